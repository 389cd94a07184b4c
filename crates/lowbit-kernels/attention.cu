// Causal grouped-query attention, exact mode, bit-exact with lowbit-device's CPU backend
// (crates/lowbit-device/src/ops/attention.rs, the oracle; host side
// crates/lowbit-device/src/cuda/kernels/attention.rs).
//
// Layouts: q, out, dout, dq [batch, seq, heads, hd]; k, v, dk, dv [batch, seq, kv_heads, hd];
// lse, D [batch, heads, seq]; query head h reads kv head h / (heads / kv_heads).
//
// Arithmetic: every product and sum through the _rn intrinsics (never contracted into FMA), each
// sum from +0 in the CPU's index order inside one thread; exp and ln in double, rounded to f32.
// One thread owns one output row: the forward and the dQ pass a query row (b, h, i), the dK/dV
// pass a key row (b, g, j); no atomics. The FlashAttention-2 backward's recomputation (Dao 2023,
// Algorithm 2), without its tiled partial sums: the scores are recomputed from lse exactly as the
// forward made them.
//
// A block of ROWS threads takes ROWS consecutive rows of one (b, head); the rows the block reads
// from the other side (keys for the forward and dQ, queries for dK/dV) go through shared memory
// in tiles of TILE rows, loaded coalesced and then read by every thread at the same address
// (a broadcast). A thread's own rows (its query, dout, key or value row and its accumulators)
// live in local arrays of MAX_HD floats. Head sizes up to MAX_HD (the host checks).

#include <stdint.h>

#include "include/lowbit_convert.cuh"

#define MAX_HD 256
#define ROWS 64
#define TILE 16

__device__ __forceinline__ float attn_exp32(float x) { return (float)exp((double)x); }
__device__ __forceinline__ float attn_ln32(float x) { return (float)log((double)x); }

// Σ_d a[d]·b[d] from +0 in index order.
__device__ __forceinline__ float attn_dot(const float* a, const float* b, u64 hd) {
    float s = 0.0f;
    for (u64 d = 0; d < hd; ++d) s = __fadd_rn(s, __fmul_rn(a[d], b[d]));
    return s;
}

// Copies the TILE rows first.. of `hd` floats (row r at src + r·stride) into dst[r·hd + d],
// rows from `limit` on left as they are (never read). Row by row, the threads across a row:
// coalesced loads and no 64-bit division per element.
__device__ __forceinline__ void attn_stage(float* dst, const float* __restrict__ src, u64 first,
                                           u64 limit, u64 stride, u64 hd) {
    for (u64 r = 0; r < TILE && first + r < limit; ++r) {
        const float* row = src + (first + r) * stride;
        for (u64 d = threadIdx.x; d < hd; d += blockDim.x) dst[r * hd + d] = row[d];
    }
}

// Forward. Grid (ceil(seq / ROWS), batch·heads), ROWS threads. Per query row i: pass 1 takes
// m = max_j s_j (`>`: NaN never becomes the maximum), pass 2 recomputes s_j and sums
// e_j = exp(s_j − m) and e_j·v[j, :]; out = acc / l, lse = m + ln l.
extern "C" __global__ void __launch_bounds__(ROWS)
    attention_fwd(const float* __restrict__ q, const float* __restrict__ k,
                  const float* __restrict__ v, float* __restrict__ out, float* __restrict__ lse,
                  u64 seq, u64 heads, u64 kv_heads, u64 hd, float scale) {
    __shared__ float ks[TILE * MAX_HD];
    __shared__ float vs[TILE * MAX_HD];
    const u64 bh = blockIdx.y, b = bh / heads, h = bh % heads, g = h / (heads / kv_heads);
    const u64 i0 = (u64)blockIdx.x * ROWS, i = i0 + threadIdx.x;
    const bool live = i < seq;
    const u64 last = min(seq, i0 + ROWS);  // keys 0..last are read by some row of the block
    const u64 qstride = heads * hd, kstride = kv_heads * hd;
    const float* kb = k + b * seq * kstride + g * hd;
    const float* vb = v + b * seq * kstride + g * hd;
    float qr[MAX_HD], acc[MAX_HD];
    if (live) {
        const float* qp = q + (b * seq + i) * qstride + h * hd;
        for (u64 d = 0; d < hd; ++d) {
            qr[d] = qp[d];
            acc[d] = 0.0f;
        }
    }
    float m = __uint_as_float(0xFF800000u);
    for (u64 t = 0; t < last; t += TILE) {
        __syncthreads();
        attn_stage(ks, kb, t, last, kstride, hd);
        __syncthreads();
        if (live) {
            for (u64 jj = 0; jj < TILE && t + jj <= i; ++jj) {
                float s = __fmul_rn(attn_dot(qr, ks + jj * hd, hd), scale);
                if (s > m) m = s;
            }
        }
    }
    float l = 0.0f;
    for (u64 t = 0; t < last; t += TILE) {
        __syncthreads();
        attn_stage(ks, kb, t, last, kstride, hd);
        attn_stage(vs, vb, t, last, kstride, hd);
        __syncthreads();
        if (live) {
            for (u64 jj = 0; jj < TILE && t + jj <= i; ++jj) {
                float s = __fmul_rn(attn_dot(qr, ks + jj * hd, hd), scale);
                float e = attn_exp32(__fsub_rn(s, m));
                l = __fadd_rn(l, e);
                const float* vr = vs + jj * hd;
                for (u64 d = 0; d < hd; ++d) acc[d] = __fadd_rn(acc[d], __fmul_rn(e, vr[d]));
            }
        }
    }
    if (live) {
        float* op = out + (b * seq + i) * qstride + h * hd;
        for (u64 d = 0; d < hd; ++d) op[d] = __fdiv_rn(acc[d], l);
        lse[bh * seq + i] = __fadd_rn(m, attn_ln32(l));
    }
}

