//! Low-precision primary weights: MXFP8 weights kept only in MXFP8, `bf16(master)` staged into a
//! view that aliases the gradient buffer, all-gathered, re-quantized on every rank, and the
//! staging view zeroed — compared bit for bit with bf16 parameters quantized on the fly, which
//! is what the model must compute with either way: `Q(bf16(master))`.
//!
//! `LOWBIT_FULL_MATRIX=1` widens the matrix (more steps, dp 3).

use lowbit_buffers::layout::{
    BufferKey, GradDType, OptimizerId, ParamSpec, ParamStorage, QuantKind,
};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{BufferError, DataParallelBuffers, Mxfp8Gather, ProtocolError, WeightState};
use lowbit_comm::{Communicator, GroupConfig, run_ranks};
use lowbit_device::Device;
use lowbit_layout::LayoutError;
use lowbit_optim::OptimError;
use lowbit_testkit::harness;
use lowbit_testkit::harness::{
    Precision, Run, TestDevice, assert_same_trajectory, ddp, full_masters, parity_matrix, specs,
    train, variant,
};
use lowbit_train::protocol;

/// The protocol violation inside an error, or a panic naming what came instead.
fn protocol_err(e: BufferError) -> ProtocolError {
    match e {
        BufferError::Protocol(p) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}

fn optim_protocol_err(e: OptimError) -> ProtocolError {
    match e {
        OptimError::Buffer(b) => protocol_err(b),
        other => panic!("expected a protocol violation, got {other}"),
    }
}

fn full_matrix() -> bool {
    std::env::var_os("LOWBIT_FULL_MATRIX").is_some()
}

#[test]
fn parity_matrix_on_vs_off_is_bitwise() {
    let start = std::time::Instant::now();
    let dps: &[usize] = if full_matrix() {
        &[1, 2, 3, 4]
    } else {
        &[1, 2, 4]
    };
    let steps = if full_matrix() { 12 } else { 5 };
    let cases = parity_matrix(
        dps,
        steps,
        TestDevice::Cpu,
        &[GradDType::F32, GradDType::Bf16],
        &[None, Some(500)],
    );
    eprintln!(
        "parity matrix: {cases} ON/OFF pairs ({} training runs of {steps} steps) in {:.1?}",
        2 * cases,
        start.elapsed()
    );
}

#[test]
fn masters_at_step_zero_are_bitwise_equal() {
    for (dp, precision) in [
        (1, Precision::Mxfp8),
        (2, Precision::Nvfp4),
        (4, Precision::Mxfp8),
        (4, Precision::Nvfp4),
    ] {
        let base = Run {
            precision,
            steps: 0,
            ..Run::new(dp)
        };
        let on = train(variant(base, true));
        let off = train(variant(base, false));
        assert_eq!(full_masters(&on), full_masters(&off));
        // ... and they are the high-precision initial values, not dequantized weights.
        let init = harness::SHAPE.init(7);
        assert_eq!(full_masters(&on), init);
        assert_eq!(on[0].weights, off[0].weights);
    }
}

#[test]
fn train_eval_train_equals_train_only() {
    for (og, op) in [(false, false), (true, false), (true, true)] {
        for (grad, precision) in [
            (GradDType::F32, Precision::Mxfp8),
            (GradDType::Bf16, Precision::Mxfp8),
            (GradDType::F32, Precision::Nvfp4),
            (GradDType::F32, Precision::Mxfp8Direct),
        ] {
            let base = variant(
                Run {
                    precision,
                    grad,
                    ddp: ddp(true, og, op, Some(500)),
                    ..Run::new(2)
                },
                true,
            );
            let mut with_eval = train(Run {
                eval_after: &[0, 2, 3],
                ..base
            });
            let plain = train(base);
            assert_eq!(with_eval[0].eval_losses.len(), 3);
            // Evals use the weights of the step they follow: equal to the OFF path's evals.
            let off_eval = train(Run {
                eval_after: &[0, 2, 3],
                ..variant(base, false)
            });
            assert_eq!(
                harness::bits(&with_eval[0].eval_losses),
                harness::bits(&off_eval[0].eval_losses)
            );
            for o in &mut with_eval {
                o.eval_losses.clear();
            }
            assert_same_trajectory(
                &with_eval,
                &plain,
                &format!("eval ({og},{op}) {grad:?} {precision:?}"),
            );
        }
    }
}

#[test]
fn a_forced_sync_every_step_changes_nothing() {
    for ((og, op), precision) in [
        ((false, false), Precision::Mxfp8),
        ((true, true), Precision::Mxfp8),
        ((true, true), Precision::Nvfp4),
        ((true, true), Precision::Mxfp8Direct),
    ] {
        let base = variant(
            Run {
                precision,
                ddp: ddp(true, og, op, Some(500)),
                ..Run::new(4)
            },
            true,
        );
        let forced = train(Run {
            force_sync_every_step: true,
            ..base
        });
        let plain = train(base);
        assert_same_trajectory(&forced, &plain, &format!("forced sync ({og},{op})"));
    }
}

fn mxfp8_specs() -> Vec<ParamSpec> {
    specs(&Run {
        precision: Precision::Mxfp8,
        param_gather: true,
        ..Run::new(2)
    })
}

/// The structural guarantees refuse the orders that Megatron's bugs took, each with its typed
/// variant, in every build profile (the harness turns full verification on explicitly).
#[test]
fn wrong_orders_are_refused() {
    let run = Run {
        precision: Precision::Mxfp8,
        param_gather: true,
        chained: false,
        ..Run::new(2)
    };
    let results = run_ranks(2, GroupConfig::default(), |mut comm, mut dev| {
        let dev = &mut dev;
        let mut bufs =
            DataParallelBuffers::new(dev, 2, comm.rank(), mxfp8_specs(), run.ddp).unwrap();
        let init = harness::SHAPE.init(7);
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        let opt = harness::optimizers(&run, dev, &bufs, &init).unwrap();
        let g = bufs.group_of(0);
        assert_eq!(
            bufs.weight_state(g),
            WeightState::Current,
            "iteration 0 needs no gather"
        );
        // The masters moved (as after a step) and nothing was staged: a forward must not run
        // on the old weights silently (bug class C: dispatched state, no gather, no zeroing).
        bufs.mark_stale(OptimizerId(0));
        let err = bufs.finish_param_sync(dev, &mut comm, g).unwrap_err();
        assert!(matches!(
            protocol_err(err),
            ProtocolError::StaleWeights { .. }
        ));
        let err = bufs.sync_params(dev, &mut comm).unwrap_err();
        assert!(matches!(
            protocol_err(err),
            ProtocolError::StaleWeights { .. }
        ));
        // Staged and then zeroed (bug A1/A3: the gather would ship zeros): the zeroing keeps
        // the staged values, so the group stays staged.
        protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Staged);
        bufs.zero_grad_buffer(dev).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Staged);
        // Staged but never gathered, then backward (bug A2): the first gradient access refuses.
        protocol::begin_iteration(dev, &mut comm, &mut bufs, &opt).unwrap();
        let err = bufs.accumulation_view(dev, 0).unwrap_err();
        assert!(matches!(
            protocol_err(err),
            ProtocolError::BackwardBeforeGather {
                state: WeightState::Staged,
                ..
            }
        ));
        // Gathering it once is fine; the staging view is zero afterwards and the weights current.
        protocol::force_param_sync(dev, &mut comm, &mut bufs, &opt).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Current);
        let staging = bufs.param_view(0).unwrap();
        assert!(dev.read_bytes(staging).unwrap().iter().all(|&b| b == 0));
        // A second gather in the same iteration is refused (bug D's double sync).
        bufs.mark_stale(OptimizerId(0));
        let err = protocol::force_param_sync(dev, &mut comm, &mut bufs, &opt);
        assert!(err.is_ok(), "a forced sync restages and regathers: {err:?}");
        let err = {
            // Staged again without zeroing: its gather count is still 1 this iteration.
            protocol::stage(dev, &mut comm, &mut bufs, &opt, false).unwrap();
            bufs.sync_params(dev, &mut comm).unwrap_err()
        };
        assert!(matches!(
            protocol_err(err),
            ProtocolError::GatheredTwice { .. }
        ));
        // A forced sync brings every group back to current; then a non-zero gradient buffer at
        // the first backward access is refused.
        protocol::force_param_sync(dev, &mut comm, &mut bufs, &opt).unwrap();
        bufs.zero_grad_buffer(dev).unwrap();
        let gv = bufs.grad_view(5).unwrap();
        dev.fill(gv, 1.0).unwrap();
        let err = bufs.accumulation_view(dev, 5).unwrap_err();
        assert_eq!(protocol_err(err), ProtocolError::GradsNotZero);
        // A communicator of another size than the plan's is refused at the first launch (F3).
        let mut solo = comm.split(comm.rank() as u32, 0).unwrap();
        bufs.zero_grad_buffer(dev).unwrap();
        let err = protocol::force_param_sync(dev, solo.as_mut(), &mut bufs, &opt).unwrap_err();
        assert!(matches!(
            optim_protocol_err(err),
            ProtocolError::WrongGroup {
                size: 1,
                plan_size: 2,
                ..
            }
        ),);
    });
    for r in results {
        r.unwrap();
    }
}

