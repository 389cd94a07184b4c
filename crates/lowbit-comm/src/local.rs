//! The in-process implementation: ranks are threads of one process, each with its own
//! [`Device`]; the group's shared state is one mutex and one condition variable per world.
//!
//! A launch posts, under the mutex, this rank's argument descriptions and input snapshots into a
//! slot keyed by (group, sequence number). A wait sleeps on the condition variable until every
//! rank of the group has posted to that slot (or the group is aborted, a missing rank has dropped
//! its communicator, or the timeout passes), checks agreement, and computes this rank's output
//! from the snapshots outside the mutex. The last rank to release a slot removes it.

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use lowbit_device::{DType, Device};

use crate::op::{self, OpDesc};
use crate::pool::Pool;
use crate::reduce::{reduce_blocks, reduce_into};
use crate::{CommError, CommStats, Communicator, Op, RankError, ReduceOp, Result, Work, WorkInner};

/// Settings of an in-process group (inherited by groups split from it).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct GroupConfig {
    /// How long a rank waits for its peers to join an operation before failing with
    /// [`CommError::Timeout`] (and aborting the world). Default 60 s.
    pub timeout: Duration,
    /// Most bytes of host memory the world keeps for reuse by input snapshots once collectives
    /// finish (a caching allocator: fresh memory page-faults on first touch, which costs more
    /// than the copy). Default 1 GiB; 0 disables reuse.
    pub pool_bytes: usize,
}

impl Default for GroupConfig {
    fn default() -> Self {
        GroupConfig {
            timeout: Duration::from_secs(60),
            pool_bytes: 1 << 30,
        }
    }
}

impl GroupConfig {
    /// This configuration with another timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// This configuration with another snapshot pool limit.
    pub fn with_pool_bytes(mut self, bytes: usize) -> Self {
        self.pool_bytes = bytes;
        self
    }
}

/// State shared by every communicator of one world (the root group and its splits).
struct Shared {
    config: GroupConfig,
    pool: Pool,
    state: Mutex<State>,
    cv: Condvar,
}

struct State {
    abort: Option<Abort>,
    groups: Vec<GroupState>,
}

#[derive(Clone)]
struct Abort {
    /// World rank.
    by_rank: usize,
    reason: String,
    /// `(group, seq)` of the operation whose wait timed out, if that is the cause: ranks waiting
    /// in the same operation report [`CommError::Timeout`] too.
    timed_out: Option<(usize, u64)>,
}

struct GroupState {
    /// World rank of each group rank.
    members: Vec<usize>,
    /// Group ranks whose communicator was dropped.
    departed: Vec<bool>,
    slots: HashMap<u64, Slot>,
}

/// One collective of one group: what each rank posted, and shared results.
struct Slot {
    posts: Vec<Option<Post>>,
    /// Ranks that have not released the slot yet.
    unreleased: usize,
    /// All-reduce results, per op index, per chunk.
    chunks: HashMap<usize, Vec<Chunk>>,
    /// Split result per old rank: (group index, new rank, new size).
    split: Option<Vec<(usize, usize, usize)>>,
}

enum Post {
    /// This rank's arguments were rejected; the message is passed on to the peers.
    Invalid(String),
    Launch(Vec<Posted>),
    Barrier,
    Split {
        color: u32,
        key: u32,
    },
}

struct Posted {
    desc: OpDesc,
    /// Input snapshot (absent for broadcast on non-root ranks).
    data: Option<Arc<Vec<u8>>>,
}

enum Chunk {
    Todo,
    /// Being computed by this group rank.
    Busy(usize),
    Done(Arc<Vec<u8>>),
}

/// Who waits, in what.
struct Ctx<'a> {
    group: usize,
    seq: u64,
    rank: usize,
    world_rank: usize,
    label: &'a str,
}

type Guard<'a> = MutexGuard<'a, State>;

impl Shared {
    fn lock(&self) -> Guard<'_> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the first abort of the world and wakes every waiter.
    fn abort(&self, st: &mut State, abort: Abort) {
        if st.abort.is_none() {
            st.abort = Some(abort);
        }
        self.cv.notify_all();
    }

