//! Gateways on the Redis store, end to end: several instances sharing one Redis (or
//! a cluster) admit exactly the limit; a script flush loses no request; an outage
//! applies `on_error` without waiting on a dead Redis and recovers by itself; and
//! processes with skewed clocks agree because Redis' clock decides.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::redis::*;

/// One route answered by sluice itself, keyed by `x-key`, with `limits`.
pub(crate) fn route(limits: &str) -> String {
    format!(
        "routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: {limits}\n"
    )
}

/// Two limits, the first binding: exactly 100 per hour.
const HUNDRED: &str = "[{name: hourly, algorithm: sliding_log, limit: 100, window: 1h}, {name: bucket, algorithm: token_bucket, rate: 1000/h, burst: 150}]";

/// Fires `n` requests at once, spread round robin over `addrs`; statuses counted.
pub(crate) async fn burst(addrs: &[SocketAddr], n: usize, key: &str) -> BTreeMap<u16, usize> {
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

/// Sum of a metric over several gateways.
pub(crate) async fn total(gateways: &[Running], name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for g in gateways {
        sum += metric(g.admin_addr, name, labels).await;
    }
    sum
}

/// Three gateways with `yaml`, 300 concurrent requests of one key: exactly 100
/// admitted, 200 refused, nothing else, and the metrics say the same.
async fn three_gateways_admit_exactly_the_limit(yaml: &str) -> Vec<Running> {
    let gateways = vec![
        start_gateway(yaml).await,
        start_gateway(yaml).await,
        start_gateway(yaml).await,
    ];
    let addrs: Vec<SocketAddr> = gateways.iter().map(|g| g.addr).collect();
    let statuses = burst(&addrs, 300, "shared").await;
    assert_eq!(statuses, BTreeMap::from([(200, 100), (429, 200)]));
    let requests = "sluice_requests_total";
    assert_eq!(
        total(
            &gateways,
            requests,
            &[("route", "api"), ("decision", "allowed")]
        )
        .await,
        100.0
    );
    assert_eq!(
        total(
            &gateways,
            requests,
            &[("route", "api"), ("decision", "limited")]
        )
        .await,
        200.0
    );
    assert_eq!(
        total(
            &gateways,
            "sluice_store_errors_total",
            &[("store", "redis")]
        )
        .await,
        0.0
    );
    // Every decision was timed under store="redis" (refusals answered from the
    // refusal cache included).
    let timed = total(
        &gateways,
        "sluice_limiter_duration_seconds_count",
        &[("store", "redis")],
    )
    .await;
    assert_eq!(timed, 300.0);
    // Every gateway took part.
    for g in &gateways {
        assert!(metric(g.admin_addr, requests, &[("route", "api")]).await >= 100.0);
    }
    gateways
}

// === b, e: exactness across instances ===

redis_and_valkey! {
    async fn three_gateways_on_one_redis_admit_exactly_the_limit() {
        let redis = RedisServer::start();
        let yaml = format!(
            "{}{}",
            redis_store(&url_target(&redis.url()), "deny", 2000),
            route(HUNDRED)
        );
        three_gateways_admit_exactly_the_limit(&yaml).await;
        // Two keys, one per limit, sharing the hash tag; both expire on their own.
        let mut keys: Vec<String> = redis.keys("*");
        keys.sort();
        assert_eq!(keys.len(), 2, "{keys:?}");
        for k in &keys {
            assert!(k.starts_with("sluice:{api:shared}:"), "{k}");
            assert!(k.len() <= "sluice:{api:shared}:".len() + 11, "{k}");
        }
        // The token bucket's state is a string, the hourly sliding log's a sorted set.
        let zset = keys
            .iter()
            .find(|k| redis.cmd::<String>(&["TYPE", k.as_str()]) == "zset")
            .unwrap();
        assert_eq!(redis.cmd::<i64>(&["ZCARD", zset]), 100);
        for k in &keys {
            let ttl: i64 = redis.cmd(&["PTTL", k]);
            assert!(ttl > 0 && ttl <= 3_600_001, "{k}: {ttl}");
        }
    }
}

redis_and_valkey! {
    async fn three_gateways_on_a_cluster_admit_exactly_the_limit() {
        let cluster = RedisCluster::start();
        let yaml = format!(
            "{}{}",
            redis_store(&cluster_target(&cluster.urls()), "deny", 2000),
            route(HUNDRED)
        );
        three_gateways_admit_exactly_the_limit(&yaml).await;
        // Both keys on one node: the hash tag keeps a request's keys in one slot.
        let per_node: Vec<usize> = cluster.nodes.iter().map(|n| n.keys("*").len()).collect();
        let mut sorted = per_node.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 0, 2], "{per_node:?}");
    }
}

