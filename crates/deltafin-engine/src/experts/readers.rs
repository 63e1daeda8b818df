//! The reader pool: a fixed set of threads serving two queues, demand before speculative.
//!
//! Scheduling rules (all decided under the store's one lock, so they hold by construction):
//! - A reader always takes queued demand work first. A demand read is split into chunks of
//!   `demand_chunk` bytes (4 KiB-aligned, so O_DIRECT holds), and readers take chunks in (request
//!   order, file offset) order: every chunk of the first record of a fetch before any chunk of
//!   the second, and so on. With `readers` chunks in flight the device keeps its queue depth,
//!   yet the records of a fetch complete one after the other, the first after about 1/n of the
//!   fetch's read time, instead of all together at the end; each record is checksummed and
//!   delivered by the reader that lands its last chunk, so the caller computes expert 1 while
//!   experts 2..n are still being read.
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

use super::cache::{Cache, Insert};
use super::io::{round_up, ReadFailure};
use super::{Expert, Key, RecordBuf, Shared};

/// A demand read split into chunks that readers take in order.
pub(crate) struct Chunked {
    offset: u64,
    /// Record length (data bytes) and its 4 KiB-rounded span.
    length: usize,
    padded: usize,
    /// Allocated when the first chunk is handed out (from the buffer pool, or the buffer of a
    /// promoted speculative read).
    buf: Option<RecordBuf>,
    /// Start of `buf`, taken once when `buf` is set, so readers never form a reference to the
    /// whole buffer while others write their chunks.
    base: *mut u8,
    /// First byte not yet handed to a reader.
    next: usize,
    /// Chunks being read.
    running: usize,
    /// Bytes read speculatively before a demand request promoted the read.
    spec_bytes: u64,
    /// The first chunk failure; the rest of the record is then not read.
    failure: Option<ReadFailure>,
}

// SAFETY: `base` points into `buf`'s heap mapping, owned by this struct; it is only dereferenced
// by the reader a chunk was handed to, for that chunk's disjoint byte range, and the record (with
// its buffer) is removed from the state only after every handed-out chunk has reported back.
unsafe impl Send for Chunked {}

impl Chunked {
    /// A demand read of `length` bytes at `offset`, continuing a speculative read that had read
    /// `done` bytes into `buf` (`None`, 0 for a fresh read).
    pub(crate) fn new(offset: u64, length: usize, buf: Option<RecordBuf>, done: usize, spec_bytes: u64) -> Self {
        let mut c = Chunked {
            offset,
            length,
            padded: round_up(length as u64) as usize,
            buf: None,
            base: std::ptr::null_mut(),
            next: done,
            running: 0,
            spec_bytes,
            failure: None,
        };
        if let Some(b) = buf {
            c.set_buf(b);
        }
        c
    }

    /// Promotes a queued (possibly partly read) speculative read.
    pub(crate) fn from_job(mut job: Job, length: usize) -> Self {
        Chunked::new(job.offset, length, job.buf.take(), job.done, job.spec_bytes)
    }

    fn set_buf(&mut self, mut b: RecordBuf) {
        self.base = b.as_mut_slice().as_mut_ptr();
        self.buf = Some(b);
    }

    /// Every chunk has reported back.
    fn finished(&self) -> bool {
        self.next >= self.padded && self.running == 0
    }
}

