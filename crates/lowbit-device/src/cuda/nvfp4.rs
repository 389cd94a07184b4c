//! Host side of `crates/lowbit-kernels/nvfp4.cu`: the NVFP4 variants the 1D kernels of `crates/lowbit-kernels/ops.cu` do not
//! cover — 2D (16x16) scales with their tile-amax pass, stochastic rounding, the Hadamard
//! transform of the columnwise copy (and its dequantization), a columnwise copy of any row
//! count, and `nvfp4_finish_2d`. Each entry point returns `None` (or `false`) for the arguments
//! it does not take, so the caller's host fallback runs (and reports the library's errors).
//! Callers have validated dtypes, lengths and views unless stated.

use lowbit_formats::NanPolicy;

use super::CudaDevice;
use super::kernels::{NVFP4_FACTOR_INV, Nvfp4Quantize, capped, dt, nvfp4_rows_vec};
use crate::{DType, Nvfp4Amax, Result, View};

/// Matrices per launch of `nvfp4x_finish_2d_same`: its parameter struct's capacity
/// (`FINISH2D_SAME_MAX` in `crates/lowbit-kernels/nvfp4.cu`; 3104 bytes of parameters).
const FINISH2D_SAME_MAX: usize = 64;

/// Which variants dispatch to the kernels (each only once bit-exact on a GPU).
mod enabled {
    /// 2D (16x16 tile) scales.
    pub(super) const TWO_D: bool = true;
    /// Stochastic rounding.
    pub(super) const STOCHASTIC: bool = true;
    /// The Hadamard transform of the columnwise copy, and the dequantization of such a copy.
    pub(super) const RHT: bool = true;
    /// 1D round-to-nearest columnwise copies of `rows % 16 != 0` (the ops.cu kernel needs
    /// whole blocks).
    pub(super) const PARTIAL_COLUMNS: bool = true;
    /// `nvfp4_finish_2d`.
    pub(super) const FINISH_2D: bool = true;
}

/// Versions 3-5's matrices of one shape: `[rows, cols]`, the launches' grids
/// ([`same_shape_grids`]) and each matrix's row of `Finish2dSameParams`.
type Finish2dSame = (([u64; 2], [u32; 5]), Vec<[u64; 6]>);

/// The grids of versions 3-5's launches for a `rows x cols` matrix (rows % 32 == 0): 256x256
/// tiles for `nvfp4x_finish_2d_same` and `_v4` (x across, y down; at most 65535 tile rows),
/// 16-byte chunks of both scale copies (rows · ceil(cols/16) + cols · rows/16 bytes) on x for
/// `nvfp4x_scales_2d_same`, 256 threads a CTA, and 512x512 blocks for `_v5`: `[gx, gy, sx,
/// gx5, gy5]`; `None` where one does not fit.
fn same_shape_grids(rows: usize, cols: usize) -> Option<[u32; 5]> {
    let gy = u32::try_from(rows.div_ceil(256))
        .ok()
        .filter(|&y| y <= 65535)?;
    let gx = super::kernels::blocks(cols.div_ceil(256), 1)?;
    let scale_chunks = (rows * cols.div_ceil(16)).div_ceil(16) + (cols * (rows / 16)).div_ceil(16);
    let sx = super::kernels::blocks(scale_chunks, 256)?;
    let gx5 = super::kernels::blocks(cols.div_ceil(512), 1)?;
    let gy5 = gy.div_ceil(2);
    Some([gx, gy, sx, gx5, gy5])
}

/// Version 5 launches `nvfp4x_finish_2d_same_v5` for a chunk of matrices when its grid has at
/// least this many CTAs, else `_v4`: a 512x512 block per CTA leaves small launches with too
/// few CTAs to fill the GPU (1x H100: 2 matrices of 768x2304, 20 CTAs, 14.2 us against v4's
/// 10.0 us; 32 of 512x2048, 128 CTAs, 17.2 against 17.6 us).
const FINISH2D_V5_MIN_CTAS: u64 = 128;

/// Matrices per launch of `nvfp4x_finish_2d_mixed`: its parameter struct's capacity
/// (`FINISH2D_MIXED_MAX` in `crates/lowbit-kernels/nvfp4.cu`; 7688 bytes of parameters, so that Llama-3.2-1B's
/// 112 matrices take one launch).
const FINISH2D_MIXED_MAX: usize = 128;

/// The capacity of `nvfp4x_finish_2d_mixed_32`, which takes launches of at most this many
/// matrices (`FINISH2D_MIXED_SMALL` in `crates/lowbit-kernels/nvfp4.cu`; 1928 bytes of parameters: past 4 KB a
/// launch costs the host ~3 us more, and the step completes its bucket groups of 28 matrices
/// one call each).
const FINISH2D_MIXED_SMALL: usize = 32;

