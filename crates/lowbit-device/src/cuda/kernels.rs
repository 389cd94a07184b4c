//! Host side of the CUDA kernels: argument checks that only the GPU path needs (alignment),
//! launch configurations and the launches. Callers have validated dtypes, lengths and shapes;
//! each method validates its views (liveness, bounds, overlap) before launching anything.

use lowbit_formats::{Copies, Fp8Kind, Mxfp8Config, NanPolicy, Nvfp4Config};

use super::{Arg, CudaDevice};
use crate::{DType, DeviceError, MatmulSpec, Mxfp8Views, Nvfp4Views, Result, View};

/// The largest grid x dimension.
const MAX_GRID_X: usize = (1 << 31) - 1;

/// Grid size for `n` work items of `per_block` each (at least one block), or `None` past the
/// grid's x limit.
fn blocks(n: usize, per_block: usize) -> Option<u32> {
    let b = n.div_ceil(per_block).max(1);
    if b > MAX_GRID_X {
        None
    } else {
        u32::try_from(b).ok()
    }
}

impl CudaDevice {
    /// MXFP8 with the kernels of `cuda/mxfp8.cu` when the configuration is theirs (bf16 input,
    /// E4M3, 1D blocks, TE NaN policy, rowwise or both copies, the vector paths' alignment);
    /// `Ok(false)` when it is not, for the caller's host fallback. Views are validated first.
    pub(crate) fn quantize_mxfp8(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Mxfp8Config,
        out: &Mxfp8Views,
    ) -> Result<bool> {
        if src.dtype() != DType::Bf16
            || cfg.kind != Fp8Kind::E4M3
            || cfg.two_d
            || cfg.nan_policy != NanPolicy::Te
            || rows == 0
            || cols == 0
        {
            return Ok(false);
        }
        let x = self.device_ptr(src)?;
        let (r, c) = (rows as u64, cols as u64);
        match (cfg.copies, out.rowwise, out.columnwise) {
            (Copies::Rowwise, Some((d, s)), None) => {
                let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
                let args = [
                    Arg::U64(x),
                    Arg::U64(d),
                    Arg::U64(s),
                    Arg::U64(r),
                    Arg::U64(c),
                ];
                let rows_grid = u32::try_from(rows.min(65535)).unwrap_or(65535);
                let (Some(g16), Some(g8), Some(g1)) = (
                    blocks(cols / 16, 128),
                    blocks(cols / 8, 128),
                    blocks(rows * cols.div_ceil(32) * 32, 256),
                ) else {
                    return Ok(false);
                };
                if cols.is_multiple_of(32) && x.is_multiple_of(16) && d.is_multiple_of(16) {
                    // SAFETY: the views were validated by the caller's `check_views` (live, in
                    // bounds: rows·cols bf16 in, rows·cols data bytes and rows·cols/32 scales
                    // out) and the vector accesses are aligned (checked here).
                    unsafe {
                        self.launch(
                            "mxfp8_rowwise_e4m3_bf16_x16",
                            (g16, rows_grid, 1),
                            (128, 1, 1),
                            &args,
                        )?;
                    }
                } else if cols.is_multiple_of(32) && x.is_multiple_of(16) && d.is_multiple_of(8) {
                    // SAFETY: as above, with 8-byte stores.
                    unsafe {
                        self.launch(
                            "mxfp8_rowwise_e4m3_bf16_x8",
                            (g8, rows_grid, 1),
                            (128, 1, 1),
                            &args,
                        )?;
                    }
                } else {
                    // SAFETY: as above; this kernel makes only element-sized accesses.
                    unsafe {
                        self.launch("mxfp8_rowwise_e4m3_bf16", (g1, 1, 1), (256, 1, 1), &args)?;
                    }
                }
                Ok(true)
            }
            (Copies::Both, Some((rd, rs)), Some((cd, cs))) => {
                let (rd, rs) = (self.device_ptr(rd)?, self.device_ptr(rs)?);
                let (cd, cs) = (self.device_ptr(cd)?, self.device_ptr(cs)?);
                if self.mxfp8_both_version != 1 {
                    let vec = cols.is_multiple_of(8)
                        && x.is_multiple_of(16)
                        && [rd, cd, cs].iter().all(|p| p.is_multiple_of(8));
                    // v5 owns 64 rows per CTA, the others 32.
                    let tile_rows = if self.mxfp8_both_version == 5 { 64 } else { 32 };
                    let (Some(gx), Ok(gy @ 1..=65535)) =
                        (blocks(cols, 256), u32::try_from(rows.div_ceil(tile_rows)))
                    else {
                        return Ok(false);
                    };
                    // SAFETY: views validated by the caller (live, in bounds, disjoint); the
                    // vector accesses only with `vec`, whose alignment is checked here.
                    unsafe {
                        self.launch(
                            if self.mxfp8_both_version == 5 {
                                "mxfp8_both_e4m3_bf16_v5"
                            } else {
                                "mxfp8_both_e4m3_bf16_v4"
                            },
                            (gx, gy, 1),
                            (256, 1, 1),
                            &[
                                Arg::U64(x),
                                Arg::U64(rd),
                                Arg::U64(rs),
                                Arg::U64(cd),
                                Arg::U64(cs),
                                Arg::U64(r),
                                Arg::U64(c),
                                Arg::U32(u32::from(vec)),
                            ],
                        )?;
                    }
                    return Ok(true);
                }
                // The kernel loads 16 bytes when cols % 8 == 0 and stores 16 when cols % 16 == 0.
                if (cols.is_multiple_of(8) && !x.is_multiple_of(16))
                    || (cols.is_multiple_of(16) && !rd.is_multiple_of(16))
                {
                    return Ok(false);
                }
                let (Some(gx), Ok(gy @ 1..=65535)) =
                    (blocks(cols, 256), u32::try_from(rows.div_ceil(32)))
                else {
                    return Ok(false);
                };
                let grid = (gx, gy, 1);
                // SAFETY: views validated by the caller (live, in bounds, disjoint), vector
                // accesses aligned (checked above), grid within limits.
                unsafe {
                    self.launch(
                        "mxfp8_both_e4m3_bf16",
                        grid,
                        (256, 1, 1),
                        &[
                            Arg::U64(x),
                            Arg::U64(rd),
                            Arg::U64(rs),
                            Arg::U64(cd),
                            Arg::U64(cs),
                            Arg::U64(r),
                            Arg::U64(c),
                        ],
                    )?;
                }
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}

/// The kernels' dtype code of a float dtype (callers have checked it is one).
fn dt(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        DType::U8 => 3,
    }
}

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;

/// Grid of a grid-stride kernel over `n` items (capped; the kernels loop).
fn stride_grid(n: usize) -> (u32, u32, u32) {
    let b = n.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    (b as u32, 1, 1)
}

/// The per-call scalars of one AdamW step (see `ops::optim`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWArgs {
    pub(crate) decay: f32,
    pub(crate) w: f32,
    pub(crate) one_minus_w: f32,
    pub(crate) beta2: f32,
    pub(crate) c2: f32,
    pub(crate) neg_step_size: f32,
    pub(crate) bc2_sqrt: f32,
    pub(crate) eps: f32,
}

impl CudaDevice {
    /// Validates an op's views (as the CPU does) and returns their device addresses, inputs
    /// then outputs.
    fn ptrs<const I: usize, const O: usize>(
        &self,
        what: &'static str,
        ins: [View; I],
        outs: [View; O],
    ) -> Result<([u64; I], [u64; O])> {
        self.check_views(what, &ins, &outs)?;
        let mut i = [0u64; I];
        for (p, v) in i.iter_mut().zip(ins) {
            *p = self.device_ptr(v)?;
        }
        let mut o = [0u64; O];
        for (p, v) in o.iter_mut().zip(outs) {
            *p = self.device_ptr(v)?;
        }
        Ok((i, o))
    }

