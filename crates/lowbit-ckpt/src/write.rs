//! Writing a rank's data file: the pieces stream from where they are (a host snapshot, or the
//! optimizer's device views, downloaded chunk by chunk into a few reused buffers) into the
//! safetensors file, while worker threads hash and write them.
//!
//! FNV-1a (the format's hash) is one multiply chain per byte, so one core hashes a piece at well
//! under the disk's speed: the pieces go to [`workers`] threads, each hashing and writing (at
//! the piece's own offset) the pieces of its slot, and the producer (the thread that owns the
//! device) hands out the chunks of one piece per slot in turn. Each written chunk is handed to
//! the disk at once (`sync_file_range`), so the final fsync finds little left to do. Nothing
//! holds the whole state in host memory: a save from device views needs at most `2·workers + 2`
//! buffers (never more than its chunks), each of at most `min(CHUNK_BYTES, largest piece)`, so
//! per rank at most `(2·8 + 2)·8 MiB` = 144 MiB, and a few KiB for a small state.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::Path;
use std::sync::mpsc;

use lowbit_device::{DType, Device, View, bf16};

use crate::error::{CkptError, Result, io};
use lowbit_io::hash::{FNV_BASIS, fnv1a64_continue};
use lowbit_io::json::Json;

use crate::bytes::{raw_bytes, raw_bytes_mut};
use crate::manifest::obj;

/// Bytes per chunk handed from the producer to a worker.
pub(crate) const CHUNK_BYTES: usize = 8 << 20;
const CHUNK_ELEMS: usize = CHUNK_BYTES / 4;

/// Where a piece's values are.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Source<'a> {
    /// In host memory (a snapshot).
    Host(&'a [f32]),
    /// In device memory (F32, or BF16 masters: written as their exact f32 values).
    Device(View),
}

impl Source<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Source::Host(v) => v.len(),
            Source::Device(v) => v.len(),
        }
    }
}

/// One piece to store: its key, where it belongs (for the index) and its values.
#[derive(Debug)]
pub(crate) struct OutPiece<'a> {
    pub key: String,
    pub param: &'a str,
    pub state: &'a str,
    pub owner: u32,
    pub range: Range<usize>,
    pub source: Source<'a>,
}

/// What [`write_file`] wrote: the file's size, every piece's absolute byte offset and hash (in
/// the order of the pieces given).
pub(crate) struct Written {
    pub bytes: u64,
    pub offsets: Vec<u64>,
    pub hashes: Vec<u64>,
}

/// Worker threads of a streaming write or read: enough cores to hash at the disk's speed, at
/// most one per piece.
pub(crate) fn workers(pieces: usize) -> usize {
    std::thread::available_parallelism()
        .map_or(1, usize::from)
        .clamp(1, 8)
        .min(pieces)
        .max(1)
}

/// Buffers in the pool of a streaming write with `workers` workers.
pub(crate) fn pool_buffers(workers: usize) -> usize {
    2 * workers + 2
}

/// A chunk on its way to a worker: bytes `at..` of piece `piece` (in file order).
struct Chunk<'a> {
    piece: usize,
    at: u64,
    data: ChunkData<'a>,
}

enum ChunkData<'a> {
    Borrowed(&'a [f32]),
    /// A pool buffer and the number of values in it.
    Pooled(Vec<f32>, usize),
}

