//! Asynchronous saves: snapshot the state on the training thread, write the files on a
//! background thread while training continues, commit at the next collective point.
//!
//! # Design
//!
//! A save has three parts (see [`crate::save()`]): the snapshot and the temp directory
//! (collective: a barrier), each rank's files (no collective), the commit (collective: a
//! barrier, rank 0 commits, a barrier). [`AsyncSaver::save`] runs the first part on the calling
//! thread and hands the second to a background thread that only writes and fsyncs files; the
//! third runs in [`AsyncSaver::wait`] (or the next [`AsyncSaver::save`]), which every rank
//! calls at the same point of its training loop. So no collective ever runs off the training
//! thread: the background thread never touches the communicator, whose calls must stay in
//! the same order on every rank (NCCL, the thread group). The alternative — rank 0's
//! background thread polling the file system until every rank's files appear, then committing
//! alone — needs no collective at the end, but a rank that fails leaves rank 0 polling with no
//! way to tell "slow" from "dead" but a timeout, and a crash of rank 0 mid-poll is silent; the
//! collective wait reports every failure on every rank.
//!
//! The atomicity is [`crate::save()`]'s: until rank 0 renames the temp directory (inside the
//! wait), a kill at any instant leaves the previous checkpoint as `latest` and nothing that
//! loads. A saver holds at most one pending save: the next save first completes it.

use std::path::PathBuf;
use std::sync::Arc;
use std::thread::JoinHandle;

use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_layout::ParamSpec;
use lowbit_optim::{Optimizer, OptimizerState};

use crate::error::{CkptError, Result};
use crate::manifest::Meta;
use crate::save::{SaveOptions, Target};

/// The background writer's outcome and the snapshot it wrote (its buffers serve the next one).
type Written = (Result<()>, Vec<OptimizerState>);

/// One save whose files are being written in the background.
#[derive(Debug)]
struct PendingSave {
    target: Arc<Target>,
    writer: Option<JoinHandle<Written>>,
    /// The local failure before the writer started (the snapshot, the temp directory, the
    /// thread), reported at the wait.
    failed: Option<CkptError>,
}

impl PendingSave {
    /// Joins the writer and commits (collective); hands back the snapshot's buffers.
    fn finish(mut self, comm: &mut dyn Communicator) -> (Result<PathBuf>, Vec<OptimizerState>) {
        let (written, state) = match (self.failed.take(), self.writer.take()) {
            (Some(e), _) => (Err(e), Vec::new()),
            (None, Some(h)) => h
                .join()
                .unwrap_or_else(|_| (Err(self.panicked()), Vec::new())),
            (None, None) => (Err(self.panicked()), Vec::new()),
        };
        (self.target.finish(comm, written), state)
    }

    fn panicked(&self) -> CkptError {
        CkptError::Io {
            op: "write in the background",
            path: self.target.tmp().to_path_buf(),
            source: std::io::Error::other("the checkpoint writer thread panicked"),
        }
    }
}

impl Drop for PendingSave {
    /// A save dropped without its wait is never committed (as if the process had been killed
    /// after the write): the writer is joined so that its files are complete and the snapshot
    /// is freed; the temp directory stays, and no loader opens it.
    fn drop(&mut self) {
        if let Some(h) = self.writer.take() {
            let _ = h.join();
        }
    }
}

/// Saves checkpoints without stopping training for the writes. Every rank of the
/// communicator holds one and calls [`AsyncSaver::save`] and [`AsyncSaver::wait`] at the same
/// points of its loop (both are collective).
///
/// ```no_run
/// # fn demo(
/// #     dev: &mut lowbit_device::Device,
/// #     comm: &mut dyn lowbit_comm::Communicator,
/// #     bufs: &lowbit_buffers::DataParallelBuffers,
/// #     opt: &dyn lowbit_optim::Optimizer,
/// # ) -> lowbit_ckpt::Result<()> {
/// use lowbit_ckpt::{AsyncSaver, Meta, SaveOptions};
/// let mut saver = AsyncSaver::new();
/// let specs = bufs.specs().to_vec();
/// for step in 1..=100u64 {
///     // ... one training step ...
///     if step % 10 == 0 {
///         let meta = Meta { step, ..Meta::default() };
///         // Snapshot now; write while the next steps run; commit at the next save or wait.
///         saver.save(dev, comm, std::path::Path::new("ckpt"), &meta, &specs, opt,
///                    SaveOptions::default())?;
///     }
/// }
/// saver.wait(comm)?; // the last save, committed
/// # Ok(()) }
/// ```
///
/// The saver keeps the host buffers of its last snapshot (as much memory as this rank's
/// state) for the next one, so a snapshot after the first copies into memory that is already
/// faulted in; [`AsyncSaver::release_buffers`] frees them.
#[derive(Debug, Default)]
pub struct AsyncSaver {
    pending: Option<PendingSave>,
    spare: Vec<OptimizerState>,
}

