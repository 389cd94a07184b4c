//! The storage and op surface the training layers use: typed buffers, views with byte-level
//! aliasing, and the element-wise, reduction, quantization, optimizer, matmul and model ops.
//!
//! # Purpose
//! Everything above this crate (collectives, param/grad buffers, optimizers, models) manipulates
//! memory only through a [`Device`] and [`View`]s of it, so that the same code runs on the CPU
//! reference backend and, behind the `cuda` feature, on a GPU.
//!
//! # The key decision: views are plain handles, like device pointers
//! A [`View`] is `(buffer, byte offset, element count, dtype)`: `Copy`, comparable, and free of
//! borrows. Ops take views and a `&mut Device`. This is how CUDA memory works (a pointer and a
//! length) and it is what lets the layers above express the aliasing they need — a bf16 staging
//! view over the first half of the bytes of an fp32 gradient buffer is
//! `grads.reinterpret(DType::Bf16)?.slice(0..n)?` and truly shares memory — without fighting the
//! borrow checker or copying. The price is that views are checked at run time: every op validates
//! bounds, dtypes and lengths and returns a [`DeviceError`] instead of touching memory it should not.
//!
//! The op API is shaped so that a CUDA backend can sit behind it unchanged: ops take views and
//! plain scalars (no closures over host memory, no references into device memory), results that
//! come back to the host are values (`sum_squares`, `max_abs`, losses, NVFP4 amaxes), and every
//! op — reductions included — takes `&mut self`, since on a GPU each launches work on the
//! device's stream and may use its scratch memory.
//!
//! # Aliasing rule
//! An op's outputs (including in/out operands such as `axpy`'s `y` or AdamW's moments) must be
//! pairwise disjoint and must not share a byte with any of its inputs; inputs may overlap each
//! other (`matmul(a, a, …)` is fine). A violation is [`DeviceError::Overlap`], never an
//! order-dependent result. This is the `__restrict__` contract a GPU kernel needs, so results
//! are identical on both backends. In-place updates are expressed by ops with one in/out view
//! ([`Device::scale`], [`Device::fill`], [`Device::add_bias`], `axpy`'s `y`), so `axpy(a, x, x)`
//! is rejected (use `scale(x, 1 + a)`). [`Device::copy`] alone allows overlap (`memmove`).
//!
//! # Arithmetic contract
//! - Float ops read f32, bf16 and f16 exactly as f32, compute in f32 one IEEE operation at a
//!   time in the order each op documents — never a fused multiply-add — and round the result
//!   once to the destination dtype with round-to-nearest-even (bf16 and f16 exactly as
//!   `half`'s `from_f32`).
//! - Reductions run in index order (f64 accumulators where an op says so), so results are
//!   bitwise reproducible run to run and independent of how the CPU backend chunks its loops.
//! - The f64 sums of squares ([`Device::sum_squares`], [`Device::mse_loss`]) use one fixed
//!   *blocked* order instead, which a GPU reproduces in parallel: the terms are cut into
//!   consecutive blocks of [`SUM_BLOCK`] = 4096 elements of the view (the last block may be
//!   shorter); each block is summed in index order from `+0.0`; the sums of each run of
//!   [`SUM_GROUP`] = 32 consecutive blocks are added in index order from `+0.0`; the group sums
//!   are then added in index order from `+0.0`. Each term (`x²`, or `(p − t)²` with the difference in f64) is
//!   one f64 operation per step, never fused.
//! - Per-call scalars derived from hyper-parameters (AdamW's bias corrections, loss scales) are
//!   computed once in f64 and rounded to f32, as PyTorch does with its Python-float scalars.
//! - `tanh`, `exp` and `ln` are evaluated in f64 and rounded to f32 (correctly rounded but for
//!   rare double-rounding cases), not with the platform's f32 libm.
//! - Quantization and dequantization are `lowbit-formats`' functions applied to the views'
//!   bytes: identical bits by construction (the CUDA kernels port its encoders bit for bit).
//! - NaN payloads produced by float arithmetic are unspecified (see the CUDA backend below);
//!   whether a result is NaN is not.
//!
//! # Invariants
//! - New buffers are zero-filled, on every backend.
//! - An op either fully succeeds or leaves memory untouched: dtypes, lengths, shapes,
//!   hyper-parameters, bounds, liveness and overlap are all checked (and a quantizer's format
//!   errors raised) before the first byte is written.
//! - Bad views and bad arguments are errors, never panics.
//! - A freed buffer's views are rejected ([`DeviceError::Freed`]), never reused silently: buffer
//!   ids carry a generation, so a stale view stays invalid after its slot is reused; they also
//!   carry the device, so a view of another [`Device`] is rejected too.
//! - [`Device::allocated_bytes`] is exactly the sum of the live buffers' sizes.
//!
//! # The ops
//! Memory: `alloc`, `free`, `upload`, `download` (and `download_f32_into`), `read_bytes` (and
//! `read_bytes_into`), `write_bytes`, `zero`, `copy`.
//! Element-wise: [`Device::fill`], [`Device::cast`], [`Device::scale`], [`Device::axpy`],
//! [`Device::add`]. Reductions: [`Device::sum_squares`], [`Device::has_non_finite`],
//! [`Device::max_abs`]. Quantization: [`Device::quantize_mxfp8`] (and
//! [`Device::quantize_mxfp8_many`]: many matrices, one launch where it can),
//! [`Device::dequantize_mxfp8_rowwise`], [`Device::dequantize_mxfp8_columnwise`],
//! [`Device::quantize_nvfp4`], [`Device::dequantize_nvfp4_rowwise`],
//! [`Device::dequantize_nvfp4_columnwise`]. Optimizers: [`Device::adamw`],
//! [`Device::sgd_momentum`]. [`Device::matmul`], and [`Device::matmul_tc`] (the tensor-core
//! product: cuBLASLt on CUDA, close to but not bit-identical with its CPU reference). Model ops (f32, row-major `[rows, cols]`):
//! [`Device::add_bias`], [`Device::bias_grad`], [`Device::rms_norm`],
//! [`Device::rms_norm_backward`], [`Device::gelu`], [`Device::gelu_backward`],
//! [`Device::mse_loss`], [`Device::mse_loss_backward`], [`Device::softmax_cross_entropy`],
//! [`Device::softmax_cross_entropy_backward`]. Decoder ops (f32 activations, ids as integer-valued
//! f32): [`Device::embedding`], [`Device::embedding_backward`], [`Device::rope`],
//! [`Device::swiglu`], [`Device::swiglu_backward`], [`Device::cross_entropy_rows`].
//! Counters: [`Device::op_calls`] counts the calls of every quantization entry point
//! ([`CountedOp`]) on every backend, so tests can state how often a step quantizes.
//!
//! # The CUDA backend (feature `cuda`)
//! `Device::cuda` opens GPU `ordinal` through `cudarc` (the driver library is loaded at run
//! time, so every build compiles and links without CUDA; a missing driver or GPU is a
//! [`DeviceError::Cuda`], never a panic). Decisions:
//! - **Same handles, same checks.** Buffers are driver allocations (zero-filled) in the same
//!   generation-checked slot table as the CPU backend; every op validates its arguments and
//!   views by the same rules, with the same errors, before anything is enqueued.
//! - **One stream per device.** Every op is enqueued on it in call order; host reads
//!   (downloads, reductions, losses, NVFP4 amaxes) synchronise it; [`Device::synchronize`]
//!   waits for everything. Layers that drive the same memory from another stream (NCCL) get the
//!   stream, the ordinal and validated raw addresses from `Device::cuda_stream`,
//!   `Device::cuda_ordinal` and `Device::cuda_device_ptr`, and order themselves with
//!   events.
//! - **Bit-exact with the CPU.** Kernels (`crates/lowbit-kernels/ops.cu`, `crates/lowbit-kernels/mxfp8.cu`, and `crates/lowbit-kernels/nvfp4.cu` for
//!   NVFP4 2D scales, stochastic rounding, the Hadamard transform and `nvfp4_finish_2d`; PTX
//!   embedded by [`ptx`]) follow the arithmetic contract above operation for operation: `_rn`
//!   intrinsics (never contracted into FMA), conversions as integer code reproducing `half` and
//!   `lowbit-formats`, `tanh`/`exp`/`ln` in double, sums in the CPU's order (one thread per row or
//!   column where the CPU sums sequentially), order-free maxima in parallel. One relaxation: the
//!   *payload* of a NaN produced by float arithmetic is unspecified (Rust does not specify it and
//!   x86 and CUDA differ); NaN-ness is exact, and data movement (fill, cast, copy, quantization
//!   bytes) is bit-exact including NaN payloads.
//! - **Host fallback, never a gap.** An op without a kernel (or a variant its kernel does not
//!   cover) validates its views, downloads their bytes, runs the CPU implementation on them and
//!   uploads its outputs (only if it succeeded): every op works on CUDA, with the CPU's bits by
//!   construction, and the CPU code path is the same function body. [`Device::host_fallback_ops`]
//!   lists those ops and [`Device::host_fallback_calls`] counts the calls that took the fallback.
//!   Today: MXFP8 and NVFP4 with the Error NaN policy, MXFP8 with more than 65535·32 rows (a
//!   grid limit), and calls whose arguments the library rejects (sharded
//!   2D ops, `nvfp4_finish_2d`, the Hadamard transform with 2D scales or rows % 16 != 0), so
//!   that its error comes back unchanged.
//! - **Blocked sums.** `sum_squares` and `mse_loss` compute the per-block f64 sums on the
//!   device (one thread per 4096-element block, staged through shared memory so the loads
//!   coalesce), each warp adds its 32 block sums in order, and the host adds those group sums
//!   in index order, so no gradient is downloaded for the grad norm: 8 bytes come back per
//!   131072 elements.
//! - **Kernels:** fill, cast, scale, axpy, add, max_abs, has_non_finite, sum_squares,
//!   mse_loss, fused AdamW, SGD with momentum, matmul (one thread per output, not a tuned
//!   GEMM), the model ops, the decoder ops (`crates/lowbit-kernels/llm.cu`), MXFP8 quantization (every mode: rowwise, columnwise, both in one
//!   pass, 2D; E4M3 and E5M2; bf16, f16 and f32 inputs) and dequantization, NVFP4
//!   quantization (1D and 2D with the amax pass on the device, transposed columnwise copy,
//!   stochastic rounding, the Hadamard transform) and dequantization, and the sharded 2D
//!   primary-weight ops (tile-amax folds, MXFP8 and NVFP4 range codes, MXFP8 2D scales).
//! - `crates/lowbit-device/tests/cuda.rs` runs every op on both backends and compares every
//!   byte; it needs a GPU (it fails, never skips, without one). `benches/cuda_bench.rs` times
//!   the hot kernels against a device-to-device copy of the same run.
//!
//! # Non-goals
//! Ranks and collectives (`lowbit-comm`), buffer layouts (`lowbit-buffers`), autograd, general
//! tensor shapes, strides or broadcasting beyond what the ops state. The CPU backend is a
//! reference: each op runs on the calling thread (parallelism comes from one device per rank
//! thread), and `matmul` is a plain triple loop, not a tuned GEMM; the CUDA `matmul` is its
//! bit-exact counterpart (one thread per output, k in order), not cuBLAS. Multi-stream
//! scheduling inside one device is not attempted, and CUDA graphs only as one-kernel graphs of
//! a batched call that repeats ([`Device::prepared_calls`]), not of whole steps.

