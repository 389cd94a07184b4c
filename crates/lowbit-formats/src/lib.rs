//! Bit-exact MXFP8 and NVFP4 block quantization on CPU, with NVIDIA Transformer Engine (TE)
//! semantics.
//!
//! # Purpose
//! Every layer of lowbit above this one (primary weights, parameter gather, FSDP, checkpoints)
//! stores tensors in block-scaled formats that GEMMs and other training stacks read. This crate is
//! the definition of those bytes: scalar codecs ([`scalar`]), MXFP8 ([`mxfp8`]: E8M0 scale per
//! 1x32, 32x1 or 32x32 block), NVFP4 ([`nvfp4`]: fp32 tensor scale, E4M3 scale per 1x16 or 16x16
//! block, E2M1 elements, optional random Hadamard transform and stochastic rounding) and the scale
//! layouts GEMMs expect ([`layout`]). It is also the oracle the CUDA kernels are tested against.
//!
//! # The key decision: TE's arithmetic, step by step
//! Several stacks implement "MXFP8" and disagree on the bits (torchao's default FLOOR scale, OCP's
//! emulator rounding ties away from zero, torchao's NVFP4 scale floor of 2^-6). We reproduce TE's
//! operation order exactly, including its rounded reciprocals (`amax · fl32(1/448)`, never a
//! division) and its edge behaviour (NaN ignored by the block amax, Inf blocks saturate, NVFP4
//! blocks whose scale underflows encode ±6 with scale 0). The TE sources are cited where each
//! rule is implemented (`mxfp8`, `nvfp4`, `hadamard`, `layout`); `tests/golden.rs` holds the
//! golden vectors, printed by probes of CUDA's conversions and TE's kernels on an H100 and
//! reproduced there.
//!
//! # Invariants
//! - Quantization is a pure function of (input values, shape, config): the result does not depend
//!   on the thread count, and stochastic rounding draws from a counter-based generator keyed by
//!   the seed and each element's position, so the same seed gives the same bytes.
//! - Elements outside a partial edge block do not exist: they neither enter the amax nor produce
//!   output bytes (packed NVFP4 rows pad their last nibble with zero).
//! - Every byte of every output buffer is written; padding in swizzled layouts is zero.
//! - With [`NanPolicy::Error`], no output is produced for an input that holds NaN or ±Inf.
//!
//! # Non-goals
//! Devices, ranks and buffers (those are `lowbit-device` and above); GEMMs; MXFP6/MXFP4;
//! torchao's FLOOR scale mode; bit-exact reproduction of TE's Philox stream for stochastic rounding
//! (tested statistically, as TE itself does).

mod alloc;
pub mod hadamard;
pub mod layout;
pub mod mxfp8;
pub mod nvfp4;
mod par;
pub mod rng;
pub mod scalar;
mod simd;

pub use half::{bf16, f16};
pub use layout::ScaleLayout;
pub use mxfp8::{Mxfp8Config, Mxfp8Tensor, quantize_mxfp8, quantize_mxfp8_into};
pub use nvfp4::{Nvfp4Config, Nvfp4Tensor, nvfp4_amax, quantize_nvfp4, quantize_nvfp4_piece};
pub use scalar::Fp8Kind;

/// Errors of this crate. Each names the tensor it is about.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FormatError {
    /// The data length does not match `rows × cols`.
    #[error("tensor `{name}`: {len} elements do not fill a {rows}x{cols} matrix")]
    ShapeMismatch {
        /// Tensor name.
        name: String,
        /// Rows requested.
        rows: usize,
        /// Columns requested.
        cols: usize,
        /// Elements supplied.
        len: usize,
    },
    /// A non-finite input under [`NanPolicy::Error`].
    #[error(
        "tensor `{name}`: non-finite value {value} at index [{row}, {col}] (flat index {flat})"
    )]
    NonFinite {
        /// Tensor name.
        name: String,
        /// Row of the first non-finite element.
        row: usize,
        /// Column of the first non-finite element.
        col: usize,
        /// Row-major flat index of that element.
        flat: usize,
        /// The value found.
        value: f32,
    },
    /// A configuration that this tensor or recipe cannot honour.
    #[error("tensor `{name}`: {reason}")]
    Unsupported {
        /// Tensor name.
        name: String,
        /// What is not supported, and why.
        reason: String,
    },
    /// A quantized buffer whose size does not match its declared shape.
    #[error("tensor `{name}`: {what} has {got}, expected shape {expected}")]
    BadBuffer {
        /// Tensor name.
        name: String,
        /// Which buffer.
        what: String,
        /// What is present.
        got: String,
        /// The shape expected.
        expected: String,
    },
}

