//! Optimizer state: `export_state` → `import_state` into a fresh optimizer continues bit for bit
//! (a checkpoint resume at dp 2 with MXFP8 weights and overlapped gathers); state that does not
//! match (another owner, another rule, another shard layout, a wrong length, an owner the chain
//! does not hold) is refused with `InvalidInput::StateMismatch` and changes nothing.

use crate::common;

use std::sync::{Barrier, Mutex};

use common::model::Mlp;
use common::{
    BATCH, DIMS, MXFP8, assemble, buffers, ddp, init_values, leaf, master_bits, optimizer, run,
    specs, train_step, trainer, weight_bytes,
};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamStorage};
use lowbit_buffers::{DataParallelBuffers, Overlap};
use lowbit_comm::Communicator;
use lowbit_device::Device;
use lowbit_optim::{
    ChainedOptimizer, InvalidInput, MasterShard, OptimConfig, OptimError, Optimizer, OptimizerState,
};

fn is_mismatch(r: Result<(), OptimError>) -> bool {
    matches!(r, Err(OptimError::Invalid(InvalidInput::StateMismatch(_))))
}

/// A checkpoint after 3 steps (each rank's exported state, and the full masters as the
/// checkpoint's weights) resumed into fresh buffers and a fresh optimizer whose init callback
/// gives other values: the next 3 steps are bitwise those of the uninterrupted run.
#[test]
fn export_import_round_trip_continues_bit_for_bit() {
    let dp = 2;
    let specs = specs(MXFP8, GradDType::F32, true);
    let sizes: Vec<usize> = specs.iter().map(|s| s.numel).collect();
    let init = init_values(&specs);
    let checkpoint: Mutex<Vec<Vec<MasterShard>>> = Mutex::new(vec![Vec::new(); dp]);
    let barrier = Barrier::new(dp);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let make = |dev: &mut Device, weights: &[Vec<f32>], masters: &[Vec<f32>]| {
            let overlap = Overlap::GradReduceAndParamGather;
            let bufs = buffers(dev, dp, rank, &specs, overlap, weights);
            let opt = optimizer(dev, &bufs, masters, true);
            trainer(dev, bufs, opt, true)
        };
        let mlp = Mlp::new(dev, &DIMS, BATCH);
        let mut t1 = make(dev, &init, &init);
        for s in 0..3 {
            train_step(dev, &mut comm, &mut t1, &mlp, s, 2, None);
        }
        let state: Vec<OptimizerState> = t1.optimizer().export_state(dev).unwrap();
        assert_eq!(state.len(), 2);
        assert!(state.iter().all(|s| s.steps == 3));
        checkpoint.lock().unwrap()[rank] = t1.optimizer().masters(dev).unwrap();
        barrier.wait();
        let full = assemble(&sizes, &checkpoint.lock().unwrap());
        let other: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![0.5; n]).collect();
        let mut t2 = make(dev, &full, &other);
        assert!(master_bits(dev, t2.optimizer()) != master_bits(dev, t1.optimizer()));
        t2.optimizer_mut().import_state(dev, &state).unwrap();
        assert!(
            t2.optimizer().export_state(dev).unwrap() == state,
            "import did not restore"
        );
        assert_eq!(t2.optimizer().steps(), 3);
        for s in 3..6 {
            let r1 = train_step(dev, &mut comm, &mut t1, &mlp, s, 2, None);
            let r2 = train_step(dev, &mut comm, &mut t2, &mlp, s, 2, None);
            assert_eq!(r1.grad_norm.to_bits(), r2.grad_norm.to_bits(), "step {s}");
            assert!(
                master_bits(dev, t1.optimizer()) == master_bits(dev, t2.optimizer()),
                "masters after step {s}"
            );
            assert!(
                t1.optimizer().export_state(dev).unwrap()
                    == t2.optimizer().export_state(dev).unwrap(),
                "state after step {s}"
            );
        }
        t1.force_param_sync(dev, &mut comm).unwrap();
        t2.force_param_sync(dev, &mut comm).unwrap();
        assert!(
            weight_bytes(dev, t1.buffers()) == weight_bytes(dev, t2.buffers()),
            "weights"
        );
    });
}

/// Buffers of rank `rank` of 2 (no communicator needed: building optimizers and importing
/// state are local).
fn bufs(dev: &mut Device, rank: usize) -> DataParallelBuffers {
    let specs = specs(ParamStorage::Bf16, GradDType::F32, true);
    DataParallelBuffers::new(dev, 2, rank, specs, ddp(Overlap::None)).unwrap()
}

