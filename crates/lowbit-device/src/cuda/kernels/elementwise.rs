//! Launches of the element-wise ops (fill, cast, scale, axpy/add) and the reductions (sum of
//! squares in the blocked order, max-abs, the non-finite check).

use super::{THREADS, blocks, dt};
use crate::cuda::CudaDevice;
use crate::{DType, DeviceError, Result, View};

impl CudaDevice {
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
        unsafe { self.launch_n(name, n, &args![y, n, pattern]) }
    }

    pub(crate) fn cast(&mut self, src: View, dst: View) -> Result<()> {
        let ([x], [y]) = self.ptrs("cast", [src], [dst])?;
        if src.dtype() == dst.dtype() {
            return self.copy(src, dst);
        }
        let n = src.len();
        // f32 -> bf16 (staging): the 16-byte aligned body eight elements per thread, where the
        // head that aligns both sides exists; the same bits as the scalar kernel.
        let head = (0..8u64).find(|&k| (x + 4 * k) % 16 == 0 && (y + 2 * k) % 16 == 0);
        if let (DType::F32, DType::Bf16, Some(h)) = (src.dtype(), dst.dtype(), head) {
            let h = h as usize;
            let n8 = n.saturating_sub(h) / 8;
            if n8 > 0 {
                let body = h..h + 8 * n8;
                self.cast_scalar(src.slice(0..h)?, dst.slice(0..h)?)?;
                let (xb, yb) = (x + 4 * h as u64, y + 2 * h as u64);
                // SAFETY: `xb`/`yb` address elements `body` of the validated views: 8·n8 f32
                // and bf16 elements, both 16-byte aligned (`h` was chosen so).
                unsafe { self.launch_n("cast_f32_bf16_x8", n8, &args![xb, yb, n8 as u64])? };
                return self.cast_scalar(src.slice(body.end..n)?, dst.slice(body.end..n)?);
            }
        }
        self.cast_scalar(src, dst)
    }

    /// The element-per-thread `cast` of two validated views of equal length.
    fn cast_scalar(&mut self, src: View, dst: View) -> Result<()> {
        let ([x], [y]) = self.ptrs("cast", [src], [dst])?;
        let n = src.len();
        let args = args![x, dt(src.dtype()), y, dt(dst.dtype()), n];
        // SAFETY: views validated (same length, float dtypes, disjoint).
        unsafe { self.launch_n("cast", n, &args) }
    }

    pub(crate) fn scale(&mut self, view: View, alpha: f32) -> Result<()> {
        let ([], [y]) = self.ptrs("scale", [], [view])?;
        let n = view.len();
        if view.dtype() == DType::F32 && y.is_multiple_of(16) {
            // SAFETY: the view was validated above: n f32 elements at a 16-byte aligned address.
            return unsafe { self.launch_n("scale_f32x4", n.div_ceil(4), &args![y, n, alpha]) };
        }
        // SAFETY: the view was validated above.
        unsafe { self.launch_n("scale", n, &args![y, dt(view.dtype()), n, alpha]) }
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
        let (a, add) = (alpha.unwrap_or(1.0), u32::from(alpha.is_none()));
        let f32x4 = [x, y].iter().all(|v| v.dtype() == DType::F32)
            && xp.is_multiple_of(16)
            && yp.is_multiple_of(16);
        if f32x4 {
            let args = args![xp, yp, n, a, add];
            // SAFETY: views validated above (n f32 elements each, disjoint), both 16-byte
            // aligned.
            return unsafe { self.launch_n("axpy_f32x4", n.div_ceil(4), &args) };
        }
        let args = args![xp, dt(x.dtype()), yp, dt(y.dtype()), n, a, add];
        // SAFETY: views validated above (same length, float dtypes, disjoint).
        unsafe { self.launch_n("axpy", n, &args) }
    }

    /// [`crate::Device::sum_squares`]: the blocked order of [`crate::SUM_BLOCK`] and
    /// [`crate::SUM_GROUP`], group sums on the device, added in order on the host.
    pub(crate) fn sum_squares(&mut self, view: View) -> Result<f64> {
        Ok(self.sum_squares_each(&[view])?[0])
    }

    /// [`crate::Device::sum_squares_each`]: every view's group sums into one scratch buffer by
    /// one launch per dtype (`sum_squares_many_*`: the views' warps run side by side), copied
    /// into page-locked host memory at once (one f64 per 131072 elements: 38 KB for a
    /// 620M-element shard) and each view's added in order on the host.
    pub(crate) fn sum_squares_each(&mut self, views: &[View]) -> Result<Vec<f64>> {
        let mut sums = self.begin_sums(views)?;
        let all: Vec<usize> = (0..views.len()).collect();
        self.launch_sums(&mut sums, &all, false)?;
        self.finish_sums(sums)
    }

    /// The first part of a sum of squares launched in stages
    /// ([`crate::Device::sum_squares_each_staged`]): validates every view and allocates the
    /// scratch for all their group sums; nothing is launched yet.
    pub(crate) fn begin_sums(&mut self, views: &[View]) -> Result<StagedSums> {
        let mut ptrs = Vec::with_capacity(views.len());
        for &v in views {
            let ([x], []) = self.ptrs("sum_squares", [v], [])?;
            ptrs.push((x, v.dtype(), v.len()));
        }
        let ngroups: Vec<usize> = views.iter().map(|v| sum_groups(v.len())).collect();
        let total: usize = ngroups.iter().sum();
        let starts: Vec<usize> = ngroups
            .iter()
            .scan(0, |at, &ng| {
                *at += ng;
                Some(*at - ng)
            })
            .collect();
        let scratch = if total == 0 {
            None
        } else {
            Some(self.scratch(2 * total)?)
        };
        Ok(StagedSums {
            ptrs,
            ngroups,
            starts,
            total,
            scratch,
            tables: Vec::new(),
        })
    }

    /// Launches the sums of the views `which` (indices into the `begin_sums` views): one launch
    /// per dtype, each view's group sums at its own place in the scratch. `beside`: collectives
    /// run beside these sums (a stage launched while later reductions are in flight).
    pub(crate) fn launch_sums(
        &mut self,
        sums: &mut StagedSums,
        which: &[usize],
        beside: bool,
    ) -> Result<()> {
        let Some(s) = sums.scratch.as_ref().map(|s| s.ptr) else {
            return Ok(());
        };
        for d in [DType::F32, DType::Bf16, DType::F16] {
            let items = which.iter().filter_map(|&i| {
                let &(ptr, dtype, len) = sums.ptrs.get(i)?;
                (dtype == d).then(|| (ptr, len, sums.starts[i]))
            });
            let table = sum_squares_table(items);
            // The tables stay alive until `finish_sums` has waited for the copy.
            if let Some(mem) = self.launch_sum_squares_many(d, &table, s, beside)? {
                sums.tables.push(mem);
            }
        }
        Ok(())
    }

    /// Copies every group sum to the host at once, waits, and adds each view's in order.
    pub(crate) fn finish_sums(&mut self, sums: StagedSums) -> Result<Vec<f64>> {
        let StagedSums {
            ngroups,
            starts,
            total,
            scratch,
            tables,
            ..
        } = sums;
        let Some(s) = scratch else {
            return Ok(vec![0.0; ngroups.len()]);
        };
        let host = self.partials_host(total)?;
        // SAFETY: `host` holds at least `total` f64 (page-locked; nothing else writes it, and
        // every earlier call waited for its copy before returning); the source is the `total`
        // partials of `s`, which lives until after the synchronization below; the copy is
        // ordered after the launches on this stream.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(host, total);
            cudarc::driver::result::memcpy_dtoh_async(dst, s.ptr, self.stream.cu_stream())
        }
        .map_err(crate::cuda::cuda_err("copying the group sums to the host"))?;
        self.stream
            .synchronize()
            .map_err(crate::cuda::cuda_err("waiting for the group sums"))?;
        drop(tables);
        drop(s);
        // SAFETY: the copy has completed (the stream was synchronized); the `total` f64 of
        // `host` are not written again until the next call.
        let all = unsafe { std::slice::from_raw_parts(host, total) };
        Ok(starts
            .iter()
            .zip(&ngroups)
            .map(|(&at, &ng)| crate::ops::add_partials(0.0, &all[at..at + ng]))
            .collect())
    }

    /// The page-locked host buffer of small reads (the sums' partials, pending amaxes), grown
    /// to hold at least `n` f64. Free between calls: every user waits for its copies before
    /// returning.
    pub(in crate::cuda) fn partials_host(&mut self, n: usize) -> Result<*mut f64> {
        if self.partials_host.as_ref().is_none_or(|h| h.len() < n) {
            self.partials_host = None;
            // Room to grow: the next, slightly larger shard reuses it.
            let len = n.next_power_of_two();
            // SAFETY: the contents are written by device copies before they are read (flags 0:
            // cached, not write-combined, memory, since the host reads it).
            let h = unsafe { self.ctx.alloc_pinned_with_flags::<f64>(len, 0) }
                .map_err(crate::cuda::cuda_err("allocating page-locked memory"))?;
            self.partials_host = Some(Box::new(h));
        }
        let h = self.partials_host.as_mut().expect("allocated above");
        h.as_mut_ptr()
            .map_err(crate::cuda::cuda_err("page-locked memory"))
    }

    /// One `sum_squares_many_*` launch over the table's views (all of dtype `d`), partials at
    /// `partials` (f64 words); `None` when there is nothing to sum, else the uploaded table
    /// (which must stay alive until the launch has run).
    fn launch_sum_squares_many(
        &mut self,
        d: DType,
        table: &SumsqTable,
        partials: u64,
        beside: bool,
    ) -> Result<Option<cudarc::driver::CudaSlice<u64>>> {
        if table.warps == 0 {
            return Ok(None);
        }
        let (name, name_v2) = match d {
            DType::F32 => ("sum_squares_many_f32", "sum_squares_many_f32_v2"),
            DType::Bf16 => ("sum_squares_many_bf16", "sum_squares_many_bf16_v2"),
            _ => ("sum_squares_many_f16", "sum_squares_many_f16_v2"),
        };
        // Version 2 (16-byte loads) when every view of this dtype is 16-byte aligned: two
        // warps per CTA; else version 3 (1 with the L2 prefetch hint: f32 0.87x of a copy
        // against 0.82x, bf16 0.72x against 0.49x, H200) by default, or 1; four warps.
        let name_v3 = match d {
            DType::F32 => "sum_squares_many_f32_v3",
            DType::Bf16 => "sum_squares_many_bf16_v3",
            _ => "sum_squares_many_f16_v3",
        };
        // Beside collectives the default takes version 3 for 16-bit views too: version 2's
        // two-warp CTAs of 128 registers and 32 KB slowed NCCL's bf16 reduce-scatter beside
        // them (2x H200, 1B, bf16 gradients: the norm as the one-call step runs it 0.47 ms with
        // version 2, 0.28 ms with 3, though version 2 alone is faster, 0.47 against 0.63 ms).
        let v2 = self.sum_squares_v2(d) && !(beside && self.sum_squares_version == 0);
        let (name, cta) = if v2 && table.aligned {
            (name_v2, 64)
        } else if matches!(self.sum_squares_version, 0 | 3) {
            (name_v3, 128)
        } else {
            (name, 128)
        };
        let grid = blocks(table.warps.saturating_mul(32), cta);
        // Beside collectives, at most `sum_squares_beside` CTAs (0: no cap) stride over the
        // warps, leaving the other multiprocessors to NCCL's CTAs.
        let cap = self.sum_squares_beside;
        let grid = grid.map(|g| if beside && cap > 0 { g.min(cap) } else { g });
        let (Some(grid), Ok(count)) = (grid, u32::try_from(table.rows.len() / 4)) else {
            return Err(DeviceError::Unsupported(format!(
                "a sum of squares over {} views exceeds the grid",
                table.rows.len() / 4
            )));
        };
        let (mem, t) = self.upload_table(&table.rows)?;
        // SAFETY: every table row addresses `len` elements of a validated view of dtype `d`;
        // its partials (`sum_groups(len)` f64 words at its offset) lie inside the
        // caller's buffer at `partials`, which holds every view's; warps past a view's blocks
        // write nothing; the table (4·count words) is returned to the caller, who keeps it until
        // the launch has run. Version 2 reads 16-byte chunks: only chosen when every view's
        // address is 16-byte aligned (a block's 4096 elements keep that alignment).
        unsafe {
            self.launch(
                name,
                (grid, 1, 1),
                (cta as u32, 1, 1),
                &args![t, count, table.warps as u64, partials],
            )?
        };
        Ok(Some(mem))
    }

    /// Launches the blocked sum-of-squares kernel over `n` elements of dtype `d` at `x` (minus
    /// the f32 elements at `y`), downloads the per-group partials and adds them in index order.
    pub(super) fn blocked_sum_squares(
        &mut self,
        x: u64,
        d: DType,
        y: Option<u64>,
        n: usize,
    ) -> Result<f64> {
        let ng = sum_groups(n);
        if ng == 0 {
            return Ok(0.0);
        }
        let s = self.scratch(2 * ng)?;
        self.launch_sum_squares(x, d, y, n, s.ptr)?;
        Ok(crate::ops::add_partials(
            0.0,
            &partials_f64(&self.fetch(&s)?),
        ))
    }

    /// Launches the blocked sum-of-squares kernel over `n` elements of dtype `d` at `x` (minus
    /// the f32 elements at `y`), writing [`sum_groups`]`(n)` f64 partials at `partials`
    /// (nothing for `n == 0`).
    fn launch_sum_squares(
        &mut self,
        x: u64,
        d: DType,
        y: Option<u64>,
        n: usize,
        partials: u64,
    ) -> Result<()> {
        let nb = n.div_ceil(crate::SUM_BLOCK);
        if nb == 0 {
            return Ok(());
        }
        // Version 2 (16-byte loads) needs 16-byte aligned inputs; else version 1.
        let v2 = self.sum_squares_v2(d)
            && x.is_multiple_of(16)
            && y.is_none_or(|y| y.is_multiple_of(16));
        // A warp per 32 blocks; four warps per CTA (version 1), two (version 2), one (version 2
        // of mse: its two shared tiles).
        let warps = match (v2, y) {
            (false, _) => 4,
            (true, None) => 2,
            (true, Some(_)) => 1,
        };
        let Some(grid) = blocks(nb, 32 * warps) else {
            return Err(DeviceError::Unsupported(format!(
                "a sum of squares over {n} elements exceeds the grid"
            )));
        };
        let (name, args) = match (d, y) {
            (DType::F32, Some(y)) => (
                if v2 {
                    "mse_blocks_f32_v2"
                } else {
                    "mse_blocks_f32"
                },
                args![x, y, n, partials].to_vec(),
            ),
            (d, _) => (
                match (d, v2) {
                    (DType::Bf16, false) => "sum_squares_blocks_bf16",
                    (DType::F16, false) => "sum_squares_blocks_f16",
                    (_, false) => "sum_squares_blocks_f32",
                    (DType::Bf16, true) => "sum_squares_blocks_bf16_v2",
                    (DType::F16, true) => "sum_squares_blocks_f16_v2",
                    (_, true) => "sum_squares_blocks_f32_v2",
                },
                args![x, n, partials].to_vec(),
            ),
        };
        let block = (32 * warps as u32, 1, 1);
        // SAFETY: `x` (and `y`) address `n` elements of validated views of dtype `d` (float:
        // checked by the callers; `y` only with f32), 16-byte aligned for the version-2 kernels
        // (checked above); `partials` addresses `sum_groups(n)` f64 words of a live scratch
        // buffer and the kernel writes partials[g] only for g < sum_groups(n) (one per warp
        // that owns a block).
        unsafe { self.launch(name, (grid, 1, 1), block, &args) }
    }

    pub(crate) fn max_abs(&mut self, view: View) -> Result<f32> {
        let ([x], []) = self.ptrs("max_abs", [view], [])?;
        let s = self.scratch(1)?;
        self.launch_max_abs(x, view.dtype(), view.len(), s.ptr)?;
        Ok(f32::from_bits(self.fetch_word(&s)?))
    }

    /// Enqueues the amax kernel: the max of |x| bits (NaN as 0) of `n` elements of dtype `d` at
    /// `x` (a validated view) into the zeroed word at `out`.
    pub(in crate::cuda) fn launch_max_abs(
        &mut self,
        x: u64,
        d: DType,
        n: usize,
        out: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if self.nvfp4_version >= 2 && d == DType::Bf16 && x.is_multiple_of(16) {
            // Four 16-byte loads per thread and iteration: a few blocks per SM suffice.
            let grid = (n.div_ceil(8 * 256 * 4).clamp(1, 2048) as u32, 1, 1);
            // SAFETY: `x` addresses `n` bf16 elements of a validated, 16-byte aligned view
            // (16-byte chunks, then the tail element by element); `out` is a live zeroed word.
            return unsafe {
                self.launch("max_abs_bits_bf16_v2", grid, (256, 1, 1), &args![x, n, out])
            };
        }
        let args = args![x, dt(d), n, out, u32::from(x.is_multiple_of(16))];
        // A few blocks per SM are enough for a streaming read, and keep the atomics few.
        let grid = (n.div_ceil(THREADS as usize * 8).clamp(1, 4096) as u32, 1, 1);
        // SAFETY: `x` addresses `n` elements of a validated view (16-byte chunks only when it is
        // 16-byte aligned); `out` is a live zeroed word.
        unsafe { self.launch("max_abs_bits", grid, (THREADS, 1, 1), &args) }
    }

    pub(crate) fn has_non_finite(&mut self, view: View) -> Result<bool> {
        let ([x], []) = self.ptrs("has_non_finite", [view], [])?;
        let s = self.scratch(1)?;
        let n = view.len();
        let args = args![x, dt(view.dtype()), n, s.ptr];
        // SAFETY: the view was validated above; `s` is a live one-word scratch buffer.
        unsafe { self.launch_n("any_non_finite", n, &args)? };
        Ok(self.fetch_word(&s)? != 0)
    }
}

