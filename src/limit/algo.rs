//! The five rate-limit algorithms as pure functions of (state, now). Time is in
//! microseconds since the UNIX epoch; all arithmetic is integer except the sliding
//! window's weighting, which is done in f64 in exactly the order the Lua script
//! uses, so both stores reach bit-identical decisions.
//!
//! State is kept across reloads that change a limit's numbers (`limit`, `rate`,
//! `burst`, `cost`): the window algorithms apply the new limit to the counts as they
//! are; token_bucket and gcra store the parameters their state was written under and
//! convert it when they differ (`bucket_level`, `gcra_tat`).

use std::collections::VecDeque;

use super::{LimitDef, Outcomes, Plan, Verdict};

/// `count` tokens (requests) per `per_us` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    pub count: u64,
    pub per_us: u64,
}

impl Rate {
    /// `count` per `per_us` with their common factor divided out: the same rate, with
    /// smaller numbers for the integer arithmetic (`100000/d` is `1` per 864ms).
    pub fn reduced(count: u64, per_us: u64) -> Rate {
        let (mut a, mut b) = (count, per_us);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        let g = a.max(1);
        Rate {
            count: count / g,
            per_us: per_us / g,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    FixedWindow {
        limit: u64,
        window_us: u64,
    },
    /// fixed_window with `window: month`: at most `limit` per calendar month, UTC. Its
    /// windows have no one length (28 to 31 days), so it is not a `FixedWindow`.
    CalendarMonth {
        limit: u64,
    },
    SlidingWindow {
        limit: u64,
        window_us: u64,
    },
    SlidingLog {
        limit: u64,
        window_us: u64,
    },
    TokenBucket {
        rate: Rate,
        burst: u64,
    },
    Gcra {
        rate: Rate,
        burst: u64,
    },
    /// At most `limit` requests in flight; a slot is held until the response ends. With
    /// the Redis store a slot is a lease that expires after `lease_us` if its instance
    /// dies without giving it back.
    Concurrency {
        limit: u64,
        lease_us: u64,
    },
}

/// The limit (windows, log) or the wait (buckets) a charge from a response is held
/// to: none that matters, and exact in Lua's doubles (`lua/request.lua`).
pub const UNBOUNDED: u64 = 1 << 52;

/// What a refused `concurrency` request is told to wait: a slot may free at any moment,
/// and nothing says when, so a short fixed retry (1 s, `Retry-After: 1`).
pub const CONCURRENCY_RETRY_US: u64 = 1_000_000;

/// Stored state of one limit for one key.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum State {
    #[default]
    Empty,
    /// fixed_window: the aligned window index and its count. With `window: month` the
    /// index counts calendar months since January 1970 (`month_of`).
    Window { idx: u64, count: u64 },
    /// sliding_window: the current window index, the previous and current counts.
    Sliding { idx: u64, prev: u64, curr: u64 },
    /// sliding_log: admitted requests as (time, cost), oldest first.
    Log(VecDeque<(u64, u64)>),
    /// token_bucket: tokens scaled by `rate.per_us` (one token = per_us units, so a
    /// microsecond refills exactly `rate.count` units) and the time they were counted,
    /// with the rate and burst they were counted under. Negative while delayed requests
    /// have booked future tokens.
    Bucket {
        tokens: i64,
        ts: u64,
        rate: Rate,
        burst: u64,
    },
    /// gcra: the theoretical arrival time and the time it was set, with the rate and
    /// burst it was computed under.
    Gcra {
        tat: u64,
        ts: u64,
        rate: Rate,
        burst: u64,
    },
    /// concurrency: requests in flight. The memory store keeps these counts beside its
    /// other state (they end with a permit, not with time); the pure functions and the
    /// table of cases see them as this state, a request that never ends.
    InFlight(u64),
}

/// What one limit says about one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    pub allowed: bool,
    /// `limit`, or `burst` for token_bucket and gcra.
    pub quota: u64,
    /// Requests of cost 1 still admitted after this one (if admitted) or now (if not).
    pub remaining: u64,
    /// Microseconds until the limit is fully replenished.
    pub reset_us: u64,
    /// Microseconds until this request could be admitted; 0 when admitted.
    pub retry_after_us: u64,
    /// Microseconds an admitted request must wait (delay mode); 0 otherwise.
    pub delay_us: u64,
}

/// The state of a limit no request has touched yet.
pub static EMPTY: State = State::Empty;

/// What a decision would store if the request is charged. Kept free of heap data so
/// a store can evaluate every limit first and write only when all of them admit.
#[derive(Debug, Clone, PartialEq)]
enum Next {
    /// Refused: nothing changes.
    Keep,
    /// The state to store: any but a sliding log (which is on the heap).
    Set(State),
    /// sliding_log: drop the entries that left the window, append `(now, cost)`.
    LogPush,
}

// === impl Algorithm ===

impl Algorithm {
    /// This limit's share on one of `n` instances deciding alone (`on_error: local`
    /// while Redis is unreachable): a count (window, log, concurrency slots, burst)
    /// divided by `n` and rounded up, a rate divided by `n` exactly (its period made
    /// `n` times longer). `n` of 0 or 1 is the whole limit.
    pub fn share(&self, n: u64) -> Algorithm {
        if n <= 1 {
            return *self;
        }
        let part = |count: u64| count.div_ceil(n);
        let rate = |r: Rate| Rate::reduced(r.count, r.per_us.saturating_mul(n));
        match *self {
            Algorithm::FixedWindow { limit, window_us } => Algorithm::FixedWindow {
                limit: part(limit),
                window_us,
            },
            Algorithm::CalendarMonth { limit } => Algorithm::CalendarMonth { limit: part(limit) },
            Algorithm::SlidingWindow { limit, window_us } => Algorithm::SlidingWindow {
                limit: part(limit),
                window_us,
            },
            Algorithm::SlidingLog { limit, window_us } => Algorithm::SlidingLog {
                limit: part(limit),
                window_us,
            },
            Algorithm::TokenBucket { rate: r, burst } => Algorithm::TokenBucket {
                rate: rate(r),
                burst: part(burst),
            },
            Algorithm::Gcra { rate: r, burst } => Algorithm::Gcra {
                rate: rate(r),
                burst: part(burst),
            },
            Algorithm::Concurrency { limit, lease_us } => Algorithm::Concurrency {
                limit: part(limit),
                lease_us,
            },
        }
    }
}

impl Algorithm {
    /// Decides one request of `cost` against this limit at `now_us`. Returns the
    /// outcome and the state as it would be if the request is charged; when refused
    /// the returned state is the input unchanged (a refused request consumes nothing).
    /// `max_delay_us` is 0 in reject mode; in delay mode token_bucket and gcra admit a
    /// request that has to wait at most that long, booking the capacity now.
    pub fn check(
        &self,
        state: &State,
        now_us: u64,
        cost: u64,
        max_delay_us: u64,
    ) -> (Outcome, State) {
        let (outcome, next) = self.eval(state, now_us, cost, max_delay_us);
        let mut new = state.clone();
        self.commit(&mut new, next, now_us, cost);
        (outcome, new)
    }

    /// `check`, committing the new state in place when admitted. Stores use it after
    /// every limit of the request has admitted, to avoid copying a sliding log.
    pub fn charge(&self, state: &mut State, now_us: u64, cost: u64, max_delay_us: u64) -> Outcome {
        let (outcome, next) = self.eval(state, now_us, cost, max_delay_us);
        self.commit(state, next, now_us, cost);
        outcome
    }

    /// Writes what a decision at `now_us` of a request of `cost` said to store.
    fn commit(&self, state: &mut State, next: Next, now_us: u64, cost: u64) {
        match next {
            Next::Keep => {}
            Next::Set(new) => *state = new,
            Next::LogPush => {
                if let State::Log(log) = state {
                    let w = self.window_us();
                    log.retain(|&(ts, _)| log_live(ts, w, now_us));
                    log.push_back((now_us, cost));
                } else {
                    *state = State::Log(VecDeque::from([(now_us, cost)]));
                }
            }
        }
    }

    /// The time (µs since the epoch) from which `state` can no longer influence any
    /// decision: from then on it behaves exactly like `State::Empty`. Used to sweep the
    /// memory store and as the Redis key's expiry. 0 for a state of another algorithm.
    /// A state written under other parameters expires no later than it would have
    /// under them (its Redis key's TTL was set then), and no later than the converted
    /// state would.
    pub fn expires_at_us(&self, state: &State) -> u64 {
        match (*self, state) {
            // The window's end: a later window starts from 0.
            (Algorithm::FixedWindow { window_us, .. }, State::Window { idx, .. }) => {
                idx.saturating_add(1).saturating_mul(window_us.max(1))
            }
            (Algorithm::CalendarMonth { .. }, State::Window { idx, .. }) => {
                month_start_us(idx.saturating_add(1))
            }
            // The end of the next window, where this window stops being the previous one.
            (Algorithm::SlidingWindow { window_us, .. }, State::Sliding { idx, .. }) => {
                idx.saturating_add(2).saturating_mul(window_us.max(1))
            }
            // The newest entry leaves the window at ts + W.
            (Algorithm::SlidingLog { window_us, .. }, State::Log(log)) => log
                .back()
                .map_or(0, |&(ts, _)| ts.saturating_add(window_us.max(1))),
            // Full again after ceil((C - tokens) / N) µs.
            (
                Algorithm::TokenBucket { rate, burst },
                &State::Bucket {
                    tokens,
                    ts,
                    rate: r0,
                    burst: b0,
                },
            ) => {
                let tokens = i128::from(tokens);
                if (r0, b0) == (rate, burst) {
                    return bucket_full_at(tokens, ts, rate, burst);
                }
                let converted = bucket_convert(tokens, r0, rate, burst);
                bucket_full_at(converted, ts, rate, burst).min(bucket_full_at(tokens, ts, r0, b0))
            }
            // Once now >= tat, max(tat, now) = now: as if empty. Written under other
            // parameters: at its own tat, or the converted one if sooner.
            (
                Algorithm::Gcra { rate, burst },
                &State::Gcra {
                    tat,
                    ts,
                    rate: r0,
                    burst: b0,
                },
            ) => {
                if (r0, b0) == (rate, burst) {
                    return tat;
                }
                tat.min(gcra_convert(tat, ts, r0, b0, rate, burst))
            }
            // Never while a request is in flight: a slot ends with its response.
            (Algorithm::Concurrency { .. }, &State::InFlight(n)) if n > 0 => u64::MAX,
            _ => 0,
        }
    }

