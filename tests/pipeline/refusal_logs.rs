//! The refusal log of the `sluice` binary: one line per refused or denied request at
//! info level, in text and with `--log-format json`, with the route, a hash of the
//! key (never the key), the limit and the answer's `Retry-After`; and under a flood,
//! at most a second's budget of lines, every line not written counted. No line of
//! the process names a client key, the lines of a ban and its end included.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::redis::RedisServer;
use crate::common::*;
use http::Method;
use serde_json::Value;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// The first 16 hex digits of SHA-1, as the log writes a key.
fn key_hash(key: &str) -> String {
    sha1_smol::Sha1::from(key.as_bytes()).digest().to_string()[..16].to_string()
}

fn config(port: u16, admin: u16, store: &str) -> String {
    format!(
        r#"
{store}
server: {{listen: "127.0.0.1:{port}"}}
admin: {{listen: "127.0.0.1:{admin}"}}
client_ip: {{trusted_proxies: [127.0.0.1]}}
deny:
  keys: [leaked-key-123]
  ips: [203.0.113.0/24]
routes:
  - name: api
    match: {{path_prefix: /api/}}
    key: header:x-api-key
    limits:
      - {{name: per_key, algorithm: fixed_window, limit: 2, window: 1h}}
    ban: {{after: 2, within: 1m, for: 1s}}
    respond: {{body: "ok\n"}}
  - name: flood
    match: {{path: /flood}}
    key: global
    limits:
      - {{name: none_left, algorithm: token_bucket, rate: 1/h, burst: 1}}
    respond: {{body: "ok\n"}}
"#
    )
}

/// A running `sluice run`, its stderr read line by line as it comes.
pub(crate) struct Sluice {
    process: Spawned,
    pub lines: Lines,
    reader: Option<std::thread::JoinHandle<()>>,
    pub port: u16,
    pub admin: u16,
    pub file: tempfile::NamedTempFile,
}

impl Sluice {
    async fn start(json: bool) -> Sluice {
        Sluice::start_with(json, "").await
    }

    /// With `store` (a `store:` section) at the head of the configuration.
    async fn start_with(json: bool, store: &str) -> Sluice {
        Sluice::start_yaml(json, |port, admin| config(port, admin, store)).await
    }

    /// With the configuration `yaml(port, admin port)`.
    pub async fn start_yaml(json: bool, yaml: impl FnOnce(u16, u16) -> String) -> Sluice {
        let (port, admin) = (free_port(), free_port());
        let file = config_file(&yaml(port, admin));
        let path = file.path().display().to_string();
        let mut args = vec!["run", "-c", &path];
        if json {
            args.extend(["--log-format", "json"]);
        }
        let (process, lines, reader) = spawn_logged(
            Command::new(SLUICE)
                .args(&args)
                .env_remove("SLUICE_CONFIG")
                .env("SLUICE_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        let s = Sluice {
            process,
            lines,
            reader: Some(reader),
            port,
            admin,
            file,
        };
        let health = format!("http://127.0.0.1:{admin}/healthz");
        let c = http1();
        let up = eventually(BOUND, || async {
            c.try_send(Method::GET, &health, &[], Default::default())
                .await
                .is_ok()
        })
        .await;
        assert!(up.is_some(), "sluice not up: {:?}", s.lines.lock().unwrap());
        s
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub async fn metrics(&self) -> String {
        metrics(format!("127.0.0.1:{}", self.admin).parse().unwrap()).await
    }

    /// The refusal lines so far, as JSON objects.
    fn refusals(&self) -> Vec<Value> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "sluice::refusal")
            .collect()
    }

