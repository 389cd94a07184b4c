//! The Llama MLP (Shazeer 2020, "GLU Variants Improve Transformer"):
//! `down(silu(gate(x)) · up(x))`, three bias-free linear layers.

use lowbit_device::{Device, View};

use super::{InputGrad, Linear, Scratch, shared_input};
use crate::error::check_len;
use crate::{Hooks, Result};

/// The SwiGLU MLP: `gate`, `up` (`[hidden, dim]`) and `down` (`[dim, hidden]`), no biases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGlu {
    /// `gate_proj`: `dim → hidden`.
    pub gate: Linear,
    /// `up_proj`: `dim → hidden`.
    pub up: Linear,
    /// `down_proj`: `hidden → dim`.
    pub down: Linear,
}

/// The activations the forward keeps for the backward, each f32 `rows·hidden`, pairwise
/// disjoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SwiGluActs {
    /// `x·W_gateᵀ`.
    pub gate: View,
    /// `x·W_upᵀ`.
    pub up: View,
    /// `silu(gate) · up`, the input of `down`. [`SwiGlu::backward`] overwrites it.
    pub act: View,
}

impl SwiGlu {
    /// The MLP of width `dim` and hidden width `hidden` from its three weights' parameter ids.
    pub fn new(gate: usize, up: usize, down: usize, dim: usize, hidden: usize) -> SwiGlu {
        SwiGlu {
            gate: Linear::new(gate, dim, hidden),
            up: Linear::new(up, dim, hidden),
            down: Linear::new(down, hidden, dim),
        }
    }

    fn check_acts(&self, rows: usize, acts: &SwiGluActs) -> Result<()> {
        let n = rows * self.gate.out_features;
        check_len("swiglu gate activation", acts.gate.len(), n)?;
        check_len("swiglu up activation", acts.up.len(), n)?;
        check_len("swiglu activation", acts.act.len(), n)
    }

