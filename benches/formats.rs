//! Throughput of the `lowbit-formats` quantizers on a 4096x4096 tensor, against memory-copy
//! bandwidth measured in the same run.
//!
//! # What is measured
//! Criterion times, on one deterministic pseudo-random bf16 tensor of 4096x4096 elements
//! (roughly unit normal; an f32 copy of the same values for the f32-input case):
//! - `memcpy`: `copy_from_slice` of the 32 MiB bf16 buffer into a preallocated, already touched
//!   one, on one thread and on two (the two halves copied concurrently in `std::thread::scope`);
//! - `mxfp8`: E4M3 rowwise, rowwise+columnwise in one pass, 2D (32x32 tile scales, both copies),
//!   rowwise from f32 input, and rowwise / both copies through `quantize_mxfp8_into` into a
//!   tensor reused across calls (the same work without allocating the outputs);
//! - `nvfp4`: rowwise (including its global amax pass), both copies, 2D (16x16 tile scales, both
//!   copies);
//! - `alloc`: allocating and first-touching (one write per 4 KiB page) zeroed buffers of the
//!   output sizes of the three required quantizers, to show what page-faulting fresh outputs
//!   costs.
//!
//! Each quantizer runs with `threads = 1` and `threads = 2`. Every `quantize_*` call allocates
//! its output vectors and drops them inside the timed region, because that is what callers pay;
//! the `quantize_mxfp8_into` rows and the `alloc` rows show how much of it that is.
//!
//! # How the summary is computed
//! After the benchmarks, the median time of each benchmark is read back from criterion's
//! `<criterion dir>/<group>/<id>/new/estimates.json` (only files written by this run count), where
//! the criterion dir is `$CRITERION_HOME`, else `$CARGO_TARGET_DIR/criterion`, else the
//! `target_directory` of `cargo metadata` joined with `criterion`, else `target/criterion`, as
//! criterion itself decides (and the directory is also handed to criterion so that both agree).
//! For `n = 4096·4096` elements and median time `t`:
//! - `Gelem/s = n / t`;
//! - `GB/s = ideal_bytes · n / t`, where `ideal_bytes` per element is what the operation must
//!   read and write at least (input read once per required pass, every output byte written once):
//!   memcpy 2 + 2; MXFP8 rowwise from bf16 2 + 1 + 1/32; MXFP8 both copies (1D or 2D)
//!   2 + 2 + 2/32; MXFP8 rowwise from f32 4 + 1 + 1/32; NVFP4 rowwise 2 (amax pass) + 2 + 1/2 +
//!   1/16; NVFP4 both copies (1D or 2D) 2 (amax pass) + 2 + 2·(1/2 + 1/16);
//! - `x memcpy` = that GB/s divided by the memcpy GB/s (bytes read + written) of the same thread
//!   count;
//! - the 2-thread speedup is `t(threads = 1) / t(threads = 2)`;
//! - `busy` is how many cores other processes kept busy on average while the benchmark ran
//!   (from `/proc/stat` less this process's own CPU time): anything well above 0 means the
//!   numbers, above all the 2-thread ones, are depressed by competition for the cores;
//! - the `alloc` rows are also given as a share of the matching quantizer's 1-thread time, and
//!   each `, into` row is compared with its fresh-output counterpart at the same thread count.
//!
//! The targets (MXFP8 rowwise ≥ 1.0 Gelem/s per core, MXFP8 both copies ≥ 0.6,
//! NVFP4 rowwise ≥ 0.6, each at `threads = 1`; 2 threads ≥ 1.7x one thread) are checked and
//! printed as PASS/FAIL. The table is printed and written to
//! `<criterion dir>/lowbit-formats-summary.txt`.
//!
//! Run with `cargo bench --bench formats` (about two minutes on two cores, plus the build); the
//! usual criterion arguments (a name filter, `--sample-size`, `--measurement-time`, …) apply.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::{Duration, SystemTime};

use criterion::{Criterion, SamplingMode, Throughput};
use lowbit_dev_support::cpu_load::CpuTimes;
use lowbit_dev_support::criterion_estimates as estimates;
use lowbit_formats::mxfp8::Mxfp8Config;
use lowbit_formats::nvfp4::Nvfp4Config;
use lowbit_formats::{
    Copies, Fp8Kind, Matrix, Source, bf16, quantize_mxfp8, quantize_mxfp8_into, quantize_nvfp4,
};
use lowbit_io::SplitMix64;

