//! `deltafin convert`: Hugging Face checkpoint directory → deltafin model directory.
//!
//! The output is built in a sibling directory `.<name>.partial` and renamed into place only after
//! every file (manifest last) is written and fsynced, so an interrupted convert never leaves a
//! directory that loads as a model, and re-running it starts clean.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::{BufWriter, Seek, Write};
use std::path::Path;

use rayon::prelude::*;
use serde_json::Value;

use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
use crate::arch::ModelConfig;
use crate::checkpoint::Checkpoint;
use crate::family::{ExpertSource, Select, TensorRole};
use crate::manifest::{
    matrix_dims, record_layout, BackboneIndex, ExpertPackIndex, ExpertRecord, ExpertTensorLayout, Manifest,
    StoredDtype, TensorRecord, COPIED_FILES,
};
use crate::{io_err, FormatError};

/// Conversion settings.
#[derive(Debug, Clone)]
pub struct ConvertOptions {
    /// Dtype of 2-D backbone matrices: `Int8` (default), `Bf16` or `F32`.
    pub backbone: StoredDtype,
    /// Dtype of routed experts: `Mxfp4` (default), `Bf16` or `F32`.
    pub experts: StoredDtype,
    /// Replace an existing model directory.
    pub force: bool,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            backbone: StoredDtype::Int8,
            experts: StoredDtype::Mxfp4,
            force: false,
        }
    }
}

/// Receives progress in source bytes processed.
pub trait Progress: Sync {
    fn start(&self, total_bytes: u64);
    fn advance(&self, bytes: u64);
    fn finish(&self);
}

/// A progress sink that ignores everything.
pub struct NoProgress;
impl Progress for NoProgress {
    fn start(&self, _: u64) {}
    fn advance(&self, _: u64) {}
    fn finish(&self) {}
}

/// What a conversion produced.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub backbone_bytes: u64,
    pub expert_pack_bytes: u64,
    pub expert_records: usize,
    /// Bytes of one expert record including alignment padding.
    pub record_stride: u64,
    /// Source tensors deliberately left out (MTP layers, non-text towers, rotary buffers).
    pub ignored_tensors: Vec<String>,
    /// Tokenizer and generation files copied from the source.
    pub tokenizer_files: Vec<String>,
}

/// One encoded expert: (expert id, record bytes padded to the stride, source bytes consumed).
type EncodedRecord = (usize, Vec<u8>, u64);

/// Reads one expert matrix `[rows, cols]` as f32 from its checkpoint source (a fused
/// `[n_experts, ..]` tensor's slice, transposed back when stored `[cols, rows]`).
fn read_expert_matrix(ck: &Checkpoint, src: &ExpertSource, rows: usize, cols: usize) -> Result<Vec<f32>, FormatError> {
    match src.select {
        Select::Whole => ck.read_f32(&src.tensor, &src.shape),
        Select::Expert { index, transposed } => {
            let w = ck.read_f32_slice(&src.tensor, &src.shape, index)?;
            if !transposed {
                return Ok(w);
            }
            // w: [cols, rows] → [rows, cols]
            let mut t = vec![0f32; w.len()];
            for (c, wrow) in w.chunks_exact(rows.max(1)).enumerate() {
                for (r, &x) in wrow.iter().enumerate() {
                    t[r * cols + c] = x;
                }
            }
            Ok(t)
        }
    }
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}

