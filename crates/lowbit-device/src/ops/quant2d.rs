//! The 2D (16x16-tile) MXFP8 and NVFP4 quantization of sharded primary weights: each rank
//! folds its shard's tile amaxes, the amaxes are reduced, then every rank quantizes its range
//! with the same scales (`lowbit_formats::{mxfp8, nvfp4}::sharded`), so the bytes equal the
//! whole matrix's quantization. The per-tensor ops are in `quant.rs`.

use lowbit_formats::{Fp8Kind, mxfp8, nvfp4};

use super::quant::{Pending, PendingAmaxes, check_overlap_sorted};
use super::{Nvfp4Views, invalid};
use crate::{DType, Device, Result, View, bf16, check_dtype, check_float, check_len};

/// 2D NVFP4 primary weights computed shard by shard (see `lowbit_formats::nvfp4::sharded`).
impl Device {
    /// Folds the magnitudes of `src` — elements `start ..` of a row-major matrix with `cols`
    /// columns — into the per-16x16-tile amaxes `tiles` (f32, in place, NaN ignored).
    pub fn nvfp4_fold_tile_amax_2d(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
    ) -> Result<()> {
        self.fold_tiles(
            "nvfp4_fold_tile_amax_2d",
            (src, start, cols, tiles, nvfp4::BLOCK),
            nvfp4::sharded::tile_count,
            nvfp4::sharded::fold_tile_amax_2d,
        )
    }

    /// Writes the packed codes of `src` (elements `start ..`, even start and length) into the
    /// u8 view `out` (`src.len() / 2` bytes), with the MAX-reduced tile amaxes `tiles`.
    pub fn nvfp4_quantize_2d_range(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
        out: View,
    ) -> Result<()> {
        self.count_call(crate::CountedOp::Nvfp4Quantize2dRange);
        self.quantize_range(
            "nvfp4_quantize_2d_range",
            (src, start, cols, tiles, out),
            nvfp4::sharded::tile_count,
            #[cfg(feature = "cuda")]
            crate::cuda::Range2d::Nvfp4,
            |v, t, b| nvfp4::sharded::quantize_2d_range(v, start, cols, t, b),
        )
    }

