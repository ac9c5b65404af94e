//! Live operations end to end, memory store: the watched configuration file (atomic
//! saves, Kubernetes symlink swaps, in-place writes, broken files under traffic),
//! `POST /admin/reload`, the admin deny API, denied keys however they are sent,
//! automatic bans, `deny.state_file` across a restart, and the metrics and
//! `/admin/config` that show all of it. Real listeners, clients and upstreams; waits
//! are bounded polls, never sleeps that hope to be long enough.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::*;
use http::Method;
use serde_json::{json, Value};

const TOKEN: &str = "s3cret-admin-token";

// === helpers ===

/// How often a bounded poll looks again.
const POLL: Duration = Duration::from_millis(20);

/// Calls `f` every `POLL` until it gives a value; fails the test after `limit`.
async fn eventually<T, F, Fut>(what: &str, limit: Duration, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {limit:?}");
        tokio::time::sleep(POLL).await;
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis() as u64
}

fn sha1(bytes: &[u8]) -> String {
    sha1_smol::Sha1::from(bytes).digest().to_string()
}

/// `YYYY-MM-DDTHH:MM:SS[.mmm]Z` as milliseconds since the epoch (days from the civil
/// date by the proleptic Gregorian rule), or None if it is not in that form.
fn parse_rfc3339(s: &str) -> Option<u64> {
    let re = regex::Regex::new(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})(?:\.(\d{3}))?Z$")
        .expect("regex");
    let c = re.captures(s)?;
    let n = |i: usize| c.get(i).map_or(0, |m| m.as_str().parse::<i64>().unwrap());
    let (y, m, d) = (n(1), n(2), n(3));
    if !(1..=12).contains(&m) {
        return None;
    }
    let days_before_year =
        |y: i64| 365 * (y - 1970) + (y - 1969) / 4 - (y - 1901) / 100 + (y - 1601) / 400;
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const BEFORE_MONTH: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let days =
        days_before_year(y) + BEFORE_MONTH[(m - 1) as usize] + i64::from(leap && m > 2) + d - 1;
    let secs = days * 86_400 + n(4) * 3600 + n(5) * 60 + n(6);
    Some(secs as u64 * 1000 + n(7) as u64)
}

#[test]
fn parse_rfc3339_knows_the_calendar() {
    for (text, ms) in [
        ("1970-01-01T00:00:00Z", 0),
        ("2000-02-29T00:00:00Z", 951_782_400_000),
        ("2000-03-01T00:00:01.500Z", 951_868_801_500),
        ("2027-01-16T00:00:00.123Z", 1_800_057_600_123),
    ] {
        assert_eq!(parse_rfc3339(text), Some(ms), "{text}");
    }
    assert_eq!(parse_rfc3339("2027-13-01T00:00:00Z"), None);
    assert_eq!(parse_rfc3339("2027-01-16 00:00:00Z"), None);
}

/// Writes `yaml` (with listeners added) to `dir/rules.yaml`.
fn write_config(dir: &Path, yaml: &str) -> PathBuf {
    let path = dir.join("rules.yaml");
    std::fs::write(&path, with_listeners(yaml)).expect("write config");
    path
}

/// Starts a gateway from the file at `path`, which it then watches.
async fn start_at(path: &Path) -> Running {
    let loaded = sluice::config::load(path).unwrap_or_else(|e| panic!("config does not load: {e}"));
    sluice::server::start(loaded)
        .await
        .unwrap_or_else(|e| panic!("gateway does not start: {e}"))
}

/// A gateway from `dir/rules.yaml` in a directory of its own, watched: no other
/// test's files wake its watcher.
async fn start_in_dir(yaml: &str) -> (Running, tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = write_config(dir.path(), yaml);
    (start_at(&path).await, dir, path)
}

/// The value of a series that must be exported.
fn value(text: &str, series: &str) -> f64 {
    metric(text, series).unwrap_or_else(|| panic!("no series {series} in\n{text}"))
}

fn reloads(m: &str, result: &str) -> f64 {
    value(
        m,
        &format!("sluice_config_reloads_total{{result=\"{result}\"}}"),
    )
}

fn deny_entries(m: &str, source: &str) -> f64 {
    value(m, &format!("sluice_deny_entries{{source=\"{source}\"}}"))
}

fn bans(m: &str, route: &str) -> f64 {
    value(m, &format!("sluice_bans_total{{route=\"{route}\"}}"))
}

/// The body of `GET path` on the gateway port, which must answer 200.
async fn body_of(c: &HttpClient, addr: SocketAddr, path: &str) -> String {
    let r = c.get(&url(addr, path), &[]).await;
    assert_eq!(r.status, 200, "GET {path}: {:?}", r.body);
    r.text().to_string()
}

/// A client of the admin API, with or without the token.
struct AdminApi {
    addr: SocketAddr,
    auth: Option<String>,
    c: HttpClient,
}

impl AdminApi {
    fn new(gw: &Running, token: Option<&str>) -> AdminApi {
        AdminApi {
            addr: gw.admin_addr,
            auth: token.map(|t| format!("Bearer {t}")),
            c: http1(),
        }
    }

    async fn call(&self, method: Method, path: &str, body: &str) -> Resp {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(a) = &self.auth {
            headers.push(("authorization", a.as_str()));
        }
        self.c
            .send(method, &url(self.addr, path), &headers, body.to_string())
            .await
    }

    async fn add(&self, body: Value) -> Resp {
        self.call(Method::POST, "/admin/deny", &body.to_string())
            .await
    }

    /// Adds an entry that must be accepted; the entry as answered.
    async fn added(&self, body: Value) -> Value {
        let r = self.add(body.clone()).await;
        assert_eq!(r.status, 201, "POST {body}: {}", r.text());
        assert_eq!(r.header("content-type"), Some("application/json"));
        serde_json::from_slice(&r.body).expect("JSON entry")
    }

    async fn remove(&self, body: Value) -> Resp {
        self.call(Method::DELETE, "/admin/deny", &body.to_string())
            .await
    }

    async fn list(&self) -> Vec<Value> {
        let r = self.call(Method::GET, "/admin/deny", "").await;
        assert_eq!(r.status, 200, "GET /admin/deny: {}", r.text());
        serde_json::from_slice(&r.body).expect("JSON list")
    }

    async fn config(&self) -> Value {
        let r = self.call(Method::GET, "/admin/config", "").await;
        assert_eq!(r.status, 200, "GET /admin/config: {}", r.text());
        serde_json::from_slice(&r.body).expect("JSON config")
    }
}

/// The entry of `value` in `list`, if there is one.
fn find<'a>(list: &'a [Value], value: &str) -> Option<&'a Value> {
    list.iter().find(|e| e["value"] == value)
}

/// `expires_at` and `expires_at_ms` of an entry agree, and the expiry lies `ttl` after
/// a moment between `before` and `after`.
fn check_expiry(e: &Value, ttl_ms: u64, before: u64, after: u64) -> u64 {
    let at = e["expires_at_ms"].as_u64().unwrap_or_else(|| panic!("{e}"));
    let text = e["expires_at"].as_str().unwrap_or_else(|| panic!("{e}"));
    assert_eq!(parse_rfc3339(text), Some(at), "{e}");
    assert!(
        (before + ttl_ms..=after + ttl_ms).contains(&at),
        "{e}: expected between {} and {}",
        before + ttl_ms,
        after + ttl_ms
    );
    at
}

/// Polls `status` until the entry expiring at `expiry_ms` has expired: an answer
/// that came before the expiry must be `denied`, one to a request sent after it must
/// be 200 — expired entries stop counting at once, not at the next purge.
async fn denied_until<F, Fut>(expiry_ms: u64, denied: u16, mut status: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = u16>,
{
    assert!(
        expiry_ms < now_ms() + 3000,
        "the entry expires too late for a test"
    );
    loop {
        let sent = now_ms();
        let s = status().await;
        let answered = now_ms();
        if answered < expiry_ms {
            assert_eq!(s, denied, "{}ms before the expiry", expiry_ms - answered);
        }
        if sent > expiry_ms {
            assert_eq!(s, 200, "{}ms after the expiry", sent - expiry_ms);
            return;
        }
        tokio::time::sleep(POLL).await;
    }
}

// === watched reload ===

const VERSIONED: &str = r#"
routes:
  - {name: main, match: {path_prefix: /}, key: ip, respond: {body: BODY}}
"#;

fn versioned(body: &str) -> String {
    with_listeners(&VERSIONED.replace("BODY", body))
}

/// Waits until the gateway serves `body`, then checks that exactly one reload
/// succeeded, triggered by the file, to the hash of `text`.
async fn picked_up(gw: &Running, text: &str, body: &str) {
    let c = http1();
    let started = Instant::now();
    eventually(
        &format!("the gateway serves {body:?}"),
        // The watcher debounces for 200 ms; the promise is about a second.
        Duration::from_secs(2),
        || {
            let c = &c;
            async move { (body_of(c, gw.addr, "/").await == body).then_some(()) }
        },
    )
    .await;
    eprintln!("{body} picked up after {:?}", started.elapsed());
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (1.0, 0.0));
    assert_eq!(value(&m, "sluice_config_last_reload_success"), 1.0);
    let cfg = AdminApi::new(gw, None).config().await;
    assert_eq!(cfg["hash"], sha1(text.as_bytes()));
    let last = &cfg["last_reload"];
    assert_eq!(
        (
            &last["result"],
            &last["trigger"],
            &last["hash"],
            &last["error"]
        ),
        (
            &json!("success"),
            &json!("file"),
            &json!(sha1(text.as_bytes())),
            &Value::Null
        ),
        "{cfg}"
    );
}

