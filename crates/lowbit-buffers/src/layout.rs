//! Pure layout functions: which parameters share a buffer, where each one sits, how buffers split
//! into buckets, and which piece of each bucket every data-parallel rank owns.
//!
//! Units are **elements** (not bytes) everywhere, except in [`PackedLayout`], which counts bytes.
//!
//! # The rules (Megatron-LM)
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
//!   (research notes §1.2(d)). We derive every packed offset as element offset / 2, and reject
//!   layouts where that is not exact. Packed parameter starts are thus 32-byte aligned (64
//!   elements), not 64-byte aligned.
//! - **Zero-element parameters** are rejected ([`LayoutError::EmptyParam`]). They have no
//!   gradient to reduce and no element any rank could own. As a shared embedding one would
//!   produce an empty bucket, which no collective can shard.
//! - **Validation returns errors.** Conditions that Megatron asserts return a [`LayoutError`]:
//!   bucket divisibility, shard count equal to group size, NVFP4 numel even.

#![forbid(unsafe_code)]

use std::borrow::Borrow;
use std::collections::HashMap;
use std::ops::Range;

/// Parameter starts are aligned to this many elements under the distributed optimizer.
pub const PARAM_START_ALIGN: usize = 64;

/// Bucket ends are aligned to a multiple of this many elements (and of `dp`) under the
/// distributed optimizer.
pub const BUCKET_END_ALIGN: usize = 128;

/// The extra bucket-end factor of high-NCCL-bus-bandwidth padding (`2^16` elements).
pub const HIGH_BUSBW_ALIGN: usize = 1 << 16;

/// Identifies the optimizer instance that owns a parameter (and therefore its buffer).
///
/// A small `Copy` id; the optimizer layer decides the numbering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OptimizerId(pub u32);

/// A block-scaled low-precision storage format for primary weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum QuantKind {
    /// MXFP8: E4M3/E5M2 elements with an E8M0 scale per 32 elements. The parameter buffer holds
    /// one byte per element.
    Mxfp8,
    /// NVFP4: E2M1 elements, two per byte. The parameter buffer holds packed bytes (see
    /// [`packed_layout`]); the gradient buffer keeps one element per parameter element.
    Nvfp4,
}

/// How a parameter's primary weights are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ParamStorage {
    /// bfloat16.
    Bf16,
    /// IEEE half precision.
    F16,
    /// IEEE single precision.
    F32,
    /// A quantized format (raw bytes plus scales).
    Quantized(QuantKind),
}

impl ParamStorage {
    /// Whether the storage is a quantized format.
    pub fn is_quantized(self) -> bool {
        matches!(self, Self::Quantized(_))
    }
}

/// The dtype gradients are accumulated and reduced in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GradDType {
    /// fp32 gradients (`grad_reduce_in_fp32`).
    F32,
    /// bfloat16 gradients.
    Bf16,
}

/// What decides which buffer a parameter goes to: parameters share a buffer if and only if their
/// keys are equal.
///
/// Field order is the order of the derived `Ord`, which makes sorted key collections
/// deterministic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BufferKey {
    /// Storage of the primary weights.
    pub param_storage: ParamStorage,
    /// Dtype of the gradient buffer.
    pub grad_dtype: GradDType,
    /// Expert-parallel parameter: reduced over the expert data-parallel group, so it lives in its
    /// own buffer.
    pub expert: bool,
    /// The optimizer instance that owns the parameter.
    pub owner: OptimizerId,
}

/// One parameter, as the layout functions see it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamSpec {
    /// Fully qualified name (for error messages and checkpoints).
    pub name: String,
    /// Number of elements; must equal the product of `shape` and be at least 1.
    pub numel: usize,
    /// Logical shape. A grouped expert weight is one parameter of shape `[experts, out, in]`.
    pub shape: Vec<usize>,
    /// Which buffer the parameter belongs to.
    pub key: BufferKey,
    /// A tied embedding shared across pipeline stages. Under the distributed optimizer it gets a
    /// bucket of its own; the classic DDP layout ignores the flag.
    pub shared_embedding: bool,
}

