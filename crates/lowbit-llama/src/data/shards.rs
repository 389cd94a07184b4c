//! Reading prepared token data: [`TokenShards`] (a validated, memory-mapped shard directory, or
//! the same built in memory) and its [`Split`]s cut into windows.

use std::path::{Path, PathBuf};

use lowbit_io::hash::{fnv1a64, fnv1a64_continue};
use memmap2::Mmap;

use super::manifest::{Dtype, InputRecord, MANIFEST_FILE, Manifest, ShardRecord, SplitRecord};
use super::prepare::{DocTokenizer, FNV_BASIS, check_options, lone_split_point, open_regular};
use super::{DataError, Result, Tokenizer};

/// The most bytes a manifest may have (it lists files, not tokens).
const MAX_MANIFEST_BYTES: u64 = 64 << 20;

/// Which split.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SplitKind {
    /// The training split.
    Train,
    /// The validation split.
    Validation,
}

impl SplitKind {
    /// `train` or `validation`.
    pub fn name(self) -> &'static str {
        match self {
            SplitKind::Train => "train",
            SplitKind::Validation => "validation",
        }
    }
}

/// A shard's bytes: a read-only map of its file, or memory.
enum Bytes {
    Map(Mmap),
    Owned(Vec<u8>),
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Map(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// One split's token stream: its shards back to back.
pub struct Split {
    kind: SplitKind,
    dtype: Dtype,
    documents: u64,
    tokens: u64,
    shards: Vec<Bytes>,
    /// First stream position of each shard, and `tokens` at the end.
    starts: Vec<u64>,
    /// FNV-1a 64 of the whole stream's bytes (independent of how it is sharded).
    stream_hash: u64,
}

impl std::fmt::Debug for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Split")
            .field("kind", &self.kind)
            .field("documents", &self.documents)
            .field("tokens", &self.tokens)
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl Split {
    /// Which split this is.
    pub fn kind(&self) -> SplitKind {
        self.kind
    }
    /// Documents in the split.
    pub fn documents(&self) -> u64 {
        self.documents
    }
    /// Tokens in the split (end-of-text ids included).
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Non-overlapping windows of `seq + 1` tokens: window `w` is stream positions
    /// `w·(seq + 1) .. (w + 1)·(seq + 1)`; the tail shorter than a window is never read.
    pub fn windows(&self, seq: usize) -> u64 {
        self.tokens / (seq as u64 + 1)
    }

    /// The ids at stream positions `start .. start + out.len()`, across shard boundaries.
    ///
    /// # Errors
    /// [`DataError::Invalid`] if that runs past the end of the split.
    pub fn read(&self, start: u64, out: &mut [u32]) -> Result<()> {
        let end = start
            .checked_add(out.len() as u64)
            .filter(|&e| e <= self.tokens);
        if end.is_none() {
            return Err(DataError::Invalid(format!(
                "{} split: tokens {start}..{}+{} past its end ({} tokens)",
                self.kind.name(),
                start,
                out.len(),
                self.tokens
            )));
        }
        let w = self.dtype.width();
        let mut pos = start;
        let mut done = 0;
        // The last shard starting at or before `pos`.
        let mut s = self
            .starts
            .partition_point(|&st| st <= pos)
            .saturating_sub(1);
        while done < out.len() {
            let in_shard = (pos - self.starts[s]) as usize;
            let avail = (self.starts[s + 1] - pos) as usize;
            let n = avail.min(out.len() - done);
            let bytes = &self.shards[s].as_slice()[in_shard * w..(in_shard + n) * w];
            for (o, c) in out[done..done + n].iter_mut().zip(bytes.chunks_exact(w)) {
                *o = match self.dtype {
                    Dtype::U16 => u32::from(u16::from_le_bytes([c[0], c[1]])),
                    Dtype::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                };
            }
            done += n;
            pos += n as u64;
            s += 1;
        }
        Ok(())
    }

    /// Window `w` of `seq + 1` tokens (see [`Split::windows`]) into `out` (length `seq + 1`):
    /// the inputs are `out[..seq]`, the targets `out[1..]`.
    ///
    /// # Errors
    /// [`DataError::Invalid`] if `out` is not `seq + 1` long or `w` is not below
    /// [`Split::windows`].
    pub fn window(&self, seq: usize, w: u64, out: &mut [u32]) -> Result<()> {
        if out.len() != seq + 1 || w >= self.windows(seq) {
            return Err(DataError::Invalid(format!(
                "{} split: window {w} of {} tokens into {} slots (it has {} windows of seq {seq})",
                self.kind.name(),
                seq + 1,
                out.len(),
                self.windows(seq)
            )));
        }
        self.read(w * (seq as u64 + 1), out)
    }

    /// A batch in the device's convention (ids as f32 holding integers): for each of `windows`
    /// in order, its first `seq` ids into `inputs` and its last `seq` into `targets`; both are
    /// `windows.len() · seq` long.
    ///
    /// # Errors
    /// [`DataError::Invalid`] for wrong lengths or a window out of range.
    pub fn batch_f32(
        &self,
        seq: usize,
        windows: &[u64],
        inputs: &mut [f32],
        targets: &mut [f32],
    ) -> Result<()> {
        let rows = windows.len() * seq;
        if inputs.len() != rows || targets.len() != rows {
            return Err(DataError::Invalid(format!(
                "batch of {} windows of seq {seq} needs {rows} inputs and targets, got {} and {}",
                windows.len(),
                inputs.len(),
                targets.len()
            )));
        }
        let mut buf = vec![0u32; seq + 1];
        for (b, &w) in windows.iter().enumerate() {
            self.window(seq, w, &mut buf)?;
            // Ids are below 2^24 (the vocabularies are), so f32 holds them exactly.
            for i in 0..seq {
                inputs[b * seq + i] = buf[i] as f32;
                targets[b * seq + i] = buf[i + 1] as f32;
            }
        }
        Ok(())
    }

    /// Builds a split from its shards' bytes, checking each against its record: ids below
    /// `vocab` and exactly `documents` end-of-text ids, the first id end-of-text.
    fn build(
        kind: SplitKind,
        rec: &SplitRecord,
        dtype: Dtype,
        tok: Tokenizer,
        shards: Vec<(Bytes, PathBuf)>,
    ) -> Result<Split> {
        let mut starts = Vec::with_capacity(shards.len() + 1);
        let mut pos = 0u64;
        let mut stream_hash = FNV_BASIS;
        let mut eots = 0u64;
        let mut out = Vec::with_capacity(shards.len());
        for ((bytes, path), r) in shards.into_iter().zip(&rec.shards) {
            let b = bytes.as_slice();
            let h = fnv1a64(b);
            if h != r.fnv1a64 {
                return Err(DataError::Shard {
                    path,
                    what: format!(
                        "FNV-1a 64 is {h:016x}, the manifest says {:016x} (corrupt, or not this \
                         manifest's shard)",
                        r.fnv1a64
                    ),
                });
            }
            stream_hash = fnv1a64_continue(stream_hash, b);
            for (i, c) in b.chunks_exact(dtype.width()).enumerate() {
                let id = match dtype {
                    Dtype::U16 => u32::from(u16::from_le_bytes([c[0], c[1]])),
                    Dtype::U32 => u32::from_le_bytes([c[0], c[1], c[2], c[3]]),
                };
                if id >= tok.vocab() {
                    return Err(DataError::Shard {
                        path,
                        what: format!(
                            "token {i} is id {id}, not below the {tok} vocabulary {}",
                            tok.vocab()
                        ),
                    });
                }
                if pos == 0 && i == 0 && id != tok.eot() {
                    return Err(DataError::Shard {
                        path,
                        what: format!(
                            "the {} split starts with id {id}, not end-of-text {}",
                            kind.name(),
                            tok.eot()
                        ),
                    });
                }
                eots += u64::from(id == tok.eot());
            }
            starts.push(pos);
            pos += r.tokens;
            out.push(bytes);
        }
        starts.push(pos);
        if eots != rec.documents {
            return Err(DataError::Invalid(format!(
                "{} split: {eots} end-of-text ids but {} documents in the manifest",
                kind.name(),
                rec.documents
            )));
        }
        Ok(Split {
            kind,
            dtype,
            documents: rec.documents,
            tokens: rec.tokens,
            shards: out,
            starts,
            stream_hash,
        })
    }
}

/// Prepared token data: the manifest and both splits.
#[derive(Debug)]
pub struct TokenShards {
    manifest: Manifest,
    dir: Option<PathBuf>,
    train: Split,
    validation: Split,
    fingerprint: u64,
}

/// Maps (or, when empty, holds) one shard file after checking it is a regular file of
/// `tokens × width` bytes.
fn map_shard(dir: &Path, rec: &ShardRecord, dtype: Dtype) -> Result<(Bytes, PathBuf)> {
    let path = dir.join(&rec.file);
    let expect = rec.tokens.checked_mul(dtype.width() as u64);
    let (file, len) = open_regular(&path).map_err(|e| match e {
        DataError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            DataError::Shard {
                path: path.clone(),
                what: "is listed in the manifest but missing".into(),
            }
        }
        e => e,
    })?;
    if Some(len) != expect {
        return Err(DataError::Shard {
            path,
            what: format!(
                "is {len} bytes, the manifest's {} tokens × {} bytes ({}) need {} (truncated or \
                 grown)",
                rec.tokens,
                dtype.width(),
                dtype.name(),
                expect.map_or("more than u64".to_string(), |e| e.to_string())
            ),
        });
    }
    if len == 0 {
        return Ok((Bytes::Owned(Vec::new()), path));
    }
    // SAFETY: the map is read-only and private to this process; the format's contract is that
    // prepared shards are immutable once their manifest exists (prepare writes them before the
    // manifest and never again). A file truncated by another process while mapped would fault
    // on access (SIGBUS), as for any mapped file; its contents are verified against the hash
    // just below, before any use.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io("memory-mapping", &path, e))?;
    Ok((Bytes::Map(map), path))
}

impl TokenShards {
    /// Opens a directory written by [`super::prepare`]: reads `manifest.json` (a regular file
    /// of at most 64 MiB) and validates it strictly (see [`Manifest::parse`]), then maps every
    /// shard and checks its size, its hash, every id against the vocabulary and the documents'
    /// end-of-text ids. The whole data is read once here (its pages stay in the page cache, not
    /// in this process's memory).
    ///
    /// # Errors
    /// Typed errors naming the file: [`DataError::NotAFile`], [`DataError::Io`],
    /// [`DataError::Json`], [`DataError::Manifest`], [`DataError::Shard`].
    pub fn open(dir: &Path) -> Result<TokenShards> {
        let mpath = dir.join(MANIFEST_FILE);
        let (mut f, len) = open_regular(&mpath)?;
        if len > MAX_MANIFEST_BYTES {
            return Err(DataError::Manifest {
                path: mpath,
                what: format!("is {len} bytes, more than a manifest's {MAX_MANIFEST_BYTES}"),
            });
        }
        let mut text = String::new();
        std::io::Read::read_to_string(&mut f, &mut text).map_err(|e| DataError::Manifest {
            path: mpath.clone(),
            what: format!("cannot be read as UTF-8 text: {e}"),
        })?;
        let manifest = Manifest::parse(&text, &mpath)?;
        let mut seen = std::collections::HashSet::new();
        for r in manifest
            .train
            .shards
            .iter()
            .chain(&manifest.validation.shards)
        {
            if !seen.insert(r.file.as_str()) {
                return Err(DataError::Manifest {
                    path: mpath,
                    what: format!("shard file {:?} is listed twice", r.file),
                });
            }
        }
        let map = |rec: &SplitRecord| -> Result<Vec<(Bytes, PathBuf)>> {
            rec.shards
                .iter()
                .map(|r| map_shard(dir, r, manifest.dtype))
                .collect()
        };
        let train = Split::build(
            SplitKind::Train,
            &manifest.train,
            manifest.dtype,
            manifest.tokenizer,
            map(&manifest.train)?,
        )
        .map_err(|e| in_manifest(e, &mpath))?;
        let validation = Split::build(
            SplitKind::Validation,
            &manifest.validation,
            manifest.dtype,
            manifest.tokenizer,
            map(&manifest.validation)?,
        )
        .map_err(|e| in_manifest(e, &mpath))?;
        Ok(TokenShards::assemble(
            manifest,
            Some(dir.to_path_buf()),
            train,
            validation,
        ))
    }

