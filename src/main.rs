//! `lowbit`: the command line of the lowbit project.
//!
//! `lowbit train` runs the reference training job (a MoE language model across data-parallel
//! ranks with low-precision primary weights, on the CPU or, built with `--features cuda`, on
//! GPUs; `src/train_cmd.rs`). `lowbit quantize` and `lowbit dequantize` convert safetensors
//! checkpoints to and from MXFP8 / NVFP4 with Transformer Engine's exact bits
//! (`lowbit quantize --demo` runs on generated data); the conversions, the file format and
//! the streaming file I/O are `lowbit_io`'s, and these commands only parse flags and print. Subcommands are variants of
//! [`cli::Command`].
//!
//! Errors print as one `error: …` line on stderr with exit status 1; usage errors keep clap's
//! status 2. A `lowbit train` stopped by SIGINT or SIGTERM prints one `lowbit train: stopped …`
//! line naming the checkpoint it saved and exits with 128 + the signal's number (130, 143). Control characters in error text (tensor names from a file, newlines in paths)
//! are escaped, so an error is always one line.

mod ckpt_cmd;
mod ckpt_hf;
mod cli;
mod config_file;
mod data_cmd;
mod demo;
mod error;
mod eval_cmd;
mod metrics;
mod plot_cmd;
mod progress;
mod report;
mod train_cmd;
mod train_report;

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let args = match config_file::expand(std::env::args().collect()) {
        Ok(a) => a,
        Err(e) => return fail(&e),
    };
    let cli = cli::Cli::parse_from(args);
    match cli::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

/// Prints `e` as one `error: …` line and gives the failure status. Every control character is
/// escaped, a newline included: no message is meant to span lines, and a newline in a path or
/// a tensor name would otherwise print as a line of its own (a forged `error:` line, say).
/// Libraries that escape their paths already (`lowbit_io`) lose nothing: `escape` leaves the
/// backslash of an escape sequence alone.
fn fail(e: &error::CliError) -> ExitCode {
    if let error::CliError::Stopped { message, status } = e {
        eprintln!("lowbit train: {}", report::escape(message));
        return ExitCode::from(*status);
    }
    eprintln!("error: {}", report::escape(&e.to_string()));
    ExitCode::FAILURE
}
