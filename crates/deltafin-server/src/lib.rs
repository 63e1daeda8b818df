//! deltafin's HTTP API: OpenAI-compatible (`/v1/models`, `/v1/completions`,
//! `/v1/chat/completions`) and Anthropic Messages (`/v1/messages`) endpoints with server-sent
//! events, `/health` and Prometheus `/metrics`.
//!
//! Threads: the caller's (small) tokio runtime serves HTTP; one dedicated compute thread owns
//! the engine [`Session`] ([`worker`]). Exactly one generation runs at a time; up to
//! `max_queue` more wait in arrival order, and a request beyond those gets 429 with
//! `Retry-After`, while models, health and metrics keep answering. Connections are bounded
//! in number and time ([`conn`]); prompts are bounded in bytes before they are tokenized
//! ([`limits`]). This crate never touches tensors: it validates requests, renders prompts with
//! the chat template, and turns the session's deltas into JSON and SSE.

#![deny(missing_docs)]

mod agent;
pub mod anthropic;
pub mod body;
mod chat_messages;
pub mod conn;
pub mod error;
pub mod half_close;
pub mod limits;
pub mod metrics;
pub mod openai;
mod sampling_fields;
mod sse;
pub mod structured;
pub mod tools;
pub mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use deltafin_engine::session::{Delta, GenerationOutput, GenerationRequest, Session, TokenLogprob};
use deltafin_tokenizer::{Tokenizer, TokenizerError};
use serde_json::json;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::Semaphore;

pub use conn::{serve, ConnLimits};
pub use error::{ApiError, Flavor};
pub use half_close::HalfClose;
use metrics::Metrics;
use worker::{JobEvent, Ticket, Worker};

/// Server settings (the `deltafin serve` flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients must name (`model` field); other ids get 404.
    pub model_id: String,
    /// When set, requests must carry `Authorization: Bearer KEY` or `x-api-key: KEY`.
    pub api_key: Option<String>,
    /// Upper bound on a request's `max_tokens` (larger values get 400) and the default when a
    /// request gives none (capped by the context left after the prompt).
    pub max_tokens: Option<usize>,
    /// Largest accepted request body, bytes (larger gets 413).
    pub max_request_bytes: usize,
    /// Sleep after each decode step: a testing aid (0 in normal use).
    pub step_delay: Duration,
    /// Generation requests that may wait behind the running one (`--max-queue`); one more
    /// gets 429. 0: a request while one generates gets 429.
    pub max_queue: usize,
    /// Connection limits and timeouts ([`serve`] applies them; the body timeout is applied by
    /// the router).
    pub conn: ConnLimits,
}

impl ServerConfig {
    /// Defaults: no API key, no max_tokens cap, 16 MiB bodies, a queue of
    /// [`worker::DEFAULT_MAX_QUEUE`], [`ConnLimits::default`].
    pub fn new(model_id: impl Into<String>) -> Self {
        ServerConfig {
            model_id: model_id.into(),
            api_key: None,
            max_tokens: None,
            max_request_bytes: 16 << 20,
            step_delay: Duration::ZERO,
            max_queue: worker::DEFAULT_MAX_QUEUE,
            conn: ConnLimits::default(),
        }
    }
}

/// Shared state of the handlers.
pub struct AppState {
    pub(crate) config: ServerConfig,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) context_length: usize,
    pub(crate) vocab_size: usize,
    pub(crate) worker: Worker,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) created: u64,
    /// One prompt is tokenized at a time (bounds the memory of concurrent large prompts).
    pub(crate) prepare: Semaphore,
    /// The markup family of tool calls and reasoning, from the tokenizer's tokens.
    pub(crate) family: Option<tools::Family>,
    /// Whether generations must spell special tokens out for the family's parser.
    pub(crate) keep_special_tokens: bool,
    /// Compiles structured-output and forced-tool-call constraints (built on first use).
    pub(crate) structured: structured::Structured,
}

