//! What `sluice check` prints for a valid file, like `nginx -t`: one screen with the
//! listeners, the store, the upstreams and every route with its limits, so an
//! operator can see what the file means before reloading it. Never prints secrets.

use std::fmt::Write as _;

use super::schema::{
    AlgorithmName, BackendSpec, Cost, EstimateSpec, KeyText, Limit, Normalize, OnError, OnLimit,
    RouteSpec, UpstreamProtocol,
};
use super::value::{fmt_dur, fmt_rate, redact_url, Text, WindowSpec};
use super::Loaded;

/// The summary of a loaded file, one line per `\n`, ending with a newline.
pub fn summary(loaded: &Loaded) -> String {
    let f = &loaded.file;
    let mut out = String::new();
    let short_hash = loaded.hash.get(..8).unwrap_or(&loaded.hash);
    line(
        &mut out,
        format!("{}: ok (sha1 {short_hash})", loaded.path.display()),
    );

    let protocols = if f.server.tls.is_some() {
        "https: http/1.1, h2"
    } else {
        "http/1.1, h2c"
    };
    let token = match &f.admin.token {
        Some(t) if !t.is_empty() => "token",
        _ => "no token",
    };
    line(
        &mut out,
        format!(
            "listen  {} ({protocols})   admin {} ({token})",
            f.server.listen.0, f.admin.listen.0
        ),
    );

    let on_error = match f.store.on_error {
        OnError::Local => "local",
        OnError::Allow => "allow",
        OnError::Deny => "deny",
    };
    let max_keys = f.store.memory.max_keys.get();
    let store = match (f.store.backend, &f.store.redis) {
        (BackendSpec::Redis, Some(r)) => {
            let list = |nodes: &[Text]| {
                nodes
                    .iter()
                    .map(|n| redact_url(n))
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            let target = match (&r.url, &r.cluster, &r.sentinel) {
                (Some(url), _, _) => redact_url(url),
                (None, Some(nodes), _) => format!("cluster {}", list(nodes)),
                (None, None, Some(s)) => {
                    format!(
                        "sentinel master {:?} via {}",
                        s.master.as_str(),
                        list(&s.nodes)
                    )
                }
                (None, None, None) => "(no url)".to_string(),
            };
            format!(
                "redis {target}, timeout {}, key_prefix {:?}, on_error {on_error} (local: memory, max_keys {max_keys})",
                fmt_dur(r.timeout.get()),
                r.key_prefix.as_str()
            )
        }
        _ if f.store.redis.is_some() => {
            format!("memory, max_keys {max_keys} (store.redis is ignored: limits are per instance)")
        }
        _ => format!("memory, max_keys {max_keys}"),
    };
    line(&mut out, format!("store   {store}"));
    if let Some(a) = &f.access_log {
        let format = match a.format {
            super::schema::AccessFormat::Json => "json",
            super::schema::AccessFormat::Combined => "combined",
        };
        let share = a.sample * 100.0;
        let text = match &a.path {
            Some(path) => {
                let buffer = a
                    .buffer
                    .map_or(super::compile::DEFAULT_ACCESS_BUFFER as u64, |b| b.0);
                let flush = a
                    .flush
                    .map_or(super::compile::DEFAULT_ACCESS_FLUSH, |d| d.get());
                format!(
                    "access  {format} to {path} (buffer {}, flush {}; reopened on SIGUSR1), {share}% of forwarded requests, every refusal",
                    super::value::fmt_size(buffer),
                    super::value::fmt_dur(flush)
                )
            }
            None => format!(
                "access  {format} on stderr, {share}% of forwarded requests, every refusal (10 lines/s)"
            ),
        };
        line(&mut out, text);
    }

    for (name, up) in &f.upstreams {
        let targets: Vec<&str> = up.targets.iter().map(|t| t.as_str()).collect();
        let protocol = match up.protocol {
            UpstreamProtocol::Http1 => "",
            UpstreamProtocol::H2c => "h2c, ",
            UpstreamProtocol::H2 => "h2, ",
            UpstreamProtocol::Auto => "auto, ",
        };
        line(
            &mut out,
            format!(
                "upstream {name} -> {} ({protocol}connect {}, timeout {})",
                targets.join(", "),
                fmt_dur(up.connect_timeout.get()),
                fmt_dur(up.timeout.get())
            ),
        );
        if let Some(failover) = failover(up) {
            line(&mut out, format!("         {failover}"));
        }
    }

    line(&mut out, format!("routes  {}", f.routes.len()));
    let width = f
        .routes
        .iter()
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(0)
        .max(8);
    let indent = " ".repeat(2 + width + 1);
    for r in &f.routes {
        let http2 = r
            .upstream
            .as_ref()
            .and_then(|u| f.upstreams.get(u.as_str()))
            .is_some_and(|u| u.protocol != UpstreamProtocol::Http1);
        route(&mut out, r, width, &indent, http2);
    }

    let (ips, keys) = (f.deny.ips.len(), f.deny.keys.len());
    let mut deny = format!(
        "deny    {ips} {}, {keys} {} -> {}",
        plural(ips, "ip", "ips"),
        plural(keys, "key", "keys"),
        f.deny.status.get()
    );
    if let Some(state) = &f.deny.state_file {
        let _ = write!(deny, ", state_file {state}");
    }
    line(&mut out, deny);
    for (name, p) in &f.jwt.providers {
        // A secret is never printed; a URL or a path is.
        let keys = match (&p.jwks_url, &p.jwks_file) {
            (Some(u), _) => format!("jwks {u}"),
            (_, Some(file)) => format!("jwks file {file}"),
            _ => "HS secret".to_string(),
        };
        let mut s = format!("jwt     {name}: {keys}");
        if let Some(iss) = &p.issuer {
            let _ = write!(s, ", issuer {iss}");
        }
        if !p.audiences.is_empty() {
            let auds: Vec<&str> = p.audiences.iter().map(|a| a.as_str()).collect();
            let _ = write!(s, ", audiences {}", auds.join(","));
        }
        let _ = write!(s, ", leeway {}", fmt_dur(p.leeway.get()));
        line(&mut out, s);
    }
    out
}

/// `http2`: the route's upstream speaks HTTP/2, so its paths may be gRPC methods.
fn route(out: &mut String, r: &RouteSpec, width: usize, indent: &str, http2: bool) {
    let target = match (&r.upstream, &r.respond) {
        (Some(up), _) => format!("upstream {up}"),
        (None, Some(resp)) => format!("respond {}", resp.status.get()),
        (None, None) => "nowhere".to_string(),
    };
    let mut head = format!(
        "  {:<width$} {} -> {target}",
        r.name.as_str(),
        describe_match(r, http2)
    );
    if !r.limits.is_empty() {
        let _ = write!(head, "   key {}", key_text(&r.key));
        if r.normalize_key != Normalize::None {
            let _ = write!(head, " ({})", r.normalize_key);
        }
    }
    if r.shadow {
        head.push_str("   (shadow)");
    }
    if let Some(j) = &r.jwt {
        let _ = write!(head, "   jwt {}", j.provider);
        if !j.required {
            head.push_str(" (optional)");
        }
    }
    line(out, head);

    if !r.limits.is_empty() {
        let mut limits = describe_limits(&r.limits);
        if r.on_limit == OnLimit::Delay {
            let wait = r.max_delay.map(|d| fmt_dur(d.get())).unwrap_or_default();
            let _ = write!(limits, "; delay up to {wait}");
        }
        if let Some(ban) = &r.ban {
            let _ = write!(
                limits,
                "; ban after {} within {} for {}",
                ban.after.get(),
                fmt_dur(ban.within.get()),
                fmt_dur(ban.duration.get())
            );
        }
        line(out, format!("{indent}{limits}"));
    }
    for ov in &r.overrides {
        if !ov.claims.is_empty() {
            let claims: Vec<String> = ov.claims.iter().map(|(c, v)| format!("{c}={v}")).collect();
            line(
                out,
                format!(
                    "{indent}override for claims {}: {}",
                    claims.join(", "),
                    describe_limits(&ov.limits)
                ),
            );
            continue;
        }
        // The keys themselves are often API keys: count them, never print them.
        let n = ov.keys.len();
        line(
            out,
            format!(
                "{indent}override for {n} {}: {}",
                plural(n, "key", "keys"),
                describe_limits(&ov.limits)
            ),
        );
    }
}

/// A gRPC method's path (`/package.Service/Method`) as gRPC names it
/// (`package.Service/Method`), or a service's prefix (`/package.Service/`) as
/// `package.Service/*`; `None` for any other path.
fn grpc_name(path: &str, prefix: bool) -> Option<String> {
    let rest = path.strip_prefix('/')?;
    let (service, method) = rest.split_once('/')?;
    let ident = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
    };
    if !service.contains('.') || !ident(service) {
        return None;
    }
    match (prefix, method) {
        (true, "") => Some(format!("{service}/*")),
        (false, m) if ident(m) && !m.contains('.') => Some(format!("{service}/{m}")),
        _ => None,
    }
}

