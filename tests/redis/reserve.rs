//! `reserve: N`, end to end: gateways sharing one hot key through one Redis (and a
//! cluster) take units in advance. Never more than the limit is admitted, at least
//! the limit − instances × (N − 1), every unit taken is either spent or counted
//! unused, and the Redis calls fall as `/metrics` and Redis itself count them. A
//! reload that lowers the limit counts the units already taken.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::common::redis::*;
use crate::redis_gateway::{burst, route, total, until_window_end};

const GATEWAYS: usize = 3;

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

redis_and_valkey! {
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
}

redis_and_valkey! {
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
}

redis_and_valkey! {
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

redis_and_valkey! {
    async fn a_token_bucket_with_reserve_never_admits_more_than_its_rate_allows() {
        bucket_fleet("token_bucket", "").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gcra_with_reserve_in_delay_mode_never_admits_more_than_its_rate_allows() {
    bucket_fleet("gcra", "    on_limit: delay\n    max_delay: 100ms\n").await;
}

/// One gateway, one key, `limits` in delay mode (max_delay 2 s), the store's
/// default timeout (50 ms): `n` requests at once, statuses counted.
async fn delayed_burst(limits: &str, n: usize) -> BTreeMap<u16, usize> {
    let redis = RedisServer::start();
    let yaml = format!(
        "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    on_limit: delay\n    max_delay: 2s\n    limits: {limits}\n",
        redis_store(&url_target(&redis.url()), "deny", 50),
    );
    let g = start_gateway(&yaml).await;
    burst(&[g.addr], n, "shared").await
}

/// Requests that must wait (delay mode) are one call each, with or without
/// `reserve`; without it, those that arrive together share calls. With it, a key's
/// calls go one at a time: 150 requests at once queue behind each other's calls and
/// those at the back run out of the store's timeout (503), though Redis answered
/// every call at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_requests_of_a_reserved_key_are_not_timed_out_by_waiting_for_each_other() {
    // Burst 10, then one every 10 ms: the 150th waits 1.4 s, within max_delay.
    let without = delayed_burst(
        "[{name: hot, algorithm: gcra, rate: 100/s, burst: 10}]",
        150,
    )
    .await;
    assert_eq!(without, BTreeMap::from([(200, 150)]));
    let with = delayed_burst(
        "[{name: hot, algorithm: gcra, rate: 100/s, burst: 10, reserve: 5}]",
        150,
    )
    .await;
    assert_eq!(with, BTreeMap::from([(200, 150)]));
}

/// A take whose answer comes back late (Redis stalled by a long script, a fork, a
/// slow network) times its request out, but still runs when Redis gets to it, and its
/// units are counted in the shared count. They must not be lost: the take waits for
/// its answer longer than the request does, and the units it brings are spent by the
/// next requests, with no call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn units_taken_by_a_call_answered_after_its_request_timed_out_are_spent() {
    let redis = RedisServer::start();
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&redis.url()), "deny", 50),
        route("[{name: hot, algorithm: fixed_window, limit: 1000, window: 1h, reserve: 10}]")
    );
    let g = start_gateway(&yaml).await;
    let count = || {
        let key = redis.keys("sluice:{api:shared}:*")[0].clone();
        window_count(&redis.cmd::<String>(&["GET", key.as_str()]))
    };
    // A busy key: 30 requests one after another, then what the gateway still holds
    // spent, so that the next request takes (as many as the key's rate asks, ≥ 1).
    let mut admitted = 0;
    for _ in 0..30 {
        assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 200);
        admitted += 1;
    }
    let held = count() - admitted;
    for _ in 0..held {
        assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 200);
        admitted += 1;
    }
    assert_eq!(count(), admitted, "everything taken was spent");
    // Redis busy for 1 s (within TAKE_WITHIN, 2 s) with a script of its own; the
    // next request's take waits behind it, times out on the gateway's side (503),
    // and runs afterwards.
    let stall = tokio::task::block_in_place(|| redis.stall(Duration::from_secs(1)));
    assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 503);
    stall.join().expect("stall thread");
    // The late take's answer arrives within TAKE_WITHIN (2 s).
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while count() == admitted {
        assert!(std::time::Instant::now() < deadline, "the take never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let taken = count() - admitted;
    assert!(
        taken >= 2,
        "the late call took the request's unit and more: {taken}"
    );
    // The request's own unit is lost as any timed-out call's is; the units beyond it
    // are held, and the next requests spend them without a call.
    let calls = redis.calls("evalsha");
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..taken - 1 {
        assert_eq!(get(g.addr, "/", &[("x-key", "shared")]).await.status, 200);
    }
    assert_eq!(redis.calls("evalsha"), calls);
    assert_eq!(count() - admitted, taken);
    assert_eq!(
        metric(
            g.admin_addr,
            "sluice_reserve_unused_total",
            &[("route", "api"), ("limit", "hot")],
        )
        .await,
        0.0
    );
}

/// `delayed_requests_of_a_reserved_key_are_not_timed_out_by_waiting_for_each_other`
/// with the default `on_error: local`: the requests that ran out of the timeout
/// waiting for the key's take are decided by this instance's memory fallback, a
/// budget of its own, though Redis never failed. The fleet's shared bucket (burst 10,
/// 100/s) admits at most 10 + 100 × t requests in the first t seconds; the gateway
/// forwards far more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserved_key_in_delay_mode_never_passes_more_than_its_shared_bucket_on_a_healthy_redis()
{
    let redis = RedisServer::start();
    let yaml = format!(
        "{}routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    on_limit: delay\n    max_delay: 2s\n    limits: [{{name: hot, algorithm: gcra, rate: 100/s, burst: 10, reserve: 5}}]\n",
        redis_store(&url_target(&redis.url()), "local", 50),
    );
    let g = start_gateway(&yaml).await;
    let start = std::time::Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..150 {
        let addr = g.addr;
        tasks.spawn(async move {
            let status = get(addr, "/", &[("x-key", "shared")]).await.status;
            (status, start.elapsed())
        });
    }
    let mut early = 0;
    let mut statuses = BTreeMap::new();
    while let Some(r) = tasks.join_next().await {
        let (status, at) = r.expect("request task");
        *statuses.entry(status).or_insert(0) += 1;
        if status == 200 && at < Duration::from_millis(700) {
            early += 1;
        }
    }
    assert_eq!(statuses, BTreeMap::from([(200, 150)]));
    // Burst 10, then 100/s: at most 80 (one more for rounding) in the first 700 ms.
    assert!(early <= 81, "{early} forwarded in the first 700 ms");
    // Redis answered every call: nothing was decided by the fallback.
    assert_eq!(
        metric(
            g.admin_addr,
            "sluice_requests_total",
            &[("route", "api"), ("decision", "store_error_allowed")],
        )
        .await,
        0.0
    );
}
