// MXFP8 quantization kernels (TE's scale rule, bit-exact with lowbit-formats on the CPU).
//
// Per 1x32 block: amax = max |x| with NaN ignored (fmaxf), e = E8M0 round-up of
// fl32(amax * fl32(1/448)), saturated to [0x00, 0xFE]; q = e4m3_rn_satfinite(x * 2^(127-e)).
// Hopper has hardware FP8 conversion (cvt.rn.satfinite.e4m3x2.f32), used via cuda_fp8.h; the
// E8M0 rule is integer arithmetic on the fp32 bits, as in lowbit_formats::scalar.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "include/lowbit_convert.cuh"

// The E8M0 rule of include/lowbit_convert.cuh with the scale arrays' byte type: the kernels here
// keep the code in a byte (their PTX stores it with st.u8 from a 16-bit register).
__device__ __forceinline__ uint8_t e8m0_round_up(float x) { return (uint8_t)e8m0_code(x); }

__device__ __forceinline__ float e8m0_rcp(uint8_t e8) { return e8m0_reciprocal(e8); }

__device__ __forceinline__ float abs_nan_zero(float v) {
    float a = fabsf(v);
    return a != a ? 0.0f : a;
}

// Rowwise MXFP8 E4M3 of a row-major rows x cols bf16 matrix. One warp per 1x32 block: lane i
// loads element i (coalesced), the block amax is a warp max reduction, lane 0 writes the scale
// and every lane its byte. data: rows*cols bytes; scales: rows*ceil(cols/32) bytes. Lanes past
// the row's end (a partial block) contribute 0 to the amax and write nothing.
extern "C" __global__ void mxfp8_rowwise_e4m3_bf16(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ data,
    uint8_t* __restrict__ scales,
    unsigned long long rows,
    unsigned long long cols) {
    unsigned long long nb = (cols + 31) / 32;
    unsigned long long block =
        ((unsigned long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    unsigned lane = threadIdx.x % 32;
    if (block >= rows * nb) return;
    unsigned long long r = block / nb;
    unsigned long long c = (block % nb) * 32 + lane;
    bool live = c < cols;
    float v = live ? __bfloat162float(x[r * cols + c]) : 0.0f;
    float amax = abs_nan_zero(v);
    for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    // fl32(1/448) = 0x3B124925, multiplied with round-to-nearest (no FMA contraction).
    uint8_t e = e8m0_round_up(__fmul_rn(amax, __uint_as_float(0x3B124925u)));
    if (lane == 0) scales[block] = e;
    if (live) {
        __nv_fp8_e4m3 q(__fmul_rn(v, e8m0_rcp(e)));
        data[r * cols + c] = *reinterpret_cast<uint8_t*>(&q);
    }
}

// The same for cols % 32 == 0, 16-byte aligned rows: each thread quantizes 8 consecutive
// elements (one 16-byte load, one 8-byte store), four threads share a 1x32 block and reduce its
// amax with shuffles. grid.y walks rows (strided when rows exceed the grid), grid.x x blockDim.x
// covers cols / 8 threads per row.
extern "C" __global__ void mxfp8_rowwise_e4m3_bf16_x8(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ data,
    uint8_t* __restrict__ scales,
    unsigned long long rows,
    unsigned long long cols) {
    unsigned t = blockIdx.x * blockDim.x + threadIdx.x;  // thread within the row
    unsigned long long c = (unsigned long long)t * 8;
    bool live = c < cols;
    for (unsigned long long r = blockIdx.y; r < rows; r += gridDim.y) {
        uint4 raw = live ? *reinterpret_cast<const uint4*>(x + r * cols + c) : make_uint4(0, 0, 0, 0);
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
        float f[8];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            f[i] = __bfloat162float(v[i]);
            amax = fmaxf(amax, abs_nan_zero(f[i]));
        }
        // The four threads of a block are consecutive lanes (t % 4).
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
        uint8_t e = e8m0_round_up(__fmul_rn(amax, __uint_as_float(0x3B124925u)));
        float s = e8m0_rcp(e);
        if (!live) continue;
        if (t % 4 == 0) scales[r * (cols / 32) + t / 4] = e;
        unsigned long long packed = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            __nv_fp8_e4m3 q(__fmul_rn(f[i], s));
            packed |= (unsigned long long)(*reinterpret_cast<uint8_t*>(&q)) << (8 * i);
        }
        *reinterpret_cast<unsigned long long*>(data + r * cols + c) = packed;
    }
}

