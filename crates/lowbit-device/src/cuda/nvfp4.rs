//! Host side of `cuda/nvfp4.cu`: the NVFP4 variants the 1D kernels of `cuda/ops.cu` do not
//! cover — 2D (16x16) scales with their tile-amax pass, stochastic rounding, the Hadamard
//! transform of the columnwise copy (and its dequantization), a columnwise copy of any row
//! count, and `nvfp4_finish_2d`. Each entry point returns `None` (or `false`) for the arguments
//! it does not take, so the caller's host fallback runs (and reports the library's errors).
//! Callers have validated dtypes, lengths and views unless stated.

use cudarc::driver::{CudaSlice, DevicePtr};
use lowbit_formats::{NanPolicy, Nvfp4Config};

use super::{Arg, CudaDevice, cuda_err};
use crate::{DType, Nvfp4Amax, Nvfp4Views, Result, View};

/// Which variants dispatch to the kernels (each only once bit-exact on a GPU).
pub(crate) struct Enabled {
    /// 2D (16x16 tile) scales.
    pub(crate) two_d: bool,
    /// Stochastic rounding.
    pub(crate) stochastic: bool,
    /// The Hadamard transform of the columnwise copy, and the dequantization of such a copy.
    pub(crate) rht: bool,
    /// 1D round-to-nearest columnwise copies of `rows % 16 != 0` (the ops.cu kernel needs
    /// whole blocks).
    pub(crate) partial_columns: bool,
    /// `nvfp4_finish_2d`.
    pub(crate) finish_2d: bool,
}

/// The variants with kernels.
pub(crate) const ENABLED: Enabled = Enabled {
    two_d: true,
    stochastic: true,
    rht: true,
    partial_columns: true,
    finish_2d: true,
};

/// Threads per block of the grid-stride kernels.
const THREADS: u32 = 256;

/// The kernels' dtype code of a float dtype.
fn dt(d: DType) -> u32 {
    match d {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
        DType::U8 => 3,
    }
}

/// Grid of a grid-stride kernel over `n` items (capped; the kernels loop).
fn stride_grid(n: usize) -> (u32, u32, u32) {
    let b = n.div_ceil(THREADS as usize).clamp(1, 1 << 16);
    (b as u32, 1, 1)
}

/// `u32::try_from` capped at `max` (grid dimensions of striding kernels).
fn capped(n: usize, max: u32) -> u32 {
    u32::try_from(n).unwrap_or(max).clamp(1, max)
}

/// A zeroed device scratch buffer and its address (freed in stream order when dropped).
struct Scratch {
    mem: CudaSlice<u32>,
    ptr: u64,
}

impl CudaDevice {
    fn nv_scratch(&self, n: usize) -> Result<Scratch> {
        let mem = self
            .stream
            .alloc_zeros::<u32>(n.max(1))
            .map_err(cuda_err("allocating scratch"))?;
        let ptr = {
            let (p, _sync) = mem.device_ptr(&self.stream);
            p
        };
        Ok(Scratch { mem, ptr })
    }

    /// The first word of a scratch buffer (synchronising).
    fn nv_fetch_word(&self, s: &Scratch) -> Result<u32> {
        let v = self
            .stream
            .clone_dtoh(&s.mem)
            .map_err(cuda_err("copying to the host"))?;
        self.stream
            .synchronize()
            .map_err(cuda_err("waiting for the stream"))?;
        Ok(v.first().copied().unwrap_or(0))
    }

    /// Launches a grid-stride kernel of 256-thread blocks over `n` items (nothing for `n == 0`).
    ///
    /// # Safety
    /// As [`CudaDevice::launch`].
    unsafe fn nv_launch_n(&mut self, name: &'static str, n: usize, args: &[Arg]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        // SAFETY: forwarded to the caller.
        unsafe { self.launch(name, stride_grid(n), (THREADS, 1, 1), args) }
    }

    /// The tensor factors (k and the 256-entry reciprocal table) from the amax word at `amax`.
    fn nv_params(&mut self, amax: u64) -> Result<Scratch> {
        let p = self.nv_scratch(257)?;
        // SAFETY: `amax` is a live scratch word, `p` holds 257 words, the tables 512 floats
        // (the E4M3 values first).
        unsafe {
            self.launch(
                "nvfp4_params",
                (1, 1, 1),
                (256, 1, 1),
                &[Arg::U64(amax), Arg::U64(self.tables_ptr), Arg::U64(p.ptr)],
            )?;
        }
        Ok(p)
    }

