//! NVFP4 primary weights sharded by rows (`optim_grads_params`): every matrix is a bucket of its
//! own (the row-aligned layout, 16-row blocks), a rank keeps the packed rowwise bytes of its
//! chunk and the matrix's 16x16 tile amaxes. Staging folds each rank's rows into the tiles,
//! MAX-reduces them (so every rank knows every tile and the global amax) and quantizes the rank's
//! rows: every 16x16 tile lies in one chunk, so the chunks in rank order are the whole matrix's
//! rowwise bytes. A unit gathers those bytes only and derives the scales and the transposed
//! columnwise copy from them and the tiles (as Transformer Engine does after its NVFP4 gather);
//! fine-grained gathers change nothing here. A grouped `[experts, out, in]` tensor keeps one
//! global amax per expert, as the whole-buffer NVFP4 storage does.

use std::ops::Range;

use lowbit_device::{DType, Device, Format2d, Piece2d, View};
use lowbit_layout::{BufferPlan, ParamSpec, chunk_rows, expert_slices, matrix_dims};

use super::{Storage, StorageBytes, StorageKind, TileScaled, experts_of, with_bf16};
use crate::error::{ConfigError, Result};
use crate::storage::Nvfp4Weights;

#[derive(Debug)]
struct Chunk {
    rows: usize,
    cols: usize,
    experts: usize,
    chunk: usize,
    first: usize,
    /// This rank's packed rowwise bytes (`chunk · cols / 2`, padded).
    data: View,
    /// The matrix's 16x16 tile amaxes (f32), MAX-reduced when staging.
    tiles: View,
}

impl Chunk {
    fn valid(&self) -> usize {
        self.rows.saturating_sub(self.first).min(self.chunk)
    }

    /// The element range of the matrix this rank holds.
    fn own(&self) -> Range<usize> {
        self.first * self.cols..(self.first + self.valid()) * self.cols
    }
}

/// Bytes of a unit of one matrix: the gathered rowwise data of every chunk, then the derived
/// rowwise scales, columnwise data and columnwise scales.
pub(crate) fn unit_bytes(rows: usize, cols: usize, dp: usize) -> [usize; 4] {
    [
        dp * chunk_rows(rows, dp, 16) * cols / 2,
        rows * cols / 16,
        rows * cols / 2,
        cols * rows / 16,
    ]
}

/// This rank's persistent bytes of one matrix: its packed chunk and the tile amaxes.
fn own_bytes(rows: usize, cols: usize, dp: usize) -> usize {
    chunk_rows(rows, dp, 16) * cols / 2 + 4 * (rows / 16) * (cols / 16)
}

#[derive(Debug)]
pub(crate) struct Nvfp4Rows {
    region: View,
    chunks: Vec<Chunk>,
}

impl Nvfp4Rows {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
        rank: usize,
    ) -> Result<Nvfp4Rows> {
        let dp = plan.layout.num_shards;
        let total: usize = specs
            .iter()
            .map(|s| {
                let (r, c) = matrix_dims(&s.shape);
                own_bytes(r, c, dp)
            })
            .sum();
        let region = dev.try_alloc(DType::U8, total)?;
        let (mut at, mut chunks) = (0, Vec::with_capacity(specs.len()));
        for s in specs {
            let (rows, cols) = matrix_dims(&s.shape);
            let chunk = chunk_rows(rows, dp, 16);
            let data = region.slice(at..at + chunk * cols / 2)?;
            at += chunk * cols / 2;
            let tiles = region
                .slice(at..at + 4 * (rows / 16) * (cols / 16))?
                .reinterpret(DType::F32)?;
            at += 4 * (rows / 16) * (cols / 16);
            chunks.push(Chunk {
                rows,
                cols,
                experts: experts_of(&s.shape),
                chunk,
                first: rank * chunk,
                data,
                tiles,
            });
        }
        Ok(Nvfp4Rows { region, chunks })
    }

    pub(super) fn closed_form(plan: &BufferPlan, specs: &[&ParamSpec]) -> StorageBytes {
        super::per_matrix_bytes(plan, specs, own_bytes)
    }

    /// The whole matrix's weights over a gathered unit (`unit`: [`unit_bytes`] laid out in
    /// order) with nothing derived yet (every amax 0): [`super::finish_nvfp4`] derives the
    /// scales, the columnwise copy and each expert's global amax, for a whole group at once.
    pub(crate) fn unfinished(
        parts: &crate::storage::UnitParts,
        unit: View,
        dp: usize,
    ) -> Result<Nvfp4Weights> {
        let crate::storage::UnitParts::Nvfp4 {
            tiles,
            rows,
            cols,
            experts,
            ..
        } = *parts
        else {
            return Err(ConfigError::Policy("not an NVFP4 unit".into()).into());
        };
        let n = unit_bytes(rows, cols, dp);
        let mut at = n[0];
        let mut take = |k: usize| -> Result<View> {
            let v = unit.slice(at..at + n[k])?;
            at += n[k];
            Ok(v)
        };
        let (rs, cd, cs) = (take(1)?, take(2)?, take(3)?);
        Ok(Nvfp4Weights {
            rows,
            cols,
            rowwise: (unit.slice(0..rows * cols / 2)?, rs),
            columnwise: (cd, cs),
            tiles,
            amaxes: vec![0.0; experts],
        })
    }
}

