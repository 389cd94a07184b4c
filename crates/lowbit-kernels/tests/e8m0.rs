//! The kernels' branch-free E8M0 helpers (`e8m0_code` / `e8m0_reciprocal` in
//! `include/lowbit_convert.cuh`, which `mxfp8.cu`, `mxfp8x.cu` and `ops.cu` include) against
//! `lowbit_formats::scalar`, the oracle every kernel reproduces. The formula is transcribed here
//! and the header is checked to still spell it (and the sources to use the header rather than a
//! copy of their own), so a change to either side fails this test.
//! (`check/e8m0_branch_free.c` runs the same comparison over all 2^32 inputs on the host.)

use lowbit_formats::scalar::{e8m0_from_f32, e8m0_rcp};

/// The kernels' `(a + (a < 2^23 ? 2^22 - 1 : 2^23 - 1)) >> 23`, clamped, NaN to 0xFF.
fn round_up(x: f32) -> u8 {
    let a = x.to_bits() & 0x7FFF_FFFF;
    let t = (a + if a < 0x80_0000 { 0x3F_FFFF } else { 0x7F_FFFF }) >> 23;
    if a > 0x7F80_0000 {
        0xFF
    } else {
        t.min(0xFE) as u8
    }
}

/// The kernels' selects: 0xFE -> 2^-127, 0xFF -> NaN, else (254 - e) << 23.
fn rcp_bits(e: u8) -> u32 {
    let n = (254u32.wrapping_sub(u32::from(e))) << 23;
    match e {
        0xFE => 0x0040_0000,
        0xFF => 0x7FC0_0000,
        _ => n,
    }
}

#[test]
fn the_branch_free_rule_is_the_scalar_rule() {
    // The rule depends on the exponent, the sign bit (ignored) and where the mantissa lies
    // against 0, 2^22 and 2^23: every exponent and sign with the mantissas at and around those
    // edges, then a strided sweep of all bit patterns.
    let mantissas = [
        0, 1, 2, 0x1F_FFFF, 0x20_0000, 0x3F_FFFE, 0x3F_FFFF, 0x40_0000, 0x40_0001, 0x40_0002,
        0x55_5555, 0x7F_FFFE, 0x7F_FFFF,
    ];
    let edges = (0..=0x1FFu32).flat_map(|se| mantissas.map(move |m| (se << 23) | m));
    let sweep = (0..=u32::MAX / 65_521).map(|i| i.wrapping_mul(65_521).wrapping_add(i % 7));
    for bits in edges.chain(sweep) {
        let x = f32::from_bits(bits);
        assert_eq!(round_up(x), e8m0_from_f32(x), "E8M0 of {bits:#010x}");
    }
    for e in 0..=0xFFu8 {
        let want = e8m0_rcp(e);
        let got = f32::from_bits(rcp_bits(e));
        assert!(
            got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
            "reciprocal of {e:#04x}: {got:?} against {want:?}"
        );
    }
}

#[test]
fn the_shared_header_spells_the_branch_free_rule() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let lines = [
        "const uint32_t t = (a + (a < 0x800000u ? 0x3FFFFFu : 0x7FFFFFu)) >> 23;",
        "const uint32_t code = t < 0xFEu ? t : 0xFEu;",
        "e == 0xFEu ? 0x00400000u : e == 0xFFu ? 0x7FC00000u : n",
        "const uint32_t n = (254u - e) << 23;",
    ];
    let header = std::fs::read_to_string(dir.join("include/lowbit_convert.cuh"))
        .expect("the header is readable");
    for line in lines {
        assert!(
            header.contains(line),
            "include/lowbit_convert.cuh no longer has `{line}`: update tests/e8m0.rs"
        );
    }
    for file in ["mxfp8.cu", "mxfp8x.cu", "ops.cu"] {
        let src = std::fs::read_to_string(dir.join(file)).expect("the source is readable");
        assert!(
            src.contains("#include \"include/lowbit_convert.cuh\""),
            "{file} no longer includes the shared conversions: update tests/e8m0.rs"
        );
        for line in lines {
            assert!(
                !src.contains(line),
                "{file} has its own copy of the E8M0 rule (`{line}`): use the header's"
            );
        }
    }
}
