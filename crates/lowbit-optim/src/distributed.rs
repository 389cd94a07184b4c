//! [`DistributedOptimizer`]: an element-wise [`UpdateRule`] over the fp32 master shards this
//! rank owns under the plan (a piece of every bucket under the distributed strategy, whole
//! parameters under layer-wise, everything when replicated).

use std::ops::Range;

use lowbit_buffers::DataParallelBuffers;
use lowbit_device::{DType, Device, View};
use lowbit_layout::OptimizerId;

use crate::error::{InvalidInput, Result};
use crate::memory::RuleMemory;
use crate::optimizer::{
    GradPiece, Leaf, MasterDtype, MasterPiece, OptimConfig, Optimizer, OptimizerMemory,
    OptimizerState, StateViews, UpdateScope,
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
    /// The gradient the update reads: the reduced gradient itself when it is fp32 (it is dead
    /// after the step) or when the rule reads bf16/f16 gradients as they are
    /// ([`UpdateRule::reads_low_precision_grads`]), otherwise an f32 scratch copy.
    grad32: View,
    state: Vec<View>,
}

/// One allocation handed out front to back.
struct Flat {
    dtype: DType,
    view: Option<View>,
    at: usize,
}

impl Flat {
    fn new(dev: &mut Device, dtype: DType, len: usize) -> Result<Flat> {
        Ok(Flat {
            dtype,
            view: if len > 0 {
                Some(dev.try_alloc(dtype, len)?)
            } else {
                None
            },
            at: 0,
        })
    }

    /// The next `n` elements (an empty allocation of its own when nothing was allocated: every
    /// piece is empty then).
    fn take(&mut self, dev: &mut Device, n: usize) -> Result<View> {
        let Some(view) = self.view else {
            return Ok(dev.try_alloc(self.dtype, n)?);
        };
        let view = view.slice(self.at..self.at + n)?;
        self.at += n;
        Ok(view)
    }
}

/// The shards' indices ordered by where their gradients lie (buffer, then offset).
fn buffer_order(owned: &[lowbit_buffers::OwnedShard]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..owned.len()).collect();
    order.sort_by_key(|&i| {
        (
            owned[i].grad_view.buffer(),
            owned[i].grad_view.byte_offset(),
        )
    });
    order
}

/// Consecutive shards whose every view continues the previous shard's: one update launch.
#[derive(Debug)]
struct Run {
    master: View,
    grad32: View,
    state: Vec<View>,
    fused_output: Option<View>,
}

impl Run {
    /// `shards` joined into runs, in the order given.
    fn of<'a>(shards: impl IntoIterator<Item = &'a Shard>) -> Vec<Run> {
        let mut runs: Vec<Run> = Vec::new();
        for s in shards {
            let next = Run {
                master: s.master,
                grad32: s.grad32,
                state: s.state.clone(),
                fused_output: s.fused_output,
            };
            match runs.last_mut().and_then(|r| Some((r.joined(&next)?, r))) {
                Some((joined, last)) => *last = joined,
                None => runs.push(next),
            }
        }
        runs
    }

    /// This run followed by `next`, if every view of `next` continues this run's.
    fn joined(&self, next: &Run) -> Option<Run> {
        let fused_output = match (self.fused_output, next.fused_output) {
            (None, None) => None,
            (Some(a), Some(b)) => Some(a.joined(&b)?),
            _ => return None,
        };
        let state = self
            .state
            .iter()
            .zip(&next.state)
            .map(|(a, b)| a.joined(b))
            .collect::<Option<Vec<_>>>()?;
        Some(Run {
            master: self.master.joined(&next.master)?,
            grad32: self.grad32.joined(&next.grad32)?,
            state,
            fused_output,
        })
    }
}

