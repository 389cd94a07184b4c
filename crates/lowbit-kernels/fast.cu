// The fast (deterministic, not CPU-bit-exact) memory-bound kernels of the Llama step, used by
// lowbit-device's CUDA backend when the device's matmul mode is Bf16 (`--compute bf16`):
// per-row softmax cross-entropy with its gradient, RMSNorm forward and backward (dx, and dw as
// a two-stage deterministic reduction), and float4 forms of RoPE, SwiGLU and the embedding
// lookup with the ids checked on the device.
//
// Determinism: every reduction has a fixed shape that depends only on the op's sizes and the
// views' 16-byte alignment (which elements a thread reads, the xor-shuffle tree inside a warp,
// warps combined in index order through shared memory, dw's row blocks summed in block
// order), never on timing or atomics, so two runs on one GPU give the same bytes. Relative to
// the exact kernels (llm.cu, ops.cu), which sum in the CPU's index order in one thread, only
// the association of the sums changes (and, for the cross-entropy's sum, expf and an online
// rescale: see fast_xent); every element-wise formula is the exact one, _rn intrinsics and
// exp/ln through double, so RoPE, SwiGLU and the embedding give the exact kernels' bits.
//
// Ids and targets are NOT validated by the host in this mode (that was a device-to-host copy
// and a stream sync per call): a kernel that meets an id that is not an integer in range reads
// nothing out of bounds, writes NaN where that row's results go, and records the smallest bad
// row with its value in an error word (u64: row << 32 | f32 bits, atomicMin, so the record is
// the same whatever the CTA order), which the host turns into an error at its next read.

#include <stdint.h>

#include "include/lowbit_convert.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ float exp32(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float ln32(float x) { return (float)log((double)x); }
__device__ __forceinline__ float qnan() { return __uint_as_float(0x7FC00000u); }
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xFF800000u); }

// Whether v is an integer in 0..n (the host's rule: v >= 0, no fraction, v < n; NaN fails).
__device__ __forceinline__ bool valid_id(float v, u64 n) {
    return v >= 0.0f && truncf(v) == v && (double)v < (double)n;
}

// Records row `r` with value `v` as bad (the smallest row wins).
__device__ __forceinline__ void report_bad(u64* err, u64 r, float v) {
    u64 rr = r > 0xFFFFFFFEull ? 0xFFFFFFFEull : r;
    atomicMin(err, (rr << 32) | (u64)__float_as_uint(v));
}

// ---- block reductions (fixed trees) ----

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
    return v;
}

// (m, s) with s = sum exp(x - m): the combination of two partial softmax sums. A part whose
// max equals the result keeps its sum as is (so -inf parts and empty parts need no exp).
__device__ __forceinline__ void lse_merge(float& m, float& s, float m2, float s2) {
    float mm = fmaxf(m, m2);
    float a = (m == mm) ? s : s * expf(m - mm);
    float b = (m2 == mm) ? s2 : s2 * expf(m2 - mm);
    m = mm;
    s = a + b;
}

__device__ __forceinline__ void warp_lse(float& m, float& s) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float m2 = __shfl_xor_sync(0xFFFFFFFFu, m, o);
        float s2 = __shfl_xor_sync(0xFFFFFFFFu, s, o);
        lse_merge(m, s, m2, s2);
    }
}

// Sum over the CTA (warps in index order after each warp's tree); every thread gets the
// result. `red` holds 32 floats; the CTA is a whole number of warps.
__device__ __forceinline__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `red` may still be read by the previous call
    if (lane == 0) red[w] = v;
    __syncthreads();
    float t = lane < nw ? red[lane] : 0.0f;
    return warp_sum(t);
}

// ---- per-row softmax cross-entropy ----

