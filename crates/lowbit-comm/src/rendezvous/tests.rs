//! Tests of the rendezvous: the environment and the secret rule, SHA-256 and HMAC against their
//! published vectors, the exchange over loopback TCP, and bad, short or foreign messages on the
//! client side (attacks on rank 0 are in `tests/rendezvous_attacks.rs`).

use super::*;
use std::collections::HashMap;
use std::net::TcpListener;

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
        let server = RendezvousServer::bind_host("127.0.0.1", port).unwrap();
        server.serve(2, b"id", T).unwrap();
        assert_eq!(client.join().unwrap().unwrap(), b"id");
    });
}

/// The environments of ranks 0..3 of a job on `host` and a free port, plus `extra` variables.
fn three_ranks(host: &str, extra: &[(&str, &str)]) -> Vec<RendezvousEnv> {
    let port = free_port().to_string();
    (0..3)
        .map(|r| {
            let rank = r.to_string();
            let mut vars = vec![
                ("RANK", rank.as_str()),
                ("WORLD_SIZE", "3"),
                ("MASTER_ADDR", host),
                ("MASTER_PORT", port.as_str()),
            ];
            vars.extend_from_slice(extra);
            env(&vars).unwrap()
        })
        .collect()
}

/// Every env exchanges a 128-byte payload of `byte` on its own thread.
fn exchange_all(envs: &[RendezvousEnv], byte: u8) -> Vec<Vec<u8>> {
    std::thread::scope(|s| {
        let hs: Vec<_> = envs
            .iter()
            .map(|e| s.spawn(move || e.exchange(|| Ok(vec![byte; 128]), T)))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
    })
}

#[test]
fn exchange_through_the_environment() {
    let envs = three_ranks("127.0.0.1", &[]);
    let got = exchange_all(&envs, 7);
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
fn env_reads_the_secret_bind_and_local_world() {
    let base = [("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500")];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut v = base.to_vec();
        v.extend_from_slice(extra);
        env(&v)
    };
    assert_eq!(with(&[]).unwrap().secret, None);
    assert_eq!(
        with(&[("TORCHELASTIC_RUN_ID", "none")]).unwrap().secret,
        None
    );
    assert_eq!(
        with(&[("TORCHELASTIC_RUN_ID", "abc")]).unwrap().secret,
        Some(RendezvousSecret::from_run_id("abc"))
    );
    // The token wins over the run id.
    let e = with(&[("TORCHELASTIC_RUN_ID", "abc"), ("LOWBIT_RDZV_TOKEN", "t")]).unwrap();
    assert_eq!(e.secret, Some(RendezvousSecret::from_token(b"t")));
    assert_ne!(e.secret, Some(RendezvousSecret::from_run_id("t")));
    // The key never shows.
    assert!(!format!("{e:?}").contains("key: ["), "{e:?}");
    let err = with(&[("LOWBIT_RDZV_TOKEN", "")]).unwrap_err();
    assert!(
        err.to_string()
            .contains("LOWBIT_RDZV_TOKEN is set but empty"),
        "{err}"
    );
    let e = with(&[("LOWBIT_RDZV_BIND", "::1"), ("LOCAL_WORLD_SIZE", "1")]).unwrap();
    assert_eq!(e.bind.as_deref(), Some("::1"));
    assert_eq!(e.local_world_size, Some(1));
}

#[test]
fn without_a_secret_only_loopback_is_allowed() {
    let e = env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "192.0.2.1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    let t0 = Instant::now();
    let err = e.exchange(|| Ok(vec![]), T).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(1), "it tried to connect");
    assert!(matches!(err, RendezvousError::Auth { .. }), "{err}");
    assert!(err.to_string().contains("LOWBIT_RDZV_TOKEN"), "{err}");
    let e = env(&[
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("LOWBIT_RDZV_BIND", "0.0.0.0"),
        ("MASTER_PORT", &free_port().to_string()),
    ])
    .unwrap();
    let err = e
        .exchange(|| panic!("no payload without a secret"), T)
        .unwrap_err();
    assert!(matches!(err, RendezvousError::Auth { .. }), "{err}");
    // The old entry points: loopback only.
    let server = RendezvousServer::bind("0.0.0.0:0").unwrap();
    let err = server.serve(2, b"x", T).unwrap_err();
    assert!(matches!(err, RendezvousError::Auth { .. }), "{err}");
    let err = fetch("192.0.2.1:9", 1, 2, T).unwrap_err();
    assert!(matches!(err, RendezvousError::Auth { .. }), "{err}");
}

