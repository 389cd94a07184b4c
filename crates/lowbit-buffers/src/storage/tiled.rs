//! Tile-scaled primary weights gathered as bytes: 2D MXFP8 (fp8 bytes, one per element, which
//! are both copies' data: a 32x32 block has one scale, so the transpose reads the same bytes)
//! and 2D NVFP4 (packed E2M1 rowwise data at element offset / 2). Each rank folds its shard into
//! partial tile amaxes, the amaxes are MAX-reduced across ranks, each rank quantizes its shard,
//! and after the gather every rank derives the scales (and NVFP4's global amax and columnwise
//! copy) from the same reduced amaxes. One generic storage, one [`TileFormat`] per format.
//!
//! NVFP4 quantizes a grouped expert tensor expert by expert (one global amax each): the tiles
//! are folded and reduced for the whole tensor (an expert's tiles are a contiguous run), then
//! each expert's part of a piece is quantized, and each expert finished, with views of its own
//! tiles and copies, so the device ops are the 2D ones.

use std::fmt::Debug;
use std::ops::Range;

use lowbit_device::{DType, Device, Format2d, Fp8Kind, PendingAmaxes, Piece2d, View};
use lowbit_layout::{BufferPlan, LayoutError, ParamSpec, expert_slices, matrix_dims};

use super::{
    AfterGather, Gathered, LowPrecisionWeights, Mxfp8Weights, Nvfp4Weights, Storage, StorageBytes,
    StorageKind, TileScaled, experts_of,
};
use crate::error::Result;

/// What differs between the tile-scaled formats.
pub(super) trait TileFormat: Debug + Send + 'static {
    /// The weights of one parameter (copies, scales, tile amaxes, global state).
    type Weights: Clone + Debug + Send;
    /// The storage kind.
    const KIND: StorageKind;
    /// Bytes of the parameter region for a buffer of `numel` elements.
    fn region_bytes(numel: usize) -> usize;
    /// Bytes outside the region of a `rows x cols` parameter.
    fn outside_bytes(rows: usize, cols: usize) -> usize;
    /// Refuses a parameter the format cannot hold.
    fn check(spec: &ParamSpec) -> Result<()> {
        let _ = spec;
        Ok(())
    }
    /// Tile amaxes of a `rows x cols` parameter.
    fn tile_count(rows: usize, cols: usize) -> usize;
    /// Allocates the weights of parameter `spec` around `data`, its slice of the region, and
    /// `tiles`, its [`TileFormat::tile_count`] f32 tile amaxes.
    fn allocate(dev: &mut Device, data: View, tiles: View, spec: &ParamSpec) -> Self::Weights;
    /// The tile amaxes.
    fn tiles(w: &Self::Weights) -> View;
    /// The allocated views outside the region.
    fn outside(w: &Self::Weights) -> Vec<View>;
    /// The fold of `bf16(values)`, starting at element `offset` of the parameter, into the
    /// tile amaxes.
    fn fold_piece(w: &Self::Weights, values: View, offset: usize) -> Piece2d;
    /// The quantizations of `bf16(values)`, `range` of the parameter, with the reduced amaxes
    /// into the region.
    fn quantize_pieces(
        w: &Self::Weights,
        values: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>>;
    /// Derives everything else from the gathered bytes and the reduced amaxes.
    fn finish(dev: &mut Device, w: &mut Self::Weights) -> Result<()>;
    /// Host values that [`TileFormat::finish_many`] left on the device (NVFP4's amaxes), for
    /// [`TileFormat::settle`].
    type Pending: Debug + Send;
    /// [`TileFormat::finish`] of `weights[i]` for every `i` of `indices` (distinct); what it
    /// leaves pending must be settled before the weights are read.
    fn finish_many(
        dev: &mut Device,
        weights: &mut [Self::Weights],
        indices: &[usize],
    ) -> Result<Option<Self::Pending>> {
        for &i in indices {
            if let Some(w) = weights.get_mut(i) {
                Self::finish(dev, w)?;
            }
        }
        Ok(None)
    }
    /// Stores what the [`TileFormat::finish_many`] calls since the last settle left pending,
    /// in completion order (all at once, so that a device reads them with one wait).
    fn settle(
        dev: &mut Device,
        weights: &mut [Self::Weights],
        pending: Vec<Self::Pending>,
    ) -> Result<()> {
        let _ = (dev, weights, pending);
        Ok(())
    }
    /// The weights as compute reads them.
    fn compute(w: &Self::Weights) -> LowPrecisionWeights;
}

