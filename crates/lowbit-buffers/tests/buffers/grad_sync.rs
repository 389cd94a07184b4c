//! Gradient reduction is exact: after `finish_grad_sync` every owned element equals the value a
//! host computes in the same f32 order — each rank's gradient rounded to the gradient dtype,
//! pre-scaled by `fl32(1/dp)` (one rounding to the dtype), then summed in rank order in f32 and
//! rounded once (`GradScaling::PreDivide`); or summed in rank order, divided by `dp` in f32 and
//! rounded once (`GradScaling::AverageInCollective`). With overlapped reduction the golden
//! counts come from the first batch, and the second batch launches every bucket group from its
//! grad-ready reports, in backward order, during the "backward"; `finish_grad_sync_except` completes
//! them in stages (none, then the first launched, then all but the last launched).

use crate::common;

use common::{add_into, assert_same_bits, bits, download_f32, round_to, run, seed, spec, values};
use lowbit_buffers::layout::{GradDType, ParamSpec, ParamStorage, ShardingStrategy};
use lowbit_buffers::protocol::StepProtocol;
use lowbit_buffers::{DataParallelBuffers, DdpConfig, GradScaling, Overlap, Verify};

/// Elements per bucket: small enough for several bucket groups at every dp.
const BUCKET: usize = 1500;

fn specs(grad: GradDType) -> Vec<ParamSpec> {
    let shapes: [&[usize]; 7] = [
        &[64, 48],
        &[48],
        &[32, 64],
        &[64],
        &[96, 32],
        &[17],
        &[40, 8],
    ];
    shapes
        .iter()
        .enumerate()
        .map(|(i, s)| spec(&format!("p{i}"), s, ParamStorage::Bf16, grad))
        .collect()
}

/// Rank `rank`'s gradient of parameter `p` in batch `batch`, with magnitudes spread over seven
/// binades so that additions round.
fn grad_values(batch: usize, rank: usize, p: usize, n: usize) -> Vec<f32> {
    values(seed(&[batch as u64, rank as u64, p as u64]), n, 1.0)
        .into_iter()
        .enumerate()
        .map(|(i, v)| v * (1u32 << (i % 7)) as f32)
        .collect()
}

/// The reduced value of element `i` of parameter `p`, computed on the host in the buffers'
/// order.
fn expected(
    dp: usize,
    batch: usize,
    p: usize,
    n: usize,
    grad: GradDType,
    scaling: GradScaling,
) -> Vec<f32> {
    let per_rank: Vec<Vec<f32>> = (0..dp)
        .map(|r| {
            grad_values(batch, r, p, n)
                .into_iter()
                .map(|v| round_to(grad, v))
                .collect()
        })
        .collect();
    let inv = 1.0 / dp as f32;
    (0..n)
        .map(|i| {
            let term = |r: usize| match scaling {
                GradScaling::AverageInCollective => per_rank[r][i],
                _ => round_to(grad, per_rank[r][i] * inv),
            };
            let mut acc = term(0);
            for r in 1..dp {
                acc += term(r);
            }
            if scaling == GradScaling::AverageInCollective {
                acc /= dp as f32;
            }
            round_to(grad, acc)
        })
        .collect()
}