    /// `out [rows, dim] = down(silu(gate(x)) · up(x))`, keeping the three activations in `acts`.
    /// Ops: gate's forward, up's, [`Device::swiglu`], down's (weights fetched in that order).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        out: View,
        rows: usize,
        acts: SwiGluActs,
        scratch: Scratch,
    ) -> Result<()> {
        self.forward_with(dev, hooks, x, None, out, rows, acts, scratch)
    }

    /// `out = down(silu(gate(x)) · up(x)) + residual`: the bits of [`SwiGlu::forward`] and an
    /// add of `residual` (f32 `rows·dim`, disjoint from `out`), the add in down's GEMM where
    /// [`Linear::forward_add`] can.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_add(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        residual: View,
        out: View,
        rows: usize,
        acts: SwiGluActs,
        scratch: Scratch,
    ) -> Result<()> {
        self.forward_with(dev, hooks, x, Some(residual), out, rows, acts, scratch)
    }

    /// The forward, `+ residual` where one is given.
    #[allow(clippy::too_many_arguments)]
    fn forward_with(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        residual: Option<View>,
        out: View,
        rows: usize,
        acts: SwiGluActs,
        scratch: Scratch,
    ) -> Result<()> {
        self.activations(dev, hooks, x, rows, acts, scratch)?;
        self.down
            .forward_with(dev, hooks, acts.act, residual, out, rows, scratch)
    }

    /// The forward's first three ops alone: `acts` from `x [rows, dim]` (gate's and up's weights
    /// fetched in that order), the same bits [`SwiGlu::forward`] keeps. For a model that
    /// recomputes the MLP's activations in its backward instead of keeping them.
    pub fn activations(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        rows: usize,
        acts: SwiGluActs,
        scratch: Scratch,
    ) -> Result<()> {
        self.check_acts(rows, &acts)?;
        // `act` is written only after both products: it holds their shared bf16 input.
        let xs = shared_input(dev, x, acts.act)?;
        self.gate
            .forward(dev, hooks, xs, acts.gate, rows, scratch)?;
        self.up.forward(dev, hooks, xs, acts.up, rows, scratch)?;
        Ok(dev.swiglu(acts.gate, acts.up, acts.act)?)
    }

    /// The backward given `dout [rows, dim]`, the forward's input `x` and its `acts`, in reverse
    /// forward order: down's weight gradient (reported ready) and `dact` into `work[0]`; then
    /// [`Device::swiglu_backward`] writes `dgate` into `work[1]` and `dup` over `acts.act` (no
    /// longer needed); then up's weight (reported) and `dx` as asked ([`InputGrad`]), then gate's
    /// weight (reported) and its part of `dx` added. `work` is two disjoint f32 views of
    /// `rows·hidden`, disjoint from `acts`; with [`InputGrad::Skip`] no input gradient is
    /// computed (and up's and gate's weights are not fetched again).
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: View,
        dout: View,
        dx: InputGrad,
        rows: usize,
        acts: SwiGluActs,
        work: [View; 2],
        scratch: Scratch,
    ) -> Result<()> {
        self.check_acts(rows, &acts)?;
        let n = rows * self.gate.out_features;
        let (dact, dgate) = (work[0], work[1]);
        check_len("swiglu work", dact.len(), n)?;
        check_len("swiglu work", dgate.len(), n)?;
        self.down.backward(
            dev,
            hooks,
            acts.act,
            dout,
            InputGrad::Write(dact),
            rows,
            scratch,
        )?;
        let dup = acts.act;
        dev.swiglu_backward(acts.gate, acts.up, dact, dgate, dup)?;
        // `dact` is consumed: it holds the weight gradients' shared bf16 input.
        let x = shared_input(dev, x, dact)?;
        self.up.backward(dev, hooks, x, dup, dx, rows, scratch)?;
        let rest = match dx {
            InputGrad::Skip => InputGrad::Skip,
            InputGrad::Write(v) | InputGrad::Add(v) => InputGrad::Add(v),
        };
        self.gate
            .backward(dev, hooks, x, dgate, rest, rows, scratch)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::Usage;
    use crate::layers::f64check::{central_diff, f64s, worst_rel};
    use crate::testing::{Call, TestHooks, scratch, upload, values};

    const ROWS: usize = 3;
    const DIM: usize = 4;
    const HID: usize = 5;

    /// `x·Wᵀ` in f64, `x [rows, k]`, `W [n, k]`.
    fn linear64(x: &[f64], w: &[f64], k: usize) -> Vec<f64> {
        let n = w.len() / k;
        let mut y = Vec::with_capacity(x.len() / k * n);
        for xr in x.chunks(k) {
            y.extend(
                w.chunks(k)
                    .map(|wr| xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f64>()),
            );
        }
        y
    }

    /// `Σ c ⊙ down(silu(gate(x)) · up(x))` in f64: `p = [x, Wg, Wu, Wd]`.
    fn loss64(p: [&[f64]; 4], c: &[f64]) -> f64 {
        let [x, wg, wu, wd] = p;
        let (g, u) = (linear64(x, wg, DIM), linear64(x, wu, DIM));
        let act: Vec<f64> = g
            .iter()
            .zip(&u)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        linear64(&act, wd, HID)
            .iter()
            .zip(c)
            .map(|(o, c)| o * c)
            .sum()
    }

    fn acts(dev: &mut Device) -> SwiGluActs {
        let mut a = || dev.alloc(DType::F32, ROWS * HID);
        SwiGluActs {
            gate: a(),
            up: a(),
            act: a(),
        }
    }

    #[test]
    fn forward_values_gradients_and_hook_order() {
        let mut dev = Device::cpu();
        let (wg, wu, wd) = (
            values(1, HID * DIM),
            values(2, HID * DIM),
            values(3, DIM * HID),
        );
        let (x, c) = (values(4, ROWS * DIM), values(5, ROWS * DIM));
        // Larger pre-activations reach silu's curved part.
        let x: Vec<f32> = x.iter().map(|v| 3.0 * v).collect();
        let mut hooks = TestHooks::new(&mut dev, &[wg.clone(), wu.clone(), wd.clone()]);
        let mlp = SwiGlu::new(0, 1, 2, DIM, HID);
        let (xv, out) = (upload(&mut dev, &x), dev.alloc(DType::F32, ROWS * DIM));
        let (a, s) = (acts(&mut dev), scratch(&mut dev, HID * DIM));
        mlp.forward(&mut dev, &mut hooks, xv, out, ROWS, a, s)
            .unwrap();
        let fwd = Usage::Forward;
        let calls = [
            Call::Param(0, fwd),
            Call::Param(1, fwd),
            Call::Param(2, fwd),
        ];
        assert_eq!(hooks.calls, calls);
        let p64 = [f64s(&x), f64s(&wg), f64s(&wu), f64s(&wd)];
        let loss = |p: [&[f64]; 4]| loss64(p, &f64s(&c));
        let got: f64 = dev
            .download::<f32>(out)
            .unwrap()
            .iter()
            .zip(&c)
            .map(|(o, c)| f64::from(*o) * f64::from(*c))
            .sum();
        let want = loss([&p64[0], &p64[1], &p64[2], &p64[3]]);
        assert!(
            (got - want).abs() < 1e-5 * want.abs().max(1.0),
            "{got} vs {want}"
        );

        hooks.calls.clear();
        let (dout, dx) = (upload(&mut dev, &c), upload(&mut dev, &[0.25; ROWS * DIM]));
        let work = [
            dev.alloc(DType::F32, ROWS * HID),
            dev.alloc(DType::F32, ROWS * HID),
        ];
        mlp.backward(
            &mut dev,
            &mut hooks,
            xv,
            dout,
            InputGrad::Add(dx),
            ROWS,
            a,
            work,
            s,
        )
        .unwrap();
        let bwd = Usage::Backward;
        let order = [
            [Call::Grad(2), Call::Ready(2), Call::Param(2, bwd)],
            [Call::Grad(1), Call::Ready(1), Call::Param(1, bwd)],
            [Call::Grad(0), Call::Ready(0), Call::Param(0, bwd)],
        ];
        assert_eq!(hooks.calls, order.concat());
        let numeric = |k: usize| {
            central_diff(&p64[k], 1e-6, |v| {
                let mut p: [&[f64]; 4] = [&p64[0], &p64[1], &p64[2], &p64[3]];
                p[k] = v;
                loss(p)
            })
        };
        let dx_got: Vec<f32> = dev
            .download::<f32>(dx)
            .unwrap()
            .iter()
            .map(|v| v - 0.25)
            .collect();
        let mut worst = 0f64;
        for (k, got) in [
            (0, dx_got),
            (1, hooks.grad_of(&dev, 0)),
            (2, hooks.grad_of(&dev, 1)),
            (3, hooks.grad_of(&dev, 2)),
        ] {
            let err = worst_rel(&got, &numeric(k));
            assert!(err < 1e-3, "input {k}: worst relative error {err}");
            worst = worst.max(err);
        }
        // Worst relative errors measured: x 1.3e-7, W_gate 7.6e-8, W_up 7.1e-8, W_down 1.3e-7.
        assert!(worst < 1e-5, "worst relative error {worst}");

        // Skip: no input gradient, so only down's weight is fetched again (for dact).
        hooks.calls.clear();
        mlp.forward(&mut dev, &mut hooks, xv, out, ROWS, a, s)
            .unwrap();
        hooks.calls.clear();
        mlp.backward(
            &mut dev,
            &mut hooks,
            xv,
            dout,
            InputGrad::Skip,
            ROWS,
            a,
            work,
            s,
        )
        .unwrap();
        let mut skip = vec![Call::Grad(2), Call::Ready(2), Call::Param(2, bwd)];
        skip.extend([1, 0].map(|p| [Call::Grad(p), Call::Ready(p)]).concat());
        assert_eq!(hooks.calls, skip);
    }

    #[test]
    fn shapes_are_checked_before_any_call() {
        let mut dev = Device::cpu();
        let mut hooks = TestHooks::new(&mut dev, &[values(1, HID * DIM)]);
        let mlp = SwiGlu::new(0, 0, 0, DIM, HID);
        let (x, out) = (
            dev.alloc(DType::F32, ROWS * DIM),
            dev.alloc(DType::F32, ROWS * DIM),
        );
        let mut a = acts(&mut dev);
        a.act = dev.alloc(DType::F32, ROWS * HID - 1);
        let s = scratch(&mut dev, HID * DIM);
        assert!(
            mlp.forward(&mut dev, &mut hooks, x, out, ROWS, a, s)
                .is_err()
        );
        assert!(hooks.calls.is_empty());
    }
}