/// One chunk handed to a reader: bytes `start..end` of record `key`, read into `dst`.
struct ChunkTask {
    key: Key,
    start: usize,
    end: usize,
    /// File offset of `start`.
    pos: u64,
    /// Record length: a short read at EOF is fine once it covers the record's data.
    length: usize,
    dst: *mut u8,
}

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
    buf: Option<RecordBuf>,
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
    /// Demand reads in progress (queued or running), by record.
    pub(crate) demand: HashMap<Key, Chunked>,
    /// Records of `demand` with chunks not yet handed out, in the order they are served.
    pub(crate) demand_q: VecDeque<Key>,
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
            demand: HashMap::new(),
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

    /// Queues a demand read behind those already queued.
    pub(crate) fn queue_demand(&mut self, key: Key, read: Chunked) {
        self.demand.insert(key, read);
        self.demand_q.push_back(key);
    }

    /// Hands out the next demand chunk: the next bytes of the first queued record.
    fn take_chunk(&mut self, sh: &Shared) -> Option<ChunkTask> {
        let &key = self.demand_q.front()?;
        let Some(rec) = self.demand.get_mut(&key) else {
            self.demand_q.pop_front();
            return None;
        };
        if rec.buf.is_none() {
            rec.set_buf(sh.pool.take(rec.padded));
        }
        let start = rec.next;
        let end = start.saturating_add(sh.demand_chunk).min(rec.padded);
        rec.next = end;
        rec.running += 1;
        let task = ChunkTask {
            key,
            start,
            end,
            pos: rec.offset + start as u64,
            length: rec.length,
            // SAFETY: `start < padded = buf.len()`, so the offset stays inside the mapping.
            dst: unsafe { rec.base.add(start) },
        };
        if end >= rec.padded {
            self.demand_q.pop_front();
        }
        self.active_demand += 1;
        set_phase(self, &key, Phase::Running);
        #[cfg(test)]
        sh.hooks.log(super::tests::Event::DemandChunk(key, start));
        Some(task)
    }
}

enum Task {
    Chunk(ChunkTask),
    Spec(Job),
}

/// Body of each reader thread.
pub(crate) fn reader_loop(sh: Arc<Shared>) {
    loop {
        let task = {
            let mut st = sh.lock();
            loop {
                if st.shutdown {
                    return;
                }
                if let Some(t) = st.take_chunk(&sh) {
                    break Task::Chunk(t);
                }
                if !st.demand_pending() && st.active_spec < sh.max_spec_active {
                    if let Some(job) = st.spec_q.pop_front() {
                        st.active_spec += 1;
                        set_phase(&mut st, &job.key, Phase::Running);
                        #[cfg(test)]
                        sh.hooks.log(super::tests::Event::SpecChunk(job.key));
                        break Task::Spec(job);
                    }
                }
                st = sh.work.wait(st).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
        };
        let job = match task {
            Task::Chunk(t) => {
                run_chunk(&sh, t);
                continue;
            }
            Task::Spec(job) => job,
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
            Err(e) => return finish_job(sh, job, Err(e.into())),
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
            let r = verify(sh, job.key, job.buf.as_ref(), length);
            return finish_job(sh, job, r);
        }
        if n < end - start {
            let e = std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "record of {length} bytes at offset {} ends at end of file after {} bytes",
                    job.offset, job.done
                ),
            );
            return finish_job(sh, job, Err(e.into()));
        }
    }
}

/// Reads one demand chunk; the reader that lands a record's last chunk verifies and delivers it.
fn run_chunk(sh: &Shared, t: ChunkTask) {
    #[cfg(test)]
    sh.hooks.before_demand_chunk(t.start);
    let read = std::panic::catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `dst..dst + (end - start)` lies inside the record's buffer (end ≤ padded =
        // buffer length), no other reader was handed these bytes, nothing reads the buffer
        // before the record finishes, and the buffer lives until this chunk reports back below.
        let dst = unsafe { std::slice::from_raw_parts_mut(t.dst, t.end - t.start) };
        let n = sh.pack.read_span(dst, t.pos)?;
        if t.start + n < t.end.min(t.length) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "record of {} bytes at offset {} ends at end of file after {} bytes",
                    t.length,
                    t.pos - t.start as u64,
                    t.start + n
                ),
            ));
        }
        // A reused buffer holds an older record past a short read at EOF: keep the padding
        // zero, as in the pack.
        dst[n..].fill(0);
        Ok(n)
    }));
    #[cfg(test)]
    sh.hooks.after_demand_chunk();
    let result: Result<usize, ReadFailure> = match read {
        Ok(Ok(n)) => Ok(n),
        Ok(Err(e)) => Err(e.into()),
        Err(_) => Err(ReadFailure::Io(
            std::io::ErrorKind::Other,
            "expert reader thread panicked".into(),
        )),
    };
    if let Ok(n) = result {
        sh.c.bytes_read_demand.fetch_add(n as u64, Ordering::Relaxed);
    }
    let done = {
        let mut guard = sh.lock();
        let st = &mut *guard;
        let Some(rec) = st.demand.get_mut(&t.key) else {
            return; // cannot happen: a record stays until its chunks have reported back
        };
        rec.running -= 1;
        if let Err(f) = result {
            rec.failure.get_or_insert(f);
            // Read no more of it.
            if rec.next < rec.padded {
                rec.next = rec.padded;
                st.demand_q.retain(|k| *k != t.key);
            }
        }
        if rec.finished() {
            // This reader stays counted in `active_demand` until `complete`.
            (st.demand.remove(&t.key), false)
        } else {
            st.active_demand -= 1;
            (None, !st.demand_pending())
        }
    };
    match done {
        (Some(mut rec), _) => {
            let buf = rec.buf.take();
            // Checksummed when complete, by the reader that landed the last chunk. (Streaming the
            // hash over the chunks as they land showed no gain on the 2-core build machine, where
            // each hashing step needs a reader scheduled for CPU before the record can finish:
            // median overlap ratio 1.20 against 1.08, 6 interleaved runs each; bench/NOTES.md.)
            let r = match rec.failure.take() {
                Some(f) => Err(f),
                None => verify(sh, t.key, buf.as_ref(), rec.length),
            };
            complete(sh, t.key, buf, rec.spec_bytes, r);
        }
        // Demand work has drained: speculative reads may start.
        (None, true) => sh.work.notify_all(),
        (None, false) => {}
    }
}

