//! Sub-groups made by `split`: membership and order, collectives inside them, interleaving with
//! the parent group, and the hybrid-sharding pattern (shard group x replicate group).

mod common;

use common::*;
use lowbit_comm::{Communicator, ReduceOp, run_ranks};
use lowbit_device::DType;

#[test]
fn split_even_odd_then_collectives() {
    let got = ok(run_ranks(4, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let mut sub = comm.split((r % 2) as u32, r as u32).unwrap();
        let buf = put(&mut dev, DType::F32, &[r as f32, 1.0]);
        sub.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        let input = put(&mut dev, DType::F32, &[r as f32]);
        let gathered = dev.alloc(DType::F32, sub.size());
        sub.all_gather(&mut dev, input, gathered).unwrap();
        // The parent group still works, interleaved with the sub-group.
        let world_buf = put(&mut dev, DType::F32, &[1.0]);
        comm.all_reduce(&mut dev, world_buf, ReduceOp::Sum).unwrap();
        sub.barrier().unwrap();
        (
            sub.rank(),
            sub.size(),
            get(&dev, buf),
            get(&dev, gathered),
            get(&dev, world_buf)[0],
        )
    }));
    for (r, (sub_rank, sub_size, sum, gathered, world)) in got.iter().enumerate() {
        assert_eq!(*sub_rank, r / 2);
        assert_eq!(*sub_size, 2);
        let members: Vec<f32> = if r % 2 == 0 {
            vec![0.0, 2.0]
        } else {
            vec![1.0, 3.0]
        };
        assert_eq!(sum, &vec![members.iter().sum::<f32>(), 2.0]);
        assert_eq!(gathered, &members);
        assert_eq!(*world, 4.0);
    }
}

/// Ranks are ordered by (key, old rank): reversed keys reverse the order; equal keys keep it.
#[test]
fn split_orders_by_key_then_rank() {
    let got = ok(run_ranks(5, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let (color, key) = if r < 3 { (7, 10 - r as u32) } else { (1, 0) };
        let mut sub = comm.split(color, key).unwrap();
        let input = put(&mut dev, DType::F32, &[r as f32]);
        let out = dev.alloc(DType::F32, sub.size());
        sub.all_gather(&mut dev, input, out).unwrap();
        (sub.rank(), get(&dev, out))
    }));
    let ranks: Vec<usize> = got.iter().map(|g| g.0).collect();
    assert_eq!(ranks, vec![2, 1, 0, 0, 1]);
    for (r, (_, order)) in got.iter().enumerate() {
        if r < 3 {
            assert_eq!(order, &vec![2.0, 1.0, 0.0]);
        } else {
            assert_eq!(order, &vec![3.0, 4.0]);
        }
    }
}

/// A 2 x 2 hybrid mesh: reduce-scatter within the shard group, then all-reduce of the shard
/// across the replicate group equals the global reduction's chunk.
#[test]
fn hybrid_shard_then_replicate() {
    let (shard_size, replicas) = (2usize, 2usize);
    let world = shard_size * replicas;
    let n = 3;
    let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let (node, local) = (r / shard_size, r % shard_size);
        let mut shard = comm.split(node as u32, local as u32).unwrap();
        let mut replicate = comm.split(local as u32, node as u32).unwrap();
        assert_eq!((shard.rank(), shard.size()), (local, shard_size));
        assert_eq!((replicate.rank(), replicate.size()), (node, replicas));
        let grads = put(&mut dev, DType::F32, &vals(DType::F32, r, shard_size * n));
        let mine = grads.slice(local * n..(local + 1) * n).unwrap();
        shard
            .reduce_scatter(&mut dev, grads, mine, ReduceOp::Sum)
            .unwrap();
        replicate.all_reduce(&mut dev, mine, ReduceOp::Sum).unwrap();
        get(&dev, mine)
    }));
    let inputs: Vec<Vec<f32>> = (0..world)
        .map(|q| vals(DType::F32, q, shard_size * n))
        .collect();
    for (r, g) in got.iter().enumerate() {
        let local = r % shard_size;
        // Shard group order then replicate order: ((x_a + x_b) + (x_c + x_d)) per element.
        let want: Vec<f32> = (local * n..(local + 1) * n)
            .map(|i| {
                let node_sum =
                    |node: usize| inputs[node * shard_size][i] + inputs[node * shard_size + 1][i];
                node_sum(0) + node_sum(1)
            })
            .collect();
        assert_eq!(g, &want, "rank {r}");
    }
}

#[test]
fn nested_and_singleton_splits() {
    let got = ok(run_ranks(4, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let mut half = comm.split((r / 2) as u32, 0).unwrap();
        let mut alone = half.split(half.rank() as u32, 0).unwrap();
        assert_eq!((alone.rank(), alone.size()), (0, 1));
        let buf = put(&mut dev, DType::Bf16, &[r as f32]);
        alone.all_reduce(&mut dev, buf, ReduceOp::Avg).unwrap();
        half.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        comm.barrier().unwrap();
        get(&dev, buf)[0]
    }));
    assert_eq!(got, vec![1.0, 1.0, 5.0, 5.0]);
}

#[test]
fn sub_group_stats_are_separate() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let mut sub = comm.split(0, 0).unwrap();
        let buf = dev.alloc(DType::F32, 4);
        sub.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        (comm.stats().all_reduce.calls, sub.stats().all_reduce.bytes)
    }));
    assert!(got.iter().all(|&g| g == (0, 16)));
}
