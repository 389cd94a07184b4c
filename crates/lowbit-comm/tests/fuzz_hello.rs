//! Bounded mutation fuzzing of the rendezvous' first messages, many cases in seconds:
//!
//! - rank 0's server reads thousands of mutated hellos (the first message a server reads from
//!   a peer: bit flips in every field, ranks and world sizes from 0 to 2^32 − 1, other
//!   versions and magics, truncations, extra bytes, garbage), eight peers at a time: each is
//!   dropped within its handshake deadline without the payload (an authenticated reply needs
//!   the job secret, which no case has), whatever a reply says is a well-formed frame that
//!   announces no more than the protocol's bound, and real ranks complete after them;
//! - a rank reads mutated replies from a fake rank 0 (bit flips, truncations, and declared
//!   lengths up to 2^32 − 1): every one is a typed error within the deadline, and the rank
//!   allocates a bounded amount whatever a reply declares (counted per thread below).
//!
//! Cases come from a fixed seed (a failure names its case and bytes); `LOWBIT_FUZZ_CASES` sets
//! their number (default 2000 hellos; a tenth as many replies: a reply closed before its
//! challenge makes the rank retry until its deadline, half a second here).

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use lowbit_comm::rendezvous::{
    MAGIC, MAX_PAYLOAD, RendezvousSecret, RendezvousServer, ServeOptions, VERSION, fetch_with,
};
use lowbit_dev_support::alloc::{ThreadCounting, thread_peak_of};

// Each test's own thread counts its allocations, so tests running side by side do not mix.
#[global_allocator]
static PER_THREAD: ThreadCounting = ThreadCounting;

const WORLD: usize = 3;
const HANDSHAKE: Duration = Duration::from_millis(500);
/// How long the server may take to drop a bad peer: its handshake deadline and slack.
const DROPPED_WITHIN: Duration = Duration::from_secs(5);
/// Frame header: magic, version, status, length.
const HEADER: usize = 20;
/// The longest body a reply may announce: a payload and its tag.
const MAX_BODY: usize = MAX_PAYLOAD + 32;

/// SplitMix64 (the cases' generator; this crate has no RNG of its own).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn secret() -> RendezvousSecret {
    RendezvousSecret::from_token(b"fuzz hello token")
}

fn payload() -> Vec<u8> {
    (0..128u32).map(|i| (i * 37 + 11) as u8).collect()
}

fn word(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

/// A hello as a rank sends it: magic, version, rank, world, nonce.
fn hello(rank: u32, world: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    for w in [VERSION, rank, world] {
        h.extend_from_slice(&w.to_le_bytes());
    }
    h.extend_from_slice(&[0xa5; 32]);
    h
}

const WORDS: [u32; 8] = [0, 1, 2, 3, 4, u32::MAX, 1 << 31, 65_536];

/// One mutated hello.
fn mutated_hello(rng: &mut Rng) -> Vec<u8> {
    let mut h = hello(WORDS[rng.below(WORDS.len())], WORDS[rng.below(WORDS.len())]);
    match rng.below(7) {
        0 => {
            for _ in 0..1 + rng.below(3) {
                let i = rng.below(h.len());
                h[i] ^= 1 << rng.below(8);
            }
        }
        1 => h.truncate(rng.below(h.len())),
        2 => {
            let extra = rng.below(200);
            h.extend((0..extra).map(|_| rng.next() as u8));
        }
        3 => h[8..12].copy_from_slice(&WORDS[rng.below(WORDS.len())].to_le_bytes()),
        4 => {
            let n = rng.below(120);
            h = (0..n).map(|_| rng.next() as u8).collect();
        }
        5 => h[rng.below(8)] = rng.next() as u8,
        // A well-formed hello of a rank that does not hold the secret.
        _ => {}
    }
    h
}

/// Every frame in `bytes` is well formed and bounded; none is an accepted reply (status 0).
fn check_replies(bytes: &[u8]) -> Result<(), String> {
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        if rest.len() < HEADER || rest[..8] != MAGIC {
            return Err(format!(
                "not a frame at byte {at}: {:02x?}",
                &rest[..rest.len().min(20)]
            ));
        }
        let (status, len) = (word(rest, 12), word(rest, 16) as usize);
        if status == 0 {
            return Err("an accepted reply to a peer without the secret".into());
        }
        if len > MAX_BODY {
            return Err(format!("a reply announcing {len} bytes"));
        }
        at += HEADER + len;
    }
    Ok(())
}

/// Sends `bytes`, half-closes, reads until the server closes.
fn send_hello(server: SocketAddr, bytes: &[u8]) -> Result<(), String> {
    let start = Instant::now();
    let mut c = TcpStream::connect(server).map_err(|e| format!("connect: {e}"))?;
    // The server may close first (a bad magic): a failed write is fine.
    let _ = c.write_all(bytes);
    let _ = c.shutdown(Shutdown::Write);
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        let left = DROPPED_WITHIN.saturating_sub(start.elapsed());
        if left.is_zero() {
            return Err("the server kept a bad peer open".into());
        }
        c.set_read_timeout(Some(left)).expect("timeout");
        match c.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading: {e}")),
        }
    }
    check_replies(&got)
}

