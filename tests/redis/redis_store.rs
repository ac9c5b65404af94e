//! The Redis store against real `redis-server` processes: the shared table of cases
//! on one server and on a cluster, exactness across gateway instances, script
//! flushes, outages and recovery, skewed clocks, and that refusals write nothing.

use std::time::Duration;

use crate::common::redis::*;
use sluice::limit::algo::{month_of, month_start_us};
use sluice::limit::cases::{self, PureStore, Rng, BASE_US};
use sluice::limit::{
    Algorithm, LimitDef, Mode, Plan, Rate, RedisOptions, RedisStore, RedisTarget, State, StoreError,
};

const S: u64 = 1_000_000;

fn options(target: RedisTarget, refusal_cache: usize) -> RedisOptions {
    RedisOptions {
        target,
        // Generous: these tests run beside a compiler on two cores.
        timeout: Duration::from_secs(2),
        key_prefix: "sluice:".into(),
        refusal_cache,
    }
}

fn one(name: &str, algorithm: Algorithm, cost: u64) -> Plan {
    Plan {
        limits: vec![LimitDef::new(name.into(), algorithm, cost)],
        mode: Mode::Reject,
    }
}

/// A limit charged `units` by every response.
fn response_units(units: u64) -> sluice::limit::FromResponse {
    sluice::limit::FromResponse {
        statuses: None,
        cost: sluice::limit::ResponseCost::Units(units),
    }
}

fn rate(count: u64, per_us: u64) -> Rate {
    Rate { count, per_us }
}

