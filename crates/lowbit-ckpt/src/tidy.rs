//! What a checkpoint root holds after crashes, and cleaning it before a run saves into it.
//!
//! A save killed at any instant leaves one of: a `.tmp-step-N` directory (never loaded: only
//! `step-*` names are), a committed `step-N` that `latest` does not name yet (killed between the
//! directory rename and the `latest` rename), a `.latest.tmp` file, or a `.pruned-step-*`
//! directory (killed mid-prune). None of them is ever loaded through the root; [`tidy`] removes
//! them so that the next save starts from a root holding only published checkpoints.

use std::fs::{self, File};
use std::path::{Path, PathBuf};

use crate::error::{Result, io};
use crate::save::{LATEST, parse_step_name};

/// The committed `step-N` directories under `root`, ascending by step (an absent root: none).
///
/// # Errors
/// I/O errors listing `root`.
pub fn committed_steps(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let mut steps = Vec::new();
    if !root.is_dir() {
        return Ok(steps);
    }
    for e in fs::read_dir(root).map_err(io("list", root))? {
        let e = e.map_err(io("list", root))?;
        if let Some(n) = e.file_name().to_str().and_then(parse_step_name) {
            steps.push((n, e.path()));
        }
    }
    steps.sort();
    Ok(steps)
}

/// The step `root/latest` names, if the pointer exists. A symbolic link is followed only to a
/// `step-N` directory of `root` (never read through), and refusals do not quote the pointer's
/// contents.
///
/// # Errors
/// A `latest` that does not hold `step-N` ([`crate::CkptError::Manifest`]); I/O errors.
pub fn latest_step(root: &Path) -> Result<Option<u64>> {
    Ok(crate::check::read_latest(root)?.and_then(|n| parse_step_name(&n)))
}

/// What [`tidy`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Tidied {
    /// `.tmp-step-*` directories of saves killed before their commit.
    pub temp_dirs: Vec<String>,
    /// Committed `step-N` directories newer than `latest` (a save killed between the rename and
    /// the `latest` update): never published, so never resumed from through the root.
    pub unpublished: Vec<String>,
    /// `.latest.tmp` and `.pruned-*` leftovers.
    pub other: Vec<String>,
}

impl Tidied {
    /// Whether nothing was removed.
    pub fn is_empty(&self) -> bool {
        self.temp_dirs.is_empty() && self.unpublished.is_empty() && self.other.is_empty()
    }
}

/// Removes what killed saves left under `root` (see the module docs). Published checkpoints —
/// `step-N` with N at most the step `latest` names — are never touched. Without a `latest`,
/// every committed `step-N` is unpublished. An absent root is fine (nothing to do).
///
/// # Errors
/// A malformed `latest`; I/O errors.
pub fn tidy(root: &Path) -> Result<Tidied> {
    let mut out = Tidied::default();
    if !root.is_dir() {
        return Ok(out);
    }
    let latest = latest_step(root)?;
    for e in fs::read_dir(root).map_err(io("list", root))? {
        let e = e.map_err(io("list", root))?;
        let Some(name) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        let path = e.path();
        let list = if name.starts_with(".tmp-step-") {
            &mut out.temp_dirs
        } else if name == format!(".{LATEST}.tmp") || name.starts_with(".pruned-") {
            &mut out.other
        } else if parse_step_name(&name).is_some_and(|n| latest.is_none_or(|l| n > l)) {
            &mut out.unpublished
        } else {
            continue;
        };
        if path.is_dir() {
            // Out of the `step-*` namespace first, so a crash mid-removal leaves nothing that
            // looks committed.
            let doomed = root.join(format!(".pruned-tidy-{name}"));
            let target = if name.starts_with('.') {
                path.clone()
            } else {
                fs::rename(&path, &doomed).map_err(io("rename", &path))?;
                doomed
            };
            fs::remove_dir_all(&target).map_err(io("remove", &target))?;
        } else {
            fs::remove_file(&path).map_err(io("remove", &path))?;
        }
        list.push(name);
    }
    for l in [&mut out.temp_dirs, &mut out.unpublished, &mut out.other] {
        l.sort();
    }
    if !out.is_empty() {
        File::open(root)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync directory", root))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::CkptError;

    #[test]
    fn tidy_removes_leftovers_and_keeps_published_checkpoints() {
        let root = std::env::temp_dir().join(format!("lowbit-tidy-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        for d in [
            "step-1",
            "step-2",
            "step-3",
            ".tmp-step-4",
            ".pruned-step-0",
        ] {
            fs::create_dir_all(root.join(d)).unwrap();
            fs::write(root.join(d).join("f"), b"x").unwrap();
        }
        fs::write(root.join(LATEST), b"step-2\n").unwrap();
        fs::write(root.join(".latest.tmp"), b"step-3\n").unwrap();
        let t = tidy(&root).unwrap();
        assert_eq!(t.temp_dirs, [".tmp-step-4"]);
        assert_eq!(t.unpublished, ["step-3"]);
        assert_eq!(t.other, [".latest.tmp", ".pruned-step-0"]);
        let steps: Vec<u64> = committed_steps(&root)
            .unwrap()
            .iter()
            .map(|s| s.0)
            .collect();
        assert_eq!(steps, [1, 2]);
        assert_eq!(latest_step(&root).unwrap(), Some(2));
        assert!(tidy(&root).unwrap().is_empty(), "nothing left to do");
        // A malformed pointer is an error, not a guess.
        fs::write(root.join(LATEST), b"../etc\n").unwrap();
        assert!(matches!(tidy(&root), Err(CkptError::Manifest { .. })));
        fs::remove_dir_all(&root).unwrap();
        assert!(tidy(&root).unwrap().is_empty(), "an absent root is fine");
    }
}
