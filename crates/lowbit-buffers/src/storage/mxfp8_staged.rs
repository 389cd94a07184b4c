//! MXFP8 primary weights staged through bf16: both MXFP8 copies live outside the buffer; the
//! buffer's parameter region is a bf16 view that aliases the first half of the gradient bytes.
//! The optimizer casts `bf16(master)` into the rank's shard of that view, the gather spreads it,
//! every rank re-quantizes each parameter (1x32 blocks, both copies) and zeroes the group's
//! staging view, which is gradient memory again for the next backward.

use std::ops::Range;

use lowbit_device::{DType, Device, View};
use lowbit_layout::{BufferPlan, ParamSpec, matrix_dims};

use super::mxfp8_weight_config;
use super::{
    AfterGather, Gathered, LowPrecisionWeights, Mxfp8Weights, Storage, StorageBytes, StorageKind,
};
use crate::config::Verify;
use crate::error::Result;

#[derive(Debug)]
pub(super) struct Mxfp8Staged {
    /// The bf16 staging view (aliases the gradients).
    staging: View,
    /// Per layout index.
    weights: Vec<Mxfp8Weights>,
}

impl Mxfp8Staged {
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        specs: &[&ParamSpec],
        grads: View,
    ) -> Result<Mxfp8Staged> {
        // The same memory as the gradients, reused between the optimizer step and the next
        // backward.
        let staging = grads
            .reinterpret(DType::Bf16)?
            .slice(0..plan.layout.numel)?;
        let weights = specs
            .iter()
            .map(|s| {
                let (rows, cols) = matrix_dims(&s.shape);
                let (rb, cb) = (cols.div_ceil(32), rows.div_ceil(32));
                Mxfp8Weights {
                    rows,
                    cols,
                    rowwise: (
                        dev.alloc(DType::U8, rows * cols),
                        dev.alloc(DType::U8, rows * rb),
                    ),
                    columnwise: (
                        dev.alloc(DType::U8, rows * cols),
                        dev.alloc(DType::U8, cb * cols),
                    ),
                }
            })
            .collect();
        Ok(Mxfp8Staged { staging, weights })
    }

    pub(super) fn closed_form(
        numel: usize,
        dims: impl Iterator<Item = (usize, usize)>,
    ) -> StorageBytes {
        StorageBytes {
            weights: dims
                .map(|(r, c)| 2 * r * c + r * c.div_ceil(32) + r.div_ceil(32) * c)
                .sum(),
            staging: numel * 2,
        }
    }
}

impl Storage for Mxfp8Staged {
    fn kind(&self) -> StorageKind {
        StorageKind::Mxfp8Staged
    }
    fn region(&self) -> View {
        self.staging
    }
    fn aliases_grads(&self) -> bool {
        true
    }
    fn staging_view(&self, range: Range<usize>) -> Result<Option<View>> {
        Ok(Some(self.staging.slice(range)?))
    }
    fn after_gather(&mut self, dev: &mut Device, group: Gathered<'_>) -> Result<AfterGather> {
        let Gathered {
            plan,
            indices,
            buckets,
            verify,
        } = group;
        // Every gathered matrix in one call (one kernel launch on CUDA for the whole group):
        // the bytes and op counts of one `quantize_mxfp8` per matrix.
        let mut items = Vec::with_capacity(indices.len());
        for &i in indices {
            let w = &self.weights[i];
            let src = self.staging.slice(plan.param_range(i))?;
            items.push((src, w.rows, w.cols, w.views()));
        }
        dev.quantize_mxfp8_many(&items, &mxfp8_weight_config())?;
        // Zero this group's staging view and nothing else: other groups' staged values alias
        // other gradient bytes and are still waiting for their gather.
        for &b in buckets {
            let view = self.staging.slice(plan.layout.buckets[b].range())?;
            dev.zero(view)?;
            if verify == Verify::Full && dev.read_bytes(view)?.iter().any(|&x| x != 0) {
                return Ok(AfterGather::StagingNotZero);
            }
        }
        Ok(AfterGather::Ok)
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        let w = self.weights[index];
        super::with_bf16(dev, values, |dev, src| {
            Ok(dev.quantize_mxfp8(src, w.rows, w.cols, &mxfp8_weight_config(), &w.views())?)
        })
    }
    fn weights(&self, index: usize) -> Option<LowPrecisionWeights> {
        self.weights
            .get(index)
            .copied()
            .map(LowPrecisionWeights::Mxfp8)
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self
                .weights
                .iter()
                .map(|w| {
                    w.rowwise.0.byte_len()
                        + w.rowwise.1.byte_len()
                        + w.columnwise.0.byte_len()
                        + w.columnwise.1.byte_len()
                })
                .sum(),
            staging: self.staging.byte_len(),
        }
    }
}
