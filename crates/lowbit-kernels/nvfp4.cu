// NVFP4 variants of lowbit-device's CUDA backend that crates/lowbit-kernels/ops.cu does not cover: 2D (16x16)
// scaling with its tile-amax pass, the transposed columnwise copy of any row count, stochastic
// rounding (Philox4x32-10, addressed by (seed, copy, element index)), the 16-point random
// Hadamard transform of the columnwise copy and its dequantization, and the completion of
// gathered 2D weights (`nvfp4_finish_2d`). Every kernel reproduces lowbit_formats::nvfp4 bit for
// bit: f32 operations one at a time through the _rn intrinsics (never contracted into FMA),
// conversions as the library's integer code, the Hadamard sums in the library's index order.
//
// Kernel names carry the prefix `nvfp4x_` (the backend looks kernels up by name across every
// loaded module). The whole-tensor amax (`max_abs_bits`), the max of reduced tile amaxes
// (`u32_max_many_p`) and the tensor factors (`nvfp4_params`) are crates/lowbit-kernels/ops.cu's, launched from the same
// backend. Views are raw byte addresses; dtype codes: 0 = f32, 1 = bf16, 2 = f16.

#include <stdint.h>

#include "include/lowbit_convert.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// The value of an E2M1 nibble (lowbit_formats::scalar::E2M1_VALUES) from its bits.
__device__ __forceinline__ float e2m1_value(uint32_t n) {
    uint32_t m = n & 7u;
    uint32_t bits = m < 2u ? (m ? 0x3F000000u : 0u) : ((((m >> 1) + 126u) << 23) | ((m & 1u) << 22));
    return __uint_as_float(bits | ((n & 8u) << 28));
}

// The E2M1 grid step below |v| (0.5 below 2, 1 below 4, else 2).
__device__ __forceinline__ float sr_step(float v) {
    return v < 2.0f ? 0.5f : (v < 4.0f ? 1.0f : 2.0f);
}

// lowbit_formats::nvfp4::e2m1_stochastic: t = |x| + (byte/256)·step(|x|),
// q = min(floor(t/step(t))·step(t), 6), sign copied; NaN -> +6.
__device__ __forceinline__ uint32_t e2m1_stochastic(float x, uint32_t rbyte) {
    if (x != x) return 7u;
    float a = fabsf(x);
    float t = __fadd_rn(a, __fmul_rn(__fdiv_rn((float)rbyte, 256.0f), sr_step(a)));
    float st = sr_step(t);
    float q = fminf(__fmul_rn(floorf(__fdiv_rn(t, st)), st), 6.0f);
    return e2m1_code(q) | ((__float_as_uint(x) >> 28) & 0x8u);
}

// ---- Philox4x32-10 (lowbit_formats::rng) ----

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0);
    }
    return c;
}

// The 16 random bytes of elements 16·g .. 16·g + 16 of `stream`: counter [g lo, g hi, stream, 0],
// key = the seed's words, bytes little-endian in word order.
__device__ __forceinline__ uint4 random_group(u64 g, uint32_t stream, uint32_t k0, uint32_t k1) {
    return philox4x32_10(make_uint4((uint32_t)g, (uint32_t)(g >> 32), stream, 0u), k0, k1);
}

__device__ __forceinline__ uint32_t word_of(uint4 w, uint32_t k) {
    return k == 0 ? w.x : (k == 1 ? w.y : (k == 2 ? w.z : w.w));
}

// The random bytes of the (up to) 16 elements first .. first + 16 of `stream`.
__device__ __forceinline__ void random_bytes(u64 first, uint32_t stream, uint32_t k0, uint32_t k1,
                                             uint32_t bytes[16]) {
    u64 g0 = first / 16;
    uint32_t off = (uint32_t)(first % 16);
    uint4 w0 = random_group(g0, stream, k0, k1);
    uint4 w1 = off != 0 ? random_group(g0 + 1, stream, k0, k1) : w0;
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i) {
        uint32_t o = off + i;
        uint4 w = o < 16 ? w0 : w1;
        uint32_t b = o % 16;
        bytes[i] = (word_of(w, b / 4) >> (8 * (b % 4))) & 0xFFu;
    }
}

// ---- the 16-point random Hadamard transform (lowbit_formats::hadamard) ----

// TE's sign vector as a mask: bit i set when s_i = -1.
#define RHT_SIGN_MASK 0xD7E8u

// Whether A[i][j] = s_i · (-1)^popcount(i & j) / 4 is negative (constant after unrolling).
__device__ __forceinline__ bool rht_negative(uint32_t i, uint32_t j) {
    return (((RHT_SIGN_MASK >> i) & 1u) ^ (__popc(i & j) & 1u)) != 0;
}

// y_j = bf16(sum_i x_i · A[i][j]), accumulated in f32 from +0 in index order. Each product is
// formed as ±(x_i · 0.25): round to nearest even is symmetric in sign, so -(x · 0.25) is the
// same number as x · (-0.25) (NaN payloads aside, which no output depends on), and the sign
// folds into the addition.
__device__ __forceinline__ void rht16(const float x[16], float y[16]) {
    float q[16];
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i) q[i] = __fmul_rn(x[i], 0.25f);
#pragma unroll
    for (uint32_t j = 0; j < 16; ++j) {
        float acc = 0.0f;
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i) acc = __fadd_rn(acc, rht_negative(i, j) ? -q[i] : q[i]);
        y[j] = bf16_bits_to_f32(f32_to_bf16_bits(acc));
    }
}

// x86's float product where NaN is involved (the first NaN operand is returned quieted, an
// invalid operation gives the negative default NaN), so dequantized NaNs keep the CPU's payloads
// where cheap (the contract promises NaN-ness only).
__device__ __forceinline__ float mul_x86_nan(float a, float b) {
    if (a != a) return __uint_as_float(__float_as_uint(a) | 0x400000u);
    if (b != b) return __uint_as_float(__float_as_uint(b) | 0x400000u);
    float p = __fmul_rn(a, b);
    return p != p ? __uint_as_float(0xFFC00000u) : p;
}

