//! The model, written as any outside project would write its own: a two-layer MLP regressor
//! `y = W2·gelu(W1·x + b1) + b2` from `lowbit-nn`'s layers, the backward called by hand in
//! reverse order. It owns activations and scratch, never parameters or gradients: the layers ask
//! the [`Hooks`] for them.

use lowbit_device::{DType, Device, View};
use lowbit_nn::layers::{Gelu, InputGrad, Linear, Mse, Scratch};
use lowbit_nn::{Hooks, Result};

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

/// The layers: `fc1` (parameters 0 and 1) and `fc2` (2 and 3).
fn layers() -> [Linear; 2] {
    let (d, h, o) = DIMS;
    [
        Linear::new(0, d, h).with_bias(1),
        Linear::new(2, h, o).with_bias(3),
    ]
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

    /// Forward and backward of one batch; gradients of `scale · loss` go into the hooks.
    pub fn step(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        (x, t): (&[f32], &[f32]),
        scale: f32,
    ) -> Result<f32> {
        let [fc1, fc2] = layers();
        let b = self.rows;
        // Parameters are cast to f32 (whatever the hooks hand out: dequantized MXFP8, bf16
        // biases) into `w`; gradients are computed into `g` before the hooks add them.
        let s = Scratch {
            param: self.w,
            grad: self.g,
        };
        dev.upload(self.x, x)?;
        dev.upload(self.t, t)?;
        fc1.forward(dev, hooks, self.x, self.h, b, s)?;
        Gelu.forward(dev, self.h, self.a)?;
        fc2.forward(dev, hooks, self.a, self.y, b, s)?;
        let loss = Mse.forward(dev, self.y, self.t)?;
        // Backward, last layer first (the order bucket reductions expect).
        Mse.backward(dev, self.y, self.t, self.dy, scale)?;
        let da = InputGrad::Write(self.da);
        fc2.backward(dev, hooks, self.a, self.dy, da, b, s)?;
        Gelu.backward(dev, self.h, self.da, self.a)?; // `a` is dead: it holds dh now
        fc1.backward(dev, hooks, self.x, self.a, InputGrad::Skip, b, s)?;
        Ok(loss)
    }
}
