//! What a run of `lowbit train` reports ([`TrainReport`] and its parts, [`StepLog`] for
//! progress) and what it is asked to do once its weights are loaded ([`RunMode`]).

use std::path::PathBuf;
use std::time::Duration;

use lowbit_buffers::layout::OptimizerId;
use lowbit_comm::CommStats;
use lowbit_optim::RankMemory;

use super::lm::ParamInfo;
use super::{ModelChoice, TrainConfig};

/// Progress of one step, as rank 0 reports it after the step (its eval and save included):
/// the values the run computed, for progress lines and `--metrics` records.
#[derive(Clone, Copy, Debug)]
pub struct StepLog {
    /// Step number, from 1.
    pub step: usize,
    /// Of how many.
    pub steps: usize,
    /// The step this run started after (a resumed checkpoint's step; 0 for a fresh run).
    pub first_step: usize,
    /// Mean training loss over the global batch.
    pub loss: f32,
    /// Global gradient norm (before clipping).
    pub grad_norm: f32,
    /// Whether the optimizer skipped the step (a non-finite gradient norm).
    pub skipped: bool,
    /// The learning rate of the AdamW groups at this step.
    pub lr: f32,
    /// Muon's learning rate at this step (`None` without `--optimizer muon`).
    pub muon_lr: Option<f32>,
    /// Eval loss, on steps that evaluated.
    pub eval: Option<f32>,
    /// Tokens the eval set predicts (items × tokens per item).
    pub eval_tokens: usize,
    /// Predicted tokens per step over all ranks.
    pub tokens_per_step: usize,
    /// Predicted tokens per second so far.
    pub tokens_per_s: f64,
    /// Wall time since this run's first step began.
    pub elapsed: Duration,
    /// Rank 0's peak device allocation so far, bytes ([`lowbit_device::Device::peak_allocated_bytes`]).
    pub device_peak_bytes: usize,
    /// Training FLOPs per token of a decoder, `6·params + 12·layers·seq·dim` (PaLM's estimate,
    /// attention included); `None` for the reference model.
    pub flops_per_token: Option<f64>,
}

impl StepLog {
    /// The learning rates of step `step` (from 0) under `cfg`: AdamW's, and Muon's (its peak over
    /// AdamW's times the schedule, rounded once, as `OptimConfig::scheduled` sets it).
    pub(super) fn scheduled_lrs(cfg: &TrainConfig, step: usize) -> (f32, Option<f32>) {
        let lr = cfg.lr_at(step);
        let muon = cfg.optimizer.muon().map(|m| {
            let ratio = f64::from(m.lr) / f64::from(cfg.lr);
            lowbit_optim::OptimConfig::new(m.lr)
                .with_lr_ratio(ratio)
                .scheduled(lr)
                .map_or(f32::NAN, |c| c.lr)
        });
        (lr, muon)
    }

    /// A decoder's training FLOPs per token, `6·N + 12·L·T·d` (N parameters, L layers, T the
    /// sequence, d the model width): the estimate of PaLM (Chowdhery et al. 2022, appendix B),
    /// the attention scores' FLOPs added to the dense `6N`. `None` for the reference model.
    pub(super) fn flops_per_token(cfg: &TrainConfig, info: &[ParamInfo]) -> Option<f64> {
        let ModelChoice::Llama(run) = &cfg.model else {
            return None;
        };
        let params: usize = info.iter().map(|p| p.shape.iter().product::<usize>()).sum();
        let attention = 12.0 * run.config.layers as f64 * run.seq as f64 * run.config.dim as f64;
        Some(6.0 * params as f64 + attention)
    }
}

/// Wall time per phase on rank 0.
#[derive(Clone, Copy, Debug, Default)]
pub struct Phases {
    /// Forward and backward (including waits on overlapped parameter gathers).
    pub forward_backward: Duration,
    /// Finishing the gradient reduction.
    pub grad_sync: Duration,
    /// Optimizer step (grad norm, AdamW, staging of the new weights).
    pub optimizer: Duration,
    /// Parameter gathers outside the forward (begin of iteration, forced syncs).
    pub param_sync: Duration,
    /// Evaluations.
    pub eval: Duration,
    /// Checkpoint loading and saving (with the forced parameter sync before each save).
    pub checkpoint: Duration,
}

