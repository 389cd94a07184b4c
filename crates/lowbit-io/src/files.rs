//! Reading and writing safetensors files without holding them in memory: inputs whose header is
//! read and validated before any data ([`Input`]), tensor bytes read on demand by position,
//! outputs whose header is computed from the tensor sizes up front and whose data is written by
//! position into a temporary file in the destination directory, renamed into place at the end
//! ([`Output`]), so no partial output is ever left behind. [`pipeline`] runs chunked work over
//! threads.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors, View};

use crate::error::Error;

mod header;
pub mod pipeline;
mod regular;

pub use header::{MAX_HEADER, Spec};
pub use regular::open_regular;

/// A tensor to be written: borrowed from the input (pass-through) or freshly computed.
#[derive(Clone, Debug)]
pub struct OutTensor<'a> {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian element bytes.
    pub data: Cow<'a, [u8]>,
}

impl OutTensor<'_> {
    /// An owned tensor.
    pub fn owned(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> OutTensor<'static> {
        OutTensor {
            dtype,
            shape,
            data: Cow::Owned(data),
        }
    }
}

impl View for OutTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// The first key that occurs twice in the top-level object of the JSON text `json`, decoded.
/// Only what it needs of JSON is scanned (strings and nesting); `None` for malformed text, which
/// the safetensors parser then refuses with its own words.
pub fn duplicate_key(json: &str) -> Option<String> {
    let b = json.as_bytes();
    let mut seen = std::collections::HashSet::new();
    let mut depth = 0usize;
    // At depth 1, the next string is a key after `{` or `,`.
    let mut expect_key = false;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'"' => {
                let (text, next) = json_string(json, i)?;
                if depth == 1 && expect_key {
                    if !seen.insert(text.clone()) {
                        return Some(text);
                    }
                    expect_key = false;
                }
                i = next;
                continue;
            }
            b'{' | b'[' => {
                depth += 1;
                expect_key = depth == 1 && b[i] == b'{';
            }
            b'}' | b']' => depth = depth.checked_sub(1)?,
            b',' => expect_key = depth == 1,
            _ => {}
        }
        i += 1;
    }
    None
}

/// Decodes the JSON string starting at byte `start` (a `"`); returns it and the index after it.
fn json_string(json: &str, start: usize) -> Option<(String, usize)> {
    let b = json.as_bytes();
    let mut out = String::new();
    let mut i = start + 1;
    let mut units: Vec<u16> = Vec::new();
    let flush = |units: &mut Vec<u16>, out: &mut String| {
        if !units.is_empty() {
            out.extend(char::decode_utf16(units.drain(..)).map(|c| c.unwrap_or('\u{fffd}')));
        }
    };
    loop {
        match *b.get(i)? {
            b'"' => {
                flush(&mut units, &mut out);
                return Some((out, i + 1));
            }
            b'\\' => {
                let e = *b.get(i + 1)?;
                if e == b'u' {
                    let hex = json.get(i + 2..i + 6)?;
                    units.push(u16::from_str_radix(hex, 16).ok()?);
                    i += 6;
                    continue;
                }
                flush(&mut units, &mut out);
                out.push(match e {
                    b'b' => '\u{8}',
                    b'f' => '\u{c}',
                    b'n' => '\n',
                    b'r' => '\r',
                    b't' => '\t',
                    other => char::from(other),
                });
                i += 2;
            }
            _ => {
                flush(&mut units, &mut out);
                let c = json.get(i..)?.chars().next()?;
                out.push(c);
                i += c.len_utf8();
            }
        }
    }
}

