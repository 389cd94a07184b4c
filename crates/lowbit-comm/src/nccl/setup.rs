//! Communicator setup: loading NCCL, the unique id, a world's initialisation (polled against
//! the timeout, with the blocking copy for collectives), splits, and the rank threads of
//! [`run_local_ranks`].

use std::collections::VecDeque;
use std::ffi::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, result as dresult};
use cudarc::nccl::sys;
use lowbit_device::Device;

use super::watchdog::{DEPART_GRACE, Failure, RawComm, Shared, State, World, backoff, describe};
use super::{NcclComm, NcclConfig, UNIQUE_ID_BYTES, cuda_stream};
use crate::liveness::PeerEvent;
use crate::rendezvous::RendezvousEnv;
use crate::{CommError, CommStats, Communicator, RankError, Result};

/// Polls a communicator being created (or split) until it settles; aborts it on an error or
/// when `timeout` has passed since `start`.
fn settle_raw(
    raw: sys::ncclComm_t,
    timeout: Duration,
    start: Instant,
    world: &World,
) -> Result<(), String> {
    wait_ready(raw, timeout, start, world).inspect_err(|_| {
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
    world: &World,
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
    wait_ready(ctl, config.timeout, start, world)?;
    if child.is_null() {
        return Err("ncclCommSplit returned no communicator".into());
    }
    if let Err(e) = wait_ready(child, config.timeout, start, world) {
        // SAFETY: the child is live and owned here; not used again.
        unsafe { sys::ncclCommAbort(child) };
        return Err(e);
    }
    Ok(child)
}

/// Polls `raw` until no call on it is in progress, up to `timeout` after `start` or until a
/// peer of `world` is lost or leaves (no abort).
fn wait_ready(
    raw: sys::ncclComm_t,
    timeout: Duration,
    start: Instant,
    world: &World,
) -> Result<(), String> {
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
        if let Some(why) = world.setup_blocker() {
            return Err(why);
        }
        backoff(&mut polls);
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
        let world = Arc::new(World::default());
        let mut made = None;
        // The liveness channel aborts this world when a peer process is lost (a weak handle:
        // the world owns the channel).
        let weak = Arc::downgrade(&world);
        let exit_after = config.liveness.exit_after_loss;
        let on_event = move |e: &PeerEvent| {
            let Some(w) = weak.upgrade() else { return };
            match e {
                PeerEvent::Left { rank } => {
                    w.depart(*rank);
                    if let Some(after) = exit_after {
                        exit_if_stuck(Arc::downgrade(&w), *rank, after);
                    }
                }
                PeerEvent::Lost { rank, cause } => w.lose(*rank, cause.clone()),
            }
        };
        let exchanged = env.exchange_live(
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
            config.liveness,
            on_event,
        );
        if let Some(e) = made {
            return Err(e);
        }
        let (bytes, live) = exchanged?;
        *world.live.lock().unwrap_or_else(PoisonError::into_inner) = Some(live);
        let id: [u8; UNIQUE_ID_BYTES] = bytes.as_slice().try_into().map_err(|_| {
            setup_error(
                env.rank,
                format!(
                    "the rendezvous delivered {} bytes, not a {UNIQUE_ID_BYTES}-byte NCCL id",
                    bytes.len()
                ),
            )
        })?;
        Self::init_in_world(dev, &id, env.rank, env.world_size, config, world)
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
        settle_raw(raw, config.timeout, start, &world).map_err(|detail| CommError::Timeout {
            op: format!("init ({detail})"),
            rank,
            waited: start.elapsed(),
            missing: Vec::new(),
        })?;
        let comm = collective_comm(raw, rank, &config, start, &world).map_err(|detail| {
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
            whole_world: *world.size.get_or_init(|| size) == size,
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
        let stream = if config.high_priority {
            // Lower numbers are higher priorities; the greatest is the range's second value.
            ctx.bind_to_thread()
                .map_err(|e| cuda("binding the context", e))?;
            let (_, greatest) = cudarc::driver::result::stream::get_priority_range()
                .map_err(|e| cuda("cuCtxGetStreamPriorityRange", e))?;
            ctx.new_stream_with_priority(greatest)
        } else {
            ctx.new_stream()
        }
        .map_err(|e| cuda("creating a stream", e))?;
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
            if let Err(detail) =
                wait_ready(st.ctl.0, self.config.timeout, start, &self.shared.world)
            {
                let failure = Failure::Nccl {
                    op: label.clone(),
                    detail,
                };
                let reason = format!("world rank {} failed in {label}", self.shared.world_rank);
                return Err(self.shared.fail(&mut st, &label, failure, reason));
            }
        }
        if raw.is_null() {
            return Err(CommError::Nccl {
                op: label,
                rank: self.rank,
                detail: "ncclCommSplit returned no communicator".into(),
            });
        }
        settle_raw(raw, self.config.timeout, start, &self.shared.world).map_err(|detail| {
            CommError::Timeout {
                op: format!("{label} ({detail})"),
                rank: self.rank,
                waited: start.elapsed(),
                missing: Vec::new(),
            }
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
        let comm = collective_comm(raw, new_rank, &self.config, start, &self.shared.world)
            .map_err(|detail| {
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
}

/// The backstop for a clean departure: the watchdog fails launches the departed peer left
/// pending, but not an NCCL call that blocks the host until its peers connect (the first launch
/// of a kind); if one that began before the departure is still running `DEPART_GRACE` + `after`
/// later, the process exits (status 1) naming the peer.
fn exit_if_stuck(world: std::sync::Weak<World>, rank: usize, after: Duration) {
    let at = Instant::now();
    let _ = std::thread::Builder::new()
        .name("lowbit-nccl-departure".into())
        .spawn(move || {
            std::thread::sleep(DEPART_GRACE + after);
            if world
                .upgrade()
                .is_some_and(|w| w.enqueuing_since_before(at))
            {
                eprintln!(
                    "lowbit nccl: world rank {rank} finished and left while this process was \
                     blocked connecting to it in a collective: exiting"
                );
                crate::liveness::exit_process(1);
            }
        });
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
