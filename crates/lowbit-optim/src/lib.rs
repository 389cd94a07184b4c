//! Optimizers over fp32 master shards: the [`Optimizer`] trait, element-wise [`UpdateRule`]s
//! (AdamW, SGD), the [`DistributedOptimizer`] over the shards a rank owns under the plan,
//! [`Muon`] over whole matrices owned under the layer-wise rule, [`ChainedOptimizer`]
//! (nestable), state export/import and memory in closed form.
//!
//! # Purpose
//! After the gradient sync each rank holds the reduced gradients of its shards. An optimizer
//! names them ([`Optimizer::grad_pieces`]: the gradient and the fp32 copy the update reads,
//! bf16/f16 gradients widened into it, or read as they are by a rule that
//! [`UpdateRule::reads_low_precision_grads`], as AdamW does) and folds their sums of squares in
//! a fixed order; it updates the pieces it owns ([`Optimizer::update`], clipping fused into
//! the update where the rule can), writing persistent weights in the same pass, and hands back
//! the masters of low-precision weights ([`Optimizer::masters_to_stage`]). The step driver
//! (`lowbit-train`) decides everything else: when reductions complete, the norm, clipping,
//! skipping, staging and when gathers run.
//!
//! # Invariants
//! - **Masters come from the high-precision initial values** (an init callback asked for the
//!   owned pieces only), never from the rounded or quantized parameter storage (bug class E).
//! - **An optimizer touches only what it owns**: no method receives a communicator or the
//!   buffers (only the constructors read the buffers' layout), so an optimizer never stages,
//!   marks weights stale or launches a gather.
//! - **Updates do not depend on their scope**: every rule is element-wise (Muon: per matrix),
//!   so updating all pieces at once, owner by owner or bucket group by bucket group gives the
//!   same bits; a [`DistributedOptimizer`] launches one update per run of consecutive shards
//!   in scope.
//! - **The sum of squares has a fixed order**: per-piece f64 sums folded by
//!   [`Optimizer::fold_sum_squares`] (pieces in order; a chain: parts in order).
//!
//! # Non-goals
//! The step order, gradient norms across ranks, clipping decisions and parameter syncs
//! (`lowbit-train`); loss scaling for fp16, optimizer-state offload, checkpoint files
//! (`lowbit-ckpt` builds on [`Optimizer::state_views`] to stream the state, and on
//! [`Optimizer::export_state`]).

mod chained;
mod distributed;
mod error;
mod memory;
mod muon;
mod optimizer;
mod rule;

pub use chained::ChainedOptimizer;
pub use distributed::DistributedOptimizer;
pub use error::{InvalidInput, OptimError, Result};
pub use memory::{RankMemory, RuleMemory, estimate_memory, memory_report};
pub use muon::{Muon, MuonConfig, MuonLrScale, NsDtype, NsMode};
pub use optimizer::{
    GradPiece, MasterDtype, MasterPiece, MasterShard, OptimConfig, Optimizer, OptimizerMemory,
    OptimizerState, StateTensor, StateView, StateViews, StepReport, UpdateScope, init_from_full,
};
pub use rule::{AdamW, Sgd, ShardViews, UpdateRule};