/// Checks the input/output pair before any work: the input must be a regular file, the output must not be
/// the input (not even with `--force`), and an existing output needs `force` and must be a
/// regular file (a device node, FIFO, socket, directory or symlink is never replaced).
pub fn check_paths(input: &Path, output: &Path, force: bool) -> Result<(), Error> {
    let input_real = fs::canonicalize(input).map_err(|e| Error::io("read", input, e))?;
    // `stat` only: a FIFO is refused here before anything could block opening it.
    let meta = fs::metadata(&input_real).map_err(|e| Error::io("read", input, e))?;
    if !meta.file_type().is_file() {
        return Err(Error::NotRegularFile {
            path: input.to_owned(),
            kind: file_kind(&meta.file_type()),
        });
    }
    // canonicalize fails when the output does not exist yet; then it cannot be the input.
    if fs::canonicalize(output).is_ok_and(|o| o == input_real) {
        return Err(Error::Invalid(format!(
            "output path {} is the input path; choose another output file",
            crate::report::shown(output)
        )));
    }
    if let Ok(m) = fs::symlink_metadata(output) {
        if !force {
            return Err(Error::Invalid(format!(
                "output {} already exists (pass --force to overwrite it)",
                crate::report::shown(output)
            )));
        }
        if !m.file_type().is_file() {
            return Err(Error::Invalid(format!(
                "output {} exists and is not a regular file ({}); --force replaces only \
                 regular files",
                crate::report::shown(output),
                file_kind(&m.file_type())
            )));
        }
    }
    Ok(())
}

/// A word for a file type, for error messages.
fn file_kind(t: &fs::FileType) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if t.is_dir() {
        "a directory"
    } else if t.is_symlink() {
        "a symbolic link"
    } else {
        "a special file"
    }
}

/// Removes the temporary file on drop unless it has been renamed into place.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        signals::disarm();
        if let Some(p) = self.0.take() {
            // Best effort: the error that got us here matters more than a cleanup failure.
            let _ = fs::remove_file(p);
        }
    }
}

/// Prefix of every temporary file: `.lowbit-tmp-<pid, 8 hex>-<random, 16 hex>` (41 bytes,
/// whatever the output name, so any name the file system accepts works as an output).
pub const TEMP_PREFIX: &str = ".lowbit-tmp-";

/// Temporaries older than this are removed even when their process id is in use (the id may
/// have been reused) or cannot be checked (no `/proc`).
const STALE_AFTER: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

/// An unpredictable 64-bit value without a dependency: the hasher's per-process random keys
/// (`RandomState`), the time, the process id, a counter and a stack address.
fn entropy() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.write_u32(std::process::id());
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    let local = 0u8;
    h.write_usize(std::ptr::addr_of!(local) as usize);
    h.finish()
}

/// The temporary file name for this process: see [`TEMP_PREFIX`].
fn temp_name() -> String {
    format!("{TEMP_PREFIX}{:08x}-{:016x}", std::process::id(), entropy())
}

/// Whether `name` is a temporary of a killed run: the pattern of [`temp_name`], its process gone
/// (on Linux, no `/proc/<pid>`), or older than a day.
fn is_stale(dir: &Path, name: &str) -> bool {
    let Some(rest) = name.strip_prefix(TEMP_PREFIX) else {
        return false;
    };
    let Some((pid, rand)) = rest.split_once('-') else {
        return false;
    };
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex(pid, 8) || !hex(rand, 16) {
        return false;
    }
    let path = dir.join(name);
    let Ok(meta) = fs::symlink_metadata(&path) else {
        return false;
    };
    if !meta.file_type().is_file() {
        return false;
    }
    let old = meta
        .modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .is_some_and(|age| age > STALE_AFTER);
    let Ok(pid) = u32::from_str_radix(pid, 16) else {
        return false;
    };
    if pid == std::process::id() {
        return false;
    }
    let gone = cfg!(target_os = "linux")
        && Path::new("/proc/self").exists()
        && !Path::new(&format!("/proc/{pid}")).exists();
    gone || old
}

/// Removes temporaries of killed runs from `dir` (best effort).
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        if let Some(name) = name.to_str()
            && is_stale(dir, name)
        {
            let _ = fs::remove_file(dir.join(name));
        }
    }
}

/// Creates a new file in `dir` under a name from `name`, exclusively: `create_new` (`O_EXCL`)
/// never opens an existing file and never follows a symlink at that name. A name that exists
/// (astronomically unlikely, or planted) is retried with the next name, up to 16 times. The
/// returned file is armed for removal on a signal ([`signals::arm`]); the caller disarms it.
fn create_temp(
    dir: &Path,
    mut name: impl FnMut() -> String,
) -> std::io::Result<(PathBuf, fs::File)> {
    let mut attempt = 0;
    loop {
        let tmp = dir.join(name());
        // Armed before the file exists, so no signal can fall between its creation and the
        // registration (a signal before it unlinks nothing).
        signals::arm(&tmp);
        match fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
        {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 16 => {
                signals::disarm();
                attempt += 1;
            }
            Err(e) => {
                signals::disarm();
                return Err(e);
            }
        }
    }
}

