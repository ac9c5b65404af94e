//! Envoy's rate limit service (`rls:`) of the real binary, called with a gRPC
//! client (tonic, envoy-types' protos): the cases of envoyproxy/ratelimit's own
//! tests (`test/integration/integration_test.go`: basic, another, two descriptors;
//! `test/service/ratelimit_test.go`: unlimited, shadow mode; `replaces` from its
//! README), on the memory store and on Redis, and two instances sharing one count.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{
    Entry, RateLimitOverride,
};
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{
    Code, DescriptorStatus, RateLimit,
};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use tonic::transport::Channel;

use crate::common::redis::{RedisCluster, RedisServer};
use crate::common::*;

const SLUICE: &str = env!("CARGO_BIN_EXE_sluice");

/// envoyproxy/ratelimit's `test/integration/runtime/current/ratelimit/config`
/// files, as they are, and sluice's own cases beside them.
const BASIC: &str = "domain: basic\ndescriptors:\n  - key: key1\n    rate_limit:\n      unit: second\n      requests_per_unit: 50\n\n  - key: key1_local\n    rate_limit:\n      unit: second\n      requests_per_unit: 50\n\n  - key: one_per_minute\n    rate_limit:\n      unit: minute\n      requests_per_unit: 1\n";
const ANOTHER: &str = "domain: another\ndescriptors:\n  - key: key2\n    rate_limit:\n      unit: minute\n      requests_per_unit: 20\n\n  - key: key3\n    rate_limit:\n      unit: hour\n      requests_per_unit: 10\n\n  - key: key4\n    rate_limit:\n      unit: day\n      requests_per_unit: 20\n";
const CASES: &str = "domain: cases\ndescriptors:\n  - key: foo\n    value: bar\n    rate_limit: {unit: minute, requests_per_unit: 10}\n  - key: baz\n    value: qux\n    rate_limit: {unit: second, requests_per_unit: 55, unlimited: false}\n  - key: free\n    rate_limit: {unlimited: true}\n  - key: trial\n    shadow_mode: true\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: strict\n    rate_limit: {unit: minute, requests_per_unit: 2}\n  - key: general\n    rate_limit: {name: general, unit: minute, requests_per_unit: 1}\n  - key: special\n    rate_limit: {unit: minute, requests_per_unit: 5, replaces: [{name: general}]}\n  - key: remote_address\n    rate_limit: {unit: minute, requests_per_unit: 100}\n  - key: api\n    rate_limit: {unit: minute, requests_per_unit: 3, algorithm: sliding_window}\n";

/// One `sluice run` with `rls:`, its stderr collected.
pub struct Rls {
    process: Spawned,
    lines: Lines,
    pub rls: u16,
    pub admin: u16,
    _files: tempfile::TempDir,
}

impl Rls {
    /// An instance on `store` (a `store:` section) with the config files `files`
    /// and `extra` YAML (a `deny:` section) in its rules.yaml.
    pub async fn start(store: &str, files: &[(&str, &str)], extra: &str) -> Rls {
        let dir = tempfile::tempdir().expect("a temp dir");
        let config_dir = dir.path().join("ratelimit");
        std::fs::create_dir(&config_dir).expect("config dir");
        for (name, text) in files {
            std::fs::write(config_dir.join(name), text).expect("a config file");
        }
        let (port, admin, rls) = (free_port(), free_port(), free_port());
        let rules = format!(
            "server: {{listen: \"127.0.0.1:{port}\"}}\nadmin: {{listen: \"127.0.0.1:{admin}\"}}\n{store}\nrls:\n  listen: 127.0.0.1:{rls}\n  config_dir: {}\n  response_headers: true\n{extra}routes: []\n",
            config_dir.display()
        );
        let path = dir.path().join("rules.yaml");
        std::fs::write(&path, rules).expect("rules.yaml");
        Rls::run(&path, dir, rls, admin).await
    }

    async fn run(path: &Path, dir: tempfile::TempDir, rls: u16, admin: u16) -> Rls {
        let (process, lines, _reader) = spawn_logged(
            Command::new(SLUICE)
                .args(["run", "-c"])
                .arg(path)
                .env_remove("SLUICE_CONFIG")
                .env("SLUICE_LOG", "info")
                .stdin(Stdio::null())
                .stdout(Stdio::null()),
        );
        let i = Rls {
            process,
            lines,
            rls,
            admin,
            _files: dir,
        };
        let ready = format!("http://127.0.0.1:{admin}/readyz");
        assert!(
            answers_200(&ready).await,
            "not ready: {:?}",
            i.lines.lock().unwrap()
        );
        i
    }

