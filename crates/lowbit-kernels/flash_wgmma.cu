// Causal grouped-query flash attention forward on Hopper's warpgroup tensor cores (sm_90a):
// FlashAttention-3's layout of the work (Shah et al. 2024, "FlashAttention-3", §3.1) without its
// producer warp: each warpgroup (4 warps, 128 threads) owns 64 query rows and issues
// `wgmma.mma_async` for S = Q·Kᵀ (A and B from shared memory) and O += P·V (P from registers, V
// from shared memory read N-major), with the online softmax of FlashAttention-2 (Dao 2023,
// Algorithm 1) between them. Same inputs, outputs and arithmetic rules as flash_attention.cu's
// forward (whose header gives the layouts and the softmax): bf16 q, k, v in, out (f32 or bf16)
// and lse out; only the order of the f32 additions inside the tensor cores differs.
//
// Shared tiles use the 128-byte swizzle that wgmma reads (PTX ISA, "Shared Memory Matrix
// Layout", and CUTLASS cute/atom/mma_traits_sm90_gmma.hpp): a tile of R rows × D bf16 is D/64
// column chunks, each R rows of 128 bytes; the 16-byte unit u of row r sits at unit u ^ (r % 8)
// of its row, and each chunk starts 1024-byte aligned. Descriptors: K-major operands (Q for A,
// K for B) step 16 values along k by +32 bytes inside a chunk and by one chunk (R·128 bytes)
// across; stride between 8-row groups (SBO) 1024 bytes. V is B read N-major (transposed):
// a k16 step is 16 key rows (+2048 bytes), the leading offset (LBO) is the chunk stride R·128
// between 64-column chunks of d, SBO 1024 between 8-key groups.
//
// Accumulator fragments (PTX ISA, "Matrix Fragments for wgmma .m64nNk16"): in warp w of the
// warpgroup, lane l (g = l / 4, t = l % 4) holds d[4j + c] = row 16w + g + 8·(c / 2), column
// 8j + 2t + c % 2. The A register fragment of a k16 step is mma.m16n8k16's (a0a1: (g, 2t..),
// a1: (g+8, 2t..), a2: (g, 2t+8..), a3: (g+8, 2t+8..)), so S's fragments of columns 16k..16k+15
// packed to bf16 are P's A operand of step k, as in flash_attention.cu.
//
// The wgmma wrappers (long operand lists) are written by check/gen_wgmma.py.

#include <stdint.h>

#include "include/flash_common.cuh"
#include "include/wgmma_common.cuh"

#define FW_LOG2E 1.4426950408889634f

extern __shared__ __align__(1024) uint8_t fw_smem[];

// Starts copying rows row0..row0+R of a [seq, ·, D] bf16 tensor (row r at src + r·stride) into
// the swizzled tile at shared address `dst`; rows at or past `seq` become zeros. Thread t copies
// the 16-byte unit t % (D/8) of rows t / (D/8) + k·NT/(D/8): its column and swizzle are fixed
// (NT/(D/8) is a multiple of 8), so the loop is pointer increments and the bounds test only
// runs on a block that reaches past the sequence.
template <int D, int R, int NT>
__device__ __forceinline__ void fw_load(uint32_t dst, const uint16_t* __restrict__ src, u64 row0,
                                        u64 seq, u64 stride) {
    constexpr int C = D / 8, RS = NT / C;
    static_assert(NT % C == 0 && RS % 8 == 0 && R % RS == 0, "tile shape");
    const int c = threadIdx.x % C, r0 = threadIdx.x / C;
    const uint32_t at0 = dst + (c >> 3) * (R * 128) + r0 * 128 + (((c & 7) ^ (r0 & 7)) << 4);
    const uint16_t* p = src + (row0 + r0) * stride + c * 8;
    const bool full = row0 + R <= seq;
#pragma unroll
    for (int i = 0; i < R / RS; ++i) {
        const bool ok = full || row0 + r0 + i * RS < seq;
        flash_cp16(at0 + i * RS * 128, ok ? p + (u64)(i * RS) * stride : src, ok);
    }
}

// d (+)= A·B, m64n128k16: A (64×16, K-major) and B (128×16, K-major) in shared memory.
__device__ __forceinline__ void fw_mma_ss128(float (&d)[64], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc));
}

// d (+)= A·B, m64n64k16: A (64×16, K-major) and B (64×16, K-major) in shared memory.
__device__ __forceinline__ void fw_mma_ss64(float (&d)[32], u64 da, u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
}

