// The promotion of one MX block's product into f32, as `lowbit_device::Device::matmul_mx`
// defines it: shared by the mma.sync (`mx_gemm.cu`) and wgmma (`mx_gemm_wgmma.cu`) kernels.

#pragma once

#include <stdint.h>

// x · 2^(ea + eb - 254) in one rounding (E8M0 scale bytes ea, eb); NaN for a NaN scale (255).
__device__ __forceinline__ float mxg_scale(float x, uint32_t ea, uint32_t eb) {
  if (ea == 255u || eb == 255u) return __int_as_float(0x7fc00000);
  int e = (int)ea + (int)eb - 254;
  if (e >= -126 && e <= 127) return x * __int_as_float((e + 127) << 23);
  return ldexpf(x, e);
}
