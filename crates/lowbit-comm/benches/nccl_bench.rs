//! NCCL all-gather and reduce-scatter through `NcclComm` on two GPUs (one thread each), bf16,
//! f32 and bytes, 1 MiB to 1 GiB: time per launch and bus bandwidth, as nccl-tests count them.
//! `benches/torch_collectives.py` measures `torch.distributed` the same way, for the same run.
//!
//! `nccl_bench [--json PATH] [--min-mib N] [--max-mib N] [--gpus N]`
//!
//! Size is the large buffer (all-gather output, reduce-scatter input). Each size: 5 warm-up
//! launches, then 3 trials of `clamp(4 GiB / size, 10, 400)` back-to-back launches timed with
//! CUDA events on the device stream (each launch `start_*` + `wait`, so the device stream waits
//! for every one); the median trial counts. algbw = size / time; busbw = algbw · (n − 1) / n.

use std::time::Duration;

use lowbit_comm::Communicator;
use lowbit_comm::nccl::{NcclConfig, run_local_ranks_with};
use lowbit_dev_support::cli::bounded_or_exit;
use lowbit_device::cudarc::driver::sys::CUevent_flags;
use lowbit_device::{DType, Device, View};

const MIB: usize = 1 << 20;

#[derive(Clone, Copy, Debug)]
enum Kind {
    AllGather,
    ReduceScatter,
}

struct Case {
    kind: Kind,
    dtype: DType,
    bytes: usize,
}

fn iters(bytes: usize) -> usize {
    ((4usize << 30) / bytes).clamp(10, 400)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let num = |name: &str, default: usize, range| {
        flag(name).map_or(default, |v| bounded_or_exit("nccl_bench", name, &v, range))
    };
    // Up to 64 GiB a collective (`max_mib` doubles up to it: an absurd value wrapped and looped).
    let min_mib = num("--min-mib", 1, 1..=65536);
    let max_mib = num("--max-mib", 1024, 1..=65536);
    let gpus = num("--gpus", 2, 1..=64);
    let json = flag("--json");

    let mut sizes = Vec::new();
    let mut mib = min_mib.max(1);
    while mib <= max_mib {
        sizes.push(mib * MIB);
        mib *= 2;
    }
    let mut cases = Vec::new();
    for (kind, dtype) in [
        (Kind::AllGather, DType::Bf16),
        (Kind::AllGather, DType::U8),
        (Kind::ReduceScatter, DType::Bf16),
        (Kind::ReduceScatter, DType::F32),
    ] {
        for &bytes in &sizes {
            cases.push(Case { kind, dtype, bytes });
        }
    }
    let max = *sizes.last().expect("at least one size");
    let cfg = NcclConfig::default().with_timeout(Duration::from_secs(120));
    let per_rank = run_local_ranks_with(gpus, cfg, |mut comm, mut dev| {
        run_rank(&mut comm, &mut dev, &cases, max)
    })
    .unwrap_or_else(|e| panic!("NCCL setup: {e}"));
    let per_rank: Vec<Vec<f64>> = per_rank
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();

    let card = Device::cuda(0)
        .ok()
        .and_then(|d| {
            d.cuda_stream()
                .map(|s| s.context().name().unwrap_or_default())
        })
        .unwrap_or_default();
    println!(
        "{:<15} {:>5} {:>10} {:>12} {:>12} {:>12}",
        "op", "dtype", "size MiB", "time us", "algbw GB/s", "busbw GB/s"
    );
    let mut rows = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        // The slowest rank's time (the ranks run in lockstep; they differ by launch skew).
        let secs = per_rank.iter().map(|t| t[i]).fold(0.0, f64::max);
        let algbw = c.bytes as f64 / secs / 1e9;
        let busbw = algbw * (gpus - 1) as f64 / gpus as f64;
        let op = match c.kind {
            Kind::AllGather => "all_gather",
            Kind::ReduceScatter => "reduce_scatter",
        };
        println!(
            "{op:<15} {:>5} {:>10} {:>12.1} {:>12.1} {:>12.1}",
            c.dtype.name(),
            c.bytes / MIB,
            secs * 1e6,
            algbw,
            busbw
        );
        rows.push(format!(
            "{{\"op\":\"{op}\",\"dtype\":\"{}\",\"bytes\":{},\"time_us\":{:.3},\"algbw_gbs\":{:.3},\"busbw_gbs\":{:.3}}}",
            c.dtype.name(),
            c.bytes,
            secs * 1e6,
            algbw,
            busbw
        ));
    }
    let nccl = lowbit_comm::nccl::nccl_version()
        .map_or_else(|_| "?".to_string(), |(a, b, c)| format!("{a}.{b}.{c}"));
    println!("NCCL {nccl}");
    if let Some(path) = json {
        let text = format!(
            "{{\"impl\":\"lowbit NcclComm (NCCL {})\",\"card\":\"{}\",\"gpus\":{gpus},\"results\":[\n{}\n]}}\n",
            nccl,
            card.replace('"', "'"),
            rows.join(",\n")
        );
        std::fs::write(&path, text).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

/// Times every case on this rank; seconds per launch, in case order.
fn run_rank(comm: &mut dyn Communicator, dev: &mut Device, cases: &[Case], max: usize) -> Vec<f64> {
    let r = comm.rank();
    let n = comm.size();
    let big = dev.alloc(DType::F32, max / 4);
    let small = dev.alloc(DType::F32, max / 4 / n);
    // Not zeros: fill both with ordinary values (their bytes serve every dtype).
    dev.fill(big, 0.3 + r as f32).expect("fill");
    dev.fill(small, 1.7 + r as f32).expect("fill");
    let stream = dev.cuda_stream().expect("a CUDA device").clone();
    let ctx = stream.context().clone();
    let start = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let end = ctx
        .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
        .expect("event");
    let view = |v: View, dtype: DType, bytes: usize| -> View {
        let v = v.reinterpret(dtype).expect("reinterpret");
        v.slice(0..bytes / dtype.size()).expect("slice")
    };
    let mut out = Vec::new();
    for c in cases {
        let large = view(big, c.dtype, c.bytes);
        let part = view(small, c.dtype, c.bytes / n);
        let mut launch = |dev: &mut Device| {
            let work = match c.kind {
                Kind::AllGather => comm.start_all_gather(dev, part, large),
                Kind::ReduceScatter => {
                    comm.start_reduce_scatter(dev, large, part, lowbit_comm::ReduceOp::Sum)
                }
            }
            .expect("launch");
            work.wait(dev).expect("wait");
        };
        for _ in 0..5 {
            launch(dev);
        }
        dev.synchronize().expect("sync");
        let k = iters(c.bytes);
        let mut trials = Vec::new();
        for _ in 0..3 {
            start.record(&stream).expect("record");
            for _ in 0..k {
                launch(dev);
            }
            end.record(&stream).expect("record");
            let ms = start.elapsed_ms(&end).expect("elapsed");
            trials.push(f64::from(ms) / 1e3 / k as f64);
        }
        trials.sort_by(f64::total_cmp);
        out.push(trials[1]);
        comm.barrier().expect("barrier");
    }
    out
}