    pub fn config_dir(&self) -> std::path::PathBuf {
        self._files.path().join("ratelimit")
    }

    pub async fn client(&self) -> RateLimitServiceClient<Channel> {
        let url = format!("http://127.0.0.1:{}", self.rls);
        bounded("rls connect", RateLimitServiceClient::connect(url))
            .await
            .expect("connected")
    }

    /// Stops the process (Envoy then meets a closed port).
    pub fn stop(&mut self) {
        self.process.kill();
    }

    pub async fn metrics(&self) -> String {
        metrics(format!("127.0.0.1:{}", self.admin).parse().unwrap()).await
    }
}

impl Drop for Rls {
    fn drop(&mut self) {
        self.process.kill();
    }
}

/// A request of `domain` with descriptors of `(key, value)` entries and the
/// request's `hits_addend`.
pub fn request(domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors
            .iter()
            .map(|entries| RateLimitDescriptor {
                entries: entries
                    .iter()
                    .map(|(k, v)| Entry {
                        key: k.to_string(),
                        value: v.to_string(),
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        hits_addend: hits,
    }
}

pub async fn call(
    c: &mut RateLimitServiceClient<Channel>,
    req: RateLimitRequest,
) -> RateLimitResponse {
    bounded("ShouldRateLimit", c.should_rate_limit(req))
        .await
        .expect("an answer")
        .into_inner()
}

fn limit(requests_per_unit: u32, unit: i32) -> Option<RateLimit> {
    Some(RateLimit {
        name: String::new(),
        requests_per_unit,
        unit,
    })
}

const SECOND: i32 = 1;
const MINUTE: i32 = 2;
const HOUR: i32 = 3;
const OK: i32 = Code::Ok as i32;
const OVER: i32 = Code::OverLimit as i32;

/// A status as envoyproxy/ratelimit's `newDescriptorStatus` builds it, its
/// duration until reset taken from the answer (checked apart, `reset_is`).
fn status(
    code: i32,
    current: Option<RateLimit>,
    remaining: u32,
    got: &DescriptorStatus,
) -> DescriptorStatus {
    DescriptorStatus {
        code,
        current_limit: current,
        limit_remaining: remaining,
        duration_until_reset: got.duration_until_reset,
        ..Default::default()
    }
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A random value, so a run never meets the counts of another.
fn random() -> String {
    format!(
        "{}",
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            ^ u128::from(std::process::id())
    )
}

/// Away from the end of a wall-clock minute (and so of an hour): waits at most 15 s.
async fn early_in_a_minute() {
    if now_s() % 60 >= 45 {
        at_window_start(std::time::Duration::from_secs(60)).await;
    }
}

/// The ported cases, on the store `store`.
pub async fn ported_cases(store: &str) {
    let node = Rls::start(
        store,
        &[
            ("basic.yaml", BASIC),
            ("another.yaml", ANOTHER),
            ("cases.yaml", CASES),
        ],
        "",
    )
    .await;
    let mut c = node.client().await;
    early_in_a_minute().await;

    // basic: a domain of no file is OK, without a limit.
    let r = call(&mut c, request("foo", &[&[("hello", "world")]], 1)).await;
    assert_eq!(
        r,
        RateLimitResponse {
            overall_code: OK,
            statuses: vec![DescriptorStatus {
                code: OK,
                ..Default::default()
            }],
            ..Default::default()
        }
    );
    let r = call(&mut c, request("basic", &[&[("key1", "foo")]], 1)).await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        r.statuses,
        [status(OK, limit(50, SECOND), 49, &r.statuses[0])]
    );
    assert_eq!(r.statuses[0].duration_until_reset.unwrap().seconds, 1);

    // another: 20 a minute, then OVER_LIMIT.
    let v = random();
    for i in 0..25u32 {
        let before = now_s();
        let r = call(&mut c, request("another", &[&[("key2", &v)]], 1)).await;
        let (code, remaining) = if i >= 20 {
            (OVER, 0)
        } else {
            (OK, 20 - (i + 1))
        };
        assert_eq!(r.overall_code, code, "call {i}");
        assert_eq!(
            r.statuses,
            [status(code, limit(20, MINUTE), remaining, &r.statuses[0])],
            "call {i}"
        );
        if now_s() == before {
            let reset = r.statuses[0].duration_until_reset.unwrap().seconds as u64;
            assert_eq!(reset, 60 - before % 60, "call {i}");
        }
    }

    // Two descriptors of one domain: the second refuses from its 11th call. Its
    // calls are refused whole, so key2 is not charged by them (envoyproxy/ratelimit
    // with STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT; by default it reports 20 - (i+1)).
    let v = random();
    for i in 0..15u32 {
        let r = call(
            &mut c,
            request("another", &[&[("key2", &v)], &[("key3", &v)]], 1),
        )
        .await;
        let (code, remaining1, remaining2) = if i >= 10 {
            (OVER, 10, 0)
        } else {
            (OK, 20 - (i + 1), 10 - (i + 1))
        };
        assert_eq!(r.overall_code, code, "call {i}");
        assert_eq!(
            r.statuses,
            [
                status(OK, limit(20, MINUTE), remaining1, &r.statuses[0]),
                status(code, limit(10, HOUR), remaining2, &r.statuses[1]),
            ],
            "call {i}"
        );
    }

    // Unlimited (TestUnlimited): OK, 4294967295 left, no limit; no rule: OK.
    let r = call(
        &mut c,
        request(
            "cases",
            &[&[("foo", "bar")], &[("hello", "world")], &[("free", "x")]],
            1,
        ),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        r.statuses,
        [
            status(OK, limit(10, MINUTE), 9, &r.statuses[0]),
            DescriptorStatus {
                code: OK,
                ..Default::default()
            },
            DescriptorStatus {
                code: OK,
                limit_remaining: u32::MAX,
                ..Default::default()
            },
        ]
    );

    // Shadow mode (TestMixedRuleShadowMode): over its limit, a shadow descriptor
    // answers OK; the call is OVER_LIMIT only for the enforced one.
    let v = random();
    for i in 0..3u32 {
        let r = call(&mut c, request("cases", &[&[("trial", &v)]], 1)).await;
        let remaining = 2u32.saturating_sub(i + 1);
        assert_eq!(r.overall_code, OK, "call {i}");
        assert_eq!(
            r.statuses,
            [status(OK, limit(2, MINUTE), remaining, &r.statuses[0])],
            "call {i}"
        );
    }
    let r = call(
        &mut c,
        request("cases", &[&[("trial", &v)], &[("strict", &v)]], 1),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
    let r = call(
        &mut c,
        request("cases", &[&[("trial", &v)], &[("strict", &v)]], 1),
    )
    .await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(
        r.statuses,
        [
            status(OK, limit(2, MINUTE), 0, &r.statuses[0]),
            status(OVER, limit(2, MINUTE), 0, &r.statuses[1])
        ]
    );

    // replaces: `special` replaces the limit named `general` in a call that
    // reaches both; alone, `general` applies.
    let v = random();
    let general = Some(RateLimit {
        name: "general".into(),
        requests_per_unit: 1,
        unit: MINUTE,
    });
    for i in 0..3u32 {
        let r = call(
            &mut c,
            request("cases", &[&[("general", &v)], &[("special", &v)]], 1),
        )
        .await;
        assert_eq!(r.overall_code, OK, "call {i}");
        assert_eq!(
            r.statuses,
            [
                DescriptorStatus {
                    code: OK,
                    ..Default::default()
                },
                status(OK, limit(5, MINUTE), 4 - i, &r.statuses[1])
            ],
            "call {i}"
        );
    }
    let r = call(&mut c, request("cases", &[&[("general", &v)]], 1)).await;
    assert_eq!(r.statuses, [status(OK, general.clone(), 0, &r.statuses[0])]);
    let r = call(&mut c, request("cases", &[&[("general", &v)]], 1)).await;
    assert_eq!(r.statuses, [status(OVER, general, 0, &r.statuses[0])]);

    // hits_addend: the request's (0 is 1), and a descriptor's own, which may be 0.
    let v = random();
    let r = call(&mut c, request("cases", &[&[("strict", &v)]], 0)).await;
    assert_eq!(r.statuses[0].limit_remaining, 1);
    let mut req = request("cases", &[&[("strict", &v)]], 1);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    let r = call(&mut c, req).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 1));
    let r = call(&mut c, request("cases", &[&[("strict", &v)]], 2)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OVER, 0));
    let r = call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));

    // The same count twice in a call: charged together, never past the limit.
    let v = random();
    let r = call(
        &mut c,
        request("cases", &[&[("strict", &v)], &[("strict", &v)]], 1),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(
        r.statuses,
        [
            status(OK, limit(2, MINUTE), 0, &r.statuses[0]),
            status(OK, limit(2, MINUTE), 0, &r.statuses[1])
        ]
    );
    let v = random();
    call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
    let r = call(
        &mut c,
        request("cases", &[&[("strict", &v)], &[("strict", &v)]], 1),
    )
    .await;
    assert_eq!(r.overall_code, OVER);
    let r = call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 0));

    // A value with braces (a path template), or a long one, counts as any other.
    for v in [
        format!("/a/{{id}}/{}", random()),
        "x".repeat(300) + &random(),
    ] {
        let mut seen = Vec::new();
        for _ in 0..3 {
            let r = call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
            seen.push((r.overall_code, r.statuses[0].limit_remaining));
        }
        assert_eq!(seen, [(OK, 1), (OK, 0), (OVER, 0)]);
    }

    // A descriptor's `limit` override replaces the configured limit.
    let v = random();
    let mut req = request("cases", &[&[("foo", "bar"), ("user", &v)]], 1);
    req.descriptors[0].limit = Some(RateLimitOverride {
        requests_per_unit: 1,
        unit: HOUR,
    });
    let r = call(&mut c, req.clone()).await;
    assert_eq!(r.statuses, [status(OK, limit(1, HOUR), 0, &r.statuses[0])]);
    let r = call(&mut c, req).await;
    assert_eq!((r.overall_code, r.statuses[0].code), (OVER, OVER));

    // sluice's algorithms: a sliding window of 3 a minute.
    let v = random();
    let codes: Vec<i32> = {
        let mut out = Vec::new();
        for _ in 0..4 {
            out.push(
                call(&mut c, request("cases", &[&[("api", &v)]], 1))
                    .await
                    .overall_code,
            );
        }
        out
    };
    assert_eq!(codes, [OK, OK, OK, OVER]);

    // Response headers: the descriptor closest to its limit.
    let v = random();
    let r = call(
        &mut c,
        request("another", &[&[("key2", &v)], &[("key3", &v)]], 1),
    )
    .await;
    let headers: Vec<(&str, &str)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.as_str(), h.value.as_str()))
        .collect();
    let reset = r.statuses[1]
        .duration_until_reset
        .unwrap()
        .seconds
        .to_string();
    assert_eq!(
        headers,
        [
            ("RateLimit-Limit", "10"),
            ("RateLimit-Remaining", "9"),
            ("RateLimit-Reset", reset.as_str())
        ]
    );

    // Malformed calls are gRPC errors.
    let e = c
        .should_rate_limit(request("", &[&[("a", "b")]], 1))
        .await
        .expect_err("no domain");
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::InvalidArgument,
            "rate limit domain must not be empty"
        )
    );
    let e = c
        .should_rate_limit(request("basic", &[], 1))
        .await
        .expect_err("no descriptors");
    assert_eq!(
        (e.code(), e.message()),
        (
            tonic::Code::InvalidArgument,
            "rate limit descriptor list must not be empty"
        )
    );

    let m = node.metrics().await;
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"over_limit\",domain=\"another\"}"
        ),
        Some(10.0)
    );
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"ok\",domain=\"basic\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"over_limit\",domain=\"basic\"}"
        ),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"error\",domain=\"basic\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(
            &m,
            "sluice_rls_requests_total{code=\"ok\",domain=\"_unknown\"}"
        ),
        Some(1.0)
    );
    assert_eq!(metric(&m, "sluice_rls_descriptors_total{decision=\"over_limit\",descriptor=\"key3\",domain=\"another\"}"), Some(5.0));
    assert_eq!(metric(&m, "sluice_rls_descriptors_total{decision=\"shadow\",descriptor=\"trial\",domain=\"cases\"}"), Some(3.0));
    assert_eq!(metric(&m, "sluice_rls_descriptors_total{decision=\"unlimited\",descriptor=\"free\",domain=\"cases\"}"), Some(1.0));
}

