//! NVFP4: E2M1 elements, one UE4M3 scale per 16 elements, and one fp32 tensor scale derived from
//! the global amax — TE's two-level recipe, in TE's operation order (TE's
//! `transformer_engine/common/cast/nvfp4/core_nvfp4.cuh`:
//! `compute_global_encode_scaling_factor_FP4` for `S_enc`, `compute_decoding_scaling_factor` for
//! `sf`, `compute_scaling_coefficient` for `rcp`):
//!
//! ```text
//! S_enc = min(448·6 / amax, FLT_MAX), or 1 when amax == 0 or S_enc == 0;  S_dec = 1 / S_enc
//! sf    = e4m3_rn_satfinite(block_amax · fl32(S_enc · fl32(1/6)))
//! rcp   = min(1 / (float(sf) · S_dec), FLT_MAX)
//! q     = e2m1_rn_satfinite(fl32(x · rcp))          (or stochastic rounding)
//! ```
//!
//! A block whose scale underflows to 0 gets `rcp = FLT_MAX`: its non-zero elements encode as ±6
//! with scale 0 and dequantize to 0, exactly as TE.
//!
//! Copies of a `rows × cols` matrix:
//! - rowwise: 1x16 blocks along a row; data `[rows, ceil(cols/2)]` packed (element 2i in the low
//!   nibble), scales `[rows, ceil(cols/16)]`;
//! - columnwise: 1x16 blocks of the transpose; data `[cols, ceil(rows/2)]` packed, scales
//!   `[cols, ceil(rows/16)]`; optionally after the 16-point random Hadamard transform along the
//!   rows, with its own (post-transform) global amax;
//! - 2D: one scale per 16x16 tile, replicated into both scale tensors.

use std::sync::atomic::AtomicUsize;

use crate::hadamard::rht16;
use crate::rng::RandomBytes;
use crate::scalar::{e2m1_from_f32, e2m1_to_f32, e4m3_to_f32, ue4m3_from_f32};
use crate::{
    Copies, Element, FormatError, Matrix, NanPolicy, QuantPlane, Source, alloc, par, thread_count,
};

/// Elements per NVFP4 block (and rows/columns per 2D tile).
pub const BLOCK: usize = 16;

/// How to quantize to NVFP4.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Nvfp4Config {
    /// Which copies to produce.
    pub copies: Copies,
    /// One scale per 16x16 tile, shared by both copies (TE's weight recipe).
    pub two_d: bool,
    /// Apply the random Hadamard transform to the columnwise copy (TE's recipe for activations
    /// and gradients). Needs `rows % 16 == 0`; incompatible with `two_d`.
    pub rht: bool,
    /// Stochastic rounding of the elements with this seed (TE's recipe for gradients).
    pub stochastic_rounding: Option<u64>,
    /// Treatment of NaN and ±Inf inputs.
    pub nan_policy: NanPolicy,
    /// Worker threads; 0 means all available cores. The result does not depend on it.
    pub threads: usize,
}

impl Default for Nvfp4Config {
    fn default() -> Self {
        Nvfp4Config {
            copies: Copies::Both,
            two_d: false,
            rht: false,
            stochastic_rounding: None,
            nan_policy: NanPolicy::Te,
            threads: 1,
        }
    }
}

/// A quantized NVFP4 matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Tensor {
    /// Rows of the original matrix.
    pub rows: usize,
    /// Columns of the original matrix.
    pub cols: usize,
    /// Whether scales are per 16x16 tile.
    pub two_d: bool,
    /// Whether the columnwise copy holds the Hadamard-transformed values.
    pub rht: bool,
    /// Global amax the rowwise scales were derived from.
    pub amax_rowwise: f32,
    /// Global amax the columnwise scales were derived from (post-RHT when `rht`).
    pub amax_columnwise: f32,
    /// Rowwise copy: data `[rows, ceil(cols/2)]`, scales `[rows, ceil(cols/16)]`.
    pub rowwise: Option<QuantPlane>,
    /// Columnwise copy: data `[cols, ceil(rows/2)]`, scales `[cols, ceil(rows/16)]`.
    pub columnwise: Option<QuantPlane>,
}

/// The tensor-level factors of one copy.
#[derive(Clone, Copy, Debug)]
struct Params {
    /// `fl32(S_enc · fl32(1/6))`.
    k: f32,
    /// `min(1 / (float(sf) · S_dec), FLT_MAX)` for every scale byte: the same divisions TE
    /// does per block, done once per tensor.
    rcp: [f32; 256],
}

