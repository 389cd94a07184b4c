// Causal grouped-query flash attention on the tensor cores (fast mode), forward and backward:
// FlashAttention-2 (Dao 2023, "FlashAttention-2", Algorithm 1 forward, Algorithm 2 backward),
// with bf16 operands through `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` and f32
// accumulation. Host side crates/lowbit-device/src/cuda/kernels/flash.rs; the semantics and the
// CPU reference are in crates/lowbit-device/src/ops/flash.rs.
//
// Layouts (the exact op's, crates/lowbit-kernels/attention.cu): q, out, dout, dq [batch, seq,
// heads, D]; k, v, dk, dv [batch, seq, kv_heads, D]; lse, dd [batch, heads, seq]; all f32 in
// global memory, read and written element by element (a view may start at any element: no
// vector access of them assumes alignment; the bf16 copies are the kernels' own, aligned). Query head h reads kv head h / (heads / kv_heads). D is 64 or 128 (one template
// instance each; the host refuses other head sizes).
//
// Tiling (the simple FA2 tiling; csrc/flash_attn/src/kernel_traits.h names the same shapes):
// 4 warps per CTA; blocks of 64 query rows and 64 key rows, each warp owning 16 rows of the
// CTA's own side. The f32 inputs are first rounded to bf16 copies (flash_to_bf16, RNE through
// cvt.rn.bf16x2.f32; a few percent of the time; bf16 inputs are used as they are), and `out` is
// written as f32 or bf16 (`out_bf16`). The kernels stream the bf16 operands global → shared with
// cp.async into double-buffered tiles (the next block's copies run while this one computes);
// rows are padded by 8 bf16 (16 bytes) so that the 8 row addresses of every ldmatrix phase fall
// into distinct 16-byte bank groups (row strides of 144 or 272 bytes: 16·r mod 128). Rows past
// `seq` are copied as zeros (cp.async's zero fill), so masked products never meet NaN garbage.
// Causal query blocks run from the last (the longest) to the first, against the tail wave.
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16", bf16): with g = lane / 4 and
// t = lane % 4, A (16×16, row) holds {a0a1: (g, 2t..2t+1), a2a3: (g+8, 2t..), a4a5: (g, 2t+8..),
// a6a7: (g+8, 2t+8..)}, B (16×8, col) {b0b1: (k 2t..2t+1, n g), b2b3: (k 2t+8.., n g)}, C/D
// (16×8) {c0c1: (g, 2t..2t+1), c2c3: (g+8, 2t..)}. A C fragment pair of two n8 blocks is
// therefore the A fragment of a k16 step (FA2's convert of the P accumulator into an operand,
// csrc/flash_attn/src/utils.h convert_layout_acc_Aregs): P and dS never leave the registers.
// `ldmatrix.x4` gives A fragments from row-major smem and B fragments from smem whose rows are
// the n index ("col" B, e.g. K for Q·Kᵀ); `ldmatrix.x4.trans` gives B fragments from smem
// whose rows are the k index (V for P·V).
//
// Softmax: scores stay raw q·k in f32; the scale is folded into the exponent,
// p = exp2(s·scale·log2 e − m·scale·log2 e) (ex2.approx.ftz), lse = m·scale + ln l per row.
// Masking only on blocks that touch the diagonal or the sequence's end; fully masked key blocks
// are never visited (the loops stop at the diagonal). Every valid query row i sees key 0, so the
// running maximum is finite after the first block.
//
// Backward, deterministic (no atomics, every sum in a fixed order): flash_bwd_d computes
// dd = rowsum(bf16(dO) ∘ bf16(O)); flash_bwd_dq_* runs one CTA per (query block, b, h) over the
// key blocks 0..diagonal in order; flash_bwd_dkv_* one CTA per (key block, b, kv head) over the
// group's query heads in increasing order, then the query blocks from the diagonal on, in
// order. Both recompute P = exp2(s·scale·log2 e − lse·log2 e) and dS = P ∘ (dP − dd) (rounded to
// bf16 as an operand); dQ and dK are multiplied by the scale once at the end.

#include <stdint.h>

#include "include/flash_common.cuh"

typedef unsigned long long u64;

