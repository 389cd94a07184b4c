//! `Device::op_calls`: every quantization entry point counts its own calls, one per call
//! (refused calls included), and nothing else moves a counter.

use lowbit_device::{
    CountedOp, DType, Device, Fp8Kind, Mxfp8Config, Mxfp8Views, Nvfp4Config, Nvfp4Views,
};

fn counts(dev: &Device) -> Vec<u64> {
    CountedOp::ALL.iter().map(|&op| dev.op_calls(op)).collect()
}

/// The counters after one call of `op` on a device whose counters were `before`.
fn one_more(before: &[u64], op: CountedOp) -> Vec<u64> {
    CountedOp::ALL
        .iter()
        .zip(before)
        .map(|(&o, &n)| n + u64::from(o == op))
        .collect()
}

#[test]
fn each_quantization_entry_point_counts_its_calls() {
    let mut dev = Device::cpu();
    assert_eq!(counts(&dev), vec![0; CountedOp::ALL.len()]);
    let (rows, cols) = (64, 64);
    let n = rows * cols;
    let x = dev.alloc(DType::F32, n);
    dev.upload(x, &(0..n).map(|i| (i as f32).sin()).collect::<Vec<_>>())
        .unwrap();
    // Ops that are not quantizations count nothing.
    let y = dev.alloc(DType::Bf16, n);
    dev.cast(x, y).unwrap();
    dev.scale(x, 0.5).unwrap();
    assert_eq!(counts(&dev), vec![0; CountedOp::ALL.len()]);

    let u8s =
        |dev: &mut Device, a: usize, b: usize| (dev.alloc(DType::U8, a), dev.alloc(DType::U8, b));
    let mx = Mxfp8Views {
        rowwise: Some(u8s(&mut dev, n, rows * cols / 32)),
        columnwise: Some(u8s(&mut dev, n, rows / 32 * cols)),
    };
    let before = counts(&dev);
    dev.quantize_mxfp8(y, rows, cols, &Mxfp8Config::default(), &mx)
        .unwrap();
    assert_eq!(counts(&dev), one_more(&before, CountedOp::QuantizeMxfp8));
    // A refused call (wrong shape) is still a call of the entry point.
    let before = counts(&dev);
    assert!(
        dev.quantize_mxfp8(y, rows, cols + 1, &Mxfp8Config::default(), &mx)
            .is_err()
    );
    assert_eq!(counts(&dev), one_more(&before, CountedOp::QuantizeMxfp8));

    let nv = Nvfp4Views {
        rowwise: Some(u8s(&mut dev, n / 2, n / 16)),
        columnwise: Some(u8s(&mut dev, n / 2, n / 16)),
    };
    let before = counts(&dev);
    let cfg = Nvfp4Config {
        two_d: true,
        ..Default::default()
    };
    dev.quantize_nvfp4(y, rows, cols, &cfg, &nv).unwrap();
    assert_eq!(counts(&dev), one_more(&before, CountedOp::QuantizeNvfp4));

    // The sharded 2D ops of the primary-weight paths: fold (not counted), quantize a range,
    // finish.
    let tiles = dev.alloc(DType::F32, (rows / 16) * (cols / 16));
    dev.nvfp4_fold_tile_amax_2d(y, 0, cols, tiles).unwrap();
    let before = counts(&dev);
    let (rd, _) = nv.rowwise.unwrap();
    dev.nvfp4_quantize_2d_range(y, 0, cols, tiles, rd).unwrap();
    assert_eq!(
        counts(&dev),
        one_more(&before, CountedOp::Nvfp4Quantize2dRange)
    );
    let before = counts(&dev);
    dev.nvfp4_finish_2d(rows, cols, tiles, &nv).unwrap();
    assert_eq!(counts(&dev), one_more(&before, CountedOp::Nvfp4Finish2d));

    let tiles = dev.alloc(DType::F32, lowbit_device::mxfp8_tile_count(rows, cols));
    dev.mxfp8_fold_tile_amax_2d(y, 0, cols, tiles).unwrap();
    let (Some((data, row_scales)), Some((_, col_scales))) = (mx.rowwise, mx.columnwise) else {
        unreachable!()
    };
    let before = counts(&dev);
    dev.mxfp8_quantize_2d_range(y, 0, cols, Fp8Kind::E4M3, tiles, data)
        .unwrap();
    assert_eq!(
        counts(&dev),
        one_more(&before, CountedOp::Mxfp8Quantize2dRange)
    );
    let before = counts(&dev);
    dev.mxfp8_scales_2d(rows, cols, Fp8Kind::E4M3, tiles, row_scales, col_scales)
        .unwrap();
    assert_eq!(counts(&dev), one_more(&before, CountedOp::Mxfp8Scales2d));

    // Counters are per device.
    assert_eq!(counts(&Device::cpu()), vec![0; CountedOp::ALL.len()]);
    let names: Vec<&str> = CountedOp::ALL.iter().map(|o| o.name()).collect();
    assert_eq!(
        names,
        [
            "quantize_mxfp8",
            "quantize_nvfp4",
            "mxfp8_quantize_2d_range",
            "nvfp4_quantize_2d_range",
            "mxfp8_scales_2d",
            "nvfp4_finish_2d"
        ]
    );
}
