//! The stateful parameter and gradient buffers of data parallelism: buffers laid out by
//! [`crate::layout`], buckets, bucket groups, grad-ready counting, gradient sync
//! (reduce-scatter or all-reduce) and parameter sync (all-gather), with overlap on or off.
//!
//! This follows Megatron-LM's `param_and_grad_buffer.py` (research notes §1.4–§1.9) with two
//! structural choices that remove bug classes instead of testing for them:
//! - every bucket group has exactly one owning optimizer (groups are built per buffer, and a
//!   buffer's key includes its owner), so no group can be synced on behalf of an optimizer that
//!   has not stepped yet (bug class D);
//! - the param-gather dispatch state is explicit per group ([`ParamSyncState`]) and is reset by
//!   [`DataParallelBuffers::finish_grad_sync`] and by [`DataParallelBuffers::reset_param_sync`],
//!   which refuses to run while a gather is in flight (bug classes C and F4).
//!
//! A "rank" here is one `DataParallelBuffers` with its own [`Device`] and [`Communicator`]; all
//! ranks must make the same calls in the same order, as with any collective code.

use std::ops::Range;

use lowbit_comm::{CommError, Communicator, Op, ReduceOp, Work};
use lowbit_device::{DType, Device, DeviceError, Fp8Kind, Mxfp8Config, Mxfp8Views, View};

use crate::layout::{
    self, BufferKey, BufferLayout, GradDType, LayoutConfig, LayoutError, OptimizerId,
    ParamShardRange, ParamSpec, ParamStorage, QuantKind,
};

/// Errors of the stateful buffers.
#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    /// An invalid layout or shard request.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A configuration that cannot work, named with the rule it breaks.
    #[error("invalid data-parallel configuration: {0}")]
    Config(String),
    /// A call out of the order the protocol requires.
    #[error("{0}")]
    Protocol(String),
}

/// Result of this module.
pub type Result<T, E = BufferError> = std::result::Result<T, E>;

/// How gradients and parameters are synchronised across data-parallel ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DdpConfig {
    /// Shard gradients and optimizer state (reduce-scatter + all-gather) instead of all-reducing.
    pub distributed_optimizer: bool,
    /// Start each bucket group's gradient collective as soon as its gradients are ready.
    pub overlap_grad_reduce: bool,
    /// Gather parameters lazily in the next forward (per bucket group, next one prefetched)
    /// instead of right after the optimizer step.
    pub overlap_param_gather: bool,
    /// Reduce with `Avg` instead of pre-scaling by `1/dp` and reducing with `Sum`.
    pub average_in_collective: bool,
    /// Elements per bucket; `None` means one bucket per buffer. Ignored (one bucket) without
    /// overlapped grad reduce, as in Megatron.
    pub bucket_size: Option<usize>,
    /// Pad bucket ends to `lcm(dp, 128, 2^16)` instead of `lcm(dp, 128)`.
    pub high_busbw_padding: bool,
    /// Gather MXFP8 primary weights directly as fp8 bytes with 2D (32x32) scaling, tile amaxes
    /// reduced with MAX across ranks first, instead of staging bf16 values: both copies are the
    /// same bytes, so the gather moves half the bytes of bf16 staging. The weights then use
    /// TE's 2D weight recipe.
    pub mxfp8_direct_2d: bool,
}

impl DdpConfig {
    /// Megatron's rules that apply here (research §6.1).
    pub fn validate(&self) -> Result<()> {
        if self.overlap_param_gather && !self.distributed_optimizer {
            return Err(BufferError::Config(
                "overlapped param gather requires the distributed optimizer".into(),
            ));
        }
        if self.overlap_param_gather && !self.overlap_grad_reduce {
            return Err(BufferError::Config(
                "overlapped param gather requires overlapped grad reduce".into(),
            ));
        }
        if self.bucket_size == Some(0) {
            return Err(BufferError::Config("bucket size must be positive".into()));
        }
        Ok(())
    }
}

/// Param-gather dispatch state of one bucket group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamSyncState {
    /// Nothing dispatched this iteration: the next forward must gather.
    Idle,
    /// An asynchronous gather is in flight.
    InFlight,
    /// Gathered this iteration.
    Done,
}

/// Whether the low-precision weights of a bucket group reflect the fp32 masters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightState {
    /// The weights are `Q(bf16(master))` of the latest masters (or of the initial values).
    Current,
    /// The masters moved; `bf16(master)` must be staged and gathered before the next forward.
    Stale,
    /// `bf16(master)` shards are staged; the gather (and re-quantization) is pending.
    Staged,
}

/// The MXFP8 storage of one parameter (both copies, compact scales), outside every buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mxfp8Weights {
    /// Rows (product of the leading dimensions).
    pub rows: usize,
    /// Columns (last dimension).
    pub cols: usize,
    /// Rowwise data and scales.
    pub rowwise: (View, View),
    /// Columnwise data and scales.
    pub columnwise: (View, View),
}

impl Mxfp8Weights {
    fn views(&self) -> Mxfp8Views {
        Mxfp8Views {
            rowwise: Some(self.rowwise),
            columnwise: Some(self.columnwise),
        }
    }
}

/// The 2D NVFP4 storage of one parameter: its rowwise data is its slice of the packed param
/// buffer; scales, the columnwise copy and the reduced tile amaxes live outside.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nvfp4Weights {
    /// Rows (product of the leading dimensions), a multiple of 16.
    pub rows: usize,
    /// Columns (last dimension), a multiple of 16.
    pub cols: usize,
    /// Rowwise packed data (in the param buffer) and E4M3 scales.
    pub rowwise: (View, View),
    /// Columnwise (transposed) packed data and scales.
    pub columnwise: (View, View),
    /// MAX-reduced 16x16 tile amaxes (f32); the global amax is their max.
    pub tiles: View,
}

