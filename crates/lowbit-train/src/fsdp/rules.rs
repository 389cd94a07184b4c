//! The combination rules between the sharding strategy, the parameters' storage and the
//! optimizers' ownership rules: what a strategy cannot do for a given set of parameters and
//! owners, as typed errors ([`Conflict`]) a front end maps to its own words (a command line
//! names its flags).
//!
//! [`FsdpConfig::validate`] checks the strategy against the precision policy and the hybrid
//! groups; these rules add what it cannot see: which owners use the layer-wise rule
//! (`lowbit_layout::ShardingStrategy::LayerWise`, whole parameters per rank, as Muon does).

use lowbit_layout::{OptimizerId, ParamSpec};

use super::policy::MainParamsDtype;
use super::{FsdpConfig, Sharding};

/// A combination of strategy, storage and owners that cannot work, or is not built.
#[non_exhaustive]
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Conflict {
    /// `no_shard` with a parameter stored in low precision: such weights are only refreshed
    /// by the gather after the step, and `no_shard` gathers nothing.
    #[error(
        "no_shard with `{param}` stored in low precision: low-precision weights are only \
         refreshed by the gather after the step, and no_shard gathers nothing"
    )]
    NoShardQuantized {
        /// The first such parameter.
        param: String,
    },
    /// `no_shard` with an owner under the layer-wise rule: the plan would mix replicated and
    /// sharded owners.
    #[error(
        "no_shard with a layer-wise owner: its parameters are owned whole by one rank each \
         (which shards the optimizer state), so the plan would mix replicated and sharded owners"
    )]
    NoShardLayerWise,
    /// Main parameters other than fp32 with an owner under the layer-wise rule (Muon keeps fp32
    /// main parameters only).
    #[error("main parameters {dtype} with a layer-wise owner, which keeps fp32 ones only")]
    LayerWiseMasters {
        /// The main-parameter dtype asked for.
        dtype: MainParamsDtype,
    },
    /// Hybrid sharding with an owner under the layer-wise rule: whole-parameter owners would
    /// need their own replica rule, which is not built.
    #[error("hybrid sharding ({outer_dp} replica groups) with a layer-wise owner is not built")]
    HybridLayerWise {
        /// The replica groups asked for.
        outer_dp: usize,
    },
}

impl std::fmt::Display for MainParamsDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FsdpConfig {
    /// The rules of the `no_shard` strategy against the parameters' storage and owners
    /// (`layer_wise`: the owners under the layer-wise rule). Checked before
    /// [`FsdpConfig::validate`].
    ///
    /// # Errors
    /// [`Conflict::NoShardQuantized`], [`Conflict::NoShardLayerWise`].
    pub fn check_no_shard(
        &self,
        specs: &[ParamSpec],
        layer_wise: &[OptimizerId],
    ) -> Result<(), Conflict> {
        if self.sharding != Sharding::NoShard {
            return Ok(());
        }
        if let Some(s) = specs.iter().find(|s| s.key.param_storage.is_quantized()) {
            return Err(Conflict::NoShardQuantized {
                param: s.name.clone(),
            });
        }
        if specs.iter().any(|s| layer_wise.contains(&s.key.owner)) {
            return Err(Conflict::NoShardLayerWise);
        }
        Ok(())
    }

    /// What owners under the layer-wise rule do not support: main parameters other than fp32,
    /// hybrid sharding. Checked after [`FsdpConfig::validate`].
    ///
    /// # Errors
    /// [`Conflict::LayerWiseMasters`], [`Conflict::HybridLayerWise`].
    pub fn check_layer_wise(
        &self,
        specs: &[ParamSpec],
        layer_wise: &[OptimizerId],
    ) -> Result<(), Conflict> {
        if !specs.iter().any(|s| layer_wise.contains(&s.key.owner)) {
            return Ok(());
        }
        let dtype = self.policy.main_params_dtype;
        if dtype != MainParamsDtype::Fp32 {
            return Err(Conflict::LayerWiseMasters { dtype });
        }
        if self.outer_dp > 1 {
            return Err(Conflict::HybridLayerWise {
                outer_dp: self.outer_dp,
            });
        }
        Ok(())
    }
}
