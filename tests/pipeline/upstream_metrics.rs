//! What the upstream answered (`sluice_upstream_responses_total`, by status class)
//! and which limit refused (`sluice_limit_refusals_total`): exact counts, every
//! child exported at 0 from the start, and sluice's own answers never counted as
//! the upstream's.

use crate::common::*;

/// `sluice_upstream_responses_total{code=C,route=R}`; the series must exist.
fn responses(text: &str, route: &str, code: &str) -> f64 {
    let series = format!("sluice_upstream_responses_total{{code=\"{code}\",route=\"{route}\"}}");
    metric(text, &series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

/// `sluice_limit_refusals_total{limit=L,route=R}`; the series must exist.
fn refusals(text: &str, route: &str, limit: &str) -> f64 {
    let series = format!("sluice_limit_refusals_total{{limit=\"{limit}\",route=\"{route}\"}}");
    metric(text, &series).unwrap_or_else(|| panic!("no {series} in\n{text}"))
}

const CODES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

#[tokio::test]
async fn upstream_answers_are_counted_by_class_and_sluices_own_answers_are_not() {
    let up = upstream().await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
  gone: {{targets: ["{dead}"], connect_timeout: 1s}}
routes:
  - name: app
    match: {{path_prefix: /app/}}
    upstream: app
    key: header:x-api-key
    limits: [{{name: small, algorithm: fixed_window, limit: 6, window: 1d}}]
  - name: gone
    match: {{path_prefix: /gone/}}
    upstream: gone
  - name: teapot
    match: {{path: /teapot}}
    respond: {{status: 418}}
"#,
        up.url()
    ))
    .await;

    // Before any request: every class of every route at 0 (as its upstream errors
    // are); none for requests that match no route.
    let text = metrics(gw.admin_addr).await;
    for route in ["app", "gone", "teapot"] {
        for code in CODES {
            assert_eq!(responses(&text, route, code), 0.0, "{route} {code}");
        }
    }
    assert!(!text.contains("sluice_upstream_responses_total{code=\"2xx\",route=\"unmatched\"}"));

    let c = http1();
    let key = ("x-api-key", "k");
    for (path, status, times) in [("/app/ok", "200", 3), ("/app/login", "401", 1)] {
        for _ in 0..times {
            let r = c
                .get(&url(gw.addr, path), &[key, ("x-reply-status", status)])
                .await;
            assert_eq!(r.status.to_string(), status, "{path}");
        }
    }
    for _ in 0..2 {
        let r = c
            .get(
                &url(gw.addr, "/app/busy"),
                &[key, ("x-reply-status", "503")],
            )
            .await;
        assert_eq!(r.status, 503);
    }
    // Sluice's own answers: a refusal by the limit (the 7th), a missing key, a
    // failed forward, a `respond` route, no route.
    let r = c.get(&url(gw.addr, "/app/ok"), &[key]).await;
    assert_eq!(r.status, 429);
    assert_eq!(c.get(&url(gw.addr, "/app/ok"), &[]).await.status, 400);
    assert_eq!(c.get(&url(gw.addr, "/gone/x"), &[]).await.status, 502);
    assert_eq!(c.get(&url(gw.addr, "/teapot"), &[]).await.status, 418);
    assert_eq!(c.get(&url(gw.addr, "/nowhere"), &[]).await.status, 404);
    assert_eq!(up.hits(), 6);

    let text = metrics(gw.admin_addr).await;
    let app: Vec<f64> = CODES.iter().map(|c| responses(&text, "app", c)).collect();
    assert_eq!(app, [0.0, 3.0, 0.0, 1.0, 2.0]);
    for route in ["gone", "teapot"] {
        let counts: Vec<f64> = CODES.iter().map(|c| responses(&text, route, c)).collect();
        assert_eq!(counts, [0.0; 5], "{route}");
    }
    assert_eq!(
        metric(
            &text,
            "sluice_upstream_errors_total{kind=\"connect\",route=\"gone\"}"
        ),
        Some(1.0)
    );
    assert_eq!(refusals(&text, "app", "small"), 1.0);
    gw.shutdown().await;
}

#[tokio::test]
async fn each_refusal_is_counted_by_the_limit_that_refused_it() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    upstream: app
    key: header:x-api-key
    limits:
      - {{name: per_key, algorithm: fixed_window, limit: 3, window: 1d}}
      - {{name: per_team, key: "header:x-team", algorithm: fixed_window, limit: 4, window: 1d}}
    overrides:
      - keys: [vip]
        limits:
          - {{name: per_key, algorithm: fixed_window, limit: 1, window: 1d}}
          - {{name: vip_burst, algorithm: token_bucket, rate: 1/h, burst: 100}}
  - name: open
    match: {{path_prefix: /open/}}
    upstream: app
"#,
        up.url()
    ))
    .await;

    // Every limit name of every tier, at 0; `per_key` once for both tiers.
    let text = metrics(gw.admin_addr).await;
    for limit in ["per_key", "per_team", "vip_burst"] {
        assert_eq!(refusals(&text, "api", limit), 0.0, "{limit}");
    }
    assert_eq!(
        text.matches("sluice_limit_refusals_total{limit=\"per_key\",route=\"api\"}")
            .count(),
        1
    );
    // A route without limits has none.
    let series = text
        .lines()
        .filter(|l| l.starts_with("sluice_limit_refusals_total{"))
        .count();
    assert_eq!(series, 3, "{text}");

    let c = http1();
    let api = url(gw.addr, "/api/x");
    // alice (team red): 3 pass, then `per_key` refuses twice; the refusals charge
    // nothing, so the team has spent 3 of its 4.
    let alice = [("x-api-key", "alice"), ("x-team", "red")];
    assert_eq!(statuses(&c, 5, &api, &alice).await, ok_then_limited(3, 2));
    // bob (team red): the team's 4th passes, then `per_team` refuses three times.
    let bob = [("x-api-key", "bob"), ("x-team", "red")];
    assert_eq!(statuses(&c, 4, &api, &bob).await, ok_then_limited(1, 3));
    // vip (its own tier, team blue): 1 passes, then the tier's `per_key` refuses.
    let vip = [("x-api-key", "vip"), ("x-team", "blue")];
    assert_eq!(statuses(&c, 2, &api, &vip).await, ok_then_limited(1, 1));

    let text = metrics(gw.admin_addr).await;
    assert_eq!(refusals(&text, "api", "per_key"), 3.0);
    assert_eq!(refusals(&text, "api", "per_team"), 3.0);
    assert_eq!(refusals(&text, "api", "vip_burst"), 0.0);
    assert_eq!(up.hits(), 5);
    gw.shutdown().await;
}
