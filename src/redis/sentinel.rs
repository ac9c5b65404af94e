//! Redis Sentinel: the store's one server is the primary the sentinels name for a
//! master, followed through failovers. A task asks the sentinels which server that is
//! (`+switch-master` on their pub/sub at once, every `ASK_EVERY` anyway, and soon
//! after a call fails), checks with `ROLE` that a newly named server is a primary,
//! and swaps the store's connection to it: no restart, no configuration change.

use std::sync::{Arc, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;
use futures_util::StreamExt;
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, ErrorKind, RedisResult, Role};
use tokio::sync::Notify;

/// How often the sentinels are asked, whatever else happens: a `+switch-master` that
/// was missed (no sentinel subscribed to at that moment) costs this long at most.
const ASK_EVERY: Duration = Duration::from_secs(1);
/// Least time between two rounds of asking: failing calls ask for a round each, and a
/// long outage must not turn into a flood of questions to the sentinels.
const ASK_GAP: Duration = Duration::from_millis(100);

/// Where the store lives when Redis Sentinel names it.
#[derive(Debug, Clone)]
pub struct SentinelTarget {
    /// The name the sentinels monitor the primary under (`sentinel monitor <name>`).
    pub master: String,
    /// The sentinels' URLs, with their own credentials and TLS.
    pub nodes: Vec<String>,
    /// How to reach the primary once it is named.
    pub primary: PrimaryUrl,
}

/// The parts of the primary's URL that do not come from the sentinels: scheme (TLS or
/// not), credentials, database and the rest (`?protocol=`).
#[derive(Debug, Clone)]
pub struct PrimaryUrl {
    /// `redis` or `rediss`.
    pub scheme: String,
    /// `user:password@`, percent-encoded, or empty.
    pub userinfo: String,
    pub db: u16,
    /// What follows the path: `?protocol=3`, or nothing.
    pub tail: String,
}

impl PrimaryUrl {
    /// The URL of the primary at `host:port`.
    pub fn at(&self, host: &str, port: u16) -> String {
        let PrimaryUrl {
            scheme,
            userinfo,
            db,
            tail,
        } = self;
        if host.contains(':') {
            format!("{scheme}://{userinfo}[{host}]:{port}/{db}{tail}")
        } else {
            format!("{scheme}://{userinfo}{host}:{port}/{db}{tail}")
        }
    }
}

/// The primary in use and the task that follows it.
pub(crate) struct Primary {
    current: ArcSwapOption<Current>,
    /// Woken when a call fails: the primary may have moved.
    suspect: Arc<Notify>,
    /// Notified when the store moved to another primary.
    moved: Arc<Notify>,
    target: SentinelTarget,
    manager: ConnectionManagerConfig,
    /// Bound on one question to a sentinel or a server (connecting included).
    timeout: Duration,
}

/// A primary the sentinels named and that said it is one.
struct Current {
    host: String,
    port: u16,
    url: String,
    conn: ConnectionManager,
}

impl Primary {
    /// Asks the sentinels once (within `timeout` per question), then follows the
    /// primary from a task of its own until the store is dropped. No sentinel answering
    /// is not an error: calls fail until one names a primary.
    pub(crate) async fn start(
        target: SentinelTarget,
        manager: ConnectionManagerConfig,
        timeout: Duration,
    ) -> Arc<Primary> {
        let p = Arc::new(Primary {
            current: ArcSwapOption::empty(),
            suspect: Arc::new(Notify::new()),
            moved: Arc::new(Notify::new()),
            target,
            manager,
            timeout,
        });
        let mut asker = Asker::default();
        if let Err(why) = p.refresh(&mut asker, None).await {
            tracing::error!(master = %p.target.master, %why, "Redis Sentinel: no primary at startup; applying store.on_error until the sentinels name one");
        }
        tokio::spawn(follow(Arc::downgrade(&p), p.suspect.clone(), asker));
        p
    }

    /// The connection to the current primary, if one is known.
    pub(crate) fn connection(&self) -> RedisResult<ConnectionManager> {
        match &*self.current.load() {
            Some(c) => Ok(c.conn.clone()),
            None => Err(redis::RedisError::from((
                ErrorKind::Client,
                "Redis Sentinel has named no primary",
                self.target.master.clone(),
            ))),
        }
    }

