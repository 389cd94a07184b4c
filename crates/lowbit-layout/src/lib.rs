//! The sharding plan of data-parallel training: where every parameter and gradient element
//! lives, which rank owns it, and which collective moves it.
//!
//! # Purpose
//! Data-parallel training flattens parameters and gradients into a few contiguous buffers,
//! reduces gradients bucket by bucket, and (when optimizer state is sharded) gathers parameters
//! shard by shard. This crate decides all of those positions, as pure functions of the parameter
//! list and a [`ShardingStrategy`]:
//! - [`ShardingPlan::new`] is the one entry point the stateful layers use: per buffer, its
//!   layout, the collective that reduces its gradients, the one that gathers its parameters, the
//!   process group both run on, and every rank's owned pieces ([`plan`]);
//! - grouping parameters into buffers ([`group_params`]);
//! - Megatron-LM's classic-DDP and distributed-optimizer layouts ([`compute_layout`]) and the
//!   layer-wise layout of whole parameters per rank ([`compute_layerwise_layout`]);
//! - per-rank shard ranges ([`shard_range`], [`param_shard_ranges`]);
//! - the packed byte map of NVFP4 buffers ([`packed_layout`]) and expert slices
//!   ([`expert_slices`]).
//!
//! Downstream projects that bring their own buffers can use this crate alone: it has no
//! dependency besides `thiserror`.
//!
//! # Invariants
//! - **Deterministic.** A plan is a pure function of the parameter list (forward order) and its
//!   configuration; never of hashing, threads or addresses.
//! - **One buffer key per buffer.** All parameters of a buffer share one [`BufferKey`]
//!   (storage, gradient dtype, expert flag, owning optimizer), so no bucket, and no bucket group
//!   built from one buffer, mixes optimizer owners (Megatron-LM's mixed bucket groups: PR #6754 partitions bucket groups by
//!   owning optimizer, PR #4769/#4800 syncs each chained optimizer's groups once).
//! - **Every element owned exactly once.** Under every strategy the owned pieces of all ranks
//!   cover every element of every parameter exactly once (the tests check it exhaustively);
//!   under [`ShardingStrategy::LayerWise`] every parameter is owned whole by one rank.
//! - **Shard count = group size.** A plan records its group size; the buffers check it against
//!   the communicator at every launch (Megatron-LM PR #6048: a shard count other than the
//!   collective group size left parameters owned by no rank).
//! - **Alignment.** Sharded layouts start parameters at multiples of 64 elements and end buckets
//!   at multiples of `lcm(dp, 128)` (or `lcm(dp, 128, 2^16)`); the replicated layout has no
//!   padding.
//! - **Packed NVFP4.** A packed byte offset is its element offset divided by two, shard
//!   boundaries included, so each rank's packed shard is exactly the bytes of its gradient shard.
//!
//! # Non-goals
//! No memory, devices, ranks or collectives are touched here; no optimizer math; no bucket
//! groups (a stateful concern). Megatron's merge of non-quantized buckets into the last
//! quantized bucket group is not reproduced: it can mix optimizer owners in one group.
//!
//! # The layout rules (Megatron-LM)
//! [`compute_layout`] implements the two layout rules of Megatron-LM.
//!
//! **Classic DDP** (`_compute_default_per_buffer_param_layout`):
//! - Parameters are walked in reverse (backward) order.
//! - There is no padding anywhere.
//! - A bucket closes as soon as `param_end - bucket_start >= bucket_size`. The parameter that
//!   crosses the threshold stays in the closing bucket.
//! - `bucket_size: None` gives one bucket.
//! - Shared embeddings are not split off.
//!
//! **Distributed optimizer** (`DistributedOptimizer._compute_per_buffer_param_layout`):
//! - Parameters are walked in reverse order, and every parameter start is rounded up to a
//!   multiple of 64 elements.
//! - After a parameter is placed, its bucket closes if `param_end - bucket_start >= bucket_size`
//!   or if the parameter is a shared embedding.
//! - A shared embedding first closes a non-empty current bucket, so it always sits alone.
//! - A closing bucket's end is padded to a multiple of [`bucket_end_divisor`]. The next bucket
//!   starts there.
//! - A bucket's `numel_unpadded` is measured before that end padding:
//!   `numel_unpadded = end - bucket_start`. Here `end` is the last parameter's end; for a bucket
//!   closed early by a following shared embedding, it is that embedding's 64-aligned start.
//!   Megatron passes `param_start_index` there, so the unpadded size then includes the
//!   shared embedding's start padding. We keep that number so that bucket sizes compare one to
//!   one with Megatron.
//!
//! Shards follow `shard_buffer` and `_build_model_gbuf_param_range_map`. See [`shard_range`] and
//! [`param_shard_ranges`].
//!
//! # Deliberate differences from Megatron-LM
//! - **Buffer key.** Megatron's key ends with "is managed by the layer-wise optimizer". Ours
//!   ends with the owning [`OptimizerId`] instead, so a buffer, and hence every bucket and
//!   bucket group built from it, has exactly one optimizer owner.
//! - **Quantized storage.** Megatron puts every quantized parameter in one `uint8` buffer. Our
//!   key keeps the [`QuantKind`], so MXFP8 and NVFP4 parameters never share a buffer. An NVFP4
//!   buffer therefore holds only NVFP4 parameters. That makes the packed map
//!   ([`packed_layout`]) an exact half of the element map.
//! - **Packed NVFP4 map.** Megatron pads packed parameter starts (64 bytes) and packed bucket
//!   ends independently. Then a rank's packed shard need not be half of its gradient shard
//!   (Megatron-LM `param_and_grad_buffer.py`, the packed NVFP4 path). We derive every packed offset as element offset / 2, and reject
//!   layouts where that is not exact. Packed parameter starts are thus 32-byte aligned (64
//!   elements), not 64-byte aligned.
//! - **Zero-element parameters** are rejected ([`LayoutError::EmptyParam`]). They have no
//!   gradient to reduce and no element any rank could own. As a shared embedding one would
//!   produce an empty bucket, which no collective can shard.
//! - **Validation returns errors.** Conditions that Megatron asserts return a [`LayoutError`]:
//!   bucket divisibility, shard count equal to group size, NVFP4 numel even.

#![forbid(unsafe_code)]

/// Generates `with_*` builder methods on a configuration struct: `$(#[doc] name => field: Type;)*`.
/// Used by this crate's and `lowbit-buffers`' `#[non_exhaustive]` configurations.
#[doc(hidden)]
#[macro_export]
macro_rules! setters {
    ($($(#[$doc:meta])* $name:ident => $field:ident: $ty:ty;)*) => {
        $(
            $(#[$doc])*
            pub fn $name(mut self, $field: $ty) -> Self {
                self.$field = $field;
                self
            }
        )*
    };
}

mod error;
mod layerwise;
mod packed;
pub mod plan;
mod rows;
mod rules;
mod spec;

pub use error::LayoutError;
pub use layerwise::{compute_layerwise_layout, layerwise_cost, owner_of_param};
pub use packed::{
    PackedBucketRange, PackedLayout, PackedParamRange, expert_slices, packed_layout,
    packed_shard_range,
};
pub use plan::{
    BufferPlan, GradReduce, GroupId, MAX_PLAN_NUMEL, OwnedPiece, ParamGather, PlanConfig,
    ShardingPlan, ShardingStrategy, matrix_dims, row_block,
};
pub use rows::{chunk_rows, compute_row_aligned_layout};
pub use rules::*;
pub use spec::*;
