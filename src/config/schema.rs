//! The configuration file as written: serde types that mirror `rules.yaml` field for
//! field. Unknown fields are errors. Values are checked for form here (durations,
//! rates, addresses); cross-field rules live in `validate`, and `compile` turns the
//! result into the runtime structures the request path reads.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::value::{Addr, Dur, Net, Num, RateSpec, Size, Text};
// Enums the runtime reads as they are written.
pub use crate::client::MissingKey;
pub use crate::limit::OnError;

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct File {
    #[serde(default)]
    pub server: Server,
    #[serde(default)]
    pub admin: Admin,
    #[serde(default)]
    pub store: Store,
    #[serde(default)]
    pub client_ip: ClientIp,
    #[serde(default = "default_header_families")]
    pub response_headers: Vec<HeaderFamily>,
    #[serde(default)]
    pub upstreams: BTreeMap<String, Upstream>,
    #[serde(default)]
    pub deny: Deny,
    pub routes: Vec<Route>,
}

fn default_header_families() -> Vec<HeaderFamily> {
    vec![HeaderFamily::Ietf, HeaderFamily::XRatelimit]
}

// === server, admin ===

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Server {
    pub listen: Addr,
    pub request_header_timeout: Dur,
    pub max_request_body: Size,
    pub shutdown_grace: Dur,
    pub max_connections: Num<usize>,
    pub max_connections_per_ip: Num<usize>,
    pub idle_timeout: Dur,
    /// Writing to the client making no progress this long closes the connection.
    pub send_timeout: Dur,
    /// The client's request body making no progress this long fails the request (408).
    pub request_body_timeout: Dur,
    /// A spliced tunnel with no byte either way this long is closed.
    pub tunnel_idle_timeout: Dur,
    pub max_header_bytes: Size,
    /// `Upgrade` tokens passed through to upstreams (compared case-insensitively).
    pub upgrades: Vec<Text>,
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
            shutdown_grace: Dur::secs(30),
            max_connections: Num(10_000),
            max_connections_per_ip: Num(256),
            idle_timeout: Dur::secs(60),
            send_timeout: Dur::secs(60),
            request_body_timeout: Dur::secs(60),
            tunnel_idle_timeout: Dur::secs(60),
            max_header_bytes: Size(32 * 1024),
            upgrades: vec![Text::literal("websocket")],
            tls: None,
            workers: None,
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Tls {
    pub cert: Text,
    pub key: Text,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Admin {
    pub listen: Addr,
    pub token: Option<Text>,
}

impl Default for Admin {
    fn default() -> Self {
        Admin {
            listen: Addr::literal("127.0.0.1:9091"),
            token: None,
        }
    }
}

// === store ===

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Backend {
    #[default]
    Memory,
    Redis,
}

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Store {
    pub backend: Backend,
    pub memory: MemoryStore,
    pub redis: Option<RedisStore>,
    pub on_error: OnError,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MemoryStore {
    pub max_keys: Num<usize>,
}

impl Default for MemoryStore {
    fn default() -> Self {
        MemoryStore {
            max_keys: Num(1_000_000),
        }
    }
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RedisStore {
    pub url: Option<Text>,
    pub cluster: Option<Vec<Text>>,
    pub timeout: Dur,
    pub key_prefix: Text,
}

impl Default for RedisStore {
    fn default() -> Self {
        RedisStore {
            url: None,
            cluster: None,
            timeout: Dur::millis(50),
            key_prefix: Text::literal("sluice:"),
        }
    }
}

// === client_ip, headers, upstreams, deny ===

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct ClientIp {
    pub trusted_proxies: Vec<Net>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
pub enum HeaderFamily {
    #[serde(rename = "ietf")]
    Ietf,
    #[serde(rename = "x-ratelimit")]
    XRatelimit,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Upstream {
    pub targets: Vec<Text>,
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout: Dur,
    #[serde(default = "default_upstream_timeout")]
    pub timeout: Dur,
    /// Extra CA certificate (PEM) trusted for `https://` targets, besides the
    /// built-in web roots; for upstreams with a private CA.
    #[serde(default)]
    pub tls_ca: Option<Text>,
    /// At most this many connections to the upstream, split evenly across its
    /// targets.
    #[serde(default = "default_upstream_connections")]
    pub max_connections: Num<usize>,
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

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Deny {
    pub ips: Vec<Net>,
    pub keys: Vec<Text>,
    pub status: Num<u16>,
    pub state_file: Option<Text>,
}

impl Default for Deny {
    fn default() -> Self {
        Deny {
            ips: Vec::new(),
            keys: Vec::new(),
            status: Num(403),
            state_file: None,
        }
    }
}

// === routes ===

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    pub name: Text,
    #[serde(rename = "match", default)]
    pub matcher: Match,
    #[serde(default)]
    pub upstream: Option<Text>,
    #[serde(default)]
    pub respond: Option<Respond>,
    #[serde(default)]
    pub key: KeySpec,
    #[serde(default)]
    pub missing_key: MissingKey,
    #[serde(default)]
    pub limits: Vec<Limit>,
    #[serde(default)]
    pub overrides: Vec<Override>,
    #[serde(default)]
    pub on_limit: OnLimit,
    #[serde(default)]
    pub max_delay: Option<Dur>,
    #[serde(default)]
    pub shadow: bool,
    #[serde(default)]
    pub ban: Option<Ban>,
}

#[derive(Debug, Clone, Deserialize, Serialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Match {
    #[serde(default)]
    pub host: Option<Text>,
    #[serde(default)]
    pub path: Option<Text>,
    #[serde(default)]
    pub path_prefix: Option<Text>,
    #[serde(default)]
    pub path_regex: Option<Text>,
    #[serde(default)]
    pub methods: Option<Vec<Text>>,
    #[serde(default)]
    pub headers: Option<BTreeMap<String, Text>>,
    /// `path`, `path_prefix` and `path_regex` compared ignoring case.
    #[serde(default)]
    pub case_insensitive: bool,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Respond {
    #[serde(default = "default_respond_status")]
    pub status: Num<u16>,
    #[serde(default)]
    pub body: Text,
    /// Extra response headers, e.g. `content-type`.
    #[serde(default)]
    pub headers: BTreeMap<String, Text>,
}

fn default_respond_status() -> Num<u16> {
    Num(200)
}

/// `ip`, `header:NAME`, `query:NAME`, `cookie:NAME`, `global`, or a list of these.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(untagged)]
pub enum KeySpec {
    One(Text),
    Composite(Vec<Text>),
}

impl Default for KeySpec {
    fn default() -> Self {
        KeySpec::One(Text::literal("ip"))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum OnLimit {
    #[default]
    Reject,
    Delay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
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

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Limit {
    #[serde(default)]
    pub name: Option<Text>,
    pub algorithm: AlgorithmName,
    #[serde(default)]
    pub limit: Option<Num<u64>>,
    #[serde(default)]
    pub window: Option<Dur>,
    #[serde(default)]
    pub rate: Option<RateSpec>,
    #[serde(default)]
    pub burst: Option<Num<u64>>,
    #[serde(default)]
    pub cost: Option<Num<u64>>,
    #[serde(default)]
    pub lease: Option<Dur>,
}

impl Limit {
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

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Override {
    pub keys: Vec<Text>,
    pub limits: Vec<Limit>,
}

#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Ban {
    pub after: Num<u64>,
    pub within: Dur,
    #[serde(rename = "for")]
    pub duration: Dur,
}
