//! The GPU part of the integration matrix (built with `--features cuda`, run by the bundle of
//! `cargo xtask gpu-bundle` on a GPU machine; it fails, not skips, without GPUs): the
//! primary-weight ON/OFF parity matrix with one rank per GPU through NCCL, `lowbit train`
//! on CUDA against the same run on the CPU backend, bit for bit, and layer-wise Muon chained with
//! AdamW and SGD on CUDA against the CPU backend, bit for bit (f32 Newton–Schulz); the one-call
//! step (`Iteration::step`) on CUDA against the two-call step on the CPU.
#![cfg(feature = "cuda")]

use lowbit::buffers::layout::GradDType;
use lowbit::device::CountedOp;
use lowbit::train::{DeviceChoice, Precision, TrainConfig, gpu_count, train};
use lowbit_testkit::harness;
use lowbit_testkit::harness::{
    LOW_PRECISIONS, MuonRun, OptimChoice, Phase, Run, TestDevice, assert_ranks_identical,
    assert_same_trajectory, ddp, parity_matrix, variant,
};

/// The data-parallel sizes this machine can run, one GPU per rank.
fn dps() -> Vec<usize> {
    let gpus = gpu_count();
    assert!(gpus >= 1, "the GPU matrix needs at least one GPU");
    [1, 2, 4].into_iter().filter(|&d| d <= gpus).collect()
}

#[test]
fn parity_matrix_on_cuda_is_bitwise() {
    let start = std::time::Instant::now();
    let dps = dps();
    // Every precision and overlap mode; by default one gradient dtype and bucketing (each run
    // opens an NCCL world, which costs about a second). LOWBIT_FULL_MATRIX=1 (the bundle's
    // `test-lowbit-gpu-full-matrix` step) runs every gradient dtype and bucketing, as the CPU
    // matrix of lowbit-train's tests/parity/primary_weights.rs does.
    let full = std::env::var_os("LOWBIT_FULL_MATRIX").is_some();
    let (grads, buckets): (&[GradDType], &[Option<usize>]) = if full {
        (&[GradDType::F32, GradDType::Bf16], &[None, Some(500)])
    } else {
        (&[GradDType::F32], &[Some(500)])
    };
    let cases = parity_matrix(&dps, 4, TestDevice::Cuda, grads, buckets);
    eprintln!(
        "CUDA parity matrix: {cases} ON/OFF pairs over dp {dps:?} in {:.1?}",
        start.elapsed()
    );
}

/// `lowbit train` on CUDA gives the CPU backend's bits: losses, grad norms, eval losses and
/// the final masters.
#[test]
fn train_on_cuda_matches_the_cpu_backend() {
    for ranks in dps().into_iter().filter(|&r| r <= 2) {
        for precision in [Precision::Mxfp8, Precision::Nvfp4, Precision::Bf16] {
            let cfg = TrainConfig {
                ranks,
                precision,
                param_gather: precision != Precision::Bf16,
                batch: 128,
                steps: 6,
                eval_every: 3,
                ..TrainConfig::default()
            };
            let cpu = train(&cfg, &|_| {}).expect("cpu run");
            let gpu = train(
                &TrainConfig {
                    device: DeviceChoice::Cuda,
                    ..cfg.clone()
                },
                &|_| {},
            )
            .expect("cuda run");
            let what = format!("{precision:?} on {ranks} GPU(s)");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&cpu.losses), bits(&gpu.losses), "{what}: losses");
            assert_eq!(
                bits(&cpu.grad_norms),
                bits(&gpu.grad_norms),
                "{what}: norms"
            );
            assert_eq!(cpu.evals, gpu.evals, "{what}: evals");
            assert_eq!(cpu.master_checksum, gpu.master_checksum, "{what}: masters");
            eprintln!(
                "{what}: identical to the CPU backend ({} steps, checksum {:016x}, cuda {:.2} s)",
                cfg.steps,
                gpu.master_checksum,
                gpu.wall.as_secs_f64()
            );
        }
    }
}