/// Version 7's launches of `nvfp4x_finish_2d_mixed` for the qualifying matrices of a call
/// (`same`: grouped by shape, each row `Finish2dSameParams`' six addresses): per launch the
/// kernel (`nvfp4x_finish_2d_mixed_32` for at most [`FINISH2D_MIXED_SMALL`] matrices), its CTA
/// count and its `Finish2dMixedParamsT` packed into u64 words; `None` where version 5's
/// per-shape launches take them instead: fewer than [`FINISH2D_V5_MIN_CTAS`] blocks in all (too
/// few to fill the GPU), or a shape or CTA count past 32 bits.
fn mixed_launches(same: &[Finish2dSame]) -> Option<Vec<(&'static str, u32, Vec<u64>)>> {
    let mut items = Vec::new();
    for (([rows, cols], [_, _, _, gx5, gy5]), group) in same {
        let dims = [u32::try_from(*rows).ok()?, u32::try_from(*cols).ok()?];
        let blocks = u64::from(*gx5) * u64::from(*gy5);
        items.extend(group.iter().map(|row| (dims, blocks, *row)));
    }
    let total: u64 = items.iter().map(|i| i.1).sum();
    if total < FINISH2D_V5_MIN_CTAS {
        return None;
    }
    // u64 words: [items, pad], first[cap] and dims[cap][2] as u32 pairs, ptrs[cap][6].
    const FIRST: usize = 1;
    let mut launches = Vec::new();
    for chunk in items.chunks(FINISH2D_MIXED_MAX) {
        let (name, cap) = if chunk.len() <= FINISH2D_MIXED_SMALL {
            ("nvfp4x_finish_2d_mixed_32", FINISH2D_MIXED_SMALL)
        } else {
            ("nvfp4x_finish_2d_mixed", FINISH2D_MIXED_MAX)
        };
        let dims_at = FIRST + cap / 2;
        let ptrs_at = dims_at + cap;
        let mut words = vec![0u64; ptrs_at + 6 * cap];
        let mut first = 0u64;
        for (k, (dims, blocks, row)) in chunk.iter().enumerate() {
            let f = u32::try_from(first).ok()?;
            words[FIRST + k / 2] |= u64::from(f) << (32 * (k % 2));
            words[dims_at + k] = u64::from(dims[0]) | u64::from(dims[1]) << 32;
            words[ptrs_at + 6 * k..][..6].copy_from_slice(row);
            first += blocks;
        }
        let ctas = u32::try_from(first)
            .ok()
            .filter(|&c| c <= i32::MAX as u32)?;
        words[0] = chunk.len() as u64;
        launches.push((name, ctas, words));
    }
    Some(launches)
}

