//! Rotary position embedding (Su et al. 2021, "RoFormer"), in Hugging Face Llama's rotate-half
//! layout, and its cos/sin tables with Llama 3's frequency scaling.

use lowbit_device::{Device, RopeSpec, View};

use crate::Result;

/// Llama 3's RoPE frequency scaling (transformers' `rope_scaling` with `rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    /// Divisor of the low frequencies (`factor`; 8 for Llama 3.1, 32 for Llama 3.2).
    pub factor: f64,
    /// `low_freq_factor` (1 in Llama 3.1).
    pub low_freq_factor: f64,
    /// `high_freq_factor` (4 in Llama 3.1).
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings` (8192 in Llama 3.1).
    pub original_max_position: usize,
}

/// The inverse frequencies `theta^(−2i/head_dim)` for `i < head_dim/2`, in f64, scaled as
/// transformers' `_compute_llama3_parameters` (`src/transformers/modeling_rope_utils.py`) when
/// `scaling` is given: wavelengths `2π/f` above `original_max_position / low_freq_factor` are
/// divided by `factor`, those below `original_max_position / high_freq_factor` kept, and those
/// between interpolated with `smooth = (original_max_position / wavelen − low) / (high − low)`:
/// `(1 − smooth) · f / factor + smooth · f`.
fn inv_freqs(theta: f64, head_dim: usize, scaling: Option<&Llama3RopeScaling>) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let f = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            let Some(s) = scaling else { return f };
            let old = s.original_max_position as f64;
            let (low_wavelen, high_wavelen) = (old / s.low_freq_factor, old / s.high_freq_factor);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen > low_wavelen {
                f / s.factor
            } else if wavelen < high_wavelen {
                f
            } else {
                let smooth =
                    (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
                (1.0 - smooth) * f / s.factor + smooth * f
            }
        })
        .collect()
}

/// The cos and sin tables, each `[max_seq, head_dim/2]` row-major: entry `(p, i)` is
/// `fl32(cos(p · inv_freq_i))` (resp. sin), the angle and its cosine in f64, with
/// `inv_freq_i = theta^(−2i/head_dim)` scaled as [`Llama3RopeScaling`] says when `scaling` is
/// given (transformers' `_compute_llama3_parameters`). Upload them once; [`Rope`] reads them.
pub fn rope_tables(
    theta: f64,
    head_dim: usize,
    max_seq: usize,
    scaling: Option<&Llama3RopeScaling>,
) -> (Vec<f32>, Vec<f32>) {
    let f = inv_freqs(theta, head_dim, scaling);
    let angles = (0..max_seq).flat_map(|p| f.iter().map(move |f| p as f64 * f));
    angles.map(|a| (a.cos() as f32, a.sin() as f32)).unzip()
}

/// The rotary embedding of the query or key projections `[rows, heads, head_dim]` (no
/// parameters): the position of row `r` is `r % seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rope {
    /// Heads per row.
    pub heads: usize,
    /// Values per head (even).
    pub head_dim: usize,
}

impl Rope {
    fn spec(&self, seq: usize, inverse: bool) -> RopeSpec {
        RopeSpec {
            seq,
            heads: self.heads,
            head_dim: self.head_dim,
            inverse,
        }
    }

    /// `y = rope(x)` ([`Device::rope`]); `y` is `x` (in place) or disjoint from it.
    pub fn forward(
        &self,
        dev: &mut Device,
        x: View,
        y: View,
        seq: usize,
        cos: View,
        sin: View,
    ) -> Result<()> {
        Ok(dev.rope(x, y, cos, sin, &self.spec(seq, false))?)
    }

    /// `dx = Rᵀ·dy`, the transposed rotation; `dx` is `dy` (in place) or disjoint from it.
    pub fn backward(
        &self,
        dev: &mut Device,
        dy: View,
        dx: View,
        seq: usize,
        cos: View,
        sin: View,
    ) -> Result<()> {
        Ok(dev.rope(dy, dx, cos, sin, &self.spec(seq, true))?)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::layers::f64check::{central_diff, f64s, worst_rel};
    use crate::testing::{upload, values};

    const LLAMA31: Llama3RopeScaling = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position: 8192,
    };

    #[test]
    fn tables_without_scaling_are_plain_powers() {
        let (cos, sin) = rope_tables(10_000.0, 4, 3, None);
        // inv_freq = [1, 10000^(-1/2) = 0.01]; row p holds angles p·1 and p·0.01.
        let want = |p: f64| [p.cos() as f32, (p * 0.01).cos() as f32];
        assert_eq!(cos, [want(0.0), want(1.0), want(2.0)].concat());
        assert_eq!(sin[2..4], [1f64.sin() as f32, 0.01f64.sin() as f32]);
        assert_eq!(sin[0..2], [0.0, 0.0]);
    }