#[tokio::test]
async fn an_atomic_save_is_picked_up() {
    let (gw, dir, path) = start_in_dir(&VERSIONED.replace("BODY", "v1")).await;
    assert_eq!(body_of(&http1(), gw.addr, "/").await, "v1");
    // How editors save: a temporary file beside the real one, renamed over it.
    let tmp = dir.path().join("rules.yaml.tmp");
    let text = versioned("v2");
    std::fs::write(&tmp, &text).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    picked_up(&gw, &text, "v2").await;
}

#[tokio::test]
async fn a_kubernetes_configmap_swap_is_picked_up() {
    // The layout kubelet makes: `..data` points at a versioned directory, and the
    // file the gateway reads is a symlink through `..data`.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let version = |name: &str, text: &str| {
        std::fs::create_dir(d.join(name)).unwrap();
        std::fs::write(d.join(name).join("rules.yaml"), text).unwrap();
    };
    let swap = |to: &str, old: &str| {
        std::os::unix::fs::symlink(to, d.join("..data_tmp")).unwrap();
        std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
        std::fs::remove_dir_all(d.join(old)).unwrap();
    };
    version("..v1", &versioned("v1"));
    std::os::unix::fs::symlink("..v1", d.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/rules.yaml", d.join("rules.yaml")).unwrap();
    let gw = start_at(&d.join("rules.yaml")).await;
    let c = http1();
    assert_eq!(body_of(&c, gw.addr, "/").await, "v1");

    let v2 = versioned("v2");
    version("..v2", &v2);
    swap("..v2", "..v1");
    picked_up(&gw, &v2, "v2").await;

    // And again, now that the directory first resolved to is gone.
    version("..v3", &versioned("v3"));
    swap("..v3", "..v2");
    eventually("v3 served", Duration::from_secs(3), || {
        let c = &c;
        async { (body_of(c, gw.addr, "/").await == "v3").then_some(()) }
    })
    .await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (2.0, 0.0));
}

#[tokio::test]
async fn an_in_place_write_is_picked_up() {
    let (gw, _dir, path) = start_in_dir(&VERSIONED.replace("BODY", "v1")).await;
    assert_eq!(body_of(&http1(), gw.addr, "/").await, "v1");
    let text = versioned("v2");
    std::fs::write(&path, &text).unwrap();
    picked_up(&gw, &text, "v2").await;

    // The same bytes again (a `touch`, a save without changes) are no reload. A
    // change after a pause, its own burst, shows that the first one was handled.
    std::fs::write(&path, &text).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    std::fs::write(&path, versioned("v3")).unwrap();
    let c = http1();
    eventually("v3 served", Duration::from_secs(3), || async {
        (body_of(&c, gw.addr, "/").await == "v3").then_some(())
    })
    .await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (2.0, 0.0));
}

#[tokio::test]
async fn a_broken_file_under_traffic_fails_no_request_and_is_reported() {
    let (gw, dir, path) = start_in_dir(&VERSIONED.replace("BODY", "v1")).await;
    let first_hash = sha1(&std::fs::read(&path).unwrap());
    // A typo on line 6, column 5: an unknown field.
    let broken = with_listeners(
        "routes:\n  - name: main\n    match: {path_prefix: /}\n    respnd: {body: v2}\n",
    );
    assert_eq!(broken.lines().nth(5), Some("    respnd: {body: v2}"));

    // Three clients, 100 requests each, about 15 ms apart: 300 over ~1.5 s.
    let clients: Vec<_> = (0..3)
        .map(|_| {
            let (c, u) = (http1(), url(gw.addr, "/"));
            tokio::spawn(async move {
                let mut wrong = Vec::new();
                for _ in 0..100 {
                    let r = c.get(&u, &[]).await;
                    if (r.status, r.text()) != (200, "v1") {
                        wrong.push((r.status, r.text().to_string()));
                    }
                    tokio::time::sleep(Duration::from_millis(15)).await;
                }
                wrong
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    std::fs::write(&path, &broken).unwrap();
    eventually(
        "the failed reload is counted",
        Duration::from_secs(3),
        || async {
            let m = metrics(gw.admin_addr).await;
            (reloads(&m, "failure") > 0.0).then_some(())
        },
    )
    .await;
    let mut failed = Vec::new();
    for t in clients {
        failed.extend(t.await.expect("client task"));
    }
    assert_eq!(failed, [], "requests that did not get the old config's 200");

    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (0.0, 1.0));
    assert_eq!(value(&m, "sluice_config_last_reload_success"), 0.0);
    let admin = AdminApi::new(&gw, None);
    let cfg = admin.config().await;
    assert_eq!(cfg["hash"], first_hash, "the old config still serves");
    let last = &cfg["last_reload"];
    assert_eq!(
        (&last["result"], &last["trigger"]),
        (&json!("failure"), &json!("file"))
    );
    assert_eq!(last["hash"], Value::Null);
    let error = last["error"].as_str().unwrap_or_else(|| panic!("{cfg}"));
    let at = format!("{}:6:5: ", path.display());
    assert!(error.starts_with(&at), "{error:?} should start with {at:?}");
    assert!(error.contains("respnd"), "{error}");

    // Fixed: back to success, and the new file serves.
    let fixed = versioned("v3");
    let tmp = dir.path().join("rules.yaml.tmp");
    std::fs::write(&tmp, &fixed).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    let c = http1();
    eventually("v3 served", Duration::from_secs(3), || {
        let c = &c;
        async { (body_of(c, gw.addr, "/").await == "v3").then_some(()) }
    })
    .await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (1.0, 1.0));
    assert_eq!(value(&m, "sluice_config_last_reload_success"), 1.0);
    let cfg = admin.config().await;
    assert_eq!(cfg["hash"], sha1(fixed.as_bytes()));
    assert_eq!(cfg["last_reload"]["result"], "success");
    assert_eq!(cfg["last_reload"]["error"], Value::Null);
}

#[tokio::test]
async fn post_admin_reload_answers_the_hash_or_the_error() {
    let config = r#"
admin: {listen: "127.0.0.1:0", token: TOKEN}
routes:
  - {name: main, match: {path_prefix: /}, respond: {body: BODY}}
"#
    .replace("TOKEN", TOKEN);
    let (gw, _dir, path) = start_in_dir(&config.replace("BODY", "v1")).await;
    let admin = AdminApi::new(&gw, Some(TOKEN));
    let c = http1();

    let text = with_listeners(&config.replace("BODY", "v2"));
    std::fs::write(&path, &text).unwrap();
    let r = admin.call(Method::POST, "/admin/reload", "").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/json"));
    let answer: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        answer,
        json!({"result": "success", "hash": sha1(text.as_bytes())})
    );
    // Served at once: the reload is done when the answer comes.
    assert_eq!(body_of(&c, gw.addr, "/").await, "v2");
    let cfg = admin.config().await;
    assert_eq!(cfg["hash"], sha1(text.as_bytes()));
    assert_eq!(cfg["last_reload"]["trigger"], "api");

    // Broken: 422 with the error, and the old config keeps serving.
    let broken = with_listeners(&config.replace("BODY", "v3")).replace("routes:", "routes: [");
    std::fs::write(&path, &broken).unwrap();
    let r = admin.call(Method::POST, "/admin/reload", "").await;
    assert_eq!(r.status, 422, "{}", r.text());
    let answer: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(answer["result"], "failure");
    let error = answer["error"]
        .as_str()
        .unwrap_or_else(|| panic!("{answer}"));
    let at = regex::Regex::new(&format!(
        r"^{}:\d+:\d+: ",
        regex::escape(&path.display().to_string())
    ))
    .unwrap();
    assert!(at.is_match(error), "{error}");
    assert_eq!(answer.as_object().unwrap().len(), 2, "{answer}");
    assert_eq!(body_of(&c, gw.addr, "/").await, "v2");
    let cfg = admin.config().await;
    assert_eq!(cfg["hash"], sha1(text.as_bytes()));
    assert_eq!(cfg["last_reload"]["result"], "failure");
    assert_eq!(cfg["last_reload"]["error"], error);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(value(&m, "sluice_config_last_reload_success"), 0.0);
}

// === the admin API ===

#[tokio::test]
async fn the_admin_api_needs_the_token_everywhere() {
    let (gw, _dir, _) = start_in_dir(&format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: {TOKEN}}}
routes:
  - {{name: main, match: {{path_prefix: /}}, respond: {{body: ok}}}}
"#
    ))
    .await;
    let calls = [
        (Method::GET, "/admin/deny", ""),
        (Method::POST, "/admin/deny", r#"{"ip":"127.0.0.1"}"#),
        (Method::DELETE, "/admin/deny", r#"{"ip":"127.0.0.1"}"#),
        (Method::PUT, "/admin/deny", r#"{"ip":"127.0.0.1"}"#),
        (Method::GET, "/admin/config", ""),
        (Method::POST, "/admin/reload", ""),
        (Method::GET, "/admin/nothing-here", ""),
    ];
    let c = http1();
    for token in [None, Some("wrong"), Some(&TOKEN[..TOKEN.len() - 1])] {
        let admin = AdminApi::new(&gw, token);
        for (method, path, body) in &calls {
            let r = admin.call(method.clone(), path, body).await;
            assert_eq!(r.status, 401, "{method} {path} with {token:?}");
            assert_eq!(
                r.header("www-authenticate"),
                Some("Bearer"),
                "{method} {path}"
            );
            assert_eq!(r.text(), "missing or wrong bearer token\n");
        }
        // Not a bearer token at all.
        let r = c
            .get(
                &url(gw.admin_addr, "/admin/deny"),
                &[("authorization", TOKEN)],
            )
            .await;
        assert_eq!(r.status, 401);
    }
    // Nothing of that took effect.
    let admin = AdminApi::new(&gw, Some(TOKEN));
    assert_eq!(admin.list().await, Vec::<Value>::new());
    assert_eq!(body_of(&c, gw.addr, "/").await, "ok");
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (0.0, 0.0));
    assert_eq!(deny_entries(&m, "api"), 0.0);
    // With the token: in.
    let r = admin.call(Method::GET, "/admin/nothing-here", "").await;
    assert_eq!(r.status, 404);
    // /metrics, /healthz and /readyz stay open.
    for path in ["/metrics", "/healthz", "/readyz"] {
        assert_eq!(
            c.get(&url(gw.admin_addr, path), &[]).await.status,
            200,
            "{path}"
        );
    }
}

#[tokio::test]
async fn wrong_methods_get_405_with_allow() {
    let (gw, _dir, _) = start_in_dir(&format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: {TOKEN}}}
routes:
  - {{name: main, match: {{path_prefix: /}}, respond: {{body: ok}}}}
"#
    ))
    .await;
    let admin = AdminApi::new(&gw, Some(TOKEN));
    for (method, path, allow) in [
        (Method::PUT, "/admin/deny", "GET, POST, DELETE"),
        (Method::PATCH, "/admin/deny", "GET, POST, DELETE"),
        (Method::GET, "/admin/reload", "POST"),
        (Method::DELETE, "/admin/reload", "POST"),
        (Method::POST, "/admin/config", "GET"),
        (Method::PUT, "/admin/config", "GET"),
    ] {
        let r = admin.call(method.clone(), path, "{}").await;
        assert_eq!(r.status, 405, "{method} {path}");
        assert_eq!(r.header("allow"), Some(allow), "{method} {path}");
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (0.0, 0.0));
}

