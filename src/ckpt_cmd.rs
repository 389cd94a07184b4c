//! `lowbit ckpt`: inspect, verify and export checkpoints written by `lowbit train --save`.

use std::collections::{HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};

use clap::{Args, Subcommand, ValueEnum};
use lowbit::ckpt::MANIFEST;
use lowbit::ckpt::{Checkpoint, LoadOptions, Manifest};
use lowbit::train::{ModelChoice, TrainConfig, apply_model_settings, layout_options, shape_of};
use lowbit_io::json::Json;
use safetensors::Dtype;

use lowbit::formats::{Copies, NanPolicy, ScaleLayout};

use crate::error::CliError;
use lowbit_io::files::{self, OutTensor};
use lowbit_io::quantize;
use lowbit_io::schema::{Recipe, Settings};

use crate::report::{self, escape};
use crate::train_report::shape_text;

/// Arguments of `lowbit ckpt`.
#[derive(Debug, Args)]
pub struct CkptArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: CkptCommand,
}

/// `lowbit ckpt` subcommands.
#[derive(Debug, Subcommand)]
pub enum CkptCommand {
    /// Print a checkpoint's step, configuration, data position, RNG state, optimizers, files
    /// and tensors (shape, pieces, bytes). DIR is a checkpoint root (its latest) or DIR/step-N.
    Inspect(InspectArgs),
    /// Check that a checkpoint loads: the manifest, every file's size, every rank file's
    /// safetensors header (readable by other tools, agreeing with the manifest), every piece's
    /// hash, that the pieces of every tensor cover it exactly once, that a `step-N` directory
    /// holds step N, and that every parameter of the `lowbit train` model its config records
    /// is stored with its shape. Exit status 1 with the file and tensor on the first failure.
    Verify(VerifyArgs),
    /// Write the full fp32 masters as one safetensors file (names are the model's parameter
    /// names), loadable by Python's safetensors and PyTorch. Expert weights are written grouped
    /// (`[experts, out, in]`) unless --discrete-experts, whatever layout the run used. With
    /// `--format hf`, a decoder checkpoint as a Hugging Face directory (config.json, tokenizer
    /// files, safetensors) that transformers loads offline.
    Export(ExportArgs),
}

/// Arguments of `lowbit ckpt inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A checkpoint root or a `step-N` directory.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `lowbit ckpt verify`.
#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// A checkpoint root or a `step-N` directory.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// Arguments of `lowbit ckpt export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint root or a `step-N` directory.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// The safetensors file to write (through a temporary file and a rename), or with `--format
    /// hf` the directory (through a temporary directory and a rename); never inside the
    /// checkpoint.
    #[arg(value_name = "OUT")]
    pub output: PathBuf,
    /// What to write: one safetensors file of the masters under the model's names, or `hf`, a
    /// Hugging Face directory of a decoder checkpoint (--dtype f32 or bf16).
    #[arg(long, value_enum, default_value_t = ExportFormat::Safetensors)]
    pub format: ExportFormat,
    /// With --format hf: shard the weights above this many bytes per file, with
    /// model.safetensors.index.json [default: 5000000000, transformers' 5GB].
    #[arg(long, value_name = "BYTES", value_parser = clap::value_parser!(u64).range(1..))]
    pub max_shard_size: Option<u64>,
    /// Element type of the weights (bf16: round to nearest even).
    #[arg(long, value_enum, default_value_t = ExportDtype::F32)]
    pub dtype: ExportDtype,
    /// One tensor per expert (`moe.experts.E.fc1.weight`) instead of grouped tensors.
    #[arg(long)]
    pub discrete_experts: bool,
    /// Overwrite OUT if it is an existing regular file (with --format hf: directory).
    #[arg(long)]
    pub force: bool,
}

/// `--format` of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// One safetensors file.
    Safetensors,
    /// A Hugging Face directory (`lowbit_llama::hf`).
    Hf,
}

