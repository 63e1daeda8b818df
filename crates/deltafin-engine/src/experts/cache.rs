//! The byte-budgeted record cache and its eviction policies.
//!
//! - `lru`: evict the least recently used record.
//! - `lfu`: LFU with dynamic aging (LFU-DA; Arlitt et al., "Evaluating content management
//!   techniques for Web proxy caches", 2000): each record's priority is `age + uses`, where `uses`
//!   counts requests since it entered the cache and `age` is the priority of the last record
//!   evicted; the lowest priority is evicted, ties broken by least recent use. Aging lets records
//!   that were hot long ago (an earlier prompt's topic) leave once newer records catch up.
//! - `pinned`: a tier of records chosen at open (hottest first in router traces, up to a fraction
//!   of the budget) that are never evicted once read, plus LRU in the rest of the budget.
//!
//! A record whose `Arc` is held outside the cache (by a live `Fetch` or by the caller) is never
//! evicted; when the evictable records cannot make room, the new record is simply not cached.
//! Sizes are resident sizes (the 4 KiB-rounded buffer), so the budget bounds real memory.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use super::{CachePolicy, Expert, Key};

pub(crate) struct Entry {
    pub(crate) expert: Arc<Expert>,
    size: u64,
    uses: u64,
    /// Key in `Cache::order`: (priority, tick of last use); unused for the pinned tier.
    rank: (u64, u64),
    pinned: bool,
    /// Bytes read speculatively for this record that no demand request has used yet.
    pub(crate) spec_unused: u64,
}

/// A record dropped to make room.
pub(crate) struct Evicted {
    pub(crate) spec_unused: u64,
}

pub(crate) enum Insert {
    /// Cached; these records were evicted to make room.
    Cached(Vec<Evicted>),
    /// Not cached: larger than the budget, or the evictable records cannot make room.
    NoRoom,
}

pub(crate) struct Cache {
    policy: CachePolicy,
    /// Records admitted to the pinned tier when read.
    pinned_keys: HashSet<Key>,
    pinned_budget: u64,
    pinned_used: u64,
    /// `budget - pinned_budget`: the evictable tier.
    general_budget: u64,
    general_used: u64,
    map: HashMap<Key, Entry>,
    /// Evictable records, lowest (priority, tick) first.
    order: BTreeMap<(u64, u64), Key>,
    tick: u64,
    /// LFU-DA inflation value: priority of the last evicted record.
    age: u64,
}

impl Cache {
    /// A cache of `budget` bytes of which `pinned_budget` are reserved for `pinned_keys`.
    pub(crate) fn new(policy: CachePolicy, budget: u64, pinned_keys: HashSet<Key>, pinned_budget: u64) -> Self {
        let pinned_budget = pinned_budget.min(budget);
        Cache {
            policy,
            pinned_keys,
            pinned_budget,
            pinned_used: 0,
            general_budget: budget - pinned_budget,
            general_used: 0,
            map: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            age: 0,
        }
    }

    /// Bytes cached (both tiers).
    pub(crate) fn used(&self) -> u64 {
        self.pinned_used + self.general_used
    }

    /// Bytes of the evictable tier.
    pub(crate) fn general_budget(&self) -> u64 {
        self.general_budget
    }

    pub(crate) fn contains(&self, key: &Key) -> bool {
        self.map.contains_key(key)
    }

    /// The keys of the pinned tier, in (layer, expert) order.
    pub(crate) fn pinned_keys(&self) -> Vec<Key> {
        let mut v: Vec<Key> = self.pinned_keys.iter().copied().collect();
        v.sort_unstable();
        v
    }

    /// Whether `key` goes to the pinned tier.
    pub(crate) fn is_pinned_key(&self, key: &Key) -> bool {
        self.pinned_keys.contains(key)
    }

    fn next_rank(&mut self, uses: u64) -> (u64, u64) {
        self.tick += 1;
        let priority = match self.policy {
            CachePolicy::Lfu => self.age + uses,
            CachePolicy::Lru | CachePolicy::Pinned => 0,
        };
        (priority, self.tick)
    }

    /// The cached record of `key`, without counting a use or changing its rank.
    pub(crate) fn peek(&self, key: &Key) -> Option<&Arc<Expert>> {
        self.map.get(key).map(|e| &e.expert)
    }

    /// Looks up `key` and counts a use of it.
    pub(crate) fn get(&mut self, key: &Key) -> Option<&mut Entry> {
        let (pinned, uses, old) = {
            let e = self.map.get(key)?;
            (e.pinned, e.uses, e.rank)
        };
        if !pinned {
            self.order.remove(&old);
            let rank = self.next_rank(uses + 1);
            self.order.insert(rank, *key);
            let e = self.map.get_mut(key)?;
            e.uses = uses + 1;
            e.rank = rank;
        }
        self.map.get_mut(key)
    }

    /// Caches `expert` under `key`, evicting as the policy says.
    pub(crate) fn insert(&mut self, key: Key, expert: Arc<Expert>, spec_unused: u64) -> Insert {
        if self.map.contains_key(&key) {
            return Insert::NoRoom;
        }
        let size = expert.resident_bytes() as u64;
        let pinned = self.pinned_keys.contains(&key) && self.pinned_used + size <= self.pinned_budget;
        let (rank, evicted) = if pinned {
            self.pinned_used += size;
            ((0, 0), Vec::new())
        } else {
            let Some(evicted) = self.make_room(size) else {
                return Insert::NoRoom;
            };
            let rank = self.next_rank(1);
            self.order.insert(rank, key);
            self.general_used += size;
            (rank, evicted)
        };
        self.map.insert(
            key,
            Entry {
                expert,
                size,
                uses: 1,
                rank,
                pinned,
                spec_unused,
            },
        );
        Insert::Cached(evicted)
    }

    /// Evicts the least valuable unheld records of the general tier until `size` more bytes fit
    /// in its budget; returns them, or `None` (evicting nothing) when they cannot be freed.
    fn make_room(&mut self, size: u64) -> Option<Vec<Evicted>> {
        if size > self.general_budget {
            return None;
        }
        let need = (self.general_used + size).saturating_sub(self.general_budget);
        let mut victims = Vec::new();
        if need > 0 {
            let mut freed = 0;
            for (&rank, k) in &self.order {
                let Some(e) = self.map.get(k) else { continue };
                if Arc::strong_count(&e.expert) > 1 {
                    continue; // held by a fetch or the caller
                }
                victims.push((rank, *k));
                freed += e.size;
                if freed >= need {
                    break;
                }
            }
            if freed < need {
                return None;
            }
        }
        let mut evicted = Vec::with_capacity(victims.len());
        for (rank, k) in victims {
            self.order.remove(&rank);
            if let Some(e) = self.map.remove(&k) {
                self.general_used -= e.size;
                self.age = self.age.max(rank.0);
                evicted.push(Evicted {
                    spec_unused: e.spec_unused,
                });
            }
        }
        Some(evicted)
    }

    /// Cached keys (tests).
    #[cfg(test)]
    pub(crate) fn keys(&self) -> std::collections::BTreeSet<Key> {
        self.map.keys().copied().collect()
    }
}
