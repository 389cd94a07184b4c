// The MXFP8 block-scaled GEMM on Hopper's FP8 tensor cores: C[m, n] (+)= A[m, k] · B[n, k]^T
// with A and B rowwise MXFP8 planes (fp8 bytes [outer, k], one E8M0 scale per 32 bytes along k:
// scales [outer, ceil(k / 32)]), f32 accumulation and an f32 C. This is the forward GEMM of
// Transformer Engine's MXFP8 recipe (activations and weights both blocked along k), which
// cuBLASLt runs only on sm_100 (CUBLASLT_MATMUL_MATRIX_SCALE_VEC32_UE8M0).
//
// Arithmetic (lowbit_device::Device::matmul_mx's): every 32-block of the contraction is one
// `mma.sync.m16n8k32` FP8 instruction started from zero, so its partial sum is the block's dot
// product (the fp8 products exact, summed in the tensor core's f32); it is multiplied by
// 2^(ea - 127) · 2^(eb - 127) in one rounding (a power of two: exact unless the result leaves
// f32's normal range) and added to the f32 accumulator, which starts at C with `accumulate`,
// in block order. The CPU reference sums each block exactly in f64 and rounds it once, so the
// two agree to the f32 summation error of the block sums. A tail block (k not a multiple of 32)
// is read with zeros past k. Scale byte 255 (E8M0 NaN) gives NaN.
//
// v0: 64 x 64 tiles, 4 warps of 32 x 32 (2 m16 x 4 n8 fragments), one k32 block a stage
// through padded shared memory. The promotion per block costs 4 FMAs per instruction; the
// wgmma/TMA pipeline (DeepGEMM's per-128 promotion, at 32) is the next version.

#include <cstdint>

#include "include/mx_scale.cuh"

#define MXG_BM 64
#define MXG_BN 64
#define MXG_WORDS 8  // 32 fp8 bytes of a row as u32 words
#define MXG_PAD 9    // shared row stride in words

// The 4 bytes of row `row` at columns kk..kk+3 as one little-endian word, zeros past k or
// past the last row; byte loads where the address is not 4-byte aligned.
__device__ __forceinline__ uint32_t mxg_word(const uint8_t* __restrict__ p, int row, int rows,
                                             int k, int kk) {
  if (row >= rows || kk >= k) return 0u;
  const uint8_t* q = p + (size_t)row * (size_t)k + kk;
  if (kk + 4 <= k && ((uintptr_t)q & 3u) == 0) return __ldg(reinterpret_cast<const uint32_t*>(q));
  uint32_t w = 0;
  for (int i = 0; i < 4 && kk + i < k; ++i) w |= (uint32_t)__ldg(q + i) << (8 * i);
  return w;
}

template <bool A5, bool B5>
__device__ __forceinline__ void mxg_mma(float (&d)[4], const uint32_t (&a)[4],
                                        const uint32_t (&b)[2]) {
#define MXG_MMA(TA, TB)                                                                        \
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32." TA "." TB                              \
               ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%10,%10,%10};\n"              \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(0.0f))
  if constexpr (!A5 && !B5) {
    MXG_MMA("e4m3", "e4m3");
  } else if constexpr (!A5 && B5) {
    MXG_MMA("e4m3", "e5m2");
  } else if constexpr (A5 && !B5) {
    MXG_MMA("e5m2", "e4m3");
  } else {
    MXG_MMA("e5m2", "e5m2");
  }
#undef MXG_MMA
}

