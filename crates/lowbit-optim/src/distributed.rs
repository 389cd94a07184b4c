//! [`DistributedOptimizer`]: an element-wise [`UpdateRule`] over the fp32 master shards this
//! rank owns under the plan (a piece of every bucket under the distributed strategy, whole
//! parameters under layer-wise, everything when replicated).

use std::ops::Range;

use lowbit_buffers::DataParallelBuffers;
use lowbit_device::{DType, Device, View};
use lowbit_layout::OptimizerId;

use crate::error::{InvalidInput, Result};
use crate::optimizer::{
    Leaf, MasterDtype, MasterPiece, OptimConfig, Optimizer, OptimizerMemory, OptimizerState,
    StateViews,
};
use crate::rule::{ShardViews, UpdateRule};

/// State tensors per element of `rule`.
fn s_len(rule: &dyn UpdateRule) -> usize {
    rule.state_names().len()
}

/// One owned piece of a parameter with its fp32 master and optimizer state.
#[derive(Debug)]
struct Shard {
    param: usize,
    param_range: Range<usize>,
    grad_view: View,
    fused_output: Option<View>,
    master: View,
    /// The fp32 gradient: the reduced gradient itself when it is fp32 (it is dead after the
    /// step), otherwise a scratch copy.
    grad32: View,
    state: Vec<View>,
}

/// The optimizer of one owner over this rank's owned shards.
#[derive(Debug)]
pub struct DistributedOptimizer {
    owner: OptimizerId,
    rule: Box<dyn UpdateRule>,
    cfg: OptimConfig,
    shards: Vec<Shard>,
    steps: u64,
    /// f32 scratch the rule updates bf16 masters in (`MasterDtype::Bf16`, `Weights`).
    work: Option<View>,
}

impl DistributedOptimizer {
    /// Builds fp32 masters and zeroed state for this rank's owned pieces of `owner`'s
    /// parameters. `init(p, range)` returns the high-precision initial values of piece `range`
    /// of parameter `p` — only the owned pieces are asked for, so no rank needs a full model
    /// copy.
    ///
    /// # Errors
    /// Invalid hyper-parameters or initial values, buffer and device errors.
    pub fn new(
        dev: &mut Device,
        bufs: &DataParallelBuffers,
        owner: OptimizerId,
        rule: impl UpdateRule + 'static,
        cfg: OptimConfig,
        init: &mut dyn FnMut(usize, Range<usize>) -> Vec<f32>,
    ) -> Result<Self> {
        cfg.validate()?;
        rule.validate()?;
        // Every piece's values are asked for and checked before anything is allocated, so a
        // refusal leaks nothing.
        let owned = bufs.owned_shards_of(owner)?;
        let mut values = Vec::with_capacity(owned.len());
        for s in &owned {
            let v = init(s.param, s.param_range.clone());
            if v.len() != s.param_range.len() {
                return Err(InvalidInput::InitLength {
                    param: s.param,
                    got: v.len(),
                    expected: s.param_range.len(),
                }
                .into());
            }
            values.push(v);
        }
        if cfg.master_dtype == MasterDtype::Weights
            && let Some(s) = owned.iter().find(|s| s.fused_output.is_none())
        {
            return Err(InvalidInput::MastersNeedPersistentWeights { param: s.param }.into());
        }
        let mut shards = Vec::new();
        for (s, values) in owned.into_iter().zip(values) {
            let n = s.param_range.len();
            // Masters from the high-precision initial values (rounded to bf16 for bf16 masters
            // and for the compute weights, which then hold exactly what `initialize` wrote).
            let master = match (cfg.master_dtype, s.fused_output) {
                (MasterDtype::Weights, Some(out)) => out,
                (MasterDtype::Bf16, _) => dev.alloc(DType::Bf16, n),
                _ => dev.alloc(DType::F32, n),
            };
            crate::optimizer::upload_values(dev, master, &values)?;
            let grad32 = if s.grad_view.dtype() == DType::F32 {
                s.grad_view
            } else {
                dev.alloc(DType::F32, n)
            };
            let state = rule
                .state_names()
                .iter()
                .map(|_| dev.alloc(DType::F32, n))
                .collect();
            shards.push(Shard {
                param: s.param,
                param_range: s.param_range,
                grad_view: s.grad_view,
                fused_output: s.fused_output,
                master,
                grad32,
                state,
            });
        }
        let widest = shards.iter().map(|s| s.param_range.len()).max();
        let work = match (cfg.master_dtype, widest) {
            (MasterDtype::F32, _) | (_, None) => None,
            (_, Some(n)) => Some(dev.alloc(DType::F32, n)),
        };
        Ok(DistributedOptimizer {
            owner,
            rule: Box::new(rule),
            cfg,
            shards,
            steps: 0,
            work,
        })
    }

    /// The owner id of the parameters this optimizer updates.
    pub fn owner(&self) -> OptimizerId {
        self.owner
    }

