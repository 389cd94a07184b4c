//! Arithmetic, reduction, quantization, optimizer, matmul and model ops of [`Device`].
//!
//! Every op follows the same three steps, so that it either fully succeeds or writes nothing:
//! 1. check dtypes, lengths and shapes of its views and arguments;
//! 2. borrow all its views at once through [`Device::host_op`], which checks that each is a
//!    live, in-bounds view of this device and that outputs overlap neither each other nor any
//!    input (see "Aliasing" in the crate docs) — on the CPU through the storage's `split`, on a
//!    GPU as the host fallback (download, compute, upload) for ops without a kernel;
//! 3. compute and write.
//!
//! Ops with a CUDA kernel dispatch to it between steps 1 and 2 (`Device::cuda_mut`); the kernel
//! side validates the views with the same rules and errors before launching anything.
//!
//! Element-wise ops stream their views in chunks of [`CHUNK`] elements: decode to f32 into stack
//! buffers, compute, encode to the destination dtype (AdamW updates its f32 state in place in
//! the bytes and stages only the gradient and the new parameters). Everything runs on the
//! calling thread.
//!
//! The ops live in submodules by family: [`elementwise`] (fill, cast, scale, axpy, add and the
//! reductions), [`quant`] (MXFP8 and NVFP4), [`quant2d`] (their 16x16-tile sharded form), [`optim`] (AdamW, SGD with momentum), [`matmul`],
//! [`model`] (bias, RMSNorm, GELU, losses) and [`llm`] (embedding, RoPE, SwiGLU, per-row
//! cross-entropy).

use std::ops::Range;

use crate::cpu::{decode_into, encode_f32};
use crate::{DType, Device, DeviceError, Result, View};

/// Returns the op's result from its CUDA kernel when `$dev` is a CUDA device:
/// `on_cuda!(self, g => g.fill(view, bits));` (nothing in builds without the `cuda` feature).
macro_rules! on_cuda {
    ($dev:expr, $g:ident => $body:expr) => {
        #[cfg(feature = "cuda")]
        if let Some($g) = $dev.cuda_mut() {
            return $body;
        }
    };
}

/// [`MatmulMode::Bf16`]'s fast kernels on CUDA (`cuda/kernels/fast.rs`): the body returns
/// `Result<bool>`, `true` when it did the op (the op then returns `Ok(())`), `false` when the
/// shape or the views have no fast kernel (the op goes on to the exact path).
macro_rules! on_fast_cuda {
    ($dev:expr, $g:ident => $body:expr) => {
        #[cfg(feature = "cuda")]
        if $dev.matmul_mode.is_fast() {
            if let Some($g) = $dev.cuda_mut() {
                if $body? {
                    return Ok(());
                }
            }
        }
    };
}

mod attention;
mod elementwise;
mod flash;
mod llm;
mod matmul;
mod matmul_mx;
mod model;
mod optim;
mod quant;
mod quant2d;

pub use attention::{ATTENTION_MAX_HEAD_DIM, AttentionSpec};
pub use flash::FLASH_HEAD_DIMS;
pub use llm::RopeSpec;
#[cfg(feature = "cuda")]
pub(crate) use llm::id_groups;
pub use matmul::{MatmulMode, MatmulTcSpec};
pub use matmul_mx::{MatmulMxSpec, MxArg, MxLayout, MxOperand};
#[cfg(feature = "cuda")]
pub(crate) use optim::AdamWScalars;
#[cfg(feature = "cuda")]
pub(crate) use quant::Dequant;
pub use quant::{PendingAmaxes, PendingNvfp4Amax};
pub use quant2d::{Format2d, Piece2d};
#[cfg(feature = "cuda")]
pub(crate) use quant2d::{Scales2dItem, scales_2d_lens};

/// Hyper-parameters of one AdamW step (decoupled weight decay, bias correction).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f32,
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// 1-based step number (for bias correction).
    pub step: u64,
    /// The factor the gradient is multiplied by first, in f32 (the clip coefficient; 1: none):
    /// bit for bit what scaling the gradient with [`crate::Device::scale`] before the step
    /// gives, without the pass over the gradient.
    pub grad_scale: f32,
}

/// Hyper-parameters of one SGD-with-momentum step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SgdMomentum {
    /// Learning rate.
    pub lr: f32,
    /// Momentum factor.
    pub momentum: f32,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f32,
}

/// Shape of a matrix product `C[m, n] (+)= op(A) · op(B)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MatmulSpec {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// Contraction length.
    pub k: usize,
    /// A is stored `[k, m]` and used transposed.
    pub trans_a: bool,
    /// B is stored `[n, k]` and used transposed.
    pub trans_b: bool,
    /// Add to C instead of overwriting it.
    pub accumulate: bool,
}

