//! Collectives between data-parallel ranks: all-gather, reduce-scatter, all-reduce, broadcast and
//! barrier, blocking or asynchronous, single or coalesced, over a group or a sub-group.
//!
//! # Purpose
//! The buffer, optimizer and FSDP layers exchange gradient buckets and parameter shards through
//! the [`Communicator`] trait: reduce-scatter of each bucket into per-rank contiguous shards
//! (rank `r` owns `[r·S, (r+1)·S)`), all-gather of the shards back into the bucket, both in place
//! on the bucket view, several buckets of a bucket group started as one coalesced launch, and the
//! returned [`Work`] handle waited on later (overlap). This crate provides the trait, the
//! in-process implementation [`LocalComm`] (ranks are threads of one process, each with its own
//! [`Device`]) with the [`run_ranks`] helper every upper-layer test uses, and, behind the `cuda`
//! feature, `nccl::NcclComm` (one rank per GPU; a thread per GPU with `nccl::run_local_ranks`,
//! or one process per GPU through [`rendezvous`], the TCP exchange of NCCL's unique id that
//! reads the environment `torchrun` sets). The rendezvous needs no CUDA and is tested on CPU.
//! A downstream transport (MPI, gloo, a test double) implements [`Communicator`] itself and
//! returns asynchronous launches as [`Work::pending`] (a [`PendingWork`] value) or
//! [`Work::from_fn`] (a closure), completed by the caller's [`Work::wait`] like the crate's own.
//!
//! ```
//! use lowbit_comm::{Communicator, GroupConfig, ReduceOp, run_ranks};
//! use lowbit_device::DType;
//!
//! let results = run_ranks(2, GroupConfig::default(), |mut comm, mut dev| {
//!     let grads = dev.alloc(DType::F32, 4);
//!     let r = comm.rank() as f32;
//!     dev.upload(grads, &[r, r, r, r]).unwrap();
//!     // Reduce-scatter in place: this rank's chunk of the bucket receives the sum.
//!     let shard = grads.slice(2 * comm.rank()..2 * comm.rank() + 2).unwrap();
//!     comm.reduce_scatter(&mut dev, grads, shard, ReduceOp::Sum).unwrap();
//!     dev.download::<f32>(shard).unwrap()
//! });
//! for shard in results {
//!     assert_eq!(shard.unwrap(), vec![1.0, 1.0]);
//! }
//! ```
//!
//! # The key decisions
//! **Deterministic reduction.** Float payloads (f32, bf16, f16) are reduced element-wise in f32
//! *in rank order* `((x₀ + x₁) + x₂) + …`, with one rounding to the payload dtype at the end
//! (round-to-nearest-even; [`ReduceOp::Avg`] divides the f32 sum by the group size before that
//! rounding). This differs from NCCL, whose ring and tree algorithms add in an order that depends
//! on the topology and rounds to the payload dtype at every hop; the in-process group gives up
//! that fidelity to make every result bitwise reproducible regardless of thread timing, so whole
//! training runs on the CPU backend are bitwise reproducible. u8 payloads (fp8/fp4 bytes, block
//! scales) can be gathered and broadcast but not reduced (amax reductions happen on f32 views).
//!
//! **Async in-process.** A `start_*` call validates the arguments, copies (snapshots) the input
//! to host memory in the group's shared state, keyed by the communicator's sequence number, and
//! returns; it never blocks on peers. (Snapshot buffers are recycled once every rank is done with
//! a collective, up to [`GroupConfig::pool_bytes`], because fresh memory page-faults on first
//! touch and that cost more than the copy.) [`Work::wait`] blocks until every rank of the group has posted that
//! operation, checks that all ranks called the same operation with agreeing arguments, then
//! computes this rank's output from the snapshots and writes it into the output views on this
//! rank's device. Each rank computes its own result (for all-reduce, the ranks share the work
//! chunk by chunk), so the computation runs in parallel on the rank threads. Callers must not
//! rely on the snapshot: as with NCCL, an input must stay untouched from `start` until `wait`
//! returns, and an output is undefined until then.
//!
//! **Failure is an error on every rank, never a hang.** Operations are matched by sequence
//! number. If ranks disagree on the operation or its arguments, or one rank's arguments are
//! invalid, every rank gets an error for that operation. A rank that does not arrive within the
//! configured timeout makes the waiting ranks fail with [`CommError::Timeout`]; a rank that
//! panics, or drops its communicator before joining an operation its peers wait in, makes them
//! fail with [`CommError::PeerLost`] naming it at once. Timeouts, panics and
//! [`Communicator::abort`] abort the whole world (the root group and every group split from
//! it): every operation started afterwards, and every one still waiting for a rank, errors; one
//! that every rank had already joined completes.
//!
//! **NCCL (feature `cuda`).** Collectives run on the communicator's own CUDA stream, ordered
//! after the device's stream by an event recorded at `start`; [`Work::wait`] makes the device's
//! stream wait on the launch's completion event without blocking the host, so compute enqueued
//! between `start` and `wait` overlaps the transfer. Views become device addresses only through
//! `Device::cuda_device_ptr` (live, in bounds, this GPU) after the same argument checks as the
//! in-process group; agreement between ranks is not checked (no per-launch exchange), so ranks
//! that disagree time out. u8 payloads move as `ncclUint8`, bf16 as `ncclBfloat16`;
//! [`ReduceOp::Avg`] is NCCL's `ncclAvg` (inputs pre-multiplied by `1/size` in the payload
//! dtype, then summed): with two ranks, sum and average are bit-identical to the in-process
//! group (one addition; halving is exact outside subnormals), larger groups differ in the last
//! bits (NCCL's ring order and per-hop rounding) and NCCL's max does not propagate NaN.
//! Initialisation and splits run on a non-blocking control communicator, polled with
//! `ncclCommGetAsyncError` up to the timeout; collectives run on a blocking copy split from it
//! (a non-blocking `ncclGroupEnd` costs ~50 µs on NCCL's own thread; `NcclConfig::nonblocking`
//! chooses that instead), and a watchdog thread per communicator aborts both (`ncclCommAbort`,
//! which also unblocks device synchronisations waiting on it) when a launch outlives the
//! timeout or NCCL reports an asynchronous error; the error is then returned by every later
//! call. (With the blocking copy, the first launch of a kind connects its peers and blocks the
//! host until they arrive, as in PyTorch's default.) Ranks of one process abort together; ranks
//! in other processes learn of a lost peer within seconds through the [`liveness`] channel (the
//! rendezvous connections kept open, heartbeats, authenticated frames; a SIGTERM'd rank says so
//! on its way out), which aborts the communicator (`ncclCommAbort` by the watchdog), so every
//! call returns [`CommError::PeerLost`] naming the rank; a process still alive 3 s after a loss
//! exits with status 1. The rendezvous: rank 0 listens on the addresses `MASTER_ADDR` (or
//! `LOWBIT_RDZV_BIND`) resolves to on this host, IPv4 and IPv6, port `MASTER_PORT`
//! (`LOWBIT_RDZV_PORT`, or `MASTER_PORT + 1` under a torchrun agent that holds the port itself);
//! both sides prove a job secret (`LOWBIT_RDZV_TOKEN`, else `TORCHELASTIC_RUN_ID`; a public key
//! on loopback only) by HMAC-SHA256 challenge–response, rank 0 first, and the 128-byte id goes
//! encrypted and tagged only to a rank that proved it. Each connection runs on its own thread
//! with a short deadline; garbage, silent, duplicate or unauthenticated peers are dropped and
//! logged without failing the job, which fails only when real ranks are missing at the deadline.
//!
//! # Invariants
//! - All-gather output is exactly `size × input` elements and rank `r`'s input lands at
//!   `[r·n, (r+1)·n)`; reduce-scatter input is exactly `size × output` elements and rank `r`
//!   receives chunk `r`. The only overlaps allowed are these in-place forms (input = rank's slice
//!   of the output, output = rank's chunk of the input).
//! - Within one coalesced launch no op writes memory another op of the launch reads or writes.
//! - Results of reductions depend only on the inputs and the group's rank order.
//! - Statistics count what this rank launched, whether or not the launch later failed on peers.
//!
//! # Non-goals
//! Point-to-point send/receive, variable-size gathers, reduction orders other than rank order
//! in-process, detecting overlaps between *separately started* outstanding operations (the
//! caller's responsibility, as with NCCL), checking argument agreement between NCCL ranks,
//! NCCL's reduction order matching the in-process one beyond two ranks, elastic membership
//! (a world is fixed at creation), NVLink SHARP (`NCCL_NVLS_ENABLE=0` where we run).

