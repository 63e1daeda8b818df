//! Crash-safe creation of a model directory: everything is written into a sibling
//! `.<name>.partial` directory, which replaces `out_dir` only when complete. An existing model is
//! swapped out atomically (`renameat2(RENAME_EXCHANGE)`), so a crash at any moment leaves the old
//! model or the new one at `out_dir`, never neither and never a half-written one. A stale
//! `.partial` from an interrupted run is removed when the next run starts.

use std::fs::File;
use std::path::{Path, PathBuf};

use crate::{io_err, FormatError};

/// Builds a model directory at `out_dir` by calling `write` on a fresh staging directory, then
/// moving it into place. `source` (the checkpoint being read, if any) must not be `out_dir` or
/// inside it.
///
/// Errors: `out_dir` cannot be replaced ([`check_replaceable`]: not empty without `force`; with
/// `force`, not a deltafin model or holding files deltafin did not write); `out_dir`
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
    check_replaceable(out_dir, force)?;
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
    std::fs::create_dir_all(&parent).map_err(io_err(&parent))?;
    let tmp = parent.join(format!(".{name}.partial"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp))?;
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

/// Checks that `out_dir` may become a new model directory: it does not exist, is empty, or (with
/// `force`) is a deltafin model directory holding only files deltafin writes there — those its
/// `manifest.json` lists, the usual model files ([`deltafin_files`]) and `*.tmp` leftovers. A
/// replace swaps the whole directory out and deletes it, so anything else (a user's `src/` next
/// to a model) would be lost: such a directory is refused, naming what it holds (issue #19,
/// item 8). Writers call this before any slow work (a pull checks it before downloading).
///
/// Errors: the directory is not empty without `force`; it has no `manifest.json`; it holds
/// entries deltafin did not write; it cannot be read.
pub fn check_replaceable(out_dir: &Path, force: bool) -> Result<(), FormatError> {
    let refuse = |message: String| FormatError::Output {
        path: out_dir.into(),
        message,
    };
    if !out_dir.exists() {
        return Ok(());
    }
    let entries: Vec<std::ffi::OsString> = std::fs::read_dir(out_dir)
        .map_err(io_err(out_dir))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(io_err(out_dir))?;
    if entries.is_empty() {
        return Ok(());
    }
    if !force {
        return Err(refuse(
            "output directory exists and is not empty (pass --force to replace it)".into(),
        ));
    }
    if !out_dir.join("manifest.json").is_file() {
        return Err(refuse(
            "output directory is not empty and is not a deltafin model (no manifest.json): --force only replaces a model directory; remove it yourself or choose another output".into(),
        ));
    }
    let ours = deltafin_files(&out_dir.join("manifest.json"));
    let mut foreign: Vec<String> = entries
        .iter()
        .map(|n| n.to_string_lossy().into_owned())
        .filter(|n| {
            // deltafin writes only regular files there: a directory is never its own.
            let dir = std::fs::symlink_metadata(out_dir.join(n)).is_ok_and(|m| m.is_dir());
            dir || (!ours.iter().any(|o| o == n) && !n.ends_with(".tmp"))
        })
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    foreign.sort();
    let shown = foreign.len().min(5);
    let more = if foreign.len() > shown {
        format!(" and {} more", foreign.len() - shown)
    } else {
        String::new()
    };
    Err(refuse(format!(
        "--force replaces a model directory as a whole, and this one also holds files deltafin did not write ({}{more}): move them out or choose another output",
        foreign[..shown].join(", ")
    )))
}

/// File names deltafin writes into a model directory: those named by the manifest at `manifest`
/// (read leniently as JSON, so a damaged or older manifest still counts), plus the fixed ones
/// (`manifest.json`, `backbone.bin`, `experts.pack`, the presence journal, `stream-index.json`
/// and the copied tokenizer and config files).
pub fn deltafin_files(manifest: &Path) -> Vec<String> {
    let mut names: Vec<String> = ["manifest.json", "backbone.bin", "experts.pack", "stream-index.json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    names.push(crate::manifest::JOURNAL_FILE.into());
    names.extend(crate::manifest::COPIED_FILES.iter().map(|s| s.to_string()));
    let v: serde_json::Value = deltafin_fs::read(manifest)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let s = |p: &str| v.pointer(p).and_then(|x| x.as_str()).map(str::to_string);
    names.extend(
        ["/backbone/file", "/experts/file", "/stream/index"]
            .into_iter()
            .filter_map(s),
    );
    if let Some(a) = v.get("tokenizer_files").and_then(|x| x.as_array()) {
        names.extend(a.iter().filter_map(|x| x.as_str().map(str::to_string)));
    }
    names
}

fn finalize(tmp: &Path, out_dir: &Path, parent: &Path) -> Result<(), FormatError> {
    if out_dir.exists() {
        exchange(tmp, out_dir).map_err(io_err(out_dir))?;
        std::fs::remove_dir_all(tmp).map_err(io_err(tmp))?;
    } else {
        std::fs::rename(tmp, out_dir).map_err(io_err(out_dir))?;
    }
    File::open(parent).and_then(|d| d.sync_all()).map_err(io_err(parent))?;
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