// D[b, h, i] = Σ_d dout[i, d]·out[i, d]: one thread per (b, i, h), n = batch·seq·heads rows.
extern "C" __global__ void attention_bwd_d(const float* __restrict__ out,
                                           const float* __restrict__ dout, float* __restrict__ dd,
                                           u64 n, u64 seq, u64 heads, u64 hd) {
    for (u64 r = (u64)blockIdx.x * blockDim.x + threadIdx.x; r < n;
         r += (u64)gridDim.x * blockDim.x) {
        // r = (b·seq + i)·heads + h: the row of out / dout.
        u64 h = r % heads, bi = r / heads, b = bi / seq, i = bi % seq;
        dd[(b * heads + h) * seq + i] = attn_dot(dout + r * hd, out + r * hd, hd);
    }
}

// The dQ pass. Grid (ceil(seq / ROWS), batch·heads), ROWS threads, one query row each:
// dq[i, :] = Σ_{j ≤ i} ds_ij·k[j, :], with s_ij as the forward, p = exp(s − lse_i),
// dp = dout_i · v_j, ds = (p·(dp − D_i))·scale.
extern "C" __global__ void __launch_bounds__(ROWS)
    attention_bwd_dq(const float* __restrict__ q, const float* __restrict__ k,
                     const float* __restrict__ v, const float* __restrict__ lse,
                     const float* __restrict__ dout, const float* __restrict__ dd,
                     float* __restrict__ dq, u64 seq, u64 heads, u64 kv_heads, u64 hd,
                     float scale) {
    __shared__ float ks[TILE * MAX_HD];
    __shared__ float vs[TILE * MAX_HD];
    const u64 bh = blockIdx.y, b = bh / heads, h = bh % heads, g = h / (heads / kv_heads);
    const u64 i0 = (u64)blockIdx.x * ROWS, i = i0 + threadIdx.x;
    const bool live = i < seq;
    const u64 last = min(seq, i0 + ROWS);
    const u64 qstride = heads * hd, kstride = kv_heads * hd;
    const float* kb = k + b * seq * kstride + g * hd;
    const float* vb = v + b * seq * kstride + g * hd;
    float qr[MAX_HD], dor[MAX_HD], acc[MAX_HD];
    float lse_i = 0.0f, d_i = 0.0f;
    if (live) {
        const u64 o = (b * seq + i) * qstride + h * hd;
        for (u64 d = 0; d < hd; ++d) {
            qr[d] = q[o + d];
            dor[d] = dout[o + d];
            acc[d] = 0.0f;
        }
        lse_i = lse[bh * seq + i];
        d_i = dd[bh * seq + i];
    }
    for (u64 t = 0; t < last; t += TILE) {
        __syncthreads();
        attn_stage(ks, kb, t, last, kstride, hd);
        attn_stage(vs, vb, t, last, kstride, hd);
        __syncthreads();
        if (live) {
            for (u64 jj = 0; jj < TILE && t + jj <= i; ++jj) {
                const float* kr = ks + jj * hd;
                float s = __fmul_rn(attn_dot(qr, kr, hd), scale);
                float p = attn_exp32(__fsub_rn(s, lse_i));
                float dp = attn_dot(dor, vs + jj * hd, hd);
                float ds = __fmul_rn(__fmul_rn(p, __fsub_rn(dp, d_i)), scale);
                for (u64 d = 0; d < hd; ++d) acc[d] = __fadd_rn(acc[d], __fmul_rn(ds, kr[d]));
            }
        }
    }
    if (live) {
        float* o = dq + (b * seq + i) * qstride + h * hd;
        for (u64 d = 0; d < hd; ++d) o[d] = acc[d];
    }
}

