//! Quantization over views is bit-equal to calling `lowbit-formats` directly.

mod common;
mod stage2d;

use common::{bits, download, round_to, upload_as};
use lowbit_dev_support::rng::{XorShift64, unit24};
use lowbit_device::{
    DType, Device, DeviceError, Fp8Kind, Mxfp8Config, Mxfp8Views, Nvfp4Config, Nvfp4Views, View,
    bf16, f16,
};
use lowbit_formats::{Copies, Matrix, NanPolicy, Source, quantize_mxfp8, quantize_nvfp4};

/// Pseudo-random values with a wide dynamic range, a few zeros.
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut r = XorShift64::new(seed);
    (0..n)
        .map(|i| {
            let s = r.next_u64();
            if i % 41 == 3 {
                0.0
            } else {
                (unit24(s) - 0.5) * 2f32.powi((s % 16) as i32 - 8)
            }
        })
        .collect()
}

fn u8_views(dev: &mut Device, data: usize, scales: usize) -> (View, View) {
    (dev.alloc(DType::U8, data), dev.alloc(DType::U8, scales))
}

fn bytes(dev: &Device, v: Option<(View, View)>) -> Option<(Vec<u8>, Vec<u8>)> {
    v.map(|(d, s)| (dev.read_bytes(d).unwrap(), dev.read_bytes(s).unwrap()))
}

fn mxfp8_views(dev: &mut Device, rows: usize, cols: usize, copies: Copies) -> Mxfp8Views {
    Mxfp8Views {
        rowwise: copies
            .rowwise()
            .then(|| u8_views(dev, rows * cols, rows * cols.div_ceil(32))),
        columnwise: copies
            .columnwise()
            .then(|| u8_views(dev, rows * cols, rows.div_ceil(32) * cols)),
    }
}

fn nvfp4_views(dev: &mut Device, rows: usize, cols: usize, copies: Copies) -> Nvfp4Views {
    Nvfp4Views {
        rowwise: copies
            .rowwise()
            .then(|| u8_views(dev, rows * cols.div_ceil(2), rows * cols.div_ceil(16))),
        columnwise: copies
            .columnwise()
            .then(|| u8_views(dev, cols * rows.div_ceil(2), cols * rows.div_ceil(16))),
    }
}

#[test]
fn mxfp8_bit_equal_to_the_library() {
    let shapes = [(1, 1), (3, 37), (64, 64), (33, 65), (0, 5)];
    let cases = [
        (Fp8Kind::E4M3, Copies::Both, false),
        (Fp8Kind::E5M2, Copies::Rowwise, false),
        (Fp8Kind::E4M3, Copies::Columnwise, false),
        (Fp8Kind::E4M3, Copies::Both, true),
    ];
    for (rows, cols) in shapes {
        let x = values(rows * cols, (rows * 1000 + cols) as u64);
        for d in [DType::F32, DType::Bf16, DType::F16] {
            for (kind, copies, two_d) in cases {
                let cfg = Mxfp8Config {
                    kind,
                    copies,
                    two_d,
                    ..Mxfp8Config::default()
                };
                let mut dev = Device::cpu();
                let src = upload_as(&mut dev, d, &x);
                let out = mxfp8_views(&mut dev, rows, cols, copies);
                dev.quantize_mxfp8(src, rows, cols, &cfg, &out).unwrap();

                let (xb, xh): (Vec<bf16>, Vec<f16>) = (
                    x.iter().map(|&v| bf16::from_f32(v)).collect(),
                    x.iter().map(|&v| f16::from_f32(v)).collect(),
                );
                let source = match d {
                    DType::F32 => Source::F32(&x),
                    DType::Bf16 => Source::Bf16(&xb),
                    _ => Source::F16(&xh),
                };
                let t =
                    quantize_mxfp8(&Matrix::new("x", rows, cols, source).unwrap(), &cfg).unwrap();
                let want = |p: &Option<lowbit_formats::QuantPlane>| {
                    p.as_ref().map(|p| (p.data.clone(), p.scales.clone()))
                };
                assert_eq!(
                    bytes(&dev, out.rowwise),
                    want(&t.rowwise),
                    "{rows}x{cols} {d:?}"
                );
                assert_eq!(bytes(&dev, out.columnwise), want(&t.columnwise));

                // Dequantization into f32 and bf16 equals the library's values (rounded).
                let n = rows * cols;
                for dd in [DType::F32, DType::Bf16] {
                    let dst = dev.alloc(dd, n);
                    if let Some((qd, qs)) = out.rowwise {
                        dev.dequantize_mxfp8_rowwise(qd, qs, rows, cols, kind, dst)
                            .unwrap();
                        assert_dequantized(&dev, dst, &t.dequantize_rowwise().unwrap());
                    }
                    if let Some((qd, qs)) = out.columnwise {
                        dev.dequantize_mxfp8_columnwise(qd, qs, rows, cols, kind, dst)
                            .unwrap();
                        assert_dequantized(&dev, dst, &t.dequantize_columnwise().unwrap());
                    }
                }
            }
        }
    }
}

/// The device's dequantization in `dst` equals the library's, `want`, rounded to `dst`'s dtype.
#[track_caller]
fn assert_dequantized(dev: &Device, dst: View, want: &[f32]) {
    let want: Vec<f32> = want.iter().map(|&x| round_to(dst.dtype(), x)).collect();
    assert_eq!(bits(&download(dev, dst)), bits(&want));
}

