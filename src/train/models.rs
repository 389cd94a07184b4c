//! The models `lowbit train` trains, behind the one training loop: the reference MoE language
//! model ([`super::lm`]) on its sources, and the Llama decoder of `lowbit-llama` on token data
//! ([`super::llama`]).
//!
//! The loop needs of a model only what is here: its parameters and initial values, its data's
//! fingerprint and eval set, and per rank a forward and backward of a microbatch of samples
//! (given by their global index, so every split of a batch over ranks and microbatches sees the
//! same samples) and the weighted loss of a range of eval items.

use std::ops::Range;

use lowbit_device::Device;

use super::data::{EvalItem, MarkovSource, Source, Target, TextSource};
use super::llama::{LlamaJob, LlamaRank};
use super::lm::Lm;
use super::{ModelChoice, TrainConfig, TrainError};
use crate::model::Hooks;

/// The model and data of a run, shared by every rank.
pub(crate) enum JobModel {
    /// The reference model on the Markov source or the bytes of a file.
    Reference {
        /// Where samples come from.
        source: Source,
        /// The eval set, padded with weightless items to whole batches on every rank.
        eval: Vec<EvalItem>,
        /// Items of the eval set before padding, and whether it is exhaustive.
        eval_set: (usize, bool),
    },
    /// A Llama decoder on token data.
    Llama(Box<LlamaJob>),
}

impl JobModel {
    /// The model and data `cfg` describes; sets the vocabulary from the data.
    pub(crate) fn build(cfg: &mut TrainConfig) -> Result<JobModel, TrainError> {
        if let ModelChoice::Llama(run) = &cfg.model {
            return Ok(JobModel::Llama(Box::new(LlamaJob::build(cfg, run)?)));
        }
        let source = match &cfg.data {
            Some(path) => {
                Source::Text(TextSource::open(path, cfg.shape.context).map_err(TrainError::Data)?)
            }
            None => Source::Markov(MarkovSource::new(cfg.shape.vocab, cfg.seed)),
        };
        cfg.shape.vocab = source.vocab();
        let (mut eval, exact) = source.eval_set(cfg.seed, cfg.shape.context, cfg.eval_samples);
        let len = eval.len();
        let split = cfg.ranks * cfg.rows();
        let pad = EvalItem {
            weight: 0.0,
            ..eval[0].clone()
        };
        eval.resize(len.div_ceil(split) * split, pad);
        Ok(JobModel::Reference {
            source,
            eval,
            eval_set: (len, exact),
        })
    }

    /// The initial values of every parameter (the fp32 masters start from these).
    pub(crate) fn init(&self, cfg: &TrainConfig) -> Vec<Vec<f32>> {
        match self {
            JobModel::Reference { .. } => cfg.shape.init(cfg.seed),
            JobModel::Llama(j) => j.initial_values(cfg.seed),
        }
    }

    /// What identifies the data (recorded in checkpoints; a resume refuses other data).
    pub(crate) fn fingerprint(&self) -> String {
        match self {
            JobModel::Reference { source, .. } => source.fingerprint(),
            JobModel::Llama(j) => j.fingerprint(),
        }
    }

    /// The loss floor in nats where it is known.
    pub(crate) fn floor(&self) -> Option<f64> {
        match self {
            JobModel::Reference { source, .. } => source.floor(),
            JobModel::Llama(_) => None,
        }
    }

    /// Items of the eval set (before padding) and whether it is exhaustive.
    pub(crate) fn eval_set(&self) -> (usize, bool) {
        match self {
            JobModel::Reference { eval_set, .. } => *eval_set,
            JobModel::Llama(j) => (j.eval_items(), false),
        }
    }

    /// Items of the padded eval set: a whole number of batches on every rank.
    pub(crate) fn eval_items(&self) -> usize {
        match self {
            JobModel::Reference { eval, .. } => eval.len(),
            JobModel::Llama(j) => j.eval_items(),
        }
    }

    /// Tokens predicted per sample (for tokens per second).
    pub(crate) fn tokens_per_sample(&self) -> usize {
        match self {
            JobModel::Reference { .. } => 1,
            JobModel::Llama(j) => j.run.seq,
        }
    }

