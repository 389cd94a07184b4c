//! `lowbit train --model llama-*`: the Llama decoder of `lowbit-llama` on token data, behind the
//! same loop as the reference model.
//!
//! Decisions:
//! - A sample is one window of `seq + 1` tokens of the training split (inputs its first `seq`,
//!   targets its last `seq`); sample `i` of the run is window `order.window_of(i)` of a
//!   deterministic permutation per epoch, so a run's data position is one number (the next
//!   sample index, which checkpoints record) and any split of a batch over ranks and
//!   microbatches reads the same windows.
//! - Without `--data` the model trains on the embedded sample of real text, byte-tokenized.
//! - The eval set is the first `eval_samples` windows of the validation split (cycled when the
//!   split has fewer), cut to whole batches on every rank; every window weighs the same, so the
//!   eval loss is the mean token loss over the set.
//! - Matrices (q/k/v/o/gate/up/down) are the GEMM weights a precision stores low and Muon
//!   updates; the embedding (and an untied head) and the norms stay high precision under AdamW,
//!   as low-precision recipes keep the first and last layers.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use lowbit_device::Device;
use lowbit_llama::data::{SampleOrder, SplitKind as Split, TokenShards, Tokenizer};
use lowbit_llama::generate::{Sampler, Sampling as Rule, generate};
use lowbit_llama::{Llama, LlamaConfig, Recompute};

use super::lm::ParamInfo;
use super::{Sampling, TrainConfig, TrainError};
use crate::model::Hooks;

/// The decoder a run trains.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaRun {
    /// The preset it started from (`llama-tiny`, …, or `config` for a config file's).
    pub preset: String,
    /// Its shape (the vocabulary at least the tokenizer's).
    pub config: LlamaConfig,
    /// Tokens per sample.
    pub seq: usize,
}

/// The largest decoder `lowbit train` builds (parameters).
pub const MAX_PARAMS: usize = 1 << 36;

impl LlamaRun {
    /// Refuses shapes and settings the run cannot build, naming the key or flag.
    pub(super) fn check(&self, cfg: &TrainConfig) -> Result<(), String> {
        self.config.validate().map_err(|e| e.to_string())?;
        if self.seq == 0 || self.seq > self.config.max_seq {
            return Err(format!(
                "--seq {} must be in 1..={} (the model's max_seq, the RoPE table's length)",
                self.seq, self.config.max_seq
            ));
        }
        let params = lowbit_llama::params::param_count(&self.config);
        if params > MAX_PARAMS {
            return Err(format!(
                "the decoder has {params} parameters, over the limit of {MAX_PARAMS}"
            ));
        }
        if cfg.precision != super::Precision::Bf16 {
            let (q, kv) = self.config.qkv_widths();
            let widths = [
                ("dim", self.config.dim),
                ("heads x head_dim", q),
                ("kv_heads x head_dim", kv),
                ("ffn", self.config.ffn),
            ];
            if let Some((k, w)) = widths.iter().find(|(_, w)| !w.is_multiple_of(32)) {
                return Err(format!(
                    "{} weights need matrix sides that are multiples of 32 (MXFP8 blocks, NVFP4 \
                     tiles); the model's {k} is {w}",
                    cfg.precision.name()
                ));
            }
        }
        if self.activation_bytes(cfg).is_none_or(|b| b > 1 << 40) {
            return Err(format!(
                "{} sequences of {} tokens per microbatch need more than 1 TiB of \
                 activations (lower --batch or raise --microbatches)",
                cfg.rows().max(1),
                self.seq
            ));
        }
        Ok(())
    }

    /// One rank's activation memory under `cfg` (its microbatch rows and recompute level), the
    /// closed form of [`Llama::activation_bytes_in`] in its compute mode; `None` where it
    /// overflows.
    pub fn activation_bytes(&self, cfg: &TrainConfig) -> Option<usize> {
        let rows = cfg.rows().max(1);
        let mode = cfg.compute.matmul_mode();
        Llama::activation_bytes_in(&self.config, rows, self.seq, cfg.recompute, mode).ok()
    }

    /// Every parameter, in forward order, as the loop describes them.
    pub(super) fn params(&self) -> Vec<ParamInfo> {
        lowbit_llama::params::params(&self.config)
            .into_iter()
            .map(|p| ParamInfo {
                name: p.name,
                shape: p.shape,
                matrix: p.matrix,
                experts: 1,
                decay: p.decay,
            })
            .collect()
    }

