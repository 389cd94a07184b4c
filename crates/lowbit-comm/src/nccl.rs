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
//! panicking rank thread) aborts the others' communicators too. Ranks in other processes (a
//! world made by [`NcclComm::from_env`]) hear of a lost peer through the
//! [`liveness`](crate::liveness) channel, which aborts the world the same way, within seconds:
//! every call then returns [`CommError::PeerLost`] naming the lost rank. A peer that finished
//! and left cleanly fails only launches of communicators spanning the whole world still pending
//! 2 s after it left (it did not join them; sub-groups without it are not judged). Where an abort
//! cannot reach (a host thread blocked inside NCCL's first launch of a kind, waiting for peers to
//! connect) the process exits with status 1 naming the peer: 3 s after a loss (the liveness
//! channel's backstop), or 5 s after a departure if such a call that began before it still runs. One hang remains possible with the blocking copy: the first launch of
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
//! f32, bf16 (`ncclBfloat16`) and f16 move and reduce natively; u8 payloads (fp8/fp4 bytes, scales)
//! move as `ncclUint8` (gather and broadcast only). [`ReduceOp::Avg`](crate::ReduceOp::Avg) is
//! NCCL's `ncclAvg`, which for floats multiplies every input by `1/size` in the payload dtype
//! before the sum (a pre-multiplied sum). With two ranks (any power-of-two group) that scaling is
//! exact and the result equals the in-process group's `sum / size` bit for bit except where values
//! are subnormal; with two ranks the sum itself is one addition, identical to the in-process
//! rank-order sum. Larger groups add in NCCL's ring/tree order and round at every hop, so they
//! differ from the in-process group in the last bits, and an all-reduce and a reduce-scatter of the
//! same values need not agree either (measured on 4 H200s: classic DDP against the distributed
//! optimizer in bf16 trains within 1e-4, not bitwise; every pair that reduce-scatters on both sides
//! stays bitwise). [`ReduceOp::Max`](crate::ReduceOp::Max) is NCCL's max, which does not propagate
//! NaN as the in-process group does.
//!
//! # Files
//! This file holds the configuration and the communicator's [`Communicator`] side; `setup`
//! makes communicators (initialisation, splits, the rank threads), `launch` validates and
//! enqueues launches, `watchdog` holds the state shared with the watchdog thread and the
//! watchdog itself.

use std::fmt;
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use cudarc::driver::{CudaEvent, CudaStream, result as dresult};
use cudarc::nccl::sys;
use lowbit_device::Device;

use crate::liveness::LivenessConfig;
use crate::{CommError, CommStats, Communicator, Op, Result, Work, WorkInner};

mod launch;
mod setup;
mod watchdog;

pub(crate) use launch::NcclWork;
pub use setup::{nccl_version, run_local_ranks, run_local_ranks_with, unique_id};
use watchdog::{Failure, Shared};

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
    /// The liveness channel of a world made by [`NcclComm::from_env`] (processes): heartbeats,
    /// the silence that counts as a loss, and the exit backstop. Default: 1 s, 5 s, exit 3 s
    /// after a loss.
    pub liveness: LivenessConfig,
    /// Launch collectives on a stream of the device's highest priority. A collective queued
    /// behind a compute kernel then gets SMs as soon as any of that kernel's CTAs retires,
    /// instead of after its whole grid has been dispatched: what lets a bucket's reduction
    /// overlap the backward's matrix products (TE and PyTorch's `is_high_priority_stream` do
    /// the same). Default true; false gives the stream the default priority.
    pub high_priority: bool,
}

impl Default for NcclConfig {
    fn default() -> Self {
        NcclConfig {
            timeout: Duration::from_secs(300),
            nonblocking: false,
            liveness: LivenessConfig::default().with_exit_after_loss(Some(Duration::from_secs(3))),
            high_priority: true,
        }
    }
}

impl NcclConfig {
    /// This configuration with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This configuration with another liveness channel setting.
    pub fn with_liveness(mut self, liveness: LivenessConfig) -> Self {
        self.liveness = liveness;
        self
    }

    /// This configuration with collectives on a highest-priority stream (or the default one).
    pub fn with_high_priority(mut self, high_priority: bool) -> Self {
        self.high_priority = high_priority;
        self
    }

    /// This configuration with collectives on the non-blocking communicator (or not).
    pub fn with_nonblocking(mut self, nonblocking: bool) -> Self {
        self.nonblocking = nonblocking;
        self
    }
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
        let (dev_stream, calls) = self.calls(dev, ops, &launch, &op_labels)?;
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
            let enqueue = self.shared.whole_world.then(|| self.shared.world.enqueue());
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
            drop((st, enqueue));
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
