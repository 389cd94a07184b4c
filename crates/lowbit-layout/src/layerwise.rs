//! The layer-wise layout: every parameter is owned whole by one rank (Megatron-LM's
//! `LayerWiseDistributedOptimizer` layout, for optimizers such as Muon that need whole matrices).
//!
//! # Purpose
//! The distributed-optimizer layout cuts buckets into `dp` equal shards without looking at
//! parameter boundaries, so a matrix may be split across ranks. An optimizer that needs the
//! whole matrix (Muon's Newton–Schulz iteration) instead wants each parameter inside one shard,
//! while keeping the collectives unchanged: buckets of `dp` equal shards, reduce-scattered and
//! all-gathered. This layout arranges the parameters inside each bucket so that every shard
//! boundary falls between parameters. The result is an ordinary [`BufferLayout`] with
//! `num_shards = dp`, so [`shard_range`](crate::shard_range),
//! [`param_shard_ranges`](crate::param_shard_ranges), [`packed_layout`](crate::packed_layout)
//! and [`check_shard_count`](crate::check_shard_count) work on it unchanged;
//! [`owner_of_param`] names the rank that owns a parameter.
//!
//! # The rule (Megatron-LM `LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`)
//! - **Shard divisor** `D = lcm(64, bucket_end_divisor(dp, high_busbw) / dp)`: padded shard
//!   sizes are multiples of `D`, so shard starts are 64-aligned and a bucket of `dp` shards is a
//!   multiple of `lcm(dp, 128)` (or `lcm(dp, 128, 2^16)`).
//! - **Chunks.** Parameters are walked in reverse (backward) order and accumulated into a chunk;
//!   each chunk becomes one bucket, so a bucket is a contiguous backward range and its
//!   reduce-scatter can start as soon as that range's gradients are done.
//!   - A shared embedding first emits the pending chunk, then gets a bucket of its own: it sits
//!     at the start of shard 0 and shards `1..dp` hold the same amount of padding.
//!   - With `bucket_size: None` nothing else closes a chunk (one bucket, plus one per shared
//!     embedding).
//!   - With `bucket_size: Some(s)`, before adding the next parameter `p` to a non-empty chunk,
//!     the chunk is emitted iff `chunk_numel >= max(s, floor(dp · chunk_max_param · 9 / 10))`
//!     **and** `p` is not absorbed. The padding floor keeps one dominant parameter from leaving
//!     most shards empty.
//!   - **Absorb** (Megatron's `absorbs`, same rule): a mirror of the chunk's shard
//!     fill is kept by placing each added parameter on the least-filled mirror shard (lowest
//!     index on ties) at `pad_param_start(fill) + numel`, in walk order. `p` is absorbed iff
//!     `pad_param_start(min fill) + p.numel <= pad_to_divisor(max fill, D)`: it would fill
//!     existing shard padding instead of growing the bucket. The mirror is a cheap estimate,
//!     not the LPT placement below, and is reset with every emitted chunk.
//! - **Emitting a chunk** (LPT bin packing):
//!   - sort the chunk by [`layerwise_cost`], descending; ties keep walk order (higher forward
//!     index first), as Python's stable sort does;
//!   - give each parameter to the candidate shard with the least accumulated cost; candidates
//!     are the shards where `pad_param_start(cursor) + numel <= 1.3 · chunk_numel / dp`; with
//!     no candidate, the shard with the smallest cursor; ties go to the lowest shard index.
//!     Costs accumulate over the whole buffer (they are never reset), so expensive parameters
//!     spread over ranks globally, not just per bucket;
//!   - a parameter starts at `pad_param_start(cursor)` of its shard, in assignment order;
//!   - `padded_shard = pad_to_divisor(max cursor, D)`; shard `s` is
//!     `[bucket_start + s·padded_shard, bucket_start + (s+1)·padded_shard)` and the bucket has
//!     `dp · padded_shard` elements.
//! - **Ownership:** `owner = (param_start - bucket_start) / (bucket_numel / dp)`.
//! - **`numel_unpadded`** of a layer-wise bucket is the sum of its parameters' numels, as in
//!   Megatron (`per_bucket_numel_unpadded`). Unlike the other layouts it does *not* include
//!   parameter-start padding, since padding is spread over every shard rather than sitting
//!   before one end.
//!
//! # Deliberate differences from Megatron-LM
//! - **Exact arithmetic.** Megatron compares against `chunk_numel / dp * 1.3` and
//!   `int(dp * chunk_max_param * 0.9)` in floating point; we use the exact rationals
//!   (`10·dp·end <= 13·chunk_numel`, `dp·max·9 / 10` rounded down). Results can differ only when
//!   a value lands exactly on (or within float rounding of) a threshold.
//! - **Shared embeddings count as work.** The shared embedding's cost is added to shard 0's
//!   accumulated cost, because rank 0 updates it; the packer then steers later parameters away
//!   from rank 0. (The Megatron sources we followed do not pin this down.)
//! - **Validation returns errors** ([`LayoutError`]) where Megatron asserts or overflows, and
//!   costs saturate at `u128::MAX` rather than growing without bound.
//! - **Memory independent of `dp`.** Only the first `min(dp, params)` shards are tracked: a
//!   shard that was never used looks exactly like every higher-index one and wins the
//!   lowest-index tie-break against them, so no shard beyond that prefix is ever chosen. The
//!   layout is identical to tracking all `dp` shards.
//!
//! This is the compute-balanced version of Megatron's rule (cost-sorted LPT, costs persisting
//! across buckets, the 1.3 size cap, the absorb check). Megatron's earlier version sorts by
//! numel, balances numel only, and closes a chunk right after the parameter that reaches the
//! threshold, with no absorb check.

