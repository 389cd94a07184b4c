//! Asynchronous launches waited in another order than started, coalesced launches, and handles
//! dropped without waiting.

mod common;

use common::*;
use lowbit_comm::{Communicator, Op, ReduceOp, Work, run_ranks};
use lowbit_device::DType;

/// Four different collectives outstanding at once; each rank waits in its own order.
#[test]
fn outstanding_ops_waited_in_any_order() {
    for world in [2, 3, 4] {
        let n = 4;
        let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
            let r = comm.rank();
            let ag_in = put(&mut dev, DType::Bf16, &vals(DType::Bf16, r, n));
            let ag_out = dev.alloc(DType::Bf16, world * n);
            let rs_in = put(&mut dev, DType::F32, &vals(DType::F32, r, world * n));
            let rs_out = dev.alloc(DType::F32, n);
            let ar = put(&mut dev, DType::F16, &vals(DType::F16, r, n));
            let bc = put(&mut dev, DType::U8, &vals(DType::U8, r, n));
            let mut works: Vec<Option<Work>> = vec![
                Some(comm.start_all_gather(&mut dev, ag_in, ag_out).unwrap()),
                Some(
                    comm.start_reduce_scatter(&mut dev, rs_in, rs_out, ReduceOp::Sum)
                        .unwrap(),
                ),
                Some(comm.start_all_reduce(&mut dev, ar, ReduceOp::Avg).unwrap()),
                Some(comm.start_broadcast(&mut dev, bc, world - 1).unwrap()),
            ];
            // Rank-dependent orders, none of them the start order.
            let orders = [[3, 1, 0, 2], [2, 3, 1, 0], [1, 0, 3, 2], [3, 2, 1, 0]];
            for &i in &orders[r % 4] {
                works[i].take().unwrap().wait(&mut dev).unwrap();
            }
            (
                dev.read_bytes(ag_out).unwrap(),
                dev.read_bytes(rs_out).unwrap(),
                dev.read_bytes(ar).unwrap(),
                dev.read_bytes(bc).unwrap(),
            )
        }));
        let ag: Vec<u8> = (0..world)
            .flat_map(|q| encode(DType::Bf16, &vals(DType::Bf16, q, n)))
            .collect();
        let rs_inputs = all_vals(DType::F32, world, world * n);
        let rs = host_reduce(DType::F32, ReduceOp::Sum, &rs_inputs);
        let ar_inputs = all_vals(DType::F16, world, n);
        let ar = encode(
            DType::F16,
            &host_reduce(DType::F16, ReduceOp::Avg, &ar_inputs),
        );
        let bc = encode(DType::U8, &vals(DType::U8, world - 1, n));
        for (r, g) in got.iter().enumerate() {
            assert_eq!(g.0, ag, "world {world} rank {r} all_gather");
            assert_eq!(
                g.1,
                encode(DType::F32, &rs[r * n..(r + 1) * n]),
                "reduce_scatter"
            );
            assert_eq!(g.2, ar, "all_reduce");
            assert_eq!(g.3, bc, "broadcast");
        }
    }
}

/// Thirty outstanding all-reduces, waited in reverse.
#[test]
fn many_outstanding_waited_in_reverse() {
    let world = 3;
    let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
        let bufs: Vec<_> = (0..30)
            .map(|k| put(&mut dev, DType::F32, &[(comm.rank() * 100 + k) as f32]))
            .collect();
        let works: Vec<Work> = bufs
            .iter()
            .map(|&b| comm.start_all_reduce(&mut dev, b, ReduceOp::Sum).unwrap())
            .collect();
        for w in works.into_iter().rev() {
            w.wait(&mut dev).unwrap();
        }
        bufs.iter().map(|&b| get(&dev, b)[0]).collect::<Vec<_>>()
    }));
    for g in got {
        let want: Vec<f32> = (0..30).map(|k| (300 + 3 * k) as f32).collect();
        assert_eq!(g, want);
    }
}

