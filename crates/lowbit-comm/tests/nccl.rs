//! NCCL on two GPUs against the in-process group on the same inputs, bit for bit; coalesced
//! launches, ordering against the device stream, rejected arguments, timeouts and aborts that
//! end instead of hanging, splits, and two processes meeting through the TCP rendezvous.
//!
//! These tests need two GPUs and NCCL: without them they fail, they do not skip. Run them one at
//! a time (`--test-threads=1`): each opens a world on both GPUs.

#![cfg(feature = "cuda")]

mod common;

use std::sync::Barrier;
use std::time::{Duration, Instant};

use common::{FLOATS, OPS, decode, encode};
use lowbit_comm::nccl::{NcclComm, NcclConfig, run_local_ranks_with};
use lowbit_comm::rendezvous::RendezvousEnv;
use lowbit_comm::{CommError, CommStats, Communicator, GroupConfig, Op, ReduceOp, run_ranks};
use lowbit_device::{DType, Device, View};

const GPUS: usize = 2;
const DTYPES: [DType; 4] = [DType::F32, DType::Bf16, DType::F16, DType::U8];
/// Per-rank element counts: one element, an odd count, and over a million (several NCCL
/// chunks and channels).
const SIZES: [usize; 3] = [1, 1001, (1 << 20) + 3];

fn cfg() -> NcclConfig {
    NcclConfig::default().with_timeout(Duration::from_secs(60))
}

/// Runs `f` on both GPUs; any setup failure or rank error fails the test.
fn nccl<T: Send>(f: impl Fn(NcclComm, Device) -> T + Sync) -> Vec<T> {
    nccl_with(cfg(), f)
}

fn nccl_with<T: Send>(cfg: NcclConfig, f: impl Fn(NcclComm, Device) -> T + Sync) -> Vec<T> {
    run_local_ranks_with(GPUS, cfg, f)
        .unwrap_or_else(|e| panic!("NCCL setup failed (these tests need {GPUS} GPUs): {e}"))
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// The same on CPU rank threads (the oracle).
fn local<T: Send>(f: impl Fn(lowbit_comm::LocalComm, Device) -> T + Sync) -> Vec<T> {
    let cfg = GroupConfig::default().with_timeout(Duration::from_secs(60));
    run_ranks(GPUS, cfg, f)
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect()
}

/// Deterministic random bytes of `n` elements of `dtype` for `rank` (floats uniform in
/// [-8, 8), rounded to the dtype; never NaN; u8 any byte).
fn random(dtype: DType, rank: usize, n: usize, salt: u64) -> Vec<u8> {
    let mut s =
        0x9e37_79b9_7f4a_7c15u64 ^ ((rank as u64) << 32) ^ salt.wrapping_mul(0x1234_5678_9abc);
    let mut next = move || {
        s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    };
    if dtype == DType::U8 {
        return (0..n).map(|_| next() as u8).collect();
    }
    // f16 keeps clear of its subnormals, where NCCL's pre-multiplied average (x · 1/2 in f16)
    // rounds and the in-process `(a + b) / 2` does not (a documented difference).
    let vals: Vec<f32> = (0..n)
        .map(|_| ((next() >> 40) as f32 / (1u64 << 24) as f32) * 16.0 - 8.0)
        .map(|v| {
            if dtype == DType::F16 && v.abs() < 1e-3 {
                0.5
            } else {
                v
            }
        })
        .collect();
    encode(dtype, &vals)
}

fn put(dev: &mut Device, dtype: DType, bytes: &[u8]) -> View {
    let v = dev.alloc(dtype, bytes.len() / dtype.size());
    dev.write_bytes(v, bytes).unwrap();
    v
}

/// Every rank's bytes from the NCCL run and the in-process run of `body` (one world each, every
/// case of the test in it), asserted equal case by case.
fn same_on_both<B>(what: &str, body: B)
where
    B: Fn(&mut dyn Communicator, &mut Device) -> Vec<(String, Vec<u8>)> + Sync,
{
    same_on_both_with(cfg(), what, body)
}

fn same_on_both_with<B>(cfg: NcclConfig, what: &str, body: B)
where
    B: Fn(&mut dyn Communicator, &mut Device) -> Vec<(String, Vec<u8>)> + Sync,
{
    let got = nccl_with(cfg, |mut c, mut d| {
        let out = body(&mut c, &mut d);
        d.synchronize().unwrap();
        out
    });
    let want = local(|mut c, mut d| body(&mut c, &mut d));
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: rank {r}: case count");
        for ((case, g), (_, w)) in g.iter().zip(w) {
            if g != w {
                let first = g.iter().zip(w).position(|(a, b)| a != b);
                panic!(
                    "{what}: {case}: rank {r}: NCCL differs from the in-process group ({} vs {} \
                     bytes, first difference at byte {first:?})",
                    g.len(),
                    w.len()
                );
            }
        }
    }
}

