//! The TCP rendezvous of a multi-process group: rank 0 hands an opaque payload (the 128-byte NCCL
//! unique id) to every other rank. It knows nothing of CUDA, so it is built and tested everywhere.
//!
//! The world is described by the environment as `torchrun` sets it ([`RendezvousEnv`]). Rank 0
//! listens ([`RendezvousServer`]) on the address `MASTER_ADDR` resolves to (every address it
//! resolves to on this host, IPv4 and IPv6; `LOWBIT_RDZV_BIND` overrides), and the other ranks
//! connect to it ([`fetch_with`]), retrying refused connections until their timeout, because
//! rank 0 may start listening after they start.
//!
//! # Authentication
//! Every rank holds a job secret ([`RendezvousSecret`]): `LOWBIT_RDZV_TOKEN` if set; else
//! torchrun's `TORCHELASTIC_RUN_ID` (unless it is `none`, torchrun's default without
//! `--rdzv-id`); else, only when every address involved is a loopback address, a public default
//! key with a notice on stderr (any local user can then join, as before); otherwise the
//! rendezvous refuses to run. Both sides prove the secret by a challenge–response HMAC-SHA256
//! over both nonces, rank 0 first (a fake rank 0 fails the client before it proves anything),
//! and the payload goes only to a peer that proved it, encrypted and authenticated under a key
//! of that connection.
//!
//! # Wire format (little-endian; `T` = hello ‖ server nonce, 84 bytes)
//! - hello, rank → rank 0 (52 bytes): `MAGIC` (8), [`VERSION`] (u32), rank (u32), world size
//!   (u32), client nonce (32).
//! - every message rank 0 → rank: `MAGIC` (8), [`VERSION`] (u32), status (u32), length (u32,
//!   at most [`MAX_PAYLOAD`] + 32), then that many bytes:
//!   - status 2, challenge: server nonce (32), `HMAC(K, "lowbit-rdzv-v2 server proof" ‖ T)` (32);
//!   - status 0, accepted: the payload XOR the keystream `HMAC(S, "lowbit-rdzv-v2 stream" ‖ i
//!     as u64)`, then `HMAC(S, "lowbit-rdzv-v2 payload tag" ‖ these 20 header bytes ‖
//!     ciphertext)` (32), with `S = HMAC(K, "lowbit-rdzv-v2 session key" ‖ T)`;
//!   - status 1, rejected: the UTF-8 reason (another version, or, after authentication, a
//!     world size that differs, a rank out of range or already served).
//! - proof, rank → rank 0, after a valid challenge (32 bytes): `HMAC(K, "lowbit-rdzv-v2 client
//!   proof" ‖ T)`.
//!
//! # Robustness
//! Rank 0 handles each connection on its own thread under a short deadline of its own
//! ([`ServeOptions::handshake_timeout`]), at most [`ServeOptions::max_connections`] at once.
//! Garbage, HTTP requests, connections closed early or left silent, failed proofs, other
//! versions, and authenticated hellos with another world size, an out-of-range rank or a rank
//! already served are dropped and logged on stderr with the peer address; the job fails only
//! when some rank has not been served by the deadline ([`RendezvousError::Timeout`], which names
//! the missing ranks and what was dropped). A rank retries while rank 0 refuses connections or
//! closes them before its challenge; a wrong challenge, a rejection, a bad tag or a silent rank 0
//! fail it.
//!
//! # After the rendezvous
//! [`RendezvousEnv::exchange_live`] keeps every served connection open as the
//! [`liveness`](crate::liveness) channel (rank 0 holds one per other rank); its frames are
//! authenticated under a key derived from the connection's session key `S`.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// First bytes of every message.
pub const MAGIC: [u8; 8] = *b"LOWBITRV";
/// Protocol version; both sides must agree.
pub const VERSION: u32 = 2;
/// Largest payload a reply may carry.
pub const MAX_PAYLOAD: usize = 64 * 1024;