/// `--dtype` of an export.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum ExportDtype {
    /// fp32, the masters' own bits.
    F32,
    /// bf16, rounded to nearest even.
    Bf16,
    /// The low-precision primary weights training computed with: the GEMM weights as
    /// `Q(bf16(master))` in MXFP8 (E4M3, 1x32 blocks, both copies, compact scales, the
    /// `lowbit quantize` layout), everything else bf16.
    Mxfp8,
    /// As `mxfp8` with NVFP4 (16x16 tiles, a global amax per tensor).
    Nvfp4,
}

/// Runs `lowbit ckpt`.
pub fn run(args: &CkptArgs) -> Result<(), CliError> {
    match &args.command {
        CkptCommand::Inspect(a) => {
            let c = open(&a.dir)?;
            let text = if a.json {
                format!("{}\n", inspect_json(&c))
            } else {
                inspect_table(&c)
            };
            report::print(&text)
        }
        CkptCommand::Verify(a) => {
            let c = open(&a.dir)?;
            c.verify().map_err(ckpt_err)?;
            let model = check_model(&c)?;
            let m = c.manifest();
            report::print(&format!(
                "ok: {} (step {}): {} tensors, {} pieces, {} bytes in {} files; every hash \
                 matches, every tensor is covered exactly once, every rank file's safetensors \
                 header agrees with the manifest{}\n",
                escape(&c.dir().display().to_string()),
                m.meta.step,
                m.tensors.len(),
                pieces(m),
                report::bytes_str(file_bytes(m) as usize),
                m.files.len(),
                model
            ))
        }
        CkptCommand::Export(a) => export(a),
    }
}

/// The parameters (name, shape) of the `lowbit train` model the manifest's config records, in
/// the expert layout it was saved in; `None` when it records none (a checkpoint of another
/// tool: its tensors are checked against the manifest only).
fn recorded_model(c: &Checkpoint) -> Result<Option<(String, Vec<Target>)>, CliError> {
    let config = &c.manifest().meta.config;
    if !config
        .keys()
        .any(|k| k == "model" || k.starts_with("model."))
    {
        return Ok(None);
    }
    let mut cfg = TrainConfig::default();
    apply_model_settings(&mut cfg, config).map_err(|e| {
        CliError::Msg(format!(
            "{}: {e}",
            escape(&c.dir().join(MANIFEST).display().to_string())
        ))
    })?;
    let u64s = |s: &[usize]| s.iter().map(|&d| d as u64).collect::<Vec<u64>>();
    Ok(Some(match &cfg.model {
        ModelChoice::Llama(run) => (
            format!("the decoder ({})", run.preset),
            lowbit_llama::params::params(&run.config)
                .into_iter()
                .map(|p| (p.name, u64s(&p.shape)))
                .collect(),
        ),
        ModelChoice::Reference => (
            "the reference model".to_string(),
            cfg.shape
                .params()
                .into_iter()
                .map(|p| (p.name, u64s(&p.shape)))
                .collect(),
        ),
    }))
}

/// Every parameter of the recorded model has its master, and every tensor stored for it (master
/// or optimizer state) has its shape: what a resume or an export reads. The text added to the
/// `ok` line.
fn check_model(c: &Checkpoint) -> Result<String, CliError> {
    let Some((what, params)) = recorded_model(c)? else {
        return Ok(String::new());
    };
    let m = c.manifest();
    let dir = c.dir().display().to_string();
    let dir = escape(&dir);
    for (name, shape) in &params {
        let master = format!("{name}/master");
        if m.tensor(&master).is_none() {
            return Err(CliError::Msg(format!(
                "{dir}: the manifest has no `{}`, a parameter of {what} its config records",
                escape(&master)
            )));
        }
        for t in m.tensors.iter().filter(|t| &t.param == name) {
            if &t.shape != shape {
                return Err(CliError::Msg(format!(
                    "{dir}: `{}` has shape {} in the manifest; {what} its config records has \
                     `{}` of shape {}",
                    escape(&t.name),
                    shape_text(&t.shape),
                    escape(name),
                    shape_text(shape)
                )));
            }
        }
    }
    Ok(format!(
        ", and it holds all {} parameters of {what} with their shapes",
        params.len()
    ))
}

fn ckpt_err(e: lowbit::ckpt::CkptError) -> CliError {
    CliError::Msg(e.to_string())
}

