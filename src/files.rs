//! Reading and writing safetensors files: whole-file reads, parsing with errors that name the
//! file, an owned tensor type for `safetensors::serialize`, and atomic writes (temporary file in
//! the destination directory, then rename) so no partial output is ever left behind.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::OsString;
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

/// Reads a whole file.
pub fn read(path: &Path) -> Result<Vec<u8>, CliError> {
    fs::read(path).map_err(|e| CliError::io("read", path, e))
}

/// Checks the input/output pair before any work: the input must exist, the output must not be
/// the input (not even with `--force`), and an existing output needs `force`.
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
    if !force && fs::symlink_metadata(output).is_ok() {
        return Err(CliError::Msg(format!(
            "output {} already exists (pass --force to overwrite it)",
            output.display()
        )));
    }
    Ok(())
}

/// Removes the temporary file on drop unless it has been renamed into place.
struct TempGuard(Option<PathBuf>);

impl Drop for TempGuard {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            // Best effort: the error that got us here matters more than a cleanup failure.
            let _ = fs::remove_file(p);
        }
    }
}

/// Writes `bytes` to `path` through `.NAME.tmp-<pid>` in the same directory and a rename, so
/// `path` either keeps its old contents or holds the complete new file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), CliError> {
    let Some(file_name) = path.file_name() else {
        return Err(CliError::Msg(format!(
            "output {} is not a file path",
            path.display()
        )));
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut tmp_name = OsString::from(".");
    tmp_name.push(file_name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = dir.join(tmp_name);
    let mut guard = TempGuard(Some(tmp.clone()));
    let write = || -> std::io::Result<()> {
        let mut f = fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    // Name the output the user asked for, not the hidden temporary file.
    write().map_err(|e| CliError::io("write", path, e))?;
    fs::rename(&tmp, path).map_err(|e| CliError::io("write", path, e))?;
    guard.0 = None;
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
