//! Token-metered APIs end to end (`cost: {response_json, estimate}`): a real
//! upstream answers OpenAI- and Anthropic-shaped JSON and event streams, and each
//! test asserts the exact statuses, `X-RateLimit-Remaining` values and
//! `sluice_response_costs_total` lines, on the memory store and on Redis.
//! Streams are held by the upstream after their first event until the test has
//! seen that event at the client: a proxy that buffered would never show it.

use crate::common::llm::{odd_stream, Llm, Streamed};
use crate::common::*;
use crate::gateway::Store;

on_both_stores!(
    a_json_body_charges_its_total_tokens,
    a_stream_passes_undelayed_and_is_charged_its_last_usage,
    an_estimate_is_held_while_a_request_runs_and_the_rest_given_back,
    an_estimate_read_from_the_request_body_is_held,
    a_client_that_goes_away_is_charged_what_it_saw_else_the_estimate,
    malformed_and_oversized_events_are_skipped,
    an_upstream_that_fails_gives_the_estimate_back,
    an_http2_client_is_charged_alike,
);

// === the gateway ===

const LLM: &str = r#"
upstreams:
  llm: {targets: ["UP"]}
routes:
  - name: chat
    match: {path_prefix: /v1/}
    upstream: llm
    key: header:x-api-key
    limits:
      - {name: tokens, algorithm: token_bucket, rate: 1000/d, burst: 1000, cost: COST}
"#;

async fn gateway(store: &Store, up: &Llm, cost: &str) -> Running {
    store
        .start(&LLM.replace("UP", &up.url()).replace("COST", cost))
        .await
}

/// A request answered whole: its status and `X-RateLimit-Remaining`.
async fn call(gw: &Running, path: &str, key: &str) -> (u16, u64) {
    let r = http1()
        .send(
            http::Method::POST,
            &url(gw.addr, path),
            &[("x-api-key", key)],
            "",
        )
        .await;
    (r.status, r.num("x-ratelimit-remaining"))
}

/// `sluice_response_costs_total` of the limit `tokens`, by source.
async fn costs(gw: &Running) -> [(&'static str, f64); 6] {
    let m = metrics(gw.admin_addr).await;
    ["json", "sse", "estimate", "default", "invalid", "capped"].map(|s| {
        let series =
            format!(r#"sluice_response_costs_total{{limit="tokens",route="chat",source="{s}"}}"#);
        (s, metric(&m, &series).unwrap_or(-1.0))
    })
}

fn counted(
    json: f64,
    sse: f64,
    estimate: f64,
    default: f64,
    invalid: f64,
) -> [(&'static str, f64); 6] {
    [
        ("json", json),
        ("sse", sse),
        ("estimate", estimate),
        ("default", default),
        ("invalid", invalid),
        ("capped", 0.0),
    ]
}

// === the tests ===

/// OpenAI's JSON: the limit is checked for one unit before forwarding, and the
/// body's `usage.total_tokens` is charged when it ends, whatever is left: the
/// request that overdraws is served, the next refused and never forwarded. A
/// body that is not JSON charges `default`, counted `invalid`.
async fn a_json_body_charges_its_total_tokens(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: /usage/total_tokens, default: 10}",
    )
    .await;
    assert_eq!(costs(&gw).await, counted(0.0, 0.0, 0.0, 0.0, 0.0));
    let mut got = Vec::new();
    for path in [
        "/v1/json?t=400",
        "/v1/json?t=300",
        "/v1/bad",
        "/v1/json?t=350",
    ] {
        got.push(call(&gw, path, "team-a").await);
    }
    // Remaining: what was left before the request, less the unit it is checked for.
    assert_eq!(got, [(200, 999), (200, 599), (200, 299), (200, 289)]);
    assert_eq!(call(&gw, "/v1/json?t=1", "team-a").await, (429, 0));
    assert_eq!(up.hits(), 4);
    // Another key has its own budget.
    assert_eq!(call(&gw, "/v1/json?t=5", "team-b").await, (200, 999));
    assert_eq!(call(&gw, "/v1/json?t=5", "team-b").await, (200, 994));
    assert_eq!(costs(&gw).await, counted(5.0, 0.0, 0.0, 0.0, 1.0));
}

/// An event stream reaches the client as it comes: the first event arrives while
/// the upstream holds the rest. The charge is the last usage, made when the
/// stream ends (OpenAI: `usage.total_tokens`; Anthropic: input tokens from
/// `message_start` plus the last `message_delta`'s output tokens).
async fn a_stream_passes_undelayed_and_is_charged_its_last_usage(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: [/usage/total_tokens, /message/usage/input_tokens, /usage/output_tokens]}",
    )
    .await;
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", &[("x-api-key", "k")]).await;
    s.until("\"first\"").await;
    assert_eq!(s.head(), (200, 999));
    // Nothing charged while it runs (no estimate): 999 left after one more.
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 999));
    up.release();
    s.until("0\r\n\r\n").await;
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 978));

    let mut s = Streamed::post(gw.addr, "/v1/anthropic?in=25&out=42", &[("x-api-key", "k")]).await;
    s.until("message_start").await;
    assert_eq!(s.head(), (200, 978));
    up.release();
    s.until("0\r\n\r\n").await;
    // 25 in, 42 out: 67.
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 911));
    assert_eq!(costs(&gw).await, counted(3.0, 2.0, 0.0, 0.0, 0.0));
}

