//! What `Checkpoint::verify` proves and what the checkpoint root refuses: checkpoints that
//! passed the old verify (hashes only) but do not load are refused naming the file; a `latest`
//! symlink is resolved only to a `step-N` of its root and never read through; a failed save
//! leaves no temporary directory.

#[path = "../benches/support/mod.rs"]
#[allow(dead_code)]
mod support;

use std::path::{Path, PathBuf};

use lowbit_ckpt::json::Json;
use lowbit_ckpt::{Checkpoint, CkptError, Meta, SaveOptions, save};
use lowbit_comm::{CommStats, Communicator, Device, Op};
use lowbit_dev_support::tempdir::TempDir;
use lowbit_testkit::run;
use support::{Rank, specs};

fn params() -> Vec<(String, Vec<usize>)> {
    vec![
        ("l0.weight".into(), vec![16, 12]),
        ("l0.bias".into(), vec![16]),
        ("l1.weight".into(), vec![8, 16]),
    ]
}

/// A checkpoint of `step` saved by two ranks under `root`; its directory.
fn saved(root: &Path, step: u64) -> PathBuf {
    let specs = specs(&params());
    run(2, |mut comm, mut dev| {
        let dev = &mut dev;
        let mut r = Rank::new(dev, 2, comm.rank(), &specs);
        r.step(dev);
        let meta = Meta {
            step,
            ..Meta::default()
        };
        save(
            dev,
            &mut comm,
            root,
            &meta,
            &specs,
            &r.opt,
            SaveOptions::default(),
        )
        .expect("save")
    });
    let dir = root.join(format!("step-{step}"));
    Checkpoint::open(&dir).unwrap().verify().unwrap();
    dir
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// The byte offset of `needle` in the safetensors header of `file`.
fn header_find(file: &Path, needle: &[u8]) -> usize {
    let d = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(d[..8].try_into().unwrap()) as usize;
    d[8..8 + n]
        .windows(needle.len())
        .position(|w| w == needle)
        .map(|i| 8 + i)
        .expect("in the header")
}

fn patch(file: &Path, at: usize, bytes: &[u8]) {
    let mut d = std::fs::read(file).unwrap();
    d[at..at + bytes.len()].copy_from_slice(bytes);
    std::fs::write(file, d).unwrap();
}

fn header_error(dir: &Path) -> String {
    let e = Checkpoint::open(dir).unwrap().verify().unwrap_err();
    assert!(matches!(e, CkptError::Header { .. }), "{e}");
    e.to_string()
}

#[test]
fn a_tensor_removed_from_the_manifest_is_refused() {
    let root = TempDir::new("verify-removed");
    let dir = saved(root.dir(), 1);
    let path = dir.join("manifest.json");
    let mut m = Json::parse(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let Json::Obj(o) = &mut m else { panic!() };
    let Some(Json::Arr(tensors)) = o.get_mut("tensors") else {
        panic!()
    };
    let removed = tensors.pop().unwrap();
    std::fs::write(&path, m.to_text()).unwrap();
    // The manifest still opens (every listed tensor is tiled, every file the listed size) and
    // every listed piece still hashes: before, verify said ok.
    let ck = Checkpoint::open(&dir).unwrap();
    assert!(ck.manifest().tensor(removed.key("name").text()).is_none());
    let e = header_error(&dir);
    assert!(
        e.contains("rank-0000") && e.contains("no piece of the manifest"),
        "{e}"
    );
}

#[test]
fn a_garbled_rank_file_header_is_refused() {
    let root = TempDir::new("verify-garbled");
    let dir = saved(root.dir(), 1);
    let file = dir.join("rank-00001.safetensors");
    let original = std::fs::read(&file).unwrap();
    // Not JSON any more (safetensors and every other reader refuse the file).
    patch(&file, 8, b"x");
    let e = header_error(&dir);
    assert!(
        e.contains("rank-00001.safetensors") && e.contains("not"),
        "{e}"
    );
    // Valid JSON, but an entry's dtype no longer fits its bytes.
    std::fs::write(&file, &original).unwrap();
    patch(&file, header_find(&file, b"\"F32\""), b"\"F16\"");
    let e = header_error(&dir);
    assert!(e.contains("F16") && e.contains("data bytes"), "{e}");
    // A header length that runs past the file.
    std::fs::write(&file, &original).unwrap();
    patch(&file, 0, &u64::MAX.to_le_bytes());
    let e = header_error(&dir);
    assert!(e.contains("header length"), "{e}");
    // Restored: ok again.
    std::fs::write(&file, &original).unwrap();
    Checkpoint::open(&dir).unwrap().verify().unwrap();
}

#[test]
fn a_step_directory_holding_another_steps_manifest_is_refused() {
    let root = TempDir::new("verify-step-name");
    let dir20 = saved(root.dir(), 20);
    let dir30 = root.path("step-30");
    copy_dir(&dir20, &dir30);
    let e = Checkpoint::open(&dir30).unwrap().verify().unwrap_err();
    assert!(
        matches!(
            e,
            CkptError::StepName {
                named: 30,
                step: 20,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("step-30"), "{e}");
    // Elsewhere under another name, the checkpoint is still its own.
    let other = root.path("copy");
    copy_dir(&dir20, &other);
    Checkpoint::open(&other).unwrap().verify().unwrap();
}

#[test]
fn a_rank_file_that_is_a_directory_is_refused_as_such() {
    let root = TempDir::new("verify-rank-dir");
    let dir = saved(root.dir(), 3);
    let rank = dir.join("rank-00000.safetensors");
    std::fs::remove_file(&rank).unwrap();
    std::fs::create_dir(&rank).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        matches!(
            e,
            CkptError::NotAFile {
                kind: "a directory",
                ..
            }
        ),
        "{e}"
    );
    let text = e.to_string();
    assert!(
        text.contains("rank-00000.safetensors") && text.contains("a directory"),
        "{text}"
    );
    assert!(!text.contains("bytes"), "not reported by its size: {text}");
}

#[cfg(unix)]
#[test]
fn a_latest_symlink_is_resolved_inside_the_root_or_refused_without_its_contents() {
    use std::os::unix::fs::symlink;
    let root = TempDir::new("verify-latest-link");
    let ck_root = root.path("c");
    saved(&ck_root, 4);
    let latest = ck_root.join("latest");
    std::fs::remove_file(&latest).unwrap();
    // To a committed step of the root: resolved.
    symlink("step-4", &latest).unwrap();
    let ck = Checkpoint::open(&ck_root).unwrap();
    assert!(ck.dir().ends_with("step-4"));
    assert_eq!(lowbit_ckpt::latest_step(&ck_root).unwrap(), Some(4));
    // To a file with secret text: refused, the text never echoed.
    let secret = root.path("secret.txt");
    std::fs::write(&secret, "step-4 TOPSECRET-8f3a password=hunter2\n").unwrap();
    std::fs::remove_file(&latest).unwrap();
    symlink(&secret, &latest).unwrap();
    for e in [
        Checkpoint::open(&ck_root).unwrap_err(),
        lowbit_ckpt::latest_step(&ck_root).unwrap_err(),
    ] {
        let msg = e.to_string();
        assert!(matches!(e, CkptError::Manifest { .. }), "{msg}");
        assert!(msg.contains("symbolic link"), "{msg}");
        assert!(
            !msg.contains("TOPSECRET") && !msg.contains("hunter2"),
            "{msg}"
        );
    }
    // To a `step-N` of another root: refused too.
    let elsewhere = root.path("other");
    saved(&elsewhere, 4);
    std::fs::remove_file(&latest).unwrap();
    symlink(elsewhere.join("step-4"), &latest).unwrap();
    assert!(matches!(
        Checkpoint::open(&ck_root),
        Err(CkptError::Manifest { .. })
    ));
    // A regular `latest` with secret text: refused, not echoed.
    std::fs::remove_file(&latest).unwrap();
    std::fs::write(&latest, "TOPSECRET-8f3a\n").unwrap();
    let msg = Checkpoint::open(&ck_root).unwrap_err().to_string();
    assert!(!msg.contains("TOPSECRET"), "{msg}");
}

/// A communicator that, at its first barrier (the one after rank 0 prepared the temp
/// directory), puts a directory where this rank's data file goes: the rank's write fails as
/// on a full or broken disk.
#[derive(Debug)]
struct FailingWrite<C> {
    inner: C,
    tmp: PathBuf,
    barriers: usize,
}

impl<C: Communicator> Communicator for FailingWrite<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn start_coalesced(
        &mut self,
        dev: &mut Device,
        ops: &[Op],
    ) -> lowbit_comm::Result<lowbit_comm::Work> {
        self.inner.start_coalesced(dev, ops)
    }
    fn barrier(&mut self) -> lowbit_comm::Result<()> {
        self.inner.barrier()?;
        if self.barriers == 0 {
            let file = self
                .tmp
                .join(format!("rank-{:05}.safetensors", self.inner.rank()));
            std::fs::create_dir_all(file).unwrap();
        }
        self.barriers += 1;
        Ok(())
    }
    fn split(&mut self, color: u32, key: u32) -> lowbit_comm::Result<Box<dyn Communicator>> {
        self.inner.split(color, key)
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn abort(&mut self, reason: &str) {
        self.inner.abort(reason);
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn a_failed_save_removes_its_temporary_directory() {
    let root = TempDir::new("verify-failed-save");
    saved(root.dir(), 1);
    let specs = specs(&params());
    let results = run(1, |comm, mut dev| {
        let dev = &mut dev;
        let mut r = Rank::new(dev, 1, 0, &specs);
        r.step(dev);
        let mut comm = FailingWrite {
            inner: comm,
            tmp: root.path(".tmp-step-2"),
            barriers: 0,
        };
        let meta = Meta {
            step: 2,
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
    });
    let e = results.into_iter().next().unwrap().unwrap_err();
    assert!(e.to_string().contains(".tmp-step-2"), "{e}");
    // Nothing of the failed save is left; the previous checkpoint is still the latest.
    assert_eq!(names(root.dir()), ["latest", "step-1"]);
    assert!(
        Checkpoint::open(root.dir())
            .unwrap()
            .dir()
            .ends_with("step-1")
    );
}
