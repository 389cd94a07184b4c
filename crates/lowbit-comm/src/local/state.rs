//! The state one in-process world shares: the slots ranks post their launches to, keyed by
//! (group, sequence number), under one mutex and condition variable, and the waits on them,
//! which fail (never hang) on a timeout, an abort or a peer that left.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use super::GroupConfig;
use crate::op::{self, OpDesc};
use crate::pool::Pool;
use crate::{CommError, Result};

/// State shared by every communicator of one world (the root group and its splits).
pub(super) struct Shared {
    pub(super) config: GroupConfig,
    pub(super) pool: Pool,
    pub(super) state: Mutex<State>,
    pub(super) cv: Condvar,
}

pub(super) struct State {
    pub(super) abort: Option<Abort>,
    pub(super) groups: Vec<GroupState>,
}

#[derive(Clone)]
pub(super) struct Abort {
    /// World rank.
    by_rank: usize,
    reason: String,
    /// `(group, seq)` of the operation whose wait timed out, if that is the cause: ranks waiting
    /// in the same operation report [`CommError::Timeout`] too.
    timed_out: Option<(usize, u64)>,
    /// `by_rank` is gone (panicked or left): [`CommError::PeerLost`] rather than `Aborted`.
    lost: bool,
}

pub(super) struct GroupState {
    /// World rank of each group rank.
    pub(super) members: Vec<usize>,
    /// Group ranks whose communicator was dropped.
    pub(super) departed: Vec<bool>,
    pub(super) slots: HashMap<u64, Slot>,
}

/// One collective of one group: what each rank posted, and shared results.
pub(super) struct Slot {
    pub(super) posts: Vec<Option<Post>>,
    /// Ranks that have not released the slot yet.
    unreleased: usize,
    /// All-reduce results, per op index, per chunk.
    pub(super) chunks: HashMap<usize, Vec<Chunk>>,
    /// Split result per old rank: (group index, new rank, new size).
    pub(super) split: Option<Vec<(usize, usize, usize)>>,
}

pub(super) enum Post {
    /// This rank's arguments were rejected; the message is passed on to the peers.
    Invalid(String),
    Launch(Vec<Posted>),
    Barrier,
    Split {
        color: u32,
        key: u32,
    },
}

pub(super) struct Posted {
    pub(super) desc: OpDesc,
    /// Input snapshot (absent for broadcast on non-root ranks).
    pub(super) data: Option<Arc<Vec<u8>>>,
}

pub(super) enum Chunk {
    Todo,
    /// Being computed by this group rank.
    Busy(usize),
    Done(Arc<Vec<u8>>),
}

/// Who waits, in what.
pub(super) struct Ctx<'a> {
    pub(super) group: usize,
    pub(super) seq: u64,
    pub(super) rank: usize,
    pub(super) world_rank: usize,
    pub(super) label: &'a str,
}

pub(super) type Guard<'a> = MutexGuard<'a, State>;

impl Shared {
    pub(super) fn lock(&self) -> Guard<'_> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the first abort of the world and wakes every waiter.
    fn abort(&self, st: &mut State, abort: Abort) {
        if st.abort.is_none() {
            st.abort = Some(abort);
        }
        self.cv.notify_all();
    }

    /// Aborts the world on behalf of world rank `by_rank`, for `reason`.
    pub(super) fn abort_by(&self, st: &mut State, by_rank: usize, reason: String) {
        let abort = Abort {
            by_rank,
            reason,
            timed_out: None,
            lost: false,
        };
        self.abort(st, abort);
    }

    /// The drop guard of world rank `world_rank`'s handles: if the thread is panicking, aborts
    /// the world (its peers then fail at once instead of waiting for it) and returns true.
    pub(super) fn abort_if_panicking(&self, st: &mut State, world_rank: usize) -> bool {
        let panicking = std::thread::panicking();
        if panicking {
            let abort = Abort {
                by_rank: world_rank,
                reason: "its thread panicked".into(),
                timed_out: None,
                lost: true,
            };
            self.abort(st, abort);
        }
        panicking
    }

    pub(super) fn post(&self, st: &mut State, ctx: &Ctx<'_>, post: Post) {
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
    pub(super) fn release(st: &mut State, group: usize, seq: u64) -> Option<Slot> {
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
    pub(super) fn recycle(&self, slot: Option<Slot>) {
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
        if abort.lost {
            return CommError::PeerLost {
                op: ctx.label.to_string(),
                rank: ctx.rank,
                lost: abort.by_rank,
                cause: abort.reason.clone(),
            };
        }
        CommError::Aborted {
            op: ctx.label.to_string(),
            rank: ctx.rank,
            by_rank: abort.by_rank,
            reason: abort.reason.clone(),
        }
    }

    /// Fails if the world is aborted.
    pub(super) fn check_abort(st: &State, ctx: &Ctx<'_>) -> Result<()> {
        match &st.abort {
            Some(a) => Err(Self::aborted_error(a, ctx)),
            None => Ok(()),
        }
    }

    /// Sleeps until `pending` returns no ranks to wait for. `pending` returns the group ranks
    /// being waited on; with `departure_fails`, one of them having dropped its communicator is an
    /// abort. Gives the guard back in every case.
    pub(super) fn wait_for<'a>(
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
                    "it (rank {q} of the group) dropped its communicator without joining {}",
                    ctx.label
                );
                let abort = Abort {
                    by_rank,
                    reason,
                    timed_out: None,
                    lost: true,
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
                    lost: false,
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
    pub(super) fn wait_posts<'a>(
        &'a self,
        st: Guard<'a>,
        ctx: &Ctx<'_>,
    ) -> (Guard<'a>, Result<()>) {
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
pub(super) fn posts<'a>(st: &'a State, ctx: &Ctx<'_>) -> Vec<&'a Post> {
    st.groups[ctx.group].slots[&ctx.seq]
        .posts
        .iter()
        .map(|p| p.as_ref().expect("every rank has posted"))
        .collect()
}

/// Fails if a rank's arguments were rejected or the ranks posted different kinds of operation.
pub(super) fn agree_on_kind(posts: &[&Post], ctx: &Ctx<'_>) -> Result<()> {
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
