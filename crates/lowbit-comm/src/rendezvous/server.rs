//! Rank 0's side: listening on the addresses of `MASTER_ADDR`, a thread and a deadline per
//! connection, the proof check, and the payload to each rank once.

use std::collections::HashMap;
use std::io::{self, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{
    FRAME_HEADER_LEN, HELLO_LEN, Link, MAC_LEN, MAGIC, MAX_LOGGED, MAX_PAYLOAD, NONCE_LEN,
    RendezvousError, RendezvousSecret, Result, STATUS_CHALLENGE, STATUS_OK, STATUS_REJECTED,
    TRANSCRIPT_LEN, VERSION, frame_header, host_port, mac, no_secret_hint, read_full, secret,
    set_deadline, word, write_frame,
};

/// How rank 0 treats each connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServeOptions {
    /// How long one connection may take from accept to its proof (default 5 s): a silent or
    /// slow peer is dropped after this, without delaying any other.
    pub handshake_timeout: Duration,
    /// Connections handled at once (default 64); more are closed at once (the ranks retry).
    pub max_connections: usize,
}

impl Default for ServeOptions {
    fn default() -> Self {
        ServeOptions {
            handshake_timeout: Duration::from_secs(5),
            max_connections: 64,
        }
    }
}

/// Rank 0's listening sockets (one per address).
#[derive(Debug)]
pub struct RendezvousServer {
    listeners: Vec<TcpListener>,
    addrs: Vec<SocketAddr>,
}

fn listen_error(shown: &str, e: &io::Error) -> RendezvousError {
    RendezvousError::Listen {
        addr: shown.to_string(),
        detail: if e.kind() == io::ErrorKind::AddrInUse {
            format!(
                "{e} (another program holds the port; under torchrun set LOWBIT_RDZV_PORT \\
                 to a free port)"
            )
        } else {
            e.to_string()
        },
    }
}

impl RendezvousServer {
    /// Listens on the first address `addr` resolves to (port 0 picks a free port; see
    /// [`RendezvousServer::local_addr`]).
    pub fn bind(addr: impl ToSocketAddrs + std::fmt::Debug) -> Result<Self> {
        let shown = format!("{addr:?}");
        let listener = TcpListener::bind(&addr).map_err(|e| listen_error(&shown, &e))?;
        let a = listener
            .local_addr()
            .map_err(|e| listen_error(&shown, &e))?;
        Ok(RendezvousServer {
            listeners: vec![listener],
            addrs: vec![a],
        })
    }

