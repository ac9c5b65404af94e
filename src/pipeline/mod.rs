//! The request path, top to bottom: client IP → deny → route → key → limits →
//! forward or respond → end. `handle` is the whole product in one function: each
//! phase (`pass`) returns a `Refusal` to answer instead, and the end of the request
//! (tally, concurrency permit) travels with the response body. The compiled
//! configuration (`Runtime`) is read through one `Arc` that a reload swaps whole.

pub mod admit;
pub mod body_key;
pub mod metered;
pub mod path;
pub mod refusal;
pub mod route;

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Instant;

use arc_swap::ArcSwap;
use bytes::Bytes;
use http::header::{HeaderMap, HeaderValue};
use http::{Response, StatusCode, Version};

use self::admit::BadRequest;
use self::refusal::{Limited, RateHeaders, Refusal};
use self::route::Matcher;
use crate::deny::{BanRequest, DenyView, StaticDeny, Target};
use crate::http::body;
use crate::http::body::Body;

use crate::http::request::{body_in_the_way, declared_length, ClientBody};
use crate::http::site::{Lent, Relay, Site};

use crate::identity::{ClientKey, KeyPart, KeySpec, MissingKey, NoKey, Normalize, TrustedProxies};
use crate::limit::{Charge, Checked, MemoryStore, OnError, Permit, Plan, Share, Store, Verdict};
use crate::telemetry::access_log::{self, AccessLog};
use crate::telemetry::metrics::{Decision, Metrics, RouteMetrics};
use crate::telemetry::refusal_log::{Line, RefusalLog, What};
use crate::telemetry::top::Top;
use crate::upstream::{BodyFailure, ClientFault, Origin, ProxyError, TunnelEnd, Upstream};

// === the compiled configuration ===

pub struct Runtime {
    pub routes: Vec<Route>,
    /// By name; a reload takes over the unchanged ones (with their pools).
    pub upstreams: HashMap<String, Arc<Upstream>>,
    pub trusted: TrustedProxies,
    /// `deny:` of the configuration; dynamic entries are in `Shared::deny`.
    pub deny: StaticDeny,
    pub rate_headers: RateHeaders,
    pub max_request_body: u64,
    /// `server.max_key_body`: the most of a body read for a key in it (`body_key`).
    pub max_key_body: u64,
    /// `server.request_body_timeout`: the longest wait for more of a body read for a
    /// key in it (`body_key`).
    pub request_body_timeout: std::time::Duration,
    pub on_error: OnError,
    /// `access_log:`, when on.
    pub access: Option<AccessLog>,
    /// Counters for requests that match no route.
    pub unmatched: RouteMetrics,
    /// SHA-1 of the configuration file this was compiled from.
    pub hash: String,
    /// `Authorization: Bearer <token>` required on `/admin/*` when set.
    pub admin_token: Option<String>,
    /// `jwt.providers` by name; a reload takes over the unchanged ones (with their
    /// keys and verified tokens).
    pub jwt: HashMap<String, Arc<crate::jwt::Provider>>,
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
    /// The other keys the route's limits count (`key` on a limit): key number i
    /// (`ShareDef::key`) is `limit_keys[i - 1]`; number 0 is the route's own.
    pub limit_keys: Vec<LimitKey>,
    pub limits: Option<Limits>,
    /// A limit of some tier reads its `estimate` from the request's JSON body.
    pub estimate_body: bool,
    pub shadow: bool,
    pub ban: Option<BanRule>,
    pub metrics: RouteMetrics,
    /// The route's heaviest refused clients (`/admin/top`), kept across reloads by
    /// the route's name.
    pub top: Arc<Top>,
    /// `jwt`: the token every request must bring, verified before the key is read.
    pub jwt: Option<RouteJwt>,
}

/// A route's `jwt`.
pub struct RouteJwt {
    pub provider: Arc<crate::jwt::Provider>,
    pub required: bool,
    pub from: TokenFrom,
    /// `sluice_jwt_failures_total`'s children, by `jwt::Failure::index`.
    pub failures: Vec<prometheus::IntCounter>,
}

/// Where a route's token is.
pub enum TokenFrom {
    /// `Authorization: Bearer <token>`.
    Authorization,
    /// This header: its value, or what follows `Bearer `.
    Header(http::HeaderName),
    Cookie(String),
}

impl Route {
    /// Whether the key counted in namespace `ns` is the client's address: a key
    /// `ip`, or one that fell back to it (`missing_key: ip`).
    fn counts_address(&self, ns: &str) -> bool {
        if ns == self.ns {
            return self.key.is_ip();
        }
        ns == self.fallback_ns
            || self
                .limit_keys
                .iter()
                .any(|k| ns == k.fallback_ns || (ns == k.ns && k.spec.is_ip()))
    }
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
    /// Tiers by verified JWT claims, in file order: the first whose claims all
    /// hold (each claim's value as a key reads it) is taken, after `overrides`.
    pub by_claims: Vec<(ClaimsWanted, Arc<Tier>)>,
}

/// The claims a tier by claims wants, each with the value it must have.
pub type ClaimsWanted = Vec<(crate::identity::Claim, String)>;

pub struct Tier {
    pub plan: Plan,
    /// Precomputed `RateLimit-Policy` value.
    pub policy: Option<HeaderValue>,
    /// With limits that count other keys than the route's: the plan split by key,
    /// in the order the keys first appear. Empty when every limit counts the route's
    /// key (the plan is decided whole).
    pub shares: Vec<ShareDef>,
    /// The limits charged from the upstream's response (`count` by status, `cost`
    /// from a header), by their index in the plan; empty on most tiers.
    pub later: Vec<LaterLimit>,
    /// `sluice_limit_refusals_total`'s child of each limit of the plan, by index.
    pub refused_by: Vec<prometheus::IntCounter>,
}

