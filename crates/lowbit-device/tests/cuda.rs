//! The CUDA backend against the CPU backend (the oracle): every op on random and edge-case
//! inputs (NaN, ±Inf, ±0, subnormals, odd lengths, non-zero view offsets, bf16 views aliasing
//! f32 buffers) runs on `Device::cpu()` and `Device::cuda(0)` and must leave identical bytes in
//! every buffer and return identical values and errors.
//!
//! One relaxation, for outputs of float arithmetic only: a NaN result matches any NaN. Rust
//! leaves NaN payloads unspecified and the hardware differs (x86 propagates an input NaN's
//! payload, or makes a negative default NaN; CUDA makes `0x7FFFFFFF`), so only NaN-ness is part
//! of the contract there. Data movement (fill, cast, copy, quantization) is compared strictly.
//!
//! These tests need a CUDA GPU: without one they fail (they never skip). Run them on the GPU
//! machine, one test at a time (`--test-threads=1`) to keep the GPU memory use low.
#![cfg(feature = "cuda")]

use lowbit_device::{
    AdamW, DType, Device, DeviceError, Fp8Kind, MatmulSpec, Mxfp8Config, Mxfp8Views, Nvfp4Config,
    Nvfp4Views, SgdMomentum, View,
};
use lowbit_formats::{Copies, NanPolicy};

mod support;
use stage2d::ScalesCalls;
use support::*;
mod stage2d;

// ---------------------------------------------------------------------------------------------
// Device and memory

#[test]
fn cuda_device_reports_itself() {
    let d = gpu();
    assert_eq!(d.cuda_ordinal(), Some(0));
    assert!(d.cuda_stream().is_some());
    assert!(Device::cpu().cuda_stream().is_none());
    assert!(Device::cuda(1 << 20).is_err(), "no such GPU is an error");
}

#[test]
fn memory_ops_match() {
    check_native("memory", false, |c| {
        let a = c.rand(DType::F32, 37, 1);
        let z = c.dev.alloc(DType::F32, 19);
        c.record(z);
        let b = c.rand(DType::Bf16, 64, 2);
        // zero-filled alloc, partial zero, offsets
        c.dev.zero(a.slice(3..9)?)?;
        c.dev.write_bytes(b.slice(5..8)?, &[1, 2, 3, 4, 5, 6])?;
        // cross-buffer copy with offsets, then overlapping copies both ways (memmove)
        let a16 = a.reinterpret(DType::Bf16)?;
        c.dev.copy(b.slice(1..21)?, a16.slice(11..31)?)?;
        c.dev.copy(b.slice(0..40)?, b.slice(7..47)?)?;
        c.dev.copy(b.slice(20..60)?, b.slice(13..53)?)?;
        c.dev.copy(a.slice(2..2)?, z.slice(0..0)?)?;
        let got = c.dev.read_bytes(b.slice(3..11)?)?;
        let d: Vec<f32> = c.dev.download(a.slice(30..37)?)?;
        let mut out: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
        out.extend(d.iter().map(|&x| f64::from(x.to_bits())));
        out.push(c.dev.allocated_bytes() as f64);
        Ok(out)
    });
}

#[test]
fn freed_stale_foreign_and_out_of_bounds_views_are_the_same_errors() {
    check("errors", false, |c| {
        let mut errs = Vec::new();
        let a = c.dev.alloc(DType::F32, 8);
        let b = c.rand(DType::F32, 8, 3);
        c.dev.free(a)?;
        errs.push(c.dev.read_bytes(a).unwrap_err());
        errs.push(c.dev.fill(a, 1.0).unwrap_err());
        errs.push(c.dev.free(a).unwrap_err());
        // The slot is reused: the stale view stays invalid.
        let a2 = c.dev.alloc(DType::F32, 8);
        c.record(a2);
        errs.push(c.dev.scale(a, 2.0).unwrap_err());
        // Another device's view.
        let mut other = Device::cpu();
        let foreign = other.alloc(DType::F32, 8);
        errs.push(c.dev.read_bytes(foreign).unwrap_err());
        // A view past its buffer's end (a slice of a reinterpretation of a bigger buffer).
        let big = c.dev.alloc(DType::F32, 16);
        c.record(big);
        c.dev.free(big)?;
        c.buffers.pop();
        let small = c.dev.alloc(DType::F32, 4);
        c.record(small);
        errs.push(c.dev.zero(big).unwrap_err());
        // Overlap, dtype and length errors.
        errs.push(c.dev.axpy(1.0, b, b).unwrap_err());
        errs.push(c.dev.cast(b.slice(0..4)?, b.slice(2..6)?).unwrap_err());
        errs.push(c.dev.add(b.slice(0..3)?, a2).unwrap_err());
        let u = c.dev.alloc(DType::U8, 4);
        c.record(u);
        errs.push(c.dev.scale(u, 1.0).unwrap_err());
        errs.push(c.dev.write_bytes(a2, &[0; 3]).unwrap_err());
        errs.push(c.dev.max_abs(a).unwrap_err());
        errs.push(
            c.dev
                .matmul(
                    b,
                    b,
                    a2,
                    &MatmulSpec {
                        m: 2,
                        n: 4,
                        k: 4,
                        trans_a: false,
                        trans_b: false,
                        accumulate: false,
                    },
                )
                .unwrap_err(),
        );
        let t = c.buf(DType::F32, &[0.0, 9.0]);
        errs.push(c.dev.softmax_cross_entropy(b, t).unwrap_err());
        // Errors carry the same payload: fold them into the compared buffer list.
        Ok(messages(&errs))
    });
}

#[test]
fn views_of_other_buffers_are_rejected_without_a_panic() {
    let mut g = gpu();
    let mut cpu = Device::cpu();
    let v = cpu.alloc(DType::F32, 4);
    assert!(matches!(g.read_bytes(v), Err(DeviceError::Freed(_))));
    assert!(g.cuda_device_ptr(v).is_err());
    let w = g.alloc(DType::F32, 4);
    let p = g.cuda_device_ptr(w).unwrap();
    assert_eq!(g.cuda_device_ptr(w.slice(1..3).unwrap()).unwrap(), p + 4);
    assert!(cpu.cuda_device_ptr(v).is_err());
    g.synchronize().unwrap();
}

// ---------------------------------------------------------------------------------------------
// Element-wise

#[test]
fn fill_matches() {
    check_native("fill", false, |c| {
        for (i, d) in FLOATS.into_iter().enumerate() {
            for (j, value) in [
                1.5f32,
                f32::NAN,
                -0.0,
                1e-40,
                65520.0,
                f32::from_bits(0xFFC0_1234),
            ]
            .into_iter()
            .enumerate()
            {
                let v = c.rand_mid(d, 33, 3, (i * 10 + j) as u64);
                c.dev.fill(v, value)?;
            }
        }
        Ok(vec![])
    });
}

#[test]
fn cast_matches_for_all_pairs() {
    check_native("cast", false, |c| {
        for (i, s) in FLOATS.into_iter().enumerate() {
            for (j, d) in FLOATS.into_iter().enumerate() {
                let seed = (i * 3 + j) as u64;
                let src = c.rand_mid(s, 1001, 1, seed);
                let dst = c.rand_mid(d, 1001, 2, seed + 100);
                c.dev.cast(src, dst)?;
            }
        }
        // f32 -> bf16 at every alignment of both sides and lengths around multiples of eight
        // (the eight-wide kernel, its head and its tail; the bytes around stay untouched).
        for (k, (so, dof)) in (0..4).flat_map(|a| (0..8).map(move |b| (a, b))).enumerate() {
            for n in [7, 64, 1003] {
                let seed = 1000 + 10 * k as u64 + n as u64;
                let src = c.rand_mid(DType::F32, n, so + 1, seed);
                let dst = c.rand_mid(DType::Bf16, n, dof + 1, seed + 5);
                c.dev.cast(src, dst)?;
            }
        }
        // f32 masters -> bf16 staging over the first half of an f32 gradient buffer.
        let m = c.rand(DType::F32, 130, 7);
        let grads = c.rand(DType::F32, 130, 8);
        let staging = grads.reinterpret(DType::Bf16)?.slice(0..130)?;
        c.dev.cast(m, staging)?;
        Ok(vec![])
    });
}