fn shifted(init: &[Vec<f32>], by: f32) -> Vec<Vec<f32>> {
    init.iter()
        .map(|v| v.iter().map(|x| x + by).collect())
        .collect()
}

#[test]
fn mismatched_state_is_refused_and_changes_nothing() {
    let mut dev = Device::cpu();
    let dev = &mut dev;
    let b0 = bufs(dev, 0);
    let b1 = bufs(dev, 1);
    let init = init_values(b0.specs());
    let cfg = OptimConfig::new(1e-2);
    let mut target = leaf(dev, &b0, 0, false, cfg, &init);
    let before = target.export_state(dev).unwrap();
    // Valid state with other values: the last tensor is what each mismatch breaks, so an import
    // that wrote before checking would show in the earlier tensors.
    let source = leaf(dev, &b0, 0, false, cfg, &shifted(&init, 1.0))
        .export_state(dev)
        .unwrap();
    assert!(source != before);
    let unchanged = |t: &lowbit_optim::DistributedOptimizer, dev: &Device, what: &str| {
        assert!(
            t.export_state(dev).unwrap() == before,
            "{what} changed the state"
        );
        assert_eq!(t.steps(), 0, "{what}");
    };

    let mut s = source.clone();
    s[0].owner = OptimizerId(7);
    assert!(is_mismatch(target.import_state(dev, &s)), "wrong owner");
    unchanged(&target, dev, "wrong owner");

    let sgd_state = leaf(dev, &b0, 0, true, cfg, &init)
        .export_state(dev)
        .unwrap();
    assert!(
        is_mismatch(target.import_state(dev, &sgd_state)),
        "wrong rule"
    );
    unchanged(&target, dev, "wrong rule");

    let other_rank = leaf(dev, &b1, 0, false, cfg, &init)
        .export_state(dev)
        .unwrap();
    assert_ne!(
        other_rank[0]
            .tensors
            .iter()
            .map(|t| (t.param, t.range.clone()))
            .collect::<Vec<_>>(),
        source[0]
            .tensors
            .iter()
            .map(|t| (t.param, t.range.clone()))
            .collect::<Vec<_>>()
    );
    assert!(
        is_mismatch(target.import_state(dev, &other_rank)),
        "other shard layout"
    );
    unchanged(&target, dev, "other shard layout");

    let mut s = source.clone();
    let last = s[0].tensors.last_mut().unwrap();
    last.range = last.range.start..last.range.end - 1;
    last.values.pop();
    assert!(
        is_mismatch(target.import_state(dev, &s)),
        "shifted last range"
    );
    unchanged(&target, dev, "shifted last range");

    let mut s = source.clone();
    s[0].tensors.last_mut().unwrap().values.push(0.0);
    assert!(is_mismatch(target.import_state(dev, &s)), "wrong length");
    unchanged(&target, dev, "wrong length");

    let mut s = source.clone();
    s[0].tensors.last_mut().unwrap().name = "exp_avg".into();
    assert!(
        is_mismatch(target.import_state(dev, &s)),
        "wrong tensor name"
    );
    unchanged(&target, dev, "wrong tensor name");

    let mut s = source.clone();
    s[0].tensors.pop();
    assert!(is_mismatch(target.import_state(dev, &s)), "missing tensor");
    unchanged(&target, dev, "missing tensor");

    // The valid state goes in.
    target.import_state(dev, &source).unwrap();
    assert!(
        target.export_state(dev).unwrap() == source,
        "the valid state did not go in"
    );
}

fn chain(dev: &mut Device, b: &DataParallelBuffers, init: &[Vec<f32>]) -> ChainedOptimizer {
    let cfg = OptimConfig::new(1e-2);
    ChainedOptimizer::new(vec![
        Box::new(leaf(dev, b, 0, false, cfg, init)),
        Box::new(leaf(dev, b, 1, true, cfg, init)),
    ])
    .unwrap()
}

/// A chain over rank 0's buffers, its state, and the (valid) state of a chain whose masters
/// are other values.
fn chain_and_states(
    dev: &mut Device,
) -> (ChainedOptimizer, Vec<OptimizerState>, Vec<OptimizerState>) {
    let b = bufs(dev, 0);
    let init = init_values(b.specs());
    let target = chain(dev, &b, &init);
    let before = target.export_state(dev).unwrap();
    let other = chain(dev, &b, &shifted(&init, 1.0))
        .export_state(dev)
        .unwrap();
    (target, before, other)
}

