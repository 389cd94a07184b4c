//! NCCL behind the [`Communicator`] trait: one rank per GPU, collectives on the communicator's
//! own CUDA stream, ordered against the device's compute stream by events.
//!
//! # Streams and events
//! A launch records an event on the device's stream and makes the communicator's stream wait on
//! it (so the collective sees every op enqueued before `start_*`), enqueues the NCCL calls on the
//! communicator's stream inside one `ncclGroupStart`/`ncclGroupEnd`, and records a completion
//! event there. [`Work::wait`](crate::Work::wait) makes the device's stream wait on that event and
//! returns without blocking the host, so compute enqueued between `start` and `wait` overlaps the
//! transfer for real. Host-visible results (downloads) synchronise as usual.
//!
//! # Never a hang, and fast launches
//! Every communicator is a pair. The *control* communicator is created non-blocking
//! (`ncclConfig_t::blocking = 0`): initialisation and `ncclCommSplit` return `ncclInProgress`
//! and the calling thread polls `ncclCommGetAsyncError` until they settle or the timeout passes,
//! so a rank that never arrives is an error, not a hang. Collectives run on a *blocking* copy
//! split from it (the split itself is polled like the initialisation), because NCCL enqueues a
//! non-blocking communicator's every `ncclGroupEnd` on a thread of its own, which cost about
//! 50 µs per launch on 2xH200 (1 MiB all-gathers at a quarter of torch.distributed's bandwidth).
//! [`NcclConfig::nonblocking`] runs collectives on the control communicator instead.
//!
//! A watchdog thread per communicator polls the completion events of outstanding launches and
//! `ncclCommGetAsyncError`; a launch not complete within the timeout, or an asynchronous NCCL
//! error, makes it call `ncclCommAbort`, which stops the NCCL kernels (so a device
//! synchronisation waiting on them returns) and marks the communicator failed: every later call
//! returns the error ([`CommError::Timeout`], [`CommError::Nccl`] or [`CommError::Aborted`]).
//! Ranks of one process share a world: the abort of one (timeout, [`Communicator::abort`], a
//! panicking rank thread) aborts the others' communicators too. Ranks in other processes notice
//! by their own timeout. One hang remains possible with the blocking copy: the first launch of
//! a kind of collective on a communicator connects its peers inside `ncclGroupEnd`, which blocks
//! the host until they arrive, so a peer that dies before its first collective of that kind
//! hangs it (as in PyTorch's default blocking mode). The non-blocking mode has no such case.
//!
//! # What is checked
//! Every launch passes the same argument checks as the in-process group (`op::check_launch`:
//! sizes, dtypes, in-place forms, overlaps within the launch) and every view is resolved through
//! [`Device::cuda_device_ptr`] (live, in bounds, of this device) before NCCL sees a pointer.
//! Agreement *between* ranks is not checked (that would cost a synchronising exchange per
//! launch): ranks that disagree time out (or NCCL reports an error).
//!
//! # Arithmetic
//! f32, bf16 (`ncclBfloat16`) and f16 move and reduce natively; u8 payloads (fp8/fp4 bytes,
//! scales) move as `ncclUint8` (gather and broadcast only). [`ReduceOp::Avg`] is NCCL's
//! `ncclAvg`, which for floats multiplies every input by `1/size` in the payload dtype before
//! the sum (a pre-multiplied sum). With two ranks (any power-of-two group) that scaling is exact
//! and the result equals the in-process group's `sum / size` bit for bit except where values are
//! subnormal; with two ranks the sum itself is one addition, identical to the in-process
//! rank-order sum. Larger groups add in NCCL's ring/tree order and round at every hop, so they
//! differ from the in-process group in the last bits, and an all-reduce and a reduce-scatter of
//! the same values need not agree either (measured on 4 H200s: classic DDP against the
//! distributed optimizer in bf16 trains within 1e-4, not bitwise; every pair that reduce-scatters
//! on both sides stays bitwise). [`ReduceOp::Max`] is NCCL's max, which does not propagate NaN
//! as the in-process group does.

use std::collections::VecDeque;
use std::ffi::{CStr, c_int};
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result as dresult};
use cudarc::nccl::sys;
use lowbit_device::{DType, Device};

use crate::rendezvous::RendezvousEnv;
use crate::{CommError, CommStats, Communicator, Op, RankError, ReduceOp, Result, Work, WorkInner};

/// The unique id that names one NCCL world (opaque bytes, sent to every rank).
pub const UNIQUE_ID_BYTES: usize = 128;

/// Settings of an NCCL communicator (inherited by communicators split from it).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct NcclConfig {
    /// How long initialisation, a split, a barrier or one launch may take before the
    /// communicator is aborted and the call (or the next one) fails. Default 300 s: the first
    /// collective of a world sets up its connections.
    pub timeout: Duration,
    /// Run collectives on the non-blocking communicator too (see the module docs): every launch
    /// is then polled to completion of its enqueueing, which NCCL does on a thread of its own,
    /// about 50 µs more per launch; in exchange no NCCL call can block the host on a missing
    /// peer. Default false.
    pub nonblocking: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            timeout: Duration::from_secs(300),
            nonblocking: false,
        }
    }
}