// Only the NCCL module (behind `cuda`) and the liveness channel's signal handler
// (`liveness::signal`) call foreign functions.
#![deny(unsafe_code)]

mod error;
pub mod liveness;
mod local;
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
pub mod nccl;
mod op;
mod pool;
mod reduce;
pub mod rendezvous;

use std::fmt;

pub use error::{CommError, RankError, Result};
pub use local::{GroupConfig, LocalComm, run_ranks};
pub use lowbit_device::{DType, Device, View};
pub use op::{Op, OpKind, ReduceOp};

/// A group of ranks that run collectives together. One value per rank; object-safe, so layers
/// hold `&mut dyn Communicator` or `Box<dyn Communicator>` and do not change when the NCCL
/// implementation arrives.
///
/// Every rank of the group must issue the same collectives in the same order with agreeing
/// arguments (same kind, per-rank element count, dtype, reduction, root); a disagreement is an
/// error on every rank. Ranks in errors and arguments are ranks of this group, `0..size()`.
///
/// Blocking methods are `start_*` followed by [`Work::wait`] on the same device. An input must
/// stay untouched from `start` until `wait` returns; an output is undefined until then.
pub trait Communicator: Send + fmt::Debug {
    /// This rank's index in the group.
    fn rank(&self) -> usize;

