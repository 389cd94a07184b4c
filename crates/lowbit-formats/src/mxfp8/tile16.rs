//! MXFP8 of bf16 or f16 input, one 32x32 tile at a time, in 16-bit integer lanes.
//!
//! The key fact: a block's scale is an exact power of two `2^k`, so for a bf16 element `x` the
//! scaled value `x · 2^k` has x's 7 mantissa bits and x's exponent plus `k` (f16 alike, with 10
//! mantissa bits). Its fp8 code (round to nearest even, saturating) is then an integer function
//! of x's 16 bits and `k`: add the exponent change and the rounding increment to the bits,
//! shift, clamp. That runs 16 lanes per AVX2 instruction, against the 8 fp32 lanes of the
//! general encoder, and needs about a third of its instructions per element.
//!
//! The integer form covers every lane whose code is a normal fp8 number or zero. A block with a
//! lane that would be an fp8 subnormal, or with a subnormal input, is re-encoded through the
//! fp32 encoder, as is every block of a tile that holds a NaN or an infinity. So every byte is the
//! general path's byte; the tests check the integer form against the fp32 encoder on every bf16
//! and f16 pattern at every scale its block can have, and whole matrices against the f32-input
//! path.
//!
//! A 32x32 tile is 32 rowwise blocks (its rows) and 32 columnwise blocks (its columns), so one
//! pass over the tile (2 KiB, in L1) gives both copies' amaxes, and a second both encodings.

use super::{BLOCK, scale_of};
use crate::Half;
use crate::scalar::{Fp8Kind, e8m0_rcp};

/// The integer encoding rule of one fp8 kind for one 16-bit input format.
#[derive(Clone, Copy)]
pub(super) struct Rule {
    kind: Fp8Kind,
    input: Half,
    /// Mantissa bits of the input: 7 (bf16) or 10 (f16).
    mant: u32,
    /// Input mantissa bits dropped: bf16 4 (E4M3) or 5 (E5M2), f16 7 or 8.
    shift: u32,
    /// Largest finite code.
    max_code: u16,
    /// Smallest magnitude bits of an infinity; above are NaNs.
    inf: u16,
    /// Biased input exponent of the smallest normal fp8 value.
    e_min: i32,
    /// Biased input exponent of half the smallest subnormal: magnitudes up to it round to zero.
    e_zero: i32,
    /// `fl32(1 / max)`, TE's scale factor.
    rcp: f32,
}

impl Rule {
    #[inline(always)]
    fn of(kind: Fp8Kind, input: Half) -> Rule {
        let (mbits, max_code, min_normal_exp, half_min_sub_exp) = match kind {
            Fp8Kind::E4M3 => (3, 0x7E, -6, -10),
            Fp8Kind::E5M2 => (2, 0x7B, -14, -17),
        };
        let (mant, bias, inf) = match input {
            Half::Bf16 => (7, 127, 0x7F80),
            Half::F16 => (10, 15, 0x7C00),
        };
        Rule {
            kind,
            input,
            mant,
            shift: mant - mbits,
            max_code,
            inf,
            e_min: bias + min_normal_exp,
            e_zero: bias + half_min_sub_exp,
            rcp: kind.max_norm_rcp(),
        }
    }

    /// The value of an input bit pattern (exact).
    #[inline(always)]
    fn to_f32(self, b: u16) -> f32 {
        match self.input {
            Half::Bf16 => f32::from_bits(u32::from(b) << 16),
            Half::F16 => half::f16::from_bits(b).to_f32(),
        }
    }

