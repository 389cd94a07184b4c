//! `lowbit train`'s configuration: what a run depends on, its validation (every refusal with
//! its reason), the learning-rate schedule, and its translation into the library's
//! configurations (buffers, plan specs, the sharding plan, precision policy, AdamW, Muon).

use std::path::PathBuf;

use lowbit_buffers::layout::{
    BufferKey, GradDType, LayoutError, OptimizerId, ParamSpec, ParamStorage, QuantKind,
    ShardingPlan, ShardingStrategy,
};
use lowbit_buffers::{ComputeFormat, DdpConfig, NanCheck, Overlap, PrecisionPolicy};
use lowbit_llama::Recompute;
use lowbit_optim::{AdamW, MuonConfig, MuonLrScale, NsDtype};
use lowbit_train::fsdp::{
    CommDtype, Conflict, FineGrainedGather, FsdpConfig, MainParamsDtype, MixedPrecisionPolicy,
    OuterSharding, Sharding,
};

use super::lm::{LmShape, ParamInfo};

/// How GEMM weights are stored and computed with (`--precision`; the value names are
/// [`Precision::name`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    /// bf16 weights.
    Bf16,
    /// MXFP8 weights: E4M3, 1x32 block scales.
    Mxfp8,
    /// NVFP4 weights: 16x16 block scales and a per-tensor scale.
    Nvfp4,
}

impl Precision {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Bf16 => "bf16",
            Precision::Mxfp8 => "mxfp8",
            Precision::Nvfp4 => "nvfp4",
        }
    }
}

/// Which optimizer updates the GEMM weights (the embedding, head, norms, biases and the router
/// are always AdamW's).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerChoice {
    /// Distributed AdamW on every parameter: matrices and the embedding and head with weight
    /// decay 0.1, norms, biases and the router without.
    AdamW,
    /// Muon on the hidden matrices and the expert weights (grouped `[experts, out, in]` tensors
    /// orthogonalized per expert), each matrix owned whole by one rank under the plan's
    /// layer-wise rule; distributed AdamW on everything else (embedding and head with weight
    /// decay 0.1; norms, biases and the router without), chained.
    Muon(MuonSettings),
}

impl OptimizerChoice {
    /// Lower-case name.
    pub fn name(&self) -> &'static str {
        match self {
            OptimizerChoice::AdamW => "adamw",
            OptimizerChoice::Muon(_) => "muon",
        }
    }

    /// Muon's settings, if Muon is chosen.
    pub fn muon(&self) -> Option<&MuonSettings> {
        match self {
            OptimizerChoice::Muon(m) => Some(m),
            OptimizerChoice::AdamW => None,
        }
    }
}

/// Muon's knobs in `lowbit train`. Nesterov momentum, the quintic coefficients (3.4445,
/// −4.7750, 2.0315) and eps 1e-7 are `torch.optim.Muon`'s and fixed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MuonSettings {
    /// Peak learning rate of the Muon matrices; the schedule (warmup, cosine to a tenth) is
    /// AdamW's, scaled to this peak.
    pub lr: f32,
    /// Momentum, in `[0, 1)`.
    pub momentum: f32,
    /// Newton–Schulz iterations, `1..100`.
    pub ns_steps: u32,
    /// The per-matrix learning-rate scale.
    pub lr_scale: MuonLrScale,
    /// The dtype of the Newton–Schulz iterate: f32 (exactly reproducible on every backend, the
    /// default here) or bf16 (`torch.optim.Muon`'s roundings).
    pub ns_dtype: NsDtype,
    /// Decoupled weight decay of the Muon matrices (`p ← p · (1 − lr·wd)`).
    pub weight_decay: f32,
}

impl Default for MuonSettings {
    /// `lowbit train`'s defaults, tuned on the reference task at the default step budget
    /// (README, "Training: `lowbit train`"): peak lr 0.03 with the original scale rule, momentum
    /// 0.85, no weight decay (over 200 steps decay only costs), 5 Newton–Schulz steps in f32.
    /// Momentum 0.8–0.9 and peak rates 0.02–0.04 land within 0.001 nats of it (+0.0115 above
    /// the floor, AdamW +0.0185); `torch.optim.Muon`'s momentum 0.95 and weight decay 0.1 give
    /// +0.0147.
    fn default() -> Self {
        MuonSettings {
            lr: 0.03,
            momentum: 0.85,
            ns_steps: 5,
            lr_scale: MuonLrScale::Original,
            ns_dtype: NsDtype::F32,
            weight_decay: 0.0,
        }
    }
}

