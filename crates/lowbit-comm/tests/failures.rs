//! Every way a collective can go wrong is an error on every rank, never a hang: argument
//! errors, disagreements across ranks, ranks that never arrive, panic, leave or abort.

mod common;

use std::time::{Duration, Instant};

use common::*;
use lowbit_comm::{CommError, Communicator, GroupConfig, Op, ReduceOp, run_ranks};
use lowbit_device::DType;

fn errs<T: std::fmt::Debug>(results: Vec<Result<T, lowbit_comm::CommError>>) -> Vec<CommError> {
    results
        .into_iter()
        .map(|r| r.expect_err("every rank must fail"))
        .collect()
}

#[test]
fn element_count_mismatch_is_an_error_everywhere() {
    let start = Instant::now();
    let got = errs(ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let n = if comm.rank() == 1 { 5 } else { 4 };
        let input = dev.alloc(DType::F32, n);
        let output = dev.alloc(DType::F32, 3 * n);
        comm.all_gather(&mut dev, input, output)
    })));
    assert!(start.elapsed() < Duration::from_secs(2));
    for e in &got {
        assert_eq!(
            e,
            &CommError::Mismatch {
                op: "all_gather #0".into(),
                what: "per-rank input element count",
                values: vec!["4".into(), "5".into(), "4".into()],
            }
        );
    }
    assert_eq!(
        got[0].to_string(),
        "all_gather #0: ranks disagree on the per-rank input element count: rank 0: 4, \
         rank 1: 5, rank 2: 4"
    );
}

#[test]
fn operation_mismatch_is_an_error_everywhere() {
    let got = errs(ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let a = dev.alloc(DType::F32, 4);
        let b = dev.alloc(DType::F32, 2);
        if comm.rank() == 0 {
            comm.all_gather(&mut dev, b, a)
        } else {
            comm.reduce_scatter(&mut dev, a, b, ReduceOp::Sum)
        }
    })));
    for (r, e) in got.iter().enumerate() {
        let CommError::Mismatch { op, what, values } = e else {
            panic!("rank {r}: {e}");
        };
        assert_eq!(*what, "operation");
        assert_eq!(values, &vec!["all_gather", "reduce_scatter"]);
        assert_eq!(op, ["all_gather #0", "reduce_scatter #0"][r]);
    }
}

#[test]
fn barrier_against_collective_and_split_mismatch() {
    let got = errs(ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let a = dev.alloc(DType::F32, 3);
        match comm.rank() {
            0 => comm.barrier(),
            1 => comm.all_reduce(&mut dev, a, ReduceOp::Sum),
            _ => comm.split(0, 0).map(drop),
        }
    })));
    for e in got {
        let CommError::Mismatch { what, values, .. } = e else {
            panic!("{e}");
        };
        assert_eq!(what, "operation");
        assert_eq!(values, vec!["barrier", "all_reduce", "split"]);
    }
}

#[test]
fn argument_disagreements_are_named() {
    type Case = (&'static str, fn(usize) -> (DType, ReduceOp, usize, usize));
    // (what, per-rank (dtype, reduce, root, coalesced op count))
    let cases: [Case; 4] = [
        ("dtype", |r| {
            ([DType::F32, DType::Bf16][r], ReduceOp::Sum, 0, 1)
        }),
        ("reduction", |r| {
            (DType::F32, [ReduceOp::Sum, ReduceOp::Max][r], 0, 1)
        }),
        ("root", |r| (DType::F32, ReduceOp::Sum, r, 1)),
        ("operation", |r| (DType::F32, ReduceOp::Sum, 0, 1 + r)),
    ];
    for (what, arg) in cases {
        let got = errs(ok(run_ranks(2, cfg(), |mut comm, mut dev| {
            let (dtype, reduce, root, count) = arg(comm.rank());
            let bufs: Vec<_> = (0..count).map(|_| dev.alloc(dtype, 4)).collect();
            let mut ops = vec![Op::AllReduce {
                buf: bufs[0],
                reduce,
            }];
            ops.extend(bufs[1..].iter().map(|&buf| Op::Broadcast { buf, root }));
            if what == "root" {
                ops = vec![Op::Broadcast { buf: bufs[0], root }];
            }
            comm.coalesced(&mut dev, &ops)
        })));
        for e in got {
            let CommError::Mismatch { what: w, .. } = &e else {
                panic!("{what}: {e}");
            };
            assert_eq!(*w, what, "{e}");
        }
    }
}

/// One rank's invalid arguments: that rank gets the argument error at start, the others a
/// `Peer` error naming it, at once.
#[test]
fn local_argument_error_fails_the_peers() {
    let start = Instant::now();
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let input = dev.alloc(DType::F32, 2);
        let len = if comm.rank() == 0 { 5 } else { 6 };
        let output = dev.alloc(DType::F32, len);
        comm.all_gather(&mut dev, input, output)
    }));
    assert!(start.elapsed() < Duration::from_secs(2));
    let e0 = got[0].as_ref().unwrap_err();
    assert_eq!(
        e0,
        &CommError::Size {
            op: "all_gather #0".into(),
            rank: 0,
            what: "output (must be group size 3 x input of 2 elements)".into(),
            expected: 6,
            got: 5,
        }
    );
    for (r, g) in got.iter().enumerate().skip(1) {
        let e = g.as_ref().unwrap_err();
        let CommError::Peer {
            op,
            rank,
            peer,
            error,
        } = e
        else {
            panic!("{e}");
        };
        assert_eq!((op.as_str(), *rank, *peer), ("all_gather #0", r, 0));
        assert_eq!(error, &e0.to_string());
    }
}

