//! Limiter state across a reload of the config file, end to end, on the memory store
//! and on a real Redis: a changed `limit`, `rate` or `burst` keeps what each client
//! has used and applies the new numbers to it, so lowering a limit never hands out a
//! fresh budget and raising it admits exactly the difference.

use std::time::{Duration, Instant};

use crate::common::redis::{redis_store, url_target, RedisServer};
use crate::common::*;

/// The route's limit, as YAML flow-mapping fields after `name: l`.
fn config(store: &str, limit: &str) -> String {
    format!(
        "{store}routes:\n  - {{name: r, match: {{path_prefix: /}}, key: header:x-client, \
         limits: [{{name: l, {limit}}}], respond: {{body: \"ok\\n\"}}}}\n"
    )
}

/// Rewrites the file with `limit` and reloads it.
async fn reload(gw: &Running, file: &tempfile::NamedTempFile, store: &str, limit: &str) {
    std::fs::write(file.path(), with_listeners(&config(store, limit))).expect("write config");
    gw.reload()
        .await
        .unwrap_or_else(|e| panic!("reload with {limit}: {e}"));
}

/// Statuses of `n` requests of client `who`.
async fn send(c: &HttpClient, u: &str, who: &str, n: usize) -> Vec<u16> {
    statuses(c, n, u, &[("x-client", who)]).await
}

const WINDOW: Duration = Duration::from_secs(2);

/// fixed_window, 10 per 2 s: 6 used; lowered to 4 (nothing left), raised to 8 (exactly
/// 2 more). All inside one aligned window: if the machine is so slow that the window
/// may have ended before the last request, the run is repeated with a fresh client in
/// the next window (three times at most).
async fn fixed_window_keeps_its_count(store: &str) {
    let fixed = |n: u32| format!("algorithm: fixed_window, limit: {n}, window: 2s");
    let (gw, file) = start_gateway_file(&config(store, &fixed(10))).await;
    let c = http1();
    let u = url(gw.addr, "/");
    for attempt in 0..3 {
        let who = format!("client-{attempt}");
        reload(&gw, &file, store, &fixed(10)).await;
        at_window_start(WINDOW).await;
        let start = Instant::now();
        let used = send(&c, &u, &who, 6).await;

        reload(&gw, &file, store, &fixed(4)).await;
        let lowered = c.get(&u, &[("x-client", &who)]).await;

        reload(&gw, &file, store, &fixed(8)).await;
        let raised = c.get(&u, &[("x-client", &who)]).await;
        let rest = send(&c, &u, &who, 3).await;

        // The window started 20 ms after its boundary; leave a margin for its end.
        if start.elapsed() > WINDOW - Duration::from_millis(300) {
            eprintln!("attempt {attempt} took {:?}; again", start.elapsed());
            continue;
        }
        assert_eq!(used, [200; 6]);
        // 6 of 4 used: refused until the window ends, nothing remaining.
        assert_eq!(
            (lowered.status, lowered.num("x-ratelimit-remaining")),
            (429, 0)
        );
        assert_eq!(lowered.num("x-ratelimit-limit"), 4);
        // 7 of 8, then 8 of 8; then refused.
        assert_eq!(
            (raised.status, raised.num("x-ratelimit-remaining")),
            (200, 1)
        );
        assert_eq!(rest, [200, 429, 429]);
        return;
    }
    panic!("no run fitted in one {WINDOW:?} window in 3 attempts");
}

/// token_bucket refilled at 1/m (nothing comes back during the test), burst 10: 8
/// used. Burst lowered to 5: the 2 tokens left, not 5. Then 2/m and burst 20: no
/// tokens added, and the next one comes at the new rate (30 s, not 60 s).
async fn token_bucket_keeps_its_level(store: &str) {
    let bucket =
        |rate: &str, burst: u32| format!("algorithm: token_bucket, rate: {rate}, burst: {burst}");
    let (gw, file) = start_gateway_file(&config(store, &bucket("1/m", 10))).await;
    let c = http1();
    let u = url(gw.addr, "/");
    assert_eq!(send(&c, &u, "b", 8).await, [200; 8]);

    reload(&gw, &file, store, &bucket("1/m", 5)).await;
    assert_eq!(send(&c, &u, "b", 3).await, [200, 200, 429]);

    reload(&gw, &file, store, &bucket("2/m", 20)).await;
    let r = c.get(&u, &[("x-client", "b")]).await;
    assert_eq!(
        (
            r.status,
            r.num("x-ratelimit-remaining"),
            r.num("retry-after")
        ),
        (429, 0, 30),
        "{:?}",
        r.rate_headers()
    );
    // Another client starts with the new burst.
    let fresh = c.get(&u, &[("x-client", "other")]).await;
    assert_eq!(
        (fresh.status, fresh.num("x-ratelimit-remaining")),
        (200, 19)
    );
}

fn redis_section(redis: &RedisServer) -> String {
    redis_store(&url_target(&redis.url()), "deny", 2_000)
}

