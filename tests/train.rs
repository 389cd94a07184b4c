//! `lowbit train` end to end: the command line and its JSON, bitwise equalities between paths
//! that must compute the same thing (low-precision gather on/off, grouped/discrete experts,
//! train → eval → train), convergence to the known floor, and refusals of invalid runs.

use std::process::Command;

use lowbit::train::{TrainConfig, train};

// The workspace's small JSON reader (no parser dependency), with strict accessors for the
// assertions here.
use lowbit_dev_support::json::Json;

trait Strict {
    fn key(&self, k: &str) -> &Json;
    fn num(&self) -> f64;
    fn text(&self) -> &str;
    fn flag(&self) -> bool;
}

impl Strict for Json {
    fn key(&self, k: &str) -> &Json {
        assert!(self.keys().contains(&k), "no key {k} in {:?}", self.keys());
        self.get(k)
    }
    fn num(&self) -> f64 {
        match self {
            Json::Num(x) => *x,
            other => panic!("not a number: {other:?}"),
        }
    }
    fn text(&self) -> &str {
        self.str()
            .unwrap_or_else(|| panic!("not a string: {self:?}"))
    }
    fn flag(&self) -> bool {
        match self {
            Json::Bool(b) => *b,
            other => panic!("not a bool: {other:?}"),
        }
    }
}

/// Runs `lowbit train ARGS --json` and parses its stdout.
fn run_json(args: &[&str]) -> Json {
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
fn run_refused(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_lowbit"))
        .arg("train")
        .args(args)
        .output()
        .expect("run lowbit");
    assert!(!out.status.success(), "lowbit train {args:?} should fail");
    assert!(out.stdout.is_empty(), "nothing on stdout when refused");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Small, fast runs: 128 samples per step over 4 ranks x 2 microbatches.
const SMALL: &[&str] = &["--batch", "128", "--steps", "5", "--eval-every", "2"];

fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    SMALL.iter().copied().chain(extra.iter().copied()).collect()
}

/// What must be identical, bit for bit, between two runs of the same arithmetic.
fn trajectory(j: &Json) -> (Vec<String>, Vec<String>, Vec<String>, String) {
    let bits = |arr: &Json, key: &str| -> Vec<String> {
        arr.arr()
            .iter()
            .map(|s| s.key(key).text().to_string())
            .collect()
    };
    (
        bits(j.key("steps"), "loss_bits"),
        bits(j.key("steps"), "grad_norm_bits"),
        bits(j.key("evals"), "loss_bits"),
        j.key("master_checksum").text().to_string(),
    )
}

#[test]
fn cli_runs_end_to_end_and_its_json_is_complete() {
    let j = run_json(SMALL);
    let steps = j.key("steps").arr();
    assert_eq!(steps.len(), 5);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s.key("step").num(), (i + 1) as f64);
        // The decimal and the bit pattern are the same f32.
        let bits = u32::from_str_radix(&s.key("loss_bits").text()[2..], 16).unwrap();
        assert_eq!(s.key("loss").num() as f32, f32::from_bits(bits));
        let loss = f32::from_bits(bits);
        assert!(loss.is_finite() && loss > 0.0, "loss {loss}");
        assert!(s.key("grad_norm").num() > 0.0);
    }
    let evals: Vec<f64> = j
        .key("evals")
        .arr()
        .iter()
        .map(|e| e.key("step").num())
        .collect();
    assert_eq!(evals, [2.0, 4.0, 5.0], "every 2 steps and after the last");
    let floor = j.key("floor").num();
    let eval = j.key("evals").arr()[2].key("loss").num();
    assert!(
        j.key("eval_exact").flag(),
        "the Markov eval set is exhaustive"
    );
    assert!(
        eval >= floor,
        "an exact expected loss is never below the floor"
    );
    assert_eq!(j.key("master_checksum").text().len(), 16);
    // Memory: categories add up, and sharding beats the bf16 unsharded baseline.
    let mem = |k: &str| {
        let m = j.key("memory").key(k);
        let parts: f64 = [
            "weights",
            "grads",
            "masters",
            "optimizer_state",
            "grad_scratch",
        ]
        .iter()
        .map(|c| m.key(c).num())
        .sum();
        assert_eq!(parts, m.key("total").num(), "{k} total");
        m.key("total").num()
    };
    assert!(mem("per_rank") < mem("bf16_unsharded"));
    let master = j.key("memory").key("per_rank").key("masters").num();
    let base = j.key("memory").key("bf16_unsharded").key("masters").num();
    assert!(master * 3.0 < base, "masters sharded over 4 ranks");
    // Collectives: gradients reduce-scattered, parameters all-gathered.
    let comm = j.key("comm");
    assert!(comm.key("reduce_scatter").key("bytes").num() > 0.0);
    assert!(comm.key("all_gather").key("bytes").num() > 0.0);
}

