//! Parameter side of the protocol: the all-gathers of the plan, their completion (re-quantization
//! of low-precision groups), the forward pre-hook's lazy gather with prefetch, forced syncs.

use lowbit_comm::{Communicator, Op};
use lowbit_device::Device;
use lowbit_layout::ParamGather;

use crate::error::{ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::storage::{AfterGather, Gathered};
use crate::{DataParallelBuffers, ParamSyncState, WeightState};

impl DataParallelBuffers {
    /// Launches the parameter all-gather of group `g` (every bucket, coalesced): each rank's
    /// shard of the parameter region goes to every rank. Asynchronous when `asynchronous`;
    /// otherwise completed here, including the re-quantization of low-precision groups.
    pub(crate) fn start_param_sync_group(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        asynchronous: bool,
    ) -> Result<()> {
        let buf = &self.buffers[self.groups[g].buffer];
        // Sharded-parameter units are gathered per use (`prepare_params`), not after the step.
        if buf.plan.param_gather == ParamGather::None || buf.shards_params() {
            self.groups[g].param_state = ParamSyncState::Done;
            return Ok(());
        }
        if self.groups[g].param_state == ParamSyncState::InFlight {
            return Err(ProtocolError::GatheredTwice { group: g }.into());
        }
        // Defence in depth: callers only gather staged groups (`needs_gather`).
        if buf.storage.is_low_precision() && self.groups[g].weights != WeightState::Staged {
            return Err(ProtocolError::StaleWeights { group: g }.into());
        }
        self.groups[g].gathers += 1;
        if self.groups[g].gathers > 1 {
            return Err(ProtocolError::GatheredTwice { group: g }.into());
        }
        let region = buf.storage.region();
        let mut ops = Vec::with_capacity(self.groups[g].buckets.len());
        for &bi in &self.groups[g].buckets {
            let (shard, whole) = buf.plan.gather_ranges(bi, self.rank)?;
            ops.push(Op::AllGather {
                input: region.slice(shard)?,
                output: region.slice(whole)?,
            });
        }
        let work = self.launch(dev, comm, &ops)?;
        if asynchronous {
            self.groups[g].param_work = Some(work);
            self.groups[g].param_state = ParamSyncState::InFlight;
        } else {
            work.wait(dev)?;
            self.after_gather(dev, g)?;
            self.settle(dev, Some(g))?;
        }
        Ok(())
    }

    /// Stores what group completions left on the device (NVFP4's global amaxes, read once for
    /// all of them): group `g`'s storage, or every storage. Called on every path that
    /// completes a gather before it returns, so no weight is read with a stale amax.
    fn settle(&mut self, dev: &mut Device, g: Option<usize>) -> Result<()> {
        match g {
            Some(g) => self.buffers[self.groups[g].buffer].storage.settle(dev),
            None => self
                .buffers
                .iter_mut()
                .try_for_each(|b| b.storage.settle(dev)),
        }
    }

    /// Completes a gather: the storage rebuilds the group's weights (re-quantization, scales);
    /// low-precision weights are current again.
    fn after_gather(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        self.groups[g].param_state = ParamSyncState::Done;
        let group = &self.groups[g];
        let buf = &mut self.buffers[group.buffer];
        let found = buf.storage.after_gather(
            dev,
            Gathered {
                plan: &buf.plan,
                indices: &group.indices,
                buckets: &group.buckets,
                verify: self.cfg.verify,
            },
        )?;
        if found == AfterGather::StagingNotZero {
            return Err(ProtocolError::StagingNotZero { group: g }.into());
        }
        self.groups[g].weights = WeightState::Current;
        Ok(())
    }

    /// Whether group `g` needs a gather before its parameters can be used.
    pub(crate) fn needs_gather(&self, g: usize) -> bool {
        let group = &self.groups[g];
        if self.buffers[group.buffer].shards_params() {
            return false;
        }
        if self.buffers[group.buffer].storage.is_low_precision() {
            group.weights == WeightState::Staged && group.param_state != ParamSyncState::InFlight
        } else {
            group.param_state == ParamSyncState::Idle
        }
    }

    pub(crate) fn check_not_stale(&self, g: usize) -> Result<()> {
        if self.buffers[self.groups[g].buffer]
            .storage
            .is_low_precision()
            && self.groups[g].weights == WeightState::Stale
        {
            return Err(ProtocolError::StaleWeights { group: g }.into());
        }
        Ok(())
    }

    /// The body of [`StepProtocol::sync_params`].
    pub(crate) fn sync_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        // Refuse before gathering anything.
        (0..self.groups.len()).try_for_each(|g| self.check_not_stale(g))?;
        self.complete_param_sync(dev)?;
        for g in 0..self.groups.len() {
            if self.needs_gather(g) {
                // On an error the gathers launched so far stay in flight: the next
                // `complete_param_sync` (or sync) completes them.
                self.start_param_sync_group(dev, comm, g, true)?;
            }
        }
        self.complete_param_sync(dev)
    }

    /// The body of [`StepProtocol::complete_param_sync`].
    pub(crate) fn complete_param_sync(&mut self, dev: &mut Device) -> Result<()> {
        let mut done = Ok(());
        for g in 0..self.groups.len() {
            if let Some(w) = self.groups[g].param_work.take() {
                done = w
                    .wait(dev)
                    .map_err(Into::into)
                    .and_then(|()| self.after_gather(dev, g));
                if done.is_err() {
                    break;
                }
            }
        }
        let settled = self.settle(dev, None);
        done.and(settled)
    }

    /// The body of [`StepProtocol::finish_param_sync`].
    pub(crate) fn finish_param_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        self.check_not_stale(g)?;
        if !self.cfg.overlap.param_gather() {
            return Ok(());
        }
        if self.needs_gather(g) {
            self.start_param_sync_group(dev, comm, g, true)?;
        }
        if let Some(w) = self.groups[g].param_work.take() {
            w.wait(dev)?;
            // The prefetch before this group's completion: a launch waits for the work queued
            // on the device's stream, so launched after the re-quantization it would wait for
            // it; launched here it runs beside it (the prefetched region is group g - 1's,
            // which the completion of group g does not touch).
            if g > 0 && self.needs_gather(g - 1) {
                self.start_param_sync_group(dev, comm, g - 1, true)?;
            }
            self.after_gather(dev, g)?;
            self.settle(dev, Some(g))?;
        }
        Ok(())
    }

    /// The body of [`StepProtocol::param_gathers_in_flight`].
    pub(crate) fn param_gathers_in_flight(&self) -> Vec<usize> {
        self.groups_where(|g| g.param_state == ParamSyncState::InFlight)
    }

    /// `GatherInFlight` naming `operation` if any group's gather is in flight.
    pub(crate) fn refuse_gather_in_flight(&self, operation: &'static str) -> Result<()> {
        match self.param_gathers_in_flight().first() {
            Some(&group) => Err(ProtocolError::GatherInFlight { group, operation }.into()),
            None => Ok(()),
        }
    }

    /// The body of [`StepProtocol::reset_param_sync`].
    pub(crate) fn reset_param_sync(&mut self) -> Result<()> {
        self.refuse_gather_in_flight("reset_param_sync")?;
        self.groups
            .iter_mut()
            .for_each(|g| g.param_state = ParamSyncState::Idle);
        Ok(())
    }
}