impl Params {
    fn new(amax: f32) -> Self {
        let s_enc = (448.0f32 * 6.0 / amax).min(f32::MAX);
        let s_enc = if amax == 0.0 || s_enc == 0.0 {
            1.0
        } else {
            s_enc
        };
        let s_dec = 1.0 / s_enc;
        Params {
            k: s_enc * (1.0f32 / 6.0),
            rcp: std::array::from_fn(|sf| (1.0 / (e4m3_to_f32(sf as u8) * s_dec)).min(f32::MAX)),
        }
    }

    /// The block scale byte and the element multiplier for a block amax (fp32 bits).
    #[inline(always)]
    fn block(&self, amax: u32) -> (u8, f32) {
        let sf = ue4m3_from_f32(f32::from_bits(amax) * self.k);
        (sf, self.rcp[usize::from(sf)])
    }
}

/// TE's stochastic rounding to E2M1 (`stochastic_round_fp4_e2m1`, software form): with
/// `u = byte/256` and grid step 0.5/1/2 below 2/4/6, `t = |x| + u·step(|x|)`,
/// `q = min(floor(t/step(t))·step(t), 6)`, sign copied; NaN → +6.
#[inline]
pub fn e2m1_stochastic(x: f32, rbyte: u8) -> u8 {
    if x.is_nan() {
        return 0x7;
    }
    let step = |v: f32| {
        if v < 2.0 {
            0.5
        } else if v < 4.0 {
            1.0
        } else {
            2.0
        }
    };
    let a = x.abs();
    let t = a + (f32::from(rbyte) / 256.0) * step(a);
    let q = ((t / step(t)).floor() * step(t)).min(6.0);
    e2m1_from_f32(q) | if x.is_sign_negative() { 0x8 } else { 0 }
}

/// Quantizes `m` to NVFP4 with TE's two-level recipe.
pub fn quantize_nvfp4(m: &Matrix<'_>, cfg: &Nvfp4Config) -> Result<Nvfp4Tensor, FormatError> {
    m.check_finite(cfg.nan_policy)?;
    if cfg.rht && cfg.two_d {
        return Err(m.unsupported(
            "the Hadamard transform and 2D scaling cannot be combined (TE applies the RHT to \
             1D columnwise copies only)",
        ));
    }
    if cfg.rht && cfg.copies.columnwise() && !m.rows().is_multiple_of(BLOCK) {
        return Err(m.unsupported(format!(
            "the Hadamard transform needs a row count divisible by 16, got {}",
            m.rows()
        )));
    }
    Ok(match m.data() {
        Source::F32(x) => run(x, m.rows(), m.cols(), cfg, None),
        Source::Bf16(x) => run(x, m.rows(), m.cols(), cfg, None),
        Source::F16(x) => run(x, m.rows(), m.cols(), cfg, None),
    })
}

/// The global amax NVFP4 derives its tensor scale from: max |x| with NaN ignored.
pub fn nvfp4_amax(m: &Matrix<'_>, threads: usize) -> f32 {
    let threads = thread_count(threads);
    match m.data() {
        Source::F32(x) => global_amax(x, threads),
        Source::Bf16(x) => global_amax(x, threads),
        Source::F16(x) => global_amax(x, threads),
    }
}

/// [`quantize_nvfp4`] of one piece of a larger matrix, for inputs too large to hold at once:
/// `amax` is the whole matrix's global amax (the max of [`nvfp4_amax`] over its pieces). Pieces
/// split at multiples of 16 rows give exactly the bytes of the whole matrix's quantization, row
/// for row (rowwise) and column segment for column segment (columnwise), because every scale
/// and code depends only on its block (or 16x16 tile) and the global amax. The Hadamard
/// transform and stochastic rounding depend on more than that and are refused here.
pub fn quantize_nvfp4_piece(
    m: &Matrix<'_>,
    cfg: &Nvfp4Config,
    amax: f32,
) -> Result<Nvfp4Tensor, FormatError> {
    if cfg.rht || cfg.stochastic_rounding.is_some() {
        return Err(m.unsupported(
            "a piece of a matrix cannot be quantized with the Hadamard transform or stochastic \
             rounding (both depend on the whole matrix)",
        ));
    }
    m.check_finite(cfg.nan_policy)?;
    Ok(match m.data() {
        Source::F32(x) => run(x, m.rows(), m.cols(), cfg, Some(amax)),
        Source::Bf16(x) => run(x, m.rows(), m.cols(), cfg, Some(amax)),
        Source::F16(x) => run(x, m.rows(), m.cols(), cfg, Some(amax)),
    })
}

