//! `manifest.json` of a deltafin model directory: the format's name and version, the stored
//! dtypes, where each backbone tensor and each expert record lies, the layout shared by every
//! record, the source of a streaming install, and the names of the directory's other files.
//! Opening a directory against its manifest is [`crate::model_dir`]; checking an untrusted
//! manifest's values is [`crate::manifest_check`].

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::aligned::TENSOR_ALIGN;
use crate::family::{ExpertMatrix, TensorRole};
use crate::{io_err, FormatError, ModelConfig};

/// Current model-directory format version; readers refuse other versions.
pub const FORMAT_VERSION: u32 = 2;
/// `format` field of every manifest.
pub const FORMAT_NAME: &str = "deltafin-model";
/// How a tensor is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StoredDtype {
    F32,
    Bf16,
    Int8,
    Mxfp4,
}

impl StoredDtype {
    /// Bytes of the values part of a `[rows, cols]` matrix.
    pub fn value_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            StoredDtype::F32 => rows * cols * 4,
            StoredDtype::Bf16 => rows * cols * 2,
            StoredDtype::Int8 => rows * cols,
            StoredDtype::Mxfp4 => rows * deltafin_kernels::mxfp4::packed_row_bytes(cols),
        }
    }

    /// Bytes of the scales part of a `[rows, cols]` matrix (0 for unscaled dtypes).
    pub fn scale_bytes(self, rows: usize, cols: usize) -> usize {
        match self {
            StoredDtype::F32 | StoredDtype::Bf16 => 0,
            StoredDtype::Int8 => rows * 4,
            StoredDtype::Mxfp4 => rows * deltafin_kernels::mxfp4::scale_row_bytes(cols),
        }
    }

    /// Name as used on the command line and in the manifest.
    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "f32",
            StoredDtype::Bf16 => "bf16",
            StoredDtype::Int8 => "int8",
            StoredDtype::Mxfp4 => "mxfp4",
        }
    }
}

/// One backbone tensor's place in `backbone.bin`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorRecord {
    pub dtype: StoredDtype,
    /// Shape as in the source checkpoint (`[rows, cols]` for matrices, `[n]` for vectors).
    pub shape: Vec<usize>,
    /// Byte offset of the values.
    pub offset: u64,
    /// Bytes of values plus scales.
    pub bytes: u64,
    /// Byte offset of the scales (int8/mxfp4 only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scales_offset: Option<u64>,
    /// XXH3-64 of the tensor's `bytes` bytes at `offset`, lowercase hex ([`tensor_xxh3`]),
    /// checked when the backbone is loaded and by `cache verify`. Empty in directories written
    /// before deltafin checksummed the backbone: those load, reported as unverified.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub xxh3: String,
}

/// The checksum of a stored tensor or record: XXH3-64 of its bytes, 16 lowercase hex digits.
pub fn tensor_xxh3(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

/// One matrix inside every expert record (all records share this layout).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertTensorLayout {
    /// `gate_proj`, `up_proj` or `down_proj` (the checkpoint's names).
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub dtype: StoredDtype,
    /// Offset of the values inside the record, bytes.
    pub offset: u64,
    /// Offset of the scales inside the record, bytes (equal to the end of the values when none).
    pub scales_offset: u64,
    /// Values plus scales, bytes.
    pub bytes: u64,
}

/// One routed expert's record in `experts.pack`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertRecord {
    pub layer: u32,
    pub expert: u32,
    /// Byte offset in `experts.pack` (multiple of [`RECORD_ALIGN`]).
    pub offset: u64,
    /// Bytes of data (the record is padded with zeros to the next alignment boundary).
    pub length: u64,
    /// XXH3-64 of the `length` data bytes, lowercase hex.
    pub xxh3: String,
}

/// Backbone section of the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BackboneIndex {
    pub file: String,
    pub bytes: u64,
    /// Dtype chosen for 2-D weight matrices (norms, router weights and biases stay f32).
    pub matrix_dtype: StoredDtype,
    pub tensors: BTreeMap<String, TensorRecord>,
}

/// Expert-pack section of the manifest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExpertPackIndex {
    pub file: String,
    pub bytes: u64,
    pub dtype: StoredDtype,
    pub record_align: u64,
    /// Layout shared by all records.
    pub layout: Vec<ExpertTensorLayout>,
    /// Records ordered by (layer, expert).
    pub records: Vec<ExpertRecord>,
}

/// `manifest.json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    /// Model family, e.g. `deepseek_v3`.
    pub family: String,
    /// Resolved hyperparameters, tagged by family.
    pub config: ModelConfig,
    /// The source `config.json`, verbatim.
    pub source_config: Value,
    pub backbone: BackboneIndex,
    pub experts: ExpertPackIndex,
    /// Tokenizer and generation files copied from the source.
    pub tokenizer_files: Vec<String>,
    /// `deltafin <version>` that wrote the directory.
    pub created_by: String,
    /// Present for a streaming install (`deltafin pull --stream`): where missing expert records
    /// come from. Absent for a full install or convert, where every record is in the pack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<StreamSource>,
}

