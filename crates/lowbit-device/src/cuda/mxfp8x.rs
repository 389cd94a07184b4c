//! Host side of `crates/lowbit-kernels/mxfp8x.cu`: the MXFP8 quantization variants the kernels of
//! `crates/lowbit-kernels/mxfp8.cu` do not take — a columnwise-only copy, 2D (32x32 tile) scales shared by both
//! copies, E5M2 elements, f32 and f16 inputs (and any bf16 → E4M3 call the `mxfp8.cu` path
//! declines). [`CudaDevice::mxfp8x_quantize`] returns `Ok(false)` for the arguments it does not
//! take, so the caller's host fallback runs (and reports the library's errors). Callers have
//! validated dtypes, lengths and views.

use lowbit_formats::{Copies, Fp8Kind, Mxfp8Config, NanPolicy};

use super::CudaDevice;
use super::kernels::Mxfp8Quantize;
use crate::{DType, Result};

/// Which variants dispatch to the kernels (each only once bit-exact on a GPU).
mod enabled {
    /// A columnwise-only 1D copy.
    pub(super) const COLUMNWISE: bool = true;
    /// 2D (32x32 tile) scales, any copies.
    pub(super) const TWO_D: bool = true;
    /// E5M2 elements.
    pub(super) const E5M2: bool = true;
    /// f32 and f16 inputs.
    pub(super) const WIDE_INPUTS: bool = true;
}

/// Flags of the kernels (`MX_*` in `mxfp8x.cu`).
const ROW: u32 = 1;
const COL: u32 = 2;
const TWO_D: u32 = 4;
const VEC: u32 = 8;

/// Whether this configuration is among the [`enabled`] variants.
fn covered(dtype: DType, cfg: &Mxfp8Config) -> bool {
    (dtype == DType::Bf16 || enabled::WIDE_INPUTS)
        && (cfg.kind == Fp8Kind::E4M3 || enabled::E5M2)
        && (!cfg.two_d || enabled::TWO_D)
        && (cfg.two_d || cfg.copies != Copies::Columnwise || enabled::COLUMNWISE)
}

/// The kernel for an input dtype and element kind; `version` (`CudaDevice::mxfp8x_version`,
/// `set_cuda_kernel_variant("mxfp8x", 2 | 3)`) picks between the bf16 kernels: 3 (the default)
/// those of mxfp8.cu v4's technique, `mxfp8x_bf16_*_v3`, 2 the generic `mxfp8x_bf16_*`. Same
/// bytes; f32 and f16 inputs have one version.
fn kernel(dtype: DType, kind: Fp8Kind, version: u32) -> Option<&'static str> {
    Some(match (dtype, kind) {
        (DType::Bf16, Fp8Kind::E4M3) if version == 3 => "mxfp8x_bf16_e4m3_v3",
        (DType::Bf16, Fp8Kind::E5M2) if version == 3 => "mxfp8x_bf16_e5m2_v3",
        (DType::F32, Fp8Kind::E4M3) => "mxfp8x_f32_e4m3",
        (DType::F32, Fp8Kind::E5M2) => "mxfp8x_f32_e5m2",
        (DType::Bf16, Fp8Kind::E4M3) => "mxfp8x_bf16_e4m3",
        (DType::Bf16, Fp8Kind::E5M2) => "mxfp8x_bf16_e5m2",
        (DType::F16, Fp8Kind::E4M3) => "mxfp8x_f16_e4m3",
        (DType::F16, Fp8Kind::E5M2) => "mxfp8x_f16_e5m2",
        (DType::U8, _) => return None,
    })
}

impl CudaDevice {
    /// MXFP8 quantization by the kernels of `crates/lowbit-kernels/mxfp8x.cu` for the variants of [`enabled`]
    /// (TE NaN policy; the grid's limits: `ceil(rows/32) <= 65535`), else `Ok(false)`. An empty
    /// matrix writes nothing (every output view is empty). Views validated by the caller,
    /// present exactly for the copies `cfg.copies` asks for.
    pub(crate) fn mxfp8x_quantize(&mut self, q: &Mxfp8Quantize<'_>) -> Result<bool> {
        let (src, [rows, cols], cfg, out) = (q.src, q.shape, q.cfg, q.out);
        let Some(name) = kernel(src.dtype(), cfg.kind, self.mxfp8x_version) else {
            return Ok(false);
        };
        if cfg.nan_policy != NanPolicy::Te || !covered(src.dtype(), cfg) {
            return Ok(false);
        }
        if rows == 0 || cols == 0 {
            return Ok(true);
        }
        let (Ok(gx), Ok(gy @ 1..=65535)) = (
            u32::try_from(cols.div_ceil(256)),
            u32::try_from(rows.div_ceil(32)),
        ) else {
            return Ok(false);
        };
        if gx > i32::MAX as u32 {
            return Ok(false);
        }
        let x = self.device_ptr(src)?;
        let mut flags = if cfg.two_d { TWO_D } else { 0 };
        let (mut rd, mut rs, mut cd, mut cs) = (0, 0, 0, 0);
        if let Some((d, s)) = out.rowwise {
            (rd, rs) = (self.device_ptr(d)?, self.device_ptr(s)?);
            flags |= ROW;
        }
        if let Some((d, s)) = out.columnwise {
            (cd, cs) = (self.device_ptr(d)?, self.device_ptr(s)?);
            flags |= COL;
        }
        // 16-byte loads of 8 elements, 8-byte stores of data and columnwise scales (version 3:
        // a tile wholly inside the matrix also issues its four loads together).
        if cols.is_multiple_of(8)
            && x.is_multiple_of(16)
            && [rd, cd, cs].iter().all(|p| p.is_multiple_of(8))
        {
            flags |= VEC;
        }
        let args = args![
            x,
            rd,
            rs,
            cd,
            cs,
            rows,
            cols,
            cfg.kind.max_norm_rcp(),
            flags
        ];
        // SAFETY: the views were validated by the caller (live, in bounds, disjoint; rows·cols
        // input elements, rows·cols data bytes and the compact scale counts for each requested
        // copy; absent copies are never addressed since their flag is clear); the vector
        // accesses only with VEC, whose alignment is checked here (version 3's interior loads
        // also need VEC); both versions' kernels take this parameter list; the grid is within
        // limits.
        unsafe { self.launch(name, (gx, gy, 1), (256, 1, 1), &args)? };
        Ok(true)
    }
}
