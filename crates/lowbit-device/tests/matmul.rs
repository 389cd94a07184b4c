//! matmul against a naive k-ordered f32 product (bitwise) and an f64 product (tolerance).

mod common;

use common::{round_to, upload_as};
use lowbit_device::{DType, Device, DeviceError, MatmulMode, MatmulSpec, View};
use proptest::prelude::*;

/// Element (i, j) of op(X) for X stored row-major `[r, c]` of op(X) or its transpose.
fn at(x: &[f32], rows: usize, cols: usize, trans: bool, i: usize, j: usize) -> f32 {
    if trans {
        x[j * rows + i]
    } else {
        x[i * cols + j]
    }
}

/// A `d` view holding `vals` rounded to `d`, and those rounded values.
fn upload(dev: &mut Device, d: DType, vals: &[f32]) -> (View, Vec<f32>) {
    let rounded = vals.iter().map(|&x| round_to(d, x)).collect();
    (upload_as(dev, d, vals), rounded)
}

proptest! {
    #[test]
    fn matmul_matches_naive(
        m in 0usize..7, n in 0usize..7, k in 0usize..9,
        trans_a in any::<bool>(), trans_b in any::<bool>(), accumulate in any::<bool>(),
        a_bf16 in any::<bool>(), b_bf16 in any::<bool>(),
        seed in proptest::collection::vec(-8.0f32..8.0, 200),
    ) {
        let mut dev = Device::cpu();
        let dt = |b| if b { DType::Bf16 } else { DType::F32 };
        let (a, av) = upload(&mut dev, dt(a_bf16), &seed[..m * k]);
        let (b, bv) = upload(&mut dev, dt(b_bf16), &seed[100..100 + k * n]);
        let c0: Vec<f32> = seed[60..60 + m * n].to_vec();
        let (c, _) = upload(&mut dev, DType::F32, &c0);
        let spec = MatmulSpec { m, n, k, trans_a, trans_b, accumulate };
        dev.matmul(a, b, c, &spec).unwrap();
        let got = dev.download::<f32>(c).unwrap();
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut s64, mut mag) = (0f32, 0f64, 0f64);
                for l in 0..k {
                    let x = at(&av, m, k, trans_a, i, l);
                    let y = at(&bv, k, n, trans_b, l, j);
                    s += x * y;
                    s64 += f64::from(x) * f64::from(y);
                    mag += (f64::from(x) * f64::from(y)).abs();
                }
                let old = c0[i * n + j];
                let want = if accumulate { old + s } else { s };
                prop_assert_eq!(got[i * n + j].to_bits(), want.to_bits(), "({}, {})", i, j);
                let want64 = if accumulate { f64::from(old) + s64 } else { s64 };
                let tol = (k as f64 + 1.0) * 2f64.powi(-24) * (mag + f64::from(old).abs());
                prop_assert!((f64::from(got[i * n + j]) - want64).abs() <= tol);
            }
        }
    }

    /// `MatmulMode::Bf16`: the operands rounded to bf16 first, then the exact k-ordered f32
    /// product (on the CPU; CUDA sums the same products in cuBLAS's order).
    #[test]
    fn bf16_mode_is_the_product_of_rounded_operands(
        m in 1usize..6, n in 1usize..6, k in 1usize..9,
        trans_a in any::<bool>(), trans_b in any::<bool>(), accumulate in any::<bool>(),
        seed in proptest::collection::vec(-8.0f32..8.0, 200),
    ) {
        let mut dev = Device::cpu();
        dev.set_matmul_mode(MatmulMode::Bf16);
        prop_assert_eq!(dev.matmul_mode(), MatmulMode::Bf16);
        let (a, _) = upload(&mut dev, DType::F32, &seed[..m * k]);
        let (b, _) = upload(&mut dev, DType::F32, &seed[100..100 + k * n]);
        let c0: Vec<f32> = seed[60..60 + m * n].to_vec();
        let (c, _) = upload(&mut dev, DType::F32, &c0);
        let spec = MatmulSpec { m, n, k, trans_a, trans_b, accumulate };
        let live = dev.allocated_bytes();
        dev.matmul(a, b, c, &spec).unwrap();
        // The cast buffer is kept for the next product: a second one allocates nothing.
        let with_buffer = dev.allocated_bytes();
        let (c2, _) = upload(&mut dev, DType::F32, &c0);
        let live2 = dev.allocated_bytes();
        dev.matmul(a, b, c2, &spec).unwrap();
        prop_assert_eq!(dev.allocated_bytes(), live2);
        prop_assert_eq!(with_buffer - live, 2 * (m * k + k * n));
        dev.release_matmul_scratch().unwrap();
        prop_assert_eq!(dev.allocated_bytes(), live2 - (with_buffer - live));
        let got = dev.download::<f32>(c).unwrap();
        let mut exact = Device::cpu();
        let (ar, _) = upload(&mut exact, DType::Bf16, &seed[..m * k]);
        let (br, _) = upload(&mut exact, DType::Bf16, &seed[100..100 + k * n]);
        let (cr, _) = upload(&mut exact, DType::F32, &c0);
        exact.matmul(ar, br, cr, &spec).unwrap();
        let want = exact.download::<f32>(cr).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        prop_assert_eq!(bits(&got), bits(&want));
    }
}

#[test]
fn matmul_errors() {
    let mut dev = Device::cpu();
    let spec = MatmulSpec {
        m: 2,
        n: 3,
        k: 4,
        trans_a: false,
        trans_b: false,
        accumulate: false,
    };
    let a = dev.alloc(DType::F32, 8);
    let b = dev.alloc(DType::Bf16, 12);
    let c = dev.alloc(DType::F32, 6);
    dev.matmul(a, b, c, &spec).unwrap();
    let c16 = dev.alloc(DType::Bf16, 6);
    assert!(matches!(
        dev.matmul(a, b, c16, &spec),
        Err(DeviceError::DType { .. })
    ));
    assert!(matches!(
        dev.matmul(a, b, c.slice(0..5).unwrap(), &spec),
        Err(DeviceError::Length {
            what: "matmul C (m·n)",
            a: 5,
            b: 6
        })
    ));
    assert!(matches!(
        dev.matmul(b, b, c, &spec),
        Err(DeviceError::Length {
            what: "matmul A (m·k)",
            ..
        })
    ));
    let big = dev.alloc(DType::F32, 20);
    let (a2, c2) = (big.slice(0..8).unwrap(), big.slice(6..12).unwrap());
    assert_eq!(
        dev.matmul(a2, b, c2, &spec),
        Err(DeviceError::Overlap("matmul"))
    );
    let huge = MatmulSpec {
        m: usize::MAX,
        k: 2,
        ..spec
    };
    assert!(matches!(
        dev.matmul(a, b, c, &huge),
        Err(DeviceError::Invalid { .. })
    ));
}
