//! The routed-expert store: records read on demand from `experts.pack` into a byte-budgeted
//! cache, with speculative reads for predicted experts.
//!
//! The store speaks in records and bytes and knows no model family.
//!
//! - I/O ([`io`]): O_DIRECT into page-aligned buffers (`--io direct`) or buffered `pread` with
//!   `POSIX_FADV_RANDOM` (`--io buffered`); O_DIRECT refused by the file system is an error at
//!   open, never a silent fallback.
//! - Readers ([`readers`]): a pool of `readers` threads; [`ExpertStore::fetch`] queues every
//!   missing record of a layer at once, sorted by file offset, and hands records back in
//!   completion order so the caller computes each expert while the others are in flight. Demand
//!   reads are split into chunks ([`StoreOptions::demand_chunk`], 512 KiB) that readers take in
//!   (request order, offset) order, so the device keeps `readers` chunks in flight while the
//!   records complete one after the other (the first after ~1/n of the layer's read time), not
//!   all together at the end: expert compute starts early and overlaps the remaining reads.
//!   Speculative reads ([`ExpertStore::prefetch`]) run only while no demand read is queued or
//!   running, in chunks that yield to demand.
//! - Cache ([`cache`]): `lru`, `lfu` (LFU with dynamic aging) or `pinned` (a never-evicted tier
//!   filled from router-trace heat, LRU for the rest).
//! - Checksums: each record's XXH3-64 is verified the first time it is read; a mismatch is
//!   [`EngineError::ExpertChecksum`] naming layer and expert.
//!
//! Memory bound: cached records occupy at most `budget` bytes, each counted at its resident size
//! (length rounded up to 4 KiB). On top of that live (a) the records of requests the caller
//! still holds (at most the experts of the live [`Fetch`]es and of the `Arc`s kept from them:
//! top-k records per MoE layer being computed; they are never evicted while held, and are not
//! cached when the rest of the cache cannot make room for them), (b) the buffers of reads in
//! progress: at most `readers + 1` records (the records with chunks being read, and the one whose
//! chunks are being handed out), of which at most `readers / 2` speculative ones, and (c) up to
//! `readers` free buffers kept for reuse. Peak: `budget + (top_k + 2 × readers + 1) × record
//! bytes`.
//!
//! Output does not depend on budget, policy, I/O mode or prefetch: the store only decides where
//! the bytes come from, and the caller sums experts in a fixed order.
//!
//! Default I/O mode: `direct`. Measured with `examples/store_bench.rs` (2 MiB records, queue
//! depth 8, top-8 fetches, this project's 2-core VM, disk ~0.7–1.2 GB/s and noisy): with every
//! record read once from a cold cache both modes run at device speed (medians 0.72 vs 0.82 GB/s,
//! within the disk's run-to-run spread), but buffered costs ~3× the CPU (0.46 vs 0.16
//! CPU-seconds per GB: the page-cache copy and reclaim), CPU that expert compute needs on two
//! cores. Under a 1 GiB memory cgroup with a 2.1 GB pack and skewed reuse, each mode at its best
//! budget: direct (896 MiB cache) 878 experts/s, buffered (256 MiB cache + page cache) 659
//! experts/s; buffered with a large budget is worse still (600), as the page cache and the
//! cache fight over the same memory. Direct makes the budget the one knob for memory.
//!
//! Readers are a thread pool rather than io_uring: the device is the bottleneck at queue depth
//! 8, and the pool's CPU cost (~0.16 s per GB, half of it the first-read checksum) leaves
//! little for io_uring to save.

mod cache;
mod io;
mod readers;
mod remote;
#[cfg(test)]
mod tests;

pub use remote::{RecordSource, Remote};

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use deltafin_format::model_dir::{matrix_from_bytes, ExpertTensorLayout};
use deltafin_format::{AlignedBuf, ModelDir, StoredDtype};
use deltafin_kernels::MatRef;

use crate::EngineError;
use cache::Cache;
use io::{round_up, PackFile};
use readers::{Chunked, Class, Delivery, InFlight, Job, Phase, State, Waiter};

/// (layer, expert).
pub(crate) type Key = (u32, u32);

/// Bytes of each step of a speculative read; between steps it yields to demand reads.
const SPEC_CHUNK: usize = 256 << 10;

/// Default bytes of each demand chunk ([`StoreOptions::demand_chunk`]).
pub const DEMAND_CHUNK: usize = 512 << 10;

/// How records are read from `experts.pack`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IoMode {
    /// O_DIRECT into page-aligned buffers: no page cache, so the cache budget is the only
    /// memory records take, and reads run at device speed without a copy.
    Direct,
    /// Plain `pread` through the page cache (for file systems that refuse O_DIRECT, or when
    /// the pack fits in free memory).
    Buffered,
}

