//! Safetensors weights under HF Llama names: written as one `model.safetensors` or sharded
//! with `model.safetensors.index.json`, read back sharded or not.
//!
//! Sharding follows `huggingface_hub`'s `split_torch_state_dict_into_shards` (what
//! `save_pretrained` uses): tensors in order, a new shard when the next tensor would take the
//! current one over the maximum, a tensor larger than the maximum alone in its shard; shards
//! named `model-{K:05}-of-{N:05}.safetensors`; the index holds `metadata.total_size` (tensor
//! bytes) and the `weight_map` with its names sorted. Every file's `__metadata__` is
//! `{"format": "pt"}`, as `transformers` writes it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use lowbit_io::Json;
use lowbit_io::files::{self, Input, Output, Spec};
use safetensors::Dtype;

use super::{DEFAULT_MAX_SHARD_BYTES, HfError, INDEX_FILE, Result, WEIGHTS_FILE, read_json};
use crate::LlamaConfig;
use crate::params::{ParamInfo, params};

/// The element type written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WeightDtype {
    /// The fp32 values' own bits.
    #[default]
    F32,
    /// bf16, rounded to nearest even (NaN stays NaN).
    Bf16,
}

impl WeightDtype {
    /// Bytes per element.
    pub fn width(self) -> u64 {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::Bf16 => 2,
        }
    }
}

/// How [`super::export`] writes the weights.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportOptions {
    /// The element type.
    pub dtype: WeightDtype,
    /// Shard above this many tensor bytes per file ([`DEFAULT_MAX_SHARD_BYTES`], at least 1).
    pub max_shard_bytes: u64,
}

impl Default for ExportOptions {
    fn default() -> Self {
        ExportOptions {
            dtype: WeightDtype::F32,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        }
    }
}

impl ExportOptions {
    /// With this element type.
    pub fn with_dtype(mut self, dtype: WeightDtype) -> Self {
        self.dtype = dtype;
        self
    }

    /// With this maximum shard size (0 is taken as 1: one tensor per shard).
    pub fn with_max_shard_bytes(mut self, bytes: u64) -> Self {
        self.max_shard_bytes = bytes.max(1);
        self
    }
}

/// What [`write`] wrote.
pub(super) struct Written {
    /// The files, shards first then the index (or the one file).
    pub files: Vec<String>,
    /// Tensor bytes in all.
    pub tensor_bytes: u64,
}

/// `values` as little-endian bytes of `dtype`.
fn encode(values: &[f32], dtype: WeightDtype) -> Vec<u8> {
    match dtype {
        WeightDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightDtype::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
    }
}

/// The shards of tensors of these byte sizes: index ranges, by the rule of the module docs.
pub fn shard_ranges(sizes: &[u64], max: u64) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0u64);
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && bytes.saturating_add(s) > max {
            out.push(start..i);
            (start, bytes) = (i, 0);
        }
        bytes = bytes.saturating_add(s);
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// The name of shard `k` (from 1) of `n`.
pub fn shard_name(k: usize, n: usize) -> String {
    format!("model-{k:05}-of-{n:05}.safetensors")
}