// As `_x8` with sixteen elements per thread (two 16-byte loads, one 16-byte store, two threads
// per 1x32 block), for cols % 32 == 0.
extern "C" __global__ void mxfp8_rowwise_e4m3_bf16_x16(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ data,
    uint8_t* __restrict__ scales,
    unsigned long long rows,
    unsigned long long cols) {
    unsigned t = blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long c = (unsigned long long)t * 16;
    bool live = c < cols;
    for (unsigned long long r = blockIdx.y; r < rows; r += gridDim.y) {
        uint4 raw[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (live) {
            const uint4* src = reinterpret_cast<const uint4*>(x + r * cols + c);
            raw[0] = src[0];
            raw[1] = src[1];
        }
        const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(raw);
        float f[16];
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            f[i] = __bfloat162float(v[i]);
            amax = fmaxf(amax, abs_nan_zero(f[i]));
        }
        amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
        uint8_t e = e8m0_round_up(__fmul_rn(amax, __uint_as_float(0x3B124925u)));
        float s = e8m0_rcp(e);
        if (!live) continue;
        if (t % 2 == 0) scales[r * (cols / 32) + t / 2] = e;
        uint4 out;
        uint8_t* o = reinterpret_cast<uint8_t*>(&out);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            __nv_fp8_e4m3 q(__fmul_rn(f[i], s));
            o[i] = *reinterpret_cast<uint8_t*>(&q);
        }
        *reinterpret_cast<uint4*>(data + r * cols + c) = out;
    }
}

// Rowwise and columnwise MXFP8 E4M3 of a row-major rows x cols bf16 matrix in one pass over
// the input. A CTA of 256 threads owns a 32-row x 256-column tile, staged in shared memory with
// 16-byte loads (elements outside the matrix read as 0, which leaves every amax unchanged):
// - columnwise: thread j quantizes column j of the tile (one 32x1 block), writing one byte per
//   row; consecutive threads write consecutive bytes;
// - rowwise: thread t quantizes the 1x32 block (row t % 32, block t / 32) of the tile.
// Outputs as the CPU library lays them out: both data copies rows x cols (not transposed),
// rowwise scales rows x ceil(cols/32), columnwise scales ceil(rows/32) x cols.
extern "C" __global__ void __launch_bounds__(256) mxfp8_both_e4m3_bf16(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ row_data,
    uint8_t* __restrict__ row_scales,
    uint8_t* __restrict__ col_data,
    uint8_t* __restrict__ col_scales,
    unsigned long long rows,
    unsigned long long cols) {
    __shared__ float tile[32][256 + 1];  // +1 breaks bank conflicts of the rowwise reads
    unsigned long long r0 = (unsigned long long)blockIdx.y * 32;
    unsigned long long c0 = (unsigned long long)blockIdx.x * 256;
    unsigned tid = threadIdx.x;
    // Stage: 32 rows x 256 columns = 1024 chunks of 8 elements, 4 per thread.
    for (unsigned k = tid; k < 1024; k += 256) {
        unsigned tr = k / 32, tc = (k % 32) * 8;
        unsigned long long r = r0 + tr, c = c0 + tc;
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (r < rows) {
            const __nv_bfloat16* src = x + r * cols + c;
            if (c + 8 <= cols && (cols % 8) == 0) {
                uint4 raw = *reinterpret_cast<const uint4*>(src);
                const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
                for (int i = 0; i < 8; ++i) f[i] = __bfloat162float(v[i]);
            } else {
                for (int i = 0; i < 8; ++i)
                    if (c + i < cols) f[i] = __bfloat162float(src[i]);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) tile[tr][tc + i] = f[i];
    }
    __syncthreads();
    const float rcp448 = __uint_as_float(0x3B124925u);
    // Columnwise: thread tid owns column c0 + tid.
    {
        unsigned long long c = c0 + tid;
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, abs_nan_zero(tile[i][tid]));
        uint8_t e = e8m0_round_up(__fmul_rn(amax, rcp448));
        float s = e8m0_rcp(e);
        if (c < cols) {
            col_scales[(r0 / 32) * cols + c] = e;
            for (int i = 0; i < 32; ++i) {
                unsigned long long r = r0 + i;
                if (r < rows) {
                    __nv_fp8_e4m3 q(__fmul_rn(tile[i][tid], s));
                    col_data[r * cols + c] = *reinterpret_cast<uint8_t*>(&q);
                }
            }
        }
    }
    // Rowwise: thread tid owns block (tid % 32, tid / 32) of the tile: a warp reads one block
    // column of 32 rows, which the +1 padding spreads over all 32 banks.
    {
        unsigned tr = tid % 32, tb = tid / 32;
        unsigned long long r = r0 + tr, c = c0 + tb * 32;
        float amax = 0.0f;
#pragma unroll
        for (int i = 0; i < 32; ++i) amax = fmaxf(amax, abs_nan_zero(tile[tr][tb * 32 + i]));
        uint8_t e = e8m0_round_up(__fmul_rn(amax, rcp448));
        float s = e8m0_rcp(e);
        if (r < rows && c < cols) {
            row_scales[r * ((cols + 31) / 32) + c / 32] = e;
            if (c + 32 <= cols && cols % 16 == 0) {
                // A whole, 16-byte aligned block: two 16-byte stores.
                uint4 out[2];
                uint8_t* o = reinterpret_cast<uint8_t*>(out);
#pragma unroll
                for (int i = 0; i < 32; ++i) {
                    __nv_fp8_e4m3 q(__fmul_rn(tile[tr][tb * 32 + i], s));
                    o[i] = *reinterpret_cast<uint8_t*>(&q);
                }
                uint4* dst = reinterpret_cast<uint4*>(row_data + r * cols + c);
                dst[0] = out[0];
                dst[1] = out[1];
            } else {
                for (int i = 0; i < 32 && c + i < cols; ++i) {
                    __nv_fp8_e4m3 q(__fmul_rn(tile[tr][tb * 32 + i], s));
                    row_data[r * cols + c + i] = *reinterpret_cast<uint8_t*>(&q);
                }
            }
        }
    }
}

