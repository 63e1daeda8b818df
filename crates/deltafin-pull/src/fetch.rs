//! On-demand expert records for a streaming install: the source tensors of one routed expert,
//! read by HTTP range, converted by the converter's own record encoder
//! ([`deltafin_format::convert::encode_expert_record`]), so a fetched record is byte-identical to
//! the record a full convert writes.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use deltafin_engine::experts::RecordSource;
use deltafin_format::convert::encode_expert_record;
use deltafin_format::model_dir::ExpertTensorLayout;
use deltafin_format::{FormatError, ModelDir};
use safetensors::Dtype;
use serde::{Deserialize, Serialize};

use crate::http::RemoteFile;
use crate::{Http, PullError, Source};

/// File name of the stream index in a streaming install's model directory.
pub const STREAM_INDEX: &str = "stream-index.json";
const INDEX_FORMAT: &str = "deltafin-stream-index";

/// Where each routed-expert tensor lives in the source (`stream-index.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StreamIndex {
    pub format: String,
    pub version: u32,
    /// Source files by name, as the server described them at install (size, ETag, sha256).
    pub files: BTreeMap<String, RemoteFile>,
    /// Routed-expert source tensors by `"<layer>.<expert>.<matrix>"` (matrix as in the record
    /// layout: `gate_proj`, `up_proj`, `down_proj`).
    pub tensors: BTreeMap<String, TensorLoc>,
    /// The source is a deltafin model directory (a mirror of a full install): records are read
    /// from its `experts.pack` at the same offsets and checked against `record_xxh3`.
    #[serde(default)]
    pub mirror: bool,
    /// Mirror only: expected XXH3-64 (hex) of each record, keyed `"<layer>.<expert>"`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub record_xxh3: BTreeMap<String, String>,
    /// Hugging Face layout only: XXH3-64 (hex), keyed `"<layer>.<expert>"`, of each record that
    /// was converted from source files whose whole bytes matched their published sha256 (a
    /// `warm` that completes a file streams it whole; see [`crate::warm`]). A present record
    /// with this checksum is verified against the source; one with another is corrupt.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub verified_xxh3: BTreeMap<String, String>,
    /// Hugging Face layout only: the byte ranges fetched at install that `backbone.bin` was
    /// converted from (each shard's safetensors header and the backbone tensors), with the
    /// XXH3-64 of the bytes received. A `warm` that streams a file whole compares them with the
    /// sha256-checked body, so a range corrupted at install is found.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<SourceRange>,
    /// Hugging Face layout only: source files a `warm` streamed whole with the published sha256
    /// and whose [`StreamIndex::source_ranges`] matched.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub verified_files: Vec<String>,
}

/// A byte range of a source file as received at install.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SourceRange {
    pub file: String,
    pub offset: u64,
    pub len: u64,
    /// XXH3-64 (hex) of the bytes received.
    pub xxh3: String,
}

/// One source tensor's bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TensorLoc {
    /// Checkpoint tensor name (any `language_model.` prefix removed).
    pub tensor: String,
    /// Shard file name.
    pub file: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the shard.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// compressed-tensors MXFP4 source (`weight_packed` at `offset`, `shape` the logical
    /// `[rows, cols]`): where its E8M0 `weight_scale` lies. The record gets both parts bit for
    /// bit, never re-quantized.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mxfp4_scales: Option<PartLoc>,
}

/// One stored part of a source tensor: shard file, absolute offset, bytes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PartLoc {
    pub file: String,
    pub offset: u64,
    pub len: u64,
}

impl StreamIndex {
    /// An empty index.
    pub fn new() -> Self {
        StreamIndex {
            format: INDEX_FORMAT.into(),
            version: 1,
            files: BTreeMap::new(),
            tensors: BTreeMap::new(),
            mirror: false,
            record_xxh3: BTreeMap::new(),
            verified_xxh3: BTreeMap::new(),
            source_ranges: Vec::new(),
            verified_files: Vec::new(),
        }
    }

    /// Whether `backbone.bin` is known equal to what the source's sha256-checked files give: every
    /// file it was converted from ([`StreamIndex::source_ranges`]) was verified by a `warm`.
    pub fn backbone_verified(&self) -> bool {
        !self.source_ranges.is_empty() && self.source_ranges.iter().all(|r| self.verified_files.contains(&r.file))
    }

