//! The liveness channel of a multi-process world: a dead rank is noticed in seconds, not at the
//! collective timeout.
//!
//! # Design
//! After the rendezvous
//! ([`RendezvousEnv::exchange_live`](crate::rendezvous::RendezvousEnv::exchange_live)) every
//! rank keeps its authenticated connection to rank 0 open (a star: rank 0 holds one link per
//! other rank). One thread per process ([`Liveness`]) polls its links every 50 ms and sends a
//! heartbeat on each every [`LivenessConfig::heartbeat`] (1 s). A link is *lost* when it closes
//! without a goodbye (the process died: SIGKILL, a crash; the kernel closes its sockets at once),
//! when nothing arrives on it for [`LivenessConfig::silence`] (5 s: a hung process, a dead host
//! or network), when a frame fails its check, or when the peer says it leaves on a signal. A
//! rank that drops its handle says it *left* (finished) instead: that alone is no failure, since
//! it may have joined every collective already. Rank 0 relays every event about one link to all
//! the others, so a loss anywhere reaches every rank within one poll; the other ranks notice the
//! loss of rank 0 on their own link. The owner hears of each peer once, through the `on_event`
//! callback (the NCCL communicator aborts itself there: see `nccl::NcclComm::from_env`).
//!
//! A rank that gets SIGINT, SIGTERM or SIGHUP says so on its way out when the process installed
//! [`install_signal_goodbye`] (an async-signal-safe handler that writes a pre-built frame to
//! each link's socket and then lets the signal do what it did before). Without it the killed
//! process's connections close anyway and the loss is reported as "closed without a goodbye".
//!
//! With [`LivenessConfig::exit_after_loss`] set, a process that is still alive that long after
//! a loss exits with status 1 and a message naming the lost rank: the backstop for a thread
//! blocked where an abort cannot reach it (NCCL's first launch of a kind blocks the host until
//! its peers connect), in the spirit of PyTorch's `TORCH_NCCL_ASYNC_ERROR_HANDLING`.
//!
//! # Frames and their authentication
//! Every frame is 56 bytes: `"LBLV"`, kind (u32: 1 heartbeat, 2 leaving, 3 report), subject rank
//! (u32), cause (u32; for a signal, the signal number in the upper 16 bits), sequence number
//! (u64, increasing per direction; a goodbye uses `u64::MAX`), then
//! `HMAC-SHA256(L, "lowbit-live-v1" ‖ direction ‖ those 24 bytes)`, with `L` derived from the
//! connection's rendezvous session key (so it differs per connection and per job). Trusting the
//! established TCP connection alone would stop an off-path host, but the MAC costs one hash per
//! second and also stops an on-path one from forging a "rank r lost" that aborts a healthy job
//! (it can still cut the connection, which is a loss either way); the sequence numbers stop
//! replays, the direction label reflections. A frame that fails any check loses the link.

use std::collections::HashSet;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::rendezvous::{Link, mac};

#[cfg(unix)]
#[allow(unsafe_code)]
mod signal;
#[cfg(unix)]
pub use signal::install_signal_goodbye;

/// Without Unix signals there is nothing to install.
#[cfg(not(unix))]
pub fn install_signal_goodbye() {}

/// Bytes of one frame.
pub const FRAME_LEN: usize = 56;
const MAGIC: [u8; 4] = *b"LBLV";
const HEARTBEAT: u32 = 1;
const LEAVING: u32 = 2;
const REPORT: u32 = 3;
/// Causes (low 16 bits of the cause word).
const FINISHED: u32 = 0;
const CLOSED: u32 = 1;
const SILENT: u32 = 2;
const SIGNAL: u32 = 3;
const GARBLED: u32 = 4;
const BROKEN: u32 = 5;
/// The sequence number of a goodbye: nothing can follow it.
const LAST_SEQ: u64 = u64::MAX;
const POLL: Duration = Duration::from_millis(50);

/// Timing of the liveness channel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LivenessConfig {
    /// How often each side sends a heartbeat (default 1 s).
    pub heartbeat: Duration,
    /// How long a link may stay silent before its peer counts as lost (default 5 s).
    pub silence: Duration,
    /// Exit the process (status 1, a message naming the lost rank) this long after a loss if it
    /// is still running (default none; the NCCL communicator sets 3 s).
    pub exit_after_loss: Option<Duration>,
}

