//! `lowbit data prepare` / `inspect` end to end through the binary: the embedded sample's text
//! prepared and inspected, and inputs that must be refused (named, exit status 1, no manifest).

use std::path::Path;

use lowbit_dev_support::tempdir::TempDir;

mod lowbit_cli;

use lowbit_cli::lowbit;

fn p(path: &Path) -> &str {
    path.to_str().expect("UTF-8 temp path")
}

#[test]
fn prepare_then_inspect_the_sample_text() {
    let tmp = TempDir::new("data-cli");
    let sample = tmp.path("sample.txt");
    std::fs::write(
        &sample,
        include_str!("../crates/lowbit-llama/data/sample.txt"),
    )
    .unwrap();
    let out = tmp.path("tokens");
    let run = lowbit(&[
        "data",
        "prepare",
        p(&sample),
        "--out",
        p(&out),
        "--shard-tokens",
        "20000",
    ]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("tokenizer gpt2") && stdout.contains("u16"),
        "{stdout}"
    );
    assert!(out.join("manifest.json").is_file() && out.join("train-00001.bin").is_file());
    let run = lowbit(&["data", "inspect", p(&out), "--tokens", "8"]);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        stdout.contains("all shards verified") && stdout.contains("MACBETH"),
        "{stdout}"
    );
}

#[test]
fn refused_inputs_name_the_file_and_leave_no_manifest() {
    let tmp = TempDir::new("data-cli-bad");
    let out = tmp.path("tokens");
    let dir = tmp.dir().to_path_buf();
    for (input, want) in [
        (Path::new("/dev/zero"), "character device"),
        (&*dir, "directory"),
    ] {
        let run = lowbit(&["data", "prepare", p(input), "--out", p(&out)]);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{stderr}");
        assert!(
            stderr.contains(p(input)) && stderr.contains(want),
            "{stderr}"
        );
        assert!(!out.join("manifest.json").exists());
    }
    let run = lowbit(&[
        "data",
        "prepare",
        "/dev/null",
        "--out",
        p(&out),
        "--validation",
        "1",
    ]);
    assert!(String::from_utf8_lossy(&run.stderr).contains("--validation"));
    let run = lowbit(&["data", "inspect", p(&out)]);
    assert!(String::from_utf8_lossy(&run.stderr).contains("manifest.json"));
}
