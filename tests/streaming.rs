//! Streaming `lowbit quantize` / `lowbit dequantize` (issue 15, item 5).
//!
//! - The output files and the printed reports are the bytes the whole-file implementation wrote
//!   before streaming: hashes committed below were printed by that build (2547706) over inputs
//!   generated here, for every recipe and layout option. They are checked with the default
//!   chunks and with 32-row chunks (`LOWBIT_CHUNK_ELEMS=1`), so chunk boundaries fall inside
//!   every tensor, partial last chunks included.
//! - A bad header is refused before any data is read: files whose header is invalid, or valid
//!   but refused by quantize, followed by gigabytes of (sparse) data fail at once, and the child
//!   never grows by more than a few MiB; `/dev/zero` and an absurd header length are refused.
//!
//! `LOWBIT_TEST_BIN=path LOWBIT_PRINT_EXPECTED=1 cargo test --test streaming -- --nocapture`
//! prints the table of hashes for another build.

use std::ffi::{c_int, c_long};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lowbit_dev_support::rng::{XorShift64, unit24};
use lowbit_dev_support::tempdir::TempDir;
// FNV-1a 64: enough to pin bytes in a test.
use lowbit_io::fnv1a64 as fnv;

fn bin() -> String {
    std::env::var("LOWBIT_TEST_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_lowbit").to_owned())
}

/// A safetensors file of `(name, dtype, shape, bytes)`, written by hand (no metadata).
fn write_file(path: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = String::from("{");
    let mut offset = 0;
    for (i, (name, dtype, shape, data)) in tensors.iter().enumerate() {
        let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
        header += &format!(
            r#"{}"{name}":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{offset},{}]}}"#,
            if i > 0 { "," } else { "" },
            dims.join(","),
            offset + data.len()
        );
        offset += data.len();
    }
    header.push('}');
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    for (.., data) in tensors {
        bytes.extend_from_slice(data);
    }
    std::fs::write(path, bytes).unwrap();
}

/// Elements with magnitudes over several decades, and NaN, ±Inf, zeros and subnormals sprinkled
/// in (every 97th element), as f32.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = XorShift64::new(seed);
    let special = [f32::NAN, f32::INFINITY, -0.0, 1e-40, f32::NEG_INFINITY, 0.0];
    (0..n)
        .map(|i| {
            let u = unit24(r.next_u64()) - 0.5;
            if i % 97 == 13 {
                special[(i / 97) % special.len()]
            } else {
                u * 10f32.powi((i % 7) as i32 - 3)
            }
        })
        .collect()
}