/// Destination views of an MXFP8 quantization (u8 views; `None` skips a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mxfp8Views {
    /// Rowwise data `[rows·cols]` and scales `[rows·ceil(cols/32)]`.
    pub rowwise: Option<(crate::View, crate::View)>,
    /// Columnwise data `[rows·cols]` and scales `[ceil(rows/32)·cols]`.
    pub columnwise: Option<(crate::View, crate::View)>,
}

/// Destination views of an NVFP4 quantization (u8 views; `None` skips a copy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nvfp4Views {
    /// Rowwise packed data `[rows·ceil(cols/2)]` and E4M3 scales `[rows·ceil(cols/16)]`.
    pub rowwise: Option<(crate::View, crate::View)>,
    /// Columnwise (transposed) packed data `[cols·ceil(rows/2)]` and scales
    /// `[cols·ceil(rows/16)]`.
    pub columnwise: Option<(crate::View, crate::View)>,
}

/// The global amaxes an NVFP4 quantization derived its tensor scales from; dequantization needs
/// the one of the copy it reads.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Nvfp4Amax {
    /// Amax of the input (NaN ignored): the rowwise copy's.
    pub rowwise: f32,
    /// Amax of the columnwise copy: equal to `rowwise`, except after the Hadamard transform.
    pub columnwise: f32,
}

/// Elements per chunk of the streaming element-wise loops: 4 KiB of f32 staging per staged
/// operand (at most three), so that the staging stays in L1.
pub(crate) const CHUNK: usize = 1024;

/// Elements per block of the blocked f64 reductions ([`Device::sum_squares`],
/// [`Device::mse_loss`]): each block of this many consecutive elements is summed in index order
/// from `+0.0`; see [`SUM_GROUP`] for how the block sums are added.
///
/// [`Device::sum_squares`]: crate::Device::sum_squares
/// [`Device::mse_loss`]: crate::Device::mse_loss
pub const SUM_BLOCK: usize = 4096;

/// Blocks per group of the blocked f64 reductions: the sums of each run of this many
/// consecutive blocks (the last run possibly shorter) are added in index order from `+0.0`, and
/// the group sums then in index order from `+0.0`. A GPU warp owns one group (a lane per block)
/// and adds its 32 block sums itself, so the host adds one partial per 131072 elements instead
/// of one per 4096 (a serial chain of ~150k dependent additions for a 620M-element shard took
/// ~0.2 ms on the host). Views of at most one group (131072 elements) sum exactly as with two
/// levels.
pub const SUM_GROUP: usize = 32;

// The streaming loops hand whole chunks to a `BlockedSum`; a chunk never straddles two blocks.
const _: () = assert!(SUM_BLOCK.is_multiple_of(CHUNK));

/// The blocked summation order of the f64 reductions, which a GPU reproduces in parallel: the
/// terms are split into consecutive blocks of [`SUM_BLOCK`]; each block is summed in index
/// order from `+0.0` (the last one possibly shorter); the block sums of each run of
/// [`SUM_GROUP`] blocks are added in index order from `+0.0`; then the group sums in index
/// order from `+0.0` ([`add_partials`]).
#[derive(Default)]
pub(crate) struct BlockedSum {
    /// The sums of the completed groups, added in order.
    total: f64,
    /// The sums of the current group's completed blocks, added in order.
    group: f64,
    /// The running sum of the current block.
    acc: f64,
    /// Terms in the current block.
    k: usize,
    /// Completed blocks in the current group.
    blocks: usize,
}

impl BlockedSum {
    /// Adds the next term.
    #[inline]
    pub(crate) fn push(&mut self, t: f64) {
        self.acc += t;
        self.k += 1;
        if self.k == SUM_BLOCK {
            self.group += self.acc;
            self.acc = 0.0;
            self.k = 0;
            self.blocks += 1;
            if self.blocks == SUM_GROUP {
                self.total += self.group;
                self.group = 0.0;
                self.blocks = 0;
            }
        }
    }

    /// The sum of all terms pushed. The unfinished block and group are added as they stand:
    /// every term is a square (`+0.0` or more, or NaN), so the sums are never `-0.0` and adding
    /// an empty (`+0.0`) block or group changes nothing, as the GPU's missing blocks do not.
    pub(crate) fn finish(self) -> f64 {
        self.total + (self.group + self.acc)
    }
}

/// `acc` plus the per-group partials, added in index order: the third level of [`BlockedSum`]
/// from `acc = +0.0`, or continued where an earlier run of the same view's partials left it
/// (the CUDA backend computes the group sums on the device).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn add_partials(acc: f64, partials: &[f64]) -> f64 {
    partials.iter().fold(acc, |s, p| s + p)
}

/// Chunks of at most [`CHUNK`] elements covering `0..n`, in order.
pub(crate) fn chunks(n: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n).step_by(CHUNK).map(move |s| s..(s + CHUNK).min(n))
}

/// The bytes of elements `r` of a `dtype` byte slice.
pub(crate) fn elems<'a>(bytes: &'a [u8], dtype: DType, r: &Range<usize>) -> &'a [u8] {
    &bytes[r.start * dtype.size()..r.end * dtype.size()]
}

