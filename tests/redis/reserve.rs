//! `reserve: N`, end to end: gateways sharing one hot key through one Redis (and a
//! cluster) take units in advance. Never more than the limit is admitted, at least
//! the limit − instances × (N − 1), every unit taken is either spent or counted
//! unused, and the Redis calls fall as `/metrics` and Redis itself count them. A
//! reload that lowers the limit counts the units already taken.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::common::redis::*;

const GATEWAYS: usize = 3;

/// One route answered by sluice itself, keyed by `x-key`, with `limits`.
fn route(limits: &str) -> String {
    format!(
        "routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: {limits}\n"
    )
}

/// Fires `n` requests at once, spread round robin over `addrs`; statuses counted.
async fn burst(addrs: &[SocketAddr], n: usize, key: &str) -> BTreeMap<u16, usize> {
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let addr = addrs[i % addrs.len()];
        let key = key.to_string();
        tasks.spawn(async move { get(addr, "/", &[("x-key", &key)]).await.status });
    }
    let mut statuses = BTreeMap::new();
    while let Some(s) = tasks.join_next().await {
        *statuses.entry(s.expect("request task")).or_insert(0) += 1;
    }
    statuses
}

async fn total(gateways: &[Running], name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for g in gateways {
        sum += metric(g.admin_addr, name, labels).await;
    }
    sum
}

async fn start(yaml: &str) -> Vec<Running> {
    let mut gateways = Vec::new();
    for _ in 0..GATEWAYS {
        gateways.push(start_gateway(yaml).await);
    }
    gateways
}

/// The count a fixed window's state holds (`"<window> <count>"`).
fn window_count(state: &str) -> u64 {
    state
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("not a window state: {state:?}"))
}

/// 600 requests of one key through three gateways, with a limit of 200 and
/// `reserve: 20`: what the fleet admits, what the shared count holds, how many
/// script calls decided them.
struct Hot {
    admitted: usize,
    decide_calls: f64,
}

