//! The ops of a Llama-style decoder other than attention: token embedding (and its scatter-add
//! backward), rotary position embedding, the SwiGLU gate and per-row softmax cross-entropy that
//! can overwrite its logits with their gradient.
//!
//! Activations are f32, row-major. Token ids and targets are f32 views holding integers (exact up
//! to 2^24, far above any vocabulary), validated on the host before any work: an id that is not
//! an integer in `0..vocab` is [`crate::DeviceError::Invalid`] naming the op and the row. Every
//! product and sum is rounded to f32 in the order each op documents (no fused multiply-add);
//! `exp` and `ln` are evaluated in f64 and rounded to f32, as in the model ops.

use super::{invalid, rows_of};
use crate::cpu::{decode_f32, decode_into, encode_f32};
use crate::{DType, Device, Result, View, check_dtype, check_float, check_len};

/// `fl32(exp(x))` via f64.
pub(crate) fn exp32(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

/// `fl32(ln(x))` via f64.
pub(crate) fn ln32(x: f32) -> f32 {
    f64::from(x).ln() as f32
}

/// Shape of a rotary embedding ([`Device::rope`]) over `x [rows, heads, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RopeSpec {
    /// Tokens per sequence: the position of row `r` is `r % seq`.
    pub seq: usize,
    /// Heads per row.
    pub heads: usize,
    /// Values per head (even; the first and second halves are rotated together).
    pub head_dim: usize,
    /// Apply the transposed (inverse) rotation: the backward of the forward rotation.
    pub inverse: bool,
}

/// Checks that every view is f32.
fn all_f32(what: &'static str, views: &[View]) -> Result<()> {
    views
        .iter()
        .try_for_each(|v| check_dtype(what, *v, DType::F32))
}

/// Reads integer ids from f32 values, each an integer in `0..n` (`kind` names them in errors).
pub(crate) fn int_ids(
    what: &'static str,
    kind: &str,
    vals: &[f32],
    n: usize,
) -> Result<Vec<usize>> {
    vals.iter()
        .enumerate()
        .map(|(r, &t)| {
            if t >= 0.0 && t.fract() == 0.0 && (t as usize) < n {
                Ok(t as usize)
            } else {
                Err(invalid(
                    what,
                    format!("{kind} {t} of row {r} is not an integer in 0..{n}"),
                ))
            }
        })
        .collect()
}

/// The shape of an embedding lookup or its backward: `ids` gives the rows, `per_row` (`out` or
/// `dy`) holds `rows·dim`, `table` holds `vocab·dim`. Returns `(dim, vocab)`; `dim` is 0 only for
/// zero rows.
fn embedding_shape(
    what: &'static str,
    ids: View,
    per_row: View,
    table: View,
) -> Result<(usize, usize)> {
    let rows = ids.len();
    if rows == 0 {
        check_len(what, per_row.len(), 0)?;
        return Ok((0, 0));
    }
    let dim = rows_of(what, per_row.len(), rows)?;
    if dim == 0 {
        return Err(invalid(what, "rows of zero width"));
    }
    let vocab = rows_of(what, table.len(), dim)?;
    Ok((dim, vocab))
}

/// Validated rotary-embedding geometry: `(rows, half, max_seq)`.
fn rope_shape(
    what: &'static str,
    x: View,
    y: View,
    cos: View,
    sin: View,
    spec: &RopeSpec,
) -> Result<(usize, usize, usize)> {
    all_f32(what, &[x, cos, sin])?;
    super::model::f32_or_bf16(what, y)?;
    check_len(what, x.len(), y.len())?;
    check_len(what, cos.len(), sin.len())?;
    let RopeSpec {
        seq,
        heads,
        head_dim,
        ..
    } = *spec;
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(invalid(
            what,
            format!("head_dim {head_dim} is not even and > 0"),
        ));
    }
    if heads == 0 || seq == 0 {
        return Err(invalid(
            what,
            format!("{heads} heads, seq {seq}: both must be > 0"),
        ));
    }
    let width = heads
        .checked_mul(head_dim)
        .ok_or_else(|| invalid(what, "heads · head_dim overflows"))?;
    let rows = rows_of(what, x.len(), width)?;
    let half = head_dim / 2;
    let max_seq = rows_of(what, cos.len(), half)?;
    if seq > max_seq {
        return Err(invalid(
            what,
            format!("seq {seq} exceeds the tables' {max_seq} positions"),
        ));
    }
    Ok((rows, half, max_seq))
}