impl CudaDevice {
    /// NVFP4 quantization by the kernels of `crates/lowbit-kernels/nvfp4.cu` for the variants of [`enabled`]
    /// (TE NaN policy, non-empty matrix; the Hadamard transform of a columnwise copy needs
    /// `rows % 16 == 0` and no 2D scales), else `Ok(None)`. Views validated by the caller.
    pub(crate) fn nvfp4_quantize_variants(
        &mut self,
        q: &Nvfp4Quantize<'_>,
    ) -> Result<Option<Nvfp4Amax>> {
        let (src, [rows, cols], cfg, out) = (q.src, q.shape, q.cfg, q.out);
        let rht = cfg.rht && out.columnwise.is_some();
        let sr = cfg.stochastic_rounding;
        let plain = !cfg.two_d && !rht && sr.is_none();
        if cfg.nan_policy != NanPolicy::Te
            || rows == 0
            || cols == 0
            || (cfg.rht && cfg.two_d)
            || (rht && !rows.is_multiple_of(16))
            || (cfg.two_d && !enabled::TWO_D)
            || (sr.is_some() && !enabled::STOCHASTIC)
            || (rht && !enabled::RHT)
            || (plain && !enabled::PARTIAL_COLUMNS)
        {
            return Ok(None);
        }
        let x = self.device_ptr(src)?;
        let xd = dt(src.dtype());
        let (r, c) = (rows as u64, cols as u64);
        let (tr, tc) = (rows.div_ceil(16), cols.div_ceil(16));
        let seed = sr.unwrap_or(0);
        let (k0, k1) = (seed as u32, (seed >> 32) as u32);
        let sr_flag = u32::from(sr.is_some());
        let amax = self.scratch(1)?;
        let tiles = self.scratch(if cfg.two_d { tr * tc } else { 1 })?;
        if cfg.two_d {
            let grid = (
                capped(cols.div_ceil(256), u32::MAX >> 1),
                capped(tr, 65535),
                1,
            );
            let args = args![x, xd, r, c, tiles.ptr, amax.ptr];
            // SAFETY: `x` addresses rows·cols validated elements; `tiles` holds tr·tc words and
            // `amax` one.
            unsafe { self.launch("nvfp4x_tile_amax", grid, (256, 1, 1), &args)? };
        } else {
            self.launch_max_abs(x, src.dtype(), src.len(), amax.ptr)?;
        }
        let params = self.nvfp4_params(amax.ptr)?;
        let tp = if cfg.two_d { tiles.ptr } else { 0 };
        if let Some((d, s)) = out.rowwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let vec = nvfp4_rows_vec(src.dtype(), cols, x, d);
            let grid = (
                capped(tc.div_ceil(128), u32::MAX >> 1),
                capped(rows, 65535),
                1,
            );
            let args = args![
                x,
                xd,
                d,
                s,
                params.ptr,
                tp,
                r,
                c,
                sr_flag,
                k0,
                k1,
                u32::from(vec)
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
                let a = self.scratch(1)?;
                let args = args![x, xd, r, c, a.ptr];
                // SAFETY: `x` addresses rows·cols validated elements (rows % 16 == 0); `a` is
                // one live word.
                unsafe { self.launch_n("nvfp4x_rht_amax", rows / 16 * cols, &args)? };
                let p = self.nvfp4_params(a.ptr)?;
                Some((a, p))
            } else {
                None
            };
            let pp = rht_amax.as_ref().map_or(params.ptr, |(_, p)| p.ptr);
            let vec = u32::from(rows.is_multiple_of(16) && d.is_multiple_of(8));
            let args = args![
                x,
                xd,
                d,
                s,
                pp,
                tp,
                r,
                c,
                u32::from(rht),
                sr_flag,
                k0,
                k1,
                vec
            ];
            // SAFETY: views validated by the caller (cols·ceil(rows/2) data and
            // cols·ceil(rows/16) scale bytes out); the transform only with rows % 16 == 0;
            // 8-byte stores only for whole blocks at 8-byte aligned addresses (rows % 16 == 0
            // makes the row pitch rows/2 a multiple of 8, `d` is checked here).
            unsafe { self.launch_n("nvfp4x_cols", tr * cols, &args)? };
            if let Some((a, _)) = &rht_amax {
                col_amax = Some(f32::from_bits(self.fetch_word(a)?));
            }
            drop(rht_amax);
        }
        let a = f32::from_bits(self.fetch_word(&amax)?);
        drop((tiles, params));
        Ok(Some(Nvfp4Amax {
            rowwise: a,
            columnwise: col_amax.unwrap_or(a),
        }))
    }

    /// Dequantizes a Hadamard-transformed columnwise copy `[data, scales, dst]` of a
    /// `[rows, cols]` matrix with global amax `amax` (views validated by the caller), or
    /// `Ok(false)` when that variant has no kernel (or `rows % 16 != 0`).
    pub(super) fn nvfp4_dequantize_rht(
        &mut self,
        views: [View; 3],
        amax: f32,
        shape: [usize; 2],
    ) -> Result<bool> {
        let [rows, cols] = shape;
        if !enabled::RHT || !rows.is_multiple_of(16) {
            return Ok(false);
        }
        let mut args = self.dequantize_args(views, self.tables_ptr, shape)?;
        args.extend(args![amax, NVFP4_FACTOR_INV]);
        // SAFETY: views validated by the caller with the plane's shapes (cols·rows/2 data,
        // cols·rows/16 scales, rows·cols dst); the tables start with the 256 E4M3 values.
        unsafe { self.launch_n("nvfp4x_dequantize_rht", rows / 16 * cols, &args)? };
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
        let ok = enabled::FINISH_2D
            && rows > 0
            && cols > 0
            && cols.is_multiple_of(2)
            && tiles.dtype() == DType::F32
            && Some(tiles.len()) == tr.checked_mul(tc)
            && [rd, rs, cd, cs].iter().all(|v| v.dtype() == DType::U8)
            && rd.len().checked_mul(2) == rows.checked_mul(cols)
            && Some(rs.len()) == rows.checked_mul(tc)
            && Some(cd.len()) == cols.checked_mul(rows.div_ceil(2))
            && Some(cs.len()) == cols.checked_mul(tr)
            && self
                .check_views("nvfp4_finish_2d", &[tiles, rd], &[rs, cd, cs])
                .is_ok();
        if !ok {
            return Ok(None);
        }
        let t = self.device_ptr(tiles)?;
        // `tiles` was checked above to be an f32 view of tr·tc words.
        let [amax, params] = self.nvfp4_tile_params(t, tiles.len())?;
        let n = rs.len() + cd.len() + cs.len();
        let args = args![
            self.device_ptr(rd)?,
            t,
            params.ptr,
            rows,
            cols,
            self.device_ptr(rs)?,
            self.device_ptr(cd)?,
            self.device_ptr(cs)?
        ];
        // SAFETY: every view checked above (live, in bounds, disjoint outputs, the exact
        // lengths the kernel reads and writes).
        unsafe { self.launch_n("nvfp4x_finish_2d", n, &args)? };
        let a = f32::from_bits(self.fetch_word(&amax)?);
        drop(params);
        Ok(Some(a))
    }
}