    /// The current primary's URL.
    pub(crate) fn url(&self) -> Option<String> {
        self.current.load().as_ref().map(|c| c.url.clone())
    }

    /// Notified each time the store moves to another primary: the breaker's prober
    /// tries it at once instead of at its next tick.
    pub(crate) fn moved(&self) -> Arc<Notify> {
        self.moved.clone()
    }

    /// A call failed: ask the sentinels soon.
    pub(crate) fn suspect(&self) {
        self.suspect.notify_one();
    }

    /// Asks the sentinels (or takes `named`, the address a `+switch-master` gave) and
    /// moves to the server named if it is not the current one and says it is a
    /// primary. Ok if the store is on the primary named; why not otherwise.
    async fn refresh(&self, asker: &mut Asker, named: Option<(String, u16)>) -> Result<(), String> {
        let named = match named {
            Some(n) => Some(n),
            None => asker
                .ask(&self.target, self.timeout)
                .await
                .map_err(|e| format!("no sentinel answered: {e}"))?,
        };
        let (host, port) = named.ok_or("the sentinels do not know this master")?;
        let before = self.current.load_full();
        if let Some(c) = &before {
            if c.host == host && c.port == port {
                return Ok(());
            }
        }
        let url = self.target.primary.at(&host, port);
        let conn = redis::Client::open(url.as_str())
            .and_then(|c| ConnectionManager::new_lazy_with_config(c, self.manager.clone()))
            .map_err(|e| format!("the address named, {host}:{port}, is not usable: {e}"))?;
        // The server named must say it is the primary: a sentinel that has not seen
        // the failover yet can name a demoted one.
        let mut check = conn.clone();
        let role = tokio::time::timeout(
            self.timeout,
            redis::cmd("ROLE").query_async::<Role>(&mut check),
        )
        .await;
        match role {
            Ok(Ok(Role::Primary { .. })) => {}
            Ok(Ok(_)) => return Err(format!("{host}:{port} is named but is not a primary")),
            Ok(Err(e)) => return Err(format!("{host}:{port} is named but fails: {e}")),
            Err(_) => {
                return Err(format!(
                    "{host}:{port} is named but does not answer in time"
                ))
            }
        }
        match &before {
            Some(b) => {
                tracing::warn!(master = %self.target.master, from = %format!("{}:{}", b.host, b.port), to = %format!("{host}:{port}"), "Redis Sentinel: the primary moved; following it")
            }
            None => {
                tracing::info!(master = %self.target.master, primary = %format!("{host}:{port}"), "Redis Sentinel: primary found")
            }
        }
        self.current.store(Some(Arc::new(Current {
            host,
            port,
            url,
            conn,
        })));
        self.moved.notify_one();
        Ok(())
    }
}