    /// Listens on every address `host:port` resolves to that belongs to this host (IPv4 and
    /// IPv6 literals, bracketed or not, and host names); addresses of other hosts are skipped,
    /// and it fails when none is left. With port 0 every address gets the first one's port.
    pub fn bind_host(host: &str, port: u16) -> Result<Self> {
        let bare = host.trim().trim_start_matches('[').trim_end_matches(']');
        let shown = host_port(bare, port);
        let resolved: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
            Ok(ip) => vec![SocketAddr::new(ip, port)],
            Err(_) => (bare, port)
                .to_socket_addrs()
                .map_err(|e| RendezvousError::Listen {
                    addr: shown.clone(),
                    detail: format!("cannot resolve {bare:?}: {e}"),
                })?
                .collect(),
        };
        let mut listeners = Vec::new();
        let mut addrs: Vec<SocketAddr> = Vec::new();
        let mut skipped = Vec::new();
        for mut a in resolved {
            if let Some(first) = addrs.first() {
                a.set_port(first.port());
            }
            if addrs.contains(&a) {
                continue;
            }
            match bind_retrying(a) {
                Ok(l) => {
                    let got = l.local_addr().map_err(|e| listen_error(&shown, &e))?;
                    listeners.push(l);
                    addrs.push(got);
                }
                Err(e) if e.kind() == io::ErrorKind::AddrNotAvailable => {
                    skipped.push(format!("{a}: {e}"));
                }
                Err(e) => return Err(listen_error(&a.to_string(), &e)),
            }
        }
        if listeners.is_empty() {
            return Err(RendezvousError::Listen {
                addr: shown,
                detail: format!(
                    "no address of this host ({}); MASTER_ADDR must name rank 0's host, or set \\
                     LOWBIT_RDZV_BIND to the address to listen on",
                    if skipped.is_empty() {
                        "it resolves to none".to_string()
                    } else {
                        skipped.join("; ")
                    }
                ),
            });
        }
        Ok(RendezvousServer { listeners, addrs })
    }

    /// The (first) address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addrs[0]
    }

    /// Every address it listens on.
    pub fn local_addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }

    /// Whether it listens on loopback addresses only.
    pub fn loopback_only(&self) -> bool {
        self.addrs.iter().all(|a| a.ip().is_loopback())
    }

    /// [`RendezvousServer::serve_with`] under the public default key and default options: for
    /// loopback addresses only (anything else is refused: use `serve_with` and a secret).
    pub fn serve(self, world: usize, payload: &[u8], timeout: Duration) -> Result<()> {
        self.serve_with(
            world,
            payload,
            &RendezvousSecret::public(),
            timeout,
            ServeOptions::default(),
        )
    }

    /// Answers ranks `1..world` that prove `secret` with `payload`, each once, and returns when
    /// all have it, or fails when `timeout` passes first. Anything else that connects is dropped
    /// and logged (see the module's documentation).
    pub fn serve_with(
        self,
        world: usize,
        payload: &[u8],
        secret: &RendezvousSecret,
        timeout: Duration,
        options: ServeOptions,
    ) -> Result<()> {
        self.serve_links(world, payload, secret, timeout, options, false)
            .map(drop)
    }

    /// [`RendezvousServer::serve_with`] that, with `keep`, keeps each served rank's
    /// authenticated connection open for the liveness channel: the links of ranks `1..world`,
    /// in rank order (none without `keep`).
    pub(crate) fn serve_links(
        self,
        world: usize,
        payload: &[u8],
        secret: &RendezvousSecret,
        timeout: Duration,
        options: ServeOptions,
        keep: bool,
    ) -> Result<Vec<Link>> {
        if world == 0 {
            return Err(RendezvousError::BadRank { rank: 0, world });
        }
        if payload.len() > MAX_PAYLOAD {
            return Err(RendezvousError::Protocol {
                peer: "rank 0 (itself)".into(),
                detail: format!("payload of {} bytes exceeds {MAX_PAYLOAD}", payload.len()),
            });
        }
        if secret.is_public() && !self.loopback_only() {
            return Err(RendezvousError::Auth {
                peer: format!("listeners {:?}", self.addrs),
                detail: no_secret_hint(),
            });
        }
        let start = Instant::now();
        let deadline = start + timeout;
        let io_err = |e: io::Error| RendezvousError::Io {
            peer: "the listening socket".into(),
            detail: e.to_string(),
        };
        for l in &self.listeners {
            l.set_nonblocking(true).map_err(io_err)?;
        }
        let state = Shared {
            world,
            payload,
            secret,
            slots: Mutex::new(vec![Slot::Free; world]),
            open: Mutex::new(HashMap::new()),
            log: Log::default(),
            stop: AtomicBool::new(false),
            kept: keep.then(|| Mutex::new(Vec::new())),
        };
        state.lock_slots()[0] = Slot::Done;
        let mut next_id = 0u64;
        std::thread::scope(|s| {
            let result = loop {
                if state.lock_slots().iter().all(|x| *x == Slot::Done) {
                    break Ok(());
                }
                if Instant::now() >= deadline {
                    let missing = state
                        .lock_slots()
                        .iter()
                        .enumerate()
                        .filter(|(_, x)| **x != Slot::Done)
                        .map(|(r, _)| r)
                        .collect();
                    break Err(RendezvousError::Timeout {
                        waited: start.elapsed(),
                        missing,
                        dropped: state.log.summary(),
                    });
                }
                let mut accepted = false;
                for l in &self.listeners {
                    match l.accept() {
                        Ok((stream, peer)) => {
                            accepted = true;
                            next_id += 1;
                            state.admit(s, next_id, stream, peer, deadline, options);
                        }
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                        Err(e) => state.log.drop_peer("(accept)", &e.to_string()),
                    }
                }
                if !accepted {
                    std::thread::sleep(Duration::from_millis(2));
                }
            };
            // Unblock every handler still reading so the scope ends at once.
            state.stop.store(true, Ordering::SeqCst);
            for c in state
                .open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
            {
                let _ = c.shutdown(Shutdown::Both);
            }
            result
        })?;
        let mut links = state
            .kept
            .map(|k| k.into_inner().unwrap_or_else(|p| p.into_inner()))
            .unwrap_or_default();
        links.sort_by_key(|l| l.rank);
        Ok(links)
    }
}

