//! Quantizer throughput against a plain memory copy measured in the same run: the quick
//! benchmark of this crate (`cargo bench -p lowbit-formats`, well under a minute of measuring on
//! two cores; the 4096x4096 benchmark with targets and thread scaling is the workspace's
//! `cargo bench --bench formats`).
//!
//! # What is measured
//! On one deterministic pseudo-random bf16 matrix of 2048x2048 (8 MiB, roughly unit normal),
//! with `threads = 1` and, on a machine with more cores, `threads = ` all of them:
//! - `memcpy`: `copy_from_slice` of the bf16 input into a preallocated, already touched buffer
//!   (with several threads, each copies its contiguous part concurrently): the bound;
//! - MXFP8 E4M3: rowwise, rowwise + columnwise (one pass), 2D (32x32 tile scales, both copies),
//!   each through `quantize_mxfp8` (fresh outputs allocated and dropped inside the timed region,
//!   as callers pay them), and rowwise / both through `quantize_mxfp8_into` into a tensor reused
//!   across calls (the kernel without the allocation);
//! - NVFP4: rowwise (including its global amax pass), both copies, 2D (16x16 tile scales, both
//!   copies).
//!
//! # The table
//! After criterion runs, each benchmark's median time `t` is read back from
//! `<criterion dir>/lowbit_formats_quantize/<id>/new/estimates.json` (files written by this run
//! only; see `lowbit_dev_support::criterion_estimates`). For `n` elements:
//! - `GB/s = ideal_bytes · n / t`, where `ideal_bytes` per element is what the operation must read
//!   and write at least (input read once per required pass, every output byte written once):
//!   memcpy 2 + 2; MXFP8 rowwise 2 + 1 + 1/32; MXFP8 both copies (1D or 2D) 2 + 2 + 2/32; NVFP4
//!   rowwise 2 (amax pass) + 2 + 1/2 + 1/16; NVFP4 both copies (1D or 2D) 2 (amax pass) + 2 +
//!   2·(1/2 + 1/16);
//! - `bound GB/s` = the memcpy GB/s (bytes read + written) at the same thread count;
//! - `ratio = GB/s / bound GB/s`: 1.0 means the quantizer moves its bytes as fast as a copy;
//! - `busy`: how many cores other processes kept busy on average while the benchmark ran
//!   (Linux `/proc/stat` less this process's own CPU time): well above 0 means the figures, the
//!   multi-threaded ones above all, are depressed by competition for the cores.
//!
//! The usual criterion arguments (a name filter, `--sample-size`, `--measurement-time`, …)
//! apply; `cargo test --benches` runs every benchmark once, untimed, and prints no table.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::time::Duration;

use criterion::Throughput;
use lowbit_dev_support::cpu_load::CpuTimes;
use lowbit_dev_support::rng::{GOLDEN_GAMMA, splitmix64, unit24};
use lowbit_formats::{
    Copies, Fp8Kind, Matrix, Mxfp8Config, Mxfp8Tensor, Nvfp4Config, Source, bf16, quantize_mxfp8,
    quantize_mxfp8_into, quantize_nvfp4,
};
use lowbit_testkit::bench::{BenchRun, cores};

const ROWS: usize = 2048;
const COLS: usize = 2048;
const N: usize = ROWS * COLS;
const GROUP: &str = "lowbit_formats_quantize";

/// What one benchmark runs.
#[derive(Clone, Copy)]
enum Op {
    Memcpy,
    Mxfp8 {
        copies: Copies,
        two_d: bool,
        into: bool,
    },
    Nvfp4 {
        copies: Copies,
        two_d: bool,
    },
}

/// The operations, their table labels, criterion id stems and ideal bytes per element.
fn ops() -> Vec<(Op, &'static str, &'static str, f64)> {
    let mx_row = 2.0 + 1.0 + 1.0 / 32.0;
    let mx_both = 2.0 + 2.0 + 2.0 / 32.0;
    let nv_row = 2.0 + 2.0 + 0.5 + 1.0 / 16.0;
    let nv_both = 2.0 + 2.0 + 2.0 * (0.5 + 1.0 / 16.0);
    let mx = |copies, two_d, into| Op::Mxfp8 {
        copies,
        two_d,
        into,
    };
    let nv = |copies, two_d| Op::Nvfp4 { copies, two_d };
    vec![
        (Op::Memcpy, "memcpy bf16", "memcpy", 4.0),
        (
            mx(Copies::Rowwise, false, false),
            "mxfp8 rowwise",
            "mxfp8-row",
            mx_row,
        ),
        (
            mx(Copies::Both, false, false),
            "mxfp8 row+col",
            "mxfp8-both",
            mx_both,
        ),
        (
            mx(Copies::Both, true, false),
            "mxfp8 2d row+col",
            "mxfp8-2d",
            mx_both,
        ),
        (
            mx(Copies::Rowwise, false, true),
            "mxfp8 rowwise, into",
            "mxfp8-row-into",
            mx_row,
        ),
        (
            mx(Copies::Both, false, true),
            "mxfp8 row+col, into",
            "mxfp8-both-into",
            mx_both,
        ),
        (
            nv(Copies::Rowwise, false),
            "nvfp4 rowwise (+amax)",
            "nvfp4-row",
            nv_row,
        ),
        (
            nv(Copies::Both, false),
            "nvfp4 row+col (+amax)",
            "nvfp4-both",
            nv_both,
        ),
        (
            nv(Copies::Both, true),
            "nvfp4 2d row+col",
            "nvfp4-2d",
            nv_both,
        ),
    ]
}

