//! Every parameter of the decoder with its Hugging Face Llama name and shape, in forward order,
//! their ids, and the deterministic initialization.
//!
//! Ids are positions in [`params`]: the embedding is 0, layer `l`'s nine parameters are
//! `1 + 9·l ..= 9 + 9·l` ([`LayerIds`]), then the final norm, then `lm_head.weight` when the head
//! is not tied. The backward reports them in exactly the reverse order.
//!
//! The q and k projections are in HF's rotate-half layout (the model applies RoPE with the
//! rotate-half convention), so a checkpoint exports to `transformers` without a permutation.

use lowbit_io::rng::{SplitMix64, splitmix64};

use crate::config::{LlamaConfig, MAX_TENSOR};
use crate::{LlamaError, Result};

/// What a parameter is in the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// `model.embed_tokens.weight [vocab, dim]` (also the head when tied).
    Embedding,
    /// `model.layers.{l}.input_layernorm.weight [dim]`.
    InputNorm(usize),
    /// `model.layers.{l}.self_attn.q_proj.weight [heads·head_dim, dim]`.
    Q(usize),
    /// `model.layers.{l}.self_attn.k_proj.weight [kv_heads·head_dim, dim]`.
    K(usize),
    /// `model.layers.{l}.self_attn.v_proj.weight [kv_heads·head_dim, dim]`.
    V(usize),
    /// `model.layers.{l}.self_attn.o_proj.weight [dim, heads·head_dim]`.
    O(usize),
    /// `model.layers.{l}.post_attention_layernorm.weight [dim]`.
    PostNorm(usize),
    /// `model.layers.{l}.mlp.gate_proj.weight [ffn, dim]`.
    Gate(usize),
    /// `model.layers.{l}.mlp.up_proj.weight [ffn, dim]`.
    Up(usize),
    /// `model.layers.{l}.mlp.down_proj.weight [dim, ffn]`.
    Down(usize),
    /// `model.norm.weight [dim]`.
    FinalNorm,
    /// `lm_head.weight [vocab, dim]` (untied heads only).
    Head,
}

/// One parameter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamInfo {
    /// Its Hugging Face Llama name.
    pub name: String,
    /// Its shape (row-major; matrices are `[out, in]`, PyTorch's `nn.Linear` layout).
    pub shape: Vec<usize>,
    /// A GEMM weight (q/k/v/o/gate/up/down): what a precision policy may store in low precision.
    pub matrix: bool,
    /// Takes weight decay: the matrices, the embedding and an untied head (not the norms).
    pub decay: bool,
    /// What it is.
    pub role: Role,
}

impl ParamInfo {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Parameters per decoder layer.
pub const PER_LAYER: usize = 9;

/// The ids of one layer's parameters, in forward order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerIds {
    /// `input_layernorm.weight`.
    pub input_norm: usize,
    /// `self_attn.q_proj.weight`.
    pub q: usize,
    /// `self_attn.k_proj.weight`.
    pub k: usize,
    /// `self_attn.v_proj.weight`.
    pub v: usize,
    /// `self_attn.o_proj.weight`.
    pub o: usize,
    /// `post_attention_layernorm.weight`.
    pub post_norm: usize,
    /// `mlp.gate_proj.weight`.
    pub gate: usize,
    /// `mlp.up_proj.weight`.
    pub up: usize,
    /// `mlp.down_proj.weight`.
    pub down: usize,
}

/// The id of the embedding.
pub const EMBEDDING: usize = 0;

/// The ids of layer `l`'s parameters.
pub fn layer_ids(l: usize) -> LayerIds {
    let b = 1 + PER_LAYER * l;
    LayerIds {
        input_norm: b,
        q: b + 1,
        k: b + 2,
        v: b + 3,
        o: b + 4,
        post_norm: b + 5,
        gate: b + 6,
        up: b + 7,
        down: b + 8,
    }
}

/// The id of `model.norm.weight`.
pub fn final_norm_id(cfg: &LlamaConfig) -> usize {
    1 + PER_LAYER * cfg.layers
}

/// The id of the head's weight: the embedding's when tied, else `lm_head.weight`'s (the last).
pub fn head_id(cfg: &LlamaConfig) -> usize {
    if cfg.tied {
        EMBEDDING
    } else {
        2 + PER_LAYER * cfg.layers
    }
}

