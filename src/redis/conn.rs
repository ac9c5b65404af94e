//! The shared connection: multiplexed, reconnecting, to one server, a Cluster, or
//! the primary Redis Sentinel names at the time of the call; every command goes
//! through `Shared::call`, under a deadline, counted. Also where a pub/sub
//! connection comes from.

use std::future::Future;
use std::sync::{Arc, OnceLock, Weak};
use std::task::Poll;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig, PubSub};
use ::redis::cluster::{ClusterClientBuilder, ClusterConfig};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, ServerErrorKind};

use super::breaker::Breaker;
use super::scripts::{self, Request, Script};
use super::sentinel::{Primary, SentinelTarget};
use super::Error;
use crate::telemetry::metrics::{CallKind, StoreCalls};

#[derive(Debug, Clone)]
pub enum Target {
    /// One server: `redis://` or `rediss://`.
    Url(String),
    /// Redis Cluster seed nodes.
    Cluster(Vec<String>),
    /// One server, the primary Redis Sentinel names, followed through failovers.
    Sentinel(SentinelTarget),
}

/// The connection to Redis, shared by every user of it (cloning is cheap).
#[derive(Clone)]
pub struct Shared(pub(super) Arc<Conn>);

pub(super) struct Conn {
    link: Link,
    target: Target,
    /// Bound on one limiter call; the default deadline of a call.
    timeout: Duration,
    prefix: String,
    pub(super) breaker: Breaker,
    /// Where calls are counted (`sluice_store_calls_total`): set once, by `Store`.
    calls: OnceLock<Arc<StoreCalls>>,
}

/// A multiplexed connection, shared by concurrent requests (cloning is cheap).
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

/// Where the connection comes from: fixed at startup, or the one to the primary Redis
/// Sentinel names at the time of the call.
enum Link {
    Fixed(Connection),
    Sentinel(Arc<Primary>),
}

impl Link {
    fn get(&self) -> RedisResult<Connection> {
        match self {
            Link::Fixed(c) => Ok(c.clone()),
            Link::Sentinel(p) => p.connection().map(Connection::Single),
        }
    }
}

// === impl Shared ===

impl Shared {
    /// The connection to `target`, made lazily (an unreachable Redis is not an error
    /// here); each call is bounded by `timeout` unless it says otherwise; keys go
    /// under `prefix`.
    pub async fn connect(
        target: Target,
        timeout: Duration,
        prefix: String,
    ) -> Result<Shared, Error> {
        let timeout = timeout.max(Duration::from_millis(1));
        let connect_timeout = connect_timeout(timeout);
        let config = |e: ::redis::RedisError| Error::Config(e.to_string());
        // No response timeout of the client's own: every command is sent under a
        // deadline of ours (`timeout` for a limiter call), and a second timer per call
        // would only cost.
        let single = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(None)
            // A reconnect is retried once, soon; the breaker does the rest.
            .set_number_of_retries(1)
            .set_min_delay(Duration::from_millis(10))
            .set_max_delay(timeout);
        let link = match &target {
            Target::Url(url) => {
                let client = ::redis::Client::open(url.as_str()).map_err(config)?;
                Link::Fixed(Connection::Single(
                    ConnectionManager::new_lazy_with_config(client, single).map_err(config)?,
                ))
            }
            Target::Sentinel(target) => {
                Link::Sentinel(Primary::start(target.clone(), single, connect_timeout).await)
            }
            Target::Cluster(nodes) => {
                let client = ClusterClientBuilder::new(nodes.iter().map(String::as_str))
                    .connection_timeout(connect_timeout)
                    .response_timeout(timeout)
                    // One retry for a MOVED/ASK redirection; both bounded by `timeout`.
                    .retries(1)
                    .min_retry_wait(1)
                    .max_retry_wait(timeout.as_millis().max(1) as u64)
                    .build()
                    .map_err(config)?;
                let cfg = ClusterConfig::new()
                    .set_connection_timeout(connect_timeout)
                    .set_response_timeout(timeout);
                Link::Fixed(Connection::Cluster(
                    client.get_pending_async_connection_with_config(cfg),
                ))
            }
        };
        Ok(Shared(Arc::new(Conn {
            link,
            target,
            timeout,
            prefix,
            breaker: Breaker::default(),
            calls: OnceLock::new(),
        })))
    }