/// Global amax with NaN ignored (TE's `nvte_compute_amax` uses `fmaxf`).
fn global_amax<E: Element>(x: &[E], threads: usize) -> f32 {
    // Chunks from the shared queue (as the quantization bands are), each folding into its own
    // slot; the max of the slots does not depend on who ran what.
    const CHUNK: usize = 1 << 17;
    let mut parts = vec![0u32; x.len().div_ceil(CHUNK)];
    let items: Vec<_> = x.chunks(CHUNK).zip(parts.iter_mut()).collect();
    par::for_each(items, threads, |(c, slot)| {
        *slot = crate::simd::dispatch(
            #[inline(always)]
            || crate::amax_bits(c),
        );
    });
    f32::from_bits(parts.into_iter().max().unwrap_or(0))
}

fn run<E: Element>(
    x: &[E],
    rows: usize,
    cols: usize,
    cfg: &Nvfp4Config,
    amax: Option<f32>,
) -> Nvfp4Tensor {
    let threads = thread_count(cfg.threads);
    let amax = amax.unwrap_or_else(|| global_amax(x, threads));
    let row_params = Params::new(amax);
    // Tile scales for 2D: [ceil(rows/16), ceil(cols/16)].
    let tiles = cfg
        .two_d
        .then(|| tile_scales(x, rows, cols, &row_params, threads));
    let mut t = Nvfp4Tensor {
        rows,
        cols,
        two_d: cfg.two_d,
        rht: cfg.rht && cfg.copies.columnwise(),
        amax_rowwise: amax,
        amax_columnwise: amax,
        rowwise: None,
        columnwise: None,
    };
    if cfg.copies.rowwise() {
        let sr = cfg.stochastic_rounding.map(|s| RandomBytes::new(s, 0));
        t.rowwise = Some(quantize_rows(
            x,
            rows,
            cols,
            &row_params,
            tiles.as_ref(),
            sr,
            threads,
        ));
    }
    if cfg.copies.columnwise() {
        let sr = cfg.stochastic_rounding.map(|s| RandomBytes::new(s, 1));
        if !t.rht && sr.is_none() && rows.is_multiple_of(BLOCK) {
            // No transform, no random bytes: read the columns straight from X.
            t.columnwise = Some(quantize_cols_direct(
                x,
                rows,
                cols,
                &row_params,
                tiles.as_ref(),
                threads,
            ));
            return t;
        }
        // The columnwise copy quantizes the rows of the transpose. Materialising Xᵀ (f32) keeps
        // one block kernel for both copies; the transform, when asked for, runs on the way.
        let xt = if t.rht {
            rht_transposed(x, rows, cols)
        } else {
            transpose_f32(x, rows, cols)
        };
        let col_params = if t.rht {
            t.amax_columnwise = global_amax(&xt, threads);
            Params::new(t.amax_columnwise)
        } else {
            row_params
        };
        let tiles_t = tiles.as_ref().map(|tl| tl.transposed());
        t.columnwise = Some(quantize_rows(
            &xt,
            cols,
            rows,
            &col_params,
            tiles_t.as_ref(),
            sr,
            threads,
        ));
    }
    t
}

/// Per-tile `(sf, rcp)` of a 16x16-tiled matrix, row-major over tiles.
struct Tiles {
    tile_rows: usize,
    tile_cols: usize,
    scales: Vec<(u8, f32)>,
}

impl Tiles {
    fn transposed(&self) -> Tiles {
        let mut scales = Vec::with_capacity(self.scales.len());
        for c in 0..self.tile_cols {
            for r in 0..self.tile_rows {
                scales.push(self.scales[r * self.tile_cols + c]);
            }
        }
        Tiles {
            tile_rows: self.tile_cols,
            tile_cols: self.tile_rows,
            scales,
        }
    }
}

fn tile_scales<E: Element>(x: &[E], rows: usize, cols: usize, p: &Params, threads: usize) -> Tiles {
    let (tr, tc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
    let mut scales = vec![(0u8, 0f32); tr * tc];
    // One item per band of 16 rows, writing that band's row of tile scales.
    let bands: Vec<_> = scales.chunks_mut(tc.max(1)).enumerate().collect();
    par::for_each(bands, threads, |(b, out)| {
        let mut amax = vec![0u32; tc];
        for r in b * BLOCK..((b + 1) * BLOCK).min(rows) {
            for (a, xc) in amax
                .iter_mut()
                .zip(x[r * cols..(r + 1) * cols].chunks(BLOCK))
            {
                *a = (*a).max(crate::amax_bits(xc));
            }
        }
        for (o, a) in out.iter_mut().zip(amax) {
            *o = p.block(a);
        }
    });
    Tiles {
        tile_rows: tr,
        tile_cols: tc,
        scales,
    }
}

fn transpose_f32<E: Element>(x: &[E], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = x[r * cols + c].to_f32();
        }
    }
    out
}

