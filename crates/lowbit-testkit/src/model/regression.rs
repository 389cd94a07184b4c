//! A small regression model on the device layer, with a hand-written backward, used by the
//! parity suites of the data-parallel machinery through the `harness` module (`lowbit train` uses
//! the MoE language model in the `lowbit` package's `train::lm`). It is built from `lowbit-nn`'s layers over the public [`Hooks`] only, as any
//! outside model would be.
//!
//! `x [B, d] → Linear(d→h)+bias → K × [Linear(h→h)+bias → RMSNorm → GELU] → Linear(h→o)+bias`,
//! loss = MSE against a target. Parameters in forward order: `in.weight [h, d]`, `in.bias [h]`,
//! then per block `weight [h, h]`, `bias [h]`, `norm [h]`, then `out.weight [o, h]`, `out.bias [o]`.
//!
//! The model never owns parameter or gradient memory: it asks its [`Hooks`] for each parameter's
//! view right before using it (the forward pre-hook, where a lazily gathered bucket is waited
//! for), accumulates each gradient into the view the hooks give, and reports the parameter as
//! ready right after (the backward hook, where a bucket's reduction may start).

use lowbit_device::{DType, Device, View};
use lowbit_nn::layers::{Gelu, InputGrad, Linear, Mse, RmsNorm, Scratch};

/// The model's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlpShape {
    /// Input features.
    pub input: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Hidden blocks.
    pub blocks: usize,
    /// Outputs.
    pub output: usize,
}

pub use lowbit_nn::layers::{accumulate, load_f32};
pub use lowbit_nn::{Hooks, Usage};

/// Errors of the models: the layers' errors (device and hook failures with their typed source,
/// bad input).
pub use lowbit_nn::NnError as ModelError;

impl MlpShape {
    /// `(name, shape)` of every parameter, in forward order.
    pub fn params(&self) -> Vec<(String, Vec<usize>)> {
        let (d, h, o) = (self.input, self.hidden, self.output);
        let mut v = vec![
            ("in.weight".to_string(), vec![h, d]),
            ("in.bias".to_string(), vec![h]),
        ];
        for k in 0..self.blocks {
            v.push((format!("blocks.{k}.weight"), vec![h, h]));
            v.push((format!("blocks.{k}.bias"), vec![h]));
            v.push((format!("blocks.{k}.norm"), vec![h]));
        }
        v.push(("out.weight".to_string(), vec![o, h]));
        v.push(("out.bias".to_string(), vec![o]));
        v
    }

    /// Deterministic initial values: weights uniform in ±1/√fan_in, biases 0, norms 1.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let mut rng = SplitMix64(seed);
        self.params()
            .into_iter()
            .map(|(name, shape)| {
                let n: usize = shape.iter().product();
                if name.ends_with(".weight") {
                    let bound = 1.0 / (shape[1] as f32).sqrt();
                    (0..n).map(|_| bound * rng.uniform()).collect()
                } else if name.ends_with(".norm") {
                    vec![1.0; n]
                } else {
                    vec![0.0; n]
                }
            })
            .collect()
    }
}

/// The deterministic generator of initial values and data (`lowbit_io`'s SplitMix64).
pub use lowbit_io::rng::SplitMix64;

