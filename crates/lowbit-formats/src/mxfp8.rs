//! MXFP8: fp8 elements (E4M3 or E5M2) with one E8M0 power-of-two scale per 32 elements.
//!
//! TE's rule (`quantize_mxfp8_kernel` in TE's `transformer_engine/common/cast/mxfp8/
//! quantize_mxfp8.cuh`: `ptx::float_to_e8m0(amax * Quantized_Limits<OType>::max_norm_rcp)`, then
//! the elements times `ptx::exp2f_rcp(e)`), per block:
//! `e = e8m0_round_up(fl32(amax · fl32(1/max)))`, `q = fp8_rne_satfinite(fl32(x · 2^(127−e)))`.
//! The scale multiply is exact, so each element is rounded once.
//!
//! Copies, for a `rows × cols` matrix (both `rows × cols` bytes, neither transposed):
//! - rowwise: 1x32 blocks along a row, scales `[rows, ceil(cols/32)]`;
//! - columnwise: 32x1 blocks down a column, scales `[ceil(rows/32), cols]`;
//! - 2D: one scale per 32x32 tile, written into both scale tensors, so both copies hold the same
//!   bytes.
//!
//! Both copies come from one pass over the input: the quantizer walks bands of 32 rows, encodes
//! the rowwise blocks while it folds the column amaxes, then encodes the columnwise copy of the
//! band while the band is still in cache. Full bands of bf16 or f16 input with whole 32-column
//! blocks take the faster integer kernel of `tile16` instead, which gives the same bytes.

use std::sync::atomic::AtomicUsize;

use crate::scalar::{self, Fp8Kind, e8m0_from_f32, e8m0_rcp, e8m0_to_f32};
use crate::{
    Copies, Element, FormatError, Matrix, NanPolicy, QuantPlane, Source, abs_bits_nan_zero, alloc,
    par, thread_count,
};

mod tile16;

/// Elements per MXFP8 block (and rows/columns per 2D tile).
pub const BLOCK: usize = 32;

/// How to quantize to MXFP8.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mxfp8Config {
    /// Element type.
    pub kind: Fp8Kind,
    /// Which copies to produce.
    pub copies: Copies,
    /// One scale per 32x32 tile, shared by both copies (TE's weight recipe option).
    pub two_d: bool,
    /// Treatment of NaN and ±Inf inputs.
    pub nan_policy: NanPolicy,
    /// Worker threads; 0 means all available cores. The result does not depend on it.
    pub threads: usize,
}

impl Default for Mxfp8Config {
    fn default() -> Self {
        Mxfp8Config {
            kind: Fp8Kind::E4M3,
            copies: Copies::Both,
            two_d: false,
            nan_policy: NanPolicy::Te,
            threads: 1,
        }
    }
}

/// A quantized MXFP8 matrix.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mxfp8Tensor {
    /// Rows of the original matrix.
    pub rows: usize,
    /// Columns of the original matrix.
    pub cols: usize,
    /// Element type.
    pub kind: Fp8Kind,
    /// Whether scales are per 32x32 tile.
    pub two_d: bool,
    /// Rowwise copy: data `[rows, cols]`, scales `[rows, ceil(cols/32)]`.
    pub rowwise: Option<QuantPlane>,
    /// Columnwise copy: data `[rows, cols]` (not transposed), scales `[ceil(rows/32), cols]`.
    pub columnwise: Option<QuantPlane>,
}

/// Quantizes `m` to MXFP8 with TE's scale rule.
pub fn quantize_mxfp8(m: &Matrix<'_>, cfg: &Mxfp8Config) -> Result<Mxfp8Tensor, FormatError> {
    let mut t = Mxfp8Tensor {
        rows: 0,
        cols: 0,
        kind: cfg.kind,
        two_d: cfg.two_d,
        rowwise: None,
        columnwise: None,
    };
    quantize_mxfp8_into(m, cfg, &mut t)?;
    Ok(t)
}