    /// The same as preparing one file holding `text` and opening the result, in memory: one
    /// document, split as [`super::prepare`] splits a lone document at `validation_fraction`
    /// (the fingerprint equals that of the prepared directory).
    ///
    /// # Errors
    /// [`DataError::Invalid`] for a fraction outside `[0, 1)`.
    pub fn from_text(
        text: &str,
        tokenizer: Tokenizer,
        validation_fraction: f64,
    ) -> Result<TokenShards> {
        let dtype = check_options(tokenizer, validation_fraction)?;
        let split_at = lone_split_point(text.len() as u64, validation_fraction);
        let (mut first, mut second) = (Vec::new(), Vec::new());
        let name = Path::new("<text>");
        let mut doc = DocTokenizer::new(tokenizer, name, usize::MAX, split_at, &mut first)?;
        doc.feed(text.as_bytes(), &mut first, &mut second)?;
        let both = doc.finish(&mut first, &mut second)?;
        let encode = |ids: &[u32]| -> Vec<u8> {
            let mut out = Vec::with_capacity(ids.len() * dtype.width());
            for &id in ids {
                match dtype {
                    // Dtype::for_vocab chose u16 only for ids that fit.
                    Dtype::U16 => out.extend_from_slice(&(id as u16).to_le_bytes()),
                    Dtype::U32 => out.extend_from_slice(&id.to_le_bytes()),
                }
            }
            out
        };
        let record = |name: &str, ids: &[u32], bytes: &[u8], docs: u64| SplitRecord {
            documents: docs,
            tokens: ids.len() as u64,
            shards: if ids.is_empty() {
                Vec::new()
            } else {
                vec![ShardRecord {
                    file: format!("{name}-00000.bin"),
                    tokens: ids.len() as u64,
                    fnv1a64: fnv1a64(bytes),
                }]
            },
        };
        let (b1, b2) = (encode(&first), encode(&second));
        let manifest = Manifest {
            tokenizer,
            vocab: tokenizer.vocab(),
            eot: tokenizer.eot(),
            dtype,
            validation_fraction,
            shard_tokens: (first.len().max(second.len()).max(1)) as u64,
            train: record("train", &first, &b1, 1),
            validation: record("validation", &second, &b2, u64::from(both)),
            inputs: vec![InputRecord {
                path: name.display().to_string(),
                bytes: text.len() as u64,
                fnv1a64: fnv1a64(text.as_bytes()),
                split: if both { "both" } else { "train" }.into(),
            }],
        };
        let owned = |b: Vec<u8>| {
            if b.is_empty() {
                Vec::new()
            } else {
                vec![(Bytes::Owned(b), PathBuf::from(name))]
            }
        };
        let train = Split::build(
            SplitKind::Train,
            &manifest.train,
            dtype,
            tokenizer,
            owned(b1),
        )?;
        let validation = Split::build(
            SplitKind::Validation,
            &manifest.validation,
            dtype,
            tokenizer,
            owned(b2),
        )?;
        Ok(TokenShards::assemble(manifest, None, train, validation))
    }