/// [`same_on_both`] of `run` on every case of `cases`, each named by its `Debug` form.
fn each_on_both<C: Copy + std::fmt::Debug + Sync>(
    what: &str,
    cases: &[C],
    run: impl Fn(&mut dyn Communicator, &mut Device, C) -> Vec<u8> + Sync,
) {
    same_on_both(what, |c, d| {
        let named = cases
            .iter()
            .map(|&case| (format!("{case:?}"), run(c, d, case)));
        named.collect()
    });
}

/// Every pair of an element of `a` and one of `b`, `b` varying fastest.
fn pairs<A: Copy, B: Copy>(a: &[A], b: &[B]) -> Vec<(A, B)> {
    a.iter()
        .flat_map(|&x| b.iter().map(move |&y| (x, y)))
        .collect()
}

#[test]
fn all_gather_matches_local() {
    let cases = pairs(&pairs(&DTYPES, &SIZES), &[false, true]);
    each_on_both("all_gather", &cases, |c, d, ((dtype, n), in_place)| {
        let r = c.rank();
        let bytes = random(dtype, r, n, 1);
        let gathered = d.alloc(dtype, GPUS * n);
        let input = if in_place {
            let v = gathered.slice(r * n..(r + 1) * n).unwrap();
            d.write_bytes(v, &bytes).unwrap();
            v
        } else {
            put(d, dtype, &bytes)
        };
        c.all_gather(d, input, gathered).unwrap();
        d.read_bytes(gathered).unwrap()
    });
}

#[test]
fn reduce_scatter_matches_local() {
    let cases = pairs(&pairs(&pairs(&FLOATS, &OPS), &SIZES), &[false, true]);
    each_on_both(
        "reduce_scatter",
        &cases,
        |c, d, (((dtype, op), n), in_place)| {
            let r = c.rank();
            let input = put(d, dtype, &random(dtype, r, GPUS * n, 2));
            let shard = if in_place {
                input.slice(r * n..(r + 1) * n).unwrap()
            } else {
                d.alloc(dtype, n)
            };
            c.reduce_scatter(d, input, shard, op).unwrap();
            d.read_bytes(shard).unwrap()
        },
    );
}

#[test]
fn all_reduce_matches_local() {
    let cases = pairs(&pairs(&FLOATS, &OPS), &SIZES);
    each_on_both("all_reduce", &cases, |c, d, ((dtype, op), n)| {
        let buf = put(d, dtype, &random(dtype, c.rank(), n, 3));
        c.all_reduce(d, buf, op).unwrap();
        d.read_bytes(buf).unwrap()
    });
}

#[test]
fn broadcast_matches_local() {
    let roots: Vec<usize> = (0..GPUS).collect();
    each_on_both(
        "broadcast",
        &pairs(&DTYPES, &roots),
        |c, d, (dtype, root)| {
            let buf = put(d, dtype, &random(dtype, c.rank(), 4099, 4));
            c.broadcast(d, buf, root).unwrap();
            d.read_bytes(buf).unwrap()
        },
    );
}

/// The launch a bucket group makes: gathers, reductions and a broadcast in one group call,
/// in place where buckets are; plus statistics equal to the in-process group's.
#[test]
fn coalesced_launch_and_stats_match_local() {
    for nonblocking in [false, true] {
        coalesced(cfg().with_nonblocking(nonblocking));
    }
}

