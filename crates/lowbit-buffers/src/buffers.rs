//! [`DataParallelBuffers`]: one rank's parameter and gradient buffers laid out by a
//! [`ShardingPlan`], their bucket groups and per-group state. The protocol operations live in
//! `grad_sync.rs`, `param_sync.rs` and `stage.rs`; memory accounting in `memory.rs`.

use std::ops::Range;

use lowbit_comm::{Communicator, Op, Work};
use lowbit_device::{DType, Device, View};
use lowbit_layout::{BufferPlan, OptimizerId, ParamSpec, PlanConfig, ShardingPlan};

use crate::config::DdpConfig;
use crate::error::{BufferError, ConfigError, ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::storage::{self, LowPrecisionWeights, Storage, StorageKind};

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

/// One buffer: its plan, gradient memory and weight storage.
#[derive(Debug)]
pub(crate) struct Buffer {
    pub(crate) plan: BufferPlan,
    /// The main gradients: the whole buffer, or (strategies that shard gradients) this rank's
    /// bucket shards one after the other.
    pub(crate) grads: View,
    /// The bf16 memory of an MXFP8 staging view where it cannot alias sharded gradients.
    pub(crate) staging_backing: Option<View>,
    pub(crate) storage: Box<dyn Storage>,
}

impl Buffer {
    pub(crate) fn owner(&self) -> OptimizerId {
        self.plan.key.owner
    }

    pub(crate) fn shards_grads(&self) -> bool {
        self.plan.strategy.shards_grads()
    }

    pub(crate) fn shards_params(&self) -> bool {
        self.plan.strategy.shards_params()
    }
}

/// The transient communication memory of one bucket group's gradient reduction.
#[derive(Debug, Default)]
pub(crate) enum GradComm {
    /// Nothing held.
    #[default]
    Idle,
    /// Sharded gradients: the backward accumulates this microbatch into the bucket.
    Filling(View),
    /// A reduction launched and not yet completed: its transient bucket (sharded gradients, or
    /// a communication dtype other than the gradients'), the work in flight, and its launch
    /// number (older launches are completed first when a new bucket is needed).
    Launched {
        bucket: Option<View>,
        work: Option<Work>,
        seq: u64,
    },
}

/// A set of buckets synchronised together in one coalesced launch.
#[derive(Debug)]
pub(crate) struct BucketGroup {
    pub(crate) buffer: usize,
    pub(crate) buckets: Vec<usize>,
    /// Global parameter ids in this group.
    pub(crate) params: Vec<usize>,
    /// Their indices in the buffer's layout.
    pub(crate) indices: Vec<usize>,
    pub(crate) grad_comm: GradComm,
    /// Launched this iteration (sharded gradients: this microbatch).
    pub(crate) grad_reduce_started: bool,
    pub(crate) grad_reduce_finished: bool,
    pub(crate) param_work: Option<Work>,
    pub(crate) param_state: ParamSyncState,
    /// Number of times each param (indexed like `params`) reported ready this iteration.
    pub(crate) ready_counts: Vec<u32>,
    /// Counts recorded in the first batch; later batches start the reduce when they match.
    pub(crate) golden_counts: Option<Vec<u32>>,
    /// Low-precision weight state (always `Current` for persistent storage).
    pub(crate) weights: WeightState,
    /// Gathers of this group since the gradients were last zeroed (forced syncs excluded; a
    /// gather in flight at the zeroing counts as the coming forward's).
    pub(crate) gathers: u32,
    /// Sharded parameters: the gathered unit (transient) while this group's parameters are
    /// in use, and its gather while in flight.
    pub(crate) unit: crate::units::Unit,
}

/// The data-parallel parameter and gradient buffers of one rank.
///
/// A "rank" here is one `DataParallelBuffers` with its own [`Device`] and [`Communicator`]; all
/// ranks must make the same calls in the same order, as with any collective code. Most callers
/// drive it through `lowbit-train`'s step driver rather than call the protocol methods directly.
#[derive(Debug)]
pub struct DataParallelBuffers {
    pub(crate) cfg: DdpConfig,
    pub(crate) plan: ShardingPlan,
    pub(crate) rank: usize,
    pub(crate) specs: Vec<ParamSpec>,
    pub(crate) buffers: Vec<Buffer>,
    pub(crate) groups: Vec<BucketGroup>,
    /// The bucket group of each global parameter.
    pub(crate) group_of: Vec<usize>,
    pub(crate) first_batch: bool,
    pub(crate) last_microbatch: bool,
    /// Whether the next gradient access is the first of the iteration.
    pub(crate) check_before_backward: bool,
    /// A new microbatch was announced ([`Self::set_last_microbatch`]) and the previous one
    /// wrote gradients: sharded gradients not reduced yet are reduced at the next hook call.
    pub(crate) microbatch_due: bool,
    /// Gradients were written since the last microbatch boundary.
    pub(crate) microbatch_dirty: bool,
    /// Launch counter of gradient reductions.
    pub(crate) launches: u64,
    /// Hybrid sharding: the group of this rank's replicas (the ranks holding the same shards in
    /// the other replica groups), across which reduced shards are all-reduced once per step.
    pub(crate) outer: Option<Box<dyn Communicator>>,
    /// What the replica groups share ([`ReplicaMode`]).
    pub(crate) replica_mode: ReplicaMode,
    /// HFSDP: the parameter shards hold only this rank's updated part until they are gathered
    /// across replicas.
    pub(crate) replica_params_stale: bool,
}

/// What the replica groups of hybrid sharding share.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReplicaMode {
    /// HSDP: replicas hold the same shards and optimizer state; reduced gradient shards are
    /// all-reduced across them.
    #[default]
    Replicate,
    /// HFSDP (`optim_grads_params` inside): each rank's shards are split across its replicas
    /// for the optimizer (state over shard × replica ranks); reduced gradient shards are
    /// reduce-scattered across replicas and updated parameter parts all-gathered back.
    ShardOptimizer,
}

