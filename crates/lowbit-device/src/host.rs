//! How an op body reaches its views' bytes on every backend.
//!
//! Op bodies are written once, against host byte slices (`&[u8]` inputs, `&mut [u8]` outputs).
//! [`Device::host_op`] hands them those slices:
//! - on the CPU backend, straight out of the buffers through `CpuDevice::split_n` (no copy);
//! - on the CUDA backend, as the **host fallback**: the views are validated exactly as on the
//!   CPU, their bytes downloaded (outputs too, since several ops read their outputs), the body
//!   runs, and the outputs are uploaded only if it succeeded — so a failing op still writes
//!   nothing. Each fallback call is counted per op ([`Device::host_fallback_calls`]).
//!
//! Ops with a CUDA kernel dispatch to it before reaching `host_op`; [`FALLBACK_OPS`] lists
//! those without one, so the slow path is never hidden.

use crate::{Device, Result, View};

/// Ops (or op variants) that run as a host fallback on a GPU device. Keep in sync with the
/// kernels in `crates/lowbit-kernels/*.cu` (a GPU test checks that the listed ops count fallbacks and the others
/// do not).
pub(crate) const FALLBACK_OPS: &[&str] = &[
    "quantize_mxfp8 (with the Error NaN policy, or more than 65535 x 32 rows)",
    "quantize_nvfp4 (with the Error NaN policy, or arguments the library rejects: the Hadamard \
     transform with 2D scales or with rows % 16 != 0)",
    "nvfp4_finish_2d (only arguments the library rejects, or overlapping views)",
    "mxfp8_quantize_2d_range, nvfp4_quantize_2d_range, mxfp8_scales_2d (only arguments the \
     library rejects, so that its error comes back)",
    "quantize_2d_range_bf16_many (a batch with an NVFP4 piece of a matrix with cols % 16 != 0)",
];

impl Device {
    /// Runs `body` on host byte slices of `ins` and `outs` after the backend-independent view
    /// checks (live, in bounds, the overlap rule); see the module docs.
    pub(crate) fn host_op<const I: usize, const O: usize, R>(
        &mut self,
        what: &'static str,
        ins: [View; I],
        outs: [View; O],
        body: impl FnOnce([&[u8]; I], [&mut [u8]; O]) -> Result<R>,
    ) -> Result<R> {
        self.host_op_dyn(what, &ins, &outs, |i, o| {
            match (i.try_into(), o.try_into()) {
                (Ok(i), Ok(o)) => body(i, o),
                _ => unreachable!("one slice per view"),
            }
        })
    }

    /// [`Device::host_op`] with any number of views, as vectors.
    pub(crate) fn host_op_dyn<R>(
        &mut self,
        what: &'static str,
        ins: &[View],
        outs: &[View],
        body: impl FnOnce(Vec<&[u8]>, Vec<&mut [u8]>) -> Result<R>,
    ) -> Result<R> {
        match &mut self.backend {
            crate::Backend::Cpu(c) => {
                let (i, o) = c.split(what, ins, outs)?;
                body(i, o)
            }
            // The host fallback on a GPU device.
            #[cfg(feature = "cuda")]
            crate::Backend::Cuda(_) => {
                self.check_views(what, ins, outs)?;
                let in_bytes = ins
                    .iter()
                    .map(|v| self.read_bytes(*v))
                    .collect::<Result<Vec<_>>>()?;
                let mut out_bytes = outs
                    .iter()
                    .map(|v| self.read_bytes(*v))
                    .collect::<Result<Vec<_>>>()?;
                let r = body(
                    in_bytes.iter().map(Vec::as_slice).collect(),
                    out_bytes.iter_mut().map(Vec::as_mut_slice).collect(),
                )?;
                for (v, b) in outs.iter().zip(&out_bytes) {
                    self.write_bytes(*v, b)?;
                }
                self.note_fallback(what);
                Ok(r)
            }
        }
    }

    /// The bytes of one input view on the host: borrowed on the CPU, downloaded (and counted as
    /// a fallback of `what`) on a GPU.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn host_read<R>(
        &mut self,
        what: &'static str,
        view: View,
        body: impl FnOnce(&[u8]) -> R,
    ) -> Result<R> {
        match &self.backend {
            crate::Backend::Cpu(c) => Ok(body(c.bytes(view)?)),
            #[cfg(feature = "cuda")]
            crate::Backend::Cuda(_) => {
                let bytes = self.read_bytes(view)?;
                self.note_fallback(what);
                Ok(body(&bytes))
            }
        }
    }
}