#[test]
fn scale_axpy_add_match() {
    check_native("scale/axpy/add", true, |c| {
        for (i, d) in FLOATS.into_iter().enumerate() {
            for (j, alpha) in [0.3f32, -2.5, 0.0, f32::INFINITY].into_iter().enumerate() {
                let v = c.rand_mid(d, 515, 1, (i * 4 + j) as u64);
                c.dev.scale(v, alpha)?;
            }
            for (j, x) in FLOATS.into_iter().enumerate() {
                let seed = 50 + (i * 3 + j) as u64;
                let xv = c.rand_mid(x, 777, 3, seed);
                let yv = c.rand_mid(d, 777, 1, seed + 1);
                c.dev.axpy(-0.7, xv, yv)?;
                let xv = c.rand_mid(x, 777, 2, seed + 2);
                let yv = c.rand_mid(d, 777, 0, seed + 3);
                c.dev.add(xv, yv)?;
            }
        }
        // The staging alias: y is a bf16 view inside an f32 buffer.
        let g = c.rand(DType::F32, 64, 9);
        c.compare_last_as(DType::Bf16);
        let x = c.rand(DType::F32, 64, 10);
        c.dev.add(x, g.reinterpret(DType::Bf16)?.slice(10..74)?)?;
        Ok(vec![])
    });
}

#[test]
fn reductions_match() {
    // Values with NaN as a class: a NaN sum of squares has an unspecified payload.
    check_native("reductions", true, |c| {
        let mut out = Vec::new();
        for (i, d) in FLOATS.into_iter().enumerate() {
            let with_specials = c.rand_mid(d, 10_001, 3, i as u64);
            let plain = c.buf(d, &finite(4099, 20 + i as u64));
            let empty = plain.slice(5..5)?;
            let nans = c.buf(d, &[f32::NAN; 5]);
            for v in [with_specials, plain, empty, nans] {
                out.push(f64::from(c.dev.max_abs(v)?));
                out.push(f64::from(u8::from(c.dev.has_non_finite(v)?)));
                out.push(c.dev.sum_squares(v)?);
            }
        }
        // The bf16 amax kernels of every version (v2 and v3 share max_abs_bits_bf16_v2:
        // 16-byte loads, four in flight, an element-wise tail).
        for version in [1, 2, 3] {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for (n, pad) in [(100_003, 0), (70_001, 8), (7, 1)] {
                let v = c.rand_mid(DType::Bf16, n, pad, n as u64 + u64::from(version));
                out.push(f64::from(c.dev.max_abs(v)?));
            }
        }
        Ok(out)
    });
}

/// `sum_squares` in its blocked order (4096-element f64 block sums, added 32 at a time, then the
/// group sums, each level in index order) on the GPU, compared as f64 bits with the CPU: sizes around the
/// block edges, offsets, every float dtype, ±Inf, NaN, large and subnormal values, and a bf16
/// view aliasing an f32 buffer. Every kernel version (`set_cuda_kernel_variant("sum_squares",
/// 0..=3)`; version 2 takes 16-byte aligned views, the misaligned ones fall back to version 1;
/// 3 is 1 with an L2 prefetch hint; 0 picks per dtype).
#[test]
fn sum_squares_bits_match() {
    check_native("sum_squares", true, |c| {
        let mut out = Vec::new();
        let sizes = [
            0,
            1,
            31,
            4095,
            4096,
            4097,
            8192,
            3 * 4096 + 5,
            32 * 4096,
            32 * 4096 + 1,
            64 * 4096 - 1,
            128 * 4096 + 1,
            300_007,
        ];
        for version in [1u32, 2, 3, 0] {
            c.dev.set_cuda_kernel_variant("sum_squares", version)?;
            let v = u64::from(version) * 10_000;
            for (i, d) in FLOATS.into_iter().enumerate() {
                for (j, n) in sizes.into_iter().enumerate() {
                    let seed = v + (i * 100 + j) as u64;
                    // Offsets 0 and 8 elements (16-byte aligned in every dtype), 1 and 3 (not).
                    let plain = c.buf(d, &finite(n + 8, seed));
                    for at in [0, 1, 3, 8] {
                        out.push(c.dev.sum_squares(plain.slice(at..n + at)?)?);
                    }
                    let special = c.rand_mid(d, n, 2, seed + 1000);
                    out.push(c.dev.sum_squares(special)?);
                    if n > 0 {
                        // Specials at offset 0 (aligned: version 2 where selected).
                        let special = c.rand_mid(d, n, 0, seed + 2000);
                        out.push(c.dev.sum_squares(special)?);
                    }
                }
                // A few million elements (many warps, a short last block).
                let big = c.buf(d, &finite(3_000_017, v + 500 + i as u64));
                out.push(c.dev.sum_squares(big)?);
                out.push(c.dev.sum_squares(big.slice(1..3_000_017)?)?);
            }
            // Infinite (no NaN), all-NaN, f32 extremes whose squares overflow f32 but not f64.
            let inf = c.buf(DType::F32, &[1.0, f32::INFINITY, -2.0, f32::NEG_INFINITY]);
            out.push(c.dev.sum_squares(inf)?);
            let nan = c.buf(DType::F32, &[f32::NAN; 4099]);
            out.push(c.dev.sum_squares(nan)?);
            // The group level is observable (see the CPU test): 2^54 in block 0, then a 1 in
            // each later block, whose 32 ones of group 1 meet in their own sum.
            let mut order = vec![0f32; 64 * 4096];
            order[0] = 2f32.powi(27);
            for b in 1..64 {
                order[b * 4096 + 7] = 1.0;
            }
            let order = c.buf(DType::F32, &order);
            out.push(c.dev.sum_squares(order)?);
            let big: Vec<f32> = (0..9000)
                .map(|k| match k % 3 {
                    0 => 3.0e38,
                    1 => f32::from_bits(1 + k as u32),
                    _ => -1.0e-20,
                })
                .collect();
            let b = c.buf(DType::F32, &big);
            out.push(c.dev.sum_squares(b)?);
            // The staging alias: a bf16 view over part of an f32 buffer (offset 1: misaligned;
            // offset 8: aligned).
            let g = c.buf(DType::F32, &finite(10_000, 77));
            for at in [1, 8] {
                out.push(
                    c.dev
                        .sum_squares(g.reinterpret(DType::Bf16)?.slice(at..12_345)?)?,
                );
            }
            // mse_loss shares the kernel (f32 differences, squared in f64): a misaligned and
            // aligned pairs, lengths around the block and warp edges.
            let p = c.buf(DType::F32, &values(300_008, 5, true));
            let t = c.buf(DType::F32, &finite(300_007, 6));
            out.push(f64::from(c.dev.mse_loss(p.slice(1..300_008)?, t)?));
            out.push(f64::from(c.dev.mse_loss(p.slice(0..300_007)?, t)?));
            for (k, n) in [1, 4095, 4097, 32 * 4096, 64 * 4096 - 1]
                .into_iter()
                .enumerate()
            {
                let p = c.buf(DType::F32, &values(n + 4, v + 40 + k as u64, true));
                let t = c.buf(DType::F32, &finite(n + 4, v + 60 + k as u64));
                out.push(f64::from(
                    c.dev.mse_loss(p.slice(0..n)?, t.slice(4..n + 4)?)?,
                ));
                out.push(f64::from(
                    c.dev.mse_loss(p.slice(3..n + 3)?, t.slice(0..n)?)?,
                ));
            }
            let p = c.buf(DType::F32, &finite(4097, 7));
            out.push(f64::from(c.dev.mse_loss(p, p)?));
            // Many views in one call (the gradient norm): empty, aliased, every dtype, big and
            // small; a dtype with a misaligned view runs version 1 for all its views.
            let views = [
                g.slice(0..0)?,
                b,
                g.reinterpret(DType::Bf16)?.slice(1..12_345)?,
                inf,
                c.buf(DType::Bf16, &finite(3 * 4096 + 5, 8)),
                c.buf(DType::F16, &finite(31, 9)),
                p,
            ];
            out.extend(c.dev.sum_squares_each(&views)?);
            // Every view aligned (version 2 where selected), sizes around the warp edges.
            let aligned = [
                c.buf(DType::F32, &finite(64 * 4096 - 1, v + 11)),
                g.reinterpret(DType::Bf16)?.slice(8..20_000)?,
                c.buf(DType::F32, &finite(4097, v + 12)),
                c.buf(DType::F16, &finite(32 * 4096, v + 13)),
                b.slice(4..9000)?,
                c.buf(DType::Bf16, &finite(1, v + 14)),
                c.buf(DType::F16, &finite(4095, v + 15)),
            ];
            out.extend(c.dev.sum_squares_each(&aligned)?);
            // Enough blocks that the partials are copied to the host in pieces whose edges
            // fall inside views (a view's partials are added across two pieces).
            let f = c.buf(DType::F32, &finite(5000 * 4096 + 77, v + 16));
            let h = c.buf(DType::F32, &finite(1500 * 4096 + 9, v + 17));
            let big = [
                f,
                h.reinterpret(DType::Bf16)?.slice(1..3000 * 4096)?,
                g.slice(0..0)?,
                c.buf(DType::F16, &finite(1000 * 4096 + 1, v + 18)),
                c.buf(DType::F32, &finite(33, v + 19)),
            ];
            out.extend(c.dev.sum_squares_each(&big)?);
            out.push(c.dev.sum_squares(f)?);
            // In stages (the gradient norm beside the reductions in flight): each view holds
            // garbage until `prepare` of its stage writes it, so a sum launched early would
            // differ; stages 1 and 3 have no views, so `prepare` never sees them.
            // With the default cap of the stages launched beside collectives (every stage but
            // the last; a quarter of the SMs, more than these stages need), then with one CTA
            // that strides over their warps (`sum_squares_beside`): stage 0's 11-group view and
            // stage 2's views take 12 warps, three rounds of its four. (Each check has its own
            // device, so the cap ends with it.)
            let lens = [
                70_001usize,
                4096,
                5 * 4096 + 3,
                33,
                0,
                3 * 4096,
                11 * 131_072 - 5,
            ];
            let stage = [2usize, 0, 4, 2, 0, 4, 0];
            let data: Vec<Vec<f32>> = (0..lens.len())
                .map(|i| finite(lens[i], v + 30 + i as u64))
                .collect();
            for cap in [None, Some(1)] {
                if let Some(cap) = cap {
                    c.dev.set_cuda_kernel_variant("sum_squares_beside", cap)?;
                }
                let staged: Vec<View> = (0..lens.len())
                    .map(|i| c.buf(DType::F32, &vec![1.0e30; lens[i]]))
                    .collect();
                let mut seen = Vec::new();
                out.extend(c.dev.sum_squares_each_staged(&staged, &stage, |d, k| {
                    seen.push(k);
                    for i in (0..lens.len()).filter(|&i| stage[i] == k) {
                        d.upload(staged[i], &data[i])?;
                    }
                    Ok::<(), DeviceError>(())
                })?);
                assert_eq!(seen, [0, 2, 4]);
                out.extend(c.dev.sum_squares_each(&staged)?);
            }
        }
        c.dev.set_cuda_kernel_variant("sum_squares", 0)?;
        Ok(out)
    });
}

