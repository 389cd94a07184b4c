//! The one helper the data-parallel integration tests go through: [`train`] runs the test model
//! on N rank threads with a given configuration and returns each rank's losses, gradient
//! digests, grad norms, fp32 masters and final weight bytes.

#![allow(dead_code)] // each test file uses part of the harness

use std::time::Duration;

use lowbit::buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingPlan,
    ShardingStrategy,
};
use lowbit::buffers::{
    ComputeFormat, DataParallelBuffers, DdpConfig, GradAccumulation, Hooks, Mxfp8Gather, Overlap,
    PrecisionPolicy, Usage, Verify,
};
use lowbit::comm::{Communicator, GroupConfig, run_ranks};
use lowbit::device::{DType, Device};
use lowbit::model::{Mlp, MlpShape, sample};
use lowbit::optim::{
    AdamW, ChainedOptimizer, DistributedOptimizer, MasterShard, OptimConfig, Optimizer, Sgd,
    Trainer, init_from_full,
};

/// Matrix dimensions are multiples of 16 so that NVFP4's 16x16 tiles cover them; 40 columns
/// would leave MXFP8 blocks partial, which `props.rs` in `lowbit-formats` covers.
pub const SHAPE: MlpShape = MlpShape {
    input: 32,
    hidden: 48,
    blocks: 2,
    output: 16,
};

/// How weight matrices are computed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// bf16 weights as stored.
    Bf16,
    /// `Q(bf16)` MXFP8 weights (dequantized rowwise for the forward, columnwise for the
    /// backward).
    Mxfp8,
    /// `Q(bf16)` 2D NVFP4 weights (likewise).
    Nvfp4,
    /// `Q(bf16)` 2D (32x32) MXFP8 weights; with parameter gather on they travel as fp8 bytes
    /// (the direct path) instead of bf16 staging.
    Mxfp8Direct,
}

/// Where the ranks of a run live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestDevice {
    /// Threads on the CPU backend, the in-process group between them.
    Cpu,
    /// One GPU per rank, NCCL between them (the `cuda` feature; the GPU matrix).
    Cuda,
}

#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub dp: usize,
    pub device: TestDevice,
    pub ddp: DdpConfig,
    pub grad: GradDType,
    pub precision: Precision,
    /// Low-precision primary weights gathered through the staging view (`Mxfp8` only); off
    /// means bf16 parameters quantized on the fly for compute.
    pub param_gather: bool,
    pub microbatches: usize,
    /// Rows per rank per microbatch.
    pub rows: usize,
    pub steps: usize,
    pub clip: Option<f32>,
    /// Put biases and norms under a second optimizer (a chained optimizer of two owners).
    pub chained: bool,
    /// `(step, rank)` whose first input sample is made NaN.
    pub poison: Option<(usize, usize)>,
    /// Run a forced sync plus an eval forward after these steps.
    pub eval_after: &'static [usize],
    /// Run a forced sync after every step.
    pub force_sync_every_step: bool,
    /// Owner 0 (the matrices' AdamW) owns whole parameters (the layer-wise plan rule).
    pub layerwise: bool,
}

impl Run {
    pub fn new(dp: usize) -> Run {
        Run {
            dp,
            device: TestDevice::Cpu,
            ddp: ddp(true, true, true, Some(600)),
            grad: GradDType::F32,
            precision: Precision::Bf16,
            param_gather: false,
            microbatches: 2,
            rows: 4,
            steps: 6,
            clip: None,
            chained: true,
            poison: None,
            eval_after: &[],
            force_sync_every_step: false,
            layerwise: false,
        }
    }
}

/// The buffers' configuration from Megatron's four knobs; every check runs (also in release).
///
/// # Panics
/// For overlapped param gather without overlapped grad reduce (not expressible).
pub fn ddp(
    distopt: bool,
    overlap_grad: bool,
    overlap_param: bool,
    bucket: Option<usize>,
) -> DdpConfig {
    DdpConfig::default()
        .with_sharding(if distopt {
            ShardingStrategy::Distributed
        } else {
            ShardingStrategy::Replicated
        })
        .with_overlap(Overlap::from_flags(overlap_grad, overlap_param).unwrap())
        .with_bucket_size(bucket)
        .with_verify(Verify::Full)
}

