// Element-wise, optimizer, matmul, reduction and model kernels of lowbit-device's CUDA backend,
// bit-exact with its CPU backend (the oracle).
//
// Arithmetic contract (crates/lowbit-device/src/lib.rs, "Arithmetic contract"):
// - f32 arithmetic one IEEE operation at a time through the _rn intrinsics (__fmul_rn,
//   __fadd_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which the compiler never contracts into FMA;
// - conversions between f32, bf16 and f16 are integer code that reproduces the `half` crate
//   (round to nearest even, NaN payloads kept with the quiet bit set), not cvt instructions,
//   whose NaN results are canonical;
// - tanh, exp and ln are evaluated in double and rounded to f32, as the CPU does;
// - reductions whose order the CPU fixes (sums) run in that order in one thread; max-style
//   reductions, which are order-independent, run in parallel.
// Views are passed as raw byte addresses; element offsets are aligned to the element size
// (the host checks). Dtype codes: 0 = f32, 1 = bf16, 2 = f16.

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "include/lowbit_convert.cuh"

// Elements of a dtype in 16 bytes.
__device__ __forceinline__ u64 dt_elems_per_16(uint32_t dt) { return dt == 0 ? 4 : 8; }

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// ---- element-wise ----

extern "C" __global__ void fill_u16(uint16_t* __restrict__ y, u64 n, uint32_t pattern) {
    GRID_STRIDE(i, n) y[i] = (uint16_t)pattern;
}

extern "C" __global__ void fill_u32(uint32_t* __restrict__ y, u64 n, uint32_t pattern) {
    GRID_STRIDE(i, n) y[i] = pattern;
}

// dst <- src converted (exact widening, RNE narrowing).
extern "C" __global__ void cast(const uint8_t* __restrict__ x, uint32_t xd, uint8_t* __restrict__ y,
                                uint32_t yd, u64 n) {
    GRID_STRIDE(i, n) store(y, yd, i, load(x, xd, i));
}

// f32 -> bf16, eight elements per thread: two 16-byte loads and one 16-byte store (staging's
// cast of the masters). Both pointers 16-byte aligned; the host casts a head and a tail with
// `cast`. Each element rounds as in `cast` (RNE, NaN quieted).
extern "C" __global__ void cast_f32_bf16_x8(const float4* __restrict__ x, uint4* __restrict__ y,
                                            u64 n8) {
    GRID_STRIDE(i, n8) {
        float4 a = x[2 * i];
        float4 b = x[2 * i + 1];
        uint4 o;
        o.x = (uint32_t)f32_to_bf16_bits(a.x) | ((uint32_t)f32_to_bf16_bits(a.y) << 16);
        o.y = (uint32_t)f32_to_bf16_bits(a.z) | ((uint32_t)f32_to_bf16_bits(a.w) << 16);
        o.z = (uint32_t)f32_to_bf16_bits(b.x) | ((uint32_t)f32_to_bf16_bits(b.y) << 16);
        o.w = (uint32_t)f32_to_bf16_bits(b.z) | ((uint32_t)f32_to_bf16_bits(b.w) << 16);
        y[i] = o;
    }
}

// y <- alpha * y.
extern "C" __global__ void scale(uint8_t* __restrict__ y, uint32_t yd, u64 n, float alpha) {
    GRID_STRIDE(i, n) store(y, yd, i, __fmul_rn(alpha, load(y, yd, i)));
}

// y <- y + alpha * x (alpha_is_one: y + x, the exact `add`).
extern "C" __global__ void axpy(const uint8_t* __restrict__ x, uint32_t xd, uint8_t* __restrict__ y,
                                uint32_t yd, u64 n, float alpha, uint32_t alpha_is_one) {
    GRID_STRIDE(i, n) {
        float xv = load(x, xd, i);
        float t = alpha_is_one ? xv : __fmul_rn(alpha, xv);
        store(y, yd, i, __fadd_rn(load(y, yd, i), t));
    }
}

// axpy and scale over f32 views with float4 loads and stores (both views 16-byte aligned; the
// n % 4 tail by the first threads): each element exactly as in `axpy` / `scale`, the same
// instruction in the same operand order, so the same bits. A scalar thread per element moved
// a third of the card's copy bandwidth; the gradient and residual adds of a step are all f32.
extern "C" __global__ void axpy_f32x4(const float* __restrict__ x, float* __restrict__ y, u64 n,
                                      float alpha, uint32_t alpha_is_one) {
    u64 n4 = n / 4;
    GRID_STRIDE(k, n4) {
        float4 a = reinterpret_cast<const float4*>(x)[k];
        float4 b = reinterpret_cast<float4*>(y)[k];
        if (!alpha_is_one) {
            a.x = __fmul_rn(alpha, a.x);
            a.y = __fmul_rn(alpha, a.y);
            a.z = __fmul_rn(alpha, a.z);
            a.w = __fmul_rn(alpha, a.w);
        }
        b.x = __fadd_rn(b.x, a.x);
        b.y = __fadd_rn(b.y, a.y);
        b.z = __fadd_rn(b.z, a.z);
        b.w = __fadd_rn(b.w, a.w);
        reinterpret_cast<float4*>(y)[k] = b;
    }
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - 4 * n4) {
        u64 i = 4 * n4 + t;
        float xv = alpha_is_one ? x[i] : __fmul_rn(alpha, x[i]);
        y[i] = __fadd_rn(y[i], xv);
    }
}

extern "C" __global__ void scale_f32x4(float* __restrict__ y, u64 n, float alpha) {
    u64 n4 = n / 4;
    GRID_STRIDE(k, n4) {
        float4 b = reinterpret_cast<float4*>(y)[k];
        b.x = __fmul_rn(alpha, b.x);
        b.y = __fmul_rn(alpha, b.y);
        b.z = __fmul_rn(alpha, b.z);
        b.w = __fmul_rn(alpha, b.w);
        reinterpret_cast<float4*>(y)[k] = b;
    }
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - 4 * n4) y[4 * n4 + t] = __fmul_rn(alpha, y[4 * n4 + t]);
}

// ---- reductions ----

// out[0] <- max over |x| bit patterns with NaN as 0 (order-independent, so parallel). With `vec`
// (a 16-byte aligned view), whole 16-byte chunks are read with vector loads and the tail element
// by element. One atomic per block.

extern "C" __global__ void max_abs_bits(const uint8_t* __restrict__ x, uint32_t xd, u64 n,
                                        uint32_t* __restrict__ out, uint32_t vec) {
    __shared__ uint32_t warp_max[32];
    uint32_t m = 0;
    u64 done = 0;
    if (vec) {
        u64 per = dt_elems_per_16(xd);
        u64 chunks = n / per;
        GRID_STRIDE(i, chunks) {
            uint4 raw = reinterpret_cast<const uint4*>(x)[i];
            if (xd == 0) {
                const float* f = reinterpret_cast<const float*>(&raw);
#pragma unroll
                for (int j = 0; j < 4; ++j) m = max(m, abs_bits_nan_zero(f[j]));
            } else {
                const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw);
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    m = max(m, abs_bits_nan_zero(xd == 1 ? bf16_bits_to_f32(h[j]) : f16_bits_to_f32(h[j])));
            }
        }
        done = chunks * per;
    }
    for (u64 i = done + (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        m = max(m, abs_bits_nan_zero(load(x, xd, i)));
    for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
        if (m != 0) atomicMax(out, m);
    }
}

// The blocked f64 sums of squares (lowbit_device::SUM_BLOCK = 4096; ops.rs, BlockedSum):
// block sum b = sum over i in block b, in index order from +0.0, of x_i^2 (sum_squares: x read
// as f32, squared exactly in f64) or of (x_i - y_i)^2 (mse_loss: f32 views, difference and
// square in f64), through __dadd_rn/__dmul_rn/__dsub_rn (never fused); partials[g] = the block
// sums of group g (blocks 32g .. 32g + 31, lowbit_device::SUM_GROUP) added in index order from
// +0.0 (sumsq_group). The host adds the partials in index order. One thread per block keeps the
// order. Each warp owns one group (32 consecutive blocks) and works on its own (no CTA barrier): it stages them through shared memory 32
// elements at a time (a step), lane l loading element k + l of each of the 32 blocks
// (coalesced, 32 independent loads per lane, unconditional when all 32 blocks are whole), then
// each lane reads its own row (pitch 33: no bank conflicts) and adds it to its block's sum.
// Software-pipelined (version 3): the loads of a step are issued SUMSQ_DEPTH steps ahead, into
// a register set freed by staging the previous step, before the 32 dependent adds of the
// current step, so the warp always has loads in flight (before, its loads waited for its adds).
// The additions, their operands and their order are unchanged. Elements past n read as 0, and
// adding +0.0 to a partial (never -0.0) leaves it unchanged, so a short last block is summed
// exactly as on the CPU. DT: 0 = f32, 1 = bf16, 2 = f16; MSE: y present (f32).
#define SUMSQ_BLOCK 4096u
#define SUMSQ_WARPS 4u

// The raw bits of element i (f32 bits, or the 16-bit pattern), converted to f32 only where
// the sum reads them (sumsq_value): one conversion per element in the adding loop instead of
// one per load site (the loads are unrolled many times over; f16's conversion is long).
// PF (version 3): the same streaming load with the L2 prefetch-size hint of 256 bytes, so the
// L2 fetches the 256 contiguous bytes of a block that a warp's two steps in flight read (f32)
// with one DRAM request instead of two 128-byte ones (H200: 0.82x -> 0.87x of a copy). The
// address is converted to the global window first, as __ldcs does.
template <int DT, bool PF = false>
__device__ __forceinline__ uint32_t sumsq_load(const uint8_t* __restrict__ x, u64 i) {
    if (PF) {
        if (DT == 0) {
            uint32_t v;
            asm("ld.global.cs.L2::256B.u32 %0, [%1];"
                : "=r"(v)
                : "l"(__cvta_generic_to_global(reinterpret_cast<const unsigned int*>(x) + i)));
            return v;
        }
        unsigned short h;
        asm("ld.global.cs.L2::256B.u16 %0, [%1];"
            : "=h"(h)
            : "l"(__cvta_generic_to_global(reinterpret_cast<const unsigned short*>(x) + i)));
        return h;
    }
    if (DT == 0) return __ldcs(reinterpret_cast<const unsigned int*>(x) + i);
    return __ldcs(reinterpret_cast<const unsigned short*>(x) + i);
}

template <int DT>
__device__ __forceinline__ float sumsq_value(uint32_t b) {
    if (DT == 0) return __uint_as_float(b);
    return DT == 1 ? bf16_bits_to_f32((uint16_t)b) : f16_bits_to_f32((uint16_t)b);
}

// One step's loads: element `base + r·SUMSQ_BLOCK` for r < 32 (`base` = the first block's
// start + k + lane). WHOLE (warp-uniform): all 32 blocks lie inside the view, no bounds check;
// else elements past n read as 0 (bits 0: +0.0 in every dtype; the warp holding the last,
// short block).
template <int DT, bool MSE, bool WHOLE, bool PF = false>
__device__ __forceinline__ void sumsq_fetch(const uint8_t* __restrict__ x,
                                            const float* __restrict__ y, u64 n, u64 base,
                                            uint32_t (&v)[32], float (&u)[32]) {
#pragma unroll
    for (unsigned r = 0; r < 32; ++r) {
        u64 i = base + (u64)r * SUMSQ_BLOCK;
        if (WHOLE) {
            v[r] = sumsq_load<DT, PF>(x, i);
            if (MSE) u[r] = __ldcs(y + i);
        } else {
            bool live = i < n;
            v[r] = live ? sumsq_load<DT, PF>(x, i) : 0u;
            if (MSE) u[r] = live ? __ldcs(y + i) : 0.0f;
        }
    }
}

// Steps in flight per warp: 2 for the sums of squares (64 registers of loads: 8 KB per warp
// for f32), 1 for MSE (its two inputs already take 64).
template <bool MSE>
struct SumsqDepth {
    static constexpr unsigned value = MSE ? 1u : 2u;
};

// The 128 steps of one warp (lane = its block b0 + lane), returning the lane's block sum.
template <int DT, bool MSE, bool WHOLE, bool PF = false>
__device__ __forceinline__ double sumsq_chain(const uint8_t* __restrict__ x,
                                              const float* __restrict__ y, u64 n, u64 b0,
                                              unsigned lane, uint32_t (*tx)[33],
                                              float (*ty)[33]) {
    constexpr unsigned D = SumsqDepth<MSE>::value;
    const u64 base = b0 * SUMSQ_BLOCK + lane;
    uint32_t v[D][32];
    float u[D][32];
#pragma unroll
    for (unsigned s = 0; s < D; ++s)
        sumsq_fetch<DT, MSE, WHOLE, PF>(x, y, n, base + 32 * s, v[s], u[s]);
    double acc = 0.0;
    for (unsigned k = 0; k < SUMSQ_BLOCK; k += 32 * D) {
#pragma unroll
        for (unsigned s = 0; s < D; ++s) {
            // Stage step k + 32s (waits for its loads), then refill the registers with the
            // loads of step k + 32(s + D), which stay in flight during this step's adds.
#pragma unroll
            for (unsigned r = 0; r < 32; ++r) {
                tx[r][lane] = v[s][r];
                if (MSE) ty[r][lane] = u[s][r];
            }
            __syncwarp();
            const unsigned next = k + 32 * (s + D);
            if (next < SUMSQ_BLOCK)
                sumsq_fetch<DT, MSE, WHOLE, PF>(x, y, n, base + next, v[s], u[s]);
#pragma unroll 8
            for (unsigned j = 0; j < 32; ++j) {
                double d = (double)sumsq_value<DT>(tx[lane][j]);
                if (MSE) d = __dsub_rn(d, (double)ty[lane][j]);
                acc = __dadd_rn(acc, __dmul_rn(d, d));
            }
            __syncwarp();
        }
    }
    return acc;
}

// The group's partial: the 32 lanes' block sums added in lane (= block) order from +0.0, by
// every lane alike. A lane past the view's last block holds +0.0 (its elements read as 0), and
// adding +0.0 to a sum of squares (never -0.0) changes nothing, so a short last group sums as on
// the CPU (BlockedSum).
__device__ __forceinline__ double sumsq_group(double acc) {
    double s = 0.0;
#pragma unroll
    for (unsigned r = 0; r < 32; ++r) s = __dadd_rn(s, __shfl_sync(0xffffffffu, acc, r));
    return s;
}

// `warp`: the warp's index within the view's launch (it owns group `warp`: blocks 32·warp ..).
template <int DT, bool MSE, bool PF = false>
__device__ __forceinline__ void sum_squares_warp(const uint8_t* __restrict__ x,
                                                 const float* __restrict__ y, u64 n,
                                                 double* __restrict__ partials, u64 warp) {
    __shared__ uint32_t tx[SUMSQ_WARPS][32][33];
    __shared__ float ty[MSE ? SUMSQ_WARPS : 1][32][MSE ? 33 : 1];
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u64 b0 = warp * 32;
    const u64 nb = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    if (b0 >= nb) return;
    float(*tyw)[33] = MSE ? reinterpret_cast<float(*)[33]>(&ty[w][0][0]) : nullptr;
    // The warp holding the last (short) block takes the predicated loads, the same number in
    // flight. (Issued one after another, as this loop once was, they made this warp the
    // kernel's critical path: ~0.1 ms per call whatever its size.)
    const double acc = (b0 + 32) * SUMSQ_BLOCK <= n
                           ? sumsq_chain<DT, MSE, true, PF>(x, y, n, b0, lane, tx[w], tyw)
                           : sumsq_chain<DT, MSE, false, PF>(x, y, n, b0, lane, tx[w], tyw);
    const double g = sumsq_group(acc);
    if (lane == 0) partials[warp] = g;
}

__device__ __forceinline__ u64 sumsq_warp_index() {
    return (u64)blockIdx.x * SUMSQ_WARPS + threadIdx.x / 32;
}