/// The rotation of one head: `a = x[i]`, `b = x[i + half]` with the position's `c`, `s`.
#[inline]
fn rotate(x: &[f32], y: &mut [f32], c: &[f32], s: &[f32], inverse: bool) {
    let half = c.len();
    for i in 0..half {
        let (a, b) = (x[i], x[i + half]);
        let (ac, bs, bc, as_) = (a * c[i], b * s[i], b * c[i], a * s[i]);
        if inverse {
            y[i] = ac + bs;
            y[i + half] = bc - as_;
        } else {
            y[i] = ac - bs;
            y[i + half] = bc + as_;
        }
    }
}

/// Rotates every head of `xs` into `ys` (same length; may be the same buffer's copy).
fn rope_host(xs: &[f32], ys: &mut [f32], cos: &[f32], sin: &[f32], spec: &RopeSpec) {
    let (hd, half) = (spec.head_dim, spec.head_dim / 2);
    let width = spec.heads * hd;
    for (r, (xr, yr)) in xs
        .chunks_exact(width)
        .zip(ys.chunks_exact_mut(width))
        .enumerate()
    {
        let p = (r % spec.seq) * half;
        let (c, s) = (&cos[p..p + half], &sin[p..p + half]);
        for (xh, yh) in xr.chunks_exact(hd).zip(yr.chunks_exact_mut(hd)) {
            rotate(xh, yh, c, s, spec.inverse);
        }
    }
}

/// `silu(g)·u` in the documented order.
#[inline]
fn swiglu32(g: f32, u: f32) -> f32 {
    let sg = 1.0 / (1.0 + exp32(-g));
    (g * sg) * u
}

/// `(dgate, dup)` of [`swiglu32`] given `dout`.
#[inline]
fn swiglu_grad32(g: f32, u: f32, d: f32) -> (f32, f32) {
    let sg = 1.0 / (1.0 + exp32(-g));
    let dup = d * (g * sg);
    let dgate = ((d * u) * sg) * (1.0 + g * (1.0 - sg));
    (dgate, dup)
}

/// One row of softmax cross-entropy: the row loss, and with `grad = Some(c)` the row overwritten
/// with `c · (e_j / s − [j = t])`. `e` is scratch of the row's length.
fn xent_row(x: &mut [f32], t: usize, e: &mut [f32], grad: Option<f32>) -> f32 {
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for (e, &v) in e.iter_mut().zip(x.iter()) {
        *e = exp32(v - mx);
        s += *e;
    }
    let loss = -((x[t] - mx) - ln32(s));
    if let Some(c) = grad {
        for (j, (x, e)) in x.iter_mut().zip(e.iter()).enumerate() {
            let onehot = if j == t { 1.0 } else { 0.0 };
            *x = c * (e / s - onehot);
        }
    }
    loss
}

impl Device {
    /// Token embedding: `out[r, :] = f32(table[ids[r], :])`. `table` is any float dtype,
    /// `[vocab, dim]`; `ids` f32 `[rows]` (integers in `0..vocab`); `out` f32 `[rows, dim]`
    /// with `dim = out.len() / ids.len()` and `vocab = table.len() / dim`. `out` must overlap
    /// neither input. Fast mode (CUDA, [`crate::MatmulMode::Bf16`]): the same bytes, with the
    /// ids checked on the device as [`Device::cross_entropy_rows`]' targets are (a bad id's row
    /// NaN, the error reported by the next host read).
    pub fn embedding(&mut self, table: View, ids: View, out: View) -> Result<()> {
        const WHAT: &str = "embedding";
        check_float(WHAT, table)?;
        all_f32(WHAT, &[ids, out])?;
        let (dim, vocab) = embedding_shape(WHAT, ids, out, table)?;
        on_fast_cuda!(self, g => g.fast_embedding(table, ids, out, (dim, vocab)).map(|()| true));
        let id = int_ids(WHAT, "id", &self.read_f32(ids)?, vocab)?;
        on_cuda!(self, g => g.embedding(table, ids, out, dim));
        self.host_op(WHAT, [table, ids], [out], |[tb, _], [ob]| {
            let td = table.dtype();
            let row_bytes = dim * td.size();
            let mut row = vec![0f32; dim];
            for (&v, o) in id.iter().zip(ob.chunks_exact_mut(4 * dim.max(1))) {
                decode_into(td, &tb[v * row_bytes..(v + 1) * row_bytes], &mut row);
                encode_f32(DType::F32, &row, o);
            }
            Ok(())
        })
    }

