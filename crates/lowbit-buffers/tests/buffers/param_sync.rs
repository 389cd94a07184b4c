//! The overlapped parameter gather: each forward pre-hook waits for its own bucket group and
//! prefetches the group the forward needs next. Groups are created in backward order (group 0
//! holds the last parameters), so the forward runs the groups down and the prefetch after the
//! hook of group `g` is exactly group `g - 1`; nothing is in flight after the last hook. The
//! gathered values are the owners' new values on every rank.

use crate::common;

use common::{
    MXFP8, bf16_round, bits, download_f32, free_pieces, mxfp8_bytes, run, seed, spec, stage_pieces,
    values, write_fused_outputs,
};
use lowbit_buffers::layout::{GradDType, OptimizerId, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{
    ComputeFormat, DataParallelBuffers, DdpConfig, DpHooks, HookMode, HookScratch, Hooks, Overlap,
    ParamCompute, ParamSyncState, PrecisionPolicy, Usage, Verify, WeightState,
};
use lowbit_comm::{Communicator, LocalComm};
use lowbit_device::Device;

fn specs(storage: ParamStorage) -> Vec<ParamSpec> {
    // Matrices with 32-multiple dimensions (MXFP8 blocks), each 1024–3072 elements, so that a
    // bucket of 2048 elements gives one group per one or two parameters.
    let shapes: [&[usize]; 6] = [
        &[32, 64],
        &[64, 32],
        &[32, 96],
        &[96, 32],
        &[64, 32],
        &[32, 32],
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| spec(&format!("w{i}"), s, storage, GradDType::F32))
        .collect()
}

fn cfg() -> DdpConfig {
    DdpConfig::default()
        .with_sharding(ShardingStrategy::Distributed)
        .with_overlap(Overlap::GradReduceAndParamGather)
        .with_bucket_size(Some(2048))
        .with_verify(Verify::Full)
}

fn new_values(specs: &[ParamSpec], iteration: usize) -> Vec<Vec<f32>> {
    specs
        .iter()
        .enumerate()
        .map(|(p, s)| values(seed(&[iteration as u64, p as u64, 77]), s.numel, 2.0))
        .collect()
}

/// The first parameter of group `g` in forward order: the one whose pre-hook runs the group's
/// gather.
fn first_in_forward(bufs: &DataParallelBuffers, g: usize) -> usize {
    *bufs.group_params(g).iter().min().unwrap()
}

/// A backward that writes ones into every gradient and reports each ready (bucket groups
/// complete in backward order), then the gradient sync.
fn backward(dev: &mut Device, comm: &mut LocalComm, bufs: &mut DataParallelBuffers) {
    for p in (0..bufs.specs().len()).rev() {
        let g = bufs.accumulation_view(dev, p).unwrap();
        dev.fill(g, 1.0).unwrap();
        bufs.register_grad_ready(dev, comm, p).unwrap();
    }
    bufs.finish_grad_sync(dev, comm).unwrap();
}

/// Asserts the groups are visited in descending order by a forward in parameter order, and
/// that there are several.
fn check_group_order(bufs: &DataParallelBuffers) {
    let n = bufs.num_groups();
    assert!(n >= 4, "{n} bucket groups");
    let forward: Vec<usize> = (0..bufs.specs().len()).map(|p| bufs.group_of(p)).collect();
    assert!(
        forward.windows(2).all(|w| w[0] >= w[1]),
        "groups in forward order: {forward:?}"
    );
    assert_eq!(forward[0], n - 1);
}

/// The forward pre-hooks of staged groups, in forward order: each group's gather completes,
/// the next one's is in flight after it (nothing after the last), and its weights are current.
fn forward_down_staged_groups(
    dev: &mut Device,
    comm: &mut LocalComm,
    bufs: &mut DataParallelBuffers,
) {
    for g in (0..bufs.num_groups()).rev() {
        assert_eq!(bufs.weight_state(g), WeightState::Staged);
        bufs.finish_param_sync(dev, comm, g).unwrap();
        let want: Vec<usize> = g.checked_sub(1).into_iter().collect();
        assert_eq!(bufs.param_gathers_in_flight(), want, "after group {g}");
        assert_eq!(bufs.weight_state(g), WeightState::Current);
        assert_eq!(bufs.param_sync_state(g), ParamSyncState::Done);
    }
}

/// bf16 parameters through `DpHooks::param` (the model-facing pre-hook), two iterations: the
/// forward of iteration 0 gathers the initial values, the one of iteration 1 the new ones.
#[test]
fn prefetch_runs_down_the_groups_through_the_hooks() {
    for dp in [2, 3] {
        let specs = specs(ParamStorage::Bf16);
        let init = new_values(&specs, 0);
        let results = run(dp, |mut comm, mut dev| {
            let dev = &mut dev;
            let rank = comm.rank();
            let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg()).unwrap();
            bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
            check_group_order(&bufs);
            let policy = PrecisionPolicy::as_stored(specs.len());
            let scratch = HookScratch::new(dev, &bufs);
            for iteration in 0..2 {
                bufs.zero_grad_buffer(dev).unwrap();
                {
                    let mut hooks =
                        DpHooks::new(&mut bufs, &mut comm, &policy, &scratch, HookMode::Train);
                    for p in 0..specs.len() {
                        hooks.param(dev, p, Usage::Forward).unwrap();
                        let b = hooks.buffers();
                        let g = b.group_of(p);
                        if p != first_in_forward(b, g) {
                            continue;
                        }
                        let want: Vec<usize> = g.checked_sub(1).into_iter().collect();
                        assert_eq!(
                            b.param_gathers_in_flight(),
                            want,
                            "dp {dp}, iteration {iteration}: after the pre-hook of group {g}"
                        );
                        assert_eq!(b.param_sync_state(g), ParamSyncState::Done);
                    }
                }
                assert!(bufs.param_gathers_in_flight().is_empty());
                backward(dev, &mut comm, &mut bufs);
                // The "optimizer": new values into the owned pieces' fused outputs.
                write_fused_outputs(dev, &bufs, &new_values(&specs, iteration + 1));
            }
            // One more forward gathers iteration 2's values; return what every rank sees.
            bufs.zero_grad_buffer(dev).unwrap();
            for g in (0..bufs.num_groups()).rev() {
                bufs.finish_param_sync(dev, &mut comm, g).unwrap();
            }
            scratch.free(dev).unwrap();
            (0..specs.len())
                .map(|p| {
                    let v = bufs.param_view(p).unwrap();
                    bits(&download_f32(dev, v))
                })
                .collect::<Vec<_>>()
        });
        let last = new_values(&specs, 2);
        for (rank, weights) in results.iter().enumerate() {
            for (p, w) in weights.iter().enumerate() {
                let want: Vec<f32> = last[p].iter().map(|&x| bf16_round(x)).collect();
                assert_eq!(*w, bits(&want), "dp {dp}, rank {rank}, param {p}");
            }
        }
    }
}