const ROWS: usize = 4096;
const COLS: usize = 4096;
const N: usize = ROWS * COLS;
/// Bytes moved per element by a bf16 memcpy: read 2, write 2.
const MEMCPY_BYTES: f64 = 4.0;
/// Required 2-thread speedup over one thread.
const SPEEDUP_TARGET: f64 = 1.7;
const SUMMARY_FILE: &str = "lowbit-formats-summary.txt";

/// What one benchmark runs.
#[derive(Clone, Copy)]
enum Kernel {
    /// bf16 `copy_from_slice` into a preallocated buffer.
    Memcpy,
    /// MXFP8 of the bf16 tensor (or of its f32 copy when `f32_input`); with `reuse`, through
    /// `quantize_mxfp8_into` into the same tensor every call (no allocation, no page faults).
    Mxfp8 {
        cfg: Mxfp8Config,
        f32_input: bool,
        reuse: bool,
    },
    /// NVFP4 of the bf16 tensor.
    Nvfp4 { cfg: Nvfp4Config },
    /// Allocate zeroed buffers of these sizes (all live at once, as a quantizer's outputs are),
    /// write one byte per 4 KiB page of each, then free them.
    AllocTouch {
        sizes: &'static [usize],
        /// Label of the quantizer whose outputs these are.
        of: &'static str,
    },
}

/// One benchmark and how its summary row is computed.
struct Case {
    group: &'static str,
    /// Criterion function id (filename-safe, so the estimates path is predictable).
    id: String,
    /// Name in the summary table.
    label: &'static str,
    threads: usize,
    kernel: Kernel,
    /// Ideal bytes moved per element; `None` for rows that are not throughput rows.
    ideal_bytes: Option<f64>,
    /// Required Gelem/s (single thread), if the issue sets one.
    target_gelem: Option<f64>,
    /// Whether the issue sets targets for this operation (and so for its 2-thread speedup).
    required: bool,
}

fn mx(copies: Copies, two_d: bool, threads: usize) -> Mxfp8Config {
    Mxfp8Config {
        kind: Fp8Kind::E4M3,
        copies,
        two_d,
        threads,
        ..Mxfp8Config::default()
    }
}

fn nv(copies: Copies, two_d: bool, threads: usize) -> Nvfp4Config {
    Nvfp4Config {
        copies,
        two_d,
        threads,
        ..Nvfp4Config::default()
    }
}

/// The output vectors of MXFP8 rowwise, MXFP8 both copies and NVFP4 rowwise, in allocation order
/// (data, scales per copy).
const MX_ROW_OUT: &[usize] = &[N, N / 32];
const MX_BOTH_OUT: &[usize] = &[N, N / 32, N, N / 32];
const NV_ROW_OUT: &[usize] = &[N / 2, N / 16];
const MX_ROW: &str = "MXFP8 E4M3 rowwise";
const MX_BOTH: &str = "MXFP8 E4M3 row+col";
const NV_ROW: &str = "NVFP4 rowwise (+amax)";
/// Labels of the `quantize_mxfp8_into` rows: the quantizer's label plus this suffix.
const INTO: &str = ", into";
const MX_ROW_INTO: &str = "MXFP8 E4M3 rowwise, into";
const MX_BOTH_INTO: &str = "MXFP8 E4M3 row+col, into";

