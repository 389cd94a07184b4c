//! Muon on whole matrices (the layer-wise plan rule) chained with distributed AdamW and SGD on
//! shared buffers, under MXFP8 (staged and direct 2D) and NVFP4 primary weights: Megatron-LM PR #4987's gaps
//! (Megatron-LM PR 4987) as invariants, each with the test that fails without it, and the ON/OFF
//! parity matrix.
//!
//! | gap | invariant | tests |
//! | --- | --- | --- |
//! | 1a | masters come from the high-precision init | `masters_at_step_zero_are_the_init_on_and_off` |
//! | 1b | the update never quantizes the weights; one quantization per low-precision parameter per gather | `apply_never_quantizes_and_stage_only_its_own_pieces`, `one_quantization_per_low_precision_parameter_per_gather` |
//! | 2a | the updated master is in the staging view before the gather | `staging_holds_bf16_of_the_updated_masters_before_the_gather`, the parity matrix |
//! | 2b | staging after every zeroing, at every forced-sync site (eval under overlapped gather) | `evals_and_forced_syncs_under_overlapped_gather_change_nothing` |
//! | 3a | a bucket group has one owner, is gathered once per step, after that owner staged | `a_group_is_gathered_only_after_its_own_owner_staged`, `every_group_is_gathered_once_per_step_after_staging` |
//! | 4a/4b | configurations that cannot work are refused up front, with the reason | `muon_refusals::configurations_that_cannot_work_are_refused_up_front` |
//!
//! Every run is tiny (the test MLP, a few steps); the file runs in a few seconds. The refusals
//! (4a/4b) and the gradient-dtype check are in `muon_refusals.rs`.

use lowbit_buffers::layout::OptimizerId;
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    BufferError, DataParallelBuffers, ParamSyncState, ProtocolError, StorageKind, WeightState,
    mxfp8_weight_config,
};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::{CountedOp, DType, Device, Mxfp8Views, bf16};
use lowbit_optim::{ChainedOptimizer, NsDtype, OptimError, Optimizer, UpdateScope};
use lowbit_testkit::harness;
use lowbit_testkit::harness::{
    LOW_PRECISIONS, MuonRun, OptimChoice, Phase, Precision, Run, SHAPE, assert_ranks_identical,
    assert_same_trajectory, bits, ddp, full_masters, muon_parity_matrix, op_counts, train, variant,
};
use lowbit_train::protocol;

/// Muon on the hidden matrices only: AdamW owns the input and output matrices, in low precision
/// too, so both owners have low-precision bucket groups.
const HIDDEN: OptimChoice = OptimChoice::Muon(MuonRun {
    ns: NsDtype::F32,
    hidden_only: true,
});

/// An eval after every step of the runs here.
const EVERY_STEP: &[usize] = &[0, 1, 2, 3, 4, 5, 6, 7];

fn idx(op: CountedOp) -> usize {
    CountedOp::ALL.iter().position(|&o| o == op).unwrap()
}

/// The counted op that quantizes shards before the gather (tile-scaled storage only) and the one
/// that rebuilds each low-precision parameter after it.
fn quant_ops(precision: Precision) -> (Option<CountedOp>, CountedOp) {
    match precision {
        Precision::Mxfp8 => (None, CountedOp::QuantizeMxfp8),
        Precision::Mxfp8Direct => (
            Some(CountedOp::Mxfp8Quantize2dRange),
            CountedOp::Mxfp8Scales2d,
        ),
        Precision::Nvfp4 => (
            Some(CountedOp::Nvfp4Quantize2dRange),
            CountedOp::Nvfp4Finish2d,
        ),
        Precision::Bf16 => unreachable!("no low-precision weights"),
    }
}

