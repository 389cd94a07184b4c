//! Units under a strategy that shards parameters (`optim_grads_params`, ZeRO-3): a bucket group
//! is a unit, gathered into a transient buffer right before its parameters are used and released
//! when another unit is used, for the forward and again for the backward. The next unit in the
//! direction of use (forward: down the groups, backward: up) is prefetched when parameter gathers
//! overlap the computation.
//!
//! A gathered unit is never stale: units are released by [`DataParallelBuffers::finish_grad_sync`],
//! [`DataParallelBuffers::release_units`] (called by forced syncs and at the start of an iteration),
//! so no unit survives an optimizer step.

use lowbit_comm::{Communicator, Op};
use lowbit_device::Device;

use crate::error::Result;
use crate::{DataParallelBuffers, Usage};

impl DataParallelBuffers {
    /// Whether group `g`'s parameters are sharded (gathered per use).
    pub(crate) fn is_unit(&self, g: usize) -> bool {
        self.buffers[self.groups[g].buffer].shards_params()
    }

    /// The pre-hook of a parameter of group `g` used for `usage`: a sharded-parameter unit is
    /// gathered (or its prefetch awaited), every other unit but the next one is released, and
    /// the next one is prefetched; other groups go through [`Self::finish_param_sync`].
    pub fn prepare_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        usage: Usage,
    ) -> Result<()> {
        if !self.is_unit(g) {
            return self.finish_param_sync(dev, comm, g);
        }
        let n = self.groups.len();
        let next = match usage {
            Usage::Forward => g.checked_sub(1),
            Usage::Backward => (g + 1 < n).then_some(g + 1),
        }
        .filter(|&h| self.is_unit(h));
        // Release first, so a unit not prefetched never sits beside two others.
        for h in 0..n {
            if h != g && Some(h) != next {
                self.release_unit(dev, h)?;
            }
        }
        if self.groups[g].unit.is_none() {
            self.start_unit_gather(dev, comm, g)?;
        }
        self.wait_unit(dev, g)?;
        if let Some(h) = next
            && self.cfg.overlap.param_gather()
            && self.groups[h].unit.is_none()
        {
            self.start_unit_gather(dev, comm, h)?;
        }
        Ok(())
    }

    /// Allocates group `g`'s unit and launches its gather (asynchronous with overlapped
    /// gathers, completed here otherwise).
    fn start_unit_gather(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        let range = self.group_range(g);
        let buf = &self.buffers[self.groups[g].buffer];
        let region = buf.storage.region();
        let unit = dev.try_alloc(region.dtype(), range.len())?;
        let mut ops = Vec::with_capacity(self.groups[g].buckets.len());
        let r = (|| -> Result<()> {
            for &bi in &self.groups[g].buckets {
                let whole = buf.plan.layout.buckets[bi].range();
                ops.push(Op::AllGather {
                    input: region.slice(buf.plan.local_shard_range(bi, self.rank)?)?,
                    output: unit.slice(whole.start - range.start..whole.end - range.start)?,
                });
            }
            Ok(())
        })();
        let work = r.and_then(|()| self.launch(dev, comm, &ops));
        let work = match work {
            Ok(w) => w,
            Err(e) => {
                dev.free(unit)?;
                return Err(e);
            }
        };
        self.groups[g].unit = Some(unit);
        if self.cfg.overlap.param_gather() {
            self.groups[g].unit_work = Some(work);
        } else {
            work.wait(dev)?;
        }
        Ok(())
    }

    fn wait_unit(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        if let Some(w) = self.groups[g].unit_work.take() {
            w.wait(dev)?;
        }
        Ok(())
    }

    fn release_unit(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        self.wait_unit(dev, g)?;
        if let Some(v) = self.groups[g].unit.take() {
            dev.free(v)?;
        }
        Ok(())
    }

    /// Releases every gathered unit (waiting for gathers in flight).
    pub fn release_units(&mut self, dev: &mut Device) -> Result<()> {
        (0..self.groups.len()).try_for_each(|g| self.release_unit(dev, g))
    }

    /// The units gathered now (for tests and diagnostics: at most the one in use and the
    /// prefetched one).
    pub fn gathered_units(&self) -> Vec<usize> {
        self.groups_where(|g| g.unit.is_some())
    }
}
