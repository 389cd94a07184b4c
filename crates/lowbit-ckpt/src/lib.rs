//! Sharded checkpoints of fp32 masters and optimizer state.
//!
//! # Format (version 1)
//!
//! A checkpoint root holds committed `step-N` directories and a `latest` file naming the newest
//! one (`step-N\n`). A `step-N` directory holds:
//!
//! - `rank-RRRRR.safetensors`, one per saving rank: that rank's owned pieces, F32, 1-D, keyed
//!   `{parameter}/{state}@{start}` (`state` is `master` or the rule's state name, `start` the
//!   first element of the piece in the flattened parameter). Low-precision weights are not
//!   stored: they are rebuilt as `Q(bf16(master))` by a forced parameter sync after loading.
//! - `manifest.json`: `format` (`"lowbit-ckpt"`), `version` (1), `step`, `config`, `data`,
//!   `rng` (free-form string maps: training configuration, data position, RNG state), `hash`
//!   (`"fnv1a64"`), `optimizers` (`owner`, `rule`, `steps` per leaf optimizer), `files`
//!   (`name`, `bytes`), and `tensors`: per logical tensor its `name` (`{param}/{state}`),
//!   `param`, `state`, `owner`, global `shape`, `dtype` (`F32`) and `pieces` (`file`, `key`,
//!   `start`/`end` element offsets in the flattened global tensor, `offset` of the data in the
//!   file in bytes, and `fnv1a64`: FNV-1a 64 of the piece's little-endian bytes as 16 hex
//!   digits). Integers are JSON integers; the pieces of a tensor tile `[0, numel)` exactly once.
//!   `scalars_fnv1a64` (16 hex digits) is FNV-1a 64 of the canonical serialization (this
//!   crate's [`json::Json::to_text`] of the parsed values: keys sorted, fixed layout) of the
//!   manifest object without `tensors` and without itself: it puts `step`, `config`, `data`,
//!   `rng`, `optimizers` (an optimizer's step count) and `files` under a hash, checked at open
//!   after the format's rules. `tensors` is left out because every member of it is checked
//!   otherwise: a piece's bytes by its own hash when read, its place by the validation (ranges,
//!   offsets within the listed file sizes, exact tiling), names and shapes against the loading
//!   model; so tools may still rewrite tensor entries, and the hash stays cheap for many pieces.
//!
//! # Commit
//!
//! [`save`] writes into `.tmp-step-N`, fsyncs every file and the directory, renames it to
//! `step-N`, fsyncs the root, then replaces `latest` by writing `.latest.tmp`, fsyncing and
//! renaming it. A crash before the directory rename leaves only a `.tmp-…` directory that no
//! loader opens; a crash before the `latest` rename leaves `latest` naming the previous
//! checkpoint. A save that fails (a rank's write, the commit) removes its `.tmp-step-N` on rank
//! 0 after the last barrier, so a full disk is not kept full by it. Committed checkpoints are
//! never overwritten or modified; pruning renames a
//! directory out of the `step-*` namespace before removing it.
//!
//! [`save`] streams the state from the optimizer's device views ([`lowbit_optim::Optimizer::
//! state_views`]): chunks are downloaded into a few reused buffers while worker threads hash
//! them and write them at their offsets, so the save runs at the disk's speed and never holds
//! the whole state in host memory (an optimizer without views is snapshotted first). Per rank
//! it holds at most `2·workers + 2` buffers (at most 18), never more than it has chunks, none
//! larger than its chunk (8 MiB, or the piece when smaller): a small state takes a few KiB
//! however many thread ranks save at once. A load streams through the same kind of pool.
//!
//! [`AsyncSaver`] is the same save with the files written by a background thread: the training
//! step pays for the snapshot (a host copy of the state) only, and the commit happens at the
//! next save or wait, which every rank calls (no collective runs off the training thread).
//!
//! # Load
//!
//! [`Checkpoint::open`] validates the manifest (hostile input is a typed error, never a panic)
//! and data file sizes; the manifest is parsed streaming ([`Manifest::parse`]: the tensor list
//! entry by entry, never one JSON tree), so it takes its text and the manifest built from it,
//! about 1.6 times the text, and at most 256 MiB of text is read; [`Checkpoint::load_optimizer`] fills a freshly built optimizer's own
//! export template from the overlapping pieces (resharding to any dp and to either sharded
//! strategy), checking every piece's hash; the step driver adds the forced parameter sync
//! (`lowbit-train`'s `Trainer::load_checkpoint`: this crate sits below the driver).
//! Every piece a load needs is read once, chunk by chunk, by worker threads that hash it, and
//! uploaded by the device's thread into every view it overlaps (streaming: the optimizer's
//! [`lowbit_optim::Optimizer::state_views`]; an optimizer without views gets its export
//! template filled, then imported). Names, shapes, rules and coverage are checked before
//! anything is written; a corrupt piece found while streaming is an error after part of the
//! state was written, so the optimizer must not be used after it ([`Checkpoint::verify`]
//! first refuses a corrupt checkpoint before anything is written: every rank file's
//! safetensors header by the `safetensors` crate's rules and against the manifest, every
//! piece's hash, a `step-N` directory's name against its manifest's step). A `latest` that is a
//! symbolic link is followed only to a `step-N` directory of its own root.
//!
//! # Lock
//!
//! [`DirLock`] is an exclusive advisory lock on a root (`flock` on `.lowbit.lock`, released by
//! the kernel when the holder ends): a trainer holds it for the whole run, so that two runs
//! never save into one directory. Loading takes no lock.

mod async_save;
mod bytes;
mod check;
mod convert;
mod error;
mod load;
pub mod lock;
pub mod manifest;
mod read;
mod read_views;
mod save;
mod tidy;
mod write;

/// The manifest's JSON codec (`lowbit_io`'s one codec), re-exported for tools that edit
/// manifests.
pub use lowbit_io::json;

pub use async_save::AsyncSaver;
pub use convert::{Alias, LoadOptions, Segment};
pub use error::{CkptError, Result};
pub use load::Checkpoint;
pub use lock::DirLock;
pub use manifest::{
    FORMAT_VERSION, FileEntry, Manifest, Meta, OptimizerEntry, Piece, SCALARS_HASH, TensorEntry,
    fnv1a64,
};
pub use save::{LATEST, MANIFEST, SaveOptions, prune, save, step_dir_name};
pub use tidy::{Tidied, committed_steps, latest_step, tidy};
