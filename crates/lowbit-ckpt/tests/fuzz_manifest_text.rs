//! Mutation fuzzing of the manifest parser alone ([`Manifest::parse`], what
//! `Checkpoint::open` runs on `manifest.json`): a fixed number of deterministic mutations of
//! valid manifests (bit flips, truncations, splices, deletions, huge and negative numbers,
//! deep nesting, long strings, duplicated and swapped lines, whitespace), each parsed in
//! microseconds, so CI runs thousands. Every outcome is a manifest that writes back to the
//! same manifest, or a typed error naming the file ([`CkptError::Manifest`] or
//! [`CkptError::Version`]); never a panic; and the parse allocates at most a small multiple of
//! its input (counted per thread by the allocator below): no declared number (a shape of
//! 2^60 elements, a piece ending at 2^64 − 1) makes it allocate by what it declares.
//!
//! `LOWBIT_FUZZ_CASES` sets the number of cases (default 3000); the cases come from a fixed
//! seed, so a failure reproduces (its case number and input are printed).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;

use lowbit_ckpt::{CkptError, FileEntry, Manifest, Meta, OptimizerEntry, Piece, TensorEntry};
use lowbit_dev_support::alloc::{ThreadCounting, thread_peak_of as peak_of};
use lowbit_io::rng::SplitMix64;

// Each test's own thread counts its allocations, so tests running side by side do not mix.
#[global_allocator]
static PER_THREAD: ThreadCounting = ThreadCounting;

/// A valid manifest of two rank files: three tensors in several pieces, a few scalars.
fn manifest() -> Manifest {
    let files = ["rank-00000.safetensors", "rank-00001.safetensors"];
    let tensor = |param: &str, state: &str, numel: u64, cuts: &[u64]| {
        let mut bounds = vec![0];
        bounds.extend_from_slice(cuts);
        bounds.push(numel);
        TensorEntry {
            name: format!("{param}/{state}"),
            param: param.into(),
            state: state.into(),
            owner: 0,
            shape: vec![numel],
            dtype: "F32".into(),
            pieces: bounds
                .windows(2)
                .enumerate()
                .map(|(i, w)| Piece {
                    file: files[i % 2].into(),
                    key: format!("{param}/{state}@{}", w[0]),
                    start: w[0],
                    end: w[1],
                    offset: 128 + 4 * w[0],
                    hash: 0x9e37_79b9_7f4a_7c15u64.wrapping_mul(w[0] + 1),
                })
                .collect(),
        }
    };
    let mut meta = Meta {
        step: 12,
        ..Meta::default()
    };
    meta.config.insert("model".into(), "llama-tiny".into());
    meta.config.insert("ranks".into(), "2".into());
    meta.data.insert("next_step".into(), "12".into());
    meta.rng.insert("seed".into(), "42".into());
    Manifest {
        meta,
        optimizers: vec![OptimizerEntry {
            owner: 0,
            rule: "adamw".into(),
            steps: 12,
        }],
        files: files
            .iter()
            .map(|f| FileEntry {
                name: (*f).into(),
                bytes: 1 << 20,
            })
            .collect(),
        tensors: vec![
            tensor("l0.weight", "master", 192, &[96]),
            tensor("l0.weight", "exp_avg", 192, &[50, 96, 150]),
            tensor("l0.bias", "master", 16, &[]),
        ],
    }
}

/// Numbers that break counts, ranges and the number grammar.
const HUGE: &[&str] = &[
    "1152921504606846976",  // 2^60
    "18446744073709551615", // 2^64 - 1
    "18446744073709551616", // 2^64: too large
    "1099511627777",        // MAX_NUMEL + 1
    "-1",
    "-9223372036854775809",
    "1e400",
    "1.5",
    "0",
    "00",
    "4294967296", // 2^32: an owner out of range
];

/// One mutation of `base`, chosen by `rng`; its name for the report.
fn mutate(base: &[u8], rng: &mut SplitMix64) -> (Vec<u8>, &'static str) {
    let mut b = base.to_vec();
    let mut pick = |n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    let kind = pick(11);
    let name = match kind {
        0 => {
            for _ in 0..1 + pick(4) {
                let i = pick(b.len());
                b[i] ^= 1 << pick(8);
            }
            "bit flips"
        }
        1 => {
            b.truncate(pick(b.len()));
            "truncation"
        }
        2 => {
            let (a, c) = (pick(b.len()), pick(b.len()));
            let (a, c) = (a.min(c), a.max(c));
            let piece = b[a..c].to_vec();
            let at = pick(b.len());
            b.splice(at..at, piece);
            "splice"
        }
        3 => {
            let a = pick(b.len());
            let end = (a + 1 + pick(64)).min(b.len());
            b.drain(a..end);
            "deletion"
        }
        4 => {
            // The n-th run of digits replaced by a huge or malformed number.
            let runs: Vec<(usize, usize)> = digit_runs(&b);
            let (s, e) = runs[pick(runs.len())];
            b.splice(s..e, HUGE[pick(HUGE.len())].bytes());
            "huge number"
        }
        5 => {
            // A value replaced by nesting far deeper than the reader's limit (or just within).
            let depth = [63, 64, 65, 1000, 100_000][pick(5)];
            let colons: Vec<usize> = (0..b.len()).filter(|&i| b[i] == b':').collect();
            let at = colons[pick(colons.len())] + 1;
            let deep = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
            b.splice(at..at, deep.bytes());
            "deep nesting"
        }
        6 => {
            // A string value made long (64 KiB), or one with escapes.
            let quotes: Vec<usize> = (0..b.len()).filter(|&i| b[i] == b'"').collect();
            let at = quotes[pick(quotes.len())] + 1;
            let s = if pick(2) == 0 {
                "x".repeat(64 << 10)
            } else {
                r#"\u0000\ud800\"\\\n\u00e9"#.to_string()
            };
            b.splice(at..at, s.bytes());
            "long or escaped string"
        }
        7 | 8 => {
            let mut lines: Vec<Vec<u8>> = b.split(|&c| c == b'\n').map(<[u8]>::to_vec).collect();
            let (i, j) = (pick(lines.len()), pick(lines.len()));
            if kind == 7 {
                let l = lines[i].clone();
                lines.insert(j, l);
            } else {
                lines.swap(i, j);
            }
            b = lines.join(&b'\n');
            if kind == 7 {
                "duplicated line"
            } else {
                "swapped lines"
            }
        }
        9 => {
            let i = pick(b.len());
            b.insert(i, b"{}[],:\"0-e."[pick(11)]);
            "structural byte"
        }
        _ => {
            // Whitespace between tokens: still the same manifest.
            let commas: Vec<usize> = (0..b.len()).filter(|&i| b[i] == b',').collect();
            let at = commas[pick(commas.len())] + 1;
            b.splice(at..at, *b" \t\r\n ");
            "whitespace"
        }
    };
    (b, name)
}