    /// Number of ranks in the group.
    fn size(&self) -> usize;

    /// Starts `ops` as one launch (NCCL: one group call), completed by one [`Work::wait`].
    /// Every rank must pass the same sequence of op kinds with agreeing arguments. If this rank's
    /// arguments are invalid, this returns the error and the peers' waits fail with
    /// [`CommError::Peer`].
    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work>;

    /// Blocks until every rank of the group has called `barrier`.
    fn barrier(&mut self) -> Result<()>;

    /// Collective over the group, like `MPI_Comm_split`: ranks passing the same `color` form a new
    /// group, ordered by `(key, rank in this group)`. Returns this rank's communicator of its new
    /// group.
    fn split(&mut self, color: u32, key: u32) -> Result<Box<dyn Communicator>>;

    /// What this communicator has launched so far.
    fn stats(&self) -> CommStats;

    /// Aborts the group (and every group of the same world): peers' pending and later operations
    /// fail with [`CommError::Aborted`] naming this rank and `reason`.
    fn abort(&mut self, reason: &str);

    /// Starts an all-gather; see [`Op::AllGather`].
    fn start_all_gather(&mut self, dev: &mut Device, input: View, output: View) -> Result<Work> {
        self.start_coalesced(dev, &[Op::AllGather { input, output }])
    }

    /// Starts a reduce-scatter; see [`Op::ReduceScatter`].
    fn start_reduce_scatter(
        &mut self,
        dev: &mut Device,
        input: View,
        output: View,
        op: ReduceOp,
    ) -> Result<Work> {
        self.start_coalesced(
            dev,
            &[Op::ReduceScatter {
                input,
                output,
                reduce: op,
            }],
        )
    }

    /// Starts an all-reduce; see [`Op::AllReduce`].
    fn start_all_reduce(&mut self, dev: &mut Device, buf: View, op: ReduceOp) -> Result<Work> {
        self.start_coalesced(dev, &[Op::AllReduce { buf, reduce: op }])
    }