// One row of `classes` logits by a group of G threads (G = 32: a warp per row; `CTA`: G =
// blockDim.x), `g` this thread's index in the group. Pass 1 reads the row once: each thread keeps
// an online (max, sum of expf(x - max)), rescaled when its max grows, over its elements (a
// scalar head up to 16-byte alignment, float4 body, scalar tail; element k of the body goes to
// thread k % G), then the group's tree combines them. The max is order-free and equals the
// exact max; the sum s differs from the exact sum by its association, expf and the rescales.
// The loss is -((x_t - mx) - ln32(s)). With `grad`, pass 2 reads the row again and writes
// c (e_j / s - [j = t]) with the exact e_j = exp32(x_j - mx) and the exact division
// (`fast_exp`, the default: __expf(x_j - mx) · fl(1 / s), a few ulp from the exact e_j / s, far
// below the bf16 rounding of the gradient the bf16 mode stores; the double-precision exp32 made
// this pass compute-bound: 0.47x of a copy against 0.61x at 4096 × 50,304 on an H200). Bad target: loss NaN, the gradient row NaN, the error word set.
// With `y` (a bf16 row), the gradient goes there, each element rounded once as `cast` rounds it
// (RNE, NaN quieted), and x is left as it is: the operand the head's backward products read,
// without a pass of its own.
template <bool CTA>
__device__ __forceinline__ void xent_row(float* x, uint16_t* y, float t_f, float* loss, u64 r,
                                         u64 classes, float c, bool grad, bool fast_exp,
                                         u64* err, float* red_m, float* red_s, u64 g, u64 G) {
    bool ok = valid_id(t_f, classes);
    u64 t = ok ? (u64)t_f : 0;
    float xt = ok ? x[t] : 0.0f;  // read before pass 2 overwrites the row
    u64 addr = (u64)x;
    u64 head = ((16 - (addr & 15)) & 15) / 4;
    if ((addr & 3) != 0 || head > classes) head = classes;  // not f32-aligned: all scalar
    u64 body = (classes - head) / 4;
    u64 tail0 = head + body * 4;
    const float4* xv = (const float4*)(x + head);

    float m = neg_inf(), s = 0.0f;
    for (u64 j = g; j < head; j += G) {
        float v = x[j];
        float mm = fmaxf(m, v);
        if (mm != m) { s = (m == neg_inf()) ? s : s * expf(m - mm); m = mm; }
        s += (v == neg_inf()) ? 0.0f : expf(v - m);
    }
    // Four float4 loads in flight per thread before any is used (a CTA is alone on its SM at
    // 128,256 classes: one load per thread would leave the SM's memory pipe mostly idle); the
    // elements are still taken in the same order.
#define XENT_ACC(q)                                                             \
    {                                                                           \
        float mm = fmaxf(fmaxf(fmaxf(m, q.x), fmaxf(q.y, q.z)), q.w);           \
        if (mm != m) { s = (m == neg_inf()) ? s : s * expf(m - mm); m = mm; }   \
        float e0 = (q.x == neg_inf()) ? 0.0f : expf(q.x - m);                   \
        float e1 = (q.y == neg_inf()) ? 0.0f : expf(q.y - m);                   \
        float e2 = (q.z == neg_inf()) ? 0.0f : expf(q.z - m);                   \
        float e3 = (q.w == neg_inf()) ? 0.0f : expf(q.w - m);                   \
        s += (e0 + e1) + (e2 + e3);                                             \
    }
    u64 k = g;
    for (; k + 3 * G < body; k += 4 * G) {
        float4 q0 = xv[k], q1 = xv[k + G], q2 = xv[k + 2 * G], q3 = xv[k + 3 * G];
        XENT_ACC(q0) XENT_ACC(q1) XENT_ACC(q2) XENT_ACC(q3)
    }
    for (; k < body; k += G) {
        float4 q = xv[k];
        XENT_ACC(q)
    }
#undef XENT_ACC
    for (u64 j = tail0 + g; j < classes; j += G) {
        float v = x[j];
        float mm = fmaxf(m, v);
        if (mm != m) { s = (m == neg_inf()) ? s : s * expf(m - mm); m = mm; }
        s += (v == neg_inf()) ? 0.0f : expf(v - m);
    }
    // A NaN element: the exact sum is NaN (exp32(NaN - mx)); fmaxf skipped it above.
    warp_lse(m, s);
    if (CTA) {
        int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
        __syncthreads();
        if (lane == 0) { red_m[w] = m; red_s[w] = s; }
        __syncthreads();
        if (w == 0) {
            float mw = lane < nw ? red_m[lane] : neg_inf();
            float sw = lane < nw ? red_s[lane] : 0.0f;
            warp_lse(mw, sw);
            if (lane == 0) { red_m[32] = mw; red_s[32] = sw; }
        }
        __syncthreads();
        m = red_m[32];
        s = red_s[32];
    }
    if (g == 0) loss[r] = ok ? -__fsub_rn(__fsub_rn(xt, m), ln32(s)) : qnan();
    if (!ok && g == 0) report_bad(err, r, t_f);
    if (!grad) return;
    float4* yv = (float4*)(x + head);
    float nanv = qnan();
    const float inv = __frcp_rn(s);
#define XENT_E(v) (fast_exp ? __fmul_rn(__expf(__fsub_rn((v), m)), inv) : __fdiv_rn(exp32(__fsub_rn((v), m)), s))
#define XENT_G(v, j) (ok ? __fmul_rn(c, __fsub_rn(XENT_E(v), (j) == t ? 1.0f : 0.0f)) : nanv)
    // bf16 out: four elements as one 8-byte store where the row's body is 8-byte aligned there.
    bool y8 = y != nullptr && (((u64)(y + head)) & 7) == 0;
#define XENT_PUT(j, v)                                   \
    {                                                    \
        float gv = (v);                                  \
        if (y) y[j] = f32_to_bf16_bits(gv); else x[j] = gv; \
    }
    for (u64 j = g; j < head; j += G) XENT_PUT(j, XENT_G(x[j], j));
#define XENT_G4(q, k)                                                              \
    {                                                                              \
        u64 j = head + 4 * (k);                                                    \
        q.x = XENT_G(q.x, j);                                                      \
        q.y = XENT_G(q.y, j + 1);                                                  \
        q.z = XENT_G(q.z, j + 2);                                                  \
        q.w = XENT_G(q.w, j + 3);                                                  \
        if (y8) {                                                                  \
            uint2 o;                                                               \
            o.x = (uint32_t)f32_to_bf16_bits(q.x) | ((uint32_t)f32_to_bf16_bits(q.y) << 16); \
            o.y = (uint32_t)f32_to_bf16_bits(q.z) | ((uint32_t)f32_to_bf16_bits(q.w) << 16); \
            reinterpret_cast<uint2*>(y + j)[0] = o;                                \
        } else if (y) {                                                            \
            y[j] = f32_to_bf16_bits(q.x);                                          \
            y[j + 1] = f32_to_bf16_bits(q.y);                                      \
            y[j + 2] = f32_to_bf16_bits(q.z);                                      \
            y[j + 3] = f32_to_bf16_bits(q.w);                                      \
        } else {                                                                   \
            yv[k] = q;                                                             \
        }                                                                          \
    }
    k = g;
    for (; k + 3 * G < body; k += 4 * G) {
        float4 q0 = xv[k], q1 = xv[k + G], q2 = xv[k + 2 * G], q3 = xv[k + 3 * G];
        XENT_G4(q0, k) XENT_G4(q1, k + G) XENT_G4(q2, k + 2 * G) XENT_G4(q3, k + 3 * G)
    }
    for (; k < body; k += G) {
        float4 q = xv[k];
        XENT_G4(q, k)
    }
#undef XENT_G4
    for (u64 j = tail0 + g; j < classes; j += G) XENT_PUT(j, XENT_G(x[j], j));
#undef XENT_PUT
#undef XENT_G
#undef XENT_E
}

