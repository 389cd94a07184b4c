//! Byte-mutation fuzzing of what a load reads (issue 14, item 8): `manifest.json` and the rank
//! files (their safetensors headers above all) of a valid two-rank checkpoint are mutated and
//! opened, verified and loaded (resharded to one rank). Every outcome is either a typed
//! [`CkptError`] that names a file of the checkpoint, or a load whose masters and moments are
//! bit for bit the saved ones (a mutation the format does not depend on, such as whitespace,
//! a key order, a safetensors header the loader does not read): never a panic, never a wrong
//! tensor accepted, never a refused load that imported anything. The valid checkpoint loads
//! before and after.
//!
//! Mutations come from proptest (seeded: a failure reproduces and shrinks); `LOWBIT_FUZZ_CASES`
//! sets the number of cases per target, as for the root's `tests/fuzz_files.rs` (CI runs the
//! default). A crash found here becomes its own regression test below.

#[path = "../benches/support/mod.rs"]
mod support;

use std::cell::{Cell, RefCell};
use std::path::Path;

use lowbit_ckpt::{Checkpoint, CkptError, Meta, SaveOptions, save};
use lowbit_comm::Communicator;
use lowbit_dev_support::tempdir::TempDir;
use lowbit_device::Device;
use lowbit_optim::{Optimizer, OptimizerState};
use lowbit_testkit::run;
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
use support::{Rank, specs};

fn cases() -> u32 {
    lowbit_dev_support::fuzz_cases(64)
}

fn params() -> Vec<(String, Vec<usize>)> {
    vec![
        ("l0.weight".into(), vec![16, 12]),
        ("l0.bias".into(), vec![16]),
        ("l1.weight".into(), vec![8, 16]),
    ]
}

/// One mutation of a file's bytes; indexes are taken modulo what they index.
#[derive(Clone, Debug)]
enum Mutation {
    /// Bits flipped at (index, bit).
    Flip(Vec<(usize, u8)>),
    /// Bytes replaced by JSON's structural characters and digits.
    Structural(Vec<(usize, usize)>),
    /// Cut to this length.
    Truncate(usize),
    /// Bytes appended.
    Extend(Vec<u8>),
    /// The n-th run of digits replaced by an interesting number.
    Number(usize, usize),
    /// A line removed.
    DeleteLine(usize),
    /// A line repeated.
    DuplicateLine(usize),
    /// Two lines exchanged (JSON members and array elements of the manifest are one per line).
    SwapLines(usize, usize),
    /// The header length of a safetensors file (its first 8 bytes) replaced.
    HeaderLength(u64),
}

const JSON: &[u8] = b"{}[]\",:0123456789-e.\\ ";
const NUMBERS: [&str; 9] = [
    "0",
    "1",
    "18446744073709551615",
    "18446744073709551616",
    "-1",
    "1e3",
    "4294967296",
    "99999999999",
    "00",
];

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = || any::<usize>();
    prop_oneof![
        prop::collection::vec((at(), 0u8..8), 1..8).prop_map(Mutation::Flip),
        prop::collection::vec((at(), 0..JSON.len()), 1..4).prop_map(Mutation::Structural),
        at().prop_map(Mutation::Truncate),
        prop::collection::vec(any::<u8>(), 1..32).prop_map(Mutation::Extend),
        (at(), 0..NUMBERS.len()).prop_map(|(i, n)| Mutation::Number(i, n)),
        at().prop_map(Mutation::DeleteLine),
        at().prop_map(Mutation::DuplicateLine),
        (at(), at()).prop_map(|(a, b)| Mutation::SwapLines(a, b)),
        prop_oneof![Just(0u64), Just(u64::MAX), any::<u64>(), 0u64..4096]
            .prop_map(Mutation::HeaderLength),
    ]
}

/// Line spans of `v`, each with its newline.
fn lines(v: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for (i, &b) in v.iter().enumerate() {
        if b == b'\n' {
            out.push((start, i + 1));
            start = i + 1;
        }
    }
    if start < v.len() {
        out.push((start, v.len()));
    }
    out
}

fn apply(base: &[u8], m: &Mutation) -> Vec<u8> {
    let mut v = base.to_vec();
    let n = v.len().max(1);
    let ls = lines(&v);
    let line = |i: usize| ls[i % ls.len().max(1)];
    match m {
        Mutation::Flip(f) => f.iter().for_each(|&(i, b)| v[i % n] ^= 1 << b),
        Mutation::Structural(s) => s.iter().for_each(|&(i, c)| v[i % n] = JSON[c]),
        Mutation::Truncate(len) => v.truncate(len % n),
        Mutation::Extend(e) => v.extend(e),
        Mutation::Number(i, k) => {
            let runs: Vec<(usize, usize)> = {
                let mut runs = Vec::new();
                let mut j = 0;
                while j < v.len() {
                    if v[j].is_ascii_digit() {
                        let s = j;
                        while j < v.len() && v[j].is_ascii_digit() {
                            j += 1;
                        }
                        runs.push((s, j));
                    }
                    j += 1;
                }
                runs
            };
            if let Some(&(s, e)) = runs.get(i % runs.len().max(1)) {
                v.splice(s..e, NUMBERS[*k].bytes());
            }
        }
        Mutation::DeleteLine(i) => {
            let (s, e) = line(*i);
            v.drain(s..e);
        }
        Mutation::DuplicateLine(i) => {
            let (s, e) = line(*i);
            let copy = v[s..e].to_vec();
            v.splice(e..e, copy);
        }
        Mutation::SwapLines(a, b) => {
            let (la, lb) = (line(*a), line(*b));
            let (first, second) = if la.0 <= lb.0 { (la, lb) } else { (lb, la) };
            if first.1 <= second.0 {
                let mut out = v[..first.0].to_vec();
                out.extend(&v[second.0..second.1]);
                out.extend(&v[first.1..second.0]);
                out.extend(&v[first.0..first.1]);
                out.extend(&v[second.1..]);
                v = out;
            }
        }
        Mutation::HeaderLength(h) => {
            if v.len() >= 8 {
                v[..8].copy_from_slice(&h.to_le_bytes());
            }
        }
    }
    v
}