mod counters;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod ops;
pub mod ptx;
mod slots;

/// The `cudarc` this crate was built with, for layers that drive the same CUDA context (NCCL).
#[cfg(feature = "cuda")]
pub use cudarc;

/// Element codecs between little-endian device bytes and f32, shared with the layers that move
/// raw payloads (the in-process collectives reduce with them).
pub mod codec {
    pub use crate::cpu::{decode_into, encode_f32};
}

pub use counters::CountedOp;
pub use half::{bf16, f16};
pub use lowbit_formats::{Copies, Fp8Kind, Mxfp8Config, Nvfp4Config};
pub use ops::{ATTENTION_MAX_HEAD_DIM, AttentionSpec, FLASH_HEAD_DIMS};
pub use ops::{
    AdamW, Format2d, MatmulMode, MatmulMxSpec, MatmulSpec, MatmulTcSpec, MxArg, MxLayout,
    MxOperand, Mxfp8Views, Nvfp4Amax, Nvfp4Views, PendingAmaxes, PendingNvfp4Amax, Piece2d,
    RopeSpec, SUM_BLOCK, SUM_GROUP, SgdMomentum,
};

use std::ops::Range;

/// Element type of a buffer view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE binary32.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE binary16.
    F16,
    /// Raw bytes: fp8 and packed fp4 payloads, block scales.
    U8,
}

