//! Helpers shared by the `lowbit-optim` integration tests: the test model's parameter specs,
//! buffers and precision policy, the optimizers, a training loop through the public step
//! driver, host-side assembly of sharded results; with `lowbit-testkit`'s rank threads,
//! deterministic values, bitwise assertions and tiny model (re-exported here).

#![allow(dead_code, unused_imports)] // each test file uses part of the helpers

pub use lowbit_testkit::{assert_same_bits, bits, download_f32, model, run, seed, values};

use std::ops::Range;

use lowbit_buffers::layout::{
    GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingStrategy,
};
use lowbit_buffers::{
    BufferError, ComputeFormat, DataParallelBuffers, DdpConfig, Overlap, PrecisionPolicy,
    ProtocolError, Verify,
};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{
    ChainedOptimizer, DistributedOptimizer, MasterShard, OptimConfig, OptimError, Optimizer, Sgd,
    StepReport, init_from_full,
};
use lowbit_testkit::{harness, weight_parts};
use lowbit_train::Trainer;

use model::Mlp;

/// Layer widths of the test model: matrices of 32x32 tiles (MXFP8 blocks fit exactly).
pub const DIMS: [usize; 4] = [32, 64, 32, 32];
/// Rows per rank per microbatch.
pub const BATCH: usize = 4;

/// MXFP8 primary weights.
pub const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);

/// The model's parameters: matrices in `matrices` storage owned by optimizer 0, biases in bf16
/// owned by optimizer 1 when `chained` (else 0).
pub fn specs(matrices: ParamStorage, grad: GradDType, chained: bool) -> Vec<ParamSpec> {
    harness::tiny_specs(&DIMS, matrices, grad, |matrix| {
        OptimizerId(u32::from(chained && !matrix))
    })
}

/// Matrices computed with MXFP8 (their stored copies when they have MXFP8 storage, quantized
/// on the fly otherwise) or as stored; biases as stored.
pub fn policy(specs: &[ParamSpec], mxfp8: bool) -> PrecisionPolicy {
    harness::matrix_policy(
        specs,
        mxfp8.then_some(ComputeFormat::Mxfp8 { two_d: false }),
    )
}

/// The initial values of every parameter.
pub fn init_values(specs: &[ParamSpec]) -> Vec<Vec<f32>> {
    harness::init_values(specs, 1234)
}

/// The buffers' configuration used by most tests.
pub fn ddp(overlap: Overlap) -> DdpConfig {
    DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_overlap(overlap)
        .with_bucket_size(Some(2500))
        .with_verify(Verify::Full)
}

/// Rank `rank`'s buffers of `dp` ranks over `specs`, configured by [`ddp`], initialized with
/// `values`.
pub fn buffers(
    dev: &mut Device,
    dp: usize,
    rank: usize,
    specs: &[ParamSpec],
    overlap: Overlap,
    values: &[Vec<f32>],
) -> DataParallelBuffers {
    let mut b = DataParallelBuffers::new(dev, dp, rank, specs.to_vec(), ddp(overlap)).unwrap();
    b.initialize_all(dev, |p| values[p].clone()).unwrap();
    b
}

/// AdamW for the matrices.
pub use harness::tiny_adamw as adamw;

/// SGD with momentum for the biases.
pub fn sgd() -> Sgd {
    Sgd {
        momentum: 0.9,
        weight_decay: 0.01,
    }
}

/// A leaf optimizer of `owner` over `bufs` (SGD when `rule_sgd`, else AdamW), masters from `init`.
pub fn leaf(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    owner: u32,
    rule_sgd: bool,
    cfg: OptimConfig,
    init: &[Vec<f32>],
) -> DistributedOptimizer {
    leaf_from(dev, bufs, owner, rule_sgd, cfg, &mut init_from_full(init))
}