impl Nvfp4Weights {
    /// The device views of both copies.
    pub fn views(&self) -> lowbit_device::Nvfp4Views {
        lowbit_device::Nvfp4Views {
            rowwise: Some(self.rowwise),
            columnwise: Some(self.columnwise),
        }
    }
}

/// The 2D NVFP4 recipe of primary weights (TE's weight recipe: 16x16 tiles, no RHT, no SR).
pub fn nvfp4_weight_config() -> lowbit_device::Nvfp4Config {
    lowbit_device::Nvfp4Config {
        two_d: true,
        ..Default::default()
    }
}

/// The MXFP8 recipe of primary weights: E4M3, both copies, 1x32 blocks, TE's NaN policy.
pub fn mxfp8_weight_config() -> Mxfp8Config {
    Mxfp8Config {
        kind: Fp8Kind::E4M3,
        ..Mxfp8Config::default()
    }
}

/// `(rows, cols)` of a parameter shape as the quantizer sees it (`[d0·…, last]`).
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        None => (1, 1),
        Some((&last, lead)) => (lead.iter().product(), last),
    }
}

/// One buffer: a contiguous parameter region and gradient region sharing a [`BufferLayout`].
#[derive(Debug)]
struct Buffer {
    layout: BufferLayout,
    /// Global parameter ids, indexed like `layout.params`.
    params: Vec<usize>,
    /// Persistent parameter storage, or for quantized buffers the bf16 staging view that aliases
    /// the gradient buffer (its first half of bytes with fp32 gradients).
    param_data: View,
    grad_data: View,
    kind: BufKind,
    /// Packed byte map (NVFP4 buffers).
    packed: Option<layout::PackedLayout>,
    owner: OptimizerId,
}

/// How a buffer's parameter region is used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BufKind {
    /// Persistent bf16/f16/f32 parameter storage, gathered as is.
    Persistent,
    /// A bf16 staging view aliasing the gradients; MXFP8 weights live outside the buffer.
    Staging,
    /// Packed NVFP4 bytes (element offset / 2), quantized shard by shard before the gather;
    /// they are the rowwise data of the weights.
    Packed,
    /// 2D MXFP8 fp8 bytes (one per element), quantized shard by shard before the gather; they
    /// are both copies' data.
    Direct,
}

impl BufKind {
    /// Whether the buffer holds low-precision primary weights (with a weight state).
    pub fn low_precision(self) -> bool {
        self != BufKind::Persistent
    }
}

/// A set of buckets synchronised together in one coalesced launch.
#[derive(Debug)]
struct BucketGroup {
    buffer: usize,
    buckets: Vec<usize>,
    /// Global parameter ids in this group.
    params: Vec<usize>,
    grad_work: Option<Work>,
    grad_reduce_started: bool,
    grad_reduce_finished: bool,
    param_work: Option<Work>,
    param_state: ParamSyncState,
    /// Number of times each param (indexed like `params`) reported ready this iteration.
    ready_counts: Vec<u32>,
    /// Counts recorded in the first batch; later batches start the reduce when they match.
    golden_counts: Option<Vec<u32>>,
    /// Low-precision weight state (always `Current` for persistent-storage groups).
    weights: WeightState,
    /// Gathers of this group since the last `zero_grad_buffer` (forced syncs excluded).
    gathers: u32,
}

/// The data-parallel parameter and gradient buffers of one rank.
#[derive(Debug)]
pub struct DataParallelBuffers {
    cfg: DdpConfig,
    dp: usize,
    rank: usize,
    specs: Vec<ParamSpec>,
    buffers: Vec<Buffer>,
    groups: Vec<BucketGroup>,
    /// For each global param: (buffer, index in the buffer's layout, group).
    param_loc: Vec<(usize, usize, usize)>,
    first_batch: bool,
    last_microbatch: bool,
    /// MXFP8 storage of each quantized parameter.
    quantized: Vec<Option<Mxfp8Weights>>,
    /// NVFP4 storage of each NVFP4 parameter, and its global amax after the last gather.
    nvfp4: Vec<Option<(Nvfp4Weights, f32)>>,
    /// Reduced 32x32 tile amaxes of each directly gathered MXFP8 parameter.
    tiles: Vec<Option<View>>,
    /// Whether the next gradient access is the first of the iteration (checked in debug builds).
    check_before_backward: bool,
}

fn storage_dtype(s: ParamStorage) -> Result<DType> {
    match s {
        ParamStorage::Bf16 => Ok(DType::Bf16),
        ParamStorage::F16 => Ok(DType::F16),
        ParamStorage::F32 => Ok(DType::F32),
        ParamStorage::Quantized(QuantKind::Mxfp8) => Ok(DType::Bf16),
        ParamStorage::Quantized(QuantKind::Nvfp4) => Ok(DType::U8),
    }
}

fn grad_dtype(g: GradDType) -> DType {
    match g {
        GradDType::F32 => DType::F32,
        GradDType::Bf16 => DType::Bf16,
    }
}

