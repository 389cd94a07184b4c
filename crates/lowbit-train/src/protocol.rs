//! The training-step protocol as functions, in the only order that works:
//!
//! ```text
//! begin_iteration    reset the iteration, stage stale owners (the first gather starts where
//!                    gathers overlap the forward), zero the gradients beside it
//! microbatches       forward/backward through the hooks: each group's gather completes in its
//!                    forward pre-hook, grad-ready hooks launch the reductions
//! finish_grad_sync_and_norm
//!                    complete the reductions group by group, each group's share of the norm
//!                    launched as soon as it is reduced; the ranks' sums added in rank order
//! clip_or_skip       the clip coefficient, or a skip when the norm is not finite
//! update_and_stage   per owner (per bucket group where it pipelines): optimizer update, then
//!                    stage and gather; without overlapped gathers, sync_params completes them
//! force_param_sync   (between steps: eval, checkpoint) complete, zero, stage all, gather all
//! ```
//!
//! [`crate::Trainer`] encodes the order as types; these functions are for callers that drive
//! the buffers themselves (tests that probe wrong orders, benchmarks, custom loops). This
//! module is the only place that decides when a gather runs: optimizers update, buffers stage
//! and gather when told.

use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, StagePiece};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, View};
use lowbit_layout::OptimizerId;
use lowbit_optim::{
    GradPiece, MasterPiece, OptimError, Optimizer, Result, StepReport, UpdateScope,
};

/// Starts an iteration: stages `bf16(master)` for every owner whose low-precision weights are
/// stale, starts the first group's gather if gathers are overlapped with the forward, then
/// zeroes the gradients while it runs (stage → gather → re-quantize → zero the group's staging
/// view → backward).
///
/// Staging first is safe: the gradients are dead after the step, and zeroing keeps the bytes
/// of staged groups' staging views (their gathers ship them and zero them afterwards), so the
/// zeroing neither ships zeros (Megatron bug A3) nor has to clear bytes the gathers overwrite
/// anyway: with bf16 gradients an MXFP8-staged buffer is not zeroed here at all, with fp32
/// gradients half of it.
///
/// # Errors
/// Protocol violations (a collective in flight, refused before anything is staged), buffer and
/// device errors.
pub fn begin_iteration(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<()> {
    bufs.release_units(dev)?;
    bufs.reset_iteration(dev)?;
    stage(dev, comm, bufs, opt, true)?;
    Ok(bufs.zero_grads(dev)?)
}

/// Stages every owner's weights from `opt`'s masters (collective): low-precision weights
/// through [`StepProtocol::stage`]; with `only_stale`, only owners whose weights are
/// stale. Without `only_stale` (forced syncs) persistent weights are rewritten from the masters
/// too, so that a forced sync after an import makes every weight reflect the masters. Every
/// rank stages every owner, also one it holds no piece of (the staging may be collective).
///
/// # Errors
/// Buffer errors (protocol violations included), device errors.
pub fn stage(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
    only_stale: bool,
) -> Result<()> {
    stage_where(dev, comm, bufs, opt, only_stale, |_| true)
}

/// [`stage`] of the owners `which` selects.
fn stage_where(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
    only_stale: bool,
    which: impl Fn(OptimizerId) -> bool,
) -> Result<()> {
    for (owner, pieces) in opt.masters_to_stage() {
        if !which(owner) || (only_stale && !bufs.has_stale(owner)) {
            continue;
        }
        let mut low = Vec::with_capacity(pieces.len());
        for piece in pieces {
            match piece.fused_output {
                // The rounding the fused update wrote, so after a normal step this changes
                // no bit; after an import it brings persistent weights to the masters.
                // (Compute weights used as masters are already the stored values.)
                Some(out) if !only_stale && out != piece.master => dev.cast(piece.master, out)?,
                Some(_) => {}
                None => low.extend(staged(piece)),
            }
        }
        bufs.stage(dev, comm, owner, &low)?;
    }
    Ok(())
}

/// What the buffers stage of an updated piece: low-precision pieces only (persistent storage
/// took the rounded values in the fused update).
fn staged(piece: MasterPiece) -> Option<StagePiece> {
    piece.fused_output.is_none().then_some(StagePiece {
        param: piece.param,
        param_range: piece.range,
        master: piece.master,
    })
}

/// One optimizer step after `finish_grad_sync`: the global gradient norm over every part and
/// rank, clip, skip if not finite (nothing changes then, not even step counts), update, then
/// stage and gather (see [`update_and_stage`]).
///
/// # Errors
/// Buffer, collective and device errors.
pub fn step(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
) -> Result<StepReport> {
    let grad_norm = global_grad_norm(dev, comm, bufs, opt)?;
    step_with_norm(dev, comm, bufs, opt, grad_norm)
}

/// `finish_grad_sync` and [`step`] in one, with the same bits: the reductions complete one
/// bucket group at a time and each group's share of the norm runs beside the later reductions
/// ([`finish_grad_sync_and_norm`]).
///
/// # Errors
/// As `finish_grad_sync` and [`step`].
pub fn finish_grad_sync_and_step(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
) -> Result<StepReport> {
    let grad_norm = finish_grad_sync_and_norm(dev, comm, bufs, opt)?;
    step_with_norm(dev, comm, bufs, opt, grad_norm)
}

/// The rest of a step once the gradient norm is known: clip or skip, then update and stage.
fn step_with_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
    grad_norm: f32,
) -> Result<StepReport> {
    let Some(clip_coef) = clip_or_skip(grad_norm, opt.clip_grad()) else {
        return Ok(StepReport {
            grad_norm,
            skipped: true,
            clip_coef: 1.0,
        });
    };
    update_and_stage(dev, comm, bufs, opt, clip_coef)?;
    Ok(StepReport {
        grad_norm,
        skipped: false,
        clip_coef,
    })
}