/// The f64 partials of a blocked sum over `n` elements: one per group of
/// [`crate::SUM_GROUP`] blocks (a warp's).
fn sum_groups(n: usize) -> usize {
    n.div_ceil(crate::SUM_BLOCK * crate::SUM_GROUP)
}

// The kernels' warps own a group each, a lane per block (`sumsq_group` in `crates/lowbit-kernels/ops.cu`).
const _: () = assert!(crate::SUM_GROUP == 32);

/// A sum of squares launched in stages: the validated views (address, dtype, elements), where
/// each view's group sums go in the scratch, and the launch tables, which live until the
/// group sums have been copied back (dropping it frees both in stream order).
pub(crate) struct StagedSums {
    ptrs: Vec<(u64, DType, usize)>,
    ngroups: Vec<usize>,
    starts: Vec<usize>,
    total: usize,
    scratch: Option<super::Scratch>,
    tables: Vec<cudarc::driver::CudaSlice<u64>>,
}

/// The launch table of `sum_squares_many_*`: 4 words per view (address, length, offset of its
/// partials in f64 words, first global warp; a warp per group; views own warps [first, next view's first)).
struct SumsqTable {
    rows: Vec<u64>,
    warps: usize,
    /// Every non-empty view 16-byte aligned (what version 2 needs).
    aligned: bool,
}

/// The table over views given as (address, elements, first partial).
fn sum_squares_table(views: impl Iterator<Item = (u64, usize, usize)>) -> SumsqTable {
    let mut t = SumsqTable {
        rows: Vec::new(),
        warps: 0,
        aligned: true,
    };
    for (ptr, len, partials) in views {
        t.rows
            .extend([ptr, len as u64, partials as u64, t.warps as u64]);
        t.warps += sum_groups(len);
        // Views that are empty are never read (their warps are none).
        t.aligned &= len == 0 || ptr.is_multiple_of(16);
    }
    t
}

/// Scratch words (little-endian pairs) as the f64 partials the kernels wrote.
fn partials_f64(words: &[u32]) -> Vec<f64> {
    words
        .as_chunks::<2>()
        .0
        .iter()
        .map(|[lo, hi]| f64::from_bits(u64::from(*lo) | (u64::from(*hi) << 32)))
        .collect()
}