#define FA_WARPS 4
#define FA_THREADS (FA_WARPS * 32)
#define FA_BM 64
#define FA_BN 64
#define FA_LOG2E 1.4426950408889634f


extern __shared__ __align__(16) uint16_t fa_smem[];

__device__ __forceinline__ float fa_lo(uint32_t x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float fa_hi(uint32_t x) { return __uint_as_float(x & 0xFFFF0000u); }

// c += a · b on the tensor cores (16×8×16, bf16 in, f32 accumulate).
__device__ __forceinline__ void fa_mma(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void fa_ldsm(uint32_t r[4], const uint16_t* p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

__device__ __forceinline__ void fa_ldsm_t(uint32_t r[4], const uint16_t* p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(a));
}

// The A fragment (16 rows from `row0`, k16 step `kk`) of a row-major tile with row stride LD:
// lane l addresses row l % 16, columns (l / 16)·8 of the step (matrices rows 0-7 / 8-15 × k
// 0-7 / 8-15 in the order a0a1, a2a3, a4a5, a6a7).
template <int LD>
__device__ __forceinline__ void fa_a_frag(uint32_t r[4], const uint16_t* s, int row0, int kk) {
    const int lane = threadIdx.x & 31;
    fa_ldsm(r, s + (row0 + (lane & 15)) * LD + kk * 16 + (lane >> 4) * 8);
}

// The B fragments of n8 blocks nb and nb+1 at k16 step kk from a tile whose rows are n
// (Q·Kᵀ's K): {r0, r1} for nb, {r2, r3} for nb + 1.
template <int LD>
__device__ __forceinline__ void fa_b_frag(uint32_t r[4], const uint16_t* s, int nb, int kk) {
    const int lane = threadIdx.x & 31;
    fa_ldsm(r, s + (nb * 8 + (lane >> 4) * 8 + (lane & 7)) * LD + kk * 16 + ((lane >> 3) & 1) * 8);
}

// The B fragments of n8 blocks nd and nd+1 at k16 step kk from a tile whose rows are k
// (P·V's V), through the transposing ldmatrix: {r0, r1} for nd, {r2, r3} for nd + 1.
template <int LD>
__device__ __forceinline__ void fa_bt_frag(uint32_t r[4], const uint16_t* s, int kk, int nd) {
    const int lane = threadIdx.x & 31;
    fa_ldsm_t(r, s + (kk * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)) * LD + nd * 8 + (lane >> 4) * 8);
}

// Starts copying rows row0..row0+R of a [seq, ·, D] bf16 tensor (row r at src + r·stride) into a
// tile of row stride D + 8; rows at or past `seq` become zeros (and read nothing). Thread t
// copies unit t % (D/8) of rows t / (D/8) + k·128/(D/8): a fixed column, so the loop is pointer
// increments, and the bounds test only runs on a block that reaches past the sequence (the
// per-unit index arithmetic and 64-bit products of a plain loop kept the integer pipe busiest).
// flash_wgmma.cu's fw_load is the same loop over a swizzled tile; one shared copy loop taking a
// shared address made ptxas spill flash_fwd_hd64 (96 registers, 20 bytes), so each keeps its own.
template <int D, int R>
__device__ __forceinline__ void fa_load(uint16_t* dst, const uint16_t* __restrict__ src, u64 row0,
                                        u64 seq, u64 stride) {
    constexpr int C = D / 8, LD = D + 8, RS = FA_THREADS / C;
    static_assert(FA_THREADS % C == 0 && R % RS == 0, "tile shape");
    const int c = threadIdx.x % C, r0 = threadIdx.x / C;
    uint16_t* d0 = dst + r0 * LD + c * 8;
    const uint16_t* p = src + (row0 + r0) * stride + c * 8;
    const bool full = row0 + R <= seq;
#pragma unroll
    for (int i = 0; i < R / RS; ++i) {
        const bool ok = full || row0 + r0 + i * RS < seq;
        flash_cp16((uint32_t)__cvta_generic_to_shared(d0 + i * RS * LD),
                   ok ? p + (u64)(i * RS) * stride : src, ok);
    }
}

// ---- forward ----

// x (n f32, n a multiple of 4) rounded to bf16 (RNE) into y: the operand copies the kernels
// stream through cp.async. A thread per 4 values.
extern "C" __global__ void __launch_bounds__(256)
    flash_to_bf16(const float* __restrict__ x, uint2* __restrict__ y, u64 n4) {
    const u64 i = (u64)blockIdx.x * 256 + threadIdx.x;
    if (i >= n4) return;
    // Scalar loads: a view may start at any element (no 16-byte alignment to rely on).
    const float* a = x + 4 * i;
    y[i] = make_uint2(flash_pack(a[0], a[1]), flash_pack(a[2], a[3]));
}

// Grid (ceil(seq / (64·MT)), batch·heads), the query blocks from the last (the longest, causal)
// to the first; 128 threads; dynamic smem (64·MT + 4·64) · (D + 8) bf16 (Q, and K, V
// double-buffered: the next block's copies run while this one computes). q, k, v are bf16
// copies. Each warp owns MT m16 tiles of query rows (tile t: rows 64·t + 16·warp ..), so every
// K and V fragment read from shared memory feeds MT products (FA2's 128-row blocks,
// csrc/flash_attn/src/kernel_traits.h: kBlockM 128, 4 warps). A row's arithmetic does not
// depend on MT: it meets the same 64-key blocks in the same order (a block wholly above the
// diagonal for a tile is skipped, which a fully masked block would leave unchanged anyway:
// alpha = 1, p = 0).
template <int D, int MT>
__device__ __forceinline__ void fa_fwd(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                       const uint16_t* __restrict__ v, void* __restrict__ out,
                                       float* __restrict__ lse, u64 seq, u64 heads, u64 kv_heads,
                                       float scale, uint32_t out_bf16) {
    constexpr int LD = D + 8, TILE = FA_BN * LD, BM = FA_BM * MT;
    uint16_t* qs = fa_smem;
    uint16_t* kvs = qs + BM * LD;  // [buffer][K, V]
    const u64 qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const u64 g = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const u64 q0 = qb * BM;
    // The last key block any row of this query block sees (causal, and inside the sequence).
    const u64 last_row = q0 + BM - 1 < seq ? q0 + BM - 1 : seq - 1;
    const u64 kb_end = last_row / FA_BN;
    const uint16_t* kbase = k + (b * seq * kv_heads + g) * D;
    const uint16_t* vbase = v + (b * seq * kv_heads + g) * D;
    fa_load<D, BM>(qs, q + (b * seq * heads + h) * D, q0, seq, heads * D);
    fa_load<D, FA_BN>(kvs, kbase, 0, seq, kv_heads * D);
    fa_load<D, FA_BN>(kvs + TILE, vbase, 0, seq, kv_heads * D);
    flash_cp_commit();
    const float sl2 = scale * FA_LOG2E;
    float o[MT][D / 8][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[t][n][0] = o[t][n][1] = o[t][n][2] = o[t][n][3] = 0.f;
    float m[MT][2], l[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) m[t][0] = m[t][1] = -INFINITY, l[t][0] = l[t][1] = 0.f;
    for (u64 kb = 0; kb <= kb_end; ++kb) {
        if (kb < kb_end) {
            uint16_t* nxt = kvs + ((kb + 1) & 1) * 2 * TILE;
            fa_load<D, FA_BN>(nxt, kbase, (kb + 1) * FA_BN, seq, kv_heads * D);
            fa_load<D, FA_BN>(nxt + TILE, vbase, (kb + 1) * FA_BN, seq, kv_heads * D);
            flash_cp_commit();
            flash_cp_wait<1>();
        } else {
            flash_cp_wait<0>();
        }
        __syncthreads();
        const uint16_t* ks = kvs + (kb & 1) * 2 * TILE;
        const uint16_t* vs = ks + TILE;
        const u64 k0 = kb * FA_BN;
        // Tile t's rows start at r0; it skips key blocks that start past its last row (warp-
        // uniform), and masks those that reach past its first row or the sequence's end.
        bool live[MT], edge[MT];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const u64 r0 = q0 + t * 64 + warp * 16;
            live[t] = k0 <= r0 + 15;
            edge[t] = k0 + FA_BN > r0 || k0 + FA_BN > seq;
        }
        float s[MT][FA_BN / 8][4];
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int n = 0; n < FA_BN / 8; ++n) s[t][n][0] = s[t][n][1] = s[t][n][2] = s[t][n][3] = 0.f;
        // Q's fragments come from shared memory at every block: keeping them in registers
        // (32 more at dim 128) measured slower (212 -> 184 TFLOP/s at 2x4096, dim 128).
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t)
                if (live[t]) fa_a_frag<LD>(a[t], qs, t * 64 + warp * 16, kk);
#pragma unroll
            for (int nb = 0; nb < FA_BN / 8; nb += 2) {
                uint32_t bb[4];
                fa_b_frag<LD>(bb, ks, nb, kk);
#pragma unroll
                for (int t = 0; t < MT; ++t)
                    if (live[t]) {
                        fa_mma(s[t][nb], a[t], bb[0], bb[1]);
                        fa_mma(s[t][nb + 1], a[t], bb[2], bb[3]);
                    }
            }
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            if (!live[t]) continue;
            const u64 ia = q0 + t * 64 + warp * 16 + gr, ib = ia + 8;
            if (edge[t]) {
#pragma unroll
                for (int nb = 0; nb < FA_BN / 8; ++nb)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const u64 j = k0 + nb * 8 + tq * 2 + (c & 1), i = c < 2 ? ia : ib;
                        if (j > i || j >= seq) s[t][nb][c] = -INFINITY;
                    }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float mx = -INFINITY;
#pragma unroll
                for (int nb = 0; nb < FA_BN / 8; ++nb)
                    mx = fmaxf(mx, fmaxf(s[t][nb][2 * r], s[t][nb][2 * r + 1]));
                mx = flash_quad_max(mx);
                const float mn = fmaxf(m[t][r], mx);
                const float ms = mn == -INFINITY ? 0.f : mn * sl2;
                const float alpha = flash_exp2(m[t][r] * sl2 - ms);
                m[t][r] = mn;
                float sum = 0.f;
#pragma unroll
                for (int nb = 0; nb < FA_BN / 8; ++nb) {
                    s[t][nb][2 * r] = flash_exp2(fmaf(s[t][nb][2 * r], sl2, -ms));
                    s[t][nb][2 * r + 1] = flash_exp2(fmaf(s[t][nb][2 * r + 1], sl2, -ms));
                    sum += s[t][nb][2 * r] + s[t][nb][2 * r + 1];
                }
                l[t][r] = l[t][r] * alpha + sum;
#pragma unroll
                for (int n = 0; n < D / 8; ++n) {
                    o[t][n][2 * r] *= alpha;
                    o[t][n][2 * r + 1] *= alpha;
                }
            }
        }
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; ++kk) {
            uint32_t a[MT][4];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                a[t][0] = flash_pack(s[t][2 * kk][0], s[t][2 * kk][1]);
                a[t][1] = flash_pack(s[t][2 * kk][2], s[t][2 * kk][3]);
                a[t][2] = flash_pack(s[t][2 * kk + 1][0], s[t][2 * kk + 1][1]);
                a[t][3] = flash_pack(s[t][2 * kk + 1][2], s[t][2 * kk + 1][3]);
            }
