//! Memory accounting: `memory()` (measured from the live allocations) equals the closed forms
//! `plan_buffer_memory` and `estimate_buffer_memory`, and the device's `allocated_bytes()` grows
//! by exactly the weights plus gradients it reports (a staging view costs nothing: it is the
//! gradient memory), for every storage kind, gradient dtype and group size.

use crate::common;

use common::{MXFP8, NVFP4, spec};
use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::{
    DataParallelBuffers, DdpConfig, Mxfp8Gather, Overlap, StorageKind, estimate_buffer_memory,
    plan_buffer_memory,
};
use lowbit_device::Device;

/// A bf16 embedding-like vector and biases next to matrices of `storage` (NVFP4 needs 16x16
/// tiles; the 48 and 80 leave partial MXFP8 blocks).
fn specs(storage: ParamStorage, grad: GradDType) -> Vec<ParamSpec> {
    let mut out = vec![spec("bias0", &[96], ParamStorage::Bf16, grad)];
    let shapes: [&[usize]; 4] = [&[64, 96], &[48, 32], &[32, 80], &[96, 64]];
    for (i, s) in shapes.iter().enumerate() {
        out.push(spec(&format!("w{i}"), s, storage, grad));
    }
    out.push(spec("bias1", &[40], ParamStorage::Bf16, grad));
    out
}

#[test]
fn measured_memory_equals_the_closed_forms_and_the_allocations() {
    let kinds = [
        (
            ParamStorage::Bf16,
            Mxfp8Gather::Bf16Staging,
            StorageKind::Persistent,
        ),
        (
            ParamStorage::F32,
            Mxfp8Gather::Bf16Staging,
            StorageKind::Persistent,
        ),
        (MXFP8, Mxfp8Gather::Bf16Staging, StorageKind::Mxfp8Staged),
        (MXFP8, Mxfp8Gather::Direct2d, StorageKind::Mxfp8Direct),
        (NVFP4, Mxfp8Gather::Bf16Staging, StorageKind::Nvfp4Packed),
    ];
    for (storage, gather, kind) in kinds {
        for grad in [GradDType::F32, GradDType::Bf16] {
            for dp in 1..=3 {
                for overlap in [Overlap::None, Overlap::GradReduceAndParamGather] {
                    let what = format!("{kind:?}, {grad:?}, dp {dp}, {overlap:?}");
                    let specs = specs(storage, grad);
                    let cfg = DdpConfig::default()
                        .with_sharding(ShardingStrategy::Distributed)
                        .with_overlap(overlap)
                        .with_bucket_size(Some(4000))
                        .with_mxfp8_gather(gather);
                    let mut dev = Device::cpu();
                    let before = dev.allocated_bytes();
                    let bufs =
                        DataParallelBuffers::new(&mut dev, dp, dp - 1, specs.clone(), cfg).unwrap();
                    let allocated = dev.allocated_bytes() - before;
                    assert_eq!(bufs.storage_kind(1), kind, "{what}");
                    let measured = bufs.memory();
                    assert_eq!(
                        measured,
                        plan_buffer_memory(bufs.plan(), &specs, &cfg),
                        "{what}: plan_buffer_memory"
                    );
                    assert_eq!(
                        measured,
                        estimate_buffer_memory(&specs, dp, &cfg).unwrap(),
                        "{what}: estimate_buffer_memory"
                    );
                    let weights: usize = measured.iter().map(|b| b.weights).sum();
                    let grads: usize = measured.iter().map(|b| b.grads).sum();
                    assert_eq!(allocated, weights + grads, "{what}: allocated bytes");
                    for b in &measured {
                        let staged =
                            b.key.param_storage == MXFP8 && kind == StorageKind::Mxfp8Staged;
                        assert_eq!(b.staging, if staged { 2 * b.numel } else { 0 }, "{what}");
                        let gsize = if grad == GradDType::F32 { 4 } else { 2 };
                        assert_eq!(b.grads, gsize * b.numel, "{what}");
                    }
                    // `memory_bytes`: parameter regions that are not the gradients, and gradients.
                    let (params, g) = bufs.memory_bytes();
                    assert_eq!(g, grads, "{what}");
                    let outside_staged: usize = measured
                        .iter()
                        .filter(|b| b.staging > 0)
                        .map(|b| b.weights)
                        .sum();
                    assert_eq!(params, weights - outside_staged, "{what}");
                }
            }
        }
    }
}

