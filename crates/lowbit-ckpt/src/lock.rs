//! An exclusive advisory lock on a checkpoint root, so that two runs never save into one
//! directory at the same time (their `step-N` commits, `latest` updates and tidying would
//! collide).
//!
//! The lock is `flock(LOCK_EX | LOCK_NB)` on `DIR/.lowbit.lock` (created if absent): the kernel
//! releases it when the holder's descriptor closes, the process dying included (SIGKILL, a
//! crash), so a lock is never stale; a file left by a killed holder is simply locked again. A
//! holder that ends normally removes the file while it still holds the lock, so a finished run
//! leaves its directory as it found it. Removal is safe because a new holder, once locked,
//! checks that the path still names the file it locked (same device and inode) and starts over
//! if not: whoever opened the old file before its removal ends up locking a file nobody else
//! can reach, notices, and retries on the new one. The holder writes its pid into the file, so
//! a refusal can name it. `flock` locks belong to an open file description, so a second
//! [`DirLock::acquire`] in the same process is refused too.
//!
//! `flock` is advisory: it stops cooperating runs (every `lowbit` run that saves), not other
//! programs writing into the directory. On network file systems it may be emulated or absent
//! (NFS maps it to `fcntl` byte-range locks). Without Unix there is no lock: [`DirLock::acquire`]
//! always succeeds.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{CkptError, Result, io};

/// The lock file's name inside the locked directory.
pub const LOCK_FILE: &str = ".lowbit.lock";

/// A held lock on a directory; released when dropped (or when the process ends).
#[derive(Debug)]
pub struct DirLock {
    dir: PathBuf,
    // Held open: closing it releases the lock.
    _file: File,
}

impl Drop for DirLock {
    fn drop(&mut self) {
        // Removed while still locked (see the module docs); the descriptor closes after this.
        let _ = std::fs::remove_file(self.dir.join(LOCK_FILE));
    }
}

impl DirLock {
    /// Takes the lock of the existing directory `dir`, writing this process's pid into its lock
    /// file.
    ///
    /// # Errors
    /// [`CkptError::Locked`] (naming the directory and the holder's pid) when another holder
    /// has it; [`CkptError::Io`] when the lock file cannot be created or locked.
    pub fn acquire(dir: &Path) -> Result<DirLock> {
        let path = dir.join(LOCK_FILE);
        // A holder removing the file between our open and our lock makes us start over; a
        // handful of rounds is plenty (each needs another run to finish in that instant).
        let mut rounds = 0;
        let mut file = loop {
            let (file, same) = Self::lock_once(dir, &path)?;
            if same {
                break file;
            }
            rounds += 1;
            if rounds == 16 {
                let e = std::io::Error::other("the lock file was replaced 16 times while locking");
                return Err(io("lock", &path)(e));
            }
        };
        // Ours now: record who holds it (a failure here only loses the pid of a refusal).
        let record = |f: &mut File| -> std::io::Result<()> {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
            writeln!(f, "{}", std::process::id())?;
            f.flush()
        };
        record(&mut file).map_err(io("write the lock file", &path))?;
        Ok(DirLock {
            dir: dir.to_path_buf(),
            _file: file,
        })
    }

    /// Opens and locks `path`; the file, and whether `path` still names it.
    fn lock_once(dir: &Path, path: &Path) -> Result<(File, bool)> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io("create the lock file", path))?;
        match sys::try_lock(&file) {
            Ok(true) => {}
            Ok(false) => {
                return Err(CkptError::Locked {
                    dir: dir.to_path_buf(),
                    holder: read_pid(&mut file),
                });
            }
            Err(e) => return Err(io("lock", path)(e)),
        }
        let same = sys::same_file(&file, path);
        Ok((file, same))
    }

    /// The locked directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// The pid in a lock file, if it holds one (at most 32 bytes are read).
fn read_pid(file: &mut File) -> Option<u32> {
    let mut text = String::new();
    file.seek(SeekFrom::Start(0)).ok()?;
    file.take(32).read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
}

#[cfg(unix)]
mod sys {
    use std::ffi::c_int;
    use std::fs::File;
    use std::os::fd::AsRawFd;

