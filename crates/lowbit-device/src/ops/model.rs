//! The ops of the small test model: bias, RMSNorm, GELU (tanh), MSE and softmax cross-entropy,
//! each forward with its backward. All views are f32; matrices are row-major `[rows, cols]`,
//! with the shape taken from the vector views (`cols` = the bias or weight length, `rows` = the
//! per-row view's length). Per-element math is f32 in the order each op documents (no fused
//! multiply-add). `tanh`, `exp` and `ln` are evaluated in f64 and rounded to f32, which makes
//! them (all but always) the correctly rounded f32 values, whatever the platform's f32 libm.

use super::{BlockedSum, invalid, map_into, rows_of, zip_into};
use crate::cpu::{decode_f32, encode_f32};
use crate::{DType, Device, Result, View, check_dtype, check_len};

/// `fl32(tanh(x))` via f64.
fn tanh32(x: f32) -> f32 {
    f64::from(x).tanh() as f32
}

/// `fl32(exp(x))` via f64.
fn exp32(x: f32) -> f32 {
    f64::from(x).exp() as f32
}

/// `fl32(ln(x))` via f64.
fn ln32(x: f32) -> f32 {
    f64::from(x).ln() as f32
}

/// PyTorch's `kBeta = M_SQRT2 · M_2_SQRTPI · 0.5` (= sqrt(2/π), evaluated in double) in f32.
const GELU_BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
/// PyTorch's `kKappa`.
const GELU_KAPPA: f32 = 0.044715;

/// GELU, tanh approximation, PyTorch's operation order:
/// `0.5·x·(1 + tanh(β·(x + κ·x³)))` with `x³ = (x·x)·x`.
fn gelu32(x: f32) -> f32 {
    let inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
    0.5 * x * (1.0 + tanh32(inner))
}

/// d gelu / dx times `dy`, PyTorch's `GeluBackward` (tanh) order.
fn gelu_grad32(x: f32, dy: f32) -> f32 {
    let x_sq = x * x;
    let inner = GELU_BETA * (x + GELU_KAPPA * (x_sq * x));
    let t = tanh32(inner);
    let left = 0.5 * x;
    let right = 1.0 + t;
    let left_derivative = 0.5 * right;
    let right_derivative = left * (1.0 - t * t) * (GELU_BETA * (1.0 + 3.0 * GELU_KAPPA * x_sq));
    dy * (left_derivative + right_derivative)
}

/// An output that may be f32 or bf16 (rounded once from the f32 result).
pub(crate) fn f32_or_bf16(what: &'static str, v: View) -> Result<()> {
    match v.dtype() {
        DType::F32 | DType::Bf16 => Ok(()),
        got => Err(crate::DeviceError::DType {
            what,
            expected: "f32 or bf16",
            got,
        }),
    }
}

/// Checks that every view is f32.
fn all_f32(what: &'static str, views: &[View]) -> Result<()> {
    views
        .iter()
        .try_for_each(|v| check_dtype(what, *v, DType::F32))
}

/// Reads class indices from an f32 view of `rows` values, each an integer in `0..classes`.
fn class_indices(what: &'static str, targets: &[f32], classes: usize) -> Result<Vec<usize>> {
    targets
        .iter()
        .enumerate()
        .map(|(r, &t)| {
            if t >= 0.0 && t.fract() == 0.0 && (t as usize) < classes {
                Ok(t as usize)
            } else {
                Err(invalid(
                    what,
                    format!("target {t} of row {r} is not a class index in 0..{classes}"),
                ))
            }
        })
        .collect()
}

/// Checks the shapes of a softmax cross-entropy: `targets` gives the rows, `logits` holds a
/// whole number of rows; returns `(rows, classes, class index per row)`.
fn xent_shape(dev: &Device, what: &'static str, logits: View, targets: View) -> Result<Shape> {
    all_f32(what, &[logits, targets])?;
    let rows = targets.len();
    let classes = if rows == 0 {
        rows_of(what, logits.len(), 0)?
    } else {
        rows_of(what, logits.len(), rows)?
    };
    let t = class_indices(what, &dev.read_f32(targets)?, classes)?;
    Ok((rows, classes, t))
}

