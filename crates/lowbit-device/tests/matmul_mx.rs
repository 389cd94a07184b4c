//! `Device::matmul_mx` on the CPU: bit for bit against an independent integer implementation
//! of the MXFP8 product's semantics (fp8 codes decoded from their bits, each 32-block's dot
//! product summed exactly in i128), the two copies and the float path giving the same bits,
//! the error against an f64 product of the dequantized operands next to the bf16 GEMM's, and
//! refusals.

mod common;

use common::{bits, upload};
use lowbit_device::{
    DType, Device, Fp8Kind, MatmulMxSpec, MatmulTcSpec, MxArg, MxLayout, MxOperand, View, bf16,
};
use lowbit_formats::{Copies, Matrix, Mxfp8Config, Source, quantize_mxfp8};

/// An fp8 code as `(sign, n)` with value `sign · n · 2^-FRAC`, decoded from its bits alone:
/// E4M3 `n · 2^-9` (bias 7, 3 mantissa bits), E5M2 `n · 2^-16` (bias 15, 2 bits). `None` for
/// NaN (and E5M2's infinities, which MXFP8 never stores).
fn fp8_integer(kind: Fp8Kind, b: u8) -> Option<i128> {
    let sign = if b & 0x80 != 0 { -1 } else { 1 };
    let (e, m) = match kind {
        Fp8Kind::E4M3 => {
            let (e, m) = (i32::from((b >> 3) & 0xF), i128::from(b & 7));
            if e == 0xF && m == 7 {
                return None;
            }
            (e, m | if e > 0 { 8 } else { 0 })
        }
        Fp8Kind::E5M2 => {
            let (e, m) = (i32::from((b >> 2) & 0x1F), i128::from(b & 3));
            if e == 0x1F {
                return None;
            }
            (e, m | if e > 0 { 4 } else { 0 })
        }
    };
    Some(sign * (m << (e - 1).max(0)))
}

/// Log2 of an fp8 integer's unit (`2^-FRAC`).
fn frac(kind: Fp8Kind) -> i32 {
    match kind {
        Fp8Kind::E4M3 => 9,
        Fp8Kind::E5M2 => 16,
    }
}

/// A logical `[outer, k]` operand: element codes and per-block biased exponents.
struct Logical {
    codes: Vec<u8>,
    exps: Vec<u8>,
    kind: Fp8Kind,
}

/// The reference: per element, per block, the exact integer dot product, scaled by
/// `2^(ea + eb − 254 − 2·FRAC)` and rounded once to f32, added in f32 in block order.
fn reference(a: &Logical, b: &Logical, m: usize, n: usize, k: usize, c0: &[f32]) -> Vec<f32> {
    let blocks = k.div_ceil(32);
    let mut c = c0.to_vec();
    for i in 0..m {
        for j in 0..n {
            let mut s = c[i * n + j];
            for blk in 0..blocks {
                let (ea, eb) = (a.exps[i * blocks + blk], b.exps[j * blocks + blk]);
                let mut dot: i128 = 0;
                let mut nan = ea == 0xFF || eb == 0xFF;
                for t in blk * 32..((blk + 1) * 32).min(k) {
                    match (
                        fp8_integer(a.kind, a.codes[i * k + t]),
                        fp8_integer(b.kind, b.codes[j * k + t]),
                    ) {
                        (Some(x), Some(y)) => dot += x * y,
                        _ => nan = true,
                    }
                }
                let shift = i32::from(ea) + i32::from(eb) - 254 - frac(a.kind) - frac(b.kind);
                s += if nan {
                    f32::NAN
                } else {
                    // |dot| < 2^45: exact in f64, as is the power of two.
                    (dot as f64 * 2f64.powi(shift)) as f32
                };
            }
            c[i * n + j] = s;
        }
    }
    c
}

/// Deterministic values spanning several binades (and a few blocks far from the rest).
fn values(seed: u64, len: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let u = (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let binade = ((x >> 8) % 12) as i32 - 6 + if i % 97 < 32 { 9 } else { 0 };
            u * 2f32.powi(binade)
        })
        .collect()
}

