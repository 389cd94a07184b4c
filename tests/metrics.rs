//! `lowbit train --metrics FILE.jsonl`, the progress lines off a terminal, `lowbit plot` and
//! `lowbit --version`: the records are the run's own values (bit for bit the `--json`
//! report's), written as each step completes (a killed run leaves its completed steps), appended
//! by a resumed run; a plot holds every run's curve and legend; bad files are refused by name
//! and line.

mod lowbit_cli;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use lowbit_cli::{Json, jsonl, lowbit, of_kind, refused, stdout_ok};
use lowbit_dev_support::tempdir::TempDir;

/// llama-tiny, 2 CPU ranks, 8 sequences of 64 tokens per step.
const TINY: &[&str] = &[
    "train",
    "--model",
    "llama-tiny",
    "--ranks",
    "2",
    "--batch",
    "8",
    "--eval-samples",
    "16",
];

fn args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    TINY.iter().copied().chain(extra.iter().copied()).collect()
}

/// `f32` bit pattern of a record's number, as the report spells it (`0x%08x`).
fn bits(v: &Json) -> String {
    format!("0x{:08x}", (v.number() as f32).to_bits())
}

#[test]
fn every_step_and_eval_is_a_record_with_the_reports_values() {
    let tmp = TempDir::new("metrics-steps");
    let file = tmp.path("run.jsonl");
    let f = file.to_str().unwrap();
    let out = lowbit(&args(&[
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--metrics",
        f,
        "--log-every",
        "0",
        "--peak-tflops",
        "0.5",
        "--json",
    ]));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = Json::parse(std::str::from_utf8(&out.stdout).unwrap()).expect("report");
    let recs = jsonl(&file);

    let header = &recs[0];
    assert_eq!(header.key("kind").text(), "run");
    assert_eq!(header.key("name").text(), "run");
    assert_eq!(
        header.key("lowbit_version").text(),
        env!("CARGO_PKG_VERSION")
    );
    assert!(!header.key("git_commit").text().is_empty());
    assert!(header.key("argv").contains_str("--metrics"));
    let config = header.key("config");
    assert_eq!(config.key("steps").as_u64(), Some(6));
    assert_eq!(config.key("model").key("name").text(), "llama-tiny");
    assert_eq!(header.key("peak_flops_per_rank").number(), 0.5e12);

    let steps = of_kind(&recs, "step");
    let want = report.key("steps").arr();
    assert_eq!(steps.len(), 6);
    assert_eq!(want.len(), 6);
    let model = report.key("model");
    let (layers, seq, dim) = (
        model.key("layers").number(),
        model.key("seq").number(),
        model.key("dim").number(),
    );
    let flops_per_token = 6.0 * report.key("params").number() + 12.0 * layers * seq * dim;
    let mut wall = 0.0;
    for (i, (s, w)) in steps.iter().zip(want).enumerate() {
        assert_eq!(s.key("step").as_u64(), Some(i as u64 + 1));
        // The same shortest decimal as the report's, and the report's f32 bits.
        assert_eq!(
            s.key("loss").number(),
            w.key("loss").number(),
            "step {}",
            i + 1
        );
        assert_eq!(bits(s.key("loss")), w.key("loss_bits").text());
        assert_eq!(bits(s.key("grad_norm")), w.key("grad_norm_bits").text());
        assert!(!s.key("skipped").flag());
        assert_eq!(s.key("tokens").as_u64(), Some((i as u64 + 1) * 8 * 64));
        let lr = s.key("lr");
        assert_eq!(lr.keys(), ["adamw"]);
        assert!(lr.key("adamw").number() > 0.0);
        assert!(s.key("device_peak_bytes").number() > 0.0);
        let t = s.key("wall_s").number();
        assert!(t > wall, "wall time grows: {t} after {wall}");
        wall = t;
        // MFU = tokens/s × FLOPs per token / (peak per rank × ranks).
        let tps = s.key("tokens_per_s").number();
        let mfu = s.key("mfu").number();
        let expect = tps * flops_per_token / (0.5e12 * 2.0);
        assert!((mfu - expect).abs() <= 1e-12 * expect, "{mfu} vs {expect}");
    }
    // The warmup's first rate is the peak's: lr falls over the cosine.
    let lr = |i: usize| steps[i].key("lr").key("adamw").number();
    assert!(lr(5) < lr(1));

    let evals = of_kind(&recs, "eval");
    let want = report.key("evals").arr();
    assert_eq!(evals.len(), 2);
    for (e, w) in evals.iter().zip(want) {
        assert_eq!(e.key("step").as_u64(), w.key("step").as_u64());
        assert_eq!(bits(e.key("eval_loss")), w.key("loss_bits").text());
        assert_eq!(e.key("eval_tokens").as_u64(), Some(16 * 64));
    }
    assert_eq!(evals[0].key("step").as_u64(), Some(3));
    // Records in completion order: step 3, its eval, step 4.
    let kinds: Vec<&str> = recs.iter().map(|r| r.key("kind").text()).collect();
    assert_eq!(
        kinds,
        [
            "run", "step", "step", "step", "eval", "step", "step", "step", "eval"
        ]
    );

    // Off a terminal with --log-every 0: one plain line per eval, with lr and ETA.
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with("step ")).collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    assert!(lines[0].starts_with("step 3/6  loss "), "{}", lines[0]);
    for l in lines {
        assert!(
            l.contains(" eval ") && l.contains(" lr ") && l.contains(" ETA "),
            "{l}"
        );
    }
}