type Shared = Arc<AppState>;

/// Builds the router and starts the compute thread that owns `session`.
///
/// Errors: the compute thread could not be spawned.
pub fn router(config: ServerConfig, session: Session) -> std::io::Result<Router> {
    let metrics = Arc::new(Metrics::default());
    let tokenizer = Arc::clone(session.tokenizer());
    let context_length = session.context_length();
    let vocab_size = session.vocab_size();
    let structured = structured::Structured::new(Arc::clone(&tokenizer), vocab_size, session.eos_token_ids().to_vec());
    let body_limit = config.max_request_bytes;
    let body_timeout = config.conn.body_timeout;
    let worker = Worker::start(session, Arc::clone(&metrics), config.step_delay, config.max_queue)?;
    let family = tools::Family::detect(&tokenizer);
    let keep_special_tokens = family.is_some_and(|f| f.needs_special_tokens(&tokenizer));
    let state: Shared = Arc::new(AppState {
        config,
        tokenizer,
        context_length,
        vocab_size,
        worker,
        metrics,
        created: unix_now(),
        prepare: Semaphore::new(1),
        family,
        keep_special_tokens,
        structured,
    });
    Ok(Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/v1/models", get(openai::list_models))
        .route("/v1/models/{id}", get(openai::get_model))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(Arc::clone(&state), auth))
        .layer(middleware::from_fn_with_state(body_limit, declared_length))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count_requests))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(body_timeout))
        .with_state(state))
}

/// `{"status": "ok"}`, or 503 with `{"status": "error", "error": ...}` once the compute thread
/// has died (generation requests then fail at once).
async fn health(State(s): State<Shared>) -> Response {
    if s.worker.alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "error", "error": "the compute thread has stopped; restart the server"})),
        )
            .into_response()
    }
}

/// 413 at once for a request whose `Content-Length` exceeds `--max-request-bytes`, before any
/// of its body is read (a client declaring 10 GB is not waited for).
async fn declared_length(State(limit): State<usize>, req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared {
        if n > limit as u64 {
            let e = ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!(
                    "request body is larger than the server's limit (--max-request-bytes): Content-Length {n} > {limit}"
                ),
            )
            .code("request_too_large");
            return match flavor_of(req.uri().path()) {
                Flavor::Anthropic => e.anthropic().into_response(),
                Flavor::OpenAi => e.into_response(),
            };
        }
    }
    next.run(req).await
}

async fn metrics_text(State(s): State<Shared>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        s.metrics.render(),
    )
        .into_response()
}

async fn not_found(req: Request) -> ApiError {
    let e = ApiError::route_not_found(req.uri().path());
    if req.uri().path().starts_with("/v1/messages") {
        e.anthropic()
    } else {
        e
    }
}

async fn method_not_allowed(req: Request) -> ApiError {
    let mut e = ApiError::bad_request(format!(
        "method {} is not allowed on {}",
        req.method(),
        req.uri().path()
    ));
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e
}

fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/v1/messages") {
        Flavor::Anthropic
    } else {
        Flavor::OpenAi
    }
}

/// With `--api-key`, everything but `/health` needs `Authorization: Bearer KEY` or
/// `x-api-key: KEY`. The scheme name is case-insensitive (RFC 9110 §11.1: `bearer KEY` works).
async fn auth(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let Some(key) = s.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    if req.uri().path() == "/health" {
        return next.run(req).await;
    }
    let h = req.headers();
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim_start().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    let x_api_key = h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    if bearer == Some(key) || x_api_key == Some(key) {
        return next.run(req).await;
    }
    let e = ApiError::unauthorized();
    match flavor_of(req.uri().path()) {
        Flavor::Anthropic => e.anthropic().into_response(),
        Flavor::OpenAi => e.into_response(),
    }
}