/// A limit of a tier charged from the upstream's response.
pub struct LaterLimit {
    /// Its index in the tier's plan.
    pub at: usize,
    /// For a cost read from the response (a header, or the body):
    /// `sluice_response_costs_total`'s children.
    pub costs: Option<metered::CostCounters>,
    /// Its cost is read from the body (`cost: {response_json}`): the response's
    /// body is read on its way (`metered`).
    pub reads_body: bool,
}

/// The limits of a tier that count one key.
pub struct ShareDef {
    /// The key's number (`Route::limit_keys`).
    pub key: usize,
    /// Those limits, in plan order, with the route's mode.
    pub plan: Plan,
    /// Where each stands in the tier's plan.
    pub at: Vec<usize>,
}

/// A key a limit counts that is not the route's, with the namespaces of its state
/// (named after the key, so a reload that reorders limits keeps it).
pub struct LimitKey {
    pub spec: KeySpec,
    pub ns: String,
    pub fallback_ns: String,
}

impl Limits {
    /// The tier of a request: its key's, else the first whose claims its verified
    /// token has, else the default.
    fn tier(&self, key: &str, claims: Option<&serde_json::Value>) -> &Tier {
        if let Some(t) = self.overrides.get(key) {
            return t;
        }
        if let Some(claims) = claims {
            for (want, t) in &self.by_claims {
                if want
                    .iter()
                    .all(|(c, v)| c.value(claims).is_some_and(|got| got == v.as_str()))
                {
                    return t;
                }
            }
        }
        &self.default
    }
}

/// What every request shares and a reload does not replace.
pub struct Shared {
    /// Itself, for what outlives a request's borrow (a metered body settles when
    /// it ends).
    pub me: std::sync::Weak<Shared>,
    pub runtime: ArcSwap<Runtime>,
    /// Dynamic deny entries (admin API, bans, other instances): a view of the control
    /// object's table, swapped on every change (which copies only the changes since
    /// its base was built), and kept across reloads.
    pub deny: ArcSwap<DenyView>,
    /// Refusals counted towards bans, per (route, key).
    pub strikes: MemoryStore,
    /// Where the request path asks for a ban; the control object applies it.
    pub bans: tokio::sync::mpsc::Sender<BanRequest>,
    pub store: Store,
    pub metrics: Arc<Metrics>,
    /// One line per refused request, within a budget.
    pub refusals: RefusalLog,
    /// `http` or `https`, how clients reach the listener.
    pub proto: &'static str,
}

// === the request path ===

/// The client connection a request came on: its address, and that address as the
/// `X-Forwarded-For` entry (formatted once per connection, not per request).
pub struct Peer {
    pub addr: SocketAddr,
    pub forwarded_for: HeaderValue,
}

impl Peer {
    pub fn new(addr: SocketAddr) -> Peer {
        let canonical = crate::identity::canonical(addr.ip()).to_string();
        Peer {
            addr,
            forwarded_for: HeaderValue::from_str(&canonical)
                .unwrap_or_else(|_| HeaderValue::from_static("unknown")),
        }
    }
}

impl Site for Shared {
    type Peer = Peer;
    type Guard = Tally;

    fn serve<'a>(
        &'a self,
        parts: &'a mut http::request::Parts,
        body: ClientBody,
        peer: &'a Peer,
        conn: Lent<'a>,
        guard: &'a mut Option<Tally>,
    ) -> impl Future<Output = http::Response<Body>> + Send + 'a {
        process(self, parts, body, peer, Some((conn, guard)))
    }

    /// A head the HTTP/1.1 server refused before it was a request (400, 431, 501)
    /// gets an access line too, as nginx logs its 400s: the method and path of its
    /// request line as far as they can be read (`-` where not), never its query;
    /// route `unmatched`, decision `bad_request`.
    fn refused_head(&self, status: http::StatusCode, peer: &Peer, head: &[u8]) {
        let rt = self.runtime.load();
        let Some(access) = &rt.access else {
            return;
        };
        let now = crate::deny::now_ms();
        let Some(dropped) = access.keep(true, now) else {
            return;
        };
        let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
        let mut words = line
            .split(|&b| b == b' ')
            .filter(|w| !w.is_empty())
            .map(|w| w.strip_suffix(b"\r").unwrap_or(w));
        let method = words
            .next()
            .and_then(|m| http::Method::from_bytes(m).ok())
            .unwrap_or_else(|| http::Method::from_bytes(b"-").unwrap_or_default());
        let target = words.next().unwrap_or(b"-");
        let path = target.split(|&b| b == b'?').next().unwrap_or_default();
        let version = match words.next() {
            Some(b"HTTP/1.0") => Version::HTTP_10,
            _ => Version::HTTP_11,
        };
        let entry = access.entry(
            &method,
            &String::from_utf8_lossy(path),
            version,
            None,
            peer.addr.ip(),
            status.as_u16(),
            dropped,
        );
        access.write(
            &entry,
            &access_log::End {
                at_ms: now,
                route: "unmatched",
                decision: "bad_request",
                limit: None,
                upstream: None,
                duration: std::time::Duration::ZERO,
                bytes: 0,
            },
        );
    }
}

/// The request path's entry for hyper's HTTP/2 server (sluice's HTTP/1 server
/// comes through `Site::serve`): the head, worked on in place, and the body in;
/// the answer out, with the request's tally boxed with its body.
pub(crate) async fn handle(
    shared: &Shared,
    parts: &mut http::request::Parts,
    body: ClientBody,
    peer: &Peer,
) -> Response<Body> {
    process(shared, parts, body, peer, None).await
}

