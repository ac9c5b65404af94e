//! Properties of the algorithms over random sequences of requests, waits, refunds
//! and reloads (proptest, on the memory store with a `ManualClock` and on the pure
//! functions): what each algorithm promises is never exceeded, a refund undoes its
//! charge, and a reload keeps the count of every limit whose state it keeps. The
//! case table (`cases`) pins the arithmetic step by step; these hold it to the
//! promises in between. A failure prints the shrunk sequence; proptest saves its
//! seed under `proptest-regressions/limit/` (committed), which replays it first.

use std::collections::HashMap;

use proptest::prelude::*;

use super::algo::{month_of, Algorithm, Rate, State};
use super::cases::BASE_US;
use super::{LimitDef, ManualClock, MemoryStore, Mode, Permit, Plan};

const S: u64 = 1_000_000;
const DAY_US: u64 = 86_400 * S;

/// A limit of every algorithm the memory store runs, with small numbers, so that
/// a few dozen requests reach it.
fn algorithm() -> impl Strategy<Value = Algorithm> {
    let window = || prop_oneof![Just(1_000u64), Just(7_000), Just(S), Just(60 * S)];
    let limit = || 1u64..=8;
    // Rates whose count divides the period and rates whose count does not.
    let rate = || {
        (
            1u64..=10,
            prop_oneof![Just(1_000u64), Just(7_000), Just(S), Just(60 * S)],
        )
            .prop_map(|(count, per_us)| Rate::reduced(count, per_us))
    };
    prop_oneof![
        (limit(), window())
            .prop_map(|(limit, window_us)| Algorithm::FixedWindow { limit, window_us }),
        limit().prop_map(|limit| Algorithm::CalendarMonth { limit }),
        (limit(), window())
            .prop_map(|(limit, window_us)| Algorithm::SlidingWindow { limit, window_us }),
        (limit(), window())
            .prop_map(|(limit, window_us)| Algorithm::SlidingLog { limit, window_us }),
        (rate(), 1u64..=8).prop_map(|(rate, burst)| Algorithm::TokenBucket { rate, burst }),
        (rate(), 1u64..=8).prop_map(|(rate, burst)| Algorithm::Gcra { rate, burst }),
        limit().prop_map(|limit| Algorithm::Concurrency {
            limit,
            lease_us: 60 * S
        }),
    ]
}

/// How far one wait goes, in thousandths of `span`: often not at all (bursts),
/// sometimes a little, sometimes past a whole window.
fn wait() -> impl Strategy<Value = u64> {
    prop_oneof![Just(0u64), 0u64..=50, 0u64..=2_500]
}

/// The time over which `algo` fills up again: its window, the time its bucket takes
/// to refill, a month; a second for requests in flight.
fn span(algo: &Algorithm) -> u64 {
    match algo {
        Algorithm::CalendarMonth { .. } => 31 * DAY_US,
        Algorithm::Concurrency { .. } => S,
        _ => algo.policy_window_us().max(1),
    }
}

fn plan(name: &str, algo: Algorithm, cost: u64, max_delay_us: u64) -> Plan {
    Plan {
        limits: vec![LimitDef::new(name.into(), algo, cost)],
        mode: match max_delay_us {
            0 => Mode::Reject,
            max_delay_us => Mode::Delay { max_delay_us },
        },
    }
}

fn bucket(algo: &Algorithm) -> bool {
    matches!(algo, Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. })
}

// === never over the limit ===

#[derive(Debug, Clone)]
enum Op {
    /// The clock moves on (thousandths of the limit's span).
    Wait(u64),
    /// A request of this cost.
    Take(u64),
    /// The oldest request in flight ends (concurrency).
    Release,
    /// The configuration is reloaded with the limit unchanged: a new plan, built
    /// anew from the same spec.
    Reload,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    let op = prop_oneof![
        3 => wait().prop_map(Op::Wait),
        5 => (1u64..=3).prop_map(Op::Take),
        1 => Just(Op::Release),
        1 => Just(Op::Reload),
    ];
    proptest::collection::vec(op, 1..120)
}

/// An admitted request: when it arrived, when it is forwarded (later in delay
/// mode), and its cost.
#[derive(Debug, Clone, Copy)]
struct Admitted {
    at: u64,
    forwarded: u64,
    cost: u64,
}

