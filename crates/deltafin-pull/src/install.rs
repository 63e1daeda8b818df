//! `deltafin pull`: full and streaming installs, and upgrading a streaming install to full.
//!
//! Files: `config.json` (required), the optional files of
//! [`deltafin_format::manifest::COPIED_FILES`], and the weights named by
//! `model.safetensors.index.json` (or a single `model.safetensors`).
//!
//! - Full: every file is downloaded (resumable, verified; [`crate::http`]) into the sibling
//!   `.<name>.download/`, converted like `deltafin convert`, and the download removed.
//! - Streaming: the small files, then each shard's safetensors header by range, go into the
//!   sibling `.<name>.stream-src/`, where each shard is a sparse file of its full size; the
//!   backbone tensors are fetched by range into it (each range recorded in `ranges.done` once
//!   durable, so an interrupted pull resumes), then [`deltafin_format::convert::convert_stream`]
//!   writes the model directory with an empty expert cache and `stream-index.json`.
//! - Mirror: when the source serves a deltafin `manifest.json` (a full install published as
//!   plain files, e.g. with `--flat`), `--full` downloads `backbone.bin`, `experts.pack` and the
//!   tokenizer files and checks every record's checksum (a corrupted record is fetched again by
//!   range); `--stream` downloads all but the pack, and on-demand fetches read each record by one
//!   range request, checked against the mirror's checksum and fetched again when corrupted.
//! - Upgrade (`--full` on a streaming install): only the records not yet present are fetched;
//!   then the manifest gets every checksum and loses its `stream` section (written atomically),
//!   and the journal and index are removed.

use std::collections::{BTreeMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use deltafin_format::checkpoint::{Checkpoint, Encoding, TensorEntry};
use deltafin_format::convert::{self, ConvertOptions, Progress, StreamExtras};
use deltafin_format::family::Select;
use deltafin_format::manifest::COPIED_FILES;
use deltafin_format::model_dir::{Manifest, StreamSource, FORMAT_NAME, FORMAT_VERSION};
use deltafin_format::source_dtypes::Mxfp4Source;
use deltafin_format::{FormatError, StoredDtype};
use deltafin_format::{ModelConfig, ModelDir};

use crate::fetch::{PartLoc, StreamIndex, TensorLoc, STREAM_INDEX};
use crate::http::{write_atomic, RemoteFile, Transfer};
use crate::{io_err, sibling, Http, HttpRecordSource, PullError, Source};

/// Install settings.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    pub convert: ConvertOptions,
    /// Streaming: write `allow_network` into the manifest, so runs fetch without the flag.
    pub allow_network: bool,
    /// Full: keep the downloaded checkpoint in `.<name>.download/` after converting.
    pub keep_download: bool,
    /// Range requests in flight at once (0 = 4).
    pub concurrency: usize,
}

/// What a pull did.
#[derive(Debug, Clone, Default)]
pub struct PullReport {
    /// `full`, `stream` or `upgrade`.
    pub mode: &'static str,
    /// Body bytes received over HTTP (including retried attempts).
    pub bytes_fetched: u64,
    /// Expert records fetched (upgrade).
    pub records_fetched: usize,
    /// Expert records that were already local (upgrade).
    pub records_kept: usize,
    pub seconds: f64,
    pub retries: u64,
    /// Expert records come (stream) or came (upgrade) by byte range from a Hugging Face
    /// layout, which publishes a sha256 per file, not per record: they cannot be checked
    /// against the source as they arrive (issue #19, item 7).
    pub records_unchecked: bool,
}

impl PullReport {
    /// A report of a pull in `mode` that started at `t0`: the bytes and retries `http` counted
    /// and the seconds since `t0`; the record fields at their defaults (set them with struct
    /// update syntax).
    fn finished(mode: &'static str, http: &Http, t0: Instant) -> Self {
        PullReport {
            mode,
            bytes_fetched: http.bytes_received(),
            seconds: t0.elapsed().as_secs_f64(),
            retries: http.retries(),
            ..PullReport::default()
        }
    }
}

/// Removes the download directory `dl` of a full pull unless `--keep-download` keeps it.
fn remove_download(dl: &Path, opts: &PullOptions) -> Result<(), PullError> {
    if !opts.keep_download {
        std::fs::remove_dir_all(dl).map_err(io_err(dl))?;
    }
    Ok(())
}