#[test]
fn thousands_of_mutated_hellos_are_dropped_and_real_ranks_complete() {
    let server = RendezvousServer::bind("127.0.0.1:0").expect("bind");
    let addr = server.local_addr();
    let opts = ServeOptions {
        handshake_timeout: HANDSHAKE,
        ..ServeOptions::default()
    };
    let serving = thread::spawn(move || {
        server.serve_with(WORLD, &payload(), &secret(), Duration::from_secs(300), opts)
    });
    let cases = lowbit_dev_support::fuzz_cases(2000) as usize;
    const PEERS: usize = 8;
    let start = Instant::now();
    thread::scope(|s| {
        for peer in 0..PEERS {
            s.spawn(move || {
                let mut rng = Rng(0x6865_6c6c_6f00 + peer as u64);
                for case in (peer..cases).step_by(PEERS) {
                    let h = mutated_hello(&mut rng);
                    if let Err(why) = send_hello(addr, &h) {
                        panic!("case {case}: {why}; hello {h:02x?}");
                    }
                }
            });
        }
    });
    let fuzzed = start.elapsed();
    for rank in 1..WORLD {
        let got = fetch_with(
            &addr.to_string(),
            rank,
            WORLD,
            &secret(),
            Duration::from_secs(20),
        );
        assert_eq!(got.expect("a real rank after the fuzz"), payload());
    }
    serving
        .join()
        .expect("the server panicked")
        .expect("served");
    println!("{cases} mutated hellos in {fuzzed:.1?}");
}

/// A fake rank 0: reads each hello, answers `reply`, closes; serves every attempt (the client
/// retries a reply closed before its challenge) until `stop`.
fn fake_rank0(reply: Vec<u8>, stop: Arc<AtomicBool>) -> (SocketAddr, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    let h = thread::spawn(move || {
        l.set_nonblocking(true).expect("nonblocking");
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut c, _)) => {
                    c.set_nonblocking(false).expect("blocking");
                    let mut hello = [0u8; 52];
                    let _ = c.set_read_timeout(Some(Duration::from_secs(2)));
                    let _ = c.read_exact(&mut hello);
                    let _ = c.write_all(&reply);
                    let _ = c.shutdown(Shutdown::Both);
                }
                Err(_) => thread::sleep(Duration::from_millis(1)),
            }
        }
    });
    (addr, h)
}

fn frame(status: u32, len: u32, body: &[u8]) -> Vec<u8> {
    let mut f = MAGIC.to_vec();
    for w in [VERSION, status, len] {
        f.extend_from_slice(&w.to_le_bytes());
    }
    f.extend_from_slice(body);
    f
}

#[test]
fn mutated_replies_fail_the_rank_with_bounded_allocation() {
    let cases = (lowbit_dev_support::fuzz_cases(2000) / 10).max(20) as usize;
    let mut rng = Rng(0x0072_6570_6c79);
    let start = Instant::now();
    for case in 0..cases {
        // A challenge of the right size (whose proof is wrong: the fake has no secret), or a
        // rejection, an accepted reply, an unknown status; then lengths up to 2^32 - 1 and
        // bit flips or truncations.
        let status = [0, 1, 2, 3, u32::MAX][rng.below(5)];
        let body: Vec<u8> = (0..64).map(|_| rng.next() as u8).collect();
        let len = match rng.below(4) {
            0 => u32::MAX,
            1 => (MAX_BODY + 1) as u32,
            2 => 4097,
            _ => 64,
        };
        let mut reply = frame(status, len, &body);
        match rng.below(3) {
            0 => {
                let i = rng.below(reply.len());
                reply[i] ^= 1 << rng.below(8);
            }
            1 => reply.truncate(rng.below(reply.len())),
            _ => {}
        }
        let stop = Arc::new(AtomicBool::new(false));
        let (addr, fake) = fake_rank0(reply.clone(), Arc::clone(&stop));
        let t = Instant::now();
        let (got, peak) = thread_peak_of(|| {
            fetch_with(
                &addr.to_string(),
                1,
                WORLD,
                &secret(),
                Duration::from_millis(500),
            )
        });
        let e = match got {
            Ok(p) => panic!("case {case}: a fake rank 0 delivered {p:02x?} with {reply:02x?}"),
            Err(e) => e,
        };
        assert!(!e.to_string().is_empty(), "case {case}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "case {case}: {:?}",
            t.elapsed()
        );
        // A body is read only once its announced length passed the bound.
        assert!(
            peak < 4 * MAX_BODY + (64 << 10),
            "case {case}: {peak} bytes allocated for a reply of {} bytes announcing {len}",
            reply.len()
        );
        stop.store(true, Ordering::SeqCst);
        fake.join().expect("fake rank 0");
    }
    println!("{cases} mutated replies in {:.1?}", start.elapsed());
}
