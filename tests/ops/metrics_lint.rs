//! `/metrics` passes the Prometheus ecosystem's own linter, `promtool check
//! metrics` (Debian's `prometheus` package; tests/run.sh installs it), after
//! traffic that moves every kind of series: allowed, limited, denied, unmatched
//! and upstream errors, a ban and its deny-list entry, and
//! store errors on a Redis store whose server is gone. Every family it exports has
//! its row in the metrics table of docs/metrics-and-logs.md.

use std::io::Write;
use std::process::{Command, Stdio};

use crate::common::redis::RedisServer;
use crate::common::*;

/// promtool's verdict on `text`: its exit status and what it printed.
fn promtool(text: &str) -> (bool, String) {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect(
            "promtool runs (is it installed? tests/run.sh installs Debian's prometheus package)",
        );
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(text.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool ends");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// Every metric family of `text` has its row in the metrics table of
/// docs/metrics-and-logs.md.
fn every_family_is_documented(text: &str) {
    let page = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/docs/metrics-and-logs.md"
    ))
    .unwrap();
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert!(families.len() >= 10, "{families:?}");
    for family in families {
        assert!(
            page.contains(&format!("| `{family}` |")),
            "{family} has no row in the metrics table of docs/metrics-and-logs.md"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_after_every_kind_of_decision_pass_promtool() {
    // An upstream port nothing listens on: forwarded requests fail to connect.
    let dead = free_port();
    let yaml = format!(
        "upstreams:
  gone: {{targets: [\"http://127.0.0.1:{dead}\"], connect_timeout: 1s}}
deny:
  keys: [blocked]
routes:
  - name: hello
    match: {{path: /hello}}
    key: header:x-key
    limits: [{{name: two, algorithm: fixed_window, limit: 2, window: 1h}}]
    ban: {{after: 1, within: 1m, for: 1m}}
    respond: {{status: 200, body: \"hi\\n\"}}
  - name: api
    match: {{path_prefix: /api/}}
    upstream: gone
    key: header:x-key
    limits: [{{name: many, algorithm: gcra, rate: 100/s, burst: 100}}]
"
    );
    let (gw, _file) = start_gateway_file(&yaml).await;
    let at = |path: &str| url(gw.addr, path);
    let statuses = |rs: &[Resp]| rs.iter().map(|r| r.status).collect::<Vec<_>>();
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(get(&at("/hello"), &[("x-key", "k1")]).await);
    }
    got.push(get(&at("/hello"), &[("x-key", "blocked")]).await);
    got.push(get(&at("/nowhere"), &[]).await);
    got.push(get(&at("/api/x"), &[("x-key", "k2")]).await);
    // Limited once, k1 is banned by `after: 1`: refused as denied from now on.
    got.push(get(&at("/hello"), &[("x-key", "k1")]).await);
    assert_eq!(statuses(&got), [200, 200, 429, 403, 404, 502, 403]);

    let text = metrics(gw.admin_addr).await;
    for (series, value) in [
        (
            r#"sluice_requests_total{decision="allowed",route="hello"}"#,
            2.0,
        ),
        (
            r#"sluice_requests_total{decision="limited",route="hello"}"#,
            1.0,
        ),
        (
            r#"sluice_requests_total{decision="denied",route="hello"}"#,
            2.0,
        ),
        (
            r#"sluice_requests_total{decision="unmatched",route="unmatched"}"#,
            1.0,
        ),
        (
            r#"sluice_upstream_errors_total{kind="connect",route="api"}"#,
            1.0,
        ),
        (r#"sluice_bans_total{route="hello"}"#, 1.0),
        (r#"sluice_deny_entries{source="ban"}"#, 1.0),
    ] {
        assert_eq!(metric(&text, series), Some(value), "{series}\n{text}");
    }
    let (ok, said) = promtool(&text);
    assert!(
        ok && said.is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
    every_family_is_documented(&text);

    // Store errors: a Redis store whose server is gone, `on_error: allow`.
    let mut redis = RedisServer::start();
    let store = format!(
        "store:\n  backend: redis\n  redis: {{url: \"{}\", timeout: 200ms}}\n  on_error: allow\n",
        redis.url()
    );
    let gw = start_gateway(&format!(
        "{store}routes:
  - name: shared
    match: {{path: /shared}}
    key: header:x-key
    limits: [{{name: ten, algorithm: token_bucket, rate: 10/s, burst: 10}}]
    respond: {{status: 200, body: \"ok\\n\"}}
"
    ))
    .await;
    let url_shared = url(gw.addr, "/shared");
    assert_eq!(get(&url_shared, &[("x-key", "k")]).await.status, 200);
    redis.kill();
    assert_eq!(get(&url_shared, &[("x-key", "k")]).await.status, 200);

    let text = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &text,
            r#"sluice_requests_total{decision="allowed",route="shared"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"sluice_requests_total{decision="store_error_allowed",route="shared"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, r#"sluice_store_errors_total{store="redis"}"#),
        Some(1.0),
        "{text}"
    );
    let (ok, said) = promtool(&text);
    assert!(
        ok && said.is_empty(),
        "promtool check metrics: {said}\n{text}"
    );
    every_family_is_documented(&text);
}