impl NcclConfig {
    /// This configuration with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This configuration with collectives on the non-blocking communicator (or not).
    pub fn with_nonblocking(mut self, nonblocking: bool) -> Self {
        self.nonblocking = nonblocking;
        self
    }
}

/// Why a communicator stopped working.
#[derive(Clone, Debug)]
enum Failure {
    Timeout { op: String, waited: Duration },
    Aborted { by_rank: usize, reason: String },
    Nccl { op: String, detail: String },
}

/// Ranks of one process that abort together.
#[derive(Debug, Default)]
struct World {
    abort: Mutex<Option<(usize, String)>>,
    aborted: AtomicBool,
}

impl World {
    fn abort(&self, by_rank: usize, reason: String) {
        let mut a = self.abort.lock().unwrap_or_else(PoisonError::into_inner);
        if a.is_none() {
            *a = Some((by_rank, reason));
        }
        self.aborted.store(true, Ordering::SeqCst);
    }

    fn reason(&self) -> Option<(usize, String)> {
        if !self.aborted.load(Ordering::SeqCst) {
            return None;
        }
        self.abort
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A raw NCCL communicator handle.
struct RawComm(sys::ncclComm_t);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not run
// concurrently; every call goes through the mutex of `State` (or happens before the handle is
// shared).
unsafe impl Send for RawComm {}

/// One outstanding launch, as the watchdog sees it.
struct Pending {
    event: Arc<CudaEvent>,
    started: Instant,
    label: String,
}

struct State {
    /// The communicator collectives run on (null once aborted).
    comm: RawComm,
    /// The non-blocking communicator splits run on (the same handle as `comm` with
    /// [`NcclConfig::nonblocking`]; null once aborted).
    ctl: RawComm,
    failure: Option<Failure>,
    pending: VecDeque<Pending>,
    stop: bool,
}

impl State {
    /// Aborts (frees) both handles, once each.
    fn free(&mut self) {
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
struct Shared {
    state: Mutex<State>,
    cv: Condvar,
    rank: usize,
    world_rank: usize,
    timeout: Duration,
    world: Arc<World>,
    ctx: Arc<CudaContext>,
}

type Guard<'a> = MutexGuard<'a, State>;

impl Shared {
    fn lock(&self) -> Guard<'_> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Aborts the NCCL communicator (if still alive) and records `failure` (the first wins).
    fn abort_locked(&self, st: &mut State, failure: Failure) {
        if st.failure.is_none() {
            st.failure = Some(failure);
        }
        let _ = self.ctx.bind_to_thread();
        st.free();
        st.pending.clear();
        self.cv.notify_all();
    }

    fn error(&self, failure: &Failure, op: &str) -> CommError {
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

    /// Fails if the communicator (or its world) was aborted.
    fn check(&self, st: &mut State, op: &str) -> Result<()> {
        if st.failure.is_none()
            && let Some((by_rank, reason)) = self.world.reason()
        {
            self.abort_locked(st, Failure::Aborted { by_rank, reason });
        }
        match &st.failure {
            Some(f) => Err(self.error(f, op)),
            None => Ok(()),
        }
    }

    fn nccl_error(&self, op: &str, what: &str, r: sys::ncclResult_t, st: &State) -> CommError {
        CommError::Nccl {
            op: op.to_string(),
            rank: self.rank,
            detail: describe(what, r, st.comm.0),
        }
    }

    /// Polls `ncclCommGetAsyncError` until the last call settles (no longer `ncclInProgress`),
    /// releasing the mutex between polls. On an error or the deadline, aborts.
    fn settle<'a>(
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
                    self.world.abort(
                        self.world_rank,
                        format!("NCCL error on world rank {} in {op}", self.world_rank),
                    );
                    let e = self.error(&failure, op);
                    self.abort_locked(&mut st, failure);
                    return (st, Err(e));
                }
            }
            if start.elapsed() >= self.timeout {
                let failure = Failure::Timeout {
                    op: op.to_string(),
                    waited: start.elapsed(),
                };
                self.world.abort(
                    self.world_rank,
                    format!("world rank {} timed out in {op}", self.world_rank),
                );
                let e = self.error(&failure, op);
                self.abort_locked(&mut st, failure);
                return (st, Err(e));
            }
            drop(st);
            backoff(&mut polls);
            st = self.lock();
        }
    }

    /// The watchdog: retires completed launches, aborts on a late launch, an asynchronous NCCL
    /// error or a world abort. Runs until the communicator is dropped.
    fn watch(self: Arc<Self>) {
        let _ = self.ctx.bind_to_thread();
        let mut st = self.lock();
        loop {
            if st.stop {
                return;
            }
            if st.failure.is_none() {
                if let Some((by_rank, reason)) = self.world.reason() {
                    self.abort_locked(&mut st, Failure::Aborted { by_rank, reason });
                    continue;
                }
                while let Some(p) = st.pending.front() {
                    match p.event.try_is_complete() {
                        Ok(true) => {
                            st.pending.pop_front();
                        }
                        Ok(false) => {
                            let waited = p.started.elapsed();
                            if waited >= self.timeout {
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
fn describe(what: &str, r: sys::ncclResult_t, comm: sys::ncclComm_t) -> String {
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
fn backoff(polls: &mut u32) {
    *polls += 1;
    if *polls < 1000 {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Polls a communicator being created (or split) until it settles; aborts it on an error or
/// when `timeout` has passed since `start`.
fn settle_raw(raw: sys::ncclComm_t, timeout: Duration, start: Instant) -> Result<(), String> {
    wait_ready(raw, timeout, start).inspect_err(|_| {
        // SAFETY: a live handle owned by the caller, who does not use it after an error.
        unsafe { sys::ncclCommAbort(raw) };
    })
}

/// The communicator collectives run on, made from the settled non-blocking `ctl` of rank `rank`:
/// `ctl` itself with [`NcclConfig::nonblocking`], else a blocking copy split from it (the split
/// runs non-blocking, as its parent is, so it is polled with the timeout; the copy's launches
/// are enqueued synchronously). On an error nothing new is left allocated; `ctl` stays the
/// caller's.
fn collective_comm(
    ctl: sys::ncclComm_t,
    rank: usize,
    config: &NcclConfig,
    start: Instant,
) -> Result<sys::ncclComm_t, String> {
    if config.nonblocking {
        return Ok(ctl);
    }
    let mut child: sys::ncclComm_t = std::ptr::null_mut();
    let mut cfg = comm_config(true);
    // SAFETY: `ctl` is live and settled; valid out pointer and config. Same colour for every
    // rank, key = rank: the same group in the same order.
    let r = unsafe { sys::ncclCommSplit(ctl, 0, rank as c_int, &mut child, &mut cfg) };
    if !matches!(
        r,
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
    ) {
        return Err(describe("ncclCommSplit (blocking copy)", r, ctl));
    }
    wait_ready(ctl, config.timeout, start)?;
    if child.is_null() {
        return Err("ncclCommSplit returned no communicator".into());
    }
    if let Err(e) = wait_ready(child, config.timeout, start) {
        // SAFETY: the child is live and owned here; not used again.
        unsafe { sys::ncclCommAbort(child) };
        return Err(e);
    }
    Ok(child)
}

/// Polls `raw` until no call on it is in progress, up to `timeout` after `start` (no abort).
fn wait_ready(raw: sys::ncclComm_t, timeout: Duration, start: Instant) -> Result<(), String> {
    let mut polls = 0u32;
    loop {
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: `raw` is a live handle owned by the caller; valid out pointer.
        let call = unsafe { sys::ncclCommGetAsyncError(raw, &mut r) };
        let r = if call == sys::ncclResult_t::ncclSuccess {
            r
        } else {
            call
        };
        match r {
            sys::ncclResult_t::ncclSuccess => return Ok(()),
            sys::ncclResult_t::ncclInProgress if start.elapsed() < timeout => {}
            sys::ncclResult_t::ncclInProgress => {
                return Err(format!(
                    "timed out after {:?} (a peer did not join)",
                    start.elapsed()
                ));
            }
            other => return Err(describe("ncclCommGetAsyncError", other, raw)),
        }
        backoff(&mut polls);
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::U8 => sys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(r: ReduceOp) -> sys::ncclRedOp_t {
    match r {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
fn comm_config(blocking: bool) -> sys::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: c_int::from(blocking),
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

fn setup_error(rank: usize, detail: impl Into<String>) -> CommError {
    CommError::Nccl {
        op: "init".into(),
        rank,
        detail: detail.into(),
    }
}

/// Fails unless the NCCL library can be loaded and is 2.28 or newer (the configuration layout
/// this crate is built against).
pub fn nccl_version() -> Result<(u32, u32, u32)> {
    // SAFETY: probing `dlopen`s libnccl, which runs its initialisers, as every NCCL program does;
    // without the probe cudarc panics on the first call when the library is missing.
    if !unsafe { sys::is_culib_present() } {
        return Err(setup_error(
            0,
            "the NCCL library was not found: it is loaded as libnccl.so (cudarc's name, no \
             version suffix); install NCCL 2.28 or newer with its libnccl.so link, or put a \
             libnccl.so link to libnccl.so.2 on LD_LIBRARY_PATH (the GPU bundle's run.sh does)",
        ));
    }
    let mut v: c_int = 0;
    // SAFETY: valid out pointer.
    let r = unsafe { sys::ncclGetVersion(&mut v) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(setup_error(
            0,
            describe("ncclGetVersion", r, std::ptr::null_mut()),
        ));
    }
    let v = u32::try_from(v).unwrap_or(0);
    let version = (v / 10000, (v / 100) % 100, v % 100);
    if v < 22800 {
        return Err(setup_error(
            0,
            format!(
                "NCCL {}.{}.{} is older than 2.28, the API this crate is built against",
                version.0, version.1, version.2
            ),
        ));
    }
    Ok(version)
}

/// A fresh NCCL unique id (rank 0 makes it; every rank of the world initialises with it).
pub fn unique_id() -> Result<[u8; UNIQUE_ID_BYTES]> {
    nccl_version()?;
    let mut id = sys::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    // SAFETY: valid out pointer to a `ncclUniqueId`.
    let r = unsafe { sys::ncclGetUniqueId(&mut id) };
    if r != sys::ncclResult_t::ncclSuccess {
        return Err(setup_error(
            0,
            describe("ncclGetUniqueId", r, std::ptr::null_mut()),
        ));
    }
    Ok(id.internal.map(|c| c as u8))
}

/// One rank's NCCL communicator, bound to one GPU (the device it was created with).
pub struct NcclComm {
    shared: Arc<Shared>,
    rank: usize,
    size: usize,
    ordinal: usize,
    config: NcclConfig,
    stream: Arc<CudaStream>,
    /// Recorded on the device's stream at each launch; the communicator's stream waits on it.
    ready: CudaEvent,
    /// One f32 on the GPU for barriers.
    scratch: u64,
    next_seq: u64,
    stats: CommStats,
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("world_rank", &self.shared.world_rank)
            .field("gpu", &self.ordinal)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

fn cuda_stream(dev: &Device, rank: usize, op: &str) -> Result<Arc<CudaStream>> {
    dev.cuda_stream().cloned().ok_or_else(|| CommError::Device {
        op: op.to_string(),
        rank,
        source: Box::new(lowbit_device::DeviceError::Unsupported(
            "NCCL collectives need a CUDA device (Device::cuda), not a CPU device".into(),
        )),
    })
}

impl NcclComm {
    /// Rank `rank` of a world of `size` named by `id`, on `dev`'s GPU. Every rank of the world
    /// must call this (from its own thread or process) within `config.timeout`.
    pub fn init(
        dev: &Device,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        size: usize,
        config: NcclConfig,
    ) -> Result<NcclComm> {
        Self::init_in_world(dev, id, rank, size, config, Arc::new(World::default()))
    }

    /// Rank `env.rank` of the world described by the environment (see [`RendezvousEnv`]): rank 0
    /// makes the unique id and sends it over TCP to the others. `dev` should be
    /// `Device::cuda(env.local_rank)`.
    pub fn from_env(dev: &Device, env: &RendezvousEnv, config: NcclConfig) -> Result<NcclComm> {
        nccl_version()?;
        let mut made = None;
        let bytes = env.exchange(
            || {
                let id = unique_id().map_err(|e| {
                    made = Some(e);
                    crate::rendezvous::RendezvousError::Env(
                        "NCCL could not make a unique id".into(),
                    )
                })?;
                Ok(id.to_vec())
            },
            config.timeout,
        );
        if let Some(e) = made {
            return Err(e);
        }
        let bytes = bytes?;
        let id: [u8; UNIQUE_ID_BYTES] = bytes.as_slice().try_into().map_err(|_| {
            setup_error(
                env.rank,
                format!(
                    "the rendezvous delivered {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL id",
                    bytes.len()
                ),
            )
        })?;
        Self::init(dev, &id, env.rank, env.world_size, config)
    }

    fn init_in_world(
        dev: &Device,
        id: &[u8; UNIQUE_ID_BYTES],
        rank: usize,
        size: usize,
        config: NcclConfig,
        world: Arc<World>,
    ) -> Result<NcclComm> {
        nccl_version()?;
        if size == 0 || rank >= size || c_int::try_from(size).is_err() {
            return Err(setup_error(
                rank,
                format!("rank {rank} is not a rank of a world of {size}"),
            ));
        }
        let stream = cuda_stream(dev, rank, "init")?;
        let ctx = Arc::clone(stream.context());
        ctx.bind_to_thread()
            .map_err(|e| setup_error(rank, format!("binding the CUDA context: {e:?}")))?;
        let start = Instant::now();
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut cfg = comm_config(false);
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        // SAFETY: valid out pointer and config; the GPU's context is current on this thread.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut raw, size as c_int, uid, rank as c_int, &mut cfg)
        };
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) || raw.is_null()
        {
            return Err(setup_error(
                rank,
                describe("ncclCommInitRankConfig", r, raw),
            ));
        }
        settle_raw(raw, config.timeout, start).map_err(|detail| CommError::Timeout {
            op: format!("init ({detail})"),
            rank,
            waited: start.elapsed(),
            missing: Vec::new(),
        })?;
        let comm = collective_comm(raw, rank, &config, start).map_err(|detail| {
            // SAFETY: the settled control handle, owned here, not used again.
            unsafe { sys::ncclCommAbort(raw) };
            setup_error(rank, detail)
        })?;
        let ordinal = dev.cuda_ordinal().unwrap_or(ctx.ordinal());
        Self::finish(ctx, ordinal, raw, comm, rank, size, rank, config, world)
    }

    /// Wraps a settled communicator pair (`ctl` for splits, `comm` for collectives, possibly the
    /// same handle): stream, events, scratch memory and watchdog. Frees (aborts) both on
    /// failure.
    #[allow(clippy::too_many_arguments)]
    fn finish(
        ctx: Arc<CudaContext>,
        ordinal: usize,
        ctl: sys::ncclComm_t,
        comm: sys::ncclComm_t,
        rank: usize,
        size: usize,
        world_rank: usize,
        config: NcclConfig,
        world: Arc<World>,
    ) -> Result<NcclComm> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                comm: RawComm(comm),
                ctl: RawComm(ctl),
                failure: None,
                pending: VecDeque::new(),
                stop: false,
            }),
            cv: Condvar::new(),
            rank,
            world_rank,
            timeout: config.timeout,
            world,
            ctx: Arc::clone(&ctx),
        });
        let fail = |detail: String| {
            let mut st = shared.lock();
            shared.abort_locked(
                &mut st,
                Failure::Nccl {
                    op: "init".into(),
                    detail: detail.clone(),
                },
            );
            setup_error(rank, detail)
        };
        let cuda = |what: &str, e: cudarc::driver::DriverError| fail(format!("{what}: {e:?}"));
        let stream = ctx.new_stream().map_err(|e| cuda("creating a stream", e))?;
        let ready = ctx
            .new_event(None)
            .map_err(|e| cuda("creating an event", e))?;
        // SAFETY: allocating 4 bytes in the bound context; freed in `Drop`.
        let scratch = unsafe { dresult::malloc_sync(4) }.map_err(|e| cuda("cuMemAlloc", e))?;
        let watchdog = {
            let s = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("nccl-watchdog-{world_rank}"))
                .spawn(move || s.watch())
                .map_err(|e| fail(format!("spawning the watchdog: {e}")))?
        };
        Ok(NcclComm {
            shared,
            rank,
            size,
            ordinal,
            config,
            stream,
            ready,
            scratch,
            next_seq: 0,
            stats: CommStats::default(),
            watchdog: Some(watchdog),
        })
    }

    /// This rank's index in the world the communicator was split from.
    pub fn world_rank(&self) -> usize {
        self.shared.world_rank
    }

    /// The GPU ordinal this communicator runs on.
    pub fn gpu(&self) -> usize {
        self.ordinal
    }

    /// The communicator's settings.
    pub fn config(&self) -> &NcclConfig {
        &self.config
    }

    /// [`Communicator::split`] returning the concrete type (`ncclCommSplit`; the new
    /// communicator runs on the same GPU, with its own stream and watchdog, in the same world).
    pub fn split_nccl(&mut self, color: u32, key: u32) -> Result<NcclComm> {
        let seq = self.take_seq();
        let label = format!("split #{seq}");
        let (Ok(c), Ok(k)) = (c_int::try_from(color), c_int::try_from(key)) else {
            return Err(CommError::Nccl {
                op: label,
                rank: self.rank,
                detail: format!("color {color} and key {key} must be below 2^31 for NCCL"),
            });
        };
        let start = Instant::now();
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        {
            let mut st = self.shared.lock();
            self.shared.check(&mut st, &label)?;
            let _ = self.shared.ctx.bind_to_thread();
            let mut cfg = comm_config(false);
            // SAFETY: live parent handle under its mutex, valid out pointer and config.
            let r = unsafe { sys::ncclCommSplit(st.ctl.0, c, k, &mut raw, &mut cfg) };
            if !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                return Err(self.shared.nccl_error(&label, "ncclCommSplit", r, &st));
            }
            // The split is collective on the parent: poll it there, holding the mutex (the
            // watchdog must not free the parent meanwhile; the poll ends at the timeout).
            if let Err(detail) = wait_ready(st.ctl.0, self.config.timeout, start) {
                let failure = Failure::Nccl {
                    op: label.clone(),
                    detail,
                };
                let e = self.shared.error(&failure, &label);
                self.shared.world.abort(
                    self.shared.world_rank,
                    format!("world rank {} failed in {label}", self.shared.world_rank),
                );
                self.shared.abort_locked(&mut st, failure);
                return Err(e);
            }
        }
        if raw.is_null() {
            return Err(CommError::Nccl {
                op: label,
                rank: self.rank,
                detail: "ncclCommSplit returned no communicator".into(),
            });
        }
        settle_raw(raw, self.config.timeout, start).map_err(|detail| CommError::Timeout {
            op: format!("{label} ({detail})"),
            rank: self.rank,
            waited: start.elapsed(),
            missing: Vec::new(),
        })?;
        let (mut n, mut r) = (0 as c_int, 0 as c_int);
        // SAFETY: live, settled handle owned here; valid out pointers.
        let (a, b) = unsafe {
            (
                sys::ncclCommCount(raw, &mut n),
                sys::ncclCommUserRank(raw, &mut r),
            )
        };
        if a != sys::ncclResult_t::ncclSuccess || b != sys::ncclResult_t::ncclSuccess {
            let detail = describe("ncclCommCount/ncclCommUserRank", a, raw);
            // SAFETY: live handle, not used again.
            unsafe { sys::ncclCommAbort(raw) };
            return Err(CommError::Nccl {
                op: label,
                rank: self.rank,
                detail,
            });
        }
        let new_rank = usize::try_from(r).unwrap_or(0);
        let comm = collective_comm(raw, new_rank, &self.config, start).map_err(|detail| {
            // SAFETY: the new control handle, owned here, not used again.
            unsafe { sys::ncclCommAbort(raw) };
            CommError::Nccl {
                op: label.clone(),
                rank: self.rank,
                detail,
            }
        })?;
        Self::finish(
            Arc::clone(&self.shared.ctx),
            self.ordinal,
            raw,
            comm,
            new_rank,
            usize::try_from(n).unwrap_or(1),
            self.shared.world_rank,
            self.config.clone(),
            Arc::clone(&self.shared.world),
        )
    }

    fn take_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    fn device_error(&self, op: &str, e: lowbit_device::DeviceError) -> CommError {
        CommError::Device {
            op: op.to_string(),
            rank: self.rank,
            source: Box::new(e),
        }
    }

    fn driver_error(&self, op: &str, what: &str, e: cudarc::driver::DriverError) -> CommError {
        CommError::Nccl {
            op: op.to_string(),
            rank: self.rank,
            detail: format!("{what}: {e:?}"),
        }
    }

    /// Checks that `dev` is this communicator's GPU and returns its stream.
    fn device_stream(&self, dev: &Device, op: &str) -> Result<Arc<CudaStream>> {
        let stream = cuda_stream(dev, self.rank, op)?;
        if dev.cuda_ordinal() != Some(self.ordinal) {
            return Err(self.device_error(
                op,
                lowbit_device::DeviceError::Unsupported(format!(
                    "the device is GPU {:?}, the communicator's is GPU {}",
                    dev.cuda_ordinal(),
                    self.ordinal
                )),
            ));
        }
        Ok(stream)
    }

    /// Waits on the host for `event`, within the timeout.
    fn host_wait(&self, event: &CudaEvent, op: &str) -> Result<()> {
        let start = Instant::now();
        let mut polls = 0u32;
        loop {
            match event.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => return Err(self.driver_error(op, "cuEventQuery", e)),
            }
            {
                let mut st = self.shared.lock();
                self.shared.check(&mut st, op)?;
                if start.elapsed() >= self.config.timeout {
                    let failure = Failure::Timeout {
                        op: op.to_string(),
                        waited: start.elapsed(),
                    };
                    self.shared.world.abort(
                        self.shared.world_rank,
                        format!("world rank {} timed out in {op}", self.shared.world_rank),
                    );
                    let e = self.shared.error(&failure, op);
                    self.shared.abort_locked(&mut st, failure);
                    return Err(e);
                }
            }
            backoff(&mut polls);
        }
    }

    /// Enqueues `calls` as one NCCL group on the communicator's stream after the device stream's
    /// work so far, and returns the completion event.
    fn launch(
        &mut self,
        dev_stream: &CudaStream,
        label: &str,
        calls: &[Call],
    ) -> Result<Arc<CudaEvent>> {
        let start = Instant::now();
        let mut st = self.shared.lock();
        self.shared.check(&mut st, label)?;
        let _ = self.shared.ctx.bind_to_thread();
        self.ready
            .record(dev_stream)
            .map_err(|e| self.driver_error(label, "recording the ready event", e))?;
        self.stream
            .wait(&self.ready)
            .map_err(|e| self.driver_error(label, "ordering after the device stream", e))?;
        let comm = st.comm.0;
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        // SAFETY: plain group bracket; it is thread-local state in NCCL.
        let r = unsafe { sys::ncclGroupStart() };
        if r != sys::ncclResult_t::ncclSuccess {
            return Err(self.shared.nccl_error(label, "ncclGroupStart", r, &st));
        }
        let mut first_error = None;
        for c in calls {
            // SAFETY: every pointer was resolved by `Device::cuda_device_ptr` from a live view
            // of this GPU and the element counts match the views (checked by
            // `op::check_launch`); the handle is live and we hold its mutex; the stream belongs
            // to the communicator's GPU.
            let r = unsafe {
                match *c {
                    Call::AllGather {
                        send,
                        recv,
                        count,
                        dtype,
                    } => {
                        sys::ncclAllGather(send as *const _, recv as *mut _, count, dtype, comm, s)
                    }
                    Call::ReduceScatter {
                        send,
                        recv,
                        count,
                        dtype,
                        op,
                    } => sys::ncclReduceScatter(
                        send as *const _,
                        recv as *mut _,
                        count,
                        dtype,
                        op,
                        comm,
                        s,
                    ),
                    Call::AllReduce {
                        buf,
                        count,
                        dtype,
                        op,
                    } => sys::ncclAllReduce(
                        buf as *const _,
                        buf as *mut _,
                        count,
                        dtype,
                        op,
                        comm,
                        s,
                    ),
                    Call::Broadcast {
                        buf,
                        count,
                        dtype,
                        root,
                    } => sys::ncclBroadcast(
                        buf as *const _,
                        buf as *mut _,
                        count,
                        dtype,
                        root,
                        comm,
                        s,
                    ),
                }
            };
            if !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) && first_error.is_none()
            {
                first_error = Some(self.shared.nccl_error(label, "enqueueing", r, &st));
            }
        }
        // SAFETY: closes the group opened above (always, so NCCL's group depth stays balanced).
        let r = unsafe { sys::ncclGroupEnd() };
        if let Some(e) = first_error {
            return Err(e);
        }
        if !matches!(
            r,
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
        ) {
            return Err(self.shared.nccl_error(label, "ncclGroupEnd", r, &st));
        }
        if r == sys::ncclResult_t::ncclInProgress {
            let (settled_st, settled) = self.shared.settle(st, label, start);
            st = settled_st;
            settled?;
        }
        let event = self
            .stream
            .record_event(None)
            .map_err(|e| self.driver_error(label, "recording the completion event", e))?;
        let event = Arc::new(event);
        st.pending.push_back(Pending {
            event: Arc::clone(&event),
            started: start,
            label: label.to_string(),
        });
        // No wake-up: the watchdog polls pending launches every millisecond (every 20 ms when
        // idle), and a wake-up per launch costs more than the launch.
        Ok(event)
    }
}

/// One NCCL call of a launch, with resolved device addresses.
#[derive(Clone, Copy, Debug)]
enum Call {
    AllGather {
        send: u64,
        recv: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
    },
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
    },
    AllReduce {
        buf: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        op: sys::ncclRedOp_t,
    },
    Broadcast {
        buf: u64,
        count: usize,
        dtype: sys::ncclDataType_t,
        root: c_int,
    },
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.shared.world.abort(
                self.shared.world_rank,
                format!("world rank {} panicked", self.shared.world_rank),
            );
        }
        // Let outstanding launches finish (the watchdog aborts them at their deadline), then
        // free the communicator. ncclCommAbort rather than ncclCommDestroy: destroy finalizes,
        // which can wait for peers that have already exited.
        let mut st = self.shared.lock();
        while st.failure.is_none() && !st.pending.is_empty() {
            st = self
                .shared
                .cv
                .wait_timeout(st, Duration::from_millis(1))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        st.stop = true;
        let _ = self.shared.ctx.bind_to_thread();
        st.free();
        self.shared.cv.notify_all();
        drop(st);
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        let _ = self.shared.ctx.bind_to_thread();
        // SAFETY: allocated in `finish` in this context, freed once; no launch that used it is
        // outstanding (barriers wait for their event).
        let _ = unsafe { dresult::free_sync(self.scratch) };
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work> {
        let seq = self.take_seq();
        let (launch, op_labels) = crate::op::labels(seq, ops);
        {
            let mut st = self.shared.lock();
            self.shared.check(&mut st, &launch)?;
        }
        crate::op::check_launch(ops, self.rank, self.size, &launch, &op_labels)?;
        let dev_stream = self.device_stream(dev, &launch)?;
        let mut calls = Vec::with_capacity(ops.len());
        for (op, label) in ops.iter().zip(&op_labels) {
            let ptr = |v| {
                dev.cuda_device_ptr(v)
                    .map_err(|e| self.device_error(label, e))
            };
            let call = match *op {
                Op::AllGather { input, output } if !input.is_empty() => Call::AllGather {
                    send: ptr(input)?,
                    recv: ptr(output)?,
                    count: input.len(),
                    dtype: nccl_dtype(input.dtype()),
                },
                Op::ReduceScatter {
                    input,
                    output,
                    reduce,
                } if !output.is_empty() => Call::ReduceScatter {
                    send: ptr(input)?,
                    recv: ptr(output)?,
                    count: output.len(),
                    dtype: nccl_dtype(input.dtype()),
                    op: nccl_op(reduce),
                },
                Op::AllReduce { buf, reduce } if !buf.is_empty() => Call::AllReduce {
                    buf: ptr(buf)?,
                    count: buf.len(),
                    dtype: nccl_dtype(buf.dtype()),
                    op: nccl_op(reduce),
                },
                Op::Broadcast { buf, root } if !buf.is_empty() => Call::Broadcast {
                    buf: ptr(buf)?,
                    count: buf.len(),
                    dtype: nccl_dtype(buf.dtype()),
                    // check_launch bounded the root by the group size, which fits a c_int.
                    root: root as c_int,
                },
                // Zero elements on every rank (the ranks agree on counts): nothing to move.
                _ => continue,
            };
            calls.push(call);
        }
        self.stats.record(ops);
        if calls.is_empty() {
            return Ok(Work::completed());
        }
        let event = self.launch(&dev_stream, &launch, &calls)?;
        Ok(Work {
            inner: WorkInner::Nccl(NcclWork {
                shared: Arc::clone(&self.shared),
                event,
                launch,
                ordinal: self.ordinal,
            }),
        })
    }

    fn barrier(&mut self) -> Result<()> {
        let seq = self.take_seq();
        let label = format!("barrier #{seq}");
        self.stats.barriers += 1;
        let start = Instant::now();
        let event = {
            let mut st = self.shared.lock();
            self.shared.check(&mut st, &label)?;
            let _ = self.shared.ctx.bind_to_thread();
            let s = self.stream.cu_stream() as sys::cudaStream_t;
            // SAFETY: the scratch f32 lives as long as the communicator; live handle under its
            // mutex; the stream is the communicator's.
            let r = unsafe {
                sys::ncclAllReduce(
                    self.scratch as *const _,
                    self.scratch as *mut _,
                    1,
                    sys::ncclDataType_t::ncclFloat32,
                    sys::ncclRedOp_t::ncclSum,
                    st.comm.0,
                    s,
                )
            };
            if !matches!(
                r,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                return Err(self.shared.nccl_error(&label, "ncclAllReduce", r, &st));
            }
            let (st, settled) = self.shared.settle(st, &label, start);
            drop(st);
            settled?;
            self.stream
                .record_event(None)
                .map_err(|e| self.driver_error(&label, "recording an event", e))?
        };
        self.host_wait(&event, &label)
    }

    fn split(&mut self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_nccl(color, key)?))
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort(&mut self, reason: &str) {
        let by_rank = self.shared.world_rank;
        self.shared.world.abort(by_rank, reason.to_string());
        let mut st = self.shared.lock();
        self.shared.abort_locked(
            &mut st,
            Failure::Aborted {
                by_rank,
                reason: reason.to_string(),
            },
        );
    }
}

/// An NCCL launch in flight.
pub(crate) struct NcclWork {
    shared: Arc<Shared>,
    event: Arc<CudaEvent>,
    launch: String,
    ordinal: usize,
}

impl fmt::Debug for NcclWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclWork")
            .field("launch", &self.launch)
            .field("rank", &self.shared.rank)
            .finish_non_exhaustive()
    }
}

impl NcclWork {
    /// Makes `dev`'s stream wait for the launch (the host does not block). Fails if the
    /// communicator already failed.
    pub(crate) fn wait(self, dev: &mut Device) -> Result<()> {
        {
            let mut st = self.shared.lock();
            self.shared.check(&mut st, &self.launch)?;
        }
        let stream = cuda_stream(dev, self.shared.rank, &self.launch)?;
        if dev.cuda_ordinal() != Some(self.ordinal) {
            return Err(CommError::Device {
                op: self.launch.clone(),
                rank: self.shared.rank,
                source: Box::new(lowbit_device::DeviceError::Unsupported(format!(
                    "waited on GPU {:?}, the launch ran on GPU {}",
                    dev.cuda_ordinal(),
                    self.ordinal
                ))),
            });
        }
        stream.wait(&self.event).map_err(|e| CommError::Nccl {
            op: self.launch.clone(),
            rank: self.shared.rank,
            detail: format!("ordering the device stream after the launch: {e:?}"),
        })
    }
}

/// Runs `f` on `gpus` rank threads of this process, rank `r` on GPU `r` with its own
/// [`Device::cuda`] and communicator (default [`NcclConfig`]), and returns each rank's result in
/// rank order, like [`run_ranks`](crate::run_ranks) does for CPU threads. A setup failure, or a
/// rank whose device or communicator cannot be created or that panics, is an error
/// ([`CommError::Rank`] names the lowest such rank). [`run_local_ranks_with`] gives the
/// configuration, owned communicators and per-rank errors.
pub fn run_local_ranks<R, F>(gpus: usize, f: F) -> Result<Vec<R>>
where
    R: Send,
    F: Fn(&mut dyn Communicator, &mut Device) -> R + Sync,
{
    run_local_ranks_with(gpus, NcclConfig::default(), |mut comm, mut dev| {
        f(&mut comm, &mut dev)
    })?
    .into_iter()
    .map(|r| r.map_err(CommError::from))
    .collect()
}

/// Runs `f` on `gpus` rank threads of this process (named `nccl-rank-<r>`), rank `r` on GPU `r`
/// with its [`Device::cuda`] and its communicator of a new NCCL world, and returns each rank's
/// result in rank order, like [`run_ranks`](crate::run_ranks). The outer error is a setup
/// failure before any thread started (no NCCL, too few GPUs); a rank whose device or
/// communicator cannot be created, or that panics, gets its [`RankError`] (a panic aborts the
/// world, so the other ranks fail promptly instead of waiting for it).
pub fn run_local_ranks_with<T, F>(
    gpus: usize,
    config: NcclConfig,
    f: F,
) -> Result<Vec<Result<T, RankError>>>
where
    T: Send,
    F: Fn(NcclComm, Device) -> T + Sync,
{
    nccl_version()?;
    let count =
        CudaContext::device_count().map_err(|e| setup_error(0, format!("counting GPUs: {e:?}")))?;
    if gpus == 0 || gpus > usize::try_from(count).unwrap_or(0) {
        return Err(setup_error(
            0,
            format!("{gpus} rank(s) asked for, {count} GPU(s) visible"),
        ));
    }
    let id = unique_id()?;
    let world = Arc::new(World::default());
    let f = &f;
    Ok(std::thread::scope(|s| {
        let handles: Vec<_> = (0..gpus)
            .map(|rank| {
                let world = Arc::clone(&world);
                let config = config.clone();
                std::thread::Builder::new()
                    .name(format!("nccl-rank-{rank}"))
                    .spawn_scoped(s, move || {
                        let fail = |message: String| RankError { rank, message };
                        let dev = Device::cuda(rank)
                            .map_err(|e| fail(format!("Device::cuda({rank}): {e}")))?;
                        let comm =
                            NcclComm::init_in_world(&dev, &id, rank, gpus, config, world.clone())
                                .map_err(|e| {
                                world.abort(rank, format!("rank {rank} failed to init"));
                                fail(e.to_string())
                            })?;
                        catch_unwind(AssertUnwindSafe(|| f(comm, dev)))
                            .map_err(|p| fail(crate::local::panic_message(&*p)))
                    })
            })
            .collect();
        crate::local::join_ranks(handles)
    }))
}