fn coalesced(cfg: NcclConfig) {
    let what = format!("coalesced (nonblocking: {})", cfg.nonblocking);
    same_on_both_with(cfg, &what, |c, d| {
        let r = c.rank();
        let n = 70_001;
        let gathered = d.alloc(DType::Bf16, GPUS * n);
        let shard = gathered.slice(r * n..(r + 1) * n).unwrap();
        d.write_bytes(shard, &random(DType::Bf16, r, n, 5)).unwrap();
        let grads = put(d, DType::F32, &random(DType::F32, r, GPUS * n, 6));
        let grad_shard = grads.slice(r * n..(r + 1) * n).unwrap();
        let amax = put(d, DType::F32, &random(DType::F32, r, 33, 7));
        let bytes = put(d, DType::U8, &random(DType::U8, r, 5000, 8));
        let fp8 = d.alloc(DType::U8, GPUS * 300);
        let fp8_in = put(d, DType::U8, &random(DType::U8, r, 300, 9));
        let ops = [
            Op::AllGather {
                input: shard,
                output: gathered,
            },
            Op::ReduceScatter {
                input: grads,
                output: grad_shard,
                reduce: ReduceOp::Avg,
            },
            Op::AllReduce {
                buf: amax,
                reduce: ReduceOp::Max,
            },
            Op::Broadcast {
                buf: bytes,
                root: 1,
            },
            Op::AllGather {
                input: fp8_in,
                output: fp8,
            },
        ];
        let work = c.start_coalesced(d, &ops).unwrap();
        work.wait(d).unwrap();
        let mut out = Vec::new();
        for v in [gathered, grad_shard, amax, bytes, fp8] {
            out.extend(d.read_bytes(v).unwrap());
        }
        let s = c.stats();
        assert_eq!(s.launches, 1);
        assert_eq!(s.all_gather.calls, 2);
        out.extend(format!("{s:?}").into_bytes());
        vec![("five ops".to_string(), out)]
    });
}

/// Ordering: a collective sees what the device stream wrote before `start`, the device sees the
/// result after `wait`, and device work enqueued between `start` and `wait` runs alongside.
#[test]
fn collectives_are_ordered_with_the_device_stream() {
    let n = 8 << 20; // 32 MiB of f32 per rank: the upload is still running at `start`
    let got = nccl(|mut c, mut d| {
        let r = c.rank();
        let input = d.alloc(DType::F32, n);
        let out = d.alloc(DType::F32, GPUS * n);
        let copy = d.alloc(DType::F32, GPUS * n);
        let other = d.alloc(DType::F32, n);
        for round in 0..4u64 {
            let bytes = random(DType::F32, r, n, 100 + round);
            d.write_bytes(input, &bytes).unwrap();
            let work = c.start_all_gather(&mut d, input, out).unwrap();
            // Unrelated compute between start and wait.
            d.fill(other, round as f32).unwrap();
            work.wait(&mut d).unwrap();
            // A device op after wait reads the gathered data.
            d.copy(out, copy).unwrap();
            let got = d.read_bytes(copy).unwrap();
            let mine = &got[r * n * 4..(r + 1) * n * 4];
            assert_eq!(mine, &bytes[..], "round {round}: own shard");
            let peer = 1 - r;
            let want = random(DType::F32, peer, n, 100 + round);
            assert_eq!(
                &got[peer * n * 4..(peer + 1) * n * 4],
                &want[..],
                "round {round}: peer shard"
            );
            assert_eq!(
                decode(
                    DType::F32,
                    &d.read_bytes(other.slice(0..1).unwrap()).unwrap()
                ),
                vec![round as f32]
            );
        }
        // Launch many without waiting in between, then wait for all: outputs all arrive.
        let bufs: Vec<View> = (0..8)
            .map(|i| put(&mut d, DType::Bf16, &random(DType::Bf16, r, 1000, 200 + i)))
            .collect();
        let works: Vec<_> = bufs
            .iter()
            .map(|&b| c.start_all_reduce(&mut d, b, ReduceOp::Sum).unwrap())
            .collect();
        for w in works {
            w.wait(&mut d).unwrap();
        }
        bufs.iter()
            .flat_map(|&b| d.read_bytes(b).unwrap())
            .collect::<Vec<u8>>()
    });
    assert_eq!(got[0], got[1], "all-reduce results agree across ranks");
}

