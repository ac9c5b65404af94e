//! The store a gateway decides its limits in, behind one type so the request path
//! does not care which it is. The memory store cannot fail; the Redis store (next)
//! reports errors and the gateway applies `on_error`.

use prometheus::Histogram;

use super::{MemoryStore, Plan, Verdict};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store did not answer in time")]
    Timeout,
}

pub enum Backend {
    Memory(MemoryStore),
}

pub struct Store {
    backend: Backend,
    latency: Histogram,
}

impl Store {
    pub fn memory(store: MemoryStore, metrics: &crate::metrics::Metrics) -> Store {
        Store {
            backend: Backend::Memory(store),
            latency: metrics.limiter_duration.with_label_values(&["memory"]),
        }
    }

    /// Decide one request against `plan` for `key` in the namespace `ns` (the route).
    pub async fn check(&self, ns: &str, key: &str, plan: &Plan) -> Result<Verdict, StoreError> {
        let timer = self.latency.start_timer();
        let v = match &self.backend {
            Backend::Memory(m) => Ok(m.check(ns, key, plan)),
        };
        timer.observe_duration();
        v
    }

    /// Whether the store answers; `/readyz` reports it.
    pub fn ready(&self) -> bool {
        match &self.backend {
            Backend::Memory(_) => true,
        }
    }

    /// The in-process store, if any: swept periodically.
    pub fn memory_store(&self) -> Option<&MemoryStore> {
        match &self.backend {
            Backend::Memory(m) => Some(m),
        }
    }
}
