//! One table of rate-limit cases that every store must pass unchanged: each step is a
//! request at a given time and the exact verdict expected. The numbers are worked out
//! by hand from the formulas in `algo`, so the memory store and the Redis store's Lua
//! scripts are both held to the arithmetic, not to each other. A case may reload its
//! plan between requests, as a changed config file does: the state of every limit
//! whose name, algorithm and window are unchanged carries over.

use super::algo::{decide, decide_taking, EMPTY};
use super::{Algorithm, LimitDef, Mode, Plan, Rate, State, Verdict};

/// Start of every case: a whole number of days since the epoch (2027-01-16), so every
/// window that divides a day starts here.
pub const BASE_US: u64 = 20_834 * 86_400_000_000;

const MS: u64 = 1_000;
const S: u64 = 1_000_000;

/// One request and the verdict it must get.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// Offset from `BASE_US`.
    pub at_us: u64,
    pub allowed: bool,
    /// `Verdict::headline()`'s remaining.
    pub remaining: u64,
    /// `Verdict::retry_after_us()`.
    pub retry_after_us: u64,
    /// `Verdict::delay_us`.
    pub delay_us: u64,
    /// `Verdict::shadow_refused`: admitted, though a limit on trial refused.
    pub shadowed: bool,
    /// When given, `Verdict::headline()`'s reset_us.
    pub reset_us: Option<u64>,
}

