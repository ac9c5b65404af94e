//! Whether each target of an upstream is in use: left out passively after
//! `max_fails` failed connections within `fail_timeout` (nginx's `max_fails` and
//! `fail_timeout`), then tried again by one request; and, with `health_check`,
//! actively (out after two failed checks in a row, back after two good ones).
//!
//! The request path reads one atomic per request (`Health::in_use`); everything
//! else runs only when a connection fails or a target is out.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use http::{Request, StatusCode};
use prometheus::{IntGauge, IntGaugeVec};

use crate::http::conn::coarse_ms;
use crate::upstream::h2::H2Error;
use crate::upstream::pool::Exchanged;
use crate::upstream::{Target, Upstream, Via};

/// `out_until_ms` of a target the active checks left out: until two good checks.
const CHECKED_OUT: u64 = u64::MAX;

/// Failed (or good) checks in a row that take a target out (or bring it back).
const CHECKS_IN_A_ROW: i32 = 2;

/// How targets are left out, and for how long (`upstreams.*.max_fails`,
/// `fail_timeout`).
#[derive(Debug, Clone, Copy)]
pub struct Passive {
    /// 0: a target is never left out.
    pub max_fails: u32,
    pub fail_timeout: Duration,
}

/// `upstreams.*.health_check`.
#[derive(Debug, Clone)]
pub struct Check {
    pub path: http::uri::PathAndQuery,
    pub interval: Duration,
    pub timeout: Duration,
}

/// One target's state: in use, at first.
#[derive(Default)]
pub struct Health {
    /// Left out until then (`coarse_ms`); 0: in use; `CHECKED_OUT`: left out by the
    /// active checks.
    out_until_ms: AtomicU64,
    /// Failed connections in the window that started at `window_ms`.
    fails: AtomicU32,
    window_ms: AtomicU64,
    /// When a request last took the one try of a target whose time out has passed
    /// (0: none): another may only after `fail_timeout`, should that one never
    /// have come back.
    trial_ms: AtomicU64,
    /// Active checks in a row: good ones counted up, failed ones down.
    streak: AtomicI32,
    /// A check is running.
    checking: AtomicBool,
    /// `sluice_upstream_target_healthy{upstream,target}`: resolved once the
    /// upstream serves (`start`), so a reload that fails leaves no series behind.
    gauge: OnceLock<IntGauge>,
}

/// What `Health` says of a target at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// In use.
    Up,
    /// Left out after failed connections, until its time out has passed.
    Out,
    /// Its time out has passed: the next request tries it.
    Retry,
    /// Left out by the active checks.
    CheckedOut,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Up => "up",
            State::Out => "out",
            State::Retry => "retry",
            State::CheckedOut => "failing checks",
        }
    }
}

impl Health {
    /// The gauge, once resolved, set to `v` (a change of state: never per request).
    fn show(&self, v: i64) {
        if let Some(g) = self.gauge.get() {
            g.set(v);
        }
    }

    /// In use: not left out (the request path's one load).
    #[inline]
    pub fn in_use(&self) -> bool {
        self.out_until_ms.load(Ordering::Relaxed) == 0
    }

    /// In use, or left out with its time out over (not claiming the one try).
    pub fn usable(&self, now: u64) -> bool {
        let until = self.out_until_ms.load(Ordering::Relaxed);
        until == 0 || (until != CHECKED_OUT && now >= until)
    }