fn encode(dtype: &str, v: &[f32]) -> Vec<u8> {
    match dtype {
        "F32" => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        "BF16" => v
            .iter()
            .flat_map(|&x| lowbit_formats::bf16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
        _ => v
            .iter()
            .flat_map(|&x| lowbit_formats::f16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
    }
}

/// Tensors that cross chunk boundaries in odd places: rows not a multiple of 32 or 16, more
/// than one chunk, 1D, 0-D, empty, and a copied integer tensor.
fn input(dir: &TempDir) {
    let specs: [(&str, &str, Vec<usize>); 8] = [
        ("a.big", "BF16", vec![300, 96]),
        ("b.odd", "F32", vec![3, 37, 45]),
        ("c.half", "F16", vec![257, 40]),
        ("d.bias", "BF16", vec![100]),
        ("e.scalar", "F32", vec![]),
        ("f.empty", "BF16", vec![0, 64]),
        ("g.tall", "F32", vec![161, 16]),
        ("h.step", "I64", vec![2]),
    ];
    let tensors: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = specs
        .into_iter()
        .enumerate()
        .map(|(i, (name, dtype, shape))| {
            let n: usize = shape.iter().product();
            let data = if dtype == "I64" {
                [7i64, -1].iter().flat_map(|x| x.to_le_bytes()).collect()
            } else {
                encode(dtype, &values(n, i as u64 + 1))
            };
            (name, dtype, shape, data)
        })
        .collect();
    write_file(&dir.path("in.safetensors"), &tensors);
}

/// Runs `lowbit args` in `dir` (relative paths, so reports do not depend on it); returns the
/// exit code, stdout and stderr.
fn run_in(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let o = Command::new(bin())
        .args(args)
        .current_dir(dir)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (
        o.status.code().unwrap_or(-1),
        text(o.stdout),
        text(o.stderr),
    )
}

/// Every configuration: (quantize flags, hash of quantized file, of its report, of the
/// dequantized file, of that report, of the `--dtype f32` dequantized file).
const EXPECTED: [(&str, [u64; 5]); 10] = [
    (
        "--recipe mxfp8",
        [
            0x02328ca5ef8b3d9f,
            0xbbf6b6896b2f9083,
            0x80f94d560ebaefbd,
            0xd7886c30f9dc697d,
            0x73fc138bcd53f5c4,
        ],
    ),
    (
        "--recipe mxfp8-e5m2 --2d",
        [
            0x82395e21e2eedb67,
            0xc3e34d3cf9cabfa1,
            0x92656b5fac56e0bd,
            0x9d77898ec6d7c621,
            0x62ee04b5ea178e1c,
        ],
    ),
    (
        "--recipe mxfp8 --scale-layout swizzled",
        [
            0xe6a757eb2ea2ef63,
            0x0f303fb2d1fb4d0a,
            0x80f94d560ebaefbd,
            0xeb3daaa5eddd78b9,
            0x73fc138bcd53f5c4,
        ],
    ),
    (
        "--recipe mxfp8 --copies columnwise --2d --scale-layout swizzled",
        [
            0x9b12feece2ab7d6d,
            0xa2e2b743e15fc7b9,
            0x653490df95fb36bd,
            0xef80d7b5644de819,
            0xf36f2714c73b22d6,
        ],
    ),
    (
        "--recipe mxfp8 --copies rowwise --threads 3",
        [
            0x6ef941447d83d8ec,
            0xe0eeeddf30519656,
            0x80f94d560ebaefbd,
            0xd7886c30f9dc697d,
            0x73fc138bcd53f5c4,
        ],
    ),
    (
        "--recipe nvfp4",
        [
            0x4f9df304129f4562,
            0x43bbafa5eaf768de,
            0x73e73727373194ea,
            0xb1a468770aa57f14,
            0xef6e3af312c90297,
        ],
    ),
    (
        "--recipe nvfp4 --2d",
        [
            0x5e41559e9bb8a8c4,
            0x7de3eab46d50e5e1,
            0xa4328cf8e15a3cd4,
            0xb1a468770aa57f14,
            0x700ddb6ed3f90397,
        ],
    ),
    (
        "--recipe nvfp4 --scale-layout swizzled",
        [
            0xd121fc15d304f83d,
            0x21c1136b796b634c,
            0x73e73727373194ea,
            0x3491334132e11eed,
            0xef6e3af312c90297,
        ],
    ),
    (
        "--recipe nvfp4 --copies columnwise",
        [
            0xb59f03fd5e757819,
            0xce6d11cec75a60df,
            0x80c81e030bcff9d1,
            0x9204fb2054229d9a,
            0x99e74ee023720522,
        ],
    ),
    (
        "--recipe nvfp4 --copies columnwise --2d --scale-layout swizzled",
        [
            0x1b8a24cbf7b5131f,
            0xd1de4e16b06e09e7,
            0xa4328cf8e15a3cd4,
            0x67f7f97580488a96,
            0x700ddb6ed3f90397,
        ],
    ),
];

fn hashes(dir: &TempDir, flags: &str, env: &[(&str, &str)]) -> [u64; 5] {
    let d = dir.dir();
    for f in ["q.safetensors", "back.safetensors", "back32.safetensors"] {
        let _ = std::fs::remove_file(d.join(f));
    }
    // `--all`: these hashes pin quantizing every float tensor, 1-D ones included.
    let mut args = vec!["quantize", "in.safetensors", "q.safetensors", "--all"];
    args.extend(flags.split(' '));
    let (code, q_report, err) = run_in(d, &args, env);
    assert_eq!(code, 0, "{flags}: {err}");
    let deq = ["dequantize", "q.safetensors", "back.safetensors"];
    let (code, d_report, err) = run_in(d, &deq, env);
    assert_eq!(code, 0, "{flags}: {err}");
    let deq32 = [
        "dequantize",
        "q.safetensors",
        "back32.safetensors",
        "--dtype",
        "f32",
    ];
    let (code, _, err) = run_in(d, &deq32, env);
    assert_eq!(code, 0, "{flags}: {err}");
    let file = |f: &str| fnv(&std::fs::read(d.join(f)).unwrap());
    [
        file("q.safetensors"),
        fnv(q_report.as_bytes()),
        file("back.safetensors"),
        fnv(d_report.as_bytes()),
        file("back32.safetensors"),
    ]
}

#[test]
fn outputs_and_reports_are_the_bytes_of_the_whole_file_implementation() {
    let dir = TempDir::new("stream-bytes");
    input(&dir);
    if std::env::var_os("LOWBIT_PRINT_EXPECTED").is_some() {
        for (flags, _) in EXPECTED {
            let h = hashes(&dir, flags, &[]);
            let h: Vec<String> = h.iter().map(|x| format!("0x{x:016x}")).collect();
            println!("    (\"{flags}\", [{}]),", h.join(", "));
        }
        return;
    }
    for (flags, want) in EXPECTED {
        for env in [&[][..], &[("LOWBIT_CHUNK_ELEMS", "1")][..]] {
            assert_eq!(hashes(&dir, flags, env), want, "{flags} {env:?}");
        }
    }
}

/// `struct rusage` (LP64): two timevals, then 14 longs of which `ru_maxrss` is the first.
#[repr(C)]
#[derive(Default)]
struct Rusage {
    times: [i64; 4],
    maxrss: c_long,
    rest: [c_long; 13],
}

// SAFETY: the C library's `wait4`, with the `struct rusage` layout above.
unsafe extern "C" {
    fn wait4(pid: c_int, status: *mut c_int, options: c_int, rusage: *mut Rusage) -> c_int;
}

/// Runs `lowbit args`; returns its exit code, stderr, wall time and peak RSS in KiB (Linux).
#[expect(
    clippy::zombie_processes,
    reason = "reaped by `wait4`, which also reports its peak RSS"
)]
fn run_measured(args: &[&std::ffi::OsStr]) -> (i32, String, Duration, c_long) {
    let start = Instant::now();
    let child = Command::new(bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = c_int::try_from(child.id()).unwrap();
    let (mut status, mut usage) = (0 as c_int, Rusage::default());
    // SAFETY: `pid` is our own child, reaped only here (`child` is never waited on); both
    // pointers are to live locals of the declared layout.
    let r = unsafe { wait4(pid, &mut status, 0, &mut usage) };
    let took = start.elapsed();
    assert_eq!(r, pid);
    let mut err = String::new();
    use std::io::Read;
    let mut stderr = child.stderr.unwrap();
    stderr.read_to_string(&mut err).unwrap();
    // Exited normally: the exit code; else the signal as a negative number.
    let code = if status & 0x7f == 0 {
        (status >> 8) & 0xff
    } else {
        -(status & 0x7f)
    };
    (code, err, took, usage.maxrss)
}

/// A file of `header` (as written) followed by a sparse data region of `data` bytes.
fn sparse(path: &Path, header: &str, data: u64) {
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    std::fs::write(path, &bytes).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.set_len(bytes.len() as u64 + data).unwrap();
}

const GIB: u64 = 1 << 30;

#[cfg(target_os = "linux")]
#[test]
fn bad_headers_are_refused_before_any_data_is_read() {
    let dir = TempDir::new("stream-header");
    let out = dir.path("out.safetensors");
    let eight = 8 * GIB;
    // (header, data bytes after it, what the error must say)
    // One tensor `w` of `end` bytes of `size`-byte elements.
    let w = |dtype: &str, size: u64, end: u64| {
        let n = end / size;
        format!(r#"{{"w":{{"dtype":"{dtype}","shape":[{n}],"data_offsets":[0,{end}]}}}}"#)
    };
    let cases: Vec<(String, u64, &str)> = vec![
        // Offsets that do not match dtype and shape.
        (
            r#"{"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,5]}}"#.into(),
            eight,
            "invalid shape, data type, or offset",
        ),
        // Not JSON.
        ("{\"w\":".into(), eight, "invalid JSON in header"),
        // A valid header that does not cover the data region.
        (w("BF16", 2, 1024), eight, "not a valid safetensors file"),
        // Valid, covering 8 GiB, but a dtype quantize refuses (checked before any data).
        (w("F64", 8, eight), eight, "unsupported dtype F64"),
        // Duplicate names.
        (
            r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}"#.into(),
            1,
            "`w` more than once",
        ),
    ];
    for (i, (header, data, why)) in cases.iter().enumerate() {
        let input = dir.path(&format!("in{i}.safetensors"));
        sparse(&input, header, *data);
        for sub in ["quantize", "dequantize"] {
            // `--all`: the 1-D F64 tensor of case 3 is selected, so refused (the default
            // selection would keep it and copy its 8 GiB).
            let mut args = vec![sub.as_ref(), input.as_os_str(), out.as_os_str()];
            if sub == "quantize" {
                args.push("--all".as_ref());
            }
            let (code, err, took, rss_kib) = run_measured(&args);
            assert_eq!(code, 1, "{sub} case {i}: {err}");
            // dequantize refuses a file without lowbit metadata, also before reading data.
            let why = if sub == "dequantize" && i == 3 {
                "not a lowbit-quantized file"
            } else {
                why
            };
            assert!(err.contains(why), "{sub} case {i}: {err}");
            assert!(
                took < Duration::from_secs(5),
                "{sub} case {i}: took {took:?}"
            );
            // The whole-file reader needed the 8 GiB region in memory; the header alone is a
            // few hundred bytes.
            assert!(rss_kib < 64 << 10, "{sub} case {i}: peak RSS {rss_kib} KiB");
        }
        assert!(!out.exists());
    }
    // An absurd header length, a length past the end of the file, and a device.
    let absurd = dir.path("absurd.safetensors");
    std::fs::write(&absurd, u64::MAX.to_le_bytes()).unwrap();
    let past = dir.path("past.safetensors");
    let mut bytes = 1000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    std::fs::write(&past, bytes).unwrap();
    for (input, why) in [
        (absurd.as_path(), "header too large"),
        (past.as_path(), "invalid header length"),
        (
            Path::new("/dev/zero"),
            "not a regular file (a character device)",
        ),
    ] {
        for sub in ["quantize", "dequantize"] {
            let args = [sub.as_ref(), input.as_os_str(), out.as_os_str()];
            let (code, err, took, rss_kib) = run_measured(&args);
            assert_eq!(code, 1, "{sub} {input:?}: {err}");
            assert!(err.contains(why), "{sub} {input:?}: {err}");
            assert!(
                took < Duration::from_secs(5),
                "{sub} {input:?}: took {took:?}"
            );
            assert!(
                rss_kib < 64 << 10,
                "{sub} {input:?}: peak RSS {rss_kib} KiB"
            );
        }
    }
    assert!(
        dir.entries().iter().all(|e| !e.starts_with(".lowbit-tmp-")),
        "{:?}",
        dir.entries()
    );
}

#[test]
fn a_non_finite_element_in_a_later_chunk_is_named_as_before() {
    let dir = TempDir::new("stream-nan");
    let mut v = values(100 * 32, 9);
    v.iter_mut()
        .filter(|x| !x.is_finite())
        .for_each(|x| *x = 0.5);
    v[70 * 32 + 5] = f32::NAN;
    v[90 * 32 + 1] = f32::INFINITY;
    let data = encode("F32", &v);
    write_file(
        &dir.path("in.safetensors"),
        &[("w", "F32", vec![2, 50, 32], data)],
    );
    // The whole-file implementation's message (its first non-finite element, in the original
    // shape too), whichever 32-row chunk holds it.
    let want = "error: in.safetensors: tensor `w`: non-finite value NaN at index [70, 5] (flat \
                index 2245), i.e. element [1, 20, 5] of the [2, 50, 32] tensor (--nan-policy \
                error)\n";
    for recipe in ["mxfp8", "nvfp4"] {
        let args = [
            "quantize",
            "in.safetensors",
            "q.safetensors",
            "--all",
            "--recipe",
            recipe,
            "--nan-policy",
            "error",
        ];
        let (code, _, err) = run_in(dir.dir(), &args, &[("LOWBIT_CHUNK_ELEMS", "1")]);
        assert_eq!((code, err.as_str()), (1, want), "{recipe}");
        assert_eq!(dir.entries(), ["in.safetensors"]);
    }
}
