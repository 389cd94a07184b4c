//! The harness of the CUDA-vs-CPU tests (`cuda.rs`, `cuda_nvfp4.rs`, `cuda_mxfp8.rs`): seeded
//! inputs with edge cases, a recording context that runs one scenario on both backends and
//! compares every buffer's bytes, and a timer for the ignored timing tests.
#![allow(dead_code)] // each test file uses part of the harness

use lowbit_device::{DType, Device, DeviceError, DeviceKind, Nvfp4Views, Result, View, bf16, f16};
use lowbit_formats::Copies;

/// Deterministic pseudo-random source (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Edge cases of every float input: NaNs, infinities, zeros, subnormals, the f32 extremes and
/// the f16 rounding edges (as f32 bits).
pub const EDGES: [u32; 12] = [
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
];

/// Values with a wide range; with `specials`, about one in eight is an edge case ([`EDGES`]
/// and bf16 rounding ties).
pub fn values(n: usize, seed: u64, specials: bool) -> Vec<f32> {
    const BF16_TIES: [u32; 2] = [
        0x3F80_8000, // bf16 tie
        0x3F81_8000, // bf16 tie, odd
    ];
    let edges = if specials {
        [&EDGES[..], &BF16_TIES].concat()
    } else {
        Vec::new()
    };
    values_with_edges(n, seed, &edges)
}

/// Values with a wide range of which about one in eight is one of `edges` (f32 bits; none when
/// `edges` is empty).
pub fn values_with_edges(n: usize, seed: u64, edges: &[u32]) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|_| {
            let x = r.next();
            if !edges.is_empty() && x.is_multiple_of(8) {
                f32::from_bits(edges[(x >> 8) as usize % edges.len()])
            } else {
                r.unit() * 2f32.powi((x % 24) as i32 - 12)
            }
        })
        .collect()
}