impl Step {
    /// The step, its headline's reset checked too.
    fn reset(self, reset_us: u64) -> Step {
        Step {
            reset_us: Some(reset_us),
            ..self
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub name: &'static str,
    /// The plan of the first step.
    pub plan: Plan,
    /// (step index, plan): from that step on, the plan is this one (a reload).
    pub reloads: Vec<(usize, Plan)>,
    pub steps: Vec<Step>,
}

/// Runs `case` through `check`, which decides one request under the plan it is given
/// (for one fixed route and key of a fresh store) at the time it is given.
pub fn run(case: &Case, mut check: impl FnMut(&Plan, u64) -> Verdict) -> Result<(), String> {
    let mut plan = &case.plan;
    for (i, step) in case.steps.iter().enumerate() {
        if let Some((_, p)) = case.reloads.iter().find(|(at, _)| *at == i) {
            plan = p;
        }
        let v = check(plan, BASE_US + step.at_us);
        let got = Step {
            at_us: step.at_us,
            allowed: v.allowed,
            remaining: v.headline().map_or(0, |(_, o)| o.remaining),
            retry_after_us: v.retry_after_us(),
            delay_us: v.delay_us,
            shadowed: v.shadow_refused(),
            reset_us: step
                .reset_us
                .map(|_| v.headline().map_or(0, |(_, o)| o.reset_us)),
        };
        if got != *step {
            return Err(format!(
                "case {:?}, step {} (at +{} µs):\n  expected {:?}\n       got {:?}\n  outcomes {:?}",
                case.name, i, step.at_us, step, got, v.outcomes
            ));
        }
    }
    Ok(())
}

fn ok(at_us: u64, remaining: u64) -> Step {
    Step {
        at_us,
        allowed: true,
        remaining,
        retry_after_us: 0,
        delay_us: 0,
        shadowed: false,
        reset_us: None,
    }
}

fn delayed(at_us: u64, remaining: u64, delay_us: u64) -> Step {
    Step {
        at_us,
        allowed: true,
        remaining,
        retry_after_us: 0,
        delay_us,
        shadowed: false,
        reset_us: None,
    }
}

fn refused(at_us: u64, remaining: u64, retry_after_us: u64) -> Step {
    Step {
        at_us,
        allowed: false,
        remaining,
        retry_after_us,
        delay_us: 0,
        shadowed: false,
        reset_us: None,
    }
}

/// Admitted, though a limit on trial refused it.
fn tried(at_us: u64, remaining: u64) -> Step {
    Step {
        shadowed: true,
        ..ok(at_us, remaining)
    }
}

fn limit(name: &str, algorithm: Algorithm, cost: u64) -> LimitDef {
    LimitDef::new(name.to_string(), algorithm, cost)
}

fn plan(limits: Vec<LimitDef>) -> Plan {
    Plan {
        limits,
        mode: Mode::Reject,
    }
}

fn one(algorithm: Algorithm, cost: u64) -> Plan {
    plan(vec![limit("l", algorithm, cost)])
}

fn delay_plan(algorithm: Algorithm, max_delay_us: u64) -> Plan {
    Plan {
        limits: vec![limit("l", algorithm, 1)],
        mode: Mode::Delay { max_delay_us },
    }
}

fn fixed(limit: u64, window_us: u64) -> Algorithm {
    Algorithm::FixedWindow { limit, window_us }
}

fn sliding(limit: u64, window_us: u64) -> Algorithm {
    Algorithm::SlidingWindow { limit, window_us }
}

fn log(limit: u64, window_us: u64) -> Algorithm {
    Algorithm::SlidingLog { limit, window_us }
}

fn bucket(count: u64, per_us: u64, burst: u64) -> Algorithm {
    Algorithm::TokenBucket {
        rate: Rate { count, per_us },
        burst,
    }
}

fn gcra(count: u64, per_us: u64, burst: u64) -> Algorithm {
    Algorithm::Gcra {
        rate: Rate { count, per_us },
        burst,
    }
}

// === taking units in advance (`reserve`) ===

/// A request that takes units for its instance to hold: at `at_us`, wanting
/// `wants[i]` units beyond its cost for limit i; the verdict and the units it must
/// get.
#[derive(Debug, Clone, PartialEq)]
pub struct TakeStep {
    pub at_us: u64,
    pub wants: Vec<u64>,
    /// Before this request the store lost every state (a Redis restarted empty).
    pub lost: bool,
    pub allowed: bool,
    /// `Verdict::headline()`'s remaining: the units left, those just taken included
    /// (they are the instance's to spend).
    pub remaining: u64,
    pub delay_us: u64,
    /// Units taken beyond the cost, per limit; all 0 when refused.
    pub taken: Vec<u64>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TakeCase {
    pub name: &'static str,
    pub plan: Plan,
    /// (step index, plan): from that step on, the plan is this one (a reload).
    pub reloads: Vec<(usize, Plan)>,
    pub steps: Vec<TakeStep>,
}

/// Runs `case` through `take`, which decides one request under the plan, at the time
/// and with the wants it is given (for one fixed route and key of a fresh store);
/// `lose` empties the store.
pub fn run_takes(
    case: &TakeCase,
    mut take: impl FnMut(&Plan, u64, &[u64]) -> (Verdict, Vec<u64>),
    mut lose: impl FnMut(),
) -> Result<(), String> {
    let mut plan = &case.plan;
    for (i, step) in case.steps.iter().enumerate() {
        if let Some((_, p)) = case.reloads.iter().find(|(at, _)| *at == i) {
            plan = p;
        }
        if step.lost {
            lose();
        }
        let (v, taken) = take(plan, BASE_US + step.at_us, &step.wants);
        let got = TakeStep {
            allowed: v.allowed,
            remaining: v.headline().map_or(0, |(_, o)| o.remaining),
            delay_us: v.delay_us,
            taken,
            ..step.clone()
        };
        if got != *step {
            return Err(format!(
                "take case {:?}, step {} (at +{} µs):\n  expected {:?}\n       got {:?}\n  outcomes {:?}",
                case.name, i, step.at_us, step, got, v.outcomes
            ));
        }
    }
    Ok(())
}

fn took(at_us: u64, wants: &[u64], remaining: u64, taken: &[u64]) -> TakeStep {
    TakeStep {
        at_us,
        wants: wants.to_vec(),
        lost: false,
        allowed: true,
        remaining,
        delay_us: 0,
        taken: taken.to_vec(),
    }
}

fn not_taken(at_us: u64, wants: &[u64], remaining: u64) -> TakeStep {
    TakeStep {
        allowed: false,
        taken: vec![0; wants.len()],
        ..took(at_us, wants, remaining, &[])
    }
}

/// The cases of taking units in advance, worked out by hand: every algorithm that
/// takes them, both modes, windows rolling with units taken, a reload that lowers
/// the limit, and a store that lost its counts.
pub fn takes() -> Vec<TakeCase> {
    vec![
        TakeCase {
            name: "fixed_window: takes what is left, never more, and afresh each window",
            plan: one(fixed(10, 10 * S), 1),
            reloads: vec![],
            steps: vec![
                // count 0: 1 + 4 taken, 5; remaining after the request 9.
                took(0, &[4], 9, &[4]),
                // count 5: 6 after the request (remaining 4), all 4 taken: 10.
                took(S, &[4], 4, &[4]),
                not_taken(2 * S, &[4], 0),
                // The next window: 1 + 9 of the 20 wanted, all that is left.
                took(10 * S, &[20], 9, &[9]),
                not_taken(11 * S, &[0], 0),
            ],
        },
        TakeCase {
            name: "fixed_window: a reload that lowers the limit counts the units taken",
            plan: one(fixed(10, 10 * S), 1),
            reloads: vec![(1, one(fixed(6, 10 * S), 1))],
            steps: vec![
                took(0, &[4], 9, &[4]),
                // Count 5 of the new 6: one more request, nothing more to take.
                took(S, &[4], 0, &[0]),
                not_taken(2 * S, &[4], 0),
            ],
        },
        TakeCase {
            name: "fixed_window: a store that lost its counts starts afresh",
            plan: one(fixed(10, 10 * S), 1),
            reloads: vec![],
            steps: vec![
                took(0, &[4], 9, &[4]),
                TakeStep {
                    lost: true,
                    ..took(S, &[4], 9, &[4])
                },
                took(2 * S, &[9], 4, &[4]),
            ],
        },
        TakeCase {
            name: "sliding_window: units count whole in the window they are taken in",
            plan: one(sliding(10, 10 * S), 1),
            reloads: vec![],
            steps: vec![
                // curr 0 -> 1 + 5.
                took(0, &[5], 9, &[5]),
                // Next window, e = 0: prev 6 weighs 1; 6 + 1 = 7: remaining 3, all taken.
                took(10 * S, &[5], 3, &[3]),
                // e = W/2: 6 * 0.5 + 4 = 7; + 1 = 8: remaining 2, both taken (curr 7).
                took(15 * S, &[2], 2, &[2]),
                // 3 + 7 = 10: nothing left.
                not_taken(15 * S, &[1], 0),
            ],
        },
        TakeCase {
            name: "token_bucket: takes whole tokens left, never more",
            plan: one(bucket(10, S, 10), 1),
            reloads: vec![],
            steps: vec![
                // 10 tokens: 1 + 5; 4 left.
                took(0, &[5], 9, &[5]),
                // 4: 1 + 3; empty.
                took(0, &[5], 3, &[3]),
                not_taken(0, &[1], 0),
                // Half a second refills 5: 1 + 4.
                took(S / 2, &[9], 4, &[4]),
            ],
        },
        TakeCase {
            name: "gcra: takes the emission slots left within the burst",
            plan: one(gcra(10, S, 10), 1),
            reloads: vec![],
            steps: vec![
                // tat 0 -> 100 ms for the request, then 600 ms with 5 more (<= 1 s).
                took(0, &[5], 9, &[5]),
                // 700 ms: 3 slots left under 1 s; all taken, tat 1 s.
                took(0, &[5], 3, &[3]),
                not_taken(0, &[0], 0),
                // 300 ms later: 3 slots again.
                took(300 * MS, &[5], 2, &[2]),
            ],
        },
        TakeCase {
            name: "delay mode: a request that must wait takes nothing more",
            plan: delay_plan(bucket(10, S, 2), S),
            reloads: vec![],
            steps: vec![
                // 2 tokens: 1 + 1; empty.
                took(0, &[5], 1, &[1]),
                // Empty: admitted after 100 ms, booking the token; nothing taken.
                TakeStep {
                    delay_us: 100 * MS,
                    ..took(0, &[5], 0, &[0])
                },
            ],
        },
        TakeCase {
            name: "two limits: all take, or a refusal takes nothing anywhere",
            plan: plan(vec![
                limit("day", fixed(10, 10 * S), 1),
                limit("rate", bucket(5, S, 5), 1),
            ]),
            reloads: vec![],
            steps: vec![
                // day: 1 + 4 (remaining 9); rate: 1 + 4 of 5 (remaining 4).
                took(0, &[4, 4], 4, &[4, 4]),
                // rate is empty: refused, and day keeps its count of 5.
                not_taken(0, &[4, 4], 0),
                // 1 s refills rate: day 5 + 1 + 4 (remaining 4); rate 1 + 4.
                took(S, &[4, 4], 4, &[4, 4]),
                // day is full now.
                not_taken(2 * S, &[0, 0], 0),
            ],
        },
    ]
}

/// Every case.
pub fn all() -> Vec<Case> {
    let mut cases = steady();
    cases.extend(reloaded());
    cases.extend(in_flight());
    cases.extend(on_trial());
    cases.extend(by_month());
    cases
}

fn month(limit: u64) -> Algorithm {
    Algorithm::CalendarMonth { limit }
}

const DAY: u64 = 86_400 * S;

/// A time given in seconds since the epoch (as `date -u -d 2027-03-01 +%s` prints
/// it), as a step's offset from `BASE_US`.
fn utc(unix_s: u64) -> u64 {
    unix_s * S - BASE_US
}

// Times of the calendar-month cases, worked out with `date -u`, not with the code
// under test.
/// 2027-01-31T23:00:00Z
const JAN_31_2027_2300: u64 = 1_801_436_400;
/// 2027-02-01T00:00:00Z
const FEB_2027: u64 = 1_801_440_000;
/// 2027-02-10T12:00:00Z
const FEB_10_2027_NOON: u64 = 1_802_260_800;
/// 2027-02-28T12:00:00Z
const FEB_28_2027_NOON: u64 = 1_803_816_000;
/// 2027-03-01T00:00:00Z
const MAR_2027: u64 = 1_803_859_200;
/// 2027-12-31T23:59:59Z
const DEC_31_2027_235959: u64 = 1_830_297_599;
/// 2028-01-01T00:00:00Z
const JAN_2028: u64 = 1_830_297_600;
/// 2028-02-01T00:00:00Z
const FEB_2028: u64 = 1_832_976_000;
/// 2028-02-28T12:00:00Z
const FEB_28_2028_NOON: u64 = 1_835_352_000;
/// 2028-02-29T00:00:00Z
const FEB_29_2028: u64 = 1_835_395_200;
/// 2028-03-01T00:00:00Z
const MAR_2028: u64 = 1_835_481_600;

/// fixed_window with `window: month`: calendar months in UTC, each ending at 00:00
/// UTC on the first of the next; reset and retry count down to it.
fn by_month() -> Vec<Case> {
    vec![
        // February 2027 has 28 days.
        Case {
            name: "month: counts within the month, all back at 00:00 UTC on the 1st",
            plan: one(month(3), 1),
            reloads: vec![],
            steps: vec![
                // 18.5 days to 2027-03-01.
                ok(utc(FEB_10_2027_NOON), 2).reset(1_598_400 * S),
                ok(utc(FEB_28_2027_NOON), 1).reset(43_200 * S),
                // The month's last µs.
                ok(utc(MAR_2027) - 1, 0).reset(1),
                refused(utc(MAR_2027) - 1, 0, 1).reset(1),
                // Its first µs: a new month, of 31 days.
                ok(utc(MAR_2027), 2).reset(31 * DAY),
            ],
        },
        Case {
            name: "month: December 2027 to January 2028",
            plan: one(month(2), 1),
            reloads: vec![],
            steps: vec![
                ok(utc(DEC_31_2027_235959), 1).reset(S),
                ok(utc(DEC_31_2027_235959) + 500 * MS, 0).reset(500 * MS),
                refused(utc(DEC_31_2027_235959) + 500 * MS, 0, 500 * MS).reset(500 * MS),
                ok(utc(JAN_2028), 1).reset(31 * DAY),
                ok(utc(JAN_2028) + S, 0).reset(31 * DAY - S),
                refused(utc(JAN_2028) + S, 0, 31 * DAY - S),
            ],
        },
        // 2028 is a leap year: February has 29 days.
        Case {
            name: "month: February of a leap year",
            plan: one(month(1), 1),
            reloads: vec![],
            steps: vec![
                // A day and a half: the 29th is still February.
                ok(utc(FEB_28_2028_NOON), 0).reset(129_600 * S),
                refused(utc(FEB_29_2028), 0, DAY).reset(DAY),
                refused(utc(MAR_2028) - 1, 0, 1),
                ok(utc(MAR_2028), 0).reset(31 * DAY),
            ],
        },
        Case {
            name: "month: a state written in an earlier month does not count",
            plan: one(month(1), 1),
            reloads: vec![],
            steps: vec![
                ok(utc(JAN_31_2027_2300), 0).reset(3_600 * S),
                // February 2027: 28 days.
                ok(utc(FEB_2027), 0).reset(28 * DAY),
                refused(utc(FEB_2027) + S, 0, 28 * DAY - S),
                // The same month a year later is another month (of 29 days).
                ok(utc(FEB_2028), 0).reset(29 * DAY),
            ],
        },
    ]
}

/// Limits on trial (`shadow: true`): decided and charged like the others when they
/// admit; when one refuses, the request is admitted all the same (and the limit not
/// charged), and only the other limits are reported or refuse.
fn on_trial() -> Vec<Case> {
    vec![
        // 3 per second enforced; 1 per second on trial.
        Case {
            name: "on trial: its refusal refuses nothing and charges it nothing",
            plan: plan(vec![
                limit("second", fixed(3, S), 1),
                limit("trial", fixed(1, S), 1).on_trial(),
            ]),
            reloads: vec![],
            steps: vec![
                // Both admit; the headline is the enforced limit's (2 left), not the
                // trial's (0 left).
                ok(0, 2),
                // The trial refuses: admitted, the enforced limit charged (1 left).
                tried(MS, 1),
                tried(2 * MS, 0),
                // The enforced limit refuses; its wait alone is reported.
                refused(3 * MS, 0, S - 3 * MS),
                // A new second: both admit again (the trial was charged once).
                ok(S, 2),
                tried(S, 1),
            ],
        },
        // On trial, a 1/h bucket of 2 that would stop the third request; enforced,
        // 2 per second. The bucket is charged only by the requests it admits: after
        // its two tokens, it admits again only once one came back.
        Case {
            name: "on trial: charged only when it admits",
            plan: plan(vec![
                limit("hourly", bucket(1, 3_600 * S, 2), 1).on_trial(),
                limit("second", fixed(2, S), 1),
            ]),
            reloads: vec![],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                refused(0, 0, S),
                tried(S, 1),
                tried(S, 0),
                // Half an hour: no token back yet.
                tried(1_800 * S, 1),
                // An hour after the start: one token back, admitted by both.
                ok(3_600 * S, 1),
                tried(3_600 * S, 0),
            ],
        },
        // Put on trial by a reload, then enforced again: its count carries over both
        // ways (the trial does not change what the state means).
        Case {
            name: "on trial and back: the state carries over",
            plan: plan(vec![limit("l", fixed(2, S), 1)]),
            reloads: vec![
                (2, plan(vec![limit("l", fixed(2, S), 1).on_trial()])),
                (3, plan(vec![limit("l", fixed(2, S), 1)])),
            ],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                tried(MS, 0),
                refused(2 * MS, 0, S - 2 * MS),
            ],
        },
        // Every limit on trial: nothing refuses, and nothing is reported.
        Case {
            name: "on trial alone: nothing refuses",
            plan: plan(vec![limit("trial", fixed(1, S), 1).on_trial()]),
            reloads: vec![],
            steps: vec![ok(0, 0), tried(0, 0), tried(MS, 0), ok(S, 0)],
        },
    ]
}

fn concurrency(limit: u64) -> Algorithm {
    Algorithm::Concurrency {
        limit,
        lease_us: 3_600 * S,
    }
}

/// concurrency, with requests that never end (the runner holds every permit to the
/// end of the case): admitted while in flight + 1 <= limit, remaining = limit - in
/// flight; refused with retry 1 s. Combined with another limit, a request refused by
/// either is charged to neither.
fn in_flight() -> Vec<Case> {
    vec![
        Case {
            name: "concurrency: fill, refuse with retry 1s, time does not free a slot",
            plan: one(concurrency(2), 1),
            reloads: vec![],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                refused(0, 0, S),
                refused(30 * 60 * S, 0, S),
            ],
        },
        Case {
            name: "concurrency and fixed_window: refused by either, charged to neither",
            plan: plan(vec![
                limit("inflight", concurrency(2), 1),
                limit("hourly", fixed(2, 3_600 * S), 1),
            ]),
            reloads: vec![],
            steps: vec![
                ok(0, 1),
                // In flight 2, hourly 2 of 2.
                ok(0, 0),
                // Both refuse; the headline is the longer wait (the hour).
                refused(0, 0, 3_600 * S),
            ],
        },
        Case {
            name: "concurrency full: the window limit is not charged",
            plan: plan(vec![
                limit("inflight", concurrency(1), 1),
                limit("hourly", fixed(3, 3_600 * S), 1),
            ]),
            // Raised to 2 in flight: the slot taken stays counted.
            reloads: vec![(
                3,
                plan(vec![
                    limit("inflight", concurrency(2), 1),
                    limit("hourly", fixed(3, 3_600 * S), 1),
                ]),
            )],
            steps: vec![
                ok(0, 0),
                refused(0, 0, S),
                refused(0, 0, S),
                // 2 of 2 in flight, hourly 2 of 3.
                ok(S, 0),
            ],
        },
    ]
}