impl ParamSpec {
    /// A parameter of the given shape (`numel` is the product of `shape`), not a shared
    /// embedding.
    pub fn new(name: impl Into<String>, shape: Vec<usize>, key: BufferKey) -> Self {
        Self {
            name: name.into(),
            numel: shape.iter().product(),
            shape,
            key,
            shared_embedding: false,
        }
    }

    /// Sets the shared-embedding flag.
    pub fn with_shared_embedding(mut self, shared_embedding: bool) -> Self {
        self.shared_embedding = shared_embedding;
        self
    }

    /// The optimizer that owns this parameter.
    pub fn owner(&self) -> OptimizerId {
        self.key.owner
    }
}

/// Groups parameters (given in forward order) by [`BufferKey`].
///
/// Returns one entry per distinct key, with the indices (into `params`) of its parameters in
/// forward order. Groups are ordered by the first appearance of their key in `params`, so the
/// result depends only on the parameter list. Pass each group, in that order, to
/// [`compute_layout`].
pub fn group_params<P: Borrow<ParamSpec>>(params: &[P]) -> Vec<(BufferKey, Vec<usize>)> {
    let mut groups: Vec<(BufferKey, Vec<usize>)> = Vec::new();
    let mut slot: HashMap<BufferKey, usize> = HashMap::new();
    for (index, param) in params.iter().enumerate() {
        let key = param.borrow().key;
        let group = *slot.entry(key).or_insert_with(|| {
            groups.push((key, Vec::new()));
            groups.len() - 1
        });
        groups[group].1.push(index);
    }
    groups
}

/// Rounds `value` up to a multiple of `divisor`.
///
/// # Panics
/// If `divisor` is zero or the result overflows `usize`.
pub fn pad_to_divisor(value: usize, divisor: usize) -> usize {
    checked_pad(value, divisor).expect("pad_to_divisor: zero divisor or overflow")
}

/// The start of a parameter placed at `index` under the distributed optimizer:
/// `ceil(index / 64) * 64`.
///
/// # Panics
/// If the result overflows `usize`.
pub fn pad_param_start(index: usize) -> usize {
    pad_to_divisor(index, PARAM_START_ALIGN)
}

/// The multiple bucket ends are padded to under the distributed optimizer: `lcm(dp, 128)`, or
/// `lcm(dp, 128, 2^16)` with `high_busbw`.
///
/// # Panics
/// If `dp` is zero or the result overflows `usize`.
pub fn bucket_end_divisor(dp: usize, high_busbw: bool) -> usize {
    checked_bucket_end_divisor(dp, high_busbw).expect("bucket_end_divisor: dp == 0 or overflow")
}

/// A bucket end padded to a multiple of [`bucket_end_divisor`]`(dp, high_busbw)`.
///
/// # Panics
/// If `dp` is zero or the result overflows `usize`.
pub fn pad_bucket_end(end: usize, dp: usize, high_busbw: bool) -> usize {
    pad_to_divisor(end, bucket_end_divisor(dp, high_busbw))
}

/// Megatron's default bucket size when gradient reduction overlaps the backward pass:
/// `max(40_000_000, 1_000_000 * dp)` elements. (Without overlap the bucket size is `None`.)
pub fn default_bucket_size(dp: usize) -> usize {
    40_000_000usize.max(1_000_000usize.saturating_mul(dp))
}

/// The knobs of [`compute_layout`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LayoutConfig {
    /// Size of the data-parallel group that reduces this buffer: the DP group, or the expert-DP
    /// group for expert buffers. At least 1.
    pub dp: usize,
    /// Minimum number of elements per bucket (the last bucket may be smaller); `None` gives one
    /// bucket (or, under the distributed optimizer, one plus one per shared embedding). At least 1.
    pub bucket_size: Option<usize>,
    /// The distributed-optimizer (ZeRO-1) layout: padded, sharded into `dp` pieces per bucket.
    /// Otherwise the classic DDP layout: unpadded, one shard.
    pub distributed_optimizer: bool,
    /// Pad bucket ends to `lcm(dp, 128, 2^16)` instead of `lcm(dp, 128)`. Only read under the
    /// distributed optimizer.
    pub high_busbw_padding: bool,
}

