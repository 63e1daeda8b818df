//! The server-sent-event reply of a generation, shared by the OpenAI and the Anthropic
//! endpoints: each keeps its own per-reply state ([`JobStream`]) that turns the worker's
//! [`JobEvent`]s into queued events; [`sse_reply`] sends those as they come.

use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use futures_util::stream::{self, Stream};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::worker::JobEvent;

/// The state of one streamed reply: events ready to go out, and the job they come from.
pub(crate) trait JobStream: Send + 'static {
    /// The next event ready to go out, first queued first.
    fn pop_ready(&mut self) -> Option<Event>;
    /// Whether the reply is complete: no event follows those queued.
    fn is_done(&self) -> bool;
    /// The worker's events of this job.
    fn rx(&mut self) -> &mut UnboundedReceiver<JobEvent>;
    /// Queues the events one job event (None: the job ended without a result) makes.
    fn on_event(&mut self, ev: Option<JobEvent>);
}

/// The SSE response of `st`: its queued events, then those of each job event as it arrives,
/// until it is done; a keep-alive comment every 5 s.
pub(crate) fn sse_reply<S: JobStream>(st: S) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.pop_ready() {
                return Some((Ok(e), st));
            }
            if st.is_done() {
                return None;
            }
            let ev = st.rx().recv().await;
            st.on_event(ev);
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
}
