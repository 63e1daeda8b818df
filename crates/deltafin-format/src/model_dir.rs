//! The deltafin model directory.
//!
//! ```text
//! model_dir/
//!   manifest.json      format version, resolved + source config, tensor index, expert records
//!   backbone.bin       resident tensors, each at a 64-byte-aligned offset
//!   experts.pack       one record per (MoE layer, routed expert), each at a 4096-byte-aligned
//!                      offset: gate_proj | up_proj | down_proj (each: values, then scales)
//!   config.json, generation_config.json, tokenizer.json, tokenizer_config.json, tiktoken.model
//!                      copied from the source when present
//! ```
//!
//! Stored dtypes: `f32`, `bf16` (little-endian), `int8` (i8 values `[rows, cols]` then one f32
//! scale per row), `mxfp4` (OCP MX v1.0 E2M1 values two per byte, low nibble first, `[rows,
//! ceil(cols/32)*16]`, then E8M0 scales `[rows, ceil(cols/32)]`). `manifest.json` is written
//! last and the directory is renamed into place only when complete, so a directory with a
//! manifest is always whole.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use deltafin_kernels::{MatData, MatRef};
use serde_json::Value;

pub use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
pub use crate::manifest::{
    tensor_xxh3, write_manifest, BackboneIndex, ExpertPackIndex, ExpertRecord, ExpertTensorLayout, Manifest,
    StoredDtype, StreamSource, TensorRecord, FORMAT_NAME, FORMAT_VERSION,
};
use crate::{AlignedBuf, FormatError};

/// One tensor of [`BackboneCheck`]: `None` without a checksum, `Some(None)` when its bytes
/// (in `seg`, which starts at file offset `base`) match, `Some(Some((name, why)))` otherwise.
fn check_tensor(name: &str, t: &TensorRecord, seg: &[u8], base: usize) -> Option<Option<(String, String)>> {
    if t.xxh3.is_empty() {
        return None;
    }
    let bytes = usize::try_from(t.offset)
        .ok()
        .zip(usize::try_from(t.offset.saturating_add(t.bytes)).ok())
        .and_then(|(a, b)| seg.get(a.checked_sub(base)?..b.checked_sub(base)?));
    let Some(bytes) = bytes else {
        return Some(Some((name.to_string(), "out of the file's range".into())));
    };
    let found = tensor_xxh3(bytes);
    Some((found != t.xxh3).then(|| {
        (
            name.to_string(),
            format!("checksum mismatch: expected xxh3 {}, found {found}", t.xxh3),
        )
    }))
}

/// Bytes of `backbone.bin` read before the tensors they hold are handed to the hashing pool.
const SEGMENT: usize = 64 << 20;

/// Reads `len` bytes of `f` into a new buffer and checks the tensors of `index` while it reads:
/// the file is read in segments of about `segment` bytes ([`SEGMENT`] at load) cut at tensor starts, in order, and
/// the tensors of each segment are hashed by the rayon pool as soon as it is in memory while the
/// next one is read. So the check hides behind the read (I/O, or a copy from the page cache),
/// and only the last segment's hashing adds to the load time. A tensor not inside one segment
/// (overlapping others in a hostile manifest) is checked after the read.
fn read_checked(
    f: &File,
    len: usize,
    index: &BTreeMap<String, TensorRecord>,
    segment: usize,
) -> std::io::Result<(AlignedBuf, BackboneCheck)> {
    let mut buf = AlignedBuf::zeroed(len, 4096);
    let mut starts: Vec<usize> = index
        .values()
        .filter_map(|t| usize::try_from(t.offset).ok())
        .filter(|&o| o < len)
        .collect();
    starts.sort_unstable();
    let mut bounds = vec![0usize];
    for o in starts {
        if o >= bounds[bounds.len() - 1] + segment {
            bounds.push(o);
        }
    }
    bounds.push(len);
    let mut per_seg: Vec<Vec<(&String, &TensorRecord)>> = vec![Vec::new(); bounds.len() - 1];
    let mut after = Vec::new();
    for (n, t) in index {
        let (a, b) = (t.offset, t.offset.saturating_add(t.bytes));
        let i = bounds.partition_point(|&x| x as u64 <= a).saturating_sub(1);
        match per_seg.get_mut(i) {
            Some(v) if b <= bounds[i + 1] as u64 => v.push((n, t)),
            _ => after.push((n, t)),
        }
    }
    let results = std::sync::Mutex::new(Vec::with_capacity(index.len()));
    let mut read = Ok(());
    rayon::scope(|s| {
        let mut rest: &mut [u8] = buf.as_mut_slice();
        for (i, list) in per_seg.iter().enumerate() {
            let (seg, tail) = std::mem::take(&mut rest).split_at_mut(bounds[i + 1] - bounds[i]);
            rest = tail;
            if let Err(e) = read_full_at(f, seg, bounds[i] as u64) {
                read = Err(e);
                return;
            }
            let seg: &[u8] = seg;
            let (base, results) = (bounds[i], &results);
            s.spawn(move |_| {
                let r: Vec<_> = list.iter().map(|(n, t)| check_tensor(n, t, seg, base)).collect();
                if let Ok(mut g) = results.lock() {
                    g.extend(r);
                }
            });
        }
    });
    read?;
    let mut results = results.into_inner().unwrap_or_default();
    results.extend(after.iter().map(|(n, t)| check_tensor(n, t, buf.as_slice(), 0)));
    Ok((buf, BackboneCheck::from_results(results)))
}