/// Xᵀ with every run of 16 consecutive elements of a row of Xᵀ (16 rows of a column of X)
/// replaced by its Hadamard transform, rounded to bf16. Requires `rows % 16 == 0`.
fn rht_transposed<E: Element>(x: &[E], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = transpose_f32(x, rows, cols);
    for g in out.chunks_exact_mut(BLOCK) {
        let v: &mut [f32; BLOCK] = g.try_into().expect("chunks_exact yields 16 elements");
        *v = rht16(v);
    }
    out
}

/// Quantizes the rows of a `rows × cols` matrix in 1x16 blocks (or with tile scales), packing
/// two E2M1 codes per byte.
fn quantize_rows<E: Element>(
    x: &[E],
    rows: usize,
    cols: usize,
    p: &Params,
    tiles: Option<&Tiles>,
    sr: Option<RandomBytes>,
    threads: usize,
) -> QuantPlane {
    let (rb, nb) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    let mut plane = QuantPlane {
        data: crate::alloc::uninit(rows * rb),
        data_shape: [rows, rb],
        scales: vec![0; rows * nb],
        scale_shape: [rows, nb],
    };
    if rows == 0 || cols == 0 {
        return plane;
    }
    // Work items of up to 64 rows, each owning its output rows.
    const ROWS_PER_ITEM: usize = 64;
    let done = AtomicUsize::new(0);
    let items: Vec<_> = alloc::chunks(&mut plane.data, rows * rb, ROWS_PER_ITEM * rb, &done)
        .into_iter()
        .zip(plane.scales.chunks_mut(ROWS_PER_ITEM * nb))
        .enumerate()
        .collect();
    par::for_each(items, threads, |(i, (data, scales))| {
        let data = data.bytes();
        crate::simd::dispatch(
            #[inline(always)]
            || {
                let r0 = i * ROWS_PER_ITEM;
                for (dr, (out, sc)) in data.chunks_mut(rb).zip(scales.chunks_mut(nb)).enumerate() {
                    let r = r0 + dr;
                    quantize_row(&x[r * cols..(r + 1) * cols], r, out, sc, p, tiles, sr);
                }
            },
        )
    });
    alloc::finish(&mut plane.data, rows * rb, &done);
    plane
}

/// One row of [`quantize_rows`]: block scales, E2M1 codes, packing.
#[inline(always)]
fn quantize_row<E: Element>(
    xr: &[E],
    r: usize,
    out: &mut [u8],
    sc: &mut [u8],
    p: &Params,
    tiles: Option<&Tiles>,
    sr: Option<RandomBytes>,
) {
    let cols = xr.len();
    if tiles.is_none() && sr.is_none() && cols.is_multiple_of(BLOCK) {
        quantize_row_whole_blocks(xr, out, sc, p);
        return;
    }
    for (k, (xb, (ob, s))) in xr
        .chunks(BLOCK)
        .zip(out.chunks_mut(BLOCK / 2).zip(sc.iter_mut()))
        .enumerate()
    {
        let (sf, rcp) = match tiles {
            Some(t) => t.scales[(r / BLOCK) * t.tile_cols + k],
            None => p.block(match <&[E; BLOCK]>::try_from(xb) {
                Ok(full) => crate::block_amax_bits(full),
                Err(_) => crate::amax_bits(xb),
            }),
        };
        *s = sf;
        let mut codes = [0u8; BLOCK];
        match sr {
            None => {
                for (c, v) in codes.iter_mut().zip(xb) {
                    *c = e2m1_from_f32(v.to_f32() * rcp);
                }
            }
            Some(g) => {
                // Random bytes are addressed by the element's index in the plane.
                let mut bytes = [0u8; BLOCK];
                g.fill((r * cols + k * BLOCK) as u64, &mut bytes[..xb.len()]);
                for ((c, v), b) in codes.iter_mut().zip(xb).zip(bytes) {
                    *c = e2m1_stochastic(v.to_f32() * rcp, b);
                }
            }
        }
        if let Ok(ob) = <&mut [u8; BLOCK / 2]>::try_from(&mut *ob) {
            // Pairs as little-endian u16 lanes (element 2j low byte): one shift and mask each.
            for (j, o) in ob.iter_mut().enumerate() {
                let pair = u16::from_le_bytes([codes[2 * j], codes[2 * j + 1]]);
                *o = ((pair & 0x0F) | ((pair >> 4) & 0xF0)) as u8;
            }
        } else {
            // A partial block at the row's end: an odd count leaves the last high nibble 0.
            for (o, pair) in ob.iter_mut().zip(codes[..xb.len()].chunks(2)) {
                *o = pair[0] | pair.get(1).map_or(0, |h| h << 4);
            }
        }
    }
}

