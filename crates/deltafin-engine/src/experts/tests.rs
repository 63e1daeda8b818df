//! Expert-store tests on model directories converted from the `dsv3_b` fixture (3 MoE layers of
//! 16 experts; MXFP4 records of 4960 bytes, padded to 8192).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::ModelDir;

use super::cache::{Cache, Insert};
use super::*;

// ---------------------------------------------------------------------------------------------
// Test hooks compiled into the store under cfg(test).

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A demand read was queued (logged under the store lock).
    DemandQueued(Key),
    /// A demand read completed.
    DemandDone(Key),
    /// A reader decided to read one chunk of a speculative read.
    SpecChunk(Key),
    /// A reader took the demand chunk starting at this byte of the record.
    DemandChunk(Key, usize),
}

#[derive(Default)]
pub(crate) struct Hooks {
    events: Mutex<Vec<Event>>,
    gate_closed: Mutex<bool>,
    gate: Condvar,
    spec_delay_ms: AtomicU64,
    gated: AtomicBool,
    /// Sleep before each demand chunk (a slow device).
    demand_delay_ms: AtomicU64,
    /// Extra sleep before the first chunk of each record (so later chunks land first).
    first_chunk_delay_ms: AtomicU64,
    /// Demand chunks being read now, and the most at once.
    demand_running: AtomicUsize,
    demand_max_running: AtomicUsize,
}

impl Hooks {
    pub(crate) fn log(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }

    /// Runs before each speculative chunk is read: waits while the gate is closed, then sleeps
    /// the configured delay (a slow device).
    pub(crate) fn before_spec_chunk(&self) {
        if self.gated.load(Ordering::SeqCst) {
            let mut closed = self.gate_closed.lock().unwrap();
            while *closed {
                closed = self.gate.wait(closed).unwrap();
            }
        }
        let ms = self.spec_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
    }

    /// Runs before each demand chunk is read.
    pub(crate) fn before_demand_chunk(&self, start: usize) {
        let now = self.demand_running.fetch_add(1, Ordering::SeqCst) + 1;
        self.demand_max_running.fetch_max(now, Ordering::SeqCst);
        let mut ms = self.demand_delay_ms.load(Ordering::SeqCst);
        if start == 0 {
            ms += self.first_chunk_delay_ms.load(Ordering::SeqCst);
        }
        if ms > 0 {
            std::thread::sleep(Duration::from_millis(ms));
        }
    }

    /// Runs after each demand chunk is read.
    pub(crate) fn after_demand_chunk(&self) {
        self.demand_running.fetch_sub(1, Ordering::SeqCst);
    }

    fn close_gate(&self) {
        *self.gate_closed.lock().unwrap() = true;
        self.gated.store(true, Ordering::SeqCst);
    }

    fn open_gate(&self) {
        *self.gate_closed.lock().unwrap() = false;
        self.gate.notify_all();
    }

    fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures.

const MOE_LAYERS: [usize; 3] = [1, 2, 3];
const N_EXPERTS: usize = 16;

fn convert_fixture() -> (tempfile::TempDir, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_b");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    (tmp, out)
}

/// [`convert_fixture`], opened: the temporary directory (keep it alive while the model is used)
/// and the model directory.
fn open_fixture() -> (tempfile::TempDir, ModelDir) {
    let (tmp, path) = convert_fixture();
    (tmp, ModelDir::open(&path).unwrap())
}

/// Every record's bytes, read with plain `std::fs::read`.
fn reference(dir: &ModelDir) -> std::collections::HashMap<(usize, usize), Vec<u8>> {
    let pack = std::fs::read(dir.expert_pack_path()).unwrap();
    let mut out = std::collections::HashMap::new();
    for &l in &MOE_LAYERS {
        for e in 0..N_EXPERTS {
            let r = dir.record(l, e);
            out.insert((l, e), pack[r.offset as usize..(r.offset + r.length) as usize].to_vec());
        }
    }
    out
}

/// [`opts`] with speculative reads on or off.
fn opts_prefetch(budget: u64, io: IoMode, policy: CachePolicy, prefetch: bool) -> StoreOptions {
    StoreOptions {
        prefetch,
        ..opts(budget, io, policy)
    }
}

/// [`opts`] with speculative reads on, LRU.
fn prefetching(budget: u64, io: IoMode) -> StoreOptions {
    opts_prefetch(budget, io, CachePolicy::Lru, true)
}

fn opts(budget: u64, io: IoMode, policy: CachePolicy) -> StoreOptions {
    StoreOptions {
        budget,
        io,
        policy,
        pinned: vec![(1, 0), (1, 1), (2, 2), (3, 3), (2, 9), (1, 4)],
        pinned_fraction: 0.5,
        prefetch: false,
        readers: 0,
        // Two chunks per 8 KiB record, so every test also exercises chunked demand reads.
        demand_chunk: 4096,
        remote: None,
    }
}

/// The I/O modes this machine's temp file system supports (O_DIRECT is refused on tmpfs).
fn modes(dir: &ModelDir) -> Vec<IoMode> {
    match ExpertStore::open(dir, StoreOptions::new(0)) {
        Ok(_) => vec![IoMode::Direct, IoMode::Buffered],
        Err(e) => {
            eprintln!("skipping direct I/O: {e}");
            vec![IoMode::Buffered]
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    /// `k` distinct experts, skewed towards low ids (so caches get hits).
    fn experts(&mut self, k: usize) -> Vec<usize> {
        let mut v = Vec::new();
        while v.len() < k {
            let e = if self.below(3) == 0 {
                self.below(N_EXPERTS)
            } else {
                self.below(6)
            };
            if !v.contains(&e) {
                v.push(e);
            }
        }
        v
    }
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(20), "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

const RECORD: u64 = 8192;

/// How many speculative chunk reads have started.
fn spec_chunks(hooks: &Hooks) -> usize {
    hooks
        .events()
        .iter()
        .filter(|e| matches!(e, Event::SpecChunk(_)))
        .count()
}

// ---------------------------------------------------------------------------------------------
// Tests.

#[test]
fn names_parse_and_print() {
    for m in [IoMode::Direct, IoMode::Buffered] {
        assert_eq!(m.to_string().parse::<IoMode>().unwrap(), m);
    }
    for p in [CachePolicy::Lru, CachePolicy::Lfu, CachePolicy::Pinned] {
        assert_eq!(p.to_string().parse::<CachePolicy>().unwrap(), p);
    }
    assert!("uring".parse::<IoMode>().is_err());
    assert!("fifo".parse::<CachePolicy>().is_err());
}

/// Every policy × budget {0, one record, half, all} × I/O mode × prefetch returns the pack's
/// bytes for the same random request sequence, and the cache never exceeds its budget.
#[test]
fn every_policy_and_budget_returns_identical_bytes() {
    let (_tmp, dir) = open_fixture();
    let want = reference(&dir);
    assert!(want.values().all(|b| b.len() == 4960));
    let all = RECORD * (MOE_LAYERS.len() * N_EXPERTS) as u64;
    for io in modes(&dir) {
        for policy in [CachePolicy::Lru, CachePolicy::Lfu, CachePolicy::Pinned] {
            for budget in [0, RECORD, all / 2, all] {
                for prefetch in [false, true] {
                    let store = ExpertStore::open(&dir, opts_prefetch(budget, io, policy, prefetch)).unwrap();
                    assert_eq!(store.record_bytes(), RECORD);
                    let mut rng = Rng(0x5EED);
                    let steps = 60;
                    for _ in 0..steps {
                        let layer = MOE_LAYERS[rng.below(3)];
                        let experts = rng.experts(4);
                        let guess = rng.experts(4);
                        store.prefetch(MOE_LAYERS[rng.below(3)], &guess);
                        let mut seen = [false; 4];
                        for r in store.fetch(layer, &experts).unwrap() {
                            let (i, e) = r.unwrap();
                            assert!(!seen[i]);
                            seen[i] = true;
                            assert_eq!(e.bytes(), 4960);
                            assert_eq!(e.resident_bytes() as u64, RECORD);
                            assert!(
                                e.as_bytes() == want[&(layer, experts[i])].as_slice(),
                                "{io} {policy} budget {budget}: layer {layer} expert {} differs",
                                experts[i]
                            );
                            assert!(store.cached_bytes() <= budget);
                        }
                        assert!(seen.iter().all(|&s| s));
                    }
                    let c = store.counters();
                    assert_eq!(c.hits + c.misses, steps * 4, "{c:?}");
                    if budget == 0 {
                        assert_eq!(c.hits, 0);
                        assert_eq!(c.bytes_read_speculative, 0, "nothing to prefetch into");
                    }
                    if budget == all {
                        assert_eq!(c.evictions, 0);
                        assert!(c.misses <= 48);
                    }
                    if !prefetch {
                        assert_eq!(c.prefetch_issued + c.bytes_read_speculative, 0);
                    }
                    assert!(c.predicted_requests > 0);
                    assert!(store.cached_bytes() <= budget);
                }
            }
        }
    }
}

/// A [`HostPin`] that records what it pinned (refusing every third buffer, as a driver out of
/// page-locked memory would) and checks each unpin against a live pin.
#[derive(Default)]
struct CountingPin {
    live: Mutex<std::collections::HashMap<usize, usize>>,
    pins: AtomicUsize,
    unpins: AtomicUsize,
    asked: AtomicUsize,
}

impl HostPin for CountingPin {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> bool {
        assert_eq!(ptr as usize % 4096, 0, "record buffers are page-aligned");
        if self.asked.fetch_add(1, Ordering::SeqCst) % 3 == 2 {
            return false;
        }
        assert!(
            self.live.lock().unwrap().insert(ptr as usize, len).is_none(),
            "pinned twice"
        );
        self.pins.fetch_add(1, Ordering::SeqCst);
        true
    }
    unsafe fn unpin(&self, ptr: *mut u8) {
        assert!(
            self.live.lock().unwrap().remove(&(ptr as usize)).is_some(),
            "unpinned what was not pinned"
        );
        self.unpins.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn pinned_record_buffers_are_unpinned_exactly_once_and_bytes_stay_right() {
    let (_tmp, dir) = open_fixture();
    let want = reference(&dir);
    for io in modes(&dir) {
        let pin = Arc::new(CountingPin::default());
        {
            let store = ExpertStore::open(&dir, opts(RECORD * 5, io, CachePolicy::Lru)).unwrap();
            assert!(store.set_host_pin(pin.clone()));
            assert!(!store.set_host_pin(pin.clone()), "a second hook is refused");
            let mut rng = Rng(0xB1A5);
            let mut held = Vec::new();
            for step in 0..80 {
                let layer = MOE_LAYERS[rng.below(3)];
                let experts = rng.experts(4);
                for r in store.fetch(layer, &experts).unwrap() {
                    let (i, e) = r.unwrap();
                    assert!(
                        e.as_bytes() == want[&(layer, experts[i])].as_slice(),
                        "{io}: bytes differ"
                    );
                    // Keep some records past later reads, as a device copy in flight would.
                    if step % 7 == 0 {
                        held.push(e);
                    }
                }
            }
            assert!(pin.pins.load(Ordering::SeqCst) > 0, "{io}: nothing was pinned");
            drop(held);
        }
        // Store and records gone: every pinned buffer was unpinned before it was unmapped.
        assert_eq!(
            pin.pins.load(Ordering::SeqCst),
            pin.unpins.load(Ordering::SeqCst),
            "{io}"
        );
        assert!(pin.live.lock().unwrap().is_empty());
    }
}

#[test]
fn direct_and_buffered_return_identical_bytes() {
    let (_tmp, dir) = open_fixture();
    let modes = modes(&dir);
    let mut got: Vec<Vec<Vec<u8>>> = Vec::new();
    for &io in &modes {
        let store = ExpertStore::open(&dir, opts(0, io, CachePolicy::Lru)).unwrap();
        assert_eq!(store.io_mode(), io);
        let mut v = Vec::new();
        for &l in &MOE_LAYERS {
            let all: Vec<usize> = (0..N_EXPERTS).collect();
            for e in store.get(l, &all).unwrap() {
                v.push(e.as_bytes().to_vec());
            }
        }
        got.push(v);
    }
    let want = reference(&dir);
    for v in &got {
        assert_eq!(v.len(), 48);
        for (i, b) in v.iter().enumerate() {
            assert_eq!(b, &want[&(MOE_LAYERS[i / N_EXPERTS], i % N_EXPERTS)]);
        }
    }
}

/// The last record ends at EOF, 4960 bytes into its 8192-byte stride: O_DIRECT reads of the
/// rounded length come back short and must still deliver the record, in one read or in chunks.
#[test]
fn short_read_at_end_of_file() {
    let (_tmp, path) = convert_fixture();
    let last = {
        let dir = ModelDir::open(&path).unwrap();
        let r = dir.record(3, 15);
        r.offset + r.length
    };
    let pack = path.join("experts.pack");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&pack)
        .unwrap()
        .set_len(last)
        .unwrap();
    let mpath = path.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m["experts"]["bytes"] = serde_json::json!(last);
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    let dir = ModelDir::open(&path).unwrap();
    assert_ne!(last % 4096, 0);
    let want = reference(&dir);
    for io in modes(&dir) {
        let store = ExpertStore::open(&dir, opts(0, io, CachePolicy::Lru)).unwrap();
        let got = store.get(3, &[15, 14]).unwrap();
        assert_eq!(got[0].as_bytes(), want[&(3, 15)].as_slice(), "{io}");
        assert_eq!(got[1].as_bytes(), want[&(3, 14)].as_slice(), "{io}");
        // Speculative reads in 4 KiB chunks: the second chunk of the last record is short.
        let store = ExpertStore::open_with(&dir, prefetching(RECORD * 4, io), 4096).unwrap();
        store.prefetch(3, &[15]);
        wait_until("prefetch of the last record", || store.cached_bytes() == RECORD);
        let got = store.get(3, &[15]).unwrap();
        assert_eq!(got[0].as_bytes(), want[&(3, 15)].as_slice(), "{io} chunked");
        let c = store.counters();
        assert_eq!((c.hits, c.prefetch_useful), (1, 1));
        assert_eq!(c.bytes_read_speculative, 4960, "{io}: one full chunk and one short one");
    }
}

/// Flips the bits `mask` of the byte `at` bytes into the record of `(layer, expert)` in the pack
/// of the model directory `path`.
fn corrupt_record(path: &Path, (layer, expert): (usize, usize), at: u64, mask: u8) {
    let off = ModelDir::open(path).unwrap().record(layer, expert).offset + at;
    let pack = path.join("experts.pack");
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[off as usize] ^= mask;
    std::fs::write(&pack, bytes).unwrap();
}

/// `e` is the checksum failure of the record of layer 2, expert 7 (the one [`corrupt_record`]
/// damages in the checksum tests), and its message names both; `ctx` prefixes the failure.
fn assert_checksum_error_of_2_7(e: &EngineError, ctx: &str) {
    assert!(
        matches!(
            e,
            EngineError::ExpertChecksum {
                layer: 2,
                expert: 7,
                ..
            }
        ),
        "{ctx}: {e:?}"
    );
    let msg = e.to_string();
    assert!(msg.contains("layer 2, expert 7"), "{ctx}: {msg}");
}

#[test]
fn checksum_failure_names_layer_and_expert() {
    let (_tmp, path) = convert_fixture();
    corrupt_record(&path, (2, 7), 100, 0x40);
    let dir = ModelDir::open(&path).unwrap();
    for io in modes(&dir) {
        for prefetch in [false, true] {
            let store = ExpertStore::open(&dir, opts_prefetch(RECORD * 8, io, CachePolicy::Lru, prefetch)).unwrap();
            store.prefetch(2, &[7]);
            let results: Vec<_> = store.fetch(2, &[3, 7]).unwrap().collect();
            assert_eq!(results.len(), 2);
            let mut errors = 0;
            for r in results {
                match r {
                    Ok((i, _)) => assert_eq!(i, 0),
                    Err(e) => {
                        errors += 1;
                        assert_checksum_error_of_2_7(&e, "");
                    }
                }
            }
            assert_eq!(errors, 1);
            // Not cached: asking again fails again.
            assert!(store.get(2, &[7]).is_err());
            assert!(store.get(2, &[3]).is_ok());
        }
    }
}

fn fake(n: u32) -> (Key, Arc<Expert>) {
    let e = Expert {
        buf: RecordBuf::new(4096, None),
        len: 4096,
        layout: Arc::from(Vec::new()),
        pool: None,
    };
    ((1, n), Arc::new(e))
}

fn insert(c: &mut Cache, n: u32) -> usize {
    let (k, e) = fake(n);
    match c.insert(k, e, 0) {
        Insert::Cached(ev) => ev.len(),
        Insert::NoRoom => panic!("no room for {n}"),
    }
}

fn keys(c: &Cache) -> BTreeSet<u32> {
    c.keys().into_iter().map(|k| k.1).collect()
}

/// LRU on a 3-record cache: A B C, use A, +D evicts B, +E evicts C; a held record is skipped.
#[test]
fn lru_eviction_order() {
    let (a, b, c, d, e, f) = (0, 1, 2, 3, 4, 5);
    let mut cache = Cache::new(CachePolicy::Lru, 3 * 4096, Default::default(), 0);
    for n in [a, b, c] {
        assert_eq!(insert(&mut cache, n), 0);
    }
    assert!(cache.get(&(1, a)).is_some());
    assert_eq!(insert(&mut cache, d), 1);
    assert_eq!(keys(&cache), BTreeSet::from([a, c, d]));
    assert_eq!(insert(&mut cache, e), 1);
    assert_eq!(keys(&cache), BTreeSet::from([a, d, e]));
    // A is now least recent, but held by a caller: D goes instead.
    let held = cache.get(&(1, a)).map(|x| x.expert.clone()).unwrap();
    let _ = cache.get(&(1, d));
    let _ = cache.get(&(1, e));
    assert_eq!(insert(&mut cache, f), 1);
    assert_eq!(keys(&cache), BTreeSet::from([a, e, f]));
    assert_eq!(cache.used(), 3 * 4096);
    drop(held);
}

/// LFU-DA on a 3-record cache. A B C inserted (priority 1 each), A used twice (3), B once (2).
/// +D evicts C (1; age becomes 1, D gets 1+1 = 2). +E: B and D tie at 2, B used longer ago, B
/// goes (age 2; E = 3). +F evicts D (2; F = 3). +G: A, E, F all at 3, A least recent: the once-hot
/// A ages out.
#[test]
fn lfu_eviction_order() {
    let (a, b, c, d, e, f, g) = (0, 1, 2, 3, 4, 5, 6);
    let mut cache = Cache::new(CachePolicy::Lfu, 3 * 4096, Default::default(), 0);
    for n in [a, b, c] {
        insert(&mut cache, n);
    }
    let _ = cache.get(&(1, a));
    let _ = cache.get(&(1, a));
    let _ = cache.get(&(1, b));
    insert(&mut cache, d);
    assert_eq!(keys(&cache), BTreeSet::from([a, b, d]));
    insert(&mut cache, e);
    assert_eq!(keys(&cache), BTreeSet::from([a, d, e]));
    insert(&mut cache, f);
    assert_eq!(keys(&cache), BTreeSet::from([a, e, f]));
    insert(&mut cache, g);
    assert_eq!(keys(&cache), BTreeSet::from([e, f, g]));
}

#[test]
fn cache_refuses_rather_than_evicting_held_records() {
    let mut cache = Cache::new(CachePolicy::Lru, 2 * 4096, Default::default(), 0);
    let (ka, a) = fake(0);
    let (kb, b) = fake(1);
    assert!(matches!(cache.insert(ka, a.clone(), 0), Insert::Cached(_)));
    assert!(matches!(cache.insert(kb, b.clone(), 0), Insert::Cached(_)));
    let (kc, c) = fake(2);
    assert!(matches!(cache.insert(kc, c, 0), Insert::NoRoom));
    assert_eq!(keys(&cache), BTreeSet::from([0, 1]));
    drop(a);
    let (kc, c) = fake(2);
    assert!(matches!(cache.insert(kc, c, 0), Insert::Cached(ref v) if v.len() == 1));
    assert_eq!(keys(&cache), BTreeSet::from([1, 2]));
    drop(b);
}

#[test]
fn pinned_entries_survive() {
    let (_tmp, dir) = open_fixture();
    for io in modes(&dir) {
        // 4 records: the pinned tier takes (1,0) and (1,1); (2,2) does not fit in half.
        let store = ExpertStore::open(&dir, opts(RECORD * 4, io, CachePolicy::Pinned)).unwrap();
        store.get(1, &[0, 1, 2]).unwrap();
        let mut rng = Rng(7);
        for _ in 0..40 {
            let layer = MOE_LAYERS[rng.below(3)];
            let experts: Vec<usize> = rng.experts(4).into_iter().map(|e| (e + 2) % N_EXPERTS).collect();
            let experts: Vec<usize> = experts.into_iter().filter(|&e| !(layer == 1 && e < 2)).collect();
            store.get(layer, &experts).unwrap();
            assert!(store.cached_bytes() <= RECORD * 4);
        }
        let before = store.counters();
        store.get(1, &[1, 0]).unwrap();
        let c = store.counters().since(&before);
        assert_eq!((c.hits, c.misses), (2, 0), "{io}");
        assert!(store.counters().evictions > 0);
    }
    // Warming fills the tier in the background; the warmed records then hit.
    let store = ExpertStore::open(&dir, opts(RECORD * 4, IoMode::Buffered, CachePolicy::Pinned)).unwrap();
    assert_eq!(store.warm_pinned(), 2);
    wait_until("the pinned tier to fill", || store.cached_bytes() == RECORD * 2);
    store.get(1, &[0, 1]).unwrap();
    let c = store.counters();
    assert_eq!(
        (c.hits, c.misses, c.prefetch_issued, c.bytes_read_speculative),
        (2, 0, 2, 2 * RECORD)
    );
    assert_eq!(store.warm_pinned(), 0, "already cached");
    // A pinned expert that does not exist is an error, not silently ignored.
    let bad = StoreOptions {
        pinned: vec![(0, 1)],
        ..opts(RECORD * 4, IoMode::Buffered, CachePolicy::Pinned)
    };
    let err = ExpertStore::open(&dir, bad).err().unwrap().to_string();
    assert!(err.contains("pinned expert (layer 0, expert 1)"), "{err}");
}

/// Speculative reads are slow here (each 4 KiB chunk takes 1 s); a demand fetch issued
/// meanwhile completes without waiting for them (well under the ≥ 970 ms that waiting for one
/// would take, a margin no loaded machine eats), and no speculative chunk starts between the
/// moment demand reads are queued and the moment they finish.
#[test]
fn prefetch_never_delays_demand() {
    let (_tmp, dir) = open_fixture();
    let all = RECORD * 48;
    let store = ExpertStore::open_with(
        &dir,
        StoreOptions {
            readers: 8,
            ..prefetching(all, IoMode::Buffered)
        },
        4096,
    )
    .unwrap();
    store.shared.hooks.spec_delay_ms.store(1000, Ordering::SeqCst);
    let predicted: Vec<usize> = (0..8).collect();
    store.prefetch(3, &predicted);
    std::thread::sleep(Duration::from_millis(30));
    let t0 = Instant::now();
    let got = store.get(1, &[0, 1, 2, 3]).unwrap();
    let waited = t0.elapsed();
    assert_eq!(got.len(), 4);
    assert!(waited < Duration::from_millis(600), "demand waited {waited:?}");
    // The rest of the prefetch need not crawl (chunks already sleeping finish their second).
    store.shared.hooks.spec_delay_ms.store(0, Ordering::SeqCst);
    let ev = store.shared.hooks.events();
    let first = ev
        .iter()
        .position(|e| matches!(e, Event::DemandQueued((1, _))))
        .unwrap();
    let last = ev.iter().rposition(|e| matches!(e, Event::DemandDone((1, _)))).unwrap();
    assert!(first < last);
    assert!(
        !ev[first..last].iter().any(|e| matches!(e, Event::SpecChunk(_))),
        "a speculative chunk started while demand reads were pending: {:?}",
        &ev[first..=last]
    );
    assert!(
        ev[..first].iter().any(|e| matches!(e, Event::SpecChunk(_))),
        "prefetch had started"
    );
    wait_until("prefetch to finish", || store.cached_bytes() == RECORD * 12);
    let before = store.counters();
    store.get(3, &[0, 1, 2, 3, 9]).unwrap();
    let c = store.counters();
    let d = c.since(&before);
    assert_eq!((d.hits, d.misses, d.prefetch_useful), (4, 1, 4));
    assert_eq!(c.prefetch_issued, 8);
    assert_eq!(c.bytes_read_speculative, 8 * RECORD);
    assert_eq!((c.predicted_requests, c.predicted_correct), (5, 4));
    assert!((c.prefetch_recall() - 0.8).abs() < 1e-12);
}

/// A demand request for an expert whose speculative read has started joins that read: the
/// record is read once, and counts as a useful prefetch.
#[test]
fn demand_joins_running_prefetch_without_reading_twice() {
    let (_tmp, dir) = open_fixture();
    for io in modes(&dir) {
        let store = ExpertStore::open(&dir, prefetching(RECORD * 8, io)).unwrap();
        let hooks = &store.shared.hooks;
        hooks.close_gate();
        store.prefetch(2, &[5]);
        wait_until("the speculative read to start", || {
            hooks.events().contains(&Event::SpecChunk((2, 5)))
        });
        let fetch = store.fetch(2, &[5, 6]).unwrap();
        hooks.open_gate();
        let got = fetch.in_order().unwrap();
        assert_eq!(got.len(), 2);
        let c = store.counters();
        assert_eq!(
            (c.hits, c.misses, c.prefetch_issued, c.prefetch_useful),
            (0, 2, 1, 1),
            "{io}"
        );
        assert_eq!(c.bytes_read_speculative, RECORD, "{io}");
        assert_eq!(c.bytes_read_demand, RECORD, "{io}: only (2, 6) read on demand");
        assert_eq!(c.prefetch_wasted_bytes, 0);
        assert_eq!(spec_chunks(hooks), 1);
    }
}

/// A demand request for an expert whose speculative read is still queued takes it over as a
/// demand read and completes even while every running speculative read is stuck.
#[test]
fn demand_promotes_queued_prefetch() {
    let (_tmp, dir) = open_fixture();
    let store = ExpertStore::open(
        &dir,
        StoreOptions {
            readers: 8,
            ..prefetching(RECORD * 48, IoMode::Buffered)
        },
    )
    .unwrap();
    let hooks = &store.shared.hooks;
    hooks.close_gate();
    let predicted: Vec<usize> = (0..8).collect();
    store.prefetch(3, &predicted);
    // At most readers / 2 = 4 speculative reads run; the other 4 stay queued.
    wait_until("four speculative reads to start", || spec_chunks(hooks) == 4);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(hooks.events().len(), 4);
    let got = store.get(3, &[7]).unwrap();
    assert_eq!(got.len(), 1);
    let c = store.counters();
    assert_eq!((c.misses, c.prefetch_useful, c.bytes_read_demand), (1, 0, RECORD));
    hooks.open_gate();
    wait_until("prefetch to finish", || store.cached_bytes() == RECORD * 8);
    let c = store.counters();
    assert_eq!(c.bytes_read_speculative, 7 * RECORD);
    assert_eq!(c.bytes_read(), 8 * RECORD);
}

/// Speculative records evicted before use count as wasted bytes.
#[test]
fn unused_prefetch_counts_as_wasted_when_evicted() {
    let (_tmp, dir) = open_fixture();
    let store = ExpertStore::open(&dir, prefetching(RECORD * 2, IoMode::Buffered)).unwrap();
    store.prefetch(1, &[0, 1]);
    wait_until("prefetch", || store.cached_bytes() == RECORD * 2);
    store.get(1, &[1]).unwrap();
    store.get(2, &[0, 1]).unwrap();
    let c = store.counters();
    assert_eq!((c.prefetch_issued, c.prefetch_useful, c.evictions), (2, 1, 2));
    assert_eq!(c.prefetch_wasted_bytes, RECORD, "(1, 0) was evicted unused");
    assert_eq!((c.predicted_requests, c.predicted_correct), (1, 1));
}

#[test]
fn direct_io_refused_is_an_error_not_a_fallback() {
    let shm = Path::new("/dev/shm");
    if !shm.is_dir() {
        eprintln!("no /dev/shm: skipped");
        return;
    }
    let (_tmp, path) = convert_fixture();
    let tmp = tempfile::tempdir_in(shm).unwrap();
    let copy = tmp.path().join("model");
    std::fs::create_dir(&copy).unwrap();
    for f in std::fs::read_dir(&path).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), copy.join(f.file_name())).unwrap();
    }
    let dir = ModelDir::open(&copy).unwrap();
    match ExpertStore::open(&dir, opts(0, IoMode::Direct, CachePolicy::Lru)) {
        Ok(_) => eprintln!("/dev/shm accepts O_DIRECT here: skipped"),
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("O_DIRECT") && msg.contains("--io buffered"), "{msg}");
        }
    }
    let store = ExpertStore::open(&dir, opts(0, IoMode::Buffered, CachePolicy::Lru)).unwrap();
    assert_eq!(store.io_mode(), IoMode::Buffered);
    assert_eq!(store.get(1, &[0]).unwrap()[0].bytes(), 4960);
}

