//! The in-process implementation: ranks are threads of one process, each with its own
//! [`Device`]; the group's shared state is one mutex and one condition variable per world.
//!
//! A launch posts, under the mutex, this rank's argument descriptions and input snapshots into a
//! slot keyed by (group, sequence number). A wait sleeps on the condition variable until every
//! rank of the group has posted to that slot (or the group is aborted, a missing rank has dropped
//! its communicator, or the timeout passes), checks agreement, and computes this rank's output
//! from the snapshots outside the mutex. The last rank to release a slot removes it.
//!
//! This file holds the configuration, the communicator and its launches, and the rank threads of
//! [`run_ranks`]; `state` the shared state and the waits on it (where failures are detected),
//! `work` the completion of a launch.

use std::collections::HashMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use lowbit_device::Device;

use crate::op;
use crate::pool::Pool;
use crate::{CommError, CommStats, Communicator, Op, RankError, Result, Work, WorkInner};

mod state;
mod work;

use state::{Ctx, GroupState, Post, Posted, Shared, State, agree_on_kind, posts};
pub(crate) use work::LocalWork;

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

/// One rank's communicator of an in-process group. Create a group with [`run_ranks`] (which
/// also spawns the rank threads) or [`LocalComm::create_group`].
///
/// Dropping it while the thread panics aborts the world; dropping it otherwise makes peers that
/// wait for an operation this rank never joined fail at once with [`CommError::PeerLost`].
pub struct LocalComm {
    me: Member,
    next_seq: u64,
    stats: CommStats,
}

/// A rank's seat in a group: what its communicator and the launches it makes share.
#[derive(Clone)]
struct Member {
    shared: Arc<Shared>,
    group: usize,
    rank: usize,
    size: usize,
    world_rank: usize,
}

impl Member {
    /// This rank in operation `seq` of its group, labelled `label`.
    fn ctx<'a>(&self, seq: u64, label: &'a str) -> Ctx<'a> {
        Ctx {
            group: self.group,
            seq,
            rank: self.rank,
            world_rank: self.world_rank,
            label,
        }
    }
}

impl fmt::Debug for LocalComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalComm")
            .field("group", &self.me.group)
            .field("rank", &self.me.rank)
            .field("size", &self.me.size)
            .field("world_rank", &self.me.world_rank)
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
                me: Member {
                    shared: Arc::clone(&shared),
                    group: 0,
                    rank,
                    size: world,
                    world_rank: rank,
                },
                next_seq: 0,
                stats: CommStats::default(),
            })
            .collect()
    }

    /// This rank's index in the world the group was split from (equal to `rank()` in the
    /// world's own group).
    pub fn world_rank(&self) -> usize {
        self.me.world_rank
    }

    /// The group's configuration.
    pub fn config(&self) -> &GroupConfig {
        &self.me.shared.config
    }

    /// [`Communicator::split`] returning the concrete type.
    pub fn split_local(&mut self, color: u32, key: u32) -> Result<LocalComm> {
        let seq = self.take_seq();
        let label = format!("split #{seq}");
        let ctx = self.ctx(seq, &label);
        let shared = Arc::clone(&self.me.shared);
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
            me: Member {
                shared,
                group,
                rank,
                size,
                world_rank: self.me.world_rank,
            },
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
        self.me.ctx(seq, label)
    }

    /// Checks a launch on this rank and snapshots its inputs.
    fn prepare(
        &self,
        dev: &Device,
        ops: &[Op],
        launch: &str,
        op_labels: &[String],
    ) -> Result<Vec<Posted>> {
        let descs = op::check_launch(ops, self.me.rank, self.me.size, launch, op_labels)?;
        let mut posted = Vec::with_capacity(ops.len());
        for ((op, desc), label) in ops.iter().zip(descs).zip(op_labels) {
            let device = |source| CommError::Device {
                op: label.clone(),
                rank: self.me.rank,
                source: Box::new(source),
            };
            let (input, output) = match *op {
                Op::AllGather { input, output } | Op::ReduceScatter { input, output, .. } => {
                    (Some(input), output)
                }
                Op::AllReduce { buf, .. } => (Some(buf), buf),
                Op::Broadcast { buf, root } => ((root == self.me.rank).then_some(buf), buf),
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
                Some(v) => Some(Arc::new(
                    self.me.shared.pool.snapshot(dev, v).map_err(device)?,
                )),
                None => None,
            };
            posted.push(Posted { desc, data });
        }
        Ok(posted)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut st = self.me.shared.lock();
        if !self
            .me
            .shared
            .abort_if_panicking(&mut st, self.me.world_rank)
        {
            st.groups[self.me.group].departed[self.me.rank] = true;
            self.me.shared.cv.notify_all();
        }
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.me.rank
    }

    fn size(&self) -> usize {
        self.me.size
    }

    fn start_coalesced(&mut self, dev: &mut Device, ops: &[Op]) -> Result<Work> {
        let seq = self.take_seq();
        let (launch, op_labels) = op::labels(seq, ops);
        let ctx = self.ctx(seq, &launch);
        Shared::check_abort(&self.me.shared.lock(), &ctx)?;
        let prepared = self.prepare(dev, ops, &launch, &op_labels);
        let mut st = self.me.shared.lock();
        match prepared {
            Ok(posted) => {
                self.me.shared.post(&mut st, &ctx, Post::Launch(posted));
                self.stats.record(ops);
                Ok(Work {
                    inner: WorkInner::Local(self.work(seq, launch, op_labels, ops)),
                })
            }
            Err(e) => {
                self.me
                    .shared
                    .post(&mut st, &ctx, Post::Invalid(e.to_string()));
                let freed = Shared::release(&mut st, ctx.group, ctx.seq);
                drop(st);
                self.me.shared.recycle(freed);
                Err(e)
            }
        }
    }

    fn barrier(&mut self) -> Result<()> {
        let seq = self.take_seq();
        let label = format!("barrier #{seq}");
        let ctx = self.ctx(seq, &label);
        let mut st = self.me.shared.lock();
        Shared::check_abort(&st, &ctx)?;
        self.me.shared.post(&mut st, &ctx, Post::Barrier);
        self.stats.barriers += 1;
        let (mut st, waited) = self.me.shared.wait_posts(st, &ctx);
        let result = waited.and_then(|()| agree_on_kind(&posts(&st, &ctx), &ctx));
        let freed = Shared::release(&mut st, ctx.group, ctx.seq);
        drop(st);
        self.me.shared.recycle(freed);
        result
    }

    fn split(&mut self, color: u32, key: u32) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split_local(color, key)?))
    }

    fn stats(&self) -> CommStats {
        self.stats
    }

    fn abort(&mut self, reason: &str) {
        let mut st = self.me.shared.lock();
        self.me
            .shared
            .abort_by(&mut st, self.me.world_rank, reason.to_string());
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
/// an operation it never joined fail with [`CommError::PeerLost`].
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
    #[test]
    fn kinds_are_named() {
        use crate::OpKind;
        assert_eq!(OpKind::AllGather.to_string(), "all_gather");
    }
}
