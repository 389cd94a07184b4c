// The pieces of Hopper's warpgroup MMA (sm_90a `wgmma`) that its users share (`flash_wgmma.cu`,
// `mx_gemm_wgmma.cu`): the shared-memory matrix descriptor of a 128-byte-swizzled tile, the
// fence / commit / wait of the asynchronous groups, and the register fence that keeps the
// compiler's accesses of an accumulator on their side of a wait.
//
// The tile layout both use (PTX ISA, "Shared Memory Matrix Layout", and CUTLASS
// cute/atom/mma_traits_sm90_gmma.hpp): rows of 128 bytes, the 16-byte unit u of row r at unit
// u ^ (r % 8) of its row, 1024-byte-aligned groups of 8 rows (the stride byte offset, SBO). A
// K-major operand steps along k by +32 bytes inside a row: k16 of bf16, k32 of fp8.

#pragma once

#include <stdint.h>

typedef unsigned long long u64;

// A shared memory matrix descriptor with the 128-byte swizzle (PTX ISA, "Matrix Descriptor
// Format"): start address, leading and stride byte offsets, each in 16-byte units.
__device__ __forceinline__ u64 wg_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32) |
           (1ull << 62);
}

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wg_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accesses of accumulator registers across a wgmma wait
// (CUTLASS's warpgroup_fence_operand).
template <int N>
__device__ __forceinline__ void wg_reg_fence(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