const INDEX_FILE: &str = "model.safetensors.index.json";

fn refuse_existing(model_dir: &Path, force: bool) -> Result<(), PullError> {
    let nonempty = std::fs::read_dir(model_dir)
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if nonempty && !force {
        return Err(PullError::Invalid(format!(
            "{}: output directory exists and is not empty (pass --force to replace it)",
            model_dir.display()
        )));
    }
    // With --force: before any download, that the directory is a model holding nothing else.
    deltafin_format::staging::check_replaceable(model_dir, force)?;
    Ok(())
}

/// Prepares a sibling work directory for `source`: reused when it was made for the same source
/// (so downloads resume), emptied otherwise.
fn work_dir(dir: &Path, source: &Source) -> Result<(), PullError> {
    let stamp = dir.join("source.json");
    let want = serde_json::json!({"url": source.url, "revision": source.revision, "flat": source.flat}).to_string();
    if dir.exists() && std::fs::read_to_string(&stamp).ok().as_deref() != Some(want.as_str()) {
        std::fs::remove_dir_all(dir).map_err(io_err(dir))?;
    }
    std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    write_atomic(&stamp, want.as_bytes())
}

/// The sibling work directory `suffix` of a pull from a checkpoint (as [`mirror_work_dir`] is of
/// a pull from a mirror), prepared by [`work_dir`] and holding the files of [`small_files`]:
/// that directory and the shard names.
fn checkpoint_work_dir(p: Pull<'_>, suffix: &str) -> Result<(PathBuf, Vec<String>), PullError> {
    let dir = sibling(p.model_dir, suffix);
    work_dir(&dir, p.source)?;
    let shards = small_files(p.http, p.source, &dir)?;
    Ok((dir, shards))
}

/// Fetches `config.json`, the optional files and the index into `dir`; returns the shard names.
fn small_files(http: &Http, source: &Source, dir: &Path) -> Result<Vec<String>, PullError> {
    let cfg_url = source.file_url("config.json");
    let cfg = http.get_optional(&cfg_url)?.ok_or_else(|| PullError::Http {
        url: cfg_url.clone(),
        message: "no config.json here: is this a model repository? (files are read from <url>/resolve/<revision>/<file>, or <url>/<file> with --flat)".into(),
    })?;
    write_atomic(&dir.join("config.json"), &cfg)?;
    for f in COPIED_FILES.iter().filter(|f| **f != "config.json") {
        if let Some(b) = http.get_optional(&source.file_url(f))? {
            write_atomic(&dir.join(f), &b)?;
        }
    }
    let Some(index) = http.get_optional(&source.file_url(INDEX_FILE))? else {
        return Ok(vec!["model.safetensors".into()]);
    };
    write_atomic(&dir.join(INDEX_FILE), &index)?;
    let v: serde_json::Value = serde_json::from_slice(&index).map_err(|e| PullError::Http {
        url: source.file_url(INDEX_FILE),
        message: format!("malformed JSON: {e}"),
    })?;
    let mut shards: Vec<String> = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .map(|m| m.values().filter_map(|f| f.as_str().map(str::to_string)).collect())
        .unwrap_or_default();
    shards.sort();
    shards.dedup();
    if shards.is_empty() {
        return Err(PullError::Http {
            url: source.file_url(INDEX_FILE),
            message: "weight_map is missing or empty".into(),
        });
    }
    if let Some(bad) = shards
        .iter()
        .find(|f| f.contains('/') || f.contains("..") || f.is_empty())
    {
        return Err(PullError::Http {
            url: source.file_url(INDEX_FILE),
            message: format!("shard name {bad:?} must be a plain file name"),
        });
    }
    Ok(shards)
}

/// One `deltafin pull`: the HTTP client, the source, the model directory to write, the
/// settings, and where download and conversion progress go; [`pull_full`] or [`pull_stream`]
/// runs it.
#[derive(Clone, Copy)]
pub struct Pull<'a> {
    pub http: &'a Arc<Http>,
    pub source: &'a Source,
    pub model_dir: &'a Path,
    pub opts: &'a PullOptions,
    pub transfer: &'a dyn Transfer,
    pub progress: &'a dyn Progress,
}

