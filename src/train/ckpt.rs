//! Checkpoints of `lowbit train` (`--save`, `--resume`): what the manifest records about the
//! run, what a resume may change and what it refuses, and the grouped ↔ per-expert conversion.
//!
//! Decisions:
//! - The manifest's `config` records every setting that changes the model, the data or the
//!   arithmetic, under the flag's name; a resume with any other value is refused naming the flag
//!   and both values. The settings in [`MAY_CHANGE`] are recorded too but may differ: the rank
//!   count and how work is placed and overlapped (the plan reshards on load), gather on/off
//!   and the backend (same bits), and the expert layout (converted on load).
//! - `--steps` is the run's total, and the learning-rate schedule spans it, so it must match —
//!   except that a resume with `--steps` equal to the checkpoint's step runs nothing and only
//!   reports the saved masters, and that a larger `--steps` is taken with `--extend-schedule`,
//!   which says how the schedule continues ([`super::Schedule`]); an extended schedule is
//!   recorded under `schedule`, so a resume of an extended run follows it.
//! - A saving run first probes the save root (creating and removing a file in it), then holds
//!   its lock ([`lowbit_ckpt::DirLock`]) until it returns: a root that cannot be written, or
//!   that another run saves into, is refused before step 1, naming `--save` and the path.
//! - The data are a pure function of (seed, sample index) and there is no other random state,
//!   so the data position (`data.next_sample`) and the seed (`rng.seed`) are all a resumed run
//!   needs to draw exactly the straight run's batches; both are checked on resume.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use lowbit_ckpt::{Alias, Checkpoint, LoadOptions, Meta, SaveOptions};

use super::config::{TrainConfig, TrainError};
use super::lm::LmShape;
use super::schedule::Schedule;

/// Checkpointing of a run: where to save, how often, how many to keep, where to resume from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Checkpointing {
    /// Save into this root (`step-N` directories and a `latest` pointer).
    pub save: Option<PathBuf>,
    /// Save after every this many steps (0: only after the last); the last step is always saved.
    pub save_every: usize,
    /// Keep only the newest K checkpoints (`None`: all).
    pub keep: Option<usize>,
    /// Resume from this checkpoint: a root (its `latest`) or a `step-N` directory.
    pub resume: Option<PathBuf>,
    /// Save asynchronously (`lowbit_ckpt::AsyncSaver`): the state is snapshotted after the
    /// step and written while the next steps run; a save commits at the next save or at the
    /// end of the run. The files are the same bytes as a synchronous save's.
    pub asynchronous: bool,
    /// With `resume` and a `--steps` beyond the checkpoint's: how the learning-rate schedule
    /// continues (`--extend-schedule`; refused without `resume`).
    pub extend_schedule: Option<super::Extend>,
}

impl Checkpointing {
    /// Whether a run of `steps` steps saves after completing step `done` (from 1).
    pub fn saves_after(&self, done: usize, steps: usize) -> bool {
        self.save.is_some()
            && (done == steps || (self.save_every > 0 && done.is_multiple_of(self.save_every)))
    }

    /// The commit options.
    pub(super) fn options(&self) -> SaveOptions {
        SaveOptions { keep: self.keep }
    }
}

/// Keys of the manifest's `config` that a resume may change. The sharding strategy only places
/// the same state differently (the plan reshards on load, as for a change of rank count);
/// recompute and the NaN check compute the same bits.
pub const MAY_CHANGE: [&str; 11] = [
    "ranks",
    "outer_dp",
    "param_gather",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "bucket_size",
    "experts_layout",
    "device",
    "sharding",
    "recompute",
    "nan_check",
];