/// The node of `cluster` that holds `key`'s slot.
fn owner(cluster: &RedisCluster, key: &str) -> usize {
    let slot: i64 = cluster.nodes[0].cmd(&["CLUSTER", "KEYSLOT", key]);
    cluster
        .nodes
        .iter()
        .position(|n| {
            let nodes: String = n.cmd(&["CLUSTER", "NODES"]);
            let mine = nodes.lines().find(|l| l.contains("myself")).unwrap_or("");
            mine.split_whitespace().skip(8).any(|range| {
                let (lo, hi) = range.split_once('-').unwrap_or((range, range));
                let (lo, hi) = (lo.parse().unwrap_or(-1), hi.parse().unwrap_or(-1));
                (lo..=hi).contains(&slot)
            })
        })
        .expect("a node owns every slot")
}

redis_and_valkey! {
    /// A route that limits per address and per account (`key` on a limit) on a
    /// cluster, where the two keys of one request live on different nodes and are
    /// decided by a call each: a request one of them refuses charges the other
    /// nothing, because the node that admitted it is refunded.
    async fn on_a_cluster_a_request_refused_on_one_node_is_refunded_on_the_other() {
        let cluster = RedisCluster::start();
        let up = crate::common::upstream().await;
        let yaml = format!(
            "{}client_ip: {{trusted_proxies: [127.0.0.1/32]}}\nupstreams:\n  api: {{targets: [\"{}\"]}}\nroutes:\n  - name: login\n    match: {{path: /login}}\n    upstream: api\n    key: ip\n    limits:\n      - {{name: per_ip, algorithm: fixed_window, limit: 5, window: 1h}}\n      - {{name: per_account, key: \"header:x-user\", algorithm: sliding_log, limit: 3, window: 1h}}\n",
            redis_store(&cluster_target(&cluster.urls()), "deny", 2000),
            up.url()
        );
        let gw = start_gateway(&yaml).await;
        // The tags the two keys are stored under (`limit::redis::tag`; the limit key's
        // namespace names it, its `:` escaped).
        let ip_tag = |ip: &str| format!("{{login:{ip}}}");
        let user_tag = |u: &str| format!("{{login/key=header\\;x-user:{u}}}");
        // An address and two accounts whose keys live on nodes other than the address's.
        let ip = "192.0.2.1";
        let home = owner(&cluster, &ip_tag(ip));
        let mut away = (0..200)
            .map(|i| format!("acct{i}"))
            .filter(|u| owner(&cluster, &user_tag(u)) != home);
        let (victim, spare) = (away.next().unwrap(), away.next().unwrap());
        let login = |ip: &str, user: &str| {
            let (ip, user) = (ip.to_string(), user.to_string());
            async move {
                get(
                    gw.addr,
                    "/login",
                    &[("x-forwarded-for", &ip), ("x-user", &user)],
                )
                .await
                .status
            }
        };
        // The address's count as its node keeps it: "<window> <count>".
        let ip_count = || -> Option<u64> {
            let keys: Vec<String> =
                cluster.nodes[home].cmd(&["KEYS", &format!("sluice:{}:*", ip_tag(ip))]);
            let state: String = cluster.nodes[home].cmd(&["GET", keys.first()?]);
            state.split(' ').nth(1)?.parse().ok()
        };

        // The account is refused on its node after three; the address's node admitted
        // the two refused requests, and is refunded them.
        let mut got = Vec::new();
        for _ in 0..5 {
            got.push(login(ip, &victim).await);
        }
        assert_eq!(got, [200, 200, 200, 429, 429]);
        assert_eq!(up.hits(), 3);
        let refunded =
            crate::common::eventually(Duration::from_secs(2), || async { ip_count() == Some(3) });
        assert!(
            refunded.await.is_some(),
            "per_ip counts {:?}, not 3",
            ip_count()
        );
        // So the address has two requests left, not none.
        let mut got = Vec::new();
        for i in 0..3 {
            got.push(login(ip, &format!("other{i}")).await);
        }
        assert_eq!(got, [200, 200, 429]);
        assert_eq!(up.hits(), 5);

        // The other way round: the address refuses (its node), the account's node
        // admitted and is refunded: `spare` still has its three, from other addresses.
        assert_eq!(login(ip, &spare).await, 429);
        let spare_tag = user_tag(&spare);
        let spare_node = &cluster.nodes[owner(&cluster, &spare_tag)];
        let spare_count = || -> usize {
            spare_node
                .cmd::<Vec<String>>(&["KEYS", &format!("sluice:{spare_tag}:*")])
                .iter()
                .map(|k| spare_node.cmd::<usize>(&["ZCARD", k]))
                .sum()
        };
        let refunded =
            crate::common::eventually(Duration::from_secs(2), || async { spare_count() == 0 });
        assert!(refunded.await.is_some(), "{spare} holds {}", spare_count());
        let mut got = Vec::new();
        for other in [
            "198.51.100.1",
            "198.51.100.2",
            "198.51.100.3",
            "198.51.100.4",
        ] {
            got.push(login(other, &spare).await);
        }
        assert_eq!(got, [200, 200, 200, 429]);
        assert_eq!(up.hits(), 8);
    }
}