/// Counts every request exactly once in `deltafin_requests_total`: with its response's status
/// once the response body has been sent in full, or with [`CLIENT_CLOSED`] when the client went
/// away first (the handler dropped before answering, or a stream dropped before its end).
async fn count_requests(State(s): State<Shared>, req: Request, next: Next) -> Response {
    let endpoint = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "other".into());
    let mut count = RequestCount {
        metrics: Arc::clone(&s.metrics),
        endpoint,
        status: None,
        recorded: false,
    };
    let resp = next.run(req).await;
    count.status = Some(resp.status().as_u16());
    resp.map(|body| {
        axum::body::Body::new(CountedBody {
            inner: body,
            count,
            finished: false,
        })
    })
}

/// Status label of a request whose client closed the connection before the whole response
/// was sent (nginx's "client closed request").
pub const CLIENT_CLOSED: u16 = 499;

/// Records its request when dropped: with `status` once the response is complete, else
/// [`CLIENT_CLOSED`].
struct RequestCount {
    metrics: Arc<Metrics>,
    endpoint: String,
    /// The response's status; None while the handler runs.
    status: Option<u16>,
    recorded: bool,
}

impl RequestCount {
    fn record(&mut self, complete: bool) {
        if self.recorded {
            return;
        }
        self.recorded = true;
        let status = match self.status {
            Some(s) if complete => s,
            _ => CLIENT_CLOSED,
        };
        self.metrics.record_request(&self.endpoint, status);
    }
}

impl Drop for RequestCount {
    fn drop(&mut self) {
        self.record(false);
    }
}

/// A response body that records its request when it ends (complete) or is dropped (complete
/// only if it had reached its end).
struct CountedBody {
    inner: axum::body::Body,
    count: RequestCount,
    finished: bool,
}