    /// One rank's model over microbatches of `rows` samples.
    pub(crate) fn rank<'a>(
        &'a self,
        cfg: &'a TrainConfig,
        dev: &mut Device,
        rows: usize,
    ) -> Result<RankModel<'a>, String> {
        match self {
            JobModel::Reference { source, eval, .. } => {
                let lm = Box::new(
                    Lm::new(dev, cfg.shape, rows)
                        .with_recompute(dev, cfg.recompute.is_on())
                        .map_err(|e| e.to_string())?,
                );
                Ok(RankModel::Reference {
                    lm,
                    source,
                    eval,
                    cfg,
                    rows,
                })
            }
            JobModel::Llama(j) => Ok(RankModel::Llama(Box::new(j.rank(
                dev,
                rows,
                cfg.recompute,
            )?))),
        }
    }
}

/// One rank's model: activations and scratch, and the data it reads.
pub(crate) enum RankModel<'a> {
    /// The reference model.
    Reference {
        lm: Box<Lm>,
        source: &'a Source,
        eval: &'a [EvalItem],
        cfg: &'a TrainConfig,
        rows: usize,
    },
    /// A decoder.
    Llama(Box<LlamaRank<'a>>),
}

impl RankModel<'_> {
    /// Forward and backward of the microbatch of training samples `first..first + rows`; the
    /// gradients of `scale ·` its mean loss accumulate through the hooks. Returns the mean loss.
    pub(crate) fn train(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        first: u64,
        scale: f32,
    ) -> Result<f32, String> {
        match self {
            RankModel::Reference {
                lm,
                source,
                cfg,
                rows,
                ..
            } => {
                let (mut t, mut y) = (Vec::new(), Vec::new());
                for i in 0..*rows as u64 {
                    source.sample(
                        cfg.seed,
                        first + i,
                        false,
                        cfg.shape.context,
                        &mut t,
                        &mut y,
                    );
                }
                lm.step(dev, hooks, &t, &y, Some(scale))
                    .map_err(|e| e.to_string())
            }
            RankModel::Llama(l) => l.train(dev, hooks, first, scale),
        }
    }

    /// The weighted loss `Σ weight · loss` of the eval items `range` (a whole number of
    /// batches), in item order.
    pub(crate) fn eval(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        range: Range<usize>,
    ) -> Result<f64, String> {
        match self {
            RankModel::Reference {
                lm,
                eval,
                cfg,
                rows,
                ..
            } => {
                let vocab = cfg.shape.vocab;
                let mut total = 0f64;
                for chunk in eval[range].chunks(*rows) {
                    let tokens: Vec<u32> = chunk.iter().flat_map(|i| i.tokens.clone()).collect();
                    let logits = lm.logits(dev, hooks, &tokens).map_err(|e| e.to_string())?;
                    for (item, row) in chunk.iter().zip(logits.chunks_exact(vocab)) {
                        total += item.weight * cross_entropy(row, &item.target);
                    }
                }
                Ok(total)
            }
            RankModel::Llama(l) => l.eval(dev, hooks, range),
        }
    }
}

impl RankModel<'_> {
    /// Samples `sampling.max_new` tokens after the prompt with the hooks' weights.
    pub(crate) fn generate(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        sampling: &super::Sampling,
    ) -> Result<Vec<u32>, String> {
        match self {
            RankModel::Llama(l) => l.generate(dev, hooks, sampling),
            RankModel::Reference { .. } => Err(
                "generation needs a decoder (--model llama-*); the reference model predicts one \
                 token from a fixed context"
                    .into(),
            ),
        }
    }
}

/// Cross-entropy of one row of logits against a target, in f64 (log-softmax with the max
/// subtracted).
fn cross_entropy(logits: &[f32], target: &Target) -> f64 {
    let mx = logits
        .iter()
        .fold(f64::NEG_INFINITY, |m, &x| m.max(f64::from(x)));
    let lse = mx
        + logits
            .iter()
            .map(|&x| (f64::from(x) - mx).exp())
            .sum::<f64>()
            .ln();
    match target {
        Target::Token(t) => lse - f64::from(logits[*t as usize]),
        Target::Dist(p) => p
            .iter()
            .zip(logits)
            .map(|(q, &x)| q * (lse - f64::from(x)))
            .sum(),
    }
}
