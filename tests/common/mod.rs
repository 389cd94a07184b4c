//! The one helper the data-parallel integration tests go through: [`train`] runs the test model
//! on N rank threads with a given configuration and returns each rank's losses, gradient
//! digests, grad norms, fp32 masters and final weight bytes, and, with [`Run::probe`], per step
//! and phase the quantization calls, parameter all-gathers, bucket-group states and the staging
//! views' contents before their gather.

#![allow(dead_code)] // each test file uses part of the harness

use lowbit::buffers::protocol::StepProtocol;
use std::path::Path;
use std::time::Duration;

use lowbit::buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingPlan,
    ShardingStrategy,
};
use lowbit::buffers::{
    BufferError, ComputeFormat, DataParallelBuffers, DdpConfig, GradAccumulation, Hooks,
    Mxfp8Gather, Overlap, ParamSyncState, PrecisionPolicy, StorageKind, Usage, Verify, WeightState,
};
use lowbit::comm::{Communicator, GroupConfig, run_ranks};
use lowbit::device::{CountedOp, DType, Device, bf16};
use lowbit::layout::LayoutError;
use lowbit::model::{Mlp, MlpShape, sample};
use lowbit::optim::{
    AdamW, ChainedOptimizer, DistributedOptimizer, MasterShard, Muon, MuonConfig, NsDtype,
    OptimConfig, Optimizer, Sgd, init_from_full,
};
use lowbit_train::Trainer;

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

/// Which optimizers own the parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimChoice {
    /// AdamW for owner 0 (the matrices, or everything when not chained), SGD for owner 1 (biases
    /// and norms) when chained.
    AdamW,
    /// Muon for owner 0 (matrices, whole, planned layer-wise), chained with a nested chain of
    /// distributed AdamW (owner 1: biases and the matrices Muon does not own) and SGD (owner 2:
    /// norms). Without [`Run::chained`] Muon owns everything (and refuses the vectors).
    Muon(MuonRun),
}

/// Muon's part of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MuonRun {
    /// The Newton–Schulz dtype (f32: exact on every backend; bf16: `torch.optim.Muon`'s).
    pub ns: NsDtype,
    /// Muon on the hidden matrices only (`blocks.*.weight`); the input and output matrices (the
    /// embedding and head of a language model) go to AdamW, in low precision too.
    pub hidden_only: bool,
}

impl MuonRun {
    /// f32 Newton–Schulz on every matrix.
    pub const F32: MuonRun = MuonRun {
        ns: NsDtype::F32,
        hidden_only: false,
    };
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
    /// Owner 0 (the matrices' AdamW) owns whole parameters (the layer-wise plan rule). Always
    /// so under Muon.
    pub layerwise: bool,
    /// Which optimizers own the parameters.
    pub optimizer: OptimChoice,
    /// Record [`StepProbe`]s (read-only: the trajectory is the same either way).
    pub probe: bool,
    /// Save a checkpoint, or start from one.
    pub ckpt: Option<CkptHook>,
    /// Step with `Iteration::step` (the norm beside the reductions in flight) instead of
    /// `finish_grad_sync` then `GradsReady::step`; the reduced gradients are not recorded then.
    /// Ignored with `probe`, which observes the two calls apart.
    pub one_call_step: bool,
    /// Let the distributed optimizers update, stage and gather bucket group by bucket group
    /// (`DistributedOptimizer::with_pipelined_step`; the default); off: update everything,
    /// then stage.
    pub pipelined_step: bool,
}