/// The manifest's `config` of `cfg` (see the module docs); `data` is the source's fingerprint.
pub fn config_map(cfg: &TrainConfig, data: &str) -> BTreeMap<String, String> {
    let on = |b: bool| if b { "on" } else { "off" }.to_string();
    let s = &cfg.shape;
    let counts = [
        "microbatches",
        "batch",
        "steps",
        "eval_every",
        "eval_samples",
        "ranks",
        "model.vocab",
        "model.context",
        "model.embed",
        "model.hidden",
        "model.blocks",
        "model.ffn",
        "model.experts",
        "model.top_k",
        "model.expert_ffn",
    ];
    let values = [
        cfg.microbatches,
        cfg.batch,
        cfg.steps,
        cfg.eval_every,
        cfg.eval_samples,
        cfg.ranks,
        s.vocab,
        s.context,
        s.embed,
        s.hidden,
        s.blocks,
        s.ffn,
        s.experts,
        s.top_k,
        s.expert_ffn,
    ];
    let mut m: BTreeMap<String, String> = counts
        .iter()
        .zip(values)
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    if let super::ModelChoice::Llama(run) = &cfg.model {
        // The decoder's shape instead of the reference model's.
        m.retain(|k, _| !k.starts_with("model."));
        m.extend(run.config_map());
    }
    // Under the key `--grad-dtype` always had (its alias); `compute` is kept as such.
    let grad = cfg.mixed_precision.main_grads_dtype.name();
    let device = cfg.device.name();
    let layout = if s.grouped { "grouped" } else { "discrete" };
    let bucket = cfg.bucket_size.map_or("none".into(), |b| b.to_string());
    let texts = [
        ("precision", cfg.precision.name().to_string()),
        ("grad_dtype", grad.into()),
        // The dtype the reduction rounds to changes the arithmetic (`auto`: the main grads').
        ("grad_comm_dtype", cfg.comm_dtype_name().into()),
        // Where the masters live changes the arithmetic (bf16 rounding every step).
        (
            "main_params_dtype",
            cfg.mixed_precision.main_params_dtype.name().into(),
        ),
        ("seed", cfg.seed.to_string()),
        ("lr", cfg.lr.to_string()),
        ("data", data.to_string()),
        ("optimizer", cfg.optimizer.name().to_string()),
        ("compute", cfg.compute.name().to_string()),
        // These may change (MAY_CHANGE).
        ("param_gather", on(cfg.param_gather)),
        ("overlap_grad_reduce", on(cfg.overlap_grad_reduce)),
        ("overlap_param_gather", on(cfg.overlap_param_gather)),
        ("bucket_size", bucket),
        ("experts_layout", layout.into()),
        ("device", device.into()),
        ("sharding", cfg.sharding.to_string()),
        ("outer_dp", cfg.outer_dp.to_string()),
        ("recompute", cfg.recompute.name().into()),
        ("nan_check", cfg.nan_check.name().into()),
    ];
    m.extend(texts.into_iter().map(|(k, v)| (k.to_string(), v)));
    if let Some(mu) = cfg.optimizer.muon() {
        let keys = [
            "muon_lr",
            "muon_momentum",
            "muon_ns_steps",
            "muon_lr_scale",
            "muon_ns_dtype",
            "muon_weight_decay",
        ];
        let values = [
            mu.lr.to_string(),
            mu.momentum.to_string(),
            mu.ns_steps.to_string(),
            mu.lr_scale.name().to_string(),
            mu.ns_dtype.name().to_string(),
            mu.weight_decay.to_string(),
        ];
        m.extend(keys.iter().map(|k| k.to_string()).zip(values));
    }
    if cfg.schedule.is_extended() {
        // Only extended schedules are recorded: other runs' maps are as they always were.
        m.insert("schedule".into(), cfg.schedule.to_text());
    }
    m
}

/// A config key as the user knows it: the flag, or the model's setting.
fn flag(key: &str) -> String {
    match key.strip_prefix("model.") {
        Some(k) => format!("the model's {k}"),
        None if key == "eval_samples" => "the eval set size".into(),
        None if key == "grad_dtype" => "--main-grads-dtype (--grad-dtype)".into(),
        None => format!("--{}", key.replace('_', "-")),
    }
}

/// The manifest's metadata after `done` steps.
pub(super) fn meta(cfg: &TrainConfig, data: &str, done: usize) -> Meta {
    let mut m = Meta {
        step: done as u64,
        config: config_map(cfg, data),
        ..Meta::default()
    };
    let next = done as u64 * cfg.batch as u64;
    m.data.insert("next_sample".into(), next.to_string());
    m.data
        .insert("samples_per_step".into(), cfg.batch.to_string());
    m.data.insert("source".into(), data.to_string());
    if let Some(p) = &cfg.data {
        m.data.insert("file".into(), p.display().to_string());
    }
    // Every random draw is addressed by (seed, index): this is the whole RNG state.
    m.rng.insert("seed".into(), cfg.seed.to_string());
    m.rng.insert(
        "train_stream".into(),
        "splitmix64(seed, sample index)".into(),
    );
    m.rng.insert("next_train_index".into(), next.to_string());
    m
}

