//! The fleet view: on the Redis store every instance publishes a small heartbeat
//! (who it is, where it listens, its configuration's hash, whether it is ready, and
//! its decision counters) every `HEARTBEAT_EVERY`, in a key that expires; `GET
//! /admin/fleet` reads them all back and sums the counters per route. An instance
//! whose last heartbeat is older than `STALE_AFTER` (by Redis's clock) is shown
//! stale and left out of the sums. Nothing here runs per request, and a Redis
//! failure only leaves this instance out of the view.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::deny::{now_ms, rfc3339};
use crate::ops::control::Control;
use crate::pipeline::Shared;
use crate::redis::Error as StoreError;
use crate::telemetry::metrics::CallKind;
use crate::telemetry::metrics::Decision;

/// How often an instance publishes its heartbeat.
pub const HEARTBEAT_EVERY: Duration = Duration::from_secs(1);
/// An instance whose last heartbeat is older than this missed two: it is shown
/// `"stale": true, "ready": false` and left out of the sums (and out of the live
/// instances that `on_error: local` divides limits by). Half an interval of slack,
/// so that a heartbeat a little late is not taken for a missed one.
pub const STALE_AFTER: Duration = Duration::from_millis(2500);
/// How long a heartbeat lasts in Redis: an instance that stopped publishing (it
/// crashed, or lost Redis) leaves the view this long after its last one.
pub const HEARTBEAT_TTL: Duration = Duration::from_secs(5);
/// Ids in the index whose last heartbeat (by the writer's clock) is older than this
/// are removed by every publisher: a crashed instance's id, long after its key
/// expired. Generous, so that clocks a little apart never remove a live instance's
/// id (which its next heartbeat would add back anyway).
const FORGET_AFTER: Duration = Duration::from_secs(60);

/// Decision counts by decision name (`allowed`, `limited`, ...).
pub type Counts = BTreeMap<String, u64>;

/// The most refused keys a heartbeat carries, over all routes (the heaviest), and
/// of one route: its size stays bounded (a key is at most 256 bytes, so a
/// heartbeat's list is at most about 40 KB) however many clients are refused.
pub const TOP_PUBLISHED: usize = 100;
pub const TOP_PUBLISHED_PER_ROUTE: usize = 20;

/// A refused key of a route as an instance's sketch counts it (`telemetry::top`):
/// what a heartbeat publishes, and what `/admin/top?scope=fleet` sums.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offender {
    pub route: String,
    pub key: String,
    /// The client address of its last refusal.
    pub ip: std::net::IpAddr,
    pub refused: u64,
    /// How far `refused` may be above the truth.
    pub error: u64,
    pub allowed: u64,
    pub last_seen_ms: u64,
}

impl Offender {
    /// The refused keys `top` (a route's, or a rate limit service domain's) counts
    /// now, as rows of `route`, the heaviest first.
    pub fn of<'a>(
        route: &'a str,
        top: &crate::telemetry::top::Top,
        now_ms: u64,
    ) -> impl Iterator<Item = Offender> + 'a {
        top.list(now_ms).into_iter().map(move |o| Offender {
            route: route.to_string(),
            key: o.key,
            ip: o.ip,
            refused: o.refused,
            error: o.error,
            allowed: o.allowed,
            last_seen_ms: o.last_seen_ms,
        })
    }
}

/// A key's rows summed over the instances whose lists hold it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Merged {
    /// The sums; `ip` and `last_seen_ms` are of the latest row.
    pub row: Offender,
    /// The instances whose lists held the key.
    pub instances: u32,
}

