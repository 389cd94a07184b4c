//! Reading criterion's results back, for the benchmark mains that print ratios against a
//! baseline of the same run. Shared by `benches/formats.rs`, `lowbit-device`'s and
//! `lowbit-comm`'s benchmarks through `#[path]` (benchmarks of different packages cannot share
//! a module otherwise).

use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The directory criterion writes to, decided as criterion 0.7 decides it: `$CRITERION_HOME`,
/// else `$CARGO_TARGET_DIR/criterion`, else cargo's target directory joined with `criterion`.
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(target) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(target).join("criterion");
    }
    cargo_metadata_target_dir()
        .map(|t| t.join("criterion"))
        .unwrap_or_else(|| PathBuf::from("target/criterion"))
}

/// `target_directory` from `$CARGO metadata`, found with a string search.
fn cargo_metadata_target_dir() -> Option<PathBuf> {
    let cargo = std::env::var_os("CARGO")?;
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    json_string_after(&text, "\"target_directory\":").map(PathBuf::from)
}

/// The JSON string value that follows `key` in `text` (only `\\`, `\"` and `\/` unescaped).
fn json_string_after(text: &str, key: &str) -> Option<String> {
    let rest = text[text.find(key)? + key.len()..].trim_start();
    let mut chars = rest.strip_prefix('"')?.chars();
    let mut value = String::new();
    loop {
        match chars.next()? {
            '"' => return Some(value),
            '\\' => value.push(chars.next()?),
            ch => value.push(ch),
        }
    }
}

/// The number after `"point_estimate":` inside the `"<stat>"` object of an estimates file.
fn point_estimate(json: &str, stat: &str) -> Option<f64> {
    let obj = &json[json.find(&format!("\"{stat}\":{{"))?..];
    let key = "\"point_estimate\":";
    let rest = &obj[obj.find(key)? + key.len()..];
    let end = rest.find([',', '}'])?;
    rest[..end].trim().parse().ok()
}

/// Median time in ns of benchmark `group/id`, if this run (started at `since`) wrote its
/// estimates.
pub fn median_ns(dir: &Path, group: &str, id: &str, since: SystemTime) -> Option<f64> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None;
    }
    point_estimate(&std::fs::read_to_string(&path).ok()?, "median")
}