type Shape = (usize, usize, Vec<usize>);

/// Softmax pieces of one row of logits: the row maximum `mx`, `e_j = exp(x_j − mx)` and their
/// sum in index order.
fn softmax_row(x: &[f32], e: &mut [f32]) -> (f32, f32) {
    let mx = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0f32;
    for (e, &v) in e.iter_mut().zip(x) {
        *e = exp32(v - mx);
        s += *e;
    }
    (mx, s)
}

impl Device {
    /// `x[r, c] ← x[r, c] + bias[c]` in place; `bias` (`cols`) must not overlap `x`.
    pub fn add_bias(&mut self, x: View, bias: View) -> Result<()> {
        const WHAT: &str = "add_bias";
        all_f32(WHAT, &[x, bias])?;
        rows_of(WHAT, x.len(), bias.len())?;
        on_cuda!(self, g => g.add_bias(x, bias));
        self.host_op(WHAT, [bias], [x], |[b], [xs]| {
            let b = decode_f32(DType::F32, b);
            let mut row = vec![0f32; b.len()];
            for xr in xs.chunks_exact_mut(4 * b.len().max(1)) {
                crate::cpu::decode_into(DType::F32, xr, &mut row);
                row.iter_mut().zip(&b).for_each(|(x, b)| *x += *b);
                encode_f32(DType::F32, &row, xr);
            }
            Ok(())
        })
    }

    /// Bias gradient: column sums `s[c] = Σ_r dy[r, c]` (f32, from 0, rows in order), then
    /// `dbias ← dbias + s` with `accumulate`, else `dbias ← s`. `dbias` (`cols`) must not
    /// overlap `dy`.
    pub fn bias_grad(&mut self, dy: View, dbias: View, accumulate: bool) -> Result<()> {
        const WHAT: &str = "bias_grad";
        all_f32(WHAT, &[dy, dbias])?;
        let cols = dbias.len();
        rows_of(WHAT, dy.len(), cols)?;
        on_cuda!(self, g => g.bias_grad(dy, dbias, accumulate));
        self.host_op(WHAT, [dy], [dbias], |[d], [db]| {
            let mut s = vec![0f32; cols];
            for row in decode_f32(DType::F32, d).chunks_exact(cols.max(1)) {
                s.iter_mut().zip(row).for_each(|(s, v)| *s += *v);
            }
            if accumulate {
                let old = decode_f32(DType::F32, db);
                s.iter_mut().zip(&old).for_each(|(s, o)| *s += *o);
            }
            encode_f32(DType::F32, &s, db);
            Ok(())
        })
    }

