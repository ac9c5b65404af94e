//! Transparency: sluice must be invisible. What the client sends reaches the
//! upstream unchanged (paths, fields in order, bodies, trailers, upgrades) except
//! what RFC 9110 says a proxy changes (hop-by-hop fields out, `X-Forwarded-*` in),
//! and the upstream's answer reaches the client the same way, over HTTP/1.1, h2c
//! and TLS. Then what sluice itself adds around a forward: balancing, its answers
//! to upstream failures, cutting off slow clients, its admin port and shutdown.

use std::time::{Duration, Instant};

use crate::common::*;
use http::{HeaderValue, Method};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One route sending everything to the upstream(s) `UP`.
const PROXY: &str = r#"
upstreams:
  api: {targets: [UP]}
routes:
  - {name: api, match: {path_prefix: /}, upstream: api}
"#;

async fn proxy_to(targets: &[String]) -> Running {
    let list: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
    start_gateway(&PROXY.replace("UP", &list.join(", "))).await
}

fn sorted(headers: &[(String, String)], skip: &[&str]) -> Vec<(String, String)> {
    let mut h: Vec<_> = headers
        .iter()
        .filter(|(k, _)| !skip.contains(&k.as_str()))
        .cloned()
        .collect();
    h.sort();
    h
}

// === the request: what the upstream receives ===

#[tokio::test]
async fn the_upstream_sees_what_the_client_sent_plus_forwarding_headers() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let c = http1();
    let r = c
        .get(
            &url(gw.addr, "/some/path?a=1&b=%20x&a=2"),
            &[
                ("host", "app.example.com"),
                ("x-forwarded-for", "203.0.113.5"),
                // Not a trusted proxy: its claims about scheme and host are replaced.
                ("x-forwarded-proto", "https"),
                ("x-forwarded-host", "evil.example.net"),
                ("connection", "keep-alive, x-drop-me"),
                ("x-drop-me", "secret"),
                ("keep-alive", "timeout=5"),
                ("te", "gzip"),
                ("proxy-connection", "keep-alive"),
                ("x-custom", "value"),
                ("x-multi", "one"),
                ("x-multi", "two"),
                ("accept", "text/plain"),
            ],
        )
        .await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    assert_eq!(
        (e.method.as_str(), e.uri.as_str(), e.version.as_str()),
        ("GET", "/some/path?a=1&b=%20x&a=2", "HTTP/1.1")
    );
    assert_eq!(e.header("host"), Some("app.example.com"));
    assert_eq!(e.header("x-forwarded-for"), Some("203.0.113.5, 127.0.0.1"));
    assert_eq!(e.header("x-forwarded-proto"), Some("http"));
    assert_eq!(e.header("x-forwarded-host"), Some("app.example.com"));
    for gone in [
        "connection",
        "x-drop-me",
        "keep-alive",
        "te",
        "proxy-connection",
    ] {
        assert_eq!(e.header(gone), None, "{gone} reached the upstream");
    }
    assert_eq!(e.header("x-custom"), Some("value"));
    assert_eq!(e.header("accept"), Some("text/plain"));
    assert_eq!(e.all("x-multi"), ["one", "two"]);
}

/// The client's `Host` goes on where it came, once; and a `Host` its `Connection`
/// names (a hop-by-hop field by that naming, taken out) is given back, as when none
/// came: the upstream always gets the one the client asked for.
#[tokio::test]
async fn the_clients_host_reaches_the_upstream_once_even_when_connection_names_it() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let c = http1();
    let names = |e: &Echo| -> Vec<String> { e.headers.iter().map(|(k, _)| k.clone()).collect() };
    let plain = c
        .get(
            &url(gw.addr, "/"),
            &[("host", "app.example.com"), ("x-a", "1")],
        )
        .await
        .echo();
    assert_eq!(plain.all("host"), ["app.example.com"]);
    assert_eq!(names(&plain)[..2], ["host", "x-a"]);
    let named = c
        .get(
            &url(gw.addr, "/"),
            &[
                ("host", "app.example.com"),
                ("connection", "host"),
                ("x-a", "1"),
            ],
        )
        .await
        .echo();
    assert_eq!(named.all("host"), ["app.example.com"]);
    assert_eq!(named.header("connection"), None);
    assert_eq!(named.header("x-a"), Some("1"));
}

#[tokio::test]
async fn direct_and_proxied_requests_look_the_same() {
    // hyper's own proxy tests do this: the same request straight to the upstream
    // and through sluice differ only in the X-Forwarded-* headers.
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let c = http1();
    let headers = [
        ("host", "app.example.com"),
        ("x-a", "1"),
        ("content-type", "application/json"),
    ];
    let body = r#"{"hello":"world"}"#;
    let direct = c
        .send(Method::PUT, &format!("{}/p?q=1", up.url()), &headers, body)
        .await;
    let proxied = c
        .send(Method::PUT, &url(gw.addr, "/p?q=1"), &headers, body)
        .await;
    assert_eq!(direct.status, proxied.status);
    let (d, p) = (direct.echo(), proxied.echo());
    assert_eq!(
        (&d.method, &d.uri, &d.version, &d.body),
        (&p.method, &p.uri, &p.version, &p.body)
    );
    let forwarding = ["x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"];
    assert_eq!(sorted(&d.headers, &[]), sorted(&p.headers, &forwarding));
    let names = |r: &Resp| {
        let mut n: Vec<String> = r
            .headers
            .keys()
            .map(|k| k.to_string())
            .filter(|k| k != "date")
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&direct), names(&proxied));
    assert_eq!(
        proxied.header("content-length"),
        Some(proxied.body.len().to_string().as_str())
    );
}

