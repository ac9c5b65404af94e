//! Token-metered APIs end to end (`cost: {response_json, estimate}`): a real
//! upstream answers OpenAI- and Anthropic-shaped JSON and event streams, and each
//! test asserts the exact statuses, `X-RateLimit-Remaining` values and
//! `sluice_response_costs_total` lines, on the memory store and on Redis.
//! Streams are held by the upstream after their first event until the test has
//! seen that event at the client: a proxy that buffered would never show it.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

use crate::common::*;
use crate::gateway::Store;

on_both_stores!(
    a_json_body_charges_its_total_tokens,
    a_stream_passes_undelayed_and_is_charged_its_last_usage,
    an_estimate_is_held_while_a_request_runs_and_the_rest_given_back,
    an_estimate_read_from_the_request_body_is_held,
    a_client_that_goes_away_is_charged_what_it_saw_else_the_estimate,
    malformed_and_oversized_events_are_skipped,
);

// === the upstream ===

/// An LLM-shaped upstream: `/v1/json?t=N` answers OpenAI's JSON with `N` total
/// tokens; `/v1/openai?t=N` streams a first event, waits for the gate, then the
/// usage event and `[DONE]`; `/v1/anthropic?in=A&out=B` streams `message_start`
/// (A input tokens), waits, then two `message_delta`s (3, then B output tokens);
/// `/v1/odd?t=N` streams a non-JSON event, an event over sluice's bound, a
/// malformed one and the usage; `/v1/bad` is a JSON body that is not JSON.
struct Llm {
    addr: SocketAddr,
    /// A held stream goes on once per permit.
    gate: Arc<Semaphore>,
    hits: Arc<std::sync::atomic::AtomicUsize>,
}

impl Llm {
    async fn start() -> Llm {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let gate = Arc::new(Semaphore::new(0));
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (g, h) = (gate.clone(), hits.clone());
        tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(serve(conn, g.clone(), h.clone()));
            }
        });
        Llm { addr, gate, hits }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// One held stream goes on.
    fn release(&self) {
        self.gate.add_permits(1);
    }

    fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// One upstream connection: requests answered in turn.
async fn serve(
    mut conn: TcpStream,
    gate: Arc<Semaphore>,
    hits: Arc<std::sync::atomic::AtomicUsize>,
) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
            .unwrap_or(0);
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..head_end + length);
        hits.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let target = head.split(' ').nth(1).unwrap_or("/").to_string();
        let (path, query) = target.split_once('?').unwrap_or((&target, ""));
        let q = |name: &str| -> u64 {
            query
                .split('&')
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('=')?.parse().ok())
                .unwrap_or(0)
        };
        let ok = match path {
            "/v1/json" => {
                let t = q("t");
                let body = format!(
                    r#"{{"id":"chatcmpl-1","object":"chat.completion","usage":{{"prompt_tokens":1,"completion_tokens":{},"total_tokens":{t}}}}}"#,
                    t.saturating_sub(1)
                );
                full(&mut conn, "application/json", body.as_bytes()).await
            }
            "/v1/bad" => {
                full(
                    &mut conn,
                    "application/json",
                    br#"{"usage":{"total_tokens":5"#,
                )
                .await
            }
            "/v1/openai" => {
                let t = q("t");
                let last = format!(
                    "data: {{\"choices\":[],\"usage\":{{\"prompt_tokens\":1,\"completion_tokens\":{},\"total_tokens\":{t}}}}}\n\ndata: [DONE]\n\n",
                    t.saturating_sub(1)
                );
                stream(
                    &mut conn,
                    &[b"data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}],\"usage\":null}\n\n", last.as_bytes()],
                    &gate,
                )
                .await
            }
            "/v1/anthropic" => {
                let start = format!(
                    "event: message_start\ndata: {{\"type\":\"message_start\",\"message\":{{\"usage\":{{\"input_tokens\":{},\"output_tokens\":1}}}}}}\n\n",
                    q("in")
                );
                let rest = format!(
                    "event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":3}}}}\n\n\
                     event: message_delta\ndata: {{\"type\":\"message_delta\",\"usage\":{{\"output_tokens\":{}}}}}\n\n\
                     event: message_stop\ndata: {{\"type\":\"message_stop\"}}\n\n",
                    q("out")
                );
                stream(&mut conn, &[start.as_bytes(), rest.as_bytes()], &gate).await
            }
            // Not held: every event at once, in chunks of every size.
            "/v1/odd" => stream_unheld(&mut conn, &odd_stream(q("t"))).await,
            _ => full(&mut conn, "text/plain", b"no such path\n").await,
        };
        if !ok {
            return;
        }
    }
}