impl LayoutConfig {
    /// The classic DDP layout (all-reduce, no padding).
    pub fn ddp(dp: usize, bucket_size: Option<usize>) -> Self {
        Self {
            dp,
            bucket_size,
            distributed_optimizer: false,
            high_busbw_padding: false,
        }
    }

    /// The distributed-optimizer layout (reduce-scatter into `dp` shards per bucket) with
    /// `lcm(dp, 128)` bucket-end padding.
    pub fn distributed(dp: usize, bucket_size: Option<usize>) -> Self {
        Self {
            dp,
            bucket_size,
            distributed_optimizer: true,
            high_busbw_padding: false,
        }
    }
}

/// Where one parameter sits in its buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParamRange {
    /// Index of the parameter in the list the layout was computed from.
    pub param: usize,
    /// First element (global, in the buffer).
    pub start: usize,
    /// One past the last element; `end - start` is the parameter's numel.
    pub end: usize,
    /// Index of the bucket holding the parameter.
    pub bucket: usize,
}

impl ParamRange {
    /// The global element range.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.end - self.start
    }
}

/// One bucket: a contiguous range of the buffer reduced (and, under the distributed optimizer,
/// sharded) as a unit.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BucketRange {
    /// First element (global).
    pub start: usize,
    /// One past the last element, including end padding.
    pub end: usize,
    /// Elements before end padding, measured from `start`; includes parameter-start padding
    /// inside the bucket.
    pub numel_unpadded: usize,
    /// The bucket's parameters in buffer order (ascending offsets, i.e. reverse forward order).
    pub params: Vec<usize>,
}

impl BucketRange {
    /// The global element range, padding included.
    pub fn range(&self) -> Range<usize> {
        self.start..self.end
    }

    /// Number of elements, padding included.
    pub fn numel(&self) -> usize {
        self.end - self.start
    }
}

/// The layout of one buffer: every parameter's range, the buckets and the shard count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BufferLayout {
    /// The buffer key shared by all parameters.
    pub key: BufferKey,
    /// Parameter ranges, indexed like the parameter list the layout was computed from.
    pub params: Vec<ParamRange>,
    /// Buckets in buffer order; bucket 0 starts at element 0 and holds the last parameters of
    /// the forward order.
    pub buckets: Vec<BucketRange>,
    /// Total elements, padding included (the end of the last bucket).
    pub numel: usize,
    /// Sum of the buckets' `numel_unpadded`.
    pub numel_unpadded: usize,
    /// Number of equal pieces each bucket is sharded into: `dp` under the distributed optimizer,
    /// 1 for the classic DDP layout. Must equal the size of the collective group
    /// ([`check_shard_count`]).
    pub num_shards: usize,
}

impl BufferLayout {
    /// The parameter's range relative to the start of its bucket (`global - bucket.start`,
    /// padding included), i.e. its slice of the bucket's parameter or gradient view. `None` if
    /// `param` is out of range.
    pub fn param_range_in_bucket(&self, param: usize) -> Option<Range<usize>> {
        let p = self.params.get(param)?;
        let offset = self.buckets.get(p.bucket)?.start;
        Some(p.start - offset..p.end - offset)
    }
}

