//! Every metric sluice exports, created and registered once at startup. The request
//! path never formats a label: each route resolves its labelled children when the
//! configuration is compiled (`RouteMetrics`), and a client key is never a label.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, PoisonError, RwLock};

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Latency buckets from 100µs to 10s: wide enough for a limiter call and a proxied
/// request alike.
const BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// The `source` label values of `sluice_deny_entries`: `deny::Source`'s names.
pub const DENY_SOURCES: [&str; 3] = ["static", "api", "ban"];

pub struct Metrics {
    registry: Registry,
    pub requests: IntCounterVec,
    pub request_duration: HistogramVec,
    pub limiter_duration: HistogramVec,
    pub store_errors: IntCounterVec,
    pub store_evictions: IntCounterVec,
    /// `store_evictions` children by limiter namespace, for the memory stores.
    pub eviction_counters: Arc<EvictionCounters>,
    pub upstream_errors: IntCounterVec,
    pub client_errors: IntCounterVec,
    /// The children of `client_errors`, resolved once.
    pub client_body: IntCounter,
    pub client_aborted: IntCounter,
    pub client_timeout: IntCounter,
    /// Connections closed at accept, by reason (`per_ip`).
    pub connections_refused: IntCounterVec,
    pub config_reloads: IntCounterVec,
    pub config_last_reload_success: IntGauge,
    /// `sluice_store_degraded`: 1 while `on_error: local` splits limits over the
    /// fleet (set when `/metrics` is read, and by the fleet's heartbeat).
    pub store_degraded: IntGauge,
    pub deny_entries: IntGaugeVec,
    pub bans: IntCounterVec,
    /// Charges of limits whose cost the response says (a header, the body), by
    /// where the charge came from (`limit::CostFrom`).
    pub response_costs: IntCounterVec,
    upstream_responses: IntCounterVec,
    /// `sluice_upstream_target_healthy{upstream,target}`: each child is resolved
    /// when its upstream starts serving (`upstream::health::start`), and removed
    /// when a reload drops the target.
    pub upstream_target_healthy: IntGaugeVec,
    /// `sluice_limit_refusals_total{route,limit}`: refusals by the limit reported.
    pub limit_refusals: IntCounterVec,
    /// `sluice_reserve_unused_total{route,limit}`: units taken in advance (`reserve`)
    /// and never spent.
    pub reserve_unused: IntCounterVec,
    /// `sluice_store_calls_total{store,kind}`: its children are created (at 0) only
    /// for a Redis store (`store_calls`).
    store_calls: IntCounterVec,
    /// Dynamic deny entries evicted by a newer one at `deny.max_entries`.
    pub deny_evictions: IntCounter,
    pub build_info: IntGaugeVec,
    /// Refusal log lines not written, over the per-second budget.
    pub refusal_logs_dropped: IntCounter,
    /// Access log lines of refused requests not written, over the per-second budget.
    pub access_logs_dropped: IntCounter,
    /// Request body bytes held by read-aheads in the whole process, and the
    /// read-aheads refused at `server.max_buffered_bytes`.
    pub read_ahead: Arc<ReadAheadBytes>,
    /// `sluice_rls_requests_total{domain,code}`: Envoy's rate limit service's calls
    /// by their answer.
    pub rls_requests: IntCounterVec,
    /// `sluice_rls_descriptors_total{domain,descriptor,decision}`: each descriptor's
    /// decision, by the configuration node it reached (never by its values).
    pub rls_descriptors: IntCounterVec,
    /// `sluice_jwt_failures_total{route,reason}`: tokens refused on routes with
    /// `jwt`, by reason (`jwt::Failure`), created at 0 for those routes.
    pub jwt_failures: IntCounterVec,
}

/// Request body bytes read ahead (`server.request_buffer`) and held until an
/// upstream connection takes them, counted across every upstream and connection,
/// so that `server.max_buffered_bytes` bounds them all. Only requests that read
/// ahead touch it: one compare-and-swap per frame read, one subtraction per frame
/// sent on.
pub struct ReadAheadBytes {
    held: AtomicUsize,
    /// `sluice_read_ahead_refused_total`: read-aheads answered 503 at the bound.
    pub refused: IntCounter,
    /// `sluice_read_ahead_bytes`, set from `held` when the metrics are rendered.
    gauge: IntGauge,
}