fn cases() -> Vec<Case> {
    let mx_row = 2.0 + 1.0 + 1.0 / 32.0;
    let mx_both = 2.0 + 2.0 + 2.0 / 32.0;
    let mx_row_f32 = 4.0 + 1.0 + 1.0 / 32.0;
    let nv_row = 2.0 + 2.0 + 0.5 + 1.0 / 16.0;
    let nv_both = 2.0 + 2.0 + 2.0 * (0.5 + 1.0 / 16.0);
    // (group, id stem, label, kernel for a thread count, ideal bytes, single-thread target)
    type Spec = (
        &'static str,
        &'static str,
        &'static str,
        fn(usize) -> Kernel,
        f64,
        Option<f64>,
    );
    let specs: [Spec; 10] = [
        (
            "memcpy",
            "bf16",
            "memcpy bf16 (32 MiB)",
            |_| Kernel::Memcpy,
            MEMCPY_BYTES,
            None,
        ),
        (
            "mxfp8",
            "rowwise-e4m3",
            MX_ROW,
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Rowwise, false, t),
                f32_input: false,
                reuse: false,
            },
            mx_row,
            Some(1.0),
        ),
        (
            "mxfp8",
            "both-e4m3",
            MX_BOTH,
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Both, false, t),
                f32_input: false,
                reuse: false,
            },
            mx_both,
            Some(0.6),
        ),
        (
            "nvfp4",
            "rowwise",
            NV_ROW,
            |t| Kernel::Nvfp4 {
                cfg: nv(Copies::Rowwise, false, t),
            },
            nv_row,
            Some(0.6),
        ),
        (
            "mxfp8",
            "2d-both-e4m3",
            "MXFP8 E4M3 2D row+col",
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Both, true, t),
                f32_input: false,
                reuse: false,
            },
            mx_both,
            None,
        ),
        (
            "mxfp8",
            "rowwise-e4m3-f32",
            "MXFP8 E4M3 rowwise, f32 in",
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Rowwise, false, t),
                f32_input: true,
                reuse: false,
            },
            mx_row_f32,
            None,
        ),
        (
            "nvfp4",
            "both",
            "NVFP4 row+col",
            |t| Kernel::Nvfp4 {
                cfg: nv(Copies::Both, false, t),
            },
            nv_both,
            None,
        ),
        (
            "nvfp4",
            "2d-both",
            "NVFP4 2D row+col",
            |t| Kernel::Nvfp4 {
                cfg: nv(Copies::Both, true, t),
            },
            nv_both,
            None,
        ),
        (
            "mxfp8",
            "rowwise-e4m3-into",
            MX_ROW_INTO,
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Rowwise, false, t),
                f32_input: false,
                reuse: true,
            },
            mx_row,
            None,
        ),
        (
            "mxfp8",
            "both-e4m3-into",
            MX_BOTH_INTO,
            |t| Kernel::Mxfp8 {
                cfg: mx(Copies::Both, false, t),
                f32_input: false,
                reuse: true,
            },
            mx_both,
            None,
        ),
    ];
    let mut v = Vec::new();
    for (group, stem, label, kernel, bytes, target) in specs {
        for threads in [1, 2] {
            v.push(Case {
                group,
                id: format!("{stem}-t{threads}"),
                label,
                threads,
                kernel: kernel(threads),
                ideal_bytes: Some(bytes),
                target_gelem: target.filter(|_| threads == 1),
                required: target.is_some(),
            });
        }
    }
    for (id, label, sizes, of) in [
        (
            "mxfp8-rowwise-outputs",
            "MXFP8 rowwise outputs",
            MX_ROW_OUT,
            MX_ROW,
        ),
        (
            "mxfp8-both-outputs",
            "MXFP8 row+col outputs",
            MX_BOTH_OUT,
            MX_BOTH,
        ),
        (
            "nvfp4-rowwise-outputs",
            "NVFP4 rowwise outputs",
            NV_ROW_OUT,
            NV_ROW,
        ),
    ] {
        v.push(Case {
            group: "alloc",
            id: id.to_owned(),
            label,
            threads: 1,
            kernel: Kernel::AllocTouch { sizes, of },
            ideal_bytes: None,
            target_gelem: None,
            required: false,
        });
    }
    v
}

/// Roughly standard normal: the centred sum of four uniforms in `[0, 1)` (24 random bits each),
/// scaled to unit variance.
fn normalish(g: &mut SplitMix64) -> f32 {
    let s: f32 = (0..4).map(|_| g.unit_f32()).sum();
    (s - 2.0) * 3.0f32.sqrt()
}

/// The benchmark inputs: the bf16 tensor and the same values as f32.
struct Inputs {
    bf16: Vec<bf16>,
    f32: Vec<f32>,
}

fn inputs() -> Inputs {
    let mut g = SplitMix64(0x5EED_1234_ABCD_0001);
    let bf16: Vec<bf16> = (0..N).map(|_| bf16::from_f32(normalish(&mut g))).collect();
    let f32 = bf16.iter().map(|v| v.to_f32()).collect();
    Inputs { bf16, f32 }
}

fn copy_split(src: &[bf16], dst: &mut [bf16], threads: usize) {
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let half = src.len() / 2;
    let (s0, s1) = src.split_at(half);
    let (d0, d1) = dst.split_at_mut(half);
    std::thread::scope(|s| {
        s.spawn(|| d1.copy_from_slice(s1));
        d0.copy_from_slice(s0);
    });
}

/// Allocates zeroed vectors of `sizes` (all live together), touches every page, frees them.
fn alloc_touch(sizes: &[usize]) -> usize {
    let mut bufs: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
    for v in &mut bufs {
        for b in v.iter_mut().step_by(4096) {
            *b = 1;
        }
    }
    black_box(&mut bufs);
    bufs.iter().map(Vec::len).sum()
}

