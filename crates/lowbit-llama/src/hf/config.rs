//! `config.json` and `generation_config.json`.
//!
//! The fields are those of `transformers`' `LlamaConfig` (`configuration_llama.py`), keys in
//! sorted order as `PretrainedConfig.to_json_string` writes them. lowbit's names map as
//! `vocab` → `vocab_size`, `dim` → `hidden_size`, `layers` → `num_hidden_layers`, `heads` →
//! `num_attention_heads`, `kv_heads` → `num_key_value_heads`, `ffn` → `intermediate_size`,
//! `max_seq` → `max_position_embeddings`, `rms_eps` → `rms_norm_eps`, `tied` →
//! `tie_word_embeddings`, `init_std` → `initializer_range`; llama3 RoPE scaling is
//! `{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
//! "original_max_position_embeddings"}` (Llama 3.1's `config.json`), none is `null`.

use std::path::Path;

use lowbit_io::Json;

use super::{CONFIG_FILE, GENERATION_CONFIG_FILE, HfError, Result, WeightDtype, read_json};
use crate::LlamaConfig;
use crate::config::Llama3RopeScaling;
use crate::data::Tokenizer;

/// The architecture written and the only one read.
pub const ARCHITECTURE: &str = "LlamaForCausalLM";

/// A `config.json` read back: the model's shape and the token ids it names.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// The shape (`initializer_range` as `init_std`, 0.02 when absent).
    pub model: LlamaConfig,
    /// `bos_token_id`, if given as one id.
    pub bos_token_id: Option<u64>,
    /// `eos_token_id`: one id, or several (Llama 3.1 Instruct lists three); empty if absent.
    pub eos_token_ids: Vec<u64>,
    /// `torch_dtype`, if given.
    pub torch_dtype: Option<String>,
}

/// The `torch_dtype` name of a weight dtype.
pub fn torch_dtype(dtype: WeightDtype) -> &'static str {
    match dtype {
        WeightDtype::F32 => "float32",
        WeightDtype::Bf16 => "bfloat16",
    }
}

/// `config.json` of `cfg` with `tok`'s end-of-text as BOS and EOS, the weights in `dtype`.
pub fn config_json(cfg: &LlamaConfig, tok: Tokenizer, dtype: WeightDtype) -> Json {
    let rope_scaling = match &cfg.rope_scaling {
        None => Json::Null,
        Some(s) => Json::obj([
            ("factor", Json::Num(s.factor)),
            ("high_freq_factor", Json::Num(s.high_freq_factor)),
            ("low_freq_factor", Json::Num(s.low_freq_factor)),
            (
                "original_max_position_embeddings",
                Json::uint(s.original_max_position),
            ),
            ("rope_type", Json::str("llama3")),
        ]),
    };
    Json::obj([
        ("architectures", Json::Arr(vec![Json::str(ARCHITECTURE)])),
        ("attention_bias", Json::Bool(false)),
        ("attention_dropout", Json::Num(0.0)),
        ("bos_token_id", Json::uint(tok.eot())),
        ("eos_token_id", Json::uint(tok.eot())),
        ("head_dim", Json::uint(cfg.head_dim)),
        ("hidden_act", Json::str("silu")),
        ("hidden_size", Json::uint(cfg.dim)),
        ("initializer_range", Json::F32(cfg.init_std)),
        ("intermediate_size", Json::uint(cfg.ffn)),
        ("max_position_embeddings", Json::uint(cfg.max_seq)),
        ("mlp_bias", Json::Bool(false)),
        ("model_type", Json::str("llama")),
        ("num_attention_heads", Json::uint(cfg.heads)),
        ("num_hidden_layers", Json::uint(cfg.layers)),
        ("num_key_value_heads", Json::uint(cfg.kv_heads)),
        ("pretraining_tp", Json::uint(1u64)),
        ("rms_norm_eps", Json::F32(cfg.rms_eps)),
        ("rope_scaling", rope_scaling),
        ("rope_theta", Json::Num(cfg.rope_theta)),
        ("tie_word_embeddings", Json::Bool(cfg.tied)),
        ("torch_dtype", Json::str(torch_dtype(dtype))),
        ("use_cache", Json::Bool(true)),
        ("vocab_size", Json::uint(cfg.vocab)),
    ])
}