#[test]
fn a_resumed_run_appends_its_records_with_the_straight_runs_values() {
    let tmp = TempDir::new("metrics-resume");
    let file = tmp.path("run.jsonl");
    let ckpt = tmp.path("ckpt");
    let (f, c) = (file.to_str().unwrap(), ckpt.to_str().unwrap());
    stdout_ok(&args(&[
        "--steps",
        "4",
        "--save",
        c,
        "--save-every",
        "2",
        "--metrics",
        f,
        "--log-every",
        "0",
    ]));
    let straight = jsonl(&file);
    let step2 = ckpt.join("step-2");
    stdout_ok(&args(&[
        "--steps",
        "4",
        "--resume",
        step2.to_str().unwrap(),
        "--metrics",
        f,
    ]));
    let recs = jsonl(&file);
    assert_eq!(
        &recs[..straight.len()],
        &straight[..],
        "the first run's records stay"
    );
    let runs = of_kind(&recs, "run");
    assert_eq!(runs.len(), 2);
    let steps: Vec<u64> = of_kind(&recs, "step")
        .iter()
        .map(|s| s.key("step").as_u64().unwrap())
        .collect();
    assert_eq!(steps, [1, 2, 3, 4, 3, 4]);
    let loss = |r: &[Json], step: u64| {
        of_kind(r, "step")
            .into_iter()
            .filter(|s| s.key("step").as_u64() == Some(step))
            .map(|s| bits(s.key("loss")))
            .collect::<Vec<_>>()
    };
    for step in [3, 4] {
        let both = loss(&recs, step);
        assert_eq!(both.len(), 2);
        assert_eq!(
            both[0], both[1],
            "step {step}: the resumed run's loss is the straight run's"
        );
    }
}

#[test]
fn a_killed_run_leaves_every_completed_step_on_disk() {
    let tmp = TempDir::new("metrics-killed");
    let file = tmp.path("run.jsonl");
    let mut child = Command::new(env!("CARGO_BIN_EXE_lowbit"))
        .args(args(&["--steps", "500", "--eval-every", "0", "--metrics"]))
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn lowbit");
    let t = Instant::now();
    // Wait for the header and three steps, then kill without warning (no cleanup runs).
    loop {
        let n = std::fs::read_to_string(&file).map_or(0, |s| s.lines().count());
        if n >= 4 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "no steps recorded");
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("kill");
    child.wait().expect("wait");
    let recs = jsonl(&file);
    assert_eq!(recs[0].key("kind").text(), "run");
    let steps: Vec<u64> = recs[1..]
        .iter()
        .map(|s| {
            assert_eq!(s.key("kind").text(), "step");
            s.key("step").as_u64().unwrap()
        })
        .collect();
    assert!(steps.len() >= 3 && steps.len() < 500, "{steps:?}");
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
}

