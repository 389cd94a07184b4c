//! Launch of the MXFP8 block-scaled GEMM (`crates/lowbit-kernels/mx_gemm.cu`, mma.sync, and
//! `mx_gemm_wgmma.cu`, Hopper's wgmma): `C (+)= A·Bᵀ` from two rowwise MXFP8 planes on the FP8
//! tensor cores, each 32-block's product promoted into the f32 accumulator with its two E8M0
//! scales. The caller ([`crate::Device::matmul_mx`]) has
//! checked the planes' dtypes and lengths against the shape; the views are validated here.

use super::blocks;
use crate::cuda::CudaDevice;
use crate::{DeviceError, Fp8Kind, MatmulMxSpec, MxLayout, MxOperand, Result, View};

/// The kernels: mma.sync v0 (64 x 64 tiles, 4 warps), v1 (128 x 128, 8 warps) and the wgmma
/// one (128 x 128, two warpgroups, dynamic shared memory).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kernel {
    V0,
    V1,
    Wgmma,
}

impl Kernel {
    /// Rows and columns of C per CTA, and threads.
    fn tile(self) -> (usize, u32) {
        match self {
            Kernel::V0 => (64, 128),
            Kernel::V1 | Kernel::Wgmma => (128, 256),
        }
    }
}

/// The wgmma kernel's dynamic shared memory: 1024 (alignment) + 4 stages of two 128 x 128-byte
/// tiles + two scale buffers of 2 x 4 x 128 f32 (`mx_gemm_wgmma.cu`'s `MXW_*`).
const WGMMA_SMEM: u32 = 1024 + 4 * 2 * 128 * 128 + 2 * 4096;

impl CudaDevice {
    /// The kernel for a product of `k` with fp8 planes at device addresses `ad`, `bd`:
    /// `set_cuda_kernel_variant("matmul_mx_kernel", 1 | 2 | 3)` selects v0, v1 or wgmma; the
    /// wgmma kernel needs Hopper (its sm_90a module loaded), k a multiple of 16 and both planes
    /// 16-byte aligned (whole cp.async copies), else v1 runs.
    fn mx_kernel(&self, k: usize, ad: u64, bd: u64) -> Kernel {
        match self.fast.mx_gemm {
            1 => Kernel::V0,
            3 if self.fast.wgmma
                && k.is_multiple_of(16)
                && ad.is_multiple_of(16)
                && bd.is_multiple_of(16) =>
            {
                Kernel::Wgmma
            }
            _ => Kernel::V1,
        }
    }

    /// Whether [`CudaDevice::matmul_mx_rowwise`] takes this product: both planes rowwise, a
    /// kernel selected (`set_cuda_kernel_variant("matmul_mx_kernel", 1..=3)`), sizes in the
    /// kernels' 32-bit indices and grid.
    pub(crate) fn mx_gemm_takes(&self, a: &MxOperand, b: &MxOperand, spec: &MatmulMxSpec) -> bool {
        let fits = |v: usize| i32::try_from(v).is_ok();
        let tile = if self.fast.mx_gemm == 1 { 64 } else { 128 };
        matches!(self.fast.mx_gemm, 1..=3)
            && a.layout == MxLayout::Rowwise
            && b.layout == MxLayout::Rowwise
            && fits(spec.m)
            && fits(spec.n)
            && fits(spec.k)
            && spec.m.div_ceil(tile) <= 65535
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
        let kernel = self.mx_kernel(spec.k, ad, bd);
        let name = match (kernel, a.kind, b.kind) {
            (Kernel::V0, Fp8Kind::E4M3, Fp8Kind::E4M3) => "mx_gemm_rr_e4m3_e4m3",
            (Kernel::V0, Fp8Kind::E4M3, Fp8Kind::E5M2) => "mx_gemm_rr_e4m3_e5m2",
            (Kernel::V0, Fp8Kind::E5M2, Fp8Kind::E4M3) => "mx_gemm_rr_e5m2_e4m3",
            (Kernel::V0, Fp8Kind::E5M2, Fp8Kind::E5M2) => "mx_gemm_rr_e5m2_e5m2",
            (Kernel::V1, Fp8Kind::E4M3, Fp8Kind::E4M3) => "mx_gemm_rr_v1_e4m3_e4m3",
            (Kernel::V1, Fp8Kind::E4M3, Fp8Kind::E5M2) => "mx_gemm_rr_v1_e4m3_e5m2",
            (Kernel::V1, Fp8Kind::E5M2, Fp8Kind::E4M3) => "mx_gemm_rr_v1_e5m2_e4m3",
            (Kernel::V1, Fp8Kind::E5M2, Fp8Kind::E5M2) => "mx_gemm_rr_v1_e5m2_e5m2",
            (Kernel::Wgmma, Fp8Kind::E4M3, Fp8Kind::E4M3) => "mx_gemm_wgmma_e4m3_e4m3",
            (Kernel::Wgmma, Fp8Kind::E4M3, Fp8Kind::E5M2) => "mx_gemm_wgmma_e4m3_e5m2",
            (Kernel::Wgmma, Fp8Kind::E5M2, Fp8Kind::E4M3) => "mx_gemm_wgmma_e5m2_e4m3",
            (Kernel::Wgmma, Fp8Kind::E5M2, Fp8Kind::E5M2) => "mx_gemm_wgmma_e5m2_e5m2",
        };
        let (tile, threads) = kernel.tile();
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
        // rows, columns and k past the end; the wgmma kernel's copies are whole 16-byte units
        // (k % 16 == 0, planes 16-byte aligned: `mx_kernel`) in WGMMA_SMEM bytes of shared
        // memory, within sm_90's 227 KiB.
        unsafe {
            if kernel == Kernel::Wgmma {
                self.launch_smem(name, (gx, gy, 1), threads, WGMMA_SMEM, &args)
            } else {
                self.launch(name, (gx, gy, 1), (threads, 1, 1), &args)
            }
        }
    }
}
