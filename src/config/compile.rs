//! Turn a validated configuration into the runtime structures the request path
//! reads: precompiled matchers, limit plans with their header values, upstream
//! clients and the per-route metric children. Runs at startup and on every reload;
//! validation has already rejected anything that cannot compile, so the errors
//! here are about the outside world (files, certificates).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode};
use regex::RegexBuilder;

use super::schema::{
    self, AlgorithmName, BackendSpec, HeaderFamily, KeyText, OnLimit, UpstreamProtocol,
};
use super::validate::{status_pattern, StatusPattern};
use super::value::{Text, WindowSpec};
use super::Loaded;
use crate::deny::{Source, StaticDeny};
use crate::identity::{Claim, KeyPart, KeySpec, Normalize, TrustedProxies};
use crate::jwt::{Failure as JwtFailure, Provider, ProviderSpec, Source as JwtSource};
use crate::limit::redis::REFUSAL_CACHE_ENTRIES;
use crate::limit::{
    Algorithm, BodyCost, Charge, Clock, CostFrom, Estimate, FromResponse, LimitDef, MemoryStore,
    Mode, Plan, PrimaryUrl, Rate, RedisOptions, RedisStore, RedisTarget, Reserve, ResponseCost,
    SentinelTarget, StatusSet, Store, StoreError, SystemClock,
};
use crate::pipeline::metered::CostCounters;
use crate::pipeline::refusal::{policy_header, RateHeaders};
use crate::pipeline::route::{HeaderMatch, HostMatch, Matcher};
use crate::pipeline::{
    Action, BanRule, LaterLimit, LimitKey, Limits, Route, RouteJwt, Runtime, ShareDef, Tier,
    TokenFrom,
};
use crate::telemetry::access_file::{AccessFile, FileOptions};
use crate::telemetry::access_log::{AccessLog, Format};
use crate::telemetry::metrics::Metrics;
use crate::upstream::health::{Check, Passive};
use crate::upstream::{BuildError, Protocol, Upstream, UpstreamOpts};

#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error(transparent)]
    Upstream(#[from] BuildError),
    #[error("route {route}: {message}")]
    Route { route: String, message: String },
    #[error("access_log.path {path}: {error}")]
    AccessLog { path: String, error: std::io::Error },
    #[error("jwt.providers.{provider}: {message}")]
    Jwt { provider: String, message: String },
}

fn route_err(route: &str, message: impl Into<String>) -> CompileError {
    CompileError::Route {
        route: route.into(),
        message: message.into(),
    }
}

/// The access log's file, if it has one: the previous configuration's when it has
/// the same path and settings (so a reload neither reopens it nor reorders its
/// lines), else opened now.
fn access_file(
    a: &schema::AccessLogConfig,
    previous: Option<&Runtime>,
) -> Result<Option<Arc<AccessFile>>, CompileError> {
    let Some(path) = &a.path else {
        return Ok(None);
    };
    let options = FileOptions {
        path: PathBuf::from(path.as_str()),
        buffer: a.buffer.map_or(DEFAULT_ACCESS_BUFFER, |b| b.0 as usize),
        flush: a.flush.map_or(DEFAULT_ACCESS_FLUSH, |d| d.get()),
    };
    let kept = previous
        .and_then(|p| p.access.as_ref()?.file())
        .filter(|f| *f.options() == options);
    if let Some(f) = kept {
        return Ok(Some(f.clone()));
    }
    AccessFile::open(options)
        .map(Some)
        .map_err(|error| CompileError::AccessLog {
            path: path.as_str().to_string(),
            error,
        })
}

/// `access_log.buffer` and `access_log.flush` when not given (nginx's `buffer=64k`,
/// `flush=1s` in its examples).
pub const DEFAULT_ACCESS_BUFFER: usize = 64 * 1024;
pub const DEFAULT_ACCESS_FLUSH: Duration = Duration::from_secs(1);

