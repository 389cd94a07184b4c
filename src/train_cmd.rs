//! `lowbit train`: arguments, the progress line, the closing table and the `--json` object.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use clap::{Args, ValueEnum};
use lowbit::comm::CommStats;
use lowbit::optim::{MuonLrScale, NsDtype, RankMemory};
use lowbit::train::json::Json;
use lowbit::train::{
    self, CommDtype, Compute, DeviceChoice, FineGrainedGather, MainGradsDtype, MainParamsDtype,
    MixedPrecisionPolicy, MuonSettings, NanCheck, OptimizerChoice, OuterSharding, ParamOwner,
    Precision, Sharding, StepLog, TrainConfig, TrainReport,
};
use lowbit::train::{LlamaRun, ModelChoice};
use lowbit_llama::LlamaConfig;

use crate::error::CliError;
use crate::report;

/// Arguments of `lowbit train`. Defaults: the embedded CPU run (4 ranks, MXFP8 primary weights
/// with staged gathers, overlapped reduction and gathers, distributed AdamW, 200 steps).
///
/// The `--muon-*` flags apply only with `--optimizer muon` and are refused otherwise; their
/// defaults are [`MuonSettings::default`], the values tuned on the reference task.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// Read flags from FILE.toml: its [train] table holds flags by their long names (`steps =
    /// 400`, `precision = "nvfp4"`, `param_gather = false`), its [model] table a decoder's shape;
    /// flags on the command line win.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Data-parallel ranks: threads on the CPU [default: 4], GPUs with --device cuda [default:
    /// every visible GPU; under a launcher such as torchrun, its WORLD_SIZE, one rank per
    /// process].
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Weight precision of the GEMMs.
    #[arg(long, value_enum, default_value_t = Precision::Mxfp8)]
    pub precision: Precision,
    /// Keep low-precision primary weights and gather them as such (staged in the gradient
    /// buffer); off: bf16 weights quantized on the fly [default: on for mxfp8/nvfp4, off for
    /// bf16].
    #[arg(long, value_enum)]
    pub param_gather: Option<OnOff>,
    /// Reduce gradient buckets while the backward runs.
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    pub overlap_grad_reduce: OnOff,
    /// Gather parameter buckets lazily in the next forward [default: as
    /// --overlap-grad-reduce; off with --sharding no_shard, which gathers nothing].
    #[arg(long, value_enum)]
    pub overlap_param_gather: Option<OnOff>,
    /// What the data-parallel ranks shard (Megatron-FSDP's strategies): no_shard (nothing;
    /// gradients all-reduced), optim (optimizer state: the distributed optimizer), optim_grads
    /// (and gradients, reduce-scattered every microbatch), optim_grads_params (and parameters,
    /// gathered per use).
    #[arg(long, value_enum, default_value_t = Sharding::Optim)]
    pub sharding: Sharding,
    /// dtype of the main (optimizer) parameters: fp32, bf16 (half the bytes; each step's result
    /// is rounded to bf16) or none (the bf16 compute weights are the main parameters: needs
    /// weights stored in bf16, --precision bf16 or --param-gather off); --optimizer muon keeps
    /// fp32.
    #[arg(long, value_enum, default_value_t = MainParamsDtype::Fp32)]
    pub main_params_dtype: MainParamsDtype,
    /// dtype of the main gradients (the gradient buffers, where microbatches accumulate):
    /// fp32, bf16, or compute (the weights' compute dtype: bf16 here) [default: fp32].
    #[arg(long, value_enum)]
    pub main_grads_dtype: Option<MainGradsDtype>,
    /// Alias of --main-grads-dtype (fp32 or bf16); give one of the two.
    #[arg(long, value_enum)]
    pub grad_dtype: Option<GradArg>,
    /// dtype gradients are reduced in (auto: the main-gradient dtype; bf16 halves the bytes on
    /// the wire, summed in f32 and rounded once).
    #[arg(long, value_enum, default_value_t = CommDtype::MainGrads)]
    pub grad_comm_dtype: CommDtype,
    /// Check gradients for NaN/Inf before each reduction: grad (the error names the first
    /// non-finite parameter and the rank), param (every non-finite parameter), or off.
    #[arg(long, value_enum, default_value_t = NanCheck::Off)]
    pub nan_check: NanCheck,
    /// Gather only the rowwise (forward) or columnwise (backward) copy of MXFP8 weights gathered
    /// per use by optim_grads_params (auto: on with --recompute on).
    #[arg(long, value_enum, default_value_t = FineGrainedGather::Auto)]
    pub fine_grained_param_gather: FineGrainedGather,
    /// Replica groups of hybrid sharding: N must divide --ranks, which split into N groups of
    /// --ranks/N, each sharding as --sharding and reducing across the groups as
    /// --outer-sharding says (1: flat sharding; not with --optimizer muon).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub outer_dp: usize,
    /// What the replica groups of hybrid sharding shard: no_shard (HSDP) or optim (HFSDP: needs
    /// --sharding optim_grads_params and bf16 weights) [default: no_shard; needs --outer-dp >
    /// 1].
    #[arg(long, value_enum)]
    pub outer_sharding: Option<OuterSharding>,
    /// Recompute the dense blocks' activations in the backward instead of keeping them (same
    /// bits, less activation memory).
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    pub recompute: OnOff,
    /// Bucket size in elements, with --overlap-grad-reduce on [default: 40000].
    #[arg(long)]
    pub bucket_size: Option<usize>,
    /// The model: `reference` (the MoE toy on a Markov source or a file's bytes) or a Llama
    /// decoder preset (llama-tiny, llama-125m, llama-1b, llama-8b-layers) on token data
    /// (--data DIR from `lowbit data prepare`; without it, the embedded text sample,
    /// byte-tokenized); a --config file's [model] table changes any of the preset's shapes.
    #[arg(long, value_name = "NAME", default_value = "reference")]
    pub model: String,
    /// Tokens per sample of a decoder [default: 64 for llama-tiny, 1024 for llama-125m, 2048 for
    /// llama-1b, 4096 for llama-8b-layers, at most the model's max_seq].
    #[arg(long, value_name = "N")]
    pub seq: Option<usize>,
    /// Decoder layers (llama-8b-layers: Llama-3-8B's layer shapes, 4 by default).
    #[arg(long, value_name = "N")]
    pub layers: Option<usize>,
    /// Eval samples (a decoder's: validation windows) [default: 4096 for the reference model, 64
    /// for a decoder].
    #[arg(long, value_name = "N")]
    pub eval_samples: Option<usize>,
    /// Microbatches per step (gradient accumulation).
    #[arg(long, default_value_t = TrainConfig::default().microbatches)]
    pub microbatches: usize,
    /// Samples per step over all ranks (split over ranks x microbatches; a decoder's samples are
    /// sequences) [default: 512 for the reference model, 16 for a decoder].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Peak AdamW learning rate: linear warmup over the first 5% of the steps, then cosine
    /// decay to a tenth of it [default: 0.01 for the reference model, 0.003 for a decoder].
    #[arg(long)]
    pub lr: Option<f32>,
    /// Optimizer steps.
    #[arg(long, default_value_t = TrainConfig::default().steps)]
    pub steps: usize,
    /// Evaluate on held-out samples every N steps (0: only at the end).
    #[arg(long, default_value_t = TrainConfig::default().eval_every)]
    pub eval_every: usize,
    /// Seed of the source, the data order and the initial weights.
    #[arg(long, default_value_t = TrainConfig::default().seed)]
    pub seed: u64,
    /// Backend.
    #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
    pub device: DeviceChoice,
    /// How the model's GEMMs compute: exact (the reference f32 products, the same bits on the
    /// CPU and CUDA) or bf16 (bf16 operands on the tensor cores, f32 accumulation: the fast
    /// mode; with --optimizer muon and --muon-ns-dtype bf16, Newton-Schulz on the tensor cores
    /// too).
    #[arg(long, value_enum, default_value_t = Compute::Exact)]
    pub compute: Compute,
    /// Train on the bytes of this file (vocabulary 256, last tenth held out) instead of the
    /// Markov source.
    #[arg(long, value_name = "FILE")]
    pub data: Option<PathBuf>,
    /// Expert weights as one parameter per expert instead of one grouped tensor (same bits).
    #[arg(long)]
    pub discrete_experts: bool,
    /// Optimizer of the GEMM weights. adamw: distributed AdamW on every parameter. muon: Muon
    /// on the hidden matrices and the expert weights (each matrix owned whole by one rank, the
    /// plan's layer-wise rule; grouped experts orthogonalized per expert), chained with
    /// distributed AdamW on the embedding, head, norms, biases and router.
    #[arg(long, value_enum, default_value_t = OptimizerArg::Adamw)]
    pub optimizer: OptimizerArg,
    /// Muon's peak learning rate, on --lr's schedule (warmup, cosine to a tenth) [default:
    /// 0.03].
    #[arg(long, value_name = "X")]
    pub muon_lr: Option<f32>,
    /// Muon's momentum, in [0, 1) (Nesterov) [default: 0.85].
    #[arg(long, value_name = "X")]
    pub muon_momentum: Option<f32>,
    /// Newton-Schulz iterations per step, 1 to 99 [default: 5].
    #[arg(long, value_name = "N")]
    pub muon_ns_steps: Option<u32>,
    /// How Muon scales the learning rate of an out x in matrix: original = max(1, out/in)^0.5,
    /// match_rms_adamw = 0.2 max(out, in)^0.5, spectral = max(out, in)^0.5 (Megatron)
    /// [default: original].
    #[arg(long, value_enum, value_name = "RULE")]
    pub muon_lr_scale: Option<MuonLrScale>,
    /// dtype of the Newton-Schulz iterate: f32 (bit-identical on CPU and CUDA) or bf16
    /// (torch.optim.Muon's roundings) [default: f32].
    #[arg(long, value_enum, value_name = "DTYPE")]
    pub muon_ns_dtype: Option<NsDtype>,
    /// Muon's decoupled weight decay, finite and >= 0 [default: 0].
    #[arg(long, value_name = "X")]
    pub muon_weight_decay: Option<f32>,
    /// Print one JSON object on stdout instead of the table (the progress line stays on
    /// stderr). Every timing field is under the one key "timing" (wall_s, phases_s), so the rest
    /// of the object is byte-identical between runs with the same flags.
    #[arg(long)]
    pub json: bool,
    /// Keep going when the training or eval loss is not finite (a diverged run); without it the
    /// run stops at the first NaN or infinite loss with an error and exit status 1.
    #[arg(long)]
    pub allow_non_finite: bool,
    /// Save checkpoints into DIR (`DIR/step-N`, `DIR/latest`): after the last step, and every
    /// --save-every steps. Masters and optimizer state, sharded by rank; committed atomically.
    #[arg(long, value_name = "DIR")]
    pub save: Option<PathBuf>,
    /// Save after every N steps too (0: only after the last) [needs --save].
    #[arg(long, value_name = "N", requires = "save")]
    pub save_every: Option<usize>,
    /// Keep only the newest K checkpoints in --save DIR [default: all; needs --save].
    #[arg(long, value_name = "K", requires = "save",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub keep: Option<u64>,
    /// Save asynchronously: snapshot the state after the step and write it while the next
    /// steps run (committed at the next save or at the end) [needs --save].
    #[arg(long, requires = "save")]
    pub async_save: bool,
    /// Resume from a checkpoint: DIR (its latest) or DIR/step-N. --steps stays the run's total;
    /// flags that change the model, the data or the arithmetic must match the checkpoint's
    /// (refused otherwise, naming the flag; --main-grads-dtype and --grad-comm-dtype among them);
    /// --ranks, --sharding, --param-gather, the overlap flags, --bucket-size,
    /// --discrete-experts, --recompute, --nan-check and --device may change.
    #[arg(long, value_name = "PATH")]
    pub resume: Option<PathBuf>,
}

