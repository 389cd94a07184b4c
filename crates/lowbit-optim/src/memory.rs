//! Memory of one rank by category: measured from the live buffers and optimizer, or in closed
//! form from the plan alone.

use lowbit_buffers::{BufferMemory, DataParallelBuffers, DdpConfig, plan_buffer_memory};
use lowbit_layout::{GradDType, OptimizerId, ParamSpec, ShardingPlan};

use crate::error::Result;
use crate::optimizer::Optimizer;

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
    /// which are used in place).
    pub grad_scratch: usize,
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
/// form, no allocation); `state_tensors(owner)` is the number of fp32 state tensors of the
/// owner's update rule (AdamW 2, SGD with momentum 1).
///
/// # Errors
/// Invalid configurations or plans.
pub fn estimate_memory(
    specs: &[ParamSpec],
    dp: usize,
    rank: usize,
    cfg: &DdpConfig,
    state_tensors: impl Fn(OptimizerId) -> usize,
) -> Result<RankMemory> {
    cfg.validate()?;
    let plan = ShardingPlan::new(specs, &cfg.plan_config(dp))?;
    let (mut masters, mut optimizer_state, mut grad_scratch) = (0, 0, 0);
    for piece in plan.owned(rank)? {
        let key = plan.buffers()[piece.buffer].key;
        let owned = piece.param_range.len();
        masters += 4 * owned;
        optimizer_state += 4 * owned * state_tensors(key.owner);
        if key.grad_dtype != GradDType::F32 {
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
