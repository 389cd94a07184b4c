//! The MXFP8 matrix product ([`Device::matmul_mx`]): `C = A·Bᵀ` with both operands in MXFP8,
//! one E8M0 scale per 32 elements along the contraction, as Transformer Engine's MXFP8 recipe
//! computes its GEMMs on Blackwell (`cublasLtMatmul` with `CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0`).
//!
//! **Semantics.** For every element, the contraction is split into the operands' 32-blocks;
//! each block's dot product of the fp8 values is exact (an E4M3 or E5M2 value is an integer
//! times 2⁻¹⁶ or coarser, so 32 products of them sum exactly in f64), is multiplied by the two
//! blocks' scales `2^(ea−127)·2^(eb−127)` and rounded once to f32, and the blocks' results are
//! added to the f32 accumulator (C with `accumulate`, else 0) in block order. The CPU computes
//! exactly this. A GPU computes the same block products in another association (tensor-core
//! partial sums): results agree to f32 summation error of `Σ|aᵢbᵢ|`, not bit for bit.
//!
//! **Operands.** Each operand is a plane of one of the two MXFP8 copies that
//! `lowbit_formats::quantize_mxfp8` writes ([`MxLayout`]): a rowwise copy has its blocks along
//! the contraction when the contraction runs along its rows, a columnwise copy when it runs
//! down its columns. That is how a training step finds every operand already blocked the way
//! its GEMM contracts: the forward `Y = X·Wᵀ` contracts rowwise copies of X and W, the data
//! gradient `dX = dY·W` dY's rowwise and W's columnwise copy, the weight gradient `dW = dYᵀ·X`
//! the columnwise copies of dY and X (TE's MXFP8 recipe, `transformer_engine/pytorch/module/
//! linear.py`). A float operand ([`MxArg::Float`]) is quantized first, into the device's
//! grow-only scratch, with TE's scale rule.
//!
//! The CUDA backend by default dequantizes both operands to bf16 (exact: an fp8 value times a
//! power of two is a bf16 value in every range a tensor's scale can produce) and runs one
//! cuBLASLt bf16 GEMM, which is the MXFP8 product's arithmetic at bf16's speed. With the
//! kernel variants `("matmul_mx_kernel", 1..=3)` two rowwise planes (the forward's `X·Wᵀ`) run
//! `mx_gemm.cu` (FP8 `mma.sync`) or `mx_gemm_wgmma.cu` (FP8 `wgmma`) instead: one instruction
//! per 32-block, its product promoted with both scales into f32.

use super::{invalid, shape_len};
use crate::cpu::{decode_into, encode_f32};
use crate::{
    DType, Device, Fp8Kind, Mxfp8Config, Mxfp8Views, Result, View, check_dtype, check_len,
};
use lowbit_formats::Copies;
use lowbit_formats::scalar::{e4m3_to_f32, e5m2_to_f32};

/// Elements per MXFP8 block along the contraction.
const BLOCK: usize = 32;

/// Which MXFP8 copy an operand is, for a product contracting over `k` (the operand's `outer`
/// dimension is `m` for A, `n` for B).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MxLayout {
    /// Stored `[outer, k]` with 1x32 blocks along k: a rowwise copy; scales
    /// `[outer, ceil(k/32)]`.
    Rowwise,
    /// Stored `[k, outer]` with 32x1 blocks down k: a columnwise copy (not transposed); scales
    /// `[ceil(k/32), outer]`.
    Columnwise,
}

/// One plane of an MXFP8 tensor as a product's operand (u8 views).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MxOperand {
    /// The fp8 elements, `outer·k` bytes.
    pub data: View,
    /// The E8M0 scales, `outer·ceil(k/32)` bytes, laid out as [`MxLayout`] says.
    pub scales: View,
    /// The element type.
    pub kind: Fp8Kind,
    /// Which copy it is.
    pub layout: MxLayout,
}

/// An operand of [`Device::matmul_mx`]: already quantized, or a float matrix the device
/// quantizes first (TE's scale rule, NaN and Inf encoded as NaN: `NanPolicy::Te`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MxArg {
    /// An MXFP8 plane.
    Quantized(MxOperand),
    /// A float matrix stored as `layout` says (`[outer, k]` or `[k, outer]`), quantized to
    /// `kind` with blocks along k.
    Float {
        /// The values (any float dtype).
        values: View,
        /// How the values are stored, which is the copy they are quantized into.
        layout: MxLayout,
        /// The element type to quantize to.
        kind: Fp8Kind,
    },
}

/// Shape of an MXFP8 product `C[m, n] (+)= A[m, k]·B[n, k]ᵀ`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulMxSpec {
    /// Rows of C (A's outer dimension).
    pub m: usize,
    /// Columns of C (B's outer dimension).
    pub n: usize,
    /// Contraction length.
    pub k: usize,
    /// Add to C instead of overwriting it.
    pub accumulate: bool,
}

/// An operand's blocks in logical order: `q[outer][k]` (the fp8 values, unscaled, as f64) and
/// `e[outer][block]` (the biased E8M0 exponents; 255 is NaN).
struct Logical {
    q: Vec<f64>,
    e: Vec<u8>,
}

