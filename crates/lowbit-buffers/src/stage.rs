//! Staging: how an optimizer hands new master values to low-precision storage. One entry point,
//! [`StepProtocol::stage`], whatever the storage: a bf16 cast into the staging view, or a
//! shard-by-shard quantization after a MAX-reduction of tile amaxes (collective).

use std::ops::Range;

use lowbit_comm::{Communicator, Op, ReduceOp};
use lowbit_device::{Device, View};
use lowbit_layout::{OptimizerId, ParamGather};

use crate::error::{ConfigError, ProtocolError, Result};
#[cfg(doc)]
use crate::protocol::StepProtocol;
use crate::storage::TileScaled;
use crate::{DataParallelBuffers, ParamSyncState, WeightState};

/// One owned piece of new master values to stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePiece {
    /// Global parameter id.
    pub param: usize,
    /// The piece within the flattened parameter (one of this rank's owned pieces).
    pub param_range: Range<usize>,
    /// The new fp32 master values of the piece.
    pub master: View,
}

impl DataParallelBuffers {
    /// The body of [`StepProtocol::stage`].
    pub(crate) fn stage(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        pieces: &[StagePiece],
    ) -> Result<()> {
        self.check_no_gather_in_flight(owner, "staging")?;
        // HFSDP: staging rewrote this rank's part of its parameter shards.
        self.replica_params_stale = true;
        let early = self.early_gather(owner);
        // A group staged by casts starts its gather right after its own casts; a tile-scaled
        // one after the batched quantization of every tile below.
        let by_casts =
            early.filter(|&g| self.buffers[self.groups[g].buffer].storage.aliases_grads());
        // Casts into staging views need no collective; consecutive pieces (masters and staging
        // views both continuing the previous piece's) are cast in one launch.
        let mut tiled = Vec::new();
        let mut first: Vec<(View, View)> = Vec::new();
        let mut casts: Vec<(View, View)> = Vec::new();
        for piece in pieces {
            let (b, i) = self.plan.location(piece.param);
            let buf = &self.buffers[b];
            if buf.owner() != owner || !buf.storage.is_low_precision() {
                continue;
            }
            let start = buf.plan.param_range(i).start;
            let range = start + piece.param_range.start..start + piece.param_range.end;
            if let Some(dst) = buf.storage.staging_view(range.clone())? {
                if by_casts == Some(self.group_of[piece.param]) {
                    first.push((piece.master, dst));
                } else {
                    casts.push((piece.master, dst));
                }
            } else if !buf.storage.stage_cast(dev, range, piece.master)? {
                tiled.push(piece);
            }
        }
        if let Some(g) = by_casts {
            for (master, dst) in joined_runs(first) {
                dev.cast(master, dst)?;
            }
            self.groups[g].weights = WeightState::Staged;
            self.groups[g].param_state = ParamSyncState::Idle;
            self.start_param_sync_group(dev, comm, g, true)?;
        }
        for (master, dst) in joined_runs(casts) {
            dev.cast(master, dst)?;
        }
        self.stage_tiled(dev, comm, owner, &tiled)?;
        for g in &mut self.groups {
            let buf = &self.buffers[g.buffer];
            // The early gather's group is staged already (and in flight).
            if g.param_work.is_some() {
                continue;
            }
            if buf.owner() == owner && buf.storage.is_low_precision() {
                // Sharded units quantized their rows in place: current, gathered per use.
                g.weights = if buf.shards_params() {
                    WeightState::Current
                } else {
                    WeightState::Staged
                };
                g.param_state = ParamSyncState::Idle;
            }
        }
        if let Some(g) = early.filter(|&g| self.groups[g].param_work.is_none()) {
            self.start_param_sync_group(dev, comm, g, true)?;
        }
        Ok(())
    }

    /// The tile-scaled part of [`Self::stage`]: zero every tile-scaled parameter's amaxes of
    /// `owner`, fold this rank's pieces (as bf16) into them, MAX-reduce them across ranks in one
    /// launch (parameters in id order), then quantize the pieces.
    fn stage_tiled(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        pieces: &[&StagePiece],
    ) -> Result<()> {
        let params: Vec<usize> = (0..self.specs.len())
            .filter(|&p| {
                let b = self.buffer_of(p);
                b.owner() == owner && b.storage.tile_scaled().is_some()
            })
            .collect();
        self.stage_tiled_params(dev, comm, &params, pieces)
    }