crate::cli_names!(IoMode, "I/O mode", { Direct => "direct", Buffered => "buffered" });

/// Which records the cache keeps (see the `cache` module for the exact rules).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CachePolicy {
    /// Least recently used.
    Lru,
    /// Least frequently used with dynamic aging (LFU-DA), ties by least recent use.
    Lfu,
    /// A never-evicted tier from [`StoreOptions::pinned`], LRU for the rest.
    Pinned,
}

crate::cli_names!(CachePolicy, "cache policy", { Lru => "lru", Lfu => "lfu", Pinned => "pinned" });

/// How to open an [`ExpertStore`].
#[derive(Debug, Clone, PartialEq)]
pub struct StoreOptions {
    /// Cache byte budget (`--ram-budget`); records count at their 4 KiB-rounded size.
    pub budget: u64,
    pub io: IoMode,
    pub policy: CachePolicy,
    /// (layer, expert) ranked hottest first, for the pinned tier (from router traces); the
    /// pinned tier takes the longest prefix that fits in `pinned_fraction × budget`, the rest of
    /// the budget is LRU. Ignored by the `lru` and `lfu` policies.
    pub pinned: Vec<(usize, usize)>,
    /// Share of the budget for the pinned tier, 0..=1.
    pub pinned_fraction: f64,
    /// Whether [`ExpertStore::prefetch`] issues reads (when false it only records predictions,
    /// so recall is still measured).
    pub prefetch: bool,
    /// Reader threads, which is also the most reads in flight (device queue depth); 0 =
    /// `max(top_k, 8)`. A fetch with more missing experts than readers queues the rest.
    pub readers: usize,
    /// Bytes of each chunk of a demand read (rounded up to 4 KiB): readers take the chunks of a
    /// fetch's records in order, so the records complete one after the other at full queue
    /// depth. 0 = [`DEMAND_CHUNK`]; `usize::MAX` = one read per record. The command line sets it
    /// with the research option `--demand-chunk`.
    pub demand_chunk: usize,
    /// Streaming installs only: where records not yet local are fetched from (None: such a
    /// record is an error naming it and the command that fetches it).
    pub remote: Option<Remote>,
}

impl StoreOptions {
    /// Defaults for a cache of `budget` bytes: direct I/O, LRU, no pinned tier, prefetch off,
    /// `max(top_k, 8)` readers.
    pub fn new(budget: u64) -> Self {
        StoreOptions {
            budget,
            io: IoMode::Direct,
            policy: CachePolicy::Lru,
            pinned: Vec::new(),
            pinned_fraction: 0.5,
            prefetch: false,
            readers: 0,
            demand_chunk: 0,
            remote: None,
        }
    }
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions::new(0)
    }
}

/// One routed expert's record in memory.
pub struct Expert {
    /// The record, padded to a multiple of 4 KiB.
    buf: RecordBuf,
    /// Record length (data bytes).
    len: usize,
    layout: Arc<[ExpertTensorLayout]>,
    /// Where the buffer goes back when the record is dropped.
    pool: Option<Arc<BufPool>>,
}

impl Drop for Expert {
    fn drop(&mut self) {
        if let Some(pool) = &self.pool {
            pool.put(std::mem::replace(&mut self.buf, RecordBuf::empty()));
        }
    }
}

/// Page-locks record buffers for a device's asynchronous copies: a GPU backend sets one on the
/// store ([`ExpertStore::set_host_pin`]) so that a record's host-to-device copy runs by DMA
/// straight from the buffer the disk read landed in, with no CPU copy (pageable memory is
/// copied by the driver through its own staging buffers at a few GB/s, one record at a time).
pub trait HostPin: Send + Sync {
    /// Page-locks the `len` bytes at `ptr`, a new record buffer; returns whether it did (a
    /// buffer it did not pin still works, copied as pageable memory).
    ///
    /// # Safety
    /// `ptr..ptr + len` is mapped and stays mapped until [`HostPin::unpin`] of `ptr`.
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> bool;
    /// Releases what [`HostPin::pin`] locked at `ptr`; called before the memory is unmapped.
    ///
    /// # Safety
    /// `ptr` was pinned by this hook, and nothing (no queued device copy) still reads it.
    unsafe fn unpin(&self, ptr: *mut u8);
}

/// A record buffer: page-aligned memory, page-locked by the store's [`HostPin`] when one was
/// set before it was made (unlocked again before it is unmapped).
pub(crate) struct RecordBuf {
    buf: AlignedBuf,
    pinned: Option<Arc<dyn HostPin>>,
}