// ---- the 16x16 tile amax pass (2D scales) ----

__device__ __forceinline__ void block_max_atomic(uint32_t m, uint32_t* __restrict__ out) {
    __shared__ uint32_t warp_max[32];
    for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
        if (m != 0) atomicMax(out, m);
    }
}

// 16x16 tile amaxes of a row-major rows x cols matrix: tiles[tr, tc] (u32 bits of the f32
// amax, NaN ignored) and their max into global[0]. Blocks of 256 threads, one column each; grid
// x covers the columns (256 per block), grid y strides over the tile rows. Each half-warp holds
// one tile column and reduces it with shuffles.
extern "C" __global__ void nvfp4x_tile_amax(const uint8_t* __restrict__ x, uint32_t xd, u64 rows,
                                            u64 cols, uint32_t* __restrict__ tiles,
                                            uint32_t* __restrict__ global) {
    u64 tr = (rows + 15) / 16, tc = (cols + 15) / 16;
    u64 c = (u64)blockIdx.x * 256 + threadIdx.x;
    uint32_t gm = 0;
    for (u64 t = blockIdx.y; t < tr; t += gridDim.y) {
        uint32_t m = 0;
        if (c < cols) {
            u64 r1 = t * 16 + 16 < rows ? t * 16 + 16 : rows;
            for (u64 r = t * 16; r < r1; ++r) m = max(m, abs_bits_nan_zero(load(x, xd, r * cols + c)));
        }
        for (int off = 8; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
        if ((threadIdx.x & 15) == 0 && c < cols) tiles[t * tc + c / 16] = m;
        gm = max(gm, m);
    }
    block_max_atomic(gm, global);
}

// ---- quantization ----

// Encodes `len` (<= 16) values with multiplier m (round to nearest, or stochastic with the
// bytes `rb` when `sr`) into packed bytes (element 2j in the low nibble of byte j; an odd tail
// leaves the high nibble 0, bytes past the block's end are 0).
__device__ __forceinline__ unsigned long long encode_block(const float f[16], uint32_t len, float m,
                                                           bool sr, const uint32_t rb[16]) {
    unsigned long long packed = 0;
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i) {
        float a = __fmul_rn(f[i], m);
        uint32_t code = sr ? e2m1_stochastic(a, rb[i]) : e2m1_code(a);
        if (i < len) packed |= (unsigned long long)code << (4 * i);
    }
    return packed;
}

// Stores the ceil(len/2) bytes of a packed block: one 8-byte store when `vec` (a whole block at
// an 8-byte aligned address), else byte by byte.
__device__ __forceinline__ void store_block(uint8_t* __restrict__ out, unsigned long long packed,
                                            uint32_t len, bool vec) {
    if (vec) {
        *reinterpret_cast<unsigned long long*>(out) = packed;
        return;
    }
#pragma unroll
    for (uint32_t j = 0; j < 8; ++j)
        if (2 * j < len) out[j] = (uint8_t)(packed >> (8 * j));
}

// The rowwise copy: one thread per 1x16 block (r, kb); grid x covers a row's blocks, grid y
// strides over the rows. Scales come from the 16x16 tile amaxes `tiles` when non-null, else from
// the block amax; `params` holds k and the reciprocal table. With `sr`, stochastic rounding from
// stream 0 of the seed (k0, k1) at element index r·cols + c. data: rows x ceil(cols/2), scales:
// rows x ceil(cols/16).
extern "C" __global__ void nvfp4x_rows(const uint8_t* __restrict__ x, uint32_t xd,
                                       uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                       const float* __restrict__ params,
                                       const uint32_t* __restrict__ tiles, u64 rows, u64 cols,
                                       uint32_t sr, uint32_t k0, uint32_t k1, uint32_t vec) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 nb = (cols + 15) / 16, rbytes = (cols + 1) / 2;
    u64 kb = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (kb >= nb) return;
    u64 c0 = kb * 16;
    uint32_t len = (uint32_t)(cols - c0 < 16 ? cols - c0 : 16);
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        float f[16];
        uint32_t amax = 0;
        if (vec) {
            // bf16, cols % 16 == 0, x 16-byte aligned (host-checked): two 16-byte loads.
            const uint4* src = reinterpret_cast<const uint4*>(x + 2 * (r * cols + c0));
            uint4 raw[2] = {src[0], src[1]};
            const uint16_t* h = reinterpret_cast<const uint16_t*>(raw);
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i) f[i] = bf16_bits_to_f32(h[i]);
        } else {
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i) f[i] = i < len ? load(x, xd, r * cols + c0 + i) : 0.0f;
        }
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i) amax = max(amax, abs_bits_nan_zero(f[i]));
        if (tiles) amax = tiles[(r / 16) * nb + kb];
        uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
        scales[r * nb + kb] = (uint8_t)sf;
        uint32_t rb[16];
        if (sr) {
            random_bytes(r * cols + c0, 0u, k0, k1, rb);
        } else {
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i) rb[i] = 0;
        }
        unsigned long long packed = encode_block(f, len, rcp[sf], sr != 0, rb);
        store_block(data + r * rbytes + kb * 8, packed, len, vec != 0);
    }
}

// The 16 values of block kb of row c of the columnwise copy (rows kb·16 .. of column c of X;
// `len` of them, zeros after), Hadamard-transformed when `rht` (then len == 16).
__device__ __forceinline__ void column_block(const uint8_t* __restrict__ x, uint32_t xd, u64 cols,
                                             u64 c, u64 kb, uint32_t len, uint32_t rht,
                                             float f[16]) {
    float v[16];
#pragma unroll
    for (uint32_t i = 0; i < 16; ++i) v[i] = i < len ? load(x, xd, (kb * 16 + i) * cols + c) : 0.0f;
    if (rht) {
        rht16(v, f);
    } else {
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i) f[i] = v[i];
    }
}