/// Synthetic regression data: sample `i` is a pure function of `(seed, i)`, so any split of a
/// global batch over ranks sees the same samples. Target: `tanh` of a fixed random projection.
pub fn sample(shape: &MlpShape, seed: u64, i: u64) -> (Vec<f32>, Vec<f32>) {
    let mut rng = SplitMix64(seed ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let x: Vec<f32> = (0..shape.input).map(|_| rng.uniform()).collect();
    let mut proj = SplitMix64(seed.wrapping_add(17));
    let y = (0..shape.output)
        .map(|_| {
            let s: f32 = x.iter().map(|&v| v * proj.uniform()).sum();
            (s / (shape.input as f32).sqrt()).tanh()
        })
        .collect();
    (x, y)
}

/// Scratch memory of one forward/backward, sized for a batch.
#[derive(Debug)]
pub struct Mlp {
    shape: MlpShape,
    batch: usize,
    /// Activations: input to each linear layer (blocks + 2 entries).
    acts: Vec<View>,
    /// Pre-norm outputs `z`, norm outputs `n` and `rstd` per block.
    z: Vec<View>,
    n: Vec<View>,
    rstd: Vec<View>,
    out: View,
    dout: View,
    dh: [View; 2],
    /// f32 copies of the current parameter (largest parameter size).
    wbuf: View,
    gbuf: View,
}

impl Mlp {
    /// Allocates scratch for batches of `batch` rows.
    pub fn new(dev: &mut Device, shape: MlpShape, batch: usize) -> Mlp {
        let (d, h, o) = (shape.input, shape.hidden, shape.output);
        let mut acts = vec![dev.alloc(DType::F32, batch * d)];
        for _ in 0..=shape.blocks {
            acts.push(dev.alloc(DType::F32, batch * h));
        }
        let per_block = |dev: &mut Device, n| {
            (0..shape.blocks)
                .map(|_| dev.alloc(DType::F32, n))
                .collect()
        };
        let largest = (h * d).max(h * h).max(o * h);
        Mlp {
            shape,
            batch,
            z: per_block(dev, batch * h),
            n: per_block(dev, batch * h),
            rstd: per_block(dev, batch),
            acts,
            out: dev.alloc(DType::F32, batch * o),
            dout: dev.alloc(DType::F32, batch * o),
            dh: [
                dev.alloc(DType::F32, batch * h),
                dev.alloc(DType::F32, batch * h),
            ],
            wbuf: dev.alloc(DType::F32, largest),
            gbuf: dev.alloc(DType::F32, largest),
        }
    }

    /// Batch rows this scratch holds.
    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Linear layer `l` of the model: 0 is the input layer, `1..=blocks` the blocks', then the
    /// output layer.
    fn linear(&self, l: usize) -> Linear {
        let (d, h, o) = (self.shape.input, self.shape.hidden, self.shape.output);
        let nb = self.shape.blocks;
        let (pw, i, n) = match l {
            0 => (0, d, h),
            l if l == nb + 1 => (2 + 3 * nb, h, o),
            l => (2 + 3 * (l - 1), h, h),
        };
        Linear::new(pw, i, n).with_bias(pw + 1)
    }

    /// Block `k`'s norm.
    fn norm(&self, k: usize) -> RmsNorm {
        RmsNorm::new(2 + 3 * k + 2, self.shape.hidden)
    }

    fn scratch(&self) -> Scratch {
        Scratch {
            param: self.wbuf,
            grad: self.gbuf,
        }
    }

    /// Forward and backward of one microbatch; gradients are accumulated (scaled by
    /// `loss_scale`) into the hooks' gradient views. Returns the (unscaled) loss.
    pub fn forward_backward(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        x: &[f32],
        target: &[f32],
        loss_scale: f32,
    ) -> Result<f32, ModelError> {
        let nb = self.shape.blocks;
        let (b, s) = (self.batch, self.scratch());
        dev.upload(self.acts[0], x)?;
        let tgt = dev.alloc(DType::F32, target.len());
        dev.upload(tgt, target)?;
        // Forward.
        self.linear(0)
            .forward(dev, hooks, self.acts[0], self.acts[1], b, s)?;
        for k in 0..nb {
            self.linear(k + 1)
                .forward(dev, hooks, self.acts[k + 1], self.z[k], b, s)?;
            self.norm(k)
                .forward(dev, hooks, self.z[k], self.n[k], self.rstd[k], s)?;
            Gelu.forward(dev, self.n[k], self.acts[k + 2])?;
        }
        self.linear(nb + 1)
            .forward(dev, hooks, self.acts[nb + 1], self.out, b, s)?;
        let loss = Mse.forward(dev, self.out, tgt)?;
        // Backward.
        Mse.backward(dev, self.out, tgt, self.dout, loss_scale)?;
        dev.free(tgt)?;
        let mut dy = self.dout;
        for layer in (0..=nb + 1).rev() {
            // Weight and bias gradients of this linear layer, then the gradient w.r.t. its input
            // (dA = dY·W) into the scratch dY does not use.
            let (da, spare) = if dy == self.dh[0] {
                (self.dh[1], self.dh[0])
            } else {
                (self.dh[0], self.dh[1])
            };
            let dx = if layer == 0 {
                InputGrad::Skip
            } else {
                InputGrad::Write(da)
            };
            self.linear(layer)
                .backward(dev, hooks, self.acts[layer], dy, dx, b, s)?;
            if layer == 0 {
                break;
            }
            if layer >= 2 {
                // Back through block (layer − 2)'s GELU and RMSNorm to its pre-norm output;
                // dY is dead by now, so its scratch holds the intermediate.
                let k = layer - 2;
                Gelu.backward(dev, self.n[k], da, spare)?;
                self.norm(k)
                    .backward(dev, hooks, self.z[k], self.rstd[k], spare, da, s)?;
            }
            dy = da;
        }
        Ok(loss)
    }
}
