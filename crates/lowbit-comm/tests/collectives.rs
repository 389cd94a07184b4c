//! Every collective on world sizes 1–4 with every dtype, values checked bit for bit against a
//! host computation in rank order with one final rounding.

mod common;

use common::*;
use lowbit_comm::{CommStats, Communicator, LocalComm, Op, OpStats, ReduceOp, run_ranks};
use lowbit_device::{DType, Device};

/// Out of place, and in Megatron's in-place form: each rank all-gathers from its own shard of
/// the bucket into the bucket.
#[test]
fn all_gather_every_world_and_dtype() {
    for (world, dtype) in worlds_and(&ALL_DTYPES) {
        for in_place in [false, true] {
            let n = if in_place { 4 } else { 5 };
            let want = encode(dtype, &all_vals(dtype, world, n).concat());
            let what = format!("world {world} {dtype:?} in place {in_place}");
            let gather = |mut comm: LocalComm, mut dev: Device| {
                let r = comm.rank();
                let output = dev.alloc(dtype, world * n);
                let input = if in_place {
                    let shard = output.slice(r * n..(r + 1) * n).unwrap();
                    dev.write_bytes(shard, &encode(dtype, &vals(dtype, r, n)))
                        .unwrap();
                    shard
                } else {
                    put(&mut dev, dtype, &vals(dtype, r, n))
                };
                comm.all_gather(&mut dev, input, output).unwrap();
                dev.read_bytes(output).unwrap()
            };
            assert_ranks(world, &what, gather, |_| want.clone());
        }
    }
}

#[test]
fn reduce_scatter_every_world_dtype_and_op() {
    for (world, dtype, op) in reduction_cases() {
        let n = 6;
        let inputs = all_vals(dtype, world, world * n);
        let full = host_reduce(dtype, op, &inputs);
        let what = format!("world {world} {dtype:?} {op}");
        let reduce = |mut comm: LocalComm, mut dev: Device| {
            let input = put(&mut dev, dtype, &inputs[comm.rank()]);
            let output = dev.alloc(dtype, n);
            comm.reduce_scatter(&mut dev, input, output, op).unwrap();
            dev.read_bytes(output).unwrap()
        };
        assert_ranks(world, &what, reduce, |r| {
            encode(dtype, &full[r * n..(r + 1) * n])
        });
    }
}

#[test]
fn all_reduce_every_world_dtype_and_op() {
    for (world, dtype, op) in reduction_cases() {
        // 7 elements: not a multiple of the world size, so the shared chunks are uneven.
        let inputs = all_vals(dtype, world, 7);
        let want = encode(dtype, &host_reduce(dtype, op, &inputs));
        let what = format!("world {world} {dtype:?} {op}");
        let reduce = |mut comm: LocalComm, mut dev: Device| {
            let buf = put(&mut dev, dtype, &inputs[comm.rank()]);
            comm.all_reduce(&mut dev, buf, op).unwrap();
            dev.read_bytes(buf).unwrap()
        };
        assert_ranks(world, &what, reduce, |_| want.clone());
    }
}

#[test]
fn broadcast_from_every_root_every_dtype() {
    for (world, dtype) in worlds_and(&ALL_DTYPES) {
        for root in 0..world {
            let n = 9;
            let want = encode(dtype, &vals(dtype, root, n));
            let what = format!("world {world} {dtype:?} root {root}");
            let broadcast = |mut comm: LocalComm, mut dev: Device| {
                let buf = put(&mut dev, dtype, &vals(dtype, comm.rank(), n));
                comm.broadcast(&mut dev, buf, root).unwrap();
                dev.read_bytes(buf).unwrap()
            };
            assert_ranks(world, &what, broadcast, |_| want.clone());
        }
    }
}