#[test]
fn bad_arguments_are_rejected_before_nccl_and_leave_the_communicator_usable() {
    let results = nccl(|mut c, mut d| {
        let mut errors = Vec::new();
        let input = d.alloc(DType::Bf16, 10);
        let short = d.alloc(DType::Bf16, 19);
        errors.push(c.all_gather(&mut d, input, short).unwrap_err());
        let wrong = d.alloc(DType::F32, 20);
        errors.push(c.all_gather(&mut d, input, wrong).unwrap_err());
        let bytes = d.alloc(DType::U8, 20);
        let half = d.alloc(DType::U8, 10);
        errors.push(
            c.reduce_scatter(&mut d, bytes, half, ReduceOp::Sum)
                .unwrap_err(),
        );
        let big = d.alloc(DType::F32, 20);
        errors.push(
            c.reduce_scatter(&mut d, big, big.slice(3..13).unwrap(), ReduceOp::Sum)
                .unwrap_err(),
        );
        errors.push(c.broadcast(&mut d, input, 2).unwrap_err());
        let freed = d.alloc(DType::F32, 4);
        d.free(freed).unwrap();
        errors.push(c.all_reduce(&mut d, freed, ReduceOp::Sum).unwrap_err());
        let mut cpu = Device::cpu();
        let on_cpu = cpu.alloc(DType::F32, 4);
        errors.push(c.all_reduce(&mut cpu, on_cpu, ReduceOp::Sum).unwrap_err());
        // Still works afterwards.
        let ok = put(&mut d, DType::F32, &encode(DType::F32, &[1.0, 2.0]));
        c.all_reduce(&mut d, ok, ReduceOp::Sum).unwrap();
        let sum = decode(DType::F32, &d.read_bytes(ok).unwrap());
        (errors, sum)
    });
    // What each refused call must have returned, in order.
    let expected: [fn(&CommError) -> bool; 7] = [
        |e| {
            matches!(
                e,
                CommError::Size {
                    expected: 20,
                    got: 19,
                    ..
                }
            )
        },
        |e| matches!(e, CommError::DType { .. }),
        |e| matches!(e, CommError::DType { .. }),
        |e| matches!(e, CommError::Overlap { .. }),
        |e| matches!(e, CommError::Root { root: 2, .. }),
        |e| matches!(e, CommError::Device { .. }),
        |e| matches!(e, CommError::Device { .. }),
    ];
    for (errors, sum) in results {
        assert_eq!(sum, vec![2.0, 4.0]);
        assert_eq!(errors.len(), expected.len());
        for (i, (e, expected)) in errors.iter().zip(expected).enumerate() {
            assert!(expected(e), "error {i}: {e}");
        }
    }
}

#[test]
fn split_and_barrier() {
    let got = nccl(|mut c, mut d| {
        c.barrier().unwrap();
        // Both in one group, ranks reversed by key.
        let mut rev = c.split_nccl(0, (GPUS - c.rank()) as u32).unwrap();
        let me = put(&mut d, DType::F32, &encode(DType::F32, &[c.rank() as f32]));
        let all = d.alloc(DType::F32, GPUS);
        rev.all_gather(&mut d, me, all).unwrap();
        let order = decode(DType::F32, &d.read_bytes(all).unwrap());
        // Each alone.
        let mut alone = c.split(c.rank() as u32, 0).unwrap();
        let buf = put(&mut d, DType::F32, &encode(DType::F32, &[3.0]));
        alone.all_reduce(&mut d, buf, ReduceOp::Sum).unwrap();
        let single = decode(DType::F32, &d.read_bytes(buf).unwrap());
        rev.barrier().unwrap();
        (
            rev.rank(),
            rev.size(),
            order,
            alone.size(),
            single,
            c.stats(),
        )
    });
    for (r, (rank, size, order, alone, single, stats)) in got.into_iter().enumerate() {
        assert_eq!((rank, size), (GPUS - 1 - r, GPUS));
        assert_eq!(order, vec![1.0, 0.0]);
        assert_eq!(alone, 1);
        assert_eq!(single, vec![3.0]);
        assert_eq!(
            stats,
            CommStats {
                barriers: 1,
                ..CommStats::default()
            }
        );
    }
}

/// A rank that never joins: the other's launch is aborted at its timeout, and the device
/// synchronisation that waits on it returns instead of hanging.
#[test]
fn a_missing_rank_times_out_instead_of_hanging() {
    for nonblocking in [true, false] {
        missing_rank(nonblocking);
    }
}