/// Every parameter, in forward order (its position is its id).
pub fn params(cfg: &LlamaConfig) -> Vec<ParamInfo> {
    let (d, f, v) = (cfg.dim, cfg.ffn, cfg.vocab);
    let (qw, kw) = cfg.qkv_widths();
    let p = |name: String, shape: Vec<usize>, matrix: bool, role: Role| ParamInfo {
        decay: shape.len() == 2,
        name,
        shape,
        matrix,
        role,
    };
    let mut out = Vec::with_capacity(3 + PER_LAYER * cfg.layers);
    out.push(p(
        "model.embed_tokens.weight".into(),
        vec![v, d],
        false,
        Role::Embedding,
    ));
    for l in 0..cfg.layers {
        let n = |s: &str| format!("model.layers.{l}.{s}.weight");
        out.push(p(n("input_layernorm"), vec![d], false, Role::InputNorm(l)));
        out.push(p(n("self_attn.q_proj"), vec![qw, d], true, Role::Q(l)));
        out.push(p(n("self_attn.k_proj"), vec![kw, d], true, Role::K(l)));
        out.push(p(n("self_attn.v_proj"), vec![kw, d], true, Role::V(l)));
        out.push(p(n("self_attn.o_proj"), vec![d, qw], true, Role::O(l)));
        out.push(p(
            n("post_attention_layernorm"),
            vec![d],
            false,
            Role::PostNorm(l),
        ));
        out.push(p(n("mlp.gate_proj"), vec![f, d], true, Role::Gate(l)));
        out.push(p(n("mlp.up_proj"), vec![f, d], true, Role::Up(l)));
        out.push(p(n("mlp.down_proj"), vec![d, f], true, Role::Down(l)));
    }
    out.push(p(
        "model.norm.weight".into(),
        vec![d],
        false,
        Role::FinalNorm,
    ));
    if !cfg.tied {
        out.push(p("lm_head.weight".into(), vec![v, d], false, Role::Head));
    }
    out
}

/// Total parameter count (the tied head counted once). The config must be valid
/// ([`LlamaConfig::validate`] checks that this does not overflow).
pub fn param_count(cfg: &LlamaConfig) -> usize {
    checked_param_count(cfg).expect("a validated config's parameter count fits")
}

/// [`param_count`], or [`LlamaError::Config`] naming the keys of a tensor over
/// [`MAX_TENSOR`] elements or of a total that overflows.
pub(crate) fn checked_param_count(cfg: &LlamaConfig) -> Result<usize> {
    let too_big = |keys: &str, name: &str| {
        LlamaError::Config(format!(
            "{keys}: {name} would have more than 2^40 elements (an absurd size)"
        ))
    };
    let numel = |a: usize, b: usize, keys: &str, name: &str| {
        a.checked_mul(b)
            .filter(|&n| n <= MAX_TENSOR)
            .ok_or_else(|| too_big(keys, name))
    };
    let (d, f, v) = (cfg.dim, cfg.ffn, cfg.vocab);
    let qw = numel(cfg.heads, cfg.head_dim, "heads/head_dim", "q_proj's rows")?;
    let kw = numel(
        cfg.kv_heads,
        cfg.head_dim,
        "kv_heads/head_dim",
        "k_proj's rows",
    )?;
    let embed = numel(v, d, "vocab/dim", "model.embed_tokens.weight")?;
    let q = numel(qw, d, "heads/head_dim/dim", "q_proj.weight")?;
    let k = numel(kw, d, "kv_heads/head_dim/dim", "k_proj.weight")?;
    let mlp = numel(f, d, "ffn/dim", "gate_proj.weight")?;
    let per_layer = [q, k, k, q, mlp, mlp, mlp, d, d]
        .iter()
        .try_fold(0usize, |s, &n| s.checked_add(n))
        .ok_or_else(|| too_big("dim", "one layer"))?;
    let heads = if cfg.tied { 1 } else { 2 };
    per_layer
        .checked_mul(cfg.layers)
        .and_then(|n| n.checked_add(embed.checked_mul(heads)?))
        .and_then(|n| n.checked_add(d))
        .ok_or_else(|| {
            LlamaError::Config(format!(
                "layers: {} layers of {per_layer} parameters overflow the parameter count",
                cfg.layers
            ))
        })
}