/// Whether the last request `algo` admitted (of those it admitted, in order) keeps
/// what the algorithm promises, with every one before it; the broken promise if not.
fn over_the_limit(algo: &Algorithm, admitted: &[Admitted]) -> Option<String> {
    let last = admitted.last()?;
    let sum_where = |f: &dyn Fn(&Admitted) -> bool| -> u64 {
        admitted.iter().filter(|a| f(a)).map(|a| a.cost).sum()
    };
    match *algo {
        // Within each window [k*W, (k+1)*W) (or calendar month). sliding_window
        // weighs in the previous window too, so it keeps this at least.
        Algorithm::FixedWindow { limit, window_us }
        | Algorithm::SlidingWindow { limit, window_us } => {
            let sum = sum_where(&|a| a.at / window_us == last.at / window_us);
            (sum > limit)
                .then(|| format!("{sum} admitted in the window of {}, limit {limit}", last.at))
        }
        Algorithm::CalendarMonth { limit } => {
            let sum = sum_where(&|a| month_of(a.at) == month_of(last.at));
            (sum > limit)
                .then(|| format!("{sum} admitted in the month of {}, limit {limit}", last.at))
        }
        // Within every interval of W: (t - W, t].
        Algorithm::SlidingLog { limit, window_us } => {
            let sum = sum_where(&|a| a.at + window_us > last.at);
            (sum > limit).then(|| format!("{sum} admitted in the {window_us} µs up to {}", last.at))
        }
        // From request i's arrival to the last one's forwarding, requests i..=last
        // use at most `burst` plus what refills meanwhile: in P-scaled tokens for
        // token_bucket; in emission intervals for gcra (each request's, rounded
        // down as gcra rounds them).
        Algorithm::TokenBucket { rate, burst } | Algorithm::Gcra { rate, burst } => {
            let (n, p) = (u128::from(rate.count), u128::from(rate.per_us));
            let used = |a: &Admitted| match algo {
                Algorithm::Gcra { .. } => (u128::from(a.cost) * p / n).max(1) * n,
                _ => u128::from(a.cost) * p,
            };
            let mut sum = 0;
            admitted.iter().rev().find_map(|first| {
                sum += used(first);
                let elapsed = u128::from(last.forwarded.saturating_sub(first.at));
                let most = u128::from(burst) * p + n * elapsed;
                (sum > most).then(|| {
                    format!(
                        "from {} to {}: {sum} used, at most {most}",
                        first.at, last.forwarded
                    )
                })
            })
        }
        Algorithm::Concurrency { .. } => None,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// What a limit admits never exceeds what its algorithm promises, through
    /// reloads that keep it; requests in flight never exceed `concurrency`'s limit,
    /// and one is admitted whenever there is room for it.
    #[test]
    fn admitted_never_exceeds_the_limit(
        algo in algorithm(),
        delay in prop_oneof![Just(0u64), 1u64..=2 * S],
        start in 0u64..DAY_US,
        ops in ops(),
    ) {
        // Delay mode is token_bucket's and gcra's.
        let max_delay_us = if bucket(&algo) { delay } else { 0 };
        let clock = ManualClock::new(BASE_US + start);
        let store = MemoryStore::new(10, clock.clone());
        let mut now = BASE_US + start;
        let mut plans: Vec<Plan> = (1..=3).map(|c| plan("p", algo, c, max_delay_us)).collect();
        let mut admitted = Vec::new();
        let mut held: Vec<(Permit, u64)> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Op::Wait(w) => {
                    now += span(&algo) / 1_000 * w;
                    clock.set(now);
                }
                Op::Take(cost) => {
                    let checked = store.acquire("r", "k", &plans[cost as usize - 1]);
                    let v = checked.verdict;
                    if let Algorithm::Concurrency { limit, .. } = algo {
                        let in_flight: u64 = held.iter().map(|(_, c)| c).sum();
                        prop_assert_eq!(v.allowed, in_flight + cost <= limit, "step {}", step);
                    }
                    if v.allowed {
                        admitted.push(Admitted { at: now, forwarded: now + v.delay_us, cost });
                        held.push((checked.permit, cost));
                    }
                    if let Some(broken) = over_the_limit(&algo, &admitted) {
                        prop_assert!(false, "step {}: {}", step, broken);
                    }
                }
                Op::Release => {
                    if !held.is_empty() {
                        held.remove(0);
                    }
                }
                Op::Reload => {
                    plans = (1..=3).map(|c| plan("p", algo, c, max_delay_us)).collect();
                }
            }
        }
    }
}