impl http_body::Body for CountedBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = &mut *self;
        let r = std::pin::Pin::new(&mut this.inner).poll_frame(cx);
        if let std::task::Poll::Ready(None) = r {
            this.finished = true;
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for CountedBody {
    fn drop(&mut self) {
        let complete = self.finished || http_body::Body::is_end_stream(&self.inner);
        self.count.record(complete);
    }
}

pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A unique-enough response id: `prefix-<time><counter>` in hex.
pub(crate) fn new_id(prefix: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    format!("{prefix}{nanos:x}{:04x}", N.fetch_add(1, Ordering::Relaxed) & 0xffff)
}

impl AppState {
    /// 404 unless `model` is the served id.
    pub(crate) fn check_model(&self, model: &str) -> Result<(), ApiError> {
        if model == self.config.model_id {
            Ok(())
        } else {
            Err(ApiError::model_not_found(model, &self.config.model_id))
        }
    }

    /// The generation budget: the request's value (≥ 1, within `--max-tokens`) or the default,
    /// and prompt plus budget within the context length. `param` names the budget field,
    /// `prompt_param` the prompt's (`prompt` or `messages`): a context overflow names the
    /// prompt when it alone fills the context or the request set no budget, else the budget.
    pub(crate) fn max_new_tokens(
        &self,
        requested: Option<i64>,
        param: &str,
        prompt_param: &str,
        prompt_len: usize,
    ) -> Result<usize, ApiError> {
        let ctx = self.context_length;
        let n = match requested {
            Some(v) if v < 1 => {
                return Err(ApiError::invalid_param(
                    param,
                    format!("`{param}` must be at least 1, got {v}"),
                ));
            }
            Some(v) => {
                let v = usize::try_from(v).unwrap_or(usize::MAX);
                if let Some(cap) = self.config.max_tokens {
                    if v > cap {
                        return Err(ApiError::invalid_param(
                            param,
                            format!("`{param}` is {v}, above this server's limit of {cap} (--max-tokens)"),
                        ));
                    }
                }
                v
            }
            None => {
                let left = ctx.saturating_sub(prompt_len).max(1);
                self.config.max_tokens.map_or(left, |cap| cap.min(left))
            }
        };
        if prompt_len.saturating_add(n) > ctx {
            return Err(ApiError::bad_request(format!(
                "This model's maximum context length is {ctx} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {n} for the completion). Please reduce the prompt or `{param}`.",
                prompt_len.saturating_add(n)
            ))
            .param(if requested.is_some() && prompt_len < ctx { param } else { prompt_param })
            .code("context_length_exceeded"));
        }
        Ok(n)
    }

    /// Takes a place among the running and queued generations: 429 when `--max-queue`
    /// requests already wait, 503 when the compute thread has died. Taken before the prompt is
    /// tokenized, so that a request that will not be served costs no tokenization.
    pub(crate) async fn admit(&self) -> Result<Ticket, ApiError> {
        if !self.worker.alive() {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the compute thread has stopped; restart the server",
            ));
        }
        self.worker
            .admit()
            .await
            .ok_or_else(|| ApiError::busy(self.config.max_queue))
    }

    /// Runs `f` (tokenization, template rendering: CPU and memory proportional to the prompt)
    /// with the request's place held, one preparation at a time, off the HTTP runtime.
    pub(crate) async fn prepare<T: Send + 'static>(
        self: &Arc<Self>,
        ticket: Ticket,
        f: impl FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<(Ticket, T), ApiError> {
        let _one = self
            .prepare
            .acquire()
            .await
            .map_err(|_| ApiError::internal("the server is shutting down"))?;
        let s = Arc::clone(self);
        let v = off_runtime(move || f(&s)).await?;
        Ok((ticket, v))
    }

    /// Compiles `constraint` for a prompt ending in `prompt_tail` (off the HTTP runtime).
    ///
    /// Errors: 400 naming `param` when llguidance rejects the grammar (e.g. an unsupported
    /// schema feature).
    pub(crate) async fn constrain(
        self: &Arc<Self>,
        constraint: structured::Constraint,
        prompt_tail: String,
        param: &'static str,
    ) -> Result<Arc<dyn deltafin_engine::constraint::Grammar>, ApiError> {
        let s = Arc::clone(self);
        off_runtime(move || {
            s.structured
                .compile(&constraint, s.family, &prompt_tail)
                .map_err(|e| ApiError::invalid_param(param, format!("`{param}` cannot be enforced: {e}")))
        })
        .await
    }

    /// Whether a generation parsed by `family`'s parser must spell special tokens out.
    pub(crate) fn keeps_special_tokens(&self, family: Option<tools::Family>) -> bool {
        if family == self.family {
            self.keep_special_tokens
        } else {
            family.is_some_and(|f| f.needs_special_tokens(&self.tokenizer))
        }
    }

    /// Waits in the queue with `ticket` (FIFO; dropping the future leaves the queue) and runs
    /// `req`.
    pub(crate) async fn start(
        &self,
        ticket: Ticket,
        req: GenerationRequest,
    ) -> Result<UnboundedReceiver<JobEvent>, ApiError> {
        self.worker
            .submit(ticket, req)
            .await
            .map_err(|e| ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e))
    }
}

/// Maps tokenizer failures on client input (template exceptions, bad messages) to 400.
pub(crate) fn template_error(e: TokenizerError) -> ApiError {
    match e {
        TokenizerError::TemplateException { message } => ApiError::invalid_param(
            "messages",
            format!("the chat template rejected the conversation: {message}"),
        ),
        other => ApiError::invalid_param(
            "messages",
            format!("cannot render the conversation with the chat template: {other}"),
        ),
    }
}

/// Runs `f` (tokenization, template rendering: CPU work proportional to the prompt) on the
/// blocking pool so that the HTTP runtime keeps answering.
pub(crate) async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}

/// A rendered and tokenized chat prompt.
pub(crate) struct ChatPrompt {
    pub ids: Vec<u32>,
    /// The last characters of the rendered text (where the generation prompt may have opened
    /// a think block).
    pub tail: String,
}

