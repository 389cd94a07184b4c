//! Calls out of protocol order are refused with their typed [`ProtocolError`] variant, in every
//! build profile, and identically on every rank (so no rank is left waiting in a collective).
//! `Verify::Full` adds the checks that read memory (gradients zero at the first backward
//! access); `Verify::Cheap` skips exactly those.

use crate::common;

use common::{
    MXFP8, free_pieces, mxfp8_bytes, protocol_err, run, seed, solo, spec, stage_pieces, values,
};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    BufferError, ConfigError, DataParallelBuffers, DdpConfig, Overlap, ProtocolError, Verify,
    WeightState,
};
use lowbit_comm::{Communicator, LocalComm};
use lowbit_device::Device;

fn specs() -> Vec<ParamSpec> {
    let shapes: [&[usize]; 4] = [&[32, 64], &[64, 32], &[32, 96], &[96, 32]];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| spec(&format!("w{i}"), s, MXFP8, GradDType::F32))
        .collect()
}

fn masters() -> Vec<Vec<f32>> {
    specs()
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[p as u64, 9]), s.numel, 1.0))
        .collect()
}

fn cfg(overlap: Overlap, verify: Verify) -> DdpConfig {
    DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_overlap(overlap)
        .with_bucket_size(Some(2048))
        .with_verify(verify)
}

fn new_bufs(dev: &mut Device, comm: &LocalComm, cfg: DdpConfig) -> DataParallelBuffers {
    let dp = comm.size();
    let mut bufs = DataParallelBuffers::new(dev, dp, comm.rank(), specs(), cfg).unwrap();
    let m = masters();
    bufs.initialize_all(dev, |p| m[p].clone()).unwrap();
    bufs
}

fn stage(dev: &mut Device, comm: &mut LocalComm, bufs: &mut DataParallelBuffers) {
    let pieces = stage_pieces(dev, bufs, &masters());
    let r = bufs.stage(dev, comm, OptimizerId(0), &pieces);
    free_pieces(dev, pieces);
    r.unwrap();
}

/// Buffers with overlapped gathers (full verification) and `n` bucket groups, `n ≥ 3`, whose
/// weights were staged and whose forward's first pre-hook gathered group `n − 1` and started
/// the prefetch of `n − 2` (in flight); and `n`.
fn gather_in_flight(dev: &mut Device, comm: &mut LocalComm) -> (DataParallelBuffers, usize) {
    let overlap = Overlap::GradReduceAndParamGather;
    let mut bufs = new_bufs(dev, comm, cfg(overlap, Verify::Full));
    let n = bufs.num_groups();
    assert!(n >= 3, "{n} groups");
    bufs.zero_grad_buffer(dev).unwrap();
    bufs.mark_stale(OptimizerId(0));
    stage(dev, comm, &mut bufs);
    bufs.finish_param_sync(dev, comm, n - 1).unwrap();
    assert_eq!(bufs.param_gathers_in_flight(), vec![n - 2]);
    (bufs, n)
}

fn err(r: Result<(), BufferError>) -> ProtocolError {
    protocol_err(r.expect_err("the call must be refused"))
}

