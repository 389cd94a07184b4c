//! A man in the middle between a real rank and the real rank 0 that changes ONE byte of what
//! passes: the last byte of rank 0's proof, the last byte of the rank's proof, one byte of the
//! encrypted payload or of its tag. Every wrong proof other tests send differs from the right
//! one everywhere, so a comparison of the first byte only would pass them; these differ from
//! the right one in a single (last) byte, and the payload is the genuine one but for one byte,
//! so a client that skipped the tag check would accept it.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::Duration;

use lowbit_comm::rendezvous::{
    RendezvousError, RendezvousSecret, RendezvousServer, ServeOptions, fetch_with,
};

/// magic, version, rank, world, nonce: what the client sends first.
const HELLO: usize = 8 + 4 + 4 + 4 + 32;
/// magic, version, status, length: every frame's header.
const FRAME_HEADER: usize = 8 + 4 + 4 + 4;
/// HMAC-SHA256.
const MAC: usize = 32;
/// The challenge frame: the header, rank 0's nonce and its proof.
const CHALLENGE: usize = FRAME_HEADER + 32 + MAC;

fn secret() -> RendezvousSecret {
    RendezvousSecret::from_token(b"the job's token")
}

fn payload() -> Vec<u8> {
    (0..96u32).map(|i| (i * 53 + 7) as u8).collect()
}

/// Copies `from` to `to`, XORing byte `flip` (counted from the start of the stream) with 1;
/// returns every byte it forwarded (as sent on).
fn pump(mut from: TcpStream, mut to: TcpStream, flip: Option<usize>) -> Vec<u8> {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let at = seen.len();
        if let Some(f) = flip
            && (at..at + n).contains(&f)
        {
            buf[f - at] ^= 1;
        }
        seen.extend_from_slice(&buf[..n]);
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    seen
}

/// What passed through the middle: client to server, server to client.
struct Relayed {
    up: Vec<u8>,
    down: Vec<u8>,
}

/// Listens on a loopback port; relays one client to `server`, flipping byte `up` of the
/// client's stream and byte `down` of the server's.
fn middle(
    server: SocketAddr,
    up: Option<usize>,
    down: Option<usize>,
) -> (String, thread::JoinHandle<Relayed>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let h = thread::spawn(move || {
        let (client, _) = l.accept().unwrap();
        let real = TcpStream::connect(server).unwrap();
        let (c2, r2) = (client.try_clone().unwrap(), real.try_clone().unwrap());
        let upward = thread::spawn(move || pump(c2, r2, up));
        let down = pump(real, client, down);
        Relayed {
            up: upward.join().unwrap(),
            down,
        }
    });
    (addr, h)
}

/// Rank 0 serving [`payload`] to a world of 2 with a short deadline (the one rank is relayed).
fn serve(deadline: Duration) -> (SocketAddr, thread::JoinHandle<Result<(), RendezvousError>>) {
    let server = RendezvousServer::bind("127.0.0.1:0").unwrap();
    let addr = server.local_addr();
    let h = thread::spawn(move || {
        server.serve_with(2, &payload(), &secret(), deadline, ServeOptions::default())
    });
    (addr, h)
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The relay itself changes nothing: the rank gets the payload through it (so the failures
/// below are the flipped byte's).
#[test]
fn an_honest_middle_changes_nothing() {
    let (real, serving) = serve(Duration::from_secs(20));
    let (addr, relay) = middle(real, None, None);
    let got = fetch_with(&addr, 1, 2, &secret(), Duration::from_secs(20)).unwrap();
    assert_eq!(got, payload());
    serving.join().unwrap().unwrap();
    let r = relay.join().unwrap();
    assert_eq!(r.up.len(), HELLO + MAC);
    assert!(r.down.len() > CHALLENGE + FRAME_HEADER + MAC);
    assert!(!contains(&r.down, &payload()), "the payload went in clear");
}

#[test]
fn the_client_refuses_a_server_proof_wrong_in_its_last_byte_only() {
    let (real, serving) = serve(Duration::from_secs(2));
    let (addr, relay) = middle(real, None, Some(CHALLENGE - 1));
    let e = fetch_with(&addr, 1, 2, &secret(), Duration::from_secs(10)).unwrap_err();
    assert!(matches!(e, RendezvousError::Auth { .. }), "{e}");
    assert!(
        e.to_string().contains("did not prove the job secret"),
        "{e}"
    );
    let r = relay.join().unwrap();
    // The client stopped before proving anything: only its hello went up.
    assert_eq!(
        r.up.len(),
        HELLO,
        "the client sent its proof to an impostor"
    );
    assert!(matches!(
        serving.join().unwrap(),
        Err(RendezvousError::Timeout { .. })
    ));
}

#[test]
fn the_server_refuses_a_client_proof_wrong_in_its_last_byte_only() {
    let (real, serving) = serve(Duration::from_secs(2));
    let (addr, relay) = middle(real, Some(HELLO + MAC - 1), None);
    let e = fetch_with(&addr, 1, 2, &secret(), Duration::from_secs(10)).unwrap_err();
    let r = relay.join().unwrap();
    // Nothing after the challenge came back: no payload frame.
    assert_eq!(
        r.down.len(),
        CHALLENGE,
        "rank 0 answered a wrong proof ({e})"
    );
    match serving.join().unwrap() {
        // The one rank never checked in: its connection was dropped (the server logs "wrong
        // proof of the job secret").
        Err(RendezvousError::Timeout {
            missing, dropped, ..
        }) => {
            assert_eq!(missing, [1]);
            assert!(dropped.contains("1 connection"), "{dropped}");
        }
        other => panic!("rank 0 served a wrong proof: {other:?}"),
    }
}

#[test]
fn the_client_refuses_a_payload_changed_by_one_byte_in_transit() {
    let len = payload().len();
    let body = CHALLENGE + FRAME_HEADER;
    // A byte of the ciphertext, its first and last, and the tag's last byte.
    for at in [body + len / 2, body, body + len - 1, body + len + MAC - 1] {
        let (real, serving) = serve(Duration::from_secs(10));
        let (addr, relay) = middle(real, None, Some(at));
        let got = fetch_with(&addr, 1, 2, &secret(), Duration::from_secs(10));
        match got {
            Err(e @ RendezvousError::Auth { .. }) => {
                assert!(
                    e.to_string().contains("altered in transit"),
                    "byte {at}: {e}"
                );
            }
            other => panic!("byte {at}: a tampered payload was accepted: {other:?}"),
        }
        relay.join().unwrap();
        // Rank 0 served it (the tampering is after it): its part succeeded.
        serving.join().unwrap().unwrap();
    }
}
