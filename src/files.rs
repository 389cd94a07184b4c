//! Reading and writing safetensors files: whole-file reads, parsing with errors that name the
//! file, an owned tensor type for `safetensors::serialize`, and atomic writes (temporary file in
//! the destination directory, then rename) so no partial output is ever left behind.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors, View};

use crate::error::CliError;

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

/// A parsed input file: tensors sorted by name (safetensors' own order depends on a hash map)
/// and its `__metadata__`.
pub struct Parsed<'a> {
    /// `(name, view)`, sorted by name.
    pub tensors: Vec<(String, TensorView<'a>)>,
    /// The `__metadata__` map (empty if absent).
    pub metadata: HashMap<String, String>,
}

impl<'a> Parsed<'a> {
    /// Parses a whole safetensors file held in memory.
    pub fn new(path: &Path, buf: &'a [u8]) -> Result<Self, CliError> {
        let parse_err = |source| CliError::Parse {
            path: path.to_owned(),
            source,
        };
        // serde_json keeps the last of two equal keys, so a header naming a tensor twice would
        // parse as the last; it is refused first (the header is bounded by the buffer).
        let header_text = buf
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
            .and_then(|n| buf.get(8..8usize.checked_add(n)?))
            .and_then(|h| std::str::from_utf8(h).ok());
        if let Some(dup) = header_text.and_then(duplicate_key) {
            return Err(CliError::Msg(format!(
                "cannot parse {}: the header names `{}` more than once",
                path.display(),
                crate::report::escape(&dup)
            )));
        }
        let (_, header) = SafeTensors::read_metadata(buf).map_err(parse_err)?;
        let st = SafeTensors::deserialize(buf).map_err(parse_err)?;
        let mut tensors = st.tensors();
        tensors.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(Parsed {
            tensors,
            metadata: header.metadata().clone().unwrap_or_default(),
        })
    }

    /// The tensor called `name`, if present.
    pub fn get(&self, name: &str) -> Option<&TensorView<'a>> {
        self.tensors
            .binary_search_by(|(n, _)| n.as_str().cmp(name))
            .ok()
            .map(|i| &self.tensors[i].1)
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

/// Reads a whole file.
pub fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    fs::read(path).map_err(|e| CliError::io("read", path, e))
}

