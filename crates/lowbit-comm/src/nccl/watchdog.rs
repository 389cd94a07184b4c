//! What a communicator shares with its watchdog thread: the NCCL handles under one mutex, the
//! outstanding launches, the first failure, the world of ranks that abort together; and the
//! watchdog itself, which aborts on a late launch or an asynchronous NCCL error.

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent};
use cudarc::nccl::sys;

use crate::{CommError, Result};

/// Why a communicator stopped working.
#[derive(Clone, Debug)]
pub(super) enum Failure {
    Timeout {
        op: String,
        waited: Duration,
    },
    Aborted {
        by_rank: usize,
        reason: String,
    },
    Nccl {
        op: String,
        detail: String,
    },
    /// A peer process was lost (the liveness channel) or left without joining a launch.
    PeerLost {
        rank: usize,
        cause: String,
    },
}

/// How long a launch may stay pending after a peer finished and left before it counts as one
/// the peer never joined (a peer that joined it completes it in microseconds).
pub(super) const DEPART_GRACE: Duration = Duration::from_secs(2);

/// Ranks of one process that abort together, and (processes) the liveness channel that tells
/// them of lost peers.
#[derive(Debug, Default)]
pub(super) struct World {
    pub(super) abort: Mutex<Option<Failure>>,
    pub(super) aborted: AtomicBool,
    /// A peer that finished and left: (world rank, when).
    pub(super) departed: Mutex<Option<(usize, Instant)>>,
    /// The liveness channel of a world made by `NcclComm::from_env`; it lives as long as the
    /// world's last communicator.
    pub(super) live: Mutex<Option<crate::liveness::Liveness>>,
    /// The number of ranks, set by the first communicator.
    pub(super) size: std::sync::OnceLock<usize>,
    /// NCCL calls of whole-world communicators in progress on the host: how many, and since
    /// when (the first of them). The first launch of a kind blocks in them until its peers
    /// connect, out of the watchdog's reach.
    pub(super) enqueuing: Mutex<(usize, Option<Instant>)>,
}

/// An NCCL call of a whole-world communicator in progress (see [`World::enqueuing`]).
pub(super) struct Enqueue<'a>(&'a World);

impl Drop for Enqueue<'_> {
    fn drop(&mut self) {
        let mut e = self
            .0
            .enqueuing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        e.0 = e.0.saturating_sub(1);
        if e.0 == 0 {
            e.1 = None;
        }
    }
}