/// A matrix of [`CudaDevice::nvfp4_finish_2d_many`]: `[rows, cols]`, the tile amaxes and the
/// views `[rowwise data, rowwise scales, columnwise data, columnwise scales]`.
pub(crate) type Finish2d = ([usize; 2], View, [View; 4]);

impl CudaDevice {
    /// Which path completes gathered 2D NVFP4 weights in `nvfp4_finish_2d_many`: 7 (the
    /// default: version 5's blocks of every shape in one `nvfp4x_finish_2d_mixed` launch per 128
    /// matrices, see `mixed_launches`), 5 (version 4 over 512x512 blocks, `nvfp4x_finish_2d_same_v5`, whose scale copies go
    /// out in whole 32-byte sectors; `_v4` for launches of fewer than
    /// [`FINISH2D_V5_MIN_CTAS`] blocks; 6: `_v5` for every launch, for tests), 4 (version 3 with one launch per shape,
    /// `nvfp4x_finish_2d_same_v4`, codes and both scale copies), 3 (every matrix's amax in one `u32_max_many` launch, two launches per
    /// shape, one host read of all amaxes), 2 (the same with one `nvfp4x_finish_2d_many` launch for every
    /// shape) or 1 (one `nvfp4_finish_2d` per matrix, each with its own host read).
    pub(crate) fn nvfp4_finish_version(&self) -> u32 {
        self.nvfp4_finish_version
    }