    /// `limit`, or `burst` for token_bucket and gcra (the `q` of `RateLimit-Policy`).
    pub fn quota(&self) -> u64 {
        match *self {
            Algorithm::FixedWindow { limit, .. }
            | Algorithm::CalendarMonth { limit }
            | Algorithm::SlidingWindow { limit, .. }
            | Algorithm::SlidingLog { limit, .. }
            | Algorithm::Concurrency { limit, .. } => limit,
            Algorithm::TokenBucket { burst, .. } | Algorithm::Gcra { burst, .. } => burst,
        }
    }

    /// The `w` of `RateLimit-Policy`, in µs: the window, or for token_bucket and gcra
    /// the time to refill `burst` from empty, ceil(burst * per_us / count). 0 for
    /// concurrency, which has no window, and for a calendar month, which has no one
    /// length (the header then has no `w`).
    pub fn policy_window_us(&self) -> u64 {
        match *self {
            Algorithm::FixedWindow { window_us, .. }
            | Algorithm::SlidingWindow { window_us, .. }
            | Algorithm::SlidingLog { window_us, .. } => window_us,
            Algorithm::TokenBucket { rate, burst } | Algorithm::Gcra { rate, burst } => {
                let (n, p) = rate_parts(rate);
                to_u64(ceil_div(i128::from(burst) * p, n))
            }
            Algorithm::CalendarMonth { .. } | Algorithm::Concurrency { .. } => 0,
        }
    }

    /// The window of fixed_window, sliding_window and sliding_log as text: its length
    /// in µs, or `month`. Part of what their state means, so a changed window starts
    /// afresh. None for the others.
    pub fn window_name(&self) -> Option<String> {
        match *self {
            Algorithm::FixedWindow { window_us, .. }
            | Algorithm::SlidingWindow { window_us, .. }
            | Algorithm::SlidingLog { window_us, .. } => Some(window_us.to_string()),
            Algorithm::CalendarMonth { .. } => Some("month".to_string()),
            Algorithm::TokenBucket { .. }
            | Algorithm::Gcra { .. }
            | Algorithm::Concurrency { .. } => None,
        }
    }

    /// Whether this limit counts requests in flight rather than requests over time.
    pub fn is_concurrency(&self) -> bool {
        matches!(self, Algorithm::Concurrency { .. })
    }

    /// The configuration name of the algorithm.
    pub fn label(&self) -> &'static str {
        match self {
            Algorithm::FixedWindow { .. } | Algorithm::CalendarMonth { .. } => "fixed_window",
            Algorithm::SlidingWindow { .. } => "sliding_window",
            Algorithm::SlidingLog { .. } => "sliding_log",
            Algorithm::TokenBucket { .. } => "token_bucket",
            Algorithm::Gcra { .. } => "gcra",
            Algorithm::Concurrency { .. } => "concurrency",
        }
    }

    /// Charges `cost` whatever is left: what the upstream's response said a request
    /// cost (`limit::response`), after the request went through. A window or log
    /// counts it past its limit, a bucket goes into debt (as delay mode books
    /// capacity), so the requests after it are refused until it has passed.
    pub fn charge_anyway(&self, state: &mut State, now_us: u64, cost: u64) {
        // Nothing to charge (a log would otherwise keep an entry of no cost).
        if cost == 0 {
            return;
        }
        let unbounded = match *self {
            Algorithm::FixedWindow { window_us, .. } => Algorithm::FixedWindow {
                limit: UNBOUNDED,
                window_us,
            },
            Algorithm::CalendarMonth { .. } => Algorithm::CalendarMonth { limit: UNBOUNDED },
            Algorithm::SlidingWindow { window_us, .. } => Algorithm::SlidingWindow {
                limit: UNBOUNDED,
                window_us,
            },
            Algorithm::SlidingLog { window_us, .. } => Algorithm::SlidingLog {
                limit: UNBOUNDED,
                window_us,
            },
            Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. } => *self,
            Algorithm::Concurrency { .. } => return,
        };
        unbounded.charge(state, now_us, cost, UNBOUNDED);
    }

    /// Undoes a charge of `cost` made at `charged_us` (the store's time then) on
    /// `state` as it is now, other requests charged since included: what a Redis
    /// Cluster does to the keys that admitted a request another key refused
    /// (`lua/refund.lua` does the same). Exact for the windows, the log and the
    /// requests in flight; a bucket gets its tokens back up to its capacity, a gcra its
    /// time back down to when it was last set. A state written since under other
    /// parameters (a reload), or a window that has rolled past the charge, is left as
    /// it is: the charge no longer counts, or counts as the new numbers say.
    pub fn refund(&self, state: &mut State, charged_us: u64, cost: u64) {
        match (*self, state) {
            (Algorithm::FixedWindow { window_us, .. }, State::Window { idx, count })
                if *idx == charged_us / window_us.max(1) =>
            {
                *count = count.saturating_sub(cost);
            }
            (Algorithm::CalendarMonth { .. }, State::Window { idx, count })
                if *idx == month_of(charged_us) =>
            {
                *count = count.saturating_sub(cost);
            }
            (Algorithm::SlidingWindow { window_us, .. }, State::Sliding { idx, prev, curr }) => {
                let charged = charged_us / window_us.max(1);
                if *idx == charged {
                    *curr = curr.saturating_sub(cost);
                } else if *idx == charged + 1 {
                    *prev = prev.saturating_sub(cost);
                }
            }
            (Algorithm::SlidingLog { .. }, State::Log(log)) => {
                if let Some(i) = log.iter().position(|&e| e == (charged_us, cost)) {
                    log.remove(i);
                }
            }
            (
                Algorithm::TokenBucket { rate, burst },
                State::Bucket {
                    tokens,
                    rate: r0,
                    burst: b0,
                    ..
                },
            ) if *r0 == rate && *b0 == burst => {
                let (_, p) = rate_parts(rate);
                let cap = i128::from(burst) * p;
                let back = (i128::from(*tokens) + i128::from(cost) * p).min(cap);
                *tokens = i64::try_from(back).unwrap_or(i64::MAX);
            }
            (
                Algorithm::Gcra { rate, burst },
                State::Gcra {
                    tat,
                    ts,
                    rate: r0,
                    burst: b0,
                },
            ) if *r0 == rate && *b0 == burst => {
                let inc = gcra_inc(rate, cost);
                *tat = tat.saturating_sub(inc).max(*ts);
            }
            (Algorithm::Concurrency { .. }, State::InFlight(n)) => {
                *n = n.saturating_sub(cost);
            }
            _ => {}
        }
    }

    /// Decides a request of `cost` (`check`) and, when it is admitted at once, takes
    /// up to `want` more units for its instance to hold (`reserve`): as many as are
    /// left after the request, never more. Returns the request's outcome (its
    /// `remaining` counts the units taken as still left: they are this instance's to
    /// spend), the units taken beyond `cost`, and the state to write. A request that
    /// waits (delay mode) or is refused takes nothing more. `lua/request.lua` does the
    /// same: the algorithm decides `cost`, then `cost + extra`; if the second is not
    /// admitted at once (rounding in gcra's emission interval), only `cost` is taken.
    pub fn take(
        &self,
        state: &State,
        now_us: u64,
        cost: u64,
        want: u64,
        max_delay_us: u64,
    ) -> (Outcome, u64, State) {
        let (outcome, next) = self.check(state, now_us, cost, max_delay_us);
        let extra = want.min(outcome.remaining);
        if !outcome.allowed || outcome.delay_us > 0 || extra == 0 {
            return (outcome, 0, next);
        }
        match self.check(state, now_us, cost.saturating_add(extra), max_delay_us) {
            (o, more) if o.allowed && o.delay_us == 0 => (outcome, extra, more),
            _ => (outcome, 0, next),
        }
    }

    /// How long units taken at `now_us` (`take`) stay this instance's to spend: until
    /// the window they were counted in ends (the current window of sliding_window,
    /// which counts them whole there), in µs. None for token_bucket and gcra, which
    /// have no window: their units fade at the limit's rate instead (`limit::reserve`).
    pub fn reserve_hold_us(&self, now_us: u64) -> Option<u64> {
        match *self {
            Algorithm::FixedWindow { window_us, .. }
            | Algorithm::SlidingWindow { window_us, .. } => {
                let w = window_us.max(1);
                Some(w - now_us % w)
            }
            Algorithm::CalendarMonth { .. } => {
                Some(month_start_us(month_of(now_us).saturating_add(1)).saturating_sub(now_us))
            }
            Algorithm::TokenBucket { .. }
            | Algorithm::Gcra { .. }
            | Algorithm::SlidingLog { .. }
            | Algorithm::Concurrency { .. } => None,
        }
    }

    /// The refill rate of token_bucket and gcra, at which held units fade; None for
    /// the others.
    pub fn refill(&self) -> Option<Rate> {
        match *self {
            Algorithm::TokenBucket { rate, .. } | Algorithm::Gcra { rate, .. } => Some(rate),
            _ => None,
        }
    }

    fn window_us(&self) -> u64 {
        match *self {
            Algorithm::FixedWindow { window_us, .. }
            | Algorithm::SlidingWindow { window_us, .. }
            | Algorithm::SlidingLog { window_us, .. } => window_us.max(1),
            Algorithm::CalendarMonth { .. }
            | Algorithm::TokenBucket { .. }
            | Algorithm::Gcra { .. }
            | Algorithm::Concurrency { .. } => 1,
        }
    }

    fn eval(&self, state: &State, now: u64, cost: u64, max_delay_us: u64) -> (Outcome, Next) {
        let (mut outcome, next) = match *self {
            Algorithm::FixedWindow { limit, window_us } => {
                // idx = now / W; the window ends at (idx+1)*W.
                let w = window_us.max(1);
                let idx = now / w;
                let end = idx.saturating_add(1).saturating_mul(w);
                fixed_window(limit, idx, end, state, now, cost)
            }
            Algorithm::CalendarMonth { limit } => {
                let idx = month_of(now);
                fixed_window(
                    limit,
                    idx,
                    month_start_us(idx.saturating_add(1)),
                    state,
                    now,
                    cost,
                )
            }
            Algorithm::SlidingWindow { limit, window_us } => {
                sliding_window(limit, window_us.max(1), state, now, cost)
            }
            Algorithm::SlidingLog { limit, window_us } => {
                sliding_log(limit, window_us.max(1), state, now, cost)
            }
            Algorithm::TokenBucket { rate, burst } => {
                token_bucket(rate, burst, state, now, cost, max_delay_us)
            }
            Algorithm::Gcra { rate, burst } => gcra(rate, burst, state, now, cost, max_delay_us),
            Algorithm::Concurrency { limit, .. } => concurrency(limit, state, cost),
        };
        outcome.quota = self.quota();
        (outcome, next)
    }
}

