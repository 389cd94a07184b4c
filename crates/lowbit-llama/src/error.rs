//! The crate's typed errors.

/// Errors of the model, its configuration and its data.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    /// A layer or device op failed.
    #[error(transparent)]
    Nn(#[from] lowbit_nn::NnError),
    /// A device op failed.
    #[error(transparent)]
    Device(#[from] lowbit_device::DeviceError),
    /// A configuration that cannot describe a model (names the key or preset).
    #[error("{0}")]
    Config(String),
    /// Bad input to the model (token ids, batch shapes).
    #[error("{0}")]
    Input(String),
}

/// Result of this crate.
pub type Result<T, E = LlamaError> = std::result::Result<T, E>;
