//! Throughput of the in-process all-gather and reduce-scatter on 4 ranks, against a memory copy of
//! the same bytes measured in the same run.
//!
//! # What is measured
//! - `memcpy`: `Device::copy` of a 16 MiB buffer into another (already touched) one, on one
//!   thread.
//! - `all_gather_{f32,bf16}`: 4 ranks, each all-gathering its 4 MiB shard in place into its 16 MiB
//!   bucket (Megatron's form: the input is the rank's slice of the output).
//! - `reduce_scatter_{f32,bf16}`: 4 ranks, each reduce-scattering (sum) its 16 MiB bucket in place
//!   into its 4 MiB shard.
//! - `barrier`: a bare barrier of the 4 ranks, to show what the per-iteration barrier costs.
//!
//! The rank threads are spawned once (with `run_ranks`, through `lowbit_testkit::bench`'s rank
//! pool) and wait for commands; each criterion `iter_custom` call sends every rank an iteration
//! count, the ranks pass a barrier, then each iteration runs the blocking collective followed by
//! a barrier, a closing barrier follows the last, and rank 0 reports the time from the first
//! barrier to the end of the closing one. Thread spawning is never timed.
//!
//! # Byte convention
//! Bytes are counted once per payload byte, for both sides of the ratio: a collective moves its
//! NCCL "algorithm bytes" per rank (all-gather: output bytes, reduce-scatter: input bytes, here
//! 16 MiB), and `memcpy` moves the bytes it copies (16 MiB; reading and writing them is not
//! counted twice). With median times `t`:
//! - `GB/s per rank = 16 MiB / t`;
//! - `GB/s all ranks = 4 · 16 MiB / t` (what the machine moved in total);
//! - `x memcpy` = the all-ranks GB/s divided by the memcpy GB/s: 1.0 means the 4 ranks together
//!   moved payload as fast as one thread copies memory. On a machine with fewer cores than ranks
//!   the ranks share the cores, so the per-rank figure is bounded by cores / 4 of that.
//!
//! After the benchmarks the medians are read back from criterion's
//! `<criterion dir>/comm/<id>/new/estimates.json` (files written by this run only; the directory
//! is decided as criterion 0.7 decides it and handed to criterion) and a table is printed.
//!
//! Run with `cargo bench -p lowbit-comm --bench collectives` (well under a minute).

use std::time::Duration;

use criterion::Throughput;
use lowbit_comm::{Communicator, GroupConfig, LocalComm, ReduceOp};
use lowbit_device::{DType, Device, View};
use lowbit_testkit::bench::{BenchRun, cores, with_rank_pool};

const WORLD: usize = 4;
/// Per-rank all-gather output and reduce-scatter input.
const BYTES: usize = 16 << 20;
const GROUP: &str = "comm";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Memcpy,
    AllGather(DType),
    ReduceScatter(DType),
    Barrier,
}

struct Case {
    id: &'static str,
    kind: Kind,
}

const CASES: [Case; 6] = [
    Case {
        id: "memcpy",
        kind: Kind::Memcpy,
    },
    Case {
        id: "all_gather_f32",
        kind: Kind::AllGather(DType::F32),
    },
    Case {
        id: "all_gather_bf16",
        kind: Kind::AllGather(DType::Bf16),
    },
    Case {
        id: "reduce_scatter_f32",
        kind: Kind::ReduceScatter(DType::F32),
    },
    Case {
        id: "reduce_scatter_bf16",
        kind: Kind::ReduceScatter(DType::Bf16),
    },
    Case {
        id: "barrier",
        kind: Kind::Barrier,
    },
];

/// One rank's 16 MiB buckets, one per dtype.
struct Buckets {
    f32: View,
    bf16: View,
}

/// One rank's setup: allocates and fills its buckets.
fn setup(comm: &mut LocalComm, dev: &mut Device) -> Buckets {
    let r = comm.rank();
    let mut bucket = |dtype: DType| -> View {
        let n = BYTES / dtype.size();
        let v = dev.alloc(dtype, n);
        let vals: Vec<f32> = (0..n).map(|i| ((i + r) % 7) as f32 * 0.25).collect();
        match dtype {
            DType::F32 => dev.upload(v, &vals).unwrap(),
            _ => {
                let b: Vec<lowbit_device::bf16> = vals
                    .iter()
                    .map(|&x| lowbit_device::bf16::from_f32(x))
                    .collect();
                dev.upload(v, &b).unwrap();
            }
        }
        v
    };
    Buckets {
        f32: bucket(DType::F32),
        bf16: bucket(DType::Bf16),
    }
}

