//! fill, cast, scale, axpy, add and the reductions against straightforward host computations.

mod common;

use common::{bits, download, round_to, upload_as};
use lowbit_dev_support::rng::xorshift32;
use lowbit_device::{DType, Device, DeviceError, bf16, f16};
use proptest::prelude::*;

const FLOATS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

/// Deterministic test values spanning many magnitudes, with specials.
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    (0..n)
        .map(|i| {
            s = xorshift32(s);
            match i % 97 {
                7 => 0.0,
                8 => -0.0,
                _ => (s as i32 as f32 / i32::MAX as f32) * 2f32.powi((s % 24) as i32 - 12),
            }
        })
        .collect()
}

proptest! {
    /// cast f32 → bf16/f16 equals half's RNE conversions bit for bit, for arbitrary bits
    /// (NaN, Inf, subnormals, ties); widening is exact.
    #[test]
    fn cast_is_halfs_rne(raw in proptest::collection::vec(any::<u32>(), 0..300)) {
        let mut dev = Device::cpu();
        let x: Vec<f32> = raw.iter().map(|&b| f32::from_bits(b)).collect();
        let src = upload_as(&mut dev, DType::F32, &x);
        let b = dev.alloc(DType::Bf16, x.len());
        let h = dev.alloc(DType::F16, x.len());
        dev.cast(src, b).unwrap();
        dev.cast(src, h).unwrap();
        let want_b: Vec<u16> = x.iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
        let want_h: Vec<u16> = x.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        prop_assert_eq!(dev.download::<bf16>(b).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_b);
        prop_assert_eq!(dev.download::<f16>(h).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want_h);
        // Widening back and narrowing between the half types.
        let wide = dev.alloc(DType::F32, x.len());
        dev.cast(b, wide).unwrap();
        prop_assert_eq!(
            bits(&download(&dev, wide)),
            dev.download::<bf16>(b).unwrap().iter().map(|v| v.to_f32().to_bits()).collect::<Vec<_>>()
        );
        let h2 = dev.alloc(DType::F16, x.len());
        dev.cast(b, h2).unwrap();
        let want: Vec<u16> = dev.download::<bf16>(b).unwrap().iter().map(|v| f16::from_f32(v.to_f32()).to_bits()).collect();
        prop_assert_eq!(dev.download::<f16>(h2).unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>(), want);
    }

    /// axpy is `fl_y(fl32(y + fl32(alpha·x)))` for every dtype pair, across chunk boundaries.
    #[test]
    fn axpy_single_rounding(
        xd in 0usize..3, yd in 0usize..3, n in 0usize..2100, seed in any::<u32>(),
        alpha in -4.0f32..4.0,
    ) {
        let (xd, yd) = (FLOATS[xd], FLOATS[yd]);
        let mut dev = Device::cpu();
        let x = upload_as(&mut dev, xd, &values(n, seed));
        let y = upload_as(&mut dev, yd, &values(n, seed ^ 0x55));
        let (xs, ys) = (download(&dev, x), download(&dev, y));
        dev.axpy(alpha, x, y).unwrap();
        let want: Vec<f32> = xs.iter().zip(&ys).map(|(&x, &y)| round_to(yd, y + alpha * x)).collect();
        prop_assert_eq!(bits(&download(&dev, y)), bits(&want));
        dev.add(x, y).unwrap();
        let want: Vec<f32> = xs.iter().zip(&want).map(|(&x, &y)| round_to(yd, y + x)).collect();
        prop_assert_eq!(bits(&download(&dev, y)), bits(&want));
    }
}

#[test]
fn axpy_does_not_fuse_multiply_add() {
    // With alpha = x = 1 + 2^-23, alpha·x = 1 + 2^-22 + 2^-46 exactly; rounded to f32 it is
    // 1 + 2^-22, and adding y = −1 gives 2^-22. A fused multiply-add would give 2^-22 + 2^-46.
    let mut dev = Device::cpu();
    let v = 1.0f32 + f32::EPSILON;
    let x = upload_as(&mut dev, DType::F32, &[v]);
    let y = upload_as(&mut dev, DType::F32, &[-1.0]);
    dev.axpy(v, x, y).unwrap();
    assert_eq!(download(&dev, y)[0], (v * v) - 1.0);
    assert_eq!(download(&dev, y)[0], 2.0 * f32::EPSILON);
}

#[test]
fn fill_and_scale_round_to_the_dtype() {
    let mut dev = Device::cpu();
    for d in FLOATS {
        let v = dev.alloc(d, 1500);
        dev.fill(v, 1.0 / 3.0).unwrap();
        assert!(
            download(&dev, v)
                .iter()
                .all(|&x| x == round_to(d, 1.0 / 3.0))
        );
        dev.scale(v, 3.0).unwrap();
        let want = round_to(d, round_to(d, 1.0 / 3.0) * 3.0);
        assert!(
            download(&dev, v)
                .iter()
                .all(|&x| x.to_bits() == want.to_bits())
        );
    }
    let u = dev.alloc(DType::U8, 4);
    assert!(matches!(
        dev.fill(u, 1.0),
        Err(DeviceError::DType { got: DType::U8, .. })
    ));
    assert!(matches!(dev.scale(u, 1.0), Err(DeviceError::DType { .. })));
}