#[tokio::test]
async fn a_large_request_body_reaches_the_upstream_intact() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let body = pattern(256 << 10);
    let r = http1()
        .send(Method::POST, &url(gw.addr, "/upload"), &[], body.clone())
        .await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    assert_eq!(e.body_len, 256 << 10);
    assert!(
        e.body.as_bytes() == body,
        "the 256 KiB body changed on the way"
    );
    assert_eq!(e.header("content-length"), Some("262144"));
}

#[tokio::test]
async fn a_trusted_proxy_keeps_its_forwarded_proto_and_host() {
    let up = upstream().await;
    let gw = start_gateway(
        &format!("client_ip: {{trusted_proxies: [127.0.0.1/32]}}\n{PROXY}")
            .replace("UP", &format!("\"{}\"", up.url())),
    )
    .await;
    let r = get(
        &url(gw.addr, "/"),
        &[
            ("host", "internal:8080"),
            ("x-forwarded-for", "203.0.113.5"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "www.example.com"),
        ],
    )
    .await;
    let e = r.echo();
    assert_eq!(e.header("x-forwarded-for"), Some("203.0.113.5, 127.0.0.1"));
    assert_eq!(e.header("x-forwarded-proto"), Some("https"));
    assert_eq!(e.header("x-forwarded-host"), Some("www.example.com"));
    assert_eq!(e.header("host"), Some("internal:8080"));
}

/// The fields the upstream got for `req`, sent on a fresh connection, as
/// `name: value` (lower-case names, in order).
async fn received(gw: &Running, req: &str) -> Vec<String> {
    let mut s = connect(gw.addr).await;
    s.write_all(req.as_bytes()).await.expect("write");
    let (head, body) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1."), "{head}");
    let echo: Echo = serde_json::from_str(&body).unwrap_or_else(|_| panic!("{head}{body}"));
    echo.headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}"))
        .collect()
}

fn lines(l: &[&str]) -> Vec<String> {
    l.iter().map(|s| s.to_string()).collect()
}

/// The fields an upstream receives, in order and exactly: the client's (hop-by-hop
/// ones gone, `Host` and `X-Forwarded-*` the client sent replaced where they
/// stood), then the `X-Forwarded-*` sluice adds, then what framing adds; from a
/// trusted proxy and from anyone else, on plain requests and on hyper's.
#[tokio::test]
async fn the_upstream_gets_the_clients_fields_in_order_then_the_forwarded_ones() {
    let up = upstream().await;
    let config = |trusted: &str| {
        format!(
            "client_ip: {{trusted_proxies: [{trusted}]}}\nupstreams:\n  app: {{targets: [\"{}\"]}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n",
            up.url()
        )
    };
    let untrusted = start_gateway(&config("10.9.9.9/32")).await;
    let trusted = start_gateway(&config("127.0.0.1/32")).await;
    let peer = "127.0.0.1";
    for (gw, trusted) in [(&untrusted, false), (&trusted, true)] {
        // A plain request.
        assert_eq!(
            received(gw, "GET /a HTTP/1.1\r\nHost: h\r\nX-A: 1\r\n\r\n").await,
            lines(&[
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ]),
        );
        // The client's own, before `Host`.
        let req = "GET /a HTTP/1.1\r\nx-forwarded-proto: https\r\nX-Forwarded-For: 1.2.3.4\r\nx-forwarded-host: other\r\nHost: h\r\nX-A: 1\r\n\r\n";
        let got = received(gw, req).await;
        let (proto, host) = if trusted {
            ("https", "other")
        } else {
            ("http", "h")
        };
        assert_eq!(
            got,
            lines(&[
                &format!("x-forwarded-proto: {proto}"),
                &format!("x-forwarded-for: 1.2.3.4, {peer}"),
                &format!("x-forwarded-host: {host}"),
                "host: h",
                "x-a: 1",
            ]),
        );
        // Claims only a trusted proxy may make; a field `Connection` names.
        let req = "GET /a HTTP/1.1\r\nforwarded: for=1.1.1.1\r\nhost: h\r\nx-real-ip: 1.1.1.1\r\nconnection: x-b\r\nx-b: 2\r\nx-a: 1\r\nte: trailers\r\n\r\n";
        let got = received(gw, req).await;
        let expected = if trusted {
            lines(&[
                "forwarded: for=1.1.1.1",
                "host: h",
                "x-real-ip: 1.1.1.1",
                "x-a: 1",
                "te: trailers",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ])
        } else {
            lines(&[
                "te: trailers",
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ])
        };
        assert_eq!(got, expected, "trusted: {trusted}");
        // No `Host`: the target's, last.
        let got = received(gw, "GET /a HTTP/1.0\r\nx-a: 1\r\n\r\n").await;
        assert_eq!(
            got,
            lines(&[
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                &format!("host: {}", up.addr),
            ]),
        );
        // Absolute form: its authority is the host.
        let got = received(gw, "GET http://abs.example/a HTTP/1.1\r\nhost: h\r\n\r\n").await;
        assert_eq!(
            got,
            lines(&[
                "host: abs.example",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: abs.example",
            ]),
        );
        // Bodies (hyper's): a length, and chunks.
        let got = received(
            gw,
            "POST /a HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\nx-a: 1\r\n\r\nhi",
        )
        .await;
        assert_eq!(
            got,
            lines(&[
                "host: h",
                "content-length: 2",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
            ]),
        );
        let got = received(
            gw,
            "POST /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(
            got,
            lines(&[
                "host: h",
                "x-a: 1",
                "x-forwarded-for: 127.0.0.1",
                "x-forwarded-proto: http",
                "x-forwarded-host: h",
                "transfer-encoding: chunked",
            ]),
        );
    }
    untrusted.shutdown().await;
    trusted.shutdown().await;
}

