//! The embedded store: limiter state in process, bounded and swept. One entry per
//! (route, client key) holds the states of that route's limits; entries live in
//! sharded maps, one LRU list per route within each shard, so the number of keys is
//! bounded, and a request's whole check-then-charge runs under one lock.
//!
//! A full shard makes room for a new entry by evicting, in this order: state that can
//! no longer matter (expired: back to full capacity), found among the least recently
//! used entries of each route; then the least recently used entry of the route that
//! holds the most entries in the shard (the inserting route on a tie). So a flood of
//! keys on one route evicts that route's own state, never another route's: no one can
//! buy a fresh budget on `/login` with keys sent to `/api`. Evictions of live state
//! are counted (`sluice_store_evictions_total{route}`) and logged.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lru::LruCache;

use super::algo::{judge, EMPTY};
use super::{Checked, Clock, Permit, Plan, State, Verdict};
use crate::metrics::EvictionCounters;

/// Shards of the key space; fewer when `max_keys` is smaller.
const SHARDS: usize = 32;
/// Entries a shard holds at least (when `max_keys` allows): routes share a shard, so
/// it must be large enough for each route's share to mean something.
const MIN_SHARD: usize = 64;
/// Least recently used entries of each route looked at for expired state before live
/// state is evicted.
const EXPIRED_SCAN: usize = 8;
/// Evictions of live state are logged at most this often.
const WARN_EVERY_US: u64 = 10_000_000;

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// Picks the shard; random per process so no one can aim keys at one shard.
    hasher: RandomState,
    clock: Arc<dyn Clock>,
    max_keys: usize,
    /// Counts evictions of live state by route; none for stores not reported.
    evictions: Option<Arc<EvictionCounters>>,
    /// Live entries evicted since the last warning, and when that was (clock µs).
    unwarned: AtomicU64,
    warned_at_us: AtomicU64,
    /// Requests in flight of the concurrency limits, one shard per entry shard.
    in_flight: Arc<InFlight>,
}

/// Requests in flight per (route, client key) and concurrency limit id, kept beside the
/// entries and never evicted: a count lives exactly while permits hold its slots, so
/// the map is bounded by the requests in flight, and no eviction can hand out a slot
/// that is still taken. Locked after the entry shard of the same index, and alone by
/// a permit's release.
struct InFlight {
    shards: Box<[Mutex<Counts>]>,
}

/// (limit id, requests in flight), by route and client key.
type Counts = HashMap<Box<str>, HashMap<Box<str>, Vec<(u64, u64)>>>;

/// The concurrency slots of one admitted request; dropping it gives them back.
pub struct Slots {
    in_flight: Arc<InFlight>,
    shard: usize,
    route: Box<str>,
    key: Box<str>,
    /// (limit id, slots taken).
    taken: Vec<(u64, u64)>,
}

/// One shard: the entries of each namespace (route), in least recently used order.
struct Shard {
    routes: HashMap<Box<str>, LruCache<Box<str>, Entry>>,
    len: usize,
    cap: usize,
}

/// The state of one limit for one key, with the time it stops mattering.
struct Slot {
    id: u64,
    state: State,
    expires_at_us: u64,
}

/// The states of one (route, client key), by `LimitDef::id`.
struct Entry {
    slots: Vec<Slot>,
    /// Max of the slots' expiry: from then on the entry is as good as absent.
    expires_at_us: u64,
}

// === impl MemoryStore ===

