//! Launches of the optimizer steps: fused AdamW (with the optional bf16 copy of the result) and
//! SGD with momentum.

use super::dt;
use crate::cuda::CudaDevice;
use crate::ops::AdamWScalars;
use crate::{Result, View};

impl CudaDevice {
    /// AdamW over `[param, grad, exp_avg, exp_avg_sq]`, writing the new parameters into `out`
    /// too when given.
    pub(crate) fn adamw(
        &mut self,
        views: [View; 4],
        k: &AdamWScalars,
        out: Option<View>,
    ) -> Result<()> {
        const WHAT: &str = "adamw";
        let [param, grad, exp_avg, exp_avg_sq] = views;
        let outs: Vec<View> = [param, exp_avg, exp_avg_sq]
            .into_iter()
            .chain(out)
            .collect();
        self.check_views(WHAT, &[grad], &outs)?;
        let (p, g, m, v) = (
            self.device_ptr(param)?,
            self.device_ptr(grad)?,
            self.device_ptr(exp_avg)?,
            self.device_ptr(exp_avg_sq)?,
        );
        let (o, od) = match out {
            Some(o) => (self.device_ptr(o)?, dt(o.dtype())),
            None => (0, 3),
        };
        let n = grad.len();
        let lerp = u32::from(k.w.abs() < 0.5);
        // Four elements a thread where every view is aligned to its vector width (16 bytes of
        // f32, 8 of four 16-bit values) and n % 4 == 0.
        let width = |d: crate::DType| if d.size() == 4 { 16 } else { 8 };
        let x4 = self.adamw_version == 2
            && n.is_multiple_of(4)
            && [p, m, v].iter().all(|a| a.is_multiple_of(16))
            && g.is_multiple_of(width(grad.dtype()))
            && out.is_none_or(|ov| o.is_multiple_of(width(ov.dtype())));
        let (kernel, items) = if x4 {
            ("adamw_x4", n / 4)
        } else {
            ("adamw", n)
        };
        let args = args![
            p,
            g,
            dt(grad.dtype()),
            m,
            v,
            o,
            od,
            items,
            k.decay,
            k.w,
            k.one_minus_w,
            k.beta2,
            k.c2,
            k.neg_step_size,
            k.bc2_sqrt,
            k.eps,
            lerp,
            k.grad_scale
        ];
        // SAFETY: views validated above (same lengths, f32 state, disjoint outputs); `adamw_x4`
        // only where n % 4 == 0 and every address is aligned to the vector it loads or stores
        // (checked above), its n / 4 items covering exactly the n elements.
        unsafe { self.launch_n(kernel, items, &args) }
    }

    pub(crate) fn sgd_momentum(
        &mut self,
        [param, grad, buf]: [View; 3],
        (wd, mom, neg_lr): (f32, f32, f32),
        first_step: bool,
    ) -> Result<()> {
        let ([g], [p, b]) = self.ptrs("sgd_momentum", [grad], [param, buf])?;
        let n = grad.len();
        let first = u32::from(first_step);
        let args = args![p, g, dt(grad.dtype()), b, n, wd, mom, neg_lr, first];
        // SAFETY: views validated above (same lengths, f32 state, disjoint outputs).
        unsafe { self.launch_n("sgd_momentum", n, &args) }
    }
}