    /// Starts a broadcast; see [`Op::Broadcast`].
    fn start_broadcast(&mut self, dev: &mut Device, buf: View, root: usize) -> Result<Work> {
        self.start_coalesced(dev, &[Op::Broadcast { buf, root }])
    }

    /// All-gather; see [`Op::AllGather`].
    fn all_gather(&mut self, dev: &mut Device, input: View, output: View) -> Result<()> {
        self.start_all_gather(dev, input, output)?.wait(dev)
    }

    /// Reduce-scatter; see [`Op::ReduceScatter`].
    fn reduce_scatter(
        &mut self,
        dev: &mut Device,
        input: View,
        output: View,
        op: ReduceOp,
    ) -> Result<()> {
        self.start_reduce_scatter(dev, input, output, op)?.wait(dev)
    }

    /// All-reduce; see [`Op::AllReduce`].
    fn all_reduce(&mut self, dev: &mut Device, buf: View, op: ReduceOp) -> Result<()> {
        self.start_all_reduce(dev, buf, op)?.wait(dev)
    }

    /// Broadcast; see [`Op::Broadcast`].
    fn broadcast(&mut self, dev: &mut Device, buf: View, root: usize) -> Result<()> {
        self.start_broadcast(dev, buf, root)?.wait(dev)
    }

    /// A coalesced launch, waited on at once.
    fn coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<()> {
        self.start_coalesced(dev, ops)?.wait(dev)
    }
}

impl<C: Communicator + ?Sized> Communicator for Box<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work> {
        (**self).start_coalesced(dev, ops)
    }
    fn barrier(&mut self) -> Result<()> {
        (**self).barrier()
    }
    fn split(&mut self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        (**self).split(color, key)
    }
    fn stats(&self) -> CommStats {
        (**self).stats()
    }
    fn abort(&mut self, reason: &str) {
        (**self).abort(reason)
    }
    fn start_all_gather(&mut self, dev: &mut Device, input: View, output: View) -> Result<Work> {
        (**self).start_all_gather(dev, input, output)
    }
    fn start_reduce_scatter(
        &mut self,
        dev: &mut Device,
        input: View,
        output: View,
        op: ReduceOp,
    ) -> Result<Work> {
        (**self).start_reduce_scatter(dev, input, output, op)
    }
    fn start_all_reduce(&mut self, dev: &mut Device, buf: View, op: ReduceOp) -> Result<Work> {
        (**self).start_all_reduce(dev, buf, op)
    }
    fn start_broadcast(&mut self, dev: &mut Device, buf: View, root: usize) -> Result<Work> {
        (**self).start_broadcast(dev, buf, root)
    }
}

/// A started collective launch. [`Work::wait`] completes it.
///
/// Dropping a `Work` without waiting does not block or fail the peers (they complete the
/// operation), but this rank's outputs are then never written.
///
/// The crate's own communicators make their handles internally; a [`Communicator`] implemented
/// outside this crate (MPI, gloo, a test double) returns [`Work::completed`] for a launch that
/// finished in `start_*`, and [`Work::pending`] or [`Work::from_fn`] for one that completes
/// later, in [`Work::wait`].
///
/// `Work` is `Send` and `Sync` whatever it holds (a pending operation needs only `Send`).
#[must_use = "the outputs are written only by Work::wait"]
#[derive(Debug)]
pub struct Work {
    inner: WorkInner,
}

#[derive(Debug)]
enum WorkInner {
    Completed,
    Local(local::LocalWork),
    #[cfg(feature = "cuda")]
    Nccl(nccl::NcclWork),
    Pending(Pending),
}