#pragma unroll
            for (int nd = 0; nd < D / 8; nd += 2) {
                uint32_t bb[4];
                fa_bt_frag<LD>(bb, vs, kk, nd);
#pragma unroll
                for (int t = 0; t < MT; ++t)
                    if (live[t]) {
                        fa_mma(o[t][nd], a[t], bb[0], bb[1]);
                        fa_mma(o[t][nd + 1], a[t], bb[2], bb[3]);
                    }
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u64 i = q0 + t * 64 + warp * 16 + gr + 8 * r;
            const float lt = flash_quad_sum(l[t][r]);
            if (i >= seq) continue;
            const float inv = 1.f / lt;
            const u64 at = ((b * seq + i) * heads + h) * D + tq * 2;
#pragma unroll
            for (int n = 0; n < D / 8; ++n)
                flash_put_pair(out, out_bf16, at + n * 8, o[t][n][2 * r] * inv,
                               o[t][n][2 * r + 1] * inv);
            if (tq == 0) lse[(b * heads + h) * seq + i] = m[t][r] * scale + logf(lt);
        }
}

#define FA_FWD(NAME, D, MT)                                                                      \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                     \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, void* __restrict__ out, float* __restrict__ lse,    \
             u64 seq, u64 heads, u64 kv_heads, float scale, uint32_t out_bf16) {                 \
        fa_fwd<D, MT>(q, k, v, out, lse, seq, heads, kv_heads, scale, out_bf16);                           \
    }

