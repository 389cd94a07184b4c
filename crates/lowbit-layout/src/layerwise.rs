//! The layer-wise layout: every parameter is owned whole by one rank (Megatron-LM's
//! `LayerWiseDistributedOptimizer` layout, for optimizers such as Muon that need whole matrices).
//!
//! STUB: being written; see the functions' docs for the contract.

use std::borrow::Borrow;

use crate::{BufferLayout, LayoutConfig, LayoutError, ParamSpec};

/// The layer-wise layout of one buffer: buckets of `dp` equal shards, each parameter entirely
/// inside one shard, parameters assigned to shards by LPT bin packing on
/// [`layerwise_cost`]. `cfg.distributed_optimizer` is ignored (the layout is always sharded).
pub fn compute_layerwise_layout<P: Borrow<ParamSpec>>(
    params: &[P],
    cfg: &LayoutConfig,
) -> Result<BufferLayout, LayoutError> {
    let _ = (params, cfg);
    Err(LayoutError::Overflow)
}

/// The estimated Newton–Schulz cost of a parameter: `max(m, n) · min(m, n)²` for a matrix
/// (`[rows, cols]`, leading dimensions folded into rows), its numel otherwise.
pub fn layerwise_cost(shape: &[usize]) -> u128 {
    shape.iter().map(|&d| d as u128).product()
}

/// The rank owning parameter `param` (an index into `layout.params`) of a layer-wise layout.
pub fn owner_of_param(layout: &BufferLayout, param: usize) -> Result<usize, LayoutError> {
    let _ = (layout, param);
    Err(LayoutError::Overflow)
}
