//! Attacks on the rank-0 rendezvous over loopback: garbage, HTTP, connect-and-close,
//! half-open and silent connections, impostors before and after the real rank, one client
//! claiming several ranks, a fake rank 0, a wrong token, an old client, a flood past the
//! connection limit. Each asserts the real ranks still complete well under the deadline and no
//! attacker ever receives the payload.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use lowbit_comm::rendezvous::{
    MAGIC, RendezvousError, RendezvousSecret, RendezvousServer, ServeOptions, VERSION, fetch_with,
};

/// The job's deadline: the real ranks must finish far below it.
const DEADLINE: Duration = Duration::from_secs(30);
/// What "quickly" means for the real ranks.
const QUICK: Duration = Duration::from_secs(4);

fn secret() -> RendezvousSecret {
    RendezvousSecret::from_token(b"the job's token")
}

fn payload() -> Vec<u8> {
    (0..128u32).map(|i| (i * 37 + 11) as u8).collect()
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(16).any(|w| needle.windows(16).any(|n| n == w))
}

/// A raw hello: magic, version, rank, world, a nonce.
fn hello(rank: u32, world: u32) -> Vec<u8> {
    let mut h = MAGIC.to_vec();
    for w in [VERSION, rank, world] {
        h.extend_from_slice(&w.to_le_bytes());
    }
    h.extend_from_slice(&[0x5a; 32]);
    h
}

/// Reads everything until the server closes (or 10 s pass), for the payload check.
fn drain(c: &mut TcpStream) -> Vec<u8> {
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut got = Vec::new();
    let _ = c.read_to_end(&mut got);
    got
}

/// An attacker: connects, runs `act`, then reads whatever comes back.
fn attacker(
    addr: SocketAddr,
    act: impl FnOnce(&mut TcpStream) + Send + 'static,
) -> thread::JoinHandle<Vec<u8>> {
    thread::spawn(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        act(&mut c);
        drain(&mut c)
    })
}

/// Rank 0 serves [`payload`] to `world` ranks under `opts` on a loopback port, in a thread.
fn serve(
    world: usize,
    opts: ServeOptions,
) -> (
    SocketAddr,
    Vec<u8>,
    thread::JoinHandle<Result<(), RendezvousError>>,
) {
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let p = payload();
    let serving = {
        let p = p.clone();
        thread::spawn(move || server.serve_with(world, &p, &secret(), DEADLINE, opts))
    };
    (addr, p, serving)
}

/// Rank 0 serves `world` ranks under `opts`; `attack` runs first (its handles are joined after
/// the job and must never hold the payload); the real ranks start after `delay` and must all
/// get the payload within [`QUICK`] of starting.
fn job(
    world: usize,
    opts: ServeOptions,
    delay: Duration,
    attack: impl FnOnce(SocketAddr) -> Vec<thread::JoinHandle<Vec<u8>>>,
) {
    let (addr, p, serving) = serve(world, opts);
    let attackers = attack(addr);
    thread::sleep(delay);
    let t0 = Instant::now();
    let ranks: Vec<_> = (1..world)
        .map(|r| {
            thread::spawn(move || fetch_with(&addr.to_string(), r, world, &secret(), DEADLINE))
        })
        .collect();
    for r in ranks {
        assert_eq!(r.join().unwrap().unwrap(), p);
    }
    serving.join().unwrap().unwrap();
    let took = t0.elapsed();
    assert!(took < QUICK, "the real ranks took {took:?}");
    for a in attackers {
        let got = a.join().unwrap();
        assert!(!contains(&got, &p), "an attacker received the payload");
    }
}

#[test]
fn garbage_does_not_fail_the_job() {
    job(
        3,
        ServeOptions::default(),
        Duration::from_millis(50),
        |addr| {
            (0..4u8)
                .map(|k| {
                    attacker(addr, move |c| {
                        let junk: Vec<u8> = (0..4096u32).map(|i| (i as u8) ^ k).collect();
                        let _ = c.write_all(&junk);
                    })
                })
                .collect()
        },
    );
}

#[test]
fn http_requests_do_not_fail_the_job() {
    job(
        2,
        ServeOptions::default(),
        Duration::from_millis(50),
        |addr| {
            vec![attacker(addr, |c| {
                let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
            })]
        },
    );
}

#[test]
fn connect_and_close_does_not_fail_the_job() {
    job(
        3,
        ServeOptions::default(),
        Duration::from_millis(50),
        |addr| {
            for _ in 0..50 {
                drop(TcpStream::connect(addr).unwrap());
            }
            // And a reset, and a close right after a partial hello.
            vec![
                attacker(addr, |c| {
                    let _ = c.write_all(&MAGIC[..5]);
                    let _ = c.shutdown(Shutdown::Both);
                }),
                attacker(addr, |c| {
                    let _ = c.shutdown(Shutdown::Write);
                }),
            ]
        },
    );
}