/// The largest parameter's element count (the embedding's or the head's for any real vocabulary):
/// the size of the layers' f32 scratch.
pub fn params_max_numel(cfg: &LlamaConfig) -> usize {
    let (qw, kw) = cfg.qkv_widths();
    [cfg.vocab, qw, kw, cfg.ffn]
        .iter()
        .map(|&rows| rows * cfg.dim)
        .max()
        .unwrap_or(0)
}

/// The generator of parameter `p`'s initial values: SplitMix64 seeded with
/// `splitmix64(seed ^ splitmix64(p))`, so each parameter's stream is independent of the others
/// (a rank can initialize the parameters it owns alone).
fn param_rng(seed: u64, p: usize) -> SplitMix64 {
    SplitMix64(splitmix64(seed ^ splitmix64(p as u64)))
}

/// Parameter `p`'s initial values (HF `LlamaPreTrainedModel._init_weights`): the norms' gains
/// are ones; every other element is `fl32(init_std · z)` with `z` a standard normal by
/// Box–Muller from two uniforms of the parameter's generator, `u₁, u₂ ∈ (0, 1]`
/// ([`SplitMix64::unit_open_f64`]): `z = √(−2 ln u₁) · cos(2π u₂)`, in f64, one normal per pair.
/// # Panics
/// When `p` is not a parameter id of `cfg`.
pub fn init_param(cfg: &LlamaConfig, seed: u64, p: usize) -> Vec<f32> {
    let info = &params(cfg)[p];
    let n = info.numel();
    match info.role {
        Role::InputNorm(_) | Role::PostNorm(_) | Role::FinalNorm => vec![1.0; n],
        _ => {
            let mut out = vec![0f32; n];
            let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
            fill_normal(
                &mut out,
                param_rng(seed, p),
                f64::from(cfg.init_std),
                threads,
            );
            out
        }
    }
}

/// Elements per thread below which [`fill_normal`] stays on the calling thread.
const NORMAL_CHUNK: usize = 1 << 20;

/// `out[i] = fl32(std · z_i)` with `z_i` the Box–Muller normal of draws `2i` and `2i + 1` of
/// `rng`, on up to `threads` threads: each piece starts its generator where the stream would be
/// ([`SplitMix64::advanced`]), so the values are the sequential ones at any thread count (a
/// 1.24B-parameter model takes ~35 ns an element, 43 s, on one core).
fn fill_normal(out: &mut [f32], rng: SplitMix64, std: f64, threads: usize) {
    let run = |out: &mut [f32], mut rng: SplitMix64| {
        for v in out {
            let (u1, u2) = (rng.unit_open_f64(), rng.unit_open_f64());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            *v = (std * z) as f32;
        }
    };
    let per = out.len().div_ceil(threads.max(1)).max(NORMAL_CHUNK);
    if per >= out.len() {
        return run(out, rng);
    }
    std::thread::scope(|s| {
        for (i, piece) in out.chunks_mut(per).enumerate() {
            let at = rng.advanced(2 * (i * per) as u64);
            s.spawn(move || run(piece, at));
        }
    });
}