#[tokio::test]
async fn absolute_form_authority_decides_route_and_host_alike() {
    // RFC 9112 §3.2.2: with an absolute-form target, the target's authority is the
    // host and `Host` is ignored; a proxy replaces `Host` with it. Routing and
    // forwarding must agree, or a client picks an unlimited route for one host
    // while the upstream serves another.
    let up = upstream().await;
    let gw = start_gateway(
        &r#"
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: limited, match: {host: api.example.com}, upstream: api, key: ip, limits: [{name: one, algorithm: sliding_log, limit: 1, window: 1m}]}
  - {name: free, match: {host: free.example.com}, upstream: api}
"#
        .replace("UP", &up.url()),
    )
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET http://free.example.com/x HTTP/1.1\r\nhost: api.example.com\r\n\r\n")
        .await
        .unwrap();
    let (head, body) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
    let e: Echo = serde_json::from_str(&body).expect("an echo");
    assert_eq!(e.uri, "/x");
    assert_eq!(e.header("host"), Some("free.example.com"));
    assert_eq!(e.header("x-forwarded-host"), Some("free.example.com"));
}

#[tokio::test]
async fn transfer_encoding_overrides_content_length() {
    // RFC 9112 §6.3: with both, the chunked framing counts and Content-Length must
    // not be forwarded, or the upstream would cut the body at 5 bytes.
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let mut s = connect(gw.addr).await;
    let req = "POST /te HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\nb\r\nhello world\r\n0\r\n\r\n";
    s.write_all(req.as_bytes()).await.unwrap();
    match read_response(&mut s).await {
        // Refusing the ambiguous request outright is also correct.
        Some((head, _)) if head.starts_with("HTTP/1.1 400 ") => assert_eq!(up.hits(), 0),
        Some((head, body)) => {
            assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
            let e: Echo = serde_json::from_str(&body).expect("an echo");
            assert_eq!(e.body, "hello world");
            assert_ne!(e.header("content-length"), Some("5"));
        }
        None => panic!("no answer"),
    }
}

// === the answer: what the client receives ===

#[tokio::test]
async fn statuses_headers_and_bodies_come_back_unchanged() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let c = http1();
    for status in ["201", "404", "500", "503"] {
        let r = c
            .get(
                &url(gw.addr, "/s"),
                &[("x-reply-status", status), ("x-reply-header", "x-up=hello")],
            )
            .await;
        assert_eq!(r.status.to_string(), status);
        assert_eq!(r.header("x-up"), Some("hello"));
        assert_eq!(r.echo().uri, "/s");
    }
    // Hop-by-hop headers of the upstream's answer stop at sluice too.
    for (name, value) in [
        ("keep-alive", "timeout=5"),
        ("proxy-connection", "keep-alive"),
        ("x-ok", "1"),
    ] {
        let r = c
            .get(
                &url(gw.addr, "/h"),
                &[("x-reply-header", &format!("{name}={value}"))],
            )
            .await;
        let want = (name == "x-ok").then_some(value);
        assert_eq!(r.header(name), want, "{name} in the answer");
    }
    let mib = 1 << 20;
    let r = c
        .get(
            &url(gw.addr, "/big"),
            &[("x-reply-bytes", &mib.to_string())],
        )
        .await;
    assert_eq!((r.status, r.body.len()), (200, mib));
    assert!(r.body == pattern(mib), "the 1 MiB body changed on the way");
}

/// The answers the upstream of `an_answers_hop_by_hop_fields_go_wherever_they_stand`
/// gives, by request path (`/0`, `/1`, ...).
const HOP_BY_HOP_ANSWERS: &[&str] = &[
    // As nginx answers: `Connection` last.
    "HTTP/1.1 200 OK\r\nServer: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    // `Connection` in the middle.
    "HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive\r\nContent-Type: text/plain\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok",
    // Naming a field.
    "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nContent-Length: 2\r\nConnection: keep-alive, X-A\r\n\r\nok",
    // Twice, and `Keep-Alive`.
    "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nX-A: 1\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    // Upper case, and a field of the same name as a later one.
    "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nx-a: 3\r\nContent-Length: 2\r\nCONNECTION: Keep-Alive\r\n\r\nok",
    // `close` (the connection closes after it), naming a field `close`.
    "HTTP/1.1 200 OK\r\nClose: x\r\nX-A: 1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
];

/// The client's view: the head's lines without `date`.
const HOP_BY_HOP_SEEN: &[&[&str]] = &[
    &[
        "HTTP/1.1 200 OK",
        "server: x",
        "content-type: text/plain",
        "content-length: 2",
    ],
    &[
        "HTTP/1.1 200 OK",
        "server: x",
        "content-length: 2",
        "content-type: text/plain",
        "x-a: 1",
    ],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-b: 2"],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-a: 1"],
    &[
        "HTTP/1.1 200 OK",
        "x-a: 1",
        "x-a: 3",
        "x-b: 2",
        "content-length: 2",
    ],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-a: 1"],
];

