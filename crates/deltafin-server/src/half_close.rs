//! Answering a client that half-closes, without serving one that went away.
//!
//! A client may shut down its sending side once its request is out (`shutdown(SHUT_WR)`,
//! `nc -N`, some proxies) and still wait for the answer. At the TCP level that looks exactly
//! like a client that closed its socket and left: the server reads the end of the stream
//! either way. What tells them apart is what the client's kernel does with data sent to it: a
//! socket that is only shut for sending takes it; a closed one answers with a reset.
//!
//! So under [`HalfClose::Probe`] (the default), when the end of stream arrives while a request
//! is being answered (its body read to the end) and nothing of its response has been written
//! yet (hyper's own 100 Continue for `Expect: 100-continue` does not count), the connection
//! writes one interim `HTTP/1.1 100 Continue` (RFC 9110 §15.2: a client must accept 1xx
//! responses it did not ask for before the final one; hyper, curl, Python's `http.client`,
//! httpx, Go and Node skip it), hides the end of stream from hyper and checks the socket's
//! pending error every [`WATCH_PERIOD`]. A reset (the client had gone) cancels the request as
//! the end of stream always did, a round trip later; otherwise the answer is written as usual
//! and the connection closes after it. A stream whose response has already begun is not
//! probed: its next event's write finds a departed client. The decision waits until the
//! handler has read the request body to its end (hyper may have the whole body off the wire
//! before that); a body cut short on the wire never gets there, and its request fails with
//! 400 after [`BODY_GRACE`].
//!
//! What stays unseen, and is answered to the end (bounded by `max_tokens`, then discarded):
//! a client that half-closed, read the interim response and only then closed its socket; and
//! an HTTP/1.0 client that left during a non-streaming request (RFC 9110 forbids interim
//! responses to HTTP/1.0, so its end of stream is taken as a half-close: one request per
//! connection, the way `printf … | nc -N` sends it).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, Response, Version};
use axum::Router;
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::Notify;

/// What the server does when a client shuts down its sending side during a request
/// (`deltafin serve --half-close MODE`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HalfClose {
    /// Answer it unless a probe shows the client has gone (see the module documentation).
    #[default]
    Probe,
    /// Always answer: a departed client's non-streaming request runs to its end.
    Answer,
    /// Treat the end of stream as a disconnect and cancel (what uvicorn, Go's net/http and
    /// nginx do): a half-closing client gets no answer.
    Disconnect,
}

impl HalfClose {
    /// The `--half-close` names, in the order the help lists them.
    pub const NAMES: [&'static str; 3] = ["probe", "answer", "disconnect"];
}

impl std::str::FromStr for HalfClose {
    type Err = String;

    /// Errors: a name other than `probe`, `answer`, `disconnect`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "probe" => Ok(HalfClose::Probe),
            "answer" => Ok(HalfClose::Answer),
            "disconnect" => Ok(HalfClose::Disconnect),
            _ => Err(format!(
                "unknown half-close mode {s:?} (expected one of: {})",
                HalfClose::NAMES.join(", ")
            )),
        }
    }
}

/// The interim response written to a client whose end of stream arrived mid-request.
const PROBE: &[u8] = b"HTTP/1.1 100 Continue\r\n\r\n";

/// How often a probed connection's socket is checked for the client's reset.
pub const WATCH_PERIOD: Duration = Duration::from_millis(20);

/// What one connection is doing, shared by its I/O, its service and its watcher.
#[derive(Default)]
struct Phase {
    /// A request's handler was called and its response body is not finished (or dropped).
    open: bool,
    /// That request is HTTP/1.1 (an interim response is allowed).
    http11: bool,
    /// Its body has been read to the end (or it has none).
    body_done: bool,
    /// Bytes of that request's response have been written.
    responding: bool,
    /// hyper's read waiting on the held end of stream; woken when the body has been read to
    /// the end and when the answer ends.
    read_waker: Option<Waker>,
}

/// Per-connection state of the half-close handling.
#[derive(Default)]
pub(crate) struct ConnState {
    phase: Mutex<Phase>,
    /// Signalled when a probe found that the client had gone: the connection is dropped,
    /// which drops the handler and cancels its generation.
    gone: Notify,
}

impl ConnState {
    fn phase(&self) -> MutexGuard<'_, Phase> {
        self.phase.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Resolves once a probe has shown that the client is gone.
    pub(crate) async fn gone(&self) {
        self.gone.notified().await;
    }