/// [`quantize_mxfp8`] into an existing tensor, reusing its buffers when their shapes already
/// fit (as a training step's weights do): every output byte is overwritten, so nothing needs
/// zeroing and no fresh memory is faulted in. On error `out` is left unchanged.
pub fn quantize_mxfp8_into(
    m: &Matrix<'_>,
    cfg: &Mxfp8Config,
    out: &mut Mxfp8Tensor,
) -> Result<(), FormatError> {
    m.check_finite(cfg.nan_policy)?;
    let (rows, cols) = (m.rows(), m.cols());
    let t = out;
    t.rows = rows;
    t.cols = cols;
    t.kind = cfg.kind;
    t.two_d = cfg.two_d;
    reuse_plane(
        &mut t.rowwise,
        cfg.copies.rowwise(),
        rowwise_shapes(rows, cols),
    );
    reuse_plane(
        &mut t.columnwise,
        cfg.copies.columnwise(),
        columnwise_shapes(rows, cols),
    );
    match (m.data(), cfg.kind) {
        (Source::F32(x), Fp8Kind::E4M3) => run(x, t, cfg, scalar::e4m3_from_f32),
        (Source::F32(x), Fp8Kind::E5M2) => run(x, t, cfg, scalar::e5m2_from_f32),
        (Source::Bf16(x), Fp8Kind::E4M3) => run(x, t, cfg, scalar::e4m3_from_f32),
        (Source::Bf16(x), Fp8Kind::E5M2) => run(x, t, cfg, scalar::e5m2_from_f32),
        (Source::F16(x), Fp8Kind::E4M3) => run(x, t, cfg, scalar::e4m3_from_f32),
        (Source::F16(x), Fp8Kind::E5M2) => run(x, t, cfg, scalar::e5m2_from_f32),
    }
    Ok(())
}

/// Keeps `slot`'s plane if it already has the shapes `shapes` gives, else allocates one (or
/// clears the slot when the copy is not wanted).
fn reuse_plane(slot: &mut Option<QuantPlane>, want: bool, shapes: [[usize; 2]; 2]) {
    if !want {
        *slot = None;
    } else if slot
        .as_ref()
        .is_none_or(|p| [p.data_shape, p.scale_shape] != shapes)
    {
        let [d, s] = shapes;
        *slot = Some(QuantPlane {
            data: crate::alloc::uninit(d[0] * d[1]),
            data_shape: d,
            scales: vec![0; s[0] * s[1]],
            scale_shape: s,
        });
    }
}

/// `[data shape, scale shape]` of the rowwise copy.
fn rowwise_shapes(rows: usize, cols: usize) -> [[usize; 2]; 2] {
    [[rows, cols], [rows, cols.div_ceil(BLOCK)]]
}

/// `[data shape, scale shape]` of the columnwise copy.
fn columnwise_shapes(rows: usize, cols: usize) -> [[usize; 2]; 2] {
    [[rows, cols], [rows.div_ceil(BLOCK), cols]]
}

/// The outputs of one band of up to 32 rows.
struct Band<'a, E> {
    x: &'a [E],
    row_data: Option<&'a mut [u8]>,
    row_scales: Option<&'a mut [u8]>,
    col_data: Option<&'a mut [u8]>,
    col_scales: Option<&'a mut [u8]>,
}

/// Data chunks and scale chunks of one copy, a band each.
type CopyChunks<'a> = (
    std::vec::IntoIter<alloc::Chunk<'a>>,
    std::slice::ChunksMut<'a, u8>,
);

fn split<'a>(
    buf: Option<&'a mut QuantPlane>,
    data_chunk: usize,
    scale_chunk: usize,
    done: &'a AtomicUsize,
) -> Option<CopyChunks<'a>> {
    buf.map(|p| {
        let n = p.data_shape[0] * p.data_shape[1];
        (
            alloc::chunks(&mut p.data, n, data_chunk, done).into_iter(),
            p.scales.chunks_mut(scale_chunk.max(1)),
        )
    })
}

fn next<'a>(c: &mut Option<CopyChunks<'a>>) -> (Option<alloc::Chunk<'a>>, Option<&'a mut [u8]>) {
    match c {
        None => (None, None),
        Some((d, s)) => (d.next(), s.next()),
    }
}

