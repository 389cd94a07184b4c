//! A dead rank is noticed in seconds (within 10 s), without GPUs:
//! - rank threads of the in-process group: a rank that drops out (returns an error, panics)
//!   makes the others' blocked collectives fail with `CommError::PeerLost` naming it;
//! - processes: this test binary runs itself as the ranks of a world of three that meet through
//!   the rendezvous and keep its connections as the liveness channel; one is killed (SIGKILL,
//!   SIGTERM, SIGSTOP), and the survivors must name it within the bound.
//!
//! The bound is a correctness bound (10 s: a dead rank must stop the job within it), not a benchmark; the measured times are
//! printed.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use lowbit_comm::liveness::{LivenessConfig, PeerEvent, install_signal_goodbye};
use lowbit_comm::rendezvous::RendezvousEnv;
use lowbit_comm::{CommError, Communicator, DType, GroupConfig, ReduceOp, run_ranks};

/// The bound on noticing a dead rank.
const BOUND: Duration = Duration::from_secs(10);
const CHILD: &str = "LOWBIT_LIVENESS_TEST_CHILD";
const STUCK: &str = "LOWBIT_LIVENESS_TEST_STUCK";
const WORLD: usize = 3;

/// Four rank threads run steps of all-reduces; rank 1 drops out at step 3 by returning
/// (`panics`: by panicking). The others, blocked in step 3's all-reduce, fail with
/// `PeerLost` naming rank 1, and so does every later operation.
fn thread_rank_drops_out(panics: bool) {
    // A long timeout: the failure must come from the loss, not from the timeout.
    let config = GroupConfig::default().with_timeout(Duration::from_secs(120));
    let start = Instant::now();
    let got = run_ranks(4, config, |mut comm, mut dev| {
        let buf = dev.alloc(DType::F32, 1024);
        for step in 0..100 {
            if comm.rank() == 1 && step == 3 {
                std::thread::sleep(Duration::from_millis(100));
                if panics {
                    panic!("rank 1 fails at step 3");
                }
                return None;
            }
            if let Err(e) = comm.all_reduce(&mut dev, buf, ReduceOp::Sum) {
                let later = comm.barrier().err();
                return Some((step, e, later, start.elapsed()));
            }
        }
        panic!("rank {} was never told of the loss", comm.rank());
    });
    for (r, result) in got.into_iter().enumerate() {
        if r == 1 {
            assert_eq!(result.is_err(), panics, "rank 1: {result:?}");
            continue;
        }
        let Ok(Some((step, e, later, elapsed))) = result else {
            panic!("rank {r}: expected an error at step 3, got {result:?}");
        };
        println!("rank {r} noticed the loss of rank 1 after {elapsed:.2?} ({e})");
        assert_eq!(step, 3, "rank {r}");
        assert!(elapsed < BOUND, "rank {r} took {elapsed:?}");
        for e in [Some(e), later].into_iter().flatten() {
            assert!(
                matches!(&e, CommError::PeerLost { rank, lost: 1, .. } if *rank == r),
                "rank {r}: {e}"
            );
            assert!(e.to_string().contains("world rank 1 was lost"), "{e}");
        }
    }
}

#[test]
fn a_thread_rank_returning_early_fails_the_others_naming_it() {
    thread_rank_drops_out(false);
}

#[test]
fn a_thread_rank_panicking_fails_the_others_naming_it() {
    thread_rank_drops_out(true);
}

/// A child rank: meets the others, says `ready`, then waits for a loss and reports it as
/// `LOST <rank> <cause>` (exit 3), or gives up after 30 s (exit 4).
#[test]
fn liveness_child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    install_signal_goodbye();
    let env = RendezvousEnv::from_env().unwrap();
    // STUCK: this rank's work never returns after a loss, so only the exit backstop ends it.
    let stuck = std::env::var_os(STUCK).is_some_and(|v| !v.is_empty());
    let config = LivenessConfig {
        silence: Duration::from_secs(3),
        exit_after_loss: stuck.then_some(Duration::from_secs(1)),
        ..LivenessConfig::default()
    };
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    let (payload, live) = env
        .exchange_live(
            || Ok(b"payload".to_vec()),
            Duration::from_secs(30),
            config,
            move |e: &PeerEvent| {
                let _ = tx.lock().unwrap().send(e.clone());
            },
        )
        .unwrap();
    assert_eq!(payload, b"payload");
    println!("ready");
    match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(PeerEvent::Lost { rank, cause }) => {
            println!("LOST {rank} {cause}");
            assert_eq!(live.lost(), Some(PeerEvent::Lost { rank, cause }));
            if stuck {
                std::thread::sleep(Duration::from_secs(60));
            }
            std::process::exit(3);
        }
        other => {
            println!("no loss: {other:?}");
            std::process::exit(4);
        }
    }
}

/// Starts the three ranks (the last one `late`; all `stuck` after a loss) and waits until each
/// has said `ready`.
fn start_world(late: Duration, stuck: bool) -> (Vec<Child>, Vec<mpsc::Receiver<String>>) {
    let port = common::free_port();
    let mut children = Vec::new();
    let mut lines = Vec::new();
    for r in 0..WORLD {
        if r == WORLD - 1 {
            std::thread::sleep(late);
        }
        let mut child = common::rank_command("liveness_child", CHILD, r, WORLD, port)
            .env("LOWBIT_RDZV_TOKEN", "liveness test token")
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            .env_remove("LOWBIT_RDZV_PORT")
            .env(STUCK, if stuck { "1" } else { "" })
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        children.push(child);
        lines.push(rx);
    }
    for (r, rx) in lines.iter().enumerate() {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                // libtest may print its "test … " prefix on the same line.
                Ok(l) if l.ends_with("ready") => break,
                Ok(_) => {}
                Err(e) => {
                    kill_all(&mut children);
                    panic!("rank {r} never got ready: {e}");
                }
            }
        }
    }
    (children, lines)
}