/// Runs two batches at `dp` ranks, checks every owned element after each gradient sync, and
/// that the owned elements of all ranks cover every parameter element once per owner.
fn check(
    dp: usize,
    sharding: ShardingStrategy,
    overlap: Overlap,
    scaling: GradScaling,
    grad: GradDType,
) {
    let what = format!("dp {dp}, {sharding:?}, {overlap:?}, {scaling:?}, {grad:?}");
    let checked = run(dp, |mut comm, mut dev| {
        let rank = lowbit_comm::Communicator::rank(&comm);
        let dev = &mut dev;
        let cfg = DdpConfig::default()
            .with_sharding(sharding)
            .with_overlap(overlap)
            .with_scaling(scaling)
            .with_bucket_size(Some(BUCKET))
            .with_verify(Verify::Full);
        let specs = specs(grad);
        let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg).unwrap();
        if overlap.grad_reduce() {
            assert!(
                bufs.num_groups() >= 3,
                "{what}: {} groups",
                bufs.num_groups()
            );
        }
        let mut checked = [0usize; 2];
        for (batch, count) in checked.iter_mut().enumerate() {
            bufs.zero_grad_buffer(dev).unwrap();
            // The "backward": parameters in reverse order, each reported ready when written.
            for p in (0..specs.len()).rev() {
                let dst = bufs.accumulation_view(dev, p).unwrap();
                add_into(dev, &grad_values(batch, rank, p, specs[p].numel), dst);
                if !overlap.grad_reduce() {
                    continue;
                }
                bufs.register_grad_ready(dev, &mut comm, p).unwrap();
                let g = bufs.group_of(p);
                let complete = bufs.group_params(g).iter().min() == Some(&p);
                let launched = bufs.grad_reduce_in_flight().contains(&g);
                if batch == 0 {
                    // No golden counts yet: nothing launches during the first backward.
                    assert!(bufs.grad_reduce_in_flight().is_empty(), "{what}");
                } else {
                    assert_eq!(launched, complete, "{what}: group {g} after param {p}");
                }
            }
            if overlap.grad_reduce() && batch == 1 {
                let all: Vec<usize> = (0..bufs.num_groups()).collect();
                assert_eq!(bufs.grad_reduce_in_flight(), all, "{what}");
                // In stages: every group is in flight, in launch order; leaving them all out
                // completes none; leaving out all but the first launched completes that one.
                assert_eq!(bufs.grad_sync_order(), all, "{what}");
                bufs.finish_grad_sync_except(dev, &mut comm, &all).unwrap();
                assert_eq!(bufs.grad_reduce_in_flight(), all, "{what}");
                bufs.finish_grad_sync_except(dev, &mut comm, &all[1..])
                    .unwrap();
                assert_eq!(bufs.grad_reduce_in_flight(), all[1..], "{what}");
                assert_eq!(bufs.grad_sync_order(), all[1..], "{what}");
                // Completing every reduction but the last launched makes the other groups'
                // gradients final.
                let pending = vec![all[all.len() - 1]];
                bufs.finish_grad_sync_except(dev, &mut comm, &pending)
                    .unwrap();
                assert_eq!(pending, vec![all[all.len() - 1]], "{what}");
                assert_eq!(bufs.grad_reduce_in_flight(), pending, "{what}");
                for s in bufs.owned_shards().unwrap() {
                    if pending.contains(&bufs.group_of(s.param)) {
                        continue;
                    }
                    let want = expected(dp, batch, s.param, specs[s.param].numel, grad, scaling);
                    let got = download_f32(dev, s.grad_view);
                    let w = format!("{what}: early, param {} {:?}", s.param, s.param_range);
                    assert_same_bits(&got, &want[s.param_range.clone()], &w);
                }
            }
            if !overlap.grad_reduce() {
                // Nothing launched yet: the order is every group. Launching ahead puts every
                // reduction in flight (each runs in place: the wire dtype is the gradients');
                // completing in stages then takes the first.
                let all: Vec<usize> = (0..bufs.num_groups()).collect();
                assert_eq!(bufs.grad_sync_order(), all, "{what}");
                bufs.launch_grad_syncs(dev, &mut comm).unwrap();
                assert_eq!(bufs.grad_reduce_in_flight(), all, "{what}");
                assert_eq!(bufs.grad_sync_order(), all, "{what}");
                bufs.finish_grad_sync_except(dev, &mut comm, &all[1..])
                    .unwrap();
                assert_eq!(bufs.grad_sync_order(), all[1..], "{what}");
                assert_eq!(bufs.grad_reduce_in_flight(), all[1..], "{what}");
            }
            bufs.finish_grad_sync(dev, &mut comm).unwrap();
            assert!(bufs.grad_reduce_in_flight().is_empty(), "{what}");
            for s in bufs.owned_shards().unwrap() {
                let n = specs[s.param].numel;
                let want = expected(dp, batch, s.param, n, grad, scaling);
                let got = download_f32(dev, s.grad_view);
                assert_same_bits(
                    &got,
                    &want[s.param_range.clone()],
                    &format!(
                        "{what}: batch {batch}, rank {rank}, param {} {:?}",
                        s.param, s.param_range
                    ),
                );
                *count += got.len();
            }
        }
        checked
    });
    let total: usize = specs(grad).iter().map(|s| s.numel).sum();
    let owners = if sharding.is_sharded() { 1 } else { dp };
    for batch in 0..2 {
        let sum: usize = checked.iter().map(|c| c[batch]).sum();
        assert_eq!(sum, owners * total, "{what}: batch {batch} coverage");
    }
}

const GRADS: [GradDType; 2] = [GradDType::F32, GradDType::Bf16];