    /// Sends `req` (a command, or a script by EVALSHA, whole after NOSCRIPT), counted
    /// as `kind`, bounded by `within`. The one way to call Redis.
    pub async fn call<T: FromRedisValue, R: Request + ?Sized>(
        &self,
        kind: CallKind,
        req: &R,
        within: Duration,
    ) -> Result<T, Error> {
        self.count(kind);
        let call = async {
            let cmd = req.cmd();
            match (self.0.query::<T>(cmd).await, req.script()) {
                (Err(e), Some(script))
                    if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) =>
                {
                    self.0.query(&scripts::whole(script, cmd)).await
                }
                (r, _) => r,
            }
        };
        match tokio::time::timeout(within, call).await {
            Ok(r) => r.map_err(Error::of),
            Err(_) => Err(Error::Timeout),
        }
    }

    /// Loads `script` (`SCRIPT LOAD`; on a cluster, on every primary), bounded by
    /// the time a connection may take.
    pub async fn load(&self, script: &Script) -> Result<(), Error> {
        let load = async {
            let invoke = script.load();
            match self.0.link.get()? {
                Connection::Single(mut c) => invoke.load_async(&mut c).await.map(drop),
                Connection::Cluster(mut c) => invoke.load_async(&mut c).await.map(drop),
            }
        };
        match tokio::time::timeout(connect_timeout(self.0.timeout), load).await {
            Ok(r) => r.map_err(Error::of),
            Err(_) => Err(Error::Timeout),
        }
    }

    /// A pub/sub connection to the same Redis: the server, the first cluster seed
    /// that answers, or the primary Redis Sentinel names now; each try bounded by
    /// `within`. With the URL it is connected to (see `moved_from`).
    pub async fn pubsub(&self, within: Duration) -> Result<(PubSub, String), Error> {
        let urls = match &self.0.target {
            Target::Url(u) => vec![u.clone()],
            Target::Cluster(nodes) => nodes.clone(),
            Target::Sentinel(_) => self.primary_url().into_iter().collect(),
        };
        let mut last_err = None;
        for url in urls {
            match ::redis::Client::open(url.as_str()) {
                Ok(client) => match tokio::time::timeout(within, client.get_async_pubsub()).await {
                    Ok(Ok(p)) => return Ok((p, url)),
                    Ok(Err(e)) => last_err = Some(Error::of(e)),
                    Err(_) => last_err = Some(Error::Timeout),
                },
                Err(e) => last_err = Some(Error::of(e)),
            }
        }
        // None tried: Redis Sentinel names no primary yet.
        Err(last_err
            .unwrap_or_else(|| Error::Unavailable("Redis Sentinel names no primary yet".into())))
    }

    /// Whether calls now go to another server than `url` (Redis Sentinel named a
    /// new primary). Never on one server or a cluster.
    pub fn moved_from(&self, url: &str) -> bool {
        match &self.0.link {
            Link::Sentinel(p) => p.url().as_deref() != Some(url),
            Link::Fixed(_) => false,
        }
    }

    /// The URL of the server in use when Redis Sentinel names it (it changes with a
    /// failover); None before one is named, and for a fixed server or a cluster.
    pub fn primary_url(&self) -> Option<String> {
        match &self.0.link {
            Link::Sentinel(p) => p.url(),
            Link::Fixed(_) => None,
        }
    }

    pub fn is_cluster(&self) -> bool {
        matches!(self.0.link, Link::Fixed(Connection::Cluster(_)))
    }

    /// Notified when calls go to another server from now on (Sentinel named a new
    /// primary).
    pub(super) fn moved(&self) -> Option<Arc<tokio::sync::Notify>> {
        match &self.0.link {
            Link::Fixed(_) => None,
            Link::Sentinel(p) => Some(p.moved()),
        }
    }

    /// The key prefix (`store.redis.key_prefix`).
    pub fn prefix(&self) -> &str {
        &self.0.prefix
    }

    /// The bound on one limiter call.
    pub fn timeout(&self) -> Duration {
        self.0.timeout
    }

    pub fn breaker(&self) -> &Breaker {
        &self.0.breaker
    }

    /// Counts this connection's calls in `calls` from now on (once; later calls do
    /// nothing).
    pub fn count_calls_in(&self, calls: Arc<StoreCalls>) {
        let _ = self.0.calls.set(calls);
    }

    /// Counts a call of `kind` (or a local admission).
    pub fn count(&self, kind: CallKind) {
        if let Some(calls) = self.0.calls.get() {
            calls.count(kind);
        }
    }

    pub(super) fn downgrade(&self) -> Weak<Conn> {
        Arc::downgrade(&self.0)
    }
}