#[test]
fn staging_aliases_the_gradient_buffer() {
    let mut dev = Device::cpu();
    for grad in [GradDType::F32, GradDType::Bf16] {
        let specs: Vec<ParamSpec> = mxfp8_specs()
            .into_iter()
            .map(|mut s| {
                s.key.grad_dtype = grad;
                s
            })
            .collect();
        let before = dev.allocated_bytes();
        let bufs =
            DataParallelBuffers::new(&mut dev, 2, 0, specs, harness::ddp(true, true, true, None))
                .unwrap();
        let staging = bufs.param_view(0).unwrap();
        let grads = bufs.grad_view(0).unwrap();
        assert_eq!(
            staging.buffer(),
            grads.buffer(),
            "{grad:?}: staging is not the grad memory"
        );
        // Writing through the staging view changes gradient bytes (with fp32 gradients, the
        // bf16 element i lives in the bytes of fp32 element i/2: other parameters' gradients).
        dev.fill(staging, 3.0).unwrap();
        let nonzero = (0..bufs.specs().len())
            .filter(|&p| bufs.mxfp8_weights(p).is_some())
            .any(|p| {
                dev.read_bytes(bufs.grad_view(p).unwrap())
                    .unwrap()
                    .iter()
                    .any(|&b| b != 0)
            });
        assert!(
            nonzero,
            "{grad:?}: staging writes did not reach the gradient memory"
        );
        // No memory was allocated for staging: the MXFP8 weights and the gradients only.
        let (rows_cols, scales): (usize, usize) = bufs
            .specs()
            .iter()
            .enumerate()
            .filter_map(|(p, s)| bufs.mxfp8_weights(p).map(|w| (s, w)))
            .map(|(_, w)| {
                (
                    2 * w.rows * w.cols,
                    w.rows * w.cols.div_ceil(32) + w.rows.div_ceil(32) * w.cols,
                )
            })
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
        let (params, grads) = bufs.memory_bytes();
        assert_eq!(
            dev.allocated_bytes() - before,
            rows_cols + scales + params + grads
        );
        let staging: usize = bufs.memory().iter().map(|b| b.staging).sum();
        assert!(staging > 0);
    }
}