/// The request path, whichever server carried the request. `plain`: what
/// sluice's HTTP/1 server lends the request to save work (none of it is needed
/// for a right answer), and where the request's tally goes for the server to hold
/// beside the response body (without it, the tally is boxed with the body).
async fn process(
    shared: &Shared,
    parts: &mut http::request::Parts,
    body: ClientBody,
    peer: &Peer,
    plain: Option<(Lent<'_>, &mut Option<Tally>)>,
) -> Response<Body> {
    let (plain, guard) = match plain {
        Some((lent, guard)) => (Some(lent), Some(guard)),
        None => (None, None),
    };
    // One snapshot for the whole request: a reload never changes it half-way.
    let rt = shared.runtime.load_full();
    // A malformed or ambiguous head is refused before anything reads it (400, on
    // route `unmatched`: nothing can be routed on it); the rest is normalised.
    let head = crate::pipeline::admit::admit(parts);
    let ip = rt.trusted.client_ip(peer.addr.ip(), &parts.headers);
    let route = head
        .is_ok()
        .then(|| rt.routes.iter().position(|r| r.matcher.matches(parts)))
        .flatten();
    // Counted when the response body ends, or when the client goes away first (while
    // delayed, while the upstream works, or mid-body), with the decision made for it.
    let mut tally = Tally::new(rt.clone(), route);
    tally.client_h1 = parts.version < Version::HTTP_2;
    let unread_body = body_in_the_way(parts);
    // What the client spoke, for the access log: forwarding rewrites `parts.version`
    // to the upstream's.
    let version = parts.version;

    let ctx = Ctx {
        shared,
        rt: &rt,
        ip,
        peer,
        unread_body,
    };
    // What the combined access log writes of the request's fields: read before they
    // are forwarded.
    let client_fields = rt
        .access
        .as_ref()
        .and_then(|a| a.client_fields(&parts.headers));
    // A gRPC call gets sluice's own answers in gRPC. gRPC is HTTP/2 only: an
    // `application/grpc` body over HTTP/1.1 is an upload like any other (read
    // ahead, answered in HTTP). Known before its fields go upstream.
    let grpc = parts.version == Version::HTTP_2 && crate::upstream::is_grpc(&parts.headers);
    let mut refused = false;
    let resp = match pass(&ctx, head, route, parts, body, &mut tally, plain).await {
        Ok(resp) => resp,
        Err(refusal) => {
            if let Some(d) = refusal.decision() {
                tally.decision = d;
                refused = true;
            }
            refusal.respond(unread_body, grpc)
        }
    };
    if let Some(access) = &rt.access {
        if let Some(dropped) = access.keep(refused, crate::deny::now_ms()) {
            let (p, status) = (&*parts, resp.status().as_u16());
            let mut entry = access.entry(
                &p.method,
                p.uri.path(),
                version,
                client_fields,
                ip,
                status,
                dropped,
            );
            entry.upstream_status = tally.upstream_status;
            tally.access = Some(entry);
        }
    }
    if let Some(line) = tally.line.take() {
        line.write(parts.method.as_str(), parts.uri.path());
    }
    let resp = if parts.method == http::Method::HEAD {
        body::headless(resp)
    } else {
        resp
    };
    end_with(resp, tally, guard)
}

/// The end of the request (pingora's `logging` phase): the tally, and the permit in
/// it, go with the response body and are dropped when it ends or the client goes
/// away (into `guard`, for the server to hold beside the body, or else boxed with
/// it); for an upgraded connection (WebSocket), when its tunnel closes.
fn end_with(
    mut resp: Response<Body>,
    tally: Tally,
    guard: Option<&mut Option<Tally>>,
) -> Response<Body> {
    if let Some(TunnelEnd(mut end)) = resp.extensions_mut().remove::<TunnelEnd>() {
        tokio::spawn(async move {
            let _ = end.changed().await;
            drop(tally);
        });
        return resp;
    }
    match guard {
        Some(slot) => {
            *slot = Some(tally);
            resp
        }
        None => {
            let (parts, body) = resp.into_parts();
            Response::from_parts(parts, body::guarded(body, tally))
        }
    }
}

/// What every phase of one request may read.
struct Ctx<'a> {
    shared: &'a Shared,
    rt: &'a Runtime,
    ip: IpAddr,
    peer: &'a Peer,
    /// An HTTP/1 request with a body: answered before reading it, the connection closes.
    unread_body: bool,
}

