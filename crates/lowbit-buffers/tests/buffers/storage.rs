//! Every storage kind holds exactly `Q(bf16(master))` on every rank: after `initialize` (no
//! gather) and after `stage` from this rank's owned master pieces plus the gather, the weights
//! are byte-identical across ranks and equal to quantizing `bf16(values)` of the whole tensor
//! directly with the device's quantizers (1x32 MXFP8 for staged weights, 32x32 MXFP8 for the
//! direct path, 16x16 NVFP4 for packed weights), or to `bf16(values)` for persistent storage.
//! The staging view aliases the gradient buffer, holds `bf16(master)` of the owned pieces
//! between staging and gather, and is zero after the gather.

use crate::common;

use common::{
    MXFP8, NVFP4, bf16_round, bits, download_f32, free_pieces, run, seed, spec, stage_pieces,
    upload_f32, values, weight_parts, write_fused_outputs,
};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    DataParallelBuffers, DdpConfig, Mxfp8Gather, Overlap, StorageKind, Verify, WeightState,
    mxfp8_weight_config, nvfp4_weight_config,
};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, Mxfp8Config, Mxfp8Views, Nvfp4Views, View};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Bf16,
    Mxfp8Staged,
    Mxfp8Direct,
    Nvfp4,
}

impl Kind {
    fn storage(self) -> ParamStorage {
        match self {
            Kind::Bf16 => ParamStorage::Bf16,
            Kind::Mxfp8Staged | Kind::Mxfp8Direct => MXFP8,
            Kind::Nvfp4 => NVFP4,
        }
    }

    fn storage_kind(self) -> StorageKind {
        match self {
            Kind::Bf16 => StorageKind::Persistent,
            Kind::Mxfp8Staged => StorageKind::Mxfp8Staged,
            Kind::Mxfp8Direct => StorageKind::Mxfp8Direct,
            Kind::Nvfp4 => StorageKind::Nvfp4Packed,
        }
    }

    fn cfg(self, grad_overlap: bool) -> DdpConfig {
        DdpConfig::default()
            .with_sharding(ShardingStrategy::Distributed)
            .with_overlap(if grad_overlap {
                Overlap::GradReduce
            } else {
                Overlap::None
            })
            .with_bucket_size(Some(3000))
            .with_mxfp8_gather(if self == Kind::Mxfp8Direct {
                Mxfp8Gather::Direct2d
            } else {
                Mxfp8Gather::Bf16Staging
            })
            .with_verify(Verify::Full)
    }
}

/// Matrices tiled by 16x16 (NVFP4) with some partial 32-blocks and 32x32 tiles (48 and 80).
fn specs(kind: Kind) -> Vec<ParamSpec> {
    let shapes: [&[usize]; 4] = [&[64, 96], &[48, 32], &[32, 80], &[96, 64]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| spec(&format!("w{i}"), s, kind.storage(), GradDType::F32))
        .collect()
}

/// Values whose magnitude changes from row to row (so block and tile scales differ) with a few
/// large outliers (so some blocks saturate others).
fn weights(specs: &[ParamSpec], version: u64) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| {
            let cols = s.shape[1];
            values(seed(&[version, p as u64, 3]), s.numel, 1.0)
                .into_iter()
                .enumerate()
                .map(|(i, v)| {
                    let row = i / cols;
                    let outlier = if i % 397 == 5 { 40.0 } else { 1.0 };
                    v * (1u32 << (row % 9)) as f32 / 16.0 * outlier
                })
                .collect()
        })
        .collect()
}

/// The same bytes computed directly from `bf16(values)` of the whole tensor.
fn reference_bytes(dev: &mut Device, kind: Kind, s: &ParamSpec, vals: &[f32]) -> Vec<Vec<u8>> {
    let (rows, cols) = (s.shape[0], s.shape[1]);
    let f32v = upload_f32(dev, vals);
    let src = dev.alloc(DType::Bf16, vals.len());
    dev.cast(f32v, src).unwrap();
    let alloc = |dev: &mut Device, sizes: [usize; 4]| -> [View; 4] {
        sizes.map(|n| dev.alloc(DType::U8, n))
    };
    let out = match kind {
        Kind::Bf16 => vec![dev.read_bytes(src).unwrap()],
        Kind::Mxfp8Staged | Kind::Mxfp8Direct => {
            let v = alloc(
                dev,
                [
                    rows * cols,
                    rows * cols.div_ceil(32),
                    rows * cols,
                    rows.div_ceil(32) * cols,
                ],
            );
            let cfg = Mxfp8Config {
                two_d: kind == Kind::Mxfp8Direct,
                ..mxfp8_weight_config()
            };
            let views = Mxfp8Views {
                rowwise: Some((v[0], v[1])),
                columnwise: Some((v[2], v[3])),
            };
            dev.quantize_mxfp8(src, rows, cols, &cfg, &views).unwrap();
            v.iter().map(|&x| dev.read_bytes(x).unwrap()).collect()
        }
        Kind::Nvfp4 => {
            let n = rows * cols;
            let v = alloc(dev, [n / 2, n / 16, n / 2, n / 16]);
            let views = Nvfp4Views {
                rowwise: Some((v[0], v[1])),
                columnwise: Some((v[2], v[3])),
            };
            let amax = dev
                .quantize_nvfp4(src, rows, cols, &nvfp4_weight_config(), &views)
                .unwrap();
            assert_eq!(amax.rowwise.to_bits(), amax.columnwise.to_bits());
            let mut out: Vec<Vec<u8>> = v.iter().map(|&x| dev.read_bytes(x).unwrap()).collect();
            out.push(amax.rowwise.to_le_bytes().to_vec());
            out
        }
    };
    dev.free(f32v).unwrap();
    dev.free(src).unwrap();
    out
}

