//! Element-wise update rules: what one optimizer step does to one fp32 master shard. A rule is a
//! small trait object, so a downstream project can add its own without touching this crate.

use std::fmt::Debug;

use lowbit_device::{Device, View};

use crate::error::{InvalidInput, Result};

/// The views one update of one shard works on.
#[derive(Clone, Copy, Debug)]
pub struct ShardViews<'a> {
    /// The fp32 master values, updated in place.
    pub master: View,
    /// The gradient: fp32 (clipped already, unless the update is [`UpdateRule::update_scaled`]),
    /// or the reduced bf16/f16 gradient itself for a rule that
    /// [`reads_low_precision_grads`](UpdateRule::reads_low_precision_grads).
    pub grad: View,
    /// The rule's fp32 state tensors ([`UpdateRule::state_names`] of them), updated in place.
    pub state: &'a [View],
    /// Where the rounded new parameter values go, fused into the update, if the storage takes
    /// them that way.
    pub fused_output: Option<View>,
}

/// An element-wise optimizer update over fp32 masters.
pub trait UpdateRule: Debug + Send + Sync {
    /// A short name for messages and state export.
    fn name(&self) -> &'static str;
    /// Names of the fp32 state tensors, one element each per master element.
    fn state_names(&self) -> &'static [&'static str];
    /// Checks the hyper-parameters.
    ///
    /// # Errors
    /// [`InvalidInput::Hyper`].
    fn validate(&self) -> Result<()>;
    /// One update of one shard at learning rate `lr`; `step` counts from 1.
    ///
    /// # Errors
    /// Device errors.
    fn update(&self, dev: &mut Device, views: ShardViews<'_>, lr: f32, step: u64) -> Result<()>;

    /// One update whose gradient is first multiplied by `grad_scale` (the clip coefficient,
    /// below 1), in the same pass: `Ok(true)` if the rule did it, bit for bit what scaling the
    /// gradient in place ([`Device::scale`]) and then [`UpdateRule::update`] give, without
    /// the pass over the gradient (which is then left unscaled); `Ok(false)`, the default,
    /// leaves the scaling to the caller, which scales first and calls [`UpdateRule::update`].
    ///
    /// # Errors
    /// Device errors.
    fn update_scaled(
        &self,
        dev: &mut Device,
        views: ShardViews<'_>,
        lr: f32,
        step: u64,
        grad_scale: f32,
    ) -> Result<bool> {
        let _ = (dev, views, lr, step, grad_scale);
        Ok(false)
    }

    /// Whether [`UpdateRule::update`] and [`UpdateRule::update_scaled`] read a bf16 or f16
    /// gradient directly, widening each element to f32 as they read it (exact), and
    /// `update_scaled` always scales (returns `Ok(true)`). An optimizer over f32 masters then
    /// keeps no f32 copy of low-precision gradients: the norm sums the same values and the
    /// update reads the same f32 numbers, so the bits are those of the widened copy, without
    /// its 4 bytes per element and its cast. Default `false`.
    fn reads_low_precision_grads(&self) -> bool {
        false
    }
}

/// AdamW with decoupled weight decay, in PyTorch's formula order (the device's fused kernel).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamW {
    /// First-moment decay.
    pub beta1: f32,
    /// Second-moment decay.
    pub beta2: f32,
    /// Denominator epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
}

impl Default for AdamW {
    /// PyTorch's defaults.
    fn default() -> Self {
        AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl UpdateRule for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }
    fn state_names(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }
    fn validate(&self) -> Result<()> {
        require(
            (0.0..1.0).contains(&self.beta1) && (0.0..1.0).contains(&self.beta2) && self.eps > 0.0,
            "AdamW",
            "needs 0 ≤ beta1, beta2 < 1 and eps > 0",
        )
    }
    fn update(&self, dev: &mut Device, v: ShardViews<'_>, lr: f32, step: u64) -> Result<()> {
        self.fused(dev, v, lr, step, 1.0)
    }
    /// The device kernel multiplies each gradient element by `grad_scale` as it reads it.
    fn update_scaled(
        &self,
        dev: &mut Device,
        v: ShardViews<'_>,
        lr: f32,
        step: u64,
        grad_scale: f32,
    ) -> Result<bool> {
        self.fused(dev, v, lr, step, grad_scale)?;
        Ok(true)
    }
    /// The device's AdamW loads any float gradient dtype as f32 and scales it as it reads.
    fn reads_low_precision_grads(&self) -> bool {
        true
    }
}

impl AdamW {
    fn fused(
        &self,
        dev: &mut Device,
        v: ShardViews<'_>,
        lr: f32,
        step: u64,
        grad_scale: f32,
    ) -> Result<()> {
        let hp = lowbit_device::AdamW {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            step,
            grad_scale,
        };
        dev.adamw(
            v.master,
            v.grad,
            v.state[0],
            v.state[1],
            &hp,
            v.fused_output,
        )?;
        Ok(())
    }
}

/// SGD with momentum and L2 weight decay, in PyTorch's formula order.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sgd {
    /// Momentum factor.
    pub momentum: f32,
    /// L2 weight decay.
    pub weight_decay: f32,
}

impl UpdateRule for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
    }
    fn state_names(&self) -> &'static [&'static str] {
        &["momentum_buffer"]
    }
    fn validate(&self) -> Result<()> {
        require(
            (0.0..1.0).contains(&self.momentum),
            "SGD",
            "needs 0 ≤ momentum < 1",
        )
    }
    fn update(&self, dev: &mut Device, v: ShardViews<'_>, lr: f32, step: u64) -> Result<()> {
        let hp = lowbit_device::SgdMomentum {
            lr,
            momentum: self.momentum,
            weight_decay: self.weight_decay,
        };
        dev.sgd_momentum(v.master, v.grad, v.state[0], &hp, step == 1)?;
        if let Some(out) = v.fused_output {
            dev.cast(v.master, out)?;
        }
        Ok(())
    }
}

/// `Ok` when `ok`, else [`InvalidInput::Hyper`] naming `rule` and the rule broken (`what`).
fn require(ok: bool, rule: &'static str, what: &'static str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(InvalidInput::Hyper { rule, what }.into())
    }
}