#[test]
fn argument_errors() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let r = comm.rank();
        let f4 = dev.alloc(DType::F32, 4);
        let f2 = dev.alloc(DType::F32, 2);
        let b2 = dev.alloc(DType::Bf16, 2);
        let u4 = dev.alloc(DType::U8, 4);
        let u2 = dev.alloc(DType::U8, 2);
        let wrong = f4.slice((1 - r) * 2..(2 - r) * 2).unwrap();
        let mut e = vec![
            // Reduce-scatter input must be size x output.
            comm.reduce_scatter(&mut dev, f2, f2, ReduceOp::Sum),
            // dtypes must match.
            comm.all_gather(&mut dev, b2, f4),
            // u8 cannot be reduced, with any op.
            comm.reduce_scatter(&mut dev, u4, u2, ReduceOp::Max),
            comm.all_reduce(&mut dev, u4, ReduceOp::Sum),
            // Root out of range.
            comm.broadcast(&mut dev, f4, 2),
        ];
        // In-place all-gather from the wrong slice.
        e.push(comm.all_gather(&mut dev, wrong, f4));
        // Partial overlap.
        e.push(comm.all_gather(&mut dev, f4.slice(1..3).unwrap(), f4));
        // In-place reduce-scatter into the wrong chunk.
        e.push(comm.reduce_scatter(&mut dev, f4, wrong, ReduceOp::Sum));
        // Two ops of one launch writing the same memory.
        e.push(comm.coalesced(
            &mut dev,
            &[
                Op::AllReduce {
                    buf: f4,
                    reduce: ReduceOp::Sum,
                },
                Op::Broadcast {
                    buf: f4.slice(0..1).unwrap(),
                    root: 0,
                },
            ],
        ));
        // A freed view.
        dev.free(f2).unwrap();
        e.push(comm.all_reduce(&mut dev, f2, ReduceOp::Sum));
        // The group is still usable after all of these.
        comm.all_reduce(&mut dev, f4, ReduceOp::Sum).unwrap();
        e.into_iter().map(|x| x.unwrap_err()).collect::<Vec<_>>()
    }));
    for (r, errs) in got.iter().enumerate() {
        let msgs: Vec<String> = errs.iter().map(ToString::to_string).collect();
        assert!(matches!(errs[0], CommError::Size { .. }), "{}", msgs[0]);
        assert!(matches!(errs[1], CommError::DType { .. }), "{}", msgs[1]);
        assert!(
            matches!(errs[2], CommError::DType { got: DType::U8, .. }),
            "{}",
            msgs[2]
        );
        assert!(msgs[2].contains("reduce_scatter #2") && msgs[2].contains("max"));
        assert!(matches!(errs[3], CommError::DType { .. }), "{}", msgs[3]);
        assert!(msgs[3].contains("all_reduce #3"), "{}", msgs[3]);
        assert!(
            matches!(
                errs[4],
                CommError::Root {
                    root: 2,
                    size: 2,
                    ..
                }
            ),
            "{}",
            msgs[4]
        );
        for i in 5..9 {
            assert!(matches!(errs[i], CommError::Overlap { .. }), "{}", msgs[i]);
        }
        assert!(
            msgs[5].contains(&format!("{}..{}", r * 2, r * 2 + 2)),
            "{}",
            msgs[5]
        );
        assert!(matches!(errs[9], CommError::Device { .. }), "{}", msgs[9]);
        for m in &msgs {
            assert!(m.contains(&format!("rank {r}")), "{m}");
        }
    }
}

