//! The gateway's decisions end to end: limits and their headers, routing, client
//! keys and addresses, the deny list and body limits, each checked through real
//! sockets with exact statuses, header values and metric lines. The tests that
//! involve the limiter or the deny list run twice, with the same assertions: on
//! the memory store (`on_memory::`) and on a real redis-server (`on_redis::`).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use crate::common;
use crate::common::*;
use http::Method;
use tokio::io::AsyncWriteExt;

// === both stores ===

/// Where a gateway keeps its limits.
#[derive(Clone)]
pub(crate) enum Store {
    Memory,
    /// This module's one redis-server, under a key prefix of the test's own (so
    /// neither limits nor the shared deny list of one test reach another).
    Redis {
        prefix: String,
    },
}

impl Store {
    pub(crate) fn redis(test: &str) -> Store {
        Store::Redis {
            prefix: format!("{test}:"),
        }
    }

    /// `yaml` on this store (a `store:` section added for Redis; `on_error: deny`,
    /// so a store failure shows as a 503 no test expects).
    fn yaml(&self, yaml: &str) -> String {
        match self {
            Store::Memory => yaml.to_string(),
            Store::Redis { prefix } => format!(
                "store:\n  backend: redis\n  redis: {{url: \"{}\", timeout: 2s, key_prefix: \"{prefix}\"}}\n  on_error: deny\n{yaml}",
                shared_redis().url()
            ),
        }
    }

    /// The `store` label of its metrics.
    fn label(&self) -> &'static str {
        match self {
            Store::Memory => "memory",
            Store::Redis { .. } => "redis",
        }
    }

    pub(crate) async fn start(&self, yaml: &str) -> Running {
        start_gateway(&self.yaml(yaml)).await
    }

    /// `start`, the limiter's time driven by `clock`.
    async fn start_at(&self, yaml: &str, clock: Arc<sluice::limit::ManualClock>) -> Running {
        start_gateway_at(&self.yaml(yaml), clock).await
    }

    async fn start_file(&self, yaml: &str) -> (Running, tempfile::NamedTempFile) {
        start_gateway_file(&self.yaml(yaml)).await
    }
}

/// One redis-server for every test of this module, started by the first that needs
/// it (killed when the process ends: see `common::spawn_grouped`).
fn shared_redis() -> &'static common::redis::RedisServer {
    static SERVER: OnceLock<common::redis::RedisServer> = OnceLock::new();
    SERVER.get_or_init(common::redis::RedisServer::start)
}

/// Each named `async fn NAME(store: Store)` becomes two tests, `on_memory::NAME`
/// and `on_redis::NAME` (as linkerd's transparency tests run one suite per
/// protocol).
macro_rules! on_both_stores {
    ($($test:ident),* $(,)?) => {
        mod on_memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Store::Memory).await
                }
            )*
        }

        mod on_redis {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    super::$test(super::Store::redis(stringify!($test))).await
                }
            )*
        }
    };
}

on_both_stores!(
    fixed_window_admits_exactly_the_limit_then_429_with_headers,
    concurrent_requests_admit_exactly_the_limit,
    a_refused_request_charges_no_limit,
    overrides_give_named_keys_their_own_limits,
    shadow_counts_but_never_refuses,
    a_limit_on_trial_counts_its_refusals_and_the_other_limits_still_refuse,
    a_login_is_limited_per_address_and_per_account_at_once,
    only_failed_logins_count_and_three_refusals_ban,
    a_token_budget_is_charged_what_the_response_says,
    a_monthly_limit_counts_down_to_00_00_utc_on_the_first,
    delay_waits_for_capacity_up_to_max_delay,
    concurrent_delayed_requests_queue_one_after_another,
    every_algorithm_admits_its_quota_then_refuses,
    each_key_kind_has_its_own_budgets,
    x_forwarded_for_is_ignored_from_untrusted_peers,
    x_forwarded_for_from_a_trusted_proxy_names_the_client,
    denied_addresses_get_the_configured_status_everywhere,
    denied_requests_are_not_charged,
    denied_keys_get_403_and_only_they,
    reload_keeps_unchanged_limits_and_survives_a_bad_file,
    a_shadow_route_never_delays,
    a_client_gone_while_delayed_is_still_counted,
);

const FIXED_5_PER_2S: &str = r#"
routes:
  - name: hello
    match: {path: /hello}
    key: ip
    limits:
      - {name: per_ip, algorithm: fixed_window, limit: 5, window: 2s}
    respond: {status: 200, body: "hi\n"}
"#;

// === limits and their headers ===

