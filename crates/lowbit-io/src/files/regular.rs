//! Opening an input that must be a regular file without ever blocking on it.
//!
//! `open(2)` of a FIFO for reading blocks until a writer appears, and a character device such
//! as `/dev/zero` never ends, so a size check made after a plain open comes too late. The path
//! is therefore checked with `stat` first (a FIFO, device, socket or directory is refused
//! before anything is opened), then opened with `O_NONBLOCK` — which returns at once for a
//! FIFO that a race swapped in after the `stat`, and has no effect on a regular file (POSIX
//! `open`: "the behavior of O_NONBLOCK for regular files is unspecified"; Linux and the BSDs
//! ignore it) — and the handle is checked again with `fstat`, so what is read is the regular
//! file that was checked.

use std::fs;
use std::path::Path;

use crate::error::Error;

/// `O_NONBLOCK` of the target, declared here because the crate has no `libc` dependency
/// (Linux `asm-generic/fcntl.h`; MIPS `asm/fcntl.h`; SPARC `asm/fcntl.h`; the BSDs and macOS
/// `sys/fcntl.h`).
#[cfg(unix)]
const O_NONBLOCK: i32 = if cfg!(any(target_os = "linux", target_os = "android")) {
    if cfg!(any(target_arch = "mips", target_arch = "mips64")) {
        0x80
    } else if cfg!(any(target_arch = "sparc", target_arch = "sparc64")) {
        0x4000
    } else {
        0o4000
    }
} else {
    0x0004
};

/// Opens `path` for reading if, and only if, it is a regular file (a symbolic link is
/// followed), without blocking whatever it is; returns the handle and its `fstat` metadata.
/// Anything else is refused with [`Error::NotRegularFile`], naming the path and what it is.
pub fn open_regular(path: &Path) -> Result<(fs::File, fs::Metadata), Error> {
    let io = |e| Error::io("read", path, e);
    let before = fs::metadata(path).map_err(io)?;
    refuse_unless_file(path, &before)?;
    let mut options = fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut options, O_NONBLOCK);
    let file = options.open(path).map_err(io)?;
    let meta = file.metadata().map_err(io)?;
    refuse_unless_file(path, &meta)?;
    Ok((file, meta))
}

fn refuse_unless_file(path: &Path, meta: &fs::Metadata) -> Result<(), Error> {
    if meta.file_type().is_file() {
        Ok(())
    } else {
        Err(Error::NotRegularFile {
            path: path.to_owned(),
            kind: super::file_kind(&meta.file_type()),
        })
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn kind_of(path: &Path) -> &'static str {
        match open_regular(path) {
            Err(Error::NotRegularFile { kind, .. }) => kind,
            other => panic!("{}: {:?}", path.display(), other.map(|_| ())),
        }
    }

    #[test]
    fn only_regular_files_open() {
        assert_eq!(kind_of(Path::new("/dev/zero")), "a character device");
        assert_eq!(kind_of(&std::env::temp_dir()), "a directory");
        let me = std::env::current_exe().unwrap();
        let (_, meta) = open_regular(&me).unwrap();
        assert!(meta.is_file());
    }

    #[test]
    fn a_fifo_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("lowbit-regular-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            eprintln!("skipped: no mkfifo");
            return;
        }
        // Nothing ever opens the FIFO for writing: a blocking open would hang here.
        assert_eq!(kind_of(&fifo), "a FIFO");
        let e = open_regular(&fifo).err().unwrap().to_string();
        assert!(e.contains("not a regular file (a FIFO)"), "{e}");
        fs::remove_dir_all(&dir).unwrap();
    }
}
