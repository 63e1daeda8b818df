//! `deltafin cache stats|verify|gc`: the expert cache of a model directory.
//!
//! - stats: records present per MoE layer, bytes, and (with traces) the share of the traces'
//!   expert choices whose record is present.
//! - verify: re-reads every present record and checks its XXH3-64 (manifest or journal), checks
//!   the journal and the pack's size. A cache left by any interruption passes: records without a
//!   journal entry are absent, not corrupt.
//! - gc: removes the work directories of interrupted pulls and converts (`.<name>.partial`,
//!   `.<name>.download`, `.<name>.stream-src`; also when the pull failed before `<name>`
//!   existed), temp files, and for a streaming install rewrites
//!   the journal without torn, damaged, duplicate or failing entries and frees the blocks of
//!   absent records (bytes of a record written before its entry, or failing its checksum) by
//!   punching holes. Run it while no other deltafin process uses the directory.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use deltafin_format::presence::{self, present_checksums};
use deltafin_format::ModelDir;

use crate::{io_err, sibling, PullError};

/// Records of one MoE layer.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerStats {
    pub layer: u32,
    pub present: usize,
    pub total: usize,
    /// Record bytes present (data bytes).
    pub bytes: u64,
}

/// `cache stats`.
#[derive(Debug, Clone)]
pub struct Stats {
    /// `full` or `stream` (with the source URL).
    pub kind: String,
    pub layers: Vec<LayerStats>,
    pub present: usize,
    pub total: usize,
    pub present_bytes: u64,
    pub total_bytes: u64,
    /// Bytes the pack occupies on disk (allocated blocks).
    pub pack_disk_bytes: u64,
    /// Share of the traces' expert choices whose record is present.
    pub trace_coverage: Option<f64>,
}

/// Computes `cache stats` for `model_dir`, with trace coverage when `traces` are given.
///
/// Errors: not a model directory, unreadable journal or traces.
pub fn stats(model_dir: &Path, traces: &[PathBuf]) -> Result<Stats, PullError> {
    let dir = ModelDir::open(model_dir)?;
    let present = present_checksums(&dir)?;
    let mut layers: Vec<LayerStats> = Vec::new();
    let (mut np, mut pb, mut tb) = (0, 0, 0);
    for r in &dir.manifest.experts.records {
        if layers.last().map(|l| l.layer) != Some(r.layer) {
            layers.push(LayerStats {
                layer: r.layer,
                present: 0,
                total: 0,
                bytes: 0,
            });
        }
        let l = layers.last_mut().expect("pushed above");
        l.total += 1;
        tb += r.length;
        if present.contains_key(&(r.layer, r.expert)) {
            l.present += 1;
            l.bytes += r.length;
            np += 1;
            pb += r.length;
        }
    }
    let trace_coverage = if traces.is_empty() {
        None
    } else {
        let heat = crate::warm::trace_heat(traces, &dir.manifest.config)?;
        let all: u64 = heat.values().sum();
        let hit: u64 = heat
            .iter()
            .filter(|(k, _)| present.contains_key(k))
            .map(|(_, n)| n)
            .sum();
        Some(if all == 0 { 0.0 } else { hit as f64 / all as f64 })
    };
    let pack = dir.expert_pack_path();
    let md = std::fs::metadata(&pack).map_err(io_err(&pack))?;
    Ok(Stats {
        kind: match &dir.manifest.stream {
            Some(s) => format!("streaming install from {}", s.url),
            None => "full install".into(),
        },
        layers,
        present: np,
        total: dir.manifest.experts.records.len(),
        present_bytes: pb,
        total_bytes: tb,
        pack_disk_bytes: md.blocks() * 512,
        trace_coverage,
    })
}

/// `cache verify`.
#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub checked: usize,
    pub total: usize,
    /// (layer, expert, what is wrong).
    pub failures: Vec<(u32, u32, String)>,
    /// Journal entries failing their own checksum (ignored by readers; `cache gc` drops them).
    pub bad_journal_entries: usize,
    /// Bytes of a torn final journal entry (ignored; normal after an interruption).
    pub torn_journal_bytes: u64,
}

