//! Activations: parameter-free, elementwise, on the device ops.

use lowbit_device::{Device, View};

use crate::Result;

/// GELU with the tanh approximation (Hendrycks & Gimpel 2016; PyTorch's
/// `gelu(approximate="tanh")`): `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, in the device's
/// fixed evaluation order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Gelu;

impl Gelu {
    /// `y = gelu(x)` (`y` must not alias `x`).
    pub fn forward(&self, dev: &mut Device, x: View, y: View) -> Result<()> {
        Ok(dev.gelu(x, y)?)
    }

    /// `dx = gelu'(x) · dy`, from the forward's input `x`.
    pub fn backward(&self, dev: &mut Device, x: View, dy: View, dx: View) -> Result<()> {
        Ok(dev.gelu_backward(x, dy, dx)?)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::testing::{assert_close, central_diff, dot, upload, values};

    fn host_gelu(x: f32) -> f32 {
        let beta = (2.0 / std::f32::consts::PI).sqrt();
        0.5 * x * (1.0 + (beta * (x + 0.044715 * x * x * x)).tanh())
    }

    #[test]
    fn gelu_forward_is_the_tanh_approximation() {
        let mut dev = Device::cpu();
        let x: Vec<f32> = values(1, 16).iter().map(|v| 3.0 * v).collect();
        let (xv, y) = (upload(&mut dev, &x), dev.alloc(DType::F32, x.len()));
        Gelu.forward(&mut dev, xv, y).unwrap();
        let want: Vec<f32> = x.iter().map(|&v| host_gelu(v)).collect();
        assert_close("gelu", &dev.download::<f32>(y).unwrap(), &want, 1e-6);
    }

    #[test]
    fn gelu_backward_matches_central_differences() {
        let mut dev = Device::cpu();
        let x: Vec<f32> = values(2, 16).iter().map(|v| 3.0 * v).collect();
        let c = values(3, 16);
        let (xv, dy, dx) = (
            upload(&mut dev, &x),
            upload(&mut dev, &c),
            upload(&mut dev, &c),
        );
        Gelu.backward(&mut dev, xv, dy, dx).unwrap();
        let want = central_diff(&x, 1e-2, |x| {
            let (xv, y) = (upload(&mut dev, x), dev.alloc(DType::F32, x.len()));
            Gelu.forward(&mut dev, xv, y).unwrap();
            dot(&dev.download::<f32>(y).unwrap(), &c)
        });
        assert_close("dx", &dev.download::<f32>(dx).unwrap(), &want, 2e-3);
    }
}