impl MemoryStore {
    /// A store holding at most `max_keys` (route, client key) entries.
    pub fn new(max_keys: usize, clock: Arc<dyn Clock>) -> MemoryStore {
        let max_keys = max_keys.max(1);
        let n = (max_keys / MIN_SHARD).clamp(1, SHARDS);
        // Capacities add up to exactly max_keys.
        let shards = (0..n)
            .map(|i| {
                Mutex::new(Shard {
                    routes: HashMap::new(),
                    len: 0,
                    cap: (max_keys / n + usize::from(i < max_keys % n)).max(1),
                })
            })
            .collect();
        MemoryStore {
            shards,
            hasher: RandomState::new(),
            clock,
            max_keys,
            evictions: None,
            unwarned: AtomicU64::new(0),
            warned_at_us: AtomicU64::new(0),
            in_flight: Arc::new(InFlight {
                shards: (0..n).map(|_| Mutex::new(HashMap::new())).collect(),
            }),
        }
    }

    /// Counts this store's evictions of live state in `counters`, by route.
    pub fn with_evictions(mut self, counters: Arc<EvictionCounters>) -> MemoryStore {
        self.evictions = Some(counters);
        self
    }

    /// Decides one request of `key` on `route` against every limit of `plan`, and
    /// charges all of them if all admit (atomically: under the entry's shard lock).
    /// Concurrency slots it takes are given back at once: see `acquire`.
    pub fn check(&self, route: &str, key: &str, plan: &Plan) -> Verdict {
        self.acquire(route, key, plan).verdict
    }

    /// `check`, returning with the verdict the permit that holds the request's
    /// concurrency slots until it is dropped. The in-flight counts are read and taken
    /// under the same locks as the other limits: a request refused by another limit
    /// takes no slot, and one refused for want of a slot is charged nothing.
    pub fn acquire(&self, route: &str, key: &str, plan: &Plan) -> Checked {
        let probe = (route, key);
        let shard = self.shard_index(&probe);
        let mut cache = self.shard(&probe);
        // Read under the lock so commits to one entry happen in clock order.
        let now = self.clock.now_us();
        let mut in_flight = plan
            .has_concurrency()
            .then(|| lock(&self.in_flight.shards[shard]));
        // The in-flight counts as states, by plan index (empty for the other limits).
        let held: Vec<State> = match &in_flight {
            None => Vec::new(),
            Some(map) => {
                let counts = map.get(route).and_then(|keys| keys.get(key));
                plan.limits
                    .iter()
                    .map(|l| match counts {
                        Some(c) if l.algorithm.is_concurrency() => {
                            let n = c.iter().find(|(id, _)| *id == l.id).map_or(0, |c| c.1);
                            State::InFlight(n)
                        }
                        _ => State::Empty,
                    })
                    .collect()
            }
        };
        let verdict = if let Some(entry) = cache.get_mut(route, key) {
            let verdict = judge(plan, now, |i| {
                if plan.limits[i].algorithm.is_concurrency() {
                    &held[i]
                } else {
                    entry.state(plan.limits[i].id)
                }
            });
            if verdict.allowed {
                entry.charge(plan, now);
            }
            drop(cache);
            verdict
        } else {
            let verdict = judge(plan, now, |i| held.get(i).unwrap_or(&EMPTY));
            // Requests in flight are counted beside the entries: a plan of
            // concurrency limits alone keeps no entry.
            if verdict.allowed && plan.limits.iter().any(|l| !l.algorithm.is_concurrency()) {
                let mut entry = Entry {
                    slots: Vec::with_capacity(plan.limits.len()),
                    expires_at_us: 0,
                };
                entry.charge(plan, now);
                let evicted = cache.insert(route, key, entry, now);
                drop(cache);
                if let Some(ns) = evicted {
                    self.evicted_live(&ns, now);
                }
            }
            verdict
        };
        let permit = match in_flight.as_mut() {
            Some(map) if verdict.allowed => Permit::Memory(self.take(map, shard, route, key, plan)),
            _ => Permit::None,
        };
        Checked { verdict, permit }
    }