/// Every parameter's initial values ([`init_param`]), in id order.
pub fn init(cfg: &LlamaConfig, seed: u64) -> Vec<Vec<f32>> {
    (0..params(cfg).len())
        .map(|p| init_param(cfg, seed, p))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::presets;

    #[test]
    fn normals_are_the_sequential_stream_at_any_thread_count() {
        let n = 2 * NORMAL_CHUNK + 12_345;
        let rng = param_rng(7, 3);
        let mut one = vec![0f32; n];
        fill_normal(&mut one, rng, 0.02, 1);
        // The sequential definition, written out.
        let mut g = rng;
        for (i, &v) in one.iter().enumerate() {
            let (u1, u2) = (g.unit_open_f64(), g.unit_open_f64());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            assert_eq!(v.to_bits(), ((0.02 * z) as f32).to_bits(), "element {i}");
        }
        for threads in [2, 3, 7] {
            let mut many = vec![0f32; n];
            fill_normal(&mut many, rng, 0.02, threads);
            assert!(
                one.iter()
                    .zip(&many)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{threads} threads"
            );
        }
    }

    #[test]
    fn llama_1b_has_the_real_count() {
        // Llama-3.2-1B: 1,235,814,400 parameters (the tied head counted once).
        let c = presets::llama_1b();
        assert_eq!(param_count(&c), 1_235_814_400);
        let listed: usize = params(&c).iter().map(ParamInfo::numel).sum();
        assert_eq!(listed, 1_235_814_400);
        assert_eq!(params(&c).len(), 2 + 16 * PER_LAYER);
    }

    #[test]
    fn llama_8b_layers_per_layer_counts() {
        let c = presets::llama_8b_layers(4);
        let ps = params(&c);
        let layer: usize = ps
            .iter()
            .filter(|p| p.name.starts_with("model.layers.1."))
            .map(ParamInfo::numel)
            .sum();
        // Llama-3-8B: q 4096², k, v 1024·4096, o 4096², three MLP matrices 14336·4096, two norms.
        assert_eq!(layer, 218_112_000);
        let by = |n: &str| ps.iter().find(|p| p.name == n).unwrap().numel();
        assert_eq!(by("model.layers.0.self_attn.q_proj.weight"), 16_777_216);
        assert_eq!(by("model.layers.0.self_attn.k_proj.weight"), 4_194_304);
        assert_eq!(by("model.layers.0.mlp.down_proj.weight"), 58_720_256);
        assert_eq!(by("lm_head.weight"), 525_336_576);
        assert_eq!(param_count(&c), 4 * 218_112_000 + 2 * 525_336_576 + 4096);
    }

    #[test]
    fn ids_names_and_flags() {
        let c = presets::llama_tiny();
        let ps = params(&c);
        assert_eq!(ps[EMBEDDING].name, "model.embed_tokens.weight");
        let l1 = layer_ids(1);
        assert_eq!(ps[l1.input_norm].role, Role::InputNorm(1));
        assert_eq!(ps[l1.q].name, "model.layers.1.self_attn.q_proj.weight");
        assert_eq!(ps[l1.v].shape, vec![32, 64]);
        assert_eq!(ps[l1.down].name, "model.layers.1.mlp.down_proj.weight");
        assert_eq!(ps[final_norm_id(&c)].name, "model.norm.weight");
        assert_eq!(head_id(&c), EMBEDDING);
        assert_eq!(ps.len(), 2 + 2 * PER_LAYER);
        for p in &ps {
            let is_matrix = matches!(
                p.role,
                Role::Q(_)
                    | Role::K(_)
                    | Role::V(_)
                    | Role::O(_)
                    | Role::Gate(_)
                    | Role::Up(_)
                    | Role::Down(_)
            );
            assert_eq!(p.matrix, is_matrix, "{}", p.name);
            assert_eq!(p.decay, p.shape.len() == 2, "{}", p.name);
        }
        let untied = LlamaConfig {
            tied: false,
            ..c.clone()
        };
        let pu = params(&untied);
        assert_eq!(pu[head_id(&untied)].name, "lm_head.weight");
        assert!(pu[head_id(&untied)].decay && !pu[head_id(&untied)].matrix);
        assert_eq!(param_count(&untied), param_count(&c) + 288 * 64);
    }

    #[test]
    fn init_is_deterministic_and_normal() {
        let c = presets::llama_tiny();
        let a = init(&c, 7);
        assert_eq!(a, init(&c, 7));
        assert_ne!(a[1 + 1], init(&c, 8)[1 + 1]);
        assert!(a[layer_ids(0).input_norm].iter().all(|&g| g == 1.0));
        // Independent streams per parameter: p's values do not depend on other parameters.
        assert_eq!(init_param(&c, 7, layer_ids(1).up), a[layer_ids(1).up]);
        let e = &a[EMBEDDING];
        let n = e.len() as f64;
        let mean = e.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
        let var = e
            .iter()
            .map(|&v| (f64::from(v) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(mean.abs() < 0.002, "mean {mean}");
        assert!((var.sqrt() - 0.02).abs() < 0.001, "std {}", var.sqrt());
        // Pinned: the first value of the embedding (the formula in init_param).
        let mut rng = param_rng(7, 0);
        let (u1, u2) = (rng.unit_open_f64(), rng.unit_open_f64());
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        assert_eq!(e[0], (f64::from(c.init_std) * z) as f32);
    }
}
