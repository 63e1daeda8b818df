//! Reading a Hugging Face checkpoint's safetensors files: one `*.safetensors`, or shards named by
//! `model.safetensors.index.json`.
//!
//! Every file's header is validated by the `safetensors` crate (header length within the file,
//! offsets contiguous and in range, byte size = product(shape) × dtype size) before any tensor is
//! read. Tensor bytes are then read with positioned reads rather than through a memory map, so a
//! file truncated or replaced while we run yields an I/O error, never a SIGBUS.
//!
//! Quantized sources are presented under the plain name of the weight they encode, with
//! [`TensorEntry::encoding`] saying how, and read by [`Checkpoint::read_f32`] through the exact
//! decoders of [`crate::source_dtypes`]:
//! - DeepSeek / Kimi K2 block FP8: `W` (F8_E4M3) + `W_scale_inv` → `W`;
//! - compressed-tensors `pack-quantized`: `M.weight_packed` (I32) + `M.weight_scale` +
//!   `M.weight_shape` → `M.weight`;
//! - compressed-tensors `mxfp4-pack-quantized`: `M.weight_packed` (U8) + `M.weight_scale` (E8M0)
//!   [+ `M.weight_shape`] → `M.weight`;
//! - gpt-oss MXFP4: `X_blocks` + `X_scales` → `X` (`[.., rows, 32·G]`).
//!
//! The auxiliary tensors are consumed: [`Checkpoint::names`] does not list them (they are in
//! [`TensorEntry::aux_file_names`] of the weight they belong to), so a completeness check over
//! `names()` treats them as used.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use serde_json::Value;

use crate::quantization::{CtGroup, SourceQuantization};
use crate::source_dtypes::{self, Mxfp4Source, ScaleDtype};
use crate::{io_err, FormatError};

/// Name prefixes of non-text towers in multimodal checkpoints (Kimi K2.5 etc.): skipped.
const IGNORED_PREFIXES: &[&str] = &[
    "vision_tower.",
    "mm_projector.",
    "multi_modal_projector.",
    "vision_model.",
];

/// Where one tensor lives.
///
/// For a quantized weight (`encoding` other than [`Encoding::Plain`]) `file_name`, `shard`,
/// `dtype`, `offset` and `len` describe its main stored part (the FP8 values, `weight_packed`,
/// `X_blocks`) and `shape` is the shape of the decoded weight.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Name as written in the file.
    pub file_name: String,
    pub shard: usize,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte offset in the shard file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
    /// How the values are stored.
    pub encoding: Encoding,
}

/// How a checkpoint tensor's values are stored (decoders in [`crate::source_dtypes`]).
#[derive(Debug, Clone, Default)]
pub enum Encoding {
    /// As they are: F32, BF16 and F16 are read; other dtypes are rejected by
    /// [`check_dtype`] with the reason.
    #[default]
    Plain,
    /// DeepSeek block FP8 `[DS_FP8_BLOCK]`: F8_E4M3 values `[rows, cols]` times `scale_inv`
    /// (F32 or BF16, `[ceil(rows/block[0]), ceil(cols/block[1])]`).
    BlockFp8 {
        scale_inv: Box<TensorEntry>,
        block: [usize; 2],
    },
    /// compressed-tensors `pack-quantized` `[CT_PACK_INT32]`: I32 words
    /// `[rows, ceil(cols·num_bits/32)]`, `scale` `[rows, ceil(cols/group)]` (BF16, F16 or F32),
    /// `shape_tensor` (`weight_shape`, I32/I64 `[2]`) holding `[rows, cols]`.
    PackQuantized {
        packed_shape: Vec<usize>,
        scale: Box<TensorEntry>,
        shape_tensor: Box<TensorEntry>,
        num_bits: u32,
        /// `None`: the `channel` strategy (one scale per row).
        group_size: Option<usize>,
    },
    /// MXFP4 `[GPTOSS_MXFP4]` `[CT_MXFP4]`: U8 E2M1 pairs and E8M0 `scales`
    /// `[.., rows, ceil(cols/32)]`; `shape_tensor` is compressed-tensors' optional `weight_shape`.
    Mxfp4 {
        source: Mxfp4Source,
        packed_shape: Vec<usize>,
        scales: Box<TensorEntry>,
        shape_tensor: Option<Box<TensorEntry>>,
    },
}

impl TensorEntry {
    /// File names of the auxiliary tensors this weight consumes (scales, shape), in file order.
    pub fn aux_file_names(&self) -> Vec<&str> {
        match &self.encoding {
            Encoding::Plain => Vec::new(),
            Encoding::BlockFp8 { scale_inv, .. } => vec![scale_inv.file_name.as_str()],
            Encoding::PackQuantized {
                scale, shape_tensor, ..
            } => vec![scale.file_name.as_str(), shape_tensor.file_name.as_str()],
            Encoding::Mxfp4 {
                scales, shape_tensor, ..
            } => std::iter::once(scales.file_name.as_str())
                .chain(shape_tensor.iter().map(|t| t.file_name.as_str()))
                .collect(),
        }
    }

    /// Bytes of the main part and every auxiliary part.
    pub fn source_bytes(&self) -> u64 {
        self.len
            + match &self.encoding {
                Encoding::Plain => 0,
                Encoding::BlockFp8 { scale_inv, .. } => scale_inv.len,
                Encoding::PackQuantized {
                    scale, shape_tensor, ..
                } => scale.len + shape_tensor.len,
                Encoding::Mxfp4 {
                    scales, shape_tensor, ..
                } => scales.len + shape_tensor.as_ref().map_or(0, |t| t.len),
            }
    }
}

struct Shard {
    path: PathBuf,
    file: File,
}

/// An opened checkpoint: every tensor of every shard, keyed by its name with any
/// `language_model.` prefix removed (`model.layers.0.self_attn.q_a_proj.weight`, `lm_head.weight`).
pub struct Checkpoint {
    shards: Vec<Shard>,
    tensors: BTreeMap<String, TensorEntry>,
    /// Names skipped because they belong to a non-text tower.
    pub skipped: Vec<String>,
}

