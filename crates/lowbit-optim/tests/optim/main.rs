//! The integration tests of `lowbit-optim`, one binary with a module per suite (they link once
//! instead of eight times): chained optimizers, initialization from the high-precision values,
//! Muon against its goldens and its modes, the update rules, non-finite skips, state export and
//! import, and the optimizers stepped through the driver. `common` is what several suites share
//! over `lowbit_testkit::harness`.

mod chained;
mod common;
mod init;
mod muon;
mod muon_modes;
mod rules;
mod skip;
mod state;
mod trainer;
