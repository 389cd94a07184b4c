//! Removal of the temporary file when SIGINT, SIGTERM or SIGHUP arrives during the write.
//!
//! Without a dependency there is no `libc` crate, so the three C functions are declared here;
//! std links the C library on every Unix anyway. The handler is async-signal-safe: it takes the
//! path (a C string registered by [`arm`]) with one atomic swap, `unlink`s it, then hands
//! the signal to the handler installed before it (the liveness channel's goodbye to the peers of
//! a rank, say) or, if there was none, restores the default action and re-raises the signal, so
//! the process still dies of it. SIGKILL cannot be caught: its temporaries are removed by the next
//! run (`remove_stale_temps`).

use std::ffi::{CString, c_char, c_int};
use std::path::Path;
use std::sync::Once;
use std::sync::atomic::{AtomicPtr, AtomicUsize, Ordering};

/// The temporary to remove, or null.
static TEMP: AtomicPtr<c_char> = AtomicPtr::new(std::ptr::null_mut());
/// The handler each of [`SIGNALS`] had before ours (`SIG_DFL` if none).
static PREVIOUS: [AtomicUsize; 3] = [const { AtomicUsize::new(SIG_DFL) }; 3];

// The same numbers on Linux and macOS.
const SIGHUP: c_int = 1;
const SIGINT: c_int = 2;
const SIGTERM: c_int = 15;
const SIGNALS: [c_int; 3] = [SIGHUP, SIGINT, SIGTERM];
const SIG_DFL: usize = 0;
const SIG_IGN: usize = 1;
const SIG_ERR: usize = usize::MAX;

// SAFETY: these are the C library's declarations of `signal`, `unlink` and `raise` (a
// handler is passed as its address, `sighandler_t`).
unsafe extern "C" {
    fn signal(signum: c_int, handler: usize) -> usize;
    fn unlink(path: *const c_char) -> c_int;
    fn raise(sig: c_int) -> c_int;
}

extern "C" fn on_signal(sig: c_int) {
    let p = TEMP.swap(std::ptr::null_mut(), Ordering::SeqCst);
    if !p.is_null() {
        // SAFETY: `p` came from `CString::into_raw` in `arm` and, swapped out here, can no
        // longer be freed by `disarm`; `unlink` is async-signal-safe.
        unsafe { unlink(p) };
    }
    let previous = SIGNALS
        .iter()
        .position(|&s| s == sig)
        .map_or(SIG_DFL, |i| PREVIOUS[i].load(Ordering::SeqCst));
    if previous == SIG_DFL || previous == SIG_ERR {
        // SAFETY: restoring the default action and re-raising are async-signal-safe; the
        // signal then terminates the process as it would have without this handler.
        unsafe {
            signal(sig, SIG_DFL);
            raise(sig);
        }
    } else {
        // SAFETY: `previous` is the address of the handler `signal` replaced in `arm`, an
        // `extern "C" fn(c_int)` installed by this process (SIG_IGN is never stored).
        let f = unsafe { std::mem::transmute::<usize, extern "C" fn(c_int)>(previous) };
        f(sig);
    }
}

/// Registers `path` for removal on a signal (installing the handlers once).
pub fn arm(path: &Path) {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        for (slot, &sig) in PREVIOUS.iter().zip(&SIGNALS) {
            // SAFETY: `on_signal` is an `extern "C" fn(c_int)` that only calls
            // async-signal-safe functions.
            match unsafe { signal(sig, on_signal as extern "C" fn(c_int) as usize) } {
                // SAFETY: an ignored signal gets its disposition back (it must not start
                // removing files and killing the process).
                SIG_IGN => unsafe { signal(sig, SIG_IGN) },
                previous => slot.swap(previous, Ordering::SeqCst),
            };
        }
    });
    use std::os::unix::ffi::OsStrExt;
    if let Ok(c) = CString::new(path.as_os_str().as_bytes()) {
        let old = TEMP.swap(c.into_raw(), Ordering::SeqCst);
        free(old);
    }
}

/// Unregisters the temporary (it has been renamed or removed).
pub fn disarm() {
    free(TEMP.swap(std::ptr::null_mut(), Ordering::SeqCst));
}

fn free(p: *mut c_char) {
    if !p.is_null() {
        // SAFETY: `p` came from `CString::into_raw` and was swapped out of `TEMP`, so
        // nothing else holds it.
        drop(unsafe { CString::from_raw(p) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicI32;

    static SEEN: AtomicI32 = AtomicI32::new(0);

    extern "C" fn earlier(sig: c_int) {
        SEEN.store(sig, Ordering::SeqCst);
    }

    /// A handler installed before ours (the liveness channel's goodbye) still runs: ours
    /// removes the temporary, then hands the signal on instead of re-raising it. The handler
    /// is called directly with `earlier` as SIGHUP's previous handler, so no disposition of
    /// the test process changes.
    #[test]
    fn the_handler_removes_the_temp_then_chains_to_the_earlier_one() {
        let dir = std::env::temp_dir().join(format!("lowbit-sig-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let tmp = dir.join("partial");
        std::fs::write(&tmp, b"x").unwrap();
        let slot = SIGNALS.iter().position(|&s| s == SIGHUP).unwrap();
        PREVIOUS[slot].store(earlier as extern "C" fn(c_int) as usize, Ordering::SeqCst);
        let old = TEMP.swap(
            CString::new(tmp.to_str().unwrap()).unwrap().into_raw(),
            Ordering::SeqCst,
        );
        on_signal(SIGHUP);
        PREVIOUS[slot].store(SIG_DFL, Ordering::SeqCst);
        free(old);
        assert_eq!(
            SEEN.load(Ordering::SeqCst),
            SIGHUP,
            "the earlier handler did not run"
        );
        assert!(!tmp.exists(), "the temporary was not removed");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
