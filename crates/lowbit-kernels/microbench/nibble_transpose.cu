// The 4-bit transpose of the 2D NVFP4 completion (rowwise codes [rows][cols/2] -> columnwise
// codes [cols][rows/2]) alone, in variants, against a copy of the same bytes and a classic f32
// transpose (crates/lowbit-kernels/NOTES.md, "the 2D NVFP4 completion at 0.9x": the codes
// transpose alone runs at a copy's speed; t0 is the backend's codes kernel, the others variants of it, checked byte for byte
// against it). `./nibble_transpose ncu` runs one shape once, for a profiler. Build on the GPU
// machine, from the repository root:
//   nvcc -O3 -arch=sm_90 -o nibble_transpose crates/lowbit-kernels/microbench/nibble_transpose.cu
#include "../nvfp4.cu"  // nibble_transpose_8x8, Finish2dSameParams, nvfp4x_finish_2d_same
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <cuda_runtime.h>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

__global__ void k_copy(const uint4* __restrict__ s, uint4* __restrict__ d, u64 n16) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += (u64)gridDim.x * blockDim.x)
        d[i] = __ldcs(s + i);
}

// 16-byte loads: tile TR rows x TC columns, thread = 8 rows x 32 columns (8 LDG.128), the
// transposed words into a column-major shared tile (STS.32, word index swizzled), then each
// column's TR/2 bytes as 16-byte stores. NT threads = (TR / 8) * (TC / 32).
template <int TR, int TC, bool LOAD, bool STORE>
__global__ void __launch_bounds__((TR / 8) * (TC / 32)) k_t1(const uint8_t* __restrict__ src,
                                                             uint8_t* __restrict__ dst, u64 rows, u64 cols) {
    constexpr int KC = TC / 32;       // 16-byte chunks per tile row
    constexpr int CW = TR / 8;        // words per tile column
    constexpr int NT = (TR / 8) * KC;
    extern __shared__ uint32_t sm[];  // [TC][CW]
    const u64 mat = (u64)blockIdx.z * (rows * cols / 2);
    const uint8_t* rowwise = src + mat;
    uint8_t* col_data = dst + mat;
    const u64 rbytes = cols / 2, rb = rows / 2;
    const u64 r0 = (u64)blockIdx.y * TR, c0 = (u64)blockIdx.x * TC;
    const unsigned k = threadIdx.x % KC, g = threadIdx.x / KC;
    if (LOAD) {
        uint4 v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            v[i] = __ldcs(reinterpret_cast<const uint4*>(rowwise + (r0 + 8 * g + i) * rbytes + c0 / 2 + 16 * k));
        if (!STORE) {
            uint32_t x = 0;
#pragma unroll
            for (int i = 0; i < 8; ++i) x ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
            if (x == 0x12345678u && rows == 3) col_data[threadIdx.x] = 1;
            return;
        }
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            uint32_t a[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) a[i] = m == 0 ? v[i].x : m == 1 ? v[i].y : m == 2 ? v[i].z : v[i].w;
            nibble_transpose_8x8(a);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned col = 32 * k + 8 * m + j;
                // word g of the column, swizzled by the column's chunk k (4k across g's 2 low bits)
                sm[col * CW + (g ^ ((4 * k) % CW))] = a[j];
            }
        }
        __syncthreads();
    }
    // Store: each column's CW words = CW/4 chunks of 16 bytes.
    constexpr int CPC = CW / 4;  // chunks per column
    constexpr int TOT = TC * CPC;
#pragma unroll
    for (int it = 0; it < TOT / NT; ++it) {
        const unsigned e = it * NT + threadIdx.x, col = e / CPC, q = e % CPC;
        uint4 val;
        if (LOAD) {
            const unsigned kk = (col / 32) % KC;
            const unsigned pq = q ^ (((4 * kk) % CW) / 4);
            val = *reinterpret_cast<const uint4*>(&sm[col * CW + 4 * pq]);
        } else {
            val = make_uint4(col, q, 0, 0);
        }
        *reinterpret_cast<uint4*>(col_data + (c0 + col) * rb + r0 / 2 + 16 * q) = val;
    }
}

