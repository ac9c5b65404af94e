//! `reserve: N`: units of a shared limit an instance took in advance, in one Redis
//! call, and spends locally until they run out, their window ends, or a reload
//! changes the limit.
//!
//! Why nothing is over-admitted: a unit is counted in Redis when it is taken, so the
//! shared count already holds every unit an instance may still spend.
//! - A window's units are spent only within the window they were counted in (local
//!   time, from before the call was sent: never later than the server's window end).
//! - A bucket's (token_bucket, gcra) have no window; held, they would come back on top
//!   of a bucket that refills meanwhile. So they fade: a lot of k units taken at t
//!   holds at most k − used − rate·(now − t). The bucket's level plus every unit held
//!   anywhere in the fleet then never exceeds `burst` (each holder fades at least as
//!   fast as the bucket refills), which is the bucket's own bound.
//!
//! Why little is left unused: an instance takes only when what it holds cannot pay
//! for a request, one call at a time per key (the others wait for it), and sizes the
//! take by how many requests it saw for the key in the last second, never above N. So
//! it holds at most N − 1 units of a limit at any moment, and a quiet instance takes
//! only what it spends. Units that expire or fade unspent are counted
//! (`sluice_reserve_unused_total{route,limit}`) when the instance next sees the key,
//! or drops it.
//!
//! Everything here is local time in µs (`Reserves::now_us`), from a monotonic clock.

use std::collections::VecDeque;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use lru::LruCache;

use super::{Algorithm, LimitDef, Outcome, Plan, Rate, Verdict};

/// Keys (route and client key, with the limits' fingerprint) whose units and rate an
/// instance remembers at most; the least recently used are dropped (their units
/// counted unused).
pub const RESERVE_ENTRIES: usize = 65_536;
const SHARDS: usize = 16;
/// The period over which an instance counts a key's requests to size its next take.
const PERIOD_US: u64 = 1_000_000;

/// Units of one limit taken in one call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Lot {
    /// Units not yet spent (before fading).
    pub left: u64,
    /// When they were taken (local µs, read before the call was sent).
    pub taken_us: u64,
    pub hold: Hold,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Hold {
    /// Spendable before this local time (µs): the end of the window they count in.
    Until(u64),
    /// Fading at the limit's refill rate from `taken_us` (token_bucket, gcra).
    Fade(Rate),
}

impl Lot {
    /// The lot of `units` taken at `taken_us` for `algorithm`, whose store decided the
    /// take at `server_now_us` (Redis' clock, which places the window).
    pub fn new(algorithm: &Algorithm, units: u64, taken_us: u64, server_now_us: u64) -> Lot {
        let hold = match (algorithm.reserve_hold_us(server_now_us), algorithm.refill()) {
            (Some(hold), _) => Hold::Until(taken_us.saturating_add(hold)),
            (None, Some(rate)) => Hold::Fade(rate),
            // No algorithm that takes units has neither; hold none.
            (None, None) => Hold::Until(taken_us),
        };
        Lot {
            left: units,
            taken_us,
            hold,
        }
    }

    /// Units spendable at `now_us`.
    pub fn available(&self, now_us: u64) -> u64 {
        match self.hold {
            Hold::Until(end) if now_us < end => self.left,
            Hold::Until(_) => 0,
            Hold::Fade(rate) => {
                // floor(elapsed * count / per): the units the bucket refilled since.
                let elapsed = u128::from(now_us.saturating_sub(self.taken_us));
                let faded = elapsed * u128::from(rate.count) / u128::from(rate.per_us.max(1));
                let faded = u64::try_from(faded).unwrap_or(u64::MAX);
                self.left.saturating_sub(faded)
            }
        }
    }
}

/// The units one instance holds for one key's limits, one queue of lots per limit
/// (oldest first: they are spent first, as they expire first).
#[derive(Debug, Default)]
pub struct Held {
    lots: Vec<VecDeque<Lot>>,
    /// Per limit: what the last call said was left (shared) and its reset, at `at_us`;
    /// what a local admission reports in the rate-limit headers.
    seen: Vec<(u64, u64)>,
    seen_at_us: u64,
    /// Requests for the key in the current and the previous period (`PERIOD_US`).
    period: u64,
    count: u64,
    previous: u64,
    /// An instance's call taking units for this key is out: others wait for it.
    taking: Option<Arc<tokio::sync::Notify>>,
    /// The last take brought nothing beyond its request's cost (a bucket in debt,
    /// delay mode, a refusal): requests that waited for one take do not wait for
    /// another, so they never queue behind one another's calls.
    dry: bool,
}

impl Held {
    /// Counts a request for the key at `now_us`.
    pub fn note(&mut self, now_us: u64) {
        let period = now_us / PERIOD_US;
        if period != self.period {
            self.previous = if period == self.period + 1 {
                self.count
            } else {
                0
            };
            self.count = 0;
            self.period = period;
        }
        self.count += 1;
    }

