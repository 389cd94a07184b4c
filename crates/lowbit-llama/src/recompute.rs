//! Activation recomputation: which of a layer's saved activations the backward recomputes from
//! the layer's input instead of keeping one copy per layer ([`Recompute`]), and the closed form of
//! the activation memory that follows ([`ActivationBytes`]).
//!
//! A recomputed activation lives in one slot all layers share; the backward reruns the forward's
//! own ops on the same weights (fetched again through the hooks) right before it needs them, so
//! every gradient is bit-identical to keeping them (Chen et al. 2016, "Training Deep Nets with
//! Sublinear Memory Cost"; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
//! Transformer Models", for the selective variant).

use std::fmt;

use lowbit_device::FLASH_HEAD_DIMS;

use crate::config::LlamaConfig;

/// What the backward recomputes. Each level recomputes what the one before it does, and more.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Every activation of a microbatch is kept.
    #[default]
    Off,
    /// The two RMSNorms' outputs and `silu(gate) · up`: elementwise ops only, no GEMM reruns.
    Selective,
    /// Also the MLP's gate and up projections: two of a layer's seven GEMMs rerun.
    Mlp,
    /// Everything but the layer's input (the residual stream): the layer's forward up to the
    /// MLP's down projection reruns, attention included.
    Full,
}

/// A layer's activations, in the order [`crate::Llama`] carves them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Act {
    N1,
    Rstd1,
    Q,
    K,
    V,
    Att,
    Lse,
    H,
    N2,
    Rstd2,
    Gate,
    Up,
    Product,
}

impl Act {
    pub(crate) const ALL: [Act; 13] = [
        Act::N1,
        Act::Rstd1,
        Act::Q,
        Act::K,
        Act::V,
        Act::Att,
        Act::Lse,
        Act::H,
        Act::N2,
        Act::Rstd2,
        Act::Gate,
        Act::Up,
        Act::Product,
    ];

    /// Values per token row.
    pub(crate) fn width(self, cfg: &LlamaConfig) -> usize {
        let (qw, kw) = cfg.qkv_widths();
        match self {
            Act::N1 | Act::H | Act::N2 => cfg.dim,
            Act::Rstd1 | Act::Rstd2 => 1,
            Act::Q | Act::Att => qw,
            Act::K | Act::V => kw,
            Act::Lse => cfg.heads,
            Act::Gate | Act::Up | Act::Product => cfg.ffn,
        }
    }
}

impl Act {
    /// Whether the model keeps this activation in bf16 when its products run in bf16
    /// ([`lowbit_device::MatmulMode::Bf16`]): the norms' outputs and SwiGLU's product, whose
    /// only readers are GEMMs, and, where the flash attention serves the head size, the rotated
    /// queries and keys and the attention's output, whose readers (the flash attention, the
    /// output projection's GEMMs) round them to bf16 as well. Each reader would round them to
    /// bf16 anyway: the same bits, half the bytes, no cast or copy pass.
    pub(crate) fn bf16_when_fast(self, cfg: &LlamaConfig) -> bool {
        match self {
            Act::N1 | Act::N2 | Act::Product => true,
            Act::Q | Act::K | Act::Att => FLASH_HEAD_DIMS.contains(&cfg.head_dim),
            _ => false,
        }
    }

    /// f32 words of this activation over `rows` token rows.
    pub(crate) fn words(self, cfg: &LlamaConfig, rows: usize, bf16: bool) -> Option<usize> {
        let n = rows.checked_mul(self.width(cfg))?;
        Some(if bf16 && self.bf16_when_fast(cfg) {
            n.div_ceil(2)
        } else {
            n
        })
    }
}

impl Recompute {
    /// Every level, from keeping all to recomputing most.
    pub const ALL: [Recompute; 4] = [
        Recompute::Off,
        Recompute::Selective,
        Recompute::Mlp,
        Recompute::Full,
    ];

