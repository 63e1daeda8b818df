//! The presence journal of a streaming install: which expert records of a sparse `experts.pack`
//! hold data, and their checksums.
//!
//! ```text
//! experts.present   header, 16 bytes: magic "DFPRES01", u32 entry size (40), u32 0
//!                   entries, 40 bytes each, little-endian:
//!                     u32 layer, u32 expert, u64 record offset, u64 record length,
//!                     u64 XXH3-64 of the record's `length` bytes,
//!                     u64 XXH3-64 of the 32 bytes before it (the entry's own checksum)
//! ```
//!
//! Rules that make an interruption harmless at any moment ([`commit_records`]): a record's bytes
//! are written and fsynced before its entry is appended, and the entry is fsynced before anyone
//! relies on it. A record whose entry never made it is absent (fetched again later); an entry
//! torn by a crash fails its checksum or is shorter than 40 bytes and is ignored, and the next
//! append truncates it away. Appends hold an exclusive `flock`, so processes may share the file.
//! A record is present when the manifest has its checksum (full install) or a valid entry whose
//! offset and length match the manifest's record names it; the last such entry wins.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::manifest::ExpertRecord;
use crate::{io_err, FormatError, ModelDir};

pub use crate::manifest::JOURNAL_FILE;
const MAGIC: &[u8; 8] = b"DFPRES01";
const HEADER: u64 = 16;
/// Bytes of one journal entry.
pub const ENTRY: u64 = 40;

/// One journal entry: record `(layer, expert)` at `offset` holds `length` bytes hashing to `xxh3`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Entry {
    pub layer: u32,
    pub expert: u32,
    pub offset: u64,
    pub length: u64,
    pub xxh3: u64,
}

impl Entry {
    fn encode(&self) -> [u8; ENTRY as usize] {
        let mut b = [0u8; ENTRY as usize];
        b[0..4].copy_from_slice(&self.layer.to_le_bytes());
        b[4..8].copy_from_slice(&self.expert.to_le_bytes());
        b[8..16].copy_from_slice(&self.offset.to_le_bytes());
        b[16..24].copy_from_slice(&self.length.to_le_bytes());
        b[24..32].copy_from_slice(&self.xxh3.to_le_bytes());
        let check = xxhash_rust::xxh3::xxh3_64(&b[..32]);
        b[32..40].copy_from_slice(&check.to_le_bytes());
        b
    }

    fn decode(b: &[u8]) -> Option<Entry> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut x = [0u8; 8];
            x.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(x)
        };
        if b.len() != ENTRY as usize || xxhash_rust::xxh3::xxh3_64(&b[..32]) != u64_at(32) {
            return None;
        }
        Some(Entry {
            layer: u32_at(0),
            expert: u32_at(4),
            offset: u64_at(8),
            length: u64_at(16),
            xxh3: u64_at(24),
        })
    }
}

/// What [`scan`] found in a journal.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// Valid entries in file order.
    pub entries: Vec<Entry>,
    /// Whole entries that failed their checksum (ignored).
    pub bad_entries: usize,
    /// Bytes of a torn trailing entry (ignored; removed by the next append or `cache gc`).
    pub torn_bytes: u64,
    /// The header was missing or torn (file shorter than 16 bytes, or empty).
    pub no_header: bool,
}

/// Reads the journal of model directory `dir` (a missing file is an empty journal).
///
/// Errors: the file cannot be read, or it starts with another magic (not a presence journal).
pub fn scan(dir: &Path) -> Result<Scan, FormatError> {
    let path = dir.join(JOURNAL_FILE);
    let bytes = match deltafin_fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Ok(Scan {
                no_header: true,
                ..Scan::default()
            })
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    if bytes.len() < HEADER as usize {
        return Ok(Scan {
            no_header: true,
            torn_bytes: bytes.len() as u64,
            ..Scan::default()
        });
    }
    if &bytes[..8] != MAGIC || bytes[8..12] != (ENTRY as u32).to_le_bytes() {
        return Err(FormatError::ModelDir {
            path: path.clone(),
            message: "not a presence journal (bad magic or entry size)".into(),
        });
    }
    let body = &bytes[HEADER as usize..];
    let whole = body.len() / ENTRY as usize;
    let mut s = Scan {
        torn_bytes: (body.len() % ENTRY as usize) as u64,
        ..Scan::default()
    };
    for (i, chunk) in body.chunks_exact(ENTRY as usize).enumerate() {
        match Entry::decode(chunk) {
            Some(e) => s.entries.push(e),
            // A bad final entry is a torn write (its bytes are partly old content); earlier ones
            // are damage.
            None if i + 1 == whole && s.torn_bytes == 0 => s.torn_bytes = ENTRY,
            None => s.bad_entries += 1,
        }
    }
    Ok(s)
}