    /// Takes one slot of every concurrency limit of `plan` (which admitted).
    fn take(&self, map: &mut Counts, shard: usize, route: &str, key: &str, plan: &Plan) -> Slots {
        let counts = map
            .entry(route.into())
            .or_default()
            .entry(key.into())
            .or_default();
        let mut taken = Vec::with_capacity(1);
        for l in plan.limits.iter().filter(|l| l.algorithm.is_concurrency()) {
            match counts.iter_mut().find(|(id, _)| *id == l.id) {
                Some(c) => c.1 += l.cost,
                None => counts.push((l.id, l.cost)),
            }
            taken.push((l.id, l.cost));
        }
        Slots {
            in_flight: self.in_flight.clone(),
            shard,
            route: route.into(),
            key: key.into(),
            taken,
        }
    }

    /// Requests in flight of `key` on `route` under the concurrency limit `id`.
    pub fn in_flight(&self, route: &str, key: &str, id: u64) -> u64 {
        let map = lock(&self.in_flight.shards[self.shard_index(&(route, key))]);
        map.get(route)
            .and_then(|keys| keys.get(key))
            .and_then(|c| c.iter().find(|(i, _)| *i == id))
            .map_or(0, |c| c.1)
    }

    fn shard_index(&self, probe: &(&str, &str)) -> usize {
        (self.hasher.hash_one(probe) % self.shards.len() as u64) as usize
    }

    /// Number of (route, client key) entries held.
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.shards.iter().all(|s| lock(s).len == 0)
    }

    /// Removes every entry that can no longer influence a decision at the clock's now;
    /// returns how many were removed.
    pub fn sweep(&self) -> usize {
        // Read once before locking: entries only ever expire later, so whatever has
        // expired by this time has also expired by the time its shard is scanned.
        let now = self.clock.now_us();
        self.shards
            .iter()
            .map(|s| {
                let mut shard = lock(s);
                let before = shard.len;
                for lru in shard.routes.values_mut() {
                    lru.retain(|_, entry| entry.expires_at_us > now);
                }
                shard.routes.retain(|_, lru| !lru.is_empty());
                shard.len = shard.routes.values().map(LruCache::len).sum();
                before - shard.len
            })
            .sum()
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }

    fn shard(&self, probe: &(&str, &str)) -> MutexGuard<'_, Shard> {
        lock(&self.shards[self.shard_index(probe)])
    }

    /// Counts a live entry of `ns` evicted, and says so in the log now and then (with
    /// how many since the last time), not once per request.
    fn evicted_live(&self, ns: &str, now: u64) {
        if let Some(counters) = &self.evictions {
            counters.count(ns);
        }
        self.unwarned.fetch_add(1, Ordering::Relaxed);
        let last = self.warned_at_us.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= WARN_EVERY_US)
            && self
                .warned_at_us
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            let evicted = self.unwarned.swap(0, Ordering::Relaxed);
            tracing::warn!(
                namespace = ns,
                evicted,
                max_keys = self.max_keys,
                "memory store full: evicted limiter state that was still in use (its keys start afresh); raise store.memory.max_keys"
            );
        }
    }
}

// === impl Slots ===

impl Drop for Slots {
    fn drop(&mut self) {
        let mut map = lock(&self.in_flight.shards[self.shard]);
        let Some(keys) = map.get_mut(&self.route) else {
            return;
        };
        if let Some(counts) = keys.get_mut(&self.key) {
            for (id, n) in &self.taken {
                if let Some(c) = counts.iter_mut().find(|(i, _)| i == id) {
                    c.1 = c.1.saturating_sub(*n);
                }
            }
            counts.retain(|c| c.1 > 0);
            if counts.is_empty() {
                keys.remove(&self.key);
            }
        }
        if keys.is_empty() {
            map.remove(&self.route);
        }
    }
}

/// A panic while a shard was locked leaves at worst one request half charged; the
/// store keeps serving rather than poisoning every later request.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// === impl Shard ===

impl Shard {
    /// The entry of (`route`, `key`), now the most recently used of its route.
    fn get_mut(&mut self, route: &str, key: &str) -> Option<&mut Entry> {
        self.routes.get_mut(route)?.get_mut(key)
    }

