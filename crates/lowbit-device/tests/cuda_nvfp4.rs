//! The NVFP4 kernels of `crates/lowbit-kernels/nvfp4.cu` (2D scales, stochastic rounding, the Hadamard
//! transform and its dequantization, columnwise copies of any row count, `nvfp4_finish_2d`)
//! against the CPU backend (the oracle): every byte of every buffer and every returned value
//! must match; quantized bytes strictly, dequantized floats with NaN as a class.
//!
//! These tests need a CUDA GPU: without one they fail (they never skip). Run them one at a
//! time (`--test-threads=1`). `nvfp4_timings` (ignored) prints kernel times on a large tensor.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, Nvfp4Config, Nvfp4Views, Result, View};
use lowbit_formats::{Copies, NanPolicy};

mod support;
use support::*;

// ---------------------------------------------------------------------------------------------
// NVFP4 variants

/// Quantizes `vals` (as `d`) with `cfg` into fresh views, then dequantizes each copy into a
/// fresh `dst` of dtype `d`; returns the amaxes.
fn quantize_case(
    c: &mut Ctx,
    d: DType,
    vals: &[f32],
    (rows, cols): (usize, usize),
    cfg: &Nvfp4Config,
    seed: u64,
) -> Result<Vec<f64>> {
    let src = c.buf(d, vals);
    let views = nvfp4_views(c, rows, cols, cfg.copies, seed);
    let amax = c.dev.quantize_nvfp4(src, rows, cols, cfg, &views)?;
    if let Some((data, scales)) = views.rowwise {
        let dst = c.rand(d, rows * cols, seed + 5);
        c.dev
            .dequantize_nvfp4_rowwise(data, scales, amax.rowwise, rows, cols, dst)?;
    }
    if let Some((data, scales)) = views.columnwise {
        let dst = c.rand(d, rows * cols, seed + 6);
        let rht = cfg.rht && cfg.copies.columnwise();
        c.dev
            .dequantize_nvfp4_columnwise(data, scales, amax.columnwise, rht, rows, cols, dst)?;
    }
    Ok(vec![f64::from(amax.rowwise), f64::from(amax.columnwise)])
}

/// Every shape, dtype, copy set and input kind (finite, with specials) under `cfg`, plus the
/// amax edge cases (NaN blocks, subnormal and infinite rows, all zeros, an infinite amax).
fn sweep(c: &mut Ctx, shapes: &[(usize, usize)], base: Nvfp4Config) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    let mut k = 0;
    for &(rows, cols) in shapes {
        for d in FLOATS {
            for copies in [Copies::Rowwise, Copies::Columnwise, Copies::Both] {
                if base.rht && copies.columnwise() && !rows.is_multiple_of(16) {
                    continue;
                }
                for specials in [false, true] {
                    k += 10;
                    let vals = if specials {
                        values(rows * cols, k, true)
                    } else {
                        finite(rows * cols, k)
                    };
                    let cfg = Nvfp4Config { copies, ..base };
                    out.extend(quantize_case(c, d, &vals, (rows, cols), &cfg, k + 1)?);
                }
            }
        }
    }
    for d in FLOATS {
        for with_inf in [false, true] {
            k += 10;
            out.extend(quantize_case(
                c,
                d,
                &nan_blocks(with_inf),
                (64, 64),
                &base,
                k,
            )?);
        }
    }
    for vals in [vec![0.0f32; 32 * 16], {
        let mut v = finite(32 * 16, 5);
        v[17] = f32::INFINITY;
        v
    }] {
        k += 10;
        out.extend(quantize_case(c, DType::Bf16, &vals, (32, 16), &base, k)?);
    }
    Ok(out)
}

const SHAPES: [(usize, usize); 8] = [
    (48, 64),
    (37, 45),
    (16, 45),
    (3, 17),
    (64, 256),
    (33, 1),
    (1, 32),
    (80, 48),
];

const RHT_SHAPES: [(usize, usize); 5] = [(48, 64), (16, 45), (64, 256), (32, 1), (16, 16)];

/// Asserts that the CUDA run took no host fallback of the NVFP4 ops.
fn native_nvfp4(o: &Outcome, name: &str) {
    assert!(
        !o.fallbacks.iter().any(|(op, _)| op.contains("nvfp4")),
        "{name} took the host fallback: {:?}",
        o.fallbacks
    );
}

/// [`check`] of [`sweep`] over `shapes` under each of `cfgs`, with no NVFP4 host fallback.
fn check_sweeps(name: &str, shapes: &[(usize, usize)], cfgs: &[Nvfp4Config]) {
    let o = check(name, true, |c| {
        let mut out = Vec::new();
        for &cfg in cfgs {
            out.extend(sweep(c, shapes, cfg)?);
        }
        Ok(out)
    });
    native_nvfp4(&o, name);
}

#[test]
fn nvfp4_2d_matches() {
    let two_d = Nvfp4Config {
        two_d: true,
        ..Nvfp4Config::default()
    };
    check_sweeps("nvfp4 2d", &SHAPES, &[two_d]);
}

