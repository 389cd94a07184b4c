//! The batched 2D staging ops (`fold_tile_amax_2d_bf16_many`, `quantize_2d_range_bf16_many`)
//! against one `cast` to bf16 and one single-piece op per piece, on any device: several pieces
//! of several MXFP8 (E4M3 and E5M2) and NVFP4 matrices in one call, pieces that start and end
//! mid-row and mid-tile, f32 masters whose low bits exercise bf16 rounding (ties included),
//! bf16 and f16 sources, a grouped NVFP4 tensor of three experts (one global amax each), and
//! matrices wide enough for the kernels' vector paths.

#![allow(dead_code)] // each test file uses part of the helpers

use lowbit_device::{DType, Device, Format2d, Fp8Kind, Piece2d, Result, View};

/// (format, rows, cols, experts, source dtype).
const CASES: [(Format2d, usize, usize, usize, DType); 10] = [
    (Format2d::Mxfp8(Fp8Kind::E4M3), 64, 96, 1, DType::F32),
    (Format2d::Mxfp8(Fp8Kind::E4M3), 70, 50, 1, DType::F32),
    (Format2d::Mxfp8(Fp8Kind::E5M2), 33, 34, 1, DType::Bf16),
    (Format2d::Mxfp8(Fp8Kind::E4M3), 96, 2048, 1, DType::F32),
    (Format2d::Mxfp8(Fp8Kind::E4M3), 64, 256, 1, DType::Bf16),
    (Format2d::Nvfp4, 64, 96, 1, DType::F32),
    (Format2d::Nvfp4, 48, 32, 1, DType::F16),
    (Format2d::Nvfp4, 64, 2048, 1, DType::F32),
    (Format2d::Nvfp4, 96, 48, 3, DType::F32),
    (Format2d::Nvfp4, 64, 512, 1, DType::Bf16),
];

/// f32 values over a wide range with random low mantissa bits (bf16 ties every 7th value).
fn master_values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let exp = 127 - 12 + (s >> 40) as u32 % 20;
            let mut bits = (s as u32 & 0x807F_FFFF) | (exp << 23);
            if i % 7 == 3 {
                bits = (bits & 0xFFFF_0000) | 0x8000;
            }
            if i % 53 == 5 {
                bits = 0;
            }
            f32::from_bits(bits)
        })
        .collect()
}

fn upload(dev: &mut Device, d: DType, vals: &[f32]) -> Result<View> {
    let v = dev.alloc(DType::F32, vals.len());
    dev.upload(v, vals)?;
    if d == DType::F32 {
        return Ok(v);
    }
    let w = dev.alloc(d, vals.len());
    dev.cast(v, w)?;
    Ok(w)
}

/// Cut points of a matrix of `n` elements into three pieces, mid-row and mid-tile (even for
/// NVFP4).
fn cuts(format: Format2d, n: usize) -> [usize; 4] {
    let (a, b) = (n / 3 + 5, 2 * n / 3 + 17);
    match format {
        Format2d::Nvfp4 => [0, a & !1, b & !1, n],
        Format2d::Mxfp8(_) => [0, a, b, n],
    }
}

/// Runs every case's staging, batched (`many`) or a cast and single ops per piece, and returns
/// the bytes of every matrix's tiles and codes.
pub fn run(dev: &mut Device, many: bool) -> Result<Vec<Vec<u8>>> {
    let mut folds = Vec::new();
    let mut quants = Vec::new();
    let mut outs = Vec::new();
    for (k, &(format, rows, cols, experts, d)) in CASES.iter().enumerate() {
        let n = rows * cols;
        let master = upload(dev, d, &master_values(n, 11 + k as u64))?;
        let (tr, tc, tile_rows, per_byte) = match format {
            Format2d::Mxfp8(_) => (rows.div_ceil(32), cols.div_ceil(32), 32, 1),
            Format2d::Nvfp4 => (rows.div_ceil(16), cols.div_ceil(16), 16, 2),
        };
        let _ = tile_rows;
        let init: Vec<f32> = (0..tr * tc)
            .map(|i| if i % 5 == 0 { 1e-3 } else { 0.0 })
            .collect();
        let tiles = dev.alloc(DType::F32, tr * tc);
        dev.upload(tiles, &init)?;
        // Codes after 16 guard bytes (the output views start at an offset).
        let out = dev.alloc(DType::U8, 16 + n / per_byte + 16);
        let per = n / experts;
        let expert_tiles = tr * tc / experts;
        for w in cuts(format, n).windows(2) {
            let src = master.slice(w[0]..w[1])?;
            folds.push(Piece2d {
                format,
                src,
                start: w[0],
                cols,
                tiles,
            });
            // Each expert's part with its own tiles, at offsets within the expert.
            for e in 0..experts {
                let (lo, hi) = (w[0].max(e * per), w[1].min((e + 1) * per));
                if lo >= hi {
                    continue;
                }
                let piece = Piece2d {
                    format,
                    src: master.slice(lo..hi)?,
                    start: lo - e * per,
                    cols,
                    tiles: tiles.slice(e * expert_tiles..(e + 1) * expert_tiles)?,
                };
                let o = out.slice(16 + lo / per_byte..16 + hi / per_byte)?;
                quants.push((piece, o));
            }
        }
        outs.push((tiles, out));
    }
    if many {
        dev.fold_tile_amax_2d_bf16_many(&folds)?;
        dev.quantize_2d_range_bf16_many(&quants)?;
    } else {
        let bf16 = |dev: &mut Device, p: &Piece2d| -> Result<View> {
            let v = dev.alloc(DType::Bf16, p.src.len());
            dev.cast(p.src, v)?;
            Ok(v)
        };
        for p in &folds {
            let x = bf16(dev, p)?;
            match p.format {
                Format2d::Mxfp8(_) => dev.mxfp8_fold_tile_amax_2d(x, p.start, p.cols, p.tiles)?,
                Format2d::Nvfp4 => dev.nvfp4_fold_tile_amax_2d(x, p.start, p.cols, p.tiles)?,
            }
        }
        for (p, o) in &quants {
            let x = bf16(dev, p)?;
            match p.format {
                Format2d::Mxfp8(kind) => {
                    dev.mxfp8_quantize_2d_range(x, p.start, p.cols, kind, p.tiles, *o)?
                }
                Format2d::Nvfp4 => dev.nvfp4_quantize_2d_range(x, p.start, p.cols, p.tiles, *o)?,
            }
        }
    }
    let mut bytes = Vec::new();
    for (t, o) in outs {
        bytes.push(dev.read_bytes(t)?);
        bytes.push(dev.read_bytes(o)?);
    }
    Ok(bytes)
}

