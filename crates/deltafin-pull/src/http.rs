//! The HTTP client: small files, range reads and resumable downloads, with retries.
//!
//! - Retries with exponential backoff ([`HttpOptions`]) on connection errors, timeouts (a read
//!   stalled for [`HttpOptions::timeout`]), bodies cut short, 408, 429 and 5xx; other statuses
//!   are errors at once.
//! - Redirects are followed by hand (at most 10) so the first response's `x-linked-etag` and
//!   `x-linked-size` (the Hugging Face hub's sha256 and size of an LFS file, sent on the redirect
//!   to the CDN) are kept.
//! - A range read must come back `206` with the requested `Content-Range`; `200` means the server
//!   ignores `Range`, which is [`PullError::RangeIgnored`] (never a silent multi-gigabyte read).
//! - Downloads write `<file>.part` plus `<file>.part.json` (size, ETag, sha256 seen when the
//!   partial was started); a later attempt or run resumes with `Range: bytes=<have>-` and
//!   `If-Range: <etag>`, so a changed file restarts from zero. The finished file is checked
//!   against its size and, when the server gives one, its sha256 (a mismatch deletes the partial
//!   and downloads again, up to the retry limit), fsynced, then renamed into place.
//! - With [`HttpOptions::auth`] (a Hugging Face token for gated repositories), requests to the
//!   token's origin carry `Authorization: Bearer <token>`; a redirect to another origin (the
//!   hub's pre-signed CDN URLs) does not, as `huggingface_hub` does. The header is marked
//!   sensitive and the token is never logged or written to disk.
//! - Each retry is a `tracing` warning, and [`Http::with_retry_observer`] lets a progress
//!   display show it.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest::header::{
    HeaderMap, HeaderValue, AUTHORIZATION, CONTENT_LENGTH, CONTENT_RANGE, ETAG, IF_RANGE, LOCATION, RANGE,
};
use serde::{Deserialize, Serialize};
use sha2::Digest;

use crate::{io_err, PullError};

/// Retry and timeout settings. Defaults: 5 retries, backoff 0.5 s doubling up to 10 s, 30 s
/// stall timeout. (The `deltafin` binary reads overrides from the environment variables
/// `DELTAFIN_HTTP_RETRIES`, `DELTAFIN_HTTP_BACKOFF_MS` and `DELTAFIN_HTTP_TIMEOUT_S`; this
/// library reads none.)
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Retries after the first attempt.
    pub retries: u32,
    /// Wait before the first retry; doubles each retry, capped at 10 s.
    pub backoff: Duration,
    /// Longest wait for a connection or for the next bytes of a body.
    pub timeout: Duration,
    /// A bearer token and the origin it is sent to (none by default).
    pub auth: Option<Auth>,
}

/// A bearer token (a Hugging Face access token for gated or private repositories) and the one
/// origin (scheme, host, port) it is sent to. `Debug` shows the origin, never the token.
#[derive(Clone)]
pub struct Auth {
    header: HeaderValue,
    origin: reqwest::Url,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Auth {{ token: <redacted>, origin: {} }}",
            self.origin.origin().ascii_serialization()
        )
    }
}

impl Auth {
    /// `token` for requests to the origin of `endpoint` (e.g. `https://huggingface.co`).
    ///
    /// Errors: `endpoint` is not an http(s) URL; the token is empty or holds characters a header
    /// cannot carry (the message never contains the token).
    pub fn new(token: &str, endpoint: &str) -> Result<Self, PullError> {
        let origin = reqwest::Url::parse(endpoint)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| PullError::Invalid(format!("endpoint {endpoint:?} must be an http:// or https:// URL")))?;
        let token = token.trim();
        if token.is_empty() {
            return Err(PullError::Invalid("the access token is empty".into()));
        }
        let mut header = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| PullError::Invalid("the access token holds characters an HTTP header cannot carry".into()))?;
        header.set_sensitive(true);
        Ok(Auth { header, origin })
    }

    /// Whether requests to `url` carry the token: same scheme, host and port as the endpoint.
    pub fn applies_to(&self, url: &str) -> bool {
        reqwest::Url::parse(url).is_ok_and(|u| u.origin() == self.origin.origin())
    }
}

