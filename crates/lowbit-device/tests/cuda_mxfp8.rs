//! The MXFP8 kernels of `crates/lowbit-kernels/mxfp8x.cu` (columnwise-only copies, 2D 32x32 scales, E5M2
//! elements, f32 / f16 / bf16 inputs) against the CPU backend (the oracle): every byte of every
//! output buffer, guard bytes around the views included, must match, and no MXFP8 call may take
//! the host fallback.
//!
//! These tests need a CUDA GPU: without one they fail (they never skip). Run them one at a
//! time (`--test-threads=1`). `mxfp8x_timings` (ignored) prints kernel times on a large tensor.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, Fp8Kind, Mxfp8Config, Mxfp8Views, Result, View};
use lowbit_formats::Copies;

mod support;
use support::{EDGES, encode, gpu, tiled, time, timing_setup, values_with_edges};

/// Edge values of the fp8 formats (about one element in eight is one of these or [`EDGES`]).
const FP8_EDGES: [u32; 4] = [
    0x43E0_0000, // 448
    0x43F0_0000, // 480: an E4M3 tie past the maximum
    0x4760_0000, // 57344
    0xC768_0000, // -59392
];

/// Inputs of a `rows × cols` matrix: wide-range values with edge cases, 32x32 tiles scaled by
/// extreme powers of two (E8M0 clamping at both ends, subnormal codes), whole NaN, Inf and zero
/// blocks along rows and down a column.
fn inputs(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    const TILE_EXP: [i32; 8] = [0, 0, 0, -133, -100, 20, 100, 125];
    let mut v = values_with_edges(rows * cols, seed, &[&EDGES[..], &FP8_EDGES].concat());
    for (i, x) in v.iter_mut().enumerate() {
        let (row, col) = (i / cols, i % cols);
        let t = (row / 32 * 7 + col / 32 * 3 + seed as usize) % TILE_EXP.len();
        let e = TILE_EXP[t];
        // Two steps, so that 2^-133 and 2^125 are not themselves out of range.
        *x = *x * 2f32.powi(e / 2) * 2f32.powi(e - e / 2);
    }
    for row in 0..rows {
        for col in 0..cols.min(64) {
            let i = row * cols + col;
            match (row % 7, col / 32) {
                (3, 0) => v[i] = f32::NAN,
                (5, 1) => v[i] = if col % 2 == 0 { f32::INFINITY } else { -1.0 },
                (6, 0) => v[i] = if col % 3 == 0 { -0.0 } else { 0.0 },
                _ => {}
            }
        }
        if cols > 5 {
            v[row * cols + 5] = f32::from_bits(0xFFC0_0001);
        }
    }
    v
}

/// A buffer of `pad + n + pad` elements filled with `bytes` (repeated) and its middle view.
fn padded(dev: &mut Device, d: DType, n: usize, pad: usize, fill: &[u8]) -> (View, View) {
    let buf = dev.alloc(d, n + 2 * pad);
    let len = (n + 2 * pad) * d.size();
    let bytes: Vec<u8> = fill.iter().copied().cycle().take(len).collect();
    dev.write_bytes(buf, &bytes).unwrap();
    (buf, buf.slice(pad..pad + n).unwrap())
}

/// One quantization on `dev`: the source at element offset `src_pad`, every output view at
/// byte offset `out_pad` inside a buffer of garbage. Returns the bytes of every buffer (guards
/// included) and the call's result.
#[allow(clippy::too_many_arguments)]
fn quantize_on(
    dev: &mut Device,
    d: DType,
    vals: &[f32],
    rows: usize,
    cols: usize,
    cfg: &Mxfp8Config,
    src_pad: usize,
    out_pad: usize,
) -> (Result<()>, Vec<Vec<u8>>) {
    let n = rows * cols;
    let x = encode(d, vals);
    let pad_bytes: Vec<u8> = encode(d, &[1.5f32]);
    let (sbuf, src) = padded(dev, d, n, src_pad, &pad_bytes);
    dev.write_bytes(src, &x).unwrap();
    let mut bufs = vec![sbuf];
    let mut pair = |dev: &mut Device, data: usize, scales: usize, k: u8| {
        let (b0, v0) = padded(dev, DType::U8, data, out_pad, &[0xA5, k]);
        let (b1, v1) = padded(dev, DType::U8, scales, out_pad, &[0x5A, k]);
        bufs.push(b0);
        bufs.push(b1);
        (v0, v1)
    };
    let views = Mxfp8Views {
        rowwise: cfg
            .copies
            .rowwise()
            .then(|| pair(dev, n, rows * cols.div_ceil(32), 1)),
        columnwise: cfg
            .copies
            .columnwise()
            .then(|| pair(dev, n, rows.div_ceil(32) * cols, 2)),
    };
    let r = dev.quantize_mxfp8(src, rows, cols, cfg, &views);
    let bytes = bufs.iter().map(|b| dev.read_bytes(*b).unwrap()).collect();
    for b in bufs {
        dev.free(b).unwrap();
    }
    (r, bytes)
}