/// The flags of `lowbit train` as a parser of their own: to check a config file's flags, and to
/// read a checkpoint's settings back.
#[derive(Debug, clap::Parser)]
#[command(name = "lowbit train", no_binary_name = true)]
pub struct TrainFlags {
    /// The flags.
    #[command(flatten)]
    pub train: TrainArgs,
}

/// `on` / `off`: the command line's spelling of the library's booleans (no library enum).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OnOff {
    /// Enabled.
    On,
    /// Disabled.
    Off,
}

impl OnOff {
    fn on(self) -> bool {
        self == OnOff::On
    }
}

/// `--grad-dtype`: the older spelling of `--main-grads-dtype`, kept to the two dtypes it always
/// took (the library's `MainGradsDtype` adds `compute`, which only the new flag accepts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GradArg {
    /// fp32 gradient buffers.
    Fp32,
    /// bf16 gradient buffers.
    Bf16,
}

/// `--optimizer`. A command-line tag, not a library enum: the library's choice
/// ([`OptimizerChoice`]) carries Muon's settings, which come from the `--muon-*` flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerArg {
    /// Distributed AdamW on every parameter.
    Adamw,
    /// Muon (layer-wise) on the hidden matrices and experts, distributed AdamW on the rest.
    Muon,
}

impl TrainArgs {
    /// The checkpointing these arguments ask for.
    pub fn checkpointing(&self) -> train::Checkpointing {
        train::Checkpointing {
            save: self.save.clone(),
            save_every: self.save_every.unwrap_or(0),
            keep: self.keep.map(|k| usize::try_from(k).unwrap_or(usize::MAX)),
            resume: self.resume.clone(),
            asynchronous: self.async_save,
        }
    }

