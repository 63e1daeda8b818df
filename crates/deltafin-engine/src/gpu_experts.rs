//! The GPU expert cache: routed experts' weights resident in device memory, the tier above the
//! host expert cache (issue #16, "Placement").
//!
//! A MoE layer asks this cache first. Experts it holds are computed with no host work at all;
//! the others are read through the [`crate::experts::ExpertStore`] (host cache, O_DIRECT reads,
//! traces, streaming-install fetches, as on the CPU), copied to the device once and kept here
//! while the byte budget allows (least recently used first out). The host cache below it still
//! holds what it held: an expert evicted here comes back from host memory, not from disk, when
//! `--ram-budget` kept it.
//!
//! Exactness: the cache only decides where a record's bytes live; the device copy is the
//! record's bytes unchanged, so a hit computes exactly what a miss computes.

use std::collections::HashMap;
use std::sync::Arc;

use deltafin_cuda::{CudaError, GpuMat, StreamMark};

use crate::experts::Expert;

/// One routed expert on the device: `[gate_proj, up_proj, down_proj]` as in the record.
pub type GpuExpert = Arc<[GpuMat; 3]>;

/// Counters of the GPU expert cache (cumulative since load).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GpuCacheStats {
    /// Byte budget (`--gpu-budget`, or what the device had free after the backbone, less a
    /// margin).
    pub budget_bytes: u64,
    /// Bytes of expert weights resident now.
    pub resident_bytes: u64,
    /// Chosen experts found on the device.
    pub hits: u64,
    /// Chosen experts copied from the host (the store's record) for this use.
    pub misses: u64,
    /// Experts dropped to stay within the budget.
    pub evictions: u64,
    /// Bytes copied host to device for misses.
    pub bytes_uploaded: u64,
    /// Nanoseconds spent copying misses to the device (host side, including the wait for the
    /// copy).
    pub upload_ns: u64,
}

impl GpuCacheStats {
    /// Records of `record_bytes` that still fit in the budget.
    pub fn records_free(&self, record_bytes: u64) -> usize {
        (self.budget_bytes.saturating_sub(self.resident_bytes) / record_bytes.max(1)) as usize
    }
}

impl GpuCacheStats {
    /// hits / (hits + misses), or 0 when nothing was asked.
    pub fn hit_rate(&self) -> f64 {
        let n = self.hits + self.misses;
        if n == 0 {
            0.0
        } else {
            self.hits as f64 / n as f64
        }
    }
}

struct Entry<T> {
    expert: T,
    bytes: u64,
    last_use: u64,
}

/// Least-recently-used cache of device-resident experts keyed by `(layer, expert id)`, within a
/// byte budget. `T` is the handle kept per expert ([`GpuExpert`] on a device; any `Clone` in
/// the tests).
pub struct GpuExpertCache<T = GpuExpert> {
    map: HashMap<(u32, u32), Entry<T>>,
    /// Resident experts per layer.
    per_layer: HashMap<u32, usize>,
    tick: u64,
    stats: GpuCacheStats,
    /// Host records whose copies to the device may still be running (page-locked buffers copy
    /// asynchronously), each batch with a mark of the stream after its copies.
    held: std::collections::VecDeque<(StreamMark, Arc<Expert>)>,
}

impl<T> Drop for GpuExpertCache<T> {
    fn drop(&mut self) {
        // No record buffer goes back to the store while a copy may still read it.
        for (mark, _) in &self.held {
            let _ = mark.wait();
        }
    }
}

impl<T: Clone> GpuExpertCache<T> {
    /// An empty cache that holds at most `budget_bytes` of expert weights.
    pub fn new(budget_bytes: u64) -> Self {
        Self {
            map: HashMap::new(),
            per_layer: HashMap::new(),
            tick: 0,
            stats: GpuCacheStats {
                budget_bytes,
                ..Default::default()
            },
            held: std::collections::VecDeque::new(),
        }
    }

    /// Keeps `record` (the host side of copies queued before `mark`) until the stream is past
    /// `mark` ([`Self::release_passed`], [`Self::release_copied`]).
    pub fn hold(&mut self, mark: StreamMark, record: Arc<Expert>) {
        self.held.push_back((mark, record));
    }

    /// Drops the held records whose copies the stream has passed, oldest first, without
    /// waiting; the store may then reuse their buffers.
    ///
    /// # Errors
    /// A driver error raised by the copies.
    pub fn release_passed(&mut self) -> Result<(), CudaError> {
        while let Some((mark, _)) = self.held.front() {
            if !mark.passed()? {
                break;
            }
            self.held.pop_front();
        }
        Ok(())
    }

    /// Waits until the stream has passed every held mark (normally already so: a step reads the
    /// router's choice back before it fetches) and drops the held records.
    ///
    /// # Errors
    /// A driver error raised by the copies.
    pub fn release_copied(&mut self) -> Result<(), CudaError> {
        while let Some((mark, _)) = self.held.front() {
            mark.wait()?;
            self.held.pop_front();
        }
        Ok(())
    }

