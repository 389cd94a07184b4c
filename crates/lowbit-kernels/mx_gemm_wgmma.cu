// The MXFP8 block-scaled GEMM on Hopper's warpgroup FP8 tensor cores (sm_90a `wgmma`):
// C[m, n] (+)= A[m, k] · B[n, k]^T from two rowwise MXFP8 planes (fp8 bytes [outer, k], one
// E8M0 scale per 32 bytes along k: scales [outer, ceil(k / 32)]), f32 accumulation, f32 C.
// The same arithmetic as `mx_gemm.cu` (whose header defines it): every 32-block of the
// contraction is one `wgmma.mma_async.m64n128k32` from zero, so its partial sum is the block's
// dot product in the tensor core's f32, promoted into the f32 accumulator (which starts at C
// with `accumulate`) with both scales, in block order. An FP8 wgmma consumes exactly one MX
// block (k = 32), hence the promotion after every instruction (DeepGEMM promotes every 128).
//
// Layout of the work: a CTA of two warpgroups computes a 128 x 128 tile of C (warpgroup w the
// rows 64·w..); stages of 128 bytes of k (4 MX blocks: one 128-byte swizzled row per operand
// row, `include/wgmma_common.cuh`) in a ring of MXW_STAGES buffers filled by cp.async
// MXW_STAGES - 1 stages ahead. Each warpgroup alternates two scratch accumulators: block j + 1's
// wgmma runs while block j's product is promoted, and the two warpgroups' promotions interleave
// with each other's tensor-core work.
//
// The promotion: acc = fma(d, 2^(ea-127) · 2^(eb-127), acc), the scale product computed in
// f32. It is `mx_gemm.cu`'s `acc + round(d · 2^(ea+eb-254))` bit for bit when the power of two
// is a normal f32 and d · 2^e is exact: d is 0 or at least 2^-32 (a sum of fp8 products, each a
// multiple of 2^-32, E5M2's smallest square) and below 2^37 (32 · 57344²), so every e in
// [-94, 90] is exact. The loader of a stage's scales checks them against [80, 172] (e in
// [-94, 90] for any pair); a stage with a byte outside (or a NaN scale, 255) is promoted
// through `mxg_scale` instead, the slow exact rule. The scales of a stage are staged as f32
// powers of two in shared memory (bits e << 23: the byte comes back as bits >> 23).
//
// Cost bound (why this is not the FP8 peak): a block's promotion is 2 FP32 instructions per
// accumulator element (the scale product, the FMA) against 64 · 128 · 32 MACs of tensor work,
// so a warpgroup issues 128 instructions per warp per wgmma that the tensor cores finish in
// ~64 cycles; two warpgroups make the FP32 issue the bound, ~1/2 of the FP8 peak (~990 of
// 1979 TFLOP/s on an H200).
//
// Requirements (checked by the host, else `mx_gemm.cu` v1 runs): k % 16 == 0 and A, B 16-byte
// aligned (every row's 16-byte units are whole cp.async copies); M, N tails and a k tail of 16
// bytes read zeros.

#include <stdint.h>

#include "include/flash_common.cuh"
#include "include/mx_scale.cuh"
#include "include/wgmma_common.cuh"

#define MXW_BM 128
#define MXW_BN 128
#define MXW_STAGES 4
#define MXW_THREADS 256
#define MXW_TILE (128 * 128)                       // bytes of one operand tile a stage
#define MXW_SCALES (MXW_STAGES * 2 * MXW_TILE)     // offset of the two scale buffers
#define MXW_SCALE_BUF 4096                         // A [4][128] f32, then B [4][128] f32
#define MXW_LO 80u                                 // fast-path window of the scale bytes
#define MXW_HI 172u

extern __shared__ __align__(1024) uint8_t mxw_smem[];

// The wgmma wrapper (its long operand list) is written by check/gen_wgmma.py.
// d = A·B from zero, m64n128k32: A (64×32) and B (128×32) fp8 (E4M3, or E5M2 where A5 / B5),
// K-major, in shared memory.
template <bool A5, bool B5>
__device__ __forceinline__ void mxw_mma128(float (&d)[64], u64 da, u64 db) {
    if constexpr (!A5 && !B5) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(0));
    } else if constexpr (!A5 && B5) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e5m2 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(0));
    } else if constexpr (A5 && !B5) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(0));
    } else if constexpr (A5 && B5) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k32.f32.e5m2.e5m2 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
            : "l"(da), "l"(db), "r"(0));
    }
}