    fn post(&self, st: &mut State, ctx: &Ctx<'_>, post: Post) {
        let g = &mut st.groups[ctx.group];
        let size = g.members.len();
        g.slots
            .entry(ctx.seq)
            .or_insert_with(|| Slot {
                posts: (0..size).map(|_| None).collect(),
                unreleased: size,
                chunks: HashMap::new(),
                split: None,
            })
            .posts[ctx.rank] = Some(post);
        self.cv.notify_all();
    }

    /// Records that a rank is done with a slot; returns the slot when it was the last, for
    /// [`Shared::recycle`] after the mutex is released.
    #[must_use]
    fn release(st: &mut State, group: usize, seq: u64) -> Option<Slot> {
        let slots = &mut st.groups[group].slots;
        let slot = slots.get_mut(&seq)?;
        slot.unreleased -= 1;
        if slot.unreleased == 0 {
            slots.remove(&seq)
        } else {
            None
        }
    }

    /// Returns a finished slot's buffers to the pool.
    fn recycle(&self, slot: Option<Slot>) {
        let Some(slot) = slot else { return };
        let posted = slot.posts.into_iter().flatten().flat_map(|p| match p {
            Post::Launch(ops) => ops.into_iter().filter_map(|o| o.data).collect(),
            _ => Vec::new(),
        });
        let chunks = slot.chunks.into_values().flatten().filter_map(|c| match c {
            Chunk::Done(bytes) => Some(bytes),
            _ => None,
        });
        for arc in posted.chain(chunks) {
            if let Ok(buf) = Arc::try_unwrap(arc) {
                self.pool.give(buf);
            }
        }
    }

    fn aborted_error(abort: &Abort, ctx: &Ctx<'_>) -> CommError {
        CommError::Aborted {
            op: ctx.label.to_string(),
            rank: ctx.rank,
            by_rank: abort.by_rank,
            reason: abort.reason.clone(),
        }
    }

    /// Fails if the world is aborted.
    fn check_abort(st: &State, ctx: &Ctx<'_>) -> Result<()> {
        match &st.abort {
            Some(a) => Err(Self::aborted_error(a, ctx)),
            None => Ok(()),
        }
    }

    /// Sleeps until `pending` returns no ranks to wait for. `pending` returns the group ranks
    /// being waited on; with `departure_fails`, one of them having dropped its communicator is an
    /// abort. Gives the guard back in every case.
    fn wait_for<'a>(
        &'a self,
        mut st: Guard<'a>,
        ctx: &Ctx<'_>,
        departure_fails: bool,
        mut pending: impl FnMut(&mut State) -> Vec<usize>,
    ) -> (Guard<'a>, Result<()>) {
        let start = Instant::now();
        let deadline = start + self.config.timeout;
        loop {
            // What every rank has joined completes even if the world was aborted meanwhile, so
            // an abort never fails an operation retroactively (and results do not depend on
            // how the abort raced with the wake-up).
            let missing = pending(&mut st);
            if missing.is_empty() {
                return (st, Ok(()));
            }
            if let Some(a) = &st.abort {
                let err = if a.timed_out == Some((ctx.group, ctx.seq)) {
                    CommError::Timeout {
                        op: ctx.label.to_string(),
                        rank: ctx.rank,
                        waited: start.elapsed(),
                        missing,
                    }
                } else {
                    Self::aborted_error(a, ctx)
                };
                return (st, Err(err));
            }
            let g = &st.groups[ctx.group];
            if departure_fails && let Some(&q) = missing.iter().find(|&&q| g.departed[q]) {
                let by_rank = g.members[q];
                let reason = format!(
                    "rank {q} of the group (world rank {by_rank}) dropped its communicator \
                     without joining {}",
                    ctx.label
                );
                let abort = Abort {
                    by_rank,
                    reason,
                    timed_out: None,
                };
                let err = Self::aborted_error(&abort, ctx);
                self.abort(&mut st, abort);
                return (st, Err(err));
            }
            let now = Instant::now();
            if now >= deadline {
                let waited = now - start;
                let abort = Abort {
                    by_rank: ctx.world_rank,
                    reason: format!(
                        "rank {} (world rank {}) timed out after {waited:?} in {} waiting for \
                         rank(s) {missing:?} of its group",
                        ctx.rank, ctx.world_rank, ctx.label
                    ),
                    timed_out: Some((ctx.group, ctx.seq)),
                };
                self.abort(&mut st, abort);
                return (
                    st,
                    Err(CommError::Timeout {
                        op: ctx.label.to_string(),
                        rank: ctx.rank,
                        waited,
                        missing,
                    }),
                );
            }
            st = self
                .cv
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// Waits until every rank posted to the slot of `ctx`.
    fn wait_posts<'a>(&'a self, st: Guard<'a>, ctx: &Ctx<'_>) -> (Guard<'a>, Result<()>) {
        self.wait_for(st, ctx, true, |st| {
            st.groups[ctx.group]
                .slots
                .get(&ctx.seq)
                .map(|s| {
                    s.posts
                        .iter()
                        .enumerate()
                        .filter(|(_, p)| p.is_none())
                        .map(|(q, _)| q)
                        .collect()
                })
                .unwrap_or_default()
        })
    }
}

