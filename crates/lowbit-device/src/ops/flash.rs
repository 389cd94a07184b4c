//! Causal grouped-query attention in the fast mode: the flash attention of
//! `crates/lowbit-kernels/flash_attention.cu` (FlashAttention-2, Dao 2023, Algorithms 1 and 2:
//! tiled, online softmax, bf16 tensor-core products), with the layouts, spec and checks of
//! [`Device::attention`] and a CPU reference of the same rounding.
//!
//! Rounding (both backends): `q`, `k`, `v` (and `dout`, `out` in the backward) are rounded to
//! bf16 (round to nearest even) before they are used; the scores `q·k` and the products `P·V`,
//! `dO·Vᵀ`, `dS·K`, `dSᵀ·Q`, `Pᵀ·dO` take bf16 operands and accumulate in f32; `P` (and `dS`) are
//! rounded to bf16 where they are operands of a product; the softmax statistics (maximum, sum,
//! `lse`) and the division are f32. The scale multiplies the exponent (and `dq`, `dk` once at
//! the end), as FlashAttention does.
//!
//! The CPU reference is *not* bit-equal to the CUDA kernels: the kernels accumulate in the
//! tensor cores' order, use `ex2.approx` and rescale partial sums by the online softmax (their
//! `P` is rounded against the running maximum, the reference's against the row's final
//! maximum). Both are within bf16 error of the exact op ([`Device::attention`]); the tests
//! bound the distance (`tests/flash.rs`, `tests/cuda_flash.rs`). The reference is deterministic
//! (sums in index order, one thread per batch element), and so are the kernels (no atomics: a
//! dK/dV pass per key block and a dQ pass per query block, each summing in a fixed order).

use super::attention::{Which, per_batch};
use super::invalid;
use super::model::f32_or_bf16;
use crate::cpu::{decode_f32, encode_f32};
use crate::{AttentionSpec, DType, Device, Result, View, bf16};

/// The head sizes the flash attention serves (one kernel instance each); the exact op serves
/// every other size.
pub const FLASH_HEAD_DIMS: [usize; 2] = [64, 128];

/// Refuses head sizes outside [`FLASH_HEAD_DIMS`].
fn check_dim(what: &'static str, spec: &AttentionSpec) -> Result<()> {
    if FLASH_HEAD_DIMS.contains(&spec.head_dim) {
        Ok(())
    } else {
        Err(invalid(
            what,
            format!(
                "head_dim {} is not one of the flash attention's {FLASH_HEAD_DIMS:?} (the exact \
                 attention serves any head size)",
                spec.head_dim
            ),
        ))
    }
}

/// `x` rounded to bf16 and back.
fn rb(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

/// `Σ_d a[d]·b[d]` from `+0` in index order.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (x, y)| s + x * y)
}

/// `fl32(exp(x))` via f64.
fn exp32(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

/// Index arithmetic of one batch element.
#[derive(Clone, Copy)]
struct Geo {
    seq: usize,
    heads: usize,
    kvh: usize,
    hd: usize,
    scale: f32,
}

impl Geo {
    fn new(s: &AttentionSpec) -> Geo {
        Geo {
            seq: s.seq,
            heads: s.heads,
            kvh: s.kv_heads,
            hd: s.head_dim,
            scale: s.scale,
        }
    }
    /// Query-row range of `(i, h)`.
    fn qr(&self, i: usize, h: usize) -> std::ops::Range<usize> {
        let o = (i * self.heads + h) * self.hd;
        o..o + self.hd
    }
    /// Key-row range of `(j, g)`.
    fn kr(&self, j: usize, g: usize) -> std::ops::Range<usize> {
        let o = (j * self.kvh + g) * self.hd;
        o..o + self.hd
    }
    /// The kv head of query head `h`.
    fn kv_of(&self, h: usize) -> usize {
        h / (self.heads / self.kvh)
    }
    /// Raw scores `q_i · k_j` (bf16 operands, f32 sums) for `j = 0..=i`, into `s`.
    fn scores(&self, q: &[f32], k: &[f32], i: usize, h: usize, s: &mut [f32]) {
        let qi = &q[self.qr(i, h)];
        for (j, sj) in s[..=i].iter_mut().enumerate() {
            *sj = dot(qi, &k[self.kr(j, self.kv_of(h))]);
        }
    }
}

/// The reference forward of one batch element (inputs already rounded to bf16).
fn forward_one(g: Geo, [q, k, v]: [&[f32]; 3], out: &mut [f32], lse: &mut [f32]) {
    let mut s = vec![0f32; g.seq];
    let mut acc = vec![0f32; g.hd];
    for h in 0..g.heads {
        let kvh = g.kv_of(h);
        for i in 0..g.seq {
            g.scores(q, k, i, h, &mut s);
            let m = s[..=i]
                .iter()
                .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
            let mut l = 0f32;
            acc.fill(0.0);
            for (j, &sj) in s[..=i].iter().enumerate() {
                let p = exp32((sj - m) * g.scale);
                l += p;
                let pb = rb(p);
                for (a, vv) in acc.iter_mut().zip(&v[g.kr(j, kvh)]) {
                    *a += pb * vv;
                }
            }
            for (o, a) in out[g.qr(i, h)].iter_mut().zip(&acc) {
                *o = a / l;
            }
            lse[h * g.seq + i] = m * g.scale + (f64::from(l).ln() as f32);
        }
    }
}

/// The inputs of one batch element's reference backward, rounded to bf16 (`lse`, `dd` f32).
struct BwdIn<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
    dd: &'a [f32],
}

