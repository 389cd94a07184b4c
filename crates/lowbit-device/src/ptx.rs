//! PTX of the CUDA kernels in `cuda/*.cu`, built by `cargo xtask ptx` with the pinned CUDA 13.0
//! toolchain and committed, embedded here for the CUDA backend (so a build needs no CUDA
//! compiler). Each file starts with a comment recording a hash of the source it was built from;
//! a test fails when a `.cu` file changed without its PTX being rebuilt.

/// One embedded PTX module.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    /// The kernel file's stem (`cuda/<name>.cu`).
    pub name: &'static str,
    /// The target architecture the PTX was built for.
    pub arch: &'static str,
    /// The PTX text.
    pub ptx: &'static str,
}

/// Every embedded module.
pub const MODULES: &[Module] = &[
    Module {
        name: "mxfp8",
        arch: "sm_90",
        ptx: include_str!("../../../cuda/ptx/mxfp8.sm_90.ptx"),
    },
    Module {
        name: "mxfp8x",
        arch: "sm_90",
        ptx: include_str!("../../../cuda/ptx/mxfp8x.sm_90.ptx"),
    },
    Module {
        name: "nvfp4",
        arch: "sm_90",
        ptx: include_str!("../../../cuda/ptx/nvfp4.sm_90.ptx"),
    },
    Module {
        name: "ops",
        arch: "sm_90",
        ptx: include_str!("../../../cuda/ptx/ops.sm_90.ptx"),
    },
];

/// The prefix of the first PTX line, followed by the source hash in hex.
pub const HASH_HEADER: &str = "// lowbit-source-fnv1a64: ";

/// FNV-1a (64-bit) of a kernel source: small, dependency-free and stable across platforms.
pub fn source_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// The source hash recorded in a PTX module's first line, if any.
pub fn recorded_hash(ptx: &str) -> Option<u64> {
    let line = ptx.lines().next()?;
    u64::from_str_radix(line.strip_prefix(HASH_HEADER)?.trim(), 16).ok()
}
