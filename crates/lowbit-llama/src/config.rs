//! The model's shape: [`LlamaConfig`], the named [`presets`], and config files.
//!
//! A config file is TOML whose keys are [`LlamaConfig`]'s fields, every one optional over a
//! `preset = "..."` base (`llama-tiny` when absent):
//!
//! ```toml
//! preset = "llama-8b-layers"
//! layers = 2
//! vocab = 50304
//! rope_scaling = "none"          # or a table: factor, low_freq_factor, high_freq_factor,
//!                                # original_max_position (each optional over the base's)
//! ```
//!
//! Unknown keys and wrong types are refused naming the file and the key; the merged shape is then
//! [`LlamaConfig::validate`]d, so a file can only describe a model that can be built. When
//! `dim` or `heads` is given without `head_dim`, `head_dim = dim / heads` (which must divide).

use lowbit_device::ATTENTION_MAX_HEAD_DIM;
use serde::Deserialize;

use crate::{LlamaError, Result};

pub use lowbit_nn::layers::Llama3RopeScaling;

/// Llama 3.1/3.2's RoPE scaling with this `factor` (8 for Llama-3.1-8B, 32 for Llama-3.2-1B):
/// low frequency factor 1, high 4, original context 8192 (their `config.json`s).
pub fn llama3_scaling(factor: f64) -> Llama3RopeScaling {
    Llama3RopeScaling {
        factor,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    }
}