/// Cases under one plan throughout.
fn steady() -> Vec<Case> {
    vec![
        // count + cost <= 3 per aligned second; refused until (idx+1)*W.
        Case {
            name: "fixed_window: fill, refuse until the window ends, roll over",
            reloads: vec![],
            plan: one(fixed(3, S), 1),
            steps: vec![
                ok(0, 2),
                ok(100 * MS, 1),
                ok(200 * MS, 0),
                refused(300 * MS, 0, 700 * MS),
                refused(999_999, 0, 1),
                ok(S, 2),
                ok(S, 1),
            ],
        },
        // cost 2 of 5 per minute: 2, 4, then 6 > 5.
        Case {
            name: "fixed_window: cost 2",
            reloads: vec![],
            plan: one(fixed(5, 60 * S), 2),
            steps: vec![ok(0, 3), ok(S, 1), refused(2 * S, 1, 58 * S), ok(60 * S, 3)],
        },
        // 8 requests in [0, 1s), then 25% into [1s, 2s): weight 0.75, estimate
        // 8 * 0.75 + curr = 6 + curr; admitted while 6 + curr + 1 <= 10.
        Case {
            name: "sliding_window: previous window weighted across the boundary",
            reloads: vec![],
            plan: one(sliding(10, S), 1),
            steps: vec![
                ok(500 * MS, 9),
                ok(500 * MS, 8),
                ok(500 * MS, 7),
                ok(500 * MS, 6),
                ok(500 * MS, 5),
                ok(500 * MS, 4),
                ok(500 * MS, 3),
                ok(500 * MS, 2),
                ok(1_250 * MS, 3),
                ok(1_250 * MS, 2),
                ok(1_250 * MS, 1),
                ok(1_250 * MS, 0),
                // estimate 10; curr 4 + 1 <= 10: e' = ceil(1s - 5 * 1s / 8) = 375ms.
                refused(1_250 * MS, 0, 125 * MS),
                // weight 0.625: 5 + 4 + 1 = 10.
                ok(1_375 * MS, 0),
                // e' = ceil(1s - 4 * 1s / 8) = 500ms.
                refused(1_375 * MS, 0, 125 * MS),
            ],
        },
        // limit 4 per 10s. Full current window: wait for the next one, where the 4
        // weigh 4 * (W - e'')/W and 3 + 1 <= 4 needs e'' = 2.5s.
        Case {
            name: "sliding_window: full window waits into the next",
            reloads: vec![],
            plan: one(sliding(4, 10 * S), 1),
            steps: vec![
                ok(S, 3),
                ok(S, 2),
                ok(S, 1),
                ok(S, 0),
                // (10s - 2s) + ceil(10s - 3 * 10s / 4) = 8s + 2.5s.
                refused(2 * S, 0, 10_500 * MS),
                // estimate 4 * 0.75 = 3.
                ok(12_500 * MS, 0),
                // estimate 4; curr 1 + 1 <= 4: e' = ceil(10s - 2 * 10s / 4) = 5s.
                refused(12_500 * MS, 0, 2_500 * MS),
                // Window 2: prev 1 (weight 0.5), estimate 0.5: floor(4 - 0.5 - 1) = 2.
                ok(25 * S, 2),
                // Window 4: nothing within reach.
                ok(40 * S, 3),
            ],
        },
        // cost 2, limit 5 per 10s: estimate 4 after two, 4 + 2 > 5; curr 4 + 2 > 5 so
        // the next window: (10s - 3s) + ceil(10s - 3 * 10s / 4) = 7s + 2.5s.
        Case {
            name: "sliding_window: cost 2",
            reloads: vec![],
            plan: one(sliding(5, 10 * S), 2),
            steps: vec![
                ok(0, 3),
                ok(2 * S, 1),
                refused(3 * S, 1, 9_500 * MS),
                // estimate 4 * 0.75 = 3, + 2 = 5.
                ok(12_500 * MS, 0),
            ],
        },
        // limit 3 per 10s; an entry at t counts up to t + W exclusive.
        Case {
            name: "sliding_log: fill, exact boundary",
            reloads: vec![],
            plan: one(log(3, 10 * S), 1),
            steps: vec![
                ok(0, 2),
                ok(2 * S, 1),
                ok(5 * S, 0),
                // The entry at 0 leaves at 10s.
                refused(6 * S, 0, 4 * S),
                refused(10 * S - 1, 0, 1),
                ok(10 * S, 0),
                // Now the entry at 2s is the oldest.
                refused(10 * S, 0, 2 * S),
                ok(12 * S, 0),
            ],
        },
        Case {
            name: "sliding_log: cost 2",
            reloads: vec![],
            plan: one(log(5, 60 * S), 2),
            steps: vec![
                ok(0, 3),
                ok(10 * S, 1),
                // 4 + 2 > 5: one unit must leave; the entry at 0 leaves at 60s.
                refused(20 * S, 1, 40 * S),
                ok(60 * S, 1),
                refused(61 * S, 1, 9 * S),
            ],
        },
        // 10/s, burst 5: one token = 1e6 units, 10 units per µs.
        Case {
            name: "token_bucket: drain, refill",
            reloads: vec![],
            plan: one(bucket(10, S, 5), 1),
            steps: vec![
                ok(0, 4),
                ok(0, 3),
                ok(0, 2),
                ok(0, 1),
                ok(0, 0),
                // -1e6 units: ceil(1e6 / 10).
                refused(0, 0, 100 * MS),
                refused(50 * MS, 0, 50 * MS),
                ok(100 * MS, 0),
                // 250ms refill 2.5 tokens.
                ok(350 * MS, 1),
                ok(350 * MS, 0),
                refused(350 * MS, 0, 50 * MS),
                // Long idle: full again, not more.
                ok(10 * S, 4),
            ],
        },
        // 3/s, burst 3: a token every 333_333.3 µs (3 units per µs, 1e6 per token).
        Case {
            name: "token_bucket: partial refill at 3/s",
            reloads: vec![],
            plan: one(bucket(3, S, 3), 1),
            steps: vec![
                ok(0, 2),
                ok(0, 1),
                ok(0, 0),
                // ceil(1e6 / 3).
                refused(0, 0, 333_334),
                // 999_999 units: one short, ceil(1 / 3) = 1 µs.
                refused(333_333, 0, 1),
                // 1_000_002 units, 2 left over.
                ok(333_334, 0),
                // 2 + 666_666 * 3 = 2_000_000 units.
                ok(S, 1),
                ok(10 * S, 2),
            ],
        },
        // cost 2 of a 10/s bucket of 5.
        Case {
            name: "token_bucket: cost 2",
            reloads: vec![],
            plan: one(bucket(10, S, 5), 2),
            steps: vec![ok(0, 3), ok(0, 1), refused(0, 1, 100 * MS), ok(100 * MS, 0)],
        },
        // 10/s, burst 5: inc = 100ms, L = 5e6; the same admissions as the bucket.
        Case {
            name: "gcra: drain, refill",
            reloads: vec![],
            plan: one(gcra(10, S, 5), 1),
            steps: vec![
                ok(0, 4),
                ok(0, 3),
                ok(0, 2),
                ok(0, 1),
                ok(0, 0),
                // tat 500ms: excess (600ms) * 10 = 6e6, ceil(1e6 / 10).
                refused(0, 0, 100 * MS),
                ok(100 * MS, 0),
                // excess 350ms * 10 = 3.5e6: floor(1.5e6 / 1e6) = 1 left.
                ok(350 * MS, 1),
                ok(350 * MS, 0),
                // excess 5.5e6: ceil(0.5e6 / 10).
                refused(350 * MS, 0, 50 * MS),
                ok(10 * S, 4),
            ],
        },
        // 3/s, burst 2: inc = floor(1e6 / 3) = 333_333, L = 2e6.
        Case {
            name: "gcra: full burst at 3/s",
            reloads: vec![],
            plan: one(gcra(3, S, 2), 1),
            steps: vec![
                // excess 999_999: floor(1_000_001 / 1e6) = 1.
                ok(0, 1),
                // excess 1_999_998 <= 2e6.
                ok(0, 0),
                // excess 2_999_997: ceil(999_997 / 3) = 333_333.
                refused(0, 0, 333_333),
                ok(333_333, 0),
                ok(10 * S, 1),
            ],
        },
        // Two limits: 3 per second, and a 1/h bucket of 5 (3.6e9 units per token,
        // 1 unit per µs). A refusal by either charges neither.
        Case {
            name: "two limits: a refused request is charged to none",
            reloads: vec![],
            plan: plan(vec![
                limit("second", fixed(3, S), 1),
                limit("hourly", bucket(1, 3_600 * S, 5), 1),
            ]),
            steps: vec![
                // headline: second (2, 1, 0 left) beats hourly (4, 3, 2).
                ok(0, 2),
                ok(0, 1),
                ok(0, 0),
                // second refuses; hourly would admit but is not charged.
                refused(0, 0, S),
                // hourly: 2 tokens + 1e6 units, minus one: 3_601_000_000 units, 1 left
                // (0 had the refused request been charged). second: 2 left.
                ok(S, 1),
                // hourly: 1_000_000 units, 0 left.
                ok(S, 0),
                // hourly refuses: ceil((3.6e9 - 1e6) / 1); second (would admit) is not
                // charged.
                refused(S, 0, 3_599 * S),
                refused(1_500 * MS, 0, 3_598_500 * MS),
            ],
        },
        // 10/s, burst 2, wait up to 250ms: booked tokens go negative.
        Case {
            name: "token_bucket: delay mode",
            reloads: vec![],
            plan: delay_plan(bucket(10, S, 2), 250 * MS),
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                // -1e6 units: wait 100ms.
                delayed(0, 0, 100 * MS),
                delayed(0, 0, 200 * MS),
                // -3e6 units: 300ms > 250ms.
                refused(0, 0, 300 * MS),
                // -2e6 + 1e6 refilled, minus 1e6 = -2e6: 200ms.
                delayed(100 * MS, 0, 200 * MS),
                // Full again (4e6 missing units refill in 400ms).
                ok(S, 1),
            ],
        },
        // The same with gcra: tat moves 100ms per request, L = 2e6.
        Case {
            name: "gcra: delay mode",
            reloads: vec![],
            plan: delay_plan(gcra(10, S, 2), 250 * MS),
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                // new tat 300ms: excess 3e6, ceil(1e6 / 10) = 100ms.
                delayed(0, 0, 100 * MS),
                delayed(0, 0, 200 * MS),
                refused(0, 0, 300 * MS),
                // tat 400ms, new 500ms: excess 4e6 - 2e6 -> 200ms.
                delayed(100 * MS, 0, 200 * MS),
                ok(S, 1),
            ],
        },
    ]
}