/// Checks the record's XXH3-64 the first time it is read.
fn verify(sh: &Shared, key: Key, buf: Option<&RecordBuf>, length: usize) -> Result<(), ReadFailure> {
    let rec = &sh.records[key.0 as usize][key.1 as usize];
    if rec.verified.load(Ordering::Acquire) {
        return Ok(());
    }
    let data = buf.map_or(&[][..], |b| &b.as_slice()[..length]);
    let found = xxhash_rust::xxh3::xxh3_64(data);
    let expected = rec.xxh3.load(Ordering::Acquire);
    if found != expected {
        return Err(ReadFailure::Checksum { expected, found });
    }
    rec.verified.store(true, Ordering::Release);
    Ok(())
}

fn finish_job(sh: &Shared, mut job: Job, result: Result<(), ReadFailure>) {
    let buf = job.buf.take();
    complete(sh, job.key, buf, job.spec_bytes, result);
}

/// Finishes a read: caches the record, hands it (or the failure) to every waiter, updates the
/// speculative-waste counter, and wakes readers that may now start speculative work.
fn complete(sh: &Shared, key: Key, mut buf: Option<RecordBuf>, spec_bytes: u64, result: Result<(), ReadFailure>) {
    let (layer, expert) = (key.0 as usize, key.1 as usize);
    let delivery: Result<Arc<Expert>, ReadFailure> = result.map(|()| {
        Arc::new(Expert {
            buf: buf.take().unwrap_or_else(RecordBuf::empty),
            len: sh.records[layer][expert].length as usize,
            layout: sh.layout.clone(),
            pool: Some(sh.pool.clone()),
        })
    });
    if let Some(b) = buf.take() {
        sh.pool.put(b); // the read failed
    }
    let mut st = sh.lock();
    let Some(f) = st.inflight.remove(&key) else { return };
    match f.class {
        Class::Demand => st.active_demand -= 1,
        Class::Speculative => st.active_spec -= 1,
    }
    #[cfg(test)]
    if f.class == Class::Demand {
        sh.hooks.log(super::tests::Event::DemandDone(key));
    }
    // Speculative bytes nobody has asked for yet; a waiter means demand used them.
    let unused = if f.waiters.is_empty() { spec_bytes } else { 0 };
    match &delivery {
        Ok(expert) => match st.cache.insert(key, expert.clone(), unused) {
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
    // Release this reader's reference before the lock: once the record is visible in the cache,
    // only the cache and the waiters hold it, so the eviction rule "held = referenced outside
    // the cache" never sees a reader that has not yet returned (seen as a flaky test under load).
    drop(delivery);
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
            st.spec_q.retain(|j| j.key != key);
        }
    }
    for w in f.waiters {
        let _ = w.tx.send((w.index, Err(failure.clone())));
    }
    drop(st);
    sh.work.notify_all();
}