fn run<E: Element>(
    x: &[E],
    t: &mut Mxfp8Tensor,
    cfg: &Mxfp8Config,
    enc: impl Fn(f32) -> u8 + Copy + Sync,
) {
    let (rows, cols) = (t.rows, t.cols);
    let (row_done, col_done) = (AtomicUsize::new(0), AtomicUsize::new(0));
    if rows > 0 && cols > 0 {
        let nb = cols.div_ceil(BLOCK);
        let band_elems = BLOCK * cols;
        let mut rw = split(t.rowwise.as_mut(), band_elems, BLOCK * nb, &row_done);
        let mut cw = split(t.columnwise.as_mut(), band_elems, cols, &col_done);
        let bands: Vec<_> = x
            .chunks(band_elems)
            .map(|xb| (xb, next(&mut rw), next(&mut cw)))
            .collect();
        let rcp = cfg.kind.max_norm_rcp();
        let two_d = cfg.two_d;
        let kind = cfg.kind;
        par::for_each(
            bands,
            thread_count(cfg.threads),
            |(xb, (rd, rs), (cd, cs))| {
                let b = Band {
                    x: xb,
                    row_data: rd.map(alloc::Chunk::bytes),
                    row_scales: rs,
                    col_data: cd.map(alloc::Chunk::bytes),
                    col_scales: cs,
                };
                crate::simd::dispatch(
                    #[inline(always)]
                    || {
                        if let Some((bits, input)) = E::half_bits(b.x)
                            && bits.len() == BLOCK * cols
                            && cols.is_multiple_of(BLOCK)
                        {
                            let out = tile16::BandOut {
                                row: b.row_data.zip(b.row_scales),
                                col: b.col_data.zip(b.col_scales),
                            };
                            tile16::band(bits, input, cols, two_d, kind, out);
                        } else if two_d {
                            band_2d(b, cols, rcp, enc);
                        } else {
                            band_1d(b, cols, rcp, enc);
                        }
                    },
                )
            },
        );
    }
    let n = rows * cols;
    if let Some(p) = t.rowwise.as_mut() {
        alloc::finish(&mut p.data, n, &row_done);
    }
    if let Some(p) = t.columnwise.as_mut() {
        alloc::finish(&mut p.data, n, &col_done);
    }
}

/// The E8M0 scale of a block with amax bits `amax` and its exact reciprocal.
#[inline(always)]
fn scale_of(amax: u32, rcp: f32) -> (u8, f32) {
    let e = e8m0_from_f32(f32::from_bits(amax) * rcp);
    (e, e8m0_rcp(e))
}

#[inline(always)]
fn block_amax<E: Element>(x: &[E]) -> u32 {
    crate::amax_bits(x)
}

#[inline(always)]
fn encode_block<E: Element>(x: &[E], s: f32, out: &mut [u8], enc: impl Fn(f32) -> u8) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = enc(v.to_f32() * s);
    }
}

/// One rowwise 1x32 block of known size (the common case), so the loops fully unroll. With
/// `col_amax` (both copies), the block's magnitudes also fold into the column amaxes, so the
/// row is decoded once for both.
#[inline(always)]
fn full_block<E: Element>(
    x: &[E; BLOCK],
    out: &mut [u8; BLOCK],
    col_amax: Option<&mut [u32; BLOCK]>,
    rcp: f32,
    enc: impl Fn(f32) -> u8,
) -> u8 {
    let amax = match col_amax {
        None => crate::amax_bits(x),
        Some(ca) => {
            let mut mag = [0u32; BLOCK];
            for (m, v) in mag.iter_mut().zip(x) {
                *m = abs_bits_nan_zero(v.to_f32());
            }
            let mut t = *ca;
            for (t, m) in t.iter_mut().zip(&mag) {
                *t = (*t).max(*m);
            }
            *ca = t;
            let mut lanes = [0u32; 8];
            for m8 in mag.chunks_exact(8) {
                for (l, m) in lanes.iter_mut().zip(m8) {
                    *l = (*l).max(*m);
                }
            }
            lanes.into_iter().fold(0, u32::max)
        }
    };
    let (e, s) = scale_of(amax, rcp);
    for (o, v) in out.iter_mut().zip(x) {
        *o = enc(v.to_f32() * s);
    }
    e
}

/// `col_amax[j] = max(col_amax[j], |x[j]|)` in fixed groups of eight: written as a plain
/// element loop, LLVM turns the max into conditional (masked) stores, which are slow.
#[inline(always)]
fn fold_col_amax<E: Element>(col_amax: &mut [u32], x: &[E]) {
    let mut a8 = col_amax.chunks_exact_mut(8);
    let mut x8 = x.chunks_exact(8);
    for (a, v) in (&mut a8).zip(&mut x8) {
        let mut t: [u32; 8] = a.try_into().expect("chunks of 8");
        for (t, v) in t.iter_mut().zip(v) {
            *t = (*t).max(abs_bits_nan_zero(v.to_f32()));
        }
        a.copy_from_slice(&t);
    }
    for (a, v) in a8.into_remainder().iter_mut().zip(x8.remainder()) {
        *a = (*a).max(abs_bits_nan_zero(v.to_f32()));
    }
}

