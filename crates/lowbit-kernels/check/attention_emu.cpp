// A host emulation of attention.cu's kernels against the CPU backend's bytes: one pthread per
// CUDA thread, a barrier for __syncthreads, the blocks of a grid one after another (the kernels'
// __shared__ arrays become function statics, shared by the running block's threads), the _rn
// intrinsics as plain f32 operations with contraction off, exp and log from the host libm (as
// the Rust CPU backend's). It checks the kernels' indexing, tiling, barriers and summation
// orders without a GPU; what it cannot check is the device's double exp/log against the host's
// (the assumption every exact kernel shares) and the launches' plumbing (cuda_attention.rs on a
// GPU does). From the repository root:
//   mkdir -p /tmp/attn && LOWBIT_ATTENTION_DUMP=/tmp/attn cargo test -p lowbit-device \
//     --test attention -- --ignored dump_cases_for_the_kernel_emulation
//   g++ -O1 -std=c++17 -ffp-contract=off -pthread -o /tmp/attn_emu \
//     crates/lowbit-kernels/check/attention_emu.cpp && /tmp/attn_emu /tmp/attn
// prints each case's differing elements and "TOTAL differing: 0", and exits 0.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <vector>
#include <string>
#include <thread>
#include <pthread.h>
struct D3 { unsigned x, y, z; };
thread_local D3 threadIdx, blockIdx;
D3 blockDim, gridDim;
pthread_barrier_t bar;
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(x)
#define __restrict__
static inline void __syncthreads() { pthread_barrier_wait(&bar); }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __clz(uint32_t x) { return x ? __builtin_clz(x) : 32; }
static inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
#include "../attention.cu"

template <class F> void launch(D3 grid, unsigned threads, F f) {
    gridDim = grid; blockDim = {threads, 1, 1};
    for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx) {
            pthread_barrier_init(&bar, nullptr, threads);
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; ++t)
                ts.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; f(); });
            for (auto& t : ts) t.join();
            pthread_barrier_destroy(&bar);
        }
}
std::vector<float> rd(const std::string& p) {
    FILE* f = fopen(p.c_str(), "rb"); std::vector<float> v;
    fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
    v.resize(n / 4); if (n) fread(v.data(), 4, n / 4, f); fclose(f); return v;
}
int cmp(const char* name, const std::vector<float>& a, const std::vector<float>& b) {
    int bad = 0;
    for (size_t i = 0; i < a.size(); ++i) if (__float_as_uint(a[i]) != __float_as_uint(b[i])) { if (!bad) printf("  %s[%zu]: emu %a cpu %a\n", name, i, a[i], b[i]); ++bad; }
    printf("  %s: %zu elements, %d differ\n", name, a.size(), bad); return bad;
}
static std::string dir;
int main(int argc, char** argv) {
    if (argc != 2) { fprintf(stderr, "usage: attention_emu DIR\n"); return 2; }
    dir = argv[1];
    FILE* l = fopen((dir + "/cases.txt").c_str(), "r");
    if (!l) { perror("cases.txt"); return 2; }
    int n; unsigned long long B, S, H, G, HD; unsigned sb; int total = 0;
    while (fscanf(l, "%d %llu %llu %llu %llu %llu %u", &n, &B, &S, &H, &G, &HD, &sb) == 7) {
        float scale = __uint_as_float(sb);
        auto p = [&](const char* x) { return dir + "/c" + std::to_string(n) + "_" + x + ".bin"; };
        auto q = rd(p("q")), k = rd(p("k")), v = rd(p("v")), dout = rd(p("dout"));
        std::vector<float> out(q.size(), 7.f), lse(B * H * S, 7.f), dq(q.size(), 7.f), dk(k.size(), 7.f), dv(k.size(), 7.f), dd(B * H * S, 7.f);
        unsigned gx = (S + 63) / 64;
        launch({gx, (unsigned)(B * H), 1}, 64, [&] { attention_fwd(q.data(), k.data(), v.data(), out.data(), lse.data(), S, H, G, HD, scale); });
        unsigned long long rows = B * S * H;
        launch({(unsigned)((rows + 255) / 256), 1, 1}, 256, [&] { attention_bwd_d(out.data(), dout.data(), dd.data(), rows, S, H, HD); });
        launch({gx, (unsigned)(B * H), 1}, 64, [&] { attention_bwd_dq(q.data(), k.data(), v.data(), lse.data(), dout.data(), dd.data(), dq.data(), S, H, G, HD, scale); });
        launch({gx, (unsigned)(B * G), 1}, 64, [&] { attention_bwd_dkv(q.data(), k.data(), v.data(), lse.data(), dout.data(), dd.data(), dk.data(), dv.data(), S, H, G, HD, scale); });
        printf("case %d: b %llu s %llu h %llu g %llu hd %llu\n", n, B, S, H, G, HD);
        total += cmp("out", out, rd(p("out"))) + cmp("lse", lse, rd(p("lse"))) + cmp("dq", dq, rd(p("dq"))) + cmp("dk", dk, rd(p("dk"))) + cmp("dv", dv, rd(p("dv")));
    }
    printf("TOTAL differing: %d\n", total); return total != 0;
}