#[test]
fn invalid_requests_are_errors() {
    let (_tmp, dir) = open_fixture();
    let store = ExpertStore::open(&dir, opts(0, IoMode::Buffered, CachePolicy::Lru)).unwrap();
    assert!(store.fetch(0, &[0]).is_err(), "layer 0 is dense");
    assert!(store.fetch(1, &[16]).is_err());
    store.prefetch(1, &[99]);
    assert_eq!(store.counters().prefetch_issued, 0);
    // Duplicates in one request are served once each.
    let got = store.get(1, &[3, 3]).unwrap();
    assert_eq!(got[0].as_bytes(), got[1].as_bytes());
}

/// The model's logits are bit-identical whatever the store does: budget, policy, I/O mode and
/// next-layer prefetch only change where expert bytes come from.
#[test]
fn model_output_is_identical_for_every_store_configuration() {
    use crate::models::deepseek_v3::DeepseekV3;
    use crate::CausalLm;
    let (_tmp, dir) = open_fixture();
    let io = *modes(&dir).first().unwrap();
    let configs = [
        (0, CachePolicy::Lru, io, false),
        (RECORD * 48, CachePolicy::Lfu, IoMode::Buffered, true),
        (RECORD, CachePolicy::Pinned, io, true),
        (RECORD * 24, CachePolicy::Lru, IoMode::Buffered, true),
        (RECORD * 24, CachePolicy::Pinned, io, false),
    ];
    let mut first: Option<Vec<Vec<u32>>> = None;
    for (budget, policy, io, prefetch) in configs {
        let model = DeepseekV3::load_with(&dir, opts_prefetch(budget, io, policy, prefetch)).unwrap();
        let mut cache = model.new_state();
        let mut bits = Vec::new();
        for t in [0u32, 5, 17, 3, 5, 9, 17, 0] {
            let (logits, _) = model.forward(cache.as_mut(), t).unwrap();
            bits.push(logits.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
        }
        let c = model.store().counters();
        assert_eq!(c.predicted_requests > 0, prefetch, "{c:?}");
        match &first {
            None => first = Some(bits),
            Some(f) => assert!(f == &bits, "{budget} {policy} {io} prefetch {prefetch}: logits differ"),
        }
    }
}

/// Demand reads are split into chunks taken in (request order, offset) order: with a slow device
/// (40 ms per chunk) and 2 readers, the records of one fetch complete one after the other in
/// offset order, the first reaching the caller before the last chunk is even handed out (checked
/// on the read log, not on a clock: a loaded machine stretches time, not order), while both
/// readers stay busy; with 4 readers the device keeps 4 chunks in flight and records complete
/// two by two, still in order.
#[test]
fn demand_chunks_complete_records_in_order_at_full_queue_depth() {
    let (_tmp, dir) = open_fixture();
    let want = reference(&dir);
    let request = [7usize, 3, 12, 0, 9, 5, 14, 1];
    let mut by_offset: Vec<usize> = (0..request.len()).collect();
    by_offset.sort_by_key(|&i| dir.record(2, request[i]).offset);
    for io in modes(&dir) {
        for readers in [2usize, 4] {
            let store = ExpertStore::open(
                &dir,
                StoreOptions {
                    readers,
                    ..opts(0, io, CachePolicy::Lru)
                },
            )
            .unwrap();
            let hooks = &store.shared.hooks;
            hooks.demand_delay_ms.store(40, Ordering::SeqCst);
            let handed_out = || {
                hooks
                    .events()
                    .iter()
                    .filter(|e| matches!(e, Event::DemandChunk(..)))
                    .count()
            };
            let mut order = Vec::new();
            let mut handed_out_at_first = None;
            for r in store.fetch(2, &request).unwrap() {
                let (i, e) = r.unwrap();
                handed_out_at_first.get_or_insert_with(handed_out);
                assert_eq!(e.as_bytes(), want[&(2, request[i])].as_slice(), "{io}");
                order.push(i);
            }
            // Chunks were handed out record by record, in offset order, each from its start.
            let chunks: Vec<(usize, usize)> = hooks
                .events()
                .iter()
                .filter_map(|e| match e {
                    Event::DemandChunk(k, start) => Some((k.1 as usize, *start)),
                    _ => None,
                })
                .collect();
            let expected: Vec<(usize, usize)> = by_offset
                .iter()
                .flat_map(|&i| [(request[i], 0), (request[i], 4096)])
                .collect();
            assert_eq!(chunks, expected, "{io} readers {readers}");
            assert_eq!(hooks.demand_max_running.load(Ordering::SeqCst), readers, "queue depth");
            // Records complete `readers / 2` at a time (2 chunks each), in offset order. Thread
            // scheduling on a loaded machine can swap neighbours, so check the trend: the records
            // delivered in the first half are, taken together, earlier in offset order than
            // those of the second half (the exact hand-out order is asserted above).
            let rank = |i: usize| by_offset.iter().position(|&j| j == i).unwrap();
            let half = order.len() / 2;
            let early: usize = order[..half].iter().map(|&i| rank(i)).sum();
            let late: usize = order[half..].iter().map(|&i| rank(i)).sum();
            assert!(early < late, "{io} readers {readers}: delivery order {order:?}");
            // Records stream: the first reached the caller while chunks were still to be handed
            // out (each takes 40 ms, so the last is handed out long after the first record).
            let at_first = handed_out_at_first.unwrap();
            assert!(
                at_first < chunks.len(),
                "{io} readers {readers}: the first record arrived after all {} chunks were handed out",
                chunks.len()
            );
            let c = store.counters();
            assert_eq!(c.bytes_read_demand, RECORD * request.len() as u64);
        }
    }
}

/// One read per record (`demand_chunk = usize::MAX`) still returns the pack's bytes.
#[test]
fn whole_record_demand_reads_still_work() {
    let (_tmp, dir) = open_fixture();
    let want = reference(&dir);
    for io in modes(&dir) {
        let store = ExpertStore::open(
            &dir,
            StoreOptions {
                demand_chunk: usize::MAX,
                ..opts(RECORD * 4, io, CachePolicy::Lru)
            },
        )
        .unwrap();
        let all: Vec<usize> = (0..N_EXPERTS).collect();
        for (e, got) in all.iter().zip(store.get(3, &all).unwrap()) {
            assert_eq!(got.as_bytes(), want[&(3, *e)].as_slice(), "{io}");
        }
        let chunks = store
            .shared
            .hooks
            .events()
            .iter()
            .filter(|e| matches!(e, Event::DemandChunk(..)))
            .count();
        assert_eq!(chunks, N_EXPERTS);
    }
}

/// A speculative read that yielded to demand after its first chunk, and is then requested on
/// demand, continues as a chunked demand read from where it stopped: nothing is read twice.
#[test]
fn demand_resumes_a_yielded_prefetch_from_its_progress() {
    let (_tmp, dir) = open_fixture();
    let want = reference(&dir);
    for demand_chunk in [4096, usize::MAX] {
        resume_yielded_prefetch(&dir, &want, demand_chunk);
    }
}

fn resume_yielded_prefetch(
    dir: &ModelDir,
    want: &std::collections::HashMap<(usize, usize), Vec<u8>>,
    demand_chunk: usize,
) {
    let store = ExpertStore::open_with(
        dir,
        StoreOptions {
            readers: 4,
            demand_chunk,
            ..prefetching(RECORD * 8, IoMode::Buffered)
        },
        4096,
    )
    .unwrap();
    let hooks = &store.shared.hooks;
    hooks.close_gate();
    store.prefetch(1, &[0]);
    wait_until("the speculative read to start", || {
        hooks.events().contains(&Event::SpecChunk((1, 0)))
    });
    // A slow demand read keeps demand pending while the speculative read finishes its first
    // chunk and yields.
    hooks.demand_delay_ms.store(300, Ordering::SeqCst);
    let slow = store.fetch(1, &[5]).unwrap();
    hooks.open_gate();
    std::thread::sleep(Duration::from_millis(100));
    hooks.demand_delay_ms.store(0, Ordering::SeqCst);
    let got = store.get(1, &[0]).unwrap();
    assert_eq!(got[0].as_bytes(), want[&(1, 0)].as_slice());
    let other = slow.in_order().unwrap();
    assert_eq!(other[0].as_bytes(), want[&(1, 5)].as_slice());
    let ev = hooks.events();
    assert!(ev.contains(&Event::DemandChunk((1, 0), 4096)), "{ev:?}");
    assert!(!ev.contains(&Event::DemandChunk((1, 0), 0)), "{ev:?}");
    let c = store.counters();
    assert_eq!((c.misses, c.prefetch_useful), (2, 1));
    assert_eq!(c.bytes_read_speculative, 4096);
    assert_eq!(c.bytes_read_demand, RECORD + 4096);
    assert_eq!(c.bytes_read(), 2 * RECORD);
}

/// Chunks may land out of order: with every record's second chunk landing before its first,
/// records are delivered whole and verified, and a corrupted byte in the second chunk is an error
/// naming layer and expert (the record is not cached).
#[test]
fn checksum_with_chunks_landing_out_of_order() {
    let (_tmp, path) = convert_fixture();
    corrupt_record(&path, (2, 7), 4500, 0x01);
    let dir = ModelDir::open(&path).unwrap();
    let want = reference(&dir);
    for io in modes(&dir) {
        let store = ExpertStore::open(
            &dir,
            StoreOptions {
                readers: 4,
                ..opts(RECORD * 8, io, CachePolicy::Lru)
            },
        )
        .unwrap();
        store.shared.hooks.first_chunk_delay_ms.store(60, Ordering::SeqCst);
        let mut results: Vec<_> = store.fetch(2, &[3, 7, 8]).unwrap().collect();
        results.sort_by_key(|r| r.as_ref().map(|(i, _)| *i).unwrap_or(1));
        let mut errors = 0;
        for r in results {
            match r {
                Ok((i, e)) => {
                    let ex = [3, 7, 8][i];
                    assert_ne!(ex, 7);
                    assert_eq!(e.as_bytes(), want[&(2, ex)].as_slice(), "{io}");
                }
                Err(e) => {
                    errors += 1;
                    assert_checksum_error_of_2_7(&e, &io.to_string());
                }
            }
        }
        assert_eq!(errors, 1, "{io}");
        assert!(store.shared.records[2][3].verified.load(Ordering::Acquire));
        assert!(!store.shared.records[2][7].verified.load(Ordering::Acquire));
        assert_eq!(store.cached_bytes(), 2 * RECORD, "{io}: the bad record is not cached");
        assert!(store.get(2, &[7]).is_err());
    }
}

// ---------------------------------------------------------------------------------------------
// Streaming installs: absent records fetched through a RecordSource.

/// Serves records from a full convert's pack; fails for the experts in `broken`.
struct PackSource {
    records: std::collections::HashMap<(usize, usize), Vec<u8>>,
    broken: Vec<(usize, usize)>,
    calls: AtomicUsize,
}

impl RecordSource for PackSource {
    fn fetch_record(&self, layer: usize, expert: usize) -> Result<Vec<u8>, String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        if self.broken.contains(&(layer, expert)) {
            return Err("HTTP 503 (gave up after 6 attempts)".into());
        }
        Ok(self.records[&(layer, expert)].clone())
    }
    fn describe(&self) -> String {
        "http://test/source".into()
    }
}

