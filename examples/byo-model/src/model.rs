//! The model, written as any outside project would write its own: a two-layer MLP regressor
//! `y = W2·gelu(W1·x + b1) + b2` with a hand-written backward on `lowbit-device` ops. It owns
//! activations and scratch, never parameters or gradients: it asks the [`Hooks`] for them.

use lowbit_buffers::{Hooks, Result, Usage};
use lowbit_device::{DType, Device, MatmulSpec, View};

/// Inputs, hidden width, outputs.
pub const DIMS: (usize, usize, usize) = (32, 64, 32);

/// `(name, shape)` of the parameters in forward order: the model's own list.
pub fn params() -> Vec<(&'static str, Vec<usize>)> {
    let (d, h, o) = DIMS;
    vec![
        ("fc1.weight", vec![h, d]),
        ("fc1.bias", vec![h]),
        ("fc2.weight", vec![o, h]),
        ("fc2.bias", vec![o]),
    ]
}

/// Activations and scratch for a batch of `rows`.
pub struct Mlp {
    rows: usize,
    x: View,
    h: View,
    a: View,
    y: View,
    t: View,
    dy: View,
    da: View,
    w: View,
    g: View,
}

fn mm(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool) -> MatmulSpec {
    MatmulSpec {
        m,
        n,
        k,
        trans_a,
        trans_b,
        accumulate: false,
    }
}

impl Mlp {
    /// Allocates the activations.
    pub fn new(dev: &mut Device, rows: usize) -> Mlp {
        let (d, h, o) = DIMS;
        let mut f = |n| dev.alloc(DType::F32, n);
        Mlp {
            rows,
            x: f(rows * d),
            h: f(rows * h),
            a: f(rows * h),
            y: f(rows * o),
            t: f(rows * o),
            dy: f(rows * o),
            da: f(rows * h),
            w: f(h * d.max(o)),
            g: f(h * d.max(o)),
        }
    }

    /// A parameter as f32 (whatever the hooks hand out: dequantized MXFP8, bf16 biases).
    fn load(&self, dev: &mut Device, hooks: &mut dyn Hooks, p: usize, u: Usage) -> Result<View> {
        let v = hooks.param(dev, p, u)?;
        let w = self.w.slice(0..v.len())?;
        dev.cast(v, w)?;
        Ok(w)
    }

    /// Forward and backward of one batch; gradients of `scale · loss` go into the hooks.
    pub fn step(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        (x, t): (&[f32], &[f32]),
        scale: f32,
    ) -> Result<f32> {
        let ((d, h, o), b) = (DIMS, self.rows);
        dev.upload(self.x, x)?;
        dev.upload(self.t, t)?;
        let w1 = self.load(dev, hooks, 0, Usage::Forward)?;
        dev.matmul(self.x, w1, self.h, &mm(b, h, d, false, true))?;
        let b1 = self.load(dev, hooks, 1, Usage::Forward)?;
        dev.add_bias(self.h, b1)?;
        dev.gelu(self.h, self.a)?;
        let w2 = self.load(dev, hooks, 2, Usage::Forward)?;
        dev.matmul(self.a, w2, self.y, &mm(b, o, h, false, true))?;
        let b2 = self.load(dev, hooks, 3, Usage::Forward)?;
        dev.add_bias(self.y, b2)?;
        let loss = dev.mse_loss(self.y, self.t)?;
        // Backward, last layer first (the order bucket reductions expect).
        dev.mse_loss_backward(self.y, self.t, self.dy, scale)?;
        dev.bias_grad(self.dy, self.g.slice(0..o)?, false)?;
        hooks.accumulate(dev, 3, self.g.slice(0..o)?)?;
        dev.matmul(
            self.dy,
            self.a,
            self.g.slice(0..o * h)?,
            &mm(o, h, b, true, false),
        )?;
        hooks.accumulate(dev, 2, self.g.slice(0..o * h)?)?;
        let w2 = self.load(dev, hooks, 2, Usage::Backward)?;
        dev.matmul(self.dy, w2, self.da, &mm(b, h, o, false, false))?;
        dev.gelu_backward(self.h, self.da, self.a)?; // `a` is dead: it holds dh now
        dev.bias_grad(self.a, self.g.slice(0..h)?, false)?;
        hooks.accumulate(dev, 1, self.g.slice(0..h)?)?;
        dev.matmul(
            self.a,
            self.x,
            self.g.slice(0..h * d)?,
            &mm(h, d, b, true, false),
        )?;
        hooks.accumulate(dev, 0, self.g.slice(0..h * d)?)?;
        Ok(loss)
    }
}
