//! The walk-through of docs/finding-abusers.md, as an operator runs it: two `sluice
//! run` processes with `docs/examples/abusers.yaml` on one real Redis, a scraper
//! flooding the API through both, a password guesser drawing 401s from the
//! upstream; then the access log, `sluice_upstream_responses_total`, `sluice top`
//! (key and address first), a deny through the admin API's command (the
//! dashboard's), refused by the other instance too, and the fleet view with both
//! instances, one configuration hash and the summed counts; then a third instance
//! from an edited copy, which the fleet view shows with a second hash.

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::redis::RedisServer;
use crate::common::*;
use http::Method;
use serde_json::Value;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// One `sluice run` of the example, its stderr collected line by line.
struct Instance {
    process: Spawned,
    lines: Lines,
    port: u16,
    admin: u16,
}

impl Instance {
    async fn start(config: &std::path::Path, redis: &RedisServer) -> Instance {
        let (port, admin) = (free_port(), free_port());
        let (process, lines, _reader) = spawn_logged(
            Command::new(SLUICE)
                .args(["run", "-c"])
                .arg(config)
                .env_remove("SLUICE_CONFIG")
                .env("SLUICE_LOG", "info")
                .env("SLUICE_LISTEN", format!("127.0.0.1:{port}"))
                .env("SLUICE_ADMIN_LISTEN", format!("127.0.0.1:{admin}"))
                .env("REDIS_URL", redis.url())
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        let i = Instance {
            process,
            lines,
            port,
            admin,
        };
        let ready = format!("http://127.0.0.1:{admin}/readyz");
        assert!(
            answers_200(&ready).await,
            "not ready: {:?}",
            i.lines.lock().unwrap()
        );
        i
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn admin(&self) -> SocketAddr {
        format!("127.0.0.1:{}", self.admin).parse().unwrap()
    }

    /// The access log's lines (the JSON objects with a `route`).
    fn access(&self) -> Vec<Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.starts_with('{'))
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v.get("route").is_some() && v.get("decision").is_some())
            .collect()
    }

    async fn admin_json(&self, path: &str) -> Value {
        let r = get(&format!("http://127.0.0.1:{}{path}", self.admin), &[]).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text());
        serde_json::from_slice(&r.body).unwrap()
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.process.kill();
    }
}

/// Away from the end of a wall-clock minute, so every request of the flood falls in
/// one minute of the example's per-minute limits: waits at most 15 s.
async fn early_in_a_minute() {
    let s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
        % 60;
    if s >= 45 {
        at_window_start(Duration::from_secs(60)).await;
    }
}