/// What checking `backbone.bin` against the manifest's tensor checksums found.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackboneCheck {
    /// Tensors whose checksum matched.
    pub verified: usize,
    /// Tensors without a checksum in the manifest (an older directory): not checked.
    pub unverified: usize,
    /// (tensor, what is wrong) of each tensor whose bytes do not match its checksum.
    pub failures: Vec<(String, String)>,
}

impl BackboneCheck {
    /// Checks each tensor of `index` with a checksum against its bytes in `buf` (the whole
    /// `backbone.bin`), in parallel: XXH3 runs at memory speed on every core.
    pub fn of(index: &BTreeMap<String, TensorRecord>, buf: &[u8]) -> BackboneCheck {
        use rayon::prelude::*;
        let results: Vec<Option<Option<(String, String)>>> = index
            .par_iter()
            .map(|(name, t)| check_tensor(name, t, buf, 0))
            .collect();
        BackboneCheck::from_results(results)
    }

    fn from_results(results: impl IntoIterator<Item = Option<Option<(String, String)>>>) -> BackboneCheck {
        let mut c = BackboneCheck::default();
        for r in results {
            match r {
                None => c.unverified += 1,
                Some(None) => c.verified += 1,
                Some(Some(f)) => c.failures.push(f),
            }
        }
        c.failures.sort();
        c
    }

    /// The load error for a failed check (None when every checked tensor matched).
    fn error(&self, path: &Path) -> Option<FormatError> {
        let (name, why) = self.failures.first()?;
        let more = match self.failures.len() {
            1 => String::new(),
            n => format!(" (and {} more tensors)", n - 1),
        };
        Some(FormatError::Checksum {
            path: path.to_path_buf(),
            message: format!(
                "backbone tensor {name}: {why}{more}: the file is damaged; convert or install the model again"
            ),
        })
    }
}

/// An opened model directory: manifest checked against the files on disk.
pub struct ModelDir {
    pub path: PathBuf,
    pub manifest: Manifest,
    /// Index into `manifest.experts.records` by `[layer][expert]` (None for dense layers).
    record_index: Vec<Vec<usize>>,
}