// ---------------------------------------------------------------------------------------------
// Optimizers

#[test]
fn adamw_matches() {
    check_native("adamw", true, |c| {
        let mut k = 0;
        // Versions 1 (an element a thread) and 2 (four: 3000 elements take `adamw_x4`; 3001,
        // and 3000 with the gradient one element into its buffer, fall back to one).
        for (version, n, skew, gd) in [(1, 3001, 0), (2, 3000, 0), (2, 3001, 0), (2, 3000, 1)]
            .into_iter()
            .flat_map(|(v, n, skew)| FLOATS.map(|gd| (v, n, skew, gd)))
        {
            c.dev.set_cuda_kernel_variant("adamw", version)?;
            for od in [None, Some(DType::Bf16), Some(DType::F16), Some(DType::F32)] {
                for (beta1, step, wd, grad_scale) in [
                    (0.9f32, 1u64, 0.01f32, 1.0f32),
                    (0.3, 17, 0.0, 0.37),
                    (0.9, 1000, 0.1, 1e-3),
                ] {
                    k += 1;
                    let p = c.rand_mid(DType::F32, n, 1, k * 7);
                    let g = c
                        .rand_mid(gd, n + skew, 2, k * 7 + 1)
                        .slice(skew..n + skew)?;
                    let m = c.buf(DType::F32, &finite(n, k * 7 + 2));
                    let v = c.buf(
                        DType::F32,
                        &finite(n, k * 7 + 3)
                            .iter()
                            .map(|x| x.abs())
                            .collect::<Vec<_>>(),
                    );
                    let out = od.map(|d| c.rand_mid(d, n, 1, k * 7 + 4));
                    let hp = AdamW {
                        lr: 1e-3,
                        beta1,
                        beta2: 0.999,
                        eps: 1e-8,
                        weight_decay: wd,
                        step,
                        grad_scale,
                    };
                    c.dev.adamw(p, g, m, v, &hp, out)?;
                }
            }
        }
        // The staging alias: the bf16 output is the first half of an f32 gradient buffer
        // whose second half is the gradient.
        let grads = c.rand(DType::F32, 512, 99);
        c.compare_last_as(DType::Bf16);
        let out = grads.reinterpret(DType::Bf16)?.slice(0..256)?;
        let g = grads.slice(256..512)?;
        let p = c.rand(DType::F32, 256, 98);
        let m = c.buf(DType::F32, &[0.0; 256]);
        let v = c.buf(DType::F32, &[0.0; 256]);
        let hp = AdamW {
            lr: 0.01,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-6,
            weight_decay: 0.1,
            step: 3,
            grad_scale: 1.0,
        };
        c.dev.adamw(p, g, m, v, &hp, Some(out))?;
        Ok(vec![])
    });
}

#[test]
fn sgd_momentum_matches() {
    check_native("sgd", true, |c| {
        let mut k = 0;
        for gd in FLOATS {
            for (mom, wd, first) in [
                (0.9f32, 0.0f32, true),
                (0.9, 0.01, false),
                (0.0, 0.01, false),
                (0.5, 0.0, false),
            ] {
                k += 1;
                let p = c.rand_mid(DType::F32, 2049, 1, k * 5);
                let g = c.rand_mid(gd, 2049, 0, k * 5 + 1);
                let b = c.rand_mid(DType::F32, 2049, 3, k * 5 + 2);
                let hp = SgdMomentum {
                    lr: 0.1,
                    momentum: mom,
                    weight_decay: wd,
                };
                c.dev.sgd_momentum(p, g, b, &hp, first)?;
            }
        }
        Ok(vec![])
    });
}

// ---------------------------------------------------------------------------------------------
// Matmul

#[test]
fn matmul_matches() {
    check_native("matmul", true, |c| {
        let mut k = 0;
        for (m, n, kk) in [(7, 13, 29), (64, 33, 128), (1, 1, 1), (5, 3, 0), (0, 4, 3)] {
            for trans_a in [false, true] {
                for trans_b in [false, true] {
                    for accumulate in [false, true] {
                        for (ad, bd) in [(DType::F32, DType::F32), (DType::Bf16, DType::F16)] {
                            k += 1;
                            let a = c.rand_mid(ad, m * kk, 1, k * 3);
                            let b = c.rand_mid(bd, kk * n, 2, k * 3 + 1);
                            let cc = c.rand_mid(DType::F32, m * n, 1, k * 3 + 2);
                            let spec = MatmulSpec {
                                m,
                                n,
                                k: kk,
                                trans_a,
                                trans_b,
                                accumulate,
                            };
                            c.dev.matmul(a, b, cc, &spec)?;
                        }
                    }
                }
            }
        }
        // A · Aᵀ with overlapping inputs.
        let a = c.buf(DType::F32, &finite(6 * 5, 77));
        let cc = c.rand(DType::F32, 36, 78);
        let spec = MatmulSpec {
            m: 6,
            n: 6,
            k: 5,
            trans_a: false,
            trans_b: true,
            accumulate: false,
        };
        c.dev.matmul(a, a, cc, &spec)?;
        Ok(vec![])
    });
}

