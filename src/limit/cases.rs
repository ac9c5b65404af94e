//! One table of rate-limit cases that every store must pass unchanged: each step is a
//! request at a given time and the exact verdict expected. The numbers are worked out
//! by hand from the formulas in `algo`, so the memory store and the Redis store's Lua
//! scripts are both held to the arithmetic, not to each other.

use super::{Algorithm, LimitDef, Mode, Plan, Rate, Verdict};

/// Start of every case: a whole number of days since the epoch (2027-01-13), so every
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
}

#[derive(Debug, Clone, PartialEq)]
pub struct Case {
    pub name: &'static str,
    pub plan: Plan,
    pub steps: Vec<Step>,
}

/// Runs `case` through `check`, which decides one request of the case's plan (for one
/// fixed route and key of a fresh store) at the time it is given.
pub fn run(case: &Case, mut check: impl FnMut(u64) -> Verdict) -> Result<(), String> {
    for (i, step) in case.steps.iter().enumerate() {
        let v = check(BASE_US + step.at_us);
        let got = Step {
            at_us: step.at_us,
            allowed: v.allowed,
            remaining: v.headline().map_or(0, |(_, o)| o.remaining),
            retry_after_us: v.retry_after_us(),
            delay_us: v.delay_us,
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
    }
}

fn delayed(at_us: u64, remaining: u64, delay_us: u64) -> Step {
    Step {
        at_us,
        allowed: true,
        remaining,
        retry_after_us: 0,
        delay_us,
    }
}

fn refused(at_us: u64, remaining: u64, retry_after_us: u64) -> Step {
    Step {
        at_us,
        allowed: false,
        remaining,
        retry_after_us,
        delay_us: 0,
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

/// Every case.
pub fn all() -> Vec<Case> {
    vec![
        // count + cost <= 3 per aligned second; refused until (idx+1)*W.
        Case {
            name: "fixed_window: fill, refuse until the window ends, roll over",
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
            plan: one(fixed(5, 60 * S), 2),
            steps: vec![ok(0, 3), ok(S, 1), refused(2 * S, 1, 58 * S), ok(60 * S, 3)],
        },
        // 8 requests in [0, 1s), then 25% into [1s, 2s): weight 0.75, estimate
        // 8 * 0.75 + curr = 6 + curr; admitted while 6 + curr + 1 <= 10.
        Case {
            name: "sliding_window: previous window weighted across the boundary",
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
            plan: one(bucket(10, S, 5), 2),
            steps: vec![ok(0, 3), ok(0, 1), refused(0, 1, 100 * MS), ok(100 * MS, 0)],
        },
        // 10/s, burst 5: inc = 100ms, L = 5e6; the same admissions as the bucket.
        Case {
            name: "gcra: drain, refill",
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
            let result = run(&case, |now| {
                clock.set(now);
                store.check("route", "client", &case.plan)
            });
            if let Err(e) = result {
                failures.push(e);
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    fn every_case_passes_on_the_pure_functions() {
        for case in all() {
            let mut states = Vec::new();
            let result = run(&case, |now| {
                let (verdict, new) = crate::limit::algo::decide(&case.plan, &states, now);
                if let Some(new) = new {
                    states = new;
                }
                verdict
            });
            if let Err(e) = result {
                panic!("{e}");
            }
        }
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
            steps: vec![ok(0, 0), ok(0, 0)],
        };
        let clock = ManualClock::new(BASE_US);
        let store = MemoryStore::new(10, clock.clone());
        let err = run(&case, |now| {
            clock.set(now);
            store.check("r", "k", &case.plan)
        })
        .unwrap_err();
        assert!(err.contains("case \"demo\", step 1 (at +0 µs)"), "{err}");
        assert!(err.contains("retry_after_us: 1000000"), "{err}");
    }
}