#[tokio::test]
async fn malformed_deny_bodies_get_400_with_a_one_line_message() {
    let gw = start_gateway(&format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: {TOKEN}}}
routes:
  - {{name: main, match: {{path_prefix: /}}, respond: {{body: ok}}}}
"#
    ))
    .await;
    let admin = AdminApi::new(&gw, Some(TOKEN));
    let huge = format!(r#"{{"key":"k","reason":"{}"}}"#, "x".repeat(70 * 1024));
    let cases: Vec<(&str, String, &str)> = vec![
        ("not JSON", r#"{"ip": "#.into(), "malformed JSON body"),
        ("empty body", String::new(), "malformed JSON body"),
        ("an array", r#"["10.0.0.1"]"#.into(), "malformed JSON body"),
        ("an empty array", "[]".into(), "malformed JSON body"),
        (
            "ip and key",
            r#"{"ip":"10.0.0.1","key":"k"}"#.into(),
            "exactly one",
        ),
        ("neither", r#"{"reason":"why"}"#.into(), "exactly one"),
        (
            "an unknown field",
            r#"{"ip":"10.0.0.1","tll":"1m"}"#.into(),
            "unknown field",
        ),
        (
            "a bad address",
            r#"{"ip":"10.0.0.300"}"#.into(),
            "10.0.0.300",
        ),
        (
            "a bad prefix",
            r#"{"ip":"10.0.0.0/33"}"#.into(),
            "10.0.0.0/33",
        ),
        (
            "a bad ttl",
            r#"{"ip":"10.0.0.1","ttl":"ten minutes"}"#.into(),
            "ttl",
        ),
        (
            "a zero ttl",
            r#"{"ip":"10.0.0.1","ttl":"0s"}"#.into(),
            "ttl",
        ),
        (
            "a ttl under a millisecond",
            r#"{"ip":"10.0.0.1","ttl":"999us"}"#.into(),
            "at least 1ms",
        ),
        ("an empty key", r#"{"key":""}"#.into(), "key is empty"),
        ("70 KiB", huge, "body larger than 65536 bytes"),
    ];
    for (what, body, says) in &cases {
        let r = admin.call(Method::POST, "/admin/deny", body).await;
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let text = r.text();
        assert!(text.contains(says), "{what}: {text:?} should say {says:?}");
        assert!(
            text.ends_with('\n') && text.matches('\n').count() == 1,
            "{what}: not one line: {text:?}"
        );
    }
    // DELETE reads the same body, and takes no ttl or reason.
    for body in [
        r#"{"ip":"#,
        r#"{"ip":"10.0.0.1","key":"k"}"#,
        r#"{"ip":"10.0.0.1","ttl":"1m"}"#,
    ] {
        let r = admin.call(Method::DELETE, "/admin/deny", body).await;
        assert_eq!(r.status, 400, "DELETE {body}: {}", r.text());
    }
    assert_eq!(admin.list().await, Vec::<Value>::new());
    let m = metrics(gw.admin_addr).await;
    assert_eq!(deny_entries(&m, "api"), 0.0);
}

#[tokio::test]
async fn admin_paths_on_the_proxy_port_go_to_the_upstream() {
    let up = upstream().await;
    let (gw, _dir, _) = start_in_dir(&format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: {TOKEN}}}
upstreams:
  api: {{targets: ["{}"]}}
routes:
  - {{name: all, match: {{path_prefix: /}}, upstream: api}}
"#,
        up.url()
    ))
    .await;
    let c = http1();
    let bearer = format!("Bearer {TOKEN}");
    let calls = [
        (Method::GET, "/admin/deny", ""),
        (Method::POST, "/admin/deny", r#"{"ip":"127.0.0.1"}"#),
        (Method::DELETE, "/admin/deny", r#"{"ip":"127.0.0.1"}"#),
        (Method::GET, "/admin/config", ""),
        (Method::POST, "/admin/reload", ""),
        (Method::GET, "/metrics", ""),
    ];
    for (i, (method, path, body)) in calls.iter().enumerate() {
        for auth in [None, Some(bearer.as_str())] {
            let headers: Vec<(&str, &str)> =
                auth.map(|a| ("authorization", a)).into_iter().collect();
            let r = c
                .send(
                    method.clone(),
                    &url(gw.addr, path),
                    &headers,
                    body.to_string(),
                )
                .await;
            assert_eq!(r.status, 200, "{method} {path}");
            let echo = r.echo();
            assert_eq!(
                (echo.method.as_str(), echo.uri.as_str()),
                (method.as_str(), *path)
            );
            assert_eq!(echo.body, *body);
            assert_eq!(echo.header("authorization"), auth);
        }
        assert_eq!(up.hits(), 2 * (i + 1));
    }
    // None of it reached the admin handler.
    let admin = AdminApi::new(&gw, Some(TOKEN));
    assert_eq!(admin.list().await, Vec::<Value>::new());
    assert_eq!(admin.config().await["last_reload"], Value::Null);
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (0.0, 0.0));
    assert_eq!(deny_entries(&m, "api"), 0.0);
}

// === dynamic deny ===

const DYNAMIC: &str = r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
deny: {ips: [198.51.100.7], keys: [static-key], status: 451}
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: limited
    match: {path: /limited}
    key: ip
    limits: [{name: three, algorithm: sliding_log, limit: 3, window: 1m}]
    respond: {body: limited}
  - {name: keyed, match: {path: /keyed}, key: "header:x-api-key", respond: {body: keyed}}
  - {name: proxied, match: {path: /api}, upstream: api}
"#;

/// The status of `GET path` from client address `ip` (through the trusted proxy).
async fn from(c: &HttpClient, gw: &Running, path: &str, ip: &str) -> u16 {
    c.get(&url(gw.addr, path), &[("x-forwarded-for", ip)])
        .await
        .status
}

async fn entry_counts(gw: &Running) -> [f64; 3] {
    let m = metrics(gw.admin_addr).await;
    ["static", "api", "ban"].map(|s| deny_entries(&m, s))
}

#[tokio::test]
async fn dynamic_ip_entries_deny_everywhere_and_charge_nothing() {
    let up = upstream().await;
    let gw = start_gateway(&DYNAMIC.replace("UP", &up.url())).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    let limited = url(gw.addr, "/limited");
    let remaining = |ip: &'static str| {
        let (c, u) = (&c, &limited);
        async move {
            let r = c.get(u, &[("x-forwarded-for", ip)]).await;
            assert_eq!(r.status, 200, "{ip}");
            r.num("x-ratelimit-remaining")
        }
    };
    assert_eq!(entry_counts(&gw).await, [2.0, 0.0, 0.0]);
    assert_eq!(remaining("203.0.113.5").await, 2);

    let e = admin
        .added(json!({"ip": "203.0.113.5", "reason": "scraping"}))
        .await;
    assert_eq!(
        e,
        json!({"kind": "ip", "value": "203.0.113.5", "expires_at": null, "expires_at_ms": null,
               "reason": "scraping", "source": "api"})
    );
    assert_eq!(entry_counts(&gw).await, [2.0, 1.0, 0.0]);
    for path in ["/limited", "/api", "/keyed", "/nowhere"] {
        for _ in 0..2 {
            let r = c
                .get(&url(gw.addr, path), &[("x-forwarded-for", "203.0.113.5")])
                .await;
            assert_eq!((r.status, r.text()), (451, "access denied\n"), "{path}");
            assert!(r.rate_headers().is_empty(), "{path}");
        }
    }
    assert_eq!(up.hits(), 0);
    // Only that address.
    assert_eq!(remaining("203.0.113.6").await, 2);
    assert_eq!(from(&c, &gw, "/api", "203.0.113.6").await, 200);
    assert_eq!(up.hits(), 1);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(requests(&m, "limited", "denied"), 2.0);
    assert_eq!(requests(&m, "unmatched", "denied"), 2.0);

    // Removed: admitted again, with the budget it had before it was denied.
    let r = admin.remove(json!({"ip": "203.0.113.5"})).await;
    assert_eq!((r.status, r.text()), (204, ""));
    assert_eq!(entry_counts(&gw).await, [2.0, 0.0, 0.0]);
    assert_eq!(remaining("203.0.113.5").await, 1);
    assert_eq!(from(&c, &gw, "/api", "203.0.113.5").await, 200);

    // Absent, and static: 404 and 409, and the static entry still denies.
    let r = admin.remove(json!({"ip": "203.0.113.5"})).await;
    assert_eq!(r.status, 404, "{}", r.text());
    let r = admin.remove(json!({"ip": "198.51.100.7"})).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert!(r.text().contains("198.51.100.7"), "{}", r.text());
    let r = admin.remove(json!({"key": "static-key"})).await;
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(from(&c, &gw, "/limited", "198.51.100.7").await, 451);
    assert_eq!(entry_counts(&gw).await, [2.0, 0.0, 0.0]);
}

#[tokio::test]
async fn cidr_blocks_v4_and_v6_and_keys() {
    let up = upstream().await;
    let gw = start_gateway(&DYNAMIC.replace("UP", &up.url())).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();

    // Host bits are cleared: 10.1.2.3/16 is 10.1.0.0/16.
    let e = admin.added(json!({"ip": "10.1.2.3/16"})).await;
    assert_eq!(e["value"], "10.1.0.0/16");
    let e = admin.added(json!({"ip": "2001:db8::/32"})).await;
    assert_eq!(e["value"], "2001:db8::/32");
    let e = admin
        .added(json!({"key": "k-abuser", "reason": "abuse"}))
        .await;
    assert_eq!(
        e,
        json!({"kind": "key", "value": "k-abuser", "expires_at": null, "expires_at_ms": null,
               "reason": "abuse", "source": "api"})
    );
    assert_eq!(entry_counts(&gw).await, [2.0, 3.0, 0.0]);

    for (ip, status) in [
        ("10.1.0.1", 451),
        ("10.1.255.254", 451),
        ("10.2.0.1", 200),
        ("2001:db8::5", 451),
        ("2001:db8:ffff::1", 451),
        ("2001:db9::5", 200),
        ("198.51.100.7", 451),
    ] {
        assert_eq!(from(&c, &gw, "/api", ip).await, status, "{ip}");
    }
    assert_eq!(up.hits(), 2);
    let keyed = |key: &'static str| {
        let (c, u) = (&c, url(gw.addr, "/keyed"));
        async move { c.get(&u, &[("x-api-key", key)]).await.status }
    };
    assert_eq!(
        (
            keyed("k-abuser").await,
            keyed("static-key").await,
            keyed("k-fine").await
        ),
        (451, 451, 200)
    );

    // The whole list: static entries first, then addresses in order, then keys.
    let none = |kind: &str, value: &str, source: &str, reason: Value| {
        json!({"kind": kind, "value": value, "expires_at": null, "expires_at_ms": null,
               "reason": reason, "source": source})
    };
    assert_eq!(
        admin.list().await,
        [
            none("ip", "198.51.100.7", "static", Value::Null),
            none("key", "static-key", "static", Value::Null),
            none("ip", "10.1.0.0/16", "api", Value::Null),
            none("ip", "2001:db8::/32", "api", Value::Null),
            none("key", "k-abuser", "api", json!("abuse")),
        ]
    );

    // Removed as added or in canonical form alike.
    let r = admin.remove(json!({"ip": "10.1.0.0/16"})).await;
    assert_eq!(r.status, 204);
    let r = admin.remove(json!({"ip": "2001:db8:0:0::/32"})).await;
    assert_eq!(r.status, 204);
    let r = admin.remove(json!({"key": "k-abuser"})).await;
    assert_eq!(r.status, 204);
    assert_eq!(entry_counts(&gw).await, [2.0, 0.0, 0.0]);
    assert_eq!(from(&c, &gw, "/api", "10.1.0.1").await, 200);
    assert_eq!(from(&c, &gw, "/api", "2001:db8::5").await, 200);
    assert_eq!(keyed("k-abuser").await, 200);
    assert_eq!(admin.list().await.len(), 2);

    // An IPv4-mapped IPv6 address is the IPv4 address.
    let e = admin.added(json!({"ip": "::ffff:10.9.9.9"})).await;
    assert_eq!(e["value"], "10.9.9.9");
    assert_eq!(from(&c, &gw, "/api", "10.9.9.9").await, 451);
    // Adding a target again replaces its entry.
    let e = admin
        .added(json!({"ip": "10.9.9.9", "ttl": "1h", "reason": "again"}))
        .await;
    assert_eq!(
        (&e["reason"], e["expires_at_ms"].is_u64()),
        (&json!("again"), true)
    );
    let list = admin.list().await;
    assert_eq!(list.len(), 3, "{list:?}");
    assert_eq!(find(&list, "10.9.9.9"), Some(&e));
    assert_eq!(entry_counts(&gw).await, [2.0, 1.0, 0.0]);
}

