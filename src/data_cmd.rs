//! `lowbit data`: prepare text files into token shards, and inspect a prepared directory
//! (`lowbit_llama::data` does the work; this parses flags and prints).

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, Subcommand};
use lowbit_llama::data::{Manifest, PrepareOptions, SplitRecord, TokenShards, Tokenizer, prepare};

use crate::error::CliError;
use crate::report::{self, bytes_str, escape};

/// Arguments of `lowbit data`.
#[derive(Debug, Args)]
pub struct DataArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: DataCommand,
}

/// `lowbit data` subcommands.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Tokenize text files (each one document) into train/validation token shards and a
    /// manifest.json with their counts and FNV-1a hashes.
    ///
    /// A document goes to validation by a hash of its bytes (at least one document in each
    /// split); a single input is split at the first line start after (1 − F) of its bytes.
    /// Inputs must be regular UTF-8 files (a FIFO, device or directory is refused before it is
    /// opened); they are read streaming, in 1 MiB pieces.
    Prepare(PrepareArgs),
    /// Validate a prepared directory (manifest, sizes, hashes, ids) and print its counts,
    /// fingerprint and first tokens decoded.
    Inspect(InspectArgs),
}

/// Arguments of `lowbit data prepare`.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Input text files, one document each.
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output directory (created if needed; an old manifest.json in it is removed first).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Tokenizer: gpt2 (tiktoken's r50k_base, vocabulary 50257) or bytes (vocabulary 257).
    #[arg(long, value_name = "NAME", default_value = "gpt2",
          value_parser = ["gpt2", "bytes"])]
    pub tokenizer: String,
    /// Fraction of the documents for validation, in [0, 1).
    #[arg(long, value_name = "F", default_value_t = 0.1)]
    pub validation: f64,
    /// The most tokens per shard file.
    #[arg(long, value_name = "N", default_value_t = 100_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub shard_tokens: u64,
}

/// Arguments of `lowbit data inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// A directory written by `lowbit data prepare`.
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
    /// How many tokens of each split to decode and print.
    #[arg(long, value_name = "N", default_value_t = 48)]
    pub tokens: usize,
}

/// Runs `lowbit data …`.
pub fn run(args: &DataArgs) -> Result<(), CliError> {
    match &args.command {
        DataCommand::Prepare(a) => run_prepare(a),
        DataCommand::Inspect(a) => run_inspect(a),
    }
}

fn data_err(cmd: &str, e: lowbit_llama::data::DataError) -> CliError {
    CliError::Msg(format!("data {cmd}: {e}"))
}

fn run_prepare(a: &PrepareArgs) -> Result<(), CliError> {
    if !(0.0..1.0).contains(&a.validation) {
        return Err(CliError::Msg(format!(
            "data prepare: --validation {} is not in [0, 1)",
            a.validation
        )));
    }
    let tokenizer = Tokenizer::from_name(&a.tokenizer)
        .map_err(|e| CliError::Msg(format!("data prepare: --tokenizer: {e}")))?;
    let opts = PrepareOptions {
        tokenizer,
        validation_fraction: a.validation,
        shard_tokens: a.shard_tokens,
        ..PrepareOptions::default()
    };
    let t0 = Instant::now();
    let m = prepare(&a.inputs, &a.out, &opts).map_err(|e| data_err("prepare", e))?;
    let secs = t0.elapsed().as_secs_f64();
    let bytes: u64 = m.inputs.iter().map(|i| i.bytes).sum();
    let tokens = m.train.tokens + m.validation.tokens;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "prepared {} inputs ({} bytes) into {} in {secs:.2} s ({:.2} MB/s)",
        m.inputs.len(),
        bytes_str(usize::try_from(bytes).unwrap_or(usize::MAX)),
        escape(&a.out.display().to_string()),
        bytes as f64 / 1e6 / secs.max(1e-9)
    );
    summary(&mut out, &m);
    let _ = writeln!(
        out,
        "{:.3} bytes per token",
        bytes as f64 / (tokens - m.train.documents - m.validation.documents).max(1) as f64
    );
    report::print(&out)
}

fn split_line(out: &mut String, name: &str, s: &SplitRecord) {
    let _ = writeln!(
        out,
        "  {name:<10} {:>6} documents {:>12} tokens {:>4} shards",
        s.documents,
        s.tokens,
        s.shards.len()
    );
}

fn summary(out: &mut String, m: &Manifest) {
    let _ = writeln!(
        out,
        "tokenizer {} (vocabulary {}, end-of-text {}), {} shards, validation fraction {}",
        m.tokenizer,
        m.vocab,
        m.eot,
        m.dtype.name(),
        m.validation_fraction
    );
    split_line(out, "train", &m.train);
    split_line(out, "validation", &m.validation);
}

fn run_inspect(a: &InspectArgs) -> Result<(), CliError> {
    let data = TokenShards::open(&a.dir).map_err(|e| data_err("inspect", e))?;
    let m = data.manifest();
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{}: {} inputs, fingerprint {:016x} (all shards verified)",
        escape(&a.dir.display().to_string()),
        m.inputs.len(),
        data.fingerprint()
    );
    summary(&mut out, m);
    for split in [data.train(), data.validation()] {
        let n = a
            .tokens
            .min(usize::try_from(split.tokens()).unwrap_or(usize::MAX));
        let mut ids = vec![0u32; n];
        split
            .read(0, &mut ids)
            .map_err(|e| data_err("inspect", e))?;
        let text = data
            .tokenizer()
            .decode(&ids)
            .map_err(|e| data_err("inspect", e))?;
        let _ = writeln!(out, "first {n} {} tokens: {ids:?}", split.kind().name());
        let _ = writeln!(out, "  decoded: {text:?}");
    }
    report::print(&out)
}