template <bool A5, bool B5>
__device__ __forceinline__ void mx_gemm_rr(const uint8_t* __restrict__ A,
                                           const uint8_t* __restrict__ SA,
                                           const uint8_t* __restrict__ B,
                                           const uint8_t* __restrict__ SB, float* __restrict__ C,
                                           int m, int n, int k, int accumulate) {
  __shared__ uint32_t sA[MXG_BM * MXG_PAD];
  __shared__ uint32_t sB[MXG_BN * MXG_PAD];
  __shared__ uint8_t sSA[MXG_BM];
  __shared__ uint8_t sSB[MXG_BN];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * MXG_BM, n0 = blockIdx.x * MXG_BN;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const int blocks = (k + 31) >> 5;

  float acc[2][4][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + wm + mi * 16 + g + (e >> 1) * 8;
        const int c = n0 + wn + ni * 8 + t * 2 + (e & 1);
        acc[mi][ni][e] = (accumulate && r < m && c < n) ? C[(size_t)r * n + c] : 0.0f;
      }

  for (int kb = 0; kb < blocks; ++kb) {
    for (int i = tid; i < MXG_BM * MXG_WORDS; i += blockDim.x) {
      const int r = i >> 3, w = i & 7, kk = kb * 32 + w * 4;
      sA[r * MXG_PAD + w] = mxg_word(A, m0 + r, m, k, kk);
      sB[r * MXG_PAD + w] = mxg_word(B, n0 + r, n, k, kk);
    }
    if (tid < MXG_BM) {
      sSA[tid] = (m0 + tid < m) ? SA[(size_t)(m0 + tid) * blocks + kb] : 127;
    } else if (tid < MXG_BM + MXG_BN) {
      const int r = tid - MXG_BM;
      sSB[r] = (n0 + r < n) ? SB[(size_t)(n0 + r) * blocks + kb] : 127;
    }
    __syncthreads();
    uint32_t af[2][4], bf[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      const int r = wm + mi * 16 + g;
      af[mi][0] = sA[r * MXG_PAD + t];
      af[mi][1] = sA[(r + 8) * MXG_PAD + t];
      af[mi][2] = sA[r * MXG_PAD + 4 + t];
      af[mi][3] = sA[(r + 8) * MXG_PAD + 4 + t];
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      const int c = wn + ni * 8 + g;
      bf[ni][0] = sB[c * MXG_PAD + t];
      bf[ni][1] = sB[c * MXG_PAD + 4 + t];
    }
    uint32_t ea[2][2], eb[4][2];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
      ea[mi][0] = sSA[wm + mi * 16 + g];
      ea[mi][1] = sSA[wm + mi * 16 + g + 8];
    }
#pragma unroll
    for (int ni = 0; ni < 4; ++ni) {
      eb[ni][0] = sSB[wn + ni * 8 + t * 2];
      eb[ni][1] = sSB[wn + ni * 8 + t * 2 + 1];
    }
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni) {
        float d[4];
        mxg_mma<A5, B5>(d, af[mi], bf[ni]);
#pragma unroll
        for (int e = 0; e < 4; ++e)
          acc[mi][ni][e] += mxg_scale(d[e], ea[mi][e >> 1], eb[ni][e & 1]);
      }
    __syncthreads();
  }

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + wm + mi * 16 + g + (e >> 1) * 8;
        const int c = n0 + wn + ni * 8 + t * 2 + (e & 1);
        if (r < m && c < n) C[(size_t)r * n + c] = acc[mi][ni][e];
      }
}

#define MXG_KERNEL(NAME, A5, B5)                                                               \
  extern "C" __global__ void __launch_bounds__(128)                                            \
      NAME(const uint8_t* __restrict__ A, const uint8_t* __restrict__ SA,                      \
           const uint8_t* __restrict__ B, const uint8_t* __restrict__ SB, float* __restrict__ C, \
           int m, int n, int k, int accumulate) {                                              \
    mx_gemm_rr<A5, B5>(A, SA, B, SB, C, m, n, k, accumulate);                                  \
  }

MXG_KERNEL(mx_gemm_rr_e4m3_e4m3, false, false)
MXG_KERNEL(mx_gemm_rr_e4m3_e5m2, false, true)
MXG_KERNEL(mx_gemm_rr_e5m2_e4m3, true, false)
MXG_KERNEL(mx_gemm_rr_e5m2_e5m2, true, true)

// v1: 128 x 128 tiles, 8 warps of 32 x 64 (2 m16 x 8 n8 fragments, 16 mma a block), stages of
// four k32 blocks (128 bytes a row) staged through shared rows padded to 36 words (the 8 rows
// of a fragment load land in distinct banks), the next stage's global loads held in registers
// while the current one is multiplied. Same arithmetic as v0, block for block.
#define MXG1_BM 128
#define MXG1_BN 128
#define MXG1_WORDS 32  // 128 fp8 bytes of a row
#define MXG1_PAD 36
#define MXG1_THREADS 256

// 16 bytes of row `row` at columns kk..kk+15 (zeros past k or the last row).
__device__ __forceinline__ uint4 mxg_quad(const uint8_t* __restrict__ p, int row, int rows,
                                          int k, int kk) {
  if (row < rows && kk + 16 <= k) {
    const uint8_t* q = p + (size_t)row * (size_t)k + kk;
    if (((uintptr_t)q & 15u) == 0) return __ldg(reinterpret_cast<const uint4*>(q));
  }
  return make_uint4(mxg_word(p, row, rows, k, kk), mxg_word(p, row, rows, k, kk + 4),
                    mxg_word(p, row, rows, k, kk + 8), mxg_word(p, row, rows, k, kk + 12));
}