    /// Adds a new entry, making room first when the shard is full. Returns the
    /// namespace of the live entry evicted for it, if one was.
    fn insert(&mut self, route: &str, key: &str, entry: Entry, now: u64) -> Option<Box<str>> {
        let mut evicted = None;
        if self.len >= self.cap && self.evict_expired(now) == 0 {
            evicted = self.evict_live(route, now);
        }
        self.routes
            .entry(route.into())
            .or_insert_with(LruCache::unbounded)
            .put(key.into(), entry);
        self.len += 1;
        evicted
    }

    /// Removes the expired entries among the `EXPIRED_SCAN` least recently used of
    /// every route; returns how many.
    fn evict_expired(&mut self, now: u64) -> usize {
        let mut removed = 0;
        for lru in self.routes.values_mut() {
            let expired: Vec<Box<str>> = lru
                .iter()
                .rev()
                .take(EXPIRED_SCAN)
                .filter(|(_, e)| e.expires_at_us <= now)
                .map(|(k, _)| k.clone())
                .collect();
            for k in &expired {
                lru.pop(k);
            }
            removed += expired.len();
        }
        self.routes.retain(|_, lru| !lru.is_empty());
        self.len -= removed;
        removed
    }

    /// Evicts the least recently used entry of the route with the most entries here
    /// (`inserting` on a tie); returns its namespace if the entry was live.
    fn evict_live(&mut self, inserting: &str, now: u64) -> Option<Box<str>> {
        let (ns, lru) = self
            .routes
            .iter_mut()
            .max_by_key(|(ns, lru)| (lru.len(), &***ns == inserting))?;
        let (_, entry) = lru.pop_lru()?;
        let ns = ns.clone();
        if lru.is_empty() {
            self.routes.remove(&ns);
        }
        self.len -= 1;
        (entry.expires_at_us > now).then_some(ns)
    }
}

// === impl Entry ===

impl Entry {
    fn state(&self, id: u64) -> &State {
        self.slots
            .iter()
            .find(|s| s.id == id)
            .map_or(&EMPTY, |s| &s.state)
    }