impl Checkpoint {
    /// Opens the safetensors files of a checkpoint directory and validates their headers.
    ///
    /// Quantized weights are grouped with their auxiliary tensors (see the module docs), using
    /// `quantization_config` of `dir/config.json` when one is needed.
    ///
    /// Errors: no safetensors file, a shard named by the index that is missing, a malformed or
    /// truncated file (named), the same tensor in two files, or an index entry pointing at a file
    /// that does not hold that tensor; for quantized weights: a missing part (`weight_scale`,
    /// `weight_shape`), a part of the wrong dtype or shape, a missing or unsupported
    /// `quantization_config`, or a module that config leaves unquantized (`ignore`) or targets
    /// with no group.
    pub fn open(dir: &Path) -> Result<Self, FormatError> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut weight_map: Option<HashMap<String, String>> = None;
        let files: Vec<String> = if index_path.exists() {
            let text = deltafin_fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
            let v: Value = serde_json::from_str(&text).map_err(|e| FormatError::Json {
                path: index_path.clone(),
                message: e.to_string(),
            })?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| FormatError::Config {
                    path: index_path.clone(),
                    field: "weight_map".into(),
                    message: "missing or not an object".into(),
                })?;
            let mut wm = HashMap::new();
            let mut files: Vec<String> = Vec::new();
            for (name, file) in map {
                let f = file.as_str().ok_or_else(|| FormatError::Config {
                    path: index_path.clone(),
                    field: format!("weight_map.{name}"),
                    message: "expected a file name".into(),
                })?;
                if f.contains('/') || f.contains("..") {
                    return Err(FormatError::Config {
                        path: index_path.clone(),
                        field: format!("weight_map.{name}"),
                        message: format!("file name {f:?} must be a plain file in the checkpoint directory"),
                    });
                }
                if !files.iter().any(|x| x == f) {
                    files.push(f.to_string());
                }
                wm.insert(name.clone(), f.to_string());
            }
            files.sort();
            weight_map = Some(wm);
            files
        } else {
            let mut files: Vec<String> = std::fs::read_dir(dir)
                .map_err(io_err(dir))?
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            files.sort();
            files
        };
        if files.is_empty() {
            let message = if dir.join("manifest.json").is_file() {
                "this is a deltafin model directory (manifest.json), not a Hugging Face checkpoint: it is \
                 converted already"
            } else {
                "no *.safetensors file (and no model.safetensors.index.json)"
            };
            return Err(FormatError::Checkpoint {
                path: dir.to_path_buf(),
                message: message.into(),
            });
        }
        let mut shards = Vec::new();
        let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
        let mut skipped = Vec::new();
        for (si, fname) in files.iter().enumerate() {
            let path = dir.join(fname);
            let file = deltafin_fs::open_regular(&path).map_err(io_err(&path))?;
            let entries = read_header(&path, &file)?;
            for mut e in entries {
                e.shard = si;
                if let Some(wm) = &weight_map {
                    if let Some(f) = wm.get(&e.file_name) {
                        if f != fname {
                            return Err(FormatError::Checkpoint {
                                path: index_path.clone(),
                                message: format!("tensor {} is indexed in {f} but found in {fname}", e.file_name),
                            });
                        }
                    }
                }
                if IGNORED_PREFIXES.iter().any(|p| e.file_name.starts_with(p)) {
                    skipped.push(e.file_name.clone());
                    continue;
                }
                let key = e
                    .file_name
                    .strip_prefix("language_model.")
                    .unwrap_or(&e.file_name)
                    .to_string();
                if let Some(prev) = tensors.get(&key) {
                    return Err(FormatError::Checkpoint {
                        path: path.clone(),
                        message: format!("tensor {key} also appears in {}", files[prev.shard]),
                    });
                }
                tensors.insert(key, e);
            }
            shards.push(Shard { path, file });
        }
        if let Some(wm) = &weight_map {
            for (name, f) in wm {
                let key = name.strip_prefix("language_model.").unwrap_or(name);
                if !tensors.contains_key(key) && !skipped.contains(name) {
                    return Err(FormatError::Checkpoint {
                        path: dir.join(f),
                        message: format!("tensor {name} listed in model.safetensors.index.json is not in this file"),
                    });
                }
            }
        }
        let tensors = resolve_quantized(tensors, &shards, dir)?;
        Ok(Checkpoint {
            shards,
            tensors,
            skipped,
        })
    }

    /// All tensor names (prefix removed), sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(|s| s.as_str())
    }

    /// Metadata of one tensor, if present.
    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The file holding a tensor.
    pub fn shard_path(&self, e: &TensorEntry) -> &Path {
        &self.shards[e.shard].path
    }

    /// Total bytes of the tensors whose names satisfy `pred`.
    pub fn bytes_where(&self, pred: impl Fn(&str) -> bool) -> u64 {
        self.tensors.iter().filter(|(k, _)| pred(k)).map(|(_, e)| e.len).sum()
    }

    /// Reads a tensor as f32 (row-major), checking its shape; quantized weights are decoded
    /// exactly (see [`Encoding`] and [`crate::source_dtypes`]).
    ///
    /// Errors: missing tensor, shape mismatch, a plain dtype other than F32/BF16/F16 (FP8
    /// without its scale and packed integers outside a known format are named as such), or a
    /// read error.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, FormatError> {
        let e = self.checked_entry(name, shape)?;
        self.decode(e)
    }

    /// Reads slice `index` along dimension 0 of a tensor fused over the experts (`shape` =
    /// `[n, ..]`, gpt-oss), as f32 `shape[1..]` row-major, reading only that slice's bytes.
    ///
    /// Errors: as [`Self::read_f32`], an index out of range, or an encoding that cannot be
    /// sliced (only plain tensors and gpt-oss MXFP4 blocks can).
    pub fn read_f32_slice(&self, name: &str, shape: &[usize], index: usize) -> Result<Vec<f32>, FormatError> {
        let e = self.checked_entry(name, shape)?;
        let sub = self.slice_entry(e, index)?;
        self.decode(&sub)
    }

    fn missing(&self, name: &str) -> FormatError {
        FormatError::MissingTensor {
            tensor: name.to_string(),
            path: self
                .shards
                .first()
                .map(|s| s.path.parent().unwrap_or(Path::new(".")).to_path_buf())
                .unwrap_or_default(),
        }
    }

    /// The entry of `name`, checked to have `shape`.
    fn checked_entry(&self, name: &str, shape: &[usize]) -> Result<&TensorEntry, FormatError> {
        let e = self.tensors.get(name).ok_or_else(|| self.missing(name))?;
        if e.shape != shape {
            return Err(FormatError::ShapeMismatch {
                path: self.shards[e.shard].path.clone(),
                tensor: e.file_name.clone(),
                expected: shape.to_vec(),
                found: e.shape.clone(),
            });
        }
        Ok(e)
    }

    /// Slice `index` along dimension 0 of `e` as an entry of its own (offsets and lengths of
    /// every stored part narrowed to the slice; dimension 0 dropped from the shapes).
    fn slice_entry(&self, e: &TensorEntry, index: usize) -> Result<TensorEntry, FormatError> {
        let bad = |m: String| FormatError::Checkpoint {
            path: self.shards[e.shard].path.clone(),
            message: format!("tensor {}: {m}", e.file_name),
        };
        let n = e.shape.first().copied().unwrap_or(0);
        if e.shape.len() < 2 || index >= n {
            return Err(bad(format!(
                "no slice {index} along dimension 0 of shape {:?}",
                e.shape
            )));
        }
        let part = |p: &TensorEntry| -> Result<TensorEntry, FormatError> {
            if !p.len.is_multiple_of(n as u64) {
                return Err(bad(format!("{} bytes do not split into {n} slices", p.len)));
            }
            let len = p.len / n as u64;
            Ok(TensorEntry {
                shape: p.shape.get(1..).map(<[usize]>::to_vec).unwrap_or_default(),
                offset: p.offset + index as u64 * len,
                len,
                encoding: Encoding::Plain,
                ..p.clone()
            })
        };
        let mut sub = part(e)?;
        sub.shape = e.shape[1..].to_vec();
        sub.encoding = match &e.encoding {
            Encoding::Plain => Encoding::Plain,
            Encoding::Mxfp4 {
                source: source @ Mxfp4Source::GptOssBlocks,
                packed_shape,
                scales,
                shape_tensor: None,
            } => Encoding::Mxfp4 {
                source: *source,
                packed_shape: packed_shape[1..].to_vec(),
                scales: Box::new(part(scales)?),
                shape_tensor: None,
            },
            _ => return Err(bad("only plain and gpt-oss MXFP4 tensors can be read per expert".into())),
        };
        Ok(sub)
    }

    /// Decodes an entry (whole tensor or slice) to f32.
    fn decode(&self, e: &TensorEntry) -> Result<Vec<f32>, FormatError> {
        let path = &self.shards[e.shard].path;
        check_entry(path, e)?;
        let cols = e.shape.last().copied().unwrap_or(1);
        let rows = e.shape.iter().product::<usize>() / cols.max(1);
        let decoded = match &e.encoding {
            Encoding::Plain => Ok(floats(&read_bytes(&self.shards, e)?, e.dtype)),
            Encoding::BlockFp8 { scale_inv, block } => {
                let s = floats(&read_bytes(&self.shards, scale_inv)?, scale_inv.dtype);
                source_dtypes::dequant_block_fp8(&read_bytes(&self.shards, e)?, rows, cols, &s, *block)
            }
            Encoding::PackQuantized {
                scale,
                num_bits,
                group_size,
                ..
            } => {
                let words: Vec<u32> = read_bytes(&self.shards, e)?
                    .chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect();
                let s = floats(&read_bytes(&self.shards, scale)?, scale.dtype);
                let sd = match scale.dtype {
                    Dtype::BF16 => ScaleDtype::Bf16,
                    Dtype::F16 => ScaleDtype::F16,
                    _ => ScaleDtype::F32,
                };
                source_dtypes::dequant_pack_quantized(&words, rows, cols, *num_bits, *group_size, &s, sd)
            }
            Encoding::Mxfp4 { source, scales, .. } => source_dtypes::dequant_mxfp4(
                *source,
                &read_bytes(&self.shards, e)?,
                &read_bytes(&self.shards, scales)?,
                rows,
                cols,
            ),
        };
        let w = decoded.map_err(|err| FormatError::Checkpoint {
            path: path.clone(),
            message: format!("tensor {}: {err}", e.file_name),
        })?;
        // A NaN or infinity in a weight makes every output NaN downstream: refuse it here, named.
        if let Some(i) = w.iter().position(|x| !x.is_finite()) {
            return Err(FormatError::Checkpoint {
                path: path.clone(),
                message: format!(
                    "tensor {}: value {} at flat index {i} is not finite (NaN or infinity): the checkpoint is damaged",
                    e.file_name, w[i]
                ),
            });
        }
        Ok(w)
    }
}