    fn begin(&self, http11: bool, body_done: bool) {
        let mut p = self.phase();
        p.open = true;
        p.http11 = http11;
        p.body_done = body_done;
        p.responding = false;
    }

    fn end(&self) {
        let mut p = self.phase();
        p.open = false;
        if let Some(w) = p.read_waker.take() {
            w.wake();
        }
    }

    fn body_read(&self) {
        let mut p = self.phase();
        p.body_done = true;
        if let Some(w) = p.read_waker.take() {
            w.wake();
        }
    }
}

/// The connection's socket as hyper sees it: reads and writes pass through, except a client's
/// end of stream during a request (handled as [`HalfClose`] says).
pub(crate) struct ProbedIo {
    inner: TcpStream,
    state: Arc<ConnState>,
    mode: HalfClose,
    /// The part of the interim response the socket did not take at once; written before
    /// hyper's next bytes.
    unsent: &'static [u8],
    /// Every byte hyper wrote has been flushed (its own buffer is empty then: hyper flushes
    /// the socket only after writing all it holds), so an interim response cannot land
    /// inside an earlier response.
    clean: bool,
    /// What became of the client's end of stream.
    eof: Eof,
    /// While the end of stream waits for the handler to read the request body to its end:
    /// when this fires first, the body was cut short on the wire.
    body_grace: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// The client's end of stream, as [`ProbedIo`] handles it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Eof {
    /// Not read yet.
    NotSeen,
    /// Read during a request and hidden from hyper; `decided` once the probe (or none) was
    /// chosen, which needs the request body read to its end.
    Held { decided: bool },
    /// Handed to hyper.
    Passed,
}

/// How long an end of stream that arrives before the handler has read the request body to
/// its end waits for it. hyper may take the whole body off the wire before the handler reads
/// it (then it comes within microseconds); a body cut short on the wire never comes, and the
/// request then fails (400) after this wait instead of the body timeout.
pub const BODY_GRACE: Duration = Duration::from_secs(1);

impl ProbedIo {
    pub(crate) fn new(inner: TcpStream, state: Arc<ConnState>, mode: HalfClose) -> Self {
        ProbedIo {
            inner,
            state,
            mode,
            unsent: &[],
            clean: true,
            eof: Eof::NotSeen,
            body_grace: None,
        }
    }

    /// Writes the interim response and starts the watcher. Errors: the write failed (the
    /// client has gone: the caller hands the error to hyper, which closes the connection).
    fn probe(&mut self) -> io::Result<()> {
        match self.inner.try_write(PROBE) {
            Ok(n) => self.unsent = &PROBE[n..],
            // A full send buffer with nothing of a response in it: no room to probe; answer.
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(e) => return Err(e),
        }
        self.watch();
        Ok(())
    }

    /// Checks the socket's pending error until the request ends; a reset means the client
    /// closed its socket (an RST answers data sent to a closed socket).
    #[cfg(unix)]
    fn watch(&self) {
        use std::os::fd::AsFd;
        let socket = match self.inner.as_fd().try_clone_to_owned() {
            Ok(fd) => std::net::TcpStream::from(fd),
            Err(e) => {
                tracing::debug!("half-close probe: cannot watch the socket: {e}");
                return;
            }
        };
        let state = Arc::clone(&self.state);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(WATCH_PERIOD);
            loop {
                tick.tick().await;
                if !state.phase().open {
                    return;
                }
                if !matches!(socket.take_error(), Ok(None)) {
                    tracing::debug!("client reset the connection after its end of stream: gone");
                    state.gone.notify_one();
                    return;
                }
            }
        });
    }

    #[cfg(not(unix))]
    fn watch(&self) {}

    /// Writes what is left of the interim response. Ready(Ok) once nothing is left.
    fn poll_unsent(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.unsent.is_empty() {
            let n = std::task::ready!(Pin::new(&mut self.inner).poll_write(cx, self.unsent))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.unsent = &self.unsent[n..];
        }
        Poll::Ready(Ok(()))
    }
}