// Global amax of the Hadamard-transformed columnwise copy (rows % 16 == 0) into out[0]: one
// thread per 16-row group of a column (item = group · cols + c). Blocks of 256 threads.
extern "C" __global__ void nvfp4x_rht_amax(const uint8_t* __restrict__ x, uint32_t xd, u64 rows,
                                           u64 cols, uint32_t* __restrict__ out) {
    uint32_t m = 0;
    GRID_STRIDE(item, (rows / 16) * cols) {
        float f[16];
        column_block(x, xd, cols, item % cols, item / cols, 16, 1, f);
#pragma unroll
        for (int i = 0; i < 16; ++i) m = max(m, abs_bits_nan_zero(f[i]));
    }
    block_max_atomic(m, out);
}

// The columnwise copy (the rowwise copy of Xᵀ, optionally Hadamard-transformed): one thread per
// block (c, kb), item = kb · cols + c, so a warp's loads are consecutive columns. Scales from the
// tiles (tile (kb, c / 16) of X) or the block amax; stochastic rounding from stream 1 at element
// index c·rows + r. data: cols x ceil(rows/2), scales: cols x ceil(rows/16).
extern "C" __global__ void nvfp4x_cols(const uint8_t* __restrict__ x, uint32_t xd,
                                       uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                       const float* __restrict__ params,
                                       const uint32_t* __restrict__ tiles, u64 rows, u64 cols,
                                       uint32_t rht, uint32_t sr, uint32_t k0, uint32_t k1,
                                       uint32_t vec) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 nbr = (rows + 15) / 16, rbytes = (rows + 1) / 2, tc = (cols + 15) / 16;
    GRID_STRIDE(item, nbr * cols) {
        u64 kb = item / cols, c = item % cols;
        uint32_t len = (uint32_t)(rows - kb * 16 < 16 ? rows - kb * 16 : 16);
        float f[16];
        column_block(x, xd, cols, c, kb, len, rht, f);
        uint32_t amax = 0;
#pragma unroll
        for (int i = 0; i < 16; ++i) amax = max(amax, abs_bits_nan_zero(f[i]));
        if (tiles) amax = tiles[kb * tc + c / 16];
        uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
        scales[c * nbr + kb] = (uint8_t)sf;
        uint32_t rb[16];
        if (sr) {
            random_bytes(c * rows + kb * 16, 1u, k0, k1, rb);
        } else {
#pragma unroll
            for (uint32_t i = 0; i < 16; ++i) rb[i] = 0;
        }
        unsigned long long packed = encode_block(f, len, rcp[sf], sr != 0, rb);
        // 8-byte stores when `vec` (host-checked: rows % 16 == 0, data 8-byte aligned).
        store_block(data + c * rbytes + kb * 8, packed, len, vec != 0);
    }
}

// ---- dequantization of a Hadamard-transformed columnwise copy ----

// dst[r, c] (rows % 16 == 0) from the columnwise plane [cols, rows/2] with scales
// [cols, rows/16]: y = q · ((float(sf) · amax) · factor_inv) (TE's order), then per 16-row group
// x_i = sum_j y_j · A[i][j] in f32 from +0 in index order (no bf16 rounding; products formed as
// in rht16), rounded to dst's
// dtype. A NaN in the sums keeps its NaN-ness, not x86's payload (outside the contract). One thread per group (item = kb · cols + c). `table` holds the 256 E4M3 values.
extern "C" __global__ void nvfp4x_dequantize_rht(const uint8_t* __restrict__ q,
                                                 const uint8_t* __restrict__ scales,
                                                 const float* __restrict__ table,
                                                 uint8_t* __restrict__ dst, uint32_t dd, u64 rows,
                                                 u64 cols, float amax, float factor_inv) {
    u64 nbr = rows / 16, rbytes = rows / 2;
    GRID_STRIDE(item, nbr * cols) {
        u64 kb = item / cols, c = item % cols;
        float fs = mul_x86_nan(mul_x86_nan(table[scales[c * nbr + kb]], amax), factor_inv);
        float y[16];
#pragma unroll
        for (uint32_t j = 0; j < 8; ++j) {
            uint8_t byte = q[c * rbytes + kb * 8 + j];
            y[2 * j] = mul_x86_nan(e2m1_value(byte & 0xFu), fs);
            y[2 * j + 1] = mul_x86_nan(e2m1_value(byte >> 4), fs);
        }
        float q[16];
#pragma unroll
        for (uint32_t j = 0; j < 16; ++j) q[j] = __fmul_rn(y[j], 0.25f);
#pragma unroll
        for (uint32_t i = 0; i < 16; ++i) {
            float acc = 0.0f;
#pragma unroll
            for (uint32_t j = 0; j < 16; ++j) acc = __fadd_rn(acc, rht_negative(i, j) ? -q[j] : q[j]);
            store(dst, dd, (kb * 16 + i) * cols + c, acc);
        }
    }
}

// ---- completion of gathered 2D weights (lowbit_formats::nvfp4::sharded::from_rowwise_2d) ----

// From the rowwise packed bytes (rows x cols/2, cols even) and the reduced tile amaxes (f32
// [tr, tc]) with the tensor factors `params` (from their raw-bit max): the rowwise scales
// [rows, tc], the columnwise data [cols, ceil(rows/2)] and scales [cols, tr]. One thread per
// output byte, in that order.
extern "C" __global__ void nvfp4x_finish_2d(const uint8_t* __restrict__ rowwise,
                                            const float* __restrict__ tiles,
                                            const float* __restrict__ params, u64 rows, u64 cols,
                                            uint8_t* __restrict__ row_scales,
                                            uint8_t* __restrict__ col_data,
                                            uint8_t* __restrict__ col_scales) {
    const float k = params[0];
    u64 tr = (rows + 15) / 16, tc = (cols + 15) / 16, cb = (rows + 1) / 2;
    u64 nrs = rows * tc, ncd = cols * cb, ncs = cols * tr;
    GRID_STRIDE(i, nrs + ncd + ncs) {
        if (i < nrs) {
            u64 r = i / tc, kb = i % tc;
            row_scales[i] = (uint8_t)e4m3_code(__fmul_rn(tiles[(r / 16) * tc + kb], k));
        } else if (i < nrs + ncd) {
            u64 j = i - nrs;
            u64 c = j / cb, r0 = 2 * (j % cb);
            u64 e0 = r0 * cols + c;
            uint32_t lo = (rowwise[e0 / 2] >> (4 * (e0 % 2))) & 0xFu;
            uint32_t hi = 0;
            if (r0 + 1 < rows) {
                u64 e1 = e0 + cols;
                hi = (rowwise[e1 / 2] >> (4 * (e1 % 2))) & 0xFu;
            }
            col_data[j] = (uint8_t)(lo | (hi << 4));
        } else {
            u64 j = i - nrs - ncd;
            u64 c = j / tr, kb = j % tr;
            col_scales[j] = (uint8_t)e4m3_code(__fmul_rn(tiles[kb * tc + c / 16], k));
        }
    }
}