extern "C" __global__ void __launch_bounds__(128) sum_squares_blocks_f32(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp<0, false>(x, nullptr, n, partials, sumsq_warp_index());
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_blocks_bf16(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp<1, false>(x, nullptr, n, partials, sumsq_warp_index());
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_blocks_f16(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp<2, false>(x, nullptr, n, partials, sumsq_warp_index());
}
extern "C" __global__ void __launch_bounds__(128) mse_blocks_f32(
    const uint8_t* __restrict__ x, const float* __restrict__ y, u64 n,
    double* __restrict__ partials) {
    sum_squares_warp<0, true>(x, y, n, partials, sumsq_warp_index());
}

// Many views of one dtype in one launch (the gradient norm's pieces): a warp's serial chain
// over its 4096-element blocks takes ~0.1 ms whatever the view's size, so one launch per view
// costs that per piece, while one launch for all runs every piece's warps side by side. The
// table holds 4 words per view: address, length, offset of its partials (in f64 words: one per
// group, i.e. per warp), and
// its first global warp (ascending; views own warps [first, next view's first)). Each warp
// runs the single-view body unchanged, so the partials are those of one launch per view.
// The table row of the view global warp `gw` works on: the last view whose first warp is
// <= gw (the first row's first warp is 0).
__device__ __forceinline__ const u64* sumsq_view(const u64* __restrict__ table, uint32_t views,
                                                 u64 gw) {
    uint32_t lo = 0, hi = views;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (table[4 * mid + 3] <= gw) lo = mid; else hi = mid;
    }
    return table + 4 * lo;
}

// `warps`: the table's warps (the last view's first warp plus its groups). A grid with fewer
// warps strides over them (a launch beside collectives keeps to a few SMs, see
// `sum_squares_beside` in cuda/kernels/elementwise.rs); each global warp still runs the
// single-view body once, so the partials are the same.
template <int DT, bool PF = false>
__device__ __forceinline__ void sum_squares_many(const u64* __restrict__ table, uint32_t views,
                                                 u64 warps, double* __restrict__ partials) {
    const u64 stride = (u64)gridDim.x * SUMSQ_WARPS;
    for (u64 gw = sumsq_warp_index(); gw < warps; gw += stride) {
        const u64* t = sumsq_view(table, views, gw);
        sum_squares_warp<DT, false, PF>(reinterpret_cast<const uint8_t*>(t[0]), nullptr, t[1],
                                        partials + t[2], gw - t[3]);
    }
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_f32(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<0>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_bf16(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<1>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_f16(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<2>(table, views, warps, partials);
}
// Version 3: version 1 with the 256-byte L2 prefetch hint (sumsq_load).
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_f32_v3(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<0, true>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_bf16_v3(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<1, true>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(128) sum_squares_many_f16_v3(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many<2, true>(table, views, warps, partials);
}

// Version 2 (set_cuda_kernel_variant("sum_squares", 2); predicted, not yet measured, see
// NOTES.md): the same warps, blocks, elements and additions as above; only the loads and the
// staging differ. A step covers 512 bytes of each of the warp's 32 blocks (128 f32 or 256
// 16-bit elements), and one load instruction reads 512 contiguous bytes of ONE block (16 bytes
// a lane), so DRAM sees a few long runs per warp instead of 32 lines 16 KiB apart. A step's 32
// rows (row = block b0 + row) are loaded SUMSQ2 G rows at a time (G independent 16-byte loads
// per lane, issued back to back), two groups in flight, and staged in shared memory: row r at
// a pitch of 32 16-byte chunks, chunk c stored at chunk c ^ (r & 7). A 16-byte shared access
// is served eight lanes a phase: the stores (one row, chunks l ^ (r & 7)) and the per-lane row
// reads (lane = row, chunk q ^ (lane & 7)) each touch eight distinct 16-byte bank groups a
// phase, so neither conflicts. Each lane then adds its row's elements in index order exactly as
// version 1 (elements past n read as +0.0). x (and y) must be 16-byte aligned: the host runs
// version 1 otherwise. CTAs of 2 warps (32 KB of shared memory), MSE 1 warp (x and y tiles).
template <bool MSE>
struct Sumsq2 {
    static constexpr unsigned G = MSE ? 4u : 8u;  // rows per load group
    static constexpr unsigned WARPS = MSE ? 1u : 2u;
};

// The 16-byte chunk of E elements (4 f32 or 8 16-bit) starting at element i0 (a multiple of E).
// WHOLE: no checks; else elements past n read as 0 (a partial chunk element by element).
template <int DT, bool WHOLE>
__device__ __forceinline__ uint4 sumsq2_load(const uint8_t* __restrict__ x, u64 n, u64 i0) {
    constexpr unsigned E = DT == 0 ? 4u : 8u;
    if (WHOLE || i0 + E <= n)
        return __ldcs(reinterpret_cast<const uint4*>(x + i0 * (16 / E)));
    uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
    for (unsigned e = 0; e < E; ++e) {
        if (i0 + e < n) {
            const uint32_t b = sumsq_load<DT>(x, i0 + e);
            if (DT == 0) w[e] = b; else w[e / 2] |= b << (16 * (e % 2));
        }
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
}

// One group's loads: rows 0..G of the group, `first` = the element of its row 0 at this lane.
template <int DT, bool MSE, bool WHOLE, unsigned G>
__device__ __forceinline__ void sumsq2_fetch(const uint8_t* __restrict__ x,
                                             const uint8_t* __restrict__ y, u64 n, u64 first,
                                             uint4 (&v)[G], uint4 (&u)[G]) {
#pragma unroll
    for (unsigned r = 0; r < G; ++r) {
        const u64 i = first + (u64)r * SUMSQ_BLOCK;
        v[r] = sumsq2_load<DT, WHOLE>(x, n, i);
        if (MSE) u[r] = sumsq2_load<0, WHOLE>(y, n, i);
    }
}

// The steps of one warp (lane = its block b0 + lane), returning the lane's block sum. tx (ty):
// the warp's 32 x 32 chunk tile.
template <int DT, bool MSE, bool WHOLE>
__device__ __forceinline__ double sumsq2_chain(const uint8_t* __restrict__ x,
                                               const uint8_t* __restrict__ y, u64 n, u64 b0,
                                               unsigned lane, uint4* __restrict__ tx,
                                               uint4* __restrict__ ty) {
    constexpr unsigned G = Sumsq2<MSE>::G, NG = 32 / G;
    constexpr unsigned E = DT == 0 ? 4u : 8u;        // elements per 16-byte chunk
    constexpr unsigned S = 32 * E;                   // elements of a row per step
    constexpr unsigned STEPS = SUMSQ_BLOCK / S;
    static_assert(NG % 2 == 0, "two load buffers alternate over a step's groups");
    // Group t = k·NG + g: rows gG .. gG + G - 1 of step k.
    const u64 base = b0 * SUMSQ_BLOCK + lane * E;
    uint4 v[2][G], u[2][G];
    sumsq2_fetch<DT, MSE, WHOLE, G>(x, y, n, base, v[0], u[0]);
    sumsq2_fetch<DT, MSE, WHOLE, G>(x, y, n, base + (u64)G * SUMSQ_BLOCK, v[1], u[1]);
    const unsigned sw = lane & 7;
    double acc = 0.0;
    for (unsigned k = 0; k < STEPS; ++k) {
#pragma unroll
        for (unsigned g = 0; g < NG; ++g) {
            // Stage group g (waits for its loads), then refill its registers with group t + 2.
            const unsigned s = g % 2;
#pragma unroll
            for (unsigned j = 0; j < G; ++j) {
                const unsigned row = g * G + j;
                tx[row * 32 + (lane ^ (row & 7))] = v[s][j];
                if (MSE) ty[row * 32 + (lane ^ (row & 7))] = u[s][j];
            }
            const unsigned nk = k + (g + 2) / NG, ng = (g + 2) % NG;
            if (nk < STEPS)
                sumsq2_fetch<DT, MSE, WHOLE, G>(
                    x, y, n, base + (u64)nk * S + (u64)(ng * G) * SUMSQ_BLOCK, v[s], u[s]);
        }
        __syncwarp();
#pragma unroll 4
        for (unsigned q = 0; q < 32; ++q) {
            const uint4 c = tx[lane * 32 + (q ^ sw)];
            const uint32_t a[4] = {c.x, c.y, c.z, c.w};
            uint32_t b[4] = {0u, 0u, 0u, 0u};
            if (MSE) {
                const uint4 cy = ty[lane * 32 + (q ^ sw)];
                b[0] = cy.x; b[1] = cy.y; b[2] = cy.z; b[3] = cy.w;
            }
#pragma unroll
            for (unsigned e = 0; e < E; ++e) {
                const uint32_t bits = DT == 0 ? a[e] : (a[e / 2] >> (16 * (e % 2))) & 0xffffu;
                double d = (double)sumsq_value<DT>(bits);
                if (MSE) d = __dsub_rn(d, (double)__uint_as_float(b[e % 4]));
                acc = __dadd_rn(acc, __dmul_rn(d, d));
            }
        }
        __syncwarp();
    }
    return acc;
}

// `warp`: the warp's index within the view's launch (it owns group `warp`: blocks 32·warp ..).
template <int DT, bool MSE>
__device__ __forceinline__ void sum_squares_warp_v2(const uint8_t* __restrict__ x,
                                                    const uint8_t* __restrict__ y, u64 n,
                                                    double* __restrict__ partials, u64 warp) {
    constexpr unsigned W = Sumsq2<MSE>::WARPS;
    __shared__ uint4 tx[W][32 * 32];
    __shared__ uint4 ty[MSE ? W : 1][MSE ? 32 * 32 : 1];
    const unsigned lane = threadIdx.x % 32, w = threadIdx.x / 32;
    const u64 b0 = warp * 32;
    const u64 nb = (n + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    if (b0 >= nb) return;
    uint4* tyw = MSE ? ty[w] : nullptr;
    const double acc = (b0 + 32) * SUMSQ_BLOCK <= n
                           ? sumsq2_chain<DT, MSE, true>(x, y, n, b0, lane, tx[w], tyw)
                           : sumsq2_chain<DT, MSE, false>(x, y, n, b0, lane, tx[w], tyw);
    const double g = sumsq_group(acc);
    if (lane == 0) partials[warp] = g;
}

template <bool MSE>
__device__ __forceinline__ u64 sumsq2_warp_index() {
    return (u64)blockIdx.x * Sumsq2<MSE>::WARPS + threadIdx.x / 32;
}

extern "C" __global__ void __launch_bounds__(64) sum_squares_blocks_f32_v2(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp_v2<0, false>(x, nullptr, n, partials, sumsq2_warp_index<false>());
}
extern "C" __global__ void __launch_bounds__(64) sum_squares_blocks_bf16_v2(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp_v2<1, false>(x, nullptr, n, partials, sumsq2_warp_index<false>());
}
extern "C" __global__ void __launch_bounds__(64) sum_squares_blocks_f16_v2(
    const uint8_t* __restrict__ x, u64 n, double* __restrict__ partials) {
    sum_squares_warp_v2<2, false>(x, nullptr, n, partials, sumsq2_warp_index<false>());
}
extern "C" __global__ void __launch_bounds__(32) mse_blocks_f32_v2(
    const uint8_t* __restrict__ x, const float* __restrict__ y, u64 n,
    double* __restrict__ partials) {
    sum_squares_warp_v2<0, true>(x, reinterpret_cast<const uint8_t*>(y), n, partials,
                                 sumsq2_warp_index<true>());
}

// sum_squares_many_* with the version-2 body (every view 16-byte aligned: the host checks).
// `warps` as in sum_squares_many.
template <int DT>
__device__ __forceinline__ void sum_squares_many_v2(const u64* __restrict__ table,
                                                    uint32_t views, u64 warps,
                                                    double* __restrict__ partials) {
    const u64 stride = (u64)gridDim.x * Sumsq2<false>::WARPS;
    for (u64 gw = sumsq2_warp_index<false>(); gw < warps; gw += stride) {
        const u64* t = sumsq_view(table, views, gw);
        sum_squares_warp_v2<DT, false>(reinterpret_cast<const uint8_t*>(t[0]), nullptr, t[1],
                                       partials + t[2], gw - t[3]);
    }
}
extern "C" __global__ void __launch_bounds__(64) sum_squares_many_f32_v2(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many_v2<0>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(64) sum_squares_many_bf16_v2(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many_v2<1>(table, views, warps, partials);
}
extern "C" __global__ void __launch_bounds__(64) sum_squares_many_f16_v2(
    const u64* __restrict__ table, uint32_t views, u64 warps, double* __restrict__ partials) {
    sum_squares_many_v2<2>(table, views, warps, partials);
}

// out[0] <- 1 if any element is NaN or infinite.
extern "C" __global__ void any_non_finite(const uint8_t* __restrict__ x, uint32_t xd, u64 n,
                                          uint32_t* __restrict__ out) {
    uint32_t f = 0;
    GRID_STRIDE(i, n) {
        uint32_t a = __float_as_uint(load(x, xd, i)) & 0x7FFFFFFFu;
        f |= a >= 0x7F800000u ? 1u : 0u;
    }
    if (__any_sync(0xFFFFFFFFu, f) && (threadIdx.x & 31) == 0) atomicOr(out, 1u);
}

// ---- optimizers ----

// The scalars of an AdamW step (ops/optim.rs: AdamWScalars), as both kernels take them.
struct AdamWArgs {
    float decay, w, one_minus_w, beta2, c2, neg_step_size, bc2_sqrt, eps;
    uint32_t small;
    float gscale;
};

// One AdamW step of one element (ops/optim.rs, operation for operation): p, m, v updated.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g,
                                              const AdamWArgs& a) {
    // The clip coefficient, as a separate `scale` pass would have applied it.
    if (a.gscale != 1.0f) g = __fmul_rn(a.gscale, g);
    float pi = __fmul_rn(p, a.decay);
    float mi = m;
    float d = __fsub_rn(g, mi);
    mi = a.small ? __fadd_rn(mi, __fmul_rn(a.w, d)) : __fsub_rn(g, __fmul_rn(d, a.one_minus_w));
    float vi = __fadd_rn(__fmul_rn(v, a.beta2), __fmul_rn(__fmul_rn(a.c2, g), g));
    float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bc2_sqrt), a.eps);
    p = __fadd_rn(pi, __fdiv_rn(__fmul_rn(a.neg_step_size, mi), denom));
    m = mi;
    v = vi;
}

// One AdamW step per element. out_dtype 3 = no output.
extern "C" __global__ void adamw(float* __restrict__ p, const uint8_t* __restrict__ g, uint32_t gd,
                                 float* __restrict__ m, float* __restrict__ v,
                                 uint8_t* __restrict__ out, uint32_t od, u64 n, float decay,
                                 float w, float one_minus_w, float beta2, float c2,
                                 float neg_step_size, float bc2_sqrt, float eps, uint32_t small,
                                 float gscale) {
    const AdamWArgs a{decay, w, one_minus_w, beta2, c2, neg_step_size, bc2_sqrt, eps, small, gscale};
    GRID_STRIDE(i, n) {
        float pi = p[i], mi = m[i], vi = v[i];
        adamw_element(pi, mi, vi, load(g, gd, i), a);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if (od != 3) store(out, od, i, pi);
    }
}

// `adamw` four elements a thread (version 2, not the default): 16-byte loads and stores of the
// f32 state (8-byte ones for 16-bit gradients and outputs), the same bits element for element.
// Alone it is faster (256M parameters on an H200: f32 gradients 0.91 -> 0.98x of a copy, bf16
// 0.89 -> 0.97x), but beside the one-call step's gathers it slows them more than it gains (2x
// H200, 1B MXFP8: 17.4-17.5 -> 18.2 ms). The host takes it where n % 4 == 0 and every view is
// aligned to its vector width.
extern "C" __global__ void adamw_x4(float* __restrict__ p, const uint8_t* __restrict__ g,
                                    uint32_t gd, float* __restrict__ m, float* __restrict__ v,
                                    uint8_t* __restrict__ out, uint32_t od, u64 n4, float decay,
                                    float w, float one_minus_w, float beta2, float c2,
                                    float neg_step_size, float bc2_sqrt, float eps,
                                    uint32_t small, float gscale) {
    const AdamWArgs a{decay, w, one_minus_w, beta2, c2, neg_step_size, bc2_sqrt, eps, small, gscale};
    GRID_STRIDE(i, n4) {
        float4 P = reinterpret_cast<const float4*>(p)[i];
        float4 M = reinterpret_cast<const float4*>(m)[i];
        float4 V = reinterpret_cast<const float4*>(v)[i];
        float G[4];
        if (gd == 0) {
            const float4 q = __ldg(reinterpret_cast<const float4*>(g) + i);
            G[0] = q.x, G[1] = q.y, G[2] = q.z, G[3] = q.w;
        } else {
            const uint2 q = __ldg(reinterpret_cast<const uint2*>(g) + i);
            const uint16_t h[4] = {(uint16_t)q.x, (uint16_t)(q.x >> 16), (uint16_t)q.y,
                                   (uint16_t)(q.y >> 16)};
#pragma unroll
            for (int k = 0; k < 4; ++k)
                G[k] = gd == 1 ? bf16_bits_to_f32(h[k]) : f16_bits_to_f32(h[k]);
        }
        adamw_element(P.x, M.x, V.x, G[0], a);
        adamw_element(P.y, M.y, V.y, G[1], a);
        adamw_element(P.z, M.z, V.z, G[2], a);
        adamw_element(P.w, M.w, V.w, G[3], a);
        reinterpret_cast<float4*>(p)[i] = P;
        reinterpret_cast<float4*>(m)[i] = M;
        reinterpret_cast<float4*>(v)[i] = V;
        if (od == 0) {
            reinterpret_cast<float4*>(out)[i] = P;
        } else if (od != 3) {
            const float r[4] = {P.x, P.y, P.z, P.w};
            uint32_t b[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) b[k] = od == 1 ? f32_to_bf16_bits(r[k]) : f32_to_f16_bits(r[k]);
            reinterpret_cast<uint2*>(out)[i] = make_uint2(b[0] | (b[1] << 16), b[2] | (b[3] << 16));
        }
    }
}

// One SGD-with-momentum step per element (ops/optim.rs).
extern "C" __global__ void sgd_momentum(float* __restrict__ p, const uint8_t* __restrict__ g,
                                        uint32_t gd, float* __restrict__ buf, u64 n, float wd,
                                        float mom, float neg_lr, uint32_t first_step) {
    GRID_STRIDE(i, n) {
        float pi = p[i];
        float gi = load(g, gd, i);
        if (wd != 0.0f) gi = __fadd_rn(gi, __fmul_rn(wd, pi));
        float b;
        if (mom == 0.0f) {
            b = gi;
        } else {
            b = first_step ? gi : __fadd_rn(__fmul_rn(buf[i], mom), gi);
            buf[i] = b;
        }
        p[i] = __fadd_rn(pi, __fmul_rn(neg_lr, b));
    }
}

// ---- matmul ----

// C[m, n] (+)= op(A)[m, k] . op(B)[k, n]: one thread per element of C, k summed in index order
// from +0 with every product rounded (the CPU's order). grid.x covers n, grid.y strides m.
extern "C" __global__ void matmul(const uint8_t* __restrict__ a, uint32_t ad,
                                  const uint8_t* __restrict__ b, uint32_t bd,
                                  float* __restrict__ c, u64 m, u64 n, u64 k, uint32_t trans_a,
                                  uint32_t trans_b, uint32_t accumulate) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) return;
    for (u64 i = blockIdx.y; i < m; i += gridDim.y) {
        float s = 0.0f;
        for (u64 kk = 0; kk < k; ++kk) {
            float av = load(a, ad, trans_a ? kk * m + i : i * k + kk);
            float bv = load(b, bd, trans_b ? j * k + kk : kk * n + j);
            s = __fadd_rn(s, __fmul_rn(av, bv));
        }
        if (accumulate) s = __fadd_rn(s, c[i * n + j]);
        c[i * n + j] = s;
    }
}

// ---- model ops (f32, row-major [rows, cols]) ----

// x[r, c] <- x[r, c] + bias[c].
extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias, u64 n,
                                    u64 cols) {
    GRID_STRIDE(i, n) x[i] = __fadd_rn(x[i], bias[i % cols]);
}

// s[c] = sum over rows in order from +0; dbias <- s (+ dbias when accumulating).
extern "C" __global__ void bias_grad(const float* __restrict__ dy, float* __restrict__ dbias,
                                     u64 rows, u64 cols, uint32_t accumulate) {
    GRID_STRIDE(c, cols) {
        float s = 0.0f;
        for (u64 r = 0; r < rows; ++r) s = __fadd_rn(s, dy[r * cols + c]);
        if (accumulate) s = __fadd_rn(s, dbias[c]);
        dbias[c] = s;
    }
}

// rstd[r] = 1 / sqrt(ss / cols + eps), ss = sum x^2 in index order (one thread per row).
extern "C" __global__ void rms_norm_rstd(const float* __restrict__ x, float* __restrict__ rstd,
                                         u64 rows, u64 cols, float eps) {
    GRID_STRIDE(r, rows) {
        const float* xr = x + r * cols;
        float ss = 0.0f;
        for (u64 j = 0; j < cols; ++j) ss = __fadd_rn(ss, __fmul_rn(xr[j], xr[j]));
        rstd[r] = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)cols), eps)));
    }
}

// y = (x * rstd[row]) * weight[col].
// y of dtype code yd (f32 or bf16: the f32 value rounded once).
extern "C" __global__ void rms_norm_apply(const float* __restrict__ x, const float* __restrict__ w,
                                          const float* __restrict__ rstd, uint8_t* __restrict__ y,
                                          u64 n, u64 cols, uint32_t yd) {
    GRID_STRIDE(i, n) store(y, yd, i, __fmul_rn(__fmul_rn(x[i], rstd[i / cols]), w[i % cols]));
}

// mean[r] = (sum_j g_j * xhat_j in index order) / cols, g = dy * w, xhat = x * rstd.
extern "C" __global__ void rms_norm_bwd_mean(const float* __restrict__ x,
                                             const float* __restrict__ w,
                                             const float* __restrict__ rstd,
                                             const float* __restrict__ dy,
                                             float* __restrict__ mean, u64 rows, u64 cols) {
    GRID_STRIDE(r, rows) {
        float rs = rstd[r];
        float dot = 0.0f;
        for (u64 j = 0; j < cols; ++j) {
            float xh = __fmul_rn(x[r * cols + j], rs);
            float g = __fmul_rn(dy[r * cols + j], w[j]);
            dot = __fadd_rn(dot, __fmul_rn(g, xh));
        }
        mean[r] = __fdiv_rn(dot, (float)cols);
    }
}

// dx = rstd * (g - xhat * mean).
extern "C" __global__ void rms_norm_bwd_dx(const float* __restrict__ x, const float* __restrict__ w,
                                           const float* __restrict__ rstd,
                                           const float* __restrict__ dy,
                                           const float* __restrict__ mean, float* __restrict__ dx,
                                           u64 n, u64 cols) {
    GRID_STRIDE(i, n) {
        u64 r = i / cols;
        float rs = rstd[r];
        float xh = __fmul_rn(x[i], rs);
        float g = __fmul_rn(dy[i], w[i % cols]);
        dx[i] = __fmul_rn(rs, __fsub_rn(g, __fmul_rn(xh, mean[r])));
    }
}

// dweight[c] <- (sum over rows in order of dy * xhat, from +0) + dweight[c].
extern "C" __global__ void rms_norm_bwd_dw(const float* __restrict__ x,
                                           const float* __restrict__ rstd,
                                           const float* __restrict__ dy, float* __restrict__ dw,
                                           u64 rows, u64 cols) {
    GRID_STRIDE(c, cols) {
        float s = 0.0f;
        for (u64 r = 0; r < rows; ++r) {
            float xh = __fmul_rn(x[r * cols + c], rstd[r]);
            s = __fadd_rn(s, __fmul_rn(dy[r * cols + c], xh));
        }
        dw[c] = __fadd_rn(s, dw[c]);
    }
}