// Classic f32 transpose (32x32 tile, 32x8 threads) over the same bytes, as a reference of what a
// 128-byte-run transpose reaches: a [R][C] f32 matrix.
__global__ void k_ftr(const float* __restrict__ s, float* __restrict__ d, u64 R, u64 C) {
    __shared__ float t[32][33];
    const u64 x = (u64)blockIdx.x * 32 + threadIdx.x, y = (u64)blockIdx.y * 32 + threadIdx.y;
#pragma unroll
    for (int j = 0; j < 32; j += 8) t[threadIdx.y + j][threadIdx.x] = s[(y + j) * C + x];
    __syncthreads();
    const u64 x2 = (u64)blockIdx.y * 32 + threadIdx.x, y2 = (u64)blockIdx.x * 32 + threadIdx.y;
#pragma unroll
    for (int j = 0; j < 32; j += 8) d[(y2 + j) * R + x2] = t[threadIdx.x][threadIdx.y + j];
}

static float timeit(void (*launch)(void*), void* arg, int reps) {
    cudaEvent_t a, b;
    cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) launch(arg);
    std::vector<float> ts;
    for (int r = 0; r < reps; ++r) {
        cudaEventRecord(a);
        launch(arg);
        cudaEventRecord(b);
        cudaEventSynchronize(b);
        float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms);
    }
    CK(cudaGetLastError());
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2] * 1000.f;
}

struct Ctx { uint8_t *src, *dst; u64 rows, cols, count, bytes; int which; };

template <int TR, int TC, bool L, bool S>
static void launch_t1(Ctx* c) {
    constexpr int NT = (TR / 8) * (TC / 32);
    constexpr int SMB = TR / 8 * TC * 4;
    static bool set = false;
    if (!set) { CK(cudaFuncSetAttribute(k_t1<TR, TC, L, S>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMB)); set = true; }
    dim3 grid(c->cols / TC, c->rows / TR, c->count);
    k_t1<TR, TC, L, S><<<grid, NT, L ? SMB : 0>>>(c->src, c->dst, c->rows, c->cols);
}

static void run(void* p) {
    Ctx* c = (Ctx*)p;
    switch (c->which) {
        case 0: k_copy<<<132 * 8, 512>>>((const uint4*)c->src, (uint4*)c->dst, c->bytes / 16); break;
        case 1: CK(cudaMemcpyAsync(c->dst, c->src, c->bytes, cudaMemcpyDeviceToDevice)); break;
        case 2: {
            // The backend's codes kernel (version 3 of the completion: the same 256x256 tile
            // and 4-byte loads as version 4; it writes nothing but the columnwise codes).
            static Finish2dSameParams p;
            memset(&p, 0, sizeof p);
            p.rows = c->rows; p.cols = c->cols; p.items = c->count;
            for (u64 i = 0; i < c->count; ++i) {
                p.ptrs[i][0] = (u64)(c->src + i * c->rows * c->cols / 2);
                p.ptrs[i][4] = (u64)(c->dst + i * c->rows * c->cols / 2);
            }
            nvfp4x_finish_2d_same<<<dim3(c->cols / 256, c->rows / 256, c->count), 256>>>(p);
            break;
        }
        case 3: launch_t1<256, 256, true, true>(c); break;
        case 4: launch_t1<512, 256, true, true>(c); break;
        case 5: launch_t1<256, 512, true, true>(c); break;
        case 6: launch_t1<256, 256, true, false>(c); break;
        case 7: launch_t1<256, 256, false, true>(c); break;
        case 8: launch_t1<128, 256, true, true>(c); break;
        case 9: launch_t1<256, 128, true, true>(c); break;
        case 10: {
            // f32 [R][C] with R*C*4 = bytes: R = rows, C = bytes / 4 / rows
            u64 R = c->rows, C = c->bytes / 4 / R;
            k_ftr<<<dim3(C / 32, R / 32), dim3(32, 8)>>>((const float*)c->src, (float*)c->dst, R, C);
            break;
        }
    }
}

