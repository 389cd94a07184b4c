//! [`Trainer`]: the training-step protocol as types. An [`Iteration`] exists only between
//! `begin` and the gradient sync; only a completed sync ([`GradsReady`], or `Iteration::step`,
//! which completes it first) can step; evals and forced syncs need the trainer back, i.e. no
//! iteration open. So the orders behind Megatron's staging bugs (step before the reduction
//! finished, a forward on weights the optimizer moved, an eval inside an iteration) do not
//! compile, and what the types cannot say is checked at run time in every build
//! ([`lowbit_buffers::ProtocolError`]). Zeroing after staging, the order behind bug A3, is
//! harmless by construction: zeroing keeps staged bytes.
//!
//! ```text
//! let mut it = trainer.begin(dev, comm)?;            // stage stale owners, first gather, zero grads
//! for m in 0..microbatches {
//!     let mut hooks = it.microbatch(comm, m + 1 == microbatches);
//!     model.forward_backward(dev, &mut hooks, …)?;   // lazy gathers, grad-ready reductions
//! }
//! let report = it.step(dev, comm)?;                  // = it.finish_grad_sync(..)?.step(..)
//! ```

use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    ComputeFormat, DataParallelBuffers, DpHooks, HookMode, HookScratch, PrecisionPolicy,
    ProtocolError,
};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{InvalidInput, Optimizer, Result, StepReport};

use crate::protocol;

/// The buffers, the optimizer and the precision policy of one rank, driven in protocol order.
#[derive(Debug)]
pub struct Trainer {
    bufs: DataParallelBuffers,
    opt: Box<dyn Optimizer>,
    policy: PrecisionPolicy,
    scratch: HookScratch,
    skipped: u64,
}

impl Trainer {
    /// A trainer over `bufs` (initialized) with `opt` (covering every parameter's owner) and
    /// `policy` (one entry per parameter; low-precision parameters are not used as stored).
    ///
    /// # Errors
    /// [`InvalidInput::Unowned`] for a parameter no optimizer updates; an invalid policy.
    pub fn new(
        dev: &mut Device,
        bufs: DataParallelBuffers,
        opt: Box<dyn Optimizer>,
        policy: PrecisionPolicy,
    ) -> Result<Self> {
        let owners = opt.owners();
        if let Some(s) = bufs.specs().iter().find(|s| !owners.contains(&s.owner())) {
            return Err(InvalidInput::Unowned {
                name: s.name.clone(),
                owner: s.owner(),
            }
            .into());
        }
        policy.validate(bufs.specs())?;
        for p in 0..bufs.specs().len() {
            check_policy_fits_storage(&bufs, p, policy.get(p).format)?;
        }
        let scratch = HookScratch::new(dev, &bufs);
        Ok(Trainer {
            bufs,
            opt,
            policy,
            scratch,
            skipped: 0,
        })
    }

    /// Starts an iteration: stages the owners whose weights are stale, starts the first gather
    /// (overlapped gathers), zeroes the gradients.
    ///
    /// # Errors
    /// As [`protocol::begin_iteration`].
    pub fn begin<'t>(
        &'t mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<Iteration<'t>> {
        protocol::begin_iteration(dev, comm, &mut self.bufs, self.opt.as_ref())?;
        Ok(Iteration {
            trainer: self,
            last_seen: false,
        })
    }