/// `deltafin pull --full`: downloads and converts, or upgrades a streaming install in place.
///
/// Errors: an existing non-empty output without `force` (checked before downloading), HTTP
/// errors after retries, checksum failures, conversion errors, I/O (no space left...). An
/// interrupted pull leaves its downloads in `.<name>.download/` and resumes from them.
pub fn pull_full(p: Pull<'_>) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    if let Ok(dir) = ModelDir::open(p.model_dir) {
        if dir.manifest.stream.is_some() {
            return upgrade(p, dir);
        }
    }
    refuse_existing(p.model_dir, p.opts.convert.force)?;
    if let Some(m) = probe_mirror(p.http, p.source)? {
        return mirror_full(p, m);
    }
    let (dl, shards) = checkpoint_work_dir(p, "download")?;
    for s in &shards {
        let dest = dl.join(s);
        if !dest.is_file() {
            p.http.download(&p.source.file_url(s), &dest, p.transfer)?;
        }
    }
    convert::convert(&dl, p.model_dir, &p.opts.convert, p.progress)?;
    remove_download(&dl, p.opts)?;
    Ok(PullReport::finished("full", p.http, t0))
}

/// `--full` on the streaming install `dir` (at `p.model_dir`): fetches the records not yet present.
fn upgrade(p: Pull<'_>, dir: ModelDir) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    let s = dir
        .manifest
        .stream
        .clone()
        .ok_or_else(|| PullError::Invalid("not a streaming install".into()))?;
    if s.url.trim_end_matches('/') != p.source.url || s.revision != p.source.revision || s.flat != p.source.flat {
        return Err(PullError::Invalid(format!(
            "{}: this streaming install comes from {} (revision {}{}); upgrade it from the same source",
            dir.path.display(),
            s.url,
            s.revision,
            if s.flat { ", flat" } else { "" }
        )));
    }
    let src = HttpRecordSource::open(&dir, p.http.clone())?;
    let present = deltafin_format::presence::present_checksums(&dir)?;
    let missing: Vec<(u32, u32)> = dir
        .manifest
        .experts
        .records
        .iter()
        .map(|r| (r.layer, r.expert))
        .filter(|k| !present.contains_key(k))
        .collect();
    let kept = dir.manifest.experts.records.len() - missing.len();
    p.progress.start(
        missing
            .iter()
            .map(|&(l, e)| dir.record(l as usize, e as usize).length)
            .sum(),
    );
    let records_unchecked = !src.checks_records();
    let fetched = crate::records::fetch_records(&dir, &src, &missing, p.opts.concurrency, &|b| p.progress.advance(b))?;
    p.progress.finish();
    let present = deltafin_format::presence::present_checksums(&dir)?;
    let mut m = dir.manifest.clone();
    for r in &mut m.experts.records {
        let h = present.get(&(r.layer, r.expert)).ok_or_else(|| {
            PullError::Invalid(format!(
                "expert (layer {}, expert {}) still missing after the upgrade",
                r.layer, r.expert
            ))
        })?;
        r.xxh3 = format!("{h:016x}");
    }
    m.stream = None;
    let json = serde_json::to_vec_pretty(&m).map_err(|e| PullError::Invalid(e.to_string()))?;
    write_atomic(&dir.path.join("manifest.json"), &json)?;
    for f in [deltafin_format::presence::JOURNAL_FILE, s.index.as_str()] {
        let p = dir.path.join(f);
        if p.exists() {
            std::fs::remove_file(&p).map_err(io_err(&p))?;
        }
    }
    Ok(PullReport {
        records_fetched: fetched,
        records_kept: kept,
        records_unchecked,
        ..PullReport::finished("upgrade", p.http, t0)
    })
}