impl ModelDir {
    /// Opens and validates a model directory (manifest version, file sizes, record offsets).
    ///
    /// Errors name the directory and what is wrong: no manifest (including an interrupted
    /// convert), another format version, a file shorter than the manifest says, a record out of
    /// range or misaligned, a `config.json` that is not JSON.
    pub fn open(path: &Path) -> Result<Self, FormatError> {
        let mpath = path.join("manifest.json");
        let bad = |m: String| FormatError::ModelDir {
            path: path.to_path_buf(),
            message: m,
        };
        if path.is_file() {
            return Err(bad(
                "a file, not a model directory (give the directory that holds manifest.json)".into(),
            ));
        }
        if !path.is_dir() {
            let partial = path
                .file_name()
                .map(|n| path.with_file_name(format!(".{}.partial", n.to_string_lossy())));
            if partial.as_deref().is_some_and(Path::is_dir) {
                return Err(bad(
                    "no such directory, only the partial output of an interrupted `deltafin convert` beside it: re-run the convert".into(),
                ));
            }
            return Err(bad("no such directory".into()));
        }
        if !mpath.exists() {
            if path.join("backbone.bin").exists() || path.join("experts.pack").exists() {
                return Err(bad("manifest.json not found beside backbone.bin / experts.pack: the model directory is damaged; convert or install it again".into()));
            }
            if path.join("config.json").is_file() {
                return Err(bad("manifest.json not found: this looks like a Hugging Face checkpoint; convert it first with `deltafin convert <hf_dir> <model_dir>`".into()));
            }
            return Err(bad("manifest.json not found (was it written by `deltafin convert`? an interrupted convert leaves no model)".into()));
        }
        let text = deltafin_fs::read_to_string(&mpath).map_err(|e| FormatError::Io {
            path: mpath.clone(),
            error: e,
        })?;
        let manifest: Manifest = serde_json::from_str(&text).map_err(|e| FormatError::Json {
            path: mpath.clone(),
            message: e.to_string(),
        })?;
        if manifest.format != FORMAT_NAME {
            return Err(bad(format!(
                "manifest format is {:?}, expected {FORMAT_NAME:?}",
                manifest.format
            )));
        }
        if manifest.format_version != FORMAT_VERSION {
            return Err(bad(format!(
                "manifest format_version {} is not supported by this deltafin (expects {FORMAT_VERSION}); re-run `deltafin convert`",
                manifest.format_version
            )));
        }
        crate::manifest_check::check_manifest_values(&manifest, &mpath)?;
        // The copied config.json is read again for its end-of-sequence ids: a damaged copy is
        // named here, by every command, not only by those that read it later.
        let cpath = path.join("config.json");
        match deltafin_fs::read_to_string(&cpath) {
            Ok(text) => {
                serde_json::from_str::<Value>(&text).map_err(|e| FormatError::Json {
                    path: cpath.clone(),
                    message: e.to_string(),
                })?;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(FormatError::Io { path: cpath, error: e }),
        }
        check_manifest_paths(path, &manifest).map_err(&bad)?;
        for (file, bytes) in [
            (&manifest.backbone.file, manifest.backbone.bytes),
            (&manifest.experts.file, manifest.experts.bytes),
        ] {
            let p = path.join(file);
            let len = deltafin_fs::check_regular(&p)
                .map_err(|e| FormatError::Io {
                    path: p.clone(),
                    error: e,
                })?
                .len();
            if len < bytes {
                return Err(bad(format!(
                    "{file} is {len} bytes, manifest says {bytes}: the file is truncated"
                )));
            }
            if len > bytes {
                return Err(bad(format!(
                    "{file} is {len} bytes, manifest says {bytes}: the file is longer than this \
                     manifest's (from another conversion?); re-run `deltafin convert`"
                )));
            }
        }
        let record_index = check_manifest_layout(&manifest).map_err(bad)?;
        Ok(ModelDir {
            path: path.to_path_buf(),
            manifest,
            record_index,
        })
    }

    /// The record of routed expert `expert` in layer `layer`. Panics if the pair does not exist
    /// (the router can only produce valid ids; callers check with `is_moe_layer`).
    pub fn record(&self, layer: usize, expert: usize) -> &ExpertRecord {
        &self.manifest.experts.records[self.record_index[layer][expert]]
    }

    /// Path of `experts.pack`.
    pub fn expert_pack_path(&self) -> PathBuf {
        self.path.join(&self.manifest.experts.file)
    }

    /// Reads `backbone.bin` into memory (resident for the life of the process) and checks every
    /// tensor against its checksum ([`BackboneCheck`]; tensors of an older directory without
    /// checksums load unchecked).
    ///
    /// Errors: the file cannot be read; a tensor fails its checksum (named, with how many more).
    pub fn load_backbone(&self) -> Result<Backbone, FormatError> {
        let (p, buf, check) = self.read_backbone()?;
        if let Some(e) = check.error(&p) {
            return Err(e);
        }
        Ok(Backbone {
            path: p,
            buf,
            index: self.manifest.backbone.tensors.clone(),
            serial: next_backbone_serial(),
        })
    }
}

impl ModelDir {
    /// `backbone.bin` read into memory and checked as it is read ([`read_checked`]).
    fn read_backbone(&self) -> Result<(PathBuf, AlignedBuf, BackboneCheck), FormatError> {
        let p = self.path.join(&self.manifest.backbone.file);
        let io = |e| FormatError::Io {
            path: p.clone(),
            error: e,
        };
        let f = deltafin_fs::open_regular(&p).map_err(io)?;
        let (buf, check) = read_checked(
            &f,
            self.manifest.backbone.bytes as usize,
            &self.manifest.backbone.tensors,
            SEGMENT,
        )
        .map_err(io)?;
        Ok((p, buf, check))
    }

    /// Reads `backbone.bin` and checks it against the manifest's tensor checksums (`cache
    /// verify`): a failing tensor is a [`BackboneCheck::failures`] entry, not an error.
    ///
    /// Errors: the file cannot be read.
    pub fn verify_backbone(&self) -> Result<BackboneCheck, FormatError> {
        Ok(self.read_backbone()?.2)
    }