    /// Charges the request to every limit of `plan` (after all of them admitted).
    fn charge(&mut self, plan: &Plan, now: u64) {
        let max_delay_us = plan.max_delay_us();
        // Requests in flight are counted beside the entry (`InFlight`), not in it.
        for limit in plan.limits.iter().filter(|l| !l.algorithm.is_concurrency()) {
            let i = match self.slots.iter().position(|s| s.id == limit.id) {
                Some(i) => i,
                None => {
                    self.slots.push(Slot {
                        id: limit.id,
                        state: State::Empty,
                        expires_at_us: 0,
                    });
                    self.slots.len() - 1
                }
            };
            let slot = &mut self.slots[i];
            limit
                .algorithm
                .charge(&mut slot.state, now, limit.cost, max_delay_us);
            slot.expires_at_us = limit.algorithm.expires_at_us(&slot.state);
        }
        // States of limits a reload removed, or gave another algorithm or window (a new
        // id), are not read now; drop them once they have expired.
        if self.slots.len() > plan.limits.len() {
            self.slots
                .retain(|s| s.expires_at_us > now || plan.limits.iter().any(|l| l.id == s.id));
        }
        self.expires_at_us = self
            .slots
            .iter()
            .map(|s| s.expires_at_us)
            .max()
            .unwrap_or(0);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::limit::{Algorithm, LimitDef, ManualClock, Mode, Rate};

    const S: u64 = 1_000_000;
    /// A whole number of days since the epoch.
    const BASE_US: u64 = 20_834 * 86_400 * S;

    fn plan(limits: Vec<LimitDef>) -> Plan {
        Plan {
            limits,
            mode: Mode::Reject,
        }
    }

    fn fixed(name: &str, limit: u64, window_us: u64) -> LimitDef {
        LimitDef::new(name.into(), Algorithm::FixedWindow { limit, window_us }, 1)
    }

    fn bucket(name: &str, count: u64, burst: u64) -> LimitDef {
        LimitDef::new(
            name.into(),
            Algorithm::TokenBucket {
                rate: Rate { count, per_us: S },
                burst,
            },
            1,
        )
    }

    fn store(max_keys: usize) -> (Arc<ManualClock>, MemoryStore) {
        let clock = ManualClock::new(BASE_US);
        (clock.clone(), MemoryStore::new(max_keys, clock))
    }

    fn remaining(v: &Verdict) -> Vec<u64> {
        v.outcomes.iter().map(|o| o.remaining).collect()
    }

    fn slots(store: &MemoryStore, route: &str, key: &str) -> Option<Vec<u64>> {
        let probe = (route, key);
        let shard = store.shard(&probe);
        shard
            .routes
            .get(route)?
            .peek(key)
            .map(|e| e.slots.iter().map(|s| s.id).collect())
    }

    #[test]
    fn capacity_is_exactly_max_keys() {
        for max_keys in [0, 1, 5, 31, 32, 33, 1000, 1_000_000] {
            let (_, store) = store(max_keys);
            let total: usize = store.shards.iter().map(|s| lock(s).cap).sum();
            assert_eq!(total, max_keys.max(1), "{max_keys}");
            assert!(store.shards.len() <= SHARDS);
        }
    }

    #[test]
    fn keys_are_bounded_and_recent_ones_kept() {
        let (_, store) = store(1000);
        let p = plan(vec![fixed("daily", 10_000, 86_400 * S)]);
        for i in 0..2000 {
            store.check("api", &format!("key-{i}"), &p);
            // Used after every new key: always the most recent in its shard.
            store.check("api", "hot", &p);
        }
        let len = store.len();
        assert!((900..=1000).contains(&len), "{len}");
        assert!(!store.is_empty());
        // 2000 earlier requests of "hot", and this one.
        assert_eq!(remaining(&store.check("api", "hot", &p)), [7_999]);
        assert_eq!(remaining(&store.check("api", "key-1999", &p)), [9_998]);
    }

    #[test]
    fn sweep_removes_expired_entries_only() {
        let (clock, store) = store(100);
        let window = plan(vec![fixed("w", 5, S)]);
        // 10/s, burst 5: one request is refilled in 100ms.
        let tb = plan(vec![bucket("b", 10, 5)]);
        // Expires with the longer of its two limits.
        let both = plan(vec![fixed("w", 5, S), fixed("m", 5, 60 * S)]);
        store.check("r", "a", &window);
        store.check("r", "t", &tb);
        store.check("r", "both", &both);
        clock.advance(99_999);
        assert_eq!(store.sweep(), 0);
        clock.advance(1);
        assert_eq!(store.sweep(), 1); // t
        clock.set(BASE_US + S);
        store.check("r", "b", &window);
        store.check("r", "b", &window);
        assert_eq!(store.sweep(), 1); // a: its window ended at BASE + 1s
        assert_eq!(store.len(), 2);
        assert_eq!(remaining(&store.check("r", "b", &window)), [2]);
        assert_eq!(remaining(&store.check("r", "both", &both)), [4, 3]);
        clock.set(BASE_US + 60 * S);
        assert_eq!(store.sweep(), 2);
        assert!(store.is_empty());
    }

    #[test]
    fn concurrent_requests_are_admitted_exactly_up_to_the_limit() {
        let plans = [
            plan(vec![fixed("w", 100, 60 * S)]),
            plan(vec![bucket("b", 1, 100)]),
            // Both limits are charged together or not at all.
            plan(vec![fixed("w", 100, 60 * S), bucket("b", 1, 150)]),
        ];
        for p in &plans {
            let (_, store) = store(1000);
            let admitted = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for _ in 0..300 {
                    s.spawn(|| {
                        if store.check("r", "k", p).allowed {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                    });
                }
            });
            assert_eq!(admitted.load(Ordering::Relaxed), 100, "{p:?}");
            let after = store.check("r", "k", p);
            assert!(!after.allowed);
            if p.limits.len() == 2 {
                // The bucket was charged 100 times: 50 left, 49 after this request
                // (its own outcome is the one had it been charged).
                assert_eq!(remaining(&after), [0, 49]);
            }
        }
    }

