//! sluice: a rate-limiting reverse proxy. `gateway` is the request path; the other
//! modules are its phases and the machinery around it.

pub mod admin;
pub mod admin_client;
pub mod answer;
pub mod client;
pub mod config;
pub mod control;
pub mod deny;
pub mod deny_sync;
pub mod fuzzing;
pub mod gateway;
pub mod h1body;
pub mod h1server;
pub mod limit;
pub mod metrics;
pub mod path;
pub mod per_ip;
pub mod pool;
pub mod proxy;
pub mod refusal_log;
pub mod request;
pub mod route;
pub mod server;
pub mod stats;
pub(crate) mod wake;
pub mod wire;