    /// Whether every backbone tensor has a checksum in the manifest (false for directories
    /// written before deltafin checksummed the backbone).
    pub fn backbone_checksummed(&self) -> bool {
        self.manifest.backbone.tensors.values().all(|t| !t.xxh3.is_empty())
    }
}

/// Checks the byte layout manifest `manifest` describes, without its files: every backbone
/// tensor lies inside `backbone.bytes` at a [`TENSOR_ALIGN`]-aligned offset; every expert record
/// names a routed expert of a MoE layer of this model, lies inside `experts.bytes` at an
/// `experts.record_align`-aligned offset and holds the whole record layout; every MoE layer has
/// all its records. Returns the record index: `[layer][expert]` → position in
/// `experts.records` (empty for dense layers). [`ModelDir::open`] runs it, and so does a pull
/// before it trusts a mirror's manifest.
///
/// Call after [`crate::manifest_check::check_manifest_values`] (which bounds the counts and
/// `record_align`). Errors: a message naming the first tensor or record that is wrong.
pub fn check_manifest_layout(manifest: &Manifest) -> Result<Vec<Vec<usize>>, String> {
    let end = |offset: u64, bytes: u64| offset.saturating_add(bytes);
    for (name, t) in &manifest.backbone.tensors {
        if t.offset % TENSOR_ALIGN != 0 || end(t.offset, t.bytes) > manifest.backbone.bytes {
            return Err(format!("backbone tensor {name} is out of range or misaligned"));
        }
    }
    let cfg = &manifest.config;
    let mut record_index = vec![Vec::new(); cfg.num_hidden_layers()];
    let layout_end = manifest
        .experts
        .layout
        .iter()
        .map(|l| end(l.offset, l.bytes))
        .max()
        .unwrap_or(0);
    let align = manifest.experts.record_align.max(1);
    for (i, r) in manifest.experts.records.iter().enumerate() {
        let (l, e) = (r.layer as usize, r.expert as usize);
        if l >= cfg.num_hidden_layers() || !cfg.is_moe_layer(l) || e >= cfg.n_routed_experts() {
            return Err(format!(
                "expert record (layer {l}, expert {e}) does not exist in this model"
            ));
        }
        if r.offset % align != 0 || end(r.offset, r.length) > manifest.experts.bytes || r.length < layout_end {
            return Err(format!(
                "expert record (layer {l}, expert {e}) is out of range, misaligned or short"
            ));
        }
        if record_index[l].is_empty() {
            record_index[l] = vec![usize::MAX; cfg.n_routed_experts()];
        }
        record_index[l][e] = i;
    }
    for (l, idx) in record_index.iter().enumerate() {
        if cfg.is_moe_layer(l) && (idx.is_empty() || idx.contains(&usize::MAX)) {
            return Err(format!("MoE layer {l} is missing expert records"));
        }
    }
    Ok(record_index)
}

/// Checks that every file a manifest names (backbone, expert pack, tokenizer files, stream
/// index) and the presence journal resolve inside the model directory `dir`: a relative path of
/// plain components (no absolute path, no `..` or `.`), and, where the file exists, no symbolic
/// link anywhere on the way leading out of `dir`. A manifest is untrusted input: without this,
/// `cache gc` and `warm` would write into a file elsewhere and loading would read any file
/// (issue #19, item 9). Pulls from a mirror already refuse names that are not plain file names.
///
/// Errors: a message naming the manifest field and the offending path.
pub fn check_manifest_paths(dir: &Path, manifest: &Manifest) -> Result<(), String> {
    check_paths(dir, dir.canonicalize().ok().as_deref(), manifest)
}

/// The lexical part of [`check_manifest_paths`], for a manifest not yet on disk (one fetched
/// from a mirror): every file it names is a relative path of plain components.
///
/// Errors: a message naming the manifest field and the offending path.
pub fn check_manifest_names(manifest: &Manifest) -> Result<(), String> {
    check_paths(Path::new(""), None, manifest)
}

fn check_paths(dir: &Path, root: Option<&Path>, manifest: &Manifest) -> Result<(), String> {
    let mut named: Vec<(String, &str)> = vec![
        ("backbone.file".into(), manifest.backbone.file.as_str()),
        ("experts.file".into(), manifest.experts.file.as_str()),
    ];
    for (i, f) in manifest.tokenizer_files.iter().enumerate() {
        named.push((format!("tokenizer_files[{i}]"), f.as_str()));
    }
    if let Some(s) = &manifest.stream {
        named.push(("stream.index".into(), s.index.as_str()));
    }
    named.push(("(presence journal)".into(), crate::manifest::JOURNAL_FILE));
    for (field, file) in named {
        check_inside(dir, root, file).map_err(|why| format!("manifest {field} {file:?} {why}"))?;
    }
    Ok(())
}

/// One path of [`check_manifest_paths`]; `root` is `dir` canonicalized (None when that failed:
/// then only the lexical rule is checked).
fn check_inside(dir: &Path, root: Option<&Path>, file: &str) -> Result<(), &'static str> {
    use std::path::Component;
    let rel = Path::new(file);
    if file.is_empty() || !rel.components().all(|c| matches!(c, Component::Normal(_))) {
        return Err("is not a relative path inside the model directory (no absolute path, `..` or `.`)");
    }
    let Some(root) = root else { return Ok(()) };
    // Each existing prefix, so that a symbolic link to a missing file or a linked parent
    // directory cannot lead out either.
    let mut p = dir.to_path_buf();
    for c in rel.components() {
        p.push(c);
        if std::fs::symlink_metadata(&p).is_err() {
            break;
        }
        match p.canonicalize() {
            Ok(real) if real.starts_with(root) => {}
            Ok(_) => return Err("is a symbolic link leading out of the model directory"),
            Err(_) => return Err("is a symbolic link that cannot be resolved"),
        }
    }
    Ok(())
}

