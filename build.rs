//! Records the git commit the binary is built from, for `lowbit --version` and the header of
//! `--metrics` files: `LOWBIT_GIT_COMMIT` is `git rev-parse --short HEAD`, with `-dirty` when
//! tracked files differ from it, or `unknown` outside a git checkout (a crate tarball, no git).
//!
//! The script reruns when HEAD moves (a commit, a checkout) or the index changes; a working
//! tree edited since the last build keeps the flag of that build until one of those happens.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    Some(String::from_utf8(out.stdout).ok()?.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let commit = git(&["rev-parse", "--short", "HEAD"]);
    if commit.is_some() {
        // HEAD itself, the branch it names and packed refs: what moves on a commit or checkout;
        // the index: what changes on `git add` or a commit. Only existing paths, since a
        // missing one makes cargo rerun the script on every build.
        let mut watch = vec![
            "HEAD".to_string(),
            "index".to_string(),
            "packed-refs".to_string(),
        ];
        if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(r);
        }
        for w in watch {
            if let Some(p) = git(&["rev-parse", "--git-path", &w]) {
                let p = PathBuf::from(p);
                if p.exists() {
                    println!("cargo:rerun-if-changed={}", p.display());
                }
            }
        }
    }
    let value = match commit {
        Some(c) if !c.is_empty() => {
            // `diff-index --quiet` exits 1 when a tracked file differs from HEAD.
            let dirty = Command::new("git")
                .args(["diff-index", "--quiet", "HEAD", "--"])
                .status()
                .is_ok_and(|s| s.code() == Some(1));
            if dirty { format!("{c}-dirty") } else { c }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=LOWBIT_GIT_COMMIT={value}");
}
