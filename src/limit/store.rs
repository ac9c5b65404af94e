//! The store a gateway decides its limits in, behind one type so the request path
//! does not care which it is. The memory store cannot fail; the Redis store reports
//! errors, and the gateway applies `on_error` (with `local`, through `fallback`,
//! which enforces this instance's share of each limit: the limit divided by the
//! live instances the fleet view last saw, `Store::set_live_instances`).

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use prometheus::{Histogram, IntCounter};

use super::{Checked, MemoryStore, Plan, RedisStore, Share, SystemClock};
use crate::telemetry::metrics::EvictionCounters;

/// A store's error: the Redis layer's (the memory store cannot fail).
pub use crate::redis::Error as StoreError;

/// What the gateway does while the shared store is unreachable: decide in this
/// instance's memory, forward unchecked, or answer 503.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    serde::Deserialize,
    serde::Serialize,
    schemars::JsonSchema,
    Default,
)]
#[serde(rename_all = "snake_case")]
pub enum OnError {
    #[default]
    Local,
    Allow,
    Deny,
}

pub enum Backend {
    Memory(MemoryStore),
    Redis {
        redis: RedisStore,
        /// Decides for this instance alone while Redis is unreachable
        /// (`on_error: local`); created on first use.
        fallback: OnceLock<MemoryStore>,
        fallback_max_keys: usize,
        /// Where the fallback counts its evictions of live state.
        evictions: Arc<EvictionCounters>,
        /// The live instances the fleet view last saw (this one included, at least
        /// 1): the fallback enforces each limit divided by it.
        live: AtomicU64,
    },
}

pub struct Store {
    backend: Backend,
    latency: Histogram,
    /// Failed calls; none for the memory store, which cannot fail.
    errors: Option<IntCounter>,
}

impl Store {
    pub fn memory(store: MemoryStore, metrics: &crate::telemetry::metrics::Metrics) -> Store {
        Store {
            backend: Backend::Memory(store),
            latency: metrics.limiter_duration.with_label_values(&["memory"]),
            errors: None,
        }
    }

    /// A Redis store; `fallback_max_keys` bounds the in-process fallback.
    pub fn redis(
        store: RedisStore,
        fallback_max_keys: usize,
        metrics: &crate::telemetry::metrics::Metrics,
    ) -> Store {
        store.count_calls_in(metrics.store_calls());
        Store {
            backend: Backend::Redis {
                redis: store,
                fallback: OnceLock::new(),
                fallback_max_keys,
                evictions: metrics.eviction_counters.clone(),
                live: AtomicU64::new(1),
            },
            latency: metrics.limiter_duration.with_label_values(&["redis"]),
            errors: Some(metrics.store_errors.with_label_values(&["redis"])),
        }
    }

    /// Decide one request against `plan` for `key` in the namespace `ns` (the route).
    /// An admitted request's concurrency slots are held by the permit of the answer.
    pub async fn check(&self, ns: &str, key: &str, plan: &Plan) -> Result<Checked, StoreError> {
        let timer = self.latency.start_timer();
        let v = match &self.backend {
            Backend::Memory(m) => Ok(m.acquire(ns, key, plan)),
            Backend::Redis { redis, .. } => redis.acquire(ns, key, plan).await,
        };
        self.observe(timer, &v);
        v
    }

    /// Times a decision and counts a failed one. A call the open breaker skipped is
    /// not a call: neither timed nor counted again.
    fn observe(&self, timer: prometheus::HistogramTimer, v: &Result<Checked, StoreError>) {
        match v {
            Err(StoreError::Open) => {
                timer.stop_and_discard();
            }
            Err(_) => {
                if let Some(errors) = &self.errors {
                    errors.inc();
                }
                timer.observe_duration();
            }
            Ok(_) => {
                timer.observe_duration();
            }
        }
    }