#[tokio::test]
async fn an_entry_with_a_ttl_expires_on_time() {
    let gw = start_gateway(&DYNAMIC.replace("UP", "http://127.0.0.1:9")).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();

    let before = now_ms();
    let e = admin.added(json!({"ip": "192.0.2.1", "ttl": "1s"})).await;
    let k = admin
        .added(json!({"key": "k-brief", "ttl": "1s", "reason": "cool off"}))
        .await;
    let after = now_ms();
    let ip_expiry = check_expiry(&e, 1000, before, after);
    let key_expiry = check_expiry(&k, 1000, before, after);
    assert_eq!(
        (&k["kind"], &k["value"], &k["reason"], &k["source"]),
        (
            &json!("key"),
            &json!("k-brief"),
            &json!("cool off"),
            &json!("api")
        )
    );
    let listed = admin.list().await;
    assert_eq!(find(&listed, "192.0.2.1"), Some(&e));
    assert_eq!(find(&listed, "k-brief"), Some(&k));
    assert_eq!(entry_counts(&gw).await, [2.0, 2.0, 0.0]);
    assert_eq!(from(&c, &gw, "/limited", "192.0.2.1").await, 451);
    let keyed = url(gw.addr, "/keyed");
    assert_eq!(c.get(&keyed, &[("x-api-key", "k-brief")]).await.status, 451);

    // Denied until the moment it expires, admitted from then on (before the purge).
    denied_until(ip_expiry, 451, || from(&c, &gw, "/limited", "192.0.2.1")).await;
    denied_until(key_expiry, 451, || async {
        c.get(&keyed, &[("x-api-key", "k-brief")]).await.status
    })
    .await;

    // And gone from the list and the gauge within the next purge.
    eventually("expired entries purged", Duration::from_secs(3), || async {
        let gone = admin.list().await.len() == 2;
        (gone && entry_counts(&gw).await == [2.0, 0.0, 0.0]).then_some(())
    })
    .await;
}