impl DataParallelBuffers {
    /// Lays out `specs` (forward order) for a group of `dp` ranks and allocates zeroed buffers on
    /// `dev`. Parameter values are then written through [`Self::param_view`].
    pub fn new(
        dev: &mut Device,
        dp: usize,
        rank: usize,
        specs: Vec<ParamSpec>,
        cfg: DdpConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        if rank >= dp {
            return Err(BufferError::Config(format!("rank {rank} of {dp} ranks")));
        }
        let bucket_size = if cfg.overlap_grad_reduce {
            cfg.bucket_size
        } else {
            None
        };
        let lcfg = LayoutConfig {
            dp,
            bucket_size,
            distributed_optimizer: cfg.distributed_optimizer,
            high_busbw_padding: cfg.high_busbw_padding,
        };
        let any_quantized = specs.iter().any(|s| s.key.param_storage.is_quantized());
        if any_quantized && !cfg.distributed_optimizer {
            return Err(BufferError::Config(
                "low-precision parameter gather requires the distributed optimizer".into(),
            ));
        }
        let mut buffers = Vec::new();
        let mut groups = Vec::new();
        let mut param_loc = vec![(0, 0, 0); specs.len()];
        let mut quantized = vec![None; specs.len()];
        let mut nvfp4 = vec![None; specs.len()];
        let mut tiles = vec![None; specs.len()];
        for spec in &specs {
            if spec.key.param_storage == ParamStorage::Quantized(QuantKind::Nvfp4) {
                let (rows, cols) = matrix_dims(&spec.shape);
                if rows % 16 != 0 || cols % 16 != 0 {
                    return Err(BufferError::Config(format!(
                        "NVFP4 parameter `{}` is {rows}x{cols}: its 16x16 tiles need both \
                         dimensions to be multiples of 16",
                        spec.name
                    )));
                }
            }
        }
        for (key, members) in layout::group_params(&specs) {
            let key: BufferKey = key;
            let group_specs: Vec<&ParamSpec> = members.iter().map(|&i| &specs[i]).collect();
            let lay = layout::compute_layout(&group_specs, &lcfg)?;
            layout::check_shard_count(&lay, if cfg.distributed_optimizer { dp } else { 1 })?;
            let kind = buf_kind(&key, &cfg);
            let grad_data = dev.alloc(grad_dtype(key.grad_dtype), lay.numel);
            let packed = (kind == BufKind::Packed)
                .then(|| layout::packed_layout(&lay))
                .transpose()?;
            let param_data = match (kind, &packed) {
                // The bf16 staging view aliases the gradient buffer: the same memory, reused
                // between the optimizer step and the next backward.
                (BufKind::Staging, _) => grad_data.reinterpret(DType::Bf16)?.slice(0..lay.numel)?,
                (BufKind::Packed, Some(pk)) => dev.alloc(DType::U8, pk.numel_bytes),
                (BufKind::Direct, _) => dev.alloc(DType::U8, lay.numel),
                _ => dev.alloc(storage_dtype(key.param_storage)?, lay.numel),
            };
            for (i, &m) in members.iter().enumerate() {
                let (rows, cols) = matrix_dims(&specs[m].shape);
                match (kind, &packed) {
                    (BufKind::Staging, _) => {
                        let (rb, cb) = (cols.div_ceil(32), rows.div_ceil(32));
                        quantized[m] = Some(Mxfp8Weights {
                            rows,
                            cols,
                            rowwise: (
                                dev.alloc(DType::U8, rows * cols),
                                dev.alloc(DType::U8, rows * rb),
                            ),
                            columnwise: (
                                dev.alloc(DType::U8, rows * cols),
                                dev.alloc(DType::U8, cb * cols),
                            ),
                        });
                    }
                    (BufKind::Direct, _) => {
                        // Both copies of a 2D-scaled tensor hold the same bytes: one view.
                        let data = param_data.slice(lay.params[i].range())?;
                        quantized[m] = Some(Mxfp8Weights {
                            rows,
                            cols,
                            rowwise: (data, dev.alloc(DType::U8, rows * cols.div_ceil(32))),
                            columnwise: (data, dev.alloc(DType::U8, rows.div_ceil(32) * cols)),
                        });
                        tiles[m] = Some(
                            dev.alloc(DType::F32, lowbit_device::mxfp8_tile_count(rows, cols)),
                        );
                    }
                    (BufKind::Packed, Some(pk)) => {
                        let pr = &pk.params[i];
                        let w = Nvfp4Weights {
                            rows,
                            cols,
                            rowwise: (
                                param_data.slice(pr.start..pr.end)?,
                                dev.alloc(DType::U8, rows * cols / 16),
                            ),
                            columnwise: (
                                dev.alloc(DType::U8, rows * cols / 2),
                                dev.alloc(DType::U8, cols * rows / 16),
                            ),
                            tiles: dev.alloc(DType::F32, (rows / 16) * (cols / 16)),
                        };
                        nvfp4[m] = Some((w, 0.0));
                    }
                    _ => {}
                }
            }
            let staging = kind.low_precision();
            let b = buffers.len();
            for (bi, bucket) in lay.buckets.iter().enumerate() {
                let g = groups.len();
                let params: Vec<usize> = bucket.params.iter().map(|&p| members[p]).collect();
                for &p in &bucket.params {
                    param_loc[members[p]] = (b, p, g);
                }
                groups.push(BucketGroup {
                    buffer: b,
                    buckets: vec![bi],
                    ready_counts: vec![0; params.len()],
                    params,
                    grad_work: None,
                    grad_reduce_started: false,
                    grad_reduce_finished: false,
                    param_work: None,
                    param_state: if staging {
                        ParamSyncState::Done
                    } else {
                        ParamSyncState::Idle
                    },
                    golden_counts: None,
                    weights: WeightState::Current,
                    gathers: 0,
                });
            }
            buffers.push(Buffer {
                layout: lay,
                params: members,
                param_data,
                grad_data,
                kind,
                packed,
                owner: key.owner,
            });
        }
        Ok(DataParallelBuffers {
            cfg,
            dp,
            rank,
            specs,
            buffers,
            groups,
            param_loc,
            first_batch: true,
            last_microbatch: true,
            quantized,
            nvfp4,
            tiles,
            check_before_backward: false,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.cfg
    }
    /// Data-parallel group size.
    pub fn dp(&self) -> usize {
        self.dp
    }
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// The parameters, in forward order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.specs
    }
    /// Number of bucket groups (gradient collectives per step).
    pub fn num_groups(&self) -> usize {
        self.groups.len()
    }
    /// The bucket group holding parameter `p`.
    pub fn group_of(&self, p: usize) -> usize {
        self.param_loc[p].2
    }
    /// The parameters of bucket group `g`.
    pub fn group_params(&self, g: usize) -> &[usize] {
        &self.groups[g].params
    }
    /// The param-gather state of bucket group `g`.
    pub fn param_sync_state(&self, g: usize) -> ParamSyncState {
        self.groups[g].param_state
    }

    fn param_range(&self, p: usize) -> Range<usize> {
        let (b, i, _) = self.param_loc[p];
        self.buffers[b].layout.params[i].range()
    }

    /// The storage of parameter `p`: its slice of the param buffer (for low-precision
    /// parameters the staging view, the packed NVFP4 bytes or the fp8 bytes).
    pub fn param_view(&self, p: usize) -> Result<View> {
        let (b, i, _) = self.param_loc[p];
        let buf = &self.buffers[b];
        let range = match &buf.packed {
            Some(pk) => pk.params[i].start..pk.params[i].end,
            None => self.param_range(p),
        };
        Ok(buf.param_data.slice(range)?)
    }

    /// Whether parameter `p` has low-precision primary weights (MXFP8 or NVFP4 storage).
    pub fn is_low_precision(&self, p: usize) -> bool {
        self.buffers[self.param_loc[p].0].kind.low_precision()
    }

    /// The main gradient of parameter `p` (its slice of the gradient buffer).
    pub fn grad_view(&self, p: usize) -> Result<View> {
        let (b, _, _) = self.param_loc[p];
        Ok(self.buffers[b].grad_data.slice(self.param_range(p))?)
    }

    /// Every piece of a parameter this rank owns under the distributed optimizer (all of every
    /// parameter without it), with the views of its param and grad elements.
    pub fn owned_shards(&self) -> Result<Vec<OwnedShard>> {
        let mut out = Vec::new();
        for buf in &self.buffers {
            let ranges = if self.cfg.distributed_optimizer {
                layout::param_shard_ranges(&buf.layout, self.rank)?
            } else {
                buf.layout
                    .params
                    .iter()
                    .map(|pr| ParamShardRange {
                        param: pr.param,
                        bucket: pr.bucket,
                        gbuf_local: pr.range(),
                        gbuf_world: pr.range(),
                        gbuf_world_in_bucket: {
                            let s = buf.layout.buckets[pr.bucket].start;
                            pr.start - s..pr.end - s
                        },
                        param_range: 0..pr.numel(),
                    })
                    .collect()
            };
            for r in ranges {
                let param_view = if buf.kind == BufKind::Packed {
                    buf.param_data
                        .slice(r.gbuf_world.start / 2..r.gbuf_world.end / 2)?
                } else {
                    buf.param_data.slice(r.gbuf_world.clone())?
                };
                out.push(OwnedShard {
                    storage: buf.kind,
                    param: buf.params[r.param],
                    param_range: r.param_range.clone(),
                    param_view,
                    grad_view: buf.grad_data.slice(r.gbuf_world.clone())?,
                });
            }
        }
        out.sort_by_key(|s| (s.param, s.param_range.start));
        Ok(out)
    }

    /// Marks whether the coming backward is the last microbatch of the step (Megatron's
    /// `no_sync`): only then do gradients become ready for reduction.
    pub fn set_last_microbatch(&mut self, last: bool) {
        self.last_microbatch = last;
    }

    /// Zeroes every gradient buffer and resets the per-iteration grad-sync state. The first call
    /// after the first batch freezes that batch's ready counts as the golden counts.
    ///
    /// Zeroing also zeroes the staging views that alias the gradients: a group whose staged
    /// weights had not been gathered yet goes back to [`WeightState::Stale`] and must be staged
    /// again before the next forward (gathering it now would ship zeros: Megatron bug A1/A3).
    pub fn zero_grad_buffer(&mut self, dev: &mut Device) -> Result<()> {
        for g in &self.groups {
            if g.grad_work.is_some() || g.param_work.is_some() {
                return Err(BufferError::Protocol(
                    "zero_grad_buffer while a collective is in flight".into(),
                ));
            }
        }
        for b in &self.buffers {
            dev.zero(b.grad_data)?;
        }
        let record = self.first_batch && self.groups.iter().any(|g| g.grad_reduce_finished);
        let buffers = &self.buffers;
        for g in &mut self.groups {
            let aliased = buffers[g.buffer].kind == BufKind::Staging;
            if record {
                g.golden_counts = Some(g.ready_counts.clone());
            }
            g.ready_counts.iter_mut().for_each(|c| *c = 0);
            g.grad_reduce_started = false;
            g.grad_reduce_finished = false;
            g.gathers = 0;
            if aliased && g.weights == WeightState::Staged {
                g.weights = WeightState::Stale;
            }
        }
        if record {
            self.first_batch = false;
        }
        self.check_before_backward = true;
        Ok(())
    }

    /// Called from the backward hook when parameter `p`'s gradient is complete for this
    /// microbatch. On the last microbatch of a step after the first, the group's reduction
    /// starts once all of its parameters reported as often as in the first batch.
    pub fn register_grad_ready(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        p: usize,
    ) -> Result<()> {
        if !self.cfg.overlap_grad_reduce {
            return Err(BufferError::Protocol(
                "register_grad_ready is only used with overlapped grad reduce".into(),
            ));
        }
        if !self.last_microbatch {
            return Ok(());
        }
        let g = self.group_of(p);
        let group = &mut self.groups[g];
        let idx = group
            .params
            .iter()
            .position(|&q| q == p)
            .expect("a parameter is in its own group");
        group.ready_counts[idx] += 1;
        let complete = match &group.golden_counts {
            Some(golden) => group.ready_counts == *golden,
            None => false,
        };
        if complete && !group.grad_reduce_started {
            self.start_grad_sync(dev, comm, g)?;
        }
        Ok(())
    }

    /// Scales the group's gradients and launches its reduce-scatter (distributed optimizer) or
    /// all-reduce, asynchronously when grad reduce is overlapped.
    fn start_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        let (reduce, factor) = if self.cfg.average_in_collective {
            (ReduceOp::Avg, None)
        } else {
            (ReduceOp::Sum, Some(1.0 / self.dp as f32))
        };
        let group = &self.groups[g];
        let buf = &self.buffers[group.buffer];
        let mut ops = Vec::with_capacity(group.buckets.len());
        for &bi in &group.buckets {
            let bucket = &buf.layout.buckets[bi];
            let grads = buf.grad_data.slice(bucket.range())?;
            if let Some(f) = factor {
                dev.scale(grads, f)?;
            }
            ops.push(if self.cfg.distributed_optimizer {
                let shard = layout::shard_range(bucket, self.rank, self.dp)?;
                Op::ReduceScatter {
                    input: grads,
                    output: buf.grad_data.slice(shard)?,
                    reduce,
                }
            } else {
                Op::AllReduce { buf: grads, reduce }
            });
        }
        let work = comm.start_coalesced(dev, &ops)?;
        let group = &mut self.groups[g];
        group.grad_reduce_started = true;
        if self.cfg.overlap_grad_reduce {
            group.grad_work = Some(work);
        } else {
            work.wait(dev)?;
        }
        Ok(())
    }