impl MuonSettings {
    /// The library's configuration of these settings.
    pub fn config(&self) -> MuonConfig {
        MuonConfig::default()
            .with_momentum(self.momentum)
            .with_ns_steps(self.ns_steps)
            .with_lr_scale(self.lr_scale)
            .with_ns_dtype(self.ns_dtype)
            .with_weight_decay(self.weight_decay)
    }
}

/// The owner ids of `lowbit train`'s optimizers.
pub mod owners {
    use lowbit_buffers::layout::OptimizerId;
    /// AdamW with weight decay.
    pub const ADAMW_DECAY: OptimizerId = OptimizerId(0);
    /// AdamW without weight decay.
    pub const ADAMW_NO_DECAY: OptimizerId = OptimizerId(1);
    /// Muon (layer-wise plan rule).
    pub const MUON: OptimizerId = OptimizerId(2);
}

/// Which backend the ranks run on (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DeviceChoice {
    /// Ranks are threads on the CPU reference backend.
    Cpu,
    /// One rank per GPU through NCCL (needs a build with --features cuda).
    Cuda,
}

impl DeviceChoice {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Cuda => "cuda",
        }
    }
}

/// Everything a run depends on.
#[derive(Clone, Debug)]
pub struct TrainConfig {
    /// Data-parallel ranks.
    pub ranks: usize,
    /// Weight precision.
    pub precision: Precision,
    /// Low-precision primary weights gathered as such (staged through the gradient buffer);
    /// off: bf16 parameters, quantized on the fly for compute.
    pub param_gather: bool,
    /// Reduce gradient buckets as they become ready during the backward.
    pub overlap_grad_reduce: bool,
    /// Gather parameters bucket by bucket in the next forward.
    pub overlap_param_gather: bool,
    /// What the data-parallel ranks shard (`--sharding`; `optim`, the distributed optimizer,
    /// is lowbit's default).
    pub sharding: Sharding,
    /// Main parameters, main gradients (the gradient buffers) and gradient communication
    /// dtypes (`--main-params-dtype`, `--main-grads-dtype` / `--grad-dtype`,
    /// `--grad-comm-dtype`).
    pub mixed_precision: MixedPrecisionPolicy,
    /// Non-finite gradient check before each reduction (`--nan-check`).
    pub nan_check: NanCheck,
    /// Fine-grained (rowwise / columnwise) low-precision gathers (`--fine-grained-param-gather`).
    pub fine_grained: FineGrainedGather,
    /// Replica groups of hybrid sharding (`--outer-dp`; 1: flat sharding).
    pub outer_dp: usize,
    /// What the replica groups shard (`--outer-sharding`; only meaningful with `outer_dp > 1`;
    /// `None`: not asked for).
    pub outer_sharding: Option<OuterSharding>,
    /// What the backward recomputes (`--recompute`; the same bits): a decoder's [`Recompute`]
    /// level; the reference model's only level is [`Recompute::Full`] (its dense blocks whole).
    pub recompute: Recompute,
    /// Bucket size in elements (with overlapped reduction); `None`: one bucket per buffer.
    pub bucket_size: Option<usize>,
    /// Microbatches per step (gradient accumulation).
    pub microbatches: usize,
    /// Samples per step over all ranks.
    pub batch: usize,
    /// Optimizer steps.
    pub steps: usize,
    /// Evaluate every this many steps (and after the last); 0: only after the last.
    pub eval_every: usize,
    /// Held-out samples per evaluation.
    pub eval_samples: usize,
    /// Seed of the data, the initial weights and the source.
    pub seed: u64,
    /// Backend.
    pub device: DeviceChoice,
    /// Train on the bytes of this file instead of the Markov source.
    pub data: Option<PathBuf>,
    /// AdamW learning rate.
    pub lr: f32,
    /// Keep training when the mean loss is not finite (otherwise the run stops with
    /// [`TrainError::Diverged`]).
    pub allow_non_finite: bool,
    /// The optimizer of the GEMM weights.
    pub optimizer: OptimizerChoice,
    /// Model shape (`vocab` is set from the data source).
    pub shape: LmShape,
    /// How the model's GEMMs compute.
    pub compute: Compute,
    /// The model (the reference model has the shape `shape`).
    pub model: ModelChoice,
    /// A decoder's initial masters from this Hugging Face directory (`--init-from`:
    /// `config.json` and safetensors, `lowbit_llama::hf`) instead of the seeded initialization.
    pub init_from: Option<PathBuf>,
    /// The learning-rate schedule's extensions (default: none, warmup-cosine over `steps`); a
    /// resume sets it from the checkpoint and `--extend-schedule`.
    pub schedule: super::schedule::Schedule,
}