impl Checkpoint {
    /// The deltafin MXFP4 bytes (values then scales, [`crate::source_dtypes::mxfp4_record`]) of
    /// a `[rows, cols]` weight stored as MXFP4 in the checkpoint, copied bit for bit: those
    /// codes and scales are the trained values, so converting them never re-quantizes. `None`
    /// when the tensor is not MXFP4-encoded (or is a stacked gpt-oss tensor of another shape).
    ///
    /// Errors: missing tensor, a read error, or parts whose sizes do not match the shape.
    ///
    /// With `index`, the weight is slice `index` along dimension 0 of a tensor fused over the
    /// experts (`shape` `[n, rows, cols]`, gpt-oss), and only that slice is read.
    pub fn read_mxfp4_record(
        &self,
        name: &str,
        shape: &[usize],
        index: Option<usize>,
    ) -> Result<Option<Vec<u8>>, FormatError> {
        let whole = self.tensors.get(name).ok_or_else(|| self.missing(name))?;
        if !matches!(whole.encoding, Encoding::Mxfp4 { .. }) || whole.shape != shape {
            return Ok(None);
        }
        let sliced;
        let e = match index {
            Some(i) => {
                sliced = self.slice_entry(whole, i)?;
                &sliced
            }
            None => whole,
        };
        let Encoding::Mxfp4 { source, scales, .. } = &e.encoding else {
            return Ok(None);
        };
        let shape = &e.shape;
        if shape.len() != 2 {
            return Ok(None);
        }
        let path = &self.shards[e.shard].path;
        source_dtypes::mxfp4_record(
            *source,
            &read_bytes(&self.shards, e)?,
            &read_bytes(&self.shards, scales)?,
            shape[0],
            shape[1],
        )
        .map(Some)
        .map_err(|err| FormatError::Checkpoint {
            path: path.clone(),
            message: format!("tensor {}: {err}", e.file_name),
        })
    }
}

