//! Losses: a scalar from predictions and targets, and the gradient of `scale ·` that scalar
//! (the loss scale folds the microbatch average into the backward).

use lowbit_device::{Device, View};

use crate::Result;

/// Mean squared error over all elements: `mean((pred − target)²)`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mse;

impl Mse {
    /// The mean squared error of `pred` against `target` (same length).
    pub fn forward(&self, dev: &mut Device, pred: View, target: View) -> Result<f32> {
        Ok(dev.mse_loss(pred, target)?)
    }

    /// `dpred = scale · ∂mse/∂pred = scale · 2·(pred − target)/n`.
    pub fn backward(
        &self,
        dev: &mut Device,
        pred: View,
        target: View,
        dpred: View,
        scale: f32,
    ) -> Result<()> {
        Ok(dev.mse_loss_backward(pred, target, dpred, scale)?)
    }
}

/// Softmax cross-entropy averaged over rows: `mean_r(logsumexp(logits_r) − logits_r[t_r])`, the
/// targets `t_r` given as class ids stored in f32 (one per row).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SoftmaxCrossEntropy;

impl SoftmaxCrossEntropy {
    /// The mean cross-entropy of `logits [rows, classes]` against `targets [rows]`.
    pub fn forward(&self, dev: &mut Device, logits: View, targets: View) -> Result<f32> {
        Ok(dev.softmax_cross_entropy(logits, targets)?)
    }

    /// `dlogits = scale · (softmax(logits) − onehot(targets)) / rows`.
    pub fn backward(
        &self,
        dev: &mut Device,
        logits: View,
        targets: View,
        dlogits: View,
        scale: f32,
    ) -> Result<()> {
        Ok(dev.softmax_cross_entropy_backward(logits, targets, dlogits, scale)?)
    }
}

#[cfg(test)]
mod tests {
    use lowbit_device::DType;

    use super::*;
    use crate::testing::{assert_close, central_diff, upload, values};

    const SCALE: f32 = 0.75;

    #[test]
    fn mse_forward_and_backward() {
        let mut dev = Device::cpu();
        let (p, t) = (values(1, 12), values(2, 12));
        let (pv, tv) = (upload(&mut dev, &p), upload(&mut dev, &t));
        let loss = Mse.forward(&mut dev, pv, tv).unwrap();
        let sq = p
            .iter()
            .zip(&t)
            .fold(0f32, |s, (a, b)| s + (a - b) * (a - b));
        assert_close("mse", &[loss], &[sq / 12.0], 1e-6);
        let dp = dev.alloc(DType::F32, 12);
        Mse.backward(&mut dev, pv, tv, dp, SCALE).unwrap();
        let want = central_diff(&p, 1e-2, |p| {
            let pv = upload(&mut dev, p);
            SCALE * Mse.forward(&mut dev, pv, tv).unwrap()
        });
        assert_close("dpred", &dev.download::<f32>(dp).unwrap(), &want, 1e-3);
    }

    #[test]
    fn cross_entropy_forward_and_backward() {
        let (rows, classes) = (3, 5);
        let mut dev = Device::cpu();
        let z: Vec<f32> = values(3, rows * classes).iter().map(|v| 2.0 * v).collect();
        let t = [4.0f32, 0.0, 2.0];
        let (zv, tv) = (upload(&mut dev, &z), upload(&mut dev, &t));
        let loss = SoftmaxCrossEntropy.forward(&mut dev, zv, tv).unwrap();
        let mut total = 0f32;
        for (row, &t) in z.chunks(classes).zip(&t) {
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let lse = mx + row.iter().map(|v| (v - mx).exp()).sum::<f32>().ln();
            total += lse - row[t as usize];
        }
        assert_close("xent", &[loss], &[total / rows as f32], 1e-5);
        let dz = dev.alloc(DType::F32, rows * classes);
        SoftmaxCrossEntropy
            .backward(&mut dev, zv, tv, dz, SCALE)
            .unwrap();
        let want = central_diff(&z, 1e-2, |z| {
            let zv = upload(&mut dev, z);
            SCALE * SoftmaxCrossEntropy.forward(&mut dev, zv, tv).unwrap()
        });
        assert_close("dlogits", &dev.download::<f32>(dz).unwrap(), &want, 1e-3);
    }
}
