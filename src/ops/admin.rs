//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and the token-guarded
//! `/admin/*` API. It is a separate listener so that it can stay on loopback while
//! the gateway faces the world. The API only translates requests into control
//! commands and their results into answers. `GET /` is the dashboard, a static page
//! whose script reads the token-guarded JSON endpoints.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{
    HeaderValue, ALLOW, AUTHORIZATION, CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, HOST,
    ORIGIN, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use serde::{Deserialize, Serialize};

use crate::config::value::parse_duration;
use crate::deny::{now_ms, rfc3339, Cursor, Entry, EntryJson, Meta, Source, Target};
use crate::http::body;
use crate::http::body::Body;
use crate::http::request::ClientBody;
use crate::http::site::{Lent, Site};
use crate::ops::control::{Command, Control, ControlError, Reply, Status, Trigger};
use crate::ops::stats::{totals_of, History, Sample, Totals, COLUMNS, UPSTREAM_COLUMNS};
use crate::pipeline::{Peer, Shared};
use crate::telemetry::metrics::Decision;

/// Largest request body the admin API reads.
pub const MAX_BODY: usize = 64 * 1024;
/// Longest `reason` kept with an entry.
const MAX_REASON: usize = 1024;
/// Entries in a page of `GET /admin/deny`: the default and the most a client may
/// ask for, so that one answer stays small (about 200 KB) however long the list.
pub const DENY_PAGE: usize = 1000;

pub struct Admin {
    pub shared: Arc<Shared>,
    pub control: Arc<Control>,
    /// Every route's sampled counters, for `/admin/stats`.
    pub history: Arc<History>,
    /// This instance and the others on the same Redis, for `/admin/fleet`.
    pub fleet: Arc<crate::ops::fleet::Fleet>,
    /// A request body must have come whole within this after its head
    /// (`admin.request_header_timeout`): else 408, and the connection closes.
    pub body_timeout: std::time::Duration,
    /// Envoy's rate limit service, with `rls:`: its domains' refusals are in
    /// `/admin/top` as routes named `rls:DOMAIN`.
    pub rls: Option<Arc<crate::rls::Service>>,
}

// The dashboard: three static files, compiled in.
const PAGE: &str = include_str!("dashboard/index.html");
const SCRIPT: &str = include_str!("dashboard/dashboard.js");
const STYLE: &str = include_str!("dashboard/dashboard.css");

/// The dashboard loads its script and style from this listener and talks to nothing
/// else; no inline script, style or event handler runs, so a route name or deny
/// reason that smuggled markup into the page could not execute.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The decisions of requests matching no route; a route's requests get every other
/// (all but `unmatched`).
const UNMATCHED_DECISIONS: [Decision; 3] =
    [Decision::Denied, Decision::Unmatched, Decision::BadRequest];

/// The admin port's HTTP/1 requests, as sluice's own server hands them over.
impl Site for Admin {
    type Peer = Peer;
    /// Nothing happens at the end of an admin request.
    type Guard = std::convert::Infallible;

    fn serve<'a>(
        &'a self,
        parts: &'a mut http::request::Parts,
        body: ClientBody,
        _peer: &'a Peer,
        _conn: Lent<'a>,
        _guard: &'a mut Option<Self::Guard>,
    ) -> impl std::future::Future<Output = Response<Body>> + Send + 'a {
        let (fresh, ()) = Request::new(()).into_parts();
        let head = std::mem::replace(parts, fresh);
        self.handle(Request::from_parts(head, body))
    }
}

