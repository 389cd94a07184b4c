// A host emulation of fast.cu's kernels: one thread per CUDA thread, a barrier for
// __syncthreads and one per warp for the shuffles, the blocks of a grid one after another
// (__shared__ arrays become function statics), f32 intrinsics as plain operations with
// contraction off, expf/exp/log from the host libm. It checks the kernels' indexing, the row
// heads and tails, barriers, reductions and NaN rules against f64 references with the
// tolerances the ops document (and RoPE, SwiGLU, the embedding against the exact formulas, bit
// for bit), without a GPU; the launches' plumbing and the device's libm are for
// crates/lowbit-device/tests/cuda_fast.rs on a GPU. From the repository root:
//   g++ -O1 -std=c++20 -ffp-contract=off -pthread -o /tmp/fast_emu \
//     crates/lowbit-kernels/check/fast_emu.cpp && /tmp/fast_emu
// prints each check and "ALL OK", and exits 0.
#include <pthread.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
struct D3 {
    unsigned x, y, z;
};
thread_local D3 threadIdx, blockIdx;
D3 blockDim, gridDim;
pthread_barrier_t bar;
pthread_barrier_t warp_bar[32];
float shfl_buf[32][32];
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __restrict__
struct float4 {
    float x, y, z, w;
};
struct uint2 {
    uint32_t x, y;
};
static inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
static inline void __syncthreads() { pthread_barrier_wait(&bar); }
static inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
static inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
static inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
static inline float __fdiv_rn(float a, float b) { volatile float r = a / b; return r; }
static inline float __fsqrt_rn(float a) { return sqrtf(a); }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int __clz(uint32_t x) { return x ? __builtin_clz(x) : 32; }
static inline unsigned tid_linear() { return threadIdx.x + threadIdx.y * blockDim.x; }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    unsigned t = tid_linear(), w = t / 32, l = t % 32;
    shfl_buf[w][l] = v;
    pthread_barrier_wait(&warp_bar[w]);
    float r = shfl_buf[w][l ^ o];
    pthread_barrier_wait(&warp_bar[w]);
    return r;
}
static inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
    unsigned long long old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
#include "../fast.cu"

template <class F>
void launch(unsigned grid, D3 block, F f) {
    unsigned threads = block.x * block.y;
    gridDim = {grid, 1, 1};
    blockDim = block;
    for (unsigned w = 0; w < threads / 32; ++w) pthread_barrier_init(&warp_bar[w], nullptr, 32);
    for (unsigned bx = 0; bx < grid; ++bx) {
        pthread_barrier_init(&bar, nullptr, threads);
        std::vector<std::thread> ts;
        for (unsigned t = 0; t < threads; ++t)
            ts.emplace_back([=] {
                threadIdx = {t % block.x, t / block.x, 0};
                blockIdx = {bx, 0, 0};
                f();
            });
        for (auto& t : ts) t.join();
        pthread_barrier_destroy(&bar);
    }
    for (unsigned w = 0; w < threads / 32; ++w) pthread_barrier_destroy(&warp_bar[w]);
}

static uint64_t rng = 88172645463325252ull;
static float unit() {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) & 0xFFFFFF) / (float)(1 << 24) * 2.0f - 1.0f;
}
static int failures = 0;
static void check(bool ok, const char* what, long i, double got, double want) {
    if (!ok && failures++ < 20) printf("  FAIL %s [%ld]: got %.9g want %.9g\n", what, i, got, want);
}