/// Both scalings, with and without overlap: the distributed layout at dp 1 to 4 with f32 and
/// bf16 gradients, and the replicated one (an all-reduce, exact on every rank) at dp 2 and 3
/// with f32 gradients.
#[test]
fn reductions_are_exact_with_and_without_overlap() {
    let distributed =
        (1..=4).flat_map(|dp| GRADS.map(|grad| (dp, ShardingStrategy::Distributed, grad)));
    let replicated = [2, 3].map(|dp| (dp, ShardingStrategy::Replicated, GradDType::F32));
    for (dp, sharding, grad) in distributed.chain(replicated) {
        for overlap in [Overlap::None, Overlap::GradReduce] {
            for scaling in [GradScaling::PreDivide, GradScaling::AverageInCollective] {
                check(dp, sharding, overlap, scaling, grad);
            }
        }
    }
}

/// The host reference must tell the two orders apart, or the tests above could not catch a
/// reduction that scales after summing (or sums in another order).
#[test]
fn the_reference_distinguishes_the_orders() {
    let n = 2000;
    for grad in GRADS {
        let pre = expected(3, 0, 0, n, grad, GradScaling::PreDivide);
        let avg = expected(3, 0, 0, n, grad, GradScaling::AverageInCollective);
        assert_ne!(bits(&pre), bits(&avg), "{grad:?}");
    }
}

/// With another wire dtype (fp32 gradients reduced in bf16 through a transient bucket per
/// group) `launch_grad_syncs` launches nothing ahead (one transient bucket at a time), and a
/// completion in stages (`grad_sync_order`, `finish_grad_sync_except`) reduces to the bits of
/// `finish_grad_sync`; with overlapped reduction every group launched by the backward comes
/// first in the order.
#[test]
fn staged_completion_with_a_transient_wire_dtype_gives_the_same_bits() {
    for overlap in [Overlap::None, Overlap::GradReduce] {
        let dp = 2;
        let grads = run(dp, |mut comm, mut dev| {
            let rank = lowbit_comm::Communicator::rank(&comm);
            let dev = &mut dev;
            let mut out = Vec::new();
            for staged in [false, true] {
                let cfg = DdpConfig::default()
                    .with_overlap(overlap)
                    .with_bucket_size(Some(BUCKET))
                    .with_grad_comm_dtype(Some(GradDType::Bf16))
                    .with_verify(Verify::Full);
                let specs = specs(GradDType::F32);
                let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg).unwrap();
                let groups: Vec<usize> = (0..bufs.num_groups()).collect();
                // Two batches: the first collects the golden counts of overlapped reduction.
                for batch in 0..2 {
                    bufs.zero_grad_buffer(dev).unwrap();
                    for p in (0..specs.len()).rev() {
                        let dst = bufs.accumulation_view(dev, p).unwrap();
                        add_into(dev, &grad_values(batch, rank, p, specs[p].numel), dst);
                        if overlap.grad_reduce() {
                            bufs.register_grad_ready(dev, &mut comm, p).unwrap();
                        }
                    }
                    if staged {
                        let in_flight = bufs.grad_reduce_in_flight();
                        bufs.launch_grad_syncs(dev, &mut comm).unwrap();
                        assert_eq!(bufs.grad_reduce_in_flight(), in_flight, "{overlap:?}");
                        let order = bufs.grad_sync_order();
                        assert_eq!(order[..in_flight.len()], in_flight, "{overlap:?}");
                        let mut sorted = order.clone();
                        sorted.sort_unstable();
                        assert_eq!(sorted, groups, "{overlap:?}");
                        for k in 0..=order.len() {
                            bufs.finish_grad_sync_except(dev, &mut comm, &order[k..])
                                .unwrap();
                            assert_eq!(bufs.grad_sync_order(), order[k..], "{overlap:?}");
                        }
                    }
                    bufs.finish_grad_sync(dev, &mut comm).unwrap();
                }
                let mut all = Vec::new();
                for s in bufs.owned_shards().unwrap() {
                    all.extend(download_f32(dev, s.grad_view));
                }
                out.push(all);
            }
            out
        });
        for (rank, [plain, staged]) in grads.iter().map(|g| [&g[0], &g[1]]).enumerate() {
            assert!(!plain.is_empty(), "{overlap:?}, rank {rank}");
            assert_same_bits(plain, staged, &format!("{overlap:?}, rank {rank}"));
        }
    }
}