fn digit_runs(b: &[u8]) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < b.len() {
        if b[i].is_ascii_digit() {
            let s = i;
            while i < b.len() && b[i].is_ascii_digit() {
                i += 1;
            }
            runs.push((s, i));
        } else {
            i += 1;
        }
    }
    runs
}

/// What one case showed: parsed, refused, or (a test failure) something else.
fn check(file: &Path, text: &str) -> Result<bool, String> {
    let (parsed, peak) = peak_of(|| Manifest::parse(file, text));
    // The parse holds the manifest it builds and one entry's tree: a small multiple of the
    // text whatever the text declares.
    let bound = 16 * text.len() + (256 << 10);
    if peak > bound {
        return Err(format!(
            "allocated {peak} bytes for {} bytes of text",
            text.len()
        ));
    }
    match parsed {
        Ok(m) => {
            // A valid parse is a manifest: written back, it parses to itself.
            let again = Manifest::parse(file, &m.to_json().to_text()).map_err(|e| e.to_string())?;
            if again != m {
                return Err("written back, the manifest parses to other values".into());
            }
            Ok(true)
        }
        Err(CkptError::Manifest { file: f, msg }) if f == file && !msg.is_empty() => Ok(false),
        Err(CkptError::Version { file: f, .. }) if f == file => Ok(false),
        Err(other) => Err(format!("an error of another kind: {other:?}")),
    }
}

#[test]
fn mutated_manifests_parse_or_are_refused_with_bounded_allocation() {
    let file = Path::new("ckpt/step-12/manifest.json");
    let m = manifest();
    let diffable = m.to_json().to_text();
    let compact = m.to_json().to_string();
    assert_eq!(
        Manifest::parse(file, &diffable).expect("the base parses"),
        m
    );
    assert_eq!(Manifest::parse(file, &compact).expect("the base parses"), m);
    let cases = lowbit_dev_support::fuzz_cases(3000);
    let mut rng = SplitMix64(0x6d61_6e69_6665_7374);
    let (mut parsed, mut refused) = (0usize, 0usize);
    let start = std::time::Instant::now();
    for case in 0..cases {
        let base = if case % 4 == 3 { &compact } else { &diffable };
        let (bytes, how) = mutate(base.as_bytes(), &mut rng);
        // `Checkpoint::open` refuses a manifest that is not UTF-8 before parsing; the parser
        // sees the rest, and here the lossy text of every case.
        let text = String::from_utf8_lossy(&bytes);
        let outcome = catch_unwind(AssertUnwindSafe(|| check(file, &text)));
        match outcome {
            Ok(Ok(true)) => parsed += 1,
            Ok(Ok(false)) => refused += 1,
            Ok(Err(why)) => panic!("case {case} ({how}): {why}\n{:.400}", text.escape_debug()),
            Err(_) => panic!(
                "case {case} ({how}) panicked on\n{:.400}",
                text.escape_debug()
            ),
        }
    }
    println!(
        "{cases} mutated manifests in {:.1?}: {parsed} parsed, {refused} refused",
        start.elapsed()
    );
    // Not vacuous: both outcomes occur (whitespace keeps a manifest; most mutations break it).
    assert!(
        parsed > 0 && refused > parsed,
        "{parsed} parsed, {refused} refused"
    );
}

/// Declared sizes far beyond the text are refused by the rules before anything of their size
/// is allocated.
#[test]
fn declared_sizes_are_refused_before_allocating() {
    let file = Path::new("manifest.json");
    let text = manifest().to_json().to_text();
    for (from, to) in [
        ("\"shape\": [192]", "\"shape\": [1152921504606846976]"),
        ("\"shape\": [192]", "\"shape\": [1048576, 1048576, 1048576]"),
        ("\"end\": 192", "\"end\": 18446744073709551615"),
    ] {
        assert!(text.contains(from), "{from}");
        let bad = text.replacen(from, to, 1);
        let (r, peak) = peak_of(|| Manifest::parse(file, &bad));
        let e = r.expect_err(to);
        assert!(matches!(e, CkptError::Manifest { .. }), "{to}: {e}");
        assert!(peak < 64 * text.len(), "{to}: {peak} bytes");
    }
}