#[test]
fn nvfp4_stochastic_rounding_matches() {
    let seeds = [(7u64, false), (0xDEAD_BEEF_1234_5678, false), (42, true)];
    let cfgs = seeds.map(|(seed, two_d)| Nvfp4Config {
        two_d,
        stochastic_rounding: Some(seed),
        ..Nvfp4Config::default()
    });
    check_sweeps("nvfp4 sr", &SHAPES, &cfgs);
}

#[test]
fn nvfp4_hadamard_matches() {
    let cfgs = [None, Some(0x1234_5678_9ABC_DEF0u64)].map(|sr| Nvfp4Config {
        rht: true,
        stochastic_rounding: sr,
        ..Nvfp4Config::default()
    });
    check_sweeps("nvfp4 rht", &RHT_SHAPES, &cfgs);
}

#[test]
fn nvfp4_hadamard_dequantize_of_random_planes_matches() {
    // Random bytes for data and scales (NaN scales 0x7F/0xFF included), every dst dtype.
    let o = check("nvfp4 rht dequantize", true, |c| {
        let mut k = 0;
        for (rows, cols) in [(48usize, 64usize), (16, 45), (32, 1)] {
            for d in FLOATS {
                for amax in [1.5f32, 3.0e38, 0.0] {
                    k += 10;
                    let mut r = Rng::new(k);
                    let mut bytes = |n: usize| -> Vec<f32> {
                        (0..n).map(|_| (r.next() % 256) as f32).collect()
                    };
                    let data = bytes(cols * rows / 2);
                    let scales = bytes(cols * rows / 16);
                    let data = c.buf(DType::U8, &data);
                    let scales = c.buf(DType::U8, &scales);
                    let dst = c.rand(d, rows * cols, k + 1);
                    c.dev
                        .dequantize_nvfp4_columnwise(data, scales, amax, true, rows, cols, dst)?;
                }
            }
        }
        Ok(vec![])
    });
    native_nvfp4(&o, "nvfp4 rht dequantize");
}

#[test]
fn nvfp4_columnwise_of_partial_blocks_matches() {
    // 1D round to nearest with rows % 16 != 0 (the ops.cu columnwise kernel needs whole blocks).
    let o = check("nvfp4 partial columns", true, |c| {
        sweep(
            c,
            &[(37, 45), (3, 17), (33, 1), (1, 32), (17, 16)],
            Nvfp4Config::default(),
        )
    });
    native_nvfp4(&o, "nvfp4 partial columns");
}