impl Admin {
    pub async fn handle(&self, req: Request<ClientBody>) -> Response<Body> {
        let path = req.uri().path();
        match (req.method(), path) {
            (&Method::GET, "/metrics") => {
                // `sluice_store_degraded` as it is now.
                self.fleet.degraded();
                let mut r = Response::new(body::full(self.shared.metrics.render()));
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            (&Method::GET, "/" | "/dashboard.js" | "/dashboard.css")
                if !self.host_allowed(&req) =>
            {
                host_refused()
            }
            (&Method::GET, "/") => asset(PAGE, "text/html; charset=utf-8"),
            (&Method::GET, "/dashboard.js") => asset(SCRIPT, "text/javascript; charset=utf-8"),
            (&Method::GET, "/dashboard.css") => asset(STYLE, "text/css; charset=utf-8"),
            (&Method::GET, "/healthz") => body::text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => match self.not_ready().first() {
                Some(why) => {
                    let degraded = match self.fleet.degraded() {
                        Some(n) => format!("degraded: {}\n", degraded_text(n)),
                        None => String::new(),
                    };
                    body::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("{why}\n{degraded}"),
                    )
                }
                None => body::text(StatusCode::OK, "ready\n"),
            },
            (_, p) if p.starts_with("/admin/") => {
                if !self.host_allowed(&req) {
                    return host_refused();
                }
                if cross_site(&req) {
                    return body::text(StatusCode::FORBIDDEN, "cross-site request refused\n");
                }
                if !self.authorized(&req) {
                    let mut r =
                        body::text(StatusCode::UNAUTHORIZED, "missing or wrong bearer token\n");
                    r.headers_mut()
                        .insert("www-authenticate", HeaderValue::from_static("Bearer"));
                    return r;
                }
                self.api(req).await
            }
            _ => body::text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    /// Why `/readyz` answers 503, in the order it checks: empty when ready.
    fn not_ready(&self) -> Vec<&'static str> {
        self.control.not_ready()
    }

    /// With a token, any `Host` (the token protects the API, and an operator may use
    /// a service name). Without one, only an IP literal or `localhost`: a page whose
    /// name an attacker rebinds to 127.0.0.1 sends its own name, and is refused.
    fn host_allowed<B>(&self, req: &Request<B>) -> bool {
        if self.shared.runtime.load().admin_token.is_some() {
            return true;
        }
        request_host(req).is_some_and(local_host)
    }

    /// `/admin/*`, once authorized.
    async fn api(&self, req: Request<ClientBody>) -> Response<Body> {
        let (method, path) = (req.method().clone(), req.uri().path().to_string());
        match (path.as_str(), method) {
            ("/admin/deny", Method::GET) => self.deny_list(req.uri().query()),
            ("/admin/deny", Method::POST | Method::DELETE) if !is_json(&req) => {
                unsupported_media_type()
            }
            ("/admin/deny", Method::POST) => {
                match read::<DenyRequest>(req, self.body_timeout).await {
                    Ok(r) => self.deny_add(r).await,
                    Err(r) => r,
                }
            }
            ("/admin/deny", Method::DELETE) => {
                match read::<DenyRequest>(req, self.body_timeout).await {
                    Ok(r) => self.deny_remove(r).await,
                    Err(r) => r,
                }
            }
            ("/admin/deny", _) => not_allowed("GET, POST, DELETE"),
            ("/admin/config", Method::GET) => {
                json(StatusCode::OK, &config_view(&self.control.status()))
            }
            ("/admin/config", _) => not_allowed("GET"),
            ("/admin/stats", Method::GET) => json(StatusCode::OK, &self.stats()),
            ("/admin/stats", _) => not_allowed("GET"),
            ("/admin/top", Method::GET) => self.top(req.uri().query()).await,
            ("/admin/top", _) => not_allowed("GET"),
            ("/admin/fleet", Method::GET) => match req.uri().query().unwrap_or("") {
                "" => json(StatusCode::OK, &self.fleet.view().await),
                q => bad_request(&format!("/admin/fleet takes no query parameters: {q}")),
            },
            ("/admin/fleet", _) => not_allowed("GET"),
            // No body: no Content-Type is fine, but not what a form sends.
            ("/admin/reload", Method::POST)
                if req.headers().contains_key(CONTENT_TYPE) && !is_json(&req) =>
            {
                unsupported_media_type()
            }
            ("/admin/reload", Method::POST) => {
                let reloaded = self.control.apply(Command::Reload(Trigger::Api)).await;
                // Envoy's rate limit service's folder is read again too.
                let rls = self.rls.as_ref().map(|s| s.reload());
                match (reloaded, rls) {
                    (Err(e), _) => json(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &serde_json::json!({"result": "failure", "error": e.to_string()}),
                    ),
                    (_, Some(Err(e))) => json(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &serde_json::json!({"result": "failure", "error": e.to_string()}),
                    ),
                    (Ok(Reply::Reloaded(hash)), None) => json(
                        StatusCode::OK,
                        &serde_json::json!({"result": "success", "hash": hash}),
                    ),
                    (Ok(Reply::Reloaded(hash)), Some(Ok(rls))) => json(
                        StatusCode::OK,
                        &serde_json::json!({"result": "success", "hash": hash, "rls_hash": rls}),
                    ),
                    (Ok(other), _) => internal(other),
                }
            }
            ("/admin/reload", _) => not_allowed("POST"),
            _ => body::text(StatusCode::NOT_FOUND, "no such admin endpoint\n"),
        }
    }

    /// `/admin/stats`: every route's decisions now and over the last minutes, the
    /// store's health, and what became of the last reload.
    fn stats(&self) -> serde_json::Value {
        let rt = self.shared.runtime.load_full();
        let metrics = &self.shared.metrics;
        let routes: Vec<_> = rt
            .routes
            .iter()
            .map(|r| {
                let [c1, c2, c3, c4, c5] = r.metrics.upstream_totals();
                let [connect, timeout, reset, busy] = r.metrics.upstream_error_totals();
                let recent = self.history.route(&r.name);
                let now = totals_of(&r.metrics);
                let mut route = serde_json::json!({
                    "name": r.name,
                    "totals": totals_json(&r.metrics.totals(), Decision::of_route()),
                    "history": history_json(&recent, Decision::of_route(), true),
                    "long_history": history_json(&self.history.route_long(&r.name), Decision::of_route(), true),
                    "upstream": {"1xx": c1, "2xx": c2, "3xx": c3, "4xx": c4, "5xx": c5},
                    "upstream_errors": {"connect": connect, "timeout": timeout, "reset": reset, "busy": busy},
                    "upstream_recent": upstream_recent(&recent, &now),
                    "refused_by_limit": refused_by_limit(r),
                });
                if let crate::pipeline::Action::Upstream(up) = &r.action {
                    route["upstream_targets"] = up
                        .target_states()
                        .into_iter()
                        .map(|(target, state)| {
                            serde_json::json!({
                                "target": target,
                                "healthy": state == crate::upstream::health::State::Up,
                                "state": state.as_str(),
                            })
                        })
                        .collect();
                }
                route
            })
            .collect();
        let store = self.shared.store.redis_store().map_or(("memory", 0), |_| {
            (
                "redis",
                metrics.store_errors.with_label_values(&["redis"]).get(),
            )
        });
        let deny: serde_json::Map<_, _> = crate::deny::Source::ALL
            .iter()
            .map(|s| {
                let n = metrics.deny_entries.with_label_values(&[s.as_str()]).get();
                (s.as_str().to_string(), n.into())
            })
            .collect();
        let reloads = |result: &str| metrics.config_reloads.with_label_values(&[result]).get();
        let status = self.control.status();
        let now = now_ms();
        let not_ready = self.not_ready();
        let mut stats = serde_json::json!({
            "version": env!("CARGO_PKG_VERSION"),
            "now": rfc3339(now),
            "now_ms": now,
            "ready": not_ready.is_empty(),
            "not_ready": not_ready,
            "sample_every_ms": crate::ops::stats::SAMPLE_EVERY.as_millis() as u64,
            "keep_ms": crate::ops::stats::KEEP.as_millis() as u64,
            "long_every_ms": crate::ops::stats::LONG_EVERY.as_millis() as u64,
            "long_keep_ms": crate::ops::stats::LONG_KEEP.as_millis() as u64,
            "routes": routes,
            "unmatched": {
                "totals": totals_json(&rt.unmatched.totals(), UNMATCHED_DECISIONS),
                "history": history_json(&self.history.unmatched(), UNMATCHED_DECISIONS, false),
            },
            "store": {
                "backend": store.0,
                "ready": self.shared.store.ready(),
                "errors": store.1,
                "on_error": rt.on_error,
            },
            "config": {
                "hash": status.hash,
                "loaded_at": rfc3339(status.loaded_at_ms),
                "last_reload": reload_view(&status),
                "reloads": {"success": reloads("success"), "failure": reloads("failure")},
            },
            "deny_entries": deny,
        });
        // Only while `on_error: local` decides alone: what it enforces.
        if let Some(n) = self.fleet.degraded() {
            stats["store"]["degraded"] = degraded_text(n).into();
        }
        stats
    }

    /// `/admin/top?route=R&n=N&scope=S`: the most refused keys of route `R` (of every
    /// route without it), the most refused first, `n` of them (`TOP_DEFAULT` if not
    /// given); with `scope=fleet` summed over the live instances of the fleet
    /// (`fleet::Fleet::top`), with `scope=instance` (the default) this one's.
    async fn top(&self, query: Option<&str>) -> Response<Body> {
        let rt = self.shared.runtime.load_full();
        let (mut route, mut n, mut fleet) = (None, None, None);
        // Envoy's rate limit service's domains, as routes named `rls:DOMAIN`.
        let rls_tops = self.rls.as_ref().map(|s| s.tops()).unwrap_or_default();
        for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*name {
                "route" if route.is_some() => return bad_request("route given twice"),
                "route" => match rt.routes.iter().find(|r| r.name == value) {
                    Some(r) => route = Some(r.name.clone()),
                    None if rls_tops.iter().any(|(d, _)| format!("rls:{d}") == value) => {
                        route = Some(value.to_string())
                    }
                    None => return bad_request(&format!("no route named {value:?}")),
                },
                "n" if n.is_some() => return bad_request("n given twice"),
                "n" => match value.parse::<usize>() {
                    Ok(v) if (1..=TOP_MAX).contains(&v) => n = Some(v),
                    _ => {
                        return bad_request(&format!(
                            "n {value:?} is not a number from 1 to {TOP_MAX}"
                        ))
                    }
                },
                "scope" if fleet.is_some() => return bad_request("scope given twice"),
                "scope" => match &*value {
                    "instance" => fleet = Some(false),
                    "fleet" => fleet = Some(true),
                    other => {
                        return bad_request(&format!(
                            "scope {other:?} is neither instance nor fleet"
                        ))
                    }
                },
                other => {
                    return bad_request(&format!(
                        "unknown query parameter {other:?}: expected route, n or scope"
                    ))
                }
            }
        }
        let fleet = fleet.unwrap_or(false);
        // This instance's domains of Envoy's rate limit service, with its routes.
        let now = now_ms();
        let rls_rows: Vec<crate::ops::fleet::Offender> = rls_tops
            .iter()
            .map(|(d, top)| (format!("rls:{d}"), top))
            .flat_map(|(route, top)| {
                crate::ops::fleet::Offender::of(&route, top, now).collect::<Vec<_>>()
            })
            .collect();
        let merged = if fleet {
            match self.fleet.top(rls_rows).await {
                Ok(m) => m,
                Err(e) => {
                    return body::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!("the fleet's lists could not be read from Redis ({e}); without scope=fleet this instance's list answers\n"),
                    )
                }
            }
        } else {
            let mut own = self.fleet.local_top(now);
            own.extend(rls_rows);
            crate::ops::fleet::merge_top([own])
        };
        let dynamic = self.shared.deny.load();
        // What the deny list refuses of a row now: its key, else its address.
        let denied = |key: &str, ip: std::net::IpAddr| {
            let mut digest = None;
            let stored = crate::deny::stored_key(key, &mut digest);
            if rt.deny.table.stored_key(stored) || dynamic.stored_key(stored) {
                Some("key".to_string())
            } else if rt.deny.table.ip(ip) || dynamic.ip(ip) {
                Some("ip".to_string())
            } else {
                None
            }
        };
        // Already in order: by refusals, then route and key, so that the order
        // never depends on timing.
        let rows: Vec<TopRow> = merged
            .into_iter()
            .filter(|m| route.as_ref().is_none_or(|only| *only == m.row.route))
            .take(n.unwrap_or(TOP_DEFAULT))
            .map(|m| {
                let o = m.row;
                TopRow {
                    denied: denied(&o.key, o.ip),
                    route: o.route,
                    key: o.key,
                    ip: crate::identity::canonical(o.ip).to_string(),
                    refused: o.refused,
                    error: o.error,
                    allowed: o.allowed,
                    last_seen: rfc3339(o.last_seen_ms),
                    last_seen_ms: o.last_seen_ms,
                    instances: fleet.then_some(m.instances),
                }
            })
            .collect();
        json(StatusCode::OK, &rows)
    }

    /// A page of the list (`?limit=N&after=CURSOR`): a JSON list of entries as the
    /// SPEC has it, the total in `X-Total-Count`, the next page in `Link`
    /// (RFC 8288, as GitHub's API pages), absent on the last page.
    fn deny_list(&self, query: Option<&str>) -> Response<Body> {
        let (mut limit, mut after) = (DENY_PAGE, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            match name {
                "limit" => match value.parse::<usize>() {
                    Ok(n) if (1..=DENY_PAGE).contains(&n) => limit = n,
                    _ => {
                        return bad_request(&format!(
                            "limit {value:?} is not a number from 1 to {DENY_PAGE}"
                        ))
                    }
                },
                "after" => match Cursor::decode(value) {
                    Some(c) => after = Some(c),
                    None => {
                        return bad_request(&format!(
                            "after {value:?} is not a cursor from this API's Link header"
                        ))
                    }
                },
                _ => {}
            }
        }
        let (page, next, total) = self.control.page(after.as_ref(), limit);
        let list: Vec<EntryJson> = page.iter().map(Entry::to_json).collect();
        let mut r = json(StatusCode::OK, &list);
        let h = r.headers_mut();
        h.insert("x-total-count", HeaderValue::from(total));
        if let Some(next) = next {
            let link = format!(
                "</admin/deny?limit={limit}&after={}>; rel=\"next\"",
                next.encode()
            );
            if let Ok(v) = HeaderValue::from_str(&link) {
                h.insert("link", v);
            }
        }
        r
    }

    async fn deny_add(&self, r: DenyRequest) -> Response<Body> {
        let target = match r.target() {
            Ok(t) => t,
            Err(msg) => return bad_request(&msg),
        };
        // The request path answers 400 to such a key before any deny list sees it.
        if r.key
            .as_deref()
            .is_some_and(|k| !crate::identity::can_be_a_key(k))
        {
            return bad_request(
                "key holds a control, format, private-use or unassigned character, or white space around it: no request has such a key, so it could never match",
            );
        }
        let ttl = match r.ttl.as_deref().map(|t| (t, parse_duration(t.trim()))) {
            None => None,
            Some((_, Some(d))) if d.as_millis() > 0 => Some(d),
            Some((t, _)) => {
                return bad_request(&format!(
                    "ttl {t:?} is not a duration of at least 1ms like 30s, 10m, 1h or 1d"
                ))
            }
        };
        if r.reason.as_ref().is_some_and(|s| s.len() > MAX_REASON) {
            return bad_request(&format!("reason longer than {MAX_REASON} bytes"));
        }
        // `1.2.3.4/0` for `1.2.3.4` is an easy slip that would deny everyone.
        if target.is_wide() && r.force != Some(true) {
            return bad_request(&format!(
                "ip {} is wider than /8 (IPv4) or /32 (IPv6) and would deny a large part of the internet; send \"force\": true (sluice deny --force) if that is meant",
                target.value()
            ));
        }
        let entry = Entry {
            target,
            meta: Meta {
                expires_at_ms: ttl.map(|d| now_ms().saturating_add(d.as_millis() as u64)),
                reason: r.reason.filter(|s| !s.is_empty()).map(Into::into),
                source: Source::Api,
                route: None,
            },
        };
        match self.control.apply(Command::DenyAdd(entry)).await {
            Ok(Reply::Added(e)) => json(StatusCode::CREATED, &e.to_json()),
            Ok(other) => internal(other),
            Err(e) => refused(e),
        }
    }

    async fn deny_remove(&self, r: DenyRequest) -> Response<Body> {
        if r.ttl.is_some() || r.reason.is_some() || r.force.is_some() {
            return bad_request("DELETE takes only \"ip\" or \"key\"");
        }
        let target = match r.target() {
            Ok(t) => t,
            Err(msg) => return bad_request(&msg),
        };
        match self.control.apply(Command::DenyRemove(target)).await {
            Ok(Reply::Removed(_)) => {
                let mut r = Response::new(body::full(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                r
            }
            Ok(other) => internal(other),
            Err(e) => refused(e),
        }
    }

    fn authorized<B>(&self, req: &Request<B>) -> bool {
        // From the running configuration, so a rotated token takes effect on reload.
        let rt = self.shared.runtime.load();
        let Some(token) = &rt.admin_token else {
            return true;
        };
        let Some(given) = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme is case-insensitive (RFC 9110 §11.1): `bearer x` is fine.
            .and_then(|v| v.split_once(' '))
            .and_then(|(scheme, rest)| scheme.eq_ignore_ascii_case("bearer").then_some(rest))
        else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), token.as_bytes())
    }
}