/// `plan` from step `at` on.
fn reload(at: usize, plan: Plan) -> (usize, Plan) {
    (at, plan)
}

/// The same steps under token_bucket and under gcra: `plan` of the algorithm built
/// from (count, per_us, burst), the first from step 0 on, each later one from its
/// step on. After a change both read a state in whole tokens at the time it was
/// written, so they admit alike whenever N divides P.
fn bucket_and_gcra(
    names: [&'static str; 2],
    plan: fn(Algorithm) -> Plan,
    params: &[(usize, (u64, u64, u64))],
    steps: Vec<Step>,
) -> [Case; 2] {
    let make = |name, algorithm: fn(u64, u64, u64) -> Algorithm| {
        let mut plans = params
            .iter()
            .map(|&(at, (n, p, b))| reload(at, plan(algorithm(n, p, b))));
        let (_, first) = plans.next().expect("a first plan");
        Case {
            name,
            plan: first,
            reloads: plans.collect(),
            steps: steps.clone(),
        }
    };
    [make(names[0], bucket), make(names[1], gcra)]
}

fn reject(algorithm: Algorithm) -> Plan {
    one(algorithm, 1)
}

/// Cases that reload the plan between requests. State is kept per (limit name,
/// algorithm, window length); new `limit`, `rate`, `burst` and `cost` apply to it.
fn reloaded() -> Vec<Case> {
    let mut cases = vec![
        // 2 per 30 days (epoch-aligned: this one ends 1 771 200 s after the steps'
        // time), then 2 per calendar month: another window, so afresh. Then 3 per
        // month: the month's count is kept, exactly one more.
        Case {
            name: "fixed_window: 30d to month starts afresh, a new limit keeps the month",
            plan: one(fixed(2, 30 * DAY), 1),
            reloads: vec![reload(3, one(month(2), 1)), reload(6, one(month(3), 1))],
            steps: vec![
                ok(utc(FEB_10_2027_NOON), 1),
                ok(utc(FEB_10_2027_NOON), 0),
                refused(utc(FEB_10_2027_NOON), 0, 1_771_200 * S),
                ok(utc(FEB_10_2027_NOON), 1),
                ok(utc(FEB_10_2027_NOON), 0),
                // 18.5 days to 2027-03-01.
                refused(utc(FEB_10_2027_NOON), 0, 1_598_400 * S),
                ok(utc(FEB_10_2027_NOON), 0),
                refused(utc(FEB_10_2027_NOON), 0, 1_598_400 * S),
            ],
        },
        // limit 10 per second; 6 taken. Lowered to 5: 6 + 1 > 5, nothing left until
        // the window ends. Raised to 8: exactly 8 - 6 = 2 more.
        Case {
            name: "fixed_window: lowered, then raised mid-window",
            plan: one(fixed(10, S), 1),
            reloads: vec![
                reload(6, one(fixed(5, S), 1)),
                reload(7, one(fixed(8, S), 1)),
            ],
            steps: vec![
                ok(0, 9),
                ok(0, 8),
                ok(0, 7),
                ok(0, 6),
                ok(0, 5),
                ok(0, 4),
                // remaining = max(5 - 6, 0); retry = end of the window.
                refused(100 * MS, 0, 900 * MS),
                // count 7, then 8 of 8.
                ok(200 * MS, 1),
                ok(200 * MS, 0),
                refused(200 * MS, 0, 800 * MS),
                // The next window starts from 0 under the new limit.
                ok(S, 7),
            ],
        },
        // limit 10 per second, 8 taken at 500ms. At 1250ms they weigh 8 * 0.75 = 6.
        Case {
            name: "sliding_window: lowered, then raised; the weighted count carries over",
            plan: one(sliding(10, S), 1),
            reloads: vec![
                reload(8, one(sliding(6, S), 1)),
                reload(10, one(sliding(9, S), 1)),
            ],
            steps: vec![
                ok(500 * MS, 9),
                ok(500 * MS, 8),
                ok(500 * MS, 7),
                ok(500 * MS, 6),
                ok(500 * MS, 5),
                ok(500 * MS, 4),
                ok(500 * MS, 3),
                ok(500 * MS, 2),
                // limit 6: 6 + 1 > 6. Later in this window: free = 6 - 1 - 0 = 5,
                // e' = ceil(1s - 5 * 1s / 8) = 375ms, 125ms from now.
                refused(1_250 * MS, 0, 125 * MS),
                // weight 0.625: 5 + 1 <= 6; floor(6 - 5 - 1) = 0.
                ok(1_375 * MS, 0),
                // limit 9: estimate 5 + 1 = 6, then 7 and 8: floor(9 - 6 - 1) = 2, 1, 0.
                ok(1_375 * MS, 2),
                ok(1_375 * MS, 1),
                ok(1_375 * MS, 0),
                // estimate 9; free = 9 - 1 - 4 = 4, e' = ceil(1s - 4 * 1s / 8) = 500ms.
                refused(1_375 * MS, 0, 125 * MS),
            ],
        },
        // limit 5 per 10s with entries at 0, 1s, 2s. Lowered to 2: two entries must
        // leave (0 and 1s); the second leaves at 11s.
        Case {
            name: "sliding_log: lowered, then raised; the entries carry over",
            plan: one(log(5, 10 * S), 1),
            reloads: vec![
                reload(3, one(log(2, 10 * S), 1)),
                reload(6, one(log(4, 10 * S), 1)),
            ],
            steps: vec![
                ok(0, 4),
                ok(S, 3),
                ok(2 * S, 2),
                // remaining = max(2 - 3, 0); need 3 + 1 - 2 = 2: 1s + 10s - 3s.
                refused(3 * S, 0, 8 * S),
                // The entry at 0 has left; need 1: the one at 1s leaves at 11s.
                refused(10 * S, 0, S),
                // Left: 2s; 1 + 1 <= 2.
                ok(11 * S, 0),
                // limit 4: entries 2s, 11s; 2 + 1 and 3 + 1 <= 4, then the one at 2s
                // must leave (at 12s).
                ok(11 * S, 1),
                ok(11 * S, 0),
                refused(11 * S, 0, S),
            ],
        },
        // 3/s, burst 3: inc = floor(1e6 / 3) = 333_333, two taken, tat 666_666.
        Case {
            name: "gcra: burst lowered, then raised, where N does not divide P",
            plan: one(gcra(3, S, 3), 1),
            reloads: vec![
                reload(2, one(gcra(3, S, 2), 1)),
                reload(4, one(gcra(3, S, 4), 1)),
            ],
            steps: vec![
                ok(0, 2),
                ok(0, 1),
                // avail = floor((3e6 - 666_666 * 3) / 1e6) = 1, used = 2 - 1,
                // tat = floor(1e6 / 3) = 333_333; new tat 666_666, excess 1_999_998 <=
                // 2e6: the one whole token passes (tat rounded up, 333_334, would
                // refuse it).
                ok(0, 0),
                // excess 2_999_997: ceil(999_997 / 3).
                refused(0, 0, 333_333),
                // Burst 4 at 333_333, from the tat set at 0: avail =
                // floor((2e6 - 666_666 * 3) / 1e6) = 0, used 4, tat = floor(4e6 / 3) =
                // 1_333_333; new tat 1_666_666, excess 3_999_999 <= 4e6: the token
                // refilled since 0 passes, no more.
                ok(333_333, 0),
                // Long past the tat: empty; floor((4e6 - 999_999) / 1e6) = 3.
                ok(10 * S, 3),
            ],
        },
        // cost 1, then 3, then 1 of 10 per second: the count carries over.
        Case {
            name: "fixed_window: cost changed",
            plan: one(fixed(10, S), 1),
            reloads: vec![
                reload(3, one(fixed(10, S), 3)),
                reload(6, one(fixed(10, S), 1)),
            ],
            steps: vec![
                ok(0, 9),
                ok(0, 8),
                ok(0, 7),
                ok(0, 4),
                ok(0, 1),
                // 9 + 3 > 10; remaining counts requests of cost 1.
                refused(0, 1, S),
                ok(0, 0),
            ],
        },
        // 10/s, burst 5: two tokens taken at cost 1, then cost 2 of the 3 left.
        Case {
            name: "token_bucket: cost changed",
            plan: one(bucket(10, S, 5), 1),
            reloads: vec![reload(2, one(bucket(10, S, 5), 2))],
            steps: vec![
                ok(0, 4),
                ok(0, 3),
                ok(0, 1),
                // 1e6 - 2e6: ceil(1e6 / 10).
                refused(0, 1, 100 * MS),
                ok(100 * MS, 0),
            ],
        },
        // limit 5 per 10s: an entry of cost 2 keeps its cost under cost 1.
        Case {
            name: "sliding_log: cost changed",
            plan: one(log(5, 10 * S), 2),
            reloads: vec![reload(1, one(log(5, 10 * S), 1))],
            steps: vec![
                ok(0, 3),
                ok(S, 2),
                ok(S, 1),
                ok(S, 0),
                // need 1: the entry at 0 (cost 2) leaves at 10s.
                refused(S, 0, 9 * S),
            ],
        },
        // limit 2 per 10s, then per 20s: another window is another count.
        Case {
            name: "sliding_log: window changed, starts afresh",
            plan: one(log(2, 10 * S), 1),
            reloads: vec![reload(3, one(log(2, 20 * S), 1))],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                refused(S, 0, 9 * S),
                ok(S, 1),
                ok(S, 0),
                // Both entries at 1s leave at 21s.
                refused(S, 0, 20 * S),
            ],
        },
        // Same name, another algorithm: a state of its own; back again, the old one.
        Case {
            name: "fixed_window to sliding_log and back: each keeps its own state",
            plan: one(fixed(2, S), 1),
            reloads: vec![reload(3, one(log(2, S), 1)), reload(6, one(fixed(2, S), 1))],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                refused(100 * MS, 0, 900 * MS),
                ok(100 * MS, 1),
                ok(100 * MS, 0),
                // Both entries at 100ms leave at 1.1s.
                refused(100 * MS, 0, S),
                // The window's count of 2 is still there until 1s.
                refused(200 * MS, 0, 800 * MS),
            ],
        },
        // token_bucket (a hash in Redis) to gcra (a string) and back: 10/s, burst 2.
        Case {
            name: "token_bucket to gcra and back: each keeps its own state",
            plan: one(bucket(10, S, 2), 1),
            reloads: vec![
                reload(3, one(gcra(10, S, 2), 1)),
                reload(5, one(bucket(10, S, 2), 1)),
            ],
            steps: vec![
                ok(0, 1),
                ok(0, 0),
                refused(0, 0, 100 * MS),
                ok(0, 1),
                ok(0, 0),
                // The bucket's level: -1e6 + 50ms * 10 = -5e5 units.
                refused(50 * MS, 0, 50 * MS),
            ],
        },
        // A plan's limits are found by name wherever they stand, and a limit left out
        // of a reload keeps its state until it comes back.
        Case {
            name: "limits reordered, dropped and restored",
            plan: plan(vec![limit("a", fixed(3, S), 1), limit("b", fixed(5, S), 1)]),
            reloads: vec![
                reload(
                    1,
                    plan(vec![limit("b", fixed(5, S), 1), limit("a", fixed(3, S), 1)]),
                ),
                reload(2, plan(vec![limit("b", fixed(5, S), 1)])),
                reload(
                    3,
                    plan(vec![limit("a", fixed(3, S), 1), limit("b", fixed(5, S), 1)]),
                ),
            ],
            steps: vec![
                // a 1 of 3, b 1 of 5: the headline is a's 2.
                ok(0, 2),
                // a 2, b 2.
                ok(0, 1),
                // b alone: 3 of 5.
                ok(0, 2),
                // a 3 of 3 (0 left), b 4.
                ok(0, 0),
                refused(0, 0, S),
            ],
        },
    ];
    // Each pair: token_bucket's state is (level, ts), gcra's (tat, ts), both with the
    // parameters they were written under.
    //
    // 10/s, burst 10, one token = 1e6 units (gcra: inc 100ms, L = 1e7); 4 taken.
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: burst lowered, then raised",
            "gcra: burst lowered, then raised",
        ],
        reject,
        &[(0, (10, S, 10)), (4, (10, S, 3)), (8, (10, S, 5))],
        vec![
            ok(0, 9),
            ok(0, 8),
            ok(0, 7),
            ok(0, 6),
            // Burst 3. bucket: 6e6 units >= C = 3e6, full. gcra: tat 400ms, avail =
            // floor((1e7 - 400ms * 10) / 1e6) = 6, clamped to 3: used 0, tat = 0.
            ok(0, 2),
            ok(0, 1),
            ok(0, 0),
            // ceil(1e6 / 10).
            refused(0, 0, 100 * MS),
            // Burst 5, nothing added. bucket: 0 + 100ms * 10 = 1e6, one token. gcra:
            // avail 0 at 0, used 5, tat = 500ms; new tat 600ms, excess 5e6 <= 5e6.
            ok(100 * MS, 0),
            // Refilled to the new burst: full, 4 after this one.
            ok(600 * MS, 4),
        ],
    ));
    // 10/s, burst 3, drained at 0: full again at 300ms under burst 3 (bucket: 3e6 / 10;
    // gcra: the tat), when its Redis key expires. Under burst 5 it is read as stored
    // until then, and as empty after.
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: raised burst, a state past its old refill time is empty",
            "gcra: raised burst, a state past its old tat is empty",
        ],
        reject,
        &[(0, (10, S, 3)), (3, (10, S, 5))],
        vec![
            ok(0, 2),
            ok(0, 1),
            ok(0, 0),
            // bucket: 50ms * 10 = 5e5 units of 1e6: ceil(5e5 / 10). gcra: avail 0 at 0,
            // used 5, tat = 500ms; new tat 600ms, excess 5.5e6: ceil(5e5 / 10).
            refused(50 * MS, 0, 50 * MS),
            // Past 300ms: a full burst of 5.
            ok(350 * MS, 4),
        ],
    ));
    // 10/s is 1 unit per µs and 1e5 units per token (gcra: inc 100ms, L = 5e5); 5/s is
    // 1 per µs and 2e5 per token (inc 200ms, L = 1e6).
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: rate lowered, whole tokens carry over",
            "gcra: rate lowered, whole tokens carry over",
        ],
        reject,
        &[(0, (1, 100 * MS, 5)), (6, (1, 200 * MS, 5))],
        vec![
            ok(0, 4),
            ok(0, 3),
            ok(0, 2),
            ok(0, 1),
            ok(0, 0),
            // bucket: 1.5e5 refilled, 5e4 (half a token) left at 150ms. gcra: new tat
            // 600ms, excess 4.5e5 <= 5e5.
            ok(150 * MS, 0),
            // 5/s. bucket: floor(5e4 / 1e5) = 0 whole tokens at 150ms; one of 2e5 units
            // takes 200ms. (Half a token kept as 5e4 new units would say 150ms; a fresh
            // bucket would admit.) gcra: avail = floor((5e5 - 4.5e5) / 1e5) = 0 at
            // 150ms, used 5, tat = 150ms + 1s; new tat 1.35s, excess 1.2e6: 2e5 µs.
            refused(150 * MS, 0, 200 * MS),
            ok(350 * MS, 0),
            // -1e5 units / new tat 1.55s: 100ms.
            refused(450 * MS, 0, 100 * MS),
            // Full again: 4 after this one.
            ok(1_350 * MS, 4),
        ],
    ));
    // Drained at 0 under 10/s, burst 2 (bucket: full again at 200ms; gcra: tat 200ms),
    // then 2/s (5e5 units per token, inc 500ms, L = 1e6). Until 200ms it is converted;
    // from then on it is empty, as its key has expired: no more than the old rate
    // gives, and a refusal says so.
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: a converted state expires when the old one would have",
            "gcra: a converted state expires when the old one would have",
        ],
        reject,
        &[(0, (1, 100 * MS, 2)), (2, (1, 500 * MS, 2))],
        vec![
            ok(0, 1),
            ok(0, 0),
            // bucket: 0 whole tokens at 0, 1e5 refilled: ceil(4e5 / 1) = 400ms. gcra:
            // used 2, tat = 1s; new tat 1.5s, excess 1.4e6: 400ms. Both: empty at
            // 200ms, sooner.
            refused(100 * MS, 0, 100 * MS),
            // Empty: 1 left of the burst of 2.
            ok(200 * MS, 1),
        ],
    ));
    // Delay mode, up to 250ms, 10/s then 5/s, burst 2: a booked half token (bucket:
    // level -5e4 of 1e5 per token; gcra: tat 300ms set at 50ms, avail
    // floor((2e5 - 2.5e5) / 1e5)) is floor(-0.5) = -1 token, -2e5 new units.
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: rate lowered with booked delays, floor of a negative level",
            "gcra: rate lowered with booked delays, floor of a negative level",
        ],
        |a| delay_plan(a, 250 * MS),
        &[(0, (1, 100 * MS, 2)), (3, (1, 200 * MS, 2))],
        vec![
            ok(0, 1),
            ok(0, 0),
            // 5e4 refilled, minus 1e5: wait 50ms.
            delayed(50 * MS, 0, 50 * MS),
            // bucket: -2e5 - 2e5 = -4e5; gcra: used 3, tat = 50ms + 600ms, new tat
            // 850ms, excess 8e5 - 4e5: both 400ms > 250ms. (A level rounded towards 0
            // would be a 200ms delay.) Retry: empty at 300ms, when the old state is
            // full.
            refused(50 * MS, 0, 250 * MS),
            // bucket: -2e5 + 150ms * 1 = -5e4, minus 2e5; gcra: new tat 850ms, excess
            // 6.5e5 - 4e5: wait 250ms.
            delayed(200 * MS, 0, 250 * MS),
            // Full again (C = 4e5): 1 left.
            ok(1_450 * MS, 1),
        ],
    ));
    // 10/s to 2/s (5e5 units per token, inc 500ms, L = 2.5e6) and back, each change
    // read at the time of the last admission and later.
    let ten = (1, 100 * MS, 5);
    let two = (1, 500 * MS, 5);
    cases.extend(bucket_and_gcra(
        [
            "token_bucket: rate lowered and raised",
            "gcra: rate lowered and raised",
        ],
        reject,
        &[(0, ten), (4, two), (7, ten)],
        vec![
            ok(0, 4),
            ok(0, 3),
            ok(0, 2),
            // bucket: 2e5 + 5e4 - 1e5 = 1.5e5 units at 50ms. gcra: tat 400ms, excess
            // 350ms * 1 <= 5e5, floor(1.5e5 / 1e5) = 1.
            ok(50 * MS, 1),
            // bucket: floor(1.5e5 / 1e5) = 1 token = 5e5 units, minus one: 0.
            // gcra: avail = floor((5e5 - 350ms * 1) / 1e5) = 1, used 4, tat = 50ms +
            // 4 * 500ms; new tat 2.55s, excess 2.5e6 <= 2.5e6.
            ok(50 * MS, 0),
            // bucket: 0 + 250ms * 1 - 5e5: wait 250ms. gcra: new tat 3.05s, excess
            // 2.75e6: ceil(2.5e5 / 1).
            refused(300 * MS, 0, 250 * MS),
            ok(550 * MS, 0),
            // Back to 10/s at 550ms. bucket: 0 whole tokens, 1e5 missing: 100ms.
            // gcra: avail = floor((2.5e6 - 2.5e6) / 5e5) = 0, used 5, tat = 550ms +
            // 500ms; new tat 1.15s, excess 6e5: ceil(1e5 / 1).
            refused(550 * MS, 0, 100 * MS),
            // Still converted from 550ms: 1e5 refilled at the new rate / new tat 1.15s,
            // excess 5e5.
            ok(650 * MS, 0),
            // Full under 10/s since 1.15s.
            ok(2 * S, 4),
        ],
    ));
    cases
}

