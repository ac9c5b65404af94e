//! The request path, top to bottom: client IP → deny → route → key → limits →
//! forward or respond. `handle` is the whole product in one function; each phase is
//! a call into its own module. The compiled configuration (`Runtime`) is read
//! through one `Arc` that a reload swaps whole.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{Request, Response, StatusCode, Version};
use hyper::body::Incoming;

use crate::answer::{self, Body, RateHeaders};
use crate::client::{ClientKey, KeySpec, MissingKey, TrustedProxies};
use crate::deny::{BanRequest, DenyTable, StaticDeny, Target};
use crate::limit::{MemoryStore, OnError, Plan, Store, Verdict};
use crate::metrics::{Decision, Metrics, RouteMetrics};
use crate::proxy::{Origin, ProxyError, Upstream};
use crate::route::Matcher;

// === the compiled configuration ===

pub struct Runtime {
    pub routes: Vec<Route>,
    pub trusted: TrustedProxies,
    /// `deny:` of the configuration; dynamic entries are in `Shared::deny`.
    pub deny: StaticDeny,
    pub rate_headers: RateHeaders,
    pub max_request_body: u64,
    pub on_error: OnError,
    /// Counters for requests that match no route.
    pub unmatched: RouteMetrics,
    /// SHA-1 of the configuration file this was compiled from.
    pub hash: String,
    /// `Authorization: Bearer <token>` required on `/admin/*` when set.
    pub admin_token: Option<String>,
}

pub struct Route {
    pub name: String,
    pub matcher: Matcher,
    pub action: Action,
    pub key: KeySpec,
    pub missing_key: MissingKey,
    /// Where limiter state of this route lives: the route name; a separate space for
    /// keys that fell back to the client IP, so no header value can ever collide
    /// with an IP fallback.
    pub ns: String,
    pub fallback_ns: String,
    pub limits: Option<Limits>,
    pub shadow: bool,
    pub ban: Option<BanRule>,
    pub metrics: RouteMetrics,
}

/// `ban:` of a route: a key refused `after` times within `within` is denied for
/// `duration`.
pub struct BanRule {
    /// Counts a key's refusals: a sliding log admitting `after - 1` per `within`, so
    /// the refusal it refuses is the `after`th.
    pub strikes: Plan,
    pub duration: std::time::Duration,
}

pub enum Action {
    Upstream(Arc<Upstream>),
    Respond {
        status: StatusCode,
        body: Bytes,
        headers: HeaderMap,
    },
}

/// A route's limits: the default tier and the tiers of named keys.
pub struct Limits {
    pub default: Tier,
    pub overrides: HashMap<String, Arc<Tier>>,
}

pub struct Tier {
    pub plan: Plan,
    /// Precomputed `RateLimit-Policy` value.
    pub policy: Option<HeaderValue>,
}

impl Limits {
    fn tier(&self, key: &str) -> &Tier {
        self.overrides
            .get(key)
            .map(|t| t.as_ref())
            .unwrap_or(&self.default)
    }
}

/// What every request shares and a reload does not replace.
pub struct Shared {
    pub runtime: ArcSwap<Runtime>,
    /// Dynamic deny entries (admin API, bans, other instances): swapped whole by the
    /// control object on every change, and kept across reloads.
    pub deny: ArcSwap<DenyTable>,
    /// Refusals counted towards bans, per (route, key).
    pub strikes: MemoryStore,
    /// Where the request path asks for a ban; the control object applies it.
    pub bans: tokio::sync::mpsc::Sender<BanRequest>,
    pub store: Store,
    pub metrics: Arc<Metrics>,
    /// `http` or `https`, how clients reach the listener.
    pub proto: &'static str,
}

// === the request path ===