// One cross-entropy launch over `rows` x `classes` logits at a float offset `off` (the row
// heads and tails), CTA (`threads`) or warp kernel, against f64.
static void xent(unsigned rows, unsigned classes, unsigned off, bool cta, unsigned threads, bool grad) {
    int before = failures;
    std::vector<float> buf(rows * classes + off + 4), t(rows), loss(rows, -7.0f);
    float* x = buf.data() + off;
    for (unsigned i = 0; i < rows * classes; ++i) x[i] = unit() * 8.0f;
    if (rows > 3 && classes > 3) {
        x[1] = NAN;                                             // row 0: NaN
        x[classes + 2] = INFINITY;                              // row 1: +Inf
        for (unsigned j = 0; j < classes; j += 3) x[2 * classes + j] = -INFINITY;  // row 2
        for (unsigned j = 0; j < classes; ++j) x[3 * classes + j] = -INFINITY;    // row 3
    }
    for (unsigned r = 0; r < rows; ++r) t[r] = (float)((r * 7919u + 13u) % classes);
    if (rows > 4) t[4] = (float)classes;  // a bad target
    std::vector<float> x0(x, x + rows * classes);
    unsigned long long err = ~0ull;
    float c = 0.37f;
    if (cta)
        launch(rows < 3 ? rows : 3, {threads, 1, 1}, [&] {
            fast_xent_cta(x, t.data(), loss.data(), &err, rows, classes, c, grad, 0, nullptr);
        });
    else
        launch(1, {64, 1, 1}, [&] {
            fast_xent_warp(x, t.data(), loss.data(), &err, rows, classes, c, grad, 0, nullptr);
        });
    // The bf16 gradient output (at an offset `off` of 2-byte elements, so also misaligned for
    // the 8-byte stores): each element the in-place gradient rounded as `cast` rounds it, the
    // logits untouched, the losses the same bits.
    if (grad) {
        // The logits at the same float offset as above: the row heads, so the sums, are the same.
        std::vector<float> xbuf(rows * classes + off + 4), loss2(rows, -7.0f);
        float* xb = xbuf.data() + off;
        std::copy(x0.begin(), x0.end(), xb);
        std::vector<uint16_t> yb(rows * classes + off + 4, 0xABCD);
        uint16_t* y = yb.data() + off;
        unsigned long long err2 = ~0ull;
        if (cta)
            launch(rows < 3 ? rows : 3, {threads, 1, 1}, [&] {
                fast_xent_cta(xb, t.data(), loss2.data(), &err2, rows, classes, c, 1, 0, y);
            });
        else
            launch(1, {64, 1, 1}, [&] {
                fast_xent_warp(xb, t.data(), loss2.data(), &err2, rows, classes, c, 1, 0, y);
            });
        for (size_t i = 0; i < (size_t)rows * classes; ++i) {
            check(y[i] == f32_to_bf16_bits(x[i]), "xent bf16 grad", (long)i, y[i], f32_to_bf16_bits(x[i]));
            check(memcmp(&xb[i], &x0[i], 4) == 0, "xent bf16: logits untouched", (long)i, xb[i], x0[i]);
        }
        for (unsigned r = 0; r < rows; ++r)
            check(memcmp(&loss2[r], &loss[r], 4) == 0, "xent bf16: same losses", r, loss2[r], loss[r]);
        for (unsigned i = 0; i < off; ++i) check(yb[i] == 0xABCD, "xent bf16 before the view", i, yb[i], 0);
        check(err2 == err, "xent bf16 error word", 0, (double)(err2 >> 32), (double)(err >> 32));
    }
    for (unsigned r = 0; r < rows; ++r) {
        const float* xr = x0.data() + (size_t)r * classes;
        unsigned ti = (unsigned)t[r];
        bool bad = r == 4 && rows > 4;
        double mx = -INFINITY;
        for (unsigned j = 0; j < classes; ++j)
            if (!std::isnan(xr[j])) mx = fmax(mx, xr[j]);
        double s = 0;
        for (unsigned j = 0; j < classes; ++j) s += exp((double)xr[j] - mx);
        bool nan = bad || std::isnan(s) || std::isnan(xr[ti] - mx);
        double lse = mx + log(s);
        if (nan) {
            check(std::isnan(loss[r]), "xent loss NaN", r, loss[r], NAN);
        } else {
            double l64 = lse - xr[ti];
            double tol = 1e-5 * (1 + fabs(xr[ti] - mx) + log(s));
            check(fabs(loss[r] - l64) <= tol || (std::isinf(l64) && loss[r] == l64), "xent loss", r, loss[r], l64);
        }
        for (unsigned j = 0; j < classes && grad; ++j) {
            float got = x[(size_t)r * classes + j];
            if (nan) {
                check(std::isnan(got), "xent grad NaN", j, got, NAN);
                continue;
            }
            double p = exp((double)xr[j] - lse);
            double want = c * (p - (j == ti ? 1.0 : 0.0));
            check(fabs(got - want) <= c * (1e-5 * p + 2e-7), "xent grad", (long)r * classes + j, got, want);
        }
        if (!grad)
            for (unsigned j = 0; j < classes; ++j)
                check(memcmp(&x[(size_t)r * classes + j], &xr[j], 4) == 0, "xent logits untouched", j, 0, 0);
    }
    if (rows > 4) {
        unsigned long long want = (4ull << 32) | __float_as_uint((float)classes);
        check(err == want, "xent error word", 0, (double)(err >> 32), 4);
    } else {
        check(err == ~0ull, "xent error word clean", 0, 0, 0);
    }
    for (unsigned i = 0; i < off; ++i) check(buf[i] == 0.0f, "xent before the view", i, buf[i], 0);
    printf("xent rows %u classes %u off %u %s%u grad %d: %s\n", rows, classes, off, cta ? "cta" : "warp",
           cta ? threads : 32, grad, failures > before ? "FAILED" : "ok");
}

