//! The optimizer interface the step driver uses: per-piece work (the gradient pieces whose
//! squares the driver sums, the update of the pieces in a scope), state export/import and
//! memory. [`crate::ChainedOptimizer`]
//! holds trait objects and is one itself, so chains nest.

use std::fmt::Debug;
use std::ops::Range;

use lowbit_device::{DType, Device, View};
use lowbit_layout::OptimizerId;

use crate::error::{InvalidInput, Result};

/// Learning rate and clipping of one optimizer.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct OptimConfig {
    /// Learning rate.
    pub lr: f32,
    /// Clip the global gradient norm to this value (`None`: no clipping). A chain clips to the
    /// smallest value of its parts.
    pub clip_grad: Option<f32>,
    /// The ratio of this optimizer's learning rate to a schedule's: `set_lr(x)` sets
    /// `lr = x · lr_ratio` (in f64, rounded once), so parts of a chain with different peak rates
    /// (Muon and AdamW) follow one warmup and decay. 1 by default.
    pub lr_ratio: f64,
    /// Where the main (master) parameters live: fp32 (the default), bf16, or the compute
    /// weights themselves (FSDP's `main_params_dtype` fp32 / bf16 / none).
    pub master_dtype: MasterDtype,
}

/// Where an optimizer keeps its main parameters (FSDP's `main_params_dtype`).
///
/// The update rule always computes in f32: bf16 masters (and compute weights used as masters)
/// are widened into an f32 scratch, updated, and rounded back to bf16 (RNE) — so the stored
/// master carries the rounding of every step, and the compute weight is exactly that value.
#[non_exhaustive]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum MasterDtype {
    /// fp32 masters of their own.
    #[default]
    F32,
    /// bf16 masters of their own (half the bytes).
    Bf16,
    /// No masters of their own: the persistent compute weights are the main parameters (no
    /// bytes; refused for low-precision storage, which cannot hold a master).
    Weights,
}

impl OptimConfig {
    /// Learning rate `lr`, no clipping.
    pub fn new(lr: f32) -> Self {
        OptimConfig {
            lr,
            clip_grad: None,
            lr_ratio: 1.0,
            master_dtype: MasterDtype::F32,
        }
    }

    lowbit_layout::setters! {
        /// Sets the clip value.
        with_clip_grad => clip_grad: Option<f32>;
        /// Sets where the main parameters live.
        with_master_dtype => master_dtype: MasterDtype;
        /// Sets the ratio to a schedule's learning rate.
        with_lr_ratio => lr_ratio: f64;
    }

    /// This configuration with the learning rate set from a schedule's `lr` (times
    /// [`Self::lr_ratio`]), validated: what every `Optimizer::set_lr` does.
    ///
    /// # Errors
    /// [`InvalidInput::LearningRate`]; `self` is unchanged then.
    pub fn scheduled(self, lr: f32) -> Result<Self> {
        let lr = if self.lr_ratio == 1.0 {
            lr
        } else {
            (f64::from(lr) * self.lr_ratio) as f32
        };
        let cfg = OptimConfig { lr, ..self };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the values.
    ///
    /// # Errors
    /// [`InvalidInput::LearningRate`], [`InvalidInput::ClipGrad`].
    pub fn validate(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return Err(InvalidInput::LearningRate(self.lr).into());
        }
        if let Some(c) = self.clip_grad
            && !(c.is_finite() && c > 0.0)
        {
            return Err(InvalidInput::ClipGrad(c).into());
        }
        if !(self.lr_ratio.is_finite() && self.lr_ratio > 0.0) {
            return Err(InvalidInput::LearningRate(self.lr_ratio as f32).into());
        }
        Ok(())
    }
}

/// A downloaded piece of the fp32 masters.
#[derive(Clone, Debug, PartialEq)]
pub struct MasterShard {
    /// Global parameter id.
    pub param: usize,
    /// Range within the flattened parameter.
    pub range: Range<usize>,
    /// The master values of that range.
    pub values: Vec<f32>,
}

/// One owned piece of fp32 masters, as staging needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MasterPiece {
    /// Global parameter id.
    pub param: usize,
    /// Range within the flattened parameter.
    pub range: Range<usize>,
    /// The fp32 master values.
    pub master: View,
    /// Where persistent storage takes the rounded values; `None` for low-precision storage,
    /// which is staged through the buffers.
    pub fused_output: Option<View>,
}