// A CTA per row (rows strided over the grid). `grad` set: the logits are overwritten with
// their gradient times c, or it is written into the bf16 `y` (rows·classes) when y is not
// null. Launch with a whole number of warps, at most 1024 threads.
extern "C" __global__ void fast_xent_cta(float* x, const float* __restrict__ targets,
                                         float* __restrict__ loss, u64* err, u64 rows,
                                         u64 classes, float c, uint32_t grad,
                                         uint32_t fast_exp, uint16_t* y) {
    __shared__ float red_m[33], red_s[33];
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        xent_row<true>(x + r * classes, y ? y + r * classes : nullptr, targets[r], loss, r,
                       classes, c, grad != 0, fast_exp != 0, err, red_m, red_s, threadIdx.x,
                       blockDim.x);
        __syncthreads();
    }
}

// A warp per row (small vocabularies): blockDim.x / 32 rows per CTA.
extern "C" __global__ void fast_xent_warp(float* x, const float* __restrict__ targets,
                                          float* __restrict__ loss, u64* err, u64 rows,
                                          u64 classes, float c, uint32_t grad,
                                          uint32_t fast_exp, uint16_t* y) {
    u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    for (u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
        xent_row<false>(x + r * classes, y ? y + r * classes : nullptr, targets[r], loss, r,
                        classes, c, grad != 0, fast_exp != 0, err, nullptr, nullptr,
                        threadIdx.x & 31, 32);
    }
}

