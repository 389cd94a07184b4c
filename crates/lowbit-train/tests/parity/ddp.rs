//! Data parallelism end to end on CPU: the test model trained by N rank threads through
//! `lowbit-buffers` (buckets, grad sync, param sync) and `lowbit-optim` (distributed AdamW and
//! SGD, chained), all through `lowbit_testkit::harness`.

use lowbit_buffers::protocol::StepProtocol;
use lowbit_testkit::harness;
use std::time::{Duration, Instant};

use lowbit_buffers::layout::{GradDType, OptimizerId};
use lowbit_buffers::{
    BufferError, ConfigError, DataParallelBuffers, GradScaling, Overlap, ProtocolError,
};
use lowbit_comm::{Communicator, GroupConfig, run_ranks};
use lowbit_device::Device;
use lowbit_testkit::harness::{
    Run, SHAPE, assert_ranks_identical, ddp, full_masters, rank_main, specs, train,
};

#[test]
fn n_ranks_match_one_rank() {
    let one = train(Run {
        dp: 1,
        rows: 12,
        steps: 10,
        ..Run::new(1)
    });
    let reference10 = full_masters(&one);
    for dp in [2, 3, 4] {
        let run = Run {
            rows: 12 / dp,
            steps: 10,
            ..Run::new(dp)
        };
        let outs = train(run);
        assert_ranks_identical(&outs);
        let masters = full_masters(&outs);
        // Relative error per parameter tensor, ‖a − b‖ / ‖b‖ (elements near zero make an
        // element-wise relative bound meaningless after AdamW's sign-like updates).
        for (p, (a, b)) in masters.iter().zip(&reference10).enumerate() {
            let diff: f64 = a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum();
            let norm: f64 = b.iter().map(|y| f64::from(*y).powi(2)).sum();
            let rel = (diff / norm).sqrt();
            assert!(rel <= 1e-6, "dp={dp} param {p}: relative error {rel:e}");
        }
    }
}

#[test]
fn overlap_and_bucketing_do_not_change_a_bit() {
    for dp in [2, 3] {
        for grad in [GradDType::F32, GradDType::Bf16] {
            let base = train(Run {
                ddp: ddp(true, false, false, None),
                grad,
                ..Run::new(dp)
            });
            assert_ranks_identical(&base);
            for (og, op) in [(true, false), (true, true)] {
                for bucket in [None, Some(300), Some(1)] {
                    let outs = train(Run {
                        ddp: ddp(true, og, op, bucket),
                        grad,
                        ..Run::new(dp)
                    });
                    let what = format!("dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?}");
                    assert_ranks_identical(&outs);
                    harness::assert_same_trajectory(&outs, &base, &what);
                }
            }
        }
    }
}

#[test]
fn classic_ddp_matches_the_distributed_optimizer() {
    let dist = train(Run::new(2));
    let classic = train(Run {
        ddp: ddp(false, true, false, Some(600)),
        ..Run::new(2)
    });
    assert_ranks_identical(&classic);
    // Classic DDP all-reduces and every rank updates every parameter: same arithmetic per
    // element, so the same bits.
    assert_eq!(classic[0].losses, dist[0].losses);
    assert_eq!(classic[0].weights, dist[0].weights);
    assert_eq!(classic[0].masters.len(), SHAPE.params().len());
}

#[test]
fn microbatch_accumulation_matches_a_big_batch() {
    let accum = train(Run {
        microbatches: 3,
        rows: 2,
        ..Run::new(2)
    });
    let big = train(Run {
        microbatches: 1,
        rows: 6,
        ..Run::new(2)
    });
    // Same samples per step (rank r's microbatch m covers a different slice, so compare the
    // trajectories loosely: same data, different summation order).
    let (a, b) = (full_masters(&accum), full_masters(&big));
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= 2e-3 * y.abs().max(0.1), "{x} vs {y}");
    }
}

#[test]
fn non_finite_gradients_skip_the_step_and_change_nothing() {
    let poisoned = Run {
        steps: 3,
        poison: Some((2, 1)),
        ..Run::new(2)
    };
    let outs = train(poisoned);
    let clean = train(Run {
        steps: 2,
        ..poisoned
    });
    assert_ranks_identical(&outs);
    for o in &outs {
        assert_eq!(o.skipped, 1);
        assert!(!o.norms[2].is_finite());
    }
    // The skipped third step left masters and parameters bitwise as after two clean steps.
    assert_eq!(full_masters(&outs), full_masters(&clean));
    assert_eq!(outs[0].weights, clean[0].weights);
}

#[test]
fn clipping_bounds_the_update() {
    let outs = train(Run {
        clip: Some(1e-3),
        ..Run::new(2)
    });
    assert_ranks_identical(&outs);
    let free = train(Run::new(2));
    assert_ne!(full_masters(&outs), full_masters(&free));
    assert!(
        outs[0].norms.iter().all(|n| *n > 1e-3),
        "clip must have been active"
    );
}