impl ReadAheadBytes {
    /// Take `n` more bytes if the process then holds at most `max`.
    pub fn take(&self, n: usize, max: usize) -> bool {
        self.held
            .fetch_update(Relaxed, Relaxed, |held| {
                held.checked_add(n).filter(|&total| total <= max)
            })
            .is_ok()
    }

    /// Give back `n` bytes taken before.
    pub fn give(&self, n: usize) {
        if n > 0 {
            self.held.fetch_sub(n, Relaxed);
        }
    }

    /// The bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Relaxed)
    }

    /// A count of its own, exported nowhere: for sluice's own requests (a JWKS
    /// fetch), which send no body.
    pub fn detached() -> ReadAheadBytes {
        ReadAheadBytes {
            held: AtomicUsize::new(0),
            refused: detached(),
            gauge: IntGauge::new("sluice_detached_bytes", "not exported")
                .expect("metric definition"),
        }
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new("sluice_requests_total", "Requests by route and decision."),
            &["route", "decision"],
        )
        .expect("metric definition");
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_request_duration_seconds",
                "Time from request head to the end of the response body (or the client going away), by route.",
            )
            .buckets(BUCKETS.to_vec()),
            &["route"],
        )
        .expect("metric definition");
        let limiter_duration = HistogramVec::new(
            HistogramOpts::new(
                "sluice_limiter_duration_seconds",
                "Time to decide a request's limits, by store.",
            )
            .buckets(BUCKETS.to_vec()),
            &["store"],
        )
        .expect("metric definition");
        let store_errors = IntCounterVec::new(
            Opts::new(
                "sluice_store_errors_total",
                "Limiter calls that failed, by store.",
            ),
            &["store"],
        )
        .expect("metric definition");
        let store_evictions = IntCounterVec::new(
            Opts::new(
                "sluice_store_evictions_total",
                "Limiter state evicted from the memory store while still in use (the store was full), by route.",
            ),
            &["route"],
        )
        .expect("metric definition");
        let upstream_errors = IntCounterVec::new(
            Opts::new(
                "sluice_upstream_errors_total",
                "Upstream failures by route and kind (connect, timeout, reset, busy).",
            ),
            &["route", "kind"],
        )
        .expect("metric definition");
        let client_errors = IntCounterVec::new(
            Opts::new(
                "sluice_client_errors_total",
                "Requests whose body the client did not complete, by kind (body: malformed, aborted: closed mid-body, timeout: stalled for server.request_body_timeout); never forwarded.",
            ),
            &["kind"],
        )
        .expect("metric definition");
        let connections_refused = IntCounterVec::new(
            Opts::new(
                "sluice_connections_refused_total",
                "Client connections closed at once when accepted, by reason (per_ip).",
            ),
            &["reason"],
        )
        .expect("metric definition");
        let config_reloads = IntCounterVec::new(
            Opts::new(
                "sluice_config_reloads_total",
                "Configuration reloads by result.",
            ),
            &["result"],
        )
        .expect("metric definition");
        let config_last_reload_success = IntGauge::new(
            "sluice_config_last_reload_success",
            "1 if the last configuration reload succeeded, else 0.",
        )
        .expect("metric definition");
        let store_degraded = IntGauge::new(
            "sluice_store_degraded",
            "1 while Redis is unreachable and on_error: local enforces this instance's share of each limit, else 0.",
        )
        .expect("metric definition");
        let deny_entries = IntGaugeVec::new(
            Opts::new("sluice_deny_entries", "Deny-list entries by source."),
            &["source"],
        )
        .expect("metric definition");
        let bans = IntCounterVec::new(
            Opts::new("sluice_bans_total", "Keys banned automatically, by route."),
            &["route"],
        )
        .expect("metric definition");
        let upstream_responses = IntCounterVec::new(
            Opts::new(
                "sluice_upstream_responses_total",
                "Responses from the upstream by route and status class (1xx to 5xx); answers sluice writes itself are not counted.",
            ),
            &["route", "code"],
        )
        .expect("metric definition");
        let upstream_target_healthy = IntGaugeVec::new(
            Opts::new(
                "sluice_upstream_target_healthy",
                "1 while an upstream target is in use, 0 while it is left out (max_fails connections failed within fail_timeout, or two health checks in a row).",
            ),
            &["upstream", "target"],
        )
        .expect("metric definition");
        let limit_refusals = IntCounterVec::new(
            Opts::new(
                "sluice_limit_refusals_total",
                "Requests refused (429) by route and by the limit that refused (the one the answer reports).",
            ),
            &["route", "limit"],
        )
        .expect("metric definition");
        let response_costs = IntCounterVec::new(
            Opts::new(
                "sluice_response_costs_total",
                "Responses that charged a limit whose cost the response says, by route, limit and where the charge came from: header (a response header), json (a JSON body), sse (the last values of an event stream), estimate (nothing read, the estimate held: the client went away), default (the response did not say), invalid (what it said is no cost: the default or the estimate), capped (at the limit's quota).",
            ),
            &["route", "limit", "source"],
        )
        .expect("metric definition");
        let reserve_unused = IntCounterVec::new(
            Opts::new(
                "sluice_reserve_unused_total",
                "Units of a limit with reserve that this instance took from the shared count and never spent (their window ended, they faded, a reload changed the limit, or the key was dropped), by route and limit.",
            ),
            &["route", "limit"],
        )
        .expect("metric definition");
        let store_calls_vec = IntCounterVec::new(
            Opts::new(
                "sluice_store_calls_total",
                "Calls to the Redis store by kind: decide (a script call deciding requests, several at once under load, taking units for reserve), refund, charge (costs from responses), renew and release (concurrency leases), probe (while the breaker is open, and the idle check), other (deny list, fleet view); local counts requests admitted from units held (reserve), which make no call.",
            ),
            &["store", "kind"],
        )
        .expect("metric definition");
        let deny_evictions = IntCounter::new(
            "sluice_deny_evictions_total",
            "Dynamic deny-list entries evicted at deny.max_entries by a newer entry.",
        )
        .expect("metric definition");
        let build_info = IntGaugeVec::new(
            Opts::new("sluice_build_info", "Build information; always 1."),
            &["version"],
        )
        .expect("metric definition");
        let refusal_logs_dropped = IntCounter::new(
            "sluice_refusal_logs_dropped_total",
            "Refusal log lines not written because a second's budget was spent.",
        )
        .expect("metric definition");
        let access_logs_dropped = IntCounter::new(
            "sluice_access_logs_dropped_total",
            "Access log lines of refused requests not written because a second's budget was spent.",
        )
        .expect("metric definition");
        let read_ahead_refused = IntCounter::new(
            "sluice_read_ahead_refused_total",
            "Requests answered 503 because reading their body ahead would have held more than server.max_buffered_bytes in the whole process.",
        )
        .expect("metric definition");
        let read_ahead_bytes = IntGauge::new(
            "sluice_read_ahead_bytes",
            "Request body bytes read ahead (server.request_buffer) and held until an upstream connection takes them, in the whole process.",
        )
        .expect("metric definition");
        let rls_requests = IntCounterVec::new(
            Opts::new(
                "sluice_rls_requests_total",
                "ShouldRateLimit calls of Envoy's rate limit service by domain (_unknown for a domain of no file) and answer: ok, over_limit, error (a malformed call, or the store failed with on_error allow or deny).",
            ),
            &["domain", "code"],
        )
        .expect("metric definition");
        let rls_descriptors = IntCounterVec::new(
            Opts::new(
                "sluice_rls_descriptors_total",
                "Descriptors decided by Envoy's rate limit service, by domain, the configuration node they reached (_none when none) and decision: ok, over_limit, shadow (over its shadow_mode limit, answered OK), unlimited, denied (the deny list), none (no limit), store_error.",
            ),
            &["domain", "descriptor", "decision"],
        )
        .expect("metric definition");
        let jwt_failures = IntCounterVec::new(
            Opts::new(
                "sluice_jwt_failures_total",
                "Requests answered 401 on routes that verify a JWT, by route and reason: missing, malformed, algorithm, unknown_kid, signature, expired, not_yet_valid, issuer, audience, no_keys.",
            ),
            &["route", "reason"],
        )
        .expect("metric definition");
        for c in [
            Box::new(requests.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(jwt_failures.clone()),
            Box::new(rls_requests.clone()),
            Box::new(rls_descriptors.clone()),
            Box::new(read_ahead_refused.clone()),
            Box::new(read_ahead_bytes.clone()),
            Box::new(request_duration.clone()),
            Box::new(limiter_duration.clone()),
            Box::new(store_errors.clone()),
            Box::new(store_evictions.clone()),
            Box::new(upstream_errors.clone()),
            Box::new(client_errors.clone()),
            Box::new(connections_refused.clone()),
            Box::new(config_reloads.clone()),
            Box::new(config_last_reload_success.clone()),
            Box::new(store_degraded.clone()),
            Box::new(deny_entries.clone()),
            Box::new(bans.clone()),
            Box::new(response_costs.clone()),
            Box::new(upstream_responses.clone()),
            Box::new(upstream_target_healthy.clone()),
            Box::new(limit_refusals.clone()),
            Box::new(reserve_unused.clone()),
            Box::new(store_calls_vec.clone()),
            Box::new(deny_evictions.clone()),
            Box::new(build_info.clone()),
            Box::new(refusal_logs_dropped.clone()),
            Box::new(access_logs_dropped.clone()),
        ] {
            registry.register(c).expect("metric registered once");
        }
        build_info
            .with_label_values(&[env!("CARGO_PKG_VERSION")])
            .set(1);
        config_last_reload_success.set(1);
        // Every child that can happen, exported at 0 from the start.
        for result in ["success", "failure"] {
            config_reloads.with_label_values(&[result]);
        }
        connections_refused.with_label_values(&["per_ip"]);
        for source in DENY_SOURCES {
            deny_entries.with_label_values(&[source]);
        }
        let client_body = client_errors.with_label_values(&["body"]);
        let client_aborted = client_errors.with_label_values(&["aborted"]);
        let client_timeout = client_errors.with_label_values(&["timeout"]);
        Metrics {
            registry,
            requests,
            request_duration,
            limiter_duration,
            store_errors,
            store_evictions,
            eviction_counters: Arc::new(EvictionCounters::default()),
            upstream_errors,
            client_errors,
            client_body,
            client_aborted,
            client_timeout,
            connections_refused,
            config_reloads,
            config_last_reload_success,
            store_degraded,
            deny_entries,
            bans,
            response_costs,
            upstream_responses,
            upstream_target_healthy,
            limit_refusals,
            reserve_unused,
            store_calls: store_calls_vec,
            deny_evictions,
            build_info,
            refusal_logs_dropped,
            access_logs_dropped,
            read_ahead: Arc::new(ReadAheadBytes {
                held: AtomicUsize::new(0),
                refused: read_ahead_refused,
                gauge: read_ahead_bytes,
            }),
            rls_requests,
            rls_descriptors,
            jwt_failures,
        }
    }

    /// The children of `sluice_store_calls_total` for the Redis store, created at 0.
    pub fn store_calls(&self) -> Arc<StoreCalls> {
        Arc::new(StoreCalls::new(&self.store_calls))
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(8 * 1024);
        let read_ahead = &self.read_ahead;
        read_ahead
            .gauge
            .set(i64::try_from(read_ahead.held()).unwrap_or(i64::MAX));
        // Encoding into a Vec cannot fail for the text format.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        buf
    }

    /// Resolve the children of one route once, at compile time.
    pub fn route(&self, route: &str) -> RouteMetrics {
        let d = |decision: &str| self.requests.with_label_values(&[route, decision]);
        let u = |kind: &str| self.upstream_errors.with_label_values(&[route, kind]);
        RouteMetrics {
            allowed: d("allowed"),
            delayed: d("delayed"),
            limited: d("limited"),
            denied: d("denied"),
            shadow: d("shadow"),
            store_error_allowed: d("store_error_allowed"),
            store_error_denied: d("store_error_denied"),
            unmatched: detached(),
            bad_request: d("bad_request"),
            unauthorized: detached(),
            duration: self.request_duration.with_label_values(&[route]),
            upstream_connect: u("connect"),
            upstream_timeout: u("timeout"),
            upstream_reset: u("reset"),
            upstream_busy: u("busy"),
            upstream_status: ["1xx", "2xx", "3xx", "4xx", "5xx"]
                .map(|code| self.upstream_responses.with_label_values(&[route, code])),
        }
    }

    /// Creates the route's `sluice_store_evictions_total` child at 0, and tells the
    /// memory stores that state in each of `namespaces` belongs to `route`.
    pub fn store_namespaces(&self, route: &str, namespaces: &[&str]) {
        let counter = self.store_evictions.with_label_values(&[route]);
        let mut by_ns = self
            .eviction_counters
            .by_ns
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        for ns in namespaces {
            by_ns.insert((*ns).to_string(), counter.clone());
        }
    }

    /// The children for requests that match no route (label `unmatched`): only the
    /// decisions such a request can get are exported.
    pub fn unmatched(&self) -> RouteMetrics {
        let d = |decision: &str| self.requests.with_label_values(&[UNMATCHED, decision]);
        RouteMetrics {
            allowed: detached(),
            delayed: detached(),
            limited: detached(),
            denied: d("denied"),
            shadow: detached(),
            store_error_allowed: detached(),
            store_error_denied: detached(),
            unmatched: d("unmatched"),
            bad_request: d("bad_request"),
            unauthorized: detached(),
            duration: self.request_duration.with_label_values(&[UNMATCHED]),
            upstream_connect: detached(),
            upstream_timeout: detached(),
            upstream_reset: detached(),
            upstream_busy: detached(),
            upstream_status: [(); 5].map(|_| detached()),
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

/// The `sluice_store_evictions_total` children, resolved when routes are compiled and
/// found by the namespace a store was given (a route's, or its IP fallback's).
#[derive(Default)]
pub struct EvictionCounters {
    by_ns: RwLock<HashMap<String, IntCounter>>,
}

impl EvictionCounters {
    /// One live entry of `ns` evicted; a namespace no route has is not counted.
    pub fn count(&self, ns: &str) {
        let by_ns = self.by_ns.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(c) = by_ns.get(ns) {
            c.inc();
        }
    }
}

/// The route label of requests that match no route.
pub const UNMATCHED: &str = "unmatched";

/// A counter registered nowhere: stands in for label combinations that cannot
/// happen, so they are not exported as misleading zeros.
fn detached() -> IntCounter {
    IntCounter::new("sluice_detached", "not exported").expect("metric definition")
}

/// What a request was decided to be, as counted in `sluice_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    Allowed,
    Delayed,
    Limited,
    Denied,
    Shadow,
    StoreErrorAllowed,
    StoreErrorDenied,
    Unmatched,
    BadRequest,
    /// No valid JWT on a route that verifies one (401).
    Unauthorized,
}

impl Decision {
    /// Every decision, in the order of declaration (a unit test holds them to it),
    /// which is that of `RouteMetrics::totals`.
    pub const ALL: [Decision; 10] = [
        Decision::Allowed,
        Decision::Delayed,
        Decision::Limited,
        Decision::Denied,
        Decision::Shadow,
        Decision::StoreErrorAllowed,
        Decision::StoreErrorDenied,
        Decision::Unmatched,
        Decision::BadRequest,
        Decision::Unauthorized,
    ];

    /// The decisions a route's requests can get (every one but `unmatched`), in the
    /// order of `ALL`.
    pub fn of_route() -> impl Iterator<Item = Decision> + Clone {
        Decision::ALL
            .into_iter()
            .filter(|d| *d != Decision::Unmatched)
    }

    /// Its place in `ALL` (and in `RouteMetrics::totals`): the order of declaration.
    pub fn index(self) -> usize {
        self as usize
    }

    /// The `decision` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Allowed => "allowed",
            Decision::Delayed => "delayed",
            Decision::Limited => "limited",
            Decision::Denied => "denied",
            Decision::Shadow => "shadow",
            Decision::StoreErrorAllowed => "store_error_allowed",
            Decision::StoreErrorDenied => "store_error_denied",
            Decision::Unmatched => "unmatched",
            Decision::BadRequest => "bad_request",
            Decision::Unauthorized => "unauthorized",
        }
    }
}