impl DType {
    /// The lower-case name (`f32`, `bf16`, `f16`, `u8`), for messages and tables.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
            DType::U8 => "u8",
        }
    }

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }

    /// Whether arithmetic ops accept this dtype.
    pub const fn is_float(self) -> bool {
        !matches!(self, DType::U8)
    }
}

/// Errors of device operations. Each names what was wrong.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum DeviceError {
    /// A view extends past its buffer, or a sub-range past its view.
    #[error("{what}: range {start}..{end} is out of bounds (length {len})")]
    OutOfBounds {
        /// Which operation or view.
        what: &'static str,
        /// Start of the requested range.
        start: usize,
        /// End of the requested range.
        end: usize,
        /// Length available.
        len: usize,
    },
    /// An op got a view of the wrong dtype.
    #[error("{what}: expected {expected}, got {got:?}")]
    DType {
        /// Which operation.
        what: &'static str,
        /// What the op accepts.
        expected: &'static str,
        /// What it got.
        got: DType,
    },
    /// Two views that must have the same length do not.
    #[error("{what}: lengths differ ({a} vs {b})")]
    Length {
        /// Which operation.
        what: &'static str,
        /// First length.
        a: usize,
        /// Second length.
        b: usize,
    },
    /// A reinterpretation whose byte length or offset does not fit the new dtype.
    #[error("cannot view {bytes} bytes at offset {offset} as {dtype:?}")]
    Reinterpret {
        /// Byte length of the view.
        bytes: usize,
        /// Byte offset of the view.
        offset: usize,
        /// Requested dtype.
        dtype: DType,
    },
    /// A view of a buffer that was freed (or never existed on this device).
    #[error("view of buffer {0} which is freed or belongs to another device")]
    Freed(u32),
    /// Input views of an op overlap its output where that is not allowed.
    #[error("{0}: input and output views overlap")]
    Overlap(&'static str),
    /// A quantization error from `lowbit-formats`.
    #[error(transparent)]
    Format(#[from] lowbit_formats::FormatError),
    /// Arguments that describe no valid operation: a shape that does not match the views, a
    /// hyper-parameter out of range, a class index out of range, a missing or unexpected view.
    #[error("{what}: {reason}")]
    Invalid {
        /// Which operation.
        what: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Something this backend cannot do.
    #[error("{0}")]
    Unsupported(String),
    /// A CUDA driver call failed, or no CUDA driver or GPU is available.
    #[error("CUDA: {0}")]
    Cuda(String),
}

/// Result of device operations.
pub type Result<T, E = DeviceError> = std::result::Result<T, E>;

/// Identifies one allocation of a [`Device`]. The generation makes stale handles detectable.
/// Ordered (device, allocation slot, generation) so that views can be sorted by where they lie.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId {
    /// The device that allocated the buffer.
    device: u32,
    index: u32,
    generation: u32,
}

/// A typed window onto a buffer: a handle, not a borrow (see the crate docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct View {
    buffer: BufferId,
    /// Byte offset of element 0 within the buffer.
    offset: usize,
    /// Number of elements.
    len: usize,
    dtype: DType,
}