#[tokio::test]
async fn the_ported_cases_on_the_memory_store() {
    ported_cases("store: {backend: memory}").await;
}

#[tokio::test]
async fn the_ported_cases_on_redis() {
    let redis = RedisServer::start();
    ported_cases(&format!(
        "store: {{backend: redis, redis: {{url: \"{}\"}}}}",
        redis.url()
    ))
    .await;
}

#[tokio::test]
async fn the_ported_cases_on_a_redis_cluster() {
    let cluster = RedisCluster::start();
    let urls: Vec<String> = cluster.urls().iter().map(|u| format!("\"{u}\"")).collect();
    ported_cases(&format!(
        "store: {{backend: redis, redis: {{cluster: [{}]}}}}",
        urls.join(", ")
    ))
    .await;
}

#[tokio::test]
async fn two_instances_on_one_redis_share_one_count() {
    let redis = RedisServer::start();
    let store = format!(
        "store: {{backend: redis, redis: {{url: \"{}\"}}}}",
        redis.url()
    );
    let a = Rls::start(&store, &[("another.yaml", ANOTHER)], "").await;
    let b = Rls::start(&store, &[("another.yaml", ANOTHER)], "").await;
    let (mut ca, mut cb) = (a.client().await, b.client().await);
    early_in_a_minute().await;
    let v = random();
    let mut seen = Vec::new();
    for i in 0..24 {
        let c = if i % 2 == 0 { &mut ca } else { &mut cb };
        let r = call(c, request("another", &[&[("key2", &v)]], 1)).await;
        seen.push((r.overall_code, r.statuses[0].limit_remaining));
    }
    let expected: Vec<(i32, u32)> = (0..24u32)
        .map(|i| if i < 20 { (OK, 19 - i) } else { (OVER, 0) })
        .collect();
    assert_eq!(seen, expected);
}

