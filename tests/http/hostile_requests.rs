//! Requests written as an attacker writes them, byte by byte: path variants that
//! must not step around a route, malformed Host and method tokens, forwarding
//! headers a client must not forge, h2 cookie fields, and an upstream whose
//! response framing is ambiguous. Raw sockets where a client library would clean
//! the request up first.

use crate::common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

/// One request written raw on a new connection: the status, the lower-cased head
/// and the body of the answer.
async fn raw(addr: std::net::SocketAddr, request: &str) -> (u16, String, String) {
    raw_bytes(addr, request.as_bytes()).await
}

/// `raw` for a request that is not UTF-8 (a byte such as 0xA0 in a field).
async fn raw_bytes(addr: std::net::SocketAddr, request: &[u8]) -> (u16, String, String) {
    let mut s = connect(addr).await;
    s.write_all(request).await.expect("write");
    let (head, body) = read_response(&mut s).await.expect("an answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, head.to_ascii_lowercase(), body)
}

/// One h2c GET of `uri` (any authority: the connection goes to `addr`), with
/// `headers`; the status and body.
async fn h2_get(addr: std::net::SocketAddr, uri: &str, headers: Headers<'_>) -> (u16, String) {
    use http_body_util::{BodyExt, Empty};
    let io = hyper_util::rt::TokioIo::new(connect(addr).await);
    let (mut send, conn) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .expect("h2 handshake");
    tokio::spawn(conn);
    let mut req = http::Request::get(uri);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Empty::<bytes::Bytes>::new()).expect("request");
    let resp = bounded("h2 request", send.send_request(req))
        .await
        .expect("h2 response");
    let status = resp.status().as_u16();
    let body = bounded("h2 body", resp.into_body().collect())
        .await
        .expect("h2 body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// `METHOD TARGET HTTP/1.1` with `Host: h` and the extra header lines.
fn req(method: &str, target: &str, extra: &str) -> String {
    format!("{method} {target} HTTP/1.1\r\nhost: h\r\n{extra}connection: close\r\n\r\n")
}

/// `path: /login` (1 per minute and key `x-k`) before a loose catch-all, both to
/// the echo upstream `UP`.
const LOGIN: &str = r#"
upstreams:
  app: {targets: ["UP"]}
routes:
  - name: login
    match: {path: /login}
    upstream: app
    key: header:x-k
    limits: [{name: one, algorithm: fixed_window, limit: 1, window: 1m}]
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#;

/// A gateway with the upstream `app` at `up` and these `routes` (YAML list items).
async fn app_gateway(up: &str, routes: &str) -> Running {
    start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"{up}\"]}}\nroutes:\n{routes}"
    ))
    .await
}

/// The echo upstream's account of the request, from a response body.
fn echo_of(body: &str) -> Echo {
    serde_json::from_str(body).expect("an echo")
}

async fn login_gateway() -> (Upstream, Running) {
    let up = upstream().await;
    let gw = start_gateway(&LOGIN.replace("UP", &up.url())).await;
    (up, gw)
}

// === paths ===

#[tokio::test]
async fn path_variants_of_login_hit_the_login_route_and_reach_the_upstream_as_login() {
    let (_up, gw) = login_gateway().await;
    let variants = [
        "/%6Cogin",
        "/%6cogin",
        "/./login",
        "//login",
        "/x/../login",
        "/login/.",
        "/%2e/login",
        "/a/%2E%2e/login",
        "/x/%2e%2e/login",
        "///x//..//login",
    ];
    for (i, v) in variants.iter().enumerate() {
        let key = format!("x-k: k{i}\r\n");
        let (status, head, body) = raw(gw.addr, &req("GET", v, &key)).await;
        assert_eq!(status, 200, "{v}: {head}{body}");
        let e = echo_of(&body);
        assert_eq!(e.uri, "/login", "{v}");
        // The same key on the plain path: the variant was charged to /login.
        let (status, _, _) = raw(gw.addr, &req("GET", "/login", &key)).await;
        assert_eq!(status, 429, "{v} was not counted against /login");
    }
    let n = variants.len() as f64;
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "login"), [("allowed", n), ("limited", n)]);
    assert_eq!(decisions(&m, "rest"), []);
}