impl View {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Bytes covered.
    pub fn byte_len(&self) -> usize {
        self.len * self.dtype.size()
    }
    /// Byte offset within the buffer.
    pub fn byte_offset(&self) -> usize {
        self.offset
    }
    /// Byte range within the buffer.
    pub fn byte_range(&self) -> Range<usize> {
        self.offset..self.offset + self.byte_len()
    }
    /// The buffer this view belongs to.
    pub fn buffer(&self) -> BufferId {
        self.buffer
    }

    /// The elements `range` of this view.
    pub fn slice(&self, range: Range<usize>) -> Result<View> {
        if range.start > range.end || range.end > self.len {
            return Err(DeviceError::OutOfBounds {
                what: "View::slice",
                start: range.start,
                end: range.end,
                len: self.len,
            });
        }
        Ok(View {
            offset: self.offset + range.start * self.dtype.size(),
            len: range.end - range.start,
            ..*self
        })
    }

    /// The same bytes seen as `dtype` (byte-level aliasing). The byte length must be a multiple
    /// of the new element size and the offset aligned to it.
    pub fn reinterpret(&self, dtype: DType) -> Result<View> {
        let bytes = self.byte_len();
        if !bytes.is_multiple_of(dtype.size()) || !self.offset.is_multiple_of(dtype.size()) {
            return Err(DeviceError::Reinterpret {
                bytes,
                offset: self.offset,
                dtype,
            });
        }
        Ok(View {
            len: bytes / dtype.size(),
            dtype,
            ..*self
        })
    }

    /// Whether the two views share at least one byte.
    pub fn overlaps(&self, other: &View) -> bool {
        let (a, b) = (self.byte_range(), other.byte_range());
        self.buffer == other.buffer && a.start < b.end && b.start < a.end
    }

    /// The sub-views `[0, mid)` and `[mid, len)`.
    pub fn split_at(&self, mid: usize) -> Result<(View, View)> {
        Ok((self.slice(0..mid)?, self.slice(mid..self.len)?))
    }

    /// This view and `next` as one view, when `next` starts in the same buffer where this one
    /// ends, with the same dtype (what lets an element-wise operation over consecutive pieces
    /// run as one launch).
    pub fn joined(&self, next: &View) -> Option<View> {
        (self.buffer == next.buffer
            && self.dtype == next.dtype
            && self.offset + self.byte_len() == next.offset)
            .then(|| View {
                len: self.len + next.len,
                ..*self
            })
    }
}

/// A host element type that maps to a [`DType`], for uploads and downloads.
pub trait HostElem: Copy + Default + Send + Sync + 'static {
    /// The device dtype of this host type.
    const DTYPE: DType;
    /// Little-endian bytes of a slice.
    fn to_bytes(src: &[Self]) -> Vec<u8>;
    /// Decodes little-endian bytes (length a multiple of the element size).
    fn from_bytes(bytes: &[u8]) -> Vec<Self>;
    /// Writes the little-endian bytes of `src` over `dst` (exactly their length).
    fn encode_into(src: &[Self], dst: &mut [u8]) {
        dst.copy_from_slice(&Self::to_bytes(src));
    }
}

macro_rules! host_elem {
    ($t:ty, $d:expr, $n:expr, $to:expr, $from:expr) => {
        impl HostElem for $t {
            const DTYPE: DType = $d;
            fn to_bytes(src: &[Self]) -> Vec<u8> {
                let mut out = vec![0u8; std::mem::size_of_val(src)];
                Self::encode_into(src, &mut out);
                out
            }
            fn encode_into(src: &[Self], dst: &mut [u8]) {
                for (d, v) in dst.chunks_exact_mut($n).zip(src) {
                    d.copy_from_slice(&$to(*v));
                }
            }
            fn from_bytes(bytes: &[u8]) -> Vec<Self> {
                bytes
                    .chunks_exact($n)
                    .map(|c| $from(c.try_into().expect("chunk size")))
                    .collect()
            }
        }
    };
}

host_elem!(f32, DType::F32, 4, f32::to_le_bytes, f32::from_le_bytes);
host_elem!(
    bf16,
    DType::Bf16,
    2,
    |v: bf16| v.to_bits().to_le_bytes(),
    |b: [u8; 2]| bf16::from_bits(u16::from_le_bytes(b))
);
host_elem!(
    f16,
    DType::F16,
    2,
    |v: f16| v.to_bits().to_le_bytes(),
    |b: [u8; 2]| f16::from_bits(u16::from_le_bytes(b))
);
host_elem!(u8, DType::U8, 1, |v: u8| [v], |b: [u8; 1]| b[0]);

