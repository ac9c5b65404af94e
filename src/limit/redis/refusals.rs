//! The refusal cache: keys Redis refused are answered locally until their retry
//! time, without asking again.

use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use lru::LruCache;

use crate::limit::{LimitDef, Plan, Verdict};

/// Refusals remembered at most (least recently used ones are dropped).
pub const REFUSAL_CACHE_ENTRIES: usize = 65_536;
/// Longest a refusal is answered locally, however far its retry time: a key reset by
/// hand in Redis (or lost with its data) is seen again within this long.
const REFUSAL_HOLD_MAX: Duration = Duration::from_secs(60);
const REFUSAL_SHARDS: usize = 16;

/// How long a refusal holds whatever other instances do: the longest retry of the
/// refusing limits that only ever use capacity up (not concurrency, whose slots can
/// free at any moment). 0 when only concurrency refused.
fn refused_until_us(plan: &Plan, v: &Verdict) -> u64 {
    v.enforced()
        .filter(|(i, o)| !o.allowed && !plan.limits[*i].algorithm.is_concurrency())
        .map(|(_, o)| o.retry_after_us)
        .max()
        .unwrap_or(0)
}

/// Identifies a plan's limits (by their versions, which change with any parameter or
/// cost, while their ids, and so their state, may stay) and mode, so a reload that
/// changes them never reuses a cached refusal.
pub(super) fn fingerprint(plan: &Plan) -> u64 {
    let mut h = plan.max_delay_us() ^ 0xcbf2_9ce4_8422_2325;
    for l in &plan.limits {
        h = (h ^ l.version)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    h ^ plan.limits.len() as u64
}

// === the refusal cache ===

/// Remembers refusals until their retry time (at most `REFUSAL_HOLD_MAX`). Exact:
/// other instances can only use capacity, never add it, so a key Redis refused until T
/// stays refused until T. (Deleting keys by hand, or losing Redis' data, is the
/// exception: then a cached refusal outlasts its cause, by `REFUSAL_HOLD_MAX` at most.)
pub(super) struct RefusalCache {
    shards: Box<[Mutex<LruCache<CacheKey, Refusal>>]>,
    hasher: RandomState,
    /// Refusals held, over all shards: while there are none (a limiter that refuses
    /// nothing), a lookup takes no lock.
    held: AtomicUsize,
}

/// (the request's key tag, the plan's fingerprint).
type CacheKey = (String, u64);

struct Refusal {
    at: Instant,
    until: Instant,
    verdict: Verdict,
}

impl RefusalCache {
    pub(super) fn new(capacity: usize) -> Option<RefusalCache> {
        if capacity == 0 {
            return None;
        }
        let per_shard =
            NonZeroUsize::new(capacity.div_ceil(REFUSAL_SHARDS)).unwrap_or(NonZeroUsize::MIN);
        let shards = (0..REFUSAL_SHARDS)
            .map(|_| Mutex::new(LruCache::sparse(per_shard)))
            .collect();
        Some(RefusalCache {
            shards,
            hasher: RandomState::new(),
            held: AtomicUsize::new(0),
        })
    }

    fn shard(&self, key: &CacheKey) -> std::sync::MutexGuard<'_, LruCache<CacheKey, Refusal>> {
        let i = self.hasher.hash_one(key) as usize % self.shards.len();
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The refusal of `key`, if it still holds at `now`, with the times that remain.
    pub(super) fn get(&self, key: &CacheKey, now: Instant) -> Option<Verdict> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut shard = self.shard(key);
        let r = shard.get(key)?;
        if r.until <= now {
            shard.pop(key);
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let elapsed = now.saturating_duration_since(r.at).as_micros() as u64;
        let mut v = r.verdict.clone();
        for o in &mut v.outcomes {
            o.reset_us = o.reset_us.saturating_sub(elapsed);
            if !o.allowed {
                o.retry_after_us = o.retry_after_us.saturating_sub(elapsed).max(1);
            }
        }
        Some(v)
    }

    /// Remembers `verdict`, a refusal of the key `tag` under a plan of fingerprint
    /// `fp`, until its retry time, counted from `sent`, no later than the server's now.
    /// In delay mode a wait of max_delay would be admitted, so only until retry -
    /// max_delay. Only the limits that use capacity up count: a concurrency slot can
    /// free at any moment. (An admission is not remembered, nor a refusal by a plan
    /// with a limit that holds an estimate: any instance may give part of it back
    /// when its response ends, and a request's estimate may be smaller.)
    pub(super) fn remember(
        &self,
        tag: &str,
        fp: u64,
        plan: &Plan,
        verdict: &Verdict,
        sent: Instant,
    ) {
        if verdict.allowed || plan.limits.iter().any(LimitDef::gives_back) {
            return;
        }
        let hold = refused_until_us(plan, verdict).saturating_sub(plan.max_delay_us());
        if hold > 0 {
            let hold = Duration::from_micros(hold).min(REFUSAL_HOLD_MAX);
            self.insert((tag.to_owned(), fp), sent, sent + hold, verdict);
        }
    }

    fn insert(&self, key: CacheKey, at: Instant, until: Instant, verdict: &Verdict) {
        let refusal = Refusal {
            at,
            until,
            verdict: verdict.clone(),
        };
        let mut shard = self.shard(&key);
        let before = shard.len();
        shard.put(key, refusal);
        // Under the shard's lock: `held` is the sum of the shards' lengths.
        if shard.len() > before {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::call::tests::plan;
    use super::super::call::{limit_key, tag};
    use super::*;
    use crate::limit::{Algorithm, LimitDef, Mode, Outcome, Rate};

    #[test]
    fn fingerprint_changes_with_limits_and_mode() {
        let a = fingerprint(&plan(Mode::Reject));
        assert_eq!(a, fingerprint(&plan(Mode::Reject)));
        assert_ne!(a, fingerprint(&plan(Mode::Delay { max_delay_us: 5 })));
        assert_ne!(
            fingerprint(&plan(Mode::Delay { max_delay_us: 5 })),
            fingerprint(&plan(Mode::Delay { max_delay_us: 6 }))
        );
        let mut p = plan(Mode::Reject);
        p.limits.reverse();
        assert_ne!(a, fingerprint(&p));
        p.limits.pop();
        assert_ne!(a, fingerprint(&p));
    }

    /// A reload that changes a limit's numbers keeps its state (same id, same key) but
    /// must not be answered by a refusal cached under the old numbers.
    #[test]
    fn fingerprint_changes_with_every_parameter_and_cost_while_the_key_stays() {
        let base = plan(Mode::Reject);
        let with = |i: usize, algorithm: Algorithm, cost: u64| {
            let mut p = base.clone();
            let name = p.limits[i].name.clone();
            p.limits[i] = LimitDef::new(name, algorithm, cost);
            p
        };
        let rate = |count, per_us| Rate { count, per_us };
        let window = |limit| Algorithm::FixedWindow {
            limit,
            window_us: 1_000_000,
        };
        let gcra = |rate, burst| Algorithm::Gcra { rate, burst };
        let changed = [
            with(0, window(4), 1),
            with(0, window(3), 2),
            with(1, gcra(rate(10, 2_000_000), 5), 1),
            with(1, gcra(rate(11, 1_000_000), 5), 1),
            with(1, gcra(rate(10, 1_000_000), 6), 1),
            with(1, gcra(rate(10, 1_000_000), 5), 3),
        ];
        let tag = tag("sluice:", "r", "k");
        let keys =
            |p: &Plan| -> Vec<String> { p.limits.iter().map(|l| limit_key(&tag, l.id)).collect() };
        let mut seen = vec![fingerprint(&base)];
        for p in &changed {
            assert_eq!(keys(p), keys(&base), "{p:?}");
            let f = fingerprint(p);
            assert!(!seen.contains(&f), "{p:?}");
            seen.push(f);
        }
    }

    #[test]
    fn refusals_are_answered_with_the_time_left_and_then_forgotten() {
        let cache = RefusalCache::new(4).unwrap();
        let refused = Outcome {
            allowed: false,
            retry_after_us: 500_000,
            reset_us: 900_000,
            ..Outcome::default()
        };
        let admitted = Outcome {
            allowed: true,
            reset_us: 100_000,
            ..Outcome::default()
        };
        let v = Verdict {
            allowed: false,
            delay_us: 0,
            outcomes: vec![admitted, refused].into(),
            trial: 0,
        };
        let t0 = Instant::now();
        let key = ("sluice:{r:k}".to_string(), 7);
        cache.insert(key.clone(), t0, t0 + Duration::from_micros(500_000), &v);
        let got = cache
            .get(&key, t0 + Duration::from_micros(200_000))
            .unwrap();
        assert_eq!(
            (got.outcomes[1].retry_after_us, got.outcomes[1].reset_us),
            (300_000, 700_000)
        );
        assert_eq!(
            (got.outcomes[0].retry_after_us, got.outcomes[0].reset_us),
            (0, 0)
        );
        assert!(cache.get(&("sluice:{r:k}".to_string(), 8), t0).is_none());
        assert!(cache
            .get(&key, t0 + Duration::from_micros(500_000))
            .is_none());
        assert!(cache.get(&key, t0).is_none(), "expired entries are dropped");
        assert!(RefusalCache::new(0).is_none());
    }

    /// A concurrency slot can free at any moment: a refusal holds only as long as the
    /// limits that use capacity up say.
    #[test]
    fn only_limits_that_use_capacity_up_hold_a_refusal() {
        let mut p = plan(Mode::Reject);
        p.limits.push(LimitDef::new(
            "c".into(),
            Algorithm::Concurrency {
                limit: 1,
                lease_us: 60_000_000,
            },
            1,
        ));
        let o = |allowed, retry_after_us| Outcome {
            allowed,
            retry_after_us,
            ..Outcome::default()
        };
        let v = |outcomes: Vec<Outcome>| Verdict {
            allowed: false,
            delay_us: 0,
            outcomes: outcomes.into(),
            trial: 0,
        };
        let only_slots = v(vec![o(true, 0), o(true, 0), o(false, 1_000_000)]);
        assert_eq!(refused_until_us(&p, &only_slots), 0);
        let both = v(vec![o(false, 300), o(true, 0), o(false, 1_000_000)]);
        assert_eq!(refused_until_us(&p, &both), 300);
    }

    #[test]
    fn the_cache_is_bounded() {
        let cache = RefusalCache::new(REFUSAL_SHARDS).unwrap();
        let t0 = Instant::now();
        let v = Verdict {
            allowed: false,
            delay_us: 0,
            outcomes: vec![].into(),
            trial: 0,
        };
        for i in 0..10_000u64 {
            cache.insert((i.to_string(), 0), t0, t0 + Duration::from_secs(60), &v);
        }
        let held: usize = cache.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= REFUSAL_SHARDS, "{held}");
    }
}
