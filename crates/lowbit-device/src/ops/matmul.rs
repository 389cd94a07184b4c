//! The reference matrix product ([`Device::matmul`]), the tensor-core product
//! ([`Device::matmul_tc`]), and the mode that routes the first through the second
//! ([`MatmulMode`]).

use super::{invalid, shape_len};
use crate::cpu::{decode_f32, decode_into, encode_f32};
use crate::{DType, Device, MatmulSpec, Result, View, check_dtype, check_float, check_len};

/// Shape and scalars of a tensor-core product `D[m, n] = alpha·op(A)·op(B) + beta·C`
/// ([`Device::matmul_tc`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MatmulTcSpec {
    /// Rows of D.
    pub m: usize,
    /// Columns of D.
    pub n: usize,
    /// Contraction length.
    pub k: usize,
    /// A is stored `[k, m]` and used transposed.
    pub trans_a: bool,
    /// B is stored `[n, k]` and used transposed.
    pub trans_b: bool,
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of C (must be 0 when no C is given).
    pub beta: f32,
    /// The caller states that the product is `op(A)·op(A)ᵀ` (`a` and `b` the same view,
    /// `trans_b = !trans_a`, `m = n`) and that C, if given, is symmetric: D is then symmetric,
    /// and for a bf16 D with an even `m` of at least 2048 the CUDA backend computes only the
    /// blocks on and above the diagonal of a 2x2 block split and mirrors the off-diagonal
    /// block (a quarter fewer multiply-adds; D exactly symmetric). With a C that is not
    /// symmetric, D's lower triangle is unspecified on CUDA.
    pub symmetric: bool,
}

impl MatmulTcSpec {
    /// `D = op(A)·op(B)` (`alpha` 1, `beta` 0, no transposes, not symmetric).
    pub fn new(m: usize, n: usize, k: usize) -> Self {
        MatmulTcSpec {
            m,
            n,
            k,
            trans_a: false,
            trans_b: false,
            alpha: 1.0,
            beta: 0.0,
            symmetric: false,
        }
    }
}

/// How [`Device::matmul`] computes (set per device with [`Device::set_matmul_mode`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MatmulMode {
    /// The reference arithmetic of [`Device::matmul`]: f32 products summed in index order, the
    /// same bits on every backend.
    #[default]
    Exact,
    /// Operands rounded to bf16 (RNE; a bf16 operand as it is) and multiplied by
    /// [`Device::matmul_tc`] into the f32 C (`accumulate`: `C ← op(A)·op(B) + C`): cuBLASLt on
    /// the tensor cores on CUDA, the same rounded operands summed in index order on the CPU. The
    /// fast mode of a model's GEMMs, as bf16 autocast computes them. On CUDA it also selects the
    /// fast kernels of the memory-bound model ops (`cross_entropy_rows`, `rms_norm` and its
    /// backward: deterministic, their sums in another association, within the tolerances their
    /// docs state; `rope`, `swiglu`, `embedding`: the same bits, faster), and ids and targets
    /// are then checked on the device (reported by the next host read).
    Bf16,
    /// [`MatmulMode::Bf16`] for [`Device::matmul`] and every fast kernel, and the mode in which
    /// a model's linear layers run their GEMMs in MXFP8 through [`Device::matmul_mx`] (the
    /// forward, data-gradient and weight-gradient products of TE's MXFP8 recipe; `lowbit_nn`'s
    /// `Linear` reads it). Attention, norms and the output head stay in bf16, as in TE.
    Mxfp8,
}

impl MatmulMode {
    /// Whether this is a fast mode ([`MatmulMode::Bf16`] or [`MatmulMode::Mxfp8`]): bf16
    /// tensor-core products and the fast kernels of the memory-bound ops.
    pub fn is_fast(self) -> bool {
        self != MatmulMode::Exact
    }
}