// d (+)= A·B, m64n64k16: A (64×16) in registers, B (16×64, N-major: transposed) in shared
// memory.
__device__ __forceinline__ void fw_mma_rs64(float (&d)[32], const uint32_t (&a)[4], u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}

// d (+)= A·B, m64n128k16: A (64×16) in registers, B (16×128, N-major: transposed) in shared
// memory.
__device__ __forceinline__ void fw_mma_rs128(float (&d)[64], const uint32_t (&a)[4], u64 db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(acc));
}


// S (+)= A·B over k = D from two K-major tiles, for the n = BN of the accumulator's size.
__device__ __forceinline__ void fw_ss(float (&d)[64], u64 da, u64 db, int acc) {
    fw_mma_ss128(d, da, db, acc);
}
__device__ __forceinline__ void fw_ss(float (&d)[32], u64 da, u64 db, int acc) {
    fw_mma_ss64(d, da, db, acc);
}

// O += P·V for a warpgroup's 64 rows: the n = D product of the head size.
__device__ __forceinline__ void fw_pv(float (&o)[32], const uint32_t (&a)[4], u64 db) {
    fw_mma_rs64(o, a, db, 1);
}
__device__ __forceinline__ void fw_pv(float (&o)[64], const uint32_t (&a)[4], u64 db) {
    fw_mma_rs128(o, a, db, 1);
}

// d (N = 2·NH columns) = rows 64·w.. of the R-row tile `a` times the N-row tile `b`ᵀ, k = D
// (both K-major swizzled tiles); issued and committed, not awaited.
template <int D, int R, int N, int NH>
__device__ __forceinline__ void fw_gemm_nt(float (&d)[NH], uint32_t a, int w, uint32_t b) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        const uint32_t kofs = (kk & 3) * 32;
        const u64 da = wg_desc(a + (kk >> 2) * (R * 128) + w * 64 * 128 + kofs, 16, 1024);
        const u64 db = wg_desc(b + (kk >> 2) * (N * 128) + kofs, 16, 1024);
        fw_ss(d, da, db, kk > 0);
    }
}

// acc += P·T for P (64 × K) in registers as bf16 pairs of an accumulator's layout and T the
// K-row tile at `t` read N-major (n = D); issued and committed, not awaited.
template <int K, int DH>
__device__ __forceinline__ void fw_gemm_pt(float (&acc)[DH], const float* p, uint32_t t) {
    uint32_t pa[K / 16][4];
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        pa[kk][0] = flash_pack(p[8 * kk + 0], p[8 * kk + 1]);
        pa[kk][1] = flash_pack(p[8 * kk + 2], p[8 * kk + 3]);
        pa[kk][2] = flash_pack(p[8 * kk + 4], p[8 * kk + 5]);
        pa[kk][3] = flash_pack(p[8 * kk + 6], p[8 * kk + 7]);
    }
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) fw_pv(acc, pa[kk], wg_desc(t + kk * 2048, K * 128, 1024));
}

