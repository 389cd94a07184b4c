//! Saving: every rank writes its own pieces, rank 0 writes the manifest and commits.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_layout::ParamSpec;
use lowbit_optim::{Optimizer, OptimizerState};
use safetensors::{Dtype, tensor::TensorView};

use crate::error::{CkptError, Result, io};
use crate::json::Json;
use crate::manifest::{
    DTYPE_F32, FileEntry, Manifest, Meta, OptimizerEntry, Piece, TensorEntry, fnv1a64,
};

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
/// Low-precision weights are not stored: they are `Q(bf16(master))`.
///
/// # Errors
/// [`CkptError::Exists`] if `step-N` is committed already (on every rank, before anything is
/// written); I/O, optimizer and collective errors.
pub fn save(
    dev: &Device,
    comm: &mut dyn Communicator,
    root: &Path,
    meta: &Meta,
    specs: &[ParamSpec],
    opt: &dyn Optimizer,
    options: SaveOptions,
) -> Result<PathBuf> {
    let rank = comm.rank();
    let size = comm.size();
    let final_dir = root.join(step_dir_name(meta.step));
    if final_dir.exists() {
        return Err(CkptError::Exists(final_dir));
    }
    let state = opt.export_state(dev)?;
    let tmp = root.join(tmp_dir_name(meta.step));
    if rank == 0 {
        fs::create_dir_all(root).map_err(io("create directory", root))?;
        // A directory of this name is what a crashed save of this step left: never committed,
        // so nothing can load it. Start over.
        if tmp.exists() {
            fs::remove_dir_all(&tmp).map_err(io("remove stale temp directory", &tmp))?;
        }
        fs::create_dir(&tmp).map_err(io("create directory", &tmp))?;
    }
    comm.barrier()?;
    write_rank(&tmp, rank, specs, &state)?;
    comm.barrier()?;
    if rank == 0 {
        commit(root, &tmp, &final_dir, size, meta, specs, options)?;
    }
    comm.barrier()?;
    Ok(final_dir)
}

/// One rank's pieces: the safetensors file and an index of its pieces for rank 0.
fn write_rank(
    tmp: &Path,
    rank: usize,
    specs: &[ParamSpec],
    state: &[OptimizerState],
) -> Result<()> {
    let mismatch = |msg: String| CkptError::Mismatch {
        dir: tmp.to_path_buf(),
        msg,
    };
    let mut data: Vec<(String, Vec<u8>)> = Vec::new();
    let mut pieces = Vec::new();
    for st in state {
        for t in &st.tensors {
            let spec = specs.get(t.param).ok_or_else(|| {
                mismatch(format!(
                    "state for parameter {} of {}",
                    t.param,
                    specs.len()
                ))
            })?;
            if t.range.end > spec.numel || t.values.len() != t.range.len() {
                return Err(mismatch(format!(
                    "`{}` piece {:?} of {} values for {} elements",
                    spec.name,
                    t.range,
                    t.values.len(),
                    spec.numel
                )));
            }
            if t.values.is_empty() {
                continue;
            }
            let key = format!("{}/{}@{}", spec.name, t.name, t.range.start);
            let bytes: Vec<u8> = t.values.iter().flat_map(|v| v.to_le_bytes()).collect();
            pieces.push((
                key.clone(),
                spec.name.clone(),
                t.name.clone(),
                st.owner.0,
                t.range.clone(),
                fnv1a64(&bytes),
            ));
            data.push((key, bytes));
        }
    }
    let views = data
        .iter()
        .map(|(k, b)| {
            Ok((
                k.clone(),
                TensorView::new(Dtype::F32, vec![b.len() / 4], b)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "lowbit-ckpt rank shard".to_string());
    meta.insert("rank".to_string(), rank.to_string());
    let bytes = safetensors::serialize(views, Some(meta))?;
    drop(data);
    let (n, header) = safetensors::SafeTensors::read_metadata(&bytes)?;
    let file = rank_file(rank);
    let mut entries = Vec::new();
    for (key, param, st, owner, range, hash) in pieces {
        let info = header
            .info(&key)
            .ok_or_else(|| mismatch(format!("duplicate piece `{key}`")))?;
        let offset = 8 + n + info.data_offsets.0;
        entries.push(obj(vec![
            ("key", Json::Str(key)),
            ("param", Json::Str(param)),
            ("state", Json::Str(st)),
            ("owner", Json::UInt(u64::from(owner))),
            ("start", Json::UInt(range.start as u64)),
            ("end", Json::UInt(range.end as u64)),
            ("offset", Json::UInt(offset as u64)),
            ("fnv1a64", Json::Str(format!("{hash:016x}"))),
        ]));
    }
    let optimizers = state
        .iter()
        .map(|s| {
            obj(vec![
                ("owner", Json::UInt(u64::from(s.owner.0))),
                ("rule", Json::Str(s.rule.clone())),
                ("steps", Json::UInt(s.steps)),
            ])
        })
        .collect();
    let index = obj(vec![
        ("file", Json::Str(file.clone())),
        ("bytes", Json::UInt(bytes.len() as u64)),
        ("optimizers", Json::Array(optimizers)),
        ("pieces", Json::Array(entries)),
    ]);
    write_synced(&tmp.join(&file), &bytes)?;
    write_synced(&tmp.join(index_file(rank)), index.to_text().as_bytes())
}

fn obj(pairs: Vec<(&str, Json)>) -> Json {
    Json::Object(pairs.into_iter().map(|(k, v)| (k.to_string(), v)).collect())
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
        let v = Json::parse(&text).map_err(|m| bad(&path, m))?;
        let get_u = |v: &Json, k: &str| match v.get(k) {
            Some(Json::UInt(n)) => Ok(*n),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let get_s = |v: &Json, k: &str| match v.get(k) {
            Some(Json::Str(s)) => Ok(s.clone()),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let get_a = |v: &Json, k: &str| match v.get(k) {
            Some(Json::Array(a)) => Ok(a.clone()),
            _ => Err(bad(&path, format!("`{k}`"))),
        };
        let file = get_s(&v, "file")?;
        files.push(FileEntry {
            name: file.clone(),
            bytes: get_u(&v, "bytes")?,
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
    let check = Json::parse(&text).map_err(|m| bad(&mpath, m))?;
    Manifest::from_json(&check).map_err(|e| {
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
