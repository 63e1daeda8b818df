//! The routed-expert store: records read on demand from `experts.pack` into a byte-budgeted LRU
//! cache.
//!
//! The store speaks in records and bytes and knows no model family. All reads of a layer's missing
//! experts are issued at once (one reader thread per record, so the device sees a queue depth of
//! up to top-k), and each record's XXH3-64 checksum is verified the first time it is read.
//!
//! Memory bound: the cache holds at most `budget` bytes of records; the records of the layer being
//! computed are additionally held by the caller until it finishes with them, so the peak is
//! `budget + top_k × record bytes`.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use deltafin_format::model_dir::{matrix_from_bytes, read_full_at, ExpertTensorLayout};
use deltafin_format::{AlignedBuf, ModelDir, StoredDtype};
use deltafin_kernels::MatRef;

use crate::EngineError;

/// One routed expert's record in memory.
pub struct Expert {
    buf: AlignedBuf,
    layout: Arc<[ExpertTensorLayout]>,
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

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.buf.len()
    }
}

/// Cumulative counters of an [`ExpertStore`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreCounters {
    /// Expert requests served from the cache.
    pub hits: u64,
    /// Expert requests that needed a read from storage.
    pub misses: u64,
    /// Records dropped from the cache to stay within the budget.
    pub evictions: u64,
    /// Bytes read from `experts.pack` on demand.
    pub bytes_read: u64,
    /// Nanoseconds the caller waited for reads.
    pub read_wait_ns: u64,
}

impl StoreCounters {
    /// hits / (hits + misses), or 0 when nothing was requested.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

struct CacheEntry {
    expert: Arc<Expert>,
    tick: u64,
}

#[derive(Default)]
struct Cache {
    map: HashMap<(u32, u32), CacheEntry>,
    lru: BTreeMap<u64, (u32, u32)>,
    used: u64,
    tick: u64,
}

struct RecordInfo {
    offset: u64,
    length: u64,
    xxh3: u64,
    verified: AtomicBool,
}

/// Routed experts on demand from `experts.pack`.
pub struct ExpertStore {
    path: PathBuf,
    file: File,
    layout: Arc<[ExpertTensorLayout]>,
    /// `[layer][expert]`, empty for dense layers.
    records: Vec<Vec<RecordInfo>>,
    budget: u64,
    cache: Mutex<Cache>,
    hits: AtomicU64,
    misses: AtomicU64,
    evictions: AtomicU64,
    bytes_read: AtomicU64,
    read_wait_ns: AtomicU64,
}

impl ExpertStore {
    /// Opens the expert pack of a model directory with a cache of at most `budget` bytes.
    pub fn open(dir: &ModelDir, budget: u64) -> Result<Self, EngineError> {
        let m = &dir.manifest;
        let path = dir.expert_pack_path();
        let file = File::open(&path).map_err(|e| deltafin_format::FormatError::Io {
            path: path.clone(),
            error: e,
        })?;
        let layout: Arc<[ExpertTensorLayout]> = m.experts.layout.clone().into();
        if layout.len() != 3 {
            return Err(EngineError::Invalid(format!(
                "{}: expert layout must hold gate_proj, up_proj, down_proj",
                path.display()
            )));
        }
        let cfg = &m.config;
        let mut records: Vec<Vec<RecordInfo>> = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let mut layer = Vec::new();
            if cfg.is_moe_layer(l) {
                for e in 0..cfg.n_routed_experts {
                    let r = dir.record(l, e);
                    let xxh3 = u64::from_str_radix(&r.xxh3, 16).map_err(|_| {
                        EngineError::Invalid(format!(
                            "{}: bad checksum {:?} for layer {l} expert {e}",
                            path.display(),
                            r.xxh3
                        ))
                    })?;
                    layer.push(RecordInfo {
                        offset: r.offset,
                        length: r.length,
                        xxh3,
                        verified: AtomicBool::new(false),
                    });
                }
            }
            records.push(layer);
        }
        // Validate the layout once so Expert::matrix cannot fail.
        for l in layout.iter() {
            let need = l.dtype.value_bytes(l.rows, l.cols) + l.dtype.scale_bytes(l.rows, l.cols);
            if l.bytes as usize != need || l.scales_offset < l.offset || (l.dtype == StoredDtype::Int8) {
                return Err(EngineError::Invalid(format!(
                    "{}: inconsistent expert layout for {}",
                    path.display(),
                    l.name
                )));
            }
        }
        Ok(ExpertStore {
            path,
            file,
            layout,
            records,
            budget,
            cache: Mutex::new(Cache::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            read_wait_ns: AtomicU64::new(0),
        })
    }