    /// The configuration.
    pub fn config(&self) -> OptimConfig {
        self.cfg
    }

    /// The state methods' view of this optimizer: per shard the master, then the rule's state
    /// in its order.
    fn leaf(&self) -> Leaf<'_, impl Iterator<Item = (&str, usize, Range<usize>, View)>> {
        let tensors = self.shards.iter().flat_map(|s| {
            let names = std::iter::once("master").chain(self.rule.state_names().iter().copied());
            names
                .zip(std::iter::once(&s.master).chain(&s.state))
                .map(|(name, &view)| (name, s.param, s.param_range.clone(), view))
        });
        Leaf {
            owner: self.owner,
            rule: self.rule.name(),
            steps: self.steps,
            per_shard: 1 + s_len(&*self.rule),
            tensors,
        }
    }
}

impl Optimizer for DistributedOptimizer {
    fn owners(&self) -> Vec<OptimizerId> {
        vec![self.owner]
    }

    /// Shards in order; within a shard, `Device::sum_squares`'s blocked order (4096-element
    /// partials in index order, then the partials in index order), the same bits on every
    /// backend.
    fn local_sum_squares(&mut self, dev: &mut Device) -> Result<f64> {
        let grads = self.shards.iter().map(|s| (s.grad_view, s.grad32));
        crate::optimizer::widened_sum_squares(dev, grads)
    }

    fn clip_grad(&self) -> Option<f32> {
        self.cfg.clip_grad
    }

    fn apply(&mut self, dev: &mut Device, bufs: &mut DataParallelBuffers, clip: f32) -> Result<()> {
        self.steps += 1;
        for s in &self.shards {
            if clip < 1.0 {
                dev.scale(s.grad32, clip)?;
            }
            let Some(work) = self.work else {
                let views = ShardViews {
                    master: s.master,
                    grad: s.grad32,
                    state: &s.state,
                    fused_output: s.fused_output,
                };
                self.rule.update(dev, views, self.cfg.lr, self.steps)?;
                continue;
            };
            // bf16 masters: widened, updated in f32, rounded back (the fused output, if any,
            // gets the same rounding; compute weights used as masters are the rounding).
            let w = work.slice(0..s.param_range.len())?;
            dev.cast(s.master, w)?;
            let views = ShardViews {
                master: w,
                grad: s.grad32,
                state: &s.state,
                fused_output: s.fused_output.filter(|&o| o != s.master),
            };
            self.rule.update(dev, views, self.cfg.lr, self.steps)?;
            dev.cast(w, s.master)?;
        }
        bufs.mark_stale(self.owner);
        Ok(())
    }

    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<MasterPiece>)> {
        let pieces = self.shards.iter().map(|s| MasterPiece {
            param: s.param,
            range: s.param_range.clone(),
            master: s.master,
            fused_output: s.fused_output,
        });
        vec![(self.owner, pieces.collect())]
    }

    fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.cfg = self.cfg.scheduled(lr)?;
        Ok(())
    }

    fn steps(&self) -> u64 {
        self.steps
    }

    fn export_state(&self, dev: &Device) -> Result<Vec<OptimizerState>> {
        crate::optimizer::exported(self, dev)
    }

    fn export_state_into(&self, dev: &Device, out: &mut Vec<OptimizerState>) -> Result<()> {
        self.leaf().export_into(Some(dev), out)
    }

    fn export_template(&self, _: &Device) -> Result<Vec<OptimizerState>> {
        self.leaf().template()
    }

    fn check_import(&self, state: &[OptimizerState]) -> Result<()> {
        self.leaf().matched(state).map(drop)
    }

    fn import_state(&mut self, dev: &mut Device, state: &[OptimizerState]) -> Result<()> {
        self.steps = self.leaf().import(dev, state)?;
        Ok(())
    }

    fn state_views(&self) -> Option<Vec<StateViews>> {
        Some(vec![self.leaf().views()])
    }

    fn set_steps(&mut self, owner: OptimizerId, steps: u64) -> Result<()> {
        let steps = self.leaf().checked_steps(owner, steps)?;
        self.steps = steps;
        Ok(())
    }

    fn memory(&self) -> OptimizerMemory {
        // The f32 scratch bf16 masters are updated in counts with the masters.
        let work = OptimizerMemory {
            masters: self.work.map_or(0, |w| w.byte_len()),
            ..OptimizerMemory::default()
        };
        self.shards.iter().fold(work, |m, s| OptimizerMemory {
            // Compute weights used as masters cost nothing of their own.
            masters: m.masters
                + if Some(s.master) == s.fused_output {
                    0
                } else {
                    s.master.byte_len()
                },
            state: m.state + s.state.iter().map(|v| v.byte_len()).sum::<usize>(),
            grad_scratch: m.grad_scratch
                + if s.grad32 == s.grad_view {
                    0
                } else {
                    s.grad32.byte_len()
                },
        })
    }
}
