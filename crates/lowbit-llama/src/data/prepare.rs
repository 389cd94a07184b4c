//! `prepare`: text files → token shards and a manifest, streaming with bounded memory.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use lowbit_io::hash::fnv1a64_continue;
use lowbit_io::rng::splitmix64;

use super::manifest::{Dtype, InputRecord, MANIFEST_FILE, Manifest, ShardRecord, SplitRecord};
use super::{DataError, Result, Tokenizer};

/// FNV-1a 64 of the empty input: the running hash's start.
pub(crate) const FNV_BASIS: u64 = 0xcbf2_9ce4_8422_2325;

/// Options of [`prepare`].
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareOptions {
    /// The tokenizer (its vocabulary sets the shards' dtype).
    pub tokenizer: Tokenizer,
    /// Fraction of the documents that go to validation, in `[0, 1)` (see [`prepare`]).
    pub validation_fraction: f64,
    /// The most tokens per shard file (positive).
    pub shard_tokens: u64,
    /// Bytes read from an input at a time (positive).
    pub read_bytes: usize,
    /// The most text held before it must be tokenized: an input with no cut point (a word
    /// boundary) in this many bytes is refused (at least `read_bytes`).
    pub max_pending_bytes: usize,
}

impl Default for PrepareOptions {
    /// GPT-2, 10% validation, 100M tokens per shard (200 MB of u16, as nanoGPT's FineWeb
    /// shards), 1 MiB reads, 16 MiB of pending text at most.
    fn default() -> Self {
        PrepareOptions {
            tokenizer: Tokenizer::Gpt2,
            validation_fraction: 0.1,
            shard_tokens: 100_000_000,
            read_bytes: 1 << 20,
            max_pending_bytes: 16 << 20,
        }
    }
}

/// Refuses anything but a regular file (following symlinks) before it is opened, so a FIFO, a
/// device such as `/dev/zero`, a socket or a directory can neither block nor stream forever;
/// returns its size.
pub(crate) fn regular_file_len(path: &Path) -> Result<u64> {
    let meta = fs::metadata(path).map_err(|e| DataError::io("reading the metadata of", path, e))?;
    let ft = meta.file_type();
    if ft.is_file() {
        return Ok(meta.len());
    }
    let what = if ft.is_dir() {
        "a directory".to_string()
    } else {
        #[cfg(unix)]
        {
            use std::os::unix::fs::FileTypeExt;
            if ft.is_fifo() {
                "a FIFO".to_string()
            } else if ft.is_char_device() {
                "a character device".to_string()
            } else if ft.is_block_device() {
                "a block device".to_string()
            } else if ft.is_socket() {
                "a socket".to_string()
            } else {
                "not a regular file".to_string()
            }
        }
        #[cfg(not(unix))]
        {
            "not a regular file".to_string()
        }
    };
    Err(DataError::NotAFile {
        path: path.to_path_buf(),
        what: format!("is {what}, not a regular file (refused without opening it)"),
    })
}

/// Opens a file checked by [`regular_file_len`] and checks the opened handle again (the path
/// may have been replaced in between).
pub(crate) fn open_regular(path: &Path) -> Result<(File, u64)> {
    let len = regular_file_len(path)?;
    let file = File::open(path).map_err(|e| DataError::io("opening", path, e))?;
    let meta = file
        .metadata()
        .map_err(|e| DataError::io("reading the metadata of", path, e))?;
    if !meta.is_file() || meta.len() != len {
        return Err(DataError::NotAFile {
            path: path.to_path_buf(),
            what: "changed while it was being opened".into(),
        });
    }
    Ok((file, len))
}

/// Reads `file` (of `len` bytes) in pieces of `chunk` bytes, handing each to `f`; errors if it
/// is not `len` bytes long after all (it changed while being read).
fn stream(
    path: &Path,
    file: &mut File,
    len: u64,
    chunk: usize,
    mut f: impl FnMut(&[u8]) -> Result<()>,
) -> Result<u64> {
    let mut buf = vec![0u8; chunk];
    let mut seen = 0u64;
    let mut hash = FNV_BASIS;
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| DataError::io("reading", path, e))?;
        if n == 0 {
            break;
        }
        seen += n as u64;
        if seen > len {
            break;
        }
        hash = fnv1a64_continue(hash, &buf[..n]);
        f(&buf[..n])?;
    }
    if seen != len {
        return Err(DataError::Input {
            path: path.to_path_buf(),
            what: format!("changed while being read ({len} bytes expected, {seen}+ read)"),
        });
    }
    Ok(hash)
}

