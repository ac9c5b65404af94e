//! The recent past, for the dashboard: every few seconds a sampler copies each
//! route's `sluice_requests_total` counters, and what its upstream answered
//! (`sluice_upstream_responses_total` 2xx to 5xx, and the requests it did not
//! answer: `sluice_upstream_errors_total`), kept by the request path anyway, into a
//! bounded ring per route name, so a page opened now already shows the last minutes
//! and a reload that keeps a route keeps its history; the first sample of each
//! minute also goes into a second ring that reaches back two hours. Nothing here
//! runs per request.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::deny::now_ms;
use crate::pipeline::Shared;
use crate::telemetry::metrics::Decision;

/// How often the sampler reads the counters.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How far back the recent history reaches.
pub const KEEP: Duration = Duration::from_secs(5 * 60);
/// How often the long history keeps a sample: the first of each minute.
pub const LONG_EVERY: Duration = Duration::from_secs(60);
/// How far back the long history reaches.
pub const LONG_KEEP: Duration = Duration::from_secs(2 * 60 * 60);

/// One route's counters at one moment: in the order of `Decision::ALL`, then the
/// upstream's answers by class (`UPSTREAM_COLUMNS`).
pub type Totals = [u64; COLUMNS];

/// The upstream's columns of `Totals`, after the decisions: its answers by status
/// class, and the requests it did not answer (connect, timeout, reset, busy).
pub const UPSTREAM_COLUMNS: [&str; 5] = [
    "upstream_2xx",
    "upstream_3xx",
    "upstream_4xx",
    "upstream_5xx",
    "upstream_failed",
];

/// Columns of `Totals`.
pub const COLUMNS: usize = Decision::ALL.len() + UPSTREAM_COLUMNS.len();

/// A route's counters now, as a sample holds them.
pub fn totals_of(m: &crate::telemetry::metrics::RouteMetrics) -> Totals {
    let mut t = [0; COLUMNS];
    let decisions = Decision::ALL.len();
    t[..decisions].copy_from_slice(&m.totals());
    let [_, c2, c3, c4, c5] = m.upstream_totals();
    let failed: u64 = m.upstream_error_totals().iter().sum();
    t[decisions..].copy_from_slice(&[c2, c3, c4, c5, failed]);
    t
}

/// One sample: wall-clock milliseconds since the epoch, and the counters then.
pub type Sample = (u64, Totals);

/// The rings of every route, and of requests that matched none.
pub struct History {
    capacity: usize,
    inner: Mutex<Rings>,
    /// One sample a minute (`LONG_EVERY`), `long_capacity` of them.
    long_capacity: usize,
    long: Mutex<Rings>,
}

#[derive(Default)]
struct Rings {
    routes: HashMap<String, VecDeque<Sample>>,
    unmatched: VecDeque<Sample>,
}

impl History {
    /// Rings of at most `capacity` samples each.
    /// Rings of at most `capacity` samples each, and long ones of `long_capacity`.
    pub fn new(capacity: usize, long_capacity: usize) -> History {
        History {
            capacity: capacity.max(1),
            inner: Mutex::new(Rings::default()),
            long_capacity: long_capacity.max(1),
            long: Mutex::new(Rings::default()),
        }
    }

    /// Enough samples of `SAMPLE_EVERY` to cover `KEEP`, and of `LONG_EVERY` to cover
    /// `LONG_KEEP` (each with the moment it starts).
    pub fn standard() -> History {
        let n = |keep: Duration, every: Duration| {
            usize::try_from(keep.as_millis() / every.as_millis())
                .unwrap_or(usize::MAX)
                .saturating_add(1)
        };
        History::new(n(KEEP, SAMPLE_EVERY), n(LONG_KEEP, LONG_EVERY))
    }

    /// Appends one sample of every route there is now; a route missing from
    /// `routes` (a reload removed it) loses its history.
    pub fn record<'a>(
        &self,
        at_ms: u64,
        routes: impl IntoIterator<Item = (&'a str, Totals)>,
        unmatched: Totals,
    ) {
        let routes: Vec<(&str, Totals)> = routes.into_iter().collect();
        Self::push_all(&self.inner, self.capacity, at_ms, &routes, unmatched);
        // The long rings: the first sample of each minute.
        let every = LONG_EVERY.as_millis() as u64;
        let newest = {
            let long = self.long.lock().unwrap_or_else(PoisonError::into_inner);
            long.unmatched.back().map(|(at, _)| *at)
        };
        if newest.is_none_or(|t| t / every != at_ms / every) {
            Self::push_all(&self.long, self.long_capacity, at_ms, &routes, unmatched);
        }
    }