/// Compiles a loaded file into the runtime that serves it. An upstream whose
/// settings (and CA file) are those of one in `previous` is taken over as it is, with
/// its pool and its connection cap: connections in use when a reload happens still
/// count, and an unchanged upstream's idle connections are not thrown away. A
/// route of the same name in `previous` hands over its heaviest refused clients
/// (`Route::top`); those of a route the file no longer has go with `previous`.
pub fn compile(
    loaded: &Loaded,
    metrics: &Metrics,
    previous: Option<&Runtime>,
) -> Result<Runtime, CompileError> {
    let f = &loaded.file;
    let mut upstreams = HashMap::new();
    let upgrades: Vec<String> = f.server.upgrades.iter().map(|u| u.0.clone()).collect();
    for (name, u) in &f.upstreams {
        let targets: Vec<String> = u.targets.iter().map(|t| t.0.clone()).collect();
        let ca = u.tls_ca.as_ref().map(|p| Path::new(p.as_str()));
        let opts = UpstreamOpts {
            connect_timeout: u.connect_timeout.get(),
            timeout: u.timeout.get(),
            read_timeout: u.read_timeout.get(),
            tls_ca: ca,
            max_connections: u.max_connections.get(),
            upgrades: &upgrades,
            body_timeout: f.server.request_body_timeout.get(),
            // Validation keeps it at most 1MiB.
            request_buffer: usize::try_from(f.server.request_buffer.0).unwrap_or(usize::MAX),
            max_buffered: usize::try_from(f.server.max_buffered_bytes.0).unwrap_or(usize::MAX),
            buffered: metrics.read_ahead.clone(),
            tunnel_idle: f.server.tunnel_idle_timeout.get(),
            probe: u.probe,
            protocol: match u.protocol {
                UpstreamProtocol::Http1 => Protocol::Http1,
                UpstreamProtocol::H2c => Protocol::H2c,
                UpstreamProtocol::H2 => Protocol::H2,
                UpstreamProtocol::Auto => Protocol::Auto,
            },
            passive: Passive {
                max_fails: u.max_fails.get(),
                fail_timeout: u.fail_timeout.get(),
            },
            check: u.health_check.as_ref().and_then(|c| {
                Some(Check {
                    // Validation keeps it a path.
                    path: c.path.as_str().parse().ok()?,
                    interval: c.interval.get(),
                    timeout: c.timeout.get(),
                })
            }),
        };
        let spec = opts.spec(name, &targets);
        let up = match previous.and_then(|p| p.upstreams.get(name)) {
            Some(up) if up.spec == spec => up.clone(),
            _ => Arc::new(Upstream::new(name, &targets, opts)?),
        };
        upstreams.insert(name.clone(), up);
    }

    let jwt = jwt_providers(f, previous)?;
    let mut routes = f
        .routes
        .iter()
        .map(|r| compile_route(r, &upstreams, &jwt, metrics))
        .collect::<Result<Vec<_>, _>>()?;
    // A route's heaviest refused clients outlive a reload that keeps its name.
    for r in &mut routes {
        if let Some(old) = previous.and_then(|p| p.routes.iter().find(|o| o.name == r.name)) {
            r.top = old.top.clone();
        }
    }

    let deny = StaticDeny::new(
        f.deny.ips.iter().map(|n| n.0),
        f.deny.keys.iter().map(|k| k.0.clone()),
        StatusCode::from_u16(f.deny.status.get()).unwrap_or(StatusCode::FORBIDDEN),
        f.deny.max_entries.get(),
    );
    // Nothing after this can fail: the new runtime will be the one serving.
    let entries = i64::try_from(deny.table.count(Source::Static)).unwrap_or(i64::MAX);
    metrics
        .deny_entries
        .with_label_values(&[Source::Static.as_str()])
        .set(entries);

    Ok(Runtime {
        routes,
        upstreams,
        trusted: TrustedProxies::new(f.client_ip.trusted_proxies.iter().map(|n| n.0).collect()),
        deny,
        rate_headers: RateHeaders {
            ietf: f.response_headers.contains(&HeaderFamily::Ietf),
            x_ratelimit: f.response_headers.contains(&HeaderFamily::XRatelimit),
        },
        max_request_body: f.server.max_request_body.0,
        max_key_body: f.server.max_key_body.0,
        request_body_timeout: f.server.request_body_timeout.get(),
        on_error: f.store.on_error,
        access: match &f.access_log {
            Some(a) => {
                let format = match a.format {
                    schema::AccessFormat::Json => Format::Json,
                    schema::AccessFormat::Combined => Format::Combined,
                };
                let file = access_file(a, previous)?;
                Some(AccessLog::new(
                    format,
                    a.sample,
                    metrics.access_logs_dropped.clone(),
                    file,
                ))
            }
            None => None,
        },
        unmatched: metrics.unmatched(),
        hash: loaded.hash.clone(),
        // An empty token (`${VAR:-}`) is no token; validation allows that only on loopback.
        admin_token: f
            .admin
            .token
            .as_ref()
            .filter(|t| !t.is_empty())
            .map(|t| t.0.clone()),
        jwt,
    })
}