/// Where a document's ids go: a split's shard writer, or memory.
pub(crate) trait Sink {
    fn push(&mut self, ids: &[u32]) -> Result<()>;
}

impl Sink for Vec<u32> {
    fn push(&mut self, ids: &[u32]) -> Result<()> {
        self.extend_from_slice(ids);
        Ok(())
    }
}

/// Tokenizes one document fed in pieces, with bounded memory, into `first` (and, from the
/// split point on, `second`). Each part is preceded by end-of-text.
///
/// Text is tokenized up to the last cut point of what is pending ([`Tokenizer::safe_cut`]),
/// which gives exactly the ids of tokenizing the whole at once, whatever the piece sizes.
/// With `split_at = Some(t)` (a lone document), the document is cut for the validation split
/// at the first line start at or after byte `t`, else (no line starts there) at the first
/// character boundary at or after `t`; until that cut is made, nothing at or after `t` is
/// tokenized.
pub(crate) struct DocTokenizer<'a> {
    tok: Tokenizer,
    path: &'a Path,
    max_pending: usize,
    /// Bytes of an incomplete UTF-8 character at the end of the last piece.
    carry: Vec<u8>,
    pending: String,
    /// Document offset of `pending[0]`.
    start: u64,
    split_at: Option<u64>,
    in_second: bool,
}

impl<'a> DocTokenizer<'a> {
    pub(crate) fn new(
        tok: Tokenizer,
        path: &'a Path,
        max_pending: usize,
        split_at: Option<u64>,
        first: &mut dyn Sink,
    ) -> Result<Self> {
        first.push(&[tok.eot()])?;
        Ok(DocTokenizer {
            tok,
            path,
            max_pending,
            carry: Vec::new(),
            pending: String::new(),
            start: 0,
            split_at,
            in_second: false,
        })
    }

    fn sink<'s>(&self, first: &'s mut dyn Sink, second: &'s mut dyn Sink) -> &'s mut dyn Sink {
        if self.in_second { second } else { first }
    }

    /// Tokenizes `pending[..cut]` into the current part.
    fn emit(&mut self, cut: usize, first: &mut dyn Sink, second: &mut dyn Sink) -> Result<()> {
        if cut == 0 {
            return Ok(());
        }
        let ids = self.tok.encode(&self.pending[..cut]);
        self.sink(first, second).push(&ids)?;
        self.pending.drain(..cut);
        self.start += cut as u64;
        Ok(())
    }

    /// The lone document's cut inside `pending`, if it is there (`eof`: nothing follows).
    fn split_cut(&self, eof: bool) -> Option<usize> {
        let t = self.split_at?;
        if self.in_second {
            return None;
        }
        let from = usize::try_from(t.saturating_sub(self.start)).ok()?;
        let b = self.pending.as_bytes();
        if from >= b.len() {
            return None;
        }
        if let Some(p) = (from.max(1)..b.len()).find(|&p| b[p - 1] == b'\n') {
            return Some(p);
        }
        // No line start yet: only at the end is the fallback (a character boundary) final.
        eof.then(|| (from..b.len()).find(|&p| self.pending.is_char_boundary(p)))
            .flatten()
    }

