//! What `lowbit train` shows while it runs, from the [`StepLog`] rank 0 hands over after every
//! step: on a terminal, a progress bar redrawn in place; elsewhere (a log file, a pipe, a
//! scheduler's capture), a plain line every `--log-every` seconds and at every evaluation; and
//! the `--metrics` records ([`crate::metrics`]).
//!
//! The step callback cannot fail the run, so a failed metrics write is kept and reported by
//! [`Progress::finish`] when the run ends (later records are not attempted).

use std::io::Write;
use std::sync::Mutex;
use std::time::Duration;

use lowbit::train::StepLog;

use crate::error::CliError;
use crate::metrics::Metrics;

/// The progress display and the metrics file of one run.
pub struct Progress {
    tty: bool,
    /// Plain lines at most this often (`None`: only at evaluations).
    log_every: Option<Duration>,
    state: Mutex<State>,
}

struct State {
    /// Elapsed time at the previous step (for the step's own wall time).
    prev: Duration,
    /// Elapsed time at the last plain line.
    last_line: Duration,
    metrics: Option<Metrics>,
    error: Option<CliError>,
}

impl Progress {
    /// A display on a terminal (`tty`) or not, with plain lines every `log_every` (zero: only
    /// at evaluations), writing `metrics` if given.
    pub fn new(tty: bool, log_every: Duration, metrics: Option<Metrics>) -> Self {
        Progress {
            tty,
            log_every: (!log_every.is_zero()).then_some(log_every),
            state: Mutex::new(State {
                prev: Duration::ZERO,
                last_line: Duration::ZERO,
                metrics,
                error: None,
            }),
        }
    }

    /// Shows step `s` and records it.
    pub fn step(&self, s: &StepLog) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        // The first step of a run starts at zero elapsed time.
        let step_secs = s.elapsed.saturating_sub(st.prev).as_secs_f64();
        st.prev = s.elapsed;
        if st.error.is_none()
            && let Some(m) = st.metrics.as_mut()
            && let Err(e) = m.step(s, step_secs)
        {
            st.error = Some(e);
        }
        let eval = s.eval.map(|v| format!("  eval {v:.4}")).unwrap_or_default();
        let mut err = std::io::stderr().lock();
        if self.tty {
            let line = format!(
                "step {:>4}/{}  loss {:.4}{eval}  {:.0} tok/s",
                s.step, s.steps, s.loss, s.tokens_per_s
            );
            let width = 30;
            let done = width * s.step / s.steps.max(1);
            let bar = format!("[{}{}]", "#".repeat(done), ".".repeat(width - done));
            let _ = write!(err, "\r{bar} {line}\x1b[K");
            if s.step == s.steps {
                let _ = writeln!(err);
            }
            return;
        }
        let due = self
            .log_every
            .is_some_and(|every| s.elapsed.saturating_sub(st.last_line) >= every);
        if s.eval.is_some() || due {
            st.last_line = s.elapsed;
            let _ = writeln!(err, "{}", plain_line(s, &eval));
        }
    }

    /// Ends the display: the first failed metrics write, if any.
    ///
    /// # Errors
    /// That write's error, naming `--metrics` and the path.
    pub fn finish(self) -> Result<(), CliError> {
        let st = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        st.error.map_or(Ok(()), Err)
    }
}

/// `step 12/200  loss 3.1234  lr 2.40e-3  5123 tok/s  ETA 1m05s` (and `eval X` on an eval).
fn plain_line(s: &StepLog, eval: &str) -> String {
    let done = s.step.saturating_sub(s.first_step);
    let left = s.steps.saturating_sub(s.step);
    let eta = if done == 0 {
        Duration::ZERO
    } else {
        s.elapsed.mul_f64(left as f64 / done as f64)
    };
    let muon = s
        .muon_lr
        .map(|m| format!(" muon {m:.2e}"))
        .unwrap_or_default();
    format!(
        "step {}/{}  loss {:.4}{eval}  lr {:.2e}{muon}  {:.0} tok/s  ETA {}",
        s.step,
        s.steps,
        s.loss,
        s.lr,
        s.tokens_per_s,
        clock(eta)
    )
}

/// `1h02m`, `3m05s`, `12s`.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_reads_as_hours_minutes_seconds() {
        assert_eq!(clock(Duration::from_secs(12)), "12s");
        assert_eq!(clock(Duration::from_secs(185)), "3m05s");
        assert_eq!(clock(Duration::from_secs(3720 + 59)), "1h02m");
    }
}