/// The phases in order: request head (and no CONNECT) → deny by IP → route → key (and deny by key) →
/// size → limits → the route's action. Each returns a refusal to answer instead.
async fn pass<'a>(
    ctx: &Ctx<'a>,
    head: Result<(), BadRequest>,
    route: Option<usize>,
    parts: &mut http::request::Parts,
    body: ClientBody,
    tally: &mut Tally,
    plain: Option<Lent<'_>>,
) -> Result<Response<Body>, Refusal<'a>> {
    let rt = ctx.rt;
    head.map_err(Refusal::BadHead)?;
    if parts.method == http::Method::CONNECT {
        return Err(Refusal::Connect);
    }
    let line = &mut tally.line;
    deny_ip(ctx, route.map_or("unmatched", |i| &rt.routes[i].name), line)?;
    let route = &rt.routes[route.ok_or(Refusal::Unmatched)?];
    // A route with `jwt`: its token verified, its claims put where key parts read
    // them; no token, or a bad one, is 401 and charged nothing.
    if let Some(j) = &route.jwt {
        verify_token(j, parts).await?;
    }
    // A key read from the body (`form:`, `json:`): the body is read first, up to
    // `server.max_key_body`, and then forwarded unchanged.
    let h = &parts.headers;
    let wants_body = route.key.body_wanted(h)
        || route.limit_keys.iter().any(|k| k.spec.body_wanted(h))
        || (route.estimate_body && crate::identity::json_body(h));
    let (read, mut body) = (None::<Bytes>, body);
    let read = if wants_body {
        if declared_length(h).is_some_and(|n| n > rt.max_request_body) {
            return Err(Refusal::TooLarge(rt.max_request_body));
        }
        let timeout = rt.request_body_timeout;
        match body_key::read(body, rt.max_key_body, timeout).await {
            Ok(k) => {
                body = k.body;
                k.bytes
            }
            Err(fault) => {
                count_client_fault(ctx.shared, &fault);
                return Err(Refusal::Client(fault));
            }
        }
    } else {
        read
    };
    let bytes = read.as_deref();
    let route_key = (&route.key, route.ns.as_str(), route.fallback_ns.as_str());
    let key = client_key(ctx, route, route_key, parts, bytes, line)?;
    // The keys of limits that count another (none on most routes: no allocation).
    let mut others = Vec::new();
    for k in &route.limit_keys {
        let limit_key = (&k.spec, k.ns.as_str(), k.fallback_ns.as_str());
        others.push(client_key(ctx, route, limit_key, parts, bytes, line)?);
    }
    // (A request with no body has no length over the limit: HTTP/1's server makes
    // one of a `Content-Length` of 0 or none, not worth looking up again.)
    let no_body = matches!(body, ClientBody::Empty);
    if !no_body && declared_length(&parts.headers).is_some_and(|n| n > rt.max_request_body) {
        return Err(Refusal::TooLarge(rt.max_request_body));
    }
    let claims = parts
        .extensions
        .get::<crate::identity::VerifiedClaims>()
        .map(|c| c.0.as_ref());
    let (report, later) = limits(ctx, route, &key, &others, claims, bytes, tally).await?;
    drop((key, others));
    let (added, mut relay) = match plain {
        Some(Lent { fields, relay }) => (Some(fields), Some(relay)),
        None => (None, None),
    };
    // A cost read from a response header needs the upstream's fields parsed.
    if later
        .as_ref()
        .is_some_and(|l| l.tier.later.iter().any(|l| l.costs.is_some()))
    {
        if let Some(relay) = relay.as_mut() {
            relay.fields_in_map();
        }
    }
    let mut resp = match act(ctx, route, parts, body, relay, &mut tally.target).await {
        Ok(resp) => resp,
        Err(refusal) => {
            // sluice answers (the upstream failed): no estimate held stays charged.
            if let Some(later) = later.as_ref().filter(|l| !l.held.is_empty()) {
                metered::unanswered(ctx.shared, later);
            }
            return Err(refusal);
        }
    };
    if matches!(route.action, Action::Upstream(_)) {
        let status = resp.status().as_u16();
        route.metrics.upstream_answered(status);
        tally.upstream_status = Some(status);
    }
    if let Some(later) = later {
        charge_from_response(ctx.shared, &later, &resp);
        // A cost the body says: read on its way, charged when it ends.
        if later.tier.later.iter().any(|l| l.reads_body) {
            resp = metered::meter(ctx.shared, &later, resp);
        }
    }
    if let Some((tier, v)) = &report {
        let (h, policy) = (&rt.rate_headers, tier.policy.as_ref());
        match added {
            Some(out) if !h.any_in(resp.headers(), policy.is_some()) => {
                h.fields(out, &tier.plan, policy, v)
            }
            _ => h.apply(resp.headers_mut(), &tier.plan, policy, v),
        }
    }
    Ok(resp)
}

/// The route's token, verified by its provider: its claims go into the request's
/// extensions (the only place `jwt:` key parts read). No token is a 401 unless the
/// route says `required: false` (then its `jwt:` parts are missing); a token that
/// fails any check is a 401 whatever `required` says.
async fn verify_token<'a>(
    j: &RouteJwt,
    parts: &mut http::request::Parts,
) -> Result<(), Refusal<'a>> {
    // Whatever a request carries in, only a verified token's claims are read.
    parts.extensions.remove::<crate::identity::VerifiedClaims>();
    let fail = |f: crate::jwt::Failure| {
        if let Some(c) = j.failures.get(f.index()) {
            c.inc();
        }
        Refusal::Unauthorized(f)
    };
    let token = match bearer_token(&j.from, &parts.headers) {
        Ok(Some(t)) => t,
        Ok(None) if !j.required => return Ok(()),
        Ok(None) => return Err(fail(crate::jwt::Failure::Missing)),
        Err(()) => return Err(fail(crate::jwt::Failure::Malformed)),
    };
    let claims = j
        .provider
        .verify(&token, crate::jwt::unix_now())
        .await
        .map_err(fail)?;
    parts.extensions.insert(claims);
    Ok(())
}