/// Reads a tensor's bytes.
fn read_bytes(shards: &[Shard], e: &TensorEntry) -> Result<Vec<u8>, FormatError> {
    let mut bytes = vec![0u8; e.len as usize];
    let shard = &shards[e.shard];
    shard
        .file
        .read_exact_at(&mut bytes, e.offset)
        .map_err(io_err(&shard.path))?;
    Ok(bytes)
}

/// Little-endian F32 / BF16 / F16 bytes as f32 (exact widening); other dtypes yield nothing
/// (callers check the dtype first).
/// Decodes little-endian tensor bytes of a plain dtype accepted by [`check_dtype`] (F32, BF16,
/// F16) to f32; other dtypes give an empty vector (callers check the dtype first).
pub fn decode_f32(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
    floats(bytes, dtype)
}

fn floats(bytes: &[u8], dtype: Dtype) -> Vec<f32> {
    match dtype {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect(),
        _ => Vec::new(),
    }
}

/// Accepts a tensor [`Checkpoint::read_f32`] can read: a quantized weight (its parts were
/// validated when the checkpoint was opened) or a plain tensor of a supported dtype
/// ([`check_dtype`]).
pub fn check_entry(path: &Path, e: &TensorEntry) -> Result<(), FormatError> {
    match e.encoding {
        Encoding::Plain => check_dtype(path, &e.file_name, e.dtype),
        _ => Ok(()),
    }
}

/// Accepts the plain (unquantized) source dtypes; names the others with the reason.
pub fn check_dtype(path: &Path, tensor: &str, dtype: Dtype) -> Result<(), FormatError> {
    let why = match dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => return Ok(()),
        Dtype::F8_E4M3 => format!(
            "an FP8 weight needs its block scales {tensor}_scale_inv (DeepSeek block FP8), which this checkpoint lacks"
        ),
        Dtype::F8_E5M2 => "FP8 E5M2 source weights are not supported (block FP8 is E4M3)".to_string(),
        Dtype::I32 | Dtype::U8 | Dtype::I8 | Dtype::U32 => "packed integers outside a recognized quantized format \
             (compressed-tensors weight_packed + weight_scale [+ weight_shape], gpt-oss _blocks + _scales)"
            .to_string(),
        _ => "unsupported dtype (supported: F32, BF16, F16, and the quantized formats of source_dtypes)".to_string(),
    };
    Err(FormatError::UnsupportedDtype {
        path: path.to_path_buf(),
        tensor: tensor.to_string(),
        dtype: format!("{dtype:?}"),
        message: why,
    })
}

/// Suffix of DeepSeek block-FP8 scales.
const SCALE_INV: &str = "_scale_inv";

