//! Store faults, end to end: a Redis connection that the server closes while the
//! gateway is idle (`timeout`, `CLIENT KILL`) costs no request and no error, while a
//! Redis that is really down is still counted and opens the breaker; and the memory
//! store's eviction never gives a live key on one route a fresh budget because
//! another route filled the store.

use std::time::Duration;

use crate::common::redis::*;

/// One route answered by sluice itself, keyed by `x-key`: 3 per hour.
const ROUTE: &str = "routes:\n  - name: api\n    match: {path_prefix: /}\n    respond: {status: 200, body: \"ok\\n\"}\n    key: header:x-key\n    limits: [{name: hourly, algorithm: fixed_window, limit: 3, window: 1h}]\n";

/// Four requests of `key`, one after the other.
async fn four(gw: &Running, key: &str) -> Vec<u16> {
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(get(gw.addr, "/", &[("x-key", key)]).await.status);
    }
    statuses
}

async fn store_errors(gw: &Running) -> f64 {
    metric(
        gw.admin_addr,
        "sluice_store_errors_total",
        &[("store", "redis")],
    )
    .await
}

/// The clients of `server` other than the one asking, from `CLIENT LIST`.
fn others(server: &RedisServer) -> Vec<String> {
    let mut c = server.connection().expect("connect to redis");
    let me: u64 = redis::cmd("CLIENT")
        .arg("ID")
        .query(&mut c)
        .expect("CLIENT ID");
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query(&mut c)
        .expect("CLIENT LIST");
    list.lines()
        .filter(|l| !l.starts_with(&format!("id={me} ")))
        .map(str::to_string)
        .collect()
}

fn ids(clients: &[String]) -> Vec<String> {
    clients
        .iter()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

/// Lets the gateway's Redis client read the close (microseconds; 20 ms under a busy
/// machine), and no longer: its idle PING, every 200 ms, would find the closed
/// connection first and spare the requests. A request that races the close itself
/// was handed to the connection and is not sent again (see `Inner::query`).
async fn after_the_close() {
    tokio::time::sleep(Duration::from_millis(20)).await;
}

/// After each idle drop, exactly three of four requests are admitted on
/// `on_error: deny`, nothing counts as a store error, and the gateway stays ready.
async fn serves_after(gw: &Running, round: usize) {
    assert_eq!(
        four(gw, &format!("k{round}")).await,
        [200, 200, 200, 429],
        "round {round}"
    );
    assert_eq!(store_errors(gw).await, 0.0, "round {round}");
    assert_eq!(get(gw.admin_addr, "/readyz", &[]).await.status, 200);
}

/// A gateway on the Redis store at `target` (`on_error: deny`), checked to serve
/// (round 0 of `serves_after`).
async fn serving_gateway(target: &str) -> Running {
    let yaml = format!("{}{ROUTE}", redis_store(target, "deny", 500));
    let gw = start_gateway(&yaml).await;
    serves_after(&gw, 0).await;
    gw
}

// === item 4: idle connections closed by Redis ===

/// Redis `timeout 1`: the gateway sits idle well past it, three times.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_timeout_on_redis_costs_no_request() {
    let redis = RedisServer::start();
    let _: () = redis.cmd(&["CONFIG", "SET", "timeout", "1"]);
    let gw = serving_gateway(&url_target(&redis.url())).await;
    let before = ids(&others(&redis));
    for round in 1..=3 {
        // The scenario itself: idle for longer than the server's timeout.
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        serves_after(&gw, round).await;
    }
    // Kept alive: the very same connections, never closed by the server.
    assert_eq!(ids(&others(&redis)), before);
}

/// `CLIENT KILL TYPE normal` while the gateway is idle, three times: each time the
/// next requests are served at once, charged exactly once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_connection_costs_no_request() {
    let redis = RedisServer::start();
    let gw = serving_gateway(&url_target(&redis.url())).await;
    for round in 1..=3 {
        let killed: u64 = redis.cmd(&["CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"]);
        assert!(killed >= 1, "round {round}");
        after_the_close().await;
        serves_after(&gw, round).await;
    }
}

/// The same for one client killed by id: the limiter's own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_by_id_costs_no_request() {
    let redis = RedisServer::start();
    let gw = serving_gateway(&url_target(&redis.url())).await;
    for round in 1..=3 {
        for id in ids(&others(&redis)) {
            let id = id.trim_start_matches("id=");
            let _: u64 = redis.cmd(&["CLIENT", "KILL", "ID", id]);
        }
        after_the_close().await;
        serves_after(&gw, round).await;
    }
}

