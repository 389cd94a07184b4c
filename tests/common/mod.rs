//! The one helper the data-parallel integration tests go through: [`train`] runs the test model
//! on N rank threads with a given configuration and returns each rank's losses, gradient
//! digests, grad norms, fp32 masters and final weight bytes.

#![allow(dead_code)] // each test file uses part of the harness

use std::time::Duration;

use lowbit::buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit::buffers::{DataParallelBuffers, DdpConfig, mxfp8_weight_config, nvfp4_weight_config};
use lowbit::comm::{Communicator, GroupConfig, run_ranks};
use lowbit::device::{DType, Device, Mxfp8Config, Mxfp8Views, View};
use lowbit::model::{Hooks, Mlp, MlpShape, ModelError, Usage, sample};
use lowbit::optim::{
    Algorithm, ChainedOptimizer, DistributedOptimizer, MasterShard, OptimConfig, initialize_params,
};
use lowbit::train::hooks::{dequant_mxfp8, dequant_nvfp4};

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
        }
    }
}

pub fn ddp(
    distopt: bool,
    overlap_grad: bool,
    overlap_param: bool,
    bucket: Option<usize>,
) -> DdpConfig {
    DdpConfig {
        distributed_optimizer: distopt,
        overlap_grad_reduce: overlap_grad,
        overlap_param_gather: overlap_param,
        average_in_collective: false,
        bucket_size: bucket,
        high_busbw_padding: false,
        mxfp8_direct_2d: false,
    }
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
            let key = BufferKey {
                param_storage: storage,
                grad_dtype: run.grad,
                expert: false,
                owner: OptimizerId(owner),
            };
            ParamSpec::new(name, shape, key)
        })
        .collect()
}

/// The model's view of the buffers: parameters through the forward pre-hook (lazy gathers) and
/// the precision policy, gradients into the buffers with readiness reported.
pub struct DpHooks<'a> {
    pub bufs: &'a mut DataParallelBuffers,
    pub comm: &'a mut dyn Communicator,
    pub precision: Precision,
    /// f32 scratch for dequantized weights, and u8 scratch for on-the-fly quantization.
    pub scratch: View,
    pub qscratch: [View; 4],
}

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string())
}

impl DpHooks<'_> {
    pub fn new<'a>(
        dev: &mut Device,
        bufs: &'a mut DataParallelBuffers,
        comm: &'a mut dyn Communicator,
        precision: Precision,
    ) -> DpHooks<'a> {
        let n = bufs.specs().iter().map(|s| s.numel).max().unwrap_or(1);
        DpHooks {
            bufs,
            comm,
            precision,
            scratch: dev.alloc(DType::F32, n),
            qscratch: [n, n, n, n].map(|k| dev.alloc(DType::U8, k)),
        }
    }

    pub fn free(self, dev: &mut Device) {
        dev.free(self.scratch).unwrap();
        for v in self.qscratch {
            dev.free(v).unwrap();
        }
    }
}