/// `deltafin pull --stream`: the resident part only, and an empty expert cache.
///
/// Errors: an existing non-empty output without `force`, a server without Range support
/// ([`PullError::RangeIgnored`]), HTTP errors after retries, a malformed shard header,
/// conversion errors (missing backbone tensor...), I/O.
pub fn pull_stream(p: Pull<'_>) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    refuse_existing(p.model_dir, p.opts.convert.force)?;
    if let Some(m) = probe_mirror(p.http, p.source)? {
        return mirror_stream(p, m);
    }
    let (sd, shards) = checkpoint_work_dir(p, "stream-src")?;
    let mut files: BTreeMap<String, RemoteFile> = BTreeMap::new();
    for s in &shards {
        files.insert(s.clone(), shard_header(p.http, p.source, &sd, s)?);
    }
    let (mut cfg, _) = ModelConfig::from_file(&sd.join("config.json"))?;
    let ck = Checkpoint::open(&sd)?;
    cfg.adapt_to_checkpoint(|n| ck.entry(n).is_some());
    let mut ranges: Vec<(String, u64, u64)> = Vec::new();
    for t in cfg.backbone_tensors() {
        if let Some(e) = ck.entry(&t.name) {
            ranges.extend(byte_ranges(&ck, e));
        }
    }
    let ranges = merge(ranges);
    fetch_ranges(
        p.http,
        p.source,
        &sd,
        &files,
        ranges.clone(),
        p.opts.concurrency,
        p.transfer,
    )?;

    let mut index = StreamIndex::new();
    // What backbone.bin is converted from, as received: checked when a warm verifies the file.
    for s in &shards {
        let mut n = [0u8; 8];
        let p = sd.join(s);
        deltafin_fs::open_regular(&p)
            .and_then(|f| f.read_exact_at(&mut n, 0))
            .map_err(io_err(&p))?;
        index
            .source_ranges
            .push(received_range(&sd, s, 0, 8 + u64::from_le_bytes(n))?);
    }
    for (f, offset, len) in &ranges {
        index.source_ranges.push(received_range(&sd, f, *offset, *len)?);
    }
    index.files = files;
    for l in cfg.moe_layers() {
        for e in 0..cfg.n_routed_experts() {
            for m in cfg.expert_matrices() {
                let src = cfg.expert_source(l, e, &m);
                let Some(t) = ck.entry(&src.tensor) else { continue };
                // compressed-tensors MXFP4 experts (Kimi K3 as shipped) stream bit for bit into
                // MXFP4 records; other quantized sources need the full download.
                let mxfp4_scales = match &t.encoding {
                    Encoding::Mxfp4 {
                        source: Mxfp4Source::CompressedTensors,
                        scales,
                        ..
                    } if p.opts.convert.experts == StoredDtype::Mxfp4 && src.select == Select::Whole => Some(PartLoc {
                        file: file_name(ck.shard_path(scales)),
                        offset: scales.offset,
                        len: scales.len,
                    }),
                    _ => None,
                };
                if mxfp4_scales.is_none() && !matches!(t.encoding, Encoding::Plain) {
                    return Err(PullError::Invalid(format!(
                        "{}: tensor {} is quantized in the source (FP8, int4, or MXFP4 not stored as MXFP4 records): streaming installs of such checkpoints are not supported yet; use `deltafin pull --full`",
                        p.source.file_url(&file_name(ck.shard_path(t))),
                        t.file_name
                    )));
                }
                index.tensors.insert(
                    format!("{l}.{e}.{}", m.name),
                    TensorLoc {
                        tensor: src.tensor.clone(),
                        file: file_name(ck.shard_path(t)),
                        dtype: t.dtype,
                        shape: t.shape.clone(),
                        offset: t.offset,
                        len: t.len,
                        mxfp4_scales,
                    },
                );
            }
        }
    }
    let extras = StreamExtras {
        source: StreamSource {
            url: p.source.url.clone(),
            revision: p.source.revision.clone(),
            flat: p.source.flat,
            allow_network: p.opts.allow_network,
            index: STREAM_INDEX.into(),
        },
        files: vec![(
            STREAM_INDEX.into(),
            serde_json::to_vec(&index).map_err(|e| PullError::Invalid(e.to_string()))?,
        )],
    };
    convert::convert_stream(&sd, p.model_dir, &p.opts.convert, &extras, p.progress)?;
    std::fs::remove_dir_all(&sd).map_err(io_err(&sd))?;
    Ok(PullReport {
        records_unchecked: true,
        ..PullReport::finished("stream", p.http, t0)
    })
}

/// The XXH3-64 of `len` bytes at `offset` of the local copy of source file `file` in `sd`.
fn received_range(sd: &Path, file: &str, offset: u64, len: u64) -> Result<crate::fetch::SourceRange, PullError> {
    let p = sd.join(file);
    let f = deltafin_fs::open_regular(&p).map_err(io_err(&p))?;
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    let mut buf = vec![0u8; (len.min(16 << 20)) as usize];
    let mut at = 0;
    while at < len {
        let k = (len - at).min(buf.len() as u64) as usize;
        f.read_exact_at(&mut buf[..k], offset + at).map_err(io_err(&p))?;
        h.update(&buf[..k]);
        at += k as u64;
    }
    Ok(crate::fetch::SourceRange {
        file: file.to_string(),
        offset,
        len,
        xxh3: format!("{:016x}", h.digest()),
    })
}

