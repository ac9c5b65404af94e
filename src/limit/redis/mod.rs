//! The Redis store: limiter state shared by every instance. All limits of one request
//! are decided by one Lua script call (one round trip), timed by the Redis server's
//! clock; the connection's breaker stops calling a Redis that keeps failing, and a
//! refusal cache answers keys that Redis has refused until their retry time without
//! asking again. The connection, scripts, batching and breaker are `crate::redis`'s;
//! this is what the limiter does with them.

mod call;
mod leases;
mod refusals;

use std::hash::{BuildHasher, RandomState};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use self::call::{
    limit_key, needs_uid, push_id, script_call, verdict, verdict_taking, Part, Time, LIMITER,
    REPLY_PER_LIMIT,
};
pub use self::leases::LeaseGuard;
use self::leases::Leases;
pub use self::refusals::REFUSAL_CACHE_ENTRIES;
use self::refusals::{fingerprint, RefusalCache};
use super::reserve::{Reserves, RESERVE_ENTRIES};
use super::{Checked, Clock, Permit, Plan, Share, StoreError, Verdict};
use crate::redis::batch::{self, Answer, Batch};
use crate::redis::{Numbers, Shared, Target};
use crate::telemetry::metrics::{CallKind, StoreCalls};

/// How long a take (`reserve`) may wait for Redis' answer, whatever the request's
/// timeout: a late answer still brings its units (`acquire_reserving`).
const TAKE_WITHIN: Duration = Duration::from_secs(2);

/// Where the store lives and how long a call may take.
#[derive(Debug, Clone)]
pub struct RedisOptions {
    pub target: Target,
    /// Bound on one limiter call, connection waits and retries included.
    pub timeout: Duration,
    pub key_prefix: String,
    /// Refusals remembered locally; 0 turns the refusal cache off.
    pub refusal_cache: usize,
}

#[derive(Clone)]
pub struct RedisStore {
    inner: Arc<Inner>,
}