fn open(dir: &Path) -> Result<Checkpoint, CliError> {
    Checkpoint::open(dir).map_err(ckpt_err)
}

fn pieces(m: &Manifest) -> usize {
    m.tensors.iter().map(|t| t.pieces.len()).sum()
}

fn file_bytes(m: &Manifest) -> u64 {
    m.files.iter().map(|f| f.bytes).sum()
}

/// A JSON array of `f` of every item.
fn list<T>(items: &[T], f: impl Fn(&T) -> Json) -> Json {
    Json::Arr(items.iter().map(f).collect())
}

fn inspect_table(c: &Checkpoint) -> String {
    let m = c.manifest();
    let mut o = format!(
        "checkpoint {}: step {}, format lowbit-ckpt v{}\n",
        escape(&c.dir().display().to_string()),
        m.meta.step,
        lowbit::ckpt::FORMAT_VERSION
    );
    for (title, map) in [
        ("configuration", &m.meta.config),
        ("data position", &m.meta.data),
        ("rng", &m.meta.rng),
    ] {
        o += &format!("\n{title}\n");
        for (k, v) in map {
            o += &format!("  {:<26}{}\n", escape(k), escape(v));
        }
    }
    o += &format!("\n{:<28}{:>8}{:>8}\n", "optimizers", "owner", "steps");
    for e in &m.optimizers {
        o += &format!("  {:<26}{:>8}{:>8}\n", escape(&e.rule), e.owner, e.steps);
    }
    o += &format!("\n{:<40}{:>16}\n", "files", "bytes");
    for f in &m.files {
        o += &format!(
            "  {:<38}{:>16}\n",
            escape(&f.name),
            report::bytes_str(f.bytes as usize)
        );
    }
    o += &format!(
        "\n{:<40}{:>12}{:>6}{:>8}{:>8}{:>12}\n",
        "tensors", "shape", "dtype", "owner", "pieces", "bytes"
    );
    for t in &m.tensors {
        o += &format!(
            "  {:<38}{:>12}{:>6}{:>8}{:>8}{:>12}\n",
            escape(&t.name),
            shape_text(&t.shape),
            escape(&t.dtype),
            t.owner,
            t.pieces.len(),
            report::bytes_str((t.numel() * 4) as usize)
        );
    }
    o += &format!(
        "\ntotal: {} tensors, {} pieces, {} bytes in {} files\n",
        m.tensors.len(),
        pieces(m),
        report::bytes_str(file_bytes(m) as usize),
        m.files.len()
    );
    o
}

fn inspect_json(c: &Checkpoint) -> Json {
    let m = c.manifest();
    let map = |m: &std::collections::BTreeMap<String, String>| {
        Json::Obj(
            m.iter()
                .map(|(k, v)| (k.clone(), Json::str(v.clone())))
                .collect(),
        )
    };
    let tensors = m
        .tensors
        .iter()
        .map(|t| {
            Json::obj([
                ("name", Json::str(t.name.clone())),
                ("param", Json::str(t.param.clone())),
                ("state", Json::str(t.state.clone())),
                ("owner", Json::uint(t.owner)),
                ("shape", list(&t.shape, |&d| Json::uint(d))),
                ("dtype", Json::str(t.dtype.clone())),
                ("bytes", Json::uint(t.numel() * 4)),
                (
                    "pieces",
                    list(&t.pieces, |p| {
                        Json::obj([
                            ("file", Json::str(p.file.clone())),
                            ("start", Json::uint(p.start)),
                            ("end", Json::uint(p.end)),
                            ("fnv1a64", Json::str(format!("{:016x}", p.hash))),
                        ])
                    }),
                ),
            ])
        })
        .collect();
    Json::obj([
        ("dir", Json::str(c.dir().display().to_string())),
        ("format_version", Json::uint(lowbit::ckpt::FORMAT_VERSION)),
        ("step", Json::uint(m.meta.step)),
        ("config", map(&m.meta.config)),
        ("data", map(&m.meta.data)),
        ("rng", map(&m.meta.rng)),
        (
            "optimizers",
            list(&m.optimizers, |e| {
                Json::obj([
                    ("owner", Json::uint(e.owner)),
                    ("rule", Json::str(e.rule.clone())),
                    ("steps", Json::uint(e.steps)),
                ])
            }),
        ),
        (
            "files",
            list(&m.files, |f| {
                Json::obj([
                    ("name", Json::str(f.name.clone())),
                    ("bytes", Json::uint(f.bytes)),
                ])
            }),
        ),
        ("tensors", Json::Arr(tensors)),
        ("total_bytes", Json::uint(file_bytes(m))),
    ])
}