fn protocol_err(e: OptimError) -> ProtocolError {
    match e {
        OptimError::Buffer(BufferError::Protocol(p)) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}

// ---- parity ------------------------------------------------------------------------------------

/// Muon + AdamW + SGD, parameter gather ON vs OFF, bitwise: losses, grad norms, reduced
/// gradients, masters and weights, for MXFP8 staged, MXFP8 direct 2D and NVFP4, every overlap
/// mode, one bucket and small buckets, dp 1–4, fused and unfused accumulation, f32 and bf16
/// gradients, Muon on every matrix or on the hidden ones (see `harness::muon_parity_matrix`).
#[test]
fn muon_parity_matrix_on_vs_off_is_bitwise() {
    let start = std::time::Instant::now();
    let cases = muon_parity_matrix(
        &[1, 2, 3, 4],
        4,
        harness::TestDevice::Cpu,
        &[None, Some(256)],
    );
    assert_eq!(cases, 3 * 3 * 2 * 4);
    eprintln!(
        "Muon parity matrix: {cases} ON/OFF pairs in {:.1?}",
        start.elapsed()
    );
}

/// The same with `torch.optim.Muon`'s bf16 Newton–Schulz (deterministic on the CPU too): the
/// NS dtype changes Muon's arithmetic, not the protocol.
#[test]
fn bf16_newton_schulz_on_vs_off_is_bitwise() {
    for (precision, (og, op), dp) in [
        (Precision::Mxfp8, (true, true), 2),
        (Precision::Nvfp4, (false, false), 3),
        (Precision::Mxfp8Direct, (true, false), 4),
    ] {
        let base = Run {
            precision,
            ddp: ddp(true, og, op, Some(256)),
            steps: 4,
            optimizer: OptimChoice::Muon(MuonRun {
                ns: NsDtype::Bf16,
                hidden_only: dp == 4,
            }),
            ..Run::muon(dp)
        };
        let on = train(variant(base, true));
        let off = train(variant(base, false));
        assert_ranks_identical(&on);
        let what = format!("bf16 NS {precision:?} dp={dp} ({og},{op})");
        harness::assert_parity(&on, &off, &what);
        // ... and bf16 NS is really another trajectory than f32 NS.
        let f32_ns = train(variant(
            Run {
                optimizer: OptimChoice::Muon(MuonRun {
                    ns: NsDtype::F32,
                    hidden_only: dp == 4,
                }),
                ..base
            },
            true,
        ));
        assert_ne!(full_masters(&on), full_masters(&f32_ns), "{what}");
    }
}

/// The parity above is not vacuous: Muon moves the masters, the loss falls, each Muon matrix is
/// owned whole by one rank (every rank holds the same weights), and with more ranks than Muon
/// matrices the idle ranks own none and train alike.
#[test]
fn muon_trains_whole_matrices_on_their_owners() {
    let init = SHAPE.init(7);
    for (dp, optimizer) in [
        (2, OptimChoice::Muon(MuonRun::F32)),
        (3, OptimChoice::Muon(MuonRun::F32)),
        (4, HIDDEN),
    ] {
        let run = variant(
            Run {
                precision: Precision::Mxfp8,
                steps: 8,
                optimizer,
                ..Run::muon(dp)
            },
            true,
        );
        let out = train(run);
        assert_ranks_identical(&out);
        let losses = &out[0].losses;
        assert!(
            losses.last().unwrap() < &(0.8 * losses[0]),
            "dp={dp}: {losses:?}"
        );
        let masters = full_masters(&out);
        let muon_params: Vec<usize> = SHAPE
            .params()
            .iter()
            .enumerate()
            .filter(|(_, (name, _))| harness::owner_of(&run, name) == 0)
            .map(|(p, _)| p)
            .collect();
        for &p in &muon_params {
            assert_ne!(bits(&masters[p]), bits(&init[p]), "dp={dp}: param {p}");
            let owners: Vec<usize> = (0..dp)
                .filter(|&r| out[r].masters.iter().any(|m| m.param == p))
                .collect();
            assert_eq!(owners.len(), 1, "dp={dp}: param {p} owned by {owners:?}");
            let pieces: Vec<_> = out[owners[0]]
                .masters
                .iter()
                .filter(|m| m.param == p)
                .collect();
            assert_eq!(pieces.len(), 1);
            assert_eq!(pieces[0].range, 0..init[p].len(), "dp={dp}: param {p}");
        }
        // Ranks without a Muon matrix (dp 4, two hidden matrices).
        let idle = (0..dp)
            .filter(|&r| {
                !out[r]
                    .masters
                    .iter()
                    .any(|m| muon_params.contains(&m.param))
            })
            .count();
        assert_eq!(idle, dp.saturating_sub(muon_params.len()), "dp={dp}");
    }
}

// ---- 1a: masters from the high-precision init --------------------------------------------------

/// Gap 1a (masters born from dequantized weights, PR 4987's `_restore_high_precision_init_val`):
/// Muon's and AdamW's masters at step 0 are the init values bit for bit, with low-precision
/// weights (ON) and without (OFF), at every dp, for every format.
#[test]
fn masters_at_step_zero_are_the_init_on_and_off() {
    let init = SHAPE.init(7);
    for precision in LOW_PRECISIONS {
        for (dp, optimizer) in [
            (1, OptimChoice::Muon(MuonRun::F32)),
            (2, HIDDEN),
            (3, OptimChoice::Muon(MuonRun::F32)),
            (4, OptimChoice::Muon(MuonRun::F32)),
        ] {
            let base = Run {
                precision,
                steps: 0,
                optimizer,
                ..Run::muon(dp)
            };
            let on = train(variant(base, true));
            let off = train(variant(base, false));
            let what = format!("{precision:?} dp={dp}");
            assert_eq!(on[0].low_precision_params, 4, "{what}");
            for (name, out) in [("ON", &on), ("OFF", &off)] {
                let m = full_masters(out);
                for (p, (a, b)) in m.iter().zip(&init).enumerate() {
                    assert_eq!(
                        bits(a),
                        bits(b),
                        "{what} {name}: master {p} is not the init"
                    );
                }
            }
            assert_eq!(on[0].weights, off[0].weights, "{what}");
        }
    }
}

// ---- 1b: no quantization in the update ---------------------------------------------------------

/// Synthetic gradient values of parameter `p` on `rank` (deterministic, a few scales).
fn synthetic_grads(p: usize, n: usize, rank: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let x = ((p * 7919 + i * 104_729 + rank * 31) % 1000) as f32 / 1000.0 - 0.5;
            x * (1.0 + p as f32 / 4.0) * 1e-2
        })
        .collect()
}

