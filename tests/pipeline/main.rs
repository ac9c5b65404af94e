//! The request path in process: the gateway's decisions on both stores, the
//! `concurrency` algorithm and its faults, limiter state across a reload, and the
//! refusal log and the access log.

#[path = "../common/mod.rs"]
mod common;

mod access_log;
mod concurrency;
mod concurrency_faults;
#[macro_use]
mod gateway;
mod jwt;
mod metered;
mod refusal_logs;
mod reload_state;
mod upstream_body_failure;
mod upstream_metrics;
mod upstream_readers;