    /// Completes gathered 2D NVFP4 weights: from the rowwise bytes `out.rowwise.0` (already in
    /// place) and the reduced tile amaxes, writes the rowwise scales and the whole columnwise
    /// copy, and returns the global amax.
    pub fn nvfp4_finish_2d(
        &mut self,
        rows: usize,
        cols: usize,
        tiles: View,
        out: &Nvfp4Views,
    ) -> Result<f32> {
        const WHAT: &str = "nvfp4_finish_2d";
        self.count_call(crate::CountedOp::Nvfp4Finish2d);
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return Err(invalid(WHAT, "both copies are needed"));
        };
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && let Some(amax) = g.nvfp4_finish_2d_kernel(rows, cols, tiles, [rd, rs, cd, cs])?
        {
            return Ok(amax);
        }
        let t: Vec<f32> = self.download(tiles)?;
        let rowwise = self.read_bytes(rd)?;
        self.note_fallback(WHAT);
        let tensor = nvfp4::sharded::from_rowwise_2d(rows, cols, rowwise, &t)?;
        let (Some(r), Some(c)) = (&tensor.rowwise, &tensor.columnwise) else {
            unreachable!("from_rowwise_2d builds both copies");
        };
        check_len(WHAT, rs.len(), r.scales.len())?;
        check_len(WHAT, cd.len(), c.data.len())?;
        check_len(WHAT, cs.len(), c.scales.len())?;
        self.write_bytes(rs, &r.scales)?;
        self.write_bytes(cd, &c.data)?;
        self.write_bytes(cs, &c.scales)?;
        Ok(tensor.amax_rowwise)
    }

    /// [`Device::nvfp4_finish_2d`] of every `(rows, cols, tiles, out)` of `items`, returning
    /// their global amaxes in order: the same bytes and amaxes as one call per item. On a GPU
    /// every item that the single op would complete with its kernel is done together (the
    /// amaxes in one launch, the matrices in two more per shape, one host read for all of them) instead
    /// of a launch sequence and a host round trip per item. When any item would fail alone or
    /// fall back to the host, the items run one by one through the single op (so its errors,
    /// in item order); when all are valid but one's output overlaps another item's views, the
    /// result would depend on the order: [`crate::DeviceError::Overlap`], nothing written.
    pub fn nvfp4_finish_2d_many(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
    ) -> Result<Vec<f32>> {
        let pending = self.finish_2d_many(items, false)?;
        self.read_amaxes(pending)
    }

    /// [`Device::nvfp4_finish_2d_many`] without reading the amaxes back yet: on a GPU they stay
    /// on the device until [`Device::read_amaxes`] (a copy and a stream synchronization), so a
    /// caller that completes several groups in a row synchronizes once for all of them instead
    /// of once per call, and the host keeps queueing work meanwhile. The same bytes and amaxes.
    pub fn nvfp4_finish_2d_many_deferred(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
    ) -> Result<PendingAmaxes> {
        self.finish_2d_many(items, true)
    }

    /// The amaxes of an [`Device::nvfp4_finish_2d_many_deferred`] call, in item order.
    ///
    /// # Errors
    /// [`crate::DeviceError::Unsupported`] for amaxes pending on another kind of device (a
    /// GPU's, read on the CPU backend); the device's own errors.
    pub fn read_amaxes(&mut self, pending: PendingAmaxes) -> Result<Vec<f32>> {
        let mut all = self.read_amaxes_many(vec![pending])?;
        Ok(all.pop().unwrap_or_default())
    }

    /// The amaxes of several [`Device::nvfp4_finish_2d_many_deferred`] calls, each in item
    /// order, the calls in the order given: on a GPU every copy is queued first and the stream
    /// synchronized once (one wait for all the groups `sync_params` completed, where reading
    /// them one by one waits once per group).
    ///
    /// # Errors
    /// As [`Device::read_amaxes`]; nothing is returned for any call when one fails.
    pub fn read_amaxes_many(&mut self, pending: Vec<PendingAmaxes>) -> Result<Vec<Vec<f32>>> {
        let mut out: Vec<Option<Vec<f32>>> = Vec::with_capacity(pending.len());
        #[cfg(feature = "cuda")]
        let mut on_device = Vec::new();
        for p in pending {
            match p.0 {
                Pending::Values(v) => out.push(Some(v)),
                #[cfg(feature = "cuda")]
                Pending::Device(words) => {
                    on_device.push(words);
                    out.push(None);
                }
            }
        }
        #[cfg(feature = "cuda")]
        if !on_device.is_empty() {
            let Some(g) = self.cuda_mut() else {
                return Err(crate::DeviceError::Unsupported(
                    "read_amaxes: the amaxes are on a CUDA device, this one is not".into(),
                ));
            };
            let mut read = g.read_pending_many(on_device)?.into_iter();
            for slot in out.iter_mut().filter(|s| s.is_none()) {
                *slot = read.next();
            }
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// [`Device::nvfp4_finish_2d_many`]; with `defer`, a GPU leaves the amaxes on the device.
    fn finish_2d_many(
        &mut self,
        items: &[(usize, usize, View, Nvfp4Views)],
        defer: bool,
    ) -> Result<PendingAmaxes> {
        const WHAT: &str = "nvfp4_finish_2d";
        #[cfg(not(feature = "cuda"))]
        let _ = defer;
        let mut checked = Vec::with_capacity(items.len());
        for (rows, cols, tiles, out) in items {
            match self.finish_2d_views(*rows, *cols, *tiles, out) {
                Some(v) => checked.push(([*rows, *cols], *tiles, v)),
                None => break,
            }
        }
        if checked.len() == items.len() {
            let ins: Vec<View> = checked.iter().flat_map(|(_, t, v)| [*t, v[0]]).collect();
            let outs: Vec<View> = checked
                .iter()
                .flat_map(|(_, _, v)| [v[1], v[2], v[3]])
                .collect();
            check_overlap_sorted(WHAT, &ins, &outs)?;
            #[cfg(feature = "cuda")]
            if let Some(g) = self.cuda_mut()
                && g.nvfp4_finish_version() != 1
                && let Some(done) = g.nvfp4_finish_2d_many(&checked, defer)?
            {
                for _ in items {
                    self.count_call(crate::CountedOp::Nvfp4Finish2d);
                }
                return Ok(PendingAmaxes(match done {
                    crate::cuda::Finished::Values(v) => Pending::Values(v),
                    crate::cuda::Finished::Pending(w) => Pending::Device(w),
                }));
            }
        }
        let values = items
            .iter()
            .map(|(rows, cols, tiles, out)| self.nvfp4_finish_2d(*rows, *cols, *tiles, out))
            .collect::<Result<Vec<f32>>>()?;
        Ok(PendingAmaxes(Pending::Values(values)))
    }

    /// The views `[rowwise data, rowwise scales, columnwise data, columnwise scales]` of a
    /// [`Device::nvfp4_finish_2d`] that its kernel takes and that cannot fail (both copies, u8
    /// views of the exact lengths, f32 tiles of the matrix's tile count, cols even and
    /// non-zero, rows non-zero, live views with disjoint outputs), else `None`.
    fn finish_2d_views(
        &self,
        rows: usize,
        cols: usize,
        tiles: View,
        out: &Nvfp4Views,
    ) -> Option<[View; 4]> {
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return None;
        };
        let (tr, tc) = (rows.div_ceil(16), cols.div_ceil(16));
        let len = |a: usize, b: usize| a.checked_mul(b);
        let ok = rows > 0
            && cols > 0
            && cols.is_multiple_of(2)
            && tiles.dtype() == DType::F32
            && Some(tiles.len()) == len(tr, tc)
            && [rd, rs, cd, cs].iter().all(|v| v.dtype() == DType::U8)
            && rd.len().checked_mul(2) == len(rows, cols)
            && Some(rs.len()) == len(rows, tc)
            && Some(cd.len()) == len(cols, rows.div_ceil(2))
            && Some(cs.len()) == len(cols, tr)
            && self
                .check_views("nvfp4_finish_2d", &[tiles, rd], &[rs, cd, cs])
                .is_ok();
        ok.then_some([rd, rs, cd, cs])
    }
}