/// Everything that can make a layout request invalid.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The data-parallel size (or shard count) is zero.
    #[error("data-parallel size must be at least 1")]
    ZeroDataParallel,
    /// `bucket_size` is `Some(0)`.
    #[error("bucket size must be at least 1 element (use None for a single bucket)")]
    ZeroBucketSize,
    /// The parameter list is empty.
    #[error("a buffer layout needs at least one parameter")]
    NoParams,
    /// A parameter has zero elements.
    #[error("parameter {index} (`{name}`) has no elements")]
    EmptyParam {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
    },
    /// A parameter's `numel` is not the product of its shape.
    #[error("parameter {index} (`{name}`): numel {numel} does not match shape {shape:?}")]
    ShapeMismatch {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
        /// The declared numel.
        numel: usize,
        /// The declared shape.
        shape: Vec<usize>,
    },
    /// Parameters with different buffer keys were passed to one layout.
    #[error("parameter {index} (`{name}`) has key {found:?}, but the buffer's key is {expected:?}")]
    MixedKeys {
        /// Index in the parameter list.
        index: usize,
        /// Parameter name.
        name: String,
        /// Key of the first parameter.
        expected: BufferKey,
        /// Key of this parameter.
        found: BufferKey,
    },
    /// An offset computation overflowed `usize`.
    #[error("buffer offsets overflow usize")]
    Overflow,
    /// A rank outside `0..dp`.
    #[error("rank {rank} is out of range for {dp} shards")]
    RankOutOfRange {
        /// The rank asked for.
        rank: usize,
        /// The shard count.
        dp: usize,
    },
    /// A bucket's size is not divisible by the shard count.
    #[error("bucket [{start}, {end}) of {numel} elements cannot be split into {dp} equal shards")]
    BucketNotDivisible {
        /// Bucket start.
        start: usize,
        /// Bucket end.
        end: usize,
        /// Bucket numel.
        numel: usize,
        /// The shard count.
        dp: usize,
    },
    /// The layout's shard count differs from the collective group size (Megatron bug F3: some
    /// shards would be owned by no rank, or ranks would read past their shard).
    #[error("layout has {layout} shards per bucket but the collective group has {group} ranks")]
    ShardCountMismatch {
        /// `BufferLayout::num_shards`.
        layout: usize,
        /// The collective group size.
        group: usize,
    },
    /// [`packed_layout`] was asked for a buffer that does not hold NVFP4 parameters.
    #[error("packed layouts exist only for NVFP4 buffers, not {storage:?}")]
    NotNvfp4 {
        /// The buffer's parameter storage.
        storage: ParamStorage,
    },
    /// An NVFP4 parameter with an odd element count cannot be packed two per byte.
    #[error("NVFP4 parameter {param} has an odd element count {numel}")]
    OddNvfp4Numel {
        /// Parameter index.
        param: usize,
        /// Its numel.
        numel: usize,
    },
    /// A bucket's per-rank shard has an odd number of elements, so its packed shard would not be
    /// a whole number of bytes (e.g. dp a multiple of 128 with an odd number of
    /// `lcm(dp, 128)` blocks in the bucket).
    #[error(
        "bucket starting at element {bucket_start}: shard of {shard_numel} elements is odd, so it \
         cannot be packed"
    )]
    OddPackedShard {
        /// The bucket's first element.
        bucket_start: usize,
        /// Elements per shard.
        shard_numel: usize,
    },
    /// A bucket index that does not exist.
    #[error("bucket {bucket} does not exist (the layout has {buckets})")]
    NoSuchBucket {
        /// The bucket index asked for.
        bucket: usize,
        /// Number of buckets.
        buckets: usize,
    },
    /// A parameter or bucket boundary at an odd element offset (only for hand-built layouts).
    #[error("element offset {offset} is odd, so it has no packed byte offset")]
    OddPackedBoundary {
        /// The offending element offset.
        offset: usize,
    },
    /// A grouped expert range cannot be split into equal expert slices.
    #[error("a range of {numel} elements cannot be split into {experts} equal expert slices")]
    ExpertSplit {
        /// Elements in the range.
        numel: usize,
        /// Number of experts asked for.
        experts: usize,
    },
}