impl Default for LivenessConfig {
    fn default() -> Self {
        LivenessConfig {
            heartbeat: Duration::from_secs(1),
            silence: Duration::from_secs(5),
            exit_after_loss: None,
        }
    }
}

impl LivenessConfig {
    /// This configuration with another exit backstop.
    pub fn with_exit_after_loss(mut self, after: Option<Duration>) -> Self {
        self.exit_after_loss = after;
        self
    }
}

/// What happened to a peer (each peer is reported at most once).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PeerEvent {
    /// The rank finished: it dropped its liveness handle (after its last collective, or on an
    /// error of its own) and said goodbye.
    Left {
        /// The world rank.
        rank: usize,
    },
    /// The rank is lost.
    Lost {
        /// The world rank.
        rank: usize,
        /// How (closed without a goodbye, silent, left on a signal, …).
        cause: String,
    },
}

impl PeerEvent {
    /// The world rank the event is about.
    pub fn rank(&self) -> usize {
        match self {
            PeerEvent::Left { rank } | PeerEvent::Lost { rank, .. } => *rank,
        }
    }
}

/// The callback that hears of peers leaving or lost (on the liveness thread).
pub type OnEvent = Box<dyn Fn(&PeerEvent) + Send + Sync>;

/// This process's end of the liveness channel; dropping it says goodbye ("left") to the peers.
pub struct Liveness {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl fmt::Debug for Liveness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Liveness")
            .field("rank", &self.shared.me)
            .field("lost", &self.lost())
            .finish_non_exhaustive()
    }
}

struct Shared {
    me: usize,
    world: usize,
    config: LivenessConfig,
    first_within: Duration,
    peers: Mutex<Vec<Peer>>,
    stop: AtomicBool,
    reported: Mutex<(HashSet<usize>, Option<PeerEvent>)>,
    on_event: OnEvent,
}

/// One link, as the liveness thread sees it.
struct Peer {
    rank: usize,
    stream: TcpStream,
    key: [u8; 32],
    /// Bytes of a frame not complete yet.
    partial: Vec<u8>,
    sent_seq: u64,
    heard_seq: u64,
    heard: Instant,
    open: bool,
    #[cfg(unix)]
    slot: Option<usize>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        // Before the socket closes, so the signal handler never writes to a reused descriptor.
        #[cfg(unix)]
        if let Some(s) = self.slot.take() {
            signal::unregister(s);
        }
    }
}

/// An event found by the poll, with its wire cause for the relay.
struct Found {
    rank: usize,
    cause: u32,
    detail: String,
    /// Heard from rank 0 rather than seen on an own link.
    relayed: bool,
}

fn direction(sender: usize) -> &'static [u8] {
    if sender == 0 { b"down" } else { b"up" }
}

fn encode(
    key: &[u8; 32],
    sender: usize,
    kind: u32,
    subject: usize,
    cause: u32,
    seq: u64,
) -> [u8; FRAME_LEN] {
    let mut f = [0u8; FRAME_LEN];
    f[..4].copy_from_slice(&MAGIC);
    f[4..8].copy_from_slice(&kind.to_le_bytes());
    f[8..12].copy_from_slice(&u32::try_from(subject).unwrap_or(u32::MAX).to_le_bytes());
    f[12..16].copy_from_slice(&cause.to_le_bytes());
    f[16..24].copy_from_slice(&seq.to_le_bytes());
    let tag = mac::hmac(key, &[b"lowbit-live-v1", direction(sender), &f[..24]]);
    f[24..].copy_from_slice(&tag);
    f
}