/// One rank's piece of one parameter with its views: the optimizer's unit of work.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OwnedShard {
    /// Global parameter id.
    pub param: usize,
    /// Sub-range of the flattened parameter.
    pub param_range: Range<usize>,
    /// Those elements in the gradient buffer (reduced after `finish_grad_sync`).
    pub grad_view: View,
    /// Where the optimizer writes the rounded new values fused into its update (persistent
    /// storage); `None` when the weights are low precision and go through
    /// [`StepProtocol::stage`] instead.
    pub fused_output: Option<View>,
}

impl DataParallelBuffers {
    /// Plans `specs` (forward order) for a group of `dp` ranks with `cfg`'s strategy and
    /// allocates zeroed buffers on `dev`. Parameter values are then written with
    /// [`Self::initialize`].
    ///
    /// # Errors
    /// Invalid configurations ([`ConfigError`]), plans ([`lowbit_layout::LayoutError`]).
    pub fn new(
        dev: &mut Device,
        dp: usize,
        rank: usize,
        specs: Vec<ParamSpec>,
        cfg: DdpConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let plan = ShardingPlan::new(&specs, &cfg.plan_config(dp))?;
        Self::with_plan(dev, rank, specs, plan, cfg)
    }

    /// As [`Self::new`] with a plan made by the caller (per-owner strategies, e.g. layer-wise
    /// for a Muon owner). `plan` must have been made from `specs`.
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn with_plan(
        dev: &mut Device,
        rank: usize,
        specs: Vec<ParamSpec>,
        plan: ShardingPlan,
        cfg: DdpConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        let dp = plan.dp();
        if rank >= dp {
            return Err(ConfigError::RankOutOfRange { rank, dp }.into());
        }
        if plan.num_params() != specs.len() {
            return Err(ConfigError::NoSuchParam {
                param: plan.num_params(),
                params: specs.len(),
            }
            .into());
        }
        if cfg.overlap.param_gather() && !plan.is_sharded() {
            return Err(ConfigError::ParamGatherOverlapNeedsSharding.into());
        }
        let mut buffers = Vec::new();
        let mut groups = Vec::new();
        let mut group_of = vec![0; specs.len()];
        for (b, bp) in plan.buffers().iter().enumerate() {
            let layout = &bp.layout;
            let shard_grads = bp.strategy.shards_grads();
            let grads = dev.alloc(
                storage::grad_dtype(bp.key.grad_dtype),
                if shard_grads {
                    bp.shard_numel()
                } else {
                    layout.numel
                },
            );
            // A staging view aliases the whole gradient buffer; sharded gradients have no whole
            // buffer, so staging gets bf16 memory of its own (zeroed with the gradients, staged
            // bytes kept, as where it aliases them).
            let staging_backing = (shard_grads
                && !bp.strategy.shards_params()
                && storage::stages_through_grads(bp, cfg.mxfp8_gather))
            .then(|| dev.alloc(DType::Bf16, layout.numel));
            let members: Vec<&ParamSpec> = bp.params.iter().map(|&p| &specs[p]).collect();
            let storage = storage::allocate(
                dev,
                bp,
                &members,
                staging_backing.unwrap_or(grads),
                cfg.mxfp8_gather,
                rank,
            )?;
            let low = storage.is_low_precision();
            for (bi, bucket) in layout.buckets.iter().enumerate() {
                let g = groups.len();
                let params: Vec<usize> = bucket.params.iter().map(|&i| bp.params[i]).collect();
                for &p in &params {
                    group_of[p] = g;
                }
                groups.push(BucketGroup {
                    buffer: b,
                    buckets: vec![bi],
                    ready_counts: vec![0; params.len()],
                    indices: bucket.params.clone(),
                    params,
                    grad_comm: GradComm::Idle,
                    grad_reduce_started: false,
                    grad_reduce_finished: false,
                    param_work: None,
                    // Low-precision weights start current (written by `initialize`), so
                    // iteration 0 needs no gather.
                    param_state: if low {
                        ParamSyncState::Done
                    } else {
                        ParamSyncState::Idle
                    },
                    golden_counts: None,
                    weights: WeightState::Current,
                    gathers: 0,
                    unit: crate::units::Unit::default(),
                });
            }
            buffers.push(Buffer {
                plan: bp.clone(),
                grads,
                staging_backing,
                storage,
            });
        }
        Ok(DataParallelBuffers {
            cfg,
            plan,
            rank,
            specs,
            buffers,
            groups,
            group_of,
            first_batch: true,
            last_microbatch: true,
            check_before_backward: false,
            microbatch_due: false,
            microbatch_dirty: false,
            launches: 0,
            outer: None,
            replica_mode: ReplicaMode::Replicate,
            replica_params_stale: false,
        })
    }

