//! The command line's error type. Every variant renders as one line naming the file or tensor
//! it is about; `main` prints it after `error: ` and exits with status 1.

use std::path::PathBuf;

/// A failure of a subcommand.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Reading or writing a file failed.
    #[error("cannot {action} {}: {source}", .path.display())]
    Io {
        /// What was attempted (`read`, `write`, …).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The input is not a well-formed safetensors file.
    #[error("{}: not a valid safetensors file: {source}", .path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        source: safetensors::SafeTensorError,
    },
    /// The output could not be serialized.
    #[error("{}: cannot serialize: {source}", .path.display())]
    Serialize {
        /// The output file.
        path: PathBuf,
        /// The serializer's error.
        source: safetensors::SafeTensorError,
    },
    /// The quantization library rejected a tensor (its message names the tensor).
    #[error("{}: {source}", .path.display())]
    Format {
        /// The input file.
        path: PathBuf,
        /// The library error.
        source: lowbit_formats::FormatError,
    },
    /// Any other problem; the message carries its own context.
    #[error("{0}")]
    Msg(String),
}

impl CliError {
    /// An I/O error with the action and path it concerns.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        CliError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
