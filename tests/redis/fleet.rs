//! The fleet view, end to end: gateways on one Redis (or a cluster) see each other
//! in `GET /admin/fleet` with their decision counts summed per route; a reload on
//! one shows as two config hashes; an instance stopped gracefully leaves at once, a
//! killed one turns stale (not ready, not summed) and leaves when its heartbeat
//! expires; a memory-store gateway sees itself alone.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::redis::*;
use serde_json::{json, Value};

const TOKEN: &str = "s3cret";
const AUTH: (&str, &str) = ("authorization", "Bearer s3cret");
/// The index of instance ids, with the harness' `key_prefix: "sluice:"`.
const IDS: &str = "sluice:{fleet}:ids";

/// Far longer than a heartbeat's interval (1 s) and its expiry (5 s) together.
const WITHIN: Duration = Duration::from_secs(20);

/// One route answered by sluice itself, keyed by `x-key`, `limit` requests an hour.
fn routes(limit: u32) -> String {
    format!(
        "routes:\n  - name: api\n    match: {{path_prefix: /}}\n    respond: {{status: 200, body: \"ok\\n\"}}\n    key: header:x-key\n    limits: [{{name: hourly, algorithm: sliding_log, limit: {limit}, window: 1h}}]\n"
    )
}

/// A whole in-process configuration: token-guarded admin API, `store`, `routes`.
fn gateway(store: &str, limit: u32) -> String {
    format!(
        "admin: {{listen: \"127.0.0.1:0\", token: {TOKEN}}}\n{store}{}",
        routes(limit)
    )
}

fn one_redis(redis: &RedisServer) -> String {
    redis_store(&url_target(&redis.url()), "deny", 500)
}

/// `n` requests of key `k` one after the other; their statuses.
async fn send(addr: SocketAddr, n: usize) -> Vec<u16> {
    send_key(addr, "k", n).await
}

/// `GET /admin/fleet`, which must answer 200 with JSON.
async fn fleet(admin: SocketAddr) -> Value {
    let a = get(admin, "/admin/fleet", &[AUTH]).await;
    assert_eq!(a.status, 200, "GET /admin/fleet: {}", a.body);
    assert_eq!(a.header("content-type"), Some("application/json"));
    serde_json::from_str(&a.body).expect("fleet JSON")
}

/// Polls `admin`'s view until `ok` holds, for at most `WITHIN`; the view then.
async fn fleet_until(what: &str, admin: SocketAddr, ok: impl Fn(&Value) -> bool) -> Value {
    let seen = std::sync::Mutex::new(Value::Null);
    let took = eventually(WITHIN, || async {
        let v = fleet(admin).await;
        let done = ok(&v);
        *seen.lock().unwrap() = v;
        done
    })
    .await;
    let last = seen.into_inner().unwrap();
    assert!(
        took.is_some(),
        "{what}: not within {WITHIN:?}; last view {last:#}"
    );
    last
}

