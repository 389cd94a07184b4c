//! Saving: every rank writes its own pieces, rank 0 writes the manifest and commits.

use std::collections::{BTreeMap, HashSet};
use std::fs::{self, File};
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};

use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_io::json::Json;
use lowbit_layout::ParamSpec;
use lowbit_optim::{Optimizer, OptimizerState, StateViews};

use crate::error::{CkptError, Result, io};
use crate::manifest::{
    DTYPE_F32, FileEntry, Manifest, Meta, OptimizerEntry, Piece, TensorEntry, obj,
};
use crate::write::{OutPiece, Source, write_file};

/// The file holding the `latest` pointer (the name of the newest committed `step-N`).
pub const LATEST: &str = "latest";
/// The manifest's file name.
pub const MANIFEST: &str = "manifest.json";

/// How a save commits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// Keep only the newest `K` committed checkpoints (`None`: keep all). `Some(0)` is treated
    /// as 1: the one just written is never pruned.
    pub keep: Option<usize>,
}

/// `step-N`.
pub fn step_dir_name(step: u64) -> String {
    format!("step-{step}")
}

fn tmp_dir_name(step: u64) -> String {
    format!(".tmp-step-{step}")
}

fn rank_file(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

fn index_file(rank: usize) -> String {
    format!("rank-{rank:05}.index.json")
}

/// Writes `bytes` to `path` (created exclusively) and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(path)
        .map_err(io("create", path))?;
    f.write_all(bytes).map_err(io("write", path))?;
    f.sync_all().map_err(io("fsync", path))
}

/// fsyncs a directory (its entries: creations, renames, removals).
fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(io("fsync directory", path))
}

/// Saves a checkpoint of `opt`'s state after step `meta.step` under `root` (collective: every
/// rank of `comm` calls it with the same `root`, `meta` and `specs`).
///
/// Each rank writes `rank-R.safetensors` with its own pieces (masters and state, named
/// `{parameter}/{state}@{start}`) into `root/.tmp-step-N` and fsyncs it; after a barrier rank 0
/// writes `manifest.json`, fsyncs it and the directory, renames the directory to `step-N`,
/// fsyncs `root`, then replaces `latest` (temp file + rename + fsync) and prunes to
/// [`SaveOptions::keep`]. Another barrier ends the save, so no rank returns before the commit.
/// Low-precision weights are not stored: they are `Q(bf16(master))`. A rank that fails still
/// takes part in every barrier (no rank is left waiting), and rank 0 commits only when every
/// rank's files are there with the sizes their indexes record. [`crate::AsyncSaver`] is the
/// same save with the writing moved off the training thread.
///
/// # Errors
/// [`CkptError::Exists`] if `step-N` is committed already (on every rank, before anything is
/// written); I/O, optimizer and collective errors; on ranks other than 0, an I/O error when rank
/// 0 did not commit (its own error says why).
pub fn save(
    dev: &Device,
    comm: &mut dyn Communicator,
    root: &Path,
    meta: &Meta,
    specs: &[ParamSpec],
    opt: &dyn Optimizer,
    options: SaveOptions,
) -> Result<PathBuf> {
    let target = Target::new(comm, root, meta, specs, options)?;
    let written = match opt.state_views() {
        // Streamed from the device: no host copy of the whole state.
        Some(views) => target
            .ready(comm, Ok(()))?
            .and_then(|()| target.write_views(dev, &views)),
        None => target
            .begin(dev, comm, opt, Vec::new())?
            .and_then(|s| target.write(&s)),
    };
    target.finish(comm, written)
}

/// One save in progress: where it writes and commits, and what the manifest records. Shared by
/// [`save()`] and [`crate::AsyncSaver`]: [`Target::begin`] and [`Target::finish`] are the
/// collective parts, [`Target::write`] the rank's own I/O (no collective, so it may run on any
/// thread).
#[derive(Debug)]
pub(crate) struct Target {
    root: PathBuf,
    tmp: PathBuf,
    final_dir: PathBuf,
    rank: usize,
    size: usize,
    meta: Meta,
    specs: Vec<ParamSpec>,
    options: SaveOptions,
}

impl Target {
    /// A save of `meta.step` under `root` by `comm`'s ranks.
    ///
    /// # Errors
    /// [`CkptError::Exists`] if `step-N` is committed already (every rank sees the same
    /// directory, and nothing collective has happened yet).
    pub(crate) fn new(
        comm: &dyn Communicator,
        root: &Path,
        meta: &Meta,
        specs: &[ParamSpec],
        options: SaveOptions,
    ) -> Result<Target> {
        let final_dir = root.join(step_dir_name(meta.step));
        if final_dir.exists() {
            return Err(CkptError::Exists(final_dir));
        }
        Ok(Target {
            root: root.to_path_buf(),
            tmp: root.join(tmp_dir_name(meta.step)),
            final_dir,
            rank: comm.rank(),
            size: comm.size(),
            meta: meta.clone(),
            specs: specs.to_vec(),
            options,
        })
    }

