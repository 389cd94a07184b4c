//! Causal grouped-query attention in the exact mode: the forward keeps the per-row log-sum-exp
//! (`lse`) instead of the `[seq, seq]` probabilities, the backward recomputes the scores from it
//! (the FlashAttention-2 recomputation, Dao 2023, "FlashAttention-2", Algorithm 2, without the
//! tiling: every sum runs sequentially in the index order the op documents).
//!
//! Layouts: `q`, `out` are `[batch, seq, heads, head_dim]`, `k`, `v` `[batch, seq, kv_heads,
//! head_dim]` (what `x·Wᵀ` of the projections gives, head-major), `lse` `[batch, heads, seq]`.
//! Query head `h` reads kv head `h / (heads / kv_heads)`, as Hugging Face's `repeat_kv`.
//!
//! Every product and sum is rounded to f32 (no fused multiply-add), sums start from `+0` and
//! run in index order, `exp`/`ln` are evaluated in f64 and rounded to f32, so the CUDA kernels
//! (`crates/lowbit-kernels/attention.cu`) reproduce the CPU bytes exactly. The CPU backend
//! splits the batch over threads; every output element is computed by one thread in the fixed
//! order, so the bytes do not depend on the thread count.

use super::invalid;
use crate::cpu::{decode_f32, encode_f32};
use crate::{DType, Device, Result, View, check_dtype};

/// The largest `head_dim` the ops accept: the CUDA kernels keep a query row and an accumulator
/// row per thread in local arrays of this size.
pub const ATTENTION_MAX_HEAD_DIM: usize = 256;

/// Shape and scale of a causal grouped-query attention ([`Device::attention`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Sequences in the batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads; `heads` must be a multiple of it.
    pub kv_heads: usize,
    /// Values per head, `1..=ATTENTION_MAX_HEAD_DIM`.
    pub head_dim: usize,
    /// The factor of the scores (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
}

/// The lengths of a checked spec: `(q/out elements, k/v elements, lse elements)`.
pub(crate) type AttentionLens = (usize, usize, usize);