pub async fn handle(
    shared: Arc<Shared>,
    req: Request<Incoming>,
    peer: SocketAddr,
) -> Response<Body> {
    let started = Instant::now();
    // One snapshot for the whole request: a reload never changes it half-way.
    let rt = shared.runtime.load_full();
    let (mut parts, body) = req.into_parts();
    // A malformed or ambiguous head is refused before anything reads it (400, on
    // route `unmatched`: nothing can be routed on it); the rest is normalised.
    if let Err(bad) = crate::request::admit(&mut parts) {
        let _tally = Tally {
            metrics: &rt.unmatched,
            started,
            decision: Decision::BadRequest,
        };
        return answer::close(bad.answer());
    }

    let ip = rt.trusted.client_ip(peer.ip(), &parts.headers);
    let route = rt.routes.iter().find(|r| r.matcher.matches(&parts));
    // Counted when dropped: a client that goes away while delayed or while the
    // upstream works is still counted, with the decision made for it.
    let mut tally = Tally {
        metrics: route.map_or(&rt.unmatched, |r| &r.metrics),
        started,
        decision: Decision::Allowed,
    };
    let has_body = parts.headers.contains_key(TRANSFER_ENCODING)
        || parts.headers.get(CONTENT_LENGTH).is_some_and(|v| v != "0");
    let http1 = parts.version < Version::HTTP_2;

    let (resp, decision) = 'answer: {
        if parts.method == http::Method::CONNECT {
            break 'answer (answer::connect_refused(), Decision::BadRequest);
        }
        // Deny by IP, whatever the route.
        if rt.deny.table.ip(ip) || shared.deny.load().ip(ip) {
            break 'answer (denied(&rt), Decision::Denied);
        }
        let Some(route) = route else {
            break 'answer (
                answer::text(StatusCode::NOT_FOUND, "no route matches this request\n"),
                Decision::Unmatched,
            );
        };
        // Every value of every key part, before any fallback: a denied key sent twice
        // (which makes it missing) is still denied.
        if denied_key(&rt, &shared, |denied| route.key.any_value(&parts, denied)) {
            break 'answer (denied(&rt), Decision::Denied);
        }
        let (ns, key) = match route.key.extract(&parts, ip) {
            Ok(k) => (&route.ns, k),
            Err(part) => match route.missing_key {
                MissingKey::Ip => (&route.fallback_ns, ClientKey::new(ip.to_string())),
                MissingKey::Reject => {
                    let msg = format!(
                        "missing {} (absent, empty or sent more than once): this route needs it to identify the client\n",
                        part.describe()
                    );
                    break 'answer (
                        answer::text(StatusCode::BAD_REQUEST, msg),
                        Decision::BadRequest,
                    );
                }
            },
        };
        // A composite key as a whole (bans deny the joined form).
        if !key.parts.is_empty() && denied_key(&rt, &shared, |denied| denied(&key.value)) {
            break 'answer (denied(&rt), Decision::Denied);
        }
        if content_length(&parts.headers).is_some_and(|n| n > rt.max_request_body) {
            let msg = format!("request body larger than {} bytes\n", rt.max_request_body);
            break 'answer (
                answer::text(StatusCode::PAYLOAD_TOO_LARGE, msg),
                Decision::BadRequest,
            );
        }

        let mut decision = Decision::Allowed;
        let mut report: Option<(&Tier, Verdict)> = None;
        if let Some(limits) = &route.limits {
            let tier = limits.tier(&key.value);
            let stored = key.stored();
            // Store unreachable: answer 503, forward unchecked, or decide in this
            // instance's memory (`on_error`); either way the decision is counted.
            let (checked, store_failed) = match shared.store.check(ns, &stored, &tier.plan).await {
                Ok(v) => (Some(v), false),
                Err(e) => {
                    // The store logs its failures; this would repeat them per request.
                    tracing::debug!(route = %route.name, error = %e, "limiter store failed");
                    match rt.on_error {
                        OnError::Deny => {
                            let r = answer::text(
                                StatusCode::SERVICE_UNAVAILABLE,
                                "rate limiter unavailable; try again later\n",
                            );
                            break 'answer (r, Decision::StoreErrorDenied);
                        }
                        OnError::Allow => (None, true),
                        OnError::Local => (shared.store.fallback(ns, &stored, &tier.plan), true),
                    }
                }
            };
            match checked {
                Some(v) if v.allowed => {
                    decision = match (store_failed, v.delay_us > 0) {
                        (true, _) => Decision::StoreErrorAllowed,
                        (false, true) => Decision::Delayed,
                        (false, false) => Decision::Allowed,
                    };
                    if v.delay_us > 0 {
                        tally.decision = decision;
                        tokio::time::sleep(v.delay()).await;
                    }
                    report = (!route.shadow).then_some((tier, v));
                }
                Some(_) if route.shadow => decision = Decision::Shadow,
                Some(v) => {
                    if let Some(ban) = &route.ban {
                        strike(&shared, route, ban, ns, &stored, &key, ip);
                    }
                    let (name, retry) = refusal(&tier.plan, &v);
                    let mut r = answer::limited(&route.name, name, retry);
                    rt.rate_headers
                        .apply(r.headers_mut(), &tier.plan, tier.policy.as_ref(), &v);
                    break 'answer (r, Decision::Limited);
                }
                None => decision = Decision::StoreErrorAllowed,
            }
        }

        tally.decision = decision;
        let mut resp = match &route.action {
            Action::Respond {
                status,
                body,
                headers,
            } => {
                let mut r = Response::new(answer::full(body.clone()));
                *r.status_mut() = *status;
                r.headers_mut()
                    .extend(headers.iter().map(|(k, v)| (k.clone(), v.clone())));
                // The body is not read: as every early answer.
                if has_body && http1 {
                    r = answer::close(r);
                }
                r
            }
            Action::Upstream(up) => {
                let origin = Origin {
                    peer: peer.ip(),
                    trusted: rt.trusted.contains(peer.ip()),
                    proto: shared.proto,
                };
                match up
                    .forward(
                        Request::from_parts(parts, body),
                        &origin,
                        rt.max_request_body,
                    )
                    .await
                {
                    Ok(r) => r,
                    Err(e) => upstream_failed(route, e),
                }
            }
        };
        if let Some((tier, v)) = &report {
            rt.rate_headers
                .apply(resp.headers_mut(), &tier.plan, tier.policy.as_ref(), v);
        }
        return resp;
    };
    tally.decision = decision;

    // Answered before the body was read: close an HTTP/1 connection that carries one.
    if has_body && http1 {
        answer::close(resp)
    } else {
        resp
    }
}