#[tokio::test]
async fn dynamic_entries_survive_reloads_and_static_ones_follow_the_file() {
    let config = r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
deny: DENY
routes:
  - {name: keyed, match: {path: /keyed}, key: "header:x-api-key", respond: {body: keyed}}
  - {name: main, match: {path_prefix: /}, respond: {body: ok}}
"#;
    let (gw, _dir, path) = start_in_dir(&config.replace("DENY", "{ips: [198.51.100.7]}")).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    admin.added(json!({"ip": "203.0.113.5"})).await;
    admin.added(json!({"key": "k-dyn", "ttl": "1h"})).await;
    let dynamic = admin.list().await[1..].to_vec();
    assert_eq!(entry_counts(&gw).await, [1.0, 2.0, 0.0]);
    let reload = |deny: &str| {
        std::fs::write(&path, with_listeners(&config.replace("DENY", deny))).unwrap();
        let admin = &admin;
        async move {
            let r = admin.call(Method::POST, "/admin/reload", "").await;
            assert_eq!(r.status, 200, "{}", r.text());
        }
    };
    let key = |k: &'static str| {
        let (c, u) = (&c, url(gw.addr, "/keyed"));
        async move { c.get(&u, &[("x-api-key", k)]).await.status }
    };

    // More static entries and another status: the dynamic ones stay, with it.
    reload("{ips: [198.51.100.7, 198.51.100.8], keys: [k-static], status: 451}").await;
    let list = admin.list().await;
    assert_eq!(list.len(), 5, "{list:?}");
    assert_eq!(list[3..], dynamic[..]);
    assert_eq!(entry_counts(&gw).await, [3.0, 2.0, 0.0]);
    for ip in ["203.0.113.5", "198.51.100.7", "198.51.100.8"] {
        assert_eq!(from(&c, &gw, "/", ip).await, 451, "{ip}");
    }
    assert_eq!((key("k-dyn").await, key("k-static").await), (451, 451));

    // No static entries: those are gone, the dynamic ones are not.
    reload("{}").await;
    assert_eq!(admin.list().await, dynamic);
    assert_eq!(entry_counts(&gw).await, [0.0, 2.0, 0.0]);
    assert_eq!(from(&c, &gw, "/", "198.51.100.7").await, 200);
    assert_eq!(from(&c, &gw, "/", "203.0.113.5").await, 403);
    assert_eq!((key("k-dyn").await, key("k-static").await), (403, 200));
    // 404, no longer 409: nothing static to point at.
    assert_eq!(
        admin.remove(json!({"ip": "198.51.100.7"})).await.status,
        404
    );
}

// === denied keys however they are sent ===

const KEYED: &str = r#"
deny: {keys: [leaked-key-123]}
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: by_header, match: {path: /h}, key: "header:x-api-key", upstream: api}
  - {name: by_query, match: {path: /q}, key: "query:k", upstream: api}
  - {name: by_cookie, match: {path: /c}, key: "cookie:session", upstream: api}
  - {name: by_header_or_ip, match: {path: /f}, key: "header:x-api-key", missing_key: ip, upstream: api}
  - {name: by_cookie_or_ip, match: {path: /cf}, key: "cookie:session", missing_key: ip, upstream: api}
"#;