/// Reads exactly `buf.len()` bytes at `offset`, in chunks (large reads are split by the kernel).
pub fn read_full_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    const CHUNK: usize = 64 << 20;
    let mut done = 0;
    while done < buf.len() {
        let end = (done + CHUNK).min(buf.len());
        f.read_exact_at(&mut buf[done..end], offset + done as u64)?;
        done = end;
    }
    Ok(())
}

/// The resident backbone: `backbone.bin` in memory plus its tensor index.
///
/// Tensors are read two ways: by name ([`Backbone::matrix`], [`Backbone::vector`],
/// [`Backbone::f32_tensor`]: a map lookup and the checks on every call, for load-time code), or
/// through a handle resolved and checked once at load ([`Backbone::matrix_handle`],
/// [`Backbone::vector_handle`], [`Backbone::f32_handle`]) and read with the infallible
/// [`Backbone::mat`] / [`Backbone::vec`] in the forward passes.
pub struct Backbone {
    path: PathBuf,
    buf: AlignedBuf,
    index: BTreeMap<String, TensorRecord>,
    /// This backbone's identity, unique in the process, stamped into its handles.
    serial: u64,
}

/// A new [`Backbone::serial`], never handed out before in this process.
fn next_backbone_serial() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A 2-D backbone tensor resolved once ([`Backbone::matrix_handle`]): its dtype, shape
/// `[rows, cols]` and the byte ranges of its values and scales in the backbone, all checked.
/// Read it with [`Backbone::mat`] on the backbone that made it. Small and `Copy`: a model keeps
/// one per weight, next to the backbone it owns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatHandle {
    backbone: u64,
    dtype: StoredDtype,
    rows: usize,
    cols: usize,
    /// `[start, end)` in bytes of the values, then of the scales (empty for f32/bf16).
    values: (usize, usize),
    scales: (usize, usize),
}

impl MatHandle {
    /// Output features (`shape[0]`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (`shape[1]`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// How the weights are stored.
    pub fn dtype(&self) -> StoredDtype {
        self.dtype
    }
}

/// An f32 backbone tensor resolved once ([`Backbone::vector_handle`], [`Backbone::f32_handle`]):
/// the element range of its values, checked. Read it with [`Backbone::vec`] on the backbone
/// that made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VecHandle {
    backbone: u64,
    /// Byte offset of the first value.
    start: usize,
    /// Values (f32 elements).
    len: usize,
}

impl VecHandle {
    /// Number of f32 values (the product of the tensor's shape).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the tensor holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Backbone {
    /// Bytes held in memory.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }

    /// Resolves the 2-D weight `name` once: runs every check of [`Backbone::matrix`] and
    /// returns a handle that [`Backbone::mat`] reads without looking anything up.
    ///
    /// Errors: the tensor is missing, not 2-D, or its bytes do not match its shape (named).
    pub fn matrix_handle(&self, name: &str) -> Result<MatHandle, FormatError> {
        let m = self.matrix(name)?;
        let r = self.rec(name)?;
        let start = r.offset as usize;
        let vb = r.dtype.value_bytes(m.rows, m.cols);
        let s_at = start + r.scales_offset.map_or(vb, |s| (s - r.offset) as usize);
        Ok(MatHandle {
            backbone: self.serial,
            dtype: r.dtype,
            rows: m.rows,
            cols: m.cols,
            values: (start, start + vb),
            scales: (s_at, s_at + r.dtype.scale_bytes(m.rows, m.cols)),
        })
    }

