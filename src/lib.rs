//! The `lowbit` package: the command line (`src/main.rs`) and, as a library, the pieces the
//! command line and the integration tests share: the test model (`model`) and `lowbit train`'s
//! model, data and training loop (`train`).

pub mod model;
pub mod train;

pub use lowbit_buffers as buffers;
pub use lowbit_ckpt as ckpt;
pub use lowbit_comm as comm;
pub use lowbit_device as device;
pub use lowbit_formats as formats;
pub use lowbit_layout as layout;
pub use lowbit_optim as optim;
