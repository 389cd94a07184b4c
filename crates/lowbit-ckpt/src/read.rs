//! Reading pieces: every piece a load needs is read once, straight into the destination's f32
//! memory where it lands whole (otherwise into a buffer of its own, then the overlapping part is
//! copied), and hash-checked. The cores take up to [`LANES`] pieces each from a shared queue
//! and read them block by block, hashing each round of blocks side by side while it is cached,
//! so one core's reads overlap another's hashing.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::AtomicUsize;

use crate::error::{CkptError, Result, io};
use crate::manifest::{Piece, TensorEntry};
use lowbit_io::hash::FNV_BASIS;

use crate::bytes::{LANES, hash_lanes, raw_bytes, raw_bytes_mut};

/// Stored tensors and element ranges of them whose concatenation is a logical tensor.
pub(crate) type Parts<'t> = Vec<(&'t TensorEntry, Range<u64>)>;

/// Elements `want` of the concatenation of `parts` (stored tensors and element ranges of them),
/// to be written to `out` (`want`'s length).
pub(crate) struct Request<'t, 'o> {
    /// The logical tensor as the caller names it (for errors).
    pub name: String,
    pub parts: Vec<(&'t TensorEntry, Range<u64>)>,
    pub want: Range<u64>,
    pub out: &'o mut [f32],
}

/// Where a piece's values go.
enum Dst<'o> {
    /// The destination itself: the piece lands there whole.
    Direct(&'o mut [f32]),
    /// A buffer of its own (filled when read), copied from afterwards.
    Keep(Vec<f32>),
    /// Nowhere: only the hash is checked.
    Discard,
}

/// One piece to read.
struct Job<'t, 'o> {
    tensor: &'t TensorEntry,
    piece: &'t Piece,
    len: usize,
    dst: Dst<'o>,
}

/// Part of a destination filled from a kept piece.
struct Part<'o> {
    dst: &'o mut [f32],
    job: usize,
    from: Range<usize>,
}

/// Checks the hash of every piece of `tensors` (reading each once).
pub(crate) fn verify<'t>(
    dir: &Path,
    tensors: impl IntoIterator<Item = &'t TensorEntry>,
) -> Result<()> {
    let mut jobs = Vec::new();
    for t in tensors {
        for p in &t.pieces {
            jobs.push(Job {
                tensor: t,
                piece: p,
                len: piece_len(dir, p)?,
                dst: Dst::Discard,
            });
        }
    }
    run(dir, &mut jobs)
}

