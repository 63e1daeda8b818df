//! `deltafin cache stats|verify|gc`: the expert cache of a model directory.
//!
//! - stats: records present per MoE layer, bytes, and (with traces) the share of the traces'
//!   expert choices whose record is present.
//! - verify: re-reads `backbone.bin` and every present record and checks their XXH3-64
//!   (manifest or journal), checks the journal and the pack's size. A cache left by any
//!   interruption passes: records without a journal entry are absent, not corrupt. With
//!   `--source` ([`verify_source`]) a streaming install's records are also compared with the
//!   source, the only check for records converted from a Hugging Face layout's byte ranges.
//! - gc: removes the work directories of interrupted pulls and converts (`.<name>.partial`,
//!   `.<name>.download`, `.<name>.stream-src`; also when the pull failed before `<name>`
//!   existed), temp files, and for a streaming install rewrites
//!   the journal without torn, damaged, duplicate or failing entries and frees the blocks of
//!   absent records (bytes of a record written before its entry, or failing its checksum) by
//!   punching holes. Run it while no other deltafin process uses the directory.

use std::collections::HashMap;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};

use deltafin_format::model_dir::BackboneCheck;
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
        let heat = crate::records::trace_heat(traces, &dir.manifest.config)?;
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
    /// `backbone.bin` against the manifest's tensor checksums.
    pub backbone: BackboneCheck,
    /// Present records that were converted from byte ranges of a source publishing no checksum
    /// for them (a streaming install from a Hugging Face layout): their xxh3 was computed on
    /// arrival, so this check shows them intact since, not equal to the source
    /// ([`verify_source`] compares them with it). Records a `warm` converted from source files
    /// whose sha256 it checked ([`crate::whole`]) are not counted here but in `verified`.
    pub unverifiable: usize,
    /// Present records equal to the copy converted from sha256-checked source files.
    pub verified: usize,
}

impl VerifyReport {
    /// No record and no backbone tensor failed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty() && self.backbone.failures.is_empty()
    }
}

