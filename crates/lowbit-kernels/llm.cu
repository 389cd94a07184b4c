// The decoder kernels of lowbit-device's CUDA backend other than attention: token embedding and
// its deterministic scatter-add backward, rotary embedding (rotate-half), SwiGLU and its
// backward, and per-row softmax cross-entropy that can overwrite its logits with their gradient.
// Bit-exact with the CPU backend (crates/lowbit-device/src/ops/llm.rs, the oracle).
//
// Arithmetic contract (as ops.cu): f32 one IEEE operation at a time through the _rn intrinsics
// (never contracted into FMA), exp and ln evaluated in double and rounded to f32, sums whose
// order the CPU fixes run in that order in one thread. Ids and targets were validated by the
// host (integers in range) before any launch; views are raw byte addresses, element-aligned.

#include <stdint.h>

#include "include/lowbit_convert.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

__device__ __forceinline__ float exp32(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float ln32(float x) { return (float)log((double)x); }

// ---- embedding ----

// out[r, c] = f32(table[ids[r], c]) for the n = rows * dim outputs; table of dtype code td.
extern "C" __global__ void llm_embedding(const uint8_t* __restrict__ table, uint32_t td,
                                         const float* __restrict__ ids, float* __restrict__ out,
                                         u64 n, u64 dim) {
    GRID_STRIDE(i, n) {
        u64 r = i / dim, c = i % dim;
        u64 v = (u64)ids[r];
        out[i] = load(table, td, v * dim + c);
    }
}

// The scatter-add of one (group, column) per item, n = groups * dim: group g holds the rows
// order[starts[g] .. starts[g + 1]] (increasing) whose id is gid[g] (ids distinct across
// groups, so no two items write one element); s = sum of dy over those rows from +0 in that
// order, then grad[gid, c] = grad[gid, c] + s. `table` is u64 words: gid[groups], then
// starts[groups + 1], then order[rows].
extern "C" __global__ void llm_embedding_backward(const float* __restrict__ dy,
                                                  float* __restrict__ grad,
                                                  const u64* __restrict__ table, u64 groups,
                                                  u64 n, u64 dim) {
    const u64* gid = table;
    const u64* starts = table + groups;
    const u64* order = starts + groups + 1;
    GRID_STRIDE(i, n) {
        u64 g = i / dim, c = i % dim;
        float s = 0.0f;
        for (u64 k = starts[g]; k < starts[g + 1]; ++k) s = __fadd_rn(s, dy[order[k] * dim + c]);
        u64 o = gid[g] * dim + c;
        grad[o] = __fadd_rn(grad[o], s);
    }
}

// ---- rotary embedding ----

// One item per rotated pair, n = rows * heads * half: a = x[i], b = x[i + half] of its head,
// c, s of its position (row % seq); forward y[i] = a c - b s, y[i + half] = b c + a s; inverse
// y[i] = a c + b s, y[i + half] = b c - a s (products rounded, then the sum). x and y are the
// same address (in place: each item reads its pair before writing it) or disjoint, hence no
// __restrict__ on them. y is stored by its dtype code `yd` (f32, or bf16 when disjoint: each
// value the f32 one rounded once).
extern "C" __global__ void llm_rope(const float* x, uint8_t* y, const float* __restrict__ cos_t,
                                    const float* __restrict__ sin_t, u64 n, u64 heads, u64 half,
                                    u64 seq, uint32_t inverse, uint32_t yd) {
    GRID_STRIDE(k, n) {
        u64 i = k % half;
        u64 head = k / half;  // row * heads + h
        u64 pos = (head / heads) % seq;
        u64 base = head * 2 * half;
        float a = x[base + i], b = x[base + i + half];
        float c = cos_t[pos * half + i], s = sin_t[pos * half + i];
        float ac = __fmul_rn(a, c), bs = __fmul_rn(b, s);
        float bc = __fmul_rn(b, c), as = __fmul_rn(a, s);
        if (inverse) {
            store(y, yd, base + i, __fadd_rn(ac, bs));
            store(y, yd, base + i + half, __fsub_rn(bc, as));
        } else {
            store(y, yd, base + i, __fsub_rn(ac, bs));
            store(y, yd, base + i + half, __fadd_rn(bc, as));
        }
    }
}

// ---- SwiGLU ----

// sg = 1 / (1 + exp32(-g)).
__device__ __forceinline__ float sigmoid32(float g) {
    return __fdiv_rn(1.0f, __fadd_rn(1.0f, exp32(-g)));
}

// out = (g sg) u.
// out of dtype code od (f32 or bf16: the f32 value rounded once).
extern "C" __global__ void llm_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                      uint8_t* __restrict__ out, u64 n, uint32_t od) {
    GRID_STRIDE(i, n) {
        float g = gate[i];
        store(out, od, i, __fmul_rn(__fmul_rn(g, sigmoid32(g)), up[i]));
    }
}