    /// RMSNorm over the rows of `x` (`rows·cols`, `cols` = `weight.len()`, `rows` =
    /// `rstd.len()`): per row, in f32, `ss = Σ x²` (index order), `rstd = 1 / sqrt(ss / cols +
    /// eps)`, `y = (x · rstd) · weight`; `rstd` is saved for the backward. `y` and `rstd` must be
    /// disjoint and overlap neither `x` nor `weight`. A non-empty `x` needs `cols > 0`. `y` is
    /// f32, or bf16: then each value is the f32 one rounded once (RNE, as [`Device::cast`]
    /// rounds), the operand a bf16 product would cast it to, without that pass.
    ///
    /// Fast mode (CUDA with [`crate::MatmulMode::Bf16`], up to 8192 columns; the CPU runs the
    /// above in both modes): a CTA per row, `ss` summed per thread then in a fixed tree, every
    /// other operation the exact one; `y` and `rstd` within `1e-5` relative of f64
    /// (`tests/cuda_fast.rs`), deterministic, NaN where the exact op gives NaN.
    pub fn rms_norm(&mut self, x: View, weight: View, y: View, rstd: View, eps: f32) -> Result<()> {
        const WHAT: &str = "rms_norm";
        all_f32(WHAT, &[x, weight, rstd])?;
        f32_or_bf16(WHAT, y)?;
        let cols = weight.len();
        check_len(WHAT, rows_of(WHAT, x.len(), cols)?, rstd.len())?;
        check_len(WHAT, x.len(), y.len())?;
        if cols == 0 && !rstd.is_empty() {
            return Err(invalid(WHAT, "rows of zero columns have no RMS"));
        }
        on_fast_cuda!(self, g => g.fast_rms_norm([x, weight], [y, rstd], eps));
        on_cuda!(self, g => g.rms_norm([x, weight], [y, rstd], eps));
        self.host_op(WHAT, [x, weight], [y, rstd], |[xb, wb], [yb, rb]| {
            let (xs, w) = (decode_f32(DType::F32, xb), decode_f32(DType::F32, wb));
            let mut ys = vec![0f32; xs.len()];
            let mut rs = vec![0f32; rstd.len()];
            for ((xr, yr), r) in xs
                .chunks_exact(cols.max(1))
                .zip(ys.chunks_exact_mut(cols.max(1)))
                .zip(&mut rs)
            {
                let ss = xr.iter().fold(0f32, |s, v| s + v * v);
                *r = 1.0 / (ss / cols as f32 + eps).sqrt();
                for ((y, x), w) in yr.iter_mut().zip(xr).zip(&w) {
                    *y = (x * *r) * w;
                }
            }
            encode_f32(y.dtype(), &ys, yb);
            encode_f32(DType::F32, &rs, rb);
            Ok(())
        })
    }

    /// RMSNorm backward from the saved `rstd`. Per row, in f32, with `x̂ = x·rstd` and
    /// `g = dy·weight`: `dot = Σ g·x̂` (index order), `dx = rstd · (g − x̂ · (dot / cols))`.
    /// The weight gradient is accumulated: `dweight[c] ← dweight[c] + Σ_r dy[r, c]·x̂[r, c]` (the
    /// sum from 0, rows in order; zero `dweight` first to overwrite). `dx` and `dweight` must be
    /// disjoint and overlap no input.
    ///
    /// Fast mode (CUDA with [`crate::MatmulMode::Bf16`], up to 8192 columns): a CTA per block of
    /// consecutive rows (at most 1024 blocks), `dot` in a fixed tree per row, the weight
    /// gradient as per-block column sums (rows in order) then the blocks added in a fixed tree
    /// before the one add into `dweight`; deterministic. Tolerances against f64: `dx` within
    /// `1e-5·rstd·(|g| + |x̂|·Σ|g·x̂|/cols)`, `dweight` within `1e-5·(|dweight₀| + Σ_r|dy·x̂|)`.
    pub fn rms_norm_backward(
        &mut self,
        x: View,
        weight: View,
        rstd: View,
        dy: View,
        dx: View,
        dweight: View,
    ) -> Result<()> {
        const WHAT: &str = "rms_norm_backward";
        all_f32(WHAT, &[x, weight, rstd, dy, dx, dweight])?;
        let cols = weight.len();
        check_len(WHAT, rows_of(WHAT, x.len(), cols)?, rstd.len())?;
        check_len(WHAT, x.len(), dy.len())?;
        check_len(WHAT, x.len(), dx.len())?;
        check_len(WHAT, cols, dweight.len())?;
        on_fast_cuda!(self, g => g.fast_rms_norm_backward([x, weight, rstd, dy], [dx, dweight]));
        on_cuda!(self, g => g.rms_norm_backward([x, weight, rstd, dy], [dx, dweight]));
        self.host_op(
            WHAT,
            [x, weight, rstd, dy],
            [dx, dweight],
            |[xb, wb, rb, dyb], [dxb, dwb]| {
                let [xs, w, rs, dys] = [xb, wb, rb, dyb].map(|b| decode_f32(DType::F32, b));
                let mut dxs = vec![0f32; xs.len()];
                let mut dw = vec![0f32; cols];
                let (mut xhat, mut g) = (vec![0f32; cols], vec![0f32; cols]);
                let c = cols.max(1);
                for (((xr, dyr), dxr), &r) in xs
                    .chunks_exact(c)
                    .zip(dys.chunks_exact(c))
                    .zip(dxs.chunks_exact_mut(c))
                    .zip(&rs)
                {
                    for j in 0..cols {
                        xhat[j] = xr[j] * r;
                        g[j] = dyr[j] * w[j];
                        dw[j] += dyr[j] * xhat[j];
                    }
                    let dot = g.iter().zip(&xhat).fold(0f32, |s, (g, xh)| s + g * xh);
                    let mean = dot / cols as f32;
                    for ((dx, g), xh) in dxr.iter_mut().zip(&g).zip(&xhat) {
                        *dx = r * (g - xh * mean);
                    }
                }
                let old = decode_f32(DType::F32, dwb);
                dw.iter_mut().zip(&old).for_each(|(s, o)| *s += *o);
                encode_f32(DType::F32, &dxs, dxb);
                encode_f32(DType::F32, &dw, dwb);
                Ok(())
            },
        )
    }

