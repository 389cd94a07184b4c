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
    // Only a checkout of this package counts: a crate unpacked inside some other repository
    // must not report that repository's commit.
    let own = git(&["rev-parse", "--show-toplevel"]).is_some_and(|top| {
        let here = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default();
        std::fs::canonicalize(top).ok() == std::fs::canonicalize(here).ok()
    });
    let commit = if own {
        git(&["rev-parse", "--short", "HEAD"])
    } else {
        None
    };
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
            // Tracked files that differ from HEAD, by content (`status` refreshes stale stat
            // data in memory, where `diff-index` would count a touched file; no optional locks,
            // so the build never writes the index).
            let dirty = git(&[
                "--no-optional-locks",
                "status",
                "--porcelain",
                "--untracked-files=no",
            ])
            .is_some_and(|s| !s.is_empty());
            if dirty { format!("{c}-dirty") } else { c }
        }
        _ => "unknown".to_string(),
    };
    println!("cargo:rustc-env=LOWBIT_GIT_COMMIT={value}");
}
