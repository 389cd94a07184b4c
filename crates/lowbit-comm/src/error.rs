//! Errors of collectives and of the rank-thread helper.

use std::fmt::Write as _;
use std::time::Duration;

use lowbit_device::{DType, DeviceError};

/// Errors of collective operations.
///
/// Every variant names the operation (`op`: its kind and the communicator's collective sequence
/// number, e.g. `"all_gather #3"`, or its position in a coalesced launch) and the ranks involved.
/// Unless a variant says otherwise, ranks are ranks *of the communicator's group* (which differ
/// from world ranks in sub-groups made by `split`).
#[derive(Debug, thiserror::Error, PartialEq)]
#[non_exhaustive]
pub enum CommError {
    /// Peers did not join the operation within the group's timeout. The group is aborted, so
    /// later operations fail at once instead of waiting again.
    #[error("{op}: rank {rank} timed out after {waited:?} waiting for rank(s) {missing:?}")]
    Timeout {
        /// The operation.
        op: String,
        /// The rank that waited.
        rank: usize,
        /// How long it waited.
        waited: Duration,
        /// The ranks that had not joined.
        missing: Vec<usize>,
    },
    /// The group was aborted: a rank timed out or called `abort` (a rank that panicked or left
    /// is [`CommError::PeerLost`]). Every later operation of every
    /// communicator of the same world fails with this error.
    #[error("{op}: rank {rank}: the group was aborted by world rank {by_rank}: {reason}")]
    Aborted {
        /// The operation that failed.
        op: String,
        /// The rank that observed the abort.
        rank: usize,
        /// The *world* rank (index given by `run_ranks` / `LocalComm::create_group`) that aborted.
        by_rank: usize,
        /// Why.
        reason: String,
    },
    /// A peer rank is gone: in-process, its thread panicked or dropped its communicator without
    /// joining an operation the others wait in; across processes (NCCL), the liveness channel
    /// lost it (its connection closed or went silent, or it left on a signal; see
    /// [`crate::liveness`]). The world is aborted: every later operation fails with this error.
    #[error("{op}: rank {rank}: world rank {lost} was lost: {cause}")]
    PeerLost {
        /// The operation that failed.
        op: String,
        /// The rank that observed the loss.
        rank: usize,
        /// The *world* rank that was lost.
        lost: usize,
        /// How it was lost.
        cause: String,
    },
    /// The ranks called different operations, or the same operation with different arguments
    /// (element count, dtype, reduction, root, number of ops in a coalesced launch). Reported on
    /// every rank.
    #[error("{op}: ranks disagree on the {what}: {}", per_rank(.values))]
    Mismatch {
        /// The operation (as this rank called it).
        op: String,
        /// What differs.
        what: &'static str,
        /// Each rank's value, indexed by rank.
        values: Vec<String>,
    },
    /// A view has the wrong number of elements for the operation.
    #[error("{op}: rank {rank}: {what} has {got} elements, expected {expected}")]
    Size {
        /// The operation.
        op: String,
        /// The rank whose argument is wrong.
        rank: usize,
        /// Which view, and the rule it breaks.
        what: String,
        /// Required element count.
        expected: usize,
        /// Actual element count.
        got: usize,
    },
    /// A view has a dtype the operation does not accept.
    #[error("{op}: rank {rank}: {what}: expected {expected}, got {got:?}")]
    DType {
        /// The operation.
        op: String,
        /// The rank whose argument is wrong.
        rank: usize,
        /// Which view.
        what: String,
        /// What is accepted.
        expected: String,
        /// What was given.
        got: DType,
    },
    /// Views overlap where the operation forbids it.
    #[error("{op}: rank {rank}: {detail}")]
    Overlap {
        /// The operation.
        op: String,
        /// The rank whose arguments overlap.
        rank: usize,
        /// Which views, and the form that is allowed.
        detail: String,
    },
    /// A broadcast root outside the group.
    #[error("{op}: rank {rank}: root {root} is not a rank of this group of {size}")]
    Root {
        /// The operation.
        op: String,
        /// The rank that passed it.
        rank: usize,
        /// The root given.
        root: usize,
        /// Group size.
        size: usize,
    },
    /// Another rank's arguments for this operation were rejected on that rank; this rank fails
    /// too instead of waiting for a contribution that will never come.
    #[error("{op}: rank {rank}: rank {peer} rejected its arguments: {error}")]
    Peer {
        /// The operation.
        op: String,
        /// The rank reporting.
        rank: usize,
        /// The rank whose arguments were rejected (lowest one if several).
        peer: usize,
        /// That rank's error.
        error: String,
    },
    /// An NCCL or CUDA call failed (NCCL builds only): the library is missing or too old, too
    /// few GPUs, a communicator could not be created, or NCCL reported an error. The
    /// communicator is aborted; later operations fail with this error.
    #[error("{op}: rank {rank}: NCCL: {detail}")]
    Nccl {
        /// The operation (`init` for setup).
        op: String,
        /// The rank.
        rank: usize,
        /// NCCL's or CUDA's message.
        detail: String,
    },
    /// A rank thread of a multi-rank helper panicked or could not start its device or
    /// communicator.
    #[error(transparent)]
    Rank(#[from] RankError),
    /// The multi-process rendezvous failed (see [`crate::rendezvous`]).
    #[error(transparent)]
    Rendezvous(#[from] crate::rendezvous::RendezvousError),
    /// A device error while reading an input or writing an output.
    #[error("{op}: rank {rank}: {source}")]
    Device {
        /// The operation.
        op: String,
        /// The rank.
        rank: usize,
        /// The device error (boxed: it is large and rare).
        #[source]
        source: Box<DeviceError>,
    },
}

fn per_rank(values: &[String]) -> String {
    let mut s = String::new();
    for (r, v) in values.iter().enumerate() {
        if r > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "rank {r}: {v}");
    }
    s
}

/// Result of collective operations.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// A rank thread of `run_ranks` that panicked (or could not be started).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("rank {rank} panicked: {message}")]
pub struct RankError {
    /// The world rank.
    pub rank: usize,
    /// The panic message (or why the thread could not start).
    pub message: String,
}