impl Hooks for DpHooks<'_> {
    fn param(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<View, ModelError> {
        let g = self.bufs.group_of(p);
        self.bufs
            .finish_param_sync(dev, self.comm, g)
            .map_err(hook_err)?;
        let spec = &self.bufs.specs()[p];
        if self.precision == Precision::Bf16 || !is_matrix(&spec.name) {
            return self.bufs.param_view(p).map_err(hook_err);
        }
        let (rows, cols) = lowbit::buffers::matrix_dims(&spec.shape);
        let out = self.scratch.slice(0..rows * cols)?;
        if self.precision == Precision::Nvfp4 {
            let (w, amax) = match self.bufs.nvfp4_weights(p) {
                // Low-precision primary weights: use the stored copies.
                Some(w) => w,
                // bf16 parameters: quantize on the fly with the weight recipe (2D).
                None => {
                    let [rd, rs, cd, cs] = self.qscratch;
                    let n = rows * cols;
                    let w = lowbit::buffers::Nvfp4Weights {
                        rows,
                        cols,
                        rowwise: (rd.slice(0..n / 2)?, rs.slice(0..n / 16)?),
                        columnwise: (cd.slice(0..n / 2)?, cs.slice(0..n / 16)?),
                        tiles: self.scratch,
                    };
                    let src = self.bufs.param_view(p).map_err(hook_err)?;
                    let amax =
                        dev.quantize_nvfp4(src, rows, cols, &nvfp4_weight_config(), &w.views())?;
                    (w, amax.rowwise)
                }
            };
            dequant_nvfp4(dev, &w, amax, usage, out)?;
            return Ok(out);
        }
        let w = match self.bufs.mxfp8_weights(p) {
            // Low-precision primary weights: use the stored copies.
            Some(w) => w,
            // bf16 parameters: quantize on the fly, exactly as the primary weights were made.
            None => {
                let [rd, rs, cd, cs] = self.qscratch;
                let (rb, cb) = (cols.div_ceil(32), rows.div_ceil(32));
                let views = Mxfp8Views {
                    rowwise: Some((rd.slice(0..rows * cols)?, rs.slice(0..rows * rb)?)),
                    columnwise: Some((cd.slice(0..rows * cols)?, cs.slice(0..cb * cols)?)),
                };
                let src = self.bufs.param_view(p).map_err(hook_err)?;
                let cfg = Mxfp8Config {
                    two_d: self.precision == Precision::Mxfp8Direct,
                    ..mxfp8_weight_config()
                };
                dev.quantize_mxfp8(src, rows, cols, &cfg, &views)?;
                lowbit::buffers::Mxfp8Weights {
                    rows,
                    cols,
                    rowwise: views.rowwise.unwrap(),
                    columnwise: views.columnwise.unwrap(),
                }
            }
        };
        dequant_mxfp8(dev, &w, usage, out)?;
        Ok(out)
    }
    fn grad(&mut self, dev: &mut Device, p: usize) -> Result<View, ModelError> {
        self.bufs.accumulation_view(dev, p).map_err(hook_err)
    }
    fn grad_ready(&mut self, dev: &mut Device, p: usize) -> Result<(), ModelError> {
        if self.bufs.config().overlap_grad_reduce {
            self.bufs
                .register_grad_ready(dev, self.comm, p)
                .map_err(hook_err)?;
        }
        Ok(())
    }
}