/// What to do with NaN and ±Inf inputs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum NanPolicy {
    /// TE's behaviour: the block amax ignores NaN (TE takes it with `fmaxf` / `__hmax`, which
    /// return the other operand when one is NaN), a NaN element encodes as NaN in FP8 and as +6
    /// in E2M1 (which has no NaN) — so an NVFP4 block of NaN only, whose amax is 0, decodes to
    /// zeros, as in TE (`quantize_nvfp4.cuh`) — and an Inf amax saturates the scale.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(
            name = "te",
            help = "Transformer Engine's behaviour: NaN encodes as NaN in FP8 (NVFP4: +6 times \
                    its block's scale; an all-NaN block is zeros), Inf saturates its block"
        )
    )]
    Te,
    /// Reject any non-finite input with [`FormatError::NonFinite`].
    #[cfg_attr(
        feature = "clap",
        value(
            name = "error",
            help = "Fail on the first NaN or ±Inf, naming the tensor and index"
        )
    )]
    Error,
}

/// Which quantized copies to produce.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Copies {
    /// Blocks along the last dimension only.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "rowwise",
            help = "1x32 / 1x16 blocks along the last dimension (what a forward GEMM reads)"
        )
    )]
    Rowwise,
    /// Blocks down the rows only.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "columnwise",
            help = "Blocks down the columns (what the backward GEMMs read)"
        )
    )]
    Columnwise,
    /// Both, from one pass over the input.
    #[default]
    #[cfg_attr(feature = "clap", value(name = "both", help = "Both copies"))]
    Both,
}

impl NanPolicy {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            NanPolicy::Te => "te",
            NanPolicy::Error => "error",
        }
    }
}

impl Copies {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            Copies::Rowwise => "rowwise",
            Copies::Columnwise => "columnwise",
            Copies::Both => "both",
        }
    }

    /// Whether the rowwise copy is produced.
    pub fn rowwise(self) -> bool {
        matches!(self, Copies::Rowwise | Copies::Both)
    }
    /// Whether the columnwise copy is produced.
    pub fn columnwise(self) -> bool {
        matches!(self, Copies::Columnwise | Copies::Both)
    }
}

/// Borrowed high-precision elements.
#[derive(Clone, Copy, Debug)]
pub enum Source<'a> {
    /// fp32 elements.
    F32(&'a [f32]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
    /// fp16 elements.
    F16(&'a [f16]),
}

impl Source<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Source::F32(s) => s.len(),
            Source::Bf16(s) => s.len(),
            Source::F16(s) => s.len(),
        }
    }
    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A named row-major `rows × cols` matrix of high-precision values: the input of every quantizer.
/// A tensor of shape `[d0, …, N]` is the matrix `[d0·…, N]`.
#[derive(Clone, Copy, Debug)]
pub struct Matrix<'a> {
    name: &'a str,
    rows: usize,
    cols: usize,
    data: Source<'a>,
}

impl<'a> Matrix<'a> {
    /// Checks that `data` holds exactly `rows × cols` elements.
    pub fn new(
        name: &'a str,
        rows: usize,
        cols: usize,
        data: Source<'a>,
    ) -> Result<Self, FormatError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(FormatError::ShapeMismatch {
                name: name.to_owned(),
                rows,
                cols,
                len: data.len(),
            });
        }
        Ok(Matrix {
            name,
            rows,
            cols,
            data,
        })
    }
    /// The tensor's name, used in errors.
    pub fn name(&self) -> &'a str {
        self.name
    }
    /// Rows (product of the leading dimensions).
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// Columns (the last dimension).
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// The elements.
    pub fn data(&self) -> Source<'a> {
        self.data
    }

    /// Element `flat` as f32 (exact for every source type).
    pub fn get(&self, flat: usize) -> f32 {
        match self.data {
            Source::F32(s) => s[flat],
            Source::Bf16(s) => s[flat].to_f32(),
            Source::F16(s) => s[flat].to_f32(),
        }
    }

    /// Under [`NanPolicy::Error`], the error for the first non-finite element, if any.
    pub(crate) fn check_finite(&self, policy: NanPolicy) -> Result<(), FormatError> {
        if policy == NanPolicy::Te {
            return Ok(());
        }
        let first = match self.data {
            Source::F32(s) => s.iter().position(|x| !x.is_finite()),
            Source::Bf16(s) => s.iter().position(|x| !x.is_finite()),
            Source::F16(s) => s.iter().position(|x| !x.is_finite()),
        };
        match first {
            None => Ok(()),
            Some(flat) => Err(FormatError::NonFinite {
                name: self.name.to_owned(),
                row: flat / self.cols,
                col: flat % self.cols,
                flat,
                value: self.get(flat),
            }),
        }
    }

    pub(crate) fn unsupported(&self, reason: impl Into<String>) -> FormatError {
        FormatError::Unsupported {
            name: self.name.to_owned(),
            reason: reason.into(),
        }
    }
}

