//! Golden vectors: outputs of probe programs run on an NVIDIA H100 against CUDA's own conversion
//! routines (`__nv_cvt_float_to_fp8` in `cuda_fp8.h`, `__nv_cvt_float_to_fp4` in `cuda_fp4.h`),
//! Transformer Engine's MXFP8 kernels (`transformer_engine/common/cast/mxfp8/`) and TE's NVFP4
//! reference quantizer (`NVFP4QuantizerRef` in
//! `transformer_engine/pytorch/custom_recipes/quantization_nvfp4.py`), with the values reproduced
//! here — never our own output. Each table is checked through one helper so a new vector is one
//! line.

use lowbit_formats::scalar::{
    E2M1_VALUES, e2m1_from_f32, e2m1_to_f32, e4m3_from_f32, e4m3_to_f32, e5m2_from_f32,
    e5m2_to_f32, e8m0_from_f32, e8m0_rcp, e8m0_to_f32, ue4m3_from_f32,
};
use lowbit_formats::{
    Copies, FormatError, Fp8Kind, Matrix, Mxfp8Config, NanPolicy, Nvfp4Config, Source, bf16,
    quantize_mxfp8, quantize_nvfp4,
};

/// 2^k exactly, for -149 <= k <= 127, built from its bits: `2f32.powi(k)` is exact only when
/// the compiler folds it; unoptimised builds call the runtime, which computes 1 / 2^-k and gives
/// 0 for k < -127.
fn p2(k: i32) -> f32 {
    assert!(
        (-149..=127).contains(&k),
        "2^{k} is not a finite non-zero f32"
    );
    if k >= -126 {
        f32::from_bits(((k + 127) as u32) << 23)
    } else {
        f32::from_bits(1u32 << (k + 149))
    }
}

/// fp32 → (e4m3, e5m2) through CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, …)`; `None`
/// where the probe printed no entry.
#[test]
fn fp8_element_cast_edge_table() {
    let nan = f32::NAN;
    let table: &[(f32, Option<u8>, Option<u8>)] = &[
        (448.0, Some(0x7e), Some(0x5f)),
        (463.99997, Some(0x7e), Some(0x5f)),
        (464.0, Some(0x7e), Some(0x5f)),
        (464.00003, Some(0x7e), Some(0x5f)),
        (480.0, Some(0x7e), None),
        (500.0, Some(0x7e), None),
        (1e6, Some(0x7e), Some(0x7b)),
        (57344.0, Some(0x7e), Some(0x7b)),
        (61439.996, Some(0x7e), Some(0x7b)),
        (61440.0, Some(0x7e), Some(0x7b)),
        (f32::INFINITY, Some(0x7e), Some(0x7b)),
        (f32::NEG_INFINITY, Some(0xfe), Some(0xfb)),
        (nan, Some(0x7f), Some(0x7f)),
        (-nan, Some(0x7f), Some(0x7f)),
        (-0.0, Some(0x80), Some(0x80)),
        (0.0, Some(0x00), Some(0x00)),
        (p2(-10), Some(0x00), Some(0x14)),
        (f32::from_bits(p2(-10).to_bits() + 1), Some(0x01), None),
        (1.5 * p2(-9), Some(0x02), None),
        (p2(-17), Some(0x00), Some(0x00)),
    ];
    for &(x, e4, e5) in table {
        if let Some(e4) = e4 {
            assert_eq!(e4m3_from_f32(x), e4, "e4m3({x:e})");
        }
        if let Some(e5) = e5 {
            assert_eq!(e5m2_from_f32(x), e5, "e5m2({x:e})");
        }
    }
}

/// CUDA's `__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)`.
#[test]
#[allow(clippy::excessive_precision)] // literals exactly as the probe printed them
fn e2m1_cast_table() {
    let table: &[(f32, u8)] = &[
        (0.25, 0x0),
        (0.25000009, 0x1),
        (0.75, 0x2),
        (1.25, 0x2),
        (1.75, 0x4),
        (2.5, 0x4),
        (3.5, 0x6),
        (5.0, 0x6),
        (5.9999, 0x7),
        (7.0, 0x7),
        (1e30, 0x7),
        (f32::INFINITY, 0x7),
        (f32::NEG_INFINITY, 0xf),
        (-0.0, 0x8),
        (-0.1, 0x8),
        (f32::NAN, 0x7),
        (-f32::NAN, 0x7),
    ];
    for &(x, code) in table {
        assert_eq!(e2m1_from_f32(x), code, "e2m1({x:e})");
    }
}

