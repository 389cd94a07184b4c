//! `Device::matmul_tc` on the CPU: the reference arithmetic (bf16 inputs, f32 sums in k order,
//! `fl(fl(alpha·s) + fl(beta·c))`, one rounding to D's dtype) against a naive product, bitwise;
//! in-place and separate C; symmetric products; and every refusal.

use lowbit_device::{DType, Device, DeviceError, MatmulTcSpec, bf16};
use proptest::prelude::*;

fn r16(x: f32) -> f32 {
    bf16::from_f32(x).to_f32()
}

mod common;
use common::{download as get, upload_as as put};

fn at(x: &[f32], rows: usize, cols: usize, trans: bool, i: usize, j: usize) -> f32 {
    if trans {
        x[j * rows + i]
    } else {
        x[i * cols + j]
    }
}

proptest! {
    #[test]
    fn matmul_tc_matches_naive(
        m in 0usize..7, n in 0usize..7, k in 0usize..9,
        trans_a in any::<bool>(), trans_b in any::<bool>(),
        c_mode in 0u8..3, out_bf16 in any::<bool>(),
        alpha in -2.0f32..2.0, beta in -2.0f32..2.0,
        seed in proptest::collection::vec(-8.0f32..8.0, 200),
    ) {
        let mut dev = Device::cpu();
        let out = if out_bf16 { DType::Bf16 } else { DType::F32 };
        let av: Vec<f32> = seed[..m * k].iter().map(|x| r16(*x)).collect();
        let bv: Vec<f32> = seed[100..100 + k * n].iter().map(|x| r16(*x)).collect();
        let c0: Vec<f32> = seed[60..60 + m * n]
            .iter()
            .map(|x| if out_bf16 { r16(*x) } else { *x })
            .collect();
        let a = put(&mut dev, DType::Bf16, &av);
        let b = put(&mut dev, DType::Bf16, &bv);
        let c = put(&mut dev, out, &c0);
        let d = if c_mode == 2 { c } else { put(&mut dev, out, &vec![f32::NAN; m * n]) };
        let beta = if c_mode == 0 { 0.0 } else { beta };
        let spec = MatmulTcSpec { trans_a, trans_b, alpha, beta, ..MatmulTcSpec::new(m, n, k) };
        dev.matmul_tc(a, b, (c_mode > 0).then_some(c), d, &spec).unwrap();
        let got = get(&dev, d);
        for i in 0..m {
            for j in 0..n {
                let mut s = 0f32;
                for l in 0..k {
                    s += at(&av, m, k, trans_a, i, l) * at(&bv, k, n, trans_b, l, j);
                }
                let mut want = alpha * s;
                if c_mode > 0 {
                    want += beta * c0[i * n + j];
                }
                if out_bf16 {
                    want = r16(want);
                }
                prop_assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "({}, {})", i, j);
            }
        }
    }
}

#[test]
fn symmetric_products_are_symmetric_and_equal_the_plain_product() {
    let mut dev = Device::cpu();
    let (n, k) = (24, 40);
    let xv: Vec<f32> = (0..n * k)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
        .collect();
    for trans in [false, true] {
        let x = put(&mut dev, DType::Bf16, &xv);
        let spec = MatmulTcSpec {
            trans_a: trans,
            trans_b: !trans,
            ..MatmulTcSpec::new(n, n, k)
        };
        let plain = dev.alloc(DType::F32, n * n);
        dev.matmul_tc(x, x, None, plain, &spec).unwrap();
        let sym = dev.alloc(DType::F32, n * n);
        let s = MatmulTcSpec {
            symmetric: true,
            ..spec
        };
        dev.matmul_tc(x, x, None, sym, &s).unwrap();
        let (p, q) = (get(&dev, plain), get(&dev, sym));
        assert_eq!(p, q);
        for i in 0..n {
            for j in 0..n {
                assert_eq!(q[i * n + j].to_bits(), q[j * n + i].to_bits());
            }
        }
    }
}

#[test]
fn refusals() {
    let mut dev = Device::cpu();
    let a = dev.alloc(DType::Bf16, 6);
    let b = dev.alloc(DType::Bf16, 6);
    let d = dev.alloc(DType::F32, 4);
    let spec = MatmulTcSpec::new(2, 2, 3);
    let f32_in = dev.alloc(DType::F32, 6);
    assert!(matches!(
        dev.matmul_tc(f32_in, b, None, d, &spec),
        Err(DeviceError::DType { .. })
    ));
    let f16_out = dev.alloc(DType::F16, 4);
    assert!(matches!(
        dev.matmul_tc(a, b, None, f16_out, &spec),
        Err(DeviceError::DType { .. })
    ));
    assert!(matches!(
        dev.matmul_tc(a, b, None, d, &MatmulTcSpec::new(2, 2, 2)),
        Err(DeviceError::Length { .. })
    ));
    let c_bf16 = dev.alloc(DType::Bf16, 4);
    assert!(matches!(
        dev.matmul_tc(a, b, Some(c_bf16), d, &spec),
        Err(DeviceError::DType { .. })
    ));
    let beta = MatmulTcSpec { beta: 1.0, ..spec };
    assert!(matches!(
        dev.matmul_tc(a, b, None, d, &beta),
        Err(DeviceError::Invalid { .. })
    ));
    let nan = MatmulTcSpec {
        alpha: f32::NAN,
        ..spec
    };
    assert!(matches!(
        dev.matmul_tc(a, b, None, d, &nan),
        Err(DeviceError::Invalid { .. })
    ));
    let sym = MatmulTcSpec {
        symmetric: true,
        trans_b: true,
        ..spec
    };
    assert!(matches!(
        dev.matmul_tc(a, b, None, d, &sym),
        Err(DeviceError::Invalid { .. })
    ));
    // D overlapping an input, and a C that overlaps D without being D.
    let big = dev.alloc(DType::F32, 8);
    let (lo, hi) = (big.slice(0..4).unwrap(), big.slice(2..6).unwrap());
    assert!(matches!(
        dev.matmul_tc(a, b, Some(hi), lo, &MatmulTcSpec { beta: 1.0, ..spec }),
        Err(DeviceError::Overlap(_))
    ));
    let ab = dev.alloc(DType::Bf16, 12);
    let (x, y) = (ab.slice(0..6).unwrap(), ab.slice(0..6).unwrap());
    let out = ab.reinterpret(DType::F32).unwrap().slice(2..6).unwrap();
    assert!(matches!(
        dev.matmul_tc(x, y, None, out, &spec),
        Err(DeviceError::Overlap(_))
    ));
    // Nothing was written by a refused call.
    assert!(get(&dev, d).iter().all(|v| *v == 0.0));
}