impl RecordBuf {
    /// An empty buffer (a placeholder; nothing mapped, nothing pinned).
    pub(crate) fn empty() -> Self {
        RecordBuf {
            buf: AlignedBuf::zeroed(0, io::DIRECT_ALIGN),
            pinned: None,
        }
    }

    fn new(len: usize, pin: Option<&Arc<dyn HostPin>>) -> Self {
        let mut buf = AlignedBuf::zeroed(len, io::DIRECT_ALIGN);
        // SAFETY: the mapping lives in `buf` until this RecordBuf drops, which unpins it first.
        let pinned = match pin {
            Some(p) if len > 0 && unsafe { p.pin(buf.as_mut_slice().as_mut_ptr(), len) } => Some(p.clone()),
            _ => None,
        };
        RecordBuf { buf, pinned }
    }
}

impl std::ops::Deref for RecordBuf {
    type Target = AlignedBuf;
    fn deref(&self) -> &AlignedBuf {
        &self.buf
    }
}

impl std::ops::DerefMut for RecordBuf {
    fn deref_mut(&mut self) -> &mut AlignedBuf {
        &mut self.buf
    }
}

impl Drop for RecordBuf {
    fn drop(&mut self) {
        if let Some(p) = self.pinned.take() {
            // SAFETY: pinned by `p` in `new`; a record's buffer is dropped only when no copy
            // reads it (the GPU path holds copied records until the stream passed the copies).
            unsafe { p.unpin(self.buf.as_mut_slice().as_mut_ptr()) };
        }
    }
}

/// Free record buffers kept for the next reads, so steady-state reads neither map, fault in,
/// zero nor unmap memory. Measured on 2 MiB O_DIRECT reads: fresh maps cost ~0.4 CPU-seconds per
/// GB read (page clearing, faults in `get_user_pages`, unmapping), most of the store's CPU time.
/// At most `max` buffers wait here (memory outside the budget; see the module docs).
struct BufPool {
    free: Mutex<Vec<RecordBuf>>,
    max: usize,
    /// Pins every buffer made after it is set.
    pin: OnceLock<Arc<dyn HostPin>>,
}

impl BufPool {
    /// A buffer of `len` bytes (page-aligned; contents unspecified when reused).
    fn take(&self, len: usize) -> RecordBuf {
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(i) = free.iter().rposition(|b| b.len() == len) {
            return free.swap_remove(i);
        }
        drop(free);
        RecordBuf::new(len, self.pin.get())
    }

    fn put(&self, buf: RecordBuf) {
        if buf.is_empty() {
            return;
        }
        let mut free = self.free.lock().unwrap_or_else(PoisonError::into_inner);
        if free.len() < self.max {
            free.push(buf);
        }
    }
}

impl Expert {
    /// Matrix `i` of the record's layout (0 = gate_proj `[inter, hidden]`, 1 = up_proj
    /// `[inter, hidden]`, 2 = down_proj `[hidden, inter]`).
    pub fn matrix(&self, i: usize) -> MatRef<'_> {
        let l = &self.layout[i];
        let bytes = &self.buf.as_slice()[l.offset as usize..(l.offset + l.bytes) as usize];
        matrix_from_bytes(
            l.dtype,
            l.rows,
            l.cols,
            bytes,
            Some((l.scales_offset - l.offset) as usize),
        )
        .expect("layout validated when the store was opened")
    }

    /// Part `i` of the record as an f32 vector (gpt-oss expert biases, stored f32 whatever the
    /// experts' dtype); empty when that part is not f32 (families check the layout at load).
    pub fn f32_part(&self, i: usize) -> &[f32] {
        match self.matrix(i).data {
            deltafin_kernels::MatData::F32(v) => v,
            _ => &[],
        }
    }

    /// Record length in bytes (the data, without alignment padding).
    pub fn bytes(&self) -> usize {
        self.len
    }

    /// Memory held, bytes: the length rounded up to 4 KiB (what the cache budget counts).
    pub fn resident_bytes(&self) -> usize {
        self.buf.len()
    }

    /// The record's `bytes()` data bytes, exactly as in `experts.pack`.
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf.as_slice()[..self.len]
    }
}

