//! The access log of the `sluice` binary (`access_log:`): one line per request with
//! every field, JSON or nginx's combined format, forwarded requests sampled exactly,
//! the protocol the client spoke, refusals within a budget of lines a second on
//! stderr (the rest counted) and every one in a file, a file renamed under traffic
//! and reopened on SIGUSR1 with no line lost or doubled, and never a query
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

#[tokio::test]
async fn the_protocol_is_the_one_the_client_spoke_for_forwarded_requests_too() {
    let up = upstream().await;
    let s = Sluice::start_yaml(true, |port, admin| {
        yaml(port, admin, &up.url(), "{format: json}")
    })
    .await;
    assert_eq!(h2c().get(&s.url("/open/h2"), &[]).await.status, 200);
    assert_eq!(http1().get(&s.url("/open/h11"), &[]).await.status, 200);
    let addr = format!("127.0.0.1:{}", s.port).parse().unwrap();
    let answer = exchange(addr, b"GET /open/h10 HTTP/1.0\r\nhost: h\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200"),
        "{answer}"
    );
    // And a refusal over h2 (sluice's own answer): the same field.
    assert_eq!(h2c().get(&s.url("/nowhere"), &[]).await.status, 404);
    let mut got: Vec<(String, String)> = wait_access(&s, 4)
        .await
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (
                v["path"].as_str().unwrap().to_string(),
                v["protocol"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    let want = [
        ("/nowhere", "HTTP/2.0"),
        ("/open/h10", "HTTP/1.0"),
        ("/open/h11", "HTTP/1.1"),
        ("/open/h2", "HTTP/2.0"),
    ];
    assert_eq!(
        got,
        want.map(|(p, v)| (p.to_string(), v.to_string())).to_vec()
    );
    s.stop().await;
}

// === to a file ===

fn file_lines(path: &std::path::Path) -> Vec<String> {
    match std::fs::read_to_string(path) {
        Ok(text) => text.lines().map(str::to_string).collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("{}: {e}", path.display()),
    }
}

#[tokio::test]
async fn a_file_gets_every_refusal_beyond_the_stderr_budget_and_nothing_goes_to_stderr() {
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let access = format!(
        "{{format: json, path: \"{}\", flush: 100ms}}",
        log.display()
    );
    let s = Sluice::start_yaml(true, |port, admin| yaml(port, admin, &up.url(), &access)).await;
    let c = http1();
    assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 200);
    const REFUSED: usize = 50;
    for _ in 0..REFUSED {
        assert_eq!(c.get(&s.url("/flood"), &[]).await.status, 429);
    }
    // Flushed within `flush`, while the gateway runs.
    let whole = eventually(Duration::from_secs(2), || async {
        file_lines(&log).len() > REFUSED
    })
    .await;
    assert!(
        whole.is_some(),
        "{} lines in the file",
        file_lines(&log).len()
    );
    let lines = file_lines(&log);
    let decisions: Vec<String> = lines
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            assert_eq!(v["dropped"], 0, "{l}");
            v["decision"].as_str().unwrap().to_string()
        })
        .collect();
    let mut want = vec!["allowed".to_string()];
    want.extend(std::iter::repeat_n("limited".to_string(), REFUSED));
    assert_eq!(decisions, want);
    let m = s.metrics().await;
    assert_eq!(metric(&m, "sluice_access_logs_dropped_total"), Some(0.0));
    assert_eq!(access_lines(&s), Vec::<String>::new());
    s.stop().await;
    assert_eq!(file_lines(&log).len(), REFUSED + 1);
}

