//! The FSDP tests of `lowbit-train`, one binary with a module per suite (they link once instead
//! of eight times): the strategies trained through the driver, hybrid groups, main parameters and
//! gradients, reduction dtypes, memory against the closed form, refusals and units. `common` is
//! the FSDP run harness over `lowbit_testkit::harness`. The regression-model parity suites are
//! the `parity` binary beside this one.

mod common;
mod double_gradient;
mod hybrid;
mod main_params;
mod memory;
mod reduction;
mod refusals;
mod training;
mod units;