// ---- versions 4 and 5 of the one-pass rowwise + columnwise kernel ----
// (Versions 2 and 3, register-resident predecessors, are described in crates/lowbit-kernels/NOTES.md; v4
// superseded them and they were removed.) One 256-thread CTA per 32-row x 256-column tile; each
// thread keeps 4 rows x 8 columns as raw bf16 in registers (lane l owns columns 8l..8l+7, warp w
// rows w, w+8, w+16, w+24). Column amaxes are reduced across the 8 warps in shared memory, row
// amaxes across the 4 lanes of a 1x32 block with shuffles, both on packed bf16 pairs (__habs2,
// then __hmax2, which ignores a NaN operand exactly as the f32 fmaxf amax does; bf16 -> f32 is
// exact, so the maxima are the same numbers). Loads are 16 bytes, data stores 8 bytes,
// coalesced for both copies, and the E4M3 conversions go two at a time (cvt...e4m3x2).
// v4: a CTA whose tile lies wholly inside the matrix (the CTA-uniform `interior` case) issues its
// four loads back-to-back with the streaming hint (ld.global.cs: read once) before any use. v5:
// a CTA owns two vertically adjacent tiles and issues all eight loads (128 bytes per thread)
// before quantizing the first, so the second tile's loads overlap the first tile's work.
// Same bytes as version 1.
// `vec` (host-checked): cols % 8 == 0 and x, row_data, col_data, col_scales aligned, so the
// 16-byte loads and 8-byte stores are legal; otherwise element-wise accesses.

// Loads the four rows (w, w+8, w+16, w+24) of the tile at r0 that this thread owns, raw bf16.
__device__ __forceinline__ void both_load(const __nv_bfloat16* __restrict__ x,
                                          unsigned long long rows, unsigned long long cols,
                                          unsigned long long r0, unsigned long long c, unsigned w,
                                          bool interior, unsigned vec, uint4 raw[4]) {
    if (interior) {
#pragma unroll
        for (int i = 0; i < 4; ++i)
            raw[i] = __ldcs(reinterpret_cast<const uint4*>(x + (r0 + w + 8 * i) * cols + c));
        return;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned long long r = r0 + w + 8 * i;
        raw[i] = make_uint4(0, 0, 0, 0);
        if (r < rows) {
            const __nv_bfloat16* src = x + r * cols + c;
            if (vec && c + 8 <= cols) {
                raw[i] = *reinterpret_cast<const uint4*>(src);
            } else {
                uint16_t* h = reinterpret_cast<uint16_t*>(&raw[i]);
                for (int j = 0; j < 8; ++j)
                    if (c + j < cols) h[j] = reinterpret_cast<const uint16_t*>(src)[j];
            }
        }
    }
}