/// Which model a run trains (`--model`).
#[derive(Clone, Debug, Default, PartialEq)]
pub enum ModelChoice {
    /// The reference MoE language model of shape [`TrainConfig::shape`].
    #[default]
    Reference,
    /// A Llama decoder on token data.
    Llama(super::llama::LlamaRun),
}

/// How the model's GEMMs compute (`--compute`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Compute {
    /// The reference f32 products (the same bits on the CPU and CUDA).
    #[default]
    Exact,
    /// bf16 operands on the tensor cores, f32 accumulation (`lowbit_device::MatmulMode::Bf16`):
    /// the fast mode, as bf16 autocast computes.
    Bf16,
    /// The fast mode with the linear layers' GEMMs in MXFP8 (`lowbit_device::MatmulMode::Mxfp8`):
    /// forward, data and weight gradients as Transformer Engine's MXFP8 recipe computes them
    /// (E4M3, 1x32 E8M0 scales along each contraction; MXFP8 primary weights feed their stored
    /// copies). Attention, norms and the output head stay bf16.
    Mxfp8,
}

impl Compute {
    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Compute::Exact => "exact",
            Compute::Bf16 => "bf16",
            Compute::Mxfp8 => "mxfp8",
        }
    }

    /// The device's matmul mode.
    pub fn matmul_mode(self) -> lowbit_device::MatmulMode {
        match self {
            Compute::Exact => lowbit_device::MatmulMode::Exact,
            Compute::Bf16 => lowbit_device::MatmulMode::Bf16,
            Compute::Mxfp8 => lowbit_device::MatmulMode::Mxfp8,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            ranks: 4,
            precision: Precision::Mxfp8,
            param_gather: true,
            overlap_grad_reduce: true,
            overlap_param_gather: true,
            sharding: Sharding::Optim,
            mixed_precision: MixedPrecisionPolicy::default(),
            nan_check: NanCheck::Off,
            fine_grained: FineGrainedGather::Auto,
            outer_dp: 1,
            outer_sharding: None,
            recompute: Recompute::Off,
            bucket_size: Some(40_000),
            microbatches: 2,
            batch: 512,
            steps: 200,
            eval_every: 50,
            eval_samples: 4096,
            seed: 1,
            device: DeviceChoice::Cpu,
            data: None,
            lr: 1e-2,
            allow_non_finite: false,
            optimizer: OptimizerChoice::AdamW,
            shape: LmShape {
                vocab: 8,
                context: 4,
                embed: 16,
                hidden: 64,
                blocks: 2,
                ffn: 128,
                experts: 4,
                top_k: 2,
                expert_ffn: 64,
                grouped: true,
            },
            compute: Compute::Exact,
            model: ModelChoice::Reference,
            init_from: None,
            schedule: super::schedule::Schedule::default(),
        }
    }
}

/// Upper bounds of `lowbit train`'s sizes, checked by [`TrainConfig::validate`] before anything
/// is allocated.
pub mod limits {
    /// Data-parallel ranks (`--ranks`).
    pub const RANKS: usize = 64;
    /// Samples per step over all ranks (`--batch`); also bounds `--microbatches`.
    pub const BATCH: usize = 1 << 18;
    /// Optimizer steps (`--steps`).
    pub const STEPS: usize = 10_000_000;
    /// Held-out samples per evaluation.
    pub const EVAL_SAMPLES: usize = 1 << 20;
    /// Bucket size in elements (`--bucket-size`).
    pub const BUCKET: usize = 1 << 40;
    /// Each model width (vocab, context, embed, hidden, blocks, ffn, experts, expert ffn).
    pub const WIDTH: usize = 1 << 16;
    /// Model parameters.
    pub const PARAMS: usize = 1 << 28;
    /// Activation elements of one microbatch on one rank (rows x widths), per layer.
    pub const ACTIVATIONS: usize = 1 << 28;
}