/// Re-checks `backbone.bin` and every present record of `model_dir`.
///
/// Errors: not a model directory, an unreadable backbone, pack or journal (a tensor or record
/// that fails is a [`VerifyReport`] entry, not an error).
pub fn verify(model_dir: &Path) -> Result<VerifyReport, PullError> {
    let dir = ModelDir::open(model_dir)?;
    let backbone = dir.verify_backbone()?;
    let present = present_checksums(&dir)?;
    let scan = presence::scan(&dir.path)?;
    let pack_path = dir.expert_pack_path();
    let pack = deltafin_fs::open_regular(&pack_path).map_err(io_err(&pack_path))?;
    let mut rep = VerifyReport {
        total: dir.manifest.experts.records.len(),
        bad_journal_entries: scan.bad_entries,
        torn_journal_bytes: scan.torn_bytes,
        backbone,
        ..VerifyReport::default()
    };
    // Hugging Face layout: which records were converted from sha256-checked source files.
    let index = match &dir.manifest.stream {
        Some(s) => Some(crate::fetch::StreamIndex::read(&dir.path, &s.index)?).filter(|ix| !ix.mirror),
        None => None,
    };
    let mut buf = Vec::new();
    for r in &dir.manifest.experts.records {
        let Some(&want) = present.get(&(r.layer, r.expert)) else {
            continue;
        };
        rep.checked += 1;
        match index.as_ref().map(|ix| ix.verified(r.layer, r.expert, want)) {
            None => {}
            Some(None) => rep.unverifiable += 1,
            Some(Some(true)) => rep.verified += 1,
            Some(Some(false)) => rep.failures.push((
                r.layer,
                r.expert,
                "its journaled checksum is not the one of the copy converted from the sha256-checked source (replaced since by bytes not from the source)".into(),
            )),
        }
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

/// For a streaming install from a Hugging Face layout: (present records never verified against
/// a source file's sha256, present records verified); (0, 0) for other model directories. Reads
/// the presence journal and the stream index, not the records.
///
/// Errors: an unreadable journal or stream index.
pub fn verify_counts(dir: &ModelDir) -> Result<(usize, usize), PullError> {
    let Some(s) = &dir.manifest.stream else {
        return Ok((0, 0));
    };
    let index = crate::fetch::StreamIndex::read(&dir.path, &s.index)?;
    if index.mirror {
        return Ok((0, 0));
    }
    let present = present_checksums(dir)?;
    let verified = present
        .iter()
        .filter(|((l, e), h)| index.verified(*l, *e, **h) == Some(true))
        .count();
    Ok((present.len() - verified, verified))
}

/// For a streaming install from a Hugging Face layout: whether `backbone.bin` was verified
/// against the source ([`crate::fetch::StreamIndex::backbone_verified`]); false otherwise.
///
/// Errors: an unreadable stream index.
pub fn backbone_verified(dir: &ModelDir) -> Result<bool, PullError> {
    let Some(s) = &dir.manifest.stream else {
        return Ok(false);
    };
    Ok(crate::fetch::StreamIndex::read(&dir.path, &s.index)?.backbone_verified())
}

/// `cache verify --source`.
#[derive(Debug, Clone, Default)]
pub struct SourceReport {
    /// Present records read again from the source.
    pub checked: usize,
    /// (layer, expert, what differed) of records whose local bytes differ from two agreeing
    /// reads of the source: the local copy was wrong, and was replaced by the source's bytes.
    pub replaced: Vec<(u32, u32, String)>,
    /// (layer, expert, what differed) of records for which two reads of the source disagreed
    /// with each other and with the local copy (a connection corrupting bytes): left as they are.
    pub unstable: Vec<(u32, u32, String)>,
    /// Source files streamed whole through sha256 (`whole_files`) that matched the install's.
    pub files_hashed: Vec<String>,
    /// (file, what differs) of source files whose sha256 is no longer the one published at
    /// install: records fetched from them since may not belong to the installed model.
    pub files_changed: Vec<(String, String)>,
    /// Source files without a published sha256 (not checked whole).
    pub files_without_sha256: Vec<String>,
}

impl SourceReport {
    /// Every record matched the source and every file hashed matched.
    pub fn ok(&self) -> bool {
        self.replaced.is_empty() && self.unstable.is_empty() && self.files_changed.is_empty()
    }
}

/// `cache verify --source`: re-reads every present record of streaming install `model_dir` from
/// its source (converted again, as on the first fetch) and compares it with the local copy. A
/// record that differs is read a second time: when both reads agree, the local copy is replaced
/// by them (written, fsynced and journaled like any fetch, so the next `cache verify` passes);
/// when they disagree the record is reported as unstable and left alone. With `whole_files`,
/// each source file whose sha256 was published at install (Hugging Face layout) is also
/// streamed whole through sha256 (the full checkpoint's bytes are read, none stored), which
/// tells whether the source still is the checkpoint that was installed (issue #19, item 7).
/// A replacement interrupted between the write and its journal entry leaves a record failing
/// its (old) checksum: `cache verify` names it and `cache gc` drops it, so it is fetched again.
///
/// Errors: not a streaming install (no source recorded); HTTP errors after retries
/// ([`PullError::SourceChanged`] when a file's size, ETag or sha256 changed); I/O.
pub fn verify_source(
    model_dir: &Path,
    http: std::sync::Arc<crate::Http>,
    whole_files: bool,
    concurrency: usize,
) -> Result<SourceReport, PullError> {
    let dir = ModelDir::open(model_dir)?;
    if dir.manifest.stream.is_none() {
        return Err(PullError::Invalid(format!(
            "{}: not a streaming install, so no source is recorded to compare with (every record has the checksum written by convert or pull; `deltafin cache verify` checks them)",
            model_dir.display()
        )));
    }
    let src = crate::HttpRecordSource::open(&dir, http.clone())?;
    let mut rep = SourceReport::default();
    if whole_files && !src.checks_records() {
        for (name, info) in src.files() {
            let Some(want) = &info.sha256 else {
                rep.files_without_sha256.push(name.clone());
                continue;
            };
            let (found, _) = http.sha256_of(&src.file_url(name))?;
            if &found == want {
                rep.files_hashed.push(name.clone());
            } else {
                rep.files_changed
                    .push((name.clone(), format!("sha256 {found}, {want} at install")));
            }
        }
    }
    let present = present_checksums(&dir)?;
    let mut keys: Vec<((u32, u32), u64)> = present.into_iter().collect();
    keys.sort();
    let pack_path = dir.expert_pack_path();
    let pack = deltafin_fs::open_regular_with(std::fs::OpenOptions::new().write(true), 0, &pack_path)
        .map_err(io_err(&pack_path))?;
    let journal = presence::Journal::open(&dir.path)?;
    enum Seen {
        Same,
        Replace(Vec<u8>, String),
        Unstable(String),
    }
    let h = |b: &[u8]| xxhash_rust::xxh3::xxh3_64(b);
    for batch in keys.chunks(crate::records::concurrency_or_default(concurrency)) {
        let seen: Vec<Result<Seen, PullError>> = std::thread::scope(|s| {
            let hs: Vec<_> = batch
                .iter()
                .map(|&((l, e), local)| {
                    let src = &src;
                    s.spawn(move || -> Result<Seen, PullError> {
                        let a = src.fetch(l as usize, e as usize)?;
                        if h(&a) == local {
                            return Ok(Seen::Same);
                        }
                        let b = src.fetch(l as usize, e as usize)?;
                        let (ha, hb) = (h(&a), h(&b));
                        if hb == local {
                            return Ok(Seen::Same); // the first read was corrupted in transit
                        }
                        Ok(if ha == hb {
                            Seen::Replace(a, format!("local xxh3 {local:016x}, the source's {ha:016x}"))
                        } else {
                            Seen::Unstable(format!(
                                "local xxh3 {local:016x}; two reads of the source gave {ha:016x} and {hb:016x}"
                            ))
                        })
                    })
                })
                .collect();
            hs.into_iter()
                .map(|t| {
                    t.join()
                        .unwrap_or_else(|_| Err(PullError::Invalid("verify thread panicked".into())))
                })
                .collect()
        });
        let mut fix = Vec::new();
        for (&((l, e), _), r) in batch.iter().zip(seen) {
            rep.checked += 1;
            match r? {
                Seen::Same => {}
                Seen::Replace(bytes, why) => {
                    rep.replaced.push((l, e, why));
                    fix.push((dir.record(l as usize, e as usize), bytes));
                }
                Seen::Unstable(why) => rep.unstable.push((l, e, why)),
            }
        }
        if !fix.is_empty() {
            let items: Vec<_> = fix.iter().map(|(r, b)| (*r, b.as_slice())).collect();
            presence::commit_records(&pack, &pack_path, &journal, &items)?;
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
    let pack = deltafin_fs::open_regular_with(std::fs::OpenOptions::new().read(true).write(true), 0, &pack_path)
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
    // Blocks of absent records are freed first: on a full disk the journal rewrite below needs
    // the room (an interrupted `warm` can leave written but unjournaled records behind).
    let stride = |r: &deltafin_format::ExpertRecord| r.length.div_ceil(4096) * 4096;
    for r in &dir.manifest.experts.records {
        if present.contains(&(r.layer, r.expert)) {
            continue;
        }
        if crate::records::has_data(&pack, r.offset, stride(r)) {
            crate::records::punch_hole(&pack, r.offset, stride(r)).map_err(io_err(&pack_path))?;
            rep.records_freed += 1;
        }
    }
    pack.sync_all().map_err(io_err(&pack_path))?;
    if rep.journal_entries_dropped > 0 || scan.no_header {
        presence::rewrite(&dir.path, &keep)?;
    }
    let after = pack.metadata().map_err(io_err(&pack_path))?.blocks() * 512;
    rep.pack_bytes_freed = before.saturating_sub(after);
    Ok(rep)
}