#[inline(always)]
fn band_1d<E: Element>(b: Band<'_, E>, cols: usize, rcp: f32, enc: impl Fn(f32) -> u8 + Copy) {
    let nb = cols.div_ceil(BLOCK);
    let mut col_amax = if b.col_data.is_some() {
        vec![0u32; cols]
    } else {
        Vec::new()
    };
    let mut row_out = b.row_data.zip(b.row_scales);
    let mut mult = vec![0f32; nb];
    for (r, xr) in b.x.chunks_exact(cols).enumerate() {
        let Some((data, scales)) = row_out.as_mut() else {
            fold_col_amax(&mut col_amax, xr);
            continue;
        };
        let out_row = &mut data[r * cols..(r + 1) * cols];
        let scale_row = &mut scales[r * nb..(r + 1) * nb];
        if col_amax.is_empty() && cols.is_multiple_of(BLOCK) {
            row_whole_blocks(xr, out_row, scale_row, &mut mult, rcp, enc);
            continue;
        }
        let mut ca = col_amax.chunks_mut(BLOCK);
        for ((xc, oc), sc) in xr
            .chunks(BLOCK)
            .zip(out_row.chunks_mut(BLOCK))
            .zip(scale_row.iter_mut())
        {
            let ca = ca.next();
            *sc = match (
                <&[E; BLOCK]>::try_from(xc),
                <&mut [u8; BLOCK]>::try_from(&mut *oc),
            ) {
                (Ok(x), Ok(o)) if ca.as_ref().is_none_or(|c| c.len() == BLOCK) => {
                    let ca = ca.map(|c| <&mut [u32; BLOCK]>::try_from(c).expect("checked"));
                    full_block(x, o, ca, rcp, enc)
                }
                _ => {
                    if let Some(ca) = ca {
                        fold_col_amax(ca, xc);
                    }
                    let (e, s) = scale_of(block_amax(xc), rcp);
                    encode_block(xc, s, oc, enc);
                    e
                }
            };
        }
    }
    if let (Some(data), Some(scales)) = (b.col_data, b.col_scales) {
        let mut col_rcp = vec![0f32; cols];
        for ((a, sc), s) in col_amax.iter().zip(scales.iter_mut()).zip(&mut col_rcp) {
            let (e, r) = scale_of(*a, rcp);
            *sc = e;
            *s = r;
        }
        for (xr, out_row) in b.x.chunks_exact(cols).zip(data.chunks_exact_mut(cols)) {
            for ((o, v), s) in out_row.iter_mut().zip(xr).zip(&col_rcp) {
                *o = enc(v.to_f32() * s);
            }
        }
    }
}

/// One rowwise-only row of whole 1x32 blocks: every block's scale first, then the codes, so
/// neither loop waits on the other's latency. (With the columnwise copy, the per-block path
/// that folds the column amaxes from the same loaded values measured faster.)
#[inline(always)]
fn row_whole_blocks<E: Element>(
    xr: &[E],
    out_row: &mut [u8],
    scale_row: &mut [u8],
    mult: &mut [f32],
    rcp: f32,
    enc: impl Fn(f32) -> u8,
) {
    for ((xc, sc), m) in xr
        .chunks_exact(BLOCK)
        .zip(scale_row.iter_mut())
        .zip(mult.iter_mut())
    {
        (*sc, *m) = scale_of(crate::amax_bits(xc), rcp);
    }
    for ((xc, oc), &m) in xr
        .chunks_exact(BLOCK)
        .zip(out_row.chunks_exact_mut(BLOCK))
        .zip(mult.iter())
    {
        let xc: &[E; BLOCK] = xc.try_into().expect("chunks_exact");
        let oc: &mut [u8; BLOCK] = oc.try_into().expect("chunks_exact");
        for (o, v) in oc.iter_mut().zip(xc) {
            *o = enc(v.to_f32() * m);
        }
    }
}