    // The same values on Linux and macOS (`<sys/file.h>`).
    const LOCK_EX: c_int = 2;
    const LOCK_NB: c_int = 4;

    // SAFETY: the C library's declaration of `flock(2)` (std links the C library on every Unix;
    // the workspace has no `libc` dependency).
    unsafe extern "C" {
        fn flock(fd: c_int, operation: c_int) -> c_int;
    }

    /// Whether `path` names the open `file` (same device and inode).
    pub(super) fn same_file(file: &File, path: &std::path::Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        match (file.metadata(), std::fs::metadata(path)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }

    /// `Ok(false)` when another open file description holds the lock.
    pub(super) fn try_lock(file: &File) -> std::io::Result<bool> {
        loop {
            // SAFETY: the descriptor is open for the duration of the call (borrowed from `file`);
            // `flock` reads nothing else.
            if unsafe { flock(file.as_raw_fd(), LOCK_EX | LOCK_NB) } == 0 {
                return Ok(true);
            }
            let e = std::io::Error::last_os_error();
            match e.kind() {
                std::io::ErrorKind::WouldBlock => return Ok(false),
                std::io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        }
    }
}

#[cfg(not(unix))]
mod sys {
    /// No advisory locks without Unix: always granted.
    pub(super) fn try_lock(_: &std::fs::File) -> std::io::Result<bool> {
        Ok(true)
    }

    /// Nothing to compare without Unix.
    pub(super) fn same_file(_: &std::fs::File, _: &std::path::Path) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("lowbit-lock-{name}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// A second holder is refused with the directory and the first holder's pid; after the
    /// first is dropped the lock is free again, and the file stays.
    #[test]
    fn a_second_holder_is_refused_until_the_first_releases() {
        let d = scratch("second");
        let first = DirLock::acquire(&d).unwrap();
        assert_eq!(first.dir(), d.as_path());
        let text = std::fs::read_to_string(d.join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        match DirLock::acquire(&d) {
            Err(CkptError::Locked { dir, holder }) => {
                assert_eq!(dir, d);
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        let msg = DirLock::acquire(&d).unwrap_err().to_string();
        assert!(msg.contains(&d.display().to_string()), "{msg}");
        assert!(
            msg.contains(&format!("pid {}", std::process::id())),
            "{msg}"
        );
        drop(first);
        assert!(!d.join(LOCK_FILE).exists(), "released: the file is removed");
        let again = DirLock::acquire(&d).unwrap();
        assert!(d.join(LOCK_FILE).is_file());
        drop(again);
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A lock held on a lock file that was removed (a holder's release) does not block: the
    /// path no longer names it, so the next holder locks a fresh file, which a third holder then
    /// cannot take.
    #[test]
    fn a_lock_on_a_removed_file_does_not_block() {
        let d = scratch("removed");
        let path = d.join(LOCK_FILE);
        let stale = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .unwrap();
        assert!(sys::try_lock(&stale).unwrap());
        std::fs::remove_file(&path).unwrap();
        assert!(!sys::same_file(&stale, &path));
        let l = DirLock::acquire(&d).unwrap();
        assert!(sys::same_file(&l._file, &path));
        assert!(matches!(
            DirLock::acquire(&d),
            Err(CkptError::Locked { .. })
        ));
        drop((l, stale));
        std::fs::remove_dir_all(&d).unwrap();
    }

    /// A lock file left with junk (or by an older holder) is taken over and rewritten; a
    /// directory that does not exist is an I/O error naming the lock file.
    #[test]
    fn junk_is_rewritten_and_a_missing_directory_is_an_io_error() {
        let d = scratch("junk");
        std::fs::write(
            d.join(LOCK_FILE),
            b"not a pid at all, and long enough to truncate\n",
        )
        .unwrap();
        let l = DirLock::acquire(&d).unwrap();
        let text = std::fs::read_to_string(d.join(LOCK_FILE)).unwrap();
        assert_eq!(text, format!("{}\n", std::process::id()));
        drop(l);
        let missing = d.join("absent");
        match DirLock::acquire(&missing) {
            Err(CkptError::Io { path, .. }) => assert_eq!(path, missing.join(LOCK_FILE)),
            other => panic!("expected Io, got {other:?}"),
        }
        std::fs::remove_dir_all(&d).unwrap();
    }
}