/// The token where the route looks for it: `Ok(None)` when there is none, `Err`
/// when there are several (two `Authorization` fields) or it is not text.
fn bearer_token<'h>(
    from: &'h TokenFrom,
    headers: &'h HeaderMap,
) -> Result<Option<Cow<'h, str>>, ()> {
    let strip = |v: &'h str| -> Option<Cow<'h, str>> {
        let t = match v.trim().split_once(' ') {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case("bearer") => rest.trim(),
            _ => return None,
        };
        (!t.is_empty()).then_some(Cow::Borrowed(t))
    };
    let one = |name: &http::HeaderName| -> Result<Option<&'h str>, ()> {
        let mut all = headers.get_all(name).iter();
        match (all.next(), all.next()) {
            (None, _) => Ok(None),
            (Some(v), None) => v.to_str().map(Some).map_err(|_| ()),
            _ => Err(()),
        }
    };
    match from {
        TokenFrom::Authorization => match one(&http::header::AUTHORIZATION)? {
            None => Ok(None),
            Some(v) => strip(v).map(Some).ok_or(()),
        },
        TokenFrom::Header(h) => Ok(one(h)?.and_then(|v| {
            strip(v).or_else(|| Some(Cow::Borrowed(v.trim())).filter(|t| !t.is_empty()))
        })),
        TokenFrom::Cookie(name) => {
            let mut all = crate::identity::cookies(headers, name);
            match (all.next(), all.next()) {
                (None, _) => Ok(None),
                (Some(v), None) => Ok(Some(v)),
                _ => Err(()),
            }
        }
    }
}

/// Deny by IP, whatever the route (`route` names it in the log).
fn deny_ip<'a>(
    ctx: &Ctx<'a>,
    route: &str,
    line: &mut Option<Box<Line>>,
) -> Result<(), Refusal<'a>> {
    if ctx.rt.deny.table.ip(ctx.ip) || ctx.shared.deny.load().ip(ctx.ip) {
        let status = ctx.rt.deny.status;
        let what = What::Denied {
            status: status.as_u16(),
            deny: "ip",
        };
        *line = ctx.shared.refusals.line(route, ctx.ip, ctx.ip, what);
        return Err(Refusal::Denied(status));
    }
    Ok(())
}

/// A key the route's limits count (`spec`, with the namespaces of its state, as the
/// route's or a limit's): the request's value, and the namespace it is counted in;
/// denied keys refused.
fn client_key<'a, 'r>(
    ctx: &Ctx<'a>,
    route: &'r Route,
    (spec, ns, fallback_ns): (&'r KeySpec, &'r str, &'r str),
    parts: &'r http::request::Parts,
    body: Option<&'r [u8]>,
    line: &mut Option<Box<Line>>,
) -> Result<(&'r str, ClientKey<'r>), Refusal<'a>> {
    let (rt, shared) = (ctx.rt, ctx.shared);
    let status = rt.deny.status;
    let mut log = |key: &str| {
        let what = What::Denied {
            status: status.as_u16(),
            deny: "key",
        };
        *line = shared.refusals.line(&route.name, key, ctx.ip, what);
    };
    // Every value of every key part, before any fallback: a denied key sent twice
    // (which makes it missing) is still denied.
    if denied_key(
        rt,
        shared,
        spec.normalize,
        |d| spec.any_value_with_body(parts, ctx.ip, body, d),
        &mut log,
    ) {
        return Err(Refusal::Denied(status));
    }
    // A value with a character its kind of key may not hold is refused whatever
    // `missing_key` says: the upstream may trim or drop it into another key (a
    // denied one, or one with a budget of its own). A found key is one copy of each
    // part, so its own value tells; a missing one (absent, or sent twice) has every
    // copy looked at.
    let unprintable = |part: Option<&KeyPart>| {
        Refusal::UnprintableKey(
            part.map_or_else(|| "the key".into(), |p| p.describe()),
            part.is_some_and(KeyPart::reads_body),
        )
    };
    let (ns, key) = match spec.extract_with_body(parts, ctx.ip, body) {
        Ok(k) => (ns, k),
        Err(NoKey::Unprintable(part)) => return Err(unprintable(Some(part))),
        Err(NoKey::Missing(part)) => {
            if let Some(part) = spec.unprintable_with_body(parts, body) {
                return Err(unprintable(Some(part)));
            }
            match route.missing_key {
                MissingKey::Ip => {
                    let key = ClientKey::new(ctx.ip.to_string());
                    // The address it falls back to is the key `/admin/top` shows.
                    if denied_key(rt, shared, Normalize::None, |d| d(&key.value), &mut log) {
                        return Err(Refusal::Denied(status));
                    }
                    (fallback_ns, key)
                }
                MissingKey::Reject => return Err(Refusal::MissingKey(part.describe())),
            }
        }
    };
    // A composite key as a whole (bans deny the joined form).
    if !key.parts.is_empty() && denied_key(rt, shared, spec.normalize, |d| d(&key.value), &mut log)
    {
        return Err(Refusal::Denied(status));
    }
    Ok((ns, key))
}