/// The labelled children of one route.
#[derive(Clone)]
pub struct RouteMetrics {
    allowed: IntCounter,
    delayed: IntCounter,
    limited: IntCounter,
    denied: IntCounter,
    shadow: IntCounter,
    store_error_allowed: IntCounter,
    store_error_denied: IntCounter,
    unmatched: IntCounter,
    bad_request: IntCounter,
    /// Exported (at 0) only on routes that verify a JWT (`with_unauthorized`).
    unauthorized: IntCounter,
    pub duration: Histogram,
    pub upstream_connect: IntCounter,
    pub upstream_timeout: IntCounter,
    pub upstream_reset: IntCounter,
    pub upstream_busy: IntCounter,
    /// `sluice_upstream_responses_total`, by status class: `[1xx, …, 5xx]`.
    pub upstream_status: [IntCounter; 5],
}

impl RouteMetrics {
    /// For a route that verifies a JWT: its `unauthorized` decision, and its
    /// `sluice_jwt_failures_total` children by `reasons`, exported at 0.
    pub fn with_unauthorized(
        mut self,
        metrics: &Metrics,
        route: &str,
        reasons: &[&str],
    ) -> (RouteMetrics, Vec<IntCounter>) {
        self.unauthorized = metrics.requests.with_label_values(&[route, "unauthorized"]);
        let failures = reasons
            .iter()
            .map(|r| metrics.jwt_failures.with_label_values(&[route, r]))
            .collect();
        (self, failures)
    }