/// fp32 → E8M0 rounding up, saturating (`cvt.rp.satfinite.ue8m0x2.f32`, which is what TE's
/// `ptx::float_to_e8m0` computes).
#[test]
fn e8m0_round_up_saturating_table() {
    let table: &[(f32, u8)] = &[
        (0.0, 0x00),
        (-0.0, 0x00),
        (1.0, 0x7f),
        (-1.0, 0x7f),
        (1.5, 0x80),
        (1.25, 0x80),
        (1.75, 0x80),
        (3.0, 0x81),
        (448.0, 0x88),
        (f32::from_bits(0x0040_0000), 0x00),
        (f32::from_bits(0x0060_0000), 0x01),
        (p2(-127) / 2.0, 0x00),
        (f32::from_bits(1), 0x00),
        (p2(-126) * (1.0 + p2(-23)), 0x02),
        (p2(127), 0xfe),
        (1.5 * p2(127), 0xfe),
        (f32::MAX, 0xfe),
        (f32::INFINITY, 0xfe),
        (f32::NEG_INFINITY, 0xfe),
        (f32::NAN, 0xff),
        (f32::from_bits(0x3B12_4925), 0x77),
    ];
    for &(x, code) in table {
        assert_eq!(e8m0_from_f32(x), code, "e8m0({x:e})");
    }
    assert_eq!(Fp8Kind::E4M3.max_norm_rcp().to_bits(), 0x3B12_4925);
    assert_eq!(448.0 * Fp8Kind::E4M3.max_norm_rcp(), 1.0);
}

#[test]
fn e8m0_decode_every_code() {
    assert_eq!(e8m0_to_f32(0x00).to_bits(), 0x0040_0000);
    assert!(e8m0_to_f32(0xff).is_nan());
    for b in 1..=0xfeu8 {
        assert_eq!(e8m0_to_f32(b), p2(i32::from(b) - 127), "code {b:#04x}");
    }
    // TE's exp2f_rcp: the exact reciprocal, with 0xFE → 2^-127 and 0xFF → NaN.
    for b in 0..=0xfdu8 {
        assert_eq!(e8m0_rcp(b) * e8m0_to_f32(b), 1.0, "code {b:#04x}");
    }
    assert_eq!(e8m0_rcp(0xfe).to_bits(), 0x0040_0000);
    assert!(e8m0_rcp(0xff).is_nan());
}

/// Decodes of every fp8 and fp4 code against an independent f64 formula.
#[test]
fn fp8_and_fp4_decode_every_code() {
    fn formula(b: u8, ebits: u32, mbits: u32) -> f64 {
        let bias = (1i32 << (ebits - 1)) - 1;
        let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
        let e = i32::from((b & 0x7f) >> mbits);
        let m = f64::from(b & ((1 << mbits) - 1)) / f64::from(1u32 << mbits);
        sign * if e == 0 {
            m * 2f64.powi(1 - bias)
        } else {
            (1.0 + m) * 2f64.powi(e - bias)
        }
    }
    for b in 0..=255u8 {
        let v4 = e4m3_to_f32(b);
        if b & 0x7f == 0x7f {
            assert!(v4.is_nan(), "e4m3 {b:#04x} is NaN");
        } else {
            assert_eq!(f64::from(v4), formula(b, 4, 3), "e4m3 {b:#04x}");
            assert_eq!(e4m3_from_f32(v4), b, "e4m3 round trip {b:#04x}");
        }
        let v5 = e5m2_to_f32(b);
        match b & 0x7f {
            0x7c => assert_eq!(
                v5,
                if b & 0x80 != 0 {
                    f32::NEG_INFINITY
                } else {
                    f32::INFINITY
                }
            ),
            0x7d..=0x7f => assert!(v5.is_nan(), "e5m2 {b:#04x} is NaN"),
            _ => {
                assert_eq!(f64::from(v5), formula(b, 5, 2), "e5m2 {b:#04x}");
                assert_eq!(e5m2_from_f32(v5), b, "e5m2 round trip {b:#04x}");
            }
        }
    }
    assert_eq!(e4m3_to_f32(0x7e), 448.0);
    assert_eq!(e5m2_to_f32(0x7b), 57344.0);
    for b in 0..16u8 {
        let nib = ((b & 0x8) << 4) | (b & 0x7);
        assert_eq!(f64::from(e2m1_to_f32(b)), formula(nib, 2, 1), "e2m1 {b:#x}");
        assert_eq!(
            e2m1_from_f32(E2M1_VALUES[usize::from(b)]),
            b,
            "e2m1 round trip {b:#x}"
        );
    }
    // The NVFP4 block scale is E4M3 of a non-negative value.
    assert_eq!(ue4m3_from_f32(448.0), 0x7e);
    assert_eq!(ue4m3_from_f32(0.171875), 0x23);
    assert_eq!(ue4m3_from_f32(0.0), 0x00);
}

