//! Whole-file verification of a streaming install from a Hugging Face layout (issue #19, item 7).
//!
//! The hub publishes one sha256 per file (the LFS oid, sent as `X-Linked-Etag`), never one per
//! byte range, so a record converted from ranges cannot be checked as it arrives. sha256 is
//! sequential: the bytes of a file can be checked only when all of them pass through it in
//! order. So when a `warm` is about to make a source file complete (after it, every expert
//! record converted from the file is present), it streams that file whole instead of fetching
//! its records by range: the body goes through sha256 as it arrives, each record's source
//! tensors are cut out of it on the way and converted, and the records are written to the pack
//! but journaled (made present) only once the file's sha256 matched the published one.
//!
//! - A body that does not match is fetched again (a byte corrupted on the way); a file that
//!   still does not match (the server sends another file) is an error naming it, and none of
//!   the records converted from it is stored.
//! - Records of the file already present (fetched by range earlier) are converted again from
//!   the verified bytes and compared: one that differs is replaced and reported.
//! - The checksum of every record converted from a verified file goes to the stream index
//!   ([`crate::fetch::StreamIndex::verified_xxh3`]), so `cache verify` and `info` can tell
//!   verified records from unverifiable ones, and a verified record changed later is found.
//!
//! A record whose tensors lie in two files (a shard boundary inside an expert) is converted once
//! both files verified. The cost: the file's backbone tensors and already-present records travel
//! again. MXFP4 sources with separate scales, files without a published sha256 and a `warm`
//! that leaves a file incomplete keep the range fetch (and their records stay unverifiable until
//! `cache verify --source`). The backbone tensors in a verified file are not compared: they were
//! fetched by range at install and are checked against their own checksums from then on.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;

use deltafin_format::presence::{commit_records, Entry, Journal};
use deltafin_format::ModelDir;

use crate::fetch::TensorLoc;
use crate::{io_err, HttpRecordSource, PullError};

/// (layer, expert).
type Key = (u32, u32);

/// What the whole-file verification of one `warm` did.
#[derive(Debug, Clone, Default)]
pub struct WholeFiles {
    /// Source files streamed whole whose sha256 matched the published one.
    pub verified: Vec<String>,
    /// Records converted from those files (fetched now, or compared with the present copy).
    pub records_verified: usize,
    /// Records fetched (made present) this way.
    pub records_fetched: usize,
    /// Present records whose local bytes differed from the verified source: replaced by it.
    pub replaced: Vec<Key>,
    /// (file, why) of files that failed: none of their records was stored.
    pub failed: Vec<(String, String)>,
    /// Records left out because their file failed.
    pub records_refused: usize,
    /// (file, what differs) of verified files whose bytes received by range at install (the
    /// safetensors header, backbone tensors: what `backbone.bin` was converted from, see
    /// [`crate::fetch::StreamIndex::source_ranges`]) differ from the verified body.
    pub backbone_mismatch: Vec<(String, String)>,
}

/// One source tensor to cut out of a file's body: `[offset, offset + len)` is part `part` of
/// record `key`.
struct Span {
    offset: u64,
    len: u64,
    key: Key,
    part: usize,
}

/// A record whose parts are arriving.
struct Pending {
    parts: Vec<Vec<u8>>,
    missing: u64,
}