    /// [`Self::stage_tiled`] of the tile-scaled parameters `params` (ascending ids; `pieces`
    /// lie in them): every rank passes the same `params` (one MAX-reduction of their amaxes).
    pub(crate) fn stage_tiled_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        params: &[usize],
        pieces: &[&StagePiece],
    ) -> Result<()> {
        if params.is_empty() {
            return Ok(());
        }
        // The f32 masters are read directly: the batched ops round them to bf16 in registers
        // exactly as the cast into a bf16 scratch did, so no scratch, no cast, and one launch
        // for every piece's fold and one for every piece's quantization.
        let tiles_of = |p: usize| {
            let (b, i) = self.plan.location(p);
            let ts = self.buffers[b].storage.tile_scaled().expect("filtered");
            ts.tiles(i)
        };
        // The parameters' tiles as runs of neighbouring views (a tile-scaled storage keeps
        // them in one allocation), in plan order: the same runs on every rank.
        let mut views: Vec<(usize, usize, View)> = params
            .iter()
            .map(|&p| {
                let t = tiles_of(p);
                (self.plan.location(p).0, t.byte_offset(), t)
            })
            .collect();
        views.sort_unstable_by_key(|&(b, at, _)| (b, at));
        let mut runs: Vec<View> = Vec::with_capacity(views.len());
        for (_, _, v) in views {
            let joined = runs.last().and_then(|r| r.joined(&v));
            match (joined, runs.last_mut()) {
                (Some(j), Some(last)) => *last = j,
                _ => runs.push(v),
            }
        }
        for &run in &runs {
            dev.zero(run)?;
        }
        let mut folds = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let (ts, i) = self.tile_scaled_of(piece.param)?;
            folds.push(ts.fold_piece(i, piece.master, piece.param_range.start));
        }
        dev.fold_tile_amax_2d_bf16_many(&folds)?;
        // The MAX of a run is the MAX of each of its views: the same amaxes.
        let ops: Vec<Op> = runs
            .iter()
            .map(|&buf| Op::AllReduce {
                buf,
                reduce: ReduceOp::Max,
            })
            .collect();
        self.launch(dev, comm, &ops)?.wait(dev)?;
        let mut quantize = Vec::with_capacity(pieces.len());
        for piece in pieces {
            let (ts, i) = self.tile_scaled_of(piece.param)?;
            quantize.extend(ts.quantize_pieces(i, piece.master, piece.param_range.clone())?);
        }
        dev.quantize_2d_range_bf16_many(&quantize)?;
        Ok(())
    }

    /// The tile-scaled storage of parameter `param` and its layout index.
    fn tile_scaled_of(&self, param: usize) -> Result<(&dyn TileScaled, usize)> {
        let (b, i) = self.plan.location(param);
        match self.buffers[b].storage.tile_scaled() {
            Some(ts) => Ok((ts, i)),
            None => Err(ConfigError::Policy(format!(
                "parameter {param} has no tile-scaled storage"
            ))
            .into()),
        }
    }

    /// The group whose gather [`Self::stage`] starts as soon as it is staged, if any: with
    /// overlapped gathers, the first group in forward order (the last group) when it holds
    /// `owner`'s low-precision weights (gathered whole, not per use) and has not been gathered
    /// since the gradients were zeroed (a second gather is left to the gather that refuses
    /// it). Its gather then runs beside the rest of the staging and the zeroing of the
    /// gradients (`begin_iteration`) instead of in front of the first forward layer; the
    /// backward needs it gathered in this iteration anyway (bug A2's check), so starting early
    /// adds no obligation. The same on every rank: it depends on the plan and the protocol
    /// state only.
    fn early_gather(&self, owner: OptimizerId) -> Option<usize> {
        if !self.cfg.overlap.param_gather() {
            return None;
        }
        let g = self.groups.len().checked_sub(1)?;
        let group = &self.groups[g];
        let buf = &self.buffers[group.buffer];
        (buf.owner() == owner
            && buf.storage.is_low_precision()
            && !buf.shards_params()
            && buf.plan.param_gather != ParamGather::None
            && group.gathers == 0
            && group.param_work.is_none())
        .then_some(g)
    }

    fn check_no_gather_in_flight(&self, owner: OptimizerId, operation: &'static str) -> Result<()> {
        for (gi, g) in self.groups.iter().enumerate() {
            let buf = &self.buffers[g.buffer];
            if buf.owner() == owner
                && buf.storage.is_low_precision()
                && g.param_state == ParamSyncState::InFlight
            {
                return Err(ProtocolError::GatherInFlight {
                    group: gi,
                    operation,
                }
                .into());
            }
        }
        Ok(())
    }

    /// The body of [`StepProtocol::mark_stale`].
    pub(crate) fn mark_stale(&mut self, owner: OptimizerId) {
        // HFSDP: the optimizer wrote only this rank's part of its parameter shards.
        self.replica_params_stale = true;
        for g in &mut self.groups {
            let b = &self.buffers[g.buffer];
            if b.storage.is_low_precision() && b.owner() == owner {
                g.weights = WeightState::Stale;
            }
        }
    }

    /// The body of [`StepProtocol::has_stale`].
    pub(crate) fn has_stale(&self, owner: OptimizerId) -> bool {
        self.groups.iter().any(|g| {
            let b = &self.buffers[g.buffer];
            b.storage.is_low_precision() && b.owner() == owner && g.weights == WeightState::Stale
        })
    }
}

/// `(source, destination)` pairs of an element-wise operation, in destination order, with each
/// pair whose views both continue the previous pair's joined to it: one launch per run.
pub(crate) fn joined_runs(mut pairs: Vec<(View, View)>) -> Vec<(View, View)> {
    pairs.sort_by_key(|(_, d)| (d.buffer(), d.byte_offset()));
    let mut runs: Vec<(View, View)> = Vec::new();
    for (s, d) in pairs {
        let joined = runs.last_mut().and_then(|last| {
            let j = (last.0.joined(&s)?, last.1.joined(&d)?);
            Some((last, j))
        });
        match joined {
            Some((last, j)) => *last = j,
            None => runs.push((s, d)),
        }
    }
    runs
}