/// (shard file, offset, length) of a tensor's stored parts: the values and, for quantized
/// sources, their scale and shape tensors.
fn byte_ranges(ck: &Checkpoint, e: &TensorEntry) -> Vec<(String, u64, u64)> {
    let mut parts: Vec<&TensorEntry> = vec![e];
    match &e.encoding {
        Encoding::Plain => {}
        Encoding::BlockFp8 { scale_inv, .. } => parts.push(scale_inv),
        Encoding::PackQuantized {
            scale, shape_tensor, ..
        } => parts.extend([&**scale, &**shape_tensor]),
        Encoding::Mxfp4 {
            scales, shape_tensor, ..
        } => {
            parts.push(scales);
            parts.extend(shape_tensor.as_deref());
        }
    }
    parts
        .into_iter()
        .map(|p| (file_name(ck.shard_path(p)), p.offset, p.len))
        .collect()
}

fn file_name(p: &Path) -> String {
    p.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// The safetensors header of shard `name`, by range, into a sparse local file of the shard's
/// full size (reused when an earlier run got it).
fn shard_header(http: &Http, source: &Source, sd: &Path, name: &str) -> Result<RemoteFile, PullError> {
    let local = sd.join(name);
    let meta = sd.join(format!("{name}.header.json"));
    if let (true, Ok(b)) = (local.is_file(), std::fs::read(&meta)) {
        if let Ok(info) = serde_json::from_slice::<RemoteFile>(&b) {
            return Ok(info);
        }
    }
    let url = source.file_url(name);
    let (b8, info) = http.get_range(&url, 0, 8, None)?;
    let n = u64::from_le_bytes(b8.as_slice().try_into().unwrap_or([0xff; 8]));
    if n > 100 << 20 || 8 + n > info.size {
        return Err(PullError::Http {
            url,
            message: format!(
                "safetensors header length {n} does not fit in the file ({} bytes): not a safetensors file",
                info.size
            ),
        });
    }
    let (header, _) = http.get_range(&url, 8, n, Some(&info))?;
    let f = File::create(&local).map_err(io_err(&local))?;
    f.set_len(info.size).map_err(io_err(&local))?;
    f.write_all_at(&b8, 0).map_err(io_err(&local))?;
    f.write_all_at(&header, 8).map_err(io_err(&local))?;
    f.sync_all().map_err(io_err(&local))?;
    write_atomic(
        &meta,
        &serde_json::to_vec(&info).map_err(|e| PullError::Invalid(e.to_string()))?,
    )?;
    Ok(info)
}

/// Sorts ranges and merges those of one file closer than 64 KiB (fewer requests for a few
/// extra bytes).
fn merge(mut r: Vec<(String, u64, u64)>) -> Vec<(String, u64, u64)> {
    r.sort();
    let mut out: Vec<(String, u64, u64)> = Vec::new();
    for (f, s, l) in r {
        if let Some(last) = out.last_mut() {
            if last.0 == f && s <= last.1 + last.2 + (64 << 10) {
                let end = (last.1 + last.2).max(s + l);
                last.2 = end - last.1;
                continue;
            }
        }
        out.push((f, s, l));
    }
    out
}

/// Fetches `ranges` into the sparse local shards, `concurrency` at a time, skipping those
/// recorded in `ranges.done`; each range is recorded there once written and fsynced.
fn fetch_ranges(
    http: &Http,
    source: &Source,
    sd: &Path,
    files: &BTreeMap<String, RemoteFile>,
    ranges: Vec<(String, u64, u64)>,
    concurrency: usize,
    transfer: &dyn Transfer,
) -> Result<(), PullError> {
    let done_path = sd.join("ranges.done");
    let done: HashSet<String> = std::fs::read_to_string(&done_path)
        .unwrap_or_default()
        .lines()
        .map(str::to_string)
        .collect();
    let key = |r: &(String, u64, u64)| format!("{} {} {}", r.0, r.1, r.2);
    let todo: Vec<(String, u64, u64)> = ranges.into_iter().filter(|r| !done.contains(&key(r))).collect();
    let total: u64 = todo.iter().map(|r| r.2).sum();
    transfer.begin("backbone tensors", total, 0);
    let log = Mutex::new(
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&done_path)
            .map_err(io_err(&done_path))?,
    );
    let next = AtomicUsize::new(0);
    let first_err: Mutex<Option<PullError>> = Mutex::new(None);
    let work = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(r) = todo.get(i) else { return };
        if first_err.lock().map(|e| e.is_some()).unwrap_or(true) {
            return;
        }
        let res = (|| -> Result<(), PullError> {
            let (bytes, _) = http.get_range(&source.file_url(&r.0), r.1, r.2, files.get(&r.0))?;
            let p = sd.join(&r.0);
            let f = OpenOptions::new().write(true).open(&p).map_err(io_err(&p))?;
            f.write_all_at(&bytes, r.1).map_err(io_err(&p))?;
            f.sync_data().map_err(io_err(&p))?;
            let mut l = log
                .lock()
                .map_err(|_| PullError::Invalid("range log lock poisoned".into()))?;
            writeln!(l, "{}", key(r)).map_err(io_err(&done_path))?;
            l.sync_data().map_err(io_err(&done_path))?;
            transfer.advance(r.2);
            Ok(())
        })();
        if let Err(e) = res {
            if let Ok(mut g) = first_err.lock() {
                g.get_or_insert(e);
            }
            return;
        }
    };
    std::thread::scope(|s| {
        for _ in 0..crate::records::concurrency_or_default(concurrency) {
            s.spawn(work);
        }
    });
    match first_err.into_inner() {
        Ok(Some(e)) => Err(e),
        _ => Ok(()),
    }
}