#[test]
fn silent_and_half_open_clients_do_not_delay_others() {
    // Handshakes may take 5 s each; the ranks must be done long before that.
    job(
        4,
        ServeOptions::default(),
        Duration::from_millis(100),
        |addr| {
            let mut v: Vec<_> = (0..10).map(|_| attacker(addr, |_| {})).collect();
            v.push(attacker(addr, |c| {
                let _ = c.write_all(&hello(1, 4)[..30]);
            }));
            v.push(attacker(addr, |c| {
                // A whole hello, then silence instead of the proof.
                let _ = c.write_all(&hello(2, 4));
            }));
            v
        },
    );
}

#[test]
fn impostor_before_the_real_rank_is_dropped() {
    job(
        3,
        ServeOptions::default(),
        Duration::from_millis(200),
        |addr| {
            vec![
                attacker(addr, |c| {
                    let _ = c.write_all(&hello(1, 3));
                    let _ = c.write_all(&[0u8; 32]); // a guessed proof
                }),
                attacker(addr, |c| {
                    // Claims rank 2 and holds the challenge without answering.
                    let _ = c.write_all(&hello(2, 3));
                }),
            ]
        },
    );
}

#[test]
fn impostor_after_the_real_rank_is_dropped() {
    // Rank 1 is served, then an impostor claims rank 1 (and 2), then rank 2 arrives.
    let (addr, p, serving) = serve(3, ServeOptions::default());
    let t0 = Instant::now();
    assert_eq!(
        fetch_with(&addr.to_string(), 1, 3, &secret(), DEADLINE).unwrap(),
        p
    );
    let impostors: Vec<_> = [1u32, 2]
        .into_iter()
        .map(|r| {
            attacker(addr, move |c| {
                let _ = c.write_all(&hello(r, 3));
                let _ = c.write_all(&[7u8; 32]);
            })
        })
        .collect();
    for i in impostors {
        assert!(!contains(&i.join().unwrap(), &p));
    }
    // A real rank 1 checking in twice is told so; the job goes on.
    let e = fetch_with(&addr.to_string(), 1, 3, &secret(), DEADLINE).unwrap_err();
    assert!(e.to_string().contains("checked in twice"), "{e}");
    assert_eq!(
        fetch_with(&addr.to_string(), 2, 3, &secret(), DEADLINE).unwrap(),
        p
    );
    serving.join().unwrap().unwrap();
    assert!(t0.elapsed() < QUICK, "{:?}", t0.elapsed());
}

#[test]
fn one_client_claiming_several_ranks_gets_nothing() {
    job(
        4,
        ServeOptions::default(),
        Duration::from_millis(200),
        |addr| {
            let mut v: Vec<_> = (1..4u32)
                .map(|r| {
                    attacker(addr, move |c| {
                        let _ = c.write_all(&hello(r, 4));
                        let _ = c.write_all(&[1u8; 32]);
                    })
                })
                .collect();
            // Every hello on one connection.
            v.push(attacker(addr, |c| {
                let all: Vec<u8> = (1..4u32).flat_map(|r| hello(r, 4)).collect();
                let _ = c.write_all(&all);
            }));
            v
        },
    );
}

#[test]
fn wrong_token_fails_that_rank_only() {
    let (addr, p, serving) = serve(2, ServeOptions::default());
    let t0 = Instant::now();
    let other = RendezvousSecret::from_token(b"another job's token");
    let e = fetch_with(&addr.to_string(), 1, 2, &other, DEADLINE).unwrap_err();
    assert!(matches!(e, RendezvousError::Auth { .. }), "{e}");
    assert!(
        e.to_string().contains("did not prove the job secret"),
        "{e}"
    );
    // The public key (no token at all) fails the same way.
    let e = fetch_with(
        &addr.to_string(),
        1,
        2,
        &RendezvousSecret::public(),
        DEADLINE,
    )
    .unwrap_err();
    assert!(matches!(e, RendezvousError::Auth { .. }), "{e}");
    assert_eq!(
        fetch_with(&addr.to_string(), 1, 2, &secret(), DEADLINE).unwrap(),
        p
    );
    serving.join().unwrap().unwrap();
    assert!(t0.elapsed() < QUICK, "{:?}", t0.elapsed());
}

/// A fake rank 0: answers the hello with `reply(hello)` and returns what the client sent after.
fn fake_rank0(
    reply: impl FnOnce(&[u8]) -> Vec<u8> + Send + 'static,
) -> (String, thread::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut h = [0u8; 52];
        c.read_exact(&mut h).unwrap();
        c.write_all(&reply(&h)).unwrap();
        drain(&mut c)
    });
    (addr, h)
}

