//! Bring your own model: the MLP in `model.rs` (its own parameter list, its own forward and
//! backward) trained by 4 data-parallel ranks with MXFP8 primary weights, bf16 staging,
//! overlapped gradient reduction and parameter gather, and a sharded AdamW — through the public
//! APIs of `lowbit-comm`, `lowbit-layout`, `lowbit-buffers`, `lowbit-nn` (its layers),
//! `lowbit-optim` and `lowbit-train` (the step driver) only.
//!
//! `cargo run --release -p byo-model [-- RANKS]`

mod model;

use lowbit_buffers::{ComputeFormat, DataParallelBuffers, DdpConfig, Overlap, PrecisionPolicy};
use lowbit_comm::{Communicator, GroupConfig, ReduceOp, run_ranks};
use lowbit_device::{DType, Device};
use lowbit_layout::{BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind};
use lowbit_optim::{AdamW, ChainedOptimizer, DistributedOptimizer, OptimConfig, Optimizer};
use lowbit_train::Trainer;

const STEPS: usize = 60;
const MICROBATCHES: usize = 2;
const ROWS: usize = 16; // per rank per microbatch

/// Weights are MXFP8 primary weights owned by optimizer 0 (decayed); biases bf16, owner 1.
fn specs() -> Vec<ParamSpec> {
    model::params()
        .into_iter()
        .map(|(name, shape)| {
            let matrix = shape.len() == 2;
            let storage = if matrix {
                ParamStorage::Quantized(QuantKind::Mxfp8)
            } else {
                ParamStorage::Bf16
            };
            let key = BufferKey::new(storage, GradDType::F32, OptimizerId(u32::from(!matrix)));
            ParamSpec::new(name, shape, key)
        })
        .collect()
}

/// Deterministic high-precision initial values of a piece of parameter `p`: uniform in
/// ±1/√fan_in from a hash of the element index (no full copy is ever built on any rank).
fn init(p: usize, range: std::ops::Range<usize>) -> Vec<f32> {
    let (name, shape) = &model::params()[p];
    let scale = 1.0 / (*shape.last().unwrap_or(&1) as f32).sqrt();
    let bias = name.ends_with("bias");
    range
        .map(|i| {
            if bias {
                0.0
            } else {
                scale * uniform(p as u64, i as u64)
            }
        })
        .collect()
}

fn uniform(stream: u64, i: u64) -> f32 {
    let mut z = (stream << 40 ^ i).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
}

/// Sample `i` of the task: a fixed nonlinear teacher of the input.
fn sample(i: u64) -> (Vec<f32>, Vec<f32>) {
    let (d, _, o) = model::DIMS;
    let x: Vec<f32> = (0..d as u64).map(|j| uniform(1000, i * 64 + j)).collect();
    let t = (0..o)
        .map(|k| (x[k] * 2.0).sin() + 0.5 * x[(k + 1) % d] * x[(k + 7) % d])
        .collect();
    (x, t)
}

fn batch(first: u64) -> (Vec<f32>, Vec<f32>) {
    let (mut x, mut t) = (Vec::new(), Vec::new());
    for i in first..first + ROWS as u64 {
        let (xs, ts) = sample(i);
        x.extend(xs);
        t.extend(ts);
    }
    (x, t)
}

/// Every crate's error converts into this; the sources are kept.
type Error = Box<dyn std::error::Error + Send + Sync>;

fn rank_main(comm: &mut dyn Communicator, dev: &mut Device) -> Result<Vec<f32>, Error> {
    let (rank, ranks) = (comm.rank(), comm.size());
    let ddp = DdpConfig::default()
        .with_overlap(Overlap::GradReduceAndParamGather)
        .with_bucket_size(Some(2048)); // small buckets: several overlapped bucket groups
    let mut bufs = DataParallelBuffers::new(dev, ranks, rank, specs(), ddp)?;
    bufs.initialize_all(dev, |p| init(p, 0..specs()[p].numel))?;
    let mut parts: Vec<Box<dyn Optimizer>> = Vec::new();
    for (owner, weight_decay) in [(0, 0.01), (1, 0.0)] {
        let rule = AdamW {
            weight_decay,
            ..AdamW::default()
        };
        let (id, cfg) = (OptimizerId(owner), OptimConfig::new(3e-3));
        parts.push(Box::new(DistributedOptimizer::new(
            dev, &bufs, id, rule, cfg, &mut init,
        )?));
    }
    // Weights computed with as dequantized MXFP8 (rowwise forward, columnwise backward).
    let matrices = specs()
        .iter()
        .map(|s| (s.shape.len() == 2).then_some(1))
        .collect::<Vec<_>>();
    let policy = PrecisionPolicy::matrices(ComputeFormat::Mxfp8 { two_d: false }, matrices);
    let chain = Box::new(ChainedOptimizer::new(parts)?);
    let mut trainer = Trainer::new(dev, bufs, chain, policy)?;
    let mlp = model::Mlp::new(dev, ROWS);
    let scalar = dev.alloc(DType::F32, 1);
    let mut losses = Vec::new();
    for step in 0..STEPS {
        let mut iteration = trainer.begin(dev, comm)?;
        let mut loss = 0.0;
        for m in 0..MICROBATCHES {
            let first = ((step * MICROBATCHES + m) * ranks + rank) * ROWS;
            let mut hooks = iteration.microbatch(comm, m + 1 == MICROBATCHES);
            let (x, t) = batch(first as u64);
            loss += mlp.step(dev, &mut hooks, (&x, &t), 1.0 / MICROBATCHES as f32)?;
        }
        // Completes the reductions and steps (the norm overlaps the last reduction).
        iteration.step(dev, comm)?;
        dev.upload(scalar, &[loss / MICROBATCHES as f32])?;
        comm.all_reduce(dev, scalar, ReduceOp::Avg)?;
        losses.push(dev.download::<f32>(scalar)?[0]);
    }
    Ok(losses)
}

/// Trains on `ranks` threads; returns rank 0's per-step mean losses.
fn train(ranks: usize) -> Vec<f32> {
    let results = run_ranks(ranks, GroupConfig::default(), |mut comm, mut dev| {
        rank_main(&mut comm, &mut dev)
    });
    match results.into_iter().next() {
        Some(Ok(Ok(losses))) => losses,
        Some(Ok(Err(e))) => panic!("rank 0: {e}"),
        _ => panic!("rank 0 panicked"),
    }
}

fn main() {
    let ranks = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(4);
    let losses = train(ranks);
    for (step, loss) in losses
        .iter()
        .enumerate()
        .filter(|(s, _)| s % 10 == 9 || *s == 0)
    {
        println!("step {:>3}  loss {loss:.5}", step + 1);
    }
    assert!(
        losses[STEPS - 1] < 0.5 * losses[0],
        "the model did not learn"
    );
}

#[cfg(test)]
mod tests {
    /// The outside model learns at 2 and 4 ranks (each rank reads its own rows, so the global
    /// batch grows with the ranks).
    #[test]
    fn learns_at_two_and_four_ranks() {
        let (two, four) = (super::train(2), super::train(4));
        for losses in [&two, &four] {
            assert!(losses[super::STEPS - 1] < 0.5 * losses[0], "{losses:?}");
        }
    }
}