/// What one rank saw: per parameter, the weight bytes after `initialize` and after the gather.
type Seen = (Vec<Vec<Vec<u8>>>, Vec<Vec<Vec<u8>>>);

fn check(kind: Kind, dp: usize, grad_overlap: bool) {
    let what = format!("{kind:?}, dp {dp}, grad overlap {grad_overlap}");
    let specs = specs(kind);
    let (v0, v1) = (weights(&specs, 0), weights(&specs, 1));
    let seen: Vec<Seen> = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mut bufs =
            DataParallelBuffers::new(dev, dp, rank, specs.clone(), kind.cfg(grad_overlap)).unwrap();
        for p in 0..specs.len() {
            assert_eq!(bufs.storage_kind(p), kind.storage_kind(), "{what}");
            assert_eq!(bufs.is_low_precision(p), kind != Kind::Bf16, "{what}");
        }
        bufs.initialize_all(dev, |p| v0[p].clone()).unwrap();
        let after_init: Vec<_> = (0..specs.len())
            .map(|p| weight_parts(dev, &bufs, p))
            .collect();
        // The optimizer's side: zero the gradients (the staging view with them), then stage the
        // owned pieces' new masters, then gather.
        bufs.zero_grad_buffer(dev).unwrap();
        if kind == Kind::Bf16 {
            write_fused_outputs(dev, &bufs, &v1);
        } else {
            bufs.mark_stale(OptimizerId(0));
            let pieces = stage_pieces(dev, &bufs, &v1);
            assert!(!pieces.is_empty(), "{what}: rank {rank} owns nothing");
            bufs.stage(dev, &mut comm, OptimizerId(0), &pieces).unwrap();
            for g in 0..bufs.num_groups() {
                assert_eq!(bufs.weight_state(g), WeightState::Staged, "{what}");
            }
            if kind == Kind::Mxfp8Staged {
                for piece in &pieces {
                    // The staging view aliases the gradients and holds bf16(master) of the piece.
                    let staging = bufs.param_view(piece.param).unwrap();
                    let grads = bufs.grad_view(piece.param).unwrap();
                    assert_eq!(staging.buffer(), grads.buffer(), "{what}");
                    assert_eq!(staging.dtype(), DType::Bf16);
                    let got = download_f32(dev, staging.slice(piece.param_range.clone()).unwrap());
                    let want: Vec<f32> = v1[piece.param][piece.param_range.clone()]
                        .iter()
                        .map(|&x| bf16_round(x))
                        .collect();
                    assert_eq!(bits(&got), bits(&want), "{what}: staged piece");
                }
            }
            free_pieces(dev, pieces);
        }
        bufs.sync_params(dev, &mut comm).unwrap();
        for g in 0..bufs.num_groups() {
            assert_eq!(bufs.weight_state(g), WeightState::Current, "{what}");
        }
        if kind == Kind::Mxfp8Staged {
            for p in 0..specs.len() {
                let staging = bufs.param_view(p).unwrap();
                assert!(
                    dev.read_bytes(staging).unwrap().iter().all(|&b| b == 0),
                    "{what}: staging view of {p} not zero after the gather"
                );
            }
        }
        let after_gather: Vec<_> = (0..specs.len())
            .map(|p| weight_parts(dev, &bufs, p))
            .collect();
        (after_init, after_gather)
    });
    let mut dev = Device::cpu();
    for (p, s) in specs.iter().enumerate() {
        let want0 = reference_bytes(&mut dev, kind, s, &v0[p]);
        let want1 = reference_bytes(&mut dev, kind, s, &v1[p]);
        assert_ne!(want0, want1, "{what}: the two versions must differ");
        for (rank, (init, gathered)) in seen.iter().enumerate() {
            assert!(
                init[p] == want0,
                "{what}: rank {rank}, param {p}: initial weights differ from Q(bf16(values))"
            );
            assert!(
                gathered[p] == want1,
                "{what}: rank {rank}, param {p}: gathered weights differ from Q(bf16(master))"
            );
        }
    }
}

/// Every kind at dp 1 to 3 (with overlapped gradient reduction at dp 2): bf16 persistent
/// weights are `bf16(values)`, MXFP8 staged weights `Q(bf16(master))` in 1x32 blocks, MXFP8
/// direct and NVFP4 packed weights the 2D-quantized `bf16(master)`.
#[test]
fn every_storage_kind_holds_quantized_bf16_masters() {
    for kind in [
        Kind::Bf16,
        Kind::Mxfp8Staged,
        Kind::Mxfp8Direct,
        Kind::Nvfp4,
    ] {
        for dp in 1..=3 {
            check(kind, dp, dp == 2);
        }
    }
}

/// In 2D MXFP8 a 32x32 tile has one scale, so the rowwise and columnwise copies share their
/// codes: the direct path keeps one byte per element and points both copies at it.
#[test]
fn direct_mxfp8_copies_share_their_codes() {
    let kind = Kind::Mxfp8Direct;
    let specs = specs(kind);
    let mut dev = Device::cpu();
    let mut bufs =
        DataParallelBuffers::new(&mut dev, 1, 0, specs.clone(), kind.cfg(false)).unwrap();
    let v0 = weights(&specs, 0);
    bufs.initialize_all(&mut dev, |p| v0[p].clone()).unwrap();
    for p in 0..specs.len() {
        let w = bufs.mxfp8_weights(p).unwrap();
        assert_eq!(w.rowwise.0, w.columnwise.0);
        assert_eq!(w.rowwise.0, bufs.param_view(p).unwrap());
        let reference = reference_bytes(&mut dev, kind, &specs[p], &v0[p]);
        assert_eq!(reference[0], reference[2], "param {p}: 2D copies differ");
    }
}