// dup = d (g sg); dgate = ((d u) sg) (1 + g (1 - sg)).
// dup of dtype code dud (f32 or bf16: the f32 value rounded once).
extern "C" __global__ void llm_swiglu_backward(const float* __restrict__ gate,
                                               const float* __restrict__ up,
                                               const float* __restrict__ dout,
                                               float* __restrict__ dgate, uint8_t* __restrict__ dup,
                                               u64 n, uint32_t dud) {
    GRID_STRIDE(i, n) {
        float g = gate[i], u = up[i], d = dout[i];
        float sg = sigmoid32(g);
        store(dup, dud, i, __fmul_rn(d, __fmul_rn(g, sg)));
        float slope = __fadd_rn(1.0f, __fmul_rn(g, __fsub_rn(1.0f, sg)));
        dgate[i] = __fmul_rn(__fmul_rn(__fmul_rn(d, u), sg), slope);
    }
}

// ---- per-row cross-entropy ----

// Per row (one thread, index order as the CPU): mx = max x (NaN ignored, from -inf), stats[3r]
// = mx, stats[3r + 2] = x[target] (kept for the loss, since the gradient path overwrites the
// logits). With `sum` set, also s = sum exp32(x - mx) from +0 in index order, stats[3r + 1] =
// s and loss[r] = -((x_t - mx) - ln32(s)) (the evaluation path: no pass writes the logits).
extern "C" __global__ void llm_xent_stats(const float* __restrict__ x,
                                          const float* __restrict__ targets,
                                          float* __restrict__ stats, float* __restrict__ loss,
                                          u64 rows, u64 classes, uint32_t sum) {
    GRID_STRIDE(r, rows) {
        const float* xr = x + r * classes;
        float mx = __uint_as_float(0xFF800000u);
        for (u64 j = 0; j < classes; ++j) mx = fmaxf(mx, xr[j]);
        float xt = xr[(u64)targets[r]];
        stats[3 * r] = mx;
        stats[3 * r + 2] = xt;
        if (sum) {
            float s = 0.0f;
            for (u64 j = 0; j < classes; ++j) s = __fadd_rn(s, exp32(__fsub_rn(xr[j], mx)));
            stats[3 * r + 1] = s;
            loss[r] = -__fsub_rn(__fsub_rn(xt, mx), ln32(s));
        }
    }
}

// The gradient path, pass 1: x[i] <- e = exp32(x[i] - mx) in place, every element in parallel
// (the exps are the cost; the sequential sum then only adds).
extern "C" __global__ void llm_xent_exp(float* __restrict__ x, const float* __restrict__ stats,
                                        u64 n, u64 classes) {
    GRID_STRIDE(i, n) x[i] = exp32(__fsub_rn(x[i], stats[3 * (i / classes)]));
}

// Pass 2, one thread per row: s = sum e_j from +0 in index order, stats[3r + 1] = s, loss[r] =
// -((x_t - mx) - ln32(s)).
extern "C" __global__ void llm_xent_sum(const float* __restrict__ e, float* __restrict__ stats,
                                        float* __restrict__ loss, u64 rows, u64 classes) {
    GRID_STRIDE(r, rows) {
        const float* er = e + r * classes;
        float s = 0.0f;
        for (u64 j = 0; j < classes; ++j) s = __fadd_rn(s, er[j]);
        float mx = stats[3 * r], xt = stats[3 * r + 2];
        stats[3 * r + 1] = s;
        loss[r] = -__fsub_rn(__fsub_rn(xt, mx), ln32(s));
    }
}

// Pass 3: x[i] <- c (e / s - [j == target]) in place.
extern "C" __global__ void llm_xent_grad(float* __restrict__ x, const float* __restrict__ targets,
                                         const float* __restrict__ stats, u64 n, u64 classes,
                                         float c) {
    GRID_STRIDE(i, n) {
        u64 r = i / classes, j = i % classes;
        float onehot = j == (u64)targets[r] ? 1.0f : 0.0f;
        x[i] = __fmul_rn(c, __fsub_rn(__fdiv_rn(x[i], stats[3 * r + 1]), onehot));
    }
}