/// Stale weights (the optimizer stepped, nothing staged) refuse forwards and syncs; staged
/// weights survive a zeroing of the gradients, so they can never be gathered as zeros; a
/// backward refuses staged-but-ungathered weights; a second gather of a group in one iteration
/// is refused.
#[test]
fn staging_order_violations_are_refused() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut bufs = new_bufs(dev, &comm, cfg(Overlap::None, Verify::Full));
        let g = bufs.group_of(0);
        assert_eq!(bufs.weight_state(g), WeightState::Current);

        // Stale forward (bug class C).
        bufs.mark_stale(OptimizerId(0));
        assert!(bufs.has_stale(OptimizerId(0)));
        assert_eq!(
            err(bufs.finish_param_sync(dev, &mut comm, g)),
            ProtocolError::StaleWeights { group: g }
        );
        assert!(matches!(
            err(bufs.sync_params(dev, &mut comm)),
            ProtocolError::StaleWeights { .. }
        ));

        // Staged, then zeroed with the gradients (bugs A1/A3): the zeroing keeps the staged
        // values, so the gather ships them and not zeros (the weights are Q(bf16(masters)), as
        // initialized), while every other gradient byte, a backward's leftovers included, is
        // zeroed, and the gathered staging bytes are zeroed by the gather's completion.
        let before = mxfp8_bytes(dev, &bufs);
        assert!(before.iter().flatten().any(|&b| b != 0));
        bufs.zero_grad_buffer(dev).unwrap();
        let grads: Vec<_> = (0..specs().len())
            .map(|p| bufs.grad_view(p).unwrap())
            .collect();
        for &v in &grads {
            dev.fill(v, 1.0).unwrap();
        }
        stage(dev, &mut comm, &mut bufs);
        assert_eq!(bufs.weight_state(g), WeightState::Staged);
        bufs.zero_grad_buffer(dev).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Staged);
        bufs.sync_params(dev, &mut comm).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Current);
        assert_eq!(mxfp8_bytes(dev, &bufs), before);
        for &v in &grads {
            assert!(dev.read_bytes(v).unwrap().iter().all(|&b| b == 0));
        }
        bufs.zero_grad_buffer(dev).unwrap();

        // Staged but never gathered, then a backward (bug A2): the first gradient access of the
        // iteration refuses, naming the state.
        stage(dev, &mut comm, &mut bufs);
        assert!(matches!(
            err(bufs.accumulation_view(dev, 0).map(drop)),
            ProtocolError::BackwardBeforeGather {
                state: WeightState::Staged,
                ..
            }
        ));

        // Gathered once: fine. Staged again in the same iteration and gathered again: refused
        // (bug D's double sync).
        bufs.sync_params(dev, &mut comm).unwrap();
        assert_eq!(bufs.weight_state(g), WeightState::Current);
        stage(dev, &mut comm, &mut bufs);
        assert!(matches!(
            err(bufs.sync_params(dev, &mut comm)),
            ProtocolError::GatheredTwice { .. }
        ));
    });
}

/// While a prefetched gather is in flight, staging, finishing the gradient sync and resetting
/// the gather state are refused (bug F4). Zeroing the gradients is not: it keeps the bytes the
/// gather reads and writes, so the gathered weights are the staged ones, and the gather counts
/// as the coming iteration's (gathering its group again in it is refused).
#[test]
fn operations_during_a_gather_in_flight_are_refused() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let (mut bufs, n) = gather_in_flight(dev, &mut comm);
        let in_flight = |operation| ProtocolError::GatherInFlight {
            group: n - 2,
            operation,
        };
        let pieces = stage_pieces(dev, &bufs, &masters());
        let r = bufs.stage(dev, &mut comm, OptimizerId(0), &pieces);
        free_pieces(dev, pieces);
        assert_eq!(err(r), in_flight("staging"));
        assert_eq!(err(bufs.reset_param_sync()), in_flight("reset_param_sync"));
        assert_eq!(
            err(bufs.finish_grad_sync(dev, &mut comm)),
            in_flight("finish_grad_sync")
        );
        let before = mxfp8_bytes(dev, &bufs);
        bufs.zero_grad_buffer(dev).unwrap();
        assert_eq!(bufs.param_gathers_in_flight(), vec![n - 2]);
        // Completing the gather makes everything legal again.
        bufs.complete_param_sync(dev).unwrap();
        assert!(bufs.param_gathers_in_flight().is_empty());
        assert_eq!(mxfp8_bytes(dev, &bufs), before);
        stage(dev, &mut comm, &mut bufs);
        assert_eq!(
            err(bufs.sync_params(dev, &mut comm)),
            ProtocolError::GatheredTwice { group: n - 2 }
        );
    });
}

/// A communicator that is not the plan's group is refused at the first launch (bug F3): the
/// wrong size, or the right size with this rank's plan made for another rank.
#[test]
fn wrong_communicators_are_refused() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mut bufs = new_bufs(dev, &comm, cfg(Overlap::None, Verify::Full));
        let mut one = solo(&mut comm);
        bufs.zero_grad_buffer(dev).unwrap();
        assert_eq!(
            err(bufs.finish_grad_sync(dev, one.as_mut())),
            ProtocolError::WrongGroup {
                rank: 0,
                size: 1,
                plan_rank: rank,
                plan_size: 2,
            }
        );
        // The plan of the other rank.
        let mut other =
            DataParallelBuffers::new(dev, 2, 1 - rank, specs(), cfg(Overlap::None, Verify::Full))
                .unwrap();
        other.zero_grad_buffer(dev).unwrap();
        assert_eq!(
            err(other.finish_grad_sync(dev, &mut comm)),
            ProtocolError::WrongGroup {
                rank,
                size: 2,
                plan_rank: 1 - rank,
                plan_size: 2,
            }
        );
        // Staging through bf16 casts launches nothing; the gather checks the group.
        bufs.zero_grad_buffer(dev).unwrap();
        bufs.mark_stale(OptimizerId(0));
        let pieces = stage_pieces(dev, &bufs, &masters());
        bufs.stage(dev, one.as_mut(), OptimizerId(0), &pieces)
            .unwrap();
        free_pieces(dev, pieces);
        assert!(matches!(
            err(bufs.sync_params(dev, one.as_mut())),
            ProtocolError::WrongGroup { size: 1, .. }
        ));
    });
}