/// Checks the input/output pair before any work: the input must exist, the output must not be
/// the input (not even with `--force`), and an existing output needs `force` and must be a
/// regular file (a device node, FIFO, socket, directory or symlink is never replaced).
pub fn check_paths(input: &Path, output: &Path, force: bool) -> Result<(), CliError> {
    let input_real = fs::canonicalize(input).map_err(|e| CliError::io("read", input, e))?;
    if fs::metadata(&input_real).is_ok_and(|m| m.is_dir()) {
        return Err(CliError::Msg(format!(
            "cannot read {}: is a directory",
            input.display()
        )));
    }
    // canonicalize fails when the output does not exist yet; then it cannot be the input.
    if fs::canonicalize(output).is_ok_and(|o| o == input_real) {
        return Err(CliError::Msg(format!(
            "output path {} is the input path; choose another output file",
            output.display()
        )));
    }
    if let Ok(m) = fs::symlink_metadata(output) {
        if !force {
            return Err(CliError::Msg(format!(
                "output {} already exists (pass --force to overwrite it)",
                output.display()
            )));
        }
        if !m.file_type().is_file() {
            return Err(CliError::Msg(format!(
                "output {} exists and is not a regular file ({}); --force replaces only \
                 regular files",
                output.display(),
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

/// Removal of the temporary file when SIGINT, SIGTERM or SIGHUP arrives during the write.
///
/// Without a dependency there is no `libc` crate, so the three C functions are declared here;
/// std links the C library on every Unix anyway. The handler is async-signal-safe: it takes the
/// path (a C string registered by [`signals::arm`]) with one atomic swap, `unlink`s it, restores
/// the default action and re-raises the signal, so the process still dies of it. SIGKILL cannot
/// be caught: its temporaries are removed by the next run ([`remove_stale_temps`]).
#[cfg(any(target_os = "linux", target_os = "macos"))]
mod signals {
    use std::ffi::{CString, c_char, c_int};
    use std::path::Path;
    use std::sync::Once;
    use std::sync::atomic::{AtomicPtr, Ordering};

    /// The temporary to remove, or null.
    static TEMP: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());

    // The same numbers on Linux and macOS.
    const SIGHUP: c_int = 1;
    const SIGINT: c_int = 2;
    const SIGTERM: c_int = 15;
    const SIG_DFL: usize = 0;

    // SAFETY: these are the C library's declarations of `signal`, `unlink` and `raise` (a
    // handler is passed as its address, `sighandler_t`).
    unsafe extern "C" {
        fn signal(signum: c_int, handler: usize) -> usize;
        fn unlink(path: *const c_char) -> c_int;
        fn raise(sig: c_int) -> c_int;
    }

    extern "C" fn on_signal(sig: c_int) {
        let p = TEMP.swap(std::ptr::null_mut(), Ordering::SeqCst);
        if !p.is_null() {
            // SAFETY: `p` came from `CString::into_raw` in `arm` and, swapped out here, can no
            // longer be freed by `disarm`; `unlink` is async-signal-safe.
            unsafe { unlink(p) };
        }
        // SAFETY: restoring the default action and re-raising are async-signal-safe; the
        // signal then terminates the process as it would have without this handler.
        unsafe {
            signal(sig, SIG_DFL);
            raise(sig);
        }
    }

    /// Registers `path` for removal on a signal (installing the handlers once).
    pub fn arm(path: &Path) {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            for sig in [SIGHUP, SIGINT, SIGTERM] {
                // SAFETY: `on_signal` is an `extern "C" fn(c_int)` that only calls
                // async-signal-safe functions.
                unsafe { signal(sig, on_signal as extern "C" fn(c_int) as usize) };
            }
        });
        use std::os::unix::ffi::OsStrExt;
        if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
            let old = TEMP.swap(c.into_raw(), Ordering::SeqCst);
            free(old);
        }
    }

    /// Unregisters the temporary (it has been renamed or removed).
    pub fn disarm() {
        free(TEMP.swap(std::ptr::null_mut(), Ordering::SeqCst));
    }

    fn free(p: *mut c_char) {
        if !p.is_null() {
            // SAFETY: `p` came from `CString::into_raw` and was swapped out of `TEMP`, so
            // nothing else holds it.
            drop(unsafe { CString::from_raw(p) });
        }
    }
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod signals {
    pub fn arm(_: &std::path::Path) {}
    pub fn disarm() {}
}

/// Writes `bytes` to `path` through a temporary file in the same directory and a rename, so
/// `path` either keeps its old contents or holds the complete new file.
///
/// The temporary is created exclusively (`create_new`: it never opens an existing file or
/// follows a symlink planted at its name) under an unpredictable fixed-length name
/// ([`TEMP_PREFIX`]); temporaries left by killed runs are removed first. When `path` is an
/// existing regular file, its permissions carry over to the new file. SIGINT, SIGTERM and SIGHUP
/// during the write remove the temporary (Linux and macOS).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    if path.file_name().is_none() {
        return Err(CliError::Msg(format!(
            "output {} is not a file path",
            path.display()
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
    let (tmp, mut f) = create_temp(dir, temp_name).map_err(|e| CliError::io("write", path, e))?;
    let mut guard = TempGuard(Some(tmp.clone()));
    let mut write = || -> std::io::Result<()> {
        f.write_all(bytes)?;
        if let Some(p) = &old_perms {
            f.set_permissions(p.clone())?;
        }
        f.sync_all()
    };
    // Name the output the user asked for, not the hidden temporary file.
    write().map_err(|e| CliError::io("write", path, e))?;
    drop(f);
    let renamed = fs::rename(&tmp, path);
    if renamed.is_ok() {
        // Disarm before anything else can be created at the temporary's name.
        signals::disarm();
        guard.0 = None;
    }
    renamed.map_err(|e| CliError::io("write", path, e))?;
    Ok(())
}

/// Serializes tensors and metadata into a safetensors byte buffer, deterministically.
///
/// `safetensors::serialize` writes `__metadata__` in `HashMap` iteration order, which differs
/// between runs, so identical inputs would give different files. The tensors are serialized by
/// the crate (their order is already deterministic) and the metadata object is spliced into the
/// header with its keys sorted; data offsets are relative to the end of the header, so they stay
/// valid.
pub fn serialize(
    path: &Path,
    tensors: Vec<(String, OutTensor<'_>)>,
    metadata: HashMap<String, String>,
) -> Result<Vec<u8>, CliError> {
    let plain = safetensors::serialize(tensors, None).map_err(|source| CliError::Serialize {
        path: path.to_owned(),
        source,
    })?;
    if metadata.is_empty() {
        return Ok(plain);
    }
    let internal = || {
        CliError::Msg(format!(
            "{}: internal error: unexpected safetensors header layout",
            path.display()
        ))
    };
    let n = plain
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .and_then(|b| usize::try_from(u64::from_le_bytes(b)).ok())
        .ok_or_else(internal)?;
    let header = plain
        .get(8..8 + n)
        .and_then(|h| std::str::from_utf8(h).ok())
        .ok_or_else(internal)?;
    let body = header
        .trim_end()
        .strip_prefix('{')
        .and_then(|h| h.strip_suffix('}'))
        .ok_or_else(internal)?;
    let mut sorted: Vec<(&String, &String)> = metadata.iter().collect();
    sorted.sort();
    let mut json = String::from("{\"__metadata__\":{");
    for (i, (k, v)) in sorted.into_iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        push_json_string(&mut json, k);
        json.push(':');
        push_json_string(&mut json, v);
    }
    json.push('}');
    if !body.is_empty() {
        json.push(',');
        json.push_str(body);
    }
    json.push('}');
    // The format pads the header with spaces to a multiple of 8 bytes.
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let data = &plain[8 + n..];
    let mut out = Vec::with_capacity(8 + json.len() + data.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(json.as_bytes());
    out.extend_from_slice(data);
    Ok(out)
}

/// Appends `s` as a JSON string literal.
fn push_json_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let _ = std::fmt::Write::write_fmt(out, format_args!("\\u{:04x}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Decodes little-endian f32 bytes.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Decodes little-endian 16-bit words.
pub fn u16s(bytes: &[u8]) -> impl Iterator<Item = u16> + '_ {
    bytes
        .chunks_exact(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
}

#[cfg(test)]
mod tests {
    use super::*;

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