template <bool A5, bool B5>
__device__ __forceinline__ void mx_gemm_rr_v1(const uint8_t* __restrict__ A,
                                              const uint8_t* __restrict__ SA,
                                              const uint8_t* __restrict__ B,
                                              const uint8_t* __restrict__ SB,
                                              float* __restrict__ C, int m, int n, int k,
                                              int accumulate) {
  __shared__ __align__(16) uint32_t sA[MXG1_BM * MXG1_PAD];
  __shared__ __align__(16) uint32_t sB[MXG1_BN * MXG1_PAD];
  __shared__ uint8_t sSA[MXG1_BM * 4];
  __shared__ uint8_t sSB[MXG1_BN * 4];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * MXG1_BM, n0 = blockIdx.x * MXG1_BN;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 64;
  const int blocks = (k + 31) >> 5;
  const int stages = (blocks + 3) >> 2;

  float acc[2][8][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + wm + mi * 16 + g + (e >> 1) * 8;
        const int c = n0 + wn + ni * 8 + t * 2 + (e & 1);
        acc[mi][ni][e] = (accumulate && r < m && c < n) ? C[(size_t)r * n + c] : 0.0f;
      }

  // Each thread moves 4 quads of A and 4 of B a stage: quad q = tid + 256·i, row q / 8,
  // 16-byte column q % 8; and one scale byte of each (row tid / 4... as 128 rows x 4 blocks).
  uint4 ra[4], rb[4];
  uint8_t rsa[2], rsb[2];
  auto load = [&](int s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + MXG1_THREADS * i, r = q >> 3, kk = s * 128 + (q & 7) * 16;
      ra[i] = mxg_quad(A, m0 + r, m, k, kk);
      rb[i] = mxg_quad(B, n0 + r, n, k, kk);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int q = tid + MXG1_THREADS * i, r = q >> 2, b = s * 4 + (q & 3);
      rsa[i] = (m0 + r < m && b < blocks) ? SA[(size_t)(m0 + r) * blocks + b] : 127;
      rsb[i] = (n0 + r < n && b < blocks) ? SB[(size_t)(n0 + r) * blocks + b] : 127;
    }
  };
  auto store = [&]() {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int q = tid + MXG1_THREADS * i, r = q >> 3, w = (q & 7) * 4;
      *reinterpret_cast<uint4*>(&sA[r * MXG1_PAD + w]) = ra[i];
      *reinterpret_cast<uint4*>(&sB[r * MXG1_PAD + w]) = rb[i];
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int q = tid + MXG1_THREADS * i;
      sSA[q] = rsa[i];
      sSB[q] = rsb[i];
    }
  };

  if (stages > 0) load(0);
  for (int s = 0; s < stages; ++s) {
    store();
    __syncthreads();
    if (s + 1 < stages) load(s + 1);
    const int nb = min(4, blocks - s * 4);
    for (int j = 0; j < nb; ++j) {
      uint32_t af[2][4], bf[8][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        const int r = wm + mi * 16 + g;
        af[mi][0] = sA[r * MXG1_PAD + j * 8 + t];
        af[mi][1] = sA[(r + 8) * MXG1_PAD + j * 8 + t];
        af[mi][2] = sA[r * MXG1_PAD + j * 8 + 4 + t];
        af[mi][3] = sA[(r + 8) * MXG1_PAD + j * 8 + 4 + t];
      }
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const int c = wn + ni * 8 + g;
        bf[ni][0] = sB[c * MXG1_PAD + j * 8 + t];
        bf[ni][1] = sB[c * MXG1_PAD + j * 8 + 4 + t];
      }
      uint32_t ea[2][2];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        ea[mi][0] = sSA[(wm + mi * 16 + g) * 4 + j];
        ea[mi][1] = sSA[(wm + mi * 16 + g + 8) * 4 + j];
      }
#pragma unroll
      for (int ni = 0; ni < 8; ++ni) {
        const uint32_t eb0 = sSB[(wn + ni * 8 + t * 2) * 4 + j];
        const uint32_t eb1 = sSB[(wn + ni * 8 + t * 2 + 1) * 4 + j];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          float d[4];
          mxg_mma<A5, B5>(d, af[mi], bf[ni]);
          acc[mi][ni][0] += mxg_scale(d[0], ea[mi][0], eb0);
          acc[mi][ni][1] += mxg_scale(d[1], ea[mi][0], eb1);
          acc[mi][ni][2] += mxg_scale(d[2], ea[mi][1], eb0);
          acc[mi][ni][3] += mxg_scale(d[3], ea[mi][1], eb1);
        }
      }
    }
    __syncthreads();
  }

#pragma unroll
  for (int mi = 0; mi < 2; ++mi)
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = m0 + wm + mi * 16 + g + (e >> 1) * 8;
        const int c = n0 + wn + ni * 8 + t * 2 + (e & 1);
        if (r < m && c < n) C[(size_t)r * n + c] = acc[mi][ni][e];
      }
}

#define MXG1_KERNEL(NAME, A5, B5)                                                              \
  extern "C" __global__ void __launch_bounds__(MXG1_THREADS)                                   \
      NAME(const uint8_t* __restrict__ A, const uint8_t* __restrict__ SA,                      \
           const uint8_t* __restrict__ B, const uint8_t* __restrict__ SB, float* __restrict__ C, \
           int m, int n, int k, int accumulate) {                                              \
    mx_gemm_rr_v1<A5, B5>(A, SA, B, SB, C, m, n, k, accumulate);                               \
  }

MXG1_KERNEL(mx_gemm_rr_v1_e4m3_e4m3, false, false)
MXG1_KERNEL(mx_gemm_rr_v1_e4m3_e5m2, false, true)
MXG1_KERNEL(mx_gemm_rr_v1_e5m2_e4m3, true, false)
MXG1_KERNEL(mx_gemm_rr_v1_e5m2_e5m2, true, true)