    /// Units of limit `i` spendable at `now_us`.
    fn available(&self, i: usize, now_us: u64) -> u64 {
        self.lots
            .get(i)
            .map_or(0, |q| q.iter().map(|l| l.available(now_us)).sum())
    }

    /// Drops the lots of limit `i` that can no longer be spent, counting what they
    /// left unspent.
    fn expire(&mut self, limits: &[LimitDef], now_us: u64) {
        for (i, q) in self.lots.iter_mut().enumerate() {
            while let Some(lot) = q.front() {
                if lot.available(now_us) > 0 {
                    break;
                }
                let unspent = lot.left;
                q.pop_front();
                count_unused(limits.get(i), unspent);
            }
        }
    }

    /// Admits a request of `plan` from the units held, if every limit holds its cost:
    /// spends them (the oldest first) and answers as the store would. None (nothing
    /// spent) otherwise.
    pub fn admit(&mut self, plan: &Plan, now_us: u64) -> Option<Verdict> {
        self.expire(&plan.limits, now_us);
        if self.lots.len() != plan.limits.len()
            || plan
                .limits
                .iter()
                .enumerate()
                .any(|(i, l)| self.available(i, now_us) < l.cost)
        {
            return None;
        }
        let elapsed = now_us.saturating_sub(self.seen_at_us);
        let mut outcomes = Vec::with_capacity(plan.limits.len());
        for (i, l) in plan.limits.iter().enumerate() {
            let mut cost = l.cost;
            for lot in self.lots[i].iter_mut() {
                let spend = cost.min(lot.available(now_us));
                // Spent units leave `left`; a fading lot keeps fading from its start.
                lot.left -= spend;
                cost -= spend;
                if cost == 0 {
                    break;
                }
            }
            let (shared, reset) = self.seen.get(i).copied().unwrap_or((0, 0));
            outcomes.push(Outcome {
                allowed: true,
                quota: l.algorithm.quota(),
                remaining: shared.saturating_add(self.available(i, now_us)),
                reset_us: reset.saturating_sub(elapsed),
                retry_after_us: 0,
                delay_us: 0,
            });
        }
        Some(Verdict::on_trial(outcomes, plan.on_trial()))
    }

    /// How many units beyond its cost each limit should take in the next call: enough
    /// to hold, with what it holds, as many requests as the key saw in the last
    /// second (at least this one, at most `reserve`), less the request's own cost.
    pub fn wants(&self, plan: &Plan, now_us: u64) -> Vec<u64> {
        let recent = self.count.max(self.previous);
        plan.limits
            .iter()
            .enumerate()
            .map(|(i, l)| {
                let n = l.reserve.as_ref().map_or(0, |r| r.units);
                let sized = recent.saturating_mul(l.cost).clamp(l.cost, n.max(l.cost));
                sized
                    .saturating_sub(l.cost)
                    .saturating_sub(self.available(i, now_us))
            })
            .collect()
    }

    /// Keeps the units a call took (`taken[i]` beyond the cost, for limit i), decided
    /// at `server_now_us` on the store's clock and sent at `sent_us` (local), with
    /// what the call said was left.
    pub fn keep(
        &mut self,
        plan: &Plan,
        verdict: &Verdict,
        taken: &[u64],
        sent_us: u64,
        server_now_us: u64,
    ) {
        if self.lots.len() != plan.limits.len() {
            // First call for the key (a reload's change of limits has already
            // dropped what was held: `Reserves::find`).
            self.drop_all(&plan.limits);
            self.lots = vec![VecDeque::new(); plan.limits.len()];
        }
        self.dry = taken.iter().all(|&t| t == 0);
        for ((l, q), &units) in plan.limits.iter().zip(&mut self.lots).zip(taken) {
            if units > 0 {
                q.push_back(Lot::new(&l.algorithm, units, sent_us, server_now_us));
            }
        }
        self.seen = verdict
            .outcomes
            .iter()
            .enumerate()
            .map(|(i, o)| {
                let mine = taken.get(i).copied().unwrap_or(0);
                (o.remaining.saturating_sub(mine), o.reset_us)
            })
            .collect();
        self.seen_at_us = sent_us;
    }

    /// Counts every unit still held as unused (the key is dropped).
    fn drop_all(&mut self, limits: &[LimitDef]) {
        for (i, q) in self.lots.drain(..).enumerate() {
            count_unused(limits.get(i), q.iter().map(|l| l.left).sum());
        }
    }
}

fn count_unused(limit: Option<&LimitDef>, units: u64) {
    if units == 0 {
        return;
    }
    if let Some(counter) = limit
        .and_then(|l| l.reserve.as_ref())
        .and_then(|r| r.unused.as_ref())
    {
        counter.inc_by(units);
    }
}

