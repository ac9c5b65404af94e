//! Failover between an upstream's targets: a connection that cannot be made goes
//! to the next target, a target whose connections fail is left out for
//! `fail_timeout` and tried again after it, and a request already written to a
//! target is never sent to another.

use std::time::{Duration, Instant};

use crate::common::*;

/// Two targets, the first `live`, the second `dead`, with `extra` in the upstream.
fn two_targets(live: &str, dead: &str, extra: &str) -> String {
    format!(
        "upstreams:\n  app: {{targets: [\"{live}\", \"{dead}\"], probe: false{extra}}}\n\
         routes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
    )
}

fn healthy(upstream: &str, target: &str) -> String {
    format!("sluice_upstream_target_healthy{{target=\"{target}\",upstream=\"{upstream}\"}}")
}

const CONNECT_ERRORS: &str = "sluice_upstream_errors_total{kind=\"connect\",route=\"all\"}";

/// A port nothing listens on: connections to it are refused.
fn refusing() -> String {
    format!("http://127.0.0.1:{}", free_port())
}

/// `targets: [live, dead]` answered 200 and 502 in turn, for ever. Now the dead
/// one's refused connection sends the request to the live one, and the dead one
/// is left out after its first failure (`max_fails: 1`): one connect error.
#[tokio::test]
async fn a_target_refusing_connections_costs_no_request_its_answer() {
    let live = upstream().await;
    let dead = refusing();
    let gw = start_gateway(&two_targets(&live.url(), &dead, "")).await;
    let got = statuses(&http1(), 40, &url(gw.addr, "/x"), &[]).await;
    assert_eq!(got, vec![200; 40]);
    assert_eq!(live.hits(), 40);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, CONNECT_ERRORS), Some(1.0), "{m}");
    assert_eq!(metric(&m, &healthy("app", &dead)), Some(0.0), "{m}");
    assert_eq!(metric(&m, &healthy("app", &live.url())), Some(1.0), "{m}");
    gw.shutdown().await;
}

/// Every target refusing: each is tried once, and the client gets one 502.
#[tokio::test]
async fn when_every_target_refuses_each_is_tried_once() {
    let (a, b) = (refusing(), refusing());
    let gw = start_gateway(&two_targets(&a, &b, ", max_fails: 5")).await;
    let got = statuses(&http1(), 3, &url(gw.addr, "/x"), &[]).await;
    assert_eq!(got, vec![502; 3]);
    let m = metrics(gw.admin_addr).await;
    // Two attempts per request, no more.
    assert_eq!(metric(&m, CONNECT_ERRORS), Some(6.0), "{m}");
    // Five failures within fail_timeout take a target out; three do not.
    assert_eq!(metric(&m, &healthy("app", &a)), Some(1.0), "{m}");
    gw.shutdown().await;
}

/// A target left out comes back after `fail_timeout`: one request tries it, and
/// it takes its share again.
#[tokio::test]
async fn a_target_that_comes_back_gets_traffic_after_fail_timeout() {
    let live = upstream().await;
    let port = free_port();
    let dead = format!("http://127.0.0.1:{port}");
    let gw = start_gateway(&two_targets(&live.url(), &dead, ", fail_timeout: 1s")).await;
    let client = http1();
    let target = url(gw.addr, "/x");
    assert_eq!(statuses(&client, 4, &target, &[]).await, vec![200; 4]);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, &healthy("app", &dead)), Some(0.0), "{m}");
    let out_since = Instant::now();

    let back = upstream_at(port).await;
    // Left out until fail_timeout has passed.
    let got = statuses(&client, 4, &target, &[]).await;
    if out_since.elapsed() < Duration::from_millis(900) {
        assert_eq!(back.hits(), 0);
    }
    assert_eq!(got, vec![200; 4]);
    // Then tried again: within 2 s it has answered, and is counted healthy.
    let mut tries = 0;
    while back.hits() == 0 {
        tries += 1;
        assert!(tries <= 40, "the target never got a request again");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(client.get(&target, &[]).await.status, 200);
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, &healthy("app", &dead)), Some(1.0), "{m}");
    // Back in the rotation: of the next 10, it takes half.
    let before = back.hits();
    assert_eq!(statuses(&client, 10, &target, &[]).await, vec![200; 10]);
    assert_eq!(back.hits() - before, 5);
    gw.shutdown().await;
}