/// Iteration 0 driven by hand up to the update: begin (zero + stage stale: nothing), synthetic
/// gradients, reduction, the local sum of squares.
fn until_update(
    run: &Run,
    comm: &mut LocalComm,
    dev: &mut Device,
) -> (DataParallelBuffers, ChainedOptimizer) {
    let rank = comm.rank();
    let mut bufs = harness::buffers(run, dev, rank).unwrap();
    let opt = harness::optimizers(run, dev, &bufs, &SHAPE.init(7)).unwrap();
    protocol::begin_iteration(dev, comm, &mut bufs, &opt).unwrap();
    for (p, s) in bufs.specs().to_vec().iter().enumerate() {
        let v = bufs.accumulation_view(dev, p).unwrap();
        dev.upload(v, &synthetic_grads(p, s.numel, rank)).unwrap();
    }
    bufs.finish_grad_sync(dev, comm).unwrap();
    (bufs, opt)
}

fn counts_since(dev: &Device, before: harness::OpCounts) -> harness::OpCounts {
    let now = op_counts(dev);
    std::array::from_fn(|i| now[i] - before[i])
}

/// Gap 1b (the inner step re-quantized the MXFP8 weights, PR 4987's
/// `_skip_mxfp8_in_copy_main_to_model`), at the protocol level: `apply` (Muon's and AdamW's
/// update of the masters) calls no quantization at all; `stage` quantizes nothing whole: for
/// MXFP8 staging it casts, for the tile-scaled formats it quantizes exactly this rank's owned
/// pieces once each; the gather then rebuilds each low-precision parameter exactly once on
/// every rank. (A redundant quantization in the update leaves the bits alone, since the gather's
/// overwrites it: only the count sees it.)
#[test]
fn apply_never_quantizes_and_stage_only_its_own_pieces() {
    for precision in LOW_PRECISIONS {
        for (dp, optimizer) in [
            (1, HIDDEN),
            (2, HIDDEN),
            (3, OptimChoice::Muon(MuonRun::F32)),
        ] {
            let run = variant(
                Run {
                    precision,
                    ddp: ddp(true, false, false, Some(256)),
                    optimizer,
                    ..Run::muon(dp)
                },
                true,
            );
            let (pre, post) = quant_ops(precision);
            let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
                let dev = &mut dev;
                let (mut bufs, mut opt) = until_update(&run, &mut comm, dev);
                let what = format!("{precision:?} dp={dp} rank {}", comm.rank());
                let pieces = bufs
                    .owned_shards()
                    .unwrap()
                    .iter()
                    .filter(|s| bufs.is_low_precision(s.param))
                    .count() as u64;
                let before = op_counts(dev);
                protocol::local_sum_squares(dev, &opt).unwrap();
                apply(dev, &mut bufs, &mut opt);
                assert_eq!(counts_since(dev, before), [0; 6], "{what}: apply quantized");
                let before = op_counts(dev);
                protocol::stage(dev, &mut comm, &mut bufs, &opt, false).unwrap();
                let mut want = [0; 6];
                if let Some(op) = pre {
                    want[idx(op)] = pieces;
                }
                assert_eq!(counts_since(dev, before), want, "{what}: stage");
                let before = op_counts(dev);
                bufs.sync_params(dev, &mut comm).unwrap();
                let mut want = [0; 6];
                want[idx(post)] = 4;
                assert_eq!(counts_since(dev, before), want, "{what}: gather");
            });
            for r in results {
                r.unwrap();
            }
        }
    }
}

