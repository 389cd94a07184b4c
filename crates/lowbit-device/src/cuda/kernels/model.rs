//! Launches of matmul and the model ops: bias and its gradient, RMSNorm forward and backward,
//! GELU forward and backward, the MSE loss and softmax cross-entropy with their gradients.

use super::dt;
use crate::cuda::CudaDevice;
use crate::{DType, DeviceError, MatmulSpec, Result, View};

impl CudaDevice {
    pub(crate) fn matmul(&mut self, a: View, b: View, c: View, spec: &MatmulSpec) -> Result<()> {
        let ([ap, bp], [cp]) = self.ptrs("matmul", [a, b], [c])?;
        let MatmulSpec { m, n, k, .. } = *spec;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let gx = u32::try_from(n.div_ceil(128))
            .map_err(|_| DeviceError::Unsupported(format!("matmul: n = {n} is too large")))?;
        let gy = u32::try_from(m.min(65535)).unwrap_or(65535);
        let [ta, tb, acc] = [spec.trans_a, spec.trans_b, spec.accumulate].map(u32::from);
        let args = args![
            ap,
            dt(a.dtype()),
            bp,
            dt(b.dtype()),
            cp,
            m,
            n,
            k,
            ta,
            tb,
            acc
        ];
        // SAFETY: views validated above with the lengths m·k, k·n, m·n.
        unsafe { self.launch("matmul", (gx, gy, 1), (128, 1, 1), &args) }
    }

    pub(crate) fn add_bias(&mut self, x: View, bias: View) -> Result<()> {
        let ([b], [xp]) = self.ptrs("add_bias", [bias], [x])?;
        let (n, cols) = (x.len(), bias.len());
        if cols == 0 {
            return Ok(());
        }
        // SAFETY: views validated above (x holds whole rows of bias.len()).
        unsafe { self.launch_n("add_bias", n, &args![xp, b, n, cols]) }
    }

    pub(crate) fn bias_grad(&mut self, dy: View, dbias: View, accumulate: bool) -> Result<()> {
        let ([d], [db]) = self.ptrs("bias_grad", [dy], [dbias])?;
        let cols = dbias.len();
        let rows = dy.len().checked_div(cols).unwrap_or(0);
        let args = args![d, db, rows, cols, u32::from(accumulate)];
        // SAFETY: views validated above (dy holds whole rows of cols).
        unsafe { self.launch_n("bias_grad", cols, &args) }
    }

    /// RMSNorm of `[x, weight]` into `[y, rstd]` (the reciprocal RMS of each row).
    pub(crate) fn rms_norm(&mut self, ins: [View; 2], outs: [View; 2], eps: f32) -> Result<()> {
        let ([xp, wp], [yp, rp]) = self.ptrs("rms_norm", ins, outs)?;
        let ([x, weight], [y, rstd]) = (ins, outs);
        let (rows, cols, n) = (rstd.len(), weight.len(), x.len());
        // SAFETY: views validated above (x and y rows·cols, rstd rows).
        unsafe { self.launch_n("rms_norm_rstd", rows, &args![xp, rp, rows, cols, eps])? };
        let args = args![xp, wp, rp, yp, n, cols, dt(y.dtype())];
        // SAFETY: as above; y is f32 or bf16 (checked by the caller), stored by its dtype code.
        unsafe { self.launch_n("rms_norm_apply", n, &args) }
    }

    /// RMSNorm backward from `[x, weight, rstd, dy]` into `[dx, dweight]`.
    pub(crate) fn rms_norm_backward(&mut self, ins: [View; 4], outs: [View; 2]) -> Result<()> {
        let ([xp, wp, rp, dyp], [dxp, dwp]) = self.ptrs("rms_norm_backward", ins, outs)?;
        let [x, weight, rstd, _] = ins;
        let (rows, cols, n) = (rstd.len(), weight.len(), x.len());
        let mean = self.scratch(rows)?;
        let mp = mean.ptr;
        let args = args![xp, wp, rp, dyp, mp, rows, cols];
        // SAFETY: views validated above; `mp` holds `rows` words.
        unsafe { self.launch_n("rms_norm_bwd_mean", rows, &args)? };
        let args = args![xp, wp, rp, dyp, mp, dxp, n, cols];
        // SAFETY: as above.
        unsafe { self.launch_n("rms_norm_bwd_dx", n, &args)? };
        let args = args![xp, rp, dyp, dwp, rows, cols];
        // SAFETY: as above.
        unsafe { self.launch_n("rms_norm_bwd_dw", cols, &args)? };
        drop(mean);
        Ok(())
    }

