//! The access log of the `sluice` binary (`access_log:`): one line per request with
//! every field, JSON or nginx's combined format, forwarded requests sampled exactly,
//! refusals within a budget of lines a second (the rest counted), and never a query
//! string, a cookie or an `Authorization` value. Beside it, the lines an operator
//! needs when the upstream fails: one WARN per target that takes no connection at
//! startup and after a reload, and WARN lines of failed forwards naming the route and
//! the target, a few a second per target.

use std::time::Duration;

use crate::common::*;
use crate::refusal_logs::Sluice;
use serde_json::Value;

fn yaml(port: u16, admin: u16, up: &str, access: &str) -> String {
    format!(
        r#"
server: {{listen: "127.0.0.1:{port}"}}
admin: {{listen: "127.0.0.1:{admin}"}}
access_log: {access}
deny:
  keys: [leaked-key-123]
upstreams:
  api: {{targets: ["{up}"]}}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    key: header:x-api-key
    limits:
      - {{name: per_key, algorithm: fixed_window, limit: 2, window: 1h}}
    upstream: api
  - name: open
    match: {{path_prefix: /open/}}
    upstream: api
  - name: flood
    match: {{path: /flood}}
    key: global
    limits:
      - {{name: none_left, algorithm: token_bucket, rate: 1/h, burst: 1}}
    respond: {{body: "ok\n"}}
"#
    )
}

/// Lines of the process written under `target`: access lines are the line itself;
/// others are tracing's (text or JSON).
fn access_lines(s: &Sluice) -> Vec<String> {
    s.lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| !l.contains("sluice::") && !l.contains("\"target\":"))
        .cloned()
        .collect()
}