/// The expected counted calls per phase of step `t` of a probed run (see
/// `one_quantization_per_low_precision_parameter_per_gather`).
fn expected_quant(run: &Run, o: &harness::Outcome, t: usize) -> [harness::OpCounts; 4] {
    let (pre, post) = quant_ops(run.precision);
    let lp = o.low_precision_params as u64;
    let pieces = o.owned_low_precision_pieces as u64;
    let syncs =
        |t: usize| u64::from(run.force_sync_every_step) + u64::from(run.eval_after.contains(&t));
    let mut e = [[0u64; 6]; 4];
    let mut stage_and_gather = |stage: Phase, gather: Phase, times: u64| {
        if let Some(op) = pre {
            e[stage as usize][idx(op)] += times * pieces;
        }
        e[gather as usize][idx(post)] += times * lp;
    };
    if run.ddp.overlap.param_gather() {
        // Staged after the zeroing in `begin`, gathered by the forward; nothing to do at step 0
        // or after a forced sync (the weights are current).
        if t > 0 && syncs(t - 1) == 0 {
            stage_and_gather(Phase::Begin, Phase::Microbatches, 1);
        }
    } else {
        stage_and_gather(Phase::Step, Phase::Step, 1);
    }
    stage_and_gather(Phase::After, Phase::After, syncs(t));
    e
}

/// Gap 1b over whole runs: per step and phase, the quantizations are exactly one per
/// low-precision parameter per gather (the rebuild after it) plus, for the tile-scaled formats,
/// one per owned piece per staging; none anywhere else — not in the update, not in the forward
/// or backward (they dequantize the stored copies), and the same on every forced-sync site.
#[test]
fn one_quantization_per_low_precision_parameter_per_gather() {
    for precision in LOW_PRECISIONS {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for (dp, optimizer, eval_after, force) in [
                (1, OptimChoice::Muon(MuonRun::F32), &[1usize][..], false),
                (2, HIDDEN, &[2], true),
                (4, OptimChoice::Muon(MuonRun::F32), &[0, 1, 3], false),
            ] {
                let run = variant(
                    Run {
                        precision,
                        ddp: ddp(true, og, op, Some(256)),
                        steps: 5,
                        optimizer,
                        eval_after,
                        force_sync_every_step: force,
                        probe: true,
                        ..Run::muon(dp)
                    },
                    true,
                );
                let out = train(run);
                for (rank, o) in out.iter().enumerate() {
                    assert_eq!(o.low_precision_params, 4);
                    for (t, probe) in o.probes.iter().enumerate() {
                        assert_eq!(
                            probe.quant,
                            expected_quant(&run, o, t),
                            "{precision:?} ({og},{op}) dp={dp} rank {rank} step {t}: quantizations \
                             per phase [begin, microbatches, step, after]"
                        );
                    }
                }
            }
        }
    }
}

// ---- 2a: the updated master is staged before the gather ----------------------------------------