#[tokio::test]
async fn the_query_is_forwarded_untouched_after_a_normalised_path() {
    let (_up, gw) = login_gateway().await;
    let (status, _, body) = raw(
        gw.addr,
        &req("GET", "/a/./b/../%7Euser//x?p=%2e%2E/..&q=%6C", ""),
    )
    .await;
    assert_eq!(status, 200);
    let e = echo_of(&body);
    assert_eq!(e.uri, "/a/~user/x?p=%2e%2E/..&q=%6C");
    // Escapes that stay escaped get upper-case hex.
    let (_, _, body) = raw(gw.addr, &req("GET", "/caf%c3%a9/%3b", "")).await;
    let e = echo_of(&body);
    assert_eq!(e.uri, "/caf%C3%A9/%3B");
}

#[tokio::test]
async fn paths_that_cannot_be_normalised_safely_get_400() {
    let (up, gw) = login_gateway().await;
    let bad = [
        "/login%2f",
        "/login%2F",
        "/x%2F..%2Flogin",
        "/lo%00gin",
        "/../login",
        "/x/../../login",
        "/%2e%2e/login",
        "/..;/login",
        "/x/.;a/login",
        "/a\\login",
        "/a%5clogin",
        "/lo%zzgin",
        "/login%2",
        "/login%",
    ];
    for p in bad {
        let (status, head, body) = raw(gw.addr, &req("GET", p, "x-k: k\r\n")).await;
        assert_eq!(status, 400, "{p}: {head}{body}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{p}: {head}");
        assert!(body.starts_with("bad request: "), "{p}: {body:?}");
        assert_eq!(body.matches('\n').count(), 1, "{p}: {body:?}");
    }
    // Asterisk-form is refused too (as nginx does).
    let (status, _, _) = raw(gw.addr, &req("OPTIONS", "*", "")).await;
    assert_eq!(status, 400);
    assert_eq!(up.hits(), 0);
    let m = metrics(gw.admin_addr).await;
    let n = bad.len() as f64 + 1.0;
    assert_eq!(decisions(&m, "unmatched"), [("bad_request", n)]);
    assert_eq!(decisions(&m, "login"), []);
}

#[tokio::test]
async fn path_parameters_are_ignored_for_matching_and_forwarded_as_sent() {
    let (_up, gw) = login_gateway().await;
    // Java servers strip `;jsessionid=...` and serve /login: it is /login here too.
    let (status, _, body) = raw(gw.addr, &req("GET", "/login;foo=1", "x-k: a\r\n")).await;
    assert_eq!(status, 200);
    let e = echo_of(&body);
    assert_eq!(e.uri, "/login;foo=1");
    let (status, _, _) = raw(gw.addr, &req("GET", "/login", "x-k: a\r\n")).await;
    assert_eq!(status, 429);
    // `path` is exact: /login/ is another path (docs/request-path.md says how to cover both).
    let (status, _, body) = raw(gw.addr, &req("GET", "/login/", "x-k: a\r\n")).await;
    assert_eq!(status, 200);
    let e = echo_of(&body);
    assert_eq!(e.uri, "/login/");
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "login"), [("allowed", 1.0), ("limited", 1.0)]);
    assert_eq!(decisions(&m, "rest"), [("allowed", 1.0)]);
}

