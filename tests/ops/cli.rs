//! The `sluice` binary: `check` and its error positions, `--version`, where the
//! configuration comes from, and `run` serving until SIGHUP reloads it and SIGTERM
//! stops it with exit status 0.

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use crate::common::*;
use http::Method;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

const GOOD: &str = r#"
server: {listen: "127.0.0.1:0"}
admin: {listen: "127.0.0.1:0"}
routes:
  - name: hello
    match: {path: /hello}
    limits:
      - {name: per_ip, algorithm: fixed_window, limit: 5, window: 2s}
    respond: {body: "hi\n"}
"#;

/// GOOD with `limits` misspelt: `limts` is on line 7, column 5.
const TYPO: &str = r#"
server: {listen: "127.0.0.1:0"}
admin: {listen: "127.0.0.1:0"}
routes:
  - name: hello
    match: {path: /hello}
    limts:
      - {name: per_ip, algorithm: fixed_window, limit: 5, window: 2s}
    respond: {body: "hi\n"}
"#;

/// Run `sluice ARGS` to completion, without `SLUICE_CONFIG` unless `env` sets it.
fn sluice(args: &[&str], env: Option<&Path>) -> Output {
    let mut cmd = Command::new(SLUICE);
    cmd.args(args)
        .env_remove("SLUICE_CONFIG")
        .env("SLUICE_LOG", "warn");
    if let Some(path) = env {
        cmd.env("SLUICE_CONFIG", path);
    }
    run_grouped(&mut cmd).expect("sluice runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn check_accepts_a_good_file() {
    let good = config_file(GOOD);
    let path = good.path().display().to_string();
    let out = sluice(&["check", "-c", &path], None);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    // The summary names the file, the route and its limit.
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.starts_with(&format!("{path}: ok")), "{summary}");
    assert!(
        summary.contains("hello") && summary.contains("per_ip"),
        "{summary}"
    );
}

#[test]
fn check_names_file_line_and_column_of_a_typo() {
    let typo = config_file(TYPO);
    let path = typo.path().display().to_string();
    let out = sluice(&["check", "-c", &path], None);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.starts_with(&format!("{path}:7:5: ")), "{err}");
    assert!(err.contains("limts"), "{err}");
}

#[test]
fn check_of_a_missing_file_fails() {
    let out = sluice(&["check", "-c", "/nonexistent/sluice.yaml"], None);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("/nonexistent/sluice.yaml: "),
        "{}",
        stderr(&out)
    );
}

#[test]
fn sluice_config_is_used_without_dash_c() {
    let (good, typo) = (config_file(GOOD), config_file(TYPO));
    // The test runs in the crate root, where config/rules.yaml is valid: only a
    // failure shows that the variable was read.
    let out = sluice(&["check"], Some(typo.path()));
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with(&format!("{}:7:5: ", typo.path().display())),
        "{}",
        stderr(&out)
    );
    assert_eq!(sluice(&["check"], Some(good.path())).status.code(), Some(0));
    // `-c` wins over the variable.
    let out = sluice(
        &["check", "-c", &good.path().display().to_string()],
        Some(typo.path()),
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
}

/// Settings that any client can defeat: trusted proxies covering every address
/// (any client then chooses its address, and none is held to the per-address
/// connection cap), keys read from headers that clients write.
const SELF_DEFEATING: &str = r#"
server: {listen: "127.0.0.1:PORT"}
admin: {listen: "127.0.0.1:ADMIN"}
client_ip: {trusted_proxies: [10.0.0.0/8, 0.0.0.0/0]}
routes:
  - name: a
    match: {path: /a}
    key: header:X-Forwarded-For
    respond: {body: "hi\n"}
  - name: c
    match: {path: /c}
    limits: [{key: "header:x-real-ip", algorithm: fixed_window, limit: 1, window: 1m}]
    respond: {body: "hi\n"}
  - name: b
    key: [ip, "header:x-real-ip", "header:forwarded"]
    respond: {body: "hi\n"}
"#;

/// The warnings `check` prints (and `run` logs) for `SELF_DEFEATING` at `path`.
fn self_defeating_warnings(path: &str) -> Vec<String> {
    let every = "trusted_proxies cover every IPv4 address: any client can choose its address with X-Forwarded-For, and none is held to max_connections_per_ip";
    let header = |name: &str| {
        format!("key \"header:{name}\" is read from a header any client can write: each request can bring a fresh key (count by address with key: ip and client_ip.trusted_proxies)")
    };
    vec![
        format!("{path}:4:43: warning: {every}"),
        format!("{path}:8:10: warning: {}", header("X-Forwarded-For")),
        format!("{path}:12:20: warning: {}", header("x-real-ip")),
        format!("{path}:15:15: warning: {}", header("x-real-ip")),
        format!("{path}:15:35: warning: {}", header("forwarded")),
    ]
}

