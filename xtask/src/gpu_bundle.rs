//! `cargo xtask gpu-bundle`: the release build of every CUDA executable of the workspace, copied
//! with `run.sh` (the GPU matrix) into the git-ignored folder `gpu-bundle/`, ready to travel to a
//! GPU machine that has no Rust toolchain.
//!
//! What goes in:
//! - the binaries of packages with a `cuda` feature (the `lowbit` command line);
//! - their integration tests, benches and examples that need CUDA: the target requires the
//!   `cuda` feature, or its source mentions `feature = "cuda"` (examples get a step without
//!   arguments in `tests.list` unless run.sh's step list runs them itself);
//! - their unit-test binaries, when a source file under `src/` with tests is about CUDA (its
//!   path mentions `cuda` or `nccl`, or it mentions `feature = "cuda"`);
//! - `xtask/gpu/*` (run.sh, helper scripts), `scripts/bench/*.py` and each package's
//!   `benches/*.py` (torch baselines) into `gpu/`, run.sh at the top;
//! - the `*.whl` files of the git-ignored `gpu-wheels/`, if there is one, into `wheels/`: Python
//!   packages the GPU machine lacks and cannot download (torchao for `torch_fsdp2_step.py`),
//!   installed by the run.sh steps that need them.
//!
//! `tests.list` holds one step per test binary (`name|timeout|command`), read by run.sh ahead of
//! its own hand-written steps, except for binaries that run.sh's list runs itself
//! (`bin/<name> …`, to give arguments or a timeout). Tests whose source mentions NCCL,
//! `run_local_ranks` or `--device` run with `--test-threads=1` (concurrent NCCL worlds on the
//! same GPUs can deadlock). Builds go to `$LOWBIT_BUNDLE_TARGET_DIR` (default `target/gpu-bundle`), release,
//! without debug info, so the bundle stays small.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::json::Json;

/// Bundles larger than this are reported (the device tool carries 64 MiB).
const SIZE_WARNING: u64 = 60 << 20;

struct Package {
    name: String,
    id: String,
    manifest_dir: PathBuf,
    has_cuda: bool,
}

