//! The driver-facing half of [`DataParallelBuffers`]: [`StepProtocol`], the calls that order one
//! training step (zero and reset an iteration, register ready gradients and reduce them, stage
//! the optimizers' new weights, gather parameters, release FSDP units) and the probes of the
//! per-group state those calls check.
//!
//! A model never needs these: it reads parameters and writes gradients through [`crate::Hooks`]
//! ([`crate::DpHooks`]) and sees the buffers' inherent methods (construction, plan, views,
//! shards, memory). The step driver (`lowbit-train`), and tests or benchmarks that drive the
//! protocol by hand, bring the trait into scope with `use lowbit_buffers::protocol::StepProtocol;`.
//! The methods keep their rules whichever way they are called: a call out of order is a
//! [`ProtocolError`], never a silent reordering.
//!
//! A trait rather than a view type so that every existing call site reads the same
//! (`bufs.stage(..)`) and only gains an import; it is implemented for [`DataParallelBuffers`]
//! alone and is not meant to be implemented elsewhere.

use lowbit_comm::Communicator;
use lowbit_device::{Device, View};
use lowbit_layout::OptimizerId;

use crate::error::Result;
#[cfg(doc)]
use crate::error::{BufferError, ConfigError, ProtocolError};
use crate::{DataParallelBuffers, ParamSyncState, StagePiece, Usage, WeightState};

/// The step driver's calls on [`DataParallelBuffers`]; see the [module documentation](self).
pub trait StepProtocol {
    // Iterations, gradient accumulation and reduction.
    /// Marks whether the coming backward is the last microbatch of the step (Megatron's
    /// `no_sync`): only then do whole gradients become ready for reduction. Call it before
    /// every microbatch (the step driver does): where gradients are sharded it is also the
    /// microbatch boundary, at which the previous microbatch's unreduced gradients are reduced.
    fn set_last_microbatch(&mut self, last: bool);

    /// Zeroes every gradient buffer and resets the per-iteration grad-sync state. The first call
    /// after the first batch freezes that batch's ready counts as the golden counts.
    ///
    /// Staged weights survive it. Where a staging view aliases the gradients (MXFP8 staged
    /// through bf16), the bytes under the staging view of every [`WeightState::Staged`] group
    /// are left as they are: that group's gather ships them and its completion zeroes them, and
    /// no backward can write gradients before that (a backward needs every low-precision group
    /// current: bug A2). So zeroing after staging cannot make a deferred gather ship zeros
    /// (Megatron bug A3), and an iteration can stage first, then start the first gather and
    /// zero the rest of the gradients while it runs ([`Self::reset_iteration`], stage, then
    /// [`Self::zero_grads`]). For the same
    /// reason a parameter gather in flight is allowed here: it reads and writes only such bytes
    /// or a parameter region apart from the gradients, and it counts as the coming iteration's
    /// gather of its group. Gradient reductions and unit gathers in flight are refused
    /// ([`ProtocolError::CollectiveInFlight`]).
    fn zero_grad_buffer(&mut self, dev: &mut Device) -> Result<()>;

    /// The first half of [`Self::zero_grad_buffer`], for a driver that stages between the two
    /// halves (stage, start the first gather, then zero while it runs): refuses collectives in
    /// flight that zeroing would race ([`ProtocolError::CollectiveInFlight`], before anything
    /// is touched), frees leftover transient buckets and resets the iteration's counts. Follow
    /// it with [`Self::zero_grads`].
    ///
    /// # Errors
    /// [`ProtocolError::CollectiveInFlight`], device errors.
    fn reset_iteration(&mut self, dev: &mut Device) -> Result<()>;

    /// The second half of [`Self::zero_grad_buffer`] (after [`Self::reset_iteration`]): zeroes
    /// every gradient byte but the staging views of staged groups.
    ///
    /// # Errors
    /// Device errors.
    fn zero_grads(&self, dev: &mut Device) -> Result<()>;

    /// The gradient view of `p` for accumulation in the backward. The first call after
    /// `zero_grad_buffer` checks that every low-precision group is gathered (bug A2) and, with
    /// [`Verify::Full`](crate::Verify::Full), that the gradient buffers are zero. Where gradients are sharded the
    /// view is `p`'s slice of its group's transient bucket for this microbatch.
    fn accumulation_view(&mut self, dev: &mut Device, p: usize) -> Result<View>;

