//! The Newton–Schulz orthogonalization of one matrix on device ops: PyTorch's
//! `torch.optim._muon._zeropower_via_newtonschulz` (2.9+) with `lowbit-device`'s `matmul`
//! (deterministic f32 sums, no FMA), `scale`, `axpy` and `cast`, so it runs on every backend
//! with the same bits.
//!
//! PyTorch, for `G` of `rows x cols`:
//! ```text
//! X = G.to(ns_dtype);  X = Xᵀ if rows > cols
//! X /= max(‖X‖_F, eps)
//! repeat ns_steps:  A = X·Xᵀ;  B = b·A + c·A·A;  X = a·X + B·X      (addmm, one rounding each)
//! X = Xᵀ if rows > cols
//! ```
//! Here the transposes are never materialized: a tall matrix (`rows > cols`) keeps its stored
//! orientation `Y = Xᵀ` and runs the transposed recurrence `A = Yᵀ·Y`, `Y = a·Y + Y·B` (`A`, and
//! so `B`, are symmetric bit for bit: element `(i, j)` and `(j, i)` sum the same products in the
//! same order). With this crate's matmul that is bitwise the transpose of PyTorch's recurrence
//! run on an explicit transpose, since every element sums the same products in the same order.
//!
//! Roundings, per NS dtype (`bf16` is what `torch.optim.Muon` does; `f32` is the same algorithm
//! with the cast to bf16 left out):
//! - the input is rounded once to the NS dtype (`cast`, round to nearest even);
//! - the norm is `sqrt` of the f64 sum of squares (`sum_squares`), rounded to f32 and, in bf16
//!   mode, to bf16 (PyTorch's `norm` of a bf16 tensor is a bf16 scalar), clamped to `eps`
//!   rounded the same way; `X` is multiplied by `fl32(1 / norm)` and rounded to the NS dtype
//!   (PyTorch divides: the two differ by at most one f32 rounding before the bf16 one);
//! - every GEMM sums in f32 and is rounded once to the NS dtype after the `addmm` terms are
//!   added in f32: `A = r(X·Xᵀ)`, `B = r(fl(c·(A·A)) + fl(b·A))`, `X = r(fl(B·X) + fl(a·X))`,
//!   which is what PyTorch's CPU bf16 GEMMs do (f32 accumulation, one rounding; measured with
//!   PyTorch 2.13 when the goldens were made). Only the summation order differs.
//!
//! Cost per NS step for a matrix `s x l` (`s = min(rows, cols)`, `l = max(rows, cols)`): three
//! GEMMs, `s·s·l + s·s·s + s·s·l` multiply-adds, plus `O(s·l)` element-wise ops.
//!
//! **Fast mode** ([`NsMode::Fast`] on a CUDA device): the same recurrence with the bf16 mode's
//! roundings on `Device::matmul_tc` (cuBLASLt, bf16 inputs, f32 accumulation), each GEMM with
//! its `addmm` term in the epilogue and the result written straight to bf16:
//! `A = r(X·Xᵀ)`, `B = r(c·(A·Aᵀ) + b·A)`, `X' = r(B·X + a·X)` (tall: `Y' = r(Y·B + a·Y)`), `X`
//! and `X'` ping-ponging. `A` and `B` are symmetric, so the first two GEMMs are symmetric
//! products (`MatmulTcSpec::symmetric`; `A·A = A·Aᵀ`), which the backend computes by blocks at
//! three quarters of the cost. The cast, the norm and the scaling before the loop are the exact
//! mode's ops. On the CPU backend the scratch is built for the exact mode instead.

use lowbit_device::{DType, Device, DeviceKind, MatmulSpec, MatmulTcSpec, View, bf16};

use super::{NsDtype, NsMode};
use crate::error::Result;