template <bool A5, bool B5>
__device__ __forceinline__ void mxw_gemm(const uint8_t* __restrict__ A,
                                         const uint8_t* __restrict__ SA,
                                         const uint8_t* __restrict__ B,
                                         const uint8_t* __restrict__ SB, float* __restrict__ C,
                                         int m, int n, int k, int accumulate) {
  const uint32_t raw = (uint32_t)__cvta_generic_to_shared(mxw_smem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  float* const sfl = reinterpret_cast<float*>(mxw_smem + (base - raw) + MXW_SCALES);
  const int tid = threadIdx.x, wg = tid >> 7, wq = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * MXW_BM, n0 = blockIdx.x * MXW_BN;
  const int blocks = (k + 31) >> 5, stages = (k + 127) >> 7;
  // This thread's accumulator rows (of the tile): row and row + 8; columns 8j + 2t + {0, 1}.
  const int row = 64 * wg + 16 * wq + g;

  float acc[64], t0[64], t1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int r = m0 + row + 8 * ((i >> 1) & 1), c = n0 + 8 * (i >> 2) + 2 * t + (i & 1);
    acc[i] = (accumulate && r < m && c < n) ? C[(size_t)r * n + c] : 0.0f;
    t0[i] = 0.0f;
    t1[i] = 0.0f;
  }

  // Tiles: thread tid copies the 16-byte unit tid % 8 of rows tid / 8 + 32·i of both operands.
  const int cu = tid & 7, r0 = tid >> 3;
  const uint32_t sw = (uint32_t)((cu ^ (r0 & 7)) << 4);
  auto load_tiles = [&](int st) {
    const uint32_t a = base + (st % MXW_STAGES) * 2 * MXW_TILE, b = a + MXW_TILE;
    const int kk = st * 128 + cu * 16;
    const bool kin = kk < k;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int r = r0 + 32 * i;
      const bool oka = kin && m0 + r < m, okb = kin && n0 + r < n;
      flash_cp16(a + r * 128 + sw, oka ? A + (size_t)(m0 + r) * k + kk : A, oka);
      flash_cp16(b + r * 128 + sw, okb ? B + (size_t)(n0 + r) * k + kk : B, okb);
    }
  };

  // Scales: threads 0..127 load row m0 + tid of A's, 128..255 row n0 + tid - 128 of B's, the 4
  // blocks of a stage, held in registers for a stage and then stored as f32 powers of two.
  const bool is_a = tid < 128;
  const int srow = tid & 127, souter = is_a ? m : n, sr = (is_a ? m0 : n0) + srow;
  const uint8_t* __restrict__ S = is_a ? SA : SB;
  uint32_t sc[4];
  auto load_scales = [&](int st) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int b = 4 * st + i;
      sc[i] = (sr < souter && b < blocks) ? (uint32_t)__ldg(S + (size_t)sr * blocks + b) : 127u;
    }
  };
  // Stores the held scales in buffer `buf`; whether one is outside the fast window.
  auto store_scales = [&](int buf) -> int {
    float* dst = sfl + buf * (MXW_SCALE_BUF / 4) + (is_a ? 0 : 512) + srow;
    int out = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dst[i * 128] = __uint_as_float(sc[i] << 23);
      out |= (sc[i] < MXW_LO) | (sc[i] > MXW_HI);
    }
    return out;
  };

  auto issue = [&](float(&d)[64], uint32_t a, uint32_t b, int j) {
    wg_fence();
    mxw_mma128<A5, B5>(d, wg_desc(a + j * 32, 16, 1024), wg_desc(b + j * 32, 16, 1024));
    wg_commit();
  };
  auto promote = [&](float(&d)[64], const float* fs, int j) {
    wg_reg_fence(d);
    const float a0 = fs[j * 128 + row], a1 = fs[j * 128 + row + 8];
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const float2 b = *reinterpret_cast<const float2*>(fs + 512 + j * 128 + 8 * jj + 2 * t);
      acc[4 * jj + 0] = fmaf(d[4 * jj + 0], a0 * b.x, acc[4 * jj + 0]);
      acc[4 * jj + 1] = fmaf(d[4 * jj + 1], a0 * b.y, acc[4 * jj + 1]);
      acc[4 * jj + 2] = fmaf(d[4 * jj + 2], a1 * b.x, acc[4 * jj + 2]);
      acc[4 * jj + 3] = fmaf(d[4 * jj + 3], a1 * b.y, acc[4 * jj + 3]);
    }
  };
  auto promote_exact = [&](float(&d)[64], const float* fs, int j) {
    wg_reg_fence(d);
    const uint32_t ea0 = __float_as_uint(fs[j * 128 + row]) >> 23;
    const uint32_t ea1 = __float_as_uint(fs[j * 128 + row + 8]) >> 23;
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const float* fb = fs + 512 + j * 128 + 8 * jj + 2 * t;
      const uint32_t eb0 = __float_as_uint(fb[0]) >> 23, eb1 = __float_as_uint(fb[1]) >> 23;
      acc[4 * jj + 0] += mxg_scale(d[4 * jj + 0], ea0, eb0);
      acc[4 * jj + 1] += mxg_scale(d[4 * jj + 1], ea0, eb1);
      acc[4 * jj + 2] += mxg_scale(d[4 * jj + 2], ea1, eb0);
      acc[4 * jj + 3] += mxg_scale(d[4 * jj + 3], ea1, eb1);
    }
  };

  // The ring: stages 0..MXW_STAGES-2 in flight before the loop, one group each (empty past the
  // end, so the group count stays the stage count).
