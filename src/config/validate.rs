//! The rules serde cannot express: cross-field constraints, value ranges, names that
//! must be unique or must exist. Every problem is collected (not just the first),
//! located at the YAML node that causes it, and says what was expected.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::path::Path;

use http::{HeaderName, HeaderValue, Method, Uri};

use super::error::{ConfigError, ConfigWarning};
use super::locate::{field, item, Index};
use super::schema::{
    AlgorithmName, BackendSpec, Cost, EstimateSpec, File, KeyText, Limit, Match, MissingKey,
    OnLimit, Pointers, ResponseCostSpec, RouteSpec, UpstreamProtocol,
};
use super::value::{Dur, Text, WindowSpec};

/// Above this a limit's count could not be kept exactly by the Redis store's Lua,
/// whose numbers are doubles (exact up to 2^53); the margin leaves room for sums.
pub const MAX_LIMIT: u64 = 1 << 40;

/// token_bucket keeps tokens scaled by the rate's period in microseconds, so
/// `burst × period_us` is the largest number it stores; it must stay exact in a
/// double with room to spare.
pub const MAX_BURST_TIMES_PERIOD_US: u128 = 1 << 50;

/// Check `file` (deserialized from the text `index` was built from, read from
/// `path`) and return every problem found, in file order.
pub fn validate(file: &File, index: &Index, path: &Path) -> Vec<ConfigError> {
    let mut c = Checker {
        index,
        path,
        errors: Vec::new(),
    };
    c.server(file);
    c.admin(file);
    c.access_log(file);
    c.store(file);
    c.upstreams(file);
    c.deny(file);
    c.jwt_providers(file);
    c.routes(file);
    c.reserves(file);
    let mut errors = c.errors;
    // Stable: problems at one node keep the order they were found in.
    errors.sort_by_key(|e| (e.line, e.col));
    errors
}

/// Settings that are valid but that any client can defeat, located like errors, in
/// file order: trusted proxies that cover every address (any client then chooses
/// its address and escapes the per-address connection cap), keys read from
/// headers that clients write (`X-Forwarded-For`, `Forwarded`, `X-Real-IP`), and
/// routes an earlier route takes every request of.
pub fn warnings(file: &File, index: &Index, path: &Path) -> Vec<ConfigWarning> {
    let mut c = Checker {
        index,
        path,
        errors: Vec::new(),
    };
    c.trusted_everyone(file);
    for (i, route) in file.routes.iter().enumerate() {
        let base = item("routes", i);
        let mut keys = vec![(format!("{base}.key"), &route.key)];
        let lists = std::iter::once((format!("{base}.limits"), &route.limits)).chain(
            route.overrides.iter().enumerate().map(|(j, o)| {
                (
                    format!("{}.limits", item(&format!("{base}.overrides"), j)),
                    &o.limits,
                )
            }),
        );
        for (lp, list) in lists {
            c.counted_in_flight(&lp, list, &route.key);
            for (j, l) in list.iter().enumerate() {
                if let Some(k) = &l.key {
                    keys.push((format!("{}.key", item(&lp, j)), k));
                }
                if file.store.backend == BackendSpec::Memory
                    && matches!(l.window, Some(WindowSpec::Month))
                {
                    c.at(
                        &format!("{}.window", item(&lp, j)),
                        "window: month on the memory store starts afresh when sluice restarts or the key is evicted (store.memory.max_keys); a month that must hold needs backend: redis",
                    );
                }
            }
        }
        if route.missing_key == MissingKey::Ip && keys.iter().any(|(_, k)| reads_body(k)) {
            c.at(
                &format!("{base}.missing_key"),
                "a key read from the body (form:, json:) with missing_key: ip: a request whose body is not read (another type, larger than server.max_key_body, malformed) is counted by its address, and the deny list's entries for the key never see it",
            );
        }
        for (kp, key) in keys {
            match key {
                KeyText::One(part) => c.client_written_key(&kp, part),
                KeyText::Composite(parts) => {
                    for (j, part) in parts.iter().enumerate() {
                        c.client_written_key(&item(&kp, j), part);
                    }
                }
            }
        }
    }
    c.unreachable_routes(file);
    let mut found = c.errors;
    found.sort_by_key(|e| (e.line, e.col));
    found.into_iter().map(ConfigWarning).collect()
}

/// Whether every request `b` matches, `a` matches too. Sure answers only: a
/// regular expression covers only the same one, with the same case rule.
fn covers(a: &Match, b: &Match) -> bool {
    // `a`'s text condition holds for every path `b` lets through when `b`'s own
    // text is `a`'s (a prefix of it, with `prefix`) under `a`'s case rule, and `b`
    // is no more lenient about case than `a`.
    let text = |want: &str, have: &str, prefix: bool| {
        if b.case_insensitive && !a.case_insensitive {
            return false;
        }
        let have = if prefix {
            match have.get(..want.len()) {
                Some(h) => h,
                None => return false,
            }
        } else {
            have
        };
        if a.case_insensitive {
            have.eq_ignore_ascii_case(want)
        } else {
            have == want
        }
    };
    let paths = [b.path.as_deref(), b.path_prefix.as_deref()];
    if let Some(p) = &a.path {
        if !b.path.as_deref().is_some_and(|q| text(p, q, false)) {
            return false;
        }
    }
    if let Some(p) = &a.path_prefix {
        if !paths.iter().flatten().any(|q| text(p, q, true)) {
            return false;
        }
    }
    if let Some(re) = &a.path_regex {
        if b.path_regex.as_ref().map(|r| r.as_str()) != Some(re.as_str())
            || a.case_insensitive != b.case_insensitive
        {
            return false;
        }
    }
    // Methods as the request path sees them: GET takes HEAD too.
    let methods = |m: &Option<Vec<Text>>| {
        m.as_ref().map(|ms| {
            let mut up: Vec<String> = ms.iter().map(|s| s.to_ascii_uppercase()).collect();
            if up.iter().any(|s| s == "GET") {
                up.push("HEAD".into());
            }
            up
        })
    };
    if let Some(want) = methods(&a.methods) {
        match methods(&b.methods) {
            Some(have) if have.iter().all(|m| want.contains(m)) => {}
            _ => return false,
        }
    }
    if let Some(h) = &a.host {
        let Some(g) = &b.host else { return false };
        let (h, g) = (h.to_ascii_lowercase(), g.to_ascii_lowercase());
        let ok = match h.strip_prefix('*') {
            // `*.example.com` takes `api.example.com` and `*.eu.example.com`.
            Some(sfx) => {
                let g = g.strip_prefix('*').unwrap_or(&g);
                g.len() > sfx.len() && g.ends_with(sfx) || g == sfx && g.starts_with('.')
            }
            None => g == h,
        };
        if !ok {
            return false;
        }
    }
    let none = BTreeMap::new();
    let have = b.headers.as_ref().unwrap_or(&none);
    a.headers.iter().flatten().all(|(name, want)| {
        let got = have
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str());
        match got {
            None => false,
            Some(_) if want.as_str() == "*" => true,
            Some(v) => v == want.as_str(),
        }
    })
}

/// A key that no request can carry: the request path refuses it with 400.
const UNPRINTABLE_KEY: &str = "a key with a control, format, private-use or unassigned character, or white space around it, never matches: no request has such a key";

/// Headers any client can write, whatever sluice does with them on the way.
const CLIENT_WRITTEN: [&str; 3] = ["x-forwarded-for", "forwarded", "x-real-ip"];

impl Checker<'_> {
    fn trusted_everyone(&mut self, file: &File) {
        let list = "client_ip.trusted_proxies";
        let nets: Vec<ipnet::IpNet> = file
            .client_ip
            .trusted_proxies
            .iter()
            .map(|n| crate::identity::canonical_net(n.0))
            .collect();
        for (family, v4) in [("IPv4", true), ("IPv6", false)] {
            let of_family = |n: &&ipnet::IpNet| matches!(n, ipnet::IpNet::V4(_)) == v4;
            let message = format!("trusted_proxies cover every {family} address: any client can choose its address with X-Forwarded-For, and none is held to max_connections_per_ip");
            // One entry that is the whole space: point at it; else the list, when
            // its entries together cover it.
            if let Some(i) = nets
                .iter()
                .position(|n| of_family(&n) && n.prefix_len() == 0)
            {
                self.at(&item(list, i), message);
                continue;
            }
            let family_nets: Vec<ipnet::IpNet> = nets.iter().filter(of_family).copied().collect();
            if ipnet::IpNet::aggregate(&family_nets)
                .iter()
                .any(|n| n.prefix_len() == 0)
            {
                self.at(list, message);
            }
        }
    }

    /// A route an earlier one takes every request of (`covers`) is never reached.
    fn unreachable_routes(&mut self, file: &File) {
        for (j, route) in file.routes.iter().enumerate() {
            let earlier = file.routes[..j]
                .iter()
                .position(|e| covers(&e.matcher, &route.matcher));
            if let Some(i) = earlier {
                self.at(
                    &format!("{}.match", item("routes", j)),
                    format!(
                        "route {j} ({}) is never reached: route {i} ({}), before it, matches every request it matches, and the first route that matches takes the request",
                        route.name.as_str(),
                        file.routes[i].name.as_str()
                    ),
                );
            }
        }
    }

    /// A limit of `list` (at `lp`) that counts by status is charged when the answer
    /// arrives: the requests in flight meanwhile all pass its check, unless a
    /// concurrency limit of the same list holds them on the same key.
    fn counted_in_flight<'f>(&mut self, lp: &str, list: &'f [Limit], route_key: &'f KeyText) {
        fn key_of<'f>(l: &'f Limit, route_key: &'f KeyText) -> Vec<&'f str> {
            key_parts(l.key.as_ref().unwrap_or(route_key))
        }
        let key_of = |l: &'f Limit| key_of(l, route_key);
        let held: Vec<Vec<&str>> = list
            .iter()
            .filter(|l| l.algorithm == AlgorithmName::Concurrency)
            .map(key_of)
            .collect();
        for (j, l) in list.iter().enumerate() {
            if l.count.is_none() || held.contains(&key_of(l)) {
                continue;
            }
            self.at(
                &format!("{}.count", item(lp, j)),
                format!("limit {} counts by status, charged when the answer arrives: without a concurrency limit on the same key, up to limit + requests in flight - 1 are admitted", l.name_at(j)),
            );
        }
    }

    fn client_written_key(&mut self, path: &str, part: &Text) {
        let Some(name) = part.strip_prefix("header:") else {
            return;
        };
        if CLIENT_WRITTEN.iter().any(|h| h.eq_ignore_ascii_case(name)) {
            self.at(
                path,
                format!("key {:?} is read from a header any client can write: each request can bring a fresh key (count by address with key: ip and client_ip.trusted_proxies)", part.as_str()),
            );
        }
    }
}

/// Whether a part of `key` is read from the request body.
fn reads_body(key: &KeyText) -> bool {
    let body = |p: &Text| p.starts_with("form:") || p.starts_with("json:");
    match key {
        KeyText::One(p) => body(p),
        KeyText::Composite(ps) => ps.iter().any(body),
    }
}

/// A key's parts as written, to compare two keys.
fn key_parts(key: &KeyText) -> Vec<&str> {
    match key {
        KeyText::One(part) => vec![part.trim()],
        KeyText::Composite(parts) => parts.iter().map(|p| p.trim()).collect(),
    }
}

