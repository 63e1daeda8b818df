//! The reader pool: a fixed set of threads serving two queues, demand before speculative.
//!
//! Scheduling rules (all decided under the store's one lock, so they hold by construction):
//! - A reader always takes a queued demand read first; a demand read is one `pread` of the whole
//!   record.
//! - A speculative read starts, and each of its chunks (`spec_chunk` bytes) starts, only while no
//!   demand read is queued or running, and at most `max_spec_active` of them run at once. Between
//!   chunks a speculative read that finds demand work yields: it goes back to the front of the
//!   speculative queue with its buffer and progress. So a demand read waits at most for the
//!   speculative chunks already in the device (≤ `max_spec_active × spec_chunk` bytes).
//! - Every record has at most one read in flight (`State::inflight`); a demand request for a record
//!   being read speculatively joins that read and promotes it to demand priority.

use std::collections::{HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering;
use std::sync::mpsc::Sender;
use std::sync::Arc;

use deltafin_format::AlignedBuf;

use super::cache::{Cache, Insert};
use super::io::{round_up, ReadFailure, DIRECT_ALIGN};
use super::{Expert, Key, Shared};

/// What a waiter receives: its index in the request and the record or the failure.
pub(crate) type Delivery = (usize, Result<Arc<Expert>, ReadFailure>);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Demand,
    Speculative,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// In `demand_q` or `spec_q` (a yielded speculative read keeps its progress).
    Queued,
    /// Held by a reader.
    Running,
}

pub(crate) struct Waiter {
    pub(crate) tx: Sender<Delivery>,
    pub(crate) index: usize,
}

/// A record whose read is queued or running.
pub(crate) struct InFlight {
    pub(crate) class: Class,
    pub(crate) phase: Phase,
    pub(crate) waiters: Vec<Waiter>,
}

/// One record read, possibly partly done.
pub(crate) struct Job {
    pub(crate) key: Key,
    pub(crate) offset: u64,
    buf: Option<AlignedBuf>,
    /// Bytes read so far.
    done: usize,
    /// Of those, bytes read while the job was speculative.
    spec_bytes: u64,
}

impl Job {
    pub(crate) fn new(key: Key, offset: u64) -> Self {
        Job {
            key,
            offset,
            buf: None,
            done: 0,
            spec_bytes: 0,
        }
    }

    /// Whether any bytes have been read (a prefetch that has started saves demand time).
    pub(crate) fn started(&self) -> bool {
        self.done > 0
    }
}

/// Everything behind the store's lock.
pub(crate) struct State {
    pub(crate) cache: Cache,
    pub(crate) inflight: HashMap<Key, InFlight>,
    pub(crate) demand_q: VecDeque<Job>,
    pub(crate) spec_q: VecDeque<Job>,
    pub(crate) active_demand: usize,
    pub(crate) active_spec: usize,
    /// The last prediction per layer, consumed by that layer's next demand fetch (recall).
    pub(crate) predictions: HashMap<u32, Vec<u32>>,
    pub(crate) shutdown: bool,
}

impl State {
    pub(crate) fn new(cache: Cache) -> Self {
        State {
            cache,
            inflight: HashMap::new(),
            demand_q: VecDeque::new(),
            spec_q: VecDeque::new(),
            active_demand: 0,
            active_spec: 0,
            predictions: HashMap::new(),
            shutdown: false,
        }
    }

    fn demand_pending(&self) -> bool {
        !self.demand_q.is_empty() || self.active_demand > 0
    }
}

/// Body of each reader thread.
pub(crate) fn reader_loop(sh: Arc<Shared>) {
    loop {
        let job = {
            let mut st = sh.lock();
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(job) = st.demand_q.pop_front() {
                    st.active_demand += 1;
                    set_phase(&mut st, &job.key, Phase::Running);
                    break job;
                }
                if !st.demand_pending() && st.active_spec < sh.max_spec_active {
                    if let Some(job) = st.spec_q.pop_front() {
                        st.active_spec += 1;
                        set_phase(&mut st, &job.key, Phase::Running);
                        #[cfg(test)]
                        sh.hooks.log(super::tests::Event::SpecChunk(job.key));
                        break job;
                    }
                }
                st = sh.work.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let key = job.key;
        let run = std::panic::catch_unwind(AssertUnwindSafe(|| run_job(&sh, job)));
        if run.is_err() {
            fail_key(
                &sh,
                key,
                ReadFailure::Io(std::io::ErrorKind::Other, "expert reader thread panicked".into()),
            );
        }
    }
}

fn set_phase(st: &mut State, key: &Key, phase: Phase) {
    if let Some(f) = st.inflight.get_mut(key) {
        f.phase = phase;
    }
}

/// Reads `job` (the first span was granted by `reader_loop`) to completion, or yields it back to
/// the speculative queue when demand work appears.
fn run_job(sh: &Shared, mut job: Job) {
    let (layer, expert) = (job.key.0 as usize, job.key.1 as usize);
    let length = sh.records[layer][expert].length as usize;
    let padded = round_up(length as u64) as usize;
    let mut first = true;
    loop {
        let class = {
            let mut st = sh.lock();
            let Some(class) = st.inflight.get(&job.key).map(|f| f.class) else {
                return; // cannot happen: only the running reader removes its entry
            };
            if class == Class::Speculative && !first && st.demand_pending() {
                st.active_spec -= 1;
                set_phase(&mut st, &job.key, Phase::Queued);
                st.spec_q.push_front(job);
                drop(st);
                sh.work.notify_all();
                return;
            }
            #[cfg(test)]
            if class == Class::Speculative && !first {
                sh.hooks.log(super::tests::Event::SpecChunk(job.key));
            }
            class
        };
        first = false;
        #[cfg(test)]
        if class == Class::Speculative {
            sh.hooks.before_spec_chunk();
        }
        let end = match class {
            Class::Demand => padded,
            Class::Speculative => (job.done + sh.spec_chunk).min(padded),
        };
        let buf = job.buf.get_or_insert_with(|| sh.pool.take(padded));
        let start = job.done;
        let read = sh
            .pack
            .read_span(&mut buf.as_mut_slice()[start..end], job.offset + start as u64);
        let n = match read {
            Ok(n) => n,
            Err(e) => return complete(sh, job, Err(e.into())),
        };
        job.done += n;
        match class {
            Class::Demand => sh.c.bytes_read_demand.fetch_add(n as u64, Ordering::Relaxed),
            Class::Speculative => {
                job.spec_bytes += n as u64;
                sh.c.bytes_read_speculative.fetch_add(n as u64, Ordering::Relaxed)
            }
        };
        if job.done >= length {
            // A reused buffer holds an older record past a short read at EOF: keep the padding
            // zero, as in the pack.
            if let Some(b) = job.buf.as_mut() {
                b.as_mut_slice()[job.done..].fill(0);
            }
            let r = verify(sh, &job, length);
            return complete(sh, job, r);
        }
        if n < end - start {
            let e = std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "record of {length} bytes at offset {} ends at end of file after {} bytes",
                    job.offset, job.done
                ),
            );
            return complete(sh, job, Err(e.into()));
        }
    }
}