/// A bucket group of two f32 grad buckets: reduce-scatter both in place in one launch, then
/// all-gather both in place in one launch (what a distributed optimizer step does around the
/// update), plus an unrelated all-reduce in the same launch.
#[test]
fn coalesced_bucket_group_round_trip() {
    for world in WORLDS {
        let sizes = [4 * world, 2 * world];
        let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
            let r = comm.rank();
            let buckets: Vec<_> = sizes
                .iter()
                .enumerate()
                .map(|(b, &len)| put(&mut dev, DType::F32, &vals(DType::F32, r + 10 * b, len)))
                .collect();
            let shards: Vec<_> = buckets
                .iter()
                .map(|b| {
                    let s = b.len() / world;
                    b.slice(r * s..(r + 1) * s).unwrap()
                })
                .collect();
            let norm = put(&mut dev, DType::F32, &[r as f32 + 0.5]);
            let mut ops: Vec<Op> = buckets
                .iter()
                .zip(&shards)
                .map(|(&input, &output)| Op::ReduceScatter {
                    input,
                    output,
                    reduce: ReduceOp::Avg,
                })
                .collect();
            ops.push(Op::AllReduce {
                buf: norm,
                reduce: ReduceOp::Max,
            });
            let work = comm.start_coalesced(&mut dev, &ops).unwrap();
            work.wait(&mut dev).unwrap();
            let reduced: Vec<Vec<f32>> = shards.iter().map(|&s| get(&dev, s)).collect();
            let ops: Vec<Op> = buckets
                .iter()
                .zip(&shards)
                .map(|(&output, &input)| Op::AllGather { input, output })
                .collect();
            comm.coalesced(&mut dev, &ops).unwrap();
            let gathered: Vec<Vec<f32>> = buckets.iter().map(|&b| get(&dev, b)).collect();
            (reduced, gathered, get(&dev, norm)[0])
        }));
        let full: Vec<Vec<f32>> = sizes
            .iter()
            .enumerate()
            .map(|(b, &len)| {
                let inputs: Vec<Vec<f32>> = (0..world)
                    .map(|q| vals(DType::F32, q + 10 * b, len))
                    .collect();
                host_reduce(DType::F32, ReduceOp::Avg, &inputs)
            })
            .collect();
        for (r, (reduced, gathered, norm)) in got.iter().enumerate() {
            for b in 0..2 {
                let s = sizes[b] / world;
                assert_eq!(
                    reduced[b],
                    full[b][r * s..(r + 1) * s],
                    "world {world} rank {r}"
                );
                assert_eq!(
                    encode(DType::F32, &gathered[b]),
                    encode(DType::F32, &full[b])
                );
            }
            assert_eq!(*norm, world as f32 - 0.5);
        }
    }
}

/// A rank that drops its handle does not block the others; the group stays usable.
#[test]
fn dropping_a_handle_does_not_block_peers() {
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let buf = put(&mut dev, DType::F32, &[comm.rank() as f32; 5]);
        let work = comm.start_all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        if comm.rank() == 1 {
            drop(work);
        } else {
            work.wait(&mut dev).unwrap();
        }
        let after = get(&dev, buf);
        comm.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        (after, get(&dev, buf))
    }));
    assert_eq!(got[0].0, vec![3.0; 5]);
    assert_eq!(
        got[1].0,
        vec![1.0; 5],
        "the dropped handle never wrote the output"
    );
    assert_eq!(got[2].0, vec![3.0; 5]);
    for g in &got {
        assert_eq!(g.1, vec![7.0; 5]);
    }
}

#[test]
fn completed_work_waits_immediately() {
    let mut dev = lowbit_device::Device::cpu();
    Work::completed().wait(&mut dev).unwrap();
}

/// Ranks start their next launch before their peers waited for the previous one.
#[test]
fn fast_ranks_run_ahead() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let bufs: Vec<_> = (0..5)
            .map(|k| put(&mut dev, DType::F32, &[(k + comm.rank()) as f32]))
            .collect();
        let mut works = Vec::new();
        for &b in &bufs {
            works.push(comm.start_all_reduce(&mut dev, b, ReduceOp::Sum).unwrap());
            if comm.rank() == 1 {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        }
        for w in works {
            w.wait(&mut dev).unwrap();
        }
        bufs.iter().map(|&b| get(&dev, b)[0]).collect::<Vec<_>>()
    }));
    for g in got {
        assert_eq!(g, vec![1.0, 3.0, 5.0, 7.0, 9.0]);
    }
}
