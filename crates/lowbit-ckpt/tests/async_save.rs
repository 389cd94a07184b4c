//! Asynchronous saves: the same bytes as a synchronous save, a snapshot that later steps do not
//! reach, errors at the wait on every rank (no rank left waiting), one pending save at a time.

#[path = "../benches/support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::path::Path;

use lowbit_buffers::layout::ParamSpec;
use lowbit_ckpt::{AsyncSaver, Checkpoint, CkptError, Meta, SaveOptions, save};
use lowbit_comm::{Communicator, LocalComm};
use lowbit_dev_support::tempdir::TempDir;
use lowbit_device::Device;
use lowbit_optim::{Optimizer, OptimizerState};
use lowbit_testkit::run;
use support::{Rank, specs};

const DP: usize = 2;

fn params() -> Vec<(String, Vec<usize>)> {
    vec![
        ("l0.weight".into(), vec![48, 40]),
        ("l0.bias".into(), vec![48]),
        ("l1.weight".into(), vec![24, 48]),
    ]
}

fn meta(step: u64) -> Meta {
    let mut m = Meta {
        step,
        ..Meta::default()
    };
    m.data.insert("next_step".into(), step.to_string());
    m
}

/// Every file of a directory, by name.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("list")
        .map(|e| {
            let e = e.expect("entry");
            let bytes = std::fs::read(e.path()).expect("read");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect()
}

/// Runs `f` on `DP` rank threads, each with its rank's optimizer over `params()` (one step
/// taken, so every state tensor holds values).
fn with_ranks(f: impl Fn(&mut LocalComm, &mut Device, &mut Rank) + Sync) {
    let specs = specs(&params());
    run(DP, |mut comm, mut dev| {
        let mut r = Rank::new(&mut dev, DP, comm.rank(), &specs);
        r.step(&mut dev);
        f(&mut comm, &mut dev, &mut r);
    });
}

/// The state a fresh rank imports from `root`.
fn loaded(dev: &mut Device, dp: usize, rank: usize, root: &Path) -> Vec<OptimizerState> {
    let mut r = Rank::new(dev, dp, rank, &specs(&params()));
    r.step(dev); // other values than any saved, so a load that skipped a tensor shows
    let ck = Checkpoint::open(root).expect("open");
    ck.load_optimizer(dev, &r.specs, &mut r.opt).expect("load");
    r.opt.export_state(dev).expect("export")
}

#[test]
fn async_save_writes_what_save_writes() {
    let (sync, asynch) = (TempDir::new("ckpt-sync"), TempDir::new("ckpt-async"));
    with_ranks(|comm, dev, r| {
        let (specs, opts) = (r.specs.clone(), SaveOptions::default());
        save(dev, comm, sync.dir(), &meta(1), &specs, &r.opt, opts).expect("save");
        let mut saver = AsyncSaver::new();
        let prev = saver
            .save(dev, comm, asynch.dir(), &meta(1), &specs, &r.opt, opts)
            .expect("async save");
        assert_eq!(prev, None);
        assert_eq!(saver.pending_step(), Some(1));
        let dir = saver.wait(comm).expect("wait").expect("a pending save");
        assert_eq!(dir, asynch.path("step-1"));
        assert_eq!(saver.pending_step(), None);
        assert_eq!(saver.wait(comm).expect("nothing pending"), None);
    });
    let (a, b) = (files(&sync.path("step-1")), files(&asynch.path("step-1")));
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        [
            "manifest.json",
            "rank-00000.safetensors",
            "rank-00001.safetensors"
        ]
    );
    assert!(a == b, "async save wrote other bytes than save");
    assert_eq!(sync.entries(), asynch.entries());
    // The rank files are plain safetensors: every piece is there under its key.
    let ck = Checkpoint::open(asynch.dir()).expect("open");
    ck.verify().expect("verify");
    for (name, bytes) in &b {
        if name.ends_with(".safetensors") {
            let st = safetensors::SafeTensors::deserialize(bytes).expect("safetensors");
            let pieces = ck.manifest().tensors.iter().flat_map(|t| &t.pieces);
            let keys = pieces.filter(|p| p.file == *name).map(|p| p.key.as_str());
            for key in keys {
                st.tensor(key).expect("piece key in the rank file");
            }
        }
    }
}

