//! Typed errors: every refusal names the file (and the tensor where there is one).

use std::path::PathBuf;

/// What can go wrong saving or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CkptError {
    /// A file-system operation failed.
    #[error("{op} `{}`: {source}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// No checkpoint at the path: neither a `manifest.json` nor a `latest` pointer.
    #[error("no checkpoint at `{}` (no manifest.json and no `latest` pointer)", .0.display())]
    NotACheckpoint(PathBuf),
    /// The manifest (or a rank index) is not valid JSON of the expected shape, or breaks a rule
    /// of the format (sizes, offsets, coverage, file names).
    #[error("invalid manifest `{}`: {msg}", file.display())]
    Manifest {
        /// The file.
        file: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// The manifest's format version is not one this build reads.
    #[error("`{}` has format version {found}; this build reads version {supported}", file.display())]
    Version {
        /// The manifest.
        file: PathBuf,
        /// The version found.
        found: u64,
        /// The version supported.
        supported: u64,
    },
    /// A data file the manifest lists is not a regular file (a directory, a FIFO, a device).
    #[error("`{}` is not a regular file ({kind}); the manifest lists it as a rank's data", file.display())]
    NotAFile {
        /// The path.
        file: PathBuf,
        /// What it is instead.
        kind: &'static str,
    },
    /// A data file is shorter or longer than the manifest says (a torn or truncated write).
    #[error("`{}` is {actual} bytes, the manifest says {expected}", file.display())]
    FileSize {
        /// The file.
        file: PathBuf,
        /// Bytes the manifest records.
        expected: u64,
        /// Bytes on disk.
        actual: u64,
    },
    /// A piece's bytes do not hash to the manifest's value.
    #[error("`{}`: piece [{start}, {end}) of `{tensor}` fails its hash (corrupted)", file.display())]
    Hash {
        /// The file.
        file: PathBuf,
        /// The logical tensor.
        tensor: String,
        /// First element of the piece.
        start: u64,
        /// End of the piece.
        end: u64,
    },
    /// The checkpoint does not match the model or optimizer loading it.
    #[error("checkpoint `{}` does not match: {msg}", dir.display())]
    Mismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The first mismatch.
        msg: String,
    },
    /// A data file is not a safetensors file other tools can read, or its header disagrees
    /// with the manifest (an entry the manifest does not list, a piece without its entry, a
    /// dtype, shape or offset that differs).
    #[error("`{}`: safetensors header: {msg}", file.display())]
    Header {
        /// The data file.
        file: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A `step-N` directory holds the manifest of another step.
    #[error("`{}` is named step-{named} but its manifest is of step {step}", dir.display())]
    StepName {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The step of its name.
        named: u64,
        /// The step of its manifest.
        step: u64,
    },
    /// `step-N` exists already; a committed checkpoint is never overwritten.
    #[error("checkpoint `{}` exists already", .0.display())]
    Exists(PathBuf),
    /// Another process holds the directory's lock ([`crate::DirLock`]): two runs saving into
    /// one directory would collide.
    #[error(
        "`{}` is locked by another run{} (`{}`)",
        dir.display(),
        holder.map_or(String::new(), |p| format!(" (pid {p})")),
        dir.join(crate::lock::LOCK_FILE).display()
    )]
    Locked {
        /// The directory.
        dir: PathBuf,
        /// The pid the holder wrote into the lock file, if it could be read.
        holder: Option<u32>,
    },
    /// A safetensors serialization error.
    #[error("safetensors: {0}")]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// An optimizer error (export or import).
    #[error(transparent)]
    Optim(#[from] lowbit_optim::OptimError),
    /// A device error (a streaming save's download, a streaming load's upload).
    #[error(transparent)]
    Device(#[from] lowbit_device::DeviceError),
    /// A collective (barrier) failed.
    #[error(transparent)]
    Comm(#[from] lowbit_comm::CommError),
}

/// Result of this crate.
pub type Result<T, E = CkptError> = std::result::Result<T, E>;

pub(crate) fn io(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> CkptError {
    let path = path.into();
    move |source| CkptError::Io { op, path, source }
}