    #[test]
    fn state_survives_a_new_plan_unless_algorithm_or_window_changed() {
        let (clock, store) = store(100);
        let old = plan(vec![
            bucket("burst", 10, 5),
            fixed("daily", 100, 86_400 * S),
        ]);
        for _ in 0..3 {
            store.check("api", "k", &old);
        }
        // burst: new numbers, same state (2 tokens left, now of 8: 1 after this one).
        // daily: a new window length starts afresh.
        let new = plan(vec![bucket("burst", 10, 8), fixed("daily", 100, 3_600 * S)]);
        assert_eq!(old.limits[0].id, new.limits[0].id);
        assert_ne!(old.limits[0].version, new.limits[0].version);
        assert_ne!(old.limits[1].id, new.limits[1].id);
        assert_eq!(remaining(&store.check("api", "k", &new)), [1, 99]);
        // The old daily state is kept until it can no longer matter...
        let ids = |p: &Plan| p.limits.iter().map(|l| l.id).collect::<Vec<_>>();
        let mut all = ids(&old);
        all.push(new.limits[1].id);
        assert_eq!(slots(&store, "api", "k"), Some(all));
        // ...(the end of the day), then dropped by the next charge.
        clock.set(BASE_US + 86_400 * S);
        assert_eq!(remaining(&store.check("api", "k", &new)), [7, 99]);
        assert_eq!(slots(&store, "api", "k"), Some(ids(&new)));
    }

    #[test]
    fn a_refused_new_key_is_not_stored() {
        let (_, store) = store(100);
        let p = plan(vec![LimitDef::new(
            "big".into(),
            Algorithm::FixedWindow {
                limit: 1,
                window_us: S,
            },
            2,
        )]);
        assert!(!store.check("r", "k", &p).allowed);
        assert!(store.is_empty());
        // No limits: allowed, nothing to keep.
        assert!(store.check("r", "k", &plan(vec![])).allowed);
        assert_eq!(store.len(), 0);
    }

    #[test]
    fn routes_and_keys_are_separate() {
        let (_, store) = store(100);
        let p = plan(vec![fixed("w", 5, S)]);
        assert_eq!(remaining(&store.check("a", "k", &p)), [4]);
        assert_eq!(remaining(&store.check("a", "k", &p)), [3]);
        assert_eq!(remaining(&store.check("b", "k", &p)), [4]);
        assert_eq!(remaining(&store.check("a", "k2", &p)), [4]);
        // The pair is compared as a pair, not as a concatenation.
        assert_eq!(remaining(&store.check("ak", "", &p)), [4]);
        assert_eq!(remaining(&store.check("", "ak", &p)), [4]);
        assert_eq!(store.len(), 5);
    }

    fn concurrency(name: &str, limit: u64) -> LimitDef {
        LimitDef::new(
            name.into(),
            Algorithm::Concurrency {
                limit,
                lease_us: 60 * S,
            },
            1,
        )
    }