/// Streams whole every source file that fetching `chosen` would complete (see the module
/// documentation), committing the records converted from the files that verify to `out` (the
/// expert pack opened for writing and the presence journal) and their checksums to `verified`
/// (the stream index's [`crate::fetch::StreamIndex::verified_xxh3`]). Returns what
/// it did and the chosen records it handled (the caller fetches the others by range; records
/// of a file that failed are handled too: they must not be stored).
///
/// Errors: I/O on the pack or journal; HTTP errors other than a checksum mismatch (a file that
/// changed since the install is [`PullError::SourceChanged`] from the size or ETag the server
/// sends, a mismatch is a [`WholeFiles::failed`] entry).
pub fn warm_whole_files(
    dir: &ModelDir,
    src: &HttpRecordSource,
    present: &HashMap<Key, u64>,
    chosen: &[Key],
    out: (&File, &Journal),
    verified: &mut BTreeMap<String, String>,
    advance: &dyn Fn(u64),
) -> Result<(WholeFiles, HashSet<Key>), PullError> {
    let (pack, journal) = out;
    let mut rep = WholeFiles::default();
    let mut handled = HashSet::new();
    if src.checks_records() || chosen.is_empty() {
        return Ok((rep, handled));
    }
    let chosen_set: HashSet<Key> = chosen.iter().copied().collect();
    let wanted = |k: &Key| present.contains_key(k) || chosen_set.contains(k);
    // The files each record's tensors lie in (usually one; two when a shard boundary falls
    // inside an expert). MXFP4 sources with separate scales are converted by range only, and
    // their files never complete here.
    let mut file_records: BTreeMap<String, Vec<Key>> = BTreeMap::new();
    let mut record_files: HashMap<Key, Vec<String>> = HashMap::new();
    let mut blocked: HashSet<String> = HashSet::new();
    let mut locs_of: HashMap<Key, Vec<&TensorLoc>> = HashMap::new();
    for r in &dir.manifest.experts.records {
        let key = (r.layer, r.expert);
        let Ok(locs) = src.locs(r.layer as usize, r.expert as usize) else {
            continue; // the range fetch names the problem
        };
        let mut files: Vec<String> = locs.iter().map(|l| l.file.clone()).collect();
        files.sort_unstable();
        files.dedup();
        if locs.iter().any(|l| l.mxfp4_scales.is_some()) {
            blocked.extend(files);
            continue;
        }
        for f in &files {
            file_records.entry(f.clone()).or_default().push(key);
        }
        record_files.insert(key, files);
        locs_of.insert(key, locs);
    }
    let completing: BTreeMap<String, String> = file_records
        .iter()
        .filter(|(f, _)| !blocked.contains(*f))
        .filter_map(|(f, keys)| {
            let sha = src.files().get(f)?.sha256.clone()?;
            let complete = keys.iter().all(&wanted);
            let needed = keys.iter().any(|k| chosen_set.contains(k));
            (complete && needed).then(|| (f.clone(), sha))
        })
        .collect();
    // Records converted from the streamed bodies: every file they lie in completes.
    let streamed: HashSet<Key> = record_files
        .iter()
        .filter(|(k, files)| wanted(k) && files.iter().all(|f| completing.contains_key(f)))
        .map(|(k, _)| *k)
        .collect();
    handled.extend(streamed.iter().filter(|k| chosen_set.contains(k)));
    // Parts of records spanning files, from files already verified.
    let mut across: HashMap<Key, Pending> = HashMap::new();
    let new_pending = |key: &Key| {
        let locs = &locs_of[key];
        Pending {
            parts: locs.iter().map(|l| vec![0u8; l.len as usize]).collect(),
            missing: locs.iter().map(|l| l.len).sum(),
        }
    };
    let pack_path = dir.expert_pack_path();
    for (file, sha) in &completing {
        let keys: Vec<Key> = file_records[file]
            .iter()
            .filter(|k| streamed.contains(k))
            .copied()
            .collect();
        let single: HashSet<Key> = keys.iter().filter(|k| record_files[k].len() == 1).copied().collect();
        let mut spans: Vec<Span> = keys
            .iter()
            .flat_map(|&key| {
                locs_of[&key]
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| &l.file == file)
                    .map(move |(part, l)| Span {
                        offset: l.offset,
                        len: l.len,
                        key,
                        part,
                    })
            })
            .collect();
        spans.sort_by_key(|s| s.offset);
        let mut cut = Cut {
            dir,
            src,
            present,
            pack,
            pack_path: &pack_path,
            entries: Vec::new(),
            differ: Vec::new(),
            seen: BTreeMap::new(),
        };
        // Records of this file being cut out, and this file's parts of records spanning files.
        let mut pending: HashMap<Key, Pending> = HashMap::new();
        let mut parts_across: Vec<(Key, usize, u64, Vec<u8>)> = Vec::new();
        let mut cursor = 0usize;
        let mut failure: Option<PullError> = None;
        // The ranges received at install from this file: (offset, len, xxh3), hashed on the way.
        let mut checks: Vec<(u64, u64, u64)> = src
            .index()
            .source_ranges
            .iter()
            .filter(|r| &r.file == file)
            .filter_map(|r| Some((r.offset, r.len, u64::from_str_radix(&r.xxh3, 16).ok()?)))
            .collect();
        checks.sort_unstable();
        let mut check_at = 0usize;
        let mut check_hash = xxhash_rust::xxh3::Xxh3::new();
        let mut bad_ranges: Vec<(u64, u64)> = Vec::new();
        let mut sink = |at: u64, chunk: &[u8]| {
            if at == 0 {
                check_at = 0;
                check_hash.reset();
                bad_ranges.clear();
                // A new attempt: everything is cut out again.
                cut.entries.clear();
                cut.differ.clear();
                cut.seen.clear();
                pending.clear();
                parts_across.clear();
                cursor = 0;
                failure = None;
            }
            let end = at + chunk.len() as u64;
            while let Some(&(o, l, want)) = checks.get(check_at).filter(|c| c.0 < end) {
                let (lo, hi) = (o.max(at), (o + l).min(end));
                if lo < hi {
                    check_hash.update(&chunk[(lo - at) as usize..(hi - at) as usize]);
                }
                if o + l > end {
                    break;
                }
                if check_hash.digest() != want {
                    bad_ranges.push((o, l));
                }
                check_hash.reset();
                check_at += 1;
            }
            if failure.is_some() {
                return;
            }
            let mut i = cursor;
            while let Some(s) = spans.get(i).filter(|s| s.offset < end) {
                let (lo, hi) = (s.offset.max(at), (s.offset + s.len).min(end));
                if lo < hi {
                    let piece = &chunk[(lo - at) as usize..(hi - at) as usize];
                    if !single.contains(&s.key) {
                        parts_across.push((s.key, s.part, lo - s.offset, piece.to_vec()));
                    } else {
                        let p = pending.entry(s.key).or_insert_with(|| new_pending(&s.key));
                        p.parts[s.part][(lo - s.offset) as usize..(hi - s.offset) as usize].copy_from_slice(piece);
                        p.missing -= hi - lo;
                        if p.missing == 0 {
                            if let Some(p) = pending.remove(&s.key) {
                                if let Err(e) = cut.finish(&locs_of[&s.key], s.key, p.parts) {
                                    failure = Some(e);
                                    return;
                                }
                            }
                        }
                    }
                }
                if s.offset + s.len <= end {
                    i += 1;
                    cursor = i;
                } else {
                    break;
                }
            }
        };
        let url = src.file_url(file);
        let outcome = src.http().stream_whole(&url, Some(sha), &mut sink);
        if outcome.is_err() || failure.is_some() {
            // Records written but never journaled: their blocks are freed again (they are
            // absent either way; on a full disk the room is needed).
            for e in &cut.entries {
                let _ = crate::records::punch_hole(pack, e.offset, e.length.div_ceil(4096) * 4096);
            }
        }
        match outcome {
            Ok(_) => {
                if let Some(e) = failure {
                    return Err(e);
                }
                if cut.seen.len() != single.len() {
                    return Err(PullError::Invalid(format!(
                        "{url}: the body held {} of the {} expert records the stream index places in it",
                        cut.seen.len(),
                        single.len()
                    )));
                }
                // This file's parts of records spanning files; those now whole are converted.
                for (key, part, at, piece) in parts_across {
                    let p = across.entry(key).or_insert_with(|| new_pending(&key));
                    p.parts[part][at as usize..at as usize + piece.len()].copy_from_slice(&piece);
                    p.missing -= piece.len() as u64;
                }
                let whole: Vec<Key> = across.iter().filter(|(_, p)| p.missing == 0).map(|(k, _)| *k).collect();
                for key in whole {
                    if let Some(p) = across.remove(&key) {
                        cut.finish(&locs_of[&key], key, p.parts)?;
                    }
                }
                if !cut.entries.is_empty() {
                    pack.sync_data().map_err(io_err(&pack_path))?;
                    journal.append(&cut.entries)?;
                }
                let replaced: Vec<(&deltafin_format::model_dir::ExpertRecord, &[u8])> = cut
                    .differ
                    .iter()
                    .map(|((l, e), b)| (dir.record(*l as usize, *e as usize), b.as_slice()))
                    .collect();
                if !replaced.is_empty() {
                    commit_records(pack, &pack_path, journal, &replaced)?;
                }
                for ((l, e), h) in &cut.seen {
                    verified.insert(format!("{l}.{e}"), format!("{h:016x}"));
                }
                rep.records_verified += cut.seen.len();
                rep.records_fetched += cut.entries.len();
                rep.replaced.extend(cut.differ.iter().map(|(k, _)| *k));
                advance(cut.entries.iter().map(|e| e.length).sum());
                rep.verified.push(file.clone());
                if let Some((o, l)) = bad_ranges.first() {
                    rep.backbone_mismatch.push((
                        file.clone(),
                        format!(
                            "{} byte ranges received at install (the safetensors header or backbone tensors; the first at offset {o}, {l} bytes) differ from the body whose sha256 is the published one",
                            bad_ranges.len()
                        ),
                    ));
                }
            }
            Err(e @ PullError::Checksum { .. }) => {
                // Records spanning this file and another cannot complete either.
                for k in &keys {
                    across.remove(k);
                }
                rep.records_refused += keys.iter().filter(|k| chosen_set.contains(k)).count();
                rep.failed.push((file.clone(), e.to_string()));
            }
            Err(e) => return Err(e),
        }
    }
    Ok((rep, handled))
}

