//! The precision policy: which values a forward and a backward compute with. A parameter is
//! either used as stored, or computed with as `Q(bf16 weight)` dequantized — the rowwise copy
//! for the forward, the columnwise copy for the backward, as block-scaled GEMMs read them. With
//! low-precision primary weights the stored copies are used; otherwise the bf16 parameter is
//! quantized on the fly with the same recipe, so both paths compute with the same bits.
//! Grouped expert tensors (`[experts, out, in]`) are quantized expert by expert.

use lowbit_device::{Device, Fp8Kind, MxLayout, MxOperand, View};
use lowbit_layout::{ParamSpec, ParamStorage, QuantKind, expert_slices, matrix_dims};

use crate::Usage;
use crate::error::{ConfigError, Result};
use crate::storage::{Mxfp8Weights, Nvfp4Weights, experts_of};

/// What a parameter is computed with.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComputeFormat {
    /// The stored values (bf16, f16 or f32 storage).
    AsStored,
    /// MXFP8 E4M3, dequantized; 1x32 blocks, or 32x32 with `two_d`.
    Mxfp8 {
        /// 2D (32x32) block scaling, TE's 2D weight recipe.
        two_d: bool,
    },
    /// 2D NVFP4 (16x16 tiles), dequantized.
    Nvfp4,
}

/// The policy of one parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ParamCompute {
    /// The format.
    pub format: ComputeFormat,
    /// Experts of a grouped tensor (quantized one by one); 1 for an ordinary tensor.
    pub experts: usize,
}

impl ParamCompute {
    /// Used as stored.
    pub const AS_STORED: ParamCompute = ParamCompute {
        format: ComputeFormat::AsStored,
        experts: 1,
    };

    /// Computed with `format`, one expert.
    pub fn new(format: ComputeFormat) -> Self {
        ParamCompute { format, experts: 1 }
    }

    /// A grouped tensor of `experts` experts.
    pub fn with_experts(mut self, experts: usize) -> Self {
        self.experts = experts;
        self
    }
}

/// The policy of every parameter, indexed like the buffers' specs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrecisionPolicy {
    params: Vec<ParamCompute>,
}

impl PrecisionPolicy {
    /// A policy from one entry per parameter.
    pub fn new(params: Vec<ParamCompute>) -> Self {
        PrecisionPolicy { params }
    }

    /// The common policy: the parameters given `Some(experts)` (GEMM weights; `experts` is 1
    /// unless grouped) computed with `format`, the others (`None`: norms, biases, embeddings)
    /// as stored.
    pub fn matrices(
        format: ComputeFormat,
        params: impl IntoIterator<Item = Option<usize>>,
    ) -> Self {
        PrecisionPolicy::new(
            params
                .into_iter()
                .map(|experts| match experts {
                    Some(e) => ParamCompute::new(format).with_experts(e),
                    None => ParamCompute::AS_STORED,
                })
                .collect(),
        )
    }

    /// A policy computing every parameter as stored.
    pub fn as_stored(params: usize) -> Self {
        PrecisionPolicy::new(vec![ParamCompute::AS_STORED; params])
    }

    /// The entry of parameter `p` (as stored if out of range).
    pub fn get(&self, p: usize) -> ParamCompute {
        self.params
            .get(p)
            .copied()
            .unwrap_or(ParamCompute::AS_STORED)
    }

