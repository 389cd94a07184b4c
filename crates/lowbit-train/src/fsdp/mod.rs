//! FSDP configuration over lowbit's buffers: the four sharding strategies of Megatron-FSDP, the
//! mixed-precision policy, and the memory each costs.
//!
//! # Purpose
//! A trainer picks *what* is sharded ([`Sharding`]: optimizer state, gradients, parameters) and
//! *in which dtype* main parameters, main gradients and gradient communication live
//! ([`MixedPrecisionPolicy`]); [`FsdpConfig`] checks the combination once, refuses what cannot
//! work with the reason, and turns it into the buffers' [`DdpConfig`] and the parameter keys
//! ([`FsdpConfig::apply`]). The mechanics live in the layers below, each in one place:
//! - the plan (`lowbit-layout`): [`ShardingStrategy::OptimGrads`] and
//!   [`ShardingStrategy::OptimGradsParams`] use the distributed layout, so every strategy has
//!   the same buckets and shards;
//! - the buffers (`lowbit-buffers`): per bucket group (a *unit*), the transient communication
//!   bucket of sharded gradients (reduce-scattered every microbatch and *added* into the
//!   persistent shard), the communication bucket of another dtype (reduced and *copied* back:
//!   never added, Megatron-FSDP's `optim` double gradient), and the transient gathered unit of
//!   sharded parameters (gathered before use, released when another unit is used, the next one
//!   prefetched);
//! - the step driver ([`crate::Trainer`]): one reduction per optimization cycle for `no_shard` and
//!   `optim`, units released before every step.
//!
//! # Invariants
//! - **Every strategy computes the same gradients.** With fp32 gradients and communication and
//!   one microbatch, the four strategies give bit-identical trajectories (`tests/parity.rs`).
//! - **A main gradient is the reduced sum, once.** The collective's input is scaled by `1/dp`,
//!   never the main gradient; the result is copied where the main buffer is whole and added
//!   where it is a shard that accumulates microbatches (`tests/double_gradient.rs`).
//! - **Memory is what the closed form says.** [`estimate_memory`] equals the live buffers and
//!   the device's allocation peak (`tests/memory.rs`).
//!
//! # Non-goals (not yet)
//! HFSDP with low-precision weights, or without `optim_grads_params` inside, is refused by
//! [`FsdpConfig::validate`] with the reason.
//!
//! # Main parameters
//! `main_params_dtype` fp32 or bf16 are the optimizers' masters
//! (`lowbit_optim::MasterDtype`, from [`FsdpConfig::master_dtype`]); `none` makes the
//! persistent compute weights the main parameters (bf16 masters that cost no memory: the same
//! bits as bf16 masters).
//!
//! # Low-precision parameters sharded by `optim_grads_params`
//! MXFP8 and NVFP4 matrices use the row-aligned layout (a unit per matrix, chunks of whole 32-
//! or 16-row blocks): each rank quantizes its rows, and a unit's gather yields the bytes of the
//! whole matrix quantized at once. MXFP8 units gather both copies, or with fine-grained gathers
//! only the one a use reads; NVFP4 units gather the rowwise bytes and derive the scales and the
//! transposed columnwise copy (Transformer Engine's order).
//!
//! # Hybrid sharding
//! `outer_dp` replica groups of `world / outer_dp` consecutive ranks
//! ([`FsdpConfig::split_groups`]): the buffers' plan is one replica group's
//! ([`FsdpConfig::plan_config`]), gradients are reduced there, then across replicas
//! ([`lowbit_buffers::DataParallelBuffers::set_replica_group`] with
//! [`FsdpConfig::replica_mode`]): all-reduced (outer `no_shard`, HSDP: the norm sums over the
//! shard group only) or reduce-scattered (outer `optim`, HFSDP: the optimizer state is split
//! across replicas, the norm sums over every rank, updated parameter parts are all-gathered
//! back). Equal to flat sharding up to the order of the sum across ranks; bit for bit with one
//! replica group.

mod config;
mod error;
mod memory;
mod policy;
mod rules;
mod strategy;

pub use config::{FineGrainedGather, FsdpConfig, HybridGroups, OuterSharding};
pub use error::FsdpError;
pub use memory::{FsdpMemory, estimate_memory};
pub use policy::{CommDtype, MainGradsDtype, MainParamsDtype, MixedPrecisionPolicy};
pub use rules::Conflict;
pub use strategy::Sharding;

pub use lowbit_buffers::DdpConfig;
pub use lowbit_layout::ShardingStrategy;
