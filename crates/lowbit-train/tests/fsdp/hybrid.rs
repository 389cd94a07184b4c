//! Hybrid sharding: 4 ranks as 2 replica groups of 2 sharded ranks train what flat sharding
//! over 4 ranks trains, up to the order of the sum across ranks (`(a0 + a1) + (a2 + a3)` instead
//! of `((a0 + a1) + a2) + a3`): stated tolerance below; one replica group is flat sharding bit
//! for bit. The gradient norm is taken over the shard group (replicas are not counted twice).

use crate::common;

use common::{Ckpt, Setup, Trace, train, train_with};
use lowbit_dev_support::tempdir::TempDir;
use lowbit_train::fsdp::Sharding;

fn f32s(bits: &[u32]) -> Vec<f32> {
    bits.iter().map(|&b| f32::from_bits(b)).collect()
}

fn max_rel(a: &[u32], b: &[u32]) -> f32 {
    f32s(a)
        .into_iter()
        .zip(f32s(b))
        .filter(|(x, _)| x.abs() > 1e-3)
        .map(|(x, y)| ((x - y) / x).abs())
        .fold(0.0, f32::max)
}

fn run(sharding: Sharding, outer: usize) -> Trace {
    let mut s = Setup::new(4, sharding);
    s.cfg = s.cfg.with_outer_dp(outer);
    train(&s).0
}

#[test]
fn one_replica_group_is_flat_sharding_bit_for_bit() {
    for sharding in Sharding::ALL {
        let mut s = Setup::new(4, sharding);
        let flat = train(&s).0;
        s.cfg = s.cfg.with_outer_dp(1);
        assert_eq!(train(&s).0, flat, "{sharding}");
    }
}

/// Measured on this model after 4 steps: masters within 1.9e-6 relative of flat sharding
/// (every strategy), grad norms equal; bounds 1e-4 and 1e-5.
#[test]
fn two_replica_groups_match_flat_sharding_within_tolerance() {
    for sharding in Sharding::ALL {
        let flat = run(sharding, 1);
        let hybrid = run(sharding, 2);
        let masters = flat
            .masters
            .iter()
            .zip(&hybrid.masters)
            .map(|(a, b)| max_rel(a, b))
            .fold(0.0, f32::max);
        let norms = max_rel(&flat.norms, &hybrid.norms);
        eprintln!("{sharding}: 2x2 hybrid vs flat 4: masters {masters:e}, norms {norms:e}");
        assert!(masters < 1e-4, "{sharding}: masters {masters}");
        assert!(norms < 1e-5, "{sharding}: norms {norms}");
        // The norm is over the shard group: counting replicas twice would double its square.
        let (a, b) = (
            f32::from_bits(flat.norms[0]),
            f32::from_bits(hybrid.norms[0]),
        );
        assert!((a / b - 1.0).abs() < 1e-5, "{sharding}: {a} vs {b}");
    }
}

/// HFSDP (outer sharding `optim`, `optim_grads_params` inside): 2 replica groups of 2 ranks
/// split every bucket shard for the optimizer, so each rank updates a quarter, as 4 flat ranks
/// do; the result matches flat sharding within the same tolerance (the sum across ranks runs
/// in another order), the gradient norm sums over all ranks (replicas own different pieces:
/// leaving them out would shrink it), and with one replica group it is flat sharding bit for
/// bit.
#[test]
fn optimizer_state_sharded_across_replica_groups_matches_flat_sharding() {
    use lowbit_train::fsdp::OuterSharding;
    let setup = |outer: usize| {
        let mut s = Setup::new(4, Sharding::OptimGradsParams);
        s.cfg = s
            .cfg
            .with_outer_dp(outer)
            .with_outer_sharding(OuterSharding::Optim);
        s
    };
    let flat = run(Sharding::OptimGradsParams, 1);
    assert_eq!(train(&setup(1)).0, flat);
    for overlap in common::overlaps(Sharding::OptimGradsParams) {
        let mut s = setup(2);
        s.cfg = s.cfg.with_overlap(overlap);
        let hfsdp = train(&s).0;
        let masters = flat
            .masters
            .iter()
            .zip(&hfsdp.masters)
            .map(|(a, b)| max_rel(a, b))
            .fold(0.0, f32::max);
        let norms = max_rel(&flat.norms, &hfsdp.norms);
        eprintln!("HFSDP 2x2 vs flat 4, {overlap:?}: masters {masters:e}, norms {norms:e}");
        assert!(masters < 1e-4, "{overlap:?}: masters {masters}");
        assert!(norms < 1e-5, "{overlap:?}: norms {norms}");
    }
}

/// A resume under hybrid sharding is the straight run bit for bit: the checkpoint's masters
/// loaded, then a forced sync, which must refresh every replica's parameter shards (under
/// HFSDP each rank staged only its part of its shard: the parts of the other replica group
/// stay the initial values unless the replicas' parameters are marked stale and all-gathered).
/// Hybrid (one group writes the checkpoint) and HFSDP (every rank writes its pieces), every
/// overlap of `optim_grads_params`.
#[test]
fn hybrid_sharding_resumes_bit_for_bit() {
    use lowbit_train::fsdp::OuterSharding;
    let mut setups = Vec::new();
    for overlap in common::overlaps(Sharding::OptimGradsParams) {
        let mut s = Setup::new(4, Sharding::OptimGradsParams);
        s.cfg = s.cfg.with_outer_dp(2).with_overlap(overlap);
        setups.push((s, format!("hybrid 2x2, {overlap:?}")));
        s.cfg = s.cfg.with_outer_sharding(OuterSharding::Optim);
        setups.push((s, format!("HFSDP 2x2, {overlap:?}")));
    }
    let mut s = Setup::new(4, Sharding::Optim);
    s.cfg = s.cfg.with_outer_dp(2);
    setups.push((s, "hybrid 2x2, optim".into()));
    for (s, what) in setups {
        let dir = TempDir::new("fsdp-hybrid-resume");
        let straight = train_with(&s, Some(Ckpt::SaveAfter(dir.dir(), 2))).0;
        assert_eq!(straight, train(&s).0, "{what}: saving changed the run");
        let resumed = train_with(&s, Some(Ckpt::Resume(dir.dir()))).0;
        assert_eq!(
            resumed.losses,
            straight.losses[2..],
            "{what}: losses after the resume"
        );
        assert_eq!(
            resumed.norms,
            straight.norms[2..],
            "{what}: grad norms after the resume"
        );
        assert!(
            resumed.masters == straight.masters,
            "{what}: masters after the resume"
        );
    }
}
