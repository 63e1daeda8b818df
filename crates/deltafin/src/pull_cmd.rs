//! `deltafin pull`: full and streaming installs from an HTTP source, and the on-demand expert
//! source that `run`, `serve`, `chat` and `replay` attach to a streaming install.

use std::path::Path;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use deltafin_engine::experts::{Remote, StoreOptions};
use deltafin_format::convert::ConvertOptions;
use deltafin_format::{ModelDir, StoredDtype};
use deltafin_pull::http::Transfer;
use deltafin_pull::install::{pull_full, pull_stream, Pull, PullOptions};
use deltafin_pull::{Auth, Http, HttpOptions, HttpRecordSource, Source};

use crate::convert_cmd::{progress_bar, BackboneDtype, ExpertDtype};
use crate::size;

#[derive(clap::Args)]
#[command(group = clap::ArgGroup::new("mode").required(true).multiple(false).args(["full", "stream"]))]
pub(crate) struct PullArgs {
    /// A Hugging Face repository id, org/name[@revision] (files at
    /// <endpoint>/org/name/resolve/<revision>/<file>), or a repository URL: files are read from
    /// <source>/resolve/<revision>/<file> (the Hugging Face layout), or from <source>/<file> with
    /// --flat (any server that honours Range).
    source: String,
    // The model directory to create (or a streaming install to upgrade with --full).
    #[command(flatten)]
    model_dir: crate::model_path::ModelPath,
    /// Download every file (resumable, verified), then convert. On a streaming install: fetch
    /// only the experts not cached yet and make it a full install.
    #[arg(long)]
    full: bool,
    /// Fetch config, tokenizer, shard headers and backbone tensors only; routed experts are
    /// fetched by HTTP range the first time a run needs them (with --allow-network) or by `warm`.
    #[arg(long)]
    stream: bool,
    /// Revision (branch, tag or commit) in the Hugging Face layout [default: main].
    #[arg(long)]
    revision: Option<String>,
    /// Hub endpoint of repository ids [default: $HF_ENDPOINT, else https://huggingface.co].
    #[arg(long, value_name = "URL")]
    endpoint: Option<String>,
    /// Access token for gated or private repositories, sent as `Authorization: Bearer` to the
    /// source's host only (never logged). Default: $HF_TOKEN, sent to the hub endpoint's host
    /// only; prefer it, as a flag's value is visible to other users of the machine.
    #[arg(long, value_name = "TOKEN", hide_default_value = true)]
    token: Option<String>,
    /// Files are at <source>/<file>.
    #[arg(long)]
    flat: bool,
    /// Streaming: let every later run fetch missing experts without --allow-network.
    #[arg(long)]
    allow_network: bool,
    /// Full: keep the downloaded checkpoint in .<model_dir>.download/ after converting.
    #[arg(long)]
    keep_download: bool,
    /// Storage of 2-D backbone matrices (as for `convert`).
    #[arg(long, value_enum, default_value = "int8")]
    backbone: BackboneDtype,
    /// Storage of routed experts (as for `convert`).
    #[arg(long, value_enum, default_value = "mxfp4")]
    experts: ExpertDtype,
    /// Replace an existing model directory.
    #[arg(long)]
    force: bool,
    /// Range requests (or expert fetches) in flight at once.
    #[arg(long, default_value_t = 4, allow_negative_numbers = true,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    concurrency: usize,
}

/// Download progress on an indicatif bar (drawn only when stderr is a terminal).
pub(crate) struct TransferBar(pub(crate) indicatif::ProgressBar);

