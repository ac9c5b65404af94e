//! Degraded mode, end to end: three gateways on one Redis with `on_error: local`;
//! Redis is killed under traffic spread over them, and each enforces its share of
//! every limit (the limit divided by the three live instances it saw, rounded up),
//! so the fleet admits the limit, not three times it, and answers no 5xx; the mode
//! shows in `/readyz`, `/admin/fleet` and `sluice_store_degraded`; once Redis
//! answers again, Redis decides within a second.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::redis::*;
use serde_json::Value;

const AUTH: (&str, &str) = ("authorization", "Bearer s3cret");

/// Two routes answered by sluice, keyed by `x-key`, 30 an hour each: a fixed
/// window and a token bucket (its rate and burst both 30 an hour).
fn gateway(store: &str) -> String {
    format!(
        "admin: {{listen: \"127.0.0.1:0\", token: s3cret}}\n{store}routes:\n\
         \x20 - name: window\n    match: {{path_prefix: /w}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{algorithm: fixed_window, limit: 30, window: 1h}}]\n\
         \x20 - name: bucket\n    match: {{path_prefix: /b}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{algorithm: token_bucket, rate: 30/h, burst: 30}}]\n"
    )
}

async fn fleet(admin: SocketAddr) -> Value {
    let a = get(admin, "/admin/fleet", &[AUTH]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    serde_json::from_str(&a.body).expect("fleet JSON")
}

/// A decision's count on both routes of one gateway.
async fn decided(admin: SocketAddr, route: &str, decision: &str) -> f64 {
    let labels = [("route", route), ("decision", decision)];
    metric(admin, "sluice_requests_total", &labels).await
}

redis_and_valkey! {
    async fn a_redis_outage_under_traffic_over_three_instances_admits_the_limit_not_three_times_it() {
        let mut redis = RedisServer::start();
        let yaml = gateway(&redis_store(&url_target(&redis.url()), "local", 200));
        let gateways = Arc::new(vec![
            start_gateway(&yaml).await,
            start_gateway(&yaml).await,
            start_gateway(&yaml).await,
        ]);
        // Each has seen the three live (its heartbeat reads the view every second).
        for g in gateways.iter() {
            let seen = eventually(Duration::from_secs(10), || async {
                let v = fleet(g.admin_addr).await;
                v["live"] == 3 && v["divided_by"] == 3
            })
            .await;
            assert!(seen.is_some(), "{:#}", fleet(g.admin_addr).await);
            let v = fleet(g.admin_addr).await;
            assert_eq!(v["degraded"], false);
            assert_eq!(
                metric(g.admin_addr, "sluice_store_degraded", &[]).await,
                0.0
            );
        }

        // Traffic: rounds of one request per route to each gateway in turn; after 5
        // rounds Redis is killed while the rounds go on, until 40 more began after it.
        // Before the kill, at most 9 rounds (27 requests a route): Redis must not
        // refuse the key yet, or each instance would answer 429 from its refusal
        // cache (until the hour ends) without ever falling back.
        const BEFORE: usize = 5;
        const AT_MOST: usize = 9;
        const AFTER: usize = 40;
        let round = Arc::new(AtomicUsize::new(0));
        let killed = Arc::new(AtomicBool::new(false));
        let traffic = {
            let (gateways, round, killed) = (gateways.clone(), round.clone(), killed.clone());
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                let mut after = 0;
                while after < AFTER {
                    while !killed.load(Ordering::SeqCst)
                        && round.load(Ordering::SeqCst) >= AT_MOST
                    {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    if killed.load(Ordering::SeqCst) {
                        after += 1;
                    }
                    for g in gateways.iter() {
                        for path in ["/w", "/b"] {
                            statuses.push(get(g.addr, path, &[("x-key", "k")]).await.status);
                        }
                    }
                    round.fetch_add(1, Ordering::SeqCst);
                }
                statuses
            })
        };
        let started = eventually(Duration::from_secs(20), || async {
            round.load(Ordering::SeqCst) >= BEFORE
        })
        .await;
        assert!(started.is_some(), "the first rounds did not end");
        redis.kill();
        killed.store(true, Ordering::SeqCst);
        let statuses = bounded("the traffic", traffic).await.expect("traffic task");

        // No 5xx: every answer is an admission or a 429.
        let ok = statuses.iter().filter(|s| **s == 200).count();
        let refused = statuses.iter().filter(|s| **s == 429).count();
        assert_eq!(ok + refused, statuses.len(), "{statuses:?}");

        // In the outage each gateway admitted exactly its share of each limit, 10 of
        // 30 (it had 40 requests of each route or more): 30 over the fleet per limit,
        // where each deciding alone with the whole limit would have admitted 90.
        for route in ["window", "bucket"] {
            let mut local = 0.0;
            let mut in_redis = 0.0;
            for g in gateways.iter() {
                let mine = decided(g.admin_addr, route, "store_error_allowed").await;
                assert_eq!(mine, 10.0, "{route} on {}", g.addr);
                local += mine;
                in_redis += decided(g.admin_addr, route, "allowed").await;
            }
            assert_eq!(local, 30.0, "{route}");
            // Before the outage, Redis admitted the first rounds' requests (5 to 9
            // rounds', and perhaps one more sent as it died).
            assert!((15.0..=28.0).contains(&in_redis), "{route}: {in_redis}");
        }
        assert_eq!(
            ok as f64,
            {
                let mut sum = 0.0;
                for g in gateways.iter() {
                    for route in ["window", "bucket"] {
                        sum += decided(g.admin_addr, route, "allowed").await
                            + decided(g.admin_addr, route, "store_error_allowed").await;
                    }
                }
                sum
            },
            "every 200 was an admission"
        );

        // The mode shows: /readyz's body, the gauge, /admin/fleet.
        for g in gateways.iter() {
            let r = get(g.admin_addr, "/readyz", &[]).await;
            assert_eq!(
                (r.status, r.body.as_str()),
                (503, "store unavailable\ndegraded: Redis unreachable; on_error local enforces each limit divided by 3 (the live instances last seen), rounded up, in this instance\n")
            );
            assert_eq!(
                metric(g.admin_addr, "sluice_store_degraded", &[]).await,
                1.0
            );
            let v = fleet(g.admin_addr).await;
            assert_eq!(
                (v["degraded"].clone(), v["divided_by"].clone()),
                (true.into(), 3.into()),
                "{v:#}"
            );
        }

        // Redis returns (empty): within a second (10 polls 100 ms apart) every gateway
        // decides in Redis again, and the mode is gone.
        redis.restart();
        for g in gateways.iter() {
            let mut back = false;
            for n in 0..10 {
                let before = decided(g.admin_addr, "window", "allowed").await;
                get(g.addr, "/w", &[("x-key", &format!("after-{n}"))]).await;
                if decided(g.admin_addr, "window", "allowed").await > before {
                    back = true;
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            assert!(back, "{} not deciding in Redis within 10 polls", g.addr);
            assert_eq!(
                metric(g.admin_addr, "sluice_store_degraded", &[]).await,
                0.0
            );
            assert_eq!(fleet(g.admin_addr).await["degraded"], false);
        }
        assert!(!redis.keys("*after-*").is_empty());
    }
}