/// Checksums of the records present in a model directory, keyed by `(layer, expert)`: every
/// record of a full install (manifest checksums), or for a streaming install those named by a
/// valid journal entry matching the record's offset and length.
///
/// Errors: a manifest checksum that is not 16 hex digits; the journal cannot be read.
pub fn present_checksums(dir: &ModelDir) -> Result<HashMap<(u32, u32), u64>, FormatError> {
    let mut out = HashMap::new();
    let mut by_key: HashMap<(u32, u32), &ExpertRecord> = HashMap::new();
    for r in &dir.manifest.experts.records {
        if r.xxh3.is_empty() {
            by_key.insert((r.layer, r.expert), r);
            continue;
        }
        let h = u64::from_str_radix(&r.xxh3, 16).map_err(|_| FormatError::ModelDir {
            path: dir.path.clone(),
            message: format!(
                "bad checksum {:?} for expert record (layer {}, expert {})",
                r.xxh3, r.layer, r.expert
            ),
        })?;
        out.insert((r.layer, r.expert), h);
    }
    if by_key.is_empty() {
        return Ok(out);
    }
    for e in scan(&dir.path)?.entries {
        if let Some(r) = by_key.get(&(e.layer, e.expert)) {
            if r.offset == e.offset && r.length == e.length {
                out.insert((e.layer, e.expert), e.xxh3);
            }
        }
    }
    Ok(out)
}

/// The journal opened for appending.
pub struct Journal {
    file: File,
    path: PathBuf,
}

struct Flock<'a>(&'a File);
impl Drop for Flock<'_> {
    fn drop(&mut self) {
        // SAFETY: plain syscall on a valid, open descriptor.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Journal {
    /// Opens (creating if needed) the journal of model directory `dir`.
    ///
    /// Errors: the file cannot be opened or created.
    pub fn open(dir: &Path) -> Result<Self, FormatError> {
        let path = dir.join(JOURNAL_FILE);
        let file = deltafin_fs::open_regular_with(
            OpenOptions::new().read(true).write(true).create(true).truncate(false),
            0,
            &path,
        )
        .map_err(io_err(&path))?;
        Ok(Journal { file, path })
    }

    /// Path of the journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `entries` durably (written, then fsynced) under an exclusive lock; a torn trailing
    /// entry left by a crash is truncated away first, and a missing header is written.
    ///
    /// Errors: I/O (no space left, ...); the journal then ends at most in a torn entry, which
    /// readers ignore.
    pub fn append(&self, entries: &[Entry]) -> Result<(), FormatError> {
        let err = io_err(&self.path);
        // SAFETY: plain syscall on a valid, open descriptor.
        if unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        let _lock = Flock(&self.file);
        let len = self.file.metadata().map_err(&err)?.len();
        let mut end = if len < HEADER {
            let mut h = [0u8; HEADER as usize];
            h[..8].copy_from_slice(MAGIC);
            h[8..12].copy_from_slice(&(ENTRY as u32).to_le_bytes());
            self.file.set_len(0).map_err(&err)?;
            self.file.write_all_at(&h, 0).map_err(&err)?;
            HEADER
        } else {
            HEADER + (len - HEADER) / ENTRY * ENTRY
        };
        // Drop torn entries at the end (a crash may leave a whole entry of stale bytes).
        let mut last = [0u8; ENTRY as usize];
        while end > HEADER {
            self.file.read_exact_at(&mut last, end - ENTRY).map_err(&err)?;
            if Entry::decode(&last).is_some() {
                break;
            }
            end -= ENTRY;
        }
        if end != len && len >= HEADER {
            self.file.set_len(end).map_err(&err)?;
        }
        let mut buf = Vec::with_capacity(entries.len() * ENTRY as usize);
        for e in entries {
            buf.extend_from_slice(&e.encode());
        }
        self.file.write_all_at(&buf, end).map_err(&err)?;
        end += buf.len() as u64;
        debug_assert_eq!((end - HEADER) % ENTRY, 0);
        self.file.sync_data().map_err(&err)?;
        Ok(())
    }
}