impl BwdIn<'_> {
    /// `(p_ij, ds_ij)` (`ds` unscaled) for query row `i` of head `h` and key `j ≤ i`.
    fn p_ds(&self, g: &Geo, i: usize, j: usize, h: usize) -> (f32, f32) {
        let kr = g.kr(j, g.kv_of(h));
        let s = dot(&self.q[g.qr(i, h)], &self.k[kr.clone()]);
        let p = exp32(s * g.scale - self.lse[h * g.seq + i]);
        let dp = dot(&self.dout[g.qr(i, h)], &self.v[kr]);
        (p, p * (dp - self.dd[h * g.seq + i]))
    }
}

/// The reference backward of one batch element into `dq`, `dk`, `dv`.
fn backward_one(g: Geo, x: &BwdIn<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
    for h in 0..g.heads {
        let kvh = g.kv_of(h);
        for i in 0..g.seq {
            let r = g.qr(i, h);
            let mut acc = vec![0f32; g.hd];
            for j in 0..=i {
                let dsb = rb(x.p_ds(&g, i, j, h).1);
                for (a, kk) in acc.iter_mut().zip(&x.k[g.kr(j, kvh)]) {
                    *a += dsb * kk;
                }
            }
            for (o, a) in dq[r].iter_mut().zip(&acc) {
                *o = a * g.scale;
            }
        }
    }
    let group = g.heads / g.kvh;
    for kvh in 0..g.kvh {
        for j in 0..g.seq {
            let (mut ak, mut av) = (vec![0f32; g.hd], vec![0f32; g.hd]);
            for h in kvh * group..(kvh + 1) * group {
                for i in j..g.seq {
                    let (p, ds) = x.p_ds(&g, i, j, h);
                    let (pb, dsb) = (rb(p), rb(ds));
                    let (qi, doi) = (&x.q[g.qr(i, h)], &x.dout[g.qr(i, h)]);
                    for d in 0..g.hd {
                        ak[d] += dsb * qi[d];
                        av[d] += pb * doi[d];
                    }
                }
            }
            let r = g.kr(j, kvh);
            for (o, a) in dk[r.clone()].iter_mut().zip(&ak) {
                *o = a * g.scale;
            }
            dv[r].copy_from_slice(&av);
        }
    }
}

/// Decodes f32 or bf16 bytes and rounds every value to bf16 (bf16 ones are already).
fn rounded(b: &[u8], dtype: DType) -> Vec<f32> {
    let mut v = decode_f32(dtype, b);
    v.iter_mut().for_each(|x| *x = rb(*x));
    v
}

impl Device {
    /// The fast mode's causal grouped-query attention: [`Device::attention`]'s layouts, spec,
    /// checks and outputs (`out`, and `lse` in natural-log units of the scaled scores), computed
    /// as a flash attention with bf16 operands (see the module documentation of this op for the
    /// rounding). `head_dim` must be 64 or 128 ([`FLASH_HEAD_DIMS`]); the exact op serves every
    /// other size. The CPU backend runs a reference of the same rounding, not bit-equal to the
    /// CUDA kernels.
    ///
    /// `q`, `k`, `v` and `out` may each be f32 or bf16 (`lse` is f32): a bf16 input is the
    /// operand the op would round an f32 one to, taken as it is (no conversion pass on CUDA),
    /// and a bf16 `out` holds the f32 output rounded once (RNE), the operand a bf16 product of
    /// it would take.
    pub fn flash_attention(
        &mut self,
        q: View,
        k: View,
        v: View,
        out: View,
        lse: View,
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "flash_attention";
        spec.check_lens(
            WHAT,
            &[
                (q, Which::Q, "q"),
                (k, Which::Kv, "k"),
                (v, Which::Kv, "v"),
                (out, Which::Q, "out"),
            ],
            |v| f32_or_bf16(WHAT, v),
        )?;
        spec.check(WHAT, &[(lse, Which::Lse, "lse")])?;
        check_dim(WHAT, spec)?;
        on_cuda!(self, g => g.flash_attention([q, k, v], [out, lse], spec));
        let sp = *spec;
        self.host_op(WHAT, [q, k, v], [out, lse], |[qb, kb, vb], [ob, lb]| {
            let [qs, ks, vs] = [(qb, q), (kb, k), (vb, v)].map(|(b, x)| rounded(b, x.dtype()));
            let (mut os, mut ls) = (vec![0f32; out.len()], vec![0f32; lse.len()]);
            let g = Geo::new(&sp);
            let (qn, kn) = (g.seq * g.heads * g.hd, g.seq * g.kvh * g.hd);
            per_batch(
                sp.batch,
                [(&mut os, qn), (&mut ls, g.heads * g.seq)],
                |b, [o, l]| {
                    let kv = b * kn..(b + 1) * kn;
                    let x = [&qs[b * qn..(b + 1) * qn], &ks[kv.clone()], &vs[kv]];
                    forward_one(g, x, o, l);
                },
            );
            encode_f32(out.dtype(), &os, ob);
            encode_f32(DType::F32, &ls, lb);
            Ok(())
        })
    }