#[test]
fn nvfp4_bit_equal_to_the_library() {
    let shapes = [(1, 1), (16, 16), (5, 33), (32, 48), (48, 17)];
    let cfgs = [
        Nvfp4Config::default(),
        Nvfp4Config {
            copies: Copies::Rowwise,
            ..Nvfp4Config::default()
        },
        Nvfp4Config {
            two_d: true,
            ..Nvfp4Config::default()
        },
        Nvfp4Config {
            rht: true,
            stochastic_rounding: Some(7),
            ..Nvfp4Config::default()
        },
    ];
    for (rows, cols) in shapes {
        let x = values(rows * cols, (rows * 77 + cols) as u64);
        for cfg in cfgs {
            if cfg.rht && rows % 16 != 0 {
                continue;
            }
            let mut dev = Device::cpu();
            let src = upload_as(&mut dev, DType::Bf16, &x);
            let out = nvfp4_views(&mut dev, rows, cols, cfg.copies);
            let amax = dev.quantize_nvfp4(src, rows, cols, &cfg, &out).unwrap();
            let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
            let t = quantize_nvfp4(
                &Matrix::new("x", rows, cols, Source::Bf16(&xb)).unwrap(),
                &cfg,
            )
            .unwrap();
            assert_eq!(amax.rowwise.to_bits(), t.amax_rowwise.to_bits());
            assert_eq!(amax.columnwise.to_bits(), t.amax_columnwise.to_bits());
            let want = |p: &Option<lowbit_formats::QuantPlane>| {
                p.as_ref().map(|p| (p.data.clone(), p.scales.clone()))
            };
            assert_eq!(bytes(&dev, out.rowwise), want(&t.rowwise));
            assert_eq!(bytes(&dev, out.columnwise), want(&t.columnwise));

            let dst = dev.alloc(DType::F32, rows * cols);
            if let Some((qd, qs)) = out.rowwise {
                dev.dequantize_nvfp4_rowwise(qd, qs, amax.rowwise, rows, cols, dst)
                    .unwrap();
                assert_dequantized(&dev, dst, &t.dequantize_rowwise().unwrap());
            }
            if let Some((qd, qs)) = out.columnwise {
                dev.dequantize_nvfp4_columnwise(qd, qs, amax.columnwise, t.rht, rows, cols, dst)
                    .unwrap();
                assert_dequantized(&dev, dst, &t.dequantize_columnwise().unwrap());
            }
        }
    }
}

#[test]
fn nvfp4_deferred_equals_the_synchronous_call() {
    // Deferred calls read back together give the synchronous call's bytes and amaxes, in call
    // order, whatever the configuration (1D, 2D, Hadamard); bad views are refused as the
    // synchronous call refuses them, before anything is written.
    let cases = [
        ((32usize, 48usize), Nvfp4Config::default(), 1.0f32),
        (
            (16, 16),
            Nvfp4Config {
                rht: true,
                ..Nvfp4Config::default()
            },
            40.0,
        ),
        (
            (48, 17),
            Nvfp4Config {
                two_d: true,
                ..Nvfp4Config::default()
            },
            1e-3,
        ),
    ];
    let mut dev = Device::cpu();
    let mut pending = Vec::new();
    let mut want = Vec::new();
    for (k, &((rows, cols), cfg, scale)) in cases.iter().enumerate() {
        let x: Vec<f32> = values(rows * cols, 40 + k as u64)
            .iter()
            .map(|v| v * scale)
            .collect();
        let src = upload_as(&mut dev, DType::Bf16, &x);
        let sync = nvfp4_views(&mut dev, rows, cols, cfg.copies);
        let deferred = nvfp4_views(&mut dev, rows, cols, cfg.copies);
        let amax = dev.quantize_nvfp4(src, rows, cols, &cfg, &sync).unwrap();
        pending.push(
            dev.quantize_nvfp4_deferred(src, rows, cols, &cfg, &deferred)
                .unwrap(),
        );
        assert_eq!(bytes(&dev, deferred.rowwise), bytes(&dev, sync.rowwise));
        assert_eq!(
            bytes(&dev, deferred.columnwise),
            bytes(&dev, sync.columnwise)
        );
        want.push(amax);
    }
    let got = dev.read_nvfp4_amaxes(pending).unwrap();
    assert_eq!(got, want);
    assert_ne!(got[0].rowwise, got[1].rowwise);
    assert!(dev.read_nvfp4_amaxes(Vec::new()).unwrap().is_empty());

    let src = upload_as(&mut dev, DType::Bf16, &values(32 * 32, 9));
    let out = nvfp4_views(&mut dev, 32, 33, Copies::Both);
    assert!(matches!(
        dev.quantize_nvfp4_deferred(src, 32, 32, &Nvfp4Config::default(), &out),
        Err(DeviceError::Length {
            what: "quantize_nvfp4 rowwise data",
            ..
        })
    ));
    let (d, _) = out.rowwise.unwrap();
    assert!(dev.read_bytes(d).unwrap().iter().all(|&b| b == 0));
}