impl AsyncSaver {
    /// A saver with nothing pending.
    pub fn new() -> Self {
        AsyncSaver::default()
    }

    /// Starts a save of `opt`'s state after step `meta.step` under `root` (collective, the
    /// arguments of [`crate::save()`]). A pending save is completed first (its files awaited,
    /// then committed), and its committed path returned. Then, on the calling thread: the
    /// snapshot (`opt.export_state_into` the previous snapshot's buffers, a host copy — what
    /// this call costs a training step) and a barrier; the files are written and fsynced by a
    /// background thread, so `opt` may step again as soon as this returns: later updates do
    /// not reach the checkpoint.
    ///
    /// # Errors
    /// The previous save's errors (then nothing new is started); [`CkptError::Exists`] if
    /// `step-N` is committed already; collective errors. A failure of the snapshot or of the
    /// files is reported by the wait that commits this save.
    #[allow(clippy::too_many_arguments)]
    pub fn save(
        &mut self,
        dev: &Device,
        comm: &mut dyn Communicator,
        root: &std::path::Path,
        meta: &Meta,
        specs: &[ParamSpec],
        opt: &dyn Optimizer,
        options: SaveOptions,
    ) -> Result<Option<PathBuf>> {
        let previous = self.wait(comm)?;
        let target = Target::new(comm, root, meta, specs, options)?;
        let state = target.begin(dev, comm, opt, std::mem::take(&mut self.spare))?;
        let target = Arc::new(target);
        let mut pending = PendingSave {
            target: Arc::clone(&target),
            writer: None,
            failed: None,
        };
        match state {
            Err(e) => pending.failed = Some(e),
            Ok(state) => {
                let spawned = std::thread::Builder::new()
                    .name(format!("lowbit-ckpt-step-{}", meta.step))
                    .spawn(move || (target.write(&state), state));
                match spawned {
                    Ok(h) => pending.writer = Some(h),
                    Err(source) => {
                        pending.failed = Some(CkptError::Io {
                            op: "start the checkpoint writer for",
                            path: pending.target.tmp().to_path_buf(),
                            source,
                        })
                    }
                }
            }
        }
        self.pending = Some(pending);
        Ok(previous)
    }

    /// Completes the pending save, if any (collective): waits for this rank's files, then the
    /// commit of [`crate::save()`]. Returns the committed `step-N` directory (`None` when nothing
    /// was pending).
    ///
    /// # Errors
    /// The snapshot's, the files' and the commit's errors, on every rank (a rank whose own part
    /// succeeded reports that rank 0 did not commit); collective errors.
    pub fn wait(&mut self, comm: &mut dyn Communicator) -> Result<Option<PathBuf>> {
        let Some(p) = self.pending.take() else {
            return Ok(None);
        };
        let (committed, spare) = p.finish(comm);
        self.spare = spare;
        committed.map(Some)
    }

    /// Frees the buffers kept from the last snapshot (the next snapshot allocates anew). A
    /// pending save keeps its own until it is waited for.
    pub fn release_buffers(&mut self) {
        self.spare = Vec::new();
    }

    /// The step of the pending save.
    pub fn pending_step(&self) -> Option<u64> {
        self.pending.as_ref().map(|p| p.target.step())
    }

    /// Whether the pending save's files are written on this rank (its wait will not block on
    /// them; the commit is still to come). `false` when nothing is pending.
    pub fn is_written(&self) -> bool {
        self.pending.as_ref().is_some_and(|p| match &p.writer {
            Some(h) => h.is_finished(),
            None => true,
        })
    }
}