__device__ __forceinline__ float tanh32(float x) { return (float)tanh((double)x); }
__device__ __forceinline__ float exp32(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float ln32(float x) { return (float)log((double)x); }

// y = 0.5 x (1 + tanh(beta (x + kappa (x x) x))).
extern "C" __global__ void gelu(const float* __restrict__ x, float* __restrict__ y, u64 n,
                                float beta, float kappa) {
    GRID_STRIDE(i, n) {
        float v = x[i];
        float inner = __fmul_rn(beta, __fadd_rn(v, __fmul_rn(kappa, __fmul_rn(__fmul_rn(v, v), v))));
        y[i] = __fmul_rn(__fmul_rn(0.5f, v), __fadd_rn(1.0f, tanh32(inner)));
    }
}

// dx = dy (0.5 (1 + t) + (0.5 x)(1 - t t)(beta (1 + (3 kappa) x^2))).
extern "C" __global__ void gelu_backward(const float* __restrict__ x, const float* __restrict__ dy,
                                         float* __restrict__ dx, u64 n, float beta, float kappa) {
    float three_kappa = __fmul_rn(3.0f, kappa);
    GRID_STRIDE(i, n) {
        float v = x[i];
        float x_sq = __fmul_rn(v, v);
        float inner = __fmul_rn(beta, __fadd_rn(v, __fmul_rn(kappa, __fmul_rn(x_sq, v))));
        float t = tanh32(inner);
        float left = __fmul_rn(0.5f, v);
        float right = __fadd_rn(1.0f, t);
        float left_d = __fmul_rn(0.5f, right);
        float right_d = __fmul_rn(__fmul_rn(left, __fsub_rn(1.0f, __fmul_rn(t, t))),
                                  __fmul_rn(beta, __fadd_rn(1.0f, __fmul_rn(three_kappa, x_sq))));
        dx[i] = __fmul_rn(dy[i], __fadd_rn(left_d, right_d));
    }
}

// dpred = c (pred - target).
extern "C" __global__ void mse_backward(const float* __restrict__ p, const float* __restrict__ t,
                                        float* __restrict__ d, u64 n, float c) {
    GRID_STRIDE(i, n) d[i] = __fmul_rn(c, __fsub_rn(p[i], t[i]));
}

// Per row: mx = max x (NaN ignored, from -inf), s = sum exp(x - mx) in index order; stats[2r] =
// mx, stats[2r+1] = s; loss[r] = -((x_target - mx) - ln s) when loss is not null.
extern "C" __global__ void softmax_row_stats(const float* __restrict__ x,
                                             const float* __restrict__ targets,
                                             float* __restrict__ stats, float* __restrict__ loss,
                                             u64 rows, u64 classes) {
    GRID_STRIDE(r, rows) {
        const float* xr = x + r * classes;
        float mx = __uint_as_float(0xFF800000u);
        for (u64 j = 0; j < classes; ++j) mx = fmaxf(mx, xr[j]);
        float s = 0.0f;
        for (u64 j = 0; j < classes; ++j) s = __fadd_rn(s, exp32(__fsub_rn(xr[j], mx)));
        stats[2 * r] = mx;
        stats[2 * r + 1] = s;
        if (loss != nullptr) {
            u64 t = (u64)targets[r];
            loss[r] = -__fsub_rn(__fsub_rn(xr[t], mx), ln32(s));
        }
    }
}

// dlogits = c (exp(x - mx) / s - [j == target]).
extern "C" __global__ void softmax_xent_backward(const float* __restrict__ x,
                                                 const float* __restrict__ targets,
                                                 const float* __restrict__ stats,
                                                 float* __restrict__ d, u64 n, u64 classes,
                                                 float c) {
    GRID_STRIDE(i, n) {
        u64 r = i / classes, j = i % classes;
        float e = exp32(__fsub_rn(x[i], stats[2 * r]));
        float onehot = j == (u64)targets[r] ? 1.0f : 0.0f;
        d[i] = __fmul_rn(c, __fsub_rn(__fdiv_rn(e, stats[2 * r + 1]), onehot));
    }
}

// ---- quantization formats (lowbit_formats::scalar, bit for bit; the encoders are in
// include/lowbit_convert.cuh) ----

// The tensor-level NVFP4 factors from the global amax bits `amax_bits[0]`, with
// lowbit_formats::nvfp4's f32 operations: params[0] = k = fl32(S_enc * fl32(1/6)),
// params[1 + sf] = min(1 / (float(sf) * S_dec), FLT_MAX) for every scale byte, where
// S_enc = min(2688 / amax, FLT_MAX), or 1 when amax == 0 or S_enc == 0, S_dec = 1 / S_enc.
// `e4m3` is the table of the 256 E4M3 values. Launch with one block of 256 threads.
extern "C" __global__ void nvfp4_params(const uint32_t* __restrict__ amax_bits,
                                        const float* __restrict__ e4m3,
                                        float* __restrict__ params) {
    const float flt_max = __uint_as_float(0x7F7FFFFFu);
    float amax = __uint_as_float(amax_bits[0]);
    float s_enc = fminf(__fdiv_rn(2688.0f, amax), flt_max);
    if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    float s_dec = __fdiv_rn(1.0f, s_enc);
    unsigned sf = threadIdx.x;
    if (sf == 0) params[0] = __fmul_rn(s_enc, __uint_as_float(0x3E2AAAABu));
    if (sf < 256) params[1 + sf] = fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3[sf], s_dec)), flt_max);
}

// NVFP4 rowwise copy, 1x16 blocks, round to nearest: one thread per block (r, kb). `params`
// holds k and the reciprocal table from nvfp4_params. data: rows x ceil(cols/2) bytes (element 2j
// in the low nibble; an odd tail leaves the last high nibble 0); scales: rows x ceil(cols/16).
// `vec` (host-checked): bf16 input, cols % 16 == 0, x 16-byte and data 8-byte aligned: each
// block is two 16-byte loads and one 8-byte store, and its amax is taken on packed bf16 pairs
// (__habs2/__hmax2 ignore NaN like the f32 amax; bf16 -> f32 is exact, so it is the same
// number). Grid: x covers a row's blocks (one thread each), y walks the rows (strided).
extern "C" __global__ void nvfp4_quantize_rows(const uint8_t* __restrict__ x, uint32_t xd,
                                               uint8_t* __restrict__ data,
                                               uint8_t* __restrict__ scales,
                                               const float* __restrict__ params, u64 rows,
                                               u64 cols, uint32_t vec) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 nb = (cols + 15) / 16, rb = (cols + 1) / 2;
    u64 kb = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (kb >= nb) return;
    u64 c0 = kb * 16;
    u64 len = cols - c0 < 16 ? cols - c0 : 16;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        float f[16];
        uint32_t amax = 0;
        if (vec) {
            const uint4* src = reinterpret_cast<const uint4*>(x + 2 * (r * cols + c0));
            uint4 raw[2] = {src[0], src[1]};
            const uint16_t* h = reinterpret_cast<const uint16_t*>(raw);
            const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(raw);
            // From +0, so that an all-NaN block has amax 0 (max.bf16x2 returns the non-NaN).
            __nv_bfloat162 m2 = __floats2bfloat162_rn(0.0f, 0.0f);
#pragma unroll
            for (int i = 0; i < 8; ++i) m2 = __hmax2(m2, __habs2(p2[i]));
            amax = __float_as_uint(fmaxf(__low2float(m2), __high2float(m2)));
#pragma unroll
            for (int i = 0; i < 16; ++i) f[i] = bf16_bits_to_f32(h[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                f[i] = (u64)i < len ? load(x, xd, r * cols + c0 + i) : 0.0f;
                uint32_t a = abs_bits_nan_zero(f[i]);
                amax = a > amax ? a : amax;
            }
        }
        uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
        float m = rcp[sf];
        scales[r * nb + kb] = (uint8_t)sf;
        uint8_t* out = data + r * rb + kb * 8;
        if (vec) {
            unsigned long long packed = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                uint32_t lo = e2m1_code(__fmul_rn(f[2 * j], m));
                uint32_t hi = e2m1_code(__fmul_rn(f[2 * j + 1], m));
                packed |= (unsigned long long)(lo | (hi << 4)) << (8 * j);
            }
            *reinterpret_cast<unsigned long long*>(out) = packed;
            continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if ((u64)(2 * j) >= len) break;
            uint32_t lo = e2m1_code(__fmul_rn(f[2 * j], m));
            uint32_t hi = (u64)(2 * j + 1) < len ? e2m1_code(__fmul_rn(f[2 * j + 1], m)) : 0u;
            out[j] = (uint8_t)(lo | (hi << 4));
        }
    }
}

// e2m1_code with fewer operations (the same nibble for every f32 input, checked exhaustively
// on the host against e2m1_code): clamping |x| at 6.0 instead of 8.0 makes the saturation of
// the code implicit (6.0 encodes as 7, and every larger magnitude, Inf and NaN included,
// clamps to it), and the normal-range bias is folded into the rounding addend.
__device__ __forceinline__ uint32_t e2m1_code_v2(float x) {
    uint32_t bits = __float_as_uint(x);
    uint32_t a = bits & 0x7FFFFFFFu;
    uint32_t ac = a < 0x40C00000u ? a : 0x40C00000u;
    uint32_t odd = (ac >> 22) & 1u;
    // ((ac + 2^21 - 1 + odd) >> 22) - 252 for ac >= 1.0 (= 254 << 22, so no wrap there).
    uint32_t normal = (ac + odd + (0x1FFFFFu - (252u << 22))) >> 22;
    uint32_t sub = __float_as_uint(__fadd_rn(__uint_as_float(ac), 4194304.0f)) - 0x4A800000u;
    uint32_t code = ac >= 0x3F800000u ? normal : sub;
    uint32_t sign = a > 0x7F800000u ? 0u : (bits >> 28) & 0x8u;
    return code | sign;
}

// max_abs_bits for bf16 with 16-byte loads, four in flight per thread and loop iteration
// (streaming hint), amaxes on packed bf16 pairs (__habs2/__hmax2 from +0 ignore NaN exactly as
// amax_bits_of does; bf16 -> f32 is exact, so the maximum's bits are bf16 bits << 16). `x`
// 16-byte aligned; the last n % 8 elements element by element. One atomic per block.
extern "C" __global__ void max_abs_bits_bf16_v2(const uint8_t* __restrict__ x, u64 n,
                                                uint32_t* __restrict__ out) {
    __shared__ uint32_t warp_max[32];
    const uint4* v = reinterpret_cast<const uint4*>(x);
    const u64 chunks = n / 8;
    const u64 T = (u64)gridDim.x * blockDim.x;
    u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
    __nv_bfloat162 m0 = zero2, m1 = zero2;
    for (; i + 3 * T < chunks; i += 4 * T) {
        uint4 q[4] = {__ldcs(v + i), __ldcs(v + i + T), __ldcs(v + i + 2 * T), __ldcs(v + i + 3 * T)};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&q[k]);
            m0 = __hmax2(m0, __habs2(p[0]));
            m1 = __hmax2(m1, __habs2(p[1]));
            m0 = __hmax2(m0, __habs2(p[2]));
            m1 = __hmax2(m1, __habs2(p[3]));
        }
    }
    for (; i < chunks; i += T) {
        uint4 q = __ldcs(v + i);
        const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&q);
        m0 = __hmax2(m0, __habs2(p[0]));
        m1 = __hmax2(m1, __habs2(p[1]));
        m0 = __hmax2(m0, __habs2(p[2]));
        m1 = __hmax2(m1, __habs2(p[3]));
    }
    m0 = __hmax2(m0, m1);
    uint32_t mb = *reinterpret_cast<uint32_t*>(&m0);
    uint32_t m = max(mb << 16, mb & 0xFFFF0000u);
    const uint16_t* h = reinterpret_cast<const uint16_t*>(x);
    for (u64 j = chunks * 8 + (u64)blockIdx.x * blockDim.x + threadIdx.x; j < n; j += T)
        m = max(m, abs_bits_nan_zero(bf16_bits_to_f32(h[j])));
    for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; ++w) m = max(m, warp_max[w]);
        if (m != 0) atomicMax(out, m);
    }
}

// NVFP4 rowwise copy, version 2, for bf16 with cols % 32 == 0, x 16-byte and data 16-byte
// aligned: one thread per two 1x16 blocks (four 16-byte streaming loads in flight, one 16-byte
// store of codes, one 2-byte store of scales), amaxes on packed bf16 pairs, e2m1_code_v2. Same
// bytes as nvfp4_quantize_rows. Grid: x covers a row's block pairs, y walks the rows (strided).
extern "C" __global__ void nvfp4_quantize_rows_v2(const uint8_t* __restrict__ x,
                                                  uint8_t* __restrict__ data,
                                                  uint8_t* __restrict__ scales,
                                                  const float* __restrict__ params, u64 rows,
                                                  u64 cols) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 nb = cols / 16, rb = cols / 2;
    u64 kp = (u64)blockIdx.x * blockDim.x + threadIdx.x;  // block pair
    if (kp * 2 >= nb) return;
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint4* src = reinterpret_cast<const uint4*>(x + 2 * (r * cols + kp * 32));
        uint4 raw[4] = {__ldcs(src), __ldcs(src + 1), __ldcs(src + 2), __ldcs(src + 3)};
        uint32_t words[4];
        uint32_t sfs = 0;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(&raw[2 * b]);
            const uint16_t* h = reinterpret_cast<const uint16_t*>(&raw[2 * b]);
            __nv_bfloat162 m2 = zero2;
#pragma unroll
            for (int i = 0; i < 8; ++i) m2 = __hmax2(m2, __habs2(p2[i]));
            uint32_t amax = __float_as_uint(fmaxf(__low2float(m2), __high2float(m2)));
            uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
            float m = rcp[sf];
            sfs |= sf << (8 * b);
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                uint32_t word = 0;
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    int e = 8 * w + 2 * j;
                    uint32_t lo = e2m1_code_v2(__fmul_rn(bf16_bits_to_f32(h[e]), m));
                    uint32_t hi = e2m1_code_v2(__fmul_rn(bf16_bits_to_f32(h[e + 1]), m));
                    word |= (lo | (hi << 4)) << (8 * j);
                }
                words[2 * b + w] = word;
            }
        }
        *reinterpret_cast<uint16_t*>(scales + r * nb + kp * 2) = (uint16_t)sfs;
        *reinterpret_cast<uint4*>(data + r * rb + kp * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream
// serialization may start while the kernel before it on the stream still runs; it must wait
// (griddepcontrol.wait: that kernel has completed and its writes are visible) before reading
// anything that kernel writes. Launched without the attribute, the wait returns at once. The
// kernel before it lets its dependents start early with launch_dependents.
__device__ __forceinline__ void grid_dependency_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void grid_dependents_launch() {
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// ---- NVFP4 rowwise, version 3: E2M1 codes by comparing the bf16 inputs with per-scale
// thresholds (no f32 product per element) ----
//
// The CPU code of element x in a block with scale byte sf is e2m1(fl32(x * rcp[sf])). For
// x >= 0 the product fl32(x * m) (m = rcp[sf] > 0, finite) and the E2M1 rounding are both
// monotone, so the magnitude code is the number of thresholds t_1..t_7 that |x| exceeds,
// where t_i is the largest bf16 magnitude whose product does not pass step i of RNE E2M1:
// v > 0.25, v >= 0.75, v > 1.25, v >= 1.75, v > 2.5, v >= 3.5, v > 5 (ties to the even code;
// above 5 the code saturates at 7 = 6.0). RNE is sign-symmetric, so a negative x gets the
// same magnitude code and the sign nibble bit (-0 included); +-Inf exceed every threshold
// (Inf * m = Inf), and NaN (code 7, sign 0) is handled by the per-element path.
__constant__ float NVFP4_STEPS[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

// nvfp4_params plus the threshold table: params[0] = k, params[1 + sf] = rcp[sf] as
// nvfp4_params; from word 260 (16-byte aligned when params is), 8 words per scale byte sf:
// t_1..t_7 as bf16 magnitudes duplicated in both halves of a word, then 0x7F7F7F7F. Launch
// with 8 blocks of 256 threads: thread (sf, i) = (global id / 8, global id % 8) finds t_{i+1}
// by bisection over the bf16 magnitudes 0..0x7F80 (cond(0) false; cond(Inf) true).
// Thread g's part of nvfp4_params_v3 (nvfp4_params_v9 runs it for two g a thread).
__device__ __forceinline__ void nvfp4_params_v3_part(const uint32_t* __restrict__ amax_bits,
                                                     const float* __restrict__ e4m3,
                                                     float* __restrict__ params, unsigned g) {
    const float flt_max = __uint_as_float(0x7F7FFFFFu);
    float amax = __uint_as_float(amax_bits[0]);
    float s_enc = fminf(__fdiv_rn(2688.0f, amax), flt_max);
    if (amax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    float s_dec = __fdiv_rn(1.0f, s_enc);
    unsigned sf = g / 8, i = g % 8;
    if (sf >= 256) return;
    float m = fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3[sf], s_dec)), flt_max);
    if (g == 0) params[0] = __fmul_rn(s_enc, __uint_as_float(0x3E2AAAABu));
    if (i == 0) params[1 + sf] = m;
    uint32_t* thr = reinterpret_cast<uint32_t*>(params) + 260 + 8 * sf;
    if (i == 7) {
        thr[7] = 0x7F7F7F7Fu;
        return;
    }
    float step = NVFP4_STEPS[i];
    bool strict = (i % 2) == 0;
    uint32_t lo = 0, hi = 0x7F80u;
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        float v = __fmul_rn(__uint_as_float(mid << 16), m);
        bool pass = strict ? v > step : v >= step;
        if (pass) hi = mid; else lo = mid;
    }
    thr[i] = lo | (lo << 16);
}

extern "C" __global__ void nvfp4_params_v3(const uint32_t* __restrict__ amax_bits,
                                           const float* __restrict__ e4m3,
                                           float* __restrict__ params) {
    nvfp4_params_v3_part(amax_bits, e4m3, params, blockIdx.x * blockDim.x + threadIdx.x);
}

// The class table's place in the parameters (words from `params`; the full table starts at 260).
#define NVFP4_CLASS_WORD 2308u
#define NVFP4_SFLO_WORD 2372u

// The class table of version 9 (Nvfp4Thr) from the full table of nvfp4_params_v3_part, which
// this block wrote into `params` (nvfp4_params_v9 runs it after a barrier; any block size of at
// least 128 threads). Class c's reference is the largest
// scale byte of its mantissa, ref = 8·15 + c (8·14 + 7 for c = 7: 0x7F is E4M3's NaN, never a
// scale); the prediction for sf = 8·E + c of its threshold word i is
// full[ref][i] - E_ref · 0x00800080 + E · 0x00800080 (mod 2^32). Thread sf compares the
// prediction with full[sf] for i < 7 (equal 32-bit words mean equal thresholds: 0x10001 is
// odd); sf_lo (word NVFP4_SFLO_WORD) is one above the largest scale byte that differs, so the
// predictions hold for every sf in sf_lo ..= 0x7E (0 when none differs).
__device__ __forceinline__ void nvfp4_params_classes_part(float* __restrict__ params) {
    const uint32_t* full = reinterpret_cast<const uint32_t*>(params) + 260;
    uint32_t* out = reinterpret_cast<uint32_t*>(params);
    __shared__ int bad;
    if (threadIdx.x == 0) bad = -1;
    __syncthreads();
    const uint32_t sf = threadIdx.x, c = sf & 7u, ref = c == 7u ? 0x77u : 0x78u + c;
    const uint32_t base = (ref >> 3) * 0x00800080u;
    if (sf <= 0x7Eu) {
        const uint32_t e = (sf >> 3) * 0x00800080u;
        // Every word compared (no short circuit): the 14 loads go out together.
        uint32_t diff = 0;
#pragma unroll
        for (uint32_t i = 0; i < 7; ++i) diff |= (full[8 * ref + i] - base + e) ^ full[8 * sf + i];
        if (diff != 0) atomicMax(&bad, (int)sf);
    }
    if (sf < 8) {
        // nvfp4_thresholds' select form: t_1..t_4 less the reference's exponent, then the
        // differences (the same for every sf of the class that the predictions hold for).
        const uint32_t* r = full + 8 * ref;
        uint32_t* o = out + NVFP4_CLASS_WORD + 8 * sf;
        for (uint32_t i = 0; i < 4; ++i) o[i] = r[i] - base;
        o[4] = r[1] - r[5], o[5] = r[0] - r[4], o[6] = r[2] - r[6], o[7] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) out[NVFP4_SFLO_WORD] = (uint32_t)(bad + 1);
}