#[test]
fn unsupported_configurations_are_refused() {
    let mut dev = Device::cpu();
    let quantized = mxfp8_specs();
    let err = DataParallelBuffers::new(&mut dev, 2, 0, quantized, ddp(false, true, false, None))
        .unwrap_err();
    assert!(
        matches!(
            err,
            BufferError::Layout(LayoutError::QuantizedNeedsGather { .. })
        ),
        "{err}"
    );
    // NVFP4 weights need shapes their 16x16 tiles cover.
    let nvfp4 = vec![ParamSpec::new(
        "w",
        vec![40, 32],
        BufferKey {
            param_storage: ParamStorage::Quantized(QuantKind::Nvfp4),
            grad_dtype: GradDType::F32,
            expert: false,
            owner: OptimizerId(0),
        },
    )];
    let err =
        DataParallelBuffers::new(&mut dev, 2, 0, nvfp4, ddp(true, true, true, None)).unwrap_err();
    assert!(
        matches!(
            err,
            BufferError::Layout(LayoutError::Nvfp4Tiles {
                rows: 40,
                cols: 32,
                ..
            })
        ),
        "{err}"
    );
    assert!(err.to_string().contains("multiples of 16"), "{err}");
}

/// Memory accounting: the live report equals the closed-form estimate and the device's own
/// allocation count, for every rank of several configurations.
#[test]
fn memory_report_matches_the_closed_form() {
    use lowbit_optim::{MasterDtype, RuleMemory, estimate_memory, memory_report};
    for (gather, grad, dp, precision) in [
        (true, GradDType::F32, 1, Precision::Mxfp8),
        (true, GradDType::F32, 4, Precision::Mxfp8),
        (true, GradDType::Bf16, 2, Precision::Mxfp8),
        (false, GradDType::F32, 3, Precision::Mxfp8),
        (true, GradDType::F32, 2, Precision::Nvfp4),
    ] {
        let run = Run {
            precision,
            param_gather: gather,
            grad,
            ..Run::new(dp)
        };
        let results = run_ranks(dp, GroupConfig::default(), |comm, mut dev| {
            let dev = &mut dev;
            let before = dev.allocated_bytes();
            let mut bufs =
                DataParallelBuffers::new(dev, dp, comm.rank(), specs(&run), run.ddp).unwrap();
            let init = harness::SHAPE.init(7);
            bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
            // AdamW for owner 0 (two state tensors), SGD with momentum for owner 1 (one).
            let opt = harness::optimizers(&run, dev, &bufs, &init).unwrap();
            let live = memory_report(&bufs, &opt);
            // AdamW reads bf16 gradients as they are (no f32 copy); SGD widens them.
            let adamw = RuleMemory::of(&harness::adamw(), MasterDtype::F32);
            let states = |o: OptimizerId| {
                if o == OptimizerId(0) {
                    adamw
                } else {
                    RuleMemory::from(1)
                }
            };
            let est = estimate_memory(&specs(&run), dp, comm.rank(), &run.ddp, states).unwrap();
            assert_eq!(live, est, "gather={gather} {grad:?} dp={dp}");
            assert_eq!(dev.allocated_bytes() - before, live.total());
        });
        for r in results {
            r.unwrap();
        }
    }
}