const HELLO_LEN: usize = 52;
const FRAME_HEADER_LEN: usize = 20;
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const TRANSCRIPT_LEN: usize = HELLO_LEN + NONCE_LEN;
const STATUS_OK: u32 = 0;
const STATUS_REJECTED: u32 = 1;
const STATUS_CHALLENGE: u32 = 2;
/// Longest rejection reason a client reads.
const MAX_REASON: usize = 4096;
/// Dropped connections logged on stderr by one `serve` before it stops logging them.
const MAX_LOGGED: usize = 64;

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
    #[error(
        "rendezvous: rank 0 timed out after {waited:?} waiting for rank(s) {missing:?}{dropped}"
    )]
    Timeout {
        /// How long it waited.
        waited: Duration,
        /// The ranks that never checked in.
        missing: Vec<usize>,
        /// What was dropped meanwhile (empty, or `"; dropped: …"`).
        dropped: String,
    },
    /// A message that breaks the protocol: short, garbled, another version, too long.
    #[error("rendezvous: message from {peer}: {detail}")]
    Protocol {
        /// Who sent it (`rank 0 at …` or the peer's socket address and rank if known).
        peer: String,
        /// What is wrong.
        detail: String,
    },
    /// The peer could not prove the job secret (or this side has no usable secret).
    #[error("rendezvous: authentication with {peer} failed: {detail}")]
    Auth {
        /// The other side.
        peer: String,
        /// What failed, and the likely cause.
        detail: String,
    },
    /// Rank 0 rejected this rank's hello.
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

/// An authenticated connection left open after the rendezvous: the liveness channel's link to
/// the rank at the other end (see [`crate::liveness`]).
pub(crate) struct Link {
    /// The rank at the other end.
    pub(crate) rank: usize,
    pub(crate) stream: TcpStream,
    /// The key of this connection's liveness frames (derived from its session key).
    pub(crate) key: [u8; 32],
}

mod client;
mod env;
pub(crate) mod mac;
mod secret;
mod server;

pub(crate) use client::fetch_link;
pub use client::{fetch, fetch_with};
pub use env::RendezvousEnv;
pub use secret::RendezvousSecret;
pub use server::{RendezvousServer, ServeOptions};

pub(crate) fn no_secret_hint() -> String {
    "no job secret: set LOWBIT_RDZV_TOKEN to the same random value on every rank (for example \\
     `export LOWBIT_RDZV_TOKEN=$(openssl rand -hex 32)` before launching), or launch with \\
     torchrun --rdzv-id <a secret id>; without one only loopback addresses are allowed"
        .to_string()
}

fn word(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
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

fn read_error(peer: &str, e: &io::Error, got: usize, len: usize, what: &str) -> RendezvousError {
    let detail = if matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    ) {
        format!("timed out after {got} of {len} bytes of the {what}")
    } else {
        format!("{e} after {got} of {len} bytes of the {what}")
    };
    RendezvousError::Io {
        peer: peer.to_string(),
        detail,
    }
}

/// Reads exactly `buf.len()` bytes, naming a short read.
fn read_full(stream: &mut TcpStream, buf: &mut [u8], peer: &str, what: &str) -> Result<()> {
    read_from(stream, buf, 0, peer, what)
}

/// Fills `buf[got..]`, naming a short read by its place in all of `buf`.
fn read_from(
    stream: &mut TcpStream,
    buf: &mut [u8],
    mut got: usize,
    peer: &str,
    what: &str,
) -> Result<()> {
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
            Err(e) => return Err(read_error(peer, &e, got, buf.len(), what)),
        }
    }
    Ok(())
}

fn frame_header(status: u32, len: usize) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&status.to_le_bytes());
    h[16..20].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

fn write_frame(stream: &mut TcpStream, status: u32, body: &[u8]) -> io::Result<()> {
    let mut msg = frame_header(status, body.len()).to_vec();
    msg.extend_from_slice(body);
    stream.write_all(&msg)?;
    stream.flush()
}

#[cfg(test)]
mod tests;
