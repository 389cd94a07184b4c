//! What a model of its own needs from lowbit, for `lowbit train`'s language model (`train::lm`)
//! and for outside code written against the `lowbit` package: the parameter hooks, the usage a
//! parameter is read for, the layers' error type and the workspace's one SplitMix64.
//!
//! The regression MLP the parity suites train is not here: it is test-only and lives in
//! `lowbit-testkit` (`lowbit_testkit::model::regression`).

pub use lowbit_io::rng::SplitMix64;
pub use lowbit_nn::layers::{accumulate, load_f32};
pub use lowbit_nn::{Hooks, Usage};

/// Errors of the models: the layers' errors (device and hook failures with their typed source,
/// bad input).
pub use lowbit_nn::NnError as ModelError;