/// Waits (bounded) until there are `n` access lines, and returns them.
async fn wait_access(s: &Sluice, n: usize) -> Vec<String> {
    for _ in 0..(BOUND.as_millis() / 20) {
        let lines = access_lines(s);
        assert!(lines.len() <= n, "more than {n} access lines: {lines:#?}");
        if lines.len() == n {
            return lines;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("never {n} access lines: {:#?}", access_lines(s));
}

/// `time` and `duration_ms` vary: checked for form, then left out.
fn fixed(line: &str) -> Value {
    let mut v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
    let o = v.as_object_mut().unwrap();
    let time = o.remove("time").unwrap();
    let time = time.as_str().unwrap();
    assert!(
        time.len() >= 20 && time.ends_with('Z') && time.as_bytes()[10] == b'T',
        "{time}"
    );
    let ms = o.remove("duration_ms").unwrap().as_f64().unwrap();
    assert!((0.0..10_000.0).contains(&ms), "{ms}");
    v
}

const SECRETS: [&str; 4] = ["in-the-query", "hunter2", "sid=hunter3", "secret-A"];

#[tokio::test]
async fn json_lines_have_every_field_of_forwarded_refused_and_unmatched_requests() {
    let up = upstream().await;
    let upstream_addr = up.addr.to_string();
    let s = Sluice::start_yaml(true, |port, admin| {
        yaml(port, admin, &up.url(), "{format: json}")
    })
    .await;
    let c = http1();
    let secret = [
        ("authorization", "Bearer hunter2"),
        ("cookie", "sid=hunter3"),
    ];
    let with = |extra: &[(&'static str, &'static str)]| {
        let mut h = vec![("x-api-key", "secret-A")];
        h.extend_from_slice(&secret);
        h.extend_from_slice(extra);
        h
    };
    let url = s.url("/api/items?token=in-the-query");
    let statuses = [
        c.get(
            &url,
            &with(&[("x-reply-status", "401"), ("x-reply-bytes", "7")]),
        )
        .await
        .status,
        c.get(&url, &with(&[("x-reply-bytes", "3")])).await.status,
        c.get(&url, &with(&[])).await.status,
        c.get(&url, &[("x-api-key", "leaked-key-123")]).await.status,
        c.get(&s.url("/nowhere?q=in-the-query"), &[]).await.status,
    ];
    assert_eq!(statuses, [401, 200, 429, 403, 404]);
    let lines = wait_access(&s, 5).await;
    let line = |status: u16,
                route: &str,
                decision: &str,
                limit: Option<&str>,
                upstream_status: Option<u16>,
                bytes: u64| {
        serde_json::json!({
            "ip": "127.0.0.1",
            "method": "GET",
            "path": if route == "unmatched" { "/nowhere" } else { "/api/items" },
            "protocol": "HTTP/1.1",
            "status": status,
            "route": route,
            "decision": decision,
            "limit": limit,
            "upstream": upstream_status.map(|_| upstream_addr.clone()),
            "upstream_status": upstream_status,
            "bytes": bytes,
            "dropped": 0,
        })
    };
    let got: Vec<Value> = lines.iter().map(|l| fixed(l)).collect();
    // The refusals' bodies are sluice's own: their length, as sent.
    let body_len = |i: usize| got[i]["bytes"].as_u64().unwrap();
    assert!(body_len(2) > 0 && body_len(3) > 0 && body_len(4) > 0);
    assert_eq!(
        got,
        [
            line(401, "api", "allowed", None, Some(401), 7),
            line(200, "api", "allowed", None, Some(200), 3),
            line(429, "api", "limited", Some("per_key"), None, body_len(2)),
            line(403, "api", "denied", None, None, body_len(3)),
            line(404, "unmatched", "unmatched", None, None, body_len(4)),
        ]
    );
    let all = s.stop().await;
    for secret in SECRETS {
        assert!(!all.contains(secret), "{secret} in the log: {all}");
    }
}

#[tokio::test]
async fn combined_lines_are_nginx_s_and_a_sample_keeps_exactly_its_share() {
    let up = upstream().await;
    let s = Sluice::start_yaml(false, |port, admin| {
        yaml(port, admin, &up.url(), "{format: combined, sample: 0.5}")
    })
    .await;
    let c = http1();
    let headers = [
        ("x-reply-bytes", "5"),
        ("user-agent", "probe/1 \"quoted\""),
        ("referer", "https://example.com/page?session=in-the-query"),
        ("authorization", "Bearer hunter2"),
    ];
    // Four forwarded: the sample keeps the 2nd and the 4th.
    for i in 0..4 {
        let r = c
            .get(&s.url(&format!("/open/{i}?x=in-the-query")), &headers)
            .await;
        assert_eq!(r.status, 200);
    }
    // A refusal is always logged.
    assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 200);
    assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 429);
    let lines = wait_access(&s, 3).await;
    let cut = |l: &str| {
        // `[26/Nov/2026:22:03:04 +0000]` and `duration_ms=…` vary.
        let (head, rest) = l.split_once(" [").unwrap();
        let (time, rest) = rest.split_once("] ").unwrap();
        assert!(time.ends_with(" +0000") && time.len() == 26, "{time}");
        let (rest, duration) = rest.split_once(" duration_ms=").unwrap();
        let (ms, dropped) = duration.split_once(' ').unwrap();
        assert!(ms.parse::<f64>().is_ok(), "{ms}");
        format!("{head} {rest} {dropped}")
    };
    let upstream = up.addr;
    assert_eq!(
        lines.iter().map(|l| cut(l)).collect::<Vec<_>>(),
        [
            format!(r#"127.0.0.1 - - "GET /open/1 HTTP/1.1" 200 5 "https://example.com/page" "probe/1 \x22quoted\x22" route=open decision=allowed limit=- upstream={upstream} upstream_status=200 dropped=0"#),
            format!(r#"127.0.0.1 - - "GET /open/3 HTTP/1.1" 200 5 "https://example.com/page" "probe/1 \x22quoted\x22" route=open decision=allowed limit=- upstream={upstream} upstream_status=200 dropped=0"#),
            r#"127.0.0.1 - - "GET /flood HTTP/1.1" 429 65 "-" "-" route=flood decision=limited limit=none_left upstream=- upstream_status=- dropped=0"#.to_string(),
        ]
    );
    let all = s.stop().await;
    for secret in SECRETS {
        assert!(!all.contains(secret), "{secret} in the log: {all}");
    }
}

#[tokio::test]
async fn a_flood_of_refusals_is_logged_within_a_budget_and_the_rest_counted() {
    let up = upstream().await;
    let s = Sluice::start_yaml(true, |port, admin| {
        yaml(port, admin, &up.url(), "{format: json, sample: 0}")
    })
    .await;
    let c = http1();
    let started = sluice::deny::now_ms() / 1000;
    assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 200);
    const REFUSED: u64 = 50;
    for _ in 0..REFUSED {
        assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 429);
    }
    let seconds = sluice::deny::now_ms() / 1000 - started + 1;
    // Every refusal is a line or counted as dropped (the allowed one is sampled out).
    let mut accounted = None;
    for _ in 0..(BOUND.as_millis() / 20) {
        let m = s.metrics().await;
        let dropped = metric(&m, "sluice_access_logs_dropped_total").unwrap() as u64;
        let lines = access_lines(&s).len() as u64;
        if lines + dropped == REFUSED {
            accounted = Some((lines, dropped));
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (lines, dropped) = accounted.expect("every refusal a line or counted");
    assert!(lines <= 10 * seconds, "{lines} lines in {seconds} s");
    assert!(dropped >= REFUSED - 10 * seconds, "{dropped} dropped");
    // The first line after a dropped one says how many were dropped since.
    let reported: u64 = access_lines(&s)
        .iter()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["dropped"]
                .as_u64()
                .unwrap()
        })
        .sum();
    assert!(reported <= dropped, "{reported} reported of {dropped}");
    s.stop().await;
}