/// `(kind, subject, cause, seq)` of an authentic frame sent by `sender`.
fn decode(key: &[u8; 32], sender: usize, f: &[u8]) -> Option<(u32, usize, u32, u64)> {
    if f.len() != FRAME_LEN || f[..4] != MAGIC {
        return None;
    }
    let tag = mac::hmac(key, &[b"lowbit-live-v1", direction(sender), &f[..24]]);
    if !mac::ct_eq(&f[24..], &tag) {
        return None;
    }
    let word = |i: usize| u32::from_le_bytes([f[i], f[i + 1], f[i + 2], f[i + 3]]);
    let seq = u64::from_le_bytes(f[16..24].try_into().ok()?);
    Some((word(4), word(8) as usize, word(12), seq))
}

/// The words of a cause.
fn describe(cause: u32, detail: &str) -> String {
    let sig = cause >> 16;
    match cause & 0xffff {
        FINISHED => "it finished and left".into(),
        CLOSED => "its connection closed without a goodbye (the process died or was killed)".into(),
        SILENT if detail.is_empty() => {
            "nothing heard from it for too long (hung, or its host is unreachable)".into()
        }
        SILENT => format!("nothing heard from it for {detail} (hung, or its host is unreachable)"),
        SIGNAL => format!("it left on signal {sig} ({})", signal_name(sig)),
        GARBLED => format!("its liveness channel broke the protocol: {detail}"),
        BROKEN => format!("sending to it failed: {detail}"),
        other => format!("unknown cause {other}"),
    }
}

fn signal_name(sig: u32) -> &'static str {
    match sig {
        1 => "SIGHUP",
        2 => "SIGINT",
        15 => "SIGTERM",
        _ => "a signal",
    }
}

impl Liveness {
    /// Starts the channel over the rendezvous `links` of rank `me` of `world` (rank 0: one per
    /// other rank; the others: one to rank 0). A peer's first frame may take `first_within`
    /// (the rendezvous timeout): rank 0 starts its side only once every rank has arrived.
    pub(crate) fn start(
        me: usize,
        world: usize,
        links: Vec<Link>,
        config: LivenessConfig,
        first_within: Duration,
        on_event: OnEvent,
    ) -> io::Result<Liveness> {
        let now = Instant::now();
        let mut peers = Vec::with_capacity(links.len());
        for l in links {
            l.stream.set_nonblocking(true)?;
            let _ = l.stream.set_nodelay(true);
            #[cfg(unix)]
            let slot = {
                use std::os::fd::AsRawFd;
                let frames = signal::SIGNALS.map(|s| {
                    encode(
                        &l.key,
                        me,
                        LEAVING,
                        me,
                        SIGNAL | ((s as u32) << 16),
                        LAST_SEQ,
                    )
                });
                signal::register(l.stream.as_raw_fd(), frames)
            };
            peers.push(Peer {
                rank: l.rank,
                stream: l.stream,
                key: l.key,
                partial: Vec::with_capacity(FRAME_LEN),
                sent_seq: 0,
                heard_seq: 0,
                heard: now,
                open: true,
                #[cfg(unix)]
                slot,
            });
        }
        let shared = Arc::new(Shared {
            me,
            world,
            config,
            first_within,
            peers: Mutex::new(peers),
            stop: AtomicBool::new(false),
            reported: Mutex::new((HashSet::new(), None)),
            on_event,
        });
        let s = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("lowbit-liveness-{me}"))
            .spawn(move || s.run())?;
        Ok(Liveness {
            shared,
            thread: Some(thread),
        })
    }

    /// This process's world rank.
    pub fn rank(&self) -> usize {
        self.shared.me
    }

    /// The first peer lost, if any.
    pub fn lost(&self) -> Option<PeerEvent> {
        self.shared.lock_reported().1.clone()
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // The owner may be dropped by the event callback on the liveness thread itself (the last
        // handle of the NCCL world); it stops at its next round then.
        if let Some(t) = self.thread.take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
        let me = self.shared.me;
        for p in self.shared.lock_peers().iter_mut().filter(|p| p.open) {
            let bye = encode(&p.key, me, LEAVING, me, FINISHED, LAST_SEQ);
            let _ = p.stream.write(&bye);
            let _ = p.stream.shutdown(Shutdown::Both);
        }
    }
}