// ---------------------------------------------------------------------------------------------
// Model ops

#[test]
fn model_ops_match() {
    check_native("model ops", true, |c| {
        let f = DType::F32;
        let mut out = Vec::new();
        for (rows, cols, seed) in [(13usize, 37usize, 1u64), (1, 1, 2), (64, 256, 3), (0, 5, 4)] {
            let x = c.rand_mid(f, rows * cols, 1, seed);
            let bias = c.rand(f, cols, seed + 10);
            c.dev.add_bias(x, bias)?;
            let dy = c.rand_mid(f, rows * cols, 2, seed + 11);
            let db = c.rand(f, cols, seed + 12);
            c.dev.bias_grad(dy, db, false)?;
            let db2 = c.rand(f, cols, seed + 13);
            c.dev.bias_grad(dy, db2, true)?;
            // RMSNorm forward and backward (finite inputs and plain ones with specials).
            for (k, xs) in [
                finite(rows * cols, seed + 14),
                values(rows * cols, seed + 15, true),
            ]
            .into_iter()
            .enumerate()
            {
                let x = c.buf(f, &xs);
                let w = c.rand(f, cols, seed + 16 + k as u64);
                let y = c.rand(f, rows * cols, seed + 18);
                let rstd = c.rand(f, rows, seed + 19);
                if cols > 0 {
                    c.dev.rms_norm(x, w, y, rstd, 1e-5)?;
                }
                let dy = c.buf(f, &finite(rows * cols, seed + 20));
                let dx = c.rand(f, rows * cols, seed + 21);
                let dw = c.buf(f, &finite(cols, seed + 22));
                c.dev.rms_norm_backward(x, w, rstd, dy, dx, dw)?;
            }
            // GELU.
            let x = c.rand_mid(f, rows * cols, 1, seed + 30);
            let y = c.rand(f, rows * cols, seed + 31);
            c.dev.gelu(x, y)?;
            let dy = c.rand(f, rows * cols, seed + 32);
            let dx = c.rand(f, rows * cols, seed + 33);
            c.dev.gelu_backward(x, dy, dx)?;
            // MSE.
            let p = c.rand(f, rows * cols, seed + 40);
            let t = c.buf(f, &finite(rows * cols, seed + 41));
            out.push(f64::from(c.dev.mse_loss(p, t)?));
            let dp = c.rand(f, rows * cols, seed + 42);
            c.dev.mse_loss_backward(p, t, dp, 0.5)?;
            // Softmax cross-entropy (classes = cols), finite and special logits.
            let targets: Vec<f32> = (0..rows)
                .map(|r| ((r * 7 + 3) % cols.max(1)) as f32)
                .collect();
            let t = c.buf(f, &targets);
            for logits in [
                finite(rows * cols, seed + 50),
                values(rows * cols, seed + 51, true),
            ] {
                let l = c.buf(f, &logits);
                out.push(f64::from(c.dev.softmax_cross_entropy(l, t)?));
                let d = c.rand(f, rows * cols, seed + 52);
                c.dev.softmax_cross_entropy_backward(l, t, d, 2.0)?;
            }
        }
        // Large logits (the log-softmax path must not overflow) and an all -inf row.
        let l = c.buf(
            f,
            &[1e30, -1e30, 88.0, 3.0, f32::NEG_INFINITY, f32::NEG_INFINITY],
        );
        let t = c.buf(f, &[0.0, 1.0]);
        out.push(f64::from(c.dev.softmax_cross_entropy(l, t)?));
        let d = c.rand(f, 6, 90);
        c.dev.softmax_cross_entropy_backward(l, t, d, 1.0)?;
        Ok(out)
    });
}

// ---------------------------------------------------------------------------------------------
// Quantization

fn mxfp8_views(c: &mut Ctx, rows: usize, cols: usize, copies: Copies, seed: u64) -> Mxfp8Views {
    let mut pair = |data: usize, scales: usize, s: u64| {
        (c.rand(DType::U8, data, s), c.rand(DType::U8, scales, s + 1))
    };
    Mxfp8Views {
        rowwise: copies
            .rowwise()
            .then(|| pair(rows * cols, rows * cols.div_ceil(32), seed)),
        columnwise: copies
            .columnwise()
            .then(|| pair(rows * cols, rows.div_ceil(32) * cols, seed + 2)),
    }
}

#[test]
fn mxfp8_kernels_match() {
    check_native("mxfp8 kernels", false, |c| {
        let mut k = 0;
        let shapes = [
            (64, 64),
            (37, 45),
            (1, 1),
            (96, 512),
            (33, 32),
            (40, 48),
            (65, 264),
            (70, 300),
            (32, 1000),
            // Whole interior tiles (v4, v5) next to partial ones.
            (160, 768),
        ];
        for version in [1, 4, 5] {
            c.dev.set_cuda_kernel_variant("mxfp8_both", version)?;
            for (rows, cols) in shapes {
                for copies in [Copies::Rowwise, Copies::Both] {
                    k += 10;
                    let src = c.rand(DType::Bf16, rows * cols, k);
                    let views = mxfp8_views(c, rows, cols, copies, k + 1);
                    let cfg = Mxfp8Config {
                        copies,
                        ..Mxfp8Config::default()
                    };
                    c.dev.quantize_mxfp8(src, rows, cols, &cfg, &views)?;
                }
            }
        }
        // NaN blocks, subnormal-only and infinite rows, with every version.
        for version in [1, 4, 5] {
            c.dev.set_cuda_kernel_variant("mxfp8_both", version)?;
            for copies in [Copies::Rowwise, Copies::Both] {
                let src = c.buf(DType::Bf16, &nan_blocks(true));
                let views = mxfp8_views(c, 64, 64, copies, 2000 + u64::from(version));
                let cfg = Mxfp8Config {
                    copies,
                    ..Mxfp8Config::default()
                };
                c.dev.quantize_mxfp8(src, 64, 64, &cfg, &views)?;
            }
        }
        // Versions 4 and 5 with a misaligned source (element-wise loads and stores).
        for version in [4, 5] {
            c.dev.set_cuda_kernel_variant("mxfp8_both", version)?;
            let src = c.rand_mid(DType::Bf16, 40 * 64, 1, 999 + u64::from(version));
            let views = mxfp8_views(c, 40, 64, Copies::Both, 1000);
            c.dev
                .quantize_mxfp8(src, 40, 64, &Mxfp8Config::default(), &views)?;
        }
        Ok(vec![])
    });
}