#[tokio::test]
async fn the_deny_list_refuses_an_address_or_a_key_from_its_first_call() {
    let node = Rls::start(
        "store: {backend: memory}",
        &[("cases.yaml", CASES)],
        "deny:\n  ips: [198.51.100.7]\n  keys: [leaked-key-123]\n",
    )
    .await;
    let mut c = node.client().await;
    early_in_a_minute().await;
    let v = random();
    // A denied address: refused, and the other descriptor of the call not charged.
    let r = call(
        &mut c,
        request(
            "cases",
            &[&[("remote_address", "198.51.100.7")], &[("strict", &v)]],
            1,
        ),
    )
    .await;
    assert_eq!(r.overall_code, OVER);
    assert_eq!(
        r.statuses,
        [
            status(OVER, limit(100, MINUTE), 0, &r.statuses[0]),
            status(OK, limit(2, MINUTE), 2, &r.statuses[1])
        ]
    );
    let r = call(
        &mut c,
        request(
            "cases",
            &[&[("remote_address", "198.51.100.8")], &[("strict", &v)]],
            1,
        ),
    )
    .await;
    assert_eq!(r.overall_code, OK);
    assert_eq!(r.statuses[1].limit_remaining, 1);
    // A denied key in any entry, of a domain with no file too.
    let r = call(
        &mut c,
        request("nowhere", &[&[("api_key", "leaked-key-123")]], 1),
    )
    .await;
    assert_eq!(r.overall_code, OVER);
    let top = get(
        &format!("http://127.0.0.1:{}/admin/top?route=rls:cases", node.admin),
        &[],
    )
    .await;
    assert_eq!(top.status, 200, "{}", top.text());
    let rows: serde_json::Value = serde_json::from_slice(&top.body).unwrap();
    assert_eq!(rows[0]["key"], "198.51.100.7");
    assert_eq!(rows[0]["ip"], "198.51.100.7");
    assert_eq!(rows[0]["refused"], 1);
    // Denied from /admin/top's key through the admin API: the next call with that
    // value is refused.
    let r = call(&mut c, request("cases", &[&[("strict", &v)]], 1)).await;
    assert_eq!(r.overall_code, OK);
    let admin = format!("http://127.0.0.1:{}/admin/deny", node.admin);
    let added = http1()
        .send(
            http::Method::POST,
            &admin,
            &[("content-type", "application/json")],
            format!("{{\"key\": \"{v}\"}}"),
        )
        .await;
    assert_eq!(added.status, 201, "{}", added.text());
    let denied = eventually(BOUND, || {
        let (mut c, req) = (c.clone(), request("cases", &[&[("strict", &v)]], 1));
        async move { call(&mut c, req).await.overall_code == OVER }
    })
    .await;
    assert!(denied.is_some());
}

