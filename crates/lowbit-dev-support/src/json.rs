//! The JSON reader for cargo's machine-readable output (`cargo metadata`,
//! `--message-format=json`), `lowbit train --json` and golden files: `lowbit_io`'s one JSON
//! codec, re-exported so the benchmarks, tests and `xtask` that used this module keep their
//! imports.

pub use lowbit_io::json::{Json, Limits, Object, ParseError};