/// 2D MXFP8 (E4M3, 32x32 tiles).
#[derive(Debug)]
pub(super) struct Mxfp8Tiles;

impl TileFormat for Mxfp8Tiles {
    type Weights = (Mxfp8Weights, View);
    const KIND: StorageKind = StorageKind::Mxfp8Direct;
    fn region_bytes(numel: usize) -> usize {
        numel
    }
    fn outside_bytes(r: usize, c: usize) -> usize {
        r * c.div_ceil(32) + r.div_ceil(32) * c + 4 * r.div_ceil(32) * c.div_ceil(32)
    }
    fn tile_count(rows: usize, cols: usize) -> usize {
        lowbit_device::mxfp8_tile_count(rows, cols)
    }
    fn allocate(dev: &mut Device, data: View, tiles: View, spec: &ParamSpec) -> Self::Weights {
        // Blocks have no global scale: a grouped tensor is its experts by construction.
        let (rows, cols) = matrix_dims(&spec.shape);
        let w = Mxfp8Weights {
            rows,
            cols,
            rowwise: (data, dev.alloc(DType::U8, rows * cols.div_ceil(32))),
            columnwise: (data, dev.alloc(DType::U8, rows.div_ceil(32) * cols)),
        };
        (w, tiles)
    }
    fn tiles(w: &Self::Weights) -> View {
        w.1
    }
    fn outside(w: &Self::Weights) -> Vec<View> {
        vec![w.0.rowwise.1, w.0.columnwise.1, w.1]
    }
    fn fold_piece(w: &Self::Weights, values: View, offset: usize) -> Piece2d {
        Piece2d {
            format: Format2d::Mxfp8(Fp8Kind::E4M3),
            src: values,
            start: offset,
            cols: w.0.cols,
            tiles: w.1,
        }
    }
    fn quantize_pieces(
        (w, t): &Self::Weights,
        values: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>> {
        let start = range.start;
        let bytes = w.rowwise.0.slice(range)?;
        let piece = Piece2d {
            format: Format2d::Mxfp8(Fp8Kind::E4M3),
            src: values,
            start,
            cols: w.cols,
            tiles: *t,
        };
        Ok(vec![(piece, bytes)])
    }
    fn finish(dev: &mut Device, (w, t): &mut Self::Weights) -> Result<()> {
        let (rows, cols, kind) = (w.rows, w.cols, Fp8Kind::E4M3);
        Ok(dev.mxfp8_scales_2d(rows, cols, kind, *t, w.rowwise.1, w.columnwise.1)?)
    }
    type Pending = ();
    fn finish_many(
        dev: &mut Device,
        weights: &mut [Self::Weights],
        indices: &[usize],
    ) -> Result<Option<()>> {
        // Every matrix of the group in one launch (`mxfp8_scales_2d` is tiny per matrix).
        let items: Vec<_> = indices
            .iter()
            .filter_map(|&i| weights.get(i))
            .map(|(w, t)| {
                let (rows, cols, kind) = (w.rows, w.cols, Fp8Kind::E4M3);
                (rows, cols, kind, *t, w.rowwise.1, w.columnwise.1)
            })
            .collect();
        dev.mxfp8_scales_2d_many(&items)?;
        Ok(None)
    }
    fn compute(w: &Self::Weights) -> LowPrecisionWeights {
        LowPrecisionWeights::Mxfp8(w.0)
    }
}

/// 2D NVFP4 (16x16 tiles, two-level scale).
#[derive(Debug)]
pub(super) struct Nvfp4Tiles;

impl TileFormat for Nvfp4Tiles {
    type Weights = Nvfp4Weights;
    const KIND: StorageKind = StorageKind::Nvfp4Packed;
    fn region_bytes(numel: usize) -> usize {
        numel / 2
    }
    fn outside_bytes(r: usize, c: usize) -> usize {
        // Rowwise scales, the columnwise copy (data, scales) and the f32 tile amaxes.
        r * c / 16 + r * c / 2 + r * c / 16 + 4 * (r / 16) * (c / 16)
    }
    fn check(spec: &ParamSpec) -> Result<()> {
        // The plan checked the whole matrix; a tile must not straddle experts either.
        let ((rows, cols), experts) = (matrix_dims(&spec.shape), experts_of(&spec.shape));
        let per = rows.checked_div(experts).unwrap_or(0);
        if experts > 0 && per * experts == rows && per.is_multiple_of(16) && cols.is_multiple_of(16)
        {
            return Ok(());
        }
        let name = format!("{} (one of {experts} experts)", spec.name);
        Err(LayoutError::Nvfp4Tiles {
            name,
            rows: per,
            cols,
        }
        .into())
    }
    fn tile_count(rows: usize, cols: usize) -> usize {
        (rows / 16) * (cols / 16)
    }
    fn allocate(dev: &mut Device, data: View, tiles: View, spec: &ParamSpec) -> Self::Weights {
        // Per expert, the same sizes as a matrix of its own: the totals do not depend on it.
        let (rows, cols) = matrix_dims(&spec.shape);
        Nvfp4Weights {
            rows,
            cols,
            rowwise: (data, dev.alloc(DType::U8, rows * cols / 16)),
            columnwise: (
                dev.alloc(DType::U8, rows * cols / 2),
                dev.alloc(DType::U8, cols * rows / 16),
            ),
            tiles,
            amaxes: vec![0.0; experts_of(&spec.shape)],
        }
    }
    fn tiles(w: &Self::Weights) -> View {
        w.tiles
    }
    fn outside(w: &Self::Weights) -> Vec<View> {
        vec![w.rowwise.1, w.columnwise.0, w.columnwise.1, w.tiles]
    }
    fn fold_piece(w: &Self::Weights, values: View, offset: usize) -> Piece2d {
        // The whole tensor's tiles: each expert's are a contiguous run of them.
        Piece2d {
            format: Format2d::Nvfp4,
            src: values,
            start: offset,
            cols: w.cols,
            tiles: w.tiles,
        }
    }
    fn quantize_pieces(
        w: &Self::Weights,
        values: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>> {
        // A piece may cover parts of several experts: each part with its expert's tiles (and
        // so its global amax), at offsets within that expert.
        let whole = expert_slices(0..w.rows * w.cols, w.amaxes.len())?;
        let mut items = Vec::new();
        for (x, e) in w.per_expert()?.iter().zip(whole) {
            let part = range.start.max(e.start)..range.end.min(e.end);
            if part.is_empty() {
                continue;
            }
            let v = values.slice(part.start - range.start..part.end - range.start)?;
            let start = part.start - e.start;
            let bytes = x.rowwise.0.slice(start / 2..(start + part.len()) / 2)?;
            let piece = Piece2d {
                format: Format2d::Nvfp4,
                src: v,
                start,
                cols: x.cols,
                tiles: x.tiles,
            };
            items.push((piece, bytes));
        }
        Ok(items)
    }
    fn finish(dev: &mut Device, w: &mut Self::Weights) -> Result<()> {
        super::finish_nvfp4(dev, &mut [w])
    }
    /// The amaxes of a group's completion, still on the device: the layout indices of the
    /// weights, in item order (each of its experts an item), and the pending values.
    type Pending = (Vec<usize>, PendingAmaxes);
    fn finish_many(
        dev: &mut Device,
        weights: &mut [Self::Weights],
        indices: &[usize],
    ) -> Result<Option<Self::Pending>> {
        // Every matrix of the group in one device call, the amaxes left on the device: the
        // completion of several groups in a row reads them once (`settle`), not once per group.
        let order: Vec<usize> = (0..weights.len()).filter(|i| indices.contains(i)).collect();
        let pending = super::start_nvfp4_finish(dev, order.iter().map(|&i| &weights[i]))?;
        Ok(Some((order, pending)))
    }
    fn settle(
        dev: &mut Device,
        weights: &mut [Self::Weights],
        pending: Vec<Self::Pending>,
    ) -> Result<()> {
        let (orders, pending): (Vec<_>, Vec<_>) = pending.into_iter().unzip();
        // Every group's amaxes with one wait for the device (not one per group).
        for (order, amaxes) in orders.into_iter().zip(dev.read_amaxes_many(pending)?) {
            // `order` ascends, so these are the weights `finish_many` started, in its order.
            let ws = weights
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| order.binary_search(i).is_ok())
                .map(|(_, w)| w);
            super::store_nvfp4_amaxes(ws, amaxes);
        }
        Ok(())
    }
    fn compute(w: &Self::Weights) -> LowPrecisionWeights {
        LowPrecisionWeights::Nvfp4 {
            amax: w.amax(),
            weights: w.clone(),
        }
    }
}

/// A tile-scaled storage of format `F`.
#[derive(Debug)]
pub(super) struct Tiled<F: TileFormat> {
    region: View,
    /// Per layout index.
    weights: Vec<F::Weights>,
    /// What group completions left on the device, in completion order, until `settle`.
    pending: Vec<F::Pending>,
}

impl<F: TileFormat> Tiled<F> {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
    ) -> Result<Self> {
        Self::check(specs)?;
        let region = dev.alloc(DType::U8, F::region_bytes(plan.layout.numel));
        // Every parameter's tile amaxes in one allocation, in layout order, so that the staging
        // zeroes and MAX-reduces the tiles of neighbouring parameters as one run (one memset
        // and one all-reduce where it made one per parameter).
        let counts: Vec<usize> = specs
            .iter()
            .map(|s| {
                let (rows, cols) = matrix_dims(&s.shape);
                F::tile_count(rows, cols)
            })
            .collect();
        let all_tiles = dev.alloc(DType::F32, counts.iter().sum());
        let (mut weights, mut at) = (Vec::with_capacity(specs.len()), 0);
        for (i, (s, n)) in specs.iter().zip(counts).enumerate() {
            let data = region.slice(plan.param_storage_range(i))?;
            let tiles = all_tiles.slice(at..at + n)?;
            at += n;
            weights.push(F::allocate(dev, data, tiles, s));
        }
        Ok(Tiled {
            region,
            weights,
            pending: Vec::new(),
        })
    }

