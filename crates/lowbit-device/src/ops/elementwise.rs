//! Fill, cast, scale, axpy, add, and the reductions (sum of squares, non-finite check, amax).

use super::{BlockedSum, for_each_chunk, map_in_place, map_into, zip_in_place};
use crate::cpu::{bf16_bits, encode_f32};
use crate::{DType, Device, DeviceError, Result, View, check_float, check_len};

impl Device {
    /// Sets every element of the float view `view` to `value` rounded to its dtype (RNE).
    pub fn fill(&mut self, view: View, value: f32) -> Result<()> {
        check_float("fill", view)?;
        let d = view.dtype();
        let mut pattern = [0u8; 4];
        encode_f32(d, &[value], &mut pattern[..d.size()]);
        on_cuda!(self, g => g.fill(view, u32::from_le_bytes(pattern)));
        self.host_op("fill", [], [view], |[], [bytes]| {
            for e in bytes.chunks_exact_mut(d.size()) {
                e.copy_from_slice(&pattern[..d.size()]);
            }
            Ok(())
        })
    }

    /// `dst ← src` converted between any float dtypes (f32, bf16, f16), same length, rounding to
    /// nearest even: f32 → bf16 equals `half::bf16::from_f32`, f32 → f16 `half::f16::from_f32`,
    /// and widening is exact. `src` and `dst` must not overlap.
    pub fn cast(&mut self, src: View, dst: View) -> Result<()> {
        check_float("cast", src)?;
        check_float("cast", dst)?;
        check_len("cast", src.len(), dst.len())?;
        on_cuda!(self, g => g.cast(src, dst));
        self.host_op("cast", [src], [dst], |[s], [d]| {
            match (src.dtype(), dst.dtype()) {
                (a, b) if a == b => d.copy_from_slice(s),
                // The master → staging path, in one pass without staging.
                (DType::F32, DType::Bf16) => {
                    let pairs = d
                        .as_chunks_mut::<2>()
                        .0
                        .iter_mut()
                        .zip(s.as_chunks::<4>().0);
                    for (o, x) in pairs {
                        *o = bf16_bits(f32::from_le_bytes(*x)).to_le_bytes();
                    }
                }
                (sd, dd) => map_into((sd, s), (dd, d), |v| v),
            }
            Ok(())
        })
    }

    /// `view ← alpha · view` in place: `fl(fl32(alpha · x))` for a float view.
    pub fn scale(&mut self, view: View, alpha: f32) -> Result<()> {
        check_float("scale", view)?;
        on_cuda!(self, g => g.scale(view, alpha));
        self.host_op("scale", [], [view], |[], [y]| {
            map_in_place((view.dtype(), y), |v| alpha * v);
            Ok(())
        })
    }

    /// `y ← y + alpha · x`, for `x` and `y` of any float dtypes and the same length: computed in
    /// f32 as `fl32(y + fl32(alpha · x))` (no fused multiply-add) and rounded once to `y`'s
    /// dtype. `x` must not overlap `y` (for `y ← (1 + alpha)·y` use [`Device::scale`]).
    pub fn axpy(&mut self, alpha: f32, x: View, y: View) -> Result<()> {
        check_float("axpy", x)?;
        check_float("axpy", y)?;
        check_len("axpy", x.len(), y.len())?;
        on_cuda!(self, g => g.axpy("axpy", Some(alpha), x, y));
        self.host_op("axpy", [x], [y], |[xs], [ys]| {
            zip_in_place((x.dtype(), xs), (y.dtype(), ys), |x, y| y + alpha * x);
            Ok(())
        })
    }

    /// `y ← y + x` (the exact `alpha = 1` case of [`Device::axpy`]: `fl32(y + x)`, then rounded to
    /// `y`'s dtype). Same rules as `axpy`.
    pub fn add(&mut self, x: View, y: View) -> Result<()> {
        check_float("add", x)?;
        check_float("add", y)?;
        check_len("add", x.len(), y.len())?;
        on_cuda!(self, g => g.axpy("add", None, x, y));
        self.host_op("add", [x], [y], |[xs], [ys]| {
            zip_in_place((x.dtype(), xs), (y.dtype(), ys), |x, y| y + x);
            Ok(())
        })
    }

    /// `Σ xᵢ²` of a float view in f64, in the blocked order of [`crate::SUM_BLOCK`] and
    /// [`crate::SUM_GROUP`]: each block of 4096 consecutive elements is summed in index order
    /// from `+0.0`, the sums of each run of 32 blocks are added in index order from `+0.0`, then
    /// the group sums in index order from `+0.0`. Each square is exact in f64 (a 24-bit significand
    /// squared fits in 53 bits), so only the additions round, and both backends add in this
    /// order (a GPU computes the block sums in parallel). Non-finite elements make the result
    /// non-finite. Takes `&mut self` because on a GPU a reduction launches work and uses device
    /// scratch memory.
    pub fn sum_squares(&mut self, view: View) -> Result<f64> {
        crate::check_float("reduction", view)?;
        on_cuda!(self, g => g.sum_squares(view));
        let mut sum = BlockedSum::default();
        for_each_chunk(self, "sum_squares", view, |c| {
            for &v in c {
                sum.push(f64::from(v) * f64::from(v));
            }
        })?;
        Ok(sum.finish())
    }

