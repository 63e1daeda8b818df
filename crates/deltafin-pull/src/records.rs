//! The records of a streaming install's expert pack, below `install`, `warm` and `cache`:
//! fetching absent records a bounded number at a time and committing each batch, ranking
//! records by router-trace heat, and freeing an absent record's blocks.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use deltafin_engine::traces::Trace;
use deltafin_format::presence::{commit_records, Journal};
use deltafin_format::{ModelConfig, ModelDir};

use crate::{io_err, HttpRecordSource, PullError};

/// (layer, expert).
type Key = (u32, u32);

/// Records fetched at once: `n`, or 4 when `n` is 0 (the `--concurrency` default).
pub(crate) fn concurrency_or_default(n: usize) -> usize {
    if n == 0 {
        4
    } else {
        n
    }
}

/// Heat of each (layer, expert) over `traces`. Errors: an unreadable trace, or one recorded
/// for another model than `cfg`'s.
pub fn trace_heat(traces: &[PathBuf], cfg: &ModelConfig) -> Result<HashMap<(u32, u32), u64>, PullError> {
    let mut heat = HashMap::new();
    for p in traces {
        let t = Trace::read_for(p, cfg).map_err(|e| PullError::Invalid(format!("--traces: {e}")))?;
        for ((l, e), n) in t.heat_ranking() {
            *heat.entry((l as u32, e as u32)).or_default() += n;
        }
    }
    Ok(heat)
}

/// Fetches `keys` (absent records of streaming install `dir`), `concurrency` at a time; each
/// batch is committed (written, fsynced, journaled) before the next. `advance` gets record bytes
/// as they are committed. Returns the records fetched.
///
/// Errors: the first fetch or write failure (records of earlier batches stay committed; those of
/// the failing batch that did arrive are committed too).
pub fn fetch_records(
    dir: &ModelDir,
    src: &HttpRecordSource,
    keys: &[(u32, u32)],
    concurrency: usize,
    advance: &dyn Fn(u64),
) -> Result<usize, PullError> {
    if keys.is_empty() {
        return Ok(0);
    }
    let pack_path = dir.expert_pack_path();
    let pack =
        deltafin_fs::open_regular_with(OpenOptions::new().write(true), 0, &pack_path).map_err(io_err(&pack_path))?;
    let journal = Journal::open(&dir.path)?;
    let mut n = 0;
    for batch in keys.chunks(concurrency_or_default(concurrency)) {
        let got: Vec<(Key, Result<Vec<u8>, PullError>)> = std::thread::scope(|s| {
            let hs: Vec<_> = batch
                .iter()
                .map(|&(l, e)| ((l, e), s.spawn(move || src.fetch(l as usize, e as usize))))
                .collect();
            hs.into_iter()
                .map(|(k, h)| {
                    (
                        k,
                        h.join()
                            .unwrap_or_else(|_| Err(PullError::Invalid("fetch thread panicked".into()))),
                    )
                })
                .collect()
        });
        let mut items = Vec::new();
        let mut err = None;
        for ((l, e), r) in &got {
            match r {
                Ok(b) => items.push((dir.record(*l as usize, *e as usize), b.as_slice())),
                Err(x) => {
                    if err.is_none() {
                        err = Some(PullError::Invalid(format!("layer {l}, expert {e}: {x}")));
                    }
                }
            }
        }
        if !items.is_empty() {
            commit_records(&pack, &pack_path, &journal, &items)?;
            n += items.len();
            advance(items.iter().map(|(r, _)| r.length).sum());
        }
        if let Some(e) = err {
            return Err(e);
        }
    }
    Ok(n)
}

/// Whether `[offset, offset + len)` of `f` holds any data (not only holes).
pub(crate) fn has_data(f: &File, offset: u64, len: u64) -> bool {
    // SAFETY: plain syscall on a valid, open descriptor.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
    // ENXIO: no data at or after offset. Other errors (no SEEK_DATA support): assume data.
    if r < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    (r as u64) < offset + len
}

pub(crate) fn punch_hole(f: &File, offset: u64, len: u64) -> std::io::Result<()> {
    // SAFETY: plain syscall on a valid, open descriptor.
    let r = unsafe {
        libc::fallocate(
            f.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            offset as libc::off_t,
            len as libc::off_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        // Without hole punching, zero the range: the record stays absent either way.
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            return f.write_all_at(&vec![0u8; len as usize], offset);
        }
        Err(e)
    }
}