/// A parameter to export: its name and global shape.
type Target = (String, Vec<u64>);

/// The parameters an export writes, `(name, shape)` in the model's order, and how to read them:
/// the `lowbit train` model in the asked expert layout when the checkpoint records its shape,
/// else every stored master as it is.
fn export_targets(c: &Checkpoint, discrete: bool) -> Result<(Vec<Target>, LoadOptions), CliError> {
    let m = c.manifest();
    if let Some(shape) = shape_of(&m.meta.config, !discrete) {
        let params = shape
            .params()
            .into_iter()
            .map(|p| (p.name, p.shape.iter().map(|&d| d as u64).collect()))
            .collect();
        return Ok((params, layout_options(&shape)));
    }
    if discrete {
        return Err(CliError::Msg(format!(
            "{}: --discrete-experts needs the model shape of a `lowbit train` checkpoint, and \
             this one does not record it",
            c.dir().display()
        )));
    }
    let params = m
        .tensors
        .iter()
        .filter(|t| t.state == "master")
        .map(|t| (t.param.clone(), t.shape.clone()))
        .collect();
    Ok((params, LoadOptions::default()))
}

/// Refuses an output inside the checkpoint directory (a rank file, the manifest, or a new file
/// there) or one that is the root's `latest` or a `step-N` of it: `--force` would destroy what
/// the export reads, and a stray file in a committed checkpoint changes what it is. Checked on
/// the resolved paths (symlinks, `..`) before anything is written.
pub(crate) fn refuse_output_inside(c: &Checkpoint, output: &Path) -> Result<(), CliError> {
    let parent = match output.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // The parent must exist for the write anyway; an unresolvable one is left to it.
    let (Ok(parent), Ok(dir)) = (fs::canonicalize(&parent), fs::canonicalize(c.dir())) else {
        return Ok(());
    };
    let name = output.file_name().map(|n| n.to_string_lossy().into_owned());
    let resolved = name.as_ref().map_or(parent.clone(), |n| parent.join(n));
    let resolved = fs::canonicalize(&resolved).unwrap_or(resolved);
    let root = dir.parent().map(Path::to_path_buf);
    let in_root = root
        .as_ref()
        .is_some_and(|r| resolved.parent() == Some(r.as_path()))
        && name
            .as_deref()
            .is_some_and(|n| n == lowbit::ckpt::LATEST || n.starts_with("step-"));
    if resolved.starts_with(&dir) || in_root {
        return Err(CliError::Msg(format!(
            "output {} is inside the checkpoint {} it exports from; write it elsewhere",
            escape(&output.display().to_string()),
            escape(&c.dir().display().to_string())
        )));
    }
    Ok(())
}

