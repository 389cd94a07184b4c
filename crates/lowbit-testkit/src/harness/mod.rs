//! The one training harness of the parity suites: [`train`] runs the regression model
//! ([`crate::model::regression`]) on N rank threads with a given configuration, through the public
//! step driver (`lowbit_train::Trainer`) only, and returns each rank's losses, gradient digests,
//! grad norms, fp32 masters and final weight bytes, and, with [`Run::probe`], per step and phase
//! the quantization calls, parameter all-gathers, bucket-group states and the staging views'
//! contents before their gather.
//!
//! - this module: the run description ([`Run`], [`Precision`], [`OptimChoice`], [`MuonRun`],
//!   [`CkptHook`]), the outcome record ([`Outcome`], [`StepProbe`]) and the builders of specs,
//!   plan, buffers, policy and optimizers a run implies;
//! - [`mod@run`]: one rank's loop ([`rank_main`]) and the launch ([`train`], threads or NCCL);
//! - [`mod@parity`]: bitwise trajectory assertions and the parity matrices;
//! - [`mod@tiny`]: the builders the tests of the tiny [`crate::model::Mlp`] share (the
//!   `lowbit-optim` tests and the FSDP tests of `lowbit-train`).

pub mod parity;
pub mod run;
pub mod tiny;

pub use parity::*;
pub use run::*;
pub use tiny::*;

/// The bitwise comparison every parity assertion uses (one definition, the crate root's).
pub use crate::bits;

use lowbit_buffers::protocol::StepProtocol;
use std::path::Path;
use std::time::Duration;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind, ShardingPlan,
    ShardingStrategy,
};
use lowbit_buffers::{
    BufferError, ComputeFormat, DataParallelBuffers, DdpConfig, GradAccumulation, Hooks,
    Mxfp8Gather, Overlap, ParamSyncState, PrecisionPolicy, StorageKind, Usage, Verify, WeightState,
};
use lowbit_comm::{Communicator, GroupConfig, run_ranks};
use lowbit_device::{CountedOp, DType, Device, bf16};
use lowbit_layout::LayoutError;
use lowbit_optim::{
    AdamW, ChainedOptimizer, DistributedOptimizer, MasterShard, Muon, MuonConfig, NsDtype,
    OptimConfig, Optimizer, Sgd, init_from_full,
};

use crate::model::regression::{MlpShape, sample};

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
/// One training run of the regression model: ranks, device, buffer configuration, precision,
/// optimizer, steps and what to probe. [`Run::new`] is the plain AdamW baseline.
pub struct Run {
    /// Data-parallel ranks.
    pub dp: usize,
    /// Where the ranks run.
    pub device: TestDevice,
    /// The buffers' configuration.
    pub ddp: DdpConfig,
    /// Gradient buffer dtype.
    pub grad: GradDType,
    /// Primary weight precision of the matrices.
    pub precision: Precision,
    /// Low-precision primary weights gathered through the staging view (`Mxfp8` only); off
    /// means bf16 parameters quantized on the fly for compute.
    pub param_gather: bool,
    /// Microbatches per step (gradient accumulation).
    pub microbatches: usize,
    /// Rows per rank per microbatch.
    pub rows: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Global gradient-norm clip, if any.
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
    /// The baseline on `dp` CPU ranks: AdamW, bf16 weights, fp32 gradients, no probes.
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
/// What one rank saw of a run, compared bit for bit across ranks and runs.
pub struct Outcome {
    /// Whether masters and gradients are sharded across ranks (distributed optimizer); without
    /// it every rank holds all of them.
    pub sharded: bool,
    /// Per step, the rank's training loss.
    pub losses: Vec<f32>,
    /// Eval losses, in order.
    pub eval_losses: Vec<f32>,
    /// Per step, the global gradient norm.
    pub norms: Vec<f32>,
    /// Per step, this rank's reduced gradient shards (as f32).
    pub grads: Vec<Vec<MasterShard>>,
    /// Steps skipped for a non-finite gradient norm.
    pub skipped: u64,
    /// This rank's final fp32 masters (all of them when not sharded).
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
    /// Every group's state after the microbatches' backwards.
    pub after_microbatches: Vec<GroupState>,
    /// Every group's state after the step.
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

/// Whether parameter `name` is a matrix (a `.weight`), the parameters Muon and low precision
/// apply to.
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

/// The regression model's parameter specs under `run` (owner, storage, gradient dtype).
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
) -> Result<ChainedOptimizer, lowbit_optim::OptimError> {
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