    /// Cache budget, bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes currently cached.
    pub fn cached_bytes(&self) -> u64 {
        self.cache.lock().map(|c| c.used).unwrap_or(0)
    }

    /// Counters so far.
    pub fn counters(&self) -> StoreCounters {
        StoreCounters {
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            evictions: self.evictions.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
            read_wait_ns: self.read_wait_ns.load(Ordering::Relaxed),
        }
    }

    /// Path of the expert pack.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Returns the records of `experts` in MoE layer `layer`, in the order given, reading the
    /// ones not cached concurrently.
    ///
    /// Errors: an I/O error or a checksum mismatch, naming layer and expert.
    pub fn get(&self, layer: usize, experts: &[usize]) -> Result<Vec<Arc<Expert>>, EngineError> {
        let mut out: Vec<Option<Arc<Expert>>> = vec![None; experts.len()];
        let mut missing = Vec::new();
        {
            let mut c = self
                .cache
                .lock()
                .map_err(|_| EngineError::Invalid("expert cache lock poisoned".into()))?;
            for (i, &e) in experts.iter().enumerate() {
                let key = (layer as u32, e as u32);
                c.tick += 1;
                let tick = c.tick;
                if let Some(entry) = c.map.get_mut(&key) {
                    let old = std::mem::replace(&mut entry.tick, tick);
                    out[i] = Some(entry.expert.clone());
                    c.lru.remove(&old);
                    c.lru.insert(tick, key);
                    self.hits.fetch_add(1, Ordering::Relaxed);
                } else {
                    missing.push(i);
                    self.misses.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if missing.is_empty() {
            return Ok(out.into_iter().map(|x| x.expect("filled")).collect());
        }
        let t0 = Instant::now();
        let read: Vec<Result<Arc<Expert>, EngineError>> = if missing.len() == 1 {
            vec![self.read_record(layer, experts[missing[0]]).map(Arc::new)]
        } else {
            std::thread::scope(|s| {
                let handles: Vec<_> = missing
                    .iter()
                    .map(|&i| {
                        let e = experts[i];
                        s.spawn(move || self.read_record(layer, e).map(Arc::new))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(EngineError::Invalid("expert reader thread panicked".into())))
                    })
                    .collect()
            })
        };
        self.read_wait_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        let mut c = self
            .cache
            .lock()
            .map_err(|_| EngineError::Invalid("expert cache lock poisoned".into()))?;
        for (&i, r) in missing.iter().zip(read) {
            let expert = r?;
            out[i] = Some(expert.clone());
            self.insert(&mut c, (layer as u32, experts[i] as u32), expert);
        }
        Ok(out.into_iter().map(|x| x.expect("filled")).collect())
    }

    fn insert(&self, c: &mut Cache, key: (u32, u32), expert: Arc<Expert>) {
        let size = expert.bytes() as u64;
        if size > self.budget || c.map.contains_key(&key) {
            return;
        }
        while c.used + size > self.budget {
            let Some((&t, &victim)) = c.lru.iter().next() else {
                break;
            };
            c.lru.remove(&t);
            if let Some(v) = c.map.remove(&victim) {
                c.used -= v.expert.bytes() as u64;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        c.tick += 1;
        let tick = c.tick;
        c.lru.insert(tick, key);
        c.used += size;
        c.map.insert(key, CacheEntry { expert, tick });
    }

    fn read_record(&self, layer: usize, expert: usize) -> Result<Expert, EngineError> {
        let r = self
            .records
            .get(layer)
            .and_then(|l| l.get(expert))
            .ok_or_else(|| EngineError::Invalid(format!("no expert record for layer {layer}, expert {expert}")))?;
        let mut buf = AlignedBuf::zeroed(r.length as usize, 4096);
        read_full_at(&self.file, buf.as_mut_slice(), r.offset).map_err(|e| EngineError::ExpertIo {
            path: self.path.clone(),
            layer,
            expert,
            error: e,
        })?;
        self.bytes_read.fetch_add(r.length, Ordering::Relaxed);
        if !r.verified.load(Ordering::Relaxed) {
            let h = xxhash_rust::xxh3::xxh3_64(buf.as_slice());
            if h != r.xxh3 {
                return Err(EngineError::ExpertChecksum {
                    path: self.path.clone(),
                    layer,
                    expert,
                    expected: format!("{:016x}", r.xxh3),
                    found: format!("{h:016x}"),
                });
            }
            r.verified.store(true, Ordering::Relaxed);
        }
        Ok(Expert {
            buf,
            layout: self.layout.clone(),
        })
    }
}