/// The step `ckpt` was saved after, bounded by `--steps`' limit.
///
/// # Errors
/// [`TrainError::Checkpoint`] for a step out of range.
pub(super) fn checkpoint_step(ckpt: &Checkpoint) -> Result<usize, TrainError> {
    let step = ckpt.meta().step;
    usize::try_from(step)
        .ok()
        .filter(|&s| s <= super::config::limits::STEPS)
        .ok_or_else(|| {
            TrainError::Checkpoint(format!(
                "{}: step {step} is out of range",
                ckpt.dir().display()
            ))
        })
}

/// Checks that `ckpt` can resume `cfg` (see the module docs), sets `cfg.schedule` (the
/// checkpoint's, extended as `extend` says); returns its step.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming the flag and both values, or what else does not fit.
pub(super) fn check_resume(
    cfg: &mut TrainConfig,
    data: &str,
    ckpt: &Checkpoint,
    extend: Option<super::Extend>,
) -> Result<usize, TrainError> {
    let meta = ckpt.meta();
    let refuse = |msg: String| {
        TrainError::Checkpoint(format!(
            "cannot resume from {}: {msg}",
            ckpt.dir().display()
        ))
    };
    let step = checkpoint_step(ckpt)?;
    if cfg.steps < step {
        return Err(refuse(format!(
            "--steps {} is before the checkpoint's step {step} (--steps is the run's total)",
            cfg.steps
        )));
    }
    let schedule = resumed_schedule(cfg, ckpt, step, extend).map_err(refuse)?;
    if let Some(s) = schedule {
        cfg.schedule = s;
    }
    let here = config_map(cfg, data);
    let mut keys: Vec<&String> = here.keys().chain(meta.config.keys()).collect();
    // `--optimizer` before the settings of one optimizer; the communication dtype after the
    // main gradients' (with `auto` it follows them: name the flag that was changed).
    keys.sort_by_key(|k| (k.starts_with("muon_"), *k == "grad_comm_dtype", *k));
    keys.dedup();
    for k in keys {
        // `resumed_schedule` checked the steps and the schedule.
        if MAY_CHANGE.contains(&k.as_str()) || k == "steps" || k == "schedule" {
            continue;
        }
        let (a, mut b) = (here.get(k), meta.config.get(k));
        if k == "grad_comm_dtype" && b.is_none() {
            // Checkpoints from before `--grad-comm-dtype` reduced in the gradient dtype.
            b = meta.config.get("grad_dtype");
        }
        let fp32 = "fp32".to_string();
        if k == "main_params_dtype" && b.is_none() {
            // Checkpoints from before `--main-params-dtype` kept fp32 masters.
            b = Some(&fp32);
        }
        let exact = "exact".to_string();
        if k == "compute" && b.is_none() {
            // Checkpoints from before `--compute` computed exactly.
            b = Some(&exact);
        }
        if a != b {
            let show = |v: Option<&String>| v.map_or("(not set)".into(), |v| v.clone());
            return Err(refuse(format!(
                "{} is {} here but {} in the checkpoint",
                flag(k),
                show(a),
                show(b)
            )));
        }
    }
    let next = (step as u64 * cfg.batch as u64).to_string();
    if meta.data.get("next_sample") != Some(&next) {
        return Err(refuse(format!(
            "data position {:?}, expected next sample {next} after step {step}",
            meta.data.get("next_sample")
        )));
    }
    if meta.rng.get("seed") != Some(&cfg.seed.to_string()) {
        return Err(refuse(format!(
            "RNG seed {:?}, --seed is {}",
            meta.rng.get("seed"),
            cfg.seed
        )));
    }
    Ok(step)
}