    /// Hybrid sharding (HSDP): the plan's group is one replica group of sharded ranks, and
    /// `outer` holds this rank's counterparts in the other replica groups. Gradients are then
    /// reduced in the shard group (scaled by `1/(dp · outer size)`), and each rank's reduced
    /// shards all-reduced across `outer` once per step, in
    /// [`StepProtocol::finish_grad_sync`] (in the main-gradient dtype). Everything else (gathers,
    /// staging, the norm over owned shards) stays in the shard group: replicas hold the same
    /// reduced gradients and masters, so they take the same steps.
    ///
    /// [`ReplicaMode::Replicate`] is that (HSDP); with [`ReplicaMode::ShardOptimizer`] (HFSDP)
    /// every buffer must shard parameters (`optim_grads_params`) with bf16/f16/f32 weights, and
    /// the plan must split bucket shards across as many replica groups
    /// (`PlanConfig::outer_shards`).
    ///
    /// # Errors
    /// [`ProtocolError::CollectiveInFlight`] while a reduction is in flight;
    /// [`ConfigError::Policy`] for a plan or storage HFSDP cannot use.
    pub fn set_replica_group(
        &mut self,
        outer: Box<dyn Communicator>,
        mode: ReplicaMode,
    ) -> Result<()> {
        if self
            .groups
            .iter()
            .any(|g| !matches!(g.grad_comm, crate::buffers::GradComm::Idle))
        {
            return Err(ProtocolError::CollectiveInFlight.into());
        }
        if mode == ReplicaMode::ShardOptimizer {
            if let Some(b) = self
                .buffers
                .iter()
                .find(|b| !b.shards_params() || b.storage.is_low_precision())
            {
                return Err(ConfigError::Policy(format!(
                    "optimizer state sharded across replica groups needs optim_grads_params with \
                     bf16/f16/f32 weights; buffer {:?} is {:?}",
                    b.plan.key, b.plan.strategy
                ))
                .into());
            }
            if self.plan.config().outer_shards != outer.size() {
                return Err(ConfigError::Policy(format!(
                    "the plan splits shards across {} replica groups, the replica group has {} \
                     ranks",
                    self.plan.config().outer_shards,
                    outer.size()
                ))
                .into());
            }
        }
        self.outer = Some(outer);
        self.replica_mode = mode;
        Ok(())
    }