/// How long connecting (TCP, TLS, HELLO) may take: it happens off the request path,
/// behind the shared connection future, and each call is bounded by `timeout`
/// anyway, so a slow handshake may take longer than one call without failing for good.
fn connect_timeout(timeout: Duration) -> Duration {
    timeout.max(Duration::from_secs(1))
}

// === impl Conn ===

impl Conn {
    /// One command. A command the connection refused unsent, because it was found
    /// already closed (Redis closed it while idle: `timeout`, `CLIENT KILL`, a proxy's
    /// idle timeout), is sent again at once, on the new connection. A command that was
    /// written and then lost its connection is not: Redis may have run it, and a
    /// script run twice charges a request twice.
    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let r = match self.link.get()? {
            Connection::Single(mut c) => match attempt(cmd.query_async(&mut c)).await {
                Sent::Done(r) => r,
                Sent::Unsent(e) => {
                    // The manager has started reconnecting; this waits for it.
                    tracing::debug!(error = %e, "Redis connection was closed; sending again on a new one");
                    cmd.query_async(&mut c).await
                }
            },
            Connection::Cluster(mut c) => cmd.query_async(&mut c).await,
        };
        // A primary that went away, or was demoted (READONLY), may have been replaced:
        // the sentinels are asked at once rather than at their next round.
        if let (Err(e), Link::Sentinel(p)) = (&r, &self.link) {
            if e.kind() != ErrorKind::Server(ServerErrorKind::NoScript) {
                p.suspect();
            }
        }
        r
    }
}

/// How one attempt to send a command ended.
enum Sent<T> {
    /// Answered, or failed after the command may have reached Redis.
    Done(RedisResult<T>),
    /// Refused before anything was written: the connection was already closed.
    Unsent(::redis::RedisError),
}

/// Runs one command future and tells whether a dropped-connection error came back
/// without the command having been written. The multiplexed connection hands a
/// command to its writer task through a channel; once the server has closed the
/// connection that task has ended, and the command is refused on the spot, within
/// the first poll. A command that got as far as the writer has to wait for its
/// answer (at least one `Pending`), so any failure after that counts as possibly run.
async fn attempt<T>(f: impl Future<Output = RedisResult<T>>) -> Sent<T> {
    let mut f = std::pin::pin!(f);
    let mut first = true;
    std::future::poll_fn(|cx| {
        let polled = f.as_mut().poll(cx);
        let was_first = std::mem::replace(&mut first, false);
        match polled {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Err(e)) if was_first && e.is_connection_dropped() => {
                Poll::Ready(Sent::Unsent(e))
            }
            Poll::Ready(r) => Poll::Ready(Sent::Done(r)),
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dropped() -> ::redis::RedisError {
        std::io::Error::from(std::io::ErrorKind::BrokenPipe).into()
    }

    /// Refused within the first poll: never written, so sent again. Failed after
    /// waiting for an answer: it may have run, so not.
    #[tokio::test]
    async fn only_a_command_refused_unsent_counts_as_unsent() {
        let unsent = attempt(async { Err::<(), _>(dropped()) }).await;
        assert!(matches!(unsent, Sent::Unsent(_)));
        let in_flight = attempt(async {
            tokio::task::yield_now().await;
            Err::<(), _>(dropped())
        })
        .await;
        assert!(matches!(in_flight, Sent::Done(Err(_))));
        // Other errors are answers, however fast.
        let refused =
            attempt(async { Err::<(), _>(::redis::RedisError::from((ErrorKind::Client, "no"))) })
                .await;
        assert!(matches!(refused, Sent::Done(Err(_))));
        assert!(matches!(attempt(async { Ok(7) }).await, Sent::Done(Ok(7))));
    }
}