// === the algorithms ===
//
// W = window_us, N = rate.count, P = rate.per_us; all times in µs. Zero parameters are
// rejected by config validation; they are raised to 1 here only so no input can make
// the process divide by zero.

/// fixed_window: at most `limit` in the window `idx`, which holds `now` and ends at
/// `end`: [idx*W, (idx+1)*W), or the calendar month `idx`.
fn fixed_window(
    limit: u64,
    idx: u64,
    end: u64,
    state: &State,
    now: u64,
    cost: u64,
) -> (Outcome, Next) {
    // The stored count counts only in its own window.
    let count = match *state {
        State::Window { idx: s, count } if s == idx => count,
        _ => 0,
    };
    // Time to the window's end: its reset, and a refused request's wait.
    let until_end = end.saturating_sub(now);
    let (outcome, after) = count_up(limit, count, cost, until_end, until_end);
    let next = after.map_or(Next::Keep, |count| Next::Set(State::Window { idx, count }));
    (outcome, next)
}

/// A count under a limit (fixed_window, concurrency): admit iff count + cost <=
/// limit; remaining = limit - count after this one. Reset is `reset_us` when
/// admitted; a refusal waits `wait_us` (its reset too). The count to store when
/// admitted.
fn count_up(
    limit: u64,
    count: u64,
    cost: u64,
    reset_us: u64,
    wait_us: u64,
) -> (Outcome, Option<u64>) {
    let after = count.saturating_add(cost);
    if after <= limit {
        let outcome = Outcome {
            allowed: true,
            remaining: limit - after,
            reset_us,
            ..Outcome::default()
        };
        return (outcome, Some(after));
    }
    let outcome = Outcome {
        allowed: false,
        remaining: limit.saturating_sub(count),
        reset_us: wait_us,
        retry_after_us: wait_us,
        ..Outcome::default()
    };
    (outcome, None)
}

/// sliding_window: the previous window's count weighted by the share of it still inside
/// the sliding window, plus the current window's count. The weighting is f64, computed
/// in exactly this order so the Lua script (whose numbers are doubles) matches bit for bit.
fn sliding_window(limit: u64, w: u64, state: &State, now: u64, cost: u64) -> (Outcome, Next) {
    // idx = now / W, e = now - idx*W (offset into the current window).
    let idx = now / w;
    let e = now - idx * w;
    // (prev, curr): as stored in this window; shifted by one if stored in the previous
    // window; (0, 0) if older.
    let (prev, curr) = match *state {
        State::Sliding { idx: s, prev, curr } if s == idx => (prev, curr),
        State::Sliding { idx: s, curr, .. } if s.checked_add(1) == Some(idx) => (curr, 0),
        _ => (0, 0),
    };
    // weight = (W - e) / W; estimate = prev * weight + curr.
    let weight = (w - e) as f64 / w as f64;
    let estimate = prev as f64 * weight + curr as f64;
    // Admit iff estimate + cost <= limit.
    let allowed = estimate + cost as f64 <= limit as f64;
    // reset: W - e if the current window (after this request) is empty, else 2W - e,
    // when the current window stops being the previous one.
    let curr_after = if allowed {
        curr.saturating_add(cost)
    } else {
        curr
    };
    let reset_us = if curr_after == 0 {
        w - e
    } else {
        w.saturating_mul(2).saturating_sub(e)
    };
    if allowed {
        // remaining = floor(limit - estimate - cost).
        let outcome = Outcome {
            allowed: true,
            remaining: f64_to_u64((limit as f64 - estimate - cost as f64).floor()),
            reset_us,
            ..Outcome::default()
        };
        return (
            outcome,
            Next::Set(State::Sliding {
                idx,
                prev,
                curr: curr_after,
            }),
        );
    }
    let retry_after_us = if curr.saturating_add(cost) <= limit {
        // Passes later in this window once prev has decayed enough: the earliest offset
        // e' with prev*(W-e')/W + curr + cost <= limit is
        // e' = ceil(W - (limit - cost - curr) * W / prev); retry = e' - e, at least 1.
        // (prev > 0 here: with prev = 0 the request would have been admitted.)
        let free = (limit - cost - curr) as f64;
        let at = f64_to_u64((w as f64 - free * w as f64 / prev as f64).ceil());
        at.saturating_sub(e).max(1)
    } else {
        // Must wait for the next window, where prev' = curr and curr' = 0:
        // (W - e) + ceil(max(0, W - (limit - cost) * W / curr)).
        // limit - cost saturates at 0 (cost > limit: never admitted; then the term is W,
        // which is also its value when curr = 0, only possible when cost > limit).
        let free = limit.saturating_sub(cost) as f64;
        let into_next = if curr == 0 {
            w
        } else {
            f64_to_u64((w as f64 - free * w as f64 / curr as f64).max(0.0).ceil())
        };
        (w - e).saturating_add(into_next)
    };
    let outcome = Outcome {
        allowed: false,
        // remaining = floor(max(0, limit - estimate)).
        remaining: f64_to_u64((limit as f64 - estimate).max(0.0).floor()),
        reset_us,
        retry_after_us,
        ..Outcome::default()
    };
    (outcome, Next::Keep)
}

/// concurrency: admit iff in_flight + cost <= limit; remaining = limit - in flight
/// after this one. Nothing resets with time: reset is 0 when admitted; a refusal is
/// told to retry in `CONCURRENCY_RETRY_US` (its reset too).
fn concurrency(limit: u64, state: &State, cost: u64) -> (Outcome, Next) {
    let count = match *state {
        State::InFlight(n) => n,
        _ => 0,
    };
    let (outcome, after) = count_up(limit, count, cost, 0, CONCURRENCY_RETRY_US);
    (
        outcome,
        after.map_or(Next::Keep, |n| Next::Set(State::InFlight(n))),
    )
}

/// Whether a log entry made at `ts` is still inside the window ending at `now`:
/// entries with ts + W <= now have left (an entry at t stops counting at t + W exactly).
fn log_live(ts: u64, w: u64, now: u64) -> bool {
    ts.saturating_add(w) > now
}

