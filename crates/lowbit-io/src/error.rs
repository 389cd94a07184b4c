//! The library's error type. Every variant renders as one line naming the file (and, where it
//! is about one, the tensor) it concerns, so a caller can print it as it is; paths are printed
//! with their control characters escaped ([`crate::report::shown`]), so a newline in a file
//! name cannot forge a line of output.

use std::path::PathBuf;

/// A failure of reading, writing or converting a file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading or writing a file failed.
    #[error("cannot {action} {}: {source}", crate::report::shown(.path))]
    Io {
        /// What was attempted (`read`, `write`, …).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The input is not a well-formed safetensors file.
    #[error("{}: not a valid safetensors file: {source}", crate::report::shown(.path))]
    Parse {
        /// The file.
        path: PathBuf,
        /// What the parser found.
        source: safetensors::SafeTensorError,
    },
    /// The output could not be serialized.
    #[error("{}: cannot serialize: {source}", crate::report::shown(.path))]
    Serialize {
        /// The output file.
        path: PathBuf,
        /// The serializer's error.
        source: safetensors::SafeTensorError,
    },
    /// The quantization library rejected a tensor (its message names the tensor).
    #[error("{}: {source}", crate::report::shown(.path))]
    Format {
        /// The input file.
        path: PathBuf,
        /// The library error.
        source: lowbit_formats::FormatError,
    },
    /// An input that is not a regular file (a FIFO, a device, a socket, a directory): refused
    /// before it is read, so it can neither block nor stream without end.
    #[error("cannot read {}: not a regular file ({kind})", crate::report::shown(.path))]
    NotRegularFile {
        /// The input.
        path: PathBuf,
        /// What it is instead (`a FIFO`, `a character device`, `a directory`, …).
        kind: &'static str,
    },
    /// A file, tensor or request the format refuses (a bad header, a shape that does not fit
    /// the recipe, an output path that would replace the input). The message names the file
    /// and the tensor.
    #[error("{0}")]
    Invalid(String),
}

impl Error {
    /// An I/O error with the action and path it concerns.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