    /// A forced parameter sync between steps (see [`protocol::force_param_sync`]).
    ///
    /// # Errors
    /// As [`protocol::force_param_sync`].
    pub fn force_param_sync(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<()> {
        protocol::force_param_sync(dev, comm, &mut self.bufs, self.opt.as_ref())
    }

    /// Hooks for an evaluation after a forced sync: the forward reads the weights of the last
    /// step; gradients go to scratch and nothing is reported.
    ///
    /// # Errors
    /// As [`protocol::force_param_sync`].
    pub fn eval<'a>(
        &'a mut self,
        dev: &mut Device,
        comm: &'a mut dyn Communicator,
    ) -> Result<DpHooks<'a>> {
        self.force_param_sync(dev, comm)?;
        Ok(DpHooks::new(
            &mut self.bufs,
            comm,
            &self.policy,
            &self.scratch,
            HookMode::Eval,
        ))
    }

    /// The buffers.
    pub fn buffers(&self) -> &DataParallelBuffers {
        &self.bufs
    }
    /// The optimizer.
    pub fn optimizer(&self) -> &dyn Optimizer {
        self.opt.as_ref()
    }
    /// The optimizer, mutably (learning-rate schedules, state import).
    pub fn optimizer_mut(&mut self) -> &mut dyn Optimizer {
        self.opt.as_mut()
    }
    /// The buffers and the optimizer together, the optimizer mutably: what a checkpoint load
    /// fills (the forced parameter sync after it is the trainer's:
    /// [`Trainer::load_checkpoint`]).
    pub fn parts_mut(&mut self) -> (&DataParallelBuffers, &mut dyn Optimizer) {
        (&self.bufs, self.opt.as_mut())
    }

    /// Loads `ckpt`'s optimizer state (resharded to this rank's plan) into the optimizer, then
    /// forces a parameter sync (collective), so every weight is `Q(bf16(master))` of the loaded
    /// masters.
    ///
    /// # Errors
    /// As `Checkpoint::load_optimizer_with`; buffer and collective errors of the sync.
    pub fn load_checkpoint(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        ckpt: &lowbit_ckpt::Checkpoint,
        options: &lowbit_ckpt::LoadOptions,
    ) -> std::result::Result<(), lowbit_ckpt::CkptError> {
        ckpt.load_optimizer_with(dev, self.bufs.specs(), self.opt.as_mut(), options)?;
        self.force_param_sync(dev, comm)?;
        Ok(())
    }

    /// One whole training step, the order of the protocol in one place. `forward_backward(dev,
    /// hooks, m)` runs microbatch `m` of `microbatches` through the hooks.
    ///
    /// # Errors
    /// The closure's errors; as [`Trainer::begin`] and [`Iteration::step`].
    pub fn train_step<E: From<lowbit_optim::OptimError>>(
        &mut self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
        microbatches: usize,
        mut forward_backward: impl FnMut(
            &mut Device,
            &mut DpHooks<'_>,
            usize,
        ) -> std::result::Result<(), E>,
    ) -> std::result::Result<StepReport, E> {
        // Reset the iteration, stage the owners the last step left stale (the first gather
        // starts where gathers overlap the forward), zero the gradients beside it.
        let mut it = self.begin(dev, comm)?;
        // Forward and backward: each group's gather completes in its forward pre-hook; the
        // last microbatch's grad-ready hooks launch the reductions.
        for m in 0..microbatches {
            let mut hooks = it.microbatch(comm, m + 1 == microbatches);
            forward_backward(dev, &mut hooks, m)?;
        }
        // Reductions completed group by group, each group's share of the norm launched as
        // soon as it is reduced; clip or skip; per group: update, stage, gather.
        Ok(it.step(dev, comm)?)
    }

    /// Steps skipped because the gradient norm was not finite.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }
    /// Changes the gradient communication dtype for the next iterations (the mixed-precision
    /// policy may change between iterations; see
    /// [`StepProtocol::set_grad_comm_dtype`]).
    ///
    /// # Errors
    /// A reduction still in flight.
    pub fn set_grad_comm_dtype(
        &mut self,
        dtype: Option<lowbit_buffers::layout::GradDType>,
    ) -> Result<()> {
        Ok(self.bufs.set_grad_comm_dtype(dtype)?)
    }
    /// The precision policy.
    pub fn policy(&self) -> &PrecisionPolicy {
        &self.policy
    }

    /// Frees the hooks' scratch and returns the parts.
    ///
    /// # Errors
    /// Device errors.
    pub fn into_parts(self, dev: &mut Device) -> Result<(DataParallelBuffers, Box<dyn Optimizer>)> {
        self.scratch.free(dev)?;
        Ok((self.bufs, self.opt))
    }
}

