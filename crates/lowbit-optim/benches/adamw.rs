//! One AdamW step of the distributed optimizer against its byte bound, measured in the same run.
//!
//! # What is measured
//! N = 4Mi fp32 parameters on one rank (4 bf16 parameters of 1024x1024 with f32 gradients,
//! `dp = 1`, so the rank owns every element), AdamW with a fused bf16 output:
//! - `optimizer_apply`: `Optimizer::apply` of a `DistributedOptimizer` (clip factor 1): for each
//!   owned shard, the device's fused AdamW over masters, gradients and both moments, writing the
//!   bf16 parameters into the buffer — what a step costs after the gradient norm;
//! - `device_adamw`: `Device::adamw` over one 4Mi view of each (the kernel alone, no shards);
//! - `stream_bound`: the bound — a plain loop over host slices that reads the same four f32
//!   arrays and writes the same three f32 arrays and one bf16 array (`p += g`, `m += g`,
//!   `v += g`, `out = upper half of p`), i.e. the same 30 bytes per element with no arithmetic
//!   to speak of.
//!
//! # The summary
//! Medians are read back from criterion's `<criterion dir>/adamw/<id>/new/estimates.json` (only
//! files this run wrote; the directory is decided as criterion 0.7 decides it and handed to
//! criterion). Bytes: 30 per element (read p, g, m, v: 16; write p, m, v: 12, bf16 out: 2),
//! `GB/s = 30·N / t`, `bound GB/s` that of `stream_bound`, `ratio = GB/s / bound GB/s` (1.0: the
//! update streams its bytes as fast as a loop that does nothing else).
//!
//! Run with `cargo bench -p lowbit-optim --bench adamw` (about 20 s plus the build).

use lowbit_buffers::protocol::StepProtocol;
use std::hint::black_box;
use std::time::Duration;

use criterion::Throughput;
use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy,
};
use lowbit_buffers::{DataParallelBuffers, DdpConfig, Verify};
use lowbit_dev_support::rng::xorshift32_signed;
use lowbit_device::{DType, Device};
use lowbit_optim::{AdamW, DistributedOptimizer, OptimConfig, Optimizer, UpdateScope};
use lowbit_testkit::bench::{BenchRun, print_bound_table, print_load_average};
use lowbit_testkit::upload_f32;

const PARAMS: usize = 4;
const SIDE: usize = 1024;
const N: usize = PARAMS * SIDE * SIDE;
const BYTES_PER_ELEM: usize = 30;
const GROUP: &str = "adamw";
const CASES: [&str; 3] = ["optimizer_apply", "device_adamw", "stream_bound"];

fn rule() -> AdamW {
    AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

fn values(n: usize, seed: u32, scale: f32) -> Vec<f32> {
    xorshift32_signed(seed | 1, n, scale)
}

/// The bound's loop: reads four f32 arrays, writes three of them and a bf16 array.
fn stream(p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], out: &mut [u16]) {
    for ((((p, g), m), v), o) in p
        .iter_mut()
        .zip(g)
        .zip(m.iter_mut())
        .zip(v.iter_mut())
        .zip(out)
    {
        *p += *g;
        *m += *g;
        *v += *g;
        *o = (p.to_bits() >> 16) as u16;
    }
}

fn main() {
    let (run, mut c) = BenchRun::start(Duration::from_millis(500), Duration::from_secs(3));
    let mut dev = Device::cpu();
    let dev = &mut dev;

    // The distributed optimizer over one rank's buffers.
    let key = BufferKey::new(ParamStorage::Bf16, GradDType::F32, OptimizerId(0));
    let specs: Vec<ParamSpec> = (0..PARAMS)
        .map(|i| ParamSpec::new(format!("w{i}"), vec![SIDE, SIDE], key))
        .collect();
    let cfg = DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_verify(Verify::Cheap);
    let mut bufs = DataParallelBuffers::new(dev, 1, 0, specs, cfg).expect("buffers");
    let init = values(N, 1, 1.0);
    let per = SIDE * SIDE;
    bufs.initialize_all(dev, |p| init[p * per..(p + 1) * per].to_vec())
        .expect("initialize");
    let mut cb = |p: usize, r: std::ops::Range<usize>| init[p * per..][r].to_vec();
    let mut opt = DistributedOptimizer::new(
        dev,
        &bufs,
        OptimizerId(0),
        rule(),
        OptimConfig::new(1e-4),
        &mut cb,
    )
    .expect("optimizer");
    let grads = values(N, 2, 1e-2);
    bufs.zero_grad_buffer(dev).expect("zero");
    for p in 0..PARAMS {
        let dst = bufs.accumulation_view(dev, p).expect("grad view");
        dev.upload(dst, &grads[p * per..(p + 1) * per])
            .expect("upload");
    }
    assert_eq!(
        bufs.owned_shards()
            .expect("shards")
            .iter()
            .map(|s| s.param_range.len())
            .sum::<usize>(),
        N
    );

    // The same update on plain device views.
    let (dp, dg) = (upload_f32(dev, &init), upload_f32(dev, &grads));
    let dm = upload_f32(dev, &values(N, 3, 1e-3));
    let dv = upload_f32(
        dev,
        &values(N, 4, 1e-4)
            .iter()
            .map(|x| x.abs())
            .collect::<Vec<_>>(),
    );
    let dout = dev.alloc(DType::Bf16, N);

    // The bound's host arrays (touched once before timing).
    let (mut hp, hg, mut hm, mut hv) = (init.clone(), grads.clone(), vec![0f32; N], vec![0f32; N]);
    let mut hout = vec![0u16; N];

    let mut g = c.benchmark_group(GROUP);
    g.throughput(Throughput::Bytes((BYTES_PER_ELEM * N) as u64));
    g.bench_function(CASES[0], |b| {
        b.iter(|| {
            opt.begin_step();
            opt.update(dev, black_box(1.0), UpdateScope::All)
                .expect("update")
        })
    });
    let mut step = 0u64;
    g.bench_function(CASES[1], |b| {
        b.iter(|| {
            step += 1;
            let hp = lowbit_device::AdamW {
                lr: 1e-4,
                beta1: 0.9,
                beta2: 0.95,
                eps: 1e-8,
                weight_decay: 0.1,
                step,
                grad_scale: 1.0,
            };
            dev.adamw(dp, dg, dm, dv, black_box(&hp), Some(dout))
                .expect("adamw")
        })
    });
    g.bench_function(CASES[2], |b| {
        b.iter(|| stream(&mut hp, black_box(&hg), &mut hm, &mut hv, &mut hout))
    });
    g.finish();
    black_box((&hp, &hm, &hv, &hout));
    assert!(opt.steps() > 0);
    c.final_summary();
    summary(&run);
}

fn summary(run: &BenchRun) {
    let title = format!(
        "lowbit-optim AdamW over {N} fp32 elements (fused bf16 output), {BYTES_PER_ELEM} bytes \
         per element; criterion medians"
    );
    let bytes = (BYTES_PER_ELEM * N) as f64;
    if !print_bound_table(run, GROUP, (&CASES, "stream_bound"), bytes, &title) {
        return;
    }
    println!(
        "bound: a loop reading the same 4 f32 arrays and writing 3 f32 + 1 bf16 array \
         (stream_bound), same run"
    );
    print_load_average("other processes skew the numbers");
}