async fn full(conn: &mut TcpStream, content_type: &str, body: &[u8]) -> bool {
    let head = format!(
        "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    conn.write_all(&[head.as_bytes(), body].concat())
        .await
        .is_ok()
}

/// A chunked event stream: the first event, then (once the gate lets it) the rest.
async fn stream(conn: &mut TcpStream, parts: &[&[u8]], gate: &Semaphore) -> bool {
    let head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    if conn
        .write_all(&[head.as_bytes(), &chunk(parts[0])].concat())
        .await
        .is_err()
    {
        return false;
    }
    match gate.acquire().await {
        Ok(p) => p.forget(),
        Err(_) => return false,
    }
    for p in &parts[1..] {
        if conn.write_all(&chunk(p)).await.is_err() {
            return false;
        }
    }
    conn.write_all(b"0\r\n\r\n").await.is_ok()
}

/// `/v1/odd`'s events: a comment, an event that is not JSON, one longer than
/// sluice reads (with a usage that must not count), a malformed one, the usage of
/// `t` tokens and `[DONE]`.
fn odd_stream(t: u64) -> Vec<u8> {
    let mut huge = b"data: {\"pad\":\"".to_vec();
    huge.resize(300 * 1024, b'x');
    huge.extend_from_slice(b"\",\"usage\":{\"total_tokens\":99999}}\n\n");
    let usage = format!("data: {{\"usage\":{{\"total_tokens\":{t}}}}}\n\n");
    [
        &b": keep-alive\n\ndata: hello, not JSON\n\n"[..],
        &huge,
        b"data: {\"usage\":{\"total_tokens\":\n\n",
        usage.as_bytes(),
        b"data: [DONE]\n\n",
    ]
    .concat()
}

async fn stream_unheld(conn: &mut TcpStream, all: &[u8]) -> bool {
    let head =
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n";
    let mut out = head.as_bytes().to_vec();
    // Chunks of 1, 2, 3, ... bytes, then the rest: events split everywhere.
    let (mut at, mut n) = (0, 1);
    while at < all.len() {
        let end = (at + n).min(all.len());
        out.extend_from_slice(&chunk(&all[at..end]));
        at = end;
        n = if n < 64 { n + 1 } else { 64 * 1024 };
    }
    out.extend_from_slice(b"0\r\n\r\n");
    conn.write_all(&out).await.is_ok()
}

fn chunk(data: &[u8]) -> Vec<u8> {
    [format!("{:x}\r\n", data.len()).as_bytes(), data, b"\r\n"].concat()
}

// === a client that reads a stream as it comes ===

/// A request to the gateway on a connection of its own, its answer read as it
/// arrives.
struct Streamed {
    conn: TcpStream,
    got: Vec<u8>,
}

impl Streamed {
    async fn post(gw: SocketAddr, path: &str, key: &str) -> Streamed {
        let mut conn = TcpStream::connect(gw).await.unwrap();
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: llm\r\nx-api-key: {key}\r\nContent-Length: 0\r\n\r\n"
        );
        conn.write_all(req.as_bytes()).await.unwrap();
        Streamed {
            conn,
            got: Vec::new(),
        }
    }

    /// Reads until `needle` has arrived (within a bound: it must come without the
    /// upstream sending anything more).
    async fn until(&mut self, needle: &str) {
        let read = async {
            while !String::from_utf8_lossy(&self.got).contains(needle) {
                let mut buf = [0u8; 4096];
                let n = self.conn.read(&mut buf).await.unwrap();
                assert!(
                    n > 0,
                    "closed before {needle:?}: {:?}",
                    String::from_utf8_lossy(&self.got)
                );
                self.got.extend_from_slice(&buf[..n]);
            }
        };
        bounded(needle, read).await;
    }

    /// The answer's status and `X-RateLimit-Remaining` (once its head has come).
    fn head(&self) -> (u16, u64) {
        let text = String::from_utf8_lossy(&self.got);
        let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap();
        let remaining = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case("x-ratelimit-remaining")
                    .then(|| v.trim().parse().ok())
                    .flatten()
            })
            .unwrap();
        (status, remaining)
    }
}

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
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", "k").await;
    s.until("\"first\"").await;
    assert_eq!(s.head(), (200, 999));
    // Nothing charged while it runs (no estimate): 999 left after one more.
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 999));
    up.release();
    s.until("0\r\n\r\n").await;
    assert_eq!(call(&gw, "/v1/json?t=0", "k").await, (200, 978));

    let mut s = Streamed::post(gw.addr, "/v1/anthropic?in=25&out=42", "k").await;
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
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", "k").await;
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
    let mut s = Streamed::post(gw.addr, "/v1/anthropic?in=25&out=42", "k").await;
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
    let mut s = Streamed::post(gw.addr, "/v1/openai?t=21", "k").await;
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