    pub(crate) fn feed(
        &mut self,
        bytes: &[u8],
        first: &mut dyn Sink,
        second: &mut dyn Sink,
    ) -> Result<()> {
        self.carry.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.carry) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(e) => {
                let at = self.start + self.pending.len() as u64 + e.valid_up_to() as u64;
                return Err(DataError::Input {
                    path: self.path.to_path_buf(),
                    what: format!("not UTF-8 text (invalid byte at offset {at})"),
                });
            }
        };
        // The prefix was just validated.
        let text = std::str::from_utf8(&self.carry[..valid]).unwrap_or_default();
        self.pending.push_str(text);
        self.carry.drain(..valid);
        self.advance(false, first, second)?;
        if self.pending.len() > self.max_pending {
            return Err(DataError::Input {
                path: self.path.to_path_buf(),
                what: format!(
                    "no word boundary (an ASCII letter, a space, an ASCII letter) in {} bytes \
                     from offset {}; raise the pending-text bound or split the file",
                    self.pending.len(),
                    self.start
                ),
            });
        }
        Ok(())
    }

    fn advance(&mut self, eof: bool, first: &mut dyn Sink, second: &mut dyn Sink) -> Result<()> {
        if let Some(cut) = self.split_cut(eof) {
            self.emit(cut, first, second)?;
            self.in_second = true;
            second.push(&[self.tok.eot()])?;
        }
        // Until the lone document's cut is made, tokenize only what lies before it.
        let limit = match self.split_at {
            Some(t) if !self.in_second => usize::try_from(t.saturating_sub(self.start))
                .map_or(self.pending.len(), |l| l.min(self.pending.len())),
            _ => self.pending.len(),
        };
        if eof && limit == self.pending.len() {
            return self.emit(limit, first, second);
        }
        let mut lim = limit;
        while !self.pending.is_char_boundary(lim) {
            lim -= 1;
        }
        match Tokenizer::safe_cut(&self.pending[..lim]) {
            Some(cut) => self.emit(cut, first, second),
            None => Ok(()),
        }
    }

    pub(crate) fn finish(mut self, first: &mut dyn Sink, second: &mut dyn Sink) -> Result<bool> {
        if !self.carry.is_empty() {
            return Err(DataError::Input {
                path: self.path.to_path_buf(),
                what: "not UTF-8 text (ends inside a character)".into(),
            });
        }
        self.advance(true, first, second)?;
        // A split point past every character boundary: the whole document is the first part.
        let rest = self.pending.len();
        self.emit(rest, first, second)?;
        Ok(self.in_second)
    }
}

/// The byte at which a lone document of `len` bytes is split: `ceil((1 − f) · len)`, at most
/// `len − 1` so that validation gets at least one byte.
pub(crate) fn lone_split_point(len: u64, fraction: f64) -> Option<u64> {
    if fraction <= 0.0 || len < 2 {
        return None;
    }
    let t = ((1.0 - fraction) * len as f64).ceil() as u64;
    Some(t.clamp(1, len - 1))
}

/// Writes one split's ids into shard files of at most `shard_tokens` tokens, hashing as it
/// goes.
struct ShardWriter {
    dir: PathBuf,
    split: &'static str,
    dtype: Dtype,
    shard_tokens: u64,
    open: Option<(BufWriter<File>, PathBuf, u64, u64)>,
    done: Vec<ShardRecord>,
    bytes: Vec<u8>,
}

impl ShardWriter {
    fn new(dir: &Path, split: &'static str, dtype: Dtype, shard_tokens: u64) -> Self {
        ShardWriter {
            dir: dir.to_path_buf(),
            split,
            dtype,
            shard_tokens,
            open: None,
            done: Vec::new(),
            bytes: Vec::new(),
        }
    }

    fn close(&mut self) -> Result<()> {
        if let Some((mut w, path, tokens, hash)) = self.open.take() {
            w.flush().map_err(|e| DataError::io("writing", &path, e))?;
            let f = w
                .into_inner()
                .map_err(|e| DataError::io("writing", &path, e.into_error()))?;
            f.sync_all()
                .map_err(|e| DataError::io("syncing", &path, e))?;
            let file = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            self.done.push(ShardRecord {
                file,
                tokens,
                fnv1a64: hash,
            });
        }
        Ok(())
    }

    fn finish(mut self, documents: u64) -> Result<SplitRecord> {
        self.close()?;
        let tokens = self.done.iter().map(|s| s.tokens).sum();
        Ok(SplitRecord {
            documents,
            tokens,
            shards: self.done,
        })
    }
}

impl Sink for ShardWriter {
    fn push(&mut self, mut ids: &[u32]) -> Result<()> {
        while !ids.is_empty() {
            if self.open.is_none() {
                let path = self
                    .dir
                    .join(format!("{}-{:05}.bin", self.split, self.done.len()));
                let f = File::create(&path).map_err(|e| DataError::io("creating", &path, e))?;
                self.open = Some((BufWriter::with_capacity(1 << 20, f), path, 0, FNV_BASIS));
            }
            let Some((w, path, tokens, hash)) = self.open.as_mut() else {
                unreachable!("a shard was just opened")
            };
            let room = usize::try_from(self.shard_tokens - *tokens).unwrap_or(usize::MAX);
            let (now, later) = ids.split_at(ids.len().min(room));
            self.bytes.clear();
            for &id in now {
                match self.dtype {
                    // The vocabulary fits u16 (Dtype::for_vocab), so the cast keeps the id.
                    Dtype::U16 => self.bytes.extend_from_slice(&(id as u16).to_le_bytes()),
                    Dtype::U32 => self.bytes.extend_from_slice(&id.to_le_bytes()),
                }
            }
            w.write_all(&self.bytes)
                .map_err(|e| DataError::io("writing", path.as_path(), e))?;
            *hash = fnv1a64_continue(*hash, &self.bytes);
            *tokens += now.len() as u64;
            ids = later;
            if *tokens == self.shard_tokens {
                self.close()?;
            }
        }
        Ok(())
    }
}