/// The largest `server.request_buffer`: it is held per request (and HTTP/2 stream)
/// in flight.
const MAX_REQUEST_BUFFER: u64 = 1024 * 1024;

/// The largest `server.max_key_body`: it is held per request (and HTTP/2 stream)
/// in flight, before the request is admitted.
const MAX_KEY_BODY: u64 = 1024 * 1024;

/// `server.max_header_bytes` bounds: hyper's smallest read buffer, and a size no
/// legitimate request head needs.
const MIN_HEADER_BYTES: u64 = 8 * 1024;
const MAX_HEADER_BYTES: u64 = 1024 * 1024;
/// `server.workers`: threads, not a budget to spend on a typo.
const MAX_WORKERS: usize = 256;

/// Fields `respond.headers` cannot set: the framing sluice writes for the body it
/// sends, and the hop-by-hop fields of the connection (RFC 9110 §7.6.1).
const RESPOND_REFUSED: [&str; 8] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "upgrade",
    "te",
    "trailer",
    "proxy-connection",
];

/// Timeouts above this are refused: a typo (`100d` for `100s`) that would hold a
/// connection, a request or a shutdown all but forever.
const MAX_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(86_400);
/// The largest access log buffer (`access_log.buffer`): lines waiting in memory.
const MAX_ACCESS_BUFFER: u64 = 16 * 1024 * 1024;

/// A character of an HTTP token (RFC 9110 §5.6.2).
fn is_tchar(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// Route and limit names end up in metric labels, header values and Redis keys.
fn safe_name(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

struct Checker<'a> {
    index: &'a Index,
    path: &'a Path,
    errors: Vec<ConfigError>,
}

// === impl Checker: reporting ===

impl Checker<'_> {
    fn push(&mut self, (line, col): (usize, usize), message: String) {
        self.errors.push(ConfigError {
            file: self.path.to_path_buf(),
            line,
            col,
            message,
        });
    }

    /// A problem with the value at `path` (or, if the file lacks it, the nearest
    /// node above it).
    fn at(&mut self, path: &str, message: impl Into<String>) {
        let pos = self.index.nearest(path);
        self.push(pos, message.into());
    }

    /// A problem with the field at `path` being there at all: its key.
    fn at_key(&mut self, path: &str, message: impl Into<String>) {
        let pos = self.index.nearest_key(path);
        self.push(pos, message.into());
    }

    fn line_of(&self, path: &str) -> usize {
        self.index.nearest(path).0
    }

    /// A limit's `limit` (of the limit at `lp`): above 0, and small enough for exact
    /// arithmetic in the Redis store.
    fn limit_in_range(&mut self, lp: &str, limit: u64) {
        if limit == 0 {
            self.at(&format!("{lp}.limit"), "limit must be greater than 0");
        } else if limit > MAX_LIMIT {
            self.at(
                &format!("{lp}.limit"),
                format!("limit {limit} is too large: at most 2^40 ({MAX_LIMIT}) for exact arithmetic in the Redis store"),
            );
        }
    }

    fn positive_dur(&mut self, path: &str, name: &str, d: Dur) {
        if d.get().is_zero() {
            self.at(path, format!("{name} must be greater than 0"));
        }
    }

    /// A timeout: above 0 and at most a day.
    fn timeout(&mut self, path: &str, name: &str, d: Dur) {
        self.positive_dur(path, name, d);
        self.at_most_a_day(path, name, d);
    }

    fn at_most_a_day(&mut self, path: &str, name: &str, d: Dur) {
        if d.get() > MAX_TIMEOUT {
            self.at(
                path,
                format!(
                    "{name} must be at most 1d, found {}",
                    super::value::fmt_dur(d.get())
                ),
            );
        }
    }

    fn positive<T: Default + PartialEq>(&mut self, path: &str, name: &str, n: T) {
        if n == T::default() {
            self.at(path, format!("{name} must be greater than 0"));
        }
    }

    /// `what` (e.g. "cert file") must name a readable file.
    fn readable_file(&mut self, path: &str, what: &str, file: &str) {
        match std::fs::metadata(file) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.at(path, format!("{what} {file:?} not found"));
            }
            Err(e) => self.at(path, format!("cannot read {what} {file:?}: {e}")),
            Ok(m) if !m.is_file() => {
                self.at(path, format!("{what} {file:?} is not a file"));
            }
            Ok(_) => {
                if let Err(e) = std::fs::File::open(file) {
                    self.at(path, format!("cannot read {what} {file:?}: {e}"));
                }
            }
        }
    }

    fn header_name(&mut self, path: &str, name: &str) {
        if HeaderName::from_bytes(name.as_bytes()).is_err() {
            self.at_key(
                path,
                format!("{name:?} is not a valid HTTP header name (expected letters, digits and !#$%&'*+-.^_`|~)"),
            );
        }
    }

    fn header_value(&mut self, path: &str, value: &str) {
        if HeaderValue::from_bytes(value.as_bytes()).is_err() {
            self.at(
                path,
                "invalid HTTP header value: control characters other than tab are not allowed",
            );
        }
    }
}

// === impl Checker: sections ===