// ---- RMSNorm ----
//
// A CTA of T threads per row (RMS_T = 256, or 128 for the `_t128` float4 entries), the row in
// registers: slot i of thread t covers W elements starting at W (t + i T) (W = 4: float4, for
// rows whose length is a multiple of 4 and 16-byte aligned views; W = 1 otherwise), NV slots a
// thread, NV W T >= cols. Per element
// the exact formulas (_rn, no contraction); only the association of the row sums (ss, dot)
// changes: each thread sums its slots in order, then block_sum.

#define RMS_T 256

template <int W>
__device__ __forceinline__ void ld(const float* p, float* v) {
    if (W == 4) {
        float4 q = *(const float4*)p;
        v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
    } else {
        v[0] = p[0];
    }
}

template <int W>
__device__ __forceinline__ void st(float* p, const float* v) {
    if (W == 4) {
        *(float4*)p = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        p[0] = v[0];
    }
}

// W values as bf16 (RNE, as `cast` rounds): one 8-byte store for W = 4.
template <int W>
__device__ __forceinline__ void st_bf16(uint16_t* p, const float* v) {
    if (W == 4) {
        uint2 o;
        o.x = (uint32_t)f32_to_bf16_bits(v[0]) | ((uint32_t)f32_to_bf16_bits(v[1]) << 16);
        o.y = (uint32_t)f32_to_bf16_bits(v[2]) | ((uint32_t)f32_to_bf16_bits(v[3]) << 16);
        *(uint2*)p = o;
    } else {
        p[0] = f32_to_bf16_bits(v[0]);
    }
}

// y = (x rstd) w, rstd = 1 / sqrt(ss / cols + eps), rows strided over the grid; y f32, or bf16
// (`ybf16`: each value rounded once, the operand a bf16 GEMM would cast it to).
template <int NV, int W, int T>
__device__ __forceinline__ void rms_fwd(const float* __restrict__ x, const float* __restrict__ w,
                                        void* __restrict__ y, float* __restrict__ rstd, u64 rows,
                                        u64 cols, float eps, bool ybf16) {
    __shared__ float red[32];
    float wr[NV * W];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
        if (c0 < cols) ld<W>(w + c0, wr + i * W);
    }
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float v[NV * W];
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
            if (c0 < cols) {
                ld<W>(xr + c0, v + i * W);
#pragma unroll
                for (int k = 0; k < W; ++k) ss = __fadd_rn(ss, __fmul_rn(v[i * W + k], v[i * W + k]));
            }
        }
        ss = block_sum(ss, red);
        float rs = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, (float)cols), eps)));
        if (threadIdx.x == 0) rstd[r] = rs;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
            if (c0 < cols) {
                float o[W];
#pragma unroll
                for (int k = 0; k < W; ++k) o[k] = __fmul_rn(__fmul_rn(v[i * W + k], rs), wr[i * W + k]);
                if (ybf16)
                    st_bf16<W>((uint16_t*)y + r * cols + c0, o);
                else
                    st<W>((float*)y + r * cols + c0, o);
            }
        }
    }
}