#[test]
fn mxfp8_fallback_variants_match_and_are_counted() {
    let o = check("mxfp8 fallback", false, |c| {
        let (rows, cols) = (40, 64);
        let mut k = 0;
        let mut cases: Vec<(DType, Mxfp8Config, usize)> = vec![
            (DType::F32, Mxfp8Config::default(), 0),
            (
                DType::Bf16,
                Mxfp8Config {
                    kind: Fp8Kind::E5M2,
                    ..Mxfp8Config::default()
                },
                0,
            ),
            (
                DType::Bf16,
                Mxfp8Config {
                    copies: Copies::Columnwise,
                    ..Mxfp8Config::default()
                },
                0,
            ),
            (
                DType::Bf16,
                Mxfp8Config {
                    two_d: true,
                    ..Mxfp8Config::default()
                },
                0,
            ),
            // A misaligned source (offset 2 bytes): element-wise accesses (native since version 2).
            (DType::Bf16, Mxfp8Config::default(), 1),
        ];
        cases.push((
            DType::Bf16,
            Mxfp8Config {
                copies: Copies::Rowwise,
                ..Mxfp8Config::default()
            },
            1,
        ));
        for (d, cfg, offset) in cases {
            k += 10;
            let src = c.rand_mid(d, rows * cols, offset, k);
            let views = mxfp8_views(c, rows, cols, cfg.copies, k + 1);
            c.dev.quantize_mxfp8(src, rows, cols, &cfg, &views)?;
            // Dequantize what was written, both copies where present.
            if let Some((data, scales)) = views.rowwise {
                let dst = c.rand(DType::F32, rows * cols, k + 5);
                c.dev
                    .dequantize_mxfp8_rowwise(data, scales, rows, cols, cfg.kind, dst)?;
            }
            if let Some((data, scales)) = views.columnwise {
                let dst = c.rand(DType::Bf16, rows * cols, k + 6);
                c.dev
                    .dequantize_mxfp8_columnwise(data, scales, rows, cols, cfg.kind, dst)?;
            }
        }
        // NaN policy Error: the format error comes back identically, nothing written.
        let src = c.rand(DType::Bf16, 64 * 32, 1234);
        let views = mxfp8_views(c, 64, 32, Copies::Both, 1235);
        let cfg = Mxfp8Config {
            nan_policy: NanPolicy::Error,
            ..Mxfp8Config::default()
        };
        let err = c.dev.quantize_mxfp8(src, 64, 32, &cfg, &views);
        Ok(vec![f64::from(u8::from(err.is_err()))])
    });
    assert!(
        o.fallbacks
            .iter()
            .any(|(op, n)| *op == "quantize_mxfp8" && *n >= 1),
        "{:?}",
        o.fallbacks
    );
}

/// Both-copies MXFP8 views for `rows × cols` carved from the u8 buffer `buf` from byte `at`:
/// each view starts `gap` bytes after the previous one ends, rounded up to a multiple of
/// `align` (1: odd offsets, which take the kernels' element-wise path); returns the views and
/// the next free byte.
fn carve_mxfp8_views(
    buf: View,
    at: usize,
    (gap, align): (usize, usize),
    (rows, cols): (usize, usize),
) -> (Mxfp8Views, usize) {
    let mut next = at;
    let mut take = |n: usize| {
        let start = (next + gap).next_multiple_of(align);
        next = start + n;
        buf.slice(start..start + n).unwrap()
    };
    let rowwise = Some((take(rows * cols), take(rows * cols.div_ceil(32))));
    let columnwise = Some((take(rows * cols), take(rows.div_ceil(32) * cols)));
    (
        Mxfp8Views {
            rowwise,
            columnwise,
        },
        next,
    )
}

/// `quantize_mxfp8_many` (launches of `mxfp8_both_e4m3_bf16_v4_many` for the bf16 items, 64 at
/// most per launch) equals one `quantize_mxfp8` per item on the same device and the CPU's bytes
/// (150 small matrices check the split over launches): a Llama-like
/// layer (scaled down), real 2048-column shapes, odd shapes, sources at element offsets inside
/// one buffer (aligned and misaligned), outputs packed into one buffer at 16-byte aligned and
/// at odd offsets (guard bytes between them must stay untouched), an f32 and an f16 item (their
/// own kernels, one by one), with every both-copies version (1 and 5 take the per-item path).
#[test]
fn mxfp8_many_matches_per_item_and_cpu() {
    check_native("mxfp8 many", false, |c| {
        // (rows, cols, source dtype, source element offset, output alignment)
        let items_spec: [(usize, usize, DType, usize, usize); 16] = [
            (2048, 2048, DType::Bf16, 0, 16),
            (512, 2048, DType::Bf16, 0, 16),
            (1024, 2048, DType::Bf16, 0, 16),
            // One layer of Llama-3.2-1B at a quarter of each dimension.
            (512, 512, DType::Bf16, 0, 16),
            (128, 512, DType::Bf16, 0, 16),
            (128, 512, DType::Bf16, 0, 16),
            (512, 512, DType::Bf16, 0, 16),
            (2048, 512, DType::Bf16, 0, 16),
            (2048, 512, DType::Bf16, 0, 16),
            (512, 2048, DType::Bf16, 0, 16),
            // Off the tile grid, misaligned, odd outputs, other dtypes.
            (37, 45, DType::Bf16, 0, 1),
            (64, 256, DType::Bf16, 8, 16),
            // The same shape misaligned: another launch of the same-shape path (`vec` off).
            (64, 256, DType::Bf16, 1, 16),
            (96, 512, DType::Bf16, 1, 16),
            (40, 64, DType::F32, 0, 16),
            (33, 72, DType::F16, 3, 1),
        ];
        let mut out = Vec::new();
        // (mxfp8_both, mxfp8_many): version 4 in one launch per shape (2), in one launch for
        // all (1) and as chosen (0); versions 1 and 5 take the per-item path.
        for (version, many) in [(4, 2), (4, 1), (4, 0), (1, 2), (5, 2)] {
            c.dev.set_cuda_kernel_variant("mxfp8_both", version)?;
            c.dev.set_cuda_kernel_variant("mxfp8_many", many)?;
            let seed = 7000 + 100 * u64::from(version) + u64::from(many);
            // Versions 1 and 5 take the per-item path: the small items suffice there.
            let spec: Vec<_> = items_spec
                .iter()
                .copied()
                .filter(|s| version == 4 || s.0 * s.1 <= 512 * 512)
                .collect();
            // Sources: one buffer per dtype, each item's view at its element offset from a
            // multiple of 8 elements after the previous one (bf16: an offset of 8 keeps 16-byte
            // alignment, 1 breaks it).
            let mut srcs = Vec::new();
            for (k, d) in [DType::Bf16, DType::F32, DType::F16]
                .into_iter()
                .enumerate()
            {
                let of_d = spec.iter().filter(|s| s.2 == d);
                let n: usize = of_d.map(|s| s.0 * s.1 + s.3 + 16).sum();
                let buf = c.rand(d, n, seed + k as u64);
                let mut at = 0;
                for (i, s) in spec.iter().enumerate().filter(|(_, s)| s.2 == d) {
                    srcs.push((i, buf.slice(at + s.3..at + s.3 + s.0 * s.1).unwrap()));
                    at = (at + s.3 + s.0 * s.1 + 8).next_multiple_of(8);
                }
            }
            srcs.sort_by_key(|(i, _)| *i);
            // Two identical output buffers (same garbage), carved the same way.
            let room: usize = spec
                .iter()
                .map(|s| 4 * s.0 * s.1 + 2 * (s.0 + s.1) + 8 * 32)
                .sum();
            let bufs = [
                c.rand(DType::U8, room, seed + 10),
                c.rand(DType::U8, room, seed + 10),
            ];
            let mut sets = [Vec::new(), Vec::new()];
            for (set, &buf) in sets.iter_mut().zip(&bufs) {
                let mut at = 0;
                for ((_, src), s) in srcs.iter().zip(&spec) {
                    let (views, next) = carve_mxfp8_views(buf, at, (3, s.4), (s.0, s.1));
                    at = next;
                    set.push((*src, s.0, s.1, views));
                }
            }
            out.push(many_matches_per_item(c, bufs, &sets)?);
        }
        // More matrices than one launch's parameter table holds (64): 150 small ones of three
        // shapes, split over three launches (version 1), and 90 of one shape over two launches
        // (version 2).
        c.dev.set_cuda_kernel_variant("mxfp8_both", 4)?;
        let shapes: Vec<(usize, usize)> = (0..150)
            .map(|i| [(32, 256), (64, 512), (32, 256), (96, 256), (32, 256)][i % 5])
            .collect();
        let n: usize = shapes.iter().map(|s| s.0 * s.1).sum();
        let src = c.rand(DType::Bf16, n, 7900);
        let room: usize = shapes.iter().map(|s| 3 * s.0 * s.1 + 64).sum();
        for many in [1, 2, 0] {
            c.dev.set_cuda_kernel_variant("mxfp8_many", many)?;
            // Fresh garbage for each version, so that bytes a launch left out would differ.
            let seed = 7901 + u64::from(many);
            let bufs = [c.rand(DType::U8, room, seed), c.rand(DType::U8, room, seed)];
            let mut sets = [Vec::new(), Vec::new()];
            for (set, &buf) in sets.iter_mut().zip(&bufs) {
                let (mut e, mut at) = (0, 0);
                for &(rows, cols) in &shapes {
                    let (views, next) = carve_mxfp8_views(buf, at, (0, 16), (rows, cols));
                    set.push((src.slice(e..e + rows * cols)?, rows, cols, views));
                    (e, at) = (e + rows * cols, next);
                }
            }
            out.push(many_matches_per_item(c, bufs, &sets)?);
        }
        c.dev.set_cuda_kernel_variant("mxfp8_many", 0)?;
        Ok(out)
    });
}