#[test]
fn low_precision_gather_on_and_off_give_identical_losses_and_masters() {
    for precision in ["mxfp8", "nvfp4"] {
        let on = run_json(&with(&["--precision", precision, "--param-gather", "on"]));
        let off = run_json(&with(&["--precision", precision, "--param-gather", "off"]));
        assert_eq!(trajectory(&on), trajectory(&off), "{precision}");
        // And they are different paths: the gathers move different bytes.
        assert_ne!(
            on.key("comm").key("all_gather").key("bytes").num(),
            off.key("comm").key("all_gather").key("bytes").num(),
            "{precision}"
        );
    }
}

#[test]
fn grouped_and_discrete_experts_train_to_the_same_bits() {
    for extra in [
        &["--precision", "bf16"][..],
        &["--precision", "mxfp8", "--param-gather", "on"],
        &[
            "--precision",
            "mxfp8",
            "--param-gather",
            "off",
            "--grad-dtype",
            "bf16",
        ],
        &["--precision", "nvfp4", "--param-gather", "on"],
    ] {
        let grouped = run_json(&with(extra));
        let discrete = run_json(&with(&[extra, &["--discrete-experts"][..]].concat()));
        assert!(grouped.key("grouped_experts").flag());
        assert!(!discrete.key("grouped_experts").flag());
        let (g, d) = (trajectory(&grouped), trajectory(&discrete));
        assert_eq!(g.0, d.0, "{extra:?}: losses");
        assert_eq!(g.1, d.1, "{extra:?}: grad norms");
        assert_eq!(g.2, d.2, "{extra:?}: eval losses");
        assert_eq!(g.3, d.3, "{extra:?}: final masters");
    }
}

#[test]
fn train_eval_train_matches_train_only() {
    // Evaluating forces a parameter sync in the middle of the staged-gather cycle; it must not
    // change what training computes (Megatron's train -> eval -> train check).
    let base = ["--batch", "128", "--steps", "6", "--precision", "mxfp8"];
    let every = run_json(&[&base[..], &["--eval-every", "1"]].concat());
    let end = run_json(&[&base[..], &["--eval-every", "0"]].concat());
    assert_eq!(every.key("evals").arr().len(), 6);
    assert_eq!(end.key("evals").arr().len(), 1);
    let (a, b) = (trajectory(&every), trajectory(&end));
    assert_eq!(a.0, b.0, "losses");
    assert_eq!(a.1, b.1, "grad norms");
    assert_eq!(a.2.last(), b.2.last(), "final eval");
    assert_eq!(a.3, b.3, "final masters");
}

#[test]
fn the_default_run_trains_to_within_0_05_nats_of_the_entropy_floor() {
    let report = train(&TrainConfig::default(), &|_| {}).expect("default run");
    let floor = report.floor.expect("the Markov source has a floor");
    let eval = f64::from(report.evals.last().expect("final eval").1);
    assert!(report.eval_set.1, "exhaustive eval set");
    assert!(eval >= floor, "eval {eval} below the floor {floor}");
    assert!(
        eval - floor < 0.05,
        "eval {eval} is {} nats above the floor {floor}",
        eval - floor
    );
    // The first step starts near the uniform guess ln 8.
    assert!(f64::from(report.losses[0]) > floor + 0.3);
}

#[test]
fn invalid_combinations_are_refused_up_front_with_the_reason() {
    for (args, reason) in [
        (
            &["--precision", "bf16", "--param-gather", "on"][..],
            "--param-gather on needs --precision mxfp8 or nvfp4",
        ),
        (
            &[
                "--overlap-grad-reduce",
                "off",
                "--overlap-param-gather",
                "on",
            ],
            "--overlap-param-gather on needs --overlap-grad-reduce on",
        ),
        (
            &["--overlap-grad-reduce", "off", "--bucket-size", "1000"],
            "--bucket-size applies only with --overlap-grad-reduce on",
        ),
        (
            &["--ranks", "3"],
            "does not split into 3 ranks x 2 microbatches",
        ),
        (&["--ranks", "0"], "--ranks 0 must be in 1..=64"),
        (&["--steps", "0"], "--steps must be at least 1"),
        (&["--data", "/nonexistent/corpus.txt"], "cannot read"),
    ] {
        let err = run_refused(args);
        assert!(err.contains(reason), "{args:?}: {err}");
        assert!(err.starts_with("error: "), "{args:?}: {err}");
    }
    if !lowbit::train::HAS_CUDA {
        let err = run_refused(&["--device", "cuda"]);
        assert!(err.contains("--features cuda"), "{err}");
    }
}

#[test]
fn trains_on_the_bytes_of_a_text_file() {
    let dir = std::env::temp_dir().join(format!("lowbit-train-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("corpus.txt");
    let text = "the quick brown fox jumps over the lazy dog. ".repeat(200);
    std::fs::write(&path, text).unwrap();
    let j = run_json(&with(&["--data", path.to_str().unwrap()]));
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(j.key("floor"), &Json::Null, "no known floor for a file");
    assert!(!j.key("eval_exact").flag());
    let losses: Vec<f64> = j
        .key("steps")
        .arr()
        .iter()
        .map(|s| s.key("loss").num())
        .collect();
    // Byte vocabulary: starts near ln 256 and learns the repetitive text.
    assert!(losses[0] > 4.0 && losses[4] < losses[0], "{losses:?}");
}
