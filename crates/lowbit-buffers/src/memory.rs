//! Memory accounting of the buffers: measured from the live allocations, or in closed form from
//! the plan alone (for models too large to instantiate). Tests hold the two equal and equal to
//! the device's own allocation count.

use lowbit_layout::{BufferKey, ParamSpec, ShardingPlan};

use crate::DataParallelBuffers;
use crate::config::DdpConfig;
use crate::error::Result;
use crate::storage::{self, StorageKind};

/// Bytes of one buffer on one rank, by category.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferMemory {
    /// The buffer's key.
    pub key: BufferKey,
    /// Padded elements of the buffer.
    pub numel: usize,
    /// Weights: the persistent parameter region, or the low-precision storage (copies, scales,
    /// tile amaxes, fp8/packed bytes) of its parameters.
    pub weights: usize,
    /// Bytes of a bf16 staging view; it aliases the gradient buffer, so it costs nothing.
    pub staging: usize,
    /// The gradient buffer (this rank's shards where gradients are sharded).
    pub grads: usize,
    /// Staging memory of its own: where gradients are sharded a staging view cannot alias
    /// them (0 otherwise).
    pub staging_own: usize,
}

impl BufferMemory {
    /// The bytes this buffer holds between steps: weights, gradients, own staging.
    pub fn persistent(&self) -> usize {
        self.weights + self.grads + self.staging_own
    }
}

impl DataParallelBuffers {
    /// Memory of every buffer on this rank, measured from the live allocations.
    pub fn memory(&self) -> Vec<BufferMemory> {
        self.buffers
            .iter()
            .map(|b| {
                let bytes = b.storage.memory();
                BufferMemory {
                    key: b.plan.key,
                    numel: b.plan.layout.numel,
                    weights: bytes.weights,
                    staging: bytes.staging,
                    grads: b.grads.byte_len(),
                    staging_own: b.staging_backing.map_or(0, |v| v.byte_len()),
                }
            })
            .collect()
    }

    /// `(parameter-region bytes of buffers that do not alias their gradients, gradient bytes)`.
    /// The MXFP8 copies of staged buffers live outside and are not in the first number.
    pub fn memory_bytes(&self) -> (usize, usize) {
        self.buffers.iter().fold((0, 0), |(p, g), b| {
            let own = if b.storage.kind() == StorageKind::Mxfp8Staged {
                0
            } else {
                b.storage.memory().weights
            };
            let staging = b.staging_backing.map_or(0, |v| v.byte_len());
            (p + own + staging, g + b.grads.byte_len())
        })
    }
}

/// The buffer memory [`DataParallelBuffers::new`] would allocate for `specs` on `dp` ranks,
/// computed from the plan alone (no allocation).
///
/// # Errors
/// Invalid configurations or plans, as [`DataParallelBuffers::new`].
pub fn estimate_buffer_memory(
    specs: &[ParamSpec],
    dp: usize,
    cfg: &DdpConfig,
) -> Result<Vec<BufferMemory>> {
    cfg.validate()?;
    let plan = ShardingPlan::new(specs, &cfg.plan_config(dp))?;
    for bp in plan.buffers() {
        let members: Vec<&ParamSpec> = bp.params.iter().map(|&p| &specs[p]).collect();
        storage::check(bp, &members)?;
    }
    Ok(plan_buffer_memory(&plan, specs, cfg))
}

/// The buffer memory of `plan` (made from `specs`) under `cfg`, in closed form.
pub fn plan_buffer_memory(
    plan: &ShardingPlan,
    specs: &[ParamSpec],
    cfg: &DdpConfig,
) -> Vec<BufferMemory> {
    plan.buffers()
        .iter()
        .map(|bp| {
            let members: Vec<&ParamSpec> = bp.params.iter().map(|&p| &specs[p]).collect();
            let bytes = storage::closed_form(bp, &members, cfg.mxfp8_gather);
            BufferMemory {
                key: bp.key,
                numel: bp.layout.numel,
                weights: bytes.weights,
                staging: bytes.staging,
                grads: if bp.strategy.shards_grads() {
                    bp.shard_numel()
                } else {
                    bp.layout.numel
                } * storage::grad_dtype(bp.key.grad_dtype).size(),
                staging_own: if bp.strategy.shards_grads()
                    && storage::stages_through_grads(bp, cfg.mxfp8_gather)
                {
                    bp.layout.numel * 2
                } else {
                    0
                },
            }
        })
        .collect()
}

/// The most bytes of transient buffers the buffers of `plan` hold at once during a step:
/// communication buckets (sharded gradients, or a communication dtype other than the
/// gradients') and gathered units (sharded parameters).
///
/// The bound, per bucket group (one per bucket): with overlapped reduction at most two
/// communication buckets are alive (the one the backward fills and the newest launched: a
/// new one completes older launches first), for a model that completes one unit's gradients
/// before it writes the next unit's; without it every sharded-gradient group fills during the
/// backward and is reduced after it, so all of them plus the largest other one. Units: the
/// one in use and the prefetched one with overlapped gathers, one without.
pub fn transient_bound(plan: &ShardingPlan, cfg: &DdpConfig) -> usize {
    let (mut sharded, mut other, mut units) = (Vec::new(), Vec::new(), Vec::new());
    for bp in plan.buffers() {
        let main = storage::grad_dtype(bp.key.grad_dtype);
        let comm = cfg.grad_comm_dtype.map_or(main, storage::grad_dtype);
        for b in &bp.layout.buckets {
            if bp.strategy.shards_grads() {
                sharded.push(b.numel() * comm.size());
            } else if comm != main {
                other.push(b.numel() * comm.size());
            }
            if bp.strategy.shards_params() {
                units.push(b.numel() * storage::persistent_dtype(bp.key.param_storage).size());
            }
        }
    }
    let largest = |v: &mut Vec<usize>, k: usize| -> usize {
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.iter().take(k).sum()
    };
    let comm = if cfg.overlap.grad_reduce() {
        sharded.append(&mut other);
        largest(&mut sharded, 2)
    } else {
        sharded.iter().sum::<usize>() + largest(&mut other, 1)
    };
    let units = largest(&mut units, if cfg.overlap.param_gather() { 2 } else { 1 });
    comm + units
}