    /// `y = gelu(x)`, tanh approximation in PyTorch's order:
    /// `0.5·x·(1 + tanh(β·(x + κ·(x·x)·x)))`, `β = fl32(sqrt(2/π))`, `κ = 0.044715`. `y` must not
    /// overlap `x`.
    pub fn gelu(&mut self, x: View, y: View) -> Result<()> {
        const WHAT: &str = "gelu";
        all_f32(WHAT, &[x, y])?;
        check_len(WHAT, x.len(), y.len())?;
        on_cuda!(self, g => g.gelu(x, None, y, (GELU_BETA, GELU_KAPPA)));
        self.host_op(WHAT, [x], [y], |[xs], [ys]| {
            map_into((DType::F32, xs), (DType::F32, ys), gelu32);
            Ok(())
        })
    }

    /// `dx = dy · gelu'(x)` (tanh approximation, PyTorch's `gelu_backward` order:
    /// `dy · (0.5·(1 + t) + (0.5·x)·(1 − t·t)·(β·(1 + 3κ·x²)))`). `dx` must overlap neither
    /// input.
    pub fn gelu_backward(&mut self, x: View, dy: View, dx: View) -> Result<()> {
        const WHAT: &str = "gelu_backward";
        all_f32(WHAT, &[x, dy, dx])?;
        check_len(WHAT, x.len(), dy.len())?;
        check_len(WHAT, x.len(), dx.len())?;
        on_cuda!(self, g => g.gelu(x, Some(dy), dx, (GELU_BETA, GELU_KAPPA)));
        self.host_op(WHAT, [x, dy], [dx], |[xs, dys], [dxs]| {
            zip_into(
                (DType::F32, xs),
                (DType::F32, dys),
                (DType::F32, dxs),
                gelu_grad32,
            );
            Ok(())
        })
    }

    /// Mean squared error `Σ (pred − target)² / N`, with each difference and square in f64,
    /// summed in f64 in the blocked order of [`Device::sum_squares`] (blocks of 4096 in index
    /// order, the block sums of each run of 32 in index order, then the group sums in index
    /// order), divided by N in f64
    /// and rounded to f32. NaN for N = 0 (as PyTorch).
    pub fn mse_loss(&mut self, pred: View, target: View) -> Result<f32> {
        const WHAT: &str = "mse_loss";
        all_f32(WHAT, &[pred, target])?;
        check_len(WHAT, pred.len(), target.len())?;
        let n = pred.len() as f64;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut() {
            return Ok((g.mse_loss(pred, target)? / n) as f32);
        }
        let sum = self.host_op(WHAT, [pred, target], [], |[p, t], []| {
            let mut sum = BlockedSum::default();
            for (p, t) in p.as_chunks::<4>().0.iter().zip(t.as_chunks::<4>().0) {
                let d = f64::from(f32::from_le_bytes(*p)) - f64::from(f32::from_le_bytes(*t));
                sum.push(d * d);
            }
            Ok(sum.finish())
        })?;
        Ok((sum / n) as f32)
    }

