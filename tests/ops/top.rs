//! `GET /admin/top` and `sluice top`: the most refused clients of each route, with
//! exact counts while fewer keys are refused than a sketch keeps; what is counted
//! (refusals by a limit, not by the deny list), the query's checks, and that a
//! reload keeps a route's clients by its name and drops a removed route's.

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::common::*;
use http::Method;
use serde_json::Value;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");
const TOKEN: &str = "s3cret";
/// A whole hour, in microseconds: the limiter's `1h` windows start here.
const HOUR_US: u64 = 3_600_000_000;
const NOW_US: u64 = 500_000 * HOUR_US;

/// `/api` keyed by `x-api-key`, 2 an hour; `/login` by address, 1 an hour; behind
/// a trusted loopback proxy, so that `X-Forwarded-For` plays any client address.
fn config(routes_after: &str) -> String {
    format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: "{TOKEN}"}}
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
routes:
  - name: api
    match: {{path: /api}}
    key: "header:x-api-key"
    limits: [{{name: per-key, algorithm: fixed_window, limit: 2, window: 1h}}]
    respond: {{body: ok}}
{routes_after}"#
    )
}

const LOGIN: &str = r#"  - name: login
    match: {path: /login}
    key: ip
    limits: [{algorithm: fixed_window, limit: 1, window: 1h}]
    respond: {body: ok}
"#;

/// The statuses of `n` requests to `path` from `ip` with `x-api-key: key`, if given.
async fn send(gw: &Running, n: usize, path: &str, ip: &str, key: Option<&str>) -> Vec<u16> {
    let mut headers = vec![("x-forwarded-for", ip)];
    if let Some(k) = key {
        headers.push(("x-api-key", k));
    }
    statuses(&http1(), n, &url(gw.addr, path), &headers).await
}

/// `GET /admin/top` with `query` and the token: status and body.
async fn top(admin: SocketAddr, query: &str) -> (u16, String) {
    let bearer = format!("Bearer {TOKEN}");
    let r = get(
        &url(admin, &format!("/admin/top{query}")),
        &[("authorization", &bearer)],
    )
    .await;
    (r.status, r.text().to_string())
}

/// The rows of a 200 answer, with `last_seen` checked against `last_seen_ms` and
/// both taken out (they are the wall clock's).
fn rows(answer: (u16, String)) -> Vec<Value> {
    let (status, body) = answer;
    assert_eq!(status, 200, "{body}");
    let list: Vec<Value> = serde_json::from_str(&body).expect("a JSON list");
    list.into_iter()
        .map(|mut r| {
            let ms = r["last_seen_ms"].as_u64().expect("last_seen_ms");
            assert_eq!(r["last_seen"], Value::from(sluice::deny::rfc3339(ms)));
            let o = r.as_object_mut().expect("an object");
            o.remove("last_seen");
            o.remove("last_seen_ms");
            r
        })
        .collect()
}

fn row(route: &str, key: &str, ip: &str, refused: u64, allowed: u64) -> Value {
    serde_json::json!({
        "route": route, "key": key, "ip": ip,
        "refused": refused, "error": 0, "allowed": allowed,
    })
}

// === running `sluice top` ===

#[derive(Debug, PartialEq, Eq)]
struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_string(&mut text);
        }
        text
    })
}

/// `sluice top ARGS --admin http://ADMIN` with the token in the environment, waited
/// for without blocking the runtime (the gateway in this process keeps answering).
async fn sluice_top(admin: SocketAddr, args: &[&str]) -> Out {
    let mut cmd = Command::new(SLUICE);
    cmd.arg("top")
        .args(args)
        .args(["--admin", &format!("http://{admin}")])
        .env_remove("SLUICE_CONFIG")
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .env("SLUICE_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = spawn_grouped(&mut cmd).expect("sluice starts");
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let mut waited = Duration::ZERO;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        assert!(waited < 2 * BOUND, "sluice top {args:?} still running");
        tokio::time::sleep(Duration::from_millis(20)).await;
        waited += Duration::from_millis(20);
    };
    Out {
        code: status.code(),
        stdout: stdout.join().expect("stdout"),
        stderr: stderr.join().expect("stderr"),
    }
}

