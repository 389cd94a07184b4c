//! MXFP8 and NVFP4 primary weights sharded by rows under `optim_grads_params`: each rank
//! quantizes its own chunk of whole 32-row (16-row) blocks, and the gathered unit holds the
//! bytes of the whole matrix quantized at once (both copies, data and scales; NVFP4's global
//! amax per expert), at every rank count, for matrices whose rows do not fill the chunks.
//! Fine-grained gathers bring only the copy a use reads.

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    DataParallelBuffers, ProtocolError, Usage, mxfp8_weight_config, nvfp4_weight_config,
};
use lowbit_comm::Communicator;
use lowbit_device::{DType, Device, Mxfp8Views, Nvfp4Views, View};
use lowbit_testkit::{run, seed, upload_f32, values};
use lowbit_train::fsdp::{FineGrainedGather, FsdpConfig, Sharding};

const MXFP8: ParamStorage = ParamStorage::Quantized(QuantKind::Mxfp8);

fn specs() -> Vec<ParamSpec> {
    let shapes: [&[usize]; 5] = [&[80, 64], &[200, 96], &[32, 32], &[16, 64], &[2, 64, 32]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            ParamSpec::new(
                format!("w{i}"),
                s.to_vec(),
                BufferKey::new(MXFP8, GradDType::F32, OptimizerId(0)),
            )
        })
        .collect()
}

fn bytes(dev: &mut Device, v: View) -> Vec<u8> {
    dev.read_bytes(v).unwrap().to_vec()
}

/// The four parts (rowwise data and scales, columnwise data and scales) of `values` (rows x
/// cols) quantized whole, as the storage's recipe does.
fn whole(dev: &mut Device, vals: &[f32], rows: usize, cols: usize) -> [Vec<u8>; 4] {
    let x = upload_f32(dev, vals);
    let xb = dev.alloc(DType::Bf16, vals.len());
    dev.cast(x, xb).unwrap();
    let n = rows * cols;
    let parts = [
        dev.alloc(DType::U8, n),
        dev.alloc(DType::U8, rows * cols.div_ceil(32)),
        dev.alloc(DType::U8, n),
        dev.alloc(DType::U8, rows.div_ceil(32) * cols),
    ];
    let views = Mxfp8Views {
        rowwise: Some((parts[0], parts[1])),
        columnwise: Some((parts[2], parts[3])),
    };
    dev.quantize_mxfp8(xb, rows, cols, &mxfp8_weight_config(), &views)
        .unwrap();
    parts.map(|v| bytes(dev, v))
}

/// This rank's buffers of `specs` under `cfg`, initialized with values from `salt`.
fn initialized(
    dev: &mut Device,
    comm: &impl Communicator,
    dp: usize,
    specs: &[ParamSpec],
    cfg: &FsdpConfig,
    salt: u64,
) -> (DataParallelBuffers, Vec<Vec<f32>>) {
    let mut bufs =
        DataParallelBuffers::new(dev, dp, comm.rank(), specs.to_vec(), cfg.ddp_config()).unwrap();
    let init: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, salt]), s.numel, 3.0))
        .collect();
    bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
    (bufs, init)
}

#[test]
fn gathered_mxfp8_units_are_the_whole_matrix_quantized() {
    for dp in 1..=4 {
        let specs = specs();
        let cfg = FsdpConfig::new(Sharding::OptimGradsParams);
        cfg.validate(&specs, dp).unwrap();
        run(dp, |mut comm, mut dev| {
            let dev: &mut Device = &mut dev;
            let (mut bufs, init) = initialized(dev, &comm, dp, &specs, &cfg, 5);
            for p in 0..specs.len() {
                let g = bufs.group_of(p);
                bufs.prepare_params(dev, &mut comm, g, Usage::Forward)
                    .unwrap();
                let w = bufs
                    .unit_mxfp8_weights(p, Usage::Forward)
                    .unwrap()
                    .expect("an MXFP8 unit");
                let want = whole(dev, &init[p], w.rows, w.cols);
                let got = [w.rowwise.0, w.rowwise.1, w.columnwise.0, w.columnwise.1]
                    .map(|v| bytes(dev, v));
                for k in 0..4 {
                    assert!(
                        got[k] == want[k],
                        "dp {dp}, rank {}, `{}`, part {k}",
                        comm.rank(),
                        specs[p].name
                    );
                }
            }
        });
    }
}

