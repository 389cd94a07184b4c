//! Where every parameter and gradient element lives: buffer layouts for data-parallel training.
//!
//! # Purpose
//! Data-parallel training flattens parameters and gradients into a few contiguous buffers. It
//! reduces gradients bucket by bucket, shards each bucket across the data-parallel (DP) ranks and
//! all-gathers parameters shard by shard. This crate decides all of those positions. The
//! [`layout`] module holds the pure functions:
//! - grouping parameters into buffers ([`layout::group_params`]);
//! - the two Megatron-LM layout rules, classic DDP and distributed optimizer
//!   ([`layout::compute_layout`]);
//! - the per-rank shard ranges and each rank's piece of every parameter
//!   ([`layout::shard_range`], [`layout::param_shard_ranges`]);
//! - the packed byte map of NVFP4 parameter buffers ([`layout::packed_layout`]);
//! - each expert's slice of a grouped expert tensor ([`layout::expert_slices`]).
//!
//! The stateful buffers, buckets, bucket groups, grad sync and param sync are built on these
//! layouts. They live in other modules of this crate, on top of `lowbit-device` and `lowbit-comm`.
//! The layout module depends on neither.
//!
//! The rules reproduce Megatron-LM (`param_and_grad_buffer.py`, `distrib_optimizer.py`,
//! `param_layout.py`) exactly, as described in the project's research notes
//! (`reference/research/megatron_ddp_distopt.md`, §1.1–§1.7 and §2.1). That way layouts, bucket
//! sizes and shard boundaries can be compared number for number. [`layout`] lists the deliberate
//! differences.
//!
//! # Invariants
//! All offsets count **elements**, except in a [`layout::PackedLayout`], which counts bytes.
//! - **Deterministic.** A layout is a pure function of the parameter list (in forward order) and
//!   a [`layout::LayoutConfig`]. It never depends on hashing, threads or memory addresses.
//! - **One buffer key per buffer.** All parameters of a layout share one [`layout::BufferKey`]:
//!   parameter storage, gradient dtype, expert flag and owning optimizer. So no bucket, and no
//!   bucket group built from one buffer's buckets, mixes optimizer owners, dtypes or expert and
//!   dense parameters.
//! - **One index space per buffer.** Parameters never overlap, and every parameter lies in
//!   exactly one bucket. Buckets are contiguous and tile `[0, numel)` in order. A parameter's
//!   bucket-local range is its global range minus the bucket start, padding included.
//! - **Alignment (distributed optimizer).** Under the distributed optimizer, parameter starts
//!   are multiples of 64 elements. Bucket ends are multiples of `lcm(dp, 128)`, or of
//!   `lcm(dp, 128, 2^16)` with high-bus-bandwidth padding. Without it, there is no padding at all.
//! - **Shards.** Rank `r` of `dp` owns the `r`-th of `dp` equal contiguous pieces of every
//!   bucket. Every element of every parameter is owned by exactly one rank. The layout records
//!   its shard count, which must equal the size of the collective group
//!   ([`layout::check_shard_count`]).
//! - **Packed NVFP4.** A packed byte offset is always its element offset divided by two, and
//!   this includes every shard boundary. Each rank's packed shard is exactly the bytes of the
//!   elements of its gradient shard.
//!
//! # Non-goals
//! - The layout module allocates no memory and knows nothing of devices, ranks or collectives.
//! - It contains no optimizer math.
//! - It does not partition buckets into bucket groups; that is stateful code.
//! - Megatron's merge of non-quantized buckets into the last quantized bucket group is not
//!   reproduced: it can mix optimizer owners in one group.
//! - The layer-wise (Muon) shard-aligned layout is not part of [`layout`].

pub mod ddp;
pub use lowbit_layout as layout;

pub use ddp::{
    BufKind, BufferError, BufferMemory, DataParallelBuffers, DdpConfig, Mxfp8Weights, Nvfp4Weights,
    OwnedShard, ParamSyncState, WeightState, buffer_memory, estimate_buffer_memory, matrix_dims,
    mxfp8_weight_config, nvfp4_weight_config,
};