    /// The synchronous start (collective): snapshots the optimizer's state to the host (into
    /// `spare`'s buffers where they fit: a previous snapshot's), rank 0 prepares the temp
    /// directory, then a barrier (nobody writes into a directory that is not there yet). A
    /// local failure (the snapshot, rank 0's directory) is the inner error, handed on so that
    /// the rank still joins the barriers of [`Target::finish`].
    ///
    /// # Errors
    /// Collective errors.
    pub(crate) fn begin(
        &self,
        dev: &Device,
        comm: &mut dyn Communicator,
        opt: &dyn Optimizer,
        mut spare: Vec<OptimizerState>,
    ) -> Result<Result<Vec<OptimizerState>>> {
        let state = opt
            .export_state_into(dev, &mut spare)
            .map(|()| spare)
            .map_err(CkptError::from);
        self.ready(comm, state)
    }

    /// Rank 0 prepares the temp directory, then a barrier (nobody writes into a directory that
    /// is not there yet). `local` (a snapshot, or nothing) is handed on, failed if rank 0's
    /// directory failed, so that the rank still joins the barriers of [`Target::finish`].
    ///
    /// # Errors
    /// Collective errors.
    pub(crate) fn ready<T>(
        &self,
        comm: &mut dyn Communicator,
        mut local: Result<T>,
    ) -> Result<Result<T>> {
        if self.rank == 0
            && let Err(e) = self.prepare_tmp()
        {
            local = Err(e);
        }
        comm.barrier()?;
        Ok(local)
    }

    /// Rank 0: a fresh, empty temp directory.
    fn prepare_tmp(&self) -> Result<()> {
        fs::create_dir_all(&self.root).map_err(io("create directory", &self.root))?;
        // A directory of this name is what a crashed save of this step left: never committed,
        // so nothing can load it. Start over.
        if self.tmp.exists() {
            fs::remove_dir_all(&self.tmp).map_err(io("remove stale temp directory", &self.tmp))?;
        }
        fs::create_dir(&self.tmp).map_err(io("create directory", &self.tmp))
    }

    /// This rank's files, durable (no collective).
    pub(crate) fn write(&self, state: &[OptimizerState]) -> Result<()> {
        let (leaves, pieces) = snapshot_pieces(&self.tmp, &self.specs, state)?;
        write_rank(&self.tmp, self.rank, &leaves, &pieces, None)
    }

    /// This rank's files, streamed from the optimizer's device views (no collective; the
    /// calling thread owns `dev`).
    fn write_views(&self, dev: &Device, state: &[StateViews]) -> Result<()> {
        let (leaves, pieces) = view_pieces(&self.tmp, &self.specs, state)?;
        write_rank(&self.tmp, self.rank, &leaves, &pieces, Some(dev))
    }

    /// The collective end: a barrier (every rank's files are written or failed), rank 0 commits
    /// if its own write succeeded (the commit refuses a rank whose index is missing), a barrier
    /// (nobody returns before the commit). Every rank reaches both barriers whatever failed
    /// locally. Ranks other than 0 then check that `latest` names this step, so a commit that
    /// failed is an error on every rank.
    pub(crate) fn finish(
        &self,
        comm: &mut dyn Communicator,
        written: Result<()>,
    ) -> Result<PathBuf> {
        comm.barrier()?;
        let committed = if self.rank == 0 && written.is_ok() {
            commit(
                &self.root,
                &self.tmp,
                &self.final_dir,
                self.size,
                &self.meta,
                &self.specs,
                self.options,
            )
        } else {
            Ok(())
        };
        comm.barrier()?;
        // A failed save leaves nothing behind: its temp directory would hold the disk's space
        // (on a full disk no later save, with `--keep 1` no resume, could make progress). After
        // the second barrier no rank writes into it any more; a commit that got as far as the
        // rename has no temp directory left, so this removes nothing committed.
        if self.rank == 0 && (written.is_err() || committed.is_err()) && self.tmp.exists() {
            let _ = fs::remove_dir_all(&self.tmp);
        }
        written?;
        committed?;
        if self.rank != 0 {
            self.check_committed()?;
        }
        Ok(self.final_dir.clone())
    }

