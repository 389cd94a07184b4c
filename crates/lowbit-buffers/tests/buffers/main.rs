//! The integration tests of `lowbit-buffers`, one binary with a module per suite (they link
//! once instead of eight times): gradient accumulation, gradient and parameter sync, layer-wise
//! ownership, memory accounting, NVFP4 experts, the protocol states and the storage kinds, on
//! the buffers' API without the driver (tests that run whole steps through the driver are
//! `lowbit-train`'s `parity` suites). `common` is what the suites share.

mod accumulation;
mod common;
mod grad_sync;
mod layerwise;
mod memory;
mod nvfp4_experts;
mod param_sync;
mod protocol;
mod storage;