/// One `quantize_mxfp8_many` of `sets[0]` and one `quantize_mxfp8` per item of `sets[1]`, the
/// same items carved the same way from the two identical buffers `bufs`: 1.0 when the many
/// call wrote the per-item calls' bytes on this device (the CPU comparison of every recorded
/// buffer follows in `check`), else 0.0.
fn many_matches_per_item(
    c: &mut Ctx,
    bufs: [View; 2],
    sets: &[Vec<(View, usize, usize, Mxfp8Views)>; 2],
) -> lowbit_device::Result<f64> {
    let cfg = Mxfp8Config::default();
    c.dev.quantize_mxfp8_many(&sets[0], &cfg)?;
    for (src, rows, cols, views) in &sets[1] {
        c.dev.quantize_mxfp8(*src, *rows, *cols, &cfg, views)?;
    }
    let [a, b] = bufs.map(|v| c.dev.read_bytes(v));
    Ok(f64::from(u8::from(a? == b?)))
}

/// The versions of `set_cuda_kernel_variant("nvfp4", _)`: 1-3 differ in the amax pass and the
/// rowwise kernel, 4 is 3 with the shared-memory-transpose columnwise kernel
/// (`nvfp4_quantize_cols_v4`), 5 writes both copies from one read (`nvfp4_quantize_both_v5`),
/// 6 is 5 and 4 over pairs of 256-row tiles (whole-sector column scale stores), 7 is 6 with
/// `nvfp4_word_v4` (the codes' selects and bit merges as integer multiply-adds), 8 is 7 with
/// `nvfp4_quantize_both_v8` (one conversion for two scale bytes, amax trees, NaN blocks out of
/// line), 9 is 8 with the thresholds of the class table (`nvfp4_params_v9`), 10 is 9 with its
/// both-copies kernel launched as the parameters kernel's programmatic dependent.
const NVFP4_VERSIONS: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];

#[test]
fn nvfp4_kernels_match() {
    // Quantized bytes are compared strictly (u8 buffers); dequantized values with NaN as a class
    // (an infinite global amax makes 0 · Inf products).
    check_native("nvfp4 kernels", true, |c| {
        let mut out = Vec::new();
        let mut k = 0;
        let shapes = [
            (48usize, 64usize),
            (16, 45),
            (3, 17),
            (64, 256),
            (32, 1),
            (128, 512),
            // Version 4's columnwise tiles (256 rows x 64 columns): partial in both directions,
            // rows % 32 != 0 (8-byte code stores), rows % 64 != 0 (byte scale stores), a
            // second tile row, a last tile row of 64 rows.
            (80, 72),
            (288, 136),
            (576, 8),
            // Version 6's tile pairs whole (16-byte column scale stores).
            (1024, 128),
        ];
        for (version, (rows, cols)) in NVFP4_VERSIONS
            .into_iter()
            .flat_map(|v| shapes.map(|s| (v, s)))
        {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for d in FLOATS {
                for copies in [Copies::Rowwise, Copies::Columnwise, Copies::Both] {
                    for specials in [false, true] {
                        if copies.columnwise() && !rows.is_multiple_of(16) {
                            continue;
                        }
                        k += 10;
                        let vals = if specials {
                            values(rows * cols, k, true)
                        } else {
                            finite(rows * cols, k)
                        };
                        let src = c.buf(d, &vals);
                        let views = nvfp4_views(c, rows, cols, copies, k + 1);
                        let cfg = Nvfp4Config {
                            copies,
                            ..Nvfp4Config::default()
                        };
                        let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
                        out.extend([f64::from(amax.rowwise), f64::from(amax.columnwise)]);
                        if let Some((data, scales)) = views.rowwise {
                            let dst = c.rand(d, rows * cols, k + 5);
                            c.dev.dequantize_nvfp4_rowwise(
                                data,
                                scales,
                                amax.rowwise,
                                rows,
                                cols,
                                dst,
                            )?;
                        }
                        if let Some((data, scales)) = views.columnwise {
                            let dst = c.rand(DType::F32, rows * cols, k + 6);
                            c.dev.dequantize_nvfp4_columnwise(
                                data,
                                scales,
                                amax.columnwise,
                                false,
                                rows,
                                cols,
                                dst,
                            )?;
                        }
                    }
                }
            }
        }
        // NaN blocks, subnormal-only and infinite rows, every input dtype and version.
        for (version, d) in NVFP4_VERSIONS
            .into_iter()
            .flat_map(|v| FLOATS.map(|d| (v, d)))
        {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            let src = c.buf(d, &nan_blocks(false));
            let views = nvfp4_views(c, 64, 64, Copies::Both, 3000);
            let amax = c
                .dev
                .quantize_nvfp4(src, 64, 64, &Nvfp4Config::default(), &views)?;
            out.push(f64::from(amax.rowwise));
        }
        // All zeros (amax 0) and an infinite amax, with every version.
        for version in NVFP4_VERSIONS {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for vals in [vec![0.0f32; 32 * 32], {
                let mut v = finite(32 * 32, 5);
                v[17] = f32::INFINITY;
                v
            }] {
                let src = c.buf(DType::Bf16, &vals);
                let views = nvfp4_views(c, 32, 32, Copies::Both, 77);
                let amax = c
                    .dev
                    .quantize_nvfp4(src, 32, 32, &Nvfp4Config::default(), &views)?;
                out.push(f64::from(amax.rowwise));
            }
        }
        Ok(out)
    });
}

#[test]
fn mxfp8_dequantize_kernels_match() {
    // NaN codes and the NaN scale 0xFF included: random bytes for data and scales.
    check_native("mxfp8 dequantize", true, |c| {
        let mut k = 0;
        for (rows, cols) in [(40usize, 64usize), (37, 45), (1, 1)] {
            for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
                for d in FLOATS {
                    k += 10;
                    let mut r = Rng::new(k);
                    let bytes: Vec<f32> =
                        (0..rows * cols).map(|_| (r.next() % 256) as f32).collect();
                    let data = c.buf(DType::U8, &bytes);
                    let rs: Vec<f32> = (0..rows * cols.div_ceil(32))
                        .map(|_| (r.next() % 256) as f32)
                        .collect();
                    let cs: Vec<f32> = (0..rows.div_ceil(32) * cols)
                        .map(|_| (r.next() % 256) as f32)
                        .collect();
                    let rsv = c.buf(DType::U8, &rs);
                    let csv = c.buf(DType::U8, &cs);
                    let dst = c.rand(d, rows * cols, k + 1);
                    c.dev
                        .dequantize_mxfp8_rowwise(data, rsv, rows, cols, kind, dst)?;
                    let dst = c.rand(d, rows * cols, k + 2);
                    c.dev
                        .dequantize_mxfp8_columnwise(data, csv, rows, cols, kind, dst)?;
                }
            }
        }
        Ok(vec![])
    });
}