#[test]
fn nvfp4_offset_views_match() {
    // Views at odd offsets: the kernels' vector paths (16-byte loads, 8-byte stores) must step
    // aside for unaligned addresses.
    let o = check("nvfp4 offset views", true, |c| {
        let mut out = Vec::new();
        let (rows, cols) = (48usize, 64usize);
        let n = rows * cols;
        for (k, cfg) in [
            Nvfp4Config {
                two_d: true,
                ..Nvfp4Config::default()
            },
            Nvfp4Config {
                stochastic_rounding: Some(11),
                ..Nvfp4Config::default()
            },
            Nvfp4Config {
                rht: true,
                ..Nvfp4Config::default()
            },
        ]
        .into_iter()
        .enumerate()
        {
            for d in FLOATS {
                let seed = 1000 + 10 * k as u64;
                let src = c.buf(d, &finite(n + 3, seed)).slice(3..3 + n)?;
                let mut pair = |len: usize, scales: usize, s: u64| -> Result<(View, View)> {
                    Ok((
                        c.rand(DType::U8, len + 1, s).slice(1..1 + len)?,
                        c.rand(DType::U8, scales, s + 1),
                    ))
                };
                let views = Nvfp4Views {
                    rowwise: Some(pair(n / 2, n / 16, seed + 1)?),
                    columnwise: Some(pair(n / 2, n / 16, seed + 3)?),
                };
                let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
                out.extend([f64::from(amax.rowwise), f64::from(amax.columnwise)]);
            }
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 offset views");
}

#[test]
fn nvfp4_1d_columnwise_versions_match_on_offset_views() {
    // The 1D columnwise copy of ops.cu in version 3 (nvfp4_quantize_cols) and version 4 (the
    // shared-memory transpose nvfp4_quantize_cols_v4, whose 16-byte code and 4-byte scale
    // stores must step aside for views that are only 8- or 1-byte aligned, and which declines
    // sources that are not 16-byte aligned) on views at offsets, shapes on and off its
    // 256 x 64 tiles.
    let o = check("nvfp4 1D columnwise offset views", true, |c| {
        let mut out = Vec::new();
        // Version 5 (the fused both-copies kernel) must leave a columnwise copy alone to v4.
        for version in [3, 4, 5, 6, 7, 8, 9, 10] {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for (k, &(rows, cols)) in [(64usize, 64usize), (320, 72), (96, 8), (48, 136)]
                .iter()
                .enumerate()
            {
                let n = rows * cols;
                // (source element offset, data byte offset, scale byte offset)
                for (j, (xo, dof, so)) in [(0, 0, 0), (8, 8, 1), (8, 8, 4), (3, 1, 2)]
                    .into_iter()
                    .enumerate()
                {
                    let seed = 3000 + 100 * k as u64 + 10 * j as u64 + u64::from(version);
                    let vals = if j % 2 == 0 {
                        finite(n + xo, seed)
                    } else {
                        values(n + xo, seed, true)
                    };
                    let src = c.buf(DType::Bf16, &vals).slice(xo..xo + n)?;
                    let mut pair = |len: usize, scales: usize, s: u64| -> Result<(View, View)> {
                        Ok((
                            c.rand(DType::U8, len + dof, s).slice(dof..dof + len)?,
                            c.rand(DType::U8, scales + so, s + 1)
                                .slice(so..so + scales)?,
                        ))
                    };
                    let views = Nvfp4Views {
                        rowwise: None,
                        columnwise: Some(pair(n / 2, n / 16, seed + 3)?),
                    };
                    let cfg = Nvfp4Config {
                        copies: Copies::Columnwise,
                        ..Nvfp4Config::default()
                    };
                    let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
                    out.push(f64::from(amax.columnwise));
                }
            }
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 1D columnwise offset views");
}

/// `n` bytes of seeded noise as a recorded U8 buffer: outputs start from it, so a byte that a
/// kernel fails to write (or writes outside its view) differs from the CPU's.
fn poison(c: &mut Ctx, n: usize, seed: u64) -> View {
    let mut r = Rng::new(seed);
    let bytes: Vec<f32> = (0..n).map(|_| (r.next() % 256) as f32).collect();
    c.buf(DType::U8, &bytes)
}

/// A `rows x cols` input (rows % 16 == 0, cols >= 32) with the 1x16 block edge cases at fixed
/// places, some in the last (partial) 256x64 tile: a whole NaN row block, whole NaN column
/// blocks (at the start and in the last rows and column), a row of bf16 subnormals, a row of
/// ±Inf and zeros (`inf`; else a large finite amax), a row block of ±0 and an all-zero 16x16
/// tile (zero row and column blocks). Elsewhere random values, with sprinkled NaN, ±Inf and
/// subnormals when `specials`, else finite.
fn block_cases(rows: usize, cols: usize, seed: u64, specials: bool, inf: bool) -> Vec<f32> {
    let n = rows * cols;
    let mut v = if specials {
        values(n, seed, true)
    } else {
        finite(n, seed)
    };
    let big = if inf { f32::INFINITY } else { 3.0e4 };
    v[..16].fill(f32::NAN);
    for c in 0..cols {
        let sign = if c % 2 == 0 { 1.0 } else { -1.0 };
        if rows > 1 {
            v[cols + c] = f32::from_bits(0x0001_0000 * (c as u32 % 7 + 1)) * sign;
        }
        if rows > 2 {
            v[2 * cols + c] = if c % 3 == 0 { big * sign } else { 0.0 };
        }
    }
    if rows >= 32 {
        for r in 16..32 {
            v[r * cols + 3] = f32::from_bits(0xFFC0_0001);
        }
    }
    if rows >= 48 {
        for r in rows - 16..rows {
            for c in 16..32 {
                v[r * cols + c] = 0.0;
            }
            v[r * cols + cols - 1] = f32::NAN;
        }
        for c in cols - 16..cols - 1 {
            v[(rows - 1) * cols + c] = if c % 2 == 0 { -0.0 } else { 0.0 };
        }
    }
    v
}

#[test]
fn nvfp4_1d_both_copies_versions_match() {
    // Both 1D copies of ops.cu with version 3 (nvfp4_quantize_rows_v3 + nvfp4_quantize_cols),
    // 4 (+ nvfp4_quantize_cols_v4) and 5 (nvfp4_quantize_both_v5: one kernel, one read of X),
    // each against the CPU byte for byte, into poisoned outputs with guard bytes. Shapes on
    // and off the 256 x 64 tiles (rows 272 and 48, cols 96 and 160: a half-width last tile
    // column; cols 72: v5 declines, cols % 32 != 0); views at offsets where v5 runs (x 16 bytes
    // in, column data 8-byte or scales 1-byte aligned: v4's narrower stores) and where it must
    // fall back to v3/v4 or further (row data 8-byte or row scales 1-byte aligned, x
    // misaligned). The last three shapes end in a partial 256-row tile: 4144 = 16·256 + 48
    // rows (rows % 32 != 0: 8-byte code and byte scale stores; the last tile's first warp has
    // three column blocks), 5152 = 20·256 + 32 rows of one 64-column strip (rows % 32 == 0:
    // one 16-byte code store of the last tile's two blocks where aligned; rows % 64 != 0: byte
    // scale stores), 2064 = 8·256 + 16 rows (a last tile of one block) with a half-width last
    // strip.
    let shapes = [
        (272usize, 96usize),
        (48, 160),
        (512, 1024),
        (256, 64),
        (16, 32),
        (64, 72),
        (4144, 192),
        (5152, 64),
        (2064, 96),
        // Version 6's 512-row tile pairs with a last pair of one block row, over many column
        // tiles: 528 = 512 + 16 rows by 4096 columns (row scale runs of 256 bytes), 1040 =
        // 2·512 + 16 rows by 1120 columns (70 scale bytes a row, a half-width last tile).
        (528, 4096),
        (1040, 1120),
    ];
    // (source element offset, row data, row scale, column data, column scale byte offsets)
    let offsets = [
        (0usize, 0usize, 0usize, 0usize, 0usize),
        (8, 0, 2, 8, 1),
        (0, 16, 2, 16, 4),
        (0, 8, 0, 0, 0),
        (0, 0, 1, 0, 0),
        (3, 1, 1, 1, 1),
    ];
    let o = check("nvfp4 1D both copies versions", true, |c| {
        let mut out = Vec::new();
        for version in [3, 4, 5, 6, 7, 8, 9, 10] {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for (k, &(rows, cols)) in shapes.iter().enumerate() {
                let n = rows * cols;
                for (j, &(xo, rdo, rso, cdo, cso)) in offsets.iter().enumerate() {
                    let seed = 5000 + 100 * k as u64 + 10 * j as u64;
                    let specials = j % 2 == 1;
                    let mut vals = vec![0.25; xo];
                    vals.extend(block_cases(rows, cols, seed, specials, specials));
                    let src = c.buf(DType::Bf16, &vals).slice(xo..xo + n)?;
                    let mut view = |len: usize, off: usize, s: u64| -> Result<View> {
                        poison(c, off + len + 16, s).slice(off..off + len)
                    };
                    let (rb, rs) = (rows * cols.div_ceil(2), rows * cols.div_ceil(16));
                    let views = Nvfp4Views {
                        rowwise: Some((view(rb, rdo, seed + 1)?, view(rs, rso, seed + 2)?)),
                        columnwise: Some((
                            view(n / 2, cdo, seed + 3)?,
                            view(n / 16, cso, seed + 4)?,
                        )),
                    };
                    let amax =
                        c.dev
                            .quantize_nvfp4(src, rows, cols, &Nvfp4Config::default(), &views)?;
                    out.extend([f64::from(amax.rowwise), f64::from(amax.columnwise)]);
                }
            }
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 1D both copies versions");
}

#[test]
fn nvfp4_library_refusals_stay_the_host_errors() {
    let o = check("nvfp4 refusals", false, |c| {
        let src = c.buf(DType::Bf16, &finite(37 * 32, 9));
        let mut errs = Vec::new();
        for (rows, cols, cfg) in [
            (
                32,
                37,
                Nvfp4Config {
                    rht: true,
                    two_d: true,
                    ..Nvfp4Config::default()
                },
            ),
            (
                37,
                32,
                Nvfp4Config {
                    rht: true,
                    ..Nvfp4Config::default()
                },
            ),
        ] {
            let views = nvfp4_views(c, rows, cols, cfg.copies, 70);
            errs.push(
                c.dev
                    .quantize_nvfp4(src, rows, cols, &cfg, &views)
                    .unwrap_err(),
            );
        }
        let nan = c.buf(DType::F32, &values(64, 3, true));
        let views = nvfp4_views(c, 4, 16, Copies::Both, 80);
        let cfg = Nvfp4Config {
            nan_policy: NanPolicy::Error,
            two_d: true,
            ..Nvfp4Config::default()
        };
        errs.push(c.dev.quantize_nvfp4(nan, 4, 16, &cfg, &views).unwrap_err());
        Ok(messages(&errs))
    });
    fallbacks_only(&o, &["quantize_nvfp4"]);
}

#[test]
fn nvfp4_finish_2d_matches() {
    let o = check("nvfp4 finish 2d", false, |c| {
        let mut out = Vec::new();
        // Also a single row of tiles and a single row.
        let thin = [(16, 2, DType::Bf16, 4), (1, 40, DType::F32, 5)];
        for (rows, cols, d, seed) in SHARDED_2D_CASES.into_iter().chain(thin) {
            let n = rows * cols;
            let x = c.buf(d, &values(n, 900 + seed, seed % 2 == 0));
            let cuts = [0, (n / 3) & !1, (2 * n / 3) & !1, n];
            let shards = nvfp4_shards_2d(c, x, (rows, cols), &cuts, 904 + seed)?;
            out.push(nvfp4_finish_shards_2d(c, (rows, cols), shards, 904 + seed)?);
            // The same bytes as a whole-tensor 2D quantization.
            let whole = nvfp4_views(c, rows, cols, Copies::Both, 908 + seed);
            let cfg = Nvfp4Config {
                two_d: true,
                ..Nvfp4Config::default()
            };
            let a = c.dev.quantize_nvfp4(x, rows, cols, &cfg, &whole)?;
            out.push(f64::from(a.rowwise));
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 finish 2d");
    // Arguments the library rejects come back as its errors (through the host path).
    let o = check("nvfp4 finish 2d errors", false, |c| {
        let tiles = c.buf(DType::F32, &[0.5; 4]);
        let q = c.rand(DType::U8, 64, 10);
        let mut errs = Vec::new();
        for (rows, cols, views) in [
            // Odd column count.
            (
                16,
                3,
                [
                    q.slice(0..24)?,
                    q.slice(24..27)?,
                    q.slice(27..51)?,
                    q.slice(51..54)?,
                ],
            ),
            // Scale lengths off by one.
            (
                16,
                16,
                [
                    q.slice(0..8)?,
                    q.slice(8..24)?,
                    q.slice(24..32)?,
                    q.slice(32..40)?,
                ],
            ),
        ] {
            let [rd, rs, cd, cs] = views;
            let v = Nvfp4Views {
                rowwise: Some((rd, rs)),
                columnwise: Some((cd, cs)),
            };
            errs.push(
                c.dev
                    .nvfp4_finish_2d(rows, cols, tiles.slice(0..1)?, &v)
                    .unwrap_err(),
            );
        }
        Ok(messages(&errs))
    });
    fallbacks_only(&o, &["nvfp4_finish_2d"]);
}

/// Shapes of `nvfp4_finish_2d_many`: the batched kernel's (rows % 32 == 0, cols % 8 == 0: whole
/// CTAs, a partial CTA row, a partial CTA column, cols % 16 == 8, a single thread row) and the
/// per-matrix kernel's (rows % 32 != 0, cols % 8 != 0); two shapes twice (one launch of the
/// same-shape kernel, version 3, holds both); partial 256x256 tiles of version 3 in both
/// directions (320 x 264); whole ones (256 x 512: version 4's 16-byte scale stores of both
/// copies); version 5's 512x512 blocks partial both ways, with scale rows and columns that end
/// inside a 16-byte half (800 x 1304: tr 50, tc 82), and whole (1024 x 1536).
const FINISH_MANY_SHAPES: [(usize, usize); 14] = [
    (256, 512),
    (320, 264),
    (64, 96),
    (128, 1040),
    (96, 40),
    (32, 8),
    (64, 512),
    (70, 50),
    (64, 96),
    (33, 34),
    (48, 64),
    (128, 1040),
    (800, 1304),
    (1024, 1536),
];

/// `e` matrices of `rows x cols` in shared buffers, 2D-quantized from bf16 values (seed
/// `seed`, specials with `odd`), as `nvfp4_finish_2d_many` items: rowwise codes and tile amaxes
/// filled, the other outputs random. With `odd`, every scale view and the last matrix's
/// columnwise data sit one byte in (guard bytes around the outputs; the last matrix then takes
/// the per-matrix kernel); else all views are packed from offset 0.
fn grouped_2d(
    c: &mut Ctx,
    (rows, cols, e): (usize, usize, usize),
    seed: u64,
    odd: bool,
) -> Result<Vec<(usize, usize, View, Nvfp4Views)>> {
    let (n, n2, n16, g) = (
        rows * cols,
        rows * cols / 2,
        rows * cols / 16,
        usize::from(odd),
    );
    let nt = n / 256;
    let x = c.buf(DType::Bf16, &values(e * n, seed, odd));
    let tiles = c.buf(DType::F32, &vec![0.0; e * nt]);
    let packed = c.rand(DType::U8, e * n2, seed + 1);
    for k in 0..e {
        let xk = x.slice(k * n..(k + 1) * n)?;
        let tk = tiles.slice(k * nt..(k + 1) * nt)?;
        c.dev.nvfp4_fold_tile_amax_2d(xk, 0, cols, tk)?;
        c.dev
            .nvfp4_quantize_2d_range(xk, 0, cols, tk, packed.slice(k * n2..(k + 1) * n2)?)?;
    }
    let rs = c.rand(DType::U8, e * n16 + 2 * g, seed + 2);
    let cd = c.rand(DType::U8, e * n2 + 2 * g, seed + 3);
    let cs = c.rand(DType::U8, e * n16 + 2 * g, seed + 4);
    let mut items = Vec::new();
    for k in 0..e {
        let at = g * usize::from(k + 1 == e);
        let views = Nvfp4Views {
            rowwise: Some((
                packed.slice(k * n2..(k + 1) * n2)?,
                rs.slice(g + k * n16..g + (k + 1) * n16)?,
            )),
            columnwise: Some((
                cd.slice(at + k * n2..at + (k + 1) * n2)?,
                cs.slice(g + k * n16..g + (k + 1) * n16)?,
            )),
        };
        items.push((rows, cols, tiles.slice(k * nt..(k + 1) * nt)?, views));
    }
    Ok(items)
}

#[test]
fn nvfp4_finish_2d_many_matches() {
    let o = check("nvfp4 finish 2d many", false, |c| {
        let mut out = Vec::new();
        for version in [7, 6, 5, 4, 3, 2, 1] {
            c.dev.set_cuda_kernel_variant("nvfp4_finish_2d", version)?;
            // Every shape from sharded quantization, outputs in fresh buffers.
            let mut parts = Vec::new();
            for (k, &(rows, cols)) in FINISH_MANY_SHAPES.iter().enumerate() {
                let (n, seed) = (rows * cols, 1000 + 10 * k as u64);
                let d = FLOATS[k % 3];
                let x = c.buf(d, &values(n, seed, k % 2 == 0));
                let cuts = [0, (n / 3) & !1, (2 * n / 3) & !1, n];
                parts.push(nvfp4_shards_2d(c, x, (rows, cols), &cuts, seed)?);
            }
            let mut items = Vec::new();
            for (k, (&(rows, cols), &(tiles, packed))) in
                FINISH_MANY_SHAPES.iter().zip(&parts).enumerate()
            {
                let seed = 2000 + 10 * k as u64;
                let views = Nvfp4Views {
                    rowwise: Some((packed, c.rand(DType::U8, rows * cols.div_ceil(16), seed))),
                    columnwise: Some((
                        c.rand(DType::U8, cols * rows.div_ceil(2), seed + 1),
                        c.rand(DType::U8, cols * rows.div_ceil(16), seed + 2),
                    )),
                };
                items.push((rows, cols, tiles, views));
            }
            out.extend(
                c.dev
                    .nvfp4_finish_2d_many(&items)?
                    .into_iter()
                    .map(f64::from),
            );
            // Three 64x64 experts of one grouped tensor (views into shared buffers), the
            // columnwise data of the last one at an odd offset (the per-matrix kernel), with
            // guard bytes around every output.
            let experts = grouped_2d(c, (64, 64, 3), 3000, true)?;
            out.extend(
                c.dev
                    .nvfp4_finish_2d_many(&experts)?
                    .into_iter()
                    .map(f64::from),
            );
            // 70 matrices of one shape: more than one launch of the same-shape kernels holds
            // (64), so version 3 splits them.
            let many = grouped_2d(c, (32, 64, 70), 3100, false)?;
            out.extend(
                c.dev
                    .nvfp4_finish_2d_many(&many)?
                    .into_iter()
                    .map(f64::from),
            );
            // Deferred: two groups completed, then their amaxes read (the last first).
            let (a, b) = many.split_at(30);
            let (pa, pb) = (
                c.dev.nvfp4_finish_2d_many_deferred(a)?,
                c.dev.nvfp4_finish_2d_many_deferred(b)?,
            );
            let (vb, va) = (c.dev.read_amaxes(pb)?, c.dev.read_amaxes(pa)?);
            out.extend(va.into_iter().chain(vb).map(f64::from));
            // The same two groups and an empty call read together (one wait), in the order
            // given.
            let (pa, pb) = (
                c.dev.nvfp4_finish_2d_many_deferred(a)?,
                c.dev.nvfp4_finish_2d_many_deferred(b)?,
            );
            let p0 = c.dev.nvfp4_finish_2d_many_deferred(&[])?;
            let read = c.dev.read_amaxes_many(vec![pb, p0, pa])?;
            assert_eq!(read.iter().map(Vec::len).collect::<Vec<_>>(), [40, 0, 30]);
            out.extend(read[2].iter().chain(&read[0]).map(|&v| f64::from(v)));
            // Three shapes in one call, 172 512x512 blocks (version 7's one launch per 64
            // matrices: two here), partial blocks in both directions, the last matrix of each
            // shape's columnwise data at an odd offset (the per-matrix kernel).
            let mut mixed = grouped_2d(c, (32, 64, 70), 3200, true)?;
            mixed.extend(grouped_2d(c, (96, 1040, 30), 3300, true)?);
            mixed.extend(grouped_2d(c, (800, 1312, 2), 3400, false)?);
            out.extend(
                c.dev
                    .nvfp4_finish_2d_many(&mixed)?
                    .into_iter()
                    .map(f64::from),
            );
            // A bucket group's worth: 20 matrices of 256x4096, 160 blocks (version 7's launch
            // of at most 32 matrices, `nvfp4x_finish_2d_mixed_32`).
            let group = grouped_2d(c, (256, 4096, 20), 3500, false)?;
            out.extend(
                c.dev
                    .nvfp4_finish_2d_many(&group)?
                    .into_iter()
                    .map(f64::from),
            );
            // Nothing to do, and one matrix alone.
            out.extend(c.dev.nvfp4_finish_2d_many(&[])?.into_iter().map(f64::from));
            let one = [experts[0]];
            out.extend(c.dev.nvfp4_finish_2d_many(&one)?.into_iter().map(f64::from));
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 finish 2d many");
    // An invalid item runs every item through the single op (its error, in order); outputs
    // that overlap across items are refused before anything is written.
    let o = check("nvfp4 finish 2d many errors", false, |c| {
        let tiles = c.buf(DType::F32, &[0.5; 4]);
        let q = c.rand(DType::U8, 256, 10);
        let views = |a: usize| -> Result<Nvfp4Views> {
            Ok(Nvfp4Views {
                rowwise: Some((q.slice(a..a + 32)?, q.slice(a + 32..a + 48)?)),
                columnwise: Some((q.slice(a + 48..a + 80)?, q.slice(a + 80..a + 84)?)),
            })
        };
        let t = tiles.slice(0..1)?;
        let good = (16, 4, t, views(0)?);
        let bad = (16, 3, t, views(100)?);
        let mut errs = Vec::new();
        errs.push(c.dev.nvfp4_finish_2d_many(&[good, bad]).unwrap_err());
        let overlapping = (16, 4, t, views(40)?);
        errs.push(
            c.dev
                .nvfp4_finish_2d_many(&[good, overlapping])
                .unwrap_err(),
        );
        Ok(messages(&errs))
    });
    fallbacks_only(&o, &["nvfp4_finish_2d"]);
}

/// Amaxes left pending by one device are refused by another (its stream is not ordered after
/// the kernels that wrote them), and read by their own, alone or together with others.
#[test]
fn pending_amaxes_are_read_on_their_own_device() {
    let (mut a, mut b) = (gpu(), gpu());
    // A 32x64 matrix the kernel path takes (rows % 32 == 0, cols % 8 == 0): 8 tile amaxes.
    let item = |dev: &mut Device, amax: f32| {
        let tiles = dev.alloc(DType::F32, 8);
        dev.fill(tiles, amax).expect("fill");
        let views = Nvfp4Views {
            rowwise: Some((dev.alloc(DType::U8, 1024), dev.alloc(DType::U8, 128))),
            columnwise: Some((dev.alloc(DType::U8, 1024), dev.alloc(DType::U8, 128))),
        };
        (32, 64, tiles, views)
    };
    let (x, y) = (item(&mut a, 0.5), item(&mut a, 3.0));
    let p = a.nvfp4_finish_2d_many_deferred(&[x]).expect("finish");
    let err = b.read_amaxes(p).expect_err("read on another device");
    assert!(err.to_string().contains("another device"), "{err}");
    let p = a.nvfp4_finish_2d_many_deferred(&[y]).expect("finish");
    let q = a.nvfp4_finish_2d_many_deferred(&[x, y]).expect("finish");
    assert!(b.read_amaxes_many(vec![q]).is_err());
    let p2 = a.nvfp4_finish_2d_many_deferred(&[x]).expect("finish");
    let read = a.read_amaxes_many(vec![p, p2]).expect("read");
    assert_eq!(read, [vec![3.0], vec![0.5]]);
    // A deferred 1D quantization's amax likewise: refused on the other GPU and on a CPU
    // device, read on its own.
    let x = a.alloc(DType::Bf16, 32 * 64);
    a.fill(x, -1.5).expect("fill");
    let views = Nvfp4Views {
        rowwise: Some((a.alloc(DType::U8, 1024), a.alloc(DType::U8, 128))),
        columnwise: Some((a.alloc(DType::U8, 1024), a.alloc(DType::U8, 128))),
    };
    let cfg = Nvfp4Config::default();
    let p = a
        .quantize_nvfp4_deferred(x, 32, 64, &cfg, &views)
        .expect("quantize");
    let err = b
        .read_nvfp4_amaxes(vec![p])
        .expect_err("read on another device");
    assert!(err.to_string().contains("another device"), "{err}");
    let p = a
        .quantize_nvfp4_deferred(x, 32, 64, &cfg, &views)
        .expect("quantize");
    assert!(Device::cpu().read_nvfp4_amaxes(vec![p]).is_err());
    let p = a
        .quantize_nvfp4_deferred(x, 32, 64, &cfg, &views)
        .expect("quantize");
    let read = a.read_nvfp4_amaxes(vec![p]).expect("read");
    assert_eq!(read[0].rowwise, 1.5);
    assert_eq!(read[0].columnwise, 1.5);
    // The kernels took every call (a pending on the host would be readable anywhere).
    assert!(
        a.host_fallback_calls().is_empty(),
        "{:?}",
        a.host_fallback_calls()
    );
}

#[test]
fn nvfp4_deferred_calls_match() {
    // Deferred NVFP4 quantizations read back in one go equal the CPU's synchronous ones, byte
    // for byte and amax for amax: the 1D kernels of version 9 and 10 (their amax word left on
    // the device) on shapes whose amaxes differ, the Hadamard and 2D variants (read at once,
    // pending on the host) between them, and a matrix the both-copies kernel declines (cols
    // % 32 != 0). Each pending read comes back in call order; a second read of none is empty.
    let name = "nvfp4 deferred";
    let o = check(name, true, |c| {
        let mut out = Vec::new();
        let mut pending = Vec::new();
        let rht = Nvfp4Config {
            rht: true,
            ..Nvfp4Config::default()
        };
        let two_d = Nvfp4Config {
            two_d: true,
            ..Nvfp4Config::default()
        };
        let cases = [
            (9, (1024usize, 128usize), Nvfp4Config::default(), 0.5f32),
            (10, (1024, 128), Nvfp4Config::default(), 4.0),
            (10, (48, 64), rht, 2.0),
            (10, (512, 1024), Nvfp4Config::default(), 1e-3),
            (10, (64, 72), Nvfp4Config::default(), 300.0),
            (9, (80, 48), two_d, 8.0),
            (10, (16, 32), Nvfp4Config::default(), 0.0),
        ];
        for (k, &(version, (rows, cols), cfg, scale)) in cases.iter().enumerate() {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            let seed = 9000 + 10 * k as u64;
            let vals: Vec<f32> = block_cases(rows, cols, seed, k % 2 == 1, false)
                .into_iter()
                .map(|v| v * scale)
                .collect();
            let src = c.buf(DType::Bf16, &vals);
            let views = nvfp4_views(c, rows, cols, cfg.copies, seed + 1);
            pending.push(
                c.dev
                    .quantize_nvfp4_deferred(src, rows, cols, &cfg, &views)?,
            );
        }
        for a in c.dev.read_nvfp4_amaxes(pending)? {
            out.extend([f64::from(a.rowwise), f64::from(a.columnwise)]);
        }
        out.push(c.dev.read_nvfp4_amaxes(Vec::new())?.len() as f64);
        Ok(out)
    });
    native_nvfp4(&o, name);
}

// ---------------------------------------------------------------------------------------------
// Timings

/// Kernel times on a 16384x16384 bf16 tensor against a device copy of it (same run).
#[test]
#[ignore = "timing: run explicitly on a GPU"]
fn nvfp4_timings() {
    let (rows, cols) = (16384usize, 16384usize);
    let n = rows * cols;
    let (mut g, src, copy) = timing_setup(rows, cols, &finite(1 << 20, 1));
    let views = |g: &mut Device| Nvfp4Views {
        rowwise: Some((g.alloc(DType::U8, n / 2), g.alloc(DType::U8, n / 16))),
        columnwise: Some((g.alloc(DType::U8, n / 2), g.alloc(DType::U8, n / 16))),
    };
    let v = views(&mut g);
    let cases: [(&str, Nvfp4Config); 5] = [
        ("1D both (ops.cu)", Nvfp4Config::default()),
        (
            "2D both",
            Nvfp4Config {
                two_d: true,
                ..Nvfp4Config::default()
            },
        ),
        (
            "SR both",
            Nvfp4Config {
                stochastic_rounding: Some(1),
                ..Nvfp4Config::default()
            },
        ),
        (
            "RHT both",
            Nvfp4Config {
                rht: true,
                ..Nvfp4Config::default()
            },
        ),
        (
            "RHT + SR both",
            Nvfp4Config {
                rht: true,
                stochastic_rounding: Some(1),
                ..Nvfp4Config::default()
            },
        ),
    ];
    for (name, cfg) in cases {
        let t = time(&mut g, 10, |g| {
            g.quantize_nvfp4(src, rows, cols, &cfg, &v).unwrap();
        });
        println!("{name}: {t:.1} us = {:.2}x copy time", copy / t);
    }
    // 1D both copies with the columnwise kernel of version 3 (down columns), version 4
    // (shared-memory transpose) and version 5 (both copies in one kernel).
    for version in [3, 4, 5, 6, 7, 8, 9, 10] {
        g.set_cuda_kernel_variant("nvfp4", version).unwrap();
        let cfg = Nvfp4Config::default();
        let t = time(&mut g, 10, |g| {
            g.quantize_nvfp4(src, rows, cols, &cfg, &v).unwrap();
        });
        println!(
            "1D both (ops.cu, nvfp4 v{version}): {t:.1} us = {:.2}x copy time",
            copy / t
        );
    }
    let (cd, cs) = v.columnwise.unwrap();
    let dst = g.alloc(DType::Bf16, n);
    let t = time(&mut g, 10, |g| {
        g.dequantize_nvfp4_columnwise(cd, cs, 1.0, true, rows, cols, dst)
            .unwrap()
    });
    println!(
        "RHT dequantize to bf16: {t:.1} us = {:.2}x copy time",
        copy / t
    );
    let tiles = g.alloc(DType::F32, (rows / 16) * (cols / 16));
    g.fill(tiles, 0.75).unwrap();
    let t = time(&mut g, 10, |g| {
        g.nvfp4_finish_2d(rows, cols, tiles, &v).unwrap();
    });
    println!("finish_2d: {t:.1} us = {:.2}x copy time", copy / t);
    assert!(
        g.host_fallback_calls().is_empty(),
        "{:?}",
        g.host_fallback_calls()
    );
}