    /// Resolves the 1-D f32 tensor `name` once (the checks of [`Backbone::vector`]).
    ///
    /// Errors: the tensor is missing or not an f32 vector (named).
    pub fn vector_handle(&self, name: &str) -> Result<VecHandle, FormatError> {
        let v = self.vector(name)?;
        Ok(self.vec_handle(name, v.len()))
    }

    /// Resolves the f32 tensor `name` of any rank once, as a flat row-major slice (the checks
    /// of [`Backbone::f32_tensor`]); its shape is the second value.
    ///
    /// Errors: the tensor is missing or not stored as f32 (named).
    pub fn f32_handle(&self, name: &str) -> Result<(VecHandle, Vec<usize>), FormatError> {
        let (v, shape) = self.f32_tensor(name)?;
        Ok((self.vec_handle(name, v.len()), shape.to_vec()))
    }

    /// The handle of a tensor already checked as `len` f32 values.
    fn vec_handle(&self, name: &str, len: usize) -> VecHandle {
        let start = self.index.get(name).map_or(0, |r| r.offset as usize);
        VecHandle {
            backbone: self.serial,
            start,
            len,
        }
    }

    /// The matrix of handle `h` (no lookup; the checks ran when `h` was made). Equal to
    /// [`Backbone::matrix`] of its name.
    ///
    /// # Panics
    /// If `h` was made by another backbone (a programming error; slicing is bounds-checked
    /// anyway, so a foreign handle could never read outside this backbone's bytes).
    pub fn mat(&self, h: &MatHandle) -> MatRef<'_> {
        self.check_serial(h.backbone);
        let buf = self.buf.as_slice();
        let vals = &buf[h.values.0..h.values.1];
        let scales = &buf[h.scales.0..h.scales.1];
        let data = match h.dtype {
            StoredDtype::F32 => MatData::F32(bytemuck::cast_slice(vals)),
            StoredDtype::Bf16 => MatData::Bf16(bytemuck::cast_slice(vals)),
            StoredDtype::Int8 => MatData::Int8 {
                q: bytemuck::cast_slice(vals),
                scales: bytemuck::cast_slice(scales),
            },
            StoredDtype::Mxfp4 => MatData::Mxfp4 { packed: vals, scales },
        };
        MatRef {
            rows: h.rows,
            cols: h.cols,
            data,
        }
    }

    /// The f32 values of handle `h` (no lookup; the checks ran when `h` was made). Equal to
    /// [`Backbone::vector`] / the slice of [`Backbone::f32_tensor`] of its name.
    ///
    /// # Panics
    /// If `h` was made by another backbone (as [`Backbone::mat`]).
    pub fn vec(&self, h: &VecHandle) -> &[f32] {
        self.check_serial(h.backbone);
        bytemuck::cast_slice(&self.buf.as_slice()[h.start..h.start + 4 * h.len])
    }

    fn check_serial(&self, serial: u64) {
        assert!(
            serial == self.serial,
            "a tensor handle of backbone #{serial} used on backbone #{} ({})",
            self.serial,
            self.path.display()
        );
    }

    fn rec(&self, name: &str) -> Result<&TensorRecord, FormatError> {
        self.index.get(name).ok_or_else(|| FormatError::MissingTensor {
            path: self.path.clone(),
            tensor: name.to_string(),
        })
    }

    /// A 2-D weight `[rows, cols]` as a matrix view.
    ///
    /// Errors: the tensor is missing, not 2-D, or its bytes do not match its shape.
    pub fn matrix(&self, name: &str) -> Result<MatRef<'_>, FormatError> {
        let r = self.rec(name)?;
        if r.shape.len() != 2 {
            return Err(FormatError::ShapeMismatch {
                path: self.path.clone(),
                tensor: name.into(),
                expected: vec![0, 0],
                found: r.shape.clone(),
            });
        }
        let (rows, cols) = (r.shape[0], r.shape[1]);
        let bytes = &self.buf.as_slice()[r.offset as usize..(r.offset + r.bytes) as usize];
        matrix_from_bytes(
            r.dtype,
            rows,
            cols,
            bytes,
            r.scales_offset.map(|s| (s - r.offset) as usize),
        )
        .map_err(|m| FormatError::ModelDir {
            path: self.path.clone(),
            message: format!("tensor {name}: {m}"),
        })
    }

    /// An f32 tensor of any rank as a flat slice (row-major), with its shape: conv weights
    /// `[P, 1, K]`, `A_log` `[1, 1, H, 1]`, `[1, H]` projections.
    ///
    /// Errors: the tensor is missing or not stored as f32.
    pub fn f32_tensor(&self, name: &str) -> Result<(&[f32], &[usize]), FormatError> {
        let r = self.rec(name)?;
        let n: usize = r.shape.iter().product();
        if r.dtype != StoredDtype::F32 || r.bytes != n as u64 * 4 {
            return Err(FormatError::ModelDir {
                path: self.path.clone(),
                message: format!("tensor {name} is not stored as f32"),
            });
        }
        let bytes = &self.buf.as_slice()[r.offset as usize..(r.offset + r.bytes) as usize];
        let v = bytemuck::try_cast_slice(bytes).map_err(|e| FormatError::ModelDir {
            path: self.path.clone(),
            message: format!("tensor {name}: {e}"),
        })?;
        Ok((v, &r.shape))
    }

    /// A 1-D f32 tensor (norm weight, router bias).
    pub fn vector(&self, name: &str) -> Result<&[f32], FormatError> {
        let r = self.rec(name)?;
        if r.dtype != StoredDtype::F32 || r.shape.len() != 1 || r.bytes != r.shape[0] as u64 * 4 {
            return Err(FormatError::ModelDir {
                path: self.path.clone(),
                message: format!("tensor {name} is not an f32 vector"),
            });
        }
        let bytes = &self.buf.as_slice()[r.offset as usize..(r.offset + r.bytes) as usize];
        bytemuck::try_cast_slice(bytes).map_err(|e| FormatError::ModelDir {
            path: self.path.clone(),
            message: format!("tensor {name}: {e}"),
        })
    }
}