    /// The expert `(layer, expert)` when resident (counted as a hit and marked used), else
    /// `None` (counted as a miss: the caller uploads it and calls [`Self::insert`]).
    pub fn get(&mut self, layer: usize, expert: usize) -> Option<T> {
        self.tick += 1;
        match self.map.get_mut(&(layer as u32, expert as u32)) {
            Some(e) => {
                e.last_use = self.tick;
                self.stats.hits += 1;
                Some(e.expert.clone())
            }
            None => {
                self.stats.misses += 1;
                None
            }
        }
    }

    /// Records an upload of `bytes` that took `ns`.
    pub fn count_upload(&mut self, bytes: u64, ns: u64) {
        self.stats.bytes_uploaded += bytes;
        self.stats.upload_ns += ns;
    }

    /// Whether `(layer, expert)` is resident (not counted as a use).
    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.map.contains_key(&(layer as u32, expert as u32))
    }

    /// How many experts of `layer` are resident.
    pub fn resident_in_layer(&self, layer: usize) -> usize {
        self.per_layer.get(&(layer as u32)).copied().unwrap_or(0)
    }

    /// Keeps `expert` (`bytes` of device memory) for later uses, evicting the least recently used
    /// entries until it fits; an expert larger than the whole budget is not kept (the caller's
    /// handle still computes with it). Evicted weights are freed once no step holds them (the
    /// device frees them in stream order, after the kernels already queued). Returns the
    /// `(layer, expert)` keys evicted (for device tables that name them).
    pub fn insert(&mut self, layer: usize, expert: usize, gpu: T, bytes: u64) -> Vec<(usize, usize)> {
        let budget = self.stats.budget_bytes;
        let mut evicted = Vec::new();
        if bytes > budget {
            return evicted;
        }
        while self.stats.resident_bytes + bytes > budget {
            let Some((&key, _)) = self.map.iter().min_by_key(|(_, e)| e.last_use) else {
                break;
            };
            if let Some(old) = self.map.remove(&key) {
                self.stats.resident_bytes -= old.bytes;
                self.stats.evictions += 1;
                if let Some(n) = self.per_layer.get_mut(&key.0) {
                    *n = n.saturating_sub(1);
                }
                evicted.push((key.0 as usize, key.1 as usize));
            }
        }
        self.tick += 1;
        let key = (layer as u32, expert as u32);
        let entry = Entry {
            expert: gpu,
            bytes,
            last_use: self.tick,
        };
        match self.map.insert(key, entry) {
            Some(old) => self.stats.resident_bytes -= old.bytes,
            None => *self.per_layer.entry(key.0).or_insert(0) += 1,
        }
        self.stats.resident_bytes += bytes;
        evicted
    }

    /// Zeroes the hit, miss, eviction and upload counters (after a preload, so that they count
    /// the generation's own uses); the resident set stays.
    pub fn clear_counters(&mut self) {
        self.stats = GpuCacheStats {
            budget_bytes: self.stats.budget_bytes,
            resident_bytes: self.stats.resident_bytes,
            ..Default::default()
        };
    }

    /// The counters now.
    pub fn stats(&self) -> GpuCacheStats {
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_goes_first_within_the_budget() {
        let mut c: GpuExpertCache<u32> = GpuExpertCache::new(300);
        assert_eq!(c.get(1, 5), None);
        c.insert(1, 5, 15, 100);
        c.insert(1, 6, 16, 100);
        c.insert(2, 5, 25, 100);
        assert_eq!(c.get(1, 5), Some(15)); // (1,6) is now the least recently used
        assert_eq!(c.resident_in_layer(1), 2);
        assert_eq!(c.insert(3, 0, 30, 100), vec![(1, 6)]);
        assert_eq!((c.resident_in_layer(1), c.resident_in_layer(3)), (1, 1));
        assert_eq!(c.get(1, 6), None);
        assert_eq!(c.get(1, 5), Some(15));
        assert_eq!(c.get(2, 5), Some(25));
        assert_eq!(c.get(3, 0), Some(30));
        let s = c.stats();
        assert_eq!((s.hits, s.misses, s.evictions, s.resident_bytes), (4, 2, 1, 300));
        assert!((s.hit_rate() - 4.0 / 6.0).abs() < 1e-12);
    }

    #[test]
    fn an_expert_larger_than_the_budget_is_not_kept_and_evicts_nothing() {
        let mut c: GpuExpertCache<u32> = GpuExpertCache::new(150);
        c.insert(0, 0, 1, 100);
        c.insert(0, 1, 2, 200);
        assert_eq!(c.get(0, 0), Some(1));
        assert_eq!(c.get(0, 1), None);
        assert_eq!(c.stats().resident_bytes, 100);
        // Two that fit one at a time: the second replaces the first.
        c.insert(0, 2, 3, 100);
        assert_eq!(c.get(0, 0), None);
        assert_eq!(c.stats().resident_bytes, 100);
    }

    #[test]
    fn a_zero_budget_keeps_nothing() {
        let mut c: GpuExpertCache<u32> = GpuExpertCache::new(0);
        c.insert(0, 0, 1, 1);
        assert_eq!(c.get(0, 0), None);
        assert_eq!(c.stats().resident_bytes, 0);
    }
}