    pub fn count(&self, d: Decision) {
        self.counter(d).inc();
    }

    /// One response from the upstream with `status` (100 to 599).
    #[inline]
    pub fn upstream_answered(&self, status: u16) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.upstream_status[class].inc();
    }

    /// The route's `sluice_upstream_responses_total` counters now, 1xx to 5xx.
    pub fn upstream_totals(&self) -> [u64; 5] {
        std::array::from_fn(|i| self.upstream_status[i].get())
    }

    /// The route's `sluice_upstream_errors_total` counters now: connect, timeout,
    /// reset, busy.
    pub fn upstream_error_totals(&self) -> [u64; 4] {
        [
            self.upstream_connect.get(),
            self.upstream_timeout.get(),
            self.upstream_reset.get(),
            self.upstream_busy.get(),
        ]
    }

    #[inline]
    fn counter(&self, d: Decision) -> &IntCounter {
        match d {
            Decision::Allowed => &self.allowed,
            Decision::Delayed => &self.delayed,
            Decision::Limited => &self.limited,
            Decision::Denied => &self.denied,
            Decision::Shadow => &self.shadow,
            Decision::StoreErrorAllowed => &self.store_error_allowed,
            Decision::StoreErrorDenied => &self.store_error_denied,
            Decision::Unmatched => &self.unmatched,
            Decision::BadRequest => &self.bad_request,
            Decision::Unauthorized => &self.unauthorized,
        }
    }

    /// The route's `sluice_requests_total` counters now, in the order of
    /// `Decision::ALL` (read by the dashboard; the request path never calls it).
    pub fn totals(&self) -> [u64; 10] {
        Decision::ALL.map(|d| self.counter(d).get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decision_is_in_all_at_its_index() {
        for (i, d) in Decision::ALL.into_iter().enumerate() {
            assert_eq!(d.index(), i, "{}", d.as_str());
        }
    }
}

/// The kinds of Redis call the store makes (`sluice_store_calls_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    Decide,
    Refund,
    Charge,
    Renew,
    Release,
    Probe,
    Other,
    /// Not a call: a request admitted from units held (`reserve`).
    Local,
}

impl CallKind {
    pub const ALL: [CallKind; 8] = [
        CallKind::Decide,
        CallKind::Refund,
        CallKind::Charge,
        CallKind::Renew,
        CallKind::Release,
        CallKind::Probe,
        CallKind::Other,
        CallKind::Local,
    ];

    pub fn label(self) -> &'static str {
        match self {
            CallKind::Decide => "decide",
            CallKind::Refund => "refund",
            CallKind::Charge => "charge",
            CallKind::Renew => "renew",
            CallKind::Release => "release",
            CallKind::Probe => "probe",
            CallKind::Other => "other",
            CallKind::Local => "local",
        }
    }
}

/// `sluice_store_calls_total`'s children for the Redis store, created at 0 and
/// resolved once. A store not given them (`RedisStore::count_calls_in`) counts
/// nothing.
#[derive(Debug)]
pub struct StoreCalls {
    by_kind: [IntCounter; 8],
}

impl StoreCalls {
    fn new(vec: &IntCounterVec) -> StoreCalls {
        StoreCalls {
            by_kind: CallKind::ALL.map(|k| vec.with_label_values(&["redis", k.label()])),
        }
    }

    pub fn count(&self, kind: CallKind) {
        self.by_kind[kind as usize].inc();
    }
}
