//! `rediss://`: the Redis store over TLS, against a `redis-server` with a TLS port and
//! a self-signed certificate that this test process trusts through `SSL_CERT_FILE`
//! (read by the system roots loader). One test in its own binary, so setting the
//! environment cannot race another test.

#[path = "common/redis.rs"]
mod harness;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::{free_port, spawn_grouped};
use sluice::limit::{Algorithm, LimitDef, Mode, Plan, RedisOptions, RedisStore, RedisTarget};

#[test]
fn the_store_works_over_rediss() {
    let cert =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).expect("certificate");
    let dir = tempfile::tempdir().expect("temp dir");
    let (cert_file, key_file) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_file, cert.cert.pem()).expect("write cert");
    std::fs::write(&key_file, cert.signing_key.serialize_pem()).expect("write key");
    std::env::set_var("SSL_CERT_FILE", &cert_file);

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
            .arg(dir.path())
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
