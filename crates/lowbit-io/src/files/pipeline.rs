//! Chunked work over threads, consumed in order: workers compute chunk results in parallel and
//! the calling thread takes them in chunk order (for sums whose rounding depends on the order,
//! and for the first error in file order), with a bounded number of results waiting, so memory
//! stays bounded by the chunk size times the thread count (the chunks are `crate::wide`'s).

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex, PoisonError};

/// The number of worker threads for `requested` (0 = one per available core).
pub fn threads(requested: usize) -> usize {
    if requested == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        requested
    }
}

struct State<T, E> {
    /// Next chunk to hand to a worker.
    next: usize,
    /// Next chunk the consumer takes.
    taking: usize,
    done: BTreeMap<usize, Result<T, E>>,
    stop: bool,
    panicked: Option<Box<dyn std::any::Any + Send>>,
}

/// Runs `work(k)` for `k in 0..n` on `threads` scoped threads and passes the results to `take`,
/// on the calling thread, in order of `k`; a worker starts chunk `k` only while fewer than
/// `ahead` chunks before it wait to be taken. Returns the first error in order of `k` (from
/// `work` or `take`), as a sequential loop would, and stops handing out chunks then.
pub fn ordered<T: Send, E: Send>(
    n: usize,
    threads: usize,
    ahead: usize,
    work: impl Fn(usize) -> Result<T, E> + Sync,
    mut take: impl FnMut(T) -> Result<(), E>,
) -> Result<(), E> {
    let state = Mutex::new(State {
        next: 0,
        taking: 0,
        done: BTreeMap::new(),
        stop: false,
        panicked: None,
    });
    let cv = Condvar::new();
    let lock = || state.lock().unwrap_or_else(PoisonError::into_inner);
    let worker = || {
        loop {
            let k = {
                let mut g = lock();
                loop {
                    if g.stop || g.next >= n {
                        return;
                    }
                    if g.next < g.taking + ahead.max(1) {
                        g.next += 1;
                        break g.next - 1;
                    }
                    g = cv.wait(g).unwrap_or_else(PoisonError::into_inner);
                }
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(k)));
            let mut g = lock();
            match r {
                Ok(r) => {
                    g.done.insert(k, r);
                }
                // Re-raised on the calling thread, which would otherwise wait for chunk k.
                Err(p) => {
                    g.panicked = Some(p);
                    g.stop = true;
                }
            }
            cv.notify_all();
        }
    };
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, n.max(1)) {
            s.spawn(worker);
        }
        let mut consume = || -> Result<(), E> {
            for k in 0..n {
                let r = {
                    let mut g = lock();
                    loop {
                        if let Some(p) = g.panicked.take() {
                            std::panic::resume_unwind(p);
                        }
                        if let Some(r) = g.done.remove(&k) {
                            g.taking = k + 1;
                            cv.notify_all();
                            break r;
                        }
                        g = cv.wait(g).unwrap_or_else(PoisonError::into_inner);
                    }
                };
                take(r?)?;
            }
            Ok(())
        };
        let result = consume();
        lock().stop = true;
        cv.notify_all();
        result
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_arrive_in_order_and_the_first_error_wins() {
        for threads in [1, 2, 5] {
            let mut seen = Vec::new();
            let r: Result<(), usize> = ordered(
                50,
                threads,
                3,
                |k| {
                    // Later chunks finish first.
                    std::thread::sleep(std::time::Duration::from_micros((50 - k as u64) * 20));
                    Ok(k)
                },
                |k| {
                    seen.push(k);
                    Ok(())
                },
            );
            assert_eq!(r, Ok(()));
            assert_eq!(seen, (0..50).collect::<Vec<_>>());
            let r = ordered(
                50,
                threads,
                4,
                |k| if k % 7 == 6 { Err(k) } else { Ok(k) },
                |_| Ok(()),
            );
            assert_eq!(r, Err(6));
            assert_eq!(
                ordered(0, threads, 1, |_| Ok::<_, ()>(()), |_| Ok(())),
                Ok(())
            );
        }
    }
}