impl Transfer for TransferBar {
    fn begin(&self, name: &str, total: u64, done: u64) {
        crate::log::set_active_bar(&self.0);
        self.0.set_message(name.to_string());
        self.0.set_length(total);
        self.0.set_position(done);
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
}

pub(crate) fn run(a: &PullArgs) -> Result<()> {
    if a.keep_download && !a.full {
        bail!("--keep-download applies to --full pulls (a streaming pull downloads no checkpoint)");
    }
    if a.flat && a.revision.is_some() {
        bail!("--revision applies to the Hugging Face layout, not to --flat sources (files at <source>/<file>)");
    }
    let is_url = a.source.starts_with("http://") || a.source.starts_with("https://");
    if is_url && a.endpoint.is_some() {
        bail!("--endpoint applies to repository ids (org/name), not to URL sources");
    }
    let endpoint = deltafin_pull::hub_endpoint(a.endpoint.as_deref());
    let source = Source::parse(&a.source, &endpoint, a.revision.as_deref(), a.flat)?;
    let auth = match &a.token {
        Some(t) => Some(Auth::new(t, &source.url).context("--token")?),
        None => hub_auth(&endpoint)?,
    };
    let model_dir = a.model_dir.path();
    let dl = progress_bar("downloading");
    let bar = dl.0.clone();
    let http = Http::new(HttpOptions {
        auth,
        ..http_defaults()
    })?
    .with_retry_observer(move |r| {
        let file = r.url.rsplit('/').next().unwrap_or(r.url);
        bar.set_message(format!("{file}: retry {}/{} ({})", r.retry, r.of, r.reason));
    });
    let http = Arc::new(http);
    let opts = PullOptions {
        convert: ConvertOptions {
            backbone: match a.backbone {
                BackboneDtype::Int8 => StoredDtype::Int8,
                BackboneDtype::Bf16 => StoredDtype::Bf16,
                BackboneDtype::F32 => StoredDtype::F32,
            },
            experts: match a.experts {
                ExpertDtype::Mxfp4 => StoredDtype::Mxfp4,
                ExpertDtype::Bf16 => StoredDtype::Bf16,
                ExpertDtype::F32 => StoredDtype::F32,
            },
            force: a.force,
        },
        allow_network: a.allow_network,
        keep_download: a.keep_download,
        concurrency: a.concurrency,
    };
    let transfer = TransferBar(dl.0.clone());
    let conv = progress_bar("converting");
    let what = if a.full { "full" } else { "streaming" };
    let p = Pull {
        http: &http,
        source: &source,
        model_dir,
        opts: &opts,
        transfer: &transfer,
        progress: &conv,
    };
    let r = if a.full { pull_full(p) } else { pull_stream(p) };
    dl.0.finish_and_clear();
    conv.0.finish_and_clear();
    let r = r.with_context(|| {
        let left = ["stream-src", "download"]
            .map(|s| deltafin_pull::sibling(model_dir, s))
            .into_iter()
            .find(|p| p.exists())
            .filter(|p| {
                // A work directory holding only its source note has nothing to resume from.
                let fetched = std::fs::read_dir(p)
                    .map(|d| d.flatten().any(|e| e.file_name() != "source.json"))
                    .unwrap_or(true);
                if !fetched {
                    let _ = std::fs::remove_dir_all(p);
                }
                fetched
            });
        let hint = left.map_or(String::new(), |p| {
            format!(
                " (the partial download in {} resumes on the next pull; `deltafin cache gc {}` removes it)",
                p.display(),
                model_dir.display()
            )
        });
        format!("{what} pull of {} into {}{hint}", source.url, model_dir.display())
    })?;
    let rate = r.bytes_fetched as f64 / r.seconds.max(1e-9);
    eprintln!(
        "pulled ({}) {} -> {} in {:.1} s: {} fetched ({}/s, {} requests, {} retries){}",
        r.mode,
        source.url,
        model_dir.display(),
        r.seconds,
        size::human(r.bytes_fetched),
        size::human(rate as u64),
        http.requests(),
        r.retries,
        if r.mode == "upgrade" {
            format!(
                "; {} expert records fetched, {} already cached and kept",
                r.records_fetched, r.records_kept
            )
        } else {
            String::new()
        }
    );
    if r.records_unchecked {
        eprintln!("{}", unchecked_note(r.mode, &a.model_dir));
    }
    if r.mode == "stream" && a.allow_network {
        eprintln!(
            "routed experts are fetched on first use by `deltafin run --model {0} …` (this install allows network access), or ahead of time with `deltafin warm {0}`",
            model_dir.display()
        );
    } else if r.mode == "stream" {
        eprintln!(
            "routed experts are fetched on first use: `deltafin run --model {0} --allow-network …`, or ahead of time with `deltafin warm {0} --allow-network`",
            model_dir.display()
        );
    }
    Ok(())
}

/// What `pull` says when expert records come by byte range from a Hugging Face layout, which
/// publishes a sha256 per file only (issue #19, item 7).
fn unchecked_note(mode: &str, dir: &Path) -> String {
    if mode == "upgrade" {
        return "note: these expert records came by byte range from a Hugging Face layout, which publishes a sha256 per file, not per record: they were not checked against the source (a full pull into a new directory downloads whole, sha256-checked files; a deltafin mirror checks every record)".into();
    }
    format!(
        "note: unverifiable expert records and backbone tensors: this source is a Hugging Face layout, which publishes a sha256 per file, not per byte range, so the backbone tensors fetched by range now and the records fetched by range later are not checked against it as they arrive; a `deltafin warm` that completes a source file streams it whole and checks its sha256, `deltafin cache verify --source {}` compares them with the source, and a deltafin mirror (see the README) checks every record",
        dir.display()
    )
}

/// The on-demand expert source of a streaming install, kept to report what it fetched.
pub(crate) struct NetworkUse(Option<Arc<HttpRecordSource>>);

impl Drop for NetworkUse {
    fn drop(&mut self) {
        if let Some(s) = &self.0 {
            let n = s.records_fetched();
            if n > 0 {
                eprintln!(
                    "fetched {n} expert records on demand ({} over HTTP, {} retries, {} refetched after a checksum failure) from {}",
                    size::human(s.http().bytes_received()),
                    s.http().retries(),
                    s.records_refetched(),
                    deltafin_engine::experts::RecordSource::describe(s.as_ref()),
                );
            }
        }
    }
}

/// Attaches the HTTP expert source to `opts` when `dir` is a streaming install and network use
/// is allowed (`allow_network`, or the install's setting). Without permission nothing is
/// attached, and a missing expert is an error naming the command that fetches it.
///
/// Errors: the stream index is missing or malformed.
/// The token from `HF_TOKEN` for requests to `endpoint`'s host (the hub's), if the variable
/// is set and not empty.
///
/// Errors: the token cannot be sent in a header; the endpoint is not an http(s) URL.
pub(crate) fn hub_auth(endpoint: &str) -> Result<Option<Auth>> {
    match std::env::var("HF_TOKEN") {
        Ok(t) if !t.trim().is_empty() => Ok(Some(Auth::new(&t, endpoint).context("HF_TOKEN")?)),
        _ => Ok(None),
    }
}

/// The HTTP retry and timeout settings: [`HttpOptions::default`], each overridden by its
/// environment variable when that holds a number (`DELTAFIN_HTTP_RETRIES`,
/// `DELTAFIN_HTTP_BACKOFF_MS`, `DELTAFIN_HTTP_TIMEOUT_S`, at least 1 s; tests use short ones).
pub(crate) fn http_defaults() -> HttpOptions {
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.trim().parse::<u64>().ok());
    let d = HttpOptions::default();
    HttpOptions {
        retries: env("DELTAFIN_HTTP_RETRIES").map_or(d.retries, |n| n as u32),
        backoff: env("DELTAFIN_HTTP_BACKOFF_MS").map_or(d.backoff, std::time::Duration::from_millis),
        timeout: env("DELTAFIN_HTTP_TIMEOUT_S").map_or(d.timeout, |s| std::time::Duration::from_secs(s.max(1))),
        auth: d.auth,
    }
}

