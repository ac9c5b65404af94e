//! One structured log line per refused request: limited (429), denied (the deny
//! list's status) or refused because the store is down (`on_error: deny`, 503). Info
//! level, target `sluice::refusal`, so `SLUICE_LOG=info,sluice::refusal=off` turns
//! them off. The key is never written: a short hash of it stands in, the same on
//! every instance, so one client's lines can be followed across a fleet. The
//! client's address is written as it is (`ip`), so the operator reading a line can
//! deny the address they read.
//!
//! A flood of refusals must not fill the disk: at most `LINES_PER_SECOND` lines are
//! written each second (per process); the rest are counted, in
//! `sluice_refusal_logs_dropped_total` and in the `dropped` field of the next line
//! written.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use prometheus::IntCounter;

use crate::identity::KeyHash;

/// Lines written per second at most; the rest are counted.
pub const LINES_PER_SECOND: u64 = 10;

/// The log target of the lines.
pub const TARGET: &str = "sluice::refusal";

pub struct RefusalLog {
    budget: Budget,
    started: Instant,
    dropped_total: IntCounter,
}

impl RefusalLog {
    pub fn new(dropped_total: IntCounter) -> RefusalLog {
        RefusalLog {
            budget: Budget::new(LINES_PER_SECOND),
            started: Instant::now(),
            dropped_total,
        }
    }

    /// A line for a refused request, if this second's budget allows one: taken
    /// where the refusal is decided (the key at hand), written by `Line::write` once
    /// the request's method and path are (the end of the request path).
    /// Nothing is allocated unless the line is admitted; boxed, as it rides on
    /// every request's tally, where it costs one word.
    pub fn line(
        &self,
        route: &str,
        key: impl std::fmt::Display,
        ip: IpAddr,
        what: What<&str>,
    ) -> Option<Box<Line>> {
        let dropped = self.admit()?;
        Some(Box::new(Line {
            route: route.to_string(),
            key_hash: KeyHash(key).to_string(),
            ip,
            what: what.owned(),
            dropped,
        }))
    }

    /// Whether a line may be written now, with the lines dropped since the last one
    /// written; `None` (counted) when this second's lines are spent. Nothing is
    /// counted when the lines are turned off.
    fn admit(&self) -> Option<u64> {
        if !tracing::enabled!(target: TARGET, tracing::Level::INFO) {
            return None;
        }
        let second = self.started.elapsed().as_secs();
        let admitted = self.budget.admit(second);
        if admitted.is_none() {
            self.dropped_total.inc();
        }
        admitted
    }
}