// 64-row blocks (one m16 tile per warp) and 128-row blocks (two); the host picks per head size.
FA_FWD(flash_fwd_hd64, 64, 1)
FA_FWD(flash_fwd_hd128, 128, 1)
FA_FWD(flash_fwd_hd64_m2, 64, 2)
FA_FWD(flash_fwd_hd128_m2, 128, 2)

// ---- backward ----

// dd[b, h, i] = Σ_d bf16(dout[b,i,h,d]) · bf16(out[b,i,h,d]) in f32, d in index order. One warp
// per row (b, i, h) in memory order, each lane 2 of every 64 values, then a fixed-shape tree.
// out and dout are f32 or bf16 (their flags), rounded to bf16 alike.
extern "C" __global__ void __launch_bounds__(256)
    flash_bwd_d(const void* __restrict__ out, const void* __restrict__ dout,
                float* __restrict__ dd, u64 rows, u64 seq, u64 heads, u64 hd, uint32_t out_bf16,
                uint32_t dout_bf16) {
    const u64 row = (u64)blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= rows) return;
    float s = 0.f;
    for (u64 d = (u64)lane * 2; d < hd; d += 64) {
        const uint32_t pa = flash_get_pair(out, out_bf16, row * hd + d);
        const uint32_t pc = flash_get_pair(dout, dout_bf16, row * hd + d);
        s = fmaf(fa_lo(pa), fa_lo(pc), s);
        s = fmaf(fa_hi(pa), fa_hi(pc), s);
    }