    /// Launches a grid-stride kernel over `n` items (nothing for `n == 0`).
    ///
    /// # Safety
    /// As [`CudaDevice::launch`].
    pub(super) unsafe fn launch_n(
        &mut self,
        name: &'static str,
        n: usize,
        args: &[Arg],
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(name, stride_grid(n), (THREADS, 1, 1), args) }
    }

    /// A zeroed device scratch buffer of `n` u32 words, freed in stream order when dropped.
    fn scratch(&self, n: usize) -> Result<(cudarc::driver::CudaSlice<u32>, u64)> {
        use cudarc::driver::DevicePtr;
        let s = self
            .stream
            .alloc_zeros::<u32>(n.max(1))
            .map_err(super::cuda_err("allocating scratch"))?;
        let p = {
            let (p, _sync) = s.device_ptr(&self.stream);
            p
        };
        Ok((s, p))
    }

    /// Copies a scratch buffer to the host (synchronising).
    fn fetch(&self, s: &cudarc::driver::CudaSlice<u32>) -> Result<Vec<u32>> {
        let v = self
            .stream
            .clone_dtoh(s)
            .map_err(super::cuda_err("copying to the host"))?;
        self.stream
            .synchronize()
            .map_err(super::cuda_err("waiting for the stream"))?;
        Ok(v)
    }

    /// Every element of `view` set to the bit pattern `pattern` (its dtype's encoding).
    pub(crate) fn fill(&mut self, view: View, pattern: u32) -> Result<()> {
        let ([], [y]) = self.ptrs("fill", [], [view])?;
        let name = if view.dtype().size() == 4 {
            "fill_u32"
        } else {
            "fill_u16"
        };
        let n = view.len();
        // SAFETY: `y` addresses `n` live elements of the view's size (validated above).
        unsafe {
            self.launch_n(
                name,
                n,
                &[Arg::U64(y), Arg::U64(n as u64), Arg::U32(pattern)],
            )
        }
    }