#[derive(Debug, PartialEq)]
pub struct Outcome {
    /// Whether masters and gradients are sharded across ranks (distributed optimizer); without
    /// it every rank holds all of them.
    pub sharded: bool,
    pub losses: Vec<f32>,
    pub eval_losses: Vec<f32>,
    pub norms: Vec<f32>,
    /// Per step, this rank's reduced gradient shards (as f32).
    pub grads: Vec<Vec<MasterShard>>,
    pub skipped: u64,
    pub masters: Vec<MasterShard>,
    /// Every parameter's final compute weights (f32 bits of what the forward uses).
    pub weights: Vec<Vec<u32>>,
    /// Bytes this rank all-gathered (parameters and the grad-norm exchange).
    pub gather_bytes: u64,
    /// Parameters with low-precision primary weights (so a test can tell the paths apart).
    pub low_precision_params: usize,
}

fn is_matrix(name: &str) -> bool {
    name.ends_with(".weight")
}

pub fn specs(run: &Run) -> Vec<ParamSpec> {
    SHAPE
        .params()
        .into_iter()
        .map(|(name, shape)| {
            let owner = if run.chained && !is_matrix(&name) {
                1
            } else {
                0
            };
            let storage = match run.precision {
                Precision::Mxfp8 | Precision::Mxfp8Direct
                    if run.param_gather && is_matrix(&name) =>
                {
                    ParamStorage::Quantized(QuantKind::Mxfp8)
                }
                Precision::Nvfp4 if run.param_gather && is_matrix(&name) => {
                    ParamStorage::Quantized(QuantKind::Nvfp4)
                }
                _ => ParamStorage::Bf16,
            };
            ParamSpec::new(
                name,
                shape,
                BufferKey::new(storage, run.grad, OptimizerId(owner)),
            )
        })
        .collect()
}

/// What the forward and backward compute with: matrices as `Q(bf16)` under the run's
/// precision (stored copies or on the fly), everything else as stored.
pub fn policy(run: &Run) -> PrecisionPolicy {
    let format = match run.precision {
        Precision::Bf16 => ComputeFormat::AsStored,
        Precision::Mxfp8 => ComputeFormat::Mxfp8 { two_d: false },
        Precision::Mxfp8Direct => ComputeFormat::Mxfp8 { two_d: true },
        Precision::Nvfp4 => ComputeFormat::Nvfp4,
    };
    PrecisionPolicy::matrices(
        format,
        SHAPE
            .params()
            .iter()
            .map(|(name, _)| is_matrix(name).then_some(1)),
    )
}

/// The harness's AdamW.
pub fn adamw() -> AdamW {
    AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.01,
    }
}

/// Learning rate and clipping.
pub fn optim(lr: f32, clip: Option<f32>) -> OptimConfig {
    OptimConfig::new(lr).with_clip_grad(clip)
}

/// The optimizers of a run: AdamW for owner 0, SGD for owner 1 when chained.
pub fn optimizers(
    run: &Run,
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    init: &[Vec<f32>],
) -> Result<ChainedOptimizer, lowbit::optim::OptimError> {
    let mut parts: Vec<Box<dyn Optimizer>> = vec![Box::new(DistributedOptimizer::new(
        dev,
        bufs,
        OptimizerId(0),
        adamw(),
        optim(3e-3, run.clip),
        &mut init_from_full(init),
    )?)];
    if run.chained {
        let sgd = Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        };
        parts.push(Box::new(DistributedOptimizer::new(
            dev,
            bufs,
            OptimizerId(1),
            sgd,
            optim(1e-2, run.clip),
            &mut init_from_full(init),
        )?));
    }
    ChainedOptimizer::new(parts)
}

fn batch(run: &Run, rank: usize, step: usize, m: usize, eval: bool) -> (Vec<f32>, Vec<f32>) {
    let global_rows = run.rows * run.dp;
    let offset = if eval { 1 << 40 } else { 0 };
    let base = offset + ((step * run.microbatches + m) * global_rows + rank * run.rows) as u64;
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for i in 0..run.rows as u64 {
        let (xs, ys) = sample(&SHAPE, 11, base + i);
        x.extend(xs);
        y.extend(ys);
    }
    (x, y)
}

