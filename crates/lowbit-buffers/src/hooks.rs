//! The model side of the training-step protocol: the [`Hooks`] a model calls for every
//! parameter it reads and every gradient it writes. A model written against this trait never
//! owns parameter or gradient memory, so the buffers can gather, quantize and reduce around it.

use lowbit_device::{Device, MxOperand, View};

use crate::error::Result;

/// Which computation a parameter is fetched for: low-precision weights use their rowwise copy
/// in the forward (`X·Wᵀ` contracts along rows of W) and their columnwise copy in the backward
/// (`dY·W` contracts down its columns), as block-scaled GEMMs do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Usage {
    /// Forward GEMMs and norms.
    Forward,
    /// Backward (data-gradient) GEMMs and norms.
    Backward,
}

/// Where a model gets parameters and puts gradients.
///
/// The contract, per microbatch: call [`Hooks::param`] right before using a parameter (the
/// forward pre-hook: a lazily gathered bucket is awaited there); accumulate each gradient into
/// the view [`Hooks::grad`] returns (add, never overwrite: microbatches accumulate); call
/// [`Hooks::grad_ready`] once the parameter's gradient is complete for the microbatch (the
/// backward hook: a bucket's reduction may start there). With unfused accumulation
/// ([`crate::GradAccumulation::Unfused`]) a contribution reaches the buffer at the next `grad`
/// call or at `grad_ready`, so report every parameter ready before the microbatch ends.
pub trait Hooks {
    /// The values of parameter `p` to compute with (any float dtype), valid until the next call.
    fn param(&mut self, dev: &mut Device, p: usize, usage: Usage) -> Result<View>;
    /// The view gradient `p` accumulates into (any float dtype).
    fn grad(&mut self, dev: &mut Device, p: usize) -> Result<View>;
    /// Gradient `p` is complete for this microbatch.
    fn grad_ready(&mut self, dev: &mut Device, p: usize) -> Result<()>;

    /// The stored MXFP8 plane of parameter `p` for `usage` (the rowwise copy for the forward,
    /// the columnwise copy for the backward, as [`Hooks::param`] would dequantize it), for a
    /// GEMM that consumes MXFP8 directly (`lowbit_device::Device::matmul_mx`); valid until the
    /// next call. `None` (the default) when `p`'s primary weights are not MXFP8: the caller
    /// then quantizes [`Hooks::param`]'s values itself. It runs the same pre-hook as `param`.
    fn param_mxfp8(
        &mut self,
        dev: &mut Device,
        p: usize,
        usage: Usage,
    ) -> Result<Option<MxOperand>> {
        let _ = (dev, p, usage);
        Ok(None)
    }

    /// Adds the f32 gradient `g` into gradient `p` and reports it ready: the three calls a
    /// backward makes per parameter.
    fn accumulate(&mut self, dev: &mut Device, p: usize, g: View) -> Result<()> {
        let dst = self.grad(dev, p)?;
        dev.add(g, dst)?;
        self.grad_ready(dev, p)
    }
}
