//! Helpers shared by the `lowbit-optim` integration tests: rank threads, the test model's
//! parameter specs and precision policy, the optimizers, a training loop through the public
//! step driver, deterministic values and host-side assembly of sharded results.

#![allow(dead_code)] // each test file uses part of the helpers

pub mod model;

use std::time::Duration;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingStrategy,
};
use lowbit_buffers::{
    BufferError, ComputeFormat, DataParallelBuffers, DdpConfig, LowPrecisionWeights, Overlap,
    ParamCompute, PrecisionPolicy, ProtocolError, Verify,
};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::{DType, Device, View};
use lowbit_optim::{
    AdamW, ChainedOptimizer, DistributedOptimizer, MasterShard, OptimConfig, OptimError, Optimizer,
    Sgd, StepReport, Trainer,
};

use model::Mlp;

/// Layer widths of the test model: matrices of 32x32 tiles (MXFP8 blocks fit exactly).
pub const DIMS: [usize; 4] = [32, 64, 32, 32];
/// Rows per rank per microbatch.
pub const BATCH: usize = 4;

/// MXFP8 primary weights.
pub const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);

/// Runs `f` on `dp` rank threads (30 s collective timeout) and returns each rank's result.
pub fn run<T: Send>(dp: usize, f: impl Fn(LocalComm, Device) -> T + Sync) -> Vec<T> {
    run_ranks(
        dp,
        GroupConfig::default().with_timeout(Duration::from_secs(30)),
        f,
    )
    .into_iter()
    .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
    .collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// `n` deterministic values in `[-scale, scale)` with full 24-bit significands.
pub fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = splitmix(seed.wrapping_mul(0x1000_0001) ^ i as u64);
            let u = (x >> 40) as f32 / (1u32 << 24) as f32;
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

/// A seed from small integers.
pub fn seed(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x5EED, |s, &p| splitmix(s ^ p.wrapping_mul(0x100_0193)))
}

/// Asserts two f32 slices are bitwise equal, naming the first difference (not dumping both).
#[track_caller]
pub fn assert_same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let diffs: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&i) = diffs.first() {
        panic!(
            "{what}: {} of {} elements differ; first at {i}: {} vs {} expected",
            diffs.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Bits of f32 values.
pub fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The model's parameters: matrices in `matrices` storage owned by optimizer 0, biases in bf16
/// owned by optimizer 1 when `chained` (else 0).
pub fn specs(matrices: ParamStorage, grad: GradDType, chained: bool) -> Vec<ParamSpec> {
    Mlp::params(&DIMS)
        .into_iter()
        .map(|(name, shape)| {
            let matrix = shape.len() == 2;
            let key = BufferKey {
                param_storage: if matrix { matrices } else { ParamStorage::Bf16 },
                grad_dtype: grad,
                expert: false,
                owner: OptimizerId(u32::from(chained && !matrix)),
            };
            ParamSpec::new(name, shape, key)
        })
        .collect()
}

/// Matrices computed with MXFP8 (their stored copies when they have MXFP8 storage, quantized
/// on the fly otherwise) or as stored; biases as stored.
pub fn policy(specs: &[ParamSpec], mxfp8: bool) -> PrecisionPolicy {
    PrecisionPolicy::new(
        specs
            .iter()
            .map(|s| {
                if mxfp8 && s.shape.len() == 2 {
                    ParamCompute::new(ComputeFormat::Mxfp8 { two_d: false })
                } else {
                    ParamCompute::AS_STORED
                }
            })
            .collect(),
    )
}

/// The initial values of every parameter.
pub fn init_values(specs: &[ParamSpec]) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, 1234]), s.numel, 0.25))
        .collect()
}

/// The buffers' configuration used by most tests.
pub fn ddp(overlap: Overlap) -> DdpConfig {
    DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_overlap(overlap)
        .with_bucket_size(Some(2500))
        .with_verify(Verify::Full)
}

/// AdamW for the matrices.
pub fn adamw() -> AdamW {
    AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

/// SGD with momentum for the biases.
pub fn sgd() -> Sgd {
    Sgd {
        momentum: 0.9,
        weight_decay: 0.01,
    }
}

/// A leaf optimizer of `owner` over `bufs`, masters from `init`.
pub fn leaf(
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    owner: u32,
    rule_sgd: bool,
    cfg: OptimConfig,
    init: &[Vec<f32>],
) -> DistributedOptimizer {
    let mut cb = lowbit_optim::init_from_full(init);
    if rule_sgd {
        DistributedOptimizer::new(dev, bufs, OptimizerId(owner), sgd(), cfg, &mut cb).unwrap()
    } else {
        DistributedOptimizer::new(dev, bufs, OptimizerId(owner), adamw(), cfg, &mut cb).unwrap()
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
    it.finish_grad_sync(dev, comm)
        .unwrap()
        .step(dev, comm)
        .unwrap()
}

/// Every parameter's weight bytes as compute reads them: the persistent values or the
/// low-precision copies and scales.
pub fn weight_bytes(dev: &mut Device, bufs: &DataParallelBuffers) -> Vec<Vec<u8>> {
    (0..bufs.specs().len())
        .map(|p| match bufs.low_precision_weights(p) {
            None => dev.read_bytes(bufs.param_view(p).unwrap()).unwrap(),
            Some(LowPrecisionWeights::Mxfp8(w)) => {
                [w.rowwise.0, w.rowwise.1, w.columnwise.0, w.columnwise.1]
                    .iter()
                    .flat_map(|&v| dev.read_bytes(v).unwrap())
                    .collect()
            }
            Some(LowPrecisionWeights::Nvfp4 { weights: w, amax }) => {
                let mut out: Vec<u8> = [w.rowwise.0, w.rowwise.1, w.columnwise.0, w.columnwise.1]
                    .iter()
                    .flat_map(|&v| dev.read_bytes(v).unwrap())
                    .collect();
                out.extend(amax.to_le_bytes());
                out
            }
            Some(other) => panic!("unknown weights {other:?}"),
        })
        .collect()
}

/// A float view's values as f32.
pub fn download_f32(dev: &mut Device, v: View) -> Vec<f32> {
    if v.dtype() == DType::F32 {
        return dev.download(v).unwrap();
    }
    let tmp = dev.alloc(DType::F32, v.len());
    dev.cast(v, tmp).unwrap();
    let out = dev.download(tmp).unwrap();
    dev.free(tmp).unwrap();
    out
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
    let mut full: Vec<Vec<Option<f32>>> = sizes.iter().map(|&n| vec![None; n]).collect();
    for rank in pieces {
        for s in rank {
            for (i, &v) in s.range.clone().zip(&s.values) {
                assert!(
                    full[s.param][i].is_none(),
                    "param {} element {i} twice",
                    s.param
                );
                full[s.param][i] = Some(v);
            }
        }
    }
    full.into_iter()
        .enumerate()
        .map(|(p, v)| {
            v.into_iter()
                .enumerate()
                .map(|(i, x)| x.unwrap_or_else(|| panic!("param {p} element {i} missing")))
                .collect()
        })
        .collect()
}

/// The protocol violation inside an optimizer error.
pub fn protocol_err(e: OptimError) -> ProtocolError {
    match e {
        OptimError::Buffer(BufferError::Protocol(p)) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}