    /// Checks the policy against the parameters: one entry each, experts dividing the rows,
    /// and, for grouped tensors, blocks that never straddle experts (MXFP8: a multiple of 32
    /// rows per expert; NVFP4: of 16 rows and 16 columns). NVFP4 primary weights hold one
    /// global amax per expert of their shape (`[experts, out, in]`), so the policy must count
    /// the same experts, or stored and on-the-fly weights would differ.
    ///
    /// # Errors
    /// [`ConfigError::Policy`] naming the parameter.
    pub fn validate(&self, specs: &[ParamSpec]) -> Result<()> {
        let bad = |m: String| Err(ConfigError::Policy(m).into());
        if self.params.len() != specs.len() {
            return bad(format!(
                "{} entries for {} parameters",
                self.params.len(),
                specs.len()
            ));
        }
        for (c, s) in self.params.iter().zip(specs) {
            if c.format == ComputeFormat::AsStored {
                continue;
            }
            let (rows, cols) = matrix_dims(&s.shape);
            let stored = experts_of(&s.shape);
            if s.key.param_storage == ParamStorage::Quantized(QuantKind::Nvfp4)
                && c.experts != stored
            {
                return bad(format!(
                    "`{}`: its NVFP4 primary weights have {stored} experts (one global amax \
                     each), the policy {}",
                    s.name, c.experts
                ));
            }
            if c.experts == 0 || !rows.is_multiple_of(c.experts) {
                return bad(format!(
                    "`{}`: {} experts do not divide {rows} rows",
                    s.name, c.experts
                ));
            }
            let er = rows / c.experts;
            let ok = match c.format {
                _ if c.experts == 1 => true,
                ComputeFormat::Mxfp8 { .. } => er.is_multiple_of(32),
                ComputeFormat::Nvfp4 => er.is_multiple_of(16) && cols.is_multiple_of(16),
                ComputeFormat::AsStored => true,
            };
            if !ok {
                return bad(format!(
                    "`{}`: {er}x{cols} per expert does not fit the {:?} blocks",
                    s.name, c.format
                ));
            }
        }
        Ok(())
    }
}

/// `out ← dequantize(w)`: the rowwise copy for the forward, the columnwise one for the backward.
pub fn dequant_mxfp8(dev: &mut Device, w: &Mxfp8Weights, usage: Usage, out: View) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    match usage {
        Usage::Forward => {
            let (d, s) = w.rowwise;
            dev.dequantize_mxfp8_rowwise(d, s, rows, cols, Fp8Kind::E4M3, out)?;
        }
        Usage::Backward => {
            let (d, s) = w.columnwise;
            dev.dequantize_mxfp8_columnwise(d, s, rows, cols, Fp8Kind::E4M3, out)?;
        }
    }
    Ok(())
}

/// The plane of `w` that [`dequant_mxfp8`] reads for `usage`, as a GEMM operand blocked along
/// the contraction: rowwise for the forward (`X·Wᵀ` contracts along W's rows), columnwise for
/// the backward (`dY·W` contracts down its columns).
pub fn mxfp8_plane(w: &Mxfp8Weights, usage: Usage) -> MxOperand {
    let ((data, scales), layout) = match usage {
        Usage::Forward => (w.rowwise, MxLayout::Rowwise),
        Usage::Backward => (w.columnwise, MxLayout::Columnwise),
    };
    MxOperand {
        data,
        scales,
        kind: Fp8Kind::E4M3,
        layout,
    }
}

/// `out ← dequantize(w)`, expert by expert with each expert's global amax: the rowwise copy
/// for the forward, the columnwise one for the backward.
pub fn dequant_nvfp4(dev: &mut Device, w: &Nvfp4Weights, usage: Usage, out: View) -> Result<()> {
    let experts = w.per_expert()?;
    let outs = expert_slices(0..out.len(), experts.len())?;
    for (x, o) in experts.iter().zip(outs) {
        let (rows, cols, amax, out) = (x.rows, x.cols, x.amax(), out.slice(o)?);
        match usage {
            Usage::Forward => {
                let (d, s) = x.rowwise;
                dev.dequantize_nvfp4_rowwise(d, s, amax, rows, cols, out)?;
            }
            Usage::Backward => {
                let (d, s) = x.columnwise;
                dev.dequantize_nvfp4_columnwise(d, s, amax, false, rows, cols, out)?;
            }
        }
    }
    Ok(())
}
