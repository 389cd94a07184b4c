//! Minimal fork-join over disjoint work items, with scoped threads.

/// Runs `f` on every item over `threads` scoped threads, each taking the next item from a
/// shared queue when it is free. Items own disjoint output slices, so the result does not depend on the
/// thread count or on which thread ran what.
///
/// Items are handed out one at a time rather than split up front because a spawned thread can
/// start late (waking an idle virtual CPU takes a while): with a fixed split the whole call
/// waits for it, with a shared queue the calling thread does its share.
pub(crate) fn for_each<T: Send>(items: Vec<T>, threads: usize, f: impl Fn(T) + Sync) {
    if threads <= 1 || items.len() <= 1 {
        items.into_iter().for_each(f);
        return;
    }
    let helpers = threads.min(items.len()) - 1;
    let queue = std::sync::Mutex::new(items.into_iter());
    // Even workers take from the front, odd ones from the back: with two threads each walks
    // its own end of the output, so they do not fault in the same (huge) pages.
    let work = |from_back: bool| {
        loop {
            // A poisoned lock means another worker panicked; the scope re-raises that panic.
            let next = queue.lock().ok().and_then(
                |mut q| {
                    if from_back { q.next_back() } else { q.next() }
                },
            );
            let Some(item) = next else {
                break;
            };
            f(item);
        }
    };
    std::thread::scope(|s| {
        for k in 1..=helpers {
            s.spawn(move || work(k % 2 == 1));
        }
        // The calling thread works too instead of idling.
        work(false);
    });
}