fn describe_match(r: &RouteSpec, http2: bool) -> String {
    let m = &r.matcher;
    let mut parts = Vec::new();
    if let Some(h) = &m.host {
        parts.push(format!("host {h}"));
    }
    if let Some(p) = &m.path {
        match grpc_name(p, false).filter(|_| http2) {
            Some(g) => parts.push(format!("gRPC {g}")),
            None => parts.push(p.to_string()),
        }
    }
    if let Some(p) = &m.path_prefix {
        match grpc_name(p, true).filter(|_| http2) {
            Some(g) => parts.push(format!("gRPC {g}")),
            None => parts.push(format!("prefix {p}")),
        }
    }
    if let Some(p) = &m.path_regex {
        parts.push(format!("regex {p}"));
    }
    if m.case_insensitive {
        parts.push("any case".into());
    }
    if let Some(headers) = &m.headers {
        // Names only: a matched value may be a credential.
        for name in headers.keys() {
            parts.push(format!("header {name}"));
        }
    }
    let mut s = String::new();
    if let Some(methods) = &m.methods {
        let mut methods: Vec<String> = methods.iter().map(|m| m.to_ascii_uppercase()).collect();
        // As routing reads it: GET takes HEAD too.
        if methods.iter().any(|m| m == "GET") && !methods.iter().any(|m| m == "HEAD") {
            methods.push("HEAD".into());
        }
        s.push_str(&methods.join(","));
        if !parts.is_empty() {
            s.push(' ');
        }
    }
    if parts.is_empty() && s.is_empty() {
        s.push_str("any");
    }
    s.push_str(&parts.join(", "));
    s
}