/// [`leaf`] with masters from the init callback `cb`.
pub fn leaf_from(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    owner: u32,
    rule_sgd: bool,
    cfg: OptimConfig,
    cb: &mut dyn FnMut(usize, Range<usize>) -> Vec<f32>,
) -> DistributedOptimizer {
    let owner = OptimizerId(owner);
    if rule_sgd {
        DistributedOptimizer::new(dev, bufs, owner, sgd(), cfg, cb).unwrap()
    } else {
        DistributedOptimizer::new(dev, bufs, owner, adamw(), cfg, cb).unwrap()
    }
}

/// AdamW (lr 1e-2) for owner 0 and, when `chained`, SGD (lr 5e-2) for owner 1, in a chain.
pub fn optimizer(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    init: &[Vec<f32>],
    chained: bool,
) -> ChainedOptimizer {
    let mut parts: Vec<Box<dyn Optimizer>> = vec![Box::new(leaf(
        dev,
        bufs,
        0,
        false,
        OptimConfig::new(1e-2),
        init,
    ))];
    if chained {
        parts.push(Box::new(leaf(
            dev,
            bufs,
            1,
            true,
            OptimConfig::new(5e-2),
            init,
        )));
    }
    ChainedOptimizer::new(parts).unwrap()
}

/// A trainer of `bufs` and `opt` under [`policy`]`(specs, mxfp8)`.
pub fn trainer(
    dev: &mut Device,
    bufs: DataParallelBuffers,
    opt: impl Optimizer + 'static,
    mxfp8: bool,
) -> Trainer {
    let pol = policy(bufs.specs(), mxfp8);
    Trainer::new(dev, bufs, Box::new(opt), pol).unwrap()
}

/// The input of `(rank, step, microbatch)`, its first element NaN when `poison`.
pub fn batch(
    mlp: &Mlp,
    rank: usize,
    step: usize,
    micro: usize,
    poison: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (mut x, y) = mlp.sample(rank, step, micro);
    if poison {
        x[0] = f32::NAN;
    }
    (x, y)
}

/// One training step through the trainer: `microbatches` forward/backwards of `data_step`'s
/// batches, the gradient sync, the optimizer step.
pub fn train_step(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    trainer: &mut Trainer,
    mlp: &Mlp,
    data_step: usize,
    microbatches: usize,
    poison_rank: Option<usize>,
) -> StepReport {
    let rank = comm.rank();
    let mut it = trainer.begin(dev, comm).unwrap();
    for m in 0..microbatches {
        let (x, y) = batch(mlp, rank, data_step, m, poison_rank == Some(rank) && m == 0);
        let mut hooks = it.microbatch(comm, m + 1 == microbatches);
        mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0 / microbatches as f32)
            .unwrap();
    }
    // The one-call path (the norm beside the reductions in flight); `trainer.rs` holds it to the
    // protocol functions called one by one, bit for bit.
    it.step(dev, comm).unwrap()
}

/// Every parameter's weight bytes as compute reads them: the persistent values or the
/// low-precision copies and scales.
pub fn weight_bytes(dev: &mut Device, bufs: &DataParallelBuffers) -> Vec<Vec<u8>> {
    (0..bufs.specs().len())
        .map(|p| weight_parts(dev, bufs, p).concat())
        .collect()
}

/// Sorted master shards with their values as bits (NaN-safe equality).
pub fn master_bits(dev: &Device, opt: &dyn Optimizer) -> Vec<(usize, usize, Vec<u32>)> {
    let mut m: Vec<_> = opt
        .masters(dev)
        .unwrap()
        .into_iter()
        .map(|s| (s.param, s.range.start, bits(&s.values)))
        .collect();
    m.sort();
    m
}

/// Full parameters assembled from every rank's pieces, each element exactly once.
pub fn assemble(sizes: &[usize], pieces: &[Vec<MasterShard>]) -> Vec<Vec<f32>> {
    harness::assemble_shards(sizes, pieces.iter().flatten())
}

/// The protocol violation inside an optimizer error.
pub fn protocol_err(e: OptimError) -> ProtocolError {
    match e {
        OptimError::Buffer(BufferError::Protocol(p)) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}
