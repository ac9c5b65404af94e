//! Concurrency leases in Redis: held while an admitted request runs, renewed by a
//! script (by EVALSHA), removed when it ends; a removal that fails is tried again.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use super::call::limit_key;
use super::Inner;
use crate::limit::StoreError;
use crate::limit::{Algorithm, LimitDef, Permit};
use crate::redis::Script;
use crate::telemetry::metrics::CallKind;

/// A lease release that failed is tried again after this long, then twice as long
/// each time, up to `RELEASE_RETRY_MAX`, until it succeeds or the lease would have
/// expired anyway.
const RELEASE_RETRY_FIRST: Duration = Duration::from_millis(50);
const RELEASE_RETRY_MAX: Duration = Duration::from_secs(2);
/// Requests whose release is being tried again at most; beyond that, a failed
/// release is left to expire (memory stays bounded through a long outage).
const RELEASES_RETRYING_MAX: usize = 65_536;

// === leases ===

/// The concurrency leases a call may take. Admitted, they are `hold`-en while the
/// request runs; dropped otherwise (a failed call, a dropped future), they are
/// removed (`ZREM`) from a task of its own, so neither the response nor the drop
/// waits for Redis. A removal
/// that fails is tried again with backoff (`RELEASE_RETRY_FIRST` doubling up to
/// `RELEASE_RETRY_MAX`, not while the breaker is open) until it succeeds or the lease
/// would have expired anyway; if the instance dies first, each lease expires on its own.
pub(super) struct Leases {
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
    /// The leases a call for `limits` (each with the tag of the key it counts) may
    /// take: one per concurrency limit, named by the request's `uid`.
    pub(super) fn of<'a>(
        inner: &Arc<Inner>,
        limits: impl Iterator<Item = (&'a str, &'a LimitDef)>,
        uid: &str,
    ) -> Leases {
        let keys = limits
            .filter_map(|(tag, l)| match l.algorithm {
                Algorithm::Concurrency { lease_us, .. } => {
                    Some((limit_key(tag, l.id), Duration::from_micros(lease_us)))
                }
                _ => None,
            })
            .collect();
        Leases {
            inner: inner.clone(),
            keys,
            uid: uid.to_owned(),
        }
    }

    /// What the leases of a call that answered become: held while an admitted
    /// request runs; given back at once otherwise (a refused request's script took
    /// nothing: all limits admit, or none is charged).
    pub(super) fn permit(leases: Option<Leases>, allowed: bool) -> Permit {
        match (allowed, leases) {
            (true, Some(leases)) => Permit::Redis(leases.hold()),
            (false, Some(mut leases)) => {
                leases.keys.clear();
                Permit::None
            }
            (_, None) => Permit::None,
        }
    }

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
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));

const RENEW_LUA: &str = r"
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
        if inner.redis.breaker().is_open() {
            continue;
        }
        for ((key, lease), at) in keys.iter().zip(renewed.iter_mut()) {
            let now = Instant::now();
            let micros = u64::try_from(lease.as_micros()).unwrap_or(u64::MAX);
            let mut renew = RENEW.call(1);
            renew.arg(key).arg(&uid).arg(micros);
            let within = inner.redis.timeout();
            match inner
                .redis
                .call::<i64, _>(CallKind::Renew, &renew, within)
                .await
            {
                Ok(_) => *at = now,
                Err(StoreError::Timeout) => {
                    tracing::debug!(key_hash = %crate::identity::KeyHash(key), "concurrency lease renewal timed out")
                }
                Err(e) => {
                    tracing::debug!(key_hash = %crate::identity::KeyHash(key), error = %e, "concurrency lease not renewed")
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
        if try_now || !inner.redis.breaker().is_open() {
            let mut failed = Vec::new();
            for (key, until) in keys {
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(&key).arg(&uid);
                let within = inner.redis.timeout();
                match inner
                    .redis
                    .call::<i64, _>(CallKind::Release, &cmd, within)
                    .await
                {
                    Ok(_) => {}
                    Err(StoreError::Timeout) => {
                        tracing::debug!(key_hash = %crate::identity::KeyHash(&key), "concurrency lease release timed out; trying again");
                        failed.push((key, until));
                    }
                    Err(e) => {
                        tracing::debug!(key_hash = %crate::identity::KeyHash(&key), error = %e, "concurrency lease not released; trying again");
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
