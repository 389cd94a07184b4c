//! Printing: the library's report pieces (tables, byte counts, escaping) and the one function
//! that writes to stdout.

use std::io::Write;

pub use lowbit_io::report::{bytes_str, escape};

use crate::error::CliError;

/// Writes to stdout; a closed pipe (`lowbit … | head`) is not an error worth reporting.
pub fn print(text: &str) -> Result<(), CliError> {
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(CliError::io("write", "standard output", e))
        }
        _ => Ok(()),
    }
}