/// Every way to send key `k` among others: (path, headers), each denied.
fn disguised(k: &str) -> Vec<(String, Vec<(&'static str, String)>)> {
    let h = |v: &str| ("x-api-key", v.to_string());
    vec![
        ("/h".into(), vec![h(k)]),
        ("/h".into(), vec![h(k), h("other")]),
        ("/h".into(), vec![h("other"), h(k)]),
        ("/f".into(), vec![h(k), h("other")]),
        (format!("/q?k={k}"), vec![]),
        (format!("/q?k={k}&k=x"), vec![]),
        (format!("/q?k=x&k={k}"), vec![]),
        (format!("/q?k=x&k={}", k.replace('-', "%2D")), vec![]),
        ("/c".into(), vec![("cookie", format!("session={k}"))]),
        (
            "/c".into(),
            vec![("cookie", format!("session={k}; session=x"))],
        ),
        (
            "/c".into(),
            vec![("cookie", format!("session=x; session={k}"))],
        ),
        (
            "/c".into(),
            vec![
                ("cookie", "session=x".into()),
                ("cookie", format!("session={k}")),
            ],
        ),
        // Padding an HTTP/1 upstream strips (hyper keeps it on HTTP/2).
        ("/h".into(), vec![h(&format!(" {k}\t"))]),
        ("/f".into(), vec![h(&format!("{k} "))]),
        // A byte that is not visible ASCII elsewhere in the header, a space before `=`.
        (
            "/c".into(),
            vec![("cookie", format!("session={k}; theme=caf\u{e9}"))],
        ),
        ("/c".into(), vec![("cookie", format!("session ={k}"))]),
        (
            "/cf".into(),
            vec![("cookie", format!("theme=caf\u{e9}; session={k}"))],
        ),
        ("/cf".into(), vec![("cookie", format!("session = {k}"))]),
    ]
}

async fn all_denied(gw: &Running, up: &Upstream, k: &str) {
    for client in [http1(), h2c()] {
        for (path, headers) in disguised(k) {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
            let r = client.get(&url(gw.addr, &path), &headers).await;
            assert_eq!(
                (r.status, r.text()),
                (403, "access denied\n"),
                "{path} {headers:?}"
            );
        }
    }
    assert_eq!(up.hits(), 0, "the upstream saw a denied key");
}

#[tokio::test]
async fn a_denied_key_is_denied_however_it_is_sent() {
    let up = upstream().await;
    let gw = start_gateway(&KEYED.replace("UP", &up.url())).await;
    all_denied(&gw, &up, "leaked-key-123").await;
    let m = metrics(gw.admin_addr).await;
    // 2 clients: /h 4 times, /f twice, /q 4 times, /c 6 times, /cf twice.
    let denied = [
        ("by_header", 8.0),
        ("by_header_or_ip", 4.0),
        ("by_query", 8.0),
        ("by_cookie", 12.0),
        ("by_cookie_or_ip", 4.0),
    ];
    for (route, n) in denied {
        assert_eq!(decisions(&m, route), [("denied", n)], "{route}");
    }

    // The same requests with a harmless key: one value passes, two are a missing key.
    let c = http1();
    assert_eq!(
        c.get(&url(gw.addr, "/h"), &[("x-api-key", "fine")])
            .await
            .status,
        200
    );
    let twice = [("x-api-key", "fine"), ("x-api-key", "other")];
    assert_eq!(c.get(&url(gw.addr, "/h"), &twice).await.status, 400);
    assert_eq!(c.get(&url(gw.addr, "/f"), &twice).await.status, 200);
    assert_eq!(c.get(&url(gw.addr, "/q?k=fine&k=x"), &[]).await.status, 400);
    assert_eq!(c.get(&url(gw.addr, "/q?k=fine"), &[]).await.status, 200);
    let cookie = [("cookie", "session=fine; session=x")];
    assert_eq!(c.get(&url(gw.addr, "/c"), &cookie).await.status, 400);
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn a_dynamic_key_entry_is_denied_however_it_is_sent() {
    let up = upstream().await;
    let gw = start_gateway(&KEYED.replace("UP", &up.url())).await;
    let admin = AdminApi::new(&gw, None);
    admin.added(json!({"key": "dyn-key-9"})).await;
    all_denied(&gw, &up, "dyn-key-9").await;
    // Removed: the plain forms pass again.
    assert_eq!(admin.remove(json!({"key": "dyn-key-9"})).await.status, 204);
    let c = http1();
    assert_eq!(
        c.get(&url(gw.addr, "/h"), &[("x-api-key", "dyn-key-9")])
            .await
            .status,
        200
    );
    assert_eq!(
        c.get(&url(gw.addr, "/q?k=dyn-key-9"), &[]).await.status,
        200
    );
    assert_eq!(up.hits(), 2);
}

// === bans ===

const BANS: &str = r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
routes:
  - name: login
    match: {path: /login}
    key: ip
    limits: [{algorithm: fixed_window, limit: 2, window: 2s}]
    ban: {after: 3, within: 2s, for: 1s}
    respond: {body: login}
  - name: api
    match: {path: /api}
    key: "header:x-api-key"
    limits: [{algorithm: fixed_window, limit: 2, window: 2s}]
    ban: {after: 3, within: 2s, for: 1s}
    respond: {body: api}
  - name: fallback
    match: {path: /fallback}
    key: "header:x-api-key"
    missing_key: ip
    limits: [{algorithm: fixed_window, limit: 2, window: 2s}]
    ban: {after: 3, within: 2s, for: 1s}
    respond: {body: fallback}
  - {name: keyed, match: {path: /keyed}, key: "header:x-api-key", respond: {body: keyed}}
  - {name: free, match: {path: /free}, respond: {body: free}}
"#;

#[tokio::test]
async fn an_address_that_keeps_hitting_the_limit_is_banned_for_a_while() {
    let gw = start_gateway(BANS).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    let m = metrics(gw.admin_addr).await;
    assert_eq!((bans(&m, "login"), bans(&m, "api")), (0.0, 0.0));
    assert_eq!(metric(&m, r#"sluice_bans_total{route="free"}"#), None);

    let ip = "192.0.2.10";
    at_window_start(Duration::from_secs(2)).await;
    let mut seen = Vec::new();
    for _ in 0..4 {
        seen.push(from(&c, &gw, "/login", ip).await);
    }
    assert_eq!(seen, [200, 200, 429, 429]);
    // Two refusals are not yet a ban.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(from(&c, &gw, "/free", ip).await, 200);
    assert_eq!(bans(&metrics(gw.admin_addr).await, "login"), 0.0);

    // The third is: the address is denied everywhere within milliseconds.
    let before = now_ms();
    assert_eq!(from(&c, &gw, "/login", ip).await, 429);
    let banned = Instant::now();
    eventually("the ban applies", Duration::from_secs(1), || async {
        (from(&c, &gw, "/free", ip).await == 403).then_some(())
    })
    .await;
    eprintln!("banned after {:?}", banned.elapsed());
    let after = now_ms();
    assert_eq!(from(&c, &gw, "/login", ip).await, 403);
    // Another address keeps its own budget.
    assert_eq!(from(&c, &gw, "/login", "192.0.2.11").await, 200);

    let m = metrics(gw.admin_addr).await;
    assert_eq!((bans(&m, "login"), bans(&m, "api")), (1.0, 0.0));
    assert_eq!(deny_entries(&m, "ban"), 1.0);
    assert_eq!(deny_entries(&m, "api"), 0.0);
    let list = admin.list().await;
    assert_eq!(list.len(), 1, "{list:?}");
    let e = &list[0];
    let expiry = check_expiry(e, 1000, before, after);
    assert_eq!(
        (&e["kind"], &e["value"], &e["source"], &e["route"]),
        (&json!("ip"), &json!(ip), &json!("ban"), &json!("login"))
    );
    let reason = e["reason"].as_str().unwrap_or_else(|| panic!("{e}"));
    assert!(
        reason.contains("login") && reason.contains("1s"),
        "{reason}"
    );
    assert_eq!(e.as_object().unwrap().len(), 7, "{e}");

    // Released after `for`, not before.
    denied_until(expiry, 403, || from(&c, &gw, "/free", ip)).await;
    eventually(
        "the ban entry is purged",
        Duration::from_secs(3),
        || async {
            let m = metrics(gw.admin_addr).await;
            (deny_entries(&m, "ban") == 0.0).then_some(())
        },
    )
    .await;
    assert_eq!(admin.list().await, Vec::<Value>::new());
    assert_eq!(bans(&metrics(gw.admin_addr).await, "login"), 1.0);
}

#[tokio::test]
async fn a_header_key_is_banned_not_the_address() {
    let gw = start_gateway(BANS).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    let api = url(gw.addr, "/api");
    let with_key = |path: &'static str, key: &'static str| {
        let (c, u) = (&c, url(gw.addr, path));
        async move { c.get(&u, &[("x-api-key", key)]).await.status }
    };

    at_window_start(Duration::from_secs(2)).await;
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(c.get(&api, &[("x-api-key", "k1")]).await.status);
    }
    assert_eq!(seen, [200, 200, 429, 429, 429]);
    eventually("the key is banned", Duration::from_secs(1), || async {
        (with_key("/keyed", "k1").await == 403).then_some(())
    })
    .await;
    assert_eq!(with_key("/api", "k1").await, 403);
    // Same address, other key; and no key at all.
    assert_eq!(with_key("/api", "k2").await, 200);
    assert_eq!(with_key("/keyed", "k2").await, 200);
    assert_eq!(c.get(&url(gw.addr, "/free"), &[]).await.status, 200);

    let m = metrics(gw.admin_addr).await;
    assert_eq!((bans(&m, "api"), bans(&m, "login")), (1.0, 0.0));
    assert_eq!(deny_entries(&m, "ban"), 1.0);
    let list = admin.list().await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(
        (
            &list[0]["kind"],
            &list[0]["value"],
            &list[0]["source"],
            &list[0]["route"]
        ),
        (&json!("key"), &json!("k1"), &json!("ban"), &json!("api"))
    );

    // An operator may lift a ban early.
    assert_eq!(admin.remove(json!({"key": "k1"})).await.status, 204);
    assert_eq!(with_key("/keyed", "k1").await, 200);
    let m = metrics(gw.admin_addr).await;
    assert_eq!((deny_entries(&m, "ban"), bans(&m, "api")), (0.0, 1.0));

    // Without a key, where the route falls back to the address, the address is
    // banned (still in the same window).
    let ip = "192.0.2.77";
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(from(&c, &gw, "/fallback", ip).await);
    }
    assert_eq!(seen, [200, 200, 429, 429, 429]);
    eventually("the address is banned", Duration::from_secs(1), || async {
        (from(&c, &gw, "/free", ip).await == 403).then_some(())
    })
    .await;
    let list = admin.list().await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(
        (&list[0]["kind"], &list[0]["value"], &list[0]["route"]),
        (&json!("ip"), &json!(ip), &json!("fallback"))
    );
    assert_eq!(bans(&metrics(gw.admin_addr).await, "fallback"), 1.0);
}

/// A client key that spells the hash a long key is stored as (`#` and its SHA-1) is
/// never taken for that long key, nor the other way round: a client's key that
/// starts with `#` is hashed too. The admin API names the long key's entry by the
/// listed hash.
#[tokio::test]
async fn a_key_spelling_a_long_keys_hash_is_not_that_key() {
    let gw = start_gateway(BANS).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    let long = "L".repeat(300);
    let hashed = format!("#{}", sha1(long.as_bytes()));
    let keyed = |key: &str| {
        let (c, u, key) = (&c, url(gw.addr, "/keyed"), key.to_string());
        async move { c.get(&u, &[("x-api-key", key.as_str())]).await.status }
    };

    // The long key denied: the key `#<its SHA-1>` passes.
    assert_eq!(admin.add(json!({"key": long})).await.status, 201);
    assert_eq!((keyed(&long).await, keyed(&hashed).await), (403, 200));
    let list = admin.list().await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_eq!(list[0]["value"], json!(hashed));
    assert_eq!(admin.remove(json!({"key": hashed})).await.status, 204);
    assert_eq!(keyed(&long).await, 200);

    // A client sending `#<SHA-1 of the long key>` banned: the long key passes.
    at_window_start(Duration::from_secs(2)).await;
    let mut seen = Vec::new();
    for _ in 0..5 {
        seen.push(
            c.get(&url(gw.addr, "/api"), &[("x-api-key", hashed.as_str())])
                .await
                .status,
        );
    }
    assert_eq!(seen, [200, 200, 429, 429, 429]);
    eventually("the key is banned", Duration::from_secs(1), || async {
        (keyed(&hashed).await == 403).then_some(())
    })
    .await;
    assert_eq!(keyed(&long).await, 200);
    let list = admin.list().await;
    assert_eq!(list.len(), 1, "{list:?}");
    assert_ne!(list[0]["value"], json!(hashed));
}

// === the state file ===

#[tokio::test]
async fn dynamic_entries_survive_a_restart_through_the_state_file() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("deny.json");
    let config = format!(
        r#"
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
deny: {{state_file: "{}"}}
routes:
  - name: login
    match: {{path: /login}}
    key: ip
    limits: [{{algorithm: fixed_window, limit: 1, window: 2s}}]
    ban: {{after: 2, within: 2s, for: 1m}}
    respond: {{body: login}}
  - {{name: main, match: {{path_prefix: /}}, key: "header:x-api-key", missing_key: ip, respond: {{body: ok}}}}
"#,
        state.display()
    );
    let path = write_config(dir.path(), &config);
    let gw = start_at(&path).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();

    // A ban, an entry for good, one for an hour, one for three seconds.
    at_window_start(Duration::from_secs(2)).await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(from(&c, &gw, "/login", "192.0.2.50").await);
    }
    assert_eq!(seen, [200, 429, 429]);
    eventually("the ban applies", Duration::from_secs(1), || async {
        (from(&c, &gw, "/", "192.0.2.50").await == 403).then_some(())
    })
    .await;
    admin
        .added(json!({"ip": "203.0.113.9", "reason": "scraper"}))
        .await;
    admin.added(json!({"key": "k-hour", "ttl": "1h"})).await;
    let short = admin.added(json!({"key": "k-short", "ttl": "3s"})).await;

    // Written within about a second of the change, whole.
    let read_state =
        || -> Option<Vec<Value>> { serde_json::from_slice(&std::fs::read(&state).ok()?).ok() };
    eventually(
        "the state file is written",
        Duration::from_secs(3),
        || async { read_state().filter(|l| l.len() == 4).map(|_| ()) },
    )
    .await;
    // The state file shares the configuration's directory: its writes wake the
    // watcher, but the configuration is unchanged, so they reload nothing. A change
    // after a pause (its own burst) shows that they were handled: one reload in all.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let text = with_listeners(&config) + "# edited\n";
    std::fs::write(&path, &text).unwrap();
    eventually("the edit is loaded", Duration::from_secs(3), || async {
        (admin.config().await["hash"] == sha1(text.as_bytes())).then_some(())
    })
    .await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!((reloads(&m, "success"), reloads(&m, "failure")), (1.0, 0.0));
    // One more just before shutdown: written at shutdown at the latest.
    admin
        .added(json!({"ip": "2001:db8::/48", "ttl": "1h"}))
        .await;
    let before = admin.list().await;
    assert_eq!(before.len(), 5);
    gw.shutdown().await;

    let saved = read_state().expect("the state file is a JSON list");
    let sorted = |mut l: Vec<Value>| {
        l.sort_by_key(|e| e.to_string());
        l
    };
    assert_eq!(sorted(saved.clone()), sorted(before.clone()));
    assert!(
        !dir.path().join("deny.json.tmp").exists(),
        "temp file left behind"
    );
    let ban = find(&saved, "192.0.2.50").expect("ban saved");
    assert_eq!(
        (&ban["source"], &ban["route"]),
        (&json!("ban"), &json!("login"))
    );

    // The short one expires while the gateway is down: not loaded again.
    let short_expiry = short["expires_at_ms"].as_u64().unwrap();
    eventually("k-short expires", Duration::from_secs(3), || async {
        (now_ms() > short_expiry).then_some(())
    })
    .await;
    let gw = start_at(&path).await;
    let admin = AdminApi::new(&gw, None);
    let expected: Vec<Value> = before
        .into_iter()
        .filter(|e| e["value"] != "k-short")
        .collect();
    assert_eq!(admin.list().await, expected);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        (deny_entries(&m, "api"), deny_entries(&m, "ban")),
        (3.0, 1.0)
    );
    // And enforced.
    let c = http1();
    assert_eq!(from(&c, &gw, "/", "203.0.113.9").await, 403);
    assert_eq!(from(&c, &gw, "/", "192.0.2.50").await, 403);
    assert_eq!(from(&c, &gw, "/", "2001:db8::1").await, 403);
    assert_eq!(from(&c, &gw, "/", "203.0.113.10").await, 200);
    let key = |k: &'static str| {
        let (c, u) = (&c, url(gw.addr, "/"));
        async move { c.get(&u, &[("x-api-key", k)]).await.status }
    };
    assert_eq!((key("k-hour").await, key("k-short").await), (403, 200));
    gw.shutdown().await;
}