/// A Redis that is really gone is still a failure: counted, and the breaker opens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_is_down_is_still_counted() {
    let mut redis = RedisServer::start();
    let gw = serving_gateway(&url_target(&redis.url())).await;
    redis.kill();
    // Before the prober notices, each request is a failed call: 503, counted.
    let first = get(gw.addr, "/", &[("x-key", "down")]).await.status;
    assert_eq!(first, 503);
    assert!(store_errors(&gw).await >= 1.0);
    let open = eventually(Duration::from_secs(5), || async {
        get(gw.admin_addr, "/readyz", &[]).await.status == 503
    })
    .await;
    assert!(open.is_some(), "the breaker never opened");
    assert_eq!(four(&gw, "down").await, [503; 4]);
}

// === the same on a cluster ===

/// `timeout 1` on every node while the gateway is idle, and while its traffic only
/// ever reaches one node: the connections to the other nodes are kept alive too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_survives_idle_timeouts() {
    let cluster = RedisCluster::start();
    for n in &cluster.nodes {
        let _: () = n.cmd(&["CONFIG", "SET", "timeout", "1"]);
    }
    let gw = serving_gateway(&cluster_target(&cluster.urls())).await;
    for round in 1..=2 {
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        serves_after(&gw, round).await;
    }
    // Busy on one key (one node) for longer than the timeout, then the others.
    let busy = std::time::Instant::now();
    let mut n = 0;
    while busy.elapsed() < Duration::from_millis(2_500) {
        get(gw.addr, "/", &[("x-key", "busy")]).await;
        n += 1;
    }
    assert!(n > 4);
    for round in 3..=8 {
        serves_after(&gw, round).await;
    }
}

// === item 7: eviction keeps each route's share ===

/// `/login` by client IP (3 per hour), everything else by `x-key` (10 per hour), in a
/// memory store of 1,000 entries.
const TWO_ROUTES: &str = "store:\n  backend: memory\n  memory: {max_keys: 1000}\nroutes:\n  - name: login\n    match: {path: /login}\n    respond: {status: 200, body: \"ok\\n\"}\n    key: ip\n    limits: [{name: hourly, algorithm: fixed_window, limit: 3, window: 1h}]\n  - name: api\n    match: {path_prefix: /}\n    respond: {status: 200, body: \"ok\\n\"}\n    key: header:x-key\n    limits: [{name: hourly, algorithm: fixed_window, limit: 10, window: 1h}]\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_keys_on_one_route_does_not_reset_login() {
    flood_keeps_login(&start_gateway(TWO_ROUTES).await).await;
}

/// The same in the memory store that decides while Redis is unreachable
/// (`on_error: local`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_local_fallback_keeps_each_routes_share_too() {
    // Nothing listens there: the breaker is open from the start.
    let dead = format!("redis://127.0.0.1:{}", free_port());
    let yaml = TWO_ROUTES.replace(
        "store:\n  backend: memory\n",
        &format!(
            "store:\n  backend: redis\n  redis: {{url: \"{dead}\", timeout: 200ms}}\n  on_error: local\n"
        ),
    );
    assert_ne!(yaml, TWO_ROUTES);
    let gw = start_gateway(&yaml).await;
    assert_eq!(get(gw.admin_addr, "/readyz", &[]).await.status, 503);
    flood_keeps_login(&gw).await;
}

/// Two requests on /login, 2,500 new keys on the other route, then /login again.
async fn flood_keeps_login(gw: &Running) {
    let login = || get(gw.addr, "/login", &[]);
    assert_eq!([login().await.status, login().await.status], [200, 200]);
    // 2,500 distinct keys on the other route, 50 at a time.
    let addr = gw.addr;
    for chunk in 0..50 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..50 {
            let key = format!("key-{}", chunk * 50 + i);
            tasks.spawn(async move { get(addr, "/api", &[("x-key", &key)]).await.status });
        }
        while let Some(s) = tasks.join_next().await {
            assert_eq!(s.expect("request task"), 200);
        }
    }
    // The IP's budget on /login is where it was: one left, then refused.
    assert_eq!(
        [
            login().await.status,
            login().await.status,
            login().await.status
        ],
        [200, 429, 429]
    );
    let evictions = |route: &'static str| async move {
        metric(
            gw.admin_addr,
            "sluice_store_evictions_total",
            &[("route", route)],
        )
        .await
    };
    // 2,501 entries made in a store of 1,000: every eviction was api's live state.
    assert_eq!(evictions("api").await, 1_501.0);
    assert_eq!(evictions("login").await, 0.0);
    let text = get(gw.admin_addr, "/metrics", &[]).await.body;
    assert!(
        text.contains("sluice_store_evictions_total{route=\"login\"} 0"),
        "{text}"
    );
}