    /// The lane constants for a block whose E8M0 scale is `e`, i.e. whose elements are
    /// multiplied by `2^(127 − e)`.
    #[inline(always)]
    fn lane(self, e: u8) -> Lane {
        let k = 127 - i32::from(e);
        // `bits + add` moves the exponent from fp32's bias to the fp8 code's (normal lanes only)
        // and adds the round-to-nearest increment below the kept bits.
        let add = ((k - (self.e_min - 1)) << self.mant) + (1 << (self.shift - 1)) - 1;
        Lane {
            // Wraps for large |k|; only lanes at or above `normal_from` use it, and for them the
            // true sum is in 0..0x10000.
            add: add as u16,
            // Input subnormals (below `1 << mant`) never count as normal: they lack the
            // implicit bit.
            normal_from: ((self.e_min - k) << self.mant).clamp(1 << self.mant, 0x7FFF) as i16,
            zero_upto: ((self.e_zero - k) << self.mant).clamp(0, 0x7FFF) as i16,
        }
    }
}

/// Per-scale constants of the integer encoding.
#[derive(Clone, Copy, Default)]
struct Lane {
    add: u16,
    /// Magnitude bits from which the code is a normal fp8 number.
    normal_from: i16,
    /// Magnitude bits up to which the code is (signed) zero.
    zero_upto: i16,
}

/// The scale-independent parts of a bf16 pattern's encoding.
#[derive(Clone, Copy)]
struct Parts {
    /// Magnitude bits; they fit in i16, so signed compares (one AVX2 instruction) order them.
    m: i16,
    /// The sign, at the fp8 code's sign bit.
    sign: u16,
    /// Magnitude bits plus the round-half-to-even bit (the lowest kept bit).
    rounded: u16,
}

#[inline(always)]
fn parts(b: u16, r: Rule) -> Parts {
    let a = b & 0x7FFF;
    Parts {
        m: a as i16,
        sign: (b >> 8) & 0x80,
        rounded: a.wrapping_add((a >> r.shift) & 1),
    }
}

/// The fp8 code of a bf16 pattern (not NaN or ±Inf) scaled by the power of two behind
/// `(add, nf, zu)`, and a nonzero flag when the code must come from the fp32 encoder instead (an fp8
/// subnormal, or a bf16 subnormal input).
#[inline(always)]
fn code(p: Parts, add: u16, nf: i16, zu: i16, r: Rule) -> (u8, u16) {
    let normal = (p.rounded.wrapping_add(add) >> r.shift).min(r.max_code);
    // All-ones masks, as the vector compares give them (no conversion to 0/1).
    let below_normal = (-i16::from(p.m < nf)) as u16;
    let above_zero = (-i16::from(p.m > zu)) as u16;
    (
        ((normal & !below_normal) | p.sign) as u8,
        below_normal & above_zero,
    )
}

/// Max of a row's magnitudes, as a tree of lane-wise maxima.
#[inline(always)]
fn row_max(a: &[u16; BLOCK]) -> u16 {
    let mut m = *a;
    let mut half = BLOCK / 2;
    while half > 0 {
        for i in 0..half {
            m[i] = m[i].max(m[i + half]);
        }
        half /= 2;
    }
    m[0]
}

/// The E8M0 scale of a block whose largest bf16 magnitude is `amax` (finite).
#[inline(always)]
fn scale(amax: u16, r: Rule) -> u8 {
    scale_of(r.to_f32(amax).to_bits(), r.rcp).0
}

/// [`scale`] of each amax (a plain loop: `array::from_fn` is not always inlined).
#[inline(always)]
fn scales_of(amax: &[u16; BLOCK], r: Rule) -> [u8; BLOCK] {
    let mut e = [0u8; BLOCK];
    for (e, &a) in e.iter_mut().zip(amax) {
        *e = scale(a, r);
    }
    e
}

/// The outputs of one band for the tile kernel: `(data, scales)` of each wanted copy, the data
/// `[32, cols]`, the rowwise scales `[32, cols / 32]`, the columnwise scales `[cols]`.
pub(super) struct BandOut<'a> {
    pub(super) row: Option<(&'a mut [u8], &'a mut [u8])>,
    pub(super) col: Option<(&'a mut [u8], &'a mut [u8])>,
}

