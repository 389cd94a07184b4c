// The branch-free E8M0 helpers of crates/lowbit-kernels/include/lowbit_convert.cuh (e8m0_code,
// e8m0_reciprocal; every kernel source includes them) against the rule as
// lowbit_formats::scalar writes it, for every f32 bit pattern and every scale byte. Plain C on
// the host (the helpers are integer arithmetic on the bits):
//   gcc -O2 -o /tmp/e8m0 crates/lowbit-kernels/check/e8m0_branch_free.c && /tmp/e8m0
// prints "mismatches 0" (about ten seconds) and exits 0.
#include <stdint.h>
#include <stdio.h>

static inline uint8_t rule_round_up(uint32_t bits) {
    uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return 0xFF;
    uint32_t exp = a >> 23;
    uint32_t mant = a & 0x7FFFFFu;
    uint32_t up = (mant != 0u && exp != 0xFEu && !(exp == 0u && mant <= 0x400000u)) ? 1u : 0u;
    uint32_t code = exp + up;
    return (uint8_t)(code > 0xFEu ? 0xFEu : code);
}

static inline uint8_t branch_free_round_up(uint32_t bits) {
    const uint32_t a = bits & 0x7FFFFFFFu;
    const uint32_t t = (a + (a < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;
    const uint32_t code = t < 0xFEu ? t : 0xFEu;
    return (uint8_t)(a > 0x7F800000u ? 0xFFu : code);
}

static inline uint32_t rule_rcp(uint8_t e) {
    if (e == 0xFE) return 0x00400000u;
    if (e == 0xFF) return 0x7FC00000u;
    return (254u - (uint32_t)e) << 23;
}

static inline uint32_t branch_free_rcp(uint32_t e) {
    const uint32_t n = (254u - e) << 23;
    return e == 0xFEu ? 0x00400000u : e == 0xFFu ? 0x7FC00000u : n;
}

int main(void) {
    uint64_t bad = 0;
    for (uint64_t i = 0; i <= 0xFFFFFFFFull; ++i) {
        if (rule_round_up((uint32_t)i) != branch_free_round_up((uint32_t)i)) {
            if (bad < 5) printf("round up differs at %08llx\n", (unsigned long long)i);
            ++bad;
        }
    }
    for (uint32_t e = 0; e < 256; ++e) {
        if (rule_rcp((uint8_t)e) != branch_free_rcp(e)) {
            printf("rcp differs at %u\n", e);
            ++bad;
        }
    }
    printf("mismatches %llu\n", (unsigned long long)bad);
    return bad != 0;
}