/// Which implementation a [`Device`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// The reference CPU backend.
    Cpu,
    /// An NVIDIA GPU through the CUDA driver (feature `cuda`).
    Cuda,
}

/// One rank's memory and compute. `Send`, so a rank thread can own it; not shared between ranks.
#[derive(Debug)]
pub struct Device {
    backend: Backend,
    /// Calls of the quantization entry points ([`Device::op_calls`]).
    calls: counters::OpCalls,
    /// The largest [`Device::allocated_bytes`] seen since creation or [`Device::reset_peak`].
    peak: usize,
    /// How [`Device::matmul`] computes.
    matmul_mode: MatmulMode,
    /// [`MatmulMode::Bf16`]'s grow-only buffer of bf16 operand casts.
    matmul_scratch: Option<View>,
    /// [`Device::matmul_mx`]'s grow-only buffer of quantized float operands.
    mx_scratch: Option<View>,
}

#[derive(Debug)]
enum Backend {
    Cpu(cpu::CpuDevice),
    /// Boxed: a CUDA device's handles, tables and kernel choices are several times the CPU
    /// backend's size.
    #[cfg(feature = "cuda")]
    Cuda(Box<cuda::CudaDevice>),
}

impl Device {
    /// A CPU device.
    pub fn cpu() -> Device {
        Device {
            backend: Backend::Cpu(cpu::CpuDevice::new()),
            calls: counters::OpCalls::default(),
            peak: 0,
            matmul_mode: MatmulMode::Exact,
            matmul_scratch: None,
            mx_scratch: None,
        }
    }

    /// A device on the CUDA GPU `ordinal`, with its own stream. Every op of this device is
    /// enqueued on that stream in call order; results that come back to the host (downloads,
    /// reductions, losses) synchronise it. Fails with [`DeviceError::Cuda`] — never a panic —
    /// when the CUDA driver library is missing, no such GPU exists, or the kernels cannot be
    /// loaded.
    #[cfg(feature = "cuda")]
    pub fn cuda(ordinal: usize) -> Result<Device> {
        Ok(Device {
            backend: Backend::Cuda(Box::new(cuda::CudaDevice::new(ordinal)?)),
            calls: counters::OpCalls::default(),
            peak: 0,
            matmul_mode: MatmulMode::Exact,
            matmul_scratch: None,
            mx_scratch: None,
        })
    }

    /// Which backend this is.
    pub fn kind(&self) -> DeviceKind {
        match self.backend {
            Backend::Cpu(_) => DeviceKind::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => DeviceKind::Cuda,
        }
    }

    /// Allocates a zero-filled buffer of `len` elements and returns the view of all of it.
    ///
    /// # Panics
    /// When the device cannot allocate (a GPU out of memory); [`Device::try_alloc`] returns that
    /// as an error instead. The CPU backend aborts on allocation failure like any `Vec`.
    pub fn alloc(&mut self, dtype: DType, len: usize) -> View {
        match self.try_alloc(dtype, len) {
            Ok(v) => v,
            Err(e) => panic!("cannot allocate {len} {dtype:?} elements: {e}"),
        }
    }

    /// [`Device::alloc`], with a failed allocation (or a size that overflows) as an error.
    pub fn try_alloc(&mut self, dtype: DType, len: usize) -> Result<View> {
        let bytes = len
            .checked_mul(dtype.size())
            .ok_or_else(|| DeviceError::Invalid {
                what: "alloc",
                reason: format!("{len} {dtype:?} elements overflow usize"),
            })?;
        let buffer = match &mut self.backend {
            Backend::Cpu(c) => c.alloc(bytes),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.alloc(bytes)?,
        };
        self.peak = self.peak.max(self.allocated_bytes());
        Ok(View {
            buffer,
            offset: 0,
            len,
            dtype,
        })
    }

    /// Frees the buffer `view` belongs to; every view of it becomes invalid.
    pub fn free(&mut self, view: View) -> Result<()> {
        match &mut self.backend {
            Backend::Cpu(c) => c.free(view.buffer),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.free(view.buffer),
        }
    }