/// 2D MXFP8 primary weights computed shard by shard (see `lowbit_formats::mxfp8::sharded`).
impl Device {
    /// Folds the magnitudes of `src` (elements `start ..` of a row-major matrix with `cols`
    /// columns) into the per-32x32-tile amaxes `tiles` (f32, in place, NaN ignored).
    pub fn mxfp8_fold_tile_amax_2d(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
    ) -> Result<()> {
        self.fold_tiles(
            "mxfp8_fold_tile_amax_2d",
            (src, start, cols, tiles, mxfp8::BLOCK),
            mxfp8::sharded::tile_count,
            mxfp8::sharded::fold_tile_amax_2d,
        )
    }

    /// Writes the fp8 codes of `src` (elements `start ..`) into the u8 view `out` (one byte
    /// each), with the MAX-reduced tile amaxes `tiles`.
    pub fn mxfp8_quantize_2d_range(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: View,
        out: View,
    ) -> Result<()> {
        self.count_call(crate::CountedOp::Mxfp8Quantize2dRange);
        self.quantize_range(
            "mxfp8_quantize_2d_range",
            (src, start, cols, tiles, out),
            mxfp8::sharded::tile_count,
            #[cfg(feature = "cuda")]
            crate::cuda::Range2d::Mxfp8(kind),
            |v, t, b| mxfp8::sharded::quantize_2d_range(v, start, cols, kind, t, b),
        )
    }

