//! The training-step protocol as three functions, in the only order that works:
//!
//! ```text
//! begin_iteration   stage stale owners, start the first gather (overlap), zero the gradients
//! microbatches      forward/backward through the hooks (lazy gathers, grad-ready reductions)
//! finish_grad_sync  (DataParallelBuffers) complete every reduction
//! step              grad norm, clip, skip, update, stage + gather unless overlapped
//!                   (finish_grad_sync_and_step: both, the norm beside the reductions; an
//!                   optimizer that pipelines updates, stages and launches gathers group by
//!                   group, overlapped or not: Optimizer::apply_and_stage)
//! force_param_sync  (between steps: eval, checkpoint) complete, zero, stage all, gather all
//! ```
//!
//! [`crate::Trainer`] encodes the order as types; these functions are for callers that drive
//! the buffers themselves (tests that probe wrong orders, custom loops).

use lowbit_buffers::DataParallelBuffers;
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device};

use crate::StagedReductions;
use crate::error::Result;
use crate::optimizer::{Optimizer, StepReport};

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
/// Protocol violations (a collective in flight), buffer and device errors.
pub fn begin_iteration(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &dyn Optimizer,
) -> Result<()> {
    bufs.release_units(dev)?;
    bufs.begin_iteration(dev, comm, |d, c, b| opt.stage(d, c, b, true))
}

/// One optimizer step after `finish_grad_sync`: the global gradient norm over every part and
/// rank, clip, skip if not finite (nothing changes then, not even step counts), update, then
/// stage and gather parameters unless the gather is overlapped with the next forward. An
/// optimizer that pipelines ([`Optimizer::pipelines`]) updates, stages and launches the gathers
/// group by group in either mode; with overlapped gathers it leaves them in flight for the
/// forward.
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
/// bucket group at a time (`DataParallelBuffers::grad_sync_order`: those in flight in launch
/// order, then those launched now), and this rank's sum of squares over each group's pieces is
/// launched as soon as that group is reduced, so it runs beside the later reductions; only the
/// last group's pieces are summed after the last reduction (one wait for the device for all of
/// them).
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

/// The first half of [`finish_grad_sync_and_step`]: completes every gradient reduction, each
/// group's share of the sum of squares launched as soon as it is reduced (on one rank, where
/// nothing runs beside them, all at once after the reductions), and returns the global gradient
/// norm (the bits of `finish_grad_sync` then [`global_grad_norm`]). Public so that a
/// benchmark can time it, and for a driver that wants the norm before it steps.
///
/// # Errors
/// As `finish_grad_sync` and [`global_grad_norm`]; after an error no reduction is left in
/// flight.
pub fn finish_grad_sync_and_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
) -> Result<f32> {
    let local = staged_local_sum_squares(dev, comm, bufs, opt);
    // Every stage is complete after `Ok` unless the optimizer broke the trait's contract;
    // after an error (a launch's non-finite check, the optimizer's sum, a completion) leave no
    // reduction in flight behind it either (the next `begin` would refuse). The first error is
    // the one reported.
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
/// [`DataParallelBuffers::grad_sync_order`] (with hybrid sharding: everything), stage k the k-th
/// group of that order, and `opt` sums each stage's pieces as soon as it is complete.
fn staged_local_sum_squares(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
) -> Result<f64> {
    bufs.launch_grad_syncs(dev, comm)?;
    if comm.size() == 1 {
        // Nothing runs beside the sums on one rank, so stages would only split one launch
        // into several (the early ones on a quarter of a GPU): the same bits in one.
        bufs.finish_grad_sync(dev, comm)?;
        return opt.local_sum_squares(dev);
    }
    let order = bufs.grad_sync_order();
    bufs.finish_grad_sync_except(dev, comm, &order)?;
    let stages = order.len();
    // A parameter's stage: 0 if its group is reduced already, else its group's place in the
    // order plus one; one it does not know is taken as final last.
    let stage: Vec<usize> = (0..bufs.specs().len())
        .map(|p| {
            let g = bufs.group_of(p);
            order.iter().position(|&q| q == g).map_or(0, |i| i + 1)
        })
        .collect();
    let stage_of = |p: usize| stage.get(p).copied().unwrap_or(stages);
    let mut complete = |d: &mut Device, k: usize| -> Result<()> {
        bufs.finish_grad_sync_except(d, comm, &order[k.min(stages)..])?;
        Ok(())
    };
    opt.local_sum_squares_overlapped(
        dev,
        &mut StagedReductions::new(stages, &stage_of, &mut complete),
    )
}

/// The rest of [`step`] once the gradient norm is known.
fn step_with_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
    grad_norm: f32,
) -> Result<StepReport> {
    if !grad_norm.is_finite() {
        return Ok(StepReport {
            grad_norm,
            skipped: true,
            clip_coef: 1.0,
        });
    }
    let clip_coef = opt
        .clip_grad()
        .map_or(1.0, |c| (c / (grad_norm + 1e-6)).min(1.0));
    if bufs.config().overlap.param_gather() {
        if opt.pipelines(bufs) {
            // Update, stage and gather group by group: the gathers run beside the update and
            // stay in flight; the forward's pre-hooks complete them (and the next
            // `begin_iteration` finds nothing stale to stage).
            opt.apply_and_stage(dev, comm, bufs, clip_coef)?;
        } else {
            opt.apply(dev, bufs, clip_coef)?;
        }
    } else {
        // Gradients are dead once their group is updated (copied to fp32 or used in place), so
        // the staging views that alias them can be written; every part stages before the one
        // gather of each group. Every owner that stepped is stale; persistent weights were
        // written by the fused update, so they are not cast again (`only_stale`). Where the
        // optimizer pipelines, each group's gather is in flight beside the later groups'
        // update; `sync_params` completes them.
        opt.apply_and_stage(dev, comm, bufs, clip_coef)?;
        bufs.sync_params(dev, comm)?;
    }
    Ok(StepReport {
        grad_norm,
        skipped: false,
        clip_coef,
    })
}

/// The global gradient norm of `opt`'s shards over every rank, as [`step`] computes it (public so
/// that a benchmark can time it apart from the update).
///
/// # Errors
/// Collective and device errors.
pub fn global_grad_norm(
    dev: &mut Device,
    comm: &mut dyn Communicator,
    bufs: &mut DataParallelBuffers,
    opt: &mut dyn Optimizer,
) -> Result<f32> {
    let local = opt.local_sum_squares(dev)?;
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

/// A forced parameter sync (eval, checkpoint save, after a state import): completes gathers in
/// flight, zeroes the gradients, rewrites every owner's weights from its masters (staged
/// `bf16(master)`, or the rounded masters for persistent storage) and gathers every group now. Right after a
/// normal step it leaves every weight bitwise unchanged. Gradients are destroyed, so call it
/// between steps.
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
    opt.stage(dev, comm, bufs, false)?;
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