    fn check_committed(&self) -> Result<()> {
        let latest = self.root.join(LATEST);
        let name = step_dir_name(self.meta.step);
        let named = fs::read_to_string(&latest).is_ok_and(|t| t.trim() == name);
        if named && self.final_dir.join(MANIFEST).is_file() {
            return Ok(());
        }
        Err(CkptError::Io {
            op: "find the checkpoint rank 0 commits",
            path: self.final_dir.clone(),
            source: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "rank 0 did not commit it (its error says why)",
            ),
        })
    }

    /// The step being saved.
    pub(crate) fn step(&self) -> u64 {
        self.meta.step
    }

    /// The temp directory (named in errors of the background writer).
    pub(crate) fn tmp(&self) -> &Path {
        &self.tmp
    }
}

/// One leaf optimizer as a rank index records it.
struct LeafEntry<'a> {
    owner: u32,
    rule: &'a str,
    steps: u64,
}

impl<'a> LeafEntry<'a> {
    fn new(owner: u32, rule: &'a str, steps: u64) -> Self {
        LeafEntry { owner, rule, steps }
    }
}

/// The pieces of a host snapshot.
fn snapshot_pieces<'a>(
    tmp: &Path,
    specs: &'a [ParamSpec],
    state: &'a [OptimizerState],
) -> Result<(Vec<LeafEntry<'a>>, Vec<OutPiece<'a>>)> {
    rank_pieces(
        tmp,
        specs,
        state.iter().map(|st| {
            let tensors = st.tensors.iter().map(|t| {
                let source = Source::Host(&t.values);
                (t.param, t.name.as_str(), t.range.clone(), source)
            });
            (LeafEntry::new(st.owner.0, &st.rule, st.steps), tensors)
        }),
    )
}

/// The pieces of an optimizer's device views.
fn view_pieces<'a>(
    tmp: &Path,
    specs: &'a [ParamSpec],
    state: &'a [StateViews],
) -> Result<(Vec<LeafEntry<'a>>, Vec<OutPiece<'a>>)> {
    rank_pieces(
        tmp,
        specs,
        state.iter().map(|st| {
            let tensors = st.tensors.iter().map(|t| {
                let source = Source::Device(t.view);
                (t.param, t.name.as_str(), t.range.clone(), source)
            });
            (LeafEntry::new(st.owner.0, &st.rule, st.steps), tensors)
        }),
    )
}

/// A rank's leaf optimizers and their pieces `(parameter, state name, range, values)`, checked
/// as [`Pieces::add`] does.
fn rank_pieces<'a, T>(
    tmp: &Path,
    specs: &'a [ParamSpec],
    leaves: impl Iterator<Item = (LeafEntry<'a>, T)>,
) -> Result<(Vec<LeafEntry<'a>>, Vec<OutPiece<'a>>)>
where
    T: Iterator<Item = (usize, &'a str, Range<usize>, Source<'a>)>,
{
    let mut pieces = Pieces::new(tmp, specs);
    let mut entries = Vec::new();
    for (leaf, tensors) in leaves {
        for (param, state, range, source) in tensors {
            pieces.add(leaf.owner, param, state, range, source)?;
        }
        entries.push(leaf);
    }
    Ok((entries, pieces.out))
}

/// A rank's pieces, checked as they are added (parameter known, range inside it, values
/// matching the range, keys unique); empty pieces are left out.
struct Pieces<'a, 't> {
    tmp: &'t Path,
    specs: &'a [ParamSpec],
    keys: HashSet<String>,
    out: Vec<OutPiece<'a>>,
}

impl<'a, 't> Pieces<'a, 't> {
    fn new(tmp: &'t Path, specs: &'a [ParamSpec]) -> Self {
        Pieces {
            tmp,
            specs,
            keys: HashSet::new(),
            out: Vec::new(),
        }
    }

    fn add(
        &mut self,
        owner: u32,
        param: usize,
        state: &'a str,
        range: Range<usize>,
        source: Source<'a>,
    ) -> Result<()> {
        let mismatch = |msg: String| CkptError::Mismatch {
            dir: self.tmp.to_path_buf(),
            msg,
        };
        let spec = self.specs.get(param).ok_or_else(|| {
            mismatch(format!(
                "state for parameter {param} of {}",
                self.specs.len()
            ))
        })?;
        if range.end > spec.numel || source.len() != range.len() {
            return Err(mismatch(format!(
                "`{}` piece {range:?} of {} values for {} elements",
                spec.name,
                source.len(),
                spec.numel
            )));
        }
        if source.len() == 0 {
            return Ok(());
        }
        let key = format!("{}/{state}@{}", spec.name, range.start);
        if !self.keys.insert(key.clone()) {
            return Err(mismatch(format!("duplicate piece `{key}`")));
        }
        self.out.push(OutPiece {
            key,
            param: &spec.name,
            state,
            owner,
            range,
            source,
        });
        Ok(())
    }
}