/// Every case of the shared table, each on a fresh key, with `now` driven through
/// the script's ARGV. Returns the number of steps checked.
///
/// A case that fails is run once more, on another fresh key, and fails the test
/// only if it fails again. Time is driven, but Redis expires keys by its own clock:
/// a state written at a window's last microsecond has a TTL of 2 ms (the time left,
/// rounded up, plus 1 ms, right for Redis' clock), so when the next step comes 2 ms
/// later in real time, as it sometimes does on a loaded machine, the key is gone
/// though no driven time passed, and the step is admitted afresh (the "month" case
/// failed so in a full run). A wrong decision fails both runs.
fn run_table(store: &RedisStore, rt: &tokio::runtime::Runtime) -> usize {
    let mut failures = Vec::new();
    let mut steps = 0;
    for (i, case) in cases::all().into_iter().enumerate() {
        steps += case.steps.len();
        let run = |key: String| {
            cases::run(&case, |plan, now| {
                rt.block_on(store.check_at("cases", &key, plan, now))
                    .unwrap_or_else(|e| panic!("case {:?}: {e}", case.name))
            })
        };
        let result = run(format!("case-{i}")).or_else(|first| {
            eprintln!("run again: {first}");
            run(format!("case-{i}-again"))
        });
        if let Err(e) = result {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    steps
}

/// Every case of taking units in advance (`reserve`), each on a fresh key, held to
/// the same numbers as the pure functions (`the_take_cases_pass_in_pure_rust`).
/// `lose` empties the Redis behind `store`.
fn run_takes(store: &RedisStore, rt: &tokio::runtime::Runtime, lose: impl Fn()) -> usize {
    let mut failures = Vec::new();
    let mut steps = 0;
    for (i, case) in cases::takes().into_iter().enumerate() {
        let key = format!("take-{i}");
        steps += case.steps.len();
        let result = cases::run_takes(
            &case,
            |plan, now, wants| {
                rt.block_on(store.take_at("cases", &key, plan, now, wants))
                    .unwrap_or_else(|e| panic!("take case {:?}: {e}", case.name))
            },
            &lose,
        );
        if let Err(e) = result {
            failures.push(e);
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    steps
}

/// A store on `target` with a refusal cache of `refusal_cache` entries (0: none).
fn connect(rt: &tokio::runtime::Runtime, target: RedisTarget, refusal_cache: usize) -> RedisStore {
    rt.block_on(RedisStore::connect(options(target, refusal_cache)))
        .expect("connect to the test Redis")
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}

// === a. the table of cases ===

redis_and_valkey! {
    fn the_table_of_cases_passes_on_one_redis() {
        let redis = RedisServer::start();
        let rt = runtime();
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let steps = run_table(&store, &rt);
        assert!(cases::all().len() >= 15);
        assert!(steps > 100, "{steps}");
    }
}

redis_and_valkey! {
    fn the_take_cases_pass_on_one_redis_and_on_a_cluster() {
        let rt = runtime();
        let redis = RedisServer::start();
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let steps = run_takes(&store, &rt, || {
            let _: () = redis.cmd(&["FLUSHALL"]);
        });
        assert_eq!(
            steps,
            cases::takes().iter().map(|c| c.steps.len()).sum::<usize>()
        );
        assert!(steps >= 25, "{steps}");
        let cluster = RedisCluster::start();
        let store = connect(&rt, RedisTarget::Cluster(cluster.urls()), 0);
        run_takes(&store, &rt, || {
            for node in &cluster.nodes {
                let _: () = node.cmd(&["FLUSHALL"]);
            }
        });
    }
}

#[test]
fn the_table_of_cases_passes_on_a_cluster() {
    let cluster = RedisCluster::start();
    let rt = runtime();
    let store = connect(&rt, RedisTarget::Cluster(cluster.urls()), 0);
    run_table(&store, &rt);
    // The cases' keys are spread over the nodes, each case's keys on one.
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| n.cmd::<Vec<String>>(&["KEYS", "*"]).len())
        .collect();
    assert!(
        per_node.iter().filter(|&&n| n > 0).count() >= 2,
        "{per_node:?}"
    );
}

redis_and_valkey! {
    /// Beyond the table: long random walks decided by the Lua scripts and by the pure
    /// functions in `algo` must agree on every field of every outcome (remaining, reset
    /// and retry included), for awkward parameters: rates that do not divide their
    /// period, day-long windows, large limits that stress the sliding window's doubles,
    /// costs above one, delay mode, and plans of several limits. Every 40 steps or so the
    /// plan is reloaded with other numbers (limit, rate, burst, cost), which keep the
    /// state and convert it; every 5th request or so is refunded at once (a cluster's
    /// refund, `lua/refund.lua` against `Algorithm::refund`).
    fn random_walks_agree_with_the_pure_functions() {
        let redis = RedisServer::start();
        let rt = runtime();
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let day = 86_400 * S;
        let plans = walk_plans();
        let mut admitted = 0;
        let mut reloads = 0;
        let mut refunds = 0;
        let mut responses = 0;
        for (p, first) in plans.iter().enumerate() {
            let mut rng = Rng(p as u64 + 1);
            let mut pure = PureStore::default();
            let mut now = BASE_US + rng.below(day);
            let mut plan = first.clone();
            let key = format!("walk-{p}");
            // Mean gap: about the time one unit takes to come back.
            let gap = comeback_us(&plan) * 2;
            for step in 0..400 {
                if rng.below(3) != 0 {
                    now += rng.below(gap);
                }
                if rng.below(40) == 0 {
                    plan = match rng.below(3) {
                        0 => first.clone(),
                        _ => renumbered(first, &mut rng),
                    };
                    reloads += 1;
                }
                // Now and then what a response said a request cost, charged whatever
                // is left (`Algorithm::charge_anyway`): 0 to 3 units of each limit.
                if rng.below(4) == 0 {
                    let mut charged = plan.clone();
                    for l in &mut charged.limits {
                        l.cost = rng.below(4);
                    }
                    pure.charge_response(&charged, now);
                    let shares = [("walk", key.as_str(), &charged)];
                    rt.block_on(store.charge_response(&shares, Some(now)))
                        .unwrap();
                    responses += 1;
                }
                // Now and then a charge undone at once, as a cluster undoes the keys
                // that admitted a request another key refused (`lua/refund.lua`).
                let (expected, got) = if rng.below(5) == 0 {
                    refunds += 1;
                    let got = store.check_refunded_at("walk", &key, &plan, now);
                    (pure.check_refunded(&plan, now), rt.block_on(got))
                } else {
                    let got = store.check_at("walk", &key, &plan, now);
                    (pure.check(&plan, now), rt.block_on(got))
                };
                let got = got.unwrap();
                assert_eq!(got, expected, "plan {p} step {step} at {now}: {plan:?}");
                admitted += usize::from(got.allowed);
            }
        }
        assert!(admitted > 1_000, "{admitted}");
        assert!(reloads > 50, "{reloads}");
        assert!(refunds > 500, "{refunds}");
        assert!(responses > 500, "{responses}");
    }
}

redis_and_valkey! {
    /// Requests that waited for the same script call are decided in order inside it,
    /// each seeing what the ones before it left; when keys repeat in the call the
    /// script keeps the states it sets (`repeats` in `lua/arith.lua`): a key is read
    /// once and written at most twice per call, not once per request. Six requests on
    /// one key, then, for each plan of the random walks, random groups of one to eight
    /// requests (on one key, now and then on a second one between them, admissions
    /// and refusals mixed) at one time, against the pure functions deciding them one
    /// by one: verdict for verdict.
    fn requests_of_one_key_in_one_call_agree_with_the_pure_functions() {
        let redis = RedisServer::start();
        let rt = runtime();
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let four = one(
            "fw",
            Algorithm::FixedWindow {
                limit: 4,
                window_us: 3_600 * S,
            },
            1,
        );
        let (gets, sets) = (redis.calls("get"), redis.calls("set"));
        let six = [("one", "k", &four); 6];
        let got = rt.block_on(store.check_together_at(&six, BASE_US)).unwrap();
        let mut pure = PureStore::default();
        let want: Vec<_> = six.iter().map(|_| pure.check(&four, BASE_US)).collect();
        assert_eq!(got, want);
        let allowed: Vec<bool> = got.iter().map(|v| v.allowed).collect();
        assert_eq!(allowed, [true, true, true, true, false, false]);
        // Read once; written when first set, and once more as the last admitted left it.
        assert_eq!((redis.calls("get") - gets, redis.calls("set") - sets), (1, 2));
        let stored: String = redis.cmd(&["GET", &store.keys("one", "k", &four)[0]]);
        assert_eq!(stored.split(' ').nth(1), Some("4"), "{stored}");

        let plans = walk_plans();
        let (mut admitted, mut refused, mut calls) = (0, 0, 0);
        for (p, plan) in plans.iter().enumerate() {
            let mut rng = Rng(p as u64 + 101);
            let mut pure = [PureStore::default(), PureStore::default()];
            let keys = [format!("a-{p}"), format!("b-{p}")];
            let mut now = BASE_US + rng.below(86_400 * S);
            let gap = comeback_us(plan) * 3;
            for step in 0..150 {
                if rng.below(3) != 0 {
                    now += rng.below(gap);
                }
                let which: Vec<usize> = (0..1 + rng.below(8))
                    .map(|_| usize::from(rng.below(5) == 0))
                    .collect();
                let requests: Vec<(&str, &str, &Plan)> = which
                    .iter()
                    .map(|&w| ("together", keys[w].as_str(), plan))
                    .collect();
                let got = rt
                    .block_on(store.check_together_at(&requests, now))
                    .unwrap();
                let want: Vec<_> = which.iter().map(|&w| pure[w].check(plan, now)).collect();
                assert_eq!(got, want, "plan {p} step {step} at {now}: {which:?}");
                admitted += got.iter().filter(|v| v.allowed).count();
                refused += got.iter().filter(|v| !v.allowed).count();
                calls += 1;
            }
        }
        assert_eq!(calls, plans.len() * 150);
        assert!(admitted > 1_000 && refused > 1_000, "{admitted} {refused}");
    }
}

/// The plans the random walks go through: every algorithm, awkward parameters
/// (rates that do not divide their period, day-long windows, large limits, costs
/// above one), delay mode, limits charged from the response, and plans of several
/// limits.
fn walk_plans() -> Vec<Plan> {
    let day = 86_400 * S;
    vec![
        one(
            "fw",
            Algorithm::FixedWindow {
                limit: 7,
                window_us: 3 * S,
            },
            1,
        ),
        one(
            "fw",
            Algorithm::FixedWindow {
                limit: 1_000_000,
                window_us: day,
            },
            4_999,
        ),
        one(
            "sw",
            Algorithm::SlidingWindow {
                limit: 10,
                window_us: S,
            },
            1,
        ),
        one(
            "sw",
            Algorithm::SlidingWindow {
                limit: 9,
                window_us: 7 * S,
            },
            2,
        ),
        one(
            "sw",
            Algorithm::SlidingWindow {
                limit: 3_000_000,
                window_us: day,
            },
            40_001,
        ),
        // Across months: the refunds and the response charges of a calendar month.
        one("mo", Algorithm::CalendarMonth { limit: 40 }, 1),
        one(
            "sl",
            Algorithm::SlidingLog {
                limit: 5,
                window_us: S,
            },
            1,
        ),
        one(
            "sl",
            Algorithm::SlidingLog {
                limit: 9,
                window_us: 3 * S,
            },
            2,
        ),
        one(
            "tb",
            Algorithm::TokenBucket {
                rate: rate(3, S),
                burst: 4,
            },
            1,
        ),
        one(
            "tb",
            Algorithm::TokenBucket {
                rate: rate(7, 13 * S),
                burst: 9,
            },
            2,
        ),
        one(
            "gc",
            Algorithm::Gcra {
                rate: rate(3, S),
                burst: 4,
            },
            1,
        ),
        one(
            "gc",
            Algorithm::Gcra {
                rate: rate(7, 13 * S),
                burst: 9,
            },
            2,
        ),
        Plan {
            limits: vec![
                LimitDef::new(
                    "tb".into(),
                    Algorithm::TokenBucket {
                        rate: rate(10, S),
                        burst: 3,
                    },
                    1,
                ),
                LimitDef::new(
                    "gc".into(),
                    Algorithm::Gcra {
                        rate: rate(3, S),
                        burst: 5,
                    },
                    1,
                ),
            ],
            mode: Mode::Delay {
                max_delay_us: 450_000,
            },
        },
        // Limits charged from the response: checked for their cost before, and
        // charged only by the responses' charges above.
        Plan {
            limits: vec![
                LimitDef::new(
                    "fw".into(),
                    Algorithm::FixedWindow {
                        limit: 6,
                        window_us: 2 * S,
                    },
                    1,
                )
                .from_response(response_units(1)),
                LimitDef::new(
                    "tb".into(),
                    Algorithm::TokenBucket {
                        rate: rate(3, S),
                        burst: 5,
                    },
                    1,
                )
                .from_response(response_units(1)),
                LimitDef::new(
                    "sl".into(),
                    Algorithm::SlidingLog {
                        limit: 4,
                        window_us: S,
                    },
                    1,
                ),
            ],
            mode: Mode::Reject,
        },
        Plan {
            limits: vec![
                LimitDef::new(
                    "fw".into(),
                    Algorithm::FixedWindow {
                        limit: 5,
                        window_us: S,
                    },
                    1,
                ),
                LimitDef::new(
                    "sw".into(),
                    Algorithm::SlidingWindow {
                        limit: 8,
                        window_us: 2 * S,
                    },
                    1,
                ),
                LimitDef::new(
                    "sl".into(),
                    Algorithm::SlidingLog {
                        limit: 6,
                        window_us: 2 * S,
                    },
                    1,
                ),
            ],
            mode: Mode::Reject,
        },
    ]
}

/// `plan` with other numbers (limit, rate, burst, cost, each between about half and
/// twice the original) and the same names, algorithms and windows: a reload that
/// keeps every limit's state.
fn renumbered(plan: &Plan, rng: &mut Rng) -> Plan {
    let mut about = |x: u64| x / 2 + 1 + rng.below(x + x / 2 + 1);
    let limits = plan
        .limits
        .iter()
        .map(|l| {
            let algorithm = match l.algorithm {
                Algorithm::FixedWindow { limit, window_us } => Algorithm::FixedWindow {
                    limit: about(limit),
                    window_us,
                },
                Algorithm::CalendarMonth { limit } => Algorithm::CalendarMonth {
                    limit: about(limit),
                },
                Algorithm::SlidingWindow { limit, window_us } => Algorithm::SlidingWindow {
                    limit: about(limit),
                    window_us,
                },
                Algorithm::SlidingLog { limit, window_us } => Algorithm::SlidingLog {
                    limit: about(limit),
                    window_us,
                },
                Algorithm::TokenBucket { rate: r, burst } => Algorithm::TokenBucket {
                    rate: rate(about(r.count), about(r.per_us).max(r.count * 2)),
                    burst: about(burst),
                },
                Algorithm::Gcra { rate: r, burst } => Algorithm::Gcra {
                    rate: rate(about(r.count), about(r.per_us).max(r.count * 2)),
                    burst: about(burst),
                },
                Algorithm::Concurrency { limit, lease_us } => Algorithm::Concurrency {
                    limit: about(limit),
                    lease_us,
                },
            };
            LimitDef::new(l.name.clone(), algorithm, about(l.cost).min(l.cost + 1))
        })
        .collect();
    Plan {
        limits,
        mode: plan.mode,
    }
}

/// token_bucket and gcra states written under other parameters, at the edges of what
/// the conversion keeps exact in Lua's doubles (levels and debts up to 2^50 units,
/// periods of a microsecond to a day), written straight into Redis and decided by the
/// script and by `algo`.
#[test]
fn converted_states_agree_state_by_state() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
    let mut conn = redis.connection().unwrap();
    let mut rng = Rng(2027);
    let top = 1u64 << 50;
    // (count, per_us, burst) with count <= per_us and burst * per_us <= 2^50.
    let params = |rng: &mut Rng| {
        let per_us = match rng.below(4) {
            0 => 1 + rng.below(10),
            1 => 1 + rng.below(10 * S),
            2 => 86_400 * S - rng.below(1_000),
            _ => S,
        };
        let count = 1 + rng.below(per_us.min(1_000));
        let burst = match rng.below(3) {
            0 => top / per_us,
            _ => 1 + rng.below((top / per_us).min(50)),
        };
        (count, per_us, burst)
    };
    let mut checked = 0;
    for i in 0..2_000 {
        let (n0, p0, b0) = params(&mut rng);
        let (n, p, burst) = params(&mut rng);
        let (r0, r) = (rate(n0, p0), rate(n, p));
        let now = BASE_US + rng.below(86_400 * S);
        let cost = 1 + rng.below(3);
        let max_delay = [0, 250_000, 60 * S][rng.below(3) as usize];
        let mode = match max_delay {
            0 => Mode::Reject,
            d => Mode::Delay { max_delay_us: d },
        };
        let cap0 = b0 * p0;
        // bucket: a level from 2^50 units owed to full, counted up to twice its refill
        // time ago (so sometimes already full under the old parameters).
        let tokens = match rng.below(4) {
            0 => -(top as i64),
            1 => cap0 as i64,
            _ => rng.below(cap0 + top) as i64 - top as i64,
        };
        let refill = (cap0 as i64 - tokens) as u64 / n0;
        let ts = now - rng.below(2 * refill.min(86_400 * S) + 1);
        // gcra: a tat up to 2^50 units of debt ahead of when it was set, at most that
        // far in the future, or a little in the past.
        let ahead = match rng.below(3) {
            0 => (cap0 + top) / n0,
            _ => rng.below((cap0 + top) / n0 + 1),
        };
        let tat = match rng.below(4) {
            0 => now - rng.below(S),
            _ => now + rng.below(ahead + 1),
        };
        let ahead = ahead.min(tat);
        for (name, algorithm, state) in [
            (
                "tb",
                Algorithm::TokenBucket { rate: r, burst },
                State::Bucket {
                    tokens,
                    ts,
                    rate: r0,
                    burst: b0,
                },
            ),
            (
                "gc",
                Algorithm::Gcra { rate: r, burst },
                State::Gcra {
                    tat,
                    ts: tat - ahead,
                    rate: r0,
                    burst: b0,
                },
            ),
        ] {
            let plan = Plan {
                limits: vec![LimitDef::new(name.into(), algorithm, cost)],
                mode,
            };
            let key = store.keys("conv", "k", &plan).remove(0);
            let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
            let value = match state {
                State::Bucket { .. } => format!("{tokens} {ts} {n0} {p0} {b0}"),
                _ => format!("{tat} {ahead} {n0} {p0} {b0}"),
            };
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(value)
                .query(&mut conn)
                .unwrap();
            let got = rt
                .block_on(store.check_at("conv", "k", &plan, now))
                .unwrap();
            let (expected, _) = algorithm.check(&state, now, cost, max_delay);
            assert_eq!(
                got.outcomes[0], expected,
                "{i}: {state:?} read as {algorithm:?} at {now}, cost {cost}, delay {max_delay}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 4_000);
}

/// About the time a request's cost takes to come back under `plan`'s slowest limit.
fn comeback_us(plan: &Plan) -> u64 {
    plan.limits
        .iter()
        .map(|l| unit_us(&l.algorithm) * l.cost)
        .max()
        .unwrap_or(S)
}

/// How long one unit of a limit takes to come back, roughly.
fn unit_us(a: &Algorithm) -> u64 {
    match *a {
        Algorithm::FixedWindow { limit, window_us }
        | Algorithm::SlidingWindow { limit, window_us }
        | Algorithm::SlidingLog { limit, window_us } => (window_us / limit.max(1)).max(1),
        Algorithm::TokenBucket { rate, .. } | Algorithm::Gcra { rate, .. } => {
            (rate.per_us / rate.count.max(1)).max(1)
        }
        Algorithm::CalendarMonth { limit } => (31 * 86_400 * S / limit.max(1)).max(1),
        Algorithm::Concurrency { lease_us, .. } => lease_us,
    }
}

/// The script's calendar arithmetic (`lua/fixed_window.lua`) against `algo`'s: the
/// first µs of every month from 1970 to 2200 and the last of the month before, and
/// random times up to 2250 (times stay below 2^53 µs, exact in Lua's doubles), each
/// decided on a state of the month before and of the month itself.
#[test]
fn calendar_months_agree_with_algo() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
    let mut conn = redis.connection().unwrap();
    let algorithm = Algorithm::CalendarMonth { limit: 3 };
    let plan = one("month", algorithm, 1);
    let key = store.keys("month", "k", &plan).remove(0);
    let mut times = Vec::new();
    for idx in 1..(2200 - 1970) * 12 {
        let first = month_start_us(idx);
        times.extend([first, first - 1]);
    }
    let mut rng = Rng(11);
    let end = month_start_us((2250 - 1970) * 12);
    times.extend((0..2_000).map(|_| rng.below(end)));
    for &now in &times {
        let idx = month_of(now);
        for state_idx in [idx.saturating_sub(1), idx] {
            let state = State::Window {
                idx: state_idx,
                count: 2,
            };
            let _: () = redis::cmd("SET")
                .arg(&key)
                .arg(format!("{state_idx} 2"))
                .query(&mut conn)
                .unwrap();
            let got = rt
                .block_on(store.check_at("month", "k", &plan, now))
                .unwrap();
            let (expected, _) = algorithm.check(&state, now, 1, 0);
            assert_eq!(
                got.outcomes[0], expected,
                "at {now}, state of month {state_idx}"
            );
        }
    }
    assert_eq!(times.len(), 2 * ((2200 - 1970) * 12 - 1) + 2_000);

    // The key expires when its month ends: 2027-02-10T12:00:00Z is 18.5 days before
    // March (the TTL is rounded up to a ms, plus 1 ms).
    let _: () = redis::cmd("DEL").arg(&key).query(&mut conn).unwrap();
    let v = rt
        .block_on(store.check_at("month", "k", &plan, 1_802_260_800 * S))
        .unwrap();
    assert!(v.allowed);
    let ttl: u64 = redis::cmd("PTTL").arg(&key).query(&mut conn).unwrap();
    let full = 1_598_400_000 + 1;
    assert!(ttl <= full && ttl > full - 10_000, "{ttl}");
}

/// The sliding window's doubles, state by state: every (prev, curr) up to the limit
/// at two offsets into windows whose divisions are inexact, written straight into
/// Redis and decided by the script and by `algo`. Among these states are some where
/// computing `free * w / prev` in another order changes the retry time.
#[test]
fn sliding_window_doubles_agree_state_by_state() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
    let mut conn = redis.connection().unwrap();
    let mut checked = 0;
    for w in [11 * S, 60 * S, 86_400 * S] {
        for limit in [7, 13, 29] {
            let algorithm = Algorithm::SlidingWindow {
                limit,
                window_us: w,
            };
            let plan = one("sw", algorithm, 1);
            let key = store.keys("sw", "k", &plan).remove(0);
            let idx = BASE_US / w + 1;
            for e in [1, w / 3] {
                let now = idx * w + e;
                for prev in 1..30u64 {
                    for curr in 0..=limit {
                        let state = State::Sliding { idx, prev, curr };
                        let _: () = redis::cmd("SET")
                            .arg(&key)
                            .arg(format!("{idx} {prev} {curr}"))
                            .query(&mut conn)
                            .unwrap();
                        let got = rt.block_on(store.check_at("sw", "k", &plan, now)).unwrap();
                        let (expected, _) = algorithm.check(&state, now, 1, 0);
                        assert_eq!(
                            got.outcomes[0], expected,
                            "w {w} limit {limit} e {e} prev {prev} curr {curr}"
                        );
                        checked += 1;
                    }
                }
            }
        }
    }
    assert_eq!(checked, 3 * 2 * 29 * (8 + 14 + 30));
}

/// The exact integer division the scripts use, at the edge of doubles' precision.
#[test]
fn lua_integer_division_is_exact_up_to_2_pow_53() {
    let redis = RedisServer::start();
    let mut conn = redis.connection().unwrap();
    let script = redis::Script::new(concat!(
        include_str!("../../lua/arith.lua"),
        "\nlocal a, b = tonumber(ARGV[1]), tonumber(ARGV[2])\n",
        "return {int(floor_div(a, b)), int(ceil_div(a, b)), int(floor_div_signed(-a, b))}\n"
    ));
    let top = (1u64 << 53) - 1;
    let mut checked = 0;
    for b in [
        1u64,
        2,
        3,
        7,
        10,
        1_000,
        999_999,
        1_000_003,
        86_400_000_000,
        (1 << 26) + 1,
        top / 3,
        top,
    ] {
        for a in [
            0u64,
            1,
            b - 1,
            b,
            b + 1,
            top,
            top - 1,
            top - b,
            top / b * b,
            top / b * b - 1,
            1_800_057_600_000_000,
        ] {
            let (f, c, neg): (String, String, String) =
                script.arg(a).arg(b).invoke(&mut conn).unwrap();
            assert_eq!(f, (a / b).to_string(), "floor {a} / {b}");
            assert_eq!(c, a.div_ceil(b).to_string(), "ceil {a} / {b}");
            let floor_neg = (-(a as i64)).div_euclid(b as i64);
            assert_eq!(neg, floor_neg.to_string(), "floor -{a} / {b}");
            checked += 1;
        }
    }
    assert_eq!(checked, 12 * 11);
}

// === g. a refused request writes nothing ===

/// A counter of `INFO <section>`.
fn info(redis: &RedisServer, section: &str, field: &str) -> u64 {
    let info: String = redis.cmd(&["INFO", section]);
    info.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{field} in INFO {section}"))
}

/// Writes Redis has counted since start (`rdb_changes_since_last_save`: every key
/// change, expiry updates included; persistence is off, so it never resets).
fn writes(redis: &RedisServer) -> u64 {
    info(redis, "persistence", "rdb_changes_since_last_save")
}

redis_and_valkey! {
    fn a_refused_request_writes_nothing() {
        let redis = RedisServer::start();
        let rt = runtime();
        // No refusal cache: every refused request below reaches the script.
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let hour = 3_600 * S;
        let plans = [
            one(
                "fw",
                Algorithm::FixedWindow {
                    limit: 3,
                    window_us: hour,
                },
                1,
            ),
            one(
                "sw",
                Algorithm::SlidingWindow {
                    limit: 3,
                    window_us: hour,
                },
                1,
            ),
            one(
                "sl",
                Algorithm::SlidingLog {
                    limit: 3,
                    window_us: hour,
                },
                1,
            ),
            one(
                "tb",
                Algorithm::TokenBucket {
                    rate: rate(3, hour),
                    burst: 3,
                },
                1,
            ),
            one(
                "gc",
                Algorithm::Gcra {
                    rate: rate(3, hour),
                    burst: 3,
                },
                1,
            ),
            // The first limit would admit; the second refuses; neither is charged.
            Plan {
                limits: vec![
                    LimitDef::new(
                        "wide".into(),
                        Algorithm::SlidingLog {
                            limit: 100,
                            window_us: hour,
                        },
                        1,
                    ),
                    LimitDef::new(
                        "narrow".into(),
                        Algorithm::FixedWindow {
                            limit: 3,
                            window_us: hour,
                        },
                        1,
                    ),
                ],
                mode: Mode::Reject,
            },
        ];
        for (p, plan) in plans.iter().enumerate() {
            let key = format!("k{p}");
            let check = || rt.block_on(store.check("g", &key, plan)).unwrap();
            let before = writes(&redis);
            for _ in 0..3 {
                assert!(check().allowed, "plan {p}");
            }
            // Admissions do write (so the counter can see writes at all): at least once
            // per limit (a string state and its TTL are one `SET ... PX`).
            assert!(
                writes(&redis) >= before + 3 * plan.limits.len() as u64,
                "plan {p}"
            );

            let keys = store.keys("g", &key, plan);
            let snapshot = || {
                let mut c = redis.connection().unwrap();
                keys.iter()
                    .map(|k| {
                        let dump: Vec<u8> = redis::cmd("DUMP").arg(k).query(&mut c).unwrap();
                        let ttl: i64 = redis::cmd("PTTL").arg(k).query(&mut c).unwrap();
                        assert!(!dump.is_empty() && ttl > 0, "plan {p}: {k}");
                        (dump, ttl)
                    })
                    .collect::<Vec<_>>()
            };
            let (held, w0) = (snapshot(), writes(&redis));
            for _ in 0..5 {
                let v = check();
                assert!(!v.allowed && v.retry_after_us() > 0, "plan {p}: {v:?}");
            }
            assert_eq!(writes(&redis), w0, "plan {p}: a refused request wrote");
            for ((dump, ttl), (dump0, ttl0)) in snapshot().into_iter().zip(held) {
                assert_eq!(dump, dump0, "plan {p}: state changed");
                assert!(ttl <= ttl0, "plan {p}: expiry pushed from {ttl0} to {ttl}");
            }
        }
        // The wide limit holds the three admitted requests, not the refused ones.
        assert_eq!(
            redis.cmd::<i64>(&["ZCARD", &store.keys("g", "k5", &plans[5])[0]]),
            3
        );
    }
}

// === the refusal cache ===

redis_and_valkey! {
    fn refusals_are_answered_locally_until_their_retry_time() {
        let mut redis = RedisServer::start();
        let rt = runtime();
        let store = rt
            .block_on(RedisStore::connect(RedisOptions {
                timeout: Duration::from_millis(200),
                ..options(RedisTarget::Url(redis.url()), 1_000)
            }))
            .unwrap();
        let plan = one(
            "log",
            Algorithm::SlidingLog {
                limit: 2,
                window_us: 1_500_000,
            },
            1,
        );
        let check = |key: &str| rt.block_on(store.check("r", key, &plan));
        assert!(check("a").unwrap().allowed);
        assert!(check("a").unwrap().allowed);
        let t0 = std::time::Instant::now();
        let first = check("a").unwrap();
        assert!(!first.allowed);
        let retry = first.retry_after_us();
        assert!((1_000_000..=1_500_000).contains(&retry), "{retry}");

        // Answered without a call: Redis sees no EVALSHA, and the retry time counts down.
        let evals = redis.calls("evalsha");
        std::thread::sleep(Duration::from_millis(100));
        let cached = check("a").unwrap();
        assert!(!cached.allowed);
        assert!(
            cached.retry_after_us() <= retry - 100_000,
            "{} vs {retry}",
            cached.retry_after_us()
        );
        assert_eq!(cached.outcomes[0].remaining, 0);
        assert_eq!(redis.calls("evalsha"), evals);

        // Even with Redis gone the refusal holds (it is exact); other keys get the error.
        redis.kill();
        assert!(!check("a").unwrap().allowed);
        assert!(check("b").is_err());
        // After the retry time the cache lets go and the store's error shows.
        std::thread::sleep(
            Duration::from_micros(retry).saturating_sub(t0.elapsed()) + Duration::from_millis(50),
        );
        assert!(check("a").is_err());
    }
}

// === memory per tracked key (the numbers of docs/redis-and-fleets.md) ===

/// Prints `MEMORY USAGE` of one tracked key per algorithm, with a realistic key
/// (`sluice:{api:203.0.113.7}:<limit id>`). Run with `--nocapture` to see them.
#[test]
fn memory_usage_per_tracked_key() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
    let minute = 60 * S;
    let cases: [(&str, Algorithm, u64); 8] = [
        (
            "fixed_window",
            Algorithm::FixedWindow {
                limit: 100,
                window_us: minute,
            },
            1,
        ),
        (
            "sliding_window",
            Algorithm::SlidingWindow {
                limit: 100,
                window_us: minute,
            },
            1,
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 100,
                window_us: minute,
            },
            1,
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 100,
                window_us: minute,
            },
            10,
        ),
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 100,
                window_us: minute,
            },
            100,
        ),
        // Past 128 members a sorted set leaves the compact listpack encoding.
        (
            "sliding_log",
            Algorithm::SlidingLog {
                limit: 1000,
                window_us: minute,
            },
            200,
        ),
        (
            "token_bucket",
            Algorithm::TokenBucket {
                rate: rate(1, 100_000),
                burst: 20,
            },
            1,
        ),
        (
            "gcra",
            Algorithm::Gcra {
                rate: rate(1, 100_000),
                burst: 20,
            },
            1,
        ),
    ];
    let mut c = redis.connection().unwrap();
    eprintln!(
        "MEMORY USAGE (bytes) of one key like sluice:{{api:203.0.113.7}}:<11 base64url digits>"
    );
    for (algorithm, a, requests) in cases {
        let plan = one("per_client", a, 1);
        let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
        for _ in 0..requests {
            assert!(
                rt.block_on(store.check("api", "203.0.113.7", &plan))
                    .unwrap()
                    .allowed
            );
        }
        let key = store.keys("api", "203.0.113.7", &plan).remove(0);
        let bytes: u64 = redis::cmd("MEMORY")
            .arg("USAGE")
            .arg(&key)
            .arg("SAMPLES")
            .arg(0)
            .query(&mut c)
            .unwrap();
        eprintln!("  {algorithm:<15} after {requests:>3} request(s): {bytes:>5}");
        assert!(bytes < 200 * requests + 200, "{algorithm}: {bytes}");
    }
}