/// One quantized copy: element bytes and compact block scales, both row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuantPlane {
    /// Element bytes (fp8 codes, or two E2M1 nibbles per byte, element 2i in the low nibble).
    pub data: Vec<u8>,
    /// Shape of `data` as `[rows, bytes per row]`.
    pub data_shape: [usize; 2],
    /// Block scales (E8M0 for MXFP8, UE4M3 for NVFP4) in the compact layout.
    pub scales: Vec<u8>,
    /// Shape of `scales`.
    pub scale_shape: [usize; 2],
}

/// A 16-bit float input format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Half {
    Bf16,
    F16,
}

/// An element type the quantizers read: f32, bf16 or f16.
pub(crate) trait Element: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    /// See [`amax_bits`].
    #[inline(always)]
    fn amax_bits(x: &[Self]) -> u32 {
        amax_bits_lanes(x)
    }
    /// The bit patterns of a bf16 or f16 slice and which format they are (for kernels
    /// specialised to 16-bit inputs); `None` for f32.
    #[inline(always)]
    fn half_bits(_: &[Self]) -> Option<(&[u16], Half)> {
        None
    }
}

impl Element for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
}

impl Element for bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits(u32::from(self.to_bits()) << 16)
    }
    #[inline(always)]
    fn amax_bits(x: &[Self]) -> u32 {
        amax_bits_bf16(x)
    }
    #[inline(always)]
    fn half_bits(x: &[Self]) -> Option<(&[u16], Half)> {
        use half::slice::HalfFloatSliceExt;
        Some((x.reinterpret_cast(), Half::Bf16))
    }
}

impl Element for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn half_bits(x: &[Self]) -> Option<(&[u16], Half)> {
        use half::slice::HalfFloatSliceExt;
        Some((x.reinterpret_cast(), Half::F16))
    }
}

/// |x| as fp32 bits, with NaN mapped to 0 so that an integer max over these equals TE's
/// NaN-ignoring `fmaxf` amax (non-negative floats order like their bit patterns).
#[inline(always)]
pub(crate) fn abs_bits_nan_zero(x: f32) -> u32 {
    let a = x.to_bits() & 0x7FFF_FFFF;
    if a > 0x7F80_0000 { 0 } else { a }
}

/// Max of [`abs_bits_nan_zero`] over `x`: TE's NaN-ignoring amax, as fp32 bits.
#[inline(always)]
pub(crate) fn amax_bits<E: Element>(x: &[E]) -> u32 {
    E::amax_bits(x)
}

/// Amax bits of a fixed-size block, as a tree of lane-wise maxima (vectorises into a few
/// shuffles; a running fold over the block does not).
#[inline(always)]
pub(crate) fn block_amax_bits<E: Element, const N: usize>(x: &[E; N]) -> u32 {
    let mut m: [u32; N] = std::array::from_fn(|i| abs_bits_nan_zero(x[i].to_f32()));
    let mut half = N / 2;
    while half > 0 {
        for i in 0..half {
            m[i] = m[i].max(m[i + half]);
        }
        half /= 2;
    }
    m[0]
}

/// The generic amax: eight independent lanes so that the loop vectorises (a single running
/// max does not).
#[inline(always)]
fn amax_bits_lanes<E: Element>(x: &[E]) -> u32 {
    let mut acc = [0u32; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = (*a).max(abs_bits_nan_zero(v.to_f32()));
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .map(|v| abs_bits_nan_zero(v.to_f32()))
        .fold(0, u32::max);
    acc.into_iter().fold(tail, u32::max)
}

/// bf16 amax on the 16-bit patterns directly (16 lanes per AVX2 register). Magnitudes order
/// like `bits & 0x7FFF`, and `0x7F81..=0x7FFF` are NaN: adding `0x7F` moves exactly the NaNs
/// to negative i16 values, so a signed max starting from `0x7F` (magnitude 0) ignores them.
#[inline(always)]
fn amax_bits_bf16(x: &[bf16]) -> u32 {
    use half::slice::HalfFloatSliceExt;
    let bits: &[u16] = x.reinterpret_cast();
    let key = |b: u16| ((b & 0x7FFF).wrapping_add(0x7F)) as i16;
    let mut acc = [0x7Fi16; 16];
    let mut chunks = bits.chunks_exact(16);
    for c in &mut chunks {
        let c: &[u16; 16] = c.try_into().expect("chunks of 16");
        for (a, &b) in acc.iter_mut().zip(c) {
            *a = (*a).max(key(b));
        }
    }
    let tail = chunks
        .remainder()
        .iter()
        .map(|&b| key(b))
        .fold(0x7F, i16::max);
    let m = acc.into_iter().fold(tail, i16::max);
    u32::from((m as u16).wrapping_sub(0x7F)) << 16
}

/// The number of worker threads to use for `requested` (0 = all available cores), capped so a
/// careless request cannot exhaust the process's threads (a failed spawn would panic).
pub(crate) fn thread_count(requested: usize) -> usize {
    const MAX_THREADS: usize = 256;
    if requested == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        requested.min(MAX_THREADS)
    }
}