fn export(a: &ExportArgs) -> Result<(), CliError> {
    let c = open(&a.dir)?;
    refuse_output_inside(&c, &a.output)?;
    if a.format == ExportFormat::Hf {
        return crate::ckpt_hf::export(a, &c);
    }
    if a.max_shard_size.is_some() {
        return Err(CliError::Msg(
            "--max-shard-size applies only with --format hf".into(),
        ));
    }
    if let Ok(meta) = fs::symlink_metadata(&a.output) {
        if !a.force {
            return Err(CliError::Msg(format!(
                "output {} already exists (pass --force to overwrite it)",
                a.output.display()
            )));
        }
        if !meta.file_type().is_file() {
            return Err(CliError::Msg(format!(
                "output {} exists and is not a regular file; --force replaces only regular files",
                a.output.display()
            )));
        }
    }
    let grouped = shape_of(&c.manifest().meta.config, true).is_some_and(|s| s.experts > 1);
    if a.dtype == ExportDtype::Nvfp4 && grouped && !a.discrete_experts {
        return Err(CliError::Msg(
            "--dtype nvfp4 would quantize a grouped expert tensor with one global amax, but \
             training keeps one per expert; pass --discrete-experts"
                .into(),
        ));
    }
    let (params, options) = export_targets(&c, a.discrete_experts)?;
    // The GEMM weights (what training stores in low precision): the model's matrices, or, in a
    // checkpoint without the model's shape, those of quantize's default rule.
    let matrices: Option<HashSet<String>> =
        shape_of(&c.manifest().meta.config, !a.discrete_experts).map(|shape| {
            shape
                .params()
                .into_iter()
                .filter(|p| p.matrix)
                .map(|p| p.name)
                .collect()
        });
    let mut tensors = Vec::with_capacity(params.len());
    for (name, shape) in params {
        let values = c
            .read_param(&name, "master", &shape, &options)
            .map_err(ckpt_err)?;
        let (dtype, data) = match a.dtype {
            ExportDtype::F32 => (
                Dtype::F32,
                values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            ),
            // Low precision: bf16 first (the quantizer's input is `bf16(master)`).
            ExportDtype::Bf16 | ExportDtype::Mxfp8 | ExportDtype::Nvfp4 => (
                Dtype::BF16,
                values
                    .iter()
                    .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                    .collect(),
            ),
        };
        let shape = shape
            .iter()
            .map(|&d| usize::try_from(d))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| CliError::Msg(format!("`{}` is too large", escape(&name))))?;
        tensors.push((name, OutTensor::owned(dtype, shape, data)));
    }
    let n = tensors.len();
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("lowbit.source".to_string(), c.dir().display().to_string()),
        ("lowbit.step".to_string(), c.meta().step.to_string()),
    ]);
    let low = match a.dtype {
        ExportDtype::Mxfp8 => Some(Recipe::Mxfp8),
        ExportDtype::Nvfp4 => Some(Recipe::Nvfp4),
        _ => None,
    };
    let bytes = files::serialize(&a.output, tensors, metadata)?;
    let Some(recipe) = low else {
        files::write_atomic(&a.output, &bytes)?;
        return report_export(a, &c, n, bytes.len());
    };
    // The bf16 file goes to a temporary beside OUT, then through `lowbit quantize` with the
    // primary-weight recipe, the GEMM weights only.
    let tmp = a.output.with_file_name(format!(
        ".{}.lowbit-export-bf16",
        a.output
            .file_name()
            .map_or_else(|| "out".into(), |f| f.to_string_lossy().into_owned())
    ));
    files::write_atomic(&tmp, &bytes)?;
    let opts = quantize::Options {
        settings: Settings {
            recipe,
            copies: Copies::Both,
            two_d: matches!(recipe, Recipe::Nvfp4),
            layout: ScaleLayout::Compact,
            nan_policy: NanPolicy::Te,
        },
        threads: 0,
        select: match matrices {
            Some(_) => lowbit_io::select::Select::all(),
            None => lowbit_io::select::Select::default(),
        },
        only: matrices,
        naming: lowbit_io::schema::Naming::Lowbit,
    };
    let r = quantize::run(&tmp, &a.output, &opts, true);
    let _ = fs::remove_file(&tmp);
    r?;
    let size = fs::metadata(&a.output)
        .map(|m| m.len() as usize)
        .unwrap_or(0);
    report_export(a, &c, n, size)
}

/// The line an export prints.
fn report_export(a: &ExportArgs, c: &Checkpoint, n: usize, size: usize) -> Result<(), CliError> {
    report::print(&format!(
        "exported {} tensors ({}, step {}) to {}: {} bytes\n",
        n,
        match a.dtype {
            ExportDtype::F32 => "f32",
            ExportDtype::Bf16 => "bf16",
            ExportDtype::Mxfp8 => "MXFP8 GEMM weights, bf16 others",
            ExportDtype::Nvfp4 => "NVFP4 GEMM weights, bf16 others",
        },
        c.meta().step,
        escape(&a.output.display().to_string()),
        report::bytes_str(size)
    ))
}
