// Bit-exact conversions shared by the kernel sources (`ops.cu`, `nvfp4.cu`, `mxfp8.cu`,
// `mxfp8x.cu`): f32 <-> bf16 and f16 as the `half` crate computes them, the dtype-coded loads and
// stores built on them, and the encoders of lowbit_formats::scalar (round-to-nearest-even
// magnitudes, E4M3 (the NVFP4 block scale, UE4M3 when the input is non-negative), E2M1, E8M0 and
// its reciprocal). One copy, so that a fix reaches every kernel; `cargo xtask ptx` compiles each
// source with it, and the recorded source hash of every PTX module covers this header too, so a
// change here makes every module stale until the PTX is rebuilt.
//
// Every function is `__forceinline__` integer code (f32 arithmetic only through `_rn`
// intrinsics): no cvt instructions, whose NaN results are canonical where the CPU keeps payloads.
// Dtype codes: 0 = f32, 1 = bf16, 2 = f16.

#pragma once

#include <stdint.h>

typedef unsigned long long u64;

// ---- f32 <-> bf16 / f16 (the `half` crate's, bit for bit) ----

__device__ __forceinline__ uint16_t f32_to_bf16_bits(float v) {
    uint32_t x = __float_as_uint(v);
    uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x40u;
    return (uint16_t)((x & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) {
    return __uint_as_float(((uint32_t)b) << 16);
}

// half::f16::from_f32 (software fallback; identical to F16C's vcvtps2ph with RNE).
__device__ __forceinline__ uint16_t f32_to_f16_bits(float value) {
    uint32_t x = __float_as_uint(value);
    uint32_t sign = x & 0x80000000u;
    uint32_t exp = x & 0x7F800000u;
    uint32_t man = x & 0x007FFFFFu;
    if (exp == 0x7F800000u) {
        uint32_t nan_bit = man == 0 ? 0u : 0x0200u;
        return (uint16_t)((sign >> 16) | 0x7C00u | nan_bit | (man >> 13));
    }
    uint32_t half_sign = sign >> 16;
    int unbiased_exp = (int)(exp >> 23) - 127;
    int half_exp = unbiased_exp + 15;
    if (half_exp >= 0x1F) return (uint16_t)(half_sign | 0x7C00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (uint16_t)half_sign;
        uint32_t m = man | 0x00800000u;
        uint32_t half_man = m >> (14 - half_exp);
        uint32_t round_bit = 1u << (13 - half_exp);
        if ((m & round_bit) != 0 && (m & (3u * round_bit - 1u)) != 0) half_man += 1;
        return (uint16_t)(half_sign | half_man);
    }
    uint32_t he = ((uint32_t)half_exp) << 10;
    uint32_t half_man = man >> 13;
    uint32_t round_bit = 0x00001000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0)
        return (uint16_t)((half_sign | he | half_man) + 1u);
    return (uint16_t)(half_sign | he | half_man);
}

// half::f16::to_f32 (exact; NaN keeps its payload with the quiet bit set).
__device__ __forceinline__ float f16_bits_to_f32(uint16_t i) {
    if ((i & 0x7FFFu) == 0) return __uint_as_float(((uint32_t)i) << 16);
    uint32_t half_sign = (uint32_t)(i & 0x8000u);
    uint32_t half_exp = (uint32_t)(i & 0x7C00u);
    uint32_t half_man = (uint32_t)(i & 0x03FFu);
    if (half_exp == 0x7C00u) {
        if (half_man == 0) return __uint_as_float((half_sign << 16) | 0x7F800000u);
        return __uint_as_float((half_sign << 16) | 0x7FC00000u | (half_man << 13));
    }
    uint32_t sign = half_sign << 16;
    int unbiased_exp = ((int)half_exp >> 10) - 15;
    if (half_exp == 0) {
        int e = __clz(half_man) - 16 - 6;
        uint32_t ex = (uint32_t)(127 - 15 - e) << 23;
        uint32_t m = (half_man << (14 + e)) & 0x7FFFFFu;
        return __uint_as_float(sign | ex | m);
    }
    uint32_t ex = ((uint32_t)(unbiased_exp + 127)) << 23;
    uint32_t m = half_man << 13;
    return __uint_as_float(sign | ex | m);
}

__device__ __forceinline__ float load(const uint8_t* __restrict__ p, uint32_t dt, u64 i) {
    if (dt == 0) return reinterpret_cast<const float*>(p)[i];
    uint16_t b = reinterpret_cast<const uint16_t*>(p)[i];
    return dt == 1 ? bf16_bits_to_f32(b) : f16_bits_to_f32(b);
}

__device__ __forceinline__ void store(uint8_t* __restrict__ p, uint32_t dt, u64 i, float v) {
    if (dt == 0) {
        reinterpret_cast<float*>(p)[i] = v;
    } else {
        reinterpret_cast<uint16_t*>(p)[i] = dt == 1 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v);
    }
}