/// bf16 blocks whose magnitudes span seven binades under a per-block scale that moves over
/// the E4M3 scale range (so every scale byte and every E2M1 step is met), the tensor amax
/// 2.625 · 2^off (a power-of-two S_enc: exact E2M1 ties are common), and with `raw_bits` a
/// third of the blocks raw random bf16 bit patterns (NaN payloads, subnormals, ±Inf, ±0).
fn nvfp4_stress(rows: usize, cols: usize, seed: u64, raw_bits: bool) -> Vec<f32> {
    let mut r = Rng::new(seed);
    let off = (seed % 40) as i32 - 20;
    let mut v = Vec::with_capacity(rows * cols);
    for _ in 0..(rows * cols).div_ceil(16) {
        let base = off + (r.next() % 18) as i32 - 17;
        let raw = raw_bits && r.next().is_multiple_of(3);
        for _ in 0..16 {
            let x = r.next();
            let bits = if raw {
                (x as u32) & 0xFFFF_0000
            } else {
                // Exactly representable in bf16: 8 significant bits.
                let m = 128 + (x >> 8) as u32 % 128;
                let e = (base - (x >> 20) as i32 % 7).clamp(-126, 120);
                let sign = if (x >> 40).is_multiple_of(2) {
                    0
                } else {
                    0x8000_0000
                };
                sign | (((e + 127) as u32) << 23) | ((m - 128) << 16)
            };
            v.push(f32::from_bits(bits));
        }
    }
    v.truncate(rows * cols);
    if !raw_bits {
        v[0] = 2.625 * 2f32.powi(off);
    }
    v
}

#[test]
fn nvfp4_rowwise_versions_match_on_stress_inputs() {
    // Rowwise bf16 (the vector kernels of versions 2, 3 and 7, and version 7's both-copies
    // kernel: nvfp4_word_v4's multiply-add selects and merges) against the CPU, strictly.
    check_native("nvfp4 rowwise stress", true, |c| {
        let mut out = Vec::new();
        for (version, copies) in [
            (2, Copies::Rowwise),
            (3, Copies::Rowwise),
            (7, Copies::Rowwise),
            (7, Copies::Both),
            (8, Copies::Both),
            (9, Copies::Both),
        ] {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for (k, (rows, cols, raw)) in [
                (256usize, 512usize, false),
                (128, 1024, true),
                (64, 96, false),
                (33, 32, true),
            ]
            .into_iter()
            .enumerate()
            {
                if copies.columnwise() && !rows.is_multiple_of(16) {
                    continue;
                }
                let seed = 7000 + 10 * k as u64 + u64::from(version);
                let src = c.buf(DType::Bf16, &nvfp4_stress(rows, cols, seed, raw));
                let views = nvfp4_views(c, rows, cols, copies, seed + 1);
                let cfg = Nvfp4Config {
                    copies,
                    ..Nvfp4Config::default()
                };
                let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
                out.push(f64::from(amax.rowwise));
            }
        }
        Ok(out)
    });
}

#[test]
fn nvfp4_columnwise_versions_match_on_stress_inputs() {
    // Columnwise bf16 (nvfp4_quantize_cols in version 3, the shared-memory transpose
    // nvfp4_quantize_cols_v4 in version 4) against the CPU, strictly: the stress values laid
    // out along columns (generated for the transpose, then transposed), so every column block
    // meets the per-block scales, the exact ties and (raw) the NaN, Inf, subnormal and ±0
    // patterns. Shapes: whole tiles, partial tiles in both directions, rows % 32 != 0.
    check_native("nvfp4 columnwise stress", true, |c| {
        let mut out = Vec::new();
        for version in [3, 4, 5, 6, 7, 8, 9, 10] {
            c.dev.set_cuda_kernel_variant("nvfp4", version)?;
            for (k, (rows, cols, raw)) in [
                (512usize, 256usize, false),
                (1024, 128, true),
                (96, 64, false),
                (272, 40, true),
                (48, 200, false),
            ]
            .into_iter()
            .enumerate()
            {
                let seed = 7500 + 10 * k as u64 + u64::from(version);
                let t = nvfp4_stress(cols, rows, seed, raw);
                let vals: Vec<f32> = (0..rows * cols)
                    .map(|i| t[(i % cols) * rows + i / cols])
                    .collect();
                let src = c.buf(DType::Bf16, &vals);
                let views = nvfp4_views(c, rows, cols, Copies::Both, seed + 1);
                let cfg = Nvfp4Config::default();
                let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
                out.push(f64::from(amax.columnwise));
            }
        }
        Ok(out)
    });
}

#[test]
fn nvfp4_fallback_variants_match() {
    check_native("nvfp4", false, |c| {
        let mut out = Vec::new();
        let (rows, cols) = (48, 64);
        for (k, cfg) in [
            Nvfp4Config::default(),
            Nvfp4Config {
                rht: true,
                ..Nvfp4Config::default()
            },
            Nvfp4Config {
                stochastic_rounding: Some(7),
                two_d: true,
                ..Nvfp4Config::default()
            },
        ]
        .into_iter()
        .enumerate()
        {
            let src = c.buf(DType::Bf16, &finite(rows * cols, 300 + k as u64));
            let mut pair = |data: usize, scales: usize, s: u64| {
                (c.rand(DType::U8, data, s), c.rand(DType::U8, scales, s + 1))
            };
            let views = Nvfp4Views {
                rowwise: Some(pair(rows * cols / 2, rows * cols / 16, 400 + k as u64)),
                columnwise: Some(pair(cols * rows / 2, cols * rows / 16, 500 + k as u64)),
            };
            let amax = c.dev.quantize_nvfp4(src, rows, cols, &cfg, &views)?;
            out.extend([f64::from(amax.rowwise), f64::from(amax.columnwise)]);
            let (d, s) = views.rowwise.unwrap();
            let dst = c.rand(DType::F32, rows * cols, 600 + k as u64);
            c.dev
                .dequantize_nvfp4_rowwise(d, s, amax.rowwise, rows, cols, dst)?;
            let (d, s) = views.columnwise.unwrap();
            let dst = c.rand(DType::F32, rows * cols, 700 + k as u64);
            c.dev
                .dequantize_nvfp4_columnwise(d, s, amax.columnwise, cfg.rht, rows, cols, dst)?;
        }
        Ok(out)
    });
    // 2D, the Hadamard transform and stochastic rounding have kernels (crates/lowbit-kernels/nvfp4.cu).
}

/// The sharded 2D primary-weight ops: tile amaxes folded shard by shard (shard boundaries
/// inside rows and tiles, tiles starting non-zero), the codes of each shard, the 2D scales.
#[test]
fn sharded_2d_ops_match() {
    let o = check("sharded 2d", false, |c| {
        let mut out = Vec::new();
        for (rows, cols, d, seed) in SHARDED_2D_CASES {
            let n = rows * cols;
            let x = c.buf(d, &finite(n, 800 + seed));
            // Three shards, boundaries at even offsets (NVFP4 packs pairs) inside rows.
            let cuts = [0, (n / 3) & !1, (2 * n / 3) & !1, n];
            for kind in [Fp8Kind::E4M3, Fp8Kind::E5M2] {
                let init: Vec<f32> = (0..lowbit_device::mxfp8_tile_count(rows, cols))
                    .map(|i| if i % 5 == 0 { 1e-3 } else { 0.0 })
                    .collect();
                let tiles = c.buf(DType::F32, &init);
                for w in cuts.windows(2) {
                    let s = x.slice(w[0]..w[1])?;
                    c.dev.mxfp8_fold_tile_amax_2d(s, w[0], cols, tiles)?;
                }
                let q = c.rand(DType::U8, n, 801 + seed);
                for w in cuts.windows(2) {
                    let (s, qs) = (x.slice(w[0]..w[1])?, q.slice(w[0]..w[1])?);
                    c.dev
                        .mxfp8_quantize_2d_range(s, w[0], cols, kind, tiles, qs)?;
                }
                let rs = c.rand(DType::U8, rows * cols.div_ceil(32), 802 + seed);
                let cs = c.rand(DType::U8, rows.div_ceil(32) * cols, 803 + seed);
                c.dev.mxfp8_scales_2d(rows, cols, kind, tiles, rs, cs)?;
            }
            // NVFP4: fold, quantize each shard, then rebuild both copies.
            let shards = nvfp4_shards_2d(c, x, (rows, cols), &cuts, 804 + seed)?;
            if cols % 2 == 0 {
                out.push(nvfp4_finish_shards_2d(c, (rows, cols), shards, 804 + seed)?);
            }
        }
        // Errors the library raises come back identically: an odd NVFP4 shard start, a
        // length mismatch, too few tiles, wrong scale lengths.
        let x = c.buf(DType::F32, &finite(64, 9));
        let tiles = c.buf(DType::F32, &[0.5; 4]);
        let q = c.rand(DType::U8, 64, 10);
        let mut errs = vec![
            c.dev
                .nvfp4_quantize_2d_range(x.slice(1..33)?, 1, 8, tiles, q.slice(0..16)?)
                .unwrap_err(),
            c.dev
                .mxfp8_quantize_2d_range(x, 0, 8, Fp8Kind::E4M3, tiles, q.slice(0..10)?)
                .unwrap_err(),
            c.dev.mxfp8_fold_tile_amax_2d(x, 0, 0, tiles).unwrap_err(),
            c.dev
                .mxfp8_scales_2d(64, 64, Fp8Kind::E4M3, tiles, q, q)
                .unwrap_err(),
        ];
        errs.push(
            c.dev
                .mxfp8_scales_2d(32, 64, Fp8Kind::E4M3, tiles.slice(0..2)?, q.slice(0..5)?, q)
                .unwrap_err(),
        );
        out.extend(messages(&errs));
        Ok(out)
    });
    // Only the error cases take the host path.
    let error_paths = [
        "nvfp4_quantize_2d_range",
        "mxfp8_quantize_2d_range",
        "mxfp8_scales_2d",
    ];
    fallbacks_only(&o, &error_paths);
}