/// The pure functions of `algo` as a store for one key: states by limit id, as the
/// memory and the Redis store keep them, so a reloaded plan finds the state of every
/// limit it kept, wherever it now stands in the plan. States are never dropped: one
/// that has expired decides like an empty one.
#[derive(Debug, Default)]
pub struct PureStore {
    states: Vec<(u64, State)>,
}

impl PureStore {
    pub fn check(&mut self, plan: &Plan, now_us: u64) -> Verdict {
        let states: Vec<State> = plan
            .limits
            .iter()
            .map(|l| self.state(l.id).clone())
            .collect();
        let (verdict, new) = decide(plan, &states, now_us);
        for (l, state) in plan.limits.iter().zip(new.into_iter().flatten()) {
            match self.states.iter_mut().find(|(id, _)| *id == l.id) {
                Some(slot) => slot.1 = state,
                None => self.states.push((l.id, state)),
            }
        }
        verdict
    }

    /// `check`, then the charge undone at once where it was made (`Algorithm::refund`,
    /// each limit charged at admission that admitted), as a cluster does when another key refuses.
    pub fn check_refunded(&mut self, plan: &Plan, now_us: u64) -> Verdict {
        let v = self.check(plan, now_us);
        if v.allowed {
            for (l, o) in plan.limits.iter().zip(&v.outcomes) {
                if let (true, Some(slot)) = (
                    o.allowed && l.at_admission(),
                    self.states.iter_mut().find(|(id, _)| *id == l.id),
                ) {
                    l.algorithm.refund(&mut slot.1, now_us, l.cost);
                }
            }
        }
        v
    }