/// The optimizer of one owner over this rank's owned shards.
#[derive(Debug)]
pub struct DistributedOptimizer {
    owner: OptimizerId,
    rule: Box<dyn UpdateRule>,
    cfg: OptimConfig,
    shards: Vec<Shard>,
    /// The shards joined where consecutive in every view (f32 masters' update launches).
    runs: Vec<Run>,
    /// Whether the driver may update this optimizer bucket group by bucket group
    /// ([`Optimizer::updates_in_parts`]).
    pipelined: bool,
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
        // One allocation per kind of tensor, cut into the shards in owned order: consecutive
        // shards are consecutive in memory, so the element-wise launches of a step run over
        // runs of shards (`Run`) instead of shard by shard.
        let total: usize = owned.iter().map(|s| s.param_range.len()).sum();
        // Low-precision gradients get an f32 copy unless the rule reads them as they are (f32
        // masters only: the bf16-master path scales the gradient in place before the update);
        // the closed form (`estimate_memory`) asks the same `RuleMemory`.
        let widens = RuleMemory::of(&rule, cfg.master_dtype).widens_low_precision_grads;
        let widened = |s: &lowbit_buffers::OwnedShard| s.grad_view.dtype() != DType::F32 && widens;
        let narrow: usize = owned
            .iter()
            .filter(|s| widened(s))
            .map(|s| s.param_range.len())
            .sum();
        let mut masters = match cfg.master_dtype {
            MasterDtype::Weights => None,
            MasterDtype::Bf16 => Some(Flat::new(dev, DType::Bf16, total)?),
            MasterDtype::F32 => Some(Flat::new(dev, DType::F32, total)?),
        };
        let mut grads32 = Flat::new(dev, DType::F32, narrow)?;
        let mut states: Vec<Flat> = rule
            .state_names()
            .iter()
            .map(|_| Flat::new(dev, DType::F32, total))
            .collect::<Result<_>>()?;
        // The flat allocations are cut in the shards' order in the gradient buffers (a bucket
        // holds its parameters in reverse), so the pieces of a bucket are one run.
        let order = buffer_order(&owned);
        let mut placed: Vec<Option<(View, View, Vec<View>)>> = vec![None; owned.len()];
        for &i in &order {
            let s = &owned[i];
            let n = s.param_range.len();
            // Masters from the high-precision initial values (rounded to bf16 for bf16 masters
            // and for the compute weights, which then hold exactly what `initialize` wrote).
            let master = match (&mut masters, s.fused_output) {
                (Some(flat), _) => flat.take(dev, n)?,
                (None, Some(out)) => out,
                // Checked above already.
                (None, None) => {
                    return Err(
                        InvalidInput::MastersNeedPersistentWeights { param: s.param }.into(),
                    );
                }
            };
            let grad32 = if widened(s) {
                grads32.take(dev, n)?
            } else {
                s.grad_view
            };
            let state = states
                .iter_mut()
                .map(|f| f.take(dev, n))
                .collect::<Result<_>>()?;
            placed[i] = Some((master, grad32, state));
        }
        let mut shards = Vec::new();
        for ((s, values), placed) in owned.into_iter().zip(values).zip(placed) {
            let Some((master, grad32, state)) = placed else {
                unreachable!("`order` is a permutation of the shards")
            };
            crate::optimizer::upload_values(dev, master, &values)?;
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
        let runs = Run::of(order.iter().map(|&i| &shards[i]));
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
            runs,
            pipelined: true,
            steps: 0,
            work,
        })
    }

    /// The owner id of the parameters this optimizer updates.
    pub fn owner(&self) -> OptimizerId {
        self.owner
    }

    /// Update-rule launches per step: one per run of consecutive shards (shards whose master,
    /// gradient, state and fused-output views continue the previous shard's: one allocation per
    /// kind of tensor makes a bucket's pieces such a run) with f32 masters; one per shard with
    /// bf16 masters (updated through an f32 scratch).
    pub fn update_launches(&self) -> usize {
        if self.work.is_some() {
            self.shards.len()
        } else {
            self.runs.len()
        }
    }

    /// Whether the driver may update, stage and gather bucket group by bucket group
    /// ([`Optimizer::updates_in_parts`]; the default, with f32 masters) or must update
    /// everything, then stage (the same bits; for comparisons).
    pub fn with_pipelined_step(mut self, on: bool) -> Self {
        self.pipelined = on;
        self
    }

    /// The piece of shard `s`, as the driver stages it.
    fn piece(s: &Shard) -> MasterPiece {
        MasterPiece {
            param: s.param,
            range: s.param_range.clone(),
            master: s.master,
            fused_output: s.fused_output,
        }
    }

    /// The update of one run with f32 masters. Clipping rides along in the update where the
    /// rule can (AdamW): no pass over the gradients of its own.
    fn update_run(&self, dev: &mut Device, r: &Run, clip: f32) -> Result<()> {
        let views = ShardViews {
            master: r.master,
            grad: r.grad32,
            state: &r.state,
            fused_output: r.fused_output,
        };
        let (lr, step) = (self.cfg.lr, self.steps);
        if clip < 1.0 && self.rule.update_scaled(dev, views, lr, step, clip)? {
            return Ok(());
        }
        if clip < 1.0 {
            if r.grad32.dtype() != DType::F32 {
                // Scaling a bf16 gradient in place would round it: a rule that reads
                // low-precision gradients must scale them itself.
                return Err(InvalidInput::Hyper {
                    rule: self.rule.name(),
                    what: "reads low-precision gradients but left the clip scale to the caller",
                }
                .into());
            }
            dev.scale(r.grad32, clip)?;
        }
        self.rule.update(dev, views, lr, step)?;
        Ok(())
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

    /// Shards in order (the driver sums each in `Device::sum_squares`'s blocked order:
    /// 4096-element blocks, their sums 32 at a time, then the group sums, each level in index
    /// order; the same bits on every backend).
    fn grad_pieces(&self) -> Vec<GradPiece> {
        let pieces = self.shards.iter().map(|s| GradPiece {
            param: s.param,
            grad: s.grad_view,
            grad32: s.grad32,
        });
        pieces.collect()
    }

    fn clip_grad(&self) -> Option<f32> {
        self.cfg.clip_grad
    }

    fn begin_step(&mut self) {
        self.steps += 1;
    }

    /// With f32 masters: one launch per run of consecutive shards in scope (every shard in
    /// scope: the runs built at construction; a part of them: the runs of those shards in
    /// buffer order). The rule is element-wise, so the same bits whatever the scope.
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: UpdateScope<'_>,
    ) -> Result<Vec<MasterPiece>> {
        let mut mine: Vec<usize> = (0..self.shards.len())
            .filter(|&i| scope.covers(self.owner, self.shards[i].param))
            .collect();
        if mine.is_empty() {
            return Ok(Vec::new());
        }
        // Buffer order: the order of the runs (and of a group's pieces when it is staged).
        mine.sort_by_key(|&i| {
            let v = self.shards[i].grad_view;
            (v.buffer(), v.byte_offset())
        });
        let updated = mine.iter().map(|&i| Self::piece(&self.shards[i])).collect();
        let Some(work) = self.work else {
            if mine.len() == self.shards.len() {
                for r in &self.runs {
                    self.update_run(dev, r, clip)?;
                }
            } else {
                for r in Run::of(mine.iter().map(|&i| &self.shards[i])) {
                    self.update_run(dev, &r, clip)?;
                }
            }
            return Ok(updated);
        };
        for s in self
            .shards
            .iter()
            .filter(|s| scope.covers(self.owner, s.param))
        {
            if clip < 1.0 {
                dev.scale(s.grad32, clip)?;
            }
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
        Ok(updated)
    }

    /// With f32 masters, unless switched off ([`DistributedOptimizer::with_pipelined_step`]).
    fn updates_in_parts(&self, owner: OptimizerId) -> bool {
        owner == self.owner && self.pipelined && self.work.is_none()
    }

    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<MasterPiece>)> {
        vec![(self.owner, self.shards.iter().map(Self::piece).collect())]
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