    fn push_all(
        rings: &Mutex<Rings>,
        cap: usize,
        at_ms: u64,
        routes: &[(&str, Totals)],
        unmatched: Totals,
    ) {
        let push = |ring: &mut VecDeque<Sample>, totals: Totals| {
            while ring.len() >= cap {
                ring.pop_front();
            }
            ring.push_back((at_ms, totals));
        };
        let mut rings = rings.lock().unwrap_or_else(PoisonError::into_inner);
        let mut seen = HashSet::new();
        for &(name, totals) in routes {
            seen.insert(name);
            match rings.routes.get_mut(name) {
                Some(ring) => push(ring, totals),
                None => {
                    let mut ring = VecDeque::with_capacity(cap.min(16));
                    push(&mut ring, totals);
                    rings.routes.insert(name.to_string(), ring);
                }
            }
        }
        rings.routes.retain(|name, _| seen.contains(name.as_str()));
        push(&mut rings.unmatched, unmatched);
    }

    /// The samples of route `name`, oldest first.
    pub fn route(&self, name: &str) -> Vec<Sample> {
        let rings = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        rings
            .routes
            .get(name)
            .map(|r| r.iter().copied().collect())
            .unwrap_or_default()
    }

    /// The samples of requests that matched no route, oldest first.
    pub fn unmatched(&self) -> Vec<Sample> {
        let rings = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        rings.unmatched.iter().copied().collect()
    }

    /// The long history of route `name` (a sample a minute), oldest first.
    pub fn route_long(&self, name: &str) -> Vec<Sample> {
        let rings = self.long.lock().unwrap_or_else(PoisonError::into_inner);
        rings
            .routes
            .get(name)
            .map(|r| r.iter().copied().collect())
            .unwrap_or_default()
    }
}

/// Reads every route's counters once, now.
pub fn sample(shared: &Shared, history: &History) {
    let rt = shared.runtime.load();
    history.record(
        now_ms(),
        rt.routes
            .iter()
            .map(|r| (r.name.as_str(), totals_of(&r.metrics))),
        totals_of(&rt.unmatched),
    );
}

/// The sampler: one sample every `SAMPLE_EVERY` until `stop`. (The server takes the
/// first itself, at startup, so the history is never empty.)
pub async fn run(shared: Arc<Shared>, history: Arc<History>, mut stop: watch::Receiver<bool>) {
    let first = tokio::time::Instant::now() + SAMPLE_EVERY;
    let mut tick = tokio::time::interval_at(first, SAMPLE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => sample(&shared, &history),
            _ = stop.changed() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(allowed: u64, limited: u64) -> Totals {
        let mut t = [0; COLUMNS];
        t[0] = allowed;
        t[2] = limited;
        t
    }

    #[test]
    fn a_ring_keeps_the_newest_samples_up_to_its_capacity() {
        let h = History::new(3, 3);
        for i in 0..5u64 {
            h.record(1000 * i, [("api", t(i, 0))], t(0, 0));
        }
        assert_eq!(
            h.route("api"),
            vec![(2000, t(2, 0)), (3000, t(3, 0)), (4000, t(4, 0))]
        );
        assert_eq!(h.unmatched().len(), 3);
    }

    #[test]
    fn a_reload_that_keeps_a_route_keeps_its_history_and_one_that_drops_it_does_not() {
        let h = History::new(10, 10);
        h.record(1000, [("api", t(1, 0)), ("login", t(5, 1))], t(0, 0));
        // Reload: `login` is gone, `admin` is new, `api` stays.
        h.record(3000, [("api", t(2, 0)), ("admin", t(0, 0))], t(0, 0));
        assert_eq!(h.route("api"), vec![(1000, t(1, 0)), (3000, t(2, 0))]);
        assert_eq!(h.route("admin"), vec![(3000, t(0, 0))]);
        assert_eq!(h.route("login"), vec![]);
        // Back again: it starts afresh.
        h.record(5000, [("login", t(5, 1))], t(0, 0));
        assert_eq!(h.route("login"), vec![(5000, t(5, 1))]);
        assert_eq!(h.route("api"), vec![]);
    }

    #[test]
    fn the_standard_history_covers_five_minutes_and_the_long_one_two_hours() {
        let h = History::standard();
        assert_eq!(h.capacity, 151);
        assert_eq!(SAMPLE_EVERY.as_millis() * (h.capacity as u128 - 1), 300_000);
        assert_eq!(h.long_capacity, 121);
        assert_eq!(
            LONG_EVERY.as_millis() * (h.long_capacity as u128 - 1),
            7_200_000
        );
    }

    #[test]
    fn the_long_history_keeps_the_first_sample_of_each_minute() {
        let h = History::new(4, 3);
        // Every 20 s from 00:00:50 to 00:04:10: 11 samples over 5 minutes.
        for i in 0..11u64 {
            let at = 50_000 + 20_000 * i;
            h.record(at, [("api", t(i, 0))], t(0, 0));
        }
        // The recent ring: the last 4.
        let recent: Vec<u64> = h.route("api").iter().map(|(at, _)| *at).collect();
        assert_eq!(recent, [190_000, 210_000, 230_000, 250_000]);
        // The long one: the first of minutes 0..=4 (00:00:50, 01:10, 02:10, 03:10,
        // 04:10), the last 3 kept, with their counts.
        assert_eq!(
            h.route_long("api"),
            vec![(130_000, t(4, 0)), (190_000, t(7, 0)), (250_000, t(10, 0))]
        );
    }
}