#[tokio::test]
async fn case_insensitive_matching_is_opt_in_per_route() {
    let gw = start_gateway(
        r#"
routes:
  - {name: admin, match: {path_prefix: /Admin/, case_insensitive: true}, respond: {body: "admin\n"}}
  - {name: login, match: {path: /login}, respond: {body: "login\n"}}
  - {name: regex, match: {path_regex: "^/users/[a-z]+$", case_insensitive: true}, respond: {body: "regex\n"}}
  - {name: rest, match: {path_prefix: /}, respond: {body: "rest\n"}}
"#,
    )
    .await;
    for (path, want) in [
        ("/LOGIN", "rest\n"),
        ("/Login", "rest\n"),
        ("/login", "login\n"),
        ("/admin/x", "admin\n"),
        ("/ADMIN/x", "admin\n"),
        ("/%41dmin/x", "admin\n"),
        ("/USERS/Bob", "regex\n"),
    ] {
        let (status, _, body) = raw(gw.addr, &req("GET", path, "")).await;
        assert_eq!((status, body.as_str()), (200, want), "{path}");
    }
}

#[tokio::test]
async fn absolute_form_and_h2_paths_are_normalised_too() {
    let (_up, gw) = login_gateway().await;
    let (status, _, body) = raw(
        gw.addr,
        &req("GET", "http://h/x/../%6Cogin?q=1", "x-k: abs\r\n"),
    )
    .await;
    assert_eq!(status, 200);
    let e = echo_of(&body);
    assert_eq!(e.uri, "/login?q=1");
    let (status, _, _) = raw(gw.addr, &req("GET", "/login", "x-k: abs\r\n")).await;
    assert_eq!(status, 429);

    let c = h2c();
    let r = c.get(&url(gw.addr, "//./%6Cogin"), &[("x-k", "h2")]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.echo().uri, "/login");
    let r = c.get(&url(gw.addr, "/login"), &[("x-k", "h2")]).await;
    assert_eq!(r.status, 429);
    let r = c.get(&url(gw.addr, "/login%2F"), &[("x-k", "h2b")]).await;
    assert_eq!(r.status, 400);
}

// === Host ===

#[tokio::test]
async fn a_missing_repeated_or_invalid_host_gets_400() {
    let up = upstream().await;
    let gw = app_gateway(
        &up.url(),
        r#"
  - {name: api, match: {host: api.example.com}, upstream: app}
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    let bad = [
        "GET / HTTP/1.1\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a\r\nhost: b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: api.example.com\r\nhost: api.example.com\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a, b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a,b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a@evil\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a:abc\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a:\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a:80x\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a:99999\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: \r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a..b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: a/b\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: [::1\r\nconnection: close\r\n\r\n",
        "GET / HTTP/1.1\r\nhost: .\r\nconnection: close\r\n\r\n",
        // Absolute-form still needs a Host, and its authority is checked as well.
        "GET http://api.example.com/ HTTP/1.1\r\nconnection: close\r\n\r\n",
        "GET http://a@api.example.com/ HTTP/1.1\r\nhost: api.example.com\r\nconnection: close\r\n\r\n",
    ];
    for r in bad {
        let (status, head, body) = raw(gw.addr, r).await;
        assert_eq!(status, 400, "{r:?}: {head}{body}");
        assert!(head.contains("\r\nconnection: close\r\n"), "{r:?}: {head}");
    }
    assert_eq!(up.hits(), 0);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "unmatched"),
        [("bad_request", bad.len() as f64)]
    );

    // Accepted: ports, IP literals, and HTTP/1.0 without Host (as nginx does).
    for (r, route) in [
        (
            "GET / HTTP/1.1\r\nhost: api.example.com:8080\r\n\r\n",
            "api",
        ),
        ("GET / HTTP/1.1\r\nhost: API.Example.COM\r\n\r\n", "api"),
        ("GET / HTTP/1.1\r\nhost: 127.0.0.1:80\r\n\r\n", "rest"),
        ("GET / HTTP/1.1\r\nhost: [::1]:80\r\n\r\n", "rest"),
        ("GET / HTTP/1.1\r\nhost: my_host.internal\r\n\r\n", "rest"),
        ("GET / HTTP/1.0\r\n\r\n", "rest"),
    ] {
        let before = requests(&metrics(gw.admin_addr).await, route, "allowed");
        let (status, head, body) = raw(gw.addr, r).await;
        assert_eq!(status, 200, "{r:?}: {head}{body}");
        let after = requests(&metrics(gw.admin_addr).await, route, "allowed");
        assert_eq!(after, before + 1.0, "{r:?} did not go to {route}");
    }
}

