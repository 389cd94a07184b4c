//! The sharding plan: the one place that decides, for every buffer, its layout, which elements
//! each rank owns, which collective reduces its gradients and which gathers its parameters, and
//! over which process group. Buffers and optimizers both read the plan; nobody re-derives it.

use std::ops::Range;

use crate::{
    BufferKey, BufferLayout, LayoutConfig, LayoutError, OptimizerId, PackedLayout, ParamSpec,
    ParamStorage, QuantKind, compute_layerwise_layout, compute_layout, compute_row_aligned_layout,
    group_params, packed_layout, param_shard_ranges, shard_range,
};

/// How a buffer's elements are distributed over the ranks of its group.
///
/// FSDP's four strategies map onto these: `no_shard` = [`Self::Replicated`], `optim` =
/// [`Self::Distributed`], `optim_grads` = [`Self::OptimGrads`], `optim_grads_params` =
/// [`Self::OptimGradsParams`]. The last two use the distributed layout (same buckets, same
/// shards), so the four give the same bits where the arithmetic is the same.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ShardingStrategy {
    /// Classic DDP: every rank holds and updates every element; gradients are all-reduced and
    /// nothing is gathered.
    Replicated,
    /// The distributed optimizer (ZeRO-1): rank `r` owns the `r`-th of `dp` equal pieces of
    /// every bucket (pieces ignore parameter boundaries); gradients are reduce-scattered and
    /// parameters all-gathered.
    #[default]
    Distributed,
    /// Layer-wise: every parameter is owned whole by one rank ([`compute_layerwise_layout`]:
    /// deterministic LPT bin packing, buckets of `dp` equal shards aligned to ownership), so an
    /// optimizer that needs the whole matrix (Muon) can run on it; gradients are
    /// reduce-scattered and parameters all-gathered, as under [`Self::Distributed`].
    LayerWise,
    /// ZeRO-2 (FSDP `optim_grads`): the distributed layout, and a rank keeps only its shard of
    /// the gradients. Each bucket group's gradients go to a transient communication bucket,
    /// are reduce-scattered every microbatch and added into the persistent shard.
    OptimGrads,
    /// ZeRO-3 (FSDP `optim_grads_params`): as [`Self::OptimGrads`], and a rank keeps only its
    /// shard of the parameters; a bucket group (a unit) is gathered into a transient buffer
    /// before use and released after it, for the forward and again for the backward.
    OptimGradsParams,
}

impl ShardingStrategy {
    /// Whether ranks own disjoint pieces (and parameters are gathered after the step).
    pub fn is_sharded(self) -> bool {
        !matches!(self, ShardingStrategy::Replicated)
    }

    /// Whether a rank keeps only its shard of the gradients (reduced every microbatch).
    pub fn shards_grads(self) -> bool {
        matches!(
            self,
            ShardingStrategy::OptimGrads | ShardingStrategy::OptimGradsParams
        )
    }

    /// Whether a rank keeps only its shard of the parameters (gathered per use).
    pub fn shards_params(self) -> bool {
        matches!(self, ShardingStrategy::OptimGradsParams)
    }
}

/// The collective that reduces a buffer's gradients.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GradReduce {
    /// Every rank receives the whole reduced bucket.
    AllReduce,
    /// Every rank receives the reduced values of its own shard of the bucket.
    ReduceScatter,
}

/// The collective that brings updated parameters to every rank.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParamGather {
    /// Nothing to gather: every rank updated every element.
    None,
    /// Each rank's shard of each bucket goes to every rank.
    AllGather,
}

/// A process group a collective runs on.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GroupId {
    /// The data-parallel group.
    Data,
}

/// The knobs of [`ShardingPlan::new`].
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// Size of the data-parallel group. At least 1.
    pub dp: usize,
    /// Minimum elements per bucket; `None`: one bucket per buffer (plus one per shared
    /// embedding when sharded).
    pub bucket_size: Option<usize>,
    /// Pad sharded bucket ends to `lcm(dp, 128, 2^16)` instead of `lcm(dp, 128)`.
    pub high_busbw_padding: bool,
    /// The strategy of every owner not named in `owner_strategies`.
    pub strategy: ShardingStrategy,
    /// Per-owner strategies (e.g. layer-wise for the Muon owner, distributed for AdamW).
    pub owner_strategies: Vec<(OptimizerId, ShardingStrategy)>,
    /// Hybrid sharding with optimizer state sharded across replica groups (HFSDP): the number
    /// of replica groups each rank's bucket shards are split across ([`ShardingPlan::owned_hybrid`]);
    /// buffers under [`ShardingStrategy::OptimGradsParams`] pad their buckets to multiples of
    /// `dp · outer_shards` so the split is even. 1: no split.
    pub outer_shards: usize,
}