fn logical(
    data: &[u8],
    scales: &[u8],
    kind: Fp8Kind,
    layout: MxLayout,
    outer: usize,
    k: usize,
) -> Logical {
    let blocks = k.div_ceil(BLOCK);
    let value = |b: u8| -> f64 {
        match kind {
            Fp8Kind::E4M3 => f64::from(e4m3_to_f32(b)),
            Fp8Kind::E5M2 => f64::from(e5m2_to_f32(b)),
        }
    };
    let mut q = vec![0f64; outer * k];
    let mut e = vec![0u8; outer * blocks];
    for o in 0..outer {
        for t in 0..k {
            let at = match layout {
                MxLayout::Rowwise => o * k + t,
                MxLayout::Columnwise => t * outer + o,
            };
            q[o * k + t] = value(data[at]);
        }
        for b in 0..blocks {
            let at = match layout {
                MxLayout::Rowwise => o * blocks + b,
                MxLayout::Columnwise => b * outer + o,
            };
            e[o * blocks + b] = scales[at];
        }
    }
    Logical { q, e }
}

/// One block's contribution: the exact dot product times `2^(ea+eb−254)`, rounded once to f32.
fn block_term(a: &[f64], b: &[f64], ea: u8, eb: u8) -> f32 {
    if ea == 0xFF || eb == 0xFF {
        return f32::NAN;
    }
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let shift = i32::from(ea) + i32::from(eb) - 254;
    // Both factors are exact in f64 (|shift| ≤ 254), so the only rounding is the cast.
    (dot * 2f64.powi(shift)) as f32
}

impl MxOperand {
    fn check(&self, what: &'static str, outer: usize, k: usize) -> Result<()> {
        check_dtype(what, self.data, DType::U8)?;
        check_dtype(what, self.scales, DType::U8)?;
        check_len(
            "matmul_mx operand data (outer·k)",
            self.data.len(),
            shape_len(what, outer, k)?,
        )?;
        let blocks = k.div_ceil(BLOCK);
        check_len(
            "matmul_mx operand scales (outer·ceil(k/32))",
            self.scales.len(),
            shape_len(what, outer, blocks)?,
        )
    }
}

impl Device {
    /// `C[m, n] (+)= A[m, k]·B[n, k]ᵀ` with both operands in MXFP8 (see the module docs for
    /// the arithmetic) and an f32 `c` of `m·n`. Float operands ([`MxArg::Float`]) are quantized
    /// into the device's grow-only MXFP8 scratch first (kept between calls; a model's GEMMs
    /// repeat their shapes, so steady state allocates nothing). `c` must overlap no operand.
    ///
    /// With `k = 0`, `C ← C` (or 0). Errors name the operand: wrong dtypes (u8 planes, float
    /// values), lengths that disagree with the shape, overlapping views.
    pub fn matmul_mx(&mut self, a: MxArg, b: MxArg, c: View, spec: &MatmulMxSpec) -> Result<()> {
        const WHAT: &str = "matmul_mx";
        let MatmulMxSpec { m, n, k, .. } = *spec;
        check_dtype(WHAT, c, DType::F32)?;
        check_len("matmul_mx C (m·n)", c.len(), shape_len(WHAT, m, n)?)?;
        for (arg, outer) in [(a, m), (b, n)] {
            match arg {
                MxArg::Quantized(op) => op.check(WHAT, outer, k)?,
                MxArg::Float { values, .. } => {
                    crate::check_float(WHAT, values)?;
                    check_len(
                        "matmul_mx float operand (outer·k)",
                        values.len(),
                        shape_len(WHAT, outer, k)?,
                    )?;
                }
            }
        }
        let floats = [a, b].iter().any(|x| matches!(x, MxArg::Float { .. }));
        if floats {
            // At least a byte, so that empty operands still slice the scratch.
            let need = float_bytes(a, m, k) + float_bytes(b, n, k);
            self.ensure_mx_scratch(need.max(1))?;
        }
        let mut at = 0;
        let qa = self.quantize_arg(a, m, k, &mut at)?;
        let qb = self.quantize_arg(b, n, k, &mut at)?;
        if self.is_cuda() && m > 0 && n > 0 && k > 0 {
            #[cfg(feature = "cuda")]
            if let Some(g) = self.cuda_mut()
                && g.mx_gemm_takes(&qa, &qb, spec)
            {
                return g.matmul_mx_rowwise(&qa, &qb, c, spec);
            }
            return self.matmul_mx_via_bf16(qa, qb, c, spec);
        }
        self.host_op(
            WHAT,
            [qa.data, qa.scales, qb.data, qb.scales],
            [c],
            |[ad, as_, bd, bs], [cb]| {
                let la = logical(ad, as_, qa.kind, qa.layout, m, k);
                let lb = logical(bd, bs, qb.kind, qb.layout, n, k);
                let blocks = k.div_ceil(BLOCK);
                let mut acc = vec![0f32; n];
                for (i, c_row) in cb.chunks_exact_mut(4 * n.max(1)).enumerate().take(m) {
                    if spec.accumulate {
                        decode_into(DType::F32, c_row, &mut acc);
                    } else {
                        acc.fill(0.0);
                    }
                    let arow = &la.q[i * k..(i + 1) * k];
                    for (j, s) in acc.iter_mut().enumerate() {
                        let brow = &lb.q[j * k..(j + 1) * k];
                        for blk in 0..blocks {
                            let r = blk * BLOCK..((blk + 1) * BLOCK).min(k);
                            let ea = la.e[i * blocks + blk];
                            let eb = lb.e[j * blocks + blk];
                            *s += block_term(&arow[r.clone()], &brow[r], ea, eb);
                        }
                    }
                    encode_f32(DType::F32, &acc, c_row);
                }
                Ok(())
            },
        )
    }