/// Why a request was refused (`L`: the limit's name, borrowed until the line is
/// admitted).
pub enum What<L = String> {
    /// By a limit: its name, and the answer's `Retry-After` in seconds.
    Limited { limit: L, retry_after: u64 },
    /// Its key (`deny = "key"`) or its address (`deny = "ip"`; the hash is of the
    /// address as a `key: ip` route would see it) is on the deny list.
    Denied { status: u16, deny: &'static str },
    /// The store cannot decide and `on_error` is `deny`.
    StoreDown,
}

impl What<&str> {
    fn owned(self) -> What {
        match self {
            What::Limited { limit, retry_after } => What::Limited {
                limit: limit.to_string(),
                retry_after,
            },
            What::Denied { status, deny } => What::Denied { status, deny },
            What::StoreDown => What::StoreDown,
        }
    }
}

/// One refusal line, admitted by the budget.
pub struct Line {
    route: String,
    key_hash: String,
    ip: IpAddr,
    what: What,
    dropped: u64,
}

/// Longest path written in a line; a longer one is cut (at a character boundary).
const MAX_PATH: usize = 256;

impl Line {
    /// Writes it, with the request's method and path (without the query, which may
    /// carry a key).
    pub fn write(&self, method: &str, path: &str) {
        let mut end = path.len().min(MAX_PATH);
        while !path.is_char_boundary(end) {
            end -= 1;
        }
        let path = &path[..end];
        let (route, key_hash, dropped) =
            (self.route.as_str(), self.key_hash.as_str(), self.dropped);
        let ip = crate::identity::canonical(self.ip);
        match &self.what {
            What::Limited { limit, retry_after } => tracing::info!(
                target: TARGET,
                decision = "limited",
                status = 429u16,
                route,
                method,
                path,
                key_hash = %key_hash,
                ip = %ip,
                limit = limit.as_str(),
                retry_after,
                dropped,
                "request refused"
            ),
            What::Denied { status, deny } => tracing::info!(
                target: TARGET,
                decision = "denied",
                status,
                route,
                method,
                path,
                key_hash = %key_hash,
                ip = %ip,
                deny,
                dropped,
                "request refused"
            ),
            What::StoreDown => tracing::info!(
                target: TARGET,
                decision = "store_error_denied",
                status = 503u16,
                route,
                method,
                path,
                key_hash = %key_hash,
                ip = %ip,
                dropped,
                "request refused"
            ),
        }
    }
}

/// At most `per_second` admissions in each whole second, and the count of those
/// refused since the last admission. The second and its count share one atomic
/// word, so the limit is exact under any number of threads.
pub struct Budget {
    per_second: u64,
    /// The second (high 40 bits) and the admissions in it (low 24 bits).
    state: AtomicU64,
    dropped: AtomicU64,
}

const COUNT_BITS: u32 = 24;
const COUNT_MASK: u64 = (1 << COUNT_BITS) - 1;

impl Budget {
    pub fn new(per_second: u64) -> Budget {
        Budget {
            per_second: per_second.min(COUNT_MASK),
            state: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
        }
    }

    /// At `second`: `Some(dropped since the last admission)`, or `None`, counted.
    pub fn admit(&self, second: u64) -> Option<u64> {
        let mut cur = self.state.load(Relaxed);
        loop {
            let (at, used) = (cur >> COUNT_BITS, cur & COUNT_MASK);
            let used = if at == second { used } else { 0 };
            if used >= self.per_second {
                self.dropped.fetch_add(1, Relaxed);
                return None;
            }
            let next = (second << COUNT_BITS) | (used + 1);
            match self
                .state
                .compare_exchange_weak(cur, next, Relaxed, Relaxed)
            {
                Ok(_) => return Some(self.dropped.swap(0, Relaxed)),
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_admits_its_lines_and_the_next_line_counts_the_rest() {
        let b = Budget::new(3);
        let first: Vec<_> = (0..5).map(|_| b.admit(7)).collect();
        assert_eq!(first, [Some(0), Some(0), Some(0), None, None]);
        // The next second: its first line reports the 2 dropped, then none.
        assert_eq!(b.admit(8), Some(2));
        assert_eq!(b.admit(8), Some(0));
        assert_eq!(b.admit(8), Some(0));
        assert_eq!(b.admit(8), None);
        // A quiet gap changes nothing: a new second starts afresh.
        assert_eq!(b.admit(20), Some(1));
    }

    #[test]
    fn the_limit_holds_across_threads() {
        let b = std::sync::Arc::new(Budget::new(10));
        let admitted: u64 = (0..4)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || (0..1000).filter(|_| b.admit(1).is_some()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap() as u64)
            .sum();
        assert_eq!(admitted, 10);
        assert_eq!(b.dropped.load(Relaxed), 3990);
    }

    #[test]
    fn key_hash_is_sha1_cut_to_16_hex_digits() {
        // printf %s abc | sha1sum
        assert_eq!(KeyHash("abc").to_string(), "a9993e364706816a");
        // An address as its text: printf %s 203.0.113.9 | sha1sum
        let ip: std::net::IpAddr = "203.0.113.9".parse().unwrap();
        assert_eq!(KeyHash(ip).to_string(), KeyHash("203.0.113.9").to_string());
    }
}