impl Default for PlanConfig {
    fn default() -> Self {
        PlanConfig {
            dp: 1,
            bucket_size: None,
            high_busbw_padding: false,
            strategy: ShardingStrategy::Distributed,
            owner_strategies: Vec::new(),
            outer_shards: 1,
        }
    }
}

impl PlanConfig {
    /// A plan for `dp` ranks with `strategy` for every owner, one bucket per buffer.
    pub fn new(dp: usize, strategy: ShardingStrategy) -> Self {
        PlanConfig {
            dp,
            strategy,
            ..PlanConfig::default()
        }
    }

    crate::setters! {
        /// Sets the bucket size.
        with_bucket_size => bucket_size: Option<usize>;
        /// Sets high-bus-bandwidth padding.
        with_high_busbw_padding => high_busbw_padding: bool;
        /// Sets the replica groups optimizer state is split across (HFSDP).
        with_outer_shards => outer_shards: usize;
    }

    /// Gives `owner` its own strategy.
    pub fn with_owner_strategy(mut self, owner: OptimizerId, strategy: ShardingStrategy) -> Self {
        self.owner_strategies.retain(|(o, _)| *o != owner);
        self.owner_strategies.push((owner, strategy));
        self
    }

    /// The strategy of `owner`.
    pub fn strategy_of(&self, owner: OptimizerId) -> ShardingStrategy {
        self.owner_strategies
            .iter()
            .find(|(o, _)| *o == owner)
            .map_or(self.strategy, |&(_, s)| s)
    }
}

/// One rank's piece of one parameter under a plan: the optimizer's unit of work.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct OwnedPiece {
    /// Global parameter id (index into the plan's parameter list).
    pub param: usize,
    /// Index of the buffer in [`ShardingPlan::buffers`].
    pub buffer: usize,
    /// Bucket index within the buffer.
    pub bucket: usize,
    /// The piece as a sub-range of the flattened parameter (`0..numel`).
    pub param_range: Range<usize>,
    /// The piece in the buffer (global element indices).
    pub buffer_range: Range<usize>,
}

/// The plan of one buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferPlan {
    /// The key shared by the buffer's parameters.
    pub key: BufferKey,
    /// The owner's strategy.
    pub strategy: ShardingStrategy,
    /// Where every parameter sits, the buckets and the shard count.
    pub layout: BufferLayout,
    /// Global parameter ids, indexed like `layout.params`.
    pub params: Vec<usize>,
    /// The packed byte map of an NVFP4 buffer.
    pub packed: Option<PackedLayout>,
    /// How gradients are reduced.
    pub grad_reduce: GradReduce,
    /// How parameters are gathered after the step.
    pub param_gather: ParamGather,
    /// The group both collectives run on.
    pub group: GroupId,
    /// The size that group must have: the shard count of a sharded layout.
    pub group_size: usize,
}

impl BufferPlan {
    /// Rank `rank`'s shard of bucket `bucket` in elements (the whole bucket when replicated).
    ///
    /// # Errors
    /// [`LayoutError::NoSuchBucket`], [`LayoutError::RankOutOfRange`].
    pub fn shard(&self, bucket: usize, rank: usize) -> Result<Range<usize>, LayoutError> {
        let b = self
            .layout
            .buckets
            .get(bucket)
            .ok_or(LayoutError::NoSuchBucket {
                bucket,
                buckets: self.layout.buckets.len(),
            })?;
        if rank >= self.group_size {
            return Err(LayoutError::RankOutOfRange {
                rank,
                dp: self.group_size,
            });
        }
        shard_range(b, rank, self.layout.num_shards)
    }

    /// The bytes rank `rank` contributes to the gather of bucket `bucket` and the bucket's
    /// bytes: packed byte ranges for NVFP4, element ranges otherwise.
    ///
    /// # Errors
    /// As [`Self::shard`].
    pub fn gather_ranges(
        &self,
        bucket: usize,
        rank: usize,
    ) -> Result<(Range<usize>, Range<usize>), LayoutError> {
        match &self.packed {
            Some(pk) => {
                let shard = pk.shard_range(bucket, rank)?;
                let b = &pk.buckets[bucket];
                Ok((shard, b.start..b.end))
            }
            None => {
                let shard = self.shard(bucket, rank)?;
                Ok((shard, self.layout.buckets[bucket].range()))
            }
        }
    }

