//! Gradient side of the protocol: zeroing, grad-ready counting, launching and completing the
//! bucket groups' reductions (reduce-scatter for sharded plans, all-reduce otherwise).
//!
//! Where the gradients go, by strategy and communication dtype:
//!
//! | gradients | comm dtype | the backward writes | the collective runs on | the result |
//! |---|---|---|---|---|
//! | whole | = main | the main buffer | the main buffer, in place | is in place |
//! | whole | ≠ main | the main buffer | a transient bucket: cast of the main buffer | **copied** back (never added: Megatron-FSDP's `optim` double gradient) |
//! | sharded | any | a transient bucket, zeroed per microbatch | that bucket | **added** into the main shard |
//!
//! The `1/dp` of the mean scales the tensor that enters the collective, never the main shard.

use std::ops::Range;

use lowbit_comm::{Communicator, Op, ReduceOp};
use lowbit_device::{DType, Device, View};
use lowbit_layout::GradReduce;

use crate::buffers::GradComm;
use crate::config::{GradScaling, NanCheck, Verify};
use crate::error::{ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::storage;
use crate::{DataParallelBuffers, ParamSyncState, WeightState};

impl DataParallelBuffers {
    /// The body of [`StepProtocol::set_last_microbatch`].
    pub(crate) fn set_last_microbatch(&mut self, last: bool) {
        self.last_microbatch = last;
        self.microbatch_due = true;
    }

    /// The body of [`StepProtocol::zero_grad_buffer`].
    pub(crate) fn zero_grad_buffer(&mut self, dev: &mut Device) -> Result<()> {
        self.reset_iteration(dev)?;
        self.zero_grads(dev)
    }

    /// The body of [`StepProtocol::reset_iteration`].
    pub(crate) fn reset_iteration(&mut self, dev: &mut Device) -> Result<()> {
        if self
            .groups
            .iter()
            .any(|g| matches!(g.grad_comm, GradComm::Launched { .. }) || g.unit.work.is_some())
        {
            return Err(ProtocolError::CollectiveInFlight.into());
        }
        for g in 0..self.groups.len() {
            self.drop_comm_bucket(dev, g)?;
        }
        let record = self.first_batch && self.groups.iter().any(|g| g.grad_reduce_finished);
        for g in &mut self.groups {
            if record {
                g.golden_counts = Some(g.ready_counts.clone());
            }
            g.ready_counts.iter_mut().for_each(|c| *c = 0);
            g.grad_reduce_started = false;
            g.grad_reduce_finished = false;
            // A gather already in flight was started for the coming forward.
            g.gathers = u32::from(g.param_work.is_some());
        }
        if record {
            self.first_batch = false;
        }
        self.check_before_backward = true;
        self.microbatch_due = false;
        self.microbatch_dirty = false;
        Ok(())
    }

    /// The body of [`StepProtocol::zero_grads`].
    pub(crate) fn zero_grads(&self, dev: &mut Device) -> Result<()> {
        for (bi, b) in self.buffers.iter().enumerate() {
            // The memory the staging view lies in: bf16 memory of its own where gradients are
            // sharded, the gradients themselves otherwise.
            let staging_memory = b.staging_backing.unwrap_or(b.grads);
            if b.staging_backing.is_some() {
                dev.zero(b.grads)?;
            }
            let mut keep = Vec::new();
            if b.storage.aliases_grads() {
                let staging = b.storage.region();
                for g in self.groups.iter().filter(|g| g.buffer == bi) {
                    if g.weights == WeightState::Staged {
                        for &k in &g.buckets {
                            keep.push(
                                staging
                                    .slice(b.plan.layout.buckets[k].range())?
                                    .byte_range(),
                            );
                        }
                    }
                }
            }
            zero_except(dev, staging_memory, keep)?;
        }
        Ok(())
    }

    /// Frees a group's transient bucket that holds nothing launched (a filling bucket left by
    /// an aborted iteration).
    fn drop_comm_bucket(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        if let GradComm::Filling(v) = std::mem::take(&mut self.groups[g].grad_comm) {
            dev.free(v)?;
        }
        Ok(())
    }

    /// The body of [`StepProtocol::accumulation_view`].
    pub(crate) fn accumulation_view(&mut self, dev: &mut Device, p: usize) -> Result<View> {
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
        self.microbatch_dirty = true;
        self.write_view(dev, p)
    }

    /// Where the backward writes gradient `p`: its slice of the main buffer, or of its group's
    /// transient bucket where gradients are sharded (allocated and zeroed on first use in a
    /// microbatch; the group's previous reduction is completed first).
    pub(crate) fn write_view(&mut self, dev: &mut Device, p: usize) -> Result<View> {
        self.check_param(p)?;
        let (b, i) = self.plan.location(p);
        let g = self.group_of[p];
        let buf = &self.buffers[b];
        let range = buf.plan.param_range(i);
        if !buf.shards_grads() {
            return Ok(buf.grads.slice(range)?);
        }
        if matches!(self.groups[g].grad_comm, GradComm::Launched { .. }) {
            self.complete_grad_sync(dev, g)?;
        }
        let bucket = match self.groups[g].grad_comm {
            GradComm::Filling(v) => v,
            _ => {
                let v = self.alloc_comm_bucket(dev, g)?;
                self.groups[g].grad_comm = GradComm::Filling(v);
                v
            }
        };
        let at = self.group_range(g).start;
        Ok(bucket.slice(range.start - at..range.end - at)?)
    }

    /// The dtype group `g`'s gradients are reduced in.
    fn comm_dtype(&self, g: usize) -> DType {
        let main = self.buffers[self.groups[g].buffer].grads.dtype();
        self.cfg.grad_comm_dtype.map_or(main, storage::grad_dtype)
    }

    /// A zeroed transient bucket for group `g`, after completing every launched reduction but
    /// the newest: at most two transient buckets are alive at once, whatever the model (the
    /// bound the memory accounting states).
    fn alloc_comm_bucket(&mut self, dev: &mut Device, g: usize) -> Result<View> {
        let newest = self
            .groups
            .iter()
            .filter_map(|x| match x.grad_comm {
                GradComm::Launched {
                    bucket: Some(_),
                    seq,
                    ..
                } => Some(seq),
                _ => None,
            })
            .max();
        for h in 0..self.groups.len() {
            if let GradComm::Launched {
                bucket: Some(_),
                seq,
                ..
            } = self.groups[h].grad_comm
                && Some(seq) != newest
            {
                self.complete_grad_sync(dev, h)?;
            }
        }
        let len = self.group_range(g).len();
        Ok(dev.try_alloc(self.comm_dtype(g), len)?)
    }

    /// The body of [`StepProtocol::begin_microbatch`].
    pub(crate) fn begin_microbatch(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        if !std::mem::take(&mut self.microbatch_due) {
            return Ok(());
        }
        if !std::mem::take(&mut self.microbatch_dirty) {
            return Ok(());
        }
        for g in 0..self.groups.len() {
            if !self.buffers[self.groups[g].buffer].shards_grads() {
                continue;
            }
            if matches!(self.groups[g].grad_comm, GradComm::Filling(_)) {
                self.start_grad_sync(dev, comm, g)?;
            }
            let group = &mut self.groups[g];
            group.grad_reduce_started = false;
            group.ready_counts.iter_mut().for_each(|c| *c = 0);
        }
        Ok(())
    }

    /// The body of [`StepProtocol::register_grad_ready`].
    pub(crate) fn register_grad_ready(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        p: usize,
    ) -> Result<()> {
        if !self.cfg.overlap.grad_reduce() {
            return Err(ProtocolError::GradReadyWithoutOverlap.into());
        }
        let g = self.group_of(p);
        let sharded = self.buffers[self.groups[g].buffer].shards_grads();
        if !self.last_microbatch && !sharded {
            return Ok(());
        }
        let group = &mut self.groups[g];
        let idx = group
            .params
            .iter()
            .position(|&q| q == p)
            .expect("a parameter is in its own group");
        group.ready_counts[idx] += 1;
        // Whole gradients: as often as in the first batch. Sharded gradients are reduced every
        // microbatch: once every parameter reported (a later contribution in the same
        // microbatch goes to a fresh bucket, reduced at the microbatch boundary).
        let complete = if sharded {
            group.ready_counts.iter().all(|&c| c > 0)
        } else {
            match &group.golden_counts {
                Some(golden) => group.ready_counts == *golden,
                None => false,
            }
        };
        let filled = !sharded || matches!(group.grad_comm, GradComm::Filling(_));
        if complete && filled && !group.grad_reduce_started {
            self.start_grad_sync(dev, comm, g)?;
        }
        Ok(())
    }

    /// Refuses non-finite gradients in `src` (group `g`'s gradients about to be reduced) with
    /// the parameters named, on every rank at once: the finding is MAX-reduced across ranks, so
    /// no rank is left waiting in a collective the others never start.
    fn check_finite(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        src: View,
    ) -> Result<()> {
        let mut names = Vec::new();
        if dev.has_non_finite(src)? {
            let group = &self.groups[g];
            let buf = &self.buffers[group.buffer];
            let at = self.group_range(g).start;
            for (&p, &i) in group.params.iter().zip(&group.indices) {
                let r = buf.plan.param_range(i);
                if dev.has_non_finite(src.slice(r.start - at..r.end - at)?)? {
                    names.push(self.specs[p].name.clone());
                    if self.cfg.nan_check == NanCheck::FirstParam {
                        break;
                    }
                }
            }
        }
        let flag = dev.try_alloc(DType::F32, 1)?;
        let r = dev
            .upload(flag, &[if names.is_empty() { 0.0f32 } else { 1.0 }])
            .map_err(crate::BufferError::from)
            .and_then(|()| {
                let ops = [Op::AllReduce {
                    buf: flag,
                    reduce: ReduceOp::Max,
                }];
                self.launch(dev, comm, &ops)?.wait(dev)?;
                Ok(dev.download::<f32>(flag)?[0])
            });
        dev.free(flag)?;
        if r? > 0.0 {
            if names.is_empty() {
                names.push("a parameter of another rank".to_string());
            }
            return Err(ProtocolError::NonFiniteGrad {
                rank: self.rank,
                names,
            }
            .into());
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
        self.launch_grad_sync(dev, comm, g)?;
        if !self.cfg.overlap.grad_reduce() {
            self.complete_grad_sync(dev, g)?;
        }
        Ok(())
    }

    /// The body of [`StepProtocol::launch_grad_syncs`].
    pub(crate) fn launch_grad_syncs(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        self.refuse_gather_in_flight("finish_grad_sync")?;
        if self.outer.is_some() {
            return Ok(());
        }
        for g in 0..self.groups.len() {
            let group = &self.groups[g];
            if group.grad_reduce_finished || matches!(group.grad_comm, GradComm::Launched { .. }) {
                continue;
            }
            let ready = if self.buffers[group.buffer].shards_grads() {
                matches!(group.grad_comm, GradComm::Filling(_))
            } else {
                // Not launched, and not one the backward should have launched (refused by
                // `finish_grad_sync`), and in place.
                let due_from_backward = self.cfg.overlap.grad_reduce() && !self.first_batch;
                !group.grad_reduce_started
                    && !due_from_backward
                    && self.comm_dtype(g) == self.buffers[group.buffer].grads.dtype()
            };
            if ready {
                self.launch_grad_sync(dev, comm, g)?;
            }
        }
        Ok(())
    }

    /// [`Self::start_grad_sync`] without the completion.
    fn launch_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        let (reduce, factor) = match self.cfg.scaling {
            GradScaling::AverageInCollective => (ReduceOp::Avg, None),
            _ => (
                ReduceOp::Sum,
                Some(1.0 / (self.dp() * self.outer_size()) as f32),
            ),
        };
        let range = self.group_range(g);
        let b = self.groups[g].buffer;
        let sharded = self.buffers[b].shards_grads();
        // The tensor the collective runs on, and the transient bucket it lives in, if any.
        let (src, bucket) = if sharded {
            let v = match std::mem::take(&mut self.groups[g].grad_comm) {
                GradComm::Filling(v) => v,
                _ => self.alloc_comm_bucket(dev, g)?,
            };
            (v, Some(v))
        } else {
            (self.buffers[b].grads.slice(range.clone())?, None)
        };
        if self.cfg.nan_check != NanCheck::Off
            && let Err(e) = self.check_finite(dev, comm, g, src)
        {
            // Nothing launched: the bucket goes back to the group as it was, so that the next
            // `zero_grad_buffer` frees it (an aborted iteration's filling bucket).
            if let Some(v) = bucket {
                self.groups[g].grad_comm = GradComm::Filling(v);
            }
            return Err(e);
        }
        let (src, bucket) = if !sharded && self.comm_dtype(g) != src.dtype() {
            let v = self.alloc_comm_bucket(dev, g)?;
            dev.cast(src, v)?;
            (v, Some(v))
        } else {
            (src, bucket)
        };
        // A factor of exactly 1 (one rank) changes no bit: its pass over the bucket is skipped.
        if let Some(f) = factor.filter(|&f| f != 1.0) {
            dev.scale(src, f)?;
        }
        let buf = &self.buffers[b];
        let mut ops = Vec::with_capacity(self.groups[g].buckets.len());
        for &bi in &self.groups[g].buckets {
            let local = |r: std::ops::Range<usize>| r.start - range.start..r.end - range.start;
            let input = src.slice(local(buf.plan.layout.buckets[bi].range()))?;
            ops.push(match buf.plan.grad_reduce {
                GradReduce::ReduceScatter => Op::ReduceScatter {
                    input,
                    output: src.slice(local(buf.plan.shard(bi, self.rank)?))?,
                    reduce,
                },
                _ => Op::AllReduce { buf: input, reduce },
            });
        }
        let work = self.launch(dev, comm, &ops)?;
        self.launches += 1;
        let group = &mut self.groups[g];
        group.grad_reduce_started = true;
        group.grad_comm = GradComm::Launched {
            bucket,
            work: Some(work),
            seq: self.launches,
        };
        Ok(())
    }

    /// Completes group `g`'s launched reduction: waits for it and moves the result from a
    /// transient bucket into the main gradients (sharded: added into this rank's shards; whole:
    /// copied over the reduced range), then frees the bucket.
    fn complete_grad_sync(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        let GradComm::Launched { bucket, work, .. } = std::mem::take(&mut self.groups[g].grad_comm)
        else {
            return Ok(());
        };
        if let Some(w) = work {
            w.wait(dev)?;
        }
        let Some(bucket) = bucket else {
            return Ok(());
        };
        let range = self.group_range(g);
        let buf = &self.buffers[self.groups[g].buffer];
        let r = (|| -> Result<()> {
            for &bi in &self.groups[g].buckets {
                let shard = match buf.plan.grad_reduce {
                    GradReduce::ReduceScatter => buf.plan.shard(bi, self.rank)?,
                    _ => buf.plan.layout.buckets[bi].range(),
                };
                let reduced = bucket.slice(shard.start - range.start..shard.end - range.start)?;
                if buf.shards_grads() {
                    let local = buf.plan.local_shard_range(bi, self.rank)?;
                    dev.add(reduced, buf.grads.slice(local)?)?;
                } else {
                    dev.cast(reduced, buf.grads.slice(shard)?)?;
                }
            }
            Ok(())
        })();
        dev.free(bucket)?;
        r
    }

    /// The body of [`StepProtocol::finish_grad_sync`].
    pub(crate) fn finish_grad_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        self.finish_grad_sync_all_but(dev, comm, &[])
    }

    /// The body of [`StepProtocol::grad_sync_order`].
    pub(crate) fn grad_sync_order(&self) -> Vec<usize> {
        if self.outer.is_some() {
            return Vec::new();
        }
        let mut order = self.grad_reduce_in_flight();
        let rest: Vec<usize> = (0..self.groups.len())
            .filter(|&g| !self.groups[g].grad_reduce_finished && !order.contains(&g))
            .collect();
        order.extend(rest);
        order
    }

    /// The body of [`StepProtocol::finish_grad_sync_except`].
    pub(crate) fn finish_grad_sync_except(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        except: &[usize],
    ) -> Result<()> {
        let except = if self.outer.is_some() {
            &[][..]
        } else {
            except
        };
        self.finish_grad_sync_all_but(dev, comm, except)
    }

    fn finish_grad_sync_all_but(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        except: &[usize],
    ) -> Result<()> {
        // Refuse before touching anything: reducing some groups and then refusing would leave
        // gradients (and the staging views aliasing them) half reduced.
        self.refuse_gather_in_flight("finish_grad_sync")?;
        // Gathered units never outlive the backward: the step moves the shards under them.
        self.release_units(dev)?;
        let mut newly_reduced = Vec::new();
        for g in 0..self.groups.len() {
            self.groups[g].param_state = ParamSyncState::Idle;
            if self.groups[g].grad_reduce_finished || except.contains(&g) {
                continue;
            }
            let sharded = self.buffers[self.groups[g].buffer].shards_grads();
            if sharded {
                // Sharded gradients: whatever the last microbatch left is reduced now; a group
                // it did not touch has nothing to reduce.
                if matches!(self.groups[g].grad_comm, GradComm::Filling(_)) {
                    self.start_grad_sync(dev, comm, g)?;
                }
            } else if !self.groups[g].grad_reduce_started {
                if self.cfg.overlap.grad_reduce() && !self.first_batch {
                    return Err(ProtocolError::GradReduceNotStarted { group: g }.into());
                }
                self.start_grad_sync(dev, comm, g)?;
            }
            self.complete_grad_sync(dev, g)?;
            self.groups[g].grad_reduce_finished = true;
            newly_reduced.push(g);
        }
        self.microbatch_due = false;
        self.microbatch_dirty = false;
        self.reduce_across_replicas(dev, &newly_reduced)
    }

    /// Hybrid sharding: all-reduces this rank's reduced shards of groups `groups` across its
    /// replicas (one launch).
    fn reduce_across_replicas(&mut self, dev: &mut Device, groups: &[usize]) -> Result<()> {
        if self.outer.is_none() || groups.is_empty() {
            return Ok(());
        }
        let reduce = match self.cfg.scaling {
            GradScaling::AverageInCollective => ReduceOp::Avg,
            _ => ReduceOp::Sum,
        };
        let mut ops = Vec::new();
        for &g in groups {
            let buf = &self.buffers[self.groups[g].buffer];
            for &bi in &self.groups[g].buckets {
                let view = if buf.shards_grads() {
                    buf.grads
                        .slice(buf.plan.local_shard_range(bi, self.rank)?)?
                } else {
                    match buf.plan.grad_reduce {
                        GradReduce::ReduceScatter => {
                            buf.grads.slice(buf.plan.shard(bi, self.rank)?)?
                        }
                        _ => buf.grads.slice(buf.plan.layout.buckets[bi].range())?,
                    }
                };
                ops.push(Op::AllReduce { buf: view, reduce });
            }
        }
        let outer = self.outer.as_mut().expect("checked above");
        outer.start_coalesced(dev, &ops)?.wait(dev)?;
        Ok(())
    }

    /// The body of [`StepProtocol::grad_reduce_in_flight`].
    pub(crate) fn grad_reduce_in_flight(&self) -> Vec<usize> {
        let mut launched: Vec<(u64, usize)> = (0..self.groups.len())
            .filter_map(|g| match self.groups[g].grad_comm {
                GradComm::Launched { seq, .. } => Some((seq, g)),
                _ => None,
            })
            .collect();
        launched.sort_unstable();
        launched.into_iter().map(|(_, g)| g).collect()
    }
}

/// Zeroes `memory` except the byte ranges `keep` (ranges within `memory`'s buffer, inside
/// `memory`), one launch per gap.
fn zero_except(dev: &mut Device, memory: View, mut keep: Vec<Range<usize>>) -> Result<()> {
    let bytes = memory.reinterpret(DType::U8)?;
    let base = memory.byte_offset();
    keep.sort_by_key(|r| r.start);
    let mut at = 0;
    for r in keep {
        let (start, end) = (r.start - base, r.end - base);
        if start > at {
            dev.zero(bytes.slice(at..start)?)?;
        }
        at = at.max(end);
    }
    if at < bytes.len() {
        dev.zero(bytes.slice(at..bytes.len())?)?;
    }
    Ok(())
}