/// sliding_log: exact; at most `limit` (summed cost) in any W-long interval ending now.
fn sliding_log(limit: u64, w: u64, state: &State, now: u64, cost: u64) -> (Outcome, Next) {
    let log = match state {
        State::Log(log) => Some(log),
        _ => None,
    };
    let live = || {
        log.into_iter()
            .flatten()
            .copied()
            .filter(|&(ts, _)| log_live(ts, w, now))
    };
    // count = sum of the costs still inside the window.
    let count = live().fold(0u64, |sum, (_, c)| sum.saturating_add(c));
    // Admit iff count + cost <= limit; then (now, cost) is appended.
    let after = count.saturating_add(cost);
    if after <= limit {
        let outcome = Outcome {
            allowed: true,
            remaining: limit - after,
            // The newest entry is this one: everything has left at now + W.
            reset_us: w,
            ..Outcome::default()
        };
        return (outcome, Next::LogPush);
    }
    // need = count + cost - limit units must leave. Walk the entries oldest first; the
    // one at which the summed cost first reaches `need` leaves at ts + W, so
    // retry = ts + W - now. If the whole log is not enough (cost > limit: never
    // admitted), retry = W.
    let need = after - limit;
    let mut freed = 0u64;
    let mut retry_after_us = w;
    for (ts, c) in live() {
        freed = freed.saturating_add(c);
        if freed >= need {
            retry_after_us = ts.saturating_add(w).saturating_sub(now);
            break;
        }
    }
    // reset = newest ts + W - now (0 if the log is empty).
    let reset_us = live()
        .next_back()
        .map_or(0, |(ts, _)| ts.saturating_add(w).saturating_sub(now));
    let outcome = Outcome {
        allowed: false,
        remaining: limit.saturating_sub(count),
        reset_us,
        retry_after_us,
        ..Outcome::default()
    };
    (outcome, Next::Keep)
}

/// token_bucket: `burst` tokens refilled continuously at N per P µs; starts full.
/// Tokens are scaled by P (one token = P units) so one µs refills exactly N units and
/// the arithmetic stays integer: capacity C = burst * P.
fn token_bucket(
    rate: Rate,
    burst: u64,
    state: &State,
    now: u64,
    cost: u64,
    max_delay_us: u64,
) -> (Outcome, Next) {
    let (n, p) = rate_parts(rate);
    let cap = i128::from(burst) * p;
    // Empty: full at now. `until`: when a state written under other parameters is as
    // good as empty (never for one written under these).
    let (stored, ts, until) = bucket_level(state, now, rate, burst).unwrap_or((cap, now, u64::MAX));
    // Refill: elapsed = now - ts (0 if the clock is behind); full if tokens >= C or
    // elapsed >= ceil((C - tokens) / N), else tokens + elapsed * N (then < C, no overflow).
    let elapsed = i128::from(now.saturating_sub(ts));
    let tokens = if stored >= cap || elapsed >= ceil_div(cap - stored, n) {
        cap
    } else {
        stored + elapsed * n
    };
    // after = tokens - cost * P; admitted at once iff after >= 0.
    let after = tokens - i128::from(cost) * p;
    // Otherwise the wait for the missing units: ceil(-after / N).
    let wait = if after >= 0 {
        0
    } else {
        to_u64(ceil_div(-after, n))
    };
    // Delay mode: book the tokens now (the level goes negative) and wait.
    let (allowed, delay_us) = admit_after(wait, max_delay_us);
    // remaining = floor(max(0, level) / P), reset = ceil((C - level) / N), where level
    // is `after` if admitted and the refilled `tokens` if refused. A refused request's
    // state is full, and it passes, by `until` at the latest.
    let level = if allowed { after } else { tokens };
    let reset_us = to_u64(ceil_div(cap - level, n));
    let remaining = to_u64(level.max(0) / p);
    let outcome = bucket_outcome(allowed, remaining, reset_us, delay_us, wait, until - now);
    let next = if allowed {
        let tokens = i64::try_from(after).unwrap_or(i64::MIN);
        Next::Set(State::Bucket {
            tokens,
            ts: now,
            rate,
            burst,
        })
    } else {
        Next::Keep
    };
    (outcome, next)
}

/// gcra: the theoretical arrival time `tat` is when the bucket would be full again; a
/// request pushes it by its emission interval and is admitted while the tat stays
/// within burst * P / N of now. Integer form of token_bucket with the level stored as
/// a time.
fn gcra(
    rate: Rate,
    burst: u64,
    state: &State,
    now: u64,
    cost: u64,
    max_delay_us: u64,
) -> (Outcome, Next) {
    let (n, p) = rate_parts(rate);
    let n_u = n as u128;
    let p_u = p as u128;
    let inc = gcra_inc(rate, cost);
    // L = burst * P: the largest admissible (tat - now) * N.
    let span = u128::from(burst) * p_u;
    // base = max(tat, now) (tat = now when empty); new_tat = base + inc. `until`: when
    // a state written under other parameters is as good as empty.
    let (tat, until) = gcra_tat(state, now, rate, burst);
    let base = tat.max(now);
    let new_tat = base.saturating_add(inc);
    // excess = (new_tat - now) * N; admitted at once iff excess <= L,
    // else wait = ceil((excess - L) / N).
    let excess = u128::from(new_tat - now) * n_u;
    let wait = if excess <= span {
        0
    } else {
        u128_to_u64((excess - span).div_ceil(n_u))
    };
    let (allowed, delay_us) = admit_after(wait, max_delay_us);
    // With t = new_tat if admitted, else base:
    // remaining = floor(max(0, L - (t - now) * N) / P), reset = t - now.
    // A refused request's state is empty, and it passes, by `until` at the latest.
    let t = if allowed { new_tat } else { base };
    let used = u128::from(t - now) * n_u;
    let remaining = u128_to_u64(span.saturating_sub(used) / p_u);
    let outcome = bucket_outcome(allowed, remaining, t - now, delay_us, wait, until - now);
    let next = if allowed {
        Next::Set(State::Gcra {
            tat: new_tat,
            ts: now,
            rate,
            burst,
        })
    } else {
        Next::Keep
    };
    (outcome, next)
}

/// The outcome of token_bucket or gcra: admitted after `delay_us`, or refused for
/// `wait_us`. A refused request's state is as good as empty in `empty_in_us` (one
/// written under other parameters): its reset and its wait end then at the latest.
fn bucket_outcome(
    allowed: bool,
    remaining: u64,
    reset_us: u64,
    delay_us: u64,
    wait_us: u64,
    empty_in_us: u64,
) -> Outcome {
    if allowed {
        Outcome {
            allowed,
            remaining,
            reset_us,
            delay_us,
            ..Outcome::default()
        }
    } else {
        Outcome {
            allowed,
            remaining,
            reset_us: reset_us.min(empty_in_us),
            retry_after_us: wait_us.min(empty_in_us),
            ..Outcome::default()
        }
    }
}

// === reading state written under other parameters ===
//
// A reload that changes a bucket's rate or burst keeps its level, in whole tokens, and
// applies the new numbers to it. Such a state is read as empty once it would have been
// full under the parameters it was written with: that is when its Redis key expires,
// so both stores read it alike however late they look. Every number stays below 2^53
// (exact in Lua's doubles): levels and capacities are at most 2^50 units.

/// The lowest level, in units, a converted state keeps: booked delays beyond it are
/// forgotten rather than carried into numbers Lua could not hold exactly.
const MAX_DEBT: i128 = 1 << 50;

/// token_bucket's level in units of `rate`, the time it was counted, and when it will
/// be as good as empty (u64::MAX: not before it is full); None when the state is
/// empty (or another algorithm's). Written under another rate: whole tokens
/// q = floor(tokens / P0) (floor also for booked, negative levels), clamped to
/// [-floor(2^50 / P), burst], become q * P at the same time, then refill at the new
/// rate. Under another burst only: the level as stored (the refill clamps it to the new
/// capacity).
fn bucket_level(state: &State, now: u64, rate: Rate, burst: u64) -> Option<(i128, u64, u64)> {
    let State::Bucket {
        tokens,
        ts,
        rate: r0,
        burst: b0,
    } = *state
    else {
        return None;
    };
    let tokens = i128::from(tokens);
    if (r0, b0) == (rate, burst) {
        return Some((tokens, ts, u64::MAX));
    }
    let until = bucket_full_at(tokens, ts, r0, b0);
    if now >= until {
        return None;
    }
    Some((bucket_convert(tokens, r0, rate, burst), ts, until))
}

/// `tokens` counted under `r0` in units of `rate`, whole tokens only, clamped to
/// [-floor(2^50 / P), burst].
fn bucket_convert(tokens: i128, r0: Rate, rate: Rate, burst: u64) -> i128 {
    if r0 == rate {
        return tokens;
    }
    let (_, p0) = rate_parts(r0);
    let (_, p) = rate_parts(rate);
    let q = floor_div(tokens, p0).clamp(-(MAX_DEBT / p), i128::from(burst));
    q * p
}

/// When a bucket at `tokens` units at `ts` is full under (`rate`, `burst`):
/// ts + ceil((C - tokens) / N).
fn bucket_full_at(tokens: i128, ts: u64, rate: Rate, burst: u64) -> u64 {
    let (n, p) = rate_parts(rate);
    let deficit = i128::from(burst) * p - tokens;
    ts.saturating_add(to_u64(ceil_div(deficit, n)))
}

/// gcra's theoretical arrival time under (`rate`, `burst`) (`now` when empty), and when
/// it will be as good as empty (u64::MAX: not before its tat). A state written under
/// other parameters is empty from its own tat on (when its Redis key expires); until
/// then it is converted (`gcra_convert`).
fn gcra_tat(state: &State, now: u64, rate: Rate, burst: u64) -> (u64, u64) {
    let State::Gcra {
        tat,
        ts,
        rate: r0,
        burst: b0,
    } = *state
    else {
        return (now, u64::MAX);
    };
    if (r0, b0) == (rate, burst) {
        return (tat, u64::MAX);
    }
    if tat <= now {
        return (now, u64::MAX);
    }
    (gcra_convert(tat, ts, r0, b0, rate, burst), tat)
}