/// The clip coefficient, or `None` (skip) when the norm is not finite: see
/// [`crate::schedule::clip_coefficient`].
pub fn clip_or_skip(grad_norm: f32, clip_grad: Option<f32>) -> Option<f32> {
    crate::schedule::clip_coefficient(grad_norm, clip_grad)
}

/// How the update of one owner runs: all of its pieces at once, or bucket group by bucket
/// group (each group's gather launched as soon as it is staged).
fn owner_groups(
    bufs: &DataParallelBuffers,
    opt: &dyn Optimizer,
    owner: OptimizerId,
) -> Option<Vec<usize>> {
    if !opt.updates_in_parts(owner) {
        return None;
    }
    let groups = bufs.pipeline_groups(owner)?;
    // Every piece must lie in one of the owner's groups, or the groups would miss it.
    let covered = opt
        .masters_to_stage()
        .into_iter()
        .filter(|(o, _)| *o == owner)
        .flat_map(|(_, pieces)| pieces)
        .all(|p| groups.contains(&bufs.group_of(p.param)));
    covered.then_some(groups)
}

/// Counts the step, updates every owner's pieces and stages the new weights: the driver's
/// half of a step after the norm.
///
/// - Where gathers overlap the forward and every owner pipelines (`owner_groups`): per
///   group, update, stage, launch its gather; the gathers stay in flight and the forward's
///   pre-hooks complete them (the next `begin_iteration` finds nothing stale).
/// - Where gathers overlap the forward otherwise: update everything; the next
///   `begin_iteration` stages the stale owners (and starts the first gather).
/// - Without overlapped gathers: owner by owner, pipelined owners group by group (each group's
///   gather beside the later groups' update), the others updated then staged; then
///   `sync_params` completes the gathers in flight and launches the rest. Gradients are dead
///   once their group is updated (copied to fp32 or used in place), so the staging views that
///   alias them can be written.
///
/// Every owner's low-precision weights are marked stale before its update (its masters move),
/// so a forward cannot read them before they are staged again.
///
/// # Errors
/// Buffer, collective and device errors.
pub fn update_and_stage(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
    clip: f32,
) -> Result<()> {
    opt.begin_step();
    let owners = opt.owners();
    let plans: Vec<_> = owners.iter().map(|&o| owner_groups(bufs, opt, o)).collect();
    let overlapped = bufs.config().overlap.param_gather();
    if overlapped && (owners.is_empty() || plans.iter().any(Option::is_none)) {
        opt.update(dev, clip, UpdateScope::All)?;
        owners.iter().for_each(|&o| bufs.mark_stale(o));
        return Ok(());
    }
    for (&owner, groups) in owners.iter().zip(plans) {
        bufs.mark_stale(owner);
        match groups {
            Some(groups) => {
                for g in groups {
                    let updated =
                        opt.update(dev, clip, UpdateScope::Params(bufs.group_params(g)))?;
                    let pieces: Vec<StagePiece> = updated.into_iter().filter_map(staged).collect();
                    bufs.stage_and_gather_group(dev, comm, owner, g, &pieces)?;
                }
            }
            None => {
                opt.update(dev, clip, UpdateScope::Owner(owner))?;
                stage_where(dev, comm, bufs, opt, true, |o| o == owner)?;
            }
        }
    }
    if !overlapped {
        bufs.sync_params(dev, comm)?;
    }
    Ok(())
}

