//! What [`crate::Checkpoint::verify`] proves beyond the pieces' hashes: every rank file is a
//! safetensors file other tools can read, its header agrees with the manifest, and a `step-N`
//! directory holds the manifest of step N; and how the `latest` pointer is read without
//! following it anywhere else.
//!
//! The header rules are the `safetensors` crate's (0.8, `SafeTensors::read_metadata` and
//! `Metadata::validate`): an 8-byte little-endian header length of at most 100 MB, a UTF-8 JSON
//! object starting with `{`, every entry's `data_offsets` tiling the data section in order with
//! no gap, each entry's byte length its shape's elements times the dtype's size, and the data
//! ending where the file ends. Only the header is read (its length is bounded), never the data.

use std::collections::HashMap;
use std::fs::{self, File};
use std::io::Read;
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io};
use crate::json::{Json, Limits};
use crate::manifest::Manifest;
use crate::save::{LATEST, parse_step_name};

/// The `safetensors` crate's largest header (`MAX_HEADER_SIZE`).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Checks every data file's safetensors header against the safetensors rules and the manifest:
/// every piece the manifest places in a file is an entry of that file's header with the piece's
/// key, dtype `F32`, 1-D shape of the piece's length and data at the piece's offset; every
/// entry of the header is a piece of the manifest (a file holding a tensor the manifest lost is
/// refused).
///
/// # Errors
/// [`CkptError::Header`] naming the file; I/O errors.
pub(crate) fn check_headers(dir: &Path, m: &Manifest) -> Result<()> {
    let mut wanted: HashMap<&str, FilePieces<'_>> = HashMap::new();
    for t in &m.tensors {
        for p in &t.pieces {
            wanted
                .entry(p.file.as_str())
                .or_default()
                .insert(p.key.as_str(), (p.start, p.end, p.offset, t.name.as_str()));
        }
    }
    for f in &m.files {
        let path = dir.join(&f.name);
        let empty = HashMap::new();
        let pieces = wanted.get(f.name.as_str()).unwrap_or(&empty);
        check_file(&path, pieces)?;
    }
    Ok(())
}

/// A file's pieces by key: (start element, end element, absolute byte offset, tensor name).
type FilePieces<'m> = HashMap<&'m str, (u64, u64, u64, &'m str)>;

/// One entry of a header: its key, dtype, shape and data offsets.
struct Entry<'j> {
    key: &'j str,
    dtype: &'j str,
    shape: Vec<u64>,
    begin: u64,
    end: u64,
}

fn check_file(path: &Path, pieces: &FilePieces<'_>) -> Result<()> {
    let bad = |msg: String| CkptError::Header {
        file: path.to_path_buf(),
        msg,
    };
    let mut f = File::open(path).map_err(io("open", path))?;
    let len = f.metadata().map_err(io("stat", path))?.len();
    let mut n = [0u8; 8];
    f.read_exact(&mut n).map_err(|_| {
        bad(format!(
            "{len} bytes, shorter than the 8-byte header length"
        ))
    })?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER_BYTES {
        return Err(bad(format!(
            "header length {n} exceeds safetensors' {MAX_HEADER_BYTES}"
        )));
    }
    if 8 + n > len {
        return Err(bad(format!(
            "header length {n} runs past the end of the file ({len} bytes)"
        )));
    }
    let mut text = vec![0u8; n as usize];
    f.read_exact(&mut text).map_err(io("read", path))?;
    let text = String::from_utf8(text).map_err(|_| bad("header is not UTF-8".into()))?;
    if !text.starts_with('{') {
        return Err(bad("header does not start with `{`".into()));
    }
    let json = Json::parse_with(text.trim_end_matches(' '), Limits::default())
        .map_err(|e| bad(format!("header is not JSON: {e}")))?;
    let Json::Obj(obj) = &json else {
        return Err(bad("header is not a JSON object".into()));
    };
    let mut entries = Vec::with_capacity(obj.len());
    for (key, v) in obj.iter() {
        if key == "__metadata__" {
            let ok = match v {
                Json::Obj(meta) => meta.iter().all(|(_, v)| matches!(v, Json::Str(_))),
                Json::Null => true,
                _ => false,
            };
            if !ok {
                return Err(bad("`__metadata__` is not a map of strings".into()));
            }
            continue;
        }
        entries.push(entry(key, v).ok_or_else(|| {
            bad(format!(
                "entry {key:?} is not {{dtype, shape, data_offsets: [begin, end]}}"
            ))
        })?);
    }
    // The safetensors layout: entries in data order, each starting where the previous ended.
    entries.sort_by_key(|e| (e.begin, e.end));
    let mut at = 0u64;
    for e in &entries {
        if e.begin != at || e.end < e.begin {
            return Err(bad(format!(
                "entry {:?} has data [{}, {}), expected to start at {at} (safetensors needs \
                 the entries to tile the data section)",
                e.key, e.begin, e.end
            )));
        }
        let size = dtype_bits(e.dtype)
            .ok_or_else(|| bad(format!("entry {:?} has unknown dtype {:?}", e.key, e.dtype)))?;
        let bits = e
            .shape
            .iter()
            .try_fold(size, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("entry {:?}: shape overflows", e.key)))?;
        if bits.div_ceil(8) != e.end - e.begin {
            return Err(bad(format!(
                "entry {:?}: shape {:?} of {} is not its {} data bytes",
                e.key,
                e.shape,
                e.dtype,
                e.end - e.begin
            )));
        }
        at = e.end;
    }
    if 8 + n + at != len {
        return Err(bad(format!(
            "the entries' data ends at byte {}, the file at {len}",
            8 + n + at
        )));
    }
    // Agreement with the manifest.
    for e in &entries {
        let Some(&(start, end, offset, tensor)) = pieces.get(e.key) else {
            return Err(bad(format!(
                "entry {:?} is no piece of the manifest (a tensor missing from it?)",
                e.key
            )));
        };
        let want = [end - start];
        if e.dtype != "F32" || e.shape != want || 8 + n + e.begin != offset {
            return Err(bad(format!(
                "entry {:?} is {} {:?} at byte {}; the manifest's piece [{start}, {end}) of \
                 `{tensor}` is F32 {want:?} at byte {offset}",
                e.key,
                e.dtype,
                e.shape,
                8 + n + e.begin
            )));
        }
    }
    if entries.len() != pieces.len() {
        let present: std::collections::HashSet<&str> = entries.iter().map(|e| e.key).collect();
        let (key, (_, _, _, tensor)) = pieces
            .iter()
            .find(|(k, _)| !present.contains(*k))
            .expect("fewer entries than pieces, all entries pieces");
        return Err(bad(format!(
            "no entry {key:?} (a piece of `{tensor}` in the manifest)"
        )));
    }
    Ok(())
}