/// A checkpoint in a run (`lowbit-ckpt`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CkptHook {
    /// After step `n` (from 1) and its eval: a forced sync, then a save into the root.
    SaveAfter(usize, &'static Path),
    /// Load `root/step-n` (any dp, any strategy) and run steps `n..steps`: losses, norms, grads
    /// and evals then start at step `n + 1`.
    ResumeFrom(usize, &'static Path),
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
            optimizer: OptimChoice::AdamW,
            probe: false,
            ckpt: None,
            one_call_step: false,
            pipelined_step: true,
        }
    }

    /// [`Run::new`] with Muon (f32 Newton–Schulz, every matrix) layer-wise, chained with AdamW
    /// and SGD on the rest.
    pub fn muon(dp: usize) -> Run {
        Run {
            optimizer: OptimChoice::Muon(MuonRun::F32),
            layerwise: true,
            ..Run::new(dp)
        }
    }

    /// Whether owner 0 is planned layer-wise.
    pub fn owner0_layerwise(&self) -> bool {
        self.layerwise || matches!(self.optimizer, OptimChoice::Muon(_))
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
    /// Per step, with [`Run::probe`].
    pub probes: Vec<StepProbe>,
    /// This rank's owned pieces of low-precision parameters (every owner).
    pub owned_low_precision_pieces: usize,
    /// Per bucket group: its owner and whether its weights are low precision.
    pub groups: Vec<(u32, bool)>,
}

/// Calls of each [`CountedOp`], in [`CountedOp::ALL`]'s order.
pub type OpCounts = [u64; CountedOp::ALL.len()];

/// The phases of one step in [`rank_main`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// `Trainer::begin`: zero the gradients, stage stale owners.
    Begin = 0,
    /// Every microbatch's forward and backward (lazy gathers under overlapped param gather).
    Microbatches = 1,
    /// `finish_grad_sync` and `step`: norm, clip, apply, stage + gather unless overlapped.
    Step = 2,
    /// The forced sync and eval after the step, if any.
    After = 3,
}

/// The state of one bucket group: its low-precision weights and its param-gather dispatch.
pub type GroupState = (WeightState, ParamSyncState);

/// What one rank saw during one step (with [`Run::probe`]).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepProbe {
    /// Counted quantization calls per [`Phase`].
    pub quant: [OpCounts; 4],
    /// All-gather calls per [`Phase`] (each bucket of a group gathered is one; the grad-norm
    /// exchange of a sharded plan is one more in [`Phase::Step`]).
    pub all_gathers: [u64; 4],
    /// Every group's state after `begin`, after the microbatches and after the step.
    pub after_begin: Vec<GroupState>,
    pub after_microbatches: Vec<GroupState>,
    pub after_step: Vec<GroupState>,
    /// Owned pieces of MXFP8-staged parameters whose staging bytes were checked after `begin`
    /// (before any gather of the step) against `bf16(master)` of the last update.
    pub staged_pieces_checked: usize,
    /// Pieces whose staging bytes were wrong (staged: not `bf16(master)`; otherwise not zero).
    pub staging_mismatches: Vec<String>,
}

impl StepProbe {
    /// Calls of `op` in `phase`.
    pub fn calls(&self, phase: Phase, op: CountedOp) -> u64 {
        self.quant[phase as usize][op_index(op)]
    }
}

fn op_index(op: CountedOp) -> usize {
    CountedOp::ALL
        .iter()
        .position(|&o| o == op)
        .expect("in ALL")
}

/// The device's counted calls now.
pub fn op_counts(dev: &Device) -> OpCounts {
    CountedOp::ALL.map(|op| dev.op_calls(op))
}

/// Counted quantization calls and all-gather calls at the start of a phase.
struct PhaseClock {
    quant: OpCounts,
    all_gathers: u64,
}

impl PhaseClock {
    fn start(dev: &Device, comm: &dyn Communicator) -> PhaseClock {
        PhaseClock {
            quant: op_counts(dev),
            all_gathers: comm.stats().all_gather.calls,
        }
    }

    /// Records the calls since the start into `probe` as `phase`'s and starts the next phase.
    fn close(
        &mut self,
        phase: Phase,
        dev: &Device,
        comm: &dyn Communicator,
        probe: &mut StepProbe,
    ) {
        let now = PhaseClock::start(dev, comm);
        probe.quant[phase as usize] = std::array::from_fn(|i| now.quant[i] - self.quant[i]);
        probe.all_gathers[phase as usize] = now.all_gathers - self.all_gathers;
        *self = now;
    }
}

