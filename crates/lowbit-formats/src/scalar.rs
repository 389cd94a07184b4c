//! Scalar codecs: E4M3, E5M2, E2M1, E8M0 and UE4M3 (the NVFP4 block scale).
//!
//! Every encoder is a branch-free bit manipulation of the fp32 input so the block loops above it
//! vectorise; each one reproduces the CUDA conversion that Transformer Engine uses
//! (`cvt.rn.satfinite.*` for the element types — `__nv_cvt_float_to_fp8` in `cuda_fp8.h`,
//! `__nv_cvt_float_to_fp4` in `cuda_fp4.h` —, `cvt.rp.satfinite.ue8m0` for E8M0, TE's
//! `ptx::float_to_e8m0`), as pinned by the probe tables in `tests/golden.rs` (printed by those
//! conversions on an H100, reproduced there).

/// Largest finite E4M3 value (`0x7E`).
pub const E4M3_MAX: f32 = 448.0;
/// Largest finite E5M2 value (`0x7B`).
pub const E5M2_MAX: f32 = 57344.0;
/// Largest E2M1 value (`0x7`).
pub const E2M1_MAX: f32 = 6.0;
/// The canonical NaN byte written by every fp8 encoder (CUDA and PyTorch emit `0x7F`).
pub const FP8_NAN: u8 = 0x7F;

/// f32 bit pattern of +Inf; magnitudes above it are NaN.
const F32_INF_BITS: u32 = 0x7F80_0000;

/// Round-to-nearest-even of an fp32 magnitude `a` (bits, sign cleared, not NaN) to a small float
/// with `mbits` mantissa bits and exponent bias `bias`, with no saturation applied yet.
///
/// Normal results: add the rounding increment to the bits and shift (carries into the exponent
/// are exactly the rounding-up cases). Subnormal results: add a power of two whose ulp equals the
/// target's subnormal spacing, letting the fp32 adder round to nearest even.
#[inline(always)]
fn rne_magnitude(a: u32, mbits: u32, bias: u32) -> u32 {
    let shift = 23 - mbits;
    let min_normal_bits = (127 - bias + 1) << 23;
    let odd = (a >> shift) & 1;
    // Wrapping: below the normal range this lane is discarded by the select at the end.
    let normal = ((a + (1 << (shift - 1)) - 1 + odd) >> shift).wrapping_sub((127 - bias) << mbits);
    // Subnormal spacing is 2^(1 - bias - mbits); the fp32 number with that ulp is 2^(24 - bias - mbits).
    let magic = f32::from_bits((127 + 24 - bias - mbits) << 23);
    let sub = (f32::from_bits(a) + magic).to_bits() - magic.to_bits();
    if a >= min_normal_bits { normal } else { sub }
}

/// fp32 → E4M3 (`e4m3fn`): round to nearest even, saturating (overflow and ±Inf → ±448),
/// NaN → `0x7F`, −0 and subnormals kept.
#[inline(always)]
pub fn e4m3_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    let sign = (bits >> 24) & 0x80;
    let code = rne_magnitude(a.min(0x4400_0000), 3, 7).min(0x7E);
    if a > F32_INF_BITS {
        FP8_NAN
    } else {
        (code | sign) as u8
    }
}

/// fp32 → E5M2: round to nearest even, saturating (overflow and ±Inf → ±57344), NaN → `0x7F`,
/// −0 and subnormals kept.
#[inline(always)]
pub fn e5m2_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    let sign = (bits >> 24) & 0x80;
    let code = rne_magnitude(a.min(0x4800_0000), 2, 15).min(0x7B);
    if a > F32_INF_BITS {
        FP8_NAN
    } else {
        (code | sign) as u8
    }
}

/// fp32 → E2M1 nibble: round to nearest even, saturating to ±6, NaN → `0x7` (+6, as CUDA's
/// `cvt.rn.satfinite.e2m1x2` does), −0 → `0x8`.
#[inline(always)]
pub fn e2m1_from_f32(x: f32) -> u8 {
    let bits = x.to_bits();
    let a = bits & 0x7FFF_FFFF;
    let sign = (bits >> 28) & 0x8;
    let code = rne_magnitude(a.min(0x4100_0000), 1, 1).min(0x7);
    if a > F32_INF_BITS {
        0x7
    } else {
        (code | sign) as u8
    }
}

/// Non-negative fp32 → UE4M3 NVFP4 block scale: the E4M3 encoder (TE calls the same
/// `cvt.rn.satfinite.e4m3x2`). Inputs are block amaxes times a positive factor, so the sign bit
/// stays clear for every input TE can produce.
#[inline(always)]
pub fn ue4m3_from_f32(x: f32) -> u8 {
    e4m3_from_f32(x)
}