/// Gap 2a (the updated master never reached the staging buffer, PR 4987's
/// `_copy_main_params_to_param_buffer`), checked on the bytes: between `stage` and the gather,
/// the staging view holds `bf16(master)` of the update just made in this rank's owned pieces
/// (Muon's whole matrices, AdamW's pieces) and zeros elsewhere; after the gather the staging
/// view is zero again and the MXFP8 copies of every matrix this rank updated whole are exactly
/// `Q(bf16(master))`. Under overlapped gather the harness checks the staging view after `begin`
/// of every step (the stage that follows the zeroing), before the forward's gathers.
#[test]
fn staging_holds_bf16_of_the_updated_masters_before_the_gather() {
    for (dp, optimizer) in [
        (1, OptimChoice::Muon(MuonRun::F32)),
        (2, HIDDEN),
        (4, HIDDEN),
    ] {
        let run = variant(
            Run {
                precision: Precision::Mxfp8,
                ddp: ddp(true, false, false, Some(256)),
                optimizer,
                ..Run::muon(dp)
            },
            true,
        );
        let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
            let dev = &mut dev;
            let (mut bufs, mut opt) = until_update(&run, &mut comm, dev);
            let what = format!("dp={dp} rank {}", comm.rank());
            protocol::local_sum_squares(dev, &opt).unwrap();
            apply(dev, &mut bufs, &mut opt);
            protocol::stage(dev, &mut comm, &mut bufs, &opt, false).unwrap();
            let masters = opt.masters(dev).unwrap();
            let owned = bufs.owned_shards().unwrap();
            let mut checked = 0;
            for p in 0..bufs.specs().len() {
                if bufs.storage_kind(p) != StorageKind::Mxfp8Staged {
                    continue;
                }
                let staging: Vec<bf16> = dev.download(bufs.param_view(p).unwrap()).unwrap();
                // The rest of the view is other ranks' pieces: gradient bytes until the gather
                // overwrites them (the staging view aliases the gradients).
                for s in owned.iter().filter(|s| s.param == p) {
                    let m = masters
                        .iter()
                        .find(|m| m.param == p && m.range == s.param_range)
                        .unwrap();
                    let want = m.values.iter().map(|&v| bf16::from_f32(v).to_bits());
                    assert!(
                        staging[s.param_range.clone()]
                            .iter()
                            .map(|b| b.to_bits())
                            .eq(want),
                        "{what}: staging view of param {p} {:?} before the gather",
                        s.param_range
                    );
                    checked += 1;
                }
            }
            bufs.sync_params(dev, &mut comm).unwrap();
            for p in 0..bufs.specs().len() {
                let Some(w) = bufs.mxfp8_weights(p) else {
                    continue;
                };
                let staging = dev.read_bytes(bufs.param_view(p).unwrap()).unwrap();
                assert!(
                    staging.iter().all(|&b| b == 0),
                    "{what}: staging of {p} after"
                );
                // A matrix this rank owns whole: its weights are Q(bf16(master)).
                let Some(m) = masters
                    .iter()
                    .find(|m| m.param == p && m.range.len() == w.rows * w.cols)
                else {
                    continue;
                };
                let src = dev.alloc(DType::Bf16, m.values.len());
                let vals: Vec<bf16> = m.values.iter().map(|&v| bf16::from_f32(v)).collect();
                dev.upload(src, &vals).unwrap();
                let mut u8s = |n| dev.alloc(DType::U8, n);
                let views = Mxfp8Views {
                    rowwise: Some((u8s(w.rows * w.cols), u8s(w.rows * w.cols.div_ceil(32)))),
                    columnwise: Some((u8s(w.rows * w.cols), u8s(w.rows.div_ceil(32) * w.cols))),
                };
                dev.quantize_mxfp8(src, w.rows, w.cols, &mxfp8_weight_config(), &views)
                    .unwrap();
                let (Some(r), Some(c)) = (views.rowwise, views.columnwise) else {
                    unreachable!()
                };
                for (got, want) in [
                    (w.rowwise.0, r.0),
                    (w.rowwise.1, r.1),
                    (w.columnwise.0, c.0),
                    (w.columnwise.1, c.1),
                ] {
                    assert!(
                        dev.read_bytes(got).unwrap() == dev.read_bytes(want).unwrap(),
                        "{what}: MXFP8 weights of {p} are not Q(bf16(master))"
                    );
                }
            }
            checked
        });
        let checked: usize = results.into_iter().map(|r| r.unwrap()).sum();
        assert!(checked >= 4, "dp={dp}: {checked} pieces checked");
    }
    // Overlapped gather: the staging after `begin`, every step, every rank.
    for (dp, optimizer) in [(2, HIDDEN), (3, OptimChoice::Muon(MuonRun::F32))] {
        let run = variant(
            Run {
                precision: Precision::Mxfp8,
                ddp: ddp(true, true, true, Some(256)),
                steps: 4,
                optimizer,
                probe: true,
                ..Run::muon(dp)
            },
            true,
        );
        let out = train(run);
        let mut checked = 0;
        for (rank, o) in out.iter().enumerate() {
            for (t, probe) in o.probes.iter().enumerate() {
                assert!(
                    probe.staging_mismatches.is_empty(),
                    "dp={dp} rank {rank} step {t}: {:?}",
                    probe.staging_mismatches
                );
                // Every owned low-precision piece is staged at every step after the first.
                let want = if t == 0 {
                    0
                } else {
                    o.owned_low_precision_pieces
                };
                assert_eq!(
                    probe.staged_pieces_checked, want,
                    "dp={dp} rank {rank} step {t}"
                );
                checked += probe.staged_pieces_checked;
            }
        }
        assert!(checked > 0);
    }
}

