//! The embedded store: limiter state in process, in sharded tables with one
//! least-recently-used list per route, so the number of keys is bounded and a flood
//! on one route evicts only that route's state. Why each entry is 64 flat bytes, and
//! the eviction order: ARCHITECTURE.md, "The memory store".

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash as _, Hasher, RandomState};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::algo::{judge, EMPTY};
use super::{Algorithm, Charge, Checked, Clock, LimitDef, Permit, Plan, Share, State, Verdict};
use crate::telemetry::metrics::EvictionCounters;

/// Shards of the key space; fewer when `max_keys` is smaller.
const SHARDS: usize = 32;
/// Entries a shard holds at least (when `max_keys` allows): routes share a shard, so
/// it must be large enough for each route's share to mean something.
const MIN_SHARD: usize = 64;
/// Entries a shard holds at most: an index slot keeps an entry number in 24 bits (more
/// shards are made for a larger `max_keys`).
const MAX_SHARD: usize = NUMBER as usize;
/// Shards at most, however large `max_keys` is: with them the store holds up to 2^36
/// entries, 4 TiB of them, more than any `max_keys` a machine can hold.
const MAX_SHARDS: usize = 4096;
/// Least recently used entries of each route looked at for expired state before live
/// state is evicted.
const EXPIRED_SCAN: usize = 8;
/// Evictions of live state are logged at most this often.
const WARN_EVERY_US: u64 = 10_000_000;
/// Entries per chunk of a shard's entry table: memory is taken a chunk at a time
/// (64 KiB) and entries never move between allocations.
const CHUNK: usize = 1024;
/// Smallest index (slots).
const MIN_INDEX: usize = 16;
/// The end of a route's list.
const NIL: u32 = u32::MAX;
/// An index slot holding no entry. (No entry has number 2^24 - 1: see `MAX_SHARD`.)
const FREE: u32 = u32::MAX;
/// The entry-number bits of an index slot; the 8 bits above are a tag from the hash,
/// so most probes of a full index never read an entry.
const NUMBER: u32 = (1 << 24) - 1;
/// `Entry::def` of an entry that has no state yet (being created).
const NO_STATE: u32 = u32::MAX;
/// `Entry::def` of an entry whose states are kept aside, in `Shard::spilled[w[0]]`.
const SPILLED: u32 = u32::MAX - 1;
/// The definitions table of a shard is compacted by a sweep when it holds more than
/// this many and at least half of them are no longer used.
const DEFS_COMPACT: usize = 64;

/// A keyed 128-bit hash of (route, client key): the entry's identity.
type Hash = [u64; 2];

