//! Optimizers over fp32 master shards and the optimizer half of the training-step protocol: the
//! [`Optimizer`] trait, element-wise [`UpdateRule`]s (AdamW, SGD), the [`DistributedOptimizer`]
//! over the shards a rank owns under the plan, [`Muon`] over whole matrices owned under the
//! layer-wise rule, [`ChainedOptimizer`] (nestable), global
//! gradient-norm clipping, skipping non-finite steps, state export/import, and the step driver
//! ([`Trainer`]: the protocol as types; [`protocol`]: the same steps as functions).
//!
//! # Purpose
//! After the gradient sync each rank holds the reduced gradients of its shards. The optimizer
//! reads them in fp32 (bf16/f16 shards widened into an f32 copy, or read as they are by a rule
//! that [`UpdateRule::reads_low_precision_grads`], as AdamW does), the driver computes the
//! global gradient norm, clips (fused into the update where the rule can), skips the step if
//! the norm is not finite, the optimizer updates its fp32 masters and writes the result back:
//! fused into the update for persistent storage, or staged through the buffers for
//! low-precision storage, from where the gather spreads it — now, or in the next forward.
//!
//! # Invariants
//! - **Masters come from the high-precision initial values** (an init callback asked for the
//!   owned pieces only), never from the rounded or quantized parameter storage (bug class E).
//! - **A skipped step changes nothing**: masters, moments, step counts and parameter storage
//!   are left bitwise as they were, and the skip is counted.
//! - **One sync per step, after every optimizer stepped**: a chain applies all parts before the
//!   single stage + gather, so no bucket group is gathered before its owner updated it (D).
//! - **The gradient norm does not depend on thread timing**: each rank's sum of squares is an
//!   f64 in a fixed order; the ranks exchange those as bytes and add them in rank order.
//!
//! # Non-goals
//! Loss scaling for fp16, optimizer-state offload, checkpoint files (`lowbit-ckpt` builds on
//! [`Optimizer::state_views`] to stream the state, and on [`Optimizer::export_state`]).

mod chained;
mod distributed;
mod driver;
mod error;
mod memory;
mod muon;
mod optimizer;
pub mod protocol;
mod rule;
mod staged;

pub use chained::ChainedOptimizer;
pub use distributed::DistributedOptimizer;
pub use driver::{GradsReady, Iteration, Trainer};
pub use error::{InvalidInput, OptimError, Result};
pub use memory::{RankMemory, RuleMemory, estimate_memory, memory_report};
pub use muon::{Muon, MuonConfig, MuonLrScale, NsDtype, NsMode};
pub use optimizer::{
    MasterDtype, MasterPiece, MasterShard, OptimConfig, Optimizer, OptimizerMemory, OptimizerState,
    StateTensor, StateView, StateViews, StepReport, init_from_full,
};
pub use rule::{AdamW, Sgd, ShardViews, UpdateRule};
pub use staged::StagedReductions;