/// Whether this build has the CUDA backend (`--features cuda`).
pub const HAS_CUDA: bool = cfg!(feature = "cuda");

/// GPUs the CUDA driver reports; 0 without the `cuda` feature, the driver library or a GPU.
pub fn gpu_count() -> usize {
    #[cfg(feature = "cuda")]
    {
        use lowbit_device::cudarc::driver::{CudaContext, sys};
        // SAFETY: probing loads the CUDA driver library with `dlopen`, which runs its
        // initialisers, as every CUDA program does; without the probe cudarc panics on the
        // first driver call when the library is missing.
        if !unsafe { sys::is_culib_present() } {
            return 0;
        }
        CudaContext::device_count().map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Errors of a training run.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// The configuration describes no valid run; refused before anything runs.
    #[error("invalid configuration: {0}")]
    Invalid(String),
    /// The data could not be read.
    #[error("data: {0}")]
    Data(String),
    /// The run diverged: a non-finite mean training or eval loss (every rank sees the same
    /// all-reduced value, so every rank stops at the same step).
    #[error(
        "the run diverged: {what} is {value} at step {step}/{steps} (lower --lr; pass \
         --allow-non-finite to keep going)"
    )]
    Diverged {
        /// `"training loss"` or `"eval loss"`.
        what: &'static str,
        /// The value.
        value: f32,
        /// The step, from 1.
        step: usize,
        /// Of how many.
        steps: usize,
    },
    /// A checkpoint could not be opened, does not fit the run (the message names the flag and
    /// both values), or the save directory would collide with the run's saves.
    #[error("{0}")]
    Checkpoint(String),
    /// A stop was requested ([`super::stop::StopRequest`], SIGINT or SIGTERM): every rank
    /// stopped after step `step`, which was saved to `saved` when the run saves.
    #[error(
        "stopped by {} after step {step}/{steps}; {}",
        super::stop::signal_name(*signal),
        match saved {
            Some(p) => format!("saved {} (continue with --resume and the same flags)", p.display()),
            None => "nothing was saved (no --save)".into(),
        }
    )]
    Stopped {
        /// The signal's number.
        signal: i32,
        /// The last step done, from 1.
        step: usize,
        /// Of how many.
        steps: usize,
        /// The checkpoint of that step.
        saved: Option<PathBuf>,
    },
    /// A rank failed.
    #[error("rank {rank}: {message}")]
    Rank {
        /// Which rank.
        rank: usize,
        /// What went wrong.
        message: String,
    },
}

impl TrainConfig {
    /// Rows per rank per microbatch.
    pub fn rows(&self) -> usize {
        self.batch / self.ranks.saturating_mul(self.microbatches).max(1)
    }

