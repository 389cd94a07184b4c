//! Reading pieces straight into an optimizer's device views (a streaming load): worker threads
//! read every needed piece once, chunk by chunk, into a few buffers of their own and hash it; the
//! thread that owns the device uploads each chunk into every destination it overlaps (a piece
//! cut by the loading plan lands in parts) and hands the buffer back. The disk, the hashing and
//! the uploads overlap, and nothing holds the whole state in host memory.
//!
//! A piece is uploaded before its hash is known: a load that fails (a corrupt piece, an I/O
//! error) has written some views, so the caller must not use the optimizer after the error.
//! Everything structural (names, shapes, coverage) is checked before anything is written.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;

use lowbit_device::{DType, Device, View, bf16};

use crate::error::{CkptError, Result, io};
use crate::manifest::{Piece, TensorEntry};
use crate::read::{piece_len, segments};
use lowbit_io::hash::{FNV_BASIS, fnv1a64_continue};

use crate::bytes::raw_bytes;
use crate::write::{CHUNK_BYTES, read_at, workers};

const CHUNK_ELEMS: usize = CHUNK_BYTES / 4;
/// Buffers a worker owns: one being read while the device thread uploads the other.
const BUFFERS_PER_WORKER: usize = 2;

/// Elements `want` of the concatenation of `parts`, to be written to `view` (`want`'s length).
pub(crate) struct ViewRequest<'t> {
    /// The logical tensor as the caller names it (for errors).
    pub name: String,
    pub parts: Vec<(&'t TensorEntry, Range<u64>)>,
    pub want: Range<u64>,
    pub view: View,
}

/// One piece to read and where its elements go: `(elements of the piece, destination view of
/// the same length)`.
struct Job<'t> {
    tensor: &'t TensorEntry,
    piece: &'t Piece,
    len: usize,
    dsts: Vec<(Range<usize>, View)>,
}

/// What a worker hands the device thread.
enum Msg {
    /// Elements `at..at + n` of job `job` in `buf`, read by worker `worker`.
    Chunk {
        worker: usize,
        job: usize,
        at: usize,
        buf: Vec<f32>,
        n: usize,
    },
    /// Job `job` failed (I/O or its hash).
    Failed { job: usize, error: CkptError },
}

