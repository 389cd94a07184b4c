//! Memory accounting of the buffers: measured from the live allocations, or in closed form from
//! the plan alone (for models too large to instantiate). Tests hold the two equal and equal to
//! the device's own allocation count.

use lowbit_layout::{
    BufferKey, ParamSpec, ParamStorage, QuantKind, ShardingPlan, chunk_rows, matrix_dims,
};

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
                    && !bp.strategy.shards_params()
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
/// The bound, per bucket group (one per bucket), for a model that completes a unit's gradients
/// before it writes the next unit's of the same buffer: with overlapped reduction, each
/// buffer's largest bucket (the one its backward may be filling) and the largest of the other
/// buckets (the newest launched: a new bucket completes older launches first); without it
/// every sharded-gradient group fills during the backward and is reduced after it, so all of
/// them plus the largest other one. Units: the one in use and the prefetched one with
/// overlapped gathers, one without; MXFP8 units hold both copies of the unit in use and, for
/// the prefetched one, both copies or (fine-grained) the larger one.
pub fn transient_bound(plan: &ShardingPlan, specs: &[ParamSpec], cfg: &DdpConfig) -> usize {
    let (mut sharded, mut other, mut units) = (Vec::new(), Vec::new(), Vec::new());
    // Low-precision units: (rowwise, columnwise) bytes.
    let mut copies: Vec<(usize, usize)> = Vec::new();
    // With overlap: per buffer, its largest bucket (the one its backward may be filling),
    // and the largest of the rest (the newest launched).
    let (mut filling, mut rest) = (0usize, 0usize);
    for bp in plan.buffers() {
        let mut mine: Vec<usize> = Vec::new();
        let main = storage::grad_dtype(bp.key.grad_dtype);
        let comm = cfg.grad_comm_dtype.map_or(main, storage::grad_dtype);
        let dp = bp.layout.num_shards;
        for b in &bp.layout.buckets {
            if bp.strategy.shards_grads() {
                sharded.push(b.numel() * comm.size());
                mine.push(b.numel() * comm.size());
            } else if comm != main {
                other.push(b.numel() * comm.size());
                mine.push(b.numel() * comm.size());
            }
            if !bp.strategy.shards_params() {
                continue;
            }
            if bp.key.param_storage.is_quantized() {
                let mxfp8 = bp.key.param_storage == ParamStorage::Quantized(QuantKind::Mxfp8);
                let (row, col) = b.params.iter().fold((0, 0), |(r, c), &i| {
                    let (rows, cols) = matrix_dims(&specs[bp.params[i]].shape);
                    if mxfp8 {
                        let p = storage::part_bytes(chunk_rows(rows, dp, 32), cols);
                        (r + dp * (p[0] + p[1]), c + dp * (p[2] + p[3]))
                    } else {
                        // NVFP4: the gathered bytes and everything derived from them.
                        let n: usize = storage::nvfp4_unit_bytes(rows, cols, dp).iter().sum();
                        (r + n, c)
                    }
                });
                copies.push((row, col));
            } else {
                units.push(b.numel() * storage::storage_dtype(bp.key.param_storage).size());
            }
        }
        mine.sort_unstable_by(|a, b| b.cmp(a));
        filling += mine.first().copied().unwrap_or(0);
        rest = rest.max(mine.get(1).copied().unwrap_or(0));
    }
    let largest = |v: &mut Vec<usize>, k: usize| -> usize {
        v.sort_unstable_by(|a, b| b.cmp(a));
        v.iter().take(k).sum()
    };
    let comm = if cfg.overlap.grad_reduce() {
        filling + rest
    } else {
        sharded.iter().sum::<usize>() + largest(&mut other, 1)
    };
    let k = if cfg.overlap.param_gather() { 2 } else { 1 };
    let units = largest(&mut units, k);
    // Both copies of the unit in use; the prefetched one's copy (or both, without
    // fine-grained gathers).
    let both = copies.iter().map(|&(r, c)| r + c).max().unwrap_or(0);
    let one = match cfg.unit_gather {
        crate::UnitGather::PerUsage => copies.iter().map(|&(r, c)| r.max(c)).max(),
        _ => Some(both),
    }
    .unwrap_or(0);
    comm + units + both + (k - 1) * one
}