    /// Embedding backward, a deterministic scatter-add: for each id `v` occurring in `ids`,
    /// `grad[v, :] ← grad[v, :] + s_v` with `s_v = Σ_{r: ids[r] = v} dy[r, :]` summed in f32 from
    /// `+0` in increasing `r`; rows of `grad` whose id does not occur are untouched. `ids` f32
    /// `[rows]`, `dy` f32 `[rows, dim]`, `grad` f32 `[vocab, dim]` (overlapping neither input).
    pub fn embedding_backward(&mut self, ids: View, dy: View, grad: View) -> Result<()> {
        const WHAT: &str = "embedding_backward";
        all_f32(WHAT, &[ids, dy, grad])?;
        let (dim, vocab) = embedding_shape(WHAT, ids, dy, grad)?;
        let id = int_ids(WHAT, "id", &self.read_f32(ids)?, vocab)?;
        on_cuda!(self, g => g.embedding_backward([ids, dy, grad], &id, dim));
        self.host_op(WHAT, [ids, dy], [grad], |[_, dyb], [gb]| {
            let dys = decode_f32(DType::F32, dyb);
            for (v, rows) in id_groups(&id) {
                let mut s = vec![0f32; dim];
                for &r in &rows {
                    s.iter_mut()
                        .zip(&dys[r * dim..(r + 1) * dim])
                        .for_each(|(s, d)| *s += *d);
                }
                let g = &mut gb[v * dim * 4..(v + 1) * dim * 4];
                let mut old = decode_f32(DType::F32, g);
                old.iter_mut().zip(&s).for_each(|(o, s)| *o += *s);
                encode_f32(DType::F32, &old, g);
            }
            Ok(())
        })
    }

    /// Rotary position embedding, rotate-half convention (Hugging Face Llama's
    /// `apply_rotary_pos_emb`), over `x [rows, heads, head_dim]`; the position of row `r` is
    /// `r % seq` and `half = head_dim / 2` (`head_dim` even). With `a = x[i]`, `b = x[i + half]`,
    /// `c = cos[pos·half + i]`, `s = sin[pos·half + i]` for `i < half`, each product rounded to
    /// f32, then the sum:
    /// - forward: `y[i] = a·c − b·s`, `y[i + half] = b·c + a·s`;
    /// - `inverse` (the backward, the transposed rotation): `y[i] = a·c + b·s`,
    ///   `y[i + half] = b·c − a·s`.
    ///
    /// `cos`, `sin` f32 `[max_seq, half]` with `seq ≤ max_seq`. `y` is `x` itself (the same
    /// view: in place) or disjoint from it; a disjoint `y` may be bf16 (each value the f32 one
    /// rounded once, as [`Device::cast`] rounds: the operand a bf16 product would take). Fast mode (CUDA, [`crate::MatmulMode::Bf16`]):
    /// four pairs a thread where `half % 4 == 0` and the views are 16-byte aligned; the same
    /// bits.
    pub fn rope(&mut self, x: View, y: View, cos: View, sin: View, spec: &RopeSpec) -> Result<()> {
        const WHAT: &str = "rope";
        rope_shape(WHAT, x, y, cos, sin, spec)?;
        on_fast_cuda!(self, g => g.fast_rope([x, y, cos, sin], spec));
        on_cuda!(self, g => g.rope([x, y, cos, sin], spec));
        let spec = *spec;
        if x == y {
            self.host_op(WHAT, [cos, sin], [y], |[cb, sb], [yb]| {
                let (c, s) = (decode_f32(DType::F32, cb), decode_f32(DType::F32, sb));
                let xs = decode_f32(DType::F32, yb);
                let mut ys = vec![0f32; xs.len()];
                rope_host(&xs, &mut ys, &c, &s, &spec);
                encode_f32(DType::F32, &ys, yb);
                Ok(())
            })
        } else {
            self.host_op(WHAT, [x, cos, sin], [y], |[xb, cb, sb], [yb]| {
                let (c, s) = (decode_f32(DType::F32, cb), decode_f32(DType::F32, sb));
                let xs = decode_f32(DType::F32, xb);
                let mut ys = vec![0f32; xs.len()];
                rope_host(&xs, &mut ys, &c, &s, &spec);
                encode_f32(y.dtype(), &ys, yb);
                Ok(())
            })
        }
    }

