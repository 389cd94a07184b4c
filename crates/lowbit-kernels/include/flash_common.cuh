// The helpers both flash attention sources share (`flash_attention.cu`, mma.sync, and
// `flash_wgmma.cu`, wgmma): the bf16 operand packing, the exponential of the online softmax,
// cp.async copies of 16 bytes and their groups, and the quad reductions over the four lanes that
// hold one accumulator row. Fast-mode arithmetic (cvt and ex2.approx), unlike lowbit_convert.cuh.

#pragma once

#include <stdint.h>

// {lo, hi} as bf16x2 (lo in the low half), each rounded to nearest even.
__device__ __forceinline__ uint32_t flash_pack(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// Elements `at`, `at + 1` of an f32 or (`bf16`) bf16 output: the pair as two f32 or one
// packed word (`at` even, so 4-byte aligned), each value rounded once.
__device__ __forceinline__ void flash_put_pair(void* out, uint32_t bf16, unsigned long long at,
                                               float lo, float hi) {
    if (bf16) {
        reinterpret_cast<uint32_t*>(out)[at / 2] = flash_pack(lo, hi);
    } else {
        float* o = reinterpret_cast<float*>(out) + at;
        o[0] = lo;
        o[1] = hi;
    }
}

// Element pair `at`, `at + 1` (`at` even) of an f32 or (`bf16`) bf16 input, rounded to bf16x2.
__device__ __forceinline__ uint32_t flash_get_pair(const void* x, uint32_t bf16,
                                                   unsigned long long at) {
    if (bf16) return reinterpret_cast<const uint32_t*>(x)[at / 2];
    const float* p = reinterpret_cast<const float*>(x) + at;
    return flash_pack(p[0], p[1]);
}

// 2^x (ex2.approx.ftz: results below the normal range flush to zero, as FlashAttention-3's
// exp2f under --use_fast_math).
__device__ __forceinline__ float flash_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// 16 bytes global → the shared address `dst` without the registers (cp.async, L2 only);
// `valid == false` fills the 16 bytes with zeros (src-size 0) and reads nothing.
__device__ __forceinline__ void flash_cp16(uint32_t dst, const void* src, bool valid) {
    const int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void flash_cp_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void flash_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Max and sum over the four lanes (lane % 4) that share an accumulator row.
__device__ __forceinline__ float flash_quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float flash_quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

