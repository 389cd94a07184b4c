//! Typed errors of the optimizers, keeping the lower layers' errors as sources.

use lowbit_buffers::BufferError;
use lowbit_comm::CommError;
use lowbit_device::DeviceError;
use lowbit_layout::OptimizerId;

/// Errors of the optimizers and the step driver.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum OptimError {
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A collective failed.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// A buffer operation failed (including protocol violations).
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Bad input: hyper-parameters, initial values, state to import.
    #[error("optimizer: {0}")]
    Invalid(#[from] InvalidInput),
}

impl From<lowbit_layout::LayoutError> for OptimError {
    fn from(e: lowbit_layout::LayoutError) -> Self {
        OptimError::Buffer(e.into())
    }
}

/// Result of this crate.
pub type Result<T, E = OptimError> = std::result::Result<T, E>;

/// Bad input to an optimizer, named.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InvalidInput {
    /// A learning rate that is not finite and non-negative.
    #[error("learning rate {0} must be finite and non-negative")]
    LearningRate(f32),
    /// A clip value that is not finite and positive.
    #[error("clip_grad {0} must be finite and positive")]
    ClipGrad(f32),
    /// A hyper-parameter of an update rule out of its range.
    #[error("{rule}: {what}")]
    Hyper {
        /// The rule.
        rule: &'static str,
        /// The rule broken.
        what: &'static str,
    },
    /// Initial values of the wrong length.
    #[error("parameter {param}: {got} initial values for a piece of {expected} elements")]
    InitLength {
        /// Global parameter id.
        param: usize,
        /// Values given.
        got: usize,
        /// Values expected.
        expected: usize,
    },
    /// Two optimizers of one chain own the same parameters.
    #[error("two chained optimizers own {0:?}")]
    DuplicateOwner(OptimizerId),
    /// A parameter whose owner no optimizer of the chain is.
    #[error("parameter `{name}` is owned by {owner:?}, which no optimizer updates")]
    Unowned {
        /// Parameter name.
        name: String,
        /// Its owner.
        owner: OptimizerId,
    },
    /// Imported state that does not match this optimizer's shards.
    #[error("state to import does not match: {0}")]
    StateMismatch(String),
    /// Main parameters kept in the compute weights ([`crate::MasterDtype::Weights`]) for a
    /// parameter whose weights are not persistent bf16/f16/f32 values (low-precision storage).
    #[error(
        "parameter {param}: its weights are low precision, so they cannot be the main \
         parameters (keep fp32 or bf16 masters)"
    )]
    MastersNeedPersistentWeights {
        /// Global parameter id.
        param: usize,
    },
    /// A main-parameter dtype an optimizer does not support.
    #[error("{optimizer} keeps fp32 main parameters only")]
    MasterDtype {
        /// The optimizer.
        optimizer: &'static str,
    },
    /// A parameter of a whole-matrix optimizer (Muon) that the plan splits across ranks.
    #[error(
        "parameter `{name}`: rank {rank} owns elements {range:?} of {numel}; Muon updates whole \
         matrices, so its owner needs a plan that keeps parameters whole \
         (ShardingStrategy::LayerWise)"
    )]
    PartialParameter {
        /// Parameter name.
        name: String,
        /// The rank that owns a piece of it.
        rank: usize,
        /// That piece within the flattened parameter.
        range: std::ops::Range<usize>,
        /// Elements of the parameter.
        numel: usize,
    },
    /// A parameter a matrix optimizer (Muon) cannot update.
    #[error(
        "parameter `{name}` has shape {shape:?}; Muon updates matrices [out, in] and grouped \
         expert weights [experts, out, in]"
    )]
    NotAMatrix {
        /// Parameter name.
        name: String,
        /// Its shape.
        shape: Vec<usize>,
    },
}
