//! Reading Hugging Face checkpoints and reading/writing the deltafin model directory.
//!
//! - [`arch`]: [`ModelConfig`], the resolved config of any supported family, chosen from
//!   `config.json`'s `model_type`.
//! - [`family`]: the [`family::Family`] trait each family implements in its own file, and the
//!   vocabulary of tensor tables (backbone tensors, expert matrices and their sources).
//! - [`deepseek_v3`], [`kimi_linear`], [`qwen3_moe`], [`mixtral`], [`gpt_oss`], [`qwen3_next`]:
//!   one file per family: `config.json` resolved with transformers' defaults, validated, and the
//!   family's tensor tables.
//! - [`json`]: typed `config.json` field readers and their bounds; [`rope`]: the RoPE scheme.
//! - [`checkpoint`]: validated safetensors reading (single file or index + shards), quantized
//!   source weights presented and decoded under their plain names.
//! - [`quantization`] and [`source_dtypes`]: `quantization_config` and the exact decoders of
//!   quantized sources (DeepSeek block FP8, compressed-tensors int4/int8 and MXFP4, gpt-oss MXFP4).
//! - [`manifest_check`]: value checks of an untrusted `manifest.json` at load.
//! - [`manifest`]: `manifest.json` and the layout it describes; [`aligned`]: page-aligned
//!   buffers and the alignments of stored tensors and records.
//! - [`model_dir`]: the deltafin model directory: `manifest.json`, `backbone.bin` (resident
//!   weights), `experts.pack` (one 4 KiB-aligned record per (layer, routed expert)).
//! - [`convert`]: Hugging Face checkpoint → deltafin model directory, crash-safe.
//! - [`presence`]: the presence journal of a streaming install's sparse expert pack.

pub mod aligned;
pub mod arch;
pub mod checkpoint;
pub mod convert;
pub mod deepseek_v3;
pub mod family;
pub mod footprint;
pub mod gpt_oss;
pub mod json;
pub mod kimi_linear;
pub mod manifest;
pub mod manifest_check;
pub mod mixtral;
pub mod model_dir;
pub mod presence;
pub mod quantization;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod rope;
pub mod source_dtypes;
pub mod staging;
pub mod synth;

pub use aligned::AlignedBuf;
pub use arch::ModelConfig;
pub use deepseek_v3::DeepseekV3Config;
pub use family::Family;
pub use gpt_oss::GptOssConfig;
pub use manifest::{ExpertRecord, Manifest, StoredDtype};
pub use mixtral::MixtralConfig;
pub use model_dir::ModelDir;
pub use qwen3_moe::Qwen3MoeConfig;
pub use qwen3_next::Qwen3NextConfig;
pub use rope::Rope;

use std::path::{Path, PathBuf};

/// Errors of checkpoint reading, conversion and model-directory loading. Each names the file
/// (and tensor or field) at fault.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    /// Stored bytes that fail their checksum (a damaged `backbone.bin`).
    #[error("{path}: {message}")]
    Checksum { path: PathBuf, message: String },
    #[error("{path}: malformed JSON: {message}")]
    Json { path: PathBuf, message: String },
    #[error("{path}: field `{field}`: {message}")]
    Config {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("{path}: missing tensor {tensor}")]
    MissingTensor { path: PathBuf, tensor: String },
    #[error("{path}: tensor {tensor} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{path}: tensor {tensor} has dtype {dtype}: {message}")]
    UnsupportedDtype {
        path: PathBuf,
        tensor: String,
        dtype: String,
        message: String,
    },
    #[error("{path}: unexpected tensor {tensor} (not part of a {family} checkpoint)")]
    UnexpectedTensor {
        path: PathBuf,
        tensor: String,
        family: String,
    },
    #[error("{path}: not a deltafin model directory: {message}")]
    ModelDir { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Output { path: PathBuf, message: String },
}

/// An I/O error on `path` as [`FormatError::Io`], for `map_err`.
pub(crate) fn io_err(path: &Path) -> impl Fn(std::io::Error) -> FormatError + '_ {
    move |error| FormatError::Io {
        path: path.to_path_buf(),
        error,
    }
}
