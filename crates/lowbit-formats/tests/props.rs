//! Invariants of the codecs and quantizers, checked with proptest and against slow references.

use lowbit_formats::layout::{
    swizzle, swizzle_mxfp8_columnwise, swizzle_offset, swizzled_dims, unswizzle,
    unswizzle_mxfp8_columnwise,
};
use lowbit_formats::nvfp4::e2m1_stochastic;
use lowbit_formats::scalar::{
    E2M1_VALUES, E4M3_VALUES, E5M2_VALUES, e2m1_from_f32, e4m3_from_f32, e4m3_to_f32,
    e5m2_from_f32, e8m0_from_f32, e8m0_to_f32,
};
use lowbit_formats::{
    Copies, Fp8Kind, Matrix, Mxfp8Config, Mxfp8Tensor, Nvfp4Config, Nvfp4Tensor, QuantPlane,
    Source, bf16, f16, quantize_mxfp8, quantize_nvfp4,
};
use proptest::prelude::*;

/// Slow reference: round-to-nearest-even over an explicit table of non-negative codes
/// `0..=max_code`, saturating; the sign is copied (so negative values that round to 0 give −0).
fn reference_encode(x: f32, values: &[f32], max_code: u8, sign_bit: u8, nan_code: u8) -> u8 {
    if x.is_nan() {
        return nan_code;
    }
    let a = f64::from(x.abs()).min(f64::from(values[usize::from(max_code)]));
    let mut best = 0u8;
    for c in 1..=max_code {
        let (dc, db) = (
            (f64::from(values[usize::from(c)]) - a).abs(),
            (f64::from(values[usize::from(best)]) - a).abs(),
        );
        if dc < db || (dc == db && c % 2 == 0) {
            best = c;
        }
    }
    best | if x.is_sign_negative() { sign_bit } else { 0 }
}

/// Every code's value, every midpoint between neighbours, and their fp32 neighbours: the inputs
/// where rounding decisions happen.
fn interesting_inputs(values: &[f32], max_code: u8) -> Vec<f32> {
    let mut out = vec![
        0.0,
        f32::MAX,
        f32::INFINITY,
        f32::MIN_POSITIVE,
        f32::from_bits(1),
    ];
    for c in 0..max_code {
        let (lo, hi) = (values[usize::from(c)], values[usize::from(c + 1)]);
        for v in [lo, (lo + hi) / 2.0, hi] {
            out.extend([
                v,
                f32::from_bits(v.to_bits() + 1),
                f32::from_bits(v.to_bits().max(1) - 1),
            ]);
        }
    }
    let top = values[usize::from(max_code)];
    out.extend([top * 1.03125, top * 1.0625, top * 1.125, top * 2.0]);
    let neg: Vec<f32> = out.iter().map(|v| -v).collect();
    out.extend(neg);
    out
}

#[test]
fn element_encoders_match_the_reference_at_every_decision_point() {
    type Case = (&'static str, fn(f32) -> u8, &'static [f32], u8, u8, u8);
    let e2m1: &'static [f32] = &E2M1_VALUES;
    let cases: [Case; 3] = [
        ("e4m3", e4m3_from_f32, &E4M3_VALUES, 0x7e, 0x80, 0x7f),
        ("e5m2", e5m2_from_f32, &E5M2_VALUES, 0x7b, 0x80, 0x7f),
        ("e2m1", e2m1_from_f32, e2m1, 0x7, 0x8, 0x7),
    ];
    for (name, enc, values, max_code, sign, nan) in cases {
        for x in interesting_inputs(values, max_code) {
            assert_eq!(
                enc(x),
                reference_encode(x, values, max_code, sign, nan),
                "{name}({x:e})"
            );
        }
    }
}

#[test]
fn element_encoders_match_the_reference_on_a_sweep_of_bit_patterns() {
    // 2^32 / 65537 ≈ 65k patterns spread over every exponent and sign.
    for bits in (0..=u32::MAX).step_by(65_537) {
        let x = f32::from_bits(bits);
        assert_eq!(
            e4m3_from_f32(x),
            reference_encode(x, &E4M3_VALUES, 0x7e, 0x80, 0x7f),
            "{x:e}"
        );
        assert_eq!(
            e5m2_from_f32(x),
            reference_encode(x, &E5M2_VALUES, 0x7b, 0x80, 0x7f),
            "{x:e}"
        );
        assert_eq!(
            e2m1_from_f32(x),
            reference_encode(x, &E2M1_VALUES, 0x7, 0x8, 0x7),
            "{x:e}"
        );
    }
}