/// Quantizes a band of exactly 32 rows of `cols` bf16 elements (`cols` a multiple of 32), tile
/// by tile; with `two_d`, one scale per tile, shared by both copies.
#[inline(always)]
pub(super) fn band(
    x: &[u16],
    input: Half,
    cols: usize,
    two_d: bool,
    kind: Fp8Kind,
    out: BandOut<'_>,
) {
    // One copy of the kernel per kind and input, so the shifts and clamps are immediates.
    match (kind, input) {
        (Fp8Kind::E4M3, Half::Bf16) => band_of::<false, false>(x, cols, two_d, out),
        (Fp8Kind::E5M2, Half::Bf16) => band_of::<true, false>(x, cols, two_d, out),
        (Fp8Kind::E4M3, Half::F16) => band_of::<false, true>(x, cols, two_d, out),
        (Fp8Kind::E5M2, Half::F16) => band_of::<true, true>(x, cols, two_d, out),
    }
}

#[inline(always)]
fn band_of<const E5M2: bool, const F16: bool>(
    x: &[u16],
    cols: usize,
    two_d: bool,
    mut out: BandOut<'_>,
) {
    let r = Rule::of(
        if E5M2 { Fp8Kind::E5M2 } else { Fp8Kind::E4M3 },
        if F16 { Half::F16 } else { Half::Bf16 },
    );
    debug_assert!(cols.is_multiple_of(BLOCK) && x.len() == BLOCK * cols);
    let nb = cols / BLOCK;
    for t in 0..nb {
        let c0 = t * BLOCK;
        let mut rmax = [0u16; BLOCK];
        let mut cmax = [0u16; BLOCK];
        for (i, rm) in rmax.iter_mut().enumerate() {
            let row = row_at(x, i * cols + c0);
            let mut a = [0u16; BLOCK];
            for j in 0..BLOCK {
                a[j] = row[j] & 0x7FFF;
                cmax[j] = cmax[j].max(a[j]);
            }
            *rm = row_max(&a);
        }
        let tile_max = row_max(&cmax);
        if tile_max >= r.inf {
            // A NaN or an infinity: the fp32 path's amax ignores NaN, and the integer form
            // assumes finite inputs.
            tile_fp32(x, cols, c0, two_d, r, &mut out);
            continue;
        }
        if two_d {
            let e = scale(tile_max, r);
            let (primary, secondary) = match (out.row.as_mut(), out.col.as_mut()) {
                (Some(row), col) => (row, col),
                (None, Some(col)) => (col, None),
                (None, None) => return,
            };
            encode_tile::<true, false>(
                x,
                cols,
                c0,
                &[e; BLOCK],
                &[e; BLOCK],
                r,
                primary.0,
                &mut [],
            );
            if let Some(sec) = secondary {
                for i in 0..BLOCK {
                    let at = i * cols + c0;
                    sec.0[at..at + BLOCK].copy_from_slice(&primary.0[at..at + BLOCK]);
                }
            }
            if let Some((_, s)) = out.row.as_mut() {
                for i in 0..BLOCK {
                    s[i * nb + t] = e;
                }
            }
            if let Some((_, s)) = out.col.as_mut() {
                s[c0..c0 + BLOCK].fill(e);
            }
            continue;
        }
        // Scales only for the copies wanted (the column amaxes still served the NaN/Inf check).
        let re = if out.row.is_some() {
            scales_of(&rmax, r)
        } else {
            [0; BLOCK]
        };
        let ce = if out.col.is_some() {
            scales_of(&cmax, r)
        } else {
            [0; BLOCK]
        };
        match (out.row.as_mut(), out.col.as_mut()) {
            (Some((rd, _)), Some((cd, _))) => {
                encode_tile::<true, true>(x, cols, c0, &re, &ce, r, rd, cd)
            }
            (Some((rd, _)), None) => {
                encode_tile::<true, false>(x, cols, c0, &re, &ce, r, rd, &mut [])
            }
            (None, Some((cd, _))) => {
                encode_tile::<false, true>(x, cols, c0, &re, &ce, r, &mut [], cd)
            }
            (None, None) => {}
        }
        if let Some((_, scales)) = out.row.as_mut() {
            for (i, &e) in re.iter().enumerate() {
                scales[i * nb + t] = e;
            }
        }
        if let Some((_, scales)) = out.col.as_mut() {
            scales[c0..c0 + BLOCK].copy_from_slice(&ce);
        }
    }
}