#[tokio::test]
async fn a_trailing_dot_is_removed_from_the_host_before_routing_and_forwarding() {
    let up = upstream().await;
    let gw = app_gateway(
        &up.url(),
        r#"
  - {name: api, match: {host: api.example.com}, upstream: app, key: ip, limits: [{algorithm: fixed_window, limit: 1, window: 1m}]}
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    let (status, _, body) = raw(
        gw.addr,
        "GET / HTTP/1.1\r\nhost: api.example.com.:8080\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200);
    let e = echo_of(&body);
    assert_eq!(e.header("host"), Some("api.example.com:8080"));
    assert_eq!(e.header("x-forwarded-host"), Some("api.example.com:8080"));
    let (status, _, _) = raw(
        gw.addr,
        "GET http://api.example.com./ HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 429);
    let (status, _) = h2_get(gw.addr, "http://api.example.com./", &[]).await;
    assert_eq!(status, 429);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "api"), [("allowed", 1.0), ("limited", 2.0)]);
}

#[tokio::test]
async fn an_h2_authority_is_checked_like_a_host() {
    let up = upstream().await;
    let gw = app_gateway(
        &up.url(),
        r#"
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    let c = h2c();
    let port = gw.addr.port();
    let r = c.get(&format!("http://user@127.0.0.1:{port}/"), &[]).await;
    assert_eq!(r.status, 400, "{}", r.text());
    // A Host naming another authority than `:authority` (RFC 9113 §8.3.1).
    let r = c
        .get(&url(gw.addr, "/"), &[("host", "other.example.com")])
        .await;
    assert_eq!(r.status, 400, "{}", r.text());
    let r = c.get(&url(gw.addr, "/"), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(up.hits(), 1);
}

// === methods ===

#[tokio::test]
async fn lower_case_and_unknown_methods_get_400() {
    let up = upstream().await;
    let gw = app_gateway(
        &up.url(),
        r#"
  - name: login
    match: {path: /login, methods: [POST]}
    upstream: app
    key: ip
    limits: [{algorithm: fixed_window, limit: 1, window: 1m}]
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    for m in ["post", "Post", "GET2", "FOO", "G-E-T", "PRI"] {
        let (status, head, body) = raw(gw.addr, &req(m, "/login", "content-length: 0\r\n")).await;
        assert_eq!(status, 400, "{m}: {head}{body}");
    }
    assert_eq!(up.hits(), 0);
    for m in [
        "GET", "PUT", "DELETE", "PATCH", "OPTIONS", "PROPFIND", "MKCOL", "SEARCH",
    ] {
        let (status, _, body) = raw(gw.addr, &req(m, "/login", "content-length: 0\r\n")).await;
        assert_eq!(status, 200, "{m}: {body}");
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "unmatched"), [("bad_request", 6.0)]);
    assert_eq!(decisions(&m, "rest"), [("allowed", 8.0)]);
}

// === forwarding headers ===

const ECHO: &str = r#"
client_ip: {trusted_proxies: [TRUSTED]}
upstreams:
  app: {targets: ["UP"]}
routes:
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#;

#[tokio::test]
async fn forwarded_and_x_real_ip_from_an_untrusted_peer_are_removed() {
    let up = upstream().await;
    let sent = [
        ("forwarded", "for=1.2.3.4;proto=https"),
        ("x-real-ip", "1.2.3.4"),
    ];
    let untrusted = start_gateway(
        &ECHO
            .replace("UP", &up.url())
            .replace("TRUSTED", "10.0.0.0/8"),
    )
    .await;
    let trusted = start_gateway(
        &ECHO
            .replace("UP", &up.url())
            .replace("TRUSTED", "127.0.0.1/32"),
    )
    .await;
    for c in [http1(), h2c()] {
        let e = c.get(&url(untrusted.addr, "/"), &sent).await.echo();
        assert_eq!(e.all("forwarded"), Vec::<&str>::new());
        assert_eq!(e.all("x-real-ip"), Vec::<&str>::new());
        let e = c.get(&url(trusted.addr, "/"), &sent).await.echo();
        assert_eq!(e.header("forwarded"), Some("for=1.2.3.4;proto=https"));
        assert_eq!(e.header("x-real-ip"), Some("1.2.3.4"));
    }
}

// === h2 cookies ===

#[tokio::test]
async fn h2_cookie_fields_reach_an_http1_upstream_as_one_header() {
    let up = upstream().await;
    let gw = app_gateway(
        &up.url(),
        r#"
  - name: session
    match: {path: /s}
    upstream: app
    key: cookie:sid
    limits: [{algorithm: fixed_window, limit: 1, window: 1m}]
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    let c = h2c();
    let cookies = [("cookie", "a=1"), ("cookie", "sid=x"), ("cookie", "b=2")];
    let r = c.get(&url(gw.addr, "/s"), &cookies).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.echo().all("cookie"), ["a=1; sid=x; b=2"]);
    // The key is read from the joined header: the same session, in one field now.
    let r = c
        .get(&url(gw.addr, "/s"), &[("cookie", "b=2; sid=x")])
        .await;
    assert_eq!(r.status, 429);
    // Two fields each naming sid: two values, so the key is missing.
    let r = c
        .get(
            &url(gw.addr, "/s"),
            &[("cookie", "sid=y"), ("cookie", "sid=z")],
        )
        .await;
    assert_eq!(r.status, 400);
    // HTTP/1.1 requests are passed on as they came.
    let r = http1()
        .get(&url(gw.addr, "/x"), &[("cookie", "a=1"), ("cookie", "b=2")])
        .await;
    assert_eq!(r.echo().all("cookie"), ["a=1", "b=2"]);
}

// === responses ===

/// An upstream that answers every request with `response`, then closes.
async fn scripted_upstream(response: &'static str) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_head(&mut s).await.is_some() {
                    let _ = s.write_all(response.as_bytes()).await;
                    let _ = s.shutdown().await;
                }
            });
        }
    });
    format!("http://{addr}")
}

