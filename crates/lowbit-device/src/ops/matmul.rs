//! The reference matrix product.

use super::shape_len;
use crate::cpu::{decode_f32, decode_into, encode_f32};
use crate::{DType, Device, MatmulSpec, Result, View, check_dtype, check_float, check_len};

/// `op(X)` as a row-major `[rows, cols]` f32 matrix, from `x` stored `[rows, cols]`, or
/// `[cols, rows]` when `trans`.
fn op_matrix(x: Vec<f32>, rows: usize, cols: usize, trans: bool) -> Vec<f32> {
    if !trans {
        return x;
    }
    let mut t = vec![0f32; x.len()];
    for (c, stored_row) in x.chunks_exact(rows.max(1)).enumerate().take(cols) {
        for (r, &v) in stored_row.iter().enumerate() {
            t[r * cols + c] = v;
        }
    }
    t
}

impl Device {
    /// `C[m, n] (+)= op(A)[m, k] · op(B)[k, n]` with f32 `c` (`m·n`) and `a` (`m·k`), `b`
    /// (`k·n`) of any float dtype, all row-major; `op` transposes when `spec.trans_a` /
    /// `spec.trans_b` say the operand is stored `[k, m]` / `[n, k]`.
    ///
    /// Each element is `s = ((0 + a₀b₀) + a₁b₁) + …` summed over k in index order in f32, every
    /// product rounded to f32 (no fused multiply-add); then `C ← C + s` with `spec.accumulate`,
    /// else `C ← s`. The loops run i, k, j for locality, which keeps each element's k order.
    /// `c` must overlap neither `a` nor `b`; `a` and `b` may overlap (e.g. `A·Aᵀ`).
    pub fn matmul(&mut self, a: View, b: View, c: View, spec: &MatmulSpec) -> Result<()> {
        const WHAT: &str = "matmul";
        let MatmulSpec { m, n, k, .. } = *spec;
        check_float(WHAT, a)?;
        check_float(WHAT, b)?;
        check_dtype(WHAT, c, DType::F32)?;
        check_len("matmul A (m·k)", a.len(), shape_len(WHAT, m, k)?)?;
        check_len("matmul B (k·n)", b.len(), shape_len(WHAT, k, n)?)?;
        check_len("matmul C (m·n)", c.len(), shape_len(WHAT, m, n)?)?;
        on_cuda!(self, g => g.matmul(a, b, c, spec));
        self.host_op(WHAT, [a, b], [c], |[ab, bb], [cb]| {
            let opa = op_matrix(decode_f32(a.dtype(), ab), m, k, spec.trans_a);
            let opb = op_matrix(decode_f32(b.dtype(), bb), k, n, spec.trans_b);
            let mut acc = vec![0f32; n];
            let mut old = vec![0f32; n];
            for (i, c_row) in cb.chunks_exact_mut(4 * n.max(1)).enumerate().take(m) {
                acc.fill(0.0);
                for (&aik, b_row) in opa[i * k..(i + 1) * k]
                    .iter()
                    .zip(opb.chunks_exact(n.max(1)))
                {
                    for (s, &bkj) in acc.iter_mut().zip(b_row) {
                        *s += aik * bkj;
                    }
                }
                if spec.accumulate {
                    decode_into(DType::F32, c_row, &mut old);
                    acc.iter_mut().zip(&old).for_each(|(s, c)| *s += *c);
                }
                encode_f32(DType::F32, &acc, c_row);
            }
            Ok(())
        })
    }
}