/// `jwt.providers`: a provider whose settings did not change is the previous
/// configuration's (its keys and the tokens it verified kept); a new one has an HS
/// secret's or a JWKS file's keys at once, and starts fetching a URL's.
fn jwt_providers(
    f: &schema::File,
    previous: Option<&Runtime>,
) -> Result<HashMap<String, Arc<Provider>>, CompileError> {
    let mut out = HashMap::new();
    for (name, p) in &f.jwt.providers {
        let source = match (&p.jwks_url, &p.jwks_file, &p.secret) {
            (Some(u), _, _) => JwtSource::Url(u.0.clone()),
            (_, Some(file), _) => JwtSource::File(file.0.clone().into()),
            (_, _, Some(s)) => JwtSource::Secret(s.0.as_bytes().to_vec()),
            _ => {
                return Err(CompileError::Jwt {
                    provider: name.clone(),
                    message: "needs jwks_url, jwks_file or secret".into(),
                })
            }
        };
        let spec = ProviderSpec {
            name: name.clone(),
            source,
            issuer: p.issuer.as_ref().map(|i| i.0.clone()),
            audiences: p.audiences.iter().map(|a| a.0.clone()).collect(),
            leeway: p.leeway.get(),
            cache_size: p.cache_size.get(),
        };
        let provider = match previous.and_then(|r| r.jwt.get(name)) {
            Some(old) if old.spec == spec => old.clone(),
            _ => {
                let provider = Arc::new(Provider::new(spec).map_err(|e| CompileError::Jwt {
                    provider: name.clone(),
                    message: e.to_string(),
                })?);
                provider.start();
                provider
            }
        };
        out.insert(name.clone(), provider);
    }
    Ok(out)
}

/// The limiter's store of `store:`: in memory (`clock` its clock), or on Redis,
/// connected (`clock`, if any, the time sent with every limiter call instead of
/// Redis' own).
pub async fn store(
    f: &schema::File,
    metrics: &Metrics,
    clock: Option<Arc<dyn Clock>>,
) -> Result<Store, StoreError> {
    let max_keys = f.store.memory.max_keys.get();
    match (f.store.backend, &f.store.redis) {
        (BackendSpec::Memory, _) => {
            let clock: Arc<dyn Clock> = match clock {
                Some(c) => c,
                None => SystemClock::new(),
            };
            let m =
                MemoryStore::new(max_keys, clock).with_evictions(metrics.eviction_counters.clone());
            Ok(Store::memory(m, metrics))
        }
        (BackendSpec::Redis, Some(redis)) => {
            let opts = redis_options(redis)?;
            let redis = RedisStore::open(opts, clock).await?;
            Ok(Store::redis(redis, max_keys, metrics))
        }
        (BackendSpec::Redis, None) => Err(StoreError::Config(
            "store.backend: redis needs a store.redis section".into(),
        )),
    }
}

