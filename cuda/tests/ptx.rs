//! The committed PTX is fresh: every `*.cu` of this package has an embedded module whose recorded
//! source hash matches the file, and every embedded module has its source.

use lowbit_kernels::{HASH_HEADER, MODULES, recorded_hash, source_hash};

#[test]
fn every_kernel_source_has_fresh_ptx() {
    let cuda = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut sources: Vec<_> = std::fs::read_dir(cuda)
        .expect("the package directory is readable")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();
    assert!(
        !sources.is_empty(),
        "no kernel sources in {}",
        cuda.display()
    );
    for src in &sources {
        let stem = src.file_stem().unwrap().to_str().unwrap();
        let module = MODULES
            .iter()
            .find(|m| m.name == stem)
            .unwrap_or_else(|| panic!("cuda/{stem}.cu has no embedded PTX: run `cargo xtask ptx`"));
        let want = source_hash(&std::fs::read(src).unwrap());
        assert_eq!(
            recorded_hash(module.ptx),
            Some(want),
            "cuda/{stem}.cu changed since its PTX was built: run `cargo xtask ptx`"
        );
        assert!(module.ptx.contains(&format!(".target {}", module.arch)));
    }
    for m in MODULES {
        assert!(
            sources.iter().any(|s| s.file_stem().unwrap() == m.name),
            "embedded PTX `{}` has no source in cuda/",
            m.name
        );
    }
}

#[test]
fn modules_are_sorted_and_unique() {
    assert!(MODULES.windows(2).all(|w| w[0].name < w[1].name));
}

#[test]
fn source_hash_is_fnv1a64() {
    // Published FNV-1a 64 test vectors.
    assert_eq!(source_hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(source_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(source_hash(b"foobar"), 0x8594_4171_f739_67e8);
}

#[test]
fn recorded_hash_reads_the_header_line_only() {
    let ptx = format!("{HASH_HEADER}00000000000000ff\n.version 9.0\n");
    assert_eq!(recorded_hash(&ptx), Some(0xff));
    assert_eq!(recorded_hash(".version 9.0\n"), None);
    assert_eq!(recorded_hash(""), None);
    assert_eq!(recorded_hash(&format!("{HASH_HEADER}xyz\n")), None);
}

/// The launch tables' kernels declare their one struct parameter with its size; kernels with
/// other parameters, and names no module has, have none.
#[test]
fn struct_param_bytes_reads_the_entry_declarations() {
    use lowbit_kernels::struct_param_bytes;
    for kernel in [
        "mxfp8_scales_2d_many",
        "nvfp4x_finish_2d_mixed",
        "mxfp8_both_e4m3_bf16_v4_many",
        "u32_max_many_p",
    ] {
        let n = struct_param_bytes(kernel).unwrap_or_else(|| panic!("{kernel}: no size"));
        assert!(n > 0 && n.is_multiple_of(8), "{kernel}: {n} bytes");
    }
    // The size the kernel's own static_assert fixes.
    assert_eq!(
        struct_param_bytes("mxfp8_both_e4m3_bf16_v4_many"),
        Some(5128)
    );
    assert_eq!(struct_param_bytes("no_such_kernel"), None);
    // A kernel of several scalar parameters.
    assert_eq!(struct_param_bytes("mxfp8_scales_2d"), None);
}
