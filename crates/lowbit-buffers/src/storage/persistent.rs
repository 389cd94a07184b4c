//! Persistent bf16/f16/f32 parameter storage: the values live in the buffer and are gathered as
//! they are; the optimizer writes them fused into its update.

use std::ops::Range;

use lowbit_device::{DType, Device, View};
use lowbit_layout::BufferPlan;

use super::{Storage, StorageBytes, StorageKind};
use crate::error::Result;

#[derive(Debug)]
pub(super) struct Persistent {
    region: View,
    /// Each parameter's element range in the region, by layout index.
    ranges: Vec<std::ops::Range<usize>>,
}

impl Persistent {
    pub(super) fn allocate(dev: &mut Device, plan: &BufferPlan, dtype: DType) -> Persistent {
        Persistent {
            region: dev.alloc(dtype, plan.layout.numel),
            ranges: (0..plan.layout.params.len())
                .map(|i| plan.param_range(i))
                .collect(),
        }
    }
}

impl Storage for Persistent {
    fn kind(&self) -> StorageKind {
        StorageKind::Persistent
    }
    fn region(&self) -> View {
        self.region
    }
    fn is_low_precision(&self) -> bool {
        false
    }
    fn fused_output(&self, range: Range<usize>) -> Result<Option<View>> {
        Ok(Some(self.region.slice(range)?))
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        let range = self.ranges[index].clone();
        Ok(dev.cast(values, self.region.slice(range)?)?)
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len(),
            staging: 0,
        }
    }
}