/// How to reach the Redis store: one server, a cluster, or the primary Redis Sentinel
/// names.
pub fn redis_options(c: &schema::RedisStoreSpec) -> Result<RedisOptions, StoreError> {
    let target = match (&c.cluster, &c.url, &c.sentinel) {
        (Some(nodes), _, _) if !nodes.is_empty() => {
            RedisTarget::Cluster(nodes.iter().map(|n| n.0.clone()).collect())
        }
        (_, Some(url), _) => RedisTarget::Url(url.0.clone()),
        (_, _, Some(s)) => RedisTarget::Sentinel(sentinel_target(s)?),
        _ => {
            return Err(StoreError::Config(
                "store.redis needs url, cluster or sentinel".into(),
            ))
        }
    };
    Ok(RedisOptions {
        target,
        timeout: c.timeout.get(),
        key_prefix: c.key_prefix.0.clone(),
        refusal_cache: REFUSAL_CACHE_ENTRIES,
    })
}

/// The sentinels, and how to reach the primary they name: the way the sentinels are
/// reached (TLS and `?protocol=`, from the first node: validation makes
/// them agree), with the primary's own credentials and database.
fn sentinel_target(s: &schema::RedisSentinel) -> Result<SentinelTarget, StoreError> {
    let first = s
        .nodes
        .first()
        .ok_or_else(|| StoreError::Config("store.redis.sentinel.nodes lists no sentinel".into()))?;
    let (scheme, rest) = first
        .split_once("://")
        .ok_or_else(|| StoreError::Config("store.redis.sentinel.nodes: not a URL".into()))?;
    let tail = rest.find(['?', '#']).map_or("", |i| &rest[i..]);
    let encode = |t: &Text| {
        percent_encoding::utf8_percent_encode(t, percent_encoding::NON_ALPHANUMERIC).to_string()
    };
    let userinfo = match (&s.username, &s.password) {
        (Some(u), Some(p)) => format!("{}:{}@", encode(u), encode(p)),
        (None, Some(p)) => format!(":{}@", encode(p)),
        (_, None) => String::new(),
    };
    Ok(SentinelTarget {
        master: s.master.0.clone(),
        nodes: s.nodes.iter().map(|n| n.0.clone()).collect(),
        primary: PrimaryUrl {
            scheme: scheme.to_string(),
            userinfo,
            db: s.db.get(),
            tail: tail.to_string(),
        },
    })
}