// The NVFP4 encode factor k = fl32(S_enc · fl32(1/6)) from a matrix's global amax word,
// exactly as ops.cu's nvfp4_params makes params[0]: S_enc = min(2688 / amax, FLT_MAX), or 1
// when amax == 0 or S_enc == 0.
__device__ __forceinline__ float nvfp4_k_from_amax(const uint32_t* __restrict__ amax_word) {
    const float flt_max = __uint_as_float(0x7F7FFFFFu);
    float amax = __uint_as_float(*amax_word);
    float s_enc = fminf(__fdiv_rn(2688.0f, amax), flt_max);
    if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    return __fmul_rn(s_enc, __uint_as_float(0x3E2AAAABu));
}

// Rows r .. r + 31 of columns c .. c + 7 of packed rowwise codes (`wpr` words a row; c % 8 == 0)
// as the columnwise codes of those 8 columns: col[j] holds column c + j's 32 nibbles, row r's
// in the low nibble of its first byte (32 word loads, the 8x32 nibble transpose in registers).
__device__ __forceinline__ void nibble_columns_32x8(const uint32_t* __restrict__ rowwise, u64 wpr,
                                                    u64 r, u64 c, uint4 col[8]) {
    uint32_t in[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) in[i] = __ldg(rowwise + (r + i) * wpr + c / 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        uint32_t o[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t v = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) v |= ((in[8 * q + i] >> (4 * j)) & 0xFu) << (4 * i);
            o[q] = v;
        }
        col[j] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// The work of one thread of nvfp4x_finish_2d_many: the 32 rows x 8 columns of the 64x512 block
// (bx, by) of one matrix that lane `lane` of warp `w` takes, codes and scale bytes (the
// same-shape kernels below write 128-byte runs of codes per column and whole sectors of scales
// instead: here each scale byte shares its sector with CTAs far apart in time).
__device__ __forceinline__ void finish_2d_block(const uint32_t* __restrict__ rowwise,
                                                const float* __restrict__ tiles,
                                                const uint32_t* __restrict__ amax_word, u64 rows,
                                                u64 cols, uint8_t* __restrict__ row_scales,
                                                uint8_t* __restrict__ col_data,
                                                uint8_t* __restrict__ col_scales, u64 bx, u64 by) {
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u64 c0 = bx * 512 + w * 128 + (lane % 16) * 8;
    const u64 r0 = by * 64 + (lane / 16) * 32;
    if (c0 >= cols || r0 >= rows) return;
    const float k = nvfp4_k_from_amax(amax_word);
    const u64 wpr = cols / 8, tr = rows / 16, tc = (cols + 15) / 16;
    uint4 col[8];
    nibble_columns_32x8(rowwise, wpr, r0, c0, col);
#pragma unroll
    for (int j = 0; j < 8; ++j)
        *reinterpret_cast<uint4*>(col_data + (c0 + j) * (rows / 2) + r0 / 2) = col[j];
    const u64 kb = r0 / 16, tcol = c0 / 16;
    const uint8_t s0 = (uint8_t)e4m3_code(__fmul_rn(tiles[kb * tc + tcol], k));
    const uint8_t s1 = (uint8_t)e4m3_code(__fmul_rn(tiles[(kb + 1) * tc + tcol], k));
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        col_scales[(c0 + j) * tr + kb] = s0;
        col_scales[(c0 + j) * tr + kb + 1] = s1;
    }
    const bool even = (c0 / 8) % 2 == 0;
    if (even) {
#pragma unroll
        for (int i = 0; i < 16; ++i) row_scales[(r0 + i) * tc + tcol] = s0;
    }
    if (!even || c0 + 8 >= cols) {
#pragma unroll
        for (int i = 16; i < 32; ++i) row_scales[(r0 + i) * tc + tcol] = s1;
    }
}