/// RFC 9112 §6.3: a response with both framings is an error (a smuggling attempt,
/// or a broken upstream), as nginx treats it: 502, never a body decoded one way.
#[tokio::test]
async fn a_response_with_content_length_and_transfer_encoding_is_502() {
    let up = scripted_upstream(
        "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\na\r\n0123456789\r\n6\r\nabcdef\r\n0\r\n\r\n",
    )
    .await;
    let gw = app_gateway(
        &up,
        r#"
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#,
    )
    .await;
    let (status, _, body) = raw(gw.addr, &req("GET", "/", "")).await;
    assert_eq!((status, body.as_str()), (502, "upstream unavailable\n"));
    let r = h2c().get(&url(gw.addr, "/"), &[]).await;
    assert_eq!((r.status, r.text()), (502, "upstream unavailable\n"));
}

// === respond ===

#[tokio::test]
async fn respond_answers_to_a_request_with_an_unread_body_close_the_connection() {
    let gw = start_gateway(
        r#"
routes:
  - {name: health, match: {path: /health}, respond: {body: "ok\n"}}
"#,
    )
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /health HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\n\r\nhello")
        .await
        .expect("write");
    let (head, body) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{head}"
    );
    assert_eq!(body, "ok\n");
    assert_eq!(read_to_close(&mut s).await, "");
    // Without a body the connection stays open.
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /health HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .expect("write");
    let (head, _) = read_response(&mut s).await.expect("an answer");
    assert!(
        !head.to_ascii_lowercase().contains("connection: close"),
        "{head}"
    );
}

// === client keys: one key, one spelling ===