/// Low-precision primary weights are computed with in their own recipe (the storage says
/// which: `StorageKind::compute_format`), so a policy naming another recipe (or "as stored")
/// would silently compute with something else.
fn check_policy_fits_storage(
    bufs: &DataParallelBuffers,
    p: usize,
    format: ComputeFormat,
) -> Result<()> {
    let kind = bufs.storage_kind(p);
    match kind.compute_format() {
        Some(want) if want != format => {
            let name = &bufs.specs()[p].name;
            let msg = format!(
                "`{name}` is stored as {kind:?}, so it is computed with as {want:?}, not {format:?}"
            );
            Err(lowbit_buffers::BufferError::from(lowbit_buffers::ConfigError::Policy(msg)).into())
        }
        _ => Ok(()),
    }
}

/// An open iteration: gradients zeroed, stale owners staged; microbatches run through it.
#[derive(Debug)]
pub struct Iteration<'t> {
    trainer: &'t mut Trainer,
    last_seen: bool,
}

impl<'t> Iteration<'t> {
    /// Hooks for one microbatch; `last` marks the last microbatch of the step (only then do
    /// gradients become ready for reduction).
    pub fn microbatch<'s>(&'s mut self, comm: &'s mut dyn Communicator, last: bool) -> DpHooks<'s> {
        self.last_seen |= last;
        let t = &mut *self.trainer;
        t.bufs.set_last_microbatch(last);
        DpHooks::new(&mut t.bufs, comm, &t.policy, &t.scratch, HookMode::Train)
    }

    /// The buffers (read-only).
    pub fn buffers(&self) -> &DataParallelBuffers {
        &self.trainer.bufs
    }

    /// Completes every gradient reduction.
    ///
    /// # Errors
    /// [`ProtocolError::NoLastMicrobatch`] if no microbatch was marked last (overlapped
    /// reductions wait for the last microbatch's readiness); buffer errors.
    pub fn finish_grad_sync(
        self,
        dev: &mut Device,
        comm: &mut dyn Communicator,
    ) -> Result<GradsReady<'t>> {
        if !self.last_seen {
            return Err(lowbit_buffers::BufferError::from(ProtocolError::NoLastMicrobatch).into());
        }
        self.trainer.bufs.finish_grad_sync(dev, comm)?;
        Ok(GradsReady {
            trainer: self.trainer,
        })
    }

    /// Completes every gradient reduction and steps, with the same bits as
    /// `finish_grad_sync(..)?.step(..)` but faster where reductions overlap the backward: each
    /// group's share of the gradient norm runs as soon as its reduction completes, beside the
    /// reductions still in flight (see
    /// [`protocol::finish_grad_sync_and_step`]).
    ///
    /// # Errors
    /// As [`Iteration::finish_grad_sync`] and [`GradsReady::step`].
    pub fn step(self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<StepReport> {
        if !self.last_seen {
            return Err(lowbit_buffers::BufferError::from(ProtocolError::NoLastMicrobatch).into());
        }
        let t = self.trainer;
        let report = protocol::finish_grad_sync_and_step(dev, comm, &mut t.bufs, t.opt.as_mut())?;
        if report.skipped {
            t.skipped += 1;
        }
        Ok(report)
    }
}

/// Gradients reduced: the state from which the optimizer steps (`Iteration::step` passes
/// through it in one call).
#[derive(Debug)]
pub struct GradsReady<'t> {
    trainer: &'t mut Trainer,
}

impl GradsReady<'_> {
    /// The buffers, with the reduced gradients of this rank's shards.
    pub fn buffers(&self) -> &DataParallelBuffers {
        &self.trainer.bufs
    }

    /// One optimizer step (see [`protocol::step`]).
    ///
    /// # Errors
    /// As [`protocol::step`].
    pub fn step(self, dev: &mut Device, comm: &mut dyn Communicator) -> Result<StepReport> {
        let t = self.trainer;
        let report = protocol::step(dev, comm, &mut t.bufs, t.opt.as_mut())?;
        if report.skipped {
            t.skipped += 1;
        }
        Ok(report)
    }
}