    /// The checkpoint's record of the model (`model.*` keys, `model` = `llama`).
    pub(super) fn config_map(&self) -> BTreeMap<String, String> {
        let c = &self.config;
        let scaling = c.rope_scaling.map_or("none".to_string(), |s| {
            format!(
                "llama3 {} {} {} {}",
                s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
            )
        });
        [
            ("model", "llama".to_string()),
            ("model.preset", self.preset.clone()),
            ("model.vocab", c.vocab.to_string()),
            ("model.dim", c.dim.to_string()),
            ("model.layers", c.layers.to_string()),
            ("model.heads", c.heads.to_string()),
            ("model.kv_heads", c.kv_heads.to_string()),
            ("model.head_dim", c.head_dim.to_string()),
            ("model.ffn", c.ffn.to_string()),
            ("model.rope_theta", c.rope_theta.to_string()),
            ("model.rope_scaling", scaling),
            ("model.rms_eps", c.rms_eps.to_string()),
            ("model.tied", c.tied.to_string()),
            ("model.max_seq", c.max_seq.to_string()),
            ("model.init_std", c.init_std.to_string()),
            ("model.seq", self.seq.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The run [`LlamaRun::config_map`] recorded; `None` when `config` records no decoder.
    pub(super) fn from_config_map(config: &BTreeMap<String, String>) -> Option<LlamaRun> {
        if config.get("model").map(String::as_str) != Some("llama") {
            return None;
        }
        let get = |k: &str| config.get(&format!("model.{k}"));
        let n = |k: &str| get(k)?.parse::<usize>().ok();
        let f = |k: &str| get(k)?.parse::<f64>().ok();
        let scaling = match get("rope_scaling")?.as_str() {
            "none" => None,
            s => {
                let v: Vec<&str> = s.split(' ').collect();
                match v[..] {
                    ["llama3", a, b, c, d] => Some(lowbit_nn::layers::Llama3RopeScaling {
                        factor: a.parse().ok()?,
                        low_freq_factor: b.parse().ok()?,
                        high_freq_factor: c.parse().ok()?,
                        original_max_position: d.parse().ok()?,
                    }),
                    _ => return None,
                }
            }
        };
        let config = LlamaConfig {
            vocab: n("vocab")?,
            dim: n("dim")?,
            layers: n("layers")?,
            heads: n("heads")?,
            kv_heads: n("kv_heads")?,
            head_dim: n("head_dim")?,
            ffn: n("ffn")?,
            rope_theta: f("rope_theta")?,
            rope_scaling: scaling,
            rms_eps: get("rms_eps")?.parse().ok()?,
            tied: get("tied")?.parse().ok()?,
            max_seq: n("max_seq")?,
            init_std: get("init_std")?.parse().ok()?,
        };
        Some(LlamaRun {
            preset: get("preset")?.clone(),
            config,
            seq: n("seq")?,
        })
    }
}

/// The tokenizer of the data a decoder run reads (`--data`, or the embedded sample's bytes).
///
/// # Errors
/// [`TrainError::Data`] when the data cannot be opened; [`TrainError::Invalid`] for the
/// reference model, which has no tokenizer.
pub fn tokenizer_of(cfg: &TrainConfig) -> Result<Tokenizer, TrainError> {
    if cfg.model == super::ModelChoice::Reference {
        return Err(TrainError::Invalid(
            "the reference model has no tokenizer (generation needs --model llama-*)".into(),
        ));
    }
    match &cfg.data {
        Some(dir) => Ok(TokenShards::open(dir)
            .map_err(|e| TrainError::Data(e.to_string()))?
            .tokenizer()),
        None => Ok(Tokenizer::Bytes),
    }
}

/// The masters of the Hugging Face directory `dir` for `run` (`--init-from`): its
/// `config.json` must describe `run`'s model (the first differing key is named), its
/// `eos_token_id`, when given, must be the data tokenizer's end-of-text (another tokenizer's
/// ids would be read as this one's), and every weight must be there with its shape and finite.
/// The values are the file's high-precision ones (f32, or bf16/f16 widened exactly); the run
/// quantizes its primary weights from them as from any initial masters.
fn init_from(dir: &Path, run: &LlamaRun, tok: Tokenizer) -> Result<Vec<Vec<f32>>, TrainError> {
    let bad = |m: String| TrainError::Invalid(format!("--init-from {}: {m}", dir.display()));
    let hf = lowbit_llama::hf::read_config(dir).map_err(|e| bad(e.to_string()))?;
    if let Some((key, theirs, ours)) =
        lowbit_llama::hf::config::first_difference(&hf.model, &run.config)
    {
        return Err(bad(format!(
            "config.json has {key} = {theirs}, but the run's model ({}) has {ours}; give no \
             --model (the shape is config.json's) or one that agrees",
            run.preset
        )));
    }
    if !hf.eos_token_ids.is_empty() && !hf.eos_token_ids.contains(&u64::from(tok.eot())) {
        return Err(bad(format!(
            "config.json's eos_token_id {:?} is not the {} tokenizer's end-of-text {} of the \
             data: the model was trained with another tokenizer",
            hf.eos_token_ids,
            tok.name(),
            tok.eot()
        )));
    }
    let values =
        lowbit_llama::hf::read_weights(dir, &run.config).map_err(|e| bad(e.to_string()))?;
    for (p, v) in lowbit_llama::params::params(&run.config)
        .iter()
        .zip(&values)
    {
        if let Some(i) = v.iter().position(|x| !x.is_finite()) {
            return Err(bad(format!("`{}` holds {} at element {i}", p.name, v[i])));
        }
    }
    Ok(values)
}

/// The decoder's job: the model, its data, the order and the eval set.
pub(crate) struct LlamaJob {
    pub(super) run: LlamaRun,
    data: TokenShards,
    order: SampleOrder,
    /// Validation window of each eval item (a whole number of batches per rank).
    eval: Vec<u64>,
    /// The initial masters read from `--init-from` (else the seeded initialization).
    init: Option<Vec<Vec<f32>>>,
}

impl LlamaJob {
    /// The job `cfg` describes; refuses data whose tokenizer the vocabulary cannot hold.
    pub(super) fn build(cfg: &TrainConfig, run: &LlamaRun) -> Result<LlamaJob, TrainError> {
        let data = match &cfg.data {
            Some(dir) => TokenShards::open(dir).map_err(|e| TrainError::Data(e.to_string()))?,
            None => {
                TokenShards::from_text(lowbit_llama::data::embedded_sample(), Tokenizer::Bytes, 0.1)
                    .map_err(|e| TrainError::Data(e.to_string()))?
            }
        };
        let vocab = data.tokenizer().vocab() as usize;
        if run.config.vocab < vocab {
            return Err(TrainError::Invalid(format!(
                "the model's vocab {} is smaller than the {} tokenizer's {vocab} ids of the data \
                 (set vocab = {} or more in the --config file's [model] table)",
                run.config.vocab,
                data.tokenizer().name(),
                vocab.next_multiple_of(64)
            )));
        }
        let init = match &cfg.init_from {
            Some(dir) => Some(init_from(dir, run, data.tokenizer())?),
            None => None,
        };
        let train = data.split(Split::Train).windows(run.seq);
        let val = data.split(Split::Validation).windows(run.seq);
        if train == 0 || val == 0 {
            return Err(TrainError::Data(format!(
                "the data hold {train} training and {val} validation windows of {} tokens; \
                 both splits need at least one (a smaller --seq, or more data)",
                run.seq + 1
            )));
        }
        let split = cfg.ranks * cfg.rows();
        let items = cfg.eval_samples.div_ceil(split).max(1) * split;
        let eval = (0..items as u64).map(|i| i % val).collect();
        Ok(LlamaJob {
            run: run.clone(),
            order: SampleOrder::new(cfg.seed, train)
                .map_err(|e| TrainError::Data(e.to_string()))?,
            data,
            eval,
            init,
        })
    }

    /// Every parameter's initial master values: `--init-from`'s, else the seeded ones.
    pub(super) fn initial_values(&self, seed: u64) -> Vec<Vec<f32>> {
        match &self.init {
            Some(v) => v.clone(),
            None => lowbit_llama::params::init(&self.run.config, seed),
        }
    }

    /// What identifies the data.
    pub(super) fn fingerprint(&self) -> String {
        format!(
            "tokens {} fnv1a64 {:016x}",
            self.data.tokenizer().name(),
            self.data.fingerprint()
        )
    }

    /// Items of the eval set.
    pub(super) fn eval_items(&self) -> usize {
        self.eval.len()
    }

    /// The tokenizer of the data.
    pub(super) fn tokenizer(&self) -> Tokenizer {
        self.data.tokenizer()
    }

    /// Inputs and targets of the windows `windows` of `split`.
    fn batch(&self, split: Split, windows: impl Iterator<Item = u64>) -> Result<Batch, String> {
        let seq = self.run.seq;
        let mut b = Batch::default();
        let mut t = vec![0u32; seq + 1];
        for w in windows {
            self.data
                .split(split)
                .window(seq, w, &mut t)
                .map_err(|e| e.to_string())?;
            b.tokens.extend_from_slice(&t[..seq]);
            b.targets.extend_from_slice(&t[1..]);
        }
        Ok(b)
    }

    /// One rank's model over microbatches of `rows` sequences.
    pub(super) fn rank<'a>(
        &'a self,
        dev: &mut Device,
        rows: usize,
        recompute: Recompute,
    ) -> Result<LlamaRank<'a>, String> {
        let (cfg, seq) = (&self.run.config, self.run.seq);
        let model =
            Llama::with_recompute(dev, cfg, rows, seq, recompute).map_err(|e| e.to_string())?;
        Ok(LlamaRank {
            job: self,
            order: self.order.clone(),
            model,
            rows,
        })
    }
}

#[derive(Default)]
struct Batch {
    tokens: Vec<u32>,
    targets: Vec<u32>,
}

/// One rank's decoder.
pub(crate) struct LlamaRank<'a> {
    job: &'a LlamaJob,
    /// This rank's copy of the order (it caches the current epoch's permutation).
    order: SampleOrder,
    model: Llama,
    rows: usize,
}