/// The fields of an upstream's answer as the client gets them, in order and
/// exactly: hop-by-hop ones (`Connection`, what it names, `Keep-Alive`) gone
/// wherever they stood, the rest kept in the order the answer's map gives them.
#[tokio::test]
async fn an_answers_hop_by_hop_fields_go_wherever_they_stand() {
    let (up, _) = raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let path = head.split(' ').nth(1).unwrap_or("/0");
            let i: usize = path.trim_start_matches('/').parse().unwrap_or(0);
            if s.write_all(HOP_BY_HOP_ANSWERS[i].as_bytes()).await.is_err()
                || HOP_BY_HOP_ANSWERS[i].contains("close")
            {
                return;
            }
        }
    })
    .await;
    let gw = start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"http://{up}\"]}}\nroutes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    // Twice each: on a new upstream connection, then on a kept one.
    for round in 0..2 {
        let mut c = connect(gw.addr).await;
        for (i, expected) in HOP_BY_HOP_SEEN.iter().enumerate() {
            let req = format!("GET /{i} HTTP/1.1\r\nhost: h\r\n\r\n");
            c.write_all(req.as_bytes()).await.expect("write");
            let (head, body) = read_response(&mut c).await.expect("an answer");
            let lines: Vec<&str> = head
                .split("\r\n")
                .filter(|l| !l.is_empty() && !l.starts_with("date:"))
                .collect();
            assert_eq!(lines, *expected, "round {round}, answer {i}");
            assert_eq!(body, "ok");
        }
    }
    gw.shutdown().await;
}