    /// Writes the rowwise and columnwise E8M0 scales of a 2D-quantized `rows × cols` matrix from
    /// its reduced tile amaxes.
    pub fn mxfp8_scales_2d(
        &mut self,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: View,
        row_scales: View,
        col_scales: View,
    ) -> Result<()> {
        const WHAT: &str = "mxfp8_scales_2d";
        self.count_call(crate::CountedOp::Mxfp8Scales2d);
        check_scales_2d(rows, cols, tiles, row_scales, col_scales)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.mxfp8_scales_2d([rows, cols], kind, tiles, [row_scales, col_scales])?
        {
            return Ok(());
        }
        // The tile count and both scale lengths were checked above (`check_scales_2d`).
        let t: Vec<f32> = self.download(tiles)?;
        self.note_fallback(WHAT);
        let (r, c) = mxfp8::sharded::scales_2d(rows, cols, kind, &t)?;
        self.write_bytes(row_scales, &r)?;
        self.write_bytes(col_scales, &c)
    }
}

/// The element counts of a `rows × cols` 2D MXFP8 matrix's tile amaxes, rowwise scales
/// (`[rows, ceil(cols/32)]`) and columnwise scales (`[ceil(rows/32), cols]`); `None` where one
/// passes `usize`.
pub(crate) fn scales_2d_lens(rows: usize, cols: usize) -> Option<[usize; 3]> {
    let (tr, tc) = (rows.div_ceil(32), cols.div_ceil(32));
    Some([
        tr.checked_mul(tc)?,
        rows.checked_mul(tc)?,
        tr.checked_mul(cols)?,
    ])
}

/// The lengths [`Device::mxfp8_scales_2d`] needs of a `rows × cols` matrix's views (tile
/// amaxes, rowwise and columnwise scales; their dtypes are the kernels' and the host copy's
/// concern), with shapes whose sizes pass `usize` named rather than wrapped.
fn check_scales_2d(rows: usize, cols: usize, tiles: View, rs: View, cs: View) -> Result<()> {
    const WHAT: &str = "mxfp8_scales_2d";
    let Some([nt, nr, nc]) = scales_2d_lens(rows, cols) else {
        return Err(invalid(
            WHAT,
            format!("a {rows}x{cols} matrix's scales exceed the address space"),
        ));
    };
    if tiles.len() != nt {
        return Err(invalid(
            WHAT,
            format!("{} tiles for {rows}x{cols}", tiles.len()),
        ));
    }
    check_len(WHAT, rs.len(), nr)?;
    check_len(WHAT, cs.len(), nc)
}

/// A format's sharded tile-amax fold (`lowbit_formats::{mxfp8,nvfp4}::sharded::fold_tile_amax_2d`).
type FoldTiles = fn(&[f32], usize, usize, &mut [f32]) -> Result<(), lowbit_formats::FormatError>;

/// Checks that `tiles` covers the flat range `start .. start + len` of a matrix with `cols`
/// columns (and that `cols > 0`), even an empty one: the formats' rule
/// ([`lowbit_formats::check_tile_cover`]), as this op's [`crate::DeviceError::Invalid`].
fn check_tiles_cover(
    what: &'static str,
    cover: (usize, usize, usize),
    tiles: View,
    tile_count: fn(usize, usize) -> usize,
) -> Result<()> {
    lowbit_formats::check_tile_cover(what, cover, tiles.len(), tile_count).map_err(|e| match e {
        lowbit_formats::FormatError::Unsupported { reason, .. } => invalid(what, reason),
        other => other.into(),
    })
}

/// The shared bodies of the sharded 2D ops: view checks, host round trip, the format's function.
impl Device {
    fn fold_tiles(
        &mut self,
        what: &'static str,
        (src, start, cols, tiles, tile): (View, usize, usize, View, usize),
        tile_count: fn(usize, usize) -> usize,
        fold: FoldTiles,
    ) -> Result<()> {
        check_float(what, src)?;
        check_dtype(what, tiles, DType::F32)?;
        self.check_views(what, &[src], &[tiles])?;
        check_tiles_cover(what, (start, src.len(), cols), tiles, tile_count)?;
        on_cuda!(self, g => g.fold_tile_amax((src, start, cols, tiles, tile)));
        #[cfg(not(feature = "cuda"))]
        let _ = tile;
        let values = self.read_f32(src)?;
        self.note_fallback(what);
        let mut t: Vec<f32> = self.download(tiles)?;
        fold(&values, start, cols, &mut t)?;
        self.upload(tiles, &t)
    }