/// Counts one request's decision and duration when dropped.
struct Tally<'a> {
    metrics: &'a RouteMetrics,
    started: Instant,
    decision: Decision,
}

impl Drop for Tally<'_> {
    fn drop(&mut self) {
        self.metrics.count(self.decision);
        self.metrics
            .duration
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// Whether `values` offers a key on the static or the dynamic deny list. The dynamic
/// list's guard is dropped before the request goes on (it must not be held across an
/// await).
fn denied_key(
    rt: &Runtime,
    shared: &Shared,
    values: impl FnOnce(&mut dyn FnMut(&str) -> bool) -> bool,
) -> bool {
    let dynamic = shared.deny.load();
    if !rt.deny.table.has_keys() && !dynamic.has_keys() {
        return false;
    }
    values(&mut |k| rt.deny.table.key(k) || dynamic.key(k))
}

fn denied(rt: &Runtime) -> Response<Body> {
    answer::text(rt.deny.status, "access denied\n")
}

/// Counts a refusal towards the route's ban; the `after`th within `within` asks the
/// control object to deny the key (or, for a key that is the client IP, the
/// address). Never waits: if the control object is behind, the next refusal asks again.
fn strike(
    shared: &Shared,
    route: &Route,
    ban: &BanRule,
    ns: &str,
    stored: &str,
    key: &ClientKey,
    ip: std::net::IpAddr,
) {
    if shared.strikes.check(ns, stored, &ban.strikes).allowed {
        return;
    }
    let target = if route.key.is_ip() || ns == route.fallback_ns {
        Target::Ip(ip.into())
    } else {
        Target::Key(key.value.clone())
    };
    let _ = shared.bans.try_send(BanRequest {
        route: route.name.clone(),
        target,
        duration: ban.duration,
    });
}

fn content_length(h: &HeaderMap) -> Option<u64> {
    h.get(CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// The name of the limit that refused and how long until a retry can pass.
fn refusal<'a>(plan: &'a Plan, v: &Verdict) -> (&'a str, u64) {
    match v.headline() {
        Some((i, o)) => (plan.limits[i].name.as_str(), o.retry_after_us),
        None => ("", v.retry_after_us()),
    }
}

fn upstream_failed(route: &Route, e: ProxyError) -> Response<Body> {
    match &e {
        ProxyError::Connect(_) => route.metrics.upstream_connect.inc(),
        ProxyError::Timeout => route.metrics.upstream_timeout.inc(),
        ProxyError::Reset(_) => route.metrics.upstream_reset.inc(),
        ProxyError::Busy => route.metrics.upstream_busy.inc(),
        ProxyError::TooLarge => {}
    }
    tracing::debug!(route = %route.name, error = %e, "forwarding failed");
    let msg = match e.status() {
        StatusCode::GATEWAY_TIMEOUT => "upstream did not answer in time\n",
        StatusCode::PAYLOAD_TOO_LARGE => "request body too large\n",
        StatusCode::SERVICE_UNAVAILABLE => "upstream busy\n",
        _ => "upstream unavailable\n",
    };
    answer::text(e.status(), msg)
}