impl LlamaRank<'_> {
    /// Forward and backward of training samples `first..first + rows`.
    pub(super) fn train(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        first: u64,
        scale: f32,
    ) -> Result<f32, String> {
        let order = &mut self.order;
        let windows: Vec<u64> = (first..first + self.rows as u64)
            .map(|i| order.window_of(i))
            .collect();
        let b = self.job.batch(Split::Train, windows.into_iter())?;
        self.model
            .forward_backward(dev, hooks, &b.tokens, &b.targets, scale)
            .map_err(|e| e.to_string())
    }

    /// `Σ loss / items` over the eval items `range`, in whole batches.
    pub(super) fn eval(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        range: Range<usize>,
    ) -> Result<f64, String> {
        let items = self.job.eval.len() as f64;
        let mut total = 0f64;
        for chunk in self.job.eval[range].chunks(self.rows) {
            let b = self.job.batch(Split::Validation, chunk.iter().copied())?;
            let loss = self
                .model
                .eval_loss(dev, hooks, &b.tokens, &b.targets)
                .map_err(|e| e.to_string())?;
            total += f64::from(loss) * chunk.len() as f64 / items;
        }
        Ok(total)
    }

    /// Samples a continuation of the prompt.
    pub(super) fn generate(
        &mut self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        s: &Sampling,
    ) -> Result<Vec<u32>, String> {
        let rule = if s.temperature == 0.0 {
            Rule::Greedy
        } else {
            Rule::Temperature {
                temperature: s.temperature,
                top_k: s.top_k,
                seed: s.seed,
            }
        };
        let mut sampler = Sampler::new(rule).map_err(|e| e.to_string())?;
        let eot = self.job.tokenizer().eot();
        // An empty prompt starts from the end-of-text token, as a new document does.
        let prompt = if s.prompt.is_empty() {
            vec![eot]
        } else {
            s.prompt.clone()
        };
        let model = &mut self.model;
        let mut next = |t: &[u32]| model.next_logits(dev, hooks, t);
        let mut out = generate(
            &prompt,
            s.max_new,
            self.job.run.seq,
            &mut next,
            &mut sampler,
        )
        .map_err(|e| e.to_string())?;
        if let Some(stop) = s.stop
            && let Some(at) = out.iter().position(|&t| t == stop)
        {
            out.truncate(at);
        }
        Ok(out)
    }
}