/// A denied key, and routes keyed by a header, a query parameter and a cookie,
/// each falling back to the address (3 per minute), before a catch-all.
const KEYED: &str = r#"
deny: {keys: [leaked-key-123]}
upstreams:
  app: {targets: ["UP"]}
routes:
  - name: api
    match: {path_prefix: /api/}
    upstream: app
    key: header:x-api-key
    missing_key: ip
    limits: [{name: three, algorithm: fixed_window, limit: 3, window: 1m}]
  - name: q
    match: {path_prefix: /q/}
    upstream: app
    key: query:api_key
    limits: [{name: three, algorithm: fixed_window, limit: 3, window: 1m}]
  - name: c
    match: {path_prefix: /c/}
    upstream: app
    key: cookie:sid
    missing_key: ip
    limits: [{name: three, algorithm: fixed_window, limit: 3, window: 1m}]
  - {name: rest, match: {path_prefix: /}, upstream: app}
"#;

async fn keyed_gateway() -> (Upstream, Running) {
    let up = upstream().await;
    let gw = start_gateway(&KEYED.replace("UP", &up.url())).await;
    (up, gw)
}

/// `GET path` on HTTP/1.1 with one extra header line given as bytes.
fn get_with(path: &str, line: &[u8]) -> Vec<u8> {
    let mut r = format!("GET {path} HTTP/1.1\r\nhost: h\r\n").into_bytes();
    r.extend_from_slice(line);
    r.extend_from_slice(b"\r\nconnection: close\r\n\r\n");
    r
}

/// `POST path` with a body (so hyper, not the plain-request server, reads it) and
/// one extra header line given as bytes.
fn post_with(path: &str, line: &[u8]) -> Vec<u8> {
    let mut r = format!("POST {path} HTTP/1.1\r\nhost: h\r\n").into_bytes();
    r.extend_from_slice(line);
    r.extend_from_slice(b"\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi");
    r
}

/// Node trims an NBSP (and other Unicode white space) off a header value, so a key
/// with one is the same key to the upstream: a key value with any byte outside
/// printable ASCII is refused, on every path and whatever `missing_key` says.
#[tokio::test]
async fn a_key_with_a_byte_outside_printable_ascii_is_400_whatever_missing_key_says() {
    let (up, gw) = keyed_gateway().await;
    let header = "header x-api-key holds a byte outside printable ASCII (0x20-0x7E), which an upstream may read as another key\n";
    for request in [
        get_with("/api/x", b"x-api-key: leaked-key-123\xa0"),
        get_with("/api/x", b"x-api-key: leaked-key-123\xc2\xa0"),
        get_with("/api/x", b"x-api-key: \xc2\xa0leaked-key-123"),
        get_with("/api/x", b"x-api-key: leaked\tkey"),
        post_with("/api/x", b"x-api-key: leaked-key-123\xa0"),
    ] {
        let (status, head, body) = raw_bytes(gw.addr, &request).await;
        let shown = String::from_utf8_lossy(&request);
        assert_eq!((status, body.as_str()), (400, header), "{shown}: {head}");
    }
    let (status, body) = h2_get(
        gw.addr,
        "http://h/api/x",
        &[("x-api-key", "leaked-key-123\u{a0}")],
    )
    .await;
    assert_eq!((status, body.as_str()), (400, header));
    let query = "query parameter api_key holds a byte outside printable ASCII (0x20-0x7E), which an upstream may read as another key\n";
    for q in [
        "leaked-key-123%C2%A0",
        "leaked-key-123%A0",
        "%09leaked-key-123",
    ] {
        let (status, _, body) = raw(gw.addr, &req("GET", &format!("/q/x?api_key={q}"), "")).await;
        assert_eq!((status, body.as_str()), (400, query), "{q}");
    }
    let cookie = "cookie sid holds a byte outside printable ASCII (0x20-0x7E), which an upstream may read as another key\n";
    let (status, _, body) = raw(
        gw.addr,
        &req("GET", "/c/x", "cookie: sid=leaked-key-123%C2%A0\r\n"),
    )
    .await;
    assert_eq!((status, body.as_str()), (400, cookie));
    assert_eq!(up.hits(), 0);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "api"), [("bad_request", 6.0)]);
    assert_eq!(decisions(&m, "q"), [("bad_request", 3.0)]);
    assert_eq!(decisions(&m, "c"), [("bad_request", 1.0)]);
}

