//! Units under a strategy that shards parameters (`optim_grads_params`, ZeRO-3): a bucket group
//! is a unit, gathered into a transient buffer right before its parameters are used and released
//! when another unit is used, for the forward and again for the backward. The next unit in the
//! direction of use (forward: down the groups, backward: up) is prefetched when parameter gathers
//! overlap the computation.
//!
//! A unit of bf16/f32 parameters gathers the values. A unit of MXFP8 parameters (sharded by
//! rows, `storage/mxfp8_rows.rs`) gathers the quantized copies: both at once, or with
//! [`UnitGather::PerUsage`] (fine-grained, Megatron-LM PR #4181) only the one the use reads: rowwise for a
//! forward, columnwise for a backward.
//!
//! A gathered unit is never stale: units are released by [`StepProtocol::finish_grad_sync`],
//! [`StepProtocol::release_units`] (called by forced syncs and at the start of an iteration),
//! so no unit survives an optimizer step.

use lowbit_comm::{Communicator, Op};
use lowbit_device::{DType, Device, View};

use crate::config::UnitGather;
use crate::error::{ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::storage::{Mxfp8Weights, Nvfp4Rows, Nvfp4Weights, UnitParts};
use crate::{DataParallelBuffers, Usage, matrix_dims};

/// The transient memory of one gathered unit.
#[derive(Debug, Default)]
pub(crate) struct Unit {
    /// bf16/f32 values (the group's bucket range).
    pub(crate) values: Option<View>,
    /// Low-precision copies: rowwise (data and scales of every parameter), columnwise.
    pub(crate) copies: [Option<View>; 2],
    /// The gather in flight.
    pub(crate) work: Option<lowbit_comm::Work>,
    /// NVFP4: each matrix's weights, derived once the gather completed (group order).
    pub(crate) nvfp4: Vec<Nvfp4Weights>,
}

impl Unit {
    fn is_empty(&self) -> bool {
        self.values.is_none() && self.copies.iter().all(Option::is_none)
    }
}

impl DataParallelBuffers {
    /// Whether group `g`'s parameters are sharded (gathered per use).
    pub(crate) fn is_unit(&self, g: usize) -> bool {
        self.buffers[self.groups[g].buffer].shards_params()
    }

    fn is_low_precision_unit(&self, g: usize) -> bool {
        self.is_unit(g)
            && self.buffers[self.groups[g].buffer]
                .storage
                .is_low_precision()
    }

    fn is_nvfp4_unit(&self, g: usize) -> bool {
        self.is_unit(g)
            && self.buffers[self.groups[g].buffer].storage.kind() == crate::StorageKind::Nvfp4Rows
    }

    /// The copies a use of unit `g` needs gathered (NVFP4 gathers its rowwise bytes, slot 0,
    /// and derives both copies from them).
    fn copies_for(&self, g: usize, usage: Usage) -> [bool; 2] {
        if self.is_nvfp4_unit(g) {
            return [true, false];
        }
        match (self.cfg.unit_gather, usage) {
            (UnitGather::PerUsage, Usage::Forward) => [true, false],
            (UnitGather::PerUsage, Usage::Backward) => [false, true],
            _ => [true, true],
        }
    }

    /// Whether unit `g` holds what `usage` needs.
    fn unit_holds(&self, g: usize, usage: Usage) -> bool {
        let u = &self.groups[g].unit;
        if self.is_low_precision_unit(g) {
            let need = self.copies_for(g, usage);
            (0..2).all(|c| !need[c] || u.copies[c].is_some())
        } else {
            u.values.is_some()
        }
    }

    /// The body of [`StepProtocol::prepare_params`].
    pub(crate) fn prepare_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        usage: Usage,
    ) -> Result<()> {
        if !self.is_unit(g) {
            return self.finish_param_sync(dev, comm, g);
        }
        self.check_not_stale(g)?;
        let n = self.groups.len();
        let next = match usage {
            Usage::Forward => g.checked_sub(1),
            Usage::Backward => (g + 1 < n).then_some(g + 1),
        }
        .filter(|&h| self.is_unit(h));
        // Release first, so a unit not prefetched never sits beside two others; the next one
        // is kept only where it is (or will be) prefetched.
        let keep = next.filter(|_| self.cfg.overlap.param_gather());
        for h in 0..n {
            if h != g && Some(h) != keep {
                self.release_unit(dev, h)?;
            }
        }
        if !self.unit_holds(g, usage) {
            self.start_unit_gather(dev, comm, g, usage)?;
        }
        self.wait_unit(dev, g)?;
        self.finish_nvfp4_unit(dev, g)?;
        if let Some(h) = next
            && self.cfg.overlap.param_gather()
            && !self.unit_holds(h, usage)
        {
            self.start_unit_gather(dev, comm, h, usage)?;
        }
        Ok(())
    }

    /// Allocates what group `g` lacks for `usage` and launches its gather (asynchronous with
    /// overlapped gathers, completed here otherwise).
    fn start_unit_gather(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        usage: Usage,
    ) -> Result<()> {
        self.wait_unit(dev, g)?;
        self.refresh_replica_params(dev)?;
        let range = self.group_range(g);
        let dp = self.dp();
        let buf = &self.buffers[self.groups[g].buffer];
        let mut ops = Vec::new();
        let mut fresh: Vec<(usize, View)> = Vec::new();
        let r = (|| -> Result<()> {
            if !self.is_low_precision_unit(g) {
                let region = buf.storage.region();
                let unit = dev.try_alloc(region.dtype(), range.len())?;
                fresh.push((2, unit));
                for &bi in &self.groups[g].buckets {
                    let whole = buf.plan.layout.buckets[bi].range();
                    ops.push(Op::AllGather {
                        input: region.slice(buf.plan.local_shard_range(bi, self.rank)?)?,
                        output: unit.slice(whole.start - range.start..whole.end - range.start)?,
                    });
                }
                return Ok(());
            }
            let need = self.copies_for(g, usage);
            let parts: Vec<UnitParts> = self.groups[g]
                .indices
                .iter()
                .map(|&i| buf.storage.unit_parts(i).expect("a low-precision unit"))
                .collect();
            for (c, &needed) in need.iter().enumerate() {
                if !needed || self.groups[g].unit.copies[c].is_some() {
                    continue;
                }
                // Per matrix: what every rank contributes, and the unit bytes it takes.
                let pieces: Vec<(Vec<View>, usize)> = parts
                    .iter()
                    .map(|p| (p.inputs(c), p.unit_bytes(c, dp)))
                    .collect();
                let bytes: usize = pieces.iter().map(|(_, n)| n).sum();
                let unit = dev.try_alloc(DType::U8, bytes)?;
                fresh.push((c, unit));
                let mut at = 0;
                for (ins, n) in &pieces {
                    let mut o = at;
                    for &input in ins {
                        let k = dp * input.len();
                        ops.push(Op::AllGather {
                            input,
                            output: unit.slice(o..o + k)?,
                        });
                        o += k;
                    }
                    at += n;
                }
            }
            Ok(())
        })();
        let work = r.and_then(|()| self.launch(dev, comm, &ops));
        let work = match work {
            Ok(w) => w,
            Err(e) => {
                for (_, v) in fresh {
                    dev.free(v)?;
                }
                return Err(e);
            }
        };
        let unit = &mut self.groups[g].unit;
        for (c, v) in fresh {
            match c {
                2 => unit.values = Some(v),
                c => unit.copies[c] = Some(v),
            }
        }
        if self.cfg.overlap.param_gather() {
            unit.work = Some(work);
        } else {
            work.wait(dev)?;
        }
        Ok(())
    }

    fn wait_unit(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        if let Some(w) = self.groups[g].unit.work.take() {
            w.wait(dev)?;
        }
        Ok(())
    }

    /// Derives an NVFP4 unit's scales and columnwise copies once its gather completed.
    fn finish_nvfp4_unit(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        if !self.is_nvfp4_unit(g) || !self.groups[g].unit.nvfp4.is_empty() {
            return Ok(());
        }
        let Some(unit) = self.groups[g].unit.copies[0] else {
            return Ok(());
        };
        let dp = self.dp();
        let buf = &self.buffers[self.groups[g].buffer];
        let mut at = 0;
        let mut out = Vec::with_capacity(self.groups[g].indices.len());
        for &i in &self.groups[g].indices {
            let parts = buf.storage.unit_parts(i).expect("a low-precision unit");
            let n = parts.unit_bytes(0, dp);
            out.push(Nvfp4Rows::unfinished(&parts, unit.slice(at..at + n)?, dp)?);
            at += n;
        }
        // The whole group in one device call (one host read of the amaxes, not one per matrix).
        crate::storage::finish_nvfp4(dev, &mut out.iter_mut().collect::<Vec<_>>())?;
        self.groups[g].unit.nvfp4 = out;
        Ok(())
    }

    fn release_unit(&mut self, dev: &mut Device, g: usize) -> Result<()> {
        self.wait_unit(dev, g)?;
        let unit = std::mem::take(&mut self.groups[g].unit);
        for v in unit.copies.into_iter().chain([unit.values]).flatten() {
            dev.free(v)?;
        }
        Ok(())
    }

    /// The body of [`StepProtocol::release_units`].
    pub(crate) fn release_units(&mut self, dev: &mut Device) -> Result<()> {
        (0..self.groups.len()).try_for_each(|g| self.release_unit(dev, g))
    }

    /// The body of [`StepProtocol::gathered_units`].
    pub(crate) fn gathered_units(&self) -> Vec<usize> {
        self.groups_where(|g| !g.unit.is_empty())
    }

    /// The body of [`StepProtocol::unit_copies`].
    pub(crate) fn unit_copies(&self, g: usize) -> (bool, bool) {
        let c = &self.groups[g].unit.copies;
        (c[0].is_some(), c[1].is_some())
    }

    /// The gathered unit's bf16/f32 values of group `g`, if gathered and complete.
    pub(crate) fn unit_values(&self, g: usize) -> Option<View> {
        let u = &self.groups[g].unit;
        u.values.filter(|_| u.work.is_none())
    }

    /// The NVFP4 weights of parameter `p` of a gathered NVFP4 unit (both copies, derived after
    /// the gather); `Ok(None)` when `p` is not in an NVFP4 unit.
    ///
    /// # Errors
    /// [`ProtocolError::NotGathered`] when the unit is not gathered.
    pub fn unit_nvfp4_weights(&self, p: usize) -> Result<Option<Nvfp4Weights>> {
        self.check_param(p)?;
        let g = self.group_of[p];
        if !self.is_nvfp4_unit(g) {
            return Ok(None);
        }
        let (_, index) = self.plan.location(p);
        let group = &self.groups[g];
        let k = group.indices.iter().position(|&i| i == index);
        match (
            group.unit.work.is_none(),
            k.and_then(|k| group.unit.nvfp4.get(k)),
        ) {
            (true, Some(w)) => Ok(Some(w.clone())),
            _ => Err(ProtocolError::NotGathered {
                name: self.specs[p].name.clone(),
                group: g,
            }
            .into()),
        }
    }

    /// The MXFP8 weights of parameter `p` of a gathered low-precision unit, for `usage`: views
    /// into the unit. Only the copy `usage` reads is guaranteed gathered; where the other is
    /// not (fine-grained gathers), its views repeat the gathered copy's, so read the weights
    /// for `usage` only. `Ok(None)` when `p` is not in a low-precision unit.
    ///
    /// # Errors
    /// [`ProtocolError::NotGathered`] when the copy `usage` reads is not gathered.
    pub fn unit_mxfp8_weights(&self, p: usize, usage: Usage) -> Result<Option<Mxfp8Weights>> {
        self.check_param(p)?;
        let g = self.group_of[p];
        if !self.is_low_precision_unit(g) || self.is_nvfp4_unit(g) {
            return Ok(None);
        }
        let group = &self.groups[g];
        let buf = &self.buffers[group.buffer];
        let dp = self.dp();
        let (_, index) = self.plan.location(p);
        let (rows, cols) = matrix_dims(&self.specs[p].shape);
        let not_gathered = || ProtocolError::NotGathered {
            name: self.specs[p].name.clone(),
            group: g,
        };
        let read = match usage {
            Usage::Forward => 0,
            Usage::Backward => 1,
        };
        if group.unit.work.is_some() || group.unit.copies[read].is_none() {
            return Err(not_gathered().into());
        }
        let mut copy = [None, None];
        for (c, slot) in copy.iter_mut().enumerate() {
            let Some(unit) = group.unit.copies[c] else {
                continue;
            };
            let mut at = 0;
            for &i in &group.indices {
                let Some(parts) = buf.storage.unit_parts(i) else {
                    return Ok(None);
                };
                if i == index {
                    // The copy's gathered data, then its gathered scales.
                    let data = dp * parts.inputs(c)[0].len();
                    let scale_len = match c {
                        0 => rows * cols.div_ceil(32),
                        _ => rows.div_ceil(32) * cols,
                    };
                    *slot = Some((
                        unit.slice(at..at + rows * cols)?,
                        unit.slice(at + data..at + data + scale_len)?,
                    ));
                    break;
                }
                at += parts.unit_bytes(c, dp);
            }
        }
        let present = copy[read].ok_or_else(not_gathered)?;
        Ok(Some(Mxfp8Weights {
            rows,
            cols,
            rowwise: copy[0].unwrap_or(present),
            columnwise: copy[1].unwrap_or(present),
        }))
    }
}