impl AsyncRead for ProbedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        match me.eof {
            Eof::Passed => return Poll::Ready(Ok(())),
            Eof::Held { .. } => {}
            Eof::NotSeen => {
                let before = buf.filled().len();
                std::task::ready!(Pin::new(&mut me.inner).poll_read(cx, buf))?;
                if buf.filled().len() > before || buf.remaining() == 0 {
                    return Poll::Ready(Ok(()));
                }
                // The client's end of stream: between requests, or in `disconnect` mode, it
                // goes to hyper (which closes the connection, cancelling any request).
                let (open, body_done) = {
                    let p = me.state.phase();
                    (p.open, p.body_done)
                };
                tracing::debug!(
                    "end of stream: {:?}, request open {open}, body read {body_done}",
                    me.mode
                );
                if !open || me.mode == HalfClose::Disconnect {
                    me.eof = Eof::Passed;
                    return Poll::Ready(Ok(()));
                }
                me.eof = Eof::Held { decided: false };
                if !body_done {
                    me.body_grace = Some(Box::pin(tokio::time::sleep(BODY_GRACE)));
                }
            }
        }
        let mut p = me.state.phase();
        if !p.open {
            // The answer is out: now hyper may see the end (and close the connection).
            me.eof = Eof::Passed;
            return Poll::Ready(Ok(()));
        }
        if !p.body_done {
            let cut_short = me.body_grace.as_mut().is_some_and(|g| g.as_mut().poll(cx).is_ready());
            if cut_short {
                // The body never came to its end: hyper fails the request (400).
                me.eof = Eof::Passed;
                return Poll::Ready(Ok(()));
            }
            p.read_waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        me.body_grace = None;
        if me.eof == (Eof::Held { decided: false }) {
            me.eof = Eof::Held { decided: true };
            // No interim response once the response has begun, to HTTP/1.0, or while an
            // earlier response is not flushed.
            if me.mode == HalfClose::Probe && !p.responding && p.http11 && me.clean {
                drop(p);
                if let Err(e) = me.probe() {
                    me.eof = Eof::Passed;
                    return Poll::Ready(Err(e));
                }
                p = me.state.phase();
            }
        }
        p.read_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

impl AsyncWrite for ProbedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        me.clean = false;
        std::task::ready!(me.poll_unsent(cx))?;
        let n = std::task::ready!(Pin::new(&mut me.inner).poll_write(cx, buf))?;
        // hyper's own interim response to `Expect: 100-continue` (the same bytes as the
        // probe) does not begin the response.
        if n > 0 && buf[..n] != PROBE[..n.min(PROBE.len())] {
            let mut p = me.state.phase();
            if p.open {
                p.responding = true;
            }
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        std::task::ready!(me.poll_unsent(cx))?;
        std::task::ready!(Pin::new(&mut me.inner).poll_flush(cx))?;
        me.clean = true;
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        std::task::ready!(me.poll_unsent(cx))?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

/// The router as hyper's service, recording each request's start and its response's end in
/// the connection's [`ConnState`].
pub(crate) struct TrackedService {
    inner: TowerToHyperService<Router>,
    state: Arc<ConnState>,
}

impl TrackedService {
    pub(crate) fn new(router: Router, state: Arc<ConnState>) -> Self {
        TrackedService {
            inner: TowerToHyperService::new(router),
            state,
        }
    }
}

impl hyper::service::Service<Request<Incoming>> for TrackedService {
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        self.state.begin(
            req.version() == Version::HTTP_11,
            hyper::body::Body::is_end_stream(req.body()),
        );
        let end = EndOfAnswer(Arc::clone(&self.state));
        let state = Arc::clone(&self.state);
        let req = req.map(|body| TrackedRequestBody { body, state });
        let answer = hyper::service::Service::call(&self.inner, req);
        Box::pin(async move {
            let res = answer.await?;
            Ok(res.map(|body| TrackedBody { body, _end: end }))
        })
    }
}

/// Marks the request's answer finished when dropped (its body written to the end, or the
/// handler or body dropped on a disconnect).
struct EndOfAnswer(Arc<ConnState>);

impl Drop for EndOfAnswer {
    fn drop(&mut self) {
        self.0.end();
    }
}

/// A request body that records in [`ConnState`] when it has been read to the end.
pub(crate) struct TrackedRequestBody {
    body: Incoming,
    state: Arc<ConnState>,
}

impl hyper::body::Body for TrackedRequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.body).poll_frame(cx));
        if frame.is_none() || (matches!(frame, Some(Ok(_))) && self.body.is_end_stream()) {
            self.state.body_read();
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A response body that ends its request's answer when hyper drops it.
pub(crate) struct TrackedBody {
    body: Body,
    _end: EndOfAnswer,
}

impl hyper::body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}
