//! `cargo xtask`: project automation in Rust, so it needs nothing beyond cargo.
//!
//! Tasks:
//! - `ci`: what `.ci/run` does (format check, clippy with warnings denied, the API docs with
//!   warnings denied, the README's test command), for running locally before a commit.
//! - `ptx`: compiles `crates/lowbit-kernels/*.cu` (which include the shared headers of its
//!   `include/`) to PTX for sm_90 into `crates/lowbit-kernels/ptx/` (committed, embedded by the
//!   `lowbit-kernels` package, re-exported as `lowbit_device::ptx`), each file headed by the hash
//!   of its source and the headers (`lowbit_kernels::module_hash`), first installing the pinned
//!   CUDA 13.0 compiler from PyPI into a cache folder (`$LOWBIT_CUDA_TOOLCHAIN`, default
//!   `target/cuda-toolchain-13.0`). Newer compilers write PTX that the GPUs' CUDA 13.0 driver
//!   cannot load, hence the pins.
//! - `gpu-bundle`: release build (`--features cuda`) of every CUDA test, bench and example
//!   executable and the `lowbit` binary into the git-ignored `gpu-bundle/`, with `run.sh`, which
//!   runs the GPU matrix there and writes results to `$OUT` (see `gpu_bundle` and
//!   `xtask/gpu/run.sh`, whose step list is the one place to add steps).

mod gpu_bundle;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// cargo's JSON messages are read with the workspace's small reader (no parser dependency).
use lowbit_dev_support::json;

/// The CUDA 13.0 compiler packages, installed without dependencies.
const CUDA_WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
    "nvidia-cuda-runtime==13.0.96",
];
/// The architecture the PTX targets (Hopper; the driver JIT-compiles it for newer GPUs), unless
/// a module's entry in `lowbit_kernels::MODULES` names another (`sm_90a`).
const ARCH: &str = "sm_90";