    /// Charges what a response said: each limit of `plan` its `cost`, whatever is
    /// left (`Algorithm::charge_anyway`).
    pub fn charge_response(&mut self, plan: &Plan, now_us: u64) {
        for l in &plan.limits {
            let i = match self.states.iter().position(|(id, _)| *id == l.id) {
                Some(i) => i,
                None => {
                    self.states.push((l.id, State::Empty));
                    self.states.len() - 1
                }
            };
            l.algorithm
                .charge_anyway(&mut self.states[i].1, now_us, l.cost);
        }
    }

    /// `check`, taking `wants[i]` more units for limit i when admitted at once
    /// (`algo::decide_taking`, `reserve`): the verdict and the units taken.
    pub fn take(&mut self, plan: &Plan, now_us: u64, wants: &[u64]) -> (Verdict, Vec<u64>) {
        let states: Vec<State> = plan
            .limits
            .iter()
            .map(|l| self.state(l.id).clone())
            .collect();
        let (verdict, taken, new) = decide_taking(plan, &states, now_us, wants);
        for (l, state) in plan.limits.iter().zip(new.into_iter().flatten()) {
            match self.states.iter_mut().find(|(id, _)| *id == l.id) {
                Some(slot) => slot.1 = state,
                None => self.states.push((l.id, state)),
            }
        }
        (verdict, taken)
    }

