//! The command line's error type: the I/O library's errors as they are, plus the command
//! line's own messages. Every variant renders as one line naming the file or tensor it is
//! about; `main` prints it after `error: ` and exits with status 1.

use std::path::PathBuf;

/// A failure of a subcommand.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Reading, writing or converting a file failed (the message names the file).
    #[error(transparent)]
    Io(#[from] lowbit_io::Error),
    /// Any other problem; the message carries its own context.
    #[error("{0}")]
    Msg(String),
    /// `lowbit train` stopped early on a signal: not an error of the input, so `main` prints
    /// the message as it is and exits with `status` (128 + the signal's number).
    #[error("{message}")]
    Stopped {
        /// What stopped and what was saved.
        message: String,
        /// The exit status.
        status: u8,
    },
}

impl CliError {
    /// An I/O error with the action and path it concerns.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CliError::Io(lowbit_io::Error::io(action, path, source))
    }
}
