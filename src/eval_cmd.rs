//! `lowbit eval` and `lowbit generate`: a checkpoint's weights, evaluated on held-out data or
//! continued from a prompt.
//!
//! The run is rebuilt from the checkpoint's manifest: every setting it records is passed back as
//! the `lowbit train` flag it came from, so the weights are exactly the training run's after that
//! step (Q(bf16(master)) through the same buffers and precision), on one rank by default.

use std::collections::BTreeMap;
use std::path::PathBuf;

use clap::{Args, Parser};

use lowbit::ckpt::Checkpoint;
use lowbit::train::json::Json;
use lowbit::train::{self, DeviceChoice, RunMode, Sampling, TrainConfig};

use crate::error::CliError;
use crate::train_cmd::TrainFlags;

/// Arguments of `lowbit eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// The checkpoint: a root written by `lowbit train --save DIR` (its latest) or DIR/step-N.
    #[arg(value_name = "CKPT")]
    pub checkpoint: PathBuf,
    /// Evaluate on these data instead of the training run's (token shards of `lowbit data
    /// prepare` for a decoder; a text file for the reference model).
    #[arg(long, value_name = "PATH")]
    pub data: Option<PathBuf>,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// Ranks to evaluate on (the checkpoint reshards to any count).
    #[arg(long, default_value_t = 1)]
    pub ranks: usize,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `lowbit generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The checkpoint: a root written by `lowbit train --save DIR` (its latest) or DIR/step-N.
    #[arg(value_name = "CKPT")]
    pub checkpoint: PathBuf,
    /// The text to continue.
    #[arg(long, default_value = "")]
    pub prompt: String,
    /// Tokens to generate.
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub max_new_tokens: usize,
    /// Softmax temperature; 0 decodes greedily.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Sample among the K most likely tokens only.
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Settings of a manifest that are not `lowbit train` flags of the same name, or that an eval
/// sets itself (`steps`: the checkpoint's step, which may be 0 for an `--init-from` import).
const NOT_FLAGS: [&str; 9] = [
    "steps",
    "data",
    "device",
    "ranks",
    "eval_samples",
    "experts_layout",
    "grad_dtype",
    "outer_dp",
    // An extended learning-rate schedule: nothing an eval uses.
    "schedule",
];

/// The run that saved `ckpt`, on `ranks` ranks of `device`, evaluating `data` if given.
fn config_of(
    ckpt: &std::path::Path,
    data: Option<PathBuf>,
    device: DeviceChoice,
    ranks: usize,
) -> Result<TrainConfig, CliError> {
    let c = Checkpoint::open(ckpt).map_err(|e| CliError::Msg(e.to_string()))?;
    let meta = c.meta();
    let map: &BTreeMap<String, String> = &meta.config;
    let mut argv = Vec::new();
    for (k, v) in map {
        if k.starts_with("model") || NOT_FLAGS.contains(&k.as_str()) {
            continue;
        }
        if k == "bucket_size" && v == "none" {
            continue;
        }
        argv.push(format!("--{}={v}", k.replace('_', "-")));
    }
    if let Some(g) = map.get("grad_dtype") {
        argv.push(format!("--main-grads-dtype={g}"));
    }
    if map.get("experts_layout").is_some_and(|l| l == "discrete") {
        argv.push("--discrete-experts".into());
    }
    let flags = TrainFlags::try_parse_from(&argv).map_err(|e| {
        CliError::Msg(format!(
            "{}: its settings are not those of this lowbit train: {}",
            ckpt.display(),
            e.to_string().lines().next().unwrap_or_default()
        ))
    })?;
    let mut cfg = flags.train.config()?;
    cfg.ranks = ranks;
    cfg.device = device;
    // A sample per rank at least: the eval splits its set in whole batches.
    cfg.microbatches = 1;
    cfg.batch = cfg.batch.div_ceil(ranks) * ranks;
    if let Some(n) = map.get("eval_samples").and_then(|n| n.parse().ok()) {
        cfg.eval_samples = n;
    }
    cfg.data = match data {
        Some(d) => Some(d),
        None => meta.data.get("file").map(PathBuf::from),
    };
    train::apply_model_settings(&mut cfg, map).map_err(|e| CliError::Msg(e.to_string()))?;
    Ok(cfg)
}

/// Runs `lowbit eval`.
pub fn run_eval(a: &EvalArgs) -> Result<(), CliError> {
    let cfg = config_of(&a.checkpoint, a.data.clone(), a.device, a.ranks)?;
    let report = train::from_checkpoint(&cfg, &a.checkpoint, &RunMode::Eval)
        .map_err(|e| CliError::Msg(e.to_string()))?;
    let Some(&(step, loss)) = report.evals.first() else {
        return Err(CliError::Msg("the evaluation produced no loss".into()));
    };
    let (items, _) = report.eval_set;
    let text = if a.json {
        let obj = Json::obj([
            ("checkpoint", Json::str(a.checkpoint.display().to_string())),
            ("step", Json::uint(step)),
            ("eval_loss", Json::Num(f64::from(loss))),
            (
                "eval_loss_bits",
                Json::str(format!("{:08x}", loss.to_bits())),
            ),
            ("eval_items", Json::uint(items)),
        ]);
        format!("{obj}\n")
    } else {
        format!(
            "eval loss {loss:.4} (perplexity {:.2}) over {items} held-out samples, checkpoint \
             step {step}\n",
            f64::from(loss).exp()
        )
    };
    crate::report::print(&text)
}

/// Runs `lowbit generate`.
pub fn run_generate(a: &GenerateArgs) -> Result<(), CliError> {
    let mut cfg = config_of(&a.checkpoint, None, a.device, 1)?;
    let tokenizer = train::tokenizer_of(&cfg).map_err(|e| CliError::Msg(e.to_string()))?;
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(CliError::Msg(format!(
            "--temperature {} must be a finite number >= 0 (0: greedy)",
            a.temperature
        )));
    }
    let prompt = tokenizer.encode(&a.prompt);
    let sampling = Sampling {
        prompt: prompt.clone(),
        max_new: a.max_new_tokens,
        temperature: a.temperature,
        top_k: a.top_k,
        seed: a.seed,
        stop: Some(tokenizer.eot()),
    };
    cfg.eval_samples = 1;
    let report = train::from_checkpoint(&cfg, &a.checkpoint, &RunMode::Generate(sampling))
        .map_err(|e| CliError::Msg(e.to_string()))?;
    let text = tokenizer
        .decode(&report.generated)
        .map_err(|e| CliError::Msg(e.to_string()))?;
    let out = if a.json {
        let ids = report.generated.iter().map(|&t| Json::uint(t));
        let obj = Json::obj([
            ("prompt", Json::str(a.prompt.clone())),
            ("prompt_tokens", Json::uint(prompt.len())),
            ("text", Json::str(text)),
            ("tokens", Json::Arr(ids.collect())),
        ]);
        format!("{obj}\n")
    } else {
        format!("{}{text}\n", a.prompt)
    };
    crate::report::print(&out)
}
