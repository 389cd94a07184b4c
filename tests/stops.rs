//! Graceful stops, schedule extension, save-directory checks and the save lock of `lowbit train`,
//! end to end: the binary run as a child and signalled for real (SIGTERM: stop after the step,
//! save, exit 143, resume to the straight run's bits; a second signal aborts at once; SIGINT
//! without --save exits 130 saving nothing), two runs on one --save directory, --save paths that
//! cannot be written, and --extend-schedule through the library.

#![cfg(unix)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use lowbit::train::{
    self, Checkpointing, Extend, LlamaRun, ModelChoice, Precision, TrainConfig, TrainError,
};
use lowbit_llama::config::presets;

mod lowbit_cli;

use lowbit_cli::{lowbit, run_json, run_refused, stdout_ok};

const SIGINT: i32 = 2;
const SIGTERM: i32 = 15;

// SAFETY: the C library's `kill(2)` and `signal(2)` (std links the C library on every Unix;
// a handler is passed as its address, `sighandler_t`).
unsafe extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
    #[link_name = "signal"]
    fn set_signal(signum: i32, handler: usize) -> usize;
}

/// Sends `sig` to `child`.
fn signal(child: &Child, sig: i32) {
    let pid = i32::try_from(child.id()).unwrap();
    // SAFETY: `kill` only takes two integers; `pid` is our own child, not yet reaped.
    assert_eq!(unsafe { kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lowbit-stops-{name}-{}", std::process::id()));
    std::fs::remove_dir_all(&d).ok();
    d
}

/// llama-tiny on 2 ranks, a small step, a progress line per step (an eval every step: the
/// progress of a non-terminal prints at evals).
fn tiny(steps: &str) -> Vec<String> {
    [
        "--model",
        "llama-tiny",
        "--ranks",
        "2",
        "--batch",
        "4",
        "--seq",
        "32",
        "--eval-samples",
        "2",
        "--eval-every",
        "1",
        "--steps",
        steps,
    ]
    .map(String::from)
    .to_vec()
}

/// `lowbit train ARGS` as a child with stderr piped; returns it once its first progress line
/// arrived, with the rest of stderr collected by a thread.
fn start(args: &[String]) -> (Child, std::thread::JoinHandle<String>) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lowbit"));
    cmd.arg("train")
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // A test run from a background job of a non-interactive shell inherits SIGINT ignored
    // (POSIX), and lowbit keeps an ignored signal ignored: the child gets the default actions
    // back, as a run started from a terminal has them.
    // SAFETY: `signal` is async-signal-safe, the only call made between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            for sig in [SIGINT, SIGTERM] {
                set_signal(sig, 0);
            }
            Ok(())
        });
    }
    let mut child = cmd.spawn().expect("start lowbit");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut first = String::new();
    loop {
        first.clear();
        assert_ne!(err.read_line(&mut first).unwrap(), 0, "stderr ended early");
        if first.starts_with("step ") {
            break;
        }
    }
    let rest = std::thread::spawn(move || {
        let mut text = first;
        for line in err.lines() {
            text.push_str(&line.unwrap());
            text.push('\n');
        }
        text
    });
    (child, rest)
}

fn args(base: &[String], more: &[&str]) -> Vec<String> {
    let mut v = base.to_vec();
    v.extend(more.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The first SIGTERM stops after the current step with exit status 143, naming the checkpoint
/// of that step, which verifies and resumes to the straight run's final masters; while the run
/// lives a second run saving into its directory is refused naming it and the holder's pid, and
/// once it has ended the lock is free.
#[test]
fn sigterm_saves_the_step_and_resumes_to_the_straight_runs_bits() {
    let dir = tempdir("term");
    let d = dir.to_str().unwrap();
    let base = tiny("40");
    let straight = run_json(&strs(&base));
    let (child, rest) = start(&args(&base, &["--save", d]));
    let other = run_refused(&strs(&args(&base, &["--save", d])));
    assert!(other.contains(&format!("--save {d}")), "{other}");
    assert!(
        other.contains(": locked by another run saving into it"),
        "{other}"
    );
    assert!(other.contains(&format!("pid {}", child.id())), "{other}");
    signal(&child, SIGTERM);
    let mut child = child;
    let status = child.wait().unwrap();
    let stderr = rest.join().unwrap();
    assert_eq!(status.code(), Some(143), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.starts_with("lowbit train: stopped by SIGTERM after step "))
        .unwrap_or_else(|| panic!("no stop line: {stderr}"));
    let step: usize = line["lowbit train: stopped by SIGTERM after step ".len()..]
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..40).contains(&step), "{line}");
    let saved = dir.join(format!("step-{step}"));
    assert!(
        line.contains(&format!("saved {} (", saved.display())),
        "{line}"
    );
    let verify = stdout_ok(&["ckpt", "verify", saved.to_str().unwrap()]);
    assert!(!verify.is_empty());
    // The lock went with the process: a resume saving into the same directory runs.
    let resumed = run_json(&strs(&args(&base, &["--resume", d, "--save", d])));
    assert_eq!(resumed.key("first_step").number(), step as f64);
    assert_eq!(
        resumed.key("master_checksum"),
        straight.key("master_checksum"),
        "resumed after the stop at step {step}"
    );
    assert!(dir.join("step-40").is_dir());
    std::fs::remove_dir_all(&dir).ok();
}