/// Every list summed per route and key: counts and errors added, the address of
/// the latest refusal kept. Heaviest first, then by route and key.
pub fn merge_top(lists: impl IntoIterator<Item = Vec<Offender>>) -> Vec<Merged> {
    let mut by_key: BTreeMap<(String, String), Merged> = BTreeMap::new();
    for list in lists {
        for o in list {
            match by_key.entry((o.route.clone(), o.key.clone())) {
                std::collections::btree_map::Entry::Vacant(e) => {
                    e.insert(Merged {
                        row: o,
                        instances: 1,
                    });
                }
                std::collections::btree_map::Entry::Occupied(mut e) => {
                    let m = e.get_mut();
                    m.instances += 1;
                    m.row.refused = m.row.refused.saturating_add(o.refused);
                    m.row.error = m.row.error.saturating_add(o.error);
                    m.row.allowed = m.row.allowed.saturating_add(o.allowed);
                    if o.last_seen_ms > m.row.last_seen_ms {
                        m.row.last_seen_ms = o.last_seen_ms;
                        m.row.ip = o.ip;
                    }
                }
            }
        }
    }
    let mut out: Vec<Merged> = by_key.into_values().collect();
    out.sort_by(|a, b| {
        b.row
            .refused
            .cmp(&a.row.refused)
            .then_with(|| a.row.route.cmp(&b.row.route))
            .then_with(|| a.row.key.cmp(&b.row.key))
    });
    out
}

/// What a heartbeat carries of `all` (every route's list, each heaviest first):
/// at most `TOP_PUBLISHED_PER_ROUTE` of a route, `TOP_PUBLISHED` in all, the
/// heaviest.
fn published(mut all: Vec<Offender>) -> Vec<Offender> {
    let mut per_route: BTreeMap<String, usize> = BTreeMap::new();
    all.retain(|o| {
        let n = per_route.entry(o.route.clone()).or_insert(0);
        *n += 1;
        *n <= TOP_PUBLISHED_PER_ROUTE
    });
    all.sort_by_key(|o| std::cmp::Reverse(o.refused));
    all.truncate(TOP_PUBLISHED);
    all
}

/// What one instance publishes, and `GET /admin/fleet` reads back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    pub id: String,
    /// The proxy listener's address (the host's name if it listens on every one).
    pub addr: String,
    pub version: String,
    pub config_hash: String,
    /// As `/readyz` says.
    pub ready: bool,
    /// When it was written, in milliseconds since the epoch: Redis's clock (`TIME`),
    /// which every reader compares with, so that hosts' clocks apart never make a
    /// live instance look stale; the writer's own if `TIME` failed.
    pub last_seen_ms: u64,
    /// Every route's decisions since the instance started.
    #[serde(default)]
    pub routes: BTreeMap<String, Counts>,
    /// Its most refused keys (`published`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top: Vec<Offender>,
}

/// The keys of the view, which share the `{fleet}` hash tag (one slot on a cluster).
struct Keys {
    redis: crate::redis::Shared,
    /// A sorted set of instance ids, scored by their last heartbeat.
    ids: String,
    /// An instance's heartbeat is `<instance><id>`.
    instance: String,
}

pub struct Fleet {
    shared: Arc<Shared>,
    control: Arc<Control>,
    id: String,
    addr: String,
    redis: Option<Keys>,
    /// The last heartbeat failed: logged once per outage.
    failing: AtomicBool,
}

// === impl Fleet ===

impl Fleet {
    /// This instance, listening for the proxy on `listen`; on the Redis store, with
    /// its keys under the store's prefix.
    pub fn new(shared: Arc<Shared>, control: Arc<Control>, listen: SocketAddr) -> Fleet {
        let redis = shared.store.redis_connection().map(|redis| {
            let redis = redis.clone();
            let p = redis.prefix();
            Keys {
                ids: format!("{p}{{fleet}}:ids"),
                instance: format!("{p}{{fleet}}:i:"),
                redis,
            }
        });
        let host = hostname();
        Fleet {
            id: new_id(&host),
            addr: if listen.ip().is_unspecified() {
                format!("{host}:{}", listen.port())
            } else {
                listen.to_string()
            },
            shared,
            control,
            redis,
            failing: AtomicBool::new(false),
        }
    }

    /// This instance's id: its host's name, its process id and a random part.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Every route's refused keys in this instance now, each route's heaviest first.
    pub fn local_top(&self, now_ms: u64) -> Vec<Offender> {
        let rt = self.shared.runtime.load();
        rt.routes
            .iter()
            .flat_map(|r| Offender::of(&r.name, &r.top, now_ms))
            .collect()
    }

