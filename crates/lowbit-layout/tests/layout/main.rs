//! The integration tests of `lowbit-layout`, one binary with a module per suite: the layer-wise
//! rule, the plan's layouts and row-sharded layouts. `common` is what the suites share.

mod common;
mod layerwise;
mod layout;
mod rows;