// Ends a stage of the double-buffered cp.async pipeline: with `more`, the next tile's copies
// (just issued) form their own group and the stage's tiles (the group before) are awaited;
// without, everything in flight is. The tiles were written through the generic proxy and wgmma
// reads through the async one, hence the proxy fence before the CTA barrier.
__device__ __forceinline__ void fw_stage_ready(bool more) {
    if (more) {
        flash_cp_commit();
        flash_cp_wait<1>();
    } else {
        flash_cp_wait<0>();
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncthreads();
}

// Grid (ceil(seq / (64·NWG)), batch·heads), the query blocks from the last (the longest, causal)
// to the first; NWG warpgroups, warpgroup w owning query rows 64·w.. of the block; key blocks of
// BN rows; dynamic smem 1024 (alignment) + (64·NWG + 4·BN)·D·2 bytes: Q, and K, V double-buffered (the next block's
// copies run while this one computes). A warpgroup skips key blocks that start past its last
// row and masks those that reach past its first row or the sequence's end.
template <int D, int NWG, int BN>
__device__ __forceinline__ void fw_fwd(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                       const uint16_t* __restrict__ v, void* __restrict__ out,
                                       float* __restrict__ lse, u64 seq, u64 heads, u64 kv_heads,
                                       float scale, uint32_t out_bf16) {
    constexpr int NT = NWG * 128, BM = NWG * 64;
    constexpr uint32_t QB = BM * D * 2, KB = BN * D * 2;
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(fw_smem) + 1023u) & ~1023u;
    const uint32_t qs = base, kv0 = base + QB;  // stage t: K at kv0 + 2·KB·t, V KB after it
    const u64 qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const u64 g = h / (heads / kv_heads);
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const u64 q0 = qb * BM;
    const u64 last_row = q0 + BM - 1 < seq ? q0 + BM - 1 : seq - 1;
    const u64 kb_end = last_row / BN;
    const uint16_t* kbase = k + (b * seq * kv_heads + g) * D;
    const uint16_t* vbase = v + (b * seq * kv_heads + g) * D;
    fw_load<D, BM, NT>(qs, q + (b * seq * heads + h) * D, q0, seq, heads * D);
    fw_load<D, BN, NT>(kv0, kbase, 0, seq, kv_heads * D);
    fw_load<D, BN, NT>(kv0 + KB, vbase, 0, seq, kv_heads * D);
    flash_cp_commit();
    const float sl2 = scale * FW_LOG2E;
    const u64 r0 = q0 + wg * 64;  // this warpgroup's first row
    const u64 ia = r0 + warp * 16 + gr, ib = ia + 8;
    float o[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    for (u64 kb = 0; kb <= kb_end; ++kb) {
        if (kb < kb_end) {
            const uint32_t nxt = kv0 + ((kb + 1) & 1) * 2 * KB;
            fw_load<D, BN, NT>(nxt, kbase, (kb + 1) * BN, seq, kv_heads * D);
            fw_load<D, BN, NT>(nxt + KB, vbase, (kb + 1) * BN, seq, kv_heads * D);
        }
        fw_stage_ready(kb < kb_end);
        const uint32_t ks = kv0 + (kb & 1) * 2 * KB, vs = ks + KB;
        const u64 k0 = kb * BN;
        if (k0 <= r0 + 63 && r0 < seq) {  // warpgroup-uniform
            float s[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s[i] = 0.f;
            wg_fence();
            fw_gemm_nt<D, BM, BN>(s, qs, wg, ks);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(s);
            if (k0 + BN > r0 || k0 + BN > seq) {
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const u64 j = k0 + jj * 8 + tq * 2 + (c & 1), i = c < 2 ? ia : ib;
                        if (j > i || j >= seq) s[4 * jj + c] = -INFINITY;
                    }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj)
                    mx = fmaxf(mx, fmaxf(s[4 * jj + 2 * r], s[4 * jj + 2 * r + 1]));
                mx = flash_quad_max(mx);
                const float mn = fmaxf(m[r], mx);
                const float ms = mn == -INFINITY ? 0.f : mn * sl2;
                const float alpha = flash_exp2(m[r] * sl2 - ms);
                m[r] = mn;
                float sum = 0.f;
#pragma unroll
                for (int jj = 0; jj < BN / 8; ++jj) {
                    s[4 * jj + 2 * r] = flash_exp2(fmaf(s[4 * jj + 2 * r], sl2, -ms));
                    s[4 * jj + 2 * r + 1] = flash_exp2(fmaf(s[4 * jj + 2 * r + 1], sl2, -ms));
                    sum += s[4 * jj + 2 * r] + s[4 * jj + 2 * r + 1];
                }
                l[r] = l[r] * alpha + sum;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[4 * n + 2 * r] *= alpha;
                    o[4 * n + 2 * r + 1] *= alpha;
                }
            }
            fw_gemm_pt<BN>(o, s, vs);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(o);
        }
        __syncthreads();  // every warpgroup is done with this buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 i = r ? ib : ia;
        const float lt = flash_quad_sum(l[r]);
        if (i >= seq) continue;
        const float inv = 1.f / lt;
        const u64 at = ((b * seq + i) * heads + h) * D + tq * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
            flash_put_pair(out, out_bf16, at + n * 8, o[4 * n + 2 * r] * inv,
                           o[4 * n + 2 * r + 1] * inv);
        if (tq == 0) lse[(b * heads + h) * seq + i] = m[r] * scale + logf(lt);
    }
}

