//! The NVFP4 kernels of `cuda/nvfp4.cu` (2D scales, stochastic rounding, the Hadamard
//! transform and its dequantization, columnwise copies of any row count, `nvfp4_finish_2d`)
//! against the CPU backend (the oracle): every byte of every buffer and every returned value
//! must match; quantized bytes strictly, dequantized floats with NaN as a class.
//!
//! These tests need a CUDA GPU: without one they fail (they never skip). Run them one at a
//! time (`--test-threads=1`). `nvfp4_timings` (ignored) prints kernel times on a large tensor.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, DeviceKind, Nvfp4Config, Nvfp4Views, Result, View, bf16, f16};
use lowbit_formats::{Copies, NanPolicy};

// ---------------------------------------------------------------------------------------------
// Harness (as in tests/cuda.rs)

/// Deterministic pseudo-random source (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Values with a wide range; with `specials`, about one in eight is an edge case.
fn values(n: usize, seed: u64, specials: bool) -> Vec<f32> {
    const EDGE: [u32; 14] = [
        0x7FC0_0000, // NaN
        0xFFC0_1234, // negative NaN with a payload
        0x7F80_0000, // +Inf
        0xFF80_0000, // -Inf
        0x0000_0000, // +0
        0x8000_0000, // -0
        0x0000_0001, // smallest subnormal
        0x807F_FFFF, // largest negative subnormal
        0x7F7F_FFFF, // f32 max
        0x3F80_0001, // 1 + ulp
        0x477F_F000, // 65520: rounds to f16 Inf
        0x3380_0000, // 2^-24: smallest f16 subnormal
        0x3F80_8000, // bf16 tie
        0x3F81_8000, // bf16 tie, odd
    ];
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| {
            let x = r.next();
            if specials && x.is_multiple_of(8) {
                f32::from_bits(EDGE[(x >> 8) as usize % EDGE.len()])
            } else {
                r.unit() * 2f32.powi((x % 24) as i32 - 12)
            }
        })
        .collect()
}

/// Values without NaN or infinities (for ops whose validity needs finite inputs).
fn finite(n: usize, seed: u64) -> Vec<f32> {
    values(n, seed, true)
        .into_iter()
        .map(|v| {
            if v.is_finite() {
                v.clamp(-1e4, 1e4)
            } else {
                0.5
            }
        })
        .collect()
}

/// A 64x64 matrix with whole NaN blocks (row 0, column 5), a row of subnormals only, a row of
/// ±Inf and zeros, and random values elsewhere: the amax edge cases of the block formats.
fn nan_blocks(with_inf: bool) -> Vec<f32> {
    let mut v = finite(64 * 64, 4242);
    let big = if with_inf { f32::NEG_INFINITY } else { -3.0e4 };
    for c in 0..64 {
        v[c] = f32::NAN;
        v[64 + c] =
            f32::from_bits(0x0001_0000 * (c as u32 % 7 + 1)) * if c % 2 == 0 { 1.0 } else { -1.0 };
        v[2 * 64 + c] = if c % 3 == 0 { big } else { 0.0 };
    }
    for r in 0..64 {
        v[r * 64 + 5] = f32::from_bits(0xFFC0_0001);
    }
    v
}

/// The little-endian bytes of `vals` encoded as `d` (RNE, `half`'s conversions).
fn encode(d: DType, vals: &[f32]) -> Vec<u8> {
    match d {
        DType::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        DType::Bf16 => vals
            .iter()
            .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        DType::F16 => vals
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_bits().to_le_bytes())
            .collect(),
        DType::U8 => vals.iter().map(|v| *v as u8).collect(),
    }
}

/// A scenario's view of one device: allocations are recorded so that every buffer's final
/// bytes can be compared.
struct Ctx<'a> {
    dev: &'a mut Device,
    /// Each recorded buffer and the dtype its bytes are compared as.
    buffers: Vec<(View, DType)>,
}

impl Ctx<'_> {
    /// A buffer of `n` elements of `d` holding `vals` (encoded to `d`), recorded.
    fn buf(&mut self, d: DType, vals: &[f32]) -> View {
        let v = self.dev.alloc(d, vals.len());
        self.dev.write_bytes(v, &encode(d, vals)).unwrap();
        self.buffers.push((v, d));
        v
    }
    /// A random buffer (edge cases included).
    fn rand(&mut self, d: DType, n: usize, seed: u64) -> View {
        self.buf(d, &values(n, seed, true))
    }
}