/// One rank's training loop, through the public step driver only.
pub fn rank_main(
    run: &Run,
    comm: &mut dyn Communicator,
    dev: &mut Device,
) -> Result<Outcome, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let rank = comm.rank();
    let mut plan = run.ddp.plan_config(run.dp);
    if run.layerwise {
        plan = plan.with_owner_strategy(OptimizerId(0), ShardingStrategy::LayerWise);
    }
    let plan = ShardingPlan::new(&specs(run), &plan).map_err(|x| e(&x))?;
    let mut bufs =
        DataParallelBuffers::with_plan(dev, rank, specs(run), plan, run.ddp).map_err(|x| e(&x))?;
    let init = SHAPE.init(7);
    bufs.initialize_all(dev, |p| init[p].clone())
        .map_err(|x| e(&x))?;
    let opt = optimizers(run, dev, &bufs, &init).map_err(|x| e(&x))?;
    let mut trainer = Trainer::new(dev, bufs, Box::new(opt), policy(run)).map_err(|x| e(&x))?;
    let mlp = Mlp::new(dev, SHAPE, run.rows);
    let mut out = Outcome {
        sharded: run.ddp.sharding.is_sharded(),
        losses: Vec::new(),
        eval_losses: Vec::new(),
        norms: Vec::new(),
        grads: Vec::new(),
        skipped: 0,
        masters: Vec::new(),
        weights: Vec::new(),
        gather_bytes: 0,
        low_precision_params: 0,
    };
    for step in 0..run.steps {
        let mut iteration = trainer.begin(dev, comm).map_err(|x| e(&x))?;
        let mut loss = 0.0f32;
        for m in 0..run.microbatches {
            let (mut x, y) = batch(run, rank, step, m, false);
            if run.poison == Some((step, rank)) && m == 0 {
                x[0] = f32::NAN;
            }
            let mut hooks = iteration.microbatch(comm, m + 1 == run.microbatches);
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / run.microbatches as f32);
            loss += r.map_err(|x| e(&x))?;
        }
        out.losses.push(loss);
        let ready = iteration.finish_grad_sync(dev, comm).map_err(|x| e(&x))?;
        let mut grads = Vec::new();
        for s in ready.buffers().owned_shards().map_err(|x| e(&x))? {
            let tmp = dev.alloc(DType::F32, s.grad_view.len());
            dev.cast(s.grad_view, tmp).map_err(|x| e(&x))?;
            let values: Vec<f32> = dev.download(tmp).map_err(|x| e(&x))?;
            dev.free(tmp).map_err(|x| e(&x))?;
            grads.push(MasterShard {
                param: s.param,
                range: s.param_range,
                values,
            });
        }
        out.grads.push(grads);
        let report = ready.step(dev, comm).map_err(|x| e(&x))?;
        out.norms.push(report.grad_norm);
        if run.force_sync_every_step {
            trainer.force_param_sync(dev, comm).map_err(|x| e(&x))?;
        }
        if run.eval_after.contains(&step) {
            let (x, y) = batch(run, rank, step, 0, true);
            let mut hooks = trainer.eval(dev, comm).map_err(|x| e(&x))?;
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 0.0);
            out.eval_losses.push(r.map_err(|x| e(&x))?);
        }
    }
    // The final forced sync (in `eval`) makes the weights reflect the last step on every path.
    let mut hooks = trainer.eval(dev, comm).map_err(|x| e(&x))?;
    for p in 0..SHAPE.params().len() {
        let v = hooks.param(dev, p, Usage::Forward).map_err(|x| e(&x))?;
        let tmp = dev.alloc(DType::F32, v.len());
        dev.cast(v, tmp).map_err(|x| e(&x))?;
        let w: Vec<f32> = dev.download(tmp).map_err(|x| e(&x))?;
        dev.free(tmp).map_err(|x| e(&x))?;
        out.weights.push(w.iter().map(|f| f.to_bits()).collect());
    }
    out.masters = trainer.optimizer().masters(dev).map_err(|x| e(&x))?;
    out.masters.sort_by_key(|m| (m.param, m.range.start));
    out.skipped = trainer.skipped_steps();
    out.gather_bytes = comm.stats().all_gather.bytes;
    out.low_precision_params = (0..SHAPE.params().len())
        .filter(|&p| trainer.buffers().is_low_precision(p))
        .count();
    if std::env::var_os("LOWBIT_DEBUG_STATS").is_some() {
        eprintln!("rank {rank}: {:?}", comm.stats());
    }
    trainer.into_parts(dev).map_err(|x| e(&x))?;
    Ok(out)
}