/// A second signal while the first stop is pending ends the process at once, killed by the
/// signal (no graceful exit status); two different signals, so the kernel cannot merge them.
#[test]
fn a_second_signal_aborts_at_once() {
    let dir = tempdir("twice");
    let (mut child, rest) = start(&args(&tiny("100000"), &["--save", dir.to_str().unwrap()]));
    signal(&child, SIGTERM);
    signal(&child, SIGINT);
    let t = Instant::now();
    let status = child.wait().unwrap();
    let stderr = rest.join().unwrap();
    assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
    assert_eq!(status.code(), None, "exited instead of dying: {stderr}");
    assert!(
        matches!(status.signal(), Some(SIGINT | SIGTERM)),
        "{status:?}"
    );
    assert!(!stderr.contains("stopped by"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}

/// SIGINT without --save: the run stops after the step, says nothing was saved, exits 130.
#[test]
fn sigint_without_save_stops_and_says_nothing_was_saved() {
    let (mut child, rest) = start(&tiny("100000"));
    signal(&child, SIGINT);
    let status = child.wait().unwrap();
    let stderr = rest.join().unwrap();
    assert_eq!(status.code(), Some(130), "{stderr}");
    assert!(
        stderr.contains("stopped by SIGINT after step ")
            && stderr.contains("/100000; nothing was saved (no --save)"),
        "{stderr}"
    );
}

/// --save on a file, under a file, or on a directory that cannot be written fails before step
/// 1, naming the flag and the path.
#[test]
fn unwritable_save_directories_are_refused_before_step_one() {
    let dir = tempdir("unwritable");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let under = file.join("sub");
    let mut cases: Vec<(PathBuf, &str)> = vec![
        (file.clone(), "not a directory"),
        (under.clone(), "cannot create the directory"),
    ];
    // A read-only directory (root may write into it anyway: then it is not a case here) and
    // one nobody may create files in, root included.
    let ro = dir.join("read-only");
    std::fs::create_dir(&ro).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    if std::fs::write(ro.join("probe"), b"").is_err() {
        cases.push((ro.clone(), "the directory cannot be written"));
    }
    if Path::new("/proc/self").is_dir() {
        cases.push((PathBuf::from("/proc"), "the directory cannot be written"));
    }
    let base = tiny("3");
    for (path, why) in cases {
        let p = path.to_str().unwrap();
        let err = run_refused(&strs(&args(&base, &["--save", p])));
        assert!(err.contains(&format!("--save {p}: {why}")), "{p}: {err}");
        assert!(!err.contains("step "), "{p}: a step ran: {err}");
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::remove_dir_all(&dir).ok();
}

/// llama-tiny, 2 CPU ranks, 4 sequences of 32 tokens per step.
fn tiny_cfg(steps: usize) -> TrainConfig {
    TrainConfig {
        ranks: 2,
        precision: Precision::Mxfp8,
        microbatches: 1,
        batch: 4,
        steps,
        eval_every: 0,
        eval_samples: 2,
        lr: 3e-3,
        bucket_size: Some(20_000),
        model: ModelChoice::Llama(LlamaRun {
            preset: "llama-tiny".into(),
            config: presets::llama_tiny(),
            seq: 32,
        }),
        ..TrainConfig::default()
    }
}

fn resuming(from: PathBuf, extend: Option<Extend>, save: Option<&Path>) -> Checkpointing {
    Checkpointing {
        resume: Some(from),
        extend_schedule: extend,
        save: save.map(Path::to_path_buf),
        save_every: 2,
        ..Checkpointing::default()
    }
}

/// A run of 4 steps resumed at step 2 with --steps 8 and --extend-schedule cosine records the
/// schedule; resuming that run again (no flag: the recorded schedule) continues bit for bit.
/// constant gives another run; a larger --steps without the flag, or the flag without a larger
/// --steps or without --resume, is refused naming the flag.
#[test]
fn an_extended_schedule_is_recorded_and_resumes_bit_for_bit() {
    let a = tempdir("extend-a");
    let b = tempdir("extend-b");
    let first = Checkpointing {
        save: Some(a.clone()),
        save_every: 2,
        ..Checkpointing::default()
    };
    train::train_with(&tiny_cfg(4), &first, &|_| {}).unwrap();
    let cfg8 = tiny_cfg(8);
    let run = |ck: &Checkpointing| train::train_with(&cfg8, ck, &|_| {});
    let extended = run(&resuming(a.join("step-2"), Some(Extend::Cosine), Some(&b))).unwrap();
    assert_eq!((extended.first_step, extended.losses.len()), (2, 6));
    let manifest = lowbit::ckpt::Checkpoint::open(&b.join("step-6")).unwrap();
    assert_eq!(
        manifest.meta().config.get("schedule").map(String::as_str),
        Some("4 cosine@2->8")
    );
    // `lowbit eval` reads an extended checkpoint (the schedule is no flag of its own).
    let eval = lowbit(&["eval", b.join("step-6").to_str().unwrap(), "--json"]);
    assert!(
        eval.status.success(),
        "{}",
        String::from_utf8_lossy(&eval.stderr)
    );
    let again = run(&resuming(b.join("step-6"), None, None)).unwrap();
    assert_eq!(again.master_checksum, extended.master_checksum);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&again.losses), bits(&extended.losses[4..]));
    // Extended again: the recorded schedule gains a second extension.
    let c = tempdir("extend-c");
    let longer = train::train_with(
        &tiny_cfg(10),
        &resuming(b.join("step-8"), Some(Extend::Constant), Some(&c)),
        &|_| {},
    )
    .unwrap();
    assert_eq!(longer.first_step, 8);
    let manifest = lowbit::ckpt::Checkpoint::open(&c.join("step-10")).unwrap();
    assert_eq!(
        manifest.meta().config.get("schedule").map(String::as_str),
        Some("4 cosine@2->8 constant@8->10")
    );
    std::fs::remove_dir_all(&c).ok();
    // The same resume with a constant tail is another schedule, so other masters.
    let constant = run(&resuming(a.join("step-2"), Some(Extend::Constant), None)).unwrap();
    assert_ne!(constant.master_checksum, extended.master_checksum);
    let refusal = |r: Result<_, TrainError>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("should be refused"),
    };
    let no_flag = refusal(run(&resuming(a.join("step-4"), None, None)));
    assert!(
        no_flag.contains(
            "--steps is 8 here but 4 in the checkpoint: a larger --steps needs \
             --extend-schedule"
        ),
        "{no_flag}"
    );
    let same = refusal(train::train_with(
        &tiny_cfg(4),
        &resuming(a.join("step-2"), Some(Extend::Constant), None),
        &|_| {},
    ));
    assert!(
        same.contains("--extend-schedule constant needs --steps beyond"),
        "{same}"
    );
    let alone = Checkpointing {
        extend_schedule: Some(Extend::Cosine),
        ..Checkpointing::default()
    };
    let alone = refusal(run(&alone));
    assert!(
        alone.contains("--extend-schedule applies only with --resume"),
        "{alone}"
    );
    // The command line's flag needs --resume.
    let out = lowbit(&["train", "--extend-schedule", "cosine"]);
    assert_eq!(out.status.code(), Some(2));
    std::fs::remove_dir_all(&a).ok();
    std::fs::remove_dir_all(&b).ok();
}

