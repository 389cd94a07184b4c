//! The Hugging Face directory of a decoder: what `transformers`'
//! `AutoModelForCausalLM.from_pretrained(DIR)` and `AutoTokenizer.from_pretrained(DIR)` load
//! offline, written from fp32 values and read back into them.
//!
//! # Purpose
//! - [`config`]: `config.json` (`LlamaForCausalLM`, every field of HF's `LlamaConfig` that
//!   changes the computation) and `generation_config.json` from a [`LlamaConfig`] and a
//!   [`Tokenizer`]; `config.json` read back into a [`LlamaConfig`] ([`read_config`]).
//! - [`tokenizer`]: the tokenizer files of lowbit's two tokenizers: GPT-2 (`vocab.json`,
//!   `merges.txt` reconstructed from tiktoken's ranks, `tokenizer.json`, `tokenizer_config.json`,
//!   `special_tokens_map.json`) and bytes (a byte-level vocabulary whose id `b` is byte `b`).
//! - [`weights`]: safetensors under HF Llama names ([`crate::params`]), f32 or bf16 (round to
//!   nearest even), one `model.safetensors` or, above a shard size, `model-0000K-of-0000N`
//!   files with `model.safetensors.index.json`; read back (sharded or not, f32/bf16/f16) with
//!   every tensor checked.
//! - [`export`]: all of it into one directory.
//!
//! # Invariants
//! - Writing is deterministic: the same values, shape, tokenizer and options give the same
//!   bytes in every file (no paths, times or versions are written), so export → import → export
//!   is byte-identical.
//! - The q and k projections are stored as the model holds them: lowbit's RoPE is HF's
//!   rotate-half convention, so no permutation is applied in either direction.
//! - Reading trusts nothing: every file is opened with [`lowbit_io::files::open_regular`]
//!   (FIFOs, devices and directories refused), JSON files are bounded ([`MAX_JSON_BYTES`]),
//!   unknown architectures, missing keys, absurd sizes, unknown, missing or duplicated tensors,
//!   wrong shapes and dtypes are [`HfError`]s naming the file and the key or tensor.
//!
//! # Non-goals
//! Other architectures (biases, other RoPE types than llama3, MoE), quantized HF formats,
//! SentencePiece or Llama 3's tiktoken tokenizers, downloading from the Hub.

use std::path::{Path, PathBuf};

pub mod config;
pub mod tokenizer;
pub mod weights;

pub use config::{HfConfig, read_config};
pub use weights::{ExportOptions, WeightDtype, read_weights};

use crate::LlamaConfig;
use crate::data::Tokenizer;

/// `config.json`.
pub const CONFIG_FILE: &str = "config.json";
/// `generation_config.json`.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The one weight file below the shard size.
pub const WEIGHTS_FILE: &str = "model.safetensors";
/// The index of sharded weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The largest JSON file read (config, index; a 50k-entry index is about 4 MB).
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// transformers' default `max_shard_size` ("5GB", decimal).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Errors of writing or reading a Hugging Face directory; each names the file (and the key or
/// tensor) it is about.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum HfError {
    /// Reading or writing a safetensors file or an atomic output failed (names the file).
    #[error(transparent)]
    Io(#[from] lowbit_io::Error),
    /// A directory or file operation failed.
    #[error("cannot {action} {}: {source}", lowbit_io::report::shown(.path))]
    Fs {
        /// What was attempted.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A JSON file that is not JSON.
    #[error("{}: not JSON: {source}", lowbit_io::report::shown(.path))]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: lowbit_io::json::ParseError,
    },
    /// A file whose content is refused (a missing or wrong key, an unknown architecture, a
    /// tensor missing, extra, duplicated or of the wrong shape or dtype).
    #[error("{}: {what}", lowbit_io::report::shown(.path))]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong, naming the key or tensor.
        what: String,
    },
    /// Values that do not match the shape being written (a caller's error).
    #[error("{0}")]
    Values(String),
}

impl HfError {
    pub(crate) fn invalid(path: &Path, what: impl Into<String>) -> HfError {
        HfError::Invalid {
            path: path.to_owned(),
            what: what.into(),
        }
    }

    pub(crate) fn fs(action: &'static str, path: &Path, source: std::io::Error) -> HfError {
        HfError::Fs {
            action,
            path: path.to_owned(),
            source,
        }
    }
}

/// Result of this module.
pub type Result<T, E = HfError> = std::result::Result<T, E>;

/// What [`export`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportSummary {
    /// Every file written, by name, in the order written.
    pub files: Vec<String>,
    /// The weight files among them (one, or the shards).
    pub weight_files: usize,
    /// Bytes of tensor data over all weight files (the index's `total_size`).
    pub tensor_bytes: u64,
}

/// Writes the whole directory into the existing directory `dir`: `config.json`,
/// `generation_config.json`, the tokenizer files of `tok` and the weights `values` (one per
/// parameter of `cfg`, in [`crate::params::params`]' order, fp32). Files are written through
/// temporaries and renames; a caller wanting the directory to appear at once writes into a
/// temporary directory and renames it.
///
/// # Errors
/// [`HfError::Values`] for values that do not fit `cfg`; I/O errors naming the file.
pub fn export(
    dir: &Path,
    cfg: &LlamaConfig,
    tok: Tokenizer,
    values: &[Vec<f32>],
    opts: &ExportOptions,
) -> Result<ExportSummary> {
    let mut files = config::write(dir, cfg, tok, opts.dtype)?;
    files.extend(tokenizer::write(dir, tok, cfg.max_seq)?);
    let w = weights::write(dir, cfg, values, opts)?;
    let weight_files = w.files.len() - usize::from(w.files.len() > 1);
    files.extend(w.files);
    Ok(ExportSummary {
        files,
        weight_files,
        tensor_bytes: w.tensor_bytes,
    })
}

/// Reads at most [`MAX_JSON_BYTES`] of the regular file `path` as JSON.
pub(crate) fn read_json(path: &Path) -> Result<lowbit_io::Json> {
    use std::io::Read;
    let (file, meta) = lowbit_io::files::open_regular(path)?;
    if meta.len() > MAX_JSON_BYTES {
        return Err(HfError::invalid(
            path,
            format!(
                "{} bytes, over the limit of {MAX_JSON_BYTES} for a JSON file",
                meta.len()
            ),
        ));
    }
    let mut text = String::new();
    file.take(MAX_JSON_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| HfError::fs("read", path, e))?;
    if text.len() as u64 > MAX_JSON_BYTES {
        return Err(HfError::invalid(
            path,
            "grew past the JSON size limit while read",
        ));
    }
    lowbit_io::Json::parse_with(
        &text,
        lowbit_io::json::Limits {
            max_depth: 64,
            max_len: MAX_JSON_BYTES as usize,
        },
    )
    .map_err(|source| HfError::Json {
        path: path.to_owned(),
        source,
    })
}

/// Writes `json` as diffable text to `dir/name` atomically; returns the name.
pub(crate) fn write_json(dir: &Path, name: &str, json: &lowbit_io::Json) -> Result<String> {
    lowbit_io::files::write_atomic(&dir.join(name), json.to_text().as_bytes())?;
    Ok(name.to_string())
}