// === metrics and /admin/config ===

#[tokio::test]
async fn live_operations_metrics_are_exported_from_the_start() {
    let (gw, _dir, _path) = start_in_dir(
        r#"
deny: {ips: [198.51.100.7, 203.0.113.0/24], keys: [leaked]}
routes:
  - name: login
    match: {path: /login}
    limits: [{algorithm: fixed_window, limit: 5, window: 1m}]
    ban: {after: 20, within: 1m, for: 15m}
    respond: {body: ok}
  - {name: other, match: {path: /other}, limits: [{algorithm: fixed_window, limit: 5, window: 1m}], respond: {body: ok}}
"#,
    )
    .await;
    let m = metrics(gw.admin_addr).await;
    let lines: Vec<&str> = m.lines().collect();
    for line in [
        r#"sluice_config_reloads_total{result="failure"} 0"#,
        r#"sluice_config_reloads_total{result="success"} 0"#,
        "sluice_config_last_reload_success 1",
        r#"sluice_deny_entries{source="api"} 0"#,
        r#"sluice_deny_entries{source="ban"} 0"#,
        r#"sluice_deny_entries{source="static"} 3"#,
        r#"sluice_bans_total{route="login"} 0"#,
    ] {
        assert!(lines.contains(&line), "no line {line:?} in\n{m}");
    }
    // Only routes with a ban have a ban counter.
    assert!(!m.contains(r#"sluice_bans_total{route="other"}"#), "{m}");
    for name in [
        "sluice_config_reloads_total",
        "sluice_deny_entries",
        "sluice_bans_total",
    ] {
        assert!(m.contains(&format!("# TYPE {name} ")), "no TYPE for {name}");
    }
}

#[tokio::test]
async fn admin_config_shows_the_effective_config_with_secrets_redacted() {
    let (gw, _dir, path) = start_in_dir(&format!(
        r#"
admin: {{listen: "127.0.0.1:0", token: {TOKEN}}}
routes:
  - {{name: main, match: {{path_prefix: /}}, respond: {{body: ok}}}}
"#
    ))
    .await;
    let r = AdminApi::new(&gw, Some(TOKEN))
        .call(Method::GET, "/admin/config", "")
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert!(!r.text().contains(TOKEN), "the token leaks: {}", r.text());
    let cfg: Value = serde_json::from_slice(&r.body).unwrap();

    assert_eq!(cfg["hash"], sha1(&std::fs::read(&path).unwrap()));
    assert_eq!(cfg["path"], path.display().to_string());
    let loaded_at = cfg["loaded_at"].as_str().unwrap_or_else(|| panic!("{cfg}"));
    let loaded_ms = parse_rfc3339(loaded_at).unwrap_or_else(|| panic!("loaded_at {loaded_at}"));
    assert!(
        now_ms().abs_diff(loaded_ms) < 10_000,
        "loaded_at {loaded_at}"
    );
    assert_eq!(cfg["last_reload"], Value::Null);

    let c = &cfg["config"];
    assert_eq!(c["admin"]["token"], "***");
    // Defaults filled in.
    assert_eq!(c["server"]["shutdown_grace"], "30s");
    assert_eq!(c["server"]["request_header_timeout"], "10s");
    assert_eq!(c["server"]["max_connections"], 10_000);
    assert_eq!(c["store"]["backend"], "memory");
    assert_eq!(c["deny"]["status"], 403);
    assert_eq!(c["response_headers"], json!(["ietf", "x-ratelimit"]));
    assert_eq!(c["routes"][0]["name"], "main");
    assert_eq!(c["routes"][0]["key"], "ip");
}

/// The admin listener stays where it was bound until a restart: a reload that moves
/// it to loopback in the file cannot drop the token it needs where it still listens.
#[tokio::test]
async fn a_reload_cannot_drop_the_token_of_an_admin_listener_off_loopback() {
    let body = "routes: [{name: r, match: {path_prefix: /}, respond: {body: ok}}]\n";
    let server = "server: {listen: \"127.0.0.1:0\"}\n";
    let (gw, file) = start_gateway_file(&format!(
        "{server}admin: {{listen: \"0.0.0.0:0\", token: s3cret}}\n{body}"
    ))
    .await;
    let admin = format!("http://127.0.0.1:{}/admin/deny", gw.admin_addr.port());
    assert_eq!(http1().get(&admin, &[]).await.status, 401);
    std::fs::write(
        file.path(),
        format!("{server}admin: {{listen: \"127.0.0.1:0\"}}\n{body}"),
    )
    .unwrap();
    let err = gw.reload().await.expect_err("the token is still needed");
    assert!(
        err.ends_with("admin.token: the admin listener stays on 0.0.0.0:0, off loopback, until a restart, so it needs a token"),
        "{err}"
    );
    assert_eq!(http1().get(&admin, &[]).await.status, 401);
    let ok = [("authorization", "Bearer s3cret")];
    assert_eq!(http1().get(&admin, &ok).await.status, 200);
}

// === the deny list's bounds ===

/// Every entry of `GET /admin/deny`, page by page (`limit` a page), following the
/// `Link: <…>; rel="next"` header; the pages' sizes too.
async fn list_pages(admin: &AdminApi, limit: usize) -> (Vec<Value>, Vec<usize>) {
    let (mut all, mut sizes) = (Vec::new(), Vec::new());
    let mut path = format!("/admin/deny?limit={limit}");
    for _ in 0..10_000 {
        let r = admin.call(Method::GET, &path, "").await;
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
        let page: Vec<Value> = serde_json::from_slice(&r.body).expect("JSON list");
        sizes.push(page.len());
        all.extend(page);
        let next = r.header("link").map(|l| {
            let l = l
                .strip_suffix(">; rel=\"next\"")
                .unwrap_or_else(|| panic!("{l}"));
            l.strip_prefix('<')
                .unwrap_or_else(|| panic!("{l}"))
                .to_string()
        });
        match next {
            Some(p) => path = p,
            None => return (all, sizes),
        }
    }
    panic!("more than 10000 pages");
}

const FLOOD: &str = r#"
deny: {max_entries: 50}
routes:
  - name: api
    match: {path: /api}
    key: "header:x-api-key"
    limits: [{algorithm: fixed_window, limit: 1, window: 1h}]
    ban: {after: 1, within: 1m, for: 1m}
    respond: {body: api}
"#;

/// One address floods a banning route with 300 different 30 KB keys, each twice
/// (admitted, refused: banned): the table keeps `max_entries` (50) entries, the
/// most recent bans (the others expire sooner), each key stored as its hash, and a
/// kept key's next request is still denied.
#[tokio::test]
async fn a_flood_of_long_keys_is_capped_at_max_entries_and_stored_hashed() {
    let gw = start_gateway(FLOOD).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    let api = url(gw.addr, "/api");
    let long = |i: usize| format!("{i:03}{}", "x".repeat(30_000));
    for i in 0..300 {
        let k = long(i);
        assert_eq!(
            statuses(&c, 2, &api, &[("x-api-key", k.as_str())]).await,
            [200, 429],
            "key {i}"
        );
        // Each ban is made before the next key comes, so that the order is known.
        eventually("the ban", Duration::from_secs(2), || async {
            let m = metrics(gw.admin_addr).await;
            (bans(&m, "api") == (i + 1) as f64).then_some(())
        })
        .await;
    }
    let kept: std::collections::BTreeSet<String> = (250..300)
        .map(|i| format!("#{}", sha1(long(i).as_bytes())))
        .collect();
    let denied = |i: usize| {
        let (c, api, k) = (&c, &api, long(i));
        async move { c.get(api, &[("x-api-key", k.as_str())]).await.status }
    };
    eventually("the last ban published", Duration::from_secs(2), || async {
        (denied(299).await == 403).then_some(())
    })
    .await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!(deny_entries(&m, "ban"), 50.0);
    assert_eq!(value(&m, "sluice_deny_evictions_total"), 250.0);
    let (list, _) = list_pages(&admin, 1000).await;
    let values: std::collections::BTreeSet<String> = list
        .iter()
        .map(|e| e["value"].as_str().expect("value").to_string())
        .collect();
    assert_eq!((list.len(), values), (50, kept));
    assert!(list.iter().all(|e| e["source"] == "ban"), "{list:?}");
    assert_eq!(denied(250).await, 403);
    // Evicted: no longer denied (its limit still refuses it).
    assert_eq!(denied(0).await, 429);
}

/// `GET /admin/deny` in pages: every entry exactly once, static ones first, in
/// pages of `limit`, with the total in `X-Total-Count`; a bad limit or cursor is a
/// 400.
#[tokio::test]
async fn the_deny_list_is_listed_in_pages() {
    let up = upstream().await;
    let gw = start_gateway(&DYNAMIC.replace("UP", &up.url())).await;
    let admin = AdminApi::new(&gw, None);
    for i in 0..13 {
        admin.added(json!({"ip": format!("10.0.{i}.0/24")})).await;
        admin.added(json!({"key": format!("key{i:02}")})).await;
    }
    let (all, sizes) = list_pages(&admin, 5).await;
    assert_eq!(sizes, [5, 5, 5, 5, 5, 3]);
    let mut expected = vec!["198.51.100.7".to_string(), "static-key".to_string()];
    expected.extend((0..13).map(|i| format!("10.0.{i}.0/24")));
    expected.extend((0..13).map(|i| format!("key{i:02}")));
    let values: Vec<&str> = all.iter().map(|e| e["value"].as_str().unwrap()).collect();
    assert_eq!(values, expected);
    let r = admin.call(Method::GET, "/admin/deny?limit=5", "").await;
    assert_eq!(r.header("x-total-count"), Some("28"));
    // The default page holds them all; no next page.
    let r = admin.call(Method::GET, "/admin/deny", "").await;
    assert_eq!((r.status, r.header("link")), (200, None));
    for bad in ["limit=0", "limit=1001", "limit=x", "after=zz", "after=%ZZ"] {
        let r = admin
            .call(Method::GET, &format!("/admin/deny?{bad}"), "")
            .await;
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
    }
}

/// A block wider than /8 (IPv4) or /32 (IPv6), IPv4-mapped forms by their IPv4
/// width, needs `"force": true`: without it, 400 saying why, and nothing is added.
#[tokio::test]
async fn a_block_wider_than_8_or_32_needs_force() {
    let up = upstream().await;
    let gw = start_gateway(&DYNAMIC.replace("UP", &up.url())).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    for (ip, shown) in [
        ("1.2.3.4/0", "0.0.0.0/0"),
        ("10.0.0.0/7", "10.0.0.0/7"),
        ("::/0", "::/0"),
        ("::ffff:0.0.0.0/96", "0.0.0.0/0"),
        ("2001:db8::/31", "2001:db8::/31"),
    ] {
        let r = admin.add(json!({"ip": ip})).await;
        assert_eq!(
            (r.status, r.text().to_string()),
            (
                400,
                format!(
                    "ip {shown} is wider than /8 (IPv4) or /32 (IPv6) and would deny a large part of the internet; send \"force\": true (sluice deny --force) if that is meant\n"
                )
            ),
            "{ip}"
        );
    }
    assert_eq!(admin.list().await.len(), 2);
    assert_eq!(from(&c, &gw, "/api", "192.0.2.1").await, 200);
    for ip in ["10.0.0.0/8", "2001:db8::/32", "::ffff:11.0.0.0/104"] {
        admin.added(json!({"ip": ip})).await;
    }
    let e = admin
        .added(json!({"ip": "::ffff:0.0.0.0/96", "force": true}))
        .await;
    assert_eq!(e["value"], "0.0.0.0/0");
    assert_eq!(from(&c, &gw, "/api", "192.0.2.1").await, 451);
    let r = admin.add(json!({"ip": "::/0", "force": true})).await;
    assert_eq!(r.status, 201, "{}", r.text());
    let r = admin.add(json!({"key": "k", "force": "yes"})).await;
    assert_eq!(r.status, 400, "{}", r.text());
}

/// At `max_entries` entries that never expire, nothing can be evicted: the admin
/// API answers 507 saying so, and a ban is not made (nor counted).
#[tokio::test]
async fn a_list_full_of_permanent_entries_refuses_more() {
    let gw = start_gateway(&FLOOD.replace("max_entries: 50", "max_entries: 2")).await;
    let admin = AdminApi::new(&gw, None);
    let c = http1();
    admin.added(json!({"key": "one"})).await;
    admin.added(json!({"ip": "192.0.2.0/24"})).await;
    let r = admin.add(json!({"key": "three", "ttl": "1m"})).await;
    assert_eq!(
        (r.status, r.text()),
        (
            507,
            "the deny list holds deny.max_entries (2) entries and none of them expires\n"
        )
    );
    // Replacing one of them is no new entry.
    admin.added(json!({"key": "one", "reason": "again"})).await;
    let api = url(gw.addr, "/api");
    assert_eq!(
        statuses(&c, 3, &api, &[("x-api-key", "k")]).await,
        [200, 429, 429]
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(bans(&m, "api"), 0.0);
    assert_eq!(entry_counts(&gw).await, [0.0, 2.0, 0.0]);
    assert_eq!(admin.list().await.len(), 2);
}
