//! What sluice tells operators: Prometheus metrics, the refusal log and the
//! heaviest refused clients of each route (`top`).

pub mod metrics;
pub mod refusal_log;
pub mod top;
