//! Launches of the quantization kernels of `crates/lowbit-kernels/mxfp8.cu` and `crates/lowbit-kernels/ops.cu`: MXFP8 (bf16 →
//! E4M3, 1D) and NVFP4 (1D, round to nearest) quantization, dequantization of one copy, and the
//! sharded 2D ranges (tile-amax folds, codes of a range, 2D MXFP8 scales).

use lowbit_formats::{Copies, Fp8Kind, Mxfp8Config, NanPolicy, Nvfp4Config};

use super::{blocks, dt, nvfp4_rows_vec};
use crate::cuda::prepared;
use crate::cuda::{Arg, CudaDevice};
use crate::ops::{Dequant, Scales2dItem};
use crate::{DType, Mxfp8Views, Nvfp4Views, Result, View};

/// A quantization's arguments as the op received them (validated by it): the row-major
/// `[rows, cols]` source, the configuration and the destination views.
pub(crate) struct Quantize<'a, C, V> {
    pub(crate) src: View,
    pub(crate) shape: [usize; 2],
    pub(crate) cfg: &'a C,
    pub(crate) out: &'a V,
}

/// The arguments of an MXFP8 quantization.
pub(crate) type Mxfp8Quantize<'a> = Quantize<'a, Mxfp8Config, Mxfp8Views>;

/// The arguments of an NVFP4 quantization.
pub(crate) type Nvfp4Quantize<'a> = Quantize<'a, Nvfp4Config, Nvfp4Views>;

/// Whether a quantization is for the kernels of `crates/lowbit-kernels/mxfp8.cu` at all: bf16 input, E4M3, 1D
/// blocks, TE NaN policy, a non-empty matrix (the copies and the grid are checked by each path).
fn mxfp8_kernels_take(q: &Mxfp8Quantize<'_>) -> bool {
    let cfg = q.cfg;
    q.src.dtype() == DType::Bf16
        && cfg.kind == Fp8Kind::E4M3
        && !cfg.two_d
        && cfg.nan_policy == NanPolicy::Te
        && q.shape[0] != 0
        && q.shape[1] != 0
}

/// Whether the both-copies kernels v4 and v5 may take their vector path (16-byte loads of `x`,
/// 8-byte stores of both data copies and the column scales): cols % 8 == 0 and aligned views.
fn both_vec(cols: usize, [x, rd, cd, cs]: [u64; 4]) -> bool {
    cols.is_multiple_of(8)
        && x.is_multiple_of(16)
        && [rd, cd, cs].iter().all(|p| p.is_multiple_of(8))
}

/// Matrices per launch of `mxfp8_both_e4m3_bf16_v4_many`: its parameter struct's capacity
/// (`MXFP8_MANY_MAX` in `crates/lowbit-kernels/mxfp8.cu`; 5128 bytes of parameters).
const MXFP8_MANY_MAX: usize = 64;

/// Matrices per launch of `mxfp8_both_e4m3_bf16_v4_same`: its parameter struct's capacity
/// (`MXFP8_SAME_MAX` in `crates/lowbit-kernels/mxfp8.cu`; 2592 bytes of parameters).
const MXFP8_SAME_MAX: usize = 64;

/// Matrices of one (rows, cols, `vec`) for `mxfp8_both_e4m3_bf16_v4_same`: the key and each
/// matrix's item index and table row.
type SameShape = ([u64; 3], Vec<(usize, [u64; 9])>);

/// Matrices per launch of `mxfp8_scales_2d_many`: its parameter struct's capacity
/// (`SCALES2D_MAX` in `crates/lowbit-kernels/ops.cu`; 8208 bytes of parameters, so that Llama-3.2-1B's 112
/// matrices take one launch).
const SCALES2D_MAX: usize = 128;

/// The capacity of `mxfp8_scales_2d_many_32`, which takes launches of at most this many
/// matrices (`SCALES2D_SMALL` in `crates/lowbit-kernels/ops.cu`; 2064 bytes of parameters: past 4 KB a launch
/// costs the host ~3 us more, as much as the kernel of a bucket group's 28 matrices).
const SCALES2D_SMALL: usize = 32;

/// Tiles per CTA item of `mxfp8_scales_2d_many` (`SCALES2D_CODES` in `crates/lowbit-kernels/ops.cu`).
const SCALES2D_CODES: usize = 256;

/// Threads per CTA of `mxfp8_scales_2d_many` (`SCALES2D_THREADS` in `crates/lowbit-kernels/ops.cu`, its launch
/// bound).
const SCALES2D_THREADS: u32 = 256;

/// The words of a launch table passed as kernel parameters ([`CudaDevice::launch_words`]):
/// `head` leading words (word 0 the item count, the others the caller's), then `max` first
/// indices (item k's: the sum of the counts of the items before it), then `max` rows of `W`
/// words, zero-padded to that fixed size. At most `max` items (the callers pass chunks of
/// that many). Returns the words and the total count.
fn param_table<const W: usize>(
    head: usize,
    max: usize,
    items: impl Iterator<Item = ([u64; W], u64)>,
) -> (Vec<u64>, u64) {
    let mut words = vec![0u64; head + max * (1 + W)];
    let mut total = 0u64;
    let mut count = 0u64;
    for (k, (row, n)) in items.enumerate() {
        words[head + k] = total;
        words[head + max + W * k..][..W].copy_from_slice(&row);
        total += n;
        count += 1;
    }
    words[0] = count;
    (words, total)
}

/// `mxfp8_scales_2d_many`'s `Scales2dParams` (`capacity` [`SCALES2D_MAX`]; or
/// `mxfp8_scales_2d_many_32`'s, [`SCALES2D_SMALL`]) for at most `capacity` matrices (each its
/// six words and its item count) and the launch's grid: [`param_table`]'s words (the matrix
/// count, the item count, each matrix's first item, the matrices' rows), then each slot's first
/// matrix. A slot is a run of consecutive matrices whose items together fit the grid's width
/// (the most items of one matrix), packed greedily in order: a grid row per slot, not per
/// matrix, so small matrices share a row instead of leaving most of theirs empty.
fn scales2d_table(chunk: &[([u64; 6], u64)], capacity: usize) -> (Vec<u64>, (u32, u32, u32)) {
    debug_assert!(chunk.len() <= capacity);
    let width = chunk.iter().map(|c| c.1).max().unwrap_or(0);
    let (mut words, units) = param_table(2, capacity, chunk.iter().copied());
    words[1] = units;
    let mut slot = vec![0u64; capacity];
    let (mut slots, mut fill) = (0usize, 0u64);
    for (k, &(_, n)) in chunk.iter().enumerate() {
        if k == 0 || fill + n > width {
            slot[slots] = k as u64;
            slots += 1;
            fill = 0;
        }
        fill += n;
    }
    words.extend(slot);
    // The width is one matrix's item count (below 2^31, checked where the items were made)
    // and the slots at most SCALES2D_MAX.
    let grid = (
        u32::try_from(width).unwrap_or(u32::MAX),
        u32::try_from(slots).unwrap_or(u32::MAX),
        1,
    );
    (words, grid)
}