// Backward, stage 1. CTA b owns rows [b rb, min(rows, (b + 1) rb)) and walks them in order:
// xh = x rstd, g = dy w, dot = sum g xh (block_sum), mean = dot / cols, dx = rstd (g - xh mean)
// (the exact formulas), and per column a register partial p += dy xh from +0 in row order,
// written to part[b, :] at the end.
template <int NV, int W, int T>
__device__ __forceinline__ void rms_bwd(const float* __restrict__ x, const float* __restrict__ w,
                                        const float* __restrict__ rstd,
                                        const float* __restrict__ dy, float* __restrict__ dx,
                                        float* __restrict__ part, u64 rows, u64 cols, u64 rb) {
    __shared__ float red[32];
    float wr[NV * W], p[NV * W];
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
#pragma unroll
        for (int k = 0; k < W; ++k) p[i * W + k] = 0.0f;
        if (c0 < cols) ld<W>(w + c0, wr + i * W);
    }
    u64 r0 = (u64)blockIdx.x * rb;
    u64 r1 = r0 + rb < rows ? r0 + rb : rows;
    for (u64 r = r0; r < r1; ++r) {
        float rs = rstd[r];
        float xh[NV * W], g[NV * W], d[NV * W];
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
            if (c0 < cols) {
                ld<W>(x + r * cols + c0, xh + i * W);
                ld<W>(dy + r * cols + c0, d + i * W);
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    int e = i * W + k;
                    xh[e] = __fmul_rn(xh[e], rs);
                    g[e] = __fmul_rn(d[e], wr[e]);
                    dot = __fadd_rn(dot, __fmul_rn(g[e], xh[e]));
                    p[e] = __fadd_rn(p[e], __fmul_rn(d[e], xh[e]));
                }
            }
        }
        dot = block_sum(dot, red);
        float mean = __fdiv_rn(dot, (float)cols);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
            u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
            if (c0 < cols) {
                float o[W];
#pragma unroll
                for (int k = 0; k < W; ++k) {
                    int e = i * W + k;
                    o[k] = __fmul_rn(rs, __fsub_rn(g[e], __fmul_rn(xh[e], mean)));
                }
                st<W>(dx + r * cols + c0, o);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        u64 c0 = (u64)W * (threadIdx.x + (u64)i * T);
        if (c0 < cols) st<W>(part + (u64)blockIdx.x * cols + c0, p + i * W);
    }
}

#define RMS_ENTRY(NV, W, T, SUF)                                                               \
    extern "C" __global__ void __launch_bounds__(T) fast_rms_fwd_##SUF(                        \
        const float* __restrict__ x, const float* __restrict__ w, void* __restrict__ y,        \
        float* __restrict__ rstd, u64 rows, u64 cols, float eps, uint32_t ybf16) {             \
        rms_fwd<NV, W, T>(x, w, y, rstd, rows, cols, eps, ybf16 != 0);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(T) fast_rms_bwd_##SUF(                        \
        const float* __restrict__ x, const float* __restrict__ w,                              \
        const float* __restrict__ rstd, const float* __restrict__ dy, float* __restrict__ dx,  \
        float* __restrict__ part, u64 rows, u64 cols, u64 rb) {                                \
        rms_bwd<NV, W, T>(x, w, rstd, dy, dx, part, rows, cols, rb);                           \
    }

// float4 slots: cols <= 4 T NV; scalar slots: cols <= T NV.
RMS_ENTRY(1, 4, RMS_T, v1)
RMS_ENTRY(2, 4, RMS_T, v2)
RMS_ENTRY(4, 4, RMS_T, v4)
RMS_ENTRY(8, 4, RMS_T, v8)
RMS_ENTRY(4, 1, RMS_T, s4)
RMS_ENTRY(8, 1, RMS_T, s8)
RMS_ENTRY(16, 1, RMS_T, s16)
RMS_ENTRY(32, 1, RMS_T, s32)
// 128-thread CTAs (twice the rows in flight per SM for short rows): `fast_rms_threads` 128.
RMS_ENTRY(1, 4, 128, v1_t128)
RMS_ENTRY(2, 4, 128, v2_t128)
RMS_ENTRY(4, 4, 128, v4_t128)

