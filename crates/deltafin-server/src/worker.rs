//! The compute thread, the generation slot and the request queue.
//!
//! One std thread owns the [`Session`] (model + KV cache) and runs jobs from a channel; async
//! handlers never block on compute. Exactly one generation runs at a time; up to `max_queue`
//! more wait for it in arrival order (FIFO). A request first takes a [`Ticket`] (a place in
//! "running or queued": 429 only when all `1 + max_queue` places are taken), then prepares its
//! prompt, then waits for the slot. Waiting is cancellable: a request dropped while queued
//! (client gone) gives its place back at once. A running job holds its [`Permit`] and releases
//! it *before* sending its final event, so a client that sends its next request as soon as it
//! has the answer never sees a spurious 429. A job is cancelled when its event receiver is
//! dropped (the client disconnected or its handler was dropped): the session checks before
//! every forward pass.
//!
//! A panic in a generation is caught: that request gets 500 naming the panic and the session
//! starts from a clean cache. Should the compute thread itself die, [`Worker::alive`] turns
//! false (`/health` answers 503) and every request fails at once instead of waiting.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use deltafin_engine::session::{Delta, GenerationOutput, GenerationRequest, Session};
use deltafin_engine::{panic_message, EngineError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::metrics::Metrics;

/// What a running job reports.
// `Done` is large (the generation's statistics) but sent once per job: boxing it saves nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum JobEvent {
    /// One decode step's output.
    Delta(Delta),
    /// The end: the output, or an error message.
    Done(Result<GenerationOutput, String>),
}

struct Job {
    req: GenerationRequest,
    events: UnboundedSender<JobEvent>,
    permit: Permit,
    /// When the request was admitted (time to first token counts from here, queueing included).
    admitted: Instant,
}

/// How long a generation request re-checks a full queue before getting 429 (see
/// [`Worker::admit`]).
pub const BUSY_GRACE: Duration = Duration::from_millis(250);

/// Default `--max-queue`: generation requests that may wait behind the running one.
pub const DEFAULT_MAX_QUEUE: usize = 8;

/// A request's place among the running and queued generations (dropping it gives the place
/// back). Holds the queue-depth gauge up while the request waits.
pub struct Ticket {
    /// None only once moved into the running job's [`Permit`].
    place: Option<OwnedSemaphorePermit>,
    slot: Arc<Semaphore>,
    current: Arc<Mutex<Option<UnboundedSender<JobEvent>>>>,
    metrics: Arc<Metrics>,
    admitted: Instant,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.metrics.queue_left();
    }
}

/// The running job's hold on the slot and its place; dropping it frees both.
pub struct Permit {
    _slot: OwnedSemaphorePermit,
    _place: OwnedSemaphorePermit,
    current: Arc<Mutex<Option<UnboundedSender<JobEvent>>>>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Ok(mut c) = self.current.lock() {
            *c = None;
        }
    }
}

/// Handle to the compute thread.
pub struct Worker {
    jobs: Mutex<mpsc::Sender<Job>>,
    /// `1 + max_queue` places: the running generation and the queued ones.
    places: Arc<Semaphore>,
    /// The single generation slot; tokio's semaphore is fair, so waiters are served FIFO.
    slot: Arc<Semaphore>,
    /// The running job's event sender: closed means its client is gone.
    current: Arc<Mutex<Option<UnboundedSender<JobEvent>>>>,
    /// False once the compute thread has exited.
    alive: Arc<AtomicBool>,
    metrics: Arc<Metrics>,
}