/// The documented order, written out independently: f64 partial sums of 4096 consecutive
/// squares, each from +0 in index order; the partials of each run of 32 blocks added from +0 in
/// index order; then those group sums added from +0 in index order.
fn blocked_reference(xs: &[f32]) -> f64 {
    let partials: Vec<f64> = xs
        .chunks(4096)
        .map(|b| {
            let mut p = 0f64;
            for &v in b {
                p += f64::from(v) * f64::from(v);
            }
            p
        })
        .collect();
    let mut total = 0f64;
    for group in partials.chunks(32) {
        let mut g = 0f64;
        for p in group {
            g += p;
        }
        total += g;
    }
    total
}

/// `sum_squares_each` is `sum_squares` view by view (empty views included); a non-float view
/// is refused before anything runs.
#[test]
fn sum_squares_each_is_sum_squares_per_view() {
    let mut dev = Device::cpu();
    let views: Vec<_> = FLOATS
        .into_iter()
        .zip([0, 4097, 9000])
        .map(|(d, n)| upload_as(&mut dev, d, &values(n, 7 + n as u32)))
        .collect();
    let want: Vec<u64> = views
        .iter()
        .map(|&v| dev.sum_squares(v).unwrap().to_bits())
        .collect();
    let got: Vec<u64> = dev
        .sum_squares_each(&views)
        .unwrap()
        .iter()
        .map(|s| s.to_bits())
        .collect();
    assert_eq!(got, want);
    let bytes = dev.alloc(DType::U8, 4);
    assert!(dev.sum_squares_each(&[views[1], bytes]).is_err());
}

/// `sum_squares_each_staged` gives `sum_squares_each`'s bits over the final views: `prepare`
/// runs once per stage number present, in increasing order (not for the gap at 2), before that
/// stage's views are read; its error is returned as it is, and mismatched lengths are refused
/// before anything runs. A stage number as large as `usize::MAX` is only a number.
#[test]
fn staged_sums_read_each_stage_after_its_prepare() {
    let mut dev = Device::cpu();
    let lens = [5000usize, 0, 4097, 9000];
    let stage = [1usize, 0, 3, 1];
    let data: Vec<Vec<f32>> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| values(n, 40 + i as u32))
        .collect();
    let views: Vec<_> = lens
        .iter()
        .map(|&n| upload_as(&mut dev, DType::F32, &vec![f32::NAN; n]))
        .collect();
    let mut seen = Vec::new();
    let got = dev
        .sum_squares_each_staged(&views, &stage, |d, k| {
            seen.push(k);
            for i in (0..views.len()).filter(|&i| stage[i] == k) {
                d.upload(views[i], &data[i])?;
            }
            Ok::<(), DeviceError>(())
        })
        .unwrap();
    assert_eq!(seen, [0, 1, 3]);
    let want = dev.sum_squares_each(&views).unwrap();
    assert_eq!(
        got.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
    );
    assert!(got.iter().all(|s| s.is_finite()));
    // An error of `prepare` stops there.
    let mut calls = 0;
    let err = dev
        .sum_squares_each_staged(&views, &stage, |_, k| {
            calls += 1;
            if k == 1 {
                return Err(DeviceError::Unsupported("stop".into()));
            }
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, DeviceError::Unsupported(ref m) if m == "stop"));
    assert_eq!(calls, 2);
    let mut seen = Vec::new();
    let far = [usize::MAX, 0, usize::MAX, 7];
    let again = dev
        .sum_squares_each_staged(&views, &far, |_, k| {
            seen.push(k);
            Ok::<(), DeviceError>(())
        })
        .unwrap();
    assert_eq!(seen, [0, 7, usize::MAX]);
    assert_eq!(
        again.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        want.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
    );
    let err = dev
        .sum_squares_each_staged(&views, &stage[..2], |_, _| -> Result<(), DeviceError> {
            panic!("prepare must not run")
        })
        .unwrap_err();
    assert!(matches!(err, DeviceError::Length { a: 4, b: 2, .. }));
}