/// The completion of an operation started by a [`Communicator`] implemented outside this crate:
/// what [`Work::wait`] runs for a handle made by [`Work::pending`].
///
/// Implement it on the type that holds what the transport needs to finish the operation (a
/// request handle, a channel, the output views). Its [`Drop`] is the place to release resources
/// of a handle dropped without waiting; the [`Work`] contract asks that dropping neither blocks
/// nor fails the peers.
///
/// ```
/// use lowbit_comm::{Device, PendingWork, Result, View, Work};
///
/// /// Writes `value` into `out` when waited on.
/// #[derive(Debug)]
/// struct Fill { out: View, value: f32 }
///
/// impl PendingWork for Fill {
///     fn wait(self: Box<Self>, dev: &mut Device) -> Result<()> {
///         let vals = vec![self.value; self.out.len()];
///         dev.upload(self.out, &vals).map_err(|e| lowbit_comm::CommError::Device {
///             op: "fill".into(),
///             rank: 0,
///             source: Box::new(e),
///         })
///     }
/// }
///
/// let mut dev = Device::cpu();
/// let out = dev.alloc(lowbit_comm::DType::F32, 2);
/// let work = Work::pending(Fill { out, value: 3.0 });
/// work.wait(&mut dev).unwrap();
/// assert_eq!(dev.download::<f32>(out).unwrap(), vec![3.0, 3.0]);
/// ```
pub trait PendingWork: Send + fmt::Debug {
    /// Completes the operation on this rank; the contract of [`Work::wait`] (same device as the
    /// launch, outputs visible to every later op on `dev` afterwards, errors as
    /// [`CommError`]s) is this method's contract. Called at most once.
    fn wait(self: Box<Self>, dev: &mut Device) -> Result<()>;
}

/// A [`PendingWork`] made of a closure ([`Work::from_fn`]).
struct FnWork<F>(F);

impl<F> fmt::Debug for FnWork<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FnWork")
    }
}

impl<F> PendingWork for FnWork<F>
where
    F: FnOnce(&mut Device) -> Result<()> + Send,
{
    fn wait(self: Box<Self>, dev: &mut Device) -> Result<()> {
        (self.0)(dev)
    }
}

/// An outside pending operation. The mutex is never contended (only `Debug` borrows it; `wait`
/// consumes it); it is there so that `Work` stays `Sync` while implementations need only be
/// `Send` (a channel receiver, for one, is not `Sync`).
struct Pending(std::sync::Mutex<Box<dyn PendingWork>>);

impl fmt::Debug for Pending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.try_lock() {
            Ok(w) => fmt::Debug::fmt(&**w, f),
            Err(_) => f.write_str("PendingWork(<locked>)"),
        }
    }
}

impl Work {
    /// A handle whose operation is already complete (for callers that skip a collective, e.g.
    /// on a group of one, but keep the start/wait shape).
    pub fn completed() -> Work {
        Work {
            inner: WorkInner::Completed,
        }
    }

    /// A handle whose operation completes in [`Work::wait`], which calls
    /// [`PendingWork::wait`] on `work`: how a [`Communicator`] implemented outside this crate
    /// returns an asynchronous launch. Dropping the handle drops `work` without waiting.
    ///
    /// Use this when the pending state has a name worth showing in `Debug` output or needs a
    /// `Drop` of its own; [`Work::from_fn`] is the shorthand for a closure.
    pub fn pending(work: impl PendingWork + 'static) -> Work {
        Work::pending_boxed(Box::new(work))
    }

    /// [`Work::pending`] for an already boxed (e.g. type-erased) operation.
    pub fn pending_boxed(work: Box<dyn PendingWork>) -> Work {
        Work {
            inner: WorkInner::Pending(Pending(std::sync::Mutex::new(work))),
        }
    }

    /// A handle whose operation is `complete`, run once by [`Work::wait`] with the waiting
    /// rank's device; dropping the handle drops the closure without running it. The shorthand
    /// of [`Work::pending`] for transports whose completion is one call (e.g. waiting on a
    /// request, then copying a received buffer into the output view).
    pub fn from_fn<F>(complete: F) -> Work
    where
        F: FnOnce(&mut Device) -> Result<()> + Send + 'static,
    {
        Work::pending(FnWork(complete))
    }