    /// Elements of one rank's shard of the whole buffer: the sum of its bucket shards (the
    /// whole buffer when not sharded).
    pub fn shard_numel(&self) -> usize {
        self.layout.numel / self.layout.num_shards
    }

    /// Where rank `rank`'s shard of bucket `bucket` sits in the rank's shard storage (its
    /// bucket shards one after the other, in bucket order): the storage of sharded gradients
    /// and parameters.
    ///
    /// # Errors
    /// As [`Self::shard`].
    pub fn local_shard_range(
        &self,
        bucket: usize,
        rank: usize,
    ) -> Result<Range<usize>, LayoutError> {
        let len = self.shard(bucket, rank)?.len();
        let start: usize = self.layout.buckets[..bucket]
            .iter()
            .map(|b| b.numel() / self.layout.num_shards)
            .sum();
        Ok(start..start + len)
    }

    /// The element range of the buffer's parameter at layout index `index`.
    pub fn param_range(&self, index: usize) -> Range<usize> {
        self.layout.params[index].range()
    }

    /// The bytes of the parameter region the parameter at `index` occupies: packed bytes for
    /// NVFP4 (element offsets / 2), its element range otherwise.
    pub fn param_storage_range(&self, index: usize) -> Range<usize> {
        match &self.packed {
            Some(pk) => pk.params[index].start..pk.params[index].end,
            None => self.param_range(index),
        }
    }

    /// Every piece of a parameter rank `rank` owns, in buffer order.
    ///
    /// # Errors
    /// [`LayoutError::RankOutOfRange`] and the errors of [`param_shard_ranges`].
    pub fn owned(&self, buffer: usize, rank: usize) -> Result<Vec<OwnedPiece>, LayoutError> {
        if rank >= self.group_size {
            return Err(LayoutError::RankOutOfRange {
                rank,
                dp: self.group_size,
            });
        }
        if !self.strategy.is_sharded() {
            return Ok(self
                .layout
                .params
                .iter()
                .map(|pr| OwnedPiece {
                    param: self.params[pr.param],
                    buffer,
                    bucket: pr.bucket,
                    param_range: 0..pr.numel(),
                    buffer_range: pr.range(),
                })
                .collect());
        }
        Ok(param_shard_ranges(&self.layout, rank)?
            .into_iter()
            .map(|r| OwnedPiece {
                param: self.params[r.param],
                buffer,
                bucket: r.bucket,
                param_range: r.param_range,
                buffer_range: r.gbuf_world,
            })
            .collect())
    }
}

/// `layout` with every bucket's end padded to a multiple of `multiple` (its parameters keep
/// their offsets within the bucket; later buckets shift).
fn pad_buckets(mut layout: BufferLayout, multiple: usize) -> Result<BufferLayout, LayoutError> {
    let mut at = 0usize;
    for b in 0..layout.buckets.len() {
        let old = layout.buckets[b].clone();
        let numel = old
            .numel()
            .div_ceil(multiple)
            .checked_mul(multiple)
            .ok_or(LayoutError::Overflow)?;
        for &i in &old.params {
            let p = &mut layout.params[i];
            p.start = p.start - old.start + at;
            p.end = p.end - old.start + at;
        }
        layout.buckets[b].start = at;
        layout.buckets[b].end = at.checked_add(numel).ok_or(LayoutError::Overflow)?;
        at = layout.buckets[b].end;
    }
    layout.numel = at;
    Ok(layout)
}

/// The rows of one quantization block along the rows of a matrix: 32 for MXFP8 (32x1
/// columnwise blocks), 16 for NVFP4 (16x16 tiles).
pub fn row_block(q: QuantKind) -> usize {
    match q {
        QuantKind::Mxfp8 => 32,
        _ => 16,
    }
}

/// The whole plan: one [`BufferPlan`] per buffer key, in first-appearance order of the keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardingPlan {
    config: PlanConfig,
    buffers: Vec<BufferPlan>,
    /// For every global parameter: (buffer, index in that buffer's layout).
    location: Vec<(usize, usize)>,
}

/// The most elements a plan's buffers may hold together: `isize::MAX / 16`, so that their bytes
/// at up to 16 bytes an element (the widest state an element carries, summed over what the
/// buffers and optimizers keep) fit what an allocation can address, and every byte count or
/// sum of them made from a plan fits `usize` (2^59 elements on a 64-bit target: far past any
/// device's memory, so only absurd inputs meet it).
pub const MAX_PLAN_NUMEL: usize = isize::MAX as usize / 16;