/// MXFP8 primary weights staged through bf16, driven by `finish_param_sync` directly: the same
/// prefetch order, and every group current once the forward is done.
#[test]
fn prefetch_runs_down_the_groups_with_staged_mxfp8() {
    let dp = 2;
    let specs = specs(MXFP8);
    let init = new_values(&specs, 0);
    run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg()).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        check_group_order(&bufs);
        let n = bufs.num_groups();
        // Iteration 0 needs no gather: the weights were written by `initialize`.
        bufs.zero_grad_buffer(dev).unwrap();
        for g in (0..n).rev() {
            bufs.finish_param_sync(dev, &mut comm, g).unwrap();
            assert!(bufs.param_gathers_in_flight().is_empty());
        }
        backward(dev, &mut comm, &mut bufs);
        bufs.mark_stale(OptimizerId(0));
        // Iteration 1: zero, stage, then the forward's gathers with prefetch.
        bufs.zero_grad_buffer(dev).unwrap();
        let pieces = stage_pieces(dev, &bufs, &new_values(&specs, 1));
        bufs.stage(dev, &mut comm, OptimizerId(0), &pieces).unwrap();
        free_pieces(dev, pieces);
        forward_down_staged_groups(dev, &mut comm, &mut bufs);
        // The hooks compute with the gathered weights; a forward through them works.
        let policy =
            PrecisionPolicy::new(vec![
                ParamCompute::new(ComputeFormat::Mxfp8 { two_d: false });
                specs.len()
            ]);
        let scratch = HookScratch::new(dev, &bufs);
        let mut hooks = DpHooks::new(&mut bufs, &mut comm, &policy, &scratch, HookMode::Train);
        for p in 0..specs.len() {
            hooks.param(dev, p, Usage::Forward).unwrap();
        }
        scratch.free(dev).unwrap();
    });
}

