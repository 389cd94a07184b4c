//! Byte-mutation fuzzing of the file readers (issue 15, item 6): `lowbit quantize` and
//! `lowbit dequantize` are run on mutated copies of valid inputs — a plain safetensors file and a
//! lowbit-quantized one (MXFP8 and NVFP4, with lowbit's metadata) — and must never panic, abort,
//! hang or leave a temporary file: every run ends with exit status 0 or a clear error (exit 1 or 2),
//! within a time bound, and an output exists only when it succeeded.
//!
//! The mutations are deterministic (seeded), so a failure reproduces; `LOWBIT_FUZZ_CASES` raises
//! the number of cases per input (CI runs the default budget). A crash found here becomes its own
//! regression test.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lowbit_dev_support::rng::XorShift64;
use lowbit_dev_support::tempdir::TempDir;

const BIN: &str = env!("CARGO_BIN_EXE_lowbit");

/// Per-run time bound: these inputs are a few KiB, so anything slower is a hang.
const RUN_LIMIT: Duration = Duration::from_secs(20);

fn cases() -> u32 {
    lowbit_dev_support::fuzz_cases(40)
}

/// Names in `dir` other than `keep`.
fn others(dir: &TempDir, keep: &[&Path]) -> Vec<String> {
    std::fs::read_dir(dir.dir())
        .expect("read scratch dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| !keep.contains(&p.as_path()))
        .map(|p| p.display().to_string())
        .collect()
}

/// Runs `lowbit args…` with a time bound; returns the exit code and stderr. Panics (the test
/// failure) on a signal, a panic exit (101) or a timeout.
fn run_bounded(args: &[&str], what: &str) -> (i32, String) {
    let start = Instant::now();
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn lowbit");
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            let code = status
                .code()
                .unwrap_or_else(|| panic!("{what}: killed by a signal ({status:?})\n{err}"));
            assert_ne!(code, 101, "{what}: panicked\n{err}");
            assert!(
                matches!(code, 0..=2),
                "{what}: unexpected exit {code}\n{err}"
            );
            return (code, err);
        }
        if start.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            panic!("{what}: still running after {RUN_LIMIT:?} (a hang)");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// One mutation of `base`: bit flips, byte overwrites with interesting values, truncation,
/// extension, or an edit inside the JSON header (where most parsing happens).
fn mutate(base: &[u8], rng: &mut XorShift64) -> Vec<u8> {
    let mut v = base.to_vec();
    let header_end = 8 + u64::from_le_bytes(base[..8].try_into().expect("8 bytes")) as usize;
    let pick = |rng: &mut XorShift64, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    match rng.next_u64() % 7 {
        0 => {
            for _ in 0..1 + pick(rng, 8) {
                let i = pick(rng, v.len());
                v[i] ^= 1 << pick(rng, 8);
            }
        }
        1 => {
            // Interesting bytes: NaN/sign patterns for scales and amaxes, 0xFF E8M0, zeros.
            const SPECIAL: [u8; 8] = [0x00, 0xFF, 0x7F, 0x80, 0x7C, 0xFE, 0x01, 0xC0];
            for _ in 0..1 + pick(rng, 16) {
                let i = header_end + pick(rng, v.len() - header_end);
                if i < v.len() {
                    v[i] = SPECIAL[pick(rng, SPECIAL.len())];
                }
            }
        }
        2 => v.truncate(pick(rng, v.len())),
        3 => {
            let extra = 1 + pick(rng, 64);
            v.extend((0..extra).map(|_| rng.next_u64() as u8));
        }
        4 => {
            // The header length itself.
            let bogus = match rng.next_u64() % 4 {
                0 => 0u64,
                1 => u64::MAX,
                2 => (v.len() as u64).saturating_add(1 + rng.next_u64() % 100),
                _ => rng.next_u64() % (v.len() as u64 + 1),
            };
            v[..8].copy_from_slice(&bogus.to_le_bytes());
        }
        5 => {
            // A character of the JSON header replaced by a structural one.
            const JSON: &[u8] = b"{}[]\",:0123456789-e.\\ ";
            for _ in 0..1 + pick(rng, 4) {
                let i = 8 + pick(rng, header_end - 8);
                v[i] = JSON[pick(rng, JSON.len())];
            }
        }
        _ => {
            // Digits in the header (shapes, offsets) made huge or negative.
            let header = &mut v[8..header_end];
            let digits: Vec<usize> = (0..header.len())
                .filter(|&i| header[i].is_ascii_digit())
                .collect();
            if !digits.is_empty() {
                let i = digits[pick(rng, digits.len())];
                header[i] = b'9';
                if i > 0 && header[i - 1].is_ascii_digit() {
                    header[i - 1] = b'9';
                }
            }
        }
    }
    v
}

/// Fuzzes `command` (`quantize` or `dequantize`) on mutations of `valid`.
fn fuzz(tag: &str, valid: &[u8], command: &str, extra: &[&str]) {
    let dir = TempDir::new(&format!("fuzz-{tag}"));
    let input = dir.path("in.safetensors");
    let output = dir.path("out.safetensors");
    let mut rng = XorShift64::new(0x5eed_0000 + tag.len() as u64);
    let mut refused = 0;
    for case in 0..cases() {
        let bytes = mutate(valid, &mut rng);
        std::fs::write(&input, &bytes).expect("write input");
        let _ = std::fs::remove_file(&output);
        let what = format!("{tag} case {case} ({} bytes)", bytes.len());
        let (i, o) = (
            input.to_str().expect("utf-8"),
            output.to_str().expect("utf-8"),
        );
        let mut args = vec![command, i, o];
        args.extend_from_slice(extra);
        let (code, err) = run_bounded(&args, &what);
        if code == 0 {
            assert!(output.exists(), "{what}: success without an output");
        } else {
            refused += 1;
            assert!(!output.exists(), "{what}: failed but left an output");
            assert!(!err.trim().is_empty(), "{what}: failed silently");
        }
        let stray = others(&dir, &[input.as_path(), output.as_path()]);
        assert!(stray.is_empty(), "{what}: left {stray:?}");
    }
    // The harness must exercise the error paths, not only mutations that change nothing.
    assert!(refused > 0, "{tag}: no mutation was refused");
}

/// A valid safetensors file of mixed float tensors (written by hand: the header is JSON).
fn valid_input() -> Vec<u8> {
    let mut rng = XorShift64::new(7);
    let tensors: [(&str, &str, Vec<usize>, usize); 3] = [
        ("a.weight", "F32", vec![32, 64], 4),
        ("b.weight", "BF16", vec![16, 32], 2),
        ("c.bias", "F16", vec![48], 2),
    ];
    let (mut header, mut data) = (Vec::new(), Vec::new());
    for (name, dtype, shape, size) in &tensors {
        let n: usize = shape.iter().product();
        let start = data.len();
        for _ in 0..n {
            // Small finite values in every dtype: the low bytes random, the exponent tamed.
            let x = (rng.next_u64() % 2000) as f32 / 1000.0 - 1.0;
            match *size {
                4 => data.extend(x.to_le_bytes()),
                _ if *dtype == "BF16" => data.extend(((x.to_bits() >> 16) as u16).to_le_bytes()),
                _ => data.extend(half::f16::from_f32(x).to_bits().to_le_bytes()),
            }
        }
        header.push(format!(
            "\"{name}\":{{\"dtype\":\"{dtype}\",\"shape\":{shape:?},\"data_offsets\":[{start},{}]}}",
            data.len()
        ));
    }
    let json = format!("{{{}}}", header.join(","));
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json.as_bytes());
    out.extend(data);
    out
}

/// The valid input quantized by `lowbit quantize --recipe recipe`.
fn quantized(recipe: &str) -> Vec<u8> {
    let dir = TempDir::new(&format!("fuzz-base-{recipe}"));
    let (input, output) = (dir.path("in.safetensors"), dir.path("out.safetensors"));
    std::fs::write(&input, valid_input()).expect("write input");
    let (i, o) = (
        input.to_str().expect("utf-8"),
        output.to_str().expect("utf-8"),
    );
    let (code, err) = run_bounded(&["quantize", i, o, "--all", "--recipe", recipe], "base");
    assert_eq!(code, 0, "the valid base input must quantize: {err}");
    std::fs::read(&output).expect("read output")
}

#[test]
fn quantize_survives_mutated_inputs() {
    fuzz(
        "quantize",
        &valid_input(),
        "quantize",
        &["--all", "--recipe", "mxfp8"],
    );
}

#[test]
fn dequantize_survives_mutated_mxfp8_files() {
    fuzz("dequant-mxfp8", &quantized("mxfp8"), "dequantize", &[]);
}

#[test]
fn dequantize_survives_mutated_nvfp4_files() {
    fuzz("dequant-nvfp4", &quantized("nvfp4"), "dequantize", &[]);
}
