//! `lowbit train --metrics FILE.jsonl`: one JSON object per line, written and flushed as each
//! step completes, so a run that dies leaves every completed step on disk and a long run can be
//! watched (`tail -f`) or plotted (`lowbit plot`) while it runs.
//!
//! Records, told apart by `kind` (the schema is in docs/metrics.md):
//! - `run`: the first line of every run (a resumed run appends its own): the lowbit version, the
//!   git commit, the command line and the configuration;
//! - `step`: one per step — loss, grad norm, every optimizer group's learning rate, tokens/s of
//!   the step and of the run, MFU, peak memory, whether the step was skipped, wall time;
//! - `eval`: one per evaluation — its step, loss and tokens.
//!
//! Losses and norms are the run's own f32 values written as the shortest decimal that reads
//! back to the same f32 (`lowbit_io::json`), so they equal the `--json` report's bit for bit.
//! Each record is one `write` of a whole line on a file opened for appending: a reader never
//! sees half a line of a completed step.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use lowbit::train::{DeviceChoice, StepLog, TrainConfig};
use lowbit_io::json::Json;

use crate::error::CliError;

/// The peak dense bf16 tensor-core throughput of an H100 or H200 SXM (989.4 TFLOP/s without
/// sparsity, NVIDIA's H100 datasheet): the MFU denominator per GPU unless `--peak-tflops` says
/// otherwise.
pub const H100_BF16_PEAK: f64 = 989e12;

/// The version string of `lowbit --version`: the crate version and the git commit it was built
/// from (`-dirty` when the tree had changes; `unknown` outside a git checkout), from `build.rs`.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("LOWBIT_GIT_COMMIT"),
    ")"
);

/// An open metrics file.
pub struct Metrics {
    file: File,
    path: PathBuf,
    /// The MFU denominator: peak FLOP/s of all ranks together (`None`: MFU not reported).
    peak_flops: Option<f64>,
}

impl Metrics {
    /// Opens `path` for the records of a run: appended to with `append` (a resumed run), else
    /// truncated; then writes the `run` header.
    ///
    /// # Errors
    /// The file cannot be opened or written, naming `--metrics` and the path.
    pub fn create(
        path: &Path,
        append: bool,
        cfg: &TrainConfig,
        peak_tflops: Option<f64>,
    ) -> Result<Self, CliError> {
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .append(append)
            .truncate(!append)
            .open(path)
            .map_err(|e| {
                CliError::Msg(format!(
                    "--metrics {}: cannot open for writing: {e}",
                    path.display()
                ))
            })?;
        // Per device: the given peak, else an H100/H200's on GPUs; none on the CPU, whose peak
        // depends on the machine (and whose rank threads share its cores).
        let per_rank = match (peak_tflops, cfg.device) {
            (Some(t), _) => Some(t * 1e12),
            (None, DeviceChoice::Cuda) => Some(H100_BF16_PEAK),
            (None, DeviceChoice::Cpu) => None,
        };
        let mut m = Metrics {
            file,
            path: path.to_path_buf(),
            peak_flops: per_rank.map(|p| p * cfg.ranks as f64),
        };
        let header = m.header(cfg, per_rank);
        m.write(&header)?;
        Ok(m)
    }