#[test]
fn check_warns_about_settings_any_client_can_defeat_and_exits_0() {
    let file = config_file(&SELF_DEFEATING.replace("PORT", "0").replace("ADMIN", "0"));
    let path = file.path().display().to_string();
    let out = sluice(&["check", "-c", &path], None);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let lines: Vec<String> = stderr(&out).lines().map(str::to_string).collect();
    assert_eq!(lines, self_defeating_warnings(&path));
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.starts_with(&format!("{path}: ok")), "{summary}");
    // A file without them: no warning.
    let good = config_file(GOOD);
    let out = sluice(&["check", "-c", &good.path().display().to_string()], None);
    assert_eq!((out.status.code(), stderr(&out)), (Some(0), String::new()));
}

/// A newcomer's second login route, with the same `match` as the first: it passes
/// `check`, but the first route takes every request it would. `check` says so at
/// its `match`, naming the route that takes them, and still exits 0.
#[test]
fn check_warns_about_a_route_an_earlier_one_takes_every_request_of() {
    let file = config_file(
        r#"
routes:
  - name: login_per_ip
    match: {path: /login, methods: [POST]}
    key: ip
    limits: [{algorithm: fixed_window, limit: 5, window: 1m}]
    respond: {body: "ok\n"}
  - name: login_per_user
    match: {path: /login, methods: [POST]}
    key: header:x-user
    limits: [{algorithm: fixed_window, limit: 5, window: 1m}]
    respond: {body: "ok\n"}
"#,
    );
    let path = file.path().display().to_string();
    let out = sluice(&["check", "-c", &path], None);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stderr(&out).lines().collect::<Vec<_>>(),
        [format!("{path}:9:12: warning: route 1 (login_per_user) is never reached: route 0 (login_per_ip), before it, matches every request it matches, and the first route that matches takes the request")]
    );
}

#[tokio::test]
async fn run_logs_the_warnings_of_check_at_warn() {
    let (port, admin) = (free_port(), free_port());
    let text = SELF_DEFEATING
        .replace("PORT", &port.to_string())
        .replace("ADMIN", &admin.to_string());
    let file = config_file(&text);
    let path = file.path().display().to_string();
    let mut p = spawn(&["run", "-c", &path]);
    p.wait_until_up(&format!("http://127.0.0.1:{admin}/healthz"))
        .await;
    p.signal("TERM");
    let status = p.exit().await;
    let err = p.stderr();
    assert_eq!(status.code(), Some(0), "{status}: {err}");
    let logged: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains(&path))
        .filter_map(|l| l.split_once(": ").map(|(_, m)| m))
        .collect();
    assert_eq!(logged, self_defeating_warnings(&path));
}

#[test]
fn version() {
    let out = sluice(&["--version"], None);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(String::from_utf8_lossy(&out.stdout), "sluice 0.1.0\n");
}

/// A running `sluice`, killed (its group) if the test ends before it exits.
struct Process(Spawned);