/// Trains `run` and returns every rank's outcome.
pub fn train(run: Run) -> Vec<Outcome> {
    if run.device == TestDevice::Cuda {
        return train_cuda(run);
    }
    let config = GroupConfig::default().with_timeout(Duration::from_secs(30));
    run_ranks(run.dp, config, |mut comm, mut dev| {
        rank_main(&run, &mut comm, &mut dev)
    })
    .into_iter()
    .map(|r| {
        r.expect("rank panicked")
            .unwrap_or_else(|e| panic!("{run:?}: {e}"))
    })
    .collect()
}

/// Full fp32 masters, assembled from every rank's shards (each element exactly once).
pub fn full_masters(outcomes: &[Outcome]) -> Vec<Vec<f32>> {
    assemble(owners(outcomes).iter().map(|o| &o.masters[..]))
}

/// The ranks whose shards together hold every element once.
fn owners(outcomes: &[Outcome]) -> &[Outcome] {
    if outcomes[0].sharded {
        outcomes
    } else {
        &outcomes[..1]
    }
}

/// The full reduced gradients of `step`, assembled from every rank's shards.
pub fn full_grads(outcomes: &[Outcome], step: usize) -> Vec<Vec<f32>> {
    assemble(owners(outcomes).iter().map(|o| &o.grads[step][..]))
}

fn assemble<'a>(pieces: impl Iterator<Item = &'a [MasterShard]>) -> Vec<Vec<f32>> {
    let sizes: Vec<usize> = SHAPE
        .params()
        .iter()
        .map(|(_, s)| s.iter().product())
        .collect();
    let mut full: Vec<Vec<Option<f32>>> = sizes.iter().map(|&n| vec![None; n]).collect();
    for shards in pieces {
        for m in shards {
            let p = m.param;
            for (i, v) in m.range.clone().zip(&m.values) {
                assert!(full[p][i].is_none(), "param {p} element {i} owned twice");
                full[p][i] = Some(*v);
            }
        }
    }
    full.into_iter()
        .enumerate()
        .map(|(p, v)| {
            v.into_iter()
                .enumerate()
                .map(|(i, x)| x.unwrap_or_else(|| panic!("param {p} element {i} owned by nobody")))
                .collect()
        })
        .collect()
}

pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Every rank ends with the same weights and saw the same grad norms.
pub fn assert_ranks_identical(outcomes: &[Outcome]) {
    for o in &outcomes[1..] {
        assert_eq!(
            o.weights, outcomes[0].weights,
            "weights differ across ranks"
        );
        assert_eq!(
            bits(&o.norms),
            bits(&outcomes[0].norms),
            "grad norms differ across ranks"
        );
    }
}

/// Two runs are the same trajectory, bit for bit.
pub fn assert_same_trajectory(a: &[Outcome], b: &[Outcome], what: &str) {
    assert_eq!(a.len(), b.len());
    assert_eq!(bits(&a[0].losses), bits(&b[0].losses), "{what}: losses");
    assert_eq!(
        bits(&a[0].eval_losses),
        bits(&b[0].eval_losses),
        "{what}: eval losses"
    );
    assert_eq!(bits(&a[0].norms), bits(&b[0].norms), "{what}: grad norms");
    for step in 0..a[0].grads.len() {
        let (ga, gb) = (full_grads(a, step), full_grads(b, step));
        for (p, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(
                bits(x),
                bits(y),
                "{what}: reduced gradient of param {p} at step {step}"
            );
        }
    }
    let (ma, mb) = (full_masters(a), full_masters(b));
    for (p, (x, y)) in ma.iter().zip(&mb).enumerate() {
        assert_eq!(bits(x), bits(y), "{what}: masters of param {p}");
    }
    assert_eq!(a[0].weights, b[0].weights, "{what}: weights");
}

/// The run with low-precision gather on or off, everything else equal. For bf16 "off" is
/// classic DDP (all-reduce, every rank updates everything, nothing gathered).
pub fn variant(base: Run, gather: bool) -> Run {
    match (base.precision, gather) {
        (Precision::Mxfp8 | Precision::Nvfp4, on) => Run {
            param_gather: on,
            ..base
        },
        (Precision::Mxfp8Direct, on) => Run {
            param_gather: on,
            ddp: base.ddp.with_mxfp8_gather(if on {
                Mxfp8Gather::Direct2d
            } else {
                Mxfp8Gather::Bf16Staging
            }),
            ..base
        },
        (Precision::Bf16, true) => base,
        (Precision::Bf16, false) => Run {
            ddp: ddp(
                false,
                base.ddp.overlap.grad_reduce(),
                false,
                base.ddp.bucket_size,
            ),
            ..base
        },
    }
}