/// A rank that never arrives: the waiting ranks get `Timeout` naming it, within the
/// configured time; the late rank then finds the group aborted.
#[test]
fn missing_rank_times_out() {
    let timeout = Duration::from_millis(200);
    let config = GroupConfig::default().with_timeout(timeout);
    let got = ok(run_ranks(3, config, |mut comm, mut dev| {
        let buf = dev.alloc(DType::F32, 2);
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(600));
            return (
                Duration::ZERO,
                comm.all_reduce(&mut dev, buf, ReduceOp::Sum),
            );
        }
        let start = Instant::now();
        let res = comm.all_reduce(&mut dev, buf, ReduceOp::Sum);
        (start.elapsed(), res)
    }));
    for (r, (took, res)) in got.iter().enumerate().take(2) {
        let e = res.as_ref().unwrap_err();
        let CommError::Timeout {
            op,
            rank,
            waited,
            missing,
        } = e
        else {
            panic!("rank {r}: {e}");
        };
        assert_eq!(
            (op.as_str(), *rank, missing.as_slice()),
            ("all_reduce #0", r, &[2][..])
        );
        assert!(*waited >= timeout / 2, "{waited:?}");
        assert!(*took < Duration::from_millis(500), "rank {r} took {took:?}");
    }
    let late = got[2].1.as_ref().unwrap_err();
    assert!(
        matches!(late, CommError::Aborted { reason, .. } if reason.contains("timed out")),
        "{late}"
    );
}

/// A rank that panics: the others fail with `PeerLost` naming it, well before the timeout, and
/// every later operation fails too.
#[test]
fn panicking_rank_aborts_the_others_promptly() {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(20));
    let start = Instant::now();
    let got = run_ranks(3, config, |mut comm, mut dev| {
        let buf = dev.alloc(DType::F32, 2);
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            panic!("injected failure");
        }
        let first = comm.all_reduce(&mut dev, buf, ReduceOp::Sum);
        let later = comm.barrier();
        (first, later)
    });
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    let e1 = got[1].as_ref().unwrap_err();
    assert_eq!(e1.rank, 1);
    assert_eq!(e1.message, "injected failure");
    assert!(e1.to_string().contains("rank 1 panicked: injected failure"));
    for r in [0, 2] {
        let (first, later) = got[r].as_ref().unwrap();
        for e in [first, later] {
            let e = e.as_ref().unwrap_err();
            let CommError::PeerLost {
                rank, lost, cause, ..
            } = e
            else {
                panic!("rank {r}: {e}");
            };
            assert_eq!((*rank, *lost), (r, 1));
            assert_eq!(cause, "its thread panicked");
        }
    }
}

/// A rank that returns without joining (dropping its communicator): the others fail at once.
#[test]
fn rank_leaving_early_aborts_waiters_promptly() {
    let config = GroupConfig::default().with_timeout(Duration::from_secs(20));
    let start = Instant::now();
    let got = ok(run_ranks(2, config, |mut comm, mut dev| {
        let buf = dev.alloc(DType::F32, 2);
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.all_reduce(&mut dev, buf, ReduceOp::Sum)
    }));
    assert!(start.elapsed() < Duration::from_secs(2));
    let e = got[0].as_ref().unwrap_err();
    assert!(
        matches!(e, CommError::PeerLost { lost: 1, cause, .. }
            if cause.contains("dropped its communicator without joining all_reduce #0")),
        "{e}"
    );
}

/// Leaving after joining everything is fine, even if the peer waits later.
#[test]
fn rank_leaving_after_its_last_op_is_fine() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let buf = put(&mut dev, DType::F32, &[1.0]);
        let work = comm.start_all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap();
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(100));
        }
        work.wait(&mut dev).unwrap();
        get(&dev, buf)[0]
    }));
    assert_eq!(got, vec![2.0, 2.0]);
}

#[test]
fn explicit_abort_reaches_every_group() {
    let got = ok(run_ranks(3, cfg(), |mut comm, mut dev| {
        let mut sub = comm.split(0, 0).unwrap();
        comm.barrier().unwrap();
        if comm.rank() == 2 {
            comm.abort("loss went NaN");
            return Vec::new();
        }
        let buf = dev.alloc(DType::F32, 1);
        vec![
            sub.all_reduce(&mut dev, buf, ReduceOp::Sum).unwrap_err(),
            comm.barrier().unwrap_err(),
        ]
    }));
    for errs in &got[..2] {
        for e in errs {
            assert!(
                matches!(e, CommError::Aborted { by_rank: 2, reason, .. } if reason == "loss went NaN"),
                "{e}"
            );
        }
    }
}

/// An output freed between start and wait is this rank's device error only.
#[test]
fn output_freed_before_wait() {
    let got = ok(run_ranks(2, cfg(), |mut comm, mut dev| {
        let input = dev.alloc(DType::F32, 1);
        let output = dev.alloc(DType::F32, 2);
        let work = comm.start_all_gather(&mut dev, input, output).unwrap();
        if comm.rank() == 0 {
            dev.free(output).unwrap();
        }
        work.wait(&mut dev)
    }));
    assert!(matches!(got[0], Err(CommError::Device { rank: 0, .. })));
    assert!(got[1].is_ok());
}
