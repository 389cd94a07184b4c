//! Host memory of saves, loads and manifest parsing, counted by a global allocator.
//!
//! A synchronous save streamed from the
//! optimizer's device views takes, per rank, at most its chunk pool (`2·workers + 2` buffers,
//! never more than its chunks, each at most `min(8 MiB, largest piece)`) and its index and
//! header texts, so many thread ranks saving a small state take little memory. (A pool of
//! full-size 8 MiB buffers took `(2·workers + 2)·8 MiB` per rank whatever the state: 2.5 GB at
//! 64 ranks for 0.9 MB of state.) The load streams through the same kind of pool.
//!
//! A manifest is parsed streaming: its tensor list entry by entry, never as one JSON tree, so
//! parsing takes the manifest built (less than the text) and one entry's tree. (The tree of a
//! whole manifest took several times the text: 3.8 GB to verify a 247 MB manifest.)
//!
//! The counter is global: the tests take turns ([`serial`]).

#[path = "../benches/support/mod.rs"]
mod support;

use std::sync::Mutex;
use std::time::Instant;

use lowbit_ckpt::json::Json;
use lowbit_ckpt::{
    Checkpoint, CkptError, FileEntry, Manifest, Meta, OptimizerEntry, Piece, SaveOptions,
    TensorEntry, save,
};
use lowbit_comm::Communicator;
use lowbit_dev_support::alloc::{self, GlobalCounting, global_peak_of as peak_of};
use lowbit_dev_support::tempdir::TempDir;
use lowbit_testkit::run;
use support::{Rank, specs};

// Every thread's allocations: the ranks are threads.
#[global_allocator]
static COUNTING: GlobalCounting = GlobalCounting;

const RANKS: usize = 16;

/// One test at a time (the counter sees every thread of the process).
fn serial() -> std::sync::MutexGuard<'static, ()> {
    static ONE: Mutex<()> = Mutex::new(());
    ONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Peak live bytes above the live bytes at the start, while `f` runs on every rank between
/// barriers (so every rank's part is inside the window).
fn peak_during(
    comm: &mut dyn Communicator,
    f: impl FnOnce(&mut dyn Communicator),
) -> Option<usize> {
    comm.barrier().expect("barrier");
    let base = (comm.rank() == 0).then(alloc::reset_global_peak);
    comm.barrier().expect("barrier");
    f(comm);
    comm.barrier().expect("barrier");
    base.map(|b| alloc::global_peak().saturating_sub(b))
}

#[test]
fn sync_save_and_load_of_a_small_state_at_many_ranks_take_little_memory() {
    let _one = serial();
    let params: Vec<(String, Vec<usize>)> = vec![
        ("l0.weight".into(), vec![64, 64]),
        ("l0.bias".into(), vec![64]),
        ("l1.weight".into(), vec![32, 64]),
    ];
    let specs = specs(&params);
    // Masters and two moments, f32: the whole state, over all ranks.
    let state_bytes: usize = 3
        * 4
        * params
            .iter()
            .map(|(_, s)| s.iter().product::<usize>())
            .sum::<usize>();
    let root = TempDir::new("ckpt-save-memory");
    let peaks = run(RANKS, |mut comm, mut dev| {
        let mut r = Rank::new(&mut dev, RANKS, comm.rank(), &specs);
        r.step(&mut dev);
        let specs = r.specs.clone();
        let meta = Meta {
            step: 1,
            ..Meta::default()
        };
        let saved = peak_during(&mut comm, |comm| {
            save(
                &dev,
                comm,
                root.dir(),
                &meta,
                &specs,
                &r.opt,
                SaveOptions::default(),
            )
            .expect("save");
        });
        let loaded = peak_during(&mut comm, |_| {
            let ck = Checkpoint::open(root.dir()).expect("open");
            ck.load_optimizer(&mut dev, &specs, &mut r.opt)
                .expect("load");
        });
        (saved, loaded)
    });
    let (saved, loaded) = peaks[0];
    let (saved, loaded) = (
        saved.expect("rank 0 measures"),
        loaded.expect("rank 0 measures"),
    );
    println!(
        "{RANKS} ranks, {state_bytes} bytes of state: save peak +{saved} bytes, load peak +{loaded} bytes"
    );
    // Per rank: its pool (at most 18 buffers, none larger than the largest piece: 16 KiB of a
    // rank's share here) and a few small texts. 1 MiB a rank is generous; full-size pool
    // buffers are 48 MiB a rank or more.
    let bound = RANKS << 20;
    assert!(
        saved < bound,
        "a save of {state_bytes} bytes at {RANKS} ranks took +{saved} bytes"
    );
    assert!(
        loaded < bound,
        "a load of {state_bytes} bytes at {RANKS} ranks took +{loaded} bytes"
    );
}