#[test]
fn quantize_view_errors_write_nothing() {
    let mut dev = Device::cpu();
    let (rows, cols) = (4, 40);
    let src = upload_as(&mut dev, DType::F32, &values(rows * cols, 1));
    let cfg = Mxfp8Config::default(); // both copies
    let good = mxfp8_views(&mut dev, rows, cols, Copies::Both);
    let untouched = |dev: &Device, v: &Mxfp8Views| {
        [v.rowwise, v.columnwise]
            .into_iter()
            .flatten()
            .all(|(d, s)| {
                dev.read_bytes(d)
                    .unwrap()
                    .iter()
                    .chain(&dev.read_bytes(s).unwrap())
                    .all(|&b| b == 0)
            })
    };

    // A requested copy without views, and views for a copy not requested.
    let missing = Mxfp8Views {
        columnwise: None,
        ..good
    };
    assert!(matches!(
        dev.quantize_mxfp8(src, rows, cols, &cfg, &missing),
        Err(DeviceError::Invalid { .. })
    ));
    let rowwise_only = Mxfp8Config {
        copies: Copies::Rowwise,
        ..cfg
    };
    assert!(matches!(
        dev.quantize_mxfp8(src, rows, cols, &rowwise_only, &good),
        Err(DeviceError::Invalid { .. })
    ));
    // Wrong lengths and dtypes.
    let (d, _) = good.rowwise.unwrap();
    let short_scales = Mxfp8Views {
        rowwise: Some((d, dev.alloc(DType::U8, rows))),
        ..good
    };
    assert!(matches!(
        dev.quantize_mxfp8(src, rows, cols, &cfg, &short_scales),
        Err(DeviceError::Length {
            what: "quantize_mxfp8 rowwise scales",
            a: 4,
            b: 8
        })
    ));
    let f32_data = Mxfp8Views {
        rowwise: Some((dev.alloc(DType::F32, rows * cols), good.rowwise.unwrap().1)),
        ..good
    };
    assert!(matches!(
        dev.quantize_mxfp8(src, rows, cols, &cfg, &f32_data),
        Err(DeviceError::DType { .. })
    ));
    assert!(matches!(
        dev.quantize_mxfp8(src, rows + 1, cols, &cfg, &good),
        Err(DeviceError::Length { .. })
    ));
    assert!(matches!(
        dev.quantize_mxfp8(src, usize::MAX, 2, &cfg, &good),
        Err(DeviceError::Invalid { .. })
    ));
    // Outputs overlapping each other or the source.
    let (_, cs) = good.columnwise.unwrap();
    let shared = Mxfp8Views {
        columnwise: Some((d, cs)),
        ..good
    };
    assert_eq!(
        dev.quantize_mxfp8(src, rows, cols, &cfg, &shared),
        Err(DeviceError::Overlap("quantize_mxfp8"))
    );
    let src_bytes = src.reinterpret(DType::U8).unwrap();
    let into_src = Mxfp8Views {
        columnwise: Some((src_bytes.slice(0..rows * cols).unwrap(), cs)),
        ..good
    };
    assert_eq!(
        dev.quantize_mxfp8(src, rows, cols, &cfg, &into_src),
        Err(DeviceError::Overlap("quantize_mxfp8"))
    );
    // A format error (non-finite input under NanPolicy::Error) names the element.
    let mut bad = values(rows * cols, 1);
    bad[45] = f32::INFINITY;
    let bad_src = upload_as(&mut dev, DType::F32, &bad);
    let strict = Mxfp8Config {
        nan_policy: NanPolicy::Error,
        ..cfg
    };
    assert!(matches!(
        dev.quantize_mxfp8(bad_src, rows, cols, &strict, &good),
        Err(DeviceError::Format(
            lowbit_formats::FormatError::NonFinite { row: 1, col: 5, .. }
        ))
    ));
    assert!(untouched(&dev, &good));
    // A U8 source is not a float view.
    let u = dev.alloc(DType::U8, rows * cols);
    assert!(matches!(
        dev.quantize_mxfp8(u, rows, cols, &cfg, &good),
        Err(DeviceError::DType { .. })
    ));
}

#[test]
fn nvfp4_and_dequantize_errors() {
    let mut dev = Device::cpu();
    let (rows, cols) = (8, 32);
    let src = upload_as(&mut dev, DType::F32, &values(rows * cols, 5));
    // RHT needs rows % 16 == 0: the library's error, before any write.
    let cfg = Nvfp4Config {
        rht: true,
        ..Nvfp4Config::default()
    };
    let out = nvfp4_views(&mut dev, rows, cols, Copies::Both);
    assert!(matches!(
        dev.quantize_nvfp4(src, rows, cols, &cfg, &out),
        Err(DeviceError::Format(
            lowbit_formats::FormatError::Unsupported { .. }
        ))
    ));
    let (d, s) = out.rowwise.unwrap();
    assert!(dev.read_bytes(d).unwrap().iter().all(|&b| b == 0));
    // Columnwise data has the transposed shape: cols·ceil(rows/2).
    let wrong = Nvfp4Views {
        columnwise: Some((
            dev.alloc(DType::U8, rows * cols.div_ceil(2) + 1),
            out.columnwise.unwrap().1,
        )),
        ..out
    };
    assert!(matches!(
        dev.quantize_nvfp4(src, rows, cols, &Nvfp4Config::default(), &wrong),
        Err(DeviceError::Length {
            what: "quantize_nvfp4 columnwise data",
            ..
        })
    ));
    // Dequantize: wrong scale length, u8 destination, destination overlapping the data.
    let dst = dev.alloc(DType::F32, rows * cols);
    assert!(matches!(
        dev.dequantize_nvfp4_rowwise(d, d, 1.0, rows, cols, dst),
        Err(DeviceError::Length { .. })
    ));
    assert!(matches!(
        dev.dequantize_nvfp4_rowwise(d, s, 1.0, rows, cols, d),
        Err(DeviceError::DType { .. })
    ));
    let big = dev.alloc(DType::U8, rows * cols * 4);
    let inside = big.reinterpret(DType::F32).unwrap();
    let scales = dev.alloc(DType::U8, rows * cols.div_ceil(32));
    let data = big.slice(0..rows * cols).unwrap();
    assert_eq!(
        dev.dequantize_mxfp8_rowwise(data, scales, rows, cols, Fp8Kind::E4M3, inside),
        Err(DeviceError::Overlap("dequantize_mxfp8_rowwise"))
    );
    // A Hadamard-transformed columnwise copy needs rows % 16 == 0.
    let (cd, cs) = out.columnwise.unwrap();
    assert!(matches!(
        dev.dequantize_nvfp4_columnwise(cd, cs, 1.0, true, rows, cols, dst),
        Err(DeviceError::Invalid { .. })
    ));
}