const SHAPES: [(usize, usize); 13] = [
    (1, 1),
    (1, 33),
    (3, 17),
    (31, 40),
    (32, 32),
    (33, 257),
    (40, 64),
    (64, 256),
    (65, 264),
    (96, 520),
    (128, 512),
    (70, 1000),
    (256, 1024),
];

/// (copies, two_d) of every MXFP8 mode.
const MODES: [(Copies, bool); 6] = [
    (Copies::Rowwise, false),
    (Copies::Columnwise, false),
    (Copies::Both, false),
    (Copies::Rowwise, true),
    (Copies::Columnwise, true),
    (Copies::Both, true),
];

/// Aligned, misaligned (element offset 1, output byte offset 3), and offset but 16-byte
/// aligned, for inputs of dtype `d`.
fn placements(d: DType) -> Vec<(usize, usize)> {
    vec![(0, 0), (1, 3), (16 / d.size(), 8)]
}

/// [`inputs`] with whole 32x32 tiles of NaN (signs and payloads mixed), a tile whose only
/// non-NaN elements are one column of +-Inf, and a tile of zeros with one NaN column, placed
/// in the tile grid (when the matrix has them) at tile rows and columns 1 and 2.
fn inputs_nan_tiles(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut v = inputs(rows, cols, seed);
    let nans = [0x7FC0_0000u32, 0xFFC0_0001, 0x7F80_0001, 0xFFFF_FFFF];
    for (tr, tc, what) in [(1, 1, 0), (2, 1, 1), (1, 2, 2)] {
        for r in tr * 32..((tr + 1) * 32).min(rows) {
            for c in tc * 32..((tc + 1) * 32).min(cols) {
                let nan = f32::from_bits(nans[(r + c) % nans.len()]);
                v[r * cols + c] = match what {
                    0 => nan,
                    1 if c % 32 == 7 => {
                        if r % 2 == 0 {
                            f32::INFINITY
                        } else {
                            f32::NEG_INFINITY
                        }
                    }
                    1 => nan,
                    _ if c % 32 == 30 => nan,
                    _ => 0.0,
                };
            }
        }
    }
    v
}

