//! [`DpHooks`]: the [`Hooks`] of data-parallel training over [`DataParallelBuffers`]. A
//! parameter fetch runs the forward pre-hook (lazy gathers) and the precision policy; a gradient
//! goes into the buffers (fused, or through a per-parameter gradient) and its readiness starts
//! bucket reductions. In eval mode gradients go to scratch and nothing is reported.

use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, MxOperand, Mxfp8Config, Mxfp8Views, View};

use crate::config::GradAccumulation;
use crate::error::Result;
use crate::policy::{
    ComputeFormat, ParamCompute, PrecisionPolicy, dequant_mxfp8, dequant_nvfp4, mxfp8_plane,
};
use crate::storage::{
    LowPrecisionWeights, Mxfp8Weights, Nvfp4Weights, mxfp8_weight_config, nvfp4_weight_config,
};
use crate::{DataParallelBuffers, Hooks, Usage, matrix_dims};

/// Device scratch of the hooks, allocated once per rank and reused by every step: f32 for
/// dequantized weights, u8 for the copies of on-the-fly quantization, f32 for unfused
/// gradients.
#[derive(Clone, Copy, Debug)]
pub struct HookScratch {
    values: View,
    quant: [View; 4],
    grad: Option<View>,
}

impl HookScratch {
    /// Scratch for the largest parameter of `bufs`.
    pub fn new(dev: &mut Device, bufs: &DataParallelBuffers) -> HookScratch {
        let n = bufs.specs().iter().map(|s| s.numel).max().unwrap_or(1);
        HookScratch {
            values: dev.alloc(DType::F32, n),
            quant: [n, n, n, n].map(|k| dev.alloc(DType::U8, k)),
            grad: (bufs.config().grad_accumulation == GradAccumulation::Unfused)
                .then(|| dev.alloc(DType::F32, n)),
        }
    }

    /// Frees the scratch.
    pub fn free(self, dev: &mut Device) -> Result<()> {
        dev.free(self.values)?;
        for v in self.quant {
            dev.free(v)?;
        }
        if let Some(g) = self.grad {
            dev.free(g)?;
        }
        Ok(())
    }
}

/// Whether the hooks serve a training microbatch or an evaluation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HookMode {
    /// Gradients accumulate into the buffers; readiness starts reductions.
    Train,
    /// Gradients go to scratch; nothing is reported (an eval must not touch training state).
    Eval,
}

/// See the module docs.
pub struct DpHooks<'a> {
    bufs: &'a mut DataParallelBuffers,
    comm: &'a mut dyn Communicator,
    policy: &'a PrecisionPolicy,
    scratch: &'a HookScratch,
    mode: HookMode,
    /// Unfused accumulation: the parameter whose gradient the scratch holds, not yet added.
    pending: Option<usize>,
}

impl<'a> DpHooks<'a> {
    /// Hooks over `bufs` computing with `policy` in `scratch` (made by [`HookScratch::new`] for
    /// these buffers).
    pub fn new(
        bufs: &'a mut DataParallelBuffers,
        comm: &'a mut dyn Communicator,
        policy: &'a PrecisionPolicy,
        scratch: &'a HookScratch,
        mode: HookMode,
    ) -> DpHooks<'a> {
        DpHooks {
            bufs,
            comm,
            policy,
            scratch,
            mode,
            pending: None,
        }
    }

    /// The buffers.
    pub fn buffers(&self) -> &DataParallelBuffers {
        self.bufs
    }

    /// The buffers, mutably (e.g. to mark the last microbatch).
    pub fn buffers_mut(&mut self) -> &mut DataParallelBuffers {
        self.bufs
    }

    /// The communicator.
    pub fn comm(&mut self) -> &mut dyn Communicator {
        self.comm
    }

    /// `Q(bf16 parameter)` dequantized into `out`, quantized on the fly per expert.
    fn quantize_on_the_fly(
        &mut self,
        dev: &mut Device,
        p: usize,
        compute: ParamCompute,
        usage: Usage,
        out: View,
    ) -> Result<()> {
        let (rows, cols) = matrix_dims(&self.bufs.specs()[p].shape);
        let src = self.bufs.param_view(p)?;
        let er = rows / compute.experts;
        let n = er * cols;
        let [rd, rs, cd, cs] = self.scratch.quant;
        for e in 0..compute.experts {
            let (src_e, out_e) = (
                src.slice(e * n..(e + 1) * n)?,
                out.slice(e * n..(e + 1) * n)?,
            );
            match compute.format {
                ComputeFormat::Nvfp4 => {
                    let w = Nvfp4Weights {
                        rows: er,
                        cols,
                        rowwise: (rd.slice(0..n / 2)?, rs.slice(0..n / 16)?),
                        columnwise: (cd.slice(0..n / 2)?, cs.slice(0..n / 16)?),
                        // Only the gathered-weights path reads tile amaxes; dequantization
                        // does not.
                        tiles: self.scratch.values,
                        amaxes: Vec::new(),
                    };
                    let cfg = nvfp4_weight_config();
                    let amax = dev.quantize_nvfp4(src_e, er, cols, &cfg, &w.views())?;
                    let w = Nvfp4Weights {
                        amaxes: vec![amax.rowwise],
                        ..w
                    };
                    dequant_nvfp4(dev, &w, usage, out_e)?;
                }
                ComputeFormat::Mxfp8 { two_d } => {
                    let (rb, cb) = (cols.div_ceil(32), er.div_ceil(32));
                    let views = Mxfp8Views {
                        rowwise: Some((rd.slice(0..n)?, rs.slice(0..er * rb)?)),
                        columnwise: Some((cd.slice(0..n)?, cs.slice(0..cb * cols)?)),
                    };
                    let cfg = Mxfp8Config {
                        two_d,
                        ..mxfp8_weight_config()
                    };
                    dev.quantize_mxfp8(src_e, er, cols, &cfg, &views)?;
                    let (Some(rowwise), Some(columnwise)) = (views.rowwise, views.columnwise)
                    else {
                        unreachable!("both copies set above")
                    };
                    let w = Mxfp8Weights {
                        rows: er,
                        cols,
                        rowwise,
                        columnwise,
                    };
                    dequant_mxfp8(dev, &w, usage, out_e)?;
                }
                ComputeFormat::AsStored => unreachable!("handled by the caller"),
            }
        }
        Ok(())
    }
}