fn checked_pad(value: usize, divisor: usize) -> Option<usize> {
    value.checked_next_multiple_of(divisor)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

fn checked_lcm(a: usize, b: usize) -> Option<usize> {
    if a == 0 || b == 0 {
        return None;
    }
    (a / gcd(a, b)).checked_mul(b)
}

fn checked_bucket_end_divisor(dp: usize, high_busbw: bool) -> Option<usize> {
    let base = checked_lcm(dp, BUCKET_END_ALIGN)?;
    if high_busbw {
        checked_lcm(base, HIGH_BUSBW_ALIGN)
    } else {
        Some(base)
    }
}

/// Computes the layout of one buffer.
///
/// `params` are the buffer's parameters in **forward** order, all with the same [`BufferKey`]
/// (one entry of [`group_params`]). The indices in the result ([`ParamRange::param`],
/// [`BucketRange::params`]) refer to positions in `params`. The rules are described in the
/// [module documentation](self).
///
/// # Errors
/// - [`LayoutError::ZeroDataParallel`] or [`LayoutError::ZeroBucketSize`] for a bad config.
/// - [`LayoutError::NoParams`] for an empty list.
/// - [`LayoutError::MixedKeys`] if the keys differ.
/// - [`LayoutError::EmptyParam`] or [`LayoutError::ShapeMismatch`] for a bad parameter.
/// - [`LayoutError::Overflow`] if offsets overflow.
pub fn compute_layout<P: Borrow<ParamSpec>>(
    params: &[P],
    cfg: &LayoutConfig,
) -> Result<BufferLayout, LayoutError> {
    if cfg.dp == 0 {
        return Err(LayoutError::ZeroDataParallel);
    }
    if cfg.bucket_size == Some(0) {
        return Err(LayoutError::ZeroBucketSize);
    }
    let first = params.first().ok_or(LayoutError::NoParams)?.borrow();
    let key = first.key;
    for (index, param) in params.iter().enumerate() {
        let param = param.borrow();
        if param.key != key {
            return Err(LayoutError::MixedKeys {
                index,
                name: param.name.clone(),
                expected: key,
                found: param.key,
            });
        }
        let product = param
            .shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if product != Some(param.numel) {
            return Err(LayoutError::ShapeMismatch {
                index,
                name: param.name.clone(),
                numel: param.numel,
                shape: param.shape.clone(),
            });
        }
        if param.numel == 0 {
            return Err(LayoutError::EmptyParam {
                index,
                name: param.name.clone(),
            });
        }
    }

    let distopt = cfg.distributed_optimizer;
    let divisor = if distopt {
        checked_bucket_end_divisor(cfg.dp, cfg.high_busbw_padding).ok_or(LayoutError::Overflow)?
    } else {
        1
    };
    let mut walk = Walk {
        divisor,
        bucket_start: 0,
        current: Vec::new(),
        buckets: Vec::new(),
    };
    let mut ranges: Vec<Option<ParamRange>> = vec![None; params.len()];
    let mut cursor = 0usize;
    for index in (0..params.len()).rev() {
        let param = params[index].borrow();
        // Megatron only splits shared embeddings off under the distributed optimizer.
        let alone = distopt && param.shared_embedding;
        if distopt {
            cursor = checked_pad(cursor, PARAM_START_ALIGN).ok_or(LayoutError::Overflow)?;
        }
        if alone && !walk.current.is_empty() {
            // Megatron closes the pending bucket at the embedding's padded start.
            cursor = walk.close(cursor)?;
        }
        let end = cursor
            .checked_add(param.numel)
            .ok_or(LayoutError::Overflow)?;
        ranges[index] = Some(ParamRange {
            param: index,
            start: cursor,
            end,
            bucket: walk.buckets.len(),
        });
        walk.current.push(index);
        let full = cfg
            .bucket_size
            .is_some_and(|size| end - walk.bucket_start >= size);
        cursor = if full || alone { walk.close(end)? } else { end };
    }
    if !walk.current.is_empty() {
        walk.close(cursor)?;
    }

    let params: Vec<ParamRange> = ranges
        .into_iter()
        .map(|r| r.expect("every parameter is placed"))
        .collect();
    let numel = walk.buckets.last().map_or(0, |b| b.end);
    let numel_unpadded = walk.buckets.iter().map(|b| b.numel_unpadded).sum();
    Ok(BufferLayout {
        key,
        params,
        buckets: walk.buckets,
        numel,
        numel_unpadded,
        num_shards: if distopt { cfg.dp } else { 1 },
    })
}

/// The bucket-closing state of the [`compute_layout`] walk.
struct Walk {
    divisor: usize,
    bucket_start: usize,
    current: Vec<usize>,
    buckets: Vec<BucketRange>,
}

impl Walk {
    /// Closes the current bucket at `end` (unpadded); returns the padded end, where the next
    /// bucket starts.
    fn close(&mut self, end: usize) -> Result<usize, LayoutError> {
        let padded = checked_pad(end, self.divisor).ok_or(LayoutError::Overflow)?;
        self.buckets.push(BucketRange {
            start: self.bucket_start,
            end: padded,
            numel_unpadded: end - self.bucket_start,
            params: std::mem::take(&mut self.current),
        });
        self.bucket_start = padded;
        Ok(padded)
    }
}

/// Rank `rank`'s shard of a bucket: `[start + rank*S, start + (rank+1)*S)` with
/// `S = bucket.numel() / dp`. Sharding is per bucket, not per buffer.
///
/// # Errors
/// - [`LayoutError::ZeroDataParallel`] if `dp == 0`.
/// - [`LayoutError::RankOutOfRange`] if `rank >= dp`.
/// - [`LayoutError::BucketNotDivisible`] if the bucket size is not a multiple of `dp`. That
///   cannot happen for a distributed-optimizer layout sharded by its own `num_shards`.
pub fn shard_range(
    bucket: &BucketRange,
    rank: usize,
    dp: usize,
) -> Result<Range<usize>, LayoutError> {
    if dp == 0 {
        return Err(LayoutError::ZeroDataParallel);
    }
    if rank >= dp {
        return Err(LayoutError::RankOutOfRange { rank, dp });
    }
    let numel = bucket.numel();
    if !numel.is_multiple_of(dp) {
        return Err(LayoutError::BucketNotDivisible {
            start: bucket.start,
            end: bucket.end,
            numel,
            dp,
        });
    }
    let shard = numel / dp;
    let start = bucket.start + rank * shard;
    Ok(start..start + shard)
}

/// One rank's piece of one parameter (Megatron's `_build_model_gbuf_param_range_map` entry).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ParamShardRange {
    /// Parameter index.
    pub param: usize,
    /// Bucket index.
    pub bucket: usize,
    /// The piece relative to the rank's shard of the bucket (`0..S`): where it sits in the
    /// reduce-scatter output and the all-gather input.
    pub gbuf_local: Range<usize>,
    /// The piece in the buffer (global element indices).
    pub gbuf_world: Range<usize>,
    /// The piece relative to the bucket start: indexes the bucket's parameter/gradient view.
    pub gbuf_world_in_bucket: Range<usize>,
    /// The piece as a sub-range of the flattened parameter (`0..numel`).
    pub param_range: Range<usize>,
}