/// The answer the upstream gives to a request for `path` (GET; a HEAD gets the
/// head alone), and whether it closes after it.
fn upstream_answer(path: &str) -> (String, bool) {
    let many: String = (0..20).map(|i| format!("X-Field-{i}: v{i}\r\n")).collect();
    let (head, body, close) = match path {
        "/nginx" => (
            "HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Sun, 22 Nov 2026 10:00:00 GMT\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/nodate" => (
            "HTTP/1.1 201 Created\r\nX-Mixed-Case: Value\r\nLocation: /things/7\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "hello",
            false,
        ),
        "/spaced" => (
            "HTTP/1.1 200 OK\r\nContent-Type:text/plain\r\nX-A:   padded  \r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/repeat" => (
            "HTTP/1.1 200 OK\r\nSet-Cookie: a=1\r\nX-B: 1\r\nSet-Cookie: b=2\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/close" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n".to_owned(),
            "ok\n",
            true,
        ),
        "/hop" => (
            "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/rate" => (
            "HTTP/1.1 200 OK\r\nRateLimit: \"up\";r=1;t=1\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/zero" => ("HTTP/1.1 200 OK\r\nServer: s\r\nContent-Length: 0\r\n\r\n".to_owned(), "", false),
        "/chunked" => (
            "HTTP/1.1 200 OK\r\nServer: s\r\nTransfer-Encoding: chunked\r\n\r\n".to_owned(),
            "3\r\nok\n\r\n0\r\n\r\n",
            false,
        ),
        "/http10" => ("HTTP/1.0 200 OK\r\nServer: s\r\nContent-Length: 3\r\n\r\n".to_owned(), "ok\n", true),
        "/connlist" => (
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: keep-alive, x-foo\r\nX-Foo: 1\r\nX-Bar: 2\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        "/404" => (
            "HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n".to_owned(),
            "{}",
            false,
        ),
        "/reason" => ("HTTP/1.1 200 Fine\r\nServer: s\r\nContent-Length: 3\r\n\r\n".to_owned(), "ok\n", false),
        "/many" => (format!("HTTP/1.1 200 OK\r\n{many}Content-Length: 3\r\n\r\n"), "ok\n", false),
        "/trailer" => (
            "HTTP/1.1 200 OK\r\nTrailer: x-sum\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
        // No body, whatever the length says: read for their heads alone.
        "/notmod" => (
            "HTTP/1.1 304 Not Modified\r\nETag: \"x\"\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "",
            false,
        ),
        "/nocontent" => (
            "HTTP/1.1 204 No Content\r\nServer: s\r\nContent-Length: 5\r\n\r\n".to_owned(),
            "",
            false,
        ),
        _ => (
            "HTTP/1.1 200 OK\r\nServer: s\r\nDate: Sun, 22 Nov 2026 10:00:00 GMT\r\nContent-Length: 3\r\n\r\n".to_owned(),
            "ok\n",
            false,
        ),
    };
    (format!("{head}{body}"), close)
}

/// Serves each request on a connection with `upstream_answer`.
async fn serve_answers(mut s: TcpStream) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            match s.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end + 4);
        let mut first = head.split(' ');
        let (method, path) = (first.next().unwrap_or(""), first.next().unwrap_or(""));
        let (answer, close) = upstream_answer(path.strip_prefix("/limited").unwrap_or(path));
        let answer = if method == "HEAD" {
            answer[..answer.find("\r\n\r\n").unwrap() + 4].to_owned()
        } else {
            answer
        };
        if s.write_all(answer.as_bytes()).await.is_err() || close {
            return;
        }
    }
}

/// The head with the value of the `date` line sluice writes (it changes by the
/// second) left out; nothing else changed.
fn fixed_date(text: &str) -> String {
    text.split("\r\n")
        .map(|l| match l.strip_prefix("date: ") {
            Some(d) if d != "Sun, 22 Nov 2026 10:00:00 GMT" => "date: (now)",
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// Upstream answers as servers write them (capitalised names, `name:value`, repeated
/// fields, hop-by-hop ones, a `Connection` last), through the plain-request server
/// and through hyper's: the client gets the same bytes from both, rate-limit
/// fields included. (The plain-request server writes the fields of most answers
/// as they came, without a header map in between: this holds it to what the map
/// gives; a 204 or 304 with a length goes through the map after all.)
#[tokio::test]
async fn the_client_gets_each_upstream_answer_as_hyper_writes_it() {
    let (up, _) = raw_upstream(serve_answers).await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["http://{up}"]}}
routes:
  - name: limited
    match: {{path_prefix: /limited}}
    upstream: app
    key: header:x-key
    limits: [{{name: perkey, algorithm: gcra, rate: 1000/s, burst: 1000}}]
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#
    ))
    .await;
    let paths = [
        "/nginx",
        "/nodate",
        "/spaced",
        "/repeat",
        "/close",
        "/hop",
        "/rate",
        "/zero",
        "/chunked",
        "/http10",
        "/connlist",
        "/404",
        "/reason",
        "/many",
        "/trailer",
        "/notmod",
        "/nocontent",
        "/other",
    ];
    let requests = [
        "GET {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\n\r\n",
        "GET {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\nconnection: close\r\n\r\n",
        "GET {p} HTTP/1.0\r\nhost: h\r\nx-key: k\r\n\r\n",
        "GET {p} HTTP/1.0\r\nhost: h\r\nx-key: k\r\nconnection: keep-alive\r\n\r\n",
        "HEAD {p} HTTP/1.1\r\nhost: h\r\nx-key: k\r\n\r\n",
    ];
    let mut compared = 0;
    for prefix in ["", "/limited"] {
        for path in paths {
            for req in requests {
                // A key of its own for each, so both get the same remaining count.
                let req = req.replace("{p}", &format!("{prefix}{path}"));
                let fast_req = req.replace("x-key: k", &format!("x-key: {compared}-fast"));
                let slow_req = req.replace("x-key: k", &format!("x-key: {compared}-slow"));
                let mut fast = connect(gw.addr).await;
                let mut slow = hyper_connection(gw.addr).await;
                let head_only =
                    req.starts_with("HEAD") || ["/notmod", "/nocontent"].contains(&path);
                let (fast_text, hyper_text) = if head_only {
                    fast.write_all(fast_req.as_bytes()).await.expect("write");
                    slow.write_all(slow_req.as_bytes()).await.expect("write");
                    (
                        read_head(&mut fast).await.expect("a head"),
                        read_head(&mut slow).await.expect("a head"),
                    )
                } else {
                    fast.write_all(fast_req.as_bytes()).await.expect("write");
                    slow.write_all(slow_req.as_bytes()).await.expect("write");
                    let (fh, fb) = read_response(&mut fast).await.expect("an answer");
                    let (sh, sb) = read_response(&mut slow).await.expect("an answer");
                    (format!("{fh}{fb}"), format!("{sh}{sb}"))
                };
                assert_eq!(fixed_date(&fast_text), fixed_date(&hyper_text), "{req}");
                if prefix == "/limited" {
                    assert!(
                        fast_text.contains("\r\nratelimit: \"perkey\";r="),
                        "{fast_text}"
                    );
                }
                compared += 1;
            }
        }
    }
    assert_eq!(compared, 2 * 18 * 5);
    gw.shutdown().await;
}

// === trailers and upgrades: passed on both ways ===

#[tokio::test]
async fn chunked_bodies_and_trailers_come_through() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let trailer = [("x-reply-trailer", "grpc-status=0")];
    // Directly, a client that accepts trailers (TE: trailers) gets them from an
    // upstream that announces them (Trailer): the reference.
    let with_te = [trailer[0], ("te", "trailers")];
    let direct = http1().get(&format!("{}/t", up.url()), &with_te).await;
    assert_eq!(
        direct.trailers.as_ref().map(|t| &t["grpc-status"]),
        Some(&HeaderValue::from_static("0"))
    );

    for (name, client) in [("http/1.1", http1()), ("h2c", h2c())] {
        let r = client.get(&url(gw.addr, "/t"), &with_te).await;
        assert_eq!(r.status, 200, "{name}");
        let e = r.echo();
        assert_eq!(e.uri, "/t", "{name}");
        // TE is hop-by-hop; sluice says for itself that it passes trailers on.
        assert_eq!(e.header("te"), Some("trailers"), "{name}");
        let trailers = r.trailers.unwrap_or_else(|| panic!("{name}: no trailers"));
        assert_eq!(trailers["grpc-status"], "0", "{name}");
    }
}

#[tokio::test]
async fn upgrades_are_spliced_both_ways() {
    let up = upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /ws HTTP/1.1\r\nhost: app.example.com\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 101 "), "{head:?}");
    let lower = head.to_ascii_lowercase();
    assert!(lower.contains("\r\nupgrade: websocket\r\n"), "{head:?}");
    assert!(lower.contains("\r\nconnection: upgrade\r\n"), "{head:?}");
    for msg in [&b"ping"[..], b"hello, upgraded world", &pattern(64 << 10)] {
        s.write_all(msg).await.unwrap();
        let mut back = vec![0; msg.len()];
        bounded("echo", s.read_exact(&mut back)).await.unwrap();
        assert!(back == msg, "{} bytes came back changed", msg.len());
    }
    s.shutdown().await.unwrap();
    assert_eq!(read_to_close(&mut s).await, "");
}

// === h2c: the same answers ===

#[tokio::test]
async fn h2c_clients_get_the_same_answers() {
    let up = upstream().await;
    let gw = start_gateway(
        &r#"
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: hello
    match: {path: /hello}
    key: ip
    limits: [{name: two, algorithm: sliding_log, limit: 2, window: 1m}]
    respond: {body: "hi\n"}
  - {name: api, match: {path_prefix: /api/}, upstream: api}
"#
        .replace("UP", &up.url()),
    )
    .await;
    let c = h2c();
    let r = c
        .get(&url(gw.addr, "/api/x?y=1"), &[("x-custom", "v")])
        .await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    assert_eq!(
        (e.version.as_str(), e.uri.as_str()),
        ("HTTP/1.1", "/api/x?y=1")
    );
    let authority = gw.addr.to_string();
    assert_eq!(e.header("host"), Some(authority.as_str()));
    assert_eq!(e.header("x-forwarded-host"), Some(authority.as_str()));
    assert_eq!(e.header("x-custom"), Some("v"));

    for left in [1, 0] {
        let r = c.get(&url(gw.addr, "/hello"), &[]).await;
        assert_eq!(
            (r.status, r.text(), r.num("x-ratelimit-remaining")),
            (200, "hi\n", left)
        );
    }
    let r = c.get(&url(gw.addr, "/hello"), &[]).await;
    assert_eq!(r.status, 429);
    assert!(
        r.text()
            .starts_with(r#"rate limit "two" of route "hello" exceeded; retry in "#),
        "{}",
        r.text()
    );
    let retry = r.num("retry-after");
    assert!((59..=60).contains(&retry), "Retry-After {retry}");
}

// === TLS: to upstreams, and terminated ===

#[tokio::test]
async fn https_upstream_with_a_private_ca() {
    let (up, ca) = tls_upstream().await;
    let target = format!("https://{}", up.addr);
    let gw = start_gateway(
        &r#"
upstreams:
  api: {targets: ["TARGET"], tls_ca: "CA"}
routes:
  - {name: api, match: {path_prefix: /}, upstream: api}
"#
        .replace("TARGET", &target)
        .replace("CA", &ca.path().display().to_string()),
    )
    .await;
    let r = get(&url(gw.addr, "/secure?x=1"), &[("host", "app.example.com")]).await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    assert_eq!(
        (e.uri.as_str(), e.header("host")),
        ("/secure?x=1", Some("app.example.com"))
    );
    assert_eq!(e.header("x-forwarded-for"), Some("127.0.0.1"));
    assert_eq!(up.hits(), 1);
}

#[tokio::test]
async fn https_upstream_with_an_unknown_ca_is_502() {
    let (up, _ca) = tls_upstream().await;
    let gw = proxy_to(&[format!("https://{}", up.addr)]).await;
    let r = get(&url(gw.addr, "/"), &[]).await;
    assert_eq!((r.status, r.text()), (502, "upstream unavailable\n"));
    assert_eq!(up.hits(), 0);
    assert_eq!(upstream_errors(&gw).await, [1.0, 0.0, 0.0]);
}

#[tokio::test]
async fn tls_termination_tells_the_upstream_https() {
    let up = upstream().await;
    let certs = self_signed();
    let gw = start_gateway(
        &r#"
server: {listen: "127.0.0.1:0", request_header_timeout: 1s, tls: {cert: "CERT", key: "KEY"}}
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: api, match: {path_prefix: /}, upstream: api}
"#
        .replace("CERT", &certs.cert_pem.path().display().to_string())
        .replace("KEY", &certs.key_pem.path().display().to_string())
        .replace("UP", &up.url()),
    )
    .await;
    let r = https(std::slice::from_ref(&certs.cert))
        .get(&format!("https://{}/s?x=1", gw.addr), &[])
        .await;
    assert_eq!(r.status, 200);
    let e = r.echo();
    assert_eq!(e.uri, "/s?x=1");
    assert_eq!(e.header("x-forwarded-proto"), Some("https"));
    assert_eq!(e.header("x-forwarded-for"), Some("127.0.0.1"));

    // A client that never starts its handshake is cut off like a slow one.
    let mut s = connect(gw.addr).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), read_to_close(&mut s))
        .await
        .expect("the connection is still open after 5 s");
    assert_eq!(answer, "");
}