// nvfp4x_finish_2d over many matrices in one launch (the completion of every gathered 2D weight:
// one launch instead of one per matrix, and no host round trip per matrix: each matrix's global
// amax is a device word, the max of its tile amaxes from ops.cu's `u32_max_many`, and k is made
// from it here exactly as `nvfp4_params` makes params[0]). `table` holds, for `items` matrices,
// first their first CTA indices (ascending from 0), then 9 words per matrix: rowwise, tiles,
// the amax word's address, rows, cols, row_scales, col_data, col_scales and the CTAs across
// (ceil(cols / 512)). Host-checked per matrix: rows % 32 == 0, cols % 8 == 0, rowwise 4-byte
// and col_data 16-byte aligned, every view as for nvfp4x_finish_2d, no output overlapping
// another matrix's views. A thread takes 32 rows x 8 columns: 32 coalesced word loads (lanes
// 0-15 read 64 contiguous bytes of a row, lanes 16-31 the row 32 below), the 8x32 nibble
// transpose in registers, and per column one 16-byte store (two lanes fill a column's
// 32-byte sector); the two tile rows' scales go to the 8 columns' columnwise scales and (by
// the even word column, or both tile rows when it is the last) to the 32 rows' rowwise scales.
// A CTA (4 warps side by side) covers 64 rows x 512 columns. Same bytes as nvfp4x_finish_2d.
extern "C" __global__ void __launch_bounds__(128) nvfp4x_finish_2d_many(
    const u64* __restrict__ table, unsigned items) {
    const u64 b = blockIdx.x;
    unsigned lo = 0, hi = items;  // the last matrix whose first CTA is <= b (first[0] == 0)
    while (hi - lo > 1) {
        unsigned mid = (lo + hi) / 2;
        if (table[mid] <= b) lo = mid; else hi = mid;
    }
    const u64* t = table + items + 9ull * lo;
    const u64 local = b - table[lo], gx = t[8];
    const uint32_t* rowwise = reinterpret_cast<const uint32_t*>(t[0]);
    const float* tiles = reinterpret_cast<const float*>(t[1]);
    const uint32_t* amax = reinterpret_cast<const uint32_t*>(t[2]);
    uint8_t* row_scales = reinterpret_cast<uint8_t*>(t[5]);
    uint8_t* col_data = reinterpret_cast<uint8_t*>(t[6]);
    uint8_t* col_scales = reinterpret_cast<uint8_t*>(t[7]);
    // Device allocations: said so, the compiler emits global loads and stores (LDG/STG)
    // instead of generic ones for addresses read from the table.
    __builtin_assume(__isGlobal(rowwise));
    __builtin_assume(__isGlobal(tiles));
    __builtin_assume(__isGlobal(amax));
    __builtin_assume(__isGlobal(row_scales));
    __builtin_assume(__isGlobal(col_data));
    __builtin_assume(__isGlobal(col_scales));
    finish_2d_block(rowwise, tiles, amax, t[3], t[4], row_scales, col_data, col_scales,
                    local % gx, local / gx);
}

// nvfp4x_finish_2d_many for matrices of one shape: grid (ceil(cols / 256), ceil(rows / 256),
// matrices), the matrix blockIdx.z, its pointers in the kernel's parameters (uniform constant
// reads; the 1-D kernel above finds its matrix by a binary search over a global table, a
// chain of dependent L2 reads at every CTA's start). `ptrs` per matrix: rowwise, tiles, the
// amax word, row_scales, col_data, col_scales. Same host checks and bytes as the 1-D kernel.
#define FINISH2D_SAME_MAX 64
struct Finish2dSameParams {
    u64 rows, cols, items, pad;
    u64 ptrs[FINISH2D_SAME_MAX][6];
};
// The host passes exactly these bytes (nvfp4.rs, FINISH2D_SAME_MAX rows).
static_assert(sizeof(Finish2dSameParams) == 8 * (4 + FINISH2D_SAME_MAX * 6), "parameter layout");

// A matrix's views from its row of a launch's parameter table (blockIdx.z's in a same-shape
// launch). Device allocations: said so, the compiler
// emits global loads and stores (LDG/STG) instead of generic ones for addresses read from the
// parameters.
struct Finish2dViews {
    const uint32_t* rowwise;
    const float* tiles;
    const uint32_t* amax_word;
    uint8_t* row_scales;
    uint8_t* col_data;
    uint8_t* col_scales;
};

__device__ __forceinline__ Finish2dViews finish2d_views_at(const u64* t) {
    Finish2dViews v;
    v.rowwise = reinterpret_cast<const uint32_t*>(t[0]);
    v.tiles = reinterpret_cast<const float*>(t[1]);
    v.amax_word = reinterpret_cast<const uint32_t*>(t[2]);
    v.row_scales = reinterpret_cast<uint8_t*>(t[3]);
    v.col_data = reinterpret_cast<uint8_t*>(t[4]);
    v.col_scales = reinterpret_cast<uint8_t*>(t[5]);
    __builtin_assume(__isGlobal(v.rowwise));
    __builtin_assume(__isGlobal(v.tiles));
    __builtin_assume(__isGlobal(v.amax_word));
    __builtin_assume(__isGlobal(v.row_scales));
    __builtin_assume(__isGlobal(v.col_data));
    __builtin_assume(__isGlobal(v.col_scales));
    return v;
}

__device__ __forceinline__ Finish2dViews finish2d_views(const Finish2dSameParams& p) {
    return finish2d_views_at(p.ptrs[blockIdx.z]);
}

// The shared codes tile of the 256x256 tile at (r0, c0) out to the columnwise data: column cl's
// 16-byte chunk q (its rows r0 + 32q ..) was stored at chunk q ^ ((cl / 8) % 8); every column's
// 128 bytes go out as 8 lanes' 16-byte stores. Chunks past `rows`, columns past `cols` are not
// stored.
__device__ __forceinline__ void finish2d_store_codes(const uint4 (*out)[8],
                                                     uint8_t* __restrict__ col_data, u64 rows,
                                                     u64 cols, u64 r0, u64 c0) {
    const u64 rb = rows / 2;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const unsigned g = 256 * k + threadIdx.x, cl = g / 8, q = g % 8;
        const u64 cc = c0 + cl, rr = r0 + 32 * q;
        if (cc < cols && rr < rows)
            *reinterpret_cast<uint4*>(col_data + cc * rb + rr / 2) = out[cl][q ^ ((cl / 8) % 8)];
    }
}

// The 16 scale bytes of `src` (shared memory, 16-byte aligned) for positions at .. at + 15 of
// a row or column of `len` scale bytes, to `o` (position `at`; at < len): one 16-byte store
// when all 16 lie inside and `o` is aligned, else the ones inside one by one.
__device__ __forceinline__ void store_scales16(uint8_t* o, const uint8_t* src, u64 at, u64 len) {
    if (at + 16 <= len && ((uintptr_t)o & 15u) == 0) {
        *reinterpret_cast<uint4*>(o) = *reinterpret_cast<const uint4*>(src);
    } else {
        for (unsigned j = 0; j < 16 && at + j < len; ++j) o[j] = src[j];
    }
}