// The dK/dV pass. Grid (ceil(seq / ROWS), batch·kv_heads), ROWS threads, one key row j each:
// over the query heads h of kv head g in increasing order, then i = j..seq in increasing order,
// dk[j, :] += ds_ij·q[i, :] and dv[j, :] += p_ij·dout[i, :] (one running sum each, from +0).
// The query rows, their dout rows, lse and D go through shared memory in tiles.
extern "C" __global__ void __launch_bounds__(ROWS)
    attention_bwd_dkv(const float* __restrict__ q, const float* __restrict__ k,
                      const float* __restrict__ v, const float* __restrict__ lse,
                      const float* __restrict__ dout, const float* __restrict__ dd,
                      float* __restrict__ dk, float* __restrict__ dv, u64 seq, u64 heads,
                      u64 kv_heads, u64 hd, float scale) {
    __shared__ float qs[TILE * MAX_HD];
    __shared__ float dos[TILE * MAX_HD];
    __shared__ float ls[TILE], ds_[TILE];
    const u64 bg = blockIdx.y, b = bg / kv_heads, g = bg % kv_heads, rep = heads / kv_heads;
    const u64 j0 = (u64)blockIdx.x * ROWS, j = j0 + threadIdx.x;
    const bool live = j < seq;
    const u64 qstride = heads * hd, kstride = kv_heads * hd;
    float kr[MAX_HD], vr[MAX_HD], ak[MAX_HD], av[MAX_HD];
    if (live) {
        const u64 o = (b * seq + j) * kstride + g * hd;
        for (u64 d = 0; d < hd; ++d) {
            kr[d] = k[o + d];
            vr[d] = v[o + d];
            ak[d] = 0.0f;
            av[d] = 0.0f;
        }
    }
    for (u64 h = g * rep; h < (g + 1) * rep; ++h) {
        const float* qb = q + b * seq * qstride + h * hd;
        const float* dob = dout + b * seq * qstride + h * hd;
        const u64 stats = (b * heads + h) * seq;
        // Query rows i ≥ j0 (the block's first key row); each thread takes those ≥ its j.
        for (u64 t = j0; t < seq; t += TILE) {
            __syncthreads();
            attn_stage(qs, qb, t, seq, qstride, hd);
            attn_stage(dos, dob, t, seq, qstride, hd);
            if (threadIdx.x < TILE && t + threadIdx.x < seq) {
                ls[threadIdx.x] = lse[stats + t + threadIdx.x];
                ds_[threadIdx.x] = dd[stats + t + threadIdx.x];
            }
            __syncthreads();
            if (live) {
                for (u64 ii = 0; ii < TILE && t + ii < seq; ++ii) {
                    if (t + ii < j) continue;
                    const float* qi = qs + ii * hd;
                    const float* doi = dos + ii * hd;
                    float s = __fmul_rn(attn_dot(qi, kr, hd), scale);
                    float p = attn_exp32(__fsub_rn(s, ls[ii]));
                    float dp = attn_dot(doi, vr, hd);
                    float dsv = __fmul_rn(__fmul_rn(p, __fsub_rn(dp, ds_[ii])), scale);
                    for (u64 d = 0; d < hd; ++d) {
                        ak[d] = __fadd_rn(ak[d], __fmul_rn(dsv, qi[d]));
                        av[d] = __fadd_rn(av[d], __fmul_rn(p, doi[d]));
                    }
                }
            }
        }
    }
    if (live) {
        const u64 o = (b * seq + j) * kstride + g * hd;
        for (u64 d = 0; d < hd; ++d) {
            dk[o + d] = ak[d];
            dv[o + d] = av[d];
        }
    }
}