    /// `gelu` (`dy` = `None`) or `gelu_backward`.
    pub(crate) fn gelu(
        &mut self,
        x: View,
        dy: Option<View>,
        out: View,
        (beta, kappa): (f32, f32),
    ) -> Result<()> {
        let n = x.len();
        match dy {
            None => {
                let ([xp], [yp]) = self.ptrs("gelu", [x], [out])?;
                // SAFETY: views validated above (same lengths, disjoint).
                unsafe { self.launch_n("gelu", n, &args![xp, yp, n, beta, kappa]) }
            }
            Some(dy) => {
                let ([xp, dyp], [dxp]) = self.ptrs("gelu_backward", [x, dy], [out])?;
                let args = args![xp, dyp, dxp, n, beta, kappa];
                // SAFETY: as above.
                unsafe { self.launch_n("gelu_backward", n, &args) }
            }
        }
    }

    /// The f64 sum of `(pred − target)²` of [`crate::Device::mse_loss`] (f32 views, checked by
    /// the caller), in the blocked order of [`crate::Device::sum_squares`].
    pub(crate) fn mse_loss(&mut self, pred: View, target: View) -> Result<f64> {
        let ([p, t], []) = self.ptrs("mse_loss", [pred, target], [])?;
        self.blocked_sum_squares(p, DType::F32, Some(t), pred.len())
    }

    /// `dpred = c · (pred − target)` of `[pred, target]`.
    pub(crate) fn mse_loss_backward(&mut self, ins: [View; 2], dpred: View, c: f32) -> Result<()> {
        let ([p, t], [d]) = self.ptrs("mse_loss_backward", ins, [dpred])?;
        let n = ins[0].len();
        // SAFETY: views validated above (same lengths, disjoint).
        unsafe { self.launch_n("mse_backward", n, &args![p, t, d, n, c]) }
    }

    /// Row losses of a softmax cross-entropy (targets already checked to be class indices).
    pub(crate) fn softmax_cross_entropy_rows(
        &mut self,
        logits: View,
        targets: View,
        classes: usize,
    ) -> Result<Vec<f32>> {
        let ([x, t], []) = self.ptrs("softmax_cross_entropy", [logits, targets], [])?;
        let rows = targets.len();
        let stats = self.scratch(2 * rows)?;
        let loss = self.scratch(rows)?;
        let args = args![x, t, stats.ptr, loss.ptr, rows, classes];
        // SAFETY: views validated above (logits rows·classes, targets rows valid indices);
        // scratch buffers of 2·rows and rows words.
        unsafe { self.launch_n("softmax_row_stats", rows, &args)? };
        let l = self.fetch(&loss)?;
        drop(stats);
        Ok(l[..rows].iter().map(|b| f32::from_bits(*b)).collect())
    }

    /// The gradient of a softmax cross-entropy scaled by `c`, into `dlogits`.
    pub(crate) fn softmax_cross_entropy_backward(
        &mut self,
        [logits, targets, dlogits]: [View; 3],
        classes: usize,
        c: f32,
    ) -> Result<()> {
        let ([x, t], [d]) = self.ptrs(
            "softmax_cross_entropy_backward",
            [logits, targets],
            [dlogits],
        )?;
        let rows = targets.len();
        let n = logits.len();
        let stats = self.scratch(2 * rows)?;
        let sp = stats.ptr;
        // SAFETY: as in the forward; the null loss pointer is never written.
        unsafe {
            self.launch_n(
                "softmax_row_stats",
                rows,
                &args![x, t, sp, 0u64, rows, classes],
            )?
        };
        // SAFETY: as above; dlogits has rows·classes elements.
        unsafe {
            self.launch_n(
                "softmax_xent_backward",
                n,
                &args![x, t, sp, d, n, classes, c],
            )?
        };
        drop(stats);
        Ok(())
    }
}
