//! Bitwise trajectory assertions and the parity matrices built on [`super::train`].

use super::*;

/// Every rank ends with the same weights and saw the same grad norms.
pub fn assert_ranks_identical(outcomes: &[Outcome]) {
    for o in &outcomes[1..] {
        assert_eq!(
            o.weights, outcomes[0].weights,
            "weights differ across ranks"
        );
        assert_eq!(
            bits(&o.norms),
            bits(&outcomes[0].norms),
            "grad norms differ across ranks"
        );
    }
}

/// Two runs are the same trajectory, bit for bit.
pub fn assert_same_trajectory(a: &[Outcome], b: &[Outcome], what: &str) {
    assert_same_from(a, 0, 0, b, what);
}

/// `b` is `a` from step `n + 1` on, bit for bit (`b` resumed from `a`'s checkpoint after step
/// `n`; `evals` of `a`'s eval losses came before it).
pub fn assert_same_from(a: &[Outcome], n: usize, evals: usize, b: &[Outcome], what: &str) {
    assert_eq!(a.len(), b.len());
    assert_eq!(
        bits(&a[0].losses[n..]),
        bits(&b[0].losses),
        "{what}: losses"
    );
    assert_eq!(
        bits(&a[0].eval_losses[evals..]),
        bits(&b[0].eval_losses),
        "{what}: eval losses"
    );
    assert_eq!(
        bits(&a[0].norms[n..]),
        bits(&b[0].norms),
        "{what}: grad norms"
    );
    for step in 0..b[0].grads.len() {
        let (ga, gb) = (full_grads(a, n + step), full_grads(b, step));
        for (p, (x, y)) in ga.iter().zip(&gb).enumerate() {
            assert_eq!(
                bits(x),
                bits(y),
                "{what}: reduced gradient of param {p} at step {step}"
            );
        }
    }
    let (ma, mb) = (full_masters(a), full_masters(b));
    for (p, (x, y)) in ma.iter().zip(&mb).enumerate() {
        assert_eq!(bits(x), bits(y), "{what}: masters of param {p}");
    }
    assert_eq!(a[0].weights, b[0].weights, "{what}: weights");
}

/// The run with low-precision gather on or off, everything else equal. For bf16 "off" is
/// classic DDP (all-reduce, every rank updates everything, nothing gathered).
pub fn variant(base: Run, gather: bool) -> Run {
    match (base.precision, gather) {
        (Precision::Mxfp8 | Precision::Nvfp4, on) => Run {
            param_gather: on,
            ..base
        },
        (Precision::Mxfp8Direct, on) => Run {
            param_gather: on,
            ddp: base.ddp.with_mxfp8_gather(if on {
                Mxfp8Gather::Direct2d
            } else {
                Mxfp8Gather::Bf16Staging
            }),
            ..base
        },
        (Precision::Bf16, true) => base,
        (Precision::Bf16, false) => Run {
            ddp: ddp(
                false,
                base.ddp.overlap.grad_reduce(),
                false,
                base.ddp.bucket_size,
            ),
            ..base
        },
    }
}

/// A parity-matrix case on `base`: `steps` steps of 3 microbatches, the rows per rank shrinking
/// with the ranks, on `device` with `ddp`.
pub fn matrix_case(base: Run, steps: usize, device: TestDevice, ddp: DdpConfig) -> Run {
    let dp = base.dp;
    Run {
        steps,
        microbatches: 3,
        rows: 8 / dp.min(4) + 1,
        ddp,
        device,
        ..base
    }
}

/// The ON run (with `fusion` as its gradient accumulation) and the OFF run of `base`, each
/// checked to be identical across its ranks.
pub fn train_on_off(base: Run, fusion: GradAccumulation) -> (Vec<Outcome>, Vec<Outcome>) {
    let on_run = variant(base, true);
    let on = train(Run {
        ddp: on_run.ddp.with_grad_accumulation(fusion),
        ..on_run
    });
    let off = train(variant(base, false));
    assert_ranks_identical(&on);
    assert_ranks_identical(&off);
    (on, off)
}

/// Compares everything but the masters' sharding (classic DDP holds whole masters).
pub fn assert_parity(on: &[Outcome], off: &[Outcome], what: &str) {
    assert_same_trajectory(on, off, what);
}

/// Two runs whose gradient reductions differ in order only (NCCL all-reduce against
/// reduce-scatter across 3+ ranks): the same trajectory up to rounding, losses and grad norms
/// within a relative 1e-4.
pub fn assert_close_trajectory(a: &[Outcome], b: &[Outcome], what: &str) {
    let close = |x: f32, y: f32| (x - y).abs() <= 1e-4 * x.abs().max(y.abs()).max(1e-6);
    for (name, xs, ys) in [
        ("losses", &a[0].losses, &b[0].losses),
        ("grad norms", &a[0].norms, &b[0].norms),
    ] {
        assert_eq!(xs.len(), ys.len(), "{what}: {name}");
        for (i, (&x, &y)) in xs.iter().zip(ys.iter()).enumerate() {
            assert!(close(x, y), "{what}: {name}[{i}] {x} vs {y} beyond 1e-4");
        }
    }
}

