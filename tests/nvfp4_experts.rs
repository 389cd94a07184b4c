//! `lowbit train --precision nvfp4` with grouped expert weights (`[experts, out, in]`) in NVFP4
//! primary storage, one global amax per expert (Megatron-LM PR #5464): at 1 to 4 ranks, with buckets whose
//! shards cut through experts, the four ways to compute the same arithmetic train to the same
//! bits — grouped with the gather on (packed NVFP4 storage) and off (bf16 weights quantized
//! expert by expert on the fly), and discrete per-expert weights with the gather on and off:
//! per-step losses, grad norms, evals and the final fp32 masters. Widths whose tiles or blocks
//! would straddle experts are refused up front.

use lowbit::buffers::layout::{ParamStorage, QuantKind};
use lowbit::train::{Precision, TrainConfig, TrainError, TrainReport, train};

/// A short NVFP4 run on `ranks` ranks: 96 samples a step over 2 microbatches, buckets of 5000
/// elements (an expert tensor is 4 experts of 4096), evals after steps 2 and 4.
fn run(ranks: usize, grouped: bool, param_gather: bool) -> TrainReport {
    let mut cfg = TrainConfig {
        ranks,
        precision: Precision::Nvfp4,
        param_gather,
        batch: 96,
        steps: 4,
        eval_every: 2,
        eval_samples: 512,
        bucket_size: Some(5000),
        ..TrainConfig::default()
    };
    cfg.shape.grouped = grouped;
    train(&cfg, &|_| {}).unwrap_or_else(|e| panic!("{ranks} ranks, grouped {grouped}: {e}"))
}

/// Loss bits, grad-norm bits, `(step, eval loss bits)`, master checksum.
type Trajectory = (Vec<u32>, Vec<u32>, Vec<(usize, u32)>, u64);

/// What must be identical, bit for bit, between runs of the same arithmetic.
fn trajectory(r: &TrainReport) -> Trajectory {
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let evals = r.evals.iter().map(|&(s, l)| (s, l.to_bits())).collect();
    (
        bits(&r.losses),
        bits(&r.grad_norms),
        evals,
        r.master_checksum,
    )
}

/// This rank's NVFP4 buffers: padded elements, and bytes outside the packed region (scales,
/// columnwise copies, tile amaxes: per parameter, not padded).
fn nvfp4_buffers(r: &TrainReport) -> (usize, usize) {
    let nvfp4 = ParamStorage::Quantized(QuantKind::Nvfp4);
    let bufs = r.memory.buffers.iter();
    bufs.filter(|b| b.key.param_storage == nvfp4)
        .fold((0, 0), |(n, o), b| {
            (n + b.numel, o + b.weights - b.numel / 2)
        })
}

#[test]
fn grouped_and_discrete_experts_with_the_gather_on_and_off_train_to_the_same_bits() {
    for ranks in 1..=4 {
        let on = run(ranks, true, true);
        let expert_elements: usize = (on.owners.iter())
            .filter(|o| o.shape.len() == 3)
            .map(|o| o.shape.iter().product::<usize>())
            .sum();
        assert!(expert_elements > 0, "the default model has grouped experts");
        // The grouped experts are NVFP4 primary weights now, as discrete ones are.
        let discrete_on = run(ranks, false, true);
        assert!(nvfp4_buffers(&on).0 >= expert_elements, "{ranks} ranks");
        assert_eq!(
            nvfp4_buffers(&on).1,
            nvfp4_buffers(&discrete_on).1,
            "{ranks} ranks: an expert holds the bytes of a matrix of its own"
        );
        if ranks > 1 {
            // Expert tensors are split across ranks (shards of 5000-element buckets cut them).
            let split = on.owners.iter().filter(|o| o.shape.len() == 3);
            assert!(split.clone().all(|o| o.ranks.len() > 1), "{ranks} ranks");
        }
        let want = trajectory(&on);
        let others = [
            ("grouped, gather off", run(ranks, true, false)),
            ("discrete, gather on", discrete_on),
            ("discrete, gather off", run(ranks, false, false)),
        ];
        for (what, r) in &others {
            let got = trajectory(r);
            assert_eq!(got.0, want.0, "{ranks} ranks, {what}: losses");
            assert_eq!(got.1, want.1, "{ranks} ranks, {what}: grad norms");
            assert_eq!(got.2, want.2, "{ranks} ranks, {what}: evals");
            assert_eq!(got.3, want.3, "{ranks} ranks, {what}: final masters");
        }
        assert_eq!(nvfp4_buffers(&others[0].1).0, 0, "gather off: bf16 storage");
    }
}

#[test]
fn expert_widths_whose_tiles_would_straddle_experts_are_refused() {
    let mut cfg = TrainConfig {
        precision: Precision::Nvfp4,
        steps: 1,
        ..TrainConfig::default()
    };
    cfg.shape.expert_ffn = 48;
    match train(&cfg, &|_| {}) {
        Err(TrainError::Invalid(m)) => assert!(m.contains("straddle experts"), "{m}"),
        other => panic!(
            "expected a refusal, got {:?}",
            other.map(|r| r.master_checksum)
        ),
    }
}
