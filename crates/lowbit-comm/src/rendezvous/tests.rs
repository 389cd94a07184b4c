//! Tests of the rendezvous: the environment, the exchange over loopback TCP, and every kind of
//! bad, short or foreign message on both sides.

use super::*;
use std::collections::HashMap;

fn env(vars: &[(&str, &str)]) -> Result<RendezvousEnv> {
    let map: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    RendezvousEnv::from_lookup(|k| map.get(k).cloned())
}

#[test]
fn env_reads_torchrun_variables() {
    let e = env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(e.rank, 1);
    assert_eq!(e.world_size, 2);
    assert_eq!(e.local_rank, 1);
    assert_eq!(e.server_addr(), "10.0.0.1:29500");
    // Under a torchrun agent the port above MASTER_PORT; an explicit port wins.
    let agent = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ];
    assert_eq!(env(&agent).unwrap().port, 29501);
    let mut explicit = agent.to_vec();
    explicit.push(("LOWBIT_RDZV_PORT", "4000"));
    assert_eq!(env(&explicit).unwrap().port, 4000);
    let v6 = env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "::1"),
        ("MASTER_PORT", "7"),
    ])
    .unwrap();
    assert_eq!(v6.server_addr(), "[::1]:7");
    assert_eq!(v6.master_addr, "::1");
    assert_eq!(v6.local_rank, 0);
}

#[test]
fn env_errors_name_the_variable() {
    let e = env(&[("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err();
    assert!(e.to_string().contains("RANK is not set"), "{e}");
    let e = env(&[("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err();
    assert!(e.to_string().contains("RANK=\"x\""), "{e}");
    let e = env(&[("RANK", "2"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).unwrap_err();
    assert_eq!(e, RendezvousError::BadRank { rank: 2, world: 2 });
    let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "70000")]).unwrap_err();
    assert!(e.to_string().contains("not a TCP port"), "{e}");
    let e = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap_err();
    assert!(e.to_string().contains("MASTER_PORT is not set"), "{e}");
}

fn listen() -> (RendezvousServer, String) {
    let s = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = s.local_addr().to_string();
    (s, addr)
}

const T: Duration = Duration::from_secs(10);

/// A port no one listened on a moment ago (bound, then released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn every_rank_gets_the_payload() {
    let world = 4;
    let (server, addr) = listen();
    let payload: Vec<u8> = (0..128u8).collect();
    std::thread::scope(|s| {
        let clients: Vec<_> = (1..world)
            .map(|r| {
                let addr = addr.clone();
                s.spawn(move || fetch(&addr, r, world, T))
            })
            .collect();
        server.serve(world, &payload, T).unwrap();
        for c in clients {
            assert_eq!(c.join().unwrap().unwrap(), payload);
        }
    });
}

#[test]
fn clients_retry_until_rank_0_listens() {
    // Reserve a port, release it, start the client first, then listen on it.
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    std::thread::scope(|s| {
        let client = s.spawn(|| fetch(&addr, 1, 2, T));
        std::thread::sleep(Duration::from_millis(300));
        let server = RendezvousServer::bind(("127.0.0.1", port)).unwrap();
        server.serve(2, b"id", T).unwrap();
        assert_eq!(client.join().unwrap().unwrap(), b"id");
    });
}

#[test]
fn exchange_through_the_environment() {
    let port = free_port().to_string();
    let envs: Vec<RendezvousEnv> = (0..3)
        .map(|r| {
            env(&[
                ("RANK", &r.to_string()),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", "127.0.0.1"),
                ("MASTER_PORT", &port),
            ])
            .unwrap()
        })
        .collect();
    let got: Vec<Vec<u8>> = std::thread::scope(|s| {
        let hs: Vec<_> = envs
            .iter()
            .map(|e| s.spawn(move || e.exchange(|| Ok(vec![7; 128]), T)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    });
    assert!(got.iter().all(|g| g == &vec![7u8; 128]));
}

#[test]
fn refused_connection_times_out_with_the_address() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let t0 = Instant::now();
    let e = fetch(&addr, 1, 2, Duration::from_millis(400)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    match &e {
        RendezvousError::Connect {
            rank: 1, addr: a, ..
        } => assert_eq!(a, &addr),
        other => panic!("{other}"),
    }
    assert!(e.to_string().contains(&addr), "{e}");
}

#[test]
fn server_times_out_naming_missing_ranks() {
    let (server, addr) = listen();
    std::thread::scope(|s| {
        s.spawn(|| fetch(&addr, 2, 4, T).unwrap());
        let e = server
            .serve(4, b"x", Duration::from_millis(500))
            .unwrap_err();
        match e {
            RendezvousError::Timeout { missing, .. } => assert_eq!(missing, vec![1, 3]),
            other => panic!("{other}"),
        }
    });
}

#[test]
fn mismatched_world_and_duplicate_ranks_are_rejected_on_both_sides() {
    let (server, addr) = listen();
    std::thread::scope(|s| {
        let c = s.spawn(|| fetch(&addr, 1, 3, T));
        let e = server.serve(2, b"x", T).unwrap_err();
        assert!(
            matches!(e, RendezvousError::Rejected { rank: 1, .. }),
            "{e}"
        );
        let e = c.join().unwrap().unwrap_err();
        assert!(
            e.to_string()
                .contains("world size 3, rank 0 has world size 2"),
            "{e}"
        );
    });
    let (server, addr) = listen();
    std::thread::scope(|s| {
        let serving = s.spawn(|| server.serve(3, b"x", T));
        assert_eq!(fetch(&addr, 1, 3, T).unwrap(), b"x");
        let e = fetch(&addr, 1, 3, T).unwrap_err();
        assert!(e.to_string().contains("checked in twice"), "{e}");
        let e = serving.join().unwrap().unwrap_err();
        assert!(
            matches!(e, RendezvousError::Rejected { rank: 1, .. }),
            "{e}"
        );
    });
}

#[test]
fn garbled_and_short_hellos_fail_rank_0() {
    for (bytes, want) in [
        (
            &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
            "not a lowbit rendezvous hello",
        ),
        (
            &b"LOWBITRV\x01\x00"[..],
            "connection closed after 10 of 20 bytes",
        ),
    ] {
        let (server, addr) = listen();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut c = TcpStream::connect(&addr).unwrap();
                c.write_all(bytes).unwrap();
                c.shutdown(std::net::Shutdown::Write).unwrap();
                let mut sink = Vec::new();
                let _ = c.read_to_end(&mut sink);
            });
            let e = server.serve(2, b"x", T).unwrap_err();
            assert!(matches!(e, RendezvousError::Protocol { .. }), "{e}");
            assert!(e.to_string().contains(want), "{e}");
        });
    }
}

#[test]
fn other_version_is_rejected() {
    let (server, addr) = listen();
    std::thread::scope(|s| {
        let c = s.spawn(|| {
            let mut c = TcpStream::connect(&addr).unwrap();
            let mut hello = MAGIC.to_vec();
            for w in [VERSION + 1, 1, 2] {
                hello.extend_from_slice(&w.to_le_bytes());
            }
            c.write_all(&hello).unwrap();
            let mut reply = Vec::new();
            c.read_to_end(&mut reply).unwrap();
            reply
        });
        let e = server.serve(2, b"x", T).unwrap_err();
        assert!(e.to_string().contains("protocol version 2"), "{e}");
        let reply = c.join().unwrap();
        assert_eq!(&reply[..8], &MAGIC);
        assert_eq!(u32::from_le_bytes(reply[12..16].try_into().unwrap()), 1);
    });
}

/// A fake rank 0 that sends `bytes` then closes.
fn fake_server(bytes: Vec<u8>) -> (String, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        let (mut c, _) = l.accept().unwrap();
        let mut hello = [0u8; HELLO_LEN];
        let _ = c.read_exact(&mut hello);
        let _ = c.write_all(&bytes);
    });
    (addr, h)
}