impl Checker<'_> {
    fn access_log(&mut self, f: &File) {
        if let Some(a) = &f.access_log {
            if !(0.0..=1.0).contains(&a.sample) {
                self.at(
                    "access_log.sample",
                    format!(
                        "sample is the share of forwarded requests logged, from 0 to 1, found {}",
                        a.sample
                    ),
                );
            }
            match &a.path {
                Some(path) => self.access_log_path(path.as_str()),
                None => {
                    for (field, given) in
                        [("buffer", a.buffer.is_some()), ("flush", a.flush.is_some())]
                    {
                        if given {
                            self.at_key(
                                &format!("access_log.{field}"),
                                format!("{field} applies only with path: on stderr each line is written at once"),
                            );
                        }
                    }
                }
            }
            if let Some(b) = a.buffer {
                if b.0 > MAX_ACCESS_BUFFER {
                    self.at(
                        "access_log.buffer",
                        format!("buffer must be at most 16MiB, found {} bytes", b.0),
                    );
                }
            }
            if let Some(f) = a.flush {
                self.timeout("access_log.flush", "flush", f);
            }
        }
    }

    /// The access log's file: a name in a directory that exists (the file itself
    /// is created when absent, as nginx does; the directory is not).
    fn access_log_path(&mut self, path: &str) {
        let p = std::path::Path::new(path);
        if path.is_empty() || path.ends_with('/') {
            self.at("access_log.path", "path must name a file");
            return;
        }
        let dir = match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        if !dir.is_dir() {
            self.at(
                "access_log.path",
                format!("the directory of {path:?} does not exist"),
            );
        } else if p.is_dir() {
            self.at("access_log.path", format!("{path:?} is a directory"));
        }
    }

    fn server(&mut self, file: &File) {
        let s = &file.server;
        self.timeout(
            "server.request_header_timeout",
            "request_header_timeout",
            s.request_header_timeout,
        );
        self.positive(
            "server.max_request_body",
            "max_request_body",
            s.max_request_body.0,
        );
        self.positive("server.max_key_body", "max_key_body", s.max_key_body.0);
        if s.max_key_body.0 > MAX_KEY_BODY {
            self.at(
                "server.max_key_body",
                format!(
                    "max_key_body must be at most 1MiB, found {} bytes",
                    s.max_key_body.0
                ),
            );
        }
        self.positive(
            "server.max_connections",
            "max_connections",
            s.max_connections.get(),
        );
        self.positive(
            "server.max_connections_per_ip",
            "max_connections_per_ip",
            s.max_connections_per_ip.get(),
        );
        if let Some(w) = s.workers {
            if !(1..=MAX_WORKERS).contains(&w.get()) {
                self.at(
                    "server.workers",
                    format!(
                        "workers must be between 1 and {MAX_WORKERS}, found {}",
                        w.get()
                    ),
                );
            }
        }
        // 0 is a valid grace (stop at once); a day is plenty.
        self.at_most_a_day("server.shutdown_grace", "shutdown_grace", s.shutdown_grace);
        self.timeout("server.idle_timeout", "idle_timeout", s.idle_timeout);
        self.timeout("server.send_timeout", "send_timeout", s.send_timeout);
        self.timeout(
            "server.request_body_timeout",
            "request_body_timeout",
            s.request_body_timeout,
        );
        self.timeout(
            "server.tunnel_idle_timeout",
            "tunnel_idle_timeout",
            s.tunnel_idle_timeout,
        );
        if s.request_buffer.0 > MAX_REQUEST_BUFFER {
            self.at(
                "server.request_buffer",
                format!(
                    "request_buffer must be at most 1MiB, found {} bytes",
                    s.request_buffer.0
                ),
            );
        }
        if s.max_buffered_bytes.0 < s.request_buffer.0 {
            self.at(
                "server.max_buffered_bytes",
                format!(
                    "max_buffered_bytes must be at least request_buffer ({} bytes), so that one request can be read ahead, found {} bytes",
                    s.request_buffer.0, s.max_buffered_bytes.0
                ),
            );
        }
        let head = s.max_header_bytes.0;
        if !(MIN_HEADER_BYTES..=MAX_HEADER_BYTES).contains(&head) {
            self.at(
                "server.max_header_bytes",
                format!("max_header_bytes must be between 8KiB and 1MiB, found {head} bytes"),
            );
        }
        for (i, token) in s.upgrades.iter().enumerate() {
            let path = item("server.upgrades", i);
            if token.is_empty() || !token.bytes().all(is_tchar) {
                self.at(
                    &path,
                    format!(
                        "{:?} is not an Upgrade protocol token, expected like websocket",
                        token.as_str()
                    ),
                );
            } else if token.eq_ignore_ascii_case("h2c") {
                self.at(
                    &path,
                    "h2c cannot be passed through: its tunnel would carry requests past every route and limit (clients can speak h2c to sluice directly)",
                );
            }
        }
        if let Some(tls) = &s.tls {
            self.readable_file("server.tls.cert", "cert file", &tls.cert);
            self.readable_file("server.tls.key", "key file", &tls.key);
        }
    }

    fn admin(&mut self, file: &File) {
        let admin = &file.admin;
        self.positive(
            "admin.max_connections_per_ip",
            "max_connections_per_ip",
            admin.max_connections_per_ip.get(),
        );
        self.timeout(
            "admin.request_header_timeout",
            "request_header_timeout",
            admin.request_header_timeout,
        );
        self.timeout("admin.idle_timeout", "idle_timeout", admin.idle_timeout);
        let ip = admin.listen.0.ip().to_canonical();
        let has_token = admin.token.as_ref().is_some_and(|t| !t.is_empty());
        if !ip.is_loopback() && !has_token {
            let path = if admin.token.is_some() {
                "admin.token"
            } else {
                "admin.listen"
            };
            self.at(
                path,
                format!(
                    "an admin listener off loopback needs admin.token, a non-empty bearer token (admin.listen is {})",
                    admin.listen.0
                ),
            );
        }
        let (a, s) = (admin.listen.0, file.server.listen.0);
        if a == s && a.port() != 0 {
            self.at(
                "admin.listen",
                format!("admin.listen must differ from server.listen (both are {a})"),
            );
        } else if overlap(a, s) {
            self.at(
                "admin.listen",
                format!("admin.listen {a} overlaps server.listen {s} (same port, and one is a wildcard address); give the admin listener its own port"),
            );
        }
    }

    fn store(&mut self, file: &File) {
        let store = &file.store;
        self.positive(
            "store.memory.max_keys",
            "max_keys",
            store.memory.max_keys.get(),
        );
        // A redis section under backend memory is allowed (SPEC's example has one);
        // startup and `check` say that it is not used.
        if store.backend != BackendSpec::Redis {
            return;
        }
        let Some(redis) = &store.redis else {
            self.at(
                "store.backend",
                "store.backend: redis needs a store.redis section with url (or cluster, or sentinel)",
            );
            return;
        };
        let given: Vec<&str> = [
            ("url", redis.url.is_some()),
            ("cluster", redis.cluster.is_some()),
            ("sentinel", redis.sentinel.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, set)| set.then_some(name))
        .collect();
        match given[..] {
            [] => self.at(
                "store.redis",
                "store.redis needs exactly one of url (one server), cluster (a list of nodes) and \
                 sentinel (the primary Redis Sentinel names)",
            ),
            [_] => {}
            [.., last] => self.at_key(
                &format!("store.redis.{last}"),
                format!(
                    "store.redis needs exactly one of url, cluster and sentinel, found {}",
                    given.join(" and ")
                ),
            ),
        }
        if let Some(url) = &redis.url {
            self.redis_url("store.redis.url", url, UrlOf::Server);
        }
        if let Some(nodes) = &redis.cluster {
            if nodes.is_empty() {
                self.at(
                    "store.redis.cluster",
                    "store.redis.cluster must list at least one node, like [redis://10.0.0.1:7000]",
                );
            }
            for (i, node) in nodes.iter().enumerate() {
                self.redis_url(&item("store.redis.cluster", i), node, UrlOf::ClusterNode);
            }
        }
        if let Some(sentinel) = &redis.sentinel {
            self.sentinel(sentinel);
        }
        self.timeout("store.redis.timeout", "timeout", redis.timeout);
    }

    fn sentinel(&mut self, s: &super::schema::RedisSentinel) {
        if s.master.trim().is_empty() {
            self.at(
                "store.redis.sentinel.master",
                "store.redis.sentinel.master must name the master the sentinels monitor \
                 (sentinel monitor <name> ...), like mymaster",
            );
        }
        let nodes = "store.redis.sentinel.nodes";
        if s.nodes.is_empty() {
            self.at(
                nodes,
                "store.redis.sentinel.nodes must list at least one sentinel, like \
                 [redis://10.0.0.1:26379]",
            );
        }
        let mut ways = Vec::new();
        for (i, node) in s.nodes.iter().enumerate() {
            if let Some(way) = self.redis_url(&item(nodes, i), node, UrlOf::Sentinel) {
                ways.push((i, way));
            }
        }
        // The primary is reached the way the sentinels are (TLS, ?protocol): they
        // must agree on it.
        if let Some(((_, first), rest)) = ways.split_first() {
            if let Some((i, _)) = rest.iter().find(|(_, w)| w != first) {
                self.at(
                    &item(nodes, *i),
                    "store.redis.sentinel.nodes must all be reached the same way (redis:// or \
                     rediss://, the same ?protocol): the primary is reached that way too",
                );
            }
        }
        if s.username.is_some() && s.password.is_none() {
            self.at_key(
                "store.redis.sentinel.username",
                "store.redis.sentinel.username needs a password too (AUTH takes both)",
            );
        }
    }

    /// Checks a Redis URL as sluice's Redis connection reads it, which ignores what it does not
    /// know: a query parameter, a fragment or a database it would silently drop
    /// would leave the store not what the file says. Returns how the URL reaches its
    /// server (scheme and query) if it is valid.
    fn redis_url(&mut self, path: &str, url: &str, of: UrlOf) -> Option<String> {
        let shown = super::value::redact_url(url);
        let Some((scheme, rest)) = url
            .split_once("://")
            .filter(|(s, _)| *s == "redis" || *s == "rediss")
        else {
            self.at(
                path,
                format!(
                    "expected a redis URL starting with redis:// or rediss://, found {shown:?}"
                ),
            );
            return None;
        };
        let (rest, fragment) = match rest.split_once('#') {
            Some((r, f)) => (r, Some(f)),
            None => (rest, None),
        };
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, db) = rest.split_once('/').unwrap_or((rest, ""));
        // As the client reads it: slashes around the number do not count.
        let db = db.trim_matches('/');
        // The host is what follows any `user:password@` and precedes `:port`.
        let host = authority.rsplit('@').next().unwrap_or("");
        if host.is_empty() || host.starts_with(':') {
            self.at(
                path,
                format!("redis URL {shown:?} has no host, expected like redis://127.0.0.1:6379/0"),
            );
            return None;
        }
        let mut ok = true;
        let mut fail = |me: &mut Self, message: String| {
            me.at(path, message);
            ok = false;
        };
        match (of, db) {
            (_, "") => {}
            (UrlOf::Server, db) if db.parse::<u16>().is_ok() => {}
            (UrlOf::ClusterNode, "0") => {}
            (UrlOf::Server, db) => fail(
                self,
                format!("redis URL {shown:?}: expected a database number after the host, like /0, found /{db}"),
            ),
            (UrlOf::ClusterNode, db) => fail(
                self,
                format!("redis URL {shown:?}: Redis Cluster has only database 0, found /{db}"),
            ),
            (UrlOf::Sentinel, db) => fail(
                self,
                format!("redis URL {shown:?}: a sentinel has no database (found /{db}); the primary's is store.redis.sentinel.db"),
            ),
        }
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            match &*k {
                "protocol" if ["2", "3", "resp2", "resp3"].contains(&&*v) => {}
                "protocol" => fail(
                    self,
                    format!(
                        "redis URL {shown:?}: protocol must be 2, 3, resp2 or resp3, found {v:?}"
                    ),
                ),
                "sentinel" => fail(
                    self,
                    format!(
                        "redis URL {shown:?}: sluice's Redis connection does not read ?sentinel=; to reach \
                         the primary that Redis Sentinel names, use store.redis.sentinel: \
                         {{master: {}, nodes: [redis://<sentinel host>:26379]}} instead of a url",
                        if v.is_empty() { "mymaster" } else { &v }
                    ),
                ),
                _ => fail(
                    self,
                    format!(
                        "redis URL {shown:?}: sluice's Redis connection does not read the query parameter \
                         {k:?} (it would be ignored); the only one it reads is protocol"
                    ),
                ),
            }
        }
        // The client reads one fragment, `#insecure` on rediss://, and only to fail
        // every connection: sluice's build has no way to skip the certificate check.
        match (scheme, fragment) {
            (_, None) => {}
            ("rediss", Some("insecure")) => fail(
                self,
                format!(
                    "redis URL {shown:?}: #insecure is not supported: the server's certificate \
                     is always checked; trust its CA in the system's store, or name it with \
                     SSL_CERT_FILE"
                ),
            ),
            (_, Some(f)) => fail(
                self,
                format!(
                    "redis URL {shown:?}: sluice's Redis connection reads no #fragment, found #{f}"
                ),
            ),
        }
        ok.then(|| format!("{scheme}?{}", query.unwrap_or("")))
    }

    fn upstreams(&mut self, file: &File) {
        for (name, up) in &file.upstreams {
            let base = field("upstreams", name);
            let targets = format!("{base}.targets");
            if up.targets.is_empty() {
                self.at(
                    &targets,
                    format!(
                        "upstream {name:?} needs at least one target, like http://127.0.0.1:3000"
                    ),
                );
            }
            for (i, t) in up.targets.iter().enumerate() {
                if let Err(msg) = check_target(t) {
                    self.at(&item(&targets, i), msg);
                } else if let Err(msg) = check_protocol(up.protocol, t) {
                    self.at(&item(&targets, i), msg);
                }
            }
            self.timeout(
                &format!("{base}.connect_timeout"),
                "connect_timeout",
                up.connect_timeout,
            );
            self.timeout(&format!("{base}.timeout"), "timeout", up.timeout);
            self.timeout(
                &format!("{base}.read_timeout"),
                "read_timeout",
                up.read_timeout,
            );
            if let Some(ca) = &up.tls_ca {
                self.readable_file(&format!("{base}.tls_ca"), "CA file", ca);
            }
            self.timeout(
                &format!("{base}.fail_timeout"),
                "fail_timeout",
                up.fail_timeout,
            );
            if let Some(hc) = &up.health_check {
                let hc_base = format!("{base}.health_check");
                if !hc.path.as_str().starts_with('/') {
                    self.at(
                        &format!("{hc_base}.path"),
                        format!(
                            "health_check.path must start with '/', like /healthz, found {:?}",
                            hc.path.as_str()
                        ),
                    );
                } else if hc.path.as_str().parse::<http::uri::PathAndQuery>().is_err() {
                    self.at(
                        &format!("{hc_base}.path"),
                        format!(
                            "health_check.path {:?} is not a valid path",
                            hc.path.as_str()
                        ),
                    );
                }
                self.timeout(&format!("{hc_base}.interval"), "interval", hc.interval);
                self.timeout(&format!("{hc_base}.timeout"), "timeout", hc.timeout);
            }
            let cap = up.max_connections.get();
            if cap == 0 {
                self.at(
                    &format!("{base}.max_connections"),
                    "max_connections must be greater than 0",
                );
            } else if cap < up.targets.len() {
                self.at(
                    &format!("{base}.max_connections"),
                    format!(
                        "max_connections ({cap}) must be at least the number of targets ({}): the connections are split across them",
                        up.targets.len()
                    ),
                );
            }
        }
    }

    fn deny(&mut self, file: &File) {
        let deny = &file.deny;
        let status = deny.status.get();
        if !(400..=599).contains(&status) {
            self.at(
                "deny.status",
                format!("deny.status must be between 400 and 599, found {status}"),
            );
        }
        self.positive("deny.max_entries", "max_entries", deny.max_entries.get());
        for (i, k) in deny.keys.iter().enumerate() {
            if k.is_empty() {
                self.at(&item("deny.keys", i), "deny.keys entries must not be empty");
            } else if !crate::identity::can_be_a_key(k) {
                self.at(&item("deny.keys", i), UNPRINTABLE_KEY);
            }
        }
    }
}

// === impl Checker: routes ===