    /// Bytes currently allocated on this device.
    pub fn allocated_bytes(&self) -> usize {
        match &self.backend {
            Backend::Cpu(c) => c.allocated_bytes(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.allocated_bytes(),
        }
    }

    /// The most bytes allocated at once since the device was made or since the last
    /// [`Device::reset_peak`]: what memory accounting of transient buffers is checked against.
    pub fn peak_allocated_bytes(&self) -> usize {
        self.peak
    }

    /// Starts a new peak measurement at the bytes allocated now.
    pub fn reset_peak(&mut self) {
        self.peak = self.allocated_bytes();
    }

    /// Copies host elements into `dst` (dtype and length must match).
    pub fn upload<T: HostElem>(&mut self, dst: View, src: &[T]) -> Result<()> {
        check_dtype("upload", dst, T::DTYPE)?;
        check_len("upload", dst.len(), src.len())?;
        match &mut self.backend {
            // Encoded straight into the buffer: no host copy in between (a checkpoint load
            // uploads the whole state).
            Backend::Cpu(c) => {
                cpu::in_parallel(src, c.bytes_mut(dst)?, T::DTYPE.size(), T::encode_into)
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.write_bytes(dst, &T::to_bytes(src))?,
        }
        Ok(())
    }

    /// Copies `src` to the host (its dtype must be `T`'s).
    pub fn download<T: HostElem>(&self, src: View) -> Result<Vec<T>> {
        check_dtype("download", src, T::DTYPE)?;
        Ok(T::from_bytes(&self.read_bytes(src)?))
    }

    /// Writes raw bytes over `dst`'s bytes (any dtype).
    pub fn write_bytes(&mut self, dst: View, src: &[u8]) -> Result<()> {
        check_len("write_bytes", dst.byte_len(), src.len())?;
        match &mut self.backend {
            Backend::Cpu(c) => c.bytes_mut(dst)?.copy_from_slice(src),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.write_bytes(dst, src)?,
        }
        Ok(())
    }

    /// Reads `src`'s bytes (any dtype). On a GPU this waits for the work queued before it.
    pub fn read_bytes(&self, src: View) -> Result<Vec<u8>> {
        let mut out = vec![0u8; src.byte_len()];
        self.read_bytes_into(src, &mut out)?;
        Ok(out)
    }

    /// Reads `src`'s bytes (any dtype) into `dst`, of the same byte length: [`Device::read_bytes`]
    /// without allocating. On a GPU a device-to-host copy into (pageable) `dst` that waits for
    /// the work queued before it; on the CPU a copy that spreads a large view over the cores,
    /// because copying into freshly allocated memory is bound by its page faults, not by
    /// the memory bandwidth.
    pub fn read_bytes_into(&self, src: View, dst: &mut [u8]) -> Result<()> {
        check_len("read_bytes", src.byte_len(), dst.len())?;
        match &self.backend {
            Backend::Cpu(c) => cpu::copy_parallel(c.bytes(src)?, dst),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.read_bytes_into(src, dst)?,
        }
        Ok(())
    }

    /// Copies the F32 view `src` into `dst` (the same length): [`Device::download`] into a
    /// buffer the caller keeps (a checkpoint snapshot reuses its buffers from one save to the
    /// next), with one copy instead of a download and a conversion.
    pub fn download_f32_into(&self, src: View, dst: &mut [f32]) -> Result<()> {
        check_dtype("download", src, DType::F32)?;
        check_len("download", src.len(), dst.len())?;
        // SAFETY: `dst` is a live, exclusively borrowed `[f32]`; its memory viewed as bytes has
        // alignment 1 and exactly `size_of_val(dst)` bytes, and every bit pattern is a valid
        // f32, so whatever bytes are written leave valid values. `dst` is used again only
        // after the last use of `bytes`.
        let bytes = unsafe {
            std::slice::from_raw_parts_mut(
                dst.as_mut_ptr().cast::<u8>(),
                std::mem::size_of_val(dst),
            )
        };
        self.read_bytes_into(src, bytes)?;
        // The device's bytes are little-endian; a big-endian host swaps them in place.
        if cfg!(target_endian = "big") {
            dst.iter_mut()
                .for_each(|v| *v = f32::from_bits(u32::from_le(v.to_bits())));
        }
        Ok(())
    }

    /// Sets every byte of `view` to zero.
    pub fn zero(&mut self, view: View) -> Result<()> {
        match &mut self.backend {
            Backend::Cpu(c) => c.bytes_mut(view)?.fill(0),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.zero(view)?,
        }
        Ok(())
    }

    /// Copies `src` into `dst` (same dtype and length). Overlapping views behave like `memmove`.
    pub fn copy(&mut self, src: View, dst: View) -> Result<()> {
        check_dtype_eq("copy", src, dst)?;
        check_len("copy", src.len(), dst.len())?;
        match &mut self.backend {
            Backend::Cpu(c) => c.copy_within(src, dst),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.copy(src, dst),
        }
    }

    /// Waits until every op queued on this device has finished (a no-op on the CPU, whose ops
    /// complete before they return). Errors of asynchronous GPU work surface here at the latest.
    pub fn synchronize(&mut self) -> Result<()> {
        match &mut self.backend {
            Backend::Cpu(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.synchronize(),
        }
    }

    /// The ops (or op variants) that have no device kernel yet and run as a host fallback on a
    /// GPU device: the views' bytes are downloaded, the CPU implementation runs on them, and the
    /// outputs are uploaded. Correct and bit-identical by construction, but slow; each such call
    /// is counted in [`Device::host_fallback_calls`].
    pub fn host_fallback_ops() -> &'static [&'static str] {
        host::FALLBACK_OPS
    }

    /// How many times each op took the host fallback on this device, by op name (empty on the
    /// CPU backend, where every op is native).
    pub fn host_fallback_calls(&self) -> Vec<(&'static str, u64)> {
        match &self.backend {
            Backend::Cpu(_) => Vec::new(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.fallback_calls(),
        }
    }

    /// How many batched calls on this device launched CUDA graphs prepared for their items
    /// (made by the second call with the same items, launched by it and every later one, which
    /// skip their checks and table building; 0 on the CPU backend, which prepares nothing; see
    /// [`Device::mxfp8_scales_2d_many`]).
    pub fn prepared_calls(&self) -> u64 {
        match &self.backend {
            Backend::Cpu(_) => 0,
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.prepared_calls(),
        }
    }

    /// The stream every op of this CUDA device is enqueued on (`None` on the CPU). Work another
    /// stream does on this device's memory must be ordered against it with events.
    #[cfg(feature = "cuda")]
    pub fn cuda_stream(&self) -> Option<&std::sync::Arc<cudarc::driver::CudaStream>> {
        match &self.backend {
            Backend::Cuda(g) => Some(g.stream()),
            Backend::Cpu(_) => None,
        }
    }

    /// The GPU ordinal of a CUDA device (`None` on the CPU).
    #[cfg(feature = "cuda")]
    pub fn cuda_ordinal(&self) -> Option<usize> {
        match &self.backend {
            Backend::Cuda(g) => Some(g.ordinal()),
            Backend::Cpu(_) => None,
        }
    }

    /// The device address of `view`'s first byte, after checking that the view is a live,
    /// in-bounds view of this CUDA device. [`DeviceError::Unsupported`] on the CPU backend.
    #[cfg(feature = "cuda")]
    pub fn cuda_device_ptr(&self, view: View) -> Result<u64> {
        match &self.backend {
            Backend::Cuda(g) => g.device_ptr(view),
            Backend::Cpu(_) => Err(DeviceError::Unsupported(
                "cuda_device_ptr: this is a CPU device".into(),
            )),
        }
    }

    /// Selects one of several versions of a CUDA kernel, for benchmarks and tests that compare
    /// them (`("mxfp8_both", 1 | 4 | 5)`: the rowwise + columnwise MXFP8 kernel, 4 by default;
    /// `("mxfp8_many", 0..=2)`: how [`Device::quantize_mxfp8_many`] launches version 4, 0 by
    /// default: 2 where its launches average at least four matrices, else 1; 2: one launch per
    /// shape (the matrix is a grid index), 1: one launch for all (each CTA looks its matrix up);
    /// `("nvfp4", 1..=10)`: the bf16 amax pass and the NVFP4 kernels, 10 by default: 9 with
    /// its both-copies kernel launched as the parameters kernel's programmatic dependent (its
    /// CTAs copy their first tile while the parameters are made); 9: 8 with
    /// the thresholds from a table of the 8 scale mantissas in shared memory and each column's
    /// codes stored by two lanes in one instruction; 8: 7 with
    /// shorter dependent chains per block in the both-copies kernel (one conversion for two
    /// scale bytes, amax trees, |x| taken once); 7: 6 with the
    /// codes' selects and bit merges as integer multiply-adds (the FMA pipe instead of the ALU);
    /// 6: 5 over pairs of 256-row tiles (whole-sector columnwise scale stores); 5: both copies
    /// from one read of X; 4: 3 with the shared-memory columnwise kernel;
    /// `("nvfp4_finish_2d", 1..=7)`: how
    /// [`Device::nvfp4_finish_2d_many`] runs, 7 by default: one launch for the 512x512 blocks
    /// of every shape (128 matrices a launch; as 5 where the call has fewer than 128 blocks),
    /// 5: one launch per shape (512x512
    /// blocks, the scale copies in whole 32-byte sectors; 4's tiles where a launch would have
    /// fewer than 128 blocks; 6: the blocks always) and one host read, 4: the same over
    /// 256x256 tiles, 3: 4 with the scales in a second launch, 2: all matrices in one launch
    /// (each CTA looks its matrix up), 1: one `nvfp4_finish_2d` per matrix; `("mxfp8x", 2 | 3)`: the bf16 kernels of
    /// `crates/lowbit-kernels/mxfp8x.cu`, 3 by default, v4's technique (columnwise-only 0.99x of a copy on an
    /// H100, 0.75x with 2); `("sum_squares", 0..=3)`: the blocked sums of squares, 0 by default
    /// (3 for f32 views, 2 for 16-bit ones), 1 loads 128 bytes of each of 32 blocks per warp
    /// instruction, 2 512 contiguous bytes of one block, 3 is 1 with a 256-byte L2 prefetch hint
    /// in `sum_squares_each` (on an H200: f32 0.82x / 0.75x / 0.87x of a copy, bf16 0.49x /
    /// 0.79x / 0.72x)); `("adamw", 1 | 2)`: 1 by default, an element a thread; 2 four elements
    /// a thread with vector loads and stores where every view is aligned and n % 4 == 0 (faster
    /// alone, slower beside the gathers of the one-call step); `("sum_squares_beside", N)`: the
    /// most CTAs of a staged sum of squares launched beside collectives (every stage of
    /// [`Device::sum_squares_each_staged`] but the last), which then stride over the warps; 0:
    /// no cap; by default a quarter of the multiprocessors (NCCL's CTAs keep the rest);
    /// `("prepared", 0 | 1)`: 1 by default, a batched call with the items of earlier ones
    /// launches the CUDA graphs prepared for them ([`Device::prepared_calls`]); 0 makes every
    /// call fresh (and drops the prepared graphs); `("fast_xent_exp", 0 | 1)` and
    /// `("fast_xent_threads", 0 | 64..=1024)`: the fast cross-entropy of [`MatmulMode::Bf16`]
    /// (its gradient's `__expf` times the reciprocal of the sum, 0, the default, or the exact
    /// kernels' exp through double and division, 1; threads per row, a multiple of 32, or 0,
    /// the default, for 1024); `("fast_rms_threads", 0 | 128)`: the fast RMSNorm's CTAs for
    /// float4 rows up to 2048 columns, 256 threads (0, the default) or 128;
    /// `("flash_fwd_tiles", 0..=2)`: the flash attention forward's m16 tiles of query rows per
    /// warp, one at head dim 64 and two at 128 (0, the default), one (1) or two (2), of the
    /// mma.sync kernels; `("flash_wgmma", 0 | 1)`: the forward, the dK/dV pass and (at dim 128)
    /// the dQ pass on Hopper's wgmma kernels where the GPU is compute capability 9.0 (0, the
    /// default), or the mma.sync ones everywhere (1) (not the same bits: another order of the
    /// f32 additions);
    /// `("matmul_mx_kernel", 0..=3)`: [`Device::matmul_mx`] of two rowwise planes through their
    /// exact bf16 dequantization and cuBLASLt (0, the default) or the block-scaled FP8 kernel,
    /// v0 (1), v1 (2) or on Hopper's wgmma (3; v1 where k % 16 != 0 or a plane is not 16-byte
    /// aligned) (each block summed on the FP8 tensor cores, so not the same bits).
    /// Every version gives the same bytes (and the same sums), but for the `fast_*` ones (each
    /// deterministic, with its own fixed summation tree).
    #[cfg(feature = "cuda")]
    #[doc(hidden)]
    pub fn set_cuda_kernel_variant(&mut self, kernel: &str, version: u32) -> Result<()> {
        match &mut self.backend {
            Backend::Cuda(g) => g.set_kernel_variant(kernel, version),
            Backend::Cpu(_) => Ok(()),
        }
    }

    /// Checks an op's views (live, in bounds, the overlap rule) on whichever backend this is.
    pub(crate) fn check_views(&self, op: &'static str, ins: &[View], outs: &[View]) -> Result<()> {
        match &self.backend {
            Backend::Cpu(c) => c.check_views(op, ins, outs),
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.check_views(op, ins, outs),
        }
    }

    /// Reads the float elements of `v` as f32 (exactly).
    pub(crate) fn read_f32(&self, v: View) -> Result<Vec<f32>> {
        match &self.backend {
            Backend::Cpu(c) => c.read_f32(v),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => {
                check_float("read", v)?;
                Ok(cpu::decode_f32(v.dtype(), &self.read_bytes(v)?))
            }
        }
    }

    /// Writes f32 values into the float view `v`, rounding to its dtype (RNE).
    pub(crate) fn write_f32(&mut self, v: View, vals: &[f32]) -> Result<()> {
        match &mut self.backend {
            Backend::Cpu(c) => c.write_f32(v, vals),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => {
                check_float("write", v)?;
                check_len("write", v.len(), vals.len())?;
                let mut bytes = vec![0u8; v.byte_len()];
                cpu::encode_f32(v.dtype(), vals, &mut bytes);
                self.write_bytes(v, &bytes)
            }
        }
    }

    /// Whether this is a CUDA device.
    pub(crate) fn is_cuda(&self) -> bool {
        #[cfg(feature = "cuda")]
        if matches!(self.backend, Backend::Cuda(_)) {
            return true;
        }
        false
    }

    /// The CUDA backend, when this is one.
    #[cfg(feature = "cuda")]
    pub(crate) fn cuda_mut(&mut self) -> Option<&mut cuda::CudaDevice> {
        match &mut self.backend {
            Backend::Cuda(g) => Some(g),
            Backend::Cpu(_) => None,
        }
    }

    /// Counts one host-fallback call of `what` (a no-op on the CPU backend).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    pub(crate) fn note_fallback(&mut self, what: &'static str) {
        match &mut self.backend {
            Backend::Cpu(_) => {}
            #[cfg(feature = "cuda")]
            Backend::Cuda(g) => g.note_fallback(what),
        }
    }
}

pub(crate) fn check_dtype(what: &'static str, v: View, want: DType) -> Result<()> {
    if v.dtype() == want {
        Ok(())
    } else {
        Err(DeviceError::DType {
            what,
            expected: want.name(),
            got: v.dtype(),
        })
    }
}

pub(crate) fn check_float(what: &'static str, v: View) -> Result<()> {
    if v.dtype().is_float() {
        Ok(())
    } else {
        Err(DeviceError::DType {
            what,
            expected: "a float dtype (f32, bf16, f16)",
            got: v.dtype(),
        })
    }
}

pub(crate) fn check_dtype_eq(what: &'static str, a: View, b: View) -> Result<()> {
    check_dtype(what, b, a.dtype())
}

pub(crate) fn check_len(what: &'static str, a: usize, b: usize) -> Result<()> {
    if a == b {
        Ok(())
    } else {
        Err(DeviceError::Length { what, a, b })
    }
}

/// Tiles of a `rows × cols` matrix under 2D MXFP8 scaling (32x32 tiles).
pub fn mxfp8_tile_count(rows: usize, cols: usize) -> usize {
    lowbit_formats::mxfp8::sharded::tile_count(rows, cols)
}