/// The common case of [`quantize_row`] (whole 1x16 blocks, round to nearest): all of the row's
/// block scales first, then the codes with fixed-size blocks, so both loops vectorise without
/// a scale computation in the middle of the encoding.
#[inline(always)]
fn quantize_row_whole_blocks<E: Element>(xr: &[E], out: &mut [u8], sc: &mut [u8], p: &Params) {
    for (s, xb) in sc.iter_mut().zip(xr.chunks_exact(BLOCK)) {
        let xb: &[E; BLOCK] = xb.try_into().expect("chunks_exact");
        *s = p.block(crate::block_amax_bits(xb)).0;
    }
    for ((xb, ob), s) in xr
        .chunks_exact(BLOCK)
        .zip(out.chunks_exact_mut(BLOCK / 2))
        .zip(sc.iter())
    {
        let xb: &[E; BLOCK] = xb.try_into().expect("chunks_exact");
        let ob: &mut [u8; BLOCK / 2] = ob.try_into().expect("chunks_exact");
        let rcp = p.rcp[usize::from(*s)];
        let codes: [u8; BLOCK] = std::array::from_fn(|i| e2m1_from_f32(xb[i].to_f32() * rcp));
        for (j, o) in ob.iter_mut().enumerate() {
            let pair = u16::from_le_bytes([codes[2 * j], codes[2 * j + 1]]);
            *o = ((pair & 0x0F) | ((pair >> 4) & 0xF0)) as u8;
        }
    }
}

impl Nvfp4Tensor {
    /// Reassembles a tensor from stored buffers (compact scale layout), checking every size.
    #[allow(clippy::too_many_arguments)]
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        two_d: bool,
        rht: bool,
        amax_rowwise: f32,
        amax_columnwise: f32,
        rowwise: Option<QuantPlane>,
        columnwise: Option<QuantPlane>,
    ) -> Result<Self, FormatError> {
        use crate::mxfp8::check_plane;
        if let Some(p) = &rowwise {
            check_plane(
                name,
                "rowwise",
                p,
                [rows, cols.div_ceil(2)],
                [rows, cols.div_ceil(BLOCK)],
            )?;
        }
        if let Some(p) = &columnwise {
            check_plane(
                name,
                "columnwise",
                p,
                [cols, rows.div_ceil(2)],
                [cols, rows.div_ceil(BLOCK)],
            )?;
        }
        Ok(Nvfp4Tensor {
            rows,
            cols,
            two_d,
            rht,
            amax_rowwise,
            amax_columnwise,
            rowwise,
            columnwise,
        })
    }

    /// Dequantizes the rowwise copy: `q · ((float(sf) · amax) · fl32(1/2688))`, TE's order.
    pub fn dequantize_rowwise(&self) -> Option<Vec<f32>> {
        let p = self.rowwise.as_ref()?;
        Some(dequantize_plane(p, self.rows, self.cols, self.amax_rowwise))
    }

    /// Dequantizes the columnwise copy back to the original `[rows, cols]` order, undoing the
    /// Hadamard transform (in fp32) when it was applied.
    pub fn dequantize_columnwise(&self) -> Option<Vec<f32>> {
        let p = self.columnwise.as_ref()?;
        let mut xt = dequantize_plane(p, self.cols, self.rows, self.amax_columnwise);
        if self.rht {
            for g in xt.chunks_exact_mut(BLOCK) {
                let v: &mut [f32; BLOCK] = g.try_into().expect("chunks_exact yields 16 elements");
                *v = crate::hadamard::inverse_rht16(v);
            }
        }
        Some(transpose_f32(&xt, self.cols, self.rows))
    }

    /// Dequantizes the rowwise copy if present, else the columnwise one.
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_rowwise()
            .or_else(|| self.dequantize_columnwise())
            .unwrap_or_default()
    }
}

fn dequantize_plane(p: &QuantPlane, rows: usize, cols: usize, amax: f32) -> Vec<f32> {
    // TE's `dequantize_fp4_kernel`: `final_scale = float(sf) · amax · factor_inv` evaluated left
    // to right, with `factor_inv = (float)(1.0 / (6.0 · 448.0))`, then `q · final_scale`.
    let factor_inv = (1.0f64 / (6.0 * 448.0)) as f32;
    let (rb, nb) = (cols.div_ceil(2), cols.div_ceil(BLOCK));
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for c in 0..cols {
            let byte = p.data[r * rb + c / 2];
            let q = e2m1_to_f32(if c % 2 == 0 { byte } else { byte >> 4 });
            let final_scale = e4m3_to_f32(p.scales[r * nb + c / BLOCK]) * amax * factor_inv;
            out[r * cols + c] = q * final_scale;
        }
    }
    out
}

