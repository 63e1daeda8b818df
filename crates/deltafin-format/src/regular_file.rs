//! Opening input files only when they are regular files. `open(2)` on a FIFO blocks until a
//! writer appears, so a FIFO in place of `config.json`, a safetensors shard or `manifest.json`
//! would hang `convert`, `info` or a load forever; these helpers open without blocking and
//! refuse anything but a regular file (symbolic links to regular files are followed).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Opens `path` for reading if it is a regular file.
///
/// Errors: what `open` returns, or `InvalidInput` "not a regular file (a FIFO, socket, device
/// or directory)" for anything else.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    // O_NONBLOCK makes opening a FIFO return at once; it has no effect on regular files.
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a FIFO, socket, device or directory); deltafin reads only regular files",
        ));
    }
    Ok(f)
}

/// Reads a regular file ([`open_regular`]) as UTF-8 text.
///
/// Errors: as [`open_regular`], a read error, or text that is not UTF-8.
pub fn read_to_string(path: &Path) -> std::io::Result<String> {
    let mut s = String::new();
    open_regular(path)?.read_to_string(&mut s)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fifo_is_refused_at_once_and_a_file_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("config.json");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_to_string(&fifo).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput, "{e}");
        assert!(read_to_string(dir.path()).is_err());
        let file = dir.path().join("a.json");
        std::fs::write(&file, "{}").unwrap();
        assert_eq!(read_to_string(&file).unwrap(), "{}");
    }
}