/// `x` (`[outer, k]`) quantized for a contraction over k in `layout`: the host quantizer's
/// plane as device views, and the logical reference operand.
fn quantized(
    dev: &mut Device,
    x: &[f32],
    outer: usize,
    k: usize,
    layout: MxLayout,
    kind: Fp8Kind,
) -> (MxOperand, Logical) {
    let stored: Vec<f32> = match layout {
        MxLayout::Rowwise => x.to_vec(),
        MxLayout::Columnwise => transpose(x, outer, k),
    };
    let (rows, cols, copies) = match layout {
        MxLayout::Rowwise => (outer, k, Copies::Rowwise),
        MxLayout::Columnwise => (k, outer, Copies::Columnwise),
    };
    let cfg = Mxfp8Config {
        kind,
        copies,
        ..Mxfp8Config::default()
    };
    let mat = Matrix::new("x", rows, cols, Source::F32(&stored)).unwrap();
    let t = quantize_mxfp8(&mat, &cfg).unwrap();
    let plane = match layout {
        MxLayout::Rowwise => t.rowwise.unwrap(),
        MxLayout::Columnwise => t.columnwise.unwrap(),
    };
    let blocks = k.div_ceil(32);
    let mut codes = vec![0u8; outer * k];
    let mut exps = vec![0u8; outer * blocks];
    for o in 0..outer {
        for t in 0..k {
            codes[o * k + t] = match layout {
                MxLayout::Rowwise => plane.data[o * k + t],
                MxLayout::Columnwise => plane.data[t * outer + o],
            };
        }
        for b in 0..blocks {
            exps[o * blocks + b] = match layout {
                MxLayout::Rowwise => plane.scales[o * blocks + b],
                MxLayout::Columnwise => plane.scales[b * outer + o],
            };
        }
    }
    let up = |dev: &mut Device, bytes: &[u8]| -> View {
        let v = dev.alloc(DType::U8, bytes.len());
        dev.upload(v, bytes).unwrap();
        v
    };
    let op = MxOperand {
        data: up(dev, &plane.data),
        scales: up(dev, &plane.scales),
        kind,
        layout,
    };
    (op, Logical { codes, exps, kind })
}

fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut t = vec![0f32; x.len()];
    for r in 0..rows {
        for c in 0..cols {
            t[c * rows + r] = x[r * cols + c];
        }
    }
    t
}

/// The shapes: K below, at and past one block, not a multiple of 32 or 128; M/N tails.
const SHAPES: [(usize, usize, usize); 8] = [
    (1, 1, 1),
    (3, 5, 31),
    (4, 4, 32),
    (7, 3, 33),
    (5, 9, 100),
    (16, 8, 128),
    (9, 17, 161),
    (33, 31, 300),
];