impl AttentionSpec {
    /// Checks the spec and returns the view lengths it implies.
    fn lens(&self, what: &'static str) -> Result<AttentionLens> {
        let AttentionSpec {
            batch,
            seq,
            heads,
            kv_heads,
            head_dim,
            ..
        } = *self;
        if head_dim == 0 || head_dim > ATTENTION_MAX_HEAD_DIM {
            return Err(invalid(
                what,
                format!("head_dim {head_dim} is not in 1..={ATTENTION_MAX_HEAD_DIM}"),
            ));
        }
        if heads == 0 || kv_heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(invalid(
                what,
                format!("{heads} query heads are not a positive multiple of {kv_heads} kv heads"),
            ));
        }
        let prod = |xs: &[usize]| {
            xs.iter()
                .try_fold(1usize, |a, &x| a.checked_mul(x))
                .ok_or_else(|| invalid(what, format!("the shape {self:?} overflows usize")))
        };
        Ok((
            prod(&[batch, seq, heads, head_dim])?,
            prod(&[batch, seq, kv_heads, head_dim])?,
            prod(&[batch, heads, seq])?,
        ))
    }

    /// Checks dtypes (all f32) and lengths of the views, in `(view, expected length, name)`.
    pub(crate) fn check(&self, what: &'static str, views: &[(View, Which, &str)]) -> Result<()> {
        self.check_lens(what, views, |v| check_dtype(what, v, DType::F32))
    }

    /// The lengths of [`AttentionSpec::check`], each view's dtype checked by `dtype`.
    pub(crate) fn check_lens(
        &self,
        what: &'static str,
        views: &[(View, Which, &str)],
        dtype: impl Fn(View) -> Result<()>,
    ) -> Result<()> {
        let (qn, kn, ln) = self.lens(what)?;
        for &(v, which, name) in views {
            dtype(v)?;
            let want = match which {
                Which::Q => qn,
                Which::Kv => kn,
                Which::Lse => ln,
            };
            if v.len() != want {
                return Err(invalid(
                    what,
                    format!(
                        "{name} has {} elements, the shape {self:?} needs {want}",
                        v.len()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Which shape a view has.
#[derive(Clone, Copy)]
pub(crate) enum Which {
    /// `[batch, seq, heads, head_dim]`.
    Q,
    /// `[batch, seq, kv_heads, head_dim]`.
    Kv,
    /// `[batch, heads, seq]`.
    Lse,
}

/// `fl32(exp(x))` via f64.
fn exp32(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

/// `fl32(ln(x))` via f64.
fn ln32(x: f32) -> f32 {
    f64::from(x).ln() as f32
}

/// `Σ_d a[d]·b[d]` from `+0` in index order, each product rounded.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (x, y)| s + x * y)
}

/// Index arithmetic of one batch element (`[seq, heads|kv_heads, head_dim]` rows).
#[derive(Clone, Copy)]
struct Geo {
    seq: usize,
    heads: usize,
    kv_heads: usize,
    hd: usize,
    scale: f32,
}

impl Geo {
    fn new(s: &AttentionSpec) -> Geo {
        Geo {
            seq: s.seq,
            heads: s.heads,
            kv_heads: s.kv_heads,
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
        let o = (j * self.kv_heads + g) * self.hd;
        o..o + self.hd
    }
    /// Query heads per kv head.
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    /// The score `s_ij = (q_i · k_j) · scale`.
    #[inline]
    fn score(&self, q: &[f32], k: &[f32], i: usize, j: usize, h: usize) -> f32 {
        dot(&q[self.qr(i, h)], &k[self.kr(j, h / self.group())]) * self.scale
    }
}

/// The forward of one batch element: `q`, `out` `[seq, heads, hd]`, `k`, `v` `[seq, kv_heads,
/// hd]`, `lse` `[heads, seq]`.
fn forward_one(g: Geo, [q, k, v]: [&[f32]; 3], out: &mut [f32], lse: &mut [f32]) {
    let mut s = vec![0f32; g.seq];
    let mut acc = vec![0f32; g.hd];
    for h in 0..g.heads {
        let kvh = h / g.group();
        for i in 0..g.seq {
            let mut m = f32::NEG_INFINITY;
            for (j, sj) in s[..=i].iter_mut().enumerate() {
                *sj = g.score(q, k, i, j, h);
                // `>` rather than `max`: NaN scores never become the maximum, identically on
                // every backend.
                if *sj > m {
                    m = *sj;
                }
            }
            let mut l = 0f32;
            acc.fill(0.0);
            for (j, &sj) in s[..=i].iter().enumerate() {
                let e = exp32(sj - m);
                l += e;
                for (a, vv) in acc.iter_mut().zip(&v[g.kr(j, kvh)]) {
                    *a += e * vv;
                }
            }
            for (o, a) in out[g.qr(i, h)].iter_mut().zip(&acc) {
                *o = a / l;
            }
            lse[h * g.seq + i] = m + ln32(l);
        }
    }
}

/// The inputs of one batch element's backward.
struct BwdIn<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    out: &'a [f32],
    lse: &'a [f32],
    dout: &'a [f32],
}

impl BwdIn<'_> {
    /// `(p_ij, ds_ij)` for query row `i` of head `h` and key row `j ≤ i`, `dd` = `D_i`.
    #[inline]
    fn p_ds(&self, g: &Geo, i: usize, j: usize, h: usize, dd: f32) -> (f32, f32) {
        let s = g.score(self.q, self.k, i, j, h);
        let p = exp32(s - self.lse[h * g.seq + i]);
        let dp = dot(&self.dout[g.qr(i, h)], &self.v[g.kr(j, h / g.group())]);
        (p, (p * (dp - dd)) * g.scale)
    }
}

/// The backward of one batch element into `dq` `[seq, heads, hd]`, `dk`, `dv` `[seq,
/// kv_heads, hd]`.
fn backward_one(g: Geo, x: &BwdIn<'_>, dq: &mut [f32], dk: &mut [f32], dv: &mut [f32]) {
    // D_i = Σ_d dout[i,d]·out[i,d], per (h, i).
    let mut dd = vec![0f32; g.heads * g.seq];
    for h in 0..g.heads {
        for i in 0..g.seq {
            dd[h * g.seq + i] = dot(&x.dout[g.qr(i, h)], &x.out[g.qr(i, h)]);
        }
    }
    // The dQ pass, per query row.
    for h in 0..g.heads {
        let kvh = h / g.group();
        for i in 0..g.seq {
            let row = &mut dq[g.qr(i, h)];
            row.fill(0.0);
            for j in 0..=i {
                let (_, ds) = x.p_ds(&g, i, j, h, dd[h * g.seq + i]);
                for (a, kk) in row.iter_mut().zip(&x.k[g.kr(j, kvh)]) {
                    *a += ds * kk;
                }
            }
        }
    }
    // The dK/dV pass, per key row: the group's query heads in increasing order, then the query
    // rows i ≥ j in increasing order, into one running sum.
    for kvh in 0..g.kv_heads {
        for j in 0..g.seq {
            let r = g.kr(j, kvh);
            let (dkr, dvr) = (&mut dk[r.clone()], &mut dv[r]);
            dkr.fill(0.0);
            dvr.fill(0.0);
            for h in kvh * g.group()..(kvh + 1) * g.group() {
                for i in j..g.seq {
                    let (p, ds) = x.p_ds(&g, i, j, h, dd[h * g.seq + i]);
                    let (qi, doi) = (&x.q[g.qr(i, h)], &x.dout[g.qr(i, h)]);
                    for d in 0..g.hd {
                        dkr[d] += ds * qi[d];
                        dvr[d] += p * doi[d];
                    }
                }
            }
        }
    }
}

/// Runs `f(b, part)` for every batch element `b` over the threads, each element's parts of
/// the outputs handed to exactly one call.
pub(crate) fn per_batch<const N: usize>(
    batch: usize,
    outs: [(&mut [f32], usize); N],
    f: impl Fn(usize, [&mut [f32]; N]) + Sync,
) {
    let threads = std::thread::available_parallelism()
        .map_or(1, usize::from)
        .min(batch);
    let mut items: Vec<(usize, [&mut [f32]; N])> = Vec::with_capacity(batch);
    let mut iters = outs.map(|(o, per)| o.chunks_mut(per.max(1)));
    for b in 0..batch {
        let parts = std::array::from_fn(|n| iters[n].next().unwrap_or_default());
        items.push((b, parts));
    }
    if threads < 2 {
        items.into_iter().for_each(|(b, p)| f(b, p));
        return;
    }
    let per = batch.div_ceil(threads);
    let f = &f;
    std::thread::scope(|sc| {
        let mut rest = items;
        while !rest.is_empty() {
            let tail = rest.split_off(per.min(rest.len()));
            let mine = std::mem::replace(&mut rest, tail);
            sc.spawn(move || mine.into_iter().for_each(|(b, p)| f(b, p)));
        }
    });
}

impl Device {
    /// Causal grouped-query attention. `q`, `out` `[batch, seq, heads, head_dim]`; `k`, `v`
    /// `[batch, seq, kv_heads, head_dim]`; `lse` f32 `[batch, heads, seq]`; all f32.
    /// `heads % kv_heads == 0`; query head `h` reads kv head `h / (heads / kv_heads)` (HF
    /// `repeat_kv`); `head_dim` in `1..=256`. Per `(b, h, i)`, in f32:
    /// `s_j = (Σ_d q[i,d]·k[j,d]) · scale` for `j` in `0..=i`; `m = max_j s_j` (NaN scores
    /// ignored); `e_j = exp32(s_j − m)`; `l = Σ_j e_j`; `out[i,d] = (Σ_j e_j · v[j,d]) / l`;
    /// `lse[i] = m + ln32(l)`. Sums from `+0` in index order. No `[seq, seq]` matrix is kept.
    /// `out` and `lse` must be disjoint and overlap no input.
    pub fn attention(
        &mut self,
        q: View,
        k: View,
        v: View,
        out: View,
        lse: View,
        spec: &AttentionSpec,
    ) -> Result<()> {
        const WHAT: &str = "attention";
        spec.check(
            WHAT,
            &[
                (q, Which::Q, "q"),
                (k, Which::Kv, "k"),
                (v, Which::Kv, "v"),
                (out, Which::Q, "out"),
                (lse, Which::Lse, "lse"),
            ],
        )?;
        on_cuda!(self, g => g.attention([q, k, v], [out, lse], spec));
        let sp = *spec;
        self.host_op(WHAT, [q, k, v], [out, lse], |[qb, kb, vb], [ob, lb]| {
            let [qs, ks, vs] = [qb, kb, vb].map(|b| decode_f32(DType::F32, b));
            let (mut os, mut ls) = (vec![0f32; out.len()], vec![0f32; lse.len()]);
            let g = Geo::new(&sp);
            let (qn, kn) = (g.seq * g.heads * g.hd, g.seq * g.kv_heads * g.hd);
            per_batch(
                sp.batch,
                [(&mut os, qn), (&mut ls, g.heads * g.seq)],
                |b, [o, l]| {
                    let qi = &qs[b * qn..(b + 1) * qn];
                    let (ki, vi) = (&ks[b * kn..(b + 1) * kn], &vs[b * kn..(b + 1) * kn]);
                    forward_one(g, [qi, ki, vi], o, l);
                },
            );
            encode_f32(DType::F32, &os, ob);
            encode_f32(DType::F32, &ls, lb);
            Ok(())
        })
    }

    /// The backward of [`Device::attention`] from its `out` and `lse`, for `dout` (the shape of
    /// `out`). Per `(b, h, i)`, in f32: `D_i = Σ_d dout[i,d]·out[i,d]`; for `j ≤ i`: `s_ij` as
    /// in the forward, `p_ij = exp32(s_ij − lse_i)`, `dp_ij = Σ_d dout[i,d]·v[j,d]`,
    /// `ds_ij = (p_ij · (dp_ij − D_i)) · scale`;
    /// `dq[i,d] = Σ_{j=0..=i} ds_ij · k[j,d]`;
    /// `dk[j,d]` = the sum over the query heads `h` of `j`'s kv group in increasing `h`, then
    /// `i = j..seq` in increasing `i`, of `ds_ij · q[i,d]` (one running sum from `+0`);
    /// `dv[j,d]` = the sum in the same order of `p_ij · dout[i,d]`.
    /// `dq`, `dk`, `dv` are overwritten; they must be disjoint and overlap no input.
    /// Deterministic: a dQ pass (per query row) and a dK/dV pass (per key row), no atomics.
    #[allow(clippy::too_many_arguments)] // the spec's signature: five inputs, three gradients
    pub fn attention_backward(
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
        const WHAT: &str = "attention_backward";
        spec.check(
            WHAT,
            &[
                (q, Which::Q, "q"),
                (k, Which::Kv, "k"),
                (v, Which::Kv, "v"),
                (out, Which::Q, "out"),
                (lse, Which::Lse, "lse"),
                (dout, Which::Q, "dout"),
                (dq, Which::Q, "dq"),
                (dk, Which::Kv, "dk"),
                (dv, Which::Kv, "dv"),
            ],
        )?;
        on_cuda!(self, g => g.attention_backward([q, k, v, out, lse, dout], [dq, dk, dv], spec));
        let sp = *spec;
        self.host_op(
            WHAT,
            [q, k, v, out, lse, dout],
            [dq, dk, dv],
            |ins, [dqb, dkb, dvb]| {
                let [qs, ks, vs, os, ls, dos] = ins.map(|b| decode_f32(DType::F32, b));
                let mut dqs = vec![0f32; dq.len()];
                let (mut dks, mut dvs) = (vec![0f32; dk.len()], vec![0f32; dv.len()]);
                let g = Geo::new(&sp);
                let (qn, kn, ln) = (
                    g.seq * g.heads * g.hd,
                    g.seq * g.kv_heads * g.hd,
                    g.heads * g.seq,
                );
                per_batch(
                    sp.batch,
                    [(&mut dqs, qn), (&mut dks, kn), (&mut dvs, kn)],
                    |b, [dqo, dko, dvo]| {
                        let x = BwdIn {
                            q: &qs[b * qn..(b + 1) * qn],
                            k: &ks[b * kn..(b + 1) * kn],
                            v: &vs[b * kn..(b + 1) * kn],
                            out: &os[b * qn..(b + 1) * qn],
                            lse: &ls[b * ln..(b + 1) * ln],
                            dout: &dos[b * qn..(b + 1) * qn],
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
