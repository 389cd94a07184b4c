//! The chained AdamW + SGD optimizer (AdamW owns the matrices, in low-precision storage; SGD
//! the biases and norms, persistent bf16) at the protocol level: each owner's staging touches
//! only its own bucket groups. The parity matrices compare bits only, and in a normal step both
//! owners stage before any gather, so a stage that marked or wrote another owner's groups would
//! pass them (at most a group gathered twice, with the same bits): here the owners stage one
//! at a time and every group's state, bytes and gathers are checked in between.

use lowbit_buffers::layout::OptimizerId;
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    BufferError, DataParallelBuffers, ParamSyncState, ProtocolError, WeightState,
};
use lowbit_comm::{Communicator, GroupConfig, LocalComm, run_ranks};
use lowbit_device::Device;
use lowbit_optim::{ChainedOptimizer, OptimError, Optimizer, UpdateScope};
use lowbit_testkit::harness;
use lowbit_testkit::harness::{LOW_PRECISIONS, Run, SHAPE, ddp, variant};
use lowbit_train::protocol;

fn protocol_err(e: OptimError) -> ProtocolError {
    match e {
        OptimError::Buffer(BufferError::Protocol(p)) => p,
        other => panic!("expected a protocol violation, got {other}"),
    }
}

/// Iteration 0 driven by hand up to the update: begin, deterministic gradients, reduction.
fn until_update(
    run: &Run,
    comm: &mut LocalComm,
    dev: &mut Device,
) -> (DataParallelBuffers, ChainedOptimizer) {
    let rank = comm.rank();
    let mut bufs = harness::buffers(run, dev, rank).unwrap();
    let opt = harness::optimizers(run, dev, &bufs, &SHAPE.init(11)).unwrap();
    protocol::begin_iteration(dev, comm, &mut bufs, &opt).unwrap();
    for (p, s) in bufs.specs().to_vec().iter().enumerate() {
        let v = bufs.accumulation_view(dev, p).unwrap();
        let g: Vec<f32> = (0..s.numel)
            .map(|i| ((p * 131 + i * 7 + rank * 3) % 97) as f32 * 1e-4 - 4.8e-3)
            .collect();
        dev.upload(v, &g).unwrap();
    }
    bufs.finish_grad_sync(dev, comm).unwrap();
    protocol::local_sum_squares(dev, &opt).unwrap();
    (bufs, opt)
}

/// The parameter bytes of `groups`.
fn bytes_of(dev: &Device, bufs: &DataParallelBuffers, groups: &[usize]) -> Vec<Vec<u8>> {
    groups
        .iter()
        .flat_map(|&g| bufs.group_params(g).to_vec())
        .map(|p| dev.read_bytes(bufs.param_view(p).unwrap()).unwrap())
        .collect()
}