// Version 9's parameters: nvfp4_params_v3's and the class table in one launch, one block of 1024
// threads: thread t the parts g = t and t + 1024 of nvfp4_params_v3, then (the table visible
// to the block after a barrier) the class table.
extern "C" __global__ void __launch_bounds__(1024) nvfp4_params_v9(
    const uint32_t* __restrict__ amax_bits, const float* __restrict__ e4m3,
    float* __restrict__ params) {
    // Version 10 launches the both-copies kernel as this one's programmatic dependent: its CTAs
    // may start now (they copy their first tile, then wait for this kernel to complete).
    grid_dependents_launch();
    nvfp4_params_v3_part(amax_bits, e4m3, params, threadIdx.x);
    nvfp4_params_v3_part(amax_bits, e4m3, params, threadIdx.x + 1024);
    __syncthreads();
    nvfp4_params_classes_part(params);
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
    uint32_t d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ uint32_t hgt2_mask(uint32_t a, uint32_t b) {
    uint32_t d;
    asm("set.gt.u32.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

// (m & a) | (~m & b) per bit.
__device__ __forceinline__ uint32_t bsel(uint32_t m, uint32_t a, uint32_t b) {
    return (m & a) | (~m & b);
}

// Where the element pairs (e, e + 4), e < 4, of eight bf16 elements come from: lo(e) and hi(e)
// hold elements e and e + 4, permute selector sel(e) makes the pair (e in the low half) and
// ssel(e) its sign masks; row(j) is the row-block word j (elements 2j | 2j + 1 << 16).
// Nvfp4RowPairs: the elements as a row block holds them, word j of `a` = row(j).
struct Nvfp4RowPairs {
    const uint32_t* a;
    __device__ __forceinline__ uint32_t lo(int e) const { return a[e / 2]; }
    __device__ __forceinline__ uint32_t hi(int e) const { return a[e / 2 + 2]; }
    __device__ __forceinline__ uint32_t sel(int e) const { return e % 2 ? 0x7632u : 0x5410u; }
    __device__ __forceinline__ uint32_t ssel(int e) const { return e % 2 ? 0xFFBBu : 0xDD99u; }
    __device__ __forceinline__ uint32_t row(int j) const { return a[j]; }
};
// Nvfp4ColPairs<H>: column c + H of a staged column pair, word i of `w` holding row i of
// columns c and c + 1 (the columnwise tiles): a pair is one permute of two tile words, with no
// permute into row-block order first.
template <unsigned H>
struct Nvfp4ColPairs {
    const uint32_t* w;
    __device__ __forceinline__ uint32_t lo(int e) const { return w[e]; }
    __device__ __forceinline__ uint32_t hi(int e) const { return w[e + 4]; }
    __device__ __forceinline__ uint32_t sel(int) const { return H ? 0x7632u : 0x5410u; }
    __device__ __forceinline__ uint32_t ssel(int) const { return H ? 0xFFBBu : 0xDD99u; }
    __device__ __forceinline__ uint32_t row(int j) const {
        return prmt(w[2 * j], w[2 * j + 1], sel(0));
    }
};

// Pair e of `p` as the word functions compare it: k = |x| of elements e and e + 4 as one
// bf16x2 pair (through __habs2: an HFMA2 with an |a| operand, the FMA pipe, not the ALU), s
// their sign masks (0xFFFF per negative half, -0 included).
template <class P>
__device__ __forceinline__ void nvfp4_pair(P p, int e, uint32_t& k, uint32_t& s) {
    const uint32_t lo = p.lo(e), hi = p.hi(e);
    uint32_t kr = prmt(lo, hi, p.sel(e));
    __nv_bfloat162 kb = __habs2(*reinterpret_cast<__nv_bfloat162*>(&kr));
    k = *reinterpret_cast<uint32_t*>(&kb);
    s = prmt(lo, hi, p.ssel(e));
}

// The 8 nibbles of elements 0..7 (bf16 pairs in words a[0..3], no NaN among them) as one
// word, element e at bits 4e..4e+3. Elements e and e + 4 are compared as one bf16x2 pair (their
// nibbles lie 16 bits apart); each comparison gives a full 16-bit mask per element. A binary
// search over the thresholds t (t[0..6] = t_1..t_7, duplicated per half): bit 2 = |x| > t_4,
// bit 1 = |x| > (bit 2 ? t_6 : t_2), bit 0 = |x| > the odd threshold between.
// (The elements come from `p`, Nvfp4RowPairs or Nvfp4ColPairs.)
template <class P>
__device__ __forceinline__ uint32_t nvfp4_word_v3(P p, const uint32_t* t) {
    uint32_t acc = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        uint32_t k, s;
        nvfp4_pair(p, e, k, s);
        uint32_t m2 = hgt2_mask(k, t[3]);
        uint32_t m1 = hgt2_mask(k, bsel(m2, t[5], t[1]));
        uint32_t tq = bsel(m2, bsel(m1, t[6], t[4]), bsel(m1, t[2], t[0]));
        uint32_t m0 = hgt2_mask(k, tq);
        uint32_t c = 0x00010001u << (4 * e);
        acc |= m0 & c;
        acc |= m1 & (c << 1);
        acc |= m2 & (c << 2);
        acc |= s & (c << 3);
    }
    return acc;
}

// a * b + c (mod 2^32) as an integer multiply-add (the FMA pipe), kept from being rewritten
// into shifts and adds (the ALU pipe).
__device__ __forceinline__ uint32_t imad(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The magnitude code bits of element pair e (k: the pair's |x| as bf16 halves) added to `acc`
// at nibbles 2e and 2e + 1: the binary search over the thresholds t_1..t_4 (t[0..3]) and, by
// multiply-add selects on the masks, t_5..t_7 (from the differences d51 = t_2 - t_6, d40 =
// t_1 - t_5, d62 = t_3 - t_7), each mask's bits merged by an integer multiply-add (the FMA
// pipe; nvfp4_word_v4's comment below derives both forms). nvfp4_word_v4 and nvfp4_word_v5
// share it.
__device__ __forceinline__ uint32_t nvfp4_pair_bits(uint32_t k, const uint32_t* t, uint32_t d51,
                                                    uint32_t d40, uint32_t d62, int e,
                                                    uint32_t acc) {
    const uint32_t inv = 0xFFFEFFFFu;
    const uint32_t m2 = hgt2_mask(k, t[3]);
    const uint32_t m1 = hgt2_mask(k, imad(m2, d51, t[1]));            // m2 ? t[5] : t[1]
    const uint32_t u = imad(m2, d40, t[0]), w = imad(m2, d62, t[2]);  // m2 ? t[4] : t[0], t[6] : t[2]
    const uint32_t m0 = hgt2_mask(k, bsel(m1, w, u));
    acc = imad(m0, inv << (4 * e), acc);
    acc = imad(m1, inv << (4 * e + 1), acc);
    return imad(m2, inv << (4 * e + 2), acc);
}

// nvfp4_word_v3's word with its selects and bit merges moved from the ALU to the FMA pipe.
// A comparison mask m is 0xFFFF per half where true, i.e. m = 0xFFFF · I with I the indicator
// word (1 per true half). 0xFFFF is odd, so it has an inverse mod 2^32, INV = 0xFFFEFFFF =
// -0x10001, and m · (INV · X) = I · X (mod 2^32). Hence:
// - a merge `acc |= m & (0x00010001 << k)` is acc + m · (INV << k): the bits are disjoint, so
//   the sum is the OR;
// - a select of duplicated thresholds `m ? B : A` (each half a bf16 magnitude, B >= A per half,
//   as the table's thresholds do not decrease) is A + m · (A - B): INV · d = -(d · 0x10001),
//   so m · (A - B) = I · d with d = b - a per half, and each half stays below 2^16 (no carry).
// Per element pair: two permutes, three compares and one select (the last one chooses
// between two per-half values) on the ALU, seven multiply-adds on the FMA pipe, where version
// 3 spends ten ALU instructions (the both-copies kernel waits on the ALU pipe; crates/lowbit-kernels/NOTES.md).
// Same words as nvfp4_word_v3.
template <class P>
__device__ __forceinline__ uint32_t nvfp4_word_v4(P p, const uint32_t* t) {
    const uint32_t inv = 0xFFFEFFFFu;
    const uint32_t d51 = t[1] - t[5], d40 = t[0] - t[4], d62 = t[2] - t[6];
    uint32_t acc = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        uint32_t k, s;
        nvfp4_pair(p, e, k, s);
        acc = nvfp4_pair_bits(k, t, d51, d40, d62, e, acc);
        acc = imad(s, inv << (4 * e + 3), acc);
    }
    return acc;
}

// The per-element path of nvfp4_block_words for a block holding a NaN (its 16 bf16 elements in
// a.w, m = rcp[sf]): the f32 product and e2m1_code_v2 per element. Out of line: NaN blocks are
// rare, and inlined into every block of the both-copies kernel this path made most of its
// 7824 SASS instructions, so the hot code's instruction fetches missed (crates/lowbit-kernels/NOTES.md).
struct Nvfp4Words8 {
    uint32_t w[8];
};
__device__ __noinline__ uint2 nvfp4_words_nan(Nvfp4Words8 a, float m) {
    uint32_t out[2];
#pragma unroll
    for (int w = 0; w < 2; ++w) {
        uint32_t word = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            uint32_t pair = a.w[4 * w + j];
            uint32_t lo = e2m1_code_v2(__fmul_rn(bf16_bits_to_f32((uint16_t)pair), m));
            uint32_t hi = e2m1_code_v2(__fmul_rn(bf16_bits_to_f32((uint16_t)(pair >> 16)), m));
            word |= (lo | (hi << 4)) << (8 * j);
        }
        out[w] = word;
    }
    return make_uint2(out[0], out[1]);
}

// The two code words of one 1x16 block (a row block of nvfp4_quantize_rows_v3 and
// nvfp4_quantize_both_v5, a column's block of nvfp4_quantize_cols_v4 and v5): `a` holds its
// 16 bf16 elements as v3's row block does (word j = elements 2j | 2j + 1 << 16), `sf` its
// scale byte, `nan` whether the block holds a NaN. Word w reads only a[4w .. 4w + 3].
// (nvfp4_block_words: the same for a block whose two halves of eight elements come from p0
// and p1, Nvfp4RowPairs or Nvfp4ColPairs.)
template <int WORD, class P>
__device__ __forceinline__ void nvfp4_block_words(P p0, P p1, uint32_t sf, bool nan,
                                                  const float* __restrict__ rcp,
                                                  const uint4* __restrict__ thr, uint32_t* out) {
    if (!nan) {
        uint4 t0 = __ldg(thr + 2 * sf), t1 = __ldg(thr + 2 * sf + 1);
        const uint32_t t[7] = {t0.x, t0.y, t0.z, t0.w, t1.x, t1.y, t1.z};
        out[0] = WORD == 4 ? nvfp4_word_v4(p0, t) : nvfp4_word_v3(p0, t);
        out[1] = WORD == 4 ? nvfp4_word_v4(p1, t) : nvfp4_word_v3(p1, t);
    } else {
        Nvfp4Words8 b;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            b.w[j] = p0.row(j);
            b.w[4 + j] = p1.row(j);
        }
        const uint2 o = nvfp4_words_nan(b, rcp[sf]);
        out[0] = o.x;
        out[1] = o.y;
    }
}

template <int WORD = 3>
__device__ __forceinline__ void nvfp4_col_words(const uint32_t* a, uint32_t sf, bool nan,
                                                const float* __restrict__ rcp,
                                                const uint4* __restrict__ thr, uint32_t* out) {
    nvfp4_block_words<WORD>(Nvfp4RowPairs{a}, Nvfp4RowPairs{a + 4}, sf, nan, rcp, thr, out);
}

// One 1x16 row block of nvfp4_quantize_rows_v3 (and nvfp4_quantize_both_v5): `a` holds its 16
// bf16 elements (word j = elements 2j | 2j + 1 << 16). The amax is a NaN-propagating max, so a
// block holding a NaN is seen at once: it takes the per-element path of version 2 (NaN-ignoring
// amax from +0, f32 product, e2m1_code_v2). Writes the two code words to out[0..1] and returns
// the scale byte.
template <int WORD = 3>
__device__ __forceinline__ uint32_t nvfp4_row_block_v3(const uint32_t* a, float k,
                                                       const float* __restrict__ rcp,
                                                       const uint4* __restrict__ thr,
                                                       uint32_t* out) {
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
    const __nv_bfloat162* p2 = reinterpret_cast<const __nv_bfloat162*>(a);
    __nv_bfloat162 m2 = zero2;
#pragma unroll
    for (int i = 0; i < 8; ++i) m2 = __hmax2_nan(m2, __habs2(p2[i]));
    uint32_t mb = *reinterpret_cast<uint32_t*>(&m2);
    bool has_nan = (mb & 0x7FFFu) > 0x7F80u || (mb >> 16) > 0x7F80u;
    if (has_nan) {
        m2 = zero2;
#pragma unroll
        for (int i = 0; i < 8; ++i) m2 = __hmax2(m2, __habs2(p2[i]));
    }
    uint32_t amax = __float_as_uint(fmaxf(__low2float(m2), __high2float(m2)));
    uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
    nvfp4_col_words<WORD>(a, sf, has_nan, rcp, thr, out);
    return sf;
}

// NVFP4 rowwise copy, version 3: nvfp4_quantize_rows_v2's layout and loads (bf16, cols % 32
// == 0, x and data 16-byte aligned, scales 2-byte aligned; a thread per two 1x16 blocks), the
// codes from the threshold table of nvfp4_params_v3 (`params`), each block by
// nvfp4_row_block_v3.
template <int WORD>
__device__ __forceinline__ void nvfp4_rows_body(const uint8_t* __restrict__ x,
                                                uint8_t* __restrict__ data,
                                                uint8_t* __restrict__ scales,
                                                const float* __restrict__ params, u64 rows,
                                                u64 cols) {
    const float k = params[0];
    const float* rcp = params + 1;
    const uint4* thr = reinterpret_cast<const uint4*>(params + 260);
    u64 nb = cols / 16, rb = cols / 2;
    u64 kp = (u64)blockIdx.x * blockDim.x + threadIdx.x;  // block pair
    if (kp * 2 >= nb) return;
    for (u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const uint4* src = reinterpret_cast<const uint4*>(x + 2 * (r * cols + kp * 32));
        uint4 raw[4] = {__ldcs(src), __ldcs(src + 1), __ldcs(src + 2), __ldcs(src + 3)};
        uint32_t words[4];
        uint32_t sfs = 0;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            const uint32_t* a = reinterpret_cast<const uint32_t*>(&raw[2 * b]);
            sfs |= nvfp4_row_block_v3<WORD>(a, k, rcp, thr, &words[2 * b]) << (8 * b);
        }
        *reinterpret_cast<uint16_t*>(scales + r * nb + kp * 2) = (uint16_t)sfs;
        *reinterpret_cast<uint4*>(data + r * rb + kp * 16) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
}

extern "C" __global__ void nvfp4_quantize_rows_v3(const uint8_t* __restrict__ x,
                                                  uint8_t* __restrict__ data,
                                                  uint8_t* __restrict__ scales,
                                                  const float* __restrict__ params, u64 rows,
                                                  u64 cols) {
    nvfp4_rows_body<3>(x, data, scales, params, rows, cols);
}

// Version 4 (`set_cuda_kernel_variant("nvfp4", 7)`): version 3 with nvfp4_word_v4. Same bytes.
extern "C" __global__ void nvfp4_quantize_rows_v4(const uint8_t* __restrict__ x,
                                                  uint8_t* __restrict__ data,
                                                  uint8_t* __restrict__ scales,
                                                  const float* __restrict__ params, u64 rows,
                                                  u64 cols) {
    nvfp4_rows_body<4>(x, data, scales, params, rows, cols);
}

// NVFP4 columnwise copy straight from X (rows % 16 == 0): the 1x16 blocks of the transpose are
// 16 consecutive rows of a column. One thread per (column, group of `per` row blocks);
// consecutive threads take consecutive columns, so the loads coalesce, and each thread writes
// `per` consecutive 8-byte codes of its column's output row (8-byte stores when `vec`: data
// 8-byte aligned). data: cols x rows/2, scales: cols x rows/16.
extern "C" __global__ void nvfp4_quantize_cols(const uint8_t* __restrict__ x, uint32_t xd,
                                               uint8_t* __restrict__ data,
                                               uint8_t* __restrict__ scales,
                                               const float* __restrict__ params, u64 rows,
                                               u64 cols, uint32_t per, uint32_t vec) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 nbr = rows / 16, rb = rows / 2;
    u64 groups = nbr / per;
    GRID_STRIDE(item, groups * cols) {
        u64 g = item / cols, c = item % cols;
        for (u64 b = g * per; b < (g + 1) * per; ++b) {
            float f[16];
            uint32_t amax = 0;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                f[i] = load(x, xd, (b * 16 + i) * cols + c);
                uint32_t a = abs_bits_nan_zero(f[i]);
                amax = a > amax ? a : amax;
            }
            uint32_t sf = e4m3_code(__fmul_rn(__uint_as_float(amax), k));
            float m = rcp[sf];
            scales[c * nbr + b] = (uint8_t)sf;
            unsigned long long packed = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                uint32_t lo = e2m1_code(__fmul_rn(f[2 * j], m));
                uint32_t hi = e2m1_code(__fmul_rn(f[2 * j + 1], m));
                packed |= (unsigned long long)(lo | (hi << 4)) << (8 * j);
            }
            uint8_t* out = data + c * rb + b * 8;
            if (vec) {
                *reinterpret_cast<unsigned long long*>(out) = packed;
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) out[j] = (uint8_t)(packed >> (8 * j));
            }
        }
    }
}

