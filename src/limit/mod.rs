//! Rate limits: what a route's limits are (`Plan`), what a store decides for one
//! request (`Verdict`), and the stores that keep the state. The arithmetic lives in
//! `algo` as pure functions of (state, now) so the memory store and the Lua scripts
//! of the Redis store can be checked against one table of cases.

pub mod algo;
#[cfg(any(test, feature = "test-support"))]
pub mod cases;
pub mod clock;
pub mod memory;
pub mod metered;
pub mod per_ip;
#[cfg(test)]
mod proptests;
pub mod redis;
pub mod reserve;
pub mod response;
pub mod store;

use std::time::Duration;

pub use self::redis::{RedisOptions, RedisStore};
pub use crate::redis::Target as RedisTarget;
pub use crate::redis::{PrimaryUrl, SentinelTarget};
pub use algo::{decide, Algorithm, Outcome, Rate, State};
pub use clock::{Clock, ManualClock, SystemClock};
pub use memory::MemoryStore;
pub use response::{BodyCost, Charge, CostFrom, Estimate, FromResponse, ResponseCost, StatusSet};
pub use store::{OnError, Store, StoreError};

/// One configured limit, compiled.
#[derive(Debug, Clone, PartialEq)]
pub struct LimitDef {
    /// `name` from the config, or `<algorithm>_<index>`.
    pub name: String,
    /// Stable id of what the state means: the name, the algorithm and, for the window
    /// algorithms, the window (its length, or `month`). State is kept per id (within a route), so a
    /// reload that changes `limit`, `rate`, `burst` or `cost` keeps the count and the
    /// algorithm applies the new numbers to it; a changed algorithm or window starts
    /// afresh.
    pub id: u64,
    /// Stable hash of everything that decides this limit: the id, every parameter and
    /// the cost. Whatever is remembered about a decision (the Redis store's refusal
    /// cache) must be forgotten when it changes.
    pub version: u64,
    pub algorithm: Algorithm,
    pub cost: u64,
    /// On trial (`shadow: true`): decided and charged like the others, but its
    /// refusal refuses nothing (the request's decision is `shadow`). Not part of
    /// `id`: a limit put on trial, or taken off it, keeps its state.
    pub shadow: bool,
    /// When it is charged: at admission, or from the upstream's response (then
    /// `cost` is what it checks for before forwarding, and charges nothing then).
    /// Not part of `id`: changing what a limit counts keeps its state.
    pub charge: Charge,
    /// `reserve: N` (Redis store): units an instance takes in advance and spends
    /// locally (`limit::reserve`). Not part of `id` or `version`: the shared count is
    /// the same whoever holds its units.
    pub reserve: Option<Reserve>,
}

/// A limit's `reserve`: how many units an instance takes at most in one call, and
/// where it counts those it never spends (`sluice_reserve_unused_total{route,limit}`).
#[derive(Debug, Clone)]
pub struct Reserve {
    pub units: u64,
    pub unused: Option<prometheus::IntCounter>,
}

impl Reserve {
    pub fn new(units: u64) -> Reserve {
        Reserve {
            units,
            unused: None,
        }
    }
}

impl PartialEq for Reserve {
    /// The same reservation whichever counter it reports to.
    fn eq(&self, other: &Reserve) -> bool {
        self.units == other.units
    }
}

impl LimitDef {
    pub fn new(name: String, algorithm: Algorithm, cost: u64) -> LimitDef {
        let label = algorithm.label();
        // A window's length in µs, or `month`: a calendar month is never the same
        // state as a window of any fixed length.
        let id = match algorithm.window_name() {
            Some(window) => stable_id(&format!("{name}|{label}|{window}")),
            None => stable_id(&format!("{name}|{label}")),
        };
        let version = stable_id(&format!("{id:x}|{algorithm:?}|{cost}"));
        LimitDef {
            name,
            id,
            version,
            algorithm,
            cost,
            shadow: false,
            charge: Charge::Admission,
            reserve: None,
        }
    }

    /// The limit with `reserve`.
    pub fn reserving(mut self, reserve: Reserve) -> LimitDef {
        self.reserve = Some(reserve);
        self
    }

