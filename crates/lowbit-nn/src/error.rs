//! Typed errors of the layers: the lower layers' errors kept whole, and input the layers refuse.

use lowbit_buffers::BufferError;
use lowbit_device::DeviceError;

/// Errors of the layers and of the models built from them.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum NnError {
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A hook failed (buffers, collectives, protocol violations), with its typed source.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// A view or parameter whose length does not match the layer's shape.
    #[error("{what}: {got} elements where the layer's shape needs {want}")]
    Shape {
        /// Which view or parameter.
        what: &'static str,
        /// Elements it has.
        got: usize,
        /// Elements the layer's shape needs.
        want: usize,
    },
    /// Bad input to a model (token ids, batch shapes).
    #[error("{0}")]
    Input(String),
}

/// Result of this crate.
pub type Result<T, E = NnError> = std::result::Result<T, E>;

/// `Ok` when `got == want`, else [`NnError::Shape`].
pub(crate) fn check_len(what: &'static str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(NnError::Shape { what, got, want })
    }
}