#[test]
fn sharded_ranges_the_tiles_do_not_cover_are_errors_not_panics() {
    let mut dev = Device::cpu();
    let x = dev.alloc(DType::F32, 64);
    let q = dev.alloc(DType::U8, 64);
    let p = dev.alloc(DType::U8, 32);
    // 64 elements of an 8-column matrix are 8 rows: one 32x32 tile, one 16x16 tile.
    let none = dev.alloc(DType::F32, 0);
    let one = dev.alloc(DType::F32, 1);
    for (cols, tiles) in [(8, none), (0, one)] {
        assert!(matches!(
            dev.mxfp8_quantize_2d_range(x, 0, cols, Fp8Kind::E4M3, tiles, q),
            Err(DeviceError::Invalid { .. })
        ));
        assert!(matches!(
            dev.nvfp4_quantize_2d_range(x, 0, cols, tiles, p),
            Err(DeviceError::Invalid { .. })
        ));
    }
    // A range past the tiles (elements 64.. of a 64-row matrix need a second tile row).
    assert!(matches!(
        dev.mxfp8_quantize_2d_range(x, 64 * 8 * 4, 8, Fp8Kind::E4M3, one, q),
        Err(DeviceError::Invalid { .. })
    ));
    assert!(matches!(
        dev.mxfp8_quantize_2d_range(x, usize::MAX, 8, Fp8Kind::E4M3, one, q),
        Err(DeviceError::Invalid { .. })
    ));
    // Covered: fine, and nothing panics for an empty range either.
    dev.mxfp8_quantize_2d_range(x, 0, 8, Fp8Kind::E4M3, one, q)
        .unwrap();
    dev.nvfp4_quantize_2d_range(x, 0, 8, one, p).unwrap();
    let empty = x.slice(0..0).unwrap();
    dev.mxfp8_quantize_2d_range(empty, 0, 0, Fp8Kind::E4M3, none, q.slice(0..0).unwrap())
        .unwrap();
}

/// Output views of `rows × cols` for `cfg.copies`, carved from `buf` (u8) from byte `at` on,
/// each view starting `gap` bytes after the previous one ends (so views sit at odd offsets
/// next to each other); returns the views and the next free byte.
fn carved_views(
    buf: View,
    at: usize,
    gap: usize,
    (rows, cols): (usize, usize),
    copies: Copies,
) -> (Mxfp8Views, usize) {
    let mut next = at;
    let mut take = |n: usize| {
        let v = buf.slice(next + gap..next + gap + n).unwrap();
        next += gap + n;
        v
    };
    let rowwise = copies
        .rowwise()
        .then(|| (take(rows * cols), take(rows * cols.div_ceil(32))));
    let columnwise = copies
        .columnwise()
        .then(|| (take(rows * cols), take(rows.div_ceil(32) * cols)));
    (
        Mxfp8Views {
            rowwise,
            columnwise,
        },
        next,
    )
}

/// The bytes of every view of `out`.
fn all_bytes(dev: &Device, out: &Mxfp8Views) -> Vec<Option<(Vec<u8>, Vec<u8>)>> {
    vec![bytes(dev, out.rowwise), bytes(dev, out.columnwise)]
}