fn compile_route(
    r: &schema::RouteSpec,
    upstreams: &HashMap<String, Arc<Upstream>>,
    providers: &HashMap<String, Arc<Provider>>,
    metrics: &Metrics,
) -> Result<Route, CompileError> {
    let name = r.name.0.clone();
    let action = match (&r.upstream, &r.respond) {
        (Some(u), _) => Action::Upstream(
            upstreams
                .get(u.as_str())
                .cloned()
                .ok_or_else(|| route_err(&name, format!("unknown upstream {u}")))?,
        ),
        (None, Some(resp)) => {
            let mut headers = HeaderMap::new();
            for (k, v) in &resp.headers {
                let k = HeaderName::from_bytes(k.as_bytes())
                    .map_err(|_| route_err(&name, format!("bad header name {k}")))?;
                let v = HeaderValue::from_str(v)
                    .map_err(|_| route_err(&name, format!("bad header value {v:?}")))?;
                headers.insert(k, v);
            }
            if !headers.contains_key(http::header::CONTENT_TYPE) {
                headers.insert(
                    http::header::CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; charset=utf-8"),
                );
            }
            Action::Respond {
                status: StatusCode::from_u16(resp.status.get())
                    .map_err(|_| route_err(&name, "bad respond.status"))?,
                body: Bytes::from(resp.body.0.clone()),
                headers,
            }
        }
        (None, None) => return Err(route_err(&name, "needs upstream or respond")),
    };

    let key = key_spec(&name, &r.key, r.normalize_key)?;
    let mut keys = Keys {
        route: &name,
        key: &key,
        others: Vec::new(),
    };

    // A shadow route must be invisible: it never delays either.
    let mode = match (r.on_limit, r.max_delay) {
        (OnLimit::Delay, Some(d)) if !r.shadow => Mode::Delay {
            max_delay_us: d.get().as_micros() as u64,
        },
        _ => Mode::Reject,
    };
    let limits = if r.limits.is_empty() {
        None
    } else {
        let default = tier(&mut keys, &r.limits, mode, metrics)?;
        let mut overrides = HashMap::new();
        let mut by_claims = Vec::new();
        for o in &r.overrides {
            let t = Arc::new(tier(&mut keys, &o.limits, mode, metrics)?);
            if !o.claims.is_empty() {
                let want = o
                    .claims
                    .iter()
                    .map(|(c, v)| {
                        let claim = Claim::parse(c)
                            .ok_or_else(|| route_err(&name, format!("bad claim {c:?}")))?;
                        Ok((claim, v.0.clone()))
                    })
                    .collect::<Result<Vec<_>, CompileError>>()?;
                by_claims.push((want, t.clone()));
            }
            for k in &o.keys {
                // Matched against the key as it is counted: a body key in NFC, in
                // its normal form (each part of a composite key).
                let k = if key.reads_body() {
                    crate::identity::nfc(k.0.as_str().into())
                } else {
                    k.0.as_str().into()
                };
                let k = if key.parts.len() > 1 {
                    crate::identity::normalize_joined(key.normalize, &k).into_owned()
                } else {
                    key.normalize.apply(k).into_owned()
                };
                overrides.insert(k, t.clone());
            }
        }
        Some(Limits {
            default,
            overrides,
            by_claims,
        })
    };

    let ban = r.ban.as_ref().map(|b| {
        // Exported at 0 from the start, so rate() and alerts work before the first ban.
        metrics.bans.with_label_values(&[name.as_str()]);
        BanRule {
            strikes: Plan {
                limits: vec![LimitDef::new(
                    "strikes".into(),
                    Algorithm::SlidingLog {
                        limit: b.after.get().saturating_sub(1),
                        window_us: b.within.get().as_micros() as u64,
                    },
                    1,
                )],
                mode: Mode::Reject,
            },
            duration: b.duration.get(),
        }
    });

    let limit_keys = keys.others;
    let (ns, fallback_ns) = (name.clone(), format!("{name}/ip"));
    let mut namespaces = vec![ns.as_str(), fallback_ns.as_str()];
    for k in &limit_keys {
        namespaces.extend([k.ns.as_str(), k.fallback_ns.as_str()]);
    }
    metrics.store_namespaces(&name, &namespaces);
    let mut route_metrics = metrics.route(&name);
    let jwt = match &r.jwt {
        None => None,
        Some(j) => {
            let provider = providers
                .get(j.provider.as_str())
                .cloned()
                .ok_or_else(|| route_err(&name, format!("unknown JWT provider {}", j.provider)))?;
            let reasons: Vec<&str> = JwtFailure::ALL.iter().map(|f| f.as_str()).collect();
            let (m, failures) = route_metrics.with_unauthorized(metrics, &name, &reasons);
            route_metrics = m;
            let from = match (&j.header, &j.cookie) {
                (Some(h), _) => TokenFrom::Header(
                    HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| route_err(&name, format!("bad jwt.header {h}")))?,
                ),
                (None, Some(c)) => TokenFrom::Cookie(c.0.clone()),
                (None, None) => TokenFrom::Authorization,
            };
            Some(RouteJwt {
                provider,
                required: j.required,
                from,
                failures,
            })
        }
    };
    Ok(Route {
        matcher: matcher(&name, &r.matcher)?,
        action,
        key,
        missing_key: r.missing_key,
        ns,
        fallback_ns,
        limit_keys,
        estimate_body: limits.as_ref().is_some_and(|l| {
            std::iter::once(&l.default)
                .chain(l.overrides.values().map(|t| t.as_ref()))
                .any(|t| crate::pipeline::metered::reads_estimate(&t.plan))
        }),
        limits,
        shadow: r.shadow,
        ban,
        metrics: route_metrics,
        top: Arc::default(),
        jwt,
        name,
    })
}