/// One named fp32 tensor of optimizer state over one owned piece.
#[derive(Clone, Debug, PartialEq)]
pub struct StateTensor {
    /// `"master"` or the rule's state name (`"exp_avg"`, …).
    pub name: String,
    /// Global parameter id.
    pub param: usize,
    /// Range within the flattened parameter.
    pub range: Range<usize>,
    /// The values.
    pub values: Vec<f32>,
}

/// The exportable state of one leaf optimizer: everything a resume needs to continue bit for
/// bit.
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerState {
    /// The owner whose parameters the optimizer updates.
    pub owner: OptimizerId,
    /// The update rule's name.
    pub rule: String,
    /// Steps taken (skipped steps not counted).
    pub steps: u64,
    /// Masters and state tensors, piece by piece.
    pub tensors: Vec<StateTensor>,
}

/// One state tensor where it lives: the device view [`Optimizer::export_state`] downloads and
/// [`Optimizer::import_state`] uploads (fp32, or bf16 for bf16 masters: exported as f32,
/// imported rounded to nearest even).
#[derive(Clone, Debug, PartialEq)]
pub struct StateView {
    /// `"master"` or the rule's state name, as in [`StateTensor::name`].
    pub name: String,
    /// Global parameter id.
    pub param: usize,
    /// Range within the flattened parameter.
    pub range: Range<usize>,
    /// The device memory (`range.len()` elements).
    pub view: View,
}

/// One leaf optimizer's state as device views, in [`Optimizer::export_state`]'s order: what
/// streaming I/O (a checkpoint written or read chunk by chunk, never the whole state in host
/// memory) reads and writes.
#[derive(Clone, Debug, PartialEq)]
pub struct StateViews {
    /// The owner whose parameters the optimizer updates.
    pub owner: OptimizerId,
    /// The update rule's name.
    pub rule: String,
    /// Steps taken.
    pub steps: u64,
    /// Masters and state tensors, piece by piece.
    pub tensors: Vec<StateView>,
}

/// Bytes an optimizer holds on this rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OptimizerMemory {
    /// fp32 master shards.
    pub masters: usize,
    /// State tensors (AdamW moments, SGD momentum).
    pub state: usize,
    /// fp32 copies of non-fp32 reduced gradients.
    pub grad_scratch: usize,
}

impl std::ops::Add for OptimizerMemory {
    type Output = OptimizerMemory;
    fn add(self, o: OptimizerMemory) -> OptimizerMemory {
        OptimizerMemory {
            masters: self.masters + o.masters,
            state: self.state + o.state,
            grad_scratch: self.grad_scratch + o.grad_scratch,
        }
    }
}

/// What one step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Global gradient norm before clipping.
    pub grad_norm: f32,
    /// Whether the step was skipped because the norm was not finite.
    pub skipped: bool,
    /// The factor gradients were multiplied by (1 when not clipped).
    pub clip_coef: f32,
}

/// One reduced-gradient piece an optimizer reads: what the step driver sums the squares of for
/// the global gradient norm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GradPiece {
    /// Global parameter id (the driver asks the buffers when its reduction is final).
    pub param: usize,
    /// The reduced gradient in the buffers (bf16, f16 or f32).
    pub grad: View,
    /// The fp32 gradient the update reads: `grad` itself, or the optimizer's f32 copy, into
    /// which the driver widens `grad` before summing its squares (and before the update).
    pub grad32: View,
}

/// Which pieces one [`Optimizer::update`] call updates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UpdateScope<'a> {
    /// Every piece of every owner.
    All,
    /// Every piece of one owner (nothing when the optimizer does not hold it).
    Owner(OptimizerId),
    /// The pieces of these parameters (global ids; one bucket group of a pipelined step).
    Params(&'a [usize]),
}

impl UpdateScope<'_> {
    /// Whether a piece of `param`, held for `owner`, is in scope.
    pub fn covers(&self, owner: OptimizerId, param: usize) -> bool {
        match *self {
            UpdateScope::All => true,
            UpdateScope::Owner(o) => o == owner,
            UpdateScope::Params(ps) => ps.contains(&param),
        }
    }
}