/// With overlapped gathers, staging casts the first group in forward order (the last group)
/// first and starts its gather at once; `zero_grads` then zeroes the gradients beside it (the
/// driver's `begin_iteration`).
/// The forward finds it in flight and runs down the groups as before, and the weights and
/// gradients come out as without overlap (zero, stage, gather everything), a backward's
/// leftover gradients zeroed. Persistent weights are not gathered early.
#[test]
fn staging_starts_the_first_gather_and_the_zeroing_runs_beside_it() {
    let dp = 2;
    let specs = specs(MXFP8);
    let init = new_values(&specs, 0);
    let results = run(dp, |mut comm, mut dev| {
        let dev = &mut dev;
        let rank = comm.rank();
        let mut out = Vec::new();
        for overlap in [Overlap::GradReduceAndParamGather, Overlap::GradReduce] {
            let cfg = cfg().with_overlap(overlap);
            let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg).unwrap();
            bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
            let n = bufs.num_groups();
            bufs.zero_grad_buffer(dev).unwrap();
            for g in (0..n).rev() {
                bufs.finish_param_sync(dev, &mut comm, g).unwrap();
            }
            backward(dev, &mut comm, &mut bufs);
            bufs.mark_stale(OptimizerId(0));
            let early = overlap == Overlap::GradReduceAndParamGather;
            if !early {
                bufs.zero_grad_buffer(dev).unwrap();
            }
            let pieces = stage_pieces(dev, &bufs, &new_values(&specs, 1));
            if early {
                // What the driver's `begin_iteration` does: reset, stage, then zero.
                bufs.reset_iteration(dev).unwrap();
                bufs.stage(dev, &mut comm, OptimizerId(0), &pieces).unwrap();
                assert_eq!(
                    bufs.param_gathers_in_flight(),
                    vec![n - 1],
                    "staging started it"
                );
                bufs.zero_grads(dev).unwrap();
                free_pieces(dev, pieces);
                assert_eq!(bufs.param_gathers_in_flight(), vec![n - 1]);
                forward_down_staged_groups(dev, &mut comm, &mut bufs);
            } else {
                bufs.stage(dev, &mut comm, OptimizerId(0), &pieces).unwrap();
                free_pieces(dev, pieces);
                assert!(bufs.param_gathers_in_flight().is_empty());
                bufs.sync_params(dev, &mut comm).unwrap();
            }
            // Full verification: every gradient byte is zero at the first backward access.
            bufs.accumulation_view(dev, 0).unwrap();
            out.push(mxfp8_bytes(dev, &bufs));
        }
        assert_eq!(out[0], out[1], "rank {rank}: early gather vs no overlap");
        // bf16 weights: no early gather (their forward gathers them).
        let specs = self::specs(ParamStorage::Bf16);
        let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg()).unwrap();
        bufs.initialize_all(dev, |p| init[p].clone()).unwrap();
        bufs.mark_stale(OptimizerId(0));
        let pieces = stage_pieces(dev, &bufs, &new_values(&specs, 1));
        bufs.reset_iteration(dev).unwrap();
        bufs.stage(dev, &mut comm, OptimizerId(0), &pieces).unwrap();
        bufs.zero_grads(dev).unwrap();
        free_pieces(dev, pieces);
        assert!(bufs.param_gathers_in_flight().is_empty());
        bufs.sync_params(dev, &mut comm).unwrap();
        out.swap_remove(0)
    });
    assert_eq!(results[0], results[1], "the ranks' weights differ");
}