    /// SwiGLU's gate, `out = silu(gate) · up` per element in f32: `e = exp32(−g)`,
    /// `sg = 1 / (1 + e)`, `out = (g · sg) · u`. All f32 views of one length; `out` must
    /// overlap neither input; `out` may be bf16 instead (each value the f32 one rounded once,
    /// as [`Device::cast`] rounds: the operand a bf16 product would cast it to). Fast mode
    /// (CUDA, [`crate::MatmulMode::Bf16`]): float4 loads where the views are 16-byte aligned
    /// (also the backward); the same bits.
    pub fn swiglu(&mut self, gate: View, up: View, out: View) -> Result<()> {
        const WHAT: &str = "swiglu";
        all_f32(WHAT, &[gate, up])?;
        super::model::f32_or_bf16(WHAT, out)?;
        check_len(WHAT, gate.len(), up.len())?;
        check_len(WHAT, gate.len(), out.len())?;
        on_fast_cuda!(self, g => g.fast_swiglu(gate, up, None, [out, out]));
        on_cuda!(self, g => g.swiglu(gate, up, out));
        self.host_op(WHAT, [gate, up], [out], |[gb, ub], [ob]| {
            super::zip_into(
                (DType::F32, gb),
                (DType::F32, ub),
                (out.dtype(), ob),
                swiglu32,
            );
            Ok(())
        })
    }

    /// The backward of [`Device::swiglu`]: with `e`, `sg` as in the forward, per element in f32,
    /// `dup = dout · (g · sg)` and `dgate = ((dout · u) · sg) · (1 + g · (1 − sg))`. All f32
    /// views of one length (`dup` may be bf16: each value rounded once, as [`Device::cast`]
    /// rounds); `dgate` and `dup` are disjoint and overlap no input.
    pub fn swiglu_backward(
        &mut self,
        gate: View,
        up: View,
        dout: View,
        dgate: View,
        dup: View,
    ) -> Result<()> {
        const WHAT: &str = "swiglu_backward";
        all_f32(WHAT, &[gate, up, dout, dgate])?;
        super::model::f32_or_bf16(WHAT, dup)?;
        for v in [up, dout, dgate, dup] {
            check_len(WHAT, gate.len(), v.len())?;
        }
        on_fast_cuda!(self, g => g.fast_swiglu(gate, up, Some(dout), [dgate, dup]));
        on_cuda!(self, g => g.swiglu_backward([gate, up, dout], [dgate, dup]));
        self.host_op(
            WHAT,
            [gate, up, dout],
            [dgate, dup],
            |[gb, ub, db], [dgb, dub]| {
                let [g, u, d] = [gb, ub, db].map(|b| decode_f32(DType::F32, b));
                let (mut dg, mut du) = (vec![0f32; g.len()], vec![0f32; g.len()]);
                for i in 0..g.len() {
                    (dg[i], du[i]) = swiglu_grad32(g[i], u[i], d[i]);
                }
                encode_f32(DType::F32, &dg, dgb);
                encode_f32(dup.dtype(), &du, dub);
                Ok(())
            },
        )
    }