/// A TLS connection to the gateway offering `alpn`, trusting `certs`.
async fn tls_connect(
    addr: std::net::SocketAddr,
    certs: &SelfSigned,
    alpn: &[&[u8]],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(certs.cert.clone()).expect("root certificate");
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    let name = rustls_pki_types::ServerName::try_from("127.0.0.1").expect("a name");
    let tcp = connect(addr).await;
    bounded(
        "TLS handshake",
        tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)).connect(name, tcp),
    )
    .await
    .expect("handshake")
}

/// Under TLS, HTTP/1.1 (chosen by ALPN, or with none offered) is served as on a
/// plain connection, by the same server: a chunked upload that waits for
/// `100 Continue`, then an upgrade on the same connection. h2 chosen by ALPN is
/// HTTP/2, and so is a connection with no ALPN that starts with the h2 preface.
#[tokio::test]
async fn tls_http1_is_served_as_plain_http1_and_h2_by_alpn_is_http2() {
    let up = upstream().await;
    let certs = self_signed();
    let gw = start_gateway(
        &r#"
server: {listen: "127.0.0.1:0", tls: {cert: "CERT", key: "KEY"}}
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: api, match: {path_prefix: /}, upstream: api}
"#
        .replace("CERT", &certs.cert_pem.path().display().to_string())
        .replace("KEY", &certs.key_pem.path().display().to_string())
        .replace("UP", &up.url()),
    )
    .await;
    for alpn in [&[&b"http/1.1"[..]][..], &[]] {
        let mut s = tls_connect(gw.addr, &certs, alpn).await;
        s.write_all(b"POST /up HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\nexpect: 100-continue\r\n\r\n")
            .await
            .unwrap();
        let (interim, _) = read_response(&mut s).await.expect("an answer");
        assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n", "{alpn:?}");
        s.write_all(b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            .await
            .unwrap();
        let (head, body) = read_response(&mut s).await.expect("an answer");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        let e: Echo = serde_json::from_str(&body).expect("an echo");
        assert_eq!(
            (e.method.as_str(), e.body.as_str()),
            ("POST", "hello world")
        );
        assert_eq!(e.header("x-forwarded-proto"), Some("https"));
        s.write_all(
            b"GET /ws HTTP/1.1\r\nhost: h\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\nping",
        )
        .await
        .unwrap();
        let (head, _) = read_response(&mut s).await.expect("an answer");
        assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
        let mut back = [0u8; 4];
        bounded("echo", s.read_exact(&mut back)).await.unwrap();
        assert_eq!(&back, b"ping");
    }
    // h2 by ALPN, or with no ALPN by its preface (prior knowledge): the preface and
    // an empty SETTINGS frame, and the server's SETTINGS come back.
    for alpn in [&[&b"h2"[..], b"http/1.1"][..], &[]] {
        let mut s = tls_connect(gw.addr, &certs, alpn).await;
        let chosen = s.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
        assert_eq!(chosen, alpn.first().map(|p| p.to_vec()));
        s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
            .await
            .unwrap();
        let mut frame = [0u8; 9];
        bounded("SETTINGS", s.read_exact(&mut frame)).await.unwrap();
        assert_eq!(frame[3], 4, "{frame:?}");
    }
    assert_eq!(up.hits(), 4);
}