/// A splitmix64 stream, for a deterministic input.
fn input() -> Vec<bf16> {
    let mut s = 0x5EED_1234_ABCD_0002u64;
    let mut next = move || {
        let u = unit24(splitmix64(s));
        s = s.wrapping_add(GOLDEN_GAMMA);
        u
    };
    // The centred sum of four uniforms, scaled to unit variance.
    (0..N)
        .map(|_| bf16::from_f32(((0..4).map(|_| next()).sum::<f32>() - 2.0) * 3.0f32.sqrt()))
        .collect()
}

/// Copies `src` into `dst` with `threads` threads, each taking a contiguous part.
fn copy(src: &[bf16], dst: &mut [bf16], threads: usize) {
    if threads <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let part = src.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (d, x) in dst.chunks_mut(part).zip(src.chunks(part)) {
            s.spawn(move || d.copy_from_slice(x));
        }
    });
}

fn main() {
    let (run, mut c) = BenchRun::start(Duration::from_millis(300), Duration::from_secs(1));
    let x = input();
    let m = Matrix::new("x", ROWS, COLS, Source::Bf16(&x)).expect("shape matches");
    let mut dst = vec![bf16::ZERO; N];
    let cores = cores();
    let thread_counts: Vec<usize> = if cores > 1 { vec![1, cores] } else { vec![1] };

    let mut g = c.benchmark_group(GROUP);
    g.throughput(Throughput::Elements(N as u64));
    // Cores other processes kept busy during each benchmark, by id.
    let mut busy = BTreeMap::new();
    for &threads in &thread_counts {
        for (op, _, stem, _) in ops() {
            let id = format!("{stem}-t{threads}");
            let before = CpuTimes::now();
            match op {
                Op::Memcpy => {
                    g.bench_function(&id, |b| b.iter(|| copy(black_box(&x), &mut dst, threads)));
                }
                Op::Mxfp8 {
                    copies,
                    two_d,
                    into,
                } => {
                    let cfg = Mxfp8Config {
                        kind: Fp8Kind::E4M3,
                        copies,
                        two_d,
                        threads,
                        ..Mxfp8Config::default()
                    };
                    if into {
                        let mut out: Mxfp8Tensor = quantize_mxfp8(&m, &cfg).expect("quantizes");
                        g.bench_function(&id, |b| {
                            b.iter(|| quantize_mxfp8_into(black_box(&m), &cfg, &mut out))
                        });
                    } else {
                        g.bench_function(&id, |b| b.iter(|| quantize_mxfp8(black_box(&m), &cfg)));
                    }
                }
                Op::Nvfp4 { copies, two_d } => {
                    let cfg = Nvfp4Config {
                        copies,
                        two_d,
                        threads,
                        ..Nvfp4Config::default()
                    };
                    g.bench_function(&id, |b| b.iter(|| quantize_nvfp4(black_box(&m), &cfg)));
                }
            }
            let load = before
                .zip(CpuTimes::now())
                .and_then(|(b, a)| b.others_cores(a, cores as f64));
            busy.insert(id, load);
        }
    }
    g.finish();
    c.final_summary();

    let median = |stem: &str, threads: usize| run.median_ns(GROUP, &format!("{stem}-t{threads}"));
    let measured = |threads: usize| ops().iter().any(|o| median(o.2, threads).is_some());
    if !thread_counts.iter().any(|&t| measured(t)) {
        return; // test mode (`cargo test --benches`) or everything filtered out
    }
    println!(
        "\nlowbit-formats quantizers, {ROWS}x{COLS} bf16 in; GB/s = ideal bytes read + written / \
         median time; bound = memcpy of the input in this run, same thread count"
    );
    println!(
        "{:<32} {:>8} {:>11} {:>6} {:>10} {:>5}",
        "op", "GB/s", "bound GB/s", "ratio", "time", "busy"
    );
    for &threads in &thread_counts {
        let gbs = |stem: &str, bytes: f64| median(stem, threads).map(|t| bytes * N as f64 / t);
        let Some(bound) = gbs("memcpy", 4.0) else {
            println!("(memcpy at {threads} thread(s) not measured in this run: no ratios)");
            continue;
        };
        for (_, label, stem, bytes) in ops() {
            let (Some(t), Some(rate)) = (median(stem, threads), gbs(stem, bytes)) else {
                continue;
            };
            let load = busy
                .get(&format!("{stem}-t{threads}"))
                .copied()
                .flatten()
                .map_or("?".to_owned(), |l| format!("{l:.2}"));
            println!(
                "{:<32} {:>8.2} {:>11.2} {:>6.2} {:>7.3} ms {:>5}",
                format!("{label}, {threads} thr"),
                rate,
                bound,
                rate / bound,
                t / 1e6,
                load
            );
        }
    }
}
