//! The FSDP tests' one harness: the `lowbit-testkit` MLP trained by `dp` rank threads through
//! the public step driver under an [`FsdpConfig`], returning every bit a comparison needs.

#![allow(dead_code, unused_imports)] // each test file uses part of the harness

pub use lowbit_testkit::{bits, run, seed, values};

use std::path::Path;

use lowbit_buffers::layout::{
    GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingPlan,
};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    ComputeFormat, DataParallelBuffers, Hooks, Overlap, PrecisionPolicy, ReplicaMode, Verify,
};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{DistributedOptimizer, OptimConfig, init_from_full};
use lowbit_testkit::harness;
use lowbit_testkit::model::Mlp;
use lowbit_train::Trainer;
use lowbit_train::fsdp::{FsdpConfig, FsdpMemory, Sharding, estimate_memory};

/// Layer widths: 32x32 tiles, several buckets of [`BUCKET`] elements.
pub const DIMS: [usize; 5] = [32, 64, 64, 32, 32];
pub const BATCH: usize = 4;
pub const BUCKET: usize = 2500;

/// One training run.
#[derive(Clone, Copy, Debug)]
pub struct Setup {
    pub dp: usize,
    pub cfg: FsdpConfig,
    /// Matrices stored as MXFP8 primary weights (gathered in low precision); else bf16,
    /// quantized on the fly when `mxfp8_compute`.
    pub mxfp8_storage: bool,
    pub mxfp8_compute: bool,
    /// NVFP4 instead of MXFP8 wherever the two flags above say MXFP8.
    pub nvfp4: bool,
    pub microbatches: usize,
    pub steps: usize,
    /// Run an eval (forward only) after these steps.
    pub eval_after: Option<usize>,
}

impl Setup {
    pub fn new(dp: usize, sharding: Sharding) -> Setup {
        Setup {
            dp,
            cfg: FsdpConfig::new(sharding)
                .with_bucket_size(Some(BUCKET))
                .with_verify(Verify::Full),
            mxfp8_storage: false,
            mxfp8_compute: false,
            nvfp4: false,
            microbatches: 1,
            steps: 4,
            eval_after: None,
        }
    }
}

/// What a run leaves: per step the loss bits and grad norm bits, eval losses, the full masters
/// (assembled from every rank), memory figures of rank 0.
#[derive(Debug, PartialEq)]
pub struct Trace {
    pub losses: Vec<u32>,
    pub norms: Vec<u32>,
    pub evals: Vec<u32>,
    pub masters: Vec<Vec<u32>>,
}

/// Memory of rank 0: live buffers, the closed form, and the device's peak above the bytes
/// allocated before the first step.
#[derive(Debug)]
pub struct Memory {
    pub live_persistent: usize,
    pub estimate: FsdpMemory,
    pub step_peak: usize,
    pub units_seen: usize,
    /// Bytes live right before an optimizer step above those before the first step, the most
    /// of any step: gathered units (released when the gradients are synced) are not.
    pub live_at_step: usize,
    /// The peak during an optimizer step above the bytes live before it, the most of any
    /// step: the step allocates its gradient norm, never a unit.
    pub step_only_peak: usize,
    /// Units gathered right after an optimizer step, the most of any step.
    pub units_after_step: usize,
}

/// The run's parameter specs: matrices in MXFP8 or NVFP4 primary storage when
/// `mxfp8_storage`, else bf16; f32 gradients; one optimizer; the FSDP configuration applied.
pub fn specs(s: &Setup) -> Vec<ParamSpec> {
    let q = if s.nvfp4 {
        QuantKind::Nvfp4
    } else {
        QuantKind::Mxfp8
    };
    let storage = if s.mxfp8_storage {
        ParamStorage::Quantized(q)
    } else {
        ParamStorage::Bf16
    };
    let mut specs = harness::tiny_specs(&DIMS, storage, GradDType::F32, |_| OptimizerId(0));
    s.cfg.apply(&mut specs);
    specs
}

fn policy(specs: &[ParamSpec], quantized: bool, nvfp4: bool) -> PrecisionPolicy {
    let format = if nvfp4 {
        ComputeFormat::Nvfp4
    } else {
        ComputeFormat::Mxfp8 { two_d: false }
    };
    harness::matrix_policy(specs, quantized.then_some(format))
}