    /// The limit charged from the upstream's response (`count` by status, `cost`
    /// from a header) instead of at admission.
    pub fn from_response(mut self, from: FromResponse) -> LimitDef {
        self.version = stable_id(&format!("{:x}|{from:?}", self.version));
        self.charge = Charge::Response(Box::new(from));
        self
    }

    /// Whether admitting a request charges it: not a limit charged from the
    /// response, unless it holds an `estimate` then (settled when the body ends).
    pub fn at_admission(&self) -> bool {
        match &self.charge {
            Charge::Admission => true,
            Charge::Response(r) => r.body().is_some_and(|b| b.estimate.is_some()),
            Charge::GiveBack => false,
        }
    }

    /// Whether the limit holds an `estimate` at admission and gives back what a
    /// response did not use: its capacity can grow back before its time.
    pub fn gives_back(&self) -> bool {
        matches!(&self.charge, Charge::Response(r) if r.body().is_some_and(|b| b.estimate.is_some()))
    }

    /// Whether admitting a request writes this limit's state: charged at admission
    /// and not `concurrency` (whose slots the memory store keeps beside its states).
    pub fn stateful_at_admission(&self) -> bool {
        self.at_admission() && !self.algorithm.is_concurrency()
    }

    /// The limit's share on one of `n` instances (`Algorithm::share`), under a
    /// version of its own: the same id, so the state it counts is the limit's.
    pub fn share(&self, n: u64) -> LimitDef {
        let mut def = self.clone();
        def.algorithm = self.algorithm.share(n);
        if def.algorithm != self.algorithm {
            def.version = stable_id(&format!("{:x}|share/{n}", self.version));
        }
        def
    }

    /// The limit on trial (`shadow: true`).
    pub fn on_trial(mut self) -> LimitDef {
        self.shadow = true;
        self.version = stable_id(&format!("{:x}|shadow", self.version));
        self
    }
}

/// What happens when a limit refuses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Refuse at once (429).
    Reject,
    /// Book capacity in the future and wait up to this long (token_bucket and gcra
    /// only); longer waits are refused.
    Delay { max_delay_us: u64 },
}

/// The limits that apply to one request: every one must admit it, and then it is
/// charged to all of them at once.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub limits: Vec<LimitDef>,
    pub mode: Mode,
}

impl Plan {
    /// Every limit's share on one of `n` instances (`LimitDef::share`).
    pub fn share(&self, n: u64) -> Plan {
        Plan {
            limits: self.limits.iter().map(|l| l.share(n)).collect(),
            mode: self.mode,
        }
    }

    pub fn max_delay_us(&self) -> u64 {
        match self.mode {
            Mode::Reject => 0,
            Mode::Delay { max_delay_us } => max_delay_us,
        }
    }

    /// The limits on trial, a bit each (bit i: `limits[i]`; `check` allows
    /// `shadow` on a route's first 64 limits only).
    pub fn on_trial(&self) -> u64 {
        self.limits
            .iter()
            .take(64)
            .enumerate()
            .filter(|(_, l)| l.shadow)
            .fold(0, |m, (i, _)| m | 1 << i)
    }
}

/// The decision for one request over all limits of its plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Verdict {
    /// Admitted by every limit (and charged to all of them).
    pub allowed: bool,
    /// With `Mode::Delay`: how long the admitted request must wait before it is
    /// forwarded (the capacity is already booked). Zero otherwise.
    pub delay_us: u64,
    /// One outcome per limit, in plan order.
    pub outcomes: Outcomes,
    /// The limits on trial (`Plan::on_trial`): their refusals refuse nothing, and
    /// neither they nor their waits are reported.
    pub trial: u64,
}

impl Verdict {
    /// Longest wait before a refused request could pass, in microseconds.
    pub fn retry_after_us(&self) -> u64 {
        self.enforced()
            .map(|(_, o)| o.retry_after_us)
            .max()
            .unwrap_or(0)
    }

    /// The outcomes of the limits that are not on trial, with their index.
    pub fn enforced(&self) -> impl Iterator<Item = (usize, &Outcome)> {
        let trial = self.trial;
        self.outcomes
            .iter()
            .enumerate()
            .filter(move |(i, _)| *i >= 64 || trial & (1 << i) == 0)
    }

    /// Admitted, though a limit on trial refused: the decision is `shadow`.
    pub fn shadow_refused(&self) -> bool {
        self.allowed
            && self
                .outcomes
                .iter()
                .enumerate()
                .any(|(i, o)| i < 64 && self.trial & (1 << i) != 0 && !o.allowed)
    }

