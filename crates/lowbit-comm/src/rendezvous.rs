//! The TCP rendezvous of a multi-process group: rank 0 hands an opaque payload (the 128-byte NCCL
//! unique id) to every other rank. It knows nothing of CUDA, so it is built and tested everywhere.
//!
//! The world is described by the environment as `torchrun` sets it ([`RendezvousEnv`]). Rank 0
//! listens ([`RendezvousServer`]) and answers each other rank's hello with the payload; the other
//! ranks connect to it ([`fetch`]), retrying refused connections until their timeout, because
//! rank 0 may start listening after they start.
//!
//! # Wire format (little-endian)
//! - hello, rank → rank 0: `MAGIC` (8 bytes), [`VERSION`] (u32), rank (u32), world size (u32).
//! - reply, rank 0 → rank: `MAGIC`, [`VERSION`], status (u32: 0 accepted, 1 rejected), length
//!   (u32, at most [`MAX_PAYLOAD`]), then that many bytes: the payload, or the UTF-8 reason of a
//!   rejection.
//!
//! Every read and write has a deadline. A short message (the peer closed early), a wrong magic
//! (not a lowbit rendezvous), another version, a rank outside the world, a rank that checked in
//! twice or a world size that differs from rank 0's is an error naming the peer and the problem;
//! rank 0 rejects such a peer (telling it why where the peer can read it) and fails too, so a
//! misconfigured launch fails on every rank instead of half-starting.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// First bytes of every message.
pub const MAGIC: [u8; 8] = *b"LOWBITRV";
/// Protocol version; both sides must agree.
pub const VERSION: u32 = 1;
/// Largest payload a reply may carry.
pub const MAX_PAYLOAD: usize = 64 * 1024;

const HELLO_LEN: usize = 20;
const REPLY_HEADER_LEN: usize = 20;
const STATUS_OK: u32 = 0;
const STATUS_REJECTED: u32 = 1;

/// Errors of the rendezvous. Each names the peer or variable involved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RendezvousError {
    /// An environment variable is missing or malformed.
    #[error("rendezvous environment: {0}")]
    Env(String),
    /// A rank outside `0..world`, or a world of zero ranks.
    #[error("rendezvous: rank {rank} is not a rank of a world of {world}")]
    BadRank {
        /// The rank given.
        rank: usize,
        /// The world size given.
        world: usize,
    },
    /// Rank 0 cannot listen on its address.
    #[error("rendezvous: rank 0 cannot listen on {addr}: {detail}")]
    Listen {
        /// The address.
        addr: String,
        /// The operating system's reason (and a hint).
        detail: String,
    },
    /// A rank could not connect to rank 0 before its timeout.
    #[error("rendezvous: rank {rank} could not reach rank 0 at {addr} within {waited:?}: {last}")]
    Connect {
        /// The rank that tried.
        rank: usize,
        /// Rank 0's address.
        addr: String,
        /// How long it tried.
        waited: Duration,
        /// The last error.
        last: String,
    },
    /// Rank 0 waited longer than its timeout for some ranks.
    #[error("rendezvous: rank 0 timed out after {waited:?} waiting for rank(s) {missing:?}")]
    Timeout {
        /// How long it waited.
        waited: Duration,
        /// The ranks that never checked in.
        missing: Vec<usize>,
    },
    /// A message that breaks the protocol: short, garbled, another version, too long.
    #[error("rendezvous: message from {peer}: {detail}")]
    Protocol {
        /// Who sent it (`rank 0 at …` or the peer's socket address and rank if known).
        peer: String,
        /// What is wrong.
        detail: String,
    },
    /// Rank 0 rejected this rank's hello (or a peer's, on rank 0).
    #[error("rendezvous: rank 0 rejected rank {rank}: {reason}")]
    Rejected {
        /// The rejected rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// A read or write failed or passed its deadline.
    #[error("rendezvous: I/O with {peer}: {detail}")]
    Io {
        /// The other side.
        peer: String,
        /// The operating system's error.
        detail: String,
    },
}

/// Result of the rendezvous.
pub type Result<T, E = RendezvousError> = std::result::Result<T, E>;

mod env;

pub use env::RendezvousEnv;

/// Rank 0's listening socket.
#[derive(Debug)]
pub struct RendezvousServer {
    listener: TcpListener,
    addr: SocketAddr,
}

