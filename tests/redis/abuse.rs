//! The limits that fit real abuse, all in one configuration, decided alike on the
//! memory store, one Redis server and a 3-node Redis Cluster: a login limited per
//! address and per account (the account read from the login form's body), failed
//! logins counted and banned, a token budget charged what the upstream's header
//! says, a monthly quota per API key, and a limit on trial. The limiter's time is
//! driven (frozen at ten seconds before a month ends), so every number is exact.

use http::Method;

use crate::common::redis::*;
use crate::common::{http1, metrics, upstream, url, HttpClient, Running};

const CONFIG: &str = r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: session                   # credential stuffing: per address AND per account, failures
    match: {path: /session, methods: [POST]}
    upstream: api
    key: ip
    limits:
      - {name: per_ip, algorithm: sliding_window, limit: 6, window: 1m}
      - {name: per_account, key: "form:username", algorithm: sliding_log, limit: 4, window: 1m}
      - {name: failures, algorithm: sliding_log, limit: 3, window: 15m, count: {status: [401, 403]}}
    ban: {after: 2, within: 1h, for: 1d}
  - name: llm                       # a token-metered API, with a monthly quota
    match: {path_prefix: /llm/}
    upstream: api
    key: header:x-api-key
    limits:
      - {name: tokens, algorithm: token_bucket, rate: 1000/m, burst: 1000, cost: {response_header: x-usage-tokens, default: 1}}
      - {name: monthly, algorithm: fixed_window, limit: 4, window: month}
      - {name: new_cap, algorithm: fixed_window, limit: 1, window: 1m, shadow: true}
"#;

/// 2027-03-31T23:59:50Z (`date -u -d 2027-03-31T23:59:50Z +%s`): the month ends in
/// ten seconds.
const NOW_US: u64 = 1_806_537_590 * 1_000_000;

async fn login(c: &HttpClient, gw: &Running, ip: &str, user: &str, answer: &str) -> u16 {
    let body = format!("username={user}&password=hunter2");
    c.send(
        Method::POST,
        &url(gw.addr, "/session"),
        &[
            ("x-forwarded-for", ip),
            ("content-type", "application/x-www-form-urlencoded"),
            ("x-reply-status", answer),
        ],
        body,
    )
    .await
    .status
}

/// `(status, Retry-After)` of one call of the metered API that used `tokens`.
async fn call(c: &HttpClient, gw: &Running, key: &str, tokens: u32) -> (u16, Option<u64>) {
    let used = format!("x-usage-tokens={tokens}");
    let r = c
        .get(
            &url(gw.addr, "/llm/v1/chat"),
            &[("x-api-key", key), ("x-reply-header", &used)],
        )
        .await;
    (
        r.status,
        r.header("retry-after").map(|v| v.parse().unwrap()),
    )
}

/// The whole story on `store` (a `store:` section, or "" for memory).
async fn limits_that_fit_abuse(store: &str) {
    let up = upstream().await;
    let clock = sluice::limit::ManualClock::new(NOW_US);
    let yaml = format!("{store}{}", CONFIG.replace("UP", &up.url()));
    let gw = crate::common::start_gateway_at(&yaml, clock).await;
    let c = http1();

    // Failed logins: three 401s pass through; then the limit refuses before
    // forwarding, and its second refusal bans the address.
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(login(&c, &gw, "192.0.2.1", "alice", "401").await);
    }
    assert_eq!(got, [401, 401, 401, 429, 429]);
    assert_eq!(up.hits(), 3);
    let banned = crate::common::eventually(std::time::Duration::from_secs(2), || async {
        login(&c, &gw, "192.0.2.1", "alice", "200").await == 403
    });
    assert!(banned.await.is_some(), "the address is banned");

    // One account from five addresses: four pass, the account's limit refuses.
    let mut got = Vec::new();
    for ip in [
        "192.0.2.10",
        "192.0.2.11",
        "192.0.2.12",
        "192.0.2.13",
        "192.0.2.14",
    ] {
        got.push(login(&c, &gw, ip, "bob", "200").await);
    }
    assert_eq!(got, [200, 200, 200, 200, 429]);
    assert_eq!(up.hits(), 7);

    // One address, seven accounts: six pass, the address's limit refuses.
    let mut got = Vec::new();
    for i in 1..=7 {
        got.push(login(&c, &gw, "198.51.100.7", &format!("user{i}"), "200").await);
    }
    assert_eq!(got, [200, 200, 200, 200, 200, 200, 429]);
    assert_eq!(up.hits(), 13);

    // Tokens: 600 and 600 of 1,000; the third call finds the budget 200 in debt and
    // needs 201 tokens at 1000/m: 12.06 s.
    let mut got = Vec::new();
    for _ in 0..3 {
        got.push(call(&c, &gw, "team-a", 600).await);
    }
    assert_eq!(got, [(200, None), (200, None), (429, Some(13))]);
    assert_eq!(up.hits(), 15);

    // The month: four calls, then refused until 00:00 UTC on the first, ten
    // seconds away.
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(call(&c, &gw, "team-b", 1).await);
    }
    assert_eq!(
        got,
        [
            (200, None),
            (200, None),
            (200, None),
            (200, None),
            (429, Some(10))
        ]
    );
    assert_eq!(up.hits(), 19);

    // The limit on trial (1 a minute) refused every call after each key's first,
    // and refused nothing.
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        crate::common::decisions(&m, "llm"),
        [("allowed", 2.0), ("limited", 2.0), ("shadow", 4.0)]
    );
    assert_eq!(
        crate::common::metric(&m, r#"sluice_bans_total{route="session"}"#),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_memory_store() {
    limits_that_fit_abuse("").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_one_redis() {
    let redis = RedisServer::start();
    limits_that_fit_abuse(&redis_store(&url_target(&redis.url()), "deny", 2000)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster() {
    let cluster = RedisCluster::start();
    limits_that_fit_abuse(&redis_store(&cluster_target(&cluster.urls()), "deny", 2000)).await;
    // The session route's keys are spread over the nodes: addresses and accounts
    // apart.
    let per_node: Vec<usize> = cluster
        .nodes
        .iter()
        .map(|n| n.cmd::<Vec<String>>(&["KEYS", "sluice:{session*"]).len())
        .collect();
    assert!(
        per_node.iter().filter(|&&n| n > 0).count() >= 2,
        "{per_node:?}"
    );
}
