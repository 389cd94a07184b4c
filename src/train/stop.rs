//! Graceful stops of a training run: a [`StopRequest`] asks the step loop to stop at the end of
//! the current step; [`signals`] sets the process's request from SIGINT and SIGTERM.
//!
//! Decisions:
//! - The handler only sets an atomic (the first signal's number) and returns; the loop reads
//!   the request once per step and every rank contributes it to the step's loss all-gather (a
//!   second f32 beside each rank's loss: the loss is still summed over the first values in rank
//!   order, so no bit of the run changes), so all ranks agree on the step to stop after, threads
//!   or processes under a launcher (which signals each process: any rank's signal stops all).
//!   The stop step is saved through the normal save path when the run saves, so it resumes bit
//!   for bit; the run then ends with [`super::TrainError::Stopped`].
//! - A second signal (either of the two) aborts at once: the handler hands it to the handler
//!   installed before it — the liveness channel's goodbye for a launched CUDA rank
//!   (`lowbit_comm::liveness::install_signal_goodbye`, which tells the peers and then dies of
//!   the signal) — or restores the default action and re-raises it, so the process dies of the
//!   signal (a shell reports 130 or 143). Install [`signals`] after the goodbye, so that the
//!   first signal does not say goodbye to peers that are about to stop with it.
//! - A request that arrives during the last step, its eval or after it changes nothing: the run
//!   ends as it would have.
//! - SIGHUP keeps its previous disposition (the goodbye, or the default). No `libc` dependency:
//!   the two C functions are declared here, as `lowbit_comm::liveness` does.
//!
//! Non-goals: stopping inside a step (a step is the unit of a checkpoint), Windows consoles.

use std::sync::atomic::{AtomicI32, Ordering};

/// SIGINT's number (the same on Linux and macOS).
pub const SIGINT: i32 = 2;
/// SIGTERM's number (the same on Linux and macOS).
pub const SIGTERM: i32 = 15;

/// A request to stop at the end of the current step: the number of the signal that asked (0:
/// none). Set from a signal handler, another thread, or a library user's own logic.
#[derive(Debug, Default)]
pub struct StopRequest(AtomicI32);

impl StopRequest {
    /// No request yet.
    pub const fn new() -> Self {
        StopRequest(AtomicI32::new(0))
    }