#[inline(always)]
fn band_2d<E: Element>(b: Band<'_, E>, cols: usize, rcp: f32, enc: impl Fn(f32) -> u8 + Copy) {
    let nb = cols.div_ceil(BLOCK);
    let mut tile_amax = vec![0u32; nb];
    for xr in b.x.chunks_exact(cols) {
        for (a, xc) in tile_amax.iter_mut().zip(xr.chunks(BLOCK)) {
            *a = (*a).max(block_amax(xc));
        }
    }
    let tiles: Vec<(u8, f32)> = tile_amax.iter().map(|&a| scale_of(a, rcp)).collect();
    // Both copies hold the same bytes; encode into whichever exists and copy to the other.
    let (primary, secondary) = match (b.row_data, b.col_data) {
        (Some(r), c) => (r, c),
        (None, Some(c)) => (c, None),
        (None, None) => return,
    };
    for (xr, out_row) in b.x.chunks_exact(cols).zip(primary.chunks_exact_mut(cols)) {
        for ((xc, oc), &(_, s)) in xr.chunks(BLOCK).zip(out_row.chunks_mut(BLOCK)).zip(&tiles) {
            encode_block(xc, s, oc, enc);
        }
    }
    if let Some(c) = secondary {
        c.copy_from_slice(primary);
    }
    if let Some(scales) = b.row_scales {
        for scale_row in scales.chunks_exact_mut(nb) {
            for (sc, &(e, _)) in scale_row.iter_mut().zip(&tiles) {
                *sc = e;
            }
        }
    }
    if let Some(scales) = b.col_scales {
        for (j, sc) in scales.iter_mut().enumerate() {
            *sc = tiles[j / BLOCK].0;
        }
    }
}

impl Mxfp8Tensor {
    /// Reassembles a tensor from stored buffers (compact scale layout), checking every size.
    pub fn from_parts(
        name: &str,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        two_d: bool,
        rowwise: Option<QuantPlane>,
        columnwise: Option<QuantPlane>,
    ) -> Result<Self, FormatError> {
        if let Some(p) = &rowwise {
            check_plane(
                name,
                "rowwise",
                p,
                [rows, cols],
                [rows, cols.div_ceil(BLOCK)],
            )?;
        }
        if let Some(p) = &columnwise {
            check_plane(
                name,
                "columnwise",
                p,
                [rows, cols],
                [rows.div_ceil(BLOCK), cols],
            )?;
        }
        Ok(Mxfp8Tensor {
            rows,
            cols,
            kind,
            two_d,
            rowwise,
            columnwise,
        })
    }

    /// Dequantizes the rowwise copy to fp32 (`q · 2^(e−127)`, exact).
    pub fn dequantize_rowwise(&self) -> Option<Vec<f32>> {
        let p = self.rowwise.as_ref()?;
        let nb = self.cols.div_ceil(BLOCK);
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols == 0 {
            return Some(out);
        }
        for (r, (o, q)) in out
            .chunks_exact_mut(self.cols)
            .zip(p.data.chunks_exact(self.cols))
            .enumerate()
        {
            for (j, (o, &q)) in o.iter_mut().zip(q).enumerate() {
                *o = self.kind.decode(q) * e8m0_to_f32(p.scales[r * nb + j / BLOCK]);
            }
        }
        Some(out)
    }

    /// Dequantizes the columnwise copy to fp32, in the original `[rows, cols]` order.
    pub fn dequantize_columnwise(&self) -> Option<Vec<f32>> {
        let p = self.columnwise.as_ref()?;
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols == 0 {
            return Some(out);
        }
        for (r, (o, q)) in out
            .chunks_exact_mut(self.cols)
            .zip(p.data.chunks_exact(self.cols))
            .enumerate()
        {
            let scales = &p.scales[(r / BLOCK) * self.cols..][..self.cols];
            for ((o, &q), &e) in o.iter_mut().zip(q).zip(scales) {
                *o = self.kind.decode(q) * e8m0_to_f32(e);
            }
        }
        Some(out)
    }

    /// Dequantizes the rowwise copy if present, else the columnwise one.
    pub fn dequantize(&self) -> Vec<f32> {
        self.dequantize_rowwise()
            .or_else(|| self.dequantize_columnwise())
            .unwrap_or_default()
    }
}

