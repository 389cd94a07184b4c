// MXFP8 quantization variants not covered by mxfp8.cu: columnwise-only copies, 2D (32x32 tile)
// scales shared by both copies, E5M2 elements, and f32 / f16 / bf16 inputs, each bit-exact with
// lowbit_formats::mxfp8 on the CPU (TE's rule and NaN/Inf behaviour).
//
// Per block (1x32 rowwise, 32x1 columnwise, or 32x32 tile): amax = max |x| as fp32 bits with NaN
// as 0 (TE's NaN-ignoring fmaxf), e = E8M0 round-up of fl32(amax * rcp) (rcp = fl32(1/448) for
// E4M3, fl32(1/57344) for E5M2; an Inf amax saturates e to 0xFE), q = fp8_rne_satfinite(fl32(x *
// 2^(127-e))) (exact multiply, one rounding; NaN -> 0x7F, +-Inf -> +-max), by the hardware
// conversion (cvt.rn.satfinite.{e4m3,e5m2}x2.f32) with E5M2 NaN codes forced to 0x7F.
//
// One kernel per (input dtype, element kind); the copies, 2D scaling and the vector path are
// CTA-uniform flags. A CTA of 256 threads owns a 32-row x 256-column tile: lane l of warp w
// holds columns 8l..8l+7 of rows w, w+8, w+16, w+24 in registers, raw (one or two 16-byte
// words per row; each element converted to f32, exactly, where it is used). Row amaxes are
// reduced over the 4 lanes of a 1x32 block with shuffles, column amaxes over the 8 warps
// through shared memory, and a 32x32 tile amax is the max of its 32 column amaxes (4 lanes x 8
// columns). Registers are capped for two CTAs per SM with f32 inputs (128) and three with
// 16-bit ones (80), with no spills. Outputs as the CPU library lays them out: both data copies
// rows x cols (not transposed), rowwise scales rows x ceil(cols/32), columnwise scales
// ceil(rows/32) x cols; 2D writes each tile's scale into every entry of both scale tensors and
// the same codes into both copies.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "include/lowbit_convert.cuh"

// Flags (CTA-uniform).
#define MX_ROW 1u    // write the rowwise copy
#define MX_COL 2u    // write the columnwise copy
#define MX_2D 4u     // one scale per 32x32 tile
#define MX_VEC 8u    // cols % 8 == 0 and aligned pointers: 16-byte loads, 8-byte stores

__device__ __forceinline__ float mx_f32(float v) { return v; }
__device__ __forceinline__ float mx_f32(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float mx_f32(__half v) { return __half2float(v); }

// 16-byte words holding 8 elements of T.
template <typename T>
struct Words {
    static constexpr int N = (int)sizeof(T) / 2;
};

// Element j (0..7) of the 8 elements of T held raw in w, as f32 (exact).
template <typename T>
__device__ __forceinline__ float mx_get(const uint4* w, int j) {
    return mx_f32(reinterpret_cast<const T*>(w)[j]);
}

// Codes of fl32(x[j] * s[j]) for the 8 elements held raw in w, packed little-endian: the
// hardware conversion (cvt.rn.satfinite.{e4m3,e5m2}x2.f32: RNE, +-Inf and overflow to +-max),
// with every NaN input mapped to 0x7F for E5M2 as the CPU does (E4M3's hardware NaN is already
// 0x7F, checked on the GPU with mxfp8.cu).
template <typename T, bool E5>
__device__ __forceinline__ u64 mx_encode8(const uint4* w, const float s[8]) {
    u64 q = 0;
#pragma unroll
    for (int j = 0; j < 8; j += 2) {
        float x0 = mx_get<T>(w, j), x1 = mx_get<T>(w, j + 1);
        float a = __fmul_rn(x0, s[j]), b = __fmul_rn(x1, s[j + 1]);
        uint32_t p = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE,
                                              E5 ? __NV_E5M2 : __NV_E4M3);
        if (E5) {
            if (a != a) p = (p & 0xFF00u) | 0x7Fu;
            if (b != b) p = (p & 0x00FFu) | 0x7F00u;
        }
        q |= (u64)p << (8 * j);
    }
    return q;
}