fn describe_limits(limits: &[Limit]) -> String {
    limits
        .iter()
        .enumerate()
        .map(|(j, l)| describe_limit(l, j))
        .collect::<Vec<_>>()
        .join("; ")
}

fn describe_limit(l: &Limit, j: usize) -> String {
    let mut s = String::new();
    if l.shadow {
        s.push_str("(shadow) ");
    }
    if l.name.is_some() {
        let _ = write!(s, "{}: ", l.name_at(j));
    }
    s.push_str(l.algorithm.as_str());
    match l.algorithm {
        AlgorithmName::TokenBucket | AlgorithmName::Gcra => {
            if let Some(rate) = l.rate {
                let _ = write!(s, " {}", fmt_rate(rate));
            }
            if let Some(b) = l.effective_burst() {
                let _ = write!(s, " burst {b}");
            }
        }
        AlgorithmName::Concurrency => {
            if let Some(n) = l.limit {
                let _ = write!(s, " {} in flight", n.get());
            }
            if let Some(d) = l.lease {
                let _ = write!(s, " lease {}", fmt_dur(d.get()));
            }
        }
        _ => {
            if let Some(n) = l.limit {
                let _ = write!(s, " {}", n.get());
            }
            match l.window {
                Some(WindowSpec::Length(d)) => {
                    let _ = write!(s, " per {}", fmt_dur(d));
                }
                Some(WindowSpec::Month) => s.push_str(" per calendar month (UTC)"),
                None => {}
            }
        }
    }
    match &l.cost {
        Some(Cost::Units(c)) if c.get() != 1 => {
            let _ = write!(s, " cost {}", c.get());
        }
        Some(Cost::Response(r)) => {
            let default = r.default.map_or(1, |d| d.get());
            if let Some(h) = &r.response_header {
                let _ = write!(
                    s,
                    " cost from response header {} (default {default})",
                    h.as_str()
                );
            } else if let Some(p) = &r.response_json {
                let pointers: Vec<&str> = p.list().iter().map(|t| t.as_str()).collect();
                let _ = write!(
                    s,
                    " cost from the response body at {} (default {default})",
                    pointers.join(" + ")
                );
                match &r.estimate {
                    Some(EstimateSpec::Units(n)) => {
                        let _ = write!(s, ", {} held at admission", n.get());
                    }
                    Some(EstimateSpec::Read(t)) => {
                        let _ = write!(
                            s,
                            ", the request's {} held at admission (default {default})",
                            t.as_str()
                        );
                    }
                    None => {}
                }
            }
        }
        _ => {}
    }
    if let Some(count) = &l.count {
        let statuses: Vec<&str> = count.status.iter().map(|t| t.as_str()).collect();
        let _ = write!(s, " counting responses {}", statuses.join(","));
    }
    if let Some(key) = &l.key {
        let _ = write!(s, " by {}", key_text(key));
        if let Some(n) = l.normalize_key.filter(|n| *n != Normalize::None) {
            let _ = write!(s, " ({n})");
        }
    }
    if let Some(n) = l.reserve {
        let _ = write!(s, " reserving {} at a time", n.get());
    }
    s
}