/// What one scenario produced on one device.
#[derive(Debug)]
struct Outcome {
    values: Result<Vec<f64>>,
    buffers: Vec<(DType, Vec<u8>)>,
    fallbacks: Vec<(&'static str, u64)>,
}

fn run_on(dev: &mut Device, f: &dyn Fn(&mut Ctx) -> Result<Vec<f64>>) -> Outcome {
    let mut ctx = Ctx {
        dev,
        buffers: Vec::new(),
    };
    let values = f(&mut ctx);
    let buffers = ctx.buffers.clone();
    let bytes = buffers
        .iter()
        .map(|(v, d)| (*d, dev.read_bytes(*v).expect("buffers stay readable")))
        .collect();
    Outcome {
        values,
        buffers: bytes,
        fallbacks: dev.host_fallback_calls(),
    }
}

fn gpu() -> Device {
    let d = Device::cuda(0).expect("these tests need a CUDA GPU (ordinal 0)");
    assert_eq!(d.kind(), DeviceKind::Cuda);
    d
}

/// Whether two elements of dtype `d` match: identical bits, or (with `nan_class`) both NaN.
fn elem_eq(d: DType, a: &[u8], b: &[u8], nan_class: bool) -> bool {
    if a == b {
        return true;
    }
    if !nan_class {
        return false;
    }
    match d {
        DType::F32 => {
            f32::from_le_bytes(a.try_into().unwrap()).is_nan()
                && f32::from_le_bytes(b.try_into().unwrap()).is_nan()
        }
        DType::Bf16 => {
            bf16::from_bits(u16::from_le_bytes(a.try_into().unwrap())).is_nan()
                && bf16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).is_nan()
        }
        DType::F16 => {
            f16::from_bits(u16::from_le_bytes(a.try_into().unwrap())).is_nan()
                && f16::from_bits(u16::from_le_bytes(b.try_into().unwrap())).is_nan()
        }
        DType::U8 => false,
    }
}

/// Runs `f` on a CPU and a CUDA device and asserts identical outcomes; returns the CUDA
/// device's fallback counts.
fn check(name: &str, nan_class: bool, f: impl Fn(&mut Ctx) -> Result<Vec<f64>>) -> Outcome {
    let cpu = run_on(&mut Device::cpu(), &f);
    let mut g = gpu();
    let cuda = run_on(&mut g, &f);
    match (&cpu.values, &cuda.values) {
        (Ok(a), Ok(b)) => {
            assert_eq!(a.len(), b.len(), "{name}: result count");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    x.to_bits() == y.to_bits() || (nan_class && x.is_nan() && y.is_nan()),
                    "{name}: result {i}: cpu {x:e} ({:#x}) vs cuda {y:e} ({:#x})",
                    x.to_bits(),
                    y.to_bits()
                );
            }
        }
        (a, b) => assert_eq!(a, b, "{name}: results differ"),
    }
    assert_eq!(cpu.buffers.len(), cuda.buffers.len());
    for (k, ((d, a), (_, b))) in cpu.buffers.iter().zip(&cuda.buffers).enumerate() {
        assert_eq!(a.len(), b.len(), "{name}: buffer {k} size");
        let s = d.size();
        let bad: Vec<usize> = (0..a.len() / s)
            .filter(|&i| {
                !elem_eq(
                    *d,
                    &a[i * s..(i + 1) * s],
                    &b[i * s..(i + 1) * s],
                    nan_class,
                )
            })
            .collect();
        assert!(
            bad.is_empty(),
            "{name}: buffer {k} ({d:?}, {} elements): {} elements differ, first at {}: cpu {:02x?} vs cuda {:02x?}",
            a.len() / s,
            bad.len(),
            bad[0],
            &a[bad[0] * s..(bad[0] + 1) * s],
            &b[bad[0] * s..(bad[0] + 1) * s]
        );
    }
    cuda
}

const FLOATS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

// ---------------------------------------------------------------------------------------------
// NVFP4 variants

fn nvfp4_views(c: &mut Ctx, rows: usize, cols: usize, copies: Copies, seed: u64) -> Nvfp4Views {
    let mut pair = |data: usize, scales: usize, s: u64| {
        (c.rand(DType::U8, data, s), c.rand(DType::U8, scales, s + 1))
    };
    Nvfp4Views {
        rowwise: copies
            .rowwise()
            .then(|| pair(rows * cols.div_ceil(2), rows * cols.div_ceil(16), seed)),
        columnwise: copies
            .columnwise()
            .then(|| pair(cols * rows.div_ceil(2), cols * rows.div_ceil(16), seed + 2)),
    }
}

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

#[test]
fn nvfp4_2d_matches() {
    let o = check("nvfp4 2d", true, |c| {
        sweep(
            c,
            &SHAPES,
            Nvfp4Config {
                two_d: true,
                ..Nvfp4Config::default()
            },
        )
    });
    native_nvfp4(&o, "nvfp4 2d");
}

