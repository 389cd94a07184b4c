//! Gradient side of the protocol: zeroing, grad-ready counting, launching and completing the
//! bucket groups' reductions (reduce-scatter for sharded plans, all-reduce otherwise).

use lowbit_comm::{Communicator, Op, ReduceOp};
use lowbit_device::{Device, View};
use lowbit_layout::GradReduce;

use crate::config::{GradScaling, Verify};
use crate::error::{ProtocolError, Result};
use crate::{DataParallelBuffers, ParamSyncState, WeightState};

impl DataParallelBuffers {
    /// Marks whether the coming backward is the last microbatch of the step (Megatron's
    /// `no_sync`): only then do gradients become ready for reduction.
    pub fn set_last_microbatch(&mut self, last: bool) {
        self.last_microbatch = last;
    }

    /// Zeroes every gradient buffer and resets the per-iteration grad-sync state. The first call
    /// after the first batch freezes that batch's ready counts as the golden counts.
    ///
    /// Zeroing also zeroes the staging views that alias the gradients: a group whose staged
    /// weights had not been gathered yet goes back to [`WeightState::Stale`] and must be staged
    /// again before the next forward (gathering it now would ship zeros: Megatron bug A1/A3).
    pub fn zero_grad_buffer(&mut self, dev: &mut Device) -> Result<()> {
        if self
            .groups
            .iter()
            .any(|g| g.grad_work.is_some() || g.param_work.is_some())
        {
            return Err(ProtocolError::CollectiveInFlight.into());
        }
        for b in &self.buffers {
            dev.zero(b.grads)?;
        }
        let record = self.first_batch && self.groups.iter().any(|g| g.grad_reduce_finished);
        let buffers = &self.buffers;
        for g in &mut self.groups {
            if record {
                g.golden_counts = Some(g.ready_counts.clone());
            }
            g.ready_counts.iter_mut().for_each(|c| *c = 0);
            g.grad_reduce_started = false;
            g.grad_reduce_finished = false;
            g.gathers = 0;
            if buffers[g.buffer].storage.aliases_grads() && g.weights == WeightState::Staged {
                g.weights = WeightState::Stale;
            }
        }
        if record {
            self.first_batch = false;
        }
        self.check_before_backward = true;
        Ok(())
    }

    /// The gradient view of `p` for accumulation in the backward. The first call after
    /// `zero_grad_buffer` checks that every low-precision group is gathered (bug A2) and, with
    /// [`Verify::Full`], that the gradient buffers are zero.
    pub fn accumulation_view(&mut self, dev: &mut Device, p: usize) -> Result<View> {
        if self.check_before_backward {
            self.check_before_backward = false;
            for (gi, g) in self.groups.iter().enumerate() {
                if self.buffers[g.buffer].storage.is_low_precision()
                    && g.weights != WeightState::Current
                {
                    return Err(ProtocolError::BackwardBeforeGather {
                        group: gi,
                        state: g.weights,
                    }
                    .into());
                }
            }
            if self.cfg.verify == Verify::Full {
                for b in &self.buffers {
                    if dev.read_bytes(b.grads)?.iter().any(|&x| x != 0) {
                        return Err(ProtocolError::GradsNotZero.into());
                    }
                }
            }
        }
        self.grad_view(p)
    }

    /// Called from the backward hook when parameter `p`'s gradient is complete for this
    /// microbatch. On the last microbatch of a step after the first, the group's reduction
    /// starts once all of its parameters reported as often as in the first batch.
    pub fn register_grad_ready(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        p: usize,
    ) -> Result<()> {
        if !self.cfg.overlap.grad_reduce() {
            return Err(ProtocolError::GradReadyWithoutOverlap.into());
        }
        if !self.last_microbatch {
            return Ok(());
        }
        let g = self.group_of(p);
        let group = &mut self.groups[g];
        let idx = group
            .params
            .iter()
            .position(|&q| q == p)
            .expect("a parameter is in its own group");
        group.ready_counts[idx] += 1;
        let complete = match &group.golden_counts {
            Some(golden) => group.ready_counts == *golden,
            None => false,
        };
        if complete && !group.grad_reduce_started {
            self.start_grad_sync(dev, comm, g)?;
        }
        Ok(())
    }

    /// Scales the group's gradients and launches the plan's reduction, asynchronously when
    /// grad reduce is overlapped.
    fn start_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        let (reduce, factor) = match self.cfg.scaling {
            GradScaling::AverageInCollective => (ReduceOp::Avg, None),
            _ => (ReduceOp::Sum, Some(1.0 / self.dp() as f32)),
        };
        let group = &self.groups[g];
        let buf = &self.buffers[group.buffer];
        let mut ops = Vec::with_capacity(group.buckets.len());
        for &bi in &group.buckets {
            let bucket = &buf.plan.layout.buckets[bi];
            let grads = buf.grads.slice(bucket.range())?;
            if let Some(f) = factor {
                dev.scale(grads, f)?;
            }
            ops.push(match buf.plan.grad_reduce {
                GradReduce::ReduceScatter => Op::ReduceScatter {
                    input: grads,
                    output: buf.grads.slice(buf.plan.shard(bi, self.rank)?)?,
                    reduce,
                },
                _ => Op::AllReduce { buf: grads, reduce },
            });
        }
        let work = self.launch(dev, comm, &ops)?;
        let group = &mut self.groups[g];
        group.grad_reduce_started = true;
        if self.cfg.overlap.grad_reduce() {
            group.grad_work = Some(work);
        } else {
            work.wait(dev)?;
        }
        Ok(())
    }

    /// Completes every group's gradient reduction (launching those not started yet) and re-arms
    /// the next forward's parameter gather. Idempotent within an iteration.
    pub fn finish_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        // Refuse before touching anything: reducing some groups and then refusing would leave
        // gradients (and the staging views aliasing them) half reduced.
        self.refuse_gather_in_flight("finish_grad_sync")?;
        for g in 0..self.groups.len() {
            self.groups[g].param_state = ParamSyncState::Idle;
            if self.groups[g].grad_reduce_finished {
                continue;
            }
            if !self.groups[g].grad_reduce_started {
                if self.cfg.overlap.grad_reduce() && !self.first_batch {
                    return Err(ProtocolError::GradReduceNotStarted { group: g }.into());
                }
                self.start_grad_sync(dev, comm, g)?;
            }
            if let Some(w) = self.groups[g].grad_work.take() {
                w.wait(dev)?;
            }
            self.groups[g].grad_reduce_finished = true;
        }
        Ok(())
    }

    /// The bucket group whose gradient reduction is in flight, in launch order (for tests and
    /// diagnostics of the overlap).
    pub fn grad_reduce_in_flight(&self) -> Vec<usize> {
        self.groups_where(|g| g.grad_work.is_some())
    }
}
