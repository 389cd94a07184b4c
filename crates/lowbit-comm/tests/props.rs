//! Random sizes, values and group sizes: reduce-scatter and all-reduce agree bit for bit with the
//! host rank-order reference, and all-reduce equals reduce-scatter followed by all-gather.

mod common;

use common::*;
use lowbit_comm::{Communicator, ReduceOp, run_ranks};
use lowbit_device::DType;
use proptest::prelude::*;

fn dtype() -> impl Strategy<Value = DType> {
    prop_oneof![Just(DType::F32), Just(DType::Bf16), Just(DType::F16)]
}

fn reduce_op() -> impl Strategy<Value = ReduceOp> {
    prop_oneof![
        Just(ReduceOp::Sum),
        Just(ReduceOp::Avg),
        Just(ReduceOp::Max)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matches_host_reference(
        world in 1usize..=4,
        n in 0usize..12,
        dtype in dtype(),
        op in reduce_op(),
        seed in proptest::collection::vec(-1000.0f32..1000.0, 48),
    ) {
        let input = |rank: usize| -> Vec<f32> {
            (0..world * n).map(|i| round(dtype, seed[(rank * 13 + i) % 48] * (1.0 + rank as f32 * 1e-3))).collect()
        };
        let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
            let r = comm.rank();
            let bucket = put(&mut dev, dtype, &input(r));
            let copy = put(&mut dev, dtype, &input(r));
            let shard = bucket.slice(r * n..(r + 1) * n).unwrap();
            comm.reduce_scatter(&mut dev, bucket, shard, op).unwrap();
            comm.all_gather(&mut dev, shard, bucket).unwrap();
            comm.all_reduce(&mut dev, copy, op).unwrap();
            (dev.read_bytes(bucket).unwrap(), dev.read_bytes(copy).unwrap())
        }));
        let inputs: Vec<Vec<f32>> = (0..world).map(input).collect();
        let want = encode(dtype, &host_reduce(dtype, op, &inputs));
        for (rs_ag, ar) in got {
            prop_assert_eq!(&rs_ag, &want);
            prop_assert_eq!(&ar, &want);
        }
    }
}