/// One rank's pieces: the safetensors file and an index of its pieces for rank 0 (written
/// last: its presence says the data file is durable).
fn write_rank(
    tmp: &Path,
    rank: usize,
    leaves: &[LeafEntry<'_>],
    pieces: &[OutPiece<'_>],
    dev: Option<&Device>,
) -> Result<()> {
    let file = rank_file(rank);
    let written = write_file(&tmp.join(&file), rank, pieces, dev)?;
    let mut entries = Vec::new();
    for ((p, hash), offset) in pieces.iter().zip(written.hashes).zip(written.offsets) {
        entries.push(obj(vec![
            ("key", Json::Str(p.key.clone())),
            ("param", Json::Str(p.param.to_string())),
            ("state", Json::Str(p.state.to_string())),
            ("owner", Json::UInt(u64::from(p.owner))),
            ("start", Json::UInt(p.range.start as u64)),
            ("end", Json::UInt(p.range.end as u64)),
            ("offset", Json::UInt(offset)),
            ("fnv1a64", Json::Str(format!("{hash:016x}"))),
        ]));
    }
    let optimizers = leaves
        .iter()
        .map(|s| {
            obj(vec![
                ("owner", Json::UInt(u64::from(s.owner))),
                ("rule", Json::Str(s.rule.to_string())),
                ("steps", Json::UInt(s.steps)),
            ])
        })
        .collect();
    let index = obj(vec![
        ("file", Json::Str(file)),
        ("bytes", Json::UInt(written.bytes)),
        ("optimizers", Json::Arr(optimizers)),
        ("pieces", Json::Arr(entries)),
    ]);
    write_synced(&tmp.join(index_file(rank)), index.to_text().as_bytes())
}

/// Rank 0: merges the rank indexes into the manifest, validates it, commits.
fn commit(
    root: &Path,
    tmp: &Path,
    final_dir: &Path,
    size: usize,
    meta: &Meta,
    specs: &[ParamSpec],
    options: SaveOptions,
) -> Result<()> {
    let bad = |file: &Path, msg: String| CkptError::Manifest {
        file: file.to_path_buf(),
        msg,
    };
    let mut optimizers: BTreeMap<u32, OptimizerEntry> = BTreeMap::new();
    let mut files = Vec::new();
    // (param index, state order of first appearance) → tensor.
    let mut tensors: BTreeMap<(usize, usize, String), TensorEntry> = BTreeMap::new();
    let mut state_order: Vec<String> = Vec::new();
    let by_name: BTreeMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(i, s)| (s.name.as_str(), i))
        .collect();
    for r in 0..size {
        let path = tmp.join(index_file(r));
        let text = fs::read_to_string(&path).map_err(io("read", &path))?;
        let v = Json::parse(&text).map_err(|e| bad(&path, e.to_string()))?;
        let get_u = |v: &Json, k: &str| match v.member(k) {
            Some(Json::UInt(n)) => Ok(*n),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let get_s = |v: &Json, k: &str| match v.member(k) {
            Some(Json::Str(s)) => Ok(s.clone()),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let get_a = |v: &Json, k: &str| match v.member(k) {
            Some(Json::Arr(a)) => Ok(a.clone()),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let file = get_s(&v, "file")?;
        let bytes = get_u(&v, "bytes")?;
        // The data file must be what its rank wrote (the rank may be another process).
        let data = tmp.join(&file);
        let actual = fs::metadata(&data).map_err(io("stat", &data))?.len();
        if actual != bytes {
            return Err(CkptError::FileSize {
                file: data,
                expected: bytes,
                actual,
            });
        }
        files.push(FileEntry {
            name: file.clone(),
            bytes,
        });
        for o in get_a(&v, "optimizers")? {
            let e = OptimizerEntry {
                owner: u32::try_from(get_u(&o, "owner")?)
                    .map_err(|_| bad(&path, "owner".into()))?,
                rule: get_s(&o, "rule")?,
                steps: get_u(&o, "steps")?,
            };
            match optimizers.get(&e.owner) {
                Some(prev) if *prev != e => {
                    return Err(bad(
                        &path,
                        format!("ranks disagree on optimizer {}: {prev:?} vs {e:?}", e.owner),
                    ));
                }
                _ => {
                    optimizers.insert(e.owner, e);
                }
            }
        }
        for p in get_a(&v, "pieces")? {
            let param = get_s(&p, "param")?;
            let st = get_s(&p, "state")?;
            let &pi = by_name
                .get(param.as_str())
                .ok_or_else(|| bad(&path, format!("unknown parameter `{param}`")))?;
            let so = match state_order.iter().position(|s| *s == st) {
                Some(i) => i,
                None => {
                    state_order.push(st.clone());
                    state_order.len() - 1
                }
            };
            let hash = u64::from_str_radix(&get_s(&p, "fnv1a64")?, 16)
                .map_err(|_| bad(&path, "hash".into()))?;
            let piece = Piece {
                file: file.clone(),
                key: get_s(&p, "key")?,
                start: get_u(&p, "start")?,
                end: get_u(&p, "end")?,
                offset: get_u(&p, "offset")?,
                hash,
            };
            let owner =
                u32::try_from(get_u(&p, "owner")?).map_err(|_| bad(&path, "owner".into()))?;
            let t = tensors
                .entry((pi, so, st.clone()))
                .or_insert_with(|| TensorEntry {
                    name: format!("{param}/{st}"),
                    param: param.clone(),
                    state: st.clone(),
                    owner,
                    shape: specs[pi].shape.iter().map(|&d| d as u64).collect(),
                    dtype: DTYPE_F32.to_string(),
                    pieces: Vec::new(),
                });
            // Replicated ownership: every rank holds every piece; keep the first copy.
            if !t
                .pieces
                .iter()
                .any(|q| q.start == piece.start && q.end == piece.end && q.hash == piece.hash)
            {
                t.pieces.push(piece);
            }
        }
    }
    let mut manifest = Manifest {
        meta: meta.clone(),
        optimizers: optimizers.into_values().collect(),
        files,
        tensors: tensors.into_values().collect(),
    };
    for t in &mut manifest.tensors {
        t.pieces.sort_by_key(|p| p.start);
    }
    let text = manifest.to_json().to_text();
    let mpath = tmp.join(MANIFEST);
    // What is written must be what a loader accepts: coverage, ranges, names.
    Manifest::from_text(&text).map_err(|e| {
        bad(
            &mpath,
            match e {
                Ok(v) => format!("version {v}"),
                Err(m) => m,
            },
        )
    })?;
    write_synced(&mpath, text.as_bytes())?;
    for r in 0..size {
        let p = tmp.join(index_file(r));
        fs::remove_file(&p).map_err(io("remove", &p))?;
    }
    sync_dir(tmp)?;
    fs::rename(tmp, final_dir).map_err(io("rename into place", final_dir))?;
    sync_dir(root)?;
    let name = final_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string();
    let latest_tmp = root.join(format!(".{LATEST}.tmp"));
    if latest_tmp.exists() {
        fs::remove_file(&latest_tmp).map_err(io("remove", &latest_tmp))?;
    }
    write_synced(&latest_tmp, format!("{name}\n").as_bytes())?;
    let latest = root.join(LATEST);
    fs::rename(&latest_tmp, &latest).map_err(io("rename into place", &latest))?;
    sync_dir(root)?;
    if let Some(keep) = options.keep {
        prune(root, keep.max(1), &name)?;
    }
    Ok(())
}

/// The step of a `step-N` name.
pub(crate) fn parse_step_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Removes all but the newest `keep` committed `step-N` directories (never `current`).
///
/// # Errors
/// I/O errors.
pub fn prune(root: &Path, keep: usize, current: &str) -> Result<()> {
    let mut steps = Vec::new();
    for e in fs::read_dir(root).map_err(io("list", root))? {
        let e = e.map_err(io("list", root))?;
        if let Some(n) = e.file_name().to_str().and_then(parse_step_name) {
            steps.push((n, e.path()));
        }
    }
    steps.sort();
    let remove = steps.len().saturating_sub(keep);
    for (_, path) in steps.into_iter().take(remove) {
        if path.file_name().and_then(|n| n.to_str()) == Some(current) {
            continue;
        }
        // Rename out of the `step-*` namespace first, so a crash mid-removal leaves nothing
        // that looks committed.
        let doomed = root.join(format!(
            ".pruned-{}",
            path.file_name().and_then(|n| n.to_str()).unwrap_or("x")
        ));
        if doomed.exists() {
            fs::remove_dir_all(&doomed).map_err(io("remove", &doomed))?;
        }
        fs::rename(&path, &doomed).map_err(io("rename", &path))?;
        fs::remove_dir_all(&doomed).map_err(io("remove", &doomed))?;
    }
    sync_dir(root)
}