#pragma unroll
    for (int w = 16; w >= 1; w >>= 1) s += __shfl_xor_sync(0xffffffffu, s, w);
    if (lane == 0) {
        const u64 h = row % heads, bi = row / heads, i = bi % seq, b = bi / seq;
        dd[(b * heads + h) * seq + i] = s;
    }
}

// dQ: grid (ceil(seq / 64), batch·heads), the query blocks from the last to the first; 128
// threads; dynamic smem 6 · 64 · (D + 8) bf16 (Q, dO, and K, V double-buffered).
template <int D>
__device__ __forceinline__ void fa_bwd_dq(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                          const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                          const uint16_t* __restrict__ dout, const float* __restrict__ dd,
                                          float* __restrict__ dq, u64 seq, u64 heads, u64 kv_heads,
                                          float scale) {
    constexpr int LD = D + 8, TILE = FA_BN * LD;
    uint16_t* qs = fa_smem;
    uint16_t* dos = qs + FA_BM * LD;
    uint16_t* kvs = dos + FA_BM * LD;  // [buffer][K, V]
    const u64 qb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const u64 g = h / (heads / kv_heads);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const u64 q0 = qb * FA_BM;
    const uint16_t* kbase = k + (b * seq * kv_heads + g) * D;
    const uint16_t* vbase = v + (b * seq * kv_heads + g) * D;
    fa_load<D, FA_BM>(qs, q + (b * seq * heads + h) * D, q0, seq, heads * D);
    fa_load<D, FA_BM>(dos, dout + (b * seq * heads + h) * D, q0, seq, heads * D);
    fa_load<D, FA_BN>(kvs, kbase, 0, seq, kv_heads * D);
    fa_load<D, FA_BN>(kvs + TILE, vbase, 0, seq, kv_heads * D);
    flash_cp_commit();
    const float sl2 = scale * FA_LOG2E;
    const u64 ia = q0 + warp * 16 + gr, ib = ia + 8;
    const u64 rowbase = (b * heads + h) * seq;
    float lr[2], dr[2];
    lr[0] = ia < seq ? lse[rowbase + ia] * FA_LOG2E : 0.f;
    lr[1] = ib < seq ? lse[rowbase + ib] * FA_LOG2E : 0.f;
    dr[0] = ia < seq ? dd[rowbase + ia] : 0.f;
    dr[1] = ib < seq ? dd[rowbase + ib] : 0.f;
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
    for (u64 kb = 0; kb <= qb; ++kb) {
        if (kb < qb) {
            uint16_t* nxt = kvs + ((kb + 1) & 1) * 2 * TILE;
            fa_load<D, FA_BN>(nxt, kbase, (kb + 1) * FA_BN, seq, kv_heads * D);
            fa_load<D, FA_BN>(nxt + TILE, vbase, (kb + 1) * FA_BN, seq, kv_heads * D);
            flash_cp_commit();
            flash_cp_wait<1>();
        } else {
            flash_cp_wait<0>();
        }
        __syncthreads();
        const uint16_t* ks = kvs + (kb & 1) * 2 * TILE;
        const uint16_t* vs = ks + TILE;
        float s[FA_BN / 8][4], dp[FA_BN / 8][4];
#pragma unroll
        for (int n = 0; n < FA_BN / 8; ++n)
#pragma unroll
            for (int c = 0; c < 4; ++c) s[n][c] = dp[n][c] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            uint32_t a[4], ad[4];
            fa_a_frag<LD>(a, qs, warp * 16, kk);
            fa_a_frag<LD>(ad, dos, warp * 16, kk);
#pragma unroll
            for (int nb = 0; nb < FA_BN / 8; nb += 2) {
                uint32_t bb[4];
                fa_b_frag<LD>(bb, ks, nb, kk);
                fa_mma(s[nb], a, bb[0], bb[1]);
                fa_mma(s[nb + 1], a, bb[2], bb[3]);
                fa_b_frag<LD>(bb, vs, nb, kk);
                fa_mma(dp[nb], ad, bb[0], bb[1]);
                fa_mma(dp[nb + 1], ad, bb[2], bb[3]);
            }
        }
        const u64 k0 = kb * FA_BN;
        const bool edge = kb == qb || k0 + FA_BN > seq;
#pragma unroll
        for (int nb = 0; nb < FA_BN / 8; ++nb)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int r = c >> 1;
                float p = flash_exp2(fmaf(s[nb][c], sl2, -lr[r]));
                if (edge) {
                    const u64 j = k0 + nb * 8 + tq * 2 + (c & 1), i = r == 0 ? ia : ib;
                    if (j > i || j >= seq || i >= seq) p = 0.f;
                }
                s[nb][c] = p * (dp[nb][c] - dr[r]);  // dS (unscaled)
            }