    /// Completes every group's gradient reduction (launching those not started yet) and re-arms
    /// the next forward's parameter gather. Idempotent within an iteration.
    pub fn finish_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        for g in 0..self.groups.len() {
            if self.groups[g].param_state == ParamSyncState::InFlight {
                return Err(BufferError::Protocol(
                    "finish_grad_sync while a parameter gather is in flight".into(),
                ));
            }
            self.groups[g].param_state = ParamSyncState::Idle;
            if self.groups[g].grad_reduce_finished {
                continue;
            }
            if !self.groups[g].grad_reduce_started {
                if self.cfg.overlap_grad_reduce && !self.first_batch {
                    return Err(BufferError::Protocol(format!(
                        "bucket group {g}: communication was never started (not every parameter \
                         reported its gradient ready)"
                    )));
                }
                self.start_grad_sync(dev, comm, g)?;
            }
            if let Some(w) = self.groups[g].grad_work.take() {
                w.wait(dev)?;
            }
            self.groups[g].grad_reduce_finished = true;
        }
        Ok(())
    }

    /// Launches the parameter all-gather of group `g` (every bucket, coalesced): each rank's
    /// shard of the param buffer (or staging view) goes to every rank. Asynchronous when
    /// `asynchronous`; otherwise completed here, including the re-quantization of staged groups.
    fn start_param_sync_group(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        asynchronous: bool,
    ) -> Result<()> {
        if !self.cfg.distributed_optimizer {
            self.groups[g].param_state = ParamSyncState::Done;
            return Ok(());
        }
        if self.groups[g].param_state == ParamSyncState::InFlight {
            return Err(BufferError::Protocol(format!(
                "bucket group {g}: parameter gather dispatched twice"
            )));
        }
        let low = self.buffers[self.groups[g].buffer].kind.low_precision();
        if low && self.groups[g].weights != WeightState::Staged {
            return Err(BufferError::Protocol(format!(
                "bucket group {g}: gather of low-precision weights that are not staged \
                 ({:?}); stage bf16(master) after zeroing the gradients",
                self.groups[g].weights
            )));
        }
        self.groups[g].gathers += 1;
        if cfg!(debug_assertions) && self.groups[g].gathers > 1 {
            return Err(BufferError::Protocol(format!(
                "bucket group {g} gathered twice in one iteration"
            )));
        }
        let group = &self.groups[g];
        let buf = &self.buffers[group.buffer];
        let mut ops = Vec::with_capacity(group.buckets.len());
        for &bi in &group.buckets {
            let (shard, whole) = match &buf.packed {
                Some(pk) => {
                    let b = &pk.buckets[bi];
                    (pk.shard_range(bi, self.rank)?, b.start..b.end)
                }
                None => {
                    let bucket = &buf.layout.buckets[bi];
                    (
                        layout::shard_range(bucket, self.rank, self.dp)?,
                        bucket.range(),
                    )
                }
            };
            ops.push(Op::AllGather {
                input: buf.param_data.slice(shard)?,
                output: buf.param_data.slice(whole)?,
            });
        }
        let work = comm.start_coalesced(dev, &ops)?;
        if asynchronous {
            self.groups[g].param_work = Some(work);
            self.groups[g].param_state = ParamSyncState::InFlight;
        } else {
            work.wait(dev)?;
            self.after_gather(dev, g)?;
        }
        Ok(())
    }

    /// Completes a gather: for staging groups every rank re-quantizes each parameter from the
    /// gathered bf16 values, then zeroes this group's staging view and nothing else (other
    /// groups' staged values alias other gradient bytes).
    fn after_gather(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        self.groups[g].param_state = ParamSyncState::Done;
        let buf = &self.buffers[self.groups[g].buffer];
        match buf.kind {
            BufKind::Persistent => return Ok(()),
            BufKind::Packed => {
                // The gathered bytes are the rowwise data; every rank derives the scales and
                // the columnwise copy from the same reduced tile amaxes.
                for &p in &self.groups[g].params {
                    let (w, _) = self.nvfp4[p].expect("packed buffers hold NVFP4 params");
                    let amax = dev.nvfp4_finish_2d(w.rows, w.cols, w.tiles, &w.views())?;
                    self.nvfp4[p] = Some((w, amax));
                }
                self.groups[g].weights = WeightState::Current;
                return Ok(());
            }
            BufKind::Direct => {
                for &p in &self.groups[g].params {
                    let w = self.quantized[p].expect("direct buffers hold MXFP8 params");
                    let t = self.tiles[p].expect("direct params have tiles");
                    dev.mxfp8_scales_2d(
                        w.rows,
                        w.cols,
                        Fp8Kind::E4M3,
                        t,
                        w.rowwise.1,
                        w.columnwise.1,
                    )?;
                }
                self.groups[g].weights = WeightState::Current;
                return Ok(());
            }
            BufKind::Staging => {}
        }
        let cfg = mxfp8_weight_config();
        for &p in &self.groups[g].params {
            let w = self.quantized[p].expect("staging buffers hold quantized params");
            let (_, i, _) = self.param_loc[p];
            let src = buf.param_data.slice(buf.layout.params[i].range())?;
            dev.quantize_mxfp8(src, w.rows, w.cols, &cfg, &w.views())?;
        }
        for &bi in &self.groups[g].buckets {
            let view = buf.param_data.slice(buf.layout.buckets[bi].range())?;
            dev.zero(view)?;
            if cfg!(debug_assertions) && dev.read_bytes(view)?.iter().any(|&b| b != 0) {
                return Err(BufferError::Protocol(format!(
                    "bucket group {g}: staging view not zero after copy-back"
                )));
            }
        }
        self.groups[g].weights = WeightState::Current;
        Ok(())
    }

    /// Whether group `g` needs a gather before its parameters can be used.
    fn needs_gather(&self, g: usize) -> bool {
        let group = &self.groups[g];
        if self.buffers[group.buffer].kind.low_precision() {
            group.weights == WeightState::Staged && group.param_state != ParamSyncState::InFlight
        } else {
            group.param_state == ParamSyncState::Idle
        }
    }

    /// Gathers every group that needs it now and completes those in flight (the
    /// non-overlapped path after the optimizer step, and forced syncs). Staging groups must be
    /// `Current` or `Staged`; a `Stale` one is an error.
    pub fn sync_params(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()> {
        self.complete_param_sync(dev)?;
        for g in 0..self.groups.len() {
            if self.buffers[self.groups[g].buffer].kind.low_precision()
                && self.groups[g].weights == WeightState::Stale
            {
                return Err(BufferError::Protocol(format!(
                    "bucket group {g}: parameter sync of stale low-precision weights (nothing \
                     staged since the optimizer stepped)"
                )));
            }
            if self.needs_gather(g) {
                self.start_param_sync_group(dev, comm, g, false)?;
            }
        }
        Ok(())
    }

    /// Waits for every gather in flight and completes it.
    pub fn complete_param_sync(&mut self, dev: &mut Device) -> Result<()> {
        for g in 0..self.groups.len() {
            if let Some(w) = self.groups[g].param_work.take() {
                w.wait(dev)?;
                self.after_gather(dev, g)?;
            }
        }
        Ok(())
    }

    /// The forward pre-hook of the layers whose parameters are in group `g` (overlapped param
    /// gather): dispatches the gather if nobody has, waits for it, completes it and prefetches
    /// the next group's (groups were created in backward order, so forward order runs down).
    pub fn finish_param_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        let low = self.buffers[self.groups[g].buffer].kind.low_precision();
        if low && self.groups[g].weights == WeightState::Stale {
            return Err(BufferError::Protocol(format!(
                "bucket group {g}: forward with stale low-precision weights (the optimizer \
                 stepped and nothing was staged)"
            )));
        }
        if !self.cfg.overlap_param_gather {
            return Ok(());
        }
        if self.needs_gather(g) {
            self.start_param_sync_group(dev, comm, g, true)?;
        }
        if let Some(w) = self.groups[g].param_work.take() {
            w.wait(dev)?;
            self.after_gather(dev, g)?;
            if g > 0 && self.needs_gather(g - 1) {
                self.start_param_sync_group(dev, comm, g - 1, true)?;
            }
        }
        Ok(())
    }

    /// Resets every group's gather state to idle (after staging new values); refuses while a
    /// gather is in flight.
    pub fn reset_param_sync(&mut self) -> Result<()> {
        if self
            .groups
            .iter()
            .any(|g| g.param_state == ParamSyncState::InFlight)
        {
            return Err(BufferError::Protocol(
                "reset_param_sync while a parameter gather is in flight".into(),
            ));
        }
        self.groups
            .iter_mut()
            .for_each(|g| g.param_state = ParamSyncState::Idle);
        Ok(())
    }

    /// The low-precision weight state of group `g`.
    pub fn weight_state(&self, g: usize) -> WeightState {
        self.groups[g].weights
    }

    /// The MXFP8 storage of parameter `p`, if it has low-precision primary weights.
    pub fn mxfp8_weights(&self, p: usize) -> Option<Mxfp8Weights> {
        self.quantized[p]
    }

    /// Writes the initial weights of quantized parameter `p` as `Q(bf16(values))` directly (no
    /// staging: iteration 0 needs no gather).
    pub fn initialize_quantized(
        &mut self,
        dev: &mut Device,
        p: usize,
        values: &[f32],
    ) -> Result<()> {
        let tmp32 = dev.alloc(DType::F32, values.len());
        let tmp16 = dev.alloc(DType::Bf16, values.len());
        let r = dev
            .upload(tmp32, values)
            .and_then(|()| dev.cast(tmp32, tmp16))
            .map_err(BufferError::from)
            .and_then(|()| self.quantize_whole(dev, p, tmp16));
        dev.free(tmp32)?;
        dev.free(tmp16)?;
        r
    }

    /// Quantizes a whole parameter from `src` (its bf16 values) into its low-precision storage.
    fn quantize_whole(&mut self, dev: &mut Device, p: usize, src: View) -> Result<()> {
        if let (Some(w), Some(t)) = (self.quantized[p], self.tiles[p]) {
            dev.zero(t)?;
            dev.mxfp8_fold_tile_amax_2d(src, 0, w.cols, t)?;
            dev.mxfp8_quantize_2d_range(src, 0, w.cols, Fp8Kind::E4M3, t, w.rowwise.0)?;
            dev.mxfp8_scales_2d(
                w.rows,
                w.cols,
                Fp8Kind::E4M3,
                t,
                w.rowwise.1,
                w.columnwise.1,
            )?;
            return Ok(());
        }
        if let Some(w) = self.quantized[p] {
            dev.quantize_mxfp8(src, w.rows, w.cols, &mxfp8_weight_config(), &w.views())?;
            return Ok(());
        }
        if let Some((w, _)) = self.nvfp4[p] {
            dev.zero(w.tiles)?;
            dev.nvfp4_fold_tile_amax_2d(src, 0, w.cols, w.tiles)?;
            dev.nvfp4_quantize_2d_range(src, 0, w.cols, w.tiles, w.rowwise.0)?;
            let amax = dev.nvfp4_finish_2d(w.rows, w.cols, w.tiles, &w.views())?;
            self.nvfp4[p] = Some((w, amax));
            return Ok(());
        }
        Err(BufferError::Config(format!(
            "parameter `{}` has no low-precision storage",
            self.specs[p].name
        )))
    }

    /// The NVFP4 storage of parameter `p` and its current global amax, if it has NVFP4 primary
    /// weights.
    pub fn nvfp4_weights(&self, p: usize) -> Option<(Nvfp4Weights, f32)> {
        self.nvfp4[p]
    }

    /// Quantizes `owner`'s NVFP4 shards into the packed param buffer: `pieces` are this rank's
    /// owned pieces `(param, range within the flattened param, values)` of `bf16(master)` (any
    /// float view). Partial 16x16 tile amaxes are reduced with MAX across ranks first, so every
    /// rank derives the same scales; the groups become `Staged` (the bytes go out with the
    /// next gather). Collective: every rank calls it for the same owner.
    pub fn stage_packed(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        pieces: &[(usize, Range<usize>, View)],
    ) -> Result<()> {
        let params: Vec<usize> = (0..self.specs.len())
            .filter(|&p| {
                self.specs[p].owner() == owner
                    && (self.nvfp4[p].is_some() || self.tiles[p].is_some())
            })
            .collect();
        if params.is_empty() {
            return Ok(());
        }
        let tiles_of = |p: usize| {
            self.nvfp4[p]
                .map(|(w, _)| w.tiles)
                .or(self.tiles[p])
                .expect("filtered")
        };
        for &p in &params {
            dev.zero(tiles_of(p))?;
        }
        let pieces: Vec<_> = pieces
            .iter()
            .filter(|(p, _, _)| params.contains(p))
            .collect();
        for (p, range, values) in &pieces {
            let cols = matrix_dims(&self.specs[*p].shape).1;
            if self.nvfp4[*p].is_some() {
                dev.nvfp4_fold_tile_amax_2d(*values, range.start, cols, tiles_of(*p))?;
            } else {
                dev.mxfp8_fold_tile_amax_2d(*values, range.start, cols, tiles_of(*p))?;
            }
        }
        let ops: Vec<Op> = params
            .iter()
            .map(|&p| Op::AllReduce {
                buf: tiles_of(p),
                reduce: ReduceOp::Max,
            })
            .collect();
        comm.start_coalesced(dev, &ops)?.wait(dev)?;
        for (p, range, values) in &pieces {
            let cols = matrix_dims(&self.specs[*p].shape).1;
            if let Some((w, _)) = self.nvfp4[*p] {
                let bytes = w.rowwise.0.slice(range.start / 2..range.end / 2)?;
                dev.nvfp4_quantize_2d_range(*values, range.start, cols, w.tiles, bytes)?;
            } else {
                let w = self.quantized[*p].expect("direct params are MXFP8");
                let bytes = w.rowwise.0.slice(range.clone())?;
                let t = tiles_of(*p);
                dev.mxfp8_quantize_2d_range(*values, range.start, cols, Fp8Kind::E4M3, t, bytes)?;
            }
        }
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let b = &self.buffers[g.buffer];
            if matches!(b.kind, BufKind::Packed | BufKind::Direct) && b.owner == owner {
                if g.param_state == ParamSyncState::InFlight {
                    return Err(BufferError::Protocol(format!(
                        "bucket group {gi}: staging while its gather is in flight"
                    )));
                }
                g.weights = WeightState::Staged;
                g.param_state = ParamSyncState::Idle;
            }
        }
        Ok(())
    }

    /// Marks the staging groups of `owner` stale: its masters moved.
    pub fn mark_stale(&mut self, owner: OptimizerId) {
        for g in &mut self.groups {
            let b = &self.buffers[g.buffer];
            if b.kind.low_precision() && b.owner == owner {
                g.weights = WeightState::Stale;
            }
        }
    }

    /// Whether any staging group of `owner` is stale.
    pub fn has_stale(&self, owner: OptimizerId) -> bool {
        self.groups.iter().any(|g| {
            let b = &self.buffers[g.buffer];
            b.kind.low_precision() && b.owner == owner && g.weights == WeightState::Stale
        })
    }

    /// Declares that `owner` wrote `bf16(master)` into every staging shard it owns: its staging
    /// groups become `Staged` and their dispatch state is reset, so the next forward (or sync)
    /// gathers them exactly once. Refuses while a gather is in flight.
    pub fn mark_staged(&mut self, owner: OptimizerId) -> Result<()> {
        for (gi, g) in self.groups.iter_mut().enumerate() {
            let b = &self.buffers[g.buffer];
            if !(b.kind == BufKind::Staging && b.owner == owner) {
                continue;
            }
            if g.param_state == ParamSyncState::InFlight {
                return Err(BufferError::Protocol(format!(
                    "bucket group {gi}: staging while its gather is in flight"
                )));
            }
            g.weights = WeightState::Staged;
            g.param_state = ParamSyncState::Idle;
        }
        Ok(())
    }

    /// The gradient view of `p` for accumulation in the backward. The first call after
    /// `zero_grad_buffer` checks (in debug and test builds) that every low-precision group is
    /// gathered and its staging zeroed and that the gradient buffers are zero — the state
    /// Megatron's staging bugs (A1–A3, C) violate.
    pub fn accumulation_view(&mut self, dev: &mut Device, p: usize) -> Result<View> {
        if self.check_before_backward {
            self.check_before_backward = false;
            if cfg!(debug_assertions) {
                for (gi, g) in self.groups.iter().enumerate() {
                    if self.buffers[g.buffer].kind.low_precision()
                        && g.weights != WeightState::Current
                    {
                        return Err(BufferError::Protocol(format!(
                            "bucket group {gi}: backward starts while its weights are {:?}",
                            g.weights
                        )));
                    }
                }
                for b in &self.buffers {
                    if dev.read_bytes(b.grad_data)?.iter().any(|&x| x != 0) {
                        return Err(BufferError::Protocol(
                            "backward starts on a gradient buffer that is not zero".into(),
                        ));
                    }
                }
            }
        }
        self.grad_view(p)
    }

    /// Bytes of each buffer kind on this rank: (persistent parameter storage, gradients).
    /// Staging views alias the gradients and are not counted.
    pub fn memory_bytes(&self) -> (usize, usize) {
        self.memory().iter().fold((0, 0), |(p, g), b| {
            (p + if b.staging > 0 { 0 } else { b.weights }, g + b.grads)
        })
    }

    /// Memory of every buffer on this rank (allocated bytes; staging is aliased, not allocated).
    pub fn memory(&self) -> Vec<BufferMemory> {
        self.buffers
            .iter()
            .map(|b| {
                buffer_memory(
                    &b.layout,
                    &b.params.iter().map(|&p| &self.specs[p]).collect::<Vec<_>>(),
                    b.kind,
                )
            })
            .collect()
    }
}