/// Every shape of `shapes`, mode, element kind and placement (source element offset, output
/// byte offset) for inputs of dtype `d` from `generate`, CPU vs CUDA with `mxfp8x` kernel version
/// `version` (which only changes the bf16 kernels). Returns the number of cases.
fn check(
    d: DType,
    version: u32,
    shapes: &[(usize, usize)],
    places: &[(usize, usize)],
    generate: fn(usize, usize, u64) -> Vec<f32>,
) -> usize {
    let mut cpu = Device::cpu();
    let mut g = gpu();
    g.set_cuda_kernel_variant("mxfp8x", version).unwrap();
    let mut seed = 0;
    let mut cases = 0;
    let mut failures = Vec::new();
    for &(rows, cols) in shapes {
        for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
            for (copies, two_d) in MODES {
                for &(src_pad, out_pad) in places {
                    seed += 1;
                    let cfg = Mxfp8Config {
                        kind,
                        copies,
                        two_d,
                        ..Mxfp8Config::default()
                    };
                    let vals = generate(rows, cols, seed);
                    let (ra, a) =
                        quantize_on(&mut cpu, d, &vals, rows, cols, &cfg, src_pad, out_pad);
                    let (rb, b) = quantize_on(&mut g, d, &vals, rows, cols, &cfg, src_pad, out_pad);
                    let name = format!(
                        "v{version} {d:?} {rows}x{cols} {kind:?} {copies:?} 2d={two_d} pads=({src_pad},{out_pad})"
                    );
                    assert!(ra.is_ok() && rb.is_ok(), "{name}: {ra:?} vs {rb:?}");
                    for (k, (x, y)) in a.iter().zip(&b).enumerate() {
                        if x != y {
                            let i = x.iter().zip(y).position(|(p, q)| p != q).unwrap_or(0);
                            let bad = x.iter().zip(y).filter(|(p, q)| p != q).count();
                            failures.push(format!(
                                "{name}: buffer {k} ({} bytes): {bad} differ, first at {i}: cpu {:#04x} vs cuda {:#04x}",
                                x.len(),
                                x[i],
                                y[i]
                            ));
                        }
                    }
                    cases += 1;
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {cases} cases differ:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let fb = g.host_fallback_calls();
    assert!(
        fb.iter().all(|(op, _)| *op != "quantize_mxfp8"),
        "MXFP8 took the host fallback: {fb:?}"
    );
    cases
}

#[test]
fn mxfp8x_matches_cpu_for_every_input_dtype() {
    // bf16 under both kernel versions (3, the default, and 2); f32 and f16 have one.
    for (d, version) in [
        (DType::Bf16, 3),
        (DType::Bf16, 2),
        (DType::F32, 3),
        (DType::F16, 3),
    ] {
        let cases = check(d, version, &SHAPES, &placements(d), inputs);
        assert_eq!(cases, SHAPES.len() * 2 * MODES.len() * 3);
    }
}

/// The bf16 kernels of both versions on matrices with interior tiles (version 3's loads
/// issued together) next to tiles on the bottom and right edges, whole-NaN 32x32 tiles among
/// the interior ones, and placements where only the source or only the outputs are
/// misaligned (the vector path, and with it the interior case, must be declined).
#[test]
fn mxfp8x_bf16_interior_and_edge_tiles() {
    const TILED: [(usize, usize); 4] = [(100, 776), (96, 768), (128, 1032), (97, 520)];
    let places = [(0, 0), (0, 3), (1, 0), (8, 8), (8, 1)];
    for version in [3, 2] {
        let cases = check(DType::Bf16, version, &TILED, &places, inputs_nan_tiles);
        assert_eq!(cases, TILED.len() * 2 * MODES.len() * places.len());
    }
}

/// An empty matrix writes nothing and takes no fallback.
#[test]
fn mxfp8x_empty_is_native() {
    let mut g = gpu();
    for (rows, cols) in [(0, 5), (7, 0)] {
        let cfg = Mxfp8Config {
            kind: Fp8Kind::E5M2,
            copies: Copies::Columnwise,
            ..Mxfp8Config::default()
        };
        let (r, _) = quantize_on(&mut g, DType::F32, &[], rows, cols, &cfg, 0, 0);
        r.unwrap();
    }
    assert!(g.host_fallback_calls().is_empty());
}

/// Kernel times on a 16384x16384 tensor against a device copy of the bf16 tensor (same run).
#[test]
#[ignore = "timing: run explicitly on a GPU"]
fn mxfp8x_timings() {
    let (rows, cols) = (16384usize, 16384usize);
    let n = rows * cols;
    let chunk_vals: Vec<f32> = inputs(1024, 1024, 7)
        .into_iter()
        .map(|v| if v.is_finite() { v } else { 0.5 })
        .collect();
    let (mut g, bf16_src, copy) = timing_setup(rows, cols, &chunk_vals);
    let srcs = [
        (DType::Bf16, bf16_src),
        (DType::F32, tiled(&mut g, DType::F32, n, &chunk_vals)),
        (DType::F16, tiled(&mut g, DType::F16, n, &chunk_vals)),
    ];
    let views = |g: &mut Device, copies: Copies| Mxfp8Views {
        rowwise: copies
            .rowwise()
            .then(|| (g.alloc(DType::U8, n), g.alloc(DType::U8, n / 32))),
        columnwise: copies
            .columnwise()
            .then(|| (g.alloc(DType::U8, n), g.alloc(DType::U8, n / 32))),
    };
    let v = [Copies::Rowwise, Copies::Columnwise, Copies::Both].map(|c| views(&mut g, c));
    let cases: [(DType, Fp8Kind, usize, bool); 14] = [
        (DType::Bf16, Fp8Kind::E4M3, 0, false),
        (DType::Bf16, Fp8Kind::E4M3, 2, false),
        (DType::Bf16, Fp8Kind::E4M3, 1, false),
        (DType::Bf16, Fp8Kind::E4M3, 0, true),
        (DType::Bf16, Fp8Kind::E4M3, 2, true),
        (DType::Bf16, Fp8Kind::E5M2, 0, false),
        (DType::Bf16, Fp8Kind::E5M2, 1, false),
        (DType::Bf16, Fp8Kind::E5M2, 2, false),
        (DType::Bf16, Fp8Kind::E5M2, 2, true),
        (DType::F32, Fp8Kind::E4M3, 0, false),
        (DType::F32, Fp8Kind::E4M3, 2, false),
        (DType::F32, Fp8Kind::E4M3, 2, true),
        (DType::F16, Fp8Kind::E4M3, 2, false),
        (DType::F16, Fp8Kind::E5M2, 2, false),
    ];
    for (d, kind, copies, two_d) in cases {
        let src = srcs.iter().find(|(e, _)| *e == d).unwrap().1;
        let cfg = Mxfp8Config {
            kind,
            copies: [Copies::Rowwise, Copies::Columnwise, Copies::Both][copies],
            two_d,
            ..Mxfp8Config::default()
        };
        let t = time(&mut g, 10, |g| {
            g.quantize_mxfp8(src, rows, cols, &cfg, &v[copies]).unwrap();
        });
        println!(
            "{d:?} -> {kind:?} {:?} 2d={two_d}: {t:.1} us = {:.2}x copy time",
            cfg.copies,
            copy / t
        );
    }
    let fb = g.host_fallback_calls();
    assert!(fb.is_empty(), "{fb:?}");
}