pub struct MemoryStore {
    shards: Box<[Mutex<Shard>]>,
    /// Hashes (route, key); random per process so no one can aim keys at one shard or
    /// one index slot, nor make two pairs collide.
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

/// One shard: its entries, their index, and each route's list of them in least
/// recently used order.
struct Shard {
    /// Open addressing with linear probing, a power of two long, at most 3/4 full:
    /// per slot an entry number and 8 bits of its hash (`NUMBER`), or `FREE`.
    index: Box<[u32]>,
    /// The entries, numbered 0..len, `CHUNK` to a chunk; at most one chunk past them
    /// is kept, empty, so a full shard evicting and inserting allocates nothing.
    chunks: Vec<Vec<Entry>>,
    len: usize,
    cap: usize,
    /// By namespace number (`Entry::ns`). A namespace is kept once seen.
    routes: Vec<RouteList>,
    route_numbers: HashMap<Arc<str>, u32>,
    /// The limits whose state an entry holds inline (`Entry::def`).
    defs: Vec<Def>,
    def_numbers: HashMap<u64, u32>,
    /// The states of entries with `def == SPILLED`; free places listed in `unspilled`.
    spilled: Vec<Vec<Slot>>,
    unspilled: Vec<u32>,
}

/// A namespace's entries, most recently used first.
struct RouteList {
    name: Arc<str>,
    head: u32,
    tail: u32,
    len: usize,
}

/// A limit definition as an entry's inline state refers to it: by `LimitDef::version`,
/// so the algorithm holds the parameters the state was written under.
struct Def {
    id: u64,
    version: u64,
    algorithm: Algorithm,
}

/// The state of one limit for one key, with the time it stops mattering.
struct Slot {
    id: u64,
    state: State,
    expires_at_us: u64,
}

/// One (route, client key).
struct Entry {
    hash: Hash,
    /// Neighbours in the route's list (`NIL` at the ends).
    prev: u32,
    next: u32,
    /// The namespace (route), a number of the shard's `routes`.
    ns: u32,
    /// The limit whose state `w` holds, a number of the shard's `defs`; or `SPILLED`,
    /// or `NO_STATE`.
    def: u32,
    /// Max of the states' expiry: from then on the entry is as good as absent.
    expires_at_us: u64,
    /// The inline state (see `encode`), or with `SPILLED` the place of the states.
    w: [u64; 3],
}

/// What a tracked key costs, besides its index slot: checked here so a change to the
/// layout is a decision, not an accident.
const _: () = assert!(std::mem::size_of::<Entry>() == 64);

// === impl MemoryStore ===

impl MemoryStore {
    /// A store holding at most `max_keys` (route, client key) entries.
    pub fn new(max_keys: usize, clock: Arc<dyn Clock>) -> MemoryStore {
        let max_keys = max_keys.max(1);
        let n = (max_keys / MIN_SHARD)
            .clamp(1, SHARDS)
            .max(max_keys.div_ceil(MAX_SHARD))
            .min(MAX_SHARDS);
        // Capacities add up to exactly max_keys (up to MAX_SHARDS * MAX_SHARD).
        let shards = (0..n)
            .map(|i| {
                let cap = max_keys / n + usize::from(i < max_keys % n);
                Mutex::new(Shard::new(cap.clamp(1, MAX_SHARD)))
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
        let hash = self.hash(route, key);
        let shard = self.shard_index(&hash);
        let mut entries = lock(&self.shards[shard]);
        // Read under the lock so commits to one entry happen in clock order.
        let now = self.clock.now_us();
        let mut in_flight = plan
            .has_concurrency()
            .then(|| lock(&self.in_flight.shards[shard]));
        // The in-flight counts as states, by plan index (empty for the other limits).
        let held: Vec<State> = match &in_flight {
            None => Vec::new(),
            Some(map) => held_states(plan, map.get(route).and_then(|keys| keys.get(key))),
        };
        let verdict = if let Some(i) = entries.find(&hash) {
            entries.touch(i);
            let verdict = entries.decide(i, plan, now, &held);
            drop(entries);
            verdict
        } else {
            let verdict = judge(plan, now, |i| held.get(i).unwrap_or(&EMPTY));
            // Requests in flight are counted beside the entries: a plan of
            // concurrency limits alone keeps no entry.
            if verdict.allowed && plan.limits.iter().any(LimitDef::stateful_at_admission) {
                let ns = entries.route_number(route);
                let (i, evicted) = entries.insert(hash, ns, now);
                entries.charge(i, plan, now);
                drop(entries);
                if let Some(ns) = evicted {
                    self.evicted_live(&ns, now);
                }
            }
            verdict
        };
        let permit = match in_flight.as_mut() {
            Some(map) if verdict.allowed => {
                Permit::Memory(self.take(map, shard, route, key, plan, &verdict))
            }
            _ => Permit::None,
        };
        Checked { verdict, permit }
    }

    /// `acquire` for a request whose limits count several keys, one share each:
    /// every share is decided under the locks of all of their shards (taken in
    /// index order, the entry shards before the in-flight ones, so two requests never
    /// wait for each other), and charged only if every share admits.
    pub fn acquire_shares(&self, shares: &[Share<'_>], trial: u64) -> Checked {
        let n = shares.iter().map(|s| s.at.len()).sum();
        let hashes: Vec<(Hash, usize)> = shares
            .iter()
            .map(|s| {
                let hash = self.hash(s.ns, s.key);
                (hash, self.shard_index(&hash))
            })
            .collect();
        let mut order: Vec<usize> = hashes.iter().map(|h| h.1).collect();
        order.sort_unstable();
        order.dedup();
        let mut entries: Vec<(usize, MutexGuard<'_, Shard>)> =
            order.iter().map(|&i| (i, lock(&self.shards[i]))).collect();
        let now = self.clock.now_us();
        let concurrency = shares.iter().any(|s| s.plan.has_concurrency());
        let mut in_flight: Vec<(usize, MutexGuard<'_, Counts>)> = if concurrency {
            order
                .iter()
                .map(|&i| (i, lock(&self.in_flight.shards[i])))
                .collect()
        } else {
            Vec::new()
        };
        let guard = |v: &mut Vec<(usize, MutexGuard<'_, Shard>)>, shard: usize| {
            v.iter().position(|(i, _)| *i == shard).unwrap_or(0)
        };
        let verdicts: Vec<Verdict> = shares
            .iter()
            .zip(&hashes)
            .map(|(share, (hash, shard))| {
                let counts = in_flight
                    .iter()
                    .find(|(i, _)| i == shard)
                    .and_then(|(_, map)| map.get(share.ns))
                    .and_then(|keys| keys.get(share.key));
                let held = held_states(share.plan, counts);
                let k = guard(&mut entries, *shard);
                let entries = &entries[k].1;
                match entries.find(hash) {
                    Some(i) => entries.judge(i, share.plan, now, &held),
                    None => judge(share.plan, now, |i| held.get(i).unwrap_or(&EMPTY)),
                }
            })
            .collect();
        let verdict = Verdict::of_share_verdicts(n, trial, shares, &verdicts);
        if !verdict.allowed {
            return Checked {
                verdict,
                permit: Permit::None,
            };
        }
        let mut evicted = Vec::new();
        let mut permits = Vec::new();
        for ((share, (hash, shard)), v) in shares.iter().zip(&hashes).zip(&verdicts) {
            let k = guard(&mut entries, *shard);
            let entries = &mut entries[k].1;
            let stateful = share
                .plan
                .limits
                .iter()
                .any(LimitDef::stateful_at_admission);
            match entries.find(hash) {
                Some(i) => {
                    entries.touch(i);
                    entries.charge(i, share.plan, now);
                }
                None if stateful => {
                    let ns = entries.route_number(share.ns);
                    let (i, lost) = entries.insert(*hash, ns, now);
                    entries.charge(i, share.plan, now);
                    evicted.extend(lost);
                }
                None => {}
            }
            if share.plan.has_concurrency() {
                if let Some((_, map)) = in_flight.iter_mut().find(|(i, _)| i == shard) {
                    let slots = self.take(map, *shard, share.ns, share.key, share.plan, v);
                    permits.push(Permit::Memory(slots));
                }
            }
        }
        drop(in_flight);
        drop(entries);
        for ns in evicted {
            self.evicted_live(&ns, now);
        }
        Checked {
            verdict,
            permit: match permits.len() {
                0 => Permit::None,
                _ => Permit::Many(permits),
            },
        }
    }

    /// Charges what a response said a request of `key` on `route` cost: each limit of
    /// `plan` (limits charged from the response, with the units to charge as their
    /// `cost`), whatever is left.
    pub fn charge_response(&self, route: &str, key: &str, plan: &Plan) {
        let hash = self.hash(route, key);
        let mut entries = lock(&self.shards[self.shard_index(&hash)]);
        let now = self.clock.now_us();
        let i = match entries.find(&hash) {
            Some(i) => {
                entries.touch(i);
                i
            }
            None => {
                let ns = entries.route_number(route);
                let (i, evicted) = entries.insert(hash, ns, now);
                if let Some(ns) = evicted {
                    self.evicted_live(&ns, now);
                }
                i
            }
        };
        entries.charge_as(i, plan, now, true);
    }

    /// Takes one slot of every concurrency limit of `plan` that admitted (all of them
    /// but those on trial that refused).
    fn take(
        &self,
        map: &mut Counts,
        shard: usize,
        route: &str,
        key: &str,
        plan: &Plan,
        verdict: &Verdict,
    ) -> Slots {
        let counts = map
            .entry(route.into())
            .or_default()
            .entry(key.into())
            .or_default();
        let mut taken = Vec::with_capacity(1);
        let admitted = |i: usize| verdict.outcomes.get(i).is_none_or(|o| o.allowed);
        let taking = plan.limits.iter().enumerate();
        for (_, l) in taking.filter(|(i, l)| l.algorithm.is_concurrency() && admitted(*i)) {
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
        let hash = self.hash(route, key);
        let map = lock(&self.in_flight.shards[self.shard_index(&hash)]);
        map.get(route)
            .and_then(|keys| keys.get(key))
            .and_then(|c| c.iter().find(|(i, _)| *i == id))
            .map_or(0, |c| c.1)
    }

    /// The pair as a pair (not a concatenation), through one keyed SipHash pass: the
    /// first word is its hash, the second the hash of it followed by one more byte.
    fn hash(&self, route: &str, key: &str) -> Hash {
        let mut h = self.hasher.build_hasher();
        (route, key).hash(&mut h);
        let first = h.finish();
        h.write_u8(0xa5);
        [first, h.finish()]
    }

    fn shard_index(&self, hash: &Hash) -> usize {
        (hash[0] % self.shards.len() as u64) as usize
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
        self.shards.iter().map(|s| lock(s).sweep(now)).sum()
    }

    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
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

/// The in-flight counts of a key as states, by plan index (empty for the other
/// limits).
fn held_states(plan: &Plan, counts: Option<&Vec<(u64, u64)>>) -> Vec<State> {
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

/// A panic while a shard was locked leaves at worst one request half charged; the
/// store keeps serving rather than poisoning every later request.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Where a probe for `hash` starts in an index of `mask + 1` slots.
fn home(hash: &Hash, mask: usize) -> usize {
    hash[1] as usize & mask
}

/// The 8 bits of `hash` an index slot keeps above the entry number (bits the home
/// position never uses).
fn tag(hash: &Hash) -> u32 {
    ((hash[1] >> 32) as u32) & !NUMBER
}

/// Index slots for `n` entries: at most 3/4 full, a power of two.
fn index_size(n: usize) -> usize {
    (n * 4 / 3 + 1).next_power_of_two().max(MIN_INDEX)
}

/// The inline form of `state` for a definition of `algorithm`: None for what is kept
/// only in full (sliding_log's log, no state, a state of other parameters).
fn encode(algorithm: &Algorithm, state: &State) -> Option<[u64; 3]> {
    match (*algorithm, state) {
        (
            Algorithm::FixedWindow { .. } | Algorithm::CalendarMonth { .. },
            &State::Window { idx, count },
        ) => Some([idx, count, 0]),
        (Algorithm::SlidingWindow { .. }, &State::Sliding { idx, prev, curr }) => {
            Some([idx, prev, curr])
        }
        (
            Algorithm::TokenBucket { rate, burst },
            &State::Bucket {
                tokens,
                ts,
                rate: r,
                burst: b,
            },
        ) if (r, b) == (rate, burst) => Some([tokens as u64, ts, 0]),
        (
            Algorithm::Gcra { rate, burst },
            &State::Gcra {
                tat,
                ts,
                rate: r,
                burst: b,
            },
        ) if (r, b) == (rate, burst) => Some([tat, ts, 0]),
        _ => None,
    }
}

/// The state `encode` made `w` from.
fn decode(algorithm: &Algorithm, w: &[u64; 3]) -> State {
    match *algorithm {
        Algorithm::FixedWindow { .. } | Algorithm::CalendarMonth { .. } => State::Window {
            idx: w[0],
            count: w[1],
        },
        Algorithm::SlidingWindow { .. } => State::Sliding {
            idx: w[0],
            prev: w[1],
            curr: w[2],
        },
        Algorithm::TokenBucket { rate, burst } => State::Bucket {
            tokens: w[0] as i64,
            ts: w[1],
            rate,
            burst,
        },
        Algorithm::Gcra { rate, burst } => State::Gcra {
            tat: w[0],
            ts: w[1],
            rate,
            burst,
        },
        Algorithm::SlidingLog { .. } | Algorithm::Concurrency { .. } => State::Empty,
    }
}

/// Whether a charge writes `limit`'s state in the entry: requests in flight are
/// counted beside it (`InFlight`); a limit charged from the response only by the
/// response's charge, which charges nothing else.
fn charged_now(limit: &LimitDef, from_response: bool) -> bool {
    !limit.algorithm.is_concurrency() && limit.at_admission() != from_response
}

fn charge_one(limit: &LimitDef, state: &mut State, plan: &Plan, now: u64, from_response: bool) {
    if from_response && limit.charge == Charge::GiveBack {
        // What a response charged less than its estimate (token_bucket and gcra:
        // `check` allows an estimate on those only, whose refund needs no time).
        limit.algorithm.refund(state, now, limit.cost);
    } else if from_response {
        limit.algorithm.charge_anyway(state, now, limit.cost);
    } else {
        limit
            .algorithm
            .charge(state, now, limit.cost, plan.max_delay_us());
    }
}

/// Charges the request to every limit of `plan` (after all of them admitted), or what
/// a response said (`from_response`); returns the max of the states' expiry.
fn charge_slots(slots: &mut Vec<Slot>, plan: &Plan, now: u64, from_response: bool) -> u64 {
    for limit in plan.limits.iter().filter(|l| charged_now(l, from_response)) {
        let i = match slots.iter().position(|s| s.id == limit.id) {
            Some(i) => i,
            None => {
                slots.push(Slot {
                    id: limit.id,
                    state: State::Empty,
                    expires_at_us: 0,
                });
                slots.len() - 1
            }
        };
        let slot = &mut slots[i];
        charge_one(limit, &mut slot.state, plan, now, from_response);
        slot.expires_at_us = limit.algorithm.expires_at_us(&slot.state);
    }
    // States of limits a reload removed, or gave another algorithm or window (a new
    // id), are not read now; drop them once they have expired.
    if slots.len() > plan.limits.len() {
        slots.retain(|s| s.expires_at_us > now || plan.limits.iter().any(|l| l.id == s.id));
    }
    slots.iter().map(|s| s.expires_at_us).max().unwrap_or(0)
}

// === impl Shard ===

impl Shard {
    fn new(cap: usize) -> Shard {
        Shard {
            index: vec![FREE; MIN_INDEX].into_boxed_slice(),
            chunks: Vec::new(),
            len: 0,
            cap,
            routes: Vec::new(),
            route_numbers: HashMap::new(),
            defs: Vec::new(),
            def_numbers: HashMap::new(),
            spilled: Vec::new(),
            unspilled: Vec::new(),
        }
    }

    fn entry(&self, i: u32) -> &Entry {
        let i = i as usize;
        &self.chunks[i / CHUNK][i % CHUNK]
    }

    fn entry_mut(&mut self, i: u32) -> &mut Entry {
        let i = i as usize;
        &mut self.chunks[i / CHUNK][i % CHUNK]
    }

    /// The number of the entry with `hash`, if there is one.
    fn find(&self, hash: &Hash) -> Option<u32> {
        let mask = self.index.len() - 1;
        let tag = tag(hash);
        let mut pos = home(hash, mask);
        // The index is never full: every probe ends at a free slot.
        loop {
            let slot = self.index[pos];
            if slot == FREE {
                return None;
            }
            if slot & !NUMBER == tag && self.entry(slot & NUMBER).hash == *hash {
                return Some(slot & NUMBER);
            }
            pos = (pos + 1) & mask;
        }
    }

    /// The index position of entry `i`, whose hash is `hash`.
    fn position(&self, hash: &Hash, i: u32) -> usize {
        let mask = self.index.len() - 1;
        let mut pos = home(hash, mask);
        while self.index[pos] & NUMBER != i {
            debug_assert_ne!(self.index[pos], FREE, "entry {i} is not indexed");
            pos = (pos + 1) & mask;
        }
        pos
    }

    /// Indexes entry `i`.
    fn place(&mut self, hash: &Hash, i: u32) {
        let mask = self.index.len() - 1;
        let mut pos = home(hash, mask);
        while self.index[pos] != FREE {
            pos = (pos + 1) & mask;
        }
        self.index[pos] = tag(hash) | i;
    }

    /// Frees index position `hole`, moving later slots of its probe run back where
    /// their probe passes it, so that every entry stays reachable (no tombstones).
    fn vacate(&mut self, mut hole: usize) {
        let mask = self.index.len() - 1;
        let mut pos = hole;
        loop {
            pos = (pos + 1) & mask;
            let slot = self.index[pos];
            if slot == FREE {
                break;
            }
            // The hole is on the slot's probe (from its home to `pos`) iff it is at
            // least as far back from `pos` as the home is.
            let home = home(&self.entry(slot & NUMBER).hash, mask);
            if pos.wrapping_sub(home) & mask >= pos.wrapping_sub(hole) & mask {
                self.index[hole] = slot;
                hole = pos;
            }
        }
        self.index[hole] = FREE;
    }

    /// Builds the index anew with `size` slots.
    fn reindex(&mut self, size: usize) {
        self.index = vec![FREE; size].into_boxed_slice();
        for i in 0..self.len as u32 {
            let hash = self.entry(i).hash;
            self.place(&hash, i);
        }
    }

    /// The number of namespace `route`, given one when first seen.
    fn route_number(&mut self, route: &str) -> u32 {
        if let Some(&n) = self.route_numbers.get(route) {
            return n;
        }
        let name: Arc<str> = route.into();
        let n = self.routes.len() as u32;
        self.routes.push(RouteList {
            name: name.clone(),
            head: NIL,
            tail: NIL,
            len: 0,
        });
        self.route_numbers.insert(name, n);
        n
    }

    /// Makes entry `i` (unlinked) the most recently used of its route.
    fn push_front(&mut self, i: u32) {
        let ns = self.entry(i).ns as usize;
        let head = self.routes[ns].head;
        let e = self.entry_mut(i);
        e.prev = NIL;
        e.next = head;
        if head == NIL {
            self.routes[ns].tail = i;
        } else {
            self.entry_mut(head).prev = i;
        }
        self.routes[ns].head = i;
    }

    /// Takes entry `i` out of its route's list.
    fn unlink(&mut self, i: u32) {
        let e = self.entry(i);
        let (prev, next, ns) = (e.prev, e.next, e.ns as usize);
        if prev == NIL {
            self.routes[ns].head = next;
        } else {
            self.entry_mut(prev).next = next;
        }
        if next == NIL {
            self.routes[ns].tail = prev;
        } else {
            self.entry_mut(next).prev = prev;
        }
    }

    /// Makes entry `i` the most recently used of its route.
    fn touch(&mut self, i: u32) {
        if self.routes[self.entry(i).ns as usize].head != i {
            self.unlink(i);
            self.push_front(i);
        }
    }

    /// Adds an entry without state for `hash` in namespace `ns`, making room first
    /// when the shard is full. Returns its number, and the namespace of the live entry
    /// evicted for it, if one was.
    fn insert(&mut self, hash: Hash, ns: u32, now: u64) -> (u32, Option<Arc<str>>) {
        let mut evicted = None;
        if self.len >= self.cap && self.evict_expired(now) == 0 {
            evicted = self.evict_live(ns, now);
        }
        if (self.len + 1) * 4 > self.index.len() * 3 {
            self.reindex(self.index.len() * 2);
        }
        let i = self.len as u32;
        let chunk = self.len / CHUNK;
        if chunk == self.chunks.len() {
            self.chunks.push(Vec::with_capacity(CHUNK));
        }
        self.chunks[chunk].push(Entry {
            hash,
            prev: NIL,
            next: NIL,
            ns,
            def: NO_STATE,
            expires_at_us: 0,
            w: [0; 3],
        });
        self.len += 1;
        self.place(&hash, i);
        self.push_front(i);
        self.routes[ns as usize].len += 1;
        (i, evicted)
    }

    /// Removes entry `i`; the last entry takes its number.
    fn remove(&mut self, i: u32) {
        self.unlink(i);
        let e = self.entry(i);
        let (hash, ns, def, place) = (e.hash, e.ns as usize, e.def, e.w[0]);
        self.routes[ns].len -= 1;
        let pos = self.position(&hash, i);
        self.vacate(pos);
        if def == SPILLED {
            self.unspill(place);
        }
        let last = (self.len - 1) as u32;
        let moved = self.chunks[last as usize / CHUNK]
            .pop()
            .expect("the last entry is in the last chunk");
        self.len -= 1;
        // At most one empty chunk is kept past the entries.
        self.chunks.truncate(self.len.div_ceil(CHUNK) + 1);
        if i == last {
            return;
        }
        let ns = moved.ns as usize;
        if moved.prev == NIL {
            self.routes[ns].head = i;
        } else {
            self.entry_mut(moved.prev).next = i;
        }
        if moved.next == NIL {
            self.routes[ns].tail = i;
        } else {
            self.entry_mut(moved.next).prev = i;
        }
        let pos = self.position(&moved.hash, last);
        self.index[pos] = tag(&moved.hash) | i;
        *self.entry_mut(i) = moved;
    }

    /// Removes the expired entries among the `EXPIRED_SCAN` least recently used of
    /// every route; returns how many.
    fn evict_expired(&mut self, now: u64) -> usize {
        let mut removed = 0;
        for ns in 0..self.routes.len() {
            let mut expired = [[0; 2]; EXPIRED_SCAN];
            let mut n = 0;
            let mut i = self.routes[ns].tail;
            for _ in 0..EXPIRED_SCAN {
                if i == NIL {
                    break;
                }
                let e = self.entry(i);
                if e.expires_at_us <= now {
                    expired[n] = e.hash;
                    n += 1;
                }
                i = e.prev;
            }
            // By hash: a removal renumbers the last entry.
            for hash in &expired[..n] {
                if let Some(i) = self.find(hash) {
                    self.remove(i);
                }
            }
            removed += n;
        }
        removed
    }

    /// Evicts the least recently used entry of the route with the most entries here
    /// (`inserting` on a tie); returns its namespace if the entry was live.
    fn evict_live(&mut self, inserting: u32, now: u64) -> Option<Arc<str>> {
        let (_, route) = self
            .routes
            .iter()
            .enumerate()
            .max_by_key(|(ns, r)| (r.len, *ns == inserting as usize))?;
        let i = route.tail;
        if i == NIL {
            return None;
        }
        let evicted = (self.entry(i).expires_at_us > now).then(|| route.name.clone());
        self.remove(i);
        evicted
    }

    /// Removes every entry expired at `now`, then gives back what the index and the
    /// definitions no longer need; returns how many entries were removed.
    fn sweep(&mut self, now: u64) -> usize {
        let before = self.len;
        let mut i = 0;
        while (i as usize) < self.len {
            if self.entry(i).expires_at_us <= now {
                // The last entry is now number i: look at it next.
                self.remove(i);
            } else {
                i += 1;
            }
        }
        let size = index_size(self.len);
        if size * 4 <= self.index.len() {
            self.reindex(size);
        }
        self.compact_defs();
        before - self.len
    }

    /// Drops the definitions no entry uses any more, once they are many (a long run of
    /// reloads that changed limits), renumbering the rest.
    fn compact_defs(&mut self) {
        if self.defs.len() <= DEFS_COMPACT {
            return;
        }
        let mut used = vec![false; self.defs.len()];
        for i in 0..self.len as u32 {
            if let Some(u) = used.get_mut(self.entry(i).def as usize) {
                *u = true;
            }
        }
        if used.iter().filter(|u| **u).count() * 2 > used.len() {
            return;
        }
        let mut kept = 0;
        let renumber: Vec<u32> = used
            .iter()
            .map(|&u| {
                kept += u32::from(u);
                if u {
                    kept - 1
                } else {
                    NO_STATE
                }
            })
            .collect();
        for i in 0..self.len as u32 {
            let e = self.entry_mut(i);
            if let Some(&n) = renumber.get(e.def as usize) {
                e.def = n;
            }
        }
        let mut n = 0;
        self.defs.retain(|_| {
            n += 1;
            used[n - 1]
        });
        self.def_numbers = self
            .defs
            .iter()
            .enumerate()
            .map(|(n, def)| (def.version, n as u32))
            .collect();
    }

    /// The number of `limit`'s definition (made when first seen); `hint`, the
    /// entry's current one, is tried first.
    fn def_number(&mut self, limit: &LimitDef, hint: u32) -> u32 {
        if self
            .defs
            .get(hint as usize)
            .is_some_and(|d| d.version == limit.version)
        {
            return hint;
        }
        if let Some(&n) = self.def_numbers.get(&limit.version) {
            return n;
        }
        let n = self.defs.len() as u32;
        self.defs.push(Def {
            id: limit.id,
            version: limit.version,
            algorithm: limit.algorithm,
        });
        self.def_numbers.insert(limit.version, n);
        n
    }

    /// Decides a request against entry `i`'s states and `held`, the requests in
    /// flight by plan index; charges every limit if all admit.
    /// The verdict of entry `i` over `plan`, charging nothing.
    fn judge(&self, i: u32, plan: &Plan, now: u64, held: &[State]) -> Verdict {
        let e = self.entry(i);
        let concurrency = |k: usize| plan.limits[k].algorithm.is_concurrency();
        if e.def == SPILLED {
            let slots = &self.spilled[e.w[0] as usize];
            return judge(plan, now, |k| {
                let id = plan.limits[k].id;
                if concurrency(k) {
                    &held[k]
                } else {
                    slots
                        .iter()
                        .find(|s| s.id == id)
                        .map_or(&EMPTY, |s| &s.state)
                }
            });
        }
        let (id, state) = match self.defs.get(e.def as usize) {
            Some(def) => (Some(def.id), decode(&def.algorithm, &e.w)),
            None => (None, State::Empty),
        };
        judge(plan, now, |k| {
            if concurrency(k) {
                &held[k]
            } else if id == Some(plan.limits[k].id) {
                &state
            } else {
                &EMPTY
            }
        })
    }

    fn decide(&mut self, i: u32, plan: &Plan, now: u64, held: &[State]) -> Verdict {
        let e = self.entry(i);
        // One limit, the entry's: deciding is charging (a refused request changes
        // nothing), in one evaluation.
        if let ([limit], false) = (&plan.limits[..], e.def == SPILLED) {
            let def = self.defs.get(e.def as usize);
            if limit.stateful_at_admission() && def.is_none_or(|d| d.id == limit.id) {
                let mut state = def.map_or(State::Empty, |d| decode(&d.algorithm, &e.w));
                let outcome =
                    limit
                        .algorithm
                        .charge(&mut state, now, limit.cost, plan.max_delay_us());
                if outcome.allowed {
                    self.store_one(i, limit, state);
                }
                return Verdict::on_trial(outcome, plan.on_trial());
            }
        }
        let verdict = self.judge(i, plan, now, held);
        if verdict.allowed {
            self.charge(i, plan, now);
        }
        verdict
    }

    /// Charges entry `i` for an admitted request (`Charge::Admission` limits), or, with
    /// `from_response`, what a response said (every limit of `plan`, whatever is
    /// left: `Algorithm::charge_anyway`).
    fn charge(&mut self, i: u32, plan: &Plan, now: u64) {
        self.charge_as(i, plan, now, false)
    }

    fn charge_as(&mut self, i: u32, plan: &Plan, now: u64, from_response: bool) {
        let mut limits = plan.limits.iter().filter(|l| charged_now(l, from_response));
        if let (Some(limit), None) = (limits.next(), limits.next()) {
            let e = self.entry(i);
            let state = match e.def {
                NO_STATE => Some(State::Empty),
                SPILLED => None,
                d => {
                    let def = &self.defs[d as usize];
                    (def.id == limit.id).then(|| decode(&def.algorithm, &e.w))
                }
            };
            if let Some(mut state) = state {
                charge_one(limit, &mut state, plan, now, from_response);
                self.store_one(i, limit, state);
                return;
            }
        }
        let mut slots = self.take_slots(i);
        let expires_at_us = charge_slots(&mut slots, plan, now, from_response);
        if let [slot] = &slots[..] {
            if let Some(limit) = plan.limits.iter().find(|l| l.id == slot.id) {
                let def = self.def_number(limit, self.entry(i).def);
                if let Some(w) = encode(&self.defs[def as usize].algorithm, &slot.state) {
                    self.set_inline(i, def, w, expires_at_us);
                    return;
                }
            }
        }
        self.set_spilled(i, slots, expires_at_us);
    }

    /// Stores `state`, just charged to `limit`, as entry `i`'s only state.
    fn store_one(&mut self, i: u32, limit: &LimitDef, state: State) {
        let expires_at_us = limit.algorithm.expires_at_us(&state);
        let def = self.def_number(limit, self.entry(i).def);
        match encode(&self.defs[def as usize].algorithm, &state) {
            Some(w) => self.set_inline(i, def, w, expires_at_us),
            None => {
                let slot = Slot {
                    id: limit.id,
                    state,
                    expires_at_us,
                };
                self.set_spilled(i, vec![slot], expires_at_us);
            }
        }
    }

    /// Entry `i`'s states as a list, leaving it with an empty one while they are out.
    fn take_slots(&mut self, i: u32) -> Vec<Slot> {
        let e = self.entry(i);
        match e.def {
            NO_STATE => Vec::new(),
            SPILLED => {
                let place = e.w[0] as usize;
                std::mem::take(&mut self.spilled[place])
            }
            d => {
                let def = &self.defs[d as usize];
                vec![Slot {
                    id: def.id,
                    state: decode(&def.algorithm, &e.w),
                    expires_at_us: e.expires_at_us,
                }]
            }
        }
    }

    fn set_inline(&mut self, i: u32, def: u32, w: [u64; 3], expires_at_us: u64) {
        let e = self.entry_mut(i);
        let spilled = (e.def == SPILLED).then_some(e.w[0]);
        e.def = def;
        e.w = w;
        e.expires_at_us = expires_at_us;
        if let Some(place) = spilled {
            self.unspill(place);
        }
    }

    fn set_spilled(&mut self, i: u32, slots: Vec<Slot>, expires_at_us: u64) {
        let e = self.entry(i);
        let place = if e.def == SPILLED {
            let place = e.w[0];
            self.spilled[place as usize] = slots;
            place
        } else {
            match self.unspilled.pop() {
                Some(place) => {
                    self.spilled[place as usize] = slots;
                    u64::from(place)
                }
                None => {
                    self.spilled.push(slots);
                    self.spilled.len() as u64 - 1
                }
            }
        };
        let e = self.entry_mut(i);
        e.def = SPILLED;
        e.w = [place, 0, 0];
        e.expires_at_us = expires_at_us;
    }

    /// Frees the place of a spilled entry's states.
    fn unspill(&mut self, place: u64) {
        self.spilled[place as usize] = Vec::new();
        self.unspilled.push(place as u32);
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

    impl Shard {
        /// Every entry indexed once and found, in its route's list, linked both ways;
        /// the counts add up; spilled places are each used once or free.
        fn check_invariants(&self) {
            assert_eq!(self.index.iter().filter(|s| **s != FREE).count(), self.len);
            assert!(self.len * 4 <= self.index.len() * 3);
            assert!(self.len <= self.cap);
            assert!(self.chunks.len() <= self.len.div_ceil(CHUNK) + 1);
            for i in 0..self.len as u32 {
                assert_eq!(self.find(&self.entry(i).hash), Some(i));
            }
            let mut listed = 0;
            for (ns, route) in self.routes.iter().enumerate() {
                let (mut n, mut prev, mut i) = (0, NIL, route.head);
                while i != NIL {
                    let e = self.entry(i);
                    assert_eq!((e.ns as usize, e.prev), (ns, prev));
                    (prev, i) = (i, e.next);
                    n += 1;
                    assert!(n <= self.len);
                }
                assert_eq!((route.tail, route.len), (prev, n));
                listed += n;
            }
            assert_eq!(listed, self.len);
            let mut places: Vec<u64> = (0..self.len as u32)
                .map(|i| self.entry(i))
                .filter(|e| e.def == SPILLED)
                .map(|e| e.w[0])
                .chain(self.unspilled.iter().map(|&p| u64::from(p)))
                .collect();
            places.sort_unstable();
            assert_eq!(places, (0..self.spilled.len() as u64).collect::<Vec<_>>());
        }
    }

    /// The limit ids entry (`route`, `key`) holds state for, if it exists.
    fn slots(store: &MemoryStore, route: &str, key: &str) -> Option<Vec<u64>> {
        let hash = store.hash(route, key);
        let shard = lock(&store.shards[store.shard_index(&hash)]);
        shard.check_invariants();
        let i = shard.find(&hash)?;
        let e = shard.entry(i);
        Some(match e.def {
            SPILLED => shard.spilled[e.w[0] as usize]
                .iter()
                .map(|s| s.id)
                .collect(),
            NO_STATE => Vec::new(),
            d => vec![shard.defs[d as usize].id],
        })
    }

    #[test]
    fn capacity_is_exactly_max_keys() {
        for max_keys in [0, 1, 5, 31, 32, 33, 1000, 1_000_000] {
            let (_, store) = store(max_keys);
            let total: usize = store.shards.iter().map(|s| lock(s).cap).sum();
            assert_eq!(total, max_keys.max(1), "{max_keys}");
            assert!(store.shards.len() <= SHARDS);
        }
        // Beyond what 32 shards can number: more shards, as many entries.
        let (_, big) = store(64 * MAX_SHARD + 1);
        assert_eq!(big.shards.len(), 65);
        let total: usize = big.shards.iter().map(|s| lock(s).cap).sum();
        assert_eq!(total, 64 * MAX_SHARD + 1);
        // An absurd max_keys makes a bounded number of shards.
        let (_, absurd) = store(usize::MAX);
        assert_eq!(absurd.shards.len(), MAX_SHARDS);
        assert!(absurd.shards.iter().all(|s| lock(s).cap == MAX_SHARD));
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
    fn counted(store: MemoryStore) -> (MemoryStore, crate::telemetry::metrics::Metrics) {
        let m = crate::telemetry::metrics::Metrics::new();
        m.store_namespaces("api", &["api", "api/ip"]);
        m.store_namespaces("login", &["login", "login/ip"]);
        m.store_namespaces("a", &["a"]);
        m.store_namespaces("b", &["b"]);
        (store.with_evictions(m.eviction_counters.clone()), m)
    }

    fn evictions(m: &crate::telemetry::metrics::Metrics, route: &str) -> u64 {
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

    /// A model of the store for one fixed_window limit on two routes (no ties between
    /// routes that are not inserting): per shard, entries with their last use, evicted
    /// as documented. Every request's remaining count, and the number of entries, must
    /// match it through thousands of insertions, evictions and sweeps, with the
    /// store's tables checked after each step.
    #[test]
    fn eviction_and_sweep_match_a_model_of_the_documented_order() {
        use std::collections::HashMap;
        const LIMIT: u64 = 100_000;
        const W: u64 = 20_000;
        let (clock, store) = store(150);
        let n = store.shards.len();
        assert_eq!(n, 2);
        let p = plan(vec![fixed("w", LIMIT, W)]);
        // (shard, route, key) -> (last use, window idx, count)
        let mut model: HashMap<(usize, &'static str, u64), (u64, u64, u64)> = HashMap::new();
        let cap = |s: usize| lock(&store.shards[s]).cap;
        let mut rng = crate::limit::cases::Rng(7);
        for tick in 0..20_000u64 {
            // About 800 requests a window.
            clock.advance(rng.below(50));
            let now = clock.now_us();
            if rng.below(500) == 0 {
                model.retain(|_, &mut (_, idx, _)| (idx + 1) * W > now);
                store.sweep();
            }
            let route = if rng.below(3) == 0 { "b" } else { "a" };
            // Half of them of 30 hot keys, which build up counts.
            let key = if rng.below(2) == 0 {
                rng.below(30)
            } else {
                30 + rng.below(400)
            };
            let shard = store.shard_index(&store.hash(route, &key.to_string()));
            let expected = match model.get_mut(&(shard, route, key)) {
                Some((used, idx, count)) => {
                    *used = tick;
                    if *idx != now / W {
                        (*idx, *count) = (now / W, 0);
                    }
                    *count += 1;
                    LIMIT - *count
                }
                None => {
                    let here = |m: &HashMap<(usize, &'static str, u64), (u64, u64, u64)>,
                                r: &str| {
                        let mut v: Vec<_> = m
                            .iter()
                            .filter(|(k, _)| k.0 == shard && k.1 == r)
                            .map(|(k, v)| (v.0, *k, (v.1 + 1) * W))
                            .collect();
                        v.sort_unstable();
                        v
                    };
                    let held = model.keys().filter(|k| k.0 == shard).count();
                    if held >= cap(shard) {
                        let mut removed = 0;
                        for r in ["a", "b"] {
                            for (_, k, expires) in here(&model, r).into_iter().take(EXPIRED_SCAN) {
                                if expires <= now {
                                    model.remove(&k);
                                    removed += 1;
                                }
                            }
                        }
                        if removed == 0 {
                            let other = if route == "a" { "b" } else { "a" };
                            let (mine, theirs) = (here(&model, route), here(&model, other));
                            let from = if theirs.len() > mine.len() {
                                theirs
                            } else {
                                mine
                            };
                            model.remove(&from[0].1);
                        }
                    }
                    model.insert((shard, route, key), (tick, now / W, 1));
                    LIMIT - 1
                }
            };
            let v = store.check(route, &key.to_string(), &p);
            assert_eq!(remaining(&v), [expected], "step {tick}: {route} {key}");
            assert_eq!(store.len(), model.len(), "step {tick}");
            if tick % 97 == 0 {
                for s in store.shards.iter() {
                    lock(s).check_invariants();
                }
            }
        }
        assert_eq!(store.len(), model.len());
        for s in store.shards.iter() {
            lock(s).check_invariants();
        }
    }

    /// A route's single limit is kept inline; a reload that gives it a new id keeps the
    /// old state aside beside the new one until the old expires, and the entry is
    /// inline again after that. sliding_log's state is always aside, and its place is
    /// reused once its entry is gone.
    #[test]
    fn state_moves_between_inline_and_aside_as_plans_change() {
        let (clock, store) = store(100);
        let inline = |route: &str, key: &str| {
            let hash = store.hash(route, key);
            let shard = lock(&store.shards[store.shard_index(&hash)]);
            shard.check_invariants();
            shard.find(&hash).map(|i| shard.entry(i).def != SPILLED)
        };
        let hour = plan(vec![fixed("w", 10, 3_600 * S)]);
        let minute = plan(vec![fixed("w", 10, 60 * S)]);
        assert_eq!(remaining(&store.check("r", "k", &hour)), [9]);
        assert_eq!(inline("r", "k"), Some(true));
        // A new window: a new id, the old state kept to the end of its hour.
        assert_eq!(remaining(&store.check("r", "k", &minute)), [9]);
        assert_eq!(inline("r", "k"), Some(false));
        assert_eq!(
            slots(&store, "r", "k"),
            Some(vec![hour.limits[0].id, minute.limits[0].id])
        );
        clock.set(BASE_US + 3_600 * S);
        assert_eq!(remaining(&store.check("r", "k", &minute)), [9]);
        assert_eq!(inline("r", "k"), Some(true));
        assert_eq!(slots(&store, "r", "k"), Some(vec![minute.limits[0].id]));
        // And back to the hour: the minute's state is still live.
        assert_eq!(remaining(&store.check("r", "k", &hour)), [9]);
        assert_eq!(inline("r", "k"), Some(false));

        let log = plan(vec![LimitDef::new(
            "l".into(),
            Algorithm::SlidingLog {
                limit: 3,
                window_us: S,
            },
            1,
        )]);
        for (key, left) in [("a", 2), ("a", 1), ("b", 2)] {
            assert_eq!(remaining(&store.check("log", key, &log)), [left]);
        }
        assert_eq!(inline("log", "a"), Some(false));
        clock.advance(S);
        assert_eq!(store.sweep(), 2);
        assert_eq!(remaining(&store.check("log", "c", &log)), [2]);
        assert_eq!(slots(&store, "log", "c"), Some(vec![log.limits[0].id]));
    }

    /// Limits whose numbers change on every reload leave definitions behind; a sweep
    /// drops those no entry uses once there are many, and the live state is intact.
    #[test]
    fn definitions_no_entry_uses_are_dropped_by_a_sweep() {
        let gcra = |count| {
            plan(vec![LimitDef::new(
                "g".into(),
                Algorithm::Gcra {
                    rate: Rate { count, per_us: S },
                    burst: 10,
                },
                1,
            )])
        };
        // The same requests of k1 on a store that keeps nothing else.
        let (alone_clock, alone) = store(10);
        let (clock, store) = store(127);
        assert_eq!(store.shards.len(), 1);
        for count in 1..=100 {
            assert_eq!(
                remaining(&store.check("r", &format!("k{count}"), &gcra(count))),
                [9]
            );
        }
        alone.check("r", "k1", &gcra(1));
        assert_eq!(lock(&store.shards[0]).defs.len(), 100);
        // Full again after 1/count s: all but k1 .. k4 are gone at 0.2 s.
        clock.advance(S / 5);
        alone_clock.advance(S / 5);
        assert_eq!(store.sweep(), 96);
        let shard = lock(&store.shards[0]);
        shard.check_invariants();
        assert_eq!(shard.defs.len(), 4);
        drop(shard);
        for p in [gcra(1), gcra(2), gcra(1)] {
            assert_eq!(store.check("r", "k1", &p), alone.check("r", "k1", &p));
        }
    }
}
