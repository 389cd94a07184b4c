//! The CUDA kernels of lowbit: the `.cu` sources in this package's root, the headers they share
//! in `include/`, and their PTX for sm_90 in `ptx/`, embedded here as strings.
//!
//! # Purpose
//! `lowbit-device`'s CUDA backend loads these modules through the driver at device creation
//! (`lowbit_device::ptx` re-exports this crate), so a build needs no CUDA compiler and no CUDA
//! install: the PTX is built once by `cargo xtask ptx` (a pinned CUDA 13.0 `nvcc` from PyPI) and
//! committed. See `README.md` for what each source holds and `NOTES.md` for every kernel
//! version with its timings.
//!
//! # Invariants
//! - Every `<name>.cu` in the package root has exactly one [`Module`] in [`MODULES`] with the
//!   same `name`, and every module has its source.
//! - Each PTX file starts with [`HASH_HEADER`] followed by [`module_hash`]: the FNV-1a hash of
//!   the source it was compiled from and of every shared header in [`INCLUDE_DIR`] (the
//!   bit-exact conversions the sources include); `tests/ptx.rs` fails when a `.cu` or a header
//!   changed without the PTX being rebuilt (`cargo xtask ptx`), so the embedded code is always
//!   the code in the sources.
//! - A kernel that takes a launch table (a struct passed by value) declares it as its only
//!   parameter, so [`struct_param_bytes`] reads its size from the PTX and `lowbit-device`
//!   refuses a host table of any other size before launching.
//! - The package is self-contained: sources, PTX and the freshness test all live inside it, so
//!   `cargo package` ships (and can verify) all of them.
//!
//! # Non-goals
//! Compiling CUDA at build time (no `build.rs`, no `nvcc` on the build machine); loading or
//! launching anything (that is `lowbit-device`, behind its `cuda` feature); architectures other
//! than sm_90 (the driver JIT-compiles sm_90 PTX for newer GPUs), but for the modules built for
//! `sm_90a` (Hopper's `wgmma`), which load on compute capability 9.0 only, beside an sm_90
//! kernel of the same work that every other GPU runs.

/// One embedded PTX module.
#[derive(Clone, Copy, Debug)]
pub struct Module {
    /// The kernel file's stem (`<name>.cu` in this package, `crates/lowbit-kernels/` in the
    /// repository).
    pub name: &'static str,
    /// The target architecture the PTX was built for: `sm_90`, or `sm_90a` for kernels that use
    /// Hopper's architecture-specific instructions (`wgmma`), which only a compute capability 9.0
    /// device can load.
    pub arch: &'static str,
    /// The PTX text.
    pub ptx: &'static str,
}

/// Every embedded module, in file-name order. A new `.cu` file needs an entry here.
pub static MODULES: &[Module] = &[
    Module {
        name: "attention",
        arch: "sm_90",
        ptx: include_str!("../ptx/attention.sm_90.ptx"),
    },
    Module {
        name: "fast",
        arch: "sm_90",
        ptx: include_str!("../ptx/fast.sm_90.ptx"),
    },
    Module {
        name: "flash_attention",
        arch: "sm_90",
        ptx: include_str!("../ptx/flash_attention.sm_90.ptx"),
    },
    Module {
        name: "flash_wgmma",
        arch: "sm_90a",
        ptx: include_str!("../ptx/flash_wgmma.sm_90a.ptx"),
    },
    Module {
        name: "llm",
        arch: "sm_90",
        ptx: include_str!("../ptx/llm.sm_90.ptx"),
    },
    Module {
        name: "mx_gemm",
        arch: "sm_90",
        ptx: include_str!("../ptx/mx_gemm.sm_90.ptx"),
    },
    Module {
        name: "mx_gemm_wgmma",
        arch: "sm_90a",
        ptx: include_str!("../ptx/mx_gemm_wgmma.sm_90a.ptx"),
    },
    Module {
        name: "mxfp8",
        arch: "sm_90",
        ptx: include_str!("../ptx/mxfp8.sm_90.ptx"),
    },
    Module {
        name: "mxfp8x",
        arch: "sm_90",
        ptx: include_str!("../ptx/mxfp8x.sm_90.ptx"),
    },
    Module {
        name: "nvfp4",
        arch: "sm_90",
        ptx: include_str!("../ptx/nvfp4.sm_90.ptx"),
    },
    Module {
        name: "ops",
        arch: "sm_90",
        ptx: include_str!("../ptx/ops.sm_90.ptx"),
    },
];

/// The prefix of the first PTX line, followed by the source hash in hex.
pub const HASH_HEADER: &str = "// lowbit-source-fnv1a64: ";