/// `[1e8, 1, -1e8, 1]` added in rank order is `((1e8 + 1) - 1e8) + 1 = 1` in f32 (1e8 + 1 rounds
/// to 1e8); in reverse order it is 0, and other orders give 0 or 2. Each element rotates the
/// pattern, so every rank's position in the order matters.
#[test]
fn sums_are_in_rank_order() {
    let pattern = [1e8f32, 1.0, -1e8, 1.0];
    let world = 4;
    let input = |rank: usize| -> Vec<f32> { (0..4).map(|i| pattern[(rank + i) % 4]).collect() };
    let inputs: Vec<Vec<f32>> = (0..world).map(input).collect();
    let want = host_reduce(DType::F32, ReduceOp::Sum, &inputs);
    assert_eq!(want[0], 1.0);
    let reversed: Vec<Vec<f32>> = inputs.iter().rev().cloned().collect();
    let other = host_reduce(DType::F32, ReduceOp::Sum, &reversed);
    assert_ne!(
        encode(DType::F32, &want),
        encode(DType::F32, &other),
        "order must matter"
    );

    let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let buf = put(&mut dev, DType::F32, &input(r));
        let copy = put(&mut dev, DType::F32, &input(r));
        let chunk = dev.alloc(DType::F32, 1);
        comm.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        comm.reduce_scatter(&mut dev, copy, chunk, ReduceOp::Sum)
            .unwrap();
        (get(&dev, buf), get(&dev, chunk))
    }));
    for (r, (all, chunk)) in got.iter().enumerate() {
        assert_eq!(
            encode(DType::F32, all),
            encode(DType::F32, &want),
            "rank {r}"
        );
        assert_eq!(chunk[0].to_bits(), want[r].to_bits(), "rank {r}");
    }
}

/// bf16 `1 + 2⁻⁸ + 2⁻⁸`: one rounding of the f32 sum gives `1 + 2⁻⁷`; rounding after each add
/// would give 1 (each `1 + 2⁻⁸` is a tie that rounds to even). Same for f16 with `2⁻¹¹`.
#[test]
fn low_precision_sums_round_once() {
    for (dtype, tiny, want) in [
        (DType::Bf16, 2f32.powi(-8), 1.0 + 2f32.powi(-7)),
        (DType::F16, 2f32.powi(-11), 1.0 + 2f32.powi(-10)),
    ] {
        assert_eq!(
            round(dtype, 1.0 + tiny),
            1.0,
            "the per-step rounding would lose it"
        );
        let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
            let v = if comm.rank() == 0 { 1.0 } else { tiny };
            let buf = put(&mut dev, dtype, &[v, v]);
            comm.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
            get(&dev, buf)
        }));
        for g in got {
            assert_eq!(g, vec![want, want], "{dtype:?}");
        }
    }
}

#[test]
fn avg_divides_the_f32_sum_once() {
    // bf16 inputs 1, 1, 2^-7 (all exact): f32 sum 2.0078125, / 3 = 0.66927..., one rounding.
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let v = [1.0, 1.0, 2f32.powi(-7)][comm.rank()];
        let buf = put(&mut dev, DType::Bf16, &[v]);
        comm.all_reduce(&mut dev, buf, ReduceOp::Avg).unwrap();
        get(&dev, buf)[0]
    }));
    let want = round(DType::Bf16, (2.0 + 2f32.powi(-7)) / 3.0);
    assert!(got.iter().all(|&g| g.to_bits() == want.to_bits()));
}

#[test]
fn max_propagates_nan_and_handles_signs() {
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let v = match comm.rank() {
            0 => [-3.0, 1.0, -0.0, f32::NEG_INFINITY],
            1 => [-2.0, f32::NAN, 0.0, -1.0],
            _ => [-5.0, 2.0, 0.0, -7.0],
        };
        let buf = put(&mut dev, DType::F32, &v);
        comm.all_reduce(&mut dev, buf, ReduceOp::Max).unwrap();
        get(&dev, buf)
    }));
    for g in got {
        assert_eq!(g[0], -2.0);
        assert!(g[1].is_nan());
        assert_eq!(
            g[2].to_bits(),
            (-0.0f32).to_bits(),
            "ties keep the lower rank's value"
        );
        assert_eq!(g[3], -1.0);
    }
}