    /// `dpred = c · (pred − target)` with `c = fl32(2·scale / N)` (computed in f64) and the
    /// difference and product in f32: the gradient of `scale · mse_loss`. `dpred` must overlap
    /// neither input.
    pub fn mse_loss_backward(
        &mut self,
        pred: View,
        target: View,
        dpred: View,
        scale: f32,
    ) -> Result<()> {
        const WHAT: &str = "mse_loss_backward";
        all_f32(WHAT, &[pred, target, dpred])?;
        check_len(WHAT, pred.len(), target.len())?;
        check_len(WHAT, pred.len(), dpred.len())?;
        let c = (2.0 * f64::from(scale) / pred.len() as f64) as f32;
        on_cuda!(self, g => g.mse_loss_backward([pred, target], dpred, c));
        self.host_op(WHAT, [pred, target], [dpred], |[p, t], [d]| {
            zip_into((DType::F32, p), (DType::F32, t), (DType::F32, d), |p, t| {
                c * (p - t)
            });
            Ok(())
        })
    }

    /// Mean softmax cross-entropy of `logits` (`rows·classes`) against `targets`, an f32 view of
    /// `rows` class indices (each an integer in `0..classes`, else
    /// [`crate::DeviceError::Invalid`]). Per row, in f32: `mx = max x`, `e_j = exp(x_j − mx)`,
    /// `s = Σ e_j` (index order), `loss = −((x_target − mx) − ln s)` (PyTorch's log-softmax
    /// then NLL, accurate for large logits); the row losses are summed in
    /// f64 in row order, divided by `rows` and rounded to f32. NaN for zero rows.
    pub fn softmax_cross_entropy(&mut self, logits: View, targets: View) -> Result<f32> {
        const WHAT: &str = "softmax_cross_entropy";
        let (rows, classes, t) = xent_shape(self, WHAT, logits, targets)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut() {
            let losses = g.softmax_cross_entropy_rows(logits, targets, classes)?;
            let total = losses.iter().fold(0f64, |s, &l| s + f64::from(l));
            return Ok((total / rows as f64) as f32);
        }
        let x = self.read_f32(logits)?;
        let mut e = vec![0f32; classes];
        let mut total = 0f64;
        for (xr, &t) in x.chunks_exact(classes.max(1)).zip(&t) {
            let (mx, s) = softmax_row(xr, &mut e);
            total += f64::from(-((xr[t] - mx) - ln32(s)));
        }
        Ok((total / rows as f64) as f32)
    }

    /// Gradient of `scale · softmax_cross_entropy` into `dlogits`: per element, in f32,
    /// `c · (e_j / s − [j = target])` with `e_j`, `s` as in the forward and `c = fl32(scale /
    /// rows)` (computed in f64). `dlogits` must overlap neither input.
    pub fn softmax_cross_entropy_backward(
        &mut self,
        logits: View,
        targets: View,
        dlogits: View,
        scale: f32,
    ) -> Result<()> {
        const WHAT: &str = "softmax_cross_entropy_backward";
        let (rows, classes, t) = xent_shape(self, WHAT, logits, targets)?;
        check_dtype(WHAT, dlogits, DType::F32)?;
        check_len(WHAT, logits.len(), dlogits.len())?;
        let c = (f64::from(scale) / rows as f64) as f32;
        on_cuda!(self, g => g.softmax_cross_entropy_backward([logits, targets, dlogits], classes, c));
        self.host_op(WHAT, [logits, targets], [dlogits], |[xb, _], [db]| {
            let x = decode_f32(DType::F32, xb);
            let mut d = vec![0f32; x.len()];
            let mut e = vec![0f32; classes];
            for ((xr, dr), &t) in x
                .chunks_exact(classes.max(1))
                .zip(d.chunks_exact_mut(classes.max(1)))
                .zip(&t)
            {
                let (_, s) = softmax_row(xr, &mut e);
                for (j, (d, e)) in dr.iter_mut().zip(&e).enumerate() {
                    let onehot = if j == t { 1.0 } else { 0.0 };
                    *d = c * (e / s - onehot);
                }
            }
            encode_f32(DType::F32, &d, db);
            Ok(())
        })
    }
}
