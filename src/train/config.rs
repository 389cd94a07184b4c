//! `lowbit train`'s configuration: what a run depends on, its validation (every refusal with
//! its reason), the learning-rate schedule, and its translation into the library's
//! configurations (buffers, plan specs, precision policy, AdamW).

use std::path::PathBuf;

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_buffers::{ComputeFormat, DdpConfig, Overlap, PrecisionPolicy};
use lowbit_optim::AdamW;

use super::lm::{LmShape, ParamInfo};

/// How GEMM weights are stored and computed with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// bf16 weights.
    Bf16,
    /// MXFP8 (E4M3, 1x32 blocks) weights.
    Mxfp8,
    /// NVFP4 (2D 16x16 blocks, two-level scales) weights.
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

/// Which backend the ranks run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    /// Ranks are threads on the CPU reference backend.
    Cpu,
    /// One rank per GPU, NCCL between them.
    Cuda,
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
    /// Gradient buffer dtype.
    pub grad_dtype: GradDType,
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
    /// Model shape (`vocab` is set from the data source).
    pub shape: LmShape,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            ranks: 4,
            precision: Precision::Mxfp8,
            param_gather: true,
            overlap_grad_reduce: true,
            overlap_param_gather: true,
            grad_dtype: GradDType::F32,
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
        }
    }
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
        self.batch / (self.ranks * self.microbatches).max(1)
    }

    /// Refuses invalid combinations up front, each with the reason.
    pub fn validate(&self) -> Result<(), TrainError> {
        let bad = |m: String| Err(TrainError::Invalid(m));
        if self.ranks == 0 || self.ranks > 64 {
            return bad(format!("--ranks {} must be in 1..=64", self.ranks));
        }
        if self.microbatches == 0 {
            return bad("--microbatches must be at least 1".into());
        }
        if self.steps == 0 {
            return bad("--steps must be at least 1".into());
        }
        let split = self.ranks * self.microbatches;
        if self.batch == 0 || !self.batch.is_multiple_of(split) {
            return bad(format!(
                "the global batch of {} samples does not split into {} ranks x {} microbatches",
                self.batch, self.ranks, self.microbatches
            ));
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
        if self.shape.context < 2 {
            return bad(format!(
                "a context of {} tokens cannot see the order-2 source's state",
                self.shape.context
            ));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad(format!("learning rate {} must be positive", self.lr));
        }
        let s = &self.shape;
        if s.top_k == 0 || s.top_k > s.experts {
            return bad(format!(
                "top-{} routing over {} experts",
                s.top_k, s.experts
            ));
        }
        if self.precision != Precision::Bf16 {
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
        Ok(())
    }

    /// The learning rate of `step` (from 0): linear warmup over the first 5% of the steps,
    /// then cosine decay to a tenth. Computed in f64, rounded once.
    pub fn lr_at(&self, step: usize) -> f32 {
        let warmup = (self.steps / 20).max(1) as f64;
        let s = step as f64;
        let ramp = ((s + 1.0) / warmup).min(1.0);
        let progress = s / self.steps.max(1) as f64;
        let cosine = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (f64::from(self.lr) * ramp * cosine) as f32
    }

    pub(super) fn ddp(&self) -> DdpConfig {
        // `validate` refused overlapped gathers without overlapped reduction.
        let overlap = match (self.overlap_grad_reduce, self.overlap_param_gather) {
            (true, true) => Overlap::GradReduceAndParamGather,
            (true, false) => Overlap::GradReduce,
            _ => Overlap::None,
        };
        DdpConfig::default()
            .with_overlap(overlap)
            .with_bucket_size(self.bucket_size)
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
        info.iter()
            .map(|p| {
                let storage = match self.precision {
                    Precision::Mxfp8 if self.param_gather && p.matrix => {
                        ParamStorage::Quantized(QuantKind::Mxfp8)
                    }
                    // Grouped tensors need per-expert global amaxes, which NVFP4 primary storage
                    // does not have yet: they stay bf16 and are quantized per expert on the fly.
                    Precision::Nvfp4 if self.param_gather && p.matrix && p.experts == 1 => {
                        ParamStorage::Quantized(QuantKind::Nvfp4)
                    }
                    _ => ParamStorage::Bf16,
                };
                let owner = OptimizerId(if p.decay { 0 } else { 1 });
                let key = BufferKey::new(storage, self.grad_dtype, owner);
                ParamSpec::new(p.name.clone(), p.shape.clone(), key)
            })
            .collect()
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
