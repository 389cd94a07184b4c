//! Launch of the MXFP8 block-scaled GEMM (`crates/lowbit-kernels/mx_gemm.cu`): `C (+)= A·Bᵀ`
//! from two rowwise MXFP8 planes on the FP8 tensor cores, each 32-block's product promoted into
//! the f32 accumulator with its two E8M0 scales. The caller ([`crate::Device::matmul_mx`]) has
//! checked the planes' dtypes and lengths against the shape; the views are validated here.

use super::blocks;
use crate::cuda::CudaDevice;
use crate::{DeviceError, Fp8Kind, MatmulMxSpec, MxLayout, MxOperand, Result, View};

/// Rows and columns of C per CTA and threads: v0 (`MXG_BM`, 4 warps) and v1 (`MXG1_BM`, 8
/// warps).
fn tile(version: u32) -> (usize, u32) {
    if version == 2 { (128, 256) } else { (64, 128) }
}

impl CudaDevice {
    /// Whether [`CudaDevice::matmul_mx_rowwise`] takes this product: both planes rowwise, the
    /// kernel selected (`set_cuda_kernel_variant("matmul_mx_kernel", 1 | 2)`: v0, v1), sizes
    /// in the kernel's 32-bit indices and grid.
    pub(crate) fn mx_gemm_takes(&self, a: &MxOperand, b: &MxOperand, spec: &MatmulMxSpec) -> bool {
        let fits = |v: usize| i32::try_from(v).is_ok();
        matches!(self.fast.mx_gemm, 1 | 2)
            && a.layout == MxLayout::Rowwise
            && b.layout == MxLayout::Rowwise
            && fits(spec.m)
            && fits(spec.n)
            && fits(spec.k)
            && spec.m.div_ceil(tile(self.fast.mx_gemm).0) <= 65535
    }

    /// `c[m, n] (+)= a·bᵀ` for rowwise planes `a` (`[m, k]`) and `b` (`[n, k]`).
    pub(crate) fn matmul_mx_rowwise(
        &mut self,
        a: &MxOperand,
        b: &MxOperand,
        c: View,
        spec: &MatmulMxSpec,
    ) -> Result<()> {
        const WHAT: &str = "matmul_mx";
        let ([ad, asc, bd, bsc], [cp]) =
            self.ptrs(WHAT, [a.data, a.scales, b.data, b.scales], [c])?;
        let v1 = self.fast.mx_gemm == 2;
        let name = match (v1, a.kind, b.kind) {
            (false, Fp8Kind::E4M3, Fp8Kind::E4M3) => "mx_gemm_rr_e4m3_e4m3",
            (false, Fp8Kind::E4M3, Fp8Kind::E5M2) => "mx_gemm_rr_e4m3_e5m2",
            (false, Fp8Kind::E5M2, Fp8Kind::E4M3) => "mx_gemm_rr_e5m2_e4m3",
            (false, Fp8Kind::E5M2, Fp8Kind::E5M2) => "mx_gemm_rr_e5m2_e5m2",
            (true, Fp8Kind::E4M3, Fp8Kind::E4M3) => "mx_gemm_rr_v1_e4m3_e4m3",
            (true, Fp8Kind::E4M3, Fp8Kind::E5M2) => "mx_gemm_rr_v1_e4m3_e5m2",
            (true, Fp8Kind::E5M2, Fp8Kind::E4M3) => "mx_gemm_rr_v1_e5m2_e4m3",
            (true, Fp8Kind::E5M2, Fp8Kind::E5M2) => "mx_gemm_rr_v1_e5m2_e5m2",
        };
        let (tile, threads) = tile(self.fast.mx_gemm);
        let too_big = || DeviceError::Unsupported(format!("{WHAT}: {spec:?} exceeds the grid"));
        let gx = blocks(spec.n, tile).ok_or_else(too_big)?;
        let gy = blocks(spec.m, tile).ok_or_else(too_big)?;
        let dim = |v: usize| u32::try_from(v).map_err(|_| too_big());
        let args = args![
            ad,
            asc,
            bd,
            bsc,
            cp,
            dim(spec.m)?,
            dim(spec.n)?,
            dim(spec.k)?,
            u32::from(spec.accumulate)
        ];
        // SAFETY: the planes were checked against the shape by the caller (data outer·k bytes,
        // scales outer·ceil(k/32)) and the views here; c holds m·n f32 and overlaps no operand
        // (checked by `ptrs`); m, n, k fit the kernel's int (`mx_gemm_takes`); the grid covers
        // ceil(n/tile) x ceil(m/tile) tiles with the version's threads, and the kernel guards
        // rows, columns and k past the end.
        unsafe { self.launch(name, (gx, gy, 1), (threads, 1, 1), &args) }
    }
}