#pragma unroll
  for (int st = 0; st < MXW_STAGES - 1; ++st) {
    if (st < stages) load_tiles(st);
    flash_cp_commit();
  }
  load_scales(0);
  int mine = store_scales(0);
  if (stages > 1) load_scales(1);

  for (int s = 0; s < stages; ++s) {
    // Stage s's copies are done (MXW_STAGES - 2 younger groups may fly); they were written
    // through the generic proxy and wgmma reads through the async one.
    flash_cp_wait<MXW_STAGES - 2>();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const int slow = __syncthreads_or(mine);
    // Every thread is past stage s - 1 (its wgmmas awaited), so its buffer can be refilled.
    if (s + MXW_STAGES - 1 < stages) load_tiles(s + MXW_STAGES - 1);
    flash_cp_commit();

    const uint32_t a = base + (s % MXW_STAGES) * 2 * MXW_TILE + wg * 64 * 128;
    const uint32_t b = base + (s % MXW_STAGES) * 2 * MXW_TILE + MXW_TILE;
    const float* fs = sfl + (s & 1) * (MXW_SCALE_BUF / 4);
    const int nb = min(4, blocks - 4 * s);
    if (!slow && nb == 4) {
      issue(t0, a, b, 0);
      issue(t1, a, b, 1);
      wg_wait<1>();
      promote(t0, fs, 0);
      issue(t0, a, b, 2);
      wg_wait<1>();
      promote(t1, fs, 1);
      issue(t1, a, b, 3);
      wg_wait<1>();
      promote(t0, fs, 2);
      wg_wait<0>();
      promote(t1, fs, 3);
    } else {
      for (int j = 0; j < nb; ++j) {
        issue(t0, a, b, j);
        wg_wait<0>();
        if (slow) {
          promote_exact(t0, fs, j);
        } else {
          promote(t0, fs, j);
        }
      }
    }
    // The next stage's scales into the other buffer (last read in stage s - 1).
    if (s + 1 < stages) {
      mine = store_scales((s + 1) & 1);
      if (s + 2 < stages) load_scales(s + 2);
    }
  }

#pragma unroll
  for (int i = 0; i < 64; i += 2) {
    const int r = m0 + row + 8 * ((i >> 1) & 1), c = n0 + 8 * (i >> 2) + 2 * t;
    if (r >= m) continue;
    float* p = C + (size_t)r * n + c;
    if (c + 1 < n && ((uintptr_t)p & 7u) == 0) {
      *reinterpret_cast<float2*>(p) = make_float2(acc[i], acc[i + 1]);
    } else {
      if (c < n) p[0] = acc[i];
      if (c + 1 < n) p[1] = acc[i + 1];
    }
  }
}

#define MXW_KERNEL(NAME, A5, B5)                                                               \
  extern "C" __global__ void __launch_bounds__(MXW_THREADS, 1)                                 \
      NAME(const uint8_t* __restrict__ A, const uint8_t* __restrict__ SA,                      \
           const uint8_t* __restrict__ B, const uint8_t* __restrict__ SB, float* __restrict__ C, \
           int m, int n, int k, int accumulate) {                                              \
    mxw_gemm<A5, B5>(A, SA, B, SB, C, m, n, k, accumulate);                                    \
  }

MXW_KERNEL(mx_gemm_wgmma_e4m3_e4m3, false, false)
MXW_KERNEL(mx_gemm_wgmma_e4m3_e5m2, false, true)
MXW_KERNEL(mx_gemm_wgmma_e5m2_e4m3, true, false)
MXW_KERNEL(mx_gemm_wgmma_e5m2_e5m2, true, true)