fn group_states(bufs: &DataParallelBuffers) -> Vec<GroupState> {
    (0..bufs.num_groups())
        .map(|g| (bufs.weight_state(g), bufs.param_sync_state(g)))
        .collect()
}

pub fn is_matrix(name: &str) -> bool {
    name.ends_with(".weight")
}

/// The owner of parameter `name` in `run` (see [`OptimChoice`]).
pub fn owner_of(run: &Run, name: &str) -> usize {
    match run.optimizer {
        OptimChoice::AdamW => usize::from(run.chained && !is_matrix(name)),
        OptimChoice::Muon(_) if !run.chained => 0,
        OptimChoice::Muon(m) => {
            let muon = is_matrix(name) && (!m.hidden_only || name.starts_with("blocks."));
            if muon {
                0
            } else if name.ends_with(".norm") {
                2
            } else {
                1
            }
        }
    }
}

pub fn specs(run: &Run) -> Vec<ParamSpec> {
    SHAPE
        .params()
        .into_iter()
        .map(|(name, shape)| {
            let owner = owner_of(run, &name) as u32;
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

/// The harness's Muon: `torch.optim.Muon`'s defaults (momentum 0.95, Nesterov, 5 quintic
/// Newton–Schulz steps, the original lr scale) with weight decay 0.01 and the run's NS dtype.
pub fn muon_config(m: MuonRun) -> MuonConfig {
    MuonConfig::default()
        .with_weight_decay(0.01)
        .with_ns_dtype(m.ns)
}

/// Muon's learning rate.
pub const MUON_LR: f32 = 2e-2;

/// The optimizers of a run: AdamW for owner 0, SGD for owner 1 when chained; or Muon for owner
/// 0 chained with (AdamW for owner 1, SGD for owner 2).
pub fn optimizers(
    run: &Run,
    dev: &mut Device,
    bufs: &DataParallelBuffers,
    init: &[Vec<f32>],
) -> Result<ChainedOptimizer, lowbit::optim::OptimError> {
    if let OptimChoice::Muon(m) = run.optimizer {
        let muon = Muon::new(
            dev,
            bufs,
            OptimizerId(0),
            muon_config(m),
            optim(MUON_LR, run.clip),
            &mut init_from_full(init),
        )?;
        if !run.chained {
            return ChainedOptimizer::new(vec![Box::new(muon)]);
        }
        let adamw = DistributedOptimizer::new(
            dev,
            bufs,
            OptimizerId(1),
            adamw(),
            optim(3e-3, run.clip),
            &mut init_from_full(init),
        )?
        .with_pipelined_step(run.pipelined_step);
        let sgd = DistributedOptimizer::new(
            dev,
            bufs,
            OptimizerId(2),
            Sgd {
                momentum: 0.9,
                weight_decay: 0.0,
            },
            optim(1e-2, run.clip),
            &mut init_from_full(init),
        )?
        .with_pipelined_step(run.pipelined_step);
        // Nested: the rest is one chain of its own.
        let rest = ChainedOptimizer::new(vec![Box::new(adamw), Box::new(sgd)])?;
        return ChainedOptimizer::new(vec![Box::new(muon), Box::new(rest)]);
    }
    let mut parts: Vec<Box<dyn Optimizer>> = vec![Box::new(
        DistributedOptimizer::new(
            dev,
            bufs,
            OptimizerId(0),
            adamw(),
            optim(3e-3, run.clip),
            &mut init_from_full(init),
        )?
        .with_pipelined_step(run.pipelined_step),
    )];
    if run.chained {
        let sgd = Sgd {
            momentum: 0.9,
            weight_decay: 0.0,
        };
        parts.push(Box::new(
            DistributedOptimizer::new(
                dev,
                bufs,
                OptimizerId(1),
                sgd,
                optim(1e-2, run.clip),
                &mut init_from_full(init),
            )?
            .with_pipelined_step(run.pipelined_step),
        ));
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

/// The plan of a run: the buffers' strategy, owner 0 layer-wise where [`Run::owner0_layerwise`].
pub fn plan(run: &Run) -> Result<ShardingPlan, LayoutError> {
    let mut plan = run.ddp.plan_config(run.dp);
    if run.owner0_layerwise() {
        plan = plan.with_owner_strategy(OptimizerId(0), ShardingStrategy::LayerWise);
    }
    ShardingPlan::new(&specs(run), &plan)
}

/// Rank `rank`'s buffers of a run, initialized from [`MlpShape::init`] (seed 7).
pub fn buffers(
    run: &Run,
    dev: &mut Device,
    rank: usize,
) -> Result<DataParallelBuffers, BufferError> {
    let plan = plan(run)?;
    let mut bufs = DataParallelBuffers::with_plan(dev, rank, specs(run), plan, run.ddp)?;
    let init = SHAPE.init(7);
    bufs.initialize_all(dev, |p| init[p].clone())?;
    Ok(bufs)
}

/// Compares the staging bytes of this rank's owned pieces of MXFP8-staged parameters with what
/// must be there after `begin` and before any gather: `bf16(master)` of the last update for a
/// staged group, zeros otherwise (zeroed with the gradients, nothing staged).
fn check_staging(
    dev: &Device,
    bufs: &DataParallelBuffers,
    masters: &[MasterShard],
    probe: &mut StepProbe,
) -> Result<(), String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    for s in bufs.owned_shards().map_err(|x| e(&x))? {
        if bufs.storage_kind(s.param) != StorageKind::Mxfp8Staged {
            continue;
        }
        let view = bufs
            .param_view(s.param)
            .and_then(|v| Ok(v.slice(s.param_range.clone())?))
            .map_err(|x| e(&x))?;
        let got: Vec<u16> = dev
            .download::<bf16>(view)
            .map_err(|x| e(&x))?
            .iter()
            .map(|b| b.to_bits())
            .collect();
        let staged = bufs.weight_state(bufs.group_of(s.param)) == WeightState::Staged;
        let want: Vec<u16> = if staged {
            let m = masters
                .iter()
                .find(|m| m.param == s.param && m.range == s.param_range)
                .ok_or_else(|| format!("no master for param {} {:?}", s.param, s.param_range))?;
            m.values
                .iter()
                .map(|&v| bf16::from_f32(v).to_bits())
                .collect()
        } else {
            vec![0; got.len()]
        };
        if staged {
            probe.staged_pieces_checked += 1;
        }
        if got != want {
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            probe.staging_mismatches.push(format!(
                "param {} {:?} ({}): {bad} of {} staging elements differ",
                s.param,
                s.param_range,
                if staged { "staged" } else { "not staged" },
                got.len()
            ));
        }
    }
    Ok(())
}

/// One rank's training loop, through the public step driver only.
pub fn rank_main(
    run: &Run,
    comm: &mut dyn Communicator,
    dev: &mut Device,
) -> Result<Outcome, String> {
    let e = |x: &dyn std::fmt::Display| x.to_string();
    let rank = comm.rank();
    let bufs = buffers(run, dev, rank).map_err(|x| e(&x))?;
    let init = SHAPE.init(7);
    let opt = optimizers(run, dev, &bufs, &init).map_err(|x| e(&x))?;
    let owned_low_precision_pieces = bufs
        .owned_shards()
        .map_err(|x| e(&x))?
        .iter()
        .filter(|s| bufs.is_low_precision(s.param))
        .count();
    let groups = (0..bufs.num_groups())
        .map(|g| {
            let p = bufs.group_params(g)[0];
            (bufs.specs()[p].owner().0, bufs.is_low_precision(p))
        })
        .collect();
    let mut trainer = Trainer::new(dev, bufs, Box::new(opt), policy(run)).map_err(|x| e(&x))?;
    let mut first = 0;
    if let Some(CkptHook::ResumeFrom(n, root)) = run.ckpt {
        let dir = root.join(lowbit::ckpt::step_dir_name(n as u64));
        let ck = lowbit::ckpt::Checkpoint::open(&dir).map_err(|x| e(&x))?;
        trainer
            .load_checkpoint(dev, comm, &ck, &lowbit::ckpt::LoadOptions::default())
            .map_err(|x| e(&x))?;
        first = n;
    }
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
        probes: Vec::new(),
        owned_low_precision_pieces,
        groups,
    };
    // The masters of the last update (for the staging check), and the counters at the start of
    // the current phase.
    let mut masters = if run.probe {
        trainer.optimizer().masters(dev).map_err(|x| e(&x))?
    } else {
        Vec::new()
    };
    for step in first..run.steps {
        let mut probe = StepProbe::default();
        let mut clock = PhaseClock::start(dev, comm);
        let mut iteration = trainer.begin(dev, comm).map_err(|x| e(&x))?;
        if run.probe {
            clock.close(Phase::Begin, dev, comm, &mut probe);
            probe.after_begin = group_states(iteration.buffers());
            check_staging(dev, iteration.buffers(), &masters, &mut probe)?;
            clock = PhaseClock::start(dev, comm);
        }
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
        if run.probe {
            clock.close(Phase::Microbatches, dev, comm, &mut probe);
            probe.after_microbatches = group_states(iteration.buffers());
        }
        if run.one_call_step && !run.probe {
            let report = iteration.step(dev, comm).map_err(|x| e(&x))?;
            out.norms.push(report.grad_norm);
        } else {
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
            if run.probe {
                // Downloading the reduced gradients above is not a quantization or a gather.
                clock = PhaseClock::start(dev, comm);
            }
            let report = ready.step(dev, comm).map_err(|x| e(&x))?;
            out.norms.push(report.grad_norm);
            if run.probe {
                clock.close(Phase::Step, dev, comm, &mut probe);
                probe.after_step = group_states(trainer.buffers());
                masters = trainer.optimizer().masters(dev).map_err(|x| e(&x))?;
                clock = PhaseClock::start(dev, comm);
            }
        }
        if run.force_sync_every_step {
            trainer.force_param_sync(dev, comm).map_err(|x| e(&x))?;
        }
        if run.eval_after.contains(&step) {
            let (x, y) = batch(run, rank, step, 0, true);
            let mut hooks = trainer.eval(dev, comm).map_err(|x| e(&x))?;
            let r = mlp.forward_backward(dev, &mut hooks, &x, &y, 0.0);
            out.eval_losses.push(r.map_err(|x| e(&x))?);
        }
        if let Some(CkptHook::SaveAfter(n, root)) = run.ckpt
            && n == step + 1
        {
            // Right after the step (under overlapped gathers: staged, not gathered): seed 000.
            trainer.force_param_sync(dev, comm).map_err(|x| e(&x))?;
            let meta = lowbit::ckpt::Meta {
                step: n as u64,
                ..Default::default()
            };
            let specs = trainer.buffers().specs().to_vec();
            let opts = lowbit::ckpt::SaveOptions::default();
            lowbit::ckpt::save(dev, comm, root, &meta, &specs, trainer.optimizer(), opts)
                .map_err(|x| e(&x))?;
        }
        if run.probe {
            clock.close(Phase::After, dev, comm, &mut probe);
            out.probes.push(probe);
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
    assert_same_from(a, 0, 0, b, what);
}

/// `b` is `a` from step `n + 1` on, bit for bit (`b` resumed from `a`'s checkpoint after step
/// `n`; `evals` of `a`'s eval losses came before it).
pub fn assert_same_from(a: &[Outcome], n: usize, evals: usize, b: &[Outcome], what: &str) {
    assert_eq!(a.len(), b.len());
    assert_eq!(
        bits(&a[0].losses[n..]),
        bits(&b[0].losses),
        "{what}: losses"
    );
    assert_eq!(
        bits(&a[0].eval_losses[evals..]),
        bits(&b[0].eval_losses),
        "{what}: eval losses"
    );
    assert_eq!(
        bits(&a[0].norms[n..]),
        bits(&b[0].norms),
        "{what}: grad norms"
    );
    for step in 0..b[0].grads.len() {
        let (ga, gb) = (full_grads(a, n + step), full_grads(b, step));
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

/// A parity-matrix case on `base`: `steps` steps of 3 microbatches, the rows per rank shrinking
/// with the ranks, on `device` with `ddp`.
pub fn matrix_case(base: Run, steps: usize, device: TestDevice, ddp: DdpConfig) -> Run {
    let dp = base.dp;
    Run {
        steps,
        microbatches: 3,
        rows: 8 / dp.min(4) + 1,
        ddp,
        device,
        ..base
    }
}

/// The ON run (with `fusion` as its gradient accumulation) and the OFF run of `base`, each
/// checked to be identical across its ranks.
pub fn train_on_off(base: Run, fusion: GradAccumulation) -> (Vec<Outcome>, Vec<Outcome>) {
    let on_run = variant(base, true);
    let on = train(Run {
        ddp: on_run.ddp.with_grad_accumulation(fusion),
        ..on_run
    });
    let off = train(variant(base, false));
    assert_ranks_identical(&on);
    assert_ranks_identical(&off);
    (on, off)
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
                            ..matrix_case(Run::new(dp), steps, device, ddp(true, og, op, bucket))
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
                        let (on, off) = train_on_off(base, fusion);
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

/// The low-precision precisions Muon's parity runs over.
pub const LOW_PRECISIONS: [Precision; 3] =
    [Precision::Mxfp8, Precision::Mxfp8Direct, Precision::Nvfp4];

/// Muon's ON/OFF parity matrix: Muon (layer-wise, f32 Newton–Schulz) chained with distributed
/// AdamW and SGD, low-precision parameter gather on against bf16 parameters quantized on the fly,
/// over the low-precision formats, every overlap mode, `buckets` and the data-parallel sizes
/// `dps`. Rotating through the cases: fused and unfused gradient accumulation on the ON side,
/// f32 and bf16 gradients, Muon on every matrix or on the hidden ones only (then the input and
/// output matrices are AdamW's, in low precision too, and at dp 4 two ranks own no Muon matrix).
/// Every pair must train to the same bits. Returns the number of pairs.
pub fn muon_parity_matrix(
    dps: &[usize],
    steps: usize,
    device: TestDevice,
    buckets: &[Option<usize>],
) -> usize {
    let mut cases = 0;
    for precision in LOW_PRECISIONS {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for &bucket in buckets {
                for &dp in dps {
                    // A rotation that does not tie an axis to a dp.
                    let k = cases + cases / dps.len().max(1);
                    let fusion = if k.is_multiple_of(2) {
                        GradAccumulation::Fused
                    } else {
                        GradAccumulation::Unfused
                    };
                    let hidden_only = (k / 2) % 2 == 1;
                    let grad = if (k / 3).is_multiple_of(2) {
                        GradDType::F32
                    } else {
                        GradDType::Bf16
                    };
                    let base = Run {
                        precision,
                        grad,
                        optimizer: OptimChoice::Muon(MuonRun {
                            hidden_only,
                            ..MuonRun::F32
                        }),
                        ..matrix_case(Run::muon(dp), steps, device, ddp(true, og, op, bucket))
                    };
                    let what = format!(
                        "Muon {precision:?} dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?} \
                         {fusion:?} hidden_only={hidden_only} case={cases}"
                    );
                    let (on, off) = train_on_off(base, fusion);
                    assert_eq!(on[0].low_precision_params, 4, "{what}");
                    assert_eq!(off[0].low_precision_params, 0, "{what}");
                    assert_parity(&on, &off, &what);
                    cases += 1;
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