impl Shared {
    fn lock_peers(&self) -> std::sync::MutexGuard<'_, Vec<Peer>> {
        self.peers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_reported(&self) -> std::sync::MutexGuard<'_, (HashSet<usize>, Option<PeerEvent>)> {
        self.reported.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The liveness thread: polls, beats, relays and reports.
    fn run(&self) {
        let mut next_beat = Instant::now();
        while !self.stop.load(Ordering::SeqCst) {
            let found = self.poll(&mut next_beat);
            for f in found {
                let event = if f.cause == FINISHED {
                    PeerEvent::Left { rank: f.rank }
                } else {
                    PeerEvent::Lost {
                        rank: f.rank,
                        cause: describe(f.cause, &f.detail)
                            + if f.relayed {
                                " (reported by rank 0)"
                            } else {
                                ""
                            },
                    }
                };
                self.report(event);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Hands `event` to the owner, once per rank.
    fn report(&self, event: PeerEvent) {
        {
            let mut r = self.lock_reported();
            if !r.0.insert(event.rank()) {
                return;
            }
            if let PeerEvent::Lost { rank, cause } = &event {
                eprintln!(
                    "lowbit liveness: rank {}: world rank {rank} was lost: {cause}",
                    self.me
                );
                if r.1.is_none() {
                    r.1 = Some(event.clone());
                    if let Some(after) = self.config.exit_after_loss {
                        exit_later(self.me, &event, after);
                    }
                }
            }
        }
        (self.on_event)(&event);
    }

    /// One round over the links: reads, checks silences, beats when due, and (rank 0) relays
    /// what it found to the other links.
    fn poll(&self, next_beat: &mut Instant) -> Vec<Found> {
        let mut found = Vec::new();
        let mut peers = self.lock_peers();
        for p in peers.iter_mut().filter(|p| p.open) {
            self.read_peer(p, &mut found);
            let silence = if p.heard_seq == 0 {
                self.first_within.max(self.config.silence)
            } else {
                self.config.silence
            };
            if p.open && p.heard.elapsed() > silence {
                found.push(Found {
                    rank: p.rank,
                    cause: SILENT,
                    detail: format!("{:.1?}", p.heard.elapsed()),
                    relayed: false,
                });
                close(p);
            }
        }
        if Instant::now() >= *next_beat {
            *next_beat = Instant::now() + self.config.heartbeat;
            for p in peers.iter_mut().filter(|p| p.open) {
                if let Err(detail) = send(p, self.me, HEARTBEAT, self.me, 0) {
                    found.push(Found {
                        rank: p.rank,
                        cause: BROKEN,
                        detail,
                        relayed: false,
                    });
                    close(p);
                }
            }
        }
        if self.me == 0 {
            // Relayed losses of a link name the link's rank; a relay that fails is that link's
            // own loss, found in a later round.
            for f in found.iter().filter(|f| !f.relayed) {
                for p in peers.iter_mut().filter(|p| p.open && p.rank != f.rank) {
                    let _ = send(p, self.me, REPORT, f.rank, f.cause);
                }
            }
        }
        found
    }

    /// Reads what `p` sent; every complete frame is checked and handled.
    fn read_peer(&self, p: &mut Peer, found: &mut Vec<Found>) {
        let mut buf = [0u8; 4 * FRAME_LEN];
        loop {
            let n = match p.stream.read(&mut buf) {
                Ok(0) => {
                    found.push(Found {
                        rank: p.rank,
                        cause: CLOSED,
                        detail: String::new(),
                        relayed: false,
                    });
                    close(p);
                    return;
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    found.push(Found {
                        rank: p.rank,
                        cause: CLOSED,
                        detail: e.to_string(),
                        relayed: false,
                    });
                    close(p);
                    return;
                }
            };
            p.partial.extend_from_slice(&buf[..n]);
            while p.partial.len() >= FRAME_LEN {
                let frame: Vec<u8> = p.partial.drain(..FRAME_LEN).collect();
                if let Some(f) = self.frame(p, &frame) {
                    found.push(f);
                    if !p.open {
                        return;
                    }
                }
            }
        }
    }

    /// Handles one frame from `p`: what it reports, if anything.
    fn frame(&self, p: &mut Peer, frame: &[u8]) -> Option<Found> {
        let garbled = |p: &mut Peer, detail: String| {
            close(p);
            Some(Found {
                rank: p.rank,
                cause: GARBLED,
                detail,
                relayed: false,
            })
        };
        let Some((kind, subject, cause, seq)) = decode(&p.key, p.rank, frame) else {
            return garbled(p, "a frame failed its authentication check".into());
        };
        if seq <= p.heard_seq {
            return garbled(p, format!("sequence number {seq} repeated or out of order"));
        }
        p.heard_seq = seq;
        p.heard = Instant::now();
        match kind {
            HEARTBEAT => None,
            LEAVING if subject == p.rank && matches!(cause & 0xffff, FINISHED | SIGNAL) => {
                close(p);
                Some(Found {
                    rank: p.rank,
                    cause,
                    detail: String::new(),
                    relayed: false,
                })
            }
            REPORT if p.rank == 0 && subject < self.world && subject != self.me => Some(Found {
                rank: subject,
                cause,
                detail: String::new(),
                relayed: true,
            }),
            _ => garbled(
                p,
                format!("unexpected frame kind {kind} about rank {subject}"),
            ),
        }
    }
}

/// The exit backstop: a detached thread, so that it outlives the handle (a process blocked in
/// its teardown is still ended).
fn exit_later(me: usize, lost: &PeerEvent, after: Duration) {
    let lost = lost.clone();
    let _ = std::thread::Builder::new()
        .name("lowbit-liveness-exit".into())
        .spawn(move || {
            std::thread::sleep(after);
            if let PeerEvent::Lost { rank, cause } = lost {
                eprintln!(
                    "lowbit liveness: rank {me}: world rank {rank} was lost ({cause}) and this \
                     process did not finish within {after:?}: exiting"
                );
            }
            exit_process(1);
        });
}

/// Ends the process at once (`_exit` on Unix: exit handlers, the CUDA driver's among them, can
/// block on a GPU whose peer is gone, which is what the backstops are for).
pub(crate) fn exit_process(status: i32) -> ! {
    #[cfg(unix)]
    signal::exit_now(status);
    #[cfg(not(unix))]
    std::process::exit(status);
}

/// Sends one frame (the next sequence number) to `p`.
fn send(p: &mut Peer, me: usize, kind: u32, subject: usize, cause: u32) -> Result<(), String> {
    p.sent_seq += 1;
    let f = encode(&p.key, me, kind, subject, cause, p.sent_seq);
    match p.stream.write(&f) {
        Ok(FRAME_LEN) => Ok(()),
        // A full send buffer means the peer stopped reading long ago.
        Ok(_) => Err("its receive buffer is full (it stopped reading)".into()),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
            Err("its receive buffer is full (it stopped reading)".into())
        }
        Err(e) => Err(e.to_string()),
    }
}

fn close(p: &mut Peer) {
    p.open = false;
    #[cfg(unix)]
    if let Some(s) = p.slot.take() {
        signal::unregister(s);
    }
    let _ = p.stream.shutdown(Shutdown::Both);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_any_flipped_bit_fails() {
        let key = [7u8; 32];
        let f = encode(&key, 3, LEAVING, 3, SIGNAL | (15 << 16), 9);
        assert_eq!(
            decode(&key, 3, &f),
            Some((LEAVING, 3, SIGNAL | (15 << 16), 9))
        );
        // Reflected to its sender's side (other direction), or under another key: refused.
        assert_eq!(decode(&key, 0, &f), None);
        assert_eq!(decode(&[8u8; 32], 3, &f), None);
        for i in 0..FRAME_LEN * 8 {
            let mut g = f;
            g[i / 8] ^= 1 << (i % 8);
            assert_eq!(decode(&key, 3, &g), None, "bit {i}");
        }
        assert_eq!(decode(&key, 3, &f[..FRAME_LEN - 1]), None);
    }

    #[test]
    fn causes_read_as_words() {
        assert!(describe(SIGNAL | (15 << 16), "").contains("SIGTERM"));
        assert!(describe(CLOSED, "").contains("without a goodbye"));
        assert!(describe(SILENT, "5.0s").contains("5.0s"));
    }
}