impl DpHooks<'_> {
    /// The per-parameter gradient scratch, with unfused accumulation.
    fn unfused_scratch(&self) -> Option<View> {
        self.scratch
            .grad
            .filter(|_| self.bufs.config().grad_accumulation == GradAccumulation::Unfused)
    }

    /// Adds the pending per-parameter gradient of `p` into the buffer: one rounding of
    /// `old + g`, as the fused path does.
    fn flush(&mut self, dev: &mut Device, p: usize) -> Result<()> {
        self.pending = None;
        if let Some(tmp) = self.unfused_scratch() {
            let n = self.bufs.specs()[p].numel;
            let main = self.bufs.write_view(dev, p)?;
            dev.add(tmp.slice(0..n)?, main)?;
        }
        Ok(())
    }
}

impl DpHooks<'_> {
    /// The forward pre-hook of a parameter fetch: a training microbatch begins (its first
    /// fetch), then `p`'s bucket group is made ready for `usage` (a lazy gather awaited).
    fn pre_hook(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<()> {
        if self.mode == HookMode::Train {
            self.bufs.begin_microbatch(dev, self.comm)?;
        }
        let g = self.bufs.group_of(p);
        self.bufs.prepare_params(dev, self.comm, g, usage)
    }
}

impl Hooks for DpHooks<'_> {
    fn param(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<View> {
        self.pre_hook(dev, p, usage)?;
        let compute = self.policy.get(p);
        if compute.format == ComputeFormat::AsStored {
            return self.bufs.param_view(p);
        }
        let n = self.bufs.specs()[p].numel;
        let out = self.scratch.values.slice(0..n)?;
        if let Some(w) = self.bufs.unit_mxfp8_weights(p, usage)? {
            dequant_mxfp8(dev, &w, usage, out)?;
            return Ok(out);
        }
        if let Some(w) = self.bufs.unit_nvfp4_weights(p)? {
            dequant_nvfp4(dev, &w, usage, out)?;
            return Ok(out);
        }
        match self.bufs.low_precision_weights(p) {
            // Low-precision primary weights: the stored copies, per expert by construction
            // (MXFP8 blocks have no global scale; NVFP4 keeps one global amax per expert).
            Some(LowPrecisionWeights::Mxfp8(w)) => dequant_mxfp8(dev, &w, usage, out)?,
            Some(LowPrecisionWeights::Nvfp4 { weights, .. }) => {
                dequant_nvfp4(dev, &weights, usage, out)?
            }
            _ => self.quantize_on_the_fly(dev, p, compute, usage, out)?,
        }
        Ok(out)
    }

    fn param_mxfp8(
        &mut self,
        dev: &mut Device,
        p: usize,
        usage: Usage,
    ) -> Result<Option<MxOperand>> {
        self.pre_hook(dev, p, usage)?;
        if self.policy.get(p).format == ComputeFormat::AsStored {
            return Ok(None);
        }
        if let Some(w) = self.bufs.unit_mxfp8_weights(p, usage)? {
            return Ok(Some(mxfp8_plane(&w, usage)));
        }
        Ok(match self.bufs.low_precision_weights(p) {
            Some(LowPrecisionWeights::Mxfp8(w)) => Some(mxfp8_plane(&w, usage)),
            _ => None,
        })
    }

    fn grad(&mut self, dev: &mut Device, p: usize) -> Result<View> {
        let n = self.bufs.specs()[p].numel;
        if self.mode == HookMode::Eval {
            return Ok(self.scratch.values.slice(0..n)?);
        }
        self.bufs.begin_microbatch(dev, self.comm)?;
        let main = self.bufs.accumulation_view(dev, p)?;
        let Some(tmp) = self.unfused_scratch() else {
            return Ok(main);
        };
        // A contribution still in the scratch (this parameter's or another's) is added first:
        // every contribution then reaches the buffer as its own `old + g`, exactly the fused
        // path's sequence of roundings, however the model interleaves its calls.
        if let Some(q) = self.pending {
            self.flush(dev, q)?;
        }
        let tmp_p = tmp.slice(0..n)?;
        dev.zero(tmp_p)?;
        self.pending = Some(p);
        Ok(tmp_p)
    }

    fn grad_ready(&mut self, dev: &mut Device, p: usize) -> Result<()> {
        if self.mode == HookMode::Eval {
            return Ok(());
        }
        if self.pending == Some(p) {
            self.flush(dev, p)?;
        }
        if self.bufs.config().overlap.grad_reduce() {
            self.bufs.register_grad_ready(dev, self.comm, p)?;
        }
        Ok(())
    }
}