/// `estimate: 500` is charged at admission: while a stream runs, a second
/// request takes the other 500 and a third does not fit (429, never forwarded);
/// as each ends, what it did not use is given back.
async fn an_estimate_is_held_while_a_request_runs_and_the_rest_given_back(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: /usage/total_tokens, estimate: 500}",
    )
    .await;
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", &[("x-api-key", "k")]).await;
    s.until("\"first\"").await;
    // Remaining after this request's estimate.
    assert_eq!(s.head(), (200, 500));
    assert_eq!(call(&gw, "/v1/json?t=100", "k").await, (200, 0));
    // The JSON request used 100: 400 given back, 400 left; 500 does not fit.
    assert_eq!(call(&gw, "/v1/json?t=1", "k").await.0, 429);
    assert_eq!(up.hits(), 2);
    up.release();
    s.until("0\r\n\r\n").await;
    // The stream used 21: 479 back, 879 left, 379 after the next estimate.
    assert_eq!(call(&gw, "/v1/json?t=9", "k").await, (200, 379));
    assert_eq!(call(&gw, "/v1/json?t=9", "k").await, (200, 370));
    assert_eq!(costs(&gw).await, counted(3.0, 1.0, 0.0, 0.0, 0.0));
}

/// `estimate: "json:/max_tokens"`: the request's own bound is held (its
/// `default` when the body has none), and settled at the end.
async fn an_estimate_read_from_the_request_body_is_held(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: /usage/total_tokens, estimate: \"json:/max_tokens\", default: 50}",
    )
    .await;
    let c = http1();
    let ask = |body: &'static str, t: u32| {
        let (c, u) = (&c, url(gw.addr, &format!("/v1/json?t={t}")));
        async move {
            let h = [("x-api-key", "k"), ("content-type", "application/json")];
            let r = c.send(http::Method::POST, &u, &h, body).await;
            (r.status, r.num("x-ratelimit-remaining"))
        }
    };
    assert_eq!(
        ask(r#"{"model":"m","max_tokens":300}"#, 120).await,
        (200, 700)
    );
    // 180 given back: 880 left. Without max_tokens: 50 held.
    assert_eq!(ask(r#"{"model":"m"}"#, 20).await, (200, 830));
    // 30 back: 860 left. A bound larger than what is left: refused.
    assert_eq!(ask(r#"{"max_tokens":900}"#, 1).await.0, 429);
    assert_eq!(ask(r#"{"max_tokens":860}"#, 60).await, (200, 0));
    assert_eq!(ask(r#"{"max_tokens":800}"#, 1).await, (200, 0));
    assert_eq!(up.hits(), 4);
}

/// A client that goes away mid-stream is charged what the stream had shown
/// (Anthropic's input tokens), else the estimate held (OpenAI's usage comes last).
async fn a_client_that_goes_away_is_charged_what_it_saw_else_the_estimate(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: [/usage/total_tokens, /message/usage/input_tokens, /usage/output_tokens], estimate: 200}",
    )
    .await;
    let mut s = Streamed::post(gw.addr, "/v1/anthropic?in=25&out=42", &[("x-api-key", "k")]).await;
    s.until("message_start").await;
    assert_eq!(s.head(), (200, 800));
    drop(s);
    let settled = |source: &'static str| {
        let gw = &gw;
        move || async move {
            costs(gw)
                .await
                .iter()
                .any(|(s, n)| *s == source && *n == 1.0)
        }
    };
    assert!(eventually(BOUND, settled("sse")).await.is_some());
    // 25 input tokens charged: 175 back, 975 left (775 after the next estimate,
    // which a request of 0 tokens gives back whole).
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 775));
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", &[("x-api-key", "k")]).await;
    s.until("\"first\"").await;
    assert_eq!(s.head(), (200, 775));
    drop(s);
    assert!(eventually(BOUND, settled("estimate")).await.is_some());
    // The estimate stands: 775 left, 575 after the next one.
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 575));
    assert_eq!(costs(&gw).await, counted(2.0, 1.0, 1.0, 0.0, 0.0));
}

/// Events that are not JSON, malformed or longer than sluice reads (256 KiB) are
/// passed on and skipped: the charge is the usage of the events it could read,
/// and the client gets every byte.
async fn malformed_and_oversized_events_are_skipped(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(&store, &up, "{response_json: /usage/total_tokens}").await;
    let r = http1()
        .send(
            http::Method::POST,
            &url(gw.addr, "/v1/odd?t=33"),
            &[("x-api-key", "k")],
            "",
        )
        .await;
    assert_eq!((r.status, r.num("x-ratelimit-remaining")), (200, 999));
    assert!(
        r.body == odd_stream(33),
        "the stream as the upstream sent it"
    );
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 966));
    assert_eq!(costs(&gw).await, counted(1.0, 1.0, 0.0, 0.0, 0.0));
}

