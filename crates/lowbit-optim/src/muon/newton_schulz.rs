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

use lowbit_device::{DType, Device, MatmulSpec, View, bf16};

use super::NsDtype;
use crate::error::Result;

/// Device scratch for one Newton–Schulz run, sized for the largest matrix of an optimizer.
#[derive(Debug)]
pub(super) struct NsScratch {
    dtype: NsDtype,
    /// The iterate `X` in the NS dtype (`max rows·cols`).
    x: View,
    /// f32: the next iterate `B·X + a·X` before its rounding (in f32 mode, the other half of a
    /// ping-pong with `x`).
    x_next: View,
    /// f32 `s·s`: the Gram matrix `A` as summed.
    gram: View,
    /// `A` in the NS dtype (bf16 mode; `gram` itself in f32 mode).
    gram_ns: View,
    /// f32 `s·s`: `A·A`, then `B`.
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
    /// `max_side`.
    pub(super) fn new(dev: &mut Device, dtype: NsDtype, max_len: usize, max_side: usize) -> Self {
        let ns = dtype.device_dtype();
        let sq = max_side * max_side;
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
            x,
            x_next,
            gram,
            gram_ns,
            poly,
            poly_ns,
        }
    }

    /// Bytes held.
    pub(super) fn bytes(&self) -> usize {
        let mut n = self.x.byte_len() + self.x_next.byte_len();
        n += self.gram.byte_len() + self.poly.byte_len();
        if self.dtype == NsDtype::Bf16 {
            n += self.gram_ns.byte_len() + self.poly_ns.byte_len();
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