/// Binds `a`, trying again for a moment while the port is in use (a rank connecting before rank
/// 0 listens may hold it for an instant; see `connect_once`).
fn bind_retrying(a: SocketAddr) -> io::Result<TcpListener> {
    let mut tries = 0;
    loop {
        match TcpListener::bind(a) {
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && a.port() != 0 && tries < 10 => {
                tries += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Free,
    Sending,
    Done,
}

#[derive(Default)]
struct Log {
    dropped: AtomicUsize,
    notes: Mutex<Vec<String>>,
}

impl Log {
    fn drop_peer(&self, peer: &str, why: &str) {
        let n = self.dropped.fetch_add(1, Ordering::Relaxed);
        if n < MAX_LOGGED {
            eprintln!("lowbit rendezvous: dropped connection from {peer}: {why}");
        } else if n == MAX_LOGGED {
            eprintln!("lowbit rendezvous: further dropped connections are not logged");
        }
    }

    /// A drop worth naming in the timeout error (an authenticated peer that was refused).
    fn note(&self, peer: &str, why: &str) {
        self.drop_peer(peer, why);
        let mut notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        if notes.len() < 8 {
            notes.push(format!("{peer}: {why}"));
        }
    }

    fn summary(&self) -> String {
        let n = self.dropped.load(Ordering::Relaxed);
        if n == 0 {
            return String::new();
        }
        let notes = self.notes.lock().unwrap_or_else(|p| p.into_inner());
        let mut s = format!("; {n} connection(s) dropped");
        if !notes.is_empty() {
            s.push_str(", including ");
            s.push_str(&notes.join("; "));
        }
        s
    }
}

struct Shared<'a> {
    world: usize,
    payload: &'a [u8],
    secret: &'a RendezvousSecret,
    slots: Mutex<Vec<Slot>>,
    open: Mutex<HashMap<u64, TcpStream>>,
    log: Log,
    stop: AtomicBool,
    /// The served ranks' connections, when they are kept for the liveness channel.
    kept: Option<Mutex<Vec<Link>>>,
}

/// Why one connection was dropped, and whether the peer had proved the secret.
struct Dropped {
    why: String,
    authenticated: bool,
}

impl<'a> Shared<'a> {
    fn lock_slots(&self) -> std::sync::MutexGuard<'_, Vec<Slot>> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn admit<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        id: u64,
        stream: TcpStream,
        peer: SocketAddr,
        deadline: Instant,
        options: ServeOptions,
    ) where
        'a: 's,
    {
        let peer = peer.to_string();
        {
            let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
            if open.len() >= options.max_connections.max(1) {
                drop(open);
                self.log.drop_peer(&peer, "too many connections at once");
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            match stream.try_clone() {
                Ok(c) => {
                    open.insert(id, c);
                }
                Err(e) => {
                    drop(open);
                    self.log.drop_peer(&peer, &e.to_string());
                    return;
                }
            }
        }
        let own_deadline = (Instant::now() + options.handshake_timeout).min(deadline);
        let spawned = std::thread::Builder::new()
            .name("lowbit-rdzv-conn".into())
            .spawn_scoped(s, move || {
                let mut stream = stream;
                let served = self.handle(&mut stream, &peer, own_deadline);
                // Out of `open` before the rank counts as done, so the final sweep that shuts
                // the open connections never closes a kept one.
                self.open
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&id);
                match served {
                    Ok((rank, key)) => {
                        if let Some(kept) = &self.kept {
                            let link = Link { rank, stream, key };
                            kept.lock().unwrap_or_else(|p| p.into_inner()).push(link);
                        } else {
                            let _ = stream.shutdown(Shutdown::Both);
                        }
                        self.lock_slots()[rank] = Slot::Done;
                    }
                    Err(d) => {
                        if !self.stop.load(Ordering::SeqCst) {
                            if d.authenticated {
                                self.log.note(&peer, &d.why);
                            } else {
                                self.log.drop_peer(&peer, &d.why);
                            }
                        }
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                }
            });
        if let Err(e) = spawned {
            self.log
                .drop_peer("(a connection)", &format!("no thread: {e}"));
            self.open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
    }

    /// One connection, from its hello to the payload. Returns the rank served (its slot still
    /// `Sending`: the caller marks it done) and the connection's liveness key.
    fn handle(
        &self,
        stream: &mut TcpStream,
        peer: &str,
        deadline: Instant,
    ) -> std::result::Result<(usize, [u8; 32]), Dropped> {
        let plain = |why: String| Dropped {
            why,
            authenticated: false,
        };
        let text = |e: RendezvousError| match e {
            RendezvousError::Protocol { detail, .. } | RendezvousError::Io { detail, .. } => detail,
            other => other.to_string(),
        };
        stream
            .set_nonblocking(false)
            .and_then(|()| set_deadline(stream, deadline))
            .map_err(|e| plain(e.to_string()))?;
        let mut hello = [0u8; HELLO_LEN];
        read_full(stream, &mut hello[..12], peer, "hello").map_err(|e| plain(text(e)))?;
        if hello[..8] != MAGIC {
            return Err(plain(format!(
                "not a lowbit rendezvous hello (first bytes {:02x?})",
                &hello[..8]
            )));
        }
        let version = word(&hello, 8);
        if version != VERSION {
            let reason = format!("protocol version {version}, rank 0 speaks version {VERSION}");
            let _ = write_frame(stream, STATUS_REJECTED, reason.as_bytes());
            return Err(plain(reason));
        }
        read_full(stream, &mut hello[12..], peer, "hello").map_err(|e| plain(text(e)))?;
        let (rank, their_world) = (word(&hello, 12) as usize, word(&hello, 16) as usize);
        let mut transcript = [0u8; TRANSCRIPT_LEN];
        transcript[..HELLO_LEN].copy_from_slice(&hello);
        transcript[HELLO_LEN..].copy_from_slice(&secret::nonce());
        let mut challenge = [0u8; NONCE_LEN + MAC_LEN];
        challenge[..NONCE_LEN].copy_from_slice(&transcript[HELLO_LEN..]);
        challenge[NONCE_LEN..].copy_from_slice(&self.secret.server_proof(&transcript));
        write_frame(stream, STATUS_CHALLENGE, &challenge)
            .map_err(|e| plain(format!("writing the challenge: {e}")))?;
        let mut proof = [0u8; MAC_LEN];
        read_full(stream, &mut proof, peer, "proof")
            .map_err(|e| plain(format!("{} (claimed rank {rank})", text(e))))?;
        if !mac::ct_eq(&proof, &self.secret.client_proof(&transcript)) {
            return Err(plain(format!(
                "wrong proof of the job secret (claimed rank {rank})"
            )));
        }
        let mut refuse = |reason: String| {
            let _ = write_frame(stream, STATUS_REJECTED, reason.as_bytes());
            Dropped {
                why: format!("rank {rank} refused: {reason}"),
                authenticated: true,
            }
        };
        if their_world != self.world {
            return Err(refuse(format!(
                "world size {their_world}, rank 0 has world size {}",
                self.world
            )));
        }
        if rank == 0 || rank >= self.world {
            return Err(refuse(format!(
                "rank {rank} is not a rank 1..{}",
                self.world
            )));
        }
        {
            let mut slots = self.lock_slots();
            if slots[rank] != Slot::Free {
                drop(slots);
                return Err(refuse(format!("rank {rank} checked in twice")));
            }
            slots[rank] = Slot::Sending;
        }
        let session = self.secret.session(&transcript);
        let sent = send_payload(stream, &session, self.payload);
        match sent {
            Ok(()) => Ok((rank, session.liveness_key())),
            Err(e) => {
                self.lock_slots()[rank] = Slot::Free;
                Err(Dropped {
                    why: format!("sending rank {rank} the payload: {e}"),
                    authenticated: true,
                })
            }
        }
    }
}

fn send_payload(
    stream: &mut TcpStream,
    session: &secret::Session,
    payload: &[u8],
) -> io::Result<()> {
    let header = frame_header(STATUS_OK, payload.len() + MAC_LEN);
    let mut msg = Vec::with_capacity(FRAME_HEADER_LEN + payload.len() + MAC_LEN);
    msg.extend_from_slice(&header);
    msg.extend_from_slice(payload);
    session.apply_keystream(&mut msg[FRAME_HEADER_LEN..]);
    let tag = session.tag(&header, &msg[FRAME_HEADER_LEN..]);
    msg.extend_from_slice(&tag);
    stream.write_all(&msg)?;
    stream.flush()
}