#[cfg(any(target_os = "linux", target_os = "macos"))]
mod signals;

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod signals {
    pub fn arm(_: &std::path::Path) {}
    pub fn disarm() {}
}

/// An output file being written: an exclusively created temporary in the destination
/// directory, renamed over `path` by [`Output::commit`], so `path` either keeps its old contents
/// or holds the complete new file.
///
/// The temporary is created exclusively (`create_new`: it never opens an existing file or
/// follows a symlink planted at its name) under an unpredictable fixed-length name
/// ([`TEMP_PREFIX`]); temporaries left by killed runs are removed first. When `path` is an
/// existing regular file, its permissions carry over to the new file. Dropping it uncommitted
/// (an error) removes the temporary, and so do SIGINT, SIGTERM and SIGHUP while it exists
/// (Linux and macOS). Writes are positioned ([`Output::write_at`]), so tensors can be written
/// in any order and from several threads.
pub struct Output {
    path: PathBuf,
    tmp: PathBuf,
    file: fs::File,
    old_perms: Option<fs::Permissions>,
    guard: TempGuard,
}

impl Output {
    /// Creates the temporary for `path`.
    pub fn create(path: &Path) -> Result<Self, Error> {
        if path.file_name().is_none() {
            return Err(Error::Invalid(format!(
                "output {} is not a file path",
                crate::report::shown(path)
            )));
        }
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        remove_stale_temps(dir);
        let old_perms = fs::symlink_metadata(path)
            .ok()
            .filter(|m| m.file_type().is_file())
            .map(|m| m.permissions());
        let (tmp, file) = create_temp(dir, temp_name).map_err(|e| Error::io("write", path, e))?;
        Ok(Output {
            path: path.to_owned(),
            guard: TempGuard(Some(tmp.clone())),
            tmp,
            file,
            old_perms,
        })
    }

    /// Writes `bytes` at byte `offset`; errors name the output the user asked for, not the
    /// hidden temporary.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> Result<(), Error> {
        positioned::write_all_at(&self.file, offset, bytes)
            .map_err(|e| Error::io("write", &self.path, e))
    }

    /// Syncs the file, gives it the replaced file's permissions and renames it into place.
    pub fn commit(mut self) -> Result<(), Error> {
        let finish = || -> std::io::Result<()> {
            if let Some(p) = &self.old_perms {
                self.file.set_permissions(p.clone())?;
            }
            self.file.sync_all()
        };
        finish().map_err(|e| Error::io("write", &self.path, e))?;
        let renamed = fs::rename(&self.tmp, &self.path);
        if renamed.is_ok() {
            // Disarm before anything else can be created at the temporary's name.
            signals::disarm();
            self.guard.0 = None;
        }
        renamed.map_err(|e| Error::io("write", &self.path, e))
    }
}

/// Commits `out`, a file of `len` bytes, and adds `wrote PATH (SIZE)` to the report's footer.
pub fn commit_reported(
    out: Output,
    len: usize,
    mut table: crate::report::Table,
) -> Result<crate::report::Table, Error> {
    let line = format!(
        "wrote {} ({})",
        crate::report::shown(&out.path),
        crate::report::human_bytes(len)
    );
    out.commit()?;
    table.footer.push(line);
    Ok(table)
}

/// Writes `bytes` to `path` atomically (see [`Output`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), Error> {
    let out = Output::create(path)?;
    out.write_at(0, bytes)?;
    out.commit()
}

/// The header of a file of `specs` and `metadata` and each spec's data offset
/// (`header::layout`); a header over safetensors' size limit is refused.
pub fn layout(
    path: &Path,
    specs: &[Spec],
    metadata: &HashMap<String, String>,
) -> Result<(Vec<u8>, Vec<u64>), Error> {
    header::layout(specs, metadata).ok_or_else(|| Error::Serialize {
        path: path.to_owned(),
        source: safetensors::SafeTensorError::HeaderTooLarge,
    })
}