#[test]
fn mxfp8_many_equals_one_call_per_item() {
    // Shapes off the 32 and 256 grids, an empty matrix, one row, one column.
    let shapes = [
        (64, 256),
        (37, 45),
        (0, 5),
        (1, 1),
        (96, 512),
        (33, 65),
        (5, 0),
        (70, 8),
        (1, 300),
        (40, 1),
    ];
    let cfgs = [
        Mxfp8Config::default(),
        Mxfp8Config {
            kind: Fp8Kind::E5M2,
            copies: Copies::Rowwise,
            ..Mxfp8Config::default()
        },
        Mxfp8Config {
            copies: Copies::Columnwise,
            ..Mxfp8Config::default()
        },
        Mxfp8Config {
            two_d: true,
            ..Mxfp8Config::default()
        },
        Mxfp8Config {
            nan_policy: NanPolicy::Error,
            ..Mxfp8Config::default()
        },
    ];
    let total: usize = shapes.iter().map(|(r, c)| r * c).sum();
    for cfg in cfgs {
        let mut dev = Device::cpu();
        // Sources: views at odd element offsets inside one buffer per dtype, dtypes mixed.
        let dtypes = [DType::Bf16, DType::F32, DType::F16];
        let bufs: Vec<View> = dtypes
            .iter()
            .enumerate()
            .map(|(i, &d)| upload_as(&mut dev, d, &values(total + 64, 11 + i as u64)))
            .collect();
        let mut at = [3usize; 3];
        let srcs: Vec<View> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(r, c))| {
                let k = i % 3;
                let v = bufs[k].slice(at[k]..at[k] + r * c).unwrap();
                at[k] += r * c + 1;
                v
            })
            .collect();
        // Outputs of the many call and of the per-item calls, each set carved from one buffer.
        let per_item_bytes = |(r, c): (usize, usize)| 4 * r * c + 2 * (r + c) + 64;
        let room: usize = shapes.iter().map(|&s| per_item_bytes(s)).sum();
        let (many_buf, one_buf) = (dev.alloc(DType::U8, room), dev.alloc(DType::U8, room));
        let (mut a, mut b) = (0, 0);
        let mut items = Vec::new();
        let mut singles = Vec::new();
        for (&src, &(rows, cols)) in srcs.iter().zip(&shapes) {
            let (out, next) = carved_views(many_buf, a, 3, (rows, cols), cfg.copies);
            a = next;
            items.push((src, rows, cols, out));
            let (out, next) = carved_views(one_buf, b, 3, (rows, cols), cfg.copies);
            b = next;
            singles.push((src, rows, cols, out));
        }
        let before = dev.op_calls(lowbit_device::CountedOp::QuantizeMxfp8);
        dev.quantize_mxfp8_many(&items, &cfg).unwrap();
        assert_eq!(
            dev.op_calls(lowbit_device::CountedOp::QuantizeMxfp8),
            before + items.len() as u64,
            "one count per item"
        );
        for (src, rows, cols, out) in &singles {
            dev.quantize_mxfp8(*src, *rows, *cols, &cfg, out).unwrap();
        }
        for (m, s) in items.iter().zip(&singles) {
            assert_eq!(
                all_bytes(&dev, &m.3),
                all_bytes(&dev, &s.3),
                "{}x{} {:?} {cfg:?}",
                m.1,
                m.2,
                m.0.dtype()
            );
        }
        // Every byte outside the views (the gaps) is untouched, so nothing was written past a
        // view either.
        let written = dev.read_bytes(many_buf).unwrap();
        let theirs = dev.read_bytes(one_buf).unwrap();
        assert_eq!(written, theirs);
        // An empty list is fine and counts nothing.
        let n = dev.op_calls(lowbit_device::CountedOp::QuantizeMxfp8);
        dev.quantize_mxfp8_many(&[], &cfg).unwrap();
        assert_eq!(dev.op_calls(lowbit_device::CountedOp::QuantizeMxfp8), n);
    }
}

#[test]
fn mxfp8_many_errors_write_nothing() {
    let mut dev = Device::cpu();
    let cfg = Mxfp8Config::default();
    let shapes = [(32, 64), (4, 40), (33, 7)];
    let mut items = Vec::new();
    for (i, &(rows, cols)) in shapes.iter().enumerate() {
        let src = upload_as(&mut dev, DType::Bf16, &values(rows * cols, 40 + i as u64));
        let out = mxfp8_views(&mut dev, rows, cols, Copies::Both);
        items.push((src, rows, cols, out));
    }
    let untouched = |dev: &Device, items: &[(View, usize, usize, Mxfp8Views)]| {
        items.iter().all(|(_, _, _, out)| {
            all_bytes(dev, out)
                .into_iter()
                .flatten()
                .all(|(d, s)| d.iter().chain(&s).all(|&b| b == 0))
        })
    };
    let calls = |dev: &Device| dev.op_calls(lowbit_device::CountedOp::QuantizeMxfp8);

    // An invalid last item: the error of its own call, and the valid items before it are not
    // written either. Every item still counts.
    let (d, _) = items[2].3.rowwise.unwrap();
    let mut bad = items.clone();
    bad[2].3.rowwise = Some((d, dev.alloc(DType::U8, 1)));
    let want = dev.quantize_mxfp8(bad[2].0, bad[2].1, bad[2].2, &cfg, &bad[2].3);
    assert!(matches!(want, Err(DeviceError::Length { .. })));
    let n = calls(&dev);
    assert_eq!(dev.quantize_mxfp8_many(&bad, &cfg), want);
    assert_eq!(calls(&dev), n + 3);
    assert!(untouched(&dev, &items));

    // A wrong shape, a missing copy.
    let mut bad = items.clone();
    bad[1].1 += 1;
    assert!(matches!(
        dev.quantize_mxfp8_many(&bad, &cfg),
        Err(DeviceError::Length { .. })
    ));
    let mut bad = items.clone();
    bad[0].3.columnwise = None;
    assert!(matches!(
        dev.quantize_mxfp8_many(&bad, &cfg),
        Err(DeviceError::Invalid { .. })
    ));
    assert!(untouched(&dev, &items));

    // Across items: an output shared by two items, an output inside another item's source.
    let mut bad = items.clone();
    bad[1].3.columnwise.as_mut().unwrap().1 = bad[2].3.columnwise.unwrap().0.slice(0..40).unwrap();
    assert_eq!(
        dev.quantize_mxfp8_many(&bad, &cfg),
        Err(DeviceError::Overlap("quantize_mxfp8"))
    );
    let src_bytes = items[0].0.reinterpret(DType::U8).unwrap();
    let mut bad = items.clone();
    bad[1].3.rowwise.as_mut().unwrap().1 = src_bytes.slice(8..16).unwrap();
    assert_eq!(
        dev.quantize_mxfp8_many(&bad, &cfg),
        Err(DeviceError::Overlap("quantize_mxfp8"))
    );
    assert!(untouched(&dev, &items));

    // A non-finite input under NanPolicy::Error in the last item: its format error, nothing
    // written for the items before it.
    let strict = Mxfp8Config {
        nan_policy: NanPolicy::Error,
        ..cfg
    };
    let (rows, cols) = (4, 40);
    let mut x = values(rows * cols, 41);
    x[45] = f32::NAN;
    let mut bad = items.clone();
    bad[1].0 = upload_as(&mut dev, DType::F32, &x);
    assert!(matches!(
        dev.quantize_mxfp8_many(&bad, &strict),
        Err(DeviceError::Format(
            lowbit_formats::FormatError::NonFinite { row: 1, col: 5, .. }
        ))
    ));
    assert!(untouched(&dev, &items));

    // Items sharing a source are fine (inputs may overlap).
    let mut twice = items.clone();
    twice[1].0 = twice[0].0;
    (twice[1].1, twice[1].2) = (twice[0].1, twice[0].2);
    let fresh = mxfp8_views(&mut dev, 32, 64, Copies::Both);
    twice[1].3 = fresh;
    dev.quantize_mxfp8_many(&twice, &cfg).unwrap();
    assert_eq!(all_bytes(&dev, &twice[0].3), all_bytes(&dev, &twice[1].3));
}