static const char* names[] = {"copy kernel (16B, read+write)", "cudaMemcpy D2D", "t0 = the codes kernel (v3, 256x256, 4B loads)",
                              "t1 256x256 16B loads", "t1 512x256 (256-B column runs)", "t1 256x512 (256-B row runs)",
                              "t1 loads only", "t1 stores only", "t1 128x256", "t1 256x128", "f32 transpose 32x32 (same bytes)"};

int main(int argc, char** argv) {
    int reps = 15;
    const char* only = argc > 1 ? argv[1] : nullptr;
    struct Shape { u64 rows, cols, count; };
    std::vector<Shape> shapes = {{16384, 16384, 1}, {32768, 32768, 1}, {8192, 2048, 16}, {2048, 8192, 16}, {2048, 2048, 32}};
    if (only && !strcmp(only, "ncu")) { shapes = {{16384, 16384, 1}}; reps = 1; }
    cudaDeviceProp prop; CK(cudaGetDeviceProperties(&prop, 0));
    printf("device %s\n", prop.name);
    for (auto s : shapes) {
        Ctx c;
        c.rows = s.rows; c.cols = s.cols; c.count = s.count;
        c.bytes = s.rows * s.cols / 2 * s.count;
        CK(cudaMalloc(&c.src, c.bytes)); CK(cudaMalloc(&c.dst, c.bytes));
        std::vector<uint8_t> h(c.bytes);
        uint64_t st = 0x9E3779B97F4A7C15ull;
        for (u64 i = 0; i < c.bytes; ++i) { st ^= st << 13; st ^= st >> 7; st ^= st << 17; h[i] = (uint8_t)st; }
        CK(cudaMemcpy(c.src, h.data(), c.bytes, cudaMemcpyHostToDevice));
        // reference: t0
        c.which = 2; run(&c); CK(cudaDeviceSynchronize());
        std::vector<uint8_t> ref(c.bytes), got(c.bytes);
        CK(cudaMemcpy(ref.data(), c.dst, c.bytes, cudaMemcpyDeviceToHost));
        // spot check t0 against the host transpose
        int bad = 0;
        for (int t = 0; t < 100000 && bad < 5; ++t) {
            u64 m = (u64)rand() % s.count, r = (u64)rand() % s.rows, col = (u64)rand() % s.cols;
            u64 base = m * s.rows * s.cols / 2;
            int nib = (h[base + r * s.cols / 2 + col / 2] >> (4 * (col % 2))) & 15;
            int out = (ref[base + col * s.rows / 2 + r / 2] >> (4 * (r % 2))) & 15;
            if (nib != out) { ++bad; printf("t0 mismatch r %llu c %llu\n", r, col); }
        }
        printf("shape %llux%llu x%llu (%.1f MB each way)%s\n", s.rows, s.cols, s.count, c.bytes / 1e6, bad ? " T0 WRONG" : "");
        float copy_us = 0;
        for (int w = 0; w <= 10; ++w) {
            c.which = w;
            if (w == 10 && (c.bytes / 4 / s.rows) % 32) continue;
            CK(cudaMemset(c.dst, 0, c.bytes));
            float us = timeit(run, &c, reps);
            CK(cudaDeviceSynchronize());
            const char* ok = "";
            if (w >= 2 && w != 6 && w != 7 && w != 10) {
                CK(cudaMemcpy(got.data(), c.dst, c.bytes, cudaMemcpyDeviceToHost));
                ok = memcmp(got.data(), ref.data(), c.bytes) ? " MISMATCH" : " ok";
            }
            double moved = (w == 6 || w == 7) ? c.bytes : 2.0 * c.bytes;
            if (w == 0) copy_us = us;
            double gbs = moved / us / 1e3;
            double copy_gbs = 2.0 * c.bytes / copy_us / 1e3;
            printf("  %-40s %9.1f us %7.0f GB/s %5.2f x copy%s\n", names[w], us, gbs, gbs / copy_gbs, ok);
        }
        cudaFree(c.src); cudaFree(c.dst);
    }
    return 0;
}
