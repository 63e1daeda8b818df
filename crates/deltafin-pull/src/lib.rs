//! Installing deltafin models from an HTTP source, fetching routed experts on demand, warming a
//! streaming install, and managing its expert cache.
//!
//! - [`source`]: where files live (`<url>/resolve/<revision>/<file>`, the Hugging Face layout, or
//!   `<url>/<file>` with `flat`).
//! - [`http`]: the HTTP client: retries with backoff on timeouts, connection errors, 429 and 5xx;
//!   range reads that refuse a server ignoring `Range`; resumable, verified downloads.
//! - [`install`]: `pull --full` (download every file, then convert) and `pull --stream` (config,
//!   tokenizer, shard headers and backbone tensors by range; an empty expert cache), and the
//!   upgrade of a streaming install to a full one.
//! - [`fetch`]: [`fetch::HttpRecordSource`], the engine's [`deltafin_engine::experts::RecordSource`]
//!   for a streaming install: one expert's tensors by range, converted to its record.
//! - [`records`]: the expert pack's records: fetching and committing absent ones, ranking by
//!   router-trace heat, freeing blocks.
//! - [`warm`]: fetching the most valuable missing experts within a byte budget.
//! - [`whole`]: a `warm` that completes a Hugging Face source file streams it whole and checks
//!   its published sha256 before its records count as present.
//! - [`cache`]: `cache stats`, `verify` and `gc`.
//!
//! Crash safety everywhere: downloads go to `<file>.part` and are renamed when verified; expert
//! records are written and fsynced before their presence-journal entry
//! ([`deltafin_format::presence`]); a model directory appears only when complete.

pub mod cache;
pub mod fetch;
pub mod http;
pub mod install;
pub mod records;
pub mod source;
pub mod warm;
pub mod whole;

use std::path::PathBuf;

pub use fetch::HttpRecordSource;
pub use http::{Auth, Http, HttpOptions};
pub use source::{hub_endpoint, Source, DEFAULT_ENDPOINT};

/// Errors of installing, fetching and cache management; each names the URL or file at fault.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{url}: {message}")]
    Http { url: String, message: String },
    #[error("{url}: the server ignored the Range request (it answered 200 with the whole file instead of 206 Partial Content); streaming installs and on-demand fetches need a server that honours Range: use `deltafin pull --full`, or serve the files with a server that supports Range (nginx, Apache, S3...)")]
    RangeIgnored { url: String },
    #[error("{url}: downloaded file failed its checksum: expected sha256 {expected}, found {found} (after {attempts} attempts)")]
    Checksum {
        url: String,
        expected: String,
        found: String,
        attempts: u32,
    },
    #[error("{url}: the file changed on the server since the install ({message}); re-run `deltafin pull` to install the new revision")]
    SourceChanged { url: String, message: String },
    #[error("{path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error(transparent)]
    Format(#[from] deltafin_format::FormatError),
    #[error(transparent)]
    Engine(#[from] deltafin_engine::EngineError),
    #[error("{0}")]
    Invalid(String),
}

pub(crate) fn io_err(path: &std::path::Path) -> impl Fn(std::io::Error) -> PullError + '_ {
    move |e| PullError::Io {
        path: path.to_path_buf(),
        error: e,
    }
}

/// A sibling work directory of a model directory: `<parent>/.<name>.<suffix>` (downloads, the
/// partial source of a streaming install), so it is on the same file system and easy to find for
/// `cache gc`.
pub fn sibling(model_dir: &std::path::Path, suffix: &str) -> PathBuf {
    let name = model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let parent = match model_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    parent.join(format!(".{name}.{suffix}"))
}