/// Serializes tensors and metadata into a safetensors byte buffer, deterministically: the
/// metadata keys are sorted (`header::layout`), so identical inputs give identical files.
pub fn serialize(
    path: &Path,
    tensors: Vec<(String, OutTensor<'_>)>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, Error> {
    let specs: Vec<Spec> = tensors
        .iter()
        .map(|(name, t)| Spec {
            name: name.clone(),
            dtype: t.dtype,
            shape: t.shape.clone(),
            len: t.data.len(),
        })
        .collect();
    let (mut out, offsets) = layout(path, &specs, &metadata)?;
    let mut order: Vec<(u64, &[u8])> = offsets
        .into_iter()
        .zip(&tensors)
        .map(|(o, (_, t))| (o, t.data.as_ref()))
        .collect();
    order.sort_by_key(|(o, _)| *o);
    for (_, data) in order {
        out.extend_from_slice(data);
    }
    Ok(out)
}

/// A safetensors input whose header has been read and fully validated — and nothing else:
/// tensor bytes are read on demand ([`Input::read_at`]), so a bad header is refused without
/// reading the data, and memory stays bounded by what the caller asks for at a time.
pub struct Input {
    path: PathBuf,
    file: fs::File,
    /// The tensors, sorted by name (safetensors' own order depends on a hash map).
    pub tensors: Vec<Entry>,
    /// The `__metadata__` map (empty if absent).
    pub metadata: HashMap<String, String>,
}

/// One tensor of an [`Input`].
#[derive(Clone, Debug)]
pub struct Entry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Absolute file offset of its data.
    pub offset: u64,
    /// Bytes of data.
    pub len: usize,
}

impl Input {
    /// Opens `path` and reads and validates its header: the length prefix (bounded by
    /// safetensors' limit and by the file's size), UTF-8, JSON, no duplicate names, dtypes,
    /// shapes and offsets that tile the data region exactly to the end of the file. Only the
    /// header's bytes are read. Inputs must be regular files (a FIFO or device has no size to
    /// check against, and could block or never end): [`open_regular`] refuses anything else
    /// without blocking on it.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let io = |e| Error::io("read", path, e);
        let parse_err = |source| Error::Parse {
            path: path.to_owned(),
            source,
        };
        let (file, meta) = open_regular(path)?;
        let size = meta.len();
        use safetensors::SafeTensorError as E;
        let mut prefix = [0u8; 8];
        if size < 8 {
            return Err(parse_err(E::HeaderTooSmall));
        }
        positioned::read_exact_at(&file, 0, &mut prefix).map_err(io)?;
        let n = u64::from_le_bytes(prefix);
        if n > header::MAX_HEADER {
            return Err(parse_err(E::HeaderTooLarge));
        }
        if 8 + n > size {
            return Err(parse_err(E::InvalidHeaderLength));
        }
        let mut buf = vec![0u8; 8 + n as usize];
        buf[..8].copy_from_slice(&prefix);
        positioned::read_exact_at(&file, 8, &mut buf[8..]).map_err(io)?;
        // serde_json keeps the last of two equal keys, so a header naming a tensor twice would
        // parse as the last; it is refused first.
        if let Some(dup) = std::str::from_utf8(&buf[8..]).ok().and_then(duplicate_key) {
            return Err(Error::Invalid(format!(
                "cannot parse {}: the header names `{}` more than once",
                crate::report::shown(path),
                crate::report::escape(&dup)
            )));
        }
        let (infos, metadata) = match SafeTensors::read_metadata(&buf) {
            Ok((_, md)) => {
                let infos = md.tensors().into_iter().map(|(k, v)| (k, v.clone()));
                (infos.collect(), md.metadata().clone())
            }
            // Everything but the length of the data region is valid.
            Err(E::MetadataIncompleteBuffer) => {
                let text =
                    std::str::from_utf8(&buf[8..]).map_err(|e| parse_err(E::InvalidHeader(e)))?;
                let (mut infos, metadata) = header::tensors(text).map_err(|e| {
                    Error::Invalid(format!("cannot parse {}: {e}", crate::report::shown(path)))
                })?;
                infos.sort_by_key(|(_, i)| i.data_offsets);
                let md = safetensors::tensor::Metadata::new(metadata, infos.clone())
                    .map_err(parse_err)?;
                (infos, md.metadata().clone())
            }
            Err(e) => return Err(parse_err(e)),
        };
        let data_len = infos
            .iter()
            .map(|(_, i)| i.data_offsets.1)
            .max()
            .unwrap_or(0);
        if (data_len as u64).checked_add(8 + n) != Some(size) {
            return Err(parse_err(E::MetadataIncompleteBuffer));
        }
        let mut tensors: Vec<Entry> = infos
            .into_iter()
            .map(|(name, i)| Entry {
                name,
                dtype: i.dtype,
                shape: i.shape,
                offset: 8 + n + i.data_offsets.0 as u64,
                len: i.data_offsets.1 - i.data_offsets.0,
            })
            .collect();
        tensors.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Input {
            path: path.to_owned(),
            file,
            tensors,
            metadata: metadata.unwrap_or_default(),
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&Entry> {
        self.tensors
            .binary_search_by(|e| e.name.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i])
    }