    /// `check` for a request whose limits count several keys (`Share`): admitted
    /// only if every share admits, and then charged to all of them.
    pub async fn check_shares(
        &self,
        shares: &[Share<'_>],
        trial: u64,
    ) -> Result<Checked, StoreError> {
        self.decide_shares(shares, trial, true).await
    }

    /// `check_shares` with every share decided by the store itself (on Redis, no
    /// refusal answered from the refusal cache): Envoy's rate limit service reports
    /// each descriptor's count, also beside a refusing one.
    pub async fn check_shares_asked(
        &self,
        shares: &[Share<'_>],
        trial: u64,
    ) -> Result<Checked, StoreError> {
        self.decide_shares(shares, trial, false).await
    }

    async fn decide_shares(
        &self,
        shares: &[Share<'_>],
        trial: u64,
        cached: bool,
    ) -> Result<Checked, StoreError> {
        let timer = self.latency.start_timer();
        let v = match &self.backend {
            Backend::Memory(m) => Ok(m.acquire_shares(shares, trial)),
            Backend::Redis { redis, .. } if cached => redis.acquire_shares(shares, trial).await,
            Backend::Redis { redis, .. } => redis.acquire_shares_asked(shares, trial).await,
        };
        self.observe(timer, &v);
        v
    }

    /// Charges what a response said requests cost (`limit::response`): each entry a
    /// namespace, a stored key and the limits to charge there (their `cost` the units
    /// the response said), whatever is left. Never waits: the memory store charges
    /// at once, the Redis store in a task of its own, one call for the response (on a
    /// cluster one per key). `fallback`: the request was decided in this instance's
    /// fallback (`on_error: local`), which is charged instead.
    pub fn charge_response(&self, charges: Vec<(String, String, Plan)>, fallback: bool) {
        self.settle(charges, fallback, false);
    }

    /// Gives back what responses charged less than the estimate they held
    /// (`limit::metered`): each entry's limits are `Charge::GiveBack`, their `cost`
    /// the units to give back. Never waits, as `charge_response`.
    pub fn give_back(&self, charges: Vec<(String, String, Plan)>, fallback: bool) {
        self.settle(charges, fallback, true);
    }

    fn settle(&self, charges: Vec<(String, String, Plan)>, fallback: bool, give_back: bool) {
        match &self.backend {
            Backend::Memory(m) => {
                for (ns, key, plan) in &charges {
                    m.charge_response(ns, key, plan);
                }
            }
            Backend::Redis {
                fallback: local, ..
            } if fallback => {
                if let Some(m) = local.get() {
                    let n = self.live_instances();
                    for (ns, key, plan) in &charges {
                        m.charge_response(ns, key, &plan.share(n));
                    }
                }
            }
            Backend::Redis { redis, .. } => {
                let (redis, errors) = (redis.clone(), self.errors.clone());
                let mut call = Box::pin(async move {
                    let shares: Vec<(&str, &str, &Plan)> = charges
                        .iter()
                        .map(|(ns, key, plan)| (ns.as_str(), key.as_str(), plan))
                        .collect();
                    let done = if give_back {
                        redis.give_back(&shares).await
                    } else {
                        redis.charge_response(&shares, None).await
                    };
                    if let Err(e) = done {
                        if let (Some(errors), false) = (&errors, matches!(e, StoreError::Open)) {
                            errors.inc();
                        }
                        tracing::debug!(error = %e, "a response's charge was not made");
                    }
                });
                // Polled once here, which hands the call to the connection before the
                // response goes out: on one Redis server, this instance's next
                // decision runs after it. Its answer is waited for in a task.
                let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                if call.as_mut().poll(&mut cx).is_pending() {
                    tokio::spawn(call);
                }
            }
        }
    }

    /// `fallback` for a request whose limits count several keys.
    pub fn fallback_shares(&self, shares: &[Share<'_>], trial: u64) -> Option<Checked> {
        let m = self.fallback_store()?;
        let n = self.live_instances();
        if n <= 1 {
            return Some(m.acquire_shares(shares, trial));
        }
        let plans: Vec<Plan> = shares.iter().map(|s| s.plan.share(n)).collect();
        let shares: Vec<Share<'_>> = shares
            .iter()
            .zip(&plans)
            .map(|(s, plan)| Share { plan, ..*s })
            .collect();
        Some(m.acquire_shares(&shares, trial))
    }

    /// Decide in this instance's memory while the shared store is unreachable
    /// (`on_error: local`), against this instance's share of each limit (the limit
    /// divided by the live instances last seen, rounded up). None for the memory
    /// store, which cannot fail.
    pub fn fallback(&self, ns: &str, key: &str, plan: &Plan) -> Option<Checked> {
        let m = self.fallback_store()?;
        Some(match self.live_instances() {
            0 | 1 => m.acquire(ns, key, plan),
            n => m.acquire(ns, key, &plan.share(n)),
        })
    }

    /// The live instances the fleet view saw last (at least 1; 1 on the memory
    /// store): what `on_error: local` divides each limit by.
    pub fn live_instances(&self) -> u64 {
        match &self.backend {
            Backend::Memory(_) => 1,
            Backend::Redis { live, .. } => live.load(Ordering::Relaxed).max(1),
        }
    }

    /// The fleet view saw `n` live instances (this one included).
    pub fn set_live_instances(&self, n: u64) {
        if let Backend::Redis { live, .. } = &self.backend {
            live.store(n.max(1), Ordering::Relaxed);
        }
    }

    /// Whether `on_error` splits limits over the fleet now: `local`, on the Redis
    /// store, while Redis does not answer (its breaker is open); then the divisor.
    pub fn degraded(&self, on_error: OnError) -> Option<u64> {
        (on_error == OnError::Local
            && matches!(self.backend, Backend::Redis { .. })
            && !self.ready())
        .then(|| self.live_instances())
    }

    /// The Redis store's in-process fallback, created on first use.
    fn fallback_store(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(_) => None,
            Backend::Redis {
                fallback,
                fallback_max_keys,
                evictions,
                ..
            } => Some(fallback.get_or_init(|| {
                MemoryStore::new(*fallback_max_keys, SystemClock::new())
                    .with_evictions(evictions.clone())
            })),
        }
    }

    /// Whether the store answers; `/readyz` reports it.
    pub fn ready(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) => true,
            Backend::Redis { redis, .. } => redis.ready(),
        }
    }

    /// The in-process store, if any: swept periodically.
    pub fn memory_store(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
            Backend::Redis { fallback, .. } => fallback.get(),
        }
    }

    /// The Redis store, if that is the backend.
    pub fn redis_store(&self) -> Option<&RedisStore> {
        match &self.backend {
            Backend::Memory(_) => None,
            Backend::Redis { redis, .. } => Some(redis),
        }
    }

    /// The Redis store's connection, if that is the backend: for the other users of
    /// the same Redis (the shared deny list, the fleet view).
    pub fn redis_connection(&self) -> Option<&crate::redis::Shared> {
        self.redis_store().map(RedisStore::redis)
    }
}