    pub fn delay(&self) -> Duration {
        Duration::from_micros(self.delay_us)
    }

    /// The outcome to report in rate-limit headers: on a refusal the refusing limit
    /// with the longest wait; otherwise the limit with the fewest requests left
    /// (ties: the one that takes longest to reset).
    pub fn headline(&self) -> Option<(usize, &Outcome)> {
        let it = self.enforced();
        if !self.allowed {
            return it
                .filter(|(_, o)| !o.allowed)
                .max_by_key(|(_, o)| o.retry_after_us);
        }
        it.min_by(|(_, a), (_, b)| {
            a.remaining
                .cmp(&b.remaining)
                .then(b.reset_us.cmp(&a.reset_us))
        })
    }
}

/// A verdict's outcomes, one per limit in plan order: held inline for a plan of
/// one limit (most routes), so that deciding it allocates nothing.
#[derive(Clone)]
pub enum Outcomes {
    One(Outcome),
    Many(Vec<Outcome>),
}

impl std::ops::Deref for Outcomes {
    type Target = [Outcome];

    fn deref(&self) -> &[Outcome] {
        match self {
            Outcomes::One(o) => std::slice::from_ref(o),
            Outcomes::Many(v) => v,
        }
    }
}

impl std::ops::DerefMut for Outcomes {
    fn deref_mut(&mut self) -> &mut [Outcome] {
        match self {
            Outcomes::One(o) => std::slice::from_mut(o),
            Outcomes::Many(v) => v,
        }
    }
}

impl From<Vec<Outcome>> for Outcomes {
    fn from(v: Vec<Outcome>) -> Outcomes {
        Outcomes::Many(v)
    }
}

/// One outcome held inline, more in a `Vec`.
impl FromIterator<Outcome> for Outcomes {
    fn from_iter<I: IntoIterator<Item = Outcome>>(iter: I) -> Outcomes {
        let mut iter = iter.into_iter();
        let Some(first) = iter.next() else {
            return Outcomes::Many(Vec::new());
        };
        match iter.next() {
            None => Outcomes::One(first),
            Some(second) => {
                let mut all = Vec::with_capacity(2 + iter.size_hint().0);
                all.extend([first, second]);
                all.extend(iter);
                Outcomes::Many(all)
            }
        }
    }
}

impl From<Outcome> for Outcomes {
    fn from(o: Outcome) -> Outcomes {
        Outcomes::One(o)
    }
}

impl<'a> IntoIterator for &'a Outcomes {
    type Item = &'a Outcome;
    type IntoIter = std::slice::Iter<'a, Outcome>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl<'a> IntoIterator for &'a mut Outcomes {
    type Item = &'a mut Outcome;
    type IntoIter = std::slice::IterMut<'a, Outcome>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter_mut()
    }
}

/// The same outcomes, however held.
impl PartialEq for Outcomes {
    fn eq(&self, other: &Outcomes) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Outcomes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

/// One key's share of a request whose limits count different keys (`key` on a
/// limit): the limits of the whole plan that count this key, as a plan of their own,
/// and where each of them stands in the whole plan.
pub struct Share<'a> {
    /// The namespace the key's state lives in, and the key as stored.
    pub ns: &'a str,
    pub key: &'a str,
    pub plan: &'a Plan,
    /// `at[i]`: the index in the whole plan of `plan.limits[i]`.
    pub at: &'a [usize],
}

impl Verdict {
    /// The verdict over a whole plan of `n` limits from the verdicts of its shares,
    /// each outcome put back at its place: admitted only if every share admits
    /// (a store charges none of them otherwise); the wait is the longest.
    pub fn of_shares<'a>(
        n: usize,
        trial: u64,
        shares: impl IntoIterator<Item = (&'a [usize], &'a [Outcome])>,
    ) -> Verdict {
        let mut outcomes = vec![Outcome::default(); n];
        for (at, part) in shares {
            for (&i, o) in at.iter().zip(part) {
                if let Some(slot) = outcomes.get_mut(i) {
                    *slot = *o;
                }
            }
        }
        Verdict::on_trial(outcomes, trial)
    }

    /// `of_shares` from each share's own verdict, in the order of `shares`.
    pub fn of_share_verdicts(
        n: usize,
        trial: u64,
        shares: &[Share<'_>],
        verdicts: &[Verdict],
    ) -> Verdict {
        let parts = shares.iter().zip(verdicts);
        Verdict::of_shares(n, trial, parts.map(|(s, v)| (s.at, &*v.outcomes)))
    }
}