    /// Frees [`Device::matmul_mx`]'s MXFP8 scratch (kept between products otherwise).
    pub fn release_mx_scratch(&mut self) -> Result<()> {
        match self.mx_scratch.take() {
            Some(s) => self.free(s),
            None => Ok(()),
        }
    }

    fn ensure_mx_scratch(&mut self, bytes: usize) -> Result<()> {
        if self.mx_scratch.is_some_and(|s| s.len() >= bytes) {
            return Ok(());
        }
        if let Some(old) = self.mx_scratch.take() {
            self.free(old)?;
        }
        self.mx_scratch = Some(self.try_alloc(DType::U8, bytes)?);
        Ok(())
    }

    /// The quantized plane of `arg`: itself, or `values` quantized into the scratch at `*at`.
    fn quantize_arg(
        &mut self,
        arg: MxArg,
        outer: usize,
        k: usize,
        at: &mut usize,
    ) -> Result<MxOperand> {
        let (values, layout, kind) = match arg {
            MxArg::Quantized(op) => return Ok(op),
            MxArg::Float {
                values,
                layout,
                kind,
            } => (values, layout, kind),
        };
        let scratch = self
            .mx_scratch
            .ok_or_else(|| invalid("matmul_mx", "no MXFP8 scratch"))?;
        let data_len = outer * k;
        let scales_len = outer * k.div_ceil(BLOCK);
        let data = scratch.slice(*at..*at + data_len)?;
        let scales = scratch.slice(*at + data_len..*at + data_len + scales_len)?;
        *at += data_len + scales_len;
        let cfg = Mxfp8Config {
            kind,
            copies: match layout {
                MxLayout::Rowwise => Copies::Rowwise,
                MxLayout::Columnwise => Copies::Columnwise,
            },
            ..Mxfp8Config::default()
        };
        // A rowwise copy of `[outer, k]`, or a columnwise copy of `[k, outer]`.
        let (rows, cols) = match layout {
            MxLayout::Rowwise => (outer, k),
            MxLayout::Columnwise => (k, outer),
        };
        let out = match layout {
            MxLayout::Rowwise => Mxfp8Views {
                rowwise: Some((data, scales)),
                columnwise: None,
            },
            MxLayout::Columnwise => Mxfp8Views {
                rowwise: None,
                columnwise: Some((data, scales)),
            },
        };
        if data_len > 0 {
            self.quantize_mxfp8(values, rows, cols, &cfg, &out)?;
        }
        Ok(MxOperand {
            data,
            scales,
            kind,
            layout,
        })
    }

    /// The GPU path until the block-scaled kernel lands: both planes dequantized to bf16 (exact)
    /// into the bf16 cast buffer, then one [`Device::matmul_tc`].
    fn matmul_mx_via_bf16(
        &mut self,
        a: MxOperand,
        b: MxOperand,
        c: View,
        spec: &MatmulMxSpec,
    ) -> Result<()> {
        let MatmulMxSpec {
            m,
            n,
            k,
            accumulate,
        } = *spec;
        let bf = self.bf16_scratch(m * k + n * k)?;
        let (da, db) = (bf.slice(0..m * k)?, bf.slice(m * k..m * k + n * k)?);
        for (op, outer, dst) in [(a, m, da), (b, n, db)] {
            match op.layout {
                MxLayout::Rowwise => {
                    self.dequantize_mxfp8_rowwise(op.data, op.scales, outer, k, op.kind, dst)?
                }
                MxLayout::Columnwise => {
                    self.dequantize_mxfp8_columnwise(op.data, op.scales, k, outer, op.kind, dst)?
                }
            }
        }
        // op(A) = A ([m, k] stored as is, or [k, m] transposed); op(B) = Bᵀ.
        let tc = super::MatmulTcSpec {
            trans_a: a.layout == MxLayout::Columnwise,
            trans_b: b.layout == MxLayout::Rowwise,
            beta: if accumulate { 1.0 } else { 0.0 },
            ..super::MatmulTcSpec::new(m, n, k)
        };
        self.matmul_tc(da, db, accumulate.then_some(c), c, &tc)
    }
}

/// Scratch bytes a float operand needs (data and scales); none for a quantized one.
fn float_bytes(arg: MxArg, outer: usize, k: usize) -> usize {
    match arg {
        MxArg::Quantized(_) => 0,
        MxArg::Float { .. } => outer * k + outer * k.div_ceil(BLOCK),
    }
}