fn stream_fixture() -> (tempfile::TempDir, PathBuf, PathBuf) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_b");
    let (tmp, full) = convert_fixture();
    let st = tmp.path().join("stream");
    let extras = deltafin_format::convert::StreamExtras {
        source: deltafin_format::model_dir::StreamSource {
            url: "http://test/source".into(),
            revision: "main".into(),
            flat: false,
            allow_network: false,
            index: "stream-index.json".into(),
        },
        files: vec![],
    };
    deltafin_format::convert::convert_stream(&src, &st, &ConvertOptions::default(), &extras, &NoProgress).unwrap();
    (tmp, full, st)
}

#[test]
fn streaming_install_fetches_absent_records_durably() {
    let (_tmp, full, st) = stream_fixture();
    let want = reference(&ModelDir::open(&full).unwrap());
    let dir = ModelDir::open(&st).unwrap();
    // Without a source: the error names the expert and the command that fetches it.
    let store = ExpertStore::open(&dir, opts(0, IoMode::Buffered, CachePolicy::Lru)).unwrap();
    let err = store.get(2, &[5]).err().unwrap().to_string();
    assert!(
        err.contains("layer 2, expert 5") && err.contains("deltafin warm") && err.contains("--allow-network"),
        "{err}"
    );
    drop(store);

    let src = Arc::new(PackSource {
        records: want.clone(),
        broken: vec![(3, 7)],
        calls: AtomicUsize::new(0),
    });
    let o = StoreOptions {
        remote: Some(Remote(src.clone())),
        ..opts(0, IoMode::Direct, CachePolicy::Lru)
    };
    let store = ExpertStore::open(&dir, o.clone()).unwrap();
    for &l in &MOE_LAYERS {
        let experts: Vec<usize> = (0..N_EXPERTS).filter(|&e| (l, e) != (3, 7)).collect();
        for (e, x) in experts.iter().zip(store.get(l, &experts).unwrap()) {
            assert_eq!(x.as_bytes(), &want[&(l, *e)][..], "layer {l} expert {e}");
        }
    }
    let calls = src.calls.load(Ordering::SeqCst);
    assert_eq!(calls, 47);
    // Cached on disk: asking again fetches nothing.
    store.get(1, &[0, 1, 2]).unwrap();
    assert_eq!(src.calls.load(Ordering::SeqCst), calls);
    // A failing fetch is an error naming the expert and the source; nothing is journaled for it.
    let err = store.get(3, &[6, 7]).err().unwrap().to_string();
    assert!(
        err.contains("layer 3, expert 7") && err.contains("http://test/source") && err.contains("503"),
        "{err}"
    );
    drop(store);

    // Reopened without a source: the 47 journaled records are local, (3, 7) is not.
    let store = ExpertStore::open(&dir, opts(0, IoMode::Direct, CachePolicy::Lru)).unwrap();
    let again = store.get(3, &[0, 6, 15]).unwrap();
    assert_eq!(again[1].as_bytes(), &want[&(3, 6)][..]);
    assert!(store.get(3, &[7]).is_err());
    let present = deltafin_format::presence::present_checksums(&dir).unwrap();
    assert_eq!(present.len(), 47);
    assert!(!present.contains_key(&(3, 7)));
}