fn matcher(route: &str, m: &schema::Match) -> Result<Matcher, CompileError> {
    let methods = match &m.methods {
        None => None,
        Some(ms) => Some(
            ms.iter()
                .map(|s| {
                    Method::from_bytes(s.to_ascii_uppercase().as_bytes())
                        .map_err(|_| route_err(route, format!("bad method {s}")))
                })
                .collect::<Result<Vec<_>, _>>()?,
        ),
    };
    // Upstreams answer HEAD with their GET handler: a route for GET takes HEAD too,
    // or a HEAD would step around its limits through another route.
    let methods = methods.map(|mut ms| {
        if ms.contains(&Method::GET) && !ms.contains(&Method::HEAD) {
            ms.push(Method::HEAD);
        }
        ms
    });
    let mut headers = Vec::new();
    for (k, v) in m.headers.iter().flatten() {
        let name = HeaderName::from_bytes(k.as_bytes())
            .map_err(|_| route_err(route, format!("bad header name {k}")))?;
        let m = if v.as_str() == "*" {
            HeaderMatch::Present
        } else {
            HeaderMatch::Exact(
                HeaderValue::from_str(v)
                    .map_err(|_| route_err(route, format!("bad header value {v:?}")))?,
            )
        };
        headers.push((name, m));
    }
    Ok(Matcher {
        host: m.host.as_ref().map(|h| HostMatch::parse(h)),
        path: m.path.as_ref().map(|p| p.0.clone()),
        path_prefix: m.path_prefix.as_ref().map(|p| p.0.clone()),
        path_regex: match &m.path_regex {
            Some(re) => Some(
                RegexBuilder::new(re)
                    .case_insensitive(m.case_insensitive)
                    .build()
                    .map_err(|e| route_err(route, format!("path_regex: {e}")))?,
            ),
            None => None,
        },
        methods,
        headers,
        case_insensitive: m.case_insensitive,
    })
}

fn key_spec(route: &str, raw: &KeyText, normalize: Normalize) -> Result<KeySpec, CompileError> {
    let parts = match raw {
        KeyText::One(k) => vec![k],
        KeyText::Composite(ks) => ks.iter().collect(),
    };
    Ok(KeySpec {
        parts: parts
            .into_iter()
            .map(|p| KeyPart::parse(p).ok_or_else(|| route_err(route, format!("bad key {p}"))))
            .collect::<Result<_, _>>()?,
        normalize,
    })
}

/// The keys a route's limits count: its own (number 0), then each other one a limit
/// names (number i: `others[i - 1]`), once however many limits name it.
struct Keys<'a> {
    route: &'a str,
    key: &'a KeySpec,
    others: Vec<LimitKey>,
}

impl Keys<'_> {
    /// The number of the key `raw` names (None: the route's key).
    fn number(
        &mut self,
        raw: Option<&KeyText>,
        normalize: Option<Normalize>,
    ) -> Result<usize, CompileError> {
        let Some(raw) = raw else {
            return Ok(0);
        };
        let spec = key_spec(self.route, raw, normalize.unwrap_or_default())?;
        if spec == *self.key {
            return Ok(0);
        }
        if let Some(i) = self.others.iter().position(|k| k.spec == spec) {
            return Ok(i + 1);
        }
        // Named by the key itself, not its place: a reload that adds, removes or
        // reorders limits keeps every key's state where it was.
        let mut ns = format!("{}/key={}", self.route, spec.describe_grammar());
        if spec.normalize != Normalize::None {
            ns = format!("{ns}/{}", spec.normalize);
        }
        self.others.push(LimitKey {
            fallback_ns: format!("{ns}/ip"),
            ns,
            spec,
        });
        Ok(self.others.len())
    }
}