use std::borrow::Borrow;

use crate::{
    BucketRange, BufferLayout, LayoutConfig, LayoutError, PARAM_START_ALIGN, ParamRange, ParamSpec,
};

/// The layer-wise layout of one buffer: buckets of `dp` equal shards, each parameter entirely
/// inside one shard, parameters assigned to shards by LPT bin packing on
/// [`layerwise_cost`]. `cfg.distributed_optimizer` is ignored (the layout is always sharded).
///
/// `params` are the buffer's parameters in **forward** order, all with the same key; indices in
/// the result refer to positions in `params`. Every bucket lists its parameters in ascending
/// offset order; `num_shards` is `cfg.dp`.
///
/// The rule (Megatron-LM's `LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`;
/// the full statement is the module documentation of `src/layerwise.rs`):
/// - parameters are walked in reverse order into chunks, one bucket per chunk; a shared
///   embedding gets its own bucket, in shard 0;
/// - with a bucket size `s`, a chunk closes before the next parameter once it holds at least
///   `max(s, floor(0.9 · dp · largest))` elements, unless that parameter fits into the padding
///   the chunk already needs (Megatron's `absorbs`);
/// - a chunk is packed largest [`layerwise_cost`] first, each parameter onto the shard with the
///   least accumulated cost among those it fits under `1.3 · chunk_numel / dp` (else the
///   least-filled shard; ties to the lowest index), at 64-aligned offsets;
/// - every shard is padded to the fullest one, rounded up to
///   `lcm(64, bucket_end_divisor(dp, high_busbw) / dp)`;
/// - a bucket's `numel_unpadded` is the sum of its parameters' numels.
///
/// # Errors
/// As [`compute_layout`](crate::compute_layout):
/// - [`LayoutError::ZeroDataParallel`] or [`LayoutError::ZeroBucketSize`] for a bad config.
/// - [`LayoutError::NoParams`] for an empty list.
/// - [`LayoutError::MixedKeys`] if the keys differ.
/// - [`LayoutError::EmptyParam`] or [`LayoutError::ShapeMismatch`] for a bad parameter.
/// - [`LayoutError::Overflow`] if offsets (or the shard divisor) overflow.
pub fn compute_layerwise_layout<P: Borrow<ParamSpec>>(
    params: &[P],
    cfg: &LayoutConfig,
) -> Result<BufferLayout, LayoutError> {
    crate::rules::validate_params(params, cfg)?;
    let key = params[0].borrow().key;
    let dp = cfg.dp;
    let divisor = shard_divisor(dp, cfg.high_busbw_padding).ok_or(LayoutError::Overflow)?;
    let numels: Vec<usize> = params.iter().map(|p| p.borrow().numel).collect();
    let costs: Vec<u128> = params
        .iter()
        .map(|p| layerwise_cost(&p.borrow().shape))
        .collect();
    // See the module doc: shards past the first `min(dp, n)` are never chosen.
    let slots = dp.min(params.len());
    let mut packer = Packer {
        dp,
        divisor,
        numels: &numels,
        costs: &costs,
        loads: vec![0; slots],
        ranges: vec![None; params.len()],
        buckets: Vec::new(),
        cursor: 0,
    };

    let mut chunk: Vec<usize> = Vec::new();
    let mut chunk_numel: u128 = 0;
    let mut chunk_max: usize = 0;
    let mut mirror = vec![0usize; slots];
    for index in (0..params.len()).rev() {
        let numel = numels[index];
        if params[index].borrow().shared_embedding {
            packer.emit(&chunk)?;
            chunk.clear();
            (chunk_numel, chunk_max) = (0, 0);
            mirror.fill(0);
            packer.emit_shared(index)?;
            continue;
        }
        if let Some(size) = cfg.bucket_size
            && !chunk.is_empty()
        {
            // The padding floor: a bucket is at least `dp` times its largest parameter, so keep
            // collecting until the chunk could fill about 90% of that.
            let floor = (dp as u128)
                .saturating_mul(chunk_max as u128)
                .saturating_mul(9)
                / 10;
            let threshold = (size as u128).max(floor);
            if chunk_numel >= threshold && !absorbs(&mirror, numel, divisor)? {
                packer.emit(&chunk)?;
                chunk.clear();
                (chunk_numel, chunk_max) = (0, 0);
                mirror.fill(0);
            }
        }
        let s = argmin(&mirror);
        mirror[s] = pad64(mirror[s])?
            .checked_add(numel)
            .ok_or(LayoutError::Overflow)?;
        chunk.push(index);
        chunk_numel += numel as u128;
        chunk_max = chunk_max.max(numel);
    }
    packer.emit(&chunk)?;

    let Packer {
        ranges, buckets, ..
    } = packer;
    let params: Vec<ParamRange> = ranges
        .into_iter()
        .map(|r| r.expect("every parameter is placed"))
        .collect();
    let numel = buckets.last().map_or(0, |b| b.end);
    let numel_unpadded = buckets.iter().map(|b| b.numel_unpadded).sum();
    Ok(BufferLayout {
        key,
        params,
        buckets,
        numel,
        numel_unpadded,
        num_shards: dp,
    })
}