/// Writes `pieces` as a safetensors file at `path` (F32, 1-D, data in key order, the layout of
/// the `safetensors` crate; created exclusively) and fsyncs it. `dev` is the device of
/// [`Source::Device`] pieces (the calling thread owns it; only it downloads).
pub(crate) fn write_file(
    path: &Path,
    rank: usize,
    pieces: &[OutPiece<'_>],
    dev: Option<&Device>,
) -> Result<Written> {
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by(|&a, &b| pieces[a].key.cmp(&pieces[b].key));
    let mut header = BTreeMap::new();
    header.insert(
        "__metadata__".to_string(),
        obj(vec![
            ("format", Json::Str("lowbit-ckpt rank shard".into())),
            ("rank", Json::Str(rank.to_string())),
        ]),
    );
    let mut data_offsets = vec![0u64; pieces.len()];
    let mut at = 0u64;
    for &i in &order {
        let p = &pieces[i];
        let len = 4 * p.source.len() as u64;
        data_offsets[i] = at;
        header.insert(
            p.key.clone(),
            obj(vec![
                ("dtype", Json::Str("F32".into())),
                ("shape", Json::Arr(vec![Json::UInt(p.source.len() as u64)])),
                (
                    "data_offsets",
                    Json::Arr(vec![Json::UInt(at), Json::UInt(at + len)]),
                ),
            ]),
        );
        at += len;
    }
    let mut text = Json::Obj(header.into()).to_text().into_bytes();
    // Readers expect the data 8-byte aligned: pad the header with spaces, as safetensors does.
    text.resize(text.len().next_multiple_of(8), b' ');
    let n = text.len() as u64;
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io("create", path))?;
    f.write_all(&n.to_le_bytes()).map_err(io("write", path))?;
    f.write_all(&text).map_err(io("write", path))?;
    let base = 8 + n;
    // File order: the pieces as the file lays them out.
    let file_pieces: Vec<(Source<'_>, u64)> = order
        .iter()
        .map(|&i| (pieces[i].source, base + data_offsets[i]))
        .collect();
    let hashes_in_file_order = stream(path, &f, &file_pieces, dev)?;
    f.sync_all().map_err(io("fsync", path))?;
    let mut hashes = vec![0u64; pieces.len()];
    for (k, &i) in order.iter().enumerate() {
        hashes[i] = hashes_in_file_order[k];
    }
    Ok(Written {
        bytes: base + at,
        offsets: data_offsets.iter().map(|o| base + o).collect(),
        hashes,
    })
}

/// Streams every `(source, file offset)` into `f` through the workers; returns the hashes.
fn stream(
    path: &Path,
    f: &File,
    pieces: &[(Source<'_>, u64)],
    dev: Option<&Device>,
) -> Result<Vec<u64>> {
    let nworkers = workers(pieces.len());
    let (free_tx, free_rx) = mpsc::channel::<Vec<f32>>();
    // The pool: at most `2·workers + 2` buffers (one being filled, two queued per worker, one
    // being written per worker), never more than the device chunks there are, each grown only
    // to the chunks it carries (at most `min(CHUNK_BYTES, largest piece)`). So a save of a
    // small state takes little memory however many ranks save at once; a pool of full-size
    // buffers took `(2·workers + 2)·CHUNK_BYTES` per rank whatever the state.
    let device_chunks: usize = pieces
        .iter()
        .filter(|p| matches!(p.0, Source::Device(_)))
        .map(|p| p.0.len().div_ceil(CHUNK_ELEMS).max(1))
        .sum();
    for _ in 0..device_chunks.min(pool_buffers(nworkers)) {
        let _ = free_tx.send(Vec::new());
    }
    std::thread::scope(|s| {
        let mut senders = Vec::with_capacity(nworkers);
        let mut handles = Vec::with_capacity(nworkers);
        for _ in 0..nworkers {
            let (tx, rx) = mpsc::sync_channel::<Chunk<'_>>(2);
            let free = free_tx.clone();
            senders.push(tx);
            handles.push(s.spawn(move || worker(path, f, pieces, rx, free)));
        }
        drop(free_tx);
        let produced = produce(path, pieces, dev, &senders, &free_rx);
        drop(senders);
        let mut hashes = vec![FNV_BASIS; pieces.len()];
        // A worker's own error first: the producer's may only say that a worker stopped.
        let mut first_err = None;
        for h in handles {
            match h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)) {
                Ok(done) => done.into_iter().for_each(|(i, v)| hashes[i] = v),
                Err(e) => first_err = first_err.or(Some(e)),
            }
        }
        match first_err.or(produced.err()) {
            Some(e) => Err(e),
            None => Ok(hashes),
        }
    })
}

/// The producer: one piece per worker slot at a time, the slots' chunks in turn (so every
/// worker hashes), downloading device chunks into pool buffers. Stops at the first error (a
/// worker that failed has hung up its channel).
fn produce<'a>(
    path: &Path,
    pieces: &'a [(Source<'a>, u64)],
    dev: Option<&Device>,
    senders: &[mpsc::SyncSender<Chunk<'a>>],
    free: &mpsc::Receiver<Vec<f32>>,
) -> Result<()> {
    let hung_up = || CkptError::Io {
        op: "write",
        path: path.to_path_buf(),
        source: std::io::Error::other("a writer thread stopped"),
    };
    // Per slot: (piece, next element).
    let mut slots: Vec<Option<(usize, usize)>> = vec![None; senders.len()];
    let mut next_piece = 0;
    loop {
        let mut any = false;
        for (slot, tx) in slots.iter_mut().zip(senders) {
            if slot.is_none() && next_piece < pieces.len() {
                *slot = Some((next_piece, 0));
                next_piece += 1;
            }
            let Some((piece, at)) = *slot else { continue };
            any = true;
            let source = pieces[piece].0;
            let end = (at + CHUNK_ELEMS).min(source.len());
            let data = match source {
                Source::Host(v) => ChunkData::Borrowed(&v[at..end]),
                Source::Device(view) => {
                    let dev = dev.ok_or_else(|| CkptError::Io {
                        op: "download a piece for",
                        path: path.to_path_buf(),
                        source: std::io::Error::other("a device piece without its device"),
                    })?;
                    let mut buf = free.recv().map_err(|_| hung_up())?;
                    // Only as large as this chunk (a small piece needs a small buffer).
                    buf.resize(end - at, 0.0);
                    download(dev, view.slice(at..end)?, &mut buf)?;
                    ChunkData::Pooled(buf, end - at)
                }
            };
            let chunk = Chunk {
                piece,
                at: 4 * at as u64,
                data,
            };
            // An empty piece still sends one (empty) chunk, so its worker records its hash.
            tx.send(chunk).map_err(|_| hung_up())?;
            *slot = (end < source.len()).then_some((piece, end));
        }
        if !any {
            return Ok(());
        }
    }
}

