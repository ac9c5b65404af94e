//! Routing and client keys on realistic requests, through a route table compiled from
//! a configuration file (the requests are built once, and normalised as the gateway
//! does before routing):
//!
//! - `request/admit`: the head checks and path normalisation every request goes through;
//! - `route/*`: finding the route of a request, first match wins, in a table of 8
//!   routes (exact paths, prefixes, a regex, hosts, a method and a header condition);
//! - `key/*`: the route's client key: the address, a header, a query parameter, a
//!   cookie, and a composite of two parts;
//! - `client_ip/*`: the client's address: a direct peer, and one behind two trusted
//!   proxies (`X-Forwarded-For` walked right to left).

use std::hint::black_box;
use std::net::IpAddr;
use std::path::Path;

use criterion::{BatchSize, BenchmarkId, Criterion};
use http::request::Parts;
use http::Request;
use sluice::config::compile::compile;
use sluice::pipeline::Runtime;
use sluice::telemetry::metrics::Metrics;

const CONFIG: &str = r#"
client_ip:
  trusted_proxies: [10.0.0.0/8]
upstreams:
  api:
    targets: [http://127.0.0.1:3000]
  web:
    targets: [http://127.0.0.1:3001]
routes:
  - name: health
    match: {path: /healthz}
    respond: {status: 200, body: "ok\n"}
  - name: login
    match: {path: /v1/login, methods: [POST]}
    upstream: api
    key: ip
    limits: [{algorithm: sliding_log, limit: 5, window: 1m}]
  - name: partner
    match: {host: partner.example.com, path_prefix: /v2/}
    upstream: api
    key: header:x-api-key
    limits: [{algorithm: token_bucket, rate: 100/s, burst: 200}]
  - name: tenant
    match: {path_prefix: /v1/tenants/, headers: {x-tenant: acme}}
    upstream: api
    key: [header:x-tenant, header:x-user]
    limits: [{algorithm: gcra, rate: 50/s}]
  - name: users
    match: {path_regex: '^/v1/users/[0-9]+/orders$'}
    upstream: api
    key: header:authorization
    limits: [{algorithm: sliding_window, limit: 600, window: 1m}]
  - name: search
    match: {path_prefix: /v1/search}
    upstream: api
    key: query:api_key
    limits: [{algorithm: fixed_window, limit: 1000, window: 1h}]
  - name: api
    match: {host: "*.example.com", path_prefix: /v1/}
    upstream: api
    key: header:x-api-key
    missing_key: ip
    limits: [{algorithm: token_bucket, rate: 10/s, burst: 20}]
  - name: web
    match: {}
    upstream: web
    key: cookie:session
    missing_key: ip
    limits: [{algorithm: fixed_window, limit: 100, window: 1m}]
"#;

fn runtime() -> Runtime {
    let loaded = sluice::config::parse(CONFIG, Path::new("bench.yaml"))
        .unwrap_or_else(|e| panic!("the benchmark's configuration does not load: {e}"));
    compile(&loaded, &Metrics::new(), None)
        .unwrap_or_else(|e| panic!("the benchmark's configuration does not compile: {e}"))
}

/// A request head as the gateway routes it: built, then checked and normalised.
fn head(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    let mut parts = b.body(()).expect("a valid request").into_parts().0;
    sluice::pipeline::admit::admit(&mut parts).expect("an admissible request");
    parts
}

const BROWSER: &[(&str, &str)] = &[
    ("host", "www.example.com"),
    ("user-agent", "Mozilla/5.0 (X11; Linux x86_64; rv:128.0) Gecko/20100101 Firefox/128.0"),
    ("accept", "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"),
    ("accept-language", "en-US,en;q=0.5"),
    ("accept-encoding", "gzip, deflate, br, zstd"),
    ("cookie", "theme=dark; _ga=GA1.2.1234567890.1700000000; session=9f86d081884c7d659a2feaa0c55ad015; consent=yes"),
    ("x-forwarded-for", "198.51.100.23, 10.1.2.3"),
];

pub fn bench(c: &mut Criterion) {
    let rt = runtime();
    let route_named = |name: &str| {
        rt.routes
            .iter()
            .position(|r| r.name == name)
            .unwrap_or_else(|| panic!("no route {name}"))
    };
    // (benchmark name, request, the route it must reach)
    let requests = [
        ("health_1st", head("GET", "/healthz", &[("host", "api.example.com")]), "health"),
        (
            "login_2nd",
            head(
                "POST",
                "/v1/login",
                &[("host", "api.example.com"), ("content-type", "application/json")],
            ),
            "login",
        ),
        (
            "tenant_4th",
            head(
                "GET",
                "/v1/tenants/acme/invoices?page=2",
                &[
                    ("host", "api.example.com"),
                    ("x-tenant", "acme"),
                    ("x-user", "u-1234"),
                    ("accept", "application/json"),
                ],
            ),
            "tenant",
        ),
        (
            "users_regex_5th",
            head(
                "GET",
                "/v1/users/123456/orders",
                &[
                    ("host", "api.example.com"),
                    ("authorization", "Bearer eyJhbGciOiJIUzI1NiJ9.e30.ZRrHA1JJJW8opsbCGfG_HACGpVUMN_a9IV7pAx_Zmeo"),
                    ("accept", "application/json"),
                ],
            ),
            "users",
        ),
        (
            "search_query_6th",
            head(
                "GET",
                "/v1/search?q=rate+limits&page=3&api_key=k-3f8a9c2e71d04b5a&sort=desc",
                &[("host", "api.example.com"), ("accept", "application/json")],
            ),
            "search",
        ),
        (
            "api_host_suffix_7th",
            head(
                "GET",
                "/v1/items/42",
                &[
                    ("host", "eu.api.example.com"),
                    ("x-api-key", "k-3f8a9c2e71d04b5a"),
                    ("accept", "application/json"),
                ],
            ),
            "api",
        ),
        ("browser_last", head("GET", "/static/app.js", BROWSER), "web"),
    ];

    let mut g = c.benchmark_group("request");
    let (_, browser, _) = &requests[requests.len() - 1];
    g.bench_function("admit", |b| {
        b.iter_batched(
            || browser.clone(),
            |mut parts| {
                let _ = black_box(sluice::pipeline::admit::admit(&mut parts));
                parts
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();

    let mut g = c.benchmark_group("route");
    for (name, parts, want) in &requests {
        let want = route_named(want);
        let find = |parts: &Parts| rt.routes.iter().position(|r| r.matcher.matches(parts));
        assert_eq!(find(parts), Some(want), "{name} is routed elsewhere");
        g.bench_function(*name, |b| b.iter(|| find(black_box(parts))));
    }
    g.finish();

    let peer: IpAddr = "198.51.100.23".parse().expect("an address");
    let mut g = c.benchmark_group("key");
    for (name, request, route) in [
        ("ip", "login_2nd", "login"),
        ("header", "api_host_suffix_7th", "api"),
        ("header_long", "users_regex_5th", "users"),
        ("query", "search_query_6th", "search"),
        ("cookie", "browser_last", "web"),
        ("composite", "tenant_4th", "tenant"),
    ] {
        let (_, parts, _) = requests
            .iter()
            .find(|(n, _, _)| *n == request)
            .expect("a request of the table");
        let spec = &rt.routes[route_named(route)].key;
        assert!(spec.extract(parts, peer).is_ok(), "{name}: no key");
        g.bench_function(BenchmarkId::new("extract", name), |b| {
            b.iter(|| spec.extract(black_box(parts), peer))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("client_ip");
    let direct = &requests[1].1;
    g.bench_function("direct", |b| {
        b.iter(|| rt.trusted.client_ip(black_box(peer), &direct.headers))
    });
    let proxy: IpAddr = "10.9.8.7".parse().expect("an address");
    g.bench_function("two_trusted_proxies", |b| {
        b.iter(|| rt.trusted.client_ip(black_box(proxy), &browser.headers))
    });
    g.finish();
}