/// The later saves of a saver snapshot into the previous snapshot's buffers: their files are
/// byte for byte those of synchronous saves of the same steps (a snapshot left stale in reused
/// buffers, or one tensor not copied again, differs).
#[test]
fn later_async_saves_write_what_save_writes() {
    let (sync, asynch) = (
        TempDir::new("ckpt-sync-later"),
        TempDir::new("ckpt-async-later"),
    );
    with_ranks(|comm, dev, r| {
        let (specs, opts) = (r.specs.clone(), SaveOptions::default());
        let mut saver = AsyncSaver::new();
        for step in 1..=3u64 {
            if step > 1 {
                r.step(dev); // every master and moment moves
            }
            saver
                .save(dev, comm, asynch.dir(), &meta(step), &specs, &r.opt, opts)
                .expect("async save");
            if step > 1 {
                save(dev, comm, sync.dir(), &meta(step), &specs, &r.opt, opts).expect("save");
            }
        }
        saver.wait(comm).expect("wait");
    });
    for step in ["step-2", "step-3"] {
        let (a, b) = (files(&sync.path(step)), files(&asynch.path(step)));
        assert_eq!(a.len(), 3, "{step}: {:?}", a.keys());
        for (name, bytes) in &a {
            assert!(
                b.get(name) == Some(bytes),
                "{step}/{name}: the async save wrote other bytes"
            );
        }
    }
    // And they differ from the first save's: the steps between moved the state.
    let (first, second) = (files(&asynch.path("step-1")), files(&asynch.path("step-2")));
    assert!(first["rank-00000.safetensors"] != second["rank-00000.safetensors"]);
}

#[test]
fn steps_after_the_snapshot_do_not_reach_the_checkpoint() {
    let root = TempDir::new("ckpt-async-snapshot");
    with_ranks(|comm, dev, r| {
        let (specs, rank) = (r.specs.clone(), comm.rank());
        let snapshot = r.opt.export_state(dev).expect("export");
        let mut saver = AsyncSaver::new();
        let opts = SaveOptions::default();
        saver
            .save(dev, comm, root.dir(), &meta(1), &specs, &r.opt, opts)
            .expect("async save");
        // Training goes on while the files are written.
        for _ in 0..3 {
            r.step(dev);
        }
        let later = r.opt.export_state(dev).expect("export");
        assert!(later != snapshot, "the steps changed nothing");
        saver.wait(comm).expect("wait");
        assert!(loaded(dev, DP, rank, root.dir()) == snapshot);
    });
    // One rank reads the same checkpoint (a resharding load).
    let full = run(1, |_comm, mut dev| loaded(&mut dev, 1, 0, root.dir()));
    assert_eq!(full[0][0].steps, 1);
}

#[test]
fn a_second_save_completes_the_first_and_keep_prunes() {
    let root = TempDir::new("ckpt-async-second");
    with_ranks(|comm, dev, r| {
        let specs = r.specs.clone();
        let mut saver = AsyncSaver::new();
        let opts = SaveOptions { keep: Some(2) };
        for step in 1..=3u64 {
            r.step(dev);
            let prev = saver
                .save(dev, comm, root.dir(), &meta(step), &specs, &r.opt, opts)
                .expect("async save");
            let want = (step > 1).then(|| root.path(&format!("step-{}", step - 1)));
            assert_eq!(prev, want);
            if let Some(p) = prev {
                // Committed by the time the next save returns.
                assert!(p.join("manifest.json").is_file());
            }
        }
        // A committed step is refused at once, and the pending save is completed first.
        let e = saver
            .save(dev, comm, root.dir(), &meta(2), &specs, &r.opt, opts)
            .unwrap_err();
        assert!(matches!(e, CkptError::Exists(_)), "{e}");
        assert_eq!(saver.pending_step(), None);
    });
    assert_eq!(root.entries(), ["latest", "step-2", "step-3"]);
    let ck = Checkpoint::open(root.dir()).expect("open");
    assert!(ck.dir().ends_with("step-3"));
    assert_eq!(ck.meta().data["next_step"], "3");
}

