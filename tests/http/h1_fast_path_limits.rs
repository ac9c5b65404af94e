//! The plain-request server's answers on limited routes, byte for byte as hyper
//! frames them: the rate-limit fields in the same place and order (after the
//! upstream's or the route's own, before a `connection` the server adds), an
//! upstream's own field of the same name replaced where it stood, 429s, HEAD,
//! HTTP/1.0, keep-alive and close, chunked answers with trailers.

use crate::common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A head's lines without `date` (it changes by the second).
fn without_date(text: &str) -> Vec<String> {
    text.split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
        .map(str::to_owned)
        .collect()
}

/// Every route limited per `x-key` by a GCRA (its reset after one request is one
/// emission interval, whenever it is sent), one of them to a burst of 1.
fn config(families: &str, up: &str) -> String {
    format!(
        r#"
response_headers: {families}
upstreams:
  app: {{targets: ["{up}"]}}
routes:
  - name: text
    match: {{path: /text}}
    key: header:x-key
    limits: [{{name: per.key, algorithm: gcra, rate: 10/s, burst: 5}}]
    respond: {{status: 200, body: "ok\n", headers: {{x-route: text}}}}
  - name: tight
    match: {{path_prefix: /tight}}
    key: header:x-key
    limits: [{{name: one, algorithm: gcra, rate: 1/s, burst: 1}}]
    upstream: app
  - name: two
    match: {{path_prefix: /two}}
    key: header:x-key
    limits:
      - {{name: a, algorithm: gcra, rate: 10/s, burst: 5}}
      - {{name: b, algorithm: token_bucket, rate: 2/s, burst: 3}}
    upstream: app
  - name: rest
    match: {{path_prefix: /}}
    key: header:x-key
    limits: [{{name: base, algorithm: gcra, rate: 10/s, burst: 5}}]
    upstream: app
"#
    )
}

/// (request with `{key}` where its key goes, answers to read; the last one is
/// compared, the connection read to its end when `to_close`).
const CASES: &[(&str, usize, bool)] = &[
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\n\r\n", 1, false),
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nconnection: close\r\n\r\n", 1, true),
    ("HEAD /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\n\r\n", 1, false),
    ("GET /a HTTP/1.0\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\n\r\n", 1, true),
    ("GET /a HTTP/1.0\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nconnection: keep-alive\r\n\r\n", 1, false),
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nx-reply-header: x-ratelimit-remaining=77\r\n\r\n", 1, false),
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nx-reply-header: ratelimit=mine\r\nconnection: close\r\n\r\n", 1, true),
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nx-reply-status: 204\r\n\r\n", 1, false),
    ("GET /a HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nx-reply-status: 404\r\n\r\n", 1, false),
    ("GET /t HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nte: trailers\r\nx-reply-trailer: x-sum=7\r\nconnection: close\r\n\r\n", 1, true),
    ("GET /t HTTP/1.0\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nx-reply-trailer: x-sum=7\r\nconnection: keep-alive\r\n\r\n", 1, true),
    ("GET /two HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\n\r\n", 2, false),
    ("GET /text HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\n\r\n", 1, false),
    ("GET /text HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nconnection: close\r\n\r\n", 1, true),
    ("GET /text HTTP/1.0\r\nhost: h\r\nx-key: {key}\r\nconnection: keep-alive\r\n\r\n", 1, false),
    ("GET /tight HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\n\r\n", 2, false),
    ("GET /tight HTTP/1.0\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nconnection: keep-alive\r\n\r\n", 2, false),
    ("GET /tight HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\nx-reply-bytes: 5\r\nconnection: close\r\n\r\n", 2, true),
];

/// A connection on which hyper serves whatever comes next: a request with a body
/// went first.
async fn hyper_connection(addr: std::net::SocketAddr, key: &str) -> TcpStream {
    let mut s = connect(addr).await;
    let upload = format!(
        "POST /upload HTTP/1.1\r\nhost: h\r\nx-key: {key}\r\ncontent-length: 5\r\n\r\nhello"
    );
    s.write_all(upload.as_bytes()).await.expect("write");
    let (head, _) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    s
}

