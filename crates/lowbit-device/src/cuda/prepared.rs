//! Prepared launches: a call's launches kept as CUDA graphs for the next call with the same
//! items.
//!
//! The step makes the same batched calls on the same views every step (a bucket group's
//! matrices after its gather). A fresh call checks every item (shapes, overlap, liveness),
//! builds its table and passes it as 2–8 KB of kernel parameters: for the 2D MXFP8 scales of a
//! Llama-3.2-1B bucket group (28 matrices) that host work (8.6–12.6 µs a call on an H200's
//! host) outlasted the kernel. A call finds its items in the cache and checks that every
//! buffer its launches point into is still the allocation it was (buffer ids carry a
//! generation, so a freed and reallocated slot is another id). The first call with some items
//! runs fresh and notes them; the second makes a graph of each of its launches, whose node
//! holds the table, and launches those; later calls launch the graphs (1.7–2.9 µs a call). A
//! call made once (over transient buffers) thus never pays for making a graph.
//!
//! Two other forms were measured and dropped (`crates/lowbit-kernels/NOTES.md`, "prepared
//! launches of the 2D MXFP8 scales"): the table in
//! device memory, its address the kernel's one parameter (host 4.3–6.1 µs, but the kernel's
//! chain of dependent table reads from memory made it 10–15% slower than from the parameter
//! bank), and the kept words passed as parameters again (4.7–6.1 µs).
//!
//! Invariants:
//! - an entry is made only from a call whose checks passed and whose every item the kernel
//!   took, so a hit is exactly that call again: the checks are pure functions of the items
//!   (shapes, views, overlap) and of the buffers' liveness, which the hit checks;
//! - a graph's parameters are fixed when it is made; an executable graph destroyed while a
//!   launch of it is in flight is freed when that launch completes (the driver's contract).
//!
//! Non-goal: matching calls whose items differ in any way (another order, one view more):
//! they are fresh calls.

use std::collections::VecDeque;

use cudarc::driver::sys;

use crate::{BufferId, View};

/// The most entries kept (the step makes one call per bucket group and kind; the oldest entry
/// goes first).
const CAPACITY: usize = 64;

/// An instantiated CUDA graph of one kernel node (its parameters copied into the graph when
/// the node was made).
#[derive(Debug)]
pub(in crate::cuda) struct KernelGraph {
    pub(in crate::cuda) graph: sys::CUgraph,
    pub(in crate::cuda) exec: sys::CUgraphExec,
}

// SAFETY: graph handles are plain driver handles, usable from any thread with the context
// bound (the device binds it before every driver call and is used by one thread at a time).
unsafe impl Send for KernelGraph {}

