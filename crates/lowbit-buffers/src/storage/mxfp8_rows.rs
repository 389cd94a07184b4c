//! MXFP8 primary weights sharded by rows (`optim_grads_params`): every matrix is a bucket of its
//! own (the row-aligned layout, `lowbit_layout::compute_row_aligned_layout`), and a rank keeps
//! only both MXFP8 copies of its chunk of whole 32-row blocks. Staging quantizes
//! `bf16(master)` of those rows on the rank, with no collective: every 1x32 rowwise block lies
//! in one row and every 32x1 columnwise block in one chunk, so the chunks gathered in rank
//! order are the bytes of the whole matrix quantized at once, then zero padding. A unit's
//! gather moves the copies, one or both ([`crate::UnitGather`]), into a transient buffer.

use std::ops::Range;

use lowbit_device::{DType, Device, Mxfp8Views, View};
use lowbit_layout::{BufferPlan, ParamSpec, chunk_rows, matrix_dims};

use super::{Storage, StorageBytes, StorageKind, mxfp8_weight_config, with_bf16};
use crate::error::{ConfigError, Result};

/// One matrix's chunk on this rank.
#[derive(Debug)]
struct Chunk {
    rows: usize,
    cols: usize,
    /// Rows per chunk (a multiple of 32) and this rank's first row.
    chunk: usize,
    first: usize,
    /// The matrix's start in the buffer (elements).
    start: usize,
    /// Rowwise data, rowwise scales, columnwise data, columnwise scales of the chunk (padded
    /// to whole chunks: the parts every rank contributes to a gather).
    parts: [View; 4],
}

impl Chunk {
    /// Rows of the matrix in this chunk.
    fn valid(&self) -> usize {
        self.rows.saturating_sub(self.first).min(self.chunk)
    }

    /// The views quantization writes for the chunk's valid rows.
    fn views(&self) -> Result<Mxfp8Views> {
        let (v, c) = (self.valid(), self.cols);
        let [rd, rs, cd, cs] = self.parts;
        Ok(Mxfp8Views {
            rowwise: Some((rd.slice(0..v * c)?, rs.slice(0..v * c.div_ceil(32))?)),
            columnwise: Some((cd.slice(0..v * c)?, cs.slice(0..v.div_ceil(32) * c)?)),
        })
    }

    /// `Q(bf16(values))` of the valid rows (`values`: f32 or bf16, `valid · cols` elements).
    fn quantize(&self, dev: &mut Device, values: View) -> Result<()> {
        let v = self.valid();
        if v == 0 {
            return Ok(());
        }
        let views = self.views()?;
        let cfg = mxfp8_weight_config();
        with_bf16(dev, values, |dev, x| {
            Ok(dev.quantize_mxfp8(x, v, self.cols, &cfg, &views)?)
        })
    }
}

/// Bytes of each part of a chunk of `chunk` rows of a matrix with `cols` columns.
pub(crate) fn part_bytes(chunk: usize, cols: usize) -> [usize; 4] {
    [
        chunk * cols,
        chunk * cols.div_ceil(32),
        chunk * cols,
        chunk / 32 * cols,
    ]
}

#[derive(Debug)]
pub(super) struct Mxfp8Rows {
    region: View,
    chunks: Vec<Chunk>,
}

impl Mxfp8Rows {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
        rank: usize,
    ) -> Result<Mxfp8Rows> {
        let dp = plan.layout.num_shards;
        let dims: Vec<(usize, usize, usize)> = specs
            .iter()
            .map(|s| {
                let (rows, cols) = matrix_dims(&s.shape);
                (rows, cols, chunk_rows(rows, dp, 32))
            })
            .collect();
        let total: usize = dims
            .iter()
            .map(|&(_, c, k)| part_bytes(k, c).iter().sum::<usize>())
            .sum();
        let region = dev.try_alloc(DType::U8, total)?;
        let mut at = 0;
        let mut chunks = Vec::with_capacity(specs.len());
        for (i, &(rows, cols, chunk)) in dims.iter().enumerate() {
            let mut parts = [region; 4];
            for (k, n) in part_bytes(chunk, cols).into_iter().enumerate() {
                parts[k] = region.slice(at..at + n)?;
                at += n;
            }
            chunks.push(Chunk {
                rows,
                cols,
                chunk,
                first: rank * chunk,
                start: plan.param_range(i).start,
                parts,
            });
        }
        Ok(Mxfp8Rows { region, chunks })
    }

    pub(super) fn closed_form(plan: &BufferPlan, specs: &[&ParamSpec]) -> StorageBytes {
        super::per_matrix_bytes(plan, specs, |rows, cols, dp| {
            part_bytes(chunk_rows(rows, dp, 32), cols).iter().sum()
        })
    }

    /// The chunk holding buffer range `range` (an owned piece: this rank's rows of one matrix).
    fn chunk_of(&self, range: &Range<usize>) -> Result<&Chunk> {
        self.chunks
            .iter()
            .find(|c| {
                let own = c.start + c.first * c.cols..c.start + (c.first + c.valid()) * c.cols;
                own == *range
            })
            .ok_or_else(|| {
                ConfigError::Policy(format!(
                    "buffer range {range:?} is not one of this rank's row chunks"
                ))
                .into()
            })
    }
}

impl Storage for Mxfp8Rows {
    fn kind(&self) -> StorageKind {
        StorageKind::Mxfp8Rows
    }
    fn region(&self) -> View {
        self.region
    }
    fn stage_cast(&self, dev: &mut Device, range: Range<usize>, master: View) -> Result<bool> {
        self.chunk_of(&range)?.quantize(dev, master)?;
        Ok(true)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        let c = &self.chunks[index];
        let (a, b) = (c.first * c.cols, (c.first + c.valid()) * c.cols);
        if a < b {
            c.quantize(dev, values.slice(a..b)?)?;
        }
        Ok(())
    }
    fn unit_parts(&self, index: usize) -> Option<super::UnitParts> {
        Some(super::UnitParts::Mxfp8(self.chunks[index].parts))
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len(),
            staging: 0,
        }
    }
}