/// The README's test command; `.ci/run` runs the same one (checked by a test below).
const TEST_COMMAND: &[&str] = &["test", "--workspace"];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("ci") => run_ci(),
        Some("ptx") => match build_ptx() {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
        Some("gpu-bundle") => {
            match gpu_bundle::gpu_bundle(&repo_root(), args.iter().any(|a| a == "--allow-partial"))
            {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("help") | Some("--help") | Some("-h") | None => {
            eprintln!(
                "usage: cargo xtask <task>\n\ntasks:\n  ci          format check, clippy -D \
                 warnings, docs -D warnings, tests\n  ptx         crates/lowbit-kernels/*.cu -> its ptx/*.ptx (pinned CUDA 13.0)\n  \
                 gpu-bundle  CUDA executables + run.sh into gpu-bundle/"
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
    let steps: [&[&str]; 4] = [
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
        &["doc", "--workspace", "--no-deps"],
        TEST_COMMAND,
    ];
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    for step in steps {
        eprintln!("== cargo {}", step.join(" "));
        let mut cmd = Command::new(&cargo);
        cmd.args(step);
        if step[0] == "doc" {
            // Broken or private intra-doc links fail the docs step, as in `.ci/run` (only
            // there: the flag would also apply to the tests' doctests).
            cmd.env("RUSTDOCFLAGS", "-D warnings");
        }
        match cmd.status() {
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

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// `nvcc` of the pinned toolchain, installed into the cache folder first if needed.
fn ensure_toolchain() -> Result<PathBuf, String> {
    let dir = std::env::var_os("LOWBIT_CUDA_TOOLCHAIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target/cuda-toolchain-13.0"));
    let nvcc = dir.join("nvidia/cu13/bin/nvcc");
    if !nvcc.exists() {
        eprintln!(
            "installing the CUDA 13.0 compiler from PyPI into {}",
            dir.display()
        );
        let status = Command::new("python3")
            .args(["-m", "pip", "install", "--quiet", "--no-deps", "--target"])
            .arg(&dir)
            .args(CUDA_WHEELS)
            .status()
            .map_err(|e| format!("cannot run python3 -m pip: {e}"))?;
        if !status.success() || !nvcc.exists() {
            return Err(format!("pip could not install {}", CUDA_WHEELS.join(" ")));
        }
    }
    let version = Command::new(&nvcc)
        .arg("--version")
        .output()
        .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
    let text = String::from_utf8_lossy(&version.stdout);
    if !text.contains("release 13.0") {
        return Err(format!("{} is not CUDA 13.0:\n{text}", nvcc.display()));
    }
    Ok(nvcc)
}

/// The `lowbit-kernels` package: the kernel sources, `include/` and `ptx/`.
const KERNELS_DIR: &str = "crates/lowbit-kernels";

/// Compiles every `*.cu` of [`KERNELS_DIR`] to its `ptx/<stem>.<ARCH>.ptx`, prefixed with the
/// hash of the source and the shared headers.
fn build_ptx() -> Result<(), String> {
    let nvcc = ensure_toolchain()?;
    let cuda = repo_root().join(KERNELS_DIR);
    let out_dir = cuda.join("ptx");
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cuda)
        .map_err(|e| format!("{}: {e}", cuda.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    for src in sources {
        let stem = src
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or("bad file name")?;
        // Hashed before compiling, so a source edited while nvcc runs reads as stale.
        let hash =
            lowbit_kernels::module_hash(&cuda, stem).map_err(|e| format!("{e}: {}", e.source))?;
        // The module's own target (sm_90a for wgmma), named by its entry in MODULES.
        let arch = lowbit_kernels::MODULES
            .iter()
            .find(|m| m.name == stem)
            .map_or(ARCH, |m| m.arch);
        // The virtual-architecture form for sm_90a: `-arch=sm_90a` also runs a plain sm_90 pass
        // that rejects wgmma in some nvcc versions.
        let flag = if arch == ARCH {
            format!("-arch={ARCH}")
        } else {
            format!("-arch={}", arch.replace("sm_", "compute_"))
        };
        let tmp = out_dir.join(format!(".{stem}.ptx.tmp"));
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", &flag])
            .arg(&src)
            .arg("-o")
            .arg(&tmp)
            .status()
            .map_err(|e| format!("cannot run nvcc: {e}"))?;
        if !status.success() {
            return Err(format!("nvcc failed on {}", src.display()));
        }
        let ptx = std::fs::read_to_string(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
        std::fs::remove_file(&tmp).ok();
        let header = format!("{}{hash:016x}\n", lowbit_kernels::HASH_HEADER);
        let out = out_dir.join(format!("{stem}.{arch}.ptx"));
        std::fs::write(&out, header + &ptx).map_err(|e| format!("{}: {e}", out.display()))?;
        eprintln!("wrote {}", out.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::TEST_COMMAND;

    fn repo_file(name: &str) -> String {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::read_to_string(root.join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
    }

    /// run.sh parses, lists its hand-written steps, and keeps NVLink multicast off.
    #[test]
    fn gpu_run_script_lists_its_steps() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = std::env::temp_dir().join(format!("lowbit-run-sh-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(root.join("gpu/run.sh"), dir.join("run.sh")).unwrap();
        std::fs::write(dir.join("tests.list"), "# comment\ntest-a||bin/test-a\n").unwrap();
        let out = std::process::Command::new("bash")
            .arg(dir.join("run.sh"))
            .arg("--list")
            .output()
            .expect("bash");
        std::fs::remove_dir_all(&dir).ok();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let names = String::from_utf8_lossy(&out.stdout);
        let names: Vec<&str> = names.lines().collect();
        assert_eq!(names[0], "test-a");
        assert!(names.contains(&"bench-nccl") && names.contains(&"compare-collectives"));
        assert!(repo_file("xtask/gpu/run.sh").contains("export NCCL_NVLS_ENABLE=0"));
    }

    /// Every `bin/NAME` that run.sh and its helper scripts call is a binary the bundle makes:
    /// `lowbit`, `test-PKG-T` / `bench-PKG-T` for `tests/T` / `benches/T` of package PKG,
    /// `unit-PKG`, or an example's own name; a renamed or moved target fails here, not on a GPU.
    #[test]
    fn gpu_scripts_name_targets_that_exist() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut packages = vec![("lowbit".to_string(), root.clone())];
        for dir in std::fs::read_dir(root.join("crates")).unwrap().flatten() {
            let manifest =
                std::fs::read_to_string(dir.path().join("Cargo.toml")).unwrap_or_default();
            let name = manifest
                .lines()
                .find_map(|l| l.strip_prefix("name = \""))
                .and_then(|l| l.strip_suffix('"'));
            if let Some(name) = name {
                packages.push((name.to_string(), dir.path()));
            }
        }
        let target = |dir: &std::path::Path, kind: &str, t: &str| {
            dir.join(kind).join(format!("{t}.rs")).is_file()
                || dir.join(kind).join(t).join("main.rs").is_file()
        };
        let exists = |name: &str| {
            if name == "lowbit" {
                return root.join("src/main.rs").is_file();
            }
            for (kind, prefix) in [("tests", "test-"), ("benches", "bench-")] {
                if let Some(rest) = name.strip_prefix(prefix) {
                    return packages.iter().any(|(p, dir)| {
                        rest.strip_prefix(p.as_str())
                            .and_then(|r| r.strip_prefix('-'))
                            .is_some_and(|t| target(dir, kind, t))
                    });
                }
            }
            if let Some(p) = name.strip_prefix("unit-") {
                return packages.iter().any(|(q, _)| q == p);
            }
            packages
                .iter()
                .any(|(_, dir)| target(dir, "examples", name))
        };
        let mut seen = 0;
        for script in std::fs::read_dir(root.join("xtask/gpu")).unwrap().flatten() {
            let path = script.path();
            if path.extension().is_none_or(|x| x != "sh") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (at, _) in text.match_indices("bin/") {
                // `bin/` at the start of a word (not `/usr/bin/env`, not `sbin/`).
                let before = text[..at].chars().next_back();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '/' || c == '_') {
                    continue;
                }
                let name: String = text[at + 4..]
                    .chars()
                    .take_while(|c| c.is_alphanumeric() || *c == '-' || *c == '_')
                    .collect();
                if name.is_empty() {
                    continue;
                }
                seen += 1;
                assert!(
                    exists(&name),
                    "{} runs bin/{name}, which no workspace target builds",
                    path.display()
                );
            }
        }
        assert!(seen > 10, "only {seen} bin/ references found");
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