/// The shape of a Llama-family decoder (Hugging Face `LlamaConfig`'s fields under shorter names).
///
/// Parameters and their shapes follow from it ([`crate::params`]); [`LlamaConfig::validate`]
/// refuses shapes that cannot be built. `max_seq` bounds the sequence length a model may be built
/// for (the RoPE table's length, HF's `max_position_embeddings`); the model computes the tables
/// for the sequence length it is built with only.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Vocabulary size: rows of the embedding and of the output head.
    pub vocab: usize,
    /// Model width (`hidden_size`).
    pub dim: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`); divides `heads` (grouped-query attention).
    pub kv_heads: usize,
    /// Width of one head (even, for the rotate-half RoPE); usually `dim / heads`.
    pub head_dim: usize,
    /// Hidden width of the SwiGLU MLP (`intermediate_size`).
    pub ffn: usize,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// Llama 3 frequency scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// RMSNorm epsilon (`rms_norm_eps`).
    pub rms_eps: f32,
    /// Whether the output head is the embedding (`tie_word_embeddings`).
    pub tied: bool,
    /// The longest sequence a model may be built for (`max_position_embeddings`).
    pub max_seq: usize,
    /// Standard deviation of the normal initialization of the matrices and the embedding
    /// (`initializer_range`).
    pub init_std: f32,
}

/// Largest vocabulary: token ids travel to the device as f32, exact up to 2^24.
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest `max_seq` (positions far beyond any RoPE table anyone builds).
pub const MAX_SEQ: usize = 1 << 24;
/// Largest element count of one parameter (2^40 f32 = 4 TiB: anything above is a typo).
pub const MAX_TENSOR: usize = 1 << 40;

/// The named shapes.
pub mod presets {
    use super::{LlamaConfig, llama3_scaling};

    /// The preset names [`by_name`] knows.
    pub const NAMES: [&str; 4] = ["llama-tiny", "llama-125m", "llama-1b", "llama-8b-layers"];

    /// Layers of [`llama_8b_layers`] unless a config says otherwise.
    pub const LLAMA_8B_DEFAULT_LAYERS: usize = 4;

    /// A CI-sized decoder: vocab 288 (the byte tokenizer's 257 ids, rounded up to a multiple of
    /// 32), d 64, 2 layers, 4 heads over 2 kv heads of 16, ffn 192 (3·d), tied, max_seq 64.
    pub fn llama_tiny() -> LlamaConfig {
        LlamaConfig {
            vocab: 288,
            dim: 64,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 192,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_eps: 1e-5,
            tied: true,
            max_seq: 64,
            init_std: 0.02,
        }
    }

    /// A GPT-2-small-sized Llama: vocab 50304 (GPT-2's 50257 padded to a multiple of 64), d 768,
    /// 12 layers, 12 heads of 64 (no grouping), ffn 2048 = 8/3·768 exactly (a multiple of 256,
    /// the rounding Llama's `multiple_of` applies), tied, max_seq 1024, theta 10000.
    pub fn llama_125m() -> LlamaConfig {
        LlamaConfig {
            vocab: 50304,
            dim: 768,
            layers: 12,
            heads: 12,
            kv_heads: 12,
            head_dim: 64,
            ffn: 2048,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rms_eps: 1e-5,
            tied: true,
            max_seq: 1024,
            init_std: 0.02,
        }
    }

    /// Llama-3.2-1B's shapes (its `config.json`): vocab 128256, d 2048, 16 layers, 32 heads over
    /// 8 kv heads of 64, ffn 8192, theta 500000 with llama3 scaling (factor 32, low 1, high 4,
    /// original 8192), eps 1e-5, tied, max_seq 131072 (`max_position_embeddings`; the model
    /// builds RoPE tables only for the sequence length it is built with).
    pub fn llama_1b() -> LlamaConfig {
        LlamaConfig {
            vocab: 128_256,
            dim: 2048,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            ffn: 8192,
            rope_theta: 500_000.0,
            rope_scaling: Some(llama3_scaling(32.0)),
            rms_eps: 1e-5,
            tied: true,
            max_seq: 131_072,
            init_std: 0.02,
        }
    }

    /// `layers` layers of Llama-3.1-8B's shapes: d 4096, 32 heads over 8 kv heads of 128, ffn
    /// 14336, vocab 128256, untied, theta 500000 with llama3 scaling factor 8, eps 1e-5,
    /// max_seq 131072.
    pub fn llama_8b_layers(layers: usize) -> LlamaConfig {
        LlamaConfig {
            vocab: 128_256,
            dim: 4096,
            layers,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            ffn: 14_336,
            rope_theta: 500_000.0,
            rope_scaling: Some(llama3_scaling(8.0)),
            rms_eps: 1e-5,
            tied: false,
            max_seq: 131_072,
            init_std: 0.02,
        }
    }

    /// The preset of this name ([`NAMES`]), `llama-8b-layers` with its default layer count.
    pub fn by_name(name: &str) -> Option<LlamaConfig> {
        Some(match name {
            "llama-tiny" => llama_tiny(),
            "llama-125m" => llama_125m(),
            "llama-1b" => llama_1b(),
            "llama-8b-layers" => llama_8b_layers(LLAMA_8B_DEFAULT_LAYERS),
            _ => return None,
        })
    }
}

fn config_err(msg: String) -> LlamaError {
    LlamaError::Config(msg)
}

impl LlamaConfig {
    /// The preset `name`, or [`LlamaError::Config`] listing the known names.
    pub fn preset(name: &str) -> Result<LlamaConfig> {
        presets::by_name(name).ok_or_else(|| {
            config_err(format!(
                "preset: unknown model preset {name:?} (known: {})",
                presets::NAMES.join(", ")
            ))
        })
    }

    /// The config with the vocabulary of a tokenizer of `tokens` ids, rounded up to a multiple of
    /// 64 when `pad` (GPT-2's 50257 → 50304; the padded rows are never a target, so they only
    /// learn to be unlikely).
    pub fn with_vocab(self, tokens: usize, pad: bool) -> LlamaConfig {
        let vocab = if pad {
            tokens.div_ceil(64).saturating_mul(64)
        } else {
            tokens
        };
        LlamaConfig { vocab, ..self }
    }

    /// Query/key/value widths: `(heads·head_dim, kv_heads·head_dim)`.
    pub fn qkv_widths(&self) -> (usize, usize) {
        (self.heads * self.head_dim, self.kv_heads * self.head_dim)
    }

    /// Checks that the shape can be built: every size positive, `heads % kv_heads == 0`, an even
    /// `head_dim` within the attention ops' [`ATTENTION_MAX_HEAD_DIM`], a vocabulary within [`MAX_VOCAB`], `max_seq` within [`MAX_SEQ`], every
    /// parameter within [`MAX_TENSOR`] elements and the total count within `usize`, a finite
    /// `rope_theta > 1`, sane llama3 scaling values, a finite `rms_eps > 0` and `init_std > 0`.
    /// The error names the key.
    pub fn validate(&self) -> Result<()> {
        let sizes = [
            ("vocab", self.vocab),
            ("dim", self.dim),
            ("layers", self.layers),
            ("heads", self.heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
            ("ffn", self.ffn),
            ("max_seq", self.max_seq),
        ];
        for (key, v) in sizes {
            if v == 0 {
                return Err(config_err(format!("{key}: must be positive, got 0")));
            }
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return Err(config_err(format!(
                "kv_heads: {} query heads cannot be grouped over {} kv heads (heads must be a \
                 multiple of kv_heads)",
                self.heads, self.kv_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(config_err(format!(
                "head_dim: rotary embedding rotates halves, so head_dim must be even, got {}",
                self.head_dim
            )));
        }
        if self.head_dim > ATTENTION_MAX_HEAD_DIM {
            return Err(config_err(format!(
                "head_dim: {} is above the attention kernels' limit of {ATTENTION_MAX_HEAD_DIM}",
                self.head_dim
            )));
        }
        if self.vocab > MAX_VOCAB {
            return Err(config_err(format!(
                "vocab: {} ids do not travel exactly as f32 (at most {MAX_VOCAB})",
                self.vocab
            )));
        }
        if self.max_seq > MAX_SEQ {
            return Err(config_err(format!(
                "max_seq: {} is absurd (at most {MAX_SEQ})",
                self.max_seq
            )));
        }
        crate::params::checked_param_count(self)?;
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(config_err(format!(
                "rope_theta: must be finite and > 1, got {}",
                self.rope_theta
            )));
        }
        if let Some(s) = &self.rope_scaling {
            let fin = |key: &str, v: f64| {
                if v.is_finite() && v > 0.0 {
                    Ok(())
                } else {
                    Err(config_err(format!(
                        "rope_scaling.{key}: must be finite and positive, got {v}"
                    )))
                }
            };
            fin("factor", s.factor)?;
            fin("low_freq_factor", s.low_freq_factor)?;
            fin("high_freq_factor", s.high_freq_factor)?;
            if s.factor < 1.0 {
                return Err(config_err(format!(
                    "rope_scaling.factor: must be at least 1 (it divides frequencies), got {}",
                    s.factor
                )));
            }
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(config_err(format!(
                    "rope_scaling.high_freq_factor: must exceed low_freq_factor ({} <= {}): the \
                     smooth interpolation divides by their difference",
                    s.high_freq_factor, s.low_freq_factor
                )));
            }
            if s.original_max_position == 0 {
                return Err(config_err(
                    "rope_scaling.original_max_position: must be positive, got 0".into(),
                ));
            }
        }
        if !(self.rms_eps.is_finite() && self.rms_eps > 0.0) {
            return Err(config_err(format!(
                "rms_eps: must be finite and positive, got {}",
                self.rms_eps
            )));
        }
        if !(self.init_std.is_finite() && self.init_std > 0.0) {
            return Err(config_err(format!(
                "init_std: must be finite and positive, got {}",
                self.init_std
            )));
        }
        Ok(())
    }

    /// A config file's text (see the module docs); `file` names it in errors.
    pub fn from_toml_str(text: &str, file: &str) -> Result<LlamaConfig> {
        let raw: RawConfig = toml::from_str(text).map_err(|e| toml_error(file, &e, Some(text)))?;
        raw.resolve(file)
    }

    /// A config table (the `[model]` table of a larger file, say); `file` names its source in
    /// errors.
    pub fn from_toml_table(table: &toml::Table, file: &str) -> Result<LlamaConfig> {
        let raw: RawConfig = table.clone().try_into().map_err(|e| {
            // A table has no spans: find the key by trying each entry alone.
            let key = table.iter().find(|(k, v)| {
                let mut one = toml::Table::new();
                one.insert(k.to_string(), (*v).clone());
                one.try_into::<RawConfig>().is_err()
            });
            match key {
                Some((k, _)) => config_err(format!("{file}: key `{k}`: {}", e.message())),
                None => toml_error(file, &e, None),
            }
        })?;
        raw.resolve(file)
    }
}

/// A parse or type error of a config file, with the line of the offending key when the parser
/// knows where it is.
fn toml_error(file: &str, e: &toml::de::Error, text: Option<&str>) -> LlamaError {
    let msg = e.message().trim_end();
    match (text, e.span()) {
        (Some(text), Some(span)) => {
            let at = span.start.min(text.len());
            let line = text[..at].matches('\n').count() + 1;
            let snippet = text.lines().nth(line - 1).unwrap_or_default().trim();
            config_err(format!("{file}: {msg} (line {line}: `{snippet}`)"))
        }
        _ => config_err(format!("{file}: {msg}")),
    }
}

/// A config file as written: every key optional.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    preset: Option<String>,
    vocab: Option<usize>,
    dim: Option<usize>,
    layers: Option<usize>,
    heads: Option<usize>,
    kv_heads: Option<usize>,
    head_dim: Option<usize>,
    ffn: Option<usize>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawScaling>,
    rms_eps: Option<f64>,
    tied: Option<bool>,
    max_seq: Option<usize>,
    init_std: Option<f64>,
}

/// `rope_scaling = "none"` or a table.
#[derive(Deserialize)]
#[serde(
    untagged,
    expecting = "the string \"none\" or a table of factor, low_freq_factor, high_freq_factor, \
                 original_max_position"
)]
enum RawScaling {
    Off(String),
    On(RawScalingTable),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawScalingTable {
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position: Option<usize>,
}

impl RawConfig {
    fn resolve(self, file: &str) -> Result<LlamaConfig> {
        let in_file = |e: LlamaError| match e {
            LlamaError::Config(m) => config_err(format!("{file}: {m}")),
            other => other,
        };
        let base = self.preset.as_deref().unwrap_or("llama-tiny");
        let mut c = LlamaConfig::preset(base).map_err(in_file)?;
        let set = |dst: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *dst = v;
            }
        };
        set(&mut c.vocab, self.vocab);
        set(&mut c.dim, self.dim);
        set(&mut c.layers, self.layers);
        set(&mut c.heads, self.heads);
        set(&mut c.kv_heads, self.kv_heads);
        set(&mut c.ffn, self.ffn);
        set(&mut c.max_seq, self.max_seq);
        match self.head_dim {
            Some(h) => c.head_dim = h,
            None if self.dim.is_some() || self.heads.is_some() => {
                if c.heads == 0 || !c.dim.is_multiple_of(c.heads) {
                    return Err(in_file(config_err(format!(
                        "head_dim: not given, and dim {} is not a multiple of heads {} (set \
                         head_dim explicitly)",
                        c.dim, c.heads
                    ))));
                }
                c.head_dim = c.dim / c.heads;
            }
            None => {}
        }
        if let Some(t) = self.rope_theta {
            c.rope_theta = t;
        }
        if let Some(eps) = self.rms_eps {
            c.rms_eps = eps as f32;
        }
        if let Some(s) = self.init_std {
            c.init_std = s as f32;
        }
        if let Some(t) = self.tied {
            c.tied = t;
        }
        match self.rope_scaling {
            None => {}
            Some(RawScaling::Off(s)) if s == "none" => c.rope_scaling = None,
            Some(RawScaling::Off(s)) => {
                return Err(in_file(config_err(format!(
                    "rope_scaling: {s:?} is neither \"none\" nor a table"
                ))));
            }
            Some(RawScaling::On(t)) => {
                let b = c.rope_scaling;
                let pick = |key: &str, v: Option<f64>, from: Option<f64>| {
                    v.or(from).ok_or_else(|| {
                        in_file(config_err(format!(
                            "rope_scaling.{key}: missing (the base preset {base} has no scaling \
                             to take it from)"
                        )))
                    })
                };
                c.rope_scaling = Some(Llama3RopeScaling {
                    factor: pick("factor", t.factor, b.map(|b| b.factor))?,
                    low_freq_factor: pick(
                        "low_freq_factor",
                        t.low_freq_factor,
                        b.map(|b| b.low_freq_factor),
                    )?,
                    high_freq_factor: pick(
                        "high_freq_factor",
                        t.high_freq_factor,
                        b.map(|b| b.high_freq_factor),
                    )?,
                    original_max_position: pick(
                        "original_max_position",
                        t.original_max_position.map(|v| v as f64),
                        b.map(|b| b.original_max_position as f64),
                    )? as usize,
                });
            }
        }
        c.validate().map_err(in_file)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<LlamaConfig>) -> String {
        match r {
            Err(LlamaError::Config(m)) => m,
            other => panic!("expected a config error, got {other:?}"),
        }
    }

    #[test]
    fn presets_are_valid() {
        for name in presets::NAMES {
            LlamaConfig::preset(name).unwrap().validate().unwrap();
        }
        assert!(err(LlamaConfig::preset("llama-7b")).contains("known: llama-tiny"));
        let one_b = presets::llama_1b();
        assert_eq!(one_b.qkv_widths(), (2048, 512));
        assert_eq!(presets::llama_8b_layers(3).layers, 3);
    }

    #[test]
    fn vocab_padding() {
        let c = presets::llama_125m();
        assert_eq!(c.clone().with_vocab(50257, true).vocab, 50304);
        assert_eq!(c.clone().with_vocab(50257, false).vocab, 50257);
        assert_eq!(c.with_vocab(257, true).vocab, 320);
    }

    #[test]
    fn validate_names_the_key() {
        let base = presets::llama_tiny();
        let cases: Vec<(LlamaConfig, &str)> = vec![
            (
                LlamaConfig {
                    kv_heads: 3,
                    ..base.clone()
                },
                "kv_heads:",
            ),
            (
                LlamaConfig {
                    head_dim: 15,
                    ..base.clone()
                },
                "head_dim:",
            ),
            (
                LlamaConfig {
                    head_dim: 512,
                    ..base.clone()
                },
                "head_dim: 512 is above",
            ),
            (
                LlamaConfig {
                    ffn: 0,
                    ..base.clone()
                },
                "ffn:",
            ),
            (
                LlamaConfig {
                    vocab: MAX_VOCAB + 1,
                    ..base.clone()
                },
                "vocab:",
            ),
            (
                LlamaConfig {
                    dim: usize::MAX / 2,
                    ..base.clone()
                },
                "dim",
            ),
            (
                LlamaConfig {
                    layers: usize::MAX,
                    ..base.clone()
                },
                "layers",
            ),
            (
                LlamaConfig {
                    rope_theta: f64::NAN,
                    ..base.clone()
                },
                "rope_theta:",
            ),
            (
                LlamaConfig {
                    rope_scaling: Some(Llama3RopeScaling {
                        high_freq_factor: 1.0,
                        ..llama3_scaling(8.0)
                    }),
                    ..base.clone()
                },
                "rope_scaling.high_freq_factor:",
            ),
            (
                LlamaConfig {
                    rms_eps: 0.0,
                    ..base.clone()
                },
                "rms_eps:",
            ),
            (
                LlamaConfig {
                    init_std: -1.0,
                    ..base.clone()
                },
                "init_std:",
            ),
        ];
        for (c, key) in cases {
            let m = err(c.validate().map(|_| c.clone()));
            assert!(m.contains(key), "{m:?} should name {key}");
        }
    }

    #[test]
    fn toml_overrides_a_preset() {
        let text = r#"
            preset = "llama-8b-layers"
            layers = 2
            vocab = 50304
            rope_scaling = { factor = 16.0 }
            rms_eps = 1e-6
        "#;
        let c = LlamaConfig::from_toml_str(text, "m.toml").unwrap();
        let want = LlamaConfig {
            layers: 2,
            vocab: 50304,
            rope_scaling: Some(llama3_scaling(16.0)),
            rms_eps: 1e-6,
            ..presets::llama_8b_layers(2)
        };
        assert_eq!(c, want);
        let c = LlamaConfig::from_toml_str("rope_scaling = \"none\"\npreset = \"llama-1b\"", "f")
            .unwrap();
        assert_eq!(c.rope_scaling, None);
        // dim and heads without head_dim: head_dim follows.
        let c = LlamaConfig::from_toml_str("dim = 96\nheads = 6\nkv_heads = 3", "f").unwrap();
        assert_eq!((c.dim, c.heads, c.head_dim), (96, 6, 16));
        // The empty file is llama-tiny.
        assert_eq!(
            LlamaConfig::from_toml_str("", "f").unwrap(),
            presets::llama_tiny()
        );
    }

    #[test]
    fn toml_refuses_unknown_keys_and_wrong_types() {
        let m = err(LlamaConfig::from_toml_str(
            "dim = 64\nlayer = 3\n",
            "m.toml",
        ));
        assert!(m.starts_with("m.toml:") && m.contains("layer"), "{m}");
        assert!(m.contains("line 2"), "{m}");
        let m = err(LlamaConfig::from_toml_str("heads = \"four\"", "m.toml"));
        assert!(m.starts_with("m.toml:") && m.contains("heads"), "{m}");
        let m = err(LlamaConfig::from_toml_str("tied = 1", "m.toml"));
        assert!(m.contains("tied"), "{m}");
        let m = err(LlamaConfig::from_toml_str("preset = \"gpt\"", "m.toml"));
        assert!(m.contains("preset"), "{m}");
        let m = err(LlamaConfig::from_toml_str("dim = 100\nheads = 3", "m.toml"));
        assert!(m.contains("head_dim"), "{m}");
        let m = err(LlamaConfig::from_toml_str(
            "heads = 4\nkv_heads = 3",
            "m.toml",
        ));
        assert!(m.starts_with("m.toml: kv_heads"), "{m}");
        let m = err(LlamaConfig::from_toml_str(
            "rope_scaling = { factor = 2.0 }",
            "m.toml",
        ));
        assert!(m.contains("rope_scaling.low_freq_factor"), "{m}");
        let m = err(LlamaConfig::from_toml_str(
            "rope_scaling = { factr = 2.0 }",
            "m.toml",
        ));
        assert!(m.contains("rope_scaling"), "{m}");
        let m = err(LlamaConfig::from_toml_str("vocab = -3", "m.toml"));
        assert!(m.contains("vocab"), "{m}");
    }

    #[test]
    fn a_model_table_of_a_larger_file() {
        let file: toml::Table =
            toml::from_str("[model]\npreset = \"llama-125m\"\nlayers = 6\n[train]\nsteps = 3\n")
                .unwrap();
        let model = file["model"].as_table().unwrap();
        let c = LlamaConfig::from_toml_table(model, "run.toml").unwrap();
        assert_eq!(c.layers, 6);
        let bad: toml::Table = toml::from_str("dims = 3").unwrap();
        let m = err(LlamaConfig::from_toml_table(&bad, "run.toml [model]"));
        assert!(
            m.contains("dims") && m.starts_with("run.toml [model]"),
            "{m}"
        );
        let bad: toml::Table = toml::from_str("layers = 2\nheads = \"x\"").unwrap();
        let m = err(LlamaConfig::from_toml_table(&bad, "run.toml [model]"));
        assert!(m.starts_with("run.toml [model]: key `heads`"), "{m}");
    }
}