/// Device values as f32 into `out` (bf16 widened exactly).
fn download(dev: &Device, view: View, out: &mut [f32]) -> Result<()> {
    match view.dtype() {
        DType::Bf16 => {
            let v = dev.download::<bf16>(view)?;
            out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32());
        }
        _ => dev.download_f32_into(view, out)?,
    }
    Ok(())
}

/// A worker: hashes its chunks (a piece's chunks arrive in order) and writes them at their
/// offsets, handing each to the disk at once; returns `(piece, hash)` of its pieces. After an
/// error it stops (its channel closes, so the producer stops too).
fn worker(
    path: &Path,
    f: &File,
    pieces: &[(Source<'_>, u64)],
    rx: mpsc::Receiver<Chunk<'_>>,
    free: mpsc::Sender<Vec<f32>>,
) -> Result<Vec<(usize, u64)>> {
    let mut done: Vec<(usize, u64)> = Vec::new();
    for chunk in rx {
        let values: &[f32] = match &chunk.data {
            ChunkData::Borrowed(v) => v,
            ChunkData::Pooled(b, n) => &b[..*n],
        };
        let le = le_bytes(values);
        let hash = match done.last_mut() {
            Some((p, h)) if *p == chunk.piece => h,
            _ => {
                done.push((chunk.piece, FNV_BASIS));
                &mut done.last_mut().expect("just pushed").1
            }
        };
        *hash = fnv1a64_continue(*hash, &le);
        let offset = pieces[chunk.piece].1 + chunk.at;
        write_at(f, &le, offset).map_err(io("write", path))?;
        start_writeback(f, offset, le.len() as u64);
        if let ChunkData::Pooled(b, _) = chunk.data {
            let _ = free.send(b);
        }
    }
    Ok(done)
}

/// The little-endian bytes of `values`: their memory on a little-endian host.
fn le_bytes(values: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(raw_bytes(values))
    } else {
        std::borrow::Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Writes all of `buf` at `offset` of `f` (positioned: the workers share the file).
fn write_at(f: &File, buf: &[u8], offset: u64) -> std::io::Result<()> {
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::write_all_at(f, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut buf, mut offset) = (buf, offset);
        while !buf.is_empty() {
            let n = std::os::windows::fs::FileExt::seek_write(f, buf, offset)?;
            if n == 0 {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            buf = &buf[n..];
            offset += n as u64;
        }
        Ok(())
    }
}

/// Reads all of `buf` from `offset` of `f` (positioned: the workers share files).
pub(crate) fn read_at(f: &File, buf: &mut [f32], offset: u64) -> std::io::Result<()> {
    let buf = raw_bytes_mut(buf);
    #[cfg(unix)]
    {
        std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
    }
    #[cfg(windows)]
    {
        let (mut buf, mut offset) = (buf, offset);
        while !buf.is_empty() {
            let n = std::os::windows::fs::FileExt::seek_read(f, buf, offset)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            buf = &mut buf[n..];
            offset += n as u64;
        }
        Ok(())
    }
}

/// Starts writing `len` bytes of `f` at `offset` to the disk without waiting (Linux
/// `sync_file_range(SYNC_FILE_RANGE_WRITE)`): the disk works while the next bytes are copied
/// into the page cache, instead of all of them waiting for the final fsync (which still makes
/// the file durable). Elsewhere, and on any error, nothing happens: it is only an early start.
fn start_writeback(f: &File, offset: u64, len: u64) {
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        unsafe extern "C" {
            fn sync_file_range(fd: i32, offset: i64, nbytes: i64, flags: u32) -> i32;
        }
        const SYNC_FILE_RANGE_WRITE: u32 = 2;
        let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
            return;
        };
        // SAFETY: `f` is an open file for the whole call and no memory is passed; the call only
        // schedules writeback of the file's dirty pages in the range.
        unsafe { sync_file_range(f.as_raw_fd(), offset, len, SYNC_FILE_RANGE_WRITE) };
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (f, offset, len);
}