proptest! {
    /// E8M0 encode is "smallest power of two ≥ |x|", clamped to [2^-127, 2^127].
    #[test]
    fn e8m0_is_the_smallest_covering_power_of_two(bits in 0u32..0x7f80_0000) {
        let x = f32::from_bits(bits);
        let e = e8m0_from_f32(x);
        let v = f64::from(e8m0_to_f32(e));
        let xa = f64::from(x);
        if xa <= 2f64.powi(127) {
            prop_assert!(v >= xa);
            prop_assert!(e == 0 || v / 2.0 < xa, "{x:e} → {e:#x}");
        } else {
            prop_assert_eq!(e, 0xfe);
        }
    }
}

fn mx(rows: usize, cols: usize, x: &[f32], cfg: Mxfp8Config) -> Mxfp8Tensor {
    quantize_mxfp8(&Matrix::new("t", rows, cols, Source::F32(x)).unwrap(), &cfg).unwrap()
}

fn nv(rows: usize, cols: usize, x: &[f32], cfg: Nvfp4Config) -> Nvfp4Tensor {
    quantize_nvfp4(&Matrix::new("t", rows, cols, Source::F32(x)).unwrap(), &cfg).unwrap()
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..rows * cols)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

fn transpose_plane_bytes(p: &QuantPlane) -> (Vec<u8>, Vec<u8>) {
    let t = |m: &[u8], [r, c]: [usize; 2]| lowbit_formats::layout::transpose(m, r, c);
    (t(&p.data, p.data_shape), t(&p.scales, p.scale_shape))
}

fn unpack_nibbles(p: &QuantPlane, cols: usize) -> Vec<u8> {
    let [rows, rb] = p.data_shape;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let b = p.data[r * rb + c / 2];
            out.push(if c % 2 == 0 { b & 0xf } else { b >> 4 });
        }
    }
    out
}