impl Storage for Nvfp4Rows {
    fn kind(&self) -> StorageKind {
        StorageKind::Nvfp4Rows
    }
    fn region(&self) -> View {
        self.region
    }
    fn tile_scaled(&self) -> Option<&dyn TileScaled> {
        Some(self)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        with_bf16(dev, values, |dev, src| {
            let c = &self.chunks[index];
            dev.zero(c.tiles)?;
            dev.fold_tile_amax_2d_bf16_many(&[self.fold_piece(index, src, 0)])?;
            let own = c.own();
            if own.is_empty() {
                return Ok(());
            }
            let v = src.slice(own.clone())?;
            dev.quantize_2d_range_bf16_many(&self.quantize_pieces(index, v, own)?)?;
            Ok(())
        })
    }
    fn unit_parts(&self, index: usize) -> Option<crate::storage::UnitParts> {
        let c = &self.chunks[index];
        Some(crate::storage::UnitParts::Nvfp4 {
            data: c.data,
            tiles: c.tiles,
            rows: c.rows,
            cols: c.cols,
            experts: c.experts,
        })
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len(),
            staging: 0,
        }
    }
}

impl TileScaled for Nvfp4Rows {
    fn tiles(&self, index: usize) -> View {
        self.chunks[index].tiles
    }
    fn fold_piece(&self, index: usize, values: View, offset: usize) -> Piece2d {
        let c = &self.chunks[index];
        Piece2d {
            format: Format2d::Nvfp4,
            src: values,
            start: offset,
            cols: c.cols,
            tiles: c.tiles,
        }
    }
    fn quantize_pieces(
        &self,
        i: usize,
        v: View,
        range: Range<usize>,
    ) -> Result<Vec<(Piece2d, View)>> {
        let c = &self.chunks[i];
        let own = c.own();
        if range.start < own.start || range.end > own.end {
            return Err(ConfigError::Policy(format!(
                "elements {range:?} are not this rank's rows {own:?}"
            ))
            .into());
        }
        // Each expert's part with its expert's tiles (and so its global amax).
        let whole = expert_slices(0..c.rows * c.cols, c.experts)?;
        let tiles = expert_slices(0..c.tiles.len(), c.experts)?;
        let mut items = Vec::new();
        for (e, t) in whole.into_iter().zip(tiles) {
            let part = range.start.max(e.start)..range.end.min(e.end);
            if part.is_empty() {
                continue;
            }
            let x = v.slice(part.start - range.start..part.end - range.start)?;
            let bytes = c
                .data
                .slice((part.start - own.start) / 2..(part.end - own.start) / 2)?;
            let piece = Piece2d {
                format: Format2d::Nvfp4,
                src: x,
                start: part.start - e.start,
                cols: c.cols,
                tiles: c.tiles.slice(t)?,
            };
            items.push((piece, bytes));
        }
        Ok(items)
    }
}
