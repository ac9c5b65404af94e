//! The admin API against browsers: cross-site request forgery and DNS rebinding.
//! A page elsewhere can make an operator's browser send requests to the loopback
//! admin listener; without a token nothing else protects it. Each rule with raw
//! requests (exact `Host`, `Origin`, `Sec-Fetch-Site` and `Content-Type` bytes) and
//! exact statuses, and that a refused request changed nothing.

use std::net::SocketAddr;

use crate::common::*;
use serde_json::Value;

const TOKEN: &str = "guard-s3cret";
const ROUTES: &str = "routes: [{name: r, match: {path_prefix: /}, respond: {body: ok}}]\n";

/// One request on a fresh connection: its status and body. `host` is sent as the
/// `Host` header as given; `body`, when not empty, with its `Content-Length`.
async fn raw(
    addr: SocketAddr,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if !body.is_empty() || method == "POST" || method == "DELETE" {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(body);
    let answer = exchange(addr, req.as_bytes()).await;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("{method} {path}: no status in {answer:?}"));
    (status, body.to_string())
}

fn local(addr: SocketAddr) -> String {
    format!("127.0.0.1:{}", addr.port())
}

async fn deny_list(addr: SocketAddr, auth: &[(&str, &str)]) -> Vec<Value> {
    let (status, body) = raw(addr, "GET", "/admin/deny", &local(addr), auth, "").await;
    assert_eq!(status, 200, "{body}");
    serde_json::from_str(&body).expect("JSON list")
}