// The amaxes, scales, codes and stores of one 32x256 tile held in `raw`; `camax` is this
// tile's 4 KB of shared memory (its readers and writers are separated by the barrier inside).
__device__ __forceinline__ void both_tile(const uint4 raw[4], __nv_bfloat162 (*camax)[256],
                                          uint8_t* __restrict__ row_data,
                                          uint8_t* __restrict__ row_scales,
                                          uint8_t* __restrict__ col_data,
                                          uint8_t* __restrict__ col_scales,
                                          unsigned long long rows, unsigned long long cols,
                                          unsigned long long r0, unsigned long long c,
                                          unsigned lane, unsigned w, unsigned vec) {
    const float rcp448 = __uint_as_float(0x3B124925u);
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
    float ramax[4];
    __nv_bfloat162 cm[4] = {zero2, zero2, zero2, zero2};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
        __nv_bfloat162 rm = zero2;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            __nv_bfloat162 a = __habs2(v[p]);
            cm[p] = __hmax2(cm[p], a);
            rm = __hmax2(rm, a);
        }
        ramax[i] = fmaxf(__low2float(rm), __high2float(rm));
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) camax[p][w * 32 + lane] = cm[p];
    __syncthreads();
    float cs[8];
    unsigned long long cscale = 0;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        __nv_bfloat162 m = camax[p][lane];
#pragma unroll
        for (int k = 1; k < 8; ++k) m = __hmax2(m, camax[p][k * 32 + lane]);
        uint8_t e0 = e8m0_round_up(__fmul_rn(__low2float(m), rcp448));
        uint8_t e1 = e8m0_round_up(__fmul_rn(__high2float(m), rcp448));
        cs[2 * p] = e8m0_rcp(e0);
        cs[2 * p + 1] = e8m0_rcp(e1);
        cscale |= ((unsigned long long)e0 | ((unsigned long long)e1 << 8)) << (16 * p);
    }
    if (w == 0 && c < cols) {
        uint8_t* dst = col_scales + (r0 / 32) * cols + c;
        if (vec && c + 8 <= cols) {
            *reinterpret_cast<unsigned long long*>(dst) = cscale;
        } else {
            for (int j = 0; j < 8; ++j)
                if (c + j < cols) dst[j] = (uint8_t)(cscale >> (8 * j));
        }
    }
    const unsigned long long nb = (cols + 31) / 32;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        unsigned long long r = r0 + w + 8 * i;
        float a = ramax[i];
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 1));
        a = fmaxf(a, __shfl_xor_sync(0xFFFFFFFFu, a, 2));
        uint8_t e = e8m0_round_up(__fmul_rn(a, rcp448));
        float s = e8m0_rcp(e);
        if (r >= rows || c >= cols) continue;
        if (lane % 4 == 0) row_scales[r * nb + c / 32] = e;
        const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw[i]);
        unsigned long long rq = 0, cq = 0;
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            float2 f = __bfloat1622float2(v[p]);
            __nv_fp8x2_storage_t q = __nv_cvt_float2_to_fp8x2(
                make_float2(__fmul_rn(f.x, s), __fmul_rn(f.y, s)), __NV_SATFINITE, __NV_E4M3);
            rq |= (unsigned long long)q << (16 * p);
            __nv_fp8x2_storage_t t = __nv_cvt_float2_to_fp8x2(
                make_float2(__fmul_rn(f.x, cs[2 * p]), __fmul_rn(f.y, cs[2 * p + 1])),
                __NV_SATFINITE, __NV_E4M3);
            cq |= (unsigned long long)t << (16 * p);
        }
        uint8_t* rdst = row_data + r * cols + c;
        uint8_t* cdst = col_data + r * cols + c;
        if (vec && c + 8 <= cols) {
            *reinterpret_cast<unsigned long long*>(rdst) = rq;
            *reinterpret_cast<unsigned long long*>(cdst) = cq;
        } else {
            for (int j = 0; j < 8; ++j) {
                if (c + j < cols) {
                    rdst[j] = (uint8_t)(rq >> (8 * j));
                    cdst[j] = (uint8_t)(cq >> (8 * j));
                }
            }
        }
    }
}

