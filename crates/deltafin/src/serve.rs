//! `deltafin serve`: the OpenAI-compatible and Anthropic Messages HTTP server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use deltafin_engine::session::Session;
use deltafin_engine::CausalLm;
use deltafin_format::ModelDir;
use deltafin_server::{HalfClose, ServerConfig};
use deltafin_tokenizer::Tokenizer;

use crate::size;

/// Flags of `deltafin serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: crate::model_path::ModelPath,
    /// Address to listen on (loopback by default; use 0.0.0.0 to expose the server).
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0 picks a free one).
    #[arg(long, default_value_t = 8000, allow_negative_numbers = true)]
    port: u16,
    /// Require `Authorization: Bearer KEY` (or `x-api-key: KEY`) on every request but /health.
    #[arg(long)]
    api_key: Option<String>,
    /// Largest `max_tokens` a request may ask for, and the default when it gives none
    /// (default: whatever the context leaves after the prompt).
    #[arg(long, allow_negative_numbers = true)]
    max_tokens: Option<usize>,
    /// Largest request body, e.g. 1MiB (larger bodies get 413).
    #[arg(long, value_parser = size::parse_size, default_value = "16MiB", allow_negative_numbers = true)]
    max_request_bytes: u64,
    #[command(flatten)]
    load: crate::model_args::LoadArgs,
    /// Model id clients send in `model` (default: the model directory's name).
    #[arg(long)]
    model_id: Option<String>,
    /// Generation requests that may wait (FIFO) behind the running one; one more gets 429.
    /// 0: a request while one generates gets 429.
    #[arg(long, default_value_t = deltafin_server::worker::DEFAULT_MAX_QUEUE, allow_negative_numbers = true)]
    max_queue: usize,
    /// Most connections open at once; further clients wait to be accepted.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true)]
    max_connections: usize,
    /// Seconds a connection may take to send a request's headers, and may stay idle between
    /// requests (keep-alive), before it is closed.
    #[arg(long, default_value_t = 30, allow_negative_numbers = true)]
    idle_timeout: u64,
    /// Seconds a request body may stall before the request fails with 408.
    #[arg(long, default_value_t = 30, allow_negative_numbers = true)]
    body_timeout: u64,
    /// A client that shuts down its sending side during a request: `probe` answers it unless
    /// an interim `100 Continue` shows it has gone (then its request is cancelled); `answer`
    /// always answers (a departed client's non-streaming request runs to its end); `disconnect`
    /// cancels (no answer). `--half-close` alone means `answer`.
    #[arg(long, value_name = "MODE", default_value = "probe", num_args = 0..=1, default_missing_value = "answer",
          value_parser = |s: &str| s.parse::<HalfClose>())]
    half_close: HalfClose,
    /// Testing aid: sleep this many milliseconds after each decode step.
    #[arg(long, hide = true, default_value_t = 0, allow_negative_numbers = true)]
    debug_step_delay_ms: u64,
}

/// Refuses flag values that would start a server that cannot work as asked, before the model
/// loads: `--max-tokens 0` (every request without `max_tokens` would fail), an empty or
/// padded `--api-key` (empty would turn authentication off; clients' keys are compared
/// trimmed), an empty `--model-id` (no request could name it).
fn check_flags(a: &ServeArgs) -> Result<()> {
    if a.max_tokens == Some(0) {
        bail!("--max-tokens must be at least 1");
    }
    if let Some(key) = &a.api_key {
        if key.is_empty() {
            bail!("--api-key is empty; give a key, or leave the flag out to serve without authentication");
        }
        if key.trim() != key {
            bail!("--api-key must not start or end with whitespace");
        }
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if a.idle_timeout == 0 {
        bail!("--idle-timeout must be at least 1 second");
    }
    if a.body_timeout == 0 {
        bail!("--body-timeout must be at least 1 second");
    }
    if a.model_id.as_deref().is_some_and(|id| id.trim().is_empty()) {
        bail!("--model-id is empty; give an id, or leave the flag out to use the model directory's name");
    }
    Ok(())
}

/// Loads the model and serves until Ctrl-C or SIGTERM.
pub fn run(a: &ServeArgs) -> Result<()> {
    check_flags(a)?;
    let dir = ModelDir::open(&a.model)?;
    let budget = crate::model_args::ram_budget(a.load.ram_budget);
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&a.model).with_context(|| format!("loading the tokenizer of {}", a.model.display()))?,
    );
    if let Some(e) = tokenizer.chat_template_error() {
        eprintln!("warning: {e}: chat requests will fail; /v1/completions works");
    }
    let eos = deltafin_tokenizer::eos_token_ids_union(&a.model, &tokenizer)?;
    let (_network, model) =
        crate::model_args::open_model(&dir, budget, &a.load.store, &a.load.passes, &a.load.device, true)?;
    a.load.store.warm_pinned(model.as_ref());
    let model: Arc<dyn CausalLm> = Arc::from(model);
    let model_id = match &a.model_id {
        Some(id) => id.clone(),
        None => a
            .model
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "deltafin".into()),
    };
    let context = model.context_length();
    let mut session = Session::new(model, tokenizer, eos);
    session.set_prefill_chunk(a.load.passes.prefill_chunk);
    session.set_speculate(a.load.passes.speculate);
    let mut config = ServerConfig::new(model_id.clone());
    config.api_key = a.api_key.clone();
    config.max_tokens = a.max_tokens;
    config.max_request_bytes = usize::try_from(a.max_request_bytes).unwrap_or(usize::MAX);
    config.step_delay = Duration::from_millis(a.debug_step_delay_ms);
    config.max_queue = a.max_queue;
    config.conn = deltafin_server::ConnLimits {
        max_connections: a.max_connections,
        idle_timeout: Duration::from_secs(a.idle_timeout),
        body_timeout: Duration::from_secs(a.body_timeout),
        half_close: a.half_close,
    };
    let conn = config.conn.clone();

    // HTTP is light; compute runs on its own thread inside the server.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("deltafin-http")
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let result = rt.block_on(async move {
        let addr: SocketAddr = format!("{}:{}", a.host, a.port)
            .parse()
            .or_else(|_| {
                std::net::ToSocketAddrs::to_socket_addrs(&(a.host.as_str(), a.port))
                    .ok()
                    .and_then(|mut it| it.next())
                    .ok_or(())
            })
            .map_err(|_| anyhow::anyhow!("cannot resolve --host {}", a.host))?;
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        if !local.ip().is_loopback() && config.api_key.is_none() {
            eprintln!("warning: listening on {local} without --api-key: anyone who can reach it can use the model");
        }
        let router = deltafin_server::router(config, session).context("starting the compute thread")?;
        eprintln!("deltafin serve: model `{model_id}` (context {context} tokens) listening on http://{local}/v1");
        // Graceful shutdown lets in-flight answers finish, but a long generation must not hold
        // the process: 5 s after the signal it stops anyway.
        let (signalled_tx, signalled_rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            shutdown_signal().await;
            let _ = signalled_tx.send(());
        };
        let grace = async move {
            if signalled_rx.await.is_ok() {
                tokio::time::sleep(Duration::from_secs(5)).await;
            } else {
                std::future::pending::<()>().await;
            }
        };
        tokio::select! {
            r = deltafin_server::serve(listener, router, &conn, shutdown) => r?,
            _ = grace => eprintln!("deltafin serve: requests still running after 5 s; stopping anyway"),
        }
        eprintln!("deltafin serve: stopped");
        Ok(())
    });
    // Don't wait for tasks of connections still open (a cancelled stream's).
    rt.shutdown_timeout(Duration::from_millis(500));
    result
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