#[tokio::test]
async fn fixed_window_keeps_its_count_on_the_memory_store() {
    fixed_window_keeps_its_count("").await;
}

#[tokio::test]
async fn token_bucket_keeps_its_level_on_the_memory_store() {
    token_bucket_keeps_its_level("").await;
}

/// On Redis the refusal under the lowered limit is also cached locally; the raised
/// limit must not be answered by it.
#[tokio::test]
async fn fixed_window_keeps_its_count_on_redis() {
    let redis = RedisServer::start();
    fixed_window_keeps_its_count(&redis_section(&redis)).await;
}

#[tokio::test]
async fn token_bucket_keeps_its_level_on_redis() {
    let redis = RedisServer::start();
    token_bucket_keeps_its_level(&redis_section(&redis)).await;
}

/// A limit that counts another key than its route's (`key` on a limit) keeps its
/// state across a reload that adds a limit before it and changes its number, and
/// starts afresh when its key changes: state is kept per route, name, algorithm,
/// window and key.
async fn a_limit_key_keeps_its_state_until_the_key_changes(store: &str) {
    let write = |limits: &str| {
        format!(
            "{store}routes:\n  - {{name: r, match: {{path_prefix: /}}, key: header:x-client, \
             limits: [{limits}], respond: {{body: \"ok\\n\"}}}}\n"
        )
    };
    let per_user = |n: u32, key: &str| {
        format!(
            "{{name: u, key: \"header:{key}\", algorithm: sliding_log, limit: {n}, window: 1m}}"
        )
    };
    let (gw, file) = start_gateway_file(&write(&per_user(5, "x-user"))).await;
    let reload = |limits: String| {
        let (gw, file) = (&gw, &file);
        async move {
            std::fs::write(file.path(), with_listeners(&write(&limits))).expect("write config");
            gw.reload().await.unwrap_or_else(|e| panic!("reload: {e}"));
        }
    };
    let c = http1();
    let u = url(gw.addr, "/");
    let send = |user: &'static str, n: usize| {
        let (c, u) = (&c, &u);
        async move {
            statuses(
                c,
                n,
                u,
                &[("x-client", "c"), ("x-user", user), ("x-account", user)],
            )
            .await
        }
    };
    assert_eq!(send("ann", 3).await, [200; 3]);
    // A limit before it, and its number lowered to 4: one left of 4.
    let before = "{name: all, algorithm: sliding_log, limit: 100, window: 1m}";
    reload(format!("{before}, {}", per_user(4, "x-user"))).await;
    assert_eq!(send("ann", 2).await, [200, 429]);
    // Another key (the same value, read from x-account): a fresh count.
    reload(format!("{before}, {}", per_user(4, "x-account"))).await;
    assert_eq!(send("ann", 5).await, [200, 200, 200, 200, 429]);
}

#[tokio::test]
async fn a_limit_key_keeps_its_state_until_the_key_changes_on_the_memory_store() {
    a_limit_key_keeps_its_state_until_the_key_changes("").await;
}

#[tokio::test]
async fn a_limit_key_keeps_its_state_until_the_key_changes_on_redis() {
    let redis = RedisServer::start();
    a_limit_key_keeps_its_state_until_the_key_changes(&redis_section(&redis)).await;
}

/// A limit charged from the response keeps its count across a reload that changes
/// what it counts (its statuses), as a changed `limit` does.
async fn a_count_by_status_keeps_its_count_when_its_statuses_change(store: &str) {
    let up = upstream().await;
    let write = |statuses: &str| {
        format!(
            "{store}upstreams: {{api: {{targets: [\"{}\"]}}}}\nroutes:\n  - {{name: r, match: {{path_prefix: /}}, key: header:x-client, upstream: api, \
             limits: [{{name: failures, algorithm: sliding_log, limit: 3, window: 1m, count: {{status: [{statuses}]}}}}]}}\n",
            up.url()
        )
    };
    let (gw, file) = start_gateway_file(&write("401")).await;
    let c = http1();
    let u = url(gw.addr, "/");
    let send = |answer: &'static str| {
        let (c, u) = (&c, &u);
        async move {
            c.get(u, &[("x-client", "c"), ("x-reply-status", answer)])
                .await
                .status
        }
    };
    assert_eq!([send("401").await, send("401").await], [401, 401]);
    std::fs::write(file.path(), with_listeners(&write("401, 403"))).expect("write config");
    gw.reload().await.unwrap_or_else(|e| panic!("reload: {e}"));
    // Two of three kept: one more failure, then refused.
    assert_eq!([send("403").await, send("200").await], [403, 429]);
    assert_eq!(up.hits(), 3);
}

#[tokio::test]
async fn a_count_by_status_keeps_its_count_when_its_statuses_change_on_the_memory_store() {
    a_count_by_status_keeps_its_count_when_its_statuses_change("").await;
}

#[tokio::test]
async fn a_count_by_status_keeps_its_count_when_its_statuses_change_on_redis() {
    let redis = RedisServer::start();
    a_count_by_status_keeps_its_count_when_its_statuses_change(&redis_section(&redis)).await;
}