/// One 32-element block: the expected scale and leading data bytes for a kind. Checks the
/// rowwise copy (1x32), the columnwise copy (the block as a 32x1 column) and 2D (the block as
/// the first row of a 32x32 tile), which must all agree.
fn check_mxfp8_block(elems: &[f32], kind: Fp8Kind, scale: u8, data: &[u8]) {
    let mut row = vec![0f32; 32];
    row[..elems.len()].copy_from_slice(elems);
    let label = format!("{kind:?} {elems:?}");
    let cfg = Mxfp8Config {
        kind,
        copies: Copies::Both,
        ..Default::default()
    };
    let t = quantize_mxfp8(&Matrix::new("b", 1, 32, Source::F32(&row)).unwrap(), &cfg).unwrap();
    let rw = t.rowwise.as_ref().unwrap();
    assert_eq!(rw.scales, [scale], "{label} rowwise scale");
    assert_eq!(&rw.data[..data.len()], data, "{label} rowwise data");
    assert!(
        rw.data[data.len()..].iter().all(|&b| b == 0),
        "{label} zeros"
    );

    let t = quantize_mxfp8(&Matrix::new("b", 32, 1, Source::F32(&row)).unwrap(), &cfg).unwrap();
    let cw = t.columnwise.as_ref().unwrap();
    assert_eq!(cw.scales, [scale], "{label} columnwise scale");
    assert_eq!(&cw.data[..data.len()], data, "{label} columnwise data");

    let mut tile = vec![0f32; 32 * 32];
    tile[..32].copy_from_slice(&row);
    let cfg2d = Mxfp8Config { two_d: true, ..cfg };
    let t = quantize_mxfp8(
        &Matrix::new("b", 32, 32, Source::F32(&tile)).unwrap(),
        &cfg2d,
    )
    .unwrap();
    for p in [t.rowwise.as_ref().unwrap(), t.columnwise.as_ref().unwrap()] {
        assert!(p.scales.iter().all(|&s| s == scale), "{label} 2D scale");
        assert_eq!(&p.data[..data.len()], data, "{label} 2D data");
    }
}

