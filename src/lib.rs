//! sluice: a rate-limiting reverse proxy. The layers, lowest first (each imports
//! only those before it): `http` (the wire), `identity` (who the client is),
//! `telemetry`, `redis` (sluice's one connection to Redis), `limit`, `deny`,
//! `upstream`, `jwt` (keys from verified tokens), `pipeline` (the request path: `pipeline::handle`), `config`, `rls`
//! (Envoy's rate limit service), `ops`
//! (control loop, admin API, stats), `server` (listeners, connections) and `cli`.
//! ARCHITECTURE.md draws them.

pub mod cli;
pub mod config;
pub mod deny;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod http;
pub mod identity;
pub mod jwt;

pub mod limit;
pub mod ops;
pub mod pipeline;
pub mod redis;
pub mod rls;
pub mod server;
pub mod telemetry;
pub mod upstream;