/// One retry about to happen, as [`Http::with_retry_observer`] reports it.
#[derive(Debug, Clone, Copy)]
pub struct RetryNote<'a> {
    pub url: &'a str,
    /// Why the attempt failed (`HTTP 503`, a connection error...).
    pub reason: &'a str,
    /// This retry's number, from 1.
    pub retry: u32,
    /// Retries allowed.
    pub of: u32,
    /// Wait before it.
    pub wait: Duration,
}

type RetryObserver = Box<dyn Fn(&RetryNote<'_>) + Send + Sync>;

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            retries: 5,
            backoff: Duration::from_millis(500),
            timeout: Duration::from_secs(30),
            auth: None,
        }
    }
}

/// What the server said about a file: its size and validators.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemoteFile {
    /// Bytes.
    pub size: u64,
    /// Strong ETag, quotes included, when the server sends one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub etag: Option<String>,
    /// sha256 (lowercase hex) from `x-linked-etag` or a 64-hex ETag, when available.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Receives download progress (bytes).
pub trait Transfer: Sync {
    /// A file's transfer (re)starts: `total` bytes, `done` already local.
    fn begin(&self, name: &str, total: u64, done: u64);
    fn advance(&self, bytes: u64);
}

/// Ignores progress.
pub struct NoTransfer;
impl Transfer for NoTransfer {
    fn begin(&self, _: &str, _: u64, _: u64) {}
    fn advance(&self, _: u64) {}
}

/// Why one attempt failed.
enum Fail {
    /// Worth another attempt (network, 5xx, short body...).
    Retry(String),
    Fatal(PullError),
}

/// A response after redirects.
struct Got {
    resp: reqwest::blocking::Response,
    status: u16,
    headers: HeaderMap,
    /// `x-linked-etag` / `x-linked-size` of any hop.
    linked_etag: Option<String>,
    linked_size: Option<u64>,
}

/// A blocking HTTP client with retries; counts the body bytes it receives.
pub struct Http {
    client: reqwest::blocking::Client,
    opts: HttpOptions,
    received: AtomicU64,
    requests: AtomicU64,
    retries: AtomicU64,
    on_retry: Option<RetryObserver>,
}

fn header(h: &HeaderMap, name: impl reqwest::header::AsHeaderName) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(|s| s.trim().to_string())
}

/// The sha256 in an ETag-like value (`"<64 hex>"`), if it is one.
fn as_sha256(tag: &str) -> Option<String> {
    let t = tag.trim_start_matches("W/").trim_matches('"').to_ascii_lowercase();
    (t.len() == 64 && t.bytes().all(|b| b.is_ascii_hexdigit())).then_some(t)
}

/// `bytes <start>-<end>/<total>` → (start, end inclusive, total).
fn content_range(v: &str) -> Option<(u64, u64, u64)> {
    let rest = v.strip_prefix("bytes ")?;
    let (range, total) = rest.split_once('/')?;
    let (s, e) = range.split_once('-')?;
    Some((s.parse().ok()?, e.parse().ok()?, total.parse().ok()?))
}

fn read_meta(p: &Path) -> Option<RemoteFile> {
    serde_json::from_slice(&std::fs::read(p).ok()?).ok()
}

/// `path` with `suffix` appended to its file name.
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_os_string();
    s.push(suffix);
    PathBuf::from(s)
}

