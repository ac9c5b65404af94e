//! The recent past, for the dashboard: every few seconds a sampler copies each
//! route's `sluice_requests_total` counters (kept by the request path anyway) into a
//! bounded ring per route name, so a page opened now already shows the last minutes
//! and a reload that keeps a route keeps its history. Nothing here runs per request.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::watch;

use crate::deny::now_ms;
use crate::pipeline::Shared;
use crate::telemetry::metrics::Decision;

/// How often the sampler reads the counters.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(2);
/// How far back the history reaches.
pub const KEEP: Duration = Duration::from_secs(5 * 60);

/// One route's counters at one moment, in the order of `Decision::ALL`.
pub type Totals = [u64; Decision::ALL.len()];

/// One sample: wall-clock milliseconds since the epoch, and the counters then.
pub type Sample = (u64, Totals);

/// The rings of every route, and of requests that matched none.
pub struct History {
    capacity: usize,
    inner: Mutex<Rings>,
}

#[derive(Default)]
struct Rings {
    routes: HashMap<String, VecDeque<Sample>>,
    unmatched: VecDeque<Sample>,
}

impl History {
    /// Rings of at most `capacity` samples each.
    pub fn new(capacity: usize) -> History {
        History {
            capacity: capacity.max(1),
            inner: Mutex::new(Rings::default()),
        }
    }

    /// Enough samples of `SAMPLE_EVERY` to cover `KEEP` (and the moment it starts).
    pub fn standard() -> History {
        let n = KEEP.as_millis() / SAMPLE_EVERY.as_millis();
        History::new(usize::try_from(n).unwrap_or(usize::MAX).saturating_add(1))
    }

    /// Appends one sample of every route there is now; a route missing from
    /// `routes` (a reload removed it) loses its history.
    pub fn record<'a>(
        &self,
        at_ms: u64,
        routes: impl IntoIterator<Item = (&'a str, Totals)>,
        unmatched: Totals,
    ) {
        let cap = self.capacity;
        let push = |ring: &mut VecDeque<Sample>, totals: Totals| {
            while ring.len() >= cap {
                ring.pop_front();
            }
            ring.push_back((at_ms, totals));
        };
        let mut rings = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
        let mut seen = HashSet::new();
        for (name, totals) in routes {
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
}

/// Reads every route's counters once, now.
pub fn sample(shared: &Shared, history: &History) {
    let rt = shared.runtime.load();
    history.record(
        now_ms(),
        rt.routes
            .iter()
            .map(|r| (r.name.as_str(), r.metrics.totals())),
        rt.unmatched.totals(),
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
        let mut t = [0; Decision::ALL.len()];
        t[0] = allowed;
        t[2] = limited;
        t
    }

    #[test]
    fn a_ring_keeps_the_newest_samples_up_to_its_capacity() {
        let h = History::new(3);
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
        let h = History::new(10);
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
    fn the_standard_history_covers_five_minutes() {
        let h = History::standard();
        assert_eq!(h.capacity, 151);
        assert_eq!(SAMPLE_EVERY.as_millis() * (h.capacity as u128 - 1), 300_000);
    }
}
