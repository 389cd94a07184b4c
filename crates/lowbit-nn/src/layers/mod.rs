//! The layers, one file per family, and the two helpers every layer is built on: fetching a
//! parameter as f32 ([`load_f32`]) and handing a gradient back ([`accumulate`]).

mod activation;
mod attention;
mod chunked_loss;
mod embedding;
mod linear;
mod loss;
mod norm;
mod rope;
mod swiglu;

pub use activation::Gelu;
pub use attention::Attention;
pub use chunked_loss::{ChunkedCrossEntropy, HeadGrad, LossScratch};
pub use embedding::{Embedding, GradStart};
pub use linear::{InputGrad, Linear, shared_input};
pub use loss::{Mse, SoftmaxCrossEntropy};
pub use norm::RmsNorm;
pub use rope::{Llama3RopeScaling, Rope, rope_tables};
pub use swiglu::{SwiGlu, SwiGluActs};

use lowbit_device::{Device, View};

use crate::{Hooks, Result, Usage};

/// The f32 scratch a layer computes through, owned by the model (layers allocate nothing).
/// Both views are overwritten by every layer call that uses them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scratch {
    /// Holds one parameter cast to f32 ([`load_f32`]): at least as long as the largest
    /// parameter the layer loads.
    pub param: View,
    /// Holds one parameter's gradient before [`accumulate`] adds it into the hooks' gradient:
    /// at least as long as the largest parameter the layer's backward computes a gradient for.
    pub grad: View,
}

/// Parameter `p` from the hooks (any float dtype the storage keeps), cast to f32 into the head of
/// `scratch`; the returned view is that head.
pub fn load_f32(
    dev: &mut Device,
    hooks: &mut dyn Hooks,
    p: usize,
    usage: Usage,
    scratch: View,
) -> Result<View> {
    let v = hooks.param(dev, p, usage)?;
    let w = scratch.slice(0..v.len())?;
    dev.cast(v, w)?;
    Ok(w)
}

/// Adds the f32 gradient `g` into the hooks' gradient `p` and reports `p` ready
/// ([`Hooks::accumulate`]: `grad`, an add, `grad_ready`).
pub fn accumulate(dev: &mut Device, hooks: &mut dyn Hooks, p: usize, g: View) -> Result<()> {
    Ok(hooks.accumulate(dev, p, g)?)
}

/// The f64 gradient check of the decoder layers' tests: central differences of an independent
/// f64 forward, and the worst error of an f32 gradient relative to the gradient's largest
/// magnitude.
#[cfg(test)]
pub(crate) mod f64check {
    /// `(f(x + h·eᵢ) − f(x − h·eᵢ)) / 2h` for every `i`, in f64.
    pub(crate) fn central_diff(x: &[f64], h: f64, f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
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

    /// `max_i |got[i] − want[i]| / max_i |want[i]|` (lengths must agree).
    pub(crate) fn worst_rel(got: &[f32], want: &[f64]) -> f64 {
        assert_eq!(got.len(), want.len(), "gradient lengths");
        let scale = want
            .iter()
            .fold(0f64, |m, w| m.max(w.abs()))
            .max(f64::MIN_POSITIVE);
        got.iter()
            .zip(want)
            .fold(0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()))
            / scale
    }

    /// f32 values as f64.
    pub(crate) fn f64s(v: &[f32]) -> Vec<f64> {
        v.iter().map(|&x| f64::from(x)).collect()
    }
}