/// Completes every gradient reduction, each group's share of this rank's sum of squares
/// launched as soon as it is reduced (on one rank, where nothing runs beside them, all at once
/// after the reductions), and returns the global gradient norm (the bits of `finish_grad_sync`
/// then [`global_grad_norm`]). Public so that a benchmark can time it, and for a driver that
/// wants the norm before it steps.
///
/// The reductions complete one bucket group at a time
/// (`StepProtocol::grad_sync_order`: those in flight in launch order, then those
/// launched now); only the last group's pieces are summed after the last reduction (one wait
/// for the device for all of them).
///
/// # Errors
/// As `finish_grad_sync` and [`global_grad_norm`]; after an error no reduction is left in
/// flight.
pub fn finish_grad_sync_and_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<f32> {
    let local = staged_local_sum_squares(dev, comm, bufs, opt);
    // After an error (a launch's non-finite check, a sum, a completion) leave no reduction in
    // flight behind it either (the next `begin` would refuse). The first error is the one
    // reported.
    if !bufs.grad_reduce_in_flight().is_empty() {
        let finished = bufs.finish_grad_sync(dev, comm);
        if local.is_ok() {
            finished?;
        }
    }
    norm_from_local(dev, comm, bufs, local?)
}

/// This rank's sum of squares with the reductions completed in stages: every reduction that can
/// is launched first (so that none queues behind a sum), stage 0 completes everything outside
/// [`StepProtocol::grad_sync_order`] (with hybrid sharding: everything), stage k the
/// k-th group of that order, and each stage's pieces are widened and summed as soon as it is
/// complete.
fn staged_local_sum_squares(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<f64> {
    bufs.launch_grad_syncs(dev, comm)?;
    if comm.size() == 1 {
        // Nothing runs beside the sums on one rank, so stages would only split one launch
        // into several (the early ones on a quarter of a GPU): the same bits in one.
        bufs.finish_grad_sync(dev, comm)?;
        return local_sum_squares(dev, opt);
    }
    let order = bufs.grad_sync_order();
    bufs.finish_grad_sync_except(dev, comm, &order)?;
    let stages = order.len();
    let pieces = opt.grad_pieces();
    // A piece's stage: 0 if its group is reduced already, else its group's place in the order
    // plus one.
    let stage_of: Vec<usize> = pieces
        .iter()
        .map(|p| {
            let g = bufs.group_of(p.param);
            order.iter().position(|&q| q == g).map_or(0, |i| i + 1)
        })
        .collect();
    let mut done = 0;
    // Completes every stage up to `k` not completed yet, once each, in order.
    let mut complete_through = |d: &mut Device, k: usize| -> Result<()> {
        while done < k.min(stages) {
            done += 1;
            bufs.finish_grad_sync_except(d, comm, &order[done..])?;
        }
        Ok(())
    };
    let sums = widened_sums(dev, &pieces, &stage_of, &mut complete_through)?;
    complete_through(dev, stages)?;
    Ok(opt.fold_sum_squares(&sums))
}

/// This rank's sum of squares of `opt`'s gradient pieces, every reduction complete: each piece
/// widened to its fp32 copy (nothing to do when the gradient is fp32 and used in place) and
/// summed in `Device::sum_squares`' blocked order, the sums folded by
/// [`Optimizer::fold_sum_squares`]: the same bits on every backend.
///
/// # Errors
/// Device errors.
pub fn local_sum_squares(dev: &mut Device, opt: &dyn Optimizer) -> Result<f64> {
    let pieces = opt.grad_pieces();
    let stages = vec![0; pieces.len()];
    let sums = widened_sums(dev, &pieces, &stages, |_, _| Ok(()))?;
    Ok(opt.fold_sum_squares(&sums))
}

/// The per-piece sums of squares of `pieces` in the stages `stage_of`: for each stage present,
/// in order, `complete(dev, k)` makes stage `k` final, its pieces are widened and their sums
/// launched (`Device::sum_squares_each_staged`: no wait for the device until the last stage).
/// The sums are per piece, so their bits do not depend on the stages.
fn widened_sums(
    dev: &mut Device,
    pieces: &[GradPiece],
    stage_of: &[usize],
    mut complete: impl FnMut(&mut Device, usize) -> Result<()>,
) -> Result<Vec<f64>> {
    let views: Vec<View> = pieces.iter().map(|p| p.grad32).collect();
    dev.sum_squares_each_staged(&views, stage_of, |d, k| {
        complete(d, k)?;
        for (p, &s) in pieces.iter().zip(stage_of) {
            if s == k && p.grad32 != p.grad {
                d.cast(p.grad, p.grad32)?;
            }
        }
        Ok::<(), OptimError>(())
    })
}

/// The global gradient norm of `opt`'s shards over every rank, every reduction complete, as
/// [`step`] computes it (public so that a benchmark can time it apart from the update).
///
/// # Errors
/// Collective and device errors.
pub fn global_grad_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<f32> {
    let local = local_sum_squares(dev, opt)?;
    norm_from_local(dev, comm, bufs, local)
}

/// The global gradient norm from this rank's sum of squares: the ranks' sums added in rank
/// order (and the replicas' where they own different pieces).
fn norm_from_local(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    local: f64,
) -> Result<f32> {
    let mut total = if bufs.plan().is_sharded() {
        sum_across_ranks(dev, comm, local)?
    } else {
        local
    };
    // HFSDP: replicas own different pieces; their sums add (replica order).
    if bufs.optimizer_sharded_across_replicas()
        && let Some(replicas) = bufs.replica_group()
    {
        total = sum_across_ranks(dev, replicas, total)?;
    }
    Ok(total.sqrt() as f32)
}

/// A forced parameter sync (eval, checkpoint save or load, after a state import): completes
/// gathers in flight, zeroes the gradients, rewrites every owner's weights from its masters
/// (staged `bf16(master)`, or the rounded masters for persistent storage) and gathers every
/// group now. Right after a normal step it leaves every weight bitwise unchanged. Gradients are
/// destroyed, so call it between steps.
///
/// # Errors
/// Buffer, collective and device errors.
pub fn force_param_sync(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<()> {
    bufs.complete_param_sync(dev)?;
    bufs.release_units(dev)?;
    bufs.zero_grad_buffer(dev)?;
    // Every group is gathered again, persistent ones included (they were rewritten from the
    // masters by `stage`).
    bufs.reset_param_sync()?;
    stage(dev, comm, bufs, opt, false)?;
    bufs.sync_params(dev, comm)?;
    Ok(())
}

/// Adds one f64 per rank in rank order: the values travel as bytes (an all-gather), so the sum
/// is the same on every rank and independent of timing (the global norm's exchange; public so
/// that a benchmark can time it alone).
///
/// # Errors
/// Collective and device errors.
pub fn sum_across_ranks(dev: &mut Device, comm: &mut dyn Communicator, local: f64) -> Result<f64> {
    let n = comm.size();
    let buf = dev.alloc(DType::U8, 8 * n);
    let mine = buf.slice(8 * comm.rank()..8 * (comm.rank() + 1))?;
    dev.write_bytes(mine, &local.to_le_bytes())?;
    let result = comm
        .start_all_gather(dev, mine, buf)
        .and_then(|w| w.wait(dev));
    let bytes = dev.read_bytes(buf);
    dev.free(buf)?;
    result?;
    Ok(bytes?
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
        .sum())
}

#[cfg(test)]
mod tests {
    use lowbit_device::{Device, View};
    use lowbit_optim::GradPiece;

    use super::widened_sums;

    fn upload(dev: &mut Device, v: &[f32]) -> View {
        let view = dev.alloc(lowbit_device::DType::F32, v.len());
        dev.upload(view, v).unwrap();
        view
    }

    /// The pieces' sums do not depend on the stages, and each stage completes before its
    /// pieces are read: piece 0 is still being reduced in stage 2 and piece 3 in stage 3 (they
    /// hold garbage until then); pieces 1 and 2 are final. Folded in piece order, 2^53 + 1 + 1
    /// is 2^53 (each +1 rounds away), 2^53 + 2 if the two early pieces were added first.
    #[test]
    fn the_staged_sums_complete_each_stage_first_and_fold_in_piece_order() {
        let mut dev = Device::cpu();
        let big = 2f32.powi(26);
        let views = [
            upload(&mut dev, &[big, big]),
            upload(&mut dev, &[1.0]),
            upload(&mut dev, &[1.0]),
            upload(&mut dev, &[3.0]),
        ];
        let pieces: Vec<GradPiece> = views
            .iter()
            .enumerate()
            .map(|(param, &v)| GradPiece {
                param,
                grad: v,
                grad32: v,
            })
            .collect();
        let plain = widened_sums(&mut dev, &pieces, &[0; 4], |_, _| Ok(())).unwrap();
        let fold = |s: &[f64]| s.iter().fold(0.0, |a, b| a + b);
        assert_eq!(fold(&plain), 2f64.powi(53) + 9.0);
        let real = [vec![big, big], vec![3.0]];
        dev.upload(views[0], &[7.0f32, 7.0]).unwrap();
        dev.upload(views[3], &[f32::NAN]).unwrap();
        let mut completed = Vec::new();
        let split = widened_sums(&mut dev, &pieces, &[2, 0, 0, 3], |d, k| {
            completed.push(k);
            match k {
                2 => d.upload(views[0], &real[0])?,
                3 => d.upload(views[3], &real[1])?,
                _ => {}
            }
            Ok(())
        })
        .unwrap();
        assert_eq!(completed, [0, 2, 3]);
        assert_eq!(fold(&split).to_bits(), fold(&plain).to_bits());
        assert_eq!(split, plain);
    }
}