// ---- 2b: staging after every zeroing, at every forced-sync site --------------------------------

/// Gap 2b (the staging buffer zeroed before the deferred all-gather: frozen Muon weights under
/// overlapped gather; the eval and paged-stash sites missed the re-stage, PR 4987): Muon +
/// MXFP8 (and the other formats) with overlapped gather, an eval after every step and a forced
/// sync after every step, trains the bits of the same run without them (train-only) and of the
/// OFF run with the same evals — eval losses included, so every eval read the latest weights.
/// The other overlap modes and eval-only schedules too.
#[test]
fn evals_and_forced_syncs_under_overlapped_gather_change_nothing() {
    for precision in LOW_PRECISIONS {
        for ((og, op), dp, optimizer, evals, force) in [
            (
                (true, true),
                2,
                OptimChoice::Muon(MuonRun::F32),
                EVERY_STEP,
                true,
            ),
            ((true, true), 4, HIDDEN, EVERY_STEP, true),
            (
                (true, true),
                3,
                OptimChoice::Muon(MuonRun::F32),
                &[0, 2, 3][..],
                false,
            ),
            ((true, true), 2, HIDDEN, &[][..], true),
            ((true, false), 2, HIDDEN, EVERY_STEP, true),
            (
                (false, false),
                2,
                OptimChoice::Muon(MuonRun::F32),
                EVERY_STEP,
                false,
            ),
        ] {
            let base = variant(
                Run {
                    precision,
                    ddp: ddp(true, og, op, Some(256)),
                    steps: 5,
                    optimizer,
                    ..Run::muon(dp)
                },
                true,
            );
            let what = format!(
                "{precision:?} ({og},{op}) dp={dp} evals={evals:?} force={force} {optimizer:?}"
            );
            let with = train(Run {
                eval_after: evals,
                force_sync_every_step: force,
                ..base
            });
            let off = train(Run {
                eval_after: evals,
                force_sync_every_step: force,
                ..variant(base, false)
            });
            let evals_run = evals.iter().filter(|&&s| s < base.steps).count();
            assert_eq!(with[0].eval_losses.len(), evals_run, "{what}");
            assert_same_trajectory(&with, &off, &format!("{what}: vs OFF"));
            let plain = train(base);
            let mut with = with;
            for o in &mut with {
                o.eval_losses.clear();
            }
            assert_same_trajectory(&with, &plain, &format!("{what}: vs train-only"));
        }
    }
}

// ---- 3a: per-bucket ownership ------------------------------------------------------------------