    /// Writes the index as `dir/file`, durably (temp file, fsync, rename).
    ///
    /// Errors: I/O.
    pub fn write(&self, dir: &Path, file: &str) -> Result<(), PullError> {
        let json = serde_json::to_vec(self).map_err(|e| PullError::Invalid(format!("stream index: {e}")))?;
        crate::http::write_atomic(&dir.join(file), &json)
    }

    /// The checksum a present record with `xxh3` has against the source: `Some(true)` when it
    /// was verified through its source files' sha256, `Some(false)` when a verified copy had
    /// another checksum (the local bytes changed since), `None` when never verified.
    pub fn verified(&self, layer: u32, expert: u32, xxh3: u64) -> Option<bool> {
        self.verified_xxh3
            .get(&format!("{layer}.{expert}"))
            .map(|h| u64::from_str_radix(h, 16).ok() == Some(xxh3))
    }

    /// Reads `stream-index.json` of a model directory.
    ///
    /// Errors: missing or malformed file.
    pub fn read(dir: &Path, file: &str) -> Result<Self, PullError> {
        let p = dir.join(file);
        let bytes = deltafin_fs::read(&p).map_err(crate::io_err(&p))?;
        let ix: StreamIndex = serde_json::from_slice(&bytes).map_err(|e| FormatError::Json {
            path: p.clone(),
            message: e.to_string(),
        })?;
        if ix.format != INDEX_FORMAT || ix.version != 1 {
            return Err(PullError::Invalid(format!(
                "{}: not a version-1 stream index",
                p.display()
            )));
        }
        Ok(ix)
    }
}

impl Default for StreamIndex {
    fn default() -> Self {
        Self::new()
    }
}

/// For a streaming install, whether its source checks each record it sends (a deltafin mirror:
/// `Some(true)`) or not (a Hugging Face layout: `Some(false)`, see
/// [`HttpRecordSource::checks_records`]); `None` for a full install, whose records all carry the
/// checksums written by convert or pull.
///
/// Errors: the stream index is missing or malformed.
pub fn source_checks_records(dir: &ModelDir) -> Result<Option<bool>, PullError> {
    match &dir.manifest.stream {
        None => Ok(None),
        Some(s) => Ok(Some(StreamIndex::read(&dir.path, &s.index)?.mirror)),
    }
}

/// The [`RecordSource`] of a streaming install: HTTP range reads of the source checkpoint.
pub struct HttpRecordSource {
    http: Arc<Http>,
    source: Source,
    index: StreamIndex,
    layout: Vec<ExpertTensorLayout>,
    /// Record length (data bytes), the same for every record.
    length: u64,
    /// Mirror sources: record offsets by (layer, expert), from the manifest.
    offsets: std::collections::HashMap<(usize, usize), u64>,
    pack_file: String,
    fetched: AtomicU64,
    /// Mirror sources: records whose body failed its checksum and was fetched again.
    refetched: AtomicU64,
}

impl HttpRecordSource {
    /// The source of streaming install `dir`.
    ///
    /// Errors: `dir` is not a streaming install; its stream index is missing or malformed.
    pub fn open(dir: &ModelDir, http: Arc<Http>) -> Result<Self, PullError> {
        let m = &dir.manifest;
        let s = m.stream.as_ref().ok_or_else(|| {
            PullError::Invalid(format!(
                "{}: not a streaming install (every expert record is local)",
                dir.path.display()
            ))
        })?;
        let index = StreamIndex::read(&dir.path, &s.index)?;
        let length = m.experts.records.first().map_or(0, |r| r.length);
        Ok(HttpRecordSource {
            http,
            source: Source::new(&s.url, Some(&s.revision), s.flat)?,
            index,
            layout: m.experts.layout.clone(),
            length,
            offsets: m
                .experts
                .records
                .iter()
                .map(|r| ((r.layer as usize, r.expert as usize), r.offset))
                .collect(),
            pack_file: m.experts.file.clone(),
            fetched: AtomicU64::new(0),
            refetched: AtomicU64::new(0),
        })
    }

    /// Whether each record fetched is checked against a checksum published by the source: true
    /// for a deltafin mirror (per-record xxh3); false for a Hugging Face layout, which publishes
    /// a sha256 per file, not per byte range, so a record converted from ranges cannot be
    /// checked as it arrives (`cache verify --source` compares it with the source later).
    pub fn checks_records(&self) -> bool {
        self.index.mirror
    }