impl BackboneIndex {
    /// The index of `backbone.bin`: `bytes` long, 2-D weight matrices stored as
    /// `matrix_dtype`, the resident tensors by checkpoint name.
    pub(crate) fn new(bytes: u64, matrix_dtype: StoredDtype, tensors: BTreeMap<String, TensorRecord>) -> Self {
        BackboneIndex {
            file: "backbone.bin".into(),
            bytes,
            matrix_dtype,
            tensors,
        }
    }
}

impl ExpertPackIndex {
    /// The index of `experts.pack`: `bytes` long, routed experts stored as `dtype`, records
    /// [`RECORD_ALIGN`](crate::aligned::RECORD_ALIGN)-aligned, each laid out as `layout`, ordered
    /// by (layer, expert).
    pub(crate) fn new(
        bytes: u64,
        dtype: StoredDtype,
        layout: Vec<ExpertTensorLayout>,
        records: Vec<ExpertRecord>,
    ) -> Self {
        ExpertPackIndex {
            file: "experts.pack".into(),
            bytes,
            dtype,
            record_align: crate::aligned::RECORD_ALIGN,
            layout,
            records,
        }
    }
}

impl Manifest {
    /// The manifest this build writes ([`FORMAT_NAME`] version [`FORMAT_VERSION`], `created_by`
    /// `deltafin <version>`) for `config` (its family named) resolved from `source_config`, with
    /// its two data files, the `tokenizer_files` copied beside them, and `stream` for a
    /// streaming install.
    pub(crate) fn new(
        config: &ModelConfig,
        source_config: Value,
        backbone: BackboneIndex,
        experts: ExpertPackIndex,
        tokenizer_files: Vec<String>,
        stream: Option<StreamSource>,
    ) -> Self {
        Manifest {
            format: FORMAT_NAME.into(),
            format_version: FORMAT_VERSION,
            family: config.family().into(),
            config: config.clone(),
            source_config,
            backbone,
            experts,
            tokenizer_files,
            created_by: format!("deltafin {}", env!("CARGO_PKG_VERSION")),
            stream,
        }
    }
}

/// The source of a streaming install. Its expert records start absent (`experts.pack` is a
/// sparse file of full size, record offsets as in a full convert, the manifest's `xxh3` empty);
/// a record becomes present when its bytes are written and fsynced and an entry with its
/// checksum is appended to the presence journal ([`crate::presence`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamSource {
    /// Repository URL given to `deltafin pull`.
    pub url: String,
    /// Revision (Hugging Face layout `<url>/resolve/<revision>/<file>`); unused with `flat`.
    pub revision: String,
    /// Files at `<url>/<file>` instead of the Hugging Face layout.
    #[serde(default)]
    pub flat: bool,
    /// Whether runs may fetch missing experts without `--allow-network`.
    #[serde(default)]
    pub allow_network: bool,
    /// File in the model directory locating each routed expert's source tensors.
    pub index: String,
}

/// Writes `manifest.json` into `dir` and makes it and the directory durable (fsync). Writers call
/// this last: a directory is a model only once its manifest exists.
pub fn write_manifest(dir: &Path, manifest: &Manifest) -> Result<(), FormatError> {
    use std::io::Write;
    let mpath = dir.join("manifest.json");
    let json = serde_json::to_vec_pretty(manifest).map_err(|e| FormatError::Json {
        path: mpath.clone(),
        message: e.to_string(),
    })?;
    let mut mf = File::create(&mpath).map_err(io_err(&mpath))?;
    mf.write_all(&json).map_err(io_err(&mpath))?;
    mf.sync_all().map_err(io_err(&mpath))?;
    File::open(dir).and_then(|d| d.sync_all()).map_err(io_err(dir))?;
    Ok(())
}

/// Files copied verbatim from the source directory when present.
pub const COPIED_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tiktoken.model",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// File name of the presence journal inside a streaming install ([`crate::presence`]).
pub const JOURNAL_FILE: &str = "experts.present";

/// `[rows, cols]` a tensor is stored as: its last dimension is `cols`, the others multiply into
/// `rows` (1 for a vector).
pub fn matrix_dims(shape: &[usize]) -> (usize, usize) {
    match shape.split_last() {
        Some((&cols, rest)) => (rest.iter().product(), cols),
        None => (1, 1),
    }
}

/// Layout of one expert record holding `mats`, each in `dtype` or f32 for
/// [`TensorRole::F32`] parts (gpt-oss biases), and its length in bytes before padding to
/// [`RECORD_ALIGN`](crate::aligned::RECORD_ALIGN). Each matrix starts 64-byte aligned inside the record so f32 and bf16 views
/// are aligned.
pub fn record_layout(mats: &[ExpertMatrix], experts_dtype: StoredDtype) -> (Vec<ExpertTensorLayout>, u64) {
    let mut layout = Vec::new();
    let mut roff = 0u64;
    for m in mats {
        let dtype = match m.role {
            TensorRole::F32 => StoredDtype::F32,
            TensorRole::Matrix => experts_dtype,
        };
        let vb = dtype.value_bytes(m.rows, m.cols) as u64;
        let sb = dtype.scale_bytes(m.rows, m.cols) as u64;
        let off = align_up(roff, TENSOR_ALIGN);
        layout.push(ExpertTensorLayout {
            name: m.name.clone(),
            rows: m.rows,
            cols: m.cols,
            dtype,
            offset: off,
            scales_offset: off + vb,
            bytes: vb + sb,
        });
        roff = off + vb + sb;
    }
    (layout, roff)
}

fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}
