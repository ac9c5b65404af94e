//! The configuration file as written: serde types that mirror `rules.yaml` field for
//! field. Unknown fields are errors. Values are checked for form here (durations,
//! rates, addresses); cross-field rules live in `validate`, and `compile` turns the
//! result into the runtime structures the request path reads.
//!
//! A type named like the runtime type it compiles into has a `Spec` suffix here
//! (`RouteSpec` becomes a `pipeline::Route`); `serde(rename)` keeps its old name
//! in `rules.schema.json` and in serde's messages. The `key` field as written is a
//! `KeyText` (it becomes an `identity::KeySpec`).

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::value::{Addr, Dur, Net, Num, RateSpec, Size, Text, WindowSpec};
// Enums the runtime reads as they are written.
pub use crate::identity::{MissingKey, Normalize};
pub use crate::limit::OnError;

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct File {
    /// The gateway listener and how it treats clients.
    #[serde(default)]
    pub server: Server,
    /// The admin listener: /metrics, /healthz, /readyz, the dashboard and /admin/*.
    #[serde(default)]
    pub admin: AdminSpec,
    /// Where limiter state lives: in this process, or shared through Redis.
    #[serde(default)]
    pub store: StoreSpec,
    /// How the client address is found behind proxies.
    #[serde(default)]
    pub client_ip: ClientIp,
    /// Rate-limit header families sent on answers; [] for none.
    #[serde(default = "default_header_families")]
    pub response_headers: Vec<HeaderFamily>,
    /// Upstreams by name, used by routes' `upstream`.
    #[serde(default)]
    pub upstreams: BTreeMap<String, UpstreamSpec>,
    /// Keys and addresses refused on every route.
    #[serde(default)]
    pub deny: Deny,
    /// One line per request, on stderr (target `sluice::access`) or to a file; off
    /// when absent.
    #[serde(default)]
    pub access_log: Option<AccessLogConfig>,
    /// Envoy's rate limit service (`ShouldRateLimit` over h2c), from
    /// envoyproxy/ratelimit's configuration files; off when absent.
    #[serde(default)]
    pub rls: Option<RlsSpec>,
    /// Who issues the JWTs that routes with `jwt` verify (keys from claims).
    #[serde(default)]
    pub jwt: JwtSpec,
    /// Routes in order; the first that matches a request takes it.
    pub routes: Vec<RouteSpec>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AccessLogConfig {
    /// `json` (one object per line) or `combined` (nginx's, with sluice's fields
    /// after it).
    #[serde(default)]
    pub format: AccessFormat,
    /// The share of forwarded requests logged, 0 to 1; refused requests are always
    /// logged (on stderr within a budget of lines a second, to a file every one).
    #[serde(default = "one")]
    pub sample: f64,
    /// Write the lines to this file (appended to, created if absent) instead of
    /// stderr; SIGUSR1 opens it again, for log rotation.
    #[serde(default)]
    pub path: Option<Text>,
    /// With `path`: bytes of lines gathered before a write (default 64KiB; 0 writes
    /// each line at once).
    #[serde(default)]
    pub buffer: Option<Size>,
    /// With `path`: the longest a line waits in the buffer (default 1s).
    #[serde(default)]
    pub flush: Option<Dur>,
}

fn one() -> f64 {
    1.0
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum AccessFormat {
    #[default]
    Json,
    Combined,
}

fn default_header_families() -> Vec<HeaderFamily> {
    vec![HeaderFamily::Ietf, HeaderFamily::XRatelimit]
}

// === server, admin ===

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Server {
    /// Address of the gateway port (HTTP/1.1 and h2c; TLS with `tls`).
    pub listen: Addr,
    /// A client must send its whole request head within this, or gets 408.
    pub request_header_timeout: Dur,
    /// Larger request bodies get 413.
    pub max_request_body: Size,
    /// On routes whose key reads the body (`form:NAME`, `json:/POINTER`), up to this
    /// much of it is read before the decision; a larger body makes that key missing.
    /// At most 1MiB.
    pub max_key_body: Size,
    /// On SIGTERM, how long requests in flight may take to finish.
    pub shutdown_grace: Dur,
    /// Client connections open at once; more wait in the kernel backlog.
    pub max_connections: Num<usize>,
    /// Client connections from one address at once; more are closed.
    pub max_connections_per_ip: Num<usize>,
    /// A connection with no request in flight this long is closed.
    pub idle_timeout: Dur,
    /// Writing to the client making no progress this long closes the connection.
    pub send_timeout: Dur,
    /// The client's request body making no progress this long fails the request (408).
    pub request_body_timeout: Dur,
    /// Up to this much of a request body is read before an upstream connection is
    /// taken for it (a body that fits, whole), so a slow upload holds none meanwhile;
    /// at most 1MiB, 0 to take the connection at once.
    pub request_buffer: Size,
    /// The most request body bytes read ahead (`request_buffer`) held at once in
    /// the whole process; a request whose read-ahead would pass it is answered 503.
    pub max_buffered_bytes: Size,
    /// A spliced tunnel with no byte either way this long is closed.
    pub tunnel_idle_timeout: Dur,
    /// Largest request head; larger gets 431.
    pub max_header_bytes: Size,
    /// `Upgrade` tokens passed through to upstreams (compared case-insensitively).
    pub upgrades: Vec<Text>,
    /// Terminate TLS on the gateway port.
    pub tls: Option<Tls>,
    /// Threads serving the gateway port, each with its own runtime; default: one per
    /// core the process may run on.
    pub workers: Option<Num<usize>>,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            listen: Addr::literal("0.0.0.0:8080"),
            request_header_timeout: Dur::secs(10),
            max_request_body: Size(10 * 1024 * 1024),
            max_key_body: Size(64 * 1024),
            shutdown_grace: Dur::secs(30),
            max_connections: Num(10_000),
            max_connections_per_ip: Num(256),
            idle_timeout: Dur::secs(60),
            send_timeout: Dur::secs(60),
            request_body_timeout: Dur::secs(60),
            request_buffer: Size(64 * 1024),
            max_buffered_bytes: Size(16 * 1024 * 1024),
            tunnel_idle_timeout: Dur::secs(60),
            max_header_bytes: Size(32 * 1024),
            upgrades: vec![Text::literal("websocket")],
            tls: None,
            workers: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    /// PEM certificate chain file.
    pub cert: Text,
    /// PEM private key file.
    pub key: Text,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "Admin", deny_unknown_fields, default)]
pub struct AdminSpec {
    /// Address of the admin listener; off loopback it needs `token`.
    pub listen: Addr,
    /// Bearer token for /admin/*; required when `listen` is not loopback.
    pub token: Option<Text>,
    /// Admin connections from one address at once; more are closed, so one client
    /// cannot keep /healthz and /metrics from answering.
    pub max_connections_per_ip: Num<usize>,
    /// An admin connection must send its first request head within this, or it is
    /// closed.
    pub request_header_timeout: Dur,
    /// An admin connection with no request in flight this long is closed.
    pub idle_timeout: Dur,
}

impl Default for AdminSpec {
    fn default() -> Self {
        AdminSpec {
            listen: Addr::literal("127.0.0.1:9091"),
            token: None,
            max_connections_per_ip: Num(16),
            request_header_timeout: Dur::secs(5),
            idle_timeout: Dur::secs(30),
        }
    }
}

/// `rls:`: where Envoy's rate limit service listens and where its domains are.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "Rls", deny_unknown_fields)]
pub struct RlsSpec {
    /// Address of the gRPC listener (h2c) that answers
    /// `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`.
    pub listen: Addr,
    /// The folder of envoyproxy/ratelimit's YAML files (`*.yaml`, `*.yml`), one
    /// domain each; watched and reloaded.
    pub config_dir: Text,
    /// Answer with `RateLimit-Limit`, `RateLimit-Remaining` and `RateLimit-Reset`
    /// for the descriptor closest to its limit (envoyproxy/ratelimit's
    /// `LIMIT_RESPONSE_HEADERS_ENABLED`).
    #[serde(default)]
    pub response_headers: bool,
}

// === store ===

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename = "Backend", rename_all = "snake_case")]
pub enum BackendSpec {
    #[default]
    Memory,
    Redis,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename = "Store", deny_unknown_fields, default)]