    fn quantize_range(
        &mut self,
        what: &'static str,
        (src, start, cols, tiles, out): (View, usize, usize, View, View),
        tile_count: fn(usize, usize) -> usize,
        #[cfg(feature = "cuda")] format: crate::cuda::Range2d,
        quantize: impl FnOnce(&[f32], &[f32], &mut [u8]) -> Result<(), lowbit_formats::FormatError>,
    ) -> Result<()> {
        check_float(what, src)?;
        check_dtype(what, tiles, DType::F32)?;
        check_dtype(what, out, DType::U8)?;
        self.check_views(what, &[src, tiles], &[out])?;
        // The library indexes the tiles of every element (and divides by `cols`): a range they do
        // not cover is an error here, not a panic there.
        if !src.is_empty() {
            check_tiles_cover(what, (start, src.len(), cols), tiles, tile_count)?;
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.quantize_2d_range(format, (src, start, cols, tiles, out))?
        {
            return Ok(());
        }
        #[cfg(not(feature = "cuda"))]
        let _ = (start, cols);
        let values = self.read_f32(src)?;
        self.note_fallback(what);
        let t: Vec<f32> = self.download(tiles)?;
        let mut bytes = vec![0u8; out.len()];
        quantize(&values, &t, &mut bytes)?;
        self.write_bytes(out, &bytes)
    }
}

/// The element format of a piece of a 2D-quantized matrix (see [`Piece2d`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format2d {
    /// 2D MXFP8: 32x32 tiles, one code byte per element of this kind.
    Mxfp8(Fp8Kind),
    /// 2D NVFP4: 16x16 tiles, two codes per byte.
    Nvfp4,
}

impl Format2d {
    fn tile_count(self) -> fn(usize, usize) -> usize {
        match self {
            Format2d::Mxfp8(_) => mxfp8::sharded::tile_count,
            Format2d::Nvfp4 => nvfp4::sharded::tile_count,
        }
    }
}

/// One piece of a batched 2D staging op: elements `start .. start + src.len()` of a row-major
/// matrix with `cols` columns, whose values are `bf16(src)` (`src` f32, bf16 or f16, rounded to
/// bf16 exactly as [`Device::cast`] rounds), and the f32 tile amaxes `tiles` of that matrix (an
/// NVFP4 expert's own run of tiles when `start` is within that expert).
#[derive(Clone, Copy, Debug)]
pub struct Piece2d {
    /// The format (tile size, codes).
    pub format: Format2d,
    /// The values (rounded to bf16 first).
    pub src: View,
    /// The piece's first element within the matrix.
    pub start: usize,
    /// The matrix's columns.
    pub cols: usize,
    /// The matrix's tile amaxes.
    pub tiles: View,
}

/// `bf16(x)` of every value, as [`Device::cast`] rounds f32 to bf16 (`half`'s `from_f32`).
fn round_bf16(dtype: DType, values: &mut [f32]) {
    if dtype != DType::Bf16 {
        for v in values {
            *v = bf16::from_f32(*v).to_f32();
        }
    }
}

