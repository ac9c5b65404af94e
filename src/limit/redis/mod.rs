//! The Redis store: limiter state shared by every instance. All limits of one request
//! are decided by one Lua script call (one round trip), timed by the Redis server's
//! clock; a breaker stops calling a Redis that keeps failing, and a refusal cache
//! answers keys that Redis has refused until their retry time without asking again.

use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, Weak};
use std::task::Poll;
use std::time::{Duration, Instant};

use lru::LruCache;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::{ClusterClientBuilder, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, ErrorKind, FromRedisValue, RedisResult, Script, ServerErrorKind};

use super::reserve::{Reserves, RESERVE_ENTRIES};
use super::sentinel::{Primary, SentinelTarget};
use super::{
    Algorithm, Checked, Clock, LimitDef, Outcome, Permit, Plan, Share, StoreError, Verdict,
};
use crate::telemetry::metrics::{CallKind, StoreCalls};

/// The whole script: the algorithms, then the runner that calls them. Loaded once
/// (`SCRIPT LOAD`) and run with `EVALSHA`; sent whole (`EVAL`) only after `NOSCRIPT`.
const SCRIPT: &str = concat!(
    include_str!("../../lua/arith.lua"),
    "\n",
    include_str!("../../lua/fixed_window.lua"),
    "\n",
    include_str!("../../lua/sliding_window.lua"),
    "\n",
    include_str!("../../lua/sliding_log.lua"),
    "\n",
    include_str!("../../lua/token_bucket.lua"),
    "\n",
    include_str!("../../lua/gcra.lua"),
    "\n",
    include_str!("../../lua/concurrency.lua"),
    "\n",
    include_str!("../../lua/refund.lua"),
    "\n",
    include_str!("../../lua/request.lua"),
);

/// Consecutive failed calls that open the breaker.
const TRIP_AFTER: u32 = 3;
/// How often an open breaker probes Redis (the script, run for no limits).
const PROBE_EVERY: Duration = Duration::from_millis(200);
/// Refusals remembered at most (least recently used ones are dropped).
pub const REFUSAL_CACHE_ENTRIES: usize = 65_536;
/// Longest a refusal is answered locally, however far its retry time: a key reset by
/// hand in Redis (or lost with its data) is seen again within this long.
const REFUSAL_HOLD_MAX: Duration = Duration::from_secs(60);
const REFUSAL_SHARDS: usize = 16;
/// A lease release that failed is tried again after this long, then twice as long
/// each time, up to `RELEASE_RETRY_MAX`, until it succeeds or the lease would have
/// expired anyway.
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(2);
/// Requests whose release is being tried again at most; beyond that, a failed
/// release is left to expire (memory stays bounded through a long outage).
const RELEASES_RETRYING_MAX: usize = 65_536;
/// Requests decided by one script call at most: a call blocks Redis while it runs,
/// and 64 requests with one limit each take it about 0.5 ms.
const BATCH_MAX: usize = 64;
/// How long a take (`reserve`) may wait for Redis' answer, whatever the request's
/// timeout: a late answer still brings its units (`acquire_reserving`).
const TAKE_WITHIN: Duration = Duration::from_secs(2);
/// Integers the script answers per limit (`verdict`).
const REPLY_PER_LIMIT: usize = 3;

/// Where the store lives and how long a call may take.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub target: RedisTarget,
    /// Bound on one limiter call, connection waits and retries included.
    pub timeout: Duration,
    pub key_prefix: String,
    /// Refusals remembered locally; 0 turns the refusal cache off.
    pub refusal_cache: usize,
}

#[derive(Debug, Clone)]
pub enum RedisTarget {
    /// One server: `redis://` or `rediss://`.
    Url(String),
    /// Redis Cluster seed nodes.
    Cluster(Vec<String>),
    /// One server, the primary Redis Sentinel names, followed through failovers.
    Sentinel(SentinelTarget),
}

#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    conn: Link,
    script: Script,
    timeout: Duration,
    prefix: String,
    /// Random per process, in base64url digits: with `requests`, makes sliding-log
    /// members and concurrency leases unique across instances.
    instance: String,
    requests: AtomicU64,
    breaker: Breaker,
    refusals: Option<RefusalCache>,
    /// Requests whose lease release failed and is being tried again.
    retrying: Arc<AtomicUsize>,
    /// Requests waiting for a script call (one Redis server only: on a cluster each
    /// request is a call of its own, its keys' slot deciding the node).
    batch: Option<Arc<Batch>>,
    /// The time sent with every limiter call; None (production): Redis' own clock
    /// (`TIME`), which every instance shares. Only tests drive it (`connect_at`).
    clock: Option<Arc<dyn Clock>>,
    /// The units this instance holds of limits with `reserve`.
    reserves: Arc<Reserves>,
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

    fn is_cluster(&self) -> bool {
        matches!(self, Link::Fixed(Connection::Cluster(_)))
    }

    /// Notified when calls go to another server from now on (Sentinel named a new
    /// primary).
    fn moved(&self) -> Option<Arc<tokio::sync::Notify>> {
        match self {
            Link::Fixed(_) => None,
            Link::Sentinel(p) => Some(p.moved()),
        }
    }
}

// === impl RedisStore ===

impl RedisStore {
    /// Connects and loads the script. An unreachable Redis is not an error: the store
    /// starts with its breaker open (not ready, `on_error` applies) and keeps probing.
    pub async fn connect(opts: RedisOptions) -> Result<RedisStore, StoreError> {
        RedisStore::open(opts, None).await
    }