/// The posts of a complete slot.
fn posts<'a>(st: &'a State, ctx: &Ctx<'_>) -> Vec<&'a Post> {
    st.groups[ctx.group].slots[&ctx.seq]
        .posts
        .iter()
        .map(|p| p.as_ref().expect("every rank has posted"))
        .collect()
}

/// Fails if a rank's arguments were rejected or the ranks posted different kinds of operation.
fn agree_on_kind(posts: &[&Post], ctx: &Ctx<'_>) -> Result<()> {
    for (q, p) in posts.iter().enumerate() {
        if let Post::Invalid(error) = p {
            return Err(CommError::Peer {
                op: ctx.label.to_string(),
                rank: ctx.rank,
                peer: q,
                error: error.clone(),
            });
        }
    }
    let describe = |p: &Post| match p {
        Post::Invalid(_) => "invalid".to_string(),
        Post::Launch(ops) => op::describe_kinds(&ops.iter().map(|o| o.desc).collect::<Vec<_>>()),
        Post::Barrier => "barrier".to_string(),
        Post::Split { .. } => "split".to_string(),
    };
    let same = posts
        .iter()
        .all(|p| std::mem::discriminant(*p) == std::mem::discriminant(posts[0]));
    if same {
        Ok(())
    } else {
        Err(CommError::Mismatch {
            op: ctx.label.to_string(),
            what: "operation",
            values: posts.iter().map(|p| describe(p)).collect(),
        })
    }
}

/// One rank's communicator of an in-process group. Create a group with [`run_ranks`] (which
/// also spawns the rank threads) or [`LocalComm::create_group`].
///
/// Dropping it while the thread panics aborts the world; dropping it otherwise makes peers that
/// wait for an operation this rank never joined fail at once with [`CommError::Aborted`].
pub struct LocalComm {
    shared: Arc<Shared>,
    group: usize,
    rank: usize,
    size: usize,
    world_rank: usize,
    next_seq: u64,
    stats: CommStats,
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("group", &self.group)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("world_rank", &self.world_rank)
            .field("next_seq", &self.next_seq)
            .finish_non_exhaustive()
    }
}

