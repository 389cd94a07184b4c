//! [`FsdpConfig`]: a strategy, a precision policy and the overlap, checked once and turned into
//! the buffers' configuration and the parameters' gradient dtypes.

use lowbit_buffers::{DdpConfig, NanCheck, Overlap, ReplicaMode, UnitGather, Verify};
use lowbit_comm::Communicator;
use lowbit_layout::{ParamSpec, ParamStorage, PlanConfig};
use lowbit_optim::MasterDtype;

use super::policy::{MainParamsDtype, MixedPrecisionPolicy};
use super::{FsdpError, Sharding};

/// Whether forward and backward gather only the copy they compute with (rowwise / columnwise)
/// of MXFP8 weights.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum FineGrainedGather {
    /// Both copies in one gather.
    #[cfg_attr(
        feature = "clap",
        value(name = "off", help = "Both copies in one gather")
    )]
    Off,
    /// Forward gathers rowwise, backward columnwise.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "on",
            help = "Rowwise copy for the forward, columnwise for the backward"
        )
    )]
    On,
    /// On exactly when MXFP8 primary weights, low-precision gather and activation recompute
    /// meet; [`FsdpConfig::fine_grained`] says which.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(
            name = "auto",
            help = "On where it applies (MXFP8 primary weights gathered per use, with --recompute on)"
        )
    )]
    Auto,
}

impl FineGrainedGather {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            FineGrainedGather::Off => "off",
            FineGrainedGather::On => "on",
            FineGrainedGather::Auto => "auto",
        }
    }
}

/// What the outer (replica) groups of hybrid sharding shard.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum OuterSharding {
    /// Nothing (HSDP): replicas hold the same shards; reduced shards are all-reduced across
    /// them once per step.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(name = "no_shard", help = "Replica groups hold the same state (HSDP)")
    )]
    NoShard,
    /// Optimizer state over outer × shard ranks (HFSDP): needs `optim_grads_params` inside;
    /// reduced shards are reduce-scattered across replicas and updated parameter parts
    /// all-gathered back.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "optim",
            help = "Replica groups shard the optimizer state (HFSDP)"
        )
    )]
    Optim,
}

impl OuterSharding {
    /// The Megatron-FSDP spelling (the command line's).
    pub fn name(self) -> &'static str {
        match self {
            OuterSharding::NoShard => "no_shard",
            OuterSharding::Optim => "optim",
        }
    }
}

/// One rank's two groups under hybrid sharding ([`FsdpConfig::split_groups`]).
#[derive(Debug)]
pub struct HybridGroups {
    /// The ranks of this replica group: the buffers' plan group.
    pub shard: Box<dyn Communicator>,
    /// This rank's counterparts in every replica group
    /// ([`lowbit_buffers::DataParallelBuffers::set_replica_group`]).
    pub replicas: Box<dyn Communicator>,
}

/// See the module docs.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FsdpConfig {
    /// What is sharded.
    pub sharding: Sharding,
    /// The dtypes.
    pub policy: MixedPrecisionPolicy,
    /// What overlaps the computation (gradient reductions; unit gathers and prefetch).
    pub overlap: Overlap,
    /// Elements per bucket: the size of a unit (`None`: one unit per buffer).
    pub bucket_size: Option<usize>,
    /// Non-finite gradient check at the reduction.
    pub nan_check: NanCheck,
    /// Fine-grained low-precision gathers.
    pub fine_grained: FineGrainedGather,
    /// Replica groups of hybrid sharding (1: flat sharding).
    pub outer_dp: usize,
    /// What the replica groups shard.
    pub outer_sharding: OuterSharding,
    /// Activation recompute in the model (read by the fine-grained rule).
    pub recompute: bool,
    /// Verification level of the buffers.
    pub verify: Verify,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            sharding: Sharding::default(),
            policy: MixedPrecisionPolicy::default(),
            overlap: Overlap::GradReduce,
            bucket_size: None,
            nan_check: NanCheck::Off,
            fine_grained: FineGrainedGather::Auto,
            outer_dp: 1,
            outer_sharding: OuterSharding::NoShard,
            recompute: false,
            verify: Verify::default(),
        }
    }
}

