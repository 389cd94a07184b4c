//! The four sharding strategies under their Megatron-FSDP names.

use std::fmt;
use std::str::FromStr;

use lowbit_layout::ShardingStrategy;

use super::FsdpError;

/// What the data-parallel ranks shard (Megatron-FSDP's `data_parallel_sharding_strategy`).
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Sharding {
    /// Nothing: every rank holds everything; gradients are all-reduced once per step.
    #[cfg_attr(
        feature = "clap",
        value(name = "no_shard", help = "Nothing sharded; gradients all-reduced")
    )]
    NoShard,
    /// Optimizer state (ZeRO-1, the distributed optimizer): gradients reduce-scattered once
    /// per step; lowbit's default.
    #[default]
    #[cfg_attr(
        feature = "clap",
        value(name = "optim", help = "Optimizer state (the distributed optimizer)")
    )]
    Optim,
    /// Optimizer state and gradients (ZeRO-2): each unit's gradients are reduce-scattered every
    /// microbatch and added into the rank's shard.
    #[cfg_attr(
        feature = "clap",
        value(name = "optim_grads", help = "Optimizer state and gradients")
    )]
    OptimGrads,
    /// Optimizer state, gradients and parameters (ZeRO-3): units are gathered before use and
    /// released after.
    #[cfg_attr(
        feature = "clap",
        value(
            name = "optim_grads_params",
            help = "Optimizer state, gradients and parameters"
        )
    )]
    OptimGradsParams,
}

impl Sharding {
    /// Every strategy, from least to most sharded.
    pub const ALL: [Sharding; 4] = [
        Sharding::NoShard,
        Sharding::Optim,
        Sharding::OptimGrads,
        Sharding::OptimGradsParams,
    ];

    /// The plan's strategy.
    pub fn layout(self) -> ShardingStrategy {
        match self {
            Sharding::NoShard => ShardingStrategy::Replicated,
            Sharding::Optim => ShardingStrategy::Distributed,
            Sharding::OptimGrads => ShardingStrategy::OptimGrads,
            Sharding::OptimGradsParams => ShardingStrategy::OptimGradsParams,
        }
    }

    /// The Megatron-FSDP spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::NoShard => "no_shard",
            Sharding::Optim => "optim",
            Sharding::OptimGrads => "optim_grads",
            Sharding::OptimGradsParams => "optim_grads_params",
        }
    }
}

impl fmt::Display for Sharding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Sharding {
    type Err = FsdpError;
    fn from_str(s: &str) -> Result<Self, FsdpError> {
        Sharding::ALL
            .into_iter()
            .find(|x| x.as_str() == s)
            .ok_or_else(|| FsdpError::Unknown {
                what: "sharding strategy",
                got: s.to_string(),
                choices: "no_shard, optim, optim_grads, optim_grads_params",
            })
    }
}