/// The records cut out of one completing source file: where they go (the model directory, its
/// expert pack, the checksums of the records present) and what came of them.
struct Cut<'a> {
    dir: &'a ModelDir,
    src: &'a HttpRecordSource,
    present: &'a HashMap<Key, u64>,
    pack: &'a File,
    pack_path: &'a std::path::Path,
    /// Records written to the pack, journaled once the file verifies.
    entries: Vec<Entry>,
    /// Present records whose bytes differ from the source's, with the source's bytes.
    differ: Vec<(Key, Vec<u8>)>,
    /// Every record cut out, with its xxh3.
    seen: BTreeMap<Key, u64>,
}

impl Cut<'_> {
    /// One record whose source bytes have all arrived: converted; a chosen record is written
    /// to the pack (journaled once the file verifies), a present one compared with its checksum.
    fn finish(&mut self, locs: &[&TensorLoc], key: Key, parts: Vec<Vec<u8>>) -> Result<(), PullError> {
        let rec = self.src.encode(locs, &parts)?;
        let r = self.dir.record(key.0 as usize, key.1 as usize);
        if rec.len() as u64 != r.length {
            return Err(PullError::Invalid(format!(
                "layer {}, expert {}: converted record is {} bytes, the manifest says {}",
                key.0,
                key.1,
                rec.len(),
                r.length
            )));
        }
        let h = xxhash_rust::xxh3::xxh3_64(&rec);
        self.seen.insert(key, h);
        match self.present.get(&key) {
            Some(&have) if have == h => {}
            Some(_) => self.differ.push((key, rec)),
            None => {
                self.pack.write_all_at(&rec, r.offset).map_err(io_err(self.pack_path))?;
                self.entries.push(Entry {
                    layer: r.layer,
                    expert: r.expert,
                    offset: r.offset,
                    length: r.length,
                    xxh3: h,
                });
            }
        }
        Ok(())
    }
}
