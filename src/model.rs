//! A small regression model on the device layer, with a hand-written backward, used by the
//! integration tests of the data-parallel machinery (`lowbit train` uses the MoE language model
//! in `train::lm`). It is written against `lowbit-buffers`' public [`Hooks`] only, as any
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

use lowbit_buffers::BufferError;
use lowbit_device::{DType, Device, DeviceError, MatmulSpec, View};

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

pub use lowbit_buffers::{Hooks, Usage};

/// Errors of the models.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A device operation failed.
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A hook failed (buffers, collectives, protocol violations), with its typed source.
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Bad input to a model (token ids, batch shapes).
    #[error("{0}")]
    Input(String),
}

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

    /// Loads parameter `p` as f32 into the weight scratch.
    fn load(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        p: usize,
        usage: Usage,
    ) -> Result<View, ModelError> {
        load_f32(dev, hooks, p, usage, self.wbuf)
    }

    /// `y = a·Wᵀ + b` for layer parameters `(pw, pb)`.
    fn linear(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        (pw, pb): (usize, usize),
        a: View,
        y: View,
        (k, n): (usize, usize),
    ) -> Result<(), ModelError> {
        linear(dev, hooks, (pw, pb), a, y, (self.batch, k, n), self.wbuf)
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
        let (d, h, o) = (self.shape.input, self.shape.hidden, self.shape.output);
        let nb = self.shape.blocks;
        dev.upload(self.acts[0], x)?;
        let tgt = dev.alloc(DType::F32, target.len());
        dev.upload(tgt, target)?;
        // Forward.
        self.linear(dev, hooks, (0, 1), self.acts[0], self.acts[1], (d, h))?;
        for k in 0..nb {
            let base = 2 + 3 * k;
            self.linear(
                dev,
                hooks,
                (base, base + 1),
                self.acts[k + 1],
                self.z[k],
                (h, h),
            )?;
            let g = self.load(dev, hooks, base + 2, Usage::Forward)?;
            dev.rms_norm(self.z[k], g, self.n[k], self.rstd[k], 1e-6)?;
            dev.gelu(self.n[k], self.acts[k + 2])?;
        }
        let pout = 2 + 3 * nb;
        self.linear(
            dev,
            hooks,
            (pout, pout + 1),
            self.acts[nb + 1],
            self.out,
            (h, o),
        )?;
        let loss = dev.mse_loss(self.out, tgt)?;
        // Backward.
        dev.mse_loss_backward(self.out, tgt, self.dout, loss_scale)?;
        dev.free(tgt)?;
        let mut dy = self.dout;
        let mut dy_width = o;
        for layer in (0..=nb + 1).rev() {
            let (pw, in_width) = match layer {
                0 => (0, d),
                l if l == nb + 1 => (pout, h),
                l => (2 + 3 * (l - 1), h),
            };
            // Weight and bias gradients of this linear layer.
            self.weight_grad(
                dev,
                hooks,
                (pw, pw + 1),
                dy,
                self.acts[layer],
                (dy_width, in_width),
            )?;
            if layer == 0 {
                break;
            }
            // Gradient w.r.t. the layer input, dA = dY·W, into the scratch dY does not use.
            let (da, spare) = if dy == self.dh[0] {
                (self.dh[1], self.dh[0])
            } else {
                (self.dh[0], self.dh[1])
            };
            let w = self.load(dev, hooks, pw, Usage::Backward)?;
            let spec = MatmulSpec {
                m: self.batch,
                n: in_width,
                k: dy_width,
                trans_a: false,
                trans_b: false,
                accumulate: false,
            };
            dev.matmul(dy, w, da, &spec)?;
            if layer >= 2 {
                // Back through block (layer − 2)'s GELU and RMSNorm to its pre-norm output;
                // dY is dead by now, so its scratch holds the intermediate.
                let k = layer - 2;
                let pg = 2 + 3 * k + 2;
                dev.gelu_backward(self.n[k], da, spare)?;
                let g = self.load(dev, hooks, pg, Usage::Backward)?;
                let dg = self.gbuf.slice(0..h)?;
                dev.zero(dg)?;
                dev.rms_norm_backward(self.z[k], g, self.rstd[k], spare, da, dg)?;
                self.accumulate(dev, hooks, pg, dg)?;
            }
            dy = da;
            dy_width = in_width;
        }
        Ok(loss)
    }

    fn weight_grad(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        (pw, pb): (usize, usize),
        dy: View,
        a: View,
        (out_w, in_w): (usize, usize),
    ) -> Result<(), ModelError> {
        let db = self.gbuf.slice(0..out_w)?;
        dev.bias_grad(dy, db, false)?;
        self.accumulate(dev, hooks, pb, db)?;
        let dw = self.gbuf.slice(0..out_w * in_w)?;
        let spec = MatmulSpec {
            m: out_w,
            n: in_w,
            k: self.batch,
            trans_a: true,
            trans_b: false,
            accumulate: false,
        };
        dev.matmul(dy, a, dw, &spec)?;
        self.accumulate(dev, hooks, pw, dw)
    }

    fn accumulate(
        &self,
        dev: &mut Device,
        hooks: &mut dyn Hooks,
        p: usize,
        g: View,
    ) -> Result<(), ModelError> {
        accumulate(dev, hooks, p, g)
    }
}

/// Parameter `p` from the hooks, cast to f32 into the head of `scratch`.
pub fn load_f32(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    usage: Usage,
    scratch: View,
) -> Result<View, ModelError> {
    let v = hooks.param(dev, p, usage)?;
    let w = scratch.slice(0..v.len())?;
    dev.cast(v, w)?;
    Ok(w)
}

/// Adds the f32 gradient `g` into the hooks' gradient `p` and reports `p` ready.
pub fn accumulate(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    g: View,
) -> Result<(), ModelError> {
    let dst = hooks.grad(dev, p)?;
    dev.add(g, dst)?;
    Ok(hooks.grad_ready(dev, p)?)
}

/// `y[m, n] = a[m, k] · Wᵀ + b` for the layer parameters `(pw, pb)`, loading each through
/// `scratch`.
pub fn linear(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    (pw, pb): (usize, usize),
    a: View,
    y: View,
    (m, k, n): (usize, usize, usize),
    scratch: View,
) -> Result<(), ModelError> {
    let w = load_f32(dev, hooks, pw, Usage::Forward, scratch)?;
    let spec = MatmulSpec {
        m,
        n,
        k,
        trans_a: false,
        trans_b: true,
        accumulate: false,
    };
    dev.matmul(a, w, y, &spec)?;
    let b = load_f32(dev, hooks, pb, Usage::Forward, scratch)?;
    dev.add_bias(y, b)?;
    Ok(())
}