// Backward, stage 2: dw[c] = dw[c] + total, total the sum of part[0..blocks, c] in a fixed
// tree: a CTA of 32 x 32 threads takes 32 columns; thread (cx, by) sums the blocks by, by + 32,
// ... in order from +0, then the 32 sums of a column are added pairwise (by 0+16, 1+17, ..,
// then 0+8, ...) in shared memory.
extern "C" __global__ void __launch_bounds__(1024) fast_rms_dw_reduce(
    const float* __restrict__ part, float* __restrict__ dw, u64 blocks, u64 cols) {
    __shared__ float acc[32][33];
    u64 c = (u64)blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (c < cols)
        for (u64 b = threadIdx.y; b < blocks; b += 32) s = __fadd_rn(s, part[b * cols + c]);
    acc[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    for (int h = 16; h > 0; h >>= 1) {
        if (threadIdx.y < h)
            acc[threadIdx.y][threadIdx.x] =
                __fadd_rn(acc[threadIdx.y][threadIdx.x], acc[threadIdx.y + h][threadIdx.x]);
        __syncthreads();
    }
    if (threadIdx.y == 0 && c < cols) dw[c] = __fadd_rn(dw[c], acc[0][threadIdx.x]);
}

// ---- RoPE, SwiGLU, embedding: float4 forms of the exact kernels (the same bits) ----

// llm_rope over 4 pairs an item: n4 = rows heads half / 4 items, half % 4 == 0 and every view
// 16-byte aligned (the host checks). x and y are the same address (in place: an item reads
// its pairs before writing them) or disjoint; `ybf16`: y is bf16 (disjoint), four values an
// 8-byte store, each rounded once as `cast` rounds.
extern "C" __global__ void fast_rope4(const float* x, void* y, const float* __restrict__ cos_t,
                                      const float* __restrict__ sin_t, u64 n4, u64 heads,
                                      u64 half, u64 seq, uint32_t inverse, uint32_t ybf16) {
    u64 q = half / 4;
    GRID_STRIDE(k, n4) {
        u64 i = (k % q) * 4;
        u64 head = k / q;  // row * heads + h
        u64 pos = (head / heads) % seq;
        u64 base = head * 2 * half;
        float4 a = *(const float4*)(x + base + i), b = *(const float4*)(x + base + i + half);
        float4 c = *(const float4*)(cos_t + pos * half + i);
        float4 s = *(const float4*)(sin_t + pos * half + i);
        float4 lo, hi;
#define ROT(f)                                                                  \
    {                                                                           \
        float ac = __fmul_rn(a.f, c.f), bs = __fmul_rn(b.f, s.f);               \
        float bc = __fmul_rn(b.f, c.f), as = __fmul_rn(a.f, s.f);               \
        lo.f = inverse ? __fadd_rn(ac, bs) : __fsub_rn(ac, bs);                 \
        hi.f = inverse ? __fsub_rn(bc, as) : __fadd_rn(bc, as);                 \
    }
        ROT(x) ROT(y) ROT(z) ROT(w)
#undef ROT
        if (ybf16) {
            const float l4[4] = {lo.x, lo.y, lo.z, lo.w}, h4[4] = {hi.x, hi.y, hi.z, hi.w};
            st_bf16<4>((uint16_t*)y + base + i, l4);
            st_bf16<4>((uint16_t*)y + base + i + half, h4);
        } else {
            *(float4*)((float*)y + base + i) = lo;
            *(float4*)((float*)y + base + i + half) = hi;
        }
    }
}

__device__ __forceinline__ float sigmoid32(float g) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp32(-g)));
}

__device__ __forceinline__ float swiglu1(float g, float u) {
    return __fmul_rn(__fmul_rn(g, sigmoid32(g)), u);
}

