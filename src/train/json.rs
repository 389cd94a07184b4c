//! The JSON of `lowbit train --json`: `lowbit_io`'s one JSON value type and writer (compact
//! through `Display`; non-finite numbers print as `null`).

pub use lowbit_io::json::Json;