    /// The refusal lines and the count of lines dropped, once they account for
    /// `refused` refusals (each is written or dropped before its answer is sent;
    /// the lines take a moment through the pipe).
    async fn accounted(&self, refused: u64) -> (Vec<Value>, u64) {
        for _ in 0..(BOUND.as_millis() / 20) {
            let m = self.metrics().await;
            let dropped = metric(&m, "sluice_refusal_logs_dropped_total").unwrap() as u64;
            let lines = self.refusals();
            if lines.len() as u64 + dropped == refused {
                return (lines, dropped);
            }
            assert!(
                (lines.len() as u64 + dropped) < refused,
                "{lines:?} and {dropped} dropped for {refused}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("{refused} refusals never accounted for");
    }

    /// Sends `signal` (e.g. `libc::SIGUSR1`) to the process.
    pub fn signal(&self, signal: libc::c_int) {
        self.process.signal(signal);
    }

    /// Stop it (SIGTERM, exit 0) and return everything it wrote.
    pub async fn stop(mut self) -> String {
        self.process.signal(libc::SIGTERM);
        let mut status = None;
        for _ in 0..(BOUND.as_millis() / 20) {
            status = self.process.try_wait().unwrap();
            if status.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(status.and_then(|s| s.code()), Some(0));
        self.reader.take().unwrap().join().unwrap();
        let text = self.lines.lock().unwrap().join("\n");
        text
    }
}

/// Limited, denied by key, denied by address: 4 refusals after 2 admissions.
async fn refuse_four(s: &Sluice) -> Vec<(u16, Option<String>)> {
    let c = http1();
    let mut got = Vec::new();
    for headers in [
        vec![("x-api-key", "secret-A")],
        vec![("x-api-key", "secret-A")],
        vec![("x-api-key", "secret-A")],
        vec![("x-api-key", "secret-A")],
        vec![("x-api-key", "leaked-key-123")],
        vec![
            ("x-api-key", "secret-B"),
            ("x-forwarded-for", "203.0.113.9"),
        ],
    ] {
        // The query is not logged: it may carry a key.
        let r = c.get(&s.url("/api/x?token=in-the-query"), &headers).await;
        got.push((r.status, r.header("retry-after").map(str::to_string)));
    }
    got
}

#[tokio::test]
async fn json_lines_name_route_key_hash_limit_and_retry_after_never_the_key() {
    let s = Sluice::start(true).await;
    let answers = refuse_four(&s).await;
    let statuses: Vec<u16> = answers.iter().map(|a| a.0).collect();
    assert_eq!(statuses, [200, 200, 429, 429, 403, 403]);
    let retry_after: u64 = answers[2].1.as_deref().unwrap().parse().unwrap();
    assert_eq!(answers[3].1, answers[2].1);

    let got = eventually(BOUND, || async { s.refusals().len() >= 4 }).await;
    assert!(got.is_some(), "{:?}", s.refusals());
    let lines = s.refusals();
    let fields: Vec<&Value> = lines.iter().map(|l| &l["fields"]).collect();
    let limited = serde_json::json!({
        "message": "request refused",
        "decision": "limited",
        "status": 429,
        "route": "api",
        "method": "GET",
        "path": "/api/x",
        "key_hash": key_hash("secret-A"),
        "ip": "127.0.0.1",
        "limit": "per_key",
        "retry_after": retry_after,
        "dropped": 0,
    });
    assert_eq!(*fields[0], limited);
    assert_eq!(*fields[1], limited);
    assert_eq!(
        *fields[2],
        serde_json::json!({
            "message": "request refused",
            "decision": "denied",
            "status": 403,
            "route": "api",
            "method": "GET",
            "path": "/api/x",
            "key_hash": key_hash("leaked-key-123"),
        "ip": "127.0.0.1",
            "deny": "key",
            "dropped": 0,
        })
    );
    assert_eq!(
        *fields[3],
        serde_json::json!({
            "message": "request refused",
            "decision": "denied",
            "status": 403,
            "route": "api",
            "method": "GET",
            "path": "/api/x",
            "key_hash": key_hash("203.0.113.9"),
            "ip": "203.0.113.9",
            "deny": "ip",
            "dropped": 0,
        })
    );
    for l in &lines {
        assert_eq!(
            (&l["level"], &l["target"]),
            (&Value::from("INFO"), &Value::from("sluice::refusal"))
        );
    }
    assert_eq!(lines.len(), 4, "{lines:?}");
    // The second refusal banned the key for 1 s: the ban and its end are logged
    // with the key's hash, as every other line that names an entry.
    let entry = format!("key #{}", key_hash("secret-A"));
    let logged = |message: &str| {
        s.lines.lock().unwrap().iter().any(|l| {
            serde_json::from_str::<Value>(l).is_ok_and(|v| {
                v["fields"]["message"] == message && v["fields"]["entry"] == entry.as_str()
            })
        })
    };
    let ended = eventually(BOUND, || async {
        logged("banned") && logged("deny entry expired")
    })
    .await;
    assert!(ended.is_some(), "{:?}", s.lines.lock().unwrap());
    let all = s.stop().await;
    for secret in ["secret-A", "secret-B", "leaked-key-123", "in-the-query"] {
        assert!(!all.contains(secret), "{secret} is in the log:\n{all}");
    }
}

#[tokio::test]
async fn text_lines_carry_the_same_fields() {
    let s = Sluice::start(false).await;
    let answers = refuse_four(&s).await;
    let retry_after = answers[2].1.clone().unwrap();
    let all = s.stop().await;
    let refusals: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("sluice::refusal"))
        .map(|l| l.split_once("sluice::refusal: ").unwrap().1)
        .collect();
    let limited = format!(
        "request refused decision=\"limited\" status=429 route=\"api\" method=\"GET\" path=\"/api/x\" key_hash={} ip=127.0.0.1 limit=\"per_key\" retry_after={retry_after} dropped=0",
        key_hash("secret-A")
    );
    assert_eq!(
        refusals,
        [
            limited.as_str(),
            limited.as_str(),
            &format!(
                "request refused decision=\"denied\" status=403 route=\"api\" method=\"GET\" path=\"/api/x\" key_hash={} ip=127.0.0.1 deny=\"key\" dropped=0",
                key_hash("leaked-key-123")
            ),
            &format!(
                "request refused decision=\"denied\" status=403 route=\"api\" method=\"GET\" path=\"/api/x\" key_hash={} ip=203.0.113.9 deny=\"ip\" dropped=0",
                key_hash("203.0.113.9")
            ),
        ]
    );
    for secret in ["secret-A", "secret-B", "leaked-key-123", "in-the-query"] {
        assert!(!all.contains(secret), "{secret} is in the log:\n{all}");
    }
}

#[tokio::test]
async fn a_flood_writes_a_seconds_budget_and_counts_every_line_it_drops() {
    const FLOOD: usize = 60;
    let s = Sluice::start(true).await;
    let c = http1();
    let flood = s.url("/flood");
    let mut statuses = Vec::new();
    for _ in 0..=FLOOD {
        statuses.push(c.get(&flood, &[]).await.status);
    }
    assert_eq!(statuses, ok_then_limited(1, FLOOD));
    // Refused requests, one at a time, until the lines have reported every line
    // dropped (a later second's first line reports the drops before it).
    let mut refused = FLOOD as u64;
    let mut reported_all = false;
    for _ in 0..50 {
        let (lines, dropped) = s.accounted(refused).await;
        let reported: u64 = lines
            .iter()
            .map(|l| l["fields"]["dropped"].as_u64().unwrap())
            .sum();
        if dropped > 0 && reported == dropped {
            // Every refusal is a line or a drop; a second's budget was spent.
            assert!(
                lines.len() >= 10,
                "{} lines, {dropped} dropped",
                lines.len()
            );
            reported_all = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(c.get(&flood, &[]).await.status, 429);
        refused += 1;
    }
    assert!(reported_all, "the lines never reported what was dropped");
    let m = s.metrics().await;
    assert_eq!(requests(&m, "flood", "limited") as u64, refused);
    s.stop().await;
}

#[tokio::test]
async fn a_store_down_under_on_error_deny_is_a_line_too() {
    let mut redis = RedisServer::start();
    let store = format!(
        "store:\n  backend: redis\n  redis: {{url: \"{}\", timeout: 200ms}}\n  on_error: deny\n",
        redis.url()
    );
    let s = Sluice::start_with(true, &store).await;
    let c = http1();
    let key = [("x-api-key", "secret-A")];
    assert_eq!(c.get(&s.url("/api/x"), &key).await.status, 200);
    redis.kill();
    assert_eq!(c.get(&s.url("/api/x"), &key).await.status, 503);
    let (lines, dropped) = s.accounted(1).await;
    assert_eq!(dropped, 0);
    assert_eq!(
        lines[0]["fields"],
        serde_json::json!({
            "message": "request refused",
            "decision": "store_error_denied",
            "status": 503,
            "route": "api",
            "method": "GET",
            "path": "/api/x",
            "key_hash": key_hash("secret-A"),
        "ip": "127.0.0.1",
            "dropped": 0,
        })
    );
    let all = s.stop().await;
    assert!(!all.contains("secret-A"), "{all}");
}