/// A manifest as 64 ranks write it: `tensors` tensors of 64 pieces each, one per rank file.
fn big_manifest(tensors: usize) -> Manifest {
    const FILES: usize = 64;
    let file = |r: usize| format!("rank-{r:05}.safetensors");
    let piece = 1024u64;
    Manifest {
        meta: Meta {
            step: 7,
            ..Meta::default()
        },
        optimizers: vec![OptimizerEntry {
            owner: 0,
            rule: "adamw".into(),
            steps: 7,
        }],
        files: (0..FILES)
            .map(|r| FileEntry {
                name: file(r),
                bytes: 1 << 40,
            })
            .collect(),
        tensors: (0..tensors)
            .map(|t| {
                let (param, state) = (format!("blocks.{t}.mlp.w_up.weight"), "exp_avg");
                TensorEntry {
                    name: format!("{param}/{state}"),
                    pieces: (0..FILES as u64)
                        .map(|r| Piece {
                            file: file(r as usize),
                            key: format!("{param}/{state}@{}", r * piece),
                            start: r * piece,
                            end: (r + 1) * piece,
                            offset: 4096 + 4 * (t as u64 * piece),
                            hash: 0x0123_4567_89ab_cdef ^ (t as u64 * 64 + r),
                        })
                        .collect(),
                    param,
                    state: state.into(),
                    owner: 0,
                    shape: vec![FILES as u64 * piece],
                    dtype: "F32".into(),
                }
            })
            .collect(),
    }
}

/// `LOWBIT_MANIFEST_MB` (default 16) sets the manifest's size; by hand, 50 and 250 MB.
#[test]
fn a_large_manifest_opens_in_a_small_multiple_of_its_size() {
    let _one = serial();
    let mb: usize = std::env::var("LOWBIT_MANIFEST_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(16);
    // About 16 KB of text per tensor of 64 pieces.
    let mut m = big_manifest((mb << 20) / 16_000);
    // Files as large as the pieces need (sparse: nothing is read).
    let bytes = m
        .tensors
        .iter()
        .flat_map(|t| &t.pieces)
        .map(|p| p.offset + 4 * (p.end - p.start))
        .max()
        .unwrap_or(0);
    let dir = TempDir::new("ckpt-big-manifest");
    for f in &mut m.files {
        f.bytes = bytes;
        let file = std::fs::File::create(dir.path(&f.name)).expect("create");
        file.set_len(bytes).expect("sparse file");
    }
    let text = m.to_json().to_text();
    std::fs::write(dir.path("manifest.json"), &text).expect("write");
    let pieces: usize = m.tensors.iter().map(|t| t.pieces.len()).sum();
    let start = Instant::now();
    let (opened, peak) = peak_of(|| Checkpoint::open(dir.dir()));
    let took = start.elapsed();
    let opened = opened.expect("the manifest opens");
    assert!(*opened.manifest() == m, "parsed other values");
    drop(opened);
    let (tree, as_tree) = peak_of(|| Json::parse(&text));
    drop(tree.expect("JSON"));
    let x = |n: usize| n as f64 / text.len() as f64;
    println!(
        "manifest of {} bytes, {pieces} pieces: opened in {took:.1?} with a peak of +{peak} \
         bytes ({:.2}x the text, the text included); one JSON tree of it: +{as_tree} bytes \
         ({:.2}x)",
        text.len(),
        x(peak),
        x(as_tree),
    );
    // The text read, the manifest built (about 0.7x the text here) and one tensor's tree.
    assert!(
        x(peak) < 2.5,
        "opening {} bytes of manifest took +{peak} bytes",
        text.len()
    );
    // Linear time: a debug build parses well over 1 MB/s (a quadratic step would not).
    assert!(
        took.as_secs_f64() < 5.0 + text.len() as f64 / 1e6,
        "{took:?}"
    );
}

/// A manifest over the cap (256 MiB) is refused by its size, before anything is read or
/// allocated for it, with the cap in the message.
#[test]
fn an_oversized_manifest_is_refused_before_reading() {
    let _one = serial();
    let dir = TempDir::new("ckpt-huge-manifest");
    let f = std::fs::File::create(dir.path("manifest.json")).expect("create");
    f.set_len((256 << 20) + 1).expect("sparse file");
    let (r, peak) = peak_of(|| Checkpoint::open(dir.dir()));
    match r {
        Err(CkptError::Manifest { file, msg }) => {
            assert!(file.ends_with("manifest.json"), "{}", file.display());
            assert!(msg.contains("larger than 256 MiB"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    assert!(peak < 1 << 20, "{peak} bytes allocated");
}
