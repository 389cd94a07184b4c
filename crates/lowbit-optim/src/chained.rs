//! [`ChainedOptimizer`]: several optimizers over one set of buffers (AdamW for matrices and
//! another configuration for biases; later Muon layer-wise plus AdamW), stepped together: one
//! global gradient norm, one clip factor, one skip decision. The driver stages and gathers a
//! bucket group only after the part that owns it updated it (bug class D).

use std::borrow::Cow;

use lowbit_device::Device;
use lowbit_layout::OptimizerId;

use crate::error::{InvalidInput, Result};
use crate::optimizer::{
    GradPiece, MasterPiece, Optimizer, OptimizerMemory, OptimizerState, StateViews, UpdateScope,
};

/// See the module docs. A chain is an [`Optimizer`] itself, so chains nest.
#[derive(Debug)]
pub struct ChainedOptimizer {
    parts: Vec<Box<dyn Optimizer>>,
}

impl ChainedOptimizer {
    /// Chains `parts`; no owner may appear twice.
    ///
    /// # Errors
    /// [`InvalidInput::DuplicateOwner`].
    pub fn new(parts: Vec<Box<dyn Optimizer>>) -> Result<Self> {
        let mut seen = Vec::new();
        for p in &parts {
            for o in p.owners() {
                if seen.contains(&o) {
                    return Err(InvalidInput::DuplicateOwner(o).into());
                }
                seen.push(o);
            }
        }
        Ok(ChainedOptimizer { parts })
    }

    /// The chained optimizers.
    pub fn parts(&self) -> &[Box<dyn Optimizer>] {
        &self.parts
    }
}

impl Optimizer for ChainedOptimizer {
    fn owners(&self) -> Vec<OptimizerId> {
        self.parts.iter().flat_map(|p| p.owners()).collect()
    }
    fn grad_pieces(&self) -> Vec<GradPiece> {
        self.parts.iter().flat_map(|p| p.grad_pieces()).collect()
    }
    /// Each part folds its own pieces' sums; the parts' sums are added in order.
    fn fold_sum_squares(&self, sums: &[f64]) -> f64 {
        let mut sum = 0.0;
        let mut at = 0;
        for p in &self.parts {
            let n = p.grad_pieces().len().min(sums.len() - at);
            sum += p.fold_sum_squares(&sums[at..at + n]);
            at += n;
        }
        sum
    }
    fn clip_grad(&self) -> Option<f32> {
        self.parts
            .iter()
            .filter_map(|p| p.clip_grad())
            .reduce(f32::min)
    }
    fn begin_step(&mut self) {
        self.parts.iter_mut().for_each(|p| p.begin_step());
    }
    /// Part by part, in order.
    fn update(
        &mut self,
        dev: &mut Device,
        clip: f32,
        scope: UpdateScope<'_>,
    ) -> Result<Vec<MasterPiece>> {
        let mut updated = Vec::new();
        for p in &mut self.parts {
            updated.extend(p.update(dev, clip, scope)?);
        }
        Ok(updated)
    }
    /// As the part that holds `owner` says.
    fn updates_in_parts(&self, owner: OptimizerId) -> bool {
        self.parts
            .iter()
            .find(|p| p.owners().contains(&owner))
            .is_some_and(|p| p.updates_in_parts(owner))
    }
    fn masters_to_stage(&self) -> Vec<(OptimizerId, Vec<MasterPiece>)> {
        self.parts
            .iter()
            .flat_map(|p| p.masters_to_stage())
            .collect()
    }
    fn set_lr(&mut self, lr: f32) -> Result<()> {
        // Validate once so that nothing changes if it is invalid.
        crate::OptimConfig::new(lr).validate()?;
        self.parts.iter_mut().try_for_each(|p| p.set_lr(lr))
    }
    fn steps(&self) -> u64 {
        self.parts.first().map_or(0, |p| p.steps())
    }
    fn export_state(&self, dev: &Device) -> Result<Vec<OptimizerState>> {
        crate::optimizer::exported(self, dev)
    }
    fn export_template(&self, dev: &Device) -> Result<Vec<OptimizerState>> {
        let mut out = Vec::new();
        for p in &self.parts {
            out.extend(p.export_template(dev)?);
        }
        Ok(out)
    }
    /// Each part gets back the entries it exported last time (one per owner of the part), so
    /// its buffers are reused.
    fn export_state_into(&self, dev: &Device, out: &mut Vec<OptimizerState>) -> Result<()> {
        let mut old = std::mem::take(out).into_iter();
        for p in &self.parts {
            let mut mine: Vec<_> = old.by_ref().take(p.owners().len()).collect();
            p.export_state_into(dev, &mut mine)?;
            out.append(&mut mine);
        }
        Ok(())
    }
    fn check_import(&self, state: &[OptimizerState]) -> Result<()> {
        let owners = self.owners();
        if let Some(s) = state.iter().find(|s| !owners.contains(&s.owner)) {
            return Err(InvalidInput::StateMismatch(format!(
                "state for {:?}, which this chain does not hold",
                s.owner
            ))
            .into());
        }
        self.parts
            .iter()
            .try_for_each(|p| p.check_import(&states_of(&**p, state)))
    }
    fn import_state(&mut self, dev: &mut Device, state: &[OptimizerState]) -> Result<()> {
        // Every part checks before any part writes: a refusal changes no part.
        self.check_import(state)?;
        self.parts.iter_mut().try_for_each(|p| {
            let mine = states_of(&**p, state);
            p.import_state(dev, &mine)
        })
    }
    /// Every part's views, in the parts' order; `None` if a part has none.
    fn state_views(&self) -> Option<Vec<StateViews>> {
        let mut out = Vec::new();
        for p in &self.parts {
            out.extend(p.state_views()?);
        }
        Some(out)
    }
    fn set_steps(&mut self, owner: OptimizerId, steps: u64) -> Result<()> {
        match self.parts.iter_mut().find(|p| p.owners().contains(&owner)) {
            Some(p) => p.set_steps(owner, steps),
            None => Err(InvalidInput::StateMismatch(format!(
                "steps for {owner:?}, which this chain does not hold"
            ))
            .into()),
        }
    }
    fn memory(&self) -> OptimizerMemory {
        self.parts
            .iter()
            .map(|p| p.memory())
            .fold(OptimizerMemory::default(), |a, b| a + b)
    }
}

/// The states of the owners `part` holds: a part (a nested chain in particular) is never shown
/// the other parts' owners, which it would rightly refuse as state it does not hold. Borrowed
/// when they lie side by side in `state` (a chain's own export order, what a checkpoint load
/// fills), so an import does not copy the whole state; copied otherwise.
fn states_of<'s>(part: &dyn Optimizer, state: &'s [OptimizerState]) -> Cow<'s, [OptimizerState]> {
    let owners = part.owners();
    let mine = |s: &OptimizerState| owners.contains(&s.owner);
    let first = state.iter().position(mine).unwrap_or(state.len());
    let end = first + state[first..].iter().take_while(|s| mine(s)).count();
    if !state[end..].iter().any(mine) {
        return Cow::Borrowed(&state[first..end]);
    }
    Cow::Owned(state.iter().filter(|s| mine(s)).cloned().collect())
}