/// A matrix of log-normal-ish magnitudes with random signs, spanning many binades.
fn matrix() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..70, 1usize..70).prop_flat_map(|(r, c)| {
        let elem = (any::<bool>(), -12i32..12, 0u32..(1 << 23)).prop_map(|(s, e, m)| {
            let v = f32::from_bits(((127 + e) as u32) << 23 | m);
            if s { -v } else { v }
        });
        (Just(r), Just(c), proptest::collection::vec(elem, r * c))
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Values already on the MXFP8 grid (fp8 codes times a power of two) quantize exactly.
    #[test]
    fn mxfp8_grid_values_are_exact(
        codes in proptest::collection::vec(0u8..=255, 64),
        k in -100i32..100,
        e5 in any::<bool>(),
    ) {
        let kind = if e5 { Fp8Kind::E5M2 } else { Fp8Kind::E4M3 };
        let x: Vec<f32> = codes
            .iter()
            .map(|&c| kind.decode(c))
            .map(|v| if v.is_finite() { v * 2f32.powi(k) } else { 0.0 })
            .collect();
        let t = mx(2, 32, &x, Mxfp8Config { kind, ..Default::default() });
        prop_assert_eq!(t.dequantize_rowwise().unwrap(), x.clone());
        // Columnwise: the same grid values as 32x2 columns.
        let xt = transpose(&x, 2, 32);
        let t = mx(32, 2, &xt, Mxfp8Config { kind, ..Default::default() });
        prop_assert_eq!(t.dequantize_columnwise().unwrap(), xt);
    }

    /// Per element: |x − x̂| ≤ half an ulp of the element format at the block's scale.
    #[test]
    fn mxfp8_error_is_bounded_per_block((rows, cols, x) in matrix(), e5 in any::<bool>()) {
        let kind = if e5 { Fp8Kind::E5M2 } else { Fp8Kind::E4M3 };
        // (relative half-ulp of normals, absolute half-spacing of subnormals) in scaled units
        let (rel, sub) = if e5 { (0.125, 2f32.powi(-17)) } else { (0.0625, 2f32.powi(-10)) };
        let t = mx(rows, cols, &x, Mxfp8Config { kind, ..Default::default() });
        let nb = cols.div_ceil(32);
        let (dr, dc) = (t.dequantize_rowwise().unwrap(), t.dequantize_columnwise().unwrap());
        let (rs, cs) = (&t.rowwise.as_ref().unwrap().scales, &t.columnwise.as_ref().unwrap().scales);
        for i in 0..rows * cols {
            let (r, c) = (i / cols, i % cols);
            let s_row = e8m0_to_f32(rs[r * nb + c / 32]);
            let s_col = e8m0_to_f32(cs[(r / 32) * cols + c]);
            prop_assert!((x[i] - dr[i]).abs() <= rel * x[i].abs() + sub * s_row, "row {} {}", x[i], dr[i]);
            prop_assert!((x[i] - dc[i]).abs() <= rel * x[i].abs() + sub * s_col, "col {} {}", x[i], dc[i]);
        }
    }

    /// The columnwise copy of X is the rowwise copy of Xᵀ, transposed (MXFP8 and NVFP4).
    #[test]
    fn columnwise_of_x_is_rowwise_of_x_transposed((rows, cols, x) in matrix()) {
        let xt = transpose(&x, rows, cols);
        let a = mx(rows, cols, &x, Mxfp8Config::default());
        let b = mx(cols, rows, &xt, Mxfp8Config::default());
        let (data, scales) = transpose_plane_bytes(a.columnwise.as_ref().unwrap());
        let brw = b.rowwise.as_ref().unwrap();
        prop_assert_eq!(&data, &brw.data);
        prop_assert_eq!(&scales, &brw.scales);

        let a = nv(rows, cols, &x, Nvfp4Config::default());
        let b = nv(cols, rows, &xt, Nvfp4Config::default());
        prop_assert_eq!(a.columnwise.as_ref().unwrap(), b.rowwise.as_ref().unwrap());
    }

    /// 2D scaling: both copies hold the same bytes and every scale is its tile's.
    #[test]
    fn two_d_copies_agree((rows, cols, x) in matrix()) {
        let t = mx(rows, cols, &x, Mxfp8Config { two_d: true, ..Default::default() });
        let (rw, cw) = (t.rowwise.as_ref().unwrap(), t.columnwise.as_ref().unwrap());
        prop_assert_eq!(&rw.data, &cw.data);
        let nb = cols.div_ceil(32);
        for r in 0..rows {
            for c in 0..cols {
                prop_assert_eq!(rw.scales[r * nb + c / 32], cw.scales[(r / 32) * cols + c]);
                prop_assert_eq!(rw.scales[r * nb + c / 32], rw.scales[(r / 32 * 32) * nb + c / 32]);
            }
        }
        let t = nv(rows, cols, &x, Nvfp4Config { two_d: true, ..Default::default() });
        let (rw, cw) = (t.rowwise.as_ref().unwrap(), t.columnwise.as_ref().unwrap());
        let (rcodes, ccodes) = (unpack_nibbles(rw, cols), unpack_nibbles(cw, rows));
        let (nbr, nbc) = (cols.div_ceil(16), rows.div_ceil(16));
        for r in 0..rows {
            for c in 0..cols {
                prop_assert_eq!(rcodes[r * cols + c], ccodes[c * rows + r]);
                prop_assert_eq!(rw.scales[r * nbr + c / 16], cw.scales[c * nbc + r / 16]);
            }
        }
    }

    /// Partial edge blocks take the amax of the elements that exist: zero-padding the matrix to
    /// whole blocks changes no byte of the real region.
    #[test]
    fn edge_blocks_ignore_missing_elements((rows, cols, x) in matrix()) {
        let (pr, pc) = (rows.div_ceil(32) * 32, cols.div_ceil(32) * 32);
        let mut padded = vec![0f32; pr * pc];
        for r in 0..rows {
            padded[r * pc..r * pc + cols].copy_from_slice(&x[r * cols..(r + 1) * cols]);
        }
        let a = mx(rows, cols, &x, Mxfp8Config::default());
        let b = mx(pr, pc, &padded, Mxfp8Config::default());
        let (ar, br) = (a.rowwise.as_ref().unwrap(), b.rowwise.as_ref().unwrap());
        let (ac, bc) = (a.columnwise.as_ref().unwrap(), b.columnwise.as_ref().unwrap());
        for r in 0..rows {
            prop_assert_eq!(&ar.data[r * cols..(r + 1) * cols], &br.data[r * pc..r * pc + cols]);
            prop_assert_eq!(&ac.data[r * cols..(r + 1) * cols], &bc.data[r * pc..r * pc + cols]);
            let nb = cols.div_ceil(32);
            prop_assert_eq!(&ar.scales[r * nb..(r + 1) * nb], &br.scales[r * (pc / 32)..r * (pc / 32) + nb]);
        }
        let a = nv(rows, cols, &x, Nvfp4Config::default());
        let b = nv(pr, pc, &padded, Nvfp4Config::default());
        let (ar, br) = (a.rowwise.as_ref().unwrap(), b.rowwise.as_ref().unwrap());
        let (acodes, bcodes) = (unpack_nibbles(ar, cols), unpack_nibbles(br, pc));
        for r in 0..rows {
            prop_assert_eq!(&acodes[r * cols..(r + 1) * cols], &bcodes[r * pc..r * pc + cols]);
        }
    }

    /// The result does not depend on the thread count.
    #[test]
    fn thread_count_does_not_change_bytes((rows, cols, x) in matrix(), seed in any::<u64>()) {
        let one = Mxfp8Config::default();
        prop_assert_eq!(mx(rows, cols, &x, one), mx(rows, cols, &x, Mxfp8Config { threads: 3, ..one }));
        let one = Nvfp4Config { stochastic_rounding: Some(seed), ..Default::default() };
        prop_assert_eq!(nv(rows, cols, &x, one), nv(rows, cols, &x, Nvfp4Config { threads: 3, ..one }));
    }

    /// NVFP4 values on the grid (every block holds ±6·2^k, the tensor amax is 6·2^k) quantize
    /// exactly: scale 448 (`0x7E`) and the input's own codes. (Dequantization multiplies by TE's
    /// `amax · fl32(1/2688)`, which is not exact, so the check is on the bytes.)
    #[test]
    fn nvfp4_grid_values_are_exact(
        mut codes in proptest::collection::vec(0u8..16, 4 * 32),
        k in -20i32..20,
    ) {
        for b in codes.chunks_mut(16) {
            b[0] = 0x7;
        }
        let x: Vec<f32> = codes.iter().map(|&c| E2M1_VALUES[usize::from(c)] * 2f32.powi(k)).collect();
        let t = nv(4, 32, &x, Nvfp4Config::default());
        let (rw, cw) = (t.rowwise.as_ref().unwrap(), t.columnwise.as_ref().unwrap());
        prop_assert!(rw.scales.iter().all(|&s| s == 0x7e));
        prop_assert_eq!(unpack_nibbles(rw, 32), codes.clone());
        let ct = unpack_nibbles(cw, 4);
        for i in 0..4 * 32 {
            // Columnwise blocks run down the columns and hold no forced 6: only check values
            // whose block amax is 6·2^k again.
            let (r, c) = (i / 32, i % 32);
            let col_has_six = (0..4).any(|rr| codes[rr * 32 + c] & 0x7 == 0x7);
            if col_has_six {
                prop_assert_eq!(ct[c * 4 + r], codes[i]);
            }
        }
    }

    /// NVFP4 per element: |x − x̂| ≤ half the top grid step (1 unit) at the block's decode scale,
    /// plus what saturation at ±6 units cuts off (large when the E4M3 scale is subnormal and
    /// rounded down); blocks whose scale underflowed are below E4M3's smallest half-step.
    #[test]
    fn nvfp4_error_is_bounded_per_block((rows, cols, x) in matrix()) {
        let t = nv(rows, cols, &x, Nvfp4Config { copies: Copies::Rowwise, ..Default::default() });
        let d = t.dequantize_rowwise().unwrap();
        let rw = t.rowwise.as_ref().unwrap();
        let global = t.amax_rowwise / 2688.0;
        let nb = cols.div_ceil(16);
        for i in 0..rows * cols {
            let sf = e4m3_to_f32(rw.scales[(i / cols) * nb + (i % cols) / 16]);
            let unit = sf * global;
            let bound = if sf == 0.0 {
                6.0 * 2f32.powi(-10) * global
            } else {
                unit + (x[i].abs() - 6.0 * unit).max(0.0)
            };
            prop_assert!((x[i] - d[i]).abs() <= bound * 1.0001, "{} vs {} (bound {})", x[i], d[i], bound);
        }
    }

    /// The swizzle is a bijection of the padded index space and unswizzle inverts it.
    #[test]
    fn swizzle_is_a_bijection(rows in 1usize..300, cols in 1usize..20, fill in any::<u8>()) {
        let (pr, pc) = swizzled_dims(rows, cols);
        let mut seen = vec![false; pr * pc];
        for r in 0..pr {
            for c in 0..pc {
                let o = swizzle_offset(r, c, cols);
                prop_assert!(!seen[o]);
                seen[o] = true;
            }
        }
        prop_assert!(seen.iter().all(|&s| s));
        let s: Vec<u8> = (0..rows * cols).map(|i| (i as u8) ^ fill | 1).collect();
        let z = swizzle(&s, rows, cols);
        prop_assert_eq!(z.iter().filter(|&&b| b == 0).count(), pr * pc - rows * cols);
        prop_assert_eq!(unswizzle(&z, rows, cols), s.clone());
        prop_assert_eq!(unswizzle_mxfp8_columnwise(&swizzle_mxfp8_columnwise(&s, rows, cols), rows, cols), s);
    }

    /// Stochastic rounding only ever returns one of the two grid points around x.
    #[test]
    fn stochastic_rounding_picks_a_neighbour(x in -6.5f32..6.5, byte in any::<u8>()) {
        let q = E2M1_VALUES[usize::from(e2m1_stochastic(x, byte))];
        let a = x.abs().min(6.0);
        let lo = E2M1_VALUES[..8].iter().copied().filter(|&v| v <= a).fold(0.0, f32::max);
        let hi = E2M1_VALUES[..8].iter().copied().filter(|&v| v >= a).fold(6.0, f32::min);
        prop_assert!(q.abs() == lo || q.abs() == hi, "{x} → {q} (neighbours {lo}, {hi})");
        prop_assert!(q == 0.0 || q.is_sign_negative() == x.is_sign_negative());
    }
}

/// Averaged over all 256 random bytes, stochastic rounding lands within step/256 of x.
#[test]
fn stochastic_rounding_is_unbiased_over_its_random_byte() {
    for i in 0..=600 {
        let x = i as f32 / 100.0;
        let step = if x < 2.0 {
            0.5
        } else if x < 4.0 {
            1.0
        } else {
            2.0
        };
        let mean: f64 = (0..=255u8)
            .map(|b| f64::from(E2M1_VALUES[usize::from(e2m1_stochastic(x, b))]))
            .sum::<f64>()
            / 256.0;
        assert!(
            (mean - f64::from(x)).abs() <= step / 256.0 + 1e-9,
            "x={x}: mean {mean}"
        );
        let neg: f64 = (0..=255u8)
            .map(|b| f64::from(E2M1_VALUES[usize::from(e2m1_stochastic(-x, b))]))
            .sum::<f64>()
            / 256.0;
        assert_eq!(neg, -mean);
    }
}

/// On a tensor: the dequantized mean of many stochastically rounded copies of a value between
/// two grid points is that value (statistically), the same seed gives the same bytes, and a
/// different seed different bytes.
#[test]
fn stochastic_rounding_on_a_tensor() {
    // Every block holds a 6 so that its scale is exactly 1 and the grid is E2M1's own.
    let (rows, cols) = (64, 64);
    let mut x = vec![2.3f32; rows * cols];
    for b in x.chunks_mut(16) {
        b[0] = 6.0;
    }
    let cfg = |seed| Nvfp4Config {
        copies: Copies::Rowwise,
        stochastic_rounding: Some(seed),
        ..Default::default()
    };
    let a = nv(rows, cols, &x, cfg(7));
    assert_eq!(a, nv(rows, cols, &x, cfg(7)));
    assert_ne!(a.rowwise, nv(rows, cols, &x, cfg(8)).rowwise);
    let rw = a.rowwise.as_ref().unwrap();
    assert!(rw.scales.iter().all(|&s| s == 0x7e));
    let codes = unpack_nibbles(rw, cols);
    let vals: Vec<f32> = codes
        .iter()
        .enumerate()
        .filter(|(i, _)| i % 16 != 0)
        .map(|(_, &c)| E2M1_VALUES[usize::from(c)])
        .collect();
    assert!(vals.iter().all(|&v| v == 2.0 || v == 3.0));
    let mean = vals.iter().map(|&v| f64::from(v)).sum::<f64>() / vals.len() as f64;
    // Bernoulli(0.3) steps of 1: σ of the mean ≈ 0.46/√3840 ≈ 0.0074; allow 5σ.
    assert!((mean - 2.3).abs() < 0.037, "mean {mean}");
}

/// The random Hadamard transform path: the columnwise copy holds bf16(x·A) quantized with its
/// own post-transform amax, and dequantizing it (with the inverse transform) recovers x.
#[test]
fn hadamard_columnwise_copy() {
    let (rows, cols) = (32, 24);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| ((i * 7919 % 263) as f32 - 131.0) / 17.0)
        .collect();
    let cfg = Nvfp4Config {
        rht: true,
        ..Default::default()
    };
    let t = nv(rows, cols, &x, cfg);
    // Post-RHT amax, from an independent computation of y = x·A per 16 rows of a column.
    let mut amax = 0f32;
    for c in 0..cols {
        for g in 0..rows / 16 {
            let v: [f32; 16] = std::array::from_fn(|i| x[(g * 16 + i) * cols + c]);
            let y = lowbit_formats::hadamard::rht16(&v);
            amax = y.iter().fold(amax, |m, &y| m.max(y.abs()));
        }
    }
    assert_eq!(t.amax_columnwise, amax);
    assert_ne!(t.amax_columnwise, t.amax_rowwise);
    let d = t.dequantize_columnwise().unwrap();
    let rms = |v: &[f32]| {
        (v.iter().map(|&e| f64::from(e) * f64::from(e)).sum::<f64>() / v.len() as f64).sqrt()
    };
    let err: Vec<f32> = x.iter().zip(&d).map(|(a, b)| a - b).collect();
    assert!(
        rms(&err) < 0.2 * rms(&x),
        "RHT round trip error {} vs signal {}",
        rms(&err),
        rms(&x)
    );
    // A row count the 16-point transform cannot cover is refused.
    let m = Matrix::new("w", 8, 3, Source::F32(&x[..24])).unwrap();
    assert!(quantize_nvfp4(&m, &cfg).is_err());
    let both = Nvfp4Config { two_d: true, ..cfg };
    assert!(quantize_nvfp4(&Matrix::new("w", 32, 24, Source::F32(&x)).unwrap(), &both).is_err());
}

