//! The committed PTX is fresh: every `*.cu` of this package has an embedded module whose recorded
//! hash matches the file and the shared headers of `include/`, and every embedded module has its
//! source.

use lowbit_kernels::{HASH_HEADER, MODULES, module_hash, recorded_hash, source_hash};

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
            .unwrap_or_else(|| panic!("{stem}.cu has no embedded PTX: run `cargo xtask ptx`"));
        let want = module_hash(cuda, stem).unwrap();
        assert_eq!(
            recorded_hash(module.ptx),
            Some(want),
            "{stem}.cu or a header of include/ changed since its PTX was built: run `cargo xtask ptx`"
        );
        assert!(module.ptx.contains(&format!(".target {}", module.arch)));
    }
    for m in MODULES {
        assert!(
            sources.iter().any(|s| s.file_stem().unwrap() == m.name),
            "embedded PTX `{}` has no source in the package",
            m.name
        );
    }
}

/// The recorded hash covers the source and every shared header: editing, adding or renaming a
/// header changes it, as editing the source does.
#[test]
fn module_hash_covers_the_shared_headers() {
    let dir = std::env::temp_dir().join(format!("lowbit-kernels-hash-{}", std::process::id()));
    let include = dir.join("include");
    std::fs::create_dir_all(&include).unwrap();
    std::fs::write(dir.join("k.cu"), "#include \"include/a.cuh\"\n").unwrap();
    let alone = module_hash(&dir, "k").unwrap();
    assert_eq!(alone, source_hash(b"#include \"include/a.cuh\"\n"));
    std::fs::write(include.join("a.cuh"), "// a\n").unwrap();
    let with_a = module_hash(&dir, "k").unwrap();
    std::fs::write(include.join("a.cuh"), "// a, changed\n").unwrap();
    let edited = module_hash(&dir, "k").unwrap();
    std::fs::rename(include.join("a.cuh"), include.join("b.cuh")).unwrap();
    let renamed = module_hash(&dir, "k").unwrap();
    std::fs::write(include.join("notes.txt"), "not a header").unwrap();
    let with_other_file = module_hash(&dir, "k").unwrap();
    std::fs::write(dir.join("k.cu"), "// edited\n").unwrap();
    let source_edited = module_hash(&dir, "k").unwrap();
    let missing = module_hash(&dir, "absent");
    std::fs::remove_dir_all(&dir).ok();
    let all = [alone, with_a, edited, renamed, source_edited];
    for (i, a) in all.iter().enumerate() {
        for b in &all[i + 1..] {
            assert_ne!(a, b, "two different trees hash alike");
        }
    }
    assert_eq!(with_other_file, renamed, "only *.cuh files count");
    let err = missing.unwrap_err();
    assert!(err.path.ends_with("absent.cu"), "{}", err.path.display());
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