pub struct StoreSpec {
    /// `memory` (this process) or `redis` (shared by every instance).
    pub backend: BackendSpec,
    /// The memory store (also the fallback of `on_error: local`).
    pub memory: MemoryStoreSpec,
    /// The Redis store; needs `url`, `cluster` or `sentinel`.
    pub redis: Option<RedisStoreSpec>,
    /// While the store fails: `local` (this instance's memory), `allow`, or `deny` (503).
    pub on_error: OnError,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "MemoryStore", deny_unknown_fields, default)]
pub struct MemoryStoreSpec {
    /// Keys kept; the least recently used are evicted beyond this.
    pub max_keys: Num<usize>,
}

impl Default for MemoryStoreSpec {
    fn default() -> Self {
        MemoryStoreSpec {
            max_keys: Num(1_000_000),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "RedisStore", deny_unknown_fields, default)]
pub struct RedisStoreSpec {
    /// A single Redis: redis://host:port/db or rediss:// for TLS.
    pub url: Option<Text>,
    /// Seed nodes of a Redis Cluster (instead of `url`).
    pub cluster: Option<Vec<Text>>,
    /// The primary that Redis Sentinel names, followed through failovers (instead of
    /// `url`).
    pub sentinel: Option<RedisSentinel>,
    /// Per limiter call; slower counts as a store error.
    pub timeout: Dur,
    /// Prefix of every key sluice writes.
    pub key_prefix: Text,
}

impl Default for RedisStoreSpec {
    fn default() -> Self {
        RedisStoreSpec {
            url: None,
            cluster: None,
            sentinel: None,
            timeout: Dur::millis(50),
            key_prefix: Text::literal("sluice:"),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RedisSentinel {
    /// The name the sentinels monitor the primary under (`sentinel monitor <name>`).
    pub master: Text,
    /// The sentinels: redis://host:26379, or rediss:// for TLS (then the primary too);
    /// credentials in these URLs are the sentinels' own.
    pub nodes: Vec<Text>,
    /// The primary's user (ACL), if it needs one.
    #[serde(default)]
    pub username: Option<Text>,
    /// The primary's password (`requirepass` or the user's).
    #[serde(default)]
    pub password: Option<Text>,
    /// The primary's database number.
    #[serde(default)]
    pub db: Num<u16>,
}

// === client_ip, headers, upstreams, deny ===

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ClientIp {
    /// Peers whose X-Forwarded-For is believed.
    pub trusted_proxies: Vec<Net>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum HeaderFamily {
    #[serde(rename = "ietf")]
    Ietf,
    #[serde(rename = "x-ratelimit")]
    XRatelimit,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "Upstream", deny_unknown_fields)]
pub struct UpstreamSpec {
    /// http:// or https:// base URLs, taken in turn.
    pub targets: Vec<Text>,
    /// Connecting to a target takes at most this, else 502.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    /// The whole response head must arrive within this, else 504.
    #[serde(default = "default_upstream_timeout")]
    pub timeout: Dur,
    /// The longest silence between two reads of a response body (as nginx's
    /// `proxy_read_timeout`); then the response is cut and the upstream connection
    /// closed.
    #[serde(default = "default_read_timeout")]
    pub read_timeout: Dur,
    /// Extra CA certificate (PEM) trusted for `https://` targets, besides the
    /// built-in web roots; for upstreams with a private CA.
    #[serde(default)]
    pub tls_ca: Option<Text>,
    /// At most this many connections to the upstream, split evenly across its
    /// targets.
    #[serde(default = "default_upstream_connections")]
    pub max_connections: Num<usize>,
    /// At startup and when a reload builds the upstream anew, open one connection
    /// to each target and log a warning for each that takes none; `false` for an
    /// upstream that must see no connection without a request.
    #[serde(default = "yes")]
    pub probe: bool,
    /// What the upstream is spoken to in, whatever the client speaks.
    #[serde(default)]
    pub protocol: UpstreamProtocol,
    /// Connections to a target that fail (refused, connect timeout, TLS) this many
    /// times within `fail_timeout` leave it out for `fail_timeout` (nginx's
    /// `max_fails`); 0 never leaves a target out.
    #[serde(default = "default_max_fails")]
    pub max_fails: Num<u32>,
    /// The window `max_fails` are counted in, and how long a target is then left
    /// out before one request tries it again (nginx's `fail_timeout`).
    #[serde(default = "default_fail_timeout")]
    pub fail_timeout: Dur,
    /// Active checks: a GET of `path` on each target every `interval`; two failed
    /// in a row leave it out, two good ones bring it back.
    #[serde(default)]
    pub health_check: Option<HealthCheck>,
}

/// `upstreams.*.health_check`.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HealthCheck {
    /// The path asked for (GET); a 2xx or 3xx answer is good.
    pub path: Text,
    /// How often each target is asked.
    #[serde(default = "default_check_interval")]
    pub interval: Dur,
    /// An answer later than this is a failed check.
    #[serde(default = "default_check_timeout")]
    pub timeout: Dur,
}

fn default_max_fails() -> Num<u32> {
    Num(1)
}

fn default_fail_timeout() -> Dur {
    Dur::secs(10)
}

fn default_check_interval() -> Dur {
    Dur::secs(5)
}

fn default_check_timeout() -> Dur {
    Dur::secs(1)
}

/// `upstreams.*.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamProtocol {
    /// HTTP/1.1, connections kept alive between requests.
    #[default]
    Http1,
    /// HTTP/2 with prior knowledge on a cleartext (`http://`) target: gRPC services.
    H2c,
    /// HTTP/2 over TLS (`https://`), offered by ALPN.
    H2,
    /// Over TLS, whichever of HTTP/2 and HTTP/1.1 the target picks by ALPN;
    /// HTTP/1.1 on `http://` targets.
    Auto,
}

fn yes() -> bool {
    true
}

fn default_upstream_connections() -> Num<usize> {
    Num(1024)
}

fn default_connect_timeout() -> Dur {
    Dur::secs(2)
}

fn default_upstream_timeout() -> Dur {
    Dur::secs(30)
}

fn default_read_timeout() -> Dur {
    Dur::secs(60)
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct Deny {
    /// Addresses and CIDR blocks refused on every route.
    pub ips: Vec<Net>,
    /// Client keys refused on every route.
    pub keys: Vec<Text>,
    /// Status of a denied request.
    pub status: Num<u16>,
    /// Memory store only: file that keeps API-added entries across restarts.
    pub state_file: Option<Text>,
    /// Most dynamic entries (admin API and bans together) kept, here and in Redis; a
    /// new one beyond it replaces the entry closest to expiry.
    pub max_entries: Num<usize>,
}

impl Default for Deny {
    fn default() -> Self {
        Deny {
            ips: Vec::new(),
            keys: Vec::new(),
            status: Num(403),
            state_file: None,
            max_entries: Num(100_000),
        }
    }
}

// === jwt ===

#[derive(Debug, Clone, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtSpec {
    /// Token issuers by name, used by routes' `jwt.provider`.
    #[serde(default)]
    pub providers: BTreeMap<String, JwtProviderSpec>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct JwtProviderSpec {
    /// A JWKS fetched over http(s); refreshed every 10 minutes and on an unknown kid.
    #[serde(default)]
    pub jwks_url: Option<Text>,
    /// A JWKS file, read again when it changes.
    #[serde(default)]
    pub jwks_file: Option<Text>,
    /// An HMAC secret (HS256/384/512), usually `${ENV_VAR}`.
    #[serde(default)]
    pub secret: Option<Text>,
    /// The `iss` a token must have; not checked when absent.
    #[serde(default)]
    pub issuer: Option<Text>,
    /// A token's `aud` must name one of these; not checked when empty.
    #[serde(default)]
    pub audiences: Vec<Text>,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default = "default_leeway")]
    pub leeway: Dur,
    /// Verified tokens remembered (until they expire).
    #[serde(default = "default_jwt_cache")]
    pub cache_size: Num<usize>,
}

fn default_leeway() -> Dur {
    Dur::secs(60)
}

fn default_jwt_cache() -> Num<usize> {
    Num(10_000)
}

/// A route's `jwt`: the provider that verifies its tokens, and where they are.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RouteJwtSpec {
    /// A name under `jwt.providers`.
    pub provider: Text,
    /// false: a request without a token falls to `missing_key` (a bad token is
    /// still 401).
    #[serde(default = "default_true")]
    pub required: bool,
    /// Read the token from this header (the whole value, or after `Bearer `)
    /// instead of `Authorization`.
    #[serde(default)]
    pub header: Option<Text>,
    /// Read the token from this cookie instead of `Authorization`.
    #[serde(default)]
    pub cookie: Option<Text>,
}