impl FsdpConfig {
    /// `sharding` with the default policy and overlapped gradient reduction.
    pub fn new(sharding: Sharding) -> Self {
        FsdpConfig {
            sharding,
            ..FsdpConfig::default()
        }
    }

    lowbit_layout::setters! {
        /// Sets the strategy.
        with_sharding => sharding: Sharding;
        /// Sets the precision policy.
        with_policy => policy: MixedPrecisionPolicy;
        /// Sets the overlap.
        with_overlap => overlap: Overlap;
        /// Sets the unit (bucket) size.
        with_bucket_size => bucket_size: Option<usize>;
        /// Sets the non-finite gradient check.
        with_nan_check => nan_check: NanCheck;
        /// Sets fine-grained gathers.
        with_fine_grained => fine_grained: FineGrainedGather;
        /// Sets the number of replica groups.
        with_outer_dp => outer_dp: usize;
        /// Sets what the replica groups shard.
        with_outer_sharding => outer_sharding: OuterSharding;
        /// Sets activation recompute.
        with_recompute => recompute: bool;
        /// Sets the verification level.
        with_verify => verify: Verify;
    }

    /// Whether `specs` has MXFP8 units: MXFP8 primary weights sharded by `optim_grads_params`,
    /// the only units that gather their copies (and so what fine-grained gathers apply to).
    fn has_mxfp8_units(&self, specs: &[ParamSpec]) -> bool {
        self.sharding == Sharding::OptimGradsParams
            && specs.iter().any(|s| {
                s.key.param_storage == ParamStorage::Quantized(lowbit_layout::QuantKind::Mxfp8)
            })
    }

    /// Whether fine-grained gathers are on for `specs`, and why (the rule: MXFP8
    /// primary weights gathered in low precision, with activation recompute). Only units of
    /// MXFP8 weights sharded by `optim_grads_params` gather copies, so only they are affected.
    pub fn fine_grained(&self, specs: &[ParamSpec]) -> (bool, &'static str) {
        let mxfp8 = self.has_mxfp8_units(specs);
        match self.fine_grained {
            FineGrainedGather::On => (true, "on (asked for)"),
            FineGrainedGather::Off => (false, "off (asked for)"),
            FineGrainedGather::Auto if mxfp8 && self.recompute => (
                true,
                "on: MXFP8 primary weights gathered in low precision by optim_grads_params, \
                 with activation recompute",
            ),
            FineGrainedGather::Auto => (
                false,
                "off: it needs MXFP8 primary weights gathered by optim_grads_params and \
                 activation recompute together",
            ),
        }
    }

    /// The buffers' unit gather: fine-grained (per use) when [`Self::fine_grained`] says on.
    fn unit_gather(&self) -> UnitGather {
        match (self.fine_grained, self.recompute) {
            (FineGrainedGather::On, _) | (FineGrainedGather::Auto, true) => UnitGather::PerUsage,
            _ => UnitGather::BothCopies,
        }
    }

    /// Refuses what cannot work (or is not built yet) for `specs`, naming the reason.
    ///
    /// # Errors
    /// [`FsdpError::Unsupported`].
    pub fn validate(&self, specs: &[ParamSpec], ranks: usize) -> Result<(), FsdpError> {
        let no = |s: String| Err(FsdpError::Unsupported(s));
        if self.policy.main_params_dtype == MainParamsDtype::None
            && let Some(s) = specs.iter().find(|s| s.key.param_storage.is_quantized())
        {
            return no(format!(
                "main_params_dtype none (the compute weights are the main parameters) needs \
                 bf16/fp32 weights; `{}` is stored in low precision (use fp32 or bf16)",
                s.name
            ));
        }
        if self.outer_dp == 0 || !ranks.is_multiple_of(self.outer_dp) {
            return no(format!(
                "outer dp {} does not divide the {ranks} ranks into replica groups",
                self.outer_dp
            ));
        }
        if self.outer_dp > 1 && self.outer_sharding == OuterSharding::Optim {
            // Megatron-FSDP's rule too: HFSDP needs full sharding inside the replica group.
            if self.sharding != Sharding::OptimGradsParams {
                return no(format!(
                    "outer sharding optim (optimizer state sharded across replica groups) needs \
                     optim_grads_params inside them, not {}",
                    self.sharding
                ));
            }
            if let Some(s) = specs.iter().find(|s| s.key.param_storage.is_quantized()) {
                return no(format!(
                    "outer sharding optim with low-precision weights (`{}`) is not built yet; \
                     use outer sharding no_shard or bf16 weights",
                    s.name
                ));
            }
        }
        if self.fine_grained == FineGrainedGather::On && !self.has_mxfp8_units(specs) {
            return no(
                "fine-grained (rowwise/columnwise) gathers apply to MXFP8 primary weights \
                 sharded by optim_grads_params; there are none here"
                    .to_string(),
            );
        }
        if self.overlap.param_gather() && self.sharding == Sharding::NoShard {
            return no("no_shard has no parameter gather to overlap".to_string());
        }
        Ok(())
    }