/// Sets `alive` to false when the compute thread ends, by return or by panic.
struct AliveGuard(Arc<AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Worker {
    /// Starts the compute thread owning `session`; up to `max_queue` generation requests may
    /// wait behind the running one. `step_delay` sleeps after each decode step (a testing aid
    /// that makes generations long enough to overlap; zero in production).
    pub fn start(
        mut session: Session,
        metrics: Arc<Metrics>,
        step_delay: Duration,
        max_queue: usize,
    ) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let model = Arc::clone(session.model());
        metrics.set_store_probe(Box::new(move || model.store().counters()));
        let alive = Arc::new(AtomicBool::new(true));
        let guard = AliveGuard(Arc::clone(&alive));
        let m = Arc::clone(&metrics);
        std::thread::Builder::new()
            .name("deltafin-compute".into())
            .spawn(move || {
                let _guard = guard;
                let metrics = m;
                while let Ok(job) = rx.recv() {
                    let Job {
                        req,
                        events,
                        permit,
                        admitted,
                    } = job;
                    metrics.generation_started();
                    let closed = || events.is_closed();
                    let mut last_token: Option<Instant> = None;
                    let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        session.generate(&req, &closed, |d| {
                            if d.token.is_some() {
                                metrics.add_completion_tokens(1);
                                let now = Instant::now();
                                match last_token {
                                    None => metrics.observe_ttft(now - admitted),
                                    Some(t) => metrics.observe_token_latency(now - t),
                                }
                                last_token = Some(now);
                            }
                            let ok = events.send(JobEvent::Delta(d)).is_ok();
                            if ok && !step_delay.is_zero() {
                                std::thread::sleep(step_delay);
                            }
                            ok
                        })
                    }));
                    // A bug must not take the server down: answer 500 naming the panic and
                    // start from a clean cache.
                    let result = run.unwrap_or_else(|payload| {
                        let msg = panic_message(payload.as_ref());
                        tracing::error!("a generation panicked: {msg}");
                        session.reset();
                        Err(EngineError::Invalid(format!(
                            "internal error: the generation panicked: {msg}"
                        )))
                    });
                    metrics.generation_finished(result.as_ref().ok());
                    drop(permit);
                    let _ = events.send(JobEvent::Done(result.map_err(|e| e.to_string())));
                }
            })?;
        Ok(Worker {
            jobs: Mutex::new(tx),
            places: Arc::new(Semaphore::new(max_queue.saturating_add(1))),
            slot: Arc::new(Semaphore::new(1)),
            current: Arc::new(Mutex::new(None)),
            alive,
            metrics,
        })
    }

    /// Whether the compute thread is running (false once it has died).
    pub fn alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }

    /// Takes a place among the running and queued generations, or None when all are taken
    /// (the caller answers 429) or the compute thread is gone.
    ///
    /// A client's disconnect becomes visible only when the server next writes to it (at the
    /// next token), so a request that arrives right after another client hung up could find
    /// every place taken. Places are therefore re-checked for up to [`BUSY_GRACE`]; when the
    /// running generation is found abandoned meanwhile, it is waited for (it stops within one
    /// decode step; capped at 120 s).
    pub async fn admit(&self) -> Option<Ticket> {
        let start = Instant::now();
        let deadline = start + Duration::from_secs(120);
        loop {
            if !self.alive() {
                return None;
            }
            if let Ok(place) = Arc::clone(&self.places).try_acquire_owned() {
                self.metrics.queue_entered();
                return Some(Ticket {
                    place: Some(place),
                    slot: Arc::clone(&self.slot),
                    current: Arc::clone(&self.current),
                    metrics: Arc::clone(&self.metrics),
                    admitted: Instant::now(),
                });
            }
            let abandoned = match self.current.lock() {
                Ok(c) => c.as_ref().is_some_and(|tx| tx.is_closed()),
                Err(_) => false,
            };
            let in_grace = start.elapsed() < BUSY_GRACE;
            if (!abandoned && !in_grace) || Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits (FIFO) for the generation slot with `ticket`, then hands `req` to the compute
    /// thread; its events arrive on the returned receiver (drop it to cancel). Dropping the
    /// returned future while it waits leaves the queue.
    ///
    /// Errors: the compute thread is gone.
    pub async fn submit(&self, ticket: Ticket, req: GenerationRequest) -> Result<UnboundedReceiver<JobEvent>, String> {
        const GONE: &str = "the compute thread has stopped; restart the server";
        let slot = Arc::clone(&ticket.slot)
            .acquire_owned()
            .await
            .map_err(|_| GONE.to_string())?;
        if !self.alive() {
            return Err(GONE.into());
        }
        let (tx, rx) = unbounded_channel();
        if let Ok(mut c) = ticket.current.lock() {
            *c = Some(tx.clone());
        }
        let admitted = ticket.admitted;
        let current = Arc::clone(&ticket.current);
        let mut ticket = ticket;
        let place = ticket.place.take().ok_or_else(|| GONE.to_string())?;
        // Leaving the queue: the ticket's Drop lowers the queue gauge.
        drop(ticket);
        let permit = Permit {
            _slot: slot,
            _place: place,
            current,
        };
        let jobs = self.jobs.lock().map_err(|_| GONE.to_string())?;
        jobs.send(Job {
            req,
            events: tx,
            permit,
            admitted,
        })
        .map_err(|_| GONE.to_string())?;
        Ok(rx)
    }
}