/// One timed iteration: the blocking collective, then a barrier.
fn step(buckets: &mut Buckets, comm: &mut LocalComm, dev: &mut Device, kind: Kind) {
    let r = comm.rank();
    let shard = |b: View| {
        let n = b.len() / WORLD;
        b.slice(r * n..(r + 1) * n).unwrap()
    };
    match kind {
        Kind::AllGather(dtype) | Kind::ReduceScatter(dtype) => {
            let b = if dtype == DType::F32 {
                buckets.f32
            } else {
                buckets.bf16
            };
            if matches!(kind, Kind::AllGather(_)) {
                comm.all_gather(dev, shard(b), b).unwrap();
            } else {
                comm.reduce_scatter(dev, b, shard(b), ReduceOp::Sum)
                    .unwrap();
            }
        }
        Kind::Barrier | Kind::Memcpy => {}
    }
    comm.barrier().unwrap();
}

fn main() {
    let (run, mut c) = BenchRun::start(Duration::from_millis(500), Duration::from_secs(2));

    {
        let mut dev = Device::cpu();
        let src = dev.alloc(DType::U8, BYTES);
        let dst = dev.alloc(DType::U8, BYTES);
        dev.copy(src, dst).unwrap();
        let mut g = c.benchmark_group(GROUP);
        g.throughput(Throughput::Bytes(BYTES as u64));
        g.bench_function(CASES[0].id, |b| b.iter(|| dev.copy(src, dst).unwrap()));
        g.finish();
    }

    // The ranks' setup (allocating and filling their buckets) finishes before any timing.
    let timeout = Duration::from_secs(120);
    with_rank_pool(
        WORLD,
        GroupConfig::default(),
        timeout,
        setup,
        step,
        |pool| {
            let mut g = c.benchmark_group(GROUP);
            for case in &CASES[1..] {
                g.throughput(match case.kind {
                    Kind::Barrier => Throughput::Elements(1),
                    _ => Throughput::Bytes(BYTES as u64),
                });
                pool.bench(&mut g, case.id, case.kind);
            }
            g.finish();
        },
    );
    c.final_summary();
    summary(&run);
}

fn summary(run: &BenchRun) {
    let median = |id: &str| run.median_ns(GROUP, id);
    let Some(memcpy) = median("memcpy") else {
        println!("(memcpy baseline not run: no summary)");
        return;
    };
    let gbs = |ns: f64, bytes: f64| bytes / ns; // bytes per ns = GB/s
    let memcpy_gbs = gbs(memcpy, BYTES as f64);
    println!(
        "\nlowbit-comm in-process collectives, {WORLD} ranks on {} core(s), 16 MiB per rank \
         (all-gather output / reduce-scatter input), in place; criterion medians",
        cores()
    );
    println!(
        "{:<22} {:>10} {:>14} {:>15} {:>9}",
        "benchmark", "time", "GB/s per rank", "GB/s all ranks", "x memcpy"
    );
    println!(
        "{:<22} {:>10} {:>14} {:>15.2} {:>9}",
        "memcpy (1 thread)",
        fmt_time(memcpy),
        "-",
        memcpy_gbs,
        "1.00"
    );
    for case in &CASES[1..] {
        let Some(t) = median(case.id) else {
            println!("{:<22} (not run)", case.id);
            continue;
        };
        if case.kind == Kind::Barrier {
            println!("{:<22} {:>10}", case.id, fmt_time(t));
            continue;
        }
        let per_rank = gbs(t, BYTES as f64);
        let all = per_rank * WORLD as f64;
        println!(
            "{:<22} {:>10} {:>14.2} {:>15.2} {:>9.2}",
            case.id,
            fmt_time(t),
            per_rank,
            all,
            all / memcpy_gbs
        );
    }
    println!(
        "bytes: each payload byte counted once (collective: NCCL algorithm bytes per rank; memcpy: \
         bytes copied); each collective iteration includes one barrier (see the barrier row)"
    );
}

fn fmt_time(ns: f64) -> String {
    if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.1} us", ns / 1e3)
    }
}
