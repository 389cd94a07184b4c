//! 2D NVFP4 primary weights gathered as packed bytes: the region holds the rowwise E2M1 data,
//! two elements per byte at element offset / 2. Each rank quantizes its shard after a
//! MAX-reduction of the 16x16 tile amaxes; after the gather every rank derives the scales, the
//! global amax and the columnwise copy from the same reduced amaxes.

use std::ops::Range;

use lowbit_device::{DType, Device, View};
use lowbit_layout::{BufferPlan, ParamSpec, matrix_dims};

use super::{
    AfterGather, LowPrecisionWeights, Nvfp4Weights, Storage, StorageBytes, StorageKind, TileScaled,
};
use crate::config::Verify;
use crate::error::Result;

#[derive(Debug)]
pub(super) struct Nvfp4Packed {
    region: View,
    /// Per layout index: the weights and the global amax after the last gather.
    weights: Vec<(Nvfp4Weights, f32)>,
}

impl Nvfp4Packed {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
    ) -> Result<Nvfp4Packed> {
        let packed = plan
            .packed
            .as_ref()
            .expect("the plan has a packed map for every NVFP4 buffer");
        let region = dev.alloc(DType::U8, packed.numel_bytes);
        let mut weights = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            let (rows, cols) = matrix_dims(&s.shape);
            let w = Nvfp4Weights {
                rows,
                cols,
                rowwise: (
                    region.slice(plan.param_storage_range(i))?,
                    dev.alloc(DType::U8, rows * cols / 16),
                ),
                columnwise: (
                    dev.alloc(DType::U8, rows * cols / 2),
                    dev.alloc(DType::U8, cols * rows / 16),
                ),
                tiles: dev.alloc(DType::F32, (rows / 16) * (cols / 16)),
            };
            weights.push((w, 0.0));
        }
        Ok(Nvfp4Packed { region, weights })
    }

    pub(super) fn closed_form(
        numel: usize,
        dims: impl Iterator<Item = (usize, usize)>,
    ) -> StorageBytes {
        // The packed buffer (rowwise data, padding included), rowwise scales, the columnwise
        // copy and the f32 tile amaxes.
        let outside: usize = dims
            .map(|(r, c)| r * c / 16 + r * c / 2 + r * c / 16 + 4 * (r / 16) * (c / 16))
            .sum();
        StorageBytes {
            weights: numel / 2 + outside,
            staging: 0,
        }
    }
}

impl Storage for Nvfp4Packed {
    fn kind(&self) -> StorageKind {
        StorageKind::Nvfp4Packed
    }
    fn region(&self) -> View {
        self.region
    }
    fn tile_scaled(&self) -> Option<&dyn TileScaled> {
        Some(self)
    }
    fn after_gather(
        &mut self,
        dev: &mut Device,
        _plan: &BufferPlan,
        indices: &[usize],
        _buckets: &[usize],
        _verify: Verify,
    ) -> Result<AfterGather> {
        // The gathered bytes are the rowwise data; every rank derives the scales and the
        // columnwise copy from the same reduced tile amaxes.
        for &i in indices {
            let (w, _) = self.weights[i];
            let amax = dev.nvfp4_finish_2d(w.rows, w.cols, w.tiles, &w.views())?;
            self.weights[i].1 = amax;
        }
        Ok(AfterGather::Ok)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, src: View) -> Result<()> {
        let (w, _) = self.weights[index];
        dev.zero(w.tiles)?;
        dev.nvfp4_fold_tile_amax_2d(src, 0, w.cols, w.tiles)?;
        dev.nvfp4_quantize_2d_range(src, 0, w.cols, w.tiles, w.rowwise.0)?;
        let amax = dev.nvfp4_finish_2d(w.rows, w.cols, w.tiles, &w.views())?;
        self.weights[index].1 = amax;
        Ok(())
    }
    fn weights(&self, index: usize) -> Option<LowPrecisionWeights> {
        self.weights
            .get(index)
            .map(|&(weights, amax)| LowPrecisionWeights::Nvfp4 { weights, amax })
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len()
                + self
                    .weights
                    .iter()
                    .map(|(w, _)| {
                        w.rowwise.1.byte_len()
                            + w.columnwise.0.byte_len()
                            + w.columnwise.1.byte_len()
                            + w.tiles.byte_len()
                    })
                    .sum::<usize>(),
            staging: 0,
        }
    }
}

impl TileScaled for Nvfp4Packed {
    fn tiles(&self, index: usize) -> View {
        self.weights[index].0.tiles
    }
    fn fold(&self, dev: &mut Device, index: usize, values: View, offset: usize) -> Result<()> {
        let w = self.weights[index].0;
        dev.nvfp4_fold_tile_amax_2d(values, offset, w.cols, w.tiles)?;
        Ok(())
    }
    fn quantize(
        &self,
        dev: &mut Device,
        index: usize,
        values: View,
        param_range: Range<usize>,
    ) -> Result<()> {
        let w = self.weights[index].0;
        let start = param_range.start;
        let bytes = w
            .rowwise
            .0
            .slice(param_range.start / 2..param_range.end / 2)?;
        dev.nvfp4_quantize_2d_range(values, start, w.cols, w.tiles, bytes)?;
        Ok(())
    }
}