/// After the update both owners' low-precision groups are stale. SGD's staging (its own
/// weights only, persistent) leaves AdamW's groups stale and their bytes untouched, and a
/// sync is then refused whole (nothing gathered); AdamW's staging leaves SGD's weights' bytes
/// untouched; then one sync gathers every group once and a second gathers nothing. The same
/// with AdamW staging first, and under overlapped gathers (the forward's gather of a group
/// whose owner has not staged is refused).
#[test]
fn each_owner_of_the_chain_stages_only_its_own_groups() {
    for precision in LOW_PRECISIONS {
        for (dp, op, sgd_first) in [(2, false, true), (3, false, false), (2, true, true)] {
            let run = variant(
                Run {
                    precision,
                    ddp: ddp(true, op, op, Some(256)),
                    chained: true,
                    param_gather: true,
                    ..Run::new(dp)
                },
                true,
            );
            let results = run_ranks(dp, GroupConfig::default(), |mut comm, mut dev| {
                let dev = &mut dev;
                let what = format!("{precision:?} dp={dp} op={op} rank {}", comm.rank());
                let (mut bufs, mut opt) = until_update(&run, &mut comm, dev);
                let groups = bufs.num_groups();
                let owners: Vec<OptimizerId> = (0..groups)
                    .map(|g| bufs.specs()[bufs.group_params(g)[0]].owner())
                    .collect();
                let lows: Vec<bool> = (0..groups)
                    .map(|g| bufs.is_low_precision(bufs.group_params(g)[0]))
                    .collect();
                let low = |g: usize| lows[g];
                let of = |o: u32| -> Vec<usize> {
                    (0..groups)
                        .filter(|&g| owners[g] == OptimizerId(o))
                        .collect()
                };
                let (adamw, sgd) = (of(0), of(1));
                assert!(!adamw.is_empty() && !sgd.is_empty(), "{what}");
                assert!(
                    adamw.iter().all(|&g| low(g)),
                    "{what}: AdamW's groups are low-precision"
                );
                assert!(
                    sgd.iter().all(|&g| !low(g)),
                    "{what}: SGD's groups are persistent"
                );
                opt.begin_step();
                opt.update(dev, 1.0, UpdateScope::All).unwrap();
                for o in opt.owners() {
                    bufs.mark_stale(o);
                }
                for &g in &adamw {
                    assert_eq!(bufs.weight_state(g), WeightState::Stale, "{what}: {g}");
                }
                let gathers = comm.stats().all_gather.calls;
                let (adamw_bytes, sgd_bytes) =
                    (bytes_of(dev, &bufs, &adamw), bytes_of(dev, &bufs, &sgd));
                let parts = opt.parts();
                let (first, second) = if sgd_first { (1, 0) } else { (0, 1) };
                protocol::stage(dev, &mut comm, &mut bufs, parts[first].as_ref(), false).unwrap();
                if sgd_first {
                    for &g in &adamw {
                        assert_eq!(
                            bufs.weight_state(g),
                            WeightState::Stale,
                            "{what}: SGD's stage changed AdamW's group {g}"
                        );
                    }
                    assert!(
                        bytes_of(dev, &bufs, &adamw) == adamw_bytes,
                        "{what}: SGD's stage wrote AdamW's weights"
                    );
                    if op {
                        let err = bufs.finish_param_sync(dev, &mut comm, adamw[0]);
                        assert!(
                            matches!(
                                err.map_err(|e| protocol_err(e.into())),
                                Err(ProtocolError::StaleWeights { .. })
                            ),
                            "{what}: a gather before AdamW staged"
                        );
                    } else {
                        match protocol_err(bufs.sync_params(dev, &mut comm).unwrap_err().into()) {
                            ProtocolError::StaleWeights { group } => {
                                assert!(adamw.contains(&group), "{what}: group {group}")
                            }
                            other => panic!("{what}: {other}"),
                        }
                    }
                    assert_eq!(comm.stats().all_gather.calls, gathers, "{what}: gathered");
                } else {
                    assert!(
                        bytes_of(dev, &bufs, &sgd) == sgd_bytes,
                        "{what}: AdamW's stage wrote SGD's weights"
                    );
                    for &g in &adamw {
                        assert_ne!(bufs.weight_state(g), WeightState::Stale, "{what}: {g}");
                    }
                }
                protocol::stage(dev, &mut comm, &mut bufs, parts[second].as_ref(), false).unwrap();
                let before = comm.stats().all_gather.calls;
                bufs.sync_params(dev, &mut comm).unwrap();
                let gathered = comm.stats().all_gather.calls - before;
                for g in 0..groups {
                    assert_eq!(
                        bufs.param_sync_state(g),
                        ParamSyncState::Done,
                        "{what}: {g}"
                    );
                    if low(g) {
                        assert_eq!(bufs.weight_state(g), WeightState::Current, "{what}: {g}");
                    }
                }
                let again = comm.stats().all_gather.calls;
                bufs.sync_params(dev, &mut comm).unwrap();
                assert_eq!(comm.stats().all_gather.calls, again, "{what}: regathered");
                (gathered, groups)
            });
            for r in results {
                let (gathered, groups) = r.unwrap();
                // At most one all-gather per group (early gathers under overlap started before
                // the counted sync).
                assert!(
                    gathered as usize <= groups,
                    "{precision:?} dp={dp} op={op}: {gathered}"
                );
            }
        }
    }
}