/// The manifest of a deltafin model directory served at `source`, if it is one.
///
/// Errors: a `manifest.json` that is not a usable deltafin manifest (another format version, or
/// a streaming install, which cannot serve its missing records).
fn probe_mirror(http: &Http, source: &Source) -> Result<Option<Manifest>, PullError> {
    let url = source.file_url("manifest.json");
    let Some(b) = http.get_optional(&url)? else {
        return Ok(None);
    };
    let bad = |message: String| PullError::Http {
        url: url.clone(),
        message,
    };
    let m: Manifest =
        serde_json::from_slice(&b).map_err(|e| bad(format!("not a deltafin manifest this version reads: {e}")))?;
    if m.format != FORMAT_NAME || m.format_version != FORMAT_VERSION {
        return Err(bad(format!(
            "manifest format {:?} version {} (this deltafin reads {FORMAT_NAME:?} version {FORMAT_VERSION})",
            m.format, m.format_version
        )));
    }
    if m.stream.is_some() || m.experts.records.iter().any(|r| r.xxh3.is_empty()) {
        return Err(bad(
            "the source is a streaming install: serve a full install instead".into()
        ));
    }
    // The checks a manifest on disk gets at load (issue #19, item 4), before anything is
    // fetched or written: a hostile mirror's counts, sizes and ranges are one error line here,
    // not a huge allocation, a sparse file of any size or a panic later.
    deltafin_format::manifest_check::check_manifest_values(&m, Path::new(&url))?;
    deltafin_format::model_dir::check_manifest_names(&m).map_err(bad)?;
    deltafin_format::model_dir::check_manifest_layout(&m).map_err(bad)?;
    Ok(Some(m))
}

fn to_format(path: &Path) -> impl Fn(PullError) -> FormatError + '_ {
    move |e| match e {
        PullError::Format(f) => f,
        e => FormatError::Output {
            path: path.to_path_buf(),
            message: e.to_string(),
        },
    }
}

/// The start of both pulls from a deltafin mirror: refuses convert options
/// ([`refuse_convert_options_for_mirror`]), prepares the work directory
/// [`sibling`]`(model_dir, suffix)` for `source` ([`work_dir`]) and downloads the mirror's
/// tokenizer files into it; returns that directory.
///
/// Errors: `--backbone` / `--experts` given, a tokenizer file that is not a plain name or is
/// missing (HTTP 404), HTTP errors after retries, I/O.
fn mirror_work_dir(
    http: &Http,
    source: &Source,
    model_dir: &Path,
    m: &Manifest,
    opts: &PullOptions,
    suffix: &str,
) -> Result<PathBuf, PullError> {
    refuse_convert_options_for_mirror(opts, m)?;
    let dir = sibling(model_dir, suffix);
    work_dir(&dir, source)?;
    mirror_small_files(http, source, m, &dir)?;
    Ok(dir)
}