/// 2D NVFP4 computed piecewise, for data-parallel primary weights: each rank holds a flat
/// element range of a row-major `rows × cols` weight. The ranks fold partial tile amaxes
/// ([`sharded::fold_tile_amax_2d`]), reduce them with MAX (the global amax is the max of the
/// tiles), quantize their own ranges into packed bytes ([`sharded::quantize_2d_range`]) and
/// gather the bytes; [`sharded::from_rowwise_2d`] then rebuilds both copies. The result is
/// byte-identical to [`quantize_nvfp4`] with `two_d` on the whole matrix, because every code
/// depends only on its element, its tile's amax and the global amax.
pub mod sharded {
    use super::{BLOCK, Nvfp4Tensor, Params};
    use crate::scalar::e2m1_from_f32;
    use crate::{FormatError, QuantPlane};

    /// Tiles of a `rows × cols` matrix: `ceil(rows/16) · ceil(cols/16)`.
    pub fn tile_count(rows: usize, cols: usize) -> usize {
        rows.div_ceil(BLOCK) * cols.div_ceil(BLOCK)
    }

    /// Folds the magnitudes of elements `start ..` (flat, row-major, `cols` columns) into the
    /// per-tile amaxes `tiles` (non-negative f32, NaN ignored).
    ///
    /// # Errors
    /// [`FormatError::Unsupported`] where `tiles` does not cover a non-empty range (or `cols`
    /// is 0, or the range passes `usize`; [`crate::check_tile_cover`]); nothing is folded then.
    pub fn fold_tile_amax_2d(
        values: &[f32],
        start: usize,
        cols: usize,
        tiles: &mut [f32],
    ) -> Result<(), FormatError> {
        crate::fold_tile_amax_2d::<BLOCK>("nvfp4 shard", tile_count, values, start, cols, tiles)
    }

    /// Packed codes (element `2i` in the low nibble) of elements `start ..` given the reduced
    /// tile amaxes. `start` and `values.len()` must be even; `out` has `values.len() / 2` bytes.
    pub fn quantize_2d_range(
        values: &[f32],
        start: usize,
        cols: usize,
        tiles: &[f32],
        out: &mut [u8],
    ) -> Result<(), FormatError> {
        if !start.is_multiple_of(2)
            || !values.len().is_multiple_of(2)
            || out.len() * 2 != values.len()
        {
            return Err(FormatError::Unsupported {
                name: "nvfp4 shard".into(),
                reason: format!(
                    "a packed range must start and end on a byte: start {start}, {} values, {} bytes",
                    values.len(),
                    out.len()
                ),
            });
        }
        if values.is_empty() {
            return Ok(());
        }
        crate::check_tile_cover(
            "nvfp4 shard",
            (start, values.len(), cols),
            tiles.len(),
            tile_count,
        )?;
        let p = Params::new(global_amax(tiles));
        let code = |flat: usize, v: f32| {
            let (_, rcp) = p.block(tiles[crate::tile_of::<BLOCK>(flat, cols)].to_bits());
            e2m1_from_f32(v * rcp)
        };
        for (j, (o, pair)) in out.iter_mut().zip(values.chunks_exact(2)).enumerate() {
            let flat = start + 2 * j;
            *o = code(flat, pair[0]) | (code(flat + 1, pair[1]) << 4);
        }
        Ok(())
    }

    /// The global amax: the max of the tile amaxes.
    pub fn global_amax(tiles: &[f32]) -> f32 {
        f32::from_bits(tiles.iter().map(|t| t.to_bits()).max().unwrap_or(0))
    }