extern "C" __global__ void __launch_bounds__(256) nvfp4x_finish_2d_same(
    const Finish2dSameParams p) {
    // The columnwise codes of a 256-row x 256-column tile of matrix blockIdx.z (its scales:
    // nvfp4x_scales_2d_same). Thread (lane, warp) loads the word of columns 8·lane .. + 7 of
    // tile rows 32·warp .. + 31 (each warp load reads 128 contiguous bytes of one row),
    // transposes the 32x8 nibbles in registers (nibble_columns_32x8, as finish_2d_block), and
    // puts each column's 16 bytes into a shared tile of 256 columns x 8 chunks of 16 bytes (chunk `warp` of the
    // column, stored at chunk warp ^ (lane % 8): the 8 lanes of a 16-byte phase then meet 8
    // distinct bank groups); after a barrier every column's 128 bytes (256 rows) go out as 8
    // lanes' 16-byte stores, a 128-byte run per column where finish_2d_block writes 32 bytes.
    // Chunks past `rows` or columns past `cols` are neither loaded nor stored (rows % 32 == 0,
    // cols % 8 == 0: a chunk or a word lies wholly inside or outside).
    __shared__ uint4 out[256][8];
    const Finish2dViews v = finish2d_views(p);
    const u64 rows = p.rows, cols = p.cols, wpr = cols / 8;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 r0 = (u64)blockIdx.y * 256, c0 = (u64)blockIdx.x * 256;
    const u64 r = r0 + 32 * warp, c = c0 + 8 * lane;
    if (r < rows && c < cols) {
        uint4 col[8];
        nibble_columns_32x8(v.rowwise, wpr, r, c, col);
#pragma unroll
        for (int j = 0; j < 8; ++j) out[8 * lane + j][warp ^ (lane % 8)] = col[j];
    }
    __syncthreads();
    finish2d_store_codes(out, v.col_data, rows, cols, r0, c0);
}

// The 8x8 nibble transpose of a[0..7] in place (nibble j of word i <-> nibble i of word j): three
// exchange steps of the recursive block transpose, 16-bit halves between words 4 apart and bytes
// between words 2 apart by PRMT, nibbles between neighbours by shifts and masks (36 operations
// where nibble_columns_32x8's per-nibble moves take ~170).
__device__ __forceinline__ void nibble_transpose_8x8(uint32_t a[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint32_t x = a[i], y = a[i + 4];
        a[i] = __byte_perm(x, y, 0x5410);
        a[i + 4] = __byte_perm(x, y, 0x7632);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        if (i & 2) continue;
        const uint32_t x = a[i], y = a[i + 2];
        a[i] = __byte_perm(x, y, 0x6240);
        a[i + 2] = __byte_perm(x, y, 0x7351);
    }
#pragma unroll
    for (int i = 0; i < 8; i += 2) {
        const uint32_t t = ((a[i] >> 4) ^ a[i + 1]) & 0x0F0F0F0Fu;
        a[i + 1] ^= t;
        a[i] ^= t << 4;
    }
}

// The 32 words of rows r .. r + 31, columns c .. c + 7 (8 nibbles each) of packed rowwise codes
// with `wpr` words a row: a warp's load reads 128 contiguous bytes of one row.
__device__ __forceinline__ void finish2d_load(const uint32_t* __restrict__ rowwise, u64 wpr, u64 r,
                                              u64 c, uint32_t in[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) in[i] = __ldg(rowwise + (r + i) * wpr + c / 8);
}

// Those words as columns (nibble_transpose_8x8 per 8 rows: word q of column j is block q's word
// j) into the shared codes tile: column 8·lane + j's chunk `warp` at chunk warp ^ (lane % 8), so
// the 8 lanes of a 16-byte phase meet 8 distinct bank groups (finish2d_store_codes reads it).
__device__ __forceinline__ void finish2d_stash(uint32_t in[32], uint4 (*out)[8], unsigned lane,
                                               unsigned warp) {
#pragma unroll
    for (int q = 0; q < 4; ++q) nibble_transpose_8x8(&in[8 * q]);
#pragma unroll
    for (int j = 0; j < 8; ++j)
        out[8 * lane + j][warp ^ (lane % 8)] = make_uint4(in[j], in[8 + j], in[16 + j], in[24 + j]);
}

// nvfp4x_finish_2d_same with both scale copies in the same launch (version 4): the codes of the
// 256x256 tile as version 3 writes them, the nibbles transposed by nibble_transpose_8x8 (one
// 8x8 block per 8 rows: word q of column j is block q's word j); then thread t makes the scale
// of tile (t / 16, t % 16) of the CTA's 16x16 tiles once (version 3's scales kernel made each
// of its 512 scale bytes from the tile amax anew) and writes the 16 row-scale bytes of row
// r0 + t (its tile row's codes) and the 16 column-scale bytes of column c0 + t (its tile
// column's), one 16-byte store each where whole and aligned (tc and tr multiples of 16), else
// byte by byte. Same parameters, grid and bytes as version 3's two kernels.
extern "C" __global__ void __launch_bounds__(256) nvfp4x_finish_2d_same_v4(
    const Finish2dSameParams p) {
    __shared__ uint4 out[256][8];
    __shared__ __align__(16) uint8_t sc[16][16];   // [tile row][tile column]
    __shared__ __align__(16) uint8_t sct[16][16];  // [tile column][tile row]
    const Finish2dViews v = finish2d_views(p);
    const u64 rows = p.rows, cols = p.cols, wpr = cols / 8;
    const u64 tr = rows / 16, tc = (cols + 15) / 16;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 r0 = (u64)blockIdx.y * 256, c0 = (u64)blockIdx.x * 256;
    const u64 r = r0 + 32 * warp, c = c0 + 8 * lane;
    if (r < rows && c < cols) {
        uint32_t in[32];
        finish2d_load(v.rowwise, wpr, r, c, in);
        finish2d_stash(in, out, lane, warp);
    }
    {
        // This thread's tile of the CTA's 16x16 tiles (zero where outside: never stored).
        const unsigned a = threadIdx.x / 16, b = threadIdx.x % 16;
        const u64 ti = (u64)blockIdx.y * 16 + a, tj = (u64)blockIdx.x * 16 + b;
        uint8_t code = 0;
        if (ti < tr && tj < tc)
            code = (uint8_t)e4m3_code(
                __fmul_rn(v.tiles[ti * tc + tj], nvfp4_k_from_amax(v.amax_word)));
        sc[a][b] = code;
        sct[b][a] = code;
    }
    __syncthreads();
    finish2d_store_codes(out, v.col_data, rows, cols, r0, c0);
    // Row r0 + t: tile columns 16·bx .. of tile row (r0 + t) / 16 (tj0 < tc: the CTA exists).
    const u64 rt = r0 + threadIdx.x, ct = c0 + threadIdx.x;
    const u64 tj0 = (u64)blockIdx.x * 16, ti0 = (u64)blockIdx.y * 16;
    if (rt < rows) store_scales16(v.row_scales + rt * tc + tj0, sc[threadIdx.x / 16], tj0, tc);
    // Column c0 + t: tile rows 16·by .. of tile column (c0 + t) / 16 (ti0 < tr likewise).
    if (ct < cols) store_scales16(v.col_scales + ct * tr + ti0, sct[threadIdx.x / 16], ti0, tr);
}