    /// Reduces the gradients the last microbatch left where gradients are sharded, once per
    /// microbatch boundary (announced by [`Self::set_last_microbatch`]); the hooks call it
    /// before anything else of a microbatch.
    fn begin_microbatch(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()>;

    /// Called from the backward hook when parameter `p`'s gradient is complete for this
    /// microbatch. A group's reduction starts once all of its parameters reported as often as
    /// in the first batch, on the last microbatch of a step after the first; where gradients
    /// are sharded, in every microbatch once all of them reported.
    fn register_grad_ready(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        p: usize,
    ) -> Result<()>;

    /// Launches every reduction that [`Self::finish_grad_sync`] would launch and that needs no
    /// memory of its own (it runs in place on the gradient buffer, or on the bucket it filled
    /// already), without completing it: a completion in stages
    /// ([`Self::grad_sync_order`], [`Self::finish_grad_sync_except`]) then finds them all in
    /// flight, queued on the communicator's stream ahead of whatever follows each completion
    /// on the device's. A reduction into a transient bucket (another wire dtype) is left to
    /// its completion, so that at most one such bucket lives at a time, as in
    /// `finish_grad_sync`; so is everything with hybrid sharding, and a group whose overlapped
    /// reduction should have been launched by the backward (`finish_grad_sync` refuses it).
    ///
    /// # Errors
    /// Those of `finish_grad_sync`'s launches; a parameter gather in flight is refused.
    fn launch_grad_syncs(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()>;

    /// Completes every group's gradient reduction (launching those not started yet) and re-arms
    /// the next forward's parameter gather. Idempotent within an iteration.
    fn finish_grad_sync(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()>;

    /// The bucket groups whose reductions [`Self::finish_grad_sync`] has still to complete, in
    /// the order to complete them for work that follows each (the gradient norm, group by
    /// group): those in flight in launch order, then those not launched yet in group order
    /// (launched when completed). Empty where hybrid sharding reduces across replicas: that
    /// reduction runs once over every group, so [`Self::finish_grad_sync_except`] of an empty
    /// list completes everything there.
    fn grad_sync_order(&self) -> Vec<usize>;

    /// [`Self::finish_grad_sync`] except for the groups `except`: completes (launching first
    /// where needed) every other group's reduction, in group order. Call it with a shorter
    /// `except` to complete more (e.g. the tail of [`Self::grad_sync_order`] one group shorter
    /// at a time), and [`Self::finish_grad_sync`] at the end, before anything else. With hybrid
    /// sharding the groups left out are completed too where any other group is (the reduction
    /// across replicas takes every group at once).
    fn finish_grad_sync_except(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        except: &[usize],
    ) -> Result<()>;

    /// The bucket groups whose gradient reduction is in flight, in launch order (for tests and
    /// diagnostics of the overlap).
    fn grad_reduce_in_flight(&self) -> Vec<usize>;

    // Parameter gathers.
    /// Gathers every group that needs it now and completes those in flight (the
    /// non-overlapped path after the optimizer step, and forced syncs). Low-precision groups
    /// must be `Current` or `Staged`; a `Stale` one is an error.
    ///
    /// Every gather is launched before any is completed: a launch orders the collective after
    /// the work already queued on the device's stream, so a gather launched after the previous
    /// group's completion (re-quantization) would wait for it; launched first, the gathers run
    /// back to back and each group's re-quantization runs beside the later gathers. Each
    /// gather writes only its own group's region, which no completion of another group reads
    /// or writes.
    fn sync_params(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()>;

    /// Waits for every gather in flight and completes it. The completions' host values
    /// (NVFP4's amaxes) are read once at the end, also when a completion fails (the groups
    /// after it stay in flight, for the next call).
    fn complete_param_sync(&mut self, dev: &mut Device) -> Result<()>;

    /// The forward pre-hook of the layers whose parameters are in group `g`: refuses stale
    /// weights; with overlapped gather, dispatches the group's gather if nobody has, waits for
    /// it, completes it and prefetches the next group's (groups were created in backward order,
    /// so forward order runs down).
    fn finish_param_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()>;

    /// The bucket groups whose parameter gather is in flight (for tests and diagnostics: after
    /// the pre-forward hook of group `g`, the prefetch is group `g - 1`).
    fn param_gathers_in_flight(&self) -> Vec<usize>;

    /// Resets every group's gather state to idle (after staging new values); refuses while a
    /// gather is in flight.
    fn reset_param_sync(&mut self) -> Result<()>;

    // Group-by-group staging and gathers (an optimizer that updates group by group).
    /// The bucket groups of `owner` in the order a pipelined step updates, stages and gathers
    /// them (per buffer, increasing element offset), or `None` where the step is not pipelined:
    /// hybrid sharding, sharded parameters (gathered per use), nothing gathered, or fewer than
    /// two groups. Tile-scaled weights are staged group by group too (one MAX-reduction of the
    /// group's tile amaxes each). The same on every rank: it depends on the plan only.
    fn pipeline_groups(&self, owner: OptimizerId) -> Option<Vec<usize>>;

    /// Stages bucket group `g` of `owner` from `pieces` (this rank's owned pieces of the group's
    /// parameters with their new master values; pieces of persistent weights, which the update
    /// wrote itself, are ignored) and launches the group's parameter gather, asynchronously:
    /// [`Self::stage`] and the gather of [`Self::sync_params`] for one group of a pipelined
    /// step, in the order of [`Self::pipeline_groups`] (which must have returned `g`). The
    /// group's low-precision weights become `Staged` and its gather is in flight; the next
    /// `sync_params` or `complete_param_sync`, or the group's forward pre-hook, completes it.
    ///
    /// # Errors
    /// `Pipeline` for a group that is not `owner`'s or cannot be pipelined, or a piece outside
    /// the group; `GatherInFlight` if the group's gather is in flight; buffer, collective and
    /// device errors.
    fn stage_and_gather_group(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        g: usize,
        pieces: &[StagePiece],
    ) -> Result<()>;

    // Staging new weights from the optimizers' masters.
    /// Stages `owner`'s new weights from its masters: `pieces` are this rank's owned pieces of
    /// `owner`'s low-precision parameters (others are ignored). Afterwards every low-precision
    /// group of `owner` is [`WeightState::Staged`] with its gather re-armed, so the next
    /// forward (or sync) gathers it exactly once. Collective (tile amaxes are MAX-reduced
    /// across ranks): every rank calls it for the same owner. Refuses while a gather of such a
    /// group is in flight.
    ///
    /// With overlapped gathers, the first group in forward order may have its gather started
    /// here as soon as it is staged (see `early_gather`): it is then in flight when this
    /// returns, and the forward's pre-hook completes it.
    fn stage(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        pieces: &[StagePiece],
    ) -> Result<()>;

    /// Marks the low-precision groups of `owner` stale: its masters moved.
    fn mark_stale(&mut self, owner: OptimizerId);

    /// Whether any low-precision group of `owner` is stale.
    fn has_stale(&self, owner: OptimizerId) -> bool;

    // FSDP units (parameters gathered whole for compute and released after).
    /// The pre-hook of a parameter of group `g` used for `usage`: a sharded-parameter unit is
    /// gathered (or its prefetch awaited), every other unit but the next one is released, and
    /// the next one is prefetched; other groups go through [`Self::finish_param_sync`].
    fn prepare_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        usage: Usage,
    ) -> Result<()>;

    /// Releases every gathered unit (waiting for gathers in flight).
    fn release_units(&mut self, dev: &mut Device) -> Result<()>;

    /// The units gathered now (for tests and diagnostics: at most the one in use and the
    /// prefetched one).
    fn gathered_units(&self) -> Vec<usize>;

    /// The copies unit `g` holds now: (rowwise, columnwise) of a low-precision unit (for tests
    /// of fine-grained gathers).
    fn unit_copies(&self, g: usize) -> (bool, bool);

    // Gradient wire format, replica groups and the per-group state the step checks.
    /// HFSDP: whether ranks of different replica groups own different pieces (the gradient
    /// norm then sums over the replica group too: [`Self::replica_group`]).
    fn optimizer_sharded_across_replicas(&self) -> bool;

    /// The replica group of hybrid sharding, if any.
    fn replica_group(&mut self) -> Option<&mut dyn Communicator>;

    /// Changes the dtype gradients are reduced in (`grad_comm_dtype`; `None`: the gradients'
    /// own) between iterations: the policy may change, the buffers do not.
    ///
    /// # Errors
    /// [`ProtocolError::CollectiveInFlight`] while a reduction is in flight or gradients of an
    /// unfinished iteration wait in a communication bucket.
    fn set_grad_comm_dtype(&mut self, dtype: Option<lowbit_layout::GradDType>) -> Result<()>;

    /// The param-gather state of bucket group `g`.
    fn param_sync_state(&self, g: usize) -> ParamSyncState;

    /// The low-precision weight state of group `g`.
    fn weight_state(&self, g: usize) -> WeightState;
}

impl StepProtocol for DataParallelBuffers {
    // Iterations, gradient accumulation and reduction.
    fn set_last_microbatch(&mut self, last: bool) {
        DataParallelBuffers::set_last_microbatch(self, last)
    }
    fn zero_grad_buffer(&mut self, dev: &mut Device) -> Result<()> {
        DataParallelBuffers::zero_grad_buffer(self, dev)
    }
    fn reset_iteration(&mut self, dev: &mut Device) -> Result<()> {
        DataParallelBuffers::reset_iteration(self, dev)
    }
    fn zero_grads(&self, dev: &mut Device) -> Result<()> {
        DataParallelBuffers::zero_grads(self, dev)
    }
    fn accumulation_view(&mut self, dev: &mut Device, p: usize) -> Result<View> {
        DataParallelBuffers::accumulation_view(self, dev, p)
    }
    fn begin_microbatch(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()> {
        DataParallelBuffers::begin_microbatch(self, dev, comm)
    }
    fn register_grad_ready(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        p: usize,
    ) -> Result<()> {
        DataParallelBuffers::register_grad_ready(self, dev, comm, p)
    }
    fn launch_grad_syncs(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()> {
        DataParallelBuffers::launch_grad_syncs(self, dev, comm)
    }
    fn finish_grad_sync(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()> {
        DataParallelBuffers::finish_grad_sync(self, dev, comm)
    }
    fn grad_sync_order(&self) -> Vec<usize> {
        DataParallelBuffers::grad_sync_order(self)
    }
    fn finish_grad_sync_except(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        except: &[usize],
    ) -> Result<()> {
        DataParallelBuffers::finish_grad_sync_except(self, dev, comm, except)
    }
    fn grad_reduce_in_flight(&self) -> Vec<usize> {
        DataParallelBuffers::grad_reduce_in_flight(self)
    }

    // Parameter gathers.
    fn sync_params(&mut self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<()> {
        DataParallelBuffers::sync_params(self, dev, comm)
    }
    fn complete_param_sync(&mut self, dev: &mut Device) -> Result<()> {
        DataParallelBuffers::complete_param_sync(self, dev)
    }
    fn finish_param_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
    ) -> Result<()> {
        DataParallelBuffers::finish_param_sync(self, dev, comm, g)
    }
    fn param_gathers_in_flight(&self) -> Vec<usize> {
        DataParallelBuffers::param_gathers_in_flight(self)
    }
    fn reset_param_sync(&mut self) -> Result<()> {
        DataParallelBuffers::reset_param_sync(self)
    }

    // Group-by-group staging and gathers (an optimizer that updates group by group).
    fn pipeline_groups(&self, owner: OptimizerId) -> Option<Vec<usize>> {
        DataParallelBuffers::pipeline_groups(self, owner)
    }
    fn stage_and_gather_group(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        g: usize,
        pieces: &[StagePiece],
    ) -> Result<()> {
        DataParallelBuffers::stage_and_gather_group(self, dev, comm, owner, g, pieces)
    }

    // Staging new weights from the optimizers' masters.
    fn stage(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        owner: OptimizerId,
        pieces: &[StagePiece],
    ) -> Result<()> {
        DataParallelBuffers::stage(self, dev, comm, owner, pieces)
    }
    fn mark_stale(&mut self, owner: OptimizerId) {
        DataParallelBuffers::mark_stale(self, owner)
    }
    fn has_stale(&self, owner: OptimizerId) -> bool {
        DataParallelBuffers::has_stale(self, owner)
    }

    // FSDP units (parameters gathered whole for compute and released after).
    fn prepare_params(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        g: usize,
        usage: Usage,
    ) -> Result<()> {
        DataParallelBuffers::prepare_params(self, dev, comm, g, usage)
    }
    fn release_units(&mut self, dev: &mut Device) -> Result<()> {
        DataParallelBuffers::release_units(self, dev)
    }
    fn gathered_units(&self) -> Vec<usize> {
        DataParallelBuffers::gathered_units(self)
    }
    fn unit_copies(&self, g: usize) -> (bool, bool) {
        DataParallelBuffers::unit_copies(self, g)
    }

    // Gradient wire format, replica groups and the per-group state the step checks.
    fn optimizer_sharded_across_replicas(&self) -> bool {
        DataParallelBuffers::optimizer_sharded_across_replicas(self)
    }
    fn replica_group(&mut self) -> Option<&mut dyn Communicator> {
        DataParallelBuffers::replica_group(self)
    }
    fn set_grad_comm_dtype(&mut self, dtype: Option<lowbit_layout::GradDType>) -> Result<()> {
        DataParallelBuffers::set_grad_comm_dtype(self, dtype)
    }
    fn param_sync_state(&self, g: usize) -> ParamSyncState {
        DataParallelBuffers::param_sync_state(self, g)
    }
    fn weight_state(&self, g: usize) -> WeightState {
        DataParallelBuffers::weight_state(self, g)
    }
}