fn frame(status: u32, body: &[u8]) -> Vec<u8> {
    let mut m = MAGIC.to_vec();
    for w in [VERSION, status, body.len() as u32] {
        m.extend_from_slice(&w.to_le_bytes());
    }
    m.extend_from_slice(body);
    m
}

#[test]
fn fake_rank_0_fails_the_client_before_it_proves_anything() {
    // A challenge with a made-up proof.
    let (addr, h) = fake_rank0(|_| frame(2, &[9u8; 64]));
    let t0 = Instant::now();
    let e = fetch_with(&addr, 1, 2, &secret(), DEADLINE).unwrap_err();
    assert!(t0.elapsed() < QUICK);
    assert!(matches!(e, RendezvousError::Auth { .. }), "{e}");
    assert!(e.to_string().contains("not rank 0"), "{e}");
    assert!(h.join().unwrap().is_empty(), "the client sent its proof");
    // A "payload" without any challenge.
    let (addr, h) = fake_rank0(|_| frame(0, &[1u8; 160]));
    let e = fetch_with(&addr, 1, 2, &secret(), DEADLINE).unwrap_err();
    assert!(e.to_string().contains("expected a challenge"), "{e}");
    h.join().unwrap();
    // A replayed proof from the real rank 0 of another connection cannot match a fresh nonce:
    // relay the hello to a real server, answer with the challenge of another hello.
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let real = server.local_addr();
    let serving = thread::spawn(move || {
        server.serve_with(
            2,
            b"id",
            &secret(),
            Duration::from_secs(1),
            ServeOptions::default(),
        )
    });
    let (addr, h) = fake_rank0(move |_| {
        let mut c = TcpStream::connect(real).unwrap();
        c.write_all(&hello(1, 2)).unwrap();
        let mut challenge = [0u8; 84];
        c.read_exact(&mut challenge).unwrap();
        challenge.to_vec()
    });
    let e = fetch_with(&addr, 1, 2, &secret(), DEADLINE).unwrap_err();
    assert!(matches!(e, RendezvousError::Auth { .. }), "{e}");
    h.join().unwrap();
    assert!(matches!(
        serving.join().unwrap(),
        Err(RendezvousError::Timeout { .. })
    ));
}

#[test]
fn an_old_client_is_told_the_version() {
    job(
        2,
        ServeOptions::default(),
        Duration::from_millis(100),
        |addr| {
            vec![thread::spawn(move || {
                let mut c = TcpStream::connect(addr).unwrap();
                let mut h = MAGIC.to_vec();
                for w in [1u32, 1, 2] {
                    h.extend_from_slice(&w.to_le_bytes());
                }
                c.write_all(&h).unwrap();
                let got = drain(&mut c);
                assert_eq!(&got[..8], &MAGIC);
                assert_eq!(u32::from_le_bytes(got[12..16].try_into().unwrap()), 1);
                assert!(String::from_utf8_lossy(&got[20..]).contains("speaks version 2"));
                got
            })]
        },
    );
}

#[test]
fn a_flood_past_the_connection_limit_only_delays_by_one_handshake() {
    let opts = ServeOptions {
        handshake_timeout: Duration::from_millis(500),
        max_connections: 4,
    };
    job(2, opts, Duration::from_millis(100), |addr| {
        (0..4).map(|_| attacker(addr, |_| {})).collect()
    });
}

#[test]
fn missing_real_rank_still_fails_the_job_naming_it() {
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let t0 = Instant::now();
    let serving = thread::spawn(move || {
        server.serve_with(
            3,
            b"id",
            &secret(),
            Duration::from_millis(800),
            ServeOptions::default(),
        )
    });
    let a = attacker(addr, |c| {
        let _ = c.write_all(b"garbage!garbage!garbage!");
    });
    assert_eq!(
        fetch_with(&addr.to_string(), 2, 3, &secret(), DEADLINE).unwrap(),
        b"id"
    );
    match serving.join().unwrap() {
        Err(e @ RendezvousError::Timeout { .. }) => {
            let RendezvousError::Timeout { ref missing, .. } = e else {
                unreachable!()
            };
            assert_eq!(missing, &vec![1]);
            assert!(e.to_string().contains("dropped"), "{e}");
        }
        other => panic!("{other:?}"),
    }
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(!contains(&a.join().unwrap(), b"id"));
}

#[test]
fn ipv6_loopback_works() {
    let server = match RendezvousServer::bind_host("::1", 0) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("skipped: no IPv6 loopback here ({e})");
            return;
        }
    };
    let addr = server.local_addr();
    assert!(addr.is_ipv6());
    let serving = thread::spawn(move || {
        server.serve_with(2, b"id6", &secret(), DEADLINE, ServeOptions::default())
    });
    assert_eq!(
        fetch_with(&addr.to_string(), 1, 2, &secret(), DEADLINE).unwrap(),
        b"id6"
    );
    serving.join().unwrap().unwrap();
}