    /// Asks for a stop on behalf of `signal` (a positive number); returns whether this was the
    /// first request (a later one keeps the first's number).
    pub fn request(&self, signal: i32) -> bool {
        self.0
            .compare_exchange(0, signal.max(1), Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// The signal that asked for a stop, if any did.
    pub fn requested(&self) -> Option<i32> {
        match self.0.load(Ordering::SeqCst) {
            0 => None,
            s => Some(s),
        }
    }
}

/// `SIGINT`, `SIGTERM` or `signal N`.
pub fn signal_name(signal: i32) -> String {
    match signal {
        SIGINT => "SIGINT".into(),
        SIGTERM => "SIGTERM".into(),
        s => format!("signal {s}"),
    }
}

/// The exit status of a run stopped by `signal`: 128 + its number, as a shell reports a process
/// ended by it (130 for SIGINT, 143 for SIGTERM).
pub fn exit_status(signal: i32) -> u8 {
    u8::try_from(128 + signal.clamp(1, 127)).unwrap_or(u8::MAX)
}

/// A request nobody sets: runs that are not stoppable.
pub(super) static NEVER: StopRequest = StopRequest::new();

/// The process's request, set by SIGINT and SIGTERM once [`signals`] installed the handlers.
static SIGNALLED: StopRequest = StopRequest::new();

#[cfg(unix)]
mod handler {
    use std::ffi::c_int;
    use std::sync::Once;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::{SIGINT, SIGNALLED, SIGTERM};

    const SIGNALS: [c_int; 2] = [SIGINT, SIGTERM];
    const SIG_DFL: usize = 0;
    const SIG_IGN: usize = 1;
    const SIG_ERR: usize = usize::MAX;
    /// The handler each of [`SIGNALS`] had before ours.
    static PREVIOUS: [AtomicUsize; 2] = [const { AtomicUsize::new(SIG_DFL) }; 2];

    // SAFETY: the C library's declarations of `signal` and `raise` (a handler is passed as its
    // address, `sighandler_t`).
    unsafe extern "C" {
        fn signal(signum: c_int, handler: usize) -> usize;
        fn raise(sig: c_int) -> c_int;
    }

    extern "C" fn on_signal(sig: c_int) {
        if SIGNALLED.request(sig) {
            // The first: the loop stops after this step.
            return;
        }
        let previous = SIGNALS
            .iter()
            .position(|&s| s == sig)
            .map_or(SIG_DFL, |i| PREVIOUS[i].load(Ordering::SeqCst));
        if previous == SIG_DFL || previous == SIG_IGN || previous == SIG_ERR {
            // SAFETY: restoring the default action and re-raising are async-signal-safe; the
            // signal, delivered when this handler returns, ends the process.
            unsafe {
                signal(sig, SIG_DFL);
                raise(sig);
            }
        } else {
            // SAFETY: `previous` is the address of the handler `signal` replaced, an
            // `extern "C" fn(c_int)` installed by this process (the liveness goodbye, which
            // ends the process in turn).
            let f = unsafe { std::mem::transmute::<usize, extern "C" fn(c_int)>(previous) };
            f(sig);
        }
    }

    pub(super) fn install() {
        static INSTALL: Once = Once::new();
        INSTALL.call_once(|| {
            for (slot, &sig) in PREVIOUS.iter().zip(&SIGNALS) {
                // SAFETY: `on_signal` is an `extern "C" fn(c_int)` that only touches atomics
                // and calls async-signal-safe functions.
                match unsafe { signal(sig, on_signal as extern "C" fn(c_int) as usize) } {
                    // SAFETY: an ignored signal (`nohup`, a parent's choice) stays ignored.
                    SIG_IGN => unsafe {
                        signal(sig, SIG_IGN);
                    },
                    previous => slot.store(previous, Ordering::SeqCst),
                }
            }
        });
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use std::sync::atomic::AtomicI32;

        static SEEN: AtomicI32 = AtomicI32::new(0);

        extern "C" fn earlier(sig: c_int) {
            SEEN.store(sig, Ordering::SeqCst);
        }

        /// The first signal only sets the request; the second goes to the handler installed
        /// before ours (the liveness goodbye of a launched rank). Called directly, with
        /// `earlier` as SIGTERM's previous handler, so no disposition of the test process
        /// changes.
        #[test]
        fn the_second_signal_goes_to_the_earlier_handler() {
            PREVIOUS[1].store(earlier as extern "C" fn(c_int) as usize, Ordering::SeqCst);
            on_signal(SIGTERM);
            assert_eq!(SIGNALLED.requested(), Some(SIGTERM));
            assert_eq!(
                SEEN.load(Ordering::SeqCst),
                0,
                "the first signal was handed on"
            );
            on_signal(SIGTERM);
            PREVIOUS[1].store(SIG_DFL, Ordering::SeqCst);
            assert_eq!(SEEN.load(Ordering::SeqCst), SIGTERM, "the second was not");
        }
    }
}

/// Installs the SIGINT and SIGTERM handlers (once per process) and returns the request they
/// set. Without Unix signals nothing is installed and the request is never set by a signal.
pub fn signals() -> &'static StopRequest {
    #[cfg(unix)]
    handler::install();
    &SIGNALLED
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first request wins and keeps its number; the exit statuses are the shell's.
    #[test]
    fn the_first_request_is_kept() {
        let r = StopRequest::new();
        assert_eq!(r.requested(), None);
        assert!(r.request(SIGTERM));
        assert!(!r.request(SIGINT));
        assert_eq!(r.requested(), Some(SIGTERM));
        assert_eq!(exit_status(SIGINT), 130);
        assert_eq!(exit_status(SIGTERM), 143);
        assert_eq!(signal_name(SIGTERM), "SIGTERM");
        assert_eq!(signal_name(9), "signal 9");
        assert_eq!(NEVER.requested(), None);
    }
}
