// MXFP8 quantization kernels (TE's scale rule, bit-exact with lowbit-formats on the CPU).
//
// Per 1x32 block: amax = max |x| with NaN ignored (fmaxf), e = E8M0 round-up of
// fl32(amax * fl32(1/448)), saturated to [0x00, 0xFE]; q = e4m3_rn_satfinite(x * 2^(127-e)).
// Hopper has hardware FP8 conversion (cvt.rn.satfinite.e4m3x2.f32), used via cuda_fp8.h; the
// E8M0 rule is integer arithmetic on the fp32 bits, as in lowbit_formats::scalar.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

// Smallest power of two >= |x| as E8M0, clamped to [2^-127, 2^127]; NaN -> 0xFF.
__device__ __forceinline__ uint8_t e8m0_round_up(float x) {
    uint32_t a = __float_as_uint(x) & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0xFF;
    uint32_t exp = a >> 23;
    uint32_t mant = a & 0x7FFFFFu;
    uint32_t up = (mant != 0u && exp != 0xFEu && !(exp == 0u && mant <= 0x400000u)) ? 1u : 0u;
    uint32_t code = exp + up;
    return (uint8_t)(code > 0xFEu ? 0xFEu : code);
}

// 2^(127 - e) exactly: 0xFE -> 2^-127 (subnormal), 0xFF -> NaN.
__device__ __forceinline__ float e8m0_rcp(uint8_t e) {
    if (e == 0xFE) return __uint_as_float(0x00400000u);
    if (e == 0xFF) return __uint_as_float(0x7FC00000u);
    return __uint_as_float((254u - (uint32_t)e) << 23);
}

__device__ __forceinline__ float abs_nan_zero(float v) {
    float a = fabsf(v);
    return a != a ? 0.0f : a;
}

// Rowwise MXFP8 E4M3 of a row-major rows x cols bf16 matrix: one thread per 1x32 block.
// data: rows*cols bytes; scales: rows*ceil(cols/32) bytes. Partial blocks at the row end use
// the elements that exist.
extern "C" __global__ void mxfp8_rowwise_e4m3_bf16(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ data,
    uint8_t* __restrict__ scales,
    unsigned long long rows,
    unsigned long long cols) {
    unsigned long long nb = (cols + 31) / 32;
    unsigned long long block = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (block >= rows * nb) return;
    unsigned long long r = block / nb, b = block % nb;
    unsigned long long c0 = b * 32, c1 = c0 + 32 < cols ? c0 + 32 : cols;
    const __nv_bfloat16* row = x + r * cols;
    float amax = 0.0f;
    for (unsigned long long c = c0; c < c1; ++c) amax = fmaxf(amax, abs_nan_zero(__bfloat162float(row[c])));
    // fl32(1/448) = 0x3B124925, multiplied with round-to-nearest (no FMA contraction).
    uint8_t e = e8m0_round_up(__fmul_rn(amax, __uint_as_float(0x3B124925u)));
    float s = e8m0_rcp(e);
    scales[block] = e;
    for (unsigned long long c = c0; c < c1; ++c) {
        __nv_fp8_e4m3 q(__fmul_rn(__bfloat162float(row[c]), s));
        data[r * cols + c] = *reinterpret_cast<uint8_t*>(&q);
    }
}