/// The weight bytes of each kind, derived by hand from what the kind stores (the storage table
/// in the crate's `storage` module): bf16 values; MXFP8 staged: both fp8 copies and both E8M0
/// scale tensors; MXFP8 direct: one fp8 byte per (padded) element, both scale tensors and f32
/// 32x32 tile amaxes; NVFP4: packed rowwise bytes of the (padded) buffer, rowwise E4M3 scales,
/// the packed columnwise copy with its scales, and f32 16x16 tile amaxes.
#[test]
fn weight_bytes_match_a_hand_derivation() {
    let dims: Vec<(usize, usize)> = vec![(64, 96), (48, 32), (32, 80), (96, 64)];
    let per_param = |storage, gather| -> usize {
        dims.iter()
            .map(|&(r, c)| match (storage, gather) {
                (s, Mxfp8Gather::Bf16Staging) if s == MXFP8 => {
                    2 * r * c + r * c.div_ceil(32) + r.div_ceil(32) * c
                }
                (s, Mxfp8Gather::Direct2d) if s == MXFP8 => {
                    r * c.div_ceil(32) + r.div_ceil(32) * c + 4 * r.div_ceil(32) * c.div_ceil(32)
                }
                (s, _) if s == NVFP4 => {
                    r * c / 16 + r * c / 2 + c * r / 16 + 4 * (r / 16) * (c / 16)
                }
                _ => 0,
            })
            .sum()
    };
    for (storage, gather) in [
        (ParamStorage::Bf16, Mxfp8Gather::Bf16Staging),
        (MXFP8, Mxfp8Gather::Bf16Staging),
        (MXFP8, Mxfp8Gather::Direct2d),
        (NVFP4, Mxfp8Gather::Bf16Staging),
    ] {
        for dp in 1..=3 {
            let cfg = DdpConfig::default().with_mxfp8_gather(gather);
            let mem = estimate_buffer_memory(&specs(storage, GradDType::F32), dp, &cfg).unwrap();
            let b = mem
                .iter()
                .find(|b| b.key.param_storage == storage && b.numel > 96)
                .unwrap();
            let region = match (storage, gather) {
                (s, Mxfp8Gather::Bf16Staging) if s == MXFP8 => 0,
                (s, Mxfp8Gather::Direct2d) if s == MXFP8 => b.numel,
                (s, _) if s == NVFP4 => b.numel / 2,
                _ => 2 * b.numel,
            };
            assert_eq!(
                b.weights,
                region + per_param(storage, gather),
                "{storage:?} {gather:?} dp {dp}"
            );
        }
    }
}

/// Parameter sets whose buffers no machine could hold are errors from the estimate and from
/// the allocation alike, under every strategy and storage, never an overflowed byte count (the
/// closed forms multiplied element counts by byte sizes unchecked).
#[test]
fn absurd_sizes_are_errors_not_panics() {
    let h = usize::MAX;
    for shape in [vec![h / 2], vec![1usize << 40, 1 << 20], vec![h / 64, 64]] {
        for storage in [ParamStorage::Bf16, ParamStorage::F32, MXFP8, NVFP4] {
            for sharding in [
                ShardingStrategy::Distributed,
                ShardingStrategy::OptimGradsParams,
                ShardingStrategy::Replicated,
            ] {
                let cfg = DdpConfig::default().with_sharding(sharding);
                let specs = vec![spec("w", &shape, storage, GradDType::F32)];
                let what = format!("{shape:?} {storage:?} {sharding:?}");
                assert!(estimate_buffer_memory(&specs, 2, &cfg).is_err(), "{what}");
                let mut dev = Device::cpu();
                assert!(
                    DataParallelBuffers::new(&mut dev, 2, 0, specs, cfg).is_err(),
                    "{what}"
                );
            }
        }
    }
}