/// TE's MXFP8 kernels on 32-element blocks, including its NaN/Inf behaviour (NaN ignored by the
/// block amax and encoded as NaN, an Inf amax saturating the scale).
#[test]
fn mxfp8_block_vectors() {
    use Fp8Kind::{E4M3, E5M2};
    let nan = f32::NAN;
    let inf = f32::INFINITY;
    type Row<'a> = (&'a [f32], u8, &'a [u8], u8, &'a [u8]);
    let ties = [
        448.0,
        1.0625,
        1.1875,
        p2(-10),
        3.0 * p2(-10),
        -p2(-10),
        p2(-9),
        17.0,
        19.0,
    ];
    let tiny = [p2(-130), p2(-140), -p2(-135)];
    let table: &[Row<'_>] = &[
        (&[], 0x00, &[0x00], 0x00, &[0x00]),
        (
            &[448.0, 1.0, -1.0, 0.5, 3.0],
            0x7f,
            &[0x7e, 0x38, 0xb8, 0x30, 0x44],
            0x78,
            &[0x7b, 0x58, 0xd8, 0x54, 0x5e],
        ),
        (&[449.0, 1.0], 0x80, &[0x76, 0x30], 0x79, &[0x77, 0x54]),
        (
            &[500.0, 250.0, -7.0],
            0x80,
            &[0x78, 0x70, 0xc6],
            0x79,
            &[0x78, 0x74, 0xdf],
        ),
        (&[300.0, 1.0], 0x7f, &[0x79, 0x38], 0x78, &[0x79, 0x58]),
        (&[511.99997, 1.0], 0x80, &[0x78, 0x30], 0x79, &[0x78, 0x54]),
        (&[1.0, 0.3], 0x77, &[0x78, 0x6a], 0x70, &[0x78, 0x71]),
        (
            &ties,
            0x7f,
            &[0x7e, 0x38, 0x3a, 0x00, 0x02, 0x80, 0x01, 0x58, 0x5a],
            0x78,
            &[0x7b, 0x58, 0x59, 0x30, 0x36, 0xb0, 0x34, 0x68, 0x69],
        ),
        (&tiny, 0x00, &[0x20, 0x00, 0x82], 0x00, &[0x30, 0x08, 0x9c]),
        (&[448.0 * p2(-140)], 0x00, &[0x16], 0x00, &[0x2b]),
        (
            &[3e38, 1e38, -1.0],
            0xf7,
            &[0x76, 0x69, 0x80],
            0xf0,
            &[0x77, 0x71, 0x80],
        ),
        (
            &[nan, 2.0, 1.0],
            0x78,
            &[0x7f, 0x78, 0x70],
            0x71,
            &[0x7f, 0x78, 0x74],
        ),
        (
            &[inf, 2.0, 1.0],
            0xfe,
            &[0x7e, 0x00, 0x00],
            0xfe,
            &[0x7b, 0x00, 0x00],
        ),
        (&[-448.0, 2.0], 0x7f, &[0xfe, 0x40], 0x78, &[0xfb, 0x5c]),
    ];
    for &(elems, s4, d4, s5, d5) in table {
        check_mxfp8_block(elems, E4M3, s4, d4);
        check_mxfp8_block(elems, E5M2, s5, d5);
    }
}

/// bf16 and f16 inputs holding the same values give the same bytes as fp32 (the amax of a
/// half-precision block is exact, so TE's bf16 `__hmax` path agrees with its fp32 path).
#[test]
fn mxfp8_input_dtypes_agree() {
    let vals: Vec<f32> = (0..64)
        .map(|i| ((i * 37 % 61) as f32 - 30.0) * 0.375)
        .collect();
    let b: Vec<bf16> = vals.iter().map(|&v| bf16::from_f32(v)).collect();
    let h: Vec<half::f16> = vals.iter().map(|&v| half::f16::from_f32(v)).collect();
    let cfg = Mxfp8Config::default();
    let f = quantize_mxfp8(&Matrix::new("x", 2, 32, Source::F32(&vals)).unwrap(), &cfg).unwrap();
    let fb = quantize_mxfp8(&Matrix::new("x", 2, 32, Source::Bf16(&b)).unwrap(), &cfg).unwrap();
    let fh = quantize_mxfp8(&Matrix::new("x", 2, 32, Source::F16(&h)).unwrap(), &cfg).unwrap();
    assert_eq!(f, fb);
    assert_eq!(f, fh);
}

#[test]
fn nan_policy_error_names_tensor_and_first_index() {
    let mut x = vec![1.0f32; 6 * 40];
    x[2 * 40 + 7] = f32::INFINITY;
    x[3 * 40 + 1] = f32::NAN;
    let m = Matrix::new("layers.0.w", 6, 40, Source::F32(&x)).unwrap();
    let want = FormatError::NonFinite {
        name: "layers.0.w".into(),
        row: 2,
        col: 7,
        flat: 87,
        value: f32::INFINITY,
    };
    let mx = Mxfp8Config {
        nan_policy: NanPolicy::Error,
        ..Default::default()
    };
    assert_eq!(quantize_mxfp8(&m, &mx).unwrap_err(), want);
    let nv = Nvfp4Config {
        nan_policy: NanPolicy::Error,
        ..Default::default()
    };
    assert_eq!(quantize_nvfp4(&m, &nv).unwrap_err(), want);
    let msg = want.to_string();
    assert!(
        msg.contains("layers.0.w") && msg.contains("[2, 7]"),
        "{msg}"
    );
    // The default TE policy accepts it.
    assert!(quantize_mxfp8(&m, &Mxfp8Config::default()).is_ok());
}