    pub(crate) fn cast(&mut self, src: View, dst: View) -> Result<()> {
        let ([x], [y]) = self.ptrs("cast", [src], [dst])?;
        if src.dtype() == dst.dtype() {
            return self.copy(src, dst);
        }
        let n = src.len();
        let args = [
            Arg::U64(x),
            Arg::U32(dt(src.dtype())),
            Arg::U64(y),
            Arg::U32(dt(dst.dtype())),
            Arg::U64(n as u64),
        ];
        // SAFETY: views validated above (same length, float dtypes, disjoint).
        unsafe { self.launch_n("cast", n, &args) }
    }

    pub(crate) fn scale(&mut self, view: View, alpha: f32) -> Result<()> {
        let ([], [y]) = self.ptrs("scale", [], [view])?;
        let n = view.len();
        let args = [
            Arg::U64(y),
            Arg::U32(dt(view.dtype())),
            Arg::U64(n as u64),
            Arg::F32(alpha),
        ];
        // SAFETY: the view was validated above.
        unsafe { self.launch_n("scale", n, &args) }
    }

    /// `y ← y + alpha·x`, or `y ← y + x` when `alpha` is `None` (`add`).
    pub(crate) fn axpy(
        &mut self,
        what: &'static str,
        alpha: Option<f32>,
        x: View,
        y: View,
    ) -> Result<()> {
        let ([xp], [yp]) = self.ptrs(what, [x], [y])?;
        let n = y.len();
        let args = [
            Arg::U64(xp),
            Arg::U32(dt(x.dtype())),
            Arg::U64(yp),
            Arg::U32(dt(y.dtype())),
            Arg::U64(n as u64),
            Arg::F32(alpha.unwrap_or(1.0)),
            Arg::U32(u32::from(alpha.is_none())),
        ];
        // SAFETY: views validated above (same length, float dtypes, disjoint).
        unsafe { self.launch_n("axpy", n, &args) }
    }

    /// [`crate::Device::sum_squares`]: the blocked order of [`crate::SUM_BLOCK`], block sums on
    /// the device, added in order on the host.
    pub(crate) fn sum_squares(&mut self, view: View) -> Result<f64> {
        let ([x], []) = self.ptrs("sum_squares", [view], [])?;
        self.blocked_sum_squares(x, view.dtype(), None, view.len())
    }

    /// The f64 sum of `(pred − target)²` of [`crate::Device::mse_loss`] (f32 views, checked by
    /// the caller), in the same blocked order.
    pub(crate) fn mse_loss(&mut self, pred: View, target: View) -> Result<f64> {
        let ([p, t], []) = self.ptrs("mse_loss", [pred, target], [])?;
        self.blocked_sum_squares(p, DType::F32, Some(t), pred.len())
    }

    /// Launches the blocked sum-of-squares kernel over `n` elements of dtype `d` at `x` (minus the f32
    /// elements at `y`), downloads the per-block partials and adds them in index order.
    fn blocked_sum_squares(&mut self, x: u64, d: DType, y: Option<u64>, n: usize) -> Result<f64> {
        let nb = n.div_ceil(crate::SUM_BLOCK);
        if nb == 0 {
            return Ok(0.0);
        }
        // A warp per 32 blocks, four warps per CTA.
        let Some(grid) = blocks(nb, 128) else {
            return Err(DeviceError::Unsupported(format!(
                "a sum of squares over {n} elements exceeds the grid"
            )));
        };
        let (s, sp) = self.scratch(2 * nb)?;
        let (name, args) = match (d, y) {
            (DType::F32, Some(y)) => (
                "mse_blocks_f32",
                vec![Arg::U64(x), Arg::U64(y), Arg::U64(n as u64), Arg::U64(sp)],
            ),
            (d, _) => (
                match d {
                    DType::Bf16 => "sum_squares_blocks_bf16",
                    DType::F16 => "sum_squares_blocks_f16",
                    _ => "sum_squares_blocks_f32",
                },
                vec![Arg::U64(x), Arg::U64(n as u64), Arg::U64(sp)],
            ),
        };
        // SAFETY: `x` (and `y`) address `n` elements of validated views of dtype `d` (float:
        // checked by the callers; `y` only with f32); `sp` holds `nb` f64 partials (2·nb words)
        // and the kernel writes partials[b] only for b < nb.
        unsafe { self.launch(name, (grid, 1, 1), (128, 1, 1), &args)? };
        let words = self.fetch(&s)?;
        let partials: Vec<f64> = words
            .as_chunks::<2>()
            .0
            .iter()
            .map(|[lo, hi]| f64::from_bits(u64::from(*lo) | (u64::from(*hi) << 32)))
            .collect();
        Ok(crate::ops::sum_partials(&partials))
    }

    pub(crate) fn max_abs(&mut self, view: View) -> Result<f32> {
        let ([x], []) = self.ptrs("max_abs", [view], [])?;
        let (s, sp) = self.scratch(1)?;
        self.launch_max_abs(x, view.dtype(), view.len(), sp)?;
        Ok(f32::from_bits(self.fetch(&s)?[0]))
    }