/// Megatron's `test_grad_sync`: a gradient buffer filled with 1.0 reduces to 1 on the owner's
/// shard and is left at 1/dp (scaled, not reduced) elsewhere; with averaging in the
/// collective the owner gets 1 and the rest stays 1.
#[test]
fn grad_sync_of_ones() {
    for dp in [1, 2, 3, 4] {
        for average in [false, true] {
            let run = Run::new(dp);
            let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
                let cfg = ddp(true, false, false, None).with_scaling(if average {
                    GradScaling::AverageInCollective
                } else {
                    GradScaling::PreDivide
                });
                let mut bufs =
                    DataParallelBuffers::new(&mut dev, dp, comm.rank(), specs(&run), cfg).unwrap();
                for p in 0..bufs.specs().len() {
                    let g = bufs.grad_view(p).unwrap();
                    dev.fill(g, 1.0).unwrap();
                }
                bufs.finish_grad_sync(&mut dev, &mut comm).unwrap();
                let owned = bufs.owned_shards().unwrap();
                let mut seen = 0;
                for s in &owned {
                    let v: Vec<f32> = dev.download(s.grad_view).unwrap();
                    assert!(v.iter().all(|&x| x == 1.0), "dp={dp} owned {v:?}");
                    seen += v.len();
                }
                let other = if average || dp == 1 {
                    1.0
                } else {
                    1.0 / dp as f32
                };
                for p in 0..bufs.specs().len() {
                    let v: Vec<f32> = dev.download(bufs.grad_view(p).unwrap()).unwrap();
                    let mine: Vec<_> = owned
                        .iter()
                        .filter(|s| s.param == p)
                        .map(|s| s.param_range.clone())
                        .collect();
                    for (i, x) in v.iter().enumerate() {
                        if !mine.iter().any(|r| r.contains(&i)) {
                            assert_eq!(*x, other, "dp={dp} avg={average} non-owned");
                        }
                    }
                }
                seen
            });
            let total: usize = results.into_iter().map(|r| r.unwrap()).sum();
            let numel: usize = SHAPE
                .params()
                .iter()
                .map(|(_, s)| s.iter().product::<usize>())
                .sum();
            assert_eq!(total, numel, "every element owned exactly once");
        }
    }
}

#[test]
fn a_missing_grad_ready_is_an_error_not_a_hang() {
    let run = Run::new(2);
    let results = run_ranks(
        2,
        GroupConfig::default().with_timeout(Duration::from_secs(5)),
        |mut comm, mut dev| {
            let mut bufs =
                DataParallelBuffers::new(&mut dev, 2, comm.rank(), specs(&run), run.ddp).unwrap();
            // First batch: every parameter reports once; the golden counts are recorded.
            bufs.zero_grad_buffer(&mut dev).unwrap();
            for p in 0..bufs.specs().len() {
                bufs.register_grad_ready(&mut dev, &mut comm, p).unwrap();
            }
            bufs.finish_grad_sync(&mut dev, &mut comm).unwrap();
            bufs.zero_grad_buffer(&mut dev).unwrap();
            // Second batch: parameter 0 never reports.
            for p in 1..bufs.specs().len() {
                bufs.register_grad_ready(&mut dev, &mut comm, p).unwrap();
            }
            bufs.finish_grad_sync(&mut dev, &mut comm)
        },
    );
    for r in results {
        let err = r.unwrap().unwrap_err();
        assert!(
            matches!(
                err,
                BufferError::Protocol(ProtocolError::GradReduceNotStarted { .. })
            ),
            "{err}"
        );
    }
}

#[test]
fn a_rank_that_dies_fails_the_others_quickly() {
    let run = Run::new(3);
    let start = Instant::now();
    let results = run_ranks(
        3,
        GroupConfig::default().with_timeout(Duration::from_secs(20)),
        |mut comm, mut dev| {
            if comm.rank() == 2 {
                panic!("rank 2 dies before training");
            }
            rank_main(&run, &mut comm, &mut dev)
        },
    );
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "peers waited for the dead rank"
    );
    assert!(results[2].is_err());
    for r in &results[..2] {
        let msg = r.as_ref().unwrap().as_ref().unwrap_err();
        assert!(msg.contains("abort") || msg.contains("rank 2"), "{msg}");
    }
}