// ---- NVFP4 columnwise, version 4: a shared-memory transpose ----
//
// nvfp4_quantize_cols reads 2-byte elements down columns and writes each column's 8-byte codes
// at a row pitch of rows/2 bytes (0.31x of copy bandwidth with both copies). Version 4 (bf16,
// cols % 8 == 0, x 16-byte aligned, data 8-byte aligned; host-checked) stages a tile of 256
// rows x 64 columns (32 KB) in shared memory with 16-byte `cp.async` copies (coalesced 128-byte
// row segments, all 16 per thread in flight, no registers held), then each lane of warp w takes
// the column pair (c0 + 2·lane, c0 + 2·lane + 1) over rows 64w .. 64w + 63 (four 1x16 blocks of
// the transpose per column): it reads the pair as one 32-bit word per row (a warp reads a whole
// 128-byte tile row: no bank conflicts), takes both columns' block amaxes on packed bf16 pairs,
// and forms each column's codes exactly as nvfp4_quantize_rows_v3 forms a row block's: the
// column's 16 elements gathered (PRMT) into v3's layout (words of element pairs (2j, 2j + 1)),
// then nvfp4_word_v3 with the column's threshold row (nvfp4_params_v3), or, for a block holding
// a NaN, v3's per-element path (NaN-ignoring amax, f32 product, e2m1_code_v2). Same bytes as
// nvfp4_quantize_cols (the CPU's columnwise copy is the rowwise copy of the transpose). Stores:
// per column 32 contiguous code bytes (two 16-byte stores when `flags & 1`: rows % 32 == 0 and
// data 16-byte aligned, else four 8-byte stores) and 4 scale bytes (one 4-byte store when
// `flags & 2`: rows % 64 == 0 and scales 4-byte aligned, else bytes); blocks past `rows` and
// columns past `cols` are neither computed nor stored (rows % 16 == 0 and cols % 8 == 0, so a
// block or a 16-byte chunk lies wholly inside or outside). Grid: x = ceil(cols / 64), y walks
// the 256-row tiles (strided); 128 threads, at most 80 registers (six CTAs per SM: 192 KB of
// tiles; uncapped it took 122, four CTAs; at seven it spills). The body is nvfp4c_load_tile,
// then nvfp4c_cols_part, which version 5 (nvfp4_quantize_both_v5) shares.
#define NVFP4C_ROWS 256u
#define NVFP4C_COLS 64u

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    uint32_t s = (uint32_t)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_all;" ::: "memory");
}

// ---- NVFP4 both copies, version 8: shorter chains per block, fewer instructions ----
//
// Version 7 spends ~25 instructions per element and waits on dependent chains (NOTES.md, "NVFP4
// both copies is instruction-bound, not store-bound"): per block a sequential amax chain, ~17 integer operations of e4m3_code per scale
// byte, then the threshold loads that depend on it. Version 8 (`set_cuda_kernel_variant("nvfp4",
// 8)`) keeps version 7's tile, loads, stores and word arithmetic, and changes what feeds it:
// - the scale bytes of two blocks come from one `cvt.rn.satfinite.e4m3x2.f32` (e4m3x2_code);
// - the block amaxes are trees of NaN-propagating maxima on |x| (depth 3 for 16 words);
// - |x| is taken once per word and serves both the amax and the codes (version 7 took it again
//   per element pair), the sign bits are merged first (nvfp4_signs) from the raw words, which
//   are then overwritten by their magnitudes (no second set of registers);
// - a block (or rowwise item) holding a NaN is recomputed from the staged tile by version 7's
//   code, out of line (nvfp4c_block_nan, nvfp4r_item_nan): the same bytes, off the hot path.

// The E4M3 codes of two non-NaN f32 values >= 0 (+Inf saturates to 448), lo | hi << 8: one
// hardware conversion. Equal to e4m3_code on every non-NaN f32 (crates/lowbit-kernels/check/e4m3_cvt.cu compares
// all 2^32 inputs on the GPU); the scale products here are never NaN (a block's amax is taken
// NaN-free first, and k is finite and positive).
__device__ __forceinline__ uint32_t e4m3x2_code(float lo, float hi) {
    uint16_t d;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
    return d;
}

// The sign bits of the eight elements of `p` (raw bf16 words) placed as a code word's nibble
// bit 3 (element e at bit 4e + 3), as nvfp4_word_v4 merges them.
template <class P>
__device__ __forceinline__ uint32_t nvfp4_signs(P p) {
    const uint32_t inv = 0xFFFEFFFFu;
    uint32_t acc = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) acc = imad(prmt(p.lo(e), p.hi(e), p.ssel(e)), inv << (4 * e + 3), acc);
    return acc;
}

// nvfp4_word_v4's magnitude bits for the elements of `p`, whose words already hold |x|
// (habs2), added to `acc` (the sign bits from nvfp4_signs). Same word as nvfp4_word_v4. `t` is
// in the select form of nvfp4_thresholds: t_1..t_4 (t[0..3]), then t_2 - t_6, t_1 - t_5 and
// t_3 - t_7 (the differences the multiply-add selects take; t_5..t_7 are used only there).
template <class P>
__device__ __forceinline__ uint32_t nvfp4_word_v5(P p, const uint32_t* t, uint32_t acc) {
    const uint32_t d51 = t[4], d40 = t[5], d62 = t[6];
#pragma unroll
    for (int e = 0; e < 4; ++e)
        acc = nvfp4_pair_bits(prmt(p.lo(e), p.hi(e), p.sel(e)), t, d51, d40, d62, e, acc);
    return acc;
}

__device__ __forceinline__ uint32_t habs2_bits(uint32_t w) {
    __nv_bfloat162 b = __habs2(*reinterpret_cast<const __nv_bfloat162*>(&w));
    return *reinterpret_cast<uint32_t*>(&b);
}

__device__ __forceinline__ uint32_t hmax2_nan_bits(uint32_t a, uint32_t b) {
    __nv_bfloat162 m = __hmax2_nan(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<uint32_t*>(&m);
}

// The NaN-propagating maximum of a[0..N-1] (bf16 pairs, each >= +0), as a tree.
template <int N>
__device__ __forceinline__ uint32_t hmax2_nan_tree(const uint32_t* a) {
    if constexpr (N == 1) {
        return a[0];
    } else {
        return hmax2_nan_bits(hmax2_nan_tree<N / 2>(a), hmax2_nan_tree<N - N / 2>(a + N / 2));
    }
}

// Whether either half of a bf16 pair of magnitudes is a NaN.
__device__ __forceinline__ bool bf16x2_has_nan(uint32_t m) {
    return (m & 0x7FFFu) > 0x7F80u || (m >> 16) > 0x7F80u;
}

struct Nvfp4Words16 {
    uint32_t w[16];
};
// A column pair's block (Nvfp4ColBlock: codes of column ca words 0 and 1, then of ca + 1; scale
// bytes sfa | sfb << 8) or a rowwise item's two blocks (Nvfp4RowItem: the four code words and
// the scale pair, both in the item's chunk order).
struct Nvfp4Out5 {
    uint32_t c[4];
    uint32_t sf;
};

// Versions 4 to 7's code for one column pair's block: wv[16] the raw tile words of rows 0..15
// (column ca low, ca + 1 high). Writes the codes to ca[0..1] and cb[0..1] and returns
// sfa | sfb << 8. The amaxes propagate NaN first; a block holding one takes them again,
// NaN-ignoring from +0 (an all-NaN block has amax 0), as abs_bits_nan_zero.
template <int WORD>
__device__ __forceinline__ uint32_t nvfp4c_block_v7(const uint32_t* wv, float k,
                                                    const float* __restrict__ rcp,
                                                    const uint4* __restrict__ thr, uint32_t* ca,
                                                    uint32_t* cb) {
    const __nv_bfloat162 zero2 = __floats2bfloat162_rn(0.0f, 0.0f);
    __nv_bfloat162 m2 = zero2;
#pragma unroll
    for (unsigned i = 0; i < 16; ++i)
        m2 = __hmax2_nan(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&wv[i])));
    uint32_t mb = *reinterpret_cast<uint32_t*>(&m2);
    const bool nan_a = (mb & 0x7FFFu) > 0x7F80u, nan_b = ((mb >> 16) & 0x7FFFu) > 0x7F80u;
    if (nan_a || nan_b) {
        m2 = zero2;
#pragma unroll
        for (unsigned i = 0; i < 16; ++i)
            m2 = __hmax2(m2, __habs2(*reinterpret_cast<const __nv_bfloat162*>(&wv[i])));
        mb = *reinterpret_cast<uint32_t*>(&m2);
    }
    // bf16 -> f32 is exact: the amax of column ca is the low half, of ca + 1 the high.
    const uint32_t sfa = e4m3_code(__fmul_rn(__uint_as_float(mb << 16), k));
    const uint32_t sfb = e4m3_code(__fmul_rn(__uint_as_float(mb & 0xFFFF0000u), k));
    // Column ca's elements are the low halves of wv, ca + 1's the high halves.
    nvfp4_block_words<WORD>(Nvfp4ColPairs<0>{wv}, Nvfp4ColPairs<0>{wv + 8}, sfa, nan_a, rcp, thr,
                            ca);
    nvfp4_block_words<WORD>(Nvfp4ColPairs<1>{wv}, Nvfp4ColPairs<1>{wv + 8}, sfb, nan_b, rcp, thr,
                            cb);
    return sfa | (sfb << 8);
}

// Version 7's code for one column pair's block holding a NaN (16 raw tile words, rows 0..15),
// out of line: versions 8 and 9 take it for such blocks (nvfp4c_block_v8).
__device__ __noinline__ Nvfp4Out5 nvfp4c_block_nan(Nvfp4Words16 a, float k,
                                                    const float* __restrict__ rcp,
                                                    const uint4* __restrict__ thr) {
    Nvfp4Out5 o;
    o.sf = nvfp4c_block_v7<4>(a.w, k, rcp, thr, &o.c[0], &o.c[2]);
    return o;
}

// Version 7's code for a rowwise item (two 1x16 blocks, 16 raw words in v3's row layout) one
// of whose blocks holds a NaN, out of line.
__device__ __noinline__ Nvfp4Out5 nvfp4r_item_nan(Nvfp4Words16 a, float k,
                                                   const float* __restrict__ rcp,
                                                   const uint4* __restrict__ thr) {
    Nvfp4Out5 o;
    const uint32_t s0 = nvfp4_row_block_v3<4>(a.w, k, rcp, thr, &o.c[0]);
    const uint32_t s1 = nvfp4_row_block_v3<4>(a.w + 8, k, rcp, thr, &o.c[2]);
    o.sf = s0 | (s1 << 8);
    return o;
}

// The threshold words of scale byte sf (nvfp4_params_v3's table) in nvfp4_word_v5's select
// form: t_1..t_4, then t_2 - t_6, t_1 - t_5, t_3 - t_7 (words 1 - 5, 0 - 4, 2 - 6 of the row).
__device__ __forceinline__ void nvfp4_thresholds(const uint4* __restrict__ thr, uint32_t sf,
                                                 uint32_t* t) {
    const uint4 t0 = __ldg(thr + 2 * sf), t1 = __ldg(thr + 2 * sf + 1);
    t[0] = t0.x, t[1] = t0.y, t[2] = t0.z, t[3] = t0.w;
    t[4] = t0.y - t1.y, t[5] = t0.x - t1.x, t[6] = t0.z - t1.z;
}

// Where versions 8 and 9 take a block's threshold words (Nvfp4Thr::get): version 8 from the
// full table of nvfp4_params_v3 (`full`, 32 bytes per scale byte: a warp's loads gather from
// as many sectors as its lanes have distinct scale bytes, which made the L1 data pipe the
// busiest unit of the both-copies kernel, crates/lowbit-kernels/NOTES.md); version 9 (CLASSES) from the 8-entry
// class table of nvfp4_params_v9 (256 bytes, copied to shared memory by the caller): a
// scale byte sf = 8·E + c (E4M3 exponent field E, mantissa c) at or above `sf_lo` has the
// threshold words t_1..t_4 = cls[c][i] + E · 0x00800080 and the class's differences (the
// thresholds scale with the block scale's power of two; nvfp4_params_v9 checked that, word
// for word, for every sf >= sf_lo); anything below takes the full table. Both in
// nvfp4_thresholds' select form.
template <bool CLASSES>
struct Nvfp4Thr {
    const uint4* __restrict__ full;
    const uint4* __restrict__ cls;
    uint32_t sf_lo;
    __device__ __forceinline__ void get(uint32_t sf, uint32_t* t) const {
        if (CLASSES && sf >= sf_lo) {
            // Only t_1..t_4 move with E: the differences are the class's.
            const uint32_t c = sf & 7u, e = (sf & 0x78u) * 0x00100010u;  // E · 0x00800080
            const uint4 t0 = cls[2 * c], t1 = cls[2 * c + 1];
            t[0] = imad(1u, t0.x, e), t[1] = imad(1u, t0.y, e), t[2] = imad(1u, t0.z, e);
            t[3] = imad(1u, t0.w, e), t[4] = t1.x, t[5] = t1.y, t[6] = t1.z;
        } else {
            nvfp4_thresholds(full, sf, t);
        }
    }
};

template <bool CLASSES>
__device__ __forceinline__ Nvfp4Thr<CLASSES> nvfp4_thr(const uint4* __restrict__ thr) {
    Nvfp4Thr<CLASSES> t;
    t.full = thr;
    t.cls = thr + (NVFP4_CLASS_WORD - 260u) / 4u;
    // Not __ldg: a read-only (non-coherent) load of a fixed address may be hoisted above the
    // caller's grid_dependency_wait, before the parameters kernel wrote the word.
    t.sf_lo = CLASSES ? __ldcg(reinterpret_cast<const uint32_t*>(thr) + (NVFP4_SFLO_WORD - 260u))
                      : 0u;
    return t;
}

// One column pair's block of version 8's columnwise part: wv[16] the raw tile words of rows
// 0..15 (column ca low, ca + 1 high). Writes the codes to ca[0..1] and cb[0..1] and returns
// sfa | sfb << 8; when the block holds a NaN, returns version 7's bytes through
// nvfp4c_block_nan (reading the raw words again from `src`, a pointer to the tile's word of
// row 0 of this block and this lane, row pitch NVFP4C_COLS / 2 words).
template <bool CLASSES>
__device__ __forceinline__ uint32_t nvfp4c_block_v8(uint32_t* wv, const uint32_t* src, float k,
                                                    const float* __restrict__ rcp,
                                                    const Nvfp4Thr<CLASSES>& th, uint32_t* ca,
                                                    uint32_t* cb) {
    const uint4* __restrict__ thr = th.full;
    uint32_t acc[4];
    acc[0] = nvfp4_signs(Nvfp4ColPairs<0>{wv});
    acc[1] = nvfp4_signs(Nvfp4ColPairs<0>{wv + 8});
    acc[2] = nvfp4_signs(Nvfp4ColPairs<1>{wv});
    acc[3] = nvfp4_signs(Nvfp4ColPairs<1>{wv + 8});
#pragma unroll
    for (unsigned i = 0; i < 16; ++i) wv[i] = habs2_bits(wv[i]);
    const uint32_t mb = hmax2_nan_tree<16>(wv);
    if (bf16x2_has_nan(mb)) {
        // Volatile: read again, so that the raw words need not stay in registers meanwhile.
        const volatile uint32_t* vs = src;
        Nvfp4Words16 a;
#pragma unroll
        for (unsigned i = 0; i < 16; ++i) a.w[i] = vs[i * (NVFP4C_COLS / 2)];
        const Nvfp4Out5 o = nvfp4c_block_nan(a, k, rcp, thr);
        ca[0] = o.c[0], ca[1] = o.c[1], cb[0] = o.c[2], cb[1] = o.c[3];
        return o.sf;
    }
    const uint32_t sf2 = e4m3x2_code(__fmul_rn(__uint_as_float(mb << 16), k),
                                     __fmul_rn(__uint_as_float(mb & 0xFFFF0000u), k));
    uint32_t t[7];
    th.get(sf2 & 0xFFu, t);
    ca[0] = nvfp4_word_v5(Nvfp4ColPairs<0>{wv}, t, acc[0]);
    ca[1] = nvfp4_word_v5(Nvfp4ColPairs<0>{wv + 8}, t, acc[1]);
    th.get(sf2 >> 8, t);
    cb[0] = nvfp4_word_v5(Nvfp4ColPairs<1>{wv}, t, acc[2]);
    cb[1] = nvfp4_word_v5(Nvfp4ColPairs<1>{wv + 8}, t, acc[3]);
    return sf2;
}

// A rowwise item of version 8: a[16] the item's raw words (v3's row layout: block 0 in a[0..7],
// block 1 in a[8..15]). Writes the four code words to w and returns the scale pair
// (block 0 | block 1 << 8); when a block holds a NaN, version 7's bytes through
// nvfp4r_item_nan (the raw words read again by `reload`).
template <bool CLASSES, class Reload>
__device__ __forceinline__ uint32_t nvfp4r_item_v8(uint32_t* a, Reload reload, float k,
                                                   const float* __restrict__ rcp,
                                                   const Nvfp4Thr<CLASSES>& th, uint32_t* w) {
    const uint4* __restrict__ thr = th.full;
    uint32_t acc[4];
#pragma unroll
    for (unsigned j = 0; j < 4; ++j) acc[j] = nvfp4_signs(Nvfp4RowPairs{a + 4 * j});
#pragma unroll
    for (unsigned i = 0; i < 16; ++i) a[i] = habs2_bits(a[i]);
    const uint32_t m0 = hmax2_nan_tree<8>(a), m1 = hmax2_nan_tree<8>(a + 8);
    if (bf16x2_has_nan(m0) || bf16x2_has_nan(m1)) {
        Nvfp4Words16 r;
        reload(r.w);
        const Nvfp4Out5 o = nvfp4r_item_nan(r, k, rcp, thr);
#pragma unroll
        for (unsigned j = 0; j < 4; ++j) w[j] = o.c[j];
        return o.sf;
    }
    // (block 0's amax | block 1's << 16): the larger half of each pair (both >= +0, no NaN).
    const uint32_t z = hmax2_nan_bits(prmt(m0, m1, 0x5410u), prmt(m0, m1, 0x7632u));
    const uint32_t sf2 = e4m3x2_code(__fmul_rn(__uint_as_float(z << 16), k),
                                     __fmul_rn(__uint_as_float(z & 0xFFFF0000u), k));
    uint32_t t[7];
    th.get(sf2 & 0xFFu, t);
    w[0] = nvfp4_word_v5(Nvfp4RowPairs{a}, t, acc[0]);
    w[1] = nvfp4_word_v5(Nvfp4RowPairs{a + 4}, t, acc[1]);
    th.get(sf2 >> 8, t);
    w[2] = nvfp4_word_v5(Nvfp4RowPairs{a + 8}, t, acc[2]);
    w[3] = nvfp4_word_v5(Nvfp4RowPairs{a + 12}, t, acc[3]);
    return sf2;
}

// Stages the tile of rows r0 .. r0 + 255 and columns c0 .. c0 + 63 (nvfp4_quantize_cols_v4;
// nvfp4c_load_tile_v5 issues the same copies for version 5): 256 rows x 8 chunks of 16 bytes;
// chunk q = threadIdx.x + 128 i is row q / 8, columns c0 + 8 (q % 8) .. + 7 (consecutive
// threads, consecutive 16 bytes of a row). Chunks past `rows` or `cols` are not copied (their
// shared words keep stale values and are never read). Returns when this thread's copies have
// landed (the caller's barrier then makes them visible to the CTA).
__device__ __forceinline__ void nvfp4c_load_tile(uint32_t (*tile)[NVFP4C_COLS / 2],
                                                 const uint8_t* __restrict__ x, u64 r0, u64 c0,
                                                 u64 rows, u64 cols) {
#pragma unroll
    for (unsigned i = 0; i < NVFP4C_ROWS * NVFP4C_COLS / 8 / 128; ++i) {
        unsigned q = threadIdx.x + 128 * i;
        unsigned tr_row = q / 8, ch = q % 8;
        u64 r = r0 + tr_row, c = c0 + 8 * ch;
        if (r < rows && c < cols) cp_async16(&tile[tr_row][4 * ch], x + 2 * (r * cols + c));
    }
    cp_async_wait_all();
}