/// Batched 2D staging: the fold and the quantization of many pieces of `bf16(master)`, one
/// launch each on a GPU, instead of a cast, a fold and a quantization per piece.
impl Device {
    /// For every piece in order, the format's tile-amax fold ([`Device::mxfp8_fold_tile_amax_2d`]
    /// or [`Device::nvfp4_fold_tile_amax_2d`]) of `bf16(src)`: the same tiles as those calls on
    /// a bf16 copy of each source. Every piece is validated as the single op validates it
    /// before anything is written; a source sharing a byte with any piece's tiles is
    /// [`crate::DeviceError::Overlap`] (pieces may share their tiles view: the fold is a max,
    /// so the order does not matter; tiles views that overlap without being equal are refused
    /// as overlapping outputs).
    pub fn fold_tile_amax_2d_bf16_many(&mut self, pieces: &[Piece2d]) -> Result<()> {
        const WHAT: &str = "fold_tile_amax_2d_bf16_many";
        for p in pieces {
            check_float(WHAT, p.src)?;
            check_dtype(WHAT, p.tiles, DType::F32)?;
            self.check_views(WHAT, &[p.src], &[p.tiles])?;
            let cover = (p.start, p.src.len(), p.cols);
            check_tiles_cover(WHAT, cover, p.tiles, p.format.tile_count())?;
        }
        let srcs: Vec<View> = pieces.iter().map(|p| p.src).collect();
        let mut tiles: Vec<View> = pieces.iter().map(|p| p.tiles).collect();
        tiles.sort_by_key(|t| (t.buffer(), t.byte_offset(), t.byte_len()));
        tiles.dedup_by_key(|t| (t.buffer(), t.byte_offset(), t.byte_len()));
        check_overlap_sorted(WHAT, &srcs, &tiles)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.stage2d_fold_many(pieces)?
        {
            return Ok(());
        }
        for p in pieces {
            let mut values = self.read_f32(p.src)?;
            round_bf16(p.src.dtype(), &mut values);
            self.note_fallback(WHAT);
            let mut t: Vec<f32> = self.download(p.tiles)?;
            match p.format {
                Format2d::Mxfp8(_) => {
                    mxfp8::sharded::fold_tile_amax_2d(&values, p.start, p.cols, &mut t)
                }
                Format2d::Nvfp4 => {
                    nvfp4::sharded::fold_tile_amax_2d(&values, p.start, p.cols, &mut t)
                }
            }?;
            self.upload(p.tiles, &t)?;
        }
        Ok(())
    }

    /// For every `(piece, out)` in order, the format's range quantization
    /// ([`Device::mxfp8_quantize_2d_range`] or [`Device::nvfp4_quantize_2d_range`]) of
    /// `bf16(src)` with the reduced tiles into the u8 view `out`: the same bytes as those calls
    /// on a bf16 copy of each source (an NVFP4 piece's global amax is the max of its tiles
    /// view, as there). Every item is validated first (as the single op, plus `out`'s length:
    /// one byte per element, or for NVFP4 an even start and length and a byte per two
    /// elements), then the items together (no output may share a byte with another output or
    /// any item's source or tiles: [`crate::DeviceError::Overlap`]); nothing is written on an
    /// error.
    pub fn quantize_2d_range_bf16_many(&mut self, items: &[(Piece2d, View)]) -> Result<()> {
        const WHAT: &str = "quantize_2d_range_bf16_many";
        for (p, out) in items {
            check_float(WHAT, p.src)?;
            check_dtype(WHAT, p.tiles, DType::F32)?;
            check_dtype(WHAT, *out, DType::U8)?;
            self.check_views(WHAT, &[p.src, p.tiles], &[*out])?;
            let n = p.src.len();
            if n != 0 {
                let cover = (p.start, n, p.cols);
                check_tiles_cover(WHAT, cover, p.tiles, p.format.tile_count())?;
            }
            let ok = match p.format {
                Format2d::Mxfp8(_) => out.len() == n,
                Format2d::Nvfp4 => {
                    p.start.is_multiple_of(2) && n.is_multiple_of(2) && out.len() * 2 == n
                }
            };
            if !ok {
                return Err(invalid(
                    WHAT,
                    format!(
                        "{} output bytes for {n} elements from {} ({:?})",
                        out.len(),
                        p.start,
                        p.format
                    ),
                ));
            }
        }
        let ins: Vec<View> = items.iter().flat_map(|(p, _)| [p.src, p.tiles]).collect();
        let outs: Vec<View> = items.iter().map(|(_, o)| *o).collect();
        check_overlap_sorted(WHAT, &ins, &outs)?;
        for (p, _) in items {
            self.count_call(match p.format {
                Format2d::Mxfp8(_) => crate::CountedOp::Mxfp8Quantize2dRange,
                Format2d::Nvfp4 => crate::CountedOp::Nvfp4Quantize2dRange,
            });
        }
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.stage2d_quantize_many(items)?
        {
            return Ok(());
        }
        for (p, out) in items {
            let mut values = self.read_f32(p.src)?;
            round_bf16(p.src.dtype(), &mut values);
            self.note_fallback(WHAT);
            let t: Vec<f32> = self.download(p.tiles)?;
            let mut bytes = vec![0u8; out.len()];
            let (start, cols) = (p.start, p.cols);
            match p.format {
                Format2d::Mxfp8(kind) => {
                    mxfp8::sharded::quantize_2d_range(&values, start, cols, kind, &t, &mut bytes)
                }
                Format2d::Nvfp4 => {
                    nvfp4::sharded::quantize_2d_range(&values, start, cols, &t, &mut bytes)
                }
            }?;
            self.write_bytes(*out, &bytes)?;
        }
        Ok(())
    }

