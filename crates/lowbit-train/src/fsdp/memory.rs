//! Memory of one rank under a strategy and policy, in closed form: the buffers between steps
//! and the transient buffers of a step (communication buckets, gathered units).

use lowbit_buffers::{BufferMemory, plan_buffer_memory, transient_bound};
use lowbit_layout::{ParamSpec, ShardingPlan};

use super::{FsdpConfig, FsdpError};

/// One rank's buffer memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FsdpMemory {
    /// Per buffer, between steps.
    pub buffers: Vec<BufferMemory>,
    /// Their sum.
    pub persistent: usize,
    /// The most transient bytes alive at once during a step
    /// ([`lowbit_buffers::transient_bound`]).
    pub transient: usize,
}

impl FsdpMemory {
    /// Persistent and transient together: the buffers' peak.
    pub fn peak(&self) -> usize {
        self.persistent + self.transient
    }
}

/// The memory of `specs` (gradient dtypes as [`FsdpConfig::apply`] sets them) on each of
/// `ranks` ranks under `cfg` (with hybrid sharding, `ranks` is the world: the plan is one
/// replica group's), without allocating anything.
///
/// # Errors
/// The configuration's refusals ([`FsdpConfig::validate`]) and the plan's.
pub fn estimate_memory(
    specs: &[ParamSpec],
    ranks: usize,
    cfg: &FsdpConfig,
) -> Result<FsdpMemory, FsdpError> {
    cfg.validate(specs, ranks)?;
    let mut specs = specs.to_vec();
    cfg.apply(&mut specs);
    let ddp = cfg.ddp_config();
    let plan = ShardingPlan::new(&specs, &cfg.plan_config(ranks))
        .map_err(lowbit_buffers::BufferError::from)?;
    let buffers = plan_buffer_memory(&plan, &specs, &ddp);
    Ok(FsdpMemory {
        persistent: buffers.iter().map(BufferMemory::persistent).sum(),
        transient: transient_bound(&plan, &specs, &ddp),
        buffers,
    })
}
