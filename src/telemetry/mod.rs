//! What sluice tells operators: Prometheus metrics and the refusal log.

pub mod metrics;
pub mod refusal_log;