/// How a buffer with `key` uses its parameter region under `cfg`.
pub fn buf_kind(key: &BufferKey, cfg: &DdpConfig) -> BufKind {
    match key.param_storage {
        ParamStorage::Quantized(QuantKind::Mxfp8) if cfg.mxfp8_direct_2d => BufKind::Direct,
        ParamStorage::Quantized(QuantKind::Mxfp8) => BufKind::Staging,
        ParamStorage::Quantized(QuantKind::Nvfp4) => BufKind::Packed,
        _ => BufKind::Persistent,
    }
}

/// Bytes of one buffer on one rank, by category.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferMemory {
    /// The buffer's key.
    pub key: BufferKey,
    /// Padded elements of the buffer.
    pub numel: usize,
    /// Weights: the persistent parameter buffer, or the low-precision storage (both MXFP8
    /// copies and their scales) of its parameters.
    pub weights: usize,
    /// Bytes of the bf16 staging view; it aliases the gradient buffer, so it costs nothing.
    pub staging: usize,
    /// The gradient buffer.
    pub grads: usize,
}

/// The memory of a buffer with `layout` holding `specs` (in the layout's order), from the closed
/// form: what [`DataParallelBuffers::new`] allocates.
pub fn buffer_memory(layout: &BufferLayout, specs: &[&ParamSpec], kind: BufKind) -> BufferMemory {
    let key = layout.key;
    let grads = layout.numel * grad_dtype(key.grad_dtype).size();
    let (weights, staging) = match key.param_storage {
        ParamStorage::Quantized(QuantKind::Mxfp8) if kind == BufKind::Direct => {
            // The fp8 bytes (padding included; both copies), both scale tensors, tile amaxes.
            let outside: usize = specs
                .iter()
                .map(|s| {
                    let (r, c) = matrix_dims(&s.shape);
                    r * c.div_ceil(32) + r.div_ceil(32) * c + 4 * r.div_ceil(32) * c.div_ceil(32)
                })
                .sum();
            (layout.numel + outside, 0)
        }
        ParamStorage::Quantized(QuantKind::Mxfp8) => {
            let w = specs
                .iter()
                .map(|s| {
                    let (r, c) = matrix_dims(&s.shape);
                    2 * r * c + r * c.div_ceil(32) + r.div_ceil(32) * c
                })
                .sum();
            (w, layout.numel * 2)
        }
        ParamStorage::Quantized(QuantKind::Nvfp4) => {
            // The packed buffer (rowwise data, padding included), rowwise scales, the
            // columnwise copy and the f32 tile amaxes.
            let outside: usize = specs
                .iter()
                .map(|s| {
                    let (r, c) = matrix_dims(&s.shape);
                    r * c / 16 + r * c / 2 + r * c / 16 + 4 * (r / 16) * (c / 16)
                })
                .sum();
            (layout.numel / 2 + outside, 0)
        }
        _ => {
            let size = storage_dtype(key.param_storage).map_or(0, |d| d.size());
            (layout.numel * size, 0)
        }
    };
    BufferMemory {
        key,
        numel: layout.numel,
        weights,
        staging,
        grads,
    }
}

