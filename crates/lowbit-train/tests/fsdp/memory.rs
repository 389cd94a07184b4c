//! Memory per strategy: the live buffers equal the closed form ([`lowbit_train::fsdp::estimate_memory`])
//! byte for byte, and the device's allocation peak during training steps, above what was
//! allocated before them, equals the closed-form transient bytes (communication buckets and
//! gathered units; the gradient norm's 16 bytes where there are none). Units of sharded parameters are
//! gathered at most two at a time with overlapped gathers (the one in use and the prefetched
//! one), one at a time without.

use crate::common;

use common::{DIMS, Setup, overlaps, train};
use lowbit_buffers::Overlap;
use lowbit_train::fsdp::{CommDtype, FineGrainedGather, MixedPrecisionPolicy, Sharding};

/// Bytes the step allocates besides the buffers' transients: the gradient norm's f64 per rank
/// (allocated after the transients are freed, so it shows only where there are none).
const NORM_BYTES: usize = 8;

#[test]
fn live_memory_equals_the_closed_form_and_bounds_the_peak() {
    for sharding in Sharding::ALL {
        for overlap in overlaps(sharding) {
            for comm in [CommDtype::MainGrads, CommDtype::Bf16] {
                let mut s = Setup::new(2, sharding);
                s.cfg = s
                    .cfg
                    .with_overlap(overlap)
                    .with_policy(MixedPrecisionPolicy::default().with_grad_comm_dtype(comm));
                let (_, m) = train(&s);
                let what = format!("{sharding}, {overlap:?}, comm {comm:?}");
                assert_eq!(m.live_persistent, m.estimate.persistent, "{what}");
                // The closed form is reached exactly (this model completes a unit's gradients
                // before it writes the next unit's, as the bound assumes).
                assert_eq!(
                    m.step_peak.max(NORM_BYTES * 2),
                    m.estimate.transient.max(NORM_BYTES * 2),
                    "{what}: measured peak vs the closed-form transient bytes"
                );
                eprintln!(
                    "{what}: persistent {} B, transient bound {} B, measured step peak {} B, \
                     units at once {}",
                    m.estimate.persistent, m.estimate.transient, m.step_peak, m.units_seen
                );
                let most = match (sharding, overlap) {
                    (Sharding::OptimGradsParams, Overlap::GradReduceAndParamGather) => 2,
                    (Sharding::OptimGradsParams, _) => 1,
                    _ => 0,
                };
                assert_eq!(m.units_seen, most, "{what}");
            }
        }
    }
}

/// MXFP8 and NVFP4 units of `optim_grads_params`: both copies or one (fine-grained) per unit; the peak
/// never exceeds the closed form, and the persistent weights are the rank's chunks only.
#[test]
fn mxfp8_units_stay_within_the_closed_form() {
    for (overlap, nvfp4) in overlaps(Sharding::OptimGradsParams)
        .into_iter()
        .flat_map(|o| [(o, false), (o, true)])
    {
        for fine in [FineGrainedGather::Off, FineGrainedGather::On] {
            if nvfp4 && fine == FineGrainedGather::On {
                continue;
            }
            let mut s = Setup::new(2, Sharding::OptimGradsParams);
            s.mxfp8_storage = true;
            s.nvfp4 = nvfp4;
            s.cfg = s.cfg.with_overlap(overlap).with_fine_grained(fine);
            let (_, m) = train(&s);
            let what = format!("{overlap:?}, {fine:?}, nvfp4 {nvfp4}");
            assert_eq!(m.live_persistent, m.estimate.persistent, "{what}");
            eprintln!(
                "low-precision units, {what}: persistent {} B, transient bound {} B, measured {} B",
                m.estimate.persistent, m.estimate.transient, m.step_peak
            );
            assert!(m.step_peak <= m.estimate.transient, "{what}: {m:?}");
        }
    }
}

/// Sharding gradients and parameters shrinks the persistent buffers as the strategy says:
/// gradients by `dp` under `optim_grads`, gradients and weights under `optim_grads_params`.
#[test]
fn sharding_shrinks_the_persistent_buffers() {
    let dp = 4;
    let bytes = |sharding| train(&Setup::new(dp, sharding)).1.estimate;
    let (optim, grads, params) = (
        bytes(Sharding::Optim),
        bytes(Sharding::OptimGrads),
        bytes(Sharding::OptimGradsParams),
    );
    let sum = |m: &lowbit_train::fsdp::FsdpMemory,
               f: fn(&lowbit_buffers::BufferMemory) -> usize| {
        m.buffers.iter().map(f).sum::<usize>()
    };
    assert_eq!(sum(&grads, |b| b.grads) * dp, sum(&optim, |b| b.grads));
    assert_eq!(sum(&grads, |b| b.weights), sum(&optim, |b| b.weights));
    assert_eq!(sum(&params, |b| b.weights) * dp, sum(&optim, |b| b.weights));
    assert_eq!(sum(&params, |b| b.grads), sum(&grads, |b| b.grads));
}

/// No gathered unit is live during an optimizer step (the units are released when the
/// gradients are synced, so none holds weights the step makes stale): right before every step
/// the live bytes are those before the first step, and the step itself allocates only its
/// gradient norm. Every strategy and overlap, bf16 and MXFP8/NVFP4 units; `optim_grads_params`
/// gathers units in every step, so a unit kept alive through the step shows here.
#[test]
fn no_gathered_unit_is_live_during_the_optimizer_step() {
    let mut runs = Vec::new();
    for sharding in Sharding::ALL {
        for overlap in overlaps(sharding) {
            let mut s = Setup::new(2, sharding);
            s.cfg = s.cfg.with_overlap(overlap);
            runs.push((s, format!("{sharding}, {overlap:?}")));
        }
    }
    for overlap in overlaps(Sharding::OptimGradsParams) {
        for nvfp4 in [false, true] {
            let mut s = Setup::new(2, Sharding::OptimGradsParams);
            s.cfg = s.cfg.with_overlap(overlap);
            (s.mxfp8_storage, s.nvfp4, s.steps) = (true, nvfp4, 2);
            runs.push((
                s,
                format!("low-precision units (nvfp4 {nvfp4}), {overlap:?}"),
            ));
        }
    }
    for (s, what) in runs {
        let (_, m) = train(&s);
        eprintln!(
            "{what}: live before a step +{} B, the step's own peak +{} B, units at once {}",
            m.live_at_step, m.step_only_peak, m.units_seen
        );
        assert_eq!(
            m.live_at_step, 0,
            "{what}: bytes live before the optimizer step"
        );
        assert_eq!(
            m.units_after_step, 0,
            "{what}: units gathered after the step"
        );
        // The step's own allocations: the gradient norm; with low-precision storage also the
        // bf16 copy of one owned piece that the staging quantizes from (a rank owns half of
        // a matrix here), freed before the next: less than a gathered unit of that matrix.
        let largest = DIMS.windows(2).map(|w| w[0] * w[1]).max().unwrap_or(0);
        let staging = if s.mxfp8_storage {
            2 * largest / s.dp
        } else {
            0
        };
        assert!(
            m.step_only_peak <= NORM_BYTES * 2 + staging,
            "{what}: the optimizer step allocated {} bytes",
            m.step_only_peak
        );
        if s.cfg.sharding == Sharding::OptimGradsParams {
            assert!(m.units_seen > 0, "{what}: no unit was ever gathered");
        }
    }
}