/// The float operands `a` (`m·k`), `b` (`k·n`) and the f32 output `c` (`m·n`) of a product.
fn check_operands(what: &'static str, a: View, b: View, c: View, spec: &MatmulSpec) -> Result<()> {
    let MatmulSpec { m, n, k, .. } = *spec;
    check_float(what, a)?;
    check_float(what, b)?;
    check_dtype(what, c, DType::F32)?;
    check_len("matmul A (m·k)", a.len(), shape_len(what, m, k)?)?;
    check_len("matmul B (k·n)", b.len(), shape_len(what, k, n)?)?;
    check_len("matmul C (m·n)", c.len(), shape_len(what, m, n)?)
}

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
        check_operands(WHAT, a, b, c, spec)?;
        if self.matmul_mode.is_fast() && k > 0 && m > 0 && n > 0 {
            let cin = spec.accumulate.then_some(c);
            return self.matmul_bf16(a, b, cin, c, spec);
        }
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

    /// `D = op(A)·op(B) + C`, a product with a residual added (`spec.accumulate` must be
    /// false; `c` and `d` f32 of `m·n`, `d` overlapping none of `a`, `b`, `c`). The bits of
    /// [`Device::matmul`] into `d` followed by [`Device::add`] of `c`: the exact mode does exactly
    /// that; the fast modes, whose products are [`Device::matmul`]'s bf16 GEMM, add `c` in its
    /// f32 epilogue (one rounding of `s + c`, as the add rounds it), which saves the add's pass
    /// over `d`.
    pub fn matmul_add(
        &mut self,
        a: View,
        b: View,
        c: View,
        d: View,
        spec: &MatmulSpec,
    ) -> Result<()> {
        const WHAT: &str = "matmul_add";
        let MatmulSpec { m, n, k, .. } = *spec;
        if spec.accumulate {
            return Err(invalid(
                WHAT,
                "the residual form does not accumulate into D",
            ));
        }
        check_dtype(WHAT, c, DType::F32)?;
        check_len("matmul_add C (m·n)", c.len(), shape_len(WHAT, m, n)?)?;
        if d.overlaps(&c) {
            return Err(invalid(WHAT, "D overlaps the residual C"));
        }
        check_operands(WHAT, a, b, d, spec)?;
        if self.matmul_mode.is_fast() && k > 0 && m > 0 && n > 0 {
            return self.matmul_bf16(a, b, Some(c), d, spec);
        }
        self.matmul(a, b, d, spec)?;
        self.add(c, d)
    }

    /// Sets how [`Device::matmul`] computes from now on ([`MatmulMode`]).
    pub fn set_matmul_mode(&mut self, mode: MatmulMode) {
        self.matmul_mode = mode;
    }

    /// How [`Device::matmul`] computes.
    pub fn matmul_mode(&self) -> MatmulMode {
        self.matmul_mode
    }

    /// [`MatmulMode::Bf16`]'s product: operands cast to bf16 (unless bf16 already) into the
    /// device's grow-only cast buffer, then one [`Device::matmul_tc`] into `c`. The buffer is
    /// kept (a model's GEMMs repeat the same shapes every step), so steady state allocates
    /// nothing.
    fn matmul_bf16(
        &mut self,
        a: View,
        b: View,
        cin: Option<View>,
        c: View,
        spec: &MatmulSpec,
    ) -> Result<()> {
        let need = |x: View| if x.dtype() == DType::Bf16 { 0 } else { x.len() };
        let total = need(a) + need(b);
        let scratch = if total == 0 {
            None
        } else {
            Some(self.bf16_scratch(total)?)
        };
        let mut at = 0;
        let mut bf16 = |dev: &mut Device, x: View| -> Result<View> {
            if x.dtype() == DType::Bf16 {
                return Ok(x);
            }
            let t = match scratch {
                Some(s) => s.slice(at..at + x.len())?,
                None => return Err(invalid("matmul", "no cast buffer")),
            };
            at += x.len();
            dev.cast(x, t)?;
            Ok(t)
        };
        let (ab, bb) = (bf16(self, a)?, bf16(self, b)?);
        let tc = MatmulTcSpec {
            trans_a: spec.trans_a,
            trans_b: spec.trans_b,
            beta: if cin.is_some() { 1.0 } else { 0.0 },
            ..MatmulTcSpec::new(spec.m, spec.n, spec.k)
        };
        self.matmul_tc(ab, bb, cin, c, &tc)
    }

    /// The first `len` elements of the grow-only bf16 cast buffer, grown to fit first.
    pub(crate) fn bf16_scratch(&mut self, len: usize) -> Result<View> {
        if self.matmul_scratch.is_none_or(|s| s.len() < len) {
            if let Some(old) = self.matmul_scratch.take() {
                self.free(old)?;
            }
            self.matmul_scratch = Some(self.try_alloc(DType::Bf16, len)?);
        }
        match self.matmul_scratch {
            Some(s) => s.slice(0..len),
            None => Err(invalid("matmul", "no cast buffer")),
        }
    }

    /// Frees [`MatmulMode::Bf16`]'s cast buffer (it is kept between products otherwise).
    pub fn release_matmul_scratch(&mut self) -> Result<()> {
        match self.matmul_scratch.take() {
            Some(s) => self.free(s),
            None => Ok(()),
        }
    }

    /// The tensor-core matrix product: `D[m, n] = alpha·op(A)[m, k]·op(B)[k, n] + beta·C[m, n]`
    /// with bf16 `a` (`m·k`) and `b` (`k·n`), `d` f32 or bf16 (`m·n`) and `c` (optional, `d`'s
    /// dtype and length), all row-major; `op` transposes as in [`Device::matmul`]. On CUDA this
    /// is one cuBLASLt GEMM (bf16 inputs on the tensor cores, f32 accumulation and epilogue, one
    /// rounding to `d`'s dtype); it is the GEMM of Muon's fast Newton–Schulz mode.
    ///
    /// Views follow [`Device::matmul`]'s rules: `d` must not overlap `a`, `b` or `c`; `a` and
    /// `b` may overlap; `c` may be `d` itself (exactly the same view: an in-place update
    /// `D ← alpha·op(A)·op(B) + beta·D`), or a disjoint view. Without `c`, `beta` must be 0 and
    /// D is not read. `alpha` and `beta` must be finite. With `spec.symmetric`, `a` and `b` must
    /// be the same view, `trans_b = !trans_a` and `m = n` (see [`MatmulTcSpec::symmetric`]).
    ///
    /// **Arithmetic.** The CPU backend computes the reference: every element is
    /// `s = ((0 + a₀b₀) + a₁b₁) + …` over k in index order in f32 (a product of two bf16 values
    /// is exact in f32, so only the sums round), then `fl(fl(alpha·s) + fl(beta·c))` (or
    /// `fl(alpha·s)` without C), rounded once to `d`'s dtype (RNE). The CUDA backend sums the
    /// same exact products in f32 in cuBLAS's order (blocked over k, possibly split-K; fixed
    /// for a given shape, GPU and library version, so repeated calls give the same bits), then
    /// applies the same epilogue: results agree with the CPU to f32 summation error (relative
    /// `≲ k·2⁻²⁴` of `Σ|aᵢbᵢ|`, far below a bf16 ulp), so a bf16 `d` differs from the CPU at most
    /// where the f32 value lies within that error of a bf16 rounding boundary (then by one bf16
    /// ulp). Unlike every other op, CPU and CUDA are not bit-identical here.
    ///
    /// Measured on an H200 against this CPU reference (`lowbit-optim`'s `muon_bench`,
    /// `tests/cuda_gemm.rs`): relative Frobenius error 2.7e-7 to 5e-7 with an f32 D (k up to
    /// 1000) and 1.8e-5 to 2.6e-5 with a bf16 D (0.003% to 0.007% of the elements one bf16 ulp
    /// apart).
    ///
    /// **Deviation of Muon's fast mode from the exact one** (the orthogonalized update,
    /// `‖O_fast − O_exact‖_F / ‖O_exact‖_F`, bf16 iterate, 5 Newton–Schulz steps, Gaussian
    /// gradients, H200): 3.8e-3 to 6.5e-3 on shapes from 256 x 1024 to the Llama-3-8B matrices
    /// (4.7e-3 at 4096 x 4096, 4.6e-3 at 14336 x 4096); the table is in
    /// `lowbit_optim::NsMode`. Both modes round the iterate to bf16 after every GEMM; only the
    /// f32 summation order differs, which flips some of those roundings.
    ///
    /// With `k = 0` the CPU body runs (a counted host fallback on CUDA): cuBLASLt has no empty
    /// contraction.
    pub fn matmul_tc(
        &mut self,
        a: View,
        b: View,
        c: Option<View>,
        d: View,
        spec: &MatmulTcSpec,
    ) -> Result<()> {
        const WHAT: &str = "matmul_tc";
        let MatmulTcSpec { m, n, k, .. } = *spec;
        check_dtype(WHAT, a, DType::Bf16)?;
        check_dtype(WHAT, b, DType::Bf16)?;
        if !matches!(d.dtype(), DType::F32 | DType::Bf16) {
            return Err(crate::DeviceError::DType {
                what: WHAT,
                expected: "f32 or bf16",
                got: d.dtype(),
            });
        }
        check_len("matmul_tc A (m·k)", a.len(), shape_len(WHAT, m, k)?)?;
        check_len("matmul_tc B (k·n)", b.len(), shape_len(WHAT, k, n)?)?;
        check_len("matmul_tc D (m·n)", d.len(), shape_len(WHAT, m, n)?)?;
        if let Some(c) = c {
            check_dtype(WHAT, c, d.dtype())?;
            check_len("matmul_tc C (m·n)", c.len(), d.len())?;
        }
        if !(spec.alpha.is_finite() && spec.beta.is_finite()) {
            return Err(invalid(WHAT, "alpha and beta must be finite"));
        }
        if c.is_none() && spec.beta != 0.0 {
            return Err(invalid(WHAT, "beta must be 0 without a C"));
        }
        if spec.symmetric && (a != b || spec.trans_b == spec.trans_a || m != n) {
            return Err(invalid(
                WHAT,
                "symmetric needs a == b, trans_b == !trans_a and m == n",
            ));
        }
        // `c == d` is the in-place form: `d` is then the op's one in/out view.
        let c_in = c.filter(|c| *c != d);
        // k = 0 (D = beta·C) is left to the host body: cuBLASLt has no empty contraction.
        if k > 0 {
            on_cuda!(self, g => g.matmul_tc(a, b, c_in, c.is_some(), d, spec));
        }
        let ins: Vec<View> = [a, b].into_iter().chain(c_in).collect();
        self.host_op_dyn(WHAT, &ins, &[d], |ib, mut ob| {
            let opa = op_matrix(decode_f32(DType::Bf16, ib[0]), m, k, spec.trans_a);
            let opb = op_matrix(decode_f32(DType::Bf16, ib[1]), k, n, spec.trans_b);
            let old = match (c, ib.get(2)) {
                (_, Some(cb)) => Some(decode_f32(d.dtype(), cb)),
                (Some(_), None) => Some(decode_f32(d.dtype(), &*ob[0])),
                (None, None) => None,
            };
            let db = &mut *ob[0];
            let es = d.dtype().size();
            let mut acc = vec![0f32; n];
            for (i, d_row) in db.chunks_exact_mut(es * n.max(1)).enumerate().take(m) {
                acc.fill(0.0);
                for (&aik, b_row) in opa[i * k..(i + 1) * k]
                    .iter()
                    .zip(opb.chunks_exact(n.max(1)))
                {
                    for (s, &bkj) in acc.iter_mut().zip(b_row) {
                        *s += aik * bkj;
                    }
                }
                for (j, s) in acc.iter_mut().enumerate() {
                    let scaled = spec.alpha * *s;
                    *s = match &old {
                        Some(o) => scaled + spec.beta * o[i * n + j],
                        None => scaled,
                    };
                }
                encode_f32(d.dtype(), &acc, d_row);
            }
            Ok(())
        })
    }
}
