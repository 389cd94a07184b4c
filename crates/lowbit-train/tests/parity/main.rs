//! The parity suites: whole training steps of the regression model through the driver
//! (`lowbit_train::Trainer`), on 1 to 4 rank threads, compared bit for bit across buffer
//! configurations, precisions, shardings and optimizers, with the one harness
//! (`lowbit_testkit::harness`).
//!
//! They live here, beside the driver, by one rule: a test that runs whole steps through the
//! driver belongs to `lowbit-train`, whichever crate's feature it exercises (the buffers' storage
//! kinds and sharding, Muon's layer-wise ownership); a test of one crate's API without the
//! driver stays in that crate. One binary with a module per suite links once instead of four
//! times.

mod chained;
mod ddp;
mod muon;
mod muon_refusals;
mod primary_weights;
mod sharding;