/// Writes the weights of `cfg` into `dir`.
pub(super) fn write(
    dir: &Path,
    cfg: &LlamaConfig,
    values: &[Vec<f32>],
    opts: &ExportOptions,
) -> Result<Written> {
    let ps = params(cfg);
    if values.len() != ps.len() {
        return Err(HfError::Values(format!(
            "{} tensors given for the {} parameters of the model",
            values.len(),
            ps.len()
        )));
    }
    for (p, v) in ps.iter().zip(values) {
        if v.len() != p.numel() {
            return Err(HfError::Values(format!(
                "`{}`: {} values for shape {:?}",
                p.name,
                v.len(),
                p.shape
            )));
        }
    }
    let dtype = match opts.dtype {
        WeightDtype::F32 => Dtype::F32,
        WeightDtype::Bf16 => Dtype::BF16,
    };
    let sizes: Vec<u64> = ps
        .iter()
        .map(|p| p.numel() as u64 * opts.dtype.width())
        .collect();
    let ranges = shard_ranges(&sizes, opts.max_shard_bytes.max(1));
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let n = ranges.len();
    let mut names = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (k, range) in ranges.iter().enumerate() {
        let name = if n == 1 {
            WEIGHTS_FILE.to_string()
        } else {
            shard_name(k + 1, n)
        };
        let path = dir.join(&name);
        let specs: Vec<Spec> = ps[range.clone()]
            .iter()
            .zip(&sizes[range.clone()])
            .map(|(p, &len)| Spec {
                name: p.name.clone(),
                dtype,
                shape: p.shape.clone(),
                len: len as usize,
            })
            .collect();
        let (header, offsets) = files::layout(&path, &specs, &metadata)?;
        let out = Output::create(&path)?;
        out.write_at(0, &header)?;
        for (i, off) in range.clone().zip(offsets) {
            out.write_at(off, &encode(&values[i], opts.dtype))?;
            weight_map.insert(ps[i].name.clone(), name.clone());
        }
        out.commit()?;
        names.push(name);
    }
    let tensor_bytes = sizes.iter().sum();
    if n > 1 {
        let index = Json::obj([
            (
                "metadata",
                Json::obj([("total_size", Json::uint(tensor_bytes))]),
            ),
            (
                "weight_map",
                Json::Obj(
                    weight_map
                        .into_iter()
                        .map(|(k, v)| (k, Json::Str(v)))
                        .collect(),
                ),
            ),
        ]);
        names.push(super::write_json(dir, INDEX_FILE, &index)?);
    }
    Ok(Written {
        files: names,
        tensor_bytes,
    })
}

/// A shard file name from an index: a plain name in the directory, nothing else.
fn plain_name(index: &Path, name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && !name.contains(['/', '\\', '\0'])
        && name.ends_with(".safetensors");
    if ok {
        Ok(())
    } else {
        Err(HfError::invalid(
            index,
            format!(
                "weight_map: file {:?} is not a .safetensors file name in this directory",
                lowbit_io::report::escape(name)
            ),
        ))
    }
}

/// The weight files of `dir` and, for an index, which tensors each must hold: as
/// `transformers` looks, `model.safetensors` first, else the index.
fn weight_files(dir: &Path) -> Result<Vec<(String, Option<Vec<String>>)>> {
    let single = dir.join(WEIGHTS_FILE);
    if std::fs::symlink_metadata(&single).is_ok() {
        return Ok(vec![(WEIGHTS_FILE.to_string(), None)]);
    }
    let index = dir.join(INDEX_FILE);
    if std::fs::symlink_metadata(&index).is_err() {
        return Err(HfError::invalid(
            dir,
            format!("neither {WEIGHTS_FILE} nor {INDEX_FILE} is there"),
        ));
    }
    let json = read_json(&index)?;
    let Some(Json::Obj(map)) = json.member("weight_map") else {
        return Err(HfError::invalid(
            &index,
            "weight_map: missing or not an object",
        ));
    };
    let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (tensor, file) in map.iter() {
        let Some(file) = file.as_str() else {
            return Err(HfError::invalid(
                &index,
                format!(
                    "weight_map.{}: not a file name",
                    lowbit_io::report::escape(tensor)
                ),
            ));
        };
        plain_name(&index, file)?;
        by_file
            .entry(file.to_string())
            .or_default()
            .push(tensor.clone());
    }
    Ok(by_file.into_iter().map(|(f, t)| (f, Some(t))).collect())
}

/// One tensor's values as f32 from its entry, which must be f32, bf16 or f16.
fn read_tensor(input: &Input, e: &files::Entry, p: &ParamInfo) -> Result<Vec<f32>> {
    let path = input.path();
    let n = p.numel();
    let name = lowbit_io::report::escape(&e.name);
    if e.shape != p.shape {
        return Err(HfError::invalid(
            path,
            format!(
                "`{name}` has shape {:?}; the config gives {:?}",
                e.shape, p.shape
            ),
        ));
    }
    let width = match e.dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        other => {
            return Err(HfError::invalid(
                path,
                format!("`{name}` is {other:?}; only F32, BF16 and F16 weights are read"),
            ));
        }
    };
    if e.len != n * width {
        return Err(HfError::invalid(
            path,
            format!(
                "`{name}` has {} bytes for {n} elements of {:?}",
                e.len, e.dtype
            ),
        ));
    }
    Ok(match e.dtype {
        Dtype::F32 => input.read_elems::<f32>(e.offset, n)?,
        dt => {
            let half16: Vec<u16> = input.read_elems::<u16>(e.offset, n)?;
            if dt == Dtype::BF16 {
                half16
                    .iter()
                    .map(|&b| half::bf16::from_bits(b).to_f32())
                    .collect()
            } else {
                half16
                    .iter()
                    .map(|&b| half::f16::from_bits(b).to_f32())
                    .collect()
            }
        }
    })
}

