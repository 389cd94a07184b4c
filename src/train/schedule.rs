//! The learning-rate schedule of `lowbit train`, extensions included.
//!
//! A run's schedule is `lowbit_train::schedule::WarmupCosine` over its `--steps`: linear warmup
//! over the first 5%, then a cosine to a tenth of the peak at the last step. Both are written as
//! `lr(s) = peak · ramp(s) · (0.1 + 0.9 · (1 + cos(π · p(s))) / 2)` with the decay's progress
//! `p(s) = s / steps` and `ramp(s) = min(1, (s + 1) / warmup)`.
//!
//! A resume with a larger `--steps` must say how the schedule continues (`--extend-schedule`);
//! an extension at the resume step `a` of a schedule ending at `E` to the new end `E'` keeps the
//! warmup and rewrites the progress (`p` the schedule's progress before the extension):
//!
//! - **constant**: `p'(s) = p(min(s, E))`: the old schedule up to its end, then its final rate
//!   (the floor, a tenth of the peak) held to `E'` (Megatron-LM's rate after `lr_decay_steps`);
//! - **cosine**: `p'(s) = p(s)` before `a`, then `p(a) + (1 - p(a)) · (s - a) / (E' - a)`: the
//!   decay still ahead at the resume step is stretched over the new steps, reaching the floor at
//!   `E'`. Continuous at `a` (the rate there is the old schedule's).
//!
//! So extending a finished run (`a = E`, `p(a) = 1`) holds the floor under both kinds; cosine is
//! for resuming a checkpoint before the end (`a < E`). Extensions chain: an extended run resumed
//! again with a still larger `--steps` extends its own schedule. Everything is computed in f64
//! and rounded to f32 once, as `WarmupCosine` does; a schedule never extended is exactly
//! `WarmupCosine`'s, bit for bit, and an extended one equals it before the first extension's
//! resume step.
//!
//! The manifest records an extended schedule under the config key `schedule` as its
//! [`Schedule::to_text`] (`ORIGINAL KIND@AT->END ...`, e.g. `100 cosine@50->200`), so a resume
//! of an extended run reproduces it; a schedule never extended records nothing (as before).

use lowbit_train::schedule::WarmupCosine;

/// How a resumed run with a larger `--steps` continues the learning-rate schedule
/// (`--extend-schedule`; see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Extend {
    /// The old schedule to its end, then its final rate (the floor) held.
    Constant,
    /// The decay left at the resume step re-stretched to the new end.
    Cosine,
}

impl Extend {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Extend::Constant => "constant",
            Extend::Cosine => "cosine",
        }
    }
}

/// One extension: resumed at step `at`, the schedule continues to `to` steps as `kind` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extension {
    /// How.
    pub kind: Extend,
    /// The resume step (the checkpoint's step).
    pub at: usize,
    /// The new end (the resumed run's `--steps`).
    pub to: usize,
}

/// A run's schedule: `WarmupCosine` over `original` steps, then each extension in turn. The
/// default has no extension: `WarmupCosine` over the run's own `--steps` (`original` unused).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// The steps of the run that planned the schedule (meaningful with extensions only).
    pub original: usize,
    /// The extensions, oldest first; the last one's `to` is the run's `--steps`.
    pub extensions: Vec<Extension>,
}

impl Schedule {
    /// Whether the schedule was extended.
    pub fn is_extended(&self) -> bool {
        !self.extensions.is_empty()
    }

    /// This schedule, which ends at `end` steps, extended at step `at` to `to` steps.
    pub fn extended(&self, end: usize, kind: Extend, at: usize, to: usize) -> Schedule {
        let mut s = self.clone();
        if !s.is_extended() {
            s.original = end;
        }
        s.extensions.push(Extension { kind, at, to });
        s
    }

    /// Checks that the schedule is one a run of `steps` steps can follow: every extension
    /// resumes within the schedule it extends and ends beyond it, the last one at `steps`.
    ///
    /// # Errors
    /// What does not fit, as text.
    pub fn check(&self, steps: usize) -> Result<(), String> {
        let Some(last) = self.extensions.last() else {
            return Ok(());
        };
        if self.original == 0 {
            return Err("an extended schedule must start from a run of at least 1 step".into());
        }
        let mut end = self.original;
        for e in &self.extensions {
            if e.at > end || e.to <= end {
                return Err(format!(
                    "extension {} at step {} to {} steps does not continue a schedule of {end} \
                     steps (it must resume at or before its end and end beyond it)",
                    e.kind.name(),
                    e.at,
                    e.to
                ));
            }
            end = e.to;
        }
        if last.to != steps {
            return Err(format!(
                "the schedule ends at {} steps but --steps is {steps}",
                last.to
            ));
        }
        Ok(())
    }

