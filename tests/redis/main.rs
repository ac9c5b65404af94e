//! Everything on real `redis-server` processes: the Redis store and its table of
//! cases, gateways sharing a Redis (or a cluster), the deny list shared through it,
//! store faults, `rediss://`, Redis Sentinel failovers, and the fleet view.

#[path = "../common/mod.rs"]
mod common;

mod abuse;
mod abusers;
mod fleet;
mod redis_gateway;
mod redis_live_ops;
mod redis_store;
mod redis_tls;
mod reserve;
mod rls;
mod rls_envoy;
mod scripts_on_the_wire;
mod sentinel;
mod store_faults;