#[test]
fn exchange_with_a_token_over_ipv4_and_ipv6() {
    for host in ["127.0.0.1", "::1", "localhost"] {
        if host == "::1" && TcpListener::bind("[::1]:0").is_err() {
            eprintln!("skipped ::1: no IPv6 loopback here");
            continue;
        }
        let envs = three_ranks(host, &[("LOWBIT_RDZV_TOKEN", "s3cret")]);
        let got = exchange_all(&envs, 9);
        assert!(got.iter().all(|g| g == &vec![9u8; 128]), "{host}");
    }
}

#[test]
fn bind_host_listens_where_master_addr_points() {
    let s = RendezvousServer::bind_host("127.0.0.1", 0).unwrap();
    assert!(s.loopback_only());
    assert_eq!(s.local_addrs().len(), 1);
    assert!(s.local_addr().ip().is_loopback());
    // An address of another host (TEST-NET-1) cannot be listened on.
    let e = RendezvousServer::bind_host("192.0.2.1", 0).unwrap_err();
    assert!(e.to_string().contains("LOWBIT_RDZV_BIND"), "{e}");
    // Bracketed IPv6 literals are accepted.
    if let Ok(s) = RendezvousServer::bind_host("[::1]", 0) {
        assert!(s.local_addr().is_ipv6());
    }
}

#[test]
fn a_wrong_world_or_duplicate_rank_is_refused_without_failing_the_job() {
    let (server, addr) = listen();
    std::thread::scope(|s| {
        let serving = s.spawn(|| server.serve(3, b"x", T));
        let e = fetch(&addr, 1, 4, T).unwrap_err();
        assert!(
            e.to_string()
                .contains("world size 4, rank 0 has world size 3"),
            "{e}"
        );
        let e = fetch(&addr, 1, 2, T).unwrap_err();
        assert!(e.to_string().contains("world size 2"), "{e}");
        assert_eq!(fetch(&addr, 1, 3, T).unwrap(), b"x");
        let e = fetch(&addr, 1, 3, T).unwrap_err();
        assert!(e.to_string().contains("checked in twice"), "{e}");
        assert_eq!(fetch(&addr, 2, 3, T).unwrap(), b"x");
        serving.join().unwrap().unwrap();
    });
}

#[test]
fn the_timeout_names_refused_ranks() {
    let (server, addr) = listen();
    std::thread::scope(|s| {
        let serving = s.spawn(|| server.serve(2, b"x", Duration::from_millis(600)));
        assert!(fetch(&addr, 1, 3, T).is_err());
        let e = serving.join().unwrap().unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("[1]") && text.contains("world size 3"),
            "{text}"
        );
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
    let mut short_body = header(STATUS_CHALLENGE, 64);
    short_body.extend_from_slice(&[1; 60]);
    let mut rejected = header(STATUS_REJECTED, 3);
    rejected.extend_from_slice(b"no!");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
            "not a lowbit rendezvous reply",
        ),
        (
            MAGIC[..5].to_vec(),
            "connection closed after 5 of 20 bytes of the challenge",
        ),
        (
            short_body,
            "connection closed after 60 of 64 bytes of the reply body",
        ),
        (header(STATUS_CHALLENGE, 1 << 30), "more than 65568"),
        (header(STATUS_REJECTED, 1 << 20), "more than 4096"),
        (header(9, 0), "expected a challenge, got status 9"),
        (rejected, "rejected rank 1: no!"),
    ];
    for (bytes, want) in cases {
        let (addr, h) = fake_server(bytes);
        let e = fetch(&addr, 1, 2, T).unwrap_err();
        assert!(e.to_string().contains(want), "{want}: {e}");
        h.join().unwrap();
    }
}

