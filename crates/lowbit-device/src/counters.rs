//! Per-device call counters of the quantization entry points, so that tests can state how many
//! quantizations a training step performs (one per low-precision parameter per gather, none in
//! the optimizer's update) without instrumenting the layers above.
//!
//! A call is counted when it enters the public op (before argument checks), on every backend
//! alike: the CUDA kernels, the host fallback and the CPU take the same entry point, so a run
//! counts the same on both. Counting is a plain integer add on `&mut Device`; nothing else
//! changes (no synchronisation, no allocation).

/// The ops a [`crate::Device`] counts calls of ([`crate::Device::op_calls`]): every entry point
/// that writes quantized bytes.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CountedOp {
    /// [`crate::Device::quantize_mxfp8`]: a whole tensor to MXFP8 (and each item of
    /// [`crate::Device::quantize_mxfp8_many`], which counts as one call per item).
    QuantizeMxfp8,
    /// [`crate::Device::quantize_nvfp4`]: a whole tensor to NVFP4.
    QuantizeNvfp4,
    /// [`crate::Device::mxfp8_quantize_2d_range`]: one flat piece of a 2D-scaled MXFP8 tensor.
    Mxfp8Quantize2dRange,
    /// [`crate::Device::nvfp4_quantize_2d_range`]: one flat piece of a 2D-scaled NVFP4 tensor.
    Nvfp4Quantize2dRange,
    /// [`crate::Device::mxfp8_scales_2d`]: the scales of gathered 2D MXFP8 bytes.
    Mxfp8Scales2d,
    /// [`crate::Device::nvfp4_finish_2d`]: scales and columnwise copy of gathered 2D NVFP4 bytes.
    Nvfp4Finish2d,
}

impl CountedOp {
    /// Every counted op.
    pub const ALL: [CountedOp; 6] = [
        CountedOp::QuantizeMxfp8,
        CountedOp::QuantizeNvfp4,
        CountedOp::Mxfp8Quantize2dRange,
        CountedOp::Nvfp4Quantize2dRange,
        CountedOp::Mxfp8Scales2d,
        CountedOp::Nvfp4Finish2d,
    ];

    /// The op's method name on [`crate::Device`].
    pub const fn name(self) -> &'static str {
        match self {
            CountedOp::QuantizeMxfp8 => "quantize_mxfp8",
            CountedOp::QuantizeNvfp4 => "quantize_nvfp4",
            CountedOp::Mxfp8Quantize2dRange => "mxfp8_quantize_2d_range",
            CountedOp::Nvfp4Quantize2dRange => "nvfp4_quantize_2d_range",
            CountedOp::Mxfp8Scales2d => "mxfp8_scales_2d",
            CountedOp::Nvfp4Finish2d => "nvfp4_finish_2d",
        }
    }

    const fn index(self) -> usize {
        self as usize
    }
}

/// Calls per [`CountedOp`] since the device was created.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct OpCalls([u64; CountedOp::ALL.len()]);

impl OpCalls {
    pub(crate) fn note(&mut self, op: CountedOp) {
        self.0[op.index()] += 1;
    }

    pub(crate) fn get(&self, op: CountedOp) -> u64 {
        self.0[op.index()]
    }
}

impl crate::Device {
    /// How many times `op` was called on this device since it was created (every call that
    /// entered the op, on every backend; see [`CountedOp`]). For tests and diagnostics; it
    /// changes no behaviour.
    pub fn op_calls(&self, op: CountedOp) -> u64 {
        self.calls.get(op)
    }

    /// Counts one call of `op`.
    pub(crate) fn count_call(&mut self, op: CountedOp) {
        self.calls.note(op);
    }
}