// === c: SCRIPT FLUSH mid-traffic ===

redis_and_valkey! {
    async fn script_flush_mid_traffic_loses_no_request() {
        let redis = RedisServer::start();
        let limits = "[{algorithm: sliding_log, limit: 300, window: 1h}]";
        let yaml = format!(
            "{}{}",
            redis_store(&url_target(&redis.url()), "deny", 2000),
            route(limits)
        );
        let gw = start_gateway(&yaml).await;

        // Flush the script cache over and over while the traffic runs.
        let stop = Arc::new(AtomicBool::new(false));
        let flusher = {
            let stop = stop.clone();
            let mut conn = redis.connection().unwrap();
            std::thread::spawn(move || {
                let mut flushes = 0;
                while !stop.load(Ordering::Relaxed) {
                    let _: () = redis::cmd("SCRIPT").arg("FLUSH").query(&mut conn).unwrap();
                    flushes += 1;
                    std::thread::sleep(Duration::from_millis(3));
                }
                flushes
            })
        };
        let mut statuses = BTreeMap::new();
        for _ in 0..8 {
            for (s, n) in burst(&[gw.addr], 50, "flushed").await {
                *statuses.entry(s).or_insert(0) += n;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let flushes = flusher.join().unwrap();

        assert_eq!(statuses, BTreeMap::from([(200, 300), (429, 100)]));
        assert_eq!(
            metric(gw.admin_addr, "sluice_store_errors_total", &[]).await,
            0.0
        );
        assert!(flushes >= 10, "{flushes}");
        // The script really was lost: calls found it missing and sent it whole.
        let (evalsha, eval) = (redis.calls("evalsha"), redis.calls("eval"));
        assert!(
            eval >= 1 && evalsha > eval,
            "EVALSHA {evalsha}, EVAL {eval}"
        );
    }
}

redis_and_valkey! {
    /// Requests that wait for Redis together are decided by one script call, each as if
    /// it had a call of its own, in turn: exactly the limit of each key, whichever call
    /// and place in it its requests got.
    async fn requests_waiting_together_share_one_script_call() {
        let redis = RedisServer::start();
        let yaml = format!(
            "{}{}",
            redis_store(&url_target(&redis.url()), "deny", 5000),
            route("[{algorithm: sliding_log, limit: 3, window: 1h}]")
        );
        let gw = start_gateway(&yaml).await;
        assert_eq!(get(gw.addr, "/", &[("x-key", "warm")]).await.status, 200);
        let before = redis.calls("evalsha");

        // While Redis holds every command, the first call waits and the other requests
        // queue behind it: two calls at most for 50 requests of 10 clients.
        let _: String = redis.cmd(&["CLIENT", "PAUSE", "1500", "ALL"]);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..50 {
            let key = format!("k{}", i % 10);
            let addr = gw.addr;
            tasks.spawn(async move { (key.clone(), get(addr, "/", &[("x-key", &key)]).await.status) });
        }
        let mut per_key: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        while let Some(r) = tasks.join_next().await {
            let (key, status) = r.expect("request task");
            let e = per_key.entry(key).or_default();
            match status {
                200 => e.0 += 1,
                429 => e.1 += 1,
                s => panic!("status {s}"),
            }
        }
        let expected: BTreeMap<String, (usize, usize)> =
            (0..10).map(|i| (format!("k{i}"), (3, 2))).collect();
        assert_eq!(per_key, expected);
        let calls = redis.calls("evalsha") - before;
        assert!(
            (1..=2).contains(&calls),
            "{calls} script calls for 50 requests"
        );
        for i in 0..10 {
            let keys: Vec<String> = redis.cmd(&["KEYS", &format!("sluice:{{api:k{i}}}:*")]);
            assert_eq!(keys.len(), 1, "{keys:?}");
            assert_eq!(redis.cmd::<i64>(&["ZCARD", &keys[0]]), 3);
        }
    }
}

// === d: Redis dies and comes back ===

/// What 50 sequential requests of a fresh key got while Redis was down.
struct Outage {
    statuses: Vec<u16>,
    took: Duration,
    /// The gateway's metrics right after them.
    metrics: String,
    _gateway: Running,
    _redis: RedisServer,
}

const TIMEOUT_MS: u64 = 100;

/// A gateway with `on_error`, a limit of 5 per hour; Redis killed after one request,
/// 50 requests while it is down; then restarted on the same port, and within 3 s
/// requests are decided in Redis again and `/readyz` is 200.
async fn outage(on_error: &str) -> Outage {
    let mut redis = RedisServer::start();
    let limits = "[{algorithm: sliding_log, limit: 5, window: 1h}]";
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&redis.url()), on_error, TIMEOUT_MS),
        route(limits)
    );
    let gw = start_gateway(&yaml).await;
    let (addr, admin) = (gw.addr, gw.admin_addr);
    assert_eq!(get(admin, "/readyz", &[]).await.status, 200);
    assert_eq!(get(gw.addr, "/", &[("x-key", "before")]).await.status, 200);
    let allowed = || {
        metric(
            admin,
            "sluice_requests_total",
            &[("route", "api"), ("decision", "allowed")],
        )
    };
    assert_eq!(allowed().await, 1.0);

    redis.kill();
    let t0 = Instant::now();
    let mut statuses = Vec::new();
    for _ in 0..50 {
        statuses.push(get(gw.addr, "/", &[("x-key", "during")]).await.status);
    }
    let took = t0.elapsed();
    // Not one timeout per request: after a few failures the breaker answers at once.
    assert!(
        took < Duration::from_millis(50 * TIMEOUT_MS / 2),
        "{took:?}"
    );
    let store = gw.shared.store.redis_store().expect("redis store");
    assert!(store.skipped() >= 45, "breaker skipped {}", store.skipped());
    let errors = metric(admin, "sluice_store_errors_total", &[("store", "redis")]).await;
    assert!((1.0..=5.0).contains(&errors), "{errors}");
    assert_eq!(get(admin, "/readyz", &[]).await.status, 503);
    let metrics = get(admin, "/metrics", &[]).await.body;
    assert_eq!(
        metric_in(
            &metrics,
            "sluice_requests_total",
            &[("decision", "allowed")]
        ),
        1.0
    );

    redis.restart();
    let mut n = 0;
    let back = eventually(Duration::from_secs(3), || {
        n += 1;
        let key = format!("after-{n}");
        async move {
            let before = allowed().await;
            get(addr, "/", &[("x-key", &key)]).await;
            allowed().await > before
        }
    })
    .await;
    assert!(
        back.is_some(),
        "requests not decided by Redis within 3 s of its restart"
    );
    assert_eq!(get(admin, "/readyz", &[]).await.status, 200);
    assert!(!redis.keys("*").is_empty());
    Outage {
        statuses,
        took,
        metrics,
        _gateway: gw,
        _redis: redis,
    }
}