    /// Softmax cross-entropy of each row of `logits [rows, classes]` against `targets` (f32
    /// `[rows]`, integers in `0..classes`): `losses[r]` is the row loss of
    /// [`Device::softmax_cross_entropy`] (`mx = max x`, `e_j = exp32(x_j − mx)`, `s = Σ e_j` in
    /// index order, `−((x_t − mx) − ln32(s))`). With `grad = Some(c)` the logits are then
    /// overwritten in place with `c · (e_j / s − [j = t])` (their gradient, so a chunk of logits
    /// needs no second buffer). `losses` (f32 `[rows]`) overlaps neither `logits` nor `targets`;
    /// with `grad` the logits must not overlap the targets either.
    ///
    /// **Fast mode** (CUDA with [`crate::MatmulMode::Bf16`]; the CPU runs the above in both
    /// modes): a CTA (a warp below 4096 classes) per row, deterministic, differing from the CPU
    /// in the sum `s` only: an online `(max, Σ expf(x − max))` per thread over float4 loads,
    /// rescaled when its max grows, combined in a fixed tree. `mx`, `e_j`, the division and the
    /// gradient's formula are the exact ones. Tolerances (checked against f64 in
    /// `tests/cuda_fast.rs`): loss within `1e-5·(1 + |x_t − mx| + ln s)`, gradient elements
    /// within `|c|·(1e-5·p_j + 2e-7)` (`p_j` the softmax probability). NaN exactly where the
    /// exact op gives NaN (a NaN or +Inf logit, a row of −Inf). Targets are checked on the
    /// device, not read back: a bad one does not fail this call but writes NaN for its row's
    /// loss (and gradient) and is reported as [`crate::DeviceError::Invalid`] by the next host
    /// read of the device (a download, [`Device::synchronize`]).
    pub fn cross_entropy_rows(
        &mut self,
        logits: View,
        targets: View,
        losses: View,
        grad: Option<f32>,
    ) -> Result<()> {
        const WHAT: &str = "cross_entropy_rows";
        all_f32(WHAT, &[logits, targets, losses])?;
        let rows = targets.len();
        check_len(WHAT, losses.len(), rows)?;
        let classes = rows_of(WHAT, logits.len(), rows)?;
        on_fast_cuda!(self, g => g
            .fast_cross_entropy_rows([logits, targets, losses], classes, grad, None)
            .map(|()| true));
        let t = int_ids(WHAT, "target", &self.read_f32(targets)?, classes)?;
        on_cuda!(self, g => g.cross_entropy_rows([logits, targets, losses], classes, grad));
        let body = |x: &mut [f32], ls: &mut [u8]| {
            let mut e = vec![0f32; classes];
            let l: Vec<f32> = x
                .chunks_exact_mut(classes.max(1))
                .zip(&t)
                .map(|(xr, &t)| xent_row(xr, t, &mut e, grad))
                .collect();
            encode_f32(DType::F32, &l, ls);
        };
        match grad {
            Some(_) => self.host_op(WHAT, [targets], [logits, losses], |[_], [xb, lb]| {
                let mut x = decode_f32(DType::F32, xb);
                body(&mut x, lb);
                encode_f32(DType::F32, &x, xb);
                Ok(())
            }),
            None => self.host_op(WHAT, [logits, targets], [losses], |[xb, _], [lb]| {
                body(&mut decode_f32(DType::F32, xb), lb);
                Ok(())
            }),
        }
    }
}

impl Device {
    /// [`Device::cross_entropy_rows`] with `grad = Some(c)`, the gradient rounded once to bf16
    /// (RNE, as [`Device::cast`] rounds) into `dlogits` (bf16, `rows·classes`, overlapping no
    /// other view) instead of over the logits: the operand a bf16 product of the head's backward
    /// reads, which would round the f32 gradient the same way. The losses and `dlogits` are
    /// exactly those of `cross_entropy_rows` followed by a cast. The logits are consumed: the
    /// fast CUDA kernel leaves them as they were, every other path computes the f32 gradient
    /// over them first (so their contents afterwards are not part of the contract).
    pub fn cross_entropy_rows_bf16_grad(
        &mut self,
        logits: View,
        targets: View,
        losses: View,
        c: f32,
        dlogits: View,
    ) -> Result<()> {
        const WHAT: &str = "cross_entropy_rows_bf16_grad";
        all_f32(WHAT, &[logits, targets, losses])?;
        check_dtype(WHAT, dlogits, DType::Bf16)?;
        check_len(WHAT, dlogits.len(), logits.len())?;
        let rows = targets.len();
        check_len(WHAT, losses.len(), rows)?;
        let classes = rows_of(WHAT, logits.len(), rows)?;
        #[cfg(not(feature = "cuda"))]
        let _ = classes;
        if [logits, targets, losses]
            .iter()
            .any(|v| v.overlaps(&dlogits))
        {
            return Err(invalid(WHAT, "dlogits overlaps an input or the losses"));
        }
        on_fast_cuda!(self, g => g
            .fast_cross_entropy_rows([logits, targets, losses], classes, Some(c), Some(dlogits))
            .map(|()| true));
        self.cross_entropy_rows(logits, targets, losses, Some(c))?;
        self.cast(logits, dlogits)
    }
}

/// The rows of each distinct id, ids in increasing order and rows in increasing order.
pub(crate) fn id_groups(ids: &[usize]) -> Vec<(usize, Vec<usize>)> {
    let mut pairs: Vec<(usize, usize)> = ids.iter().copied().zip(0..).collect();
    pairs.sort_unstable();
    let mut groups: Vec<(usize, Vec<usize>)> = Vec::new();
    for (v, r) in pairs {
        match groups.last_mut() {
            Some((g, rows)) if *g == v => rows.push(r),
            _ => groups.push((v, vec![r])),
        }
    }
    groups
}