// Elements c..c+7 of row r, raw (0 outside the matrix, which leaves every amax unchanged).
template <typename T>
__device__ __forceinline__ void mx_load8(const T* __restrict__ x, u64 rows, u64 cols, u64 r, u64 c,
                                         bool vec, uint4 w[Words<T>::N]) {
#pragma unroll
    for (int k = 0; k < Words<T>::N; ++k) w[k] = make_uint4(0, 0, 0, 0);
    if (r >= rows || c >= cols) return;
    const T* src = x + r * cols + c;
    if (vec) {
#pragma unroll
        for (int k = 0; k < Words<T>::N; ++k)
            w[k] = __ldcs(reinterpret_cast<const uint4*>(src) + k);
    } else {
        T* v = reinterpret_cast<T*>(w);
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (c + j < cols) v[j] = src[j];
    }
}

// Stores the 8 packed bytes q at dst (only those before column `cols` when not `vec`).
__device__ __forceinline__ void mx_store8(uint8_t* dst, u64 q, u64 c, u64 cols, bool vec) {
    if (vec) {
        *reinterpret_cast<u64*>(dst) = q;
    } else {
        for (int j = 0; j < 8; ++j)
            if (c + j < cols) dst[j] = (uint8_t)(q >> (8 * j));
    }
}

template <typename T, bool E5>
__device__ __forceinline__ void mxfp8x_body(const T* __restrict__ x, uint8_t* __restrict__ row_data,
                                            uint8_t* __restrict__ row_scales,
                                            uint8_t* __restrict__ col_data,
                                            uint8_t* __restrict__ col_scales, u64 rows, u64 cols,
                                            float rcp, uint32_t flags) {
    __shared__ uint32_t camax[8][256];
    const bool row = flags & MX_ROW, col = flags & MX_COL, two_d = flags & MX_2D,
               vec = flags & MX_VEC;
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u64 r0 = (u64)blockIdx.y * 32;
    const u64 c = (u64)blockIdx.x * 256 + lane * 8;
    const u64 nb = (cols + 31) / 32;
    constexpr int N = Words<T>::N;
    uint4 raw[4][N];
#pragma unroll
    for (int i = 0; i < 4; ++i) mx_load8<T>(x, rows, cols, r0 + w + 8 * i, c, vec, raw[i]);
    uint32_t ra[4] = {0, 0, 0, 0};
    uint32_t cm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            uint32_t a = abs_bits_nan_zero(mx_get<T>(raw[i], j));
            ra[i] = a > ra[i] ? a : ra[i];
            cm[j] = a > cm[j] ? a : cm[j];
        }
    }
    if (col || two_d) {
#pragma unroll
        for (int j = 0; j < 8; ++j) camax[j][w * 32 + lane] = cm[j];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            uint32_t m = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                uint32_t a = camax[j][k * 32 + lane];
                m = a > m ? a : m;
            }
            cm[j] = m;
        }
    }
    float s[8];
    if (two_d) {
        uint32_t t = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) t = cm[j] > t ? cm[j] : t;
        t = max(t, __shfl_xor_sync(0xFFFFFFFFu, t, 1));
        t = max(t, __shfl_xor_sync(0xFFFFFFFFu, t, 2));
        const uint32_t e = e8m0_code(__fmul_rn(__uint_as_float(t), rcp));
        const float sc = e8m0_reciprocal(e);
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j] = sc;
        if (col && w == 0 && c < cols)
            mx_store8(col_scales + (r0 / 32) * cols + c, 0x0101010101010101ull * e, c, cols, vec);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u64 r = r0 + w + 8 * i;
            if (r >= rows || c >= cols) continue;
            if (row && lane % 4 == 0) row_scales[r * nb + c / 32] = (uint8_t)e;
            const u64 q = mx_encode8<T, E5>(raw[i], s);
            if (row) mx_store8(row_data + r * cols + c, q, c, cols, vec);
            if (col) mx_store8(col_data + r * cols + c, q, c, cols, vec);
        }
        return;
    }
    if (col) {
        u64 cscale = 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const uint32_t e = e8m0_code(__fmul_rn(__uint_as_float(cm[j]), rcp));
            s[j] = e8m0_reciprocal(e);
            cscale |= (u64)e << (8 * j);
        }
        if (w == 0 && c < cols) mx_store8(col_scales + (r0 / 32) * cols + c, cscale, c, cols, vec);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u64 r = r0 + w + 8 * i;
        uint32_t a = ra[i];
        a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        if (r >= rows || c >= cols) continue;
        if (row) {
            const uint32_t e = e8m0_code(__fmul_rn(__uint_as_float(a), rcp));
            const float sr = e8m0_reciprocal(e);
            float rs[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) rs[j] = sr;
            if (lane % 4 == 0) row_scales[r * nb + c / 32] = (uint8_t)e;
            mx_store8(row_data + r * cols + c, mx_encode8<T, E5>(raw[i], rs), c, cols, vec);
        }
        if (col) mx_store8(col_data + r * cols + c, mx_encode8<T, E5>(raw[i], s), c, cols, vec);
    }
}