// === a refund undoes its charge ===

#[derive(Debug, Clone)]
enum Paid {
    Wait(u64),
    /// A request, of this cost.
    Take(u64),
    /// A request of this cost charged, to be refunded (as a Redis Cluster charges a
    /// key before another key of the request refuses).
    Charge(u64),
    /// The oldest charge not yet refunded is refunded, where it was made.
    Refund,
}

fn paid() -> impl Strategy<Value = Vec<Paid>> {
    let op = prop_oneof![
        3 => wait().prop_map(Paid::Wait),
        5 => (1u64..=3).prop_map(Paid::Take),
        1 => (1u64..=3).prop_map(Paid::Charge),
        1 => Just(Paid::Refund),
    ];
    proptest::collection::vec(op, 1..120)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A refunded charge (`Algorithm::refund`) leaves a limit deciding every later
    /// request exactly as a twin that never saw the charge: for every algorithm when
    /// no request came between the charge and its refund, and for the windows, the
    /// log and requests in flight whatever came between, so long as the charge
    /// refused nothing its twin admitted. A bucket refunded after other requests
    /// gets back what time may have given back already: it is never stricter than
    /// its twin, and more generous by at most what was refunded.
    #[test]
    fn a_refund_restores_what_was_taken(
        algo in algorithm(),
        start in 0u64..DAY_US,
        ops in paid(),
    ) {
        let mut now = BASE_US + start;
        let (mut charged, mut twin) = (State::Empty, State::Empty);
        // Charges not yet refunded, and whether a request came after each.
        let mut pending: Vec<(u64, u64, bool)> = Vec::new();
        // A pending charge refused what the twin admitted: they count different
        // requests from then on, until both are resynchronised.
        let mut diverged = false;
        // Refunded to a bucket after other requests: how much more generous than
        // its twin it may be.
        let mut given_back = 0;
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Paid::Wait(w) => now += span(&algo) / 1_000 * w,
                Paid::Charge(cost) => {
                    let (o, new) = algo.check(&charged, now, cost, 0);
                    if o.allowed {
                        charged = new;
                        pending.push((now, cost, false));
                    }
                }
                Paid::Refund => {
                    if pending.is_empty() {
                        continue;
                    }
                    let (at, cost, after) = pending.remove(0);
                    algo.refund(&mut charged, at, cost);
                    if after && bucket(&algo) {
                        given_back += cost;
                    }
                    if pending.is_empty() && diverged {
                        twin = charged.clone();
                        (diverged, given_back) = (false, 0);
                    }
                }
                Paid::Take(cost) => {
                    let (a, new_a) = algo.check(&charged, now, cost, 0);
                    let (b, new_b) = algo.check(&twin, now, cost, 0);
                    if !pending.is_empty() {
                        diverged |= a.allowed != b.allowed;
                        for p in &mut pending {
                            p.2 = true;
                        }
                    } else if given_back == 0 {
                        prop_assert_eq!(&a, &b, "step {}", step);
                    } else {
                        prop_assert!(
                            a.allowed || !b.allowed,
                            "step {}: the refunded refuses what its twin admits",
                            step
                        );
                        if a.allowed && !b.allowed && cost > given_back {
                            let (less, _) = algo.check(&twin, now, cost - given_back, 0);
                            prop_assert!(
                                less.allowed,
                                "step {}: more generous than its twin by more than {}",
                                step,
                                given_back
                            );
                        }
                    }
                    if a.allowed {
                        charged = new_a;
                    }
                    if b.allowed {
                        twin = new_b;
                    }
                    if pending.is_empty() && a.allowed != b.allowed {
                        twin = charged.clone();
                        given_back = 0;
                    }
                }
            }
        }
    }
}

// === a reload keeps the counts ===

#[derive(Debug, Clone)]
enum Reloaded {
    Wait(u64),
    Take(u64),
    Release,
    /// The configuration reloaded with the limit changed: (its name, whether its
    /// window changes, its new limit or burst, its new rate's count).
    Reload(usize, bool, u64, u64),
}

