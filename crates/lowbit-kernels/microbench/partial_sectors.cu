// What partial-sector writes cost (crates/lowbit-kernels/NOTES.md, "partial-sector writes"): 256 MB written in
// P-byte pieces, the 32/P pieces of each 32-byte sector stored by different CTAs D launch
// positions apart (D = 0: by consecutive lanes of one store instruction), each thread storing R
// pieces; times against 16-byte contiguous stores of the same bytes. Modes: plain; a
// `prefetch.global.L2` of the sector before the store; a load of the sector's first word before
// the store. Build and run on the GPU machine (nvcc is there):
//   nvcc -O3 -arch=sm_90 -o partial_sectors crates/lowbit-kernels/microbench/partial_sectors.cu && ./partial_sectors
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
typedef unsigned long long u64;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); return 1;} } while (0)
constexpr int R = 16, T = 256;

template <int P, int MODE>
__global__ void k_pieces(uint8_t* __restrict__ out, u64 D, uint32_t* sink) {
    constexpr int J = 32 / P;
    uint32_t acc = 0;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
        const u64 b = (u64)r * gridDim.x + blockIdx.x, t = threadIdx.x;
        u64 s, j;
        if (D == 0) {
            const u64 g = b * T + t;
            s = g / J; j = g % J;
        } else {
            const u64 grp = b / (D * J), within = b % (D * J);
            j = within / D;
            s = (grp * D + within % D) * T + t;
        }
        uint8_t* p = out + 32 * s + P * j;
        if (MODE == 1) asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
        if (MODE == 2) acc += *reinterpret_cast<volatile uint32_t*>(out + 32 * s);
        if (P == 16) *reinterpret_cast<uint4*>(p) = make_uint4(1, 2, 3, (uint32_t)s);
        else if (P == 8) *reinterpret_cast<uint2*>(p) = make_uint2(1, (uint32_t)s);
        else if (P == 4) *reinterpret_cast<uint32_t*>(p) = (uint32_t)s;
        else if (P == 2) *reinterpret_cast<uint16_t*>(p) = (uint16_t)s;
        else *p = (uint8_t)s;
    }
    if (acc == 0xDEADBEEFu) *sink = acc;
}

__global__ void k_full(uint4* __restrict__ out, u64 n16) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x)
        out[i] = make_uint4(1, 2, 3, (uint32_t)i);
}

template <class F>
static float timeit(F f) {
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) f();
    std::vector<float> ts;
    for (int r = 0; r < 11; ++r) { cudaEventRecord(a); f(); cudaEventRecord(b); cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms); }
    std::sort(ts.begin(), ts.end()); return ts[5] * 1000.f;
}

template <int P, int MODE>
static float one(uint8_t* out, u64 S, u64 D, uint32_t* sink) {
    const u64 pieces = S / P;
    const unsigned grid = (unsigned)(pieces / T / R);
    return timeit([&] { k_pieces<P, MODE><<<grid, T>>>(out, D, sink); });
}

int main() {
    const u64 S = 256ull << 20;
    uint8_t* out; CK(cudaMalloc(&out, S));
    uint32_t* sink; CK(cudaMalloc(&sink, 4));
    float full = timeit([&] { k_full<<<132 * 8, 512>>>((uint4*)out, S / 16); });
    printf("contiguous 16-B stores, 256 MB: %.1f us (%.0f GB/s)\n", full, S / full / 1e3);
    const char* modes[] = {"plain", "prefetch.L2 first", "load first"};
    for (u64 D : {0ull, 1ull, 64ull, 2048ull}) {
        for (int m = 0; m < 3; ++m) {
            float t16 = m == 0 ? one<16, 0>(out, S, D, sink) : m == 1 ? one<16, 1>(out, S, D, sink) : one<16, 2>(out, S, D, sink);
            float t8 = m == 0 ? one<8, 0>(out, S, D, sink) : m == 1 ? one<8, 1>(out, S, D, sink) : one<8, 2>(out, S, D, sink);
            float t4 = m == 0 ? one<4, 0>(out, S, D, sink) : m == 1 ? one<4, 1>(out, S, D, sink) : one<4, 2>(out, S, D, sink);
            float t2 = m == 0 ? one<2, 0>(out, S, D, sink) : m == 1 ? one<2, 1>(out, S, D, sink) : one<2, 2>(out, S, D, sink);
            printf("D=%5llu %-18s x contiguous time: P=16 %5.2f  P=8 %5.2f  P=4 %5.2f  P=2 %5.2f\n", D, modes[m],
                   t16 / full, t8 / full, t4 / full, t2 / full);
        }
    }
    CK(cudaGetLastError());
    return 0;
}