#[test]
fn sum_squares_is_blocked_f64_in_index_order() {
    assert_eq!(lowbit_device::SUM_BLOCK, 4096);
    let mut dev = Device::cpu();
    for d in FLOATS {
        for n in [
            0,
            1,
            4095,
            4096,
            4097,
            5000,
            3 * 4096 + 17,
            40_000,
            32 * 4096 + 1,
            300_007,
        ] {
            let x = upload_as(&mut dev, d, &values(n, 3 + n as u32));
            let xs = download(&dev, x);
            let want = blocked_reference(&xs);
            assert_eq!(
                dev.sum_squares(x).unwrap().to_bits(),
                want.to_bits(),
                "{d:?} {n}"
            );
            // An offset view starts its blocks at its own first element.
            if n > 2 {
                let v = x.slice(2..n).unwrap();
                let want = blocked_reference(&xs[2..]);
                assert_eq!(dev.sum_squares(v).unwrap().to_bits(), want.to_bits());
            }
        }
    }
    // The order is observable: after 2^54 (ulp 4) a running sum absorbs every 1, but the ones
    // of the later blocks are summed exactly before the partials meet.
    let mut vals = vec![1f32; 3 * 4096];
    vals[0] = 2f32.powi(27);
    let x = upload_as(&mut dev, DType::F32, &vals);
    let sequential = vals
        .iter()
        .fold(0f64, |s, &v| s + f64::from(v) * f64::from(v));
    assert_eq!(sequential, 2f64.powi(54));
    assert_eq!(dev.sum_squares(x).unwrap(), 2f64.powi(54) + 8192.0);
    // The groups are observable: with 2^54 in block 0, each later block's sum of 1 is absorbed
    // by a running sum of the blocks (ulp 4), but the 32 ones of group 1 (blocks 32..64) meet
    // in their own sum first.
    assert_eq!(lowbit_device::SUM_GROUP, 32);
    let mut vals = vec![0f32; 64 * 4096];
    vals[0] = 2f32.powi(27);
    for b in 1..64 {
        vals[b * 4096 + 7] = 1.0;
    }
    let two_levels = (1..64).fold(2f64.powi(54), |s, _| s + 1.0);
    assert_eq!(two_levels, 2f64.powi(54));
    let x = upload_as(&mut dev, DType::F32, &vals);
    assert_eq!(dev.sum_squares(x).unwrap(), 2f64.powi(54) + 32.0);
    assert_eq!(blocked_reference(&vals), 2f64.powi(54) + 32.0);
    let big = 3.0e38f32;
    let v = upload_as(&mut dev, DType::F32, &[big, big]);
    let sq = f64::from(big) * f64::from(big);
    assert_eq!(dev.sum_squares(v).unwrap(), sq + sq, "no f32 overflow");
}

#[test]
fn has_non_finite_and_max_abs() {
    let mut dev = Device::cpu();
    for d in FLOATS {
        let mut vals = values(3000, 9);
        let x = upload_as(&mut dev, d, &vals);
        assert!(!dev.has_non_finite(x).unwrap());
        let want = download(&dev, x).iter().fold(0f32, |m, v| m.max(v.abs()));
        assert_eq!(dev.max_abs(x).unwrap(), want);
        // NaN is ignored by the amax but detected as non-finite.
        vals[2500] = f32::NAN;
        vals[10] = -f32::NAN;
        let y = upload_as(&mut dev, d, &vals);
        assert!(dev.has_non_finite(y).unwrap());
        assert_eq!(dev.max_abs(y).unwrap(), want);
        vals[1200] = f32::NEG_INFINITY;
        let z = upload_as(&mut dev, d, &vals);
        assert_eq!(dev.max_abs(z).unwrap(), f32::INFINITY);
    }
    let all_nan = upload_as(&mut dev, DType::F32, &[f32::NAN; 3]);
    assert_eq!(dev.max_abs(all_nan).unwrap(), 0.0);
    let u = dev.alloc(DType::U8, 3);
    assert!(dev.max_abs(u).is_err());
    assert!(dev.sum_squares(u).is_err());
    assert!(dev.has_non_finite(u).is_err());
}

#[test]
fn errors_leave_memory_untouched() {
    let mut dev = Device::cpu();
    let x = upload_as(&mut dev, DType::F32, &[1.0, 2.0, 3.0]);
    let y = upload_as(&mut dev, DType::Bf16, &[5.0, 6.0]);
    let before = dev.read_bytes(y).unwrap();
    assert_eq!(
        dev.axpy(1.0, x, y),
        Err(DeviceError::Length {
            what: "axpy",
            a: 3,
            b: 2
        })
    );
    assert!(matches!(dev.add(x, y), Err(DeviceError::Length { .. })));
    assert!(matches!(dev.cast(x, y), Err(DeviceError::Length { .. })));
    let u = dev.alloc(DType::U8, 2);
    assert!(matches!(
        dev.cast(u, y),
        Err(DeviceError::DType { what: "cast", .. })
    ));
    assert!(matches!(
        dev.axpy(1.0, y, u),
        Err(DeviceError::DType { .. })
    ));
    assert_eq!(dev.read_bytes(y).unwrap(), before);
    assert_eq!(download(&dev, x), [1.0, 2.0, 3.0]);
}