/// An optimizer over this rank's owned shards of some owners' parameters.
///
/// It updates the pieces it owns and nothing else: it never sees a communicator, never stages
/// weights into the buffers, never marks them stale and never starts a gather. The step driver
/// (`lowbit-train`) calls, per step: [`Optimizer::grad_pieces`] (the driver widens and sums
/// their squares as their reductions complete) and [`Optimizer::fold_sum_squares`] on every
/// rank, then, unless the global norm is not finite, [`Optimizer::begin_step`] and
/// [`Optimizer::update`] (all at once, owner by owner, or bucket group by bucket group where
/// [`Optimizer::updates_in_parts`]), and stages [`Optimizer::masters_to_stage`] (or the pieces
/// `update` returned) before the parameter gather. Masters always come from the
/// high-precision initial values, never from the (rounded or quantized) parameter storage.
pub trait Optimizer: Debug + Send {
    /// The owners whose parameters this optimizer updates.
    fn owners(&self) -> Vec<OptimizerId>;

    /// This rank's reduced-gradient pieces, in the fixed order of the sum of squares (a chain:
    /// its parts' in order).
    fn grad_pieces(&self) -> Vec<GradPiece>;

    /// This rank's sum of squares from the per-piece sums `sums` (one per
    /// [`Optimizer::grad_pieces`] entry, in that order), added in the fixed order: the pieces
    /// in order from 0 (a chain: each part's fold, the parts' folds added in order).
    fn fold_sum_squares(&self, sums: &[f64]) -> f64 {
        sums.iter().fold(0.0, |a, b| a + b)
    }

    /// The clip value (a chain: the smallest of its parts).
    fn clip_grad(&self) -> Option<f32>;

    /// Counts a step that is taken (every leaf; skipped steps are not counted): the step number
    /// the following [`Optimizer::update`] calls use.
    fn begin_step(&mut self);

    /// Clips by the coefficient `clip` (at most 1) and updates the masters (and fused
    /// parameter outputs) of the pieces in `scope`, each piece once per step. Returns the
    /// updated pieces in the order they were updated (the driver stages those of low-precision
    /// storage: `fused_output` `None`).
    ///
    /// # Errors
    /// Device errors.
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: UpdateScope<'_>,
    ) -> Result<Vec<MasterPiece>>;

    /// Whether `owner`'s pieces may be updated bucket group by bucket group
    /// ([`UpdateScope::Params`] per group) with one launch per run of consecutive pieces within
    /// the group: what lets the driver gather each group beside the update of the later ones.
    /// The same bits as updating all at once either way; the default: no.
    fn updates_in_parts(&self, owner: OptimizerId) -> bool {
        let _ = owner;
        false
    }

    /// This rank's master pieces, per owner, in staging order (a chain: its parts' in order).
    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<MasterPiece>)>;

    /// Sets the learning rate of every part; nothing changes if it is invalid.
    ///
    /// # Errors
    /// [`InvalidInput::LearningRate`].
    fn set_lr(&mut self, lr: f32) -> Result<()>;

    /// Steps taken (a chain: its first part's count).
    fn steps(&self) -> u64;

    /// This rank's fp32 masters, downloaded (the pieces of [`Optimizer::masters_to_stage`]).
    ///
    /// # Errors
    /// Device errors.
    fn masters(&self, dev: &Device) -> Result<Vec<MasterShard>> {
        let mut out = Vec::new();
        for (_, pieces) in self.masters_to_stage() {
            for p in pieces {
                let mut values = vec![0.0; p.master.len()];
                download_values(dev, p.master, &mut values)?;
                out.push(MasterShard {
                    param: p.param,
                    range: p.range,
                    values,
                });
            }
        }
        Ok(out)
    }

    /// This rank's state, one entry per leaf optimizer.
    ///
    /// # Errors
    /// Device errors.
    fn export_state(&self, dev: &Device) -> Result<Vec<OptimizerState>>;

    /// [`Optimizer::export_state`] into `out`, reusing the value buffers `out` holds where they
    /// have the right lengths (a saver that snapshots again and again then copies into memory
    /// that is already faulted in). The default exports anew. On an error `out` holds no
    /// complete state.
    ///
    /// # Errors
    /// Device errors.
    fn export_state_into(&self, dev: &Device, out: &mut Vec<OptimizerState>) -> Result<()> {
        *out = self.export_state(dev)?;
        Ok(())
    }

    /// What [`Optimizer::export_state`] returns, with every tensor's values zero: the template
    /// a checkpoint load fills and imports, with nothing downloaded (the zeros are fresh pages
    /// the load's reads fill). The default exports, then zeroes.
    ///
    /// # Errors
    /// Device errors.
    fn export_template(&self, dev: &Device) -> Result<Vec<OptimizerState>> {
        let mut state = self.export_state(dev)?;
        for t in state.iter_mut().flat_map(|s| &mut s.tensors) {
            t.values.fill(0.0);
        }
        Ok(state)
    }

    /// Checks that `state` matches this optimizer's owners and shards, writing nothing. A chain
    /// runs every part's check before any part imports, so an optimizer whose `import_state`
    /// can refuse must override this (the default accepts everything).
    ///
    /// # Errors
    /// [`InvalidInput::StateMismatch`] naming the first mismatch.
    fn check_import(&self, state: &[OptimizerState]) -> Result<()> {
        let _ = state;
        Ok(())
    }

    /// Restores state exported by an optimizer with the same owners and shards; everything is
    /// checked ([`Optimizer::check_import`]) before anything is written.
    ///
    /// # Errors
    /// [`InvalidInput::StateMismatch`] (nothing is changed then), device errors.
    fn import_state(&mut self, dev: &mut Device, state: &[OptimizerState]) -> Result<()>;

    /// The state as device views, one entry per leaf optimizer in [`Optimizer::export_state`]'s
    /// order, for streaming I/O: reading the views is an export, writing all of them and then
    /// [`Optimizer::set_steps`] for every owner is an import. `None` (the default): only
    /// export and import move this optimizer's state.
    fn state_views(&self) -> Option<Vec<StateViews>> {
        None
    }

    /// Sets the step count of `owner` after its [`Optimizer::state_views`] were written (the
    /// end of a streaming import).
    ///
    /// # Errors
    /// [`InvalidInput::StateMismatch`] for an owner this optimizer does not hold (or when it has
    /// no state views).
    fn set_steps(&mut self, owner: OptimizerId, steps: u64) -> Result<()> {
        let _ = steps;
        Err(InvalidInput::StateMismatch(format!(
            "{owner:?}: this optimizer has no state views to import into"
        ))
        .into())
    }

    /// Bytes held on this rank.
    fn memory(&self) -> OptimizerMemory;
}