fn missing_rank(nonblocking: bool) {
    let done = Barrier::new(GPUS);
    let cfg = NcclConfig::default()
        .with_timeout(Duration::from_secs(5))
        .with_nonblocking(nonblocking);
    let t0 = Instant::now();
    let got = run_local_ranks_with(GPUS, cfg, |mut c, mut d| {
        // Connect first, so the timeout measures the missing rank, not setup. (A barrier is a
        // one-element f32 all-reduce, so the launch below needs no new connections: with a
        // blocking communicator, connecting would block the host on the missing peer.)
        c.barrier().unwrap();
        let result = if c.rank() == 0 {
            let buf = put(&mut d, DType::F32, &encode(DType::F32, &[1.0]));
            let work = c.start_all_reduce(&mut d, buf, ReduceOp::Sum).unwrap();
            let _ = work.wait(&mut d);
            let _ = d.synchronize();
            let later = c.all_reduce(&mut d, buf, ReduceOp::Sum);
            Some(later)
        } else {
            None
        };
        done.wait();
        result
    })
    .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(60),
        "took {:?}",
        t0.elapsed()
    );
    let rank0 = got[0].as_ref().unwrap().as_ref().unwrap();
    match rank0 {
        Err(CommError::Timeout { .. }) | Err(CommError::Aborted { .. }) => {}
        other => panic!("rank 0 (nonblocking: {nonblocking}): expected a timeout, got {other:?}"),
    }
}

/// `abort` on one rank fails the other's pending launch promptly (same process).
#[test]
fn abort_reaches_the_other_rank() {
    let started = Barrier::new(GPUS);
    let t0 = Instant::now();
    let got = nccl(|mut c, mut d| {
        c.barrier().unwrap();
        if c.rank() == 1 {
            started.wait();
            std::thread::sleep(Duration::from_millis(200));
            c.abort("test abort");
            return None;
        }
        let buf = put(&mut d, DType::F32, &encode(DType::F32, &[1.0]));
        let work = c.start_all_reduce(&mut d, buf, ReduceOp::Sum).unwrap();
        started.wait();
        let _ = work.wait(&mut d);
        let _ = d.synchronize();
        Some(c.barrier())
    });
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    match &got[0] {
        Some(Err(CommError::Aborted {
            by_rank: 1, reason, ..
        })) => {
            assert_eq!(reason, "test abort")
        }
        other => panic!("rank 0: {other:?}"),
    }
}

const CHILD: &str = "LOWBIT_NCCL_TEST_CHILD";