    /// Refuses parameters the format cannot hold (before anything is allocated).
    pub(super) fn check(specs: &[&ParamSpec]) -> Result<()> {
        specs.iter().try_for_each(|s| F::check(s))
    }

    pub(super) fn closed_form(
        numel: usize,
        dims: impl Iterator<Item = (usize, usize)>,
    ) -> StorageBytes {
        StorageBytes {
            weights: F::region_bytes(numel)
                + dims.map(|(r, c)| F::outside_bytes(r, c)).sum::<usize>(),
            staging: 0,
        }
    }
}

impl<F: TileFormat> Storage for Tiled<F> {
    fn kind(&self) -> StorageKind {
        F::KIND
    }
    fn region(&self) -> View {
        self.region
    }
    fn tile_scaled(&self) -> Option<&dyn TileScaled> {
        Some(self)
    }
    fn after_gather(&mut self, dev: &mut Device, group: Gathered<'_>) -> Result<AfterGather> {
        if let Some(p) = F::finish_many(dev, &mut self.weights, group.indices)? {
            self.pending.push(p);
        }
        Ok(AfterGather::Ok)
    }
    fn settle(&mut self, dev: &mut Device) -> Result<()> {
        let pending = std::mem::take(&mut self.pending);
        if pending.is_empty() {
            return Ok(());
        }
        F::settle(dev, &mut self.weights, pending)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        let w = &mut self.weights[index];
        super::with_bf16(dev, values, |dev, src| {
            dev.zero(F::tiles(w))?;
            dev.fold_tile_amax_2d_bf16_many(&[F::fold_piece(w, src, 0)])?;
            dev.quantize_2d_range_bf16_many(&F::quantize_pieces(w, src, 0..src.len())?)?;
            F::finish(dev, w)
        })
    }
    fn weights(&self, index: usize) -> Option<LowPrecisionWeights> {
        self.weights.get(index).map(F::compute)
    }
    fn memory(&self) -> StorageBytes {
        let outside: usize = self
            .weights
            .iter()
            .flat_map(F::outside)
            .map(|v| v.byte_len())
            .sum();
        StorageBytes {
            weights: self.region.byte_len() + outside,
            staging: 0,
        }
    }
}

impl<F: TileFormat> TileScaled for Tiled<F> {
    fn tiles(&self, index: usize) -> View {
        F::tiles(&self.weights[index])
    }
    fn fold_piece(&self, index: usize, values: View, offset: usize) -> Piece2d {
        F::fold_piece(&self.weights[index], values, offset)
    }
    fn quantize_pieces(
        &self,
        i: usize,
        v: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>> {
        F::quantize_pieces(&self.weights[i], v, range)
    }
}