    /// `/admin/top?scope=fleet`: this instance's keys now (with `also`, its rate
    /// limit service's) and those the live instances published with their last
    /// heartbeat, summed per route and key. On the memory store, this instance's
    /// alone.
    pub async fn top(&self, also: Vec<Offender>) -> Result<Vec<Merged>, StoreError> {
        let mut own = self.local_top(now_ms());
        own.extend(also);
        let (others, now) = self.read().await?;
        let lists = others
            .into_iter()
            .filter(|h| h.id != self.id && !is_stale(h.last_seen_ms, now))
            .map(|h| h.top);
        Ok(merge_top(std::iter::once(own).chain(lists)))
    }

    /// Whether `on_error: local` splits limits over the fleet now, and by how many
    /// instances (`limit::Store::degraded`); the gauge `sluice_store_degraded` set
    /// to match.
    pub fn degraded(&self) -> Option<u64> {
        let on_error = self.shared.runtime.load().on_error;
        let d = self.shared.store.degraded(on_error);
        self.shared
            .metrics
            .store_degraded
            .set(i64::from(d.is_some()));
        d
    }

    /// This instance as it is now, its counters live.
    pub fn heartbeat(&self) -> Heartbeat {
        let rt = self.shared.runtime.load();
        let now = now_ms();
        Heartbeat {
            id: self.id.clone(),
            addr: self.addr.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            config_hash: self.control.hash(),
            ready: self.control.not_ready().is_empty(),
            last_seen_ms: now,
            top: published(self.local_top(now)),
            routes: rt
                .routes
                .iter()
                .map(|r| {
                    let t = r.metrics.totals();
                    let counts = Decision::of_route()
                        .map(|d| (d.as_str().to_string(), t[d.index()]))
                        .collect();
                    (r.name.clone(), counts)
                })
                .collect(),
        }
    }

    /// Writes this instance's heartbeat (with its TTL) and renews the index.
    pub async fn publish(&self) -> Result<(), StoreError> {
        let Some(k) = &self.redis else {
            return Ok(());
        };
        let mut hb = self.heartbeat();
        hb.last_seen_ms = redis_now_ms(&k.redis).await?;
        let json =
            serde_json::to_string(&hb).map_err(|e| StoreError::Unavailable(e.to_string()))?;
        let ttl = HEARTBEAT_TTL.as_millis() as u64;
        let mut cmd = redis::cmd("SET");
        cmd.arg(format!("{}{}", k.instance, self.id))
            .arg(json)
            .arg("PX")
            .arg(ttl);
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        let mut cmd = redis::cmd("ZADD");
        cmd.arg(&k.ids).arg(hb.last_seen_ms).arg(&self.id);
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        let mut cmd = redis::cmd("PEXPIRE");
        cmd.arg(&k.ids).arg(ttl);
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        let forget = hb
            .last_seen_ms
            .saturating_sub(FORGET_AFTER.as_millis() as u64);
        let mut cmd = redis::cmd("ZREMRANGEBYSCORE");
        cmd.arg(&k.ids).arg("-inf").arg(format!("({forget}"));
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await
    }

