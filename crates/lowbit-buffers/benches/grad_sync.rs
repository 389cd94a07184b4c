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

use lowbit_buffers::protocol::StepProtocol;
use std::hint::black_box;
use std::time::Duration;

use criterion::{SamplingMode, Throughput};
use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Overlap, Verify};
use lowbit_comm::{Communicator, GroupConfig, LocalComm};
use lowbit_device::{DType, Device, View};
use lowbit_testkit::bench::{
    BenchRun, cores, print_bound_table, print_load_average, with_rank_pool,
};

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

fn specs() -> Vec<ParamSpec> {
    let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(0));
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

/// One rank's state: buffers with and without overlap, the "backward"'s prepared gradients,
/// and the memcpy bound's host buffers.
struct Rank {
    overlapped: DataParallelBuffers,
    plain: DataParallelBuffers,
    src: Vec<View>,
    from: Vec<u8>,
    to: Vec<u8>,
}

fn setup(comm: &mut LocalComm, dev: &mut Device) -> Rank {
    let rank = comm.rank();
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
        sync(dev, comm, &mut overlapped, &src);
        sync(dev, comm, &mut plain, &src);
    }
    let from = vec![0x5Au8; GRAD_BYTES];
    let mut to = vec![0u8; GRAD_BYTES];
    to.copy_from_slice(&from);
    Rank {
        overlapped,
        plain,
        src,
        from,
        to,
    }
}

fn step(r: &mut Rank, comm: &mut LocalComm, dev: &mut Device, kind: Kind) {
    match kind {
        Kind::SyncOverlap => sync(dev, comm, &mut r.overlapped, &r.src),
        Kind::SyncNoOverlap => sync(dev, comm, &mut r.plain, &r.src),
        Kind::Memcpy => {
            r.to.copy_from_slice(black_box(&r.from));
            black_box(&r.to);
        }
    }
}

fn main() {
    let (run, mut c) = BenchRun::start(Duration::from_millis(500), Duration::from_secs(3));
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
    let timeout = Duration::from_secs(300);
    let config = GroupConfig::default().with_timeout(timeout);
    with_rank_pool(WORLD, config, timeout, setup, step, |pool| {
        let mut g = c.benchmark_group(GROUP);
        g.throughput(Throughput::Bytes(GRAD_BYTES as u64));
        // Tens of milliseconds per iteration: equal iteration counts per sample.
        g.sampling_mode(SamplingMode::Flat);
        for (id, kind) in RANK_CASES {
            pool.bench(&mut g, id, kind);
        }
        g.finish();
    });
    c.final_summary();
    summary(&run);
}

fn summary(run: &BenchRun) {
    let title = format!(
        "lowbit-buffers gradient sync, {WORLD} ranks on {} core(s), {} MiB of f32 gradients per \
         rank in {PARAMS} params, buckets of {BUCKET} elements; criterion medians",
        cores(),
        GRAD_BYTES >> 20
    );
    let ids = [
        "sync_overlap",
        "sync_no_overlap",
        "memcpy_4_ranks",
        MEMCPY_1,
    ];
    let bytes = GRAD_BYTES as f64;
    if !print_bound_table(run, GROUP, (&ids, "memcpy_4_ranks"), bytes, &title) {
        return;
    }
    println!(
        "GB/s: gradient bytes per rank / time; bound: every rank copying its gradient bytes once \
         with copy_from_slice, concurrently (memcpy_4_ranks)"
    );
    print_load_average("other processes skew the numbers");
}