#[test]
fn a_metrics_file_that_cannot_be_written_is_refused_before_training() {
    let tmp = TempDir::new("metrics-refused");
    let bad = tmp.path("missing-dir").join("run.jsonl");
    let b = bad.to_str().unwrap();
    let err = refused(&args(&["--steps", "2", "--metrics", b]));
    assert!(err.contains("--metrics") && err.contains(b), "{err}");
    assert!(!err.contains("step "), "refused before step 1: {err}");
    for (flag, why) in [
        ("--log-every=-1", "--log-every -1"),
        ("--log-every=inf", "--log-every inf"),
        ("--peak-tflops=0", "--peak-tflops 0"),
    ] {
        let err = refused(&args(&["--steps", "2", flag]));
        assert!(err.contains(why), "{err}");
    }
}

/// A metrics file of `n` steps with losses `base - step/10` and evals every 2 steps.
fn synthetic(name: Option<&str>, n: u64, base: f64) -> String {
    let mut s = String::new();
    if let Some(name) = name {
        s += &format!("{{\"kind\":\"run\",\"name\":\"{name}\"}}\n");
    }
    for step in 1..=n {
        let loss = base - step as f64 / 10.0;
        s += &format!(
            "{{\"kind\":\"step\",\"step\":{step},\"loss\":{loss},\"grad_norm\":1.5,\
             \"lr\":{{\"adamw\":0.001,\"muon\":0.02}},\"tokens\":{},\"tokens_per_s\":900.5}}\n",
            step * 512
        );
        if step % 2 == 0 {
            s += &format!(
                "{{\"kind\":\"eval\",\"step\":{step},\"eval_loss\":{},\"tokens\":{}}}\n",
                loss + 0.05,
                step * 512
            );
        }
    }
    s
}

/// The series of an SVG: polylines of width 2 with more than two points (legend samples have
/// two), by colour.
fn series(svg: &str) -> Vec<String> {
    let mut colours: Vec<String> = svg
        .split("<polyline")
        .skip(1)
        .filter(|p| p.contains("stroke-width=\"2\""))
        .filter(|p| {
            let pts = p.split("points=\"").nth(1).unwrap_or("");
            pts.split('"')
                .next()
                .unwrap_or("")
                .split_whitespace()
                .count()
                > 2
        })
        .map(|p| {
            p.split("stroke=\"")
                .nth(1)
                .unwrap()
                .split('"')
                .next()
                .unwrap()
                .to_string()
        })
        .collect();
    colours.sort();
    colours.dedup();
    colours
}