/// Every parameter piece that rank `rank` owns, in buffer order (bucket by bucket, ascending
/// offsets), sharding each bucket into `layout.num_shards` pieces.
///
/// For bucket `b` with start `O` and shard size `S`, the rank's world range is
/// `W = [O + rank*S, O + (rank+1)*S)`. For a parameter at `[ps, pe)`:
/// - `local_start = max(0, ps - W.start)` and `local_end = min(S, pe - W.start)`;
/// - the rank owns a piece iff `local_end > local_start`;
/// - `gbuf_world = gbuf_local + W.start` and `gbuf_world_in_bucket = gbuf_world - O`;
/// - `param_range` starts at `max(0, W.start - ps)` and has the same length.
///
/// Shards ignore parameter boundaries, so a parameter may be split across ranks. Across all
/// ranks, the pieces cover every element of every parameter exactly once.
///
/// # Errors
/// [`LayoutError::RankOutOfRange`], [`LayoutError::ZeroDataParallel`] or
/// [`LayoutError::BucketNotDivisible`], as for [`shard_range`].
pub fn param_shard_ranges(
    layout: &BufferLayout,
    rank: usize,
) -> Result<Vec<ParamShardRange>, LayoutError> {
    let mut out = Vec::new();
    for (b, bucket) in layout.buckets.iter().enumerate() {
        let world = shard_range(bucket, rank, layout.num_shards)?;
        let shard = world.len();
        for &p in &bucket.params {
            let range = &layout.params[p];
            let local_start = range.start.saturating_sub(world.start);
            let local_end = shard.min(range.end.saturating_sub(world.start));
            if local_end <= local_start {
                continue;
            }
            let len = local_end - local_start;
            let world_start = world.start + local_start;
            let param_start = world.start.saturating_sub(range.start);
            out.push(ParamShardRange {
                param: p,
                bucket: b,
                gbuf_local: local_start..local_end,
                gbuf_world: world_start..world_start + len,
                gbuf_world_in_bucket: world_start - bucket.start..world_start - bucket.start + len,
                param_range: param_start..param_start + len,
            });
        }
    }
    Ok(out)
}