/// Decides the route's limits over the request's keys (`keys[0]` the route's, then
/// one per `Route::limit_keys`); the decision goes on the tally, and an admitted
/// request's concurrency permit into it (released when the response ends). `body`:
/// the request's body when it was read (an `estimate` may be read from it). Returns
/// what the rate-limit headers of the answer report.
async fn limits<'a>(
    ctx: &Ctx<'a>,
    route: &'a Route,
    (ns, key): &(&str, ClientKey<'_>),
    others: &[(&str, ClientKey<'_>)],
    claims: Option<&serde_json::Value>,
    body: Option<&[u8]>,
    tally: &mut Tally,
) -> Result<(Option<(&'a Tier, Verdict)>, Option<Later<'a>>), Refusal<'a>> {
    let (rt, shared) = (ctx.rt, ctx.shared);
    let Some(limits) = &route.limits else {
        return Ok((None, None));
    };
    // Tiers are chosen by the route's key.
    let tier = limits.tier(&key.value, claims);
    let stored = key.stored();
    // Key number k: the route's (0), or `others[k - 1]`.
    let key_at = |k: usize| match k.checked_sub(1) {
        None => (*ns, key),
        Some(j) => (others[j].0, &others[j].1),
    };
    let others_stored: Vec<Cow<'_, str>> = others.iter().map(|(_, k)| k.stored()).collect();
    let stored_at = |k: usize| match k.checked_sub(1) {
        None => &*stored,
        Some(j) => &*others_stored[j],
    };
    // An estimate read from the request's body: the plan (and its shares) priced
    // with it.
    let priced = route
        .estimate_body
        .then(|| metered::priced(tier, body))
        .flatten();
    let plan = priced.as_ref().map_or(&tier.plan, |p| &p.plan);
    let shares: Vec<Share<'_>> = tier
        .shares
        .iter()
        .enumerate()
        .map(|(i, s)| Share {
            ns: key_at(s.key).0,
            key: stored_at(s.key),
            plan: priced.as_ref().map_or(&s.plan, |p| &p.shares[i]),
            at: &s.at,
        })
        .collect();
    let trial = tier.plan.on_trial();
    let store = &shared.store;
    // Store unreachable: answer 503, forward unchecked, or decide in this instance's
    // memory (`on_error`); either way the decision is counted.
    let checked = if shares.is_empty() {
        store.check(ns, &stored, plan).await
    } else {
        store.check_shares(&shares, trial).await
    };
    // (Taken apart where it is: a verdict is large enough that each move of it is
    // a copy.)
    let mut store_failed = false;
    let Checked { verdict: v, permit } = match checked {
        Ok(c) => c,
        Err(e) => {
            // The store logs its failures; this would repeat them per request.
            tracing::debug!(route = %route.name, error = %e, "limiter store failed");
            let fallback = match rt.on_error {
                OnError::Deny => {
                    tally.line =
                        shared
                            .refusals
                            .line(&route.name, &key.value, ctx.ip, What::StoreDown);
                    return Err(Refusal::StoreDown);
                }
                OnError::Allow => None,
                OnError::Local if shares.is_empty() => store.fallback(ns, &stored, plan),
                OnError::Local => store.fallback_shares(&shares, trial),
            };
            store_failed = true;
            match fallback {
                Some(c) => c,
                None => {
                    tally.decision = Decision::StoreErrorAllowed;
                    return Ok((None, None));
                }
            }
        }
    };
    // What the response will charge, with the keys it charges.
    let later = (!tier.later.is_empty() && (v.allowed || route.shadow)).then(|| Later {
        tier,
        keys: (0..=others.len())
            .map(|k| (key_at(k).0.to_string(), stored_at(k).to_string()))
            .collect(),
        fallback: store_failed,
        held: metered::held(plan, &v),
    });
    if !v.allowed {
        if route.shadow {
            tally.decision = Decision::Shadow;
            return Ok((None, later));
        }
        // The key of a limit is the key it refused: each such key earns a strike
        // towards the route's ban, and the log names the key of the limit reported.
        let key_of = |i: usize| {
            tier.shares
                .iter()
                .find(|s| s.at.contains(&i))
                .map_or(0, |s| s.key)
        };
        if let Some(ban) = &route.ban {
            let mut struck: Vec<usize> = Vec::with_capacity(1);
            for (i, _) in v.enforced().filter(|(_, o)| !o.allowed) {
                let k = key_of(i);
                if !struck.contains(&k) {
                    struck.push(k);
                    let (ns, key) = key_at(k);
                    strike(shared, route, ban, ns, stored_at(k), key, ctx.ip);
                }
            }
        }
        let (limit, retry_us, k) = match v.headline() {
            Some((i, o)) => (
                tier.plan.limits[i].name.as_str(),
                o.retry_after_us,
                key_of(i),
            ),
            None => ("", v.retry_after_us(), 0),
        };
        if let Some((i, _)) = v.headline() {
            tier.refused_by[i].inc();
        }
        let what = What::Limited {
            limit,
            retry_after: crate::pipeline::refusal::retry_after_secs(retry_us),
        };
        tally.line = shared
            .refusals
            .line(&route.name, &key_at(k).1.value, ctx.ip, what);
        if rt.access.is_some() {
            tally.limit = Some(limit.into());
        }
        // Counted for `/admin/top` (a deny-list refusal is not: that client is
        // already denied).
        route
            .top
            .refused(stored_at(k), ctx.ip, crate::deny::now_ms());
        return Err(Refusal::Limited(Box::new(Limited {
            route: &route.name,
            plan: &tier.plan,
            policy: tier.policy.as_ref(),
            headers: &rt.rate_headers,
            verdict: v,
        })));
    }
    tally.permit = permit;
    // A route that refused no one lately pays one relaxed load.
    if route.top.holds_any() {
        let keys = (0..=others.len()).map(stored_at);
        route.top.allowed(keys, crate::deny::now_ms());
    }
    // A limit on trial that refused: the request goes on, counted as `shadow`.
    tally.decision = match (store_failed, v.shadow_refused(), v.delay_us > 0) {
        (true, _, _) => Decision::StoreErrorAllowed,
        (false, true, _) => Decision::Shadow,
        (false, false, true) => Decision::Delayed,
        (false, false, false) => Decision::Allowed,
    };
    if v.delay_us > 0 {
        tokio::time::sleep(v.delay()).await;
    }
    Ok(((!route.shadow).then_some((tier, v)), later))
}

/// The limits of an admitted request that its response charges (`Tier::later`),
/// with the keys they count.
struct Later<'a> {
    tier: &'a Tier,
    /// The namespace and the stored key of each key number (`ShareDef::key`).
    keys: Vec<(String, String)>,
    /// Decided in this instance's fallback (`on_error: local`): charged there.
    fallback: bool,
    /// The estimate admission charged each limit of the plan, by index (0: none,
    /// or not charged: a refusal on trial); empty when no limit reads its cost from
    /// the body.
    held: Vec<u64>,
}

/// Charges what the upstream's response head says to the limits charged from the
/// response, off the response path (`Store::charge_response` never waits).
fn charge_from_response(shared: &Shared, later: &Later<'_>, resp: &Response<Body>) {
    let status = resp.status().as_u16();
    let tier = later.tier;
    let key_of = |i: usize| {
        tier.shares
            .iter()
            .find(|s| s.at.contains(&i))
            .map_or(0, |s| s.key)
    };
    // Per key number, the limits to charge with the units as their cost.
    let mut by_key: Vec<(usize, Plan)> = Vec::new();
    for l in &tier.later {
        let def = &tier.plan.limits[l.at];
        let Charge::Response(from) = &def.charge else {
            continue;
        };
        let (units, how) = from.units(status, resp.headers());
        if let (Some(how), Some(costs)) = (how, &l.costs) {
            costs.inc(how);
        }
        if units == 0 {
            continue;
        }
        let mut charged = def.clone();
        charged.cost = units;
        let k = key_of(l.at);
        match by_key.iter_mut().find(|(key, _)| *key == k) {
            Some((_, plan)) => plan.limits.push(charged),
            None => by_key.push((
                k,
                Plan {
                    limits: vec![charged],
                    mode: tier.plan.mode,
                },
            )),
        }
    }
    if by_key.is_empty() {
        return;
    }
    let charges = by_key
        .into_iter()
        .map(|(k, plan)| {
            let (ns, key) = &later.keys[k];
            (ns.clone(), key.clone(), plan)
        })
        .collect();
    shared.store.charge_response(charges, later.fallback);
}

/// The route's action: its own answer, or the upstream's.
async fn act<'a>(
    ctx: &Ctx<'a>,
    route: &Route,
    parts: &mut http::request::Parts,
    body: ClientBody,
    relay: Option<Relay<'_>>,
    target: &mut Option<usize>,
) -> Result<Response<Body>, Refusal<'a>> {
    match &route.action {
        Action::Respond {
            status,
            body,
            headers,
        } => {
            let mut r = Response::new(body::full(body.clone()));
            *r.status_mut() = *status;
            r.headers_mut()
                .extend(headers.iter().map(|(k, v)| (k.clone(), v.clone())));
            // The body is not read: as every early answer.
            if ctx.unread_body {
                r = body::close(r);
            }
            Ok(r)
        }
        Action::Upstream(up) => {
            let origin = Origin {
                client: ctx.ip,
                peer_forwarded_for: &ctx.peer.forwarded_for,
                trusted: ctx.rt.trusted.contains(ctx.peer.addr.ip()),
                proto: ctx.shared.proto,
            };
            let mut t = up.pick();
            *target = Some(t);
            // A target no connection could be made to, left for the next: counted
            // and logged as any failed forward.
            let passed_over = |past: usize, e: &ProxyError| {
                upstream_failed(route, (up, past), e);
            };
            let response = up
                .forward(
                    &mut t,
                    parts,
                    body,
                    &origin,
                    ctx.rt.max_request_body,
                    relay,
                    passed_over,
                )
                .await;
            *target = Some(t);
            response.map_err(|e| forward_failed(ctx.shared, route, (up, t), e))
        }
    }
}

