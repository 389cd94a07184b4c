//! Typed errors of the FSDP configuration.

/// A configuration FSDP refuses, with the reason.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum FsdpError {
    /// A name that is not one of the choices.
    #[error("unknown {what} `{got}` (choose one of {choices})")]
    Unknown {
        /// What was parsed.
        what: &'static str,
        /// The text given.
        got: String,
        /// The valid spellings.
        choices: &'static str,
    },
    /// A combination that cannot work, or that is not built yet, with the reason.
    #[error("{0}")]
    Unsupported(String),
    /// A combination of strategy, storage and owners that cannot work ([`super::Conflict`]).
    #[error(transparent)]
    Conflict(#[from] super::Conflict),
    /// Splitting the world into shard and replica groups failed.
    #[error(transparent)]
    Comm(#[from] lowbit_comm::CommError),
    /// The buffers refused the configuration.
    #[error(transparent)]
    Buffers(#[from] lowbit_buffers::BufferError),
}