#[tokio::test]
async fn a_file_renamed_under_traffic_and_reopened_on_sigusr1_loses_no_line() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let rotated = dir.path().join("access.log.1");
    // A small buffer, so lines are written while the traffic goes on, and a long
    // flush: the lines still buffered at the reopen are the old file's.
    let access = format!(
        "{{format: combined, path: \"{}\", buffer: 2KiB, flush: 10s}}",
        log.display()
    );
    let s = Sluice::start_yaml(false, |port, admin| yaml(port, admin, &up.url(), &access)).await;

    // Four clients send requests, each to a path of its own, until told to stop.
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..4)
        .map(|client| {
            let (stop, base) = (stop.clone(), s.url("/open/"));
            tokio::spawn(async move {
                let c = http1();
                let mut sent = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let path = format!("/open/{client}-{}", sent.len());
                    let r = c.get(&format!("{base}{client}-{}", sent.len()), &[]).await;
                    assert_eq!(r.status, 200);
                    sent.push(path);
                }
                sent
            })
        })
        .collect();
    let lines_in = |p: &std::path::Path| file_lines(p).len();
    // Traffic until some lines are in the file, then logrotate's move.
    let before = eventually(Duration::from_secs(2), || async { lines_in(&log) > 0 }).await;
    assert!(before.is_some(), "nothing written before the rename");
    std::fs::rename(&log, &rotated).unwrap();
    s.signal(libc::SIGUSR1);
    // The reopen creates the file again; the traffic goes on into it.
    let reopened = eventually(Duration::from_secs(2), || async { log.exists() }).await;
    assert!(reopened.is_some(), "access.log not reopened");
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let mut sent = Vec::new();
    for c in clients {
        sent.extend(c.await.unwrap());
    }
    // The rest is written at the latest when the gateway stops.
    s.stop().await;
    let path_of = |l: &String| {
        let request = l.split('"').nth(1).unwrap_or_else(|| panic!("{l}"));
        request.split(' ').nth(1).unwrap().to_string()
    };
    let (old, new) = (file_lines(&rotated), file_lines(&log));
    assert!(
        !old.is_empty() && !new.is_empty(),
        "{} and {} lines",
        old.len(),
        new.len()
    );
    let mut logged: Vec<String> = old.iter().chain(&new).map(path_of).collect();
    logged.sort();
    sent.sort();
    assert_eq!(
        logged.len(),
        sent.len(),
        "lines for {} requests",
        sent.len()
    );
    assert_eq!(logged, sent);
}

#[tokio::test]
async fn a_reload_keeps_the_file_or_opens_it_anew_and_loses_no_line_either_way() {
    let up = upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("access.log");
    let access = |flush: &str| {
        format!(
            "{{format: json, path: \"{}\", flush: {flush}}}",
            log.display()
        )
    };
    let s = Sluice::start_yaml(true, |port, admin| {
        yaml(port, admin, &up.url(), &access("10s"))
    })
    .await;
    let c = http1();
    let mut sent = Vec::new();
    let send = async |sent: &mut Vec<String>| {
        for _ in 0..10 {
            let path = format!("/open/{}", sent.len());
            assert_eq!(c.get(&s.url(&path), &[]).await.status, 200);
            sent.push(path);
        }
    };
    let reloaded = |n: f64| {
        let s = &s;
        async move {
            eventually(Duration::from_secs(2), || async {
                let m = s.metrics().await;
                metric(&m, r#"sluice_config_reloads_total{result="success"}"#) == Some(n)
            })
            .await
            .is_some()
        }
    };
    send(&mut sent).await;
    // The same file settings, another limit: the file is kept as it is.
    let text = yaml(s.port, s.admin, &up.url(), &access("10s"));
    std::fs::write(s.file.path(), text.replace("limit: 2,", "limit: 3,")).unwrap();
    assert!(reloaded(1.0).await, "no reload");
    send(&mut sent).await;
    // Another flush: the file is opened anew; the old one's lines still get out.
    let text = yaml(s.port, s.admin, &up.url(), &access("100ms"));
    std::fs::write(s.file.path(), text).unwrap();
    assert!(reloaded(2.0).await, "no second reload");
    send(&mut sent).await;
    s.stop().await;
    let mut logged: Vec<String> = file_lines(&log)
        .iter()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            v["path"].as_str().unwrap().to_string()
        })
        .collect();
    logged.sort();
    sent.sort();
    assert_eq!(logged, sent);
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