/// The tile-cover rule of the sharded 2D helpers (`mxfp8::sharded`, `nvfp4::sharded`), which
/// index a tile for every element and divide by `cols`: `tiles` tiles (of a layout counting
/// `tile_count(rows, cols)` for a `rows × cols` matrix) cover the flat range `start .. start +
/// len` of a row-major matrix with `cols` columns. Callers that accept an empty range do so
/// before asking (the helpers do; `lowbit_device`'s folds do not).
///
/// # Errors
/// [`FormatError::Unsupported`] (tensor `name`) for a range past `usize`, zero columns, or too
/// few tiles.
pub fn check_tile_cover(
    name: &str,
    (start, len, cols): (usize, usize, usize),
    tiles: usize,
    tile_count: fn(usize, usize) -> usize,
) -> Result<(), FormatError> {
    let bad = |reason: String| {
        Err(FormatError::Unsupported {
            name: name.into(),
            reason,
        })
    };
    let Some(end) = start.checked_add(len) else {
        return bad(format!("the range {start} + {len} passes usize"));
    };
    if cols == 0 {
        return bad("a matrix of zero columns has no elements".into());
    }
    // ceil(end / cols) rows of `cols`: the tile count is about end / 256 at most, no overflow.
    if tiles < tile_count(end.div_ceil(cols), cols) {
        return bad(format!(
            "{tiles} tiles cannot cover elements {start}..{end} of a matrix of {cols} columns"
        ));
    }
    Ok(())
}

/// The tile of flat element `flat` of a row-major matrix with `cols` columns under square
/// tiles of `BLOCK` (row-major tiles, `ceil(cols / BLOCK)` a tile row; a constant, so the
/// divisions by it are shifts).
pub(crate) fn tile_of<const BLOCK: usize>(flat: usize, cols: usize) -> usize {
    (flat / cols / BLOCK) * cols.div_ceil(BLOCK) + (flat % cols) / BLOCK
}

/// The sharded helpers' fold (both formats; `BLOCK` and `tile_count` the format's): the
/// magnitudes of elements `start ..` into their tiles' amaxes (u32-bit max, NaN as 0), after
/// [`check_tile_cover`] for a non-empty range.
pub(crate) fn fold_tile_amax_2d<const BLOCK: usize>(
    name: &str,
    tile_count: fn(usize, usize) -> usize,
    values: &[f32],
    start: usize,
    cols: usize,
    tiles: &mut [f32],
) -> Result<(), FormatError> {
    if values.is_empty() {
        return Ok(());
    }
    check_tile_cover(name, (start, values.len(), cols), tiles.len(), tile_count)?;
    for (i, &v) in values.iter().enumerate() {
        let t = tile_of::<BLOCK>(start + i, cols);
        tiles[t] = f32::from_bits(tiles[t].to_bits().max(abs_bits_nan_zero(v)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bf16 fast path (signed 16-bit max after a bias) equals the generic NaN-ignoring
    /// amax on every special pattern, at every position and length.
    #[test]
    fn bf16_amax_matches_the_generic_amax() {
        let specials: Vec<u16> = vec![
            0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0xBF80, 0x7F7F, 0xFF7F, 0x7F80,
            0xFF80, 0x7F81, 0xFF81, 0x7FC0, 0xFFC0, 0x7FFF, 0xFFFF, 0x4000, 0xC2F0,
        ];
        let mut state = 0x1234_5678u32;
        for len in [0, 1, 15, 16, 17, 33, 64, 100] {
            for round in 0..200 {
                let x: Vec<bf16> = (0..len)
                    .map(|i| {
                        state ^= state << 13;
                        state ^= state >> 17;
                        state ^= state << 5;
                        let b = if round % 2 == 0 {
                            specials[(state as usize + i) % specials.len()]
                        } else {
                            state as u16
                        };
                        bf16::from_bits(b)
                    })
                    .collect();
                assert_eq!(amax_bits_bf16(&x), amax_bits_lanes(&x), "{x:?}");
            }
        }
    }
}