/// Checks the record's XXH3-64 the first time it is read.
fn verify(sh: &Shared, job: &Job, length: usize) -> Result<(), ReadFailure> {
    let rec = &sh.records[job.key.0 as usize][job.key.1 as usize];
    if rec.verified.load(Ordering::Acquire) {
        return Ok(());
    }
    let data = job.buf.as_ref().map_or(&[][..], |b| &b.as_slice()[..length]);
    let found = xxhash_rust::xxh3::xxh3_64(data);
    if found != rec.xxh3 {
        return Err(ReadFailure::Checksum {
            expected: rec.xxh3,
            found,
        });
    }
    rec.verified.store(true, Ordering::Release);
    Ok(())
}

/// Finishes a read: caches the record, hands it (or the failure) to every waiter, updates the
/// speculative-waste counter, and wakes readers that may now start speculative work.
fn complete(sh: &Shared, mut job: Job, result: Result<(), ReadFailure>) {
    let (layer, expert) = (job.key.0 as usize, job.key.1 as usize);
    let delivery: Result<Arc<Expert>, ReadFailure> = result.map(|()| {
        Arc::new(Expert {
            buf: job.buf.take().unwrap_or_else(|| AlignedBuf::zeroed(0, DIRECT_ALIGN)),
            len: sh.records[layer][expert].length as usize,
            layout: sh.layout.clone(),
            pool: Some(sh.pool.clone()),
        })
    });
    if let Some(b) = job.buf.take() {
        sh.pool.put(b); // the read failed
    }
    let mut st = sh.lock();
    let Some(f) = st.inflight.remove(&job.key) else { return };
    match f.class {
        Class::Demand => st.active_demand -= 1,
        Class::Speculative => st.active_spec -= 1,
    }
    #[cfg(test)]
    if f.class == Class::Demand {
        sh.hooks.log(super::tests::Event::DemandDone(job.key));
    }
    // Speculative bytes nobody has asked for yet; a waiter means demand used them.
    let unused = if f.waiters.is_empty() { job.spec_bytes } else { 0 };
    match &delivery {
        Ok(expert) => match st.cache.insert(job.key, expert.clone(), unused) {
            Insert::Cached(evicted) => {
                sh.c.evictions.fetch_add(evicted.len() as u64, Ordering::Relaxed);
                let wasted: u64 = evicted.iter().map(|e| e.spec_unused).sum();
                sh.c.prefetch_wasted_bytes.fetch_add(wasted, Ordering::Relaxed);
            }
            Insert::NoRoom => {
                sh.c.prefetch_wasted_bytes.fetch_add(unused, Ordering::Relaxed);
            }
        },
        Err(_) => {
            sh.c.prefetch_wasted_bytes.fetch_add(unused, Ordering::Relaxed);
        }
    }
    for w in f.waiters {
        // A dropped `Fetch` no longer listens; the record is cached all the same.
        let _ = w.tx.send((w.index, delivery.clone()));
    }
    drop(st);
    sh.work.notify_all();
}

/// Fails the read of `key` after a reader panicked mid-job.
fn fail_key(sh: &Shared, key: Key, failure: ReadFailure) {
    let mut st = sh.lock();
    let Some(f) = st.inflight.remove(&key) else { return };
    match (f.class, f.phase) {
        (Class::Demand, Phase::Running) => st.active_demand -= 1,
        (Class::Speculative, Phase::Running) => st.active_spec -= 1,
        (_, Phase::Queued) => {
            st.demand_q.retain(|j| j.key != key);
            st.spec_q.retain(|j| j.key != key);
        }
    }
    for w in f.waiters {
        let _ = w.tx.send((w.index, Err(failure.clone())));
    }
    drop(st);
    sh.work.notify_all();
}