/// The split of each of `hashes.len()` documents (`true`: validation) for `fraction`: a
/// document goes to validation when `splitmix64(fnv1a64(its bytes)) / 2^64 < fraction`, so the
/// split depends on content only (equal documents land together). With a positive fraction
/// at least one document goes to validation (the smallest such value, the first of equals) and
/// at least one stays in train (the largest, the last of equals).
pub(crate) fn assign(hashes: &[u64], fraction: f64) -> Vec<bool> {
    let keys: Vec<u64> = hashes.iter().map(|&h| splitmix64(h)).collect();
    let mut val: Vec<bool> = keys
        .iter()
        .map(|&k| (k as f64) / 18_446_744_073_709_551_616.0 < fraction)
        .collect();
    if fraction > 0.0 && hashes.len() >= 2 {
        if !val.contains(&true) {
            let i = (0..keys.len()).min_by_key(|&i| (keys[i], i)).unwrap_or(0);
            val[i] = true;
        }
        if !val.contains(&false) {
            let i = (0..keys.len()).max_by_key(|&i| (keys[i], i)).unwrap_or(0);
            val[i] = false;
        }
    }
    val
}

pub(crate) fn check_options(tokenizer: Tokenizer, fraction: f64) -> Result<Dtype> {
    if !(0.0..1.0).contains(&fraction) {
        return Err(DataError::Invalid(format!(
            "validation fraction {fraction} is not in [0, 1)"
        )));
    }
    Ok(Dtype::for_vocab(tokenizer.vocab()))
}