async fn hot_key(target: &str) -> Hot {
    let yaml = format!(
        "{}{}",
        redis_store(target, "deny", 2000),
        route("[{name: hot, algorithm: fixed_window, limit: 200, window: 1h, reserve: 20}]")
    );
    let gateways = start(&yaml).await;
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    // Created at 0 before any unit is taken.
    for g in &gateways {
        let text = get(g.admin_addr, "/metrics", &[]).await.body;
        assert!(
            text.contains("sluice_reserve_unused_total{limit=\"hot\",route=\"api\"} 0\n"),
            "{text}"
        );
    }
    let statuses = burst(&addrs, 600, "shared").await;
    let admitted = statuses.get(&200).copied().unwrap_or(0);
    // Never more than the limit; at most N − 1 units held unspent per instance.
    assert!(
        (200 - GATEWAYS * 19..=200).contains(&admitted),
        "{statuses:?}"
    );
    assert_eq!(
        statuses,
        BTreeMap::from([(200, admitted), (429, 600 - admitted)])
    );
    let allowed = total(
        &gateways,
        "sluice_requests_total",
        &[("route", "api"), ("decision", "allowed")],
    )
    .await;
    assert_eq!(allowed, admitted as f64);
    let decide_calls = total(
        &gateways,
        "sluice_store_calls_total",
        &[("store", "redis"), ("kind", "decide")],
    )
    .await;
    let local = total(
        &gateways,
        "sluice_store_calls_total",
        &[("store", "redis"), ("kind", "local")],
    )
    .await;
    // Every admitted request was decided by a call or from units held.
    assert!(
        local + decide_calls >= admitted as f64,
        "{local} {decide_calls}"
    );
    assert!(local >= (admitted - 60) as f64, "{local} of {admitted}");
    // Without reserve every admitted request is a call (or a share of one); with
    // it, at least ten times fewer.
    assert!(decide_calls <= 60.0, "{decide_calls} calls for {admitted}");
    Hot {
        admitted,
        decide_calls,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_one_redis_never_admit_more_than_a_reserved_limit() {
    let redis = RedisServer::start();
    let hot = hot_key(&url_target(&redis.url())).await;
    // The shared count took the whole limit: what was not admitted is held.
    let keys = redis.keys("sluice:{api:shared}:*");
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!(
        window_count(&redis.cmd::<String>(&["GET", keys[0].as_str()])),
        200
    );
    // Redis ran exactly the calls the gateways counted.
    assert_eq!(redis.calls("evalsha") as f64, hot.decide_calls);
    assert_eq!(redis.calls("eval"), 0);
    // What was not admitted is held: spent by later requests, or counted unused
    // once its window ends.
    assert!(hot.admitted <= 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_on_a_cluster_never_admit_more_than_a_reserved_limit() {
    let cluster = RedisCluster::start();
    let hot = hot_key(&cluster_target(&cluster.urls())).await;
    // One node holds the hot key, and every call went to it.
    let owners: Vec<usize> = (0..cluster.nodes.len())
        .filter(|&i| !cluster.nodes[i].keys("sluice:{api:shared}:*").is_empty())
        .collect();
    assert_eq!(owners.len(), 1);
    let owner = &cluster.nodes[owners[0]];
    let key = &owner.keys("sluice:{api:shared}:*")[0];
    assert_eq!(
        window_count(&owner.cmd::<String>(&["GET", key.as_str()])),
        200
    );
    assert_eq!(owner.calls("evalsha") as f64, hot.decide_calls);
}

/// Microseconds until the end of the current `window_us` window on Redis' clock.
fn until_window_end(redis: &RedisServer, window_us: u64) -> u64 {
    let t: Vec<u64> = redis.cmd(&["TIME"]);
    let now = t[0] * 1_000_000 + t[1];
    window_us - now % window_us
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_left_when_the_window_ends_are_counted_unused_and_nothing_else_is_lost() {
    let redis = RedisServer::start();
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&redis.url()), "deny", 2000),
        route("[{name: hot, algorithm: fixed_window, limit: 1000, window: 2s, reserve: 20}]")
    );
    let gateways = start(&yaml).await;
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    const W: u64 = 2_000_000;
    let unused = || {
        total(
            &gateways,
            "sluice_reserve_unused_total",
            &[("route", "api"), ("limit", "hot")],
        )
    };
    // A burst inside one window, under the limit (tried again if it ran past the
    // window's end); then what the shared count holds, read in the same window.
    let mut found = None;
    for _ in 0..3 {
        // Start just after a window begins.
        tokio::time::sleep(Duration::from_micros(until_window_end(&redis, W) + 20_000)).await;
        let unused_before = unused().await;
        let left = until_window_end(&redis, W);
        let statuses = burst(&addrs, 300, "shared").await;
        assert_eq!(statuses, BTreeMap::from([(200, 300)]));
        let key = redis.keys("sluice:{api:shared}:*")[0].clone();
        let count = window_count(&redis.cmd::<String>(&["GET", key.as_str()]));
        if until_window_end(&redis, W) >= left {
            // The window rolled during the burst: its numbers span two windows.
            continue;
        }
        found = Some((count, unused_before));
        break;
    }
    let (count, unused_before) = found.expect("a burst within one 2 s window in 3 tries");
    // The gateways took more than they spent, at most N − 1 each.
    assert!(
        (300..=300 + GATEWAYS as u64 * 19).contains(&count),
        "{count}"
    );
    // The next window: one request per gateway finds its units expired and counts
    // them; each is admitted afresh.
    tokio::time::sleep(Duration::from_micros(until_window_end(&redis, W) + 20_000)).await;
    for addr in &addrs {
        assert_eq!(get(*addr, "/", &[("x-key", "shared")]).await.status, 200);
    }
    // Every unit taken in the window was admitted or is counted unused.
    assert_eq!(unused().await - unused_before, (count - 300) as f64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_lowers_the_limit_counts_the_units_already_taken() {
    let redis = RedisServer::start();
    let store = redis_store(&url_target(&redis.url()), "deny", 2000);
    let limits = |limit: u32| {
        format!("[{{name: hot, algorithm: fixed_window, limit: {limit}, window: 1h, reserve: 20}}]")
    };
    let mut gateways = Vec::new();
    let mut files = Vec::new();
    for _ in 0..GATEWAYS {
        let (g, f) = start_gateway_file(&format!("{store}{}", route(&limits(300)))).await;
        gateways.push(g);
        files.push(f);
    }
    // 40 requests one after another through each gateway: all admitted, each
    // gateway then holding what its last take left.
    for g in &gateways {
        for _ in 0..40 {
            assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 200);
        }
    }
    let key = redis.keys("sluice:{api:shared}:*")[0].clone();
    let taken = window_count(&redis.cmd::<String>(&["GET", key.as_str()]));
    assert!(
        (120..=120 + GATEWAYS as u64 * 19).contains(&taken),
        "{taken}"
    );
    // The limit goes down to 200, on every gateway.
    for (g, f) in gateways.iter().zip(&files) {
        std::fs::write(
            f.path(),
            with_listeners(&format!("{store}{}", route(&limits(200)))),
        )
        .expect("write config");
        let r = request(g.admin_addr, "POST", "/admin/reload", &[], "").await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // One gateway, one request after another until refused: it admits exactly what
    // the shared count still allows under the new limit, every unit taken under the
    // old one counted, spent or not.
    let mut second = 0;
    while get(gateways[0].addr, "/", &[("x-key", "shared")])
        .await
        .status
        == 200
    {
        second += 1;
        assert!(second <= 200, "never refused");
    }
    assert_eq!(second, 200 - taken);
    // The others refuse too, dropping (and counting) what they held.
    for g in &gateways[1..] {
        assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 429);
    }
    assert_eq!(
        total(
            &gateways,
            "sluice_reserve_unused_total",
            &[("route", "api"), ("limit", "hot")],
        )
        .await,
        (taken - 120) as f64
    );
}

/// Redis' clock, in µs.
fn server_now(redis: &RedisServer) -> u64 {
    let t: Vec<u64> = redis.cmd(&["TIME"]);
    t[0] * 1_000_000 + t[1]
}

/// Three gateways sending waves of one key at a bucket of `rate` 100/s and `burst`
/// 50 with `reserve: 10`: the fleet never admits more than the bucket allows over the
/// time it ran, units held or not.
async fn bucket_fleet(algorithm: &str, mode: &str) {
    let redis = RedisServer::start();
    let yaml = format!(
        "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n{mode}    limits: [{{name: hot, algorithm: {algorithm}, rate: 100/s, burst: 50, reserve: 10}}]\n",
        redis_store(&url_target(&redis.url()), "deny", 2000),
    );
    let gateways = start(&yaml).await;
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    let start = server_now(&redis);
    let mut admitted = 0;
    let mut first = 0;
    for wave in 0..5 {
        let statuses = burst(&addrs, 150, "shared").await;
        let ok = statuses.get(&200).copied().unwrap_or(0);
        assert_eq!(
            ok + statuses.get(&429).copied().unwrap_or(0),
            150,
            "{statuses:?}"
        );
        if wave == 0 {
            first = ok;
        }
        admitted += ok;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let elapsed_us = server_now(&redis) - start;
    // The bucket's bound: burst + rate × elapsed (delayed requests booked within it).
    let bound = 50 + elapsed_us * 100 / 1_000_000;
    assert!(
        admitted as u64 <= bound,
        "{algorithm} {mode:?}: admitted {admitted} > {bound} in {elapsed_us} µs"
    );
    // The first wave finds the bucket full: at most N − 1 per gateway held back.
    assert!(first >= 50 - GATEWAYS * 9, "first wave {first}");
    let calls = total(
        &gateways,
        "sluice_store_calls_total",
        &[("store", "redis"), ("kind", "decide")],
    )
    .await;
    assert_eq!(redis.calls("evalsha") as f64, calls);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_bucket_with_reserve_never_admits_more_than_its_rate_allows() {
    bucket_fleet("token_bucket", "").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_with_reserve_in_delay_mode_never_admits_more_than_its_rate_allows() {
    bucket_fleet("gcra", "    on_limit: delay\n    max_delay: 100ms\n").await;
}