/// The estimated Newton–Schulz cost of a parameter: `max(m, n) · min(m, n)²` for a matrix
/// (`[rows, cols]`, leading dimensions folded into rows as [`matrix_dims`](crate::matrix_dims)
/// does; any shape of two or more dimensions), its numel otherwise (1-D and scalars).
/// Saturates at `u128::MAX`.
pub fn layerwise_cost(shape: &[usize]) -> u128 {
    let product = |dims: &[usize]| {
        dims.iter()
            .fold(1u128, |acc, &d| acc.saturating_mul(d as u128))
    };
    match shape.split_last() {
        Some((&cols, lead)) if !lead.is_empty() => {
            let (rows, cols) = (product(lead), cols as u128);
            let (big, small) = (rows.max(cols), rows.min(cols));
            big.saturating_mul(small).saturating_mul(small)
        }
        _ => product(shape),
    }
}

/// The rank owning parameter `param` (an index into `layout.params`) of a layer-wise layout:
/// `(param_start - bucket_start) / (bucket_numel / num_shards)`.
///
/// Works on any layout whose parameter lies inside one shard of its bucket (e.g. every
/// parameter of a classic-DDP layout is owned by shard 0).
///
/// # Errors
/// - [`LayoutError::NoSuchParam`] if `param` is out of range.
/// - [`LayoutError::NoSuchBucket`] if the parameter's bucket does not exist.
/// - [`LayoutError::ZeroDataParallel`] or [`LayoutError::BucketNotDivisible`] if the bucket
///   cannot be sharded.
/// - [`LayoutError::ParamNotInOneShard`] if the parameter crosses a shard boundary or lies
///   outside its bucket.
pub fn owner_of_param(layout: &BufferLayout, param: usize) -> Result<usize, LayoutError> {
    let range = layout.params.get(param).ok_or(LayoutError::NoSuchParam {
        param,
        params: layout.params.len(),
    })?;
    let bucket = layout
        .buckets
        .get(range.bucket)
        .ok_or(LayoutError::NoSuchBucket {
            bucket: range.bucket,
            buckets: layout.buckets.len(),
        })?;
    let dp = layout.num_shards;
    let outside = || LayoutError::ParamNotInOneShard {
        param,
        start: range.start,
        end: range.end,
    };
    // A hand-built bucket may be inverted.
    if bucket.end < bucket.start && dp > 0 {
        return Err(outside());
    }
    let shard = crate::rules::shard_size(bucket.start, bucket.end, dp)?;
    let offset = range.start.checked_sub(bucket.start).ok_or_else(outside)?;
    if shard == 0 || range.end < range.start {
        return Err(outside());
    }
    let owner = offset / shard;
    // `owner < dp` rules out an empty range sitting at the bucket end.
    if owner >= dp || range.end > bucket.start + (owner + 1) * shard {
        return Err(outside());
    }
    Ok(owner)
}