    /// The learning rate of `step` (from 0) for a run of `steps` steps peaking at `peak`.
    pub fn lr_at(&self, peak: f32, steps: usize, step: usize) -> f32 {
        if !self.is_extended() {
            return WarmupCosine::new(peak, steps).lr_at(step);
        }
        // `WarmupCosine::lr_at`'s expression with the extended progress.
        let warmup = WarmupCosine::new(peak, self.original).warmup_steps() as f64;
        let s = step as f64;
        let ramp = ((s + 1.0) / warmup).min(1.0);
        let progress = self.progress(self.extensions.len(), step);
        let cosine = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (f64::from(peak) * ramp * cosine) as f32
    }

    /// The decay's progress at `step` under the first `k` extensions.
    fn progress(&self, k: usize, step: usize) -> f64 {
        if k == 0 {
            // As `WarmupCosine::lr_at` divides.
            return step as f64 / self.original.max(1) as f64;
        }
        let e = self.extensions[k - 1];
        let end = if k == 1 {
            self.original
        } else {
            self.extensions[k - 2].to
        };
        match e.kind {
            Extend::Constant => self.progress(k - 1, step.min(end)),
            Extend::Cosine if step < e.at => self.progress(k - 1, step),
            Extend::Cosine => {
                let at = self.progress(k - 1, e.at);
                let stretched = (step - e.at) as f64 / (e.to - e.at).max(1) as f64;
                (at + (1.0 - at) * stretched).min(1.0)
            }
        }
    }

    /// The manifest's record: `ORIGINAL` then ` KIND@AT->END` per extension (empty when not
    /// extended).
    pub fn to_text(&self) -> String {
        if !self.is_extended() {
            return String::new();
        }
        let mut t = self.original.to_string();
        for e in &self.extensions {
            t.push_str(&format!(" {}@{}->{}", e.kind.name(), e.at, e.to));
        }
        t
    }

