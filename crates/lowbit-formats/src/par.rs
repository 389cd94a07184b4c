//! Minimal fork-join over disjoint work items, with scoped threads.

/// Runs `f` on every item, spreading contiguous runs of items over `threads` scoped threads.
/// Items own disjoint output slices, so the result does not depend on the thread count.
pub(crate) fn for_each<T: Send>(items: Vec<T>, threads: usize, f: impl Fn(T) + Sync) {
    if threads <= 1 || items.len() <= 1 {
        items.into_iter().for_each(f);
        return;
    }
    let per = items.len().div_ceil(threads);
    let mut groups: Vec<Vec<T>> = Vec::with_capacity(threads);
    let mut it = items.into_iter().peekable();
    while it.peek().is_some() {
        groups.push(it.by_ref().take(per).collect());
    }
    let f = &f;
    std::thread::scope(|s| {
        let mut groups = groups.into_iter();
        // The calling thread works on the first group instead of idling.
        let first = groups.next();
        for g in groups {
            s.spawn(move || g.into_iter().for_each(f));
        }
        if let Some(g) = first {
            g.into_iter().for_each(f);
        }
    });
}

/// Runs `f` over contiguous index ranges covering `0..n` (at most `threads` of them) and returns
/// the per-range results in order.
pub(crate) fn map_ranges<R: Send>(
    n: usize,
    threads: usize,
    f: impl Fn(std::ops::Range<usize>) -> R + Sync,
) -> Vec<R> {
    let parts = threads.clamp(1, n.max(1));
    let per = n.div_ceil(parts).max(1);
    let ranges: Vec<_> = (0..n).step_by(per).map(|s| s..(s + per).min(n)).collect();
    if ranges.len() <= 1 {
        return vec![f(0..n)];
    }
    let f = &f;
    std::thread::scope(|s| {
        let handles: Vec<_> = ranges.into_iter().map(|r| s.spawn(move || f(r))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("quantization worker panicked"))
            .collect()
    })
}