/// Fills every request's view from the pieces of `dir` (each read once, hash-checked).
/// `mismatch` makes the error of a request that does not fit its parts or its view.
pub(crate) fn fill_views(
    dir: &Path,
    dev: &mut Device,
    requests: Vec<ViewRequest<'_>>,
    mismatch: impl Fn(String) -> CkptError,
) -> Result<()> {
    let mut jobs: Vec<Job<'_>> = Vec::new();
    let mut by_piece: HashMap<(&str, u64), usize> = HashMap::new();
    for r in requests {
        let total: u64 = r.parts.iter().map(|(_, p)| p.end - p.start).sum();
        if r.want.start > r.want.end
            || r.want.end > total
            || r.view.len() as u64 != r.want.end - r.want.start
        {
            return Err(mismatch(format!(
                "range {:?} of `{}` with {total} elements into {} values",
                r.want,
                r.name,
                r.view.len()
            )));
        }
        for (t, p, from, to) in segments(&r.parts, &r.want, &r.name, &mismatch)? {
            let dst = r.view.slice(to)?;
            let job = match by_piece.entry((t.name.as_str(), p.start)) {
                Entry::Occupied(o) => *o.get(),
                Entry::Vacant(v) => {
                    v.insert(jobs.len());
                    jobs.push(Job {
                        tensor: t,
                        piece: p,
                        len: piece_len(dir, p)?,
                        dsts: Vec::new(),
                    });
                    jobs.len() - 1
                }
            };
            jobs[job].dsts.push((from, dst));
        }
    }
    if jobs.is_empty() {
        return Ok(());
    }
    let nworkers = workers(jobs.len());
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let mut errors: Vec<(usize, CkptError)> = Vec::new();
    std::thread::scope(|s| {
        let (tx, rx) = mpsc::sync_channel::<Msg>(BUFFERS_PER_WORKER * nworkers);
        let mut returns = Vec::with_capacity(nworkers);
        for w in 0..nworkers {
            let (ret_tx, ret_rx) = mpsc::channel::<Vec<f32>>();
            returns.push(ret_tx);
            let (tx, jobs, next, stop) = (tx.clone(), &jobs, &next, &stop);
            s.spawn(move || worker(dir, w, jobs, next, stop, &tx, &ret_rx));
        }
        drop(tx);
        for msg in rx {
            match msg {
                Msg::Chunk {
                    worker,
                    job,
                    at,
                    buf,
                    n,
                } => {
                    if !stop.load(Ordering::Relaxed)
                        && let Err(e) = upload(dev, &jobs[job].dsts, at, &buf[..n])
                    {
                        errors.push((job, e));
                        stop.store(true, Ordering::Relaxed);
                    }
                    // The worker may have stopped already; its buffer is then dropped.
                    let _ = returns[worker].send(buf);
                }
                Msg::Failed { job, error } => {
                    errors.push((job, error));
                    stop.store(true, Ordering::Relaxed);
                }
            }
        }
    });
    errors.sort_by_key(|e| e.0);
    match errors.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// Uploads elements `at..at + values.len()` of a piece into every destination they overlap.
fn upload(
    dev: &mut Device,
    dsts: &[(Range<usize>, View)],
    at: usize,
    values: &[f32],
) -> Result<()> {
    let end = at + values.len();
    for (from, view) in dsts {
        let (a, b) = (from.start.max(at), from.end.min(end));
        if a >= b {
            continue;
        }
        let dst = view.slice(a - from.start..b - from.start)?;
        let src = &values[a - at..b - at];
        match dst.dtype() {
            // bf16 masters: rounded to nearest even, as an import rounds them.
            DType::Bf16 => {
                let v: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
                dev.upload(dst, &v)?;
            }
            _ => dev.upload(dst, src)?,
        }
    }
    Ok(())
}

/// A worker: takes jobs from `next` until none are left (or `stop`), reads each in chunks into
/// its buffers, hashes and sends them; a job that fails is reported and the worker goes on.
fn worker(
    dir: &Path,
    me: usize,
    jobs: &[Job<'_>],
    next: &AtomicUsize,
    stop: &AtomicBool,
    tx: &mpsc::SyncSender<Msg>,
    returned: &mpsc::Receiver<Vec<f32>>,
) {
    let mut files: HashMap<&str, File> = HashMap::new();
    let mut spare: Vec<Vec<f32>> = (0..BUFFERS_PER_WORKER).map(|_| Vec::new()).collect();
    while !stop.load(Ordering::Relaxed) {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(job) = jobs.get(i) else { return };
        let path = dir.join(&job.piece.file);
        let file = match files.entry(job.piece.file.as_str()) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => match File::open(&path) {
                Ok(f) => v.insert(f),
                Err(e) => {
                    let error = io("open", &path)(e);
                    if tx.send(Msg::Failed { job: i, error }).is_err() {
                        return;
                    }
                    continue;
                }
            },
        };
        let mut hash = FNV_BASIS;
        let mut at = 0;
        let mut failed = false;
        while at < job.len && !stop.load(Ordering::Relaxed) {
            let n = (job.len - at).min(CHUNK_ELEMS);
            let mut buf = match spare.pop() {
                Some(b) => b,
                None => match returned.recv() {
                    Ok(b) => b,
                    Err(_) => return,
                },
            };
            // Only as large as this chunk: a small piece takes a small buffer (at many ranks
            // per process, full-size buffers for small states add up).
            buf.resize(n, 0.0);
            if let Err(e) = read_at(file, &mut buf[..n], job.piece.offset + 4 * at as u64) {
                spare.push(buf);
                let error = io("read", &path)(e);
                failed = true;
                if tx.send(Msg::Failed { job: i, error }).is_err() {
                    return;
                }
                break;
            }
            hash = fnv1a64_continue(hash, raw_bytes(&buf[..n]));
            // The bytes are little-endian; a big-endian host swaps them in place.
            if cfg!(target_endian = "big") {
                buf[..n]
                    .iter_mut()
                    .for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
            }
            let msg = Msg::Chunk {
                worker: me,
                job: i,
                at,
                buf,
                n,
            };
            if tx.send(msg).is_err() {
                return;
            }
            at += n;
        }
        if !failed && at == job.len && hash != job.piece.hash {
            let error = CkptError::Hash {
                file: path,
                tensor: job.tensor.name.clone(),
                start: job.piece.start,
                end: job.piece.end,
            };
            if tx.send(Msg::Failed { job: i, error }).is_err() {
                return;
            }
        }
    }
}