/// What `on_error: local` does while Redis is unreachable, dividing limits by `n`.
fn degraded_text(n: u64) -> String {
    match n {
        1 => "Redis unreachable; on_error local enforces every limit in this instance alone (no other live instance was seen)".to_string(),
        n => format!("Redis unreachable; on_error local enforces each limit divided by {n} (the live instances last seen), rounded up, in this instance"),
    }
}

/// Rows of `/admin/top` by default, and the most a client may ask for.
pub const TOP_DEFAULT: usize = 20;
pub const TOP_MAX: usize = 1000;

/// A row of `GET /admin/top`: a key of a route, its counts over the last 60 to 120
/// seconds (`telemetry::top`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopRow {
    pub route: String,
    /// The key as the limiter stores it (an address key: the address).
    pub key: String,
    /// The client address of its last refusal.
    pub ip: String,
    /// Refusals by a limit: at least the true number, at most `error` above it.
    pub refused: u64,
    pub error: u64,
    /// Requests of the key allowed since it was first counted as refused.
    pub allowed: u64,
    /// Its last request counted, refused or allowed (RFC 3339, UTC).
    pub last_seen: String,
    pub last_seen_ms: u64,
    /// What the deny list refuses of it now: `key` (its key), `ip` (its address);
    /// absent when neither.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub denied: Option<String>,
    /// With `scope=fleet`: how many live instances' lists held the key (its counts
    /// are their sums).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub instances: Option<u32>,
}