/// What a run produced.
#[derive(Clone, Debug)]
pub struct TrainReport {
    /// The configuration (with the vocabulary of the source).
    pub config: TrainConfig,
    /// Steps done before this run (the resumed checkpoint's step; 0 for a fresh run): the
    /// first entry of `losses` is step `first_step + 1`.
    pub first_step: usize,
    /// The checkpoint resumed from.
    pub resumed_from: Option<PathBuf>,
    /// The checkpoints this run saved, in order.
    pub saved: Vec<PathBuf>,
    /// The token ids [`RunMode::Generate`] sampled (empty otherwise).
    pub generated: Vec<u32>,
    /// Every step's mean training loss.
    pub losses: Vec<f32>,
    /// Every step's global gradient norm.
    pub grad_norms: Vec<f32>,
    /// `(step, eval loss)`.
    pub evals: Vec<(usize, f32)>,
    /// The loss floor (entropy rate, nats) where known.
    pub floor: Option<f64>,
    /// Eval items in the eval set, and whether it enumerates every context exactly.
    pub eval_set: (usize, bool),
    /// Parameters in the model.
    pub params: usize,
    /// FNV-1a 64 of the final fp32 masters (every parameter in order, little-endian).
    pub master_checksum: u64,
    /// Rank 0's memory.
    pub memory: RankMemory,
    /// The same model with bf16 weights, fp32 gradients, masters and the same optimizers'
    /// state (AdamW two tensors, Muon one), unsharded.
    pub baseline: RankMemory,
    /// Who updates each parameter, in model order (from the sharding plan).
    pub owners: Vec<ParamOwner>,
    /// Muon's work per rank (empty without Muon), in rank order.
    pub muon_ranks: Vec<MuonRankLoad>,
    /// Rank 0's collectives.
    pub comm: CommStats,
    /// Rank 0's time per phase.
    pub phases: Phases,
    /// Wall time of the training loop.
    pub wall: Duration,
}

/// Which optimizer updates one parameter, and where.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamOwner {
    /// Parameter name.
    pub name: String,
    /// Shape (grouped expert weights `[experts, out, in]`).
    pub shape: Vec<usize>,
    /// `"adamw"` or `"muon"`.
    pub optimizer: &'static str,
    /// The owner id in the plan (see [`super::owners`]).
    pub owner: OptimizerId,
    /// Decoupled weight decay applied to it.
    pub weight_decay: f32,
    /// The ranks holding a piece of its fp32 master and optimizer state, ascending. A Muon
    /// matrix has exactly one (the layer-wise rule places it whole); an AdamW parameter has the
    /// ranks whose shards of its bucket it overlaps.
    pub ranks: Vec<usize>,
    /// Muon's learning-rate factor for each of its matrices (`None` for AdamW).
    pub muon_lr_factor: Option<f64>,
}

/// One rank's share of the Muon matrices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MuonRankLoad {
    /// The rank.
    pub rank: usize,
    /// Parameters it owns whole.
    pub params: usize,
    /// Matrices it orthogonalizes per step (a grouped expert tensor counts each expert).
    pub matrices: usize,
    /// Elements of those parameters.
    pub elements: usize,
}

/// What a run does once its weights are loaded.
#[derive(Clone, Debug, PartialEq)]
pub enum RunMode {
    /// Train from the (resumed) step to `--steps`.
    Train,
    /// Only evaluate the checkpoint's weights (`lowbit eval`): the report's `evals` holds one
    /// entry, at the checkpoint's step. Data other than the training data are allowed.
    Eval,
    /// Only sample a continuation of a prompt with the checkpoint's weights (`lowbit
    /// generate`): the report's `generated` holds the new token ids.
    Generate(Sampling),
}

/// A generation request.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampling {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Tokens to generate.
    pub max_new: usize,
    /// 0 for greedy decoding, else the softmax temperature.
    pub temperature: f32,
    /// Sample only among the k most likely tokens (`None`: all).
    pub top_k: Option<usize>,
    /// Seed of the sampler.
    pub seed: u64,
    /// Stop at this token (the tokenizer's end of text), if given.
    pub stop: Option<u32>,
}