/// Gap 3a (mixed-owner bucket groups gathered by the wrong optimizer or twice, PR 4987), at the
/// protocol level: Muon (layer-wise) and AdamW (distributed) both own low-precision groups on
/// shared buffers. After the update every such group is stale; Muon's staging makes only its own
/// groups staged (AdamW's stay stale, their staging bytes untouched); a sync then is refused
/// whole — nothing is gathered, not even Muon's groups; once AdamW staged too, one sync gathers
/// every group exactly once, a second sync gathers nothing, and restaging + gathering again in
/// the same iteration is refused. Under overlapped gather the forward's lazy gather of a group
/// whose owner has not staged is refused while the other owner's group gathers.
#[test]
fn a_group_is_gathered_only_after_its_own_owner_staged() {
    for precision in LOW_PRECISIONS {
        for (dp, (og, op)) in [(2, (false, false)), (3, (false, false)), (2, (true, true))] {
            let run = variant(
                Run {
                    precision,
                    ddp: ddp(true, og, op, Some(256)),
                    optimizer: HIDDEN,
                    ..Run::muon(dp)
                },
                true,
            );
            let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
                let dev = &mut dev;
                let (mut bufs, mut opt) = until_update(&run, &mut comm, dev);
                let what = format!("{precision:?} dp={dp} ({og},{op}) rank {}", comm.rank());
                let groups = bufs.num_groups();
                let owner = |bufs: &DataParallelBuffers, g: usize| {
                    bufs.specs()[bufs.group_params(g)[0]].owner()
                };
                let low = |bufs: &DataParallelBuffers, g: usize| {
                    bufs.is_low_precision(bufs.group_params(g)[0])
                };
                let of = |o: u32| -> Vec<usize> {
                    (0..groups)
                        .filter(|&g| owner(&bufs, g) == OptimizerId(o) && low(&bufs, g))
                        .collect()
                };
                let (muon_groups, adamw_groups) = (of(0), of(1));
                assert!(
                    !muon_groups.is_empty() && !adamw_groups.is_empty(),
                    "{what}"
                );
                // Every group holds one owner's parameters only.
                for g in 0..groups {
                    let o = owner(&bufs, g);
                    assert!(
                        bufs.group_params(g)
                            .iter()
                            .all(|&p| bufs.specs()[p].owner() == o),
                        "{what}: group {g} mixes owners"
                    );
                }
                protocol::local_sum_squares(dev, &opt).unwrap();
                apply(dev, &mut bufs, &mut opt);
                for &g in muon_groups.iter().chain(&adamw_groups) {
                    assert_eq!(
                        bufs.weight_state(g),
                        WeightState::Stale,
                        "{what}: group {g}"
                    );
                }
                let adamw_region: Vec<Vec<u8>> = adamw_groups
                    .iter()
                    .flat_map(|&g| bufs.group_params(g).to_vec())
                    .map(|p| dev.read_bytes(bufs.param_view(p).unwrap()).unwrap())
                    .collect();
                // Muon stages: its groups only.
                protocol::stage(dev, &mut comm, &mut bufs, opt.parts()[0].as_ref(), false).unwrap();
                for &g in &muon_groups {
                    assert_eq!(bufs.weight_state(g), WeightState::Staged, "{what}: {g}");
                }
                for &g in &adamw_groups {
                    assert_eq!(bufs.weight_state(g), WeightState::Stale, "{what}: {g}");
                }
                let after: Vec<Vec<u8>> = adamw_groups
                    .iter()
                    .flat_map(|&g| bufs.group_params(g).to_vec())
                    .map(|p| dev.read_bytes(bufs.param_view(p).unwrap()).unwrap())
                    .collect();
                assert!(
                    after == adamw_region,
                    "{what}: Muon's stage wrote AdamW's region"
                );
                let gathers = comm.stats().all_gather.calls;
                if op {
                    // The forward's lazy gather: AdamW's group refused, Muon's gathered.
                    let err = bufs.finish_param_sync(dev, &mut comm, adamw_groups[0]);
                    assert!(
                        matches!(
                            err.map_err(|e| protocol_err(e.into())),
                            Err(ProtocolError::StaleWeights { .. })
                        ),
                        "{what}"
                    );
                    let g = muon_groups[0];
                    bufs.finish_param_sync(dev, &mut comm, g).unwrap();
                    assert_eq!(bufs.weight_state(g), WeightState::Current, "{what}");
                    // Its prefetch (the next group in forward order) is never a group whose
                    // owner has not staged.
                    let prefetched = bufs.param_gathers_in_flight();
                    assert!(
                        prefetched.iter().all(|g| !adamw_groups.contains(g)),
                        "{what}: prefetched {prefetched:?}"
                    );
                    bufs.complete_param_sync(dev).unwrap();
                } else {
                    let err = bufs.sync_params(dev, &mut comm).unwrap_err();
                    match protocol_err(err.into()) {
                        ProtocolError::StaleWeights { group } => {
                            assert!(adamw_groups.contains(&group), "{what}: group {group}")
                        }
                        other => panic!("{what}: {other}"),
                    }
                    assert_eq!(comm.stats().all_gather.calls, gathers, "{what}: gathered");
                    for &g in &muon_groups {
                        assert_eq!(bufs.weight_state(g), WeightState::Staged, "{what}: {g}");
                    }
                }
                // AdamW (and SGD) stage: now every group gathers, once.
                protocol::stage(dev, &mut comm, &mut bufs, opt.parts()[1].as_ref(), false).unwrap();
                bufs.sync_params(dev, &mut comm).unwrap();
                let gathered = comm.stats().all_gather.calls - gathers;
                for g in 0..groups {
                    assert_eq!(
                        bufs.param_sync_state(g),
                        ParamSyncState::Done,
                        "{what}: {g}"
                    );
                    if low(&bufs, g) {
                        assert_eq!(bufs.weight_state(g), WeightState::Current, "{what}: {g}");
                    }
                }
                let gathers = comm.stats().all_gather.calls;
                bufs.sync_params(dev, &mut comm).unwrap();
                assert_eq!(comm.stats().all_gather.calls, gathers, "{what}: regathered");
                protocol::stage(dev, &mut comm, &mut bufs, &opt, false).unwrap();
                let err = bufs.sync_params(dev, &mut comm).unwrap_err();
                assert!(
                    matches!(
                        protocol_err(err.into()),
                        ProtocolError::GatheredTwice { .. }
                    ),
                    "{what}"
                );
                (gathered, groups)
            });
            for r in results {
                let (gathered, groups) = r.unwrap();
                // One all-gather per group (each group is one bucket here), early or not.
                assert_eq!(gathered as usize, groups, "{precision:?} dp={dp}");
            }
        }
    }
}