/// Encodes an f32 matrix `[rows, cols]` in a stored dtype: values then scales.
pub fn encode_matrix(dtype: StoredDtype, w: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    let vb = dtype.value_bytes(rows, cols);
    let sb = dtype.scale_bytes(rows, cols);
    let mut out = vec![0u8; vb + sb];
    match dtype {
        StoredDtype::F32 => {
            for (o, x) in out.chunks_exact_mut(4).zip(w) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        StoredDtype::Bf16 => {
            for (o, x) in out.chunks_exact_mut(2).zip(w) {
                o.copy_from_slice(&half::bf16::from_f32(*x).to_bits().to_le_bytes());
            }
        }
        StoredDtype::Int8 => {
            let mut q = vec![0i8; rows * cols];
            let mut s = vec![0f32; rows];
            deltafin_kernels::int8::quantize(w, rows, cols, &mut q, &mut s);
            out[..vb].copy_from_slice(bytemuck::cast_slice(&q));
            for (o, x) in out[vb..].chunks_exact_mut(4).zip(&s) {
                o.copy_from_slice(&x.to_le_bytes());
            }
        }
        StoredDtype::Mxfp4 => {
            let (v, s) = out.split_at_mut(vb);
            deltafin_kernels::mxfp4::quantize(w, rows, cols, v, s);
        }
    }
    out
}

/// Converts `hf_dir` into a deltafin model directory at `out_dir`.
///
/// Errors: anything wrong with the source (named file/tensor/field), an existing output without
/// `force`, or an I/O failure writing the output (including no space left), in which case the
/// partial output is removed.
pub fn convert(
    hf_dir: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
) -> Result<ConvertReport, FormatError> {
    if !matches!(opts.backbone, StoredDtype::Int8 | StoredDtype::Bf16 | StoredDtype::F32) {
        return Err(FormatError::Output {
            path: out_dir.into(),
            message: format!("--backbone {} is not supported (int8, bf16, f32)", opts.backbone.name()),
        });
    }
    if opts.experts == StoredDtype::Int8 {
        return Err(FormatError::Output {
            path: out_dir.into(),
            message: "--experts int8 is not supported (mxfp4, bf16, f32)".into(),
        });
    }
    let (mut cfg, raw) = ModelConfig::from_file(&hf_dir.join("config.json"))?;
    let ck = Checkpoint::open(hf_dir)?;
    cfg.adapt_to_checkpoint(|n| ck.entry(n).is_some());

    crate::staging::write_dir_atomically(out_dir, opts.force, Some(hf_dir), |tmp| {
        write_all(&ck, &cfg, raw, hf_dir, tmp, opts, progress, None)
    })
}

/// What a streaming install adds to a convert: the manifest's `stream` section and extra files
/// (name, bytes) written into the model directory before the manifest.
#[derive(Debug, Clone)]
pub struct StreamExtras {
    pub source: crate::manifest::StreamSource,
    pub files: Vec<(String, Vec<u8>)>,
}

/// Like [`convert`], but for a streaming install: `hf_dir` must hold every backbone tensor and
/// the headers of every shard (routed-expert tensor data is never read and may be a hole of a
/// sparse file). `experts.pack` is written as a sparse file of full size with the record offsets
/// of a full convert and empty checksums; the backbone, tokenizer files and layout are those of a
/// full convert.
///
/// Errors: as [`convert`].
pub fn convert_stream(
    hf_dir: &Path,
    out_dir: &Path,
    opts: &ConvertOptions,
    extras: &StreamExtras,
    progress: &dyn Progress,
) -> Result<ConvertReport, FormatError> {
    let (mut cfg, raw) = ModelConfig::from_file(&hf_dir.join("config.json"))?;
    let ck = Checkpoint::open(hf_dir)?;
    cfg.adapt_to_checkpoint(|n| ck.entry(n).is_some());
    crate::staging::write_dir_atomically(out_dir, opts.force, Some(hf_dir), |tmp| {
        write_all(&ck, &cfg, raw, hf_dir, tmp, opts, progress, Some(extras))
    })
}

/// Encodes one routed expert into its record of `padded_len` bytes: each matrix of `layout`
/// (gate_proj `[inter, hidden]`, up_proj `[inter, hidden]`, down_proj `[hidden, inter]`), read as
/// f32 by `read(name, rows, cols)`, encoded in its dtype at its offset; zeros elsewhere. For
/// plain (F32/BF16/F16) source tensors this is exactly what [`convert`] writes, so a streaming
/// install's on-demand records are byte-identical to a full convert's (the pull tests check it).
///
/// Errors: whatever `read` returns.
pub fn encode_expert_record(
    layout: &[ExpertTensorLayout],
    padded_len: usize,
    mut read: impl FnMut(&str, usize, usize) -> Result<Vec<f32>, FormatError>,
) -> Result<Vec<u8>, FormatError> {
    let mut rec = vec![0u8; padded_len];
    for lay in layout {
        let w = read(&lay.name, lay.rows, lay.cols)?;
        let b = encode_matrix(lay.dtype, &w, lay.rows, lay.cols);
        let at = lay.offset as usize;
        rec.get_mut(at..at + b.len())
            .ok_or_else(|| FormatError::Output {
                path: lay.name.clone().into(),
                message: format!("record of {padded_len} bytes is too short for its layout"),
            })?
            .copy_from_slice(&b);
    }
    Ok(rec)
}

/// Completeness check before writing anything: every tensor the model needs is present with the
/// right shape and a supported dtype, and every tensor present is either used or deliberately
/// ignored. Returns the names used and the names ignored.
///
/// Errors: a missing tensor, a shape or dtype mismatch, or an unexpected tensor (named, with its
/// shard).
fn check_complete(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    hf_dir: &Path,
) -> Result<(BTreeSet<String>, Vec<String>), FormatError> {
    let table = cfg.backbone_tensors();
    let mut needed: BTreeSet<String> = BTreeSet::new();
    let check = |name: &str, shape: &[usize]| -> Result<(), FormatError> {
        let e = ck.entry(name).ok_or_else(|| FormatError::MissingTensor {
            path: hf_dir.to_path_buf(),
            tensor: name.to_string(),
        })?;
        let path = ck.shard_path(e);
        if e.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: path.to_path_buf(),
                tensor: e.file_name.clone(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        crate::checkpoint::check_entry(path, e)
    };
    for t in &table {
        check(&t.name, &t.shape)?;
        needed.insert(t.name.clone());
    }
    let mats = cfg.expert_matrices();
    for l in cfg.moe_layers() {
        for e in 0..cfg.n_routed_experts() {
            for m in &mats {
                let src = cfg.expert_source(l, e, m);
                check(&src.tensor, &src.shape)?;
                needed.insert(src.tensor);
            }
        }
    }
    let mut ignored: Vec<String> = ck.skipped.clone();
    for n in ck.names() {
        if needed.contains(n) {
            continue;
        }
        if cfg.is_ignored(n) {
            ignored.push(n.to_string());
            continue;
        }
        let e = ck.entry(n).expect("name from the checkpoint");
        return Err(FormatError::UnexpectedTensor {
            path: ck.shard_path(e).to_path_buf(),
            tensor: e.file_name.clone(),
            family: cfg.model_type().to_string(),
        });
    }
    Ok((needed, ignored))
}

/// What `deltafin convert --dry-run` reports: the source checked completely, nothing written.
#[derive(Debug, Clone)]
pub struct ConvertPlan {
    pub config: ModelConfig,
    /// Resident tensors.
    pub backbone_tensors: usize,
    /// Routed-expert records the pack would hold.
    pub expert_records: usize,
    /// Source bytes that would be read.
    pub source_bytes: u64,
    /// Source tensors deliberately left out.
    pub ignored_tensors: Vec<String>,
}

/// Checks `hf_dir` as [`convert`] would (config, every safetensors header, completeness, shapes,
/// dtypes and quantization metadata) without reading weights or writing anything: a
/// multi-terabyte checkpoint can be validated from its headers alone.
///
/// Errors: as [`convert`]'s checks.
pub fn plan(hf_dir: &Path) -> Result<ConvertPlan, FormatError> {
    let (mut cfg, _) = ModelConfig::from_file(&hf_dir.join("config.json"))?;
    let ck = Checkpoint::open(hf_dir)?;
    cfg.adapt_to_checkpoint(|n| ck.entry(n).is_some());
    let (needed, ignored) = check_complete(&ck, &cfg, hf_dir)?;
    let moe = cfg.moe_layers().count();
    Ok(ConvertPlan {
        backbone_tensors: cfg.backbone_tensors().len(),
        expert_records: moe * cfg.n_routed_experts(),
        source_bytes: ck.bytes_where(|n| needed.contains(n)),
        ignored_tensors: ignored,
        config: cfg,
    })
}

#[allow(clippy::too_many_arguments)]
fn write_all(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    raw: Value,
    hf_dir: &Path,
    out: &Path,
    opts: &ConvertOptions,
    progress: &dyn Progress,
    stream: Option<&StreamExtras>,
) -> Result<ConvertReport, FormatError> {
    let (needed, ignored) = check_complete(ck, cfg, hf_dir)?;
    let table = cfg.backbone_tensors();
    let mats = cfg.expert_matrices();
    progress.start(ck.bytes_where(|n| needed.contains(n)));

    // Backbone.
    let bb_path = out.join("backbone.bin");
    let mut bb = BufWriter::with_capacity(8 << 20, File::create(&bb_path).map_err(io_err(&bb_path))?);
    let mut pos = 0u64;
    let mut tensors = std::collections::BTreeMap::new();
    for t in &table {
        let (n, shape) = (&t.name, &t.shape);
        let w = ck.read_f32(n, shape)?;
        let dtype = match t.role {
            TensorRole::F32 => StoredDtype::F32,
            TensorRole::Matrix => opts.backbone,
        };
        let (rows, cols) = matrix_dims(shape);
        let bytes = encode_matrix(dtype, &w, rows, cols);
        let off = align_up(pos, TENSOR_ALIGN);
        bb.write_all(&vec![0u8; (off - pos) as usize])
            .map_err(io_err(&bb_path))?;
        bb.write_all(&bytes).map_err(io_err(&bb_path))?;
        pos = off + bytes.len() as u64;
        let scales_offset = match dtype {
            StoredDtype::Int8 | StoredDtype::Mxfp4 => Some(off + dtype.value_bytes(rows, cols) as u64),
            _ => None,
        };
        tensors.insert(
            n.clone(),
            TensorRecord {
                dtype,
                shape: shape.clone(),
                offset: off,
                bytes: bytes.len() as u64,
                scales_offset,
                xxh3: crate::manifest::tensor_xxh3(&bytes),
            },
        );
        progress.advance(ck.entry(n).map(|e| e.len).unwrap_or(0));
    }
    let bb_file = bb.into_inner().map_err(|e| io_err(&bb_path)(e.into_error()))?;
    bb_file.sync_all().map_err(io_err(&bb_path))?;
    let backbone_bytes = pos;

    // Expert pack.
    let (layout, rec_len) = record_layout(&mats, opts.experts);
    let stride = align_up(rec_len, RECORD_ALIGN);
    let ep_path = out.join("experts.pack");
    let mut ep = File::create(&ep_path).map_err(io_err(&ep_path))?;
    let mut records = Vec::new();
    let mut offset = 0u64;
    let moe_layers: Vec<usize> = cfg.moe_layers().collect();
    // Encode a few experts in parallel, write them in order.
    let batch = rayon::current_num_threads().max(1) * 2;
    if stream.is_some() {
        // Streaming install: records start absent (holes); the journal will carry checksums.
        for &l in &moe_layers {
            for e in 0..cfg.n_routed_experts() {
                records.push(ExpertRecord {
                    layer: l as u32,
                    expert: e as u32,
                    offset,
                    length: rec_len,
                    xxh3: String::new(),
                });
                offset += stride;
                let src: u64 = mats
                    .iter()
                    .map(|m| ck.entry(&cfg.expert_source(l, e, m).tensor).map_or(0, |x| x.len))
                    .sum();
                progress.advance(src);
            }
        }
        ep.set_len(offset).map_err(io_err(&ep_path))?;
        ep.seek(std::io::SeekFrom::End(0)).map_err(io_err(&ep_path))?;
    }
    for &l in moe_layers.iter().filter(|_| stream.is_none()) {
        let experts: Vec<usize> = (0..cfg.n_routed_experts()).collect();
        for chunk in experts.chunks(batch) {
            let encoded: Vec<Result<EncodedRecord, FormatError>> = chunk
                .par_iter()
                .map(|&e| {
                    let mut rec = vec![0u8; stride as usize];
                    let mut src = 0u64;
                    for (lay, m) in layout.iter().zip(&mats) {
                        let source = cfg.expert_source(l, e, m);
                        // MXFP4 sources are copied bit for bit into MXFP4 records (no
                        // re-quantization: those bytes are the trained values).
                        let copied = match (lay.dtype, source.select) {
                            (StoredDtype::Mxfp4, Select::Whole) => {
                                ck.read_mxfp4_record(&source.tensor, &source.shape, None)?
                            }
                            (
                                StoredDtype::Mxfp4,
                                Select::Expert {
                                    index,
                                    transposed: false,
                                },
                            ) => ck.read_mxfp4_record(&source.tensor, &source.shape, Some(index))?,
                            _ => None,
                        };
                        let b = match copied {
                            Some(b) => b,
                            None => {
                                let w = read_expert_matrix(ck, &source, lay.rows, lay.cols)?;
                                encode_matrix(lay.dtype, &w, lay.rows, lay.cols)
                            }
                        };
                        rec[lay.offset as usize..lay.offset as usize + b.len()].copy_from_slice(&b);
                        // Progress in source bytes: this matrix's share of its tensor.
                        let total: usize = source.shape.iter().product();
                        let len = ck.entry(&source.tensor).map(|x| x.len).unwrap_or(0);
                        src += len * (lay.rows * lay.cols) as u64 / total.max(1) as u64;
                    }
                    Ok((e, rec, src))
                })
                .collect();
            for r in encoded {
                let (e, rec, src) = r?;
                let hash = xxhash_rust::xxh3::xxh3_64(&rec[..rec_len as usize]);
                ep.write_all(&rec).map_err(io_err(&ep_path))?;
                records.push(ExpertRecord {
                    layer: l as u32,
                    expert: e as u32,
                    offset,
                    length: rec_len,
                    xxh3: format!("{hash:016x}"),
                });
                offset += stride;
                progress.advance(src);
            }
        }
    }
    ep.sync_all().map_err(io_err(&ep_path))?;
    debug_assert_eq!(ep.stream_position().unwrap_or(offset), offset);

    for (name, bytes) in stream.map(|s| s.files.as_slice()).unwrap_or_default() {
        let dst = out.join(name);
        std::fs::write(&dst, bytes).map_err(io_err(&dst))?;
        File::open(&dst).and_then(|x| x.sync_all()).map_err(io_err(&dst))?;
    }

    // Tokenizer and generation files.
    let mut copied = Vec::new();
    for f in COPIED_FILES {
        let src = hf_dir.join(f);
        // A FIFO or device in place of a tokenizer file is an error naming it, not a file
        // silently left out (nor a hang).
        let mut from = match deltafin_fs::open_regular(&src) {
            Ok(from) => from,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(io_err(&src)(e)),
        };
        let dst = out.join(f);
        let mut to = File::create(&dst).map_err(io_err(&dst))?;
        std::io::copy(&mut from, &mut to).map_err(io_err(&dst))?;
        to.sync_all().map_err(io_err(&dst))?;
        copied.push(f.to_string());
    }

    let manifest = Manifest::new(
        cfg,
        raw,
        BackboneIndex::new(backbone_bytes, opts.backbone, tensors),
        ExpertPackIndex::new(offset, opts.experts, layout, records),
        copied,
        stream.map(|x| x.source.clone()),
    );
    crate::manifest::write_manifest(out, &manifest)?;
    progress.finish();
    Ok(ConvertReport {
        backbone_bytes,
        expert_pack_bytes: offset,
        expert_records: manifest.experts.records.len(),
        record_stride: stride,
        ignored_tensors: ignored,
        tokenizer_files: manifest.tokenizer_files.clone(),
    })
}
