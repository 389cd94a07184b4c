//! Running the `lowbit` binary from the root package's tests: `lowbit train ARGS --json`
//! parsed, a refusal's stderr, and the part of a report that must be bit-identical between two
//! runs of the same arithmetic.

#![allow(dead_code)] // each test file uses part of it

use std::process::{Command, Output};

// The workspace's small JSON reader, with strict accessors for the assertions.
pub use lowbit_dev_support::json::Json;

/// Runs `lowbit ARGS` (any subcommand).
pub fn lowbit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_lowbit"))
        .args(args)
        .output()
        .expect("run lowbit")
}

/// Runs `lowbit ARGS` expecting success; returns stdout.
pub fn stdout_ok(args: &[&str]) -> String {
    let out = lowbit(args);
    assert!(
        out.status.success(),
        "lowbit {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

/// Runs `lowbit ARGS` expecting a failure; returns stderr.
pub fn refused(args: &[&str]) -> String {
    let out = lowbit(args);
    assert!(!out.status.success(), "lowbit {args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `lowbit train ARGS --json` and parses its stdout (one JSON object on one line).
pub fn run_json(args: &[&str]) -> Json {
    let out = Command::new(env!("CARGO_BIN_EXE_lowbit"))
        .arg("train")
        .args(args)
        .arg("--json")
        .output()
        .expect("run lowbit");
    let stdout = String::from_utf8(out.stdout).expect("utf-8 stdout");
    assert!(
        out.status.success(),
        "lowbit train {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "one JSON object on one line");
    Json::parse(&stdout).unwrap_or_else(|e| panic!("invalid JSON ({e}): {stdout}"))
}

/// Runs `lowbit train ARGS` expecting a refusal; returns stderr.
pub fn run_refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_lowbit"))
        .arg("train")
        .args(args)
        .output()
        .expect("run lowbit");
    assert!(!out.status.success(), "lowbit train {args:?} should fail");
    assert!(out.stdout.is_empty(), "nothing on stdout when refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `f` of every record of list `list`.
pub fn records<T>(j: &Json, list: &str, f: impl Fn(&Json) -> T) -> Vec<T> {
    j.key(list).arr().iter().map(f).collect()
}

/// What must be identical, bit for bit, between two runs of the same arithmetic: every step's
/// loss and grad norm bits, every eval's loss bits, the master checksum.
pub fn trajectory(j: &Json) -> (Vec<String>, Vec<String>, Vec<String>, String) {
    let bits = |list: &str, key: &str| records(j, list, |s| s.key(key).text().to_string());
    (
        bits("steps", "loss_bits"),
        bits("steps", "grad_norm_bits"),
        bits("evals", "loss_bits"),
        j.key("master_checksum").text().to_string(),
    )
}

/// Every line of a JSON-lines file (`--metrics`), parsed; panics naming the line that is not
/// JSON.
pub fn jsonl(path: &std::path::Path) -> Vec<Json> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{}: every record is a whole line",
        path.display()
    );
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            Json::parse(l).unwrap_or_else(|e| panic!("{}:{}: {e}: {l}", path.display(), i + 1))
        })
        .collect()
}

/// The records of `kind` among `records`.
pub fn of_kind<'a>(records: &'a [Json], kind: &str) -> Vec<&'a Json> {
    records
        .iter()
        .filter(|r| r.key("kind").text() == kind)
        .collect()
}