/// Counts one request's decision and duration when dropped: when its response body
/// ends, or the client goes away first. Holds the request's concurrency permit, which
/// is released right after.
pub(crate) struct Tally {
    rt: Arc<Runtime>,
    route: Option<usize>,
    started: Instant,
    decision: Decision,
    permit: Permit,
    /// The refusal's log line, written once the request's method and path are at
    /// hand again (`process`).
    line: Option<Box<Line>>,
    /// The upstream target the request went to (`Upstream::pick`).
    target: Option<usize>,
    /// The upstream's status, when the answer is the upstream's.
    upstream_status: Option<u16>,
    /// The limit that refused (kept only when the access log is on).
    limit: Option<Box<str>>,
    /// The access log's line, finished and written when the request ends.
    access: Option<access_log::Entry>,
    /// Body bytes sent to the client (counted only when `access` is kept).
    bytes: u64,
    /// The client speaks HTTP/1 (sluice's own server writes the answer).
    client_h1: bool,
}

impl Tally {
    fn new(rt: Arc<Runtime>, route: Option<usize>) -> Tally {
        Tally {
            rt,
            route,
            started: Instant::now(),
            decision: Decision::Allowed,
            permit: Permit::None,
            line: None,
            target: None,
            upstream_status: None,
            limit: None,
            access: None,
            bytes: 0,
            client_h1: true,
        }
    }

    /// The upstream the request went to, and the target's number.
    fn upstream(&self) -> Option<(&Upstream, usize)> {
        let route = &self.rt.routes[self.route?];
        match (&route.action, self.target) {
            (Action::Upstream(up), Some(t)) => Some((up, t)),
            _ => None,
        }
    }
}