/// Fills every request's `out` from the pieces of `dir` (each read once, hash-checked).
/// `mismatch` makes the error of a request that is out of range of its parts.
pub(crate) fn fill<'t, 'o>(
    dir: &Path,
    requests: Vec<Request<'t, 'o>>,
    mismatch: impl Fn(String) -> CkptError,
) -> Result<()> {
    let mut jobs: Vec<Job<'t, 'o>> = Vec::new();
    let mut by_piece: HashMap<(&'t str, u64), usize> = HashMap::new();
    let mut copies = Vec::new();
    for r in requests {
        let (ws, we) = (r.want.start, r.want.end);
        let total: u64 = r.parts.iter().map(|(_, p)| p.end - p.start).sum();
        if ws > we || we > total || r.out.len() as u64 != we - ws {
            return Err(mismatch(format!(
                "range {:?} of `{}` with {total} elements",
                r.want, r.name
            )));
        }
        let segments = segments(&r.parts, &r.want, &r.name, &mismatch)?;
        let mut rest = r.out;
        for (t, p, from, to) in segments {
            let (dst, tail) = std::mem::take(&mut rest).split_at_mut(to.len());
            rest = tail;
            let len = piece_len(dir, p)?;
            // A piece is (tensor, start): the pieces of a tensor do not overlap.
            match by_piece.entry((t.name.as_str(), p.start)) {
                // Whole and not needed elsewhere (so far): read it in place.
                Entry::Vacant(v) if from.len() == len => {
                    v.insert(jobs.len());
                    jobs.push(Job {
                        tensor: t,
                        piece: p,
                        len,
                        dst: Dst::Direct(dst),
                    });
                }
                Entry::Vacant(v) => {
                    v.insert(jobs.len());
                    copies.push(Part {
                        dst,
                        job: jobs.len(),
                        from,
                    });
                    jobs.push(Job {
                        tensor: t,
                        piece: p,
                        len,
                        dst: Dst::Keep(Vec::new()),
                    });
                }
                // Needed twice: read into its own buffer, both places copy from it.
                Entry::Occupied(o) => {
                    let job = *o.get();
                    if let Dst::Direct(first) =
                        std::mem::replace(&mut jobs[job].dst, Dst::Keep(Vec::new()))
                    {
                        copies.push(Part {
                            dst: first,
                            job,
                            from: 0..len,
                        });
                    }
                    copies.push(Part { dst, job, from });
                }
            }
        }
    }
    run(dir, &mut jobs)?;
    for c in copies {
        if let Dst::Keep(v) = &jobs[c.job].dst {
            c.dst.copy_from_slice(&v[c.from]);
        }
    }
    Ok(())
}

/// A segment of a request: `from` (elements of the piece) lands at `to` (elements of the
/// request's output).
pub(crate) type Segment<'t> = (&'t TensorEntry, &'t Piece, Range<usize>, Range<usize>);

/// The pieces elements `want` of the concatenation of `parts` come from, in output order;
/// checked to cover `want` exactly.
pub(crate) fn segments<'t>(
    parts: &[(&'t TensorEntry, Range<u64>)],
    want: &Range<u64>,
    name: &str,
    mismatch: &impl Fn(String) -> CkptError,
) -> Result<Vec<Segment<'t>>> {
    let (ws, we) = (want.start, want.end);
    let mut segments = Vec::new();
    let mut at = 0u64;
    for (t, src) in parts {
        let t = *t;
        let (s, e) = (ws.max(at), we.min(at + src.end - src.start));
        if s < e {
            // Elements [s, e) of the concatenation are [lo, hi) of `t`.
            let (lo, hi) = (src.start + s - at, src.start + e - at);
            for p in &t.pieces {
                let (a, b) = (p.start.max(lo), p.end.min(hi));
                if a < b {
                    let from = (a - p.start) as usize..(b - p.start) as usize;
                    let to = (s + a - lo - ws) as usize..(s + b - lo - ws) as usize;
                    segments.push((t, p, from, to));
                }
            }
        }
        at += src.end - src.start;
    }
    // The manifest's pieces tile every tensor exactly once, so this holds; checked anyway.
    let covered: usize = segments.iter().map(|s| s.3.len()).sum();
    if covered as u64 != we.saturating_sub(ws) {
        return Err(mismatch(format!("range {want:?} of `{name}` not covered")));
    }
    Ok(segments)
}

/// Elements of `p` (its bytes fit the file, which the manifest checked against its size).
pub(crate) fn piece_len(dir: &Path, p: &Piece) -> Result<usize> {
    usize::try_from(p.end - p.start).map_err(|_| CkptError::Manifest {
        file: dir.join(&p.file),
        msg: "piece too large for this machine".into(),
    })
}

/// Reads and hash-checks every job, on all cores. The error is the first failing job's.
fn run(dir: &Path, jobs: &mut [Job<'_, '_>]) -> Result<()> {
    let workers = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(jobs.len())
        .max(1);
    let queue = Mutex::new(jobs.iter_mut().enumerate());
    let mut errors: Vec<(usize, CkptError)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..workers)
            .map(|_| s.spawn(|| worker(dir, &queue, workers)))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    errors.sort_by_key(|e| e.0);
    match errors.into_iter().next() {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

type Queue<'a, 't, 'o> = Mutex<std::iter::Enumerate<std::slice::IterMut<'a, Job<'t, 'o>>>>;

/// Takes up to [`LANES`] jobs at a time (of `workers` sharing `queue`) and reads them into
/// their destinations block by block, hashing the blocks side by side. Returns the failures
/// as `(job, error)`.
fn worker(dir: &Path, queue: &Queue<'_, '_, '_>, workers: usize) -> Vec<(usize, CkptError)> {
    let mut files: HashMap<&str, File> = HashMap::new();
    let mut scratch: [Vec<f32>; LANES] = Default::default();
    let mut errors = Vec::new();
    loop {
        let batch: Vec<_> = {
            let mut q = queue
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            // Up to LANES, but a fair share of what is left: a few large pieces must not all
            // go to one core.
            let n = (q.len() / workers).clamp(1, LANES);
            q.by_ref().take(n).collect()
        };
        if batch.is_empty() {
            return errors;
        }
        let mut lanes = Vec::new();
        for ((i, job), spare) in batch.into_iter().zip(&mut scratch) {
            let buf: &mut [f32] = match &mut job.dst {
                Dst::Direct(d) => d,
                Dst::Keep(v) => {
                    *v = vec![0.0; job.len];
                    v
                }
                Dst::Discard => {
                    spare.resize(job.len, 0.0);
                    spare
                }
            };
            lanes.push(Lane {
                job: i,
                tensor: job.tensor,
                piece: job.piece,
                buf,
                at: 0,
                block: 0,
                hash: FNV_BASIS,
                failed: false,
            });
        }
        // Block by block: every lane reads its next block, then the blocks are hashed side by
        // side while they are still cached (and the other cores read).
        while lanes.iter().any(|l| !l.failed && l.at < l.bytes()) {
            for l in &mut lanes {
                let n = if l.failed {
                    0
                } else {
                    (l.bytes() - l.at).min(READ_BLOCK)
                };
                let (at, block) = (l.at, &mut raw_bytes_mut(l.buf)[l.at..l.at + n]);
                l.block = n;
                if let Err(e) = read_block(dir, &mut files, l.piece, at, block) {
                    errors.push((l.job, e));
                    (l.failed, l.block) = (true, 0);
                }
            }
            let blocks: Vec<&[u8]> = lanes
                .iter()
                .map(|l| &raw_bytes(l.buf)[l.at..l.at + l.block])
                .collect();
            for (k, hash) in hash_lanes(&blocks, &AtomicUsize::new(0), |k| lanes[k].hash) {
                lanes[k].hash = hash;
                lanes[k].at += lanes[k].block;
            }
        }
        for l in lanes.into_iter().filter(|l| !l.failed) {
            if l.hash != l.piece.hash {
                errors.push((
                    l.job,
                    CkptError::Hash {
                        file: dir.join(&l.piece.file),
                        tensor: l.tensor.name.clone(),
                        start: l.piece.start,
                        end: l.piece.end,
                    },
                ));
            }
            // The bytes are little-endian; a big-endian host swaps them in place.
            if cfg!(target_endian = "big") {
                l.buf
                    .iter_mut()
                    .for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
            }
        }
    }
}

/// Bytes a lane reads before the blocks are hashed.
const READ_BLOCK: usize = 4 << 20;

/// One piece being read and hashed by a worker.
struct Lane<'t, 'b> {
    job: usize,
    tensor: &'t TensorEntry,
    piece: &'t Piece,
    buf: &'b mut [f32],
    /// Bytes read and hashed.
    at: usize,
    /// Bytes of the block just read.
    block: usize,
    /// FNV-1a of the first `at` bytes.
    hash: u64,
    failed: bool,
}

impl Lane<'_, '_> {
    fn bytes(&self) -> usize {
        std::mem::size_of_val(self.buf)
    }
}

/// Reads bytes `at..` of piece `p` of `dir` into `dst` through this worker's open files.
fn read_block<'t>(
    dir: &Path,
    files: &mut HashMap<&'t str, File>,
    p: &'t Piece,
    at: usize,
    dst: &mut [u8],
) -> Result<()> {
    let path = dir.join(&p.file);
    let f = match files.entry(p.file.as_str()) {
        Entry::Occupied(o) => o.into_mut(),
        Entry::Vacant(v) => v.insert(File::open(&path).map_err(io("open", &path))?),
    };
    f.seek(SeekFrom::Start(p.offset + at as u64))
        .map_err(io("seek", &path))?;
    f.read_exact(dst).map_err(io("read", &path))
}