fn decisions(o: &Outage, decision: &str) -> f64 {
    let labels = [("route", "api"), ("decision", decision)];
    metric_in(&o.metrics, "sluice_requests_total", &labels)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_with_on_error_deny_answers_503() {
    let o = outage("deny").await;
    assert_eq!(o.statuses, vec![503; 50]);
    assert_eq!(decisions(&o, "store_error_denied"), 50.0);
    assert_eq!(decisions(&o, "store_error_allowed"), 0.0);
    eprintln!("deny: 50 requests with Redis down took {:?}", o.took);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_with_on_error_allow_forwards() {
    let o = outage("allow").await;
    assert_eq!(o.statuses, vec![200; 50]);
    assert_eq!(decisions(&o, "store_error_allowed"), 50.0);
    assert_eq!(decisions(&o, "limited"), 0.0);
}

redis_and_valkey! {
    async fn redis_down_with_on_error_local_applies_the_limit_in_memory() {
        let o = outage("local").await;
        let mut expected = vec![200; 5];
        expected.extend([429; 45]);
        assert_eq!(o.statuses, expected);
        assert_eq!(decisions(&o, "store_error_allowed"), 5.0);
        assert_eq!(decisions(&o, "limited"), 45.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_started_before_redis_serves_once_it_answers() {
    let port = free_port();
    let url = format!("redis://127.0.0.1:{port}");
    let limits = "[{algorithm: sliding_log, limit: 5, window: 1h}]";
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&url), "deny", TIMEOUT_MS),
        route(limits)
    );
    // Starts anyway: not ready, and on_error applies without calling Redis.
    let gw = start_gateway(&yaml).await;
    assert_eq!(get(gw.admin_addr, "/readyz", &[]).await.status, 503);
    assert_eq!(get(gw.addr, "/", &[("x-key", "k")]).await.status, 503);
    let store = gw.shared.store.redis_store().expect("redis store");
    assert_eq!(store.skipped(), 1);

    let redis = RedisServer::start_at(port);
    let up = eventually(Duration::from_secs(3), || async {
        get(gw.addr, "/", &[("x-key", "k")]).await.status == 200
    })
    .await;
    assert!(up.is_some(), "not decided by Redis within 3 s of its start");
    // Ready once the shared deny list has been read too (within one retry).
    let ready = eventually(Duration::from_secs(1), || async {
        get(gw.admin_addr, "/readyz", &[]).await.status == 200
    })
    .await;
    assert!(ready.is_some(), "not ready within 1 s of deciding in Redis");
    assert_eq!(redis.keys("*").len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_slower_than_the_timeout_is_cut_off_and_recovers() {
    let redis = RedisServer::start();
    let limits = "[{algorithm: sliding_log, limit: 1000, window: 1h}]";
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&redis.url()), "allow", TIMEOUT_MS),
        route(limits)
    );
    let gw = start_gateway(&yaml).await;
    let admin = gw.admin_addr;
    assert_eq!(get(gw.addr, "/", &[("x-key", "k")]).await.status, 200);
    let count = |decision: &'static str| async move {
        let labels = [("route", "api"), ("decision", decision)];
        metric(admin, "sluice_requests_total", &labels).await
    };

    // Redis stops answering anyone for 1.5 s.
    let _: () = redis::cmd("CLIENT")
        .arg(&["PAUSE", "1500", "ALL"])
        .query(&mut redis.connection().unwrap())
        .unwrap();
    let t0 = Instant::now();
    for _ in 0..20 {
        assert_eq!(get(gw.addr, "/", &[("x-key", "k")]).await.status, 200);
    }
    let took = t0.elapsed();
    // About three timeouts, then the breaker answers at once.
    assert!(
        took < Duration::from_millis(20 * TIMEOUT_MS / 2),
        "{took:?}"
    );
    assert_eq!(count("store_error_allowed").await, 20.0);
    assert_eq!(get(admin, "/readyz", &[]).await.status, 503);

    let back = eventually(Duration::from_secs(3), || async {
        let before = count("allowed").await;
        get(gw.addr, "/", &[("x-key", "k")]).await;
        count("allowed").await > before
    })
    .await;
    assert!(
        back.is_some(),
        "not decided by Redis within 3 s of the pause"
    );
    assert_eq!(get(admin, "/readyz", &[]).await.status, 200);
}