// nvfp4x_finish_2d_same_v4 over 512x512 blocks (version 5): the codes of the block's four
// 256x256 tiles in turn, each as version 4 writes them (the next tile's 32 loads issued before
// the current tile's stores), then the block's 32x32 tile scales, each thread making four once,
// and the scale copies as whole 32-byte sectors: the 32 row-scale bytes of each of the block's
// 512 rows and the 32 column-scale bytes of each of its 512 columns, two lanes a sector (16-byte
// stores where whole and aligned, else bytes). Version 4 wrote 16 bytes per row and per column,
// half a sector, the other half left to a CTA far away in time: those partial-sector writes
// cost more than the codes (1x H100: 32768x32768 codes alone 394 us, with version 4's scale
// stores 684 us, with the same bytes stored contiguously 451 us). Grid (ceil(cols / 512),
// ceil(rows / 512), matrices); same parameters, host checks and bytes as version 4.
// The 512x512 block (bx, by) of matrix `v` ([rows, cols]): the body of
// nvfp4x_finish_2d_same_v5 and nvfp4x_finish_2d_mixed.
__device__ __forceinline__ void finish2d_block_v5(const Finish2dViews& v, u64 rows, u64 cols,
                                                  u64 bx, u64 by) {
    __shared__ uint4 out[256][8];
    __shared__ __align__(16) uint8_t sc[32][32];   // [tile row][tile column]
    __shared__ __align__(16) uint8_t sct[32][32];  // [tile column][tile row]
    const u64 wpr = cols / 8;
    const u64 tr = rows / 16, tc = (cols + 15) / 16;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 R0 = by * 512, C0 = bx * 512;
    const u64 ti0 = by * 32, tj0 = bx * 32;
    {
        // Tile (a, b) of the block's 32x32 tiles for a = e / 32, b = e % 32, e = t + 256m: a
        // warp reads 32 consecutive tile amaxes (zero where outside: never stored).
        const float k = nvfp4_k_from_amax(v.amax_word);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const unsigned e = threadIdx.x + 256 * m, a = e / 32, b = e % 32;
            const u64 ti = ti0 + a, tj = tj0 + b;
            uint8_t code = 0;
            if (ti < tr && tj < tc) code = (uint8_t)e4m3_code(__fmul_rn(v.tiles[ti * tc + tj], k));
            sc[a][b] = code;
            sct[b][a] = code;
        }
    }
    // Tile q of the block: rows R0 + 256·(q / 2), columns C0 + 256·(q % 2).
    uint32_t in[32];
    auto load = [&](int q) {
        const u64 r = R0 + 256 * (q / 2) + 32 * warp, c = C0 + 256 * (q % 2) + 8 * lane;
        if (r < rows && c < cols) finish2d_load(v.rowwise, wpr, r, c, in);
    };
    load(0);
#pragma unroll 1
    for (int q = 0; q < 4; ++q) {
        const u64 r0 = R0 + 256 * (q / 2), c0 = C0 + 256 * (q % 2);
        if (r0 + 32 * warp < rows && c0 + 8 * lane < cols) finish2d_stash(in, out, lane, warp);
        __syncthreads();
        if (q < 3) load(q + 1);
        finish2d_store_codes(out, v.col_data, rows, cols, r0, c0);
        __syncthreads();
    }
    // Row R0 + e / 2 (its tile row's 32 bytes, half e % 2), then column C0 + e / 2 likewise.
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned e = threadIdx.x + 256 * m, i = e / 2, h = e % 2;
        const u64 rt = R0 + i, j0 = tj0 + 16 * h;
        if (rt < rows && j0 < tc)
            store_scales16(v.row_scales + rt * tc + j0, &sc[i / 16][16 * h], j0, tc);
    }
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        const unsigned e = threadIdx.x + 256 * m, i = e / 2, h = e % 2;
        const u64 ct = C0 + i, i0 = ti0 + 16 * h;
        if (ct < cols && i0 < tr)
            store_scales16(v.col_scales + ct * tr + i0, &sct[i / 16][16 * h], i0, tr);
    }
}

extern "C" __global__ void __launch_bounds__(256) nvfp4x_finish_2d_same_v5(
    const Finish2dSameParams p) {
    finish2d_block_v5(finish2d_views(p), p.rows, p.cols, blockIdx.x, blockIdx.y);
}

