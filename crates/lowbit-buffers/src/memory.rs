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
    /// The gradient buffer.
    pub grads: usize,
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
            (p + own, g + b.grads.byte_len())
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
                grads: bp.layout.numel * storage::grad_dtype(bp.key.grad_dtype).size(),
            }
        })
        .collect()
}
