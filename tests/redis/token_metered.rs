//! Token-metered limits (`cost: {response_json, estimate}`) on a 3-node Redis
//! Cluster: a request's estimate held on two keys at once (an API key's budget and
//! its organisation's, each on its own node's share of the call), and what each
//! response did not use given back to both when it ends.

use http::Method;

use crate::common::llm::{Llm, Streamed};
use crate::common::redis::*;
use crate::common::{http1, start_gateway, url, Running};

const CONFIG: &str = r#"
upstreams:
  llm: {targets: ["UP"]}
routes:
  - name: chat
    match: {path_prefix: /v1/}
    upstream: llm
    key: header:x-api-key
    limits:
      - {name: tokens, algorithm: token_bucket, rate: 1000/d, burst: 1000, cost: {response_json: /usage/total_tokens, estimate: 300}}
      - {name: org, key: header:x-org, algorithm: gcra, rate: 900/d, burst: 900, cost: {response_json: /usage/total_tokens, estimate: 300}}
"#;

/// `(status, X-RateLimit-Remaining)` of a JSON call that used `t` tokens.
async fn call(gw: &Running, key: &str, t: u32) -> (u16, u64) {
    let h = [("x-api-key", key), ("x-org", "acme")];
    let r = http1()
        .send(
            Method::POST,
            &url(gw.addr, &format!("/v1/json?t={t}")),
            &h,
            "",
        )
        .await;
    (r.status, r.num("x-ratelimit-remaining"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn estimates_are_held_and_given_back_on_a_cluster() {
    let cluster = RedisCluster::start();
    let up = Llm::start().await;
    let store = redis_store(&cluster_target(&cluster.urls()), "deny", 2000);
    let gw = start_gateway(&format!("{store}{}", CONFIG.replace("UP", &up.url()))).await;
    // The headers report the limit with the least left: the organisation's.
    let h = [("x-api-key", "k"), ("x-org", "acme")];
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", &h).await;
    s.until("\"first\"").await;
    assert_eq!(s.head(), (200, 600));
    // k: 700 then 400 held; acme: 600 then 300. 100 used: 200 back to each.
    assert_eq!(call(&gw, "k", 100).await, (200, 300));
    // Another key of the organisation: acme 500 - 300, then 499 - 300.
    assert_eq!(call(&gw, "k2", 1).await, (200, 200));
    assert_eq!(call(&gw, "k2", 1).await, (200, 199));
    assert_eq!(up.hits(), 4);
    up.release();
    s.until("0\r\n\r\n").await;
    // acme: 900 - 100 - 1 - 1 - 21 = 777; k: 1000 - 100 - 21 = 879.
    assert_eq!(call(&gw, "k", 0).await, (200, 477));
    assert_eq!(call(&gw, "k2", 0).await, (200, 477));
}