// ---- version 3: bf16 inputs with mxfp8.cu v4's technique (same tile, same bytes) ----
// A CTA whose tile lies wholly inside the matrix with the vector path (the CTA-uniform
// `interior` case) issues its four 16-byte loads back to back with the streaming hint
// (ld.global.cs) before any use; every amax is taken on packed bf16 pairs (__habs2, then
// __hmax2 from 0, which ignores a NaN operand: the same maxima as the u32 bits with NaN as 0 of
// version 2, since bf16 -> f32 is exact and every value is >= +0); column amaxes through 4 KB of
// shared memory (bf16 pairs instead of u32); the data and scale stores as in version 2. Tiles on
// the matrix edge and views without the vector path take version 2's guarded loads and stores.
// Capped at 64 registers: four CTAs per SM.
template <bool E5>
__device__ __forceinline__ void mxfp8x_bf16_v3_body(const __nv_bfloat16* __restrict__ x,
                                                    uint8_t* __restrict__ row_data,
                                                    uint8_t* __restrict__ row_scales,
                                                    uint8_t* __restrict__ col_data,
                                                    uint8_t* __restrict__ col_scales, u64 rows,
                                                    u64 cols, float rcp, uint32_t flags) {
    typedef __nv_bfloat16 T;
    __shared__ __nv_bfloat162 camax[4][256];
    const bool row = flags & MX_ROW, col = flags & MX_COL, two_d = flags & MX_2D,
               vec = flags & MX_VEC;
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u64 r0 = (u64)blockIdx.y * 32;
    const u64 c0 = (u64)blockIdx.x * 256;
    const u64 c = c0 + lane * 8;
    const u64 nb = (cols + 31) / 32;
    const bool interior = vec && r0 + 32 <= rows && c0 + 256 <= cols;
    uint4 raw[4];
    if (interior) {
        const T* src = x + (r0 + w) * cols + c;
#pragma unroll
        for (int i = 0; i < 4; ++i)
            raw[i] = __ldcs(reinterpret_cast<const uint4*>(src + 8 * i * cols));
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) mx_load8<T>(x, rows, cols, r0 + w + 8 * i, c, vec, &raw[i]);
    }
    const __nv_bfloat162 zero2 = __float2bfloat162_rn(0.0f);
    float ra[4];
    __nv_bfloat162 cm[4] = {zero2, zero2, zero2, zero2};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
        __nv_bfloat162 rm = zero2;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const __nv_bfloat162 a = __habs2(v[p]);
            cm[p] = __hmax2(cm[p], a);
            rm = __hmax2(rm, a);
        }
        ra[i] = fmaxf(__low2float(rm), __high2float(rm));
    }
    if (col || two_d) {
#pragma unroll
        for (int p = 0; p < 4; ++p) camax[p][w * 32 + lane] = cm[p];
        __syncthreads();
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            __nv_bfloat162 m = camax[p][lane];
#pragma unroll
            for (int k = 1; k < 8; ++k) m = __hmax2(m, camax[p][k * 32 + lane]);
            cm[p] = m;
        }
    }
    float s[8];
    if (two_d) {
        const __nv_bfloat162 m2 = __hmax2(__hmax2(cm[0], cm[1]), __hmax2(cm[2], cm[3]));
        float t = fmaxf(__low2float(m2), __high2float(m2));
        t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, 1));
        t = fmaxf(t, __shfl_xor_sync(0xFFFFFFFFu, t, 2));
        const uint32_t e = e8m0_code(__fmul_rn(t, rcp));
        const float sc = e8m0_reciprocal(e);
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j] = sc;
        if (col && w == 0 && c < cols)
            mx_store8(col_scales + (r0 / 32) * cols + c, 0x0101010101010101ull * e, c, cols, vec);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const u64 r = r0 + w + 8 * i;
            if (r >= rows || c >= cols) continue;
            if (row && lane % 4 == 0) row_scales[r * nb + c / 32] = (uint8_t)e;
            const u64 q = mx_encode8<T, E5>(&raw[i], s);
            if (row) mx_store8(row_data + r * cols + c, q, c, cols, vec);
            if (col) mx_store8(col_data + r * cols + c, q, c, cols, vec);
        }
        return;
    }
    if (col) {
        u64 cscale = 0;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const uint32_t e0 = e8m0_code(__fmul_rn(__low2float(cm[p]), rcp));
            const uint32_t e1 = e8m0_code(__fmul_rn(__high2float(cm[p]), rcp));
            s[2 * p] = e8m0_reciprocal(e0);
            s[2 * p + 1] = e8m0_reciprocal(e1);
            cscale |= ((u64)e0 | ((u64)e1 << 8)) << (16 * p);
        }
        if (w == 0 && c < cols) mx_store8(col_scales + (r0 / 32) * cols + c, cscale, c, cols, vec);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u64 r = r0 + w + 8 * i;
        float a = ra[i];
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        if (r >= rows || c >= cols) continue;
        if (row) {
            const uint32_t e = e8m0_code(__fmul_rn(a, rcp));
            const float sr = e8m0_reciprocal(e);
            float rs[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) rs[j] = sr;
            if (lane % 4 == 0) row_scales[r * nb + c / 32] = (uint8_t)e;
            mx_store8(row_data + r * cols + c, mx_encode8<T, E5>(&raw[i], rs), c, cols, vec);
        }
        if (col) mx_store8(col_data + r * cols + c, mx_encode8<T, E5>(&raw[i], s), c, cols, vec);
    }
}