    /// The live instances now, from the index alone (its scores are the
    /// heartbeats' times, Redis's clock): those not stale, this one included.
    pub async fn live(&self) -> Result<u64, StoreError> {
        let Some(k) = &self.redis else {
            return Ok(1);
        };
        let now = redis_now_ms(&k.redis).await?;
        let since = now.saturating_sub(STALE_AFTER.as_millis() as u64);
        let mut cmd = redis::cmd("ZCOUNT");
        cmd.arg(&k.ids).arg(since).arg("+inf");
        let n: u64 = k
            .redis
            .call(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        // This instance's heartbeat may have failed while the count did not.
        Ok(n.max(1))
    }

    /// Removes this instance from the view (at graceful shutdown).
    pub async fn leave(&self) -> Result<(), StoreError> {
        let Some(k) = &self.redis else {
            return Ok(());
        };
        let mut cmd = redis::cmd("DEL");
        cmd.arg(format!("{}{}", k.instance, self.id));
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        let mut cmd = redis::cmd("ZREM");
        cmd.arg(&k.ids).arg(&self.id);
        k.redis
            .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
            .await
    }

    /// The heartbeats in Redis now, and Redis's time now: the index, then every key
    /// in one MGET. Ids whose key expired are removed from the index.
    pub async fn read(&self) -> Result<(Vec<Heartbeat>, u64), StoreError> {
        let Some(k) = &self.redis else {
            return Ok((Vec::new(), now_ms()));
        };
        let now = redis_now_ms(&k.redis).await?;
        let mut cmd = redis::cmd("ZRANGE");
        cmd.arg(&k.ids).arg(0).arg(-1);
        let ids: Vec<String> = k
            .redis
            .call(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        if ids.is_empty() {
            return Ok((Vec::new(), now));
        }
        let mut cmd = redis::cmd("MGET");
        for id in &ids {
            cmd.arg(format!("{}{id}", k.instance));
        }
        let values: Vec<Option<String>> = k
            .redis
            .call(CallKind::Other, &cmd, k.redis.timeout())
            .await?;
        let mut live = Vec::with_capacity(ids.len());
        let mut gone = Vec::new();
        for (id, v) in ids.iter().zip(values) {
            match v.and_then(|j| serde_json::from_str::<Heartbeat>(&j).ok()) {
                Some(hb) if hb.id == *id => live.push(hb),
                _ => gone.push(id),
            }
        }
        if !gone.is_empty() {
            let mut cmd = redis::cmd("ZREM");
            cmd.arg(&k.ids).arg(gone);
            // Cleaning only: the next reader or publisher tries again.
            let _ = k
                .redis
                .call::<(), _>(CallKind::Other, &cmd, k.redis.timeout())
                .await;
        }
        Ok((live, now))
    }

    /// `GET /admin/fleet`: on Redis every live instance, else (or with Redis
    /// unreachable, then with `error`) this one alone.
    pub async fn view(&self) -> serde_json::Value {
        let own = self.heartbeat();
        let (store, others, now, error) = match &self.redis {
            None => ("memory", Vec::new(), own.last_seen_ms, None),
            Some(_) => match self.read().await {
                Ok((hbs, now)) => ("redis", hbs, now, None),
                Err(e) => ("redis", Vec::new(), own.last_seen_ms, Some(e.to_string())),
            },
        };
        let mut v = render(&own, others, now, store, error);
        // What `on_error: local` divides limits by: the live instances the
        // heartbeat counted last (in an outage, before it began).
        v["divided_by"] = self.shared.store.live_instances().into();
        v["degraded"] = self.degraded().is_some().into();
        v
    }

    /// The publisher: a heartbeat every `HEARTBEAT_EVERY` (the first at once), then
    /// the live instances counted in the index, until `stop`; then this instance
    /// leaves the view. Nothing to do on the memory store.
    pub async fn run(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        if self.redis.is_none() {
            return;
        }
        let mut tick = tokio::time::interval(HEARTBEAT_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.changed() => break,
            }
            self.degraded();
            match self.publish().await {
                Ok(()) => {
                    if self.failing.swap(false, Ordering::Relaxed) {
                        tracing::info!("fleet heartbeat published again");
                    }
                    // How many are live, for `on_error: local`; kept as it was
                    // when Redis cannot be read.
                    if let Ok(n) = self.live().await {
                        self.shared.store.set_live_instances(n);
                    }
                }
                Err(e) => {
                    if !self.failing.swap(true, Ordering::Relaxed) {
                        tracing::warn!(error = %e, "fleet heartbeat not published; this instance drops out of GET /admin/fleet until Redis answers");
                    }
                }
            }
        }
        if let Err(e) = self.leave().await {
            tracing::debug!(error = %e, "fleet heartbeat not removed at shutdown; it expires by itself");
        }
    }
}

/// Whether a heartbeat written at `last_seen_ms` is stale at `now_ms` (both Redis's
/// clock): its instance missed two heartbeats.
pub fn is_stale(last_seen_ms: u64, now_ms: u64) -> bool {
    now_ms.saturating_sub(last_seen_ms) > STALE_AFTER.as_millis() as u64
}

/// The view from `own` (this instance now, never stale) and the heartbeats read
/// from Redis at `now_ms` (`own`'s last one among them is left out: its live
/// counters count instead). Stale instances are listed but not summed.
pub fn render(
    own: &Heartbeat,
    others: Vec<Heartbeat>,
    now_ms: u64,
    store: &str,
    error: Option<String>,
) -> serde_json::Value {
    let mut all: Vec<(Heartbeat, bool)> = others
        .into_iter()
        .filter(|h| h.id != own.id)
        .map(|h| {
            let stale = is_stale(h.last_seen_ms, now_ms);
            (h, stale)
        })
        .collect();
    all.push((own.clone(), false));
    all.sort_by(|a, b| a.0.id.cmp(&b.0.id));
    let mut routes: BTreeMap<String, Counts> = BTreeMap::new();
    for hb in all.iter().filter(|(_, stale)| !stale).map(|(h, _)| h) {
        for (route, counts) in &hb.routes {
            let sum = routes.entry(route.clone()).or_insert_with(|| {
                Decision::of_route()
                    .map(|d| (d.as_str().to_string(), 0))
                    .collect()
            });
            for (decision, n) in counts {
                let s = sum.entry(decision.clone()).or_insert(0);
                *s = s.saturating_add(*n);
            }
        }
    }
    let hashes: std::collections::BTreeSet<&str> = all
        .iter()
        .filter(|(_, stale)| !stale)
        .map(|(h, _)| h.config_hash.as_str())
        .collect();
    let instances: Vec<_> = all
        .iter()
        .map(|(h, stale)| {
            serde_json::json!({
                "id": h.id,
                "addr": h.addr,
                "version": h.version,
                "config_hash": h.config_hash,
                "ready": h.ready && !stale,
                "stale": stale,
                "last_seen": rfc3339(h.last_seen_ms),
                "last_seen_ms": h.last_seen_ms,
                "self": h.id == own.id,
                // Its own counts, as of its last heartbeat (this instance's: now).
                "routes": h.routes,
            })
        })
        .collect();
    let live = all.iter().filter(|(_, stale)| !stale).count();
    let mut v = serde_json::json!({
        "instances": instances,
        "live": live,
        "routes": routes,
        "config_hashes": hashes.len(),
        "consistent": hashes.len() <= 1,
        "store": store,
    });
    if let Some(e) = error {
        v["error"] = e.into();
    }
    v
}

/// Redis's clock now (`TIME`), in milliseconds since the epoch. On a cluster any
/// node answers: their clocks are taken to agree.
async fn redis_now_ms(redis: &crate::redis::Shared) -> Result<u64, StoreError> {
    let (secs, micros): (u64, u64) = redis
        .call(CallKind::Other, &redis::cmd("TIME"), redis.timeout())
        .await?;
    Ok(secs * 1000 + micros / 1000)
}

/// `<host>-<pid>-<random>`: readable in a list, unique across restarts of one
/// process id and across hosts that share a name.
fn new_id(host: &str) -> String {
    use std::hash::{BuildHasher, RandomState};
    let random = RandomState::new().hash_one(std::time::SystemTime::now()) & 0xff_ffff;
    format!("{host}-{}-{random:06x}", std::process::id())
}

/// The host's name (`gethostname`), or `localhost` if it has none that is text.
fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname writes at most that.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    match std::str::from_utf8(&buf[..end]) {
        Ok(h) if rc == 0 && !h.is_empty() => h.to_string(),
        _ => "localhost".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hb(id: &str, hash: &str, at: u64, routes: &[(&str, &[(&str, u64)])]) -> Heartbeat {
        Heartbeat {
            id: id.into(),
            addr: format!("{id}:8080"),
            version: "1.0.0".into(),
            config_hash: hash.into(),
            ready: true,
            last_seen_ms: at,
            top: Vec::new(),
            routes: routes
                .iter()
                .map(|(r, c)| {
                    let c = c.iter().map(|(d, n)| (d.to_string(), *n)).collect();
                    (r.to_string(), c)
                })
                .collect(),
        }
    }

    #[test]
    fn the_view_sums_every_instance_and_counts_this_one_live() {
        let own = hb(
            "b",
            "h1",
            2000,
            &[("api", &[("allowed", 5), ("limited", 1)])],
        );
        let others = vec![
            hb("c", "h1", 1500, &[("api", &[("allowed", 2)])]),
            // This instance's last heartbeat: its live counters count instead.
            hb("b", "h1", 1000, &[("api", &[("allowed", 1)])]),
            hb(
                "a",
                "h1",
                1000,
                &[("api", &[("limited", 3)]), ("login", &[("denied", 4)])],
            ),
        ];
        let v = render(&own, others, 2000, "redis", None);
        let ids: Vec<&str> = v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["id"].as_str().unwrap())
            .collect();
        assert_eq!(ids, ["a", "b", "c"]);
        assert_eq!(
            v["instances"][1],
            serde_json::json!({"id": "b", "addr": "b:8080", "version": "1.0.0", "config_hash": "h1",
                "ready": true, "stale": false, "last_seen": "1970-01-01T00:00:02Z", "last_seen_ms": 2000, "self": true,
                "routes": {"api": {"allowed": 5, "limited": 1}}})
        );
        assert_eq!(v["instances"][0]["self"], false);
        assert_eq!(
            v["routes"]["api"],
            serde_json::json!({"allowed": 7, "delayed": 0, "limited": 4, "denied": 0, "shadow": 0,
                "store_error_allowed": 0, "store_error_denied": 0, "bad_request": 0, "unauthorized": 0})
        );
        assert_eq!(v["routes"]["login"]["denied"], 4);
        assert_eq!(v["config_hashes"], 1);
        assert_eq!(v["consistent"], true);
        assert_eq!(v["live"], 3);
        assert_eq!(v["store"], "redis");
        assert!(v.get("error").is_none());
    }