    /// Fills `buf` from byte `offset` of the file (safe to call from several threads).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
        positioned::read_exact_at(&self.file, offset, buf)
            .map_err(|e| Error::io("read", &self.path, e))
    }

    /// `len` bytes from `offset`, freshly allocated.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, Error> {
        let mut buf = vec![0u8; len];
        self.read_at(offset, &mut buf)?;
        Ok(buf)
    }

    /// `n` little-endian elements from `offset`, read straight into their typed buffer (no
    /// byte buffer, no decoding pass).
    pub fn read_elems<T: Plain>(&self, offset: u64, n: usize) -> Result<Vec<T>, Error> {
        let mut v = vec![T::default(); n];
        let len = std::mem::size_of_val(v.as_slice());
        // SAFETY: the bytes of `v`'s `n` initialized elements, viewed as `u8` (alignment 1);
        // `Plain` types have no padding and accept any bit pattern, so whatever is read in is
        // a valid value. The view ends before `v` is used again.
        let bytes = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), len) };
        self.read_at(offset, bytes)?;
        if cfg!(target_endian = "big") {
            v.iter_mut().for_each(|x| *x = x.le_to_native());
        }
        Ok(v)
    }

    /// Copies `len` bytes from `offset` to `out` at `out_offset`, through a bounded buffer.
    pub fn copy_to(
        &self,
        offset: u64,
        len: usize,
        out: &Output,
        out_offset: u64,
    ) -> Result<(), Error> {
        const STEP: usize = 8 << 20;
        let mut buf = vec![0u8; len.min(STEP)];
        for start in (0..len).step_by(STEP) {
            let b = &mut buf[..(len - start).min(STEP)];
            self.read_at(offset + start as u64, b)?;
            out.write_at(out_offset + start as u64, b)?;
        }
        Ok(())
    }
}

/// Element types read straight from file bytes: no padding, every bit pattern a value.
pub trait Plain: Copy + Default {
    /// The value whose little-endian representation these bytes were read as.
    fn le_to_native(self) -> Self;
}

impl Plain for u16 {
    fn le_to_native(self) -> Self {
        u16::from_le(self)
    }
}

impl Plain for f32 {
    fn le_to_native(self) -> Self {
        f32::from_bits(u32::from_le(self.to_bits()))
    }
}

/// Positioned reads and writes (`pread`/`pwrite` on Unix): they do not move a shared cursor, so
/// worker threads can use one file at once.
mod positioned {
    use std::fs::File;
    use std::io::Result;

    #[cfg(unix)]
    pub fn read_exact_at(f: &File, offset: u64, buf: &mut [u8]) -> Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(f, buf, offset)
    }

    #[cfg(unix)]
    pub fn write_all_at(f: &File, offset: u64, buf: &[u8]) -> Result<()> {
        std::os::unix::fs::FileExt::write_all_at(f, buf, offset)
    }

    // Elsewhere `&File` has one shared cursor: a move and a read happen under one lock.
    #[cfg(not(unix))]
    static CURSOR: std::sync::Mutex<()> = std::sync::Mutex::new(());

    #[cfg(not(unix))]
    pub fn read_exact_at(mut f: &File, offset: u64, buf: &mut [u8]) -> Result<()> {
        use std::io::{Read, Seek, SeekFrom};
        let _held = CURSOR
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.seek(SeekFrom::Start(offset))?;
        f.read_exact(buf)
    }

    #[cfg(not(unix))]
    pub fn write_all_at(mut f: &File, offset: u64, buf: &[u8]) -> Result<()> {
        use std::io::{Seek, SeekFrom, Write};
        let _held = CURSOR
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        f.seek(SeekFrom::Start(offset))?;
        f.write_all(buf)
    }
}

