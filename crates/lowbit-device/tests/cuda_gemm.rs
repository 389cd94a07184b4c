//! `Device::matmul_tc` on CUDA (cuBLASLt) against the CPU reference on a GPU: every transpose,
//! no / separate / in-place C, f32 and bf16 outputs, symmetric products by blocks (bf16:
//! exactly symmetric; both mirrors) and as one GEMM. Needs a GPU and cuBLASLt on the
//! library path (`gpu/with_cublas.sh`); fails, never skips, without them.
#![cfg(feature = "cuda")]

use lowbit_device::{DType, Device, MatmulTcSpec};

mod common;
use common::{download as get, upload_as as put};

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

/// Runs `spec` with C mode `c_mode` (0 none, 1 separate, 2 in place) and returns D.
fn run(dev: &mut Device, spec: &MatmulTcSpec, out: DType, c_mode: u8, seed: u64) -> Vec<f32> {
    let a = put(dev, DType::Bf16, &values(seed, spec.m * spec.k));
    let b = if spec.symmetric {
        a
    } else {
        put(dev, DType::Bf16, &values(seed + 1, spec.k * spec.n))
    };
    let mut cv = values(seed + 2, spec.m * spec.n);
    if spec.symmetric {
        let n = spec.n;
        for i in 0..n {
            for j in 0..i {
                cv[i * n + j] = cv[j * n + i];
            }
        }
    }
    let c = put(dev, out, &cv);
    let d = if c_mode == 2 {
        c
    } else {
        put(dev, out, &vec![f32::NAN; spec.m * spec.n])
    };
    dev.matmul_tc(a, b, (c_mode > 0).then_some(c), d, spec)
        .unwrap();
    get(dev, d)
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let (mut n, mut d) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        n += (f64::from(*x) - f64::from(*y)).powi(2);
        d += f64::from(*y).powi(2);
    }
    (n / d).sqrt()
}

#[test]
fn matmul_tc_matches_the_cpu() {
    let mut gpu = Device::cuda(0).unwrap();
    let mut cpu = Device::cpu();
    let mut seed = 11;
    for (m, n, k) in [(1, 1, 1), (33, 65, 17), (128, 96, 300), (7, 300, 64)] {
        for ta in [false, true] {
            for tb in [false, true] {
                for c_mode in 0..3u8 {
                    for out in [DType::F32, DType::Bf16] {
                        seed += 3;
                        let spec = MatmulTcSpec {
                            trans_a: ta,
                            trans_b: tb,
                            alpha: 0.75,
                            beta: if c_mode == 0 { 0.0 } else { -1.5 },
                            ..MatmulTcSpec::new(m, n, k)
                        };
                        let g = run(&mut gpu, &spec, out, c_mode, seed);
                        let c = run(&mut cpu, &spec, out, c_mode, seed);
                        let tol = if out == DType::F32 { 1e-5 } else { 4e-3 };
                        let r = rel(&g, &c);
                        assert!(
                            g.iter().all(|v| v.is_finite()) && r <= tol,
                            "{m}x{n}x{k} ta {ta} tb {tb} c {c_mode} {out:?}: rel {r:e}"
                        );
                    }
                }
            }
        }
    }
    assert!(gpu.host_fallback_calls().is_empty());
}

#[test]
fn symmetric_blocks_are_exactly_symmetric_and_match_the_cpu() {
    let mut gpu = Device::cuda(0).unwrap();
    let mut cpu = Device::cpu();
    for (i, (trans, c_mode, out)) in [
        (false, 0u8, DType::Bf16),
        (true, 1, DType::Bf16),
        (false, 2, DType::Bf16),
        (true, 1, DType::F32),
    ]
    .into_iter()
    .enumerate()
    {
        let spec = MatmulTcSpec {
            trans_a: trans,
            trans_b: !trans,
            alpha: 1.25,
            beta: if c_mode == 0 { 0.0 } else { 0.5 },
            symmetric: true,
            ..MatmulTcSpec::new(2048, 2048, 64)
        };
        let seed = 100 + i as u64;
        let want = run(&mut cpu, &spec, out, c_mode, seed);
        let tol = if out == DType::F32 { 1e-5 } else { 4e-3 };
        // 1: blocks, mirrored by the transform or the identity GEMM; 2: the identity GEMM;
        // 0: one full GEMM.
        for variant in [1, 2, 0] {
            gpu.set_cuda_kernel_variant("matmul_tc_symmetric", variant)
                .unwrap();
            let got = run(&mut gpu, &spec, out, c_mode, seed);
            let r = rel(&got, &want);
            assert!(
                got.iter().all(|v| v.is_finite()) && r <= tol,
                "case {i} variant {variant}: rel {r:e}"
            );
            if out == DType::Bf16 && variant > 0 {
                let n = 2048;
                for r in 0..n {
                    for c in 0..r {
                        assert_eq!(
                            got[r * n + c].to_bits(),
                            got[c * n + r].to_bits(),
                            "case {i} variant {variant}: ({r}, {c})"
                        );
                    }
                }
            }
        }
        gpu.set_cuda_kernel_variant("matmul_tc_symmetric", 1)
            .unwrap();
    }
    assert!(gpu.host_fallback_calls().is_empty());
}
