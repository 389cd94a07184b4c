//! The other ranks' side: connect (retrying), check rank 0's proof, prove the secret, decrypt.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::{
    FRAME_HEADER_LEN, HELLO_LEN, Link, MAC_LEN, MAGIC, MAX_PAYLOAD, MAX_REASON, NONCE_LEN,
    RendezvousError, RendezvousSecret, Result, STATUS_CHALLENGE, STATUS_OK, STATUS_REJECTED,
    TRANSCRIPT_LEN, VERSION, mac, no_secret_hint, read_error, read_from, read_full, secret,
    set_deadline, word,
};

/// [`fetch_with`] under the public default key: for loopback addresses only (anything else is
/// refused: use `fetch_with` and a secret).
pub fn fetch(addr: &str, rank: usize, world: usize, timeout: Duration) -> Result<Vec<u8>> {
    fetch_with(addr, rank, world, &RendezvousSecret::public(), timeout)
}

/// Connects to rank 0 at `addr` (`host:port`) as `rank` of `world`, retrying until `timeout`
/// while rank 0 refuses the connection or closes it before its challenge, proves `secret` to a
/// rank 0 that proved it first, and returns the payload it sends.
pub fn fetch_with(
    addr: &str,
    rank: usize,
    world: usize,
    secret: &RendezvousSecret,
    timeout: Duration,
) -> Result<Vec<u8>> {
    fetch_link(addr, rank, world, secret, timeout).map(|(payload, _)| payload)
}