#[test]
fn shape_mismatch_is_an_error() {
    let x = [0f32; 10];
    assert!(matches!(
        Matrix::new("w", 3, 4, Source::F32(&x)),
        Err(FormatError::ShapeMismatch { len: 10, .. })
    ));
}

/// TE's NVFP4 on one 6×16 fp32 tensor: global amax 2688 → S_enc = 448·6 / 2688 = 1.
#[test]
fn nvfp4_two_level_vectors() {
    let rows: [(&[f32], u8, [u8; 16]); 6] = [
        (
            &[2688.0, 1.0],
            0x7e,
            [7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ),
        (&[1.0], 0x23, [7; 16]),
        (&[0.0], 0x00, [0; 16]),
        (
            &[1e-6, 0.0],
            0x00,
            [7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
        ),
        (
            &[
                3.0, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, -3.5, 5.0, 4.9, 0.1, 0.2, 0.3, 0.4, 0.6,
                0.7,
            ],
            0x35,
            [6, 5, 4, 3, 2, 1, 9, 14, 7, 7, 0, 0, 1, 1, 1, 2],
        ),
        (&[384.0], 0x68, [7; 16]),
    ];
    // A short row spec repeats its last element ("[2688, 1×15]", "[1×16]").
    let mut x = Vec::new();
    for (spec, _, _) in &rows {
        x.extend((0..16).map(|i| spec[i.min(spec.len() - 1)]));
    }
    let m = Matrix::new("w", 6, 16, Source::F32(&x)).unwrap();
    let t = quantize_nvfp4(&m, &Nvfp4Config::default()).unwrap();
    assert_eq!(t.amax_rowwise, 2688.0);
    let rw = t.rowwise.as_ref().unwrap();
    for (r, (_, scale, codes)) in rows.iter().enumerate() {
        assert_eq!(rw.scales[r], *scale, "row {r} scale");
        let packed: Vec<u8> = codes.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
        assert_eq!(&rw.data[r * 8..(r + 1) * 8], &packed[..], "row {r} codes");
    }
    // The columnwise copy of the transpose is the rowwise copy of this tensor.
    let xt: Vec<f32> = (0..16 * 6).map(|i| x[(i % 6) * 16 + i / 6]).collect();
    let mt = Matrix::new("wt", 16, 6, Source::F32(&xt)).unwrap();
    let tt = quantize_nvfp4(&mt, &Nvfp4Config::default()).unwrap();
    assert_eq!(tt.columnwise.as_ref().unwrap(), rw);
}

/// The cuBLAS block-scale layout ("1D Block Scaling Factors Layout"): rows 0, 32, 64, 96
/// interleave in 4-byte groups; tiles of 128x4 are 512 bytes.
#[test]
fn swizzle_offsets() {
    use lowbit_formats::layout::{swizzle, swizzle_offset, swizzled_dims};
    assert_eq!(swizzle_offset(0, 0, 8), 0);
    assert_eq!(swizzle_offset(0, 3, 8), 3);
    assert_eq!(swizzle_offset(32, 0, 8), 4);
    assert_eq!(swizzle_offset(64, 1, 8), 9);
    assert_eq!(swizzle_offset(96, 0, 8), 12);
    assert_eq!(swizzle_offset(1, 0, 8), 16);
    assert_eq!(swizzle_offset(0, 4, 8), 512);
    assert_eq!(swizzle_offset(128, 0, 8), 1024);
    assert_eq!(swizzled_dims(90, 3), (128, 4));
    // gpt-oss dims (TE PR #3070): 2880 columns → 90 MXFP8 blocks; padding must be zero.
    let s = vec![0x7fu8; 3 * 90];
    let z = swizzle(&s, 3, 90);
    assert_eq!(z.len(), 128 * 92);
    assert_eq!(z.iter().filter(|&&b| b == 0x7f).count(), 3 * 90);
    assert_eq!(z.iter().filter(|&&b| b == 0).count(), 128 * 92 - 3 * 90);
}