/// A key as the configuration writes it, a composite one's parts joined by `+`.
fn key_text(key: &KeyText) -> String {
    match key {
        KeyText::One(k) => k.to_string(),
        KeyText::Composite(parts) => parts
            .iter()
            .map(|p| p.as_str())
            .collect::<Vec<_>>()
            .join("+"),
    }
}

fn plural<'a>(n: usize, one: &'a str, many: &'a str) -> &'a str {
    if n == 1 {
        one
    } else {
        many
    }
}

fn line(out: &mut String, s: String) {
    out.push_str(&s);
    out.push('\n');
}

/// How an upstream's targets are left out and tried again, when that can matter:
/// with several targets, or active checks, or `max_fails` set to other than 1.
fn failover(up: &crate::config::schema::UpstreamSpec) -> Option<String> {
    let fails = up.max_fails.get();
    let timeout = fmt_dur(up.fail_timeout.get());
    let mut parts = Vec::new();
    if up.targets.len() > 1 {
        parts.push(
            "a target no connection can be made to passes the request to the next".to_string(),
        );
    }
    if up.targets.len() > 1 || fails != 1 || up.health_check.is_some() {
        parts.push(match fails {
            0 => "no target is ever left out after failed connections".to_string(),
            1 => format!("a target is left out {timeout} after a failed connection"),
            n => format!(
                "a target is left out {timeout} after {n} failed connections within {timeout}"
            ),
        });
    }
    if let Some(c) = &up.health_check {
        parts.push(format!(
            "health check GET {} every {} (timeout {}): out after 2 failed, back after 2 good",
            c.path.as_str(),
            fmt_dur(c.interval.get()),
            fmt_dur(c.timeout.get())
        ));
    }
    (!parts.is_empty()).then(|| format!("failover: {}", parts.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use std::path::Path;

    /// gRPC methods and services read as gRPC names them, on routes whose
    /// upstream speaks HTTP/2; the same paths to an HTTP/1.1 upstream as paths.
    #[test]
    fn grpc_routes_read_as_grpc_names() {
        let yaml = "\
upstreams:
  orders: {targets: [http://127.0.0.1:50051], protocol: h2c}
  web: {targets: [http://127.0.0.1:3000]}
routes:
  - {name: create, match: {path: /orders.v1.Orders/Create}, upstream: orders}
  - {name: orders, match: {path_prefix: /orders.v1.Orders/}, upstream: orders}
  - {name: v1, match: {path_prefix: /v1/}, upstream: orders}
  - {name: web, match: {path: /orders.v1.Orders/Create}, upstream: web}
";
        let loaded = parse(yaml, Path::new("t.yaml")).unwrap();
        let text = summary(&loaded);
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines.contains(
                &"upstream orders -> http://127.0.0.1:50051 (h2c, connect 2s, timeout 30s)"
            ),
            "{text}"
        );
        assert!(
            lines.contains(&"  create   gRPC orders.v1.Orders/Create -> upstream orders"),
            "{text}"
        );
        assert!(
            lines.contains(&"  orders   gRPC orders.v1.Orders/* -> upstream orders"),
            "{text}"
        );
        assert!(
            lines.contains(&"  v1       prefix /v1/ -> upstream orders"),
            "{text}"
        );
        assert!(
            lines.contains(&"  web      /orders.v1.Orders/Create -> upstream web"),
            "{text}"
        );
    }

    /// Providers are listed with where their keys come from (a secret never
    /// printed); a route shows its provider, and claim overrides their claims.
    #[test]
    fn jwt_providers_and_routes() {
        let yaml = "\
upstreams:
  api: {targets: [http://127.0.0.1:3000]}
jwt:
  providers:
    idp: {jwks_url: \"https://idp.example/jwks.json\", issuer: \"https://idp.example/\", audiences: [api, web]}
    hs: {secret: do-not-print-me}
routes:
  - name: partner
    match: {path_prefix: /partner/}
    upstream: api
    jwt: {provider: idp, required: false}
    key: jwt:sub
    limits: [{algorithm: fixed_window, limit: 5, window: 1m}]
    overrides:
      - claims: {plan: gold}
        limits: [{algorithm: fixed_window, limit: 50, window: 1m}]
";
        let loaded = parse(yaml, Path::new("t.yaml")).unwrap();
        let text = summary(&loaded);
        let lines: Vec<&str> = text.lines().collect();
        for want in [
            "jwt     idp: jwks https://idp.example/jwks.json, issuer https://idp.example/, audiences api,web, leeway 1m",
            "jwt     hs: HS secret, leeway 1m",
            "  partner  prefix /partner/ -> upstream api   key jwt:sub   jwt idp (optional)",
            "           override for claims plan=gold: fixed_window 50 per 1m",
        ] {
            assert!(lines.contains(&want), "{want:?} not in\n{text}");
        }
        assert!(!text.contains("do-not-print-me"), "{text}");
    }

    #[test]
    fn the_spec_example_in_one_screen() {
        let yaml = "\
server: {listen: 0.0.0.0:8080}
admin: {listen: 127.0.0.1:9091}
upstreams:
  api: {targets: [http://127.0.0.1:3000]}
deny: {ips: [203.0.113.0/24, 198.51.100.7], keys: [leaked-key-123]}
routes:
  - name: login
    match: {path: /login, methods: [POST]}
    upstream: api
    limits: [{algorithm: sliding_log, limit: 5, window: 1m}]
  - name: api
    match: {host: api.example.com, path_prefix: /v1/, headers: {x-tenant: acme}}
    upstream: api
    key: header:x-api-key
    limits:
      - {name: burst, algorithm: token_bucket, rate: 10/s, burst: 20}
      - {name: daily, algorithm: fixed_window, limit: 10000, window: 1d}
    overrides:
      - keys: [premium-key-1]
        limits: [{name: burst, algorithm: token_bucket, rate: 100/s, burst: 200}]
  - name: health
    match: {path: /healthz}
    respond: {status: 200, body: \"ok\\n\"}
";
        let loaded = parse(yaml, Path::new("config/rules.yaml")).unwrap();
        let expected = format!(
            "\
config/rules.yaml: ok (sha1 {})
listen  0.0.0.0:8080 (http/1.1, h2c)   admin 127.0.0.1:9091 (no token)
store   memory, max_keys 1000000
upstream api -> http://127.0.0.1:3000 (connect 2s, timeout 30s)
routes  3
  login    POST /login -> upstream api   key ip
           sliding_log 5 per 1m
  api      host api.example.com, prefix /v1/, header x-tenant -> upstream api   key header:x-api-key
           burst: token_bucket 10/s burst 20; daily: fixed_window 10000 per 1d
           override for 1 key: burst: token_bucket 100/s burst 200
  health   /healthz -> respond 200
deny    2 ips, 1 key -> 403
",
            &loaded.hash[..8]
        );
        assert_eq!(summary(&loaded), expected);
        assert!(!summary(&loaded).contains("premium-key-1"));
    }

    /// An upstream with two targets says how they fail over, and its health check.
    #[test]
    fn an_upstream_of_several_targets_says_how_they_fail_over() {
        let yaml = "upstreams:\n  api:\n    targets: [http://127.0.0.1:3000, http://127.0.0.1:3001]\n    max_fails: 3\n    fail_timeout: 30s\n    health_check: {path: /healthz, interval: 2s}\n  one: {targets: [http://127.0.0.1:4000]}\nroutes: []\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        let lines: Vec<&str> = text.lines().collect();
        let at = lines
            .iter()
            .position(|l| l.starts_with("upstream api -> "))
            .expect("the upstream's line");
        assert_eq!(
            lines[at + 1],
            "         failover: a target no connection can be made to passes the request to the next; a target is left out 30s after 3 failed connections within 30s; health check GET /healthz every 2s (timeout 1s): out after 2 failed, back after 2 good"
        );
        // One target with the defaults: nothing more to say.
        let one = lines
            .iter()
            .position(|l| l.starts_with("upstream one -> "))
            .expect("the other upstream's line");
        assert!(!lines[one + 1].contains("failover"), "{text}");
    }

    /// The summary says what routing does: a route for GET takes HEAD too.
    #[test]
    fn get_is_shown_with_head() {
        let yaml = "routes:\n  - {name: a, match: {path: /a, methods: [GET, POST]}, respond: {}}\n  - {name: b, match: {methods: [HEAD, GET]}, respond: {}}\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        let lines: Vec<&str> = text.lines().filter(|l| l.contains("-> respond")).collect();
        assert_eq!(
            lines,
            [
                "  a        GET,POST,HEAD /a -> respond 200",
                "  b        HEAD,GET -> respond 200"
            ]
        );
    }

    #[test]
    fn a_limit_on_trial_is_marked() {
        let yaml = "routes:\n  - name: a\n    limits:\n      - {name: per_ip, algorithm: fixed_window, limit: 5, window: 1m}\n      - {name: strict, algorithm: fixed_window, limit: 1, window: 1m, shadow: true}\n    respond: {}\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        assert!(
            text.contains("per_ip: fixed_window 5 per 1m; (shadow) strict: fixed_window 1 per 1m"),
            "{text}"
        );
    }

    #[test]
    fn a_limit_says_how_many_units_it_reserves() {
        let yaml = "store: {backend: redis, redis: {url: \"redis://127.0.0.1:6379\"}}\nroutes:\n  - name: a\n    limits:\n      - {name: hot, algorithm: token_bucket, rate: 50/s, burst: 100, reserve: 20}\n    respond: {}\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        assert!(
            text.contains("hot: token_bucket 50/s burst 100 reserving 20 at a time"),
            "{text}"
        );
    }

    #[test]
    fn a_normalised_key_says_its_form() {
        let yaml = "routes:\n  - name: login\n    key: \"json:/email\"\n    normalize_key: email\n    limits:\n      - {name: per_ip, algorithm: fixed_window, limit: 5, window: 1m}\n      - {name: per_user, algorithm: fixed_window, limit: 3, window: 1m, key: \"form:user\", normalize_key: casefold}\n    respond: {}\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        let lines: Vec<&str> = text
            .lines()
            .filter(|l| l.contains("login") || l.contains("per_"))
            .collect();
        assert_eq!(
            lines,
            [
                "  login    any -> respond 200   key json:/email (email)",
                "           per_ip: fixed_window 5 per 1m; per_user: fixed_window 3 per 1m by form:user (casefold)"
            ],
            "{text}"
        );
    }

    #[test]
    fn a_limit_says_which_key_it_counts() {
        let yaml = "routes:
  - name: login
    key: ip
    limits:
      - {name: per_ip, algorithm: sliding_log, limit: 5, window: 1m}
      - {name: per_account, key: \"header:x-user\", algorithm: sliding_log, limit: 3, window: 1m}
      - {name: pair, key: [ip, \"header:x-user\"], algorithm: sliding_log, limit: 2, window: 1m}
    respond: {}
";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        assert!(
            text.contains("      per_ip: sliding_log 5 per 1m; per_account: sliding_log 3 per 1m by header:x-user; pair: sliding_log 2 per 1m by ip+header:x-user\n"),
            "{text}"
        );
    }

    #[test]
    fn a_calendar_month_is_named() {
        let yaml = "routes:\n  - name: a\n    limits:\n      - {name: monthly, algorithm: fixed_window, limit: 100, window: month}\n    respond: {}\n";
        let loaded = parse(yaml, Path::new("r.yaml")).unwrap();
        let text = summary(&loaded);
        assert!(
            text.lines()
                .any(|l| l.trim() == "monthly: fixed_window 100 per calendar month (UTC)"),
            "{text}"
        );
    }
}