struct Inner {
    redis: Shared,
    /// Random per process, in base64url digits: with `requests`, makes sliding-log
    /// members and concurrency leases unique across instances.
    instance: String,
    requests: AtomicU64,
    refusals: Option<RefusalCache>,
    /// Requests whose lease release failed and is being tried again.
    retrying: Arc<AtomicUsize>,
    /// Requests waiting for a script call (one Redis server only: on a cluster each
    /// request is a call of its own, its keys' slot deciding the node).
    batch: Option<Arc<Batch<Part>>>,
    /// The time sent with every limiter call; None (production): Redis' own clock
    /// (`TIME`), which every instance shares. Only tests drive it (`connect_at`).
    clock: Option<Arc<dyn Clock>>,
    /// The units this instance holds of limits with `reserve`.
    reserves: Arc<Reserves>,
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
        let redis = Shared::connect(opts.target, opts.timeout, opts.key_prefix).await?;
        let inner = Arc::new(Inner {
            batch: (!redis.is_cluster()).then(|| Arc::new(Batch::default())),
            redis,
            instance: {
                let mut s = String::with_capacity(11);
                push_id(&mut s, RandomState::new().hash_one(std::process::id()));
                s
            },
            requests: AtomicU64::new(0),
            refusals: match clock {
                Some(_) => None,
                None => RefusalCache::new(opts.refusal_cache),
            },
            retrying: Arc::new(AtomicUsize::new(0)),
            clock,
            reserves: Reserves::new(RESERVE_ENTRIES),
        });
        if let Some(batch) = &inner.batch {
            tokio::spawn(batch::dispatch(Arc::downgrade(&inner), batch.clone()));
        }
        let redis = &inner.redis;
        match redis.load(&LIMITER).await {
            Ok(()) => {
                tracing::info!(sha = %LIMITER.hash(), "limiter script loaded into Redis")
            }
            Err(StoreError::Timeout) => {
                redis.breaker().trip();
                tracing::error!(
                    "Redis did not answer at startup; applying store.on_error until it answers"
                );
            }
            Err(e) => {
                redis.breaker().trip();
                tracing::error!(error = %e, "Redis unreachable at startup; applying store.on_error until it answers");
            }
        }
        // The probe of an open breaker: the script run for no request.
        redis.watch(script_call(&LIMITER, &[], Time::Server));
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
        let leases = plan.has_concurrency().then(|| {
            let limits = plan.limits.iter().map(|l| (cache_key.0.as_str(), l));
            Leases::of(&self.inner, limits, &uid)
        });
        let part = Part::new(&cache_key.0, plan, &uid);
        let result = inner
            .ask(part, inner.redis.timeout())
            .await
            .and_then(|(reply, _)| verdict(plan, &reply));
        inner.redis.breaker().settle(&result);
        if let Ok(v) = &result {
            inner.remember_refusal(&cache_key.0, cache_key.1, plan, v, sent);
        }
        // A failed call may still have taken its leases: the script was sent, and a
        // call that timed out on this side (Redis stalled by a fork, a long script, a
        // slow network) usually runs later. Dropping `leases` removes them (`ZREM`),
        // sent on the same connection after the script, so it runs after it; if the
        // script never ran, it removes nothing.
        let verdict = result?;
        let permit = Leases::permit(leases, verdict.allowed);
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
        let deadline = tokio::time::Instant::now() + inner.redis.timeout();
        let mut waited = false;
        let (wants, taking) = loop {
            match inner.reserves.find(&cache_key.0, cache_key.1, plan, waited) {
                Found::Admitted(verdict) => {
                    inner.redis.count(CallKind::Local);
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
            let part = Part::new(&cache_key.0, plan, &uid);
            let result = inner
                .ask(part, inner.redis.timeout())
                .await
                .and_then(|(reply, _)| verdict(plan, &reply));
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
        let within = inner.redis.timeout().max(TAKE_WITHIN);
        let sent_us = inner.reserves.now_us();
        tokio::spawn(async move {
            let mut taking = taking;
            let result = task
                .ask(part, within)
                .await
                .and_then(|(reply, now)| Ok((verdict_taking(&plan_of_take, &reply)?, now)));
            match &result {
                Ok(((verdict, taken), now)) if verdict.allowed => {
                    taking.keep(&plan_of_take, verdict, taken, sent_us, *now);
                }
                // Remembered before the requests waiting for this take look again,
                // so they are refused from the cache rather than each by a call.
                Ok(((verdict, _), _)) => {
                    task.remember_refusal(&tag.0, tag.1, &plan_of_take, verdict, sent)
                }
                Err(_) => {}
            }
            drop(taking);
            let _ = tx.send(result.map(|((verdict, _), _)| verdict));
        });
        let result = match tokio::time::timeout(inner.redis.timeout(), rx).await {
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
        inner.redis.breaker().settle(&result);
        let verdict = result?;
        inner.remember_refusal(&cache_key.0, cache_key.1, plan, &verdict, sent);
        Ok(Checked {
            verdict,
            permit: Permit::None,
        })
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
                        verdict: Verdict::of_shares(n, trial, [(s.at, &*v.outcomes)]),
                        permit: Permit::None,
                    });
                }
            }
        }
        self.decide_shares(shares, &tags, trial, Some(sent)).await
    }

    /// `acquire_shares` with every share asked, the refusal cache neither read nor
    /// written: for Envoy's rate limit service, which reports each descriptor's own
    /// count even when another refuses.
    pub async fn acquire_shares_asked(
        &self,
        shares: &[Share<'_>],
        trial: u64,
    ) -> Result<Checked, StoreError> {
        let tags: Vec<String> = shares.iter().map(|s| self.inner.tag(s.ns, s.key)).collect();
        self.decide_shares(shares, &tags, trial, None).await
    }

    /// The call(s) of `acquire_shares`; a refusal is remembered when `remember` says
    /// when the call was sent.
    async fn decide_shares(
        &self,
        shares: &[Share<'_>],
        tags: &[String],
        trial: u64,
        remember: Option<Instant>,
    ) -> Result<Checked, StoreError> {
        let inner = &self.inner;
        let n = shares.iter().map(|s| s.at.len()).sum();
        if inner.redis.breaker().is_open() {
            return Err(inner.redis.breaker().skip());
        }
        let uid = if shares.iter().any(|s| needs_uid(s.plan)) {
            inner.uid()
        } else {
            String::new()
        };
        let leases = shares.iter().any(|s| s.plan.has_concurrency()).then(|| {
            let limits = shares
                .iter()
                .zip(tags)
                .flat_map(|(s, tag)| s.plan.limits.iter().map(move |l| (tag.as_str(), l)));
            Leases::of(&self.inner, limits, &uid)
        });
        let result = match &inner.batch {
            // One server: one request of the script.
            Some(_) => {
                let limits = shares
                    .iter()
                    .zip(tags)
                    .flat_map(|(s, tag)| s.plan.limits.iter().map(move |l| (tag.as_str(), l)));
                let max_delay = shares.first().map_or(0, |s| s.plan.max_delay_us());
                let part = Part::of(limits, max_delay, &uid, None);
                inner
                    .ask(part, inner.redis.timeout())
                    .await
                    .and_then(|(reply, _)| {
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
                    .zip(tags)
                    .map(|(s, tag)| Part::new(tag, s.plan, &uid))
                    .collect();
                let parts: Vec<[&Part; 1]> = parts.iter().map(|p| [p]).collect();
                let within = inner.redis.timeout();
                let calls = parts
                    .iter()
                    .map(|p| inner.decide(p, inner.now_us(), within));
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
                    self.refund_admitted(shares, tags, &decided, &uid);
                }
                decided
                    .into_iter()
                    .map(|d| d.map(|(v, _)| v))
                    .collect::<Result<Vec<_>, _>>()
            }
        };
        inner.redis.breaker().settle(&result);
        let verdicts = result?;
        let verdict = Verdict::of_share_verdicts(n, trial, shares, &verdicts);
        if let (false, Some(sent)) = (verdict.allowed, remember) {
            for ((s, tag), v) in shares.iter().zip(tags).zip(&verdicts) {
                inner.remember_refusal(tag, fingerprint(s.plan), s.plan, v, sent);
            }
        }
        let permit = Leases::permit(leases, verdict.allowed);
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
                let within = inner.redis.timeout();
                if let Err(e) = inner.call(&[&part], Time::Refund(at), within).await {
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
        let (tag, uid) = (self.inner.tag(ns, key), self.inner.uid_for(plan));
        let part = Part::new(&tag, plan, &uid);
        let within = self.inner.redis.timeout();
        let reply = self.inner.decide(&[&part], Some(now_us), within).await?;
        verdict(plan, &reply.0)
    }

    /// `check_at` for several requests (namespace, key, plan), decided in order by one
    /// script call, as the requests that waited for the same call are: each sees
    /// what the ones before it left. For the table of cases.
    pub async fn check_together_at(
        &self,
        requests: &[(&str, &str, &Plan)],
        now_us: u64,
    ) -> Result<Vec<Verdict>, StoreError> {
        let inner = &self.inner;
        let parts: Vec<Part> = requests
            .iter()
            .map(|(ns, key, plan)| Part::new(&inner.tag(ns, key), plan, &inner.uid_for(plan)))
            .collect();
        let parts: Vec<&Part> = parts.iter().collect();
        let within = inner.redis.timeout();
        let (reply, _) = inner.decide(&parts, Some(now_us), within).await?;
        let mut at = 0;
        let mut verdicts = Vec::with_capacity(requests.len());
        for (p, (_, _, plan)) in parts.iter().zip(requests) {
            let n = p.reply_len();
            verdicts.push(verdict(plan, &reply[at..at + n])?);
            at += n;
        }
        Ok(verdicts)
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
        let part = Part::taking(&tag, plan, &uid, wants);
        let within = self.inner.redis.timeout();
        let (reply, _) = self.inner.decide(&[&part], Some(now_us), within).await?;
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
        self.charge_at(shares, Time::Anyway(now_us.or(self.inner.now_us())))
            .await
    }

    /// Gives back what responses charged less than their estimate: each share's
    /// limits (token_bucket and gcra, whose refund needs no time of charge), their
    /// `cost` the units to give back, in one call (on a cluster, one per share).
    pub async fn give_back(&self, shares: &[(&str, &str, &Plan)]) -> Result<(), StoreError> {
        self.charge_at(shares, Time::Refund(0)).await
    }

    /// `charge_response` or `give_back`, as `at` says.
    async fn charge_at(&self, shares: &[(&str, &str, &Plan)], at: Time) -> Result<(), StoreError> {
        let inner = &self.inner;
        if inner.redis.breaker().is_open() {
            return Err(StoreError::Open);
        }
        let tags: Vec<String> = shares.iter().map(|(ns, k, _)| inner.tag(ns, k)).collect();
        let needs = shares.iter().any(|(_, _, p)| needs_uid(p));
        let uid = if needs { inner.uid() } else { String::new() };
        let max_delay = shares.first().map_or(0, |(_, _, p)| p.max_delay_us());
        let within = inner.redis.timeout();
        match &inner.batch {
            Some(_) => {
                let limits = shares
                    .iter()
                    .zip(&tags)
                    .flat_map(|((_, _, p), tag)| p.limits.iter().map(move |l| (tag.as_str(), l)));
                inner
                    .call(&[&Part::of(limits, max_delay, &uid, None)], at, within)
                    .await?;
            }
            None => {
                for ((_, _, p), tag) in shares.iter().zip(&tags) {
                    inner.call(&[&Part::new(tag, p, &uid)], at, within).await?;
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
        let within = self.inner.redis.timeout();
        let (reply, now) = self
            .inner
            .decide(&[&Part::new(&tag, plan, &uid)], Some(now_us), within)
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
            self.inner.call(&[&part], Time::Refund(now), within).await?;
        }
        Ok(v)
    }

    /// The connection this store decides in, for the other users of the same Redis
    /// (the shared deny list, the fleet view).
    pub fn redis(&self) -> &Shared {
        &self.inner.redis
    }

    /// Counts this store's calls in `calls` from now on (once; later calls do nothing).
    pub fn count_calls_in(&self, calls: Arc<StoreCalls>) {
        self.inner.redis.count_calls_in(calls);
    }

    /// The key prefix (`store.redis.key_prefix`).
    pub fn prefix(&self) -> &str {
        self.inner.redis.prefix()
    }

    /// False while the breaker is open: Redis failed repeatedly and has not answered a
    /// probe since.
    pub fn ready(&self) -> bool {
        !self.inner.redis.breaker().is_open()
    }

    /// Requests answered by `on_error` without calling Redis because the breaker was
    /// open.
    pub fn skipped(&self) -> u64 {
        self.inner.redis.breaker().skipped()
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
        outcomes: Vec::new().into(),
        trial: 0,
    }
}

// === impl Inner ===

impl Inner {
    fn tag(&self, ns: &str, key: &str) -> String {
        call::tag(self.redis.prefix(), ns, key)
    }

    /// Remembers a refusal of the key `tag` (its plan's fingerprint `fp`), sent at
    /// `sent`, in the refusal cache, if there is one.
    fn remember_refusal(&self, tag: &str, fp: u64, plan: &Plan, verdict: &Verdict, sent: Instant) {
        if let Some(cache) = &self.refusals {
            cache.remember(tag, fp, plan, verdict, sent);
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
        if self.redis.breaker().is_open() {
            return Some(Err(self.redis.breaker().skip()));
        }
        None
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

    /// The reply to one request (`part`) and the time the store decided it at: in a
    /// script call shared with the requests waiting at the same time on one Redis
    /// server (`crate::redis::batch`), in a call of its own on a cluster. Bounded by
    /// `within` (the timeout; a take's `TAKE_WITHIN`), the wait for a shared call
    /// included.
    async fn ask(&self, part: Part, within: Duration) -> Result<(Answer, u64), StoreError> {
        Ok(match &self.batch {
            Some(batch) => match tokio::time::timeout(within, batch.push(part)).await {
                Ok(Ok(reply)) => reply?,
                Ok(Err(_)) => return Err(StoreError::Unavailable("store closed".into())),
                Err(_) => return Err(StoreError::Timeout),
            },
            None => {
                let (reply, now) = self.decide(&[&part], self.now_us(), within).await?;
                (Answer::Own(reply), now)
            }
        })
    }

    /// The time a limiter call is sent with: None for Redis' own.
    fn now_us(&self) -> Option<u64> {
        self.clock.as_ref().map(|c| c.now_us())
    }

    /// One script call deciding `parts` in order (`now_us`: None = Redis' clock):
    /// the reply's integers, `Part::reply_len` of them per part, and the time the
    /// server decided at. Bounded by `within`.
    async fn decide(
        &self,
        parts: &[&Part],
        now_us: Option<u64>,
        within: Duration,
    ) -> Result<(Vec<i64>, u64), StoreError> {
        let at = now_us.map(Time::At).unwrap_or(Time::Server);
        let mut reply = self.call(parts, at, within).await?;
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

    /// The script called on `parts` at `at` (a decision, a refund, a charge),
    /// bounded by `within`.
    async fn call(
        &self,
        parts: &[&Part],
        at: Time,
        within: Duration,
    ) -> Result<Vec<i64>, StoreError> {
        let kind = match at {
            Time::Server | Time::At(_) => CallKind::Decide,
            Time::Refund(_) => CallKind::Refund,
            Time::Anyway(_) => CallKind::Charge,
        };
        let call = script_call(&LIMITER, parts, at);
        let reply = self.redis.call::<Numbers, _>(kind, &call, within).await?;
        Ok(reply.0)
    }
}

/// On one server, requests wait for a shared script call (`crate::redis::batch`).
impl batch::Sender for Inner {
    type Part = Part;

    fn reply_len(part: &Part) -> usize {
        part.reply_len()
    }

    async fn send(&self, parts: &[&Part]) -> batch::Reply {
        // A call that carries a take (`reserve`) waits for its answer as long as the
        // take does, so a late answer still brings its units; the requests of the
        // call stop waiting at their own timeouts.
        let within = if parts.iter().any(|p| p.taking) {
            self.redis.timeout().max(TAKE_WITHIN)
        } else {
            self.redis.timeout()
        };
        self.decide(parts, self.now_us(), within).await
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        if let Some(batch) = &self.batch {
            batch.close();
        }
    }
}