pub(crate) fn check_plane(
    name: &str,
    which: &str,
    p: &QuantPlane,
    data_shape: [usize; 2],
    scale_shape: [usize; 2],
) -> Result<(), FormatError> {
    let check = |what: &str, len: usize, shape: [usize; 2], expected: [usize; 2]| {
        if len == expected[0] * expected[1] && shape == expected {
            Ok(())
        } else {
            Err(FormatError::BadBuffer {
                name: name.to_owned(),
                what: format!("{which} {what}"),
                got: format!("{len} bytes as {shape:?}"),
                expected: format!("{expected:?}"),
            })
        }
    };
    check("data", p.data.len(), p.data_shape, data_shape)?;
    check("scales", p.scales.len(), p.scale_shape, scale_shape)
}

/// 2D MXFP8 computed piecewise, for data-parallel primary weights gathered as fp8 bytes: each
/// rank folds partial 32x32 tile amaxes of its flat element range
/// ([`sharded::fold_tile_amax_2d`]), the ranks reduce them with MAX, each quantizes its own
/// range ([`sharded::quantize_2d_range`]) and the bytes are gathered; [`sharded::scales_2d`]
/// gives both scale tensors. Byte-identical to
/// [`quantize_mxfp8`] with `two_d` on the whole matrix: each code depends only on its element
/// and its tile's amax. Both copies are the same bytes, so half the traffic of bf16 staging.
pub mod sharded {
    use super::{BLOCK, scale_of};
    use crate::{FormatError, Fp8Kind};

    /// Tiles of a `rows × cols` matrix: `ceil(rows/32) · ceil(cols/32)`.
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
        crate::fold_tile_amax_2d::<BLOCK>("mxfp8 shard", tile_count, values, start, cols, tiles)
    }

    /// fp8 codes of elements `start ..` (one byte each) given the reduced tile amaxes.
    pub fn quantize_2d_range(
        values: &[f32],
        start: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: &[f32],
        out: &mut [u8],
    ) -> Result<(), FormatError> {
        if out.len() != values.len() {
            return Err(FormatError::Unsupported {
                name: "mxfp8 shard".into(),
                reason: format!("{} values for {} bytes", values.len(), out.len()),
            });
        }
        if values.is_empty() {
            return Ok(());
        }
        crate::check_tile_cover(
            "mxfp8 shard",
            (start, values.len(), cols),
            tiles.len(),
            tile_count,
        )?;
        let rcp = kind.max_norm_rcp();
        for (i, (o, &v)) in out.iter_mut().zip(values).enumerate() {
            let (_, s) = scale_of(
                tiles[crate::tile_of::<BLOCK>(start + i, cols)].to_bits(),
                rcp,
            );
            *o = kind.encode(v * s);
        }
        Ok(())
    }

    /// The rowwise (`[rows, ceil(cols/32)]`) and columnwise (`[ceil(rows/32), cols]`) E8M0
    /// scales of a 2D-quantized matrix with the reduced tile amaxes `tiles`.
    ///
    /// # Errors
    /// [`FormatError::Unsupported`] where `tiles` is not [`tile_count`]`(rows, cols)` long or
    /// the scale sizes pass `usize`.
    pub fn scales_2d(
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: &[f32],
    ) -> Result<(Vec<u8>, Vec<u8>), FormatError> {
        let (tr, tc) = (rows.div_ceil(BLOCK), cols.div_ceil(BLOCK));
        let sizes = (
            tr.checked_mul(tc),
            rows.checked_mul(tc),
            tr.checked_mul(cols),
        );
        let (Some(n), Some(_), Some(_)) = sizes else {
            return Err(FormatError::Unsupported {
                name: "mxfp8 shard".into(),
                reason: format!("a {rows}x{cols} matrix's scales pass usize"),
            });
        };
        if tiles.len() != n {
            return Err(FormatError::Unsupported {
                name: "mxfp8 shard".into(),
                reason: format!("{} tiles for a {rows}x{cols} matrix", tiles.len()),
            });
        }
        let rcp = kind.max_norm_rcp();
        let e: Vec<u8> = tiles.iter().map(|t| scale_of(t.to_bits(), rcp).0).collect();
        let row = (0..rows * tc)
            .map(|i| e[(i / tc / BLOCK) * tc + i % tc])
            .collect();
        let col = (0..tr * cols)
            .map(|i| e[(i / cols) * tc + (i % cols) / BLOCK])
            .collect();
        Ok((row, col))
    }
}