/// Values without NaN or infinities (for ops whose validity needs finite inputs).
pub fn finite(n: usize, seed: u64) -> Vec<f32> {
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
pub fn nan_blocks(with_inf: bool) -> Vec<f32> {
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
pub fn encode(d: DType, vals: &[f32]) -> Vec<u8> {
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
pub struct Ctx<'a> {
    pub dev: &'a mut Device,
    /// Each recorded buffer and the dtype its bytes are compared as.
    pub buffers: Vec<(View, DType)>,
}

impl Ctx<'_> {
    /// A buffer of `n` elements of `d` holding `vals` (encoded to `d`), recorded.
    pub fn buf(&mut self, d: DType, vals: &[f32]) -> View {
        let v = self.dev.alloc(d, vals.len());
        self.dev.write_bytes(v, &encode(d, vals)).unwrap();
        self.buffers.push((v, d));
        v
    }
    /// Records an allocation made directly on the device.
    pub fn record(&mut self, v: View) {
        self.buffers.push((v, v.dtype()));
    }
    /// Compares the last recorded buffer as `d` elements (for a bf16 staging view written
    /// into an f32 buffer: NaN-ness is then judged per bf16 element).
    pub fn compare_last_as(&mut self, d: DType) {
        if let Some(last) = self.buffers.last_mut() {
            last.1 = d;
        }
    }
    /// A random buffer (edge cases included).
    pub fn rand(&mut self, d: DType, n: usize, seed: u64) -> View {
        self.buf(d, &values(n, seed, true))
    }
    /// A random buffer of `pad + n + pad` elements and the view of its middle `n`: a non-zero
    /// offset, and bytes around the view that must stay untouched.
    pub fn rand_mid(&mut self, d: DType, n: usize, pad: usize, seed: u64) -> View {
        let v = self.rand(d, n + 2 * pad, seed);
        v.slice(pad..pad + n).unwrap()
    }
}

/// What one scenario produced on one device.
#[derive(Debug)]
pub struct Outcome {
    pub values: Result<Vec<f64>>,
    pub buffers: Vec<(DType, Vec<u8>)>,
    pub fallbacks: Vec<(&'static str, u64)>,
}

pub fn run_on(dev: &mut Device, f: &dyn Fn(&mut Ctx) -> Result<Vec<f64>>) -> Outcome {
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

pub fn gpu() -> Device {
    let d = Device::cuda(0).expect("these tests need a CUDA GPU (ordinal 0)");
    assert_eq!(d.kind(), DeviceKind::Cuda);
    d
}

/// Whether two elements of dtype `d` match: identical bits, or (with `nan_class`) both NaN.
pub fn elem_eq(d: DType, a: &[u8], b: &[u8], nan_class: bool) -> bool {
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
pub fn check(name: &str, nan_class: bool, f: impl Fn(&mut Ctx) -> Result<Vec<f64>>) -> Outcome {
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

pub const FLOATS: [DType; 3] = [DType::F32, DType::Bf16, DType::F16];

/// Asserts that the CUDA run took no host fallback.
pub fn native(o: &Outcome, name: &str) {
    assert!(
        o.fallbacks.is_empty(),
        "{name} took the host fallback: {:?}",
        o.fallbacks
    );
}

/// [`check`], then [`native`]: the CUDA run took no host fallback.
pub fn check_native(name: &str, nan_class: bool, f: impl Fn(&mut Ctx) -> Result<Vec<f64>>) {
    let o = check(name, nan_class, f);
    native(&o, name);
}

/// Fresh random NVFP4 output views (recorded) for a `rows × cols` input.
pub fn nvfp4_views(c: &mut Ctx, rows: usize, cols: usize, copies: Copies, seed: u64) -> Nvfp4Views {
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

/// The errors' messages as result values (their bytes), so that [`check`] compares them
/// between the devices.
pub fn messages(errs: &[DeviceError]) -> Vec<f64> {
    errs.iter()
        .flat_map(|e| format!("{e}").into_bytes())
        .map(f64::from)
        .collect()
}

/// Asserts that the CUDA run took the host fallback in no op but those named in `ops`.
pub fn fallbacks_only(o: &Outcome, ops: &[&str]) {
    assert!(
        o.fallbacks.iter().all(|(op, _)| ops.contains(op)),
        "{:?}",
        o.fallbacks
    );
}

/// A `d` tensor of `n` elements on `g` holding `chunk` (1 Mi values) encoded and repeated.
pub fn tiled(g: &mut Device, d: DType, n: usize, chunk: &[f32]) -> View {
    let src = g.alloc(d, n);
    let bytes = encode(d, chunk);
    for k in 0..n / (1 << 20) {
        g.write_bytes(src.slice(k << 20..(k + 1) << 20).unwrap(), &bytes)
            .unwrap();
    }
    src
}

/// The set-up of the timing tests: a GPU holding a bf16 `rows × cols` tensor of `chunk` (1 Mi
/// values) repeated, and the time of a device copy of that tensor (their yardstick), printed.
pub fn timing_setup(rows: usize, cols: usize, chunk: &[f32]) -> (Device, View, f64) {
    let mut g = gpu();
    let src = tiled(&mut g, DType::Bf16, rows * cols, chunk);
    let copy_dst = g.alloc(DType::Bf16, rows * cols);
    let copy = time(&mut g, 10, |g| g.copy(src, copy_dst).unwrap());
    println!("copy bf16 {rows}x{cols}: {copy:.1} us");
    (g, src, copy)
}

/// `(rows, cols, input dtype, seed)` of the sharded 2D tests: tiles cut by the matrix edges and
/// shard boundaries inside rows and tiles.
pub const SHARDED_2D_CASES: [(usize, usize, DType, u64); 3] = [
    (64, 96, DType::F32, 1),
    (70, 50, DType::Bf16, 2),
    (33, 34, DType::F16, 3),
];

/// NVFP4 2D quantization of `x` (`rows × cols`) piecewise over the shards between `cuts` (even
/// offsets), as the primary-weight gathers run it: the 16x16 tile amaxes folded shard by shard
/// into fresh zeroed tiles, then each shard's codes into its part of a fresh random packed
/// buffer (seed `seed`). Returns the tiles and the packed codes.
pub fn nvfp4_shards_2d(
    c: &mut Ctx,
    x: View,
    (rows, cols): (usize, usize),
    cuts: &[usize],
    seed: u64,
) -> Result<(View, View)> {
    let tc = rows.div_ceil(16) * cols.div_ceil(16);
    let tiles = c.buf(DType::F32, &vec![0.0; tc]);
    for w in cuts.windows(2) {
        let s = x.slice(w[0]..w[1])?;
        c.dev.nvfp4_fold_tile_amax_2d(s, w[0], cols, tiles)?;
    }
    let packed = c.rand(DType::U8, rows * cols / 2, seed);
    for w in cuts.windows(2) {
        let (s, ps) = (x.slice(w[0]..w[1])?, packed.slice(w[0] / 2..w[1] / 2)?);
        c.dev.nvfp4_quantize_2d_range(s, w[0], cols, tiles, ps)?;
    }
    Ok((tiles, packed))
}

/// `nvfp4_finish_2d` of [`nvfp4_shards_2d`]'s `tiles` and `packed` codes into fresh random
/// scales and columnwise copy (seeds `seed + 1` to `seed + 3`); returns its result.
pub fn nvfp4_finish_shards_2d(
    c: &mut Ctx,
    (rows, cols): (usize, usize),
    (tiles, packed): (View, View),
    seed: u64,
) -> Result<f64> {
    let views = Nvfp4Views {
        rowwise: Some((
            packed,
            c.rand(DType::U8, rows * cols.div_ceil(16), seed + 1),
        )),
        columnwise: Some((
            c.rand(DType::U8, cols * rows.div_ceil(2), seed + 2),
            c.rand(DType::U8, cols * rows.div_ceil(16), seed + 3),
        )),
    };
    Ok(f64::from(c.dev.nvfp4_finish_2d(rows, cols, tiles, &views)?))
}

/// Median wall time of `reps` runs of `f` (each synchronised), after two warm-up runs.
pub fn time(dev: &mut Device, reps: usize, mut f: impl FnMut(&mut Device)) -> f64 {
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
