//! Megatron-LM's two buffer layout rules (classic DDP and distributed optimizer): padding,
//! bucketing and shard ranges.

use std::borrow::Borrow;
use std::ops::Range;

use crate::{BufferKey, LayoutError, ParamSpec};

/// Parameter starts are aligned to this many elements under the distributed optimizer.
pub const PARAM_START_ALIGN: usize = 64;

/// Bucket ends are aligned to a multiple of this many elements (and of `dp`) under the
/// distributed optimizer.
pub const BUCKET_END_ALIGN: usize = 128;

/// The extra bucket-end factor of high-NCCL-bus-bandwidth padding (`2^16` elements).
pub const HIGH_BUSBW_ALIGN: usize = 1 << 16;

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

fn checked_pad(value: usize, divisor: usize) -> Option<usize> {
    value.checked_next_multiple_of(divisor)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

pub(crate) fn checked_lcm(a: usize, b: usize) -> Option<usize> {
    if a == 0 || b == 0 {
        return None;
    }
    (a / gcd(a, b)).checked_mul(b)
}

pub(crate) fn checked_bucket_end_divisor(dp: usize, high_busbw: bool) -> Option<usize> {
    let base = checked_lcm(dp, BUCKET_END_ALIGN)?;
    if high_busbw {
        checked_lcm(base, HIGH_BUSBW_ALIGN)
    } else {
        Some(base)
    }
}

/// The checks every layout rule runs first, in one order, so that all rules reject the same
/// inputs with the same errors; returns the buffer's key.
pub(crate) fn validate_params<P: Borrow<ParamSpec>>(
    params: &[P],
    cfg: &LayoutConfig,
) -> Result<BufferKey, LayoutError> {
    if cfg.dp == 0 {
        return Err(LayoutError::ZeroDataParallel);
    }
    if cfg.bucket_size == Some(0) {
        return Err(LayoutError::ZeroBucketSize);
    }
    let key = params.first().ok_or(LayoutError::NoParams)?.borrow().key;
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

    Ok(key)
}

/// The per-rank shard size of a bucket `[start, end)` split into `dp` equal pieces.
pub(crate) fn shard_size(start: usize, end: usize, dp: usize) -> Result<usize, LayoutError> {
    if dp == 0 {
        return Err(LayoutError::ZeroDataParallel);
    }
    let numel = end.saturating_sub(start);
    if !numel.is_multiple_of(dp) {
        return Err(LayoutError::BucketNotDivisible {
            start,
            end,
            numel,
            dp,
        });
    }
    Ok(numel / dp)
}

/// Computes the layout of one buffer.
///
/// `params` are the buffer's parameters in **forward** order, all with the same [`BufferKey`]
/// (one entry of [`crate::group_params`]). The indices in the result ([`ParamRange::param`],
/// [`BucketRange::params`]) refer to positions in `params`. The rules (Megatron-LM's: padding,
/// alignment, bucket boundaries) are the crate documentation's invariants.
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
    let key = validate_params(params, cfg)?;
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
    if dp > 0 && rank >= dp {
        return Err(LayoutError::RankOutOfRange { rank, dp });
    }
    let shard = shard_size(bucket.start, bucket.end, dp)?;
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
/// leaves elements owned by no rank (Megatron-LM PR #6048).
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
