//! Plan rules and protocol options that must not move a bit: the layer-wise rule (whole
//! parameters per rank) against the distributed rule, and unfused gradient accumulation against
//! fused, over precisions, gradient dtypes and overlap modes.

use lowbit_buffers::GradAccumulation;
use lowbit_buffers::layout::GradDType;
use lowbit_testkit::harness::{
    Precision, Run, assert_ranks_identical, assert_same_trajectory, bits, ddp, full_masters, train,
    variant,
};

const PRECISIONS: [Precision; 4] = [
    Precision::Bf16,
    Precision::Mxfp8,
    Precision::Nvfp4,
    Precision::Mxfp8Direct,
];

/// The layer-wise rule moves ownership, not arithmetic: every element is reduced in the same
/// rank order and updated by the same element-wise AdamW, so losses, reduced gradients, masters
/// and weights are bitwise those of the distributed rule. Only the grad norm's partial sums are
/// grouped differently (per-rank sums over other pieces), so it may differ in the last bits.
#[test]
fn layerwise_ownership_trains_the_same_bits_as_distributed() {
    for precision in PRECISIONS {
        for (og, op) in [(false, false), (true, true)] {
            for dp in [2, 3] {
                let base = variant(
                    Run {
                        precision,
                        ddp: ddp(true, og, op, Some(600)),
                        steps: 4,
                        ..Run::new(dp)
                    },
                    true,
                );
                let what = format!("{precision:?} dp={dp} overlap=({og},{op})");
                let layerwise = train(Run {
                    layerwise: true,
                    ..base
                });
                let distributed = train(base);
                assert_ranks_identical(&layerwise);
                assert_eq!(
                    bits(&layerwise[0].losses),
                    bits(&distributed[0].losses),
                    "{what}"
                );
                assert_eq!(
                    full_masters(&layerwise),
                    full_masters(&distributed),
                    "{what}"
                );
                assert_eq!(layerwise[0].weights, distributed[0].weights, "{what}");
                for (a, b) in layerwise[0].norms.iter().zip(&distributed[0].norms) {
                    assert!((a - b).abs() <= 1e-6 * b.abs(), "{what}: norm {a} vs {b}");
                }
                // Ownership really is whole parameters for owner 0 (the matrices): each matrix's
                // master lives on exactly one rank, in one piece.
                for p in [0, 2, 5, 8] {
                    let owners: Vec<usize> = layerwise
                        .iter()
                        .enumerate()
                        .filter(|(_, o)| o.masters.iter().any(|m| m.param == p))
                        .map(|(r, _)| r)
                        .collect();
                    assert_eq!(owners.len(), 1, "{what}: param {p} owned by {owners:?}");
                    let pieces = layerwise[owners[0]]
                        .masters
                        .iter()
                        .filter(|m| m.param == p)
                        .count();
                    assert_eq!(pieces, 1, "{what}: param {p} in {pieces} pieces");
                }
            }
        }
    }
}

/// Gradient-accumulation fusion (Megatron-LM PR #5464's axis): accumulating straight into the buffer or into
/// a per-parameter f32 gradient added when the parameter is ready gives the same bits, for every
/// precision, gradient dtype and overlap mode, with several microbatches.
#[test]
fn unfused_gradient_accumulation_gives_the_fused_bits() {
    for precision in PRECISIONS {
        for grad in [GradDType::F32, GradDType::Bf16] {
            for (og, op) in [(false, false), (true, false), (true, true)] {
                let base = variant(
                    Run {
                        precision,
                        grad,
                        microbatches: 3,
                        ddp: ddp(true, og, op, Some(500)),
                        steps: 3,
                        ..Run::new(2)
                    },
                    true,
                );
                let unfused = train(Run {
                    ddp: base.ddp.with_grad_accumulation(GradAccumulation::Unfused),
                    ..base
                });
                let fused = train(base);
                assert_same_trajectory(
                    &unfused,
                    &fused,
                    &format!("{precision:?} {grad:?} overlap=({og},{op})"),
                );
            }
        }
    }
}
