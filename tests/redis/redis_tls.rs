//! `rediss://`: the Redis store over TLS, against a `redis-server` with a TLS port and
//! a self-signed certificate that the store trusts through `SSL_CERT_FILE` (read by
//! the system roots loader). The test runs itself again in a child process started
//! with that variable, so that no test of this binary sees the environment change.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{free_port, run_grouped, spawn_grouped, test_name};
use sluice::limit::{Algorithm, LimitDef, Mode, Plan, RedisOptions, RedisStore, RedisTarget};

/// Set in the child process: the directory holding `cert.pem` and `key.pem`.
const CHILD: &str = "SLUICE_TEST_REDIS_TLS_DIR";

#[test]
fn the_store_works_over_rediss() {
    if let Some(dir) = std::env::var_os(CHILD) {
        return over_rediss(Path::new(&dir));
    }
    let cert =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
    let dir = tempfile::tempdir().expect("temp dir");
    let cert_file = dir.path().join("cert.pem");
    std::fs::write(&cert_file, cert.cert.pem()).expect("write cert");
    std::fs::write(dir.path().join("key.pem"), cert.signing_key.serialize_pem())
        .expect("write key");

    let name = test_name(module_path!(), "the_store_works_over_rediss");
    let out = run_grouped(
        Command::new(std::env::current_exe().expect("test binary"))
            .args([name.as_str(), "--exact", "--nocapture", "--test-threads=1"])
            .env("SSL_CERT_FILE", &cert_file)
            .env(CHILD, dir.path()),
    )
    .expect("run the test in a child process");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 1 passed"),
        "{name} in its own process: {}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The test itself, in the child process, which trusts the certificate in `dir`.
fn over_rediss(dir: &Path) {
    let (cert_file, key_file) = (dir.join("cert.pem"), dir.join("key.pem"));
    let port = free_port();
    let _redis = spawn_grouped(
        Command::new("redis-server")
            .args([
                "--port",
                "0",
                "--tls-port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args([
                "--save",
                "",
                "--appendonly",
                "no",
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(&cert_file)
            .arg("--tls-key-file")
            .arg(&key_file)
            .arg("--tls-ca-cert-file")
            .arg(&cert_file)
            .arg("--dir")
            .arg(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    )
    .expect("redis-server runs");
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "redis-server TLS port never opened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let store = rt
        .block_on(RedisStore::connect(RedisOptions {
            target: RedisTarget::Url(format!("rediss://localhost:{port}")),
            timeout: Duration::from_secs(2),
            key_prefix: "sluice:".into(),
            refusal_cache: 0,
        }))
        .expect("store");
    assert!(store.ready(), "the script did not load over TLS");
    let plan = Plan {
        limits: vec![LimitDef::new(
            "l".into(),
            Algorithm::SlidingLog {
                limit: 3,
                window_us: 3_600_000_000,
            },
            1,
        )],
        mode: Mode::Reject,
    };
    let admitted: Vec<bool> = (0..5)
        .map(|_| {
            rt.block_on(store.check("tls", "k", &plan))
                .expect("answer over TLS")
                .allowed
        })
        .collect();
    assert_eq!(admitted, [true, true, true, false, false]);
}