// ---- quantization formats (lowbit_formats::scalar, bit for bit) ----

// Round-to-nearest-even magnitude code of fp32 bits `a` in a format with `mbits` mantissa bits
// and exponent bias `bias` (lowbit_formats::scalar::rne_magnitude): normal results by integer
// rounding of the bits, subnormal results by letting the fp32 adder round.
__device__ __forceinline__ uint32_t rne_magnitude(uint32_t a, uint32_t mbits, uint32_t bias) {
    uint32_t shift = 23 - mbits;
    uint32_t min_normal_bits = (127 - bias + 1) << 23;
    uint32_t odd = (a >> shift) & 1u;
    uint32_t normal = ((a + (1u << (shift - 1)) - 1u + odd) >> shift) - ((127 - bias) << mbits);
    float magic = __uint_as_float((127 + 24 - bias - mbits) << 23);
    uint32_t sub = __float_as_uint(__fadd_rn(__uint_as_float(a), magic)) - __float_as_uint(magic);
    return a >= min_normal_bits ? normal : sub;
}

// fp32 -> E4M3 (saturating, NaN -> 0x7F): the NVFP4 block-scale encoder.
__device__ __forceinline__ uint32_t e4m3_code(float x) {
    uint32_t bits = __float_as_uint(x);
    uint32_t a = bits & 0x7FFFFFFFu;
    uint32_t sign = (bits >> 24) & 0x80u;
    uint32_t code = rne_magnitude(a < 0x44000000u ? a : 0x44000000u, 3, 7);
    code = code < 0x7Eu ? code : 0x7Eu;
    return a > 0x7F800000u ? 0x7Fu : (code | sign);
}

// fp32 -> E2M1 nibble (saturating to 6, NaN -> +6, -0 -> 0x8).
__device__ __forceinline__ uint32_t e2m1_code(float x) {
    uint32_t bits = __float_as_uint(x);
    uint32_t a = bits & 0x7FFFFFFFu;
    uint32_t sign = (bits >> 28) & 0x8u;
    uint32_t code = rne_magnitude(a < 0x41000000u ? a : 0x41000000u, 1, 1);
    code = code < 7u ? code : 7u;
    return a > 0x7F800000u ? 7u : (code | sign);
}

// |v|'s bits with NaN as 0: the amax reductions compare u32 bits (order-independent, so atomics
// and parallel maxima give the library's result).
__device__ __forceinline__ uint32_t abs_bits_nan_zero(float v) {
    uint32_t a = __float_as_uint(v) & 0x7FFFFFFFu;
    return a > 0x7F800000u ? 0u : a;
}

// Smallest power of two >= |x| as E8M0, clamped to [2^-127, 2^127]; NaN -> 0xFF
// (lowbit_formats::scalar::e8m0_from_f32). Branch-free: (a + 2^23 - 1) >> 23 is the exponent plus
// one when the mantissa is not zero (a normal number rounds up), and for a subnormal (a < 2^23)
// (a + 2^22 - 1) >> 23 is 1 exactly when the mantissa exceeds 2^22 (Transformer Engine's
// float_to_e8m0 fallback, common/util/ptx_arch_spec.cuh and tests/cpp/test_common.h: 2^-127
// covers subnormals up to half of 2^-126); Inf and 0xFE.. give 0xFF, clamped to 0xFE. The branchy form (the rule as
// lowbit_formats::scalar writes it) costs two branches per scale; this one is equal to it for all
// 2^32 inputs (check/e8m0_branch_free.c) and to the rule transcribed in tests/e8m0.rs.
__device__ __forceinline__ uint32_t e8m0_code(float x) {
    const uint32_t a = __float_as_uint(x) & 0x7FFFFFFFu;
    const uint32_t t = (a + (a < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
    const uint32_t code = t < 0xFEu ? t : 0xFEu;
    return a > 0x7F800000u ? 0xFFu : code;
}

// 2^(127 - e) (lowbit_formats::scalar::e8m0_rcp): 0xFE -> 2^-127, 0xFF -> NaN (selects).
__device__ __forceinline__ float e8m0_reciprocal(uint32_t e) {
    const uint32_t n = (254u - e) << 23;
    return __uint_as_float(e == 0xFEu ? 0x00400000u : e == 0xFFu ? 0x7FC00000u : n);
}