    /// Both copies of a 2D NVFP4 tensor from its gathered rowwise bytes (`rows · cols / 2`,
    /// `cols` even) and the reduced tile amaxes.
    pub fn from_rowwise_2d(
        rows: usize,
        cols: usize,
        rowwise: Vec<u8>,
        tiles: &[f32],
    ) -> Result<Nvfp4Tensor, FormatError> {
        let bad = |reason: String| FormatError::Unsupported {
            name: "nvfp4 shard".into(),
            reason,
        };
        if !cols.is_multiple_of(2)
            || Some(rowwise.len() * 2) != rows.checked_mul(cols)
            || tiles.len() != tile_count(rows, cols)
        {
            return Err(bad(format!(
                "{} bytes and {} tiles for a {rows}x{cols} matrix",
                rowwise.len(),
                tiles.len()
            )));
        }
        let amax = global_amax(tiles);
        let p = Params::new(amax);
        let (tr, tc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
        let sf: Vec<u8> = tiles.iter().map(|t| p.block(t.to_bits()).0).collect();
        let row_scales: Vec<u8> = (0..rows * tc)
            .map(|i| sf[(i / tc / BLOCK) * tc + i % tc])
            .collect();
        let col_scales: Vec<u8> = (0..cols * tr)
            .map(|i| sf[(i % tr) * tc + (i / tr) / BLOCK])
            .collect();
        let nib = |i: usize| (rowwise[i / 2] >> (4 * (i % 2))) & 0xF;
        let cb = rows.div_ceil(2);
        let mut col_data = vec![0u8; cols * cb];
        for c in 0..cols {
            for r in 0..rows {
                col_data[c * cb + r / 2] |= nib(r * cols + c) << (4 * (r % 2));
            }
        }
        Nvfp4Tensor::from_parts(
            "nvfp4 shard",
            rows,
            cols,
            true,
            false,
            amax,
            amax,
            Some(QuantPlane {
                data: rowwise,
                data_shape: [rows, cols / 2],
                scales: row_scales,
                scale_shape: [rows, tc],
            }),
            Some(QuantPlane {
                data: col_data,
                data_shape: [cols, cb],
                scales: col_scales,
                scale_shape: [cols, tr],
            }),
        )
    }
}

/// Columns per work item of [`quantize_cols_direct`].
const STRIP: usize = 256;

/// The columnwise copy straight from X, without materialising Xᵀ in f32: work items are strips
/// of up to 256 columns (whole output rows of the plane); per band of 16 rows, the column
/// amaxes, scales and packed codes are computed along the row (so they vectorise), then each
/// column's 8 bytes are stored into its output row. Needs `rows % 16 == 0`, no RHT and no
/// stochastic rounding.
fn quantize_cols_direct<E: Element>(
    x: &[E],
    rows: usize,
    cols: usize,
    p: &Params,
    tiles: Option<&Tiles>,
    threads: usize,
) -> QuantPlane {
    let (rb, nbr) = (rows / 2, rows / BLOCK);
    let mut plane = QuantPlane {
        data: crate::alloc::uninit(cols * rb),
        data_shape: [cols, rb],
        scales: vec![0; cols * nbr],
        scale_shape: [cols, nbr],
    };
    if rows == 0 || cols == 0 {
        return plane;
    }
    let done = AtomicUsize::new(0);
    let items: Vec<_> = alloc::chunks(&mut plane.data, cols * rb, STRIP * rb, &done)
        .into_iter()
        .zip(plane.scales.chunks_mut(STRIP * nbr))
        .enumerate()
        .collect();
    par::for_each(items, threads, |(i, (data, scales))| {
        let data = data.bytes();
        crate::simd::dispatch(
            #[inline(always)]
            || column_strip(x, rows, cols, p, tiles, i * STRIP, data, scales),
        )
    });
    alloc::finish(&mut plane.data, cols * rb, &done);
    plane
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn column_strip<E: Element>(
    x: &[E],
    rows: usize,
    cols: usize,
    p: &Params,
    tiles: Option<&Tiles>,
    c0: usize,
    data: &mut [u8],
    scales: &mut [u8],
) {
    let (rb, nbr) = (rows / 2, rows / BLOCK);
    let cn = (cols - c0).min(STRIP);
    let mut amax = [0u32; STRIP];
    let mut mult = [0f32; STRIP];
    let mut packed = [[0u8; STRIP]; BLOCK / 2];
    let row = |r: usize| &x[r * cols + c0..][..cn];
    for b in 0..nbr {
        let (amax, mult) = (&mut amax[..cn], &mut mult[..cn]);
        match tiles {
            Some(t) => {
                for (j, m) in mult.iter_mut().enumerate() {
                    let (sf, rcp) = t.scales[b * t.tile_cols + (c0 + j) / BLOCK];
                    scales[j * nbr + b] = sf;
                    *m = rcp;
                }
            }
            None => {
                amax.fill(0);
                for r in b * BLOCK..(b + 1) * BLOCK {
                    for (a, v) in amax.iter_mut().zip(row(r)) {
                        *a = (*a).max(crate::abs_bits_nan_zero(v.to_f32()));
                    }
                }
                for (j, (a, m)) in amax.iter().zip(mult.iter_mut()).enumerate() {
                    let (sf, rcp) = p.block(*a);
                    scales[j * nbr + b] = sf;
                    *m = rcp;
                }
            }
        }
        for (i, pk) in packed.iter_mut().enumerate() {
            let r = b * BLOCK + 2 * i;
            for (((o, lo), hi), m) in pk[..cn].iter_mut().zip(row(r)).zip(row(r + 1)).zip(&*mult) {
                *o = e2m1_from_f32(lo.to_f32() * m) | (e2m1_from_f32(hi.to_f32() * m) << 4);
            }
        }
        for (j, o) in data.chunks_mut(rb).take(cn).enumerate() {
            for (ob, pk) in o[b * (BLOCK / 2)..][..BLOCK / 2].iter_mut().zip(&packed) {
                *ob = pk[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pieces of 32 rows (the last one partial) quantized with the whole matrix's amax give the
    /// whole matrix's bytes: rowwise planes stacked, columnwise ones as column segments.
    #[test]
    fn pieces_give_the_whole_matrix_bytes() {
        let (rows, cols) = (75, 40);
        let x: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) * 1e-3 * (1 + i % 7) as f32)
            .collect();
        let whole_m = Matrix::new("w", rows, cols, Source::F32(&x)).unwrap();
        for two_d in [false, true] {
            let cfg = Nvfp4Config {
                two_d,
                ..Nvfp4Config::default()
            };
            let whole = quantize_nvfp4(&whole_m, &cfg).unwrap();
            let amax = nvfp4_amax(&whole_m, 2);
            assert_eq!(amax, whole.amax_rowwise);
            let (wr, wc) = (whole.rowwise.unwrap(), whole.columnwise.unwrap());
            let (mut data, mut scales) = (Vec::new(), Vec::new());
            for r0 in (0..rows).step_by(32) {
                let r1 = (r0 + 32).min(rows);
                let m = Matrix::new("w", r1 - r0, cols, Source::F32(&x[r0 * cols..r1 * cols]));
                let p = quantize_nvfp4_piece(&m.unwrap(), &cfg, amax).unwrap();
                let (pr, pc) = (p.rowwise.unwrap(), p.columnwise.unwrap());
                data.extend(pr.data);
                scales.extend(pr.scales);
                let (db, sb) = ((r1 - r0).div_ceil(2), (r1 - r0).div_ceil(BLOCK));
                for c in 0..cols {
                    let d = &wc.data[c * rows.div_ceil(2) + r0 / 2..][..db];
                    assert_eq!(d, &pc.data[c * db..][..db], "column {c} at row {r0}");
                    let s = &wc.scales[c * rows.div_ceil(BLOCK) + r0 / BLOCK..][..sb];
                    assert_eq!(s, &pc.scales[c * sb..][..sb], "column {c} at row {r0}");
                }
            }
            assert_eq!((data, scales), (wr.data, wr.scales));
        }
        let sr = Nvfp4Config {
            stochastic_rounding: Some(1),
            ..Nvfp4Config::default()
        };
        assert!(quantize_nvfp4_piece(&whole_m, &sr, 1.0).is_err());
    }

    /// `--nan-policy te` on NaN, as Transformer Engine does it: block amaxes start at 0 and
    /// fold with `fmaxf`/`__hmax`, which drop NaN (`quantize_nvfp4.cuh`, `block_amax =
    /// fmaxf(block_amax, fabsf(elt))`), and E2M1's `cvt.rn.satfinite` turns NaN into +6. An
    /// all-NaN block thus gets scale byte 0 and codes 0x7: it decodes to +0, as in TE; a NaN
    /// beside finite values decodes to +6 times its block's scale (its block amax, rounded).
    #[test]
    fn nan_follows_transformer_engine() {
        let x = vec![f32::NAN; 32 * 32];
        let m = Matrix::new("w", 32, 32, Source::F32(&x)).unwrap();
        let t = quantize_nvfp4(&m, &Nvfp4Config::default()).unwrap();
        assert_eq!(t.amax_rowwise.to_bits(), 0);
        let r = t.rowwise.as_ref().unwrap();
        assert!(r.scales.iter().all(|&b| b == 0), "{:?}", r.scales);
        assert!(r.data.iter().all(|&b| b == 0x77), "{:?}", r.data);
        assert!(t.dequantize().iter().all(|v| v.to_bits() == 0));
        let mut x = vec![0.5f32; 16 * 16];
        x[0] = f32::NAN;
        x[1] = -3.0;
        let m = Matrix::new("w", 16, 16, Source::F32(&x)).unwrap();
        let y = quantize_nvfp4(&m, &Nvfp4Config::default())
            .unwrap()
            .dequantize();
        assert_eq!((y[0], y[1]), (3.0, -3.0));
    }
}