/// A POST the target took and then closed on is answered 502, not sent to the
/// other target; so is a GET: a request written is never sent again.
#[tokio::test]
async fn a_request_written_to_a_target_that_closed_is_never_sent_again() {
    let closing = closing_upstream().await;
    let live = upstream().await;
    let gw = start_gateway(&two_targets(&closing.url(), &live.url(), "")).await;
    let client = http1();
    let r = client
        .send(
            http::Method::POST,
            &url(gw.addr, "/pay"),
            &[("content-type", "text/plain")],
            b"amount=10".to_vec(),
        )
        .await;
    assert_eq!(r.status, 502);
    assert_eq!(closing.hits(), 1);
    assert_eq!(live.hits(), 0);
    // The next goes to the live target, in turn; the one after to the closing one
    // again (a failure after connecting does not take a target out).
    assert_eq!(client.get(&url(gw.addr, "/a"), &[]).await.status, 200);
    assert_eq!(client.get(&url(gw.addr, "/b"), &[]).await.status, 502);
    assert_eq!((closing.hits(), live.hits()), (2, 1));
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, CONNECT_ERRORS), Some(0.0), "{m}");
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"reset\",route=\"all\"}"
        ),
        Some(2.0),
        "{m}"
    );
    gw.shutdown().await;
}

/// Active checks: a target whose check path fails twice in a row is left out
/// (no request needed to find it so), and back after two good checks.
#[tokio::test]
async fn a_target_failing_its_health_checks_is_left_out_until_they_pass() {
    let live = upstream().await;
    // Answers its check path with the status in `status`.
    let status = std::sync::Arc::new(std::sync::atomic::AtomicU16::new(503));
    let answer = status.clone();
    let (sick, _) = raw_upstream(move |mut s| {
        let answer = answer.clone();
        async move {
            use tokio::io::AsyncWriteExt;
            while let Some(head) = read_head(&mut s).await {
                let code = if head.starts_with("GET /healthz ") {
                    answer.load(std::sync::atomic::Ordering::SeqCst)
                } else {
                    200
                };
                let reply = format!("HTTP/1.1 {code} X\r\ncontent-length: 0\r\n\r\n");
                if s.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let sick = format!("http://{sick}");
    let gw = start_gateway(&two_targets(
        &live.url(),
        &sick,
        ", health_check: {path: /healthz, interval: 100ms, timeout: 1s}",
    ))
    .await;
    let gauge = healthy("app", &sick);
    let is = |want: f64| {
        let gauge = gauge.clone();
        let admin = gw.admin_addr;
        move || {
            let gauge = gauge.clone();
            async move { metric(&metrics(admin).await, &gauge) == Some(want) }
        }
    };
    assert!(
        eventually(Duration::from_secs(2), is(0.0)).await.is_some(),
        "never left out"
    );
    // Every request goes to the live target.
    let before = live.hits();
    assert_eq!(
        statuses(&http1(), 10, &url(gw.addr, "/x"), &[]).await,
        vec![200; 10]
    );
    assert_eq!(live.hits() - before, 10);
    status.store(200, std::sync::atomic::Ordering::SeqCst);
    assert!(
        eventually(Duration::from_secs(2), is(1.0)).await.is_some(),
        "never back"
    );
    let before = live.hits();
    assert_eq!(
        statuses(&http1(), 10, &url(gw.addr, "/x"), &[]).await,
        vec![200; 10]
    );
    assert_eq!(live.hits() - before, 5);
    gw.shutdown().await;
}

/// A reload that replaces a target: its series goes, the new target's is there
/// (at 1) before any request, and the target kept keeps its state.
#[tokio::test]
async fn a_reload_drops_the_series_of_a_target_it_drops() {
    let live = upstream().await;
    let (a, b) = (refusing(), refusing());
    let (gw, file) = start_gateway_file(&two_targets(&live.url(), &a, "")).await;
    assert_eq!(
        statuses(&http1(), 4, &url(gw.addr, "/x"), &[]).await,
        vec![200; 4]
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, &healthy("app", &a)), Some(0.0), "{m}");
    std::fs::write(
        file.path(),
        with_listeners(&two_targets(&live.url(), &b, "")),
    )
    .unwrap();
    gw.reload().await.expect("reload");
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, &healthy("app", &a)), None, "{m}");
    assert_eq!(metric(&m, &healthy("app", &b)), Some(1.0), "{m}");
    assert_eq!(metric(&m, &healthy("app", &live.url())), Some(1.0), "{m}");
    gw.shutdown().await;
}