    /// Enqueues the amax kernel: the max of |x| bits (NaN as 0) of `n` elements of dtype `d` at
    /// `x` (a validated view) into the zeroed word at `out`.
    pub(super) fn launch_max_abs(&mut self, x: u64, d: DType, n: usize, out: u64) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if self.nvfp4_version >= 2 && d == DType::Bf16 && x.is_multiple_of(16) {
            // Four 16-byte loads per thread and iteration: a few blocks per SM suffice.
            let grid = (n.div_ceil(8 * 256 * 4).clamp(1, 2048) as u32, 1, 1);
            let args = [Arg::U64(x), Arg::U64(n as u64), Arg::U64(out)];
            // SAFETY: `x` addresses `n` bf16 elements of a validated, 16-byte aligned view
            // (16-byte chunks, then the tail element by element); `out` is a live zeroed word.
            return unsafe { self.launch("max_abs_bits_bf16_v2", grid, (256, 1, 1), &args) };
        }
        let args = [
            Arg::U64(x),
            Arg::U32(dt(d)),
            Arg::U64(n as u64),
            Arg::U64(out),
            Arg::U32(u32::from(x.is_multiple_of(16))),
        ];
        // A few blocks per SM are enough for a streaming read, and keep the atomics few.
        let grid = (n.div_ceil(THREADS as usize * 8).clamp(1, 4096) as u32, 1, 1);
        // SAFETY: `x` addresses `n` elements of a validated view (16-byte chunks only when it is
        // 16-byte aligned); `out` is a live zeroed word.
        unsafe { self.launch("max_abs_bits", grid, (THREADS, 1, 1), &args) }
    }

    pub(crate) fn has_non_finite(&mut self, view: View) -> Result<bool> {
        let ([x], []) = self.ptrs("has_non_finite", [view], [])?;
        let (s, sp) = self.scratch(1)?;
        let n = view.len();
        let args = [
            Arg::U64(x),
            Arg::U32(dt(view.dtype())),
            Arg::U64(n as u64),
            Arg::U64(sp),
        ];
        // SAFETY: the view was validated above; `sp` is a live one-word scratch buffer.
        unsafe { self.launch_n("any_non_finite", n, &args)? };
        Ok(self.fetch(&s)?[0] != 0)
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn adamw(
        &mut self,
        param: View,
        grad: View,
        exp_avg: View,
        exp_avg_sq: View,
        k: &AdamWArgs,
        out: Option<View>,
    ) -> Result<()> {
        const WHAT: &str = "adamw";
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
        let args = [
            Arg::U64(p),
            Arg::U64(g),
            Arg::U32(dt(grad.dtype())),
            Arg::U64(m),
            Arg::U64(v),
            Arg::U64(o),
            Arg::U32(od),
            Arg::U64(n as u64),
            Arg::F32(k.decay),
            Arg::F32(k.w),
            Arg::F32(k.one_minus_w),
            Arg::F32(k.beta2),
            Arg::F32(k.c2),
            Arg::F32(k.neg_step_size),
            Arg::F32(k.bc2_sqrt),
            Arg::F32(k.eps),
            Arg::U32(u32::from(k.w.abs() < 0.5)),
        ];
        // SAFETY: views validated above (same lengths, f32 state, disjoint outputs).
        unsafe { self.launch_n("adamw", n, &args) }
    }

    pub(crate) fn sgd_momentum(
        &mut self,
        param: View,
        grad: View,
        buf: View,
        (wd, mom, neg_lr): (f32, f32, f32),
        first_step: bool,
    ) -> Result<()> {
        let ([g], [p, b]) = self.ptrs("sgd_momentum", [grad], [param, buf])?;
        let n = grad.len();
        let args = [
            Arg::U64(p),
            Arg::U64(g),
            Arg::U32(dt(grad.dtype())),
            Arg::U64(b),
            Arg::U64(n as u64),
            Arg::F32(wd),
            Arg::F32(mom),
            Arg::F32(neg_lr),
            Arg::U32(u32::from(first_step)),
        ];
        // SAFETY: views validated above (same lengths, f32 state, disjoint outputs).
        unsafe { self.launch_n("sgd_momentum", n, &args) }
    }

    pub(crate) fn matmul(&mut self, a: View, b: View, c: View, spec: &MatmulSpec) -> Result<()> {
        let ([ap, bp], [cp]) = self.ptrs("matmul", [a, b], [c])?;
        let MatmulSpec { m, n, k, .. } = *spec;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let gx = u32::try_from(n.div_ceil(128))
            .map_err(|_| DeviceError::Unsupported(format!("matmul: n = {n} is too large")))?;
        let gy = u32::try_from(m.min(65535)).unwrap_or(65535);
        let args = [
            Arg::U64(ap),
            Arg::U32(dt(a.dtype())),
            Arg::U64(bp),
            Arg::U32(dt(b.dtype())),
            Arg::U64(cp),
            Arg::U64(m as u64),
            Arg::U64(n as u64),
            Arg::U64(k as u64),
            Arg::U32(u32::from(spec.trans_a)),
            Arg::U32(u32::from(spec.trans_b)),
            Arg::U32(u32::from(spec.accumulate)),
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
        let args = [
            Arg::U64(xp),
            Arg::U64(b),
            Arg::U64(n as u64),
            Arg::U64(cols as u64),
        ];
        // SAFETY: views validated above (x holds whole rows of bias.len()).
        unsafe { self.launch_n("add_bias", n, &args) }
    }

    pub(crate) fn bias_grad(&mut self, dy: View, dbias: View, accumulate: bool) -> Result<()> {
        let ([d], [db]) = self.ptrs("bias_grad", [dy], [dbias])?;
        let cols = dbias.len();
        let rows = dy.len().checked_div(cols).unwrap_or(0);
        let args = [
            Arg::U64(d),
            Arg::U64(db),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::U32(u32::from(accumulate)),
        ];
        // SAFETY: views validated above (dy holds whole rows of cols).
        unsafe { self.launch_n("bias_grad", cols, &args) }
    }

    pub(crate) fn rms_norm(
        &mut self,
        x: View,
        weight: View,
        y: View,
        rstd: View,
        eps: f32,
    ) -> Result<()> {
        let ([xp, wp], [yp, rp]) = self.ptrs("rms_norm", [x, weight], [y, rstd])?;
        let (rows, cols, n) = (rstd.len(), weight.len(), x.len());
        let args = [
            Arg::U64(xp),
            Arg::U64(rp),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::F32(eps),
        ];
        // SAFETY: views validated above (x and y rows·cols, rstd rows).
        unsafe { self.launch_n("rms_norm_rstd", rows, &args)? };
        let args = [
            Arg::U64(xp),
            Arg::U64(wp),
            Arg::U64(rp),
            Arg::U64(yp),
            Arg::U64(n as u64),
            Arg::U64(cols as u64),
        ];
        // SAFETY: as above.
        unsafe { self.launch_n("rms_norm_apply", n, &args) }
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn rms_norm_backward(
        &mut self,
        x: View,
        weight: View,
        rstd: View,
        dy: View,
        dx: View,
        dweight: View,
    ) -> Result<()> {
        let ([xp, wp, rp, dyp], [dxp, dwp]) =
            self.ptrs("rms_norm_backward", [x, weight, rstd, dy], [dx, dweight])?;
        let (rows, cols, n) = (rstd.len(), weight.len(), x.len());
        let (mean, mp) = self.scratch(rows)?;
        let args = [
            Arg::U64(xp),
            Arg::U64(wp),
            Arg::U64(rp),
            Arg::U64(dyp),
            Arg::U64(mp),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
        ];
        // SAFETY: views validated above; `mp` holds `rows` words.
        unsafe { self.launch_n("rms_norm_bwd_mean", rows, &args)? };
        let args = [
            Arg::U64(xp),
            Arg::U64(wp),
            Arg::U64(rp),
            Arg::U64(dyp),
            Arg::U64(mp),
            Arg::U64(dxp),
            Arg::U64(n as u64),
            Arg::U64(cols as u64),
        ];
        // SAFETY: as above.
        unsafe { self.launch_n("rms_norm_bwd_dx", n, &args)? };
        let args = [
            Arg::U64(xp),
            Arg::U64(rp),
            Arg::U64(dyp),
            Arg::U64(dwp),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
        ];
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
                let args = [
                    Arg::U64(xp),
                    Arg::U64(yp),
                    Arg::U64(n as u64),
                    Arg::F32(beta),
                    Arg::F32(kappa),
                ];
                // SAFETY: views validated above (same lengths, disjoint).
                unsafe { self.launch_n("gelu", n, &args) }
            }
            Some(dy) => {
                let ([xp, dyp], [dxp]) = self.ptrs("gelu_backward", [x, dy], [out])?;
                let args = [
                    Arg::U64(xp),
                    Arg::U64(dyp),
                    Arg::U64(dxp),
                    Arg::U64(n as u64),
                    Arg::F32(beta),
                    Arg::F32(kappa),
                ];
                // SAFETY: as above.
                unsafe { self.launch_n("gelu_backward", n, &args) }
            }
        }
    }

    pub(crate) fn mse_loss_backward(
        &mut self,
        pred: View,
        target: View,
        dpred: View,
        c: f32,
    ) -> Result<()> {
        let ([p, t], [d]) = self.ptrs("mse_loss_backward", [pred, target], [dpred])?;
        let n = pred.len();
        let args = [
            Arg::U64(p),
            Arg::U64(t),
            Arg::U64(d),
            Arg::U64(n as u64),
            Arg::F32(c),
        ];
        // SAFETY: views validated above (same lengths, disjoint).
        unsafe { self.launch_n("mse_backward", n, &args) }
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
        let (stats, sp) = self.scratch(2 * rows)?;
        let (loss, lp) = self.scratch(rows)?;
        let args = [
            Arg::U64(x),
            Arg::U64(t),
            Arg::U64(sp),
            Arg::U64(lp),
            Arg::U64(rows as u64),
            Arg::U64(classes as u64),
        ];
        // SAFETY: views validated above (logits rows·classes, targets rows valid indices);
        // scratch buffers of 2·rows and rows words.
        unsafe { self.launch_n("softmax_row_stats", rows, &args)? };
        let l = self.fetch(&loss)?;
        drop(stats);
        Ok(l[..rows].iter().map(|b| f32::from_bits(*b)).collect())
    }

    pub(crate) fn softmax_cross_entropy_backward(
        &mut self,
        logits: View,
        targets: View,
        dlogits: View,
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
        let (stats, sp) = self.scratch(2 * rows)?;
        let args = [
            Arg::U64(x),
            Arg::U64(t),
            Arg::U64(sp),
            Arg::U64(0),
            Arg::U64(rows as u64),
            Arg::U64(classes as u64),
        ];
        // SAFETY: as in the forward; the null loss pointer is never written.
        unsafe { self.launch_n("softmax_row_stats", rows, &args)? };
        let args = [
            Arg::U64(x),
            Arg::U64(t),
            Arg::U64(sp),
            Arg::U64(d),
            Arg::U64(n as u64),
            Arg::U64(classes as u64),
            Arg::F32(c),
        ];
        // SAFETY: as above; dlogits has rows·classes elements.
        unsafe { self.launch_n("softmax_xent_backward", n, &args)? };
        drop(stats);
        Ok(())
    }
}