/// A tat set at `ts` under (N0, P0, B0), under (N, P, B): converted as token_bucket
/// converts its level, at the time it was written. The whole tokens available then,
/// avail = floor((B0 * P0 - (tat - ts) * N0) / P0) (negative with booked delays),
/// clamped to [-floor(2^50 / P), B], leave used = B - avail, and the tat becomes
/// ts + floor(used * P / N). Rounded down like gcra's own emission interval, so
/// exactly `avail` requests pass at once, as `avail` whole tokens of token_bucket do
/// (rounding up would lose one whenever N does not divide P).
fn gcra_convert(tat: u64, ts: u64, r0: Rate, b0: u64, rate: Rate, burst: u64) -> u64 {
    let (n0, p0) = rate_parts(r0);
    let (n, p) = rate_parts(rate);
    let owed = i128::from(tat.saturating_sub(ts)) * n0;
    let avail = floor_div(i128::from(b0) * p0 - owed, p0).clamp(-(MAX_DEBT / p), i128::from(burst));
    let used = i128::from(burst) - avail;
    ts.saturating_add(to_u64(floor_div(used * p, n)))
}

// === calendar months, UTC ===
//
// Howard Hinnant's days_from_civil and civil_from_days (chrono-Compatible Low-Level
// Date Algorithms), for dates from 1970 on only, so every number is unsigned;
// lua/fixed_window.lua does the same integer arithmetic.

const DAY_US: u64 = 86_400_000_000;

/// The calendar month (UTC) holding `now_us`, counted from January 1970 as 0:
/// (year - 1970) * 12 + month - 1.
pub fn month_of(now_us: u64) -> u64 {
    // civil_from_days, for the year and month only. Days fit in 28 bits, so nothing
    // below can overflow.
    let z = now_us / DAY_US + 719_468;
    let era = z / 146_097;
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    // mp counts months from March: January and February belong to the next year.
    let (year, month) = if mp < 10 {
        (era * 400 + yoe, mp + 3)
    } else {
        (era * 400 + yoe + 1, mp - 9)
    };
    (year - 1970) * 12 + month - 1
}

/// When calendar month `idx` (`month_of`) starts: 00:00 UTC on its first day, in µs
/// since the epoch (u64::MAX if later than that holds).
pub fn month_start_us(idx: u64) -> u64 {
    // days_from_civil for the first of the month, in u128 so no index overflows.
    let idx = u128::from(idx);
    let (year, month) = (1970 + idx / 12, idx % 12 + 1);
    // Counted from March, so that February's length comes last.
    let (y, mp) = if month > 2 {
        (year, month - 3)
    } else {
        (year - 1, month + 9)
    };
    let era = y / 400;
    let yoe = y - era * 400;
    let doy = (153 * mp + 2) / 5;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    u128_to_u64(days * u128::from(DAY_US))
}

// === arithmetic helpers ===

/// (N, P) as i128, each at least 1.
/// gcra's emission interval for `cost`: floor(cost * P / N), at least 1 for cost > 0.
/// (Rounded down, not up: with ceil, N not dividing P made every full burst one
/// request short; see the tests.)
fn gcra_inc(rate: Rate, cost: u64) -> u64 {
    let (n, p) = rate_parts(rate);
    let inc = u128_to_u64(u128::from(cost) * p as u128 / n as u128);
    if inc == 0 && cost > 0 {
        1
    } else {
        inc
    }
}

fn rate_parts(rate: Rate) -> (i128, i128) {
    (
        i128::from(rate.count.max(1)),
        i128::from(rate.per_us.max(1)),
    )
}

/// ceil(a / b) for b > 0; 0 when a <= 0 (lua/arith.lua: ceil_div).
fn ceil_div(a: i128, b: i128) -> i128 {
    if a <= 0 {
        0
    } else {
        (a - 1) / b + 1
    }
}

/// floor(a / b) for any a, b > 0: towards minus infinity for negative a
/// (lua/arith.lua: floor_div_signed).
fn floor_div(a: i128, b: i128) -> i128 {
    if a >= 0 {
        a / b
    } else {
        -ceil_div(-a, b)
    }
}

/// Clamps into u64 (negative -> 0, too large -> u64::MAX).
fn to_u64(v: i128) -> u64 {
    u64::try_from(v.max(0)).unwrap_or(u64::MAX)
}

fn u128_to_u64(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// f64 -> u64 with negatives and NaN as 0 (Rust's `as` saturates; the Lua side clamps).
fn f64_to_u64(v: f64) -> u64 {
    v as u64
}

// === deciding a request ===

/// Decides one request over every limit of `plan`: `states[i]` belongs to
/// `plan.limits[i]` (missing = empty). Admitted only if every limit admits; then the
/// new states to commit are returned, else `None` and nothing is charged anywhere.
pub fn decide(plan: &Plan, states: &[State], now_us: u64) -> (Verdict, Option<Vec<State>>) {
    let max_delay_us = plan.max_delay_us();
    let (outcomes, new): (Vec<Outcome>, Vec<State>) = plan
        .limits
        .iter()
        .enumerate()
        .map(|(i, limit)| {
            let state = states.get(i).unwrap_or(&EMPTY);
            let (outcome, new) = limit
                .algorithm
                .check(state, now_us, limit.cost, max_delay_us);
            // A limit charged from the response is only checked here.
            let new = if limit.at_admission() {
                new
            } else {
                state.clone()
            };
            (outcome, new)
        })
        .unzip();
    let verdict = Verdict::on_trial(outcomes, plan.on_trial());
    let new = verdict.allowed.then_some(new);
    (verdict, new)
}

/// `decide`, taking for each limit `wants[i]` more units when the request is admitted
/// at once (`Algorithm::take`): the verdict, the units each limit took beyond the
/// request's cost, and the states to commit (None when refused: nothing is charged or
/// taken). A limit on trial that refuses takes nothing, as it charges nothing.
pub fn decide_taking(
    plan: &Plan,
    states: &[State],
    now_us: u64,
    wants: &[u64],
) -> (Verdict, Vec<u64>, Option<Vec<State>>) {
    let max_delay_us = plan.max_delay_us();
    let mut taken = Vec::with_capacity(plan.limits.len());
    let mut new = Vec::with_capacity(plan.limits.len());
    let mut outcomes = Vec::with_capacity(plan.limits.len());
    for (i, limit) in plan.limits.iter().enumerate() {
        let state = states.get(i).unwrap_or(&EMPTY);
        let want = wants.get(i).copied().unwrap_or(0);
        let (outcome, extra, next) =
            limit
                .algorithm
                .take(state, now_us, limit.cost, want, max_delay_us);
        outcomes.push(outcome);
        taken.push(if outcome.allowed { extra } else { 0 });
        new.push(if outcome.allowed { next } else { state.clone() });
    }
    let verdict = Verdict::on_trial(outcomes, plan.on_trial());
    if !verdict.allowed {
        return (verdict, vec![0; plan.limits.len()], None);
    }
    (verdict, taken, Some(new))
}

/// The verdict over every limit of `plan` without charging anything; `state_of(i)` is
/// the state of `plan.limits[i]`.
pub fn judge<'a>(plan: &Plan, now_us: u64, state_of: impl Fn(usize) -> &'a State) -> Verdict {
    let max_delay_us = plan.max_delay_us();
    let eval = |i: usize, limit: &LimitDef| {
        limit
            .algorithm
            .eval(state_of(i), now_us, limit.cost, max_delay_us)
            .0
    };
    let outcomes = match &plan.limits[..] {
        [limit] => Outcomes::One(eval(0, limit)),
        limits => Outcomes::Many(limits.iter().enumerate().map(|(i, l)| eval(i, l)).collect()),
    };
    Verdict::on_trial(outcomes, plan.on_trial())
}

// === impl Verdict ===

impl Verdict {
    /// Combines the outcomes of a request's limits (in plan order): admitted iff every
    /// limit admits; the delay is the longest of them (0 when refused).
    pub fn from_outcomes(outcomes: Vec<Outcome>) -> Verdict {
        Verdict::on_trial(outcomes, 0)
    }

    /// `from_outcomes`, with the limits of `trial` (`Plan::on_trial`) on trial: they
    /// neither refuse nor delay the request.
    pub fn on_trial(outcomes: impl Into<Outcomes>, trial: u64) -> Verdict {
        let mut v = Verdict {
            allowed: true,
            delay_us: 0,
            outcomes: outcomes.into(),
            trial,
        };
        let allowed = v.enforced().all(|(_, o)| o.allowed);
        let delay_us = if allowed {
            v.enforced().map(|(_, o)| o.delay_us).max().unwrap_or(0)
        } else {
            0
        };
        (v.allowed, v.delay_us) = (allowed, delay_us);
        v
    }
}