// Version 4's work for the tile (bx, by) (columns 256·bx.., rows 32·by..) of one matrix: its
// loads, then `both_tile`. `camax` is the CTA's 4 KB of shared memory. Shared by the
// single-matrix kernel and the many-matrix kernel, so both write the same bytes.
__device__ __forceinline__ void both_v4(const __nv_bfloat16* __restrict__ x,
                                        uint8_t* __restrict__ row_data,
                                        uint8_t* __restrict__ row_scales,
                                        uint8_t* __restrict__ col_data,
                                        uint8_t* __restrict__ col_scales,
                                        unsigned long long rows, unsigned long long cols,
                                        unsigned vec, unsigned long long bx,
                                        unsigned long long by, __nv_bfloat162 (*camax)[256]) {
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const unsigned long long r0 = by * 32;
    const unsigned long long c0 = bx * 256;
    const unsigned long long c = c0 + lane * 8;
    const bool interior = vec && r0 + 32 <= rows && c0 + 256 <= cols;
    uint4 raw[4];
    both_load(x, rows, cols, r0, c, w, interior, vec, raw);
    both_tile(raw, camax, row_data, row_scales, col_data, col_scales, rows, cols, r0, c, lane, w,
              vec);
}

// Version 4: one tile per CTA, grid (ceil(cols / 256), ceil(rows / 32)); the default.
extern "C" __global__ void __launch_bounds__(256, 4) mxfp8_both_e4m3_bf16_v4(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ row_data,
    uint8_t* __restrict__ row_scales,
    uint8_t* __restrict__ col_data,
    uint8_t* __restrict__ col_scales,
    unsigned long long rows,
    unsigned long long cols,
    unsigned vec) {
    __shared__ __nv_bfloat162 camax[4][256];
    both_v4(x, row_data, row_scales, col_data, col_scales, rows, cols, vec, blockIdx.x, blockIdx.y,
            camax);
}

// both_v4 on a launch table's row of addresses: x, row_data, row_scales, col_data,
// col_scales (the many-matrix kernels). Addresses read from a table are generic to the
// compiler, which then emits generic loads and stores (LD/ST); they are device allocations,
// and saying so gets the global ones (LDG/STG) that the single kernel's pointer parameters get.
__device__ __forceinline__ void both_v4_at(const unsigned long long* t, unsigned long long rows,
                                           unsigned long long cols, unsigned vec,
                                           unsigned long long bx, unsigned long long by,
                                           __nv_bfloat162 (*camax)[256]) {
    const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(t[0]);
    uint8_t* rd = reinterpret_cast<uint8_t*>(t[1]);
    uint8_t* rs = reinterpret_cast<uint8_t*>(t[2]);
    uint8_t* cd = reinterpret_cast<uint8_t*>(t[3]);
    uint8_t* cs = reinterpret_cast<uint8_t*>(t[4]);
    __builtin_assume(__isGlobal(x));
    __builtin_assume(__isGlobal(rd));
    __builtin_assume(__isGlobal(rs));
    __builtin_assume(__isGlobal(cd));
    __builtin_assume(__isGlobal(cs));
    both_v4(x, rd, rs, cd, cs, rows, cols, vec, bx, by, camax);
}

// Version 4 over many matrices in one launch (the re-quantization of every gathered weight:
// one launch instead of one per matrix, so the small matrices pay neither a launch each nor a
// ramp-up and tail each). The launch table travels in the kernel's parameter space (the
// constant bank), not in global memory: a CTA moves one 16 KB tile in ~5 us, and two dependent
// L2 reads to find its matrix (the first-CTA words, then its row) delayed its loads by ~1 us
// (1B's 112 matrices: 0.71x of a copy against 0.83-0.86x for one large matrix, H200); constant
// reads hit the SM's constant cache after the first CTAs. `first` holds the matrices' first CTA
// indices (ascending from 0; matrix i owns the CTAs [first[i], first[i + 1])), `rows` 9 words
// per matrix: x, row_data, row_scales, col_data, col_scales, rows, cols, the tiles across
// (ceil(cols / 256)) and `vec` (host-checked as for the single kernel). A CTA finds its matrix
// by binary search (CTA-uniform reads), turns its index within it into (bx, by) as the single
// kernel's grid would, and runs the same tile body: the bytes are those of one single-kernel
// launch per matrix. 1-D grid of the total CTA count; at most MXFP8_MANY_MAX matrices per
// launch (the host splits longer lists). The host checks that no output overlaps another
// matrix's input or outputs, so the order in which matrices run does not matter.
#define MXFP8_MANY_MAX 64
struct Mxfp8ManyParams {
    unsigned long long items;
    unsigned long long first[MXFP8_MANY_MAX];
    unsigned long long rows[MXFP8_MANY_MAX][9];
};
// The host passes exactly these bytes (quant.rs, MXFP8_MANY_MAX words of table).
static_assert(sizeof(Mxfp8ManyParams) == 8 * (1 + MXFP8_MANY_MAX * 10), "parameter layout");

