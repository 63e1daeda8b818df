//! The compute thread and the one-generation slot.
//!
//! One std thread owns the [`Session`] (model + KV cache) and runs jobs from a channel; async
//! handlers never block on compute. A job holds the [`Permit`] of the single generation slot
//! and releases it *before* sending its final event, so a client that sends its next request
//! as soon as it has the answer never sees a spurious 429. A job is cancelled when its event
//! receiver is dropped (the client disconnected or its handler was dropped): the session checks
//! before every forward pass.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use deltafin_engine::session::{Delta, GenerationOutput, GenerationRequest, Session};
use deltafin_engine::EngineError;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

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
}

/// The single generation slot.
#[derive(Default)]
struct Slot {
    busy: AtomicBool,
    /// The running job's event sender: closed means its client is gone.
    current: Mutex<Option<UnboundedSender<JobEvent>>>,
}

/// How long a generation request re-checks a busy slot before getting 429 (see
/// [`Worker::try_acquire`]).
pub const BUSY_GRACE: Duration = Duration::from_millis(250);

/// Holding the slot; dropping it frees the slot.
pub struct Permit {
    slot: Arc<Slot>,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Ok(mut c) = self.slot.current.lock() {
            *c = None;
        }
        self.slot.busy.store(false, Ordering::Release);
    }
}

/// Handle to the compute thread.
pub struct Worker {
    jobs: Mutex<mpsc::Sender<Job>>,
    slot: Arc<Slot>,
}

impl Worker {
    /// Starts the compute thread owning `session`. `step_delay` sleeps after each decode step
    /// (a testing aid that makes generations long enough to overlap; zero in production).
    pub fn start(mut session: Session, metrics: Arc<Metrics>, step_delay: Duration) -> std::io::Result<Self> {
        let (tx, rx) = mpsc::channel::<Job>();
        let model = Arc::clone(session.model());
        metrics.set_store_probe(Box::new(move || model.store().counters()));
        std::thread::Builder::new()
            .name("deltafin-compute".into())
            .spawn(move || {
                while let Ok(job) = rx.recv() {
                    let Job { req, events, permit } = job;
                    metrics.generation_started();
                    let closed = || events.is_closed();
                    let run = std::panic::catch_unwind(AssertUnwindSafe(|| {
                        session.generate(&req, &closed, |d| {
                            if d.token.is_some() {
                                metrics.add_completion_tokens(1);
                            }
                            let ok = events.send(JobEvent::Delta(d)).is_ok();
                            if ok && !step_delay.is_zero() {
                                std::thread::sleep(step_delay);
                            }
                            ok
                        })
                    }));
                    // A bug must not take the server down: answer 500 and start from a clean cache.
                    let result = run.unwrap_or_else(|_| {
                        session.reset();
                        Err(EngineError::Invalid("internal error: the generation panicked".into()))
                    });
                    metrics.generation_finished(result.as_ref().ok());
                    drop(permit);
                    let _ = events.send(JobEvent::Done(result.map_err(|e| e.to_string())));
                }
            })?;
        Ok(Worker {
            jobs: Mutex::new(tx),
            slot: Arc::new(Slot::default()),
        })
    }

    /// Takes the generation slot, or None while another generation runs. A running generation
    /// whose client has gone is waited for (it stops within one decode step).
    ///
    /// A client's disconnect becomes visible only when the server next writes to it (at the
    /// next token), so a request that arrives right after another client hung up would see the
    /// slot busy. The slot is therefore re-checked for up to [`BUSY_GRACE`] before answering
    /// busy; a generation found abandoned meanwhile is then waited for.
    pub async fn try_acquire(&self) -> Option<Permit> {
        // A forward pass of a large model can take seconds; an abandoned generation always ends
        // after its current one, so waiting for it is bounded by one step (capped here).
        let start = Instant::now();
        let deadline = start + Duration::from_secs(120);
        loop {
            if self
                .slot
                .busy
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(Permit {
                    slot: Arc::clone(&self.slot),
                });
            }
            let abandoned = match self.slot.current.lock() {
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

    /// Queues a generation; its events arrive on the returned receiver (drop it to cancel).
    pub fn submit(&self, req: GenerationRequest, permit: Permit) -> Result<UnboundedReceiver<JobEvent>, String> {
        let (tx, rx) = unbounded_channel();
        if let Ok(mut c) = permit.slot.current.lock() {
            *c = Some(tx.clone());
        }
        let jobs = self.jobs.lock().map_err(|_| "the compute thread is gone".to_string())?;
        jobs.send(Job {
            req,
            events: tx,
            permit,
        })
        .map_err(|_| "the compute thread is gone".to_string())?;
        Ok(rx)
    }
}