impl RendezvousServer {
    /// Listens on `addr` (port 0 picks a free port; see [`RendezvousServer::local_addr`]).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let shown = format!("{addr:?}");
        let listener = TcpListener::bind(&addr).map_err(|e| RendezvousError::Listen {
            addr: shown.clone(),
            detail: if e.kind() == io::ErrorKind::AddrInUse {
                format!(
                    "{e} (another program holds the port; under torchrun set LOWBIT_RDZV_PORT \
                     to a free port)"
                )
            } else {
                e.to_string()
            },
        })?;
        let addr = listener.local_addr().map_err(|e| RendezvousError::Listen {
            addr: shown,
            detail: e.to_string(),
        })?;
        Ok(RendezvousServer { listener, addr })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Answers ranks `1..world` with `payload`, each once, and returns when all have it. Fails
    /// on the first bad message (rejecting that peer) or when `timeout` passes.
    pub fn serve(self, world: usize, payload: &[u8], timeout: Duration) -> Result<()> {
        if world == 0 {
            return Err(RendezvousError::BadRank { rank: 0, world });
        }
        if payload.len() > MAX_PAYLOAD {
            return Err(RendezvousError::Protocol {
                peer: "rank 0 (itself)".into(),
                detail: format!("payload of {} bytes exceeds {MAX_PAYLOAD}", payload.len()),
            });
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let mut served = vec![false; world];
        served[0] = true;
        let io_err = |peer: &str, e: io::Error| RendezvousError::Io {
            peer: peer.to_string(),
            detail: e.to_string(),
        };
        self.listener
            .set_nonblocking(true)
            .map_err(|e| io_err("the listening socket", e))?;
        while served.iter().any(|s| !s) {
            let (mut stream, peer) = match self.listener.accept() {
                Ok(c) => c,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Err(RendezvousError::Timeout {
                            waited: start.elapsed(),
                            missing: (0..world).filter(|&r| !served[r]).collect(),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(5));
                    continue;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err("the listening socket", e)),
            };
            let peer = format!("{peer}");
            stream
                .set_nonblocking(false)
                .map_err(|e| io_err(&peer, e))?;
            set_deadline(&stream, deadline).map_err(|e| io_err(&peer, e))?;
            let mut hello = [0u8; HELLO_LEN];
            read_full(&mut stream, &mut hello, &peer, "hello")?;
            let (version, rank, their_world) = match parse_hello(&hello) {
                Ok(h) => h,
                Err(detail) => {
                    // Not ours: answer in our format anyway, the peer may be a lowbit of
                    // another version that can read the reason.
                    let _ = reply(&mut stream, STATUS_REJECTED, detail.as_bytes());
                    return Err(RendezvousError::Protocol { peer, detail });
                }
            };
            let reject = if version != VERSION {
                Some(format!(
                    "protocol version {version}, rank 0 speaks version {VERSION}"
                ))
            } else if their_world != world {
                Some(format!(
                    "world size {their_world}, rank 0 has world size {world}"
                ))
            } else if rank == 0 || rank >= world {
                Some(format!("rank {rank} is not a rank 1..{world}"))
            } else if served[rank] {
                Some(format!("rank {rank} checked in twice"))
            } else {
                None
            };
            if let Some(reason) = reject {
                let _ = reply(&mut stream, STATUS_REJECTED, reason.as_bytes());
                return Err(RendezvousError::Rejected { rank, reason });
            }
            reply(&mut stream, STATUS_OK, payload)
                .map_err(|e| io_err(&format!("rank {rank} at {peer}"), e))?;
            served[rank] = true;
        }
        Ok(())
    }
}

/// Connects to rank 0 at `addr` (`host:port`) as `rank` of `world`, retrying until `timeout`,
/// and returns the payload it sends.
pub fn fetch(addr: &str, rank: usize, world: usize, timeout: Duration) -> Result<Vec<u8>> {
    if rank == 0 || rank >= world {
        return Err(RendezvousError::BadRank { rank, world });
    }
    let (Ok(rank32), Ok(world32)) = (u32::try_from(rank), u32::try_from(world)) else {
        return Err(RendezvousError::BadRank { rank, world });
    };
    let start = Instant::now();
    let deadline = start + timeout;
    let peer = format!("rank 0 at {addr}");
    let mut stream = loop {
        let last = match connect_once(addr, deadline) {
            Ok(s) => break s,
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
    };
    let io_err = |e: io::Error| RendezvousError::Io {
        peer: peer.clone(),
        detail: e.to_string(),
    };
    set_deadline(&stream, deadline).map_err(io_err)?;
    let mut hello = Vec::with_capacity(HELLO_LEN);
    hello.extend_from_slice(&MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&rank32.to_le_bytes());
    hello.extend_from_slice(&world32.to_le_bytes());
    stream.write_all(&hello).map_err(io_err)?;
    let mut header = [0u8; REPLY_HEADER_LEN];
    read_full(&mut stream, &mut header, &peer, "reply header")?;
    let protocol = |detail: String| RendezvousError::Protocol {
        peer: peer.clone(),
        detail,
    };
    if header[..8] != MAGIC {
        return Err(protocol(format!(
            "not a lowbit rendezvous reply (first bytes {:02x?})",
            &header[..8]
        )));
    }
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
    let (version, status, len) = (word(8), word(12), word(16) as usize);
    if len > MAX_PAYLOAD {
        return Err(protocol(format!(
            "reply announces {len} bytes, more than {MAX_PAYLOAD}"
        )));
    }
    let mut body = vec![0u8; len];
    read_full(&mut stream, &mut body, &peer, "reply body")?;
    match status {
        STATUS_REJECTED => Err(RendezvousError::Rejected {
            rank,
            reason: String::from_utf8_lossy(&body).into_owned(),
        }),
        _ if version != VERSION => Err(protocol(format!(
            "protocol version {version}, this rank speaks version {VERSION}"
        ))),
        STATUS_OK => Ok(body),
        other => Err(protocol(format!("unknown status {other}"))),
    }
}

fn connect_once(addr: &str, deadline: Instant) -> Result<TcpStream, String> {
    let addrs: Vec<SocketAddr> = addr
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {addr}: {e}"))?
        .collect();
    let mut last = format!("{addr} resolves to no address");
    for a in addrs {
        let left = deadline.saturating_duration_since(Instant::now());
        let wait = left
            .min(Duration::from_secs(2))
            .max(Duration::from_millis(10));
        match TcpStream::connect_timeout(&a, wait) {
            Ok(s) => return Ok(s),
            Err(e) => last = format!("{a}: {e}"),
        }
    }
    Err(last)
}

fn set_deadline(stream: &TcpStream, deadline: Instant) -> io::Result<()> {
    // A zero timeout means "none" to the OS, so keep at least a millisecond.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .max(Duration::from_millis(1));
    stream.set_read_timeout(Some(left))?;
    stream.set_write_timeout(Some(left))?;
    stream.set_nodelay(true)
}

/// Reads exactly `buf.len()` bytes, naming a short read.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], peer: &str, what: &str) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        match stream.read(&mut buf[got..]) {
            Ok(0) => {
                return Err(RendezvousError::Protocol {
                    peer: peer.to_string(),
                    detail: format!(
                        "connection closed after {got} of {} bytes of the {what}",
                        buf.len()
                    ),
                });
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let detail = if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) {
                    format!("timed out after {got} of {} bytes of the {what}", buf.len())
                } else {
                    format!("{e} after {got} of {} bytes of the {what}", buf.len())
                };
                return Err(RendezvousError::Io {
                    peer: peer.to_string(),
                    detail,
                });
            }
        }
    }
    Ok(())
}

fn parse_hello(h: &[u8; HELLO_LEN]) -> Result<(u32, usize, usize), String> {
    if h[..8] != MAGIC {
        return Err(format!(
            "not a lowbit rendezvous hello (first bytes {:02x?})",
            &h[..8]
        ));
    }
    let word = |i: usize| u32::from_le_bytes(h[i..i + 4].try_into().expect("4 bytes"));
    Ok((word(8), word(12) as usize, word(16) as usize))
}

fn reply(stream: &mut TcpStream, status: u32, body: &[u8]) -> io::Result<()> {
    let mut msg = Vec::with_capacity(REPLY_HEADER_LEN + body.len());
    msg.extend_from_slice(&MAGIC);
    msg.extend_from_slice(&VERSION.to_le_bytes());
    msg.extend_from_slice(&status.to_le_bytes());
    msg.extend_from_slice(&(body.len() as u32).to_le_bytes());
    msg.extend_from_slice(body);
    stream.write_all(&msg)?;
    stream.flush()
}

#[cfg(test)]
mod tests;