    /// The backward of [`Device::flash_attention`] from its `out` and `lse`, for `dout`, with
    /// [`Device::attention_backward`]'s signature and checks. With `q`, `k`, `v`, `out`, `dout`
    /// rounded to bf16: `D_i = Σ_d dout[i,d]·out[i,d]` (f32); `p_ij = exp(s_ij·scale − lse_i)`;
    /// `dp_ij = dout_i · v_j`; `ds_ij = p_ij·(dp_ij − D_i)`; `dq_i = scale · Σ_j bf16(ds_ij)·k_j`,
    /// `dk_j = scale · Σ_{h, i} bf16(ds_ij)·q_i`, `dv_j = Σ_{h, i} bf16(p_ij)·dout_i` (the query
    /// heads of `j`'s group, `i ≥ j`). Deterministic on both backends (no atomics). `q`, `k`,
    /// `v`, `out` and `dout` may each be f32 or bf16, as in the forward; `lse` and the
    /// gradients are f32.
    #[allow(clippy::too_many_arguments)] // the exact op's signature: five inputs, three gradients
    pub fn flash_attention_backward(
        &mut self,
        q: View,
        k: View,
        v: View,
        out: View,
        lse: View,
        dout: View,
        dq: View,
        dk: View,
        dv: View,
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "flash_attention_backward";
        spec.check_lens(
            WHAT,
            &[
                (q, Which::Q, "q"),
                (k, Which::Kv, "k"),
                (v, Which::Kv, "v"),
                (out, Which::Q, "out"),
                (dout, Which::Q, "dout"),
            ],
            |v| f32_or_bf16(WHAT, v),
        )?;
        spec.check(
            WHAT,
            &[
                (lse, Which::Lse, "lse"),
                (dq, Which::Q, "dq"),
                (dk, Which::Kv, "dk"),
                (dv, Which::Kv, "dv"),
            ],
        )?;
        check_dim(WHAT, spec)?;
        on_cuda!(self, g => g.flash_attention_backward(
            [q, k, v, out, lse, dout], [dq, dk, dv], spec));
        let sp = *spec;
        self.host_op(
            WHAT,
            [q, k, v, out, lse, dout],
            [dq, dk, dv],
            |[qb, kb, vb, ob, lb, dob], [dqb, dkb, dvb]| {
                let [qs, ks, vs, os, dos] = [(qb, q), (kb, k), (vb, v), (ob, out), (dob, dout)]
                    .map(|(b, x)| rounded(b, x.dtype()));
                let ls = decode_f32(DType::F32, lb);
                let g = Geo::new(&sp);
                let (qn, kn, ln) = (
                    g.seq * g.heads * g.hd,
                    g.seq * g.kvh * g.hd,
                    g.heads * g.seq,
                );
                // D per (b, h, i), in the lse layout.
                let mut dd = vec![0f32; ls.len()];
                for b in 0..sp.batch {
                    for h in 0..g.heads {
                        for i in 0..g.seq {
                            let r = g.qr(i, h);
                            let (o, d) = (&os[b * qn..][r.clone()], &dos[b * qn..][r]);
                            dd[b * ln + h * g.seq + i] = dot(d, o);
                        }
                    }
                }
                let mut dqs = vec![0f32; dq.len()];
                let (mut dks, mut dvs) = (vec![0f32; dk.len()], vec![0f32; dv.len()]);
                per_batch(
                    sp.batch,
                    [(&mut dqs, qn), (&mut dks, kn), (&mut dvs, kn)],
                    |b, [dqo, dko, dvo]| {
                        let kv = b * kn..(b + 1) * kn;
                        let x = BwdIn {
                            q: &qs[b * qn..(b + 1) * qn],
                            k: &ks[kv.clone()],
                            v: &vs[kv],
                            lse: &ls[b * ln..(b + 1) * ln],
                            dout: &dos[b * qn..(b + 1) * qn],
                            dd: &dd[b * ln..(b + 1) * ln],
                        };
                        backward_one(g, &x, dqo, dko, dvo);
                    },
                );
                encode_f32(DType::F32, &dqs, dqb);
                encode_f32(DType::F32, &dks, dkb);
                encode_f32(DType::F32, &dvs, dvb);
                Ok(())
            },
        )
    }
}