/// Gap 3a over whole runs: per step every bucket group (Muon's layer-wise ones, AdamW's and
/// SGD's distributed ones, low precision or not) is gathered exactly once — counted as
/// all-gather launches and seen as states — and under overlapped gather every low-precision
/// group of both owners is staged before the first gather of the step starts.
#[test]
fn every_group_is_gathered_once_per_step_after_staging() {
    for precision in LOW_PRECISIONS {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for dp in [2, 4] {
                let run = variant(
                    Run {
                        precision,
                        ddp: ddp(true, og, op, Some(256)),
                        steps: 5,
                        optimizer: HIDDEN,
                        eval_after: &[2],
                        probe: true,
                        ..Run::muon(dp)
                    },
                    true,
                );
                let out = train(run);
                let what = format!("{precision:?} ({og},{op}) dp={dp}");
                for (rank, o) in out.iter().enumerate() {
                    let groups = o.groups.len() as u64;
                    let low: Vec<usize> = (0..o.groups.len()).filter(|&g| o.groups[g].1).collect();
                    let persistent = groups - low.len() as u64;
                    let owners_low: Vec<u32> = low.iter().map(|&g| o.groups[g].0).collect();
                    assert!(
                        owners_low.contains(&0) && owners_low.contains(&1),
                        "{what}: low-precision groups of both owners: {:?}",
                        o.groups
                    );
                    for (t, p) in o.probes.iter().enumerate() {
                        let w = format!("{what} rank {rank} step {t}");
                        let fresh = t == 0 || run.eval_after.contains(&(t - 1));
                        // The grad-norm exchange is the one other all-gather of a step.
                        if op {
                            let first = if t == 0 {
                                persistent
                            } else if fresh {
                                0
                            } else {
                                groups
                            };
                            // `begin` starts the first group's gather (the last group) when
                            // it holds staged low-precision weights; the forward the rest.
                            let last = o.groups.len() - 1;
                            let early = u64::from(!fresh && o.groups[last].1);
                            assert_eq!(p.all_gathers[..3], [early, first - early, 1], "{w}");
                            if !fresh {
                                for &g in &low {
                                    let sync = if g == last {
                                        ParamSyncState::InFlight
                                    } else {
                                        ParamSyncState::Idle
                                    };
                                    assert_eq!(
                                        p.after_begin[g],
                                        (WeightState::Staged, sync),
                                        "{w}: group {g} after begin"
                                    );
                                }
                            }
                            for &g in &low {
                                assert_eq!(p.after_step[g].0, WeightState::Stale, "{w}: {g}");
                            }
                        } else {
                            assert_eq!(p.all_gathers[..3], [0, 0, groups + 1], "{w}");
                            for &g in &low {
                                assert_eq!(p.after_step[g].0, WeightState::Current, "{w}: {g}");
                            }
                            assert!(
                                p.after_step.iter().all(|s| s.1 == ParamSyncState::Done),
                                "{w}: {:?}",
                                p.after_step
                            );
                        }
                        assert!(
                            p.after_microbatches
                                .iter()
                                .enumerate()
                                .all(|(g, s)| s.1 != ParamSyncState::InFlight
                                    && (!o.groups[g].1 || s.0 == WeightState::Current)),
                            "{w}: {:?}",
                            p.after_microbatches
                        );
                        let after = if run.eval_after.contains(&t) {
                            groups
                        } else {
                            0
                        };
                        assert_eq!(p.all_gathers[3], after, "{w}: forced sync");
                    }
                }
            }
        }
    }
}

/// The update as the driver runs it when nothing is pipelined: the step counted, every piece
/// updated, every owner's low-precision weights marked stale (the staging is left to the test).
fn apply(dev: &mut Device, bufs: &mut DataParallelBuffers, opt: &mut dyn Optimizer) {
    opt.begin_step();
    opt.update(dev, 1.0, UpdateScope::All).unwrap();
    for owner in opt.owners() {
        bufs.mark_stale(owner);
    }
}