/// fp32 → E8M0 with TE's rule (`cvt.rp.satfinite.ue8m0x2.f32`): the smallest power of two ≥ |x|,
/// clamped to [2^-127, 2^127]; NaN → `0xFF`, ±Inf → `0xFE`, zero → `0x00`. The sign is ignored.
#[inline(always)]
pub fn e8m0_from_f32(x: f32) -> u8 {
    let a = x.to_bits() & 0x7FFF_FFFF;
    let exp = a >> 23;
    let mant = a & 0x7F_FFFF;
    // Round up when any mantissa bit is set, except at the top exponent (saturate) and for
    // subnormals at or below 2^-127 (which are already representable by code 0).
    let round_up = u32::from(mant != 0 && exp != 0xFE && !(exp == 0 && mant <= 0x40_0000));
    let code = (exp + round_up).min(0xFE);
    if a > F32_INF_BITS { 0xFF } else { code as u8 }
}

/// E8M0 → fp32: `2^(b − 127)`; `0x00` is the fp32 subnormal 2^-127, `0xFF` is NaN.
#[inline(always)]
pub fn e8m0_to_f32(b: u8) -> f32 {
    match b {
        0x00 => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        _ => f32::from_bits(u32::from(b) << 23),
    }
}

/// The exact reciprocal `2^(127 − e)` of an E8M0 scale as TE's `exp2f_rcp` computes it:
/// `0xFE` → 2^-127 (subnormal), `0xFF` → NaN.
#[inline(always)]
pub fn e8m0_rcp(e: u8) -> f32 {
    match e {
        0xFE => f32::from_bits(0x0040_0000),
        0xFF => f32::NAN,
        _ => f32::from_bits((254 - u32::from(e)) << 23),
    }
}

/// Decodes every byte of an 8-bit float with `mbits` mantissa bits and exponent bias `bias`;
/// codes whose exponent field is all ones are left to the caller's special cases.
const fn small_float_table(mbits: u32, bias: u32) -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut b = 0u32;
    while b < 256 {
        let exp = (b & 0x7F) >> mbits;
        let mant = b & ((1 << mbits) - 1);
        let mag = if exp == 0 {
            // Subnormal: mant · 2^(1 − bias − mbits), exact in fp32.
            mant as f32 * f32::from_bits((127 + 1 - bias - mbits) << 23)
        } else {
            f32::from_bits(((exp + 127 - bias) << 23) | (mant << (23 - mbits)))
        };
        t[b as usize] = if b & 0x80 != 0 { -mag } else { mag };
        b += 1;
    }
    t
}

/// fp32 value of every E4M3 code (`0x7F` and `0xFF` are NaN; there is no infinity).
pub const E4M3_VALUES: [f32; 256] = {
    let mut t = small_float_table(3, 7);
    t[0x7F] = f32::NAN;
    t[0xFF] = f32::NAN;
    t
};

/// fp32 value of every E5M2 code (`0x7C` is +Inf, `0x7D..=0x7F` NaN, likewise with the sign).
pub const E5M2_VALUES: [f32; 256] = {
    let mut t = small_float_table(2, 15);
    t[0x7C] = f32::INFINITY;
    t[0xFC] = f32::NEG_INFINITY;
    let mut b = 0x7D;
    while b <= 0x7F {
        t[b] = f32::NAN;
        t[b | 0x80] = f32::NAN;
        b += 1;
    }
    t
};

/// E4M3 → fp32.
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    E4M3_VALUES[usize::from(b)]
}

/// E5M2 → fp32.
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    E5M2_VALUES[usize::from(b)]
}

/// E2M1 values of the 16 nibble codes.
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E2M1 nibble (low four bits of `b`) → fp32.
#[inline(always)]
pub fn e2m1_to_f32(b: u8) -> f32 {
    E2M1_VALUES[usize::from(b & 0xF)]
}

/// Element type of an MXFP8 tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8Kind {
    /// E4M3 (`e4m3fn`): max 448, no infinity. TE's default for weights and activations.
    E4M3,
    /// E5M2: max 57344, with infinities. TE's choice for gradients in some recipes.
    E5M2,
}

impl Fp8Kind {
    /// Largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Kind::E4M3 => E4M3_MAX,
            Fp8Kind::E5M2 => E5M2_MAX,
        }
    }

    /// TE's `max_norm_rcp`: `1.0 / max` evaluated in double and stored as float
    /// (`0x3B124925` for E4M3). It is above 1/448, so `448 · rcp` rounds to exactly 1.
    pub fn max_norm_rcp(self) -> f32 {
        (1.0f64 / f64::from(self.max())) as f32
    }

    /// Encodes one fp32 value.
    #[inline(always)]
    pub fn encode(self, x: f32) -> u8 {
        match self {
            Fp8Kind::E4M3 => e4m3_from_f32(x),
            Fp8Kind::E5M2 => e5m2_from_f32(x),
        }
    }

    /// Decodes one byte.
    #[inline]
    pub fn decode(self, b: u8) -> f32 {
        match self {
            Fp8Kind::E4M3 => e4m3_to_f32(b),
            Fp8Kind::E5M2 => e5m2_to_f32(b),
        }
    }

    /// The safetensors dtype name of this element type.
    pub fn safetensors_name(self) -> &'static str {
        match self {
            Fp8Kind::E4M3 => "F8_E4M3",
            Fp8Kind::E5M2 => "F8_E5M2",
        }
    }
}
