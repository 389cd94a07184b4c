//! The bucketed gradient sync of one training step at 4 in-process ranks, against a memory copy
//! of the same gradient bytes measured in the same run.
//!
//! # What is measured
//! Each rank holds `DataParallelBuffers` of 8 bf16 parameters of 512x1024 (4Mi elements, f32
//! gradients: 16 MiB per rank), distributed-optimizer layout, buckets of 1Mi elements (4 bucket
//! groups), `Verify::Cheap`, gradients pre-divided by `1/dp`. One iteration of a sync row is what
//! a step's gradient side costs without the model:
//! - `zero_grad_buffer`;
//! - for every parameter in backward order: `accumulation_view`, `Device::copy` of a prepared f32
//!   gradient into it (the "backward" writing its gradient), and, with overlap, `register_grad_ready`
//!   (which launches each bucket group's reduce-scatter as soon as its parameters are ready);
//! - `finish_grad_sync` (launching what is left and waiting for every reduction).
//!
//! Rows:
//! - `sync_overlap`: `Overlap::GradReduce` (per-group launches during the "backward");
//! - `sync_no_overlap`: `Overlap::None` (one bucket, reduced in `finish_grad_sync`);
//! - `memcpy_4_ranks`: the bound — each of the 4 rank threads copies 16 MiB with
//!   `copy_from_slice` into an already touched buffer, concurrently;
//! - `memcpy_1_thread`: the same copy on one thread, alone, for scale.
//!
//! The rank threads are spawned once (`run_ranks`) and wait for commands; each criterion
//! `iter_custom` call sends every rank a command and an iteration count; the ranks pass a
//! barrier, run the iterations, pass a barrier, and rank 0 reports the time between the two.
//! Setup (allocation, first-batch golden counts) is never timed.
//!
//! # The summary
//! Median times are read back from criterion's `<criterion dir>/grad_sync/<id>/new/estimates.json`
//! (only files this run wrote; the directory is decided as criterion 0.7 decides it and handed to
//! criterion). Bytes are the 16 MiB of gradients per rank, counted once on both sides:
//! `GB/s = 16 MiB / t`, `bound GB/s` is that of `memcpy_4_ranks`, `ratio = GB/s / bound GB/s`
//! (1.0: the whole sync costs one copy of the gradients). The sync touches the gradient bytes
//! several times (zero, the "backward" copy, the 1/dp scale, the reduction's snapshot and
//! reduce), so a ratio well below 1 is expected; the row is there to show how far below.
//!
//! Run with `cargo bench -p lowbit-buffers --bench grad_sync` (well under a minute plus the
//! build on two cores).

use lowbit_dev_support::criterion_estimates as estimates;

use std::hint::black_box;
use std::path::Path;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant, SystemTime};

use criterion::{Criterion, SamplingMode, Throughput};
use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::{DType, Device, View};

const WORLD: usize = 4;
const PARAMS: usize = 8;
const ROWS: usize = 512;
const COLS: usize = 1024;
const ELEMS: usize = PARAMS * ROWS * COLS;
const GRAD_BYTES: usize = 4 * ELEMS;
const BUCKET: usize = 1 << 20;
const GROUP: &str = "grad_sync";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    SyncOverlap,
    SyncNoOverlap,
    Memcpy,
}

const RANK_CASES: [(&str, Kind); 3] = [
    ("sync_overlap", Kind::SyncOverlap),
    ("sync_no_overlap", Kind::SyncNoOverlap),
    ("memcpy_4_ranks", Kind::Memcpy),
];
const MEMCPY_1: &str = "memcpy_1_thread";

enum Cmd {
    Run { kind: Kind, iters: u64 },
    Stop,
}

fn specs() -> Vec<ParamSpec> {
    let key = BufferKey {
        param_storage: ParamStorage::Bf16,
        grad_dtype: GradDType::F32,
        expert: false,
        owner: OptimizerId(0),
    };
    (0..PARAMS)
        .map(|i| ParamSpec::new(format!("w{i}"), vec![ROWS, COLS], key))
        .collect()
}

fn buffers(dev: &mut Device, rank: usize, overlap: Overlap) -> DataParallelBuffers {
    let cfg = DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_overlap(overlap)
        .with_bucket_size(Some(BUCKET))
        .with_verify(Verify::Cheap);
    DataParallelBuffers::new(dev, WORLD, rank, specs(), cfg).expect("buffers")
}

/// One iteration of the gradient side of a step (see the module docs).
fn sync(dev: &mut Device, comm: &mut LocalComm, bufs: &mut DataParallelBuffers, src: &[View]) {
    let overlap = bufs.config().overlap.grad_reduce();
    bufs.zero_grad_buffer(dev).expect("zero");
    for p in (0..PARAMS).rev() {
        let dst = bufs.accumulation_view(dev, p).expect("grad view");
        dev.copy(src[p], dst).expect("copy");
        if overlap {
            bufs.register_grad_ready(dev, comm, p).expect("grad ready");
        }
    }
    bufs.finish_grad_sync(dev, comm).expect("finish");
}

