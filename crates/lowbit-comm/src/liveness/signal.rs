//! The goodbye a rank sends when SIGHUP, SIGINT or SIGTERM ends it: a handler that writes a
//! pre-built frame to every registered link's socket and then lets the signal do what it did
//! before (the previous handler, or the default action re-raised).
//!
//! No `libc` dependency, so the four C functions are declared here (std links the C library on
//! every Unix). The handler only loads atomics, calls `write` and `signal`/`raise` (all
//! async-signal-safe), and reads frames that registered slots leak on purpose: a slot's frames
//! are never freed, so a handler racing an unregistration never reads freed memory, and
//! `unregister` waits for running handlers before the caller may close the descriptor, so a
//! handler never writes to a reused one.

use std::ffi::{c_int, c_void};
use std::sync::Once;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicUsize, Ordering};

use super::FRAME_LEN;

/// The signals that get a goodbye, in the order of a slot's frames (same numbers on Linux and
/// macOS).
pub(super) const SIGNALS: [c_int; 3] = [1, 2, 15];
const SIG_DFL: usize = 0;
const SIG_IGN: usize = 1;
/// `SIG_ERR` as `signal` returns it.
const SIG_ERR: usize = usize::MAX;
const SLOTS: usize = 256;

type Frames = [[u8; FRAME_LEN]; 3];

struct Slot {
    /// The socket, or -1 (free), or -2 (being filled).
    fd: AtomicI32,
    frames: AtomicPtr<Frames>,
}

static SLOT: [Slot; SLOTS] = [const {
    Slot {
        fd: AtomicI32::new(-1),
        frames: AtomicPtr::new(std::ptr::null_mut()),
    }
}; SLOTS];
/// Handlers running now (an unregistration waits for them).
static ACTIVE: AtomicUsize = AtomicUsize::new(0);
/// The handler each signal had before ours.
static PREVIOUS: [AtomicUsize; 3] = [const { AtomicUsize::new(SIG_DFL) }; 3];

// SAFETY: the C library's declarations of `signal`, `raise`, `write` and `_exit` (a handler is
// passed as its address, `sighandler_t`).
unsafe extern "C" {
    fn signal(signum: c_int, handler: usize) -> usize;
    fn raise(sig: c_int) -> c_int;
    fn write(fd: c_int, buf: *const c_void, count: usize) -> isize;
    fn _exit(status: c_int) -> !;
}

/// Ends the process at once with `status` (`_exit`: no exit handlers).
pub(super) fn exit_now(status: c_int) -> ! {
    // SAFETY: `_exit` takes any status and does not return.
    unsafe { _exit(status) }
}

extern "C" fn on_signal(sig: c_int) {
    let Some(i) = SIGNALS.iter().position(|&s| s == sig) else {
        return;
    };
    ACTIVE.fetch_add(1, Ordering::SeqCst);
    for slot in &SLOT {
        let fd = slot.fd.load(Ordering::SeqCst);
        let frames = slot.frames.load(Ordering::SeqCst);
        if fd >= 0 && !frames.is_null() {
            // SAFETY: `frames` was leaked by `register` and is never freed; `fd` is a socket
            // kept open until `unregister` has seen this handler finish; `write` is
            // async-signal-safe. The result does not matter: the process is going away.
            unsafe {
                let f = &(*frames)[i];
                write(fd, f.as_ptr().cast(), FRAME_LEN);
            }
        }
    }
    ACTIVE.fetch_sub(1, Ordering::SeqCst);
    let previous = PREVIOUS[i].load(Ordering::SeqCst);
    if previous == SIG_DFL || previous == SIG_IGN || previous == SIG_ERR {
        // SAFETY: restoring the default action and re-raising are async-signal-safe; the
        // signal then ends the process as it would have without this handler.
        unsafe {
            signal(sig, SIG_DFL);
            raise(sig);
        }
    } else {
        // SAFETY: `previous` is the address of the handler `signal` replaced, an
        // `extern "C" fn(c_int)` installed by this process.
        let f: extern "C" fn(c_int) =
            unsafe { std::mem::transmute::<usize, extern "C" fn(c_int)>(previous) };
        f(sig);
    }
}

/// Installs the goodbye handler for SIGHUP, SIGINT and SIGTERM, once per process, chaining to
/// the handler each had (a signal the process ignores stays ignored). Call it early in a
/// program that runs ranks as processes (`lowbit train` does); a handler installed later with
/// `signal` replaces this one, and the peers then see the connection close instead (still a
/// loss, without the signal's name).
pub fn install_signal_goodbye() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        for (i, &sig) in SIGNALS.iter().enumerate() {
            // SAFETY: `on_signal` is an `extern "C" fn(c_int)` that only does async-signal-safe
            // work before handing the signal on.
            let previous = unsafe { signal(sig, on_signal as extern "C" fn(c_int) as usize) };
            if previous == SIG_IGN {
                // SAFETY: puts back the ignored disposition we just replaced.
                unsafe { signal(sig, SIG_IGN) };
            } else {
                PREVIOUS[i].store(previous, Ordering::SeqCst);
            }
        }
    });
}

/// Registers a socket and its goodbye frames (one per signal of [`SIGNALS`]); `None` when every
/// slot is taken (that peer then sees the connection close instead).
pub(super) fn register(fd: c_int, frames: Frames) -> Option<usize> {
    let i = SLOT.iter().position(|s| {
        s.fd.compare_exchange(-1, -2, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })?;
    // Leaked on purpose (see the module docs): 168 bytes per link.
    let frames = Box::into_raw(Box::new(frames));
    SLOT[i].frames.store(frames, Ordering::SeqCst);
    SLOT[i].fd.store(fd, Ordering::SeqCst);
    Some(i)
}

/// Unregisters slot `i`; on return no handler writes to its socket any more.
pub(super) fn unregister(i: usize) {
    SLOT[i].fd.store(-2, Ordering::SeqCst);
    while ACTIVE.load(Ordering::SeqCst) != 0 {
        std::thread::yield_now();
    }
    SLOT[i].frames.store(std::ptr::null_mut(), Ordering::SeqCst);
    SLOT[i].fd.store(-1, Ordering::SeqCst);
}