impl Checker<'_> {
    fn routes(&mut self, file: &File) {
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, route) in file.routes.iter().enumerate() {
            let base = item("routes", i);
            let name_path = format!("{base}.name");
            let name = route.name.as_str();
            if name.trim().is_empty() {
                self.at(&name_path, "route name must not be empty");
            } else if !safe_name(name) {
                self.at(
                    &name_path,
                    format!("route name {name:?} may use only letters, digits, '_', '-' and '.' (it names metrics and stored keys)"),
                );
            } else if name == "unmatched" {
                self.at(
                    &name_path,
                    "route name \"unmatched\" is reserved: metrics use it for requests that match no route",
                );
            } else if let Some(&first) = names.get(name) {
                let line = self.line_of(&format!("routes[{first}].name"));
                self.at(
                    &name_path,
                    format!("route name {name:?} is already used at line {line}; route names must be unique"),
                );
            } else {
                names.insert(name, i);
            }
            self.target(file, route, &base);
            self.matcher(route, &base);
            self.key(route, &base);
            self.route_limits(route, &base);
            self.route_jwt(file, route, &base);
        }
    }

    /// `jwt.providers`: each with one source of keys.
    fn jwt_providers(&mut self, file: &File) {
        for (name, p) in &file.jwt.providers {
            let path = format!("jwt.providers.{name}");
            if !safe_name(name) {
                self.at_key(
                    &path,
                    format!(
                        "provider name {name:?} may use only letters, digits, '_', '-' and '.'"
                    ),
                );
            }
            let sources = [
                p.jwks_url.is_some(),
                p.jwks_file.is_some(),
                p.secret.is_some(),
            ];
            match sources.iter().filter(|s| **s).count() {
                0 => self.at(&path, format!("provider {name:?} needs one of jwks_url, jwks_file or secret: where its keys come from")),
                1 => {}
                _ => self.at(&path, format!("provider {name:?} has more than one of jwks_url, jwks_file and secret; give one")),
            }
            if let Some(url) = &p.jwks_url {
                let ok = url.parse::<Uri>().is_ok_and(|u| {
                    matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some()
                });
                if !ok {
                    self.at(
                        &format!("{path}.jwks_url"),
                        format!("jwks_url {url:?} is not an http:// or https:// URL"),
                    );
                }
            }
            if p.secret.as_ref().is_some_and(|s| s.is_empty()) {
                self.at(
                    &format!("{path}.secret"),
                    "the HS secret is empty (is its environment variable set?)",
                );
            }
            if p.cache_size.get() == 0 {
                self.at(
                    &format!("{path}.cache_size"),
                    "cache_size must be at least 1",
                );
            }
        }
    }

    /// A route's `jwt` and the JWT claims it reads: a known provider; `jwt:` keys
    /// and claim overrides only with it.
    fn route_jwt(&mut self, file: &File, route: &RouteSpec, base: &str) {
        if let Some(j) = &route.jwt {
            if !file.jwt.providers.contains_key(j.provider.as_str()) {
                let known: Vec<&str> = file.jwt.providers.keys().map(String::as_str).collect();
                self.at(
                    &format!("{base}.jwt.provider"),
                    format!(
                        "unknown JWT provider {:?}; jwt.providers has {known:?}",
                        j.provider.as_str()
                    ),
                );
            }
            if j.header.is_some() && j.cookie.is_some() {
                self.at(
                    &format!("{base}.jwt"),
                    "give the token's header or its cookie, not both",
                );
            }
            if let Some(h) = &j.header {
                self.header_name(&format!("{base}.jwt.header"), h);
            }
            return;
        }
        let needs =
            "reads a JWT claim, but the route has no jwt: {provider: NAME} to verify the token";
        let mut keys = vec![(format!("{base}.key"), &route.key)];
        for (j, l) in route.limits.iter().enumerate() {
            if let Some(k) = &l.key {
                keys.push((format!("{}.key", item(&format!("{base}.limits"), j)), k));
            }
        }
        for (path, key) in keys {
            let parts: Vec<&Text> = match key {
                KeyText::One(p) => vec![p],
                KeyText::Composite(ps) => ps.iter().collect(),
            };
            if parts.iter().any(|p| p.starts_with("jwt:")) {
                self.at(&path, format!("key {}", needs));
            }
        }
        for (j, ov) in route.overrides.iter().enumerate() {
            if !ov.claims.is_empty() {
                let op = item(&format!("{base}.overrides"), j);
                self.at(&format!("{op}.claims"), format!("this override {needs}"));
            }
        }
    }

    /// Where the route sends requests: exactly one of an upstream and a response.
    fn target(&mut self, file: &File, route: &RouteSpec, base: &str) {
        match (&route.upstream, &route.respond) {
            (None, None) => self.at(
                base,
                format!(
                    "route {:?} needs upstream (forward to an upstream) or respond (answer directly)",
                    route.name.as_str()
                ),
            ),
            (Some(_), Some(_)) => self.at_key(
                &format!("{base}.respond"),
                format!(
                    "route {:?} has both upstream and respond; give exactly one",
                    route.name.as_str()
                ),
            ),
            (Some(up), None) => {
                if !file.upstreams.contains_key(up.as_str()) {
                    let known: Vec<&str> = file.upstreams.keys().map(String::as_str).collect();
                    let expected = if known.is_empty() {
                        "no upstreams are defined".to_string()
                    } else {
                        format!("expected one of: {}", known.join(", "))
                    };
                    self.at(
                        &format!("{base}.upstream"),
                        format!("unknown upstream {:?}, {expected}", up.as_str()),
                    );
                }
            }
            (None, Some(resp)) => {
                // A 1xx is no answer: hyper sends a bare 500 (or a 101 and closes).
                let status = resp.status.get();
                if !(200..=599).contains(&status) {
                    self.at(
                        &format!("{base}.respond.status"),
                        format!("respond.status must be between 200 and 599, found {status}"),
                    );
                }
                // A 204 or 304 has no body (RFC 9110 §15.3.5, §15.4.5): hyper drops
                // it, and a HEAD answer would state its length.
                if matches!(status, 204 | 304) && !resp.body.as_str().is_empty() {
                    self.at(
                        &format!("{base}.respond.body"),
                        format!(
                            "respond.body must be empty with status {status}, which has no body"
                        ),
                    );
                }
                let headers = format!("{base}.respond.headers");
                for (name, value) in &resp.headers {
                    let path = field(&headers, name);
                    if RESPOND_REFUSED
                        .iter()
                        .any(|r| r.eq_ignore_ascii_case(name))
                    {
                        // A length other than the body's makes the configured bytes
                        // a response-splitting tool; the rest speak for the connection.
                        self.at_key(
                            &path,
                            format!(
                                "respond.headers cannot set {name}: sluice frames its own answers and owns the connection ({} are refused)",
                                "Content-Length, Transfer-Encoding, Connection, Keep-Alive, Upgrade, TE, Trailer and Proxy-Connection"
                            ),
                        );
                        continue;
                    }
                    self.header_name(&path, name);
                    self.header_value(&path, value);
                }
            }
        }
    }

    fn matcher(&mut self, route: &RouteSpec, base: &str) {
        let m = &route.matcher;
        let mp = format!("{base}.match");
        if let Some(host) = &m.host {
            if !valid_host(host) {
                self.at(
                    &format!("{mp}.host"),
                    format!("expected a host name like api.example.com or a wildcard like *.example.com, found {:?}", host.as_str()),
                );
            }
        }
        for (name, value) in [("path", &m.path), ("path_prefix", &m.path_prefix)] {
            if let Some(p) = value {
                if !p.starts_with('/') {
                    self.at(
                        &format!("{mp}.{name}"),
                        format!("{name} must start with \"/\", found {:?}", p.as_str()),
                    );
                    continue;
                }
                // Requests are matched in normal form: any other spelling never matches.
                let normal = crate::pipeline::path::normalize(p)
                    .map(|n| crate::pipeline::path::route_view(&n).into_owned());
                match normal {
                    Ok(n) if n == p.as_str() => {}
                    Ok(n) => self.at(
                        &format!("{mp}.{name}"),
                        format!(
                            "requests are matched with their path normalised, so {:?} never matches; write {n:?}",
                            p.as_str()
                        ),
                    ),
                    Err(e) => self.at(
                        &format!("{mp}.{name}"),
                        format!("{name} {:?} can never match: {e}", p.as_str()),
                    ),
                }
            }
        }
        if let Some(re) = &m.path_regex {
            if let Err(e) = regex::Regex::new(re) {
                self.at(
                    &format!("{mp}.path_regex"),
                    format!(
                        "path_regex is not a valid regular expression: {}",
                        regex_problem(&e)
                    ),
                );
            }
        }
        if let Some(methods) = &m.methods {
            let path = format!("{mp}.methods");
            if methods.is_empty() {
                self.at(
                    &path,
                    "methods must list at least one method (omit it to match every method)",
                );
            }
            for (i, method) in methods.iter().enumerate() {
                if Method::from_bytes(method.as_bytes()).is_err() {
                    self.at(
                        &item(&path, i),
                        format!(
                            "{:?} is not a valid HTTP method, expected a token like GET or POST",
                            method.as_str()
                        ),
                    );
                } else if !crate::pipeline::admit::METHODS.contains(&method.as_str())
                    && method.as_str() != "CONNECT"
                {
                    // Requests with it get 400 before routing: the route could never match.
                    self.at(
                        &item(&path, i),
                        format!(
                            "{:?} is not a registered HTTP method (methods are case-sensitive; sluice answers 400 to unregistered ones), expected one like GET or POST",
                            method.as_str()
                        ),
                    );
                }
            }
        }
        if let Some(headers) = &m.headers {
            let hp = format!("{mp}.headers");
            for (name, value) in headers {
                let path = field(&hp, name);
                if name.contains('_') {
                    self.at_key(
                        &path,
                        format!("match.headers: header names with \"_\" are dropped from requests (as nginx does), so {name:?} never matches; write it with \"-\""),
                    );
                    continue;
                }
                self.header_name(&path, name);
                self.header_value(&path, value);
            }
        }
    }

    fn key(&mut self, route: &RouteSpec, base: &str) {
        self.key_spec(&route.key, &format!("{base}.key"));
    }

    /// A key, the route's or a limit's, at `path`.
    fn key_spec(&mut self, key: &KeyText, path: &str) {
        let path = path.to_string();
        match key {
            KeyText::One(part) => self.key_part(&path, part),
            KeyText::Composite(parts) => {
                if parts.is_empty() {
                    self.at(&path, "the key list must not be empty: expected one or more of ip, global, header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER");
                }
                for (i, part) in parts.iter().enumerate() {
                    self.key_part(&item(&path, i), part);
                }
            }
        }
    }

    fn key_part(&mut self, path: &str, part: &Text) {
        if let Err(msg) = check_key_part(part) {
            self.at(path, msg);
        }
    }

    fn route_limits(&mut self, route: &RouteSpec, base: &str) {
        self.limit_list(&format!("{base}.limits"), &route.limits);
        if route.respond.is_some() {
            let lists = std::iter::once((format!("{base}.limits"), &route.limits)).chain(
                route.overrides.iter().enumerate().map(|(j, o)| {
                    (
                        format!("{}.limits", item(&format!("{base}.overrides"), j)),
                        &o.limits,
                    )
                }),
            );
            for (lp, list) in lists {
                for (j, l) in list.iter().enumerate() {
                    let field = match (&l.count, &l.cost) {
                        (Some(_), _) => "count",
                        (None, Some(Cost::Response(_))) => "cost",
                        _ => continue,
                    };
                    self.at_key(
                        &format!("{}.{field}", item(&lp, j)),
                        format!("{field} from the upstream's response on a route that answers with respond: sluice's own answers are never counted, so this limit would never be charged"),
                    );
                }
            }
        }
        for (j, ov) in route.overrides.iter().enumerate() {
            let op = item(&format!("{base}.overrides"), j);
            if ov.keys.is_empty() && ov.claims.is_empty() {
                self.at(
                    &format!("{op}.keys"),
                    "an override needs at least one key in keys, or claims",
                );
            } else if !ov.keys.is_empty() && !ov.claims.is_empty() {
                self.at(&op, "an override gives keys or claims, not both");
            }
            for claim in ov.claims.keys() {
                if crate::identity::Claim::parse(claim).is_none() {
                    self.at(
                        &format!("{op}.claims"),
                        format!(
                            "claim {claim:?} is neither a claim name nor a JSON pointer (RFC 6901)"
                        ),
                    );
                }
            }
            for (k, key) in ov.keys.iter().enumerate() {
                if key.is_empty() {
                    self.at(
                        &item(&format!("{op}.keys"), k),
                        "override keys must not be empty",
                    );
                } else if !crate::identity::can_be_a_key(key) {
                    self.at(&item(&format!("{op}.keys"), k), UNPRINTABLE_KEY);
                }
            }
            if ov.limits.is_empty() {
                self.at(
                    &format!("{op}.limits"),
                    "an override needs at least one limit in limits",
                );
            }
            self.limit_list(&format!("{op}.limits"), &ov.limits);
        }
        if !route.overrides.is_empty() && route.limits.is_empty() {
            self.at_key(
                &format!("{base}.overrides"),
                "overrides only make sense on a route with limits: they give some keys other limits",
            );
        }

        let on_limit = format!("{base}.on_limit");
        match (route.on_limit, route.max_delay) {
            (OnLimit::Delay, max_delay) => {
                let lists =
                    std::iter::once(&route.limits).chain(route.overrides.iter().map(|o| &o.limits));
                let mut others = Vec::new();
                for list in lists {
                    for (j, l) in list.iter().enumerate() {
                        if !matches!(
                            l.algorithm,
                            AlgorithmName::TokenBucket | AlgorithmName::Gcra
                        ) {
                            others.push(format!("{:?} ({})", l.name_at(j), l.algorithm.as_str()));
                        }
                    }
                }
                if !others.is_empty() {
                    self.at(
                        &on_limit,
                        format!(
                            "on_limit: delay is valid only with token_bucket and gcra, found {}",
                            others.join(", ")
                        ),
                    );
                }
                match max_delay {
                    None => self.at(&on_limit, "on_limit: delay needs max_delay, how long a request may wait for capacity (like 2s)"),
                    Some(d) => self.timeout(&format!("{base}.max_delay"), "max_delay", d),
                }
            }
            // SPEC's own example sets max_delay on a reject route: it is accepted and
            // has no effect (the summary says so).
            (OnLimit::Reject, _) => {}
        }

        if let Some(ban) = &route.ban {
            let bp = format!("{base}.ban");
            self.positive(&format!("{bp}.after"), "ban.after", ban.after.get());
            self.positive_dur(&format!("{bp}.within"), "ban.within", ban.within);
            self.positive_dur(&format!("{bp}.for"), "ban.for", ban.duration);
            if route.limits.is_empty() {
                self.at_key(
                    &bp,
                    "ban needs limits on the route: it bans keys that keep hitting them",
                );
            }
            let global = |k: &Text| k.as_str() == "global";
            let only_global = match &route.key {
                KeyText::One(k) => global(k),
                KeyText::Composite(ks) => ks.iter().all(global),
            };
            if only_global {
                self.at_key(
                    &bp,
                    "ban needs a per-client key: with key: global every client shares one key, and banning it would deny nobody in particular",
                );
            }
        }
    }

    /// `reserve` on limits: only where units taken in advance can be spent locally and
    /// still never over-admit (see `limit::reserve`).
    fn reserves(&mut self, file: &File) {
        for (i, route) in file.routes.iter().enumerate() {
            let base = item("routes", i);
            let lists = std::iter::once((format!("{base}.limits"), &route.limits)).chain(
                route.overrides.iter().enumerate().map(|(o, ov)| {
                    (
                        format!("{}.limits", item(&format!("{base}.overrides"), o)),
                        &ov.limits,
                    )
                }),
            );
            for (path, limits) in lists {
                self.reserve_list(file, &path, limits);
            }
        }
    }

    fn reserve_list(&mut self, file: &File, path: &str, limits: &[Limit]) {
        let Some(first) = limits.iter().position(|l| l.reserve.is_some()) else {
            return;
        };
        for (j, l) in limits.iter().enumerate() {
            let lp = item(path, j);
            let name = l.name_at(j);
            let Some(n) = l.reserve else {
                self.at(
                    &lp,
                    format!(
                        "limit {name} needs reserve too: reserve on {} takes effect only when every limit of the list has it (a request is admitted from held units only if all of its limits hold them)",
                        limits[first].name_at(first)
                    ),
                );
                continue;
            };
            let rp = format!("{lp}.reserve");
            let n = n.get();
            let alg = l.algorithm.as_str();
            if n < 2 {
                self.at(
                    &rp,
                    "reserve must be at least 2: with 1 nothing is taken in advance",
                );
            }
            if file.store.backend != BackendSpec::Redis {
                self.at_key(
                    &rp,
                    "reserve needs the Redis store (store.backend: redis): on the memory store every decision is already local",
                );
            }
            match l.algorithm {
                AlgorithmName::SlidingLog | AlgorithmName::Concurrency => self.at_key(
                    &rp,
                    format!("{alg} does not take reserve: it keeps every request (or slot) apart, so there are no units to take in advance; use fixed_window, sliding_window, token_bucket or gcra"),
                ),
                _ => {}
            }
            if l.from_response() {
                self.at_key(
                    &rp,
                    "a limit charged from the response (count, or a cost from a response header or body) does not take reserve: its charge is known only after the request",
                );
            }
            if limits.iter().any(|l| l.key.is_some()) {
                self.at_key(
                    &rp,
                    "reserve needs every limit of the list to count the route's key: a limit with its own key is decided with the others in one call per request",
                );
            }
            let quota = match l.algorithm {
                AlgorithmName::TokenBucket | AlgorithmName::Gcra => {
                    l.burst.map(|b| b.get()).or(l.rate.map(|r| r.count))
                }
                _ => l.limit.map(|x| x.get()),
            };
            if let Some(q) = quota.filter(|&q| q > 0 && n > q) {
                self.at(
                    &rp,
                    format!("reserve {n} is greater than the limit's {q}: an instance could never take that many"),
                );
            }
        }
    }

    /// A cost from the response (`lp` its path): from a header or from the body,
    /// with what each form takes.
    fn response_cost(&mut self, lp: &str, l: &Limit, r: &ResponseCostSpec) {
        let alg = l.algorithm.as_str();
        let pointer_help = "a JSON pointer (RFC 6901) starts with \"/\", like /usage/total_tokens, and a \"~\" in a name is written \"~0\" (a \"/\" \"~1\")";
        match (&r.response_header, &r.response_json) {
            (Some(h), None) => {
                if HeaderName::from_bytes(h.as_bytes()).is_err() {
                    self.at(
                        &format!("{lp}.response_header"),
                        format!("{:?} is not a valid HTTP header name", h.as_str()),
                    );
                }
                if r.estimate.is_some() {
                    self.at_key(
                        &format!("{lp}.estimate"),
                        "estimate goes with response_json: a cost from a header is known with the response's head, and checked for one unit before forwarding",
                    );
                }
            }
            (Some(_), Some(_)) => self.at_key(
                &format!("{lp}.response_json"),
                "a cost comes from response_header or response_json, not both",
            ),
            (None, None) => self.at(
                lp,
                "a cost from the response needs response_header: NAME or response_json: POINTER",
            ),
            (None, Some(pointers)) => {
                let pp = format!("{lp}.response_json");
                if l.count.is_some() {
                    self.at_key(
                        &format!("{lp}.response_json"),
                        "response_json does not go with count: the body's cost is charged whatever the status (an answer without usage charges default); write default: 0 to charge nothing for those",
                    );
                }
                if pointers.list().is_empty() {
                    self.at(
                        &pp,
                        format!("response_json needs at least one pointer: {pointer_help}"),
                    );
                }
                for (i, p) in pointers.list().iter().enumerate() {
                    if !crate::identity::is_json_pointer(p.as_str()) {
                        let at = match pointers {
                            Pointers::One(_) => pp.clone(),
                            Pointers::Many(_) => item(&pp, i),
                        };
                        self.at(
                            &at,
                            format!("{:?} is not a JSON pointer: {pointer_help}", p.as_str()),
                        );
                    }
                }
            }
        }
        let Some(estimate) = &r.estimate else {
            return;
        };
        let ep = format!("{lp}.estimate");
        match estimate {
            EstimateSpec::Units(n) if n.get() == 0 => {
                self.at(&ep, "estimate must be greater than 0 (or left out)");
            }
            EstimateSpec::Units(n) => {
                let quota = l.effective_burst().or(l.limit.map(|x| x.get()));
                if let Some(q) = quota.filter(|&q| n.get() > q) {
                    self.at(
                        &ep,
                        format!("estimate {} is greater than the limit's {q}: no request could ever be admitted", n.get()),
                    );
                }
            }
            EstimateSpec::Read(t) => match t.as_str().strip_prefix("json:") {
                Some(p) if crate::identity::is_json_pointer(p) => {}
                Some(p) => self.at(&ep, format!("{p:?} is not a JSON pointer: {pointer_help}")),
                None => self.at(
                    &ep,
                    format!("estimate is a number of units, or \"json:/pointer\" into the request's JSON body (like json:/max_tokens), not {:?}", t.as_str()),
                ),
            },
        }
        if !matches!(
            l.algorithm,
            AlgorithmName::TokenBucket | AlgorithmName::Gcra
        ) {
            self.at_key(
                &ep,
                format!("{alg} does not take estimate: what a response charges less than its estimate is given back, which is exact only for token_bucket and gcra (a window or a log would have to find the charge by its time); use token_bucket or gcra, or leave estimate out (then the limit is checked for one unit before forwarding and charged when the response ends)"),
            );
        }
    }

    /// One list of limits (a route's, or an override's): each limit, and that their
    /// names, given or default, are unique within the list.
    fn limit_list(&mut self, path: &str, limits: &[Limit]) {
        let mut names: HashMap<String, usize> = HashMap::new();
        for (j, l) in limits.iter().enumerate() {
            let lp = item(path, j);
            self.limit(&lp, l, j);
            if l.normalize_key.is_some() && l.key.is_none() {
                self.at(
                    &format!("{lp}.normalize_key"),
                    "a limit's normalize_key applies to its own key: set key on the limit, or normalize_key on the route for the route's key",
                );
            }
            if l.shadow && j >= 64 {
                self.at(
                    &format!("{lp}.shadow"),
                    "only a list's first 64 limits can be on trial (shadow)",
                );
            }
            let name = l.name_at(j);
            let at = if l.name.is_some() {
                format!("{lp}.name")
            } else {
                lp.clone()
            };
            if let Some(&first) = names.get(&name) {
                let line = self.line_of(&item(path, first));
                let hint = if l.name.is_none() || limits[first].name.is_none() {
                    " (a limit without a name is called <algorithm>_<index>)"
                } else {
                    ""
                };
                self.at(
                    &at,
                    format!("limit name {name:?} is already used at line {line}; limit names must be unique within a list{hint}"),
                );
            } else {
                names.insert(name, j);
            }
        }
    }

    fn limit(&mut self, lp: &str, l: &Limit, j: usize) {
        let alg = l.algorithm.as_str();
        if let Some(key) = &l.key {
            self.key_spec(key, &format!("{lp}.key"));
        }
        if let Some(name) = &l.name {
            if name.trim().is_empty() {
                self.at(
                    &format!("{lp}.name"),
                    format!("limit name must not be empty (omit it for the default {alg}_{j})"),
                );
            } else if !safe_name(name) {
                self.at(
                    &format!("{lp}.name"),
                    format!("limit name {name:?} may use only letters, digits, '_', '-' and '.' (it appears in headers and stored keys)"),
                );
            }
        }
        let (takes, rejects): (&str, &[&str]) = match l.algorithm {
            AlgorithmName::Concurrency => {
                ("limit and optionally lease", &["window", "rate", "burst"])
            }
            AlgorithmName::FixedWindow
            | AlgorithmName::SlidingWindow
            | AlgorithmName::SlidingLog => ("limit and window", &["rate", "burst", "lease"]),
            AlgorithmName::TokenBucket | AlgorithmName::Gcra => {
                ("rate and optionally burst", &["limit", "window", "lease"])
            }
        };
        let given = |f: &str| match f {
            "limit" => l.limit.is_some(),
            "window" => l.window.is_some(),
            "rate" => l.rate.is_some(),
            "burst" => l.burst.is_some(),
            _ => l.lease.is_some(),
        };
        for f in rejects {
            if given(f) {
                self.at_key(
                    &format!("{lp}.{f}"),
                    format!("{alg} does not take {f}; it takes {takes}"),
                );
            }
        }

        let cost = l.units();
        if l.algorithm == AlgorithmName::Concurrency && l.cost.is_some() {
            self.at_key(
                &format!("{lp}.cost"),
                "concurrency does not take cost: each request in flight takes one slot",
            );
        }
        if l.algorithm == AlgorithmName::Concurrency && l.count.is_some() {
            self.at_key(
                &format!("{lp}.count"),
                "concurrency does not take count: it counts the requests in flight, not answers",
            );
        }
        if cost == Some(0) {
            self.at(&format!("{lp}.cost"), "cost must be greater than 0");
        }
        if let Some(Cost::Response(r)) = &l.cost {
            self.response_cost(&format!("{lp}.cost"), l, r);
        }
        if let Some(count) = &l.count {
            let cp = format!("{lp}.count.status");
            if count.status.is_empty() {
                self.at(
                    &cp,
                    "count.status needs at least one status, like [401, 403] or [\"5xx\"]",
                );
            }
            for (i, st) in count.status.iter().enumerate() {
                match status_pattern(st) {
                    None => self.at(
                        &item(&cp, i),
                        format!("{:?} is not a status: write a code from 100 to 599 (401) or a class (\"5xx\")", st.as_str()),
                    ),
                    Some(StatusPattern::Code(100..=199) | StatusPattern::Class(1)) => self.at(
                        &item(&cp, i),
                        format!("{:?} can never count: a limit counts final answers, 200 to 599 (a 1xx is an interim answer, never the response)", st.as_str()),
                    ),
                    Some(_) => {}
                }
            }
        }
        // What the limit checks for before forwarding: its cost, or one unit when the
        // response says the cost; a default above the quota is charged as the quota.
        let cost = cost.unwrap_or(1);

        match l.algorithm {
            AlgorithmName::Concurrency => {
                let Some(limit) = l.limit else {
                    self.at(
                        lp,
                        "concurrency needs limit, the requests of a key in flight at once",
                    );
                    return;
                };
                self.limit_in_range(lp, limit.get());
                if let Some(lease) = l.lease {
                    let lp = format!("{lp}.lease");
                    if lease.get() < std::time::Duration::from_millis(1) {
                        self.at(&lp, "lease must be at least 1ms");
                    } else if lease.get() > std::time::Duration::from_secs(7 * 86_400) {
                        self.at(&lp, "lease must be at most 7d: it is how long a slot stays taken after an instance died");
                    }
                }
            }
            AlgorithmName::TokenBucket | AlgorithmName::Gcra => {
                let Some(rate) = l.rate else {
                    self.at(lp, format!("{alg} needs rate, like 10/s"));
                    return;
                };
                let rp = format!("{lp}.rate");
                if rate.count == 0 {
                    self.at(&rp, "the rate's count must be greater than 0, like 10/s");
                }
                if rate.per.is_zero() {
                    self.at(
                        &rp,
                        "the rate's period must be greater than 0, like 10/s or 5/10s",
                    );
                }
                let reduced = crate::limit::Rate::reduced(rate.count, rate.per.as_micros() as u64);
                if rate.count > 0 && !rate.per.is_zero() && reduced.count > reduced.per_us {
                    self.at(
                        &rp,
                        "the rate is faster than one request per microsecond, which the stores cannot time",
                    );
                }
                let (burst, bp, default) = match l.burst {
                    Some(b) => (b.get(), format!("{lp}.burst"), ""),
                    None => (rate.count, rp.clone(), " (the default: the rate's count)"),
                };
                if l.burst.is_some() && burst == 0 {
                    self.at(&bp, "burst must be greater than 0");
                }
                if burst > 0 && cost > burst {
                    self.at(
                        &format!("{lp}.cost"),
                        format!("cost {cost} is greater than burst {burst}{default}: no request could ever pass"),
                    );
                }
                // The stores work on the rate reduced by its common factor.
                let period_us = u128::from(
                    crate::limit::Rate::reduced(rate.count, rate.per.as_micros() as u64).per_us,
                );
                if u128::from(burst) * period_us > MAX_BURST_TIMES_PERIOD_US {
                    self.at(
                        &bp,
                        format!(
                            "burst {burst}{default} × the rate's period ({period_us}µs) exceeds 2^50, \
                             the limit for exact arithmetic in the Redis store; \
                             lower the burst or use a rate whose count divides its period"
                        ),
                    );
                }
            }
            _ => {
                let (Some(limit), Some(window)) = (l.limit, l.window) else {
                    let missing = match (l.limit, l.window) {
                        (None, None) => "limit and window, like limit: 100 and window: 1m",
                        (None, _) => "limit, the number of requests per window",
                        _ => "window, a duration like 1m",
                    };
                    self.at(lp, format!("{alg} needs {missing}"));
                    return;
                };
                let limit = limit.get();
                self.limit_in_range(lp, limit);
                let wp = format!("{lp}.window");
                match window {
                    WindowSpec::Length(d) => self.positive_dur(&wp, "window", Dur(d)),
                    WindowSpec::Month if l.algorithm != AlgorithmName::FixedWindow => self.at(
                        &wp,
                        format!("{alg} does not take window: month (calendar months are for fixed_window only); give a duration like 30d"),
                    ),
                    WindowSpec::Month => {}
                }
                if limit > 0 && cost > limit {
                    self.at(
                        &format!("{lp}.cost"),
                        format!(
                            "cost {cost} is greater than limit {limit}: no request could ever pass"
                        ),
                    );
                }
            }
        }
    }
}