// === tests ===

#[tokio::test]
async fn the_most_refused_clients_are_listed_with_exact_counts_heaviest_first() {
    let clock = sluice::limit::ManualClock::new(NOW_US);
    let gw = start_gateway_at(&config(LOGIN), clock.clone()).await;
    let admin = gw.admin_addr;
    // Nothing refused yet: an empty list.
    assert_eq!(top(admin, "").await, (200, "[]\n".to_string()));

    let flood = send(&gw, 12, "/api", "198.51.100.7", Some("flood")).await;
    assert_eq!(flood, ok_then_limited(2, 10));
    let other = send(&gw, 5, "/api", "203.0.113.9", Some("other")).await;
    assert_eq!(other, ok_then_limited(2, 3));
    assert_eq!(
        send(&gw, 3, "/login", "192.0.2.1", None).await,
        ok_then_limited(1, 2)
    );
    // Allowed before any refusal: never listed.
    assert_eq!(
        send(&gw, 2, "/api", "192.0.2.50", Some("quiet")).await,
        [200; 2]
    );
    // A key on the deny list is refused by the list, not by a limit: not counted.
    let bearer = format!("Bearer {TOKEN}");
    let json_body = [
        ("authorization", bearer.as_str()),
        ("content-type", "application/json"),
    ];
    let deny_url = url(admin, "/admin/deny");
    let added = http1()
        .send(Method::POST, &deny_url, &json_body, r#"{"key":"denied"}"#)
        .await;
    assert_eq!(added.status, 201, "{}", added.text());
    assert_eq!(
        send(&gw, 4, "/api", "192.0.2.60", Some("denied")).await,
        [403; 4]
    );
    // A new hour: the flooding key is allowed again, once from another address.
    clock.advance(HOUR_US);
    assert_eq!(
        send(&gw, 1, "/api", "198.51.100.8", Some("flood")).await,
        [200]
    );

    let all = vec![
        row("api", "flood", "198.51.100.7", 10, 1),
        row("api", "other", "203.0.113.9", 3, 0),
        row("login", "192.0.2.1", "192.0.2.1", 2, 0),
    ];
    assert_eq!(rows(top(admin, "").await), all);
    assert_eq!(rows(top(admin, "?n=20").await), all);
    assert_eq!(rows(top(admin, "?route=login").await), all[2..]);
    assert_eq!(rows(top(admin, "?route=api").await), all[..2]);
    assert_eq!(rows(top(admin, "?n=1").await), all[..1]);
    assert_eq!(rows(top(admin, "?route=api&n=1").await), all[..1]);
    assert_eq!(rows(top(admin, "?n=2&route=login").await), all[2..]);

    // What the query may say.
    for (query, message) in [
        ("?route=nope", r#"no route named "nope""#),
        ("?route=", r#"no route named """#),
        ("?n=0", r#"n "0" is not a number from 1 to 1000"#),
        ("?n=1001", r#"n "1001" is not a number from 1 to 1000"#),
        ("?n=abc", r#"n "abc" is not a number from 1 to 1000"#),
        ("?n=-1", r#"n "-1" is not a number from 1 to 1000"#),
        ("?n=1&n=2", "n given twice"),
        ("?route=api&route=login", "route given twice"),
        (
            "?limit=5",
            r#"unknown query parameter "limit": expected route, n or scope"#,
        ),
        ("?scope=all", r#"scope "all" is neither instance nor fleet"#),
        ("?scope=fleet&scope=fleet", "scope given twice"),
    ] {
        assert_eq!(
            top(admin, query).await,
            (400, format!("{message}\n")),
            "{query}"
        );
    }
    // The token, and the method.
    let r = get(&url(admin, "/admin/top"), &[]).await;
    assert_eq!(r.status, 401);
    let r = http1()
        .send(
            Method::POST,
            &url(admin, "/admin/top"),
            &[("authorization", bearer.as_str())],
            "",
        )
        .await;
    assert_eq!((r.status, r.header("allow")), (405, Some("GET")));

    // `sluice top`: the same rows as a table, or the API's JSON.
    let (_, json) = top(admin, "").await;
    let listed: Vec<Value> = serde_json::from_str(&json).expect("a JSON list");
    let seen = |i: usize| {
        listed[i]["last_seen"]
            .as_str()
            .expect("last_seen")
            .to_string()
    };
    let out = sluice_top(admin, &[]).await;
    assert_eq!((out.code, out.stderr.as_str()), (Some(0), ""), "{out:?}");
    assert_eq!(
        out.stdout,
        format!(
            "ROUTE  KEY        IP            REFUSED  ALLOWED  LAST SEEN (UTC)\n\
             api    flood      198.51.100.7  10       1        {}\n\
             api    other      203.0.113.9   3        0        {}\n\
             login  192.0.2.1  192.0.2.1     2        0        {}\n",
            seen(0),
            seen(1),
            seen(2)
        )
    );
    let out = sluice_top(admin, &["--route", "login", "-n", "5"]).await;
    assert_eq!(out.code, Some(0), "{out:?}");
    assert_eq!(
        out.stdout
            .lines()
            .nth(1)
            .map(|l| l.starts_with("login  192.0.2.1")),
        Some(true)
    );
    assert_eq!(out.stdout.lines().count(), 2, "{}", out.stdout);
    let out = sluice_top(admin, &["--json", "-n", "1"]).await;
    assert_eq!(out.code, Some(0), "{out:?}");
    let parsed: Vec<Value> = serde_json::from_str(&out.stdout).expect("--json prints JSON");
    assert_eq!(parsed, listed[..1]);
    // A 400 is the API's message, and exit code 1.
    let out = sluice_top(admin, &["--route", "nope"]).await;
    assert_eq!(
        out,
        Out {
            code: Some(1),
            stdout: String::new(),
            stderr: "sluice top: 400 Bad Request: no route named \"nope\"\n".into(),
        }
    );
    let out = sluice_top(admin, &["-n", "0"]).await;
    assert_eq!(
        (out.code, out.stderr.as_str()),
        (
            Some(1),
            "sluice top: 400 Bad Request: n \"0\" is not a number from 1 to 1000\n"
        )
    );
}

/// A reload keeps the clients of a route it keeps (by name), and forgets those of
/// a route it removes.
#[tokio::test]
async fn a_reload_keeps_a_routes_clients_by_name_and_drops_a_removed_routes() {
    let (gw, file) = start_gateway_file(&config(LOGIN)).await;
    let admin = gw.admin_addr;
    assert_eq!(
        send(&gw, 4, "/api", "198.51.100.7", Some("flood")).await,
        ok_then_limited(2, 2)
    );
    assert_eq!(
        send(&gw, 2, "/login", "192.0.2.1", None).await,
        ok_then_limited(1, 1)
    );
    assert_eq!(
        rows(top(admin, "").await),
        vec![
            row("api", "flood", "198.51.100.7", 2, 0),
            row("login", "192.0.2.1", "192.0.2.1", 1, 0),
        ]
    );
    // `login` goes, `api` stays (the limiter's state with it: still refused).
    std::fs::write(file.path(), with_listeners(&config(""))).expect("write config");
    let hash = gw.reload().await.expect("reloads");
    assert_eq!(
        gw.shared.runtime.load().hash,
        hash,
        "the new file is the one served"
    );
    assert_eq!(
        send(&gw, 1, "/api", "198.51.100.7", Some("flood")).await,
        [429]
    );
    assert_eq!(
        rows(top(admin, "").await),
        vec![row("api", "flood", "198.51.100.7", 3, 0)]
    );
    assert_eq!(
        top(admin, "?route=login").await,
        (400, "no route named \"login\"\n".to_string())
    );
    // Back again, it starts empty.
    std::fs::write(file.path(), with_listeners(&config(LOGIN))).expect("write config");
    gw.reload().await.expect("reloads");
    assert_eq!(rows(top(admin, "?route=login").await), Vec::<Value>::new());
}
