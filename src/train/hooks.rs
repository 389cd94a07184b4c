//! The model's view of the data-parallel buffers: parameters through the forward pre-hook
//! (where lazily gathered buckets are waited for) and the precision policy, gradients into the
//! buffers with readiness reported (where bucket reductions start).
//!
//! Precision policy: GEMM weights are computed with as `Q(bf16 weight)`, dequantized — the
//! rowwise copy for the forward, the columnwise copy for the backward, as block-scaled GEMMs
//! read them. With low-precision primary weights the stored copies are used; otherwise the bf16
//! parameter is quantized on the fly with the same recipe, so both paths compute with the same
//! bits. Grouped expert tensors are quantized per expert: MXFP8 blocks never straddle experts
//! when each expert's row count is a multiple of 32 (checked up front), and NVFP4 needs a global
//! amax per expert, so grouped tensors are quantized expert by expert on the fly (their NVFP4
//! primary storage is not built yet; they stay bf16-stored under `--precision nvfp4`).

use lowbit_buffers::{DataParallelBuffers, Mxfp8Weights, Nvfp4Weights, matrix_dims};
use lowbit_buffers::{mxfp8_weight_config, nvfp4_weight_config};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, Fp8Kind, Mxfp8Views, View};

use super::Precision;
use super::lm::ParamInfo;
use crate::model::{Hooks, ModelError, Usage};

/// Device scratch of the hooks, allocated once per rank and reused by every step: f32 for
/// dequantized weights, u8 for the copies of on-the-fly quantization.
#[derive(Clone, Copy, Debug)]
pub struct HookScratch {
    scratch: View,
    qscratch: [View; 4],
}

impl HookScratch {
    /// Scratch for the largest parameter of `bufs`.
    pub fn new(dev: &mut Device, bufs: &DataParallelBuffers) -> HookScratch {
        let n = bufs.specs().iter().map(|s| s.numel).max().unwrap_or(1);
        HookScratch {
            scratch: dev.alloc(DType::F32, n),
            qscratch: [n, n, n, n].map(|k| dev.alloc(DType::U8, k)),
        }
    }

    /// Frees the scratch.
    pub fn free(self, dev: &mut Device) -> Result<(), ModelError> {
        dev.free(self.scratch)?;
        for v in self.qscratch {
            dev.free(v)?;
        }
        Ok(())
    }
}

/// See the module docs.
pub struct TrainHooks<'a> {
    pub(crate) bufs: &'a mut DataParallelBuffers,
    pub(crate) comm: &'a mut dyn Communicator,
    precision: Precision,
    info: &'a [ParamInfo],
    scratch: View,
    qscratch: [View; 4],
    /// Eval: gradients go to scratch and readiness is not reported.
    eval: bool,
}

fn hook_err(e: impl std::fmt::Display) -> ModelError {
    ModelError::Hook(e.to_string())
}