    /// [`crate::Device::nvfp4_finish_2d_many`]'s kernel path (version 7, the default: the
    /// qualifying matrices' 512x512 blocks, every shape in one `nvfp4x_finish_2d_mixed` launch
    /// per 128 matrices where they make at least [`FINISH2D_V5_MIN_CTAS`] blocks, else as
    /// version 5; version 5: the
    /// qualifying matrices by shape, per shape and 64 matrices one `nvfp4x_finish_2d_same_v5`
    /// launch (512x512 blocks; `_v4`'s 256x256 tiles where that grid would be small) for the
    /// columnwise codes and both scale copies; version 4: always `_v4`; version 3: the same with one
    /// `nvfp4x_finish_2d_same` launch for the codes and one `nvfp4x_scales_2d_same` for the
    /// scales, written 16 contiguous bytes per thread; version 2: all of them in one
    /// `nvfp4x_finish_2d_many` launch, scales included): each matrix's global amax (the
    /// raw-bit max of its tiles) into a device word by one `u32_max_many` launch, every matrix
    /// that qualifies (rows % 32 == 0, cols % 8 == 0, rowwise data 4-byte and columnwise data
    /// 16-byte aligned) completed by the version's launches, the others by one
    /// `nvfp4x_finish_2d` launch each (tensor factors from their amax word), then one host read
    /// of all amaxes. `Ok(None)` (nothing launched) when the variant is disabled or there are
    /// more than 65535 matrices. The caller has validated every matrix as
    /// `nvfp4_finish_2d_kernel` does and checked that no output overlaps another matrix's
    /// views.
    ///
    /// With `defer`, nothing is read back: the amax words stay on the device
    /// ([`Finished::Pending`], read by [`CudaDevice::read_pending`]).
    pub(crate) fn nvfp4_finish_2d_many(
        &mut self,
        items: &[Finish2d],
        defer: bool,
    ) -> Result<Option<Finished>> {
        let Ok(1..=65535) = u32::try_from(items.len()) else {
            return Ok(items.is_empty().then(|| Finished::Values(Vec::new())));
        };
        if !enabled::FINISH_2D {
            return Ok(None);
        }
        let amax = self.scratch(items.len())?;
        let mut tiles = Vec::with_capacity(items.len());
        for (_, t, _) in items {
            tiles.push((self.device_ptr(*t)?, t.len()));
        }
        // SAFETY: entry i is the address and length of item i's tile view, an f32 view
        // validated by the caller (live, in bounds); `amax` holds one zeroed word per item; the
        // item count is at most 65535 (checked above).
        unsafe { self.launch_u32_max_many(&tiles, amax.ptr)? };
        let (mut firsts, mut rows_of) = (Vec::new(), Vec::new());
        // Versions 3 and 4: the qualifying matrices by shape and their grids, for
        // `nvfp4x_finish_2d_same` and `nvfp4x_scales_2d_same` (or `nvfp4x_finish_2d_same_v4`).
        let mut same: Vec<Finish2dSame> = Vec::new();
        let mut ctas = 0u64;
        for (i, &([rows, cols], tiles, [rd, rs, cd, cs])) in items.iter().enumerate() {
            let a = amax.ptr + 4 * i as u64;
            let t = self.device_ptr(tiles)?;
            let [rdp, rsp, cdp, csp] = [rd, rs, cd, cs].map(|v| self.device_ptr(v));
            let (rdp, rsp, cdp, csp) = (rdp?, rsp?, cdp?, csp?);
            if rows.is_multiple_of(32)
                && cols.is_multiple_of(8)
                && rdp.is_multiple_of(4)
                && cdp.is_multiple_of(16)
            {
                // Version 3 where its grids fit, decided here so that its launches below
                // cannot fail after others wrote; else the one-launch kernel takes the matrix.
                if let (3..=7, Some(grids)) =
                    (self.nvfp4_finish_version, same_shape_grids(rows, cols))
                {
                    let key = ([rows as u64, cols as u64], grids);
                    let row = [rdp, t, a, rsp, cdp, csp];
                    match same.iter_mut().find(|(k, _)| *k == key) {
                        Some((_, g)) => g.push(row),
                        None => same.push((key, vec![row])),
                    }
                    continue;
                }
                let gx = cols.div_ceil(512) as u64;
                firsts.push(ctas);
                rows_of.extend([rdp, t, a, rows as u64, cols as u64, rsp, cdp, csp, gx]);
                ctas += gx * rows.div_ceil(64) as u64;
                continue;
            }
            let params = self.nvfp4_params(a)?;
            let n = rs.len() + cd.len() + cs.len();
            let args = args![rdp, t, params.ptr, rows, cols, rsp, cdp, csp];
            // SAFETY: the views were validated by the caller as `nvfp4_finish_2d_kernel` checks
            // them (live, in bounds, disjoint outputs, the lengths the kernel reads and
            // writes); `params` holds the factors from this item's amax word.
            unsafe { self.launch_n("nvfp4x_finish_2d", n, &args)? };
            drop(params);
        }
        if let (Some(grid), Ok(n @ 1..)) = (
            usize::try_from(ctas)
                .ok()
                .and_then(|n| super::kernels::blocks(n, 1)),
            u32::try_from(firsts.len()),
        ) {
            let mut table = firsts;
            table.extend(rows_of);
            let (mem, t) = self.upload_table(&table)?;
            // SAFETY: each of the `n` table rows holds the addresses of one matrix's views,
            // validated by the caller with the lengths `nvfp4x_finish_2d` needs (rows·cols/2
            // rowwise bytes, rows·tc row scales, cols·rows/2 columnwise bytes, cols·rows/16
            // column scales, tr·tc tiles), and its amax word; rows % 32 == 0 and cols % 8 == 0
            // (so a thread's 32 rows and 8 columns lie inside the matrix) and the 4-byte loads
            // and 16-byte stores aligned (checked above; the row pitch cols/2 and column pitch
            // rows/2 keep those alignments). CTA b runs a 64x512 block of the matrix whose CTAs
            // [first, first + gx·ceil(rows/64)) hold it. No output overlaps another matrix's
            // views (checked by the caller). `mem` is freed in stream order after the launch.
            unsafe {
                self.launch(
                    "nvfp4x_finish_2d_many",
                    (grid, 1, 1),
                    (128, 1, 1),
                    &args![t, n],
                )?;
            }
            drop(mem);
        } else if ctas > 0 {
            return Err(crate::DeviceError::Unsupported(format!(
                "nvfp4_finish_2d_many: {ctas} CTAs exceed the grid"
            )));
        }
        if self.nvfp4_finish_version == 7
            && let Some(launches) = mixed_launches(&same)
        {
            for (name, ctas, mut words) in launches {
                // SAFETY: `words` is exactly the kernel's `Finish2dMixedParamsT` (1 + 1.5·cap +
                // 6·cap u64 words: FINISH2D_MIXED_MAX = 128, or FINISH2D_MIXED_SMALL = 32 for
                // `_32`; see `mixed_launches`; `launch_words` checks the size against the
                // PTX). Each of its rows holds
                // the addresses of one matrix's views, validated by the caller with the lengths
                // `nvfp4x_finish_2d` needs, and its amax word (written by `u32_max_many` above, in
                // stream order); rows % 32 == 0 and cols % 8 == 0 (both below 2^32) and the 4-byte
                // loads and 16-byte stores aligned (checked above). The matrices' first blocks
                // ascend from 0 and CTA b (below `ctas`, the sum of their ceil(cols/512) ·
                // ceil(rows/512) blocks) writes the codes and scale bytes of one 512x512 block of
                // one matrix, each index checked against rows, cols, tr and tc. No output overlaps
                // another matrix's views (checked by the caller). The driver copies the
                // parameters.
                unsafe { self.launch_words(name, (ctas, 1, 1), (256, 1, 1), &mut words)? };
            }
            same.clear();
        }
        for (([rows, cols], [gx, gy, sx, gx5, gy5]), group) in &same {
            let (gx, gy, sx) = (*gx, *gy, *sx);
            for chunk in group.chunks(FINISH2D_SAME_MAX) {
                let mut words = vec![0u64; 4 + 6 * FINISH2D_SAME_MAX];
                words[..3].copy_from_slice(&[*rows, *cols, chunk.len() as u64]);
                for (k, row) in chunk.iter().enumerate() {
                    words[4 + 6 * k..][..6].copy_from_slice(row);
                }
                // Versions 4 and 5 write the codes and both scale copies in one launch; version
                // 3 the codes here and the scales in a second launch below.
                let n = chunk.len() as u32;
                let v5_ctas = u64::from(*gx5) * u64::from(*gy5) * u64::from(n);
                let (codes, grid) = match self.nvfp4_finish_version {
                    6 => ("nvfp4x_finish_2d_same_v5", (*gx5, *gy5, n)),
                    5 | 7 if v5_ctas >= FINISH2D_V5_MIN_CTAS => {
                        ("nvfp4x_finish_2d_same_v5", (*gx5, *gy5, n))
                    }
                    4 | 5 | 7 => ("nvfp4x_finish_2d_same_v4", (gx, gy, n)),
                    _ => ("nvfp4x_finish_2d_same", (gx, gy, n)),
                };
                // SAFETY: `words` is exactly `Finish2dSameParams` (4 + 64·6 words, the kernel's
                // FINISH2D_SAME_MAX = 64). Each of its `chunk.len()` rows holds the addresses of
                // one matrix's views of this launch's shape, validated by the caller with the
                // lengths `nvfp4x_finish_2d` needs, and its amax word (written by
                // `u32_max_many` above, in stream order); rows % 32 == 0 and cols % 8 == 0 and
                // the 4-byte loads and 16-byte stores aligned (checked above). CTA (bx, by, k)
                // writes the columnwise codes of the 256x256 tile (bx, by) of matrix k, or
                // with `_v5` of the 512x512 block (bx, by) (versions 4 and 5 also the scale
                // bytes of its 16x16 tiles, each index checked against rows, cols, tr and tc
                // per byte or per whole 16-byte chunk). No output overlaps another matrix's
                // views (checked by the caller). The driver copies the parameters.
                unsafe { self.launch_words(codes, grid, (256, 1, 1), &mut words)? };
                if self.nvfp4_finish_version != 3 {
                    continue;
                }
                // SAFETY: the same parameters as the launch above; each matrix's row scales
                // (rows·ceil(cols/16) bytes) and column scales (cols·rows/16) were validated
                // by the caller, its tiles (rows/16 · ceil(cols/16) f32) too, and its amax word
                // is written by `u32_max_many` before in stream order; every byte index the
                // kernel writes is below those lengths (checked per byte).
                unsafe {
                    self.launch_words(
                        "nvfp4x_scales_2d_same",
                        (sx, 1, chunk.len() as u32),
                        (256, 1, 1),
                        &mut words,
                    )?;
                }
            }
        }
        if defer {
            let n = items.len();
            return Ok(Some(Finished::Pending(PendingWords::new(amax, n))));
        }
        Ok(Some(Finished::Values(
            self.read_pending(PendingWords::new(amax, items.len()))?,
        )))
    }

