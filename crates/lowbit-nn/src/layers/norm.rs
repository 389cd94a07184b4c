//! RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"):
//! `y = x · rstd · g`, `rstd = 1/√(mean(x²) + eps)` per row, with a learned gain `g`.

use lowbit_device::{Device, View};

use super::{Scratch, accumulate, load_f32};
use crate::error::check_len;
use crate::{Hooks, Result, Usage};

/// An RMSNorm over rows of `features`: the gain's parameter id, its width and `eps`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RmsNorm {
    /// The gain's parameter id (`[features]`).
    pub weight: usize,
    /// Row width.
    pub features: usize,
    /// Added to the mean square before the inverse square root.
    pub eps: f32,
}

impl RmsNorm {
    /// The `eps` of [`RmsNorm::new`].
    pub const DEFAULT_EPS: f32 = 1e-6;

    /// A norm with `eps` = [`RmsNorm::DEFAULT_EPS`].
    pub fn new(weight: usize, features: usize) -> RmsNorm {
        RmsNorm {
            weight,
            features,
            eps: Self::DEFAULT_EPS,
        }
    }

    /// The norm with another `eps`.
    pub fn with_eps(self, eps: f32) -> RmsNorm {
        RmsNorm { eps, ..self }
    }

    /// `y = RMSNorm(x)` over rows of `features`, keeping each row's inverse RMS in `rstd` (one per
    /// row) for the backward. The gain is cast into `scratch.param`.
    pub fn forward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        y: View,
        rstd: View,
        scratch: Scratch,
    ) -> Result<()> {
        let g = load_f32(dev, hooks, self.weight, Usage::Forward, scratch.param)?;
        check_len("rms_norm gain", g.len(), self.features)?;
        dev.rms_norm(x, g, y, rstd, self.eps)?;
        Ok(())
    }

    /// The backward of [`RmsNorm::forward`] given `dy`, the forward's input `x` and its `rstd`:
    /// writes `dx` and accumulates the gain's gradient (computed into a zeroed head of
    /// `scratch.grad`) and reports it ready.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        rstd: View,
        dy: View,
        dx: View,
        scratch: Scratch,
    ) -> Result<()> {
        let g = load_f32(dev, hooks, self.weight, Usage::Backward, scratch.param)?;
        check_len("rms_norm gain", g.len(), self.features)?;
        let dg = scratch.grad.slice(0..self.features)?;
        // The device op adds into the gain gradient (it sums over rows).
        dev.zero(dg)?;
        dev.rms_norm_backward(x, g, rstd, dy, dx, dg)?;
        accumulate(dev, hooks, self.weight, dg)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::testing::{
        Call, TestHooks, assert_close, central_diff, dot, scratch, upload, values,
    };

    const ROWS: usize = 3;
    const F: usize = 5;

    /// `Σ c ⊙ RMSNorm(x)` with the layer's forward on the device.
    fn probe(dev: &mut Device, g: &[f32], x: &[f32], c: &[f32]) -> f32 {
        let mut hooks = TestHooks::new(dev, &[g.to_vec()]);
        let (xv, y) = (upload(dev, x), dev.alloc(DType::F32, ROWS * F));
        let (rstd, s) = (dev.alloc(DType::F32, ROWS), scratch(dev, F));
        let n = RmsNorm::new(0, F);
        n.forward(dev, &mut hooks, xv, y, rstd, s).unwrap();
        dot(&dev.download::<f32>(y).unwrap(), c)
    }

    #[test]
    fn forward_scales_rows_by_their_inverse_rms_and_the_gain() {
        let mut dev = Device::cpu();
        let (g, x) = (values(1, F), values(2, ROWS * F));
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&g));
        let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * F));
        let (rstd, s) = (dev.alloc(DType::F32, ROWS), scratch(&mut dev, F));
        let n = RmsNorm::new(0, F).with_eps(1e-5);
        n.forward(&mut dev, &mut hooks, xv, y, rstd, s).unwrap();
        let mut want_y = Vec::new();
        let mut want_r = Vec::new();
        for row in x.chunks(F) {
            let r = 1.0 / (dot(row, row) / F as f32 + 1e-5).sqrt();
            want_r.push(r);
            want_y.extend(row.iter().zip(&g).map(|(v, g)| v * r * g));
        }
        assert_close("rstd", &dev.download::<f32>(rstd).unwrap(), &want_r, 1e-5);
        assert_close("y", &dev.download::<f32>(y).unwrap(), &want_y, 1e-5);
        assert_eq!(hooks.calls, [Call::Param(0, Usage::Forward)]);
    }

    #[test]
    fn backward_matches_central_differences() {
        let mut dev = Device::cpu();
        let (g, x, c) = (values(3, F), values(4, ROWS * F), values(5, ROWS * F));
        let mut hooks = TestHooks::new(&mut dev, std::slice::from_ref(&g));
        let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * F));
        let (rstd, s) = (dev.alloc(DType::F32, ROWS), scratch(&mut dev, F));
        let n = RmsNorm::new(0, F);
        n.forward(&mut dev, &mut hooks, xv, y, rstd, s).unwrap();
        // Scratch left dirty: the gain gradient must not add to what it held.
        dev.upload(s.grad, &[7.0; F]).unwrap();
        let (dy, dx) = (upload(&mut dev, &c), dev.alloc(DType::F32, ROWS * F));
        hooks.calls.clear();
        n.backward(&mut dev, &mut hooks, xv, rstd, dy, dx, s)
            .unwrap();
        let order = [
            Call::Param(0, Usage::Backward),
            Call::Grad(0),
            Call::Ready(0),
        ];
        assert_eq!(hooks.calls, order);
        let h = 1e-2;
        let dg = central_diff(&g, h, |g| probe(&mut dev, g, &x, &c));
        let dxn = central_diff(&x, h, |x| probe(&mut dev, &g, x, &c));
        assert_close("dg", &hooks.grad_of(&dev, 0), &dg, 2e-3);
        assert_close("dx", &dev.download::<f32>(dx).unwrap(), &dxn, 2e-3);
    }
}