/// The many call's overlap rule is the per-op rule over all items' views (outputs pairwise
/// disjoint and disjoint from every source; sources may overlap; empty views as
/// [`View::overlaps`] treats them), on random placements including empty matrices.
#[test]
fn mxfp8_many_overlap_rule_matches_pairwise() {
    let mut r = XorShift64::new(0x5eed);
    let shapes = [(0, 3), (1, 1), (2, 5), (1, 33), (3, 0), (2, 2)];
    let mut seen = [0usize; 2];
    for _ in 0..400 {
        let mut dev = Device::cpu();
        let bytes_buf = dev.alloc(DType::U8, 160);
        let bf16_buf = dev.alloc(DType::Bf16, 64);
        let as_bf16 = bytes_buf.reinterpret(DType::Bf16).unwrap();
        let n = 1 + (r.next_u64() % 3) as usize;
        let mut items = Vec::new();
        for _ in 0..n {
            let (rows, cols) = shapes[(r.next_u64() % shapes.len() as u64) as usize];
            let len = rows * cols;
            let pick =
                |r: &mut XorShift64, room: usize| (r.next_u64() % (room + 1) as u64) as usize;
            let src = if r.next_u64().is_multiple_of(4) {
                let at = pick(&mut r, as_bf16.len() - len);
                as_bf16.slice(at..at + len).unwrap()
            } else {
                let at = pick(&mut r, bf16_buf.len() - len);
                bf16_buf.slice(at..at + len).unwrap()
            };
            let mut view = |n: usize| {
                let at = pick(&mut r, bytes_buf.len() - n);
                bytes_buf.slice(at..at + n).unwrap()
            };
            let out = Mxfp8Views {
                rowwise: Some((view(len), view(rows * cols.div_ceil(32)))),
                columnwise: Some((view(len), view(rows.div_ceil(32) * cols))),
            };
            items.push((src, rows, cols, out));
        }
        let ins: Vec<View> = items.iter().map(|i| i.0).collect();
        let outs: Vec<View> = items
            .iter()
            .flat_map(|i| [i.3.rowwise.unwrap(), i.3.columnwise.unwrap()])
            .flat_map(|(d, s)| [d, s])
            .collect();
        let overlap = outs
            .iter()
            .enumerate()
            .any(|(k, o)| outs[k + 1..].iter().chain(&ins).any(|v| o.overlaps(v)));
        let got = dev.quantize_mxfp8_many(&items, &Mxfp8Config::default());
        if overlap {
            assert_eq!(
                got,
                Err(DeviceError::Overlap("quantize_mxfp8")),
                "{items:?}"
            );
        } else {
            assert_eq!(got, Ok(()), "{items:?}");
        }
        seen[usize::from(overlap)] += 1;
    }
    assert!(seen[0] > 20 && seen[1] > 20, "{seen:?}");
}