// llm_swiglu with float4 loads: n elements, 16-byte aligned views; the n % 4 tail scalar. `out`
// f32, or bf16 (`obf16`: each value rounded once, as `cast` rounds).
extern "C" __global__ void fast_swiglu4(const float* __restrict__ gate,
                                        const float* __restrict__ up, void* __restrict__ out,
                                        u64 n, uint32_t obf16) {
    u64 n4 = n / 4;
    GRID_STRIDE(k, n4) {
        float4 g = ((const float4*)gate)[k], u = ((const float4*)up)[k];
        float o[4] = {swiglu1(g.x, u.x), swiglu1(g.y, u.y), swiglu1(g.z, u.z), swiglu1(g.w, u.w)};
        if (obf16)
            st_bf16<4>((uint16_t*)out + 4 * k, o);
        else
            st<4>((float*)out + 4 * k, o);
    }
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - 4 * n4) {
        float o = swiglu1(gate[4 * n4 + t], up[4 * n4 + t]);
        if (obf16)
            ((uint16_t*)out)[4 * n4 + t] = f32_to_bf16_bits(o);
        else
            ((float*)out)[4 * n4 + t] = o;
    }
}

// llm_swiglu_backward with float4 loads (as fast_swiglu4).
__device__ __forceinline__ void swiglu_bwd1(float g, float u, float d, float& dg, float& du) {
    float sg = sigmoid32(g);
    du = __fmul_rn(d, __fmul_rn(g, sg));
    float slope = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg)));
    dg = __fmul_rn(__fmul_rn(__fmul_rn(d, u), sg), slope);
}

// `dup` f32, or bf16 (`dbf16`: each value rounded once, as `cast` rounds: up's backward
// products read it as bf16).
extern "C" __global__ void fast_swiglu_bwd4(const float* __restrict__ gate,
                                            const float* __restrict__ up,
                                            const float* __restrict__ dout,
                                            float* __restrict__ dgate, void* __restrict__ dup,
                                            u64 n, uint32_t dbf16) {
    u64 n4 = n / 4;
    GRID_STRIDE(k, n4) {
        float4 g = ((const float4*)gate)[k], u = ((const float4*)up)[k];
        float4 d = ((const float4*)dout)[k];
        float4 dg;
        float du[4];
        swiglu_bwd1(g.x, u.x, d.x, dg.x, du[0]);
        swiglu_bwd1(g.y, u.y, d.y, dg.y, du[1]);
        swiglu_bwd1(g.z, u.z, d.z, dg.z, du[2]);
        swiglu_bwd1(g.w, u.w, d.w, dg.w, du[3]);
        ((float4*)dgate)[k] = dg;
        if (dbf16)
            st_bf16<4>((uint16_t*)dup + 4 * k, du);
        else
            st<4>((float*)dup + 4 * k, du);
    }
    u64 t = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (t < n - 4 * n4) {
        u64 i = 4 * n4 + t;
        float du;
        swiglu_bwd1(gate[i], up[i], dout[i], dgate[i], du);
        if (dbf16)
            ((uint16_t*)dup)[i] = f32_to_bf16_bits(du);
        else
            ((float*)dup)[i] = du;
    }
}

// llm_embedding with the ids checked here: a CTA per row (strided), out[r, :] = f32(table[id,
// :]); with `vec` (f32 table, dim % 4 == 0, 16-byte aligned views) float4 copies. A bad id:
// the row NaN, the error word set.
extern "C" __global__ void fast_embedding(const uint8_t* __restrict__ table, uint32_t td,
                                          const float* __restrict__ ids, float* __restrict__ out,
                                          u64* err, u64 rows, u64 dim, u64 vocab, uint32_t vec) {
    for (u64 r = blockIdx.x; r < rows; r += gridDim.x) {
        float v = ids[r];
        float* o = out + r * dim;
        if (!valid_id(v, vocab)) {
            for (u64 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = qnan();
            if (threadIdx.x == 0) report_bad(err, r, v);
            continue;
        }
        u64 id = (u64)v;
        if (vec) {
            const float4* src = (const float4*)(table + 4 * id * dim);
            for (u64 c = threadIdx.x; c < dim / 4; c += blockDim.x) ((float4*)o)[c] = src[c];
        } else {
            for (u64 c = threadIdx.x; c < dim; c += blockDim.x) o[c] = load(table, td, id * dim + c);
        }
    }
}
