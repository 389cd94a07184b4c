//! Counting global allocators for tests that bound heap memory (saves, loads, parsers fed
//! hostile input): [`ThreadCounting`] counts each thread's live bytes and their peak (tests that
//! run side by side do not see each other), [`GlobalCounting`] every thread's (for work spread
//! over rank threads; such tests must take turns). A test binary installs one:
//!
//! ```text
//! #[global_allocator]
//! static A: lowbit_dev_support::alloc::ThreadCounting = lowbit_dev_support::alloc::ThreadCounting;
//! ```
//!
//! Every call is forwarded to [`System`] unchanged; the counters are bookkeeping only.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

static GLOBAL_LIVE: AtomicUsize = AtomicUsize::new(0);
static GLOBAL_PEAK: AtomicUsize = AtomicUsize::new(0);

/// Counts this thread's live heap bytes and their peak (a free on another thread than the
/// allocation's makes the count an over-estimate, never an under-estimate of the peak).
#[derive(Clone, Copy, Debug, Default)]
pub struct ThreadCounting;

/// Counts the process's live heap bytes and their peak.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalCounting;

/// What a counter does on a change of `n` bytes.
trait Count {
    fn grew(n: usize);
    fn shrank(n: usize);
}

impl Count for ThreadCounting {
    fn grew(n: usize) {
        // `try_with`: no count during thread-local teardown, never a panic in the allocator.
        let _ = LIVE.try_with(|l| {
            let now = l.get().saturating_add(n);
            l.set(now);
            let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        });
    }
    fn shrank(n: usize) {
        let _ = LIVE.try_with(|l| l.set(l.get().saturating_sub(n)));
    }
}

impl Count for GlobalCounting {
    fn grew(n: usize) {
        let now = GLOBAL_LIVE.fetch_add(n, Ordering::SeqCst) + n;
        GLOBAL_PEAK.fetch_max(now, Ordering::SeqCst);
    }
    fn shrank(n: usize) {
        GLOBAL_LIVE.fetch_sub(n, Ordering::SeqCst);
    }
}

macro_rules! counting_alloc {
    ($t:ty) => {
        // SAFETY: every call is forwarded to `System` with the caller's layout and pointer
        // unchanged; the counters (atomics or const-initialised thread-locals without
        // destructors) are only bookkeeping and never allocate.
        unsafe impl GlobalAlloc for $t {
            unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
                // SAFETY: the caller's contract for `alloc`, passed on.
                let p = unsafe { System.alloc(layout) };
                if !p.is_null() {
                    <$t>::grew(layout.size());
                }
                p
            }

            unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
                // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
                let p = unsafe { System.alloc_zeroed(layout) };
                if !p.is_null() {
                    <$t>::grew(layout.size());
                }
                p
            }

            unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
                // SAFETY: the caller's contract for `dealloc`, passed on.
                unsafe { System.dealloc(ptr, layout) };
                <$t>::shrank(layout.size());
            }

            unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
                // SAFETY: the caller's contract for `realloc`, passed on.
                let p = unsafe { System.realloc(ptr, layout, new_size) };
                if !p.is_null() {
                    <$t>::shrank(layout.size());
                    <$t>::grew(new_size);
                }
                p
            }
        }
    };
}

counting_alloc!(ThreadCounting);
counting_alloc!(GlobalCounting);

/// With [`ThreadCounting`] installed: the peak bytes this thread held above its live bytes at
/// the start while `f` ran (0 under another allocator).
pub fn thread_peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get).saturating_sub(base))
}

/// With [`GlobalCounting`] installed: the process's live heap bytes now.
pub fn global_live() -> usize {
    GLOBAL_LIVE.load(Ordering::SeqCst)
}

/// With [`GlobalCounting`] installed: starts a peak measurement at the live bytes now and
/// returns them.
pub fn reset_global_peak() -> usize {
    let base = global_live();
    GLOBAL_PEAK.store(base, Ordering::SeqCst);
    base
}

/// With [`GlobalCounting`] installed: the largest live byte count since [`reset_global_peak`].
pub fn global_peak() -> usize {
    GLOBAL_PEAK.load(Ordering::SeqCst)
}

/// With [`GlobalCounting`] installed: the peak bytes above those live at the start while `f`
/// ran (on any thread).
pub fn global_peak_of<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = reset_global_peak();
    let out = f();
    (out, global_peak().saturating_sub(base))
}