#[test]
fn a_chain_refuses_state_of_owners_it_does_not_hold() {
    let mut dev = Device::cpu();
    let dev = &mut dev;
    let (mut target, before, mut s) = chain_and_states(dev);
    let mut extra = s[1].clone();
    extra.owner = OptimizerId(9);
    s.push(extra);
    assert!(is_mismatch(target.import_state(dev, &s)));
    assert!(
        target.export_state(dev).unwrap() == before,
        "the state changed"
    );
    s.pop();
    target.import_state(dev, &s).unwrap();
    assert!(
        target.export_state(dev).unwrap() == s,
        "the valid state did not go in"
    );
}

/// A chain inside a chain (Muon's layer-wise chain beside AdamW, say) imports the outer
/// chain's state: each part is shown only its own owners' state, so the inner chain does not
/// refuse the other part's owners.
#[test]
fn a_nested_chain_imports_its_part_of_the_state() {
    let mut dev = Device::cpu();
    let dev = &mut dev;
    let b = bufs(dev, 0);
    let init = init_values(b.specs());
    let cfg = OptimConfig::new(1e-2);
    let nested = |dev: &mut Device, init: &[Vec<f32>]| {
        // Owner 2 holds no parameter here: an empty part, so that the inner chain's owners are
        // 0 and 2 and can be apart in a state ordered by owner.
        let inner = ChainedOptimizer::new(vec![
            Box::new(leaf(dev, &b, 0, false, cfg, init)),
            Box::new(leaf(dev, &b, 2, false, cfg, init)),
        ]);
        ChainedOptimizer::new(vec![
            Box::new(inner.unwrap()),
            Box::new(leaf(dev, &b, 1, true, cfg, init)),
        ])
        .unwrap()
    };
    let mut target = nested(dev, &init);
    let source = nested(dev, &shifted(&init, 1.0)).export_state(dev).unwrap();
    assert!(target.export_state(dev).unwrap() != source);
    target.import_state(dev, &source).unwrap();
    assert!(
        target.export_state(dev).unwrap() == source,
        "the nested chain's state did not go in"
    );
    // Ordered by owner (0, 1, 2), the inner chain's entries are no longer side by side: the
    // same state still goes in.
    let mut fresh = nested(dev, &init);
    let mut by_owner = source.clone();
    by_owner.sort_by_key(|s| s.owner.0);
    assert!(by_owner != source);
    fresh.import_state(dev, &by_owner).unwrap();
    assert!(
        fresh.export_state(dev).unwrap() == source,
        "the state ordered by owner did not go in"
    );
}

/// A chain whose first part accepts its state and whose second part refuses its own must change
/// nothing, like a leaf.
#[test]
fn a_chain_import_refused_by_one_part_changes_no_part() {
    let mut dev = Device::cpu();
    let dev = &mut dev;
    let (mut target, before, mut s) = chain_and_states(dev);
    s[1].rule = "adamw".into();
    assert!(is_mismatch(target.import_state(dev, &s)));
    assert!(
        target.export_state(dev).unwrap() == before,
        "a part changed"
    );
}

/// After `import_state`, a forced parameter sync should make every weight `bf16(master)` (or
/// `Q(bf16(master))`) of the imported masters, as its documentation promises ("restages every
/// owner's bf16(master)"). Low-precision weights are restaged; persistent bf16 weights are not,
/// because `DistributedOptimizer::stage` skips shards with a fused output, which only `apply`
/// writes.
#[test]
fn a_forced_sync_after_import_makes_persistent_weights_the_masters() {
    let dp = 2;
    let specs = specs(ParamStorage::Bf16, GradDType::F32, true);
    let init = init_values(&specs);
    let moved = shifted(&init, 1.0);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut b = buffers(dev, dp, comm.rank(), &specs, Overlap::None, &init);
        let mut opt = optimizer(dev, &b, &init, true);
        let state = {
            let other = optimizer(dev, &b, &moved, true);
            other.export_state(dev).unwrap()
        };
        opt.import_state(dev, &state).unwrap();
        lowbit_train::protocol::force_param_sync(dev, &mut comm, &mut b, &opt).unwrap();
        for m in opt.masters(dev).unwrap() {
            let got = common::download_f32(dev, b.param_view(m.param).unwrap());
            let want: Vec<f32> = m
                .values
                .iter()
                .map(|&x| lowbit_device::bf16::from_f32(x).to_f32())
                .collect();
            assert!(
                got[m.range.clone()] == want[..],
                "param {}: weights are not bf16 of the imported masters",
                m.param
            );
        }
    });
}