/// The answers to `req` (each request with a key of its own, `n` times) on `s`:
/// the last one's text.
async fn last_answer(s: &mut TcpStream, req: &str, n: usize, to_close: bool) -> String {
    let mut text = String::new();
    for i in 0..n {
        // Only the last request asks to close.
        let this = if i + 1 < n {
            req.replace("connection: close\r\n", "")
        } else {
            req.to_owned()
        };
        s.write_all(this.as_bytes()).await.expect("write");
        text = if to_close && i + 1 == n {
            read_to_close(s).await
        } else if req.starts_with("HEAD") {
            read_head(s).await.expect("a head")
        } else {
            let (head, body) = read_response(s).await.expect("an answer");
            head + &body
        };
    }
    text
}

#[tokio::test]
async fn limited_answers_are_framed_as_hyper_frames_them() {
    let up = upstream().await;
    for families in ["[ietf, x-ratelimit]", "[ietf]", "[x-ratelimit]", "[]"] {
        let gw = start_gateway(&config(families, &up.url())).await;
        for (i, &(req, n, to_close)) in CASES.iter().enumerate() {
            let mut fast = connect(gw.addr).await;
            let mut slow = hyper_connection(gw.addr, &format!("upload-{i}")).await;
            let fast_req = req.replace("{key}", &format!("fast-{i}"));
            let slow_req = req.replace("{key}", &format!("slow-{i}"));
            let fast_text = last_answer(&mut fast, &fast_req, n, to_close).await;
            let slow_text = last_answer(&mut slow, &slow_req, n, to_close).await;
            assert_eq!(
                without_date(&fast_text),
                without_date(&slow_text),
                "{families} {req}"
            );
            if families.contains("x-ratelimit") && !req.contains("/text") {
                assert!(
                    fast_text.contains("\r\nx-ratelimit-limit: "),
                    "{families} {req}: {fast_text}"
                );
            }
            if families == "[]" && !req.contains("x-reply-header") {
                assert!(!fast_text.contains("ratelimit"), "{req}: {fast_text}");
            }
        }
        gw.shutdown().await;
    }
}

/// The fields an answer carries, in order, exactly: the upstream's (its own
/// `x-ratelimit-remaining` replaced in place), then the rate-limit fields.
#[tokio::test]
async fn the_rate_limit_fields_follow_the_upstream_s_in_order() {
    let up = upstream().await;
    let gw = start_gateway(&config("[ietf, x-ratelimit]", &up.url())).await;
    let mut s = connect(gw.addr).await;
    let req = "GET /a HTTP/1.1\r\nhost: h\r\nx-key: k\r\nx-reply-bytes: 5\r\nx-reply-header: x-ratelimit-remaining=77\r\n\r\n";
    let text = last_answer(&mut s, req, 1, false).await;
    let names: Vec<&str> = text
        .split("\r\n")
        .skip(1)
        .filter_map(|l| l.split_once(": ").map(|(n, _)| n))
        .filter(|n| *n != "date")
        .collect();
    assert_eq!(
        names,
        [
            "x-ratelimit-remaining",
            "content-length",
            "ratelimit-policy",
            "ratelimit",
            "x-ratelimit-limit",
            "x-ratelimit-reset"
        ],
        "{text}"
    );
    assert!(text.contains("\r\nx-ratelimit-remaining: 4\r\n"), "{text}");
    assert!(
        text.contains("\r\nratelimit-policy: \"base\";q=5;w=1\r\nratelimit: \"base\";r=4;t=1\r\nx-ratelimit-limit: 5\r\nx-ratelimit-reset: 1\r\n"),
        "{text}"
    );
    gw.shutdown().await;
}
