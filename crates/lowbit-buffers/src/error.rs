//! Typed errors of the buffers: configuration, protocol order, and the lower layers' errors
//! kept as sources.

use lowbit_comm::CommError;
use lowbit_device::DeviceError;
use lowbit_layout::LayoutError;

use crate::WeightState;

/// Errors of the stateful buffers.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum BufferError {
    /// An invalid layout, plan or shard request.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A configuration that cannot work.
    #[error("invalid data-parallel configuration: {0}")]
    Config(#[from] ConfigError),
    /// A call out of the order the training-step protocol requires.
    #[error("protocol violation: {0}")]
    Protocol(#[from] ProtocolError),
}

impl BufferError {
    /// The protocol violation, if this is one.
    pub fn protocol(&self) -> Option<&ProtocolError> {
        match self {
            BufferError::Protocol(p) => Some(p),
            _ => None,
        }
    }
}

/// Result of this crate.
pub type Result<T, E = BufferError> = std::result::Result<T, E>;

/// A configuration that cannot work, named with the rule it breaks.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// Overlapped parameter gather with a replicated strategy (nothing to gather).
    #[error("overlapped param gather requires a sharded strategy (the distributed optimizer)")]
    ParamGatherOverlapNeedsSharding,
    /// Overlapped parameter gather without overlapped gradient reduction.
    #[error("overlapped param gather requires overlapped grad reduce")]
    ParamGatherOverlapNeedsGradOverlap,
    /// `bucket_size` is `Some(0)`.
    #[error("bucket size must be positive")]
    ZeroBucketSize,
    /// This rank is not in the group.
    #[error("rank {rank} of {dp} ranks")]
    RankOutOfRange {
        /// The rank.
        rank: usize,
        /// The group size.
        dp: usize,
    },
    /// A parameter id that does not exist.
    #[error("parameter {param} does not exist ({params} parameters)")]
    NoSuchParam {
        /// The id asked for.
        param: usize,
        /// Number of parameters.
        params: usize,
    },
    /// Initial values of the wrong length.
    #[error("parameter `{name}`: {got} initial values for {numel} elements")]
    InitLength {
        /// Parameter name.
        name: String,
        /// Values given.
        got: usize,
        /// Elements of the parameter.
        numel: usize,
    },
    /// A precision policy that does not fit the parameters.
    #[error("precision policy: {0}")]
    Policy(String),
}

/// A call out of the order the training-step protocol requires. Each variant is one of the
/// orders Megatron-LM's staging and gather bugs took; see ARCHITECTURE.md's catalogue.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// A forward, a parameter sync or a gather of low-precision weights the optimizer moved and
    /// nothing staged since (bug class C; a gather would ship zeros or old values: A1/A3).
    #[error(
        "bucket group {group}: stale low-precision weights (the optimizer stepped and nothing was \
         staged)"
    )]
    StaleWeights {
        /// The bucket group.
        group: usize,
    },
    /// An operation that needs no gather in flight found one (bug F4).
    #[error("bucket group {group}: {operation} while its parameter gather is in flight")]
    GatherInFlight {
        /// The bucket group.
        group: usize,
        /// What was attempted.
        operation: &'static str,
    },
    /// A pipelined step's staging of one bucket group that the pipeline does not allow
    /// (`StepProtocol::stage_and_gather_group`).
    #[error("bucket group {group}: pipelined staging refused: {what}")]
    Pipeline {
        /// The bucket group.
        group: usize,
        /// Why.
        what: &'static str,
    },
    /// Zeroing the gradients while a collective is in flight.
    #[error("zeroing the gradients while a collective is in flight")]
    CollectiveInFlight,
    /// A bucket group gathered twice in one iteration (bug D).
    #[error("bucket group {group} gathered twice in one iteration")]
    GatheredTwice {
        /// The bucket group.
        group: usize,
    },
    /// A backward starts while a low-precision group is not current (bug A2: staged but never
    /// gathered, its staging bytes would be summed into the gradients).
    #[error("bucket group {group}: backward starts while its weights are {state:?}")]
    BackwardBeforeGather {
        /// The bucket group.
        group: usize,
        /// Its weight state.
        state: WeightState,
    },
    /// A backward starts on a gradient buffer that is not zero ([`crate::Verify::Full`]).
    #[error("backward starts on a gradient buffer that is not zero")]
    GradsNotZero,
    /// A staging view is not zero after its copy-back ([`crate::Verify::Full`]).
    #[error("bucket group {group}: staging view not zero after copy-back")]
    StagingNotZero {
        /// The bucket group.
        group: usize,
    },
    /// Gradient reduction never started for a group (not every parameter reported ready).
    #[error(
        "bucket group {group}: communication was never started (not every parameter reported its \
         gradient ready)"
    )]
    GradReduceNotStarted {
        /// The bucket group.
        group: usize,
    },
    /// An iteration's gradient sync without a microbatch marked last.
    #[error("gradient sync of an iteration in which no microbatch was marked last")]
    NoLastMicrobatch,
    /// `register_grad_ready` without overlapped gradient reduction.
    #[error("register_grad_ready is only used with overlapped grad reduce")]
    GradReadyWithoutOverlap,
    /// A parameter of a sharded-parameter unit read while the unit is not gathered.
    #[error(
        "`{name}`: its unit (bucket group {group}) is not gathered; fetch it through the hooks"
    )]
    NotGathered {
        /// The parameter.
        name: String,
        /// Its bucket group.
        group: usize,
    },
    /// The main gradient of a whole parameter asked for where ranks keep only their shards.
    #[error(
        "`{name}`: gradients are sharded (optim_grads); only owned shards have a main gradient"
    )]
    GradsSharded {
        /// The parameter.
        name: String,
    },
    /// Non-finite gradients found before their reduction ([`crate::NanCheck`]).
    #[error("rank {rank}: non-finite (NaN or Inf) gradient in {}", names.join(", "))]
    NonFiniteGrad {
        /// The rank that found them.
        rank: usize,
        /// The parameters (the first, or all of its bucket group).
        names: Vec<String>,
    },
    /// The communicator is not the group the plan was made for (bug F3).
    #[error("communicator is rank {rank} of {size}, the plan is rank {plan_rank} of {plan_size}")]
    WrongGroup {
        /// The communicator's rank.
        rank: usize,
        /// The communicator's size.
        size: usize,
        /// The plan's rank.
        plan_rank: usize,
        /// The plan's group size.
        plan_size: usize,
    },
}