impl Drop for KernelGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `CudaDevice::kernel_graph` (the executable one
        // null where instantiation failed) and are destroyed once; an executable graph still in flight is freed when it completes (the driver's
        // contract for cuGraphExecDestroy). Errors cannot be reported from here.
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A call's items and, from its second call on, its launches.
#[derive(Debug)]
struct Entry<K, L> {
    items: Vec<K>,
    /// The buffers the launches point into, each once.
    buffers: Vec<BufferId>,
    /// `None` after the first call: a call made once (a transient buffer's) never pays for
    /// making graphs.
    launches: Option<Vec<L>>,
}

/// What [`Cache::find`] knows of a call's items.
#[derive(Debug, PartialEq)]
pub(in crate::cuda) enum Found<'a, L> {
    /// Never seen, or seen with a buffer since freed: a fresh call.
    New,
    /// Seen once: a fresh call that should prepare its launches ([`Cache::insert`] them).
    Seen,
    /// Prepared: launch these.
    Prepared(&'a [L]),
}

/// The prepared calls of one kind of call: items `K`, launches `L` ([`KernelGraph`]; generic
/// for the unit tests, which have no device).
#[derive(Debug)]
pub(in crate::cuda) struct Cache<K, L = KernelGraph> {
    entries: VecDeque<Entry<K, L>>,
}

impl<K, L> Default for Cache<K, L> {
    fn default() -> Self {
        Cache {
            entries: VecDeque::new(),
        }
    }
}

impl<K: PartialEq + Clone, L> Cache<K, L> {
    /// What is known of exactly `items`, with every buffer of its entry accepted by `live`; an
    /// entry with a buffer gone is dropped (the call then runs fresh, with its checks).
    pub(in crate::cuda) fn find(
        &mut self,
        items: &[K],
        live: impl Fn(BufferId) -> bool,
    ) -> Found<'_, L> {
        let Some(i) = self.entries.iter().position(|e| e.items == items) else {
            return Found::New;
        };
        if !self.entries[i].buffers.iter().all(|&b| live(b)) {
            self.entries.remove(i);
            return Found::New;
        }
        match &self.entries[i].launches {
            Some(l) => Found::Prepared(l),
            None => Found::Seen,
        }
    }

    /// Notes a call with `items`, whose views are `views`, and its `launches` (`None` for a
    /// first call), replacing what was known of them; the oldest entry goes when full.
    pub(in crate::cuda) fn insert(
        &mut self,
        items: &[K],
        views: impl Iterator<Item = View>,
        launches: Option<Vec<L>>,
    ) {
        let mut buffers: Vec<BufferId> = views.map(|v| v.buffer()).collect();
        buffers.sort_unstable();
        buffers.dedup();
        if let Some(i) = self.entries.iter().position(|e| e.items == items) {
            self.entries.remove(i);
        }
        if self.entries.len() == CAPACITY {
            self.entries.pop_front();
        }
        self.entries.push_back(Entry {
            items: items.to_vec(),
            buffers,
            launches,
        });
    }

    /// Drops every entry (graphs in flight are freed when they complete).
    pub(in crate::cuda) fn clear(&mut self) {
        self.entries.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::{CAPACITY, Cache, Found};
    use crate::{BufferId, DType, View};

    fn view(buffer: u32, offset: usize) -> View {
        let buffer = BufferId {
            device: 0,
            index: buffer,
            generation: 1,
        };
        View {
            buffer,
            offset,
            len: 4,
            dtype: DType::F32,
        }
    }

    #[test]
    fn a_call_is_prepared_on_its_second_sighting_with_the_same_items_and_live_buffers() {
        let mut c: Cache<(usize, View), u32> = Cache::default();
        let items = [(3, view(1, 0)), (5, view(2, 64))];
        let views = || items.iter().map(|i| i.1);
        assert_eq!(c.find(&items, |_| true), Found::New);
        c.insert(&items, views(), None);
        assert_eq!(c.find(&items, |_| true), Found::Seen);
        c.insert(&items, views(), Some(vec![7, 8]));
        assert_eq!(c.find(&items, |_| true), Found::Prepared(&[7, 8][..]));
        // Another order, one item less, another view: fresh calls.
        assert_eq!(c.find(&[items[1], items[0]], |_| true), Found::New);
        assert_eq!(c.find(&items[..1], |_| true), Found::New);
        assert_eq!(c.find(&[items[0], (5, view(2, 68))], |_| true), Found::New);
        // A buffer gone: new, and the entry dropped (new also when the buffer is back).
        let gone = items[1].1.buffer();
        assert_eq!(c.find(&items, |b| b != gone), Found::New);
        assert_eq!(c.find(&items, |_| true), Found::New);
    }

    #[test]
    fn the_oldest_call_goes_first() {
        let mut c: Cache<usize, usize> = Cache::default();
        for k in 0..=CAPACITY {
            c.insert(&[k], std::iter::once(view(1, 0)), Some(vec![k]));
        }
        assert_eq!(c.find(&[0], |_| true), Found::New);
        assert_eq!(c.find(&[1], |_| true), Found::Prepared(&[1][..]));
        assert_eq!(
            c.find(&[CAPACITY], |_| true),
            Found::Prepared(&[CAPACITY][..])
        );
        // Noting a known call again replaces it (no second entry).
        c.insert(&[1], std::iter::once(view(1, 0)), None);
        assert_eq!(c.find(&[1], |_| true), Found::Seen);
        c.clear();
        assert_eq!(c.find(&[1], |_| true), Found::New);
    }
}