pub fn adamw(lr: f32, clip: Option<f32>) -> OptimConfig {
    OptimConfig {
        algorithm: Algorithm::AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        lr,
        clip_grad: clip,
    }
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

/// One rank's training loop.
pub fn rank_main(
    run: &Run,
    comm: &mut dyn Communicator,
    dev: &mut Device,
) -> Result<Outcome, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let rank = comm.rank();
    let mut bufs =
        DataParallelBuffers::new(dev, run.dp, rank, specs(run), run.ddp).map_err(|x| e(&x))?;
    let init = SHAPE.init(7);
    initialize_params(dev, &mut bufs, &init).map_err(|x| e(&x))?;
    let mut parts = vec![
        DistributedOptimizer::new(dev, &bufs, OptimizerId(0), adamw(3e-3, run.clip), &init)
            .map_err(|x| e(&x))?,
    ];
    if run.chained {
        let sgd = OptimConfig {
            algorithm: Algorithm::Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            lr: 1e-2,
            clip_grad: run.clip,
        };
        parts.push(
            DistributedOptimizer::new(dev, &bufs, OptimizerId(1), sgd, &init).map_err(|x| e(&x))?,
        );
    }
    let mut opt = ChainedOptimizer::new(parts).map_err(|x| e(&x))?;
    let mlp = Mlp::new(dev, SHAPE, run.rows);
    let mut out = Outcome {
        sharded: run.ddp.distributed_optimizer,
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
        opt.begin_iteration(dev, comm, &mut bufs)
            .map_err(|x| e(&x))?;
        let mut loss = 0.0f32;
        for m in 0..run.microbatches {
            bufs.set_last_microbatch(m + 1 == run.microbatches);
            let (mut x, y) = batch(run, rank, step, m, false);
            if run.poison == Some((step, rank)) && m == 0 {
                x[0] = f32::NAN;
            }
            let mut hooks = DpHooks::new(dev, &mut bufs, comm, run.precision);
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / run.microbatches as f32);
            hooks.free(dev);
            loss += r.map_err(|x| e(&x))?;
        }
        out.losses.push(loss);
        bufs.finish_grad_sync(dev, comm).map_err(|x| e(&x))?;
        let mut grads = Vec::new();
        for s in bufs.owned_shards().map_err(|x| e(&x))? {
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
        let report = opt.step(dev, comm, &mut bufs).map_err(|x| e(&x))?;
        out.norms.push(report.grad_norm);
        if run.force_sync_every_step {
            opt.force_param_sync(dev, comm, &mut bufs)
                .map_err(|x| e(&x))?;
        }
        if run.eval_after.contains(&step) {
            opt.force_param_sync(dev, comm, &mut bufs)
                .map_err(|x| e(&x))?;
            let (x, y) = batch(run, rank, step, 0, true);
            let mut hooks = DpHooks::new(dev, &mut bufs, comm, run.precision);
            let r = mlp.forward_backward(dev, &mut EvalHooks(&mut hooks), &x, &y, 0.0);
            hooks.free(dev);
            out.eval_losses.push(r.map_err(|x| e(&x))?);
        }
    }
    // A final forced sync makes the weights reflect the last step on every path.
    opt.force_param_sync(dev, comm, &mut bufs)
        .map_err(|x| e(&x))?;
    for p in opt.parts() {
        out.masters.extend(p.masters(dev).map_err(|x| e(&x))?);
    }
    out.masters.sort_by_key(|m| (m.param, m.range.start));
    out.skipped = opt.skipped_steps();
    let mut hooks = DpHooks::new(dev, &mut bufs, comm, run.precision);
    for p in 0..SHAPE.params().len() {
        let v = hooks.param(dev, p, Usage::Forward).map_err(|x| e(&x))?;
        let tmp = dev.alloc(DType::F32, v.len());
        dev.cast(v, tmp).map_err(|x| e(&x))?;
        let w: Vec<f32> = dev.download(tmp).map_err(|x| e(&x))?;
        dev.free(tmp).map_err(|x| e(&x))?;
        out.weights.push(w.iter().map(|f| f.to_bits()).collect());
    }
    hooks.free(dev);
    out.gather_bytes = comm.stats().all_gather.bytes;
    out.low_precision_params = (0..SHAPE.params().len())
        .filter(|&p| bufs.is_low_precision(p))
        .count();
    if std::env::var_os("LOWBIT_DEBUG_STATS").is_some() {
        eprintln!("rank {rank}: {:?}", comm.stats());
    }
    Ok(out)
}

/// Eval: the forward reads parameters through the same hooks, the backward's gradients go to
/// scratch (an eval must not touch the training gradients or report readiness).
pub struct EvalHooks<'h, 'a>(pub &'h mut DpHooks<'a>);

impl Hooks for EvalHooks<'_, '_> {
    fn param(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<View, ModelError> {
        self.0.param(dev, p, usage)
    }
    fn grad(&mut self, _dev: &mut Device, p: usize) -> Result<View, ModelError> {
        let n = self.0.bufs.specs()[p].numel;
        Ok(self.0.scratch.slice(0..n)?)
    }
    fn grad_ready(&mut self, _dev: &mut Device, _p: usize) -> Result<(), ModelError> {
        Ok(())
    }
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
            ddp: lowbit::buffers::DdpConfig {
                mxfp8_direct_2d: on,
                ..base.ddp
            },
            ..base
        },
        (Precision::Bf16, true) => base,
        (Precision::Bf16, false) => Run {
            ddp: ddp(
                false,
                base.ddp.overlap_grad_reduce,
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
                            "{precision:?} dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?}"
                        );
                        let on = train(variant(base, true));
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