#[tokio::test]
async fn a_changed_file_is_reloaded_with_the_counts_kept_and_a_bad_one_changes_nothing() {
    let node = Rls::start("store: {backend: memory}", &[("another.yaml", ANOTHER)], "").await;
    let mut c = node.client().await;
    early_in_a_minute().await;
    let v = random();
    for _ in 0..5 {
        call(&mut c, request("another", &[&[("key2", &v)]], 1)).await;
    }
    let file = node.config_dir().join("another.yaml");
    std::fs::write(
        &file,
        ANOTHER.replace("requests_per_unit: 20", "requests_per_unit: 8"),
    )
    .unwrap();
    // Calls that only look: a descriptor's hits_addend 0 charges nothing.
    let look = || {
        let mut r = request("another", &[&[("key2", &v)]], 1);
        r.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
        r
    };
    let reloaded = eventually(BOUND, || {
        let (mut c, req) = (c.clone(), look());
        async move {
            let r = call(&mut c, req).await;
            r.statuses[0]
                .current_limit
                .as_ref()
                .is_some_and(|l| l.requests_per_unit == 8)
        }
    })
    .await;
    assert!(reloaded.is_some(), "not reloaded");
    // The 5 calls counted before the reload count against the new 8.
    let r = call(&mut c, look()).await;
    assert_eq!((r.overall_code, r.statuses[0].limit_remaining), (OK, 3));
    std::fs::write(
        &file,
        "domain: another\ndescriptors:\n  - key: key2\n    rate_limit: {unit: fortnight}\n",
    )
    .unwrap();
    let failed = eventually(BOUND, || async {
        metric(
            &node.metrics().await,
            "sluice_config_reloads_total{result=\"failure\"}",
        ) == Some(1.0)
    })
    .await;
    assert!(failed.is_some());
    let r = call(&mut c, look()).await;
    assert_eq!(r.statuses[0].current_limit, limit(8, MINUTE));
    // POST /admin/reload reads the folder too, and says where it is wrong.
    let reload = format!("http://127.0.0.1:{}/admin/reload", node.admin);
    let r = http1()
        .send(http::Method::POST, &reload, &[], bytes::Bytes::new())
        .await;
    let body: serde_json::Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        (r.status, body),
        (
            422,
            serde_json::json!({"result": "failure", "error": format!("{}:4:24: invalid rate limit unit 'fortnight': expected second, minute, hour, day, week, month or year", file.display())})
        )
    );
}