impl ShardingPlan {
    /// Plans `specs` (forward order) under `cfg`.
    ///
    /// # Errors
    /// [`LayoutError::ZeroDataParallel`], [`LayoutError::ZeroBucketSize`],
    /// [`LayoutError::NoParams`], [`LayoutError::ShapeMismatch`] (a shape whose product is not
    /// `numel` or passes usize), [`LayoutError::MixedStrategies`] (replicated and sharded
    /// owners in one plan: the gradient norm would mix local and rank-summed parts),
    /// [`LayoutError::QuantizedNeedsGather`] (low-precision storage under a replicated
    /// strategy), [`LayoutError::Nvfp4Tiles`], [`LayoutError::TooLarge`] (buffers of more
    /// than [`MAX_PLAN_NUMEL`] elements together), and those of the layout rules.
    pub fn new(specs: &[ParamSpec], cfg: &PlanConfig) -> Result<Self, LayoutError> {
        if cfg.dp == 0 {
            return Err(LayoutError::ZeroDataParallel);
        }
        if cfg.bucket_size == Some(0) {
            return Err(LayoutError::ZeroBucketSize);
        }
        if specs.is_empty() {
            return Err(LayoutError::NoParams);
        }
        let mut sharded = None;
        for (index, spec) in specs.iter().enumerate() {
            // Every later size derives from the shape: one whose size passes usize (or
            // disagrees with `numel`) is named here, before any of them.
            if spec.shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) != Some(spec.numel) {
                return Err(LayoutError::ShapeMismatch {
                    index,
                    name: spec.name.clone(),
                    numel: spec.numel,
                    shape: spec.shape.clone(),
                });
            }
            let strategy = cfg.strategy_of(spec.owner());
            match sharded {
                None => sharded = Some(strategy.is_sharded()),
                Some(s) if s != strategy.is_sharded() => {
                    return Err(LayoutError::MixedStrategies);
                }
                Some(_) => {}
            }
            if spec.key.param_storage.is_quantized() && !strategy.is_sharded() {
                return Err(LayoutError::QuantizedNeedsGather {
                    name: spec.name.clone(),
                });
            }
            if spec.key.param_storage == ParamStorage::Quantized(QuantKind::Nvfp4) {
                let (rows, cols) = matrix_dims(&spec.shape);
                if !rows.is_multiple_of(16) || !cols.is_multiple_of(16) {
                    return Err(LayoutError::Nvfp4Tiles {
                        name: spec.name.clone(),
                        rows,
                        cols,
                    });
                }
            }
        }
        let mut buffers = Vec::new();
        let mut location = vec![(0, 0); specs.len()];
        // The buffers' elements so far (padding included), against MAX_PLAN_NUMEL.
        let mut total = 0usize;
        for (key, members) in group_params(specs) {
            let strategy = cfg.strategy_of(key.owner);
            let lcfg = LayoutConfig {
                dp: cfg.dp,
                bucket_size: cfg.bucket_size,
                distributed_optimizer: strategy.is_sharded(),
                high_busbw_padding: cfg.high_busbw_padding,
            };
            let group: Vec<&ParamSpec> = members.iter().map(|&i| &specs[i]).collect();
            let layout = match (strategy, key.param_storage) {
                (ShardingStrategy::LayerWise, _) => compute_layerwise_layout(&group, &lcfg)?,
                // Sharded low-precision parameters: each rank quantizes whole row blocks.
                (ShardingStrategy::OptimGradsParams, ParamStorage::Quantized(q)) => {
                    compute_row_aligned_layout(&group, cfg.dp, row_block(q))?
                }
                _ => compute_layout(&group, &lcfg)?,
            };
            let layout = if strategy == ShardingStrategy::OptimGradsParams && cfg.outer_shards > 1 {
                pad_buckets(
                    layout,
                    cfg.dp
                        .checked_mul(cfg.outer_shards)
                        .ok_or(LayoutError::Overflow)?,
                )?
            } else {
                layout
            };
            total = total.saturating_add(layout.numel);
            if total > MAX_PLAN_NUMEL {
                return Err(LayoutError::TooLarge { numel: total });
            }
            let packed = (key.param_storage == ParamStorage::Quantized(QuantKind::Nvfp4))
                .then(|| packed_layout(&layout))
                .transpose()?;
            for (i, &m) in members.iter().enumerate() {
                location[m] = (buffers.len(), i);
            }
            let (grad_reduce, param_gather) = if strategy.is_sharded() {
                (GradReduce::ReduceScatter, ParamGather::AllGather)
            } else {
                (GradReduce::AllReduce, ParamGather::None)
            };
            buffers.push(BufferPlan {
                key,
                strategy,
                group_size: cfg.dp,
                layout,
                params: members,
                packed,
                grad_reduce,
                param_gather,
                group: GroupId::Data,
            });
        }
        Ok(ShardingPlan {
            config: cfg.clone(),
            buffers,
            location,
        })
    }

    /// The configuration the plan was made from.
    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    /// Data-parallel group size.
    pub fn dp(&self) -> usize {
        self.config.dp
    }

    /// HFSDP: the pieces world rank (`rank` in its replica group, `replica` of `replicas`
    /// groups) owns: its [`Self::owned`] pieces cut to the `replica`-th of `replicas` equal
    /// parts of each of its bucket shards. Over all replica groups every element is owned
    /// exactly once.
    ///
    /// # Errors
    /// As [`Self::owned`]; [`LayoutError::UnevenReplicaSplit`] when a bucket shard does not split
    /// evenly.
    pub fn owned_hybrid(
        &self,
        rank: usize,
        replica: usize,
        replicas: usize,
    ) -> Result<Vec<OwnedPiece>, LayoutError> {
        let mut out = Vec::new();
        for piece in self.owned(rank)? {
            let bp = &self.buffers[piece.buffer];
            let shard = bp.shard(piece.bucket, rank)?;
            if !shard.len().is_multiple_of(replicas) {
                return Err(LayoutError::UnevenReplicaSplit {
                    len: shard.len(),
                    replicas,
                });
            }
            let part = shard.len() / replicas;
            let sub = shard.start + replica * part..shard.start + (replica + 1) * part;
            let (lo, hi) = (
                piece.buffer_range.start.max(sub.start),
                piece.buffer_range.end.min(sub.end),
            );
            if lo >= hi {
                continue;
            }
            let off = lo - piece.buffer_range.start;
            out.push(OwnedPiece {
                param_range: piece.param_range.start + off
                    ..piece.param_range.start + off + (hi - lo),
                buffer_range: lo..hi,
                ..piece
            });
        }
        Ok(out)
    }

    /// Whether ranks own disjoint pieces (every strategy of the plan is sharded).
    pub fn is_sharded(&self) -> bool {
        self.buffers.iter().all(|b| b.strategy.is_sharded())
    }

    /// The buffers, in order.
    pub fn buffers(&self) -> &[BufferPlan] {
        &self.buffers
    }

    /// Number of parameters planned.
    pub fn num_params(&self) -> usize {
        self.location.len()
    }

    /// `(buffer, index in the buffer's layout)` of global parameter `p`.
    ///
    /// # Panics
    /// If `p` is not a planned parameter.
    pub fn location(&self, p: usize) -> (usize, usize) {
        self.location[p]
    }

    /// Every piece rank `rank` owns, across buffers, sorted by (parameter, offset).
    ///
    /// # Errors
    /// Those of [`BufferPlan::owned`].
    pub fn owned(&self, rank: usize) -> Result<Vec<OwnedPiece>, LayoutError> {
        let mut out = Vec::new();
        for (b, buf) in self.buffers.iter().enumerate() {
            out.extend(buf.owned(b, rank)?);
        }
        out.sort_by_key(|s| (s.param, s.param_range.start));
        Ok(out)
    }

    /// Checks that a communicator of `size` ranks, this one being `rank`, is the group the plan
    /// was made for (the "shard count equals group size" invariant, Megatron-LM PR #6048).
    ///
    /// # Errors
    /// [`LayoutError::ShardCountMismatch`] or [`LayoutError::RankOutOfRange`].
    pub fn check_group(&self, size: usize, rank: usize) -> Result<(), LayoutError> {
        if size != self.config.dp {
            return Err(LayoutError::ShardCountMismatch {
                layout: self.config.dp,
                group: size,
            });
        }
        if rank >= size {
            return Err(LayoutError::RankOutOfRange { rank, dp: size });
        }
        Ok(())
    }
}

/// `(rows, cols)` of a parameter shape as a matrix quantizer sees it: leading dimensions folded
/// into rows (`[d0·…·dn-2, dn-1]`); a scalar is `1x1`.
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        // Saturating: a shape whose size passes usize is rejected by the layouts' shape check
        // (`LayoutError::ShapeMismatch`), not by a panic here.
        Some((&last, lead)) => (
            lead.iter()
                .try_fold(1usize, |n, &d| n.checked_mul(d))
                .unwrap_or(usize::MAX),
            last,
        ),
    }
}