/// Per parameter, MXFP8 weights + fp32 gradients + AdamW across dp ranks cost
/// `2 + 2/32` (both copies and scales) `+ 4` (gradients; the staging view is free)
/// `+ (4 + 8)/dp` (master, moments; fp32 gradients are used in place) bytes.
#[test]
fn memory_per_parameter_closed_form() {
    use lowbit_optim::estimate_memory;
    let spec = |name: &str, storage| {
        ParamSpec::new(
            name,
            vec![4096, 4096],
            BufferKey {
                param_storage: storage,
                grad_dtype: GradDType::F32,
                expert: false,
                owner: OptimizerId(0),
            },
        )
    };
    let n = 4096 * 4096;
    for dp in [1, 2, 8] {
        let cfg = ddp(true, true, true, None);
        let m = estimate_memory(
            &[spec("w", ParamStorage::Quantized(QuantKind::Mxfp8))],
            dp,
            0,
            &cfg,
            |_| 2,
        )
        .unwrap();
        assert_eq!(m.weights(), 2 * n + 2 * n / 32);
        assert_eq!(m.grads(), 4 * n);
        assert_eq!(m.staging(), 2 * n);
        assert_eq!(m.masters, 4 * n / dp);
        assert_eq!(m.optimizer_state, 8 * n / dp);
        assert_eq!(m.grad_scratch, 0);
        let b = estimate_memory(&[spec("w", ParamStorage::Bf16)], dp, 0, &cfg, |_| 2).unwrap();
        assert_eq!(b.weights(), 2 * n);
        assert_eq!(b.staging(), 0);
    }
}

/// The direct 2D path gathers fp8 bytes: about half the all-gather traffic of bf16 staging
/// (biases and the grad-norm exchange are the same in both), for the same trajectory as bf16
/// weights quantized on the fly with 2D scaling.
#[test]
fn direct_path_halves_the_gather_traffic() {
    let base = Run {
        precision: Precision::Mxfp8Direct,
        param_gather: true,
        ..Run::new(2)
    };
    let direct = train(Run {
        ddp: base.ddp.with_mxfp8_gather(Mxfp8Gather::Direct2d),
        ..base
    });
    let staged = train(Run {
        precision: Precision::Mxfp8,
        ..base
    });
    let (d, s) = (direct[0].gather_bytes as f64, staged[0].gather_bytes as f64);
    assert!(d < 0.6 * s, "direct {d} bytes vs staged {s}");
    assert!(d > 0.45 * s, "direct {d} bytes vs staged {s}");
}