/// One executable chosen for the bundle.
struct Exe {
    /// File name in `bin/`.
    name: String,
    path: PathBuf,
    /// The `tests.list` line, for test binaries.
    step: Option<String>,
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

fn mentions_cuda(text: &str) -> bool {
    text.contains("feature = \"cuda\"")
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Whether a package's unit tests include CUDA tests.
fn unit_tests_need_cuda(src_dir: &Path) -> bool {
    let mut files = Vec::new();
    rs_files(src_dir, &mut files);
    files.iter().any(|f| {
        let text = read(f);
        let path = f.to_string_lossy().to_lowercase();
        text.contains("#[test]")
            && (path.contains("cuda") || path.contains("nccl") || mentions_cuda(&text))
    })
}

fn packages(root: &Path, cargo: &str) -> Result<Vec<Package>, String> {
    let out = Command::new(cargo)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .map_err(|e| format!("cannot run cargo metadata: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let meta = Json::parse(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| format!("cargo metadata: {e}"))?;
    Ok(meta
        .get("packages")
        .arr()
        .iter()
        .map(|p| Package {
            name: p.get("name").as_str().unwrap_or("").to_string(),
            id: p.get("id").as_str().unwrap_or("").to_string(),
            manifest_dir: Path::new(p.get("manifest_path").as_str().unwrap_or(""))
                .parent()
                .unwrap_or(Path::new("."))
                .to_path_buf(),
            has_cuda: p.get("features").keys().contains(&"cuda"),
        })
        .collect())
}

/// Builds and chooses the executables.
/// Builds and chooses the executables; `Err` carries what did build when some targets failed.
fn build(
    root: &Path,
    cargo: &str,
    pkgs: &[&Package],
    target_dir: &Path,
) -> Result<Vec<Exe>, (String, Vec<Exe>)> {
    let mut cmd = Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "--all-targets",
        "--message-format=json-render-diagnostics",
        "--keep-going",
    ]);
    for p in pkgs {
        cmd.args(["-p", &p.name]);
    }
    let features: Vec<String> = pkgs.iter().map(|p| format!("{}/cuda", p.name)).collect();
    cmd.args(["--features", &features.join(",")]);
    for profile in ["RELEASE", "BENCH"] {
        cmd.env(format!("CARGO_PROFILE_{profile}_DEBUG"), "false");
        cmd.env(format!("CARGO_PROFILE_{profile}_STRIP"), "debuginfo");
    }
    cmd.env("CARGO_TARGET_DIR", target_dir)
        .current_dir(root)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    eprintln!(
        "building (release, {}) into {}",
        features.join(", "),
        target_dir.display()
    );
    let mut child = cmd
        .spawn()
        .map_err(|e| (format!("cannot run cargo: {e}"), Vec::new()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| ("no cargo stdout".to_string(), Vec::new()))?;
    let mut exes = Vec::new();
    let mut seen = BTreeSet::new();
    let run_sh = read(&root.join("xtask/gpu/run.sh"));
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else {
            break;
        };
        let Ok(msg) = Json::parse(&line) else {
            continue;
        };
        if msg.get("reason").as_str() != Some("compiler-artifact") {
            continue;
        }
        let Some(exe) = msg.get("executable").as_str() else {
            continue;
        };
        if !seen.insert(exe.to_string()) {
            continue;
        }
        let id = msg.get("package_id").as_str().unwrap_or("");
        let Some(pkg) = pkgs.iter().find(|p| p.id == id) else {
            continue;
        };
        let target = msg.get("target");
        let kind = target.get("kind");
        let tname = target.get("name").as_str().unwrap_or("?").to_string();
        let src = PathBuf::from(target.get("src_path").as_str().unwrap_or(""));
        let needs_cuda =
            target.get("required-features").contains_str("cuda") || mentions_cuda(&read(&src));
        let test = msg.get("profile").get("test").is_true();
        let pkg_name = &pkg.name;
        // Tests that open NCCL worlds (or drive the command line on CUDA, which may) run one at
        // a time: concurrent worlds on the same GPUs can deadlock.
        let nccl_like = {
            let text = read(&src).to_lowercase();
            text.contains("nccl") || text.contains("run_local_ranks") || text.contains("--device")
        };
        // run.sh's own list may run a binary with its own arguments; then no generated step.
        let listed = |name: &str| {
            run_sh.contains(&format!("bin/{name} ")) || run_sh.contains(&format!("bin/{name}\""))
        };
        let threads = if nccl_like { " --test-threads=1" } else { "" };
        let chosen = if kind.contains_str("bin") && !test {
            Some((tname.clone(), None))
        } else if kind.contains_str("example") && needs_cuda {
            // A step of its own, without arguments, unless run.sh's list runs it already.
            let step = (!listed(&tname)).then(|| format!("example-{tname}||bin/{tname}"));
            Some((tname.clone(), step))
        } else if kind.contains_str("test") && needs_cuda {
            let name = format!("test-{pkg_name}-{tname}");
            let step = (!listed(&name)).then(|| format!("{name}||bin/{name}{threads}"));
            Some((name, step))
        } else if kind.contains_str("bench") && needs_cuda {
            let name = format!("bench-{pkg_name}-{tname}");
            let step = (!listed(&name)).then(|| format!("{name}||bin/{name} --bench"));
            Some((name, step))
        } else if test
            && (kind.contains_str("lib") || kind.contains_str("rlib"))
            && unit_tests_need_cuda(&pkg.manifest_dir.join("src"))
        {
            let name = format!("unit-{pkg_name}");
            let step = (!listed(&name)).then(|| format!("{name}||bin/{name}{threads}"));
            Some((name, step))
        } else {
            None
        };
        if let Some((name, step)) = chosen {
            exes.push(Exe {
                name,
                path: PathBuf::from(exe),
                step,
            });
        }
    }
    match child.wait() {
        Ok(status) if status.success() => Ok(exes),
        Ok(status) => Err((format!("cargo build failed ({status})"), exes)),
        Err(e) => Err((format!("waiting for cargo: {e}"), exes)),
    }
}

fn copy(from: &Path, to: &Path) -> Result<u64, String> {
    std::fs::copy(from, to)
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

fn set_executable(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Copies the `*.whl` files of `from` (if it exists) into `to`; the bytes copied.
fn copy_wheels(from: &Path, to: &Path) -> Result<u64, String> {
    let Ok(entries) = std::fs::read_dir(from) else {
        return Ok(0);
    };
    let mut wheels: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|f| f.is_file() && f.extension().is_some_and(|x| x == "whl"))
        .collect();
    wheels.sort();
    if wheels.is_empty() {
        return Ok(0);
    }
    std::fs::create_dir_all(to).map_err(|e| format!("{}: {e}", to.display()))?;
    let mut total = 0;
    for w in wheels {
        let name = w.file_name().ok_or("wheel without a name")?;
        total += copy(&w, &to.join(name))?;
        eprintln!("  wheels/{}", name.to_string_lossy());
    }
    Ok(total)
}

fn commit(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let head = git(&["rev-parse", "--short", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let dirty =
        git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    if dirty { format!("{head}-dirty") } else { head }
}

/// `cargo xtask gpu-bundle [--allow-partial]`: with `--allow-partial`, targets that fail to
/// build are left out (and named by cargo above) instead of failing the bundle.
pub fn gpu_bundle(root: &Path, allow_partial: bool) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let all = packages(root, &cargo)?;
    let pkgs: Vec<&Package> = all.iter().filter(|p| p.has_cuda).collect();
    if pkgs.is_empty() {
        return Err("no workspace package has a `cuda` feature".into());
    }
    let target_dir = std::env::var_os("LOWBIT_BUNDLE_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target/gpu-bundle"));
    let exes = match build(root, &cargo, &pkgs, &target_dir) {
        Ok(exes) => exes,
        Err((e, exes)) if allow_partial => {
            eprintln!(
                "warning: {e}; bundling the {} executables that built",
                exes.len()
            );
            exes
        }
        Err((e, _)) => return Err(format!("{e} (--allow-partial bundles what built)")),
    };

    let bundle = root.join("gpu-bundle");
    if bundle.exists() {
        std::fs::remove_dir_all(&bundle).map_err(|e| format!("{}: {e}", bundle.display()))?;
    }
    for d in ["bin", "gpu"] {
        std::fs::create_dir_all(bundle.join(d))
            .map_err(|e| format!("{}: {e}", bundle.display()))?;
    }
    let mut total = 0;
    let mut list = String::from("# generated by cargo xtask gpu-bundle: name|timeout|command\n");
    for e in &exes {
        let to = bundle.join("bin").join(&e.name);
        total += copy(&e.path, &to)?;
        set_executable(&to)?;
        if let Some(step) = &e.step {
            list.push_str(step);
            list.push('\n');
        }
        eprintln!("  bin/{}", e.name);
    }
    std::fs::write(bundle.join("tests.list"), list).map_err(|e| format!("tests.list: {e}"))?;
    std::fs::write(bundle.join("COMMIT"), commit(root) + "\n")
        .map_err(|e| format!("COMMIT: {e}"))?;
    let mut scripts = Vec::new();
    let gpu_dir = root.join("xtask/gpu");
    // Benchmark baselines that belong to no package (torch SDPA for the flash attention).
    let bench_dir = root.join("scripts/bench");
    let roots = [&gpu_dir, &bench_dir];
    for p in roots
        .into_iter()
        .chain(pkgs.iter().map(|p| &p.manifest_dir))
    {
        let dir = if roots.contains(&p) {
            p.clone()
        } else {
            p.join("benches")
        };
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for f in entries.flatten().map(|e| e.path()) {
            let is_script = f.extension().is_some_and(|x| x == "py" || x == "sh");
            if is_script {
                scripts.push(f);
            }
        }
    }
    for s in scripts {
        let name = s.file_name().ok_or("script without a name")?;
        let to = if name == "run.sh" {
            bundle.join("run.sh")
        } else {
            bundle.join("gpu").join(name)
        };
        total += copy(&s, &to)?;
        set_executable(&to)?;
    }
    if !bundle.join("run.sh").exists() {
        return Err("xtask/gpu/run.sh is missing".into());
    }
    total += copy_wheels(&root.join("gpu-wheels"), &bundle.join("wheels"))?;
    eprintln!(
        "wrote {} ({} executables, {:.1} MiB); run it there with ./run.sh [FILTER...]",
        bundle.display(),
        exes.len(),
        total as f64 / (1 << 20) as f64
    );
    if total > SIZE_WARNING {
        eprintln!(
            "warning: the bundle is over {} MiB; the device tool carries at most 64 MiB",
            SIZE_WARNING >> 20
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::copy_wheels;

    /// The wheels of `gpu-wheels/` land in `wheels/`; other files and a missing folder do not.
    #[test]
    fn wheels_are_copied_when_present() {
        let dir = std::env::temp_dir().join(format!("lowbit-wheels-{}", std::process::id()));
        let (from, to) = (dir.join("gpu-wheels"), dir.join("bundle/wheels"));
        std::fs::create_dir_all(&from).unwrap();
        std::fs::write(from.join("a-1.0-py3-none-any.whl"), b"abc").unwrap();
        std::fs::write(from.join("notes.txt"), b"x").unwrap();
        let copied = copy_wheels(&from, &to);
        let none = copy_wheels(&dir.join("absent"), &dir.join("absent-out"));
        let names: Vec<_> = std::fs::read_dir(&to)
            .map(|d| d.flatten().map(|e| e.file_name()).collect())
            .unwrap_or_default();
        let absent_out = dir.join("absent-out").exists();
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(copied, Ok(3));
        assert_eq!(names, ["a-1.0-py3-none-any.whl"]);
        assert_eq!(none, Ok(0));
        assert!(!absent_out);
    }
}