/// The upstream closes without answering: sluice answers 502 itself, which
/// charges nothing, so the estimate admission held is given back whole.
async fn an_upstream_that_fails_gives_the_estimate_back(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: /usage/total_tokens, estimate: 500}",
    )
    .await;
    let r = http1()
        .send(
            http::Method::POST,
            &url(gw.addr, "/v1/close"),
            &[("x-api-key", "k")],
            "",
        )
        .await;
    assert_eq!(r.status, 502);
    assert_eq!(call(&gw, "/v1/json?t=10", "k").await, (200, 500));
    assert_eq!(call(&gw, "/v1/json?t=10", "k").await, (200, 490));
    assert_eq!(costs(&gw).await, counted(2.0, 0.0, 0.0, 0.0, 0.0));
}

/// An HTTP/2 client (h2c) is metered alike: its bodies go through hyper's server
/// rather than sluice's HTTP/1 codec.
async fn an_http2_client_is_charged_alike(store: Store) {
    let up = Llm::start().await;
    let gw = gateway(
        &store,
        &up,
        "{response_json: /usage/total_tokens, estimate: 100}",
    )
    .await;
    let c = h2c();
    let ask = |path: &'static str| {
        let (c, u) = (&c, url(gw.addr, path));
        async move {
            let r = c
                .send(http::Method::POST, &u, &[("x-api-key", "k")], "")
                .await;
            (r.status, r.num("x-ratelimit-remaining"), r.body.len())
        }
    };
    assert_eq!(ask("/v1/json?t=40").await.0, 200);
    // 40 used: 960 left, 860 after this one's hold.
    assert_eq!(ask("/v1/odd?t=30").await, (200, 860, odd_stream(30).len()));
    assert_eq!(ask("/v1/json?t=0").await.1, 830);
    assert_eq!(costs(&gw).await, counted(2.0, 1.0, 0.0, 0.0, 0.0));
}