    /// NVFP4 quantization by the kernels of `cuda/nvfp4.cu` for the variants of [`ENABLED`]
    /// (TE NaN policy, non-empty matrix; the Hadamard transform of a columnwise copy needs
    /// `rows % 16 == 0` and no 2D scales), else `Ok(None)`. Views validated by the caller.
    pub(crate) fn nvfp4_quantize_variants(
        &mut self,
        src: View,
        rows: usize,
        cols: usize,
        cfg: &Nvfp4Config,
        out: &Nvfp4Views,
    ) -> Result<Option<Nvfp4Amax>> {
        let rht = cfg.rht && out.columnwise.is_some();
        let sr = cfg.stochastic_rounding;
        let plain = !cfg.two_d && !rht && sr.is_none();
        if cfg.nan_policy != NanPolicy::Te
            || rows == 0
            || cols == 0
            || (cfg.rht && cfg.two_d)
            || (rht && !rows.is_multiple_of(16))
            || (cfg.two_d && !ENABLED.two_d)
            || (sr.is_some() && !ENABLED.stochastic)
            || (rht && !ENABLED.rht)
            || (plain && !ENABLED.partial_columns)
        {
            return Ok(None);
        }
        let x = self.device_ptr(src)?;
        let xd = dt(src.dtype());
        let (r, c) = (rows as u64, cols as u64);
        let (tr, tc) = (rows.div_ceil(16), cols.div_ceil(16));
        let seed = sr.unwrap_or(0);
        let (k0, k1) = (seed as u32, (seed >> 32) as u32);
        let amax = self.nv_scratch(1)?;
        let tiles = self.nv_scratch(if cfg.two_d { tr * tc } else { 1 })?;
        if cfg.two_d {
            let grid = (
                capped(cols.div_ceil(256), u32::MAX >> 1),
                capped(tr, 65535),
                1,
            );
            let args = [
                Arg::U64(x),
                Arg::U32(xd),
                Arg::U64(r),
                Arg::U64(c),
                Arg::U64(tiles.ptr),
                Arg::U64(amax.ptr),
            ];
            // SAFETY: `x` addresses rows·cols validated elements; `tiles` holds tr·tc words and
            // `amax` one.
            unsafe { self.launch("nvfp4x_tile_amax", grid, (256, 1, 1), &args)? };
        } else {
            self.launch_max_abs(x, src.dtype(), src.len(), amax.ptr)?;
        }
        let params = self.nv_params(amax.ptr)?;
        let tp = if cfg.two_d { tiles.ptr } else { 0 };
        if let Some((d, s)) = out.rowwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let vec = src.dtype() == DType::Bf16
                && cols.is_multiple_of(16)
                && x.is_multiple_of(16)
                && d.is_multiple_of(8);
            let grid = (
                capped(tc.div_ceil(128), u32::MAX >> 1),
                capped(rows, 65535),
                1,
            );
            let args = [
                Arg::U64(x),
                Arg::U32(xd),
                Arg::U64(d),
                Arg::U64(s),
                Arg::U64(params.ptr),
                Arg::U64(tp),
                Arg::U64(r),
                Arg::U64(c),
                Arg::U32(u32::from(sr.is_some())),
                Arg::U32(k0),
                Arg::U32(k1),
                Arg::U32(u32::from(vec)),
            ];
            // SAFETY: views validated by the caller (rows·cols in; rows·ceil(cols/2) data and
            // rows·ceil(cols/16) scale bytes out); `params` holds 257 words, `tp` is null or
            // tr·tc tile words; 16-byte loads and 8-byte stores only with `vec` (bf16, whole
            // blocks, alignment checked here; the row pitch cols/2 is a multiple of 8).
            unsafe { self.launch("nvfp4x_rows", grid, (128, 1, 1), &args)? };
        }
        let mut col_amax = None;
        if let Some((d, s)) = out.columnwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let rht_amax = if rht {
                let a = self.nv_scratch(1)?;
                let args = [
                    Arg::U64(x),
                    Arg::U32(xd),
                    Arg::U64(r),
                    Arg::U64(c),
                    Arg::U64(a.ptr),
                ];
                // SAFETY: `x` addresses rows·cols validated elements (rows % 16 == 0); `a` is
                // one live word.
                unsafe { self.nv_launch_n("nvfp4x_rht_amax", rows / 16 * cols, &args)? };
                let p = self.nv_params(a.ptr)?;
                Some((a, p))
            } else {
                None
            };
            let pp = rht_amax.as_ref().map_or(params.ptr, |(_, p)| p.ptr);
            let args = [
                Arg::U64(x),
                Arg::U32(xd),
                Arg::U64(d),
                Arg::U64(s),
                Arg::U64(pp),
                Arg::U64(tp),
                Arg::U64(r),
                Arg::U64(c),
                Arg::U32(u32::from(rht)),
                Arg::U32(u32::from(sr.is_some())),
                Arg::U32(k0),
                Arg::U32(k1),
                Arg::U32(u32::from(rows.is_multiple_of(16) && d.is_multiple_of(8))),
            ];
            // SAFETY: views validated by the caller (cols·ceil(rows/2) data and
            // cols·ceil(rows/16) scale bytes out); the transform only with rows % 16 == 0;
            // 8-byte stores only for whole blocks at 8-byte aligned addresses (rows % 16 == 0
            // makes the row pitch rows/2 a multiple of 8, `d` is checked here).
            unsafe { self.nv_launch_n("nvfp4x_cols", tr * cols, &args)? };
            if let Some((a, _)) = &rht_amax {
                col_amax = Some(f32::from_bits(self.nv_fetch_word(a)?));
            }
            drop(rht_amax);
        }
        let a = f32::from_bits(self.nv_fetch_word(&amax)?);
        drop((tiles, params));
        Ok(Some(Nvfp4Amax {
            rowwise: a,
            columnwise: col_amax.unwrap_or(a),
        }))
    }

    /// Dequantizes a Hadamard-transformed columnwise copy (views validated by the caller,
    /// `rows % 16 == 0`), or `Ok(false)` when that variant has no kernel.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn nvfp4_dequantize_rht(
        &mut self,
        data: View,
        scales: View,
        amax: f32,
        rows: usize,
        cols: usize,
        dst: View,
    ) -> Result<bool> {
        if !ENABLED.rht || !rows.is_multiple_of(16) {
            return Ok(false);
        }
        let factor_inv = (1.0f64 / (6.0 * 448.0)) as f32;
        let args = [
            Arg::U64(self.device_ptr(data)?),
            Arg::U64(self.device_ptr(scales)?),
            Arg::U64(self.tables_ptr),
            Arg::U64(self.device_ptr(dst)?),
            Arg::U32(dt(dst.dtype())),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::F32(amax),
            Arg::F32(factor_inv),
        ];
        // SAFETY: views validated by the caller with the plane's shapes (cols·rows/2 data,
        // cols·rows/16 scales, rows·cols dst); the tables start with the 256 E4M3 values.
        unsafe { self.nv_launch_n("nvfp4x_dequantize_rht", rows / 16 * cols, &args)? };
        Ok(true)
    }

    /// `nvfp4_finish_2d` by a kernel, or `Ok(None)` whenever the host path would fail or
    /// write piecewise (wrong dtypes or lengths, an odd column count, dead or overlapping
    /// views), so that its errors stay the host's.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn nvfp4_finish_2d_kernel(
        &mut self,
        rows: usize,
        cols: usize,
        tiles: View,
        [rd, rs, cd, cs]: [View; 4],
    ) -> Result<Option<f32>> {
        let (tr, tc) = (rows.div_ceil(16), cols.div_ceil(16));
        let ok = ENABLED.finish_2d
            && rows > 0
            && cols > 0
            && cols.is_multiple_of(2)
            && tiles.dtype() == DType::F32
            && tiles.len() == tr * tc
            && [rd, rs, cd, cs].iter().all(|v| v.dtype() == DType::U8)
            && rd.len() * 2 == rows * cols
            && rs.len() == rows * tc
            && cd.len() == cols * rows.div_ceil(2)
            && cs.len() == cols * tr
            && self
                .check_views("nvfp4_finish_2d", &[tiles, rd], &[rs, cd, cs])
                .is_ok();
        if !ok {
            return Ok(None);
        }
        let t = self.device_ptr(tiles)?;
        let amax = self.nv_scratch(1)?;
        let args = [
            Arg::U64(t),
            Arg::U64(tiles.len() as u64),
            Arg::U64(amax.ptr),
        ];
        // SAFETY: `tiles` is a validated f32 view of tr·tc words; `amax` one live zeroed word.
        unsafe { self.launch_n("u32_max", tiles.len(), &args)? };
        let params = self.nv_params(amax.ptr)?;
        let n = rs.len() + cd.len() + cs.len();
        let args = [
            Arg::U64(self.device_ptr(rd)?),
            Arg::U64(t),
            Arg::U64(params.ptr),
            Arg::U64(rows as u64),
            Arg::U64(cols as u64),
            Arg::U64(self.device_ptr(rs)?),
            Arg::U64(self.device_ptr(cd)?),
            Arg::U64(self.device_ptr(cs)?),
        ];
        // SAFETY: every view checked above (live, in bounds, disjoint outputs, the exact
        // lengths the kernel reads and writes).
        unsafe { self.nv_launch_n("nvfp4x_finish_2d", n, &args)? };
        let a = f32::from_bits(self.nv_fetch_word(&amax)?);
        drop(params);
        Ok(Some(a))
    }
}
