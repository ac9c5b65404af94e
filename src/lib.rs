//! sluice: a rate-limiting reverse proxy.

pub mod limit;