/// A store's answer for one request: the verdict and, when admitted, the permit that
/// holds its concurrency slots.
pub struct Checked {
    pub verdict: Verdict,
    pub permit: Permit,
}

/// The concurrency slots an admitted request holds until its response ends. Dropping
/// it gives them back: at once in memory, with a `ZREM` sent off the request path in
/// Redis (and if that never arrives, the lease expires). Empty for a plan without a
/// concurrency limit, and for a refused request, which takes nothing.
#[derive(Default)]
pub enum Permit {
    #[default]
    None,
    Memory(memory::Slots),
    Redis(redis::LeaseGuard),
    /// The slots of a request whose limits count several keys.
    Many(Vec<Permit>),
}

impl Plan {
    /// Whether every limit of the plan takes units in advance (`reserve`), and so a
    /// request may be admitted from units its instance holds. A limit without it
    /// (or one charged from the response) needs a call for every request anyway.
    pub fn reserving(&self) -> bool {
        !self.limits.is_empty()
            && self
                .limits
                .iter()
                .all(|l| l.reserve.is_some() && l.at_admission() && !l.algorithm.is_concurrency())
    }

    /// Whether any limit of the plan counts requests in flight.
    pub fn has_concurrency(&self) -> bool {
        self.limits.iter().any(|l| l.algorithm.is_concurrency())
    }
}