fn tier(
    keys: &mut Keys<'_>,
    limits: &[schema::Limit],
    mode: Mode,
    metrics: &Metrics,
) -> Result<Tier, CompileError> {
    let mut defs = limits
        .iter()
        .enumerate()
        .map(|(i, l)| limit_def(keys.route, i, l))
        .collect::<Result<Vec<_>, _>>()?;
    let numbers = limits
        .iter()
        .map(|l| keys.number(l.key.as_ref(), l.normalize_key))
        .collect::<Result<Vec<_>, _>>()?;
    // One share per key, in the order the keys first appear.
    let mut shares: Vec<ShareDef> = Vec::new();
    for (i, (&key, def)) in numbers.iter().zip(&defs).enumerate() {
        let at = match shares.iter().position(|s| s.key == key) {
            Some(j) => j,
            None => {
                shares.push(ShareDef {
                    key,
                    plan: Plan {
                        limits: Vec::new(),
                        mode,
                    },
                    at: Vec::new(),
                });
                shares.len() - 1
            }
        };
        shares[at].plan.limits.push(def.clone());
        shares[at].at.push(i);
    }
    // Every limit counts the route's key: the plan is decided whole.
    if shares.iter().all(|s| s.key == 0) {
        shares.clear();
    }
    let later = defs
        .iter()
        .enumerate()
        .filter_map(|(at, d)| match &d.charge {
            Charge::Admission | Charge::GiveBack => None,
            Charge::Response(r) => {
                let sources: &[CostFrom] = match r.cost {
                    ResponseCost::Header { .. } => &CostFrom::OF_HEADER,
                    ResponseCost::Body(_) => &CostFrom::OF_BODY,
                    ResponseCost::Units(_) => &[],
                };
                Some(LaterLimit {
                    at,
                    // Exported at 0 from the start.
                    costs: (!sources.is_empty()).then(|| {
                        CostCounters::new(sources.iter().map(|&from| {
                            let labels = [keys.route, d.name.as_str(), from.label()];
                            (from, metrics.response_costs.with_label_values(&labels))
                        }))
                    }),
                    reads_body: r.body().is_some(),
                })
            }
        })
        .collect();
    // Created at 0, once per (route, limit name): tiers share a name's child.
    for d in defs.iter_mut() {
        if let Some(r) = &mut d.reserve {
            r.unused = Some(
                metrics
                    .reserve_unused
                    .with_label_values(&[keys.route, d.name.as_str()]),
            );
        }
    }
    let refused_by = defs
        .iter()
        .map(|d| {
            metrics
                .limit_refusals
                .with_label_values(&[keys.route, d.name.as_str()])
        })
        .collect();
    let plan = Plan { limits: defs, mode };
    Ok(Tier {
        policy: policy_header(&plan),
        plan,
        shares,
        later,
        refused_by,
    })
}