/// A key's tag (route and client key): one entry whatever its limits, so a reload
/// that changes them is seen, and what was held counted, at the key's next request.
type Key = String;

/// What a key's entry remembers beside its units: the limits they were taken for
/// (their fingerprint, and the limits themselves once units are held, so units
/// dropped are counted against the right ones).
struct Entry {
    held: Held,
    fingerprint: u64,
    limits: Vec<LimitDef>,
}

/// Every key's held units, sharded, bounded (`RESERVE_ENTRIES`).
pub struct Reserves {
    shards: Vec<Mutex<LruCache<Key, Entry>>>,
    hasher: RandomState,
    start: Instant,
}

/// What a request found in its key's entry.
pub enum Found {
    /// Admitted from the units held.
    Admitted(Verdict),
    /// Another request is taking units for the key: wait for it, then look again.
    Wait(tokio::sync::futures::OwnedNotified),
    /// This request makes a call. With a guard, it takes these wants for the key (the
    /// guard ends the take when dropped); without, it only decides itself.
    Call(Vec<u64>, Option<Taking>),
}

/// The take in progress for a key: dropped (however the call ended), it wakes the
/// requests waiting for it.
pub struct Taking {
    reserves: Arc<Reserves>,
    key: Key,
    /// The limits the take is for.
    fingerprint: u64,
    notify: Arc<tokio::sync::Notify>,
    /// Its units were kept (`keep`); a take that ends otherwise brought nothing.
    kept: bool,
}

impl Drop for Taking {
    fn drop(&mut self) {
        if let Some(e) = self.reserves.shard(&self.key).peek_mut(&self.key) {
            if e.held
                .taking
                .as_ref()
                .is_some_and(|n| Arc::ptr_eq(n, &self.notify))
            {
                e.held.taking = None;
                if !self.kept {
                    e.held.dry = true;
                }
            }
        }
        self.notify.notify_waiters();
    }
}

impl Taking {
    /// Keeps what the call took (`Held::keep`).
    pub fn keep(
        &mut self,
        plan: &Plan,
        verdict: &Verdict,
        taken: &[u64],
        sent_us: u64,
        now_us: u64,
    ) {
        self.kept = true;
        let mut shard = self.reserves.shard(&self.key);
        match shard.get_mut(&self.key) {
            // The key's limits are still those the units were taken for.
            Some(e) if e.fingerprint == self.fingerprint => {
                e.held.keep(plan, verdict, taken, sent_us, now_us);
                if taken.iter().any(|&t| t > 0) && e.limits != plan.limits {
                    e.limits.clone_from(&plan.limits);
                }
            }
            // A reload changed them meanwhile (or the key was dropped): the units are
            // not spent under other limits.
            _ => {
                for (l, &t) in plan.limits.iter().zip(taken) {
                    count_unused(Some(l), t);
                }
            }
        }
    }
}

impl Reserves {
    pub fn new(capacity: usize) -> Arc<Reserves> {
        let per = NonZeroUsize::new(capacity.div_ceil(SHARDS).max(1)).unwrap_or(NonZeroUsize::MIN);
        Arc::new(Reserves {
            shards: (0..SHARDS)
                .map(|_| Mutex::new(LruCache::new(per)))
                .collect(),
            hasher: RandomState::new(),
            start: Instant::now(),
        })
    }