/// FNV-1a, 64 bit: a hash that is the same in every process and every version, for
/// ids that name stored state.
pub fn stable_id(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests of one key admitted by `plan` in a row at one instant (permits kept,
    /// so concurrency slots stay taken).
    fn admitted_at_once(store: &MemoryStore, plan: &Plan, tries: usize) -> usize {
        let mut permits = Vec::new();
        for _ in 0..tries {
            let c = store.acquire("r", "k", plan);
            if c.verdict.allowed {
                permits.push(c.permit);
            }
        }
        permits.len()
    }

    #[test]
    fn outcomes_collected_keep_one_inline_and_every_one_in_order() {
        let outcome = |remaining| Outcome {
            allowed: true,
            quota: 10,
            remaining,
            reset_us: 1,
            retry_after_us: 0,
            delay_us: 0,
        };
        let none: Outcomes = std::iter::empty().collect();
        assert!(matches!(&none, Outcomes::Many(v) if v.is_empty()));
        let one: Outcomes = [outcome(7)].into_iter().collect();
        assert!(matches!(one, Outcomes::One(ref o) if o.remaining == 7));
        let three: Outcomes = (1..=3).map(outcome).collect();
        let remaining: Vec<u64> = three.iter().map(|o| o.remaining).collect();
        assert!(matches!(three, Outcomes::Many(_)));
        assert_eq!(remaining, [1, 2, 3]);
    }

    #[test]
    fn a_share_of_every_counting_limit_is_its_count_divided_and_rounded_up() {
        let rate = |count, per_us| Rate { count, per_us };
        let algorithms = [
            (
                Algorithm::FixedWindow {
                    limit: 30,
                    window_us: 3_600_000_000,
                },
                10,
            ),
            (Algorithm::CalendarMonth { limit: 31 }, 11),
            (
                Algorithm::SlidingWindow {
                    limit: 10,
                    window_us: 1_000_000,
                },
                4,
            ),
            (
                Algorithm::SlidingLog {
                    limit: 2,
                    window_us: 1_000_000,
                },
                1,
            ),
            (
                Algorithm::TokenBucket {
                    rate: rate(30, 3_600_000_000),
                    burst: 30,
                },
                10,
            ),
            (
                Algorithm::Gcra {
                    rate: rate(30, 3_600_000_000),
                    burst: 29,
                },
                10,
            ),
            (
                Algorithm::Concurrency {
                    limit: 7,
                    lease_us: 30_000_000,
                },
                3,
            ),
        ];
        for (algorithm, share) in algorithms {
            let def = LimitDef::new("l".into(), algorithm, 1);
            let plan = Plan {
                limits: vec![def.clone()],
                mode: Mode::Reject,
            };
            // The whole limit for one instance; the share for one of three, each
            // instance deciding alone in its own memory.
            assert_eq!(plan.share(1), plan);
            let parts = plan.share(3);
            assert_eq!(parts.limits[0].id, def.id, "{algorithm:?}");
            assert_ne!(parts.limits[0].version, def.version, "{algorithm:?}");
            for _ in 0..3 {
                let store = MemoryStore::new(1000, ManualClock::new(1_000_000_000_000));
                assert_eq!(admitted_at_once(&store, &parts, 40), share, "{algorithm:?}");
            }
        }
        // A rate is divided exactly: 30 an hour is 10 per hour on each of three.
        assert_eq!(
            Algorithm::TokenBucket {
                rate: rate(30, 3_600_000_000),
                burst: 30
            }
            .share(3),
            Algorithm::TokenBucket {
                rate: rate(1, 360_000_000),
                burst: 10
            }
        );
        assert_eq!(
            Algorithm::Gcra {
                rate: rate(10, 1_000_000),
                burst: 1
            }
            .share(4),
            Algorithm::Gcra {
                rate: rate(1, 400_000),
                burst: 1
            }
        );
    }

    #[test]
    fn a_token_buckets_share_refills_at_its_share_of_the_rate() {
        // 30 a second, burst 30, over three instances: 10 at once, then 10 a second.
        let clock = ManualClock::new(1_000_000_000_000);
        let store = MemoryStore::new(1000, clock.clone());
        let def = LimitDef::new(
            "l".into(),
            Algorithm::TokenBucket {
                rate: Rate {
                    count: 30,
                    per_us: 1_000_000,
                },
                burst: 30,
            },
            1,
        );
        let plan = Plan {
            limits: vec![def],
            mode: Mode::Reject,
        }
        .share(3);
        assert_eq!(admitted_at_once(&store, &plan, 40), 10);
        clock.advance(500_000);
        assert_eq!(admitted_at_once(&store, &plan, 40), 5);
        clock.advance(1_000_000);
        assert_eq!(admitted_at_once(&store, &plan, 40), 10);
    }

    #[test]
    fn the_id_names_what_the_state_means_and_the_version_everything() {
        let rate = |count| Rate {
            count,
            per_us: 1_000_000,
        };
        let def = |name: &str, algorithm, cost| LimitDef::new(name.into(), algorithm, cost);
        let fixed = |limit, window_us| Algorithm::FixedWindow { limit, window_us };
        let log = |limit, window_us| Algorithm::SlidingLog { limit, window_us };
        let bucket = |count, burst| Algorithm::TokenBucket {
            rate: rate(count),
            burst,
        };
        let gcra = |count, burst| Algorithm::Gcra {
            rate: rate(count),
            burst,
        };
        let same_state = [
            [def("l", fixed(10, 60), 1), def("l", fixed(5, 60), 3)],
            [def("l", log(10, 60), 1), def("l", log(11, 60), 1)],
            [def("l", bucket(10, 5), 1), def("l", bucket(3, 5), 1)],
            [def("l", bucket(10, 5), 1), def("l", bucket(10, 9), 2)],
            [def("l", gcra(10, 5), 1), def("l", gcra(1, 1), 1)],
        ];
        for [a, b] in &same_state {
            assert_eq!(a.id, b.id, "{a:?} {b:?}");
            assert_ne!(a.version, b.version, "{a:?} {b:?}");
        }
        let afresh = [
            [def("l", fixed(10, 60), 1), def("m", fixed(10, 60), 1)],
            [def("l", fixed(10, 60), 1), def("l", fixed(10, 61), 1)],
            [def("l", fixed(10, 60), 1), def("l", log(10, 60), 1)],
            [def("l", bucket(10, 5), 1), def("l", gcra(10, 5), 1)],
        ];
        for [a, b] in &afresh {
            assert_ne!(a.id, b.id, "{a:?} {b:?}");
            assert_ne!(a.version, b.version, "{a:?} {b:?}");
        }
        let a = def("l", gcra(10, 5), 1);
        assert_eq!((a.id, a.version), {
            let b = def("l", gcra(10, 5), 1);
            (b.id, b.version)
        });
    }
}