/// A `count.status` item: a code from 100 to 599, or a class `1xx` to `5xx`.
pub fn status_pattern(s: &str) -> Option<StatusPattern> {
    let s = s.trim();
    if let Some(class) = s.strip_suffix("xx").or_else(|| s.strip_suffix("XX")) {
        return match class {
            "1" | "2" | "3" | "4" | "5" => class.parse().ok().map(StatusPattern::Class),
            _ => None,
        };
    }
    let code: u16 = s.parse().ok()?;
    (100..=599)
        .contains(&code)
        .then_some(StatusPattern::Code(code))
}

/// A status a `count` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusPattern {
    Code(u16),
    /// `5xx`: 5.
    Class(u16),
}

// === value forms ===

/// Two listen addresses that cannot both be bound: same port, and one of them a
/// wildcard address (or both the same address). Port 0 picks a free port each time.
fn overlap(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port()
        && a.port() != 0
        && (a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified())
}

/// A host to match: a DNS name (`api.example.com`), an IP address, or `*.suffix`
/// with the `*` as the whole first label.
pub fn valid_host(host: &str) -> bool {
    if let Some(v6) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return v6.parse::<Ipv6Addr>().is_ok();
    }
    let name = host.strip_prefix("*.").unwrap_or(host);
    if name.is_empty() || name.len() > 253 || name.parse::<IpAddr>().is_ok() && name != host {
        return false;
    }
    name.split('.').all(|label| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    })
}