/// Lane constants of 32 scales, as three arrays (the layout the encoder loads).
#[derive(Clone, Copy, Default)]
struct Lanes {
    add: [u16; BLOCK],
    nf: [i16; BLOCK],
    zu: [i16; BLOCK],
}

impl Lanes {
    #[inline(always)]
    fn of(e: &[u8; BLOCK], r: Rule) -> Lanes {
        let mut l = Lanes {
            add: [0; BLOCK],
            nf: [0; BLOCK],
            zu: [0; BLOCK],
        };
        for (j, &e) in e.iter().enumerate() {
            let one = r.lane(e);
            (l.add[j], l.nf[j], l.zu[j]) = (one.add, one.normal_from, one.zero_upto);
        }
        l
    }
}

/// The rowwise (`ROW`, row `i` with scale `re[i]`) and columnwise (`COL`, column `j` with scale
/// `ce[j]`) codes of a tile, into `rd` / `cd` at `i * cols + c0 + j`. Both copies come from one
/// load of each row and share its magnitude, sign and rounding bit.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn encode_tile<const ROW: bool, const COL: bool>(
    x: &[u16],
    cols: usize,
    c0: usize,
    re: &[u8; BLOCK],
    ce: &[u8; BLOCK],
    r: Rule,
    rd: &mut [u8],
    cd: &mut [u8],
) {
    let rl = if ROW {
        Lanes::of(re, r)
    } else {
        Lanes::default()
    };
    let cl = if COL {
        Lanes::of(ce, r)
    } else {
        Lanes::default()
    };
    let mut rslow = [0u16; BLOCK];
    let mut cslow = [0u16; BLOCK];
    for i in 0..BLOCK {
        let at = i * cols + c0;
        let row = row_at(x, at);
        let mut ro = [0u8; BLOCK];
        let mut co = [0u8; BLOCK];
        for j in 0..BLOCK {
            let p = parts(row[j], r);
            if ROW {
                let (c, slow) = code(p, rl.add[i], rl.nf[i], rl.zu[i], r);
                ro[j] = c;
                rslow[j] |= slow;
            }
            if COL {
                let (c, slow) = code(p, cl.add[j], cl.nf[j], cl.zu[j], r);
                co[j] = c;
                cslow[j] |= slow;
            }
        }
        if ROW {
            out_at(rd, at).copy_from_slice(&ro);
        }
        if COL {
            out_at(cd, at).copy_from_slice(&co);
        }
    }
    // Rare: blocks with a lane the integer form hands back are re-encoded in fp32. A row's
    // flags were OR-ed per column above, so the flagged rows are found again.
    if ROW && row_max(&rslow) != 0 {
        for (i, &e) in re.iter().enumerate() {
            let at = i * cols + c0;
            let row = row_at(x, at);
            let mut flags = [0u16; BLOCK];
            for (f, &b) in flags.iter_mut().zip(row) {
                *f = code(parts(b, r), rl.add[i], rl.nf[i], rl.zu[i], r).1;
            }
            if row_max(&flags) != 0 {
                let s = e8m0_rcp(e);
                for (o, &b) in out_at(rd, at).iter_mut().zip(row) {
                    *o = r.kind.encode(r.to_f32(b) * s);
                }
            }
        }
    }
    if COL && row_max(&cslow) != 0 {
        for j in (0..BLOCK).filter(|&j| cslow[j] != 0) {
            let s = e8m0_rcp(ce[j]);
            for i in 0..BLOCK {
                let at = i * cols + c0 + j;
                cd[at] = r.kind.encode(r.to_f32(x[at]) * s);
            }
        }
    }
}