// === what sluice adds: balancing and its answers to upstream failures ===

#[tokio::test]
async fn requests_go_round_robin_over_targets() {
    let (a, b) = (upstream().await, upstream().await);
    let gw = proxy_to(&[a.url(), b.url()]).await;
    let c = http1();
    assert_eq!(statuses(&c, 10, &url(gw.addr, "/"), &[]).await, [200; 10]);
    assert_eq!((a.hits(), b.hits()), (5, 5));
}

/// The count of `sluice_upstream_errors_total` of route `api` for each kind.
async fn upstream_errors(gw: &Running) -> [f64; 3] {
    let m = metrics(gw.admin_addr).await;
    ["connect", "timeout", "reset"].map(|kind| {
        metric(
            &m,
            &format!("sluice_upstream_errors_total{{kind=\"{kind}\",route=\"api\"}}"),
        )
        .unwrap_or(0.0)
    })
}

#[tokio::test]
async fn a_closed_port_is_502_connect() {
    let gw = proxy_to(&[format!("http://127.0.0.1:{}", free_port())]).await;
    let r = get(&url(gw.addr, "/"), &[]).await;
    assert_eq!((r.status, r.text()), (502, "upstream unavailable\n"));
    assert_eq!(upstream_errors(&gw).await, [1.0, 0.0, 0.0]);
}

#[tokio::test]
async fn a_slow_upstream_is_504_timeout() {
    let up = upstream_with(UpstreamOpts {
        delay: Duration::from_secs(3),
        ..Default::default()
    })
    .await;
    let gw = start_gateway(
        &r#"
upstreams:
  api: {targets: ["UP"], timeout: 300ms}
routes:
  - {name: api, match: {path_prefix: /}, upstream: api}
"#
        .replace("UP", &up.url()),
    )
    .await;
    let started = Instant::now();
    let r = get(&url(gw.addr, "/"), &[]).await;
    let took = started.elapsed();
    assert_eq!(
        (r.status, r.text()),
        (504, "upstream did not answer in time\n")
    );
    assert!(took >= Duration::from_millis(300), "504 after {took:?}");
    assert_eq!(upstream_errors(&gw).await, [0.0, 1.0, 0.0]);
}

#[tokio::test]
async fn an_upstream_closing_without_answer_is_502_reset() {
    let up = closing_upstream().await;
    let gw = proxy_to(&[up.url()]).await;
    let r = get(&url(gw.addr, "/"), &[]).await;
    assert_eq!((r.status, r.text()), (502, "upstream unavailable\n"));
    assert_eq!(up.hits(), 1);
    assert_eq!(upstream_errors(&gw).await, [0.0, 0.0, 1.0]);
}

// === what sluice adds: cutting off slow clients, capping connections ===

#[tokio::test]
async fn a_client_that_stalls_in_its_headers_is_cut_off() {
    let gw = start_gateway(
        r#"
server: {listen: "127.0.0.1:0", request_header_timeout: 1s}
routes:
  - {name: hello, match: {path: /}, respond: {body: hi}}
"#,
    )
    .await;
    let mut s = connect(gw.addr).await;
    let started = Instant::now();
    s.write_all(b"GET / HTTP/1.1\r\n").await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(5), read_to_close(&mut s))
        .await
        .expect("the connection is still open after 5 s");
    let took = started.elapsed();
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 408 "),
        "{answer:?}"
    );
    assert!(
        took >= Duration::from_millis(900),
        "cut off after {took:?}, before the timeout"
    );
}

#[tokio::test]
async fn silent_sockets_and_half_prefaces_do_not_hold_connection_slots() {
    let gw = start_gateway(
        r#"
server: {listen: "127.0.0.1:0", max_connections: 2, request_header_timeout: 1s}
routes:
  - {name: hello, match: {path: /}, respond: {body: hi}}
"#,
    )
    .await;
    // Both slots taken: one socket says nothing, one stops inside the h2c preface.
    let silent = connect(gw.addr).await;
    let mut half = connect(gw.addr).await;
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let started = Instant::now();
    // Both are closed once the header timeout has passed ...
    for mut s in [silent, half] {
        let rest = tokio::time::timeout(Duration::from_secs(5), read_to_close(&mut s))
            .await
            .expect("an idle socket is still open after 5 s");
        assert_eq!(rest, "");
    }
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "closed too early"
    );
    // ... and a real client gets its slot.
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let (head, body) = tokio::time::timeout(Duration::from_secs(5), read_response(&mut s))
        .await
        .expect("no answer within 5 s")
        .expect("an answer");
    assert!(
        head.starts_with("HTTP/1.1 200 ") && body == "hi",
        "{head:?}"
    );
}