redis_and_valkey! {
    /// In delay mode a refusal with retry R turns into a delayed admission once the
    /// wait is down to max_delay: the cache answers only until R - max_delay.
    fn delay_mode_refusals_are_held_until_the_wait_fits() {
        let redis = RedisServer::start();
        let rt = runtime();
        let store = connect(&rt, RedisTarget::Url(redis.url()), 1_000);
        let plan = Plan {
            limits: vec![LimitDef::new(
                "gc".into(),
                Algorithm::Gcra {
                    rate: rate(1, S),
                    burst: 1,
                },
                1,
            )],
            mode: Mode::Delay { max_delay_us: S },
        };
        let check = || rt.block_on(store.check("d", "k", &plan)).unwrap();
        let t0 = std::time::Instant::now();
        assert_eq!((check().allowed, check().allowed), (true, true)); // the second waits ~1 s
        let refused = check();
        assert!(!refused.allowed);
        let retry = refused.retry_after_us();
        assert!((1_500_000..=2 * S).contains(&retry), "{retry}");

        std::thread::sleep(Duration::from_millis(300));
        let evals = redis.calls("evalsha");
        assert!(!check().allowed, "held while the wait exceeds max_delay");
        assert_eq!(redis.calls("evalsha"), evals);

        // Past R - max_delay: Redis is asked and books a wait of at most max_delay.
        std::thread::sleep(
            Duration::from_micros(retry - S).saturating_sub(t0.elapsed()) + Duration::from_millis(100),
        );
        let v = check();
        assert!(v.allowed && v.delay_us > 0 && v.delay_us <= S, "{v:?}");
        assert_eq!(redis.calls("evalsha"), evals + 1);
    }
}