/// Layer-wise Muon (f32 Newton–Schulz: every GEMM and sum in the CPU's order) chained with
/// distributed AdamW and SGD, on CUDA with one rank per GPU (NCCL), gives the CPU backend's bits
/// at dp 1 and 2: losses, grad norms, reduced gradients, masters, weights and eval losses, for
/// MXFP8 staged, MXFP8 direct 2D and NVFP4 primary weights, without and with overlap (evals
/// under overlapped gather included). The same quantization calls per step and phase on both
/// backends, and on CUDA the ON run equals its OFF twin.
#[test]
fn muon_on_cuda_matches_the_cpu_backend() {
    let start = std::time::Instant::now();
    let mut cases = 0;
    for dp in dps().into_iter().filter(|&d| d <= 2) {
        for precision in LOW_PRECISIONS {
            for ((og, op), hidden_only) in [((false, false), false), ((true, true), true)] {
                let base = Run {
                    precision,
                    ddp: ddp(true, og, op, Some(256)),
                    steps: 4,
                    eval_after: &[1],
                    probe: true,
                    optimizer: OptimChoice::Muon(MuonRun {
                        hidden_only,
                        ..MuonRun::F32
                    }),
                    ..Run::muon(dp)
                };
                let what = format!("Muon {precision:?} dp={dp} overlap=({og},{op})");
                let on = variant(base, true);
                let cpu = harness::train(on);
                let gpu = harness::train(Run {
                    device: TestDevice::Cuda,
                    ..on
                });
                assert_ranks_identical(&gpu);
                assert_same_trajectory(&gpu, &cpu, &format!("{what}: CUDA vs CPU"));
                for (rank, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
                    for (t, (pg, pc)) in g.probes.iter().zip(&c.probes).enumerate() {
                        assert_eq!(pg.quant, pc.quant, "{what} rank {rank} step {t}");
                        assert!(
                            pg.staging_mismatches.is_empty(),
                            "{what} rank {rank} step {t}"
                        );
                        assert_eq!(pg.staged_pieces_checked, pc.staged_pieces_checked);
                    }
                    let post = match precision {
                        harness::Precision::Mxfp8 => CountedOp::QuantizeMxfp8,
                        harness::Precision::Mxfp8Direct => CountedOp::Mxfp8Scales2d,
                        _ => CountedOp::Nvfp4Finish2d,
                    };
                    // The weights were rebuilt on the GPU too (the counters are not vacuous).
                    let rebuilt: u64 = g
                        .probes
                        .iter()
                        .map(|p| {
                            [Phase::Begin, Phase::Microbatches, Phase::Step, Phase::After]
                                .iter()
                                .map(|&ph| p.calls(ph, post))
                                .sum::<u64>()
                        })
                        .sum();
                    assert!(rebuilt > 0, "{what} rank {rank}");
                }
                let off = harness::train(Run {
                    device: TestDevice::Cuda,
                    ..variant(base, false)
                });
                assert_same_trajectory(&gpu, &off, &format!("{what}: ON vs OFF on CUDA"));
                eprintln!("{what}: CUDA = CPU = OFF");
                cases += 1;
            }
        }
    }
    eprintln!(
        "Muon on CUDA: {cases} cases identical to the CPU backend in {:.1?}",
        start.elapsed()
    );
}

/// `Iteration::step` on CUDA (each group's sum of squares launched on the device stream as soon
/// as its reduction completes, while NCCL runs the later ones) gives the CPU backend's bits of the two-call step:
/// overlapped reductions and gathers, MXFP8 and bf16 weights, one optimizer and a chain.
#[test]
fn the_one_call_step_on_cuda_matches_the_cpu_backend() {
    for dp in dps().into_iter().filter(|&d| d <= 2) {
        for (chained, precision) in [
            (false, harness::Precision::Mxfp8),
            (true, harness::Precision::Bf16),
        ] {
            let base = Run {
                ddp: ddp(true, true, true, Some(300)),
                chained,
                precision,
                param_gather: precision != harness::Precision::Bf16,
                clip: Some(1e-3),
                ..Run::new(dp)
            };
            let cpu = harness::train(base);
            let gpu = harness::train(Run {
                device: TestDevice::Cuda,
                one_call_step: true,
                ..base
            });
            assert_ranks_identical(&gpu);
            let what = format!("one-call step {precision:?} dp={dp} chained={chained}");
            assert_same_trajectory(&cpu, &gpu, &format!("{what}: CUDA vs CPU"));
            eprintln!("{what}: CUDA = CPU");
        }
    }
}

/// The pipelined step on CUDA (each bucket group's gather on NCCL's stream beside the update of
/// the later groups on the device's) gives the CPU backend's bits of the plain step (update
/// everything, then stage): reductions overlapped, gathers after the step or left in flight for
/// the forward, f32 gradients (the
/// MXFP8 staging view aliases them) and bf16, MXFP8, 2D MXFP8 and NVFP4 weights (their tile
/// amaxes MAX-reduced group by group), one optimizer and a chain.
#[test]
fn the_pipelined_step_on_cuda_matches_the_cpu_backend() {
    use harness::Precision::{Bf16, Mxfp8, Mxfp8Direct, Nvfp4};
    for dp in dps().into_iter().filter(|&d| d <= 2) {
        for (grad, chained, precision, op) in [
            (GradDType::F32, false, Mxfp8, false),
            (GradDType::Bf16, false, Mxfp8, false),
            (GradDType::F32, true, Mxfp8, false),
            (GradDType::Bf16, true, Bf16, false),
            (GradDType::F32, false, Mxfp8Direct, false),
            (GradDType::F32, false, Nvfp4, false),
            (GradDType::F32, true, Mxfp8, true),
            (GradDType::F32, false, Nvfp4, true),
        ] {
            let base = variant(
                Run {
                    ddp: ddp(true, true, op, Some(300)),
                    grad,
                    chained,
                    precision,
                    clip: Some(1e-3),
                    ..Run::new(dp)
                },
                true,
            );
            let cpu = harness::train(Run {
                pipelined_step: false,
                ..base
            });
            let gpu = harness::train(Run {
                device: TestDevice::Cuda,
                one_call_step: true,
                ..base
            });
            assert_ranks_identical(&gpu);
            let what = format!(
                "pipelined step {precision:?} {grad:?} dp={dp} chained={chained} overlapped gathers={op}"
            );
            assert_same_trajectory(&cpu, &gpu, &format!("{what}: CUDA vs CPU"));
            eprintln!("{what}: CUDA = CPU");
        }
    }
}