fn run_case(c: &mut Criterion, inp: &Inputs, case: &Case, dst: &mut [bf16]) {
    let mut g = c.benchmark_group(case.group);
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Elements(N as u64));
    match case.kernel {
        Kernel::Memcpy => {
            g.bench_function(&case.id, |b| {
                b.iter(|| copy_split(black_box(&inp.bf16), black_box(&mut *dst), case.threads))
            });
        }
        Kernel::Mxfp8 {
            cfg,
            f32_input,
            reuse,
        } => {
            let src = if f32_input {
                Source::F32(&inp.f32)
            } else {
                Source::Bf16(&inp.bf16)
            };
            let m = Matrix::new("bench", ROWS, COLS, src).expect("shape");
            if reuse {
                let mut out = quantize_mxfp8(&m, &cfg).expect("quantize");
                g.bench_function(&case.id, |b| {
                    b.iter(|| quantize_mxfp8_into(black_box(&m), &cfg, &mut out).expect("quantize"))
                });
            } else {
                g.bench_function(&case.id, |b| {
                    b.iter(|| quantize_mxfp8(black_box(&m), &cfg).expect("quantize"))
                });
            }
        }
        Kernel::Nvfp4 { cfg } => {
            let m = Matrix::new("bench", ROWS, COLS, Source::Bf16(&inp.bf16)).expect("shape");
            g.bench_function(&case.id, |b| {
                b.iter(|| quantize_nvfp4(black_box(&m), &cfg).expect("quantize"))
            });
        }
        Kernel::AllocTouch { sizes, .. } => {
            g.throughput(Throughput::Bytes(sizes.iter().sum::<usize>() as u64));
            g.bench_function(&case.id, |b| b.iter(|| alloc_touch(black_box(sizes))));
        }
    }
    g.finish();
}

fn fmt_time(ns: f64) -> String {
    format!("{:.2} ms", ns / 1e6)
}