#pragma unroll
        for (int kk = 0; kk < FA_BN / 16; ++kk) {
            uint32_t a[4];
            a[0] = flash_pack(s[2 * kk][0], s[2 * kk][1]);
            a[1] = flash_pack(s[2 * kk][2], s[2 * kk][3]);
            a[2] = flash_pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = flash_pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int nd = 0; nd < D / 8; nd += 2) {
                uint32_t bb[4];
                fa_bt_frag<LD>(bb, ks, kk, nd);
                fa_mma(acc[nd], a, bb[0], bb[1]);
                fa_mma(acc[nd + 1], a, bb[2], bb[3]);
            }
        }
        __syncthreads();  // every warp is done with this buffer before it is refilled
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 i = r == 0 ? ia : ib;
        if (i >= seq) continue;
        float* row = dq + ((b * seq + i) * heads + h) * D + tq * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            row[n * 8] = acc[n][2 * r] * scale;
            row[n * 8 + 1] = acc[n][2 * r + 1] * scale;
        }
    }
}

// dK, dV: grid (ceil(seq / 64), batch·kv_heads), 128 threads, each warp 16 key rows; query
// blocks of BQ rows; dynamic smem (2 · 64 + 4 · BQ) · (D + 8) bf16 + 4 · BQ f32 (K, V, and Q,
// dO, lse, D double-buffered).
template <int D, int BQ>
__device__ __forceinline__ void fa_bwd_dkv(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,
                                           const uint16_t* __restrict__ v, const float* __restrict__ lse,
                                           const uint16_t* __restrict__ dout,
                                           const float* __restrict__ dd, float* __restrict__ dk,
                                           float* __restrict__ dv, u64 seq, u64 heads, u64 kv_heads,
                                           float scale) {
    constexpr int LD = D + 8, QT = BQ * LD;
    uint16_t* ks = fa_smem;
    uint16_t* vs = ks + FA_BN * LD;
    uint16_t* qds = vs + FA_BN * LD;  // [buffer][Q, dO]
    float* lds = reinterpret_cast<float*>(qds + 4 * QT);  // [buffer][lse·log2 e, D]
    const u64 kb = blockIdx.x, bg = blockIdx.y, b = bg / kv_heads, g = bg % kv_heads;
    const u64 group = heads / kv_heads;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gr = lane >> 2, tq = lane & 3;
    const u64 k0 = kb * FA_BN;
    // The (head, query block) steps in order: the group's heads, then the query blocks from
    // the one holding key k0 to the end.
    const u64 first = k0 / BQ, per_head = (seq + BQ - 1) / BQ - first;
    const u64 steps = group * per_head;
    // Starts the copies of step t into buffer t & 1 (the lse and D rows through registers).
    auto issue = [&](u64 t) {
        const u64 h = g * group + t / per_head, i0 = (first + t % per_head) * BQ;
        uint16_t* buf = qds + (t & 1) * 2 * QT;
        fa_load<D, BQ>(buf, q + (b * seq * heads + h) * D, i0, seq, heads * D);
        fa_load<D, BQ>(buf + QT, dout + (b * seq * heads + h) * D, i0, seq, heads * D);
        float* lb = lds + (t & 1) * 2 * BQ;
        const u64 rowbase = (b * heads + h) * seq;
        for (int r = threadIdx.x; r < BQ; r += FA_THREADS) {
            const bool ok = i0 + r < seq;
            lb[r] = ok ? lse[rowbase + i0 + r] * FA_LOG2E : 0.f;
            lb[BQ + r] = ok ? dd[rowbase + i0 + r] : 0.f;
        }
    };
    fa_load<D, FA_BN>(ks, k + (b * seq * kv_heads + g) * D, k0, seq, kv_heads * D);
    fa_load<D, FA_BN>(vs, v + (b * seq * kv_heads + g) * D, k0, seq, kv_heads * D);
    issue(0);
    flash_cp_commit();
    const float sl2 = scale * FA_LOG2E;
    // The two key rows of this thread's fragments.
    const u64 ja = k0 + warp * 16 + gr, jb = ja + 8;
    float dka[D / 8][4], dva[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) dka[n][c] = dva[n][c] = 0.f;
    for (u64 t = 0; t < steps; ++t) {
        {
            if (t + 1 < steps) {
                issue(t + 1);
                flash_cp_commit();
                flash_cp_wait<1>();
            } else {
                flash_cp_wait<0>();
            }
            __syncthreads();
            const u64 i0 = (first + t % per_head) * BQ;
            const uint16_t* qs = qds + (t & 1) * 2 * QT;
            const uint16_t* dos = qs + QT;
            const float* ls = lds + (t & 1) * 2 * BQ;
            const float* ds_ = ls + BQ;
            // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: rows keys (this warp's 16), columns the BQ queries.
            float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
            for (int n = 0; n < BQ / 8; ++n)
#pragma unroll
                for (int c = 0; c < 4; ++c) st[n][c] = dpt[n][c] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                uint32_t a[4], av[4];
                fa_a_frag<LD>(a, ks, warp * 16, kk);
                fa_a_frag<LD>(av, vs, warp * 16, kk);
#pragma unroll
                for (int nb = 0; nb < BQ / 8; nb += 2) {
                    uint32_t bb[4];
                    fa_b_frag<LD>(bb, qs, nb, kk);
                    fa_mma(st[nb], a, bb[0], bb[1]);
                    fa_mma(st[nb + 1], a, bb[2], bb[3]);
                    fa_b_frag<LD>(bb, dos, nb, kk);
                    fa_mma(dpt[nb], av, bb[0], bb[1]);
                    fa_mma(dpt[nb + 1], av, bb[2], bb[3]);
                }
            }
            const bool edge = i0 < k0 + FA_BN || i0 + BQ > seq || k0 + FA_BN > seq;
#pragma unroll
            for (int nb = 0; nb < BQ / 8; ++nb)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int il = nb * 8 + tq * 2 + (c & 1);
                    float p = flash_exp2(fmaf(st[nb][c], sl2, -ls[il]));
                    if (edge) {
                        const u64 i = i0 + il, j = c < 2 ? ja : jb;
                        if (i < j || i >= seq || j >= seq) p = 0.f;
                    }
                    st[nb][c] = p;
                    dpt[nb][c] = p * (dpt[nb][c] - ds_[il]);  // dSᵀ (unscaled)
                }
            // dV += Pᵀ·dO and dK += dSᵀ·Q: k over the BQ queries.
#pragma unroll
            for (int kk = 0; kk < BQ / 16; ++kk) {
                uint32_t ap[4], as[4];
                ap[0] = flash_pack(st[2 * kk][0], st[2 * kk][1]);
                ap[1] = flash_pack(st[2 * kk][2], st[2 * kk][3]);
                ap[2] = flash_pack(st[2 * kk + 1][0], st[2 * kk + 1][1]);
                ap[3] = flash_pack(st[2 * kk + 1][2], st[2 * kk + 1][3]);
                as[0] = flash_pack(dpt[2 * kk][0], dpt[2 * kk][1]);
                as[1] = flash_pack(dpt[2 * kk][2], dpt[2 * kk][3]);
                as[2] = flash_pack(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
                as[3] = flash_pack(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
                for (int nd = 0; nd < D / 8; nd += 2) {
                    uint32_t bb[4];
                    fa_bt_frag<LD>(bb, dos, kk, nd);
                    fa_mma(dva[nd], ap, bb[0], bb[1]);
                    fa_mma(dva[nd + 1], ap, bb[2], bb[3]);
                    fa_bt_frag<LD>(bb, qs, kk, nd);
                    fa_mma(dka[nd], as, bb[0], bb[1]);
                    fa_mma(dka[nd + 1], as, bb[2], bb[3]);
                }
            }
            __syncthreads();  // every warp is done with this buffer before it is refilled
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 j = r == 0 ? ja : jb;
        if (j >= seq) continue;
        const u64 off = ((b * seq + j) * kv_heads + g) * D + tq * 2;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            dk[off + n * 8] = dka[n][2 * r] * scale;
            dk[off + n * 8 + 1] = dka[n][2 * r + 1] * scale;
            dv[off + n * 8] = dva[n][2 * r];
            dv[off + n * 8 + 1] = dva[n][2 * r + 1];
        }
    }
}