// nvfp4x_finish_2d_same_v5 over matrices of any shapes in one launch (version 7): a 1-D grid of
// the 512x512 blocks of every matrix, matrix m's ceil(cols / 512) · ceil(rows / 512) blocks
// from CTA first[m] on (row-major). One launch per bucket group where version 5 made one per
// shape, each a partial wave with its own ramp and tail (1B's four shapes per group). CTA b
// finds its matrix by a binary search over `first` in the parameters (uniform across the CTA).
// `dims`: rows and cols (each below 2^32). Same host checks and bytes as version 5.
// nvfp4x_finish_2d_mixed_32 takes at most FINISH2D_MIXED_SMALL matrices (1928 bytes of
// parameters: past 4 KB a launch costs the host ~3 us more, and the step completes its bucket
// groups of 28 matrices one launch each).
#define FINISH2D_MIXED_MAX 128
#define FINISH2D_MIXED_SMALL 32
template <int MAX>
struct Finish2dMixedParamsT {
    uint32_t items, pad;
    uint32_t first[MAX];
    uint32_t dims[MAX][2];
    u64 ptrs[MAX][6];
};
using Finish2dMixedParams = Finish2dMixedParamsT<FINISH2D_MIXED_MAX>;
// The host passes exactly these bytes (nvfp4.rs, FINISH2D_MIXED_MAX rows: 7688 bytes, within
// the 32764 a launch may pass since CUDA 12.1; FINISH2D_MIXED_SMALL rows: 1928 bytes).
static_assert(sizeof(Finish2dMixedParams) == 8 + 12 * FINISH2D_MIXED_MAX + 48 * FINISH2D_MIXED_MAX,
              "parameter layout");
static_assert(sizeof(Finish2dMixedParamsT<FINISH2D_MIXED_SMALL>) ==
                  8 + 12 * FINISH2D_MIXED_SMALL + 48 * FINISH2D_MIXED_SMALL,
              "parameter layout");

template <class P>
__device__ __forceinline__ void finish2d_mixed_body(const P& p) {
    uint32_t lo = 0, hi = p.items;  // the last matrix whose first block is <= blockIdx.x
    while (hi - lo > 1) {
        const uint32_t mid = (lo + hi) / 2;
        if (p.first[mid] <= blockIdx.x) lo = mid; else hi = mid;
    }
    const Finish2dViews v = finish2d_views_at(p.ptrs[lo]);
    const u64 rows = p.dims[lo][0], cols = p.dims[lo][1];
    const uint32_t local = blockIdx.x - p.first[lo], gx = (uint32_t)((cols + 511) / 512);
    finish2d_block_v5(v, rows, cols, local % gx, local / gx);
}

extern "C" __global__ void __launch_bounds__(256) nvfp4x_finish_2d_mixed(
    const Finish2dMixedParams p) {
    finish2d_mixed_body(p);
}

extern "C" __global__ void __launch_bounds__(256) nvfp4x_finish_2d_mixed_32(
    const Finish2dMixedParamsT<FINISH2D_MIXED_SMALL> p) {
    finish2d_mixed_body(p);
}

// The rowwise scales [rows, tc] and columnwise scales [cols, tr] of the matrices of a
// nvfp4x_finish_2d_same launch (the same parameters; rows % 32 == 0, so tr = rows / 16):
// thread g of matrix blockIdx.z writes 16 consecutive scale bytes, the row scales' chunks
// first, then the column scales', as one 16-byte store where the chunk is whole and aligned;
// each byte is e4m3(tile amax · k) as nvfp4x_finish_2d computes it. Consecutive threads write
// consecutive bytes, so every sector is written whole by one warp.
extern "C" __global__ void __launch_bounds__(256) nvfp4x_scales_2d_same(
    const Finish2dSameParams p) {
    const u64* t = p.ptrs[blockIdx.z];
    const float* tiles = reinterpret_cast<const float*>(t[1]);
    const uint32_t* amax_word = reinterpret_cast<const uint32_t*>(t[2]);
    uint8_t* row_scales = reinterpret_cast<uint8_t*>(t[3]);
    uint8_t* col_scales = reinterpret_cast<uint8_t*>(t[5]);
    __builtin_assume(__isGlobal(tiles));
    __builtin_assume(__isGlobal(amax_word));
    __builtin_assume(__isGlobal(row_scales));
    __builtin_assume(__isGlobal(col_scales));
    const u64 rows = p.rows, cols = p.cols, tr = rows / 16, tc = (cols + 15) / 16;
    const u64 nrs = rows * tc, ncs = cols * tr;
    const u64 rchunks = (nrs + 15) / 16;
    u64 g = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= rchunks + (ncs + 15) / 16) return;
    const float k = nvfp4_k_from_amax(amax_word);
    const bool row = g < rchunks;
    uint8_t* out = row ? row_scales : col_scales;
    const u64 n = row ? nrs : ncs, g0 = 16 * (row ? g : g - rchunks);
    // Output byte g0 + j is (major, minor) = divmod(g0 + j, inner): row scales (row, tile
    // column), tile (row / 16, tile column); column scales (column, tile row), tile (tile row,
    // column / 16).
    const u64 inner = row ? tc : tr;
    // 32-bit division where it fits (always in practice): the 64-bit one is long emulated code.
    u64 major, minor;
    if (g0 <= 0xFFFFFFFFull && inner <= 0xFFFFFFFFull) {
        major = (uint32_t)g0 / (uint32_t)inner;
        minor = (uint32_t)g0 % (uint32_t)inner;
    } else {
        major = g0 / inner;
        minor = g0 % inner;
    }
    uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        if (g0 + j < n) {
            const u64 tile = row ? (major / 16) * tc + minor : minor * tc + major / 16;
            w[j / 4] |= (uint32_t)e4m3_code(__fmul_rn(tiles[tile], k)) << (8 * (j % 4));
        }
        if (++minor == inner) {
            minor = 0;
            ++major;
        }
    }
    uint8_t* o = out + g0;
    if (g0 + 16 <= n && ((uintptr_t)o & 15u) == 0) {
        *reinterpret_cast<uint4*>(o) = make_uint4(w[0], w[1], w[2], w[3]);
    } else {
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (g0 + j < n) o[j] = (uint8_t)(w[j / 4] >> (8 * (j % 4)));
    }
}