/// Cumulative counters of an [`ExpertStore`]; use [`StoreCounters::since`] for one run's share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Expert requests served from the cache.
    pub hits: u64,
    /// Expert requests not in the cache (read now, or joined a read already in flight).
    pub misses: u64,
    /// Records dropped from the cache to stay within the budget.
    pub evictions: u64,
    /// Bytes read from `experts.pack` for demand requests (including the rest of a speculative
    /// read that a demand request promoted).
    pub bytes_read_demand: u64,
    /// Bytes read speculatively.
    pub bytes_read_speculative: u64,
    /// Nanoseconds the caller blocked in [`Fetch::next`] waiting for reads (and, in a streaming
    /// install, in [`ExpertStore::fetch`] while absent records were fetched).
    pub read_wait_ns: u64,
    /// Experts queued for speculative reads (not counting ones already cached or in flight).
    pub prefetch_issued: u64,
    /// Speculatively read experts later requested on demand before eviction (including reads
    /// still in flight with bytes already read when the request came).
    pub prefetch_useful: u64,
    /// Speculative bytes of records evicted or not cached before any demand request used them.
    /// Unused records still cached are not counted (yet).
    pub prefetch_wasted_bytes: u64,
    /// Demand expert requests in layers for which a prediction was made ([`ExpertStore::prefetch`]
    /// since that layer's previous demand fetch).
    pub predicted_requests: u64,
    /// Of `predicted_requests`, those that were in the prediction.
    pub predicted_correct: u64,
}

impl StoreCounters {
    /// hits / (hits + misses), or 0 when nothing was requested.
    pub fn hit_rate(&self) -> f64 {
        ratio(self.hits, self.hits + self.misses)
    }

    /// Prediction recall: of the experts demanded in layers that had a prediction, the share
    /// that was predicted (`predicted_correct / predicted_requests`), or 0 without predictions.
    /// It measures the predictor whether or not the read was needed (a predicted expert may
    /// already have been cached); [`StoreCounters::prefetch_useful`] measures the reads.
    pub fn prefetch_recall(&self) -> f64 {
        ratio(self.predicted_correct, self.predicted_requests)
    }