    /// The amaxes of a deferred `nvfp4_finish_2d_many` (a copy to the host and a stream
    /// synchronization).
    pub(crate) fn read_pending(&mut self, words: PendingWords) -> Result<Vec<f32>> {
        let mut all = self.read_pending_many(vec![words])?;
        Ok(all.pop().unwrap_or_default())
    }

    /// The amaxes of several deferred `nvfp4_finish_2d_many` calls, in order: every copy
    /// queued into page-locked memory, then one stream synchronization for all of them (a
    /// copy into pageable memory waits for the stream each time).
    pub(crate) fn read_pending_many(&mut self, words: Vec<PendingWords>) -> Result<Vec<Vec<f32>>> {
        // Another device's words: its kernels are not ordered before this stream's copies
        // (and may be on another GPU).
        if words.iter().any(|w| !w.0.is_on(self.stream())) {
            return Err(crate::DeviceError::Unsupported(
                "read_amaxes: the amaxes are pending on another device".into(),
            ));
        }
        let lens: Vec<usize> = words.iter().map(|w| w.1).collect();
        let total: usize = lens.iter().sum();
        if total == 0 {
            return Ok(lens.iter().map(|_| Vec::new()).collect());
        }
        let host = self.partials_host(total.div_ceil(2))?.cast::<u32>();
        let mut at = 0;
        for (w, &len) in words.iter().zip(&lens) {
            // SAFETY: `host` holds at least `total` u32 (page-locked, 8-byte aligned; nothing
            // else uses it until this call returns, and every earlier user waited for its
            // copies); `[at, at + len)` lies within it and the ranges of the copies are
            // disjoint; the source is `len` words of a live scratch buffer, kept until after
            // the synchronization below; the copy is ordered after the kernels that wrote them.
            unsafe {
                let dst = std::slice::from_raw_parts_mut(host.add(at), len);
                cudarc::driver::result::memcpy_dtoh_async(dst, w.0.ptr, self.stream().cu_stream())
            }
            .map_err(super::cuda_err("copying the amaxes to the host"))?;
            at += len;
        }
        self.stream()
            .synchronize()
            .map_err(super::cuda_err("waiting for the amaxes"))?;
        drop(words);
        // SAFETY: the copies have completed (the stream was synchronized); the `total` words
        // are not written again until the next call.
        let all = unsafe { std::slice::from_raw_parts(host, total) };
        let mut out = Vec::with_capacity(lens.len());
        let mut at = 0;
        for len in lens {
            out.push(
                all[at..at + len]
                    .iter()
                    .map(|&w| f32::from_bits(w))
                    .collect(),
            );
            at += len;
        }
        Ok(out)
    }
}