#[tokio::test]
async fn check_lists_the_domains_and_says_where_a_file_is_wrong() {
    let dir = tempfile::tempdir().unwrap();
    let rl = dir.path().join("rl");
    std::fs::create_dir(&rl).unwrap();
    std::fs::write(rl.join("basic.yaml"), BASIC).unwrap();
    std::fs::write(rl.join("another.yaml"), ANOTHER).unwrap();
    let rules = dir.path().join("rules.yaml");
    std::fs::write(
        &rules,
        format!(
            "rls:\n  listen: 127.0.0.1:8081\n  config_dir: {}\nroutes: []\n",
            rl.display()
        ),
    )
    .unwrap();
    let out = run_grouped(Command::new(SLUICE).args(["check", "-c"]).arg(&rules)).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rls: Vec<&str> = stdout
        .lines()
        .skip_while(|l| !l.starts_with("rls "))
        .collect();
    assert_eq!(
        rls,
        [
            format!(
                "rls     127.0.0.1:8081 (gRPC, h2c), 2 domains in {}",
                rl.display()
            ),
            format!(
                "  another ({}): 3 limits",
                rl.join("another.yaml").display()
            ),
            format!("  basic ({}): 3 limits", rl.join("basic.yaml").display()),
        ]
    );
    std::fs::write(
        rl.join("basic.yaml"),
        "domain: basic\ndescriptors:\n  - key: key1\n    rate_limits: {unit: second}\n",
    )
    .unwrap();
    let out = run_grouped(Command::new(SLUICE).args(["check", "-c"]).arg(&rules)).unwrap();
    assert!(!out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        format!("{}:4:5: descriptors[0]: unknown field `rate_limits`, expected one of `key`, `value`, `rate_limit`, `descriptors`, `shadow_mode`, `detailed_metric`, `share_threshold`", rl.join("basic.yaml").display())
    );
}