    /// Local time in µs.
    pub fn now_us(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    fn shard(&self, key: &str) -> MutexGuard<'_, LruCache<Key, Entry>> {
        let i = (self.hasher.hash_one(key) % SHARDS as u64) as usize;
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Looks at the key's units for a request of `plan`, whose limits and mode
    /// `fingerprint` identifies. `waited`: the request already waited for a take (and
    /// was counted towards the key's rate then); it waits for another only while takes
    /// bring units, so requests that find nothing held (a bucket in debt, delay mode)
    /// never queue behind one another's calls.
    pub fn find(self: &Arc<Self>, key: &str, fingerprint: u64, plan: &Plan, waited: bool) -> Found {
        let now = self.now_us();
        let mut shard = self.shard(key);
        if !shard.contains(key) {
            if let Some((_, mut old)) = shard.push(
                key.to_string(),
                Entry {
                    held: Held::default(),
                    fingerprint,
                    limits: Vec::new(),
                },
            ) {
                // A least recently used key made room.
                old.held.drop_all(&old.limits);
            }
        }
        let Some(e) = shard.get_mut(key) else {
            unreachable!("inserted above")
        };
        if !waited {
            e.held.note(now);
        }
        if e.fingerprint != fingerprint {
            // A reload changed the limits: the units held were taken under the old
            // ones (the shared count holds them), and are not spent under the new.
            e.fingerprint = fingerprint;
            let old = std::mem::take(&mut e.limits);
            e.held.drop_all(&old);
        }
        if let Some(v) = e.held.admit(plan, now) {
            return Found::Admitted(v);
        }
        match &e.held.taking {
            Some(n) if !waited || !e.held.dry => return Found::Wait(n.clone().notified_owned()),
            // Taking nothing, this call cannot push what the instance holds past
            // N - 1.
            Some(_) => return Found::Call(vec![0; plan.limits.len()], None),
            None => {}
        }
        let wants = e.held.wants(plan, now);
        if wants.iter().all(|&w| w == 0) {
            return Found::Call(wants, None);
        }
        let notify = Arc::new(tokio::sync::Notify::new());
        e.held.taking = Some(notify.clone());
        drop(shard);
        Found::Call(
            wants,
            Some(Taking {
                reserves: self.clone(),
                key: key.to_string(),
                fingerprint,
                notify,
                kept: false,
            }),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{LimitDef, Mode, Reserve};

    const S: u64 = 1_000_000;

    fn plan(algorithm: Algorithm, units: u64) -> Plan {
        Plan {
            limits: vec![LimitDef::new("l".into(), algorithm, 1).reserving(Reserve::new(units))],
            mode: Mode::Reject,
        }
    }

    #[test]
    fn a_window_lot_is_spent_until_the_window_ends_and_not_after() {
        let fixed = Algorithm::FixedWindow {
            limit: 100,
            window_us: 10 * S,
        };
        // Taken 3 s into a 10 s window (server time), at local time 50 s.
        let lot = Lot::new(&fixed, 19, 50 * S, 1_000 * S + 3 * S);
        assert_eq!(lot.hold, Hold::Until(57 * S));
        assert_eq!(lot.available(57 * S - 1), 19);
        assert_eq!(lot.available(57 * S), 0);
        // sliding_window: the current window's end, where its count stops being whole.
        let sliding = Algorithm::SlidingWindow {
            limit: 100,
            window_us: 10 * S,
        };
        assert_eq!(Lot::new(&sliding, 5, 0, 1_009 * S).hold, Hold::Until(S));
    }

    #[test]
    fn a_bucket_lot_fades_at_the_refill_rate() {
        let rate = Rate {
            count: 10,
            per_us: S,
        };
        let bucket = Algorithm::TokenBucket { rate, burst: 50 };
        let lot = Lot::new(&bucket, 19, 0, 123);
        assert_eq!(lot.hold, Hold::Fade(rate));
        assert_eq!(
            [0, 99_999, 100_000, S, 1_800_000, 1_900_000, 10 * S].map(|t| lot.available(t)),
            [19, 19, 18, 9, 1, 0, 0]
        );
    }

    #[test]
    fn held_units_admit_until_spent_then_a_take_is_asked_for() {
        let p = plan(
            Algorithm::FixedWindow {
                limit: 100,
                window_us: 10 * S,
            },
            20,
        );
        let mut h = Held::default();
        h.note(0);
        assert_eq!(h.admit(&p, 0), None);
        // The first take of a key that saw one request: nothing beyond its cost.
        assert_eq!(h.wants(&p, 0), vec![0]);
        for t in 1..30 {
            h.note(t);
        }
        // 30 requests in this second: the most, 20, less this request's cost.
        assert_eq!(h.wants(&p, 30), vec![19]);
        let v = Verdict::on_trial(
            vec![Outcome {
                allowed: true,
                quota: 100,
                remaining: 79,
                reset_us: 7 * S,
                ..Outcome::default()
            }],
            0,
        );
        h.keep(&p, &v, &[19], 30, 3 * S);
        for i in 0..19 {
            let v = h.admit(&p, 40 + i).expect("held");
            // What was left for others, plus what this instance still holds.
            assert_eq!(v.outcomes[0].remaining, 60 + 18 - i);
        }
        assert_eq!(h.admit(&p, 100), None);
        // Holding 0: the next take asks for 19 again.
        assert_eq!(h.wants(&p, 100), vec![19]);
    }

    #[test]
    fn units_left_when_the_window_ends_are_counted_unused() {
        let counter = prometheus::IntCounter::new("u", "u").unwrap();
        let mut p = plan(
            Algorithm::FixedWindow {
                limit: 100,
                window_us: S,
            },
            20,
        );
        p.limits[0].reserve.as_mut().unwrap().unused = Some(counter.clone());
        let mut h = Held::default();
        let v = Verdict::on_trial(vec![Outcome::default()], 0);
        // Taken 0.9 s into the window: 0.1 s to spend them.
        h.keep(&p, &v, &[10], 0, 900_000);
        assert!(h.admit(&p, 99_999).is_some());
        assert_eq!(h.admit(&p, 100_000), None);
        assert_eq!(counter.get(), 9);
    }
}