impl CudaDevice {
    /// NVFP4 with the kernels when the configuration is theirs (1D blocks, round to nearest,
    /// no Hadamard transform, TE NaN policy; a columnwise copy needs `rows % 16 == 0`), else
    /// `Ok(None)` for the host fallback. Returns the global amax (both copies share it).
    pub(crate) fn quantize_nvfp4(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Nvfp4Config,
        out: &Nvfp4Views,
    ) -> Result<Option<f32>> {
        if cfg.two_d
            || cfg.rht
            || cfg.stochastic_rounding.is_some()
            || cfg.nan_policy != NanPolicy::Te
            || rows == 0
            || cols == 0
            || (out.columnwise.is_some() && !rows.is_multiple_of(16))
        {
            return Ok(None);
        }
        let Some(gx) = blocks(cols.div_ceil(16), 128) else {
            return Ok(None);
        };
        let x = self.device_ptr(src)?;
        let xd = dt(src.dtype());
        // Global amax, then the tensor-level factors, both on the device: no host round trip
        // before the quantization kernels; the amax comes back at the end.
        let (amax_buf, ap) = self.scratch(1)?;
        self.launch_max_abs(x, src.dtype(), src.len(), ap)?;
        // Version 3 also builds the E2M1 threshold table (8 words per scale byte from word
        // 260, which the 16-byte loads of nvfp4_quantize_rows_v3 need 16-byte aligned).
        let (params, tp) = self.scratch(if self.nvfp4_version == 3 {
            260 + 8 * 256
        } else {
            257
        })?;
        let thresholds = self.nvfp4_version == 3 && tp.is_multiple_of(16);
        let (name, grid) = if thresholds {
            ("nvfp4_params_v3", (8, 1, 1))
        } else {
            ("nvfp4_params", (1, 1, 1))
        };
        // SAFETY: `ap` holds one word, `tp` 257 (260 + 2048 for the table of the v3 kernel,
        // whose 8 x 256 threads write words 0..=256 and 260..2308), the tables 512 floats
        // (E4M3 first).
        unsafe {
            self.launch(
                name,
                grid,
                (256, 1, 1),
                &[Arg::U64(ap), Arg::U64(self.tables_ptr), Arg::U64(tp)],
            )?;
        }
        let (r, c) = (rows as u64, cols as u64);
        if let Some((d, s)) = out.rowwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let vec = src.dtype() == DType::Bf16
                && cols.is_multiple_of(16)
                && x.is_multiple_of(16)
                && d.is_multiple_of(8);
            let args = [
                Arg::U64(x),
                Arg::U32(xd),
                Arg::U64(d),
                Arg::U64(s),
                Arg::U64(tp),
                Arg::U64(r),
                Arg::U64(c),
                Arg::U32(u32::from(vec)),
            ];
            let gy = u32::try_from(rows.min(65535)).unwrap_or(65535);
            let v2 = self.nvfp4_version >= 2
                && vec
                && cols.is_multiple_of(32)
                && d.is_multiple_of(16)
                && s.is_multiple_of(2);
            match blocks(cols / 32, 128) {
                Some(gx2) if v2 => {
                    let args = [
                        Arg::U64(x),
                        Arg::U64(d),
                        Arg::U64(s),
                        Arg::U64(tp),
                        Arg::U64(r),
                        Arg::U64(c),
                    ];
                    let name = if thresholds {
                        "nvfp4_quantize_rows_v3"
                    } else {
                        "nvfp4_quantize_rows_v2"
                    };
                    // SAFETY: as below, with 16-byte loads and code stores and 2-byte scale
                    // stores, whose alignment is checked above (row pitches cols·2, cols/2 and
                    // cols/16 keep it: cols % 32 == 0); the v3 kernel reads the threshold table
                    // that nvfp4_params_v3 wrote into `tp` (16-byte aligned, checked above).
                    unsafe { self.launch(name, (gx2, gy, 1), (128, 1, 1), &args)? };
                }
                // SAFETY: views validated by the caller (rows·cols in; rows·ceil(cols/2) data
                // and rows·ceil(cols/16) scale bytes out); `tp` holds k and the 256-entry table.
                _ => unsafe {
                    self.launch("nvfp4_quantize_rows", (gx, gy, 1), (128, 1, 1), &args)?
                },
            }
        }
        if let Some((d, s)) = out.columnwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let nbr = rows / 16;
            let per = [4, 2, 1]
                .into_iter()
                .find(|p| nbr.is_multiple_of(*p))
                .unwrap_or(1);
            let args = [
                Arg::U64(x),
                Arg::U32(xd),
                Arg::U64(d),
                Arg::U64(s),
                Arg::U64(tp),
                Arg::U64(r),
                Arg::U64(c),
                Arg::U32(per as u32),
                Arg::U32(u32::from(d.is_multiple_of(8))),
            ];
            // SAFETY: as above, with cols·rows/2 data and cols·rows/16 scale bytes; `per`
            // divides the row-block count; 8-byte stores only when `d` is 8-byte aligned (the
            // row pitch rows/2 is a multiple of 8).
            unsafe { self.launch_n("nvfp4_quantize_cols", nbr / per * cols, &args)? };
        }
        let amax = f32::from_bits(self.fetch(&amax_buf)?[0]);
        drop(params);
        Ok(Some(amax))
    }

    /// MXFP8 dequantization of one copy (views validated by the caller).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dequantize_mxfp8(
        &mut self,
        data: View,
        scales: View,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        dst: View,
        columnwise: bool,
    ) -> Result<()> {
        let tp = self.tables_ptr
            + match kind {
                Fp8Kind::E4M3 => 0,
                Fp8Kind::E5M2 => 256 * 4,
            };
        let args = [
            Arg::U64(self.device_ptr(data)?),
            Arg::U64(self.device_ptr(scales)?),
            Arg::U64(tp),
            Arg::U64(self.device_ptr(dst)?),
            Arg::U32(dt(dst.dtype())),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::U32(u32::from(columnwise)),
        ];
        // SAFETY: views validated by the caller with the plane's shapes; `tp` addresses a
        // 256-entry table of the device's constant tables.
        unsafe { self.launch_n("mxfp8_dequantize", rows * cols, &args) }
    }

    /// NVFP4 dequantization of one copy without the Hadamard transform (views validated by
    /// the caller).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn dequantize_nvfp4(
        &mut self,
        data: View,
        scales: View,
        amax: f32,
        rows: usize,
        cols: usize,
        dst: View,
        columnwise: bool,
    ) -> Result<()> {
        let tp = self.tables_ptr;
        let factor_inv = (1.0f64 / (6.0 * 448.0)) as f32;
        let args = [
            Arg::U64(self.device_ptr(data)?),
            Arg::U64(self.device_ptr(scales)?),
            Arg::U64(tp),
            Arg::U64(self.device_ptr(dst)?),
            Arg::U32(dt(dst.dtype())),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::F32(amax),
            Arg::F32(factor_inv),
            Arg::U32(u32::from(columnwise)),
        ];
        // SAFETY: views validated by the caller with the plane's shapes; `tp` addresses a
        // 256-entry table of the device's constant tables.
        unsafe { self.launch_n("nvfp4_dequantize", rows * cols, &args) }
    }
}