/// Downloads the mirror's tokenizer files into `dir`.
fn mirror_small_files(http: &Http, source: &Source, m: &Manifest, dir: &Path) -> Result<(), PullError> {
    for f in &m.tokenizer_files {
        if f.contains('/') || f.contains("..") {
            return Err(PullError::Invalid(format!(
                "mirror manifest names file {f:?}: not a plain file name"
            )));
        }
        let url = source.file_url(f);
        let b = http.get_optional(&url)?.ok_or_else(|| PullError::Http {
            url: url.clone(),
            message: "listed in the mirror's manifest but not found (HTTP 404)".into(),
        })?;
        write_atomic(&dir.join(f), &b)?;
    }
    Ok(())
}

/// Moves the downloaded files and writes `manifest` into a staging directory that becomes
/// `model_dir` (see `deltafin_format::staging`).
fn place(
    model_dir: &Path,
    force: bool,
    from: &Path,
    files: &[&str],
    manifest: &Manifest,
    extra: impl FnOnce(&Path) -> Result<(), PullError>,
) -> Result<(), PullError> {
    deltafin_format::staging::write_dir_atomically(model_dir, force, None, |tmp| {
        for f in files {
            let (a, b) = (from.join(f), tmp.join(f));
            std::fs::rename(&a, &b).map_err(|e| FormatError::Io {
                path: b.clone(),
                error: e,
            })?;
        }
        extra(tmp).map_err(to_format(tmp))?;
        deltafin_format::model_dir::write_manifest(tmp, manifest)
    })?;
    Ok(())
}

/// A mirror serves converted files: the storage choices of a convert do not apply to it.
fn refuse_convert_options_for_mirror(opts: &PullOptions, m: &Manifest) -> Result<(), PullError> {
    let b = opts.convert.backbone;
    let e = opts.convert.experts;
    if b != StoredDtype::Int8 || e != StoredDtype::Mxfp4 {
        return Err(PullError::Invalid(format!(
            "the source is a deltafin mirror (its files are already converted: backbone {}, experts {}): --backbone / --experts do not apply; leave them out",
            m.backbone.matrix_dtype.name(),
            m.experts.dtype.name()
        )));
    }
    Ok(())
}

/// Checks a mirror's downloaded `backbone.bin` at `path` against the tensor checksums of its
/// manifest; a file that fails is downloaded again, up to the HTTP retry limit. A mirror whose
/// manifest predates backbone checksums is accepted as is (its size was checked).
///
/// Errors: every download fails its checksums (naming the tensor), HTTP errors, I/O.
fn mirror_backbone(
    http: &Http,
    source: &Source,
    m: &Manifest,
    path: &Path,
    transfer: &dyn Transfer,
) -> Result<(), PullError> {
    let url = source.file_url(&m.backbone.file);
    let mut attempt = 1;
    loop {
        let bytes = std::fs::read(path).map_err(io_err(path))?;
        let check = deltafin_format::model_dir::BackboneCheck::of(&m.backbone.tensors, &bytes);
        let Some((name, why)) = check.failures.first() else {
            return Ok(());
        };
        if attempt >= http.max_attempts() {
            return Err(PullError::Http {
                url,
                message: format!("backbone tensor {name} keeps failing its checksum ({why}; {attempt} downloads)"),
            });
        }
        tracing::warn!("{url}: backbone tensor {name} failed its checksum: downloading the file again");
        std::fs::remove_file(path).map_err(io_err(path))?;
        http.download(&url, path, transfer)?;
        attempt += 1;
    }
}

