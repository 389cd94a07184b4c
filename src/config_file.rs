//! `lowbit train --config FILE.toml`: every flag of `lowbit train` from a file.
//!
//! The file's `[train]` table holds flags by their long names (`steps = 400`,
//! `precision = "nvfp4"`, `param_gather = "off"`, `json = true`; dashes or underscores); its
//! `[model]` table describes a decoder's shape (read by `lowbit-llama`). Flags given on the
//! command line win over the file's. Unknown tables and keys, and values of the wrong type, are
//! refused naming the file and the key before anything runs.

use std::path::Path;

use clap::{ArgAction, Args};

use crate::error::CliError;
use crate::train_cmd::{TrainArgs, TrainFlags};

/// Largest config file read (a config is a few hundred bytes; this bounds a hostile one).
const MAX_BYTES: u64 = 1 << 20;

/// Reads `path` as TOML, refusing what is not a small regular file.
pub fn read_table(path: &Path) -> Result<toml::Table, CliError> {
    let shown = path.display();
    let meta =
        std::fs::metadata(path).map_err(|e| CliError::Msg(format!("--config {shown}: {e}")))?;
    if !meta.is_file() {
        return Err(CliError::Msg(format!(
            "--config {shown}: not a regular file"
        )));
    }
    if meta.len() > MAX_BYTES {
        return Err(CliError::Msg(format!(
            "--config {shown}: {} bytes, over the limit of {MAX_BYTES} for a config file",
            meta.len()
        )));
    }
    let text = std::fs::read_to_string(path)
        .map_err(|e| CliError::Msg(format!("--config {shown}: {e}")))?;
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| CliError::Msg(format!("--config {shown}: {e}")))?;
    if let Some(k) = table
        .keys()
        .find(|k| !["train", "model"].contains(&k.as_str()))
    {
        return Err(CliError::Msg(format!(
            "--config {shown}: unknown table or key `{k}` (the file has a [train] table of \
             flags and a [model] table)"
        )));
    }
    Ok(table)
}

/// The `lowbit train` flags the `[train]` table of `table` gives, as command-line arguments.
pub fn train_flags(path: &Path, table: &toml::Table) -> Result<Vec<String>, CliError> {
    let shown = path.display();
    let Some(train) = table.get("train") else {
        return Ok(Vec::new());
    };
    let Some(train) = train.as_table() else {
        return Err(CliError::Msg(format!(
            "--config {shown}: `train` must be a table ([train])"
        )));
    };
    let cmd = TrainArgs::augment_args(clap::Command::new("train"));
    let mut out = Vec::new();
    for (key, value) in train {
        let long = key.replace('_', "-");
        let bad = |what: String| CliError::Msg(format!("--config {shown}: [train] {key}: {what}"));
        let Some(arg) = cmd
            .get_arguments()
            .find(|a| a.get_long() == Some(long.as_str()))
        else {
            return Err(bad("not a flag of lowbit train".into()));
        };
        if long == "config" {
            return Err(bad("a config file cannot name another".into()));
        }
        let switch = matches!(arg.get_action(), ArgAction::SetTrue);
        match value {
            toml::Value::Boolean(b) if switch => {
                if *b {
                    out.push(format!("--{long}"));
                }
            }
            // on/off flags take booleans too.
            toml::Value::Boolean(b) => {
                out.push(format!("--{long}={}", if *b { "on" } else { "off" }));
            }
            _ if switch => return Err(bad("takes true or false".into())),
            toml::Value::String(s) => out.push(format!("--{long}={s}")),
            toml::Value::Integer(i) => out.push(format!("--{long}={i}")),
            toml::Value::Float(f) => out.push(format!("--{long}={f}")),
            _ => return Err(bad("takes a string, a number or a boolean".into())),
        }
    }
    // Values of the wrong type, refused here so that the message names the file.
    if let Err(e) = <TrainFlags as clap::Parser>::try_parse_from(&out) {
        let first = e.to_string();
        let first = first
            .lines()
            .next()
            .unwrap_or_default()
            .trim_start_matches("error: ");
        return Err(CliError::Msg(format!("--config {shown}: [train]: {first}")));
    }
    Ok(out)
}

/// The command line with the flags of `--config FILE`'s `[train]` table inserted right after
/// `train`, so that the flags given on the command line, parsed later, win.
pub fn expand(args: Vec<String>) -> Result<Vec<String>, CliError> {
    let at = 1;
    if args.get(at).is_none_or(|a| a != "train") {
        return Ok(args);
    }
    let mut path = None;
    for (i, a) in args.iter().enumerate().skip(at + 1) {
        if let Some(p) = a.strip_prefix("--config=") {
            path = Some(p.to_string());
        } else if a == "--config" {
            path = args.get(i + 1).cloned();
        }
    }
    let Some(path) = path else {
        return Ok(args);
    };
    let path = Path::new(&path);
    let flags = train_flags(path, &read_table(path)?)?;
    let mut out = args[..=at].to_vec();
    out.extend(flags);
    out.extend_from_slice(&args[at + 1..]);
    Ok(out)
}