// === i. requests waiting for a shared script call ===

/// From now until `CLIENT UNPAUSE`, Redis reads script calls but holds them (other
/// commands answer). Returns the bytes it has read so far.
fn hold_scripts(redis: &RedisServer) -> u64 {
    let _: String = redis.cmd(&["CLIENT", "PAUSE", "10000", "WRITE"]);
    info(redis, "stats", "total_net_input_bytes")
}

/// Waits until Redis has read a script call sent after it had read `before` bytes
/// (while paused it reads calls and holds them; a PING is 14 bytes).
async fn call_reached(redis: &RedisServer, before: u64) {
    let mut polls = 0;
    while info(redis, "stats", "total_net_input_bytes") < before + 100 {
        polls += 1;
        assert!(polls < 200, "the call never reached Redis");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A request whose caller stopped waiting (a client that left) before its shared
/// call went out is left out of that call: Redis never decides it, so it charges
/// nothing.
#[test]
fn a_request_that_stopped_waiting_is_not_sent() {
    let redis = RedisServer::start();
    let rt = runtime();
    let store = rt
        .block_on(RedisStore::connect(RedisOptions {
            target: RedisTarget::Url(redis.url()),
            timeout: Duration::from_millis(300),
            key_prefix: "sluice:".into(),
            refusal_cache: 0,
        }))
        .expect("connect to the test Redis");
    let plan = one(
        "fw",
        Algorithm::FixedWindow {
            limit: 100,
            window_us: 3_600 * S,
        },
        1,
    );
    assert!(
        rt.block_on(store.check("q", "warm", &plan))
            .unwrap()
            .allowed
    );

    let before = hold_scripts(&redis);
    let first = {
        let (store, plan) = (store.clone(), plan.clone());
        rt.spawn(async move { store.check("q", "first", &plan).await })
    };
    rt.block_on(call_reached(&redis, before));
    // Ten more queue behind it, and their callers give up after 50 ms, while the
    // first call is still out (its timeout is 300 ms).
    let waiting: Vec<_> = (0..10)
        .map(|i| {
            let (store, plan) = (store.clone(), plan.clone());
            rt.spawn(async move {
                let key = format!("late-{i}");
                tokio::time::timeout(Duration::from_millis(50), store.check("q", &key, &plan)).await
            })
        })
        .collect();
    for w in waiting {
        assert!(rt.block_on(w).unwrap().is_err(), "the caller gave up");
    }
    let r = rt.block_on(first).unwrap();
    assert!(matches!(r, Err(StoreError::Timeout)), "{r:?}");

    // Redis runs what it holds; then one more request: any call for the ten would
    // have gone out before it.
    let _: String = redis.cmd(&["CLIENT", "UNPAUSE"]);
    assert!(
        rt.block_on(store.check("q", "after", &plan))
            .unwrap()
            .allowed
    );
    let mut keys: Vec<String> = redis.cmd(&["KEYS", "sluice:*"]);
    keys.sort();
    let names: Vec<&str> = keys
        .iter()
        .map(|k| k.split(['{', '}']).nth(1).unwrap())
        .collect();
    // The call that was out ran when the pause ended; the ten were never sent.
    assert_eq!(names, ["q:after", "q:first", "q:warm"]);
}

redis_and_valkey! {
    /// Requests of different routes and limits decided by one call each get their own
    /// keys and limits: two plans, interleaved, queued behind a call Redis holds.
    fn one_call_decides_requests_of_different_plans_apart() {
        let redis = RedisServer::start();
        // One thread: a spawned request runs only while the test waits on the runtime.
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let store = connect(&rt, RedisTarget::Url(redis.url()), 0);
        let hour = 3_600 * S;
        let two_limits = Plan {
            limits: vec![
                LimitDef::new(
                    "fw".into(),
                    Algorithm::FixedWindow {
                        limit: 2,
                        window_us: hour,
                    },
                    1,
                ),
                LimitDef::new(
                    "gc".into(),
                    Algorithm::Gcra {
                        rate: rate(10, S),
                        burst: 5,
                    },
                    1,
                ),
            ],
            mode: Mode::Reject,
        };
        let one_limit = one(
            "fw",
            Algorithm::FixedWindow {
                limit: 5,
                window_us: hour,
            },
            1,
        );
        assert!(
            rt.block_on(store.check("a", "warm", &one_limit))
                .unwrap()
                .allowed
        );

        let before = hold_scripts(&redis);
        let calls = redis.calls("evalsha");
        let first = {
            let (store, plan) = (store.clone(), one_limit.clone());
            rt.spawn(async move { store.check("b", "w", &plan).await })
        };
        rt.block_on(call_reached(&redis, before));
        let queued: Vec<_> = (0..6)
            .map(|i| {
                let store = store.clone();
                let (ns, key, plan) = if i % 2 == 0 {
                    ("a", "x", two_limits.clone())
                } else {
                    ("b", "y", one_limit.clone())
                };
                rt.spawn(async move { (key, store.check(ns, key, &plan).await) })
            })
            .collect();
        // Each queues behind the first call at its first poll; then Redis goes on.
        rt.block_on(async {
            for _ in 0..10 {
                tokio::task::yield_now().await;
            }
        });
        let _: String = redis.cmd(&["CLIENT", "UNPAUSE"]);
        assert!(rt.block_on(first).unwrap().unwrap().allowed);
        let mut x = Vec::new();
        let mut y = Vec::new();
        for q in queued {
            let (key, v) = rt.block_on(q).unwrap();
            let v = v.unwrap();
            let seen = (
                v.allowed,
                v.outcomes.iter().map(|o| o.remaining).collect::<Vec<_>>(),
            );
            if key == "x" {
                x.push(seen)
            } else {
                y.push(seen)
            }
        }
        x.sort();
        y.sort();
        // x: the fixed window (2) binds (the refused one's gcra outcome is what it would
        // have left had it been admitted); y: 5 per hour.
        assert_eq!(
            x,
            [(false, vec![0, 2]), (true, vec![0, 3]), (true, vec![1, 4])]
        );
        assert_eq!(y, [(true, vec![2]), (true, vec![3]), (true, vec![4])]);
        assert_eq!(
            redis.calls("evalsha") - calls,
            2,
            "the first call, then the six together"
        );
    }
}