impl<'a> TrainHooks<'a> {
    /// Hooks over `bufs` (whose parameters are described by `info`, same order), computing
    /// in `scratch` (made by [`HookScratch::new`] for these buffers).
    pub fn new(
        scratch: HookScratch,
        bufs: &'a mut DataParallelBuffers,
        comm: &'a mut dyn Communicator,
        precision: Precision,
        info: &'a [ParamInfo],
    ) -> TrainHooks<'a> {
        TrainHooks {
            bufs,
            comm,
            precision,
            info,
            scratch: scratch.scratch,
            qscratch: scratch.qscratch,
            eval: false,
        }
    }

    /// Switches to eval mode: gradients go to scratch, readiness is not reported.
    pub fn eval(mut self) -> Self {
        self.eval = true;
        self
    }

    fn mxfp8(
        &mut self,
        dev: &mut Device,
        p: usize,
        usage: Usage,
        out: View,
    ) -> Result<(), ModelError> {
        let spec = &self.bufs.specs()[p];
        let (rows, cols) = matrix_dims(&spec.shape);
        let experts = self.info[p].experts;
        if let Some(w) = self.bufs.mxfp8_weights(p) {
            // Low-precision primary weights: the stored copies (per expert by construction).
            return dequant_mxfp8(dev, &w, usage, out);
        }
        let src = self.bufs.param_view(p).map_err(hook_err)?;
        let er = rows / experts;
        for e in 0..experts {
            let [rd, rs, cd, cs] = self.qscratch;
            let (rb, cb) = (cols.div_ceil(32), er.div_ceil(32));
            let n = er * cols;
            let views = Mxfp8Views {
                rowwise: Some((rd.slice(0..n)?, rs.slice(0..er * rb)?)),
                columnwise: Some((cd.slice(0..n)?, cs.slice(0..cb * cols)?)),
            };
            dev.quantize_mxfp8(
                src.slice(e * n..(e + 1) * n)?,
                er,
                cols,
                &mxfp8_weight_config(),
                &views,
            )?;
            let w = Mxfp8Weights {
                rows: er,
                cols,
                rowwise: views.rowwise.expect("set above"),
                columnwise: views.columnwise.expect("set above"),
            };
            dequant_mxfp8(dev, &w, usage, out.slice(e * n..(e + 1) * n)?)?;
        }
        Ok(())
    }

    fn nvfp4(
        &mut self,
        dev: &mut Device,
        p: usize,
        usage: Usage,
        out: View,
    ) -> Result<(), ModelError> {
        let spec = &self.bufs.specs()[p];
        let (rows, cols) = matrix_dims(&spec.shape);
        let experts = self.info[p].experts;
        if let Some((w, amax)) = self.bufs.nvfp4_weights(p) {
            return dequant_nvfp4(dev, &w, amax, usage, out);
        }
        let src = self.bufs.param_view(p).map_err(hook_err)?;
        let er = rows / experts;
        let n = er * cols;
        for e in 0..experts {
            let [rd, rs, cd, cs] = self.qscratch;
            let w = Nvfp4Weights {
                rows: er,
                cols,
                rowwise: (rd.slice(0..n / 2)?, rs.slice(0..n / 16)?),
                columnwise: (cd.slice(0..n / 2)?, cs.slice(0..n / 16)?),
                // Only the gathered-weights path reads tile amaxes; dequantization does not.
                tiles: self.scratch,
            };
            let amax = dev.quantize_nvfp4(
                src.slice(e * n..(e + 1) * n)?,
                er,
                cols,
                &nvfp4_weight_config(),
                &w.views(),
            )?;
            dequant_nvfp4(dev, &w, amax.rowwise, usage, out.slice(e * n..(e + 1) * n)?)?;
        }
        Ok(())
    }
}

/// `out ← dequantize(w)`: the rowwise copy for the forward, the columnwise one for the backward.
pub fn dequant_mxfp8(
    dev: &mut Device,
    w: &Mxfp8Weights,
    usage: Usage,
    out: View,
) -> Result<(), ModelError> {
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

/// `out ← dequantize(w)` with global amax `amax`, rowwise for the forward, columnwise for the
/// backward.
pub fn dequant_nvfp4(
    dev: &mut Device,
    w: &Nvfp4Weights,
    amax: f32,
    usage: Usage,
    out: View,
) -> Result<(), ModelError> {
    let (rows, cols) = (w.rows, w.cols);
    match usage {
        Usage::Forward => {
            let (d, s) = w.rowwise;
            dev.dequantize_nvfp4_rowwise(d, s, amax, rows, cols, out)?;
        }
        Usage::Backward => {
            let (d, s) = w.columnwise;
            dev.dequantize_nvfp4_columnwise(d, s, amax, false, rows, cols, out)?;
        }
    }
    Ok(())
}

impl Hooks for TrainHooks<'_> {
    fn param(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<View, ModelError> {
        let g = self.bufs.group_of(p);
        self.bufs
            .finish_param_sync(dev, self.comm, g)
            .map_err(hook_err)?;
        if self.precision == Precision::Bf16 || !self.info[p].matrix {
            return self.bufs.param_view(p).map_err(hook_err);
        }
        let n = self.bufs.specs()[p].numel;
        let out = self.scratch.slice(0..n)?;
        match self.precision {
            Precision::Mxfp8 => self.mxfp8(dev, p, usage, out)?,
            Precision::Nvfp4 => self.nvfp4(dev, p, usage, out)?,
            Precision::Bf16 => unreachable!("handled above"),
        }
        Ok(out)
    }

    fn grad(&mut self, dev: &mut Device, p: usize) -> Result<View, ModelError> {
        if self.eval {
            let n = self.bufs.specs()[p].numel;
            return Ok(self.scratch.slice(0..n)?);
        }
        self.bufs.accumulation_view(dev, p).map_err(hook_err)
    }

    fn grad_ready(&mut self, dev: &mut Device, p: usize) -> Result<(), ModelError> {
        if !self.eval && self.bufs.config().overlap_grad_reduce {
            self.bufs
                .register_grad_ready(dev, self.comm, p)
                .map_err(hook_err)?;
        }
        Ok(())
    }
}