    /// Forgets every state, as a Redis that restarted without its data.
    pub fn lose(&mut self) {
        self.states.clear();
    }

    fn state(&self, id: u64) -> &State {
        self.states
            .iter()
            .find(|(i, _)| *i == id)
            .map_or(&EMPTY, |(_, s)| s)
    }
}

/// A small deterministic generator (SplitMix64) for long "random" sequences: the
/// property tests of `algo` and the Redis store's random walks share it.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{ManualClock, MemoryStore};

    #[test]
    fn every_case_passes_on_the_memory_store() {
        let mut failures = Vec::new();
        for case in all() {
            let clock = ManualClock::new(BASE_US);
            let store = MemoryStore::new(100, clock.clone());
            // Every request stays in flight to the end of the case.
            let mut held = Vec::new();
            let result = run(&case, |plan, now| {
                clock.set(now);
                let checked = store.acquire("route", "client", plan);
                held.push(checked.permit);
                checked.verdict
            });
            if let Err(e) = result {
                failures.push(e);
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn every_case_passes_on_the_pure_functions() {
        let mut failures = Vec::new();
        for case in all() {
            let mut store = PureStore::default();
            let result = run(&case, |plan, now| store.check(plan, now));
            if let Err(e) = result {
                failures.push(e);
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn base_is_aligned_to_days() {
        assert_eq!(BASE_US % 86_400_000_000, 0);
        assert_eq!(BASE_US, 1_800_057_600_000_000);
    }

    #[test]
    fn run_reports_the_case_and_step() {
        let case = Case {
            name: "demo",
            plan: one(fixed(1, S), 1),
            reloads: vec![],
            steps: vec![ok(0, 0), ok(0, 0)],
        };
        let clock = ManualClock::new(BASE_US);
        let store = MemoryStore::new(10, clock.clone());
        let err = run(&case, |plan, now| {
            clock.set(now);
            store.check("r", "k", plan)
        })
        .unwrap_err();
        assert!(err.contains("case \"demo\", step 1 (at +0 µs)"), "{err}");
        assert!(err.contains("retry_after_us: 1000000"), "{err}");
    }
}