fn limit_def(route: &str, index: usize, l: &schema::Limit) -> Result<LimitDef, CompileError> {
    let name = l.name_at(index);
    let missing = |what: &str| route_err(route, format!("limit {name}: missing {what}"));
    let us = |d: std::time::Duration| d.as_micros() as u64;
    let limit =
        || -> Result<u64, CompileError> { Ok(l.limit.ok_or_else(|| missing("limit"))?.get()) };
    // A window of fixed length, for sliding_window and sliding_log (`check` refuses
    // `month` on them).
    let windowed = || -> Result<(u64, u64), CompileError> {
        match l.window.ok_or_else(|| missing("window"))? {
            WindowSpec::Length(d) => Ok((limit()?, us(d))),
            WindowSpec::Month => Err(route_err(
                route,
                format!("limit {name}: window: month is for fixed_window only"),
            )),
        }
    };
    let bucket = || -> Result<(Rate, u64), CompileError> {
        let r = l.rate.ok_or_else(|| missing("rate"))?;
        let burst = l.burst.map_or(r.count, |b| b.get());
        Ok((Rate::reduced(r.count, us(r.per)), burst))
    };
    let algorithm = match l.algorithm {
        AlgorithmName::FixedWindow => match l.window.ok_or_else(|| missing("window"))? {
            WindowSpec::Length(d) => Algorithm::FixedWindow {
                limit: limit()?,
                window_us: us(d),
            },
            WindowSpec::Month => Algorithm::CalendarMonth { limit: limit()? },
        },
        AlgorithmName::SlidingWindow => {
            windowed().map(|(limit, window_us)| Algorithm::SlidingWindow { limit, window_us })?
        }
        AlgorithmName::SlidingLog => {
            windowed().map(|(limit, window_us)| Algorithm::SlidingLog { limit, window_us })?
        }
        AlgorithmName::TokenBucket => {
            bucket().map(|(rate, burst)| Algorithm::TokenBucket { rate, burst })?
        }
        AlgorithmName::Gcra => bucket().map(|(rate, burst)| Algorithm::Gcra { rate, burst })?,
        AlgorithmName::Concurrency => Algorithm::Concurrency {
            limit: limit()?,
            lease_us: us(l.lease.map_or(DEFAULT_LEASE, |d| d.get())),
        },
    };
    // A limit charged from the response checks for its cost (one unit when the
    // response says the cost) before forwarding.
    let mut def = LimitDef::new(name, algorithm, l.units().unwrap_or(1));
    if l.from_response() {
        let from = from_response(route, l, &algorithm)?;
        // An estimate is what admission charges (settled when the body ends); one
        // read from the request's body is set per request, this when it has none.
        if let Some(e) = from.body().and_then(|b| b.estimate.as_ref()) {
            def = LimitDef::new(def.name, algorithm, e.fallback());
        }
        def = def.from_response(from);
    }
    if let Some(n) = l.reserve {
        def = def.reserving(Reserve::new(n.get()));
    }
    Ok(if l.shadow { def.on_trial() } else { def })
}

/// What a response charges a limit with `count` or a `cost` from a header.
fn from_response(
    route: &str,
    l: &schema::Limit,
    algorithm: &Algorithm,
) -> Result<FromResponse, CompileError> {
    let statuses = match &l.count {
        None => None,
        Some(count) => {
            let mut set = StatusSet::default();
            for st in &count.status {
                match status_pattern(st) {
                    Some(StatusPattern::Code(c)) => set.insert(c),
                    Some(StatusPattern::Class(c)) => set.insert_class(c),
                    None => return Err(route_err(route, format!("bad status {st:?}"))),
                }
            }
            Some(set)
        }
    };
    let cost = match &l.cost {
        Some(schema::Cost::Response(r)) => {
            // No response owes more than a whole window or bucket.
            let (default, cap) = (
                r.default.map_or(1, |d| d.get()).min(algorithm.quota()),
                algorithm.quota(),
            );
            match (&r.response_header, &r.response_json) {
                (Some(h), _) => ResponseCost::Header {
                    name: HeaderName::from_bytes(h.as_bytes())
                        .map_err(|_| route_err(route, "bad response_header"))?,
                    default,
                    cap,
                },
                (None, Some(pointers)) => ResponseCost::Body(Box::new(BodyCost {
                    pointers: pointers.list().iter().map(|p| p.to_string()).collect(),
                    estimate: r.estimate.as_ref().map(|e| match e {
                        schema::EstimateSpec::Units(n) => Estimate::Units(n.get().min(cap)),
                        schema::EstimateSpec::Read(t) => Estimate::Read {
                            pointer: t
                                .as_str()
                                .strip_prefix("json:")
                                .unwrap_or_default()
                                .to_string(),
                            default,
                        },
                    }),
                    default,
                    cap,
                })),
                (None, None) => {
                    return Err(route_err(
                        route,
                        "a cost from the response needs response_header or response_json",
                    ))
                }
            }
        }
        _ => ResponseCost::Units(l.units().unwrap_or(1)),
    };
    Ok(FromResponse { statuses, cost })
}

/// How long a concurrency slot stays taken when the instance holding it dies without
/// giving it back (Redis store): `lease` of a concurrency limit, by default.
pub const DEFAULT_LEASE: std::time::Duration = std::time::Duration::from_secs(60);