    fn assemble(
        manifest: Manifest,
        dir: Option<PathBuf>,
        train: Split,
        validation: Split,
    ) -> TokenShards {
        // The token streams and their tokenizer, not file names, paths or shard sizes.
        let canon = format!(
            "{} {} {} train {} {} {:016x} validation {} {} {:016x}",
            manifest.tokenizer.name(),
            manifest.vocab,
            manifest.dtype.name(),
            train.documents,
            train.tokens,
            train.stream_hash,
            validation.documents,
            validation.tokens,
            validation.stream_hash,
        );
        TokenShards {
            fingerprint: fnv1a64(canon.as_bytes()),
            manifest,
            dir,
            train,
            validation,
        }
    }

    /// The manifest (for [`TokenShards::from_text`], the one `prepare` would have written, its
    /// input named `<text>`).
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }
    /// The directory opened, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }
    /// The tokenizer of the ids.
    pub fn tokenizer(&self) -> Tokenizer {
        self.manifest.tokenizer
    }
    /// Every id is below it.
    pub fn vocab(&self) -> u32 {
        self.manifest.vocab
    }
    /// The training split.
    pub fn train(&self) -> &Split {
        &self.train
    }
    /// The validation split (no tokens when prepared with fraction 0).
    pub fn validation(&self) -> &Split {
        &self.validation
    }
    /// The split `kind`.
    pub fn split(&self, kind: SplitKind) -> &Split {
        match kind {
            SplitKind::Train => &self.train,
            SplitKind::Validation => &self.validation,
        }
    }
    /// A content fingerprint: FNV-1a 64 of the tokenizer, the dtype and each split's document
    /// and token counts and stream hash (FNV-1a 64 of its shards' bytes back to back). Equal
    /// token streams give equal fingerprints however they are sharded or named, so a resume
    /// can refuse different data.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// Errors about a split's counts are about the manifest's claims.
fn in_manifest(e: DataError, mpath: &Path) -> DataError {
    match e {
        DataError::Invalid(what) => DataError::Manifest {
            path: mpath.to_path_buf(),
            what,
        },
        e => e,
    }
}