#define FW_FWD(NAME, D, NWG, BN, MINB)                                                          \
    extern "C" __global__ void __launch_bounds__(NWG * 128, MINB)                                \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, void* __restrict__ out, float* __restrict__ lse,    \
             u64 seq, u64 heads, u64 kv_heads, float scale, uint32_t out_bf16) {                 \
        fw_fwd<D, NWG, BN>(q, k, v, out, lse, seq, heads, kv_heads, scale, out_bf16);                      \
    }

// Measured on one H200 (NOTES.md): at dim 64 one warpgroup per CTA and three CTAs per SM (the
// CTAs drift apart, so one's softmax overlaps another's products); at dim 128 two warpgroups
// sharing each K, V tile.
FW_FWD(flash_fwd_wg_hd64, 64, 1, 128, 3)
FW_FWD(flash_fwd_wg_hd128, 128, 2, 128, 1)

// ---- backward: the dQ and dK/dV passes of flash_attention.cu's deterministic backward (no
// atomics, every sum in a fixed order; the same recomputation of P from lse and
// dS = P ∘ (dP − D), dS rounded to bf16 as an operand), on wgmma; its D pass stays there.

// dQ: grid (ceil(seq / (64·NWG)), batch·heads), the query blocks from the last to the first;
// NWG warpgroups of 64 query rows; key blocks of BN rows up to the diagonal. Dynamic smem 1024
// + (2·64·NWG + 4·BN)·D·2 bytes (Q, dO, and K, V double-buffered).
template <int D, int NWG, int BN>
__device__ __forceinline__ void fw_bwd_dq(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                          const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                          const uint16_t* __restrict__ dout, const float* __restrict__ dd,
                                          float* __restrict__ dq, u64 seq, u64 heads, u64 kv_heads,
                                          float scale) {
    constexpr int NT = NWG * 128, BM = NWG * 64;
    constexpr uint32_t QB = BM * D * 2, KB = BN * D * 2;
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(fw_smem) + 1023u) & ~1023u;
    const uint32_t qs = base, dos = base + QB, kv0 = dos + QB;  // stage t: K, V at kv0 + 2·KB·t
    const u64 qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const u64 g = h / (heads / kv_heads);
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const u64 q0 = qb * BM;
    const u64 last_row = q0 + BM - 1 < seq ? q0 + BM - 1 : seq - 1;
    const u64 kb_end = last_row / BN;
    const uint16_t* kbase = k + (b * seq * kv_heads + g) * D;
    const uint16_t* vbase = v + (b * seq * kv_heads + g) * D;
    const u64 kvs = kv_heads * D;
    fw_load<D, BM, NT>(qs, q + (b * seq * heads + h) * D, q0, seq, heads * D);
    fw_load<D, BM, NT>(dos, dout + (b * seq * heads + h) * D, q0, seq, heads * D);
    fw_load<D, BN, NT>(kv0, kbase, 0, seq, kvs);
    fw_load<D, BN, NT>(kv0 + KB, vbase, 0, seq, kvs);
    flash_cp_commit();
    const float sl2 = scale * FW_LOG2E;
    const u64 r0 = q0 + wg * 64;
    const u64 ia = r0 + warp * 16 + gr, ib = ia + 8;
    const u64 rowbase = (b * heads + h) * seq;
    float lr[2], dr[2];
    lr[0] = ia < seq ? lse[rowbase + ia] * FW_LOG2E : 0.f;
    lr[1] = ib < seq ? lse[rowbase + ib] * FW_LOG2E : 0.f;
    dr[0] = ia < seq ? dd[rowbase + ia] : 0.f;
    dr[1] = ib < seq ? dd[rowbase + ib] : 0.f;
    float acc[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.f;
    for (u64 kb = 0; kb <= kb_end; ++kb) {
        if (kb < kb_end) {
            const uint32_t nxt = kv0 + ((kb + 1) & 1) * 2 * KB;
            fw_load<D, BN, NT>(nxt, kbase, (kb + 1) * BN, seq, kvs);
            fw_load<D, BN, NT>(nxt + KB, vbase, (kb + 1) * BN, seq, kvs);
        }
        fw_stage_ready(kb < kb_end);
        const uint32_t ks = kv0 + (kb & 1) * 2 * KB, vs = ks + KB;
        const u64 k0 = kb * BN;
        if (k0 <= r0 + 63 && r0 < seq) {  // warpgroup-uniform
            float s[BN / 2], dp[BN / 2];
#pragma unroll
            for (int i = 0; i < BN / 2; ++i) s[i] = dp[i] = 0.f;
            wg_fence();
            fw_gemm_nt<D, BM, BN>(s, qs, wg, ks);
            fw_gemm_nt<D, BM, BN>(dp, dos, wg, vs);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(s);
            wg_reg_fence(dp);
            const bool edge = k0 + BN > r0 || k0 + BN > seq;
#pragma unroll
            for (int jj = 0; jj < BN / 8; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int r = c >> 1;
                    float p = flash_exp2(fmaf(s[4 * jj + c], sl2, -lr[r]));
                    if (edge) {
                        const u64 j = k0 + jj * 8 + tq * 2 + (c & 1), i = r == 0 ? ia : ib;
                        if (j > i || j >= seq || i >= seq) p = 0.f;
                    }
                    s[4 * jj + c] = p * (dp[4 * jj + c] - dr[r]);  // dS (unscaled)
                }
            fw_gemm_pt<BN>(acc, s, ks);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(acc);
        }
        __syncthreads();  // every warpgroup is done with this buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 i = r == 0 ? ia : ib;
        if (i >= seq) continue;
        float* row = dq + ((b * seq + i) * heads + h) * D + tq * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            row[n * 8] = acc[4 * n + 2 * r] * scale;
            row[n * 8 + 1] = acc[4 * n + 2 * r + 1] * scale;
        }
    }
}

