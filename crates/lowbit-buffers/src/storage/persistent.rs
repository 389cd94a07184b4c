//! Persistent bf16/f16/f32 parameter storage: the values live in the buffer and are gathered as
//! they are; the optimizer writes them fused into its update. Under a strategy that shards
//! parameters (`optim_grads_params`) the region holds only this rank's bucket shards, one after
//! the other; the whole values exist only in the transient unit buffers the gathers fill.

use std::ops::Range;

use lowbit_device::{DType, Device, View};
use lowbit_layout::BufferPlan;

use super::{Storage, StorageBytes, StorageKind};
use crate::error::{ConfigError, Result};

#[derive(Debug)]
pub(super) struct Persistent {
    region: View,
    /// Each parameter's element range in the buffer, by layout index.
    ranges: Vec<Range<usize>>,
    /// Sharded parameters: each bucket shard's buffer range and its start in the region.
    shards: Option<Vec<(Range<usize>, usize)>>,
}

impl Persistent {
    /// `rank`: `Some` when the plan shards parameters (the region is that rank's shards).
    pub(super) fn allocate(
        dev: &mut Device,
        plan: &BufferPlan,
        dtype: DType,
        rank: Option<usize>,
    ) -> Result<Persistent> {
        let shards = match rank {
            None => None,
            Some(r) => Some(
                (0..plan.layout.buckets.len())
                    .map(|b| Ok((plan.shard(b, r)?, plan.local_shard_range(b, r)?.start)))
                    .collect::<Result<Vec<_>>>()?,
            ),
        };
        let numel = if shards.is_some() {
            plan.shard_numel()
        } else {
            plan.layout.numel
        };
        Ok(Persistent {
            region: dev.alloc(dtype, numel),
            ranges: (0..plan.layout.params.len())
                .map(|i| plan.param_range(i))
                .collect(),
            shards,
        })
    }

    /// The part of buffer range `range` this rank stores, as (buffer range, region range)
    /// pairs.
    fn local(&self, range: Range<usize>) -> Vec<(Range<usize>, Range<usize>)> {
        match &self.shards {
            None => vec![(range.clone(), range)],
            Some(shards) => shards
                .iter()
                .filter_map(|(s, at)| {
                    let (lo, hi) = (range.start.max(s.start), range.end.min(s.end));
                    (lo < hi).then(|| (lo..hi, at + lo - s.start..at + hi - s.start))
                })
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
        // An owned piece lies inside one bucket shard, so it maps to one region range.
        let local = self.local(range.clone());
        match local.as_slice() {
            [(b, r)] if *b == range => Ok(Some(self.region.slice(r.clone())?)),
            _ => Err(ConfigError::Policy(format!(
                "buffer range {range:?} is not inside one of this rank's parameter shards"
            ))
            .into()),
        }
    }
    fn initialize(&mut self, dev: &mut Device, index: usize, values: View) -> Result<()> {
        let range = self.ranges[index].clone();
        for (b, r) in self.local(range.clone()) {
            let v = values.slice(b.start - range.start..b.end - range.start)?;
            dev.cast(v, self.region.slice(r)?)?;
        }
        Ok(())
    }
    fn memory(&self) -> StorageBytes {
        StorageBytes {
            weights: self.region.byte_len(),
            staging: 0,
        }
    }
}