impl VerifyReport {
    /// No record failed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

/// Re-checks every present record of `model_dir`.
///
/// Errors: not a model directory, an unreadable pack or journal (a record that fails is a
/// [`VerifyReport::failures`] entry, not an error).
pub fn verify(model_dir: &Path) -> Result<VerifyReport, PullError> {
    let dir = ModelDir::open(model_dir)?;
    let present = present_checksums(&dir)?;
    let scan = presence::scan(&dir.path)?;
    let pack_path = dir.expert_pack_path();
    let pack = File::open(&pack_path).map_err(io_err(&pack_path))?;
    let mut rep = VerifyReport {
        total: dir.manifest.experts.records.len(),
        bad_journal_entries: scan.bad_entries,
        torn_journal_bytes: scan.torn_bytes,
        ..VerifyReport::default()
    };
    let mut buf = Vec::new();
    for r in &dir.manifest.experts.records {
        let Some(&want) = present.get(&(r.layer, r.expert)) else {
            continue;
        };
        rep.checked += 1;
        buf.resize(r.length as usize, 0);
        if let Err(e) = pack.read_exact_at(&mut buf, r.offset) {
            rep.failures.push((r.layer, r.expert, format!("read failed: {e}")));
            continue;
        }
        let found = xxhash_rust::xxh3::xxh3_64(&buf);
        if found != want {
            rep.failures.push((
                r.layer,
                r.expert,
                format!("checksum mismatch: expected xxh3 {want:016x}, found {found:016x}"),
            ));
        }
    }
    Ok(rep)
}

/// `cache gc`.
#[derive(Debug, Clone, Default)]
pub struct GcReport {
    /// Work directories and temp files removed.
    pub removed: Vec<PathBuf>,
    /// Journal entries dropped (torn, damaged, duplicate, not matching the manifest, failing).
    pub journal_entries_dropped: usize,
    /// Records whose blocks were freed (absent in a streaming install but holding data).
    pub records_freed: usize,
    /// Disk bytes freed in the pack.
    pub pack_bytes_freed: u64,
}

/// Cleans up `model_dir` (see the module docs).
///
/// Errors: not a model directory; I/O.
pub fn gc(model_dir: &Path) -> Result<GcReport, PullError> {
    let mut rep = GcReport::default();
    for suffix in ["partial", "download", "stream-src"] {
        let p = sibling(model_dir, suffix);
        if p.exists() {
            std::fs::remove_dir_all(&p).map_err(io_err(&p))?;
            rep.removed.push(p);
        }
    }
    if !model_dir.exists() && !rep.removed.is_empty() {
        // Only the leftovers of a failed pull or convert: nothing else to clean.
        return Ok(rep);
    }
    let dir = ModelDir::open(model_dir)?;
    for e in std::fs::read_dir(&dir.path).map_err(io_err(&dir.path))?.flatten() {
        let p = e.path();
        if p.extension().is_some_and(|x| x == "tmp") {
            std::fs::remove_file(&p).map_err(io_err(&p))?;
            rep.removed.push(p);
        }
    }
    let Some(stream) = &dir.manifest.stream else {
        // A full install (or one upgraded from streaming): no journal or index is needed.
        for f in [presence::JOURNAL_FILE, crate::fetch::STREAM_INDEX] {
            let p = dir.path.join(f);
            if p.exists() {
                std::fs::remove_file(&p).map_err(io_err(&p))?;
                rep.removed.push(p);
            }
        }
        return Ok(rep);
    };
    let _ = stream;
    let scan = presence::scan(&dir.path)?;
    let pack_path = dir.expert_pack_path();
    let pack = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pack_path)
        .map_err(io_err(&pack_path))?;
    let before = pack.metadata().map_err(io_err(&pack_path))?.blocks() * 512;
    // The last valid entry per record that matches the manifest and whose bytes verify.
    let mut last: HashMap<(u32, u32), presence::Entry> = HashMap::new();
    for e in &scan.entries {
        last.insert((e.layer, e.expert), *e);
    }
    let mut keep = Vec::new();
    let mut buf = Vec::new();
    let mut present = std::collections::HashSet::new();
    for r in &dir.manifest.experts.records {
        let Some(e) = last.get(&(r.layer, r.expert)) else {
            continue;
        };
        if e.offset != r.offset || e.length != r.length {
            continue;
        }
        buf.resize(r.length as usize, 0);
        if pack.read_exact_at(&mut buf, r.offset).is_err() || xxhash_rust::xxh3::xxh3_64(&buf) != e.xxh3 {
            continue;
        }
        keep.push(*e);
        present.insert((r.layer, r.expert));
    }
    rep.journal_entries_dropped = scan.entries.len() + scan.bad_entries + usize::from(scan.torn_bytes > 0) - keep.len();
    if rep.journal_entries_dropped > 0 || scan.no_header {
        presence::rewrite(&dir.path, &keep)?;
    }
    let stride = |r: &deltafin_format::ExpertRecord| r.length.div_ceil(4096) * 4096;
    for r in &dir.manifest.experts.records {
        if present.contains(&(r.layer, r.expert)) {
            continue;
        }
        if has_data(&pack, r.offset, stride(r)) {
            punch_hole(&pack, r.offset, stride(r)).map_err(io_err(&pack_path))?;
            rep.records_freed += 1;
        }
    }
    pack.sync_all().map_err(io_err(&pack_path))?;
    let after = pack.metadata().map_err(io_err(&pack_path))?.blocks() * 512;
    rep.pack_bytes_freed = before.saturating_sub(after);
    Ok(rep)
}

/// Whether `[offset, offset + len)` of `f` holds any data (not only holes).
fn has_data(f: &File, offset: u64, len: u64) -> bool {
    // SAFETY: plain syscall on a valid, open descriptor.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
    // ENXIO: no data at or after offset. Other errors (no SEEK_DATA support): assume data.
    if r < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    (r as u64) < offset + len
}

fn punch_hole(f: &File, offset: u64, len: u64) -> std::io::Result<()> {
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