/// [`fetch_with`] that keeps the authenticated connection to rank 0 open (for the liveness
/// channel) and returns it with the payload.
pub(crate) fn fetch_link(
    addr: &str,
    rank: usize,
    world: usize,
    secret: &RendezvousSecret,
    timeout: Duration,
) -> Result<(Vec<u8>, Link)> {
    if rank == 0 || rank >= world {
        return Err(RendezvousError::BadRank { rank, world });
    }
    let (Ok(rank32), Ok(world32)) = (u32::try_from(rank), u32::try_from(world)) else {
        return Err(RendezvousError::BadRank { rank, world });
    };
    let start = Instant::now();
    let deadline = start + timeout;
    let peer = format!("rank 0 at {addr}");
    let resolved: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| RendezvousError::Connect {
            rank,
            addr: addr.to_string(),
            waited: start.elapsed(),
            last: format!("cannot resolve {addr}: {e}"),
        })?
        .collect();
    if secret.is_public() && !resolved.iter().all(|a| a.ip().is_loopback()) {
        return Err(RendezvousError::Auth {
            peer,
            detail: no_secret_hint(),
        });
    }
    loop {
        let last = match connect_once(&resolved, addr, deadline) {
            Ok(mut stream) => {
                match handshake(&mut stream, &peer, rank, rank32, world32, secret, deadline) {
                    Ok((payload, key)) => {
                        let link = Link {
                            rank: 0,
                            stream,
                            key,
                        };
                        return Ok((payload, link));
                    }
                    Err(Attempt::Fatal(e)) => return Err(e),
                    Err(Attempt::Retry(e)) => e,
                }
            }
            Err(e) => e,
        };
        if Instant::now() + Duration::from_millis(50) >= deadline {
            return Err(RendezvousError::Connect {
                rank,
                addr: addr.to_string(),
                waited: start.elapsed(),
                last,
            });
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

enum Attempt {
    Retry(String),
    Fatal(RendezvousError),
}

fn handshake(
    stream: &mut TcpStream,
    peer: &str,
    rank: usize,
    rank32: u32,
    world32: u32,
    secret: &RendezvousSecret,
    deadline: Instant,
) -> std::result::Result<(Vec<u8>, [u8; 32]), Attempt> {
    let fatal = Attempt::Fatal;
    let io_err = |e: io::Error| {
        fatal(RendezvousError::Io {
            peer: peer.to_string(),
            detail: e.to_string(),
        })
    };
    let protocol = |detail: String| {
        fatal(RendezvousError::Protocol {
            peer: peer.to_string(),
            detail,
        })
    };
    set_deadline(stream, deadline).map_err(io_err)?;
    let mut transcript = [0u8; TRANSCRIPT_LEN];
    transcript[..8].copy_from_slice(&MAGIC);
    transcript[8..12].copy_from_slice(&VERSION.to_le_bytes());
    transcript[12..16].copy_from_slice(&rank32.to_le_bytes());
    transcript[16..20].copy_from_slice(&world32.to_le_bytes());
    transcript[20..HELLO_LEN].copy_from_slice(&secret::nonce());
    if let Err(e) = stream.write_all(&transcript[..HELLO_LEN]) {
        return Err(Attempt::Retry(format!("sending the hello: {e}")));
    }
    // The challenge; a connection closed before any byte of it may be a rank 0 at capacity.
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut got = 0;
    while got < 1 {
        match stream.read(&mut header) {
            Ok(0) => return Err(Attempt::Retry("closed before the challenge".into())),
            Ok(n) => got = n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                return Err(Attempt::Retry(format!("before the challenge: {e}")));
            }
            Err(e) => {
                return Err(fatal(read_error(
                    peer,
                    &e,
                    0,
                    FRAME_HEADER_LEN,
                    "challenge",
                )));
            }
        }
    }
    read_from(stream, &mut header, got, peer, "challenge").map_err(fatal)?;
    let (status, body) = read_body(stream, &header, peer)?;
    if status == STATUS_REJECTED {
        return Err(fatal(RendezvousError::Rejected {
            rank,
            reason: String::from_utf8_lossy(&body).into_owned(),
        }));
    }
    if status != STATUS_CHALLENGE || body.len() != NONCE_LEN + MAC_LEN {
        return Err(protocol(format!(
            "expected a challenge, got status {status} with {} bytes",
            body.len()
        )));
    }
    transcript[HELLO_LEN..].copy_from_slice(&body[..NONCE_LEN]);
    if !mac::ct_eq(&body[NONCE_LEN..], &secret.server_proof(&transcript)) {
        return Err(fatal(RendezvousError::Auth {
            peer: peer.to_string(),
            detail: format!(
                "it did not prove the job secret ({}): the secret differs between ranks \\
                 (LOWBIT_RDZV_TOKEN / TORCHELASTIC_RUN_ID), or this is not rank 0",
                secret.source()
            ),
        }));
    }
    stream
        .write_all(&secret.client_proof(&transcript))
        .and_then(|()| stream.flush())
        .map_err(io_err)?;
    read_full(stream, &mut header, peer, "reply header").map_err(fatal)?;
    let (status, mut body) = read_body(stream, &header, peer)?;
    match status {
        STATUS_REJECTED => Err(fatal(RendezvousError::Rejected {
            rank,
            reason: String::from_utf8_lossy(&body).into_owned(),
        })),
        STATUS_OK if body.len() >= MAC_LEN => {
            let session = secret.session(&transcript);
            let (ct, tag) = body.split_at(body.len() - MAC_LEN);
            if !mac::ct_eq(tag, &session.tag(&header, ct)) {
                return Err(fatal(RendezvousError::Auth {
                    peer: peer.to_string(),
                    detail: "the payload's tag is wrong (altered in transit)".into(),
                }));
            }
            body.truncate(body.len() - MAC_LEN);
            session.apply_keystream(&mut body);
            Ok((body, session.liveness_key()))
        }
        other => Err(protocol(format!(
            "unknown status {other} with {} bytes",
            body.len()
        ))),
    }
}

/// Checks a frame header and reads its body.
fn read_body(
    stream: &mut TcpStream,
    header: &[u8; FRAME_HEADER_LEN],
    peer: &str,
) -> std::result::Result<(u32, Vec<u8>), Attempt> {
    let protocol = |detail: String| {
        Attempt::Fatal(RendezvousError::Protocol {
            peer: peer.to_string(),
            detail,
        })
    };
    if header[..8] != MAGIC {
        return Err(protocol(format!(
            "not a lowbit rendezvous reply (first bytes {:02x?})",
            &header[..8]
        )));
    }
    let (version, status, len) = (word(header, 8), word(header, 12), word(header, 16) as usize);
    let limit = if status == STATUS_REJECTED {
        MAX_REASON
    } else {
        MAX_PAYLOAD + MAC_LEN
    };
    if len > limit {
        return Err(protocol(format!(
            "reply announces {len} bytes, more than {limit}"
        )));
    }
    let mut body = vec![0u8; len];
    read_full(stream, &mut body, peer, "reply body").map_err(Attempt::Fatal)?;
    if status != STATUS_REJECTED && version != VERSION {
        return Err(protocol(format!(
            "protocol version {version}, this rank speaks version {VERSION}"
        )));
    }
    Ok((status, body))
}

fn connect_once(
    addrs: &[SocketAddr],
    shown: &str,
    deadline: Instant,
) -> std::result::Result<TcpStream, String> {
    let mut last = format!("{shown} resolves to no address");
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(a, wait) {
            // A retried connect to a free port of the ephemeral range can connect the socket
            // to itself (TCP simultaneous open), which would also keep rank 0 off its port.
            Ok(s) if s.local_addr().ok() == Some(*a) => {
                last = format!("{a}: connected to itself (nobody listens yet)");
            }
            Ok(s) => return Ok(s),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}