/// What `nvfp4_finish_2d_many` gives back: the amaxes, or their words on the device.
pub(crate) enum Finished {
    Values(Vec<f32>),
    Pending(PendingWords),
}

/// Amax words on the device not yet read: the first `len` words of a scratch (one per matrix;
/// freed in stream order when dropped).
pub(crate) struct PendingWords(super::kernels::Scratch, usize);

impl PendingWords {
    /// The first `len` words of `scratch` (at most its length).
    pub(super) fn new(scratch: super::kernels::Scratch, len: usize) -> Self {
        let len = len.min(scratch.len());
        Self(scratch, len)
    }
}

impl std::fmt::Debug for PendingWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingWords")
    }
}

#[cfg(test)]
mod tests {
    use super::{FINISH2D_MIXED_MAX, FINISH2D_MIXED_SMALL, Finish2dSame, mixed_launches};

    /// `count` matrices of `[rows, cols]` whose six addresses are `tag`, `tag + 1`, ...
    fn shape(rows: u64, cols: u64, count: usize, tag: u64) -> Finish2dSame {
        let grids = super::same_shape_grids(rows as usize, cols as usize).expect("grids");
        let rows_of = (0..count as u64)
            .map(|k| std::array::from_fn(|i| tag + 100 * k + i as u64))
            .collect();
        (([rows, cols], grids), rows_of)
    }

    /// An item of a mixed launch: its first block, `[rows, cols]` and its six addresses.
    type MixedRow = (u32, [u32; 2], [u64; 6]);

    /// The words of `nvfp4x_finish_2d_mixed`'s `Finish2dMixedParams` as the kernel reads them
    /// (little-endian u32 halves): the item count, the padding, each item's first block, rows
    /// and cols, and its six addresses.
    fn unpack(words: &[u64], cap: usize) -> (u32, u32, Vec<MixedRow>) {
        let (dims_at, ptrs_at) = (1 + cap / 2, 1 + cap / 2 + cap);
        let half = |w: usize, k: usize| (words[w] >> (32 * (k % 2))) as u32;
        let items = half(0, 0);
        let rows = (0..items as usize)
            .map(|k| {
                (
                    half(1 + k / 2, k),
                    [words[dims_at + k] as u32, (words[dims_at + k] >> 32) as u32],
                    std::array::from_fn(|i| words[ptrs_at + 6 * k + i]),
                )
            })
            .collect();
        (items, half(0, 1), rows)
    }

