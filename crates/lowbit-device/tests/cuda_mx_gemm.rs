//! The MXFP8 block-scaled GEMMs on CUDA (`crates/lowbit-kernels/mx_gemm.cu`, kernel variants
//! `("matmul_mx_kernel", 1 | 2)`, and `mx_gemm_wgmma.cu`, variant 3) against the CPU's
//! `Device::matmul_mx`, which computes the semantics exactly (each 32-block's dot product exact,
//! scaled by both E8M0 scales, rounded once, added in block order; `tests/matmul_mx.rs` checks
//! it against an integer reference). Shapes with K below, at and past a block, not a multiple of
//! 16, 32 or 128 (the wgmma kernel's 16-byte copies and 128-byte stages), M/N tails of the 64 x
//! 64 and 128 x 128 tiles; both fp8 kinds on either side; accumulate; planes starting at odd
//! byte offsets (where variant 3 runs v1); scales outside the wgmma kernel's fast window (its
//! exact promotion).
//! Bounds per element, `|cuda − cpu| ≤ β · Σₖ|aₖ·bₖ|` (dequantized values): the kernel
//! β = 2⁻¹¹, since Hopper's FP8 tensor cores add a block's products in an accumulator of about
//! 14 mantissa bits (DeepSeek-V3 technical report, §3.3.2: the reason DeepGEMM promotes to f32
//! every 128 elements; here every 32); the bf16-dequantize path (variant 0, cuBLASLt's f32
//! accumulation) β = 2⁻²⁰. Both errors against an f64 product are printed (H200: ≤ 1.6e-7 for
//! the kernels, ≤ 5.6e-7 for the bf16 path, relative to Σ|ab|). An ignored test
//! prints TFLOP/s. Needs a GPU and cuBLASLt (`gpu/with_cublas.sh`); fails, never skips.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, Fp8Kind, MatmulMxSpec, MxArg, MxLayout, MxOperand, View};
use lowbit_formats::{Copies, Matrix, Mxfp8Config, Source, quantize_mxfp8};

mod support;
use support::*;

/// Values over several binades, so that blocks' scales differ.
fn spread(n: usize, seed: u64) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n)
        .map(|i| r.unit() * 2f32.powi((i / 32 % 9) as i32 - 4))
        .collect()
}

/// The rowwise MXFP8 plane of `x` (`[outer, k]`): bytes, scales, and its dequantized values.
fn plane(x: &[f32], outer: usize, k: usize, kind: Fp8Kind) -> (Vec<u8>, Vec<u8>, Vec<f64>) {
    let cfg = Mxfp8Config {
        kind,
        copies: Copies::Rowwise,
        ..Mxfp8Config::default()
    };
    let mat = Matrix::new("x", outer, k, Source::F32(x)).unwrap();
    let p = quantize_mxfp8(&mat, &cfg).unwrap().rowwise.unwrap();
    let blocks = k.div_ceil(32);
    let decode = |b: u8| match kind {
        Fp8Kind::E4M3 => lowbit_formats::scalar::e4m3_to_f32(b),
        Fp8Kind::E5M2 => lowbit_formats::scalar::e5m2_to_f32(b),
    };
    let deq = (0..outer * k)
        .map(|i| {
            let e = i32::from(p.scales[(i / k) * blocks + (i % k) / 32]) - 127;
            f64::from(decode(p.data[i])) * 2f64.powi(e)
        })
        .collect();
    (p.data, p.scales, deq)
}

/// `bytes` in a fresh u8 buffer starting `offset` bytes in.
fn put_bytes(dev: &mut Device, bytes: &[u8], offset: usize) -> View {
    let v = dev.alloc(DType::U8, bytes.len() + offset);
    let mut all = vec![0xA5u8; offset];
    all.extend_from_slice(bytes);
    dev.upload(v, &all).unwrap();
    v.slice(offset..offset + bytes.len()).unwrap()
}

struct Case {
    m: usize,
    n: usize,
    k: usize,
    kinds: (Fp8Kind, Fp8Kind),
    accumulate: bool,
    offset: usize,
    /// Binades the values of A and B are moved by (their scales with them).
    shift: (i32, i32),
}

