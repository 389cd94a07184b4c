//! `lowbit train`: arguments and the run (the progress display and `--metrics` records are
//! `progress`'s and `metrics`', the closing table and the `--json` object `train_report`'s).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};
use lowbit::optim::{MuonLrScale, NsDtype};
use lowbit::train::{
    self, CommDtype, Compute, DeviceChoice, FineGrainedGather, MainGradsDtype, MainParamsDtype,
    MixedPrecisionPolicy, MuonSettings, NanCheck, OptimizerChoice, OuterSharding, Precision,
    Sharding, StepLog, TrainConfig,
};
use lowbit::train::{LlamaRun, ModelChoice, Recompute};
use lowbit_llama::LlamaConfig;

use crate::error::CliError;
use crate::metrics::Metrics;
use crate::progress::Progress;

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
    /// Recompute activations in the backward instead of keeping them (the same bits, less
    /// memory): a decoder's norms and SwiGLU product (selective), also its gate/up projections
    /// (mlp), or its whole layers from their inputs (full, or on); the reference model's dense
    /// blocks (on, full).
    #[arg(long, value_enum, default_value_t = RecomputeArg::Off)]
    pub recompute: RecomputeArg,
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
    /// Start a decoder from a Hugging Face directory (config.json + model.safetensors or its
    /// sharded index; f32, bf16 or f16): the masters are its values, the shape its config.json's
    /// (a --model given too must agree). With --steps 0 and --save, only writes them as a step-0
    /// checkpoint. Not with --resume.
    #[arg(long, value_name = "HF_DIR", conflicts_with = "resume")]
    pub init_from: Option<PathBuf>,
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
    /// mode; on CUDA also the fast deterministic kernels of the loss, RMSNorm, RoPE, SwiGLU and
    /// embedding; with --optimizer muon and --muon-ns-dtype bf16, Newton-Schulz on the tensor
    /// cores too), or mxfp8 (bf16 as above, with the linear layers' GEMMs in MXFP8: E4M3
    /// operands with 1x32 E8M0 scales along each contraction, forward, data and weight
    /// gradients, as Transformer Engine's MXFP8 recipe; MXFP8 primary weights feed their stored
    /// copies).
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
    /// Stream the run into FILE.jsonl as it goes: a `run` header, then one JSON line per step
    /// (loss, grad norm, learning rates, tokens/s, MFU, peak memory, skipped, wall time) and per
    /// evaluation, each written and flushed as its step completes; with --resume, appended
    /// (docs/metrics.md has the schema).
    #[arg(long, value_name = "FILE.jsonl")]
    pub metrics: Option<PathBuf>,
    /// Peak throughput of one rank's device in TFLOP/s, the denominator of the metrics' MFU
    /// (times --ranks) [default: 989, an H100/H200's dense bf16, with --device cuda; none on
    /// the CPU: MFU null].
    #[arg(long, value_name = "X")]
    pub peak_tflops: Option<f64>,
    /// When stderr is not a terminal, print a progress line (step, loss, lr, tok/s, ETA) every
    /// SECS seconds, and one at every evaluation (0: only at evaluations).
    #[arg(long, value_name = "SECS", default_value_t = 10.0)]
    pub log_every: f64,
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
    /// Resume from a checkpoint: DIR (its latest) or DIR/step-N. --steps stays the run's total
    /// (a larger one needs --extend-schedule);
    /// flags that change the model, the data or the arithmetic must match the checkpoint's
    /// (refused otherwise, naming the flag; --main-grads-dtype and --grad-comm-dtype among them);
    /// --ranks, --sharding, --param-gather, the overlap flags, --bucket-size,
    /// --discrete-experts, --recompute, --nan-check and --device may change.
    #[arg(long, value_name = "PATH")]
    pub resume: Option<PathBuf>,
    /// With --resume and a --steps beyond the checkpoint's: how the learning-rate schedule
    /// continues. constant: the old schedule to its end, then its final rate held; cosine: the
    /// decay left at the resume step stretched to the new end (docs/training.md).
    #[arg(long, value_enum, value_name = "KIND", requires = "resume")]
    pub extend_schedule: Option<train::Extend>,
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