/// Rank 1 hands the save specs that its optimizer's pieces do not fit: its background write fails.
/// `AsyncSaver::save` returns on both ranks; the wait reports the failure on both (rank 0: rank 1's
/// index is missing, so it does not commit), nobody hangs, and `latest` still names the previous
/// checkpoint. The synchronous save behaves the same.
#[test]
fn errors_are_reported_at_the_wait_on_every_rank() {
    let root = TempDir::new("ckpt-async-error");
    with_ranks(|comm, dev, r| {
        let (specs, rank, opts) = (r.specs.clone(), comm.rank(), SaveOptions::default());
        save(dev, comm, root.dir(), &meta(1), &specs, &r.opt, opts).expect("save");
        // Every parameter one element long: rank 1's pieces do not fit.
        let one = |s: &ParamSpec| ParamSpec::new(s.name.clone(), vec![1], s.key);
        let bad: Vec<ParamSpec> = match rank {
            1 => specs.iter().map(one).collect(),
            _ => specs.clone(),
        };
        let bad = &bad[..];
        let mut saver = AsyncSaver::new();
        saver
            .save(dev, comm, root.dir(), &meta(2), bad, &r.opt, opts)
            .expect("the start succeeds; the write fails later");
        let e = saver.wait(comm).unwrap_err();
        match (rank, &e) {
            (0, CkptError::Io { path, .. }) => {
                assert!(path.ends_with("rank-00001.index.json"), "{e}")
            }
            (1, CkptError::Mismatch { msg, .. }) => assert!(msg.contains("elements"), "{e}"),
            _ => panic!("rank {rank}: {e}"),
        }
        let e = save(dev, comm, root.dir(), &meta(3), bad, &r.opt, opts).unwrap_err();
        assert!(
            matches!(
                (rank, &e),
                (0, CkptError::Io { .. }) | (1, CkptError::Mismatch { .. })
            ),
            "rank {rank}: {e}"
        );
    });
    let ck = Checkpoint::open(root.dir()).expect("open");
    assert!(ck.dir().ends_with("step-1"));
    assert!(!root.path("step-2").exists() && !root.path("step-3").exists());
}

/// Rank 0 fails to commit (a file sits where `step-N` goes after the others checked): the
/// other ranks, whose own writes succeeded, report that rank 0 did not commit.
#[test]
fn a_failed_commit_is_an_error_on_every_rank() {
    let root = TempDir::new("ckpt-async-commit");
    with_ranks(|comm, dev, r| {
        let (specs, rank) = (r.specs.clone(), comm.rank());
        let mut saver = AsyncSaver::new();
        let opts = SaveOptions::default();
        saver
            .save(dev, comm, root.dir(), &meta(5), &specs, &r.opt, opts)
            .expect("async save");
        comm.barrier().expect("barrier");
        if rank == 0 {
            // A non-empty directory: the rename onto it fails.
            std::fs::create_dir_all(root.path("step-5").join("x")).expect("block");
        }
        let e = saver.wait(comm).unwrap_err();
        match (rank, &e) {
            (0, CkptError::Io { op, .. }) => assert!(op.contains("rename"), "{e}"),
            (_, CkptError::Io { op, .. }) => assert!(op.contains("rank 0"), "{e}"),
            _ => panic!("rank {rank}: {e}"),
        }
    });
    assert!(!root.path("latest").exists());
}

/// A saver dropped with a save pending never commits it: like a kill after the writes.
#[test]
fn a_dropped_pending_save_is_never_committed() {
    let root = TempDir::new("ckpt-async-drop");
    with_ranks(|comm, dev, r| {
        let specs = r.specs.clone();
        let opts = SaveOptions::default();
        let mut saver = AsyncSaver::new();
        saver
            .save(dev, comm, root.dir(), &meta(1), &specs, &r.opt, opts)
            .expect("async save");
        saver.wait(comm).expect("wait");
        saver
            .save(dev, comm, root.dir(), &meta(2), &specs, &r.opt, opts)
            .expect("async save");
        drop(saver);
    });
    assert_eq!(root.entries(), [".tmp-step-2", "latest", "step-1"]);
    let ck = Checkpoint::open(root.dir()).expect("open");
    assert!(ck.dir().ends_with("step-1"));
    assert!(matches!(
        Checkpoint::open(&root.path(".tmp-step-2")),
        Err(CkptError::NotACheckpoint(_))
    ));
}