fn kill_all(children: &mut [Child]) {
    for c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// Sends `signal` to the child by `kill(1)` (no libc binding in the tests).
fn signal(child: &Child, signal: &str) {
    let ok = Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok, "kill -{signal} failed");
}

/// Kills rank `victim` with `how`, and checks that every other rank reports its loss, with
/// `cause` in the message, within the bound (the last rank joins `late`; `stuck`: the survivors
/// must then be ended by the exit backstop, status 1, within the bound too).
fn survivors_name_after(late: Duration, stuck: bool, victim: usize, how: &str, cause: &str) {
    let (mut children, lines) = start_world(late, stuck);
    // Mid-run: the heartbeats have been flowing for a while.
    std::thread::sleep(Duration::from_millis(1500));
    let start = Instant::now();
    if how == "KILL" {
        children[victim].kill().unwrap();
    } else {
        signal(&children[victim], how);
    }
    for (r, rx) in lines.iter().enumerate().filter(|(r, _)| *r != victim) {
        let got = loop {
            match rx.recv_timeout(BOUND.saturating_sub(start.elapsed())) {
                Ok(l) if l.contains("LOST ") => {
                    break l[l.find("LOST ").unwrap_or(0)..].to_string();
                }
                Ok(_) => {}
                Err(e) => {
                    kill_all(&mut children);
                    panic!("rank {r} did not report the loss of rank {victim} in {BOUND:?}: {e}");
                }
            }
        };
        let elapsed = start.elapsed();
        println!("SIG{how} of rank {victim}: rank {r} noticed after {elapsed:.2?}: {got}");
        assert!(
            got.starts_with(&format!("LOST {victim} ")),
            "rank {r}: {got}"
        );
        assert!(got.contains(cause), "rank {r}: {got}");
        assert!(elapsed < BOUND);
        let status = children[r].wait().unwrap();
        let took = start.elapsed();
        println!("rank {r} exited with {status} after {took:.2?}");
        assert_eq!(status.code(), Some(if stuck { 1 } else { 3 }), "rank {r}");
        assert!(took < BOUND, "rank {r} exited after {took:?}");
    }
    kill_all(&mut children);
}

fn survivors_name(victim: usize, how: &str, cause: &str) {
    survivors_name_after(Duration::ZERO, false, victim, how, cause);
}

/// Survivors whose work never returns are ended by the exit backstop.
#[test]
fn stuck_survivors_are_ended_by_the_exit_backstop() {
    survivors_name_after(Duration::ZERO, true, 1, "KILL", "closed without a goodbye");
}

/// Rank 0 starts its side of the channel only when the last rank has arrived; the early ranks
/// must not take that wait (longer than the children's 3 s silence) for a loss of rank 0.
#[test]
fn a_late_rank_does_not_make_rank_0_look_lost() {
    survivors_name_after(
        Duration::from_secs(5),
        false,
        2,
        "KILL",
        "closed without a goodbye",
    );
}

/// Each case: (victim, signal, the cause the survivors must name). A killed rank (rank 0 too)
/// closes its connection without a goodbye; a terminated one says goodbye with its signal; a
/// stopped one is lost by its silence.
#[test]
fn a_lost_rank_is_named_by_every_survivor() {
    for (victim, how, cause) in [
        (1, "KILL", "closed without a goodbye"),
        (2, "TERM", "SIGTERM"),
        (0, "KILL", "closed without a goodbye"),
        (1, "STOP", "nothing heard from it"),
    ] {
        survivors_name(victim, how, cause);
    }
}

/// A rank that drops its handle says it left (finished): the others hear `Left`, never a loss,
/// and rank 0 relays it. Three ranks as threads of this process, each with its own environment.
#[test]
fn a_rank_that_finishes_is_reported_as_left_not_lost() {
    let port = common::free_port();
    let events: Vec<_> = (0..WORLD).map(|_| mpsc::channel()).collect();
    let handles: Vec<_> = events
        .iter()
        .enumerate()
        .map(|(r, (tx, _))| {
            let tx = std::sync::Mutex::new(tx.clone());
            std::thread::spawn(move || {
                let vars = [
                    ("RANK", r.to_string()),
                    ("WORLD_SIZE", WORLD.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".to_string()),
                    ("MASTER_PORT", port.to_string()),
                    ("LOWBIT_RDZV_TOKEN", "left test".to_string()),
                ];
                let env = RendezvousEnv::from_lookup(|k| {
                    vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
                })
                .unwrap();
                let on_event = move |e: &PeerEvent| {
                    let _ = tx.lock().unwrap().send(e.clone());
                };
                let timeout = Duration::from_secs(30);
                let config = LivenessConfig::default();
                env.exchange_live(|| Ok(vec![7]), timeout, config, on_event)
                    .unwrap()
                    .1
            })
        })
        .collect();
    let mut live: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // Heartbeats flow for a while, then rank 2 finishes.
    std::thread::sleep(Duration::from_millis(1500));
    drop(live.pop());
    for (r, (_, rx)) in events.iter().enumerate().take(2) {
        let got = rx.recv_timeout(BOUND).unwrap();
        assert_eq!(got, PeerEvent::Left { rank: 2 }, "rank {r}");
        assert_eq!(live[r].lost(), None, "rank {r}");
    }
    // Nothing else happens to the two that stay.
    std::thread::sleep(Duration::from_millis(1500));
    for (r, (_, rx)) in events.iter().enumerate().take(2) {
        assert!(rx.try_recv().is_err(), "rank {r}");
    }
}
