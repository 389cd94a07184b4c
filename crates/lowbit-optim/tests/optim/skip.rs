//! A step whose global gradient norm is not finite changes nothing: masters, moments, step
//! counts and weights stay bitwise as they were, the skip is counted, and the following steps
//! are exactly those of a run that never saw the poisoned batch (AdamW's bias correction reads
//! the step count, so a skip that still counted a step would show in every later master).

use crate::common;

use common::{
    BATCH, DIMS, MXFP8, buffers, init_values, master_bits, optimizer, run, specs, train_step,
    trainer, weight_bytes,
};
use lowbit_buffers::Overlap;
use lowbit_buffers::layout::{GradDType, ParamStorage};
use lowbit_comm::Communicator;
use lowbit_optim::OptimizerState;

use common::model::Mlp;

const POISONED: usize = 2;
const STEPS: usize = 5;

/// After one step: its report's (skipped, grad norm finite), the skipped count, the step count,
/// masters, exported state and weights.
#[derive(Debug, PartialEq)]
struct After {
    skipped: bool,
    norm_finite: bool,
    skipped_steps: u64,
    steps: u64,
    masters: Vec<(usize, usize, Vec<u32>)>,
    state: Vec<OptimizerState>,
    weights: Vec<Vec<u8>>,
}

/// Trains on the batches of `data_steps`, poisoning rank 1's input at data step `POISONED`
/// when `poison`.
fn train(data_steps: &[usize], poison: bool, storage: ParamStorage) -> Vec<Vec<After>> {
    let dp = 2;
    let specs = specs(storage, GradDType::F32, true);
    let init = init_values(&specs);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let bufs = buffers(dev, dp, comm.rank(), &specs, Overlap::GradReduce, &init);
        let opt = optimizer(dev, &bufs, &init, true);
        let mut trainer = trainer(dev, bufs, opt, storage != ParamStorage::Bf16);
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let mut out = Vec::new();
        for &s in data_steps {
            let poison_rank = (poison && s == POISONED).then_some(1);
            let report = train_step(dev, &mut comm, &mut trainer, &mlp, s, 2, poison_rank);
            out.push(After {
                skipped: report.skipped,
                norm_finite: report.grad_norm.is_finite(),
                skipped_steps: trainer.skipped_steps(),
                steps: trainer.optimizer().steps(),
                masters: master_bits(dev, trainer.optimizer()),
                state: trainer.optimizer().export_state(dev).unwrap(),
                weights: weight_bytes(dev, trainer.buffers()),
            });
        }
        trainer.into_parts(dev).unwrap();
        out
    })
}

fn check(storage: ParamStorage) {
    let all: Vec<usize> = (0..STEPS).collect();
    let without: Vec<usize> = all.iter().copied().filter(|&s| s != POISONED).collect();
    let poisoned = train(&all, true, storage);
    let clean = train(&without, false, storage);
    for (rank, (a, b)) in poisoned.iter().zip(&clean).enumerate() {
        let what = format!("{storage:?}, rank {rank}");
        // Before the poisoned step both runs are the same run.
        for s in 0..POISONED {
            assert!(a[s] == b[s], "{what}: step {s}");
            assert!(!a[s].skipped && a[s].norm_finite);
        }
        // The poisoned step is skipped, counted, and changes nothing at all.
        let (before, skipped) = (&a[POISONED - 1], &a[POISONED]);
        assert!(skipped.skipped, "{what}");
        assert!(!skipped.norm_finite, "{what}");
        assert_eq!(skipped.skipped_steps, 1, "{what}");
        assert_eq!(skipped.steps, before.steps, "{what}: the step count moved");
        assert!(skipped.masters == before.masters, "{what}: masters moved");
        assert!(
            skipped.state == before.state,
            "{what}: optimizer state moved"
        );
        assert!(skipped.weights == before.weights, "{what}: weights moved");
        // Every step after it is the clean run's step.
        for s in POISONED + 1..STEPS {
            let (x, y) = (&a[s], &b[s - 1]);
            assert!(!x.skipped, "{what}: step {s}");
            assert_eq!(x.steps, y.steps, "{what}: step {s}");
            assert!(x.masters == y.masters, "{what}: masters after step {s}");
            assert!(x.state == y.state, "{what}: state after step {s}");
            assert!(x.weights == y.weights, "{what}: weights after step {s}");
            assert_eq!(x.skipped_steps, 1, "{what}");
        }
        // The later steps moved the masters (the comparison above is not vacuous).
        assert!(a[STEPS - 1].masters != a[POISONED].masters, "{what}");
    }
}

#[test]
fn a_non_finite_middle_step_is_skipped_without_a_trace() {
    for storage in [ParamStorage::Bf16, MXFP8] {
        check(storage);
    }
}