/// One part of a route's key: `ip`, `global`, `header:NAME`, `query:NAME`,
/// `cookie:NAME`, `form:NAME` or `json:/POINTER`.
pub fn check_key_part(part: &str) -> Result<(), String> {
    const EXPECTED: &str =
        "ip, global, header:NAME, query:NAME, cookie:NAME, form:NAME, json:/POINTER, jwt:CLAIM or jwt:/POINTER";
    match part {
        "ip" | "global" => Ok(()),
        _ => match part.split_once(':') {
            Some(("json", "")) => Err(format!(
                "key {part:?} needs a JSON pointer after \"json:\", like json:/user/name"
            )),
            Some(("json", pointer)) if !crate::identity::is_json_pointer(pointer) => Err(format!(
                "key {part:?}: {pointer:?} is not a JSON pointer (RFC 6901): it starts with \"/\", and a \"~\" is written \"~0\" (and a \"/\" in a name \"~1\")"
            )),
            Some(("json", _)) => Ok(()),
            Some(("jwt", claim)) => match crate::identity::Claim::parse(claim) {
                Some(_) => Ok(()),
                None if claim.is_empty() => Err(format!(
                    "key {part:?} needs a claim after \"jwt:\", like jwt:sub or jwt:/org/id"
                )),
                None => Err(format!(
                    "key {part:?}: {claim:?} is not a JSON pointer (RFC 6901): a \"~\" is written \"~0\" (and a \"/\" in a name \"~1\")"
                )),
            },
            Some((kind @ ("header" | "query" | "cookie" | "form"), name)) => {
                if name.is_empty() {
                    Err(format!("key {part:?} needs a name after \"{kind}:\""))
                } else if kind == "header" && HeaderName::from_bytes(name.as_bytes()).is_err() {
                    Err(format!(
                        "key {part:?}: {name:?} is not a valid HTTP header name"
                    ))
                } else if kind == "header" && name.contains('_') {
                    Err(format!("key {part:?}: header names with \"_\" are dropped from requests (as nginx does), so this header is never there; write it with \"-\""))
                } else {
                    Ok(())
                }
            }
            _ => Err(format!("unknown key {part:?}, expected {EXPECTED}")),
        },
    }
}

/// An upstream target: `http://host[:port]` or `https://host[:port]`, nothing more.
/// Whether `protocol` can be spoken to `target` (a valid target): HTTP/2 over
/// TLS needs `https://`, and prior knowledge is cleartext only (h2c over TLS is
/// not a thing a server answers).
fn check_protocol(protocol: UpstreamProtocol, target: &str) -> Result<(), String> {
    let https = target.starts_with("https://");
    match protocol {
        UpstreamProtocol::H2 if !https => Err(format!(
            "protocol h2 is HTTP/2 over TLS and needs an https:// target, found {target:?}; for cleartext HTTP/2 use protocol: h2c"
        )),
        UpstreamProtocol::H2c if https => Err(format!(
            "protocol h2c is cleartext HTTP/2 and needs an http:// target, found {target:?}; over TLS use protocol: h2 (or auto)"
        )),
        _ => Ok(()),
    }
}