/// The batched 2D staging ops (`tests/stage2d`: several pieces of MXFP8 E4M3/E5M2 and NVFP4
/// matrices in one call, cuts mid-row and mid-tile, f32/bf16/f16 masters rounded to bf16 in
/// the kernels, three NVFP4 experts, wide matrices on the vector paths) and the batched 2D MXFP8
/// scales: the bytes of the CPU's cast and one single op per piece, all on the kernels.
#[test]
fn stage_2d_many_matches_per_piece_and_cpu() {
    let cpu = stage2d::run(&mut Device::cpu(), false).unwrap();
    let mut g = gpu();
    let many = stage2d::run(&mut g, true).unwrap();
    assert_eq!(many.len(), cpu.len());
    for (k, (m, c)) in many.iter().zip(&cpu).enumerate() {
        assert!(
            m == c,
            "buffer {k}: {} of {} bytes differ",
            m.iter().zip(c).filter(|(a, b)| a != b).count(),
            m.len()
        );
    }
    assert!(
        g.host_fallback_calls().is_empty(),
        "{:?}",
        g.host_fallback_calls()
    );
    assert_eq!(stage2d::run(&mut g, false).unwrap(), cpu);
    let cpu = stage2d::scales(&mut Device::cpu(), ScalesCalls::One).unwrap();
    // Fresh calls (the tables in the parameters), then calls prepared: the first fresh, the
    // second makes its graphs, the third launches them. A round of 143 matrices is two
    // launches either way.
    g.set_cuda_kernel_variant("prepared", 0).unwrap();
    assert!(
        stage2d::scales(&mut g, ScalesCalls::Many(3)).unwrap() == vec![cpu.clone(); 3].concat()
    );
    assert_eq!(g.prepared_calls(), 0);
    g.set_cuda_kernel_variant("prepared", 1).unwrap();
    assert!(stage2d::scales(&mut g, ScalesCalls::Many(1)).unwrap() == cpu);
    assert_eq!(g.prepared_calls(), 0);
    assert!(
        stage2d::scales(&mut g, ScalesCalls::Many(3)).unwrap() == vec![cpu.clone(); 3].concat()
    );
    assert_eq!(g.prepared_calls(), 2);
    assert!(
        g.host_fallback_calls().is_empty(),
        "{:?}",
        g.host_fallback_calls()
    );
}

/// A prepared `mxfp8_scales_2d_many` call (the items of earlier calls, its graphs made) whose
/// buffers are no longer all allocated is a fresh call: it fails as one (the freed view),
/// launching no graph; the same items without the freed one are prepared anew, with the same
/// bytes.
#[test]
fn prepared_scales_2d_refuse_freed_buffers() {
    let mut g = gpu();
    let items: Vec<_> = (0..3)
        .map(|k| {
            let tiles = g.alloc(DType::F32, 4);
            g.upload(tiles, &[1.0, 2.0, 3.0, 4.0 + k as f32]).unwrap();
            let (rs, cs) = (g.alloc(DType::U8, 128), g.alloc(DType::U8, 128));
            (64, 64, Fp8Kind::E4M3, tiles, rs, cs)
        })
        .collect();
    // Fresh, graphs made, graphs launched.
    for _ in 0..3 {
        g.mxfp8_scales_2d_many(&items).unwrap();
    }
    assert_eq!(g.prepared_calls(), 2);
    let first = g.read_bytes(items[0].4).unwrap();
    assert!(first.iter().any(|&b| b != 0));
    g.free(items[1].5).unwrap();
    let err = g.mxfp8_scales_2d_many(&items).unwrap_err();
    assert!(matches!(err, DeviceError::Freed(_)), "{err:?}");
    assert_eq!(g.prepared_calls(), 2);
    let rest = [items[0], items[2]];
    for _ in 0..3 {
        g.zero(items[0].4).unwrap();
        g.mxfp8_scales_2d_many(&rest).unwrap();
        assert_eq!(g.read_bytes(items[0].4).unwrap(), first);
    }
    assert_eq!(g.prepared_calls(), 4);
}

// ---------------------------------------------------------------------------------------------
// Bookkeeping

#[test]
fn fallback_list_names_the_fallback_ops() {
    let list = Device::host_fallback_ops();
    for op in ["quantize_nvfp4 (", "nvfp4_finish_2d"] {
        assert!(list.iter().any(|l| l.starts_with(op)), "{op} not listed");
    }
    for op in [
        "sum_squares",
        "mse_loss",
        "adamw",
        "matmul",
        "cast",
        "fill",
        "gelu",
        "rms_norm",
        "dequantize_mxfp8_rowwise",
        "dequantize_nvfp4_rowwise",
        "mxfp8_fold_tile_amax_2d",
        "nvfp4_fold_tile_amax_2d",
    ] {
        assert!(!list.contains(&op), "{op} has a kernel but is listed");
    }
}

#[test]
fn allocated_bytes_and_synchronize() {
    let mut g = gpu();
    let base = g.allocated_bytes();
    let a = g.alloc(DType::F32, 1000);
    let b = g.alloc(DType::U8, 0);
    assert_eq!(g.allocated_bytes(), base + 4000);
    assert_eq!(g.download::<f32>(a).unwrap(), vec![0.0; 1000]);
    g.free(a).unwrap();
    g.free(b).unwrap();
    assert_eq!(g.allocated_bytes(), base);
    g.synchronize().unwrap();
    Device::cpu().synchronize().unwrap();
}

#[test]
fn devices_move_between_threads_and_run_side_by_side() {
    // A device created on one thread and used on another (the driver context is bound per
    // call), and two devices of the same GPU used concurrently, as rank threads do.
    let mut g = gpu();
    let v = g.alloc(DType::F32, 1 << 16);
    let handle = std::thread::spawn(move || {
        g.fill(v, 2.5).unwrap();
        g.scale(v, 2.0).unwrap();
        let back: Vec<f32> = g.download(v).unwrap();
        assert!(back.iter().all(|&x| x == 5.0));
        g
    });
    let mut g = handle.join().unwrap();
    let workers: Vec<_> = (0..2)
        .map(|k| {
            std::thread::spawn(move || {
                let mut d = gpu();
                let x = d.alloc(DType::F32, 4096);
                d.fill(x, k as f32).unwrap();
                (d.max_abs(x).unwrap(), d.sum_squares(x).unwrap())
            })
        })
        .collect();
    for (k, w) in workers.into_iter().enumerate() {
        let (m, s) = w.join().unwrap();
        assert_eq!(m, k as f32);
        assert_eq!(s, 4096.0 * (k * k) as f64);
    }
    g.free(v).unwrap();
    g.synchronize().unwrap();
}