/// C from `dev` (variant `variant` on CUDA) for the case's operands.
fn product(dev: &mut Device, c: &Case, planes: &[(Vec<u8>, Vec<u8>); 2], c0: &[f32]) -> Vec<f32> {
    let op = |dev: &mut Device, (d, s): &(Vec<u8>, Vec<u8>), kind| MxOperand {
        data: put_bytes(dev, d, c.offset),
        scales: put_bytes(dev, s, c.offset),
        kind,
        layout: MxLayout::Rowwise,
    };
    let a = op(dev, &planes[0], c.kinds.0);
    let b = op(dev, &planes[1], c.kinds.1);
    let cv = dev.alloc(DType::F32, c.m * c.n);
    dev.upload(cv, c0).unwrap();
    let spec = MatmulMxSpec {
        m: c.m,
        n: c.n,
        k: c.k,
        accumulate: c.accumulate,
    };
    dev.matmul_mx(MxArg::Quantized(a), MxArg::Quantized(b), cv, &spec)
        .unwrap();
    dev.download::<f32>(cv).unwrap()
}

#[test]
fn the_block_scaled_kernel_matches_the_cpu_semantics() {
    use Fp8Kind::{E4M3, E5M2};
    let mut cases = Vec::new();
    for (m, n, k) in [
        (1, 1, 1),
        (3, 5, 31),
        (16, 8, 32),
        (7, 3, 33),
        (64, 64, 64),
        (65, 63, 100),
        (130, 70, 161),
        (257, 129, 300),
        (512, 384, 1024),
        (96, 200, 2048),
        (5, 9, 16),
        (129, 131, 48),
        (130, 70, 144),
        (257, 129, 400),
        (300, 260, 528),
        (256, 384, 4096),
    ] {
        cases.push(Case {
            m,
            n,
            k,
            kinds: (E4M3, E4M3),
            accumulate: false,
            offset: 0,
            shift: (0, 0),
        });
    }
    for (kinds, accumulate, offset, k) in [
        ((E4M3, E5M2), false, 1, 129),
        ((E5M2, E4M3), true, 3, 129),
        ((E5M2, E5M2), true, 2, 129),
        ((E4M3, E4M3), true, 1, 129),
        ((E4M3, E5M2), false, 0, 272),
        ((E5M2, E4M3), true, 0, 272),
        ((E5M2, E5M2), true, 0, 272),
        ((E4M3, E4M3), true, 0, 272),
    ] {
        cases.push(Case {
            m: 97,
            n: 75,
            k,
            kinds,
            accumulate,
            offset,
            shift: (0, 0),
        });
    }
    // Scale bytes below and above the wgmma kernel's window [80, 172], in every stage or in
    // some (one operand moved by 2^-70 or 2^60; the other, spread over 9 binades, not).
    for shift in [(-70, 0), (0, 60), (-40, -40)] {
        cases.push(Case {
            m: 140,
            n: 130,
            k: 512,
            kinds: (E4M3, E4M3),
            accumulate: true,
            offset: 0,
            shift,
        });
    }
    let mut g = gpu();
    let mut cpu = Device::cpu();
    for (s, c) in cases.iter().enumerate() {
        let moved =
            |v: Vec<f32>, e: i32| -> Vec<f32> { v.into_iter().map(|x| x * 2f32.powi(e)).collect() };
        let (x, y) = (
            moved(spread(c.m * c.k, s as u64), c.shift.0),
            moved(spread(c.n * c.k, 100 + s as u64), c.shift.1),
        );
        let (ad, asc, adq) = plane(&x, c.m, c.k, c.kinds.0);
        let (bd, bsc, bdq) = plane(&y, c.n, c.k, c.kinds.1);
        let planes = [(ad, asc), (bd, bsc)];
        let c0 = spread(c.m * c.n, 7);
        let want = product(&mut cpu, c, &planes, &c0);
        let mut worst = [0f64; 4];
        for variant in [1, 2, 3, 0] {
            g.set_cuda_kernel_variant("matmul_mx_kernel", variant)
                .unwrap();
            let got = product(&mut g, c, &planes, &c0);
            for i in 0..c.m {
                for j in 0..c.n {
                    let (mut abs, mut exact) = (0f64, 0f64);
                    for t in 0..c.k {
                        let p = adq[i * c.k + t] * bdq[j * c.k + t];
                        abs += p.abs();
                        exact += p;
                    }
                    if c.accumulate {
                        exact += f64::from(c0[i * c.n + j]);
                        abs += f64::from(c0[i * c.n + j]).abs();
                    }
                    let (gv, wv) = (got[i * c.n + j], want[i * c.n + j]);
                    let beta = if variant == 0 { -20 } else { -11 };
                    let bound = abs * 2f64.powi(beta) + f64::from(f32::MIN_POSITIVE);
                    assert!(
                        (f64::from(gv) - f64::from(wv)).abs() <= bound,
                        "variant {variant}, {}x{}x{} {:?} acc {} at ({i}, {j}): cuda {gv}, cpu \
                         {wv}, bound {bound:e}",
                        c.m,
                        c.n,
                        c.k,
                        c.kinds,
                        c.accumulate
                    );
                    let rel = (f64::from(gv) - exact).abs() / abs.max(f64::MIN_POSITIVE);
                    worst[variant as usize] = worst[variant as usize].max(rel);
                }
            }
        }
        println!(
            "{}x{}x{} {:?} acc {} offset {} shift {:?}: max |c − f64| / Σ|ab|: kernel v0 {:.2e}, \
             v1 {:.2e}, wgmma {:.2e}, bf16 path {:.2e}",
            c.m,
            c.n,
            c.k,
            c.kinds,
            c.accumulate,
            c.offset,
            c.shift,
            worst[1],
            worst[2],
            worst[3],
            worst[0]
        );
    }
    g.set_cuda_kernel_variant("matmul_mx_kernel", 0).unwrap();
}