/// WARN lines of the `sluice::` targets that contain `what`.
fn warnings(s: &Sluice, what: &str) -> Vec<String> {
    s.lines
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains(" WARN ") && l.contains(what))
        .cloned()
        .collect()
}

async fn wait_warnings(s: &Sluice, what: &str, n: usize) -> Vec<String> {
    for _ in 0..(BOUND.as_millis() / 20) {
        let w = warnings(s, what);
        if w.len() >= n {
            return w;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!(
        "never {n} warnings with {what:?}: {:#?}",
        s.lines.lock().unwrap()
    );
}

#[tokio::test]
async fn an_absent_upstream_is_a_warning_at_startup_after_a_reload_and_on_every_failure() {
    // Nothing listens on either port.
    let (dead, dead2) = (free_port(), free_port());
    let target = format!("127.0.0.1:{dead}");
    // An upstream with `probe: false` is never probed, absent as it is.
    let quiet = free_port();
    let quiet_upstream =
        format!("upstreams:\n  quiet: {{targets: [\"http://127.0.0.1:{quiet}\"], probe: false}}\n");
    let s = Sluice::start_yaml(false, |port, admin| {
        yaml(
            port,
            admin,
            &format!("http://{target}"),
            "{format: json, sample: 0}",
        )
        .replace("upstreams:\n", &quiet_upstream)
    })
    .await;
    let startup = wait_warnings(&s, "takes no connection", 1).await;
    assert_eq!(startup.len(), 1, "{startup:#?}");
    assert!(
        startup[0].contains(&format!("target=\"http://{target}\""))
            && startup[0].contains("upstream=api"),
        "{}",
        startup[0]
    );
    // Failed forwards: 502 each, counted, WARN with route and target, a few a second.
    let c = http1();
    let started = sluice::deny::now_ms() / 1000;
    for _ in 0..8 {
        assert_eq!(c.get(&s.url("/open/x"), &[]).await.status, 502);
    }
    let seconds = sluice::deny::now_ms() / 1000 - started + 1;
    let m = s.metrics().await;
    assert_eq!(
        metric(
            &m,
            r#"sluice_upstream_errors_total{kind="connect",route="open"}"#
        ),
        Some(8.0)
    );
    let failed = wait_warnings(&s, "forwarding failed", 1).await;
    assert!(
        failed.len() as u64 <= 3 * seconds && failed.len() < 8,
        "{failed:#?}"
    );
    for l in &failed {
        assert!(
            l.contains("route=open") && l.contains(&format!("target=\"{target}\"")),
            "{l}"
        );
    }
    // A reload that changes the upstream probes it again (once); one that keeps it
    // does not.
    let moved = yaml(
        s.port,
        s.admin,
        &format!("http://127.0.0.1:{dead2}"),
        "{format: json, sample: 0}",
    );
    std::fs::write(s.file.path(), moved).unwrap();
    let after = wait_warnings(&s, "takes no connection", 2).await;
    assert!(
        after[1].contains(&format!("target=\"http://127.0.0.1:{dead2}\"")),
        "{}",
        after[1]
    );
    let admin = format!("http://127.0.0.1:{}/admin/reload", s.admin);
    let r = c
        .send(http::Method::POST, &admin, &[], bytes::Bytes::new())
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    // Then a third target: its warning is the third line (the forced reload, which
    // kept the upstream, probed nothing; its probe would have come first).
    let dead3 = free_port();
    let third = yaml(
        s.port,
        s.admin,
        &format!("http://127.0.0.1:{dead3}"),
        "{format: json, sample: 0}",
    );
    std::fs::write(s.file.path(), third).unwrap();
    let last = wait_warnings(&s, &format!("127.0.0.1:{dead3}"), 1).await;
    assert!(last[0].contains("takes no connection"), "{}", last[0]);
    assert_eq!(warnings(&s, "takes no connection").len(), 3);
    assert_eq!(
        warnings(&s, &format!("127.0.0.1:{quiet}")),
        Vec::<String>::new()
    );
    s.stop().await;
}

/// A head sluice's HTTP/1.1 server refuses itself, before a request exists (400,
/// 501), still gets its access line, as nginx logs its 400s: the method and path
/// of its request line (never the query), route `unmatched`, decision
/// `bad_request`. A target nginx forwards (`"` in the query) is forwarded, with its
/// line as any request's.
#[tokio::test]
async fn heads_refused_by_the_http_server_get_their_access_line() {
    let up = upstream().await;
    let s = Sluice::start_yaml(true, |port, admin| {
        yaml(port, admin, &up.url(), "{format: json}")
    })
    .await;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], s.port).into();
    let probes: [&[u8]; 3] = [
        b"GET /open/x?q=in-the-query HTTP/1.1\r\nhost: h\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
        b"GET /open/q?a=\"b\" HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
        b"POST /open/up HTTP/1.0\r\nhost: h\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
    ];
    let mut statuses = Vec::new();
    for probe in probes {
        let answer = exchange(addr, probe).await;
        statuses.push(answer.get(..12).unwrap_or_default().to_string());
    }
    assert_eq!(
        statuses,
        ["HTTP/1.1 400", "HTTP/1.1 200", "HTTP/1.1 400"],
        "HTTP/1.0 with Transfer-Encoding is a 400 before its codings are read"
    );
    let probe = b"POST /open/up HTTP/1.1\r\nhost: h\r\ntransfer-encoding: gzip, chunked\r\n\r\n";
    let answer = exchange(addr, probe).await;
    assert!(answer.starts_with("HTTP/1.1 501 "), "{answer}");
    let lines = wait_access(&s, 4).await;
    let line = |method: &str, path: &str, protocol: &str, status: u16, decision: &str| {
        let upstream = (status == 200).then(|| up.addr.to_string());
        serde_json::json!({
            "ip": "127.0.0.1",
            "method": method,
            "path": path,
            "protocol": protocol,
            "status": status,
            "route": if status == 200 { "open" } else { "unmatched" },
            "decision": decision,
            "limit": null,
            "upstream": upstream,
            "upstream_status": (status == 200).then_some(200),
            "bytes": lines_bytes(status),
            "dropped": 0,
        })
    };
    let mut got: Vec<Value> = lines.iter().map(|l| fixed(l)).collect();
    // The forwarded answer's body is the echo's: its length as sent.
    let echoed = got[1]["bytes"].as_u64().unwrap();
    assert!(echoed > 0);
    got[1]["bytes"] = 1.into();
    assert_eq!(
        got,
        [
            line("GET", "/open/x", "HTTP/1.1", 400, "bad_request"),
            line("GET", "/open/q", "HTTP/1.1", 200, "allowed"),
            line("POST", "/open/up", "HTTP/1.0", 400, "bad_request"),
            line("POST", "/open/up", "HTTP/1.1", 501, "bad_request"),
        ]
    );
    let all = s.stop().await;
    assert!(!all.contains("in-the-query"), "the query in the log: {all}");
}

/// The bytes of a line in `heads_refused_by_the_http_server_get_their_access_line`:
/// none for the server's own refusals (their body is empty), 1 standing for the
/// forwarded answer's.
fn lines_bytes(status: u16) -> u64 {
    u64::from(status == 200)
}