/// The bytes of elements `r` of a `dtype` byte slice, mutably.
pub(crate) fn elems_mut<'a>(bytes: &'a mut [u8], dtype: DType, r: &Range<usize>) -> &'a mut [u8] {
    &mut bytes[r.start * dtype.size()..r.end * dtype.size()]
}

/// `dst[i] = f(src[i])`, `src` and `dst` of any float dtypes, rounded once to `dst`'s dtype.
pub(crate) fn map_into(
    (sd, src): (DType, &[u8]),
    (dd, dst): (DType, &mut [u8]),
    f: impl Fn(f32) -> f32,
) {
    let mut buf = [0f32; CHUNK];
    for r in chunks(src.len() / sd.size()) {
        let b = &mut buf[..r.len()];
        decode_into(sd, elems(src, sd, &r), b);
        b.iter_mut().for_each(|v| *v = f(*v));
        encode_f32(dd, b, elems_mut(dst, dd, &r));
    }
}

/// `y[i] = f(y[i])` in place, rounded to `y`'s dtype.
pub(crate) fn map_in_place((d, y): (DType, &mut [u8]), f: impl Fn(f32) -> f32) {
    let mut buf = [0f32; CHUNK];
    for r in chunks(y.len() / d.size()) {
        let b = &mut buf[..r.len()];
        let bytes = elems_mut(y, d, &r);
        decode_into(d, bytes, b);
        b.iter_mut().for_each(|v| *v = f(*v));
        encode_f32(d, b, bytes);
    }
}

/// `y[i] = f(x[i], y[i])` in place, rounded to `y`'s dtype.
pub(crate) fn zip_in_place(
    (xd, x): (DType, &[u8]),
    (yd, y): (DType, &mut [u8]),
    f: impl Fn(f32, f32) -> f32,
) {
    let (mut xb, mut yb) = ([0f32; CHUNK], [0f32; CHUNK]);
    for r in chunks(y.len() / yd.size()) {
        let (xs, ys) = (&mut xb[..r.len()], &mut yb[..r.len()]);
        let bytes = elems_mut(y, yd, &r);
        decode_into(xd, elems(x, xd, &r), xs);
        decode_into(yd, bytes, ys);
        ys.iter_mut()
            .zip(xs.iter())
            .for_each(|(y, x)| *y = f(*x, *y));
        encode_f32(yd, ys, bytes);
    }
}

/// `dst[i] = f(a[i], b[i])`, rounded to `dst`'s dtype.
pub(crate) fn zip_into(
    (ad, a): (DType, &[u8]),
    (bd, b): (DType, &[u8]),
    (dd, dst): (DType, &mut [u8]),
    f: impl Fn(f32, f32) -> f32,
) {
    let (mut ab, mut bb) = ([0f32; CHUNK], [0f32; CHUNK]);
    for r in chunks(a.len() / ad.size()) {
        let (xs, ys) = (&mut ab[..r.len()], &mut bb[..r.len()]);
        decode_into(ad, elems(a, ad, &r), xs);
        decode_into(bd, elems(b, bd, &r), ys);
        xs.iter_mut()
            .zip(ys.iter())
            .for_each(|(x, y)| *x = f(*x, *y));
        encode_f32(dd, xs, elems_mut(dst, dd, &r));
    }
}

/// Calls `f` on every chunk of `view`'s elements decoded to f32, in index order.
/// `what` names the op for the host-fallback count on a GPU device.
pub(crate) fn for_each_chunk(
    dev: &mut Device,
    what: &'static str,
    view: View,
    mut f: impl FnMut(&[f32]),
) -> Result<()> {
    crate::check_float("reduction", view)?;
    dev.host_read(what, view, |bytes| {
        let d = view.dtype();
        let mut buf = [0f32; CHUNK];
        for r in chunks(view.len()) {
            let b = &mut buf[..r.len()];
            decode_into(d, elems(bytes, d, &r), b);
            f(b);
        }
    })
}

/// `rows · cols`, or an error when it overflows.
pub(crate) fn shape_len(what: &'static str, rows: usize, cols: usize) -> Result<usize> {
    rows.checked_mul(cols)
        .ok_or_else(|| invalid(what, format!("{rows}x{cols} elements overflow usize")))
}

/// A [`DeviceError::Invalid`].
pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> DeviceError {
    DeviceError::Invalid {
        what,
        reason: reason.into(),
    }
}

/// Checks that a view of `len` elements holds a whole number of rows of `cols` and returns the
/// row count (`cols == 0` admits only an empty view).
pub(crate) fn rows_of(what: &'static str, len: usize, cols: usize) -> Result<usize> {
    match len.checked_div(cols) {
        Some(rows) if rows * cols == len => Ok(rows),
        None if len == 0 => Ok(0),
        _ => Err(invalid(
            what,
            format!("{len} elements are not a whole number of rows of {cols}"),
        )),
    }
}
