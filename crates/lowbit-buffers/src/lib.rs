//! The stateful side of data parallelism: one rank's parameter and gradient buffers laid out by
//! a [`layout::ShardingPlan`], bucket groups, gradient reduction and parameter gathers with
//! overlap on or off, low-precision primary weights, and the model-facing half of the
//! training-step protocol ([`Hooks`], the [`PrecisionPolicy`], [`DpHooks`]).
//!
//! # Purpose
//! A downstream trainer brings its own model code and calls [`Hooks`] for every parameter it
//! reads and gradient it writes. This crate puts the values there: it gathers parameters
//! lazily (MXFP8 staged through bf16, 2D MXFP8 or NVFP4 as bytes, or bf16 as is), dequantizes
//! them for compute, accumulates gradients into flat buffers and reduces them bucket by bucket
//! as they become ready. Optimizers (`lowbit-optim`) read the reduced shards; the step driver
//! (`lowbit-train`) decides the order: it resets and zeroes an iteration, completes the
//! reductions, marks owners stale and stages their new weights (all at once or group by group)
//! and syncs parameters. Nothing here calls back into an optimizer or a driver: the buffers act
//! when told and refuse wrong orders.
//!
//! # Two surfaces: a model uses the inherent methods, the driver uses [`protocol::StepProtocol`]
//! - **A model** (and an optimizer's constructor, a checkpoint) sees [`DataParallelBuffers`]'s
//!   inherent methods: construction ([`DataParallelBuffers::new`],
//!   [`DataParallelBuffers::with_plan`], the replica group), the plan and the specs, parameter
//!   and gradient views, the low-precision weights, owned shards, initialization, memory; and it
//!   reads parameters and writes gradients through [`DpHooks`] ([`Hooks`]).
//! - **The step driver** (`lowbit-train`, and tests or benchmarks that drive a step by hand)
//!   imports [`protocol::StepProtocol`], implemented for [`DataParallelBuffers`]: zeroing and
//!   resetting an iteration, microbatch boundaries, gradient readiness and reductions, staging,
//!   parameter gathers and their completion, FSDP unit release, the gradient wire dtype and the
//!   per-group states the protocol checks. Everything else is `pub(crate)`.
//!
//! # Modules
//! - [`layout`] (re-exported `lowbit-layout`): the pure plan; nobody here re-derives it.
//! - `config`: [`DdpConfig`] — every choice an enum, one validity check, one plan translation.
//! - `storage`: one type per storage kind behind one interface; nothing else asks the kind.
//! - `buffers`, `grad_sync`, `param_sync`, `stage`, `pipeline`, `memory`:
//!   [`DataParallelBuffers`] by job (`pipeline`: staging and gathers group by group for a step
//!   whose optimizer updates group by group).
//! - `hooks`, `policy`, `dp_hooks`: the model-facing protocol.
//! - [`protocol`]: [`protocol::StepProtocol`], the driver-facing protocol.
//!
//! # Invariants
//! - **One owner per bucket group**: groups are built per buffer and a buffer's key includes
//!   its owning optimizer, so no group is gathered on behalf of an optimizer that has not
//!   stepped (Megatron bug class D).
//! - **Weight states**: every low-precision group is `Current`, `Stale` or `Staged`
//!   ([`WeightState`]). Gathers require `Staged`; forwards refuse `Stale`; zeroing the
//!   gradients keeps the bytes of `Staged` groups' staging views where staging aliases them
//!   (their gather ships them, its completion zeroes them); a backward refuses anything but
//!   `Current`; a group gathered twice in an iteration is an error. These make
//!   Megatron's staging bugs (A1–A3, C, E) errors in every build profile ([`ProtocolError`]).
//! - **Explicit dispatch state** per group ([`ParamSyncState`]), reset by
//!   [`protocol::StepProtocol::finish_grad_sync`] and refused while a gather is in flight (C, F4).
//! - **The communicator is the plan's group**: every launch checks its size and rank (F3).
//! - **Pipelined staging in element order**: [`protocol::StepProtocol::pipeline_groups`] orders a
//!   buffer's groups by increasing offset, so a staging view that aliases the f32 gradients
//!   only ever overwrites gradients already read by the update.
//!
//! # Non-goals
//! Optimizer math (`lowbit-optim`), the step order and the FSDP configuration (`lowbit-train`),
//! checkpoints, tensor/expert parallel groups.

mod buffers;
mod config;
mod dp_hooks;
mod error;
mod grad_sync;
mod hooks;
mod memory;
mod param_sync;
mod pipeline;
mod policy;
pub mod protocol;
mod stage;
mod storage;
mod units;

pub use lowbit_layout as layout;

pub use buffers::{DataParallelBuffers, OwnedShard, ParamSyncState, ReplicaMode, WeightState};
pub use config::{
    DdpConfig, GradAccumulation, GradScaling, Mxfp8Gather, NanCheck, Overlap, UnitGather, Verify,
};
pub use dp_hooks::{DpHooks, HookMode, HookScratch};
pub use error::{BufferError, ConfigError, ProtocolError, Result};
pub use hooks::{Hooks, Usage};
pub use memory::{BufferMemory, estimate_buffer_memory, plan_buffer_memory, transient_bound};
pub use policy::{
    ComputeFormat, ParamCompute, PrecisionPolicy, dequant_mxfp8, dequant_nvfp4, mxfp8_plane,
};
pub use stage::StagePiece;
pub use storage::{
    LowPrecisionWeights, Mxfp8Weights, Nvfp4Weights, StorageKind, matrix_dims, mxfp8_weight_config,
    nvfp4_weight_config,
};