    fn header(&self, cfg: &TrainConfig, per_rank: Option<f64>) -> Json {
        let name = self
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let muon_lr = cfg.optimizer.muon().map_or(Json::Null, |m| Json::F32(m.lr));
        let unix = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Json::obj([
            ("kind", Json::str("run")),
            ("name", Json::str(name)),
            ("lowbit_version", Json::str(env!("CARGO_PKG_VERSION"))),
            ("git_commit", Json::str(env!("LOWBIT_GIT_COMMIT"))),
            ("started_unix_s", Json::uint(unix)),
            ("argv", Json::Arr(std::env::args().map(Json::str).collect())),
            (
                "config",
                Json::obj([
                    ("describe", Json::str(crate::train_report::describe(cfg))),
                    ("model", crate::train_report::model_json(cfg)),
                    ("precision", Json::str(cfg.precision.name())),
                    ("compute", Json::str(cfg.compute.name())),
                    ("device", Json::str(cfg.device.name())),
                    ("ranks", Json::uint(cfg.ranks)),
                    ("batch", Json::uint(cfg.batch)),
                    ("microbatches", Json::uint(cfg.microbatches)),
                    ("steps", Json::uint(cfg.steps)),
                    ("eval_every", Json::uint(cfg.eval_every)),
                    ("seed", Json::uint(cfg.seed)),
                    ("optimizer", Json::str(cfg.optimizer.name())),
                    ("lr", Json::F32(cfg.lr)),
                    ("muon_lr", muon_lr),
                    ("fsdp", crate::train_report::fsdp_json(cfg)),
                    (
                        "activations_per_rank",
                        crate::train_report::activations_json(cfg),
                    ),
                ]),
            ),
            (
                "peak_flops_per_rank",
                per_rank.map_or(Json::Null, Json::Num),
            ),
        ])
    }

    /// Writes the records of step `s` (its `step` record, then its `eval` record if it
    /// evaluated); `step_secs` is the step's wall time (its eval and save included).
    ///
    /// # Errors
    /// A failed write, naming `--metrics` and the path.
    pub fn step(&mut self, s: &StepLog, step_secs: f64) -> Result<(), CliError> {
        let step_tps = s.tokens_per_step as f64 / step_secs.max(1e-9);
        let mfu = match (self.peak_flops, s.flops_per_token) {
            (Some(peak), Some(f)) => Json::Num(step_tps * f / peak),
            _ => Json::Null,
        };
        let mut lr = vec![("adamw", Json::F32(s.lr))];
        if let Some(m) = s.muon_lr {
            lr.push(("muon", Json::F32(m)));
        }
        let tokens = s.step * s.tokens_per_step;
        let wall = s.elapsed.as_secs_f64();
        let rec = Json::obj([
            ("kind", Json::str("step")),
            ("step", Json::uint(s.step)),
            ("steps", Json::uint(s.steps)),
            ("loss", Json::F32(s.loss)),
            ("grad_norm", Json::F32(s.grad_norm)),
            ("lr", Json::obj(lr)),
            ("skipped", Json::Bool(s.skipped)),
            ("tokens", Json::uint(tokens)),
            ("tokens_per_s", Json::Num(step_tps)),
            ("tokens_per_s_run", Json::Num(s.tokens_per_s)),
            ("mfu", mfu),
            ("device_peak_bytes", Json::uint(s.device_peak_bytes)),
            (
                "host_peak_rss_bytes",
                host_peak_rss().map_or(Json::Null, Json::uint),
            ),
            ("wall_s", Json::Num(wall)),
        ]);
        self.write(&rec)?;
        if let Some(v) = s.eval {
            let rec = Json::obj([
                ("kind", Json::str("eval")),
                ("step", Json::uint(s.step)),
                ("eval_loss", Json::F32(v)),
                ("eval_tokens", Json::uint(s.eval_tokens)),
                ("tokens", Json::uint(tokens)),
                ("wall_s", Json::Num(wall)),
            ]);
            self.write(&rec)?;
        }
        Ok(())
    }

    /// One record as one line, in one write, flushed.
    fn write(&mut self, rec: &Json) -> Result<(), CliError> {
        let line = format!("{rec}\n");
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| {
                CliError::Msg(format!(
                    "--metrics {}: cannot write: {e}",
                    self.path.display()
                ))
            })
    }
}

/// The process's peak resident set (`VmHWM` of /proc/self/status), bytes; `None` where there
/// is no procfs.
fn host_peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line
        .trim_start_matches("VmHWM:")
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_rss_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let rss = host_peak_rss().expect("VmHWM");
            // A test process holds at least a megabyte and less than a terabyte.
            assert!((1 << 20..1 << 40).contains(&rss), "{rss}");
        }
    }
}