impl LocalComm {
    /// The communicators of a new world of `world` ranks, in rank order; move each to its own
    /// thread.
    pub fn create_group(world: usize, config: GroupConfig) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            pool: Pool::new(config.pool_bytes),
            config,
            state: Mutex::new(State {
                abort: None,
                groups: vec![GroupState {
                    members: (0..world).collect(),
                    departed: vec![false; world],
                    slots: HashMap::new(),
                }],
            }),
            cv: Condvar::new(),
        });
        (0..world)
            .map(|rank| LocalComm {
                shared: Arc::clone(&shared),
                group: 0,
                rank,
                size: world,
                world_rank: rank,
                next_seq: 0,
                stats: CommStats::default(),
            })
            .collect()
    }

    /// This rank's index in the world the group was split from (equal to `rank()` in the
    /// world's own group).
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// The group's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.shared.config
    }

    /// [`Communicator::split`] returning the concrete type.
    pub fn split_local(&mut self, color: u32, key: u32) -> Result<LocalComm> {
        let seq = self.take_seq();
        let label = format!("split #{seq}");
        let ctx = self.ctx(seq, &label);
        let shared = Arc::clone(&self.shared);
        let mut st = shared.lock();
        Shared::check_abort(&st, &ctx)?;
        shared.post(&mut st, &ctx, Post::Split { color, key });
        let (mut st, waited) = shared.wait_posts(st, &ctx);
        let result = waited
            .and_then(|()| agree_on_kind(&posts(&st, &ctx), &ctx))
            .map(|()| Self::split_assignment(&mut st, &ctx));
        let freed = Shared::release(&mut st, ctx.group, ctx.seq);
        drop(st);
        shared.recycle(freed);
        let (group, rank, size) = result?;
        Ok(LocalComm {
            shared,
            group,
            rank,
            size,
            world_rank: self.world_rank,
            next_seq: 0,
            stats: CommStats::default(),
        })
    }

    /// This rank's (group, rank, size) after a split whose slot is complete; the first rank
    /// to get here creates the groups.
    fn split_assignment(st: &mut State, ctx: &Ctx<'_>) -> (usize, usize, usize) {
        let slot = &st.groups[ctx.group].slots[&ctx.seq];
        if let Some(split) = &slot.split {
            return split[ctx.rank];
        }
        let mut entries: Vec<(u32, u32, usize)> = slot
            .posts
            .iter()
            .enumerate()
            .map(|(q, p)| match p {
                Some(Post::Split { color, key }) => (*color, *key, q),
                _ => unreachable!("agreement checked: every post is a split"),
            })
            .collect();
        entries.sort_unstable();
        let old_members = st.groups[ctx.group].members.clone();
        let mut assignment = vec![(0, 0, 0); old_members.len()];
        for same_color in entries.chunk_by(|a, b| a.0 == b.0) {
            let index = st.groups.len();
            st.groups.push(GroupState {
                members: same_color.iter().map(|e| old_members[e.2]).collect(),
                departed: vec![false; same_color.len()],
                slots: HashMap::new(),
            });
            for (new_rank, e) in same_color.iter().enumerate() {
                assignment[e.2] = (index, new_rank, same_color.len());
            }
        }
        let mine = assignment[ctx.rank];
        let slot = st.groups[ctx.group]
            .slots
            .get_mut(&ctx.seq)
            .expect("slot lives until released");
        slot.split = Some(assignment);
        mine
    }

    fn take_seq(&mut self) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        seq
    }

    fn ctx<'a>(&self, seq: u64, label: &'a str) -> Ctx<'a> {
        Ctx {
            group: self.group,
            seq,
            rank: self.rank,
            world_rank: self.world_rank,
            label,
        }
    }

    /// Checks a launch on this rank and snapshots its inputs.
    fn prepare(
        &self,
        dev: &Device,
        ops: &[Op],
        launch: &str,
        op_labels: &[String],
    ) -> Result<Vec<Posted>> {
        let descs = op::check_launch(ops, self.rank, self.size, launch, op_labels)?;
        let mut posted = Vec::with_capacity(ops.len());
        for ((op, desc), label) in ops.iter().zip(descs).zip(op_labels) {
            let device = |source| CommError::Device {
                op: label.clone(),
                rank: self.rank,
                source: Box::new(source),
            };
            let (input, output) = match *op {
                Op::AllGather { input, output } | Op::ReduceScatter { input, output, .. } => {
                    (Some(input), output)
                }
                Op::AllReduce { buf, .. } => (Some(buf), buf),
                Op::Broadcast { buf, root } => ((root == self.rank).then_some(buf), buf),
            };
            // Reading the last element checks that the output exists and is in bounds, so a
            // bad output is rejected here (and reported to the peers) rather than after the
            // exchange.
            if !output.is_empty() {
                let last = output
                    .slice(output.len() - 1..output.len())
                    .map_err(device)?;
                dev.read_bytes(last).map_err(device)?;
            }
            let data = match input {
                Some(v) => Some(Arc::new(self.shared.pool.snapshot(dev, v).map_err(device)?)),
                None => None,
            };
            posted.push(Posted { desc, data });
        }
        Ok(posted)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if std::thread::panicking() {
            let abort = Abort {
                by_rank: self.world_rank,
                reason: format!("rank {} panicked", self.world_rank),
                timed_out: None,
            };
            self.shared.abort(&mut st, abort);
        } else {
            st.groups[self.group].departed[self.rank] = true;
            self.shared.cv.notify_all();
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work> {
        let seq = self.take_seq();
        let (launch, op_labels) = op::labels(seq, ops);
        let ctx = self.ctx(seq, &launch);
        Shared::check_abort(&self.shared.lock(), &ctx)?;
        let prepared = self.prepare(dev, ops, &launch, &op_labels);
        let mut st = self.shared.lock();
        match prepared {
            Ok(posted) => {
                self.shared.post(&mut st, &ctx, Post::Launch(posted));
                self.stats.record(ops);
                Ok(Work {
                    inner: WorkInner::Local(LocalWork {
                        shared: Arc::clone(&self.shared),
                        group: self.group,
                        rank: self.rank,
                        size: self.size,
                        world_rank: self.world_rank,
                        seq,
                        launch,
                        op_labels,
                        ops: ops.to_vec(),
                    }),
                })
            }
            Err(e) => {
                self.shared
                    .post(&mut st, &ctx, Post::Invalid(e.to_string()));
                let freed = Shared::release(&mut st, ctx.group, ctx.seq);
                drop(st);
                self.shared.recycle(freed);
                Err(e)
            }
        }
    }

    fn barrier(&mut self) -> Result<()> {
        let seq = self.take_seq();
        let label = format!("barrier #{seq}");
        let ctx = self.ctx(seq, &label);
        let mut st = self.shared.lock();
        Shared::check_abort(&st, &ctx)?;
        self.shared.post(&mut st, &ctx, Post::Barrier);
        self.stats.barriers += 1;
        let (mut st, waited) = self.shared.wait_posts(st, &ctx);
        let result = waited.and_then(|()| agree_on_kind(&posts(&st, &ctx), &ctx));
        let freed = Shared::release(&mut st, ctx.group, ctx.seq);
        drop(st);
        self.shared.recycle(freed);
        result
    }

    fn split(&mut self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_local(color, key)?))
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort(&mut self, reason: &str) {
        let mut st = self.shared.lock();
        let abort = Abort {
            by_rank: self.world_rank,
            reason: reason.to_string(),
            timed_out: None,
        };
        self.shared.abort(&mut st, abort);
    }
}