/// Megatron's form: each rank reduce-scatters the bucket into its own shard of it.
#[test]
fn in_place_reduce_scatter() {
    for (world, dtype) in worlds_and(&FLOATS) {
        let n = 3;
        let got = ok(run_ranks(world, cfg(), |mut comm, mut dev| {
            let r = comm.rank();
            let bucket = put(&mut dev, dtype, &vals(dtype, r, world * n));
            let shard = bucket.slice(r * n..(r + 1) * n).unwrap();
            comm.reduce_scatter(&mut dev, bucket, shard, ReduceOp::Sum)
                .unwrap();
            get(&dev, bucket)
        }));
        let inputs = all_vals(dtype, world, world * n);
        let full = host_reduce(dtype, ReduceOp::Sum, &inputs);
        for (r, g) in got.iter().enumerate() {
            assert_eq!(
                encode(dtype, &g[r * n..(r + 1) * n]),
                encode(dtype, &full[r * n..(r + 1) * n]),
                "world {world} {dtype:?} rank {r}"
            );
            // The in-process group leaves the other chunks of the input as they were.
            let mut rest = g.clone();
            let mut orig = inputs[r].clone();
            rest.drain(r * n..(r + 1) * n);
            orig.drain(r * n..(r + 1) * n);
            assert_eq!(encode(dtype, &rest), encode(dtype, &orig));
        }
    }
}

#[test]
fn empty_views_are_fine() {
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let e = dev.alloc(DType::F32, 0);
        comm.all_gather(&mut dev, e, e).unwrap();
        comm.reduce_scatter(&mut dev, e, e, ReduceOp::Sum).unwrap();
        comm.all_reduce(&mut dev, e, ReduceOp::Max).unwrap();
        comm.broadcast(&mut dev, e, 2).unwrap();
        comm.coalesced(&mut dev, &[]).unwrap();
        comm.barrier().unwrap();
    }));
    assert_eq!(got.len(), 3);
}

#[test]
fn stats_count_calls_and_algorithm_bytes() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let a_in = dev.alloc(DType::F32, 3);
        let a_out = dev.alloc(DType::F32, 6);
        let rs_in = dev.alloc(DType::Bf16, 8);
        let rs_out = dev.alloc(DType::Bf16, 4);
        let ar = dev.alloc(DType::F16, 5);
        let bc = dev.alloc(DType::U8, 7);
        comm.all_gather(&mut dev, a_in, a_out).unwrap();
        comm.reduce_scatter(&mut dev, rs_in, rs_out, ReduceOp::Avg)
            .unwrap();
        comm.all_reduce(&mut dev, ar, ReduceOp::Max).unwrap();
        comm.broadcast(&mut dev, bc, 1).unwrap();
        comm.barrier().unwrap();
        comm.coalesced(
            &mut dev,
            &[
                Op::AllGather {
                    input: a_in,
                    output: a_out,
                },
                Op::AllReduce {
                    buf: ar,
                    reduce: ReduceOp::Sum,
                },
            ],
        )
        .unwrap();
        // A launch rejected on this rank is not counted.
        assert!(comm.all_gather(&mut dev, a_in, a_in).is_err());
        comm.stats()
    }));
    let want = CommStats {
        all_gather: OpStats {
            calls: 2,
            bytes: 48,
        },
        reduce_scatter: OpStats {
            calls: 1,
            bytes: 16,
        },
        all_reduce: OpStats {
            calls: 2,
            bytes: 20,
        },
        broadcast: OpStats { calls: 1, bytes: 7 },
        barriers: 1,
        launches: 5,
    };
    for s in got {
        assert_eq!(s, want);
        assert_eq!(s.total_bytes(), 48 + 16 + 20 + 7);
        let line = s.to_string();
        assert!(line.contains("all_gather 2 x"), "{line}");
        assert!(line.contains("1 barriers, 5 launches"), "{line}");
    }
    let mut sum = want;
    sum.merge(&want);
    assert_eq!(sum.all_gather.calls, 4);
    assert_eq!(sum.launches, 10);
}

#[test]
fn many_consecutive_collectives_stay_in_step() {
    let got = ok(run_ranks(4, cfg(), |mut comm, mut dev| {
        let buf = dev.alloc(DType::F32, 2);
        let r = comm.rank() as f32;
        let mut sums = Vec::new();
        for step in 0..200 {
            dev.upload(buf, &[r + step as f32, 1.0]).unwrap();
            comm.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
            sums.push(dev.download::<f32>(buf).unwrap());
            if step % 50 == 0 {
                comm.barrier().unwrap();
            }
        }
        sums
    }));
    for sums in got {
        for (step, s) in sums.iter().enumerate() {
            assert_eq!(s, &vec![6.0 + 4.0 * step as f32, 4.0]);
        }
    }
}