fn rank_loop(
    mut comm: LocalComm,
    mut dev: Device,
    cmds: &Mutex<Receiver<Cmd>>,
    done: &Sender<Duration>,
    ready: &Barrier,
) {
    let rank = comm.rank();
    let dev = &mut dev;
    let mut overlapped = buffers(dev, rank, Overlap::GradReduce);
    let mut plain = buffers(dev, rank, Overlap::None);
    assert!(
        overlapped.num_groups() >= 4,
        "{} groups",
        overlapped.num_groups()
    );
    let src: Vec<View> = (0..PARAMS)
        .map(|p| {
            let v = dev.alloc(DType::F32, ROWS * COLS);
            let vals: Vec<f32> = (0..ROWS * COLS)
                .map(|i| ((i * 7 + p * 13 + rank) % 29) as f32 * 0.125 - 1.5)
                .collect();
            dev.upload(v, &vals).expect("upload");
            v
        })
        .collect();
    // The first batch records the golden grad-ready counts; the second runs as timed ones do.
    for _ in 0..2 {
        sync(dev, &mut comm, &mut overlapped, &src);
        sync(dev, &mut comm, &mut plain, &src);
    }
    let from = vec![0x5Au8; GRAD_BYTES];
    let mut to = vec![0u8; GRAD_BYTES];
    to.copy_from_slice(&from);
    ready.wait();
    loop {
        let cmd = cmds.lock().expect("commands").recv().expect("driver alive");
        let Cmd::Run { kind, iters } = cmd else {
            return;
        };
        comm.barrier().expect("barrier");
        let start = Instant::now();
        for _ in 0..iters {
            match kind {
                Kind::SyncOverlap => sync(dev, &mut comm, &mut overlapped, &src),
                Kind::SyncNoOverlap => sync(dev, &mut comm, &mut plain, &src),
                Kind::Memcpy => to.copy_from_slice(black_box(&from)),
            }
        }
        comm.barrier().expect("barrier");
        black_box(&to);
        if rank == 0 {
            done.send(start.elapsed()).expect("driver alive");
        }
    }
}

fn main() {
    let start = SystemTime::now();
    let dir = estimates::criterion_dir();
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .output_directory(&dir)
        .configure_from_args();
    {
        let from = vec![0x5Au8; GRAD_BYTES];
        let mut to = vec![0u8; GRAD_BYTES];
        to.copy_from_slice(&from);
        let mut g = c.benchmark_group(GROUP);
        g.throughput(Throughput::Bytes(GRAD_BYTES as u64));
        g.bench_function(MEMCPY_1, |b| {
            b.iter(|| to.copy_from_slice(black_box(&from)))
        });
        g.finish();
    }
    let (txs, rxs): (Vec<Sender<Cmd>>, Vec<Mutex<Receiver<Cmd>>>) = (0..WORLD)
        .map(|_| {
            let (tx, rx) = channel();
            (tx, Mutex::new(rx))
        })
        .unzip();
    let (done_tx, done_rx) = channel::<Duration>();
    let ready = Barrier::new(WORLD + 1);
    std::thread::scope(|s| {
        let ranks = s.spawn(|| {
            run_ranks(
                WORLD,
                GroupConfig::default().with_timeout(Duration::from_secs(300)),
                |comm, dev| {
                    let r = comm.rank();
                    rank_loop(comm, dev, &rxs[r], &done_tx, &ready)
                },
            )
        });
        ready.wait();
        let mut g = c.benchmark_group(GROUP);
        g.throughput(Throughput::Bytes(GRAD_BYTES as u64));
        // Tens of milliseconds per iteration: equal iteration counts per sample.
        g.sampling_mode(SamplingMode::Flat);
        for (id, kind) in RANK_CASES {
            g.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    for tx in &txs {
                        tx.send(Cmd::Run { kind, iters })
                            .expect("rank thread alive");
                    }
                    done_rx
                        .recv_timeout(Duration::from_secs(300))
                        .expect("rank 0 reports its time")
                })
            });
        }
        g.finish();
        for tx in &txs {
            let _ = tx.send(Cmd::Stop);
        }
        for r in ranks.join().expect("rank driver") {
            r.expect("rank thread");
        }
    });
    c.final_summary();
    summary(&dir, start);
}

fn summary(dir: &Path, since: SystemTime) {
    let median = |id: &str| estimates::median_ns(dir, GROUP, id, since);
    let Some(bound) = median("memcpy_4_ranks") else {
        println!("\n(memcpy_4_ranks, the bound, was not measured in this run: no summary)");
        return;
    };
    let gbs = |ns: f64| GRAD_BYTES as f64 / ns;
    let bound_gbs = gbs(bound);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "\nlowbit-buffers gradient sync, {WORLD} ranks on {cores} core(s), {} MiB of f32 \
         gradients per rank in {PARAMS} params, buckets of {BUCKET} elements; criterion medians",
        GRAD_BYTES >> 20
    );
    println!(
        "{:<18} {:>10} {:>9} {:>12} {:>7}",
        "op", "time", "GB/s", "bound GB/s", "ratio"
    );
    for id in [
        "sync_overlap",
        "sync_no_overlap",
        "memcpy_4_ranks",
        MEMCPY_1,
    ] {
        let Some(t) = median(id) else {
            println!("{id:<18} (not run)");
            continue;
        };
        println!(
            "{:<18} {:>7.2} ms {:>9.2} {:>12.2} {:>7.3}",
            id,
            t / 1e6,
            gbs(t),
            bound_gbs,
            gbs(t) / bound_gbs
        );
    }
    println!(
        "GB/s: gradient bytes per rank / time; bound: every rank copying its gradient bytes once \
         with copy_from_slice, concurrently (memcpy_4_ranks)"
    );
    if let Ok(load) = std::fs::read_to_string("/proc/loadavg") {
        let one_minute = load.split_whitespace().next().unwrap_or("?");
        println!("(load average {one_minute} on {cores} cores: other processes skew the numbers)");
    }
}