    #[test]
    fn llama3_scaling_matches_transformers_by_hand() {
        // theta 500000, head_dim 8: inv_freq_i = 1 / 500000^(i/4) for i = 0..4, wavelengths
        // 2π·500000^(i/4): 6.28, 167.08, 4442.88, 118142.8. With 8192/4 = 2048 and
        // 8192/1 = 8192: i = 0, 1 kept; i = 3 divided by 8; i = 2 interpolated with
        // smooth = (8192 / 4442.88 − 1) / 3 = 0.28128.
        let f: Vec<f64> = (0..4)
            .map(|i| 1.0 / 500_000f64.powf(i as f64 / 4.0))
            .collect();
        let got = inv_freqs(500_000.0, 8, Some(&LLAMA31));
        assert_eq!(got[0], f[0]);
        assert_eq!(got[1], f[1]);
        assert_eq!(got[3], f[3] / 8.0);
        let wavelen = 2.0 * std::f64::consts::PI / f[2];
        assert!((wavelen - 4_442.882_938).abs() < 1e-5, "{wavelen}");
        let smooth = (8192.0 / wavelen - 1.0) / 3.0;
        assert!((smooth - 0.281_282_6).abs() < 1e-6, "{smooth}");
        let want = (1.0 - smooth) * f[2] / 8.0 + smooth * f[2];
        assert_eq!(got[2], want);
        // f[2] = 500000^(-1/2) = 1.41421e-3; blended: 1.41421e-3 · (0.71872/8 + 0.28128) =
        // 5.24846e-4.
        assert!((got[2] - 5.248_462e-4).abs() < 1e-9, "{}", got[2]);
        let (cos, sin) = rope_tables(500_000.0, 8, 9000, Some(&LLAMA31));
        let p = 8999.0;
        assert_eq!(cos[8999 * 4 + 2], (p * want).cos() as f32);
        assert_eq!(sin[8999 * 4 + 3], (p * f[3] / 8.0).sin() as f32);
    }

    /// `Σ c ⊙ rope(x)` in f64, written from the rotate-half definition.
    fn loss64(x: &[f64], tables: (&[f32], &[f32]), c: &[f64], shape: [usize; 3]) -> f64 {
        let ([heads, hd, seq], (cos, sin)) = (shape, tables);
        let half = hd / 2;
        let mut l = 0.0;
        for (h, head) in x.chunks(hd).enumerate() {
            let p = (h / heads) % seq;
            for i in 0..half {
                let (cs, sn) = (f64::from(cos[p * half + i]), f64::from(sin[p * half + i]));
                let (a, b) = (head[i], head[i + half]);
                l += c[h * hd + i] * (a * cs - b * sn) + c[h * hd + i + half] * (b * cs + a * sn);
            }
        }
        l
    }

    #[test]
    fn backward_is_the_transposed_rotation() {
        let (heads, hd, seq) = (2, 4, 3);
        let rows = 2 * seq;
        let n = rows * heads * hd;
        let (cos, sin) = rope_tables(100.0, hd, 5, None);
        let mut dev = Device::cpu();
        let (cv, sv) = (upload(&mut dev, &cos), upload(&mut dev, &sin));
        let (x, c) = (values(1, n), values(2, n));
        let rope = Rope {
            heads,
            head_dim: hd,
        };
        let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, n));
        rope.forward(&mut dev, xv, y, seq, cv, sv).unwrap();
        let (dy, dx) = (upload(&mut dev, &c), dev.alloc(DType::F32, n));
        rope.backward(&mut dev, dy, dx, seq, cv, sv).unwrap();
        let shape = [heads, hd, seq];
        let want = central_diff(&f64s(&x), 1e-6, |x| {
            loss64(x, (&cos, &sin), &f64s(&c), shape)
        });
        let err = worst_rel(&dev.download::<f32>(dx).unwrap(), &want);
        // Worst relative error measured: 6.4e-8 (f32 rounding of the products).
        assert!(err < 1e-6, "worst relative error {err}");
        // And the forward against the same reference: Σ c ⊙ y.
        let yv = dev.download::<f32>(y).unwrap();
        let l: f64 = yv
            .iter()
            .zip(&c)
            .map(|(y, c)| f64::from(*y) * f64::from(*c))
            .sum();
        let w = loss64(&f64s(&x), (&cos, &sin), &f64s(&c), shape);
        assert!((l - w).abs() < 1e-5, "{l} vs {w}");
    }
}