    /// Refuses invalid combinations up front, each with the reason.
    ///
    /// Every user-given size is bounded (`config::limits`) and every product of them is computed
    /// with checked arithmetic before anything is allocated, so no flag value overflows, hangs
    /// or aborts on a failed allocation.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Invalid(m));
        if self.ranks == 0 || self.ranks > limits::RANKS {
            return bad(format!(
                "--ranks {} must be in 1..={}",
                self.ranks,
                limits::RANKS
            ));
        }
        check_count(
            "microbatches",
            self.microbatches,
            limits::BATCH,
            " (and --batch must split into them)",
        )?;
        if self.model == ModelChoice::Reference
            && matches!(self.recompute, Recompute::Selective | Recompute::Mlp)
        {
            return bad(format!(
                "--recompute {}: the reference model recomputes its dense blocks whole (--recompute \
                 on or full); selective and mlp are levels of the decoders (--model llama-*)",
                self.recompute
            ));
        }
        if let Some(dir) = &self.init_from
            && !matches!(self.model, ModelChoice::Llama(_))
        {
            return bad(format!(
                "--init-from {} starts a decoder (--model llama-* or the directory's \
                 config.json); the reference model has no Hugging Face form",
                dir.display()
            ));
        }
        // `--steps 0` with `--init-from`: the imported masters saved as step 0, nothing run.
        if !(self.steps == 0 && self.init_from.is_some()) {
            check_count("steps", self.steps, limits::STEPS, " steps")?;
        }
        if let Err(m) = self.schedule.check(self.steps) {
            return bad(format!("learning-rate schedule: {m}"));
        }
        if self.batch > limits::BATCH {
            return bad(format!(
                "--batch {} exceeds the limit of {} samples per step",
                self.batch,
                limits::BATCH
            ));
        }
        let Some(split) = self.ranks.checked_mul(self.microbatches) else {
            return bad(format!(
                "--ranks {} x --microbatches {} overflows",
                self.ranks, self.microbatches
            ));
        };
        if self.batch == 0 || !self.batch.is_multiple_of(split) {
            return bad(format!(
                "the global batch of {} samples does not split into {} ranks x {} microbatches",
                self.batch, self.ranks, self.microbatches
            ));
        }
        if self.eval_samples > limits::EVAL_SAMPLES {
            return bad(format!(
                "{} eval samples exceed the limit of {}",
                self.eval_samples,
                limits::EVAL_SAMPLES
            ));
        }
        if let Some(b) = self.bucket_size
            && b > limits::BUCKET
        {
            return bad(format!(
                "--bucket-size {b} exceeds the limit of {} elements",
                limits::BUCKET
            ));
        }
        if let Err(m) = self.check_model_size() {
            return bad(m);
        }
        if self.precision == Precision::Bf16 && self.param_gather {
            return bad(
                "--param-gather on needs --precision mxfp8 or nvfp4 (with bf16 weights there is \
                 no low-precision copy to gather)"
                    .into(),
            );
        }
        if self.overlap_param_gather && !self.overlap_grad_reduce {
            return bad(
                "--overlap-param-gather on needs --overlap-grad-reduce on (the gathers are \
                 launched per bucket, and buckets exist only with overlapped reduction)"
                    .into(),
            );
        }
        if let Some(b) = self.bucket_size {
            if !self.overlap_grad_reduce {
                return bad(
                    "--bucket-size applies only with --overlap-grad-reduce on (without it each \
                     buffer is reduced as one bucket)"
                        .into(),
                );
            }
            if b == 0 {
                return bad("--bucket-size must be at least 1 element".into());
            }
        }
        if self.eval_samples == 0 {
            return bad("the eval set needs at least one sample".into());
        }
        if let ModelChoice::Llama(run) = &self.model {
            run.check(self).map_err(TrainError::Invalid)?;
        } else if self.shape.context < 2 {
            return bad(format!(
                "a context of {} tokens cannot see the order-2 source's state",
                self.shape.context
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("--lr {} must be a positive finite number", self.lr));
        }
        if let Some(m) = self.optimizer.muon() {
            if !(m.lr.is_finite() && m.lr > 0.0) {
                return bad(format!(
                    "--muon-lr {} must be a positive finite number",
                    m.lr
                ));
            }
            if !(m.momentum.is_finite() && (0.0..1.0).contains(&m.momentum)) {
                return bad(format!(
                    "--muon-momentum {} must be in [0, 1) (buf <- lerp(buf, g, 1 - momentum))",
                    m.momentum
                ));
            }
            if !(1..100).contains(&m.ns_steps) {
                return bad(format!(
                    "--muon-ns-steps {} must be in 1..=99 (Newton-Schulz iterations)",
                    m.ns_steps
                ));
            }
            if !(m.weight_decay.is_finite() && m.weight_decay >= 0.0) {
                return bad(format!(
                    "--muon-weight-decay {} must be a finite number >= 0",
                    m.weight_decay
                ));
            }
            // Whatever is left for the library to refuse, refused here with its words.
            if let Err(e) = m.config().validate() {
                return bad(format!("Muon: {e}"));
            }
        }
        let s = &self.shape;
        let reference = self.model == ModelChoice::Reference;
        if reference && (s.top_k == 0 || s.top_k > s.experts) {
            return bad(format!(
                "top-{} routing over {} experts",
                s.top_k, s.experts
            ));
        }
        if reference && self.precision != Precision::Bf16 {
            let dims = [s.hidden, s.ffn, s.expert_ffn, s.context * s.embed];
            if let Some(d) = dims.iter().find(|d| !d.is_multiple_of(32)) {
                return bad(format!(
                    "{} weights need model widths that are multiples of 32 (MXFP8 blocks and \
                     NVFP4 tiles must not straddle experts); got {d}",
                    self.precision.name()
                ));
            }
        }
        if self.device == DeviceChoice::Cuda && !cfg!(feature = "cuda") {
            return bad(
                "--device cuda needs a build with the CUDA backend: cargo build --release \
                 --features cuda"
                    .into(),
            );
        }
        self.check_fsdp()
    }