/// FNV-1a (64-bit) of a kernel source: [`lowbit_io::fnv1a64`], the workspace's one FNV-1a
/// (small, dependency-free and stable across platforms), so the PTX headers, checkpoint
/// manifests and the command line's seeds all hash with the same bits.
pub fn source_hash(bytes: &[u8]) -> u64 {
    lowbit_io::fnv1a64(bytes)
}

/// The folder of the headers the kernel sources share, relative to the package root.
pub const INCLUDE_DIR: &str = "include";

/// A kernel source or shared header that [`module_hash`] could not read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {}", path.display())]
pub struct ModuleHashError {
    /// The file or folder that could not be read.
    pub path: std::path::PathBuf,
    /// What the file system said.
    #[source]
    pub source: std::io::Error,
}

/// The hash recorded in the PTX of `<stem>.cu` of the package folder `dir`: FNV-1a over the
/// source's bytes followed, for every `*.cuh` of [`INCLUDE_DIR`] in file-name order, by the
/// header's file name, a NUL byte and its bytes. Every header counts for every module (not only
/// the ones a source includes), so a change to a shared header makes all modules stale rather
/// than relying on a parse of `#include` lines. `cargo xtask ptx` records it and `tests/ptx.rs`
/// recomputes it, both through this one function.
pub fn module_hash(dir: &std::path::Path, stem: &str) -> Result<u64, ModuleHashError> {
    let read = |path: std::path::PathBuf| {
        std::fs::read(&path).map_err(|source| ModuleHashError { path, source })
    };
    let mut hash = source_hash(&read(dir.join(format!("{stem}.cu")))?);
    for header in headers(dir)? {
        let name = header
            .file_name()
            .unwrap_or_default()
            .as_encoded_bytes()
            .to_vec();
        hash = lowbit_io::hash::fnv1a64_continue(hash, &name);
        hash = lowbit_io::hash::fnv1a64_continue(hash, &[0]);
        hash = lowbit_io::hash::fnv1a64_continue(hash, &read(header)?);
    }
    Ok(hash)
}

/// The `*.cuh` files of `dir`'s [`INCLUDE_DIR`] in file-name order (none when it is absent).
pub fn headers(dir: &std::path::Path) -> Result<Vec<std::path::PathBuf>, ModuleHashError> {
    let include = dir.join(INCLUDE_DIR);
    let entries = match std::fs::read_dir(&include) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ModuleHashError {
                path: include,
                source,
            });
        }
    };
    let mut found = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|source| ModuleHashError {
                path: include.clone(),
                source,
            })?
            .path();
        if path.extension().is_some_and(|x| x == "cuh") {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// The source hash recorded in a PTX module's first line, if any.
pub fn recorded_hash(ptx: &str) -> Option<u64> {
    let line = ptx.lines().next()?;
    u64::from_str_radix(line.strip_prefix(HASH_HEADER)?.trim(), 16).ok()
}

/// The byte size of `kernel`'s parameter where the kernel takes exactly one and it is a byte
/// array (a struct passed by value, as the launch tables of `lowbit-device` are), read from the
/// embedded PTX's `.entry` declaration; `None` for a kernel that is in no module or takes
/// other parameters. `lowbit-device` checks the tables it builds against this size before
/// launching, so a host table and a kernel struct that disagree (a capacity changed on one
/// side only) fail as an error, not as a launch that reads or writes the wrong addresses.
pub fn struct_param_bytes(kernel: &str) -> Option<usize> {
    static TABLE: std::sync::OnceLock<std::collections::HashMap<&'static str, usize>> =
        std::sync::OnceLock::new();
    TABLE
        .get_or_init(|| MODULES.iter().flat_map(|m| struct_params(m.ptx)).collect())
        .get(kernel)
        .copied()
}

/// The kernels of one PTX module that take one `.b8` array parameter, with its byte size. A
/// search for each `.entry ` (a byte search, not a walk over the ~150k lines of a module).
fn struct_params(ptx: &'static str) -> impl Iterator<Item = (&'static str, usize)> {
    ptx.match_indices(".entry ").filter_map(|(at, _)| {
        let mut lines = ptx[at + ".entry ".len()..].lines();
        let name = lines.next()?.strip_suffix('(')?.trim();
        // `.param .align A .b8 NAME_param_0[N]` then `)`: one array parameter.
        let size = lines
            .next()?
            .trim()
            .strip_prefix(".param ")
            .and_then(|p| p.split_once(".b8 "))
            .and_then(|(_, decl)| decl.strip_prefix(name))
            .and_then(|d| d.strip_prefix("_param_0["))
            .and_then(|d| d.strip_suffix(']'))
            .and_then(|n| n.parse().ok())?;
        (lines.next()?.trim() == ")").then_some((name, size))
    })
}