/// Checks the conversation's size in bytes ([`limits::check_prompt_bytes`]), takes a place in
/// the queue ([`AppState::admit`]: 429 when full), then renders `messages` with the chat
/// template (generation prompt appended; `extra`: template variables such as `tools`) and
/// tokenizes the result.
pub(crate) async fn chat_prompt(
    s: &Arc<AppState>,
    messages: Vec<serde_json::Value>,
    extra: serde_json::Value,
) -> Result<(Ticket, ChatPrompt), ApiError> {
    limits::check_prompt_bytes(
        s.context_length,
        messages.iter().map(limits::text_bytes).sum::<usize>() + limits::text_bytes(&extra),
        "messages",
    )?;
    let ticket = s.admit().await?;
    s.prepare(ticket, move |s| {
        if let Some(e) = s.tokenizer.chat_template_error() {
            return Err(ApiError::internal(format!(
                "the model's chat template is unusable: {e}"
            )));
        }
        let template = s.tokenizer.chat_template().ok_or_else(|| {
            ApiError::bad_request("this model has no chat template; use /v1/completions with a raw prompt")
        })?;
        let rendered = template.render(&messages, true, &extra).map_err(template_error)?;
        let prompt = s
            .tokenizer
            .encode(&rendered, false)
            .map_err(|e| ApiError::invalid_param("messages", format!("cannot tokenize the conversation: {e}")))?;
        if prompt.is_empty() {
            return Err(ApiError::invalid_param(
                "messages",
                "the conversation renders to zero tokens",
            ));
        }
        let mut start = rendered.len().saturating_sub(256);
        while !rendered.is_char_boundary(start) {
            start += 1;
        }
        Ok(ChatPrompt {
            ids: prompt,
            tail: rendered[start..].to_string(),
        })
    })
    .await
}

/// A finished non-streaming generation.
pub(crate) struct Collected {
    pub output: GenerationOutput,
    pub logprobs: Vec<TokenLogprob>,
}

/// Waits for a generation to finish, gathering log-probabilities. Dropping the future (client
/// gone) drops the receiver, which cancels the generation.
pub(crate) async fn collect(mut rx: UnboundedReceiver<JobEvent>) -> Result<Collected, ApiError> {
    let mut logprobs = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            JobEvent::Delta(Delta { logprob, .. }) => logprobs.extend(logprob),
            JobEvent::Done(Ok(output)) => return Ok(Collected { output, logprobs }),
            JobEvent::Done(Err(e)) => return Err(ApiError::internal(format!("generation failed: {e}"))),
        }
    }
    Err(ApiError::internal("the generation ended without a result"))
}

/// Validated sampling settings shared by the endpoints.
pub(crate) fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    max_temperature: f64,
) -> Result<deltafin_engine::sampler::SamplingParams, ApiError> {
    let temperature = temperature.unwrap_or(0.0);
    if !(0.0..=max_temperature).contains(&temperature) {
        return Err(ApiError::invalid_param(
            "temperature",
            format!("`temperature` must be between 0 and {max_temperature}, got {temperature}"),
        ));
    }
    let top_p = top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid_param(
            "top_p",
            format!("`top_p` must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => usize::try_from(k).unwrap_or(usize::MAX),
        Some(k) => {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("`top_k` must be positive (or 0 / -1 for no limit), got {k}"),
            ))
        }
    };
    Ok(deltafin_engine::sampler::SamplingParams {
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        seed: seed.map(|s| s as u64),
        ..Default::default()
    })
}

/// `stop`: a string or a list of non-empty strings.
pub(crate) fn stop_strings(v: Option<&serde_json::Value>, param: &str) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            param,
            format!("`{param}` must be a non-empty string or a list of non-empty strings"),
        )
    };
    match v {
        None | Some(serde_json::Value::Null) => Ok(Vec::new()),
        Some(serde_json::Value::String(s)) if !s.is_empty() => Ok(vec![s.clone()]),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                serde_json::Value::String(s) if !s.is_empty() => Ok(s.clone()),
                _ => Err(bad()),
            })
            .collect(),
        _ => Err(bad()),
    }
}
