//! Everything on real `redis-server` processes: the Redis store and its table of
//! cases, gateways sharing a Redis (or a cluster), the deny list shared through it,
//! store faults, `rediss://`, Redis Sentinel failovers, the fleet view, and degraded
//! mode (`on_error: local` splitting limits over the fleet in an outage).

#[path = "../common/mod.rs"]
mod common;

mod abuse;
mod abusers;
mod degraded;
mod fleet;
mod redis_gateway;
mod redis_live_ops;
mod redis_store;
mod redis_tls;
mod reserve;
mod scripts_on_the_wire;
mod sentinel;
mod store_faults;