#[tokio::test]
async fn max_connections_caps_open_connections() {
    let gw = start_gateway(
        r#"
server: {listen: "127.0.0.1:0", max_connections: 2}
routes:
  - {name: hello, match: {path: /}, respond: {body: hi}}
"#,
    )
    .await;
    let request = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut s = connect(gw.addr).await;
        s.write_all(request).await.unwrap();
        let (head, body) = read_response(&mut s).await.expect("an answer");
        assert!(
            head.starts_with("HTTP/1.1 200 ") && body == "hi",
            "{head:?}"
        );
        open.push(s);
    }
    // The kernel completes the third handshake, but sluice does not take the
    // connection while two are open.
    let mut third = connect(gw.addr).await;
    third.write_all(request).await.unwrap();
    let mut byte = [0u8; 1];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut byte)).await;
    assert!(early.is_err(), "a third connection was served: {early:?}");
    drop(open.pop());
    let (head, _) = read_response(&mut third)
        .await
        .expect("an answer once a slot is free");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
}

#[tokio::test]
async fn early_answers_close_the_connection_so_an_unread_body_is_never_a_request() {
    let gw = start_gateway(
        r#"
routes:
  - {name: hello, match: {path: /hello}, respond: {body: hello}}
  - {name: smuggled, match: {path: /smuggled}, respond: {body: smuggled}}
"#,
    )
    .await;
    // The body of a request sluice refuses (404) without reading it is a whole
    // second request; it must not be answered.
    let inner = "GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let outer = format!(
        "POST /nowhere HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{inner}",
        inner.len()
    );
    let answer = exchange(gw.addr, outer.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 404 "), "{answer:?}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{answer:?}"
    );
    assert_eq!(answer.matches("HTTP/1.1 ").count(), 1, "{answer:?}");

    // A `respond` route does not read the body either; whether the connection is
    // closed or kept, the body is skipped: the next answer is the next request's.
    let outer = format!(
        "POST /hello HTTP/1.1\r\nhost: x\r\ncontent-length: {}\r\n\r\n{inner}GET /hello HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        inner.len()
    );
    let answer = exchange(gw.addr, outer.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer:?}");
    assert!(!answer.contains("smuggled"), "{answer:?}");
}

// === what sluice adds: its admin listener, reloads, shutdown ===

#[tokio::test]
async fn the_admin_listener_serves_health_and_metrics_behind_its_token() {
    let gw = start_gateway(
        r#"
admin: {listen: "127.0.0.1:0", token: t0k}
routes:
  - {name: hello, match: {path_prefix: /}, respond: {body: hi}}
"#,
    )
    .await;
    let c = http1();
    let admin = |path: &str| url(gw.admin_addr, path);
    let r = c.get(&admin("/healthz"), &[]).await;
    assert_eq!((r.status, r.text()), (200, "ok\n"));
    assert_eq!(c.get(&admin("/readyz"), &[]).await.status, 200);
    let r = c.get(&admin("/metrics"), &[]).await;
    assert_eq!(r.status, 200);
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/plain; version=0.0.4"));
    assert_eq!(
        metric(r.text(), r#"sluice_build_info{version="0.1.0"}"#),
        Some(1.0)
    );
    for auth in [
        &[][..],
        &[("authorization", "Bearer wrong")],
        &[("authorization", "t0k")],
    ] {
        let r = c.get(&admin("/admin/anything"), auth).await;
        assert_eq!(r.status, 401, "{auth:?}");
        assert_eq!(r.header("www-authenticate"), Some("Bearer"));
    }
    // Authorized (no such endpoint); the scheme is case-insensitive (RFC 9110 §11.1).
    for auth in ["Bearer t0k", "bearer t0k", "BEARER  t0k"] {
        let r = c
            .get(&admin("/admin/anything"), &[("authorization", auth)])
            .await;
        assert_eq!(r.status, 404, "{auth}");
    }
    // The gateway port does not serve the admin API.
    assert_eq!(c.get(&url(gw.addr, "/metrics"), &[]).await.text(), "hi");
}

#[tokio::test]
async fn a_rotated_admin_token_takes_effect_on_reload() {
    let config = r#"
admin: {listen: "127.0.0.1:0", token: TOKEN}
routes:
  - {name: hello, match: {path_prefix: /}, respond: {body: hi}}
"#;
    let (gw, file) = start_gateway_file(&config.replace("TOKEN", "old-secret")).await;
    let c = http1();
    let status = |token: &'static str| {
        let (c, u) = (&c, url(gw.admin_addr, "/admin/anything"));
        async move {
            c.get(&u, &[("authorization", &format!("Bearer {token}"))])
                .await
                .status
        }
    };
    assert_eq!(
        (status("old-secret").await, status("new-secret").await),
        (404, 401)
    );
    std::fs::write(file.path(), config.replace("TOKEN", "new-secret")).unwrap();
    gw.reload().await.expect("reload");
    assert_eq!(
        (status("old-secret").await, status("new-secret").await),
        (401, 404)
    );
}

#[tokio::test]
async fn shutdown_lets_requests_in_flight_finish() {
    let up = upstream_with(UpstreamOpts {
        delay: Duration::from_millis(500),
        ..Default::default()
    })
    .await;
    let gw = proxy_to(&[up.url()]).await;
    let addr = gw.addr;
    let in_flight = tokio::spawn(async move { get(&url(addr, "/slow"), &[]).await });
    for _ in 0..500 {
        if up.hits() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(up.hits(), 1, "the request never reached the upstream");
    bounded("shutdown", gw.shutdown()).await;
    let r = bounded("request in flight", in_flight).await.unwrap();
    assert_eq!((r.status, r.echo().uri.as_str()), (200, "/slow"));
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
}
