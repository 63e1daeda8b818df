//! The server-sent-event reply of a generation, shared by the OpenAI and the Anthropic
//! endpoints: each keeps its own per-reply state ([`JobStream`]) that turns the worker's
//! [`JobEvent`]s into events in its [`Outbox`]; [`sse_reply`] sends those as they come.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream};
use tokio::sync::mpsc::UnboundedReceiver;

use deltafin_engine::session::{Delta, GenerationOutput};

use crate::worker::JobEvent;

/// The events of one streamed reply waiting to go out, and the job they come from.
pub(crate) struct Outbox {
    rx: UnboundedReceiver<JobEvent>,
    /// Events ready to go out, first queued first.
    pub(crate) queue: VecDeque<Event>,
    /// The reply is complete: no event follows those queued.
    pub(crate) done: bool,
}

impl Outbox {
    /// An empty outbox for the events of the job behind `rx`.
    pub(crate) fn new(rx: UnboundedReceiver<JobEvent>) -> Self {
        Outbox {
            rx,
            queue: VecDeque::new(),
            done: false,
        }
    }
}

/// The state of one streamed reply.
pub(crate) trait JobStream: Send + 'static {
    /// Where the reply's events wait.
    fn outbox(&mut self) -> &mut Outbox;
    /// Queues the events of one decode step's output.
    fn on_delta(&mut self, d: Delta);
    /// Queues the events that end the reply of a finished generation.
    fn on_done(&mut self, out: GenerationOutput);
    /// Queues the error event that ends the reply.
    fn fail(&mut self, message: &str);

    /// Queues the events one job event (None: the job ended without a result) makes.
    fn on_event(&mut self, ev: Option<JobEvent>) {
        match ev {
            Some(JobEvent::Delta(d)) => self.on_delta(d),
            Some(JobEvent::Done(Ok(out))) => self.on_done(out),
            Some(JobEvent::Done(Err(e))) => self.fail(&format!("generation failed: {e}")),
            None => self.fail("the generation ended without a result"),
        }
    }
}

/// The SSE response of `st`: its queued events, then those of each job event as it arrives,
/// until it is done; a keep-alive comment every 5 s.
pub(crate) fn sse_reply<S: JobStream>(st: S) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events = stream::unfold(st, |mut st| async move {
        loop {
            let out = st.outbox();
            if let Some(e) = out.queue.pop_front() {
                return Some((Ok(e), st));
            }
            if out.done {
                return None;
            }
            let ev = out.rx.recv().await;
            st.on_event(ev);
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
}