/// With overlapped reduction after the first batch, a group whose parameters did not all report
/// ready was never launched: the sync says so instead of reducing half-accumulated gradients.
/// Without overlap, grad-ready reports are refused.
#[test]
fn grad_ready_violations_are_refused() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut bufs = new_bufs(dev, &comm, cfg(Overlap::GradReduce, Verify::Full));
        let params = bufs.specs().len();
        for _batch in 0..2 {
            bufs.zero_grad_buffer(dev).unwrap();
            for p in (0..params).rev() {
                bufs.accumulation_view(dev, p).unwrap();
                bufs.register_grad_ready(dev, &mut comm, p).unwrap();
            }
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
        }
        // Parameter 0 (in the last group launched) never reports.
        bufs.zero_grad_buffer(dev).unwrap();
        for p in (1..params).rev() {
            bufs.accumulation_view(dev, p).unwrap();
            bufs.register_grad_ready(dev, &mut comm, p).unwrap();
        }
        let g0 = bufs.group_of(0);
        assert_eq!(
            err(bufs.finish_grad_sync(dev, &mut comm)),
            ProtocolError::GradReduceNotStarted { group: g0 }
        );

        let mut plain = new_bufs(dev, &comm, cfg(Overlap::None, Verify::Full));
        plain.zero_grad_buffer(dev).unwrap();
        assert_eq!(
            err(plain.register_grad_ready(dev, &mut comm, 0)),
            ProtocolError::GradReadyWithoutOverlap
        );
    });
}

/// `Verify::Full` refuses a backward that starts on non-zero gradients; `Verify::Cheap` does
/// not read memory, so it lets it through — and both refuse the cheap violations alike.
#[test]
fn full_verification_reads_memory_cheap_does_not() {
    for verify in [Verify::Full, Verify::Cheap] {
        run(2, |mut comm, mut dev| {
            let dev = &mut dev;
            let mut bufs = new_bufs(dev, &comm, cfg(Overlap::None, verify));
            bufs.zero_grad_buffer(dev).unwrap();
            let g = bufs.grad_view(3).unwrap();
            dev.fill(g, 1.0).unwrap();
            let r = bufs.accumulation_view(dev, 0).map(drop);
            match verify {
                Verify::Full => assert_eq!(err(r), ProtocolError::GradsNotZero),
                _ => r.unwrap(),
            }
            // Only the first access of an iteration checks.
            bufs.accumulation_view(dev, 1).unwrap();
            // The cheap checks run at both levels.
            bufs.mark_stale(OptimizerId(0));
            assert!(matches!(
                err(bufs.sync_params(dev, &mut comm)),
                ProtocolError::StaleWeights { .. }
            ));
        });
    }
}