/// The launches of `mxfp8_scales_2d_many` for `taken` (each matrix's six words and its item
/// count): per [`SCALES2D_MAX`] matrices the kernel (`_32` where the chunk fits
/// [`SCALES2D_SMALL`]), its [`scales2d_table`] and grid. Fresh calls launch them; prepared
/// calls make graphs of them.
fn scales2d_launches(
    taken: &[([u64; 6], u64)],
) -> impl Iterator<Item = (&'static str, Vec<u64>, (u32, u32, u32))> + '_ {
    taken.chunks(SCALES2D_MAX).map(|chunk| {
        let (name, capacity) = if chunk.len() <= SCALES2D_SMALL {
            ("mxfp8_scales_2d_many_32", SCALES2D_SMALL)
        } else {
            ("mxfp8_scales_2d_many", SCALES2D_MAX)
        };
        let (words, grid) = scales2d_table(chunk, capacity);
        (name, words, grid)
    })
}

/// NVFP4's `1 / (6 · 448)`, rounded to f32 (the dequantization kernels' factor).
pub(in crate::cuda) const NVFP4_FACTOR_INV: f32 = (1.0f64 / (6.0 * 448.0)) as f32;

impl CudaDevice {
    /// MXFP8 with the kernels of `crates/lowbit-kernels/mxfp8.cu` when the configuration is theirs (bf16 input,
    /// E4M3, 1D blocks, TE NaN policy, rowwise or both copies, the vector paths' alignment);
    /// `Ok(false)` when it is not, for the caller's host fallback. Views are validated first.
    pub(crate) fn quantize_mxfp8(&mut self, q: &Mxfp8Quantize<'_>) -> Result<bool> {
        let (src, [rows, cols], cfg, out) = (q.src, q.shape, q.cfg, q.out);
        if !mxfp8_kernels_take(q) {
            return Ok(false);
        }
        let x = self.device_ptr(src)?;
        let (r, c) = (rows as u64, cols as u64);
        match (cfg.copies, out.rowwise, out.columnwise) {
            (Copies::Rowwise, Some((d, s)), None) => {
                let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
                let args = args![x, d, s, r, c];
                let rows_grid = u32::try_from(rows.min(65535)).unwrap_or(65535);
                let (Some(g16), Some(g8), Some(g1)) = (
                    blocks(cols / 16, 128),
                    blocks(cols / 8, 128),
                    blocks(rows * cols.div_ceil(32) * 32, 256),
                ) else {
                    return Ok(false);
                };
                let aligned = cols.is_multiple_of(32) && x.is_multiple_of(16);
                let (name, grid, threads) = if aligned && d.is_multiple_of(16) {
                    ("mxfp8_rowwise_e4m3_bf16_x16", (g16, rows_grid, 1), 128)
                } else if aligned && d.is_multiple_of(8) {
                    ("mxfp8_rowwise_e4m3_bf16_x8", (g8, rows_grid, 1), 128)
                } else {
                    ("mxfp8_rowwise_e4m3_bf16", (g1, 1, 1), 256)
                };
                // SAFETY: the views were validated by the caller's `check_views` (live, in
                // bounds: rows·cols bf16 in, rows·cols data bytes and rows·cols/32 scales out);
                // the vector accesses of the x16 (16-byte stores) and x8 (8-byte stores)
                // kernels are aligned (checked here), the third kernel makes only element-sized
                // accesses.
                unsafe { self.launch(name, grid, (threads, 1, 1), &args)? };
                Ok(true)
            }
            (Copies::Both, Some((rd, rs)), Some((cd, cs))) => {
                let (rd, rs) = (self.device_ptr(rd)?, self.device_ptr(rs)?);
                let (cd, cs) = (self.device_ptr(cd)?, self.device_ptr(cs)?);
                if self.mxfp8_both_version != 1 {
                    let vec = both_vec(cols, [x, rd, cd, cs]);
                    // v5 owns 64 rows per CTA, the others 32.
                    let tile_rows = if self.mxfp8_both_version == 5 { 64 } else { 32 };
                    let (Some(gx), Ok(gy @ 1..=65535)) =
                        (blocks(cols, 256), u32::try_from(rows.div_ceil(tile_rows)))
                    else {
                        return Ok(false);
                    };
                    let name = if self.mxfp8_both_version == 5 {
                        "mxfp8_both_e4m3_bf16_v5"
                    } else {
                        "mxfp8_both_e4m3_bf16_v4"
                    };
                    let args = args![x, rd, rs, cd, cs, r, c, u32::from(vec)];
                    // SAFETY: views validated by the caller (live, in bounds, disjoint); the
                    // vector accesses only with `vec`, whose alignment is checked here.
                    unsafe { self.launch(name, (gx, gy, 1), (256, 1, 1), &args)? };
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
                let args = args![x, rd, rs, cd, cs, r, c];
                // SAFETY: views validated by the caller (live, in bounds, disjoint), vector
                // accesses aligned (checked above), grid within limits.
                unsafe { self.launch("mxfp8_both_e4m3_bf16", grid, (256, 1, 1), &args)? };
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    /// The row of the `mxfp8_both_e4m3_bf16_v4_many` table for one matrix and its CTA count,
    /// when [`CudaDevice::quantize_mxfp8`] would quantize it with version 4 of the both-copies
    /// kernel (the same conditions: a configuration of `mxfp8.cu`, both copies, version 4
    /// selected, the single kernel's grid limits), else `None`. Row: x, row data, row scales,
    /// column data, column scales, rows, cols, tiles across (`ceil(cols / 256)`), `vec`.
    fn mxfp8_both_v4_row(&self, q: &Mxfp8Quantize<'_>) -> Result<Option<([u64; 9], u64)>> {
        let (src, [rows, cols], cfg, out) = (q.src, q.shape, q.cfg, q.out);
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return Ok(None);
        };
        if self.mxfp8_both_version != 4 || cfg.copies != Copies::Both || !mxfp8_kernels_take(q) {
            return Ok(None);
        }
        let (Some(gx), Ok(gy @ 1..=65535)) = (blocks(cols, 256), u32::try_from(rows.div_ceil(32)))
        else {
            return Ok(None);
        };
        let x = self.device_ptr(src)?;
        let (rd, rs) = (self.device_ptr(rd)?, self.device_ptr(rs)?);
        let (cd, cs) = (self.device_ptr(cd)?, self.device_ptr(cs)?);
        let vec = u64::from(both_vec(cols, [x, rd, cd, cs]));
        let (r, c, gx64) = (rows as u64, cols as u64, u64::from(gx));
        Ok(Some((
            [x, rd, rs, cd, cs, r, c, gx64, vec],
            gx64 * u64::from(gy),
        )))
    }

    /// [`crate::Device::quantize_mxfp8_many`]'s kernel path: every matrix that
    /// [`CudaDevice::quantize_mxfp8`] would quantize with version 4 of the both-copies kernel
    /// goes into a launch per shape of `mxfp8_both_e4m3_bf16_v4_same` or into one launch of
    /// `mxfp8_both_e4m3_bf16_v4_many` (the `mxfp8_many` variant; 64 matrices at most per
    /// launch), the table in the kernel's parameters (each CTA runs the single kernel's tile
    /// body on its matrix, so the bytes are the single kernel's). Returns the indices of
    /// the other items, in order, for the caller's one-by-one path — all of them when fewer
    /// than two qualify (one matrix is the single kernel's). A launch whose CTAs would exceed
    /// the grid leaves its matrices to that path too. The caller has validated every item as
    /// `quantize_mxfp8` does and checked that no item's output overlaps another item's views.
    pub(crate) fn quantize_mxfp8_many(
        &mut self,
        items: &[Mxfp8Quantize<'_>],
    ) -> Result<Vec<usize>> {
        let mut rows = Vec::new();
        let mut rest = Vec::new();
        for (i, q) in items.iter().enumerate() {
            match self.mxfp8_both_v4_row(q)? {
                Some(row) => rows.push((i, row)),
                None => rest.push(i),
            }
        }
        if rows.len() < 2 {
            return Ok((0..items.len()).collect());
        }
        let same = match self.mxfp8_many_version {
            1 => false,
            2 => true,
            // Automatic: one launch per shape where the launches average at least four
            // matrices (1B's 112 matrices in 4 launches: 0.82-0.89x of a copy against
            // 0.68-0.87x in one; one layer's 7 in 4: 0.59-0.70x against 0.61-0.79x).
            _ => {
                let mut shapes: Vec<[u64; 3]> =
                    rows.iter().map(|(_, (r, _))| [r[5], r[6], r[8]]).collect();
                shapes.sort_unstable();
                shapes.dedup();
                4 * shapes.len() <= rows.len()
            }
        };
        if same {
            self.launch_mxfp8_same(&rows, &mut rest)?;
        } else {
            self.launch_mxfp8_many(&rows, &mut rest)?;
        }
        rest.sort_unstable();
        Ok(rest)
    }

    /// Version 1 of [`CudaDevice::quantize_mxfp8_many`]'s launches: `rows` (item index, table
    /// row and CTA count) in launches of `mxfp8_both_e4m3_bf16_v4_many`, [`MXFP8_MANY_MAX`]
    /// matrices each; the items of a launch whose CTAs would exceed the grid go to `rest`.
    fn launch_mxfp8_many(
        &mut self,
        rows: &[(usize, ([u64; 9], u64))],
        rest: &mut Vec<usize>,
    ) -> Result<()> {
        for chunk in rows.chunks(MXFP8_MANY_MAX) {
            // The kernel's `Mxfp8ManyParams`: the count, the first CTA of each matrix, then
            // their rows.
            let (mut words, ctas) = param_table(1, MXFP8_MANY_MAX, chunk.iter().map(|(_, r)| *r));
            let Some(grid) = usize::try_from(ctas).ok().and_then(|n| blocks(n, 1)) else {
                rest.extend(chunk.iter().map(|(i, _)| *i));
                continue;
            };
            // SAFETY: `words` is exactly `Mxfp8ManyParams` (1 + 64 + 64·9 words, the
            // kernel's MXFP8_MANY_MAX = 64). Each of its `chunk.len()` rows holds the addresses
            // of one item's views, which the caller validated as `quantize_mxfp8` does (live,
            // in bounds: rows·cols bf16 in, rows·cols data bytes and rows·ceil(cols/32) resp.
            // ceil(rows/32)·cols scale bytes out, disjoint), with its shape, tiles across and
            // `vec` computed as the single v4 launch computes them (the 16-byte loads and
            // 8-byte stores only with `vec`, whose alignment `both_vec` checked). CTA b runs
            // the tile (bx, by) of the matrix whose CTAs [first, first + gx·gy) hold it, a tile
            // the single kernel's grid (gx, gy) has, so every access is one that launch makes.
            // No item's output overlaps another item's source or outputs (checked by the
            // caller), so the `__restrict__` promises hold across matrices too. The driver
            // copies the parameters at launch.
            unsafe {
                self.launch_words(
                    "mxfp8_both_e4m3_bf16_v4_many",
                    (grid, 1, 1),
                    (256, 1, 1),
                    &mut words,
                )?;
            }
        }
        Ok(())
    }

    /// Version 2 of [`CudaDevice::quantize_mxfp8_many`]'s launches: the matrices of one shape
    /// and `vec` (in item order) in launches of `mxfp8_both_e4m3_bf16_v4_same`,
    /// [`MXFP8_SAME_MAX`] matrices each, grid (tiles across, tile rows, matrices) as the single
    /// kernel's grid per matrix.
    fn launch_mxfp8_same(
        &mut self,
        rows: &[(usize, ([u64; 9], u64))],
        rest: &mut Vec<usize>,
    ) -> Result<()> {
        // Groups of one (rows, cols, vec), in order of first appearance.
        let mut groups: Vec<SameShape> = Vec::new();
        for &(i, (row, _)) in rows {
            let key = [row[5], row[6], row[8]];
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push((i, row)),
                None => groups.push((key, vec![(i, row)])),
            }
        }
        for (key, group) in &groups {
            let [r, c, vec] = *key;
            // Every row of the group has the same tiles across (`row[7]`); the tile rows are
            // at most 65535 (`mxfp8_both_v4_row`), so neither conversion fails in practice.
            let (Ok(gx), Ok(gy)) = (u32::try_from(group[0].1[7]), u32::try_from(r.div_ceil(32)))
            else {
                rest.extend(group.iter().map(|(i, _)| *i));
                continue;
            };
            for chunk in group.chunks(MXFP8_SAME_MAX) {
                let mut words = vec![0u64; 4 + 5 * MXFP8_SAME_MAX];
                words[..4].copy_from_slice(&[r, c, vec, chunk.len() as u64]);
                for (k, (_, row)) in chunk.iter().enumerate() {
                    words[4 + 5 * k..][..5].copy_from_slice(&row[..5]);
                }
                let z = chunk.len() as u32;
                // SAFETY: `words` is exactly `Mxfp8SameParams` (4 + 64·5 words, the kernel's
                // MXFP8_SAME_MAX = 64). Each of its `chunk.len()` rows holds the addresses of
                // one item's views, which the caller validated as `quantize_mxfp8` does (live,
                // in bounds, disjoint), and every item of the launch has the launch's rows,
                // cols and `vec` (the single v4 launch's values: 16-byte loads and 8-byte
                // stores only with `vec`, whose alignment `both_vec` checked). CTA (bx, by, k)
                // runs the tile (bx, by) of matrix k, a tile of the single kernel's grid
                // (gx, gy), so every access is one that launch makes. No item's output overlaps
                // another item's source or outputs (checked by the caller). The driver copies
                // the parameters at launch.
                unsafe {
                    self.launch_words(
                        "mxfp8_both_e4m3_bf16_v4_same",
                        (gx, gy, z),
                        (256, 1, 1),
                        &mut words,
                    )?;
                }
            }
        }
        Ok(())
    }

    /// NVFP4 with the kernels when the configuration is theirs (1D blocks, round to nearest,
    /// no Hadamard transform, TE NaN policy; a columnwise copy needs `rows % 16 == 0`), else
    /// `Ok(None)` for the host fallback. The launches are queued, nothing waits: the global
    /// amax (both copies share it) stays on the device, one pending word.
    pub(crate) fn quantize_nvfp4(
        &mut self,
        q: &Nvfp4Quantize<'_>,
    ) -> Result<Option<crate::cuda::PendingWords>> {
        let (src, [rows, cols], cfg, out) = (q.src, q.shape, q.cfg, q.out);
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
        // One zeroed scratch for both: the amax word first, the parameters from word 4 (16
        // bytes in). Versions 3 to 5 also build the E2M1 threshold table (8 words per scale
        // byte from parameter word 260, which the 16-byte loads of nvfp4_quantize_rows_v3,
        // nvfp4_quantize_cols_v4 and nvfp4_quantize_both_v5 need 16-byte aligned); version 9
        // adds the class table (8 x 8 words) and its lower bound after it.
        let params_words = match self.nvfp4_version {
            9.. => 260 + 8 * 256 + 8 * 8 + 1,
            3.. => 260 + 8 * 256,
            _ => 257,
        };
        let scratch = self.scratch(4 + params_words)?;
        let amax = &scratch;
        self.launch_max_abs(x, src.dtype(), src.len(), amax.ptr)?;
        let tp = scratch.ptr + 16;
        let thresholds = self.nvfp4_version >= 3 && tp.is_multiple_of(16);
        // Version 9 builds the class table in the same launch (one block of 1024 threads).
        let (name, grid, block) = match (thresholds, self.nvfp4_version) {
            (true, 9..) => ("nvfp4_params_v9", (1, 1, 1), (1024, 1, 1)),
            (true, _) => ("nvfp4_params_v3", (8, 1, 1), (256, 1, 1)),
            _ => ("nvfp4_params", (1, 1, 1), (256, 1, 1)),
        };
        // SAFETY: `amax` holds one word, then `tp` (the same scratch, 16 bytes in, so the two
        // do not overlap) 257 (260 + 2048 for the table of the v3 kernel,
        // whose 8 x 256 threads write words 0..=256 and 260..2308; 2373 for the v9 kernel,
        // which also writes the class table, words 2308..=2372), the tables 512 floats (E4M3
        // first).
        unsafe {
            self.launch(name, grid, block, &args![amax.ptr, self.tables_ptr, tp])?;
        }
        let (r, c) = (rows as u64, cols as u64);
        // Version 5: both copies from one read of X (nvfp4_quantize_both_v5; version 6
        // nvfp4_quantize_both_v6) where both v3's rowwise and v4's columnwise conditions hold;
        // else the separate kernels below.
        let fused = thresholds && self.nvfp4_version >= 5 && self.nvfp4_both_fused(q, x, tp)?;
        let (rowwise, columnwise) = if fused {
            (None, None)
        } else {
            (out.rowwise, out.columnwise)
        };
        if let Some((d, s)) = rowwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let vec = nvfp4_rows_vec(src.dtype(), cols, x, d);
            let args = args![x, xd, d, s, tp, r, c, u32::from(vec)];
            let gy = u32::try_from(rows.min(65535)).unwrap_or(65535);
            let v2 = self.nvfp4_version >= 2
                && vec
                && cols.is_multiple_of(32)
                && d.is_multiple_of(16)
                && s.is_multiple_of(2);
            match blocks(cols / 32, 128) {
                Some(gx2) if v2 => {
                    let name = match (thresholds, self.nvfp4_version) {
                        (true, 7..) => "nvfp4_quantize_rows_v4",
                        (true, _) => "nvfp4_quantize_rows_v3",
                        _ => "nvfp4_quantize_rows_v2",
                    };
                    let args = args![x, d, s, tp, r, c];
                    // SAFETY: as below, with 16-byte loads and code stores and 2-byte scale
                    // stores, whose alignment is checked above (row pitches cols·2, cols/2 and
                    // cols/16 keep it: cols % 32 == 0); the v3 and v4 kernels (the same
                    // accesses; v4 forms the codes differently) read the threshold table
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
        if let Some((d, s)) = columnwise {
            let (d, s) = (self.device_ptr(d)?, self.device_ptr(s)?);
            let nbr = rows / 16;
            let per = [4, 2, 1]
                .into_iter()
                .find(|p| nbr.is_multiple_of(*p))
                .unwrap_or(1);
            // Version 4: the shared-memory transpose (bf16, cols % 8 == 0, 16-byte aligned
            // input rows, 8-byte aligned codes, the threshold table of nvfp4_params_v3).
            let v4 = self.nvfp4_version >= 4
                && thresholds
                && src.dtype() == DType::Bf16
                && cols.is_multiple_of(8)
                && x.is_multiple_of(16)
                && d.is_multiple_of(8);
            match blocks(cols, 64) {
                Some(gx4) if v4 => {
                    let (flags, gy, kernel) = self.nvfp4_cols_launch(
                        rows,
                        d,
                        s,
                        &[
                            "nvfp4_quantize_cols_v4",
                            "nvfp4_quantize_cols_v6",
                            "nvfp4_quantize_cols_v7",
                        ],
                    );
                    let args = args![x, d, s, tp, r, c, flags];
                    // SAFETY: views validated by the caller (rows·cols bf16 in; cols·rows/2
                    // data and cols·rows/16 scale bytes out). The kernel copies 16-byte chunks
                    // of whole input rows (x 16-byte aligned and cols % 8 == 0, checked above,
                    // so every chunk is aligned and lies wholly inside or past a row), stores
                    // codes in 8-byte units (d 8-byte aligned, pitch rows/2 a multiple of 8),
                    // 16-byte units only with flag 1 (rows % 32 == 0, d 16-byte aligned) and
                    // scales as 4-byte words only with flag 2 (rows % 64 == 0, s 4-byte
                    // aligned; version 6 stores each column's scales of a tile pair as 16-byte
                    // units where they are whole and 16-byte aligned, checked per unit, else
                    // bytes), touching nothing past row `rows` or column `cols`; it reads the
                    // threshold table that nvfp4_params_v3 wrote into `tp` (16-byte aligned).
                    unsafe { self.launch(kernel, (gx4, gy, 1), (128, 1, 1), &args)? };
                }
                _ => {
                    let vec = u32::from(d.is_multiple_of(8));
                    let args = args![x, xd, d, s, tp, r, c, per as u32, vec];
                    // SAFETY: as above, with cols·rows/2 data and cols·rows/16 scale bytes;
                    // `per` divides the row-block count; 8-byte stores only when `d` is 8-byte
                    // aligned (the row pitch rows/2 is a multiple of 8).
                    unsafe { self.launch_n("nvfp4_quantize_cols", nbr / per * cols, &args)? };
                }
            }
        }
        Ok(Some(crate::cuda::PendingWords::new(scratch, 1)))
    }

    /// What a kernel with the columnwise part (`nvfp4c_cols_part`: `nvfp4_quantize_cols_*`,
    /// `nvfp4_quantize_both_*`) is launched with, for `rows` and column data / scales at `d` /
    /// `s`: its store flags (1: 16-byte code units, rows % 32 == 0 and `d` 16-byte aligned; 2:
    /// 4-byte scale words, rows % 64 == 0 and `s` 4-byte aligned), the grid's rows of CTAs (a
    /// 256-row tile each, or from version 6 a pair of them; strided past 65535) and which of
    /// `kernels` runs: the single-tile one before version 6, then one per version from 6 (the
    /// tile-pair kernels; a version past the list takes its last, as columnwise-only does from
    /// version 7).
    fn nvfp4_cols_launch(
        &self,
        rows: usize,
        d: u64,
        s: u64,
        kernels: &[&'static str],
    ) -> (u32, u32, &'static str) {
        let flags = u32::from(rows.is_multiple_of(32) && d.is_multiple_of(16))
            | (u32::from(rows.is_multiple_of(64) && s.is_multiple_of(4)) << 1);
        // Version 5 (or below) takes kernels[0], 6 kernels[1], and so on; a version past the
        // list takes its last kernel.
        let tier = (self.nvfp4_version.max(5) - 5) as usize;
        let tile_rows = if tier > 0 { 512 } else { 256 };
        let gy = u32::try_from(rows.div_ceil(tile_rows).min(65535)).unwrap_or(65535);
        (flags, gy, kernels[tier.min(kernels.len() - 1)])
    }

    /// Both NVFP4 copies with `nvfp4_quantize_both_v5` (version 6: `_v6`, ..., 9: `_v9`) when its
    /// conditions hold (both copies requested; bf16; cols % 32 == 0; x 16-byte, rowwise data
    /// 16-byte, rowwise scales 2-byte and columnwise data 8-byte aligned; the grid within
    /// limits): launches it and returns `true`, else launches nothing and returns `false`. `x` is the source's address, `tp` the
    /// parameters that `nvfp4_params_v3` wrote (16-byte aligned: the caller checked it), and
    /// the caller validated the views (and `rows % 16 == 0`, as for any columnwise copy).
    fn nvfp4_both_fused(&mut self, q: &Nvfp4Quantize<'_>, x: u64, tp: u64) -> Result<bool> {
        let (src, [rows, cols], out) = (q.src, q.shape, q.out);
        let (Some((rd, rs)), Some((cd, cs))) = (out.rowwise, out.columnwise) else {
            return Ok(false);
        };
        let (rd, rs) = (self.device_ptr(rd)?, self.device_ptr(rs)?);
        let (cd, cs) = (self.device_ptr(cd)?, self.device_ptr(cs)?);
        // v3's rowwise conditions (v2's `vec` and the 16-byte code and 2-byte scale stores) and
        // v4's columnwise ones (16-byte loads of x, 8-byte code stores).
        let ok = src.dtype() == DType::Bf16
            && cols.is_multiple_of(32)
            && x.is_multiple_of(16)
            && rd.is_multiple_of(16)
            && rs.is_multiple_of(2)
            && cd.is_multiple_of(8);
        let (true, Some(gx)) = (ok, blocks(cols, 64)) else {
            return Ok(false);
        };
        let (r, c) = (rows as u64, cols as u64);
        let (flags, gy, kernel) = self.nvfp4_cols_launch(
            rows,
            cd,
            cs,
            // Versions 8 and 9 launch as 7 does (the same accesses); 9 reads the class table
            // of thresholds that nvfp4_params_v9 wrote (the caller launched it for version 9).
            &[
                "nvfp4_quantize_both_v5",
                "nvfp4_quantize_both_v6",
                "nvfp4_quantize_both_v7",
                "nvfp4_quantize_both_v8",
                "nvfp4_quantize_both_v9",
            ],
        );
        let args = args![x, rd, rs, cd, cs, tp, r, c, flags];
        // SAFETY: views validated by the caller (rows·cols bf16 in; rows·cols/2 row data and
        // rows·cols/16 row scale bytes, cols·rows/2 column data and cols·rows/16 column scale
        // bytes out; rows % 16 == 0). Reads: the 16-byte `cp.async` chunks of v4 (x 16-byte
        // aligned and cols % 8 == 0, checked above: each chunk is aligned and lies wholly
        // inside or past a row; only chunks with row < rows and column < cols are copied) and
        // the threshold table that nvfp4_params_v3 wrote into `tp` (16-byte aligned, checked by
        // the caller), at scale bytes < 256. Column stores exactly as v4's (8-byte units, `cd`
        // 8-byte aligned with pitch rows/2 a multiple of 8; 16-byte units only with flag 1:
        // rows % 32 == 0 and `cd` 16-byte aligned; 4-byte scale words only with flag 2:
        // rows % 64 == 0 and `cs` 4-byte aligned; version 6: 16-byte units of a column's tile
        // pair where whole and 16-byte aligned, checked per unit, else bytes; nothing past row
        // `rows` or column `cols`).
        // Row stores exactly as v3's: for a row r < rows and a block pair starting at column
        // p < cols (p % 32 == 0, so p + 32 <= cols as cols % 32 == 0), 16 code bytes at
        // r·cols/2 + p/2 and 2 scale bytes at r·cols/16 + p/16, inside the views and aligned
        // (`rd` 16-byte and `rs` 2-byte aligned, checked above, pitches cols/2 and cols/16
        // multiples of 16 and 2). The shared-memory words it reads are those it copied.
        // Version 10 launches version 9's kernel as the programmatic dependent of
        // nvfp4_params_v9, the kernel just before it (its CTAs copy their first tile while the
        // parameters are made, and wait for them with griddepcontrol.wait before reading `tp`;
        // they write only the outputs, which that kernel does not touch).
        let dependent = self.nvfp4_version >= 10 && kernel == "nvfp4_quantize_both_v9";
        // SAFETY: as above; a dependent launch only for version 9's kernel, whose loop reads
        // `tp` after that wait.
        unsafe { self.launch_with(kernel, (gx, gy, 1), (128, 1, 1), &args, dependent)? };
        Ok(true)
    }

    /// Dequantizes one copy of a `[rows, cols]` matrix, its rowwise or (`columnwise`) its
    /// columnwise `data` and `scales`, into `dst` (views validated by the caller with the
    /// plane's shapes), or `Ok(false)` when the variant has no kernel (see
    /// [`CudaDevice::nvfp4_dequantize_rht`] for a Hadamard-transformed copy, always columnwise).
    pub(crate) fn dequantize(
        &mut self,
        format: Dequant,
        views: [View; 3],
        shape: [usize; 2],
        columnwise: bool,
    ) -> Result<bool> {
        let (name, table, extra) = match format {
            Dequant::Nvfp4 { amax, rht: true } => {
                return self.nvfp4_dequantize_rht(views, amax, shape);
            }
            Dequant::Nvfp4 { amax, rht: false } => (
                "nvfp4_dequantize",
                self.tables_ptr,
                vec![Arg::from(amax), Arg::from(NVFP4_FACTOR_INV)],
            ),
            Dequant::Mxfp8(kind) => (
                "mxfp8_dequantize",
                self.tables_ptr
                    + match kind {
                        Fp8Kind::E4M3 => 0,
                        Fp8Kind::E5M2 => 256 * 4,
                    },
                Vec::new(),
            ),
        };
        let mut args = self.dequantize_args(views, table, shape)?;
        args.extend(extra);
        args.push(Arg::from(u32::from(columnwise)));
        let [rows, cols] = shape;
        // SAFETY: views validated by the caller with the plane's shapes; `table` addresses a
        // 256-entry table of the device's constant tables.
        unsafe { self.launch_n(name, rows * cols, &args)? };
        Ok(true)
    }

    /// The leading arguments of every dequantization kernel: the addresses of `data`, `scales`
    /// and the decode table, the address and dtype code of `dst`, rows and cols.
    pub(in crate::cuda) fn dequantize_args(
        &self,
        [data, scales, dst]: [View; 3],
        table: u64,
        [rows, cols]: [usize; 2],
    ) -> Result<Vec<Arg>> {
        let (d, s, y) = (
            self.device_ptr(data)?,
            self.device_ptr(scales)?,
            self.device_ptr(dst)?,
        );
        Ok(args![d, s, table, y, dt(dst.dtype()), rows, cols].to_vec())
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
        (src, start, cols, tiles, tile): (View, usize, usize, View, usize),
    ) -> Result<()> {
        let (x, t) = (self.device_ptr(src)?, self.device_ptr(tiles)?);
        let n = src.len();
        let segments = n.div_ceil(tile) + (n + start) / cols + 2;
        if n == 0 {
            return Ok(());
        }
        let args = args![x, dt(src.dtype()), n, start, cols, tile, t];
        // SAFETY: `src` and `tiles` validated by the caller; every tile index the range maps to
        // is below the count the caller checked.
        unsafe { self.launch_n("tile_amax_fold", segments, &args) }
    }

    /// The codes of a sharded 2D range with the kernels, or `Ok(false)` when the library would
    /// report an error (or could not index its tiles) for these arguments, for the caller's
    /// host path. Views validated by the caller.
    pub(crate) fn quantize_2d_range(
        &mut self,
        format: Range2d,
        (src, start, cols, tiles, out): (View, usize, usize, View, View),
    ) -> Result<bool> {
        let n = src.len();
        let (x, t, o) = (
            self.device_ptr(src)?,
            self.device_ptr(tiles)?,
            self.device_ptr(out)?,
        );
        let xd = dt(src.dtype());
        match format {
            Range2d::Mxfp8(kind) => {
                if out.len() != n || !Self::tiles_cover(tiles, start, n, cols, 32) {
                    return Ok(false);
                }
                let e5m2 = u32::from(kind == Fp8Kind::E5M2);
                let args = args![x, xd, n, start, cols, e5m2, kind.max_norm_rcp(), t, o];
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
                let [amax, params] = self.nvfp4_tile_params(t, tiles.len())?;
                let args = args![x, xd, n / 2, start, cols, t, params.ptr, o];
                // SAFETY: views validated by the caller; `out` has n/2 bytes and the tiles cover
                // the range (checked here); `params` holds the tensor factors.
                unsafe { self.launch_n("nvfp4_quantize_2d_range", n / 2, &args)? };
                drop((amax, params));
            }
        }
        Ok(true)
    }

    /// Rowwise and columnwise E8M0 scales of a 2D MXFP8 matrix from its tile amaxes, or
    /// `Ok(false)` for the caller's host path whenever that path would fail or write piecewise
    /// (wrong dtypes or lengths, dead or overlapping views), so errors stay the host's.
    pub(crate) fn mxfp8_scales_2d(
        &mut self,
        [rows, cols]: [usize; 2],
        kind: Fp8Kind,
        tiles: View,
        [row_scales, col_scales]: [View; 2],
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
        let args = args![
            self.device_ptr(tiles)?,
            rows,
            cols,
            kind.max_norm_rcp(),
            self.device_ptr(row_scales)?,
            self.device_ptr(col_scales)?
        ];
        // SAFETY: all three views checked above (live, in bounds, disjoint, the lengths the
        // kernel writes).
        unsafe { self.launch_n("mxfp8_scales_2d", nr + nc, &args)? };
        Ok(true)
    }
}

/// Words per piece in the tables of `stage2d_fold_many` / `stage2d_quantize_many` (ops.cu).
const STAGE2D_WORDS: usize = 11;

impl CudaDevice {
    /// The table of the batched 2D staging kernels (first units, then [`STAGE2D_WORDS`] words
    /// per non-empty piece) and the total unit count, or `None` when a count exceeds the
    /// kernels' integer ranges. `outs[i]` and `amax[i]` are piece i's output and global amax
    /// word addresses (0 for a fold).
    fn stage2d_table(
        &self,
        pieces: &[(crate::Piece2d, u64, u64)],
    ) -> Result<Option<(Vec<u64>, u32, u64)>> {
        let (mut firsts, mut rows) = (Vec::new(), Vec::new());
        let mut units = 0u64;
        for &(p, out, amax) in pieces {
            let n = p.src.len();
            if n == 0 {
                continue;
            }
            let (tile, e5m2, nvfp4, rcp) = match p.format {
                crate::Format2d::Mxfp8(kind) => {
                    (32, kind == Fp8Kind::E5M2, false, kind.max_norm_rcp())
                }
                crate::Format2d::Nvfp4 => (16, false, true, 0.0),
            };
            let (cols, end) = (p.cols, p.start + n);
            let tc = cols.div_ceil(tile);
            let (band0, band1) = (p.start / cols / tile, (end - 1) / cols / tile);
            let Some(count) = (band1 - band0 + 1).checked_mul(tc) else {
                return Ok(None);
            };
            let flags = u64::from(dt(p.src.dtype()))
                | (tile as u64) << 8
                | u64::from(e5m2) << 16
                | u64::from(nvfp4) << 24;
            firsts.push(units);
            rows.extend([
                self.device_ptr(p.src)?,
                flags,
                p.start as u64,
                n as u64,
                cols as u64,
                self.device_ptr(p.tiles)?,
                out,
                amax,
                band0 as u64,
                tc as u64,
                u64::from(rcp.to_bits()),
            ]);
            debug_assert_eq!(rows.len(), firsts.len() * STAGE2D_WORDS);
            let Some(u) = units.checked_add(count as u64) else {
                return Ok(None);
            };
            units = u;
        }
        let Ok(count) = u32::try_from(firsts.len()) else {
            return Ok(None);
        };
        firsts.extend(rows);
        Ok(Some((firsts, count, units)))
    }

    /// [`crate::Device::fold_tile_amax_2d_bf16_many`] in one `stage2d_fold_many` launch (the
    /// caller validated every piece and the overlaps). `Ok(false)` (nothing launched) when the
    /// counts do not fit the kernel.
    pub(crate) fn stage2d_fold_many(&mut self, pieces: &[crate::Piece2d]) -> Result<bool> {
        let with: Vec<_> = pieces.iter().map(|&p| (p, 0, 0)).collect();
        let Some((table, count, units)) = self.stage2d_table(&with)? else {
            return Ok(false);
        };
        if count == 0 {
            return Ok(true);
        }
        let (mem, t) = self.upload_table(&table)?;
        // SAFETY: each of the `count` table rows holds one validated piece: a live float view
        // of `n` elements at `x` (dtype code xd), and a live f32 tiles view covering the
        // piece's range (checked by the caller: every (band, cb) a unit maps to, band in
        // band0 ..= band1 and cb < tc, indexes a tile of the rows the range spans), so every
        // load is an element of the source and every atomic a tile word; the 16-byte loads
        // are taken only at 16-byte aligned addresses of whole segments. No source overlaps a
        // tiles view (checked by the caller). `mem` is freed in stream order after the launch.
        unsafe { self.launch_n("stage2d_fold_many", units as usize, &args![t, count, units])? };
        drop(mem);
        Ok(true)
    }

    /// [`crate::Device::quantize_2d_range_bf16_many`] with one `u32_max_many` launch (each NVFP4
    /// piece's global amax: the raw max of its distinct tiles view, as `nvfp4_tile_params`) and
    /// one `stage2d_quantize_many` launch, no host synchronisation. `Ok(false)` (nothing
    /// launched) when the kernel does not take the batch (an NVFP4 piece with cols % 16 != 0,
    /// counts out of range), for the caller's host path.
    pub(crate) fn stage2d_quantize_many(
        &mut self,
        items: &[(crate::Piece2d, View)],
    ) -> Result<bool> {
        // Distinct NVFP4 tiles views, in first-use order.
        let mut distinct: Vec<(u64, usize)> = Vec::new();
        let mut which = Vec::with_capacity(items.len());
        for (p, _) in items {
            if p.format != crate::Format2d::Nvfp4 || p.src.is_empty() {
                which.push(None);
                continue;
            }
            if !p.cols.is_multiple_of(16) {
                return Ok(false);
            }
            let key = (self.device_ptr(p.tiles)?, p.tiles.len());
            let at = match distinct.iter().position(|d| *d == key) {
                Some(at) => at,
                None => {
                    distinct.push(key);
                    distinct.len() - 1
                }
            };
            which.push(Some(at));
        }
        let Ok(0..=65535) = u32::try_from(distinct.len()) else {
            return Ok(false);
        };
        let amax = self.scratch(distinct.len().max(1))?;
        let mut with = Vec::with_capacity(items.len());
        for ((p, out), w) in items.iter().zip(&which) {
            let a = w.map_or(0, |at| amax.ptr + 4 * at as u64);
            with.push((*p, self.device_ptr(*out)?, a));
        }
        let Some((table, count, units)) = self.stage2d_table(&with)? else {
            return Ok(false);
        };
        if count == 0 {
            return Ok(true);
        }
        // SAFETY: every distinct entry is the address and length of a validated live f32
        // tiles view; `amax` holds one zeroed word per entry; nd <= 65535 (checked above).
        unsafe { self.launch_u32_max_many(&distinct, amax.ptr)? };
        let (mem, t) = self.upload_table(&table)?;
        // SAFETY: each of the `count` rows holds one validated piece (live views: a float
        // source of n elements, f32 tiles covering its range, an output of n bytes (MXFP8) or
        // n/2 bytes with start and n even and cols % 16 == 0 (NVFP4), so every segment's
        // pairs are whole bytes of the output), and for NVFP4 the address of its amax word in
        // `amax`, written by the `u32_max_many` launch before it in stream order. Every unit
        // reads one tile word of the covered rows and writes only its piece's output bytes;
        // vector accesses are taken only at aligned addresses of whole segments. Outputs
        // overlap no other item's views (checked by the caller). `mem` and `amax` are freed in
        // stream order after the launch; `tables_ptr` holds the 256 E4M3 values first.
        unsafe {
            self.launch_n(
                "stage2d_quantize_many",
                units as usize,
                &args![t, count, units, self.tables_ptr],
            )?;
        }
        drop((mem, amax));
        Ok(true)
    }

    /// [`crate::Device::mxfp8_scales_2d_many`]: every item whose views `mxfp8_scales_2d` takes
    /// (the single kernel's checks but overlap) in `mxfp8_scales_2d_many` launches,
    /// [`SCALES2D_MAX`] items at most per launch, their table in the kernel's parameters;
    /// returns the indices of the others, in order, for the single op. The caller checked that
    /// no output overlaps another output or an input, of its own item or another.
    pub(crate) fn mxfp8_scales_2d_many(&mut self, items: &[Scales2dItem]) -> Result<Vec<usize>> {
        let (mut taken, mut rest) = (Vec::new(), Vec::new());
        for (i, &(rows, cols, kind, tiles, rs, cs)) in items.iter().enumerate() {
            let (tr, tc) = (rows.div_ceil(32), cols.div_ceil(32));
            // Products past usize cannot come from `Device::mxfp8_scales_2d_many` (it checks
            // every shape first); checked here too so that nothing below can wrap.
            let Some([nt, nr, nc]) = crate::ops::scales_2d_lens(rows, cols) else {
                rest.push(i);
                continue;
            };
            let ok = tiles.dtype() == DType::F32
                && tiles.len() == nt
                && rs.dtype() == DType::U8
                && cs.dtype() == DType::U8
                && rs.len() == nr
                && cs.len() == nc
                && nr + nc > 0;
            // Live and in bounds (the caller checked every view against the others' overlap).
            let ptrs = [tiles, rs, cs].map(|v| self.device_ptr(v));
            let (true, [Ok(t), Ok(r), Ok(c)]) = (ok, ptrs) else {
                rest.push(i);
                continue;
            };
            let row = [
                t,
                rows as u64,
                cols as u64,
                r,
                c,
                u64::from(kind.max_norm_rcp().to_bits()),
            ];
            // The kernel's items: SCALES2D_CODES tiles at most, whole tile rows where a tile
            // row has no more, else segments of one tile row. A matrix's items fit one row of
            // the grid, so at most 2^31 - 1 of them (beyond, the single op's grid-stride kernel
            // takes the matrix).
            let n = tc.min(SCALES2D_CODES);
            let items = tr.div_ceil(SCALES2D_CODES / n) * tc.div_ceil(n);
            if items > (u32::MAX >> 1) as usize {
                rest.push(i);
                continue;
            }
            taken.push((row, items as u64));
        }
        if rest.is_empty() && !taken.is_empty() && self.prepare {
            // The second call with these items makes their graphs; the first only notes them.
            // Bound first: noting may evict (destroy) another call's graphs.
            self.bind()?;
            let slots = &self.slots;
            let found = self.scales2d_prepared.find(items, |b| slots.get(b).is_ok());
            let views = items.iter().flat_map(|i| [i.3, i.4, i.5]);
            if matches!(found, prepared::Found::New) {
                self.scales2d_prepared.insert(items, views, None);
            } else {
                match self.mxfp8_scales_2d_graphs(&taken) {
                    Ok(graphs) => {
                        // SAFETY: built from these items, which passed the checks of
                        // `mxfp8_scales_2d_many`, a moment ago.
                        unsafe { self.launch_graphs(&graphs)? };
                        self.scales2d_prepared.insert(items, views, Some(graphs));
                        self.prepared_calls += 1;
                        return Ok(rest);
                    }
                    // The driver refused a graph: this call runs fresh, counted as a fallback
                    // (tests expect none); a later call tries again.
                    Err(_) => self.note_fallback("mxfp8_scales_2d_many (graph refused)"),
                }
            }
        }
        for (name, mut words, grid) in scales2d_launches(&taken) {
            // SAFETY: `words` is exactly the kernel's `Scales2dParamsT` (2 + 8·capacity words:
            // SCALES2D_MAX = 128, or SCALES2D_SMALL = 32 for `_32`; `launch_words` checks the
            // size against the PTX). Each of its rows holds one matrix's views as
            // `mxfp8_scales_2d` checks them (live, in bounds, disjoint by the caller's check,
            // rows·tc and ceil(rows/32)·cols scale bytes, the tile count), and the matrices'
            // items [first, first + bands·segments) partition 0..units; an item reads the
            // tiles of its tile rows (below ceil(rows/32)) and tile columns (below tc) and
            // writes those tiles' scale bytes (rows below `rows`, columns below `cols`),
            // 16-byte stores only where 16-byte aligned. The slots partition the matrices in
            // order, each slot's items at most the grid's width (below 2^31), one grid row a
            // slot (at most 128); CTA (x, y) takes item x of slot y where the slot has it, each
            // CTA of exactly SCALES2D_THREADS threads (the kernel's launch bound). The driver
            // copies the parameters at launch.
            unsafe {
                self.launch_words(name, grid, (SCALES2D_THREADS, 1, 1), &mut words)?;
            }
        }
        Ok(rest)
    }

    /// The launches of `mxfp8_scales_2d_many` for matrices every one of which the kernel
    /// takes (`taken`, in order) as one-kernel graphs (`cuda/prepared.rs`), for this call and
    /// later ones with the same items ([`Self::mxfp8_scales_2d_prepared`]).
    fn mxfp8_scales_2d_graphs(
        &mut self,
        taken: &[([u64; 6], u64)],
    ) -> Result<Vec<prepared::KernelGraph>> {
        let mut graphs = Vec::new();
        for (name, mut words, grid) in scales2d_launches(taken) {
            // SAFETY: the table of `mxfp8_scales_2d_many`'s launch (see there) for every
            // launch of the graph: it is launched for the items it was built from, now and
            // by `mxfp8_scales_2d_prepared` while every buffer its addresses point into is
            // live.
            graphs.push(unsafe {
                self.kernel_graph(name, grid, (SCALES2D_THREADS, 1, 1), &mut words)?
            });
        }
        Ok(graphs)
    }

    /// [`crate::Device::mxfp8_scales_2d_many`] of items earlier calls prepared
    /// ([`Self::mxfp8_scales_2d_graphs`]) whose buffers are all still allocated: launches its
    /// graphs and returns `true`; `false` (nothing launched) for a fresh call.
    pub(crate) fn mxfp8_scales_2d_prepared(&mut self, items: &[Scales2dItem]) -> Result<bool> {
        if !self.prepare {
            return Ok(false);
        }
        // Bound first: `find` drops (destroys) an entry whose buffers are gone.
        self.bind()?;
        // Taken out while its launches run (they borrow the device).
        let mut cache = std::mem::take(&mut self.scales2d_prepared);
        let slots = &self.slots;
        let launched = match cache.find(items, |b| slots.get(b).is_ok()) {
            // SAFETY: the graphs were built from items that passed every check of
            // `mxfp8_scales_2d_many` (the same items as this call's), and every buffer their
            // addresses point into is the allocation it was then (`find` checked: a freed
            // buffer's id is never live again), so they are that call's launches again.
            prepared::Found::Prepared(graphs) => unsafe { self.launch_graphs(graphs) },
            prepared::Found::New | prepared::Found::Seen => {
                self.scales2d_prepared = cache;
                return Ok(false);
            }
        };
        self.scales2d_prepared = cache;
        launched?;
        self.prepared_calls += 1;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::{SCALES2D_MAX, SCALES2D_SMALL, scales2d_table};

    /// A matrix row tagged `t` (its six words `t, t + 1, ...`) with `n` items.
    fn item(t: u64, n: u64) -> ([u64; 6], u64) {
        (std::array::from_fn(|i| t + i as u64), n)
    }

    #[test]
    fn scales2d_table_packs_small_matrices_into_shared_grid_rows() {
        // One Llama-3.2-1B layer as `mxfp8_scales_2d_many` sees it (q, k, v, o, gate, up,
        // down: 16, 4, 4, 16, 64, 64, 64 items), twice: q to o share a row, each large matrix
        // has its own; the grid is 64 wide and 8 rows, not 14.
        let layer = [16, 4, 4, 16, 64, 64, 64];
        let chunk: Vec<_> = (0..14)
            .map(|k| item(100 * k, layer[k as usize % 7]))
            .collect();
        let (words, grid) = scales2d_table(&chunk, SCALES2D_MAX);
        assert_eq!(words.len(), 2 + 8 * SCALES2D_MAX);
        // The kernels' structs, as their PTX declares them.
        assert_eq!(
            crate::ptx::struct_param_bytes("mxfp8_scales_2d_many"),
            Some(8 * words.len())
        );
        let (small, small_grid) = scales2d_table(&chunk, SCALES2D_SMALL);
        assert_eq!(
            crate::ptx::struct_param_bytes("mxfp8_scales_2d_many_32"),
            Some(8 * small.len())
        );
        // The same table at the smaller capacity: the same head, firsts, rows and slots.
        assert_eq!(small_grid, grid);
        assert_eq!(small[..2 + 14], words[..2 + 14]);
        assert_eq!(
            small[2 + SCALES2D_SMALL..][..6 * 14],
            words[2 + SCALES2D_MAX..][..6 * 14]
        );
        assert_eq!(
            small[2 + 7 * SCALES2D_SMALL..][..9],
            words[2 + 7 * SCALES2D_MAX..][..9]
        );
        assert_eq!(grid, (64, 8, 1));
        assert_eq!((words[0], words[1]), (14, 2 * 232));
        let first: Vec<u64> = words[2..16].to_vec();
        assert_eq!(
            first,
            [
                0, 16, 20, 24, 40, 104, 168, 232, 248, 252, 256, 272, 336, 400
            ]
        );
        let slot = &words[2 + 7 * SCALES2D_MAX..][..9];
        assert_eq!(slot, [0, 4, 5, 6, 7, 11, 12, 13, 0]);
        let rows = &words[2 + SCALES2D_MAX..];
        assert_eq!(rows[..6], [0, 1, 2, 3, 4, 5]);
        assert_eq!(rows[6 * 13..][..6], [1300, 1301, 1302, 1303, 1304, 1305]);
        // Every slot's items fit the width.
        let ends: Vec<usize> = slot[1..8].iter().map(|&s| s as usize).chain([14]).collect();
        for (y, &end) in ends.iter().enumerate() {
            let start = slot[y] as usize;
            let units: u64 = chunk[start..end].iter().map(|c| c.1).sum();
            assert!(units <= 64, "slot {y}: {units} items");
        }
    }

    #[test]
    fn scales2d_table_gives_a_lone_large_matrix_its_own_row() {
        // A matrix as wide as the grid between small ones: the small ones before it share a
        // row, it takes the next, the ones after it share the last.
        let chunk = [
            item(0, 3),
            item(10, 5),
            item(20, 9),
            item(30, 1),
            item(40, 8),
        ];
        let (words, grid) = scales2d_table(&chunk, SCALES2D_MAX);
        assert_eq!(grid, (9, 3, 1));
        assert_eq!(words[2 + 7 * SCALES2D_MAX..][..3], [0, 2, 3]);
        assert_eq!(words[1], 26);
    }
}