    /// Source files as the server described them at install (size, ETag, sha256), by name.
    pub fn files(&self) -> &BTreeMap<String, RemoteFile> {
        &self.index.files
    }

    /// URL of `file` in the source.
    pub fn file_url(&self, file: &str) -> String {
        self.source.file_url(file)
    }

    /// Mirror sources: records fetched again after a corrupted body.
    pub fn records_refetched(&self) -> u64 {
        self.refetched.load(Ordering::Relaxed)
    }

    /// A mirror's record: one range read of its `experts.pack`, checked against the mirror's
    /// checksum; a corrupted body is fetched again (up to the HTTP retry limit).
    fn fetch_mirror(&self, layer: usize, expert: usize) -> Result<Vec<u8>, PullError> {
        let key = format!("{layer}.{expert}");
        let want = self
            .index
            .record_xxh3
            .get(&key)
            .and_then(|h| u64::from_str_radix(h, 16).ok())
            .ok_or_else(|| {
                PullError::Invalid(format!(
                    "stream index has no checksum for layer {layer}, expert {expert}"
                ))
            })?;
        let offset = *self
            .offsets
            .get(&(layer, expert))
            .ok_or_else(|| PullError::Invalid(format!("no expert record for layer {layer}, expert {expert}")))?;
        let url = self.source.file_url(&self.pack_file);
        let attempts = self.http.max_attempts();
        let mut found = 0;
        for attempt in 0..attempts {
            let (bytes, _) = self.read(&self.pack_file, offset, self.length)?;
            found = xxhash_rust::xxh3::xxh3_64(&bytes);
            if found == want {
                self.fetched.fetch_add(1, Ordering::Relaxed);
                return Ok(bytes);
            }
            self.refetched.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                "{url}: layer {layer} expert {expert}: body failed its checksum (attempt {}/{attempts}), fetching it again",
                attempt + 1
            );
        }
        Err(PullError::Http {
            url,
            message: format!(
                "record of layer {layer}, expert {expert} failed its checksum {attempts} times: expected xxh3 {want:016x}, found {found:016x}"
            ),
        })
    }

    /// The HTTP client (byte counters).
    pub fn http(&self) -> &Http {
        &self.http
    }

    /// Records fetched so far.
    pub fn records_fetched(&self) -> u64 {
        self.fetched.load(Ordering::Relaxed)
    }

    /// The record of routed expert `expert` in MoE layer `layer` (`length` bytes), fetched and
    /// converted (from a mirror: read and checked against its checksum). When the expert's tensors lie close together in one shard they are read with a
    /// single range request.
    ///
    /// Errors: a tensor missing from the index, a wrong shape or unsupported dtype, HTTP errors
    /// (retried first), a source file that changed since the install.
    pub fn fetch(&self, layer: usize, expert: usize) -> Result<Vec<u8>, PullError> {
        if self.index.mirror {
            return self.fetch_mirror(layer, expert);
        }
        let locs = self.locs(layer, expert)?;
        let same_file = locs.iter().all(|l| l.file == locs[0].file);
        let lo = locs.iter().map(|l| l.offset).min().unwrap_or(0);
        let hi = locs.iter().map(|l| l.offset + l.len).max().unwrap_or(0);
        let sum: u64 = locs.iter().map(|l| l.len).sum();
        let mut bytes: Vec<Vec<u8>> = Vec::with_capacity(locs.len());
        if same_file && hi - lo <= sum + (1 << 20) {
            let (span, _) = self.read(&locs[0].file, lo, hi - lo)?;
            for l in &locs {
                let at = (l.offset - lo) as usize;
                bytes.push(span[at..at + l.len as usize].to_vec());
            }
        } else {
            for l in &locs {
                bytes.push(self.read(&l.file, l.offset, l.len)?.0);
            }
        }
        let rec = self.encode(&locs, &bytes)?;
        self.fetched.fetch_add(1, Ordering::Relaxed);
        Ok(rec)
    }

    /// The stream index of the install.
    pub fn index(&self) -> &StreamIndex {
        &self.index
    }

    /// Where the source tensors of routed expert `expert` in layer `layer` lie, one per matrix
    /// of the record layout, checked against it (shape, dtype).
    ///
    /// Errors: a tensor missing from the index, a wrong shape, an unsupported dtype.
    pub fn locs(&self, layer: usize, expert: usize) -> Result<Vec<&TensorLoc>, PullError> {
        let mut locs = Vec::with_capacity(self.layout.len());
        for lay in &self.layout {
            let key = format!("{layer}.{expert}.{}", lay.name);
            let loc = self.index.tensors.get(&key).ok_or_else(|| {
                PullError::Invalid(format!(
                    "stream index has no {} for layer {layer}, expert {expert}",
                    lay.name
                ))
            })?;
            let n = loc.tensor.clone();
            if loc.shape != [lay.rows, lay.cols] {
                return Err(FormatError::ShapeMismatch {
                    path: loc.file.clone().into(),
                    tensor: n,
                    expected: vec![lay.rows, lay.cols],
                    found: loc.shape.clone(),
                }
                .into());
            }
            if loc.mxfp4_scales.is_some() {
                if lay.dtype != deltafin_format::StoredDtype::Mxfp4 {
                    return Err(PullError::Invalid(format!(
                        "{n}: an MXFP4 source is copied only into MXFP4 records, this install stores {}",
                        lay.dtype.name()
                    )));
                }
            } else {
                deltafin_format::checkpoint::check_dtype(Path::new(&loc.file), &n, loc.dtype)?;
            }
            locs.push(loc);
        }
        Ok(locs)
    }

    /// The record converted from the source bytes of its tensors (`bytes[i]` of `locs[i]`, as
    /// [`HttpRecordSource::locs`] gives them); MXFP4 sources read their scales by range here.
    ///
    /// Errors: an unsupported combination of sources, a bad MXFP4 tensor.
    pub fn encode(&self, locs: &[&TensorLoc], bytes: &[Vec<u8>]) -> Result<Vec<u8>, PullError> {
        if locs.iter().any(|l| l.mxfp4_scales.is_some()) {
            return self.mxfp4_record(locs, bytes);
        }
        let mut i = 0;
        Ok(encode_expert_record(&self.layout, self.length as usize, |_, _, _| {
            let v = deltafin_format::checkpoint::decode_f32(locs[i].dtype, &bytes[i]);
            i += 1;
            Ok(v)
        })?)
    }

    /// A record from compressed-tensors MXFP4 sources: each matrix's codes (`packed`) and
    /// scales (read here) copied into place, as `convert` copies them
    /// ([`deltafin_format::source_dtypes::mxfp4_record`]).
    fn mxfp4_record(&self, locs: &[&TensorLoc], packed: &[Vec<u8>]) -> Result<Vec<u8>, PullError> {
        use deltafin_format::source_dtypes::{mxfp4_record, Mxfp4Source};
        let mut rec = vec![0u8; self.length as usize];
        for ((lay, loc), p) in self.layout.iter().zip(locs).zip(packed) {
            let Some(sc) = &loc.mxfp4_scales else {
                return Err(PullError::Invalid(format!(
                    "{}: mixed MXFP4 and plain sources in one expert are not supported",
                    loc.tensor
                )));
            };
            let (scales, _) = self.read(&sc.file, sc.offset, sc.len)?;
            let b = mxfp4_record(Mxfp4Source::CompressedTensors, p, &scales, lay.rows, lay.cols)
                .map_err(|e| PullError::Invalid(format!("{}: {e}", loc.tensor)))?;
            let at = lay.offset as usize;
            rec.get_mut(at..at + b.len())
                .ok_or_else(|| PullError::Invalid(format!("{}: record layout too short", loc.tensor)))?
                .copy_from_slice(&b);
        }
        Ok(rec)
    }

    fn read(&self, file: &str, start: u64, len: u64) -> Result<(Vec<u8>, RemoteFile), PullError> {
        let expect = self.index.files.get(file);
        self.http.get_range(&self.source.file_url(file), start, len, expect)
    }
}

impl RecordSource for HttpRecordSource {
    fn fetch_record(&self, layer: usize, expert: usize) -> Result<Vec<u8>, String> {
        self.fetch(layer, expert).map_err(|e| e.to_string())
    }

    fn describe(&self) -> String {
        self.source.url.clone()
    }

    /// One MoE layer's top-k (8 for DeepSeek-V3) in flight at once.
    fn max_concurrent(&self) -> usize {
        8
    }
}