    /// Muon's settings from the flags, or the refusal of `--muon-*` flags without `--optimizer
    /// muon` (they would silently do nothing). Values are checked by [`TrainConfig::validate`].
    fn optimizer(&self) -> Result<OptimizerChoice, CliError> {
        let given = [
            ("--muon-lr", self.muon_lr.is_some()),
            ("--muon-momentum", self.muon_momentum.is_some()),
            ("--muon-ns-steps", self.muon_ns_steps.is_some()),
            ("--muon-lr-scale", self.muon_lr_scale.is_some()),
            ("--muon-ns-dtype", self.muon_ns_dtype.is_some()),
            ("--muon-weight-decay", self.muon_weight_decay.is_some()),
        ];
        if self.optimizer == OptimizerArg::Adamw {
            if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
                return Err(CliError::Msg(format!(
                    "invalid configuration: {flag} applies only with --optimizer muon (the \
                     optimizer is adamw)"
                )));
            }
            return Ok(OptimizerChoice::AdamW);
        }
        let d = MuonSettings::default();
        Ok(OptimizerChoice::Muon(MuonSettings {
            lr: self.muon_lr.unwrap_or(d.lr),
            momentum: self.muon_momentum.unwrap_or(d.momentum),
            ns_steps: self.muon_ns_steps.unwrap_or(d.ns_steps),
            lr_scale: self.muon_lr_scale.unwrap_or(d.lr_scale),
            ns_dtype: self.muon_ns_dtype.unwrap_or(d.ns_dtype),
            weight_decay: self.muon_weight_decay.unwrap_or(d.weight_decay),
        }))
    }

    /// The model `--model`, `--seq`, `--layers` and the `--config` file's `[model]` table ask for.
    fn model_choice(&self) -> Result<ModelChoice, CliError> {
        let table = match &self.config {
            Some(path) => crate::config_file::read_table(path)?
                .get("model")
                .cloned()
                .map(|m| (path, m)),
            None => None,
        };
        if self.model == "reference" {
            let given = [
                ("--seq", self.seq.is_some()),
                ("--layers", self.layers.is_some()),
                ("a [model] table in --config", table.is_some()),
            ];
            if let Some((what, _)) = given.iter().find(|(_, g)| *g) {
                return Err(CliError::Msg(format!(
                    "invalid configuration: {what} applies only to a decoder (--model llama-*)"
                )));
            }
            return Ok(ModelChoice::Reference);
        }
        let bad = |m: String| CliError::Msg(format!("invalid configuration: {m}"));
        let mut config = match &table {
            Some((path, m)) => {
                let Some(t) = m.as_table() else {
                    return Err(bad(format!("{}: `model` must be a table", path.display())));
                };
                let mut t = t.clone();
                // The table's fields apply over --model's preset unless it names its own.
                t.entry("preset")
                    .or_insert_with(|| toml::Value::String(self.model.clone()));
                LlamaConfig::from_toml_table(&t, &path.display().to_string())
                    .map_err(|e| bad(e.to_string()))?
            }
            None => LlamaConfig::preset(&self.model)
                .map_err(|e| bad(format!("--model {}: {e} (or `reference`)", self.model)))?,
        };
        if let Some(n) = self.layers {
            config.layers = n;
        }
        // A given --seq is checked against max_seq; the default fits it.
        let seq = self.seq.unwrap_or_else(|| {
            let d = match self.model.as_str() {
                "llama-125m" => 1024,
                "llama-1b" => 2048,
                "llama-8b-layers" => 4096,
                _ => 64,
            };
            d.min(config.max_seq)
        });
        Ok(ModelChoice::Llama(LlamaRun {
            preset: self.model.clone(),
            seq,
            config,
        }))
    }

    /// The mixed-precision policy, or the refusal of both `--main-grads-dtype` and its alias
    /// `--grad-dtype` (which one would win is not obvious).
    fn mixed_precision(&self) -> Result<MixedPrecisionPolicy, CliError> {
        let main_grads = match (self.main_grads_dtype, self.grad_dtype) {
            (Some(_), Some(_)) => {
                return Err(CliError::Msg(
                    "invalid configuration: --grad-dtype is an alias of --main-grads-dtype; \
                     give only one of them"
                        .into(),
                ));
            }
            (Some(m), None) => m,
            (None, Some(GradArg::Fp32)) | (None, None) => MainGradsDtype::Fp32,
            (None, Some(GradArg::Bf16)) => MainGradsDtype::Bf16,
        };
        Ok(MixedPrecisionPolicy::default()
            .with_main_params_dtype(self.main_params_dtype)
            .with_main_grads_dtype(main_grads)
            .with_grad_comm_dtype(self.grad_comm_dtype))
    }

    /// The run these arguments describe.
    ///
    /// # Errors
    /// `--muon-*` flags without `--optimizer muon`; both `--main-grads-dtype` and
    /// `--grad-dtype`.
    pub fn config(&self) -> Result<TrainConfig, CliError> {
        let (precision, sharding) = (self.precision, self.sharding);
        let d = TrainConfig::default();
        let model = self.model_choice()?;
        let mut shape = d.shape;
        shape.grouped = !self.discrete_experts;
        Ok(TrainConfig {
            ranks: self.ranks.unwrap_or(match self.device {
                DeviceChoice::Cpu => d.ranks,
                // Under a launcher, its world; else every local GPU, at least one, so that a
                // machine without GPUs gets the device's own error.
                DeviceChoice::Cuda => train::launched_world_size()
                    .map_err(|e| CliError::Msg(e.to_string()))?
                    .unwrap_or_else(|| train::gpu_count().max(1)),
            }),
            precision,
            param_gather: self
                .param_gather
                .map_or(precision != Precision::Bf16, OnOff::on),
            overlap_grad_reduce: self.overlap_grad_reduce.on(),
            // no_shard gathers nothing, so there is nothing to overlap by default.
            overlap_param_gather: self.overlap_param_gather.map_or(
                self.overlap_grad_reduce.on() && sharding != Sharding::NoShard,
                OnOff::on,
            ),
            sharding,
            mixed_precision: self.mixed_precision()?,
            nan_check: self.nan_check,
            fine_grained: self.fine_grained_param_gather,
            outer_dp: self.outer_dp,
            outer_sharding: self.outer_sharding,
            recompute: self.recompute.on(),
            bucket_size: match self.bucket_size {
                Some(b) => Some(b),
                None if self.overlap_grad_reduce.on() => d.bucket_size,
                None => None,
            },
            microbatches: self.microbatches,
            batch: self.batch.unwrap_or(match model {
                ModelChoice::Reference => d.batch,
                ModelChoice::Llama(_) => 16,
            }),
            eval_samples: self.eval_samples.unwrap_or(match model {
                ModelChoice::Reference => d.eval_samples,
                ModelChoice::Llama(_) => 64,
            }),
            steps: self.steps,
            eval_every: self.eval_every,
            seed: self.seed,
            device: self.device,
            data: self.data.clone(),
            lr: self.lr.unwrap_or(match model {
                ModelChoice::Reference => d.lr,
                ModelChoice::Llama(_) => 3e-3,
            }),
            allow_non_finite: self.allow_non_finite,
            optimizer: self.optimizer()?,
            compute: self.compute,
            shape,
            model,
        })
    }
}

