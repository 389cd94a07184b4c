//! Memory of one rank by category: measured from the live buffers and optimizer, or in closed
//! form from the plan alone.

use lowbit_buffers::{BufferMemory, DataParallelBuffers, DdpConfig, plan_buffer_memory};
use lowbit_layout::{GradDType, OptimizerId, ParamSpec, ShardingPlan};

use crate::error::Result;
use crate::optimizer::{MasterDtype, Optimizer};
use crate::rule::UpdateRule;

/// Memory of one rank by category, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankMemory {
    /// Every parameter/gradient buffer.
    pub buffers: Vec<BufferMemory>,
    /// fp32 master shards.
    pub masters: usize,
    /// Optimizer state (AdamW moments, SGD momentum).
    pub optimizer_state: usize,
    /// fp32 copies of the reduced gradient shards the update reads (zero with fp32 gradients,
    /// which are used in place, and for rules that read bf16/f16 gradients as they are).
    pub grad_scratch: usize,
}

/// What the closed form needs to know of an owner's update rule: its fp32 state tensors per
/// element (AdamW 2, SGD with momentum 1) and whether its optimizer widens low-precision
/// gradients into an f32 copy. A bare count converts with the copy (the conservative form);
/// [`RuleMemory::of`] asks the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RuleMemory {
    /// fp32 state tensors per master element.
    pub state_tensors: usize,
    /// Whether bf16/f16 gradient shards get an f32 copy (4 bytes per owned element).
    pub widens_low_precision_grads: bool,
}

impl From<usize> for RuleMemory {
    fn from(state_tensors: usize) -> Self {
        RuleMemory {
            state_tensors,
            widens_low_precision_grads: true,
        }
    }
}

impl RuleMemory {
    /// What a [`crate::DistributedOptimizer`] with `rule` and `masters` holds per element.
    pub fn of(rule: &dyn UpdateRule, masters: MasterDtype) -> Self {
        RuleMemory {
            state_tensors: rule.state_names().len(),
            widens_low_precision_grads: !(masters == MasterDtype::F32
                && rule.reads_low_precision_grads()),
        }
    }
}

impl RankMemory {
    /// Weight bytes (persistent parameter buffers and low-precision storage).
    pub fn weights(&self) -> usize {
        self.buffers.iter().map(|b| b.weights).sum()
    }
    /// Staging bytes (aliased with the gradients: not allocated).
    pub fn staging(&self) -> usize {
        self.buffers.iter().map(|b| b.staging).sum()
    }
    /// Gradient buffer bytes.
    pub fn grads(&self) -> usize {
        self.buffers.iter().map(|b| b.grads).sum()
    }
    /// Staging memory of its own (where sharded gradients leave nothing to alias).
    pub fn staging_own(&self) -> usize {
        self.buffers.iter().map(|b| b.staging_own).sum()
    }
    /// Everything allocated (aliased staging excluded: it is the gradient memory).
    pub fn total(&self) -> usize {
        self.weights()
            + self.grads()
            + self.staging_own()
            + self.masters
            + self.optimizer_state
            + self.grad_scratch
    }
}

/// What this rank holds, measured from the live buffers and optimizer.
pub fn memory_report(bufs: &DataParallelBuffers, opt: &dyn Optimizer) -> RankMemory {
    let m = opt.memory();
    RankMemory {
        buffers: bufs.memory(),
        masters: m.masters,
        optimizer_state: m.state,
        grad_scratch: m.grad_scratch,
    }
}

/// What rank `rank` of `dp` would hold for `specs` under `cfg`, from the plan alone (closed
/// form, no allocation); `rule(owner)` describes the owner's update rule ([`RuleMemory`]; a
/// bare count of fp32 state tensors, AdamW 2 and SGD with momentum 1, assumes low-precision
/// gradients are widened into f32 copies).
///
/// # Errors
/// Invalid configurations or plans.
pub fn estimate_memory<R: Into<RuleMemory>>(
    specs: &[ParamSpec],
    dp: usize,
    rank: usize,
    cfg: &DdpConfig,
    rule: impl Fn(OptimizerId) -> R,
) -> Result<RankMemory> {
    cfg.validate()?;
    let plan = ShardingPlan::new(specs, &cfg.plan_config(dp))?;
    let (mut masters, mut optimizer_state, mut grad_scratch) = (0, 0, 0);
    for piece in plan.owned(rank)? {
        let key = plan.buffers()[piece.buffer].key;
        let owned = piece.param_range.len();
        let r: RuleMemory = rule(key.owner).into();
        masters += 4 * owned;
        optimizer_state += 4 * owned * r.state_tensors;
        if key.grad_dtype != GradDType::F32 && r.widens_low_precision_grads {
            grad_scratch += 4 * owned;
        }
    }
    Ok(RankMemory {
        buffers: plan_buffer_memory(&plan, specs, cfg),
        masters,
        optimizer_state,
        grad_scratch,
    })
}