/// Tokenizes `inputs` (each file one document) into `out_dir` (created if needed): shards
/// `train-NNNNN.bin` and `validation-NNNNN.bin` of at most `shard_tokens` ids each, then
/// `manifest.json`, which is written last (to a temporary name, synced, renamed), after any
/// old one is removed first: a failed prepare leaves no manifest.
///
/// - Inputs are refused before they are opened unless they are regular files (a FIFO,
///   `/dev/zero` or a directory never blocks or grows memory), and must be UTF-8.
/// - Every input is read twice, streaming: once to hash it (the split needs every hash), once
///   to tokenize it into its split, in the order given. Memory is bounded by the options, not
///   by the inputs: `read_bytes` + at most `max_pending_bytes` of text and its ids (4 bytes
///   each) + 1 MiB of write buffer, besides the GPT-2 vocabulary (about 30 MB once built).
/// - The split: see `assign` above — by a hash of each document's bytes at
///   `validation_fraction`, at least one document in each split; a lone document (one input)
///   is cut instead at the first line start at or after `ceil((1 − f) · bytes)`, the tail being
///   the validation document. `validation_fraction = 0` makes no validation split.
///
/// # Errors
/// [`DataError::Invalid`] for no inputs or bad options; [`DataError::NotAFile`] naming an input
/// that is not a regular file; [`DataError::Input`] naming one that is not UTF-8 (with the
/// offset) or lies inside `out_dir`; [`DataError::Io`] naming the file for any I/O failure.
pub fn prepare<P: AsRef<Path>>(
    inputs: &[P],
    out_dir: &Path,
    opts: &PrepareOptions,
) -> Result<Manifest> {
    if inputs.is_empty() {
        return Err(DataError::Invalid(
            "prepare needs at least one input file".into(),
        ));
    }
    let dtype = check_options(opts.tokenizer, opts.validation_fraction)?;
    if opts.shard_tokens == 0 || opts.read_bytes == 0 || opts.max_pending_bytes < opts.read_bytes {
        return Err(DataError::Invalid(format!(
            "shard tokens ({}) and read bytes ({}) must be positive and the pending-text bound \
             ({}) at least the read size",
            opts.shard_tokens, opts.read_bytes, opts.max_pending_bytes
        )));
    }
    let inputs: Vec<&Path> = inputs.iter().map(AsRef::as_ref).collect();
    // Every input is checked before anything is written.
    let mut lens = Vec::with_capacity(inputs.len());
    for p in &inputs {
        lens.push(regular_file_len(p)?);
    }
    fs::create_dir_all(out_dir).map_err(|e| DataError::io("creating", out_dir, e))?;
    let out_canon =
        fs::canonicalize(out_dir).map_err(|e| DataError::io("resolving", out_dir, e))?;
    for p in &inputs {
        let canon = fs::canonicalize(p).map_err(|e| DataError::io("resolving", *p, e))?;
        if canon.starts_with(&out_canon) {
            return Err(DataError::Input {
                path: p.to_path_buf(),
                what: format!("lies inside the output directory {}", out_dir.display()),
            });
        }
    }
    let manifest_path = out_dir.join(MANIFEST_FILE);
    match fs::symlink_metadata(&manifest_path) {
        Ok(_) => fs::remove_file(&manifest_path)
            .map_err(|e| DataError::io("removing the old", &manifest_path, e))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(DataError::io("reading the metadata of", &manifest_path, e)),
    }

    // Pass 1: hashes.
    let mut hashes = Vec::with_capacity(inputs.len());
    for (p, &len) in inputs.iter().zip(&lens) {
        let (mut f, len2) = open_regular(p)?;
        if len2 != len {
            return Err(DataError::Input {
                path: p.to_path_buf(),
                what: "changed size while being prepared".into(),
            });
        }
        hashes.push(stream(p, &mut f, len, opts.read_bytes, |_| Ok(()))?);
    }
    let lone = inputs.len() == 1;
    let to_val = if lone {
        vec![false]
    } else {
        assign(&hashes, opts.validation_fraction)
    };

    // Pass 2: tokens.
    let mut train = ShardWriter::new(out_dir, "train", dtype, opts.shard_tokens);
    let mut val = ShardWriter::new(out_dir, "validation", dtype, opts.shard_tokens);
    let (mut train_docs, mut val_docs) = (0u64, 0u64);
    let mut records = Vec::with_capacity(inputs.len());
    for (i, p) in inputs.iter().enumerate() {
        let (mut f, len) = open_regular(p)?;
        let split_at = if lone {
            lone_split_point(len, opts.validation_fraction)
        } else {
            None
        };
        let (first, second): (&mut dyn Sink, &mut dyn Sink) = if to_val[i] {
            (&mut val, &mut train)
        } else {
            (&mut train, &mut val)
        };
        let mut doc =
            DocTokenizer::new(opts.tokenizer, p, opts.max_pending_bytes, split_at, first)?;
        let hash = stream(p, &mut f, len, opts.read_bytes, |b| {
            doc.feed(b, first, second)
        })?;
        let both = doc.finish(first, second)?;
        if hash != hashes[i] {
            return Err(DataError::Input {
                path: p.to_path_buf(),
                what: "changed between the two passes of prepare".into(),
            });
        }
        let split = match (to_val[i], both) {
            (_, true) => {
                train_docs += 1;
                val_docs += 1;
                "both"
            }
            (true, false) => {
                val_docs += 1;
                "validation"
            }
            (false, false) => {
                train_docs += 1;
                "train"
            }
        };
        records.push(InputRecord {
            path: p.to_string_lossy().into_owned(),
            bytes: len,
            fnv1a64: hash,
            split: split.into(),
        });
    }
    let manifest = Manifest {
        tokenizer: opts.tokenizer,
        vocab: opts.tokenizer.vocab(),
        eot: opts.tokenizer.eot(),
        dtype,
        validation_fraction: opts.validation_fraction,
        shard_tokens: opts.shard_tokens,
        train: train.finish(train_docs)?,
        validation: val.finish(val_docs)?,
        inputs: records,
    };
    let tmp = out_dir.join(format!(".{MANIFEST_FILE}.{}.tmp", std::process::id()));
    let text = manifest.to_json().to_text();
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    };
    if let Err(e) = write() {
        let _ = fs::remove_file(&tmp);
        return Err(DataError::io("writing", &tmp, e));
    }
    fs::rename(&tmp, &manifest_path)
        .map_err(|e| DataError::io("renaming into place", &manifest_path, e))?;
    Ok(manifest)
}