/// Two processes, one GPU each, meeting through the environment as torchrun sets it: this test
/// runs its own binary twice (as `multi_process_child`) and checks both succeed.
#[test]
fn two_processes_through_the_rendezvous() {
    let port = common::free_port();
    let mut children: Vec<_> = (0..GPUS)
        .map(|r| {
            common::rank_command("multi_process_child", CHILD, r, GPUS, port)
                .env("LOCAL_RANK", r.to_string())
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::inherit())
                .spawn()
                .unwrap()
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut statuses = [None; GPUS];
    while statuses.iter().any(Option::is_none) {
        for (r, c) in children.iter_mut().enumerate() {
            if statuses[r].is_none() {
                statuses[r] = c.try_wait().unwrap();
            }
        }
        if Instant::now() > deadline {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("the child processes did not finish within 180 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, c) in children.into_iter().enumerate() {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "child {r} failed: {:?}\n{text}",
            out.status
        );
        assert!(
            text.contains(&format!("child rank {r} of {GPUS}: ok")),
            "child {r} did not report:\n{text}"
        );
    }
}

/// The child of [`two_processes_through_the_rendezvous`]; does nothing in a normal run.
#[test]
fn multi_process_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let env = RendezvousEnv::from_env().unwrap();
    let mut dev = Device::cuda(env.local_rank).unwrap();
    let mut comm = NcclComm::from_env(&dev, &env, cfg()).unwrap();
    assert_eq!((comm.rank(), comm.size()), (env.rank, env.world_size));
    let r = comm.rank();
    let n = 100_003;
    // The reference: both ranks' inputs through the in-process group on this host.
    let body = |c: &mut dyn Communicator, d: &mut Device| {
        let q = c.rank();
        let gathered = d.alloc(DType::Bf16, GPUS * n);
        let mine = put(d, DType::Bf16, &random(DType::Bf16, q, n, 50));
        c.all_gather(d, mine, gathered).unwrap();
        let grads = put(d, DType::F32, &random(DType::F32, q, GPUS * n, 51));
        let shard = d.alloc(DType::F32, n);
        c.reduce_scatter(d, grads, shard, ReduceOp::Sum).unwrap();
        let bytes = put(d, DType::U8, &random(DType::U8, q, 777, 52));
        c.broadcast(d, bytes, 1).unwrap();
        let mut out = d.read_bytes(gathered).unwrap();
        out.extend(d.read_bytes(shard).unwrap());
        out.extend(d.read_bytes(bytes).unwrap());
        out
    };
    let got = body(&mut comm, &mut dev);
    let want = local(|mut c, mut d| body(&mut c, &mut d));
    assert!(
        got == want[r],
        "rank {r}: NCCL across processes differs from the in-process group"
    );
    comm.barrier().unwrap();
    println!("child rank {r} of {}: ok", env.world_size);
}

const LIVENESS_CHILD: &str = "LOWBIT_NCCL_LIVENESS_CHILD";

/// A dead rank noticed within seconds, on two GPUs through the library: two processes (this binary as
/// `liveness_child`) all-reduce in a loop; rank 1 is killed (SIGKILL) mid-run, and rank 0 must
/// end within 10 s naming it: `CommError::PeerLost { lost: 1 }` from its collective (exit 3),
/// or the liveness channel's exit backstop (status 1, its message on stderr).
#[test]
fn a_killed_process_fails_the_other_within_seconds() {
    use std::io::{BufRead, BufReader};
    let port = common::free_port();
    let mut children: Vec<_> = (0..GPUS)
        .map(|r| {
            common::rank_command("liveness_child", LIVENESS_CHILD, r, GPUS, port)
                .env("LOCAL_RANK", r.to_string())
                .env("NCCL_NVLS_ENABLE", "0")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Wait for rank 0's "looping" (the collectives run), then kill rank 1.
    let mut out0 = BufReader::new(children[0].stdout.take().unwrap());
    let mut line = String::new();
    while !line.contains("looping") {
        line.clear();
        if out0.read_line(&mut line).unwrap_or(0) == 0 {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("rank 0 ended before its collectives ran");
        }
    }
    std::thread::sleep(Duration::from_secs(1));
    let t0 = Instant::now();
    children[1].kill().unwrap();
    let _ = children[1].wait();
    let status = loop {
        if let Some(s) = children[0].try_wait().unwrap() {
            break s;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            let _ = children[0].kill();
            panic!("rank 0 still running 30 s after rank 1 was killed");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = t0.elapsed();
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut out0, &mut rest);
    let mut err = String::new();
    let _ = std::io::Read::read_to_string(children[0].stderr.as_mut().unwrap(), &mut err);
    println!("rank 0 ended {took:.2?} after the kill of rank 1 ({status}): {rest}");
    assert!(took < Duration::from_secs(10), "took {took:?}\n{err}");
    assert!(!status.success(), "{status}");
    assert!(
        rest.contains("PEERLOST 1") || err.contains("world rank 1 was lost"),
        "rank 0 did not name rank 1:\n{rest}\n{err}"
    );
}

/// The child of [`a_killed_process_fails_the_other_within_seconds`]; does nothing in a normal
/// run.
#[test]
fn liveness_child() {
    if std::env::var_os(LIVENESS_CHILD).is_none() {
        return;
    }
    let env = RendezvousEnv::from_env().unwrap();
    let mut dev = Device::cuda(env.local_rank).unwrap();
    let mut comm = NcclComm::from_env(&dev, &env, cfg()).unwrap();
    let buf = put(
        &mut dev,
        DType::F32,
        &encode(DType::F32, &vec![1.0; 1 << 16]),
    );
    let mut announced = false;
    loop {
        if let Err(e) = comm
            .all_reduce(&mut dev, buf, ReduceOp::Sum)
            .and_then(|()| comm.barrier())
        {
            match e {
                CommError::PeerLost { lost, .. } => println!("PEERLOST {lost}: {e}"),
                other => println!("OTHER {other}"),
            }
            std::process::exit(3);
        }
        if !announced {
            println!("looping");
            announced = true;
        }
    }
}
