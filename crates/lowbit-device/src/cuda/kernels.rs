//! Host side of the CUDA kernels: argument checks that only the GPU path needs (alignment),
//! launch configurations and the launches. Callers have validated dtypes, lengths and shapes;
//! each method validates its views (liveness, bounds, overlap) before launching anything.

use lowbit_formats::{Copies, Fp8Kind, Mxfp8Config, NanPolicy};

use super::{Arg, CudaDevice};
use crate::{DType, Mxfp8Views, Result, View};

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