/// `generation_config.json`: BOS and EOS are `tok`'s end-of-text (what `generate` stops at).
pub fn generation_config_json(tok: Tokenizer) -> Json {
    Json::obj([
        ("_from_model_config", Json::Bool(true)),
        ("bos_token_id", Json::uint(tok.eot())),
        ("eos_token_id", Json::uint(tok.eot())),
    ])
}

/// Writes `config.json` and `generation_config.json` into `dir`; returns their names.
pub(super) fn write(
    dir: &Path,
    cfg: &LlamaConfig,
    tok: Tokenizer,
    dtype: WeightDtype,
) -> Result<Vec<String>> {
    Ok(vec![
        super::write_json(dir, CONFIG_FILE, &config_json(cfg, tok, dtype))?,
        super::write_json(dir, GENERATION_CONFIG_FILE, &generation_config_json(tok))?,
    ])
}

/// lowbit's key → HF's, for messages of [`LlamaConfig::validate`].
const KEYS: [(&str, &str); 13] = [
    ("vocab", "vocab_size"),
    ("dim", "hidden_size"),
    ("layers", "num_hidden_layers"),
    ("heads", "num_attention_heads"),
    ("kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("ffn", "intermediate_size"),
    ("max_seq", "max_position_embeddings"),
    ("rope_theta", "rope_theta"),
    ("rope_scaling", "rope_scaling"),
    ("rms_eps", "rms_norm_eps"),
    ("tied", "tie_word_embeddings"),
    ("init_std", "initializer_range"),
];

/// The HF key of lowbit's `key`.
pub fn hf_key(key: &str) -> &str {
    KEYS.iter()
        .find(|(k, _)| *k == key)
        .map_or(key, |(_, h)| *h)
}

/// The first field (by its HF key) in which `a` and `b` describe different models, with both
/// values; `init_std` is not compared (it only initializes).
pub fn first_difference(
    a: &LlamaConfig,
    b: &LlamaConfig,
) -> Option<(&'static str, String, String)> {
    let pairs: [(&str, String, String); 12] = [
        ("vocab_size", a.vocab.to_string(), b.vocab.to_string()),
        ("hidden_size", a.dim.to_string(), b.dim.to_string()),
        (
            "num_hidden_layers",
            a.layers.to_string(),
            b.layers.to_string(),
        ),
        (
            "num_attention_heads",
            a.heads.to_string(),
            b.heads.to_string(),
        ),
        (
            "num_key_value_heads",
            a.kv_heads.to_string(),
            b.kv_heads.to_string(),
        ),
        ("head_dim", a.head_dim.to_string(), b.head_dim.to_string()),
        ("intermediate_size", a.ffn.to_string(), b.ffn.to_string()),
        (
            "max_position_embeddings",
            a.max_seq.to_string(),
            b.max_seq.to_string(),
        ),
        (
            "rope_theta",
            a.rope_theta.to_string(),
            b.rope_theta.to_string(),
        ),
        (
            "rope_scaling",
            format!("{:?}", a.rope_scaling),
            format!("{:?}", b.rope_scaling),
        ),
        ("rms_norm_eps", a.rms_eps.to_string(), b.rms_eps.to_string()),
        (
            "tie_word_embeddings",
            a.tied.to_string(),
            b.tied.to_string(),
        ),
    ];
    pairs.into_iter().find(|(_, x, y)| x != y)
}

/// Reads `dir/config.json` into a [`HfConfig`].
///
/// Required: `model_type` `"llama"` (and `architectures`, when present, exactly
/// `["LlamaForCausalLM"]`), `hidden_size`, `intermediate_size`, `num_hidden_layers`,
/// `num_attention_heads`, `vocab_size`, `max_position_embeddings`, `rms_norm_eps`,
/// `rope_theta` (or transformers 5's `rope_parameters`, holding it and the scaling). Defaulted as `LlamaConfig` defaults them: `num_key_value_heads` (the query
/// heads), `head_dim` (`hidden_size / num_attention_heads`, which must divide),
/// `tie_word_embeddings` (false), `rope_scaling` (none), `initializer_range` (0.02). Refused:
/// `hidden_act` other than `silu`, `attention_bias` or `mlp_bias` true, a `rope_scaling` other
/// than llama3, and any shape [`LlamaConfig::validate`] refuses (absurd sizes), each naming the
/// file and the key.
///
/// # Errors
/// [`HfError`] naming `config.json` and the key.
pub fn read_config(dir: &Path) -> Result<HfConfig> {
    let path = dir.join(CONFIG_FILE);
    let json = read_json(&path)?;
    let bad = |what: String| HfError::invalid(&path, what);
    if !matches!(json, Json::Obj(_)) {
        return Err(bad("not a JSON object".into()));
    }
    match json.member("model_type").map(|m| m.as_str()) {
        Some(Some("llama")) => {}
        Some(Some(other)) => {
            return Err(bad(format!(
                "model_type: {:?} is not \"llama\" (only Llama decoders are read)",
                other
            )));
        }
        _ => return Err(bad("model_type: missing or not a string (\"llama\")".into())),
    }
    if let Some(a) = json.member("architectures") {
        let names: Vec<Option<&str>> = a.arr().iter().map(Json::as_str).collect();
        if !matches!(a, Json::Arr(_)) || names.len() != 1 || names[0] != Some(ARCHITECTURE) {
            return Err(bad(format!(
                "architectures: {a} is not [\"{ARCHITECTURE}\"] (the only architecture read)"
            )));
        }
    }
    let uint = |key: &str| -> Result<Option<usize>> {
        match json.member(key) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("{key}: {v} is not a non-negative integer"))),
        }
    };
    let need = |key: &str| -> Result<usize> {
        uint(key)?.ok_or_else(|| bad(format!("{key}: missing (a Llama config needs it)")))
    };
    let num = |key: &str| -> Result<f64> {
        match json.member(key) {
            None | Some(Json::Null) => {
                Err(bad(format!("{key}: missing (a Llama config needs it)")))
            }
            Some(v) => v
                .as_f64()
                .ok_or_else(|| bad(format!("{key}: {v} is not a number"))),
        }
    };
    let flag = |key: &str| -> Result<Option<bool>> {
        match json.member(key) {
            None | Some(Json::Null) => Ok(None),
            Some(Json::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(bad(format!("{key}: {v} is not true or false"))),
        }
    };
    if let Some(act) = json.member("hidden_act")
        && act.as_str() != Some("silu")
    {
        return Err(bad(format!(
            "hidden_act: {act} is not \"silu\" (the SwiGLU MLP computes silu)"
        )));
    }
    for key in ["attention_bias", "mlp_bias"] {
        if flag(key)? == Some(true) {
            return Err(bad(format!("{key}: true, but this decoder has no biases")));
        }
    }
    let dim = need("hidden_size")?;
    let heads = need("num_attention_heads")?;
    let head_dim = match uint("head_dim")? {
        Some(h) => h,
        None if heads > 0 && dim.is_multiple_of(heads) => dim / heads,
        None => {
            return Err(bad(format!(
                "head_dim: missing, and hidden_size {dim} is not a multiple of \
                 num_attention_heads {heads}"
            )));
        }
    };
    // transformers 5 writes `rope_parameters` (`rope_type`, `rope_theta` and the scaling's
    // keys) instead of `rope_theta` + `rope_scaling`; either form is read.
    let params = json
        .member("rope_parameters")
        .filter(|p| matches!(p, Json::Obj(_)));
    let rope_theta = match json.member("rope_theta") {
        None | Some(Json::Null) => params
            .and_then(|p| p.member("rope_theta"))
            .and_then(Json::as_f64)
            .ok_or_else(|| bad("rope_theta: missing (a Llama config needs it)".into()))?,
        Some(_) => num("rope_theta")?,
    };
    let scaling = match json.member("rope_scaling") {
        None | Some(Json::Null) => params.map(|p| ("rope_parameters", p)),
        Some(s @ Json::Obj(_)) => Some(("rope_scaling", s)),
        Some(v) => {
            return Err(bad(format!(
                "rope_scaling: {v} is neither null nor an object"
            )));
        }
    };
    let rope_scaling = match scaling {
        None => None,
        Some((key, s)) => {
            let kind = s
                .member("rope_type")
                .or_else(|| s.member("type"))
                .and_then(Json::as_str);
            match kind {
                Some("default") if key == "rope_parameters" => None,
                Some("llama3") => {
                    let f = |k: &str| {
                        s.member(k)
                            .and_then(Json::as_f64)
                            .ok_or_else(|| bad(format!("{key}.{k}: missing or not a number")))
                    };
                    let orig = s
                        .member("original_max_position_embeddings")
                        .and_then(Json::as_u64)
                        .and_then(|n| usize::try_from(n).ok())
                        .ok_or_else(|| {
                            bad(format!(
                                "{key}.original_max_position_embeddings: missing or not a \
                                 non-negative integer"
                            ))
                        })?;
                    Some(Llama3RopeScaling {
                        factor: f("factor")?,
                        low_freq_factor: f("low_freq_factor")?,
                        high_freq_factor: f("high_freq_factor")?,
                        original_max_position: orig,
                    })
                }
                _ => {
                    return Err(bad(format!(
                        "{key}: type {} is not \"llama3\" (the only scaling this decoder \
                         computes)",
                        s.member("rope_type")
                            .or_else(|| s.member("type"))
                            .unwrap_or(&Json::Null)
                    )));
                }
            }
        }
    };
    let init_std = match json.member("initializer_range") {
        None | Some(Json::Null) => 0.02,
        Some(v) => v
            .as_f64()
            .ok_or_else(|| bad(format!("initializer_range: {v} is not a number")))?
            as f32,
    };
    let model = LlamaConfig {
        vocab: need("vocab_size")?,
        dim,
        layers: need("num_hidden_layers")?,
        heads,
        kv_heads: uint("num_key_value_heads")?.unwrap_or(heads),
        head_dim,
        ffn: need("intermediate_size")?,
        rope_theta,
        rope_scaling,
        rms_eps: num("rms_norm_eps")? as f32,
        tied: flag("tie_word_embeddings")?.unwrap_or(false),
        max_seq: need("max_position_embeddings")?,
        init_std,
    };
    model.validate().map_err(|e| {
        let text = e.to_string();
        // The message starts with lowbit's key: name HF's.
        let (key, rest) = text.split_once(':').unwrap_or(("", &text));
        let base = key.split('.').next().unwrap_or(key);
        bad(format!("{}{}:{rest}", hf_key(base), &key[base.len()..]))
    })?;
    let eos_token_ids = match json.member("eos_token_id") {
        None | Some(Json::Null) => Vec::new(),
        Some(Json::Arr(ids)) => ids
            .iter()
            .map(|v| {
                v.as_u64()
                    .ok_or_else(|| bad(format!("eos_token_id: {v} is not a token id")))
            })
            .collect::<Result<_>>()?,
        Some(v) => vec![
            v.as_u64()
                .ok_or_else(|| bad(format!("eos_token_id: {v} is not a token id")))?,
        ],
    };
    Ok(HfConfig {
        model,
        bos_token_id: json.member("bos_token_id").and_then(Json::as_u64),
        eos_token_ids,
        torch_dtype: json
            .member("torch_dtype")
            .and_then(Json::as_str)
            .map(str::to_string),
    })
}