pub fn check_target(target: &str) -> Result<(), String> {
    const EXPECTED: &str = "http://host[:port] or https://host[:port]";
    let uri: Uri = target
        .parse()
        .map_err(|_| format!("expected a target like {EXPECTED}, found {target:?}"))?;
    let (Some(scheme), Some(authority)) = (uri.scheme_str(), uri.authority()) else {
        return Err(format!(
            "expected a target like {EXPECTED}, found {target:?}"
        ));
    };
    if scheme != "http" && scheme != "https" {
        return Err(format!(
            "target scheme must be http or https, found {scheme:?}"
        ));
    }
    if authority.as_str().contains('@') {
        return Err(format!(
            "target must not contain user info (user@), expected {EXPECTED}"
        ));
    }
    if authority.host().is_empty() {
        return Err(format!("target has no host, expected {EXPECTED}"));
    }
    if !matches!(uri.path(), "" | "/") {
        return Err(format!(
            "target must not have a path, found {:?}; the request's own path is forwarded, expected {EXPECTED}",
            uri.path()
        ));
    }
    if let Some(q) = uri.query() {
        return Err(format!(
            "target must not have a query, found \"?{q}\", expected {EXPECTED}"
        ));
    }
    Ok(())
}

/// The one-line cause in a regex error (its Display draws the pattern with a caret
/// over several lines).
fn regex_problem(e: &regex::Error) -> String {
    let text = e.to_string();
    text.lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("error: "))
        .map(str::to_string)
        .unwrap_or_else(|| text.split_whitespace().collect::<Vec<_>>().join(" "))
}

/// What a Redis URL names: what may follow its host.
#[derive(Clone, Copy)]
enum UrlOf {
    /// One server (`store.redis.url`): any database.
    Server,
    /// A Redis Cluster node: database 0 only.
    ClusterNode,
    /// A sentinel: no database.
    Sentinel,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn errors(yaml: &str) -> Vec<String> {
        let file: File = serde_yaml::from_str(yaml).expect("valid schema");
        let index = Index::parse(yaml);
        validate(&file, &index, Path::new("t.yaml"))
            .into_iter()
            .map(|e| format!("{}:{}: {}", e.line, e.col, e.message))
            .collect()
    }

    const UP: &str = "upstreams: {api: {targets: [http://127.0.0.1:3000]}}\n";

    fn warned(yaml: &str) -> Vec<String> {
        let file: File = serde_yaml::from_str(yaml).expect("valid schema");
        let index = Index::parse(yaml);
        warnings(&file, &index, Path::new("t.yaml"))
            .into_iter()
            .map(|w| format!("{}:{}: {}", w.0.line, w.0.col, w.0.message))
            .collect()
    }

    /// `jwt`: a `jwt:` key or a claim override needs the route's `jwt`, which names
    /// a known provider; a provider has one source of keys; claims are names or
    /// pointers.
    #[test]
    fn jwt_keys_providers_and_claim_overrides() {
        let file = |providers: &str, route: &str| {
            format!(
                "{UP}jwt:\n  providers:\n{providers}routes:\n  - name: p\n    upstream: api\n{route}    limits: [{{algorithm: fixed_window, limit: 5, window: 1m}}]\n"
            )
        };
        let idp = "    idp: {jwks_url: \"https://idp.example/jwks.json\", issuer: x}\n";
        assert!(errors(&file(idp, "    jwt: {provider: idp}\n    key: jwt:sub\n")).is_empty());
        assert!(errors(&file(
            idp,
            "    jwt: {provider: idp}\n    key: [ip, \"jwt:/org/id\"]\n"
        ))
        .is_empty());
        assert_eq!(
            errors(&file(idp, "    key: jwt:sub\n")),
            ["8:10: key reads a JWT claim, but the route has no jwt: {provider: NAME} to verify the token"]
        );
        assert_eq!(
            errors(&file(idp, "    jwt: {provider: other}\n    key: jwt:sub\n")),
            ["8:21: unknown JWT provider \"other\"; jwt.providers has [\"idp\"]"]
        );
        assert_eq!(
            errors(&file(idp, "    jwt: {provider: idp}\n    key: \"jwt:/a~2\"\n")),
            ["9:10: key \"jwt:/a~2\": \"/a~2\" is not a JSON pointer (RFC 6901): a \"~\" is written \"~0\" (and a \"/\" in a name \"~1\")"]
        );
        assert_eq!(
            errors(&file("    idp: {issuer: x}\n", "    jwt: {provider: idp}\n    key: jwt:sub\n")),
            ["4:10: provider \"idp\" needs one of jwks_url, jwks_file or secret: where its keys come from"]
        );
        assert_eq!(
            errors(&file("    idp: {secret: \"\", jwks_file: /k.json}\n", "    jwt: {provider: idp}\n    key: jwt:sub\n")),
            [
                "4:10: provider \"idp\" has more than one of jwks_url, jwks_file and secret; give one",
                "4:19: the HS secret is empty (is its environment variable set?)"
            ]
        );
        assert_eq!(
            errors(&file(
                "    idp: {jwks_url: \"ftp://x/k\"}\n",
                "    jwt: {provider: idp}\n    key: jwt:sub\n"
            )),
            ["4:21: jwks_url \"ftp://x/k\" is not an http:// or https:// URL"]
        );
        let tiers = "    overrides:\n      - claims: {plan: gold}\n        limits: [{algorithm: fixed_window, limit: 50, window: 1m}]\n";
        assert!(errors(&file(
            idp,
            &format!("    jwt: {{provider: idp}}\n    key: jwt:sub\n{tiers}")
        ))
        .is_empty());
        assert_eq!(
            errors(&file(idp, &format!("    key: ip\n{tiers}"))),
            ["10:17: this override reads a JWT claim, but the route has no jwt: {provider: NAME} to verify the token"]
        );
    }

    /// `normalize_key` on a limit applies to its own key; a body key with
    /// `missing_key: ip` is warned about (the fallback skips the key's deny entries).
    #[test]
    fn normalize_key_and_body_keys_with_an_address_fallback() {
        let route = |extra: &str, limit: &str| {
            format!(
                "{UP}routes:\n  - name: login\n    upstream: api\n    key: ip\n{extra}    limits:\n      - {{algorithm: fixed_window, limit: 5, window: 1m{limit}}}\n"
            )
        };
        assert_eq!(
            errors(&route("", ", normalize_key: casefold")),
            ["7:72: a limit's normalize_key applies to its own key: set key on the limit, or normalize_key on the route for the route's key"]
        );
        assert!(errors(&route(
            "    normalize_key: email\n",
            ", key: \"form:user\", normalize_key: casefold"
        ))
        .is_empty());
        let body = route("    missing_key: ip\n", ", key: \"json:/user\"");
        assert_eq!(
            warned(&body),
            ["6:18: a key read from the body (form:, json:) with missing_key: ip: a request whose body is not read (another type, larger than server.max_key_body, malformed) is counted by its address, and the deny list's entries for the key never see it"]
        );
        assert!(warned(&route("    missing_key: ip\n", ", key: \"header:x-user\"")).is_empty());
    }

    /// A route that an earlier route matches every request of is never reached (the
    /// first route that matches takes a request): warned about at its `match`,
    /// naming the earlier one. Only what is surely covered is: a regular expression
    /// covers only the same one.
    #[test]
    fn a_route_an_earlier_route_takes_every_request_of_is_warned_about() {
        let never = |j: usize, name: &str, i: usize, earlier: &str| {
            format!("route {j} ({name}) is never reached: route {i} ({earlier}), before it, matches every request it matches, and the first route that matches takes the request")
        };
        let routes = |list: &[(&str, &str)]| {
            let mut y = format!("{UP}routes:\n");
            for (name, m) in list {
                y += &format!("  - name: {name}\n    match: {m}\n    upstream: api\n");
            }
            y
        };
        // The newcomer's case: the same login route twice.
        let login = "{path: /login, methods: [POST]}";
        assert_eq!(
            warned(&routes(&[("login", login), ("login_user", login)])),
            [format!("7:12: {}", never(1, "login_user", 0, "login"))]
        );
        // Prefixes, exact paths, methods (GET takes HEAD), hosts, headers, no match.
        let covered = [
            ("{path_prefix: /api/}", "{path: /api/users}"),
            (
                "{path_prefix: /api/}",
                "{path_prefix: /api/v2/, methods: [GET]}",
            ),
            ("{methods: [GET]}", "{path: /x, methods: [HEAD]}"),
            ("{host: \"*.example.com\"}", "{host: api.example.com}"),
            ("{host: \"*.example.com\"}", "{host: \"*.eu.example.com\"}"),
            (
                "{headers: {x-env: \"*\"}}",
                "{headers: {x-env: prod, x-v: \"2\"}}",
            ),
            ("{path: /Login, case_insensitive: true}", "{path: /login}"),
            (
                "{path_regex: \"^/a/[0-9]+$\"}",
                "{path_regex: \"^/a/[0-9]+$\", host: h}",
            ),
            ("{}", "{path: /anything}"),
        ];
        for (a, b) in covered {
            assert_eq!(
                warned(&routes(&[("a", a), ("b", b)])),
                [format!("7:12: {}", never(1, "b", 0, "a"))],
                "{a} before {b}"
            );
        }
        // Each of these lets through a request the earlier route does not match.
        let not_covered = [
            ("{path_prefix: /api/}", "{path_prefix: /ap}"),
            ("{path: /login}", "{path: /login, case_insensitive: true}"),
            ("{path_prefix: /api/}", "{path_regex: \"^/api/.*\"}"),
            ("{methods: [POST]}", "{path: /x}"),
            ("{methods: [HEAD]}", "{methods: [GET]}"),
            ("{host: api.example.com}", "{host: \"*.example.com\"}"),
            ("{host: \"*.example.com\"}", "{host: example.com}"),
            ("{headers: {x-env: prod}}", "{headers: {x-env: \"*\"}}"),
            ("{path_regex: \"^/a\"}", "{path_regex: \"^/a/b\"}"),
        ];
        for (a, b) in not_covered {
            assert_eq!(
                warned(&routes(&[("a", a), ("b", b)])),
                Vec::<String>::new(),
                "{a} before {b}"
            );
        }
        // Later routes are never said to shadow earlier ones.
        assert_eq!(
            warned(&routes(&[
                ("b", "{path: /api/users}"),
                ("a", "{path_prefix: /api/}")
            ])),
            Vec::<String>::new()
        );
    }

    /// Trusted blocks that together cover a family, or one that is all of it
    /// (an IPv4-mapped block is the IPv4 one), are warned about; any less is not.
    #[test]
    fn trusted_proxies_that_cover_every_address() {
        let v4 = "trusted_proxies cover every IPv4 address: any client can choose its address with X-Forwarded-For, and none is held to max_connections_per_ip";
        let v6 = v4.replace("IPv4", "IPv6");
        let yaml = |nets: &str| format!("client_ip: {{trusted_proxies: [{nets}]}}\nroutes: []\n");
        assert_eq!(
            warned(&yaml("0.0.0.0/1, 128.0.0.0/1")),
            [format!("1:30: {v4}")]
        );
        assert_eq!(
            warned(&yaml("10.0.0.0/8, \"::ffff:0:0/96\", \"::/0\"")),
            [format!("1:43: {v4}"), format!("1:60: {v6}")]
        );
        assert_eq!(
            warned(&yaml("0.0.0.0/1, 128.0.0.0/2, \"::/1\"")),
            Vec::<String>::new()
        );
    }