    /// `connect`; with a `clock`, every request is decided at its time instead of
    /// Redis' (for tests that drive time across a window's end), and refusals are
    /// not cached (the cache runs on real time).
    pub(crate) async fn open(
        opts: RedisOptions,
        clock: Option<Arc<dyn Clock>>,
    ) -> Result<RedisStore, StoreError> {
        let timeout = opts.timeout.max(Duration::from_millis(1));
        // Connecting (TCP, TLS, HELLO) happens off the request path, behind the shared
        // connection future, and each call is bounded by `timeout` anyway: a slow
        // handshake may take longer than one call without failing for good.
        let connect_timeout = timeout.max(Duration::from_secs(1));
        let config = |e: redis::RedisError| StoreError::Config(e.to_string());
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
        let conn = match &opts.target {
            RedisTarget::Url(url) => {
                let client = redis::Client::open(url.as_str()).map_err(config)?;
                Link::Fixed(Connection::Single(
                    ConnectionManager::new_lazy_with_config(client, single).map_err(config)?,
                ))
            }
            RedisTarget::Sentinel(target) => {
                Link::Sentinel(Primary::start(target.clone(), single, connect_timeout).await)
            }
            RedisTarget::Cluster(nodes) => {
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
        let inner = Arc::new(Inner {
            conn,
            script: Script::new(SCRIPT),
            timeout,
            prefix: opts.key_prefix,
            instance: {
                let mut s = String::with_capacity(11);
                push_id(&mut s, RandomState::new().hash_one(std::process::id()));
                s
            },
            requests: AtomicU64::new(0),
            breaker: Breaker::default(),
            refusals: match clock {
                Some(_) => None,
                None => RefusalCache::new(opts.refusal_cache),
            },
            retrying: Arc::new(AtomicUsize::new(0)),
            batch: match opts.target {
                RedisTarget::Url(_) | RedisTarget::Sentinel(_) => Some(Arc::new(Batch::default())),
                RedisTarget::Cluster(_) => None,
            },
            clock,
            reserves: Reserves::new(RESERVE_ENTRIES),
            calls: OnceLock::new(),
        });
        if let Some(batch) = &inner.batch {
            tokio::spawn(dispatch(Arc::downgrade(&inner), batch.clone()));
        }
        match tokio::time::timeout(connect_timeout, inner.load()).await {
            Ok(Ok(())) => {
                tracing::info!(sha = %inner.script.get_hash(), "limiter script loaded into Redis")
            }
            Ok(Err(e)) => {
                inner.breaker.trip();
                tracing::error!(error = %e, "Redis unreachable at startup; applying store.on_error until it answers");
            }
            Err(_) => {
                inner.breaker.trip();
                tracing::error!(
                    "Redis did not answer at startup; applying store.on_error until it answers"
                );
            }
        }
        spawn_prober(Arc::downgrade(&inner));
        Ok(RedisStore { inner })
    }

    /// Decides one request against every limit of `plan` for `key` in the namespace
    /// `ns`, at the Redis server's time. Concurrency slots it takes are given back at
    /// once: see `acquire`.
    pub async fn check(&self, ns: &str, key: &str, plan: &Plan) -> Result<Verdict, StoreError> {
        self.acquire(ns, key, plan).await.map(|c| c.verdict)
    }

    /// `check`, returning with the verdict the permit that holds the request's
    /// concurrency leases until it is dropped.
    pub async fn acquire(&self, ns: &str, key: &str, plan: &Plan) -> Result<Checked, StoreError> {
        let inner = &self.inner;
        if plan.limits.is_empty() {
            return Ok(Checked {
                verdict: allowed_empty(),
                permit: Permit::None,
            });
        }
        let cache_key = (inner.tag(ns, key), fingerprint(plan));
        if plan.reserving() {
            return self.acquire_reserving(cache_key, plan).await;
        }
        let sent = Instant::now();
        if let Some(answer) = inner.answer_without_call(&cache_key, sent) {
            return answer;
        }
        let uid = inner.uid_for(plan);
        // Built before the call: whatever becomes of the call, the leases it may take
        // are given back (see below).
        let mut leases = plan.has_concurrency().then(|| Leases {
            inner: self.inner.clone(),
            keys: plan
                .limits
                .iter()
                .filter_map(|l| match l.algorithm {
                    Algorithm::Concurrency { lease_us, .. } => Some((
                        limit_key(&cache_key.0, l.id),
                        Duration::from_micros(lease_us),
                    )),
                    _ => None,
                })
                .collect(),
            uid: uid.clone(),
        });
        let result = inner
            .decide(Part::new(&cache_key.0, plan, &uid), plan)
            .await;
        match &result {
            Ok(v) => {
                inner.breaker.success();
                if let (false, Some(cache)) = (v.allowed, &inner.refusals) {
                    // Refused until `retry`; with delay mode a wait of max_delay would be
                    // admitted, so only until retry - max_delay. Counted from when the
                    // call was sent, which is no later than the server's now. Only the
                    // limits that use capacity up count: a concurrency slot can free at
                    // any moment.
                    let hold = refused_until_us(plan, v).saturating_sub(plan.max_delay_us());
                    if hold > 0 {
                        let hold = Duration::from_micros(hold).min(REFUSAL_HOLD_MAX);
                        cache.insert(cache_key.clone(), sent, sent + hold, v);
                    }
                }
            }
            Err(e) => {
                if inner.breaker.failure() {
                    tracing::error!(error = %e, failures = TRIP_AFTER, "Redis keeps failing; breaker open, applying store.on_error while probing");
                } else {
                    tracing::warn!(error = %e, "Redis limiter call failed");
                }
            }
        }
        // A failed call may still have taken its leases: the script was sent, and a
        // call that timed out on this side (Redis stalled by a fork, a long script, a
        // slow network) usually runs later. Dropping `leases` removes them (`ZREM`),
        // sent on the same connection after the script, so it runs after it; if the
        // script never ran, it removes nothing.
        let verdict = result?;
        let permit = match (verdict.allowed, leases.take()) {
            (true, Some(leases)) => Permit::Redis(leases.hold()),
            // Refused: the script took nothing (all limits admit, or none is charged).
            (false, Some(mut leases)) => {
                leases.keys.clear();
                Permit::None
            }
            (_, None) => Permit::None,
        };
        Ok(Checked { verdict, permit })
    }

    /// `acquire` for a plan whose every limit has `reserve`: admitted from the units
    /// this instance holds for the key when they pay for it; otherwise one call that
    /// decides the request and takes units for the next ones (`limit::reserve`). One
    /// such call per key at a time: requests that find one out wait for it (within the
    /// timeout), then look again.
    async fn acquire_reserving(
        &self,
        cache_key: (String, u64),
        plan: &Plan,
    ) -> Result<Checked, StoreError> {
        use super::reserve::Found;
        let inner = &self.inner;
        let deadline = tokio::time::Instant::now() + inner.timeout;
        let mut waited = false;
        let (wants, taking) = loop {
            match inner.reserves.find(&cache_key.0, cache_key.1, plan, waited) {
                Found::Admitted(verdict) => {
                    inner.count(CallKind::Local);
                    return Ok(Checked {
                        verdict,
                        permit: Permit::None,
                    });
                }
                Found::Wait(notified) => {
                    waited = true;
                    // A take that outlasts the timeout (a chain of them at a burst's
                    // start, a slow Redis) does not fail the request: it makes a call
                    // of its own, taking nothing, as without `reserve`.
                    if tokio::time::timeout_at(deadline, notified).await.is_err() {
                        break (vec![0; plan.limits.len()], None);
                    }
                }
                Found::Call(wants, taking) => break (wants, taking),
            }
        };
        // (A refusal or an open breaker ends the take at once: `taking` is dropped.)
        let sent = Instant::now();
        if let Some(answer) = inner.answer_without_call(&cache_key, sent) {
            return answer;
        }
        let uid = inner.uid_for(plan);
        let Some(taking) = taking else {
            // Nothing to take: a call like any other.
            let result = inner
                .decide(Part::new(&cache_key.0, plan, &uid), plan)
                .await;
            return self.settle(result, &cache_key, plan, sent);
        };
        // The take runs as a task of its own, bounded by `TAKE_WITHIN` rather than the
        // request's timeout: a call that Redis answers late (stalled by a fork or a
        // long script) still brings its units to the key, instead of leaving them
        // counted in Redis and spent by no one. The request waits only its timeout.
        // On one server it shares a script call with the requests waiting then, as
        // any request does.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let part = Part::taking(&cache_key.0, plan, &uid, &wants);
        let (task, plan_of_take, tag) = (inner.clone(), plan.clone(), cache_key.clone());
        let within = inner.timeout.max(TAKE_WITHIN);
        let sent_us = inner.reserves.now_us();
        tokio::spawn(async move {
            let mut taking = taking;
            let result = task
                .ask_within(part, within)
                .await
                .and_then(|(reply, now)| Ok((verdict_taking(&plan_of_take, &reply)?, now)));
            match &result {
                Ok(((verdict, taken), now)) if verdict.allowed => {
                    taking.keep(&plan_of_take, verdict, taken, sent_us, *now);
                }
                // Remembered before the requests waiting for this take look again,
                // so they are refused from the cache rather than each by a call.
                Ok(((verdict, _), _)) => task.remember_refusal(&tag, &plan_of_take, verdict, sent),
                Err(_) => {}
            }
            drop(taking);
            let _ = tx.send(result.map(|((verdict, _), _)| verdict));
        });
        let result = match tokio::time::timeout(inner.timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(StoreError::Unavailable("store closed".into())),
            Err(_) => Err(StoreError::Timeout),
        };
        self.settle(result, &cache_key, plan, sent)
    }

    /// What a reserving request's call ended with, as `acquire` records it: the
    /// breaker told, a refusal remembered until its retry time.
    fn settle(
        &self,
        result: Result<Verdict, StoreError>,
        cache_key: &(String, u64),
        plan: &Plan,
        sent: Instant,
    ) -> Result<Checked, StoreError> {
        let inner = &self.inner;
        match result {
            Ok(verdict) => {
                inner.breaker.success();
                inner.remember_refusal(cache_key, plan, &verdict, sent);
                Ok(Checked {
                    verdict,
                    permit: Permit::None,
                })
            }
            Err(e) => {
                if inner.breaker.failure() {
                    tracing::error!(error = %e, failures = TRIP_AFTER, "Redis keeps failing; breaker open, applying store.on_error while probing");
                } else {
                    tracing::warn!(error = %e, "Redis limiter call failed");
                }
                Err(e)
            }
        }
    }

    /// `acquire` for a request whose limits count several keys, one share each. On one
    /// Redis server the shares go in one script call as one request: every limit
    /// decided, then all charged or none. On a cluster the keys of different shares
    /// live in different slots, so each share is a call of its own, sent at once; when
    /// one refuses, the shares that admitted are refunded (`refund`).
    pub async fn acquire_shares(
        &self,
        shares: &[Share<'_>],
        trial: u64,
    ) -> Result<Checked, StoreError> {
        let inner = &self.inner;
        let n = shares.iter().map(|s| s.at.len()).sum();
        let tags: Vec<String> = shares.iter().map(|s| inner.tag(s.ns, s.key)).collect();
        let sent = Instant::now();
        // A share refused a moment ago refuses the request: the shares not asked
        // are reported as admitting (the headers speak of the refusing limit).
        if let Some(cache) = &inner.refusals {
            for (s, tag) in shares.iter().zip(&tags) {
                if let Some(v) = cache.get(&(tag.clone(), fingerprint(s.plan)), sent) {
                    return Ok(Checked {
                        verdict: Verdict::of_shares(n, trial, [(s.at, v.outcomes)]),
                        permit: Permit::None,
                    });
                }
            }
        }
        if inner.breaker.is_open() {
            inner.breaker.skipped.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Open);
        }
        let uid = if shares.iter().any(|s| needs_uid(s.plan)) {
            inner.uid()
        } else {
            String::new()
        };
        let mut leases = shares
            .iter()
            .any(|s| s.plan.has_concurrency())
            .then(|| Leases {
                inner: self.inner.clone(),
                keys: shares
                    .iter()
                    .zip(&tags)
                    .flat_map(|(s, tag)| {
                        s.plan.limits.iter().filter_map(move |l| match l.algorithm {
                            Algorithm::Concurrency { lease_us, .. } => {
                                Some((limit_key(tag, l.id), Duration::from_micros(lease_us)))
                            }
                            _ => None,
                        })
                    })
                    .collect(),
                uid: uid.clone(),
            });
        let result = match &inner.batch {
            // One server: one request of the script.
            Some(_) => {
                let limits = shares
                    .iter()
                    .zip(&tags)
                    .flat_map(|(s, tag)| s.plan.limits.iter().map(move |l| (tag.as_str(), l)));
                let max_delay = shares.first().map_or(0, |s| s.plan.max_delay_us());
                let part = Part::of(limits, max_delay, &uid, None);
                inner.ask(part).await.and_then(|(reply, _)| {
                    let mut at = 0;
                    let mut verdicts = Vec::with_capacity(shares.len());
                    for s in shares {
                        let len = REPLY_PER_LIMIT * s.plan.limits.len();
                        verdicts.push(verdict(s.plan, &reply[at..at + len])?);
                        at += len;
                    }
                    Ok(verdicts)
                })
            }
            // A cluster: a call per share, refunds when one refuses.
            None => {
                let parts: Vec<Part> = shares
                    .iter()
                    .zip(&tags)
                    .map(|(s, tag)| Part::new(tag, s.plan, &uid))
                    .collect();
                let parts: Vec<[&Part; 1]> = parts.iter().map(|p| [p]).collect();
                let calls = parts.iter().map(|p| inner.run(p, inner.now_us()));
                let answers = futures_util::future::join_all(calls).await;
                let decided: Vec<Result<(Verdict, u64), StoreError>> = shares
                    .iter()
                    .zip(answers)
                    .map(|(s, a)| a.and_then(|(reply, now)| Ok((verdict(s.plan, &reply)?, now))))
                    .collect();
                let refused = decided
                    .iter()
                    .any(|d| d.as_ref().map_or(true, |(v, _)| !v.allowed));
                if refused {
                    self.refund_admitted(shares, &tags, &decided, &uid);
                }
                decided
                    .into_iter()
                    .map(|d| d.map(|(v, _)| v))
                    .collect::<Result<Vec<_>, _>>()
            }
        };
        match &result {
            Ok(_) => inner.breaker.success(),
            Err(e) => {
                if inner.breaker.failure() {
                    tracing::error!(error = %e, failures = TRIP_AFTER, "Redis keeps failing; breaker open, applying store.on_error while probing");
                } else {
                    tracing::warn!(error = %e, "Redis limiter call failed");
                }
            }
        }
        let verdicts = result?;
        let verdict = Verdict::of_shares(
            n,
            trial,
            shares
                .iter()
                .zip(&verdicts)
                .map(|(s, v)| (s.at, v.outcomes.clone())),
        );
        if !verdict.allowed {
            if let Some(cache) = &inner.refusals {
                for ((s, tag), v) in shares.iter().zip(&tags).zip(&verdicts) {
                    let hold = refused_until_us(s.plan, v).saturating_sub(s.plan.max_delay_us());
                    if !v.allowed && hold > 0 {
                        let hold = Duration::from_micros(hold).min(REFUSAL_HOLD_MAX);
                        cache.insert((tag.clone(), fingerprint(s.plan)), sent, sent + hold, v);
                    }
                }
            }
        }
        let permit = match (verdict.allowed, leases.take()) {
            (true, Some(leases)) => Permit::Redis(leases.hold()),
            (false, Some(mut leases)) => {
                leases.keys.clear();
                Permit::None
            }
            (_, None) => Permit::None,
        };
        Ok(Checked { verdict, permit })
    }

    /// After a cluster's calls for one request's shares: the shares that admitted it
    /// (another refused, or failed) are refunded what they were charged, each on its
    /// own node at the time it decided, in a task of its own (the refusal does not
    /// wait for it). Only the limits that admitted, and were charged, are refunded: a
    /// limit on trial that refused, or one charged from the response, charged
    /// nothing. A refund that fails leaves the charge (the key counts
    /// one request more than it should until its window passes); it is logged.
    fn refund_admitted(
        &self,
        shares: &[Share<'_>],
        tags: &[String],
        decided: &[Result<(Verdict, u64), StoreError>],
        uid: &str,
    ) {
        let mut refunds = Vec::new();
        for ((s, tag), d) in shares.iter().zip(tags).zip(decided) {
            let Ok((v, at)) = d else { continue };
            if !v.allowed {
                continue;
            }
            let admitted = s
                .plan
                .limits
                .iter()
                .zip(&v.outcomes)
                .filter(|(l, o)| o.allowed && l.at_admission())
                .map(|(l, _)| (tag.as_str(), l));
            refunds.push((Part::of(admitted, s.plan.max_delay_us(), uid, None), *at));
        }
        if refunds.is_empty() {
            return;
        }
        let inner = self.inner.clone();
        tokio::spawn(async move {
            for (part, at) in refunds {
                if let Err(e) = inner.refund(&[&part], at).await {
                    tracing::warn!(error = %e, "Redis Cluster: a refused request's charge on another node could not be refunded; that key counts it until its window passes");
                }
            }
        });
    }

    /// `check` at an explicit time instead of the server's clock, for driving a table of
    /// cases. Skips the refusal cache (it runs on real time).
    pub async fn check_at(
        &self,
        ns: &str,
        key: &str,
        plan: &Plan,
        now_us: u64,
    ) -> Result<Verdict, StoreError> {
        if plan.limits.is_empty() {
            return Ok(allowed_empty());
        }
        let tag = self.inner.tag(ns, key);
        let uid = self.inner.uid_for(plan);
        let reply = self
            .inner
            .run(&[&Part::new(&tag, plan, &uid)], Some(now_us))
            .await?;
        verdict(plan, &reply.0)
    }

    /// `check_at`, taking `wants[i]` units beyond the cost for limit i when admitted
    /// at once (the script's `reserve` arithmetic, for the table of cases): the
    /// verdict and the units taken. Nothing is held locally.
    pub async fn take_at(
        &self,
        ns: &str,
        key: &str,
        plan: &Plan,
        now_us: u64,
        wants: &[u64],
    ) -> Result<(Verdict, Vec<u64>), StoreError> {
        let tag = self.inner.tag(ns, key);
        let uid = self.inner.uid_for(plan);
        let (reply, _) = self
            .inner
            .run(&[&Part::taking(&tag, plan, &uid, wants)], Some(now_us))
            .await?;
        verdict_taking(plan, &reply)
    }

    /// Charges what a response said requests cost: each share's limits (limits
    /// charged from the response, with the units to charge as their `cost`),
    /// whatever is left, in one call (on a cluster, one per share). `now_us`: a
    /// driven clock, for the tests; None in production (the server's).
    pub async fn charge_response(
        &self,
        shares: &[(&str, &str, &Plan)],
        now_us: Option<u64>,
    ) -> Result<(), StoreError> {
        let inner = &self.inner;
        if inner.breaker.is_open() {
            return Err(StoreError::Open);
        }
        let tags: Vec<String> = shares.iter().map(|(ns, k, _)| inner.tag(ns, k)).collect();
        let needs = shares.iter().any(|(_, _, p)| needs_uid(p));
        let uid = if needs { inner.uid() } else { String::new() };
        let max_delay = shares.first().map_or(0, |(_, _, p)| p.max_delay_us());
        let at = Time::Anyway(now_us.or(inner.now_us()));
        match &inner.batch {
            Some(_) => {
                let limits = shares
                    .iter()
                    .zip(&tags)
                    .flat_map(|((_, _, p), tag)| p.limits.iter().map(move |l| (tag.as_str(), l)));
                inner
                    .call(&[&Part::of(limits, max_delay, &uid, None)], at)
                    .await?;
            }
            None => {
                for ((_, _, p), tag) in shares.iter().zip(&tags) {
                    inner.call(&[&Part::new(tag, p, &uid)], at).await?;
                }
            }
        }
        Ok(())
    }

    /// `check_at`, then, if admitted, the refund a cluster sends when another key
    /// refuses (`refund_admitted`), at once: for holding `lua/refund.lua` to
    /// `Algorithm::refund`.
    pub async fn check_refunded_at(
        &self,
        ns: &str,
        key: &str,
        plan: &Plan,
        now_us: u64,
    ) -> Result<Verdict, StoreError> {
        let tag = self.inner.tag(ns, key);
        let uid = self.inner.uid_for(plan);
        let (reply, now) = self
            .inner
            .run(&[&Part::new(&tag, plan, &uid)], Some(now_us))
            .await?;
        let v = verdict(plan, &reply)?;
        if v.allowed {
            let admitted = plan
                .limits
                .iter()
                .zip(&v.outcomes)
                .filter(|(l, o)| o.allowed && l.at_admission())
                .map(|(l, _)| (tag.as_str(), l));
            let part = Part::of(admitted, plan.max_delay_us(), &uid, None);
            self.inner.refund(&[&part], now).await?;
        }
        Ok(v)
    }

    /// Runs one command over the store's shared connection, bounded by its timeout;
    /// for the other users of the same Redis (the shared deny list).
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> Result<T, StoreError> {
        self.query_within(cmd, self.inner.timeout).await
    }

    /// `query` with its own bound, for calls that may take longer than a limiter call
    /// (reading a large deny list page by page).
    pub async fn query_within<T: FromRedisValue>(
        &self,
        cmd: &Cmd,
        timeout: Duration,
    ) -> Result<T, StoreError> {
        self.inner.count(CallKind::Other);
        match tokio::time::timeout(timeout, self.inner.query(cmd)).await {
            Ok(r) => r.map_err(|e| StoreError::Unavailable(e.to_string())),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// Counts this store's calls in `calls` from now on (once; later calls do nothing).
    pub fn count_calls_in(&self, calls: Arc<StoreCalls>) {
        let _ = self.inner.calls.set(calls);
    }

    /// The URL of the server in use when Redis Sentinel names it (it changes with a
    /// failover); None before one is named, and for a fixed server or a cluster.
    pub fn primary_url(&self) -> Option<String> {
        match &self.inner.conn {
            Link::Sentinel(p) => p.url(),
            Link::Fixed(_) => None,
        }
    }

    /// The key prefix (`store.redis.key_prefix`).
    pub fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    /// False while the breaker is open: Redis failed repeatedly and has not answered a
    /// probe since.
    pub fn ready(&self) -> bool {
        !self.inner.breaker.is_open()
    }

    /// Requests answered by `on_error` without calling Redis because the breaker was
    /// open.
    pub fn skipped(&self) -> u64 {
        self.inner.breaker.skipped.load(Ordering::Relaxed)
    }

    /// The Redis keys of `plan`'s limits for `key` in `ns`, in plan order.
    pub fn keys(&self, ns: &str, key: &str, plan: &Plan) -> Vec<String> {
        let tag = self.inner.tag(ns, key);
        plan.limits.iter().map(|l| limit_key(&tag, l.id)).collect()
    }
}

fn allowed_empty() -> Verdict {
    Verdict {
        allowed: true,
        delay_us: 0,
        outcomes: Vec::new(),
        trial: 0,
    }
}

// === impl Inner ===

impl Inner {
    fn tag(&self, ns: &str, key: &str) -> String {
        tag(&self.prefix, ns, key)
    }

    async fn load(&self) -> RedisResult<()> {
        let script = self.script.prepare_invoke();
        match self.conn.get()? {
            Connection::Single(mut c) => script.load_async(&mut c).await.map(drop),
            Connection::Cluster(mut c) => script.load_async(&mut c).await.map(drop),
        }
    }

    /// A refusal answered from the cache (`RefusalCache`) until its retry time, counted
    /// from `sent`, no later than the server's now. In delay mode a wait of max_delay
    /// would be admitted, so only until retry - max_delay. Only the limits that use
    /// capacity up count: a concurrency slot can free at any moment.
    fn remember_refusal(&self, key: &(String, u64), plan: &Plan, verdict: &Verdict, sent: Instant) {
        if let (false, Some(cache)) = (verdict.allowed, &self.refusals) {
            let hold = refused_until_us(plan, verdict).saturating_sub(plan.max_delay_us());
            if hold > 0 {
                let hold = Duration::from_micros(hold).min(REFUSAL_HOLD_MAX);
                cache.insert(key.clone(), sent, sent + hold, verdict);
            }
        }
    }

    /// The answer for a request of the key `key` that needs no call: a refusal
    /// remembered until its retry time, or the open breaker's error.
    fn answer_without_call(
        &self,
        key: &(String, u64),
        now: Instant,
    ) -> Option<Result<Checked, StoreError>> {
        if let Some(verdict) = self.refusals.as_ref().and_then(|c| c.get(key, now)) {
            return Some(Ok(Checked {
                verdict,
                permit: Permit::None,
            }));
        }
        if self.breaker.is_open() {
            self.breaker.skipped.fetch_add(1, Ordering::Relaxed);
            return Some(Err(StoreError::Open));
        }
        None
    }

    /// Counts a call of `kind` (or a local admission).
    fn count(&self, kind: CallKind) {
        if let Some(calls) = self.calls.get() {
            calls.count(kind);
        }
    }

    /// One command. A command the connection refused unsent, because it was found
    /// already closed (Redis closed it while idle: `timeout`, `CLIENT KILL`, a proxy's
    /// idle timeout), is sent again at once, on the new connection. A command that was
    /// written and then lost its connection is not: Redis may have run it, and a
    /// script run twice charges a request twice.
    async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let r = match self.conn.get()? {
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
        if let (Err(e), Link::Sentinel(p)) = (&r, &self.conn) {
            if e.kind() != ErrorKind::Server(ServerErrorKind::NoScript) {
                p.suspect();
            }
        }
        r
    }

    /// Runs the script for no limits: answers only if Redis is up and can run it
    /// (not, say, refusing scripts for lack of memory), and loads it if it is missing.
    async fn probe(&self) -> Result<(), StoreError> {
        self.run(&[], None).await.map(drop)
    }

    /// PING, bounded by the timeout.
    async fn ping(&self) -> Result<(), StoreError> {
        self.count(CallKind::Probe);
        match tokio::time::timeout(self.timeout, self.query::<String>(&redis::cmd("PING"))).await {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => Err(StoreError::Unavailable(e.to_string())),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    /// The request's id if a limit of `plan` needs one (`needs_uid`), else empty.
    fn uid_for(&self, plan: &Plan) -> String {
        if needs_uid(plan) {
            self.uid()
        } else {
            String::new()
        }
    }

    /// A request id unique across instances: sliding-log members, concurrency leases.
    fn uid(&self) -> String {
        let seq = self.requests.fetch_add(1, Ordering::Relaxed);
        let mut s = String::with_capacity(self.instance.len() + 12);
        s.push_str(&self.instance);
        s.push('.');
        push_id(&mut s, seq);
        s
    }

    /// Decides one request (`part`, for `plan`): in a script call shared with the
    /// requests waiting at the same time on one Redis server, in a call of its own on a
    /// cluster. Bounded by the timeout, the wait for a shared call included.
    async fn decide(&self, part: Part, plan: &Plan) -> Result<Verdict, StoreError> {
        let (reply, _) = self.ask(part).await?;
        verdict(plan, &reply)
    }

    /// The reply to one request (`part`), sent as `decide` says, and the time the
    /// store decided it at.
    async fn ask(&self, part: Part) -> Result<(Vec<i64>, u64), StoreError> {
        self.ask_within(part, self.timeout).await
    }

    /// `ask`, bounded by `within` (a take's: `TAKE_WITHIN`).
    async fn ask_within(
        &self,
        part: Part,
        within: Duration,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        Ok(match &self.batch {
            Some(batch) => {
                let (tx, rx) = tokio::sync::oneshot::channel();
                batch.push(Queued { part, reply: tx });
                match tokio::time::timeout(within, rx).await {
                    Ok(Ok(reply)) => reply?,
                    Ok(Err(_)) => return Err(StoreError::Unavailable("store closed".into())),
                    Err(_) => return Err(StoreError::Timeout),
                }
            }
            None => self.run_within(&[&part], self.now_us(), within).await?,
        })
    }

    /// The time a limiter call is sent with: None for Redis' own.
    fn now_us(&self) -> Option<u64> {
        self.clock.as_ref().map(|c| c.now_us())
    }

    /// One script call deciding `parts` in order (`now_us`: None = Redis' clock):
    /// the reply's integers, `Part::reply_len` of them per part, and the time the
    /// server decided at. Bounded by the timeout.
    async fn run(
        &self,
        parts: &[&Part],
        now_us: Option<u64>,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        self.run_within(parts, now_us, self.timeout).await
    }

    /// `run`, bounded by `within` instead of the timeout.
    async fn run_within(
        &self,
        parts: &[&Part],
        now_us: Option<u64>,
        within: Duration,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        let at = now_us.map(Time::At).unwrap_or(Time::Server);
        let mut reply = self.call_within(parts, at, within).await?;
        let want: usize = parts.iter().map(|p| p.reply_len()).sum();
        if reply.len() != want + 1 {
            return Err(StoreError::Unavailable(format!(
                "limiter script answered {} numbers for {} requests ({} expected)",
                reply.len(),
                parts.len(),
                want + 1
            )));
        }
        let now = reply.pop().map_or(0, |n| u64::try_from(n).unwrap_or(0));
        Ok((reply, now))
    }

    /// Undoes what the requests of `parts` (each of the limits that admitted it)
    /// were charged at `charged_us`, on this server's time: see `lua/refund.lua`.
    async fn refund(&self, parts: &[&Part], charged_us: u64) -> Result<(), StoreError> {
        self.call(parts, Time::Refund(charged_us)).await.map(drop)
    }

    /// The script called on `parts`, EVALSHA and EVAL as needed; bounded by the
    /// timeout.
    async fn call(&self, parts: &[&Part], at: Time) -> Result<Vec<i64>, StoreError> {
        self.call_within(parts, at, self.timeout).await
    }

    /// `call`, bounded by `within`.
    async fn call_within(
        &self,
        parts: &[&Part],
        at: Time,
        within: Duration,
    ) -> Result<Vec<i64>, StoreError> {
        self.count(match at {
            // The script run for no request: the breaker's probe.
            _ if parts.is_empty() => CallKind::Probe,
            Time::Server | Time::At(_) => CallKind::Decide,
            Time::Refund(_) => CallKind::Refund,
            Time::Anyway(_) => CallKind::Charge,
        });
        let command = |verb: &str, script: &str| script_call(verb, script, parts, at);
        // EVALSHA; on NOSCRIPT (flushed, restarted, failed over) EVAL with the body,
        // which runs and caches it in one step. (SCRIPT LOAD, then EVALSHA again, fails
        // when another flush lands between the two.)
        let call = async {
            let evalsha = command("EVALSHA", self.script.get_hash());
            match self.query::<Vec<i64>>(&evalsha).await {
                Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                    self.query(&command("EVAL", SCRIPT)).await
                }
                r => r,
            }
        };
        match tokio::time::timeout(within, call).await {
            Ok(r) => r.map_err(|e| StoreError::Unavailable(e.to_string())),
            Err(_) => Err(StoreError::Timeout),
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(batch) = &self.batch {
            batch.close();
        }
    }
}

// === shared script calls ===

/// One request's part of a script call: its keys and its two arguments, as
/// `lua/request.lua` reads them, built in one buffer.
struct Part {
    buf: String,
    /// Where each key ends in `buf`, then where its two arguments end.
    ends: Vec<usize>,
    /// Its limits take units in advance (`reserve`): the script answers one more
    /// integer per limit, the units taken.
    taking: bool,
}

impl Part {
    fn new(tag: &str, plan: &Plan, uid: &str) -> Part {
        Part::of(
            plan.limits.iter().map(|l| (tag, l)),
            plan.max_delay_us(),
            uid,
            None,
        )
    }

    /// `new`, taking `wants[i]` units beyond the cost for limit i (`reserve`).
    fn taking(tag: &str, plan: &Plan, uid: &str, wants: &[u64]) -> Part {
        Part::of(
            plan.limits.iter().map(|l| (tag, l)),
            plan.max_delay_us(),
            uid,
            Some(wants),
        )
    }

    /// The request of `limits`, each with the tag of the key it counts.
    fn of<'a>(
        limits: impl Iterator<Item = (&'a str, &'a LimitDef)> + Clone,
        max_delay_us: u64,
        uid: &str,
        wants: Option<&[u64]>,
    ) -> Part {
        let n = limits.clone().count();
        let tags: usize = limits.clone().map(|(t, _)| t.len()).sum();
        let mut buf = String::with_capacity(tags + n * 60 + uid.len() + 24);
        let mut ends = Vec::with_capacity(n + 2);
        for (tag, l) in limits.clone() {
            buf.push_str(tag);
            buf.push(':');
            push_id(&mut buf, l.id);
            ends.push(buf.len());
        }
        // The limits: max_delay, then each limit's letter, cost and parameters. The
        // same for every request of a route, so the script parses it once per call.
        let mut num = itoa::Buffer::new();
        buf.push_str(num.format(max_delay_us));
        for (i, (_, l)) in limits.enumerate() {
            let (code, a, b, c) = params(&l.algorithm);
            buf.push(' ');
            // A limit charged from the response after a `~`, one on trial by its
            // letter in upper case (`lua/request.lua`).
            if !l.at_admission() {
                buf.push('~');
            }
            buf.push(if l.shadow {
                code.to_ascii_uppercase()
            } else {
                code
            });
            buf.push(' ');
            buf.push_str(num.format(l.cost));
            // The units to take beyond the cost (`reserve`).
            if let Some(wants) = wants {
                buf.push('+');
                buf.push_str(num.format(wants.get(i).copied().unwrap_or(0)));
            }
            for v in [a, b, c] {
                buf.push(' ');
                buf.push_str(num.format(v));
            }
        }
        ends.push(buf.len());
        buf.push_str(uid);
        ends.push(buf.len());
        Part {
            buf,
            ends,
            taking: wants.is_some(),
        }
    }

    /// The keys, then the arguments.
    fn pieces(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.ends.iter().map(move |&end| {
            let piece = &self.buf[start..end];
            start = end;
            piece
        })
    }

    /// How many keys (limits) the request has.
    fn keys(&self) -> usize {
        self.ends.len() - 2
    }

    /// How many integers the script answers for this request.
    fn reply_len(&self) -> usize {
        (REPLY_PER_LIMIT + usize::from(self.taking)) * self.keys()
    }
}

/// A request waiting for a script call, and where its reply goes.
struct Queued {
    part: Part,
    /// Its integers, and the time the call decided at.
    reply: tokio::sync::oneshot::Sender<Result<(Vec<i64>, u64), StoreError>>,
}

/// The requests waiting for a script call. While a call is out, those that arrive
/// wait, and the next call decides them all (up to `BATCH_MAX`): under load, one
/// call per round trip instead of one per request, and Redis runs the script's setup
/// (reading its clock, defining the algorithms) once for them all. A request that
/// arrives while no call is out goes at once.
#[derive(Default)]
struct Batch {
    queue: Mutex<Queue>,
    wake: tokio::sync::Notify,
}

#[derive(Default)]
struct Queue {
    waiting: Vec<Queued>,
    /// The dispatcher found nothing to do and waits to be woken.
    idle: bool,
    closed: bool,
}

impl Batch {
    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn push(&self, q: Queued) {
        let wake = {
            let mut queue = self.lock();
            queue.waiting.push(q);
            std::mem::take(&mut queue.idle)
        };
        if wake {
            self.wake.notify_one();
        }
    }

    /// The store is gone: waiting requests get an error, the dispatcher ends.
    fn close(&self) {
        let waiting = {
            let mut queue = self.lock();
            queue.closed = true;
            std::mem::take(&mut queue.waiting)
        };
        drop(waiting);
        self.wake.notify_one();
    }
}

/// Sends the waiting requests, one script call at a time, and hands each its part of
/// the reply. Requests that stopped waiting (timed out, or their client left) before
/// their call was sent are left out of it. Ends when the store is dropped.
async fn dispatch(store: Weak<Inner>, batch: Arc<Batch>) {
    let mut sending: Vec<Queued> = Vec::with_capacity(BATCH_MAX);
    loop {
        let idle = {
            let mut queue = batch.lock();
            if queue.closed {
                return;
            }
            let n = queue.waiting.len().min(BATCH_MAX);
            sending.extend(queue.waiting.drain(..n));
            queue.idle = n == 0;
            queue.idle
        };
        if idle {
            batch.wake.notified().await;
            continue;
        }
        sending.retain(|q| !q.reply.is_closed());
        if sending.is_empty() {
            continue;
        }
        let Some(inner) = store.upgrade() else {
            return;
        };
        let parts: Vec<&Part> = sending.iter().map(|q| &q.part).collect();
        // A call that carries a take (`reserve`) waits for its answer as long as the
        // take does, so a late answer still brings its units; the requests of the
        // call stop waiting at their own timeouts.
        let within = if parts.iter().any(|p| p.taking) {
            inner.timeout.max(TAKE_WITHIN)
        } else {
            inner.timeout
        };
        let result = inner.run_within(&parts, inner.now_us(), within).await;
        drop(parts);
        drop(inner);
        match result {
            Ok((reply, now)) => {
                let mut at = 0;
                for q in sending.drain(..) {
                    let n = q.part.reply_len();
                    let _ = q.reply.send(Ok((reply[at..at + n].to_vec(), now)));
                    at += n;
                }
            }
            Err(e) => {
                for q in sending.drain(..) {
                    let _ = q.reply.send(Err(e.clone()));
                }
            }
        }
    }
}

/// How one attempt to send a command ended.
enum Sent<T> {
    /// Answered, or failed after the command may have reached Redis.
    Done(RedisResult<T>),
    /// Refused before anything was written: the connection was already closed.
    Unsent(redis::RedisError),
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

/// `<prefix>{<ns>:<key>}`: the part every key of the request shares, braces included,
/// so Redis Cluster puts them in one slot. `ns` is escaped so that it never contains
/// `:` or braces: no route name and key can make the tag of another pair. `key` is the
/// stored client key, which never contains braces.
fn tag(prefix: &str, ns: &str, key: &str) -> String {
    let mut s = String::with_capacity(prefix.len() + ns.len() + key.len() + 3);
    s.push_str(prefix);
    s.push('{');
    for c in ns.chars() {
        match c {
            '\\' => s.push_str("\\\\"),
            ':' => s.push_str("\\;"),
            '{' => s.push_str("\\("),
            '}' => s.push_str("\\)"),
            c => s.push(c),
        }
    }
    s.push(':');
    s.push_str(key);
    s.push('}');
    s
}

/// `<tag>:<limit id>`, the id in 11 base64url digits. The id already names the
/// limit, its algorithm and window (`LimitDef::id`); the limit's name is not repeated.
fn limit_key(tag: &str, id: u64) -> String {
    let mut s = String::with_capacity(tag.len() + 12);
    s.push_str(tag);
    s.push(':');
    push_id(&mut s, id);
    s
}

/// The base64url digits (RFC 4648 §5): no `:`, no braces.
const DIGITS: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

/// `n` in base64url digits, least significant first: 11 for any u64, fewer for a
/// small one (no leading zero digits).
fn push_id(s: &mut String, mut n: u64) {
    loop {
        s.push(DIGITS[(n & 63) as usize] as char);
        n >>= 6;
        if n == 0 {
            break;
        }
    }
}

/// Whether a limit of the plan needs the request's id (`uid`): sliding_log members
/// and concurrency leases are named by it.
fn needs_uid(plan: &Plan) -> bool {
    plan.limits.iter().any(|l| {
        matches!(
            l.algorithm,
            Algorithm::SlidingLog { .. } | Algorithm::Concurrency { .. }
        )
    })
}

/// The script call deciding `parts` in order: `verb` (EVALSHA or EVAL) and `script`
/// (its hash or body), every part's keys, then now (empty: Redis' clock) and every
/// part's arguments (`lua/request.lua`).
/// The script's first argument: the time it decides at, or refunds a charge of.
#[derive(Clone, Copy)]
enum Time {
    /// The server's clock (production).
    Server,
    /// A driven clock (the table of cases).
    At(u64),
    /// Refund the charges made at this time.
    Refund(u64),
    /// Charge whatever is left, at the server's time or a driven one.
    Anyway(Option<u64>),
}

fn script_call(verb: &str, script: &str, parts: &[&Part], at: Time) -> Cmd {
    let keys: usize = parts.iter().map(|p| p.keys()).sum();
    let args: usize = parts.iter().map(|p| p.ends.len()).sum();
    let bytes: usize = parts.iter().map(|p| p.buf.len()).sum();
    let mut cmd = Cmd::with_capacity(4 + args, verb.len() + script.len() + 30 + bytes);
    cmd.arg(verb).arg(script).arg(keys);
    for p in parts {
        for key in p.pieces().take(p.keys()) {
            cmd.arg(key);
        }
    }
    match at {
        Time::Server => cmd.arg(""),
        Time::At(now) => cmd.arg(now),
        Time::Refund(charged) => cmd.arg(format!("r{charged}")),
        Time::Anyway(None) => cmd.arg("c"),
        Time::Anyway(Some(now)) => cmd.arg(format!("c{now}")),
    };
    for p in parts {
        for arg in p.pieces().skip(p.keys()) {
            cmd.arg(arg);
        }
    }
    cmd
}

/// The script's letter for an algorithm (`algorithms` in `lua/request.lua`) and its
/// three parameters.
fn params(a: &Algorithm) -> (char, u64, u64, u64) {
    match *a {
        Algorithm::FixedWindow { limit, window_us } => ('f', limit, window_us, 0),
        Algorithm::CalendarMonth { limit } => ('m', limit, 0, 0),
        Algorithm::SlidingWindow { limit, window_us } => ('w', limit, window_us, 0),
        Algorithm::SlidingLog { limit, window_us } => ('l', limit, window_us, 0),
        Algorithm::TokenBucket { rate, burst } => ('t', rate.count, rate.per_us, burst),
        Algorithm::Gcra { rate, burst } => ('g', rate.count, rate.per_us, burst),
        Algorithm::Concurrency { limit, lease_us } => ('c', limit, lease_us, 0),
    }
}

/// How long a refusal holds whatever other instances do: the longest retry of the
/// refusing limits that only ever use capacity up (not concurrency, whose slots can
/// free at any moment). 0 when only concurrency refused.
fn refused_until_us(plan: &Plan, v: &Verdict) -> u64 {
    v.enforced()
        .filter(|(i, o)| !o.allowed && !plan.limits[*i].algorithm.is_concurrency())
        .map(|(_, o)| o.retry_after_us)
        .max()
        .unwrap_or(0)
}

// === leases ===

/// The concurrency leases a call may take. Admitted, they are `hold`-en while the
/// request runs; dropped otherwise (a failed call, a dropped future), they are
/// removed (`ZREM`) from a task of its own, so neither the response nor the drop
/// waits for Redis. A removal
/// that fails is tried again with backoff (`RELEASE_RETRY_FIRST` doubling up to
/// `RELEASE_RETRY_MAX`, not while the breaker is open) until it succeeds or the lease
/// would have expired anyway; if the instance dies first, each lease expires on its own.
pub struct Leases {
    inner: Arc<Inner>,
    /// Each lease's key and duration.
    keys: Vec<(String, Duration)>,
    uid: String,
}

impl Drop for Leases {
    fn drop(&mut self) {
        if self.keys.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // An admitted request's lease was taken no later than now, so it expires no
        // later than now + lease. (After a failed call the script may run later still,
        // but the first `ZREM` follows it on the connection.)
        let now = Instant::now();
        let keys = self.keys.drain(..).map(|(k, d)| (k, now + d)).collect();
        let uid = std::mem::take(&mut self.uid);
        runtime.spawn(release(self.inner.clone(), keys, uid));
    }
}

impl Leases {
    /// The leases of an admitted request, held while it runs: a task of their own
    /// renews them every third of the shortest `lease` (so a response that streams
    /// longer than its lease keeps its slot, as in memory) and removes them when the
    /// returned `LeaseGuard` is dropped.
    fn hold(mut self) -> LeaseGuard {
        let (done, until) = tokio::sync::oneshot::channel();
        let keys = std::mem::take(&mut self.keys);
        let uid = std::mem::take(&mut self.uid);
        tokio::spawn(keep(self.inner.clone(), keys, uid, until));
        LeaseGuard(done)
    }
}

/// An admitted request's concurrency leases; dropping it gives them back.
pub struct LeaseGuard(#[allow(dead_code)] tokio::sync::oneshot::Sender<()>);

/// Moves a lease's expiry to the server's now + `lease` (µs) if the lease is still
/// there, and keeps its key alive at least that long. A lease that already expired,
/// and was removed, is not taken again.
const RENEW: &str = r"
local t = redis.call('TIME')
local expires = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[2])
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', string.format('%.0f', expires), ARGV[1])
local want = math.ceil(tonumber(ARGV[2]) / 1000)
local ttl = redis.call('PTTL', KEYS[1])
if ttl >= 0 and ttl < want then redis.call('PEXPIRE', KEYS[1], want) end
return 1
";

/// Renews the leases of `uid` until `done` (the request ended), then removes them.
async fn keep(
    inner: Arc<Inner>,
    keys: Vec<(String, Duration)>,
    uid: String,
    mut done: tokio::sync::oneshot::Receiver<()>,
) {
    let shortest = keys.iter().map(|(_, d)| *d).min().unwrap_or(Duration::MAX);
    let every = (shortest / 3).max(Duration::from_millis(10));
    // Each lease expires by the time of its last renewal (or its taking) + its lease.
    let mut renewed: Vec<Instant> = vec![Instant::now(); keys.len()];
    loop {
        tokio::select! {
            _ = &mut done => break,
            _ = tokio::time::sleep(every) => {}
        }
        if inner.breaker.is_open() {
            continue;
        }
        for ((key, lease), at) in keys.iter().zip(renewed.iter_mut()) {
            let now = Instant::now();
            let micros = u64::try_from(lease.as_micros()).unwrap_or(u64::MAX);
            let mut cmd = redis::cmd("EVAL");
            cmd.arg(RENEW).arg(1).arg(key).arg(&uid).arg(micros);
            inner.count(CallKind::Renew);
            match tokio::time::timeout(inner.timeout, inner.query::<i64>(&cmd)).await {
                Ok(Ok(_)) => *at = now,
                Ok(Err(e)) => {
                    tracing::debug!(key_hash = %crate::identity::KeyHash(key), error = %e, "concurrency lease not renewed")
                }
                Err(_) => {
                    tracing::debug!(key_hash = %crate::identity::KeyHash(key), "concurrency lease renewal timed out")
                }
            }
        }
    }
    let keys = keys
        .into_iter()
        .zip(renewed)
        .map(|((k, d), at)| (k, at + d))
        .collect();
    release(inner, keys, uid).await;
}

/// Removes the leases of `uid` (each key with the time its lease expires by), trying
/// again with backoff those that fail, while they would still be held. The first try
/// is sent whatever the breaker says (as soon as possible, right behind a call that
/// failed); later ones wait for the breaker to close, and end if the store is gone.
async fn release(first: Arc<Inner>, mut keys: Vec<(String, Instant)>, uid: String) {
    let store = Arc::downgrade(&first);
    let mut first = Some(first);
    let mut wait = RELEASE_RETRY_FIRST;
    let mut retrying: Option<Retrying> = None;
    loop {
        let try_now = first.is_some();
        let Some(inner) = first.take().or_else(|| store.upgrade()) else {
            return;
        };
        if try_now || !inner.breaker.is_open() {
            let mut failed = Vec::new();
            for (key, until) in keys {
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(&key).arg(&uid);
                inner.count(CallKind::Release);
                match tokio::time::timeout(inner.timeout, inner.query::<i64>(&cmd)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        tracing::debug!(key_hash = %crate::identity::KeyHash(&key), error = %e, "concurrency lease not released; trying again");
                        failed.push((key, until));
                    }
                    Err(_) => {
                        tracing::debug!(key_hash = %crate::identity::KeyHash(&key), "concurrency lease release timed out; trying again");
                        failed.push((key, until));
                    }
                }
            }
            keys = failed;
        }
        // A lease that expires before the next try needs none.
        let next = Instant::now() + wait;
        keys.retain(|(_, until)| *until > next);
        if keys.is_empty() {
            return;
        }
        if retrying.is_none() {
            retrying = Retrying::take(&inner.retrying);
            if retrying.is_none() {
                tracing::debug!(
                    "too many concurrency lease releases being retried; this one expires on its own"
                );
                return;
            }
        }
        drop(inner);
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(RELEASE_RETRY_MAX);
    }
}

/// One of the `RELEASES_RETRYING_MAX` releases being tried again; given back on drop.
struct Retrying(Arc<AtomicUsize>);

impl Retrying {
    fn take(count: &Arc<AtomicUsize>) -> Option<Retrying> {
        count
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < RELEASES_RETRYING_MAX).then_some(n + 1)
            })
            .ok()
            .map(|_| Retrying(count.clone()))
    }
}

impl Drop for Retrying {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Reads the script's reply for one request, three integers per limit: remaining,
/// reset_us, and the limit's decision, `wait_us` (>= 0) if it admits, else
/// `-(retry_after_us + 1)`. The request is admitted if every limit admits, after the
/// longest wait.
/// The script's reply for a request that took units (`Part::taking`): four integers
/// per limit, `verdict`'s three and the units taken beyond the cost. Nothing is taken
/// when the request is refused (the script writes nothing then).
fn verdict_taking(plan: &Plan, reply: &[i64]) -> Result<(Verdict, Vec<u64>), StoreError> {
    const PER: usize = REPLY_PER_LIMIT + 1;
    if reply.len() != PER * plan.limits.len() {
        return Err(StoreError::Unavailable(format!(
            "limiter script answered {} numbers for {} limits taking units",
            reply.len(),
            plan.limits.len()
        )));
    }
    let mut three = Vec::with_capacity(REPLY_PER_LIMIT * plan.limits.len());
    let mut taken = Vec::with_capacity(plan.limits.len());
    for o in reply.chunks_exact(PER) {
        three.extend_from_slice(&o[..REPLY_PER_LIMIT]);
        taken.push(u64::try_from(o[REPLY_PER_LIMIT]).unwrap_or(0));
    }
    let v = verdict(plan, &three)?;
    if !v.allowed {
        taken.iter_mut().for_each(|t| *t = 0);
    }
    Ok((v, taken))
}

fn verdict(plan: &Plan, reply: &[i64]) -> Result<Verdict, StoreError> {
    if reply.len() != REPLY_PER_LIMIT * plan.limits.len() {
        return Err(StoreError::Unavailable(format!(
            "limiter script answered {} numbers for {} limits",
            reply.len(),
            plan.limits.len()
        )));
    }
    let u = |v: i64| u64::try_from(v).unwrap_or(0);
    let outcomes: Vec<Outcome> = plan
        .limits
        .iter()
        .zip(reply.chunks_exact(REPLY_PER_LIMIT))
        .map(|(l, o)| {
            let allowed = o[2] >= 0;
            Outcome {
                allowed,
                quota: l.algorithm.quota(),
                remaining: u(o[0]),
                reset_us: u(o[1]),
                retry_after_us: if allowed { 0 } else { u(-1 - o[2]) },
                delay_us: if allowed { u(o[2]) } else { 0 },
            }
        })
        .collect();
    Ok(Verdict::on_trial(outcomes, plan.on_trial()))
}

/// Identifies a plan's limits (by their versions, which change with any parameter or
/// cost, while their ids, and so their state, may stay) and mode, so a reload that
/// changes them never reuses a cached refusal.
fn fingerprint(plan: &Plan) -> u64 {
    let mut h = plan.max_delay_us() ^ 0xcbf2_9ce4_8422_2325;
    for l in &plan.limits {
        h = (h ^ l.version)
            .wrapping_mul(0x0000_0100_0000_01b3)
            .rotate_left(29);
    }
    h ^ plan.limits.len() as u64
}

// === the breaker ===

/// Counts consecutive failures; open after `TRIP_AFTER`, closed by the first probe
/// that succeeds.
struct Breaker {
    failures: AtomicU32,
    open: AtomicBool,
    skipped: AtomicU64,
    /// When a call last succeeded, in µs since `epoch`.
    answered_us: AtomicU64,
    epoch: Instant,
}

impl Default for Breaker {
    fn default() -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            open: AtomicBool::new(false),
            skipped: AtomicU64::new(0),
            answered_us: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl Breaker {
    fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    fn success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
        let now = self.epoch.elapsed().as_micros() as u64;
        // One store per ~millisecond at most: the hot path rarely writes the line.
        if now.saturating_sub(self.answered_us.load(Ordering::Relaxed)) > 1_000 {
            self.answered_us.store(now, Ordering::Relaxed);
        }
    }

    /// Whether a call succeeded within the last `d`.
    fn answered_within(&self, d: Duration) -> bool {
        let last = self.answered_us.load(Ordering::Relaxed);
        last != 0 && self.epoch.elapsed().as_micros() as u64 - last < d.as_micros() as u64
    }

    /// A probe answered: the failures in a row start again from zero.
    fn probe_answered(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// Counts a failure; true if it opened the breaker.
    fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        n >= TRIP_AFTER && self.trip()
    }

    /// Opens the breaker; true if it was closed.
    fn trip(&self) -> bool {
        !self.open.swap(true, Ordering::Relaxed)
    }

    fn close(&self) {
        self.failures.store(0, Ordering::Relaxed);
        self.open.store(false, Ordering::Relaxed);
    }
}

/// Probes Redis every `PROBE_EVERY` unless a call has just succeeded: while the
/// breaker is open, the first answer closes it; while it is closed, failed probes
/// count like failed calls, so an idle instance notices a Redis that went away (and
/// `/readyz` says so) within `TRIP_AFTER` probes. The PINGs are also the keepalive: no
/// connection is ever idle for longer than `PROBE_EVERY`, far below the smallest
/// server `timeout` (1 s), so Redis never closes one as idle. A store that moved to
/// another primary (Sentinel) is probed at once. Ends when the store is dropped.
fn spawn_prober(store: Weak<Inner>) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let moved = store.upgrade().and_then(|inner| inner.conn.moved());
        loop {
            match &moved {
                Some(moved) => tokio::select! {
                    _ = tick.tick() => {}
                    _ = moved.notified() => {}
                },
                None => {
                    tick.tick().await;
                }
            }
            let Some(inner) = store.upgrade() else { return };
            let open = inner.breaker.is_open();
            // A call that just answered kept the one connection busy; on a cluster it
            // reached one node, and the PING (sent to every node) keeps the others'
            // connections from being closed as idle.
            let cluster = inner.conn.is_cluster();
            if !open && !cluster && inner.breaker.answered_within(PROBE_EVERY) {
                continue;
            }
            // An open breaker closes only once the script itself runs; an idle one
            // just checks that Redis answers.
            let answer = if open {
                inner.probe().await
            } else {
                inner.ping().await
            };
            match answer {
                Ok(()) if open => {
                    inner.breaker.close();
                    tracing::info!("Redis answers again; limits are decided in Redis");
                }
                // Not `success()`: stamped as an answer, a probe would skip the next one,
                // and an idle instance would probe every 2 × PROBE_EVERY.
                Ok(()) => inner.breaker.probe_answered(),
                Err(e) if open => tracing::debug!(error = %e, "Redis probe failed"),
                Err(e) => {
                    if inner.breaker.failure() {
                        tracing::error!(error = %e, failures = TRIP_AFTER, "Redis does not answer; breaker open, applying store.on_error while probing");
                    } else {
                        tracing::warn!(error = %e, "Redis probe failed");
                    }
                }
            }
        }
    });
}

// === the refusal cache ===

/// Remembers refusals until their retry time (at most `REFUSAL_HOLD_MAX`). Exact:
/// other instances can only use capacity, never add it, so a key Redis refused until T
/// stays refused until T. (Deleting keys by hand, or losing Redis' data, is the
/// exception: then a cached refusal outlasts its cause, by `REFUSAL_HOLD_MAX` at most.)
struct RefusalCache {
    shards: Box<[Mutex<LruCache<CacheKey, Refusal>>]>,
    hasher: RandomState,
    /// Refusals held, over all shards: while there are none (a limiter that refuses
    /// nothing), a lookup takes no lock.
    held: AtomicUsize,
}

/// (the request's key tag, the plan's fingerprint).
type CacheKey = (String, u64);

struct Refusal {
    at: Instant,
    until: Instant,
    verdict: Verdict,
}

impl RefusalCache {
    fn new(capacity: usize) -> Option<RefusalCache> {
        if capacity == 0 {
            return None;
        }
        let per_shard =
            NonZeroUsize::new(capacity.div_ceil(REFUSAL_SHARDS)).unwrap_or(NonZeroUsize::MIN);
        let shards = (0..REFUSAL_SHARDS)
            .map(|_| Mutex::new(LruCache::sparse(per_shard)))
            .collect();
        Some(RefusalCache {
            shards,
            hasher: RandomState::new(),
            held: AtomicUsize::new(0),
        })
    }

