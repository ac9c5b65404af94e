//! `sluice health`, the container health check, run as the real binary against a
//! gateway started in this process: exit 0 with one line on stdout when the admin
//! listener answers 200, exit 1 with one line on stderr when it answers anything
//! else or nothing at all.

use std::net::SocketAddr;
use std::process::Command;

use crate::common::*;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// How `sluice health` ended: exit code, stdout, stderr.
type Out = (Option<i32>, String, String);

/// Run `sluice health ARGS` to its end, without `SLUICE_CONFIG` or
/// `SLUICE_ADMIN_TOKEN` inherited. On a blocking thread, so the gateway in this
/// process keeps answering meanwhile.
async fn health(args: &[&str]) -> Out {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let run = tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(SLUICE);
        cmd.arg("health")
            .args(&args)
            .env_remove("SLUICE_CONFIG")
            .env_remove("SLUICE_ADMIN_TOKEN")
            .env("SLUICE_LOG", "warn");
        run_grouped(&mut cmd).expect("sluice runs")
    });
    let out = bounded("sluice health", run).await.expect("join");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn ok(stdout: String) -> Out {
    (Some(0), stdout, String::new())
}

fn failed(stderr: String) -> Out {
    (Some(1), String::new(), stderr)
}

fn admin_url(admin: SocketAddr) -> String {
    format!("http://{admin}")
}

const ROUTES: &str = "routes:\n  - {name: hello, match: {path: /hello}, respond: {body: hi}}\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_gateway_is_healthy_and_ready() {
    let gw = start_gateway(ROUTES).await;
    let base = admin_url(gw.admin_addr);
    assert_eq!(
        health(&["--admin", &base]).await,
        ok(format!("{base}/healthz: 200 OK\n"))
    );
    assert_eq!(
        health(&["--admin", &base, "--ready"]).await,
        ok(format!("{base}/readyz: 200 OK\n"))
    );
}

/// Without `--admin`, the address is the configuration's `admin.listen`, as in the
/// Docker image (which names its file in `SLUICE_CONFIG`); `0.0.0.0` is reached on
/// loopback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_address_comes_from_the_configuration() {
    let port = free_port();
    let yaml = format!(
        "admin: {{listen: \"0.0.0.0:{port}\", token: s3cret}}\n\
         server: {{listen: \"127.0.0.1:0\"}}\n{ROUTES}"
    );
    let (gw, file) = start_gateway_file(&yaml).await;
    assert_eq!(gw.admin_addr.port(), port);
    let path = file.path().display().to_string();
    assert_eq!(
        health(&["-c", &path]).await,
        ok(format!("http://127.0.0.1:{port}/healthz: 200 OK\n"))
    );
}

/// A gateway keeps serving the configuration it loaded when its file is saved
/// with a mistake; health asks about the process, so it still finds the listener
/// in the broken file (`routs:`), and says healthy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_saved_with_a_mistake_still_names_the_listener() {
    let port = free_port();
    let yaml = format!("admin: {{listen: \"${{ADMIN_AT:-127.0.0.1:{port}}}\"}}\n{ROUTES}");
    let (gw, file) = start_gateway_file(&yaml).await;
    assert_eq!(gw.admin_addr.port(), port);
    std::fs::write(file.path(), yaml.replace("routes:", "routs:")).unwrap();
    assert!(sluice::config::load(file.path()).is_err());
    let path = file.path().display().to_string();
    assert_eq!(
        health(&["-c", &path]).await,
        ok(format!("http://127.0.0.1:{port}/healthz: 200 OK\n"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_port_is_unhealthy() {
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let refused =
        format!("sluice health: cannot reach the admin API at {base}: connection refused\n");
    assert_eq!(health(&["--admin", &base]).await, failed(refused.clone()));
    assert_eq!(
        health(&["--admin", &base, "--ready"]).await,
        failed(refused)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_that_does_not_load_is_one_line() {
    let out = health(&["-c", "/nonexistent/rules.yaml"]).await;
    assert_eq!(out.0, Some(1), "{out:?}");
    assert_eq!(out.1, "");
    assert!(
        out.2
            .starts_with("sluice health: /nonexistent/rules.yaml: "),
        "{out:?}"
    );
    assert_eq!(out.2.lines().count(), 1, "{out:?}");
}

/// A Redis store whose server is not there: the process is alive (`/healthz` 200)
/// but not ready (`/readyz` 503 once the breaker opens, within about a second of
/// idle PINGs failing), and `--ready` says so with the listener's own reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn not_ready_while_the_store_is_down() {
    let dead = free_port();
    let yaml = format!(
        "store:\n  backend: redis\n  redis: {{url: \"redis://127.0.0.1:{dead}/0\", timeout: 50ms}}\n  on_error: local\n{ROUTES}"
    );
    let gw = start_gateway(&yaml).await;
    let base = admin_url(gw.admin_addr);
    let readyz = url(gw.admin_addr, "/readyz");
    let waited = eventually(BOUND, || async { get(&readyz, &[]).await.status == 503 }).await;
    assert!(waited.is_some(), "/readyz never answered 503");
    assert_eq!(
        health(&["--admin", &base, "--ready"]).await,
        failed(format!(
            "sluice health: {base}/readyz answered 503 Service Unavailable: store unavailable\n"
        ))
    );
    assert_eq!(
        health(&["--admin", &base]).await,
        ok(format!("{base}/healthz: 200 OK\n"))
    );
}