/// `lcm(64, bucket_end_divisor(dp, high_busbw) / dp)`, or `None` on overflow. Computed here
/// (not with the panicking [`bucket_end_divisor`](crate::bucket_end_divisor)) so that a huge
/// `dp` is an error, never a panic.
fn shard_divisor(dp: usize, high_busbw: bool) -> Option<usize> {
    let bucket = crate::rules::checked_bucket_end_divisor(dp, high_busbw)?;
    crate::rules::checked_lcm(PARAM_START_ALIGN, bucket / dp)
}

fn pad64(value: usize) -> Result<usize, LayoutError> {
    value
        .checked_next_multiple_of(PARAM_START_ALIGN)
        .ok_or(LayoutError::Overflow)
}

/// Index of the smallest value; the lowest index on ties (Python's `min` over `range`).
fn argmin<T: Ord + Copy>(values: &[T]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v < values[best] {
            best = i;
        }
    }
    best
}

/// Megatron's `absorbs`: whether a parameter of `numel` elements fits into the padding the
/// mirror's shards already need, i.e. would not grow the bucket.
fn absorbs(mirror: &[usize], numel: usize, divisor: usize) -> Result<bool, LayoutError> {
    let max = mirror.iter().copied().max().unwrap_or(0);
    let min = mirror.iter().copied().min().unwrap_or(0);
    let target = max
        .checked_next_multiple_of(divisor)
        .ok_or(LayoutError::Overflow)?;
    // An overflowing end certainly does not fit.
    Ok(pad64(min)?
        .checked_add(numel)
        .is_some_and(|end| end <= target))
}

/// Whether a parameter ending at `end` (relative to its shard) stays under the LPT size cap
/// `1.3 · chunk_numel / dp`, compared exactly as `10 · dp · end <= 13 · chunk_numel`.
fn under_cap(end: usize, dp: usize, chunk_numel: u128) -> bool {
    (end as u128)
        .checked_mul(dp as u128)
        .and_then(|x| x.checked_mul(10))
        .is_some_and(|lhs| lhs <= chunk_numel.saturating_mul(13))
}