/// The body of `POST` and `DELETE /admin/deny`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyRequest {
    #[serde(default)]
    ip: Option<String>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    ttl: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    /// Needed for a block wider than /8 (IPv4) or /32 (IPv6).
    #[serde(default)]
    force: Option<bool>,
}

impl DenyRequest {
    fn target(&self) -> Result<Target, String> {
        match (&self.ip, &self.key) {
            (Some(ip), None) => Target::ip(ip).ok_or_else(|| {
                format!("ip {ip:?} is not an address or CIDR block like 203.0.113.7 or 10.1.0.0/16")
            }),
            (None, Some(k)) if k.is_empty() => Err("key is empty".into()),
            (None, Some(k)) => Ok(Target::key(k)),
            _ => Err("give exactly one of \"ip\" and \"key\"".into()),
        }
    }
}

/// `/admin/config`: the effective configuration and what became of the last reload.
fn config_view(s: &Status) -> serde_json::Value {
    serde_json::json!({
        "path": s.path.display().to_string(),
        "hash": s.hash,
        "loaded_at": rfc3339(s.loaded_at_ms),
        "last_reload": reload_view(s),
        "config": s.config,
    })
}

/// The last reload (`null` before the first): when, why, and its hash or error.
fn reload_view(s: &Status) -> serde_json::Value {
    let last = s.last_reload.as_ref().map(|r| {
        let (result, hash, error) = match &r.result {
            Ok(h) => ("success", Some(h.as_str()), None),
            Err(e) => ("failure", None, Some(e.as_str())),
        };
        serde_json::json!({
            "at": rfc3339(r.at_ms),
            "trigger": r.trigger.as_str(),
            "result": result,
            "hash": hash,
            "error": error,
        })
    });
    last.unwrap_or(serde_json::Value::Null)
}

