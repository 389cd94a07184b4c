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

/// The world of one process, read from the environment as `torchrun` sets it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RendezvousEnv {
    /// `RANK`: this process's rank in the world.
    pub rank: usize,
    /// `WORLD_SIZE`: number of processes (one per GPU).
    pub world_size: usize,
    /// `LOCAL_RANK`: this process's GPU on its host (default: `RANK`).
    pub local_rank: usize,
    /// `MASTER_ADDR`: rank 0's host (default `127.0.0.1`).
    pub master_addr: String,
    /// The port rank 0 listens on: `LOWBIT_RDZV_PORT` if set; else `MASTER_PORT + 1` under a
    /// torchrun agent that holds `MASTER_PORT` itself (`TORCHELASTIC_USE_AGENT_STORE=True`);
    /// else `MASTER_PORT`.
    pub port: u16,
}

impl RendezvousEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads the variables through `get` (for tests and launchers that hold them elsewhere).
    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let number = |name: &str| -> Result<Option<u64>> {
            match get(name) {
                None => Ok(None),
                Some(v) => v.trim().parse::<u64>().map(Some).map_err(|_| {
                    RendezvousError::Env(format!("{name}={v:?} is not a non-negative integer"))
                }),
            }
        };
        let required = |name: &str| -> Result<u64> {
            number(name)?.ok_or_else(|| RendezvousError::Env(format!("{name} is not set")))
        };
        let to_usize = |v: u64| usize::try_from(v).unwrap_or(usize::MAX);
        let rank = to_usize(required("RANK")?);
        let world_size = to_usize(required("WORLD_SIZE")?);
        if world_size == 0 || rank >= world_size {
            return Err(RendezvousError::BadRank {
                rank,
                world: world_size,
            });
        }
        let local_rank = number("LOCAL_RANK")?.map_or(rank, to_usize);
        let master_addr = get("MASTER_ADDR")
            .filter(|s| !s.trim().is_empty())
            .unwrap_or_else(|| "127.0.0.1".to_string());
        let port_of = |name: &str, v: u64| {
            u16::try_from(v)
                .ok()
                .filter(|&p| p != 0)
                .ok_or_else(|| RendezvousError::Env(format!("{name}={v} is not a TCP port")))
        };
        let port = if let Some(p) = number("LOWBIT_RDZV_PORT")? {
            port_of("LOWBIT_RDZV_PORT", p)?
        } else {
            let p = port_of("MASTER_PORT", required("MASTER_PORT")?)?;
            let agent = get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v == "True");
            if agent {
                p.checked_add(1).ok_or_else(|| {
                    RendezvousError::Env(format!(
                        "MASTER_PORT={p}: no port above it for the rendezvous (set LOWBIT_RDZV_PORT)"
                    ))
                })?
            } else {
                p
            }
        };
        Ok(RendezvousEnv {
            rank,
            world_size,
            local_rank,
            master_addr,
            port,
        })
    }

    /// `host:port` of rank 0 (IPv6 literals bracketed).
    pub fn server_addr(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.port)
        } else {
            format!("{}:{}", self.master_addr, self.port)
        }
    }

    /// Rank 0 serves `payload()` to the others; the others fetch it. Returns the payload on every
    /// rank. `payload` runs on rank 0 only, after it listens.
    pub fn exchange(
        &self,
        payload: impl FnOnce() -> Result<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        if self.rank == 0 {
            let server = RendezvousServer::bind(("0.0.0.0", self.port))?;
            let bytes = payload()?;
            server.serve(self.world_size, &bytes, timeout)?;
            Ok(bytes)
        } else {
            fetch(&self.server_addr(), self.rank, self.world_size, timeout)
        }
    }
}

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
mod tests {
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
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
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
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
            .to_string();
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
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
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
}