/// Compares everything but the masters' sharding (classic DDP holds whole masters).
pub fn assert_parity(on: &[Outcome], off: &[Outcome], what: &str) {
    assert_same_trajectory(on, off, what);
}

/// Two runs whose gradient reductions differ in order only (NCCL all-reduce against
/// reduce-scatter across 3+ ranks): the same trajectory up to rounding, losses and grad norms
/// within a relative 1e-4.
pub fn assert_close_trajectory(a: &[Outcome], b: &[Outcome], what: &str) {
    let close = |x: f32, y: f32| (x - y).abs() <= 1e-4 * x.abs().max(y.abs()).max(1e-6);
    for (name, xs, ys) in [
        ("losses", &a[0].losses, &b[0].losses),
        ("grad norms", &a[0].norms, &b[0].norms),
    ] {
        assert_eq!(xs.len(), ys.len(), "{what}: {name}");
        for (i, (&x, &y)) in xs.iter().zip(ys.iter()).enumerate() {
            assert!(close(x, y), "{what}: {name}[{i}] {x} vs {y} beyond 1e-4");
        }
    }
}

/// The ON/OFF parity matrix over precisions, overlap, gradient dtype, buckets and the data-parallel
/// sizes `dps`: every pair must train to the same bits. Returns the number of pairs.
///
/// One exception, on CUDA only: bf16 "OFF" is classic DDP (all-reduce over an unpadded bucket)
/// and "ON" the distributed optimizer (reduce-scatter over a padded one). With 3 or more ranks
/// NCCL sums those in different orders, so that pair is held to [`assert_close_trajectory`];
/// every low-precision pair (reduce-scatter on both sides) stays bitwise at any size.
pub fn parity_matrix(
    dps: &[usize],
    steps: usize,
    device: TestDevice,
    grads: &[GradDType],
    buckets: &[Option<usize>],
) -> usize {
    let mut cases = 0;
    for precision in [
        Precision::Bf16,
        Precision::Mxfp8,
        Precision::Nvfp4,
        Precision::Mxfp8Direct,
    ] {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for &grad in grads {
                for &bucket in buckets {
                    for &dp in dps {
                        let base = Run {
                            precision,
                            grad,
                            steps,
                            microbatches: 3,
                            rows: 8 / dp.min(4) + 1,
                            ddp: ddp(true, og, op, bucket),
                            device,
                            ..Run::new(dp)
                        };
                        let what = format!(
                            "{precision:?} dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?} \
                             case={cases}"
                        );
                        // Gradient-accumulation fusion is an axis of the ON side: fused and
                        // unfused accumulation must give the OFF run's bits alike.
                        let fusion = if cases % 2 == 0 {
                            GradAccumulation::Fused
                        } else {
                            GradAccumulation::Unfused
                        };
                        let on = train(Run {
                            ddp: base.ddp.with_grad_accumulation(fusion),
                            ..variant(base, true)
                        });
                        let off = train(variant(base, false));
                        assert_ranks_identical(&on);
                        assert_ranks_identical(&off);
                        if precision == Precision::Bf16 && !on[0].masters.is_empty() {
                            // Classic DDP vs distributed optimizer: masters are sharded
                            // differently but assemble to the same values.
                            assert_eq!(full_masters(&on).len(), full_masters(&off).len());
                        }
                        // The ON run really has low-precision primary weights (all 4 matrices).
                        let expect_low = if precision == Precision::Bf16 { 0 } else { 4 };
                        assert_eq!(on[0].low_precision_params, expect_low, "{what}");
                        assert_eq!(off[0].low_precision_params, 0, "{what}");
                        if device == TestDevice::Cuda && precision == Precision::Bf16 && dp >= 3 {
                            assert_close_trajectory(&on, &off, &what);
                            eprintln!(
                                "{what}: within 1e-4, not bitwise (NCCL all-reduce vs reduce-scatter)"
                            );
                        } else {
                            assert_parity(&on, &off, &what);
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    cases
}

#[cfg(feature = "cuda")]
fn train_cuda(run: Run) -> Vec<Outcome> {
    lowbit::comm::nccl::run_local_ranks(run.dp, |comm, dev| rank_main(&run, comm, dev))
        .unwrap_or_else(|e| panic!("{run:?}: {e}"))
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{run:?}: {e}")))
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn train_cuda(run: Run) -> Vec<Outcome> {
    panic!("{run:?}: CUDA runs need the cuda feature");
}