/// Sharded-2D NVFP4 inputs of `nvfp4_finish_2d`: the tiles and packed rowwise codes of a
/// `rows × cols` matrix of seed `seed`, and fresh views for the rest.
fn finish_2d_item(
    dev: &mut Device,
    rows: usize,
    cols: usize,
    seed: u64,
) -> (usize, usize, View, Nvfp4Views) {
    let x = upload_as(dev, DType::Bf16, &values(rows * cols, seed));
    let tiles = dev.alloc(DType::F32, rows.div_ceil(16) * cols.div_ceil(16));
    dev.nvfp4_fold_tile_amax_2d(x, 0, cols, tiles).unwrap();
    let views = nvfp4_views(dev, rows, cols, Copies::Both);
    let (rd, _) = views.rowwise.unwrap();
    dev.nvfp4_quantize_2d_range(x, 0, cols, tiles, rd).unwrap();
    (rows, cols, tiles, views)
}

#[test]
fn nvfp4_finish_2d_many_equals_one_call_per_item() {
    let shapes = [(64, 96), (70, 50), (33, 34), (32, 8), (128, 1040)];
    let mut dev = Device::cpu();
    let items: Vec<_> = shapes
        .iter()
        .enumerate()
        .map(|(k, &(r, c))| finish_2d_item(&mut dev, r, c, 50 + k as u64))
        .collect();
    let many = dev.nvfp4_finish_2d_many(&items).unwrap();
    let copies: Vec<_> = items
        .iter()
        .map(|(_, _, _, v)| (bytes(&dev, v.rowwise), bytes(&dev, v.columnwise)))
        .collect();
    let mut one = Vec::new();
    for (k, &(r, c, tiles, views)) in items.iter().enumerate() {
        let fresh = nvfp4_views(&mut dev, r, c, Copies::Both);
        let (rd, _) = views.rowwise.unwrap();
        let (_, rs) = fresh.rowwise.unwrap();
        let out = Nvfp4Views {
            rowwise: Some((rd, rs)),
            columnwise: fresh.columnwise,
        };
        one.push(dev.nvfp4_finish_2d(r, c, tiles, &out).unwrap());
        let got = (bytes(&dev, out.rowwise), bytes(&dev, out.columnwise));
        assert_eq!(got, copies[k], "item {k}");
    }
    assert_eq!(bits(&many), bits(&one));
    assert!(dev.nvfp4_finish_2d_many(&[]).unwrap().is_empty());
    // Deferred: the same amaxes when read, in item order (two calls read in reverse order).
    let (first, second) = items.split_at(2);
    let p1 = dev.nvfp4_finish_2d_many_deferred(first).unwrap();
    let p2 = dev.nvfp4_finish_2d_many_deferred(second).unwrap();
    let mut deferred = dev.read_amaxes(p2).unwrap();
    deferred.splice(0..0, dev.read_amaxes(p1).unwrap());
    assert_eq!(bits(&deferred), bits(&one));
    let empty = dev.nvfp4_finish_2d_many_deferred(&[]).unwrap();
    assert!(dev.read_amaxes(empty).unwrap().is_empty());
    // Several calls read together: each call's amaxes, in the order given, an empty call kept.
    let p1 = dev.nvfp4_finish_2d_many_deferred(first).unwrap();
    let p0 = dev.nvfp4_finish_2d_many_deferred(&[]).unwrap();
    let p2 = dev.nvfp4_finish_2d_many_deferred(second).unwrap();
    let read = dev.read_amaxes_many(vec![p2, p0, p1]).unwrap();
    assert_eq!(read.len(), 3);
    assert_eq!(bits(&read[0]), bits(&one[2..]));
    assert!(read[1].is_empty());
    assert_eq!(bits(&read[2]), bits(&one[..2]));
    assert!(dev.read_amaxes_many(Vec::new()).unwrap().is_empty());
}

#[test]
fn nvfp4_finish_2d_many_errors() {
    let mut dev = Device::cpu();
    let good = finish_2d_item(&mut dev, 32, 32, 7);
    // An item the single op refuses: its error.
    let mut bad = finish_2d_item(&mut dev, 32, 32, 8);
    bad.1 = 30;
    assert!(dev.nvfp4_finish_2d_many(&[good, bad]).is_err());
    // Outputs shared by two valid items: refused (the result would depend on the order).
    let twice = dev.nvfp4_finish_2d_many(&[good, good]).unwrap_err();
    assert!(matches!(twice, DeviceError::Overlap(_)), "{twice:?}");
    // The deferred call refuses the same, before anything is pending.
    assert!(dev.nvfp4_finish_2d_many_deferred(&[good, bad]).is_err());
    let twice = dev
        .nvfp4_finish_2d_many_deferred(&[good, good])
        .unwrap_err();
    assert!(matches!(twice, DeviceError::Overlap(_)), "{twice:?}");
}

#[test]
fn bf16_many_2d_ops_equal_a_cast_and_one_call_per_piece() {
    let many = stage2d::run(&mut Device::cpu(), true).unwrap();
    let one = stage2d::run(&mut Device::cpu(), false).unwrap();
    assert_eq!(many.len(), one.len());
    for (k, (m, o)) in many.iter().zip(&one).enumerate() {
        assert_eq!(m, o, "buffer {k}");
        assert!(m.iter().any(|&b| b != 0), "buffer {k} is all zero");
    }
    let one = stage2d::scales(&mut Device::cpu(), stage2d::ScalesCalls::One).unwrap();
    let many = stage2d::scales(&mut Device::cpu(), stage2d::ScalesCalls::Many(3)).unwrap();
    assert_eq!(many, vec![one; 3].concat());
}