/// Device scratch for one Newton–Schulz run, sized for the largest matrix of an optimizer.
#[derive(Debug)]
pub(super) struct NsScratch {
    dtype: NsDtype,
    /// The fast mode's tensor-core GEMMs (only on a CUDA device).
    fast: bool,
    /// The iterate `X` in the NS dtype (`max rows·cols`).
    x: View,
    /// f32: the next iterate `B·X + a·X` before its rounding (in f32 mode, the other half of a
    /// ping-pong with `x`). Fast mode: bf16, the other half of the ping-pong.
    x_next: View,
    /// f32 `s·s`: the Gram matrix `A` as summed (fast mode: bf16, `gram_ns` itself).
    gram: View,
    /// `A` in the NS dtype (bf16 mode; `gram` itself in f32 mode).
    gram_ns: View,
    /// f32 `s·s`: `A·A`, then `B` (fast mode: bf16 `B`, `poly_ns` itself).
    poly: View,
    /// `B` in the NS dtype (bf16 mode; `poly` itself in f32 mode).
    poly_ns: View,
}

/// The Newton–Schulz hyper-parameters of one run.
#[derive(Clone, Copy, Debug)]
pub(super) struct NsParams {
    pub(super) steps: u32,
    pub(super) coefficients: [f32; 3],
    pub(super) eps: f32,
}

impl NsScratch {
    /// Scratch for matrices of at most `max_len` elements whose smaller side is at most
    /// `max_side`, for `mode` on this device (fast mode only on CUDA; the config was
    /// validated, so fast mode comes with bf16).
    pub(super) fn new(
        dev: &mut Device,
        dtype: NsDtype,
        mode: NsMode,
        max_len: usize,
        max_side: usize,
    ) -> Self {
        let ns = dtype.device_dtype();
        let sq = max_side * max_side;
        if mode == NsMode::Fast && dev.kind() == DeviceKind::Cuda {
            let [x, x_next] = [0; 2].map(|_| dev.alloc(DType::Bf16, max_len));
            let [gram, poly] = [0; 2].map(|_| dev.alloc(DType::Bf16, sq));
            return NsScratch {
                dtype,
                fast: true,
                x,
                x_next,
                gram,
                gram_ns: gram,
                poly,
                poly_ns: poly,
            };
        }
        let x = dev.alloc(ns, max_len);
        let x_next = dev.alloc(DType::F32, max_len);
        let gram = dev.alloc(DType::F32, sq);
        let poly = dev.alloc(DType::F32, sq);
        let (gram_ns, poly_ns) = match dtype {
            NsDtype::F32 => (gram, poly),
            NsDtype::Bf16 => (dev.alloc(ns, sq), dev.alloc(ns, sq)),
        };
        NsScratch {
            dtype,
            fast: false,
            x,
            x_next,
            gram,
            gram_ns,
            poly,
            poly_ns,
        }
    }

    /// Whether this scratch runs the fast mode (fast mode on a CUDA device).
    pub(super) fn is_fast(&self) -> bool {
        self.fast
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        let mut n = self.x.byte_len() + self.x_next.byte_len();
        n += self.gram.byte_len() + self.poly.byte_len();
        if self.gram_ns != self.gram {
            n += self.gram_ns.byte_len();
        }
        if self.poly_ns != self.poly {
            n += self.poly_ns.byte_len();
        }
        n
    }

