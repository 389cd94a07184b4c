//! The configuration of the data-parallel buffers: how gradients and parameters are
//! synchronised. Every choice is an enum, so combinations that cannot work (a parameter gather
//! overlapped with the forward while the gradient reduction is not) are not expressible, and the
//! one rule left (overlapped gathers need a sharded strategy) is checked in one place,
//! [`DdpConfig::validate`]. The translation into the layout layer's [`PlanConfig`] is written
//! once, [`DdpConfig::plan_config`].

use lowbit_layout::{GradDType, PlanConfig, ShardingStrategy};

use crate::error::{ConfigError, Result};

/// What overlaps the computation.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Overlap {
    /// Gradients are reduced after the backward, parameters gathered right after the step.
    #[default]
    None,
    /// Each bucket group's gradient reduction starts as soon as its gradients are ready.
    GradReduce,
    /// As [`Self::GradReduce`], and parameters are gathered lazily in the next forward, bucket
    /// group by bucket group, the next group prefetched.
    GradReduceAndParamGather,
}

impl Overlap {
    /// Whether gradient reduction overlaps the backward.
    pub fn grad_reduce(self) -> bool {
        !matches!(self, Overlap::None)
    }

    /// Whether the parameter gather overlaps the forward.
    pub fn param_gather(self) -> bool {
        matches!(self, Overlap::GradReduceAndParamGather)
    }

    /// The overlap of the two booleans Megatron-LM's `DistributedDataParallelConfig` uses.
    ///
    /// # Errors
    /// [`ConfigError::ParamGatherOverlapNeedsGradOverlap`] for `(false, true)`.
    pub fn from_flags(grad_reduce: bool, param_gather: bool) -> Result<Self> {
        match (grad_reduce, param_gather) {
            (false, false) => Ok(Overlap::None),
            (true, false) => Ok(Overlap::GradReduce),
            (true, true) => Ok(Overlap::GradReduceAndParamGather),
            (false, true) => Err(ConfigError::ParamGatherOverlapNeedsGradOverlap.into()),
        }
    }
}

/// Where the `1/dp` of the gradient mean is applied.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GradScaling {
    /// Scale each bucket by `1/dp` before a `Sum` reduction (Megatron's default).
    #[default]
    PreDivide,
    /// Reduce with `Avg` (`average_in_collective`).
    AverageInCollective,
}

/// How MXFP8 primary weights travel in the parameter gather.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Mxfp8Gather {
    /// `bf16(master)` is staged in a view aliasing the gradient buffer, gathered, and every
    /// rank re-quantizes (1x32 blocks, both copies).
    #[default]
    Bf16Staging,
    /// Fp8 bytes with 2D (32x32) scaling, quantized shard by shard after a MAX-reduction of the
    /// tile amaxes and gathered as bytes: both copies are the same bytes, so half the traffic.
    /// The weights then follow TE's 2D weight recipe.
    Direct2d,
}

/// Where the backward accumulates each parameter's gradient (Megatron-LM PR #5464's test axis).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum GradAccumulation {
    /// Straight into the parameter's slice of the gradient buffer (`gradient_accumulation_fusion`).
    #[default]
    Fused,
    /// Into a per-parameter f32 gradient first, added into the buffer when the parameter is
    /// reported ready. The same bits as fused: the buffer's element gets one rounding of
    /// `old + g` either way.
    Unfused,
}

/// Whether gradients are checked for NaN and ±Inf before they are reduced (Megatron's
/// `check_for_nan_in_grad` and `report_nan_in_param_grad`). The check reads every gradient once
/// more, so it costs one reduction pass over the gradients per reduction.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum NanCheck {
    /// No check: non-finite gradients reach the norm, which skips the step.
    #[default]
    #[cfg_attr(feature = "clap", value(name = "off", help = "No check"))]
    Off,
    /// One pass per bucket group before its reduction; a non-finite group is searched for the
    /// first non-finite parameter, and the error names it and the rank.
    #[cfg_attr(
        feature = "clap",
        value(name = "grad", help = "Name the first non-finite parameter")
    )]
    FirstParam,
    /// As [`Self::FirstParam`], but the error lists every non-finite parameter of the group.
    #[cfg_attr(
        feature = "clap",
        value(name = "param", help = "Name every non-finite parameter")
    )]
    EveryParam,
}

impl NanCheck {
    /// The command line's spelling: `off`, `grad` (the first non-finite parameter, Megatron's
    /// `check_for_nan_in_grad`), `param` (every one, `report_nan_in_param_grad`).
    pub fn name(self) -> &'static str {
        match self {
            NanCheck::Off => "off",
            NanCheck::FirstParam => "grad",
            NanCheck::EveryParam => "param",
        }
    }
}

/// What a unit of low-precision parameters sharded by `optim_grads_params` gathers.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum UnitGather {
    /// Both MXFP8 copies at once (more memory, fewer collectives).
    #[default]
    BothCopies,
    /// Fine-grained (Megatron-LM PR #4181): the rowwise copy for a forward, the columnwise copy for a
    /// backward.
    PerUsage,
}