/// The schedule a resume of `ckpt` at `step` follows: the checkpoint's (recorded under
/// `schedule`, else warmup-cosine over its `steps`), extended to `cfg.steps` when `extend` says
/// how; `None` when the resume runs nothing (`--steps` at the checkpoint's step).
///
/// # Errors
/// The refusal's text: a different `--steps` without `--extend-schedule` (naming the flag), an
/// `--extend-schedule` without a larger `--steps`, a malformed recorded schedule.
fn resumed_schedule(
    cfg: &TrainConfig,
    ckpt: &Checkpoint,
    step: usize,
    extend: Option<super::Extend>,
) -> Result<Option<Schedule>, String> {
    let config = &ckpt.meta().config;
    let recorded = config.get("steps");
    let Some(end) = recorded.and_then(|v| v.parse::<usize>().ok()) else {
        return Err(format!(
            "--steps is {} here but {} in the checkpoint",
            cfg.steps,
            recorded.map_or("(not set)", |v| v.as_str())
        ));
    };
    let old = match config.get("schedule") {
        Some(text) => {
            let s = Schedule::parse(text)?;
            s.check(end)
                .map_err(|m| format!("its learning-rate schedule: {m}"))?;
            s
        }
        None => Schedule::default(),
    };
    let kind = extend.map(|k| k.name()).unwrap_or_default();
    match extend {
        Some(_) if cfg.steps <= end => Err(format!(
            "--extend-schedule {kind} needs --steps beyond the checkpoint's schedule of {end} \
             steps (--steps is {})",
            cfg.steps
        )),
        Some(k) => {
            let new = old.extended(end, k, step, cfg.steps);
            // A manifest whose step lies beyond its own schedule cannot be extended.
            new.check(cfg.steps)
                .map_err(|m| format!("--extend-schedule {kind}: {m}"))?;
            Ok(Some(new))
        }
        // Nothing runs: the schedule does not matter.
        None if cfg.steps == step => Ok(None),
        None if cfg.steps == end => Ok(Some(old)),
        None if cfg.steps > end => Err(format!(
            "--steps is {} here but {end} in the checkpoint: a larger --steps needs \
             --extend-schedule constant (hold the final learning rate) or cosine (stretch the \
             remaining decay to the new end) to say how the schedule continues",
            cfg.steps
        )),
        None => Err(format!(
            "--steps is {} here but {end} in the checkpoint (--steps is the run's total; the \
             learning-rate schedule spans it)",
            cfg.steps
        )),
    }
}

/// Load options that assemble `shape`'s expert parameters from a checkpoint saved in the other
/// layout: per-expert tensors as slices of the grouped `[experts, out, in]` tensor, or the
/// grouped tensor as the concatenation of the per-expert ones (used only for absent tensors).
pub fn layout_options(shape: &LmShape) -> LoadOptions {
    let mut aliases = Vec::new();
    for (grouped, parts, n) in shape.expert_groups() {
        if shape.grouped {
            aliases.push(Alias::stacked(grouped, &parts, n as u64));
        } else {
            aliases.extend(Alias::unstacked(&grouped, &parts, n as u64));
        }
    }
    LoadOptions::default().with_aliases(aliases)
}

/// The model shape a checkpoint of `lowbit train` records, in `grouped` layout; `None` for a
/// checkpoint without it (not written by `lowbit train`).
pub fn shape_of(config: &BTreeMap<String, String>, grouped: bool) -> Option<LmShape> {
    let n = |k: &str| config.get(&format!("model.{k}"))?.parse::<usize>().ok();
    Some(LmShape {
        vocab: n("vocab")?,
        context: n("context")?,
        embed: n("embed")?,
        hidden: n("hidden")?,
        blocks: n("blocks")?,
        ffn: n("ffn")?,
        experts: n("experts")?,
        top_k: n("top_k")?,
        expert_ffn: n("expert_ffn")?,
        grouped,
    })
}

/// Sets `cfg`'s model from a checkpoint's `config` (the manifest's record of the run).
///
/// # Errors
/// [`TrainError::Checkpoint`] when the record names no model this build knows.
pub fn apply_model_settings(
    cfg: &mut TrainConfig,
    config: &BTreeMap<String, String>,
) -> Result<(), TrainError> {
    if let Some(run) = super::llama::LlamaRun::from_config_map(config) {
        cfg.model = super::ModelChoice::Llama(run);
        return Ok(());
    }
    if config.contains_key("model") {
        return Err(TrainError::Checkpoint(format!(
            "the checkpoint's model {:?} is not one this build knows or its settings are \
             incomplete",
            config.get("model")
        )));
    }
    let grouped = config.get("experts_layout").is_none_or(|l| l != "discrete");
    match shape_of(config, grouped) {
        Some(shape) => {
            cfg.shape = shape;
            Ok(())
        }
        None => Err(TrainError::Checkpoint(
            "the checkpoint records no model of `lowbit train` (model.* settings)".into(),
        )),
    }
}