    /// The sharding strategy, precision policy and owners: the library's rules
    /// ([`FsdpConfig::check_no_shard`], [`FsdpConfig::validate`],
    /// [`FsdpConfig::check_layer_wise`]), each refusal in words that name the flags, and the
    /// checks of flags that only the command line has.
    fn check_fsdp(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Invalid(m));
        let specs = self.specs(&self.model_params());
        let fsdp = self.fsdp();
        let layer_wise: &[OptimizerId] = match self.optimizer {
            OptimizerChoice::Muon(_) => &[owners::MUON],
            OptimizerChoice::AdamW => &[],
        };
        if let Err(c) = fsdp.check_no_shard(&specs, layer_wise) {
            return bad(self.conflict_message(&c));
        }
        if self.sharding == Sharding::NoShard && self.overlap_param_gather {
            return bad(
                "--overlap-param-gather on with --sharding no_shard: no_shard has no parameter \
                 gather to overlap (pass --overlap-param-gather off)"
                    .into(),
            );
        }
        if let Err(e) = fsdp.validate(&specs, self.ranks) {
            // The library's reason is text: name the flag, in the order the library checks.
            let mp = self.mixed_precision.main_params_dtype;
            let flag = if mp != MainParamsDtype::Fp32 {
                format!("--main-params-dtype {}", mp.name())
            } else if self.outer_dp == 0 || !self.ranks.is_multiple_of(self.outer_dp) {
                format!("--outer-dp {}", self.outer_dp)
            } else if self.outer_dp > 1 && self.outer_sharding == Some(OuterSharding::Optim) {
                "--outer-sharding optim".to_string()
            } else if self.fine_grained == FineGrainedGather::On {
                "--fine-grained-param-gather on".to_string()
            } else {
                format!("--sharding {}", self.sharding)
            };
            return bad(format!("{flag}: {e}"));
        }
        if let Err(c) = fsdp.check_layer_wise(&specs, layer_wise) {
            return bad(self.conflict_message(&c));
        }
        if self.outer_sharding.is_some() && self.outer_dp == 1 {
            return bad(
                "--outer-sharding applies only with --outer-dp > 1 (hybrid sharding: what the \
                 replica groups shard)"
                    .into(),
            );
        }
        Ok(())
    }

    /// A library [`Conflict`] in the command line's words: the flags to change.
    fn conflict_message(&self, c: &Conflict) -> String {
        match c {
            Conflict::NoShardQuantized { .. } => format!(
                "--sharding no_shard with {} primary weights stored as such (--param-gather on): \
                 low-precision weights are only refreshed by the gather after the step, and \
                 no_shard gathers nothing; pass --param-gather off (bf16 weights quantized on \
                 the fly), or shard with --sharding optim",
                self.precision.name()
            ),
            Conflict::NoShardLayerWise => "--sharding no_shard with --optimizer muon: Muon's \
                 matrices are owned whole by one rank each (the layer-wise rule, which shards \
                 the optimizer state), so the plan would mix replicated and sharded owners; use \
                 --sharding optim (or --optimizer adamw)"
                .into(),
            Conflict::LayerWiseMasters { dtype } => format!(
                "--main-params-dtype {} with --optimizer muon: Muon keeps fp32 main parameters \
                 only",
                dtype.name()
            ),
            // Muon's layer-wise owners would need their own replica rule.
            Conflict::HybridLayerWise { outer_dp } => format!(
                "--outer-dp {outer_dp}: hybrid sharding with Muon is not built yet; use \
                 --outer-dp 1"
            ),
            other => format!("invalid sharding for these parameters: {other}"),
        }
    }

    /// The model's parameter count and per-microbatch activation sizes, computed with checked
    /// arithmetic and bounded ([`limits`]).
    fn check_model_size(&self) -> Result<(), String> {
        if matches!(self.model, ModelChoice::Llama(_)) {
            // The decoder's own checks (`LlamaRun::check`).
            return Ok(());
        }
        let s = &self.shape;
        // --data sets a vocabulary of 256 later; count with the larger one.
        let vocab = s.vocab.max(256);
        let widths = [
            ("vocab", s.vocab),
            ("context", s.context),
            ("embed", s.embed),
            ("hidden", s.hidden),
            ("blocks", s.blocks),
            ("ffn", s.ffn),
            ("experts", s.experts),
            ("expert ffn", s.expert_ffn),
        ];
        if let Some((n, w)) = widths.iter().find(|(_, w)| *w > limits::WIDTH) {
            return Err(format!(
                "model {n} {w} exceeds the limit of {}",
                limits::WIDTH
            ));
        }
        let overflow = || format!("the model's size overflows ({s:?})");
        let mul = |a: usize, b: usize| a.checked_mul(b).ok_or_else(overflow);
        let add = |a: usize, b: usize| a.checked_add(b).ok_or_else(overflow);
        let ctx_embed = mul(s.context, s.embed)?;
        let mut params = mul(vocab, s.embed)?;
        params = add(params, mul(ctx_embed, s.hidden)?)?;
        let block = add(
            mul(mul(s.hidden, s.ffn)?, 2)?,
            add(s.ffn, mul(s.hidden, 2)?)?,
        )?;
        params = add(params, mul(block, s.blocks)?)?;
        params = add(
            params,
            mul(mul(mul(s.experts, s.expert_ffn)?, s.hidden)?, 2)?,
        )?;
        params = add(params, mul(s.experts, s.hidden)?)?;
        params = add(params, mul(add(s.hidden, 1)?, vocab)?)?;
        if params > limits::PARAMS {
            return Err(format!(
                "the model has {params} parameters, over the limit of {}",
                limits::PARAMS
            ));
        }
        let widest = [
            ctx_embed,
            s.hidden,
            s.ffn,
            vocab,
            mul(s.experts, s.expert_ffn)?,
        ]
        .into_iter()
        .max()
        .unwrap_or(0);
        let rows = self.rows().max(self.eval_samples.min(limits::EVAL_SAMPLES));
        let act = mul(rows, widest)?;
        if act > limits::ACTIVATIONS {
            return Err(format!(
                "{rows} rows x width {widest} = {act} activation elements per layer, over the \
                 limit of {} (lower --batch or raise --microbatches)",
                limits::ACTIVATIONS
            ));
        }
        Ok(())
    }

    /// The learning rate of `step` (from 0): linear warmup over the first 5% of the steps,
    /// then cosine decay to a tenth. Computed in f64, rounded once.
    /// (`lowbit_train::schedule::WarmupCosine` over the run's steps, unless `schedule` extends
    /// it: [`super::Schedule`].)
    pub fn lr_at(&self, step: usize) -> f32 {
        self.schedule.lr_at(self.lr, self.steps, step)
    }

    /// The FSDP configuration: strategy, precision policy, overlap and buckets (today's
    /// settings), the NaN check, fine-grained gathers, hybrid groups and recompute.
    pub fn fsdp(&self) -> FsdpConfig {
        // `validate` refused overlapped gathers without overlapped reduction.
        let overlap = match (self.overlap_grad_reduce, self.overlap_param_gather) {
            (true, true) => Overlap::GradReduceAndParamGather,
            (true, false) => Overlap::GradReduce,
            _ => Overlap::None,
        };
        FsdpConfig::new(self.sharding)
            .with_policy(self.mixed_precision)
            .with_overlap(overlap)
            .with_bucket_size(self.bucket_size)
            .with_nan_check(self.nan_check)
            .with_fine_grained(self.fine_grained)
            .with_outer_dp(self.outer_dp)
            .with_outer_sharding(self.outer_sharding.unwrap_or_default())
            .with_recompute(self.recompute.is_on())
    }

    pub(super) fn ddp(&self) -> DdpConfig {
        self.fsdp().ddp_config()
    }

    /// The dtype gradients are reduced in: the `--grad-comm-dtype` asked for, or with `auto`
    /// the main-gradient dtype's name.
    pub fn comm_dtype_name(&self) -> &'static str {
        match self.mixed_precision.grad_comm_dtype {
            CommDtype::MainGrads => self.mixed_precision.main_grads_dtype.name(),
            c => c.name(),
        }
    }

    /// Whether fine-grained gathers are on for this run, and why (the library's rule).
    pub fn fine_grained_on(&self) -> (bool, &'static str) {
        self.fsdp().fine_grained(&self.specs(&self.model_params()))
    }

    /// Every parameter of the model, in forward order.
    pub fn model_params(&self) -> Vec<ParamInfo> {
        match &self.model {
            ModelChoice::Reference => self.shape.params(),
            ModelChoice::Llama(run) => run.params(),
        }
    }

    /// The gradient buffers' dtype of a parameter stored as `storage`.
    pub fn grad_dtype(&self, storage: ParamStorage) -> GradDType {
        self.mixed_precision.main_grads_dtype.resolve(storage)
    }

    /// GEMM weights computed with as `Q(bf16 weight)` (the stored copies with low-precision
    /// primary weights, quantized on the fly otherwise), grouped experts one by one; everything
    /// else as stored.
    pub(super) fn policy(&self, info: &[ParamInfo]) -> PrecisionPolicy {
        let format = match self.precision {
            Precision::Bf16 => ComputeFormat::AsStored,
            Precision::Mxfp8 => ComputeFormat::Mxfp8 { two_d: false },
            Precision::Nvfp4 => ComputeFormat::Nvfp4,
        };
        PrecisionPolicy::matrices(format, info.iter().map(|p| p.matrix.then_some(p.experts)))
    }

    pub(super) fn specs(&self, info: &[ParamInfo]) -> Vec<ParamSpec> {
        let mut specs: Vec<ParamSpec> = info
            .iter()
            .map(|p| {
                let storage = match self.precision {
                    Precision::Mxfp8 if self.param_gather && p.matrix => {
                        ParamStorage::Quantized(QuantKind::Mxfp8)
                    }
                    // Grouped tensors too: NVFP4 storage keeps one global amax per expert.
                    Precision::Nvfp4 if self.param_gather && p.matrix => {
                        ParamStorage::Quantized(QuantKind::Nvfp4)
                    }
                    _ => ParamStorage::Bf16,
                };
                let owner = self.owner_of(p);
                // The gradient dtype is the policy's (`FsdpConfig::apply` below).
                let key = BufferKey::new(storage, GradDType::F32, owner);
                ParamSpec::new(p.name.clone(), p.shape.clone(), key)
            })
            .collect();
        self.fsdp().apply(&mut specs);
        specs
    }

    /// The optimizer owning parameter `p`: Muon for the GEMM weights when Muon is chosen, else
    /// AdamW with or without weight decay.
    pub(super) fn owner_of(&self, p: &ParamInfo) -> OptimizerId {
        match self.optimizer {
            OptimizerChoice::Muon(_) if p.matrix => owners::MUON,
            _ if p.decay => owners::ADAMW_DECAY,
            _ => owners::ADAMW_NO_DECAY,
        }
    }

    /// The sharding plan of `specs`: the distributed rule (a piece of every bucket on every
    /// rank) for AdamW's owners, the layer-wise rule (whole parameters, one rank each) for
    /// Muon's. Pure: every rank, and the report, make the same plan.
    pub(super) fn plan(&self, specs: &[ParamSpec]) -> Result<ShardingPlan, LayoutError> {
        // With hybrid sharding the plan is one replica group's (HFSDP: its shards split across
        // the replica groups).
        let mut pc = self.fsdp().plan_config(self.ranks);
        if self.optimizer.muon().is_some() {
            pc = pc.with_owner_strategy(owners::MUON, ShardingStrategy::LayerWise);
        }
        ShardingPlan::new(specs, &pc)
    }

    pub(super) fn adamw(decay: f32) -> AdamW {
        AdamW {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: decay,
        }
    }
}

/// `--{flag}` must be at least 1 and at most `limit`; `note` ends the over-the-limit message.
fn check_count(flag: &str, value: usize, limit: usize, note: &str) -> Result<(), TrainError> {
    if value == 0 {
        return Err(TrainError::Invalid(format!("--{flag} must be at least 1")));
    }
    if value > limit {
        return Err(TrainError::Invalid(format!(
            "--{flag} {value} exceeds the limit of {limit}{note}"
        )));
    }
    Ok(())
}
