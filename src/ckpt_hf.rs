//! `lowbit ckpt export CKPT OUT --format hf`: a decoder checkpoint as a Hugging Face directory
//! (`lowbit_llama::hf`), written into a temporary directory beside OUT and renamed into place.
//!
//! What is exported are the fp32 masters (never the low-precision weights); the model's shape
//! is the checkpoint's record of it (`model = llama`, `model.*`), the tokenizer the one its
//! data fingerprint names (`data = tokens NAME fnv1a64 …`, from the data manifest).

use std::fs;
use std::path::{Path, PathBuf};

use lowbit::ckpt::{Checkpoint, LoadOptions};
use lowbit::train::{ModelChoice, TrainConfig, apply_model_settings};
use lowbit_llama::data::Tokenizer;
use lowbit_llama::hf::{self, ExportOptions, WeightDtype};

use crate::ckpt_cmd::{ExportArgs, ExportDtype};
use crate::error::CliError;
use crate::report::{self, escape};

fn msg(m: String) -> CliError {
    CliError::Msg(m)
}

/// The tokenizer a checkpoint's data fingerprint names (`tokens NAME fnv1a64 HEX`).
fn tokenizer_of(c: &Checkpoint) -> Result<Tokenizer, CliError> {
    let data = c
        .manifest()
        .meta
        .config
        .get("data")
        .cloned()
        .unwrap_or_default();
    let name = data
        .strip_prefix("tokens ")
        .and_then(|r| r.split(' ').next())
        .ok_or_else(|| {
            msg(format!(
                "{}: its data record {:?} names no tokenizer (a decoder run on token data \
                 records `tokens NAME fnv1a64 ...`)",
                escape(&c.dir().display().to_string()),
                escape(&data)
            ))
        })?;
    Tokenizer::from_name(name).map_err(|e| msg(format!("{}: {e}", c.dir().display())))
}

/// A fresh sibling of `out` named `.NAME.lowbit-hf-TAG-PID-N`.
fn sibling(out: &Path, tag: &str) -> PathBuf {
    let name = out
        .file_name()
        .map_or_else(|| "out".into(), |f| f.to_string_lossy().into_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    out.with_file_name(format!(
        ".{name}.lowbit-hf-{tag}-{}-{nanos}",
        std::process::id()
    ))
}

/// Removes a temporary directory when dropped (an export that failed leaves nothing).
struct TempDir(Option<PathBuf>);

impl Drop for TempDir {
    fn drop(&mut self) {
        if let Some(d) = self.0.take() {
            let _ = fs::remove_dir_all(d);
        }
    }
}

/// `--force` replaces a directory only if it is empty or an earlier export (it has a
/// `config.json`), and never one that holds the checkpoint: a mistyped OUT must not delete a
/// directory of other files.
fn refuse_replacing(out: &Path, c: &Checkpoint) -> Result<(), CliError> {
    let shown = escape(&out.display().to_string()).into_owned();
    if let (Ok(o), Ok(d)) = (fs::canonicalize(out), fs::canonicalize(c.dir()))
        && d.starts_with(&o)
    {
        return Err(msg(format!(
            "output {shown} holds the checkpoint {}; --force would delete it",
            escape(&c.dir().display().to_string())
        )));
    }
    let mut entries = fs::read_dir(out).map_err(|e| CliError::io("read", out, e))?;
    if entries.next().is_some() && !out.join(hf::CONFIG_FILE).is_file() {
        return Err(msg(format!(
            "output {shown} is a directory with files but no {}: --force replaces only an \
             earlier export or an empty directory",
            hf::CONFIG_FILE
        )));
    }
    Ok(())
}

/// Runs the export (the caller refused outputs inside the checkpoint).
pub fn export(a: &ExportArgs, c: &Checkpoint) -> Result<(), CliError> {
    let dtype = match a.dtype {
        ExportDtype::F32 => WeightDtype::F32,
        ExportDtype::Bf16 => WeightDtype::Bf16,
        other => {
            return Err(msg(format!(
                "--format hf writes f32 or bf16 weights (what transformers loads), not --dtype \
                 {other:?}"
            )
            .to_lowercase()));
        }
    };
    if a.discrete_experts {
        return Err(msg(
            "--discrete-experts applies to the reference model's experts; --format hf exports a \
             decoder"
                .into(),
        ));
    }
    let mut cfg = TrainConfig::default();
    apply_model_settings(&mut cfg, &c.manifest().meta.config)
        .map_err(|e| msg(format!("{}: {e}", c.dir().display())))?;
    let ModelChoice::Llama(run) = &cfg.model else {
        return Err(msg(format!(
            "{}: --format hf exports a decoder checkpoint (lowbit train --model llama-*); this \
             one records the reference model",
            escape(&c.dir().display().to_string())
        )));
    };
    let tok = tokenizer_of(c)?;
    let out = &a.output;
    let existing = fs::symlink_metadata(out).ok();
    if let Some(meta) = &existing {
        if !a.force {
            return Err(msg(format!(
                "output {} already exists (pass --force to replace it)",
                escape(&out.display().to_string())
            )));
        }
        if !meta.file_type().is_dir() {
            return Err(msg(format!(
                "output {} exists and is not a directory; --force replaces only a directory",
                escape(&out.display().to_string())
            )));
        }
        refuse_replacing(out, c)?;
    }
    let mut values = Vec::new();
    for p in lowbit_llama::params::params(&run.config) {
        let shape: Vec<u64> = p.shape.iter().map(|&d| d as u64).collect();
        values.push(
            c.read_param(&p.name, "master", &shape, &LoadOptions::default())
                .map_err(|e| msg(e.to_string()))?,
        );
    }
    let tmp = sibling(out, "new");
    fs::create_dir(&tmp).map_err(|e| CliError::io("create", &tmp, e))?;
    let mut guard = TempDir(Some(tmp.clone()));
    let mut opts = ExportOptions::default().with_dtype(dtype);
    if let Some(max) = a.max_shard_size {
        opts = opts.with_max_shard_bytes(max);
    }
    let summary =
        hf::export(&tmp, &run.config, tok, &values, &opts).map_err(|e| msg(e.to_string()))?;
    if existing.is_some() {
        // --force: the old directory moves aside, the new one takes its name, the old goes.
        let old = sibling(out, "old");
        fs::rename(out, &old).map_err(|e| CliError::io("replace", out, e))?;
        if let Err(e) = fs::rename(&tmp, out) {
            let _ = fs::rename(&old, out);
            return Err(CliError::io("write", out, e));
        }
        let _ = fs::remove_dir_all(&old);
    } else {
        fs::rename(&tmp, out).map_err(|e| CliError::io("write", out, e))?;
    }
    guard.0 = None;
    report::print(&format!(
        "exported {} tensors ({}, step {}) to {} as a Hugging Face directory: {} weight file{}, \
         {} bytes of tensors; {}\n",
        values.len(),
        hf::config::torch_dtype(dtype),
        c.meta().step,
        escape(&out.display().to_string()),
        summary.weight_files,
        if summary.weight_files == 1 { "" } else { "s" },
        report::bytes_str(summary.tensor_bytes as usize),
        summary.files.join(", ")
    ))
}