/// Builds a matrix view over stored bytes (values, then scales at `scales_at` bytes in).
pub fn matrix_from_bytes(
    dtype: StoredDtype,
    rows: usize,
    cols: usize,
    bytes: &[u8],
    scales_at: Option<usize>,
) -> Result<MatRef<'_>, String> {
    let vb = dtype.value_bytes(rows, cols);
    let sb = dtype.scale_bytes(rows, cols);
    let s_at = scales_at.unwrap_or(vb);
    if bytes.len() < vb || bytes.len() < s_at + sb {
        return Err(format!(
            "{} bytes is too short for {} [{rows}, {cols}]",
            bytes.len(),
            dtype.name()
        ));
    }
    let vals = &bytes[..vb];
    let scales = &bytes[s_at..s_at + sb];
    let cast_err = |e: bytemuck::PodCastError| format!("misaligned data: {e}");
    let data = match dtype {
        StoredDtype::F32 => MatData::F32(bytemuck::try_cast_slice(vals).map_err(cast_err)?),
        StoredDtype::Bf16 => MatData::Bf16(bytemuck::try_cast_slice(vals).map_err(cast_err)?),
        StoredDtype::Int8 => MatData::Int8 {
            q: bytemuck::cast_slice(vals),
            scales: bytemuck::try_cast_slice(scales).map_err(cast_err)?,
        },
        StoredDtype::Mxfp4 => MatData::Mxfp4 { packed: vals, scales },
    };
    MatRef::new(rows, cols, data)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The storage a matrix view borrows: (address, length) of each slice.
    fn parts(m: &MatRef<'_>) -> Vec<(usize, usize)> {
        match m.data {
            MatData::F32(w) => vec![(w.as_ptr() as usize, w.len())],
            MatData::Bf16(w) => vec![(w.as_ptr() as usize, w.len())],
            MatData::F16(w) => vec![(w.as_ptr() as usize, w.len())],
            MatData::Int8 { q, scales } => {
                vec![(q.as_ptr() as usize, q.len()), (scales.as_ptr() as usize, scales.len())]
            }
            MatData::Mxfp4 { packed, scales } => vec![
                (packed.as_ptr() as usize, packed.len()),
                (scales.as_ptr() as usize, scales.len()),
            ],
        }
    }

    /// A backbone of one tensor per stored dtype, a vector and a 3-D f32 tensor.
    fn small_backbone() -> Backbone {
        let mut index = BTreeMap::new();
        let mut at = 0u64;
        let mut add = |name: &str, dtype: StoredDtype, shape: Vec<usize>, bytes: u64, scales: Option<u64>| {
            index.insert(
                name.to_string(),
                TensorRecord {
                    dtype,
                    shape,
                    offset: at,
                    bytes,
                    scales_offset: scales.map(|s| at + s),
                    xxh3: String::new(),
                },
            );
            at = (at + bytes).div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN;
        };
        add("f32", StoredDtype::F32, vec![2, 3], 24, None);
        add("bf16", StoredDtype::Bf16, vec![3, 2], 12, None);
        add("int8", StoredDtype::Int8, vec![2, 4], 8 + 8, Some(8));
        add("mxfp4", StoredDtype::Mxfp4, vec![2, 32], 32 + 2, Some(32));
        add("vec", StoredDtype::F32, vec![5], 20, None);
        add("conv", StoredDtype::F32, vec![2, 1, 3], 24, None);
        let mut buf = AlignedBuf::zeroed(at as usize, 4096);
        for (i, b) in buf.as_mut_slice().iter_mut().enumerate() {
            *b = (i * 37 % 61) as u8;
        }
        Backbone {
            path: PathBuf::from("backbone.bin"),
            buf,
            index,
            serial: next_backbone_serial(),
        }
    }

    /// A handle reads exactly the storage the by-name view borrows, for every dtype; a missing
    /// or malformed tensor fails when the handle is made, with its name.
    #[test]
    fn handles_read_what_names_read() {
        let bb = small_backbone();
        for name in ["f32", "bf16", "int8", "mxfp4"] {
            let h = bb.matrix_handle(name).unwrap();
            let (a, b) = (bb.mat(&h), bb.matrix(name).unwrap());
            assert_eq!((a.rows, a.cols), (b.rows, b.cols), "{name}");
            assert_eq!(parts(&a), parts(&b), "{name}");
            assert_eq!((h.rows(), h.cols()), (b.rows, b.cols), "{name}");
        }
        let v = bb.vector_handle("vec").unwrap();
        assert_eq!(bb.vec(&v).as_ptr(), bb.vector("vec").unwrap().as_ptr());
        assert_eq!(v.len(), 5);
        let (c, shape) = bb.f32_handle("conv").unwrap();
        let (want, want_shape) = bb.f32_tensor("conv").unwrap();
        assert_eq!((bb.vec(&c).as_ptr(), bb.vec(&c).len()), (want.as_ptr(), want.len()));
        assert_eq!(shape, want_shape);
        for (bad, err) in [
            (bb.matrix_handle("nope").err(), "nope"),
            (bb.matrix_handle("vec").err(), "vec"),
            (bb.vector_handle("int8").err(), "int8"),
            (bb.f32_handle("bf16").err(), "bf16"),
        ] {
            let e = bad.expect(err).to_string();
            assert!(e.contains(err) && !e.contains('\n'), "{e}");
        }
    }

    /// A handle of one backbone used on another is refused, not read.
    #[test]
    #[should_panic(expected = "tensor handle of backbone")]
    fn foreign_handle_panics() {
        let (a, b) = (small_backbone(), small_backbone());
        let h = a.matrix_handle("f32").unwrap();
        let _ = b.mat(&h);
    }

    /// Many segments (a segment size of a few tensors), one damaged tensor, one without a
    /// checksum and one overlapping another (checked after the read): the check finds exactly
    /// the damaged one whatever the segmenting.
    #[test]
    fn read_checked_checks_every_tensor_across_segments() {
        let mut file = Vec::new();
        let mut index = BTreeMap::new();
        for i in 0..40u64 {
            let bytes: Vec<u8> = (0..100 + i).map(|k| (k * 7 + i) as u8).collect();
            let offset = file.len() as u64;
            file.extend_from_slice(&bytes);
            file.resize(file.len().div_ceil(64) * 64, 0);
            let rec = |xxh3: String| TensorRecord {
                dtype: StoredDtype::F32,
                shape: vec![bytes.len()],
                offset,
                bytes: bytes.len() as u64,
                scales_offset: None,
                xxh3,
            };
            index.insert(
                format!("t{i:02}"),
                rec(if i == 7 { String::new() } else { tensor_xxh3(&bytes) }),
            );
        }
        let mut wide = index["t10"].clone();
        wide.bytes += 500; // over t11..: straddles the segment bounds
        wide.xxh3 = tensor_xxh3(&file[wide.offset as usize..(wide.offset + wide.bytes) as usize]);
        index.insert("wide".into(), wide);
        let at = index["t23"].offset as usize + 50;
        file[at] ^= 1;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("backbone.bin");
        std::fs::write(&p, &file).unwrap();
        let f = File::open(&p).unwrap();
        for segment in [1, 300, 1000, 1 << 20] {
            let (buf, c) = read_checked(&f, file.len(), &index, segment).unwrap();
            assert!(buf.as_slice() == file.as_slice(), "segment {segment}");
            assert_eq!(c.unverified, 1, "segment {segment}");
            assert_eq!(c.verified, 39, "segment {segment}");
            let names: Vec<&str> = c.failures.iter().map(|(n, _)| n.as_str()).collect();
            assert_eq!(names, ["t23"], "segment {segment}");
            assert_eq!(c, BackboneCheck::of(&index, &file), "segment {segment}");
        }
    }
}