    #[test]
    fn mixed_launches_pack_the_kernels_parameters() {
        // 134 one-block matrices, 30 of three blocks (1040 columns: a partial block), 2 of six
        // (800 rows: a partial block row): 236 blocks, two launches (128 matrices a launch).
        let same = [
            shape(32, 64, 134, 1000),
            shape(96, 1040, 30, 9000),
            shape(800, 1312, 2, 20000),
        ];
        let launches = mixed_launches(&same).expect("172 blocks take the mixed kernel");
        assert_eq!(launches.len(), 2);
        assert!(
            launches
                .iter()
                .all(|(n, _, w)| *n == "nvfp4x_finish_2d_mixed" && w.len() == 7688 / 8)
        );
        // The kernel's struct, as its PTX declares it.
        assert_eq!(
            crate::ptx::struct_param_bytes("nvfp4x_finish_2d_mixed"),
            Some(7688)
        );
        let (items, pad, rows) = unpack(&launches[0].2, FINISH2D_MIXED_MAX);
        assert_eq!((items, pad, launches[0].1), (128, 0, 128));
        for (k, (first, dims, ptrs)) in rows.iter().enumerate() {
            assert_eq!((*first, *dims), (k as u32, [32, 64]));
            assert_eq!(ptrs[0], 1000 + 100 * k as u64);
            assert_eq!(ptrs[5], 1005 + 100 * k as u64);
        }
        let (items, pad, rows) = unpack(&launches[1].2, FINISH2D_MIXED_MAX);
        assert_eq!((items, pad, launches[1].1), (38, 0, 6 + 30 * 3 + 2 * 6));
        let firsts: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let want: Vec<u32> = (0..6)
            .chain((0..30).map(|k| 6 + 3 * k))
            .chain([96, 102])
            .collect();
        assert_eq!(firsts, want);
        assert_eq!(rows[6].1, [96, 1040]);
        assert_eq!(rows[6].2[0], 9000);
        assert_eq!(rows[37].1, [800, 1312]);
        assert_eq!(rows[37].2[3], 20103);
        // Unused rows stay zero (the kernel never reads them).
        assert!(
            launches[1].2[1 + 64 + 128 + 6 * 38..]
                .iter()
                .all(|&w| w == 0)
        );
    }

    #[test]
    fn mixed_launches_of_a_bucket_group_take_the_small_table() {
        // A bucket group of Llama-3.2-1B (four layers: 28 matrices, 928 blocks): one launch of
        // the 32-matrix kernel, whose struct its PTX declares 1928 bytes.
        let layer = [(2048, 2048), (512, 2048), (512, 2048), (2048, 2048)];
        let mut same: Vec<Finish2dSame> = layer
            .iter()
            .enumerate()
            .map(|(k, &(r, c))| shape(r, c, 4, 1000 * k as u64))
            .collect();
        same.push(shape(8192, 2048, 8, 9000));
        same.push(shape(2048, 8192, 4, 20000));
        let launches = mixed_launches(&same).expect("enough blocks");
        assert_eq!(launches.len(), 1);
        let (name, ctas, words) = &launches[0];
        assert_eq!(*name, "nvfp4x_finish_2d_mixed_32");
        assert_eq!(
            crate::ptx::struct_param_bytes("nvfp4x_finish_2d_mixed_32"),
            Some(8 * words.len())
        );
        assert_eq!(
            8 * words.len(),
            8 + 12 * FINISH2D_MIXED_SMALL + 48 * FINISH2D_MIXED_SMALL
        );
        let (items, _, rows) = unpack(words, FINISH2D_MIXED_SMALL);
        assert_eq!(items, 28);
        let blocks = 4 * 16 + 4 * 4 + 4 * 4 + 4 * 16 + 8 * 64 + 4 * 64;
        assert_eq!(*ctas, blocks);
        assert_eq!(rows[16].0, 4 * 16 + 4 * 4 + 4 * 4 + 4 * 16);
        assert_eq!(rows[16].1, [8192, 2048]);
        assert_eq!(rows[27].2[0], 20300);
    }

    #[test]
    fn mixed_launches_leave_small_calls_and_wide_shapes_to_version_5() {
        // 127 blocks in all: too few to fill the GPU.
        assert!(mixed_launches(&[shape(32, 64, 127, 0)]).is_none());
        assert!(mixed_launches(&[shape(32, 64, 128, 0)]).is_some());
        // A dimension past 32 bits (the kernel's u32 dims).
        let mut wide = shape(32, 64, 200, 0);
        wide.0.0 = [32, 1 << 32];
        assert!(mixed_launches(&[wide]).is_none());
        assert!(mixed_launches(&[]).is_none());
    }
}
