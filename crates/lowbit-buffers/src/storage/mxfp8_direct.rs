//! 2D MXFP8 primary weights gathered as fp8 bytes: the region holds one E4M3 byte per element,
//! which is both copies' data (a 32x32 block has one scale, so the transpose reads the same
//! bytes). Each rank quantizes its shard after a MAX-reduction of the 32x32 tile amaxes, so every
//! rank derives the same scales; the gather moves half the bytes of bf16 staging.

use std::ops::Range;

use lowbit_device::{DType, Device, Fp8Kind, View};
use lowbit_layout::{BufferPlan, ParamSpec, matrix_dims};

use super::{
    AfterGather, LowPrecisionWeights, Mxfp8Weights, Storage, StorageBytes, StorageKind, TileScaled,
};
use crate::config::Verify;
use crate::error::Result;

#[derive(Debug)]
pub(super) struct Mxfp8Direct {
    region: View,
    /// Per layout index: the weights (both copies' data is the region slice) and tile amaxes.
    weights: Vec<(Mxfp8Weights, View)>,
}

impl Mxfp8Direct {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
    ) -> Result<Mxfp8Direct> {
        let region = dev.alloc(DType::U8, plan.layout.numel);
        let mut weights = Vec::with_capacity(specs.len());
        for (i, s) in specs.iter().enumerate() {
            let (rows, cols) = matrix_dims(&s.shape);
            let data = region.slice(plan.param_range(i))?;
            let w = Mxfp8Weights {
                rows,
                cols,
                rowwise: (data, dev.alloc(DType::U8, rows * cols.div_ceil(32))),
                columnwise: (data, dev.alloc(DType::U8, rows.div_ceil(32) * cols)),
            };
            let tiles = dev.alloc(DType::F32, lowbit_device::mxfp8_tile_count(rows, cols));
            weights.push((w, tiles));
        }
        Ok(Mxfp8Direct { region, weights })
    }

    pub(super) fn closed_form(
        numel: usize,
        dims: impl Iterator<Item = (usize, usize)>,
    ) -> StorageBytes {
        // The fp8 bytes (padding included; both copies), both scale tensors, tile amaxes.
        let outside: usize = dims
            .map(|(r, c)| {
                r * c.div_ceil(32) + r.div_ceil(32) * c + 4 * r.div_ceil(32) * c.div_ceil(32)
            })
            .sum();
        StorageBytes {
            weights: numel + outside,
            staging: 0,
        }
    }
}

impl Storage for Mxfp8Direct {
    fn kind(&self) -> StorageKind {
        StorageKind::Mxfp8Direct
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
        for &i in indices {
            let (w, t) = self.weights[i];
            dev.mxfp8_scales_2d(
                w.rows,
                w.cols,
                Fp8Kind::E4M3,
                t,
                w.rowwise.1,
                w.columnwise.1,
            )?;
        }
        Ok(AfterGather::Ok)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, src: View) -> Result<()> {
        let (w, t) = self.weights[index];
        dev.zero(t)?;
        dev.mxfp8_fold_tile_amax_2d(src, 0, w.cols, t)?;
        dev.mxfp8_quantize_2d_range(src, 0, w.cols, Fp8Kind::E4M3, t, w.rowwise.0)?;
        dev.mxfp8_scales_2d(
            w.rows,
            w.cols,
            Fp8Kind::E4M3,
            t,
            w.rowwise.1,
            w.columnwise.1,
        )?;
        Ok(())
    }
    fn weights(&self, index: usize) -> Option<LowPrecisionWeights> {
        self.weights
            .get(index)
            .map(|&(w, _)| LowPrecisionWeights::Mxfp8(w))
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len()
                + self
                    .weights
                    .iter()
                    .map(|(w, t)| w.rowwise.1.byte_len() + w.columnwise.1.byte_len() + t.byte_len())
                    .sum::<usize>(),
            staging: 0,
        }
    }
}

impl TileScaled for Mxfp8Direct {
    fn tiles(&self, index: usize) -> View {
        self.weights[index].1
    }
    fn fold(&self, dev: &mut Device, index: usize, values: View, offset: usize) -> Result<()> {
        let (w, t) = self.weights[index];
        dev.mxfp8_fold_tile_amax_2d(values, offset, w.cols, t)?;
        Ok(())
    }
    fn quantize(
        &self,
        dev: &mut Device,
        index: usize,
        values: View,
        param_range: Range<usize>,
    ) -> Result<()> {
        let (w, t) = self.weights[index];
        let start = param_range.start;
        let bytes = w.rowwise.0.slice(param_range)?;
        dev.mxfp8_quantize_2d_range(values, start, w.cols, Fp8Kind::E4M3, t, bytes)?;
        Ok(())
    }
}