#[test]
fn fine_grained_gathers_bring_only_the_copy_a_use_reads() {
    let specs = specs();
    let cfg = FsdpConfig::new(Sharding::OptimGradsParams).with_fine_grained(FineGrainedGather::On);
    cfg.validate(&specs, 2).unwrap();
    run(2, |mut comm, mut dev| {
        let dev: &mut Device = &mut dev;
        let mut bufs =
            DataParallelBuffers::new(dev, 2, comm.rank(), specs.clone(), cfg.ddp_config()).unwrap();
        let (g0, g1) = (bufs.group_of(0), bufs.group_of(1));
        assert_ne!(g0, g1);
        bufs.prepare_params(dev, &mut comm, g0, Usage::Forward)
            .unwrap();
        assert_eq!(bufs.unit_copies(g0), (true, false));
        let e = bufs.unit_mxfp8_weights(0, Usage::Backward).unwrap_err();
        assert!(matches!(
            e.protocol(),
            Some(ProtocolError::NotGathered { .. })
        ));
        // The backward of the same unit adds its columnwise copy; another unit's backward
        // releases it and gathers only its own columnwise copy.
        bufs.prepare_params(dev, &mut comm, g0, Usage::Backward)
            .unwrap();
        assert_eq!(bufs.unit_copies(g0), (true, true));
        bufs.prepare_params(dev, &mut comm, g1, Usage::Backward)
            .unwrap();
        assert_eq!(
            (bufs.unit_copies(g0), bufs.unit_copies(g1)),
            ((false, false), (false, true))
        );
        bufs.release_units(dev).unwrap();
        assert!(bufs.gathered_units().is_empty());
    });
}

/// The four parts and the global amax of `values` (rows x cols, one expert) quantized whole with
/// the NVFP4 weight recipe.
fn whole_nvfp4(dev: &mut Device, vals: &[f32], rows: usize, cols: usize) -> ([Vec<u8>; 4], f32) {
    let x = upload_f32(dev, vals);
    let xb = dev.alloc(DType::Bf16, vals.len());
    dev.cast(x, xb).unwrap();
    let n = rows * cols;
    let parts = [
        dev.alloc(DType::U8, n / 2),
        dev.alloc(DType::U8, n / 16),
        dev.alloc(DType::U8, n / 2),
        dev.alloc(DType::U8, n / 16),
    ];
    let views = Nvfp4Views {
        rowwise: Some((parts[0], parts[1])),
        columnwise: Some((parts[2], parts[3])),
    };
    let amax = dev
        .quantize_nvfp4(xb, rows, cols, &nvfp4_weight_config(), &views)
        .unwrap();
    (parts.map(|v| bytes(dev, v)), amax.rowwise)
}

#[test]
fn gathered_nvfp4_units_are_the_whole_matrix_quantized() {
    let shapes: [&[usize]; 5] = [&[80, 64], &[208, 96], &[32, 32], &[16, 64], &[2, 64, 32]];
    let key = BufferKey::new(
        ParamStorage::Quantized(QuantKind::Nvfp4),
        GradDType::F32,
        OptimizerId(0),
    );
    let specs: Vec<ParamSpec> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| ParamSpec::new(format!("w{i}"), s.to_vec(), key))
        .collect();
    for dp in 1..=4 {
        let cfg = FsdpConfig::new(Sharding::OptimGradsParams);
        cfg.validate(&specs, dp).unwrap();
        run(dp, |mut comm, mut dev| {
            let dev: &mut Device = &mut dev;
            let (mut bufs, init) = initialized(dev, &comm, dp, &specs, &cfg, 9);
            for p in 0..specs.len() {
                let g = bufs.group_of(p);
                for usage in [Usage::Forward, Usage::Backward] {
                    bufs.prepare_params(dev, &mut comm, g, usage).unwrap();
                    let w = bufs.unit_nvfp4_weights(p).unwrap().expect("an NVFP4 unit");
                    for (e, x) in w.per_expert().unwrap().into_iter().enumerate() {
                        let n = x.rows * x.cols;
                        let vals = &init[p][e * n..(e + 1) * n];
                        let (want, amax) = whole_nvfp4(dev, vals, x.rows, x.cols);
                        let got = [x.rowwise.0, x.rowwise.1, x.columnwise.0, x.columnwise.1]
                            .map(|v| bytes(dev, v));
                        for k in 0..4 {
                            assert!(
                                got[k] == want[k],
                                "dp {dp}, rank {}, `{}` expert {e}, part {k}",
                                comm.rank(),
                                specs[p].name
                            );
                        }
                        assert_eq!(x.amax().to_bits(), amax.to_bits(), "`{}`", specs[p].name);
                    }
                }
            }
        });
    }
}