    /// The name the command line and the reports use.
    pub fn name(self) -> &'static str {
        match self {
            Recompute::Off => "off",
            Recompute::Selective => "selective",
            Recompute::Mlp => "mlp",
            Recompute::Full => "full",
        }
    }

    /// The level of a [`Recompute::name`].
    pub fn from_name(name: &str) -> Option<Recompute> {
        Recompute::ALL.into_iter().find(|r| r.name() == name)
    }

    /// Whether anything is recomputed.
    pub fn is_on(self) -> bool {
        self != Recompute::Off
    }

    /// Whether activation `a` lives in the shared slot (recomputed) rather than per layer.
    pub(crate) fn shares(self, a: Act) -> bool {
        match self {
            Recompute::Off => false,
            Recompute::Selective => {
                matches!(
                    a,
                    Act::N1 | Act::Rstd1 | Act::N2 | Act::Rstd2 | Act::Product
                )
            }
            Recompute::Mlp => matches!(
                a,
                Act::N1 | Act::Rstd1 | Act::N2 | Act::Rstd2 | Act::Gate | Act::Up | Act::Product
            ),
            Recompute::Full => true,
        }
    }

    /// GEMM flops the backward adds per token, over all layers (`2·m·n·k` per rerun product):
    /// 0, the gate and up projections, or every projection but down.
    pub fn extra_flops_per_token(self, cfg: &LlamaConfig) -> u64 {
        let (qw, kw) = cfg.qkv_widths();
        let (d, f) = (cfg.dim as u64, cfg.ffn as u64);
        let mlp = 2 * 2 * d * f;
        let attn_proj = 2 * d * (2 * qw as u64 + 2 * kw as u64);
        let per_layer = match self {
            Recompute::Off | Recompute::Selective => 0,
            Recompute::Mlp => mlp,
            Recompute::Full => mlp + attn_proj,
        };
        per_layer * cfg.layers as u64
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The activation memory of a batch, in closed form (f32 bytes): what [`crate::Llama`]
/// allocates, split into what grows with the layer count and what does not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActivationBytes {
    /// Per layer: its input (the residual stream) and the activations it keeps.
    pub per_layer: usize,
    /// Once: ids, targets, RoPE tables, the final norm, the shared slot of the recomputed
    /// activations, the backward's buffers, the loss's chunk and head copies, the scratch.
    pub fixed: usize,
}

impl ActivationBytes {
    /// `layers · per_layer + fixed`, the bytes [`crate::Llama::activation_bytes`] reports.
    pub fn total(&self, layers: usize) -> Option<usize> {
        self.per_layer.checked_mul(layers)?.checked_add(self.fixed)
    }
}

/// Values per token row that each layer keeps (`per_layer`) and that the shared slot holds
/// (`shared`) under `r`: the closed form's two sums of [`Act::width`].
#[cfg(test)]
pub(crate) fn row_widths(cfg: &LlamaConfig, r: Recompute) -> (usize, usize) {
    let (mut kept, mut shared) = (cfg.dim, 0); // `kept` starts with the layer's input
    for a in Act::ALL {
        if r.shares(a) {
            shared += a.width(cfg);
        } else {
            kept += a.width(cfg);
        }
    }
    (kept, shared)
}

/// Bytes per token row that each layer keeps and that the shared slot holds under `r`, with the
/// [`Act::bf16_when_fast`] activations in bf16 when `bf16`.
pub(crate) fn row_bytes(cfg: &LlamaConfig, r: Recompute, bf16: bool) -> (usize, usize) {
    let (mut kept, mut shared) = (4 * cfg.dim, 0); // `kept` starts with the layer's input
    for a in Act::ALL {
        let b = if bf16 && a.bf16_when_fast(cfg) { 2 } else { 4 } * a.width(cfg);
        if r.shares(a) {
            shared += b;
        } else {
            kept += b;
        }
    }
    (kept, shared)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets;

    #[test]
    fn names_round_trip_and_levels_nest() {
        for r in Recompute::ALL {
            assert_eq!(Recompute::from_name(r.name()), Some(r));
        }
        assert_eq!(Recompute::from_name("on"), None);
        // Each level shares a superset of the previous level's activations.
        for w in Recompute::ALL.windows(2) {
            for a in Act::ALL {
                assert!(!w[0].shares(a) || w[1].shares(a), "{:?} {a:?}", w[1]);
            }
        }
    }

    #[test]
    fn the_1b_rows_follow_the_widths() {
        // Llama-3.2-1B: d 2048, 32 heads of 64 (q 2048), 8 kv heads (k, v 512), ffn 8192.
        let c = presets::llama_1b();
        let off = 2048 * 4 + 2 + 2048 * 2 + 512 * 2 + 32 + 8192 * 3;
        assert_eq!(row_widths(&c, Recompute::Off), (off, 0));
        assert_eq!(
            row_widths(&c, Recompute::Selective),
            (off - 2048 * 2 - 2 - 8192, 2048 * 2 + 2 + 8192)
        );
        assert_eq!(row_widths(&c, Recompute::Full).0, 2048);
        assert_eq!(Recompute::Selective.extra_flops_per_token(&c), 0);
        assert_eq!(
            Recompute::Mlp.extra_flops_per_token(&c),
            16 * 4 * 2048 * 8192
        );
    }
}