/// The ON/OFF parity matrix over precisions, overlap, gradient dtype, buckets and the data-parallel
/// sizes `dps`: every pair must train to the same bits. Returns the number of pairs.
///
/// One exception, on CUDA only: bf16 "OFF" is classic DDP (all-reduce over an unpadded bucket)
/// and "ON" the distributed optimizer (reduce-scatter over a padded one). With 3 or more ranks
/// NCCL sums those in different orders, so that pair is held to [`assert_close_trajectory`];
/// every low-precision pair (reduce-scatter on both sides) stays bitwise at any size.
pub fn parity_matrix(
    dps: &[usize],
    steps: usize,
    device: TestDevice,
    grads: &[GradDType],
    buckets: &[Option<usize>],
) -> usize {
    let mut cases = 0;
    for precision in [
        Precision::Bf16,
        Precision::Mxfp8,
        Precision::Nvfp4,
        Precision::Mxfp8Direct,
    ] {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for &grad in grads {
                for &bucket in buckets {
                    for &dp in dps {
                        let base = Run {
                            precision,
                            grad,
                            ..matrix_case(Run::new(dp), steps, device, ddp(true, og, op, bucket))
                        };
                        let what = format!(
                            "{precision:?} dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?} \
                             case={cases}"
                        );
                        // Gradient-accumulation fusion is an axis of the ON side: fused and
                        // unfused accumulation must give the OFF run's bits alike.
                        let fusion = if cases % 2 == 0 {
                            GradAccumulation::Fused
                        } else {
                            GradAccumulation::Unfused
                        };
                        let (on, off) = train_on_off(base, fusion);
                        if precision == Precision::Bf16 && !on[0].masters.is_empty() {
                            // Classic DDP vs distributed optimizer: masters are sharded
                            // differently but assemble to the same values.
                            assert_eq!(full_masters(&on).len(), full_masters(&off).len());
                        }
                        // The ON run really has low-precision primary weights (all 4 matrices).
                        let expect_low = if precision == Precision::Bf16 { 0 } else { 4 };
                        assert_eq!(on[0].low_precision_params, expect_low, "{what}");
                        assert_eq!(off[0].low_precision_params, 0, "{what}");
                        if device == TestDevice::Cuda && precision == Precision::Bf16 && dp >= 3 {
                            assert_close_trajectory(&on, &off, &what);
                            eprintln!(
                                "{what}: within 1e-4, not bitwise (NCCL all-reduce vs reduce-scatter)"
                            );
                        } else {
                            assert_parity(&on, &off, &what);
                        }
                        cases += 1;
                    }
                }
            }
        }
    }
    cases
}

/// The low-precision precisions Muon's parity runs over.
pub const LOW_PRECISIONS: [Precision; 3] =
    [Precision::Mxfp8, Precision::Mxfp8Direct, Precision::Nvfp4];

/// Muon's ON/OFF parity matrix: Muon (layer-wise, f32 Newton–Schulz) chained with distributed
/// AdamW and SGD, low-precision parameter gather on against bf16 parameters quantized on the fly,
/// over the low-precision formats, every overlap mode, `buckets` and the data-parallel sizes
/// `dps`. Rotating through the cases: fused and unfused gradient accumulation on the ON side,
/// f32 and bf16 gradients, Muon on every matrix or on the hidden ones only (then the input and
/// output matrices are AdamW's, in low precision too, and at dp 4 two ranks own no Muon matrix).
/// Every pair must train to the same bits. Returns the number of pairs.
pub fn muon_parity_matrix(
    dps: &[usize],
    steps: usize,
    device: TestDevice,
    buckets: &[Option<usize>],
) -> usize {
    let mut cases = 0;
    for precision in LOW_PRECISIONS {
        for (og, op) in [(false, false), (true, false), (true, true)] {
            for &bucket in buckets {
                for &dp in dps {
                    // A rotation that does not tie an axis to a dp.
                    let k = cases + cases / dps.len().max(1);
                    let fusion = if k.is_multiple_of(2) {
                        GradAccumulation::Fused
                    } else {
                        GradAccumulation::Unfused
                    };
                    let hidden_only = (k / 2) % 2 == 1;
                    let grad = if (k / 3).is_multiple_of(2) {
                        GradDType::F32
                    } else {
                        GradDType::Bf16
                    };
                    let base = Run {
                        precision,
                        grad,
                        optimizer: OptimChoice::Muon(MuonRun {
                            hidden_only,
                            ..MuonRun::F32
                        }),
                        ..matrix_case(Run::muon(dp), steps, device, ddp(true, og, op, bucket))
                    };
                    let what = format!(
                        "Muon {precision:?} dp={dp} {grad:?} overlap=({og},{op}) bucket={bucket:?} \
                         {fusion:?} hidden_only={hidden_only} case={cases}"
                    );
                    let (on, off) = train_on_off(base, fusion);
                    assert_eq!(on[0].low_precision_params, 4, "{what}");
                    assert_eq!(off[0].low_precision_params, 0, "{what}");
                    assert_parity(&on, &off, &what);
                    cases += 1;
                }
            }
        }
    }
    cases
}