    /// In use; or left out with its time out over and no other request trying
    /// it (then this one does).
    pub fn claim(&self, now: u64, passive: &Passive) -> bool {
        let until = self.out_until_ms.load(Ordering::Relaxed);
        if until == 0 {
            return true;
        }
        if until == CHECKED_OUT || now < until {
            return false;
        }
        let trial = self.trial_ms.load(Ordering::Relaxed);
        let stale = trial == 0 || now.saturating_sub(trial) >= ms(passive.fail_timeout);
        stale
            && self
                .trial_ms
                .compare_exchange(trial, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    pub fn state(&self, now: u64) -> State {
        match self.out_until_ms.load(Ordering::Relaxed) {
            0 => State::Up,
            CHECKED_OUT => State::CheckedOut,
            until if now >= until => State::Retry,
            _ => State::Out,
        }
    }

    /// A connection was made (or a kept one used): a target left out passively is
    /// back. (One load when it was in use.)
    #[inline]
    pub(super) fn connected(&self, upstream: &str, target: &Target) {
        let until = self.out_until_ms.load(Ordering::Relaxed);
        if until != 0 && until != CHECKED_OUT {
            self.back(upstream, target, until);
        }
    }

    #[cold]
    fn back(&self, upstream: &str, target: &Target, was: u64) {
        if self
            .out_until_ms
            .compare_exchange(was, 0, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            self.fails.store(0, Ordering::Relaxed);
            self.trial_ms.store(0, Ordering::Relaxed);
            self.show(1);
            tracing::info!(upstream, target = ?target, "upstream target back in use");
        }
    }

    /// A connection to the target could not be made: counted, and the target left
    /// out at `max_fails` within `fail_timeout`; one tried after its time out and
    /// failed again is left out again at once. Whether it is now left out.
    #[cold]
    pub(super) fn failed(&self, upstream: &str, target: &Target, passive: &Passive) -> bool {
        if passive.max_fails == 0 {
            return false;
        }
        let now = coarse_ms();
        let span = ms(passive.fail_timeout);
        let until = self.out_until_ms.load(Ordering::Relaxed);
        if until == CHECKED_OUT {
            return true;
        }
        if until != 0 {
            // Its one try failed (or a request that took it before it was left
            // out): out again for fail_timeout.
            self.out_until_ms
                .store(now.saturating_add(span).max(1), Ordering::Relaxed);
            self.trial_ms.store(0, Ordering::Relaxed);
            return true;
        }
        let start = self.window_ms.load(Ordering::Relaxed);
        let fails = if start == 0 || now.saturating_sub(start) >= span {
            self.window_ms.store(now.max(1), Ordering::Relaxed);
            self.fails.store(1, Ordering::Relaxed);
            1
        } else {
            self.fails.fetch_add(1, Ordering::Relaxed) + 1
        };
        if fails < passive.max_fails {
            return false;
        }
        self.fails.store(0, Ordering::Relaxed);
        self.window_ms.store(0, Ordering::Relaxed);
        if self
            .out_until_ms
            .compare_exchange(
                0,
                now.saturating_add(span).max(1),
                Ordering::Relaxed,
                Ordering::Relaxed,
            )
            .is_ok()
        {
            self.show(0);
            tracing::warn!(
                upstream,
                target = ?target,
                fails,
                fail_timeout = ?passive.fail_timeout,
                "upstream target left out: its connections failed"
            );
        }
        true
    }

    /// One active check's result: two in a row change the target's state.
    fn checked(&self, upstream: &str, target: &Target, good: bool, why: &str) {
        let streak = self.streak.load(Ordering::Relaxed);
        let streak = match (good, streak) {
            (true, s) if s > 0 => s.saturating_add(1),
            (true, _) => 1,
            (false, s) if s < 0 => s.saturating_sub(1),
            (false, _) => -1,
        };
        self.streak.store(streak, Ordering::Relaxed);
        let until = self.out_until_ms.load(Ordering::Relaxed);
        if streak == -CHECKS_IN_A_ROW && until != CHECKED_OUT {
            self.out_until_ms.store(CHECKED_OUT, Ordering::Relaxed);
            self.show(0);
            tracing::warn!(upstream, target = ?target, why, "upstream target left out: its health checks failed");
        } else if streak == CHECKS_IN_A_ROW && until == CHECKED_OUT {
            self.out_until_ms.store(0, Ordering::Relaxed);
            self.fails.store(0, Ordering::Relaxed);
            self.show(1);
            tracing::info!(upstream, target = ?target, "upstream target back in use: its health checks pass");
        }
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Upstreams that now serve (at startup, and those a reload built anew): each
/// target's `sluice_upstream_target_healthy` child is resolved, set to its state,
/// and the active checks of each upstream that has them start, in a task that ends
/// when the upstream is dropped (a reload replaced it).
pub fn start(upstreams: &[Arc<Upstream>], healthy: &IntGaugeVec) {
    for up in upstreams {
        for t in &up.targets {
            let gauge = healthy.with_label_values(&[up.name.as_str(), t.label().as_str()]);
            gauge.set(i64::from(t.health.in_use()));
            let _ = t.health.gauge.set(gauge);
        }
    }
    for up in upstreams {
        let Some(check) = up.check.clone() else {
            continue;
        };
        let weak = Arc::downgrade(up);
        tokio::spawn(run_checks(weak, check));
    }
}

async fn run_checks(up: Weak<Upstream>, check: Check) {
    let mut tick = tokio::time::interval(check.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(upstream) = up.upgrade() else {
            return;
        };
        for t in 0..upstream.targets.len() {
            let target = &upstream.targets[t];
            // A check still running (a slow target) is not doubled.
            if target.health.checking.swap(true, Ordering::Relaxed) {
                continue;
            }
            let (upstream, check) = (upstream.clone(), check.clone());
            tokio::spawn(async move {
                let target = &upstream.targets[t];
                let result = tokio::time::timeout(check.timeout, probe(target, &check)).await;
                let (good, why) = match result {
                    Ok(Ok(status)) if status.is_success() || status.is_redirection() => {
                        (true, String::new())
                    }
                    Ok(Ok(status)) => (false, format!("answered {status}")),
                    Ok(Err(e)) => (false, e),
                    Err(_) => (false, format!("no answer within {:?}", check.timeout)),
                };
                target.health.checked(&upstream.name, target, good, &why);
                target.health.checking.store(false, Ordering::Relaxed);
            });
        }
    }
}

/// A GET of the check's path on `target`, in the upstream's protocol; its status.
async fn probe(target: &Target, check: &Check) -> Result<StatusCode, String> {
    let host = http::HeaderValue::from_str(target.authority.as_str()).map_err(|e| e.to_string())?;
    let h2 = match &target.via {
        Via::H1(_) => None,
        Via::H2(h2) => Some(h2),
        Via::Auto(_, h2) => (!h2.picked_http1()).then_some(h2),
    };
    if let Some(h2) = h2 {
        let mut uri = http::uri::Parts::default();
        uri.scheme = Some(target.scheme.clone());
        uri.authority = Some(target.authority.clone());
        uri.path_and_query = Some(check.path.clone());
        let mut req = Request::new(crate::http::body::empty());
        *req.uri_mut() = http::Uri::from_parts(uri).map_err(|e| e.to_string())?;
        *req.version_mut() = http::Version::HTTP_2;
        return match h2.send(req).await {
            Ok(resp) => Ok(resp.status()),
            Err(H2Error::Send(e)) => Err(e.to_string()),
            Err(H2Error::Unsent(_, e)) => Err(format!("connecting: {e}")),
            Err(H2Error::Http1(..)) => Err("the target picked HTTP/1.1".into()),
        };
    }
    let pool = match &target.via {
        Via::H1(pool) | Via::Auto(pool, _) => pool,
        Via::H2(_) => return Err("no HTTP/1.1 pool".into()),
    };
    let mut req = Request::new(crate::http::body::empty());
    *req.uri_mut() = http::Uri::from(check.path.clone());
    req.headers_mut().insert(http::header::HOST, host);
    req.headers_mut().insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static("sluice-health-check"),
    );
    let (mut parts, body) = req.into_parts();
    match pool
        .send(&mut parts, body, Default::default(), None)
        .await
        .map_err(|e| e.to_string())?
    {
        Exchanged::Response(resp, _) => {
            let status = resp.status();
            // Read to its end, so the connection goes back to the pool.
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            Ok(status)
        }
        Exchanged::Switched(..) => Err("the target switched protocols".into()),
    }
}
