//! A tiny multi-layer perceptron (linear layers with biases, GELU between them, MSE loss) built
//! from `lowbit-nn`'s layers. It owns no parameter or gradient memory: every parameter comes from
//! [`Hooks::param`] and every gradient goes through [`Hooks::accumulate`], in backward order
//! (last layer first, bias before weight), which is the order the buffers' buckets are laid out
//! in. The `lowbit-buffers` and `lowbit-optim` tests train it.
//!
//! [`regression`] is the larger model of the parity suites (RMSNorm blocks, named parameters,
//! deterministic samples), the one the `harness` module (feature `harness`) trains.

pub mod regression;

use lowbit_device::{DType, Device, View};
use lowbit_nn::layers::{Gelu, InputGrad, Linear, Mse, Scratch};
use lowbit_nn::{Hooks, Result};

/// See the module docs. Parameters, in forward order: `w0 [d1, d0]`, `b0 [d1]`, `w1 [d2, d1]`,
/// `b1 [d2]`, …
pub struct Mlp {
    dims: Vec<usize>,
    batch: usize,
    input: View,
    target: View,
    /// Pre-activations per layer (`batch × dims[l + 1]`); the last one is the output.
    pre: Vec<View>,
    /// GELU outputs of the hidden layers (`batch × dims[l + 1]`).
    act: Vec<View>,
    /// Two `batch × max width` f32 scratch buffers for the backward's data gradients.
    dx: [View; 2],
    /// f32 scratch for a parameter's values and a parameter's gradient.
    wscratch: View,
    gscratch: View,
}

impl Mlp {
    /// A model of layers `dims[0] → dims[1] → …` over batches of `batch` rows.
    pub fn new(dev: &mut Device, dims: &[usize], batch: usize) -> Mlp {
        let layers = dims.len() - 1;
        let wide = *dims.iter().max().unwrap();
        let numel = (0..layers).map(|l| dims[l] * dims[l + 1]).max().unwrap();
        Mlp {
            dims: dims.to_vec(),
            batch,
            input: dev.alloc(DType::F32, batch * dims[0]),
            target: dev.alloc(DType::F32, batch * dims[layers]),
            pre: (0..layers)
                .map(|l| dev.alloc(DType::F32, batch * dims[l + 1]))
                .collect(),
            act: (0..layers - 1)
                .map(|l| dev.alloc(DType::F32, batch * dims[l + 1]))
                .collect(),
            dx: [0, 1].map(|_| dev.alloc(DType::F32, batch * wide)),
            wscratch: dev.alloc(DType::F32, numel),
            gscratch: dev.alloc(DType::F32, numel),
        }
    }

    /// `(name, shape)` of every parameter, in forward order.
    pub fn params(dims: &[usize]) -> Vec<(String, Vec<usize>)> {
        (0..dims.len() - 1)
            .flat_map(|l| {
                [
                    (format!("l{l}.weight"), vec![dims[l + 1], dims[l]]),
                    (format!("l{l}.bias"), vec![dims[l + 1]]),
                ]
            })
            .collect()
    }

    /// Rows of one batch.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// The input width and the output width.
    pub fn io(&self) -> (usize, usize) {
        (self.dims[0], *self.dims.last().unwrap())
    }

    /// Linear layer `l`: `w{l}` (`dims[l + 1] × dims[l]`) with bias `b{l}`.
    fn linear(&self, l: usize) -> Linear {
        Linear::new(2 * l, self.dims[l], self.dims[l + 1]).with_bias(2 * l + 1)
    }

    /// One forward and backward of `scale · mse(model(x), target)`; gradients accumulate through
    /// the hooks. Returns the (unscaled) loss.
    pub fn forward_backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: &[f32],
        target: &[f32],
        scale: f32,
    ) -> Result<f32> {
        let layers = self.dims.len() - 1;
        let b = self.batch;
        let s = Scratch {
            param: self.wscratch,
            grad: self.gscratch,
        };
        dev.upload(self.input, x)?;
        dev.upload(self.target, target)?;
        let input_of = |l: usize| if l == 0 { self.input } else { self.act[l - 1] };
        for l in 0..layers {
            self.linear(l)
                .forward(dev, hooks, input_of(l), self.pre[l], b, s)?;
            if l + 1 < layers {
                Gelu.forward(dev, self.pre[l], self.act[l])?;
            }
        }
        let out = self.pre[layers - 1];
        let loss = Mse.forward(dev, out, self.target)?;
        // dY always lives in the first scratch, dA in the second.
        let [dy_buf, da_buf] = self.dx;
        let mut dy = dy_buf.slice(0..b * self.dims[layers])?;
        Mse.backward(dev, out, self.target, dy, scale)?;
        for l in (0..layers).rev() {
            let i = self.dims[l];
            let da = da_buf.slice(0..b * i)?;
            let dx = if l == 0 {
                InputGrad::Skip
            } else {
                InputGrad::Write(da)
            };
            self.linear(l)
                .backward(dev, hooks, input_of(l), dy, dx, b, s)?;
            if l == 0 {
                break;
            }
            // Back through the GELU of layer l − 1 into dY's scratch (dY is dead once dA is
            // computed).
            let dz = dy_buf.slice(0..b * i)?;
            Gelu.backward(dev, self.pre[l - 1], da, dz)?;
            dy = dz;
        }
        Ok(loss)
    }

    /// A deterministic batch `(x, target)` for `(rank, step, microbatch)`.
    pub fn sample(&self, rank: usize, step: usize, micro: usize) -> (Vec<f32>, Vec<f32>) {
        let (i, o) = self.io();
        let s = crate::seed(&[rank as u64, step as u64, micro as u64]);
        (
            crate::values(s, self.batch * i, 1.0),
            crate::values(s ^ 1, self.batch * o, 0.5),
        )
    }
}