    #[test]
    fn slots_are_held_by_permits_and_given_back_on_drop() {
        let (_, store) = store(100);
        let p = plan(vec![concurrency("c", 2)]);
        let id = p.limits[0].id;
        let a = store.acquire("r", "k", &p);
        let b = store.acquire("r", "k", &p);
        assert_eq!(
            (remaining(&a.verdict), remaining(&b.verdict)),
            (vec![1], vec![0])
        );
        let c = store.acquire("r", "k", &p);
        assert!(!c.verdict.allowed);
        assert!(matches!(c.permit, Permit::None));
        assert_eq!(c.verdict.retry_after_us(), 1_000_000);
        assert_eq!(store.in_flight("r", "k", id), 2);
        // Other keys and routes have their own slots.
        assert!(store.acquire("r", "other", &p).verdict.allowed);
        assert!(store.acquire("r2", "k", &p).verdict.allowed);
        drop(a);
        assert_eq!(store.in_flight("r", "k", id), 1);
        let d = store.acquire("r", "k", &p);
        assert_eq!(remaining(&d.verdict), [0]);
        drop((b, d));
        assert_eq!(store.in_flight("r", "k", id), 0);
        // `check` gives its slot back at once; only concurrency: no entry is kept.
        assert!(store.check("r", "k", &p).allowed);
        assert_eq!(store.in_flight("r", "k", id), 0);
        assert!(store.is_empty());
        assert!(lock(&store.in_flight.shards[0]).is_empty());
    }

    #[test]
    fn eviction_and_sweep_never_free_a_slot_in_flight() {
        let (clock, store) = store(1);
        let p = plan(vec![concurrency("c", 1), fixed("w", 100, S)]);
        let held = store.acquire("r", "k", &p);
        assert!(held.verdict.allowed);
        // Evicts the entry of "k" (max_keys 1), and time passes its window.
        for i in 0..10 {
            store.check("r", &format!("other-{i}"), &p);
        }
        clock.advance(10 * S);
        store.sweep();
        let v = store.acquire("r", "k", &p).verdict;
        assert!(!v.allowed, "{v:?}");
        drop(held);
        assert!(store.acquire("r", "k", &p).verdict.allowed);
    }

    #[test]
    fn a_reload_keeps_the_slots_in_flight_of_an_unchanged_limit() {
        let (_, store) = store(10);
        let old = plan(vec![concurrency("c", 1)]);
        let held = store.acquire("r", "k", &old);
        let raised = plan(vec![LimitDef::new(
            "c".into(),
            Algorithm::Concurrency {
                limit: 2,
                lease_us: 5 * S,
            },
            1,
        )]);
        assert_eq!(old.limits[0].id, raised.limits[0].id);
        let again = store.acquire("r", "k", &raised);
        assert_eq!(remaining(&again.verdict), [0]);
        assert!(!store.acquire("r", "k", &raised).verdict.allowed);
        // Released under the new plan, by the permit taken under the old one.
        drop(held);
        assert_eq!(remaining(&store.acquire("r", "k", &raised).verdict), [0]);
        drop(again);
    }