/// [`Optimizer::export_state`] through [`Optimizer::export_state_into`] (what the optimizers of
/// this crate do: their export fills reusable buffers).
pub(crate) fn exported(opt: &dyn Optimizer, dev: &Device) -> Result<Vec<OptimizerState>> {
    let mut out = Vec::new();
    opt.export_state_into(dev, &mut out)?;
    Ok(out)
}

/// One leaf optimizer's state as the [`Optimizer`] state methods see it (what
/// `DistributedOptimizer` and `Muon` share): its owner, its rule's name, its step count, and
/// every state tensor's `(name, param, range, view)` in export order, shard by shard,
/// `per_shard` tensors each.
pub(crate) struct Leaf<'a, I> {
    pub owner: OptimizerId,
    pub rule: &'a str,
    pub steps: u64,
    pub per_shard: usize,
    pub tensors: I,
}

impl<'n, I: Iterator<Item = (&'n str, usize, Range<usize>, View)>> Leaf<'_, I> {
    /// The leaf's state exported into `out` (see [`Optimizer::export_state_into`]): every tensor
    /// downloaded in one copy, into the buffer of the tensor at the same position in `out` when
    /// its length fits; without `dev`, zeros (see [`Optimizer::export_template`]).
    pub(crate) fn export_into(
        self,
        dev: Option<&Device>,
        out: &mut Vec<OptimizerState>,
    ) -> Result<()> {
        let mut old = std::mem::take(out).into_iter().flat_map(|s| s.tensors);
        let mut exported = Vec::new();
        for (name, param, range, view) in self.tensors {
            let mut values = match old.next() {
                Some(t) if t.values.len() == view.len() => t.values,
                // Zeroed allocations are fresh pages, not written twice.
                _ => vec![0.0; view.len()],
            };
            if let Some(dev) = dev {
                download_values(dev, view, &mut values)?;
            }
            exported.push(StateTensor {
                name: name.to_string(),
                param,
                range,
                values,
            });
        }
        *out = vec![OptimizerState {
            owner: self.owner,
            rule: self.rule.to_string(),
            steps: self.steps,
            tensors: exported,
        }];
        Ok(())
    }

    /// The leaf's state as device views.
    pub(crate) fn views(self) -> StateViews {
        StateViews {
            owner: self.owner,
            rule: self.rule.to_string(),
            steps: self.steps,
            tensors: self
                .tensors
                .map(|(name, param, range, view)| StateView {
                    name: name.to_string(),
                    param,
                    range,
                    view,
                })
                .collect(),
        }
    }

    /// [`Optimizer::set_steps`] of a leaf: `owner` must be its own.
    pub(crate) fn checked_steps(&self, owner: OptimizerId, steps: u64) -> Result<u64> {
        if owner == self.owner {
            Ok(steps)
        } else {
            Err(InvalidInput::StateMismatch(format!(
                "steps for {owner:?}, which this optimizer ({:?}) does not hold",
                self.owner
            ))
            .into())
        }
    }

    /// [`Leaf::export_into`] without a device: the zeroed template.
    pub(crate) fn template(self) -> Result<Vec<OptimizerState>> {
        let mut out = Vec::new();
        self.export_into(None, &mut out)?;
        Ok(out)
    }

    /// This leaf's entry of `state`, checked tensor by tensor (name, parameter, range, length)
    /// against the leaf's, with the views that entry's tensors go to.
    ///
    /// # Errors
    /// [`InvalidInput::StateMismatch`] naming the first mismatch.
    pub(crate) fn matched(self, state: &[OptimizerState]) -> Result<(&OptimizerState, Vec<View>)> {
        let mismatch = |m: String| Err(InvalidInput::StateMismatch(m).into());
        let Some(mine) = state.iter().find(|s| s.owner == self.owner) else {
            return mismatch(format!("no state for {:?}", self.owner));
        };
        if mine.rule != self.rule {
            return mismatch(format!(
                "rule `{}` for a `{}` optimizer",
                mine.rule, self.rule
            ));
        }
        let expected: Vec<_> = self.tensors.collect();
        if mine.tensors.len() != expected.len() {
            return mismatch(format!(
                "{} tensors for {} shards of {}",
                mine.tensors.len(),
                expected.len() / self.per_shard,
                self.per_shard
            ));
        }
        let mut views = Vec::with_capacity(expected.len());
        for (t, (name, param, range, view)) in mine.tensors.iter().zip(expected) {
            if t.name != name
                || t.param != param
                || t.range != range
                || t.values.len() != range.len()
            {
                return mismatch(format!(
                    "tensor `{}` of parameter {} {:?} where `{name}` of parameter {param} \
                     {range:?} was expected",
                    t.name, t.param, t.range
                ));
            }
            views.push(view);
        }
        Ok((mine, views))
    }

    /// Uploads this leaf's entry of `state` (checked first: nothing is written on a mismatch)
    /// and returns its step count.
    ///
    /// # Errors
    /// As [`Leaf::matched`]; device errors.
    pub(crate) fn import(self, dev: &mut Device, state: &[OptimizerState]) -> Result<u64> {
        let (mine, views) = self.matched(state)?;
        for (view, t) in views.into_iter().zip(&mine.tensors) {
            upload_values(dev, view, &t.values)?;
        }
        Ok(mine.steps)
    }
}