    /// The body of [`StepProtocol::optimizer_sharded_across_replicas`].
    pub(crate) fn optimizer_sharded_across_replicas(&self) -> bool {
        self.replica_mode == ReplicaMode::ShardOptimizer && self.outer.is_some()
    }

    /// The body of [`StepProtocol::replica_group`].
    pub(crate) fn replica_group(&mut self) -> Option<&mut dyn Communicator> {
        match &mut self.outer {
            Some(c) => Some(c.as_mut()),
            None => None,
        }
    }

    /// HFSDP: this rank's shard of bucket `bi` of buffer `b` in its shard storage, and the part
    /// of it this rank's replica owns (the shard split evenly across the replica group).
    pub(crate) fn replica_part(&self, b: usize, bi: usize) -> Result<(Range<usize>, Range<usize>)> {
        let (n, o) = self.outer.as_ref().map_or((1, 0), |c| (c.size(), c.rank()));
        let local = self.buffers[b].plan.local_shard_range(bi, self.rank)?;
        let part = local.len() / n;
        let mine = local.start + o * part..local.start + (o + 1) * part;
        Ok((local, mine))
    }

    /// HFSDP: all-gathers every rank's updated part of its parameter shards across replicas
    /// (once after the optimizer wrote them; before any unit gathers).
    pub(crate) fn refresh_replica_params(&mut self, dev: &mut Device) -> Result<()> {
        if !std::mem::take(&mut self.replica_params_stale)
            || !self.optimizer_sharded_across_replicas()
        {
            return Ok(());
        }
        let mut ops = Vec::new();
        for (b, buf) in self.buffers.iter().enumerate() {
            let region = buf.storage.region();
            for bi in 0..buf.plan.layout.buckets.len() {
                let (local, mine) = self.replica_part(b, bi)?;
                ops.push(Op::AllGather {
                    input: region.slice(mine)?,
                    output: region.slice(local)?,
                });
            }
        }
        let outer = self.outer.as_mut().expect("checked above");
        outer.start_coalesced(dev, &ops)?.wait(dev)?;
        Ok(())
    }

    /// The body of [`StepProtocol::set_grad_comm_dtype`].
    pub(crate) fn set_grad_comm_dtype(
        &mut self,
        dtype: Option<lowbit_layout::GradDType>,
    ) -> Result<()> {
        if self
            .groups
            .iter()
            .any(|g| !matches!(g.grad_comm, crate::buffers::GradComm::Idle))
        {
            return Err(ProtocolError::CollectiveInFlight.into());
        }
        self.cfg.grad_comm_dtype = dtype;
        Ok(())
    }

    /// The size of the outer (replica) group: 1 without hybrid sharding.
    pub(crate) fn outer_size(&self) -> usize {
        self.outer.as_ref().map_or(1, |c| c.size())
    }

    /// The configuration.
    pub fn config(&self) -> &DdpConfig {
        &self.cfg
    }
    /// The sharding plan.
    pub fn plan(&self) -> &ShardingPlan {
        &self.plan
    }
    /// Data-parallel group size.
    pub fn dp(&self) -> usize {
        self.plan.dp()
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
        self.group_of[p]
    }
    /// The parameters of bucket group `g`.
    pub fn group_params(&self, g: usize) -> &[usize] {
        &self.groups[g].params
    }
    /// The body of [`StepProtocol::param_sync_state`].
    pub(crate) fn param_sync_state(&self, g: usize) -> ParamSyncState {
        self.groups[g].param_state
    }
    /// The body of [`StepProtocol::weight_state`].
    pub(crate) fn weight_state(&self, g: usize) -> WeightState {
        self.groups[g].weights
    }
    /// The storage kind of parameter `p`'s buffer.
    pub fn storage_kind(&self, p: usize) -> StorageKind {
        self.buffer_of(p).storage.kind()
    }