/// Whether a request that must wait `wait_us` for capacity is admitted, and how long
/// it waits: at once when nothing is owed, after the wait in delay mode when it fits
/// in `max_delay_us`, else refused.
fn admit_after(wait_us: u64, max_delay_us: u64) -> (bool, u64) {
    if wait_us == 0 {
        (true, 0)
    } else if max_delay_us > 0 && wait_us <= max_delay_us {
        (true, wait_us)
    } else {
        (false, 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::Mode;

    const S: u64 = 1_000_000;

    #[test]
    fn rates_are_reduced() {
        assert_eq!(
            Rate::reduced(10, 1_000_000),
            Rate {
                count: 1,
                per_us: 100_000
            }
        );
        assert_eq!(
            Rate::reduced(3, 1_000_000),
            Rate {
                count: 3,
                per_us: 1_000_000
            }
        );
        assert_eq!(
            Rate::reduced(100_000, 86_400_000_000),
            Rate {
                count: 1,
                per_us: 864_000
            }
        );
    }
    const T0: u64 = 20_834 * 86_400 * S;

    use crate::limit::cases::Rng;

    fn rate(count: u64, per_us: u64) -> Rate {
        Rate { count, per_us }
    }

    fn samples() -> Vec<Algorithm> {
        vec![
            Algorithm::FixedWindow {
                limit: 5,
                window_us: S,
            },
            Algorithm::FixedWindow {
                limit: 100,
                window_us: 60 * S,
            },
            Algorithm::CalendarMonth { limit: 4 },
            Algorithm::SlidingWindow {
                limit: 10,
                window_us: S,
            },
            Algorithm::SlidingWindow {
                limit: 7,
                window_us: 3 * S,
            },
            Algorithm::SlidingWindow {
                limit: 1000,
                window_us: 60 * S,
            },
            Algorithm::SlidingLog {
                limit: 5,
                window_us: S,
            },
            Algorithm::SlidingLog {
                limit: 3,
                window_us: 700_000,
            },
            Algorithm::TokenBucket {
                rate: rate(10, S),
                burst: 5,
            },
            Algorithm::TokenBucket {
                rate: rate(3, S),
                burst: 4,
            },
            Algorithm::TokenBucket {
                rate: rate(7, 60 * S),
                burst: 3,
            },
            Algorithm::Gcra {
                rate: rate(10, S),
                burst: 5,
            },
            Algorithm::Gcra {
                rate: rate(3, S),
                burst: 4,
            },
            Algorithm::Gcra {
                rate: rate(7, 60 * S),
                burst: 3,
            },
        ]
    }

    /// A charge undone (`Algorithm::refund`, as a Redis Cluster undoes the keys that
    /// admitted a request another key refused) leaves a limit deciding every later
    /// request exactly as if the charge had never been made; with requests charged
    /// between the charge and its refund, exactly so for the windows and the log, and
    /// never more generously for the buckets.
    #[test]
    fn the_take_cases_pass_in_pure_rust() {
        for case in crate::limit::cases::takes() {
            let store = std::cell::RefCell::new(crate::limit::cases::PureStore::default());
            crate::limit::cases::run_takes(
                &case,
                |plan, now, wants| store.borrow_mut().take(plan, now, wants),
                || store.borrow_mut().lose(),
            )
            .unwrap_or_else(|e| panic!("{e}"));
        }
    }

    #[test]
    fn a_refunded_charge_is_as_if_it_had_never_been_made() {
        for algo in samples() {
            for cost in [1, 2] {
                for between in [0, 1, 3] {
                    let mut rng = Rng(7 + between + cost);
                    let gap = algo.policy_window_us() / algo.quota().max(1) + 1;
                    let (mut charged, mut twin) = (State::Empty, State::Empty);
                    let mut now = T0 + rng.below(S);
                    let exact = between == 0
                        || !matches!(algo, Algorithm::TokenBucket { .. } | Algorithm::Gcra { .. });
                    for step in 0..600 {
                        now += rng.below(gap);
                        // Every 7th request is charged, then refunded `between`
                        // requests later; its twin never sees it.
                        if step % 7 == 3 {
                            let (o, new) = algo.check(&charged, now, cost, 0);
                            if !o.allowed {
                                continue;
                            }
                            charged = new;
                            let at = now;
                            let mut diverged = false;
                            for _ in 0..between {
                                now += rng.below(gap);
                                let (a, new_a) = algo.check(&charged, now, 1, 0);
                                let (b, new_b) = algo.check(&twin, now, 1, 0);
                                if a.allowed != b.allowed {
                                    diverged = true;
                                }
                                if a.allowed {
                                    charged = new_a;
                                }
                                if b.allowed {
                                    twin = new_b;
                                }
                            }
                            algo.refund(&mut charged, at, cost);
                            if diverged {
                                // The charge refused a request its twin admitted: the
                                // two no longer count the same requests.
                                twin = charged.clone();
                            }
                            continue;
                        }
                        let (a, new_a) = algo.check(&charged, now, cost, 0);
                        let (b, new_b) = algo.check(&twin, now, cost, 0);
                        if exact {
                            assert_eq!(a, b, "{algo:?} cost {cost} between {between} step {step}");
                        } else {
                            assert!(
                                !a.allowed || b.allowed,
                                "{algo:?} cost {cost} between {between} step {step}: refunded admits what its twin refuses"
                            );
                        }
                        if a.allowed {
                            charged = new_a;
                        }
                        if b.allowed {
                            twin = new_b;
                        }
                        if a.allowed != b.allowed {
                            twin = charged.clone();
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_refund_gives_back_requests_in_flight() {
        let algo = Algorithm::Concurrency {
            limit: 2,
            lease_us: S,
        };
        let mut state = State::InFlight(2);
        algo.refund(&mut state, T0, 1);
        assert_eq!(state, State::InFlight(1));
    }

    /// Drives `algo` with requests at random gaps (up to `max_gap_us`) and calls
    /// `visit(state_before, now, outcome)` for each; admitted requests are charged.
    fn walk(
        algo: Algorithm,
        cost: u64,
        max_delay: u64,
        seed: u64,
        mut visit: impl FnMut(&State, u64, &Outcome),
    ) {
        let mut rng = Rng(seed);
        // On average three times the allowed rate (a calendar month has no policy
        // window: taken as 31 days).
        let window = match algo {
            Algorithm::CalendarMonth { .. } => 31 * DAY_US,
            _ => algo.policy_window_us(),
        };
        let gap = window / algo.quota().max(1) + 1;
        let mut state = State::Empty;
        let mut now = T0 + rng.below(S);
        for _ in 0..3_000 {
            // Bursts: often no gap at all.
            if rng.below(3) != 0 {
                now += rng.below(gap);
            }
            let (outcome, new) = algo.check(&state, now, cost, max_delay);
            visit(&state, now, &outcome);
            if outcome.allowed {
                state = new;
            } else {
                assert_eq!(new, state, "{algo:?}: a refusal changed the state");
            }
        }
    }

    #[test]
    fn gcra_admits_exactly_what_token_bucket_admits() {
        // P divisible by N: the two are the same algorithm in different units.
        for (r, burst) in [(rate(10, S), 5), (rate(6, 60 * S), 2), (rate(1, S), 1)] {
            for max_delay in [0, 300_000, 5 * S] {
                for cost in [1, 2] {
                    let tb = Algorithm::TokenBucket { rate: r, burst };
                    let gc = Algorithm::Gcra { rate: r, burst };
                    let (mut s_tb, mut s_gc) = (State::Empty, State::Empty);
                    let mut rng = Rng(7 + cost + max_delay);
                    let mut now = T0;
                    let mut admitted = 0;
                    for i in 0..5_000 {
                        if rng.below(2) == 0 {
                            now += rng.below(r.per_us / r.count * 2);
                        }
                        let (o_tb, n_tb) = tb.check(&s_tb, now, cost, max_delay);
                        let (o_gc, n_gc) = gc.check(&s_gc, now, cost, max_delay);
                        assert_eq!(
                            o_tb, o_gc,
                            "step {i} at {now} ({r:?} burst {burst} delay {max_delay})"
                        );
                        if o_tb.allowed {
                            admitted += 1;
                            (s_tb, s_gc) = (n_tb, n_gc);
                        }
                    }
                    if cost <= burst {
                        assert!(
                            admitted > 100,
                            "{r:?} burst {burst} cost {cost}: {admitted}"
                        );
                    }
                }
            }
        }
    }

    /// Rates with N dividing P, all different (10/s twice, in other units).
    fn divisible_rates() -> [(Rate, u64); 5] {
        [
            (rate(1, 100_000), 5),
            (rate(1, 500_000), 5),
            (rate(2, S), 3),
            (rate(10, S), 8),
            (rate(1, 50_000), 2),
        ]
    }

    #[test]
    fn gcra_and_token_bucket_agree_through_changes_of_rate() {
        // Both read a changed state in whole tokens at the time it was written; with N
        // dividing P neither rounds anywhere else.
        for max_delay in [0, 300_000] {
            for cost in [1, 2] {
                let mut rng = Rng(11 + cost + max_delay);
                let (mut s_tb, mut s_gc) = (State::Empty, State::Empty);
                let mut now = T0;
                let (mut admitted, mut changes) = (0, 0);
                let (mut r, mut burst) = divisible_rates()[0];
                for i in 0..20_000 {
                    if rng.below(30) == 0 {
                        let (r2, b2) = divisible_rates()[rng.below(5) as usize];
                        changes += usize::from(r2 != r);
                        (r, burst) = (r2, b2);
                    }
                    if rng.below(2) == 0 {
                        now += rng.below(r.per_us / r.count * 2);
                    }
                    let tb = Algorithm::TokenBucket { rate: r, burst };
                    let gc = Algorithm::Gcra { rate: r, burst };
                    let (o_tb, n_tb) = tb.check(&s_tb, now, cost, max_delay);
                    let (o_gc, n_gc) = gc.check(&s_gc, now, cost, max_delay);
                    assert_eq!(
                        o_tb, o_gc,
                        "step {i} at {now} ({r:?} burst {burst} delay {max_delay}): \
                         {s_tb:?} / {s_gc:?}"
                    );
                    assert_eq!(tb.expires_at_us(&s_tb), gc.expires_at_us(&s_gc));
                    if o_tb.allowed {
                        admitted += 1;
                        (s_tb, s_gc) = (n_tb, n_gc);
                    }
                }
                assert!(admitted > 1_000 && changes > 400, "{admitted} {changes}");
            }
        }
    }

    /// States written under one set of parameters and read under another keep what
    /// every outcome promises: a refused request passes exactly after its retry time,
    /// the state is replenished after its reset time, and from its expiry on it
    /// decides like an empty one.
    #[test]
    fn converted_states_keep_the_promises_of_their_outcomes() {
        let params = [
            (rate(10, S), 5),
            (rate(10, S), 2),
            (rate(10, S), 9),
            (rate(3, S), 4),
            (rate(1, 250_000), 3),
            (rate(7, 60 * S), 3),
        ];
        let mut checked = 0;
        for (i, &(r0, b0)) in params.iter().enumerate() {
            for (j, &(r, burst)) in params.iter().enumerate() {
                if i == j {
                    continue;
                }
                for [old, new] in [
                    [
                        Algorithm::TokenBucket {
                            rate: r0,
                            burst: b0,
                        },
                        Algorithm::TokenBucket { rate: r, burst },
                    ],
                    [
                        Algorithm::Gcra {
                            rate: r0,
                            burst: b0,
                        },
                        Algorithm::Gcra { rate: r, burst },
                    ],
                ] {
                    let mut n = 0;
                    walk(old, 1, 0, 5 + i as u64, |state, now, _| {
                        n += 1;
                        if n > 300 {
                            return;
                        }
                        checked += 1;
                        let at = |t| new.check(state, t, 1, 0).0;
                        let o = at(now);
                        let fresh = |t| new.check(&State::Empty, t, 1, 0).0;
                        let ctx = format!("{state:?} as {new:?} at {now}: {o:?}");
                        if !o.allowed {
                            let retry = o.retry_after_us;
                            assert!(retry > 0 && at(now + retry).allowed, "{ctx}");
                            assert!(retry == 1 || !at(now + retry - 1).allowed, "{ctx}");
                            assert_eq!(at(now + o.reset_us), fresh(now + o.reset_us), "{ctx}");
                        }
                        let expires = new.expires_at_us(state).max(now);
                        for t in [expires, expires + 1, expires + 7 * S] {
                            assert_eq!(at(t), fresh(t), "{ctx}: expires {expires}");
                        }
                        if expires > now + 1 {
                            assert_ne!(at(expires - 1), fresh(expires - 1), "{ctx}");
                        }
                    });
                }
            }
        }
        assert_eq!(checked, 6 * 5 * 2 * 300);
    }

    #[test]
    fn gcra_allows_the_full_burst_when_n_does_not_divide_p() {
        for n in [3, 7, 9, 11, 13] {
            for per_us in [S, 60 * S] {
                for burst in 1..20 {
                    for algo in [
                        Algorithm::Gcra {
                            rate: rate(n, per_us),
                            burst,
                        },
                        Algorithm::TokenBucket {
                            rate: rate(n, per_us),
                            burst,
                        },
                    ] {
                        let mut state = State::Empty;
                        let mut admitted = 0;
                        loop {
                            let (o, new) = algo.check(&state, T0, 1, 0);
                            if !o.allowed {
                                break;
                            }
                            admitted += 1;
                            state = new;
                        }
                        assert_eq!(admitted, burst, "{algo:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn retry_after_is_the_earliest_admission() {
        for algo in samples() {
            for cost in [1, 2] {
                let mut refusals = 0;
                walk(algo, cost, 0, 42 + cost, |state, now, o| {
                    if o.allowed {
                        assert_eq!(o.retry_after_us, 0);
                        return;
                    }
                    refusals += 1;
                    let retry = o.retry_after_us;
                    assert!(retry > 0, "{algo:?} at {now}");
                    let later = algo.check(state, now + retry, cost, 0).0;
                    assert!(
                        later.allowed,
                        "{algo:?} at {now}: not admitted after {retry}"
                    );
                    if retry > 1 {
                        let sooner = algo.check(state, now + retry - 1, cost, 0).0;
                        assert!(
                            !sooner.allowed,
                            "{algo:?} at {now}: admitted before {retry}"
                        );
                    }
                });
                assert!(refusals > 10, "{algo:?}: {refusals}");
            }
        }
    }

    #[test]
    fn reset_and_remaining_describe_the_state() {
        for algo in samples() {
            walk(algo, 1, 0, 9, |state, now, o| {
                let charged = if o.allowed {
                    algo.check(state, now, 1, 0).1
                } else {
                    state.clone()
                };
                // `remaining` more cost-1 requests are admitted at once, and no more
                // (the sliding window's estimate may round either way by less than one).
                let mut s = charged.clone();
                for i in 0..o.remaining {
                    let (next, new) = algo.check(&s, now, 1, 0);
                    assert!(
                        next.allowed,
                        "{algo:?} at {now}: request {i} of {} refused",
                        o.remaining
                    );
                    s = new;
                }
                assert!(
                    !algo.check(&s, now, 1, 0).0.allowed,
                    "{algo:?} at {now}: more than {}",
                    o.remaining
                );
                // After reset the limit is fully replenished: a fresh state decides alike.
                let at = now + o.reset_us;
                assert_eq!(
                    algo.check(&charged, at, 1, 0).0,
                    algo.check(&State::Empty, at, 1, 0).0,
                    "{algo:?} at {now}: not replenished after {}",
                    o.reset_us
                );
            });
        }
    }

    #[test]
    fn expired_state_decides_like_an_empty_one() {
        for algo in samples() {
            walk(algo, 1, 0, 5, |state, _, _| {
                let at = algo.expires_at_us(state);
                for t in [at, at + 1, at + 12_345_678] {
                    let t = t.max(T0);
                    assert_eq!(
                        algo.check(state, t, 1, 0).0,
                        algo.check(&State::Empty, t, 1, 0).0,
                        "{algo:?}"
                    );
                }
            });
            assert_eq!(algo.expires_at_us(&State::Empty), 0);
        }
    }

    #[test]
    fn delay_mode_books_capacity_up_to_max_delay() {
        for algo in [
            Algorithm::TokenBucket {
                rate: rate(10, S),
                burst: 3,
            },
            Algorithm::Gcra {
                rate: rate(10, S),
                burst: 3,
            },
        ] {
            let max_delay = 450_000;
            let mut state = State::Empty;
            let mut delays = Vec::new();
            loop {
                let (o, new) = algo.check(&state, T0, 1, max_delay);
                if !o.allowed {
                    assert_eq!((o.delay_us, o.retry_after_us, o.remaining), (0, 500_000, 0));
                    break;
                }
                assert_eq!(o.retry_after_us, 0);
                delays.push(o.delay_us);
                state = new;
            }
            assert_eq!(
                delays,
                [0, 0, 0, 100_000, 200_000, 300_000, 400_000],
                "{algo:?}"
            );
        }
    }

    #[test]
    fn sliding_log_walks_entries_of_different_costs() {
        let algo = Algorithm::SlidingLog {
            limit: 5,
            window_us: 10 * S,
        };
        let state = State::Log(VecDeque::from([(T0, 1), (T0 + S, 3), (T0 + 2 * S, 1)]));
        let (o, new) = algo.check(&state, T0 + 5 * S, 3, 0);
        // need = 5 + 3 - 5 = 3 units: 1 (not enough), then 1 + 3 at T0 + 1s.
        assert_eq!(
            o,
            Outcome {
                allowed: false,
                quota: 5,
                remaining: 0,
                reset_us: 7 * S,
                retry_after_us: 6 * S,
                delay_us: 0
            }
        );
        assert_eq!(new, state);
        // At T0 + 10s the first entry has left (T0 + 10s <= now): 4 + 1 fits.
        let (o, new) = algo.check(&state, T0 + 10 * S, 1, 0);
        assert_eq!((o.allowed, o.remaining, o.reset_us), (true, 0, 10 * S));
        assert_eq!(
            new,
            State::Log(VecDeque::from([
                (T0 + S, 3),
                (T0 + 2 * S, 1),
                (T0 + 10 * S, 1)
            ]))
        );
        // charge() commits the same state in place.
        let mut s = state.clone();
        assert_eq!(algo.charge(&mut s, T0 + 10 * S, 1, 0), o);
        assert_eq!(s, new);
    }

    #[test]
    fn sliding_window_weights_the_previous_window() {
        let algo = Algorithm::SlidingWindow {
            limit: 10,
            window_us: S,
        };
        let idx = T0 / S;
        // 8 in the previous window, 2 in this one, 25% in: 8 * 0.75 + 2 = 8.
        let state = State::Sliding {
            idx,
            prev: 8,
            curr: 2,
        };
        let (o, new) = algo.check(&state, T0 + S / 4, 1, 0);
        assert_eq!(
            (o.allowed, o.remaining, o.reset_us),
            (true, 1, 2 * S - S / 4)
        );
        assert_eq!(
            new,
            State::Sliding {
                idx,
                prev: 8,
                curr: 3
            }
        );
        // One window later the stored current count becomes the previous one.
        let (o, new) = algo.check(&state, T0 + S + S / 2, 1, 0);
        assert_eq!((o.allowed, o.remaining), (true, 8)); // 2 * 0.5 + 1
        assert_eq!(
            new,
            State::Sliding {
                idx: idx + 1,
                prev: 2,
                curr: 1
            }
        );
        // Two windows later nothing is left.
        let (o, _) = algo.check(&state, T0 + 2 * S, 1, 0);
        assert_eq!((o.allowed, o.remaining), (true, 9));
    }

    #[test]
    fn charge_commits_what_check_returns() {
        for algo in samples() {
            for max_delay in [0, 250_000] {
                walk(algo, 1, max_delay, 3, |state, now, o| {
                    let (_, new) = algo.check(state, now, 1, max_delay);
                    let mut s = state.clone();
                    assert_eq!(algo.charge(&mut s, now, 1, max_delay), *o);
                    if o.allowed {
                        assert_eq!(s, new);
                    }
                });
            }
        }
    }

    #[test]
    fn calendar_months_start_at_00_00_utc_on_the_first() {
        // (month index, its first day in seconds since the epoch, from `date -u +%s`).
        let month = |year: u64, month: u64| (year - 1970) * 12 + month - 1;
        let firsts = [
            (month(1970, 1), 0),
            (month(1970, 2), 2_678_400),
            (month(1970, 3), 5_097_600),
            // 2000 is a leap year (divisible by 400), 2100 is not (by 100).
            (month(2000, 2), 949_363_200),
            (month(2000, 3), 951_868_800),
            (month(2026, 12), 1_796_083_200),
            (month(2027, 1), 1_798_761_600),
            (month(2028, 2), 1_832_976_000),
            (month(2028, 3), 1_835_481_600),
            (month(2100, 2), 4_105_123_200),
            (month(2100, 3), 4_107_542_400),
        ];
        for (idx, secs) in firsts {
            assert_eq!(month_start_us(idx), secs * S, "month {idx}");
            assert_eq!(month_of(secs * S), idx);
            if idx > 0 {
                assert_eq!(month_of(secs * S - 1), idx - 1);
            }
        }
        // Every month from 1970 to 2500 by the Gregorian rules, day by day.
        let mut day = 0;
        let mut idx = 0;
        for year in 1970..2500u64 {
            let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
            for len in [
                31,
                if leap { 29 } else { 28 },
                31,
                30,
                31,
                30,
                31,
                31,
                30,
                31,
                30,
                31,
            ] {
                assert_eq!(month_start_us(idx), day * DAY_US, "{year}, month {idx}");
                assert_eq!(month_of(day * DAY_US), idx);
                assert_eq!(month_of((day + len) * DAY_US - 1), idx);
                day += len;
                idx += 1;
            }
        }
        // Far beyond: no overflow.
        assert_eq!(month_start_us(u64::MAX), u64::MAX);
        assert!(month_of(u64::MAX) > month_of(u64::MAX / 2));
    }

    #[test]
    fn a_calendar_month_counts_down_to_the_first_of_the_next() {
        let algo = Algorithm::CalendarMonth { limit: 2 };
        // 2026-12-31T23:59:59Z, then 2027-01-01T00:00:00Z.
        let (dec_31, jan_1) = (1_798_761_599 * S, 1_798_761_600 * S);
        let (o, state) = algo.check(&State::Empty, dec_31, 1, 0);
        assert_eq!(
            o,
            Outcome {
                allowed: true,
                quota: 2,
                remaining: 1,
                reset_us: S,
                retry_after_us: 0,
                delay_us: 0
            }
        );
        let december = month_of(dec_31);
        assert_eq!(
            state,
            State::Window {
                idx: december,
                count: 1
            }
        );
        assert_eq!(algo.expires_at_us(&state), jan_1);
        let (_, state) = algo.check(&state, dec_31, 1, 0);
        let (o, _) = algo.check(&state, jan_1 - 1, 1, 0);
        assert_eq!(
            (o.allowed, o.remaining, o.reset_us, o.retry_after_us),
            (false, 0, 1, 1)
        );
        // January has 31 days.
        let (o, state) = algo.check(&state, jan_1, 1, 0);
        assert_eq!((o.allowed, o.remaining, o.reset_us), (true, 1, 31 * DAY_US));
        assert_eq!(
            state,
            State::Window {
                idx: december + 1,
                count: 1
            }
        );
        // Its own id: never the state of a fixed window, whatever its length.
        let id = |a| LimitDef::new("l".into(), a, 1).id;
        assert_ne!(
            id(algo),
            id(Algorithm::FixedWindow {
                limit: 2,
                window_us: 30 * DAY_US
            })
        );
        assert_eq!(id(algo), id(Algorithm::CalendarMonth { limit: 7 }));
        assert_eq!(algo.label(), "fixed_window");
        assert_eq!(algo.policy_window_us(), 0);
    }

    #[test]
    fn policy_numbers() {
        let cases = [
            (
                Algorithm::FixedWindow {
                    limit: 100,
                    window_us: 60 * S,
                },
                "fixed_window",
                100,
                60 * S,
            ),
            (
                Algorithm::SlidingWindow {
                    limit: 7,
                    window_us: S,
                },
                "sliding_window",
                7,
                S,
            ),
            (
                Algorithm::SlidingLog {
                    limit: 5,
                    window_us: 60 * S,
                },
                "sliding_log",
                5,
                60 * S,
            ),
            (
                Algorithm::TokenBucket {
                    rate: rate(10, S),
                    burst: 20,
                },
                "token_bucket",
                20,
                2 * S,
            ),
            // ceil(2 * 1e6 / 3)
            (
                Algorithm::Gcra {
                    rate: rate(3, S),
                    burst: 2,
                },
                "gcra",
                2,
                666_667,
            ),
        ];
        for (algo, label, quota, window) in cases {
            assert_eq!(
                (algo.label(), algo.quota(), algo.policy_window_us()),
                (label, quota, window)
            );
        }
    }

    #[test]
    fn outcomes_carry_the_quota() {
        for algo in samples() {
            assert_eq!(algo.check(&State::Empty, T0, 1, 0).0.quota, algo.quota());
        }
    }

    #[test]
    fn zero_parameters_do_not_panic() {
        for algo in [
            Algorithm::FixedWindow {
                limit: 0,
                window_us: 0,
            },
            Algorithm::SlidingWindow {
                limit: 0,
                window_us: 0,
            },
            Algorithm::SlidingLog {
                limit: 0,
                window_us: 0,
            },
            Algorithm::TokenBucket {
                rate: rate(0, 0),
                burst: 0,
            },
            Algorithm::Gcra {
                rate: rate(0, 0),
                burst: 0,
            },
        ] {
            for (now, cost) in [(0, 0), (0, 1), (T0, 1), (u64::MAX, u64::MAX)] {
                let (o, s) = algo.check(&State::Empty, now, cost, 0);
                let _ = (o, algo.expires_at_us(&s), algo.policy_window_us());
            }
        }
    }

    #[test]
    fn cost_above_the_quota_is_never_admitted() {
        for algo in samples() {
            let cost = algo.quota() + 1;
            let (o, _) = algo.check(&State::Empty, T0, cost, 0);
            assert!(!o.allowed && o.retry_after_us > 0, "{algo:?}: {o:?}");
        }
    }

    #[test]
    fn decide_charges_all_limits_or_none() {
        let plan = Plan {
            limits: vec![
                LimitDef::new(
                    "a".into(),
                    Algorithm::FixedWindow {
                        limit: 2,
                        window_us: S,
                    },
                    1,
                ),
                LimitDef::new(
                    "b".into(),
                    Algorithm::FixedWindow {
                        limit: 1,
                        window_us: S,
                    },
                    1,
                ),
            ],
            mode: Mode::Reject,
        };
        let idx = T0 / S;
        let (v, new) = decide(&plan, &[], T0);
        assert!(v.allowed);
        let new = new.unwrap();
        assert_eq!(
            new,
            [
                State::Window { idx, count: 1 },
                State::Window { idx, count: 1 }
            ]
        );
        let (v, none) = decide(&plan, &new, T0);
        assert!(!v.allowed && none.is_none());
        assert_eq!(
            (v.outcomes[0].allowed, v.outcomes[1].allowed),
            (true, false)
        );
        assert_eq!(v.retry_after_us(), S);
        // A missing state is an empty one.
        let (v, _) = decide(&plan, &new[..1], T0);
        assert!(v.allowed);
    }

    #[test]
    fn verdict_delay_is_the_longest_and_zero_when_refused() {
        let o = |allowed, delay_us| Outcome {
            allowed,
            delay_us,
            ..Outcome::default()
        };
        assert_eq!(
            Verdict::from_outcomes(vec![o(true, 5), o(true, 9), o(true, 0)]).delay_us,
            9
        );
        let v = Verdict::from_outcomes(vec![o(true, 5), o(false, 0)]);
        assert_eq!((v.allowed, v.delay_us), (false, 0));
        let v = Verdict::from_outcomes(vec![]);
        assert_eq!((v.allowed, v.delay_us), (true, 0));
    }
}
