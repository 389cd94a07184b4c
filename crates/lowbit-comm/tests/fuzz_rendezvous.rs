//! Fuzzing the rank-0 rendezvous server on loopback: a proptest
//! byte-mutation harness feeds one long-lived server garbage, mutated and truncated hellos, and
//! a real client's hello and proof mutated in flight by a relay (the challenge–response), and
//! asserts that the server never panics, drops every such peer within its handshake deadline
//! without ever sending it the payload, and keeps serving: real ranks complete the rendezvous
//! between and after the cases.
//!
//! The cases are deterministic (a fixed seed), so a failure reproduces; `LOWBIT_FUZZ_CASES`
//! sets their number (CI runs the default). A crash found here becomes its own regression test
//! below the harness.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use lowbit_comm::rendezvous::{
    MAGIC, RendezvousError, RendezvousSecret, RendezvousServer, ServeOptions, VERSION, fetch_with,
};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

const WORLD: usize = 3;
const HANDSHAKE: Duration = Duration::from_millis(500);
/// How long the server may take to drop a bad peer: its handshake deadline and slack.
const DROPPED_WITHIN: Duration = Duration::from_secs(5);

fn cases() -> u32 {
    lowbit_dev_support::fuzz_cases(48)
}

fn secret() -> RendezvousSecret {
    RendezvousSecret::from_token(b"fuzz token")
}

fn payload() -> Vec<u8> {
    (0..128u32).map(|i| (i * 29 + 3) as u8).collect()
}

/// What one case sends.
#[derive(Clone, Debug)]
enum Input {
    /// Raw bytes (garbage, or a hello with mutations), then a half-close.
    Raw(Vec<u8>),
    /// A real client (rank 1) whose stream to rank 0 is changed in flight: byte `at` (of the
    /// 52-byte hello and 32-byte proof) xor `flip`, or cut after `cut` bytes.
    Relayed {
        at: usize,
        flip: u8,
        cut: Option<usize>,
    },
}

/// A hello as a rank sends it: magic, version, rank, world, a nonce.
fn hello(rank: u32, world: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    for w in [VERSION, rank, world] {
        h.extend_from_slice(&w.to_le_bytes());
    }
    h.extend_from_slice(&[0x5a; 32]);
    h
}

fn input() -> impl Strategy<Value = Input> {
    let garbage = prop::collection::vec(any::<u8>(), 0..160).prop_map(Input::Raw);
    let mutated_hello = (
        0u32..5,
        0u32..5,
        prop::collection::vec((0usize..52, any::<u8>()), 0..4),
        prop::option::of(0usize..60),
        prop::collection::vec(any::<u8>(), 0..40),
    )
        .prop_map(|(rank, world, changes, cut, tail)| {
            let mut h = hello(rank, world);
            for (i, b) in changes {
                h[i] = b;
            }
            h.extend_from_slice(&tail);
            if let Some(c) = cut {
                h.truncate(c);
            }
            Input::Raw(h)
        });
    let relayed = (0usize..84, 1u8..=255, prop::option::of(0usize..84))
        .prop_map(|(at, flip, cut)| Input::Relayed { at, flip, cut });
    prop_oneof![garbage, mutated_hello, relayed]
}

/// Whether `bytes` hold an accepted reply (status 0), which only a real rank may get.
fn has_accepted_reply(bytes: &[u8]) -> bool {
    let mut head = MAGIC.to_vec();
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&0u32.to_le_bytes());
    bytes.windows(head.len()).any(|w| w == head)
}

/// Reads until the server closes; fails if it does not within [`DROPPED_WITHIN`].
fn until_closed(c: &mut TcpStream, start: Instant) -> Result<Vec<u8>, TestCaseError> {
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let left = DROPPED_WITHIN.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err(TestCaseError::fail("the server kept a bad peer open"));
        }
        c.set_read_timeout(Some(left)).unwrap();
        match c.read(&mut buf) {
            Ok(0) => return Ok(got),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(got),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(TestCaseError::fail(format!("reading: {e}"))),
        }
    }
}