/// The buffer memory `DataParallelBuffers::new` would allocate for `specs`, computed from the
/// layouts alone (no allocation), for models too large to instantiate.
pub fn estimate_buffer_memory(
    specs: &[ParamSpec],
    dp: usize,
    cfg: &DdpConfig,
) -> Result<Vec<BufferMemory>> {
    let lcfg = LayoutConfig {
        dp,
        bucket_size: if cfg.overlap_grad_reduce {
            cfg.bucket_size
        } else {
            None
        },
        distributed_optimizer: cfg.distributed_optimizer,
        high_busbw_padding: cfg.high_busbw_padding,
    };
    layout::group_params(specs)
        .into_iter()
        .map(|(_, members)| {
            let group: Vec<&ParamSpec> = members.iter().map(|&i| &specs[i]).collect();
            let lay = layout::compute_layout(&group, &lcfg)?;
            let kind = buf_kind(&lay.key, cfg);
            Ok(buffer_memory(&lay, &group, kind))
        })
        .collect()
}

/// One rank's piece of one parameter: the optimizer's unit of work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedShard {
    /// What `param_view` is: persistent weights (the optimizer writes them), a bf16 staging
    /// view (the optimizer stages `bf16(master)` into it) or packed NVFP4 bytes (staged by
    /// [`DataParallelBuffers::stage_packed`]).
    pub storage: BufKind,
    /// Global parameter id.
    pub param: usize,
    /// Sub-range of the flattened parameter.
    pub param_range: Range<usize>,
    /// Those elements in the param buffer.
    pub param_view: View,
    /// Those elements in the gradient buffer (reduced after `finish_grad_sync`).
    pub grad_view: View,
}