/// How much the buffers verify at protocol boundaries.
///
/// The cheap checks (weight states, gathers in flight, a group gathered twice, the communicator
/// against the plan) run in every build. [`Verify::Full`] adds checks that read device memory:
/// the gradient buffers are zero when a backward starts and a staging view is zero after its
/// copy-back.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verify {
    /// The cheap checks only.
    Cheap,
    /// The cheap checks and the memory-reading ones.
    Full,
}

impl Default for Verify {
    /// [`Verify::Full`] in debug builds, [`Verify::Cheap`] otherwise; tests set it explicitly.
    fn default() -> Self {
        if cfg!(debug_assertions) {
            Verify::Full
        } else {
            Verify::Cheap
        }
    }
}

/// How gradients and parameters are synchronised across data-parallel ranks.
///
/// Build it with [`DdpConfig::default`] and the `with_*` methods; the struct is non-exhaustive
/// so that new knobs do not break callers.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DdpConfig {
    /// The default sharding strategy of every owner (per-owner strategies go into a
    /// [`PlanConfig`] passed to [`crate::DataParallelBuffers::with_plan`]).
    pub sharding: ShardingStrategy,
    /// What overlaps the computation.
    pub overlap: Overlap,
    /// Where the `1/dp` is applied.
    pub scaling: GradScaling,
    /// Elements per bucket; `None`: one bucket per buffer. Only read with overlapped gradient
    /// reduction (without it there is one bucket, as in Megatron-LM).
    pub bucket_size: Option<usize>,
    /// Pad sharded bucket ends to `lcm(dp, 128, 2^16)` instead of `lcm(dp, 128)`.
    pub high_busbw_padding: bool,
    /// How MXFP8 primary weights are gathered.
    pub mxfp8_gather: Mxfp8Gather,
    /// Where gradients accumulate.
    pub grad_accumulation: GradAccumulation,
    /// How much is verified at protocol boundaries.
    pub verify: Verify,
    /// The dtype gradients are reduced in (`grad_comm_dtype`); `None`: the gradient buffer's
    /// own dtype (`main_grads_dtype`). When it differs, a bucket of this dtype is allocated per
    /// bucket group for its collective and freed after it; the reduction sums in f32 and
    /// rounds once to this dtype; the result is written back (sharded gradients: added) in the
    /// main-gradient dtype.
    pub grad_comm_dtype: Option<GradDType>,
    /// Whether gradients are checked for non-finite values before their reduction.
    pub nan_check: NanCheck,
    /// What units of sharded low-precision parameters gather.
    pub unit_gather: UnitGather,
}

impl DdpConfig {
    lowbit_layout::setters! {
        /// Sets the sharding strategy.
        with_sharding => sharding: ShardingStrategy;
        /// Sets the overlap.
        with_overlap => overlap: Overlap;
        /// Sets the gradient scaling.
        with_scaling => scaling: GradScaling;
        /// Sets the bucket size.
        with_bucket_size => bucket_size: Option<usize>;
        /// Sets high-bus-bandwidth padding.
        with_high_busbw_padding => high_busbw_padding: bool;
        /// Sets how MXFP8 weights are gathered.
        with_mxfp8_gather => mxfp8_gather: Mxfp8Gather;
        /// Sets where gradients accumulate.
        with_grad_accumulation => grad_accumulation: GradAccumulation;
        /// Sets the verification level.
        with_verify => verify: Verify;
        /// Sets the dtype gradients are reduced in.
        with_grad_comm_dtype => grad_comm_dtype: Option<GradDType>;
        /// Sets the non-finite gradient check.
        with_nan_check => nan_check: NanCheck;
        /// Sets what units of sharded low-precision parameters gather.
        with_unit_gather => unit_gather: UnitGather;
    }

    /// The rules of Megatron-LM's configuration that the types do not already enforce.
    ///
    /// # Errors
    /// [`ConfigError::ParamGatherOverlapNeedsSharding`], [`ConfigError::ZeroBucketSize`].
    pub fn validate(&self) -> Result<()> {
        if self.overlap.param_gather() && !self.sharding.is_sharded() {
            return Err(ConfigError::ParamGatherOverlapNeedsSharding.into());
        }
        if self.bucket_size == Some(0) {
            return Err(ConfigError::ZeroBucketSize.into());
        }
        Ok(())
    }

    /// The layout layer's configuration for `dp` ranks: the one place the buffer settings turn
    /// into plan settings (bucket size only with overlapped reduction).
    pub fn plan_config(&self, dp: usize) -> PlanConfig {
        PlanConfig::new(dp, self.sharding)
            .with_bucket_size(if self.overlap.grad_reduce() {
                self.bucket_size
            } else {
                None
            })
            .with_high_busbw_padding(self.high_busbw_padding)
    }
}