/// `--recompute`: the levels of [`Recompute`], with `on` the older spelling of `full`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum RecomputeArg {
    /// Keep every activation.
    Off,
    /// Full recompute (the reference model's only level).
    On,
    /// A decoder's norm outputs and SwiGLU product: elementwise recompute only.
    Selective,
    /// Also a decoder's gate and up projections.
    Mlp,
    /// Whole layers from their inputs.
    Full,
}

impl RecomputeArg {
    fn level(self) -> Recompute {
        match self {
            RecomputeArg::Off => Recompute::Off,
            RecomputeArg::Selective => Recompute::Selective,
            RecomputeArg::Mlp => Recompute::Mlp,
            RecomputeArg::On | RecomputeArg::Full => Recompute::Full,
        }
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
            extend_schedule: self.extend_schedule,
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
        if let Some(dir) = &self.init_from
            && self.model == "reference"
            && table.is_none()
            && self.layers.is_none()
        {
            // The shape is config.json's.
            let hf = lowbit_llama::hf::read_config(dir).map_err(|e| {
                CliError::Msg(format!(
                    "invalid configuration: --init-from {}: {e}",
                    dir.display()
                ))
            })?;
            let seq = self.seq.unwrap_or(1024.min(hf.model.max_seq));
            return Ok(ModelChoice::Llama(LlamaRun {
                preset: "hf".into(),
                config: hf.model,
                seq,
            }));
        }
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
            recompute: self.recompute.level(),
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
            init_from: self.init_from.clone(),
            schedule: train::Schedule::default(),
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
    // The first SIGINT/SIGTERM stops after the current step (saved with --save), a second one
    // hands the signal to the goodbye above or dies of it (`lowbit::train::stop`).
    let stop = train::stop::signals();
    let progress = progress(args, &cfg)?;
    let report = train::train_until(&cfg, &args.checkpointing(), stop, &|s: &StepLog| {
        progress.step(s)
    })
    .map_err(|e| {
        let status = match e {
            train::TrainError::Stopped { signal, .. } => Some(train::stop::exit_status(signal)),
            _ => None,
        };
        match status {
            Some(status) => CliError::Stopped {
                message: e.to_string(),
                status,
            },
            None => CliError::Msg(e.to_string()),
        }
    });
    // A failed metrics write is the run's error only if the run itself succeeded.
    let finished = progress.finish();
    let report = report?;
    finished?;
    if cfg.device == train::DeviceChoice::Cuda
        && train::launched_rank().map_err(|e| CliError::Msg(e.to_string()))? != 0
    {
        // One process per rank under a launcher: rank 0 reports for the world.
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    let text = if args.json {
        format!("{}\n", crate::train_report::to_json(&report))
    } else {
        crate::train_report::render(&report)
    };
    out.write_all(text.as_bytes())
        .map_err(|e| CliError::Msg(format!("cannot write to stdout: {e}")))
}

/// The progress display and the `--metrics` file (opened, its header written, before step 1;
/// under a launcher only by rank 0, which alone reports steps).
fn progress(args: &TrainArgs, cfg: &TrainConfig) -> Result<Progress, CliError> {
    if !(args.log_every.is_finite() && args.log_every >= 0.0) {
        return Err(CliError::Msg(format!(
            "invalid configuration: --log-every {}: seconds must be finite and >= 0",
            args.log_every
        )));
    }
    if let Some(t) = args.peak_tflops
        && !(t.is_finite() && t > 0.0)
    {
        return Err(CliError::Msg(format!(
            "invalid configuration: --peak-tflops {t}: must be finite and > 0"
        )));
    }
    let metrics = match &args.metrics {
        Some(path) if train::launched_rank().map_err(|e| CliError::Msg(e.to_string()))? == 0 => {
            // Refuse a bad configuration before the file is touched.
            cfg.validate().map_err(|e| CliError::Msg(e.to_string()))?;
            Some(Metrics::create(
                path,
                args.resume.is_some(),
                cfg,
                args.peak_tflops,
            )?)
        }
        _ => None,
    };
    Ok(Progress::new(
        std::io::stderr().is_terminal(),
        Duration::from_secs_f64(args.log_every),
        metrics,
    ))
}