#[tokio::test]
async fn the_walkthrough_finds_the_scraper_denies_it_and_sums_the_fleet() {
    let redis = RedisServer::start();
    let up = upstream().await;
    let example = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/examples/abusers.yaml"),
    )
    .unwrap();
    assert!(example.contains("http://127.0.0.1:3000"));
    let file = config_file(&example.replace("http://127.0.0.1:3000", &up.url()));
    let a = Instance::start(file.path(), &redis).await;
    let b = Instance::start(file.path(), &redis).await;
    let c = http1();

    // Wrong passwords through a: the upstream's 401s count; the sixth is refused.
    // (First: the access log writes 10 refusals a second, and these are the first.)
    let mut logins = Vec::new();
    for _ in 0..8 {
        let r = c
            .send(
                Method::POST,
                &a.url("/login"),
                &[
                    ("content-type", "application/x-www-form-urlencoded"),
                    ("x-reply-status", "401"),
                ],
                "user=alice&password=guess",
            )
            .await;
        logins.push(r.status);
    }
    assert_eq!(logins, [401, 401, 401, 401, 401, 429, 429, 429]);

    // The scraper, through both instances in turn: 20 a minute between them.
    early_in_a_minute().await;
    let scraper = [("x-api-key", "scraper-7")];
    let mut admitted = [0, 0];
    for _ in 0..100 {
        for (n, i) in [&a, &b].into_iter().enumerate() {
            let status = c.get(&i.url("/api/items"), &scraper).await.status;
            assert!(status == 200 || status == 429, "{status}");
            admitted[n] += usize::from(status == 200);
        }
    }
    assert_eq!(admitted, [10, 10]);
    // Ordinary users through b.
    for i in 0..10 {
        let key = format!("user-{i}");
        let r = c.get(&b.url("/api/items"), &[("x-api-key", &key)]).await;
        assert_eq!(r.status, 200);
    }

    // The access log: every request of a is a line, or a refusal counted as dropped
    // over the budget of 10 a second; the login ones as the walk-through shows.
    let lines = {
        let mut lines = Vec::new();
        for _ in 0..(BOUND.as_millis() / 20) {
            lines = a.access();
            let m = metrics(a.admin()).await;
            let dropped = metric(&m, "sluice_access_logs_dropped_total").unwrap() as usize;
            if lines.len() + dropped == 108 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        lines
    };
    // The 10 admitted scraper requests and the 5 failed logins are always written.
    let forwarded = lines.iter().filter(|l| l["decision"] == "allowed").count();
    assert_eq!(forwarded, 15, "{lines:#?}");
    let login: Vec<(u64, &str, Value, Value)> = lines
        .iter()
        .filter(|l| l["route"] == "login")
        .map(|l| {
            (
                l["status"].as_u64().unwrap(),
                l["decision"].as_str().unwrap(),
                l["limit"].clone(),
                l["upstream_status"].clone(),
            )
        })
        .collect();
    let failed = (401, "allowed", Value::Null, Value::from(401));
    let refused = (429, "limited", Value::from("failures"), Value::Null);
    assert_eq!(
        login,
        [
            failed.clone(),
            failed.clone(),
            failed.clone(),
            failed.clone(),
            failed,
            refused.clone(),
            refused.clone(),
            refused
        ]
    );
    assert!(lines.iter().all(|l| l["ip"] == "127.0.0.1"));

    // The upstream's statuses on /metrics.
    let m = metrics(a.admin()).await;
    let upstream = |route: &str, code: &str| {
        metric(
            &m,
            &format!(r#"sluice_upstream_responses_total{{code="{code}",route="{route}"}}"#),
        )
    };
    assert_eq!(upstream("login", "4xx"), Some(5.0));
    assert_eq!(upstream("login", "2xx"), Some(0.0));
    assert_eq!(upstream("api", "2xx"), Some(10.0));
    assert_eq!(upstream("api", "5xx"), Some(0.0));

    // `sluice top`: the scraper and its address first.
    let out = run_grouped(
        Command::new(SLUICE)
            .args(["top", "--json", "-c"])
            .arg(file.path())
            .env_remove("SLUICE_CONFIG")
            .env("SLUICE_ADMIN_LISTEN", format!("127.0.0.1:{}", a.admin))
            .env("SLUICE_LOG", "warn"),
    )
    .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let top: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    let rows: Vec<(&str, &str, &str, u64, u64)> = top
        .iter()
        .map(|r| {
            (
                r["route"].as_str().unwrap(),
                r["key"].as_str().unwrap(),
                r["ip"].as_str().unwrap(),
                r["refused"].as_u64().unwrap(),
                r["allowed"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("api", "scraper-7", "127.0.0.1", 90, 0),
            ("login", "127.0.0.1", "127.0.0.1", 3, 0)
        ]
    );
    let table = run_grouped(
        Command::new(SLUICE)
            .args(["top", "-c"])
            .arg(file.path())
            .env_remove("SLUICE_CONFIG")
            .env("SLUICE_ADMIN_LISTEN", format!("127.0.0.1:{}", a.admin))
            .env("SLUICE_LOG", "warn"),
    )
    .unwrap();
    let table = String::from_utf8_lossy(&table.stdout).into_owned();
    let first = table.lines().nth(1).unwrap_or_default();
    assert!(
        first.contains("scraper-7") && first.contains("127.0.0.1"),
        "{table}"
    );

    // Denied as the dashboard's button does it: POST /admin/deny on a; b refuses too.
    let r = c
        .send(
            Method::POST,
            &format!("http://127.0.0.1:{}/admin/deny", a.admin),
            &[("content-type", "application/json")],
            r#"{"key":"scraper-7","ttl":"1h","reason":"flooding api"}"#,
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    // (Watched on b's list, not by requests, which would add to its counts.)
    let listed = eventually(BOUND, || async {
        b.admin_json("/admin/deny")
            .await
            .to_string()
            .contains("scraper-7")
    })
    .await;
    assert!(listed.is_some(), "b never learned of the entry");
    assert_eq!(c.get(&b.url("/api/items"), &scraper).await.status, 403);

    // The fleet view: both instances, one hash, the routes' counts summed.
    let fleet = {
        let mut fleet = Value::Null;
        for _ in 0..(BOUND.as_millis() / 50) {
            fleet = a.admin_json("/admin/fleet").await;
            let n = fleet["instances"].as_array().map_or(0, Vec::len);
            // b's heartbeat carries its denied requests once it has published since.
            if n == 2 && fleet["routes"]["api"]["denied"] == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        fleet
    };
    let instances = fleet["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 2, "{fleet:#}");
    assert_eq!(fleet["consistent"], true, "{fleet:#}");
    assert_eq!(instances[0]["config_hash"], instances[1]["config_hash"]);
    let api = &fleet["routes"]["api"];
    assert_eq!(api["allowed"], 30, "{fleet:#}");
    assert_eq!(api["limited"], 180, "{fleet:#}");
    assert_eq!(api["denied"], 1, "{fleet:#}");
    let login = &fleet["routes"]["login"];
    assert_eq!(
        (login["allowed"].as_u64(), login["limited"].as_u64()),
        (Some(5), Some(3))
    );

    // The page's way to see a fleet that disagrees: a third instance from an
    // edited copy (the page's `sed`), listed with a hash of its own.
    assert!(example.contains("limit: 20, window: 1m"));
    let edited = config_file(
        &example
            .replace("limit: 20, window: 1m", "limit: 30, window: 1m")
            .replace("http://127.0.0.1:3000", &up.url()),
    );
    let third = Instance::start(edited.path(), &redis).await;
    let mut fleet = Value::Null;
    for _ in 0..(BOUND.as_millis() / 50) {
        fleet = a.admin_json("/admin/fleet").await;
        if fleet["instances"].as_array().map_or(0, Vec::len) == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let instances = fleet["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 3, "{fleet:#}");
    assert_eq!(fleet["consistent"], false, "{fleet:#}");
    let hashes: std::collections::BTreeSet<&str> = instances
        .iter()
        .map(|i| i["config_hash"].as_str().unwrap())
        .collect();
    assert_eq!(hashes.len(), 2, "{fleet:#}");
    drop(third);
}