/// Runs `lowbit train`.
pub fn run(args: &TrainArgs) -> Result<(), CliError> {
    let cfg = args.config()?;
    let launched = train::launched_world_size().map_err(|e| CliError::Msg(e.to_string()))?;
    if cfg.device == DeviceChoice::Cpu
        && let Some(world) = launched
        && world > 1
    {
        // Each of the launcher's processes would run the same whole job: N duplicate runs.
        return Err(CliError::Msg(format!(
            "invalid configuration: WORLD_SIZE={world} (a launcher such as torchrun) with \
             --device cpu: CPU ranks are threads of one process, so every process would run \
             the same job; launch one process and pass --ranks {world}, or use --device cuda"
        )));
    }
    if cfg.device == DeviceChoice::Cuda && launched.is_some() {
        // One rank per process: a rank ended by SIGINT/SIGTERM/SIGHUP tells its peers so on its
        // way out, over the liveness channel (`lowbit_comm::liveness`).
        lowbit::comm::liveness::install_signal_goodbye();
    }
    let tty = std::io::stderr().is_terminal();
    let progress = |s: &StepLog| {
        let eval = s.eval.map(|v| format!("  eval {v:.4}")).unwrap_or_default();
        let line = format!(
            "step {:>4}/{}  loss {:.4}{eval}  {:.0} tok/s",
            s.step, s.steps, s.loss, s.tokens_per_s
        );
        let mut err = std::io::stderr().lock();
        if tty {
            let width = 30;
            let done = width * s.step / s.steps.max(1);
            let bar = format!("[{}{}]", "#".repeat(done), ".".repeat(width - done));
            let _ = write!(err, "\r{bar} {line}\x1b[K");
            if s.step == s.steps {
                let _ = writeln!(err);
            }
        } else if s.eval.is_some() {
            // Not a terminal: one line per evaluation.
            let _ = writeln!(err, "{line}");
        }
    };
    let report = train::train_with(&cfg, &args.checkpointing(), &progress)
        .map_err(|e| CliError::Msg(e.to_string()))?;
    if cfg.device == train::DeviceChoice::Cuda
        && train::launched_rank().map_err(|e| CliError::Msg(e.to_string()))? != 0
    {
        // One process per rank under a launcher: rank 0 reports for the world.
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    let text = if args.json {
        format!("{}\n", to_json(&report))
    } else {
        render(&report)
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::Msg(format!("cannot write to stdout: {e}")))
}

fn mib(b: usize) -> String {
    if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.1} KiB", b as f64 / 1024.0)
    }
}