/// An in-process launch in flight.
pub(crate) struct LocalWork {
    shared: Arc<Shared>,
    group: usize,
    rank: usize,
    size: usize,
    world_rank: usize,
    seq: u64,
    launch: String,
    op_labels: Vec<String>,
    ops: Vec<Op>,
}

impl fmt::Debug for LocalWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalWork")
            .field("launch", &self.launch)
            .field("rank", &self.rank)
            .field("group", &self.group)
            .finish_non_exhaustive()
    }
}

/// Element range of chunk `c` of `k` over `n` elements.
fn chunk_range(n: usize, k: usize, c: usize) -> Range<usize> {
    c * n / k..(c + 1) * n / k
}

impl LocalWork {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            group: self.group,
            seq: self.seq,
            rank: self.rank,
            world_rank: self.world_rank,
            label: &self.launch,
        }
    }

    /// Completes the launch; the slot is released by `Drop`.
    pub(crate) fn wait(self, dev: &mut Device) -> Result<()> {
        let ctx = self.ctx();
        let st = self.shared.lock();
        let (st, waited) = self.shared.wait_posts(st, &ctx);
        waited?;
        let all = posts(&st, &ctx);
        agree_on_kind(&all, &ctx)?;
        let launches: Vec<&[Posted]> = all
            .iter()
            .map(|p| match p {
                Post::Launch(ops) => ops.as_slice(),
                _ => unreachable!("agreement checked: every post is a launch"),
            })
            .collect();
        let descs: Vec<Vec<OpDesc>> = launches
            .iter()
            .map(|l| l.iter().map(|p| p.desc).collect())
            .collect();
        let desc_refs: Vec<&[OpDesc]> = descs.iter().map(Vec::as_slice).collect();
        op::check_agreement(&desc_refs, &self.launch, &self.op_labels)?;
        // data[i][q]: rank q's snapshot for op i.
        let data: Vec<Vec<Option<Arc<Vec<u8>>>>> = (0..self.ops.len())
            .map(|i| launches.iter().map(|l| l[i].data.clone()).collect())
            .collect();
        drop(st);

        for (i, op) in self.ops.iter().enumerate() {
            let label = &self.op_labels[i];
            let device = |source| CommError::Device {
                op: label.clone(),
                rank: self.rank,
                source: Box::new(source),
            };
            let snapshots = || -> Vec<&[u8]> {
                data[i]
                    .iter()
                    .map(|d| d.as_deref().map_or(&[][..], Vec::as_slice))
                    .collect()
            };
            match *op {
                Op::AllGather { input, output } => {
                    let n = input.len();
                    for (q, bytes) in snapshots().into_iter().enumerate() {
                        let dst = output.slice(q * n..(q + 1) * n).map_err(device)?;
                        if q == self.rank && dst == input {
                            continue; // in place: already there
                        }
                        dev.write_bytes(dst, bytes).map_err(device)?;
                    }
                }
                Op::ReduceScatter {
                    output, reduce: r, ..
                } => {
                    let nb = output.byte_len();
                    let at = self.rank * nb..(self.rank + 1) * nb;
                    let parts: Vec<&[u8]> = snapshots().iter().map(|s| &s[at.clone()]).collect();
                    reduce_blocks(output.dtype(), r, &parts, self.size, |at, block| {
                        let len = block.len() / output.dtype().size();
                        dev.write_bytes(output.slice(at..at + len)?, block)
                    })
                    .map_err(device)?;
                }
                Op::AllReduce { buf, reduce: r } => {
                    let chunks = self.all_reduce_chunks(i, buf.len(), buf.dtype(), r, &data[i])?;
                    for (c, bytes) in chunks.iter().enumerate() {
                        let dst = buf
                            .slice(chunk_range(buf.len(), self.size, c))
                            .map_err(device)?;
                        dev.write_bytes(dst, bytes).map_err(device)?;
                    }
                }
                Op::Broadcast { buf, root } => {
                    if root != self.rank {
                        dev.write_bytes(buf, snapshots()[root]).map_err(device)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The all-reduce result of op `i`, as `size` chunks. The ranks share the work: each claims
    /// chunks not yet claimed (its own index first), computes them outside the mutex, and
    /// publishes them; the result of a chunk does not depend on who computes it.
    fn all_reduce_chunks(
        &self,
        i: usize,
        n: usize,
        dtype: DType,
        r: ReduceOp,
        data: &[Option<Arc<Vec<u8>>>],
    ) -> Result<Vec<Arc<Vec<u8>>>> {
        let ctx = self.ctx();
        let k = self.size;
        let es = dtype.size();
        loop {
            let st = self.shared.lock();
            let (mut st, waited) = self.shared.wait_for(st, &ctx, false, |st| {
                let chunks = Self::chunks(st, &ctx, i, k);
                let claimable = chunks.iter().any(|c| matches!(c, Chunk::Todo));
                if claimable || chunks.iter().all(|c| matches!(c, Chunk::Done(_))) {
                    Vec::new()
                } else {
                    chunks
                        .iter()
                        .filter_map(|c| match c {
                            Chunk::Busy(q) => Some(*q),
                            _ => None,
                        })
                        .collect()
                }
            });
            waited?;
            let chunks = Self::chunks(&mut st, &ctx, i, k);
            let todo = (0..k)
                .map(|j| (self.rank + j) % k)
                .find(|&c| matches!(chunks[c], Chunk::Todo));
            let Some(c) = todo else {
                if chunks.iter().all(|c| matches!(c, Chunk::Done(_))) {
                    return Ok(chunks
                        .iter()
                        .map(|c| match c {
                            Chunk::Done(bytes) => Arc::clone(bytes),
                            _ => unreachable!("all chunks are done"),
                        })
                        .collect());
                }
                unreachable!("wait_for returns when a chunk is claimable or all are done");
            };
            chunks[c] = Chunk::Busy(self.rank);
            drop(st);
            let range = chunk_range(n, k, c);
            let bytes = range.start * es..range.end * es;
            let parts: Vec<&[u8]> = data
                .iter()
                .map(|d| &d.as_deref().expect("all-reduce inputs are posted")[bytes.clone()])
                .collect();
            let mut out = self.shared.pool.take(bytes.len());
            reduce_into(dtype, r, &parts, k, &mut out);
            let out = Arc::new(out);
            let mut st = self.shared.lock();
            Self::chunks(&mut st, &ctx, i, k)[c] = Chunk::Done(out);
            self.shared.cv.notify_all();
        }
    }

    fn chunks<'s>(st: &'s mut State, ctx: &Ctx<'_>, i: usize, k: usize) -> &'s mut Vec<Chunk> {
        st.groups[ctx.group]
            .slots
            .get_mut(&ctx.seq)
            .expect("slot lives until released")
            .chunks
            .entry(i)
            .or_insert_with(|| (0..k).map(|_| Chunk::Todo).collect())
    }
}

impl Drop for LocalWork {
    fn drop(&mut self) {
        let mut st = self.shared.lock();
        if std::thread::panicking() {
            let abort = Abort {
                by_rank: self.world_rank,
                reason: format!("rank {} panicked", self.world_rank),
                timed_out: None,
            };
            self.shared.abort(&mut st, abort);
        }
        let freed = Shared::release(&mut st, self.group, self.seq);
        self.shared.cv.notify_all();
        drop(st);
        self.shared.recycle(freed);
    }
}

pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

/// Runs `f` on `world` rank threads (named `rank-<r>`), each with its communicator of a new
/// world and a fresh [`Device::cpu`], and returns each rank's result in rank order. A panic is
/// caught and returned as that rank's [`RankError`]; its communicator's drop guard has aborted
/// the world by then, so the other ranks fail promptly instead of waiting for it.
///
/// `f` returning early (or with an error inside `T`) drops its communicator: peers that wait for
/// an operation it never joined fail with [`CommError::Aborted`].
pub fn run_ranks<T, F>(world: usize, config: GroupConfig, f: F) -> Vec<Result<T, RankError>>
where
    T: Send,
    F: Fn(LocalComm, Device) -> T + Sync,
{
    let comms = LocalComm::create_group(world, config);
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| {
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(s, move || {
                        catch_unwind(AssertUnwindSafe(|| f(comm, Device::cpu()))).map_err(|p| {
                            RankError {
                                rank,
                                message: panic_message(&*p),
                            }
                        })
                    })
            })
            .collect();
        join_ranks(handles)
    })
}

/// Joins rank threads in rank order: a thread that could not be spawned, or that panicked
/// outside its own `catch_unwind`, becomes that rank's [`RankError`].
pub(crate) fn join_ranks<T>(
    handles: Vec<std::io::Result<std::thread::ScopedJoinHandle<'_, Result<T, RankError>>>>,
) -> Vec<Result<T, RankError>> {
    handles
        .into_iter()
        .enumerate()
        .map(|(rank, h)| {
            let h = h.map_err(|e| RankError {
                rank,
                message: format!("could not spawn the rank thread: {e}"),
            })?;
            h.join().unwrap_or_else(|p| {
                Err(RankError {
                    rank,
                    message: panic_message(&*p),
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_cover_everything() {
        for n in 0..20 {
            for k in 1..6 {
                let mut next = 0;
                for c in 0..k {
                    let r = chunk_range(n, k, c);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn kinds_are_named() {
        use crate::OpKind;
        assert_eq!(OpKind::AllGather.to_string(), "all_gather");
    }
}
