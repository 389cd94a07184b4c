//! The layers, one file per family, and the two helpers every layer is built on: fetching a
//! parameter as f32 ([`load_f32`]) and handing a gradient back ([`accumulate`]).

mod activation;
mod attention;
mod linear;
mod loss;
mod norm;

pub use activation::Gelu;
pub use attention::Attention;
pub use linear::{InputGrad, Linear};
pub use loss::{Mse, SoftmaxCrossEntropy};
pub use norm::RmsNorm;

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