fn memory_rows(m: &RankMemory) -> [(&'static str, usize); 6] {
    [
        ("weights", m.weights()),
        ("staging (aliases grads)", m.staging()),
        ("grads", m.grads()),
        ("fp32 masters", m.masters),
        ("optimizer state", m.optimizer_state + m.grad_scratch),
        ("total", m.total()),
    ]
}

fn comm_rows(c: &CommStats) -> [(&'static str, u64, u64); 4] {
    [
        ("all-gather", c.all_gather.calls, c.all_gather.bytes),
        (
            "reduce-scatter",
            c.reduce_scatter.calls,
            c.reduce_scatter.bytes,
        ),
        ("all-reduce", c.all_reduce.calls, c.all_reduce.bytes),
        ("broadcast", c.broadcast.calls, c.broadcast.bytes),
    ]
}

/// The optimizers in words.
fn describe_optimizer(cfg: &TrainConfig) -> String {
    match &cfg.optimizer {
        OptimizerChoice::AdamW => "distributed AdamW".into(),
        OptimizerChoice::Muon(m) => format!(
            "Muon layer-wise (lr {}, {} scale, momentum {} Nesterov, {} NS steps {}, weight \
             decay {}) + distributed AdamW",
            m.lr,
            m.lr_scale.name(),
            m.momentum,
            m.ns_steps,
            m.ns_dtype.name(),
            m.weight_decay
        ),
    }
}

fn describe(cfg: &TrainConfig) -> String {
    let on = |b: bool| if b { "on" } else { "off" };
    let mp = &cfg.mixed_precision;
    format!(
        "{} ranks on {}, sharding {}, {} weights (primary low-precision gather {}), main params \
         {}, grads {}, grad comm {}, overlap grad reduce {} / param gather {}, recompute {}, \
         nan check {}, {}, compute {}",
        cfg.ranks,
        cfg.device.name(),
        cfg.sharding,
        cfg.precision.name(),
        on(cfg.param_gather),
        mp.main_params_dtype.name(),
        mp.main_grads_dtype.name(),
        cfg.comm_dtype_name(),
        on(cfg.overlap_grad_reduce),
        on(cfg.overlap_param_gather),
        on(cfg.recompute),
        cfg.nan_check.name(),
        describe_optimizer(cfg),
        cfg.compute.name(),
    )
}

/// The model as the `--json` object's `"model"`: its name, and a decoder's shape and sequence
/// length.
fn model_json(c: &TrainConfig) -> Json {
    match &c.model {
        ModelChoice::Reference => Json::obj([("name", Json::str("reference"))]),
        ModelChoice::Llama(run) => {
            let m = &run.config;
            Json::obj([
                ("name", Json::str(run.preset.clone())),
                ("seq", Json::uint(run.seq)),
                ("vocab", Json::uint(m.vocab)),
                ("dim", Json::uint(m.dim)),
                ("layers", Json::uint(m.layers)),
                ("heads", Json::uint(m.heads)),
                ("kv_heads", Json::uint(m.kv_heads)),
                ("head_dim", Json::uint(m.head_dim)),
                ("ffn", Json::uint(m.ffn)),
                ("tied", Json::Bool(m.tied)),
            ])
        }
    }
}

/// The sharding strategy and precision policy as the `--json` object's `"fsdp"`.
fn fsdp_json(cfg: &TrainConfig) -> Json {
    let mp = &cfg.mixed_precision;
    Json::obj([
        ("sharding", Json::str(cfg.sharding.as_str())),
        ("main_params_dtype", Json::str(mp.main_params_dtype.name())),
        ("main_grads_dtype", Json::str(mp.main_grads_dtype.name())),
        ("grad_comm_dtype", Json::str(mp.grad_comm_dtype.name())),
        // `auto` resolved: the dtype the reduction rounds to.
        (
            "grad_comm_dtype_effective",
            Json::str(cfg.comm_dtype_name()),
        ),
        ("nan_check", Json::str(cfg.nan_check.name())),
        (
            "fine_grained_param_gather",
            Json::str(cfg.fine_grained.name()),
        ),
        (
            "fine_grained_effective",
            Json::Bool(cfg.fine_grained_on().0),
        ),
        ("outer_dp", Json::uint(cfg.outer_dp)),
        (
            "outer_sharding",
            cfg.outer_sharding
                .map_or(Json::Null, |s| Json::str(s.name())),
        ),
        ("recompute", Json::Bool(cfg.recompute)),
    ])
}

/// Ranks as text: `0-3`, `0,2`, `2`.
fn ranks_text(ranks: &[usize]) -> String {
    match ranks {
        [] => "-".into(),
        [r] => r.to_string(),
        [first, .., last] if last - first + 1 == ranks.len() => format!("{first}-{last}"),
        _ => ranks
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(","),
    }
}

/// A shape as text: `8x64`.
pub fn shape_text<T: ToString>(shape: &[T]) -> String {
    shape
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("x")
}

/// Who updates which parameter: one line each, then Muon's work per rank.
fn render_owners(r: &TrainReport) -> String {
    let mut o = format!(
        "{:<28}{:>10}  {:<10}{:>7}  {}\n",
        "optimizer per parameter", "shape", "optimizer", "decay", "ranks (fp32 master and state)"
    );
    for p in &r.owners {
        let ranks = if p.optimizer == "muon" {
            format!("{} (layer-wise: whole)", ranks_text(&p.ranks))
        } else {
            format!("{} (distributed)", ranks_text(&p.ranks))
        };
        o += &format!(
            "  {:<26}{:>10}  {:<10}{:>7}  {ranks}\n",
            p.name,
            shape_text(&p.shape),
            p.optimizer,
            p.weight_decay
        );
    }
    if !r.muon_ranks.is_empty() {
        o += &format!(
            "\n{:<28}{:>10}{:>10}{:>10}\n",
            "muon work per rank", "params", "matrices", "elements"
        );
        for l in &r.muon_ranks {
            let name = format!("rank {}", l.rank);
            if l.params == 0 {
                o += &format!("  {name:<26}  idle: owns no Muon matrix\n");
            } else {
                o += &format!(
                    "  {name:<26}{:>10}{:>10}{:>10}\n",
                    l.params, l.matrices, l.elements
                );
            }
        }
    }
    o
}

/// The closing table.
pub fn render(r: &TrainReport) -> String {
    let c = &r.config;
    let s = &c.shape;
    let mut o = String::new();
    o += &format!("lowbit train: {}\n", describe(c));
    if let ModelChoice::Llama(run) = &c.model {
        let m = &run.config;
        o += &format!(
            "model: {} ({} parameters; vocab {}, dim {}, {} layers, {} heads / {} kv heads of \
             {}, ffn {}, {} head); batch {} x {} tokens x {} steps\n\n",
            run.preset,
            r.params,
            m.vocab,
            m.dim,
            m.layers,
            m.heads,
            m.kv_heads,
            m.head_dim,
            m.ffn,
            if m.tied { "tied" } else { "untied" },
            c.batch,
            run.seq,
            c.steps
        );
    } else {
        o += &format!(
            "model: {} parameters; vocab {}, context {}, {} dense blocks, MoE {} experts top-{} \
         ({}); batch {} x {} steps\n\n",
            r.params,
            s.vocab,
            s.context,
            s.blocks,
            s.experts,
            s.top_k,
            if s.grouped {
                "grouped weights"
            } else {
                "per-expert weights"
            },
            c.batch,
            c.steps
        );
    }
    if let Some(dir) = &r.resumed_from {
        o += &format!(
            "resumed from {} (step {}): {} steps run\n",
            report::escape(&dir.display().to_string()),
            r.first_step,
            r.losses.len()
        );
    }
    if let Some(last) = r.saved.last() {
        o += &format!(
            "checkpoints saved: {}, the last {}\n",
            r.saved.len(),
            report::escape(&last.display().to_string())
        );
    }
    if r.resumed_from.is_some() || !r.saved.is_empty() {
        o += "\n";
    }
    // A resume at the final step runs nothing: no loss, only the saved masters' checksum.
    let final_loss = r.losses.last().map_or("-".into(), |l| format!("{l:.4}"));
    let final_eval = r.evals.last().map(|e| e.1);
    let eval_text = final_eval.map_or("-".into(), |v| format!("{v:.4}"));
    o += &format!("{:<28}{:>12}\n", "final train loss", final_loss);
    o += &format!("{:<28}{:>12}", "final eval loss", eval_text);
    o += &if r.eval_set.1 {
        format!(
            "  (expected cross-entropy over all {} contexts)\n",
            r.eval_set.0
        )
    } else {
        format!("  ({} held-out samples)\n", r.eval_set.0)
    };
    match r.floor {
        Some(f) => {
            o += &format!("{:<28}{:>12}\n", "entropy floor", format!("{f:.4}"));
            let gap = final_eval.map_or("-".into(), |v| format!("{:+.4}", f64::from(v) - f));
            o += &format!("{:<28}{:>12}\n", "eval - floor", gap);
        }
        None => o += &format!("{:<28}{:>12}\n", "entropy floor", "unknown"),
    }
    o += &format!(
        "{:<28}{:>12}\n\n",
        "wall time",
        format!("{:.1} s", r.wall.as_secs_f64())
    );
    o += &render_owners(r);
    o += "\n";
    o += &format!(
        "{:<28}{:>14}{:>20}\n",
        "memory per rank", "this run", "bf16, unsharded"
    );
    for ((name, a), (_, b)) in memory_rows(&r.memory).iter().zip(memory_rows(&r.baseline)) {
        o += &format!("  {name:<26}{:>14}{:>20}\n", mib(*a), mib(b));
    }
    o += &format!(
        "\n{:<28}{:>14}{:>14}\n",
        "collectives (rank 0)", "calls", "bytes"
    );
    for (name, calls, bytes) in comm_rows(&r.comm) {
        o += &format!("  {name:<26}{calls:>14}{:>14}\n", mib(bytes as usize));
    }
    let p = &r.phases;
    o += &format!("\n{:<28}{:>14}\n", "time per phase (rank 0)", "seconds");
    for (name, d) in [
        ("forward + backward", p.forward_backward),
        ("grad sync", p.grad_sync),
        ("optimizer step", p.optimizer),
        ("param sync", p.param_sync),
        ("eval", p.eval),
    ] {
        o += &format!("  {name:<26}{:>14.2}\n", d.as_secs_f64());
    }
    if r.resumed_from.is_some() || !r.saved.is_empty() {
        o += &format!(
            "  {:<26}{:>14.2}\n",
            "checkpoint load + save",
            p.checkpoint.as_secs_f64()
        );
    }
    o += &format!(
        "\nfp32 master checksum (fnv1a64): {:016x}\n",
        r.master_checksum
    );
    o
}

fn memory_json(m: &RankMemory) -> Json {
    Json::obj([
        ("weights", Json::uint(m.weights())),
        ("staging", Json::uint(m.staging())),
        ("grads", Json::uint(m.grads())),
        ("masters", Json::uint(m.masters)),
        ("optimizer_state", Json::uint(m.optimizer_state)),
        ("grad_scratch", Json::uint(m.grad_scratch)),
        ("total", Json::uint(m.total())),
    ])
}

/// One entry of `param_owners`.
fn owner_json(p: &ParamOwner) -> Json {
    let whole = p.optimizer == "muon";
    Json::obj([
        ("name", Json::str(p.name.clone())),
        (
            "shape",
            Json::Arr(p.shape.iter().map(|&d| Json::uint(d)).collect()),
        ),
        ("optimizer", Json::str(p.optimizer)),
        ("owner_id", Json::uint(p.owner.0)),
        ("weight_decay", Json::F32(p.weight_decay)),
        (
            "sharding",
            Json::str(if whole { "layer_wise" } else { "distributed" }),
        ),
        (
            "ranks",
            Json::Arr(p.ranks.iter().map(|&r| Json::uint(r)).collect()),
        ),
        (
            "owner_rank",
            match (whole, &p.ranks[..]) {
                (true, [r]) => Json::uint(*r),
                _ => Json::Null,
            },
        ),
        (
            "muon_lr_factor",
            p.muon_lr_factor.map_or(Json::Null, Json::Num),
        ),
    ])
}

/// The `--json` object. Timing fields (wall time, time per phase) are all under `"timing"`;
/// everything else depends only on the flags, so two runs with the same seed print the same
/// bytes outside that key.
pub fn to_json(r: &TrainReport) -> Json {
    let c = &r.config;
    let bits = |v: f32| Json::str(format!("0x{:08x}", v.to_bits()));
    let steps = r
        .losses
        .iter()
        .zip(&r.grad_norms)
        .enumerate()
        .map(|(i, (&l, &g))| {
            Json::obj([
                ("step", Json::uint(r.first_step + i + 1)),
                ("loss", Json::F32(l)),
                ("loss_bits", bits(l)),
                ("grad_norm", Json::F32(g)),
                ("grad_norm_bits", bits(g)),
            ])
        })
        .collect();
    let evals = r
        .evals
        .iter()
        .map(|&(s, l)| {
            Json::obj([
                ("step", Json::uint(s)),
                ("loss", Json::F32(l)),
                ("loss_bits", bits(l)),
            ])
        })
        .collect();
    let comm = Json::Obj(
        comm_rows(&r.comm)
            .iter()
            .map(|&(n, calls, bytes)| {
                (
                    n.replace('-', "_"),
                    Json::obj([("calls", Json::uint(calls)), ("bytes", Json::uint(bytes))]),
                )
            })
            .collect(),
    );
    let p = &r.phases;
    let owners = r.owners.iter().map(owner_json).collect();
    let muon_ranks = r
        .muon_ranks
        .iter()
        .map(|l| {
            Json::obj([
                ("rank", Json::uint(l.rank)),
                ("params", Json::uint(l.params)),
                ("matrices", Json::uint(l.matrices)),
                ("elements", Json::uint(l.elements)),
            ])
        })
        .collect();
    let muon = match c.optimizer.muon() {
        None => Json::Null,
        Some(m) => Json::obj([
            ("lr", Json::F32(m.lr)),
            ("momentum", Json::F32(m.momentum)),
            ("nesterov", Json::Bool(true)),
            ("ns_steps", Json::uint(m.ns_steps)),
            ("ns_dtype", Json::str(m.ns_dtype.name())),
            ("lr_scale", Json::str(m.lr_scale.name())),
            ("weight_decay", Json::F32(m.weight_decay)),
            ("sharding", Json::str("layer_wise")),
        ]),
    };
    Json::obj([
        ("config", Json::str(describe(c))),
        ("optimizer", Json::str(c.optimizer.name())),
        ("lr", Json::F32(c.lr)),
        ("muon", muon),
        ("param_owners", Json::Arr(owners)),
        ("muon_ranks", Json::Arr(muon_ranks)),
        ("ranks", Json::uint(c.ranks)),
        ("precision", Json::str(c.precision.name())),
        ("compute", Json::str(c.compute.name())),
        ("batch", Json::uint(c.batch)),
        ("model", model_json(c)),
        ("param_gather", Json::Bool(c.param_gather)),
        ("sharding", Json::str(c.sharding.as_str())),
        ("fsdp", fsdp_json(c)),
        ("grouped_experts", Json::Bool(c.shape.grouped)),
        ("params", Json::uint(r.params)),
        ("seed", Json::uint(c.seed)),
        ("floor", r.floor.map_or(Json::Null, Json::Num)),
        ("eval_items", Json::uint(r.eval_set.0)),
        ("eval_exact", Json::Bool(r.eval_set.1)),
        ("first_step", Json::uint(r.first_step)),
        (
            "resumed_from",
            r.resumed_from
                .as_ref()
                .map_or(Json::Null, |d| Json::str(d.display().to_string())),
        ),
        (
            "saved",
            Json::Arr(
                r.saved
                    .iter()
                    .map(|d| Json::str(d.display().to_string()))
                    .collect(),
            ),
        ),
        ("steps", Json::Arr(steps)),
        ("evals", Json::Arr(evals)),
        (
            "master_checksum",
            Json::str(format!("{:016x}", r.master_checksum)),
        ),
        (
            "memory",
            Json::obj([
                ("per_rank", memory_json(&r.memory)),
                ("bf16_unsharded", memory_json(&r.baseline)),
            ]),
        ),
        ("comm", comm),
        // Everything that varies between runs of the same flags, under one key (last).
        (
            "timing",
            Json::obj([
                ("wall_s", Json::Num(r.wall.as_secs_f64())),
                (
                    "phases_s",
                    Json::obj([
                        (
                            "forward_backward",
                            Json::Num(p.forward_backward.as_secs_f64()),
                        ),
                        ("grad_sync", Json::Num(p.grad_sync.as_secs_f64())),
                        ("optimizer", Json::Num(p.optimizer.as_secs_f64())),
                        ("param_sync", Json::Num(p.param_sync.as_secs_f64())),
                        ("eval", Json::Num(p.eval.as_secs_f64())),
                        ("checkpoint", Json::Num(p.checkpoint.as_secs_f64())),
                    ]),
                ),
            ]),
        ),
    ])
}