/// One to five NBSPs after a key used to be five more keys, each with a fresh
/// budget; the spaces and tabs HTTP trims (OWS) are the same key.
#[tokio::test]
async fn nbsp_and_ows_spellings_of_a_key_get_no_budget_of_their_own() {
    let (up, gw) = keyed_gateway().await;
    let mut got = Vec::new();
    for n in 1..=3 {
        let mut line = b"x-api-key: k".to_vec();
        line.extend(b"\xc2\xa0".repeat(n));
        got.push(raw_bytes(gw.addr, &get_with("/api/x", &line)).await.0);
    }
    for n in 4..=5 {
        let key = format!("k{}", "\u{a0}".repeat(n));
        got.push(
            h2_get(gw.addr, "http://h/api/x", &[("x-api-key", &key)])
                .await
                .0,
        );
    }
    for line in [
        &b"x-api-key: k"[..],
        b"x-api-key: k \t",
        b"x-api-key:\t k",
        b"x-api-key: k",
    ] {
        got.push(raw_bytes(gw.addr, &get_with("/api/x", line)).await.0);
    }
    assert_eq!(got, [400, 400, 400, 400, 400, 200, 200, 200, 429]);
    assert_eq!(up.hits(), 3);
}

/// WSGI servers fold `_` into `-` in header names, so `X_Api_Key` would be the key
/// to them: such headers are dropped before anything reads them, as nginx does
/// (`underscores_in_headers off`), on the plain path, hyper's and h2.
#[tokio::test]
async fn header_names_with_an_underscore_are_dropped_on_every_path() {
    let (up, gw) = keyed_gateway().await;
    for request in [
        get_with("/api/x", b"X_Api_Key: leaked-key-123"),
        post_with("/api/x", b"X_Api_Key: leaked-key-123"),
    ] {
        let (status, head, body) = raw_bytes(gw.addr, &request).await;
        assert_eq!(status, 200, "{head}{body}");
        let e = echo_of(&body);
        assert_eq!(e.all("x_api_key"), Vec::<&str>::new());
        assert_eq!(e.all("x-api-key"), Vec::<&str>::new());
    }
    let (status, body) = h2_get(
        gw.addr,
        "http://h/api/x",
        &[("x_api_key", "leaked-key-123")],
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(echo_of(&body).all("x_api_key"), Vec::<&str>::new());
    // All three fell back to the address: its budget of 3 is spent, whatever the
    // underscored header says.
    let (status, _, _) = raw_bytes(gw.addr, &get_with("/api/x", b"X_Api_Key: other")).await;
    assert_eq!(status, 429);
    assert_eq!(up.hits(), 3);
}

/// PHP reads `api.key`, `api key` and `api[key` as `api_key` (and the last value
/// wins): those names are the same parameter as the key's, so a denied key sent
/// so is denied and two spellings are a key sent twice.
#[tokio::test]
async fn php_spellings_of_a_query_name_are_the_key_parameter() {
    let (up, gw) = keyed_gateway().await;
    for q in [
        "api_key=x&api.key=leaked-key-123",
        "api.key=leaked-key-123",
        "api%2Ekey=leaked-key-123",
        "api+key=leaked-key-123",
        "api%20key=leaked-key-123",
        "api%5Bkey=leaked-key-123",
    ] {
        let (status, _, body) = raw(gw.addr, &req("GET", &format!("/q/x?{q}"), "")).await;
        assert_eq!((status, body.as_str()), (403, "access denied\n"), "{q}");
    }
    let (status, _, _) = raw(gw.addr, &req("GET", "/q/x?api_key=x&api.key=y", "")).await;
    assert_eq!(status, 400, "sent twice");
    let mut got = Vec::new();
    for q in ["api.key=z", "api_key=z", "api+key=z", "api_key=z"] {
        got.push(raw(gw.addr, &req("GET", &format!("/q/x?{q}"), "")).await.0);
    }
    assert_eq!(got, [200, 200, 200, 429]);
    assert_eq!(up.hits(), 3);
}

/// What a hostile probe found past the first round: PHP url-decodes cookie names
/// (`%73id` is `sid`) and values (`+` is a space), reads `api_key[]=bad` as the
/// array `['bad']` (equal to `'bad'` to loose comparisons), and Laravel trims
/// parameter values (`bad%20` is `bad`). Each spelling of a denied key is denied;
/// two spellings of one key share its budget.
#[tokio::test]
async fn php_and_laravel_readings_of_cookies_and_arrays_are_the_key() {
    let (up, gw) = keyed_gateway().await;
    for (path, extra) in [
        ("/c/x", "cookie: %73id=leaked-key-123; sid=fresh1\r\n"),
        ("/c/x", "cookie: %73%69d=leaked-key-123\r\n"),
        ("/c/x", "cookie: si%64=leaked-key-123\r\n"),
        ("/c/x", "cookie: sid=leaked-key-123%20\r\n"),
        ("/q/x?api_key[]=leaked-key-123", ""),
        ("/q/x?api_key[0]=leaked-key-123", ""),
        ("/q/x?api_key=leaked-key-123%20", ""),
    ] {
        let (status, _, body) = raw(gw.addr, &req("GET", path, extra)).await;
        assert_eq!(
            (status, body.as_str()),
            (403, "access denied\n"),
            "{path} {extra}"
        );
    }
    assert_eq!(up.hits(), 0);
    let mut got = Vec::new();
    for extra in [
        "sid=a+b",
        "sid=a%20b",
        "%73id=a+b",
        "sid=%20a%20b",
        "sid=a+b",
    ] {
        let line = format!("cookie: {extra}\r\n");
        got.push(raw(gw.addr, &req("GET", "/c/x", &line)).await.0);
    }
    assert_eq!(got, [200, 200, 200, 429, 429]);
    assert_eq!(up.hits(), 3);
}

// === respond: framing ===

/// Two pipelined requests to routes whose `respond.headers` state a length other
/// than the body's (a file `check` refuses, started without it): two answers, each
/// framed by its body, on the plain path and on hyper's.
#[tokio::test]
async fn respond_answers_are_framed_by_their_body_whatever_their_headers_say() {
    let up = upstream().await;
    let gw = start_unchecked(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
routes:
  - {{name: short, match: {{path: /short}}, respond: {{body: "ok\n", headers: {{content-length: "1"}}}}}}
  - {{name: long, match: {{path: /long}}, respond: {{body: "ok\n", headers: {{Content-Length: "100"}}}}}}
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    ))
    .await;
    let two = b"GET /short HTTP/1.1\r\nhost: h\r\n\r\nGET /long HTTP/1.1\r\nhost: h\r\n\r\n";
    for hyper in [false, true] {
        let mut s = if hyper {
            hyper_connection(gw.addr).await
        } else {
            connect(gw.addr).await
        };
        s.write_all(two).await.expect("write");
        for path in ["/short", "/long"] {
            let (head, body) = read_response(&mut s).await.expect("an answer");
            assert!(
                head.starts_with("HTTP/1.1 200 OK\r\n"),
                "{path} (hyper: {hyper}): {head}"
            );
            let lengths: Vec<&str> = head
                .split("\r\n")
                .filter(|l| l.to_ascii_lowercase().starts_with("content-length:"))
                .collect();
            assert_eq!(lengths, ["content-length: 3"], "{path} (hyper: {hyper})");
            assert_eq!(body, "ok\n", "{path} (hyper: {hyper})");
        }
    }
}