    #[test]
    fn slots_are_taken_exactly_up_to_the_limit_under_contention() {
        let (_, store) = store(1000);
        let p = plan(vec![concurrency("c", 10), fixed("w", 1000, 60 * S)]);
        let held = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..100 {
                s.spawn(|| {
                    let c = store.acquire("r", "k", &p);
                    if c.verdict.allowed {
                        lock(&held).push(c.permit);
                    }
                });
            }
        });
        assert_eq!(lock(&held).len(), 10);
        // The window limit was charged by the 10 admitted only.
        lock(&held).clear();
        assert_eq!(remaining(&store.check("r", "k", &p)), [9, 989]);
    }

    #[test]
    fn a_poisoned_shard_keeps_serving() {
        let (_, store) = store(1);
        let p = plan(vec![fixed("w", 5, S)]);
        store.check("r", "k", &p);
        let panicked = std::thread::scope(|s| {
            s.spawn(|| {
                let _guard = store.shards[0].lock();
                panic!("while holding the shard");
            })
            .join()
            .is_err()
        });
        assert!(panicked && store.shards[0].is_poisoned());
        assert_eq!(remaining(&store.check("r", "k", &p)), [3]);
        assert_eq!((store.len(), store.sweep()), (1, 0));
    }

    /// Counters for routes "api" and "login" (its IP fallback namespace included).
    fn counted(store: MemoryStore) -> (MemoryStore, crate::metrics::Metrics) {
        let m = crate::metrics::Metrics::new();
        m.store_namespaces("api", &["api", "api/ip"]);
        m.store_namespaces("login", &["login", "login/ip"]);
        m.store_namespaces("a", &["a"]);
        m.store_namespaces("b", &["b"]);
        (store.with_evictions(m.eviction_counters.clone()), m)
    }

    fn evictions(m: &crate::metrics::Metrics, route: &str) -> u64 {
        m.store_evictions.with_label_values(&[route]).get()
    }

    /// 2,500 API keys on one route do not give an IP on /login a fresh budget.
    #[test]
    fn a_flood_of_keys_on_one_route_keeps_another_routes_state() {
        let (_, store) = store(1000);
        let (store, m) = counted(store);
        let login = plan(vec![fixed("w", 5, 60 * S)]);
        let api = plan(vec![fixed("h", 10, 3_600 * S)]);
        for left in [4, 3, 2, 1] {
            assert_eq!(
                remaining(&store.check("login/ip", "10.0.0.1", &login)),
                [left]
            );
        }
        for i in 0..2_500 {
            assert!(store.check("api", &format!("key-{i}"), &api).allowed);
        }
        assert_eq!(store.len(), 1000);
        let last = store.check("login/ip", "10.0.0.1", &login);
        assert_eq!((last.allowed, remaining(&last)), (true, vec![0]));
        assert!(!store.check("login/ip", "10.0.0.1", &login).allowed);
        // Every eviction was of the flooding route's live state: 2,501 entries made,
        // 1,000 kept.
        assert_eq!(evictions(&m, "api"), 1_501);
        assert_eq!(evictions(&m, "login"), 0);
    }

    #[test]
    fn expired_state_is_evicted_before_live_state() {
        let (clock, store) = store(2);
        let (store, m) = counted(store);
        assert_eq!(store.shards.len(), 1);
        let hour = plan(vec![fixed("h", 5, 3_600 * S)]);
        let second = plan(vec![fixed("s", 5, S)]);
        store.check("a", "live", &hour);
        // Used last, but back to full capacity a second later.
        store.check("a", "expired", &second);
        clock.advance(S);
        store.check("b", "new", &hour);
        assert_eq!(slots(&store, "a", "expired"), None);
        assert!(slots(&store, "a", "live").is_some());
        assert_eq!((evictions(&m, "a"), evictions(&m, "b")), (0, 0));
        // Only live state left, one entry each: the inserting route gives up its own.
        store.check("b", "newer", &hour);
        assert_eq!(slots(&store, "b", "new"), None);
        assert_eq!(remaining(&store.check("a", "live", &hour)), [3]);
        assert_eq!((evictions(&m, "a"), evictions(&m, "b")), (0, 1));
        assert_eq!(store.len(), 2);
    }

    /// A route that holds most of a shard gives up its entries to one that holds few.
    #[test]
    fn the_route_holding_most_entries_is_evicted_from() {
        let (_, store) = store(3);
        let (store, m) = counted(store);
        let hour = plan(vec![fixed("h", 5, 3_600 * S)]);
        store.check("a", "1", &hour);
        store.check("a", "2", &hour);
        store.check("b", "1", &hour);
        // b inserts: a holds two, so a's least recently used goes.
        store.check("b", "2", &hour);
        assert_eq!(slots(&store, "a", "1"), None);
        assert!(slots(&store, "a", "2").is_some());
        assert_eq!((evictions(&m, "a"), evictions(&m, "b")), (1, 0));
        // Now b holds two: it evicts its own from here on.
        store.check("b", "3", &hour);
        assert_eq!(slots(&store, "b", "1"), None);
        assert!(slots(&store, "a", "2").is_some());
        assert_eq!((evictions(&m, "a"), evictions(&m, "b")), (1, 1));
    }
}
