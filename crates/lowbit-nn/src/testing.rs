//! Test helpers: hooks over f32 device buffers that record the calls a layer makes, small
//! deterministic values, and central differences in f32.

use lowbit_buffers::Result as HookResult;
use lowbit_device::{DType, Device, View};

use crate::layers::Scratch;
use crate::{Hooks, Usage};

/// A call a layer made on its hooks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Param(usize, Usage),
    Grad(usize),
    Ready(usize),
}

/// Parameters and gradients in device buffers of their own; every call recorded.
pub(crate) struct TestHooks {
    pub(crate) params: Vec<View>,
    pub(crate) grads: Vec<View>,
    pub(crate) calls: Vec<Call>,
}

impl TestHooks {
    /// f32 parameters with these values, zero gradients.
    pub(crate) fn new(dev: &mut Device, values: &[Vec<f32>]) -> TestHooks {
        let params = values.iter().map(|v| upload(dev, v)).collect();
        let grads = values
            .iter()
            .map(|v| {
                let g = dev.alloc(DType::F32, v.len());
                dev.zero(g).unwrap();
                g
            })
            .collect();
        TestHooks {
            params,
            grads,
            calls: Vec::new(),
        }
    }

    /// The accumulated gradient of parameter `p`.
    pub(crate) fn grad_of(&self, dev: &Device, p: usize) -> Vec<f32> {
        dev.download(self.grads[p]).unwrap()
    }
}

impl Hooks for TestHooks {
    fn param(&mut self, _: &mut Device, p: usize, usage: Usage) -> HookResult<View> {
        self.calls.push(Call::Param(p, usage));
        Ok(self.params[p])
    }
    fn grad(&mut self, _: &mut Device, p: usize) -> HookResult<View> {
        self.calls.push(Call::Grad(p));
        Ok(self.grads[p])
    }
    fn grad_ready(&mut self, _: &mut Device, p: usize) -> HookResult<()> {
        self.calls.push(Call::Ready(p));
        Ok(())
    }
}

/// An f32 device buffer holding `v`.
pub(crate) fn upload(dev: &mut Device, v: &[f32]) -> View {
    let view = dev.alloc(DType::F32, v.len());
    dev.upload(view, v).unwrap();
    view
}

/// Scratch of `n` elements each.
pub(crate) fn scratch(dev: &mut Device, n: usize) -> Scratch {
    Scratch {
        param: dev.alloc(DType::F32, n),
        grad: dev.alloc(DType::F32, n),
    }
}

/// `n` values in `[-1, 1)` from a 32-bit xorshift seeded by `seed`.
pub(crate) fn values(seed: u32, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

/// `Σ a·b` in f32.
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0.0, |s, (x, y)| s + x * y)
}

/// Central differences `(f(x + h·eᵢ) − f(x − h·eᵢ)) / 2h` of `f` at `x`, for every `i`.
pub(crate) fn central_diff(x: &[f32], h: f32, mut f: impl FnMut(&[f32]) -> f32) -> Vec<f32> {
    let mut at = x.to_vec();
    (0..x.len())
        .map(|i| {
            at[i] = x[i] + h;
            let up = f(&at);
            at[i] = x[i] - h;
            let down = f(&at);
            at[i] = x[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Every `got[i]` within `tol · max(1, |want[i]|)` of `want[i]`.
pub(crate) fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs().max(1.0),
            "{what}[{i}]: {g} against {w}"
        );
    }
}