/// Makes records present: writes each record's bytes (exactly `record.length` of them) at its
/// offset in `pack` (the model's `experts.pack`, opened for writing), fsyncs the pack, then
/// appends one journal entry per record. Returns the records' XXH3-64 checksums, in order.
///
/// Errors: a record whose bytes are not `length` long; I/O (no space left...). On error no entry
/// is appended for a record whose bytes may be incomplete, so the cache stays consistent.
pub fn commit_records(
    pack: &File,
    pack_path: &Path,
    journal: &Journal,
    items: &[(&ExpertRecord, &[u8])],
) -> Result<Vec<u64>, FormatError> {
    let mut entries = Vec::with_capacity(items.len());
    for (r, bytes) in items {
        if bytes.len() as u64 != r.length {
            return Err(FormatError::Output {
                path: pack_path.to_path_buf(),
                message: format!(
                    "expert record (layer {}, expert {}) is {} bytes, the manifest says {}",
                    r.layer,
                    r.expert,
                    bytes.len(),
                    r.length
                ),
            });
        }
        pack.write_all_at(bytes, r.offset).map_err(io_err(pack_path))?;
        entries.push(Entry {
            layer: r.layer,
            expert: r.expert,
            offset: r.offset,
            length: r.length,
            xxh3: xxhash_rust::xxh3::xxh3_64(bytes),
        });
    }
    pack.sync_data().map_err(io_err(pack_path))?;
    journal.append(&entries)?;
    Ok(entries.iter().map(|e| e.xxh3).collect())
}

/// Rewrites the journal to hold exactly `entries` (temp file, fsync, rename): used by
/// `cache gc` to drop torn, damaged, duplicate and failed entries. Must not run while another
/// process appends.
///
/// Errors: I/O.
pub fn rewrite(dir: &Path, entries: &[Entry]) -> Result<(), FormatError> {
    let path = dir.join(JOURNAL_FILE);
    let tmp = dir.join(format!("{JOURNAL_FILE}.tmp"));
    let mut buf = Vec::with_capacity(HEADER as usize + entries.len() * ENTRY as usize);
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&(ENTRY as u32).to_le_bytes());
    buf.extend_from_slice(&0u32.to_le_bytes());
    for e in entries {
        buf.extend_from_slice(&e.encode());
    }
    std::fs::write(&tmp, &buf).map_err(io_err(&tmp))?;
    File::open(&tmp).and_then(|f| f.sync_all()).map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, &path).map_err(io_err(&path))?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(l: u32, x: u32) -> Entry {
        Entry {
            layer: l,
            expert: x,
            offset: 4096 * x as u64,
            length: 100,
            xxh3: 0xABCD + x as u64,
        }
    }

    #[test]
    fn append_scan_and_torn_tail() {
        let d = tempfile::tempdir().unwrap();
        assert!(scan(d.path()).unwrap().entries.is_empty());
        let j = Journal::open(d.path()).unwrap();
        j.append(&[e(1, 0), e(1, 1)]).unwrap();
        let s = scan(d.path()).unwrap();
        assert_eq!(s.entries, vec![e(1, 0), e(1, 1)]);
        assert_eq!((s.bad_entries, s.torn_bytes), (0, 0));
        // A crash mid-append: 17 bytes of the next entry.
        let p = d.path().join(JOURNAL_FILE);
        let mut b = std::fs::read(&p).unwrap();
        b.extend_from_slice(&e(1, 2).encode()[..17]);
        std::fs::write(&p, &b).unwrap();
        let s = scan(d.path()).unwrap();
        assert_eq!((s.entries.len(), s.torn_bytes), (2, 17));
        // A whole final entry with a wrong checksum is a torn write too.
        let mut full = b[..b.len() - 17].to_vec();
        let mut bad = e(1, 3).encode();
        bad[5] ^= 1;
        full.extend_from_slice(&bad);
        std::fs::write(&p, &full).unwrap();
        let s = scan(d.path()).unwrap();
        assert_eq!((s.entries.len(), s.torn_bytes, s.bad_entries), (2, ENTRY, 0));
        // The next append drops the torn entry and lines up.
        j.append(&[e(1, 4)]).unwrap();
        let s = scan(d.path()).unwrap();
        assert_eq!(s.entries, vec![e(1, 0), e(1, 1), e(1, 4)]);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), HEADER + 3 * ENTRY);
        // Damage in the middle is counted, not fatal.
        let mut b = std::fs::read(&p).unwrap();
        b[HEADER as usize + 3] ^= 0x40;
        std::fs::write(&p, &b).unwrap();
        let s = scan(d.path()).unwrap();
        assert_eq!((s.entries.len(), s.bad_entries), (2, 1));
        rewrite(d.path(), &s.entries).unwrap();
        assert_eq!(scan(d.path()).unwrap().entries, vec![e(1, 1), e(1, 4)]);
    }

    #[test]
    fn other_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join(JOURNAL_FILE), b"0123456789abcdefghij").unwrap();
        assert!(scan(d.path()).is_err());
    }
}