/// How [`scales`] computes the scales.
#[derive(Clone, Copy, Debug)]
pub enum ScalesCalls {
    /// One `mxfp8_scales_2d` call per matrix.
    One,
    /// The same `mxfp8_scales_2d_many` call this many times, the scales zeroed before each
    /// (on a GPU the first runs fresh, the second makes its graphs, later ones launch them).
    Many(usize),
}

/// Batched 2D MXFP8 scales of every MXFP8 case and of shapes that end the kernel's items
/// part-way: 40x1600 (50 tiles a row: byte-wise rowwise stores), 100x544 (17 tiles a row, a
/// last tile row of 4 rows), 33x16384 (512 tiles a row: two segments per tile row, a last tile
/// row of one row), 70x8224 (257 tiles a row: a segment of one tile), 50x1000 (columns not a
/// multiple of 16: byte-wise columnwise stores), 1100x512 (16 tile rows an item, the last of
/// 3); 13 times over (143 matrices: more than one launch's table holds, 128), against one
/// `mxfp8_scales_2d` each; every other item's scales start 3 bytes into their buffer (the
/// kernel's unaligned stores; 11 shapes a round, so each shape is stored both ways). The bytes
/// of every call (`calls`), one after the other.
pub fn scales(dev: &mut Device, calls: ScalesCalls) -> Result<Vec<Vec<u8>>> {
    let extra = [
        (Format2d::Mxfp8(Fp8Kind::E4M3), 40, 1600, 1, DType::F32),
        (Format2d::Mxfp8(Fp8Kind::E5M2), 100, 544, 1, DType::F32),
        (Format2d::Mxfp8(Fp8Kind::E4M3), 33, 16384, 1, DType::F32),
        (Format2d::Mxfp8(Fp8Kind::E5M2), 70, 8224, 1, DType::F32),
        (Format2d::Mxfp8(Fp8Kind::E4M3), 50, 1000, 1, DType::F32),
        (Format2d::Mxfp8(Fp8Kind::E4M3), 1100, 512, 1, DType::F32),
    ];
    let mut items = Vec::new();
    for rep in 0..13 {
        for (k, &(format, rows, cols, _, _)) in CASES.iter().chain(&extra).enumerate() {
            let Format2d::Mxfp8(kind) = format else {
                continue;
            };
            let t = rows.div_ceil(32) * cols.div_ceil(32);
            let tiles = dev.alloc(DType::F32, t);
            let vals: Vec<f32> = master_values(t, 100 + k as u64 + 17 * rep)
                .iter()
                .map(|v| v.abs())
                .collect();
            dev.upload(tiles, &vals)?;
            let at = 3 * (items.len() % 2);
            let (nr, nc) = (rows * cols.div_ceil(32), rows.div_ceil(32) * cols);
            let rs = dev.alloc(DType::U8, nr + at).slice(at..at + nr)?;
            let cs = dev.alloc(DType::U8, nc + at).slice(at..at + nc)?;
            items.push((rows, cols, kind, tiles, rs, cs));
        }
    }
    let mut bytes = Vec::new();
    let rounds = match calls {
        ScalesCalls::One => 1,
        ScalesCalls::Many(n) => n,
    };
    for _ in 0..rounds {
        for &(_, _, _, _, rs, cs) in &items {
            dev.zero(rs)?;
            dev.zero(cs)?;
        }
        match calls {
            ScalesCalls::One => {
                for &(r, c, kind, t, rs, cs) in &items {
                    dev.mxfp8_scales_2d(r, c, kind, t, rs, cs)?;
                }
            }
            ScalesCalls::Many(_) => dev.mxfp8_scales_2d_many(&items)?,
        }
        for &(_, _, _, _, rs, cs) in &items {
            bytes.push(dev.read_bytes(rs)?);
            bytes.push(dev.read_bytes(cs)?);
        }
    }
    Ok(bytes)
}