/// Start `sluice ARGS` in the background; its stderr is kept for `stderr`.
fn spawn(args: &[&str]) -> Process {
    let child = spawn_grouped(
        Command::new(SLUICE)
            .args(args)
            .env_remove("SLUICE_CONFIG")
            .env("SLUICE_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped()),
    )
    .expect("sluice starts");
    Process(child)
}

impl Process {
    fn signal(&self, name: &str) {
        let signal = match name {
            "HUP" => libc::SIGHUP,
            "TERM" => libc::SIGTERM,
            "INT" => libc::SIGINT,
            _ => panic!("signal {name}?"),
        };
        self.0.signal(signal);
    }

    /// The exit status, waiting at most `BOUND`.
    async fn exit(&mut self) -> std::process::ExitStatus {
        for _ in 0..(BOUND.as_millis() / 20) {
            if let Some(status) = self.0.try_wait().expect("wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("sluice still running after {BOUND:?}");
    }

    /// What it wrote to stderr; call after `exit`.
    fn stderr(&mut self) -> String {
        let mut text = String::new();
        if let Some(mut pipe) = self.0.stderr.take() {
            std::io::Read::read_to_string(&mut pipe, &mut text).expect("read stderr");
        }
        text
    }

    /// Poll `url` until it answers 200, at most `BOUND`.
    async fn wait_until_up(&mut self, url: &str) {
        let c = http1();
        for _ in 0..(BOUND.as_millis() / 50) {
            if let Some(status) = self.0.try_wait().expect("wait") {
                panic!("sluice exited early ({status}): {}", self.stderr());
            }
            if let Ok(r) = c.try_send(Method::GET, url, &[], Default::default()).await {
                assert_eq!(r.status, 200);
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("{url} not up within {BOUND:?}");
    }
}

fn run_config(port: u16, admin: u16, body: &str) -> String {
    format!(
        r#"
server: {{listen: "127.0.0.1:{port}"}}
admin: {{listen: "127.0.0.1:{admin}"}}
routes:
  - name: hello
    match: {{path: /hello}}
    limits:
      - {{name: per_ip, algorithm: sliding_log, limit: 3, window: 1m}}
    respond: {{body: "{body}"}}
"#
    )
}

#[tokio::test]
async fn run_serves_reloads_on_sighup_and_exits_0_on_sigterm() {
    let (port, admin) = (free_port(), free_port());
    let file = config_file(&run_config(port, admin, "v1"));
    let mut p = spawn(&["run", "-c", &file.path().display().to_string()]);
    p.wait_until_up(&format!("http://127.0.0.1:{admin}/healthz"))
        .await;

    let c = http1();
    let hello = format!("http://127.0.0.1:{port}/hello");
    let r = c.get(&hello, &[]).await;
    assert_eq!(
        (r.status, r.text(), r.num("x-ratelimit-remaining")),
        (200, "v1", 2)
    );

    // SIGHUP: the new body is served, the unchanged limit keeps its count.
    std::fs::write(file.path(), run_config(port, admin, "v2")).unwrap();
    p.signal("HUP");
    let admin_addr = format!("127.0.0.1:{admin}").parse().unwrap();
    let mut reloads = 0.0;
    for _ in 0..(BOUND.as_millis() / 50) {
        let m = metrics(admin_addr).await;
        reloads = metric(&m, r#"sluice_config_reloads_total{result="success"}"#).unwrap_or(0.0);
        if reloads >= 1.0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reloads >= 1.0, "no reload counted after SIGHUP");
    let r = c.get(&hello, &[]).await;
    assert_eq!(
        (r.status, r.text(), r.num("x-ratelimit-remaining")),
        (200, "v2", 1)
    );

    p.signal("TERM");
    let status = p.exit().await;
    assert_eq!(status.code(), Some(0), "{status}: {}", p.stderr());
}

#[tokio::test]
async fn run_exits_0_on_sigint() {
    let (port, admin) = (free_port(), free_port());
    let file = config_file(&run_config(port, admin, "hi"));
    let mut p = spawn(&["run", "-c", &file.path().display().to_string()]);
    p.wait_until_up(&format!("http://127.0.0.1:{admin}/healthz"))
        .await;
    p.signal("INT");
    let status = p.exit().await;
    assert_eq!(status.code(), Some(0), "{status}: {}", p.stderr());
}

#[tokio::test]
async fn run_refuses_a_bad_file_and_a_busy_port() {
    let typo = config_file(TYPO);
    let path = typo.path().display().to_string();
    let mut p = spawn(&["run", "-c", &path]);
    assert_eq!(p.exit().await.code(), Some(1));
    let err = p.stderr();
    assert!(err.starts_with(&format!("{path}:7:5: ")), "{err}");

    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = busy.local_addr().unwrap().port();
    let file = config_file(&run_config(port, free_port(), "hi"));
    let mut p = spawn(&["run", "-c", &file.path().display().to_string()]);
    assert_eq!(p.exit().await.code(), Some(1));
    let err = p.stderr();
    assert!(
        err.contains(&format!("cannot listen on 127.0.0.1:{port}")),
        "{err}"
    );
}

#[tokio::test]
async fn run_starts_the_configured_workers_which_share_limits_and_drain_on_sigterm() {
    let (port, admin) = (free_port(), free_port());
    let text = run_config(port, admin, "w").replace(
        &format!("server: {{listen: \"127.0.0.1:{port}\"}}"),
        &format!("server: {{listen: \"127.0.0.1:{port}\", workers: 3}}"),
    );
    assert!(text.contains("workers: 3"));
    let file = config_file(&text);
    let mut p = spawn(&["run", "-c", &file.path().display().to_string()]);
    p.wait_until_up(&format!("http://127.0.0.1:{admin}/healthz"))
        .await;

    // The main thread is the first worker; the other two are threads of their own.
    let mut workers: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", p.0.id()))
        .expect("/proc")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|c| c.trim().to_string())
        .filter(|c| c.starts_with("sluice-worker"))
        .collect();
    workers.sort();
    assert_eq!(workers, ["sluice-worker-1", "sluice-worker-2"]);

    // Each request on a connection of its own, taken by whichever worker accepts it:
    // the limit (3 per minute per IP) is one for all of them.
    let hello = format!("http://127.0.0.1:{port}/hello");
    let mut codes = Vec::new();
    for _ in 0..12 {
        codes.push(http1().get(&hello, &[]).await.status);
    }
    assert_eq!(codes, ok_then_limited(3, 9));

    p.signal("TERM");
    let status = p.exit().await;
    assert_eq!(status.code(), Some(0), "{status}: {}", p.stderr());
}