/// 2D MXFP8 scales of shapes whose sizes pass `usize`, or whose views are too short, are
/// errors that name the op, never a wrapped size or a panic; a batched call with one such item
/// writes nothing for the good ones.
#[test]
fn scales_2d_bad_shapes_are_errors_and_write_nothing() {
    let mut dev = Device::cpu();
    let tiles = dev.alloc(DType::F32, 4);
    dev.upload(tiles, &[0.5f32, 1.0, 2.0, 4.0]).unwrap();
    let rs = dev.alloc(DType::U8, 128);
    let cs = dev.alloc(DType::U8, 128);
    let (e4m3, huge) = (Fp8Kind::E4M3, usize::MAX);
    for (rows, cols) in [(huge, huge), (huge, 64), (64, huge), (huge / 2, 33)] {
        let err = dev
            .mxfp8_scales_2d(rows, cols, e4m3, tiles, rs, cs)
            .unwrap_err();
        assert!(
            matches!(
                err,
                DeviceError::Invalid {
                    what: "mxfp8_scales_2d",
                    ..
                }
            ),
            "{rows}x{cols}: {err:?}"
        );
    }
    let good = (64, 64, e4m3, tiles, rs, cs);
    let other = [
        dev.alloc(DType::F32, 4),
        dev.alloc(DType::U8, 8),
        dev.alloc(DType::U8, 8),
    ];
    for bad in [
        (huge, huge, e4m3, other[0], other[1], other[2]),
        (64, 64, e4m3, other[0], other[1], other[2]),
    ] {
        assert!(dev.mxfp8_scales_2d_many(&[good, bad]).is_err());
        assert!(dev.download::<u8>(rs).unwrap().iter().all(|&b| b == 0));
        assert!(dev.download::<u8>(cs).unwrap().iter().all(|&b| b == 0));
    }
    dev.mxfp8_scales_2d_many(&[good]).unwrap();
    assert!(dev.download::<u8>(rs).unwrap().iter().any(|&b| b != 0));
}

/// Completing 2D NVFP4 weights of a shape whose size passes `usize` is an error, not a panic
/// (the rowwise length was compared with an unchecked `rows · cols`).
#[test]
fn nvfp4_finish_2d_absurd_shapes_are_errors() {
    let mut dev = Device::cpu();
    let tiles = dev.alloc(DType::F32, 4);
    let b = [64, 64, 64, 64].map(|n| dev.alloc(DType::U8, n));
    let out = Nvfp4Views {
        rowwise: Some((b[0], b[1])),
        columnwise: Some((b[2], b[3])),
    };
    let h = usize::MAX;
    for (rows, cols) in [(h, 64), (64, h), (h, h), (h / 4, 8)] {
        assert!(dev.nvfp4_finish_2d(rows, cols, tiles, &out).is_err());
        assert!(
            dev.nvfp4_finish_2d_many(&[(rows, cols, tiles, out)])
                .is_err()
        );
    }
}

#[test]
fn bf16_many_2d_errors_write_nothing() {
    use lowbit_device::{Format2d, Piece2d};
    let mut dev = Device::cpu();
    let x = upload_as(&mut dev, DType::F32, &values(64 * 64, 3));
    let tiles = dev.alloc(DType::F32, 16);
    let out = dev.alloc(DType::U8, 64 * 64);
    let piece = |format, src: View, start| Piece2d {
        format,
        src,
        start,
        cols: 64,
        tiles,
    };
    let mx = Format2d::Mxfp8(Fp8Kind::E4M3);
    let good = (
        piece(mx, x.slice(0..100).unwrap(), 0),
        out.slice(0..100).unwrap(),
    );
    // A wrong output length, an odd NVFP4 start, too few tiles, a source aliasing the tiles.
    let short = (good.0, out.slice(100..150).unwrap());
    let odd = (
        piece(Format2d::Nvfp4, x.slice(1..11).unwrap(), 1),
        out.slice(200..205).unwrap(),
    );
    let far = (
        piece(mx, x.slice(0..10).unwrap(), 64 * 64 * 4),
        out.slice(300..310).unwrap(),
    );
    for bad in [short, odd, far] {
        assert!(dev.quantize_2d_range_bf16_many(&[good, bad]).is_err());
    }
    let alias = piece(mx, tiles, 0);
    assert!(dev.fold_tile_amax_2d_bf16_many(&[good.0, alias]).is_err());
    // Two items writing the same bytes, or an output over a source: Overlap.
    let e = dev.quantize_2d_range_bf16_many(&[good, good]).unwrap_err();
    assert!(matches!(e, DeviceError::Overlap(_)), "{e:?}");
    let x8 = x.reinterpret(DType::U8).unwrap().slice(0..100).unwrap();
    let e = dev
        .quantize_2d_range_bf16_many(&[good, (piece(mx, x.slice(200..300).unwrap(), 200), x8)])
        .unwrap_err();
    assert!(matches!(e, DeviceError::Overlap(_)), "{e:?}");
    // Nothing was written.
    assert!(dev.read_bytes(out).unwrap().iter().all(|&b| b == 0));
    assert!(
        bits(&dev.download::<f32>(tiles).unwrap())
            .iter()
            .all(|&b| b == 0)
    );
    // Empty calls are fine.
    dev.fold_tile_amax_2d_bf16_many(&[]).unwrap();
    dev.quantize_2d_range_bf16_many(&[]).unwrap();
}