    /// [`Device::mxfp8_scales_2d`] of every `(rows, cols, kind, tiles, row_scales, col_scales)`
    /// of `items`: on a GPU, every item its kernel takes in one launch. The same bytes as one
    /// call per item when no item's scales share a byte with another item's views (else
    /// [`crate::DeviceError::Overlap`], nothing written); an item the kernel does not take runs
    /// through the single op.
    ///
    /// On a GPU, calls that repeat (the step's bucket groups, every step) are prepared: the
    /// second call with exactly the items of an earlier one that the kernel took whole makes
    /// a CUDA graph of each of its launches (the table in the node's parameters), and later
    /// calls with those items launch the graphs after checking only that the buffers they
    /// point into are still allocated: the other checks are functions of the items, which
    /// passed them then. The same bytes as a fresh call.
    pub fn mxfp8_scales_2d_many(
        &mut self,
        items: &[(usize, usize, Fp8Kind, View, View, View)],
    ) -> Result<()> {
        const WHAT: &str = "mxfp8_scales_2d";
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut()
            && g.mxfp8_scales_2d_prepared(items)?
        {
            for _ in items {
                self.count_call(crate::CountedOp::Mxfp8Scales2d);
            }
            return Ok(());
        }
        // Every item's shape before anything is written: a bad item fails the call whole.
        for &(rows, cols, _, tiles, rs, cs) in items {
            check_scales_2d(rows, cols, tiles, rs, cs)?;
        }
        let ins: Vec<View> = items.iter().map(|i| i.3).collect();
        let outs: Vec<View> = items.iter().flat_map(|i| [i.4, i.5]).collect();
        check_overlap_sorted(WHAT, &ins, &outs)?;
        #[cfg(feature = "cuda")]
        let rest: Vec<usize> = match self.cuda_mut() {
            Some(g) => g.mxfp8_scales_2d_many(items)?,
            None => (0..items.len()).collect(),
        };
        #[cfg(not(feature = "cuda"))]
        let rest: Vec<usize> = (0..items.len()).collect();
        let taken = items.len() - rest.len();
        for _ in 0..taken {
            self.count_call(crate::CountedOp::Mxfp8Scales2d);
        }
        for i in rest {
            let (rows, cols, kind, tiles, rs, cs) = items[i];
            self.mxfp8_scales_2d(rows, cols, kind, tiles, rs, cs)?;
        }
        Ok(())
    }
}

/// One matrix of [`Device::mxfp8_scales_2d_many`]: `(rows, cols, kind, tiles, row_scales,
/// col_scales)` (the key of its prepared calls on a GPU).
#[cfg(feature = "cuda")]
pub(crate) type Scales2dItem = (usize, usize, Fp8Kind, View, View, View);