    /// Orthogonalizes the f32 `rows x cols` matrix `g` (row-major; not modified) and returns
    /// the view of the result, `rows x cols` in the NS dtype, valid until the next call.
    pub(super) fn orthogonalize(
        &self,
        dev: &mut Device,
        g: View,
        rows: usize,
        cols: usize,
        p: NsParams,
    ) -> Result<View> {
        let len = rows * cols;
        let side = rows.min(cols);
        let wide = rows <= cols;
        let mut x = self.x.slice(0..len)?;
        let mut x_next = self.x_next.slice(0..len)?;
        let sq = side * side;
        let (gram, gram_ns) = (self.gram.slice(0..sq)?, self.gram_ns.slice(0..sq)?);
        let (poly, poly_ns) = (self.poly.slice(0..sq)?, self.poly_ns.slice(0..sq)?);
        let [a, b, c] = p.coefficients;

        dev.cast(g, x)?;
        let norm = self.dtype.round(dev.sum_squares(x)?.sqrt() as f32);
        let eps = self.dtype.round(p.eps);
        // PyTorch's `clamp(min=eps)`: a NaN norm stays NaN.
        let norm = if norm < eps { eps } else { norm };
        dev.scale(x, (1.0 / f64::from(norm)) as f32)?;
        if self.fast {
            return fast_steps(dev, [x, x_next, gram, poly], rows, cols, p);
        }

        // A = X·Xᵀ (wide) or Yᵀ·Y (tall, Y = Xᵀ stored as is): s x s, contracted over l.
        let gram_spec = MatmulSpec {
            m: side,
            n: side,
            k: rows.max(cols),
            trans_a: !wide,
            trans_b: wide,
            accumulate: false,
        };
        let square = MatmulSpec {
            m: side,
            n: side,
            k: side,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        // B·X (wide: s x l) or Y·B (tall: l x s).
        let update_spec = MatmulSpec {
            m: rows,
            n: cols,
            k: side,
            trans_a: false,
            trans_b: false,
            accumulate: false,
        };
        for _ in 0..p.steps {
            dev.matmul(x, x, gram, &gram_spec)?;
            if gram_ns != gram {
                dev.cast(gram, gram_ns)?;
            }
            dev.matmul(gram_ns, gram_ns, poly, &square)?;
            dev.scale(poly, c)?;
            dev.axpy(b, gram_ns, poly)?;
            if poly_ns != poly {
                dev.cast(poly, poly_ns)?;
            }
            if wide {
                dev.matmul(poly_ns, x, x_next, &update_spec)?;
            } else {
                dev.matmul(x, poly_ns, x_next, &update_spec)?;
            }
            dev.axpy(a, x, x_next)?;
            match self.dtype {
                NsDtype::Bf16 => dev.cast(x_next, x)?,
                NsDtype::F32 => std::mem::swap(&mut x, &mut x_next),
            }
        }
        Ok(x)
    }
}

/// The fast mode's iterations on bf16 `[x, x_next, gram, poly]` (see the module docs);
/// returns the view holding the result.
fn fast_steps(
    dev: &mut Device,
    [mut x, mut x_next, gram, poly]: [View; 4],
    rows: usize,
    cols: usize,
    p: NsParams,
) -> Result<View> {
    let side = rows.min(cols);
    let wide = rows <= cols;
    let [a, b, c] = p.coefficients;
    // A = X·Xᵀ (wide) or Yᵀ·Y (tall), symmetric.
    let gram_spec = MatmulTcSpec {
        trans_a: !wide,
        trans_b: wide,
        symmetric: true,
        ..MatmulTcSpec::new(side, side, rows.max(cols))
    };
    // B = c·A·Aᵀ + b·A (A is symmetric, so A·Aᵀ = A·A and B is symmetric).
    let poly_spec = MatmulTcSpec {
        trans_b: true,
        alpha: c,
        beta: b,
        symmetric: true,
        ..MatmulTcSpec::new(side, side, side)
    };
    // X' = B·X + a·X (wide) or Y' = Y·B + a·Y (tall).
    let update_spec = MatmulTcSpec {
        beta: a,
        ..MatmulTcSpec::new(rows, cols, side)
    };
    for _ in 0..p.steps {
        dev.matmul_tc(x, x, None, gram, &gram_spec)?;
        dev.matmul_tc(gram, gram, Some(gram), poly, &poly_spec)?;
        if wide {
            dev.matmul_tc(poly, x, Some(x), x_next, &update_spec)?;
        } else {
            dev.matmul_tc(x, poly, Some(x), x_next, &update_spec)?;
        }
        std::mem::swap(&mut x, &mut x_next);
    }
    Ok(x)
}

impl NsDtype {
    pub(super) fn device_dtype(self) -> DType {
        match self {
            NsDtype::F32 => DType::F32,
            NsDtype::Bf16 => DType::Bf16,
        }
    }

    /// `v` rounded to this dtype (round to nearest even), as f32.
    fn round(self, v: f32) -> f32 {
        match self {
            NsDtype::F32 => v,
            NsDtype::Bf16 => bf16::from_f32(v).to_f32(),
        }
    }
}