#[test]
fn nvfp4_stochastic_rounding_matches() {
    let o = check("nvfp4 sr", true, |c| {
        let mut out = Vec::new();
        for (seed, two_d) in [(7u64, false), (0xDEAD_BEEF_1234_5678, false), (42, true)] {
            out.extend(sweep(
                c,
                &SHAPES,
                Nvfp4Config {
                    two_d,
                    stochastic_rounding: Some(seed),
                    ..Nvfp4Config::default()
                },
            )?);
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 sr");
}

#[test]
fn nvfp4_hadamard_matches() {
    let o = check("nvfp4 rht", true, |c| {
        let mut out = Vec::new();
        for sr in [None, Some(0x1234_5678_9ABC_DEF0u64)] {
            out.extend(sweep(
                c,
                &RHT_SHAPES,
                Nvfp4Config {
                    rht: true,
                    stochastic_rounding: sr,
                    ..Nvfp4Config::default()
                },
            )?);
        }
        Ok(out)
    });
    native_nvfp4(&o, "nvfp4 rht");
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
        Ok(errs
            .iter()
            .flat_map(|e| format!("{e}").into_bytes())
            .map(f64::from)
            .collect())
    });
    assert!(
        o.fallbacks.iter().all(|(op, _)| *op == "quantize_nvfp4"),
        "{:?}",
        o.fallbacks
    );
}

#[test]
fn nvfp4_finish_2d_matches() {
    let o = check("nvfp4 finish 2d", false, |c| {
        let mut out = Vec::new();
        for (rows, cols, d, seed) in [
            (64usize, 96usize, DType::F32, 1u64),
            (70, 50, DType::Bf16, 2),
            (33, 34, DType::F16, 3),
            (16, 2, DType::Bf16, 4),
            (1, 40, DType::F32, 5),
        ] {
            let n = rows * cols;
            let x = c.buf(d, &values(n, 900 + seed, seed % 2 == 0));
            let cuts = [0, (n / 3) & !1, (2 * n / 3) & !1, n];
            let tc = rows.div_ceil(16) * cols.div_ceil(16);
            let tiles = c.buf(DType::F32, &vec![0.0; tc]);
            for w in cuts.windows(2) {
                let s = x.slice(w[0]..w[1])?;
                c.dev.nvfp4_fold_tile_amax_2d(s, w[0], cols, tiles)?;
            }
            let packed = c.rand(DType::U8, n / 2, 904 + seed);
            for w in cuts.windows(2) {
                let (s, ps) = (x.slice(w[0]..w[1])?, packed.slice(w[0] / 2..w[1] / 2)?);
                c.dev.nvfp4_quantize_2d_range(s, w[0], cols, tiles, ps)?;
            }
            let views = Nvfp4Views {
                rowwise: Some((
                    packed,
                    c.rand(DType::U8, rows * cols.div_ceil(16), 905 + seed),
                )),
                columnwise: Some((
                    c.rand(DType::U8, cols * rows.div_ceil(2), 906 + seed),
                    c.rand(DType::U8, cols * rows.div_ceil(16), 907 + seed),
                )),
            };
            out.push(f64::from(c.dev.nvfp4_finish_2d(rows, cols, tiles, &views)?));
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
        Ok(errs
            .iter()
            .flat_map(|e| format!("{e}").into_bytes())
            .map(f64::from)
            .collect())
    });
    assert!(
        o.fallbacks.iter().all(|(op, _)| *op == "nvfp4_finish_2d"),
        "{:?}",
        o.fallbacks
    );
}

// ---------------------------------------------------------------------------------------------
// Timings

/// Median wall time of `reps` runs of `f` (each synchronised), after two warm-up runs.
fn time(dev: &mut Device, reps: usize, mut f: impl FnMut(&mut Device)) -> f64 {
    for _ in 0..2 {
        f(dev);
    }
    dev.synchronize().unwrap();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = std::time::Instant::now();
            f(dev);
            dev.synchronize().unwrap();
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

/// Kernel times on a 16384x16384 bf16 tensor against a device copy of it (same run).
#[test]
#[ignore = "timing: run explicitly on a GPU"]
fn nvfp4_timings() {
    let (rows, cols) = (16384usize, 16384usize);
    let n = rows * cols;
    let mut g = gpu();
    let src = g.alloc(DType::Bf16, n);
    let vals: Vec<f32> = finite(1 << 20, 1);
    let chunk = encode(DType::Bf16, &vals);
    for k in 0..n / (1 << 20) {
        g.write_bytes(src.slice(k << 20..(k + 1) << 20).unwrap(), &chunk)
            .unwrap();
    }
    let copy_dst = g.alloc(DType::Bf16, n);
    let views = |g: &mut Device| Nvfp4Views {
        rowwise: Some((g.alloc(DType::U8, n / 2), g.alloc(DType::U8, n / 16))),
        columnwise: Some((g.alloc(DType::U8, n / 2), g.alloc(DType::U8, n / 16))),
    };
    let v = views(&mut g);
    let copy = time(&mut g, 10, |g| g.copy(src, copy_dst).unwrap());
    println!("copy bf16 {rows}x{cols}: {copy:.1} us");
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