#define MXFP8X_KERNEL(NAME, T, E5, MINB)                                                  \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                 \
        NAME(const T* __restrict__ x, uint8_t* __restrict__ row_data,                       \
             uint8_t* __restrict__ row_scales, uint8_t* __restrict__ col_data,              \
             uint8_t* __restrict__ col_scales, u64 rows, u64 cols, float rcp, uint32_t flags) { \
        mxfp8x_body<T, E5>(x, row_data, row_scales, col_data, col_scales, rows, cols, rcp,  \
                           flags);                                                          \
    }

// f32 inputs: two CTAs per SM; bf16 and f16: three.
MXFP8X_KERNEL(mxfp8x_f32_e4m3, float, false, 2)
MXFP8X_KERNEL(mxfp8x_f32_e5m2, float, true, 2)
MXFP8X_KERNEL(mxfp8x_bf16_e4m3, __nv_bfloat16, false, 3)
MXFP8X_KERNEL(mxfp8x_bf16_e5m2, __nv_bfloat16, true, 3)
MXFP8X_KERNEL(mxfp8x_f16_e4m3, __half, false, 3)
MXFP8X_KERNEL(mxfp8x_f16_e5m2, __half, true, 3)

// Version 3 (bf16 inputs, the default): four CTAs per SM.
#define MXFP8X_V3_KERNEL(NAME, E5)                                                             \
    extern "C" __global__ void __launch_bounds__(256, 4)                                        \
        NAME(const __nv_bfloat16* __restrict__ x, uint8_t* __restrict__ row_data,              \
             uint8_t* __restrict__ row_scales, uint8_t* __restrict__ col_data,                 \
             uint8_t* __restrict__ col_scales, u64 rows, u64 cols, float rcp, uint32_t flags) { \
        mxfp8x_bf16_v3_body<E5>(x, row_data, row_scales, col_data, col_scales, rows, cols, rcp, \
                                flags);                                                        \
    }

MXFP8X_V3_KERNEL(mxfp8x_bf16_e4m3_v3, false)
MXFP8X_V3_KERNEL(mxfp8x_bf16_e5m2_v3, true)
