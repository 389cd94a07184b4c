//! Reading criterion's results back, for the benchmark mains that print ratios against a
//! baseline measured in the same run.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use crate::json::Json;

/// The directory criterion writes to, decided as criterion 0.7 decides it: `$CRITERION_HOME`,
/// else `$CARGO_TARGET_DIR/criterion`, else cargo's target directory joined with `criterion`.
/// Hand it to criterion (`Criterion::output_directory`) so that both agree.
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

/// `target_directory` from `$CARGO metadata`.
fn cargo_metadata_target_dir() -> Option<PathBuf> {
    let cargo = std::env::var_os("CARGO")?;
    let out = std::process::Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .output()
        .ok()?;
    let meta = Json::parse(std::str::from_utf8(&out.stdout).ok()?).ok()?;
    meta.get("target_directory").as_str().map(PathBuf::from)
}

/// The `point_estimate` of statistic `stat` (`"median"`, `"mean"`, …) in the text of a
/// criterion `estimates.json`.
pub fn point_estimate(estimates_json: &str, stat: &str) -> Option<f64> {
    Json::parse(estimates_json)
        .ok()?
        .get(stat)
        .get("point_estimate")
        .as_f64()
}

/// Median time in ns of benchmark `group/id`, if this run (started at `since`) wrote its
/// estimates under `dir` (`<dir>/<group>/<id>/new/estimates.json`).
pub fn median_ns(dir: &Path, group: &str, id: &str, since: SystemTime) -> Option<f64> {
    let path = dir.join(group).join(id).join("new").join("estimates.json");
    if std::fs::metadata(&path).ok()?.modified().ok()? < since {
        return None;
    }
    point_estimate(&std::fs::read_to_string(&path).ok()?, "median")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape criterion 0.7 writes (abridged).
    const ESTIMATES: &str = r#"{"mean":{"confidence_interval":{"confidence_level":0.95,
        "lower_bound":1.0,"upper_bound":3.0},"point_estimate":2.5,"standard_error":0.1},
        "median":{"confidence_interval":{"confidence_level":0.95,"lower_bound":1.0,
        "upper_bound":3.0},"point_estimate":1.25e6,"standard_error":0.2},"median_abs_dev":null,
        "slope":null,"std_dev":{"confidence_interval":{"confidence_level":0.95,"lower_bound":0.0,
        "upper_bound":1.0},"point_estimate":0.5,"standard_error":0.01}}"#;

    #[test]
    fn reads_point_estimates() {
        assert_eq!(point_estimate(ESTIMATES, "median"), Some(1.25e6));
        assert_eq!(point_estimate(ESTIMATES, "mean"), Some(2.5));
        assert_eq!(point_estimate(ESTIMATES, "slope"), None);
        assert_eq!(point_estimate("not json", "median"), None);
    }

    #[test]
    fn median_only_from_this_run() {
        let dir = std::env::temp_dir().join(format!("lowbit-estimates-{}", std::process::id()));
        let new = dir.join("g").join("id").join("new");
        std::fs::create_dir_all(&new).unwrap();
        std::fs::write(new.join("estimates.json"), ESTIMATES).unwrap();
        let past = SystemTime::now() - std::time::Duration::from_secs(3600);
        let future = SystemTime::now() + std::time::Duration::from_secs(3600);
        assert_eq!(median_ns(&dir, "g", "id", past), Some(1.25e6));
        assert_eq!(median_ns(&dir, "g", "id", future), None);
        assert_eq!(median_ns(&dir, "g", "other", past), None);
        std::fs::remove_dir_all(&dir).ok();
    }
}
