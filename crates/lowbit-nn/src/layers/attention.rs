//! Causal grouped-query self-attention over projected heads (the core of Llama's `self_attn`,
//! between the q/k/v projections with rotary embedding and the output projection): no
//! parameters, on [`Device::attention`] and [`Device::attention_backward`] in the exact mode,
//! and on [`Device::flash_attention`] and [`Device::flash_attention_backward`] in the fast mode.

use lowbit_device::{AttentionSpec, Device, FLASH_HEAD_DIMS, View};

use crate::Result;

/// Causal grouped-query attention with the scale `1 / sqrt(head_dim)`: softmax over the keys
/// `j ≤ i` of `q_i · k_j · scale`, weighting the values; query head `h` attends with kv head
/// `h / (heads / kv_heads)` (Hugging Face Llama's `repeat_kv`; Ainslie et al. 2023, "GQA").
///
/// `q`, `out`, `dout`, `dq` are `[batch, seq, heads, head_dim]` f32, `k`, `v`, `dk`, `dv`
/// `[batch, seq, kv_heads, head_dim]`, `lse` `[batch, heads, seq]` (the per-row log-sum-exp the
/// forward saves for the backward), each row-major and head-major as `x·Wᵀ` of the projections
/// gives it. Where the flash attention runs, `q`, `k`, `v`, `out` and `dout` may also be bf16
/// (the operands it rounds to anyway: no conversion pass; a bf16 `out` is the f32 one rounded
/// once).
///
/// Which op runs follows the device's matmul mode ([`Device::matmul_mode`]): in the exact mode
/// ([`MatmulMode::Exact`]) the exact attention, in the device ops' exact order and bit-equal
/// across backends; in the fast mode ([`MatmulMode::Bf16`], `lowbit train --compute bf16`) the
/// flash attention with bf16 tensor-core products where `head_dim` is 64 or 128
/// ([`FLASH_HEAD_DIMS`]), the exact attention for other head sizes. Forward and backward decide
/// alike, so a backward always matches the forward that made its `lse`.
///
/// [`MatmulMode::Exact`]: lowbit_device::MatmulMode::Exact
/// [`MatmulMode::Bf16`]: lowbit_device::MatmulMode::Bf16
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attention {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` a multiple of it).
    pub kv_heads: usize,
    /// Values per head.
    pub head_dim: usize,
}

impl Attention {
    /// The device op's spec: the scale `fl32(1 / sqrt(head_dim))`, computed in f64.
    pub fn spec(&self, batch: usize, seq: usize) -> AttentionSpec {
        AttentionSpec {
            batch,
            seq,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            scale: (1.0 / (self.head_dim as f64).sqrt()) as f32,
        }
    }

    /// Whether `dev` runs this attention as the flash attention (see the type's documentation).
    pub fn uses_flash(&self, dev: &Device) -> bool {
        dev.matmul_mode().is_fast() && FLASH_HEAD_DIMS.contains(&self.head_dim)
    }

    /// `out` (and `lse`) of `batch` sequences of `seq` tokens; `out` and `lse` must overlap
    /// neither each other nor an input.
    #[allow(clippy::too_many_arguments)] // three inputs, two outputs, the shape
    pub fn forward(
        &self,
        dev: &mut Device,
        q: View,
        k: View,
        v: View,
        out: View,
        lse: View,
        batch: usize,
        seq: usize,
    ) -> Result<()> {
        let spec = self.spec(batch, seq);
        if self.uses_flash(dev) {
            return Ok(dev.flash_attention(q, k, v, out, lse, &spec)?);
        }
        Ok(dev.attention(q, k, v, out, lse, &spec)?)
    }

    /// `dq`, `dk`, `dv` (overwritten) from the forward's inputs, its `out` and `lse`, and the
    /// gradient `dout` of `out`. The gradients must be disjoint and overlap no input.
    #[allow(clippy::too_many_arguments)] // the forward's views, the gradients, the shape
    pub fn backward(
        &self,
        dev: &mut Device,
        q: View,
        k: View,
        v: View,
        out: View,
        lse: View,
        dout: View,
        dq: View,
        dk: View,
        dv: View,
        batch: usize,
        seq: usize,
    ) -> Result<()> {
        let spec = self.spec(batch, seq);
        if self.uses_flash(dev) {
            return Ok(dev.flash_attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &spec)?);
        }
        Ok(dev.attention_backward(q, k, v, out, lse, dout, dq, dk, dv, &spec)?)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::{DType, MatmulMode};

    use super::*;
    use crate::testing::{upload, values};

    /// The f64 host attention, a plain softmax over each causal row: `out`.
    fn host_attention(a: &Attention, batch: usize, seq: usize, x: [&[f64]; 3]) -> Vec<f64> {
        let [q, k, v] = x;
        let (h_n, g_n, hd) = (a.heads, a.kv_heads, a.head_dim);
        let rep = h_n / g_n;
        let scale = 1.0 / (hd as f64).sqrt();
        let qo = |b: usize, i: usize, h: usize| ((b * seq + i) * h_n + h) * hd;
        let ko = |b: usize, j: usize, g: usize| ((b * seq + j) * g_n + g) * hd;
        let mut out = vec![0f64; q.len()];
        for b in 0..batch {
            for h in 0..h_n {
                for i in 0..seq {
                    let s: Vec<f64> = (0..=i)
                        .map(|j| {
                            let (qr, kr) = (qo(b, i, h), ko(b, j, h / rep));
                            (0..hd).map(|d| q[qr + d] * k[kr + d]).sum::<f64>() * scale
                        })
                        .collect();
                    let z: f64 = s.iter().map(|s| s.exp()).sum();
                    for d in 0..hd {
                        out[qo(b, i, h) + d] = (0..=i)
                            .map(|j| s[j].exp() / z * v[ko(b, j, h / rep) + d])
                            .sum();
                    }
                }
            }
        }
        out
    }

    fn f64s(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
    }

    /// Worst `|got − want|` over the largest `|want|`.
    fn worst_rel(got: &[f32], want: &[f64]) -> f64 {
        let mag = want.iter().fold(0f64, |m, w| m.max(w.abs())).max(1e-30);
        got.iter()
            .zip(want)
            .fold(0f64, |m, (&g, &w)| m.max((f64::from(g) - w).abs() / mag))
    }

    struct Case {
        a: Attention,
        batch: usize,
        seq: usize,
    }

    impl Case {
        fn lens(&self) -> (usize, usize) {
            let rows = self.batch * self.seq;
            (
                rows * self.a.heads * self.a.head_dim,
                rows * self.a.kv_heads * self.a.head_dim,
            )
        }
    }

    const CASES: [Case; 3] = [
        // Multi-head (one query head per kv head), GQA with two and with four query heads per
        // kv head; odd sequence lengths and head sizes.
        Case {
            a: Attention {
                heads: 2,
                kv_heads: 2,
                head_dim: 4,
            },
            batch: 2,
            seq: 5,
        },
        Case {
            a: Attention {
                heads: 4,
                kv_heads: 2,
                head_dim: 3,
            },
            batch: 1,
            seq: 6,
        },
        Case {
            a: Attention {
                heads: 4,
                kv_heads: 1,
                head_dim: 8,
            },
            batch: 2,
            seq: 3,
        },
    ];

    #[test]
    fn forward_matches_the_f64_softmax() {
        for (n, c) in CASES.iter().enumerate() {
            let mut dev = Device::cpu();
            let (qn, kn) = c.lens();
            let seed = 10 * n as u32;
            let (q, k, v) = (
                values(seed + 1, qn),
                values(seed + 2, kn),
                values(seed + 3, kn),
            );
            let [qv, kv, vv] = [&q, &k, &v].map(|x| upload(&mut dev, x));
            let out = dev.alloc(DType::F32, qn);
            let lse = dev.alloc(DType::F32, c.batch * c.a.heads * c.seq);
            c.a.forward(&mut dev, qv, kv, vv, out, lse, c.batch, c.seq)
                .unwrap();
            let want = host_attention(&c.a, c.batch, c.seq, [&f64s(&q), &f64s(&k), &f64s(&v)]);
            let rel = worst_rel(&dev.download::<f32>(out).unwrap(), &want);
            assert!(rel < 1e-6, "case {n}: worst error {rel:e}");
        }
    }

    /// The f64 gradient check: every element of dq, dk, dv against central differences of the
    /// f64 host attention of `L = Σ dout · out`. The worst error relative to the gradient's
    /// largest magnitude over the cases is 3.0e-7 (the f32 rounding of the analytic
    /// gradients; the f64 differences are exact to ~1e-10).
    #[test]
    fn gradients_match_f64_central_differences() {
        let mut worst = 0f64;
        for (n, c) in CASES.iter().enumerate() {
            let mut dev = Device::cpu();
            let (qn, kn) = c.lens();
            let seed = 10 * n as u32 + 100;
            let (q, k, v, dout) = (
                values(seed + 1, qn)
                    .iter()
                    .map(|x| 2.0 * x)
                    .collect::<Vec<_>>(),
                values(seed + 2, kn)
                    .iter()
                    .map(|x| 2.0 * x)
                    .collect::<Vec<_>>(),
                values(seed + 3, kn),
                values(seed + 4, qn),
            );
            let [qv, kv, vv, dov] = [&q, &k, &v, &dout].map(|x| upload(&mut dev, x));
            let out = dev.alloc(DType::F32, qn);
            let lse = dev.alloc(DType::F32, c.batch * c.a.heads * c.seq);
            let [dq, dk, dv] = [qn, kn, kn].map(|len| dev.alloc(DType::F32, len));
            c.a.forward(&mut dev, qv, kv, vv, out, lse, c.batch, c.seq)
                .unwrap();
            c.a.backward(
                &mut dev, qv, kv, vv, out, lse, dov, dq, dk, dv, c.batch, c.seq,
            )
            .unwrap();
            let x = [f64s(&q), f64s(&k), f64s(&v)];
            let dout = f64s(&dout);
            let loss = |x: &[Vec<f64>; 3]| {
                let o = host_attention(&c.a, c.batch, c.seq, [&x[0], &x[1], &x[2]]);
                o.iter().zip(&dout).map(|(o, d)| o * d).sum::<f64>()
            };
            let h = 1e-5;
            for (which, got) in [dq, dk, dv].iter().enumerate() {
                let mut at = x.clone();
                let want: Vec<f64> = (0..x[which].len())
                    .map(|e| {
                        at[which][e] = x[which][e] + h;
                        let up = loss(&at);
                        at[which][e] = x[which][e] - h;
                        let down = loss(&at);
                        at[which][e] = x[which][e];
                        (up - down) / (2.0 * h)
                    })
                    .collect();
                let rel = worst_rel(&dev.download::<f32>(*got).unwrap(), &want);
                assert!(rel < 1e-3, "case {n}, input {which}: worst error {rel:e}");
                worst = worst.max(rel);
            }
        }
        eprintln!("attention gradient check: worst relative error {worst:e}");
        assert!(worst < 1e-5, "worst error {worst:e}");
    }

    /// The fast mode runs the flash attention for head sizes 64 and 128 (its bf16 rounding
    /// shows in the bits: different from the exact op's, equal to the flash op's), the exact
    /// attention for any other head size; the exact mode always the exact attention.
    #[test]
    fn the_fast_mode_selects_the_flash_attention() {
        for (head_dim, flash) in [(64, true), (128, true), (16, false)] {
            let a = Attention {
                heads: 2,
                kv_heads: 1,
                head_dim,
            };
            let (batch, seq) = (1, 9);
            let (qn, kn) = (seq * 2 * head_dim, seq * head_dim);
            let mut dev = Device::cpu();
            let (q, k, v, dout) = (values(1, qn), values(2, kn), values(3, kn), values(4, qn));
            let [qv, kv, vv, dov] = [&q, &k, &v, &dout].map(|x| upload(&mut dev, x));
            let spec = a.spec(batch, seq);
            // [out, lse, dq, dk, dv] of the layer (exact or fast mode), the exact op, the flash op.
            let mut outs = Vec::new();
            for run in 0..4 {
                let [out, dq] = [qn, qn].map(|n| dev.alloc(DType::F32, n));
                let [dk, dv] = [kn, kn].map(|n| dev.alloc(DType::F32, n));
                let lse = dev.alloc(DType::F32, 2 * seq);
                match run {
                    0 | 1 => {
                        dev.set_matmul_mode(if run == 0 {
                            MatmulMode::Exact
                        } else {
                            MatmulMode::Bf16
                        });
                        assert_eq!(a.uses_flash(&dev), run == 1 && flash);
                        a.forward(&mut dev, qv, kv, vv, out, lse, batch, seq)
                            .unwrap();
                        a.backward(&mut dev, qv, kv, vv, out, lse, dov, dq, dk, dv, batch, seq)
                            .unwrap();
                    }
                    2 => {
                        dev.attention(qv, kv, vv, out, lse, &spec).unwrap();
                        dev.attention_backward(qv, kv, vv, out, lse, dov, dq, dk, dv, &spec)
                            .unwrap();
                    }
                    _ if flash => {
                        dev.flash_attention(qv, kv, vv, out, lse, &spec).unwrap();
                        dev.flash_attention_backward(qv, kv, vv, out, lse, dov, dq, dk, dv, &spec)
                            .unwrap();
                    }
                    _ => continue,
                }
                let bytes: Vec<Vec<u8>> = [out, lse, dq, dk, dv]
                    .iter()
                    .map(|w| dev.read_bytes(*w).unwrap())
                    .collect();
                outs.push(bytes);
            }
            assert_eq!(
                outs[0], outs[2],
                "head_dim {head_dim}: exact mode is the exact op"
            );
            if flash {
                assert_eq!(
                    outs[1], outs[3],
                    "head_dim {head_dim}: fast mode is the flash op"
                );
                assert_ne!(
                    outs[1], outs[2],
                    "head_dim {head_dim}: flash rounds to bf16"
                );
            } else {
                assert_eq!(
                    outs[1], outs[2],
                    "head_dim {head_dim}: fast mode keeps the exact op"
                );
            }
        }
    }

    #[test]
    fn the_scale_is_the_rounded_inverse_square_root() {
        let a = Attention {
            heads: 2,
            kv_heads: 1,
            head_dim: 64,
        };
        assert_eq!(a.spec(3, 7).scale, 0.125);
        let b = Attention { head_dim: 3, ..a };
        assert_eq!(b.spec(1, 1).scale, (1.0 / 3f64.sqrt()) as f32);
    }

    #[test]
    fn bad_head_counts_are_errors() {
        let mut dev = Device::cpu();
        let a = Attention {
            heads: 3,
            kv_heads: 2,
            head_dim: 2,
        };
        let [q, k, v, out, lse] = [6, 4, 4, 6, 3].map(|n| dev.alloc(DType::F32, n));
        assert!(a.forward(&mut dev, q, k, v, out, lse, 1, 1).is_err());
    }
}
