//! sluice's one connection to Redis: the shared connection (one server, a
//! Cluster, or the primary Redis Sentinel names), every script by EVALSHA, the
//! batching of script calls, and the breaker that stops calling a Redis that keeps
//! failing. `limit` (the limiter's store) and `deny` (the shared list) use it; a call
//! looks the same wherever it is made: `Shared::call`.
//!
//! (The folder is named for what it talks to; inside the crate the `redis` crate is
//! `::redis` where the two could be confused.)

pub mod batch;
pub mod breaker;
pub mod conn;
pub mod scripts;
pub mod sentinel;

pub use conn::{Shared, Target};
pub use scripts::{Eval, Numbers, Request, Script};
pub use sentinel::{PrimaryUrl, SentinelTarget};

/// What a call to Redis (or the store built on it) ended with, when not an answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum Error {
    #[error("store unavailable: {0}")]
    Unavailable(String),
    #[error("store did not answer in time")]
    Timeout,
    /// Not called: the store failed repeatedly and has not answered a probe since.
    #[error("store unavailable (breaker open)")]
    Open,
    #[error("store configuration: {0}")]
    Config(String),
}

impl Error {
    /// A Redis error as the callers see it.
    pub fn of(e: ::redis::RedisError) -> Error {
        Error::Unavailable(e.to_string())
    }
}