/// The element format of a sharded 2D quantization range.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Range2d {
    /// MXFP8 codes (one byte each) of this kind, 32x32 tiles.
    Mxfp8(Fp8Kind),
    /// NVFP4 packed codes (two per byte), 16x16 tiles.
    Nvfp4,
}

impl CudaDevice {
    /// Whether `tiles` (`tile` x `tile` tiles of a matrix with `cols` columns) covers the flat
    /// range `start .. start + len`.
    fn tiles_cover(tiles: View, start: usize, len: usize, cols: usize, tile: usize) -> bool {
        cols > 0
            && (start + len)
                .div_ceil(cols)
                .div_ceil(tile)
                .checked_mul(cols.div_ceil(tile))
                .is_some_and(|need| tiles.len() >= need)
    }

    /// Folds |src| into the tile amaxes (views validated by the caller, `cols > 0`, tiles
    /// covering the range).
    pub(crate) fn fold_tile_amax(
        &mut self,
        src: View,
        start: usize,
        cols: usize,
        tile: usize,
        tiles: View,
    ) -> Result<()> {
        let (x, t) = (self.device_ptr(src)?, self.device_ptr(tiles)?);
        let n = src.len();
        let segments = n.div_ceil(tile) + (n + start) / cols + 2;
        if n == 0 {
            return Ok(());
        }
        let args = [
            Arg::U64(x),
            Arg::U32(dt(src.dtype())),
            Arg::U64(n as u64),
            Arg::U64(start as u64),
            Arg::U64(cols as u64),
            Arg::U64(tile as u64),
            Arg::U64(t),
        ];
        // SAFETY: `src` and `tiles` validated by the caller; every tile index the range maps to
        // is below the count the caller checked.
        unsafe { self.launch_n("tile_amax_fold", segments, &args) }
    }