// dK, dV: grid (ceil(seq / (64·NWG)), batch·kv_heads); NWG warpgroups of 64 key rows; steps of
// BQ query rows: the group's heads in order, each from the query block holding key k0 to the
// end. Dynamic smem 1024 + (2·64·NWG + 4·BQ)·D·2 + 16·BQ bytes (K, V, and Q, dO, lse, D
// double-buffered).
template <int D, int NWG, int BQ>
__device__ __forceinline__ void fw_bwd_dkv(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                           const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                           const uint16_t* __restrict__ dout,
                                           const float* __restrict__ dd, float* __restrict__ dk,
                                           float* __restrict__ dv, u64 seq, u64 heads, u64 kv_heads,
                                           float scale) {
    constexpr int NT = NWG * 128, BK = NWG * 64;
    constexpr uint32_t KT = BK * D * 2, QT = BQ * D * 2;
    const uint32_t base = ((uint32_t)__cvta_generic_to_shared(fw_smem) + 1023u) & ~1023u;
    const uint32_t ks = base, vs = base + KT, qd0 = vs + KT;  // stage t: Q, dO at qd0 + 2·QT·t
    float* lds = reinterpret_cast<float*>(fw_smem + (qd0 + 4 * QT - (uint32_t)__cvta_generic_to_shared(fw_smem)));
    const u64 kb = blockIdx.x, bg = blockIdx.y, b = bg / kv_heads, g = bg % kv_heads;
    const u64 group = heads / kv_heads;
    const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const u64 k0 = kb * BK, kw = k0 + wg * 64;  // the block's and this warpgroup's first key
    const u64 first = k0 / BQ, per_head = (seq + BQ - 1) / BQ - first;
    const u64 steps = group * per_head;
    auto issue = [&](u64 t) {
        const u64 h = g * group + t / per_head, i0 = (first + t % per_head) * BQ;
        const uint32_t buf = qd0 + (t & 1) * 2 * QT;
        fw_load<D, BQ, NT>(buf, q + (b * seq * heads + h) * D, i0, seq, heads * D);
        fw_load<D, BQ, NT>(buf + QT, dout + (b * seq * heads + h) * D, i0, seq, heads * D);
        float* lb = lds + (t & 1) * 2 * BQ;
        const u64 rowbase = (b * heads + h) * seq;
        for (int r = threadIdx.x; r < BQ; r += NT) {
            const bool ok = i0 + r < seq;
            lb[r] = ok ? lse[rowbase + i0 + r] * FW_LOG2E : 0.f;
            lb[BQ + r] = ok ? dd[rowbase + i0 + r] : 0.f;
        }
    };
    fw_load<D, BK, NT>(ks, k + (b * seq * kv_heads + g) * D, k0, seq, kv_heads * D);
    fw_load<D, BK, NT>(vs, v + (b * seq * kv_heads + g) * D, k0, seq, kv_heads * D);
    issue(0);
    flash_cp_commit();
    const float sl2 = scale * FW_LOG2E;
    const u64 ja = kw + warp * 16 + gr, jb = ja + 8;
    float dka[D / 2], dva[D / 2];
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dka[i] = dva[i] = 0.f;
    for (u64 t = 0; t < steps; ++t) {
        if (t + 1 < steps) issue(t + 1);
        fw_stage_ready(t + 1 < steps);
        const u64 i0 = (first + t % per_head) * BQ;
        const uint32_t qs = qd0 + (t & 1) * 2 * QT, dos = qs + QT;
        const float* ls = lds + (t & 1) * 2 * BQ;
        const float* ds_ = ls + BQ;
        // A block wholly above the diagonal for this warpgroup's keys (every i < j) adds zeros.
        if (i0 + BQ > kw && kw < seq) {  // warpgroup-uniform
            float st[BQ / 2], dpt[BQ / 2];
#pragma unroll
            for (int i = 0; i < BQ / 2; ++i) st[i] = dpt[i] = 0.f;
            wg_fence();
            fw_gemm_nt<D, BK, BQ>(st, ks, wg, qs);
            fw_gemm_nt<D, BK, BQ>(dpt, vs, wg, dos);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(st);
            wg_reg_fence(dpt);
            const bool edge = i0 < kw + 64 || i0 + BQ > seq || kw + 64 > seq;
#pragma unroll
            for (int jj = 0; jj < BQ / 8; ++jj)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int il = jj * 8 + tq * 2 + (c & 1);
                    float p = flash_exp2(fmaf(st[4 * jj + c], sl2, -ls[il]));
                    if (edge) {
                        const u64 i = i0 + il, j = c < 2 ? ja : jb;
                        if (i < j || i >= seq || j >= seq) p = 0.f;
                    }
                    st[4 * jj + c] = p;
                    dpt[4 * jj + c] = p * (dpt[4 * jj + c] - ds_[il]);  // dSᵀ (unscaled)
                }
            fw_gemm_pt<BQ>(dva, st, dos);
            fw_gemm_pt<BQ>(dka, dpt, qs);
            wg_commit();
            wg_wait<0>();
            wg_reg_fence(dva);
            wg_reg_fence(dka);
        }
        __syncthreads();  // every warpgroup is done with this buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 j = r == 0 ? ja : jb;
        if (j >= seq) continue;
        const u64 off = ((b * seq + j) * kv_heads + g) * D + tq * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dk[off + n * 8] = dka[4 * n + 2 * r] * scale;
            dk[off + n * 8 + 1] = dka[4 * n + 2 * r + 1] * scale;
            dv[off + n * 8] = dva[4 * n + 2 * r];
            dv[off + n * 8 + 1] = dva[4 * n + 2 * r + 1];
        }
    }
}

