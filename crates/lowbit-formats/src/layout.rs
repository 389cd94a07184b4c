//! Scale layouts: compact (`rows × blocks`, row-major) and the padded, swizzled layout cuBLAS
//! block-scaled GEMMs read (the cuBLAS documentation, "1D Block Scaling Factors Layout"; TE
//! writes it in `transformer_engine/common/swizzle/swizzle.cu`).
//!
//! The swizzled layout pads the scale matrix `S[R][C]` (R rows of the operand in its K-major
//! orientation, C scale blocks along K) to multiples of 128x4, cuts it into 512-byte tiles stored
//! row-major, and interleaves rows 0, 32, 64, 96, 1, 33, … inside a tile:
//!
//! `offset(r, c) = ((r/128)·ceil(C/4) + c/4)·512 + (r%32)·16 + ((r%128)/32)·4 + c%4`.
//!
//! Padding bytes are zero (TE PR #3070: garbage padding reached a GEMM as NaN).
//! MXFP8 columnwise scales (`[ceil(M/32), N]`) are swizzled as their transpose `[N, ceil(M/32)]`,
//! as TE does; NVFP4 scales are already K-major in both copies.

/// Where block scales live in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum ScaleLayout {
    /// Row-major `[rows, blocks]`, no padding.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(name = "compact", help = "Row-major [rows, blocks], no padding")
    )]
    Compact,
    /// Padded to 128x4 tiles and swizzled as cuBLAS block-scaled GEMMs read them.
    #[cfg_attr(feature = "clap", value(name = "swizzled"))]
    Swizzled,
}

impl ScaleLayout {
    /// The lower-case name (the command line's spelling).
    pub fn name(self) -> &'static str {
        match self {
            ScaleLayout::Compact => "compact",
            ScaleLayout::Swizzled => "swizzled",
        }
    }
}

/// `(padded rows, padded cols)` of a swizzled `rows × cols` scale matrix.
pub fn swizzled_dims(rows: usize, cols: usize) -> (usize, usize) {
    (rows.div_ceil(128) * 128, cols.div_ceil(4) * 4)
}

/// Byte offset of scale `(r, c)` of a matrix with `cols` scale columns in the swizzled layout.
#[inline]
pub fn swizzle_offset(r: usize, c: usize, cols: usize) -> usize {
    ((r / 128) * cols.div_ceil(4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4
}

/// Swizzles a compact row-major `rows × cols` scale matrix; padding bytes are zero.
///
/// # Panics
/// If `scales.len() != rows * cols` (a caller bug: planes carry their own shapes).
pub fn swizzle(scales: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(scales.len(), rows * cols, "scale matrix size");
    let (pr, pc) = swizzled_dims(rows, cols);
    let mut out = vec![0u8; pr * pc];
    for (r, row) in scales.chunks_exact(cols.max(1)).enumerate().take(rows) {
        for (c, &s) in row.iter().enumerate() {
            out[swizzle_offset(r, c, cols)] = s;
        }
    }
    out
}

/// Inverse of [`swizzle`]: the compact `rows × cols` matrix from a swizzled buffer.
///
/// # Panics
/// If `swizzled` is not exactly the padded size.
pub fn unswizzle(swizzled: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let (pr, pc) = swizzled_dims(rows, cols);
    assert_eq!(swizzled.len(), pr * pc, "swizzled scale size");
    let mut out = vec![0u8; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            out[r * cols + c] = swizzled[swizzle_offset(r, c, cols)];
        }
    }
    out
}

/// Transposes a row-major `rows × cols` byte matrix.
pub fn transpose(m: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; m.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = m[r * cols + c];
        }
    }
    out
}

/// Swizzles MXFP8 columnwise scales `[row_blocks, cols]` as TE does (as the transpose
/// `[cols, row_blocks]`). The result has TE's shape `[roundup(row_blocks, 4), roundup(cols, 128)]`.
pub fn swizzle_mxfp8_columnwise(scales: &[u8], row_blocks: usize, cols: usize) -> Vec<u8> {
    swizzle(&transpose(scales, row_blocks, cols), cols, row_blocks)
}

/// Inverse of [`swizzle_mxfp8_columnwise`].
pub fn unswizzle_mxfp8_columnwise(swizzled: &[u8], row_blocks: usize, cols: usize) -> Vec<u8> {
    transpose(&unswizzle(swizzled, cols, row_blocks), cols, row_blocks)
}
