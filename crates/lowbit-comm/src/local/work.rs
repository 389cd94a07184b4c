//! An in-process launch in flight and its completion: agreement checks across the ranks' posts,
//! then this rank's outputs computed from the snapshots (all-reduce chunks shared out among the
//! ranks).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use lowbit_device::{DType, Device};

use super::state::{Chunk, Ctx, Post, Posted, Shared, State, agree_on_kind, posts};
use super::{LocalComm, Member};
use crate::op::{self, OpDesc};
use crate::reduce::{reduce_blocks, reduce_into};
use crate::{CommError, Op, ReduceOp, Result};

/// An in-process launch in flight.
pub(crate) struct LocalWork {
    me: Member,
    seq: u64,
    launch: String,
    op_labels: Vec<String>,
    ops: Vec<Op>,
}

impl LocalComm {
    /// The handle of this communicator's launch `seq` of `ops`, posted under the label
    /// `launch` (and `op_labels`, one per op).
    pub(super) fn work(
        &self,
        seq: u64,
        launch: String,
        op_labels: Vec<String>,
        ops: &[Op],
    ) -> LocalWork {
        LocalWork {
            me: self.me.clone(),
            seq,
            launch,
            op_labels,
            ops: ops.to_vec(),
        }
    }
}

impl fmt::Debug for LocalWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalWork")
            .field("launch", &self.launch)
            .field("rank", &self.me.rank)
            .field("group", &self.me.group)
            .finish_non_exhaustive()
    }
}

/// Element range of chunk `c` of `k` over `n` elements.
fn chunk_range(n: usize, k: usize, c: usize) -> Range<usize> {
    c * n / k..(c + 1) * n / k
}

impl LocalWork {
    fn ctx(&self) -> Ctx<'_> {
        self.me.ctx(self.seq, &self.launch)
    }

    /// Completes the launch; the slot is released by `Drop`.
    pub(crate) fn wait(self, dev: &mut Device) -> Result<()> {
        let ctx = self.ctx();
        let st = self.me.shared.lock();
        let (st, waited) = self.me.shared.wait_posts(st, &ctx);
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
                rank: self.me.rank,
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
                        if q == self.me.rank && dst == input {
                            continue; // in place: already there
                        }
                        dev.write_bytes(dst, bytes).map_err(device)?;
                    }
                }
                Op::ReduceScatter {
                    output, reduce: r, ..
                } => {
                    let nb = output.byte_len();
                    let at = self.me.rank * nb..(self.me.rank + 1) * nb;
                    let parts: Vec<&[u8]> = snapshots().iter().map(|s| &s[at.clone()]).collect();
                    reduce_blocks(output.dtype(), r, &parts, self.me.size, |at, block| {
                        let len = block.len() / output.dtype().size();
                        dev.write_bytes(output.slice(at..at + len)?, block)
                    })
                    .map_err(device)?;
                }
                Op::AllReduce { buf, reduce: r } => {
                    let chunks = self.all_reduce_chunks(i, buf.len(), buf.dtype(), r, &data[i])?;
                    for (c, bytes) in chunks.iter().enumerate() {
                        let dst = buf
                            .slice(chunk_range(buf.len(), self.me.size, c))
                            .map_err(device)?;
                        dev.write_bytes(dst, bytes).map_err(device)?;
                    }
                }
                Op::Broadcast { buf, root } => {
                    if root != self.me.rank {
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
        let k = self.me.size;
        let es = dtype.size();
        loop {
            let st = self.me.shared.lock();
            let (mut st, waited) = self.me.shared.wait_for(st, &ctx, false, |st| {
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
                .map(|j| (self.me.rank + j) % k)
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
            chunks[c] = Chunk::Busy(self.me.rank);
            drop(st);
            let range = chunk_range(n, k, c);
            let bytes = range.start * es..range.end * es;
            let parts: Vec<&[u8]> = data
                .iter()
                .map(|d| &d.as_deref().expect("all-reduce inputs are posted")[bytes.clone()])
                .collect();
            let mut out = self.me.shared.pool.take(bytes.len());
            reduce_into(dtype, r, &parts, k, &mut out);
            let out = Arc::new(out);
            let mut st = self.me.shared.lock();
            Self::chunks(&mut st, &ctx, i, k)[c] = Chunk::Done(out);
            self.me.shared.cv.notify_all();
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
        let mut st = self.me.shared.lock();
        self.me
            .shared
            .abort_if_panicking(&mut st, self.me.world_rank);
        let freed = Shared::release(&mut st, self.me.group, self.seq);
        self.me.shared.cv.notify_all();
        drop(st);
        self.me.shared.recycle(freed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_ranges_cover_everything() {
        for n in 0..20 {
            for k in 1..6 {
                let ranges: Vec<Range<usize>> = (0..k).map(|c| chunk_range(n, k, c)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[k - 1].end, n);
                let contiguous = ranges.windows(2).all(|w| w[0].end == w[1].start);
                assert!(contiguous, "{n} elements in {k} chunks: {ranges:?}");
            }
        }
    }
}