/// The ids of the instances listed.
fn ids(v: &Value) -> Vec<String> {
    v["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .map(|i| i["id"].as_str().expect("id").to_string())
        .collect()
}

/// The listed instance whose `addr` is `addr`.
fn at(v: &Value, addr: SocketAddr) -> &Value {
    v["instances"]
        .as_array()
        .expect("instances")
        .iter()
        .find(|i| i["addr"] == addr.to_string())
        .unwrap_or_else(|| panic!("no instance at {addr} in {v:#}"))
}

/// A route's sums, every decision.
fn counts(allowed: u64, limited: u64) -> Value {
    json!({"allowed": allowed, "delayed": 0, "limited": limited, "denied": 0, "shadow": 0,
        "store_error_allowed": 0, "store_error_denied": 0, "bad_request": 0, "unauthorized": 0})
}

/// `sluice fleet ARGS --admin http://ADMIN` with the token in the environment:
/// its stdout, once it exited 0 (the client bounds its call by 10 s).
async fn cli_fleet(admin: SocketAddr, args: &[&str]) -> String {
    cli(admin, "fleet", args).await
}

/// `sluice COMMAND ARGS --admin http://ADMIN` with the token in the environment:
/// its stdout, once it exited 0.
async fn cli(admin: SocketAddr, command: &str, args: &[&str]) -> String {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    cmd.arg(command)
        .args(args)
        .args(["--admin", &format!("http://{admin}")])
        .env_remove("SLUICE_CONFIG")
        .env("SLUICE_ADMIN_TOKEN", TOKEN)
        .env("SLUICE_LOG", "warn");
    let out = tokio::task::spawn_blocking(move || run_grouped(&mut cmd))
        .await
        .expect("join")
        .expect("sluice runs");
    let stdout = String::from_utf8(out.stdout).expect("UTF-8");
    assert!(
        out.status.success(),
        "sluice {command} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

async fn config_hash(admin: SocketAddr) -> String {
    let a = get(admin, "/admin/config", &[AUTH]).await;
    assert_eq!(a.status, 200, "{}", a.body);
    let v: Value = serde_json::from_str(&a.body).expect("config JSON");
    v["hash"].as_str().expect("hash").to_string()
}

redis_and_valkey! {
    async fn two_instances_are_summed_a_reload_shows_and_a_stopped_one_leaves_at_once() {
        let redis = RedisServer::start();
        let yaml = gateway(&one_redis(&redis), 5);
        let (a, file) = start_gateway_file(&yaml).await;
        let b = start_gateway(&yaml).await;
        // One limit of 5 shared through Redis: 3 on A, then 2 of 4 on B, then none.
        assert_eq!(send(a.addr, 3).await, [200, 200, 200]);
        assert_eq!(send(b.addr, 4).await, [200, 200, 429, 429]);
        assert_eq!(send(a.addr, 2).await, [429, 429]);

        // Each sees the other once the other's heartbeat carries its counts.
        let summed = |v: &Value| ids(v).len() == 2 && v["routes"]["api"] == counts(5, 4);
        let from_a = fleet_until("A sees B's counts", a.admin_addr, summed).await;
        let from_b = fleet_until("B sees A's counts", b.admin_addr, summed).await;
        let hash = config_hash(a.admin_addr).await;
        assert_eq!(config_hash(b.admin_addr).await, hash);
        for (v, me) in [(&from_a, a.addr), (&from_b, b.addr)] {
            assert_eq!(v["routes"], json!({"api": counts(5, 4)}), "{v:#}");
            assert_eq!(v["config_hashes"], 1);
            assert_eq!(v["consistent"], true);
            assert_eq!(v["store"], "redis");
            assert_eq!(v.get("error"), None);
            let mut sorted = ids(v);
            sorted.sort();
            assert_eq!(ids(v), sorted, "instances sorted by id");
            for addr in [a.addr, b.addr] {
                let i = at(v, addr);
                assert_eq!(i["self"], addr == me, "{i}");
                assert_eq!(i["ready"], true, "{i}");
                assert_eq!(i["version"], env!("CARGO_PKG_VERSION"));
                assert_eq!(i["config_hash"], hash.as_str());
                let ms = i["last_seen_ms"].as_u64().expect("last_seen_ms");
                assert_eq!(i["last_seen"], sluice::deny::rfc3339(ms), "{i}");
                assert!(ms > 1_600_000_000_000, "{i}");
            }
        }
        assert_eq!(ids(&from_a), ids(&from_b));

        // A reloads another limit: the fleet is half reloaded, and says so.
        std::fs::write(file.path(), with_listeners(&gateway(&one_redis(&redis), 6))).expect("write");
        let r = request(a.admin_addr, "POST", "/admin/reload", &[AUTH], "").await;
        assert_eq!(r.status, 200, "{}", r.body);
        let new_hash = config_hash(a.admin_addr).await;
        assert_ne!(new_hash, hash);
        let split = fleet_until("B sees A's new hash", b.admin_addr, |v| {
            v["consistent"] == false
        })
        .await;
        assert_eq!(split["config_hashes"], 2);
        assert_eq!(at(&split, a.addr)["config_hash"], new_hash.as_str());
        assert_eq!(at(&split, b.addr)["config_hash"], hash.as_str());
        // A's own view has its new hash at once (its live state, not its heartbeat).
        let v = fleet(a.admin_addr).await;
        assert_eq!(
            (v["config_hashes"].clone(), v["consistent"].clone()),
            (json!(2), json!(false))
        );

        // B stops gracefully: it is gone from A's view at once, and its counts with it.
        let b_id = at(&v, b.addr)["id"].as_str().expect("id").to_string();
        b.shutdown().await;
        let v = fleet(a.admin_addr).await;
        assert_eq!(
            ids(&v),
            [at(&v, a.addr)["id"].as_str().expect("id")],
            "{v:#}"
        );
        assert_eq!(v["routes"], json!({"api": counts(3, 2)}));
        assert_eq!(
            (v["config_hashes"].clone(), v["consistent"].clone()),
            (json!(1), json!(true))
        );
        let index: Vec<String> = redis.cmd(&["ZRANGE", IDS, "0", "-1"]);
        assert!(!index.contains(&b_id), "{index:?}");
        assert_eq!(
            redis.cmd::<i64>(&["EXISTS", &format!("sluice:{{fleet}}:i:{b_id}")]),
            0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_view_wants_the_token_no_parameters_and_get() {
    let redis = RedisServer::start();
    let gw = start_gateway(&gateway(&one_redis(&redis), 5)).await;
    let a = get(gw.admin_addr, "/admin/fleet", &[]).await;
    assert_eq!(
        (a.status, a.body.as_str()),
        (401, "missing or wrong bearer token\n")
    );
    let a = get(gw.admin_addr, "/admin/fleet?verbose=1", &[AUTH]).await;
    assert_eq!(
        (a.status, a.body.as_str()),
        (400, "/admin/fleet takes no query parameters: verbose=1\n")
    );
    let a = request(gw.admin_addr, "POST", "/admin/fleet", &[AUTH], "").await;
    assert_eq!((a.status, a.header("allow")), (405, Some("GET")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_store_gateway_shows_itself_alone_with_its_counts() {
    let gw = start_gateway(&gateway("", 2)).await;
    assert_eq!(send(gw.addr, 3).await, [200, 200, 429]);
    let v = fleet(gw.admin_addr).await;
    let hash = config_hash(gw.admin_addr).await;
    let me = at(&v, gw.addr);
    assert_eq!(ids(&v).len(), 1, "{v:#}");
    assert_eq!(me["self"], true);
    assert_eq!(me["ready"], true);
    assert_eq!(me["config_hash"], hash.as_str());
    assert_eq!(v["routes"], json!({"api": counts(2, 1)}));
    assert_eq!(v["config_hashes"], 1);
    assert_eq!(v["consistent"], true);
    assert_eq!(v["store"], "memory");
    assert_eq!(v.get("error"), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_unreachable_the_view_is_this_instance_and_the_error() {
    let nowhere = format!("redis://127.0.0.1:{}", free_port());
    let gw = start_gateway(&gateway(
        &redis_store(&url_target(&nowhere), "allow", 200),
        2,
    ))
    .await;
    assert_eq!(send(gw.addr, 1).await, [200]);
    let v = fleet(gw.admin_addr).await;
    assert_eq!(ids(&v).len(), 1, "{v:#}");
    let me = at(&v, gw.addr);
    assert_eq!(
        (me["self"].clone(), me["ready"].clone()),
        (json!(true), json!(false))
    );
    assert_eq!(v["routes"]["api"]["store_error_allowed"], 1, "{v:#}");
    assert_eq!(v["store"], "redis");
    assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v:#}");
}

redis_and_valkey! {
    async fn a_killed_instance_of_three_turns_stale_then_leaves_the_view_within_6_s() {
        let redis = RedisServer::start();
        let a = start_gateway(&gateway(&one_redis(&redis), 5)).await;
        let b = start_gateway(&gateway(&one_redis(&redis), 5)).await;
        let mut p = SluiceProcess::start_admin(
            &format!("token: {TOKEN}"),
            &format!("{}{}", one_redis(&redis), routes(5)),
        )
        .await;
        assert_eq!(send(p.addr, 3).await, [200, 200, 200]);
        let v = fleet_until(
            "A sees three, with the process' counts",
            a.admin_addr,
            |v| ids(v).len() == 3 && v["live"] == 3 && v["routes"]["api"] == counts(3, 0),
        )
        .await;
        let mut live: Vec<String> = vec![
            at(&v, a.addr)["id"].as_str().expect("id").to_string(),
            at(&v, b.addr)["id"].as_str().expect("id").to_string(),
        ];
        live.sort();
        for i in v["instances"].as_array().expect("instances") {
            assert_eq!(
                (i["stale"].clone(), i["ready"].clone()),
                (json!(false), json!(true)),
                "{i}"
            );
        }

        // SIGKILL: no goodbye. Its heartbeat key expires 5 s after its last heartbeat
        // (at most 1 s before the kill); until then, past 2.5 s, it is listed stale.
        // Polled every 200 ms, 30 times: 6 s at the least.
        p.child.kill();
        let mut seen_stale = 0;
        let mut gone = None;
        for poll in 0..30 {
            let v = fleet(a.admin_addr).await;
            let listed = ids(&v);
            if listed == live {
                gone = Some((poll, v));
                break;
            }
            assert_eq!(listed.len(), 3, "{v:#}");
            let killed = at(&v, p.addr);
            if killed["stale"] == true {
                seen_stale += 1;
                // Stale: not ready, and its counts out of the sums and its instance out
                // of the live ones.
                assert_eq!(killed["ready"], false, "{killed}");
                assert_eq!(v["routes"]["api"], counts(0, 0), "{v:#}");
                assert_eq!(v["live"], 2, "{v:#}");
            } else {
                assert_eq!(v["routes"]["api"], counts(3, 0), "{v:#}");
                assert_eq!(v["live"], 3, "{v:#}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let Some((_, v)) = gone else {
            panic!("the killed instance is still listed after 30 polls 200 ms apart");
        };
        // Between 2.5 s and 5 s it was stale: polled 200 ms apart, seen so.
        assert!(seen_stale > 0, "never seen stale");
        assert_eq!(v["live"], 2);
        assert_eq!(v["routes"]["api"], counts(0, 0));
        // B sees the same two.
        assert_eq!(ids(&fleet(b.admin_addr).await), live);
        // Its id was cleaned from the index by the reader that found its key gone.
        let mut index: Vec<String> = redis.cmd(&["ZRANGE", IDS, "0", "-1"]);
        index.sort();
        assert_eq!(index, live);
    }
}

redis_and_valkey! {
    async fn on_a_cluster_both_instances_are_listed_and_sigterm_leaves_at_once() {
        let cluster = RedisCluster::start();
        let store = redis_store(&cluster_target(&cluster.urls()), "deny", 500);
        let a = start_gateway(&gateway(&store, 5)).await;
        let mut p =
            SluiceProcess::start_admin(&format!("token: {TOKEN}"), &format!("{store}{}", routes(5)))
                .await;
        assert_eq!(send(a.addr, 2).await, [200, 200]);
        assert_eq!(send(p.addr, 4).await, [200, 200, 200, 429]);
        let v = fleet_until("A sees the process' counts", a.admin_addr, |v| {
            ids(v).len() == 2 && v["routes"]["api"] == counts(5, 1)
        })
        .await;
        assert_eq!(at(&v, a.addr)["self"], true);
        assert_eq!(at(&v, p.addr)["self"], false);
        assert_eq!(at(&v, p.addr)["ready"], true);
        // The process' file names other listeners: another hash.
        assert_eq!(
            (v["config_hashes"].clone(), v["consistent"].clone()),
            (json!(2), json!(false))
        );
        // Every heartbeat key shares one slot: all on one node.
        let per_node: Vec<usize> = cluster
            .nodes
            .iter()
            .map(|n| n.cmd::<Vec<String>>(&["KEYS", "sluice:{fleet}:*"]).len())
            .collect();
        let mut sorted = per_node.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 0, 3], "{per_node:?}");

        // `sluice fleet`: both instances, the sums, and the line that flags the hashes.
        let text = cli_fleet(a.admin_addr, &[]).await;
        for id in ids(&v) {
            let line = text.lines().find(|l| l.starts_with(&id));
            let addr = if at(&v, a.addr)["id"] == id.as_str() {
                a.addr
            } else {
                p.addr
            };
            assert!(
                line.is_some_and(|l| l.contains(&addr.to_string())),
                "{id}: {text}"
            );
        }
        assert!(text.lines().any(|l| l.starts_with("INSTANCE ")), "{text}");
        let route = "api    5        0        1        0       0       0                    0                   0            0";
        assert!(text.lines().any(|l| l == route), "{text}");
        assert!(
            text.contains("\nconfig hashes differ: 2 hashes across 2 instances (a reload not applied everywhere?)\n"),
            "{text}"
        );
        let json: Value =
            serde_json::from_str(&cli_fleet(a.admin_addr, &["--json"]).await).expect("JSON");
        assert_eq!(ids(&json), ids(&v));
        assert_eq!(json["routes"], v["routes"]);

        p.child.signal(libc::SIGTERM);
        let mut exited = None;
        for _ in 0..200 {
            exited = p.child.try_wait().expect("wait");
            if exited.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(exited.is_some_and(|s| s.success()), "{exited:?}");
        let v = fleet(a.admin_addr).await;
        assert_eq!(ids(&v).len(), 1, "{v:#}");
        assert_eq!(at(&v, a.addr)["self"], true);
        assert_eq!(v["routes"], json!({"api": counts(2, 0)}));
    }
}

/// `n` requests of key `key` one after the other; their statuses.
async fn send_key(addr: SocketAddr, key: &str, n: usize) -> Vec<u16> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(get(addr, "/", &[("x-key", key)]).await.status);
    }
    out
}

/// `GET /admin/top` with `query`, which must answer 200 with JSON.
async fn top(admin: SocketAddr, query: &str) -> Value {
    let a = get(admin, &format!("/admin/top?{query}"), &[AUTH]).await;
    assert_eq!(a.status, 200, "GET /admin/top?{query}: {}", a.body);
    serde_json::from_str(&a.body).expect("top JSON")
}

/// The rows without their times: route, key, ip, refused, error, allowed, instances.
fn top_rows(v: &Value) -> Vec<Value> {
    v.as_array()
        .expect("rows")
        .iter()
        .map(|r| {
            json!([
                r["route"],
                r["key"],
                r["ip"],
                r["refused"],
                r["error"],
                r["allowed"],
                r["instances"]
            ])
        })
        .collect()
}

redis_and_valkey! {
    async fn a_client_refused_on_three_instances_is_one_row_of_the_fleet_top_with_its_counts_summed() {
        let redis = RedisServer::start();
        let yaml = gateway(&one_redis(&redis), 2);
        let (a, b, c) = (
            start_gateway(&yaml).await,
            start_gateway(&yaml).await,
            start_gateway(&yaml).await,
        );
        // One limit of 2 an hour shared through Redis: k's first two pass on A, then
        // every request of k is refused wherever it comes in; j is refused once, on B.
        assert_eq!(send_key(a.addr, "k", 5).await, [200, 200, 429, 429, 429]);
        assert_eq!(send_key(b.addr, "k", 4).await, [429; 4]);
        assert_eq!(send_key(c.addr, "k", 6).await, [429; 6]);
        assert_eq!(send_key(b.addr, "j", 3).await, [200, 200, 429]);

        // Each instance's own list: its refusals alone.
        assert_eq!(
            top_rows(&top(c.admin_addr, "").await),
            [json!(["api", "k", "127.0.0.1", 6, 0, 0, null])]
        );
        // The fleet's, from any instance once the others' heartbeats carry their lists
        // (one a second): k once, its 13 refusals summed over three lists; j from B's.
        let want = vec![
            json!(["api", "k", "127.0.0.1", 13, 0, 0, 3]),
            json!(["api", "j", "127.0.0.1", 1, 0, 0, 1]),
        ];
        for admin in [a.admin_addr, b.admin_addr, c.admin_addr] {
            let last = std::sync::Mutex::new(Value::Null);
            let took = eventually(WITHIN, || async {
                let v = top(admin, "scope=fleet").await;
                let done = top_rows(&v) == want;
                *last.lock().unwrap() = v;
                done
            })
            .await;
            let last = last.into_inner().unwrap();
            assert!(took.is_some(), "the fleet's top from {admin}: {last:#}");
            // The latest refusal's time.
            let k = &last[0];
            assert_eq!(
                k["last_seen"],
                sluice::deny::rfc3339(k["last_seen_ms"].as_u64().unwrap())
            );
        }
        // A route filter and `n` apply to the merged list.
        assert_eq!(
            top_rows(&top(a.admin_addr, "scope=fleet&route=api&n=1").await),
            want[..1]
        );
        assert_eq!(
            top_rows(&top(a.admin_addr, "scope=instance").await),
            [json!(["api", "k", "127.0.0.1", 3, 0, 0, null])]
        );
        let bad = get(a.admin_addr, "/admin/top?scope=world", &[AUTH]).await;
        assert_eq!(
            (bad.status, bad.body.as_str()),
            (400, "scope \"world\" is neither instance nor fleet\n")
        );

        // `sluice top --fleet`: the same rows, and over how many instances.
        let text = cli(c.admin_addr, "top", &["--fleet"]).await;
        let lines: Vec<Vec<&str>> = text
            .lines()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(
            lines[0],
            [
                "ROUTE",
                "KEY",
                "IP",
                "REFUSED",
                "ALLOWED",
                "LAST",
                "SEEN",
                "(UTC)",
                "INSTANCES"
            ]
        );
        assert_eq!(lines.len(), 3, "{text}");
        assert_eq!(
            [&lines[1][..5], &lines[1][6..]].concat(),
            ["api", "k", "127.0.0.1", "13", "0", "3"]
        );
        assert_eq!(
            [&lines[2][..5], &lines[2][6..]].concat(),
            ["api", "j", "127.0.0.1", "1", "0", "1"]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_top_of_a_memory_store_gateway_is_its_own() {
    let gw = start_gateway(&gateway("", 1)).await;
    assert_eq!(send_key(gw.addr, "k", 3).await, [200, 429, 429]);
    assert_eq!(
        top_rows(&top(gw.admin_addr, "scope=fleet").await),
        [json!(["api", "k", "127.0.0.1", 2, 0, 0, 1])]
    );
}