/// Configurations that cannot work are refused before anything is allocated.
#[test]
fn impossible_configurations_are_refused() {
    let mut dev = Device::cpu();
    let before = dev.allocated_bytes();
    let replicated_gather = DdpConfig::default()
        .with_sharding(ShardingStrategy::Replicated)
        .with_overlap(Overlap::GradReduceAndParamGather);
    let specs_bf16: Vec<ParamSpec> = specs()
        .into_iter()
        .map(|mut s| {
            s.key.param_storage = lowbit_buffers::layout::ParamStorage::Bf16;
            s
        })
        .collect();
    let e = DataParallelBuffers::new(&mut dev, 2, 0, specs_bf16.clone(), replicated_gather)
        .unwrap_err();
    assert!(matches!(
        e,
        BufferError::Config(ConfigError::ParamGatherOverlapNeedsSharding)
    ));
    let e = DataParallelBuffers::new(
        &mut dev,
        2,
        0,
        specs_bf16.clone(),
        DdpConfig::default().with_bucket_size(Some(0)),
    )
    .unwrap_err();
    assert!(matches!(
        e,
        BufferError::Config(ConfigError::ZeroBucketSize)
    ));
    let e = DataParallelBuffers::new(&mut dev, 2, 2, specs_bf16, DdpConfig::default()).unwrap_err();
    assert!(matches!(
        e,
        BufferError::Config(ConfigError::RankOutOfRange { rank: 2, dp: 2 })
    ));
    assert!(matches!(
        Overlap::from_flags(false, true),
        Err(BufferError::Config(
            ConfigError::ParamGatherOverlapNeedsGradOverlap
        ))
    ));
    assert_eq!(dev.allocated_bytes(), before);
    let mut bufs = DataParallelBuffers::new(&mut dev, 1, 0, specs(), DdpConfig::default()).unwrap();
    let e = bufs.initialize(&mut dev, 0, &[1.0; 3]).unwrap_err();
    assert!(matches!(
        e,
        BufferError::Config(ConfigError::InitLength { .. })
    ));
    let e = bufs.initialize(&mut dev, 9, &[]).unwrap_err();
    assert!(matches!(
        e,
        BufferError::Config(ConfigError::NoSuchParam { param: 9, .. })
    ));
}

/// A refused call changes nothing: `finish_grad_sync` with a gather in flight must not reduce
/// (scale, reduce-scatter) the gradients of the groups before the one in flight. With staged
/// MXFP8 weights those gradient bytes alias other groups' staging views, which the gather in
/// flight writes when it completes.
#[test]
fn a_refused_finish_grad_sync_reduces_nothing() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let (mut bufs, n) = gather_in_flight(dev, &mut comm);
        // Gradients of the groups below the one in flight (written without the backward's
        // checks, which would refuse the staged groups).
        let low: Vec<usize> = (0..bufs.specs().len())
            .filter(|&p| bufs.group_of(p) < n - 2)
            .collect();
        assert!(!low.is_empty());
        for &p in &low {
            dev.fill(bufs.grad_view(p).unwrap(), 1.0).unwrap();
        }
        let before: Vec<Vec<u8>> = low
            .iter()
            .map(|&p| dev.read_bytes(bufs.grad_view(p).unwrap()).unwrap())
            .collect();
        assert!(bufs.finish_grad_sync(dev, &mut comm).is_err());
        let after: Vec<Vec<u8>> = low
            .iter()
            .map(|&p| dev.read_bytes(bufs.grad_view(p).unwrap()).unwrap())
            .collect();
        bufs.complete_param_sync(dev).unwrap();
        assert!(before == after, "the refused call reduced gradients");
    });
}

/// A forward between the gradient sync and the step would gather the persistent groups a
/// second time in the iteration (after the step each rank would then compute with the others'
/// old shards, the step's gather never coming): refused as every second gather is, on every
/// rank, before anything is launched.
#[test]
fn a_second_forward_before_the_step_is_refused() {
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let specs: Vec<ParamSpec> = specs()
            .into_iter()
            .map(|s| spec(&s.name, &s.shape, ParamStorage::Bf16, GradDType::F32))
            .collect();
        let overlap = Overlap::GradReduceAndParamGather;
        let cfg = cfg(overlap, Verify::Full);
        let mut bufs = DataParallelBuffers::new(dev, 2, comm.rank(), specs.clone(), cfg).unwrap();
        let m = masters();
        bufs.initialize_all(dev, |p| m[p].clone()).unwrap();
        let n = bufs.num_groups();
        bufs.zero_grad_buffer(dev).unwrap();
        for g in (0..n).rev() {
            bufs.finish_param_sync(dev, &mut comm, g).unwrap();
        }
        for p in (0..specs.len()).rev() {
            let v = bufs.accumulation_view(dev, p).unwrap();
            dev.fill(v, 1.0).unwrap();
            bufs.register_grad_ready(dev, &mut comm, p).unwrap();
        }
        bufs.finish_grad_sync(dev, &mut comm).unwrap();
        let gathers = comm.stats().all_gather.calls;
        assert_eq!(
            err(bufs.finish_param_sync(dev, &mut comm, n - 1)),
            ProtocolError::GatheredTwice { group: n - 1 }
        );
        assert_eq!(comm.stats().all_gather.calls, gathers, "nothing launched");
    });
}