/// A valid checkpoint saved by two ranks (after one step) and the state one rank loads from it.
struct Base {
    root: TempDir,
    dir: std::path::PathBuf,
    want: Vec<OptimizerState>,
}

fn base(tag: &str) -> Base {
    let root = TempDir::new(tag);
    let specs = specs(&params());
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut r = Rank::new(dev, 2, comm.rank(), &specs);
        r.step(dev);
        let meta = Meta {
            step: 1,
            ..Meta::default()
        };
        save(
            dev,
            &mut comm,
            root.dir(),
            &meta,
            &specs,
            &r.opt,
            SaveOptions::default(),
        )
        .expect("save");
    });
    let dir = root.path("step-1");
    let mut dev = Device::cpu();
    let mut r = Rank::new(&mut dev, 1, 0, &specs);
    let want = load(&mut dev, &mut r, &dir).expect("the valid checkpoint loads");
    Base { root, dir, want }
}

/// Opens, verifies and loads `dir` into `r`; the state after the load.
fn load(dev: &mut Device, r: &mut Rank, dir: &Path) -> Result<Vec<OptimizerState>, CkptError> {
    let ck = Checkpoint::open(dir)?;
    ck.verify()?;
    ck.load_optimizer(dev, &r.specs, &mut r.opt)?;
    Ok(r.opt.export_state(dev).expect("export"))
}

/// Masters, moments and step counts (a manifest scalar, under the manifest's scalars hash).
fn tensors(s: &[OptimizerState]) -> Vec<(u64, usize, String, Vec<u32>)> {
    s.iter()
        .flat_map(|st| st.tensors.iter().map(|t| (st.steps, t)))
        .map(|(steps, t)| {
            let bits = t.values.iter().map(|x| x.to_bits()).collect();
            (steps, t.param, t.name.clone(), bits)
        })
        .collect()
}

/// Fuzzes the file `name` of the base checkpoint; returns how many mutations were refused.
fn fuzz(tag: &str, name: &str) -> u32 {
    let b = base(tag);
    let path = b.dir.join(name);
    let original = std::fs::read(&path).expect("read");
    let mut dev = Device::cpu();
    let r = Rank::new(&mut dev, 1, 0, &specs(&params()));
    // The runner takes an `Fn`: the loading rank is borrowed per case.
    let loader = RefCell::new((dev, r));
    let dir = b.dir.display().to_string();
    let refused = Cell::new(0);
    let config = Config {
        cases: cases(),
        failure_persistence: None,
        ..Config::default()
    };
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &[tag.len() as u8; 32]);
    let mut runner = TestRunner::new_with_rng(config, rng);
    let result = runner.run(&mutation(), |m| {
        std::fs::write(&path, apply(&original, &m)).expect("write");
        let (dev, r) = &mut *loader.borrow_mut();
        let before = r.opt.export_state(dev).expect("export");
        match load(dev, r, &b.dir) {
            Ok(got) => prop_assert_eq!(tensors(&got), tensors(&b.want), "{:?} accepted", m),
            Err(e) => {
                refused.set(refused.get() + 1);
                let msg = e.to_string();
                prop_assert!(msg.contains(&dir), "{:?}: `{}` names no file", m, msg);
                let after = r.opt.export_state(dev).expect("export");
                prop_assert!(after == before, "{:?}: a refused load imported", m);
            }
        }
        Ok(())
    });
    std::fs::write(&path, &original).expect("restore");
    if let Err(e) = result {
        panic!("{tag}: {e}");
    }
    let (mut dev, mut r) = loader.into_inner();
    // The valid checkpoint still loads, bit for bit.
    let got = load(&mut dev, &mut r, &b.dir).expect("the restored checkpoint loads");
    assert!(got == b.want);
    drop(b.root);
    eprintln!("{tag}: {} of {} mutations refused", refused.get(), cases());
    refused.get()
}

#[test]
fn mutated_manifests_are_refused_or_load_the_saved_tensors() {
    let refused = fuzz("fuzz-manifest", "manifest.json");
    // The harness must exercise the error paths, not only harmless mutations.
    assert!(refused > cases() / 2, "only {refused} refused");
}

#[test]
fn mutated_rank_files_are_refused_or_load_the_saved_tensors() {
    let refused = fuzz("fuzz-rank-file", "rank-00001.safetensors");
    assert!(refused > 0, "no mutation was refused");
}
