//! What FSDP refuses before anything runs, and the errors of a step: the NaN check names the
//! parameter and rank on every rank at the same step (no rank left waiting in a collective);
//! parameters of a sharded unit are not readable outside the hooks; whole main gradients do not
//! exist where they are sharded.

use crate::common;

use common::{Setup, run, specs};
use lowbit_buffers::layout::{ParamStorage, QuantKind};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, NanCheck, Overlap, ProtocolError};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_train::fsdp::{
    FineGrainedGather, FsdpConfig, FsdpError, MainParamsDtype, MixedPrecisionPolicy, OuterSharding,
    Sharding,
};

fn unsupported(r: Result<(), FsdpError>) -> String {
    match r {
        Err(FsdpError::Unsupported(m)) => m,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn unsupported_configurations_are_refused_with_the_reason() {
    let s = Setup::new(4, Sharding::OptimGradsParams);
    let bf16 = specs(&s);
    let mut mxfp8 = bf16.clone();
    mxfp8[0].key.param_storage = ParamStorage::Quantized(QuantKind::Mxfp8);
    let mut nvfp4 = bf16.clone();
    nvfp4[0].key.param_storage = ParamStorage::Quantized(QuantKind::Nvfp4);
    let cfg = FsdpConfig::new(Sharding::OptimGradsParams);
    assert!(cfg.validate(&nvfp4, 4).is_ok());
    assert!(cfg.validate(&mxfp8, 4).is_ok());
    assert!(cfg.validate(&bf16, 4).is_ok());
    let m = unsupported(cfg.with_outer_dp(3).validate(&bf16, 4));
    assert!(m.contains("does not divide"), "{m}");
    assert!(cfg.with_outer_dp(2).validate(&bf16, 4).is_ok());
    // HFSDP: optim_grads_params inside, bf16/f32 weights.
    let hfsdp = cfg
        .with_outer_dp(2)
        .with_outer_sharding(OuterSharding::Optim);
    assert!(hfsdp.validate(&bf16, 4).is_ok());
    let m = unsupported(hfsdp.validate(&mxfp8, 4));
    assert!(m.contains("low-precision weights (`l0.weight`)"), "{m}");
    let m = unsupported(hfsdp.with_sharding(Sharding::OptimGrads).validate(&bf16, 4));
    assert!(
        m.contains("needs optim_grads_params inside them, not optim_grads"),
        "{m}"
    );
    let none = cfg
        .with_policy(MixedPrecisionPolicy::default().with_main_params_dtype(MainParamsDtype::None));
    assert!(none.validate(&bf16, 4).is_ok());
    let m = unsupported(none.validate(&mxfp8, 4));
    assert!(m.contains("main_params_dtype none"), "{m}");
    let m = unsupported(
        FsdpConfig::new(Sharding::NoShard)
            .with_overlap(Overlap::GradReduceAndParamGather)
            .validate(&bf16, 4),
    );
    assert!(m.contains("no_shard"), "{m}");
    // Seed 002's rule: auto turns fine-grained gathers on for MXFP8 weights gathered by
    // optim_grads_params with recompute, and says why; `on` without such weights is refused.
    assert!(!cfg.fine_grained(&mxfp8).0);
    assert!(cfg.with_recompute(true).fine_grained(&mxfp8).0);
    assert!(!cfg.with_recompute(true).fine_grained(&bf16).0);
    let opt = FsdpConfig::new(Sharding::Optim).with_recompute(true);
    let (on, why) = opt.fine_grained(&mxfp8);
    assert!(!on && why.contains("optim_grads_params"), "{why}");
    let m = unsupported(
        opt.with_fine_grained(FineGrainedGather::On)
            .validate(&mxfp8, 4),
    );
    assert!(m.contains("fine-grained"), "{m}");
    assert!(
        cfg.with_fine_grained(FineGrainedGather::On)
            .validate(&mxfp8, 4)
            .is_ok()
    );
    assert!("zero3".parse::<Sharding>().is_err());
    assert_eq!(
        "optim_grads".parse::<Sharding>().unwrap(),
        Sharding::OptimGrads
    );
}

/// Rank 1's gradient of `l1.weight` holds a NaN: both ranks fail at the reduction, rank 1
/// naming the parameter, rank 0 saying another rank found it.
#[test]
fn a_nan_gradient_is_named_on_every_rank() {
    for sharding in Sharding::ALL {
        for check in [NanCheck::FirstParam, NanCheck::EveryParam] {
            let s = Setup::new(2, sharding);
            let specs = specs(&s);
            let cfg = s
                .cfg
                .with_nan_check(check)
                .with_overlap(Overlap::GradReduce);
            let errs = run(2, |mut comm, mut dev| {
                let dev: &mut Device = &mut dev;
                let rank = comm.rank();
                let mut bufs =
                    DataParallelBuffers::new(dev, 2, rank, specs.clone(), cfg.ddp_config())
                        .unwrap();
                bufs.zero_grad_buffer(dev).unwrap();
                bufs.set_last_microbatch(true);
                bufs.begin_microbatch(dev, &mut comm).unwrap();
                let mut err = None;
                for p in (0..specs.len()).rev() {
                    let v = bufs.accumulation_view(dev, p).unwrap();
                    let mut g = vec![0.5f32; specs[p].numel];
                    if rank == 1 && (specs[p].name == "l1.weight" || specs[p].name == "l1.bias") {
                        g[3] = f32::NAN;
                    }
                    let t = lowbit_testkit::upload_f32(dev, &g);
                    dev.add(t, v).unwrap();
                    dev.free(t).unwrap();
                    if let Err(e) = bufs.register_grad_ready(dev, &mut comm, p) {
                        err = Some(e);
                        break;
                    }
                }
                let err = match err {
                    Some(e) => e,
                    None => bufs.finish_grad_sync(dev, &mut comm).unwrap_err(),
                };
                match err.protocol() {
                    Some(ProtocolError::NonFiniteGrad { rank, names }) => (*rank, names.clone()),
                    _ => panic!("{sharding}: expected a non-finite gradient error, got {err}"),
                }
            });
            assert_eq!(errs[0].1, vec!["a parameter of another rank".to_string()]);
            let (rank, mut names) = errs[1].clone();
            assert_eq!(rank, 1);
            names.sort();
            match check {
                // The first in the bucket group's (backward) order.
                NanCheck::FirstParam => assert_eq!(names, ["l1.bias"], "{sharding}"),
                _ => assert_eq!(names, ["l1.bias", "l1.weight"], "{sharding}"),
            }
        }
    }
}

#[test]
fn sharded_units_and_gradients_are_not_readable_outside_the_hooks() {
    let s = Setup::new(2, Sharding::OptimGradsParams);
    let specs = specs(&s);
    run(2, |comm, mut dev| {
        let bufs =
            DataParallelBuffers::new(&mut dev, 2, comm.rank(), specs.clone(), s.cfg.ddp_config())
                .unwrap();
        let e = bufs.param_view(0).unwrap_err();
        assert!(
            matches!(e.protocol(), Some(ProtocolError::NotGathered { name, .. }) if name == "l0.weight")
        );
        let e = bufs.grad_view(0).unwrap_err();
        assert!(matches!(
            e.protocol(),
            Some(ProtocolError::GradsSharded { .. })
        ));
    });
}