fn default_true() -> bool {
    true
}

// === routes ===

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "Route", deny_unknown_fields)]
pub struct RouteSpec {
    /// Unique name, used in metrics, headers and logs.
    pub name: Text,
    /// What requests the route takes; every given field must hold.
    #[serde(rename = "match", default)]
    pub matcher: Match,
    /// Name of the upstream to forward to (or use `respond`).
    #[serde(default)]
    pub upstream: Option<Text>,
    /// Answer from sluice itself instead of forwarding.
    #[serde(default)]
    pub respond: Option<Respond>,
    /// The client key: ip, header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER,
    /// jwt:CLAIM, jwt:/POINTER (with `jwt`),
    /// global, or a list of these.
    #[serde(default)]
    pub key: KeyText,
    /// A request without its key: `reject` (400) or `ip` (count it by address).
    #[serde(default)]
    pub missing_key: MissingKey,
    /// How the key is compared: `none` (as sent), `casefold` (Unicode NFKC case
    /// folding: Carl and CARL are one key) or `email` (casefold, and a +tag dropped
    /// from the local part). Deny-list keys are matched in the same form.
    #[serde(default)]
    pub normalize_key: Normalize,
    /// Every limit must admit a request; it is then charged to all of them.
    #[serde(default)]
    pub limits: Vec<Limit>,
    /// Other limits for named keys (tiers).
    #[serde(default)]
    pub overrides: Vec<Override>,
    /// A refused request: `reject` (429) or `delay` (token_bucket and gcra only).
    #[serde(default)]
    pub on_limit: OnLimit,
    /// With `on_limit: delay`: wait at most this long, then 429.
    #[serde(default)]
    pub max_delay: Option<Dur>,
    /// Count and report refusals but forward every request.
    #[serde(default)]
    pub shadow: bool,
    /// Deny a key that keeps hitting the limit.
    #[serde(default)]
    pub ban: Option<Ban>,
    /// Verify a JWT on every request before its key is read (`key: jwt:CLAIM`).
    #[serde(default)]
    pub jwt: Option<RouteJwtSpec>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema, Default)]