/// The state of the bucket emission: the shards' accumulated costs and the buffer so far.
struct Packer<'a> {
    dp: usize,
    divisor: usize,
    numels: &'a [usize],
    costs: &'a [u128],
    /// Accumulated cost per tracked shard, over the whole buffer.
    loads: Vec<u128>,
    ranges: Vec<Option<ParamRange>>,
    buckets: Vec<BucketRange>,
    /// Where the next bucket starts.
    cursor: usize,
}

impl Packer<'_> {
    /// Bin-packs `chunk` (parameter indices in walk order) into a new bucket; nothing for an
    /// empty chunk.
    fn emit(&mut self, chunk: &[usize]) -> Result<(), LayoutError> {
        if chunk.is_empty() {
            return Ok(());
        }
        let chunk_numel: u128 = chunk.iter().map(|&i| self.numels[i] as u128).sum();
        let mut order = chunk.to_vec();
        // Stable: equal costs keep walk order, as in Megatron.
        order.sort_by(|&a, &b| self.costs[b].cmp(&self.costs[a]));
        let mut cursors = vec![0usize; self.loads.len()];
        let mut placed = Vec::with_capacity(order.len());
        for i in order {
            let numel = self.numels[i];
            let mut best: Option<usize> = None;
            for (s, &c) in cursors.iter().enumerate() {
                let fits = pad64(c)?
                    .checked_add(numel)
                    .is_some_and(|end| under_cap(end, self.dp, chunk_numel));
                if fits && best.is_none_or(|b| self.loads[s] < self.loads[b]) {
                    best = Some(s);
                }
            }
            let s = best.unwrap_or_else(|| argmin(&cursors));
            let offset = pad64(cursors[s])?;
            cursors[s] = offset.checked_add(numel).ok_or(LayoutError::Overflow)?;
            self.loads[s] = self.loads[s].saturating_add(self.costs[i]);
            placed.push((i, s, offset));
        }
        let max = cursors.iter().copied().max().unwrap_or(0);
        self.close(max, &placed)
    }

    /// A shared embedding's own bucket: shard 0 holds it, the other shards the same amount of
    /// padding.
    fn emit_shared(&mut self, index: usize) -> Result<(), LayoutError> {
        self.loads[0] = self.loads[0].saturating_add(self.costs[index]);
        self.close(self.numels[index], &[(index, 0, 0)])
    }

    /// Records a bucket whose fullest shard reaches `max_cursor`, with `placed` =
    /// `(param, shard, offset in shard)`.
    fn close(
        &mut self,
        max_cursor: usize,
        placed: &[(usize, usize, usize)],
    ) -> Result<(), LayoutError> {
        let shard = max_cursor
            .checked_next_multiple_of(self.divisor)
            .ok_or(LayoutError::Overflow)?;
        let start = self.cursor;
        let end = shard
            .checked_mul(self.dp)
            .and_then(|n| n.checked_add(start))
            .ok_or(LayoutError::Overflow)?;
        let bucket = self.buckets.len();
        let mut members = Vec::with_capacity(placed.len());
        for &(i, s, offset) in placed {
            // No overflow: `s < dp` and `offset + numel <= shard`, so this is below `end`.
            let p_start = start + s * shard + offset;
            members.push((p_start, i));
            self.ranges[i] = Some(ParamRange {
                param: i,
                start: p_start,
                end: p_start + self.numels[i],
                bucket,
            });
        }
        members.sort_unstable();
        self.buckets.push(BucketRange {
            start,
            end,
            numel_unpadded: placed.iter().map(|&(i, _, _)| self.numels[i]).sum(),
            params: members.into_iter().map(|(_, i)| i).collect(),
        });
        self.cursor = end;
        Ok(())
    }
}