#[test]
fn matches_the_integer_reference_bit_for_bit() {
    let layouts = [MxLayout::Rowwise, MxLayout::Columnwise];
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        for (la, lb) in layouts
            .iter()
            .flat_map(|a| layouts.iter().map(move |b| (*a, *b)))
        {
            for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
                for accumulate in [false, true] {
                    let mut dev = Device::cpu();
                    let (x, y) = (values(s as u64, m * k), values(100 + s as u64, n * k));
                    let (qa, ra) = quantized(&mut dev, &x, m, k, la, kind);
                    let (qb, rb) = quantized(&mut dev, &y, n, k, lb, Fp8Kind::E4M3);
                    let c0 = values(7, m * n);
                    let c = upload(&mut dev, &c0);
                    let spec = MatmulMxSpec {
                        m,
                        n,
                        k,
                        accumulate,
                    };
                    dev.matmul_mx(MxArg::Quantized(qa), MxArg::Quantized(qb), c, &spec)
                        .unwrap();
                    let start = if accumulate { c0 } else { vec![0.0; m * n] };
                    let want = reference(&ra, &rb, m, n, k, &start);
                    let got = dev.download::<f32>(c).unwrap();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{m}x{n}x{k} {la:?} {lb:?} {kind:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn float_operands_and_both_copies_give_the_same_bits() {
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        let (x, y) = (values(s as u64, m * k), values(50 + s as u64, n * k));
        let mut results = Vec::new();
        for (la, lb) in [
            (MxLayout::Rowwise, MxLayout::Rowwise),
            (MxLayout::Columnwise, MxLayout::Columnwise),
            (MxLayout::Rowwise, MxLayout::Columnwise),
        ] {
            let mut dev = Device::cpu();
            // Stored as each layout says: [outer, k] rowwise, [k, outer] columnwise.
            let store = |v: &[f32], outer, l| match l {
                MxLayout::Rowwise => v.to_vec(),
                MxLayout::Columnwise => transpose(v, outer, k),
            };
            let (xa, yb) = (
                upload(&mut dev, &store(&x, m, la)),
                upload(&mut dev, &store(&y, n, lb)),
            );
            let kind = Fp8Kind::E4M3;
            let c = dev.alloc(DType::F32, m * n);
            let spec = MatmulMxSpec {
                m,
                n,
                k,
                accumulate: false,
            };
            let a = MxArg::Float {
                values: xa,
                layout: la,
                kind,
            };
            let b = MxArg::Float {
                values: yb,
                layout: lb,
                kind,
            };
            dev.matmul_mx(a, b, c, &spec).unwrap();
            results.push(bits(&dev.download::<f32>(c).unwrap()));
            // The same operands quantized by the host quantizer, as planes.
            let (qa, _) = quantized(&mut dev, &x, m, k, la, kind);
            let (qb, _) = quantized(&mut dev, &y, n, k, lb, kind);
            dev.matmul_mx(MxArg::Quantized(qa), MxArg::Quantized(qb), c, &spec)
                .unwrap();
            results.push(bits(&dev.download::<f32>(c).unwrap()));
        }
        // A block's scale and codes depend only on its 32 values, whichever copy holds them.
        assert!(results.windows(2).all(|w| w[0] == w[1]), "{m}x{n}x{k}");
    }
}

/// Relative Frobenius error against the f64 product of the dequantized operands, for this
/// product and for the bf16 tensor-core product of the same (exactly representable) operands;
/// both are f32 summation error, so both stay far below a bf16 rounding (2^-9).
#[test]
fn error_against_f64_is_f32_summation_error_like_the_bf16_gemm() {
    for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
        let mut dev = Device::cpu();
        let (x, y) = (values(s as u64, m * k), values(9 + s as u64, n * k));
        let kind = Fp8Kind::E4M3;
        let (qa, ra) = quantized(&mut dev, &x, m, k, MxLayout::Rowwise, kind);
        let (qb, rb) = quantized(&mut dev, &y, n, k, MxLayout::Rowwise, kind);
        let deq = |l: &Logical, outer: usize| -> Vec<f64> {
            let blocks = k.div_ceil(32);
            (0..outer * k)
                .map(|at| {
                    let (o, t) = (at / k, at % k);
                    let e = i32::from(l.exps[o * blocks + t / 32]) - 127 - frac(l.kind);
                    fp8_integer(l.kind, l.codes[at]).unwrap() as f64 * 2f64.powi(e)
                })
                .collect()
        };
        let (da, db) = (deq(&ra, m), deq(&rb, n));
        let exact: Vec<f64> = (0..m * n)
            .map(|at| {
                (0..k)
                    .map(|t| da[at / n * k + t] * db[at % n * k + t])
                    .sum()
            })
            .collect();
        let c = dev.alloc(DType::F32, m * n);
        let spec = MatmulMxSpec {
            m,
            n,
            k,
            accumulate: false,
        };
        dev.matmul_mx(MxArg::Quantized(qa), MxArg::Quantized(qb), c, &spec)
            .unwrap();
        let mx = dev.download::<f32>(c).unwrap();
        // The bf16 GEMM of the same values: every dequantized value is a bf16 value.
        let mut to_bf16 = |v: &[f64]| -> View {
            let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f64(x)).collect();
            assert!(
                h.iter().zip(v).all(|(h, &x)| h.to_f64() == x),
                "not exact in bf16"
            );
            let d = dev.alloc(DType::Bf16, h.len());
            dev.upload(d, &h).unwrap();
            d
        };
        let (ba, bb) = (to_bf16(&da), to_bf16(&db));
        let tc = MatmulTcSpec {
            trans_b: true,
            ..MatmulTcSpec::new(m, n, k)
        };
        dev.matmul_tc(ba, bb, None, c, &tc).unwrap();
        let bf = dev.download::<f32>(c).unwrap();
        let rel = |got: &[f32]| {
            let num: f64 = got
                .iter()
                .zip(&exact)
                .map(|(g, e)| (f64::from(*g) - e).powi(2))
                .sum();
            let den: f64 = exact.iter().map(|e| e * e).sum();
            (num / den.max(f64::MIN_POSITIVE)).sqrt()
        };
        let (e_mx, e_bf) = (rel(&mx), rel(&bf));
        let bound = (k as f64) * 2f64.powi(-24) * 4.0;
        assert!(
            e_mx <= bound && e_bf <= bound,
            "{m}x{n}x{k}: mx {e_mx:e}, bf16 {e_bf:e}"
        );
    }
}

#[test]
fn nan_codes_and_nan_scales_give_nan_and_empty_k_gives_c() {
    let mut dev = Device::cpu();
    let (m, n, k) = (2, 2, 40);
    let mut x = values(1, m * k);
    x[3] = f32::NAN; // row 0, block 0: encoded as NaN (TE's policy)
    let y = values(2, n * k);
    let kind = Fp8Kind::E4M3;
    let (xa, yb) = (upload(&mut dev, &x), upload(&mut dev, &y));
    let c = dev.alloc(DType::F32, m * n);
    let spec = MatmulMxSpec {
        m,
        n,
        k,
        accumulate: false,
    };
    let a = MxArg::Float {
        values: xa,
        layout: MxLayout::Rowwise,
        kind,
    };
    let b = MxArg::Float {
        values: yb,
        layout: MxLayout::Rowwise,
        kind,
    };
    dev.matmul_mx(a, b, c, &spec).unwrap();
    let got = dev.download::<f32>(c).unwrap();
    assert!(got[0].is_nan() && got[1].is_nan(), "{got:?}");
    assert!(got[2].is_finite() && got[3].is_finite(), "{got:?}");
    // k = 0: C is kept with accumulate, zeroed without.
    let c0 = vec![1.5f32, -2.0, 3.0, 0.25];
    let c = upload(&mut dev, &c0);
    let none = dev.alloc(DType::F32, 0);
    let z = |layout| MxArg::Float {
        values: none,
        layout,
        kind,
    };
    let empty = MatmulMxSpec {
        m,
        n,
        k: 0,
        accumulate: true,
    };
    dev.matmul_mx(z(MxLayout::Rowwise), z(MxLayout::Columnwise), c, &empty)
        .unwrap();
    assert_eq!(dev.download::<f32>(c).unwrap(), c0);
    let empty = MatmulMxSpec {
        accumulate: false,
        ..empty
    };
    dev.matmul_mx(z(MxLayout::Rowwise), z(MxLayout::Columnwise), c, &empty)
        .unwrap();
    assert_eq!(dev.download::<f32>(c).unwrap(), vec![0.0; 4]);
}

#[test]
fn wrong_dtypes_lengths_and_overlaps_are_refused_before_writing() {
    let mut dev = Device::cpu();
    let (m, n, k) = (2, 3, 33);
    let kind = Fp8Kind::E4M3;
    let (qa, _) = quantized(&mut dev, &values(1, m * k), m, k, MxLayout::Rowwise, kind);
    let (qb, _) = quantized(&mut dev, &values(2, n * k), n, k, MxLayout::Rowwise, kind);
    let c0 = values(3, m * n);
    let c = upload(&mut dev, &c0);
    let spec = MatmulMxSpec {
        m,
        n,
        k,
        accumulate: false,
    };
    let (a, b) = (MxArg::Quantized(qa), MxArg::Quantized(qb));
    let err = |dev: &mut Device, a, b, c, spec: &MatmulMxSpec| {
        dev.matmul_mx(a, b, c, spec).unwrap_err().to_string()
    };
    // Scales of the wrong length (one block short).
    let short = MxOperand {
        scales: qa.scales.slice(0..m).unwrap(),
        ..qa
    };
    let e = err(&mut dev, MxArg::Quantized(short), b, c, &spec);
    assert!(e.contains("scales"), "{e}");
    // Data of the wrong dtype.
    let f = dev.alloc(DType::F32, m * k);
    let bad = MxOperand { data: f, ..qa };
    let e = err(&mut dev, MxArg::Quantized(bad), b, c, &spec);
    assert!(e.contains("u8"), "{e}");
    // A C of the wrong length, or of bf16.
    let e = err(&mut dev, a, b, c.slice(0..m * n - 1).unwrap(), &spec);
    assert!(e.contains("C (m·n)"), "{e}");
    let cb = dev.alloc(DType::Bf16, m * n);
    assert!(dev.matmul_mx(a, b, cb, &spec).is_err());
    // A float operand whose length is not outer·k.
    let xf = upload(&mut dev, &values(4, m * k - 1));
    let fa = MxArg::Float {
        values: xf,
        layout: MxLayout::Rowwise,
        kind,
    };
    let e = err(&mut dev, fa, b, c, &spec);
    assert!(e.contains("float operand"), "{e}");
    // C overlapping an operand's bytes: nothing is written.
    let big = upload(&mut dev, &values(5, 64));
    let cc = big.slice(0..m * n).unwrap();
    let bytes = big.reinterpret(DType::U8).unwrap().slice(0..m * k).unwrap();
    let alias = MxOperand { data: bytes, ..qa };
    let before = dev.download::<f32>(big).unwrap();
    assert!(
        dev.matmul_mx(MxArg::Quantized(alias), b, cc, &spec)
            .is_err()
    );
    assert_eq!(
        bits(&dev.download::<f32>(big).unwrap()),
        bits(&before),
        "nothing written"
    );
    assert_eq!(dev.download::<f32>(c).unwrap(), c0, "nothing written");
}