#[tokio::test]
async fn a_call_of_three_descriptors_is_one_store_call() {
    let redis = RedisServer::start();
    let store = format!(
        "store: {{backend: redis, redis: {{url: \"{}\"}}}}",
        redis.url()
    );
    let node = Rls::start(&store, &[("another.yaml", ANOTHER)], "").await;
    let mut c = node.client().await;
    early_in_a_minute().await;
    let v = random();
    let three: &[&[(&str, &str)]] = &[&[("key2", &v)], &[("key3", &v)], &[("key4", &v)]];
    // The first call may load the script (SCRIPT LOAD and EVALSHA again).
    call(&mut c, request("another", three, 1)).await;
    let before = redis.calls("evalsha");
    for _ in 0..5 {
        let r = call(&mut c, request("another", three, 1)).await;
        assert_eq!(r.overall_code, OK);
    }
    assert_eq!(redis.calls("evalsha") - before, 5);
    // Descriptors of no limit ask the store nothing.
    call(&mut c, request("another", &[&[("nothing", "x")]], 1)).await;
    assert_eq!(redis.calls("evalsha") - before, 5);
}

#[tokio::test]
async fn a_failed_store_answers_as_on_error_says() {
    let mut redis = RedisServer::start();
    let store = |on_error: &str| {
        format!(
            "store: {{backend: redis, redis: {{url: \"{}\", timeout: 100ms}}, on_error: {on_error}}}",
            redis.url()
        )
    };
    let files = [("cases.yaml", CASES)];
    let allow = Rls::start(&store("allow"), &files, "").await;
    let deny = Rls::start(&store("deny"), &files, "").await;
    let local = Rls::start(&store("local"), &files, "").await;
    let (mut ca, mut cd, mut cl) = (
        allow.client().await,
        deny.client().await,
        local.client().await,
    );
    // `local` divides each limit by the live instances its fleet view saw last
    // (degraded mode): here the three, once it has seen them. (`live` is counted
    // when the view is asked for; `divided_by` is what the store was last told,
    // once a second.)
    let admin = format!("127.0.0.1:{}", local.admin).parse().unwrap();
    let seen = eventually(std::time::Duration::from_secs(10), || async {
        let a = crate::common::redis::get(admin, "/admin/fleet", &[]).await;
        serde_json::from_str::<serde_json::Value>(&a.body)
            .is_ok_and(|v| v["live"] == 3 && v["divided_by"] == 3)
    })
    .await;
    assert!(
        seen.is_some(),
        "the local instance never saw three live instances"
    );
    early_in_a_minute().await;
    redis.kill();
    let v = random();
    let strict = || request("cases", &[&[("strict", &v)], &[("hello", "world")]], 1);
    // allow: OK, no limit reported; deny: OVER_LIMIT for the limited descriptor.
    let r = call(&mut ca, strict()).await;
    let ok = DescriptorStatus {
        code: OK,
        ..Default::default()
    };
    assert_eq!(
        (r.overall_code, r.statuses.clone()),
        (OK, vec![ok.clone(), ok.clone()])
    );
    let r = call(&mut cd, strict()).await;
    let over = DescriptorStatus {
        code: OVER,
        current_limit: limit(2, MINUTE),
        ..Default::default()
    };
    assert_eq!((r.overall_code, r.statuses.clone()), (OVER, vec![over, ok]));
    // local: this instance's memory decides, with its share of the limit of 2 a
    // minute: ceil(2 / 3) = 1.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let r = call(&mut cl, strict()).await;
        seen.push((r.overall_code, r.statuses[0].limit_remaining));
    }
    assert_eq!(seen, [(OK, 0), (OVER, 0), (OVER, 0)]);
    let errors = |m: &str| {
        metric(
            m,
            "sluice_rls_requests_total{code=\"error\",domain=\"cases\"}",
        )
    };
    assert_eq!(errors(&allow.metrics().await), Some(1.0));
    assert_eq!(errors(&deny.metrics().await), Some(1.0));
    assert_eq!(errors(&local.metrics().await), Some(0.0));
}
