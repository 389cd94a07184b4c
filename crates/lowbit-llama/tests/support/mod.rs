//! Test helpers: hooks over device buffers that record every call, deterministic parameter
//! values, and an independent f64 host implementation of the whole decoder's forward.

#![allow(dead_code)]

use lowbit_buffers::Result as HookResult;
use lowbit_device::{DType, Device, View};
use lowbit_io::rng::SplitMix64;
use lowbit_llama::LlamaConfig;
use lowbit_llama::params::{self, Role};
use lowbit_nn::{Hooks, Usage};

/// A call the model made on its hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    Param(usize, Usage),
    Grad(usize),
    Ready(usize),
}

/// Parameters (any dtype) and f32 gradients in device buffers of their own; calls recorded.
pub struct TestHooks {
    pub params: Vec<View>,
    pub grads: Vec<View>,
    pub calls: Vec<Call>,
}

impl TestHooks {
    /// f32 parameters with these values, zero gradients.
    pub fn new(dev: &mut Device, values: &[Vec<f32>]) -> TestHooks {
        let params = values.iter().map(|v| upload(dev, v)).collect();
        let grads = values
            .iter()
            .map(|v| dev.alloc(DType::F32, v.len()))
            .collect();
        TestHooks {
            params,
            grads,
            calls: Vec::new(),
        }
    }

    /// Every accumulated gradient.
    pub fn grads(&self, dev: &Device) -> Vec<Vec<f32>> {
        self.grads
            .iter()
            .map(|g| dev.download(*g).unwrap())
            .collect()
    }

    /// Zero gradients and no recorded calls.
    pub fn reset(&mut self, dev: &mut Device) {
        for g in &self.grads {
            dev.zero(*g).unwrap();
        }
        self.calls.clear();
    }

    /// The parameters reported ready, in order.
    pub fn ready(&self) -> Vec<usize> {
        self.calls
            .iter()
            .filter_map(|c| match c {
                Call::Ready(p) => Some(*p),
                _ => None,
            })
            .collect()
    }
}

impl Hooks for TestHooks {
    fn param(&mut self, _: &mut Device, p: usize, usage: Usage) -> HookResult<View> {
        self.calls.push(Call::Param(p, usage));
        Ok(self.params[p])
    }
    fn grad(&mut self, _: &mut Device, p: usize) -> HookResult<View> {
        self.calls.push(Call::Grad(p));
        Ok(self.grads[p])
    }
    fn grad_ready(&mut self, _: &mut Device, p: usize) -> HookResult<()> {
        self.calls.push(Call::Ready(p));
        Ok(())
    }
}

/// An f32 device buffer holding `v`.
pub fn upload(dev: &mut Device, v: &[f32]) -> View {
    let view = dev.alloc(DType::F32, v.len());
    dev.upload(view, v).unwrap();
    view
}

/// Test parameter values, larger than the init's so that every path carries gradient: matrices
/// and the embedding uniform in ±`amp`, norm gains `1 ± 0.3`.
pub fn test_params(cfg: &LlamaConfig, seed: u64, amp: f32) -> Vec<Vec<f32>> {
    let mut rng = SplitMix64(seed);
    params::params(cfg)
        .iter()
        .map(|p| {
            let n = p.numel();
            match p.role {
                Role::InputNorm(_) | Role::PostNorm(_) | Role::FinalNorm => {
                    (0..n).map(|_| 1.0 + 0.3 * rng.uniform()).collect()
                }
                _ => (0..n).map(|_| amp * rng.uniform()).collect(),
            }
        })
        .collect()
}

