//! `cargo xtask`: project automation in Rust, so it needs nothing beyond cargo.
//!
//! Tasks:
//! - `ci`: what `.ci/run` does (format check, clippy with warnings denied, the README's test
//!   command), for running locally before a commit.
//!
//! The CUDA backend adds `ptx` (build `cuda/*.cu` with a pinned toolchain) and `gpu-bundle`.

use std::process::{Command, ExitCode};

/// The README's test command; `.ci/run` runs the same one (checked by a test below).
const TEST_COMMAND: &[&str] = &["test", "--workspace"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => run_ci(),
        Some("help") | Some("--help") | Some("-h") | None => {
            eprintln!(
                "usage: cargo xtask <task>\n\ntasks:\n  ci    format check, clippy -D warnings, tests"
            );
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("error: unknown task `{other}` (try `cargo xtask help`)");
            ExitCode::from(2)
        }
    }
}

fn run_ci() -> ExitCode {
    let steps: [&[&str]; 3] = [
        &["fmt", "--all", "--", "--check"],
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--all-features",
            "--",
            "-D",
            "warnings",
        ],
        TEST_COMMAND,
    ];
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for step in steps {
        eprintln!("== cargo {}", step.join(" "));
        match Command::new(&cargo).args(step).status() {
            Ok(s) if s.success() => {}
            Ok(s) => {
                eprintln!("error: `cargo {}` failed ({s})", step.join(" "));
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("error: cannot run cargo: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::TEST_COMMAND;

    fn repo_file(name: &str) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::read_to_string(root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// CI must run exactly the test command the README documents.
    #[test]
    fn readme_and_ci_share_the_test_command() {
        let cmd = format!("cargo {}", TEST_COMMAND.join(" "));
        assert!(
            repo_file("README.md").contains(&cmd),
            "README lacks `{cmd}`"
        );
        assert!(repo_file(".ci/run").contains(&cmd), ".ci/run lacks `{cmd}`");
    }
}