    /// The bucket groups satisfying `f`, in order.
    pub(crate) fn groups_where(&self, f: impl Fn(&BucketGroup) -> bool) -> Vec<usize> {
        (0..self.groups.len())
            .filter(|&g| f(&self.groups[g]))
            .collect()
    }

    pub(crate) fn buffer_of(&self, p: usize) -> &Buffer {
        &self.buffers[self.plan.location(p).0]
    }

    pub(crate) fn check_param(&self, p: usize) -> Result<()> {
        if p < self.specs.len() {
            Ok(())
        } else {
            Err(ConfigError::NoSuchParam {
                param: p,
                params: self.specs.len(),
            }
            .into())
        }
    }

    /// The storage of parameter `p`: its slice of the parameter region (for low-precision
    /// parameters the staging view, the packed NVFP4 bytes or the fp8 bytes).
    ///
    /// Where parameters are sharded (`optim_grads_params`) this is the parameter's slice of its
    /// gathered unit, which exists only while the hooks hold the unit:
    /// [`ProtocolError::NotGathered`] otherwise.
    pub fn param_view(&self, p: usize) -> Result<View> {
        self.check_param(p)?;
        let (b, i) = self.plan.location(p);
        let buf = &self.buffers[b];
        if buf.shards_params() {
            let g = self.group_of[p];
            let Some(unit) = self.unit_values(g) else {
                return Err(ProtocolError::NotGathered {
                    name: self.specs[p].name.clone(),
                    group: g,
                }
                .into());
            };
            let at = self.group_range(g).start;
            let r = buf.plan.param_storage_range(i);
            return Ok(unit.slice(r.start - at..r.end - at)?);
        }
        Ok(buf
            .storage
            .region()
            .slice(buf.plan.param_storage_range(i))?)
    }

    /// The buffer range (elements) of bucket group `g`'s buckets.
    pub(crate) fn group_range(&self, g: usize) -> Range<usize> {
        let group = &self.groups[g];
        let buckets = &self.buffers[group.buffer].plan.layout.buckets;
        let first = buckets[group.buckets[0]].range().start;
        let last = buckets[*group.buckets.last().expect("a group has buckets")]
            .range()
            .end;
        first..last
    }

    /// Whether parameter `p` has low-precision primary weights (MXFP8 or NVFP4 storage).
    pub fn is_low_precision(&self, p: usize) -> bool {
        self.buffer_of(p).storage.is_low_precision()
    }

    /// The low-precision weights of parameter `p`, if it has them.
    pub fn low_precision_weights(&self, p: usize) -> Option<LowPrecisionWeights> {
        let (b, i) = self.plan.location(p);
        self.buffers[b].storage.weights(i)
    }

    /// The MXFP8 storage of parameter `p`, if it has MXFP8 primary weights.
    pub fn mxfp8_weights(&self, p: usize) -> Option<storage::Mxfp8Weights> {
        match self.low_precision_weights(p) {
            Some(LowPrecisionWeights::Mxfp8(w)) => Some(w),
            _ => None,
        }
    }

    /// The NVFP4 storage of parameter `p` and its global amax, if it has NVFP4 primary weights.
    pub fn nvfp4_weights(&self, p: usize) -> Option<(storage::Nvfp4Weights, f32)> {
        match self.low_precision_weights(p) {
            Some(LowPrecisionWeights::Nvfp4 { weights, amax }) => Some((weights, amax)),
            _ => None,
        }
    }