/// [`pull_full`] from a mirror that serves the deltafin manifest `m`.
fn mirror_full(p: Pull<'_>, m: Manifest) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    let dl = mirror_work_dir(p.http, p.source, p.model_dir, &m, p.opts, "download")?;
    for f in [&m.backbone.file, &m.experts.file] {
        if f.contains('/') || f.contains("..") {
            return Err(PullError::Invalid(format!(
                "mirror manifest names file {f:?}: not a plain file name"
            )));
        }
        let dest = dl.join(f);
        if !dest.is_file() {
            p.http.download(&p.source.file_url(f), &dest, p.transfer)?;
        }
    }
    mirror_backbone(p.http, p.source, &m, &dl.join(&m.backbone.file), p.transfer)?;
    // Every record against the mirror's checksum; a corrupted one is fetched again by range.
    let pack_path = dl.join(&m.experts.file);
    let pack = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&pack_path)
        .map_err(io_err(&pack_path))?;
    p.progress.start(m.experts.bytes);
    let mut buf = Vec::new();
    for r in &m.experts.records {
        buf.resize(r.length as usize, 0);
        pack.read_exact_at(&mut buf, r.offset).map_err(io_err(&pack_path))?;
        let want = u64::from_str_radix(&r.xxh3, 16).unwrap_or(0);
        let mut attempt = 0;
        while xxhash_rust::xxh3::xxh3_64(&buf) != want {
            attempt += 1;
            let url = p.source.file_url(&m.experts.file);
            if attempt > p.http.max_attempts() {
                return Err(PullError::Http {
                    url,
                    message: format!(
                        "record of layer {}, expert {} keeps failing its checksum (xxh3 {})",
                        r.layer, r.expert, r.xxh3
                    ),
                });
            }
            tracing::warn!(
                "{url}: record of layer {} expert {} failed its checksum: fetching it again",
                r.layer,
                r.expert
            );
            buf = p.http.get_range(&url, r.offset, r.length, None)?.0;
            pack.write_all_at(&buf, r.offset).map_err(io_err(&pack_path))?;
        }
        p.progress.advance(r.length);
    }
    pack.sync_all().map_err(io_err(&pack_path))?;
    p.progress.finish();
    let mut files: Vec<&str> = m.tokenizer_files.iter().map(String::as_str).collect();
    files.push(&m.backbone.file);
    files.push(&m.experts.file);
    place(p.model_dir, p.opts.convert.force, &dl, &files, &m, |_| Ok(()))?;
    remove_download(&dl, p.opts)?;
    Ok(PullReport::finished("full", p.http, t0))
}

/// [`pull_stream`] from a mirror that serves the deltafin manifest `m`.
fn mirror_stream(p: Pull<'_>, m: Manifest) -> Result<PullReport, PullError> {
    let t0 = Instant::now();
    let sd = mirror_work_dir(p.http, p.source, p.model_dir, &m, p.opts, "stream-src")?;
    if m.backbone.file.contains('/') || m.experts.file.contains('/') {
        return Err(PullError::Invalid(
            "mirror manifest names a file that is not a plain name".into(),
        ));
    }
    let bb = sd.join(&m.backbone.file);
    if !bb.is_file() {
        p.http.download(&p.source.file_url(&m.backbone.file), &bb, p.transfer)?;
    }
    mirror_backbone(p.http, p.source, &m, &bb, p.transfer)?;
    let (_, pack_info) = p.http.get_range(&p.source.file_url(&m.experts.file), 0, 1, None)?;
    if pack_info.size < m.experts.bytes {
        return Err(PullError::Http {
            url: p.source.file_url(&m.experts.file),
            message: format!("{} bytes, the manifest says {}", pack_info.size, m.experts.bytes),
        });
    }
    let mut index = StreamIndex::new();
    index.mirror = true;
    index.files.insert(m.experts.file.clone(), pack_info);
    let mut local = m.clone();
    for r in &mut local.experts.records {
        index
            .record_xxh3
            .insert(format!("{}.{}", r.layer, r.expert), std::mem::take(&mut r.xxh3));
    }
    local.stream = Some(StreamSource {
        url: p.source.url.clone(),
        revision: p.source.revision.clone(),
        flat: p.source.flat,
        allow_network: p.opts.allow_network,
        index: STREAM_INDEX.into(),
    });
    let index_json = serde_json::to_vec(&index).map_err(|e| PullError::Invalid(e.to_string()))?;
    let mut files: Vec<&str> = m.tokenizer_files.iter().map(String::as_str).collect();
    files.push(&m.backbone.file);
    let pack_name = m.experts.file.clone();
    let pack_bytes = m.experts.bytes;
    place(p.model_dir, p.opts.convert.force, &sd, &files, &local, move |tmp| {
        let p = tmp.join(&pack_name);
        let f = File::create(&p).map_err(io_err(&p))?;
        f.set_len(pack_bytes).map_err(io_err(&p))?;
        f.sync_all().map_err(io_err(&p))?;
        write_atomic(&tmp.join(STREAM_INDEX), &index_json)
    })?;
    std::fs::remove_dir_all(&sd).map_err(io_err(&sd))?;
    Ok(PullReport::finished("stream", p.http, t0))
}