#define FA_BWD_DQ(NAME, D, MINB)                                                                 \
    extern "C" __global__ void __launch_bounds__(FA_THREADS, MINB)                               \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, const float* __restrict__ lse,                      \
             const uint16_t* __restrict__ dout, const float* __restrict__ dd,                    \
             float* __restrict__ dq,                                                             \
             u64 seq, u64 heads, u64 kv_heads, float scale) {                                    \
        fa_bwd_dq<D>(q, k, v, lse, dout, dd, dq, seq, heads, kv_heads, scale);                   \
    }

// dim 64 fits 128 registers without spilling: 4 CTAs (16 warps) per SM (fwd+bwd at 8x2048
// 32/8: 138 -> 144 TFLOP/s); dim 128 is held to 2 CTAs by its 104 KiB of shared memory anyway.
FA_BWD_DQ(flash_bwd_dq_hd64, 64, 4)
FA_BWD_DQ(flash_bwd_dq_hd128, 128, 1)

#define FA_BWD_DKV(NAME, D, BQ)                                                                  \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                     \
        NAME(const uint16_t* __restrict__ q, const uint16_t* __restrict__ k,                     \
             const uint16_t* __restrict__ v, const float* __restrict__ lse,                      \
             const uint16_t* __restrict__ dout, const float* __restrict__ dd,                    \
             float* __restrict__ dk,                                                             \
             float* __restrict__ dv, u64 seq, u64 heads, u64 kv_heads, float scale) {            \
        fa_bwd_dkv<D, BQ>(q, k, v, lse, dout, dd, dk, dv, seq, heads, kv_heads, scale);          \
    }

// dim 128 takes 32 query rows per step so that dK, dV (64 + 64 registers) and the 32-column
// Sᵀ, dPᵀ fit the 255 registers without spilling.
FA_BWD_DKV(flash_bwd_dkv_hd64, 64, 64)
FA_BWD_DKV(flash_bwd_dkv_hd128, 128, 32)