fn entry<'j>(key: &'j str, v: &'j Json) -> Option<Entry<'j>> {
    let dtype = v.member("dtype")?.as_str()?;
    let shape = match v.member("shape")? {
        Json::Arr(a) => a.iter().map(Json::as_u64).collect::<Option<Vec<_>>>()?,
        _ => return None,
    };
    let offsets = match v.member("data_offsets")? {
        Json::Arr(a) if a.len() == 2 => (a[0].as_u64()?, a[1].as_u64()?),
        _ => return None,
    };
    Some(Entry {
        key,
        dtype,
        shape,
        begin: offsets.0,
        end: offsets.1,
    })
}

/// Bits per element of a safetensors dtype name.
fn dtype_bits(d: &str) -> Option<u64> {
    Some(match d {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
        "F4" => 4,
        "F6_E2M3" | "F6_E3M2" => 6,
        "I16" | "U16" | "F16" | "BF16" => 16,
        "I32" | "U32" | "F32" => 32,
        "I64" | "U64" | "F64" | "C64" => 64,
        _ => return None,
    })
}

/// A directory named `step-N` must hold the manifest of step N (a copied or renamed directory
/// would otherwise resume at another step than its name says). Other names are not checked: a
/// checkpoint may be opened from anywhere.
///
/// # Errors
/// [`CkptError::StepName`].
pub(crate) fn check_step_name(dir: &Path, m: &Manifest) -> Result<()> {
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(parse_step_name);
    match named {
        Some(n) if n != m.meta.step => Err(CkptError::StepName {
            dir: dir.to_path_buf(),
            named: n,
            step: m.meta.step,
        }),
        _ => Ok(()),
    }
}

/// Bytes of a `latest` file at most (it holds `step-N\n`).
const MAX_LATEST_BYTES: u64 = 4096;

/// The `step-N` name `root/latest` points to, `None` when there is no `latest`. A symbolic link
/// is resolved only to a `step-N` directory of `root` itself (by its name, nothing is read
/// through it); any other link, and anything that is not a regular file, is refused. Refusals
/// never quote what the pointer holds: it may be any file of the system.
///
/// # Errors
/// [`CkptError::Manifest`] for a pointer that is not one; I/O errors.
pub(crate) fn read_latest(root: &Path) -> Result<Option<String>> {
    let lp = root.join(LATEST);
    let meta = match fs::symlink_metadata(&lp) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io("stat", &lp)(e)),
    };
    let refuse = |msg: String| CkptError::Manifest {
        file: lp.clone(),
        msg,
    };
    if meta.file_type().is_symlink() {
        let target = fs::read_link(&lp).map_err(io("read link", &lp))?;
        let name = target
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| parse_step_name(n).is_some());
        let inside = |name: &str| -> Option<PathBuf> {
            let resolved = fs::canonicalize(&lp).ok()?;
            let want = fs::canonicalize(root).ok()?.join(name);
            (resolved == want && resolved.is_dir()).then_some(resolved)
        };
        return match name.and_then(|n| inside(n).map(|_| n.to_string())) {
            Some(n) => Ok(Some(n)),
            None => Err(refuse(format!(
                "`latest` is a symbolic link to {:?}, not to a `step-N` directory of this \
                 root; lowbit writes `latest` as a file holding `step-N`",
                target.display().to_string()
            ))),
        };
    }
    if !meta.file_type().is_file() {
        return Err(refuse(
            "`latest` is not a regular file (lowbit writes it as a file holding `step-N`)".into(),
        ));
    }
    let f = File::open(&lp).map_err(io("open", &lp))?;
    let mut text = Vec::new();
    f.take(MAX_LATEST_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(io("read", &lp))?;
    let name = std::str::from_utf8(&text).unwrap_or("").trim();
    if text.len() as u64 > MAX_LATEST_BYTES || parse_step_name(name).is_none() {
        return Err(refuse(format!(
            "`latest` ({} bytes) does not hold `step-N`",
            text.len()
        )));
    }
    Ok(Some(name.to_string()))
}