    /// Bytes read from the pack, demand and speculative.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read_demand + self.bytes_read_speculative
    }

    /// The counts since `earlier` (field by field).
    pub fn since(&self, earlier: &StoreCounters) -> StoreCounters {
        StoreCounters {
            hits: self.hits.saturating_sub(earlier.hits),
            misses: self.misses.saturating_sub(earlier.misses),
            evictions: self.evictions.saturating_sub(earlier.evictions),
            bytes_read_demand: self.bytes_read_demand.saturating_sub(earlier.bytes_read_demand),
            bytes_read_speculative: self
                .bytes_read_speculative
                .saturating_sub(earlier.bytes_read_speculative),
            read_wait_ns: self.read_wait_ns.saturating_sub(earlier.read_wait_ns),
            prefetch_issued: self.prefetch_issued.saturating_sub(earlier.prefetch_issued),
            prefetch_useful: self.prefetch_useful.saturating_sub(earlier.prefetch_useful),
            prefetch_wasted_bytes: self.prefetch_wasted_bytes.saturating_sub(earlier.prefetch_wasted_bytes),
            predicted_requests: self.predicted_requests.saturating_sub(earlier.predicted_requests),
            predicted_correct: self.predicted_correct.saturating_sub(earlier.predicted_correct),
        }
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_read_demand: AtomicU64,
    bytes_read_speculative: AtomicU64,
    read_wait_ns: AtomicU64,
    prefetch_issued: AtomicU64,
    prefetch_useful: AtomicU64,
    prefetch_wasted_bytes: AtomicU64,
    predicted_requests: AtomicU64,
    predicted_correct: AtomicU64,
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct RecordInfo {
    offset: u64,
    length: u64,
    /// Expected XXH3-64 (set when a streaming install fetches the record).
    xxh3: AtomicU64,
    verified: AtomicBool,
    /// The pack holds the record (always, except in a streaming install).
    present: AtomicBool,
}

/// State shared by the store and its reader threads.
struct Shared {
    pack: PackFile,
    layout: Arc<[ExpertTensorLayout]>,
    /// `[layer][expert]`, empty for dense layers.
    records: Vec<Vec<RecordInfo>>,
    spec_chunk: usize,
    /// Bytes per demand chunk, a multiple of 4 KiB.
    demand_chunk: usize,
    max_spec_active: usize,
    prefetch: bool,
    pool: Arc<BufPool>,
    state: Mutex<State>,
    /// Readers wait here for work.
    work: Condvar,
    c: Counters,
    #[cfg(test)]
    hooks: tests::Hooks,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent across a panic (every update is a few plain assignments).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Routed experts on demand from `experts.pack`.
pub struct ExpertStore {
    shared: Arc<Shared>,
    opts: StoreOptions,
    readers: usize,
    record_bytes: u64,
    threads: Vec<JoinHandle<()>>,
    /// Streaming install: fetches absent records before they are read.
    stream: Option<remote::Streaming>,
}

impl ExpertStore {
    /// Opens the expert pack of a model directory and starts the reader threads.
    ///
    /// Errors: the pack cannot be opened; `IoMode::Direct` on a file system that refuses
    /// O_DIRECT (the message suggests `--io buffered`); a malformed layout or checksum in the
    /// manifest; a pinned (layer, expert) that does not exist in this model.
    pub fn open(dir: &ModelDir, opts: StoreOptions) -> Result<Self, EngineError> {
        Self::open_with(dir, opts, SPEC_CHUNK)
    }

    fn open_with(dir: &ModelDir, opts: StoreOptions, spec_chunk: usize) -> Result<Self, EngineError> {
        let m = &dir.manifest;
        let path = dir.expert_pack_path();
        let layout: Arc<[ExpertTensorLayout]> = m.experts.layout.clone().into();
        let want: Vec<String> = m.config.expert_matrices().into_iter().map(|x| x.name).collect();
        if layout.iter().map(|l| &l.name).ne(want.iter()) {
            return Err(EngineError::Invalid(format!(
                "{}: expert layout must hold {} (the {} record)",
                path.display(),
                want.join(", "),
                m.config.family()
            )));
        }
        // Validate the layout once so Expert::matrix cannot fail.
        for l in layout.iter() {
            let need = l.dtype.value_bytes(l.rows, l.cols) + l.dtype.scale_bytes(l.rows, l.cols);
            if l.bytes as usize != need || l.scales_offset < l.offset || l.dtype == StoredDtype::Int8 {
                return Err(EngineError::Invalid(format!(
                    "{}: inconsistent expert layout for {}",
                    path.display(),
                    l.name
                )));
            }
        }
        let cfg = &m.config;
        // A streaming install leaves checksums empty until the journal records them.
        let streaming = m.stream.is_some() || m.experts.records.iter().any(|r| r.xxh3.is_empty());
        let journal = if streaming {
            deltafin_format::presence::present_checksums(dir)?
        } else {
            Default::default()
        };
        let mut records: Vec<Vec<RecordInfo>> = Vec::with_capacity(cfg.num_hidden_layers());
        let mut record_bytes = 0;
        for l in 0..cfg.num_hidden_layers() {
            let mut layer = Vec::new();
            if cfg.is_moe_layer(l) {
                for e in 0..cfg.n_routed_experts() {
                    let r = dir.record(l, e);
                    let known = journal.get(&(l as u32, e as u32)).copied();
                    let xxh3 = if streaming {
                        Ok(known.unwrap_or(0))
                    } else {
                        u64::from_str_radix(&r.xxh3, 16)
                    };
                    let xxh3 = xxh3.map_err(|_| {
                        EngineError::Invalid(format!(
                            "{}: bad checksum {:?} for layer {l} expert {e}",
                            path.display(),
                            r.xxh3
                        ))
                    })?;
                    record_bytes = record_bytes.max(round_up(r.length));
                    layer.push(RecordInfo {
                        offset: r.offset,
                        length: r.length,
                        xxh3: AtomicU64::new(xxh3),
                        verified: AtomicBool::new(false),
                        present: AtomicBool::new(!streaming || known.is_some()),
                    });
                }
            }
            records.push(layer);
        }
        let pinned_keys = if opts.policy == CachePolicy::Pinned {
            select_pinned(&records, &opts, &path)?
        } else {
            Vec::new()
        };
        let pinned_budget: u64 = pinned_keys
            .iter()
            .map(|&(l, e)| round_up(records[l as usize][e as usize].length))
            .sum();
        let cache = Cache::new(
            opts.policy,
            opts.budget,
            pinned_keys.into_iter().collect::<HashSet<Key>>(),
            pinned_budget,
        );
        let stream = streaming.then(|| remote::Streaming::new(dir, opts.remote.as_ref().map(|r| r.0.clone())));
        let pack = PackFile::open(&path, opts.io)?;
        let readers = if opts.readers == 0 {
            cfg.num_experts_per_tok().max(8)
        } else {
            opts.readers
        };
        let demand_chunk = match opts.demand_chunk {
            0 => DEMAND_CHUNK,
            n => n,
        };
        let demand_chunk = demand_chunk
            .min(usize::MAX - io::DIRECT_ALIGN)
            .next_multiple_of(io::DIRECT_ALIGN);
        let shared = Arc::new(Shared {
            pack,
            layout,
            records,
            spec_chunk,
            demand_chunk,
            max_spec_active: (readers / 2).max(1),
            prefetch: opts.prefetch,
            pool: Arc::new(BufPool {
                free: Mutex::new(Vec::new()),
                max: readers,
                pin: OnceLock::new(),
            }),
            state: Mutex::new(State::new(cache)),
            work: Condvar::new(),
            c: Counters::default(),
            #[cfg(test)]
            hooks: tests::Hooks::default(),
        });
        let mut store = ExpertStore {
            shared,
            opts,
            readers,
            record_bytes,
            threads: Vec::with_capacity(readers),
            stream,
        };
        for i in 0..readers {
            let sh = store.shared.clone();
            let t = std::thread::Builder::new()
                .name(format!("deltafin-reader-{i}"))
                .spawn(move || readers::reader_loop(sh));
            // On an error the store is dropped, which stops the readers already started.
            let t = t.map_err(|e| EngineError::Invalid(format!("cannot start expert reader thread: {e}")))?;
            store.threads.push(t);
        }
        Ok(store)
    }

    /// The I/O mode in use (never changed after open).
    pub fn io_mode(&self) -> IoMode {
        self.opts.io
    }

    /// Page-locks record buffers made from now on with `pin` (a GPU backend's hook, see
    /// [`HostPin`]); free buffers made before are dropped so that reads take pinned ones.
    /// Returns false (and changes nothing) when a hook was already set.
    pub fn set_host_pin(&self, pin: Arc<dyn HostPin>) -> bool {
        let set = self.shared.pool.pin.set(pin).is_ok();
        if set {
            // Buffers made before are not pinned: let new ones replace them.
            self.shared
                .pool
                .free
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clear();
        }
        set
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.opts
    }

    /// Reader threads (device queue depth).
    pub fn readers(&self) -> usize {
        self.readers
    }

    /// Cache budget, bytes.
    pub fn budget(&self) -> u64 {
        self.opts.budget
    }

    /// Resident bytes of the largest record (its length rounded up to 4 KiB); 0 without MoE
    /// layers.
    pub fn record_bytes(&self) -> u64 {
        self.record_bytes
    }

    /// Bytes currently cached (≤ budget).
    pub fn cached_bytes(&self) -> u64 {
        self.shared.lock().cache.used()
    }

    /// Path of the expert pack.
    pub fn path(&self) -> &Path {
        &self.shared.pack.path
    }

    /// Counters so far.
    pub fn counters(&self) -> StoreCounters {
        let c = &self.shared.c;
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StoreCounters {
            hits: r(&c.hits),
            misses: r(&c.misses),
            evictions: r(&c.evictions),
            bytes_read_demand: r(&c.bytes_read_demand),
            bytes_read_speculative: r(&c.bytes_read_speculative),
            read_wait_ns: r(&c.read_wait_ns),
            prefetch_issued: r(&c.prefetch_issued),
            prefetch_useful: r(&c.prefetch_useful),
            prefetch_wasted_bytes: r(&c.prefetch_wasted_bytes),
            predicted_requests: r(&c.predicted_requests),
            predicted_correct: r(&c.predicted_correct),
        }
    }

    fn check(&self, layer: usize, expert: usize) -> Result<&RecordInfo, EngineError> {
        self.shared
            .records
            .get(layer)
            .and_then(|l| l.get(expert))
            .ok_or_else(|| EngineError::Invalid(format!("no expert record for layer {layer}, expert {expert}")))
    }

    /// Demand fetch for one MoE layer. Cached experts are returned at once; reads of all the
    /// missing ones are queued immediately, sorted by file offset, ahead of any speculative
    /// read (queue depth `min(missing, readers)`); a record already being read (speculatively or
    /// for another request) is not read again: this request joins that read. The handle yields
    /// `(index into experts, record)` in completion order. The experts of this request are
    /// never evicted while the handle or the `Arc`s it yielded live.
    ///
    /// Errors: an expert id that does not exist in `layer` (at once); read failures and checksum
    /// mismatches come from the handle, naming layer and expert.
    pub fn fetch(&self, layer: usize, experts: &[usize]) -> Result<Fetch<'_>, EngineError> {
        let mut offsets = Vec::with_capacity(experts.len());
        for &e in experts {
            offsets.push(self.check(layer, e)?.offset);
        }
        if let Some(s) = &self.stream {
            // Time fetching absent records counts as waiting for reads.
            let t0 = Instant::now();
            let r = s.ensure(&self.shared.records, layer, experts);
            add(&self.shared.c.read_wait_ns, t0.elapsed().as_nanos() as u64);
            r?;
        }
        let sh = &self.shared;
        let mut ready = VecDeque::new();
        let (tx, rx) = mpsc::channel::<Delivery>();
        let mut pending = 0;
        let mut jobs: Vec<(Key, u64, Chunked)> = Vec::new();
        let (mut hits, mut useful) = (0, 0);
        {
            let mut guard = sh.lock();
            let st = &mut *guard;
            if let Some(pred) = st.predictions.remove(&(layer as u32)) {
                let correct = experts.iter().filter(|&&e| pred.contains(&(e as u32))).count();
                add(&sh.c.predicted_requests, experts.len() as u64);
                add(&sh.c.predicted_correct, correct as u64);
            }
            for (i, &e) in experts.iter().enumerate() {
                let key = (layer as u32, e as u32);
                if let Some(entry) = st.cache.get(&key) {
                    if entry.spec_unused > 0 {
                        entry.spec_unused = 0;
                        useful += 1;
                    }
                    ready.push_back((i, entry.expert.clone()));
                    hits += 1;
                    continue;
                }
                pending += 1;
                let waiter = Waiter {
                    tx: tx.clone(),
                    index: i,
                };
                if let Some(f) = st.inflight.get_mut(&key) {
                    f.waiters.push(waiter);
                    if f.class == Class::Speculative {
                        f.class = Class::Demand;
                        match f.phase {
                            Phase::Running => {
                                st.active_spec -= 1;
                                st.active_demand += 1;
                                useful += 1;
                            }
                            Phase::Queued => {
                                if let Some(pos) = st.spec_q.iter().position(|j| j.key == key) {
                                    if let Some(job) = st.spec_q.remove(pos) {
                                        useful += u64::from(job.started());
                                        let len = sh.records[layer][e].length as usize;
                                        jobs.push((key, offsets[i], Chunked::from_job(job, len)));
                                    }
                                }
                            }
                        }
                    }
                    continue;
                }
                st.inflight.insert(
                    key,
                    InFlight {
                        class: Class::Demand,
                        phase: Phase::Queued,
                        waiters: vec![waiter],
                    },
                );
                let len = sh.records[layer][e].length as usize;
                jobs.push((key, offsets[i], Chunked::new(offsets[i], len, None, 0, 0)));
            }
            // Readers serve records in this order, chunk by chunk: the first completes first.
            jobs.sort_by_key(|j| j.1);
            for (key, _, read) in jobs {
                #[cfg(test)]
                sh.hooks.log(tests::Event::DemandQueued(key));
                st.queue_demand(key, read);
            }
        }
        add(&sh.c.hits, hits);
        add(&sh.c.misses, pending as u64);
        add(&sh.c.prefetch_useful, useful);
        if pending > 0 {
            sh.work.notify_all();
        }
        Ok(Fetch {
            store: self,
            layer,
            experts: experts.to_vec(),
            ready,
            rx: (pending > 0).then_some(rx),
            pending,
        })
    }

    /// The records of layer `layer` in the cache now, ascending expert id, for computing with
    /// resident experts only (self-drafting): no read, no hit counted, no change to the
    /// eviction order. The returned `Arc`s keep the records alive (and unevictable) while held.
    pub fn resident(&self, layer: usize) -> Vec<(usize, Arc<Expert>)> {
        let n = self.shared.records.get(layer).map_or(0, Vec::len);
        let st = self.shared.lock();
        (0..n)
            .filter_map(|e| st.cache.peek(&(layer as u32, e as u32)).map(|x| (e, x.clone())))
            .collect()
    }

    /// Like [`ExpertStore::fetch`], but waits for all records and returns them in request order.
    pub fn get(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Expert>>, EngineError> {
        self.fetch(layer, experts)?.in_order()
    }

    /// Speculative reads for predicted experts of a later layer. Experts already cached or in
    /// flight are skipped; the rest are queued behind all demand reads and start only while no
    /// demand read is queued or running (see the `readers` module). Results go into the cache,
    /// counted as speculative. Also records the prediction, so the layer's next demand fetch
    /// measures recall. Without [`StoreOptions::prefetch`], or when the evictable part of the
    /// budget cannot hold one record, only the prediction is recorded. Invalid ids are ignored.
    pub fn prefetch(&self, layer: usize, experts: &[usize]) {
        let valid: Vec<usize> = experts
            .iter()
            .copied()
            .filter(|&e| self.check(layer, e).is_ok())
            .collect();
        let mut st = self.shared.lock();
        st.predictions
            .insert(layer as u32, valid.iter().map(|&e| e as u32).collect());
        if self.shared.prefetch {
            let keys: Vec<Key> = valid.iter().map(|&e| (layer as u32, e as u32)).collect();
            self.queue_speculative(st, keys);
        }
    }

    /// Queues speculative reads of the pinned tier's records not yet cached (policy `pinned`;
    /// whatever [`StoreOptions::prefetch`] says), so the tier fills in the background without
    /// delaying demand reads. Returns the number of reads queued. Without it, pinned records
    /// enter their tier when first read.
    pub fn warm_pinned(&self) -> usize {
        let st = self.shared.lock();
        let keys = st.cache.pinned_keys();
        self.queue_speculative(st, keys)
    }

    /// Speculative reads queued or running (prefetch and pinned-tier warm-up); 0 once the
    /// background reads have drained.
    pub fn speculative_pending(&self) -> usize {
        let st = self.shared.lock();
        st.spec_q.len() + st.active_spec
    }

    /// Queues speculative reads of `keys` not cached or in flight (sorted by offset); skips
    /// everything when the evictable budget cannot hold a record (outside the pinned tier).
    fn queue_speculative(&self, mut guard: MutexGuard<'_, State>, keys: Vec<Key>) -> usize {
        let sh = &self.shared;
        let st = &mut *guard;
        let mut jobs = Vec::new();
        for key in keys {
            if st.cache.contains(&key) || st.inflight.contains_key(&key) {
                continue;
            }
            let rec = &sh.records[key.0 as usize][key.1 as usize];
            if !rec.present.load(Ordering::Acquire) {
                continue; // a streaming install's record not fetched yet: only demand fetches
            }
            if !st.cache.is_pinned_key(&key) && st.cache.general_budget() < round_up(rec.length) {
                continue;
            }
            st.inflight.insert(
                key,
                InFlight {
                    class: Class::Speculative,
                    phase: Phase::Queued,
                    waiters: Vec::new(),
                },
            );
            jobs.push(Job::new(key, rec.offset));
        }
        let n = jobs.len();
        if n == 0 {
            return 0;
        }
        jobs.sort_by_key(|j| j.offset);
        add(&sh.c.prefetch_issued, n as u64);
        st.spec_q.extend(jobs);
        drop(guard);
        sh.work.notify_all();
        n
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The records of one [`ExpertStore::fetch`], yielded as they become available.
pub struct Fetch<'a> {
    store: &'a ExpertStore,
    layer: usize,
    experts: Vec<usize>,
    /// Cache hits, yielded first.
    ready: VecDeque<(usize, Arc<Expert>)>,
    rx: Option<Receiver<Delivery>>,
    /// Reads not yet yielded.
    pending: usize,
}

impl Fetch<'_> {
    /// Records not yet yielded.
    pub fn remaining(&self) -> usize {
        self.ready.len() + self.pending
    }

    /// Waits for every record; returns them in request order (first error wins).
    pub fn in_order(self) -> Result<Vec<Arc<Expert>>, EngineError> {
        let mut out: Vec<Option<Arc<Expert>>> = vec![None; self.experts.len()];
        for r in self {
            let (i, e) = r?;
            out[i] = Some(e);
        }
        out.into_iter()
            .map(|e| e.ok_or_else(|| EngineError::Invalid("expert fetch ended early".into())))
            .collect()
    }
}

impl Iterator for Fetch<'_> {
    type Item = Result<(usize, Arc<Expert>), EngineError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(r) = self.ready.pop_front() {
            return Some(Ok(r));
        }
        if self.pending == 0 {
            return None;
        }
        let rx = self.rx.as_ref()?;
        let t0 = Instant::now();
        let got = rx.recv();
        add(&self.store.shared.c.read_wait_ns, t0.elapsed().as_nanos() as u64);
        match got {
            Ok((i, Ok(e))) => {
                self.pending -= 1;
                Some(Ok((i, e)))
            }
            Ok((i, Err(f))) => {
                self.pending -= 1;
                Some(Err(f.into_error(self.store.path(), self.layer, self.experts[i])))
            }
            Err(_) => {
                self.pending = 0;
                Some(Err(EngineError::Invalid(
                    "expert readers stopped before the fetch completed".into(),
                )))
            }
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining(), Some(self.remaining()))
    }
}

/// The pinned tier: the longest prefix of the ranking that fits in `pinned_fraction × budget`.
fn select_pinned(records: &[Vec<RecordInfo>], opts: &StoreOptions, path: &Path) -> Result<Vec<Key>, EngineError> {
    let cap = (opts.budget as f64 * opts.pinned_fraction.clamp(0.0, 1.0)) as u64;
    let mut used = 0;
    let mut keys = Vec::new();
    let mut seen = HashSet::new();
    for &(l, e) in &opts.pinned {
        let r = records.get(l).and_then(|x| x.get(e)).ok_or_else(|| {
            EngineError::Invalid(format!(
                "{}: pinned expert (layer {l}, expert {e}) does not exist in this model",
                path.display()
            ))
        })?;
        if !seen.insert((l, e)) {
            continue;
        }
        let size = round_up(r.length);
        if used + size > cap {
            break;
        }
        used += size;
        keys.push((l as u32, e as u32));
    }
    Ok(keys)
}