/// Reads the weights of `cfg` from `dir` (one `model.safetensors`, or the shards of
/// `model.safetensors.index.json`), each as f32, in [`params`]' order.
///
/// Every tensor must be a parameter of `cfg` with its shape, F32, BF16 or F16, present exactly
/// once over all files and in the file the index names; a tensor the model does not have (an
/// untied `lm_head.weight` of a tied config, biases, `rotary_emb.inv_freq`) or lacks is refused
/// by name.
///
/// # Errors
/// [`HfError`] naming the file and the tensor.
pub fn read_weights(dir: &Path, cfg: &LlamaConfig) -> Result<Vec<Vec<f32>>> {
    let ps = params(cfg);
    let ids: HashMap<&str, usize> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| (p.name.as_str(), i))
        .collect();
    let mut out: Vec<Option<Vec<f32>>> = vec![None; ps.len()];
    for (file, listed) in weight_files(dir)? {
        let input = Input::open(&dir.join(&file))?;
        if let Some(listed) = &listed {
            for t in listed {
                if input.get(t).is_none() {
                    return Err(HfError::invalid(
                        input.path(),
                        format!(
                            "{INDEX_FILE} puts `{}` here, but the file has no such tensor",
                            lowbit_io::report::escape(t)
                        ),
                    ));
                }
            }
        }
        for e in &input.tensors {
            let name = lowbit_io::report::escape(&e.name);
            let Some(&id) = ids.get(e.name.as_str()) else {
                return Err(HfError::invalid(
                    input.path(),
                    format!("`{name}` is not a parameter of the model config.json describes"),
                ));
            };
            if listed.as_ref().is_some_and(|l| !l.contains(&e.name)) {
                return Err(HfError::invalid(
                    input.path(),
                    format!("`{name}` is here, but {INDEX_FILE} puts it in another file"),
                ));
            }
            if out[id].is_some() {
                return Err(HfError::invalid(
                    input.path(),
                    format!("`{name}` is stored twice"),
                ));
            }
            out[id] = Some(read_tensor(&input, e, &ps[id])?);
        }
    }
    ps.iter()
        .zip(out)
        .map(|(p, v)| {
            v.ok_or_else(|| {
                HfError::invalid(
                    dir,
                    format!(
                        "`{}` is missing (a parameter of the model config.json describes)",
                        p.name
                    ),
                )
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_as_the_hub_splits() {
        assert_eq!(shard_ranges(&[4, 4, 4], 100), vec![0..3]);
        assert_eq!(shard_ranges(&[4, 4, 4], 8), vec![0..2, 2..3]);
        assert_eq!(shard_ranges(&[4, 20, 4], 8), vec![0..1, 1..2, 2..3]);
        assert_eq!(shard_ranges(&[20], 8), vec![0..1]);
        assert_eq!(shard_ranges(&[4, 4, 4], 1), vec![0..1, 1..2, 2..3]);
        assert!(shard_ranges(&[], 8).is_empty());
        assert_eq!(shard_name(2, 13), "model-00002-of-00013.safetensors");
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between bf16 1.0 and 1 + 2^-7: ties to even (1.0); a hair above
        // rounds up.
        let b = encode(
            &[1.0 + 2f32.powi(-8), 1.0 + 2f32.powi(-8) + 2f32.powi(-20)],
            WeightDtype::Bf16,
        );
        assert_eq!(b, vec![0x80, 0x3F, 0x81, 0x3F]);
    }
}