/// Follows the primary until the store is dropped: a round of `refresh` every
/// `ASK_EVERY`, when a call failed (`suspect`), and at once, with the new address,
/// on a sentinel's `+switch-master` for this master.
async fn follow(primary: Weak<Primary>, suspect: Arc<Notify>, mut asker: Asker) {
    let mut tick = tokio::time::interval(ASK_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let mut events: Option<redis::aio::PubSubStream> = None;
    // Said once per outage, then at debug level.
    let mut failing = false;
    loop {
        let mut named = None;
        tokio::select! {
            _ = tick.tick() => {}
            _ = suspect.notified() => {}
            msg = next_event(&mut events) => match msg {
                Some(msg) => {
                    let Some(p) = primary.upgrade() else { return };
                    named = switched(&msg.get_payload::<String>().unwrap_or_default(), &p.target.master);
                    if named.is_none() {
                        continue;
                    }
                }
                None => events = None,
            },
        }
        let Some(p) = primary.upgrade() else { return };
        if events.is_none() {
            events = subscribe(&p.target, p.timeout).await;
        }
        match p.refresh(&mut asker, named).await {
            Ok(()) => failing = false,
            Err(why) if !std::mem::replace(&mut failing, true) => {
                tracing::warn!(master = %p.target.master, %why, "Redis Sentinel: not following the primary; asking again")
            }
            Err(why) => {
                tracing::debug!(master = %p.target.master, %why, "Redis Sentinel: still not following the primary")
            }
        }
        drop(p);
        tokio::time::sleep(ASK_GAP).await;
    }
}

/// The next `+switch-master` message; never, while there is no subscription.
async fn next_event(events: &mut Option<redis::aio::PubSubStream>) -> Option<redis::Msg> {
    match events {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

/// `+switch-master` on the first sentinel that takes the subscription.
async fn subscribe(target: &SentinelTarget, timeout: Duration) -> Option<redis::aio::PubSubStream> {
    for node in &target.nodes {
        let sub = async {
            let mut p = redis::Client::open(node.as_str())?
                .get_async_pubsub()
                .await?;
            p.subscribe("+switch-master").await?;
            Ok::<_, redis::RedisError>(p.into_on_message())
        };
        match tokio::time::timeout(timeout, sub).await {
            Ok(Ok(s)) => return Some(s),
            Ok(Err(e)) => {
                tracing::debug!(error = %e, "Redis Sentinel: not subscribed to a sentinel")
            }
            Err(_) => tracing::debug!("Redis Sentinel: a sentinel is too slow to subscribe to"),
        }
    }
    None
}

/// The new address in a `+switch-master` message (`<master> <old ip> <old port>
/// <new ip> <new port>`) if it is about `master`.
fn switched(payload: &str, master: &str) -> Option<(String, u16)> {
    let words: Vec<&str> = payload.split(' ').collect();
    match words[..] {
        [name, _, _, host, port] if name == master => Some((host.to_string(), port.parse().ok()?)),
        _ => None,
    }
}

/// Asks the sentinels, keeping a connection to the last one that answered.
#[derive(Default)]
struct Asker {
    conn: Option<(usize, MultiplexedConnection)>,
}

impl Asker {
    /// The primary's address as the first sentinel that answers names it (None: it
    /// does not know the master), starting with the one that answered last.
    async fn ask(
        &mut self,
        target: &SentinelTarget,
        timeout: Duration,
    ) -> RedisResult<Option<(String, u16)>> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("get-master-addr-by-name").arg(&target.master);
        if let Some((i, mut c)) = self.conn.take() {
            match ask_on(&mut c, &cmd, timeout).await {
                Ok(named) => {
                    self.conn = Some((i, c));
                    return Ok(named);
                }
                Err(e) => {
                    tracing::debug!(error = %e, sentinel = i, "Redis Sentinel: a sentinel stopped answering")
                }
            }
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        let mut last = None;
        for (i, node) in target.nodes.iter().enumerate() {
            let connected = async {
                redis::Client::open(node.as_str())?
                    .get_multiplexed_async_connection_with_config(&config)
                    .await
            };
            let mut c = match tokio::time::timeout(timeout, connected).await {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    last = Some(e);
                    continue;
                }
                Err(_) => continue,
            };
            match ask_on(&mut c, &cmd, timeout).await {
                Ok(named) => {
                    self.conn = Some((i, c));
                    return Ok(named);
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            redis::RedisError::from((ErrorKind::Io, "no sentinel answered in time"))
        }))
    }
}

async fn ask_on(
    c: &mut MultiplexedConnection,
    cmd: &redis::Cmd,
    timeout: Duration,
) -> RedisResult<Option<(String, u16)>> {
    let named = tokio::time::timeout(timeout, cmd.query_async::<Option<(String, u16)>>(c))
        .await
        .map_err(|_| redis::RedisError::from((ErrorKind::Io, "sentinel too slow")))??;
    Ok(named)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primary_url_keeps_what_the_sentinels_do_not_say() {
        let p = PrimaryUrl {
            scheme: "rediss".into(),
            userinfo: "app:p%40ss@".into(),
            db: 2,
            tail: "?protocol=3".into(),
        };
        assert_eq!(
            p.at("10.0.0.7", 6380),
            "rediss://app:p%40ss@10.0.0.7:6380/2?protocol=3"
        );
        assert_eq!(
            p.at("fd00::7", 6379),
            "rediss://app:p%40ss@[fd00::7]:6379/2?protocol=3"
        );
    }

    #[test]
    fn switch_master_names_the_new_primary_of_its_master_only() {
        let msg = "mymaster 127.0.0.1 6379 127.0.0.1 6380";
        assert_eq!(switched(msg, "mymaster"), Some(("127.0.0.1".into(), 6380)));
        assert_eq!(switched(msg, "other"), None);
        assert_eq!(switched("mymaster 127.0.0.1 6379", "mymaster"), None);
        assert_eq!(switched("mymaster a 1 b port", "mymaster"), None);
    }
}