    #[test]
    fn window_month_is_for_fixed_window_only() {
        let limits =
            |l: &str| format!("{UP}routes:\n  - name: a\n    upstream: api\n    limits:\n{l}");
        assert_eq!(
            errors(&limits(
                "      - {algorithm: fixed_window, limit: 100, window: month}\n"
            )),
            Vec::<String>::new()
        );
        assert_eq!(
            errors(&limits(
                "      - {algorithm: sliding_window, limit: 100, window: month}\n      - {algorithm: sliding_log, limit: 5, window: month}\n"
            )),
            [
                "6:57: sliding_window does not take window: month (calendar months are for fixed_window only); give a duration like 30d",
                "7:52: sliding_log does not take window: month (calendar months are for fixed_window only); give a duration like 30d",
            ]
        );
    }

    #[test]
    fn reserve_only_where_units_can_be_held_without_over_admitting() {
        const REDIS: &str = "store: {backend: redis, redis: {url: \"redis://127.0.0.1:6379\"}}\n";
        let limits = |store: &str, l: &str| {
            format!("{store}{UP}routes:\n  - name: a\n    upstream: api\n    limits:\n{l}")
        };
        assert_eq!(
            errors(&limits(
                REDIS,
                "      - {algorithm: fixed_window, limit: 100, window: 1s, reserve: 20}\n      - {algorithm: gcra, rate: 10/s, burst: 20, reserve: 20}\n"
            )),
            Vec::<String>::new()
        );
        assert_eq!(
            errors(&limits(
                REDIS,
                "      - {algorithm: sliding_log, limit: 100, window: 1s, reserve: 20}\n      - {algorithm: concurrency, limit: 10, reserve: 5}\n"
            )),
            [
                "7:58: sliding_log does not take reserve: it keeps every request (or slot) apart, so there are no units to take in advance; use fixed_window, sliding_window, token_bucket or gcra",
                "8:45: concurrency does not take reserve: it keeps every request (or slot) apart, so there are no units to take in advance; use fixed_window, sliding_window, token_bucket or gcra",
            ]
        );
        assert_eq!(
            errors(&limits(
                "",
                "      - {algorithm: fixed_window, limit: 100, window: 1s, reserve: 20}\n"
            )),
            ["6:59: reserve needs the Redis store (store.backend: redis): on the memory store every decision is already local"]
        );
        assert_eq!(
            errors(&limits(
                REDIS,
                "      - {algorithm: fixed_window, limit: 100, window: 1s, reserve: 1}\n      - {name: day, algorithm: fixed_window, limit: 10, window: 1d}\n      - {algorithm: token_bucket, rate: 5/s, reserve: 6}\n"
            )),
            [
                "7:68: reserve must be at least 2: with 1 nothing is taken in advance",
                "8:9: limit day needs reserve too: reserve on fixed_window_0 takes effect only when every limit of the list has it (a request is admitted from held units only if all of its limits hold them)",
                "9:55: reserve 6 is greater than the limit's 5: an instance could never take that many",
            ]
        );
        assert_eq!(
            errors(&limits(
                REDIS,
                "      - {algorithm: fixed_window, limit: 100, window: 1s, reserve: 20, count: {status: [401]}}\n      - {algorithm: fixed_window, limit: 100, window: 1m, reserve: 20, key: ip}\n"
            )),
            [
                "7:59: a limit charged from the response (count, or a cost from a response header or body) does not take reserve: its charge is known only after the request",
                "7:59: reserve needs every limit of the list to count the route's key: a limit with its own key is decided with the others in one call per request",
                "8:59: reserve needs every limit of the list to count the route's key: a limit with its own key is decided with the others in one call per request",
            ]
        );
    }

    #[test]
    fn a_clean_file_has_no_errors() {
        let yaml = format!(
            "{UP}routes:\n  - name: a\n    upstream: api\n    limits: [{{algorithm: gcra, rate: 10/s}}]\n"
        );
        assert_eq!(errors(&yaml), Vec::<String>::new());
    }

    #[test]
    fn default_limit_names_take_part_in_uniqueness() {
        let yaml = format!(
            "{UP}routes:\n  - name: a\n    upstream: api\n    limits:\n      - {{name: gcra_1, algorithm: gcra, rate: 1/s}}\n      - {{algorithm: gcra, rate: 1/s}}\n"
        );
        assert_eq!(
            errors(&yaml),
            ["7:9: limit name \"gcra_1\" is already used at line 6; limit names must be unique within a list (a limit without a name is called <algorithm>_<index>)"]
        );
    }

    #[test]
    fn match_paths_must_be_in_normal_form() {
        let yaml = "routes:\n  - name: a\n    respond: {}\n    match: {path: /a//b, case_insensitive: true}\n  - name: b\n    respond: {}\n    match: {path_prefix: /%7euser/}\n  - name: c\n    respond: {}\n    match: {path: /login;x}\n  - name: d\n    respond: {}\n    match: {path: /a%2Fb}\n  - name: e\n    respond: {}\n    match: {path: /caf%C3%A9, path_prefix: /}\n";
        assert_eq!(
            errors(yaml),
            [
                "4:19: requests are matched with their path normalised, so \"/a//b\" never matches; write \"/a/b\"",
                "7:26: requests are matched with their path normalised, so \"/%7euser/\" never matches; write \"/~user/\"",
                "10:19: requests are matched with their path normalised, so \"/login;x\" never matches; write \"/login\"",
                "13:19: path \"/a%2Fb\" can never match: an encoded \"/\" (%2F) in the path",
            ]
        );
    }

    #[test]
    fn match_methods_must_be_ones_requests_can_carry() {
        let yaml = "routes:\n  - name: a\n    respond: {}\n    match: {methods: [GET, PURGE, post, PROPFIND]}\n";
        assert_eq!(
            errors(yaml),
            [
                "4:28: \"PURGE\" is not a registered HTTP method (methods are case-sensitive; sluice answers 400 to unregistered ones), expected one like GET or POST",
                "4:35: \"post\" is not a registered HTTP method (methods are case-sensitive; sluice answers 400 to unregistered ones), expected one like GET or POST",
            ]
        );
    }

    #[test]
    fn errors_come_in_file_order() {
        let yaml = "routes:\n  - name: a\n    upstream: nope\nserver: {max_connections: 0}\n";
        assert_eq!(
            errors(yaml),
            [
                "3:15: unknown upstream \"nope\", no upstreams are defined",
                "4:27: max_connections must be greater than 0",
            ]
        );
    }

    #[test]
    fn the_protocol_must_fit_the_targets_scheme() {
        let yaml = "upstreams:\n  a:\n    targets: [http://127.0.0.1:3000, https://x.example]\n    protocol: h2\n  b:\n    targets: [https://x.example, http://127.0.0.1:3000]\n    protocol: h2c\n  c:\n    targets: [http://127.0.0.1:3000, https://x.example]\n    protocol: auto\nroutes: []\n";
        assert_eq!(
            errors(yaml),
            [
                "3:15: protocol h2 is HTTP/2 over TLS and needs an https:// target, found \"http://127.0.0.1:3000\"; for cleartext HTTP/2 use protocol: h2c",
                "6:15: protocol h2c is cleartext HTTP/2 and needs an http:// target, found \"https://x.example\"; over TLS use protocol: h2 (or auto)",
            ]
        );
    }

    #[test]
    fn an_upstream_read_timeout_must_be_positive() {
        let yaml = "upstreams:\n  app:\n    targets: [http://127.0.0.1:3000]\n    read_timeout: 0s\nroutes: []\n";
        assert_eq!(errors(yaml), ["4:19: read_timeout must be greater than 0"]);
    }

    #[test]
    fn stall_timeouts_must_be_positive() {
        let yaml = "server:\n  send_timeout: 0s\n  request_body_timeout: 0ms\n  tunnel_idle_timeout: 0s\nroutes: []\n";
        assert_eq!(
            errors(yaml),
            [
                "2:17: send_timeout must be greater than 0",
                "3:25: request_body_timeout must be greater than 0",
                "4:24: tunnel_idle_timeout must be greater than 0",
            ]
        );
    }

    #[test]
    fn workers_between_1_and_256() {
        assert_eq!(
            errors("server: {workers: 0}\nroutes: []\n"),
            ["1:19: workers must be between 1 and 256, found 0"]
        );
        assert_eq!(
            errors("server: {workers: 257}\nroutes: []\n"),
            ["1:19: workers must be between 1 and 256, found 257"]
        );
        assert!(errors("server: {workers: 2}\nroutes: []\n").is_empty());
    }

    #[test]
    fn connection_settings() {
        let yaml = "server:\n  max_header_bytes: 4KiB\n  idle_timeout: 0s\n  max_connections_per_ip: 0\n  upgrades: [websocket, H2C, \"a b\"]\nupstreams:\n  api: {targets: [http://127.0.0.1:1, http://127.0.0.1:2], max_connections: 1}\nroutes: []\n";
        assert_eq!(
            errors(yaml),
            [
                "2:21: max_header_bytes must be between 8KiB and 1MiB, found 4096 bytes",
                "3:17: idle_timeout must be greater than 0",
                "4:27: max_connections_per_ip must be greater than 0",
                "5:25: h2c cannot be passed through: its tunnel would carry requests past every route and limit (clients can speak h2c to sluice directly)",
                "5:30: \"a b\" is not an Upgrade protocol token, expected like websocket",
                "7:77: max_connections (1) must be at least the number of targets (2): the connections are split across them",
            ]
        );
    }

    #[test]
    fn hosts() {
        for ok in [
            "api.example.com",
            "*.example.com",
            "localhost",
            "10.0.0.1",
            "[::1]",
            "A-1.b",
        ] {
            assert!(valid_host(ok), "{ok}");
        }
        for bad in [
            "",
            "*",
            "*.",
            "a.*.com",
            "*example.com",
            "-a.com",
            "a..b",
            "a.com.",
            "a_b.com",
            "api.example.com:80",
            "*.10.0.0.1",
        ] {
            assert!(!valid_host(bad), "{bad}");
        }
    }

    #[test]
    fn key_parts() {
        for ok in [
            "ip",
            "global",
            "header:x-api-key",
            "query:k",
            "cookie:session",
        ] {
            assert_eq!(check_key_part(ok), Ok(()), "{ok}");
        }
        assert_eq!(
            check_key_part("header:"),
            Err("key \"header:\" needs a name after \"header:\"".into())
        );
        assert!(check_key_part("header:x y").is_err());
        assert!(check_key_part("IP").is_err());
        assert!(check_key_part("path:x").is_err());
    }

    #[test]
    fn targets() {
        for ok in [
            "http://127.0.0.1:3000",
            "https://api.example.com",
            "http://h:1/",
            "http://[::1]:80",
        ] {
            assert_eq!(check_target(ok), Ok(()), "{ok}");
        }
        for bad in [
            "127.0.0.1:3000",
            "ftp://h",
            "http://h/v1",
            "http://h/?a=b",
            "http://u:p@h",
            "http://",
            "/x",
        ] {
            assert!(check_target(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn regex_errors_are_one_line() {
        // Built at run time: clippy rejects an invalid regex literal.
        let pattern = String::from("(a");
        let e = regex::Regex::new(&pattern).unwrap_err();
        assert_eq!(regex_problem(&e), "unclosed group");
    }

    #[test]
    fn effective_bursts() {
        let l: Limit = serde_yaml::from_str("{algorithm: token_bucket, rate: 7/s}").unwrap();
        assert_eq!(l.effective_burst(), Some(7));
        assert_eq!(l.name_at(3), "token_bucket_3");
        let l: Limit = serde_yaml::from_str("{algorithm: gcra, rate: 7/s, burst: 2}").unwrap();
        assert_eq!(l.effective_burst(), Some(2));
    }
}