/// Writes `bytes` to `path` durably: temp file, fsync, rename, fsync of the directory.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), PullError> {
    let tmp = with_suffix(path, ".tmp");
    let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
    f.write_all(bytes).map_err(io_err(&tmp))?;
    f.sync_all().map_err(io_err(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err(path))?;
    if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(d).and_then(|d| d.sync_all()).map_err(io_err(d))?;
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String, PullError> {
    let mut f = File::open(path).map_err(io_err(path))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

impl Http {
    /// A client with `opts`.
    ///
    /// Errors: the TLS backend cannot be initialised.
    pub fn new(opts: HttpOptions) -> Result<Self, PullError> {
        let client = reqwest::blocking::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(opts.timeout)
            .timeout(opts.timeout)
            .user_agent(concat!("deltafin/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| PullError::Invalid(format!("cannot create the HTTP client: {e}")))?;
        Ok(Http {
            client,
            opts,
            received: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            on_retry: None,
        })
    }

    /// Calls `f` before each retry's wait (after the `tracing` warning), e.g. to show it on a
    /// progress line.
    pub fn with_retry_observer(mut self, f: impl Fn(&RetryNote<'_>) + Send + Sync + 'static) -> Self {
        self.on_retry = Some(Box::new(f));
        self
    }

    /// Body bytes received so far (all requests, including failed attempts).
    pub fn bytes_received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// Requests sent so far (each redirect hop counts).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Attempts an operation gets (first try plus retries).
    pub fn max_attempts(&self) -> u32 {
        self.opts.retries + 1
    }

    /// Attempts retried so far.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    fn send(&self, url: &str, range: Option<&str>, if_range: Option<&str>) -> Result<Got, Fail> {
        let mut u = url.to_string();
        let (mut linked_etag, mut linked_size) = (None, None);
        for _ in 0..10 {
            let mut rb = self.client.get(&u);
            if let Some(r) = range {
                rb = rb.header(RANGE, r);
            }
            if let Some(t) = if_range {
                rb = rb.header(IF_RANGE, t);
            }
            if let Some(a) = self.opts.auth.as_ref().filter(|a| a.applies_to(&u)) {
                rb = rb.header(AUTHORIZATION, a.header.clone());
            }
            self.requests.fetch_add(1, Ordering::Relaxed);
            let resp = rb.send().map_err(|e| Fail::Retry(error_line(&e)))?;
            let headers = resp.headers().clone();
            if let Some(t) = header(&headers, "x-linked-etag") {
                linked_etag = Some(t);
            }
            if let Some(n) = header(&headers, "x-linked-size").and_then(|s| s.parse().ok()) {
                linked_size = Some(n);
            }
            let status = resp.status().as_u16();
            if resp.status().is_redirection() {
                let loc = header(&headers, LOCATION)
                    .ok_or_else(|| Fail::Fatal(http_err(&u, format!("redirect {status} without a Location"))))?;
                u = resp
                    .url()
                    .join(&loc)
                    .map_err(|e| Fail::Fatal(http_err(&u, format!("bad redirect Location {loc:?}: {e}"))))?
                    .to_string();
                continue;
            }
            return Ok(Got {
                resp,
                status,
                headers,
                linked_etag,
                linked_size,
            });
        }
        Err(Fail::Fatal(http_err(url, "more than 10 redirects".into())))
    }

    /// Runs `attempt` until it succeeds, fails fatally, or the retries are used up.
    fn retry<T>(&self, url: &str, mut attempt: impl FnMut() -> Result<T, Fail>) -> Result<T, PullError> {
        let mut n = 0u32;
        loop {
            match attempt() {
                Ok(v) => return Ok(v),
                Err(Fail::Fatal(e)) => return Err(e),
                Err(Fail::Retry(m)) => {
                    n += 1;
                    if n > self.opts.retries {
                        return Err(http_err(url, format!("{m} (gave up after {n} attempts)")));
                    }
                    self.retries.fetch_add(1, Ordering::Relaxed);
                    let wait = self.opts.backoff.saturating_mul(1 << (n - 1).min(16));
                    let wait = wait.min(Duration::from_secs(10));
                    tracing::warn!(
                        "{url}: {m}; retrying in {:.1} s ({n}/{})",
                        wait.as_secs_f64(),
                        self.opts.retries
                    );
                    if let Some(f) = &self.on_retry {
                        f(&RetryNote {
                            url,
                            reason: &m,
                            retry: n,
                            of: self.opts.retries,
                            wait,
                        });
                    }
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// Reads a whole body, counting bytes; a body cut short is worth a retry.
    fn body(&self, mut resp: reqwest::blocking::Response, url: &str) -> Result<Vec<u8>, Fail> {
        let announced = header(resp.headers(), CONTENT_LENGTH).and_then(|v| v.parse::<usize>().ok());
        let mut out = Vec::with_capacity(announced.unwrap_or(0).min(1 << 30));
        let mut buf = vec![0u8; 256 << 10];
        loop {
            match resp.read(&mut buf) {
                Ok(0) => return Ok(out),
                Ok(n) => {
                    self.received.fetch_add(n as u64, Ordering::Relaxed);
                    out.extend_from_slice(&buf[..n]);
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Fail::Retry(format!("reading the body of {url}: {e}"))),
            }
        }
    }

    /// GETs a small file whole; `None` when the server answers 404.
    ///
    /// Errors: other failing statuses, or the retries used up.
    pub fn get_optional(&self, url: &str) -> Result<Option<Vec<u8>>, PullError> {
        self.retry(url, || {
            let got = self.send(url, None, None)?;
            match got.status {
                200 => {}
                404 => return Ok(None),
                s => return Err(self.status_fail(url, s)),
            }
            let len = header(&got.headers, CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok());
            let body = self.body(got.resp, url)?;
            if len.is_some_and(|n| n != body.len() as u64) {
                return Err(Fail::Retry(format!("body ended after {} of {len:?} bytes", body.len())));
            }
            Ok(Some(body))
        })
    }

    /// Reads `len` bytes of `url` from `start` with a range request; returns them with what the
    /// response says about the whole file. With `expect`, a file whose size or ETag differs is
    /// [`PullError::SourceChanged`].
    ///
    /// Errors: [`PullError::RangeIgnored`] (status 200), a wrong `Content-Range`, other failing
    /// statuses, or the retries used up.
    pub fn get_range(
        &self,
        url: &str,
        start: u64,
        len: u64,
        expect: Option<&RemoteFile>,
    ) -> Result<(Vec<u8>, RemoteFile), PullError> {
        if len == 0 {
            return Ok((Vec::new(), expect.cloned().unwrap_or_default()));
        }
        let range = format!("bytes={start}-{}", start + len - 1);
        self.retry(url, || {
            let got = self.send(url, Some(&range), None)?;
            match got.status {
                206 => {}
                200 => {
                    return Err(Fail::Fatal(PullError::RangeIgnored { url: url.to_string() }));
                }
                s => return Err(self.status_fail(url, s)),
            }
            let cr = header(&got.headers, CONTENT_RANGE).unwrap_or_default();
            let Some((s, e, total)) = content_range(&cr) else {
                return Err(Fail::Fatal(http_err(
                    url,
                    format!("206 with a bad Content-Range {cr:?}"),
                )));
            };
            if s != start || e != start + len - 1 {
                return Err(Fail::Fatal(http_err(
                    url,
                    format!("asked for {range}, the server sent Content-Range {cr:?}"),
                )));
            }
            let etag = header(&got.headers, ETAG).filter(|t| !t.starts_with("W/"));
            let info = RemoteFile {
                size: total,
                sha256: got.linked_etag.as_deref().and_then(as_sha256),
                etag,
            };
            if let Some(x) = expect {
                if x.size != info.size {
                    return Err(Fail::Fatal(PullError::SourceChanged {
                        url: url.to_string(),
                        message: format!("{} bytes at install, {} now", x.size, info.size),
                    }));
                }
                if let (Some(a), Some(b)) = (&x.etag, &info.etag) {
                    if a != b {
                        return Err(Fail::Fatal(PullError::SourceChanged {
                            url: url.to_string(),
                            message: format!("ETag {a} at install, {b} now"),
                        }));
                    }
                }
                // The published sha256 is a validator too (a file replaced under the same ETag).
                if let (Some(a), Some(b)) = (&x.sha256, &info.sha256) {
                    if a != b {
                        return Err(Fail::Fatal(PullError::SourceChanged {
                            url: url.to_string(),
                            message: format!("sha256 {a} at install, {b} now"),
                        }));
                    }
                }
            }
            let body = self.body(got.resp, url)?;
            if body.len() as u64 != len {
                return Err(Fail::Retry(format!(
                    "range body ended after {} of {len} bytes",
                    body.len()
                )));
            }
            Ok((body, info))
        })
    }

    /// Streams the whole body of `url` through sha256 without storing it (`cache verify --source
    /// --whole-files`). Returns the sha256 (lowercase hex) and the bytes read.
    ///
    /// Errors: failing statuses, a body shorter than its `Content-Length`, the retries used up.
    pub fn sha256_of(&self, url: &str) -> Result<(String, u64), PullError> {
        self.stream_whole(url, None, &mut |_, _| {})
    }

    /// Streams the whole body of `url` through sha256, handing each piece to `sink` with its
    /// offset in the file; a retried attempt starts again at offset 0 (so `sink` must accept
    /// the same bytes again). With `want` (lowercase hex), a body whose sha256 differs is
    /// retried like a broken transfer (a byte corrupted on the way), and still differing after
    /// the retries is [`PullError::Checksum`]. Returns the sha256 and the bytes read.
    ///
    /// Errors: failing statuses, a body shorter than its `Content-Length`, the retries used up,
    /// [`PullError::Checksum`].
    pub fn stream_whole(
        &self,
        url: &str,
        want: Option<&str>,
        sink: &mut dyn FnMut(u64, &[u8]),
    ) -> Result<(String, u64), PullError> {
        let mut attempts = 0u32;
        let mut last_found = String::new();
        let r = self.retry(url, || {
            attempts += 1;
            last_found.clear();
            let got = self.send(url, None, None)?;
            if got.status != 200 {
                return Err(self.status_fail(url, got.status));
            }
            let len = header(&got.headers, CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok());
            let mut resp = got.resp;
            let mut h = sha2::Sha256::new();
            let mut buf = vec![0u8; 1 << 20];
            let mut n = 0u64;
            loop {
                match resp.read(&mut buf) {
                    Ok(0) => break,
                    Ok(k) => {
                        self.received.fetch_add(k as u64, Ordering::Relaxed);
                        h.update(&buf[..k]);
                        sink(n, &buf[..k]);
                        n += k as u64;
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(Fail::Retry(format!("reading the body of {url}: {e}"))),
                }
            }
            if len.is_some_and(|l| l != n) {
                return Err(Fail::Retry(format!("body ended after {n} of {len:?} bytes")));
            }
            let found: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if want.is_some_and(|w| w != found) {
                last_found = found.clone();
                return Err(Fail::Retry(format!(
                    "sha256 {found} differs from the published {}",
                    want.unwrap_or_default()
                )));
            }
            Ok((found, n))
        });
        match (r, want) {
            (Err(_), Some(w)) if !last_found.is_empty() => Err(PullError::Checksum {
                url: url.to_string(),
                expected: w.to_string(),
                found: last_found,
                attempts,
            }),
            (r, _) => r,
        }
    }

    /// Downloads `url` to `dest` (resuming a partial left by an earlier attempt or run), verifies
    /// size and, when known, sha256, and renames it into place. Returns what the server said.
    ///
    /// Errors: [`PullError::Checksum`] when every attempt's sha256 differs; failing statuses; the
    /// retries used up; I/O (no space left...), which leaves the partial for the next run.
    pub fn download(&self, url: &str, dest: &Path, progress: &dyn Transfer) -> Result<RemoteFile, PullError> {
        let part = with_suffix(dest, ".part");
        let meta = with_suffix(dest, ".part.json");
        let name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut corrupt = 0u32;
        loop {
            let info = self.retry(url, || self.download_once(url, &part, &meta, &name, progress))?;
            if let Some(want) = &info.sha256 {
                let found = sha256_file(&part)?;
                if &found != want {
                    corrupt += 1;
                    let _ = std::fs::remove_file(&part);
                    let _ = std::fs::remove_file(&meta);
                    if corrupt > self.opts.retries {
                        return Err(PullError::Checksum {
                            url: url.to_string(),
                            expected: want.clone(),
                            found,
                            attempts: corrupt,
                        });
                    }
                    tracing::warn!("{url}: sha256 {found} instead of {want}: downloading it again");
                    continue;
                }
            }
            File::open(&part).and_then(|f| f.sync_all()).map_err(io_err(&part))?;
            std::fs::rename(&part, dest).map_err(io_err(dest))?;
            if let Some(d) = dest.parent().filter(|d| !d.as_os_str().is_empty()) {
                File::open(d).and_then(|d| d.sync_all()).map_err(io_err(d))?;
            }
            let _ = std::fs::remove_file(&meta);
            return Ok(info);
        }
    }

    fn download_once(
        &self,
        url: &str,
        part: &Path,
        meta_path: &Path,
        name: &str,
        progress: &dyn Transfer,
    ) -> Result<RemoteFile, Fail> {
        let fatal_io = |p: &Path| {
            let p = p.to_path_buf();
            move |e: std::io::Error| {
                Fail::Fatal(PullError::Io {
                    path: p.clone(),
                    error: e,
                })
            }
        };
        let meta = read_meta(meta_path);
        let mut have = match (&meta, std::fs::metadata(part)) {
            (Some(m), Ok(md)) if md.len() <= m.size => md.len(),
            _ => 0,
        };
        if let Some(m) = meta.as_ref().filter(|m| have == m.size && have > 0) {
            return Ok(m.clone()); // complete partial from an earlier run: verify it
        }
        let if_range = meta.as_ref().and_then(|m| m.etag.clone());
        let range = (have > 0).then(|| format!("bytes={have}-"));
        let got = self.send(url, range.as_deref(), if_range.as_deref().filter(|_| have > 0))?;
        let etag = header(&got.headers, ETAG).filter(|t| !t.starts_with("W/"));
        let sha256 = got
            .linked_etag
            .as_deref()
            .and_then(as_sha256)
            .or_else(|| etag.as_deref().and_then(as_sha256));
        let size = match got.status {
            206 if have > 0 => {
                let cr = header(&got.headers, CONTENT_RANGE).unwrap_or_default();
                match (content_range(&cr), &meta) {
                    (Some((s, _, total)), Some(m)) if s == have && total == m.size => total,
                    _ => {
                        let _ = std::fs::remove_file(meta_path);
                        return Err(Fail::Retry(format!(
                            "resume answered with Content-Range {cr:?}: restarting the download"
                        )));
                    }
                }
            }
            200 => {
                if have > 0 {
                    tracing::warn!("{url}: the server did not resume (200 instead of 206): downloading from the start");
                }
                have = 0;
                let len = header(&got.headers, CONTENT_LENGTH).and_then(|v| v.parse::<u64>().ok());
                match len.or(got.linked_size) {
                    Some(n) => n,
                    None => return Err(Fail::Fatal(http_err(url, "no Content-Length in the response".into()))),
                }
            }
            416 => {
                let _ = std::fs::remove_file(meta_path);
                let _ = std::fs::remove_file(part);
                return Err(Fail::Retry("416 Range Not Satisfiable on resume: restarting".into()));
            }
            s => return Err(self.status_fail(url, s)),
        };
        let info = RemoteFile { size, etag, sha256 };
        if have == 0 {
            let json = serde_json::to_vec(&info).unwrap_or_default();
            write_atomic(meta_path, &json).map_err(Fail::Fatal)?;
        }
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(part)
            .map_err(fatal_io(part))?;
        f.set_len(have).map_err(fatal_io(part))?;
        use std::io::Seek;
        f.seek(std::io::SeekFrom::Start(have)).map_err(fatal_io(part))?;
        progress.begin(name, size, have);
        let mut resp = got.resp;
        let mut buf = vec![0u8; 1 << 20];
        let mut done = have;
        loop {
            let n = match resp.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Fail::Retry(format!("download interrupted after {done} bytes: {e}"))),
            };
            self.received.fetch_add(n as u64, Ordering::Relaxed);
            if done + n as u64 > size {
                let _ = std::fs::remove_file(meta_path);
                return Err(Fail::Retry(format!(
                    "server sent more than the {size} bytes it announced"
                )));
            }
            f.write_all(&buf[..n]).map_err(fatal_io(part))?;
            done += n as u64;
            progress.advance(n as u64);
        }
        if done != size {
            return Err(Fail::Retry(format!("body ended after {done} of {size} bytes")));
        }
        Ok(info)
    }
}

fn http_err(url: &str, message: String) -> PullError {
    PullError::Http {
        url: url.to_string(),
        message,
    }
}

impl Http {
    /// What a failing status means: worth a retry (408, 429, 5xx) or fatal, with a hint for 401
    /// and 403 (gated or private repositories need a token; a token that was sent was refused).
    fn status_fail(&self, url: &str, status: u16) -> Fail {
        let m = format!("HTTP {status}");
        match status {
            408 | 429 | 500..=599 => Fail::Retry(m),
            404 => Fail::Fatal(http_err(url, "not found (HTTP 404)".into())),
            401 | 403 if self.opts.auth.as_ref().is_some_and(|a| a.applies_to(url)) => Fail::Fatal(http_err(
                url,
                format!("{m}: the access token was refused (a gated repository whose terms this account has not accepted, or a token without access to it)"),
            )),
            401 | 403 => Fail::Fatal(http_err(
                url,
                format!("{m}: the repository is gated or private: give an access token with --token or HF_TOKEN"),
            )),
            _ => Fail::Fatal(http_err(url, m)),
        }
    }
}

/// A reqwest error and its causes on one line.
fn error_line(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(c) = src {
        let t = c.to_string();
        if !s.contains(&t) {
            s.push_str(": ");
            s.push_str(&t);
        }
        src = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_headers() {
        assert_eq!(content_range("bytes 0-7/100"), Some((0, 7, 100)));
        assert_eq!(content_range("bytes */100"), None);
        let h = "a".repeat(64);
        assert_eq!(as_sha256(&format!("\"{h}\"")), Some(h.clone()));
        assert_eq!(as_sha256("\"65f0-12\""), None);
        assert_eq!(
            with_suffix(Path::new("/a/b.bin"), ".part"),
            PathBuf::from("/a/b.bin.part")
        );
    }
}