// The columnwise copy of one staged tile (nvfp4_quantize_cols_v4 and nvfp4_quantize_both_v5):
// lane `lane` of warp `warp` codes the column pair (ca, ca + 1), ca = c0 + 2·lane, over the four
// 1x16 blocks of tile rows 64·warp .. + 63, whose first matrix row is rw. The caller checked
// ca < cols and rw < rows. Stores per column: the blocks' 32 code bytes as 16-byte units when
// `flags & 1` and all four (or two) blocks lie inside the matrix, else 8-byte units; the four
// scale bytes as one 4-byte store when `flags & 2` and all four blocks lie inside, else bytes.
// With STASH (versions 6), the scale words go to stash[column - c0][slot] in shared memory
// instead (nvfp4c_store_col_scales writes them out later, 32 bytes a column).
template <bool STASH = false, int WORD = 3>
__device__ __forceinline__ void nvfp4c_cols_part(const uint32_t (*tile)[NVFP4C_COLS / 2],
                                                 unsigned lane, unsigned warp, u64 ca, u64 rw,
                                                 u64 rows, float k, const float* __restrict__ rcp,
                                                 const uint4* __restrict__ thr,
                                                 uint8_t* __restrict__ data,
                                                 uint8_t* __restrict__ scales, uint32_t flags,
                                                 uint32_t (*stash)[8] = nullptr,
                                                 unsigned slot = 0,
                                                 Nvfp4Thr<(WORD == 6)> th = {}) {
    const u64 nbr = rows / 16, rb = rows / 2;
    const u64 left = (rows - rw) / 16;
    const unsigned nblk = left < 4 ? (unsigned)left : 4u;  // warp-uniform
    uint32_t codes[2][8];  // [column][block * 2 + word]
    uint32_t sfs[2] = {0, 0};
#pragma unroll
    for (unsigned b = 0; b < 4; ++b) {
        if (b >= nblk) break;
        uint32_t wv[16];
#pragma unroll
        for (unsigned i = 0; i < 16; ++i) wv[i] = tile[64 * warp + 16 * b + i][lane];
        uint32_t sf2;
        if constexpr (WORD >= 5)
            sf2 = nvfp4c_block_v8(wv, &tile[64 * warp + 16 * b][lane], k, rcp, th,
                                  &codes[0][2 * b], &codes[1][2 * b]);
        else
            sf2 = nvfp4c_block_v7<WORD>(wv, k, rcp, thr, &codes[0][2 * b], &codes[1][2 * b]);
        sfs[0] |= (sf2 & 0xFFu) << (8 * b);
        sfs[1] |= (sf2 >> 8) << (8 * b);
    }
    // Version 9, a warp whose 64 columns lie inside the matrix (flag 4, warp-uniform) with four
    // whole blocks and 16-byte code units: each column's 32 code bytes are stored by two
    // neighbouring lanes in one instruction (the pair's lanes swap the halves they do not own
    // by a shuffle), so every store covers whole 32-byte sectors of 16 columns; version 7's
    // lanes each stored 16 bytes of 32 columns, half a sector per lane, twice per column.
    const bool pairs_store = WORD == 6 && (flags & 5u) == 5u && nblk == 4;
    if (pairs_store) {
        const bool odd = (lane & 1u) != 0;
        const u64 c0 = ca - 2 * lane;
#pragma unroll
        for (unsigned h = 0; h < 2; ++h) {
            uint32_t r[4];
#pragma unroll
            for (unsigned i = 0; i < 4; ++i)
                r[i] = __shfl_xor_sync(0xFFFFFFFFu, odd ? codes[h][i] : codes[h][4 + i], 1);
            // The pair's even lane's column, then its odd lane's; this lane writes half `odd`.
            const u64 ce = c0 + 2 * (lane & ~1u) + h, co = ce + 2;
            const uint4 ve = odd ? make_uint4(r[0], r[1], r[2], r[3])
                                 : make_uint4(codes[h][0], codes[h][1], codes[h][2], codes[h][3]);
            const uint4 vo = odd ? make_uint4(codes[h][4], codes[h][5], codes[h][6], codes[h][7])
                                 : make_uint4(r[0], r[1], r[2], r[3]);
            *reinterpret_cast<uint4*>(data + ce * rb + rw / 2 + 16 * odd) = ve;
            *reinterpret_cast<uint4*>(data + co * rb + rw / 2 + 16 * odd) = vo;
        }
    }
#pragma unroll
    for (unsigned h = 0; h < 2; ++h) {
        const u64 c = ca + h;
        uint8_t* out = data + c * rb + rw / 2;
        if (pairs_store) {
            // Stored above.
        } else if ((flags & 1u) && nblk == 4) {
            uint4* o = reinterpret_cast<uint4*>(out);
            o[0] = make_uint4(codes[h][0], codes[h][1], codes[h][2], codes[h][3]);
            o[1] = make_uint4(codes[h][4], codes[h][5], codes[h][6], codes[h][7]);
        } else if ((flags & 1u) && nblk == 2) {
            *reinterpret_cast<uint4*>(out) =
                make_uint4(codes[h][0], codes[h][1], codes[h][2], codes[h][3]);
        } else {
#pragma unroll
            for (unsigned b = 0; b < 4; ++b) {
                if (b >= nblk) break;
                *reinterpret_cast<uint2*>(out + 8 * b) =
                    make_uint2(codes[h][2 * b], codes[h][2 * b + 1]);
            }
        }
        if (STASH) {
            stash[2 * lane + h][slot] = sfs[h];
            continue;
        }
        uint8_t* so = scales + c * nbr + rw / 16;
        if ((flags & 2u) && nblk == 4) {
            *reinterpret_cast<uint32_t*>(so) = sfs[h];
        } else {
#pragma unroll
            for (unsigned b = 0; b < 4; ++b) {
                if (b >= nblk) break;
                so[b] = (uint8_t)(sfs[h] >> (8 * b));
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 6) nvfp4_quantize_cols_v4(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
    const float* __restrict__ params, u64 rows, u64 cols, uint32_t flags) {
    __shared__ __align__(16) uint32_t tile[NVFP4C_ROWS][NVFP4C_COLS / 2];
    const float k = params[0];
    const float* rcp = params + 1;
    const uint4* thr = reinterpret_cast<const uint4*>(params + 260);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 c0 = (u64)blockIdx.x * NVFP4C_COLS;
    const u64 ca = c0 + 2 * lane;  // this lane's column pair (ca, ca + 1)
    const u64 tiles = (rows + NVFP4C_ROWS - 1) / NVFP4C_ROWS;
    for (u64 tr = blockIdx.y; tr < tiles; tr += gridDim.y) {
        const u64 r0 = tr * NVFP4C_ROWS;
        __syncthreads();  // the previous tile's reads are done
        nvfp4c_load_tile(tile, x, r0, c0, rows, cols);
        __syncthreads();
        const u64 rw = r0 + 64 * warp;  // this warp's first row
        if (ca < cols && rw < rows)
            nvfp4c_cols_part(tile, lane, warp, ca, rw, rows, k, rcp, thr, data, scales, flags);
    }
}

// The columnwise scales that versions 6 stashed for the tile pair tp (tile rows 2·tp and
// 2·tp + 1: 32 scale bytes per column): thread t writes half t % 2 (16 bytes) of column
// c0 + t / 2, so the two lanes of a column fill its 32-byte sector in one store instruction
// where version 4's lanes wrote 4 bytes each, a partial sector per store (1x H100: a 4-byte
// piece of a sector costs about as much DRAM time as the whole sector). 16-byte stores where
// whole and aligned, else bytes; nothing at or past scale byte nbr of a column (stale slots of
// rows past the matrix lie there) or past column `cols`.
__device__ __forceinline__ void nvfp4c_store_col_scales(const uint32_t (*stash)[8], u64 c0,
                                                        u64 cols, u64 nbr, u64 tp,
                                                        uint8_t* __restrict__ scales) {
    const unsigned cl = threadIdx.x / 2, h = threadIdx.x % 2;
    const u64 c = c0 + cl, j0 = 32 * tp + 16 * h;
    if (c >= cols || j0 >= nbr) return;
    uint8_t* o = scales + c * nbr + j0;
    const uint4 v = *reinterpret_cast<const uint4*>(&stash[cl][4 * h]);
    if (j0 + 16 <= nbr && ((uintptr_t)o & 15u) == 0) {
        *reinterpret_cast<uint4*>(o) = v;
    } else {
        for (unsigned j = 0; j < 16 && j0 + j < nbr; ++j) {
            const uint32_t w = j < 4 ? v.x : j < 8 ? v.y : j < 12 ? v.z : v.w;  // no local array
            o[j] = (uint8_t)(w >> (8 * (j % 4)));
        }
    }
}

// nvfp4_quantize_cols_v4 over pairs of 256-row tiles (version 6): a CTA codes tile rows 2·tp
// and 2·tp + 1 as version 4 does (the codes stored as version 4 stores them), keeps their
// scale words in shared memory and stores each column's 32 scale bytes as one sector
// (nvfp4c_store_col_scales). Grid y: the tile pairs (strided past 65535). Same conditions and
// bytes as version 4 (`flags` bit 2 unused: the scale stores check their own alignment).
template <int WORD>
__device__ __forceinline__ void nvfp4_cols_v6_body(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
    const float* __restrict__ params, u64 rows, u64 cols, uint32_t flags,
    uint32_t (*tile)[NVFP4C_COLS / 2], uint32_t (*stash)[8]) {
    const float k = params[0];
    const float* rcp = params + 1;
    const uint4* thr = reinterpret_cast<const uint4*>(params + 260);
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 c0 = (u64)blockIdx.x * NVFP4C_COLS;
    const u64 ca = c0 + 2 * lane;
    const u64 tiles = (rows + NVFP4C_ROWS - 1) / NVFP4C_ROWS, pairs = (tiles + 1) / 2;
    for (u64 tp = blockIdx.y; tp < pairs; tp += gridDim.y) {
        for (unsigned tt = 0; tt < 2; ++tt) {
            const u64 tr = 2 * tp + tt;
            if (tr >= tiles) break;
            const u64 r0 = tr * NVFP4C_ROWS;
            __syncthreads();  // the previous tile's reads (and the last pair's stash) are done
            nvfp4c_load_tile(tile, x, r0, c0, rows, cols);
            __syncthreads();
            const u64 rw = r0 + 64 * warp;
            if (ca < cols && rw < rows)
                nvfp4c_cols_part<true, WORD>(tile, lane, warp, ca, rw, rows, k, rcp, thr, data,
                                             scales, flags, stash, 4 * tt + warp);
        }
        __syncthreads();
        nvfp4c_store_col_scales(stash, c0, cols, rows / 16, tp, scales);
    }
}

extern "C" __global__ void __launch_bounds__(128, 6) nvfp4_quantize_cols_v6(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
    const float* __restrict__ params, u64 rows, u64 cols, uint32_t flags) {
    __shared__ __align__(16) uint32_t tile[NVFP4C_ROWS][NVFP4C_COLS / 2];
    __shared__ __align__(16) uint32_t stash[NVFP4C_COLS][8];
    nvfp4_cols_v6_body<3>(x, data, scales, params, rows, cols, flags, tile, stash);
}

// Version 7: version 6 with nvfp4_word_v4. Same bytes.
extern "C" __global__ void __launch_bounds__(128, 6) nvfp4_quantize_cols_v7(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
    const float* __restrict__ params, u64 rows, u64 cols, uint32_t flags) {
    __shared__ __align__(16) uint32_t tile[NVFP4C_ROWS][NVFP4C_COLS / 2];
    __shared__ __align__(16) uint32_t stash[NVFP4C_COLS][8];
    nvfp4_cols_v6_body<4>(x, data, scales, params, rows, cols, flags, tile, stash);
}

// cp_async16 to the shared address s + OFF (an immediate offset).
template <unsigned OFF>
__device__ __forceinline__ void cp_async16_at(uint32_t s, const void* gmem) {
    asm volatile("cp.async.cg.shared.global [%0+%2], [%1], 16;" ::"r"(s), "l"(gmem), "n"(OFF)
                 : "memory");
}

// Copies I .. 15 of nvfp4c_load_tile (row r + 16 i, columns c .. c + 7 to shared address
// s + 2048 i) at immediate shared offsets: one address register for all 16.
template <unsigned I>
__device__ __forceinline__ void nvfp4c_load_chunks_v5(uint32_t s, const uint8_t* __restrict__ x,
                                                      u64 r, u64 c, u64 rows, u64 cols) {
    if constexpr (I < NVFP4C_ROWS / 16) {
        const u64 ri = r + 16 * I;
        if (ri < rows && c < cols)
            cp_async16_at<I * 16 * NVFP4C_COLS * 2>(s, x + 2 * (ri * cols + c));
        nvfp4c_load_chunks_v5<I + 1>(s, x, r, c, rows, cols);
    }
}

// nvfp4c_load_tile (the same copies) with one shared address register: the 16 shared
// addresses held in registers across the tile loop made nvfp4_quantize_both_v5 spill at 80.
// nvfp4c_issue_tile_v5 only issues the copies (the caller waits with cp_async_wait_all).
__device__ __forceinline__ void nvfp4c_issue_tile_v5(uint32_t (*tile)[NVFP4C_COLS / 2],
                                                     const uint8_t* __restrict__ x, u64 r0,
                                                     u64 c0, u64 rows, u64 cols) {
    const unsigned tr_row = threadIdx.x / 8, ch = threadIdx.x % 8;
    const uint32_t s = (uint32_t)__cvta_generic_to_shared(&tile[tr_row][4 * ch]);
    nvfp4c_load_chunks_v5<0>(s, x, r0 + tr_row, c0 + 8 * ch, rows, cols);
}
__device__ __forceinline__ void nvfp4c_load_tile_v5(uint32_t (*tile)[NVFP4C_COLS / 2],
                                                    const uint8_t* __restrict__ x, u64 r0, u64 c0,
                                                    u64 rows, u64 cols) {
    nvfp4c_issue_tile_v5(tile, x, r0, c0, rows, cols);
    cp_async_wait_all();
}

// ---- NVFP4 both copies, version 5: the rowwise and columnwise copies from one read of X ----
//
// Versions 3/4 read X twice for both copies (nvfp4_quantize_rows_v3, nvfp4_quantize_cols_v4).
// Version 5 stages v4's tile (256 rows x 64 columns by cp.async; same grid, 128 threads), writes
// its columnwise copy with v4's code (nvfp4c_cols_part), then its rowwise copy: a tile row is
// two block pairs (columns c0 + 32·pair .. + 31, 16 words), 512 (row, pair) items, item
// i = threadIdx.x + 128 j (j < 4) is tile row i / 2, pair i % 2. Each 1x16 block goes through
// nvfp4_row_block_v3, v3's own code, on v3's layout (a tile row's word j holds elements
// 2j | 2j + 1 << 16), and is stored as v3 stores it (16 code bytes, a 2-byte scale pair), so
// both copies are v3/v4's bytes. Bank conflicts: an item's four 16-byte chunks lie in bank
// groups 4·pair + 0..3 (row pitch 128 bytes), so the 8 lanes of a 16-byte phase (4 rows, both
// pairs) would meet in 2 groups; the lane's q-th load reads chunk q ^ xo, xo = (i / 2) % 4,
// and a phase touches 8 distinct groups. The permutation is undone on the results: a block's
// code words are per chunk (nvfp4_word_v3 and the NaN path read only their own 8 elements),
// its amax is a max of |x| >= +0 with NaN tested per half (the chunk order cannot change it),
// so word q is chunk q ^ xo's and scale b block b ^ (xo / 2)'s, put back by two select steps.
// Conditions (host-checked): v4's (bf16, x 16-byte and column data 8-byte aligned, the
// threshold table; `flags` as v4's) and v3's (cols % 32 == 0, row data 16-byte and row scales
// 2-byte aligned). Rowwise items past `rows` or `cols` are skipped (cols % 32 == 0: a pair lies
// wholly inside or outside). 80 registers, 32 KB shared: six CTAs per SM (version 6: a 4-byte
// spill around the out-of-line NaN path).
//
// PAIRS (version 6, nvfp4_quantize_both_v6): a CTA takes tile rows 2·tp and 2·tp + 1 and stores
// the columnwise scales of both as whole sectors (nvfp4c_store_col_scales), as
// nvfp4_quantize_cols_v6 does; grid y the tile pairs. Same bytes.
template <bool PAIRS, int WORD = 3>
__device__ __forceinline__ void nvfp4_both_body(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ rdata, uint8_t* __restrict__ rscales,
    uint8_t* __restrict__ cdata, uint8_t* __restrict__ cscales, const float* __restrict__ params,
    u64 rows, u64 cols, uint32_t flags, uint32_t (*tile)[NVFP4C_COLS / 2],
    uint32_t (*stash)[8]) {
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const u64 c0 = (u64)blockIdx.x * NVFP4C_COLS;
    const u64 ca = c0 + 2 * lane;  // this lane's column pair (ca, ca + 1)
    const u64 tiles = (rows + NVFP4C_ROWS - 1) / NVFP4C_ROWS;
    const u64 nb = cols / 16, rbytes = cols / 2;
    // This thread's rowwise items: tile rows threadIdx.x / 2 + 64 j, block pair `pair`
    // (columns cp .. cp + 31), chunk order q ^ xo.
    const unsigned pair = threadIdx.x & 1u, xo = (threadIdx.x >> 1) & 3u;
    const u64 cp = c0 + 32 * pair;
    const u64 per = PAIRS ? 2 : 1, groups = (tiles + per - 1) / per;
    // Version 9 issues its first tile's copy before it reads the parameters, then waits for
    // the kernel that writes them (grid_dependency_wait): launched as that kernel's
    // programmatic dependent (version 10), the copy overlaps it; launched plainly, the wait
    // returns at once. The tile loop then only waits for the copy.
    const u64 tg0 = WORD == 6 ? groups - 1 - blockIdx.y : blockIdx.y;
    const bool preloaded = WORD == 6 && blockIdx.y < groups && per * tg0 < tiles;
    if (preloaded) nvfp4c_issue_tile_v5(tile, x, per * tg0 * NVFP4C_ROWS, c0, rows, cols);
    if constexpr (WORD == 6) grid_dependency_wait();
    const float k = params[0];
    const float* rcp = params + 1;
    const uint4* thr = reinterpret_cast<const uint4*>(params + 260);
    // Version 9: the class table (256 bytes) copied into shared memory once (the barrier at
    // the top of the tile loop orders the copy before any use). Plain loads after the wait:
    // the compiler moved an __ldg of this fixed address above it (version 10 then read the
    // table before nvfp4_params_v9 wrote it). The loop's __ldg reads of the parameters
    // (the full table, rcp) have addresses from the tile's data, so they cannot move up.
    __shared__ __align__(16) uint4 cls_s[WORD == 6 ? 16 : 1];
    Nvfp4Thr<(WORD == 6)> th = nvfp4_thr<(WORD == 6)>(thr);
    if constexpr (WORD == 6) {
        if (threadIdx.x < 16) cls_s[threadIdx.x] = __ldcg(th.cls + threadIdx.x);
        th.cls = cls_s;
    }
    for (u64 it = blockIdx.y; it < groups; it += gridDim.y) {
        // Version 9 walks the tile groups from the last: the amax pass read X just before, and
        // the L2 still holds its tail (the first wave of CTAs reads ~48 MB of 16384² bf16).
        const u64 tg = WORD == 6 ? groups - 1 - it : it;
        for (unsigned tt = 0; tt < per; ++tt) {
            const u64 tr = per * tg + tt;
            if (tr >= tiles) break;
            const u64 r0 = tr * NVFP4C_ROWS;
            __syncthreads();  // the previous tile's reads (and the last pair's stash) are done
            if (preloaded && it == blockIdx.y && tt == 0)
                cp_async_wait_all();  // the copy issued before the parameters' wait
            else
                nvfp4c_load_tile_v5(tile, x, r0, c0, rows, cols);
            __syncthreads();
            const u64 rw = r0 + 64 * warp;  // this warp's first row
            if (ca < cols && rw < rows)
                nvfp4c_cols_part<PAIRS, WORD>(tile, lane, warp, ca, rw, rows, k, rcp, thr, cdata,
                                              cscales, flags | (c0 + 64 <= cols ? 4u : 0u),
                                              stash, 4 * tt + warp, th);
            if (cp >= cols) continue;
            // Not unrolled: the kernel's time goes to issuing ALU instructions, and fetching
            // them (crates/lowbit-kernels/NOTES.md); four copies of this body made the code a third longer.
#pragma unroll 1
            for (unsigned j = 0; j < 4; ++j) {
                const unsigned trow = threadIdx.x / 2 + 64 * j;
                const u64 r = r0 + trow;
                if (r >= rows) break;  // r grows with j
                const uint4* src = reinterpret_cast<const uint4*>(&tile[trow][16 * pair]);
                uint4 raw[4];
#pragma unroll
                for (unsigned q = 0; q < 4; ++q) raw[q] = src[q ^ xo];
                uint32_t w[4], sf[2];
                if constexpr (WORD >= 5) {
                    // Volatile: read again, not kept in registers (nvfp4c_block_v8).
                    auto reload = [&](uint32_t* r) {
                        const volatile uint32_t* vs = reinterpret_cast<const uint32_t*>(src);
#pragma unroll
                        for (unsigned q = 0; q < 4; ++q)
#pragma unroll
                            for (unsigned i = 0; i < 4; ++i) r[4 * q + i] = vs[4 * (q ^ xo) + i];
                    };
                    const uint32_t sf2 = nvfp4r_item_v8(reinterpret_cast<uint32_t*>(raw), reload,
                                                        k, rcp, th, w);
                    sf[0] = sf2 & 0xFFu, sf[1] = sf2 >> 8;
                } else {
#pragma unroll
                    for (unsigned b = 0; b < 2; ++b)
                        sf[b] = nvfp4_row_block_v3<WORD>(
                            reinterpret_cast<const uint32_t*>(&raw[2 * b]), k, rcp, thr,
                            &w[2 * b]);
                }
                // w[q] is chunk q ^ xo's code word, sf[b] block b ^ (xo >> 1)'s scale.
                const bool s1 = (xo & 1u) != 0, s2 = (xo & 2u) != 0;
                uint32_t v0 = s1 ? w[1] : w[0], v1 = s1 ? w[0] : w[1];
                uint32_t v2 = s1 ? w[3] : w[2], v3 = s1 ? w[2] : w[3];
                uint32_t o0 = s2 ? v2 : v0, o1 = s2 ? v3 : v1, o2 = s2 ? v0 : v2, o3 = s2 ? v1 : v3;
                uint32_t sfs = s2 ? (sf[1] | (sf[0] << 8)) : (sf[0] | (sf[1] << 8));
                *reinterpret_cast<uint16_t*>(rscales + r * nb + cp / 16) = (uint16_t)sfs;
                *reinterpret_cast<uint4*>(rdata + r * rbytes + cp / 2) = make_uint4(o0, o1, o2, o3);
            }
        }
        if (PAIRS) {
            __syncthreads();
            nvfp4c_store_col_scales(stash, c0, cols, rows / 16, tg, cscales);
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 6) nvfp4_quantize_both_v5(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ rdata, uint8_t* __restrict__ rscales,
    uint8_t* __restrict__ cdata, uint8_t* __restrict__ cscales, const float* __restrict__ params,
    u64 rows, u64 cols, uint32_t flags) {
    __shared__ __align__(16) uint32_t tile[NVFP4C_ROWS][NVFP4C_COLS / 2];
    nvfp4_both_body<false>(x, rdata, rscales, cdata, cscales, params, rows, cols, flags, tile,
                           nullptr);
}

// The tile-pair kernels of both copies (versions 6 to 9): nvfp4_both_body over pairs of
// 256-row tiles with the column scales' stash, WORD choosing the codes (3: nvfp4_word_v3).
#define NVFP4_BOTH_PAIRS_KERNEL(name, WORD)                                                    \
    extern "C" __global__ void __launch_bounds__(128, 6) name(                                  \
        const uint8_t* __restrict__ x, uint8_t* __restrict__ rdata,                             \
        uint8_t* __restrict__ rscales, uint8_t* __restrict__ cdata,                             \
        uint8_t* __restrict__ cscales, const float* __restrict__ params, u64 rows, u64 cols,    \
        uint32_t flags) {                                                                       \
        __shared__ __align__(16) uint32_t tile[NVFP4C_ROWS][NVFP4C_COLS / 2];                   \
        __shared__ __align__(16) uint32_t stash[NVFP4C_COLS][8];                                \
        nvfp4_both_body<true, WORD>(x, rdata, rscales, cdata, cscales, params, rows, cols,      \
                                    flags, tile, stash);                                        \
    }

NVFP4_BOTH_PAIRS_KERNEL(nvfp4_quantize_both_v6, 3)
// Version 7: version 6 with nvfp4_word_v4 (selects and merges on the FMA pipe). Same bytes.
NVFP4_BOTH_PAIRS_KERNEL(nvfp4_quantize_both_v7, 4)
// Version 8: version 7 with shorter chains per block (nvfp4c_block_v8, nvfp4r_item_v8). Same
// bytes.
NVFP4_BOTH_PAIRS_KERNEL(nvfp4_quantize_both_v8, 5)
// Version 9: version 8 with the thresholds of the class table (Nvfp4Thr<true>; the parameters
// of nvfp4_params_v9). Same bytes.
NVFP4_BOTH_PAIRS_KERNEL(nvfp4_quantize_both_v9, 6)

// x86's product of two floats where NaN is involved (mulss returns its first operand's NaN,
// else the second's, and makes the negative default NaN 0xFFC00000 for 0 * Inf), so that
// dequantized NaNs keep the CPU's payloads on the x86 hosts the GPUs sit in. (The contract only
// promises NaN-ness; this keeps the bytes equal where it is cheap.)
__device__ __forceinline__ float mul_x86_nan(float a, float b) {
    if (a != a) return a;
    if (b != b) return b;
    float p = __fmul_rn(a, b);
    return p != p ? __uint_as_float(0xFFC00000u) : p;
}

// MXFP8 dequantization: dst[r, c] = decode(q) * 2^(e - 127) rounded to dst's dtype. `table` is
// the 256 fp32 values of the element kind (from the host). Rowwise scales: rows x ceil(cols/32);
// columnwise: ceil(rows/32) x cols.
extern "C" __global__ void mxfp8_dequantize(const uint8_t* __restrict__ q,
                                            const uint8_t* __restrict__ scales,
                                            const float* __restrict__ table,
                                            uint8_t* __restrict__ dst, uint32_t dd, u64 rows,
                                            u64 cols, uint32_t columnwise) {
    u64 nb = (cols + 31) / 32;
    GRID_STRIDE(i, rows * cols) {
        u64 r = i / cols, c = i % cols;
        uint8_t e = columnwise ? scales[(r / 32) * cols + c] : scales[r * nb + c / 32];
        float s = e == 0 ? __uint_as_float(0x00400000u)
                         : (e == 0xFF ? __uint_as_float(0x7FC00000u) : __uint_as_float((uint32_t)e << 23));
        store(dst, dd, i, mul_x86_nan(table[q[i]], s));
    }
}

// NVFP4 dequantization of one plane stored [prows, pcols] (rowwise: the matrix itself;
// columnwise: its transpose): value = q * ((float(sf) * amax) * factor_inv), TE's order, written
// to dst[r, c] of the original [rows, cols] matrix. `table` holds the 256 E4M3 values.
extern "C" __global__ void nvfp4_dequantize(const uint8_t* __restrict__ q,
                                            const uint8_t* __restrict__ scales,
                                            const float* __restrict__ table,
                                            uint8_t* __restrict__ dst, uint32_t dd, u64 rows,
                                            u64 cols, float amax, float factor_inv,
                                            uint32_t columnwise) {
    const float e2m1[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                            -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    u64 pcols = columnwise ? rows : cols;
    u64 rb = (pcols + 1) / 2, nb = (pcols + 15) / 16;
    GRID_STRIDE(i, rows * cols) {
        u64 r = i / cols, c = i % cols;
        u64 pr = columnwise ? c : r, pc = columnwise ? r : c;
        uint8_t byte = q[pr * rb + pc / 2];
        float v = e2m1[(pc % 2 == 0 ? byte : byte >> 4) & 0xF];
        float fs = mul_x86_nan(mul_x86_nan(table[scales[pr * nb + pc / 16]], amax), factor_inv);
        store(dst, dd, i, mul_x86_nan(v, fs));
    }
}

// ---- sharded 2D primary weights (lowbit_formats::{mxfp8, nvfp4}::sharded) ----

// fp32 -> E5M2 (saturating to 57344, NaN -> 0x7F), lowbit_formats::scalar::e5m2_from_f32.
__device__ __forceinline__ uint32_t e5m2_code(float x) {
    uint32_t bits = __float_as_uint(x);
    uint32_t a = bits & 0x7FFFFFFFu;
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t code = rne_magnitude(a < 0x48000000u ? a : 0x48000000u, 2, 15);
    code = code < 0x7Bu ? code : 0x7Bu;
    return a > 0x7F800000u ? 0x7Fu : (code | sign);
}

// Two codes at once by the hardware conversion (cvt.rn.satfinite.{e4m3,e5m2}x2.f32: RNE,
// +-Inf and overflow to +-max), a's in the low byte: e4m3_code / e5m2_code's bytes, with E5M2
// NaN forced to 0x7F as they give it (E4M3's hardware NaN code is 0x7F already; mxfp8x.cu's
// mx_encode8 does the same and is checked against the CPU on the GPU).
__device__ __forceinline__ uint32_t fp8x2_code(float a, float b, uint32_t e5m2) {
    uint32_t p = e5m2 ? __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E5M2)
                      : __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
    if (e5m2) {
        if (a != a) p = (p & 0xFF00u) | 0x7Fu;
        if (b != b) p = (p & 0x00FFu) | 0x7F00u;
    }
    return p;
}

// tiles[t] <- max(tiles[t] bits, |x| bits with NaN as 0) over elements start.. of a row-major
// matrix with `cols` columns, tiles of `tile` x `tile`. The max is on u32 bits (as the library
// does), so atomics give the same result in any order. One thread per (row, tile column)
// segment of the range, one atomic per segment.
extern "C" __global__ void tile_amax_fold(const uint8_t* __restrict__ x, uint32_t xd, u64 n,
                                          u64 start, u64 cols, u64 tile,
                                          uint32_t* __restrict__ tiles) {
    u64 tc = (cols + tile - 1) / tile;
    u64 end = start + n;
    u64 s_first = (start / cols) * tc + (start % cols) / tile;
    u64 s_last = ((end - 1) / cols) * tc + ((end - 1) % cols) / tile;
    GRID_STRIDE(k, s_last - s_first + 1) {
        u64 s = s_first + k;
        u64 row = s / tc, cb = s % tc;
        u64 a = row * cols + cb * tile;
        u64 b = row * cols + (cb * tile + tile < cols ? cb * tile + tile : cols);
        a = a > start ? a : start;
        b = b < end ? b : end;
        uint32_t m = 0;
        for (u64 g = a; g < b; ++g) m = max(m, abs_bits_nan_zero(load(x, xd, g - start)));
        if (m != 0) atomicMax(tiles + (row / tile) * tc + cb, m);
    }
}

// MXFP8 codes of elements start.. given the reduced 32x32 tile amaxes: per element the tile's
// scale e = E8M0(amax * rcp), code = encode(x * 2^(127 - e)). e5m2 selects the element kind.
extern "C" __global__ void mxfp8_quantize_2d_range(const uint8_t* __restrict__ x, uint32_t xd,
                                                   u64 n, u64 start, u64 cols, uint32_t e5m2,
                                                   float rcp, const float* __restrict__ tiles,
                                                   uint8_t* __restrict__ out) {
    u64 tc = (cols + 31) / 32;
    GRID_STRIDE(i, n) {
        u64 g = start + i;
        float amax = tiles[(g / cols / 32) * tc + (g % cols) / 32];
        float s = e8m0_reciprocal(e8m0_code(__fmul_rn(amax, rcp)));
        float v = __fmul_rn(load(x, xd, i), s);
        out[i] = (uint8_t)(e5m2 ? e5m2_code(v) : e4m3_code(v));
    }
}

// Rowwise ([rows, tc]) and columnwise ([ceil(rows/32), cols]) E8M0 scales from the tile
// amaxes: every entry is its tile's scale.
extern "C" __global__ void mxfp8_scales_2d(const float* __restrict__ tiles, u64 rows, u64 cols,
                                           float rcp, uint8_t* __restrict__ row_scales,
                                           uint8_t* __restrict__ col_scales) {
    u64 tc = (cols + 31) / 32;
    u64 nr = rows * tc, nc = ((rows + 31) / 32) * cols;
    GRID_STRIDE(i, nr + nc) {
        if (i < nr) {
            row_scales[i] = (uint8_t)e8m0_code(__fmul_rn(tiles[(i / tc / 32) * tc + i % tc], rcp));
        } else {
            u64 j = i - nr;
            col_scales[j] = (uint8_t)e8m0_code(__fmul_rn(tiles[(j / cols) * tc + (j % cols) / 32], rcp));
        }
    }
}

// The max of the raw u32 bits of x[0..n) into *out (atomicMax; `out` zeroed or holding a
// lower bound): the x blocks of the grid stride over the words. Where they are 16-byte aligned,
// 16-byte loads four deep per thread: one 4-byte load at a time left each thread's ~32 words a
// chain of memory latencies (1B's 112 matrices, 15 MB of tiles: 16 us on an H200).
__device__ __forceinline__ void u32_max_item(const uint32_t* x, u64 n, uint32_t* out) {
    __builtin_assume(__isGlobal(x));  // a device allocation: global loads, not generic ones
    uint32_t m = 0;
    u64 done = 0;
    const u64 step = (u64)gridDim.x * blockDim.x, start = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (((uintptr_t)x & 15u) == 0) {
        const uint4* x4 = reinterpret_cast<const uint4*>(x);
        const u64 n4 = n / 4;
        u64 i = start;
        for (; i + 3 * step < n4; i += 4 * step) {
            uint4 q[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k] = __ldg(x4 + i + k * step);
#pragma unroll
            for (int k = 0; k < 4; ++k) m = max(m, max(max(q[k].x, q[k].y), max(q[k].z, q[k].w)));
        }
        for (; i < n4; i += step) {
            const uint4 q = __ldg(x4 + i);
            m = max(m, max(max(q.x, q.y), max(q.z, q.w)));
        }
        done = 4 * n4;
    }
    for (u64 i = done + start; i < n; i += step) m = max(m, x[i]);
    for (int off = 16; off > 0; off /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, off));
    if ((threadIdx.x & 31) == 0 && m != 0) atomicMax(out, m);
}

// out[i] <- max of the raw u32 bits of item i's words (the NVFP4 global amaxes of many
// matrices' reduced tiles, or of experts' runs of them), `out` zeroed. `table`: 2 words per item
// (address, count). Grid (x, items): the x blocks of row y stride over item y's words.
extern "C" __global__ void u32_max_many(const u64* __restrict__ table, uint32_t* __restrict__ out) {
    const u64 item = blockIdx.y;
    u32_max_item(reinterpret_cast<const uint32_t*>(table[2 * item]), table[2 * item + 1],
                 out + item);
}

// u32_max_many with its table in the parameters (no upload per call) for at most
// U32MAX_PARAMS_MAX items: `out` the zeroed words, `rows` (address, count) per item.
#define U32MAX_PARAMS_MAX 128
struct U32MaxParams {
    u64 out, pad;
    u64 rows[U32MAX_PARAMS_MAX][2];
};
// The host passes exactly these bytes (kernels.rs, U32MAX_PARAMS_MAX rows).
static_assert(sizeof(U32MaxParams) == 8 * (2 + 2 * U32MAX_PARAMS_MAX), "parameter layout");

extern "C" __global__ void u32_max_many_p(const U32MaxParams p) {
    const u64 item = blockIdx.y;
    u32_max_item(reinterpret_cast<const uint32_t*>(p.rows[item][0]), p.rows[item][1],
                 reinterpret_cast<uint32_t*>(p.out) + item);
}

// NVFP4 packed codes of elements start.. (start and n even) given the reduced 16x16 tile
// amaxes and the tensor factors from nvfp4_params (k, reciprocal table): byte j holds elements
// 2j (low nibble) and 2j + 1.
extern "C" __global__ void nvfp4_quantize_2d_range(const uint8_t* __restrict__ x, uint32_t xd,
                                                   u64 npairs, u64 start, u64 cols,
                                                   const float* __restrict__ tiles,
                                                   const float* __restrict__ params,
                                                   uint8_t* __restrict__ out) {
    const float k = params[0];
    const float* rcp = params + 1;
    u64 tc = (cols + 15) / 16;
    GRID_STRIDE(j, npairs) {
        uint32_t codes[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u64 g = start + 2 * j + h;
            float amax = tiles[(g / cols / 16) * tc + (g % cols) / 16];
            float m = rcp[e4m3_code(__fmul_rn(amax, k))];
            codes[h] = e2m1_code(__fmul_rn(load(x, xd, 2 * j + h), m));
        }
        out[j] = (uint8_t)(codes[0] | (codes[1] << 4));
    }
}

// ---- batched 2D staging: fold and quantize many pieces of bf16(x) in one launch each ----
//
// A piece is elements start .. start + n of a row-major matrix with `cols` columns, read from
// x (dtype xd) and rounded to bf16 first (f32_to_bf16_bits, as `cast` does: RNE, NaN quieted;
// bf16 input unchanged). Its work units are (band, cb): a tile row `band` (rows band·tile ..)
// that the piece touches and a tile column cb; unit k of a piece is band = band0 + k / tc,
// cb = k % tc. A thread takes one unit: the piece's elements of that tile, row by row (16- or
// 32-element row segments, 16-byte loads when a segment is whole and aligned), so a tile's
// maximum is combined in registers and each unit makes at most one atomic.
//
// Table: `count` u64 first units (ascending, the first 0), then STAGE2D_WORDS words per piece:
// [x, xd | tile << 8 | e5m2 << 16 | nvfp4 << 24, start, n, cols, tiles, out, amax, band0, tc,
// rcp bits]. `amax` (NVFP4 quantize only): the address of the piece's global amax word (raw
// u32 max of its tiles view); `rcp`: the MXFP8 kind's max_norm_rcp.
#define STAGE2D_WORDS 11

__device__ __forceinline__ float bf16_round(float v, uint32_t xd) {
    return xd == 1 ? v : bf16_bits_to_f32(f32_to_bf16_bits(v));
}

// The piece of unit u: the last piece whose first unit is <= u.
__device__ __forceinline__ uint32_t stage2d_find(const u64* __restrict__ firsts, uint32_t count,
                                                 u64 u) {
    uint32_t lo = 0, hi = count - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (firsts[mid] <= u) lo = mid; else hi = mid - 1;
    }
    return lo;
}

struct Stage2d {
    const uint8_t* x;
    uint32_t xd, tile, e5m2, nvfp4;
    u64 start, end, cols, band, cb, tc;
    const float* tiles;
    uint8_t* out;
    const uint32_t* amax;
    float rcp;
};

__device__ __forceinline__ Stage2d stage2d_unit(const u64* __restrict__ table, uint32_t count,
                                                u64 u) {
    uint32_t p = stage2d_find(table, count, u);
    const u64* w = table + count + (u64)p * STAGE2D_WORDS;
    Stage2d s;
    s.x = reinterpret_cast<const uint8_t*>(w[0]);
    uint32_t f = (uint32_t)w[1];
    s.xd = f & 0xFFu;
    s.tile = (f >> 8) & 0xFFu;
    s.e5m2 = (f >> 16) & 0xFFu;
    s.nvfp4 = (f >> 24) & 0xFFu;
    s.start = w[2];
    s.end = w[2] + w[3];
    s.cols = w[4];
    s.tiles = reinterpret_cast<const float*>(w[5]);
    s.out = reinterpret_cast<uint8_t*>(w[6]);
    s.amax = reinterpret_cast<const uint32_t*>(w[7]);
    // Device allocations: said so, the compiler emits global loads and stores (LDG/STG)
    // instead of generic ones for addresses read from the table.
    __builtin_assume(__isGlobal(s.x));
    __builtin_assume(__isGlobal(s.tiles));
    __builtin_assume(__isGlobal(s.out));
    __builtin_assume(__isGlobal(s.amax));
    s.tc = w[9];
    u64 k = u - table[p];
    s.band = w[8] + k / s.tc;
    s.cb = k - (k / s.tc) * s.tc;
    s.rcp = __uint_as_float((uint32_t)w[10]);
    return s;
}

// Loads elements i .. i + m (m = 16 or 32, whole segment) of x as bf16-rounded floats into v
// with 16-byte loads when aligned, else one by one.
template <int M>
__device__ __forceinline__ void stage2d_load(const uint8_t* __restrict__ x, uint32_t xd, u64 i,
                                             float* v) {
    if (xd == 0 && (((uintptr_t)x + 4 * i) & 15u) == 0) {
        const float4* p = reinterpret_cast<const float4*>(x + 4 * i);
#pragma unroll
        for (int q = 0; q < M / 4; ++q) {
            float4 f = p[q];
            v[4 * q] = bf16_round(f.x, 0);
            v[4 * q + 1] = bf16_round(f.y, 0);
            v[4 * q + 2] = bf16_round(f.z, 0);
            v[4 * q + 3] = bf16_round(f.w, 0);
        }
    } else if (xd == 1 && (((uintptr_t)x + 2 * i) & 15u) == 0) {
        const uint4* p = reinterpret_cast<const uint4*>(x + 2 * i);
#pragma unroll
        for (int q = 0; q < M / 8; ++q) {
            uint4 b = p[q];
            uint32_t ws[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int h = 0; h < 4; ++h) {
                v[8 * q + 2 * h] = __uint_as_float(ws[h] << 16);
                v[8 * q + 2 * h + 1] = __uint_as_float(ws[h] & 0xFFFF0000u);
            }
        }
    } else {
#pragma unroll
        for (int q = 0; q < M; ++q) v[q] = bf16_round(load(x, xd, i + q), xd);
    }
}

// The piece's elements of row r inside unit s: [a, b) as matrix indices (possibly empty).
__device__ __forceinline__ void stage2d_row(const Stage2d& s, u64 r, u64& a, u64& b) {
    u64 c0 = s.cb * s.tile;
    u64 c1 = c0 + s.tile < s.cols ? c0 + s.tile : s.cols;
    a = r * s.cols + c0;
    b = r * s.cols + c1;
    a = a > s.start ? a : s.start;
    b = b < s.end ? b : s.end;
}

// tiles[band·tc + cb] <- max(its bits, |bf16(x)| bits with NaN as 0) over each unit's elements.
template <int T>
__device__ __forceinline__ uint32_t stage2d_fold_unit(const Stage2d& s) {
    u64 r0 = s.band * T, r_lo = s.start / s.cols, r_hi = (s.end - 1) / s.cols;
    u64 ra = r0 > r_lo ? r0 : r_lo, rb = r0 + T - 1 < r_hi ? r0 + T - 1 : r_hi;
    uint32_t m = 0;
    for (u64 r = ra; r <= rb; ++r) {
        u64 a, b;
        stage2d_row(s, r, a, b);
        if (b == a + T) {
            float v[T];
            stage2d_load<T>(s.x, s.xd, a - s.start, v);
#pragma unroll
            for (int q = 0; q < T; ++q) m = max(m, abs_bits_nan_zero(v[q]));
        } else {
            for (u64 g = a; g < b; ++g)
                m = max(m, abs_bits_nan_zero(bf16_round(load(s.x, s.xd, g - s.start), s.xd)));
        }
    }
    return m;
}

extern "C" __global__ void stage2d_fold_many(const u64* __restrict__ table, uint32_t count,
                                             u64 units) {
    GRID_STRIDE(u, units) {
        Stage2d s = stage2d_unit(table, count, u);
        uint32_t m = s.tile == 16 ? stage2d_fold_unit<16>(s) : stage2d_fold_unit<32>(s);
        if (m != 0)
            atomicMax(reinterpret_cast<uint32_t*>(const_cast<float*>(s.tiles)) + s.band * s.tc + s.cb,
                      m);
    }
}

// MXFP8 codes of a unit: the tile's scale e = E8M0(amax * rcp) once, code = encode(v * 2^(127-e)).
__device__ __forceinline__ void stage2d_mxfp8_unit(const Stage2d& s) {
    float amax = s.tiles[s.band * s.tc + s.cb];
    float sc = e8m0_reciprocal(e8m0_code(__fmul_rn(amax, s.rcp)));
    u64 r0 = s.band * 32, r_lo = s.start / s.cols, r_hi = (s.end - 1) / s.cols;
    u64 ra = r0 > r_lo ? r0 : r_lo, rb = r0 + 31 < r_hi ? r0 + 31 : r_hi;
    for (u64 r = ra; r <= rb; ++r) {
        u64 a, b;
        stage2d_row(s, r, a, b);
        uint8_t* o = s.out + (a - s.start);
        if (b == a + 32 && ((uintptr_t)o & 15u) == 0) {
            float v[32];
            stage2d_load<32>(s.x, s.xd, a - s.start, v);
            uint32_t w[8];
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                uint32_t lo = fp8x2_code(__fmul_rn(v[4 * q], sc), __fmul_rn(v[4 * q + 1], sc),
                                         s.e5m2);
                uint32_t hi = fp8x2_code(__fmul_rn(v[4 * q + 2], sc),
                                         __fmul_rn(v[4 * q + 3], sc), s.e5m2);
                w[q] = lo | (hi << 16);
            }
            uint4* p = reinterpret_cast<uint4*>(o);
            p[0] = make_uint4(w[0], w[1], w[2], w[3]);
            p[1] = make_uint4(w[4], w[5], w[6], w[7]);
        } else {
            for (u64 g = a; g < b; ++g) {
                float y = __fmul_rn(bf16_round(load(s.x, s.xd, g - s.start), s.xd), sc);
                s.out[g - s.start] = (uint8_t)(s.e5m2 ? e5m2_code(y) : e4m3_code(y));
            }
        }
    }
}

// NVFP4 packed codes of a unit (cols % 16 == 0, start even): the tensor factors from the
// piece's amax word as nvfp4_params makes them, the tile's block factor once, byte j of the
// piece holds its elements 2j (low nibble) and 2j + 1.
__device__ __forceinline__ void stage2d_nvfp4_unit(const Stage2d& s, const float* __restrict__ e4m3) {
    const float flt_max = __uint_as_float(0x7F7FFFFFu);
    float gamax = __uint_as_float(s.amax[0]);
    float s_enc = fminf(__fdiv_rn(2688.0f, gamax), flt_max);
    if (gamax == 0.0f || s_enc == 0.0f) s_enc = 1.0f;
    float s_dec = __fdiv_rn(1.0f, s_enc);
    float k = __fmul_rn(s_enc, __uint_as_float(0x3E2AAAABu));
    float amax = s.tiles[s.band * s.tc + s.cb];
    uint32_t sf = e4m3_code(__fmul_rn(amax, k));
    float m = fminf(__fdiv_rn(1.0f, __fmul_rn(e4m3[sf], s_dec)), flt_max);
    u64 r0 = s.band * 16, r_lo = s.start / s.cols, r_hi = (s.end - 1) / s.cols;
    u64 ra = r0 > r_lo ? r0 : r_lo, rb = r0 + 15 < r_hi ? r0 + 15 : r_hi;
    for (u64 r = ra; r <= rb; ++r) {
        u64 a, b;
        stage2d_row(s, r, a, b);
        uint8_t* o = s.out + (a - s.start) / 2;
        if (b == a + 16 && ((uintptr_t)o & 7u) == 0) {
            float v[16];
            stage2d_load<16>(s.x, s.xd, a - s.start, v);
            uint32_t w[2];
#pragma unroll
            for (int q = 0; q < 2; ++q) {
                uint32_t acc = 0;
#pragma unroll
                for (int h = 0; h < 8; ++h) acc |= e2m1_code(__fmul_rn(v[8 * q + h], m)) << (4 * h);
                w[q] = acc;
            }
            *reinterpret_cast<uint2*>(o) = make_uint2(w[0], w[1]);
        } else {
            for (u64 g = a; g < b; g += 2) {
                uint32_t c0 = e2m1_code(__fmul_rn(bf16_round(load(s.x, s.xd, g - s.start), s.xd), m));
                uint32_t c1 = e2m1_code(__fmul_rn(bf16_round(load(s.x, s.xd, g + 1 - s.start), s.xd), m));
                s.out[(g - s.start) / 2] = (uint8_t)(c0 | (c1 << 4));
            }
        }
    }
}

extern "C" __global__ void stage2d_quantize_many(const u64* __restrict__ table, uint32_t count,
                                                 u64 units, const float* __restrict__ e4m3) {
    GRID_STRIDE(u, units) {
        Stage2d s = stage2d_unit(table, count, u);
        if (s.nvfp4) stage2d_nvfp4_unit(s, e4m3); else stage2d_mxfp8_unit(s);
    }
}

// Rowwise and columnwise E8M0 scales of many 2D MXFP8 matrices (mxfp8_scales_2d of each, the
// same bytes). Every byte of a 32x32 tile's scales is that tile's one E8M0 code, and a band of
// whole tile rows owns two contiguous runs of output: its rows of the rowwise copy
// ([rows, tc], 32 rows per tile row) and its tile rows of the columnwise copy
// ([ceil(rows/32), cols]). A CTA takes one item: up to SCALES2D_CODES tiles (whole tile rows
// where tc <= SCALES2D_CODES, else a segment of one tile row), makes their codes once into
// shared memory, then stores both runs as a copy kernel would: consecutive lanes, consecutive
// 16-byte pieces, whole sectors per store instruction (rowwise a piece is 16 codes of a row,
// columnwise one code splatted: cols % 16 == 0 keeps a piece inside one tile). Where tc % 16
// or cols % 16 is not 0 or a copy is not 16-byte aligned, that copy is stored byte by byte.
// The kernel before gave a thread a strip of 16 tiles (16 row stores of 16 bytes) or 64
// columnwise bytes, each thread a chain of latencies: 0.46x of a copy on an H200 for
// Llama-3.2-1B's 112 matrices.
// The table travels in the parameters (the constant bank: no upload per call, as
// mxfp8_both_e4m3_bf16_v4_many): `items` the matrices, `units` the items of all of them,
// `first` each matrix's first item (ascending from 0), `rows` 6 words per matrix: [tiles, rows,
// cols, row_scales, col_scales, the kind's max_norm_rcp bits], `slot` each grid row's first
// matrix (ascending from 0; a row holds matrices slot[y] .. slot[y + 1], or .. items for the
// last). At most SCALES2D_MAX matrices per launch (the host splits longer lists;
// 8208 bytes of parameters, within the 32764 a launch may pass since CUDA 12.1), or
// SCALES2D_SMALL with mxfp8_scales_2d_many_32 (2064 bytes): a launch's parameters past 4 KB
// cost the host ~3 us more to enqueue, which the step's calls of 28 matrices (a bucket group of
// Llama-3.2-1B) paid beside ~5 us of kernel.
#define SCALES2D_MAX 128
#define SCALES2D_SMALL 32
#define SCALES2D_CODES 256
#define SCALES2D_THREADS 256
template <int MAX>
struct Scales2dParamsT {
    u64 items;
    u64 units;
    u64 first[MAX];
    u64 rows[MAX][6];
    u64 slot[MAX];
};
using Scales2dParams = Scales2dParamsT<SCALES2D_MAX>;
// The host passes exactly these bytes (quant.rs, SCALES2D_MAX, SCALES2D_SMALL, SCALES2D_CODES).
static_assert(sizeof(Scales2dParams) == 8 * (2 + SCALES2D_MAX * 8), "parameter layout");
static_assert(sizeof(Scales2dParamsT<SCALES2D_SMALL>) == 8 * (2 + SCALES2D_SMALL * 8),
              "parameter layout");

// a / b and a % b in 32 bits where both fit (the 64-bit division is a long emulated sequence).
__device__ __forceinline__ void divmod_u64(u64 a, u64 b, u64& q, u64& r) {
    if ((a | b) <= 0xFFFFFFFFull) {
        const uint32_t a32 = (uint32_t)a, b32 = (uint32_t)b;
        q = a32 / b32;
        r = a32 - (uint32_t)q * b32;
    } else {
        q = a / b;
        r = a - q * b;
    }
}

// One item of mxfp8_scales_2d_many: a matrix's views and its tile rows tr0 .. tr0 + tb, tile
// columns c0 .. c0 + nc.
struct Scales2dItem {
    const float* tiles;
    uint8_t* rs;
    uint8_t* cs;
    u64 rows, cols, tc, tr0, c0;
    float rcp;
    uint32_t tb, nc;
};

// Item u of the launch, of matrix m.
template <class P>
__device__ __forceinline__ Scales2dItem scales2d_item(const P& p, uint32_t m, u64 u) {
    const u64* w = p.rows[m];
    Scales2dItem it;
    it.tiles = reinterpret_cast<const float*>(w[0]);
    it.rs = reinterpret_cast<uint8_t*>(w[3]);
    it.cs = reinterpret_cast<uint8_t*>(w[4]);
    it.rows = w[1];
    it.cols = w[2];
    it.rcp = __uint_as_float((uint32_t)w[5]);
    it.tc = (it.cols + 31) / 32;
    const u64 trows = (it.rows + 31) / 32;
    const uint32_t n = it.tc < SCALES2D_CODES ? (uint32_t)it.tc : SCALES2D_CODES;
    const uint32_t per = SCALES2D_CODES / n;  // tile rows per item
    u64 band, seg;
    divmod_u64(u - p.first[m], (it.tc + n - 1) / n, band, seg);
    it.tr0 = band * per;
    it.c0 = seg * n;
    it.tb = trows - it.tr0 < per ? (uint32_t)(trows - it.tr0) : per;
    it.nc = it.tc - it.c0 < n ? (uint32_t)(it.tc - it.c0) : n;
    return it;
}

// Thread e's tile of the item (e < tb·nc; 0 past them).
__device__ __forceinline__ float scales2d_tile(const Scales2dItem& it, uint32_t e) {
    // Device allocations: global loads, not generic ones.
    __builtin_assume(__isGlobal(it.tiles));
    if (e >= it.tb * it.nc) return 0.0f;
    const uint32_t r = e / it.nc, c = e - r * it.nc;
    return __ldg(it.tiles + (it.tr0 + r) * it.tc + it.c0 + c);
}

// Walks the chunks i = threadIdx.x, + blockDim.x, ... of a grid `per` chunks wide as (row,
// column): one division per walk rather than per chunk.
struct ChunkWalk {
    uint32_t r, c, dr, dc, per;
    __device__ __forceinline__ explicit ChunkWalk(uint32_t per_) : per(per_) {
        r = threadIdx.x / per;
        c = threadIdx.x - r * per;
        dr = blockDim.x / per;
        dc = blockDim.x - dr * per;
    }
    __device__ __forceinline__ void next() {
        r += dr;
        c += dc;
        if (c >= per) {
            c -= per;
            ++r;
        }
    }
};

// Both scale runs of the item from its codes.
__device__ __forceinline__ void scales2d_store(const Scales2dItem& it, const uint8_t* code) {
    __builtin_assume(__isGlobal(it.rs));
    __builtin_assume(__isGlobal(it.cs));
    const u64 tc = it.tc, cols = it.cols;
    const uint32_t nc = it.nc, tb = it.tb;
    // Rowwise: rows 32·tr0 .. r1, bytes c0 .. c0 + nc of each (contiguous where nc == tc).
    const u64 r1 = 32 * (it.tr0 + tb) < it.rows ? 32 * (it.tr0 + tb) : it.rows;
    const uint32_t nr = (uint32_t)(r1 - 32 * it.tr0);
    uint8_t* ro = it.rs + 32 * it.tr0 * tc + it.c0;
    if (tc % 16 == 0 && ((uintptr_t)it.rs & 15u) == 0) {
        // nc % 16 == 0: n and tc - c0 are multiples of 16
        for (ChunkWalk w(nc / 16); w.r < nr; w.next())
            *reinterpret_cast<uint4*>(ro + (u64)w.r * tc + 16 * w.c) =
                *reinterpret_cast<const uint4*>(code + (w.r / 32) * nc + 16 * w.c);
    } else {
        for (ChunkWalk w(nc); w.r < nr; w.next()) ro[(u64)w.r * tc + w.c] = code[(w.r / 32) * nc + w.c];
    }
    // Columnwise: tile rows tr0 .. tr0 + tb, columns 32·c0 .. + wb of each.
    const u64 cb = 32 * it.c0;
    const uint32_t wb = cols - cb < 32 * (u64)nc ? (uint32_t)(cols - cb) : 32 * nc;
    uint8_t* co = it.cs + it.tr0 * cols + cb;
    if (cols % 16 == 0 && ((uintptr_t)it.cs & 15u) == 0) {
        // wb % 16 == 0: 32·nc and cols - 32·c0 are
        for (ChunkWalk w(wb / 16); w.r < tb; w.next()) {
            const uint32_t b = code[w.r * nc + w.c / 2] * 0x01010101u;
            *reinterpret_cast<uint4*>(co + (u64)w.r * cols + 16 * w.c) = make_uint4(b, b, b, b);
        }
    } else {
        for (ChunkWalk w(wb); w.r < tb; w.next()) co[(u64)w.r * cols + w.c] = code[w.r * nc + w.c / 32];
    }
}

// Grid (the width, slots): a slot is a run of consecutive matrices whose items together are
// at most the width (the host packs them), and CTA (x, y) takes item x of slot y, or exits
// past the slot's items. The CTA finds its matrix by a scan over the slot's few matrices, all
// threads reading the same parameter words. One grid row per matrix (the version before)
// left half of Llama-3.2-1B's CTAs empty (a row as wide as the largest matrix's 64 items for
// matrices of 4 and 16); a 1-D grid found each CTA's matrix by a binary search in the
// parameters, six dependent reads of the constant bank that missed its cache. Exactly
// SCALES2D_THREADS threads a CTA (thread e codes tiles e, e + SCALES2D_THREADS, ...).
template <class P>
__device__ __forceinline__ void mxfp8_scales_2d_body(const P& p) {
    constexpr uint32_t K = SCALES2D_CODES / SCALES2D_THREADS;  // tiles a thread
    static_assert(K * SCALES2D_THREADS == SCALES2D_CODES, "whole tiles a thread");
    __shared__ __align__(16) uint8_t code[SCALES2D_CODES];
    const uint32_t y = blockIdx.y;
    uint32_t m = (uint32_t)p.slot[y];
    const uint32_t last = y + 1 < gridDim.y ? (uint32_t)p.slot[y + 1] : (uint32_t)p.items;
    const u64 u = p.first[m] + blockIdx.x, end = last < p.items ? p.first[last] : p.units;
    if (u >= end) return;
    while (m + 1 < last && p.first[m + 1] <= u) ++m;
    const Scales2dItem it = scales2d_item(p, m, u);
    float t[K];
#pragma unroll
    for (uint32_t k = 0; k < K; ++k) t[k] = scales2d_tile(it, threadIdx.x + k * SCALES2D_THREADS);
#pragma unroll
    for (uint32_t k = 0; k < K; ++k)
        code[threadIdx.x + k * SCALES2D_THREADS] = (uint8_t)e8m0_code(__fmul_rn(t[k], it.rcp));
    __syncthreads();
    scales2d_store(it, code);
}

extern "C" __global__ void __launch_bounds__(SCALES2D_THREADS) mxfp8_scales_2d_many(const Scales2dParams p) {
    mxfp8_scales_2d_body(p);
}

// The same for at most SCALES2D_SMALL matrices (a quarter of the parameter bytes).
extern "C" __global__ void __launch_bounds__(SCALES2D_THREADS)
    mxfp8_scales_2d_many_32(const Scales2dParamsT<SCALES2D_SMALL> p) {
    mxfp8_scales_2d_body(p);
}
