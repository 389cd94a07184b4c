//! The training-step driver of lowbit: the one place that decides the order of a step and
//! when collectives run.
//!
//! # Purpose
//! A downstream trainer holds its model, a [`Trainer`] (the buffers, the optimizer and the
//! precision policy of one rank) and a communicator, and calls per step:
//!
//! ```text
//! let mut it = trainer.begin(dev, comm)?;            // stage stale owners, first gather, zero grads
//! for m in 0..microbatches {
//!     let mut hooks = it.microbatch(comm, m + 1 == microbatches);
//!     model.forward_backward(dev, &mut hooks, …)?;   // gathers complete in the pre-hooks,
//! }                                                  // grad-ready hooks launch reductions
//! let report = it.step(dev, comm)?;                  // reductions, norm, clip/skip, update,
//!                                                    // stage and gather per bucket group
//! ```
//!
//! or [`Trainer::train_step`], which is exactly that. [`protocol`] has the same steps as
//! functions for callers that drive the buffers themselves. Around the step: [`launch`] makes
//! the ranks (threads, local GPUs, or a launcher's processes, its variables parsed strictly),
//! [`schedule`] has the learning-rate schedule and the clip coefficient, and [`fsdp`] turns a
//! sharding strategy and a mixed-precision policy into the buffers' configuration.
//!
//! # Invariants
//! - **The step order lives here.** Optimizers (`lowbit-optim`) update the pieces they own and
//!   never see a communicator; the buffers (`lowbit-buffers`) stage and gather when the driver
//!   says and never call back into an optimizer. The driver marks an owner's weights stale
//!   before its update and stages them before any gather, so a bucket group is never gathered
//!   before its owner updated it (Megatron bug class D).
//! - **Wrong orders do not compile, or fail in every build**: an [`Iteration`] exists only
//!   between `begin` and the gradient sync; only a completed sync ([`GradsReady`], or
//!   `Iteration::step`) can step; evals and forced syncs need the trainer back. What the types
//!   cannot say the buffers check at run time (`lowbit_buffers::ProtocolError`).
//! - **The gradient norm does not depend on thread timing or staging**: per-piece f64 sums in
//!   `Device::sum_squares`' blocked order, folded in the optimizer's fixed order; the ranks
//!   exchange those as bytes and add them in rank order ([`protocol::sum_across_ranks`]).
//! - **A skipped step changes nothing**: masters, moments, step counts and parameter storage
//!   are left bitwise as they were, and the skip is counted.
//! - **Overlap changes timing, never bits**: pipelined per-group updates, the norm beside the
//!   reductions and gathers in flight across the step boundary give the bits of the plain
//!   order.
//!
//! # Non-goals
//! Model code (it comes to the driver through `lowbit_buffers::Hooks`), optimizer math
//! (`lowbit-optim`), checkpoint files (`lowbit-ckpt`; the driver loads one into its optimizer
//! and forces the sync: [`Trainer::load_checkpoint`]), tensor/expert parallel groups, elastic
//! worlds.

mod driver;
pub mod fsdp;
pub mod launch;
pub mod protocol;
pub mod schedule;

pub use driver::{GradsReady, Iteration, Trainer};
pub use lowbit_optim::StepReport;
