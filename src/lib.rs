//! sluice: a rate-limiting reverse proxy.

pub mod limit;
pub mod config;