// === f: skewed clocks ===

/// Microseconds until the end of the current `window_us` window on Redis' clock.
pub(crate) fn until_window_end(redis: &RedisServer, window_us: u64) -> u64 {
    let t: Vec<u64> = redis.cmd(&["TIME"]);
    let now = t[0] * 1_000_000 + t[1];
    window_us - now % window_us
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_with_skewed_clocks_agree_on_every_decision() {
    // libfaketime works here: a process under it sees its clock an hour off.
    let faked =
        run_grouped(Command::new("date").arg("+%s").envs(faketime_env("-1h"))).expect("date runs");
    let faked: u64 = String::from_utf8_lossy(&faked.stdout)
        .trim()
        .parse()
        .expect("date prints seconds");
    let real = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    assert!(
        (3_590..=3_610).contains(&(real - faked)),
        "faketime: {faked} vs {real}"
    );

    let redis = RedisServer::start();
    let hour = 3_600_000_000;
    // Not across a window boundary on Redis' clock (that would rightly admit more).
    let left = until_window_end(&redis, hour);
    if left < 60_000_000 {
        tokio::time::sleep(Duration::from_micros(left + 1_000_000)).await;
    }
    let limits = "[{algorithm: fixed_window, limit: 20, window: 1h}]";
    let yaml = format!(
        "{}{}",
        redis_store(&url_target(&redis.url()), "deny", 2000),
        route(limits)
    );
    let behind = SluiceProcess::start_faked("-1h", &yaml).await;
    let ahead = SluiceProcess::start_faked("+1h", &yaml).await;

    let mut admitted = [0, 0];
    let mut refused = [0, 0];
    for i in 0..60 {
        let p = if i % 2 == 0 { &behind } else { &ahead };
        match get(p.addr, "/", &[("x-key", "skewed")]).await.status {
            200 => admitted[i % 2] += 1,
            429 => refused[i % 2] += 1,
            s => panic!("request {i}: status {s}"),
        }
    }
    // The first 20 in turn, 10 through each, then nothing: one window, one count.
    assert_eq!((admitted, refused), ([10, 10], [20, 20]));
    let keys: Vec<String> = redis.keys("*");
    assert_eq!(keys.len(), 1, "{keys:?}");
    let state: String = redis.cmd(&["GET", &keys[0]]);
    assert_eq!(state.split(' ').nth(1), Some("20"), "{state}");
    // No leak: every key expires by itself, by the end of its window on Redis' clock.
    let left_ms = until_window_end(&redis, hour) / 1_000;
    for k in &keys {
        let ttl: i64 = redis.cmd(&["PTTL", k]);
        assert!(
            ttl > 0 && ttl as u64 <= left_ms + 1_001,
            "{k}: {ttl} ms, window ends in {left_ms} ms"
        );
    }
}