/// Checks that the layout's shard count equals the size of the group its collectives run on.
///
/// A layout sharded for the full DP group but reduced over a smaller group (or the reverse)
/// leaves elements owned by no rank (Megatron bug F3).
///
/// # Errors
/// [`LayoutError::ShardCountMismatch`] if they differ.
pub fn check_shard_count(layout: &BufferLayout, group_size: usize) -> Result<(), LayoutError> {
    if layout.num_shards == group_size {
        Ok(())
    } else {
        Err(LayoutError::ShardCountMismatch {
            layout: layout.num_shards,
            group: group_size,
        })
    }
}

/// Where one NVFP4 parameter's packed bytes sit in the packed parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedParamRange {
    /// Parameter index.
    pub param: usize,
    /// First byte: the element start / 2.
    pub start: usize,
    /// One past the last byte: the element end / 2.
    pub end: usize,
    /// Bucket index (the same as in the element layout).
    pub bucket: usize,
}

/// A bucket of the packed parameter buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PackedBucketRange {
    /// First byte: the element bucket start / 2.
    pub start: usize,
    /// One past the last byte: the element bucket end / 2.
    pub end: usize,
    /// Bytes per rank shard: half of the element shard size.
    pub shard_bytes: usize,
}

/// The packed byte map of an NVFP4 parameter buffer (two E2M1 values per byte), derived from the
/// element layout: every byte offset is the element offset divided by two.
///
/// The gradient buffer keeps the element layout; the parameter buffer and the all-gather use
/// this one. Because shard boundaries are halved too, each rank's packed shard holds exactly the
/// bytes of the elements of its gradient (and fp32 master) shard.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PackedLayout {
    /// Packed ranges, indexed like [`BufferLayout::params`].
    pub params: Vec<PackedParamRange>,
    /// Packed buckets, indexed like [`BufferLayout::buckets`].
    pub buckets: Vec<PackedBucketRange>,
    /// Total bytes (the element layout's `numel / 2`).
    pub numel_bytes: usize,
    /// Shard count, as in the element layout.
    pub num_shards: usize,
}

impl PackedLayout {
    /// Rank `rank`'s packed shard of bucket `bucket`, in bytes.
    ///
    /// # Errors
    /// [`LayoutError::NoSuchBucket`] or [`LayoutError::RankOutOfRange`].
    pub fn shard_range(&self, bucket: usize, rank: usize) -> Result<Range<usize>, LayoutError> {
        let b = self.buckets.get(bucket).ok_or(LayoutError::NoSuchBucket {
            bucket,
            buckets: self.buckets.len(),
        })?;
        if rank >= self.num_shards {
            return Err(LayoutError::RankOutOfRange {
                rank,
                dp: self.num_shards,
            });
        }
        let start = b.start + rank * b.shard_bytes;
        Ok(start..start + b.shard_bytes)
    }
}

fn half_exact(offset: usize) -> Result<usize, LayoutError> {
    if offset.is_multiple_of(2) {
        Ok(offset / 2)
    } else {
        Err(LayoutError::OddPackedBoundary { offset })
    }
}

/// Rank `rank`'s packed shard of an (element) bucket, in bytes: [`shard_range`] halved.
///
/// # Errors
/// Those of [`shard_range`], and [`LayoutError::OddPackedShard`] or
/// [`LayoutError::OddPackedBoundary`] if the shard boundaries are not even element offsets.
pub fn packed_shard_range(
    bucket: &BucketRange,
    rank: usize,
    dp: usize,
) -> Result<Range<usize>, LayoutError> {
    let shard = shard_range(bucket, rank, dp)?;
    if !shard.len().is_multiple_of(2) {
        return Err(LayoutError::OddPackedShard {
            bucket_start: bucket.start,
            shard_numel: shard.len(),
        });
    }
    Ok(half_exact(shard.start)?..half_exact(shard.end)?)
}

