//! The accept loop: HTTP/1.1 connections bounded in number and in time.
//!
//! What production HTTP servers bound, and how this one does (hyper's connection builder):
//! - **Connections**: at most [`ConnLimits::max_connections`] are open at once; further clients
//!   wait in the kernel's accept backlog until one closes (the process never runs out of file
//!   descriptors, and `/health` is answered as soon as a place frees).
//! - **Idle and slow headers**: a connection must deliver a complete request head within
//!   [`ConnLimits::idle_timeout`] of being opened or of its previous response, else it is
//!   closed (an idle keep-alive connection, or one that sends its headers byte by byte).
//! - **Slow bodies**: a request body that stalls for [`ConnLimits::body_timeout`] (for example
//!   one shorter than its `Content-Length`) gets 408 and the connection closes; a declared
//!   `Content-Length` above the body limit gets 413 before any of the body is read.
//! - **Half-close**: a client that shuts down its sending side after its request still gets the
//!   response, and one that closed its socket is still cancelled at once: an interim
//!   `100 Continue` tells them apart ([`HalfClose`], [`crate::half_close`]).
//!
//! A response being generated or streamed is not timed: generation time is bounded by
//! `max_tokens` and the context length, and a client that goes away cancels it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use tokio::sync::Semaphore;

use crate::half_close::{ConnState, HalfClose, ProbedIo, TrackedService};

/// Connection limits and timeouts (the `deltafin serve` flags `--max-connections`,
/// `--idle-timeout`, `--body-timeout`, `--half-close`).
#[derive(Debug, Clone)]
pub struct ConnLimits {
    /// Most connections open at once; more wait to be accepted. Default 256, well below the
    /// usual 1024 file descriptors of a process.
    pub max_connections: usize,
    /// Longest wait for a complete request head: on a new connection, and between requests
    /// of a keep-alive connection (the idle timeout). Default 30 s.
    pub idle_timeout: Duration,
    /// Longest wait for the next part of a request body (408 after it). Default 30 s.
    pub body_timeout: Duration,
    /// What a client's end of stream during a request means. Default [`HalfClose::Probe`].
    pub half_close: HalfClose,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            max_connections: 256,
            idle_timeout: Duration::from_secs(30),
            body_timeout: Duration::from_secs(30),
            half_close: HalfClose::Probe,
        }
    }
}

/// Serves `router` on `listener` with `limits` until `shutdown` resolves, then stops accepting
/// and waits for open connections to finish their responses.
///
/// Errors: none today (accept errors such as running out of file descriptors are logged and
/// retried after a short pause, as `axum::serve` does); the `Result` leaves room for them.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    limits: &ConnLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let places = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout)
        .half_close(false) // ProbedIo holds back a half-closing client's end of stream
        .keep_alive(true);
    tokio::pin!(shutdown);
    loop {
        let place = tokio::select! {
            p = Arc::clone(&places).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break, // never closed
            },
            _ = &mut shutdown => break,
        };
        let stream = tokio::select! {
            r = listener.accept() => match r {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!("accepting a connection failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let state = Arc::new(ConnState::default());
        let io = ProbedIo::new(stream, Arc::clone(&state), limits.half_close);
        let service = TrackedService::new(router.clone(), Arc::clone(&state));
        let conn = graceful.watch(builder.serve_connection(TokioIo::new(io), service));
        tokio::spawn(async move {
            tokio::select! {
                r = conn => if let Err(e) = r {
                    tracing::debug!("connection closed: {e}");
                },
                // Dropping the connection drops the handler, which cancels its generation.
                () = state.gone() => tracing::debug!("client gone after a half-close probe"),
            }
            drop(place);
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