/// The values of a state view as f32: fp32 views in one copy, bf16 masters widened (exact).
pub(crate) fn download_values(dev: &Device, view: View, out: &mut [f32]) -> Result<()> {
    match view.dtype() {
        DType::Bf16 => {
            let v = dev.download::<half::bf16>(view)?;
            out.iter_mut().zip(v).for_each(|(o, x)| *o = x.to_f32());
            Ok(())
        }
        _ => Ok(dev.download_f32_into(view, out)?),
    }
}

/// Writes f32 values into a state view: as they are, or rounded to bf16 (RNE) for bf16 masters.
pub(crate) fn upload_values(dev: &mut Device, view: View, values: &[f32]) -> Result<()> {
    match view.dtype() {
        DType::Bf16 => {
            let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Ok(dev.upload(view, &v)?)
        }
        _ => Ok(dev.upload(view, values)?),
    }
}

/// An init callback over full initial values (`init[p]` is parameter `p`, flattened): the
/// piece `range` of parameter `p`. For tests and small models; large models produce pieces.
pub fn init_from_full(init: &[Vec<f32>]) -> impl FnMut(usize, Range<usize>) -> Vec<f32> + '_ {
    move |p, range| {
        init.get(p)
            .and_then(|v| v.get(range))
            .map(<[f32]>::to_vec)
            .unwrap_or_default()
    }
}
