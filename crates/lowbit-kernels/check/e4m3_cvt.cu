// Checks that `e4m3x2_code` (one `cvt.rn.satfinite.e4m3x2.f32`, used for NVFP4 scale bytes by
// nvfp4_quantize_both_v8) equals `e4m3_code` (the integer encoder the other NVFP4 kernels use)
// on every non-NaN f32, in both halves of the pair: all 2^32 bit patterns, NaNs counted apart
// (the scale products are never NaN). Build and run on the GPU machine (or build here with the
// pinned toolchain of `cargo xtask ptx` and carry the binary):
//   nvcc -O3 -arch=sm_90 -o e4m3_cvt crates/lowbit-kernels/check/e4m3_cvt.cu && ./e4m3_cvt
// Prints the mismatch count (0 expected) and exits 1 on any mismatch.
#include "../ops.cu"
#include <cstdio>
#include <cuda_runtime.h>

__global__ void e4m3_cvt_check(unsigned long long* bad, unsigned long long* nans,
                               uint32_t* first) {
    const u64 stride = (u64)gridDim.x * blockDim.x;
    unsigned long long b = 0, n = 0;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (1ull << 32); i += stride) {
        const uint32_t u = (uint32_t)i;
        const float x = __uint_as_float(u);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
            ++n;
            continue;
        }
        const uint32_t want = e4m3_code(x);
        // x as the low half beside 1.0f, then as the high half beside 1.0f.
        const uint32_t lo = e4m3x2_code(x, 1.0f), hi = e4m3x2_code(1.0f, x);
        const uint32_t one = e4m3_code(1.0f);
        if (lo != (want | (one << 8)) || hi != (one | (want << 8))) {
            if (b == 0) atomicCAS(first, 0xFFFFFFFFu, u);
            ++b;
        }
    }
    atomicAdd(bad, b);
    atomicAdd(nans, n);
}

int main() {
    unsigned long long *bad, *nans;
    uint32_t* first;
    cudaMallocManaged(&bad, 8);
    cudaMallocManaged(&nans, 8);
    cudaMallocManaged(&first, 4);
    *bad = 0, *nans = 0, *first = 0xFFFFFFFFu;
    e4m3_cvt_check<<<4096, 256>>>(bad, nans, first);
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
        printf("CUDA error %s\n", cudaGetErrorString(e));
        return 2;
    }
    printf("e4m3x2_code vs e4m3_code: %llu mismatches over %llu non-NaN inputs (%llu NaNs "
           "skipped)%s",
           *bad, (1ull << 32) - *nans, *nans, *bad ? "" : "\n");
    if (*bad) printf("; first 0x%08x\n", *first);
    return *bad ? 1 : 0;
}