#[serde(deny_unknown_fields)]
pub struct Match {
    /// Host, exact or `*.example.com`.
    #[serde(default)]
    pub host: Option<Text>,
    /// Exact path (normalised).
    #[serde(default)]
    pub path: Option<Text>,
    /// Path prefix.
    #[serde(default)]
    pub path_prefix: Option<Text>,
    /// Regular expression over the path.
    #[serde(default)]
    pub path_regex: Option<Text>,
    /// Methods, e.g. [GET, POST].
    #[serde(default)]
    pub methods: Option<Vec<Text>>,
    /// Header name to exact value, or "*" for present.
    #[serde(default)]
    pub headers: Option<BTreeMap<String, Text>>,
    /// `path`, `path_prefix` and `path_regex` compared ignoring case.
    #[serde(default)]
    pub case_insensitive: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Respond {
    /// Status code of the answer.
    #[serde(default = "default_respond_status")]
    pub status: Num<u16>,
    /// Body of the answer.
    #[serde(default)]
    pub body: Text,
    /// Extra response headers, e.g. `content-type`.
    #[serde(default)]
    pub headers: BTreeMap<String, Text>,
}

fn default_respond_status() -> Num<u16> {
    Num(200)
}

/// `ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, `form:NAME`, `json:/POINTER`,
/// `global`, or a list of these.
#[derive(Debug, Clone, Serialize, JsonSchema)]
#[serde(rename = "KeySpec", untagged)]
pub enum KeyText {
    One(Text),
    Composite(Vec<Text>),
}

impl Default for KeyText {
    fn default() -> Self {
        KeyText::One(Text::literal("ip"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    #[default]
    Reject,
    Delay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum AlgorithmName {
    FixedWindow,
    SlidingWindow,
    SlidingLog,
    TokenBucket,
    Gcra,
    Concurrency,
}

impl AlgorithmName {
    pub fn as_str(self) -> &'static str {
        match self {
            AlgorithmName::FixedWindow => "fixed_window",
            AlgorithmName::SlidingWindow => "sliding_window",
            AlgorithmName::SlidingLog => "sliding_log",
            AlgorithmName::TokenBucket => "token_bucket",
            AlgorithmName::Gcra => "gcra",
            AlgorithmName::Concurrency => "concurrency",
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    /// Name in headers and metrics; default `<algorithm>_<index>`.
    #[serde(default)]
    pub name: Option<Text>,
    /// fixed_window, sliding_window, sliding_log, token_bucket, gcra or concurrency.
    pub algorithm: AlgorithmName,
    /// fixed_window, sliding_window, sliding_log, concurrency: the most allowed.
    #[serde(default)]
    pub limit: Option<Num<u64>>,
    /// fixed_window, sliding_window, sliding_log: the window length; for fixed_window
    /// also `month`: calendar months, UTC, each ending at 00:00 UTC on the first of the
    /// next.
    #[serde(default)]
    pub window: Option<WindowSpec>,
    /// token_bucket, gcra: the refill rate, e.g. 10/s.
    #[serde(default)]
    pub rate: Option<RateSpec>,
    /// token_bucket, gcra: the bucket size; default the rate's count.
    #[serde(default)]
    pub burst: Option<Num<u64>>,
    /// Units a request takes (default 1); or `{response_header, default}`: what the
    /// upstream's response header says, charged when the response head arrives.
    #[serde(default)]
    pub cost: Option<Cost>,
    /// Which requests the limit counts: `{status: [401, 403, "5xx"]}` counts only
    /// those the upstream answered with a listed status, when the answer arrives
    /// (default: every admitted request, at admission).
    #[serde(default)]
    pub count: Option<Count>,
    /// concurrency: a slot not released within this is freed (default 1m).
    #[serde(default)]
    pub lease: Option<Dur>,
    /// On trial: counted and its refusals reported (decision `shadow`), but it
    /// never refuses; the route's other limits still do (default false).
    #[serde(default)]
    pub shadow: bool,
    /// The key this limit counts, in the grammar of the route's `key` (default the
    /// route's key): a login route limits per address and per account at once.
    #[serde(default)]
    pub key: Option<KeyText>,
    /// How this limit's own `key` is compared (as the route's `normalize_key`);
    /// only with `key`.
    #[serde(default)]
    pub normalize_key: Option<Normalize>,
    /// Redis store: units an instance takes from the shared count in one call and
    /// spends locally, at most this many (fixed_window, sliding_window, token_bucket,
    /// gcra; every limit of the list needs it). A hot key then costs one Redis call
    /// per `reserve` requests; up to instances × (reserve − 1) units may go unused.
    #[serde(default)]
    pub reserve: Option<Num<u64>>,
}

/// A limit's `cost`.
#[derive(Debug, Clone, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Cost {
    /// Units every request takes.
    Units(Num<u64>),
    /// What the upstream's response says the request cost.
    Response(ResponseCostSpec),
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(rename = "ResponseCost", deny_unknown_fields)]
pub struct ResponseCostSpec {
    /// The response header holding the units the request cost, e.g. x-usage-tokens.
    #[serde(default)]
    pub response_header: Option<Text>,
    /// RFC 6901 pointers into the response body (an `application/json` body, or
    /// each JSON `data:` event of a `text/event-stream`) to the units the request
    /// cost, e.g. /usage/total_tokens; several are summed.
    #[serde(default)]
    pub response_json: Option<Pointers>,
    /// With response_json: units charged at admission, and settled when the
    /// response ends: a number, or "json:/pointer" into the request's JSON body
    /// (e.g. json:/max_tokens).
    #[serde(default)]
    pub estimate: Option<EstimateSpec>,
    /// The units charged when the response does not say (default 1).
    #[serde(default)]
    pub default: Option<Num<u64>>,
}

/// `response_json`: one pointer or a list of them.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum Pointers {
    One(Text),
    Many(Vec<Text>),
}

impl Pointers {
    pub fn list(&self) -> &[Text] {
        match self {
            Pointers::One(p) => std::slice::from_ref(p),
            Pointers::Many(v) => v,
        }
    }
}

/// `estimate`: a number of units, or "json:/pointer" into the request's body.
#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(untagged)]
pub enum EstimateSpec {
    Units(Num<u64>),
    Read(Text),
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Count {
    /// Upstream statuses that count: codes (401) and classes ("5xx").
    pub status: Vec<Text>,
}

impl Limit {
    /// The units a request takes when they do not come from the response.
    pub fn units(&self) -> Option<u64> {
        match self.cost {
            Some(Cost::Units(n)) => Some(n.get()),
            _ => None,
        }
    }

    /// Whether the limit is charged from the upstream's response (`count` by status,
    /// or `cost` from a header) rather than at admission.
    pub fn from_response(&self) -> bool {
        self.count.is_some() || matches!(self.cost, Some(Cost::Response(_)))
    }

    /// The name a limit goes by: its `name`, or `<algorithm>_<index in its list>`.
    pub fn name_at(&self, index: usize) -> String {
        match &self.name {
            Some(n) => n.to_string(),
            None => format!("{}_{index}", self.algorithm.as_str()),
        }
    }

    /// token_bucket and gcra take `burst`, defaulting to the rate's count.
    pub fn effective_burst(&self) -> Option<u64> {
        match self.algorithm {
            AlgorithmName::TokenBucket | AlgorithmName::Gcra => {
                self.burst.map(|b| b.get()).or(self.rate.map(|r| r.count))
            }
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Override {
    /// Keys these limits apply to.
    #[serde(default)]
    pub keys: Vec<Text>,
    /// Or: verified JWT claims (name or /pointer → value) that must all hold.
    #[serde(default)]
    pub claims: BTreeMap<String, Text>,
    /// Their limits, instead of the route's.
    pub limits: Vec<Limit>,
}

#[derive(Debug, Clone, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Ban {
    /// Refusals that trigger a ban...
    pub after: Num<u64>,
    /// ...within this long.
    pub within: Dur,
    /// How long the ban lasts.
    #[serde(rename = "for")]
    pub duration: Dur,
}

// === values of several forms ===
//
// serde's `untagged` says only "data did not match any variant" when a value is
// none of its forms, at the enclosing mapping. These say which forms there are, at
// the value itself, and leave a form's own errors (an unset `${VAR}`, an unknown
// field of the mapping form) to that form.

/// What a value that matched no form was, in the operator's words.
fn found_scalar(v: impl std::fmt::Display) -> String {
    format!("found {:?}", v.to_string())
}

const KEY_FORMS: &str = "expected a key (ip, global, header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER) or a list of these";

impl<'de> Deserialize<'de> for KeyText {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, value::SeqAccessDeserializer, IntoDeserializer};
        struct Forms;
        impl<'de> de::Visitor<'de> for Forms {
            type Value = KeyText;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(KEY_FORMS)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyText, E> {
                Text::deserialize(v.into_deserializer()).map(KeyText::One)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KeyText, E> {
                Ok(KeyText::One(Text(v.to_string())))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KeyText, E> {
                Ok(KeyText::One(Text(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<KeyText, E> {
                Ok(KeyText::One(Text(v.to_string())))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<KeyText, E> {
                Ok(KeyText::One(Text(v.to_string())))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, seq: A) -> Result<KeyText, A::Error> {
                Vec::<KeyPart>::deserialize(SeqAccessDeserializer::new(seq))
                    .map(|parts| KeyText::Composite(parts.into_iter().map(|p| p.0).collect()))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<KeyText, A::Error> {
                Err(de::Error::custom(format!("{KEY_FORMS}, found a mapping")))
            }
            fn visit_unit<E: de::Error>(self) -> Result<KeyText, E> {
                Err(E::custom(format!("{KEY_FORMS}, found nothing")))
            }
        }
        d.deserialize_any(Forms)
    }
}

/// One part of a composite key: a scalar, never a list or a mapping.
struct KeyPart(Text);

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, IntoDeserializer};
        const PART: &str = "expected a key part like ip or header:NAME";
        struct Part;
        impl<'de> de::Visitor<'de> for Part {
            type Value = KeyPart;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(PART)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<KeyPart, E> {
                Text::deserialize(v.into_deserializer()).map(KeyPart)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<KeyPart, E> {
                Ok(KeyPart(Text(v.to_string())))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<KeyPart, E> {
                Ok(KeyPart(Text(v.to_string())))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<KeyPart, E> {
                Ok(KeyPart(Text(v.to_string())))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<KeyPart, E> {
                Ok(KeyPart(Text(v.to_string())))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<KeyPart, A::Error> {
                Err(de::Error::custom(format!("{PART}, found a list")))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, _: A) -> Result<KeyPart, A::Error> {
                Err(de::Error::custom(format!("{PART}, found a mapping")))
            }
            fn visit_unit<E: de::Error>(self) -> Result<KeyPart, E> {
                Err(E::custom(format!("{PART}, found nothing")))
            }
        }
        d.deserialize_any(Part)
    }
}

const COST_FORMS: &str =
    "expected a cost: a whole number of units (cost: 3), {response_header: NAME, default: N} or {response_json: POINTER, estimate: N, default: N}";

impl<'de> Deserialize<'de> for Cost {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{self, value::MapAccessDeserializer};
        struct Forms;
        impl Forms {
            fn units<E: de::Error>(text: &str) -> Result<Cost, E> {
                let text = super::value::interpolate(text).map_err(E::custom)?;
                match text.trim().parse::<u64>() {
                    Ok(n) => Ok(Cost::Units(Num(n))),
                    Err(_) => Err(E::custom(format!("{COST_FORMS}, {}", found_scalar(text)))),
                }
            }
        }
        impl<'de> de::Visitor<'de> for Forms {
            type Value = Cost;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(COST_FORMS)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Cost, E> {
                Forms::units(v)
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Cost, E> {
                Ok(Cost::Units(Num(v)))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Cost, E> {
                Forms::units(&v.to_string())
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Cost, E> {
                Forms::units(&v.to_string())
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Cost, E> {
                Forms::units(&v.to_string())
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, _: A) -> Result<Cost, A::Error> {
                Err(de::Error::custom(format!("{COST_FORMS}, found a list")))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<Cost, A::Error> {
                ResponseCostSpec::deserialize(MapAccessDeserializer::new(map)).map(Cost::Response)
            }
            fn visit_unit<E: de::Error>(self) -> Result<Cost, E> {
                Err(E::custom(format!("{COST_FORMS}, found nothing")))
            }
        }
        d.deserialize_any(Forms)
    }
}
