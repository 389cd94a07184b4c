//! The pipelined step's staging and gathers: bucket group by bucket group, so that each group's
//! parameter gather runs beside the optimizer's update of the groups after it. The step driver
//! asks [`StepProtocol::pipeline_groups`] for the order, has the optimizer update each
//! group and hands the updated pieces to [`StepProtocol::stage_and_gather_group`]. Without overlapped
//! gathers `sync_params` then completes the gathers in flight; with them the forward's
//! pre-hooks do (a gather in flight at the zeroing counts as the coming forward's).
//!
//! Why the order is safe: an MXFP8 staging view aliases the first half of the f32 gradient
//! bytes, so staging (and gathering) elements `a..b` of a buffer writes the bytes of the f32
//! gradients of elements `a/2..b/2`. In increasing element order every such gradient belongs to
//! a group already updated (or to the group itself, updated just before), and no group after it
//! reads a byte below `4b`. Each gather writes only its own group's region.

use lowbit_comm::Communicator;
use lowbit_device::{Device, View};
use lowbit_layout::{OptimizerId, ParamGather};

use crate::error::{ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::stage::{StagePiece, joined_runs};
use crate::{DataParallelBuffers, ParamSyncState, WeightState};

impl DataParallelBuffers {
    /// The body of [`StepProtocol::pipeline_groups`].
    pub(crate) fn pipeline_groups(&self, owner: OptimizerId) -> Option<Vec<usize>> {
        if self.outer.is_some() {
            return None;
        }
        let mut mine: Vec<(usize, usize, usize)> = Vec::new();
        let mut gathers = false;
        for (g, group) in self.groups.iter().enumerate() {
            let buf = &self.buffers[group.buffer];
            if buf.owner() != owner {
                continue;
            }
            if buf.shards_params() {
                return None;
            }
            gathers |= buf.plan.param_gather != ParamGather::None;
            let start = group
                .buckets
                .iter()
                .map(|&k| buf.plan.layout.buckets[k].range().start)
                .min()?;
            mine.push((group.buffer, start, g));
        }
        if !gathers || mine.len() < 2 {
            return None;
        }
        mine.sort_unstable();
        Some(mine.into_iter().map(|(_, _, g)| g).collect())
    }

    /// The body of [`StepProtocol::stage_and_gather_group`].
    pub(crate) fn stage_and_gather_group(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        g: usize,
        pieces: &[StagePiece],
    ) -> Result<()> {
        let refuse = |what| Err(ProtocolError::Pipeline { group: g, what }.into());
        let Some(group) = self.groups.get(g) else {
            return refuse("no such bucket group");
        };
        let buf = &self.buffers[group.buffer];
        if buf.owner() != owner {
            return refuse("belongs to another optimizer");
        }
        if self.outer.is_some() || buf.shards_params() {
            return refuse("cannot be pipelined (see pipeline_groups)");
        }
        if group.param_state == ParamSyncState::InFlight {
            return Err(ProtocolError::GatherInFlight {
                group: g,
                operation: "staging",
            }
            .into());
        }
        let low_precision = buf.storage.is_low_precision();
        let tiled = buf.storage.tile_scaled().is_some();
        let mut casts: Vec<(View, View)> = Vec::new();
        let mut tiled_pieces = Vec::new();
        for piece in pieces {
            if self.group_of.get(piece.param) != Some(&g) {
                return refuse("a piece of a parameter outside the group");
            }
            if !low_precision {
                continue;
            }
            if tiled {
                tiled_pieces.push(piece);
                continue;
            }
            let (_, i) = self.plan.location(piece.param);
            let start = buf.plan.param_range(i).start;
            let range = start + piece.param_range.start..start + piece.param_range.end;
            if let Some(dst) = buf.storage.staging_view(range.clone())? {
                casts.push((piece.master, dst));
            } else if !buf.storage.stage_cast(dev, range, piece.master)? {
                return refuse("a piece its storage cannot stage by itself");
            }
        }
        for (master, dst) in joined_runs(casts) {
            dev.cast(master, dst)?;
        }
        if tiled {
            // The group's tile amaxes, MAX-reduced across ranks (every rank stages the same
            // groups in the same order), then its pieces quantized.
            let mut params = self.groups[g].params.clone();
            params.sort_unstable();
            self.stage_tiled_params(dev, comm, &params, &tiled_pieces)?;
        }
        if low_precision {
            self.groups[g].weights = WeightState::Staged;
        }
        self.groups[g].param_state = ParamSyncState::Idle;
        // New weights: this is their first gather. (With gathers overlapped with the forward the
        // group was gathered for this iteration's forward already; this gather is the coming
        // forward's, and the zeroing counts it so.)
        self.groups[g].gathers = 0;
        if self.needs_gather(g) {
            self.start_param_sync_group(dev, comm, g, true)?;
        }
        Ok(())
    }
}