impl body::OnFail for Tally {
    /// A response body the upstream failed after its head had gone (silent for
    /// `read_timeout`, cut, malformed) is counted as the upstream's failure, as one
    /// before the head is (`forward_failed`).
    fn failed(&mut self, e: &body::BoxError, at_first: bool) {
        // Sluice's HTTP/1 server answered 502 instead of the head.
        if at_first && self.client_h1 {
            if let Some(entry) = &mut self.access {
                entry.status = StatusCode::BAD_GATEWAY.as_u16();
            }
        }
        let Some(route) = self.route.map(|i| &self.rt.routes[i]) else {
            return;
        };
        let counter = match crate::upstream::body_failure(e) {
            Some(BodyFailure::Timeout) => &route.metrics.upstream_timeout,
            Some(BodyFailure::Reset) => &route.metrics.upstream_reset,
            None => return,
        };
        counter.inc();
        if let Some((up, t)) = self.upstream() {
            if let Some(dropped) = up.failure_line(t) {
                let target = up.target_addr(t);
                tracing::warn!(route = %route.name, upstream = %up.name, target, dropped, error = %e, "upstream response body failed");
            }
        }
    }

    fn sent(&mut self, bytes: usize) {
        self.bytes += bytes as u64;
    }

    fn counts_bytes(&self) -> bool {
        self.access.is_some()
    }
}

impl Drop for Tally {
    fn drop(&mut self) {
        let metrics = match self.route {
            Some(i) => &self.rt.routes[i].metrics,
            None => &self.rt.unmatched,
        };
        metrics.count(self.decision);
        let elapsed = self.started.elapsed();
        metrics.duration.observe(elapsed.as_secs_f64());
        if let (Some(entry), Some(log)) = (&self.access, &self.rt.access) {
            let route = self.route.map(|i| &self.rt.routes[i]);
            let limit = self.limit.as_deref();
            log.write(
                entry,
                &access_log::End {
                    at_ms: crate::deny::now_ms(),
                    route: route.map_or("unmatched", |r| r.name.as_str()),
                    decision: self.decision.as_str(),
                    limit,
                    upstream: self.upstream().map(|(up, t)| up.target_addr(t)),
                    duration: elapsed,
                    bytes: self.bytes,
                },
            );
        }
    }
}

/// Whether `values` offers a key on the static or the dynamic deny list; `hit` is
/// told the first one (for the log). On a route that normalises its key, the
/// values are in that form already, and an entry matches when its own form is the
/// value (`Carl` denies `carl` on a `casefold` route). The dynamic list's guard is
/// dropped before the request goes on (it must not be held across an await).
fn denied_key(
    rt: &Runtime,
    shared: &Shared,
    form: Normalize,
    values: impl FnOnce(&mut dyn FnMut(&str) -> bool) -> bool,
    hit: &mut dyn FnMut(&str),
) -> bool {
    let dynamic = shared.deny.load();
    if !rt.deny.table.has_keys() && !dynamic.has_keys() {
        return false;
    }
    values(&mut |k| {
        // A long key is looked up as it is kept: hashed once, on the stack.
        let mut digest = None;
        let stored = crate::deny::stored_key(k, &mut digest);
        let denied = rt.deny.table.stored_key(stored)
            || dynamic.stored_key(stored)
            || (form != Normalize::None
                && (rt.deny.table.folded_key(form, k) || dynamic.folded_key(form, k)));
        if denied {
            hit(k);
        }
        denied
    })
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
    key: &ClientKey<'_>,
    ip: std::net::IpAddr,
) {
    if shared.strikes.check(ns, stored, &ban.strikes).allowed {
        return;
    }
    // A key that is the address, or fell back to it, bans the address.
    let target = if route.counts_address(ns) {
        Target::Ip(ip.into())
    } else {
        Target::client_key(&key.value)
    };
    let _ = shared.bans.try_send(BanRequest {
        route: route.name.clone(),
        target,
        duration: ban.duration,
    });
}

/// Counts a client's fault with its request body.
fn count_client_fault(shared: &Shared, fault: &ClientFault) {
    match fault {
        ClientFault::Malformed => shared.metrics.client_body.inc(),
        ClientFault::Aborted => shared.metrics.client_aborted.inc(),
        ClientFault::Timeout => shared.metrics.client_timeout.inc(),
    }
}

/// Counts a failed forward: the client's fault or the upstream's. The upstream's
/// (connect, timeout, reset or a malformed answer) is logged at WARN with the target,
/// a few lines a second per target (`Upstream::failure_line`).
fn forward_failed<'a>(
    shared: &Shared,
    route: &Route,
    (up, t): (&Upstream, usize),
    e: ProxyError,
) -> Refusal<'a> {
    let upstream_fault = match &e {
        ProxyError::Connect(_) | ProxyError::Timeout | ProxyError::Reset(_) => Some(()),
        ProxyError::Busy => {
            route.metrics.upstream_busy.inc();
            None
        }
        ProxyError::TooLarge | ProxyError::BuffersFull => None,
        ProxyError::Client(fault) => {
            count_client_fault(shared, fault);
            None
        }
    };
    match upstream_fault {
        Some(_) => upstream_failed(route, (up, t), &e),
        None => tracing::debug!(route = %route.name, error = %e, "forwarding failed"),
    }
    Refusal::from(e)
}

/// Counts the upstream's failure (connect, timeout or reset) and logs it at WARN
/// with the target, a few lines a second per target.
fn upstream_failed(route: &Route, (up, t): (&Upstream, usize), e: &ProxyError) {
    let counter = match e {
        ProxyError::Connect(_) => &route.metrics.upstream_connect,
        ProxyError::Timeout => &route.metrics.upstream_timeout,
        ProxyError::Reset(_) => &route.metrics.upstream_reset,
        _ => return,
    };
    counter.inc();
    if let Some(dropped) = up.failure_line(t) {
        let target = up.target_addr(t);
        tracing::warn!(route = %route.name, upstream = %up.name, target, dropped, error = %e, "forwarding failed");
    }
}