    /// The data-parallel group of the buffers' plan: the ranks of one replica group.
    pub fn shard_ranks(&self, world: usize) -> usize {
        world / self.outer_dp.max(1)
    }

    /// The plan's configuration for `world` ranks: one replica group's ranks, bucket shards
    /// split across the replica groups under outer sharding `optim` (HFSDP).
    pub fn plan_config(&self, world: usize) -> PlanConfig {
        let outer = match self.outer_sharding {
            OuterSharding::Optim if self.outer_dp > 1 => self.outer_dp,
            _ => 1,
        };
        self.ddp_config()
            .plan_config(self.shard_ranks(world))
            .with_outer_shards(outer)
    }

    /// What the replica groups share (for `DataParallelBuffers::set_replica_group`).
    pub fn replica_mode(&self) -> ReplicaMode {
        match self.outer_sharding {
            OuterSharding::Optim => ReplicaMode::ShardOptimizer,
            _ => ReplicaMode::Replicate,
        }
    }

    /// Hybrid sharding: splits `world` (every rank calls this) into this rank's shard group
    /// (consecutive world ranks: `rank / shard` is the replica group, `rank % shard` the rank
    /// in it) and its replica group (the ranks at the same position in every replica group).
    /// `None` with one replica group: the world is the shard group.
    ///
    /// # Errors
    /// A world size `outer_dp` does not divide ([`FsdpError::Unsupported`]); collective errors.
    pub fn split_groups(
        &self,
        world: &mut dyn Communicator,
    ) -> Result<Option<HybridGroups>, FsdpError> {
        let n = world.size();
        if self.outer_dp == 0 || !n.is_multiple_of(self.outer_dp) {
            return Err(FsdpError::Unsupported(format!(
                "outer dp {} does not divide the {n} ranks into replica groups",
                self.outer_dp
            )));
        }
        if self.outer_dp == 1 {
            return Ok(None);
        }
        let shard = n / self.outer_dp;
        let r = world.rank();
        let (replica, pos) = ((r / shard) as u32, (r % shard) as u32);
        let shard = world.split(replica, pos)?;
        let replicas = world.split(pos, replica)?;
        Ok(Some(HybridGroups { shard, replicas }))
    }

    /// Sets every parameter's gradient dtype from the policy's `main_grads_dtype`.
    pub fn apply(&self, specs: &mut [ParamSpec]) {
        for s in specs {
            s.key.grad_dtype = self.policy.main_grads_dtype.resolve(s.key.param_storage);
        }
    }

    /// Where the optimizers keep the main parameters (`OptimConfig::with_master_dtype`).
    pub fn master_dtype(&self) -> MasterDtype {
        match self.policy.main_params_dtype {
            MainParamsDtype::Fp32 => MasterDtype::F32,
            MainParamsDtype::Bf16 => MasterDtype::Bf16,
            MainParamsDtype::None => MasterDtype::Weights,
        }
    }

    /// The buffers' configuration.
    pub fn ddp_config(&self) -> DdpConfig {
        DdpConfig::default()
            .with_sharding(self.sharding.layout())
            .with_overlap(self.overlap)
            .with_bucket_size(self.bucket_size)
            .with_grad_comm_dtype(self.policy.grad_comm_dtype.grad_dtype())
            .with_nan_check(self.nan_check)
            .with_unit_gather(self.unit_gather())
            .with_verify(self.verify)
    }
}