/// HTTP settings of the expert fetches of a streaming install: the defaults, and `HF_TOKEN` for
/// the hub endpoint (`HF_ENDPOINT`) so that an install of a gated repository keeps working.
pub(crate) fn fetch_options() -> Result<HttpOptions> {
    Ok(HttpOptions {
        auth: hub_auth(&deltafin_pull::hub_endpoint(None))?,
        ..http_defaults()
    })
}

pub(crate) fn attach_source(opts: &mut StoreOptions, dir: &ModelDir, allow_network: bool) -> Result<NetworkUse> {
    let Some(s) = &dir.manifest.stream else {
        return Ok(NetworkUse(None));
    };
    if !(allow_network || s.allow_network) {
        return Ok(NetworkUse(None));
    }
    let http = Arc::new(Http::new(fetch_options()?)?);
    let src = Arc::new(
        HttpRecordSource::open(dir, http)
            .with_context(|| format!("opening the stream source of {}", show(&dir.path)))?,
    );
    opts.remote = Some(Remote(src.clone()));
    Ok(NetworkUse(Some(src)))
}

impl NetworkUse {
    /// Whether missing expert records are fetched on demand.
    pub(crate) fn fetches(&self) -> bool {
        self.0.is_some()
    }
}

/// Records of a streaming install that are not local: `(missing, total)`; `(0, total)` for a
/// full install.
///
/// Errors: the manifest's checksums or the presence journal cannot be read.
fn missing_records(dir: &ModelDir) -> Result<(usize, usize)> {
    let total = dir.manifest.experts.records.len();
    if dir.manifest.stream.is_none() {
        return Ok((0, total));
    }
    let present = deltafin_format::presence::present_checksums(dir)
        .with_context(|| format!("reading which expert records of {} are present", show(&dir.path)))?
        .len();
    Ok((total.saturating_sub(present), total))
}

/// A streaming install whose missing expert records will not be fetched (`network` does not
/// fetch): prints one warning line saying how many are missing, or, with `refuse_if_none` (the
/// server, where every request would fail), refuses when none is local. Nothing for a full
/// install or one with network use.
///
/// Errors: no record is local (with `refuse_if_none`); the presence journal cannot be read.
pub(crate) fn warn_unfetched_records(network: &NetworkUse, dir: &ModelDir, refuse_if_none: bool) -> Result<()> {
    if network.fetches() {
        return Ok(());
    }
    let (missing, total) = missing_records(dir)?;
    let shown = show(&dir.path);
    if refuse_if_none && total > 0 && missing == total {
        bail!(
            "{shown}: none of the {total} expert records of this streaming install is local and network use is not allowed, so every request would fail: serve with --allow-network, or fetch them first with `deltafin warm {shown} --allow-network`"
        );
    }
    if missing > 0 {
        eprintln!(
            "warning: {missing} of {total} expert records of this streaming install are not local; requests that need them will fail without --allow-network (or fetch them with `deltafin warm {shown} --allow-network`)"
        );
    }
    Ok(())
}

fn show(p: &Path) -> String {
    p.display().to_string()
}
