//! The GPU part of the integration matrix (built with `--features cuda`, run by the bundle of
//! `cargo xtask gpu-bundle` on a GPU machine; it fails, not skips, without GPUs): the
//! primary-weight ON/OFF parity matrix with one rank per GPU through NCCL, and `lowbit train`
//! on CUDA against the same run on the CPU backend, bit for bit.
#![cfg(feature = "cuda")]

mod common;

use common::{TestDevice, parity_matrix};
use lowbit::buffers::layout::GradDType;
use lowbit::train::{DeviceChoice, Precision, TrainConfig, gpu_count, train};

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
    // matrix of tests/primary_weights.rs does.
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