    #[test]
    fn an_instance_that_missed_two_heartbeats_is_stale_not_ready_and_not_summed() {
        let own = hb("a", "h1", 10_000, &[("api", &[("allowed", 1)])]);
        let at_edge = 10_000 - STALE_AFTER.as_millis() as u64;
        let others = vec![
            // Exactly STALE_AFTER old: late, not yet stale.
            hb("b", "h1", at_edge, &[("api", &[("allowed", 2)])]),
            // A millisecond older, with another configuration: stale.
            hb("c", "h2", at_edge - 1, &[("api", &[("allowed", 4)])]),
        ];
        let v = render(&own, others, 10_000, "redis", None);
        let flags: Vec<(bool, bool)> = v["instances"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| (i["stale"] == true, i["ready"] == true))
            .collect();
        assert_eq!(flags, [(false, true), (false, true), (true, false)]);
        assert_eq!(v["routes"]["api"]["allowed"], 3);
        assert_eq!(v["live"], 2);
        // A stale instance's configuration is not a live disagreement.
        assert_eq!(
            (v["config_hashes"].clone(), v["consistent"].clone()),
            (1.into(), true.into())
        );
        assert!(!is_stale(at_edge, 10_000));
        assert!(is_stale(at_edge - 1, 10_000));
        // A heartbeat from a clock a little ahead is not stale.
        assert!(!is_stale(10_500, 10_000));
    }