/// The 32 elements of `x` from `at`.
#[inline(always)]
fn row_at(x: &[u16], at: usize) -> &[u16; BLOCK] {
    x[at..at + BLOCK].try_into().expect("32 wide")
}

/// The 32 output bytes of `data` from `at`.
#[inline(always)]
fn out_at(data: &mut [u8], at: usize) -> &mut [u8; BLOCK] {
    (&mut data[at..at + BLOCK]).try_into().expect("32 wide")
}

/// A tile with a NaN or an infinity, through the fp32 encoder with TE's NaN-ignoring amax.
#[cold]
fn tile_fp32(x: &[u16], cols: usize, c0: usize, two_d: bool, r: Rule, out: &mut BandOut<'_>) {
    let nb = cols / BLOCK;
    let t = c0 / BLOCK;
    let at = |i: usize, j: usize| i * cols + c0 + j;
    let mag = |i: usize, j: usize| crate::abs_bits_nan_zero(r.to_f32(x[at(i, j)]));
    let rmax: Vec<u32> = (0..BLOCK)
        .map(|i| (0..BLOCK).map(|j| mag(i, j)).fold(0, u32::max))
        .collect();
    let cmax: Vec<u32> = (0..BLOCK)
        .map(|j| (0..BLOCK).map(|i| mag(i, j)).fold(0, u32::max))
        .collect();
    let tile = rmax.iter().copied().fold(0, u32::max);
    let enc = |v: u16, s: f32| r.kind.encode(r.to_f32(v) * s);
    if let Some((data, scales)) = out.row.as_mut() {
        for i in 0..BLOCK {
            let (e, s) = scale_of(if two_d { tile } else { rmax[i] }, r.rcp);
            scales[i * nb + t] = e;
            for j in 0..BLOCK {
                data[at(i, j)] = enc(x[at(i, j)], s);
            }
        }
    }
    if let Some((data, scales)) = out.col.as_mut() {
        for j in 0..BLOCK {
            let (e, s) = scale_of(if two_d { tile } else { cmax[j] }, r.rcp);
            scales[c0 + j] = e;
            for i in 0..BLOCK {
                data[at(i, j)] = enc(x[at(i, j)], s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The integer form equals the fp32 encoder on every finite bf16 and f16 pattern at every
    /// scale its block can have wherever it does not hand the lane back, and hands back only lanes below the
    /// smallest normal fp8 value or with a subnormal input (never a normal code of a normal
    /// input).
    #[test]
    fn integer_form_matches_the_fp32_encoder_everywhere() {
        for input in [Half::Bf16, Half::F16] {
            for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
                let r = Rule::of(kind, input);
                let min_normal = f32::from_bits(((r.e_min - bias(input) + 127) as u32) << 23);
                let sub_max = (1u16 << r.mant) - 1;
                for e in 0..=0xFEu8 {
                    let l = r.lane(e);
                    let s = e8m0_rcp(e);
                    for b in 0..=u16::MAX {
                        // Finite inputs, at every scale a block holding them can have: one
                        // whose amax is at least |x| (so the scaled value is at most ~max).
                        if b & 0x7FFF >= r.inf || e < scale(b & 0x7FFF, r) {
                            continue;
                        }
                        let (c, slow) = code(parts(b, r), l.add, l.normal_from, l.zero_upto, r);
                        let slow = slow != 0;
                        let y = r.to_f32(b) * s;
                        let want = kind.encode(y);
                        let a = b & 0x7FFF;
                        let sub_in = a != 0 && a <= sub_max;
                        if slow {
                            assert!(
                                sub_in || y.abs() < min_normal,
                                "{input:?} {kind:?} e={e:#x} b={b:#06x} y={y:e}"
                            );
                        } else {
                            assert_eq!(c, want, "{input:?} {kind:?} e={e:#x} b={b:#06x} y={y:e}");
                        }
                    }
                }
            }
        }
    }

    fn bias(input: Half) -> i32 {
        match input {
            Half::Bf16 => 127,
            Half::F16 => 15,
        }
    }
}