    /// Parses [`Schedule::to_text`]'s form (strictly: decimal counts, single spaces).
    ///
    /// # Errors
    /// A text not of that form, quoted.
    pub fn parse(text: &str) -> Result<Schedule, String> {
        let bad = || format!("schedule {text:?} is not of the form `STEPS KIND@AT->END ...`");
        let count = |t: &str| {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            t.parse::<usize>().ok()
        };
        let mut parts = text.split(' ');
        let original = parts.next().and_then(count).ok_or_else(bad)?;
        let mut extensions = Vec::new();
        for p in parts {
            let (kind, rest) = p.split_once('@').ok_or_else(bad)?;
            let kind = match kind {
                "constant" => Extend::Constant,
                "cosine" => Extend::Cosine,
                _ => return Err(bad()),
            };
            let (at, to) = rest.split_once("->").ok_or_else(bad)?;
            extensions.push(Extension {
                kind,
                at: count(at).ok_or_else(bad)?,
                to: count(to).ok_or_else(bad)?,
            });
        }
        if extensions.is_empty() {
            return Err(bad());
        }
        Ok(Schedule {
            original,
            extensions,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEAK: f32 = 1e-2;

    /// The straight run's rate as f64, for the expected values below.
    fn formula(step: usize, warmup: f64, progress: f64) -> f32 {
        let ramp = ((step as f64 + 1.0) / warmup).min(1.0);
        let c = 0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        (f64::from(PEAK) * ramp * c) as f32
    }

    /// Not extended: `WarmupCosine` bit for bit; extended: the same bits before the resume step.
    #[test]
    fn an_unextended_schedule_is_warmup_cosine_and_extensions_keep_the_past() {
        let plain = Schedule::default();
        let wc = WarmupCosine::new(PEAK, 100);
        for s in 0..=100 {
            assert_eq!(plain.lr_at(PEAK, 100, s).to_bits(), wc.lr_at(s).to_bits());
        }
        for kind in [Extend::Constant, Extend::Cosine] {
            let x = plain.extended(100, kind, 40, 300);
            for s in 0..40 {
                assert_eq!(
                    x.lr_at(PEAK, 300, s).to_bits(),
                    wc.lr_at(s).to_bits(),
                    "{s}"
                );
            }
        }
    }

    /// Constant: the old schedule to its end, then the floor (a tenth of the peak) held.
    #[test]
    fn constant_follows_the_old_schedule_then_holds_its_floor() {
        let x = Schedule::default().extended(100, Extend::Constant, 40, 300);
        let wc = WarmupCosine::new(PEAK, 100);
        for s in [40, 50, 99, 100] {
            assert_eq!(
                x.lr_at(PEAK, 300, s).to_bits(),
                wc.lr_at(s).to_bits(),
                "{s}"
            );
        }
        let floor = PEAK / 10.0;
        for s in [100, 101, 200, 299, 300] {
            assert!((x.lr_at(PEAK, 300, s) - floor).abs() < 1e-9, "{s}");
        }
        assert_eq!(x.lr_at(PEAK, 300, 50), formula(50, 5.0, 0.5));
    }

    /// Cosine: continuous at the resume step, the remaining decay stretched to the new end:
    /// halfway through it at the middle of the new steps, the floor at the end.
    #[test]
    fn cosine_restretches_the_remaining_decay() {
        // Resumed at 50 of 100 (progress 1/2), extended to 250: progress 3/4 at step 150.
        let x = Schedule::default().extended(100, Extend::Cosine, 50, 250);
        let wc = WarmupCosine::new(PEAK, 100);
        assert_eq!(x.lr_at(PEAK, 250, 50).to_bits(), wc.lr_at(50).to_bits());
        assert_eq!(x.lr_at(PEAK, 250, 150), formula(150, 5.0, 0.75));
        assert_eq!(x.lr_at(PEAK, 250, 100), formula(100, 5.0, 0.625));
        assert!((x.lr_at(PEAK, 250, 250) - PEAK / 10.0).abs() < 1e-9);
        // Higher than the old schedule after the resume step, decreasing to the end.
        assert!(x.lr_at(PEAK, 250, 80) > wc.lr_at(80));
        assert!((50..250).all(|s| x.lr_at(PEAK, 250, s + 1) <= x.lr_at(PEAK, 250, s)));
        // A finished run has no decay left: the floor, as constant.
        let done = Schedule::default().extended(100, Extend::Cosine, 100, 200);
        assert!((done.lr_at(PEAK, 200, 150) - PEAK / 10.0).abs() < 1e-9);
    }

    /// A second extension continues the first: resumed at 150 of the cosine above (progress
    /// 3/4), stretched again to 350: progress 7/8 at step 250.
    #[test]
    fn extensions_chain() {
        let once = Schedule::default().extended(100, Extend::Cosine, 50, 250);
        let twice = once.extended(250, Extend::Cosine, 150, 350);
        assert_eq!(twice.original, 100);
        for s in 0..150 {
            assert_eq!(
                twice.lr_at(PEAK, 350, s).to_bits(),
                once.lr_at(PEAK, 250, s).to_bits()
            );
        }
        assert_eq!(twice.lr_at(PEAK, 350, 250), formula(250, 5.0, 0.875));
        let held = once.extended(250, Extend::Constant, 250, 400);
        assert_eq!(
            held.lr_at(PEAK, 400, 300).to_bits(),
            once.lr_at(PEAK, 250, 250).to_bits()
        );
    }

    /// The manifest's text round-trips; malformed texts and inconsistent schedules are refused.
    #[test]
    fn text_round_trips_and_bad_schedules_are_refused() {
        let x = Schedule::default()
            .extended(100, Extend::Cosine, 50, 250)
            .extended(250, Extend::Constant, 250, 300);
        assert_eq!(x.to_text(), "100 cosine@50->250 constant@250->300");
        assert_eq!(Schedule::parse(&x.to_text()).unwrap(), x);
        assert_eq!(x.check(300), Ok(()));
        assert!(x.check(301).unwrap_err().contains("--steps is 301"));
        assert_eq!(Schedule::default().to_text(), "");
        for bad in [
            "",
            "100",
            "100 ",
            "x cosine@1->2",
            "100 linear@1->200",
            "100 cosine@1-200",
            "100 cosine@+1->200",
            "100  cosine@1->200",
        ] {
            assert!(Schedule::parse(bad).is_err(), "{bad:?}");
        }
        for (text, steps) in [
            ("100 cosine@101->200", 200),
            ("100 cosine@50->100", 100),
            ("0 constant@0->10", 10),
        ] {
            assert!(
                Schedule::parse(text).unwrap().check(steps).is_err(),
                "{text}"
            );
        }
    }
}