    /// Completes the launch on this rank: afterwards every op on `dev` (which must be the
    /// device the launch was started with) sees the outputs. In-process, this blocks until the
    /// outputs are written; with NCCL it makes the device's stream wait for the launch and
    /// returns at once (the host blocks only where it reads results back). A handle from
    /// [`Work::pending`] or [`Work::from_fn`] runs its completion and returns its result.
    ///
    /// Errors: [`CommError::Mismatch`] or [`CommError::Peer`] if the ranks disagree,
    /// [`CommError::Timeout`], [`CommError::Aborted`], or [`CommError::Device`] if an output
    /// view cannot be written (it was freed meanwhile).
    pub fn wait(self, dev: &mut Device) -> Result<()> {
        match self.inner {
            WorkInner::Completed => Ok(()),
            WorkInner::Local(w) => w.wait(dev),
            #[cfg(feature = "cuda")]
            WorkInner::Nccl(w) => w.wait(dev),
            WorkInner::Pending(Pending(w)) => w
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .wait(dev),
        }
    }
}

/// Calls and bytes of one collective kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OpStats {
    /// Operations launched (each op of a coalesced launch counts).
    pub calls: u64,
    /// Algorithm bytes of those operations (see [`CommStats`]).
    pub bytes: u64,
}

/// What a communicator launched, per collective kind.
///
/// Bytes are "algorithm bytes" as NCCL's tests count them, per rank: all-gather counts the
/// output bytes, reduce-scatter the input bytes, all-reduce and broadcast the buffer bytes. They
/// are counted when a launch passes this rank's argument checks, whether or not it later fails.
/// Sub-groups made by `split` count separately.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    /// All-gathers.
    pub all_gather: OpStats,
    /// Reduce-scatters.
    pub reduce_scatter: OpStats,
    /// All-reduces.
    pub all_reduce: OpStats,
    /// Broadcasts.
    pub broadcast: OpStats,
    /// Barriers.
    pub barriers: u64,
    /// Launches (`start_*` calls; a coalesced launch counts once).
    pub launches: u64,
}

impl CommStats {
    /// The counters of one kind.
    pub fn get(&self, kind: OpKind) -> OpStats {
        match kind {
            OpKind::AllGather => self.all_gather,
            OpKind::ReduceScatter => self.reduce_scatter,
            OpKind::AllReduce => self.all_reduce,
            OpKind::Broadcast => self.broadcast,
        }
    }

    fn get_mut(&mut self, kind: OpKind) -> &mut OpStats {
        match kind {
            OpKind::AllGather => &mut self.all_gather,
            OpKind::ReduceScatter => &mut self.reduce_scatter,
            OpKind::AllReduce => &mut self.all_reduce,
            OpKind::Broadcast => &mut self.broadcast,
        }
    }

    /// Counts one launch of `ops`.
    pub(crate) fn record(&mut self, ops: &[Op]) {
        self.launches += 1;
        for op in ops {
            let s = self.get_mut(op.kind());
            s.calls += 1;
            s.bytes += op.algorithm_bytes() as u64;
        }
    }

    /// Bytes of all kinds.
    pub fn total_bytes(&self) -> u64 {
        self.all_gather.bytes
            + self.reduce_scatter.bytes
            + self.all_reduce.bytes
            + self.broadcast.bytes
    }

    /// Adds `other`'s counters (e.g. to total a rank's world and sub-group communicators).
    pub fn merge(&mut self, other: &CommStats) {
        for kind in [
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::AllReduce,
            OpKind::Broadcast,
        ] {
            let o = other.get(kind);
            let s = self.get_mut(kind);
            s.calls += o.calls;
            s.bytes += o.bytes;
        }
        self.barriers += other.barriers;
        self.launches += other.launches;
    }
}

impl fmt::Display for CommStats {
    /// One line: `all_gather 12 x 48.0 MiB, reduce_scatter …, 3 barriers, 30 launches`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for kind in [
            OpKind::AllGather,
            OpKind::ReduceScatter,
            OpKind::AllReduce,
            OpKind::Broadcast,
        ] {
            let s = self.get(kind);
            write!(
                f,
                "{kind} {} x {:.1} MiB, ",
                s.calls,
                s.bytes as f64 / (1024.0 * 1024.0)
            )?;
        }
        write!(f, "{} barriers, {} launches", self.barriers, self.launches)
    }
}