#define FW_BWD_DQ(NAME, D, NWG, BN, MINB)                                                        \
    extern "C" __global__ void __launch_bounds__(NWG * 128, MINB)                                \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, const float* __restrict__ lse,                      \
             const uint16_t* __restrict__ dout, const float* __restrict__ dd,                    \
             float* __restrict__ dq, u64 seq, u64 heads, u64 kv_heads, float scale) {            \
        fw_bwd_dq<D, NWG, BN>(q, k, v, lse, dout, dd, dq, seq, heads, kv_heads, scale);          \
    }
#define FW_BWD_DKV(NAME, D, NWG, BQ, MINB)                                                       \
    extern "C" __global__ void __launch_bounds__(NWG * 128, MINB)                                \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, const float* __restrict__ lse,                      \
             const uint16_t* __restrict__ dout, const float* __restrict__ dd,                    \
             float* __restrict__ dk, float* __restrict__ dv, u64 seq, u64 heads, u64 kv_heads,   \
             float scale) {                                                                      \
        fw_bwd_dkv<D, NWG, BQ>(q, k, v, lse, dout, dd, dk, dv, seq, heads, kv_heads, scale);     \
    }

// One warpgroup per CTA: dQ with key blocks of 64 at dim 128 (at dim 64 flash_attention.cu's
// mma.sync dQ at four CTAs per SM measured faster, NOTES.md); dK/dV with query steps of 64, two
// CTAs per SM (dim 128: 255 registers, a few bytes spilled).
FW_BWD_DQ(flash_bwd_dq_wg_hd128, 128, 1, 64, 2)
FW_BWD_DKV(flash_bwd_dkv_wg_hd64, 64, 1, 64, 2)
FW_BWD_DKV(flash_bwd_dkv_wg_hd128, 128, 1, 64, 2)