/// What the upstream answered over the recent history (`stats::KEEP`): the counts
/// now less those of the oldest sample kept (a fresh process: since it started).
/// `{"2xx": n, "3xx": n, "4xx": n, "5xx": n, "failed": n}`.
fn upstream_recent(samples: &[Sample], now: &Totals) -> serde_json::Value {
    let from = Decision::ALL.len();
    let oldest = samples.first().map_or([0; COLUMNS], |(_, t)| *t);
    UPSTREAM_COLUMNS
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let n = now[from + i].saturating_sub(oldest[from + i]);
            (name.trim_start_matches("upstream_").to_string(), n.into())
        })
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// `{"allowed": 3, "limited": 2, ...}`: the counters of `decisions`.
fn totals_json(totals: &[u64], decisions: impl IntoIterator<Item = Decision>) -> serde_json::Value {
    decisions
        .into_iter()
        .map(|d| (d.as_str().to_string(), totals[d.index()].into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// `{"at_ms": [t0, t1, ...], "allowed": [n0, n1, ...], ...}`: one column per decision,
/// the counters as they were at each sample time.
/// A route's `sluice_limit_refusals_total`, by limit name (tiers that share a name
/// share its count), in the order of the default tier's limits then the others'.
fn refused_by_limit(r: &crate::pipeline::Route) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    if let Some(limits) = &r.limits {
        let tiers = std::iter::once(&limits.default).chain(limits.overrides.values().map(|t| &**t));
        for tier in tiers {
            for (def, counter) in tier.plan.limits.iter().zip(&tier.refused_by) {
                m.entry(def.name.clone())
                    .or_insert_with(|| counter.get().into());
            }
        }
    }
    m.into()
}

/// `upstream`: with the upstream's columns too (`stats::UPSTREAM_COLUMNS`).
fn history_json(
    samples: &[Sample],
    decisions: impl IntoIterator<Item = Decision>,
    upstream: bool,
) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    let at: Vec<u64> = samples.iter().map(|(at, _)| *at).collect();
    m.insert("at_ms".into(), at.into());
    for d in decisions {
        let col: Vec<u64> = samples.iter().map(|(_, t)| t[d.index()]).collect();
        m.insert(d.as_str().into(), col.into());
    }
    if upstream {
        for (i, name) in UPSTREAM_COLUMNS.iter().enumerate() {
            let at = Decision::ALL.len() + i;
            let col: Vec<u64> = samples.iter().map(|(_, t)| t[at]).collect();
            m.insert((*name).into(), col.into());
        }
    }
    m.into()
}

/// A dashboard file: never cached (a new binary serves a new page), never framed.
fn asset(body: &'static str, content_type: &'static str) -> Response<Body> {
    let mut r = Response::new(body::full(Bytes::from_static(body.as_bytes())));
    let h = r.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    h.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    h.insert(REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    h.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r
}

/// Reads a JSON body of at most `MAX_BODY` bytes, whole `within` its head, or the
/// 400 (408) to answer.
async fn read<T: serde::de::DeserializeOwned>(
    req: Request<ClientBody>,
    within: std::time::Duration,
) -> Result<T, Response<Body>> {
    let collect = Limited::new(req.into_body(), MAX_BODY).collect();
    let Ok(read) = tokio::time::timeout(within, collect).await else {
        // Held in flight, a half-sent body would keep the connection from ever
        // being idle; what it still sends is drained, then it closes.
        return Err(body::close(body::text(
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time\n",
        )));
    };
    let body = match read {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(bad_request(&format!("body larger than {MAX_BODY} bytes")))
        }
        Err(e) => return Err(bad_request(&format!("cannot read the body: {e}"))),
    };
    // serde reads a struct from a JSON array too (`["10.0.0.1"]` as `{"ip": …}`);
    // every body of this API is an object.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(bad_request("malformed JSON body: expected a JSON object"));
    }
    serde_json::from_slice(&body).map_err(|e| bad_request(&format!("malformed JSON body: {e}")))
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response<Body> {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = Response::new(body::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

// === browsers: cross-site requests and DNS rebinding ===

/// The `Host` the client asked for (the URI's authority for HTTP/2).
fn request_host<B>(req: &Request<B>) -> Option<&str> {
    match req.headers().get(HOST) {
        Some(h) => h.to_str().ok(),
        None => req.uri().authority().map(|a| a.as_str()),
    }
}

/// `127.0.0.1`, `[::1]:9091`, `localhost`, `x.localhost:9091`: an IP literal (which
/// no DNS answer can rebind) or a name that always means this machine.
fn local_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        Some(rest) => {
            let Some((v6, after)) = rest.split_once(']') else {
                return false;
            };
            return v6.parse::<std::net::Ipv6Addr>().is_ok() && port_ok(after);
        }
        None => match host.rsplit_once(':') {
            Some((name, port)) if port.parse::<u16>().is_ok() => name,
            Some(_) => return false,
            None => host,
        },
    };
    let lower = name.to_ascii_lowercase();
    name.parse::<std::net::Ipv4Addr>().is_ok()
        || lower == "localhost"
        || lower
            .strip_suffix(".localhost")
            .is_some_and(|sub| !sub.is_empty() && !sub.starts_with('.'))
}

/// Nothing, or `:` and a port number.
fn port_ok(s: &str) -> bool {
    s.is_empty()
        || s.strip_prefix(':')
            .is_some_and(|p| !p.is_empty() && p.parse::<u16>().is_ok())
}

/// A browser says so (`Sec-Fetch-Site: cross-site`), or sent an `Origin` that is not
/// this listener as the request names it (`Host`). A browser's `Sec-Fetch-Site:
/// same-origin` (which no page can forge) settles it the other way first: behind a
/// reverse proxy that rewrites `Host` (nginx's default `$proxy_host`), the page's
/// own `Origin` does not match the `Host` sluice sees.
fn cross_site<B>(req: &Request<B>) -> bool {
    let h = req.headers();
    let site = h.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    match site.map(str::trim) {
        Some(s) if s.eq_ignore_ascii_case("cross-site") => return true,
        Some(s) if s.eq_ignore_ascii_case("same-origin") => return false,
        _ => {}
    }
    let Some(origin) = h.get(ORIGIN) else {
        return false;
    };
    let (Ok(origin), Some(host)) = (origin.to_str(), request_host(req)) else {
        return true;
    };
    !same_origin(origin.trim(), host.trim())
}

/// `http://HOST` or `https://HOST` against the `Host` header, case-insensitively,
/// a scheme's default port written or not.
fn same_origin(origin: &str, host: &str) -> bool {
    let Some((scheme, authority)) = origin.split_once("://") else {
        return false;
    };
    let default = match scheme.to_ascii_lowercase().as_str() {
        "http" => ":80",
        "https" => ":443",
        _ => return false,
    };
    let norm = |a: &str| {
        let a = a.to_ascii_lowercase();
        match a.strip_suffix(default) {
            Some(bare) if !bare.is_empty() => bare.to_string(),
            _ => a,
        }
    };
    !authority.is_empty() && norm(authority) == norm(host)
}

/// `Content-Type: application/json`, any case, parameters (`; charset=utf-8`) allowed.
/// A browser cannot send it to another origin without a preflight, which fails.
fn is_json<B>(req: &Request<B>) -> bool {
    req.headers()
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

fn host_refused() -> Response<Body> {
    body::text(
        StatusCode::FORBIDDEN,
        "Host refused: without admin.token the admin API answers only to an IP address or localhost\n",
    )
}

fn unsupported_media_type() -> Response<Body> {
    body::text(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "Content-Type must be application/json\n",
    )
}

fn bad_request(msg: &str) -> Response<Body> {
    body::text(StatusCode::BAD_REQUEST, format!("{}\n", one_line(msg)))
}

fn not_allowed(allow: &'static str) -> Response<Body> {
    let mut r = body::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    r
}

fn refused(e: ControlError) -> Response<Body> {
    let status = match &e {
        ControlError::Config(_) => StatusCode::UNPROCESSABLE_ENTITY,
        ControlError::NotFound => StatusCode::NOT_FOUND,
        ControlError::Static(_) => StatusCode::CONFLICT,
        ControlError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
        ControlError::Full(_) => StatusCode::INSUFFICIENT_STORAGE,
    };
    body::text(status, format!("{}\n", one_line(&e.to_string())))
}

fn internal(reply: Reply) -> Response<Body> {
    tracing::error!(?reply, "admin API: unexpected reply");
    body::text(StatusCode::INTERNAL_SERVER_ERROR, "unexpected reply\n")
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// Compare without stopping at the first difference, so timing tells nothing about
/// the token (its length included: both sides are hashed first).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (
        sha1_smol::Sha1::from(a).digest().bytes(),
        sha1_smol::Sha1::from(b).digest().bytes(),
    );
    a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The page runs only its own script file: no inline script or event handler
    /// (the CSP would block them, and the page would silently break), nothing loaded
    /// from elsewhere, and no API that turns a string into markup or code.
    #[test]
    fn the_dashboard_has_no_inline_code_no_external_assets_and_no_markup_sinks() {
        let page = PAGE.to_ascii_lowercase();
        for (i, _) in page.match_indices("<script") {
            let tag = &page[i..i + page[i..].find('>').unwrap_or(0)];
            assert!(tag.contains(" src=\"/"), "inline script: {tag}");
        }
        assert!(!page.contains("<style"), "inline style");
        assert!(!page.contains(" style="), "style attribute");
        for attr in [
            " onclick",
            " onload",
            " onsubmit",
            " onerror",
            " oninput",
            "javascript:",
        ] {
            assert!(!page.contains(attr), "{attr} in the page");
        }
        for file in [PAGE, SCRIPT, STYLE] {
            let without_svg_ns = file.replace("http://www.w3.org/2000/svg", "");
            for scheme in ["http://", "https://", "//cdn", "@import"] {
                assert!(!without_svg_ns.contains(scheme), "{scheme} in an asset");
            }
        }
        for sink in [
            "innerHTML",
            "outerHTML",
            "insertAdjacentHTML",
            "document.write",
            "eval(",
            "new Function",
            "localStorage",
        ] {
            assert!(!SCRIPT.contains(sink), "{sink} in dashboard.js");
        }
    }

    #[test]
    fn only_ip_literals_and_localhost_are_local_hosts() {
        for h in [
            "127.0.0.1",
            "127.0.0.1:9091",
            "10.0.0.5:80",
            "[::1]",
            "[::1]:9091",
            "[2001:db8::1]:1",
            "localhost",
            "LOCALHOST:9091",
            "dash.localhost",
            "a.b.localhost:8080",
        ] {
            assert!(local_host(h), "{h}");
        }
        for h in [
            "",
            "evil.example",
            "evil.example:9091",
            "localhost.evil.example",
            "evillocalhost",
            ".localhost",
            "127.0.0.1.nip.io",
            "127.0.0.1:",
            "127.0.0.1:99999",
            "127.0.0.1:x",
            "::1",
            "[::1",
            "[::1]x",
            "[evil.example]",
            "2130706433",
        ] {
            assert!(!local_host(h), "{h}");
        }
    }

    #[test]
    fn an_origin_is_the_same_when_scheme_and_authority_name_the_host() {
        for (o, h) in [
            ("http://127.0.0.1:9091", "127.0.0.1:9091"),
            ("HTTP://LocalHost:9091", "localhost:9091"),
            ("http://sluice", "sluice:80"),
            ("http://sluice:80", "sluice"),
            ("https://admin.example", "admin.example:443"),
        ] {
            assert!(same_origin(o, h), "{o} {h}");
        }
        for (o, h) in [
            ("null", "127.0.0.1:9091"),
            ("http://127.0.0.1:9092", "127.0.0.1:9091"),
            ("http://127.0.0.1", "127.0.0.1:9091"),
            ("https://sluice", "sluice:80"),
            ("ftp://127.0.0.1:9091", "127.0.0.1:9091"),
            ("http://", ""),
            ("http://evil.example", "127.0.0.1"),
        ] {
            assert!(!same_origin(o, h), "{o} {h}");
        }
    }

    #[test]
    fn history_json_has_one_column_per_decision_as_long_as_the_times() {
        let mut a = [0; COLUMNS];
        a[Decision::Limited.index()] = 2;
        let mut b = a;
        b[Decision::Allowed.index()] = 3;
        let v = history_json(&[(1000, a), (3000, b)], UNMATCHED_DECISIONS, false);
        assert_eq!(
            v,
            serde_json::json!({"at_ms": [1000, 3000], "denied": [0, 0], "unmatched": [0, 0], "bad_request": [0, 0]})
        );
        let v = totals_json(&b, [Decision::Allowed, Decision::Limited]);
        assert_eq!(v, serde_json::json!({"allowed": 3, "limited": 2}));
    }

    /// The upstream's answers shown are those of the recent history: 5xx answers
    /// older than its oldest sample are gone from them, though the totals keep them.
    #[test]
    fn recent_upstream_answers_leave_out_those_before_the_oldest_sample() {
        let at = |i: usize| Decision::ALL.len() + i;
        let mut old = [0; COLUMNS];
        old[at(3)] = 30; // 30 answers 5xx, long ago
        old[at(4)] = 4; // 4 not answered
        let mut now = old;
        now[at(0)] = 7; // 7 answers 2xx since
        let v = upstream_recent(&[(1000, old), (3000, old)], &now);
        assert_eq!(
            v,
            serde_json::json!({"2xx": 7, "3xx": 0, "4xx": 0, "5xx": 0, "failed": 0})
        );
        // A fresh process: since it started.
        let v = upstream_recent(&[], &now);
        assert_eq!(v["5xx"], 30);
    }
}