fn summary(cases: &[Case], times: &[Option<f64>], load: &[Option<f64>]) -> String {
    let gbps = |i: usize| -> Option<f64> { Some(cases[i].ideal_bytes? * N as f64 / times[i]?) };
    let find = |pred: &dyn Fn(&Case) -> bool| (0..cases.len()).find(|&i| pred(&cases[i]));
    let memcpy_gbps = |threads: usize| {
        find(&|c| matches!(c.kernel, Kernel::Memcpy) && c.threads == threads).and_then(gbps)
    };
    let fmt_load = |i: usize| load[i].map_or("?".to_owned(), |l| format!("{l:.2}"));
    let mut s = String::new();
    let _ = writeln!(
        s,
        "lowbit-formats throughput, {ROWS}x{COLS} bf16 ({N} elements), criterion median time per \
         call (output allocation included)\n\
         GB/s counts ideal bytes moved (input reads + output writes); x memcpy = GB/s / memcpy \
         GB/s at the same thread count;\n\
         busy = cores other processes kept busy on average while the benchmark ran (0 = quiet \
         machine).\n"
    );
    let _ = writeln!(
        s,
        "{:<27} {:>3} {:>10} {:>8} {:>6} {:>8} {:>5} {:>12} {:>6}",
        "benchmark", "thr", "time", "Gelem/s", "GB/s", "x memcpy", "busy", "target", "result"
    );
    let mut failures = 0;
    let mut missing = 0;
    for (i, case) in cases.iter().enumerate() {
        if case.ideal_bytes.is_none() {
            continue;
        }
        let Some(t) = times[i] else {
            missing += 1;
            let _ = writeln!(
                s,
                "{:<27} {:>3} {:>10}",
                case.label, case.threads, "not run"
            );
            continue;
        };
        let ge = N as f64 / t;
        let gb = gbps(i).unwrap_or(f64::NAN);
        let ratio = memcpy_gbps(case.threads).map_or(f64::NAN, |m| gb / m);
        let (target, result) = match case.target_gelem {
            Some(g) if ge >= g => (format!(">= {g:.1} Ge/s"), "PASS"),
            Some(g) => {
                failures += 1;
                (format!(">= {g:.1} Ge/s"), "FAIL")
            }
            None if case.required => ("see speedup".to_owned(), "-"),
            None => ("-".to_owned(), "info"),
        };
        let _ = writeln!(
            s,
            "{:<27} {:>3} {:>10} {:>8.3} {:>6.2} {:>8.3} {:>5} {:>12} {:>6}",
            case.label,
            case.threads,
            fmt_time(t),
            ge,
            gb,
            ratio,
            fmt_load(i),
            target,
            result
        );
    }

    let _ = writeln!(
        s,
        "\n2-thread speedup = time(threads=1) / time(threads=2); target >= {SPEEDUP_TARGET:.1}x \
         where the issue sets one"
    );
    let _ = writeln!(
        s,
        "{:<27} {:>10} {:>10} {:>8} {:>6}",
        "benchmark", "t1", "t2", "speedup", "result"
    );
    for (i, one) in cases.iter().enumerate() {
        if one.threads != 1 || one.ideal_bytes.is_none() {
            continue;
        }
        let Some(j) = find(&|c| c.label == one.label && c.threads == 2) else {
            continue;
        };
        let (Some(t1), Some(t2)) = (times[i], times[j]) else {
            continue;
        };
        let speedup = t1 / t2;
        let result = if !one.required {
            "info"
        } else if speedup >= SPEEDUP_TARGET {
            "PASS"
        } else {
            failures += 1;
            "FAIL"
        };
        let _ = writeln!(
            s,
            "{:<27} {:>10} {:>10} {:>7.2}x {:>6}",
            one.label,
            fmt_time(t1),
            fmt_time(t2),
            speedup,
            result
        );
    }

    let mut header = false;
    for (i, case) in cases.iter().enumerate() {
        let (Kernel::AllocTouch { sizes, of }, Some(t)) = (case.kernel, times[i]) else {
            continue;
        };
        if !header {
            header = true;
            let _ = writeln!(
                s,
                "\nFresh outputs: allocating zeroed Vecs of a quantizer's output sizes, writing one \
                 byte per 4 KiB page, freeing them (1 thread)"
            );
        }
        let bytes = sizes.iter().sum::<usize>() as f64;
        let share = find(&|c| c.label == of && c.threads == 1)
            .and_then(|q| times[q])
            .map_or(String::new(), |tq| {
                format!(", {:.0}% of {of} at 1 thread", 100.0 * t / tq)
            });
        let _ = writeln!(
            s,
            "{:<27} {:>10} for {:.1} MiB ({:.2} GB/s{share})",
            case.label,
            fmt_time(t),
            bytes / f64::from(1u32 << 20),
            bytes / t
        );
    }
    let mut header = false;
    for (i, case) in cases.iter().enumerate() {
        let Some(base) = case.label.strip_suffix(INTO) else {
            continue;
        };
        let Some(j) = find(&|c| c.label == base && c.threads == case.threads) else {
            continue;
        };
        let (Some(t_into), Some(t_new)) = (times[i], times[j]) else {
            continue;
        };
        if !header {
            header = true;
            let _ = writeln!(
                s,
                "\nOutputs reused (quantize_mxfp8_into) vs fresh (quantize_mxfp8): the difference is \
                 what allocating, zeroing, faulting in and freeing the outputs costs"
            );
        }
        let cost = if t_new > t_into {
            format!(
                "fresh outputs cost {:.1} ms ({:.0}% of the call)",
                (t_new - t_into) / 1e6,
                100.0 * (t_new - t_into) / t_new
            )
        } else {
            "no cost measurable (the reused run was not faster: noise?)".to_owned()
        };
        let _ = writeln!(
            s,
            "{:<27} {:>3} {:>10} vs {:>10}: {cost}",
            base,
            case.threads,
            fmt_time(t_into),
            fmt_time(t_new),
        );
    }
    let _ = writeln!(
        s,
        "\n{failures} requirement(s) failed{}",
        if missing > 0 {
            format!("; {missing} benchmark(s) not run (filtered out?)")
        } else {
            String::new()
        }
    );
    s
}

fn main() {
    let start = SystemTime::now();
    let dir = estimates::criterion_dir();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(800))
        .measurement_time(Duration::from_secs(3))
        .output_directory(&dir)
        .configure_from_args();
    let inp = inputs();
    let mut dst = vec![bf16::ZERO; N];
    let cases = cases();
    let cores = std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64);
    let mut load = Vec::with_capacity(cases.len());
    for case in &cases {
        let before = CpuTimes::now();
        run_case(&mut c, &inp, case, &mut dst);
        let after = CpuTimes::now();
        load.push(
            before
                .zip(after)
                .and_then(|(b, a)| b.others_cores(a, cores)),
        );
    }
    c.final_summary();

    let times: Vec<Option<f64>> = cases
        .iter()
        .map(|k| estimates::median_ns(&dir, k.group, &k.id, start))
        .collect();
    if times.iter().all(Option::is_none) {
        return;
    }
    let table = summary(&cases, &times, &load);
    println!("\n{table}");
    let path = dir.join(SUMMARY_FILE);
    match std::fs::write(&path, &table) {
        Ok(()) => println!("summary written to {}", path.display()),
        Err(e) => eprintln!("could not write {}: {e}", path.display()),
    }
}