impl World {
    fn fail(&self, failure: Failure) {
        let mut a = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
        if a.is_none() {
            *a = Some(failure);
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    pub(super) fn abort(&self, by_rank: usize, reason: String) {
        self.fail(Failure::Aborted { by_rank, reason });
    }

    /// Peer `rank` is lost: every communicator of the world aborts.
    pub(super) fn lose(&self, rank: usize, cause: String) {
        self.fail(Failure::PeerLost { rank, cause });
    }

    /// Peer `rank` finished and left: launches it did not join fail after [`DEPART_GRACE`].
    pub(super) fn depart(&self, rank: usize) {
        let mut d = self.departed.lock().unwrap_or_else(PoisonError::into_inner);
        d.get_or_insert((rank, Instant::now()));
    }

    pub(super) fn reason(&self) -> Option<Failure> {
        if !self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        self.abort
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Marks an NCCL call of a whole-world communicator in progress until the guard drops.
    pub(super) fn enqueue(&self) -> Enqueue<'_> {
        let mut e = self
            .enqueuing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if e.0 == 0 {
            e.1 = Some(Instant::now());
        }
        e.0 += 1;
        Enqueue(self)
    }

    /// Whether an NCCL call that began before `at` is still in progress.
    pub(super) fn enqueuing_since_before(&self, at: Instant) -> bool {
        let e = self
            .enqueuing
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        e.1.is_some_and(|since| since <= at)
    }

    /// Why a world being set up (every rank must join) cannot complete, if it cannot.
    pub(super) fn setup_blocker(&self) -> Option<String> {
        if let Some(f) = self.reason() {
            return Some(match f {
                Failure::PeerLost { rank, cause } => format!("world rank {rank} was lost: {cause}"),
                Failure::Aborted { by_rank, reason } => {
                    format!("aborted by world rank {by_rank}: {reason}")
                }
                Failure::Timeout { op, .. } | Failure::Nccl { op, .. } => format!("{op} failed"),
            });
        }
        let d = *self.departed.lock().unwrap_or_else(PoisonError::into_inner);
        d.map(|(rank, _)| format!("world rank {rank} left before joining"))
    }

    /// The loss to report for a launch pending for `waited`, if a peer left long enough ago.
    fn departed_from(&self, op: &str, waited: Duration) -> Option<Failure> {
        let d = *self.departed.lock().unwrap_or_else(PoisonError::into_inner);
        let (rank, at) = d?;
        (waited >= DEPART_GRACE && at.elapsed() >= DEPART_GRACE).then(|| Failure::PeerLost {
            rank,
            cause: format!("it finished and left without joining {op}"),
        })
    }
}

/// A raw NCCL communicator handle.
pub(super) struct RawComm(pub(super) sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not run
// concurrently; every call goes through the mutex of `State` (or happens before the handle is
// shared).
unsafe impl Send for RawComm {}

/// One outstanding launch, as the watchdog sees it.
pub(super) struct Pending {
    pub(super) event: Arc<CudaEvent>,
    pub(super) started: Instant,
    pub(super) label: String,
}

pub(super) struct State {
    /// The communicator collectives run on (null once aborted).
    pub(super) comm: RawComm,
    /// The non-blocking communicator splits run on (the same handle as `comm` with
    /// [`NcclConfig::nonblocking`](super::NcclConfig::nonblocking); null once aborted).
    pub(super) ctl: RawComm,
    pub(super) failure: Option<Failure>,
    pub(super) pending: VecDeque<Pending>,
    pub(super) stop: bool,
}

impl State {
    /// Aborts (frees) both handles, once each.
    pub(super) fn free(&mut self) {
        let (comm, ctl) = (self.comm.0, self.ctl.0);
        let distinct_ctl = if ctl == comm {
            std::ptr::null_mut()
        } else {
            ctl
        };
        for h in [comm, distinct_ctl] {
            if !h.is_null() {
                // SAFETY: a live handle; no other call on it runs (every call goes through the
                // state mutex, which the caller holds); it is nulled below and never used again.
                unsafe { sys::ncclCommAbort(h) };
            }
        }
        self.comm = RawComm(std::ptr::null_mut());
        self.ctl = RawComm(std::ptr::null_mut());
    }
}

/// What a communicator and its watchdog share.
pub(super) struct Shared {
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
    pub(super) rank: usize,
    pub(super) world_rank: usize,
    pub(super) timeout: Duration,
    pub(super) world: Arc<World>,
    /// Whether the group holds every rank of the world (then a departed peer is a member, and
    /// a launch it left pending can never complete).
    pub(super) whole_world: bool,
    pub(super) ctx: Arc<CudaContext>,
}

pub(super) type Guard<'a> = MutexGuard<'a, State>;

impl Shared {
    pub(super) fn lock(&self) -> Guard<'_> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Aborts the NCCL communicator (if still alive) and records `failure` (the first wins).
    pub(super) fn abort_locked(&self, st: &mut State, failure: Failure) {
        if st.failure.is_none() {
            st.failure = Some(failure);
        }
        let _ = self.ctx.bind_to_thread();
        st.free();
        st.pending.clear();
        self.cv.notify_all();
    }

    pub(super) fn error(&self, failure: &Failure, op: &str) -> CommError {
        match failure {
            Failure::Timeout { op: what, waited } => CommError::Timeout {
                op: if what == op {
                    op.to_string()
                } else {
                    format!("{op} (after {what} timed out)")
                },
                rank: self.rank,
                waited: *waited,
                missing: Vec::new(),
            },
            Failure::Aborted { by_rank, reason } => CommError::Aborted {
                op: op.to_string(),
                rank: self.rank,
                by_rank: *by_rank,
                reason: reason.clone(),
            },
            Failure::PeerLost { rank, cause } => CommError::PeerLost {
                op: op.to_string(),
                rank: self.rank,
                lost: *rank,
                cause: cause.clone(),
            },
            Failure::Nccl { op: what, detail } => CommError::Nccl {
                op: op.to_string(),
                rank: self.rank,
                detail: if what == op {
                    detail.clone()
                } else {
                    format!("{what} failed earlier: {detail}")
                },
            },
        }
    }

    /// Aborts the world on behalf of this rank (for `reason`) and this communicator with
    /// `failure`; returns the error of `op`.
    pub(super) fn fail(
        &self,
        st: &mut State,
        op: &str,
        failure: Failure,
        reason: String,
    ) -> CommError {
        self.world.abort(self.world_rank, reason);
        let e = self.error(&failure, op);
        self.abort_locked(st, failure);
        e
    }

    /// [`Shared::fail`] for `op`, which has taken longer than the timeout since `start`.
    pub(super) fn fail_timeout(&self, st: &mut State, op: &str, start: Instant) -> CommError {
        let failure = Failure::Timeout {
            op: op.to_string(),
            waited: start.elapsed(),
        };
        let reason = format!("world rank {} timed out in {op}", self.world_rank);
        self.fail(st, op, failure, reason)
    }

    /// Fails if the communicator (or its world) was aborted.
    pub(super) fn check(&self, st: &mut State, op: &str) -> Result<()> {
        if st.failure.is_none()
            && let Some(failure) = self.world.reason()
        {
            self.abort_locked(st, failure);
        }
        match &st.failure {
            Some(f) => Err(self.error(f, op)),
            None => Ok(()),
        }
    }

    pub(super) fn nccl_error(
        &self,
        op: &str,
        what: &str,
        r: sys::ncclResult_t,
        st: &State,
    ) -> CommError {
        CommError::Nccl {
            op: op.to_string(),
            rank: self.rank,
            detail: describe(what, r, st.comm.0),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the last call settles (no longer `ncclInProgress`),
    /// releasing the mutex between polls. On an error or the deadline, aborts.
    pub(super) fn settle<'a>(
        &'a self,
        mut st: Guard<'a>,
        op: &str,
        start: Instant,
    ) -> (Guard<'a>, Result<()>) {
        let mut polls = 0u32;
        loop {
            if let Err(e) = self.check(&mut st, op) {
                return (st, Err(e));
            }
            let mut r = sys::ncclResult_t::ncclSuccess;
            // SAFETY: the handle is live (checked above: a failure-free state has a live
            // handle) and we hold the mutex; `r` is a valid out pointer.
            let call = unsafe { sys::ncclCommGetAsyncError(st.comm.0, &mut r) };
            let r = if call == sys::ncclResult_t::ncclSuccess {
                r
            } else {
                call
            };
            match r {
                sys::ncclResult_t::ncclSuccess => return (st, Ok(())),
                sys::ncclResult_t::ncclInProgress => {}
                other => {
                    let detail = describe("ncclCommGetAsyncError", other, st.comm.0);
                    let failure = Failure::Nccl {
                        op: op.to_string(),
                        detail,
                    };
                    let reason = format!("NCCL error on world rank {} in {op}", self.world_rank);
                    let e = self.fail(&mut st, op, failure, reason);
                    return (st, Err(e));
                }
            }
            if start.elapsed() >= self.timeout {
                let e = self.fail_timeout(&mut st, op, start);
                return (st, Err(e));
            }
            drop(st);
            backoff(&mut polls);
            st = self.lock();
        }
    }

    /// The watchdog: retires completed launches, aborts on a late launch, an asynchronous NCCL
    /// error or a world abort. Runs until the communicator is dropped.
    pub(super) fn watch(self: Arc<Self>) {
        let _ = self.ctx.bind_to_thread();
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            if st.failure.is_none() {
                if let Some(failure) = self.world.reason() {
                    self.abort_locked(&mut st, failure);
                    continue;
                }
                while let Some(p) = st.pending.front() {
                    match p.event.try_is_complete() {
                        Ok(true) => {
                            st.pending.pop_front();
                        }
                        Ok(false) => {
                            let waited = p.started.elapsed();
                            let departed = self
                                .whole_world
                                .then(|| self.world.departed_from(&p.label, waited))
                                .flatten();
                            if let Some(failure) = departed {
                                if let Failure::PeerLost { rank, cause } = &failure {
                                    self.world.lose(*rank, cause.clone());
                                }
                                self.abort_locked(&mut st, failure);
                            } else if waited >= self.timeout {
                                let op = p.label.clone();
                                self.world.abort(
                                    self.world_rank,
                                    format!(
                                        "world rank {} timed out after {waited:?} in {op}",
                                        self.world_rank
                                    ),
                                );
                                self.abort_locked(&mut st, Failure::Timeout { op, waited });
                            }
                            break;
                        }
                        Err(e) => {
                            let failure = Failure::Nccl {
                                op: p.label.clone(),
                                detail: format!("CUDA error on the communicator's stream: {e:?}"),
                            };
                            self.abort_locked(&mut st, failure);
                            break;
                        }
                    }
                }
                if st.failure.is_none() && !st.comm.0.is_null() {
                    let mut r = sys::ncclResult_t::ncclSuccess;
                    // SAFETY: live handle, mutex held, valid out pointer.
                    let call = unsafe { sys::ncclCommGetAsyncError(st.comm.0, &mut r) };
                    let bad = |x: sys::ncclResult_t| {
                        !matches!(
                            x,
                            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                        )
                    };
                    if bad(call) || bad(r) {
                        let r = if bad(call) { call } else { r };
                        let detail = describe("asynchronous error", r, st.comm.0);
                        let op = st
                            .pending
                            .front()
                            .map_or_else(|| "a launch".to_string(), |p| p.label.clone());
                        self.world.abort(
                            self.world_rank,
                            format!("NCCL error on world rank {}: {detail}", self.world_rank),
                        );
                        self.abort_locked(&mut st, Failure::Nccl { op, detail });
                    }
                }
            }
            let tick = if st.pending.is_empty() {
                Duration::from_millis(20)
            } else {
                Duration::from_millis(1)
            };
            st = self
                .cv
                .wait_timeout(st, tick)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// `what` failed with `r`, with NCCL's message and its last error text.
pub(super) fn describe(what: &str, r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
    // SAFETY: `ncclGetErrorString` returns a static NUL-terminated string for any result.
    let s = unsafe { CStr::from_ptr(sys::ncclGetErrorString(r)) };
    // SAFETY: `ncclGetLastError` accepts any handle (null included) and returns a
    // NUL-terminated string owned by NCCL, copied at once.
    let last = unsafe { CStr::from_ptr(sys::ncclGetLastError(comm)) };
    let last = last.to_string_lossy();
    if last.is_empty() {
        format!("{what}: {r:?} ({})", s.to_string_lossy())
    } else {
        format!("{what}: {r:?} ({}): {last}", s.to_string_lossy())
    }
}

/// Between polls: yield the first thousand times (a launch usually settles within
/// microseconds, and a sleep costs at least the timer slack, ~50 µs), then sleep 200 µs.
pub(super) fn backoff(polls: &mut u32) {
    *polls += 1;
    if *polls < 1000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}