    #[test]
    fn different_hashes_are_not_consistent_and_an_error_is_shown() {
        let own = hb("a", "h1", 1000, &[]);
        let v = render(&own, vec![hb("b", "h2", 1000, &[])], 1000, "redis", None);
        assert_eq!(
            (v["config_hashes"].clone(), v["consistent"].clone()),
            (2.into(), false.into())
        );
        let v = render(&own, Vec::new(), 1000, "redis", Some("timed out".into()));
        assert_eq!(v["instances"].as_array().map(Vec::len), Some(1));
        assert_eq!(v["error"], "timed out");
        assert_eq!(v["consistent"], true);
    }

    #[test]
    fn a_heartbeat_round_trips_and_stays_small() {
        let h = hb(
            "host-1-abcdef",
            "0123456789abcdef",
            1,
            &[("api", &[("allowed", u64::MAX)])],
        );
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<Heartbeat>(&json).unwrap(), h);
        assert!(json.len() < 300, "{}", json.len());
    }

    fn offender(route: &str, key: &str, ip: &str, counts: (u64, u64, u64), at: u64) -> Offender {
        Offender {
            route: route.into(),
            key: key.into(),
            ip: ip.parse().unwrap(),
            refused: counts.0,
            error: counts.1,
            allowed: counts.2,
            last_seen_ms: at,
        }
    }

    #[test]
    fn the_fleet_top_sums_a_key_over_the_lists_that_hold_it() {
        let a = vec![
            offender("api", "k1", "10.0.0.1", (7, 0, 1), 100),
            offender("api", "k2", "10.0.0.2", (5, 1, 0), 100),
        ];
        let b = vec![
            offender("api", "k2", "10.0.0.9", (6, 2, 3), 300),
            offender("login", "k1", "10.0.0.1", (9, 0, 0), 50),
        ];
        let c = vec![offender("api", "k1", "10.0.0.3", (4, 0, 0), 200)];
        let merged = merge_top([a, b, c]);
        assert_eq!(
            merged,
            [
                Merged {
                    row: offender("api", "k1", "10.0.0.3", (11, 0, 1), 200),
                    instances: 2
                },
                Merged {
                    row: offender("api", "k2", "10.0.0.9", (11, 3, 3), 300),
                    instances: 2
                },
                Merged {
                    row: offender("login", "k1", "10.0.0.1", (9, 0, 0), 50),
                    instances: 1
                },
            ]
        );
    }

    #[test]
    fn a_heartbeat_carries_a_bounded_top_the_heaviest_of_each_route() {
        let mut all = Vec::new();
        for route in 0..8u64 {
            for k in 0..30u64 {
                let counts = (1000 - route * 30 - k, 0, 0);
                all.push(offender(
                    &format!("r{route}"),
                    &format!("k{k}"),
                    "10.0.0.1",
                    counts,
                    1,
                ));
            }
        }
        let p = published(all);
        assert_eq!(p.len(), TOP_PUBLISHED);
        // Five routes' heaviest 20 each, heaviest first.
        assert!(p.windows(2).all(|w| w[0].refused >= w[1].refused));
        for route in 0..5 {
            let keys: Vec<&str> = p
                .iter()
                .filter(|o| o.route == format!("r{route}"))
                .map(|o| o.key.as_str())
                .collect();
            let want: Vec<String> = (0..20).map(|k| format!("k{k}")).collect();
            assert_eq!(keys, want);
        }
        // A heartbeat with the longest keys stays within about 40 KB.
        let long = "x".repeat(crate::identity::MAX_STORED_KEY);
        let mut h = hb("a", "h", 1, &[]);
        h.top = (0..TOP_PUBLISHED)
            .map(|i| {
                offender(
                    &format!("route-{i}"),
                    &long,
                    "2001:db8::1",
                    (u64::MAX, u64::MAX, u64::MAX),
                    u64::MAX,
                )
            })
            .collect();
        let json = serde_json::to_string(&h).unwrap();
        assert!(json.len() < 45_000, "{}", json.len());
        assert_eq!(serde_json::from_str::<Heartbeat>(&json).unwrap(), h);
    }

    #[test]
    fn an_id_names_the_host_and_the_process() {
        let id = new_id("web-1");
        let prefix = format!("web-1-{}-", std::process::id());
        assert!(id.starts_with(&prefix), "{id}");
        assert_eq!(id.len(), prefix.len() + 6);
        assert!(!hostname().is_empty());
    }
}