#[test]
fn plot_draws_every_run_with_its_legend() {
    let tmp = TempDir::new("metrics-plot");
    let a = tmp.path("a.jsonl");
    let b = tmp.path("mxfp8-run.jsonl");
    std::fs::write(&a, synthetic(Some("bf16 baseline"), 6, 5.0)).unwrap();
    std::fs::write(&b, synthetic(None, 6, 5.5)).unwrap();
    let out = tmp.path("curves.svg");
    let (a, b, o) = (
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    stdout_ok(&["plot", a, b, "--out", o]);
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg"), "{svg:.80}");
    assert_eq!(series(&svg).len(), 2, "two runs, two coloured lines");
    // Legends: the header's name, else the file stem.
    assert!(svg.contains("bf16 baseline"), "legend of the named run");
    assert!(svg.contains("mxfp8-run"), "legend from the file stem");
    // Eval markers: three evals per run.
    assert_eq!(svg.matches("<circle").count(), 6);

    // Every metric and axis draws; lr has a curve (a colour) per run and optimizer group.
    for extra in [
        &["--metric", "lr"][..],
        &["--metric", "eval_loss", "--x", "tokens"],
        &["--metric", "grad_norm", "--log-y"],
        &["--metric", "tokens_per_s", "--smooth", "3"],
    ] {
        let mut argv = vec!["plot", a, b, "--out", o];
        argv.extend_from_slice(extra);
        stdout_ok(&argv);
        let svg = std::fs::read_to_string(&out).unwrap();
        let want = if extra[1] == "lr" { 4 } else { 2 };
        assert_eq!(series(&svg).len(), want, "{extra:?}");
        assert!(svg.contains("mxfp8-run"), "{extra:?}");
        if extra[1] == "lr" {
            assert!(svg.contains("mxfp8-run muon") && svg.contains("bf16 baseline adamw"));
        }
    }
}

#[test]
fn plot_refuses_empty_and_garbled_files_by_name_and_line() {
    let tmp = TempDir::new("metrics-plot-bad");
    let out = tmp.path("c.svg");
    let o = out.to_str().unwrap();
    let empty = tmp.path("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let err = refused(&["plot", empty.to_str().unwrap(), "--out", o]);
    assert!(
        err.contains("empty.jsonl") && err.contains("no records"),
        "{err}"
    );

    let garbled = tmp.path("garbled.jsonl");
    let mut text = synthetic(Some("x"), 1, 5.0);
    text += "{\"kind\":\"step\",\"step\":2,\"loss\":4.\n";
    std::fs::write(&garbled, text).unwrap();
    let err = refused(&["plot", garbled.to_str().unwrap(), "--out", o]);
    assert!(err.contains("garbled.jsonl:3:"), "{err}");

    let no_step = tmp.path("nostep.jsonl");
    std::fs::write(&no_step, "{\"kind\":\"step\",\"loss\":1}\n").unwrap();
    let err = refused(&["plot", no_step.to_str().unwrap(), "--out", o]);
    assert!(
        err.contains("nostep.jsonl:1:") && err.contains("step"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written for a refused input");
}

#[test]
fn version_names_the_crate_version_and_the_commit() {
    let v = stdout_ok(&["--version"]);
    let rest = v
        .trim()
        .strip_prefix(&format!("lowbit {} (", env!("CARGO_PKG_VERSION")))
        .unwrap_or_else(|| panic!("{v}"));
    let commit = rest.strip_suffix(')').unwrap_or_else(|| panic!("{v}"));
    let hex = commit.trim_end_matches("-dirty");
    assert!(
        commit == "unknown" || (hex.len() >= 7 && hex.chars().all(|c| c.is_ascii_hexdigit())),
        "{v}"
    );
}

#[test]
fn muon_runs_record_both_optimizer_groups_learning_rates() {
    let tmp = TempDir::new("metrics-muon");
    let file = tmp.path("muon.jsonl");
    stdout_ok(&args(&[
        "--steps",
        "2",
        "--optimizer",
        "muon",
        "--muon-lr",
        "0.02",
        "--lr",
        "0.004",
        "--metrics",
        file.to_str().unwrap(),
    ]));
    let recs = jsonl(&file);
    assert_eq!(
        recs[0].key("config").key("muon_lr").number() as f32,
        0.02f32
    );
    let steps = of_kind(&recs, "step");
    assert_eq!(steps.len(), 2);
    for s in steps {
        let lr = s.key("lr");
        assert_eq!(lr.keys(), ["adamw", "muon"]);
        // Muon's rate is the schedule's at its own peak: AdamW's times 0.02 / 0.004.
        let ratio = lr.key("muon").number() / lr.key("adamw").number();
        assert!((ratio - 5.0).abs() < 1e-5, "{ratio}");
    }
}
