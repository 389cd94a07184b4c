//! lowbit's file formats and the small codecs every package shares.
//!
//! # Purpose
//! - [`files`]: safetensors files read and written without holding them in memory: the header
//!   is read and checked before any data, tensor bytes are read and written by position in
//!   chunks ([`files::pipeline`] runs chunked work over threads), and outputs are replaced
//!   atomically.
//! - [`schema`], [`quantize`], [`dequantize`]: the quantized-file format (each tensor's MXFP8 or
//!   NVFP4 components plus `lowbit.tensor.*` metadata recording its original dtype and shape)
//!   and whole-file conversions to and from it, bit-identical to `lowbit_formats`.
//! - [`select`]: which tensors `quantize` quantizes (glob filters and the default rule that
//!   keeps norms, biases, embeddings, the head and 1-D tensors).
//! - [`report`]: what a conversion returns to print (an aligned table of round-trip errors).
//! - [`json`]: the one JSON value type, reader and writers (manifests, `--json` output, cargo's
//!   messages); [`hash`]: FNV-1a 64; [`rng`]: SplitMix64.
//!
//! # Invariants
//! - Bounded reading: a safetensors header longer than [`files::MAX_HEADER`] bytes is refused
//!   before it is read, every tensor's offsets are checked against the file's length before
//!   any data is read, and tensor data is read in chunks, never whole (quantize and dequantize
//!   hold a bounded number of blocks, whatever a tensor's size); the JSON reader refuses
//!   nesting deeper and text longer than its [`json::Limits`] and never panics.
//! - Atomic writing: an output is written into an exclusively created temporary in its
//!   directory and renamed over the destination only when complete and synced, so the
//!   destination holds its old contents or the whole new file. An uncommitted output's
//!   temporary is removed on drop and on SIGINT, SIGTERM and SIGHUP (Linux and macOS);
//!   temporaries of killed runs are removed by the next write to that directory.
//! - Inputs are regular files: [`files::open_regular`] refuses a FIFO, device, socket or
//!   directory after a `stat` and again on the handle (opened `O_NONBLOCK`), so no input can
//!   block the open or stream without end.
//! - Errors are typed ([`Error`], [`json::ParseError`]) and name the file, and the tensor
//!   where one is concerned; paths print with control characters escaped
//!   ([`report::shown`]).
//! - [`hash::fnv1a64`] and [`rng::SplitMix64`] never change their bits: checkpoint manifests
//!   store the hash and tests pin the generator's streams.
//!
//! # Non-goals
//! Devices, ranks and communication (this crate knows nothing of them: checkpoints of
//! distributed state are `lowbit-ckpt`'s); a general JSON library (no serde, no streaming);
//! safetensors features beyond what the project writes (no big-endian hosts, no memory maps).
//!
//! # Features
//! `files` (default) brings the safetensors and quantized-file modules; without it only
//! [`json`], [`hash`] and [`rng`] are built (no dependency but `thiserror`). `clap` derives
//! `clap::ValueEnum` for [`schema::Recipe`] and [`dequantize::OutDtype`].

pub mod hash;
pub mod json;
pub mod rng;

#[cfg(feature = "files")]
pub mod dequantize;
#[cfg(feature = "files")]
mod error;
#[cfg(feature = "files")]
pub mod files;
#[cfg(feature = "files")]
pub mod quantize;
#[cfg(feature = "files")]
pub mod report;
#[cfg(feature = "files")]
pub mod schema;
#[cfg(feature = "files")]
pub mod select;
#[cfg(feature = "files")]
pub(crate) mod wide;

#[cfg(feature = "files")]
pub use error::Error;
pub use hash::fnv1a64;
pub use json::Json;
pub use rng::SplitMix64;