    /// [`Device::sum_squares`] of each view, in order: the same bits as calling it view by
    /// view, but on a GPU every reduction is launched first and the partial sums come back in
    /// one copy, so a gradient norm over many pieces waits for the device once, not per piece.
    pub fn sum_squares_each(&mut self, views: &[View]) -> Result<Vec<f64>> {
        for &v in views {
            crate::check_float("reduction", v)?;
        }
        on_cuda!(self, g => g.sum_squares_each(views));
        views.iter().map(|&v| self.sum_squares(v)).collect()
    }

    /// [`Device::sum_squares_each`] launched in stages, for views that become final one group
    /// at a time (a gradient norm beside the reductions still in flight): view `i` belongs to
    /// stage `stages[i]`; for each stage number present, in increasing order, `prepare(dev, k)`
    /// runs (it makes stage `k`'s views final, e.g. waits for their reduction, and everything
    /// before it) and then stage `k`'s sums are launched. On a GPU nothing waits for the device
    /// until every stage has been launched, and the partial sums come back in one copy; the
    /// results are the bits of [`Device::sum_squares_each`] over the final views. Stage numbers
    /// need not be consecutive: `prepare` runs once per distinct number, never for a gap.
    /// Every stage but the last is taken to run beside collectives: on a GPU it keeps to a
    /// quarter of the multiprocessors (`set_cuda_kernel_variant("sum_squares_beside", N)` sets
    /// another cap), so call this only where something does run beside it (with nothing in
    /// flight, one [`Device::sum_squares_each`] is faster).
    ///
    /// # Errors
    /// `Length` if `stages` and `views` differ in length, the errors of
    /// [`Device::sum_squares`], and the first error of `prepare` (stages launched before it
    /// complete on the device; nothing is returned for them).
    pub fn sum_squares_each_staged<E: From<DeviceError>>(
        &mut self,
        views: &[View],
        stages: &[usize],
        mut prepare: impl FnMut(&mut Device, usize) -> std::result::Result<(), E>,
    ) -> std::result::Result<Vec<f64>, E> {
        if views.len() != stages.len() {
            return Err(DeviceError::Length {
                what: "sum_squares_each_staged",
                a: views.len(),
                b: stages.len(),
            }
            .into());
        }
        for &v in views {
            crate::check_float("reduction", v)?;
        }
        let mut present = stages.to_vec();
        present.sort_unstable();
        present.dedup();
        let of =
            |k: usize| -> Vec<usize> { (0..views.len()).filter(|&i| stages[i] == k).collect() };
        #[cfg(feature = "cuda")]
        if let Some(g) = self.cuda_mut() {
            let mut sums = g.begin_sums(views)?;
            // Every stage but the last is launched while later stages' reductions may still
            // run beside it.
            let last = present.last().copied();
            for &k in &present {
                prepare(self, k)?;
                self.cuda_mut()
                    .ok_or_else(|| {
                        DeviceError::Unsupported("`prepare` replaced the CUDA device".into())
                    })?
                    .launch_sums(&mut sums, &of(k), Some(k) != last)?;
            }
            let g = self.cuda_mut().ok_or_else(|| {
                DeviceError::Unsupported("`prepare` replaced the CUDA device".into())
            })?;
            return Ok(g.finish_sums(sums)?);
        }
        let mut out = vec![0.0; views.len()];
        for &k in &present {
            prepare(self, k)?;
            let which = of(k);
            let vs: Vec<View> = which.iter().map(|&i| views[i]).collect();
            for (i, s) in which.into_iter().zip(self.sum_squares_each(&vs)?) {
                out[i] = s;
            }
        }
        Ok(out)
    }

    /// Whether any element of the float view is NaN or ±Inf.
    pub fn has_non_finite(&mut self, view: View) -> Result<bool> {
        crate::check_float("reduction", view)?;
        on_cuda!(self, g => g.has_non_finite(view));
        let mut found = false;
        for_each_chunk(self, "has_non_finite", view, |c| {
            found |= c.iter().fold(false, |f, v| f | !v.is_finite());
        })?;
        Ok(found)
    }

    /// `max |xᵢ|` of a float view with NaN ignored (TE's `fmaxf` amax): 0 for an empty or
    /// all-NaN view, +Inf if any element is infinite.
    pub fn max_abs(&mut self, view: View) -> Result<f32> {
        crate::check_float("reduction", view)?;
        on_cuda!(self, g => g.max_abs(view));
        let mut amax = 0u32;
        for_each_chunk(self, "max_abs", view, |c| {
            // Non-negative floats order like their bit patterns; NaN maps to 0.
            let chunk_max = c
                .iter()
                .map(|v| v.to_bits() & 0x7FFF_FFFF)
                .map(|a| if a > 0x7F80_0000 { 0 } else { a })
                .fold(0, u32::max);
            amax = amax.max(chunk_max);
        })?;
        Ok(f32::from_bits(amax))
    }
}