/// Groups quantized weights with their auxiliary tensors (module docs); the auxiliary names leave
/// the map. `quantization_config` is read from `dir/config.json` only if a quantized weight needs it.
fn resolve_quantized(
    mut tensors: BTreeMap<String, TensorEntry>,
    shards: &[Shard],
    dir: &Path,
) -> Result<BTreeMap<String, TensorEntry>, FormatError> {
    let mut quant: Option<Option<SourceQuantization>> = None;
    let cfg_path = dir.join("config.json");
    let mut quant_config = || -> Result<Option<SourceQuantization>, FormatError> {
        if quant.is_none() {
            let q = match deltafin_fs::read_to_string(&cfg_path) {
                Ok(text) => {
                    let raw: Value = serde_json::from_str(&text).map_err(|e| FormatError::Json {
                        path: cfg_path.clone(),
                        message: e.to_string(),
                    })?;
                    SourceQuantization::from_config(&raw, &cfg_path)?
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(io_err(&cfg_path)(e)),
            };
            quant = Some(q);
        }
        Ok(quant.clone().flatten())
    };
    let bad = |e: &TensorEntry, message: String| FormatError::Checkpoint {
        path: shards[e.shard].path.clone(),
        message: format!("tensor {}: {message}", e.file_name),
    };
    let keys: Vec<String> = tensors.keys().cloned().collect();

    // DeepSeek block FP8: `W` + `W_scale_inv`.
    for k in keys.iter().filter(|k| k.ends_with(SCALE_INV)) {
        let base = &k[..k.len() - SCALE_INV.len()];
        if tensors.get(base).is_none_or(|w| w.dtype != Dtype::F8_E4M3) {
            continue;
        }
        let block = match quant_config()? {
            Some(SourceQuantization::BlockFp8 { block }) => block,
            _ => {
                return Err(FormatError::Config {
                    path: cfg_path.clone(),
                    field: "quantization_config.weight_block_size".into(),
                    message: format!("missing (quant_method \"fp8\"): needed to read the block FP8 weight {base}"),
                })
            }
        };
        let scale = tensors.remove(k).expect("key listed above");
        let w = tensors.get_mut(base).expect("checked above");
        if w.shape.len() != 2 {
            return Err(bad(
                w,
                format!("block FP8 weight of shape {:?}: expected 2 dimensions", w.shape),
            ));
        }
        let want = vec![w.shape[0].div_ceil(block[0]), w.shape[1].div_ceil(block[1])];
        if !matches!(scale.dtype, Dtype::F32 | Dtype::BF16) || scale.shape != want {
            return Err(bad(
                &scale,
                format!(
                    "{:?} {:?}: expected F32 or BF16 {want:?} (one scale per {block:?} block of {} {:?})",
                    scale.dtype, scale.shape, w.file_name, w.shape
                ),
            ));
        }
        w.encoding = Encoding::BlockFp8 {
            scale_inv: Box::new(scale),
            block,
        };
    }

    // compressed-tensors: `M.weight_packed` + `M.weight_scale` [+ `M.weight_shape`].
    for k in keys.iter().filter(|k| k.ends_with(".weight_packed")) {
        let module = &k[..k.len() - ".weight_packed".len()];
        let packed = tensors.remove(k).expect("key listed above");
        let scale = tensors
            .remove(&format!("{module}.weight_scale"))
            .ok_or_else(|| bad(&packed, format!("has no {module}.weight_scale")))?;
        let shape_t = tensors.remove(&format!("{module}.weight_shape"));
        let target = format!("{module}.weight");
        if let Some(plain) = tensors.get(&target) {
            return Err(bad(plain, format!("also stored quantized as {}", packed.file_name)));
        }
        let ct = match quant_config()? {
            Some(SourceQuantization::CompressedTensors(c)) => c,
            _ => {
                return Err(FormatError::Config {
                    path: cfg_path.clone(),
                    field: "quantization_config".into(),
                    message: format!(
                        "quant_method \"compressed-tensors\" is needed to read {} (missing or another method)",
                        packed.file_name
                    ),
                })
            }
        };
        let file_module = packed.file_name.strip_suffix(".weight_packed").unwrap_or(module);
        let group: &CtGroup = ct.group_for(&[file_module, module]).map_err(|m| bad(&packed, m))?;
        let w = &group.weights;
        let scheme = |m: &str| bad(&packed, format!("config_groups.{} ({}): {m}", group.name, group.format));
        let encoding;
        let shape;
        match (group.format.as_str(), packed.dtype) {
            ("pack-quantized", Dtype::I32) => {
                if w.kind != "int" || !matches!(w.num_bits, 4 | 8) {
                    return Err(scheme(&format!(
                        "{} bits of type {}: int4 and int8 are supported",
                        w.num_bits, w.kind
                    )));
                }
                if !w.symmetric {
                    return Err(scheme("asymmetric weights (weight_zero_point) are not supported"));
                }
                let group_size = match (w.strategy.as_str(), w.group_size) {
                    ("group", Some(g)) if g > 0 => Some(g),
                    ("channel", _) => None,
                    (s, g) => {
                        return Err(scheme(&format!(
                            "strategy {s:?} with group_size {g:?} is not supported"
                        )))
                    }
                };
                let st = shape_t.ok_or_else(|| bad(&packed, format!("has no {module}.weight_shape")))?;
                let dims = read_shape_tensor(shards, &st).map_err(|m| bad(&st, m))?;
                let (rows, cols) = (dims[0], dims[1]);
                let want_packed = vec![rows, source_dtypes::packed_int32_row_words(cols, w.num_bits)];
                if packed.shape != want_packed {
                    return Err(bad(
                        &packed,
                        format!(
                            "shape {:?}, expected {want_packed:?} for weight_shape {dims:?}",
                            packed.shape
                        ),
                    ));
                }
                let want_scale = vec![rows, cols.div_ceil(group_size.unwrap_or(cols.max(1)))];
                if !matches!(scale.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) || scale.shape != want_scale {
                    return Err(bad(
                        &scale,
                        format!(
                            "{:?} {:?}: expected BF16, F16 or F32 {want_scale:?}",
                            scale.dtype, scale.shape
                        ),
                    ));
                }
                shape = dims;
                encoding = Encoding::PackQuantized {
                    packed_shape: packed.shape.clone(),
                    scale: Box::new(scale),
                    shape_tensor: Box::new(st),
                    num_bits: w.num_bits,
                    group_size,
                };
            }
            ("mxfp4-pack-quantized", Dtype::U8) => {
                if w.kind != "float" || w.num_bits != 4 || w.group_size != Some(32) {
                    return Err(scheme(&format!(
                        "{} bits of type {} in groups of {:?}: MXFP4 is 4-bit float in groups of 32",
                        w.num_bits, w.kind, w.group_size
                    )));
                }
                if packed.shape.len() != 2 {
                    return Err(bad(&packed, format!("shape {:?}: expected 2 dimensions", packed.shape)));
                }
                let dims = match &shape_t {
                    Some(st) => read_shape_tensor(shards, st).map_err(|m| bad(st, m))?,
                    None => vec![packed.shape[0], packed.shape[1] * 2],
                };
                let want_packed = vec![dims[0], dims[1].div_ceil(2)];
                let want_scale = vec![dims[0], dims[1].div_ceil(32)];
                if packed.shape != want_packed {
                    return Err(bad(
                        &packed,
                        format!("shape {:?}, expected {want_packed:?}", packed.shape),
                    ));
                }
                if !matches!(scale.dtype, Dtype::U8 | Dtype::F8_E8M0) || scale.shape != want_scale {
                    return Err(bad(
                        &scale,
                        format!("{:?} {:?}: expected U8 (E8M0) {want_scale:?}", scale.dtype, scale.shape),
                    ));
                }
                shape = dims;
                encoding = Encoding::Mxfp4 {
                    source: Mxfp4Source::CompressedTensors,
                    packed_shape: packed.shape.clone(),
                    scales: Box::new(scale),
                    shape_tensor: shape_t.map(Box::new),
                };
            }
            (f, d) => {
                return Err(scheme(&format!(
                    "weight_packed of dtype {d:?} in format {f:?} is not supported"
                )))
            }
        }
        tensors.insert(
            target,
            TensorEntry {
                shape,
                encoding,
                ..packed
            },
        );
    }

    // gpt-oss MXFP4: `X_blocks` [.., rows, G, 16] + `X_scales` [.., rows, G].
    for k in keys.iter().filter(|k| k.ends_with("_blocks")) {
        let base = &k[..k.len() - "_blocks".len()];
        let sk = format!("{base}_scales");
        let (Some(b), Some(sc)) = (tensors.get(k), tensors.get(&sk)) else {
            continue;
        };
        if b.dtype != Dtype::U8 {
            continue;
        }
        let n = b.shape.len();
        if n < 3 || b.shape[n - 1] != 16 {
            return Err(bad(
                b,
                format!("MXFP4 blocks of shape {:?}: expected [.., rows, G, 16]", b.shape),
            ));
        }
        if !matches!(sc.dtype, Dtype::U8 | Dtype::F8_E8M0) || sc.shape != b.shape[..n - 1] {
            return Err(bad(
                sc,
                format!(
                    "{:?} {:?}: expected U8 (E8M0) {:?}",
                    sc.dtype,
                    sc.shape,
                    &b.shape[..n - 1]
                ),
            ));
        }
        if let Some(plain) = tensors.get(base) {
            return Err(bad(plain, format!("also stored as MXFP4 blocks {}", b.file_name)));
        }
        let blocks = tensors.remove(k).expect("checked above");
        let scales = tensors.remove(&sk).expect("checked above");
        let mut shape = blocks.shape[..n - 1].to_vec();
        shape[n - 2] *= 32;
        let entry = TensorEntry {
            shape,
            encoding: Encoding::Mxfp4 {
                source: Mxfp4Source::GptOssBlocks,
                packed_shape: blocks.shape.clone(),
                scales: Box::new(scales),
                shape_tensor: None,
            },
            ..blocks
        };
        tensors.insert(base.to_string(), entry);
    }
    Ok(tensors)
}

/// Reads a compressed-tensors `weight_shape`: I32 or I64 `[2]` holding `[rows, cols]`.
fn read_shape_tensor(shards: &[Shard], e: &TensorEntry) -> Result<Vec<usize>, String> {
    let bytes = read_bytes(shards, e).map_err(|err| err.to_string())?;
    let vals: Vec<i64> = match e.dtype {
        Dtype::I32 => bytes
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
            .collect(),
        Dtype::I64 => bytes
            .chunks_exact(8)
            .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
            .collect(),
        d => return Err(format!("weight_shape of dtype {d:?}: expected I32 or I64")),
    };
    if vals.len() != 2 || vals.iter().any(|&v| v <= 0 || v > u32::MAX as i64) {
        return Err(format!("weight_shape {vals:?}: expected two positive dimensions"));
    }
    Ok(vals.iter().map(|&v| v as usize).collect())
}

fn read_header(path: &Path, file: &File) -> Result<Vec<TensorEntry>, FormatError> {
    let len = file.metadata().map_err(io_err(path))?.len();
    let bad = |m: String| FormatError::Safetensors {
        path: path.to_path_buf(),
        message: m,
    };
    if len < 8 {
        return Err(bad(format!("file is {len} bytes, too short for a safetensors header")));
    }
    let mut nb = [0u8; 8];
    file.read_exact_at(&mut nb, 0).map_err(io_err(path))?;
    let n = u64::from_le_bytes(nb);
    if n > 100 << 20 || 8 + n > len {
        return Err(bad(format!(
            "header length {n} does not fit in the file ({len} bytes): truncated or not safetensors"
        )));
    }
    // Validate with the safetensors crate on a map of the file; only the header pages are touched.
    // SAFETY: the map is read-only and dropped before this function returns; we only let the
    // safetensors crate parse the header, whose extent we checked against the file length above.
    let mmap = unsafe { memmap2::Mmap::map(file) }.map_err(io_err(path))?;
    let st = SafeTensors::deserialize(&mmap).map_err(|e| match e {
        safetensors::SafeTensorError::MetadataIncompleteBuffer => {
            match declared_data_end(&mmap[8..8 + n as usize]).map(|end| 8 + n + end) {
                Some(need) if need > len => bad(format!(
                    "file is truncated: its header needs {need} bytes, the file has {len}"
                )),
                _ => bad("invalid safetensors: tensor data does not match the header (trailing bytes or gaps)".into()),
            }
        }
        e => bad(format!("invalid safetensors: {e}")),
    })?;
    let data_start = 8 + n;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        // Recompute the absolute range from the view's position inside the map.
        let data = view.data();
        let off = data.as_ptr() as usize - mmap.as_ptr() as usize;
        let end = off as u64 + data.len() as u64;
        if (off as u64) < data_start || end > len {
            return Err(bad(format!("tensor {name}: data range {off}..{end} outside the file")));
        }
        out.push(TensorEntry {
            file_name: name,
            shard: 0,
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            offset: off as u64,
            len: data.len() as u64,
            encoding: Encoding::Plain,
        });
    }
    Ok(out)
}

