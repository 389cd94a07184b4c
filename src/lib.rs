//! The `lowbit` package: the command line (`src/main.rs`) and, as a library, `lowbit train`'s
//! model, data and training loop (`train`), the model-writing surface it uses (`model`: hooks,
//! usage, errors, RNG) and re-exports of the workspace crates. The test-only regression model and
//! the training harness of the parity suites are in `lowbit-testkit`.

pub mod model;
pub mod train;

pub use lowbit_buffers as buffers;
pub use lowbit_ckpt as ckpt;
pub use lowbit_comm as comm;
pub use lowbit_device as device;
pub use lowbit_formats as formats;
pub use lowbit_layout as layout;
pub use lowbit_optim as optim;
