//! The learning-rate schedule and gradient clipping of a training run.
//!
//! [`WarmupCosine`]: linear warmup over the first 5% of the steps, then a cosine decay to a
//! tenth of the peak (the shape of nanoGPT's and Megatron-LM's `--lr-decay-style cosine` with
//! `--min-lr` a tenth of `--lr`), computed in f64 and rounded to f32 once, so a run's rates are
//! a pure function of the step. Optimizers take the rate through `Optimizer::set_lr`; a chain
//! whose parts have different peaks scales it per part (`OptimConfig::lr_ratio`).
//!
//! [`clip_coefficient`]: PyTorch's `clip_grad_norm_` factor from the global gradient norm, or a
//! skip when the norm is not finite. The clip value itself is each optimizer's
//! (`OptimConfig::clip_grad`; a chain clips to the smallest of its parts).

/// Linear warmup, then cosine decay to a tenth of the peak, over `steps` steps.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WarmupCosine {
    /// The peak learning rate (reached at the end of the warmup).
    pub peak: f32,
    /// The run's total number of steps: the schedule spans them.
    pub steps: usize,
}

impl WarmupCosine {
    /// The schedule of a run of `steps` steps peaking at `peak`.
    pub fn new(peak: f32, steps: usize) -> Self {
        WarmupCosine { peak, steps }
    }

    /// Warmup steps: 5% of the run, at least one.
    pub fn warmup_steps(&self) -> usize {
        (self.steps / 20).max(1)
    }

    /// The learning rate of `step` (from 0): `peak · min(1, (step + 1) / warmup) · (0.1 + 0.9 ·
    /// (1 + cos(π · step / steps)) / 2)`, in f64, rounded once.
    pub fn lr_at(&self, step: usize) -> f32 {
        let warmup = self.warmup_steps() as f64;
        let s = step as f64;
        let ramp = ((s + 1.0) / warmup).min(1.0);
        let progress = s / self.steps.max(1) as f64;
        let cosine = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (f64::from(self.peak) * ramp * cosine) as f32
    }
}

/// The factor gradients are multiplied by for the global norm `grad_norm` under the clip value
/// `max_norm`: `min(1, max_norm / (grad_norm + 1e-6))` (PyTorch's `clip_grad_norm_`,
/// `torch/nn/utils/clip_grad.py`), 1 without a clip value; `None` when the norm is not finite:
/// the step is skipped and nothing changes.
pub fn clip_coefficient(grad_norm: f32, max_norm: Option<f32>) -> Option<f32> {
    if !grad_norm.is_finite() {
        return None;
    }
    Some(max_norm.map_or(1.0, |c| (c / (grad_norm + 1e-6)).min(1.0)))
}

#[cfg(test)]
mod tests {
    use super::{WarmupCosine, clip_coefficient};

    /// Warmup to the peak, a tenth of it at the end, never above the peak.
    #[test]
    fn warms_up_then_decays_to_a_tenth() {
        let s = WarmupCosine::new(1e-3, 100);
        assert_eq!(s.warmup_steps(), 5);
        assert!((s.lr_at(0) - 2e-4).abs() < 1e-9);
        assert!(s.lr_at(3) < s.lr_at(4) && s.lr_at(4) > s.lr_at(5) && s.lr_at(4) > 0.99e-3);
        assert!((s.lr_at(100) - 1e-4).abs() < 1e-9);
        assert!((0..=100).all(|i| s.lr_at(i) <= 1e-3));
        assert_eq!(WarmupCosine::new(1.0, 3).warmup_steps(), 1);
    }

    /// No clip value: 1; a norm under the clip value: 1; over it: the ratio; not finite: skip.
    #[test]
    fn clip_coefficients() {
        assert_eq!(clip_coefficient(5.0, None), Some(1.0));
        assert_eq!(clip_coefficient(0.5, Some(1.0)), Some(1.0));
        assert_eq!(clip_coefficient(4.0, Some(1.0)), Some(1.0 / (4.0 + 1e-6)));
        assert_eq!(clip_coefficient(f32::NAN, Some(1.0)), None);
        assert_eq!(clip_coefficient(f32::INFINITY, None), None);
    }
}