    fn shard(&self, key: &CacheKey) -> std::sync::MutexGuard<'_, LruCache<CacheKey, Refusal>> {
        let i = self.hasher.hash_one(key) as usize % self.shards.len();
        self.shards[i]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The refusal of `key`, if it still holds at `now`, with the times that remain.
    fn get(&self, key: &CacheKey, now: Instant) -> Option<Verdict> {
        if self.held.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut shard = self.shard(key);
        let r = shard.get(key)?;
        if r.until <= now {
            shard.pop(key);
            self.held.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        let elapsed = now.saturating_duration_since(r.at).as_micros() as u64;
        let mut v = r.verdict.clone();
        for o in &mut v.outcomes {
            o.reset_us = o.reset_us.saturating_sub(elapsed);
            if !o.allowed {
                o.retry_after_us = o.retry_after_us.saturating_sub(elapsed).max(1);
            }
        }
        Some(v)
    }

    fn insert(&self, key: CacheKey, at: Instant, until: Instant, verdict: &Verdict) {
        let refusal = Refusal {
            at,
            until,
            verdict: verdict.clone(),
        };
        let mut shard = self.shard(&key);
        let before = shard.len();
        shard.put(key, refusal);
        // Under the shard's lock: `held` is the sum of the shards' lengths.
        if shard.len() > before {
            self.held.fetch_add(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limit::{LimitDef, Mode, Rate};

    fn plan(mode: Mode) -> Plan {
        Plan {
            limits: vec![
                LimitDef::new(
                    "a".into(),
                    Algorithm::FixedWindow {
                        limit: 3,
                        window_us: 1_000_000,
                    },
                    1,
                ),
                LimitDef::new(
                    "b".into(),
                    Algorithm::Gcra {
                        rate: Rate {
                            count: 10,
                            per_us: 1_000_000,
                        },
                        burst: 5,
                    },
                    1,
                ),
            ],
            mode,
        }
    }

    #[test]
    fn script_holds_every_algorithm_and_the_runner_last() {
        for name in [
            "fixed_window",
            "sliding_window",
            "sliding_log",
            "token_bucket",
            "gcra",
            "concurrency",
        ] {
            assert!(
                SCRIPT.contains(&format!("local function {name}(")),
                "{name}"
            );
        }
        let runner = SCRIPT.find("local parsed = {}").unwrap();
        assert!(SCRIPT.rfind("local function").unwrap() < runner);
    }

    #[test]
    fn keys_share_one_hash_tag() {
        assert_eq!(tag("sluice:", "api", "1.2.3.4"), "sluice:{api:1.2.3.4}");
        assert_eq!(tag("sluice:", "api/ip", "::1"), "sluice:{api/ip:::1}");
        // A route name can not pose as another route with a longer key.
        assert_ne!(tag("", "a:b", "c"), tag("", "a", "b:c"));
        assert_eq!(tag("", "a:b{c}\\", "k"), "{a\\;b\\(c\\)\\\\:k}");
        // The limit id in base64url digits, least significant first.
        assert_eq!(limit_key("sluice:{api:k}", 0xab), "sluice:{api:k}:rC");
        assert_eq!(limit_key("sluice:{api:k}", 0), "sluice:{api:k}:A");
        assert_eq!(limit_key("", u64::MAX), ":__________P");
        let id = LimitDef::new(
            "burst".into(),
            Algorithm::FixedWindow {
                limit: 3,
                window_us: 1_000_000,
            },
            1,
        )
        .id;
        let key = limit_key("sluice:{api:203.0.113.7}", id);
        assert_eq!(key.len(), "sluice:{api:203.0.113.7}:".len() + 11, "{key}");
        // Distinct ids, distinct keys; no digit is a separator or a brace.
        let mut seen = std::collections::HashSet::new();
        for id in (0..5_000u64).chain((13..64).map(|b| 1 << b)) {
            let k = limit_key("t", id);
            assert!(!k[2..].contains([':', '{', '}']), "{k}");
            assert!(seen.insert(k));
        }
    }

    /// What one call sends: every request's keys, then now, then per request its
    /// limits (max_delay, then each limit's letter, cost and parameters) and its id.
    #[test]
    fn one_call_sends_one_argument_per_key_and_per_limit() {
        let p = plan(Mode::Delay { max_delay_us: 250 });
        let one = Part::new("sluice:{r:k}", &p, "");
        let mut single = p.clone();
        single.limits.truncate(1);
        single.mode = Mode::Reject;
        let two = Part::new("sluice:{r:j}", &single, "id.7");
        let cmd = script_call("EVALSHA", "abc", &[&one, &two], Time::Server);
        let args: Vec<String> = cmd
            .args_iter()
            .map(|a| match a {
                redis::Arg::Simple(b) => String::from_utf8(b.to_vec()).unwrap(),
                _ => unreachable!("no cursor"),
            })
            .collect();
        let key = |tag: &str, i: usize| limit_key(tag, p.limits[i].id);
        assert_eq!(
            args,
            [
                "EVALSHA",
                "abc",
                "3",
                &key("sluice:{r:k}", 0),
                &key("sluice:{r:k}", 1),
                &key("sluice:{r:j}", 0),
                "",
                "250 f 1 3 1000000 0 g 1 10 1000000 5",
                "",
                "0 f 1 3 1000000 0",
                "id.7",
            ]
        );
        assert_eq!((one.reply_len(), two.reply_len()), (6, 3));
        assert!(!needs_uid(&p));
        let at = script_call("EVAL", "body", &[&two], Time::At(17));
        assert_eq!(at.args_iter().count(), 3 + 1 + 1 + 2);
    }

    #[test]
    fn fingerprint_changes_with_limits_and_mode() {
        let a = fingerprint(&plan(Mode::Reject));
        assert_eq!(a, fingerprint(&plan(Mode::Reject)));
        assert_ne!(a, fingerprint(&plan(Mode::Delay { max_delay_us: 5 })));
        assert_ne!(
            fingerprint(&plan(Mode::Delay { max_delay_us: 5 })),
            fingerprint(&plan(Mode::Delay { max_delay_us: 6 }))
        );
        let mut p = plan(Mode::Reject);
        p.limits.reverse();
        assert_ne!(a, fingerprint(&p));
        p.limits.pop();
        assert_ne!(a, fingerprint(&p));
    }

    /// A reload that changes a limit's numbers keeps its state (same id, same key) but
    /// must not be answered by a refusal cached under the old numbers.
    #[test]
    fn fingerprint_changes_with_every_parameter_and_cost_while_the_key_stays() {
        let base = plan(Mode::Reject);
        let with = |i: usize, algorithm: Algorithm, cost: u64| {
            let mut p = base.clone();
            let name = p.limits[i].name.clone();
            p.limits[i] = LimitDef::new(name, algorithm, cost);
            p
        };
        let rate = |count, per_us| Rate { count, per_us };
        let window = |limit| Algorithm::FixedWindow {
            limit,
            window_us: 1_000_000,
        };
        let gcra = |rate, burst| Algorithm::Gcra { rate, burst };
        let changed = [
            with(0, window(4), 1),
            with(0, window(3), 2),
            with(1, gcra(rate(10, 2_000_000), 5), 1),
            with(1, gcra(rate(11, 1_000_000), 5), 1),
            with(1, gcra(rate(10, 1_000_000), 6), 1),
            with(1, gcra(rate(10, 1_000_000), 5), 3),
        ];
        let tag = tag("sluice:", "r", "k");
        let keys =
            |p: &Plan| -> Vec<String> { p.limits.iter().map(|l| limit_key(&tag, l.id)).collect() };
        let mut seen = vec![fingerprint(&base)];
        for p in &changed {
            assert_eq!(keys(p), keys(&base), "{p:?}");
            let f = fingerprint(p);
            assert!(!seen.contains(&f), "{p:?}");
            seen.push(f);
        }
    }

    #[test]
    fn reply_becomes_a_verdict() {
        let p = plan(Mode::Reject);
        // The first limit admits (2 left), the second refuses (retry in 40 µs).
        let v = verdict(&p, &[2, 30, 0, 0, 50, -41]).unwrap();
        assert!(!v.allowed);
        assert_eq!(v.delay_us, 0);
        let seen: Vec<_> = v
            .outcomes
            .iter()
            .map(|o| {
                (
                    o.allowed,
                    o.remaining,
                    o.reset_us,
                    o.retry_after_us,
                    o.delay_us,
                )
            })
            .collect();
        assert_eq!(seen, [(true, 2, 30, 0, 0), (false, 0, 50, 40, 0)]);
        // Both admit, one after a wait: the request waits the longest.
        let v = verdict(&p, &[2, 30, 0, 4, 50, 700]).unwrap();
        assert_eq!(
            (v.allowed, v.delay_us, v.outcomes[1].delay_us),
            (true, 700, 700)
        );
        // A refusal with no time to wait still refuses.
        let v = verdict(&p, &[2, 30, 0, 0, 0, -1]).unwrap();
        assert_eq!((v.allowed, v.outcomes[1].retry_after_us), (false, 0));
        assert!(verdict(&p, &[1, 0, 17]).is_err());
    }

    #[test]
    fn refusals_are_answered_with_the_time_left_and_then_forgotten() {
        let cache = RefusalCache::new(4).unwrap();
        let refused = Outcome {
            allowed: false,
            retry_after_us: 500_000,
            reset_us: 900_000,
            ..Outcome::default()
        };
        let admitted = Outcome {
            allowed: true,
            reset_us: 100_000,
            ..Outcome::default()
        };
        let v = Verdict {
            allowed: false,
            delay_us: 0,
            outcomes: vec![admitted, refused],
            trial: 0,
        };
        let t0 = Instant::now();
        let key = ("sluice:{r:k}".to_string(), 7);
        cache.insert(key.clone(), t0, t0 + Duration::from_micros(500_000), &v);
        let got = cache
            .get(&key, t0 + Duration::from_micros(200_000))
            .unwrap();
        assert_eq!(
            (got.outcomes[1].retry_after_us, got.outcomes[1].reset_us),
            (300_000, 700_000)
        );
        assert_eq!(
            (got.outcomes[0].retry_after_us, got.outcomes[0].reset_us),
            (0, 0)
        );
        assert!(cache.get(&("sluice:{r:k}".to_string(), 8), t0).is_none());
        assert!(cache
            .get(&key, t0 + Duration::from_micros(500_000))
            .is_none());
        assert!(cache.get(&key, t0).is_none(), "expired entries are dropped");
        assert!(RefusalCache::new(0).is_none());
    }

    /// A concurrency slot can free at any moment: a refusal holds only as long as the
    /// limits that use capacity up say.
    #[test]
    fn only_limits_that_use_capacity_up_hold_a_refusal() {
        let mut p = plan(Mode::Reject);
        p.limits.push(LimitDef::new(
            "c".into(),
            Algorithm::Concurrency {
                limit: 1,
                lease_us: 60_000_000,
            },
            1,
        ));
        let o = |allowed, retry_after_us| Outcome {
            allowed,
            retry_after_us,
            ..Outcome::default()
        };
        let v = |outcomes: Vec<Outcome>| Verdict {
            allowed: false,
            delay_us: 0,
            outcomes,
            trial: 0,
        };
        let only_slots = v(vec![o(true, 0), o(true, 0), o(false, 1_000_000)]);
        assert_eq!(refused_until_us(&p, &only_slots), 0);
        let both = v(vec![o(false, 300), o(true, 0), o(false, 1_000_000)]);
        assert_eq!(refused_until_us(&p, &both), 300);
    }

    #[test]
    fn the_cache_is_bounded() {
        let cache = RefusalCache::new(REFUSAL_SHARDS).unwrap();
        let t0 = Instant::now();
        let v = Verdict {
            allowed: false,
            delay_us: 0,
            outcomes: vec![],
            trial: 0,
        };
        for i in 0..10_000u64 {
            cache.insert((i.to_string(), 0), t0, t0 + Duration::from_secs(60), &v);
        }
        let held: usize = cache.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= REFUSAL_SHARDS, "{held}");
    }

    /// Failed releases are retried for a bounded number of requests at once; a slot
    /// is given back when its release ends.
    #[test]
    fn retried_releases_are_bounded() {
        let count = Arc::new(AtomicUsize::new(RELEASES_RETRYING_MAX - 2));
        let a = Retrying::take(&count).unwrap();
        let b = Retrying::take(&count).unwrap();
        assert!(Retrying::take(&count).is_none());
        assert_eq!(count.load(Ordering::Relaxed), RELEASES_RETRYING_MAX);
        drop(a);
        assert_eq!(count.load(Ordering::Relaxed), RELEASES_RETRYING_MAX - 1);
        let c = Retrying::take(&count).unwrap();
        drop((b, c));
        assert_eq!(count.load(Ordering::Relaxed), RELEASES_RETRYING_MAX - 2);
    }

    fn dropped() -> redis::RedisError {
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
            attempt(async { Err::<(), _>(redis::RedisError::from((ErrorKind::Client, "no"))) })
                .await;
        assert!(matches!(refused, Sent::Done(Err(_))));
        assert!(matches!(attempt(async { Ok(7) }).await, Sent::Done(Ok(7))));
    }
}