/// Decodes little-endian f32 bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn temp_names_are_short_unpredictable_and_recognised() {
        let a = temp_name();
        let b = temp_name();
        assert_ne!(a, b);
        assert_eq!(a.len(), TEMP_PREFIX.len() + 8 + 1 + 16);
        let dir = std::env::temp_dir();
        // Our own live process: never stale.
        assert!(!is_stale(&dir, &a));
        assert!(!is_stale(&dir, ".lowbit-tmp-zz"));
        assert!(!is_stale(&dir, "model.safetensors"));
    }

    #[cfg(unix)]
    #[test]
    fn temp_creation_never_follows_a_planted_symlink() {
        let dir = std::env::temp_dir().join(format!("lowbit-files-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        fs::write(&victim, b"precious").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(".lowbit-tmp-planted")).unwrap();
        let mut names = [".lowbit-tmp-planted", ".lowbit-tmp-fresh"].into_iter();
        let (tmp, mut f) = create_temp(&dir, || names.next().unwrap().to_owned()).unwrap();
        f.write_all(b"new").unwrap();
        assert_eq!(tmp, dir.join(".lowbit-tmp-fresh"));
        assert_eq!(fs::read(&victim).unwrap(), b"precious");
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn duplicate_keys_are_found_after_decoding() {
        assert_eq!(duplicate_key(r#"{"a":{"x":[1,2]},"b":1}"#), None);
        assert_eq!(
            duplicate_key(r#"{"a":{"a":1},"a":2}"#).as_deref(),
            Some("a")
        );
        assert_eq!(
            duplicate_key(r#"{"w\u0041":1, "x":{"w":[",\"}"]}, "wA":2}"#).as_deref(),
            Some("wA")
        );
        assert_eq!(duplicate_key(r#"{"\u00e9":1,"é":2}"#).as_deref(), Some("é"));
        assert_eq!(duplicate_key(r#"{"a":1"#), None);
    }

    #[test]
    fn serialize_is_deterministic_and_round_trips_metadata() {
        let metadata: HashMap<String, String> = [
            ("b", "plain"),
            ("a", "quote \" backslash \\ newline \n tab \t bell \u{7} é"),
            ("lowbit.tensor.x", r#"{"dtype":"F32","shape":[2]}"#),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        let tensors = || {
            vec![
                (
                    "x".to_owned(),
                    OutTensor::owned(Dtype::F32, vec![2], vec![0, 0, 128, 63, 0, 0, 0, 64]),
                ),
                (
                    "y".to_owned(),
                    OutTensor::owned(Dtype::U8, vec![3], vec![1, 2, 3]),
                ),
            ]
        };
        let p = Path::new("t");
        let a = serialize(p, tensors(), metadata.clone()).unwrap();
        for _ in 0..4 {
            let mut shuffled = HashMap::new();
            shuffled.extend(metadata.clone());
            assert_eq!(serialize(p, tensors(), shuffled).unwrap(), a);
        }
        let (n, header) = SafeTensors::read_metadata(&a).unwrap();
        assert_eq!(n % 8, 0);
        assert_eq!(header.metadata().as_ref(), Some(&metadata));
        let st = SafeTensors::deserialize(&a).unwrap();
        assert_eq!(st.tensor("x").unwrap().data(), [0, 0, 128, 63, 0, 0, 0, 64]);
        assert_eq!(st.tensor("y").unwrap().data(), [1, 2, 3]);
        // No tensors at all.
        let e = serialize(p, Vec::new(), metadata.clone()).unwrap();
        let (_, header) = SafeTensors::read_metadata(&e).unwrap();
        assert_eq!(header.metadata().as_ref(), Some(&metadata));
    }
}
