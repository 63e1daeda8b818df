//! Crash-safe creation of a model directory: everything is written into a sibling
//! `.<name>.partial` directory, which replaces `out_dir` only when complete. An existing model is
//! swapped out atomically (`renameat2(RENAME_EXCHANGE)`), so a crash at any moment leaves the old
//! model or the new one at `out_dir`, never neither and never a half-written one. A stale
//! `.partial` from an interrupted run is removed when the next run starts.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::FormatError;

fn io(path: &Path) -> impl Fn(std::io::Error) -> FormatError + '_ {
    move |e| FormatError::Io {
        path: path.to_path_buf(),
        error: e,
    }
}

/// Builds a model directory at `out_dir` by calling `write` on a fresh staging directory, then
/// moving it into place.
///
/// Errors: `out_dir` exists and is not empty without `force`, `out_dir` has no directory name,
/// any error of `write` (the staging directory is then removed), or an I/O error.
pub fn write_dir_atomically<T>(
    out_dir: &Path,
    force: bool,
    write: impl FnOnce(&Path) -> Result<T, FormatError>,
) -> Result<T, FormatError> {
    if out_dir.exists() {
        let nonempty = std::fs::read_dir(out_dir).map_err(io(out_dir))?.next().is_some();
        if nonempty && !force {
            return Err(FormatError::Output {
                path: out_dir.into(),
                message: "output directory exists and is not empty (pass --force to replace it)".into(),
            });
        }
    }
    let name = out_dir
        .file_name()
        .ok_or_else(|| FormatError::Output {
            path: out_dir.into(),
            message: "output path has no directory name".into(),
        })?
        .to_string_lossy()
        .into_owned();
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(io(&parent))?;
    let tmp = parent.join(format!(".{name}.partial"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io(&tmp))?;
    match write(&tmp) {
        Ok(v) => {
            finalize(&tmp, out_dir, &parent)?;
            Ok(v)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

fn finalize(tmp: &Path, out_dir: &Path, parent: &Path) -> Result<(), FormatError> {
    if out_dir.exists() {
        exchange(tmp, out_dir).map_err(io(out_dir))?;
        std::fs::remove_dir_all(tmp).map_err(io(tmp))?;
    } else {
        std::fs::rename(tmp, out_dir).map_err(io(out_dir))?;
    }
    File::open(parent).and_then(|d| d.sync_all()).map_err(io(parent))?;
    Ok(())
}

/// Atomically exchanges two paths (Linux `renameat2(RENAME_EXCHANGE)`).
fn exchange(a: &Path, b: &Path) -> std::io::Result<()> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let ca = CString::new(a.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    let cb = CString::new(b.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: both arguments are valid NUL-terminated paths relative to the working directory.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
