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
/// moving it into place. `source` (the checkpoint being read, if any) must not be `out_dir` or
/// inside it.
///
/// Errors: `out_dir` exists and is not empty without `force`; with `force`, `out_dir` is not a
/// deltafin model directory (no `manifest.json`: `--force` only ever replaces a model); `out_dir`
/// is or contains `source`; `out_dir` has no directory name; any error of `write` (the staging
/// directory is then removed); or an I/O error.
pub fn write_dir_atomically<T>(
    out_dir: &Path,
    force: bool,
    source: Option<&Path>,
    write: impl FnOnce(&Path) -> Result<T, FormatError>,
) -> Result<T, FormatError> {
    let refuse = |message: String| FormatError::Output {
        path: out_dir.into(),
        message,
    };
    if let (Some(src), Ok(out)) = (source, out_dir.canonicalize()) {
        if let Ok(src) = src.canonicalize() {
            if src.starts_with(&out) {
                return Err(refuse(format!(
                    "the output directory is or contains the source checkpoint {}; choose another output",
                    src.display()
                )));
            }
        }
    }
    if out_dir.exists() {
        let nonempty = std::fs::read_dir(out_dir).map_err(io(out_dir))?.next().is_some();
        if nonempty && !force {
            return Err(refuse(
                "output directory exists and is not empty (pass --force to replace it)".into(),
            ));
        }
        if nonempty && !out_dir.join("manifest.json").is_file() {
            return Err(refuse(
                "output directory is not empty and is not a deltafin model (no manifest.json): --force only replaces a model directory; remove it yourself or choose another output".into(),
            ));
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