/// Quantizing into an existing tensor gives the same bytes as a fresh one, whether its buffers
/// fit (reused, stale bytes all overwritten) or not (reallocated), and drops unwanted copies.
#[test]
fn quantize_into_matches_fresh_output() {
    use lowbit_formats::quantize_mxfp8_into;
    let x: Vec<f32> = (0..70 * 45)
        .map(|i| ((i * 7919 % 1009) as f32 - 500.0) / 37.0)
        .collect();
    let y: Vec<f32> = x.iter().map(|v| v * -3.0).collect();
    let both = Mxfp8Config::default();
    let mut t = mx(70, 45, &y, both);
    let fresh = mx(70, 45, &x, both);
    let m = Matrix::new("t", 70, 45, Source::F32(&x)).unwrap();
    quantize_mxfp8_into(&m, &both, &mut t).unwrap();
    assert_eq!(t, fresh);
    let m2 = Matrix::new("t", 45, 70, Source::F32(&x)).unwrap();
    let row = Mxfp8Config {
        copies: Copies::Rowwise,
        ..both
    };
    quantize_mxfp8_into(&m2, &row, &mut t).unwrap();
    assert_eq!(t, mx(45, 70, &x, row));
    assert!(t.columnwise.is_none());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// 2D NVFP4 computed from flat shards (partial tile amaxes reduced with MAX, ranges
    /// quantized independently, bytes concatenated) equals the whole-matrix quantization.
    #[test]
    fn sharded_nvfp4_2d_equals_whole((rows, cols, x) in matrix(), cuts in proptest::collection::vec(any::<u16>(), 0..5)) {
        use lowbit_formats::nvfp4::sharded::{fold_tile_amax_2d, from_rowwise_2d, quantize_2d_range, tile_count};
        let cols = cols + cols % 2;
        let x: Vec<f32> = (0..rows * cols).map(|i| x[i % x.len()] * if i % 7 == 0 { 1e-3 } else { 1.0 }).collect();
        let n = rows * cols;
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| (usize::from(c) % (n + 1)) & !1).collect();
        bounds.extend([0, n]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut tiles = vec![0f32; tile_count(rows, cols)];
        for w in bounds.windows(2) {
            let mut part = vec![0f32; tile_count(rows, cols)];
            fold_tile_amax_2d(&x[w[0]..w[1]], w[0], cols, &mut part).unwrap();
            for (t, p) in tiles.iter_mut().zip(&part) {
                *t = t.max(*p);
            }
        }
        let mut packed = vec![0u8; n / 2];
        for w in bounds.windows(2) {
            quantize_2d_range(&x[w[0]..w[1]], w[0], cols, &tiles, &mut packed[w[0] / 2..w[1] / 2]).unwrap();
        }
        let got = from_rowwise_2d(rows, cols, packed, &tiles).unwrap();
        let want = nv(rows, cols, &x, Nvfp4Config { two_d: true, ..Default::default() });
        prop_assert_eq!(got, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// 2D MXFP8 from flat shards equals the whole-matrix quantization (both copies).
    #[test]
    fn sharded_mxfp8_2d_equals_whole((rows, cols, x) in matrix(), cuts in proptest::collection::vec(any::<u16>(), 0..5)) {
        use lowbit_formats::mxfp8::sharded::{fold_tile_amax_2d, quantize_2d_range, scales_2d, tile_count};
        let n = rows * cols;
        let mut bounds: Vec<usize> = cuts.iter().map(|&c| usize::from(c) % (n + 1)).collect();
        bounds.extend([0, n]);
        bounds.sort_unstable();
        bounds.dedup();
        let mut tiles = vec![0f32; tile_count(rows, cols)];
        for w in bounds.windows(2) {
            fold_tile_amax_2d(&x[w[0]..w[1]], w[0], cols, &mut tiles).unwrap();
        }
        let mut bytes = vec![0u8; n];
        for w in bounds.windows(2) {
            quantize_2d_range(&x[w[0]..w[1]], w[0], cols, Fp8Kind::E4M3, &tiles, &mut bytes[w[0]..w[1]]).unwrap();
        }
        let (rs, cs) = scales_2d(rows, cols, Fp8Kind::E4M3, &tiles).unwrap();
        let want = mx(rows, cols, &x, Mxfp8Config { two_d: true, ..Default::default() });
        let (wr, wc) = (want.rowwise.unwrap(), want.columnwise.unwrap());
        prop_assert_eq!(&bytes, &wr.data);
        prop_assert_eq!(&bytes, &wc.data);
        prop_assert_eq!(rs, wr.scales);
        prop_assert_eq!(cs, wc.scales);
    }
}

/// The direct columnwise NVFP4 path (rows a multiple of 16, no transform, no stochastic
/// rounding) equals the rowwise quantization of the transpose, 1D and 2D, at 1 and 3 threads.
#[test]
fn nvfp4_direct_columnwise_equals_rowwise_of_transpose() {
    let (rows, cols) = (64, 300);
    let x: Vec<f32> = (0..rows * cols)
        .map(|i| {
            (((i * 2654435761usize) % 20011) as f32 - 10005.0)
                * if i % 97 == 0 { 40.0 } else { 0.01 }
        })
        .collect();
    let xt = transpose(&x, rows, cols);
    for two_d in [false, true] {
        for threads in [1, 3] {
            let cfg = Nvfp4Config {
                two_d,
                threads,
                ..Default::default()
            };
            let a = nv(rows, cols, &x, cfg);
            if two_d {
                let b = nv(
                    rows,
                    cols,
                    &x,
                    Nvfp4Config {
                        copies: Copies::Columnwise,
                        ..cfg
                    },
                );
                assert_eq!(a.columnwise, b.columnwise);
            } else {
                let b = nv(cols, rows, &xt, cfg);
                assert_eq!(a.columnwise.as_ref().unwrap(), b.rowwise.as_ref().unwrap());
            }
        }
    }
}

/// A 16-bit float format for the tile-kernel proptests.
#[derive(Clone, Copy)]
struct HalfFormat {
    /// Mantissa bits (the exponent takes the other 15 − `mant` below the sign).
    mant: u16,
    bias: u16,
    /// Exponents of values far below a block's amax (sampled one time in five).
    wide: (u16, u16),
    /// Normals with an exponent below this are tiny: fp8 subnormal or zero after scaling.
    tiny_below: u16,
}

const BF16: HalfFormat = HalfFormat {
    mant: 7,
    bias: 127,
    wide: (100, 150),
    tiny_below: 20,
};
const F16: HalfFormat = HalfFormat {
    mant: 10,
    bias: 15,
    wide: (1, 31),
    tiny_below: 5,
};

/// A matrix of `f`'s bit patterns, shaped to reach the 32x32-tile kernel (32-multiple columns,
/// at least one full band of 32 rows) as well as the general path, with special patterns at a
/// per-matrix density: none, rare (most tiles clean, a few not) or dense (every tile touched).
fn half_matrix(f: HalfFormat) -> impl Strategy<Value = (usize, usize, Vec<u16>)> {
    let rows = prop_oneof![32usize..=33, 64usize..=96, 1usize..40];
    let cols = prop_oneof![(1usize..=4).prop_map(|c| 32 * c), 1usize..80];
    let min_normal = 1u16 << f.mant;
    let inf = ((1u16 << (15 - f.mant)) - 1) << f.mant;
    (rows, cols, prop_oneof![Just(0u32), Just(3), Just(200)]).prop_flat_map(
        move |(r, c, per_mille)| {
            let special = prop_oneof![
                Just(0x0000u16),
                Just(0x8000),
                1u16..min_normal,                   // subnormals
                min_normal..f.tiny_below << f.mant, // tiny normals
                Just(inf),
                Just(0x8000 | inf),
                inf + 1..=0x7FFF, // NaNs
                Just(inf - 1),
                Just(0x8000 | (inf - 1)),
            ];
            // Mostly a span a block's fp8 range covers, sometimes far below the block's amax.
            let exp = prop_oneof![4 => f.bias - 7..f.bias + 9, 1 => f.wide.0..f.wide.1];
            let normal = (any::<bool>(), exp, 0u16..min_normal)
                .prop_map(move |(s, e, m)| (u16::from(s) << 15) | (e << f.mant) | m);
            let elem = (0u32..1000, special, normal)
                .prop_map(move |(roll, sp, n)| if roll < per_mille { sp } else { n });
            (Just(r), Just(c), proptest::collection::vec(elem, r * c))
        },
    )
}

/// Quantizing `half` (bf16 or f16 input) gives the same bytes as its values `f` given as f32,
/// for every copy set, 1D and 2D, E4M3 and E5M2.
fn assert_half_input_is_its_f32_values(
    rows: usize,
    cols: usize,
    half: Source<'_>,
    f: &[f32],
    threads: usize,
) -> Result<(), TestCaseError> {
    let mh = Matrix::new("t", rows, cols, half).unwrap();
    let mf = Matrix::new("t", rows, cols, Source::F32(f)).unwrap();
    for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
        for copies in [Copies::Rowwise, Copies::Columnwise, Copies::Both] {
            for two_d in [false, true] {
                let cfg = Mxfp8Config {
                    kind,
                    copies,
                    two_d,
                    threads,
                    ..Mxfp8Config::default()
                };
                prop_assert_eq!(
                    quantize_mxfp8(&mh, &cfg).unwrap(),
                    quantize_mxfp8(&mf, &cfg).unwrap(),
                    "{:?} {:?} 2d={}",
                    kind,
                    copies,
                    two_d
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    /// bf16 input gives the same bytes as the same values in f32, for every copy set, 1D and
    /// 2D, E4M3 and E5M2, and any thread count: the 16-bit tile kernel's integer encoding and
    /// its hand-backs (fp8 subnormals, bf16 subnormals, tiles with NaN or Inf) agree with the
    /// general fp32 path byte for byte.
    #[test]
    fn bf16_input_equals_its_f32_values((rows, cols, bits) in half_matrix(BF16), threads in 1usize..3) {
        let h: Vec<bf16> = bits.iter().map(|&b| bf16::from_bits(b)).collect();
        let f: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        assert_half_input_is_its_f32_values(rows, cols, Source::Bf16(&h), &f, threads)?;
    }

    /// The same for f16 input (f16 subnormals, infinities and NaNs included).
    #[test]
    fn f16_input_equals_its_f32_values((rows, cols, bits) in half_matrix(F16), threads in 1usize..3) {
        let h: Vec<f16> = bits.iter().map(|&b| f16::from_bits(b)).collect();
        let f: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        assert_half_input_is_its_f32_values(rows, cols, Source::F16(&h), &f, threads)?;
    }
}