    /// The codes of a sharded 2D range with the kernels, or `Ok(false)` when the library would
    /// report an error (or could not index its tiles) for these arguments, for the caller's
    /// host path. Views validated by the caller.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn quantize_2d_range(
        &mut self,
        format: Range2d,
        src: View,
        start: usize,
        cols: usize,
        tiles: View,
        out: View,
    ) -> Result<bool> {
        let n = src.len();
        let (x, t, o) = (
            self.device_ptr(src)?,
            self.device_ptr(tiles)?,
            self.device_ptr(out)?,
        );
        match format {
            Range2d::Mxfp8(kind) => {
                if out.len() != n || !Self::tiles_cover(tiles, start, n, cols, 32) {
                    return Ok(false);
                }
                let args = [
                    Arg::U64(x),
                    Arg::U32(dt(src.dtype())),
                    Arg::U64(n as u64),
                    Arg::U64(start as u64),
                    Arg::U64(cols as u64),
                    Arg::U32(u32::from(kind == Fp8Kind::E5M2)),
                    Arg::F32(kind.max_norm_rcp()),
                    Arg::U64(t),
                    Arg::U64(o),
                ];
                // SAFETY: views validated by the caller; `out` has one byte per element and
                // the tiles cover the range (checked here).
                unsafe { self.launch_n("mxfp8_quantize_2d_range", n, &args)? };
            }
            Range2d::Nvfp4 => {
                if !start.is_multiple_of(2)
                    || !n.is_multiple_of(2)
                    || out.len() * 2 != n
                    || !Self::tiles_cover(tiles, start, n, cols, 16)
                {
                    return Ok(false);
                }
                let (amax, ap) = self.scratch(1)?;
                if !tiles.is_empty() {
                    let args = [Arg::U64(t), Arg::U64(tiles.len() as u64), Arg::U64(ap)];
                    // SAFETY: `tiles` is a validated f32 view; `ap` one zeroed word.
                    unsafe { self.launch_n("u32_max", tiles.len(), &args)? };
                }
                let (params, pp) = self.scratch(257)?;
                // SAFETY: `ap` holds one word, `pp` 257, the tables 512 floats (E4M3 first).
                unsafe {
                    self.launch(
                        "nvfp4_params",
                        (1, 1, 1),
                        (256, 1, 1),
                        &[Arg::U64(ap), Arg::U64(self.tables_ptr), Arg::U64(pp)],
                    )?;
                }
                let args = [
                    Arg::U64(x),
                    Arg::U32(dt(src.dtype())),
                    Arg::U64((n / 2) as u64),
                    Arg::U64(start as u64),
                    Arg::U64(cols as u64),
                    Arg::U64(t),
                    Arg::U64(pp),
                    Arg::U64(o),
                ];
                // SAFETY: views validated by the caller; `out` has n/2 bytes and the tiles cover
                // the range (checked here); `pp` holds the tensor factors.
                unsafe { self.launch_n("nvfp4_quantize_2d_range", n / 2, &args)? };
                drop((amax, params));
            }
        }
        Ok(true)
    }

    /// Rowwise and columnwise E8M0 scales of a 2D MXFP8 matrix from its tile amaxes, or
    /// `Ok(false)` for the caller's host path whenever that path would fail or write piecewise
    /// (wrong dtypes or lengths, dead or overlapping views), so errors stay the host's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn mxfp8_scales_2d(
        &mut self,
        rows: usize,
        cols: usize,
        kind: Fp8Kind,
        tiles: View,
        row_scales: View,
        col_scales: View,
    ) -> Result<bool> {
        let tc = cols.div_ceil(32);
        let (nr, nc) = (rows * tc, rows.div_ceil(32) * cols);
        let ok = tiles.dtype() == DType::F32
            && tiles.len() == rows.div_ceil(32) * tc
            && row_scales.dtype() == DType::U8
            && col_scales.dtype() == DType::U8
            && row_scales.len() == nr
            && col_scales.len() == nc
            && self
                .check_views("mxfp8_scales_2d", &[tiles], &[row_scales, col_scales])
                .is_ok();
        if !ok {
            return Ok(false);
        }
        let args = [
            Arg::U64(self.device_ptr(tiles)?),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::F32(kind.max_norm_rcp()),
            Arg::U64(self.device_ptr(row_scales)?),
            Arg::U64(self.device_ptr(col_scales)?),
        ];
        // SAFETY: all three views checked above (live, in bounds, disjoint, the lengths the
        // kernel writes).
        unsafe { self.launch_n("mxfp8_scales_2d", nr + nc, &args)? };
        Ok(true)
    }
}