fn init(specs: &[ParamSpec]) -> Vec<Vec<f32>> {
    harness::init_values(specs, 77)
}

/// What a run does with a checkpoint under a root directory.
#[derive(Clone, Copy, Debug)]
pub enum Ckpt<'a> {
    /// Saves after this many steps (after a forced sync, as `lowbit train` does).
    SaveAfter(&'a Path, usize),
    /// Starts from the latest checkpoint (`Trainer::load_checkpoint`), at its step.
    Resume(&'a Path),
}

/// Trains `s` and returns the trace and rank 0's memory figures.
pub fn train(s: &Setup) -> (Trace, Memory) {
    train_with(s, None)
}

/// [`train`], saving or resuming as `ck` says (a resumed trace holds the steps it ran). Under
/// hybrid sharding every replica group holds the same shards and the first writes the
/// checkpoint; under HFSDP (the optimizer state split across the groups) every rank writes its
/// pieces over the world; every rank loads.
pub fn train_with(s: &Setup, ck: Option<Ckpt<'_>>) -> (Trace, Memory) {
    let specs = specs(s);
    s.cfg.validate(&specs, s.dp).expect("a supported setup");
    let shard = s.cfg.shard_ranks(s.dp);
    let out = run(s.dp, |mut world, mut dev| {
        let dev: &mut Device = &mut dev;
        // The world rank picks the data; the shard group is the buffers' group.
        let rank = world.rank();
        let groups = s.cfg.split_groups(&mut world).unwrap();
        let split_state = s.cfg.outer_dp > 1 && s.cfg.replica_mode() == ReplicaMode::ShardOptimizer;
        let first_group = groups.as_ref().is_none_or(|g| g.replicas.rank() == 0);
        // The world stays apart only under hybrid sharding (HFSDP saves over it).
        let (mut inner, outer, mut world) = match groups {
            Some(g) => (g.shard, Some(g.replicas), Some(world)),
            None => (Box::new(world) as Box<dyn Communicator>, None, None),
        };
        let comm: &mut dyn Communicator = inner.as_mut();
        let init = init(&specs);
        let plan = ShardingPlan::new(&specs, &s.cfg.plan_config(s.dp)).unwrap();
        let mut bufs = DataParallelBuffers::with_plan(
            dev,
            comm.rank(),
            specs.clone(),
            plan,
            s.cfg.ddp_config(),
        )
        .unwrap();
        if let Some(o) = outer {
            bufs.set_replica_group(o, s.cfg.replica_mode()).unwrap();
        }
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let live_persistent: usize = bufs.memory().iter().map(|m| m.persistent()).sum();
        let opt = DistributedOptimizer::new(
            dev,
            &bufs,
            OptimizerId(0),
            harness::tiny_adamw(),
            OptimConfig::new(1e-2).with_master_dtype(s.cfg.master_dtype()),
            &mut init_from_full(&init),
        )
        .unwrap();
        let pol = policy(&specs, s.mxfp8_compute || s.mxfp8_storage, s.nvfp4);
        let mut trainer = Trainer::new(dev, bufs, Box::new(opt), pol).unwrap();
        let mut first = 0;
        if let Some(Ckpt::Resume(root)) = ck {
            let c = lowbit_ckpt::Checkpoint::open(root).unwrap();
            trainer
                .load_checkpoint(dev, comm, &c, &lowbit_ckpt::LoadOptions::default())
                .unwrap();
            first = c.meta().step as usize;
        }
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        dev.reset_peak();
        let base = dev.allocated_bytes();
        let (mut losses, mut norms, mut evals) = (Vec::new(), Vec::new(), Vec::new());
        let mut units_seen = 0;
        let (mut peak, mut live_at_step, mut step_only_peak) = (base, 0, 0);
        let mut units_after_step = 0;
        for step in first..s.steps {
            let mut it = trainer.begin(dev, comm).unwrap();
            let mut loss = 0.0f32;
            for m in 0..s.microbatches {
                let (x, y) = mlp.sample(rank, step, m);
                let mut hooks = it.microbatch(comm, m + 1 == s.microbatches);
                loss += mlp
                    .forward_backward(dev, &mut hooks, &x, &y, 1.0 / s.microbatches as f32)
                    .unwrap();
                units_seen = units_seen.max(hooks.buffers().gathered_units().len());
            }
            let ready = it.finish_grad_sync(dev, comm).unwrap();
            // Around the optimizer step alone: what is live before it, what it allocates.
            let before = dev.allocated_bytes();
            live_at_step = live_at_step.max(before.saturating_sub(base));
            peak = peak.max(dev.peak_allocated_bytes());
            dev.reset_peak();
            let report = ready.step(dev, comm).unwrap();
            step_only_peak = step_only_peak.max(dev.peak_allocated_bytes() - before);
            units_after_step = units_after_step.max(trainer.buffers().gathered_units().len());
            losses.push(loss.to_bits());
            norms.push(report.grad_norm.to_bits());
            if let Some(Ckpt::SaveAfter(root, n)) = ck
                && n == step + 1
            {
                trainer.force_param_sync(dev, comm).unwrap();
                let meta = lowbit_ckpt::Meta {
                    step: n as u64,
                    ..Default::default()
                };
                let specs = trainer.buffers().specs().to_vec();
                let opts = lowbit_ckpt::SaveOptions::default();
                let opt = trainer.optimizer();
                match world.as_mut() {
                    Some(w) if split_state => {
                        lowbit_ckpt::save(dev, w, root, &meta, &specs, opt, opts).unwrap();
                    }
                    _ if first_group => {
                        lowbit_ckpt::save(dev, comm, root, &meta, &specs, opt, opts).unwrap();
                    }
                    _ => {}
                }
                // Nobody resumes before the checkpoint is committed.
                match world.as_mut() {
                    Some(w) => w.barrier().unwrap(),
                    None => comm.barrier().unwrap(),
                }
            }
            if s.eval_after == Some(step) {
                let (x, y) = mlp.sample(rank, 1000 + step, 0);
                let mut hooks = trainer.eval(dev, comm).unwrap();
                let l = mlp.forward_backward(dev, &mut hooks, &x, &y, 1.0).unwrap();
                evals.push(l.to_bits());
            }
        }
        let step_peak = peak.max(dev.peak_allocated_bytes()) - base;
        let masters = trainer.optimizer().masters(dev).unwrap();
        (
            losses,
            norms,
            evals,
            masters,
            live_persistent,
            step_peak,
            units_seen,
            live_at_step,
            step_only_peak,
            units_after_step,
        )
    });
    let sizes: Vec<usize> = specs.iter().map(|s| s.numel).collect();
    // Replicated masters are whole on every rank: take rank 0's; replica groups hold the same
    // shards: take the first group's.
    let ranks = if s.cfg.sharding == Sharding::NoShard {
        1
    } else if s.cfg.outer_dp > 1 && s.cfg.replica_mode() == ReplicaMode::ShardOptimizer {
        // HFSDP: the replica groups split the shards.
        s.dp
    } else {
        shard
    };
    let masters = harness::assemble_shards(&sizes, out[..ranks].iter().flat_map(|o| o.3.iter()));
    let mut raw = specs.clone();
    raw.iter_mut()
        .for_each(|x| x.key.grad_dtype = GradDType::F32);
    let o = &out[0];
    (
        Trace {
            losses: o.0.clone(),
            norms: o.1.clone(),
            evals: o.2.clone(),
            masters: masters.iter().map(|m| bits(m)).collect(),
        },
        Memory {
            live_persistent: o.4,
            estimate: estimate_memory(&raw, s.dp, &s.cfg).unwrap(),
            step_peak: o.5,
            units_seen: o.6,
            live_at_step: o.7,
            step_only_peak: o.8,
            units_after_step: o.9,
        },
    )
}

/// Every overlap a strategy supports.
pub fn overlaps(sharding: Sharding) -> Vec<Overlap> {
    let mut v = vec![Overlap::None, Overlap::GradReduce];
    if sharding != Sharding::NoShard {
        v.push(Overlap::GradReduceAndParamGather);
    }
    v
}

/// The unused-import guard for `Hooks` (the trait's methods are called through `DpHooks`).
pub fn _uses(_: &dyn Hooks) {}