#[test]
fn garbled_short_and_oversized_replies_fail_the_client() {
    let header = |status: u32, len: u32| {
        let mut m = MAGIC.to_vec();
        for w in [VERSION, status, len] {
            m.extend_from_slice(&w.to_le_bytes());
        }
        m
    };
    let mut short_body = header(STATUS_OK, 128);
    short_body.extend_from_slice(&[1; 60]);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
            "not a lowbit rendezvous reply",
        ),
        (
            MAGIC[..5].to_vec(),
            "connection closed after 5 of 20 bytes of the reply header",
        ),
        (
            short_body,
            "connection closed after 60 of 128 bytes of the reply body",
        ),
        (header(STATUS_OK, 1 << 30), "more than 65536"),
        (header(9, 0), "unknown status 9"),
    ];
    for (bytes, want) in cases {
        let (addr, h) = fake_server(bytes);
        let e = fetch(&addr, 1, 2, T).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
        h.join().unwrap();
    }
}

#[test]
fn silent_server_times_out() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t0 = Instant::now();
    let e = fetch(&addr, 1, 2, Duration::from_millis(300)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        e.to_string().contains("timed out after 0 of 20 bytes"),
        "{e}"
    );
    drop(l);
}

#[test]
fn bad_ranks_are_refused_before_connecting() {
    assert!(matches!(
        fetch("127.0.0.1:1", 0, 2, T),
        Err(RendezvousError::BadRank { rank: 0, world: 2 })
    ));
    assert!(matches!(
        fetch("127.0.0.1:1", 3, 2, T),
        Err(RendezvousError::BadRank { rank: 3, world: 2 })
    ));
}