/// The reviewer's request: a page on evil.example, its name rebound to 127.0.0.1,
/// posts a "simple" (no preflight) request that would deny every client.
#[tokio::test]
async fn the_reviewers_forged_deny_of_everyone_is_refused() {
    let gw = start_gateway(ROUTES).await;
    let a = gw.admin_addr;
    let (status, body) = raw(
        a,
        "POST",
        "/admin/deny",
        "evil.example",
        &[
            ("Content-Type", "text/plain"),
            ("Origin", "https://evil.example"),
        ],
        r#"{"ip":"0.0.0.0/0"}"#,
    )
    .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(body.matches('\n').count(), 1, "one line: {body:?}");
    assert_eq!(deny_list(a, &[]).await, Vec::<Value>::new());
    let c = http1();
    assert_eq!(c.get(&url(gw.addr, "/"), &[]).await.status, 200);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_body_must_be_sent_as_application_json() {
    let (gw, _file) = start_gateway_file(ROUTES).await;
    let a = gw.admin_addr;
    let h = local(a);
    let entry = r#"{"key":"k1"}"#;
    // What a form or a no-preflight fetch can send, and what is not JSON at all.
    for ct in [
        None,
        Some("text/plain"),
        Some("text/plain; charset=utf-8"),
        Some("application/x-www-form-urlencoded"),
        Some("multipart/form-data; boundary=x"),
        Some("application/jsonx"),
        Some("application/json-patch+json"),
        Some("text/json"),
    ] {
        let headers: Vec<_> = ct.map(|c| ("Content-Type", c)).into_iter().collect();
        for method in ["POST", "DELETE"] {
            let (status, body) = raw(a, method, "/admin/deny", &h, &headers, entry).await;
            assert_eq!(status, 415, "{method} with {ct:?}: {body}");
            assert_eq!(body, "Content-Type must be application/json\n");
        }
    }
    assert_eq!(deny_list(a, &[]).await, Vec::<Value>::new());
    // The media type is case-insensitive and may have parameters.
    for (i, ct) in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/json;charset=UTF-8",
    ]
    .iter()
    .enumerate()
    {
        let key = format!(r#"{{"key":"k{i}"}}"#);
        let headers = [("Content-Type", *ct)];
        let (status, body) = raw(a, "POST", "/admin/deny", &h, &headers, &key).await;
        assert_eq!(status, 201, "{ct}: {body}");
        let (status, body) = raw(a, "DELETE", "/admin/deny", &h, &headers, &key).await;
        assert_eq!(status, 204, "{ct}: {body}");
    }
    // `POST /admin/reload` takes no body: no Content-Type, or JSON, but not what a
    // form sends.
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (status, body) = raw(a, "POST", "/admin/reload", &h, &[("Content-Type", ct)], "").await;
        assert_eq!(status, 415, "reload with {ct}: {body}");
    }
    let m = metrics(a).await;
    assert_eq!(
        metric(&m, "sluice_config_reloads_total{result=\"success\"}"),
        Some(0.0)
    );
    for headers in [vec![], vec![("Content-Type", "application/json")]] {
        let (status, body) = raw(a, "POST", "/admin/reload", &h, &headers, "").await;
        assert_eq!(status, 200, "reload with {headers:?}: {body}");
    }
    // A wrong method is still 405, whatever it carries.
    let (status, _) = raw(
        a,
        "PUT",
        "/admin/deny",
        &h,
        &[("Content-Type", "text/plain")],
        entry,
    )
    .await;
    assert_eq!(status, 405);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_cross_site_request_is_refused_with_or_without_a_token() {
    for token in [None, Some(TOKEN)] {
        let admin = match token {
            Some(t) => format!("admin: {{listen: \"127.0.0.1:0\", token: {t}}}\n"),
            None => String::new(),
        };
        let gw = start_gateway(&format!("{admin}{ROUTES}")).await;
        let a = gw.admin_addr;
        let h = local(a);
        let bearer = format!("Bearer {TOKEN}");
        let auth: Vec<(&str, &str)> = token
            .map(|_| ("Authorization", bearer.as_str()))
            .into_iter()
            .collect();
        let with = |extra: &[(&'static str, String)]| {
            let mut v: Vec<(&str, String)> =
                auth.iter().map(|(k, v)| (*k, v.to_string())).collect();
            v.extend(extra.iter().cloned());
            v
        };
        let json = ("Content-Type", "application/json".to_string());
        let port = a.port();
        let refused: Vec<Vec<(&str, String)>> = vec![
            vec![("Origin", "https://evil.example".into())],
            vec![("Origin", "null".into())],
            vec![("Origin", format!("http://127.0.0.1:{}", port + 1))],
            vec![("Origin", format!("http://localhost:{port}"))],
            vec![("Origin", "http://127.0.0.1".into())],
            vec![("Sec-Fetch-Site", "cross-site".into())],
            vec![("Sec-Fetch-Site", "Cross-Site".into())],
            vec![
                ("Origin", format!("http://127.0.0.1:{port}")),
                ("Sec-Fetch-Site", "cross-site".into()),
            ],
        ];
        for extra in &refused {
            for (method, path, body) in [
                ("GET", "/admin/config", ""),
                ("GET", "/admin/deny", ""),
                ("GET", "/admin/stats", ""),
                ("POST", "/admin/deny", r#"{"key":"x"}"#),
                ("DELETE", "/admin/deny", r#"{"key":"x"}"#),
                ("POST", "/admin/reload", ""),
            ] {
                let headers = with(&[extra.clone(), vec![json.clone()]].concat());
                let headers: Vec<(&str, &str)> =
                    headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
                let (status, answer) = raw(a, method, path, &h, &headers, body).await;
                assert_eq!(
                    status, 403,
                    "{method} {path} {extra:?} token {token:?}: {answer}"
                );
                assert_eq!(answer, "cross-site request refused\n");
            }
        }
        let auth_ref: Vec<(&str, &str)> = auth.to_vec();
        assert_eq!(deny_list(a, &auth_ref).await, Vec::<Value>::new());
        let m = metrics(a).await;
        assert_eq!(
            metric(&m, "sluice_config_reloads_total{result=\"success\"}"),
            Some(0.0)
        );
        // The page itself may be reached from a link elsewhere.
        let (status, _) = raw(a, "GET", "/", &h, &[("Sec-Fetch-Site", "cross-site")], "").await;
        assert_eq!(status, 200);
        // Same origin (as the dashboard sends it) and a typed-in URL pass.
        for (i, extra) in [
            vec![("Origin", format!("http://127.0.0.1:{port}"))],
            vec![("Origin", format!("HTTP://127.0.0.1:{port}"))],
            vec![
                ("Origin", format!("http://127.0.0.1:{port}")),
                ("Sec-Fetch-Site", "same-origin".into()),
            ],
            vec![("Sec-Fetch-Site", "none".into())],
            vec![],
            // The page behind a reverse proxy that rewrites Host (nginx's default):
            // its Origin is the proxy's name, and the browser says same-origin.
            vec![
                ("Origin", "https://admin.example".into()),
                ("Sec-Fetch-Site", "same-origin".into()),
            ],
        ]
        .iter()
        .enumerate()
        {
            let headers = with(&[extra.clone(), vec![json.clone()]].concat());
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            let key = format!(r#"{{"key":"k{i}"}}"#);
            let (status, body) = raw(a, "POST", "/admin/deny", &h, &headers, &key).await;
            assert_eq!(status, 201, "{extra:?}: {body}");
            let (status, body) = raw(a, "GET", "/admin/config", &h, &headers, "").await;
            assert_eq!(status, 200, "{extra:?}: {body}");
        }
        assert_eq!(deny_list(a, &auth_ref).await.len(), 6);
        gw.shutdown().await;
    }
}

#[tokio::test]
async fn without_a_token_only_an_ip_or_localhost_host_is_served() {
    let gw = start_gateway(ROUTES).await;
    let a = gw.admin_addr;
    let port = a.port();
    let json = [("Content-Type", "application/json")];
    for host in [
        "evil.example".to_string(),
        format!("evil.example:{port}"),
        format!("localhost.evil.example:{port}"),
        "127.0.0.1.nip.io".into(),
        "localhostx".into(),
        "evil-localhost".into(),
        "".into(),
        "[::1".into(),
    ] {
        for path in ["/admin/config", "/admin/deny", "/admin/stats", "/"] {
            let (status, body) = raw(a, "GET", path, &host, &[], "").await;
            assert_eq!(status, 403, "{path} with Host {host:?}: {body}");
            assert_eq!(
                body,
                "Host refused: without admin.token the admin API answers only to an IP address or localhost\n"
            );
        }
        let (status, _) = raw(a, "POST", "/admin/deny", &host, &json, r#"{"key":"x"}"#).await;
        assert_eq!(status, 403, "POST with Host {host:?}");
        let (status, _) = raw(a, "POST", "/admin/reload", &host, &[], "").await;
        assert_eq!(status, 403, "reload with Host {host:?}");
    }
    assert_eq!(deny_list(a, &[]).await, Vec::<Value>::new());
    // Health and metrics stay open to any name (a scraper may use one).
    for path in ["/metrics", "/healthz", "/readyz"] {
        let (status, _) = raw(a, "GET", path, "evil.example", &[], "").await;
        assert_eq!(status, 200, "{path}");
    }
    for host in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1".into(),
        "10.1.2.3:80".into(),
        format!("[::1]:{port}"),
        "[::1]".into(),
        "localhost".into(),
        format!("localhost:{port}"),
        format!("LocalHost:{port}"),
        format!("dash.localhost:{port}"),
        "a.b.localhost".into(),
    ] {
        for path in ["/admin/config", "/admin/deny", "/admin/stats", "/"] {
            let (status, body) = raw(a, "GET", path, &host, &[], "").await;
            assert_eq!(status, 200, "{path} with Host {host:?}: {body}");
        }
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn with_a_token_any_host_is_served_to_the_token() {
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{ROUTES}"
    ))
    .await;
    let a = gw.admin_addr;
    let bearer = format!("Bearer {TOKEN}");
    let auth = [("Authorization", bearer.as_str())];
    for host in ["sluice-admin:9091", "evil.example"] {
        let (status, body) = raw(a, "GET", "/admin/config", host, &auth, "").await;
        assert_eq!(status, 200, "{host}: {body}");
        let (status, _) = raw(a, "GET", "/admin/config", host, &[], "").await;
        assert_eq!(status, 401, "{host}");
        let (status, _) = raw(a, "GET", "/", host, &[], "").await;
        assert_eq!(status, 200, "{host}");
        // With a service name the browser's Origin matches it.
        let origin = format!("http://{host}");
        let headers = [
            auth[0],
            ("Origin", origin.as_str()),
            ("Content-Type", "application/json"),
        ];
        let (status, body) = raw(a, "POST", "/admin/deny", host, &headers, r#"{"key":"k"}"#).await;
        assert_eq!(status, 201, "{host}: {body}");
    }
    gw.shutdown().await;
}

// === the admin listener's connection limits ===

/// Whether the peer closes `s` (end or reset) within `within`; anything it sends
/// meanwhile is read past.
async fn closes_within(s: &mut tokio::net::TcpStream, within: std::time::Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let read_to_end = async {
        let mut buf = [0u8; 1024];
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read_to_end).await.is_ok()
}

/// `GET path` from 127.0.0.1 must be answered 200 within 3s (`sluice health`'s bound).
async fn answered(addr: SocketAddr, path: &str) -> u16 {
    let host = local(addr);
    let get = raw(addr, "GET", path, &host, &[], "");
    match tokio::time::timeout(std::time::Duration::from_secs(3), get).await {
        Ok((status, _)) => status,
        Err(_) => panic!("GET {path}: no answer within 3s"),
    }
}

#[tokio::test]
async fn one_address_holding_idle_connections_cannot_stop_healthz_or_metrics() {
    use tokio::io::AsyncWriteExt;
    let gw = start_gateway(ROUTES).await;
    let mut held = Vec::new();
    for _ in 0..300 {
        held.push(connect_from_other(gw.admin_addr).await);
    }
    // The connections over the address's cap (16) are closed at once.
    let checks = held
        .iter_mut()
        .map(|s| closes_within(s, std::time::Duration::from_secs(1)));
    let closed = futures_util::future::join_all(checks).await;
    assert_eq!(closed.iter().filter(|c| **c).count(), 300 - 16);
    let mut open: Vec<_> = held
        .into_iter()
        .zip(closed)
        .filter(|(_, c)| !c)
        .map(|(s, _)| s)
        .collect();
    // Everyone else is served meanwhile.
    for _ in 0..5 {
        assert_eq!(answered(gw.admin_addr, "/healthz").await, 200);
        assert_eq!(answered(gw.admin_addr, "/metrics").await, 200);
    }
    // A head begun and never finished is cut after the header timeout (5s).
    for s in &mut open {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            .await
            .expect("write a partial head");
    }
    let checks = open
        .iter_mut()
        .map(|s| closes_within(s, std::time::Duration::from_secs(8)));
    let closed = futures_util::future::join_all(checks).await;
    assert_eq!(closed, vec![true; 16]);
}

#[tokio::test]
async fn the_admin_listeners_limits_are_configurable() {
    use tokio::io::AsyncWriteExt;
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", max_connections_per_ip: 2, request_header_timeout: 1s, idle_timeout: 1s}}\n{ROUTES}"
    ))
    .await;
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(connect_from_other(gw.admin_addr).await);
    }
    let checks = held
        .iter_mut()
        .map(|s| closes_within(s, std::time::Duration::from_millis(500)));
    let closed = futures_util::future::join_all(checks).await;
    assert_eq!(closed.iter().filter(|c| **c).count(), 1);
    let mut open: Vec<_> = held
        .into_iter()
        .zip(closed)
        .filter(|(_, c)| !c)
        .map(|(s, _)| s)
        .collect();
    // One is served and then left idle; the other sends half a head.
    open[0]
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .expect("write a request");
    let (head, _) = read_response(&mut open[0]).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head}");
    open[1]
        .write_all(b"GET /healthz HTTP/1.1\r\n")
        .await
        .expect("write a partial head");
    let checks = open
        .iter_mut()
        .map(|s| closes_within(s, std::time::Duration::from_secs(4)));
    assert_eq!(
        futures_util::future::join_all(checks).await,
        vec![true, true]
    );
}

/// The defect: a POST whose head came but whose body never does stayed in flight
/// for ever (so `idle_timeout` never fired either). The body must come within
/// `admin.request_header_timeout` too: 408, the connection closed, nothing applied.
#[tokio::test]
async fn an_admin_body_that_never_comes_is_answered_408_and_closed() {
    use tokio::io::AsyncWriteExt;
    let gw = start_gateway(&format!(
        "admin: {{listen: \"127.0.0.1:0\", request_header_timeout: 300ms, idle_timeout: 30s}}\n{ROUTES}"
    ))
    .await;
    let a = gw.admin_addr;
    let mut s = connect(a).await;
    let head = format!(
        "POST /admin/deny HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: 18\r\n\r\n{{\"ip\":",
        local(a)
    );
    s.write_all(head.as_bytes()).await.expect("write the head");
    let answer = tokio::time::timeout(std::time::Duration::from_secs(3), read_response(&mut s))
        .await
        .expect("no answer within 3s")
        .expect("an answer");
    let (head, body) = answer;
    assert!(
        head.starts_with("HTTP/1.1 408 Request Timeout\r\n"),
        "{head}"
    );
    assert!(
        head.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{head}"
    );
    assert_eq!(body, "request body not received in time\n");
    assert!(
        closes_within(&mut s, std::time::Duration::from_secs(1)).await,
        "the connection stayed open"
    );
    // A client that keeps trickling is drained for at most the admin port's
    // request_header_timeout, not the gateway's 30 s (a few addresses holding
    // 30 s drains could fill the admin port's 256 connections).
    let cut = tokio::time::timeout(std::time::Duration::from_secs(3), async {
        while s.write_all(b"x").await.is_ok() {
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(
        cut.is_ok(),
        "the admin connection was still drained after 3 s"
    );
    drop(s);
    assert_eq!(deny_list(a, &[]).await, Vec::<Value>::new());
    gw.shutdown().await;
}