/// End of the tensor data a safetensors header describes (the largest `data_offsets` end), if
/// the header is JSON of the expected shape.
fn declared_data_end(header: &[u8]) -> Option<u64> {
    let v: Value = serde_json::from_slice(header).ok()?;
    v.as_object()?
        .iter()
        .filter(|(k, _)| k.as_str() != "__metadata__")
        .map(|(_, t)| t.get("data_offsets")?.get(1)?.as_u64())
        .try_fold(0u64, |m, e| Some(m.max(e?)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_st(path: &Path, tensors: &[(&str, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                (
                    n.to_string(),
                    safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
                )
            })
            .collect();
        safetensors::serialize_to_file(views, None, path).unwrap();
    }

    /// A tensor of [`write_st`] with an owned name.
    type Owned = (String, Dtype, Vec<usize>, Vec<u8>);

    /// [`write_st`] of tensors with owned names.
    fn write_owned(path: &Path, tensors: &[Owned]) {
        let t: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)> = tensors
            .iter()
            .map(|(n, d, s, b)| (n.as_str(), *d, s.clone(), b.clone()))
            .collect();
        write_st(path, &t);
    }

    #[test]
    fn reads_f32_bf16_f16() {
        let dir = tempfile::tempdir().unwrap();
        let f32b: Vec<u8> = [1.0f32, -2.5].iter().flat_map(|x| x.to_le_bytes()).collect();
        let bf: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        let f16b: Vec<u8> = [1.0f32, -2.5]
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("a", Dtype::F32, vec![2], f32b),
                ("language_model.b", Dtype::BF16, vec![1, 2], bf),
                ("c", Dtype::F16, vec![2], f16b),
            ],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.read_f32("a", &[2]).unwrap(), vec![1.0, -2.5]);
        assert_eq!(ck.read_f32("b", &[1, 2]).unwrap(), vec![1.0, -2.5]);
        assert_eq!(ck.read_f32("c", &[2]).unwrap(), vec![1.0, -2.5]);
        let e = ck.read_f32("a", &[3]).unwrap_err().to_string();
        assert!(e.contains("a") && e.contains("[3]") && e.contains("[2]"), "{e}");
        let e = ck.read_f32("zzz", &[1]).unwrap_err().to_string();
        assert!(e.contains("zzz"), "{e}");
    }

    #[test]
    fn rejects_fp8_with_a_clear_message() {
        let dir = tempfile::tempdir().unwrap();
        write_st(
            &dir.path().join("model.safetensors"),
            &[("w", Dtype::F8_E4M3, vec![2], vec![0, 1])],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        let e = ck.read_f32("w", &[2]).unwrap_err().to_string();
        assert!(
            e.contains("FP8") && e.contains("w_scale_inv") && e.contains("model.safetensors"),
            "{e}"
        );
    }

    fn le<T: Copy, const N: usize>(xs: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        xs.iter().flat_map(|&x| f(x)).collect()
    }

    fn bf16s(xs: &[f32]) -> Vec<u8> {
        le(xs, |x| half::bf16::from_f32(x).to_bits().to_le_bytes())
    }

    fn write_config(dir: &Path, quant: serde_json::Value) {
        let cfg = serde_json::json!({"model_type": "deepseek_v3", "quantization_config": quant});
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    }

    /// `[3, 5]` E4M3 bytes with `[2, 2]` blocks, scales, and the values worked by hand
    /// (`source_dtypes` tests).
    fn fp8_case() -> (Vec<u8>, Vec<f32>, Vec<f32>) {
        let v = vec![
            0x38, 0x40, 0x38, 0x40, 0x38, 0xC0, 0x30, 0x38, 0x38, 0x7E, 0x38, 0x38, 0x01, 0x38, 0x40,
        ];
        let s = vec![1.0, 10.0, 100.0, 0.5, 0.25, -2.0];
        #[rustfmt::skip]
        let want = vec![
            1.0, 2.0, 10.0, 20.0, 100.0,
            -2.0, 0.5, 10.0, 10.0, 44800.0,
            0.5, 0.5, 0.25 * 0.001953125, 0.25, -4.0,
        ];
        (v, s, want)
    }

    #[test]
    fn block_fp8_reads_under_the_weight_name_and_consumes_its_scale() {
        let dir = tempfile::tempdir().unwrap();
        let (v, s, want) = fp8_case();
        write_config(
            dir.path(),
            serde_json::json!({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [2, 2]}),
        );
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("language_model.w", Dtype::F8_E4M3, vec![3, 5], v.clone()),
                (
                    "language_model.w_scale_inv",
                    Dtype::F32,
                    vec![2, 3],
                    le(&s, f32::to_le_bytes),
                ),
                ("b", Dtype::F8_E4M3, vec![3, 5], v.clone()),
                ("b_scale_inv", Dtype::BF16, vec![2, 3], bf16s(&s)),
                ("norm", Dtype::F32, vec![1], le(&[1.5f32], f32::to_le_bytes)),
            ],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.names().collect::<Vec<_>>(), ["b", "norm", "w"]);
        assert_eq!(ck.entry("w").unwrap().aux_file_names(), ["language_model.w_scale_inv"]);
        assert_eq!(ck.entry("w").unwrap().source_bytes(), 15 + 24);
        assert_eq!(ck.read_f32("w", &[3, 5]).unwrap(), want);
        assert_eq!(ck.read_f32("b", &[3, 5]).unwrap(), want);
        assert_eq!(ck.read_f32("norm", &[1]).unwrap(), [1.5]);

        // A scale grid that does not cover the weight in [2, 2] blocks (full blocks only).
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("w", Dtype::F8_E4M3, vec![3, 5], v.clone()),
                ("w_scale_inv", Dtype::F32, vec![1, 2], le(&s[..2], f32::to_le_bytes)),
            ],
        );
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("w_scale_inv") && e.contains("[2, 3]"), "{e}");

        // Without quantization_config.weight_block_size.
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("w", Dtype::F8_E4M3, vec![3, 5], v),
                ("w_scale_inv", Dtype::F32, vec![2, 3], le(&s, f32::to_le_bytes)),
            ],
        );
        std::fs::write(dir.path().join("config.json"), r#"{"model_type": "deepseek_v3"}"#).unwrap();
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("weight_block_size") && e.contains("config.json"), "{e}");
    }

    const EXPERT: &str = "model.layers.1.mlp.experts.0.up_proj";

    fn ct_config(dir: &Path) {
        write_config(
            dir,
            serde_json::json!({
                "quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                    "strategy": "group", "group_size": 4, "symmetric": true}}},
                "ignore": ["lm_head", "re:.*self_attn.*"]
            }),
        );
    }

    #[test]
    fn int4_pack_quantized_reads_under_the_weight_name() {
        let dir = tempfile::tempdir().unwrap();
        ct_config(dir.path());
        // Two rows of 8 int4 values in one word each (see source_dtypes tests), group 4.
        let words = le(&[0xFCBA_9870u32, 0x8888_885D], u32::to_le_bytes);
        let scales = bf16s(&[0.5, 2.0, -1.0, 1.0078125]);
        let p = |s: &str| format!("{EXPERT}.{s}");
        // The three tensors of pack-quantized module `m`: the words, the scales, and
        // `weight_shape` `[2, cols]` stored as `shape_dtype` (I32 or I64).
        let packed = |m: &str, shape_dtype: Dtype, cols: i64| -> Vec<Owned> {
            let shape = match shape_dtype {
                Dtype::I64 => le(&[2i64, cols], i64::to_le_bytes),
                _ => le(&[2i32, cols as i32], i32::to_le_bytes),
            };
            vec![
                (format!("{m}.weight_packed"), Dtype::I32, vec![2, 1], words.clone()),
                (format!("{m}.weight_scale"), Dtype::BF16, vec![2, 2], scales.clone()),
                (format!("{m}.weight_shape"), shape_dtype, vec![2], shape),
            ]
        };
        let st = dir.path().join("model.safetensors");
        let mut tensors = packed(EXPERT, Dtype::I32, 8);
        tensors.push((
            "model.layers.0.self_attn.o_proj.weight".into(),
            Dtype::BF16,
            vec![1, 2],
            bf16s(&[1.0, 2.0]),
        ));
        write_owned(&st, &tensors);
        let ck = Checkpoint::open(dir.path()).unwrap();
        let w = format!("{EXPERT}.weight");
        assert_eq!(
            ck.names().collect::<Vec<_>>(),
            ["model.layers.0.self_attn.o_proj.weight", w.as_str()]
        );
        assert_eq!(
            ck.entry(&w).unwrap().aux_file_names(),
            [p("weight_scale"), p("weight_shape")]
        );
        assert_eq!(
            ck.read_f32(&w, &[2, 8]).unwrap(),
            [-4.0, -0.5, 0.0, 0.5, 4.0, 6.0, 8.0, 14.0, -5.0, 3.0, -0.0, -0.0, 0.0, 0.0, 0.0, 0.0]
        );
        let e = ck.read_f32(&w, &[8, 2]).unwrap_err().to_string();
        assert!(e.contains("[8, 2]") && e.contains("[2, 8]"), "{e}");

        // An I64 weight_shape reads the same.
        write_owned(&st, &packed(EXPERT, Dtype::I64, 8));
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.read_f32(&w, &[2, 8]).unwrap()[7], 14.0);

        // Errors, each naming the tensor: missing scale, a module the config ignores, a shape that
        // does not match the packed words.
        let mut no_scale = packed(EXPERT, Dtype::I32, 8);
        no_scale.remove(1);
        let cases: Vec<(Vec<Owned>, &[&str])> = vec![
            (no_scale, &["weight_packed", "has no", "weight_scale"]),
            (
                packed("model.layers.0.self_attn.o_proj", Dtype::I32, 8),
                &["o_proj", "ignore", "re:.*self_attn.*"],
            ),
            (packed(EXPERT, Dtype::I32, 16), &["weight_packed", "[2, 2]"]),
        ];
        for (tensors, needles) in cases {
            write_owned(&st, &tensors);
            let e = Checkpoint::open(dir.path()).err().expect("must fail").to_string();
            assert!(needles.iter().all(|n| e.contains(n)), "{needles:?}: {e}");
        }

        // A packed weight without a compressed-tensors config.
        std::fs::remove_file(dir.path().join("config.json")).unwrap();
        write_owned(&st, &packed(EXPERT, Dtype::I32, 8));
        let e = Checkpoint::open(dir.path()).err().unwrap().to_string();
        assert!(e.contains("compressed-tensors") && e.contains("weight_packed"), "{e}");
    }

    #[test]
    fn mxfp4_sources_read_under_the_weight_name() {
        let dir = tempfile::tempdir().unwrap();
        write_config(
            dir.path(),
            serde_json::json!({
                "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                    "strategy": "group", "group_size": 32, "symmetric": true}}}
            }),
        );
        // One row of 32: byte 0 = 0x2F (elements -6, +1), scale 128 (×2).
        let mut packed = vec![0u8; 16];
        packed[0] = 0x2F;
        let mut want = vec![0f32; 32];
        want[0] = -12.0;
        want[1] = 2.0;
        write_st(
            &dir.path().join("model.safetensors"),
            &[
                ("m.weight_packed", Dtype::U8, vec![1, 16], packed.clone()),
                ("m.weight_scale", Dtype::U8, vec![1, 1], vec![128]),
                // gpt-oss: two experts of one row each.
                (
                    "e.gate_up_proj_blocks",
                    Dtype::U8,
                    vec![2, 1, 1, 16],
                    [packed.clone(), packed].concat(),
                ),
                ("e.gate_up_proj_scales", Dtype::U8, vec![2, 1, 1], vec![128, 127]),
            ],
        );
        let ck = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(ck.names().collect::<Vec<_>>(), ["e.gate_up_proj", "m.weight"]);
        assert_eq!(ck.read_f32("m.weight", &[1, 32]).unwrap(), want);
        let g = ck.read_f32("e.gate_up_proj", &[2, 1, 32]).unwrap();
        assert_eq!(&g[..32], &want[..]);
        assert_eq!((g[32], g[33]), (-6.0, 1.0));
        // Per expert: only slice 1 of the fused tensor, decoded or copied bit for bit.
        let g1 = ck.read_f32_slice("e.gate_up_proj", &[2, 1, 32], 1).unwrap();
        assert_eq!(&g1[..], &g[32..]);
        let rec = ck
            .read_mxfp4_record("e.gate_up_proj", &[2, 1, 32], Some(1))
            .unwrap()
            .unwrap();
        let mut want_rec = vec![0u8; 17];
        want_rec[0] = 0x2F;
        want_rec[16] = 127;
        assert_eq!(rec, want_rec);
        let e = ck
            .read_f32_slice("e.gate_up_proj", &[2, 1, 32], 2)
            .unwrap_err()
            .to_string();
        assert!(e.contains("slice 2") && e.contains("e.gate_up_proj_blocks"), "{e}");
        // Compressed-tensors weights are not fused over experts.
        let e = ck.read_f32_slice("m.weight", &[1, 32], 0).unwrap_err().to_string();
        assert!(e.contains("m.weight_packed"), "{e}");
    }

    #[test]
    fn truncated_and_garbage_files_are_errors_not_crashes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let b: Vec<u8> = (0..64u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        write_st(&p, &[("w", Dtype::F32, vec![64], b)]);
        let full = std::fs::read(&p).unwrap();
        for cut in [0, 3, 8, 20, full.len() - 1] {
            std::fs::write(&p, &full[..cut]).unwrap();
            let e = Checkpoint::open(dir.path())
                .err()
                .expect("truncated file must fail")
                .to_string();
            assert!(e.contains("model.safetensors"), "cut {cut}: {e}");
        }
        // Header length pointing far past the end.
        let mut f = File::create(&p).unwrap();
        f.write_all(&u64::MAX.to_le_bytes()).unwrap();
        f.write_all(b"{}").unwrap();
        assert!(Checkpoint::open(dir.path()).is_err());
        // Not JSON.
        let mut f = File::create(&p).unwrap();
        f.write_all(&4u64.to_le_bytes()).unwrap();
        f.write_all(b"nope").unwrap();
        assert!(Checkpoint::open(dir.path()).is_err());
    }

    #[test]
    fn fuzzed_headers_never_panic() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("model.safetensors");
        let b: Vec<u8> = (0..16u32).flat_map(|x| (x as f32).to_le_bytes()).collect();
        write_st(
            &p,
            &[("w", Dtype::F32, vec![4, 4], b.clone()), ("v", Dtype::F32, vec![16], b)],
        );
        let full = std::fs::read(&p).unwrap();
        let mut state = 0x9E3779B97F4A7C15u64;
        for _ in 0..300 {
            let mut m = full.clone();
            for _ in 0..4 {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let i = (state as usize) % m.len();
                m[i] = (state >> 32) as u8;
            }
            std::fs::write(&p, &m).unwrap();
            if let Ok(ck) = Checkpoint::open(dir.path()) {
                for n in ck.names().map(|s| s.to_string()).collect::<Vec<_>>() {
                    let e = ck.entry(&n).unwrap().clone();
                    let _ = ck.read_f32(&n, &e.shape);
                }
            }
        }
    }
}