/// `n` token ids below `vocab`.
pub fn test_tokens(seed: u64, n: usize, vocab: usize) -> Vec<u32> {
    let mut rng = SplitMix64(seed);
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// The RoPE inverse frequencies in f64, with HF transformers' `_compute_llama3_parameters` when
/// the config scales them (written here from that function, not from the crate's code).
fn inv_freqs(cfg: &LlamaConfig) -> Vec<f64> {
    let hd = cfg.head_dim;
    (0..hd / 2)
        .map(|i| {
            let f = cfg.rope_theta.powf(-((2 * i) as f64) / hd as f64);
            let Some(s) = cfg.rope_scaling else {
                return f;
            };
            let old = s.original_max_position as f64;
            let low_wavelen = old / s.low_freq_factor;
            let high_wavelen = old / s.high_freq_factor;
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / s.factor
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

fn rms_norm(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    let d = g.len();
    x.chunks(d)
        .flat_map(|row| {
            let ms = row.iter().map(|v| v * v).sum::<f64>() / d as f64;
            let r = 1.0 / (ms + eps).sqrt();
            row.iter()
                .zip(g)
                .map(move |(v, g)| v * r * g)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// `x [rows, i] · Wᵀ` for `W [o, i]`.
fn linear(x: &[f64], w: &[f64], i: usize) -> Vec<f64> {
    let o = w.len() / i;
    x.chunks(i)
        .flat_map(|row| {
            (0..o)
                .map(|r| {
                    row.iter()
                        .zip(&w[r * i..(r + 1) * i])
                        .map(|(a, b)| a * b)
                        .sum()
                })
                .collect::<Vec<f64>>()
        })
        .collect()
}

/// Rotate-half RoPE in place over `[rows, heads, hd]`, position `row % seq`.
fn rope(x: &mut [f64], heads: usize, hd: usize, seq: usize, inv: &[f64]) {
    let half = hd / 2;
    for (r, row) in x.chunks_mut(heads * hd).enumerate() {
        let pos = (r % seq) as f64;
        for head in row.chunks_mut(hd) {
            for i in 0..half {
                let (c, s) = ((pos * inv[i]).cos(), (pos * inv[i]).sin());
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = b * c + a * s;
            }
        }
    }
}

/// Causal GQA attention, `[batch, seq, heads, hd]` queries over `[batch, seq, kv, hd]` keys.
#[allow(clippy::too_many_arguments)]
fn attention(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    batch: usize,
    seq: usize,
    heads: usize,
    kv: usize,
    hd: usize,
) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    let scale = 1.0 / (hd as f64).sqrt();
    let group = heads / kv;
    for b in 0..batch {
        for h in 0..heads {
            let g = h / group;
            let qa = |i: usize| ((b * seq + i) * heads + h) * hd;
            let ka = |j: usize| ((b * seq + j) * kv + g) * hd;
            for i in 0..seq {
                let s: Vec<f64> = (0..=i)
                    .map(|j| (0..hd).map(|d| q[qa(i) + d] * k[ka(j) + d]).sum::<f64>() * scale)
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|s| (s - m).exp()).collect();
                let l: f64 = e.iter().sum();
                for d in 0..hd {
                    out[qa(i) + d] = (0..=i).map(|j| e[j] * v[ka(j) + d]).sum::<f64>() / l;
                }
            }
        }
    }
    out
}

/// The decoder's forward in f64 up to the final norm, over `batch` sequences of `seq` tokens.
fn trunk(cfg: &LlamaConfig, p: &[Vec<f64>], tokens: &[u32], batch: usize, seq: usize) -> Vec<f64> {
    let (d, hd) = (cfg.dim, cfg.head_dim);
    let eps = f64::from(cfg.rms_eps);
    let inv = inv_freqs(cfg);
    let mut x: Vec<f64> = tokens
        .iter()
        .flat_map(|&t| p[0][t as usize * d..(t as usize + 1) * d].to_vec())
        .collect();
    for l in 0..cfg.layers {
        let ids = params::layer_ids(l);
        let n1 = rms_norm(&x, &p[ids.input_norm], eps);
        let mut q = linear(&n1, &p[ids.q], d);
        let mut k = linear(&n1, &p[ids.k], d);
        let v = linear(&n1, &p[ids.v], d);
        rope(&mut q, cfg.heads, hd, seq, &inv);
        rope(&mut k, cfg.kv_heads, hd, seq, &inv);
        let att = attention(&q, &k, &v, batch, seq, cfg.heads, cfg.kv_heads, hd);
        let o = linear(&att, &p[ids.o], cfg.heads * hd);
        let h: Vec<f64> = x.iter().zip(&o).map(|(a, b)| a + b).collect();
        let n2 = rms_norm(&h, &p[ids.post_norm], eps);
        let g = linear(&n2, &p[ids.gate], d);
        let u = linear(&n2, &p[ids.up], d);
        let a: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let m = linear(&a, &p[ids.down], cfg.ffn);
        x = h.iter().zip(&m).map(|(a, b)| a + b).collect();
    }
    rms_norm(&x, &p[params::final_norm_id(cfg)], eps)
}

/// The logits `[rows, vocab]` in f64.
pub fn ref_logits(
    cfg: &LlamaConfig,
    p: &[Vec<f64>],
    tokens: &[u32],
    batch: usize,
    seq: usize,
) -> Vec<f64> {
    let nf = trunk(cfg, p, tokens, batch, seq);
    linear(&nf, &p[params::head_id(cfg)], cfg.dim)
}

/// The mean cross-entropy in f64 and the per-row losses.
pub fn ref_loss(
    cfg: &LlamaConfig,
    p: &[Vec<f64>],
    tokens: &[u32],
    targets: &[u32],
    batch: usize,
    seq: usize,
) -> (f64, Vec<f64>) {
    let logits = ref_logits(cfg, p, tokens, batch, seq);
    let rows: Vec<f64> = logits
        .chunks(cfg.vocab)
        .zip(targets)
        .map(|(z, &t)| {
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
            lse - z[t as usize]
        })
        .collect();
    (rows.iter().sum::<f64>() / rows.len() as f64, rows)
}

/// Parameters as f64.
pub fn to_f64(p: &[Vec<f32>]) -> Vec<Vec<f64>> {
    p.iter()
        .map(|v| v.iter().map(|&x| f64::from(x)).collect())
        .collect()
}