/// A NaN scale (E8M0 255) gives NaN in its rows, as on the CPU.
#[test]
fn a_nan_scale_gives_nan() {
    let c = Case {
        m: 4,
        n: 8,
        k: 64,
        kinds: (Fp8Kind::E4M3, Fp8Kind::E4M3),
        accumulate: false,
        offset: 0,
        shift: (0, 0),
    };
    let (ad, mut asc, _) = plane(&spread(4 * 64, 1), 4, 64, Fp8Kind::E4M3);
    let (bd, bsc, _) = plane(&spread(8 * 64, 2), 8, 64, Fp8Kind::E4M3);
    asc[2 * 2 + 1] = 255;
    let planes = [(ad, asc), (bd, bsc)];
    let mut g = gpu();
    for variant in [1, 2, 3] {
        g.set_cuda_kernel_variant("matmul_mx_kernel", variant)
            .unwrap();
        let got = product(&mut g, &c, &planes, &[0.0; 32]);
        for (i, v) in got.iter().enumerate() {
            assert_eq!(v.is_nan(), i / 8 == 2, "v{variant} element {i}: {v}");
        }
    }
}

/// TFLOP/s (2·m·n·k per product, median of 10 synchronised runs after 2 warm-ups) of the
/// kernel and of the bf16-dequantize path on the same planes: 8192³ and the Llama-3.2-1B
/// forward GEMMs of 16384 tokens (q/o, k/v, gate/up, down). `... --ignored --nocapture
/// mx_gemm_timing`.
#[test]
#[ignore = "timing"]
fn mx_gemm_timing() {
    let mut g = gpu();
    for (m, n, k) in [
        (8192, 8192, 8192),
        (16384, 2048, 2048),
        (16384, 512, 2048),
        (16384, 8192, 2048),
        (16384, 2048, 8192),
    ] {
        let mk = |g: &mut Device, outer: usize, seed: u8| MxOperand {
            data: put_bytes(g, &vec![0x38 ^ seed; outer * k], 0),
            scales: put_bytes(g, &vec![127; outer * k.div_ceil(32)], 0),
            kind: Fp8Kind::E4M3,
            layout: MxLayout::Rowwise,
        };
        let (a, b) = (mk(&mut g, m, 0), mk(&mut g, n, 1));
        let c = g.alloc(DType::F32, m * n);
        let spec = MatmulMxSpec {
            m,
            n,
            k,
            accumulate: false,
        };
        let mut line = format!("mx_gemm {m}x{n}x{k}:");
        for variant in [1, 2, 3, 0] {
            g.set_cuda_kernel_variant("matmul_mx_kernel", variant)
                .unwrap();
            let t = time(&mut g, 10, |g| {
                g.matmul_mx(MxArg::Quantized(a), MxArg::Quantized(b), c, &spec)
                    .unwrap()
            });
            let tf = 2.0 * (m * n * k) as f64 / t / 1e6;
            let what = ["bf16 path", "kernel v0", "kernel v1", "kernel wgmma"][variant as usize];
            line += &format!(" {what} {:.3} ms {tf:.1} TFLOP/s;", t / 1e3);
        }
        println!("{line}");
    }
    g.set_cuda_kernel_variant("matmul_mx_kernel", 0).unwrap();
}