/// The packed byte map of an NVFP4 buffer's layout.
///
/// Why halving is exact:
/// - under the distributed optimizer, parameter starts are multiples of 64 elements (32 bytes)
///   and bucket boundaries are multiples of `lcm(dp, 128)`;
/// - without it, parameters are contiguous and every NVFP4 numel is even.
///
/// The remaining condition is that each bucket's per-rank shard (`bucket numel / num_shards`)
/// is even. It fails only when `dp` is a multiple of 128 and a bucket holds an odd number of
/// `lcm(dp, 128)` blocks; that case is an error, never a silent misalignment.
///
/// # Errors
/// - [`LayoutError::NotNvfp4`] if the buffer does not hold NVFP4 parameters.
/// - [`LayoutError::OddNvfp4Numel`] for a parameter with an odd element count.
/// - [`LayoutError::OddPackedShard`] for an odd per-rank shard.
/// - [`LayoutError::BucketNotDivisible`] or [`LayoutError::ZeroDataParallel`] if a bucket cannot
///   be sharded.
/// - [`LayoutError::OddPackedBoundary`] for any odd boundary in a hand-built layout.
pub fn packed_layout(layout: &BufferLayout) -> Result<PackedLayout, LayoutError> {
    let storage = layout.key.param_storage;
    if storage != ParamStorage::Quantized(QuantKind::Nvfp4) {
        return Err(LayoutError::NotNvfp4 { storage });
    }
    let dp = layout.num_shards;
    if dp == 0 {
        return Err(LayoutError::ZeroDataParallel);
    }
    let mut params = Vec::with_capacity(layout.params.len());
    for range in &layout.params {
        if !range.numel().is_multiple_of(2) {
            return Err(LayoutError::OddNvfp4Numel {
                param: range.param,
                numel: range.numel(),
            });
        }
        params.push(PackedParamRange {
            param: range.param,
            start: half_exact(range.start)?,
            end: half_exact(range.end)?,
            bucket: range.bucket,
        });
    }
    let mut buckets = Vec::with_capacity(layout.buckets.len());
    for bucket in &layout.buckets {
        let numel = bucket.numel();
        if !numel.is_multiple_of(dp) {
            return Err(LayoutError::BucketNotDivisible {
                start: bucket.start,
                end: bucket.end,
                numel,
                dp,
            });
        }
        let shard_numel = numel / dp;
        if !shard_numel.is_multiple_of(2) {
            return Err(LayoutError::OddPackedShard {
                bucket_start: bucket.start,
                shard_numel,
            });
        }
        buckets.push(PackedBucketRange {
            start: half_exact(bucket.start)?,
            end: half_exact(bucket.end)?,
            shard_bytes: shard_numel / 2,
        });
    }
    Ok(PackedLayout {
        params,
        buckets,
        numel_bytes: half_exact(layout.numel)?,
        num_shards: dp,
    })
}

/// Each expert's contiguous element range within a grouped expert tensor
/// (`[experts, out, in]`, stored expert-major), given the tensor's range `param_range`.
///
/// Pass a buffer range to get buffer ranges, or `0..numel` to get ranges within the parameter.
///
/// # Errors
/// [`LayoutError::ExpertSplit`] if `experts` is zero or does not divide the range length.
pub fn expert_slices(
    param_range: Range<usize>,
    experts: usize,
) -> Result<Vec<Range<usize>>, LayoutError> {
    let numel = param_range.len();
    if experts == 0 || !numel.is_multiple_of(experts) {
        return Err(LayoutError::ExpertSplit { numel, experts });
    }
    let per = numel / experts;
    Ok((0..experts)
        .map(|e| param_range.start + e * per..param_range.start + (e + 1) * per)
        .collect())
}
