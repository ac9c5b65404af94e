//! The five rate-limit algorithms as pure functions of (state, now). Time is in
//! microseconds since the UNIX epoch; all arithmetic is integer except the sliding
//! window's weighting, which is done in f64 in exactly the order the Lua script
//! uses, so both stores reach bit-identical decisions.

use std::collections::VecDeque;

/// `count` tokens (requests) per `per_us` microseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rate {
    pub count: u64,
    pub per_us: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Algorithm {
    FixedWindow { limit: u64, window_us: u64 },
    SlidingWindow { limit: u64, window_us: u64 },
    SlidingLog { limit: u64, window_us: u64 },
    TokenBucket { rate: Rate, burst: u64 },
    Gcra { rate: Rate, burst: u64 },
}

/// Stored state of one limit for one key.
#[derive(Debug, Clone, PartialEq, Default)]
pub enum State {
    #[default]
    Empty,
    /// fixed_window: the aligned window index and its count.
    Window { idx: u64, count: u64 },
    /// sliding_window: the current window index, the previous and current counts.
    Sliding { idx: u64, prev: u64, curr: u64 },
    /// sliding_log: admitted requests as (time, cost), oldest first.
    Log(VecDeque<(u64, u64)>),
    /// token_bucket: tokens scaled by `rate.per_us` (one token = per_us units, so a
    /// microsecond refills exactly `rate.count` units) and the time they were counted.
    /// Negative while delayed requests have booked future tokens.
    Bucket { tokens: i64, ts: u64 },
    /// gcra: the theoretical arrival time.
    Gcra { tat: u64 },
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
// TEMPORARY stub until the limit-algos branch lands.
impl Algorithm {
    pub fn quota(&self) -> u64 { 0 }
    pub fn policy_window_us(&self) -> u64 { 0 }
}