// RMSNorm forward and backward (both stages) against f64, with `nb` row blocks of `rb`.
static void rms(unsigned rows, unsigned cols, unsigned off, bool vec, int nv) {
    int before = failures;
    std::vector<float> xb(rows * cols + off), w(cols), y(rows * cols), rs(rows), dyb(rows * cols + off),
        dx(rows * cols), dw(cols), dw0(cols);
    float* x = xb.data() + off;
    float* dy = dyb.data() + off;
    for (unsigned i = 0; i < rows * cols; ++i) x[i] = unit() * 3.0f, dy[i] = unit();
    for (unsigned j = 0; j < cols; ++j) w[j] = unit() * 1.5f, dw0[j] = dw[j] = unit() * 0.1f;
    float eps = 1e-5f;
    unsigned grid = rows < 5 ? rows : 5;
#define RMS_CALL(SUF)                                                                      \
    launch(grid, {RMS_T, 1, 1}, [&] { fast_rms_fwd_##SUF(x, w.data(), y.data(), rs.data(), rows, cols, eps, 0); }); \
    launch(grid, {RMS_T, 1, 1}, [&] { fast_rms_fwd_##SUF(x, w.data(), yh.data(), rs2.data(), rows, cols, eps, 1); }); \
    launch(nb, {RMS_T, 1, 1}, [&] {                                                        \
        fast_rms_bwd_##SUF(x, w.data(), rs.data(), dy, dx.data(), part.data(), rows, cols, rb); \
    });
    unsigned rb = (rows + 6) / 7, nb = (rows + rb - 1) / rb;
    std::vector<float> part((size_t)nb * cols, NAN), rs2(rows);
    std::vector<uint16_t> yh(rows * cols, 0xABCD);  // the bf16 output
    if (vec && nv < 0) {
#undef RMS_T
#define RMS_T 128
        if (nv == -1) { RMS_CALL(v1_t128) } else if (nv == -2) { RMS_CALL(v2_t128) } else { RMS_CALL(v4_t128) }
#undef RMS_T
#define RMS_T 256
    } else if (vec) {
        if (nv == 1) { RMS_CALL(v1) } else if (nv == 2) { RMS_CALL(v2) } else if (nv == 4) { RMS_CALL(v4) } else { RMS_CALL(v8) }
    } else {
        if (nv == 4) { RMS_CALL(s4) } else if (nv == 8) { RMS_CALL(s8) } else if (nv == 16) { RMS_CALL(s16) } else { RMS_CALL(s32) }
    }
    launch((cols + 31) / 32, {32, 32, 1}, [&] { fast_rms_dw_reduce(part.data(), dw.data(), nb, cols); });
    std::vector<double> dw64(dw0.begin(), dw0.end()), mag(cols);
    for (unsigned j = 0; j < cols; ++j) mag[j] = fabs(dw0[j]);
    for (unsigned r = 0; r < rows; ++r) {
        const float* xr = x + (size_t)r * cols;
        double ss = 0;
        for (unsigned j = 0; j < cols; ++j) ss += (double)xr[j] * xr[j];
        double r64 = 1 / sqrt(ss / cols + eps);
        check(fabs(rs[r] - r64) <= 1e-5 * r64, "rms rstd", r, rs[r], r64);
        double rsf = rs[r], dot = 0, m = 0;
        for (unsigned j = 0; j < cols; ++j) {
            double xh = xr[j] * rsf, g = (double)dy[r * cols + j] * w[j];
            dot += g * xh, m += fabs(g * xh);
            dw64[j] += dy[r * cols + j] * xh, mag[j] += fabs(dy[r * cols + j] * xh);
        }
        for (unsigned j = 0; j < cols; ++j) {
            double y64 = xr[j] * r64 * w[j];
            check(fabs(y[r * cols + j] - y64) <= 1e-5 * fabs(y64) + 1e-30, "rms y", (long)r * cols + j, y[r * cols + j], y64);
            double xh = xr[j] * rsf, g = (double)dy[r * cols + j] * w[j];
            double d64 = rsf * (g - xh * dot / cols);
            double tol = 1e-5 * rsf * (fabs(g) + fabs(xh) * m / cols) + 1e-30;
            check(fabs(dx[r * cols + j] - d64) <= tol, "rms dx", (long)r * cols + j, dx[r * cols + j], d64);
        }
    }
    for (unsigned j = 0; j < cols; ++j) check(fabs(dw[j] - dw64[j]) <= 1e-5 * mag[j] + 1e-30, "rms dw", j, dw[j], dw64[j]);
    // The bf16 output is the f32 one rounded (as `cast` rounds it), the same rstd.
    for (size_t i = 0; i < (size_t)rows * cols; ++i)
        check(yh[i] == f32_to_bf16_bits(y[i]), "rms bf16 y", (long)i, yh[i], f32_to_bf16_bits(y[i]));
    for (unsigned r = 0; r < rows; ++r) check(memcmp(&rs[r], &rs2[r], 4) == 0, "rms bf16 rstd", r, rs2[r], rs[r]);
    printf("rms rows %u cols %u off %u %s%d (blocks %u of %u rows): %s\n", rows, cols, off, vec ? "v" : "s", nv, nb, rb,
           failures > before ? "FAILED" : "ok");
}

// RoPE, SwiGLU and the embedding against the exact kernels' formulas, bit for bit.
static bool same(float a, float b) { return memcmp(&a, &b, 4) == 0 || (std::isnan(a) && std::isnan(b)); }
static void elementwise() {
    int before = failures;
    unsigned rows = 5, heads = 3, half = 8, seq = 4, n = rows * heads * 2 * half;
    std::vector<float> x(n), y(n), cs(seq * half), sn(seq * half);
    for (auto& v : x) v = unit() * 4;
    for (unsigned i = 0; i < seq * half; ++i) cs[i] = unit(), sn[i] = unit();
    for (unsigned inv = 0; inv < 2; ++inv) {
        std::vector<float> yy = x;  // in place
        launch(2, {64, 1, 1}, [&] { fast_rope4(yy.data(), yy.data(), cs.data(), sn.data(), n / 8, heads, half, seq, inv); });
        for (unsigned k = 0; k < n / 2; ++k) {
            unsigned i = k % half, head = k / half, pos = (head / heads) % seq, base = head * 2 * half;
            float a = x[base + i], b = x[base + i + half], c = cs[pos * half + i], s = sn[pos * half + i];
            float ac = a * c, bs = b * s, bc = b * c, as = a * s;
            float lo = inv ? ac + bs : ac - bs, hi = inv ? bc - as : bc + as;
            check(same(yy[base + i], lo) && same(yy[base + i + half], hi), "rope", k, yy[base + i], lo);
        }
    }
    unsigned m = 1003;
    std::vector<float> g(m), u(m), d(m), o(m), dg(m), du(m);
    for (unsigned i = 0; i < m; ++i) g[i] = unit() * 10, u[i] = unit(), d[i] = unit();
    g[5] = NAN, g[6] = INFINITY, g[7] = -INFINITY;
    std::vector<uint16_t> oh(m, 0xABCD);
    launch(2, {64, 1, 1}, [&] { fast_swiglu4(g.data(), u.data(), o.data(), m, 0); });
    launch(2, {64, 1, 1}, [&] { fast_swiglu4(g.data(), u.data(), oh.data(), m, 1); });
    for (unsigned i = 0; i < m; ++i) check(oh[i] == f32_to_bf16_bits(o[i]), "swiglu bf16", i, oh[i], f32_to_bf16_bits(o[i]));
    launch(2, {64, 1, 1}, [&] { fast_swiglu_bwd4(g.data(), u.data(), d.data(), dg.data(), du.data(), m, 0); });
    std::vector<float> dg2(m);
    std::vector<uint16_t> duh(m, 0xABCD);
    launch(2, {64, 1, 1}, [&] { fast_swiglu_bwd4(g.data(), u.data(), d.data(), dg2.data(), duh.data(), m, 1); });
    for (unsigned i = 0; i < m; ++i)
        check(duh[i] == f32_to_bf16_bits(du[i]) && same(dg2[i], dg[i]), "swiglu bwd bf16", i, duh[i], f32_to_bf16_bits(du[i]));
    for (unsigned i = 0; i < m; ++i) {
        float sg = 1.0f / (1.0f + (float)exp((double)-g[i]));
        float want = (g[i] * sg) * u[i];
        float wdu = d[i] * (g[i] * sg), wdg = ((d[i] * u[i]) * sg) * (1.0f + g[i] * (1.0f - sg));
        check(same(o[i], want) && same(du[i], wdu) && same(dg[i], wdg), "swiglu", i, o[i], want);
    }
    unsigned vocab = 7, dim = 12, er = 9;
    std::vector<float> table(vocab * dim), ids(er), out(er * dim);
    for (auto& v : table) v = unit();
    for (unsigned r = 0; r < er; ++r) ids[r] = (float)((r * 5) % vocab);
    ids[3] = 7.0f, ids[6] = 0.5f;
    unsigned long long err = ~0ull;
    for (unsigned vec = 0; vec < 2; ++vec) {
        err = ~0ull;
        launch(2, {32, 1, 1}, [&] {
            fast_embedding((const uint8_t*)table.data(), 0, ids.data(), out.data(), &err, er, dim, vocab, vec);
        });
        for (unsigned r = 0; r < er; ++r)
            for (unsigned c = 0; c < dim; ++c) {
                bool bad = r == 3 || r == 6;
                float want = bad ? NAN : table[(unsigned)ids[r] * dim + c];
                check(same(out[r * dim + c], want), "embedding", r * dim + c, out[r * dim + c], want);
            }
        check(err == ((3ull << 32) | __float_as_uint(7.0f)), "embedding error word", 0, (double)(err >> 32), 3);
    }
    printf("rope, swiglu, embedding: %s\n", failures > before ? "FAILED" : "ok");
}

int main() {
    xent(7, 5000, 0, true, 128, true);
    xent(7, 5001, 1, true, 96, true);
    xent(6, 4099, 3, true, 64, false);
    xent(9, 300, 0, false, 32, true);
    xent(9, 37, 2, false, 32, true);
    xent(3, 1, 0, false, 32, true);
    xent(2, 3, 1, false, 32, false);
    rms(9, 768, 0, true, 1);
    rms(5, 2048, 0, true, 2);
    rms(3, 4096, 0, true, 4);
    rms(2, 8000, 0, true, 8);
    rms(7, 37, 1, false, 4);
    rms(4, 1500, 3, false, 8);
    rms(3, 3000, 0, false, 16);
    rms(2, 8192, 1, false, 32);
    rms(40, 64, 0, true, 1);
    rms(9, 512, 0, true, -1);  // the 128-thread entries
    rms(5, 768, 0, true, -2);
    rms(11, 2048, 0, true, -4);
    elementwise();
    printf(failures ? "FAILURES: %d\n" : "ALL OK\n", failures);
    return failures != 0;
}