/// Through the library: a request set before the run stops every rank after its first step;
/// under --async-save that step's checkpoint is committed before the run returns, and it
/// resumes to the straight run's masters. A run without a request is not disturbed by one
/// that was never set.
#[test]
fn a_stop_request_stops_after_the_step_and_commits_its_async_save() {
    let dir = tempdir("request");
    let cfg = tiny_cfg(3);
    let straight = train::train(&cfg, &|_| {}).unwrap();
    let stop = train::stop::StopRequest::new();
    assert!(stop.request(SIGTERM));
    let ck = Checkpointing {
        save: Some(dir.clone()),
        asynchronous: true,
        ..Checkpointing::default()
    };
    let steps = std::sync::Mutex::new(Vec::new());
    let r = train::train_until(&cfg, &ck, &stop, &|s| steps.lock().unwrap().push(s.step));
    match r {
        Err(TrainError::Stopped {
            signal,
            step,
            steps,
            saved,
        }) => {
            assert_eq!((signal, step, steps), (SIGTERM, 1, 3));
            assert_eq!(saved, Some(dir.join("step-1")));
        }
        other => panic!(
            "expected a stop, got {:?}",
            other.map(|r| r.master_checksum)
        ),
    }
    assert_eq!(*steps.lock().unwrap(), [1]);
    assert_eq!(lowbit::ckpt::latest_step(&dir).unwrap(), Some(1));
    assert!(!dir.join(".lowbit.lock").exists(), "the lock is released");
    let resumed = train::train_with(&cfg, &resuming(dir.clone(), None, None), &|_| {}).unwrap();
    assert_eq!(resumed.master_checksum, straight.master_checksum);
    std::fs::remove_dir_all(&dir).ok();
}