/// Before a saving run: checks that the save root can be written ([`probe_writable`]), takes
/// its lock (held by the returned guard), removes what killed saves left in it
/// ([`lowbit_ckpt::tidy`]) and refuses a root whose published checkpoints the run would
/// collide with: any checkpoint without `--resume`, one newer than the resumed step with it.
///
/// # Errors
/// [`TrainError::Checkpoint`], naming `--save` and the root.
pub(super) fn prepare_save(
    ck: &Checkpointing,
    resumed: Option<(&Checkpoint, usize)>,
) -> Result<Option<lowbit_ckpt::DirLock>, TrainError> {
    let Some(root) = &ck.save else {
        return Ok(None);
    };
    probe_writable(root)?;
    let lock = lowbit_ckpt::DirLock::acquire(root).map_err(|e| {
        TrainError::Checkpoint(match e {
            lowbit_ckpt::CkptError::Locked { holder, .. } => format!(
                "--save {}: locked by another run saving into it{} ({}); wait for it to end or \
                 save elsewhere",
                root.display(),
                holder.map_or(String::new(), |p| format!(" (pid {p})")),
                root.join(lowbit_ckpt::lock::LOCK_FILE).display()
            ),
            e => format!("--save {}: {e}", root.display()),
        })
    })?;
    let err = |e: lowbit_ckpt::CkptError| TrainError::Checkpoint(e.to_string());
    if let Some((c, _)) = resumed
        && let Some(step) = unpublished_in(root, c.dir()).map_err(err)?
    {
        return Err(TrainError::Checkpoint(format!(
            "cannot resume from {}: step-{step} was committed but never published in {} (a \
             save killed before `latest` was updated); resume from {} (its latest)",
            c.dir().display(),
            root.display(),
            root.display()
        )));
    }
    lowbit_ckpt::tidy(root).map_err(err)?;
    let published = lowbit_ckpt::committed_steps(root).map_err(err)?;
    let after = resumed.map_or(0, |(_, s)| s as u64);
    if let Some((n, _)) = published
        .iter()
        .rev()
        .find(|(n, _)| resumed.is_none() || *n > after)
    {
        return Err(TrainError::Checkpoint(match resumed {
            None => format!(
                "--save {} already holds checkpoints (up to step-{n}); pass --resume {} to \
                 continue from its latest, or save into another directory",
                root.display(),
                root.display()
            ),
            Some(_) => format!(
                "--save {} holds step-{n}, newer than the resumed step {after}; saving would \
                 collide with it: resume from it, or save into another directory",
                root.display()
            ),
        }));
    }
    Ok(Some(lock))
}

/// Creates the save root if absent, then creates and removes a file in it, so that a root that
/// is read-only, a file, or under a non-directory fails before step 1 rather than at the first
/// save.
///
/// # Errors
/// [`TrainError::Checkpoint`] naming `--save`, the path and the cause.
fn probe_writable(root: &Path) -> Result<(), TrainError> {
    let refuse = |what: &str, e: &dyn std::fmt::Display| {
        TrainError::Checkpoint(format!("--save {}: {what}: {e}", root.display()))
    };
    if let Ok(m) = std::fs::metadata(root)
        && !m.is_dir()
    {
        return Err(TrainError::Checkpoint(format!(
            "--save {}: not a directory (it exists, as a file)",
            root.display()
        )));
    }
    std::fs::create_dir_all(root).map_err(|e| refuse("cannot create the directory", &e))?;
    // Unique to this process and instant: a probe left by a killed run never blocks this one.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let probe = root.join(format!(".lowbit-probe-{}-{nanos}", std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
        .map_err(|e| refuse("the directory cannot be written", &e))?;
    std::fs::remove_file(&probe).map_err(|e| refuse("cannot remove the probe file", &e))?;
    Ok(())
}

/// The step of `dir` if it is a committed `step-N` directly under `root` that `root`'s `latest`
/// does not publish (N beyond it).
fn unpublished_in(root: &Path, dir: &Path) -> lowbit_ckpt::Result<Option<u64>> {
    let (Ok(root_c), Ok(dir_c)) = (root.canonicalize(), dir.canonicalize()) else {
        return Ok(None);
    };
    if dir_c.parent() != Some(root_c.as_path()) {
        return Ok(None);
    }
    let latest = lowbit_ckpt::latest_step(root)?;
    let step = lowbit_ckpt::committed_steps(root)?
        .into_iter()
        .find(|(_, p)| p.canonicalize().is_ok_and(|p| p == dir_c))
        .map(|(n, _)| n);
    Ok(step.filter(|&n| latest.is_none_or(|l| n > l)))
}
