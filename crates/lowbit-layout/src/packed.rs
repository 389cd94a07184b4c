//! The packed byte map of NVFP4 parameter buffers (two E2M1 values per byte) and expert slices
//! of grouped tensors.

use std::ops::Range;

use crate::{BucketRange, BufferLayout, LayoutError, ParamStorage, QuantKind, shard_range};

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
        let shard_numel = crate::rules::shard_size(bucket.start, bucket.end, dp)?;
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