/// Sends `bytes` raw, half-closes, and checks the server drops the peer without the payload.
fn raw_case(server: SocketAddr, bytes: &[u8]) -> Result<(), TestCaseError> {
    let start = Instant::now();
    let mut c = TcpStream::connect(server).unwrap();
    // The server may close first (a bad magic): a failed write is fine.
    let _ = c.write_all(bytes);
    let _ = c.shutdown(Shutdown::Write);
    let got = until_closed(&mut c, start)?;
    prop_assert!(!has_accepted_reply(&got), "a bad peer was accepted");
    Ok(())
}

/// Relays a real rank-1 client to the server, changing its stream in flight.
fn relayed_case(
    server: SocketAddr,
    at: usize,
    flip: u8,
    cut: Option<usize>,
) -> Result<(), TestCaseError> {
    let relay = TcpListener::bind("127.0.0.1:0").unwrap();
    let relay_addr = relay.local_addr().unwrap();
    // The client retries while the relay refuses (it is closed after one connection), so
    // its deadline is short; it must fail.
    let client = thread::spawn(move || {
        fetch_with(
            &relay_addr.to_string(),
            1,
            WORLD,
            &secret(),
            Duration::from_secs(1),
        )
    });
    let (mut from_client, _) = relay.accept().unwrap();
    drop(relay);
    let start = Instant::now();
    let mut to_server = TcpStream::connect(server).unwrap();
    let back = {
        let mut from_server = to_server.try_clone().unwrap();
        let mut to_client = from_client.try_clone().unwrap();
        thread::spawn(move || {
            let got = until_closed(&mut from_server, start);
            if let Ok(bytes) = &got {
                let _ = to_client.write_all(bytes);
            }
            let _ = to_client.shutdown(Shutdown::Both);
            got
        })
    };
    let mut sent = 0usize;
    let mut buf = [0u8; 128];
    from_client.set_read_timeout(Some(DROPPED_WITHIN)).unwrap();
    while let Ok(n) = from_client.read(&mut buf) {
        if n == 0 {
            break;
        }
        let mut chunk = buf[..n].to_vec();
        for (i, b) in chunk.iter_mut().enumerate() {
            if sent + i == at {
                *b ^= flip;
            }
        }
        let keep = cut.map_or(n, |c| c.saturating_sub(sent).min(n));
        let _ = to_server.write_all(&chunk[..keep]);
        sent += n;
        if keep < n {
            break;
        }
    }
    let _ = to_server.shutdown(Shutdown::Write);
    let got = back.join().unwrap()?;
    prop_assert!(!has_accepted_reply(&got), "a changed stream was accepted");
    let result = client.join().unwrap();
    prop_assert!(result.is_err(), "a changed stream completed: {result:?}");
    Ok(())
}

fn run_case(server: SocketAddr, input: &Input) -> Result<(), TestCaseError> {
    match input {
        Input::Raw(bytes) => raw_case(server, bytes),
        Input::Relayed { at, flip, cut } => relayed_case(server, *at, *flip, *cut),
    }
}

fn fuzz(runner: &mut TestRunner, server: SocketAddr) {
    if let Err(e) = runner.run(&input(), |i| run_case(server, &i)) {
        panic!("{e}");
    }
}

#[test]
fn mutated_hellos_and_proofs_never_break_the_server() {
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let opts = ServeOptions {
        handshake_timeout: HANDSHAKE,
        ..ServeOptions::default()
    };
    let serving = thread::spawn(move || {
        server.serve_with(WORLD, &payload(), &secret(), Duration::from_secs(600), opts)
    });
    let config = Config {
        cases: cases().div_ceil(2),
        failure_persistence: None,
        ..Config::default()
    };
    // Two fixed seeds: the second half differs from the first.
    let rng = |seed: u8| TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]);
    let start = Instant::now();
    fuzz(&mut TestRunner::new_with_rng(config.clone(), rng(1)), addr);
    // Between the cases a real rank still completes, and after them the last one.
    let real = |rank| {
        fetch_with(
            &addr.to_string(),
            rank,
            WORLD,
            &secret(),
            Duration::from_secs(20),
        )
    };
    assert_eq!(real(1).unwrap(), payload());
    fuzz(&mut TestRunner::new_with_rng(config, rng(2)), addr);
    assert_eq!(real(2).unwrap(), payload());
    let served: Result<(), RendezvousError> = serving.join().expect("the server panicked");
    served.unwrap();
    println!("{} fuzz cases in {:.1?}", cases(), start.elapsed());
}