#[test]
fn invalid_configurations_are_refused_up_front() {
    let mut dev = Device::cpu();
    let run = Run::new(1);
    // Overlapped gathers without overlapped reduction cannot even be built.
    assert!(matches!(
        Overlap::from_flags(false, true),
        Err(BufferError::Config(
            ConfigError::ParamGatherOverlapNeedsGradOverlap
        ))
    ));
    for (cfg, want) in [
        (
            ddp(false, true, true, None),
            ConfigError::ParamGatherOverlapNeedsSharding,
        ),
        (ddp(true, true, false, Some(0)), ConfigError::ZeroBucketSize),
    ] {
        let err = DataParallelBuffers::new(&mut dev, 1, 0, specs(&run), cfg).unwrap_err();
        match err {
            BufferError::Config(c) => assert_eq!(c, want),
            other => panic!("expected {want:?}, got {other}"),
        }
    }
    let err = DataParallelBuffers::new(&mut dev, 2, 2, specs(&run), run.ddp).unwrap_err();
    assert!(matches!(
        err,
        BufferError::Config(ConfigError::RankOutOfRange { rank: 2, dp: 2 })
    ));
}

/// The step updates, stages and gathers bucket group by bucket group (each group's gather in
/// flight beside the later groups' update; with gathers overlapped with the forward, left in
/// flight for its pre-hooks instead of staged at the next iteration's start) and trains the same
/// bits as updating everything, then staging: f32 and bf16 gradients (with f32 gradients an MXFP8
/// staging view aliases the first half of the gradient bytes, so a wrong group order would
/// stage over gradients not yet read), bf16, MXFP8 and the 2D formats (a MAX-reduction of each
/// group's tile amaxes), one optimizer or a chain, 2 and 3 ranks, gathers after the step or
/// overlapped with the forward.
#[test]
fn the_pipelined_step_changes_no_bit() {
    use harness::Precision;
    let mut pipelined = 0;
    for (dp, op) in [(2, false), (3, false), (2, true)] {
        for grad in [GradDType::F32, GradDType::Bf16] {
            for (chained, precision) in [
                (false, Precision::Bf16),
                (false, Precision::Mxfp8),
                (true, Precision::Mxfp8),
                (false, Precision::Mxfp8Direct),
                (false, Precision::Nvfp4),
            ] {
                let run = harness::variant(
                    Run {
                        ddp: ddp(true, true, op, Some(300)),
                        grad,
                        chained,
                        precision,
                        param_gather: precision != Precision::Bf16,
                        clip: Some(1e-3),
                        one_call_step: dp == 3,
                        ..Run::new(dp)
                    },
                    true,
                );
                // The plan decides; check that the pipeline is on where it should be, so that
                // the comparison below is not vacuous.
                let mut dev = Device::cpu();
                let bufs = DataParallelBuffers::new(&mut dev, dp, 0, specs(&run), run.ddp)
                    .expect("buffers");
                let on = bufs.pipeline_groups(OptimizerId(0)).is_some();
                assert!(on, "{run:?}");
                pipelined += usize::from(on);
                let plain = train(Run {
                    pipelined_step: false,
                    ..run
                });
                let piped = train(run);
                assert_ranks_identical(&piped);
                harness::assert_same_trajectory(&plain, &piped, &format!("{run:?}"));
            }
        }
    }
    assert_eq!(pipelined, 30);
    // One group per buffer is not pipelined.
    let mut dev = Device::cpu();
    let cfg = ddp(true, false, false, None);
    let run = Run {
        ddp: cfg,
        ..Run::new(2)
    };
    let bufs = DataParallelBuffers::new(&mut dev, 2, 0, specs(&run), cfg).expect("buffers");
    assert_eq!(bufs.pipeline_groups(OptimizerId(0)), None, "{cfg:?}");
}

/// `Iteration::step` (this rank's sum of squares taken group by group as the reductions complete,
/// beside those still in flight; on one rank all at once after them) trains the same bits as
/// `finish_grad_sync` then `GradsReady::step`: one optimizer or a chain, Muon layer-wise, every
/// overlap mode, clipping on, bf16 and MXFP8 weights, one to three ranks.
#[test]
fn the_one_call_step_changes_no_bit() {
    use harness::Precision;
    let mut runs = Vec::new();
    for dp in [1, 2, 3] {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for (chained, precision) in [
                (false, Precision::Bf16),
                (false, Precision::Mxfp8),
                (true, Precision::Mxfp8),
            ] {
                runs.push(Run {
                    ddp: ddp(true, og, op, Some(300)),
                    chained,
                    precision,
                    param_gather: precision != Precision::Bf16,
                    clip: Some(1e-3),
                    ..Run::new(dp)
                });
            }
        }
    }
    runs.push(Run {
        precision: Precision::Mxfp8,
        param_gather: true,
        ..Run::muon(2)
    });
    for run in runs {
        let base = train(run);
        let one = train(Run {
            one_call_step: true,
            ..run
        });
        assert_ranks_identical(&one);
        harness::assert_same_trajectory(&base, &one, &format!("{run:?}"));
        assert!(one[0].grads.is_empty() && !base[0].grads.is_empty());
    }
}
