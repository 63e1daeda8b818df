//! Opening input files only when they are regular files.
//!
//! `open(2)` on a FIFO blocks until a writer appears (and opening one for writing blocks until a
//! reader appears), so a FIFO in place of `config.json`, a safetensors shard, `manifest.json`,
//! `tokenizer.json` or the presence journal would hang `convert`, `info`, `run` or `serve`
//! forever. Every deltafin crate that reads a user-supplied directory opens through these
//! helpers: they open without blocking and refuse anything but a regular file (symbolic links
//! to regular files are followed).
//!
//! This crate sits below every other deltafin crate (it depends on `libc` only), so the
//! tokenizer crate and the format crate share one implementation without depending on each
//! other.

use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// The message of the `InvalidInput` error for a path that is not a regular file.
pub const NOT_REGULAR: &str =
    "not a regular file (a FIFO, socket, device or directory); deltafin reads only regular files";

fn not_regular() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, NOT_REGULAR)
}

/// Opens `path` for reading if it is a regular file.
///
/// Errors: what `open` returns (`NotFound` for a missing file), or `InvalidInput`
/// ([`NOT_REGULAR`]) for anything but a regular file.
pub fn open_regular(path: &Path) -> io::Result<File> {
    open_regular_with(OpenOptions::new().read(true), 0, path)
}

/// Opens `path` with `options` and `custom_flags` (for example `libc::O_DIRECT`; 0 for none) if
/// it is a regular file; the file's status flags are then exactly those asked for.
///
/// `options.custom_flags` is overwritten: pass custom flags in `custom_flags`.
///
/// Errors: what `open` returns, or `InvalidInput` ([`NOT_REGULAR`]) for anything but a regular
/// file (a FIFO opened for writing with no reader gives `ENXIO` from `open` itself).
pub fn open_regular_with(options: &mut OpenOptions, custom_flags: i32, path: &Path) -> io::Result<File> {
    // O_NONBLOCK makes opening a FIFO return at once; on a regular file it has no effect, and
    // it is cleared again below so that later reads and writes behave as the caller asked.
    let f = options.custom_flags(custom_flags | libc::O_NONBLOCK).open(path)?;
    if !f.metadata()?.is_file() {
        return Err(not_regular());
    }
    if custom_flags & libc::O_NONBLOCK == 0 {
        let fd = f.as_raw_fd();
        // SAFETY: fcntl on a descriptor owned by `f`, which stays open for the call.
        let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
        // SAFETY: as above.
        if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) } < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(f)
}

/// Checks without opening it that `path` names a regular file (following symbolic links).
///
/// Errors: what `stat` returns (`NotFound` for a missing file), or `InvalidInput`
/// ([`NOT_REGULAR`]).
pub fn check_regular(path: &Path) -> io::Result<std::fs::Metadata> {
    let m = std::fs::metadata(path)?;
    if !m.is_file() {
        return Err(not_regular());
    }
    Ok(m)
}

/// Reads a regular file ([`open_regular`]) whole.
///
/// Errors: as [`open_regular`], or a read error.
pub fn read(path: &Path) -> io::Result<Vec<u8>> {
    let mut f = open_regular(path)?;
    let mut v = Vec::with_capacity(f.metadata().map(|m| m.len() as usize).unwrap_or(0));
    f.read_to_end(&mut v)?;
    Ok(v)
}

/// Reads a regular file ([`open_regular`]) as UTF-8 text.
///
/// Errors: as [`open_regular`], a read error, or text that is not UTF-8.
pub fn read_to_string(path: &Path) -> io::Result<String> {
    let mut s = String::new();
    open_regular(path)?.read_to_string(&mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn mkfifo(p: &Path) {
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    }

    #[test]
    fn a_fifo_is_refused_at_once_and_a_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.json");
        mkfifo(&fifo);
        for e in [
            read_to_string(&fifo).unwrap_err(),
            read(&fifo).unwrap_err(),
            check_regular(&fifo).unwrap_err(),
            open_regular_with(OpenOptions::new().read(true).write(true), 0, &fifo).unwrap_err(),
        ] {
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");
        }
        // Write-only on a FIFO without a reader fails in open itself (ENXIO), not by blocking.
        assert!(open_regular_with(OpenOptions::new().write(true), 0, &fifo).is_err());
        assert!(read_to_string(dir.path()).is_err());
        let file = dir.path().join("a.json");
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(read_to_string(&file).unwrap(), "{}");
        assert_eq!(read(&file).unwrap(), b"{}");
        assert_eq!(check_regular(&file).unwrap().len(), 2);
    }

    #[test]
    fn the_non_blocking_flag_is_cleared_after_opening() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a");
        std::fs::write(&file, "x").unwrap();
        let mut f = open_regular_with(OpenOptions::new().append(true), 0, &file).unwrap();
        // SAFETY: fcntl on an open descriptor.
        let flags = unsafe { libc::fcntl(f.as_raw_fd(), libc::F_GETFL) };
        assert_eq!(flags & libc::O_NONBLOCK, 0);
        assert_ne!(flags & libc::O_APPEND, 0);
        f.write_all(b"y").unwrap();
        assert_eq!(std::fs::read(&file).unwrap(), b"xy");
    }
}