extern "C" __global__ void __launch_bounds__(256, 4) mxfp8_both_e4m3_bf16_v4_many(
    const Mxfp8ManyParams p) {
    __shared__ __nv_bfloat162 camax[4][256];
    const unsigned long long b = blockIdx.x;
    unsigned lo = 0, hi = (unsigned)p.items;  // the last matrix whose first CTA is <= b
    while (hi - lo > 1) {
        const unsigned mid = (lo + hi) / 2;
        if (p.first[mid] <= b) lo = mid; else hi = mid;
    }
    const unsigned long long* t = p.rows[lo];
    const unsigned long long local = b - p.first[lo], gx = t[7];
    // 32-bit division where the tile index fits (always in practice): the 64-bit one is a long
    // emulated sequence per CTA.
    unsigned long long bx, by;
    if (local <= 0xFFFFFFFFull && gx <= 0xFFFFFFFFull) {
        const unsigned l32 = (unsigned)local, g32 = (unsigned)gx;
        bx = l32 % g32;
        by = l32 / g32;
    } else {
        bx = local % gx;
        by = local / gx;
    }
    both_v4_at(t, t[5], t[6], (unsigned)t[8], bx, by, camax);
}

// Version 4 over many matrices of one shape in one launch: grid (tiles across, tile rows,
// matrices), so a CTA's matrix is blockIdx.z and its tile (blockIdx.x, blockIdx.y) as in the
// single kernel's grid. Every parameter a CTA reads is uniform across the CTA and indexed by
// a grid index, so it comes from the constant bank through uniform registers, as the single
// kernel's pointer parameters do: no search at CTA start (the 1-D kernel above finds its
// matrix by a chain of dependent constant reads, and measured 0.77x of a copy against the
// single kernel's 0.83x on the same two large matrices, H200). `ptrs` holds x, row_data,
// row_scales, col_data, col_scales per matrix; rows, cols and `vec` are the group's (the host
// groups matrices by all three). At most MXFP8_SAME_MAX matrices per launch.
#define MXFP8_SAME_MAX 64
struct Mxfp8SameParams {
    unsigned long long rows, cols, vec, items;
    unsigned long long ptrs[MXFP8_SAME_MAX][5];
};
// The host passes exactly these bytes (quant.rs, MXFP8_SAME_MAX rows).
static_assert(sizeof(Mxfp8SameParams) == 8 * (4 + MXFP8_SAME_MAX * 5), "parameter layout");

extern "C" __global__ void __launch_bounds__(256, 4) mxfp8_both_e4m3_bf16_v4_same(
    const Mxfp8SameParams p) {
    __shared__ __nv_bfloat162 camax[4][256];
    both_v4_at(p.ptrs[blockIdx.z], p.rows, p.cols, (unsigned)p.vec, blockIdx.x, blockIdx.y,
               camax);
}

// Version 5: two vertically adjacent tiles per CTA (grid.y = ceil(rows / 64)), all eight loads
// in flight before the first tile is quantized; one shared-memory buffer per tile, so the
// tiles need no barrier between them.
extern "C" __global__ void __launch_bounds__(256, 3) mxfp8_both_e4m3_bf16_v5(
    const __nv_bfloat16* __restrict__ x,
    uint8_t* __restrict__ row_data,
    uint8_t* __restrict__ row_scales,
    uint8_t* __restrict__ col_data,
    uint8_t* __restrict__ col_scales,
    unsigned long long rows,
    unsigned long long cols,
    unsigned vec) {
    __shared__ __nv_bfloat162 camax[2][4][256];
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const unsigned long long r0 = (unsigned long long)blockIdx.y * 64;
    const unsigned long long c0 = (unsigned long long)blockIdx.x * 256;
    const unsigned long long c = c0 + lane * 8;
    const bool interior = vec && r0 + 64 <= rows && c0 + 256 <= cols;
    uint4 a[4], b[4];
    both_load(x, rows, cols, r0, c, w, interior, vec, a);
    both_load(x, rows, cols, r0 + 32, c, w, interior, vec, b);
    both_tile(a, camax[0], row_data, row_scales, col_data, col_scales, rows, cols, r0, c, lane, w,
              vec);
    if (r0 + 32 < rows)
        both_tile(b, camax[1], row_data, row_scales, col_data, col_scales, rows, cols, r0 + 32, c,
                  lane, w, vec);
}