fn reloads() -> impl Strategy<Value = Vec<Reloaded>> {
    let op = prop_oneof![
        3 => wait().prop_map(Reloaded::Wait),
        5 => (1u64..=3).prop_map(Reloaded::Take),
        1 => Just(Reloaded::Release),
        2 => (0usize..2, prop::bool::weighted(0.2), 1u64..=8, 1u64..=10)
            .prop_map(|(name, window, quota, count)| Reloaded::Reload(name, window, quota, count)),
    ];
    proptest::collection::vec(op, 1..120)
}

/// `algo` with new numbers, the window changed if `window` (in the same
/// algorithm): what a reload may make of it.
fn changed(algo: Algorithm, window: bool, quota: u64, count: u64) -> Algorithm {
    let w = |w: u64| if window { w * 2 } else { w };
    match algo {
        Algorithm::FixedWindow { window_us, .. } => Algorithm::FixedWindow {
            limit: quota,
            window_us: w(window_us),
        },
        Algorithm::CalendarMonth { .. } => Algorithm::CalendarMonth { limit: quota },
        Algorithm::SlidingWindow { window_us, .. } => Algorithm::SlidingWindow {
            limit: quota,
            window_us: w(window_us),
        },
        Algorithm::SlidingLog { window_us, .. } => Algorithm::SlidingLog {
            limit: quota,
            window_us: w(window_us),
        },
        Algorithm::TokenBucket { rate, .. } => Algorithm::TokenBucket {
            rate: Rate::reduced(count, rate.per_us),
            burst: quota,
        },
        Algorithm::Gcra { rate, .. } => Algorithm::Gcra {
            rate: Rate::reduced(count, rate.per_us),
            burst: quota,
        },
        Algorithm::Concurrency { lease_us, .. } => Algorithm::Concurrency {
            limit: quota,
            lease_us,
        },
    }
}

/// What a limit's state is, as its documentation says (`LimitDef::id`): its name,
/// its algorithm and its window; not its numbers.
type Meaning = (&'static str, &'static str, Option<String>);

fn meaning(name: &'static str, algo: &Algorithm) -> Meaning {
    (name, algo.label(), algo.window_name())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Through reloads that change a limit's numbers, its name or its window, the
    /// memory store decides each request as the algorithm does on the state kept
    /// for what the limit means (name, algorithm, window): a reload that keeps
    /// those keeps the count, requests in flight included, and applies the new
    /// numbers to it; one that changes them starts afresh, and finds the old count
    /// again if it changes them back.
    #[test]
    fn a_reload_keeps_the_counts(
        algo in algorithm(),
        start in 0u64..DAY_US,
        ops in reloads(),
    ) {
        let clock = ManualClock::new(BASE_US + start);
        let store = MemoryStore::new(10, clock.clone());
        let mut now = BASE_US + start;
        let (mut name, mut algo) = ("p", algo);
        let mut states: HashMap<Meaning, State> = HashMap::new();
        let mut held: Vec<(Permit, Meaning, u64)> = Vec::new();
        for (step, op) in ops.iter().enumerate() {
            match *op {
                Reloaded::Wait(w) => {
                    now += span(&algo) / 1_000 * w;
                    clock.set(now);
                }
                Reloaded::Release => {
                    if !held.is_empty() {
                        held.remove(0);
                    }
                }
                Reloaded::Reload(n, window, quota, count) => {
                    name = ["p", "q"][n];
                    algo = changed(algo, window, quota, count);
                }
                Reloaded::Take(cost) => {
                    let checked = store.acquire("r", "k", &plan(name, algo, cost, 0));
                    let key = meaning(name, &algo);
                    let state = match algo {
                        Algorithm::Concurrency { .. } => State::InFlight(
                            held.iter().filter(|(_, m, _)| *m == key).map(|(_, _, c)| c).sum(),
                        ),
                        _ => states.get(&key).cloned().unwrap_or_default(),
                    };
                    let (expected, new) = algo.check(&state, now, cost, 0);
                    prop_assert_eq!(
                        &*checked.verdict.outcomes,
                        &[expected][..],
                        "step {}: {:?}",
                        step,
                        algo
                    );
                    if expected.allowed {
                        states.insert(key.clone(), new);
                        held.push((checked.permit, key, cost));
                    }
                }
            }
        }
    }
}