async fn fixed_window_admits_exactly_the_limit_then_429_with_headers(store: Store) {
    let gw = store.start(FIXED_5_PER_2S).await;
    let c = http1();
    let u = url(gw.addr, "/hello");
    at_window_start(Duration::from_secs(2)).await;

    for left in [4, 3, 2, 1, 0] {
        let r = c.get(&u, &[]).await;
        assert_eq!(r.status, 200);
        assert_eq!(r.text(), "hi\n");
        assert_eq!(r.header("x-ratelimit-limit"), Some("5"));
        assert_eq!(r.num("x-ratelimit-remaining"), left);
        assert_eq!(r.header("ratelimit-policy"), Some(r#""per_ip";q=5;w=2"#));
        assert!(r
            .header("ratelimit")
            .unwrap()
            .starts_with(&format!(r#""per_ip";r={left};t="#)));
    }
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 429);
    let retry = r.num("retry-after");
    assert!((1..=2).contains(&retry), "Retry-After {retry}");
    assert!(
        r.text().contains("per_ip") && r.text().contains("hello"),
        "{}",
        r.text()
    );
    assert_eq!(r.header("ratelimit-policy"), Some(r#""per_ip";q=5;w=2"#));
    let rl = r.header("ratelimit").unwrap();
    let t: u64 = rl
        .strip_prefix(r#""per_ip";r=0;t="#)
        .unwrap_or_else(|| panic!("RateLimit: {rl}"))
        .parse()
        .unwrap();
    assert!((1..=2).contains(&t), "RateLimit: {rl}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("5"));
    assert_eq!(r.header("x-ratelimit-remaining"), Some("0"));
    let reset = r.num("x-ratelimit-reset");
    assert!((1..=2).contains(&reset), "X-RateLimit-Reset {reset}");

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "hello"), [("allowed", 5.0), ("limited", 1.0)]);
    assert_eq!(
        metric(
            &m,
            r#"sluice_request_duration_seconds_count{route="hello"}"#
        ),
        Some(6.0)
    );
    let limiter = format!(
        r#"sluice_limiter_duration_seconds_count{{store="{}"}}"#,
        store.label()
    );
    assert_eq!(metric(&m, &limiter), Some(6.0));
}

#[tokio::test]
async fn response_headers_choose_the_families() {
    let none = start_gateway(&format!("response_headers: []\n{FIXED_5_PER_2S}")).await;
    let x_only = start_gateway(&format!(
        "response_headers: [x-ratelimit]\n{FIXED_5_PER_2S}"
    ))
    .await;
    let ietf_only = start_gateway(&format!("response_headers: [ietf]\n{FIXED_5_PER_2S}")).await;
    let c = http1();
    for _ in 0..6 {
        let r = c.get(&url(none.addr, "/hello"), &[]).await;
        assert!(r.rate_headers().is_empty(), "{:?}", r.headers);
    }
    let r = c.get(&url(x_only.addr, "/hello"), &[]).await;
    assert_eq!(
        r.rate_headers(),
        [
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset"
        ]
    );
    let r = c.get(&url(ietf_only.addr, "/hello"), &[]).await;
    assert_eq!(r.rate_headers(), ["ratelimit", "ratelimit-policy"]);
}

async fn concurrent_requests_admit_exactly_the_limit(store: Store) {
    const N: usize = 300;
    let up = upstream().await;
    let gw = store
        .start(
            &r#"
server: {listen: "127.0.0.1:0", max_connections_per_ip: 1000}
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: api
    match: {path_prefix: /}
    upstream: api
    key: ip
    limits:
      - {name: hundred, algorithm: sliding_log, limit: 100, window: 1m}
"#
            .replace("UP", &up.url()),
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/burst");
    // Every task waits at the barrier, so all 300 are in flight together.
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let tasks: Vec<_> = (0..N)
        .map(|_| {
            let (c, u, barrier) = (c.clone(), u.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                c.get(&u, &[]).await.status
            })
        })
        .collect();
    let mut ok = 0;
    let mut limited = 0;
    for t in tasks {
        match t.await.unwrap() {
            200 => ok += 1,
            429 => limited += 1,
            s => panic!("unexpected status {s}"),
        }
    }
    assert_eq!((ok, limited), (100, 200));
    assert_eq!(up.hits(), 100);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "api"),
        [("allowed", 100.0), ("limited", 200.0)]
    );
}

async fn a_refused_request_charges_no_limit(store: Store) {
    // `a` refuses often and resets every 2 s; `b` would run out at once if the
    // requests `a` refuses were charged to it.
    let gw = store
        .start(
            r#"
routes:
  - name: two
    match: {path: /two}
    key: ip
    limits:
      - {name: a, algorithm: fixed_window, limit: 2, window: 2s}
      - {name: b, algorithm: sliding_log, limit: 4, window: 1m}
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/two");
    at_window_start(Duration::from_secs(2)).await;
    for left in [1, 0] {
        let r = c.get(&u, &[]).await;
        assert_eq!(r.status, 200);
        // The headline is the limit closest to refusing: `a`.
        assert_eq!(
            (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")),
            (2, left)
        );
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(r#""a";q=2;w=2, "b";q=4;w=60"#)
        );
    }
    for _ in 0..5 {
        let r = c.get(&u, &[]).await;
        assert_eq!(r.status, 429);
        assert!(
            r.text().starts_with(r#"rate limit "a" of route "two""#),
            "{}",
            r.text()
        );
    }

    at_window_start(Duration::from_secs(2)).await;
    // `b` has exactly 2 left: the 5 refusals cost it nothing.
    for left in [1, 0] {
        let r = c.get(&u, &[]).await;
        assert_eq!(r.status, 200);
        // Tie on remaining: the limit that takes longer to reset, `b`.
        assert_eq!(
            (r.num("x-ratelimit-limit"), r.num("x-ratelimit-remaining")),
            (4, left)
        );
    }
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 429);
    // Both refuse; the one with the longer wait is reported.
    assert!(
        r.text().starts_with(r#"rate limit "b" of route "two""#),
        "{}",
        r.text()
    );
    let retry = r.num("retry-after");
    assert!((50..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.header("x-ratelimit-limit"), Some("4"));

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "two"), [("allowed", 4.0), ("limited", 6.0)]);
}

async fn overrides_give_named_keys_their_own_limits(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: tiers
    match: {path: /tiers}
    key: header:x-api-key
    limits: [{name: base, algorithm: sliding_log, limit: 2, window: 1m}]
    overrides:
      - keys: [premium]
        limits: [{name: base, algorithm: sliding_log, limit: 4, window: 1m}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/tiers");
    assert_eq!(
        statuses(&c, 3, &u, &[("x-api-key", "basic")]).await,
        ok_then_limited(2, 1)
    );
    let r = c.get(&u, &[("x-api-key", "premium")]).await;
    assert_eq!(
        (
            r.status,
            r.num("x-ratelimit-limit"),
            r.num("x-ratelimit-remaining")
        ),
        (200, 4, 3)
    );
    assert_eq!(r.header("ratelimit-policy"), Some(r#""base";q=4;w=60"#));
    assert_eq!(
        statuses(&c, 4, &u, &[("x-api-key", "premium")]).await,
        ok_then_limited(3, 1)
    );
}

async fn shadow_counts_but_never_refuses(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: shadowed
    match: {path: /s}
    key: ip
    shadow: true
    limits: [{name: s, algorithm: sliding_log, limit: 2, window: 1m}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    for _ in 0..5 {
        let r = c.get(&url(gw.addr, "/s"), &[]).await;
        assert_eq!(r.status, 200);
        assert!(r.rate_headers().is_empty(), "{:?}", r.headers);
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "shadowed"),
        [("allowed", 2.0), ("shadow", 3.0)]
    );
}

/// `shadow: true` on one limit: its refusals are counted as `shadow` and refuse
/// nothing; the route's other limit still refuses, and alone is announced in the
/// rate-limit headers. (That it is charged only by the requests it admits is held
/// by the shared cases, `limit::cases`, on both stores.)
async fn a_limit_on_trial_counts_its_refusals_and_the_other_limits_still_refuse(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: login
    match: {path: /login}
    key: ip
    limits:
      - {name: per_ip, algorithm: sliding_log, limit: 4, window: 1m}
      - {name: strict, algorithm: sliding_log, limit: 1, window: 1m, shadow: true}
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let mut got = Vec::new();
    for _ in 0..6 {
        let r = c.get(&url(gw.addr, "/login"), &[]).await;
        assert_eq!(
            r.header("ratelimit-policy"),
            Some(r#""per_ip";q=4;w=60"#),
            "the trial is not announced"
        );
        got.push((
            r.status,
            r.header("x-ratelimit-remaining").map(str::to_string),
        ));
    }
    let left = |n: &str| Some(n.to_string());
    assert_eq!(
        got,
        [
            (200, left("3")),
            (200, left("2")),
            (200, left("1")),
            (200, left("0")),
            (429, left("0")),
            (429, left("0")),
        ]
    );
    let m = metrics(gw.admin_addr).await;
    // The first request: both admitted. The next three: the trial refused. The
    // last two: per_ip refused (limited, whatever the trial said).
    assert_eq!(
        decisions(&m, "login"),
        [("allowed", 1.0), ("limited", 2.0), ("shadow", 3.0)]
    );
}

/// Credential stuffing, both ways, on one route: `per_ip` counts the address,
/// `per_account` the account (`key` on the limit). One address trying many
/// accounts is stopped by the first, many addresses trying one account by the
/// second. A request refused by either charges neither; the ban denies the key of
/// the limit that refused: the address, or the account.
async fn a_login_is_limited_per_address_and_per_account_at_once(store: Store) {
    let up = upstream().await;
    let gw = store
        .start(
            &r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: login
    match: {path: /login}
    upstream: api
    key: ip
    limits:
      - {name: per_ip, algorithm: sliding_log, limit: 5, window: 1m}
      - {name: per_account, key: "header:x-user", algorithm: sliding_log, limit: 3, window: 1m}
    ban: {after: 2, within: 1m, for: 1m}
"#
            .replace("UP", &up.url()),
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/login");
    let login = |ip: &'static str, user: String| {
        let (c, u) = (&c, &u);
        async move {
            let r = c
                .get(u, &[("x-forwarded-for", ip), ("x-user", &user)])
                .await;
            (r.status, r.header("x-ratelimit-limit").map(str::to_string))
        }
    };
    let limit = |n: &str| Some(n.to_string());

    // One address, seven accounts: five pass, then per_ip refuses. The headers
    // speak of the limit with the fewest left (per_account's 2 until per_ip's 2;
    // on a tie, the first).
    let mut got = Vec::new();
    for i in 1..=7 {
        got.push(login("192.0.2.1", format!("user{i}")).await);
    }
    #[rustfmt::skip]
    assert_eq!(got, [
        (200, limit("3")), (200, limit("3")), (200, limit("5")), (200, limit("5")),
        (200, limit("5")), (429, limit("5")), (429, limit("5")),
    ]);
    assert_eq!(up.hits(), 5);
    // Two refusals by per_ip: the address is banned, whatever account it names.
    let banned = eventually(Duration::from_secs(2), || async {
        login("192.0.2.1", "user9".into()).await.0 == 403
    });
    assert!(banned.await.is_some(), "the address is banned");
    // The accounts it refused were charged nothing: user6 has all three.
    for ip in ["198.51.100.1", "198.51.100.2", "198.51.100.3"] {
        assert_eq!(login(ip, "user6".into()).await.0, 200);
    }
    assert_eq!(up.hits(), 8);

    // Five addresses, one account: three pass, then per_account refuses.
    let mut got = Vec::new();
    for ip in [
        "203.0.113.1",
        "203.0.113.2",
        "203.0.113.3",
        "203.0.113.4",
        "203.0.113.5",
    ] {
        got.push(login(ip, "victim".into()).await);
    }
    #[rustfmt::skip]
    assert_eq!(got, [
        (200, limit("3")), (200, limit("3")), (200, limit("3")),
        (429, limit("3")), (429, limit("3")),
    ]);
    assert_eq!(up.hits(), 11);
    // The account is banned, from any address; the addresses it refused are not, and
    // were charged nothing: 203.0.113.4 still has all five.
    let banned = eventually(Duration::from_secs(2), || async {
        login("203.0.113.9", "victim".into()).await.0 == 403
    });
    assert!(banned.await.is_some(), "the account is banned");
    let mut got = Vec::new();
    for i in 1..=6 {
        got.push(login("203.0.113.4", format!("other{i}")).await.0);
    }
    assert_eq!(got, [200, 200, 200, 200, 200, 429]);
    assert_eq!(up.hits(), 16);
    // A request without the account's header: 400, naming it.
    let r = c.get(&u, &[("x-forwarded-for", "192.0.2.77")]).await;
    assert_eq!(r.status, 400);
    assert!(r.text().contains("x-user"), "{}", r.text());
}

/// `count: {status: [...]}`: only answers with a listed status count, charged when
/// they arrive; once the count is reached the limit refuses before forwarding, and
/// its refusals count toward the ban like any other: "5 failed logins in 15
/// minutes, three such refusals and the address is out for a day", here with 3.
async fn only_failed_logins_count_and_three_refusals_ban(store: Store) {
    let up = upstream().await;
    let gw = store
        .start(
            &r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: login
    match: {path: /login}
    upstream: api
    key: ip
    limits:
      - {name: failures, algorithm: sliding_log, limit: 3, window: 15m, count: {status: [401, 403, "5xx"]}}
    ban: {after: 3, within: 1h, for: 1d}
"#
            .replace("UP", &up.url()),
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/login");
    let login = |ip: &'static str, answer: &'static str| {
        let (c, u) = (&c, &u);
        async move {
            let r = c
                .get(u, &[("x-forwarded-for", ip), ("x-reply-status", answer)])
                .await;
            (
                r.status,
                r.header("x-ratelimit-remaining").map(str::to_string),
            )
        }
    };
    let left = |n: &str| Some(n.to_string());
    // Successes and other failures count nothing; 401, 403 and 5xx do.
    let mut got = Vec::new();
    for answer in ["200", "200", "404", "401", "200", "503", "403"] {
        got.push(login("192.0.2.1", answer).await);
    }
    #[rustfmt::skip]
    assert_eq!(got, [
        (200, left("2")), (200, left("2")), (404, left("2")), (401, left("2")),
        (200, left("1")), (503, left("1")), (403, left("0")),
    ]);
    assert_eq!(up.hits(), 7);
    // Three failures: refused before forwarding, whatever the request.
    let mut got = Vec::new();
    for answer in ["200", "200"] {
        got.push(login("192.0.2.1", answer).await);
    }
    assert_eq!(got, [(429, left("0")), (429, left("0"))]);
    assert_eq!(
        up.hits(),
        7,
        "the requests after the third failure never reach the upstream"
    );
    // Another address is untouched.
    assert_eq!(login("192.0.2.2", "401").await, (401, left("2")));
    // The third refusal bans the address.
    assert_eq!(login("192.0.2.1", "200").await.0, 429);
    let banned = eventually(Duration::from_secs(2), || async {
        login("192.0.2.1", "200").await.0 == 403
    });
    assert!(banned.await.is_some(), "three refusals ban the address");
    assert_eq!(up.hits(), 8);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(metric(&m, r#"sluice_bans_total{route="login"}"#), Some(1.0));
}

/// `cost: {response_header, default}`: the upstream's header says what the request
/// cost, charged when the answer arrives. Before forwarding the limit admits while
/// one unit is left, so the last request can overdraw the budget; the requests after
/// it are refused until it is paid back. A huge value is capped at the limit's
/// quota, a missing or malformed one charges the default, and
/// `sluice_response_costs_total` counts each case.
async fn a_token_budget_is_charged_what_the_response_says(store: Store) {
    let up = upstream().await;
    let gw = store
        .start(
            &r#"
upstreams:
  api: {targets: ["UP"]}
routes:
  - name: llm
    match: {path: /llm}
    upstream: api
    key: header:x-api-key
    limits:
      - {name: tokens, algorithm: token_bucket, rate: 1000/d, burst: 1000, cost: {response_header: x-usage-tokens, default: 50}}
"#
            .replace("UP", &up.url()),
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/llm");
    let call = |key: &'static str, used: Option<&'static str>| {
        let (c, u) = (&c, &u);
        async move {
            let reply = used.map(|n| format!("x-usage-tokens={n}"));
            let mut headers = vec![("x-api-key", key)];
            if let Some(h) = &reply {
                headers.push(("x-reply-header", h));
            }
            let r = c.get(u, &headers).await;
            (r.status, r.num("x-ratelimit-remaining"))
        }
    };
    // The remaining header is what was left before this request's charge, less the
    // one unit it is checked for.
    let mut got = Vec::new();
    for used in [Some("400"), Some("300"), None, Some(" 200 "), Some("100")] {
        got.push(call("team-a", used).await);
    }
    assert_eq!(
        got,
        [(200, 999), (200, 599), (200, 299), (200, 249), (200, 49)]
    );
    assert_eq!(up.hits(), 5);
    // 1,050 used of 1,000: 50 in debt. Refused, never forwarded.
    let r = c.get(&u, &[("x-api-key", "team-a")]).await;
    assert_eq!((r.status, r.num("x-ratelimit-remaining")), (429, 0));
    // 51 tokens at 1000/d: 51 × 86.4 s = 4406.4 s, less the moments the test took.
    let retry = r.num("retry-after");
    assert!((4400..=4407).contains(&retry), "Retry-After {retry}");
    assert_eq!(up.hits(), 5);

    // A huge value is capped at the quota; a malformed one charges the default.
    assert_eq!(call("team-b", Some("-5")).await, (200, 999));
    assert_eq!(call("team-b", Some("99999999999")).await, (200, 949));
    assert_eq!(call("team-b", None).await.0, 429);
    let m = metrics(gw.admin_addr).await;
    let costs = |from: &str| {
        metric(
            &m,
            &format!(
                r#"sluice_response_costs_total{{limit="tokens",route="llm",source="{from}"}}"#
            ),
        )
    };
    assert_eq!(
        ["header", "default", "invalid", "capped"].map(costs),
        [Some(4.0), Some(1.0), Some(1.0), Some(1.0)]
    );
}

/// `window: month`: a calendar month's budget, refused until 00:00 UTC on the first
/// of the next month and counted down to it in every header, with the limiter's
/// time driven from the last second of 2026 into 2027.
async fn a_monthly_limit_counts_down_to_00_00_utc_on_the_first(store: Store) {
    const S: u64 = 1_000_000;
    // 2026-12-31T23:59:59Z and 2027-01-01T00:00:00Z (`date -u +%s`).
    let (last_second, new_year) = (1_798_761_599 * S, 1_798_761_600 * S);
    let clock = sluice::limit::ManualClock::new(last_second);
    let gw = store
        .start_at(
            r#"
routes:
  - name: billing
    match: {path: /bill}
    key: ip
    limits:
      - {name: monthly, algorithm: fixed_window, limit: 2, window: month}
    respond: {body: "ok
"}
"#,
            clock.clone(),
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/bill");
    let headers = |r: &Resp| {
        [
            "retry-after",
            "ratelimit",
            "ratelimit-policy",
            "x-ratelimit-limit",
            "x-ratelimit-remaining",
            "x-ratelimit-reset",
        ]
        .map(|h| r.header(h).map(str::to_string))
    };
    let expect = |retry: Option<&str>, left: &str, t: &str| {
        [
            retry.map(str::to_string),
            Some(format!(r#""monthly";r={left};t={t}"#)),
            // A month has no one length: no `w`.
            Some(r#""monthly";q=2"#.to_string()),
            Some("2".to_string()),
            Some(left.to_string()),
            Some(t.to_string()),
        ]
    };
    // A second to the new year.
    for left in ["1", "0"] {
        let r = c.get(&u, &[]).await;
        assert_eq!(r.status, 200);
        assert_eq!(headers(&r), expect(None, left, "1"));
    }
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(headers(&r), expect(Some("1"), "0", "1"));
    // The year's last µs is still December.
    clock.set(new_year - 1);
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(headers(&r), expect(Some("1"), "0", "1"));
    // January: a fresh budget, for 31 days.
    clock.set(new_year);
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(headers(&r), expect(None, "1", "2678400"));

    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "billing"),
        [("allowed", 3.0), ("limited", 2.0)]
    );
}

async fn delay_waits_for_capacity_up_to_max_delay(store: Store) {
    // `strict` refills once a second, so its second request would have to wait far
    // longer than its 50 ms, however slowly this machine runs.
    let gw = store
        .start(
            r#"
routes:
  - name: paced
    match: {path: /paced}
    key: ip
    on_limit: delay
    max_delay: 1s
    limits: [{name: pace, algorithm: token_bucket, rate: 10/s, burst: 1}]
    respond: {body: "ok\n"}
  - name: strict
    match: {path: /strict}
    key: ip
    on_limit: delay
    max_delay: 50ms
    limits: [{name: pace, algorithm: token_bucket, rate: 1/s, burst: 1}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let started = Instant::now();
    assert_eq!(c.get(&url(gw.addr, "/paced"), &[]).await.status, 200);
    assert_eq!(c.get(&url(gw.addr, "/paced"), &[]).await.status, 200);
    // The second token exists 100 ms after the first was taken, which was after
    // `started`.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(90),
        "second request passed after {waited:?}"
    );

    assert_eq!(c.get(&url(gw.addr, "/strict"), &[]).await.status, 200);
    let r = c.get(&url(gw.addr, "/strict"), &[]).await;
    assert_eq!((r.status, r.num("retry-after")), (429, 1));

    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "paced"), [("allowed", 1.0), ("delayed", 1.0)]);
    assert_eq!(
        decisions(&m, "strict"),
        [("allowed", 1.0), ("limited", 1.0)]
    );
}

async fn concurrent_delayed_requests_queue_one_after_another(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: paced
    match: {path: /paced}
    key: ip
    on_limit: delay
    max_delay: 1s
    limits: [{name: pace, algorithm: token_bucket, rate: 10/s, burst: 1}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let started = Instant::now();
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let (c, u) = (c.clone(), url(gw.addr, "/paced"));
            tokio::spawn(async move { c.get(&u, &[]).await.status })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.unwrap(), 200);
    }
    // One token at once, then one every 100 ms: the fifth waits for the fourth
    // refill after the first was taken.
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(390),
        "five passed after {waited:?}"
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "paced"), [("allowed", 1.0), ("delayed", 4.0)]);
}

async fn every_algorithm_admits_its_quota_then_refuses(store: Store) {
    // Windows long enough that no aligned boundary falls inside the test.
    let gw = store.start(
        r#"
routes:
  - {name: fw, match: {path: /fixed_window}, limits: [{algorithm: fixed_window, limit: 3, window: 1d}], respond: {body: ok}}
  - {name: sw, match: {path: /sliding_window}, limits: [{algorithm: sliding_window, limit: 3, window: 1h}], respond: {body: ok}}
  - {name: sl, match: {path: /sliding_log}, limits: [{algorithm: sliding_log, limit: 3, window: 1h}], respond: {body: ok}}
  - {name: tb, match: {path: /token_bucket}, limits: [{algorithm: token_bucket, rate: 1/h, burst: 3}], respond: {body: ok}}
  - {name: gcra, match: {path: /gcra}, limits: [{algorithm: gcra, rate: 1/h, burst: 3}], respond: {body: ok}}
  - {name: costly, match: {path: /cost}, limits: [{name: c, algorithm: sliding_log, limit: 5, window: 1h, cost: 2}], respond: {body: ok}}
"#,
    )
    .await;
    let c = http1();
    for algorithm in [
        "fixed_window",
        "sliding_window",
        "sliding_log",
        "token_bucket",
        "gcra",
    ] {
        let u = url(gw.addr, &format!("/{algorithm}"));
        for left in [2, 1, 0] {
            let r = c.get(&u, &[]).await;
            assert_eq!(
                (r.status, r.num("x-ratelimit-remaining")),
                (200, left),
                "{algorithm}"
            );
            assert_eq!(r.header("x-ratelimit-limit"), Some("3"), "{algorithm}");
            // The default name is `<algorithm>_<index>`.
            let policy = r.header("ratelimit-policy").unwrap();
            assert!(
                policy.starts_with(&format!("\"{algorithm}_0\";q=3;w=")),
                "{policy}"
            );
        }
        let r = c.get(&u, &[]).await;
        assert_eq!(
            (r.status, r.num("x-ratelimit-remaining")),
            (429, 0),
            "{algorithm}"
        );
        assert!(r.num("retry-after") >= 1, "{algorithm}");
    }
    // Cost 2 of 5: two requests (4), then the third would make 6.
    let u = url(gw.addr, "/cost");
    for left in [3, 1] {
        let r = c.get(&u, &[]).await;
        assert_eq!((r.status, r.num("x-ratelimit-remaining")), (200, left));
    }
    let r = c.get(&u, &[]).await;
    assert_eq!((r.status, r.num("x-ratelimit-remaining")), (429, 1));
}

// === routing ===

#[tokio::test]
async fn first_matching_route_wins_and_no_match_is_404() {
    let gw = start_gateway(
        r#"
routes:
  - {name: exact-host, match: {host: api.example.com}, respond: {body: exact-host}}
  - {name: wild-host, match: {host: "*.example.com"}, respond: {body: wild-host}}
  - {name: first, match: {path_prefix: /both/}, respond: {body: first}}
  - {name: second, match: {path: /both/x}, respond: {body: second}}
  - {name: exact-path, match: {path: /exact}, respond: {body: exact-path}}
  - {name: prefix, match: {path_prefix: /pre/}, respond: {body: prefix}}
  - {name: regex, match: {path_regex: "^/users/[0-9]+$"}, respond: {body: regex}}
  - {name: post-only, match: {path: /m, methods: [POST]}, respond: {body: post-only}}
  - {name: tenant, match: {path: /h, headers: {x-tenant: acme}}, respond: {body: tenant}}
  - {name: any-header, match: {path: /h, headers: {x-any: "*"}}, respond: {body: any-header}}
"#,
    )
    .await;
    let c = http1();
    // (method, path and query, headers, the route that answers or None for 404)
    #[rustfmt::skip]
    let cases: &[(Method, &str, Headers, Option<&str>)] = &[
        (Method::GET, "/z", &[("host", "api.example.com")], Some("exact-host")),
        (Method::GET, "/z", &[("host", "API.Example.com:8080")], Some("exact-host")),
        (Method::GET, "/z", &[("host", "www.example.com")], Some("wild-host")),
        (Method::GET, "/z", &[("host", "a.b.example.com")], Some("wild-host")),
        (Method::GET, "/z", &[("host", "example.com")], None),
        (Method::GET, "/z", &[("host", "example.com.evil")], None),
        (Method::GET, "/both/x", &[], Some("first")),
        (Method::GET, "/both/y", &[], Some("first")),
        (Method::GET, "/exact", &[], Some("exact-path")),
        (Method::GET, "/exact?q=1", &[], Some("exact-path")),
        (Method::GET, "/exact/", &[], None),
        (Method::GET, "/pre/a/b", &[], Some("prefix")),
        (Method::GET, "/pre", &[], None),
        (Method::GET, "/users/42", &[], Some("regex")),
        (Method::GET, "/users/x", &[], None),
        (Method::POST, "/m", &[], Some("post-only")),
        (Method::GET, "/m", &[], None),
        (Method::GET, "/h", &[("x-tenant", "acme")], Some("tenant")),
        (Method::GET, "/h", &[("x-tenant", "other")], None),
        (Method::GET, "/h", &[("x-any", "whatever")], Some("any-header")),
        (Method::GET, "/h", &[], None),
    ];
    for (method, path, headers, want) in cases {
        let r = c
            .send(method.clone(), &url(gw.addr, path), headers, "")
            .await;
        match want {
            Some(route) => assert_eq!(
                (r.status, r.text()),
                (200, *route),
                "{method} {path} {headers:?}"
            ),
            None => assert_eq!(r.status, 404, "{method} {path} {headers:?}: {}", r.text()),
        }
    }
    let m = metrics(gw.admin_addr).await;
    let misses = cases.iter().filter(|c| c.3.is_none()).count() as f64;
    assert_eq!(decisions(&m, "unmatched"), [("unmatched", misses)]);
    assert_eq!(decisions(&m, "first"), [("allowed", 2.0)]);
    assert_eq!(decisions(&m, "second"), []);
}

/// Upstreams answer HEAD with their GET handler, so a route for GET takes HEAD too:
/// a HEAD must neither step around the route's limit through a catch-all route nor
/// get a budget of its own. On HTTP/1.1 and h2 alike.
#[tokio::test]
async fn get_routes_take_head_and_share_its_limit() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
routes:
  - name: search
    match: {{path: /search, methods: [GET]}}
    upstream: app
    limits: [{{algorithm: fixed_window, limit: 2, window: 1m}}]
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    ))
    .await;
    let u = url(gw.addr, "/search");
    let c = http1();
    let mut got = Vec::new();
    for m in [Method::GET, Method::HEAD, Method::HEAD, Method::GET] {
        got.push(c.send(m, &u, &[], "").await.status);
    }
    assert_eq!(got, [200, 200, 429, 429]);
    let r = h2c().send(Method::HEAD, &u, &[], "").await;
    assert_eq!(r.status, 429);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "search"),
        [("allowed", 2.0), ("limited", 3.0)]
    );
    assert_eq!(decisions(&m, "rest"), []);
    assert_eq!(up.hits(), 2);
    // On a connection hyper serves: the 429 to HEAD states its length and sends no
    // body, so the next answer on the connection is read as sent.
    let mut s = hyper_connection(gw.addr).await;
    s.write_all(b"HEAD /search HTTP/1.1\r\nhost: h\r\n\r\nGET /search HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .expect("write");
    let head = read_head(&mut s).await.expect("the HEAD's answer");
    assert!(head.starts_with("HTTP/1.1 429 "), "{head}");
    // The 429's body, with its head's Retry-After in it.
    let field = |head: &str, name: &str| -> String {
        head.split("\r\n")
            .find_map(|l| l.strip_prefix(name))
            .unwrap_or_else(|| panic!("no {name} in {head}"))
            .to_string()
    };
    let text = |head: &str| {
        let secs = field(head, "retry-after: ");
        format!("rate limit \"fixed_window_0\" of route \"search\" exceeded; retry in {secs}s\n")
    };
    assert_eq!(
        field(&head, "content-length: "),
        text(&head).len().to_string()
    );
    let (head, body) = read_response(&mut s).await.expect("the GET's answer");
    assert!(head.starts_with("HTTP/1.1 429 "), "{head}");
    assert_eq!(body, text(&head));
}

/// A 204 or 304 has no body, so its answer to HEAD states no length either (hyper
/// writes what the map says). Before, `headless` gave a HEAD to a `respond` route
/// with status 204 and a body `Content-Length: n`. `check` refuses such a body now;
/// the gateway started unchecked shows the defence behind it. On sluice's own
/// HTTP/1.1 server, on hyper's (after a request with a body) and on h2c.
#[tokio::test]
async fn a_head_answered_204_or_304_states_no_length() {
    let up = upstream().await;
    let gw = start_unchecked(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
routes:
  - {{name: gone, match: {{path: /gone}}, respond: {{status: 204, body: gone}}}}
  - {{name: same, match: {{path: /same}}, respond: {{status: 304, body: "x"}}}}
  - {{name: empty, match: {{path: /empty}}, respond: {{status: 204, body: ""}}}}
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    ))
    .await;
    for (path, status) in [("/gone", 204), ("/same", 304), ("/empty", 204)] {
        let req = format!("HEAD {path} HTTP/1.1\r\nhost: h\r\n\r\n");
        for mut s in [connect(gw.addr).await, hyper_connection(gw.addr).await] {
            s.write_all(req.as_bytes()).await.expect("write");
            let head = read_head(&mut s)
                .await
                .expect("an answer")
                .to_ascii_lowercase();
            assert!(head.starts_with(&format!("http/1.1 {status} ")), "{head}");
            assert!(!head.contains("\r\ncontent-length:"), "{path}: {head}");
            assert!(!head.contains("\r\ntransfer-encoding:"), "{path}: {head}");
        }
        let r = h2c().send(Method::HEAD, &url(gw.addr, path), &[], "").await;
        assert_eq!(r.status, status);
        assert_eq!(r.header("content-length"), None, "{path}");
    }
}

// === keys and client addresses ===

/// One route per key kind, each allowing one request per key per minute.
const KEYS: &str = r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
routes:
  - {name: by-header, match: {path: /header}, key: "header:x-api-key", limits: [ONE], respond: {body: ok}}
  - {name: by-header-or-ip, match: {path: /fallback}, key: "header:x-api-key", missing_key: ip, limits: [ONE], respond: {body: ok}}
  - {name: by-query, match: {path: /query}, key: "query:api_key", limits: [ONE], respond: {body: ok}}
  - {name: by-cookie, match: {path: /cookie}, key: "cookie:session", limits: [ONE], respond: {body: ok}}
  - {name: composite, match: {path: /composite}, key: ["header:x-tenant", ip], limits: [ONE], respond: {body: ok}}
  - {name: shared, match: {path: /global}, key: global, limits: [ONE], respond: {body: ok}}
  - {name: per-ip, match: {path: /ip}, key: ip, limits: [ONE], respond: {body: ok}}
"#;
const ONE: &str = "{name: one, algorithm: sliding_log, limit: 1, window: 1m}";

/// Sends one request per step and checks its status.
async fn expect(c: &HttpClient, addr: std::net::SocketAddr, steps: &[(&str, Headers<'_>, u16)]) {
    for (path, headers, status) in steps {
        let r = c.get(&url(addr, path), headers).await;
        assert_eq!(r.status, *status, "{path} {headers:?}: {}", r.text());
    }
}

async fn each_key_kind_has_its_own_budgets(store: Store) {
    let gw = store.start(&KEYS.replace("ONE", ONE)).await;
    let c = http1();
    let (ip1, ip2) = (
        ("x-forwarded-for", "1.1.1.1"),
        ("x-forwarded-for", "2.2.2.2"),
    );
    // Longer than 256 bytes (stored hashed), differing only in the last byte.
    let (long_a, long_b) = ("k".repeat(300) + "a", "k".repeat(300) + "b");
    #[rustfmt::skip]
    expect(&c, gw.addr, &[
        ("/header", &[("x-api-key", "k1")], 200),
        ("/header", &[("x-api-key", "k1")], 429),
        ("/header", &[("x-api-key", "k2")], 200),
        ("/header", &[("x-api-key", &long_a)], 200),
        ("/header", &[("x-api-key", &long_a)], 429),
        ("/header", &[("x-api-key", &long_b)], 200),
        ("/header", &[("x-api-key", "{curly}")], 200),
        ("/header", &[("x-api-key", "{curly}")], 429),
        // Missing with the IP fallback: the IP's own budget, apart from any key's,
        // even a key that looks like the IP.
        ("/fallback", &[], 200),
        ("/fallback", &[], 429),
        ("/fallback", &[("x-api-key", "k1")], 200),
        ("/fallback", &[("x-api-key", "127.0.0.1")], 200),
        ("/query?api_key=q1", &[], 200),
        ("/query?other=1&api_key=q1", &[], 429),
        ("/query?api_key=q2", &[], 200),
        ("/cookie", &[("cookie", "a=1; session=s1")], 200),
        ("/cookie", &[("cookie", "session=s1")], 429),
        ("/cookie", &[("cookie", "session=s2")], 200),
        ("/composite", &[("x-tenant", "t1"), ip1], 200),
        ("/composite", &[("x-tenant", "t1"), ip1], 429),
        ("/composite", &[("x-tenant", "t1"), ip2], 200),
        ("/composite", &[("x-tenant", "t2"), ip1], 200),
        ("/global", &[ip1], 200),
        ("/global", &[ip2], 429),
        ("/global", &[], 429),
        ("/ip", &[ip1], 200),
        ("/ip", &[ip1], 429),
        ("/ip", &[ip2], 200),
    ]).await;
}

#[tokio::test]
async fn a_missing_key_is_400_naming_it() {
    let gw = start_gateway(&KEYS.replace("ONE", ONE)).await;
    let c = http1();
    for (path, headers, missing) in [
        ("/header", &[][..], "header x-api-key"),
        ("/header", &[("x-api-key", "")][..], "header x-api-key"),
        ("/query?other=1", &[], "query parameter api_key"),
        ("/cookie", &[("cookie", "other=1")], "cookie session"),
        ("/composite", &[], "header x-tenant"),
    ] {
        let r = c.get(&url(gw.addr, path), headers).await;
        assert_eq!(r.status, 400, "{path}");
        assert!(
            r.text().contains(missing),
            "{path}: {:?} does not name {missing}",
            r.text()
        );
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "by-header"), [("bad_request", 2.0)]);
    assert_eq!(decisions(&m, "composite"), [("bad_request", 1.0)]);
}

async fn x_forwarded_for_is_ignored_from_untrusted_peers(store: Store) {
    let gw = store
        .start(&format!(
            r#"
deny: {{ips: [9.9.9.9]}}
routes:
  - {{name: per-ip, match: {{path: /ip}}, key: ip, limits: [{ONE}], respond: {{body: ok}}}}
"#
        ))
        .await;
    let c = http1();
    #[rustfmt::skip]
    expect(&c, gw.addr, &[
        ("/ip", &[("x-forwarded-for", "9.9.9.9")], 200),
        ("/ip", &[("x-forwarded-for", "5.6.7.8")], 429),
        ("/ip", &[], 429),
    ]).await;
}

async fn x_forwarded_for_from_a_trusted_proxy_names_the_client(store: Store) {
    let gw = store
        .start(&format!(
            r#"
client_ip: {{trusted_proxies: [127.0.0.1/32]}}
deny: {{ips: [9.9.9.9]}}
routes:
  - {{name: per-ip, match: {{path: /ip}}, key: ip, limits: [{ONE}], respond: {{body: ok}}}}
"#
        ))
        .await;
    let c = http1();
    #[rustfmt::skip]
    expect(&c, gw.addr, &[
        ("/ip", &[("x-forwarded-for", "9.9.9.9")], 403),
        // The right-most untrusted hop counts; what the client wrote left of it not.
        ("/ip", &[("x-forwarded-for", "9.9.9.9, 1.2.3.4")], 200),
        ("/ip", &[("x-forwarded-for", "1.2.3.4")], 429),
        ("/ip", &[("x-forwarded-for", "5.6.7.8")], 200),
        // A hop that is itself trusted is skipped.
        ("/ip", &[("x-forwarded-for", "5.6.7.8, 127.0.0.1")], 429),
        ("/ip", &[], 200),
    ]).await;
}

// === deny ===

async fn denied_addresses_get_the_configured_status_everywhere(store: Store) {
    for entry in ["127.0.0.1", "127.0.0.0/8"] {
        let up = upstream().await;
        let gw = store
            .start(
                &r#"
deny: {ips: [ENTRY], status: 451}
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: proxied, match: {path: /api}, upstream: api, key: ip, limits: [ONE]}
  - {name: local, match: {path: /local}, respond: {body: ok}}
"#
                .replace("ENTRY", entry)
                .replace("UP", &up.url())
                .replace("ONE", ONE),
            )
            .await;
        let c = http1();
        for path in ["/api", "/local", "/nowhere"] {
            let r = c.get(&url(gw.addr, path), &[]).await;
            assert_eq!(r.status, 451, "{entry} {path}");
            assert!(r.rate_headers().is_empty());
        }
        assert_eq!(up.hits(), 0);
        let m = metrics(gw.admin_addr).await;
        for route in ["proxied", "local", "unmatched"] {
            assert_eq!(decisions(&m, route), [("denied", 1.0)], "{entry} {route}");
        }
    }
}

async fn denied_requests_are_not_charged(store: Store) {
    // Behind a trusted proxy, so one test can be a denied and an admitted client.
    let gw = store
        .start(
            r#"
client_ip: {trusted_proxies: [127.0.0.1/32]}
deny: {ips: [127.0.0.1, 10.0.0.0/8], status: 451}
routes:
  - name: shared
    match: {path: /g}
    key: global
    limits: [{name: two, algorithm: sliding_log, limit: 2, window: 1m}]
    respond: {body: ok}
"#,
        )
        .await;
    let c = http1();
    let u = url(gw.addr, "/g");
    assert_eq!(statuses(&c, 3, &u, &[]).await, [451; 3]);
    assert_eq!(
        statuses(&c, 3, &u, &[("x-forwarded-for", "10.1.2.3")]).await,
        [451; 3]
    );
    for left in [1, 0] {
        let r = c.get(&u, &[("x-forwarded-for", "1.1.1.1")]).await;
        assert_eq!((r.status, r.num("x-ratelimit-remaining")), (200, left));
    }
    assert_eq!(
        c.get(&u, &[("x-forwarded-for", "1.1.1.1")]).await.status,
        429
    );
    let m = metrics(gw.admin_addr).await;
    let counts = [("allowed", 2.0), ("denied", 6.0), ("limited", 1.0)];
    assert_eq!(decisions(&m, "shared"), counts);
    assert_eq!(
        metric(&m, r#"sluice_deny_entries{source="static"}"#),
        Some(2.0)
    );
}

async fn denied_keys_get_403_and_only_they(store: Store) {
    let gw = store.start(
        r#"
deny: {keys: [leaked]}
routes:
  - {name: keyed, match: {path: /k}, key: "header:x-api-key", respond: {body: ok}}
  - {name: listed, match: {path: /l}, key: ["header:x-tenant", "header:x-api-key"], respond: {body: ok}}
"#,
    )
    .await;
    let c = http1();
    // A denied key is denied inside a composite key too.
    let listed = |key: &'static str| {
        let (c, u) = (&c, url(gw.addr, "/l"));
        async move {
            c.get(&u, &[("x-tenant", "acme"), ("x-api-key", key)])
                .await
                .status
        }
    };
    assert_eq!((listed("leaked").await, listed("fine").await), (403, 200));
    let r = c.get(&url(gw.addr, "/k"), &[("x-api-key", "leaked")]).await;
    assert_eq!((r.status, r.text()), (403, "access denied\n"));
    assert_eq!(
        c.get(&url(gw.addr, "/k"), &[("x-api-key", "fine")])
            .await
            .status,
        200
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "keyed"), [("allowed", 1.0), ("denied", 1.0)]);
    assert_eq!(decisions(&m, "listed"), [("allowed", 1.0), ("denied", 1.0)]);
}

// === request bodies ===

const UPLOAD: &str = r#"
server: {listen: "127.0.0.1:0", max_request_body: 1KiB}
upstreams:
  api: {targets: ["UP"]}
routes:
  - {name: upload, match: {path_prefix: /}, upstream: api}
"#;

#[tokio::test]
async fn a_declared_body_over_the_limit_is_413_before_the_upstream() {
    let up = upstream().await;
    let gw = start_gateway(&UPLOAD.replace("UP", &up.url())).await;
    let c = http1();
    let r = c
        .send(Method::POST, &url(gw.addr, "/up"), &[], pattern(2000))
        .await;
    assert_eq!(r.status, 413);
    assert_eq!(up.hits(), 0);
    // Exactly the limit passes.
    let r = c
        .send(Method::POST, &url(gw.addr, "/up"), &[], pattern(1024))
        .await;
    assert_eq!((r.status, r.echo().body_len), (200, 1024));
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "upload"),
        [("allowed", 1.0), ("bad_request", 1.0)]
    );
}

#[tokio::test]
async fn a_chunked_body_growing_over_the_limit_is_413() {
    let up = upstream().await;
    let gw = start_gateway(&UPLOAD.replace("UP", &up.url())).await;
    let chunk = String::from_utf8(pattern(600)).unwrap();
    let post = |chunks: usize| {
        let body = format!("258\r\n{chunk}\r\n").repeat(chunks);
        format!("POST /up HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n{body}0\r\n\r\n")
    };
    let mut s = connect(gw.addr).await;
    s.write_all(post(2).as_bytes()).await.unwrap();
    let (head, _) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 413 "), "{head:?}");
    // Refused for the client's body, as a declared length over the limit is: counted
    // bad_request (not as the admission it was), and the connection closes.
    assert!(
        head.to_ascii_lowercase().contains("connection: close"),
        "{head:?}"
    );
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "upload")
            .into_iter()
            .filter(|(_, n)| *n > 0.0)
            .collect::<Vec<_>>(),
        [("bad_request", 1.0)]
    );
    // The connection is closed, or else the rest of the refused body must not be
    // taken for a request: the next one on it is answered as itself.
    if s.write_all(post(1).as_bytes()).await.is_ok() {
        if let Some((head, body)) = read_response(&mut s).await {
            assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
            assert!(body.contains(r#""body_len":600"#), "{body:?}");
        }
    }
}

// === reload ===

async fn reload_keeps_unchanged_limits_and_survives_a_bad_file(store: Store) {
    let config = r#"
routes:
  - {name: r, match: {path_prefix: /}, key: ip, limits: [{name: l, algorithm: sliding_log, limit: LIMIT, window: 1m}], respond: {body: BODY}}
"#;
    let write = |file: &tempfile::NamedTempFile, limit: &str, body: &str| {
        let text =
            with_listeners(&store.yaml(&config.replace("LIMIT", limit).replace("BODY", body)));
        std::fs::write(file.path(), text).unwrap();
    };
    let (gw, file) = store
        .start_file(&config.replace("LIMIT", "3").replace("BODY", "v1"))
        .await;
    let c = http1();
    let u = url(gw.addr, "/");
    assert_eq!(statuses(&c, 2, &u, &[]).await, [200, 200]);
    // The file is watched: each change is waited for as the watcher applies it, so
    // the counts below do not depend on whether it or a SIGHUP-like reload is first.
    let admin = gw.admin_addr;
    let reloads = |result: &'static str, n: f64| async move {
        let series = format!("sluice_config_reloads_total{{result=\"{result}\"}}");
        let seen = eventually(Duration::from_secs(10), || async {
            metric(&metrics(admin).await, &series) == Some(n)
        })
        .await;
        assert!(seen.is_some(), "{series} never reached {n}");
    };

    // Same limit, new body: the new config serves and the budget carries over.
    write(&file, "3", "v2");
    reloads("success", 1.0).await;
    let r = c.get(&u, &[]).await;
    assert_eq!(
        (r.status, r.text(), r.num("x-ratelimit-remaining")),
        (200, "v2", 0)
    );
    assert_eq!(c.get(&u, &[]).await.status, 429);

    // A broken file changes nothing.
    std::fs::write(file.path(), "routes: [").unwrap();
    reloads("failure", 1.0).await;
    let err = gw.reload().await.expect_err("a broken file must not load");
    assert!(
        err.starts_with(&format!("{}:", file.path().display())),
        "{err}"
    );
    let r = c.get(&u, &[]).await;
    assert_eq!(r.status, 429);
    assert!(
        r.text()
            .starts_with(r#"rate limit "l" of route "r" exceeded"#),
        "{}",
        r.text()
    );

    // A raised limit keeps the count: 3 used, 4 of 5 now.
    write(&file, "5", "v3");
    reloads("success", 2.0).await;
    let r = c.get(&u, &[]).await;
    assert_eq!(
        (r.status, r.text(), r.num("x-ratelimit-remaining")),
        (200, "v3", 1)
    );

    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(&m, r#"sluice_config_reloads_total{result="success"}"#),
        Some(2.0)
    );
    assert_eq!(
        metric(&m, r#"sluice_config_reloads_total{result="failure"}"#),
        Some(2.0),
        "the watcher's and the explicit reload's"
    );
    assert_eq!(metric(&m, "sluice_config_last_reload_success"), Some(1.0));
}

async fn a_shadow_route_never_delays(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: quiet
    match: {path: /}
    key: ip
    shadow: true
    on_limit: delay
    max_delay: 5s
    limits: [{name: pace, algorithm: token_bucket, rate: 1/m, burst: 1}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    let started = Instant::now();
    assert_eq!(
        statuses(&c, 3, &url(gw.addr, "/"), &[]).await,
        [200, 200, 200]
    );
    // With the delay applied, the second request would have waited a minute.
    assert!(started.elapsed() < Duration::from_secs(5));
    let m = metrics(gw.admin_addr).await;
    assert_eq!(decisions(&m, "quiet"), [("allowed", 1.0), ("shadow", 2.0)]);
}

async fn a_client_gone_while_delayed_is_still_counted(store: Store) {
    let gw = store
        .start(
            r#"
routes:
  - name: paced
    match: {path: /}
    key: ip
    on_limit: delay
    max_delay: 2m
    limits: [{name: pace, algorithm: token_bucket, rate: 1/m, burst: 1}]
    respond: {body: "ok\n"}
"#,
        )
        .await;
    let c = http1();
    assert_eq!(c.get(&url(gw.addr, "/"), &[]).await.status, 200);
    // The second request would wait a minute for its token; hang up long before, and
    // it must be counted at once (not after the minute, not never).
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(s);
    let mut counted = Vec::new();
    for _ in 0..50 {
        let m = metrics(gw.admin_addr).await;
        counted = decisions(&m, "paced")
            .into_iter()
            .map(|(d, n)| (d.to_string(), n))
            .collect();
        if counted.len() == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        counted,
        [("allowed".to_string(), 1.0), ("delayed".to_string(), 1.0)]
    );
}

// === what the upstream answered, and which limit refused ===

#[tokio::test]
async fn upstream_statuses_are_counted_by_class_and_refusals_by_limit() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  api: {{targets: ["{}"]}}
routes:
  - name: api
    match: {{path_prefix: /api/}}
    key: header:x-key
    limits:
      - {{name: burst, algorithm: fixed_window, limit: 3, window: 1h}}
      - {{name: hourly, algorithm: fixed_window, limit: 1, window: 1h, key: "header:x-account"}}
    upstream: api
  - name: local
    match: {{path: /local}}
    respond: {{status: 503}}
"#,
        up.url()
    ))
    .await;
    let c = http1();
    let url = format!("http://{}/api/x", gw.addr);
    let mut got = Vec::new();
    // a: 200, 401, 503 from the upstream, then refused by `burst` twice.
    for (status, account) in [
        ("200", "a1"),
        ("401", "a2"),
        ("503", "a3"),
        ("200", "a4"),
        ("200", "a5"),
    ] {
        let h = [
            ("x-key", "a"),
            ("x-account", account),
            ("x-reply-status", status),
        ];
        got.push(c.get(&url, &h).await.status);
    }
    // b with an account: the account's `hourly` admits one, then refuses.
    for _ in 0..2 {
        let h = [("x-key", "b"), ("x-account", "acme")];
        got.push(c.get(&url, &h).await.status);
    }
    // sluice's own answers are not the upstream's.
    got.push(
        c.get(&format!("http://{}/local", gw.addr), &[])
            .await
            .status,
    );
    assert_eq!(got, [200, 401, 503, 429, 429, 200, 429, 503]);
    let m = metrics(gw.admin_addr).await;
    let class = |route: &str, code: &str| {
        metric(
            &m,
            &format!(r#"sluice_upstream_responses_total{{code="{code}",route="{route}"}}"#),
        )
    };
    assert_eq!(
        ["1xx", "2xx", "3xx", "4xx", "5xx"].map(|c| class("api", c)),
        [Some(0.0), Some(2.0), Some(0.0), Some(1.0), Some(1.0)]
    );
    assert_eq!(class("local", "5xx"), Some(0.0));
    let by = |limit: &str| {
        metric(
            &m,
            &format!(r#"sluice_limit_refusals_total{{limit="{limit}",route="api"}}"#),
        )
    };
    assert_eq!((by("burst"), by("hourly")), (Some(2.0), Some(1.0)));
}