#[test]
fn a_server_closing_before_the_challenge_is_retried_until_the_timeout() {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = std::thread::spawn(move || {
        for _ in 0..3 {
            let (c, _) = l.accept().unwrap();
            drop(c);
        }
    });
    let t0 = Instant::now();
    let e = fetch(&addr, 1, 2, Duration::from_millis(600)).unwrap_err();
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert!(
        e.to_string().contains("closed before the challenge")
            || e.to_string().contains("could not reach"),
        "{e}"
    );
    h.join().unwrap();
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

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[test]
fn sha256_matches_fips_180_vectors() {
    assert_eq!(
        hex(&mac::sha256(b"")),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        hex(&mac::sha256(b"abc")),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert_eq!(
        hex(&mac::sha256(
            b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"
        )),
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    );
    let million = vec![b'a'; 1_000_000];
    assert_eq!(
        hex(&mac::sha256(&million)),
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
    );
    // Split updates give the same digest.
    let mut s = mac::Sha256::new();
    for c in million.chunks(777) {
        s.update(c);
    }
    assert_eq!(s.finish(), mac::sha256(&million));
}

#[test]
fn hmac_matches_rfc_4231_vectors() {
    let cases: [(Vec<u8>, Vec<u8>, &str); 6] = [
        (
            vec![0x0b; 20],
            b"Hi There".to_vec(),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7",
        ),
        (
            b"Jefe".to_vec(),
            b"what do ya want for nothing?".to_vec(),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843",
        ),
        (
            vec![0xaa; 20],
            vec![0xdd; 50],
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe",
        ),
        (
            (1..=25u8).collect(),
            vec![0xcd; 50],
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b",
        ),
        (
            vec![0xaa; 131],
            b"Test Using Larger Than Block-Size Key - Hash Key First".to_vec(),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54",
        ),
        (
            vec![0xaa; 131],
            b"This is a test using a larger than block-size key and a larger than block-size data. The key needs to be hashed before being used by the HMAC algorithm.".to_vec(),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2",
        ),
    ];
    for (key, data, want) in cases {
        assert_eq!(hex(&mac::hmac(&key, &[&data])), want);
        // Parts are concatenated.
        let (a, b) = data.split_at(data.len() / 2);
        assert_eq!(hex(&mac::hmac(&key, &[a, b])), want);
    }
    // RFC 4231 test case 5 (output truncated to 128 bits).
    let t5 = mac::hmac(&[0x0c; 20], &[b"Test With Truncation"]);
    assert_eq!(hex(&t5[..16]), "a3b6167473100ee06e0c796c2955552b");
}

#[test]
fn the_payload_is_encrypted_and_tampering_is_detected() {
    let secret = RendezvousSecret::from_token(b"k");
    let t = [3u8; TRANSCRIPT_LEN];
    let session = secret.session(&t);
    let plain: Vec<u8> = (0..100u8).collect();
    let mut ct = plain.clone();
    session.apply_keystream(&mut ct);
    assert_ne!(ct, plain);
    let tag = session.tag(b"h", &ct);
    let mut back = ct.clone();
    session.apply_keystream(&mut back);
    assert_eq!(back, plain);
    ct[5] ^= 1;
    assert_ne!(session.tag(b"h", &ct), tag);
    // Another transcript, another key; proofs of the two roles differ.
    let mut t2 = t;
    t2[60] ^= 1;
    assert_ne!(secret.server_proof(&t), secret.server_proof(&t2));
    assert_ne!(secret.server_proof(&t), secret.client_proof(&t));
    assert!(mac::ct_eq(b"ab", b"ab") && !mac::ct_eq(b"ab", b"ac") && !mac::ct_eq(b"a", b"ab"));
    assert_ne!(mac::random32(), mac::random32());
}