    /// The main gradient of parameter `p` (its slice of the gradient buffer).
    /// [`ProtocolError::GradsSharded`] where ranks keep only gradient shards.
    pub fn grad_view(&self, p: usize) -> Result<View> {
        self.check_param(p)?;
        let (b, i) = self.plan.location(p);
        let buf = &self.buffers[b];
        if buf.shards_grads() {
            return Err(ProtocolError::GradsSharded {
                name: self.specs[p].name.clone(),
            }
            .into());
        }
        Ok(buf.grads.slice(buf.plan.param_range(i))?)
    }

    /// Every piece of a parameter this rank owns under the plan, with its gradient view and
    /// fused output, sorted by (parameter, offset).
    pub fn owned_shards(&self) -> Result<Vec<OwnedShard>> {
        let mut out = Vec::new();
        let pieces = match (&self.outer, self.replica_mode) {
            (Some(o), ReplicaMode::ShardOptimizer) => {
                self.plan.owned_hybrid(self.rank, o.rank(), o.size())?
            }
            _ => self.plan.owned(self.rank)?,
        };
        for piece in pieces {
            let buf = &self.buffers[piece.buffer];
            let grads = if buf.shards_grads() {
                // The piece lies in this rank's shard of its bucket; sharded gradients keep
                // those shards one after the other.
                let shard = buf.plan.shard(piece.bucket, self.rank)?;
                let at = buf.plan.local_shard_range(piece.bucket, self.rank)?.start
                    + (piece.buffer_range.start - shard.start);
                buf.grads.slice(at..at + piece.buffer_range.len())?
            } else {
                buf.grads.slice(piece.buffer_range.clone())?
            };
            out.push(OwnedShard {
                param: piece.param,
                param_range: piece.param_range,
                grad_view: grads,
                fused_output: buf.storage.fused_output(piece.buffer_range)?,
            });
        }
        Ok(out)
    }

    /// The owned shards of `owner`'s parameters.
    pub fn owned_shards_of(&self, owner: OptimizerId) -> Result<Vec<OwnedShard>> {
        Ok(self
            .owned_shards()?
            .into_iter()
            .filter(|s| self.specs[s.param].owner() == owner)
            .collect())
    }

    /// Writes parameter `p`'s initial values: rounded to its storage dtype into the parameter
    /// region, or as `Q(bf16(values))` into its low-precision storage (no staging: iteration 0
    /// needs no gather). Every rank writes every parameter, so all ranks start identical.
    pub fn initialize(&mut self, dev: &mut Device, p: usize, values: &[f32]) -> Result<()> {
        self.check_param(p)?;
        let spec = &self.specs[p];
        if values.len() != spec.numel {
            return Err(ConfigError::InitLength {
                name: spec.name.clone(),
                got: values.len(),
                numel: spec.numel,
            }
            .into());
        }
        let tmp = dev.alloc(DType::F32, values.len());
        let (b, i) = self.plan.location(p);
        let r = dev
            .upload(tmp, values)
            .map_err(BufferError::from)
            .and_then(|()| self.buffers[b].storage.initialize(dev, i, tmp));
        dev.free(tmp)?;
        r
    }

    /// Initializes every parameter from `init(p)`, its high-precision initial values.
    pub fn initialize_all(
        &mut self,
        dev: &mut Device,
        mut init: impl FnMut(usize) -> Vec<f32>,
    ) -> Result<()> {
        for p in 0..self.specs.len() {
            let values = init(p);
            self.initialize(dev, p, &values)?;
        }
        Ok(())
    }

    /// Launches `ops` after checking the communicator is the plan's group (bug F3 for real:
    /// a layout sharded for one group size can never be reduced over another).
    pub(crate) fn launch(
        &self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        ops: &[Op],
    ) -> Result<Work> {
        if comm.size() != self.plan.dp() || comm.rank() != self.rank {
            return Err(ProtocolError::WrongGroup {
                rank: comm.rank(),
                size: comm.size(),
                plan_rank: self.rank,
                plan_size: self.plan.dp(),
            }
            .into());
        }
        Ok(comm.start_coalesced(dev, ops)?)
    }

    /// A plan config for these buffers' settings (for estimates of other sizes).
    pub fn plan_config(&self) -> &PlanConfig {
        self.plan.config()
    }
}