/// With sharded gradients a non-finite gradient refused at launch gives its group the filling
/// bucket back instead of losing it, so the next zeroing frees every transient bucket: device
/// memory returns to where it was before the backward.
#[test]
fn a_refused_launch_leaves_no_transient_bucket_behind() {
    let dp = 2;
    run(dp, |mut comm, mut dev| {
        let rank = lowbit_comm::Communicator::rank(&comm);
        let dev = &mut dev;
        let cfg = DdpConfig::default()
            .with_sharding(ShardingStrategy::OptimGrads)
            .with_nan_check(lowbit_buffers::NanCheck::FirstParam)
            .with_verify(Verify::Full);
        let specs = specs(GradDType::F32);
        let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg).unwrap();
        bufs.zero_grad_buffer(dev).unwrap();
        let base = dev.allocated_bytes();
        for p in (0..specs.len()).rev() {
            let dst = bufs.accumulation_view(dev, p).unwrap();
            let mut g = grad_values(0, rank, p, specs[p].numel);
            if p == specs.len() - 1 {
                g[1] = f32::NAN;
            }
            add_into(dev, &g, dst);
        }
        assert!(
            dev.allocated_bytes() > base,
            "the backward fills transient buckets"
        );
        let e = bufs.finish_grad_sync(dev, &mut comm).unwrap_err();
        assert!(e.to_string().contains("non-finite"), "{e}");
        assert!(bufs.grad_reduce_in_flight().is_empty());
        bufs.zero_grad_buffer(dev).unwrap();
        assert_eq!(dev.allocated_bytes(), base);
    });
}

/// The non-finite verdict is global: a NaN in one rank's gradient (rank 1 of 3, the last
/// parameter, the first the backward reports) fails the reduction on every rank, the finding
/// rank naming the parameter and the others "a parameter of another rank". With NaN on every
/// rank (the test above) a verdict each rank took on its own gradient alone would pass; here
/// ranks 0 and 2 would finish their sync (or hang in a reduction rank 1 never starts).
#[test]
fn a_nan_on_one_rank_only_fails_every_rank() {
    let dp = 3;
    for sharding in [
        ShardingStrategy::Replicated,
        ShardingStrategy::Distributed,
        ShardingStrategy::OptimGrads,
    ] {
        for overlap in [Overlap::None, Overlap::GradReduce] {
            let verdicts = run(dp, |mut comm, mut dev| {
                let rank = lowbit_comm::Communicator::rank(&comm);
                let dev = &mut dev;
                let cfg = DdpConfig::default()
                    .with_sharding(sharding)
                    .with_overlap(overlap)
                    .with_nan_check(lowbit_buffers::NanCheck::FirstParam);
                let specs = specs(GradDType::F32);
                let mut bufs = DataParallelBuffers::new(dev, dp, rank, specs.clone(), cfg).unwrap();
                bufs.zero_grad_buffer(dev).unwrap();
                bufs.set_last_microbatch(true);
                bufs.begin_microbatch(dev, &mut comm).unwrap();
                let mut err = None;
                for p in (0..specs.len()).rev() {
                    let dst = bufs.accumulation_view(dev, p).unwrap();
                    let mut g = grad_values(0, rank, p, specs[p].numel);
                    if rank == 1 && p == specs.len() - 1 {
                        g[5] = f32::NAN;
                    }
                    add_into(dev, &g, dst);
                    if !overlap.grad_reduce() {
                        continue;
                    }
                    if let Err(e) = bufs.register_grad_ready(dev, &mut comm, p) {
                        err = Some(e);
                        break;
                    }
                }
                let err = match err {
                    Some(e) => Some(e),
                    None => bufs.finish_grad_sync(dev, &mut comm).err(),
                };
                match err.as_ref().and_then(|e| e.protocol()) {
                    Some(lowbit_buffers::ProtocolError::NonFiniteGrad { rank: r, names }) => {
                        assert_eq!(*r, rank);
                        Ok(names.clone())
                    }
                    _ => Err(err.map(|e| e.to_string())),
                }
            });
            let what = format!("{sharding:?}, {overlap:?}");
            for (rank, v) in verdicts.iter().enumerate() {
                let names = v
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{what}: rank {rank} did not refuse: {e:?}"));
                let want = if rank == 1 {
                    "p6"
                } else {
                    "a parameter of another rank"
                };
                assert_eq!(names, &[want.to_string()], "{what}: rank {rank}");
            }
        }
    }
}
