//! HTTP/1.1 to upstreams as sluice speaks it (src/http/h1/upstream.rs), against hostile and
//! unusual upstreams written byte by byte: heads that arrive in pieces, answers that
//! come while the upload goes on, bodies cut short, malformed framing, bytes nobody
//! asked for, request trailers, and what may be sent twice.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request};
use http_body::Frame;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long one step of these tests may take (the upstream timeout is 1 s).
const STEP: Duration = Duration::from_secs(4);

async fn step<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(STEP, f)
        .await
        .unwrap_or_else(|_| panic!("{what}: nothing within {STEP:?}"))
}

fn config(up: SocketAddr) -> String {
    format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 1s}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    )
}

/// Reads from `s` until `buf` ends with `end`; false on EOF first.
async fn read_until(s: &mut TcpStream, buf: &mut Vec<u8>, end: &[u8]) -> bool {
    let mut b = [0u8; 4096];
    while !buf.ends_with(end) {
        match step("upstream read", s.read(&mut b)).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => buf.extend_from_slice(&b[..n]),
        }
    }
    true
}

/// A status line cut in two, the rest 100 ms later (a slow upstream, or TCP
/// segments): the head is read once whole. sluice's worker spun on the partial head
/// without reading on, for ever, at 100% CPU (no timeout could fire).
#[tokio::test]
async fn a_response_head_that_arrives_in_pieces_is_read_once_whole() {
    let (up, _) = raw_upstream(|mut s| async move {
        while read_head(&mut s).await.is_some() {
            for piece in [&b"HTTP/1.1 200 OK\r\ncontent-"[..], b"length: 2\r\n\r\nok"] {
                if s.write_all(piece).await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for _ in 0..2 {
        let r = step(
            "GET",
            client.try_send(Method::GET, &url(gw.addr, "/"), &[], Bytes::new()),
        )
        .await
        .expect("an answer");
        assert_eq!((r.status, r.text()), (200, "ok"));
    }
}

/// An upstream that answers as soon as the request body starts and streams its
/// answer while the body goes on (an echo, a transcoder): hyper's client went on
/// sending the body after the response head; sluice stopped the upload at the head,
/// so the upstream waited for the rest of a body that never came.
#[tokio::test]
async fn the_upload_goes_on_while_the_upstream_streams_its_answer() {
    let (up, _) = raw_upstream(|mut s| async move {
        let mut got = Vec::new();
        if !read_until(&mut s, &mut got, b"5\r\nhello\r\n").await {
            return;
        }
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n";
        if s.write_all(head).await.is_err() || !read_until(&mut s, &mut got, b"0\r\n\r\n").await {
            return;
        }
        let _ = s.write_all(b"5\r\nworld\r\n0\r\n\r\n").await;
    })
    .await;
    // Full duplex: nothing read ahead (`server.request_buffer: 0`).
    let gw =
        start_gateway(&config(up).replace("workers: 1", "workers: 1, request_buffer: 0")).await;
    let mut c = connect(gw.addr).await;
    c.write_all(
        b"POST /duplex HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let mut got = Vec::new();
    assert!(read_until(&mut c, &mut got, b"hello\r\n").await, "{got:?}");
    assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"), "{got:?}");
    c.write_all(b"5\r\nworld\r\n0\r\n\r\n").await.unwrap();
    got.clear();
    let ended = read_until(&mut c, &mut got, b"0\r\n\r\n").await;
    assert_eq!(
        (ended, String::from_utf8_lossy(&got).as_ref()),
        (true, "5\r\nworld\r\n0\r\n\r\n")
    );
}

/// A kept connection the upstream closes after reading the request, without an
/// answer (docs/request-path.md, Forwarding): a request safe to repeat (GET, no body) goes again
/// on a new connection; a POST, even without a body, reached the upstream once and
/// gets a 502, never a second send.
#[tokio::test]
async fn only_a_request_safe_to_repeat_is_sent_again_after_a_silent_close() {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    let (up, _) = raw_upstream(move |mut s| {
        let log = log.clone();
        async move {
            // The first request on each connection is answered, keep-alive; the
            // second is read, and the connection closed without an answer.
            for n in 0.. {
                let Some(head) = read_head(&mut s).await else {
                    return;
                };
                let line = head.split("\r\n").next().unwrap_or("").to_string();
                log.lock().unwrap().push(line);
                if n == 1 {
                    return;
                }
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if s.write_all(answer).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    let mut statuses = Vec::new();
    for (method, path) in [
        (Method::GET, "/a"),
        (Method::POST, "/p"),
        (Method::GET, "/b"),
        (Method::GET, "/c"),
    ] {
        let r = step(path, client.send(method, &url(gw.addr, path), &[], "")).await;
        statuses.push(r.status);
    }
    assert_eq!(statuses, [200, 502, 200, 200]);
    assert_eq!(
        *seen.lock().unwrap(),
        [
            "GET /a HTTP/1.1",
            "POST /p HTTP/1.1",
            "GET /b HTTP/1.1",
            "GET /c HTTP/1.1",
            "GET /c HTTP/1.1"
        ]
    );
}

/// Bytes after an answer without a body (204, 304, HEAD) are nothing the request
/// asked for: its connection is closed, never lent to the next request, which would
/// take them for its own answer.
#[tokio::test]
async fn bytes_after_a_bodiless_answer_are_never_read_as_the_next_answer() {
    let (up, accepted) = raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let answer: &[u8] = if head.starts_with("GET /empty ") {
                b"HTTP/1.1 204 No Content\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"
            } else if head.starts_with("HEAD ") {
                b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged"
            } else {
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            };
            if s.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    let r = step("204", client.get(&url(gw.addr, "/empty"), &[])).await;
    assert_eq!((r.status, r.text()), (204, ""));
    let r = step("after 204", client.get(&url(gw.addr, "/next"), &[])).await;
    assert_eq!((r.status, r.text()), (200, "ok"));
    let r = step(
        "HEAD",
        client.send(Method::HEAD, &url(gw.addr, "/h"), &[], ""),
    )
    .await;
    assert_eq!((r.status, r.text()), (200, ""));
    let r = step("after HEAD", client.get(&url(gw.addr, "/next"), &[])).await;
    assert_eq!((r.status, r.text()), (200, "ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 3);
}

/// An upstream that closes in the middle of a body: the client sees the body cut
/// (HTTP/1.1: the connection closes short of the length, or without the last
/// chunk, or before the head; h2c: the stream fails), never a clean end.
#[tokio::test]
async fn a_body_the_upstream_cuts_is_cut_for_the_client() {
    let (up, _) = raw_upstream(|mut s| async move {
        if let Some(head) = read_head(&mut s).await {
            let answer: &[u8] = if head.starts_with("GET /length ") {
                b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc"
            } else {
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n"
            };
            let _ = s.write_all(answer).await;
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /length HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let all = step("length", read_to_close(&mut c)).await;
    // The head may not have gone out before the close; if it did, it still
    // announces 10 bytes, and only 3 come.
    assert!(
        all.is_empty()
            || (all
                .to_ascii_lowercase()
                .contains("\r\ncontent-length: 10\r\n")
                && all.ends_with("\r\n\r\nabc")),
        "{all:?}"
    );
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /chunked HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let all = step("chunked", read_to_close(&mut c)).await;
    assert!(
        all.is_empty() || all.ends_with("\r\n\r\n3\r\nabc\r\n"),
        "{all:?}"
    );
    for path in ["/length", "/chunked"] {
        let r = step(
            path,
            h2c().try_send(Method::GET, &url(gw.addr, path), &[], Bytes::new()),
        )
        .await;
        assert!(r.is_err(), "{path}: {r:?}");
    }
}

/// Answers whose framing cannot be trusted are a 502 (or, once the head has gone
/// to the client, a cut body), and their connection is never used again.
#[tokio::test]
async fn malformed_answers_are_502_and_their_connections_closed() {
    let answers: Vec<Vec<u8>> = vec![
        b"HTTP/1.1 200 OK\r\ncontent-length: -1\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ncontent-length: 18446744073709551616\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok".to_vec(),
        b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 100 Continue\r\n\r\nnot http\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\nx: "
            .iter()
            .copied()
            .chain(std::iter::repeat_n(b'a', 70_000))
            .collect(),
    ];
    let n = answers.len();
    let answers = Arc::new(answers);
    let next = Arc::new(AtomicUsize::new(0));
    let (up, accepted) = raw_upstream(move |mut s| {
        let (answers, next) = (answers.clone(), next.clone());
        async move {
            while read_head(&mut s).await.is_some() {
                let i = next.fetch_add(1, Ordering::SeqCst);
                let answer: &[u8] = answers
                    .get(i)
                    .map_or(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", |a| a);
                if s.write_all(answer).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for i in 0..n {
        let r = step("malformed", client.get(&url(gw.addr, "/"), &[])).await;
        assert_eq!(r.status, 502, "answer {i}: {r:?}");
    }
    let r = step("after", client.get(&url(gw.addr, "/"), &[])).await;
    assert_eq!((r.status, r.text()), (200, "ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), n + 1);
}

/// A body of fixed frames without a length (chunked on HTTP/1.1).
struct Frames(VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

/// An upstream that answers a chunked request with its body as it came on the
/// wire: chunk sizes, data, the last chunk and the trailer section.
async fn chunked_echo() -> SocketAddr {
    let (up, _) = raw_upstream(|mut s| async move {
        if read_head(&mut s).await.is_none() {
            return;
        }
        let mut body = Vec::new();
        let mut b = [0u8; 4096];
        while !(body.ends_with(b"\r\n\r\n") && body.windows(5).any(|w| w == b"\r\n0\r\n")) {
            match step("upstream read", s.read(&mut b)).await {
                Ok(0) | Err(_) => return,
                Ok(n) => body.extend_from_slice(&b[..n]),
            }
        }
        let mut answer =
            format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len()).into_bytes();
        answer.extend_from_slice(&body);
        let _ = s.write_all(&answer).await;
    })
    .await;
    up
}

/// A chunked body as it came on the wire: its data, joined, and its trailer lines.
fn dechunk(mut wire: &[u8]) -> (Vec<u8>, Vec<String>) {
    let mut data = Vec::new();
    loop {
        let end = wire
            .windows(2)
            .position(|w| w == b"\r\n")
            .expect("a chunk-size line");
        let size = std::str::from_utf8(&wire[..end]).expect("ASCII chunk size");
        let size = usize::from_str_radix(size, 16).expect("a hex chunk size");
        wire = &wire[end + 2..];
        if size == 0 {
            break;
        }
        data.extend_from_slice(&wire[..size]);
        assert_eq!(&wire[size..size + 2], b"\r\n", "a chunk ends with CRLF");
        wire = &wire[size + 2..];
    }
    let trailers = std::str::from_utf8(wire).expect("ASCII trailers");
    let trailers = trailers
        .strip_suffix("\r\n")
        .expect("the end of the trailers");
    (data, trailers.lines().map(str::to_string).collect())
}

/// Request trailers from an h2c client go on as hyper's client sent them: only the
/// fields the request's `Trailer` header announces, and never one that must not be
/// a trailer (RFC 9110 §6.5.1: `Host`, `Authorization`, `Content-Length`...), which
/// an upstream merging trailers into the head would take as the request's own, nor
/// one with `_` in its name (as a header, it would be dropped). sluice wrote every
/// trailer field it got.
#[tokio::test]
async fn request_trailers_go_on_only_as_announced_and_allowed() {
    let gw = start_gateway(&config(chunked_echo().await)).await;
    let io = TokioIo::new(connect(gw.addr).await);
    let (mut send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
        .await
        .expect("h2c handshake");
    tokio::spawn(conn);
    let mut trailers = HeaderMap::new();
    for (k, v) in [
        ("x-sum", "7"),
        ("x-unannounced", "1"),
        ("x_api_key", "secret"),
        ("authorization", "Bearer forged"),
        ("host", "admin.internal"),
    ] {
        trailers.insert(k, HeaderValue::from_static(v));
    }
    let body = Frames(VecDeque::from([
        Frame::data(Bytes::from_static(b"abc")),
        Frame::trailers(trailers),
    ]));
    let req = Request::post(format!("http://{}/t", gw.addr))
        .header("trailer", "x-sum, authorization, host, x_api_key")
        .body(body)
        .unwrap();
    let resp = step("h2c POST", send.send_request(req))
        .await
        .expect("an answer");
    assert_eq!(resp.status(), 200);
    let got = step("body", resp.into_body().collect())
        .await
        .unwrap()
        .to_bytes();
    assert_eq!(
        String::from_utf8_lossy(&got),
        "3\r\nabc\r\n0\r\nx-sum: 7\r\n\r\n"
    );
}

/// A chunked upload from an HTTP/1.1 client, read ahead (`server.request_buffer`,
/// 64KiB by default) whole when small and in part when larger: the upstream gets
/// the same data, its last chunk and the announced trailer.
#[tokio::test]
async fn a_chunked_upload_and_its_trailer_come_through_the_read_ahead() {
    let gw = start_gateway(&config(chunked_echo().await)).await;
    let small = vec![b"abc".to_vec(), b"defgh".to_vec()];
    let large = vec![pattern(40_000); 3];
    for chunks in [small, large] {
        let mut req =
            b"POST /t HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n"
                .to_vec();
        for c in &chunks {
            req.extend_from_slice(format!("{:x}\r\n", c.len()).as_bytes());
            req.extend_from_slice(c);
            req.extend_from_slice(b"\r\n");
        }
        req.extend_from_slice(b"0\r\nx-sum: 8\r\n\r\n");
        let mut s = connect(gw.addr).await;
        s.write_all(&req).await.expect("write the upload");
        let (head, wire) = step("the answer", read_response(&mut s))
            .await
            .expect("an answer");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        let (data, trailers) = dechunk(wire.as_bytes());
        assert_eq!(data, chunks.concat());
        assert_eq!(trailers, ["x-sum: 8"]);
    }
}

/// The defect: a request header named with `_` is dropped (CGI servers fold `_`
/// into `-`), but the same field sent as a trailer, announced in `Trailer`, went on
/// to the upstream. Now it is dropped from the announced names and from the
/// trailers; the other trailer goes on.
#[tokio::test]
async fn a_trailer_named_with_an_underscore_is_not_forwarded() {
    let gw = start_gateway(&config(chunked_echo().await)).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /t HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\ntrailer: x_api_key, x-sum\r\n\r\n\
          3\r\nabc\r\n0\r\nx_api_key: secret\r\nx-sum: 8\r\n\r\n",
    )
    .await
    .expect("write the upload");
    let (head, wire) = step("the answer", read_response(&mut s))
        .await
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert_eq!(wire, "3\r\nabc\r\n0\r\nx-sum: 8\r\n\r\n");
}

/// `Expect: 100-continue` with the read-ahead (`server.request_buffer`, 64KiB by
/// default) on HTTP/1.1: the client waits for `100 Continue` before it sends its
/// body, gets it, sends the body (10 KB: read ahead whole; 200 KB: in part), and
/// gets the upstream's 200; the upstream got the exact bytes.
#[tokio::test]
async fn expect_100_continue_works_with_the_read_ahead() {
    let up = upstream().await;
    let gw = start_gateway(&config(up.addr)).await;
    for n in [10_000, 200_000] {
        let body = pattern(n);
        let mut s = connect(gw.addr).await;
        let head = format!(
            "POST /up HTTP/1.1\r\nhost: h\r\ncontent-length: {n}\r\nexpect: 100-continue\r\n\r\n"
        );
        s.write_all(head.as_bytes()).await.expect("write the head");
        let interim = step("100 Continue", read_head(&mut s))
            .await
            .expect("an interim answer");
        assert_eq!(interim, "HTTP/1.1 100 Continue\r\n\r\n", "{n}");
        s.write_all(&body).await.expect("write the body");
        let (head, echo) = step("the answer", read_response(&mut s))
            .await
            .expect("an answer");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{n}: {head}");
        let e: Echo = serde_json::from_str(&echo).expect("the echo");
        assert_eq!((e.method.as_str(), e.body_len), ("POST", n));
        assert!(e.body.as_bytes() == body, "{n}: the body differs");
    }
    assert_eq!(up.hits(), 2);
}

/// A request refused before its body is read (here: larger than
/// `max_request_body`) gets no `100 Continue`: the client sends no body, reads the
/// answer, and the connection closes (as hyper closed it).
#[tokio::test]
async fn an_early_answer_sends_no_100_continue() {
    let up = upstream().await;
    let gw = start_gateway(
        &config(up.addr).replace("workers: 1}", "workers: 1, max_request_body: 1KiB}"),
    )
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /up HTTP/1.1\r\nhost: h\r\ncontent-length: 5000\r\nexpect: 100-continue\r\n\r\n",
    )
    .await
    .expect("write the head");
    let (head, _) = step("the answer", read_response(&mut s))
        .await
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    assert_eq!(read_to_close(&mut s).await, "");
    assert_eq!(up.hits(), 0);
}

/// Bytes the upstream sends right after its 101 head belong to the tunnel: the
/// client gets them first, then the two sides are spliced.
#[tokio::test]
async fn bytes_after_a_101_head_go_through_the_tunnel() {
    let (up, _) = raw_upstream(|mut s| async move {
        if read_head(&mut s).await.is_none() {
            return;
        }
        let switch = b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\nfirst";
        if s.write_all(switch).await.is_err() {
            return;
        }
        let (mut r, mut w) = s.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let mut c = connect(gw.addr).await;
    c.write_all(
        b"GET /ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut c).await.expect("a 101");
    assert!(head.starts_with("HTTP/1.1 101 "), "{head:?}");
    let mut got = Vec::new();
    assert!(read_until(&mut c, &mut got, b"first").await);
    assert_eq!(got, b"first");
    c.write_all(b"ping").await.unwrap();
    got.clear();
    assert!(read_until(&mut c, &mut got, b"ping").await);
    assert_eq!(got, b"ping");
}

/// An upstream that answers at once and closes while the upload is still coming:
/// its answer reaches the client (the failed write does not hide it).
#[tokio::test]
async fn an_answer_before_the_upstream_closes_on_an_upload_reaches_the_client() {
    let (up, _) = raw_upstream(|mut s| async move {
        if read_head(&mut s).await.is_some() {
            let _ = s
                .write_all(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
                .await;
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let mut c = connect(gw.addr).await;
    let size = 8 << 20;
    c.write_all(
        format!("POST /up HTTP/1.1\r\nhost: a\r\ncontent-length: {size}\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    let (mut r, mut w) = c.into_split();
    let upload = tokio::spawn(async move {
        let chunk = vec![b'x'; 64 << 10];
        for _ in 0..size / chunk.len() {
            if w.write_all(&chunk).await.is_err() {
                return;
            }
        }
    });
    let mut got = Vec::new();
    let mut b = [0u8; 4096];
    while !got.ends_with(b"big") {
        match step("answer", r.read(&mut b)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
        }
    }
    let got = String::from_utf8_lossy(&got);
    assert!(
        got.starts_with("HTTP/1.1 413 ") && got.ends_with("\r\n\r\nbig"),
        "{got:?}"
    );
    upload.abort();
}

/// With one upstream connection allowed, every way an exchange can fail gives its
/// slot back: a malformed answer, a body cut short, an upstream that never answers
/// (504), an answer before the upload's end, a client that leaves mid-body. Each
/// request after them gets the one connection, never `503 upstream busy`.
#[tokio::test]
async fn no_failure_keeps_the_one_upstream_connection_slot() {
    let (up, _) = raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            let answer: Vec<u8> = match path.as_str() {
                "/malformed" => b"HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\n".to_vec(),
                "/cut" => b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc".to_vec(),
                "/silent" => Vec::new(),
                "/early" => b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n".to_vec(),
                "/big" => {
                    let mut a = b"HTTP/1.1 200 OK\r\ncontent-length: 16777216\r\n\r\n".to_vec();
                    a.resize(a.len() + (16 << 20), b'x');
                    a
                }
                _ => b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
            };
            if s.write_all(&answer).await.is_err() {
                return;
            }
            if path != "/ok" {
                // Never closes by itself: only sluice can let the slot go.
                std::future::pending::<()>().await;
            }
        }
    })
    .await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1, request_buffer: 0}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 300ms, connect_timeout: 500ms, max_connections: 1}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let ok = || async {
        let r = step("ok", http1().get(&url(gw.addr, "/ok"), &[])).await;
        assert_eq!((r.status, r.text()), (200, "ok"));
    };
    let r = step("malformed", http1().get(&url(gw.addr, "/malformed"), &[])).await;
    assert_eq!(r.status, 502);
    ok().await;
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /cut HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut b = [0u8; 64];
    let _ = step("cut", c.read(&mut b)).await;
    drop(c);
    ok().await;
    let r = step("silent", http1().get(&url(gw.addr, "/silent"), &[])).await;
    assert_eq!(r.status, 504);
    ok().await;
    let mut c = connect(gw.addr).await;
    c.write_all(b"POST /early HTTP/1.1\r\nhost: a\r\ncontent-length: 100000\r\n\r\nsome")
        .await
        .unwrap();
    let head = read_head(&mut c).await.expect("the early answer");
    assert!(head.starts_with("HTTP/1.1 401 "), "{head:?}");
    ok().await;
    drop(c);
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut c).await.expect("the big answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
    drop(c);
    ok().await;
}

/// `sluice_upstream_errors_total{kind="reset"}` of the route `rest`.
fn resets(m: &str) -> Option<f64> {
    metric(
        m,
        "sluice_upstream_errors_total{kind=\"reset\",route=\"rest\"}",
    )
}

/// Answers whose framing sluice cannot pass on faithfully (RFC 9112 §6.1, §6.3;
/// nginx refuses the same ones): both `Content-Length` and `Transfer-Encoding`;
/// any transfer coding but one `chunked`; a first chunk-size line that is malformed
/// (it came with the head, so the client had been sent nothing yet).
fn refused_answers() -> Vec<Vec<u8>> {
    const CHUNKED: &[u8] = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
    let chunked = |first: &[u8]| [CHUNKED, first].concat();
    let mut long_extension = b"1;".to_vec();
    long_extension.resize(5000, b'e');
    vec![
        b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\nabc".to_vec(),
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\nabc".to_vec(),
        chunked(b"zz\r\nabc\r\n0\r\n\r\n"),
        chunked(b"-3\r\nabc\r\n0\r\n\r\n"),
        chunked(b"3 x\r\nabc\r\n0\r\n\r\n"),
        chunked(b"3\nabc\r\n0\r\n\r\n"),
        chunked(b"1ffffffffffffffff\r\nx"),
        chunked(&long_extension),
        // Not a whole line yet, but no line starting so can be a chunk size.
        chunked(b"zz"),
        // Later chunks that came with the head (the hostile probe's case: an empty
        // reply before).
        chunked(b"5\r\nhelloXXX\r\n0\r\n\r\n"),
        chunked(b"3\r\nabcX\r\n0\r\n\r\n"),
        chunked(b"2\r\nok\r\nzz\r\n0\r\n\r\n"),
    ]
}

/// Each refused answer is a 502 before anything reaches the client: on the
/// plain-request server (GET), on hyper's (a request with a body), and to an h2c
/// client; its upstream connection is closed (the next request opens a new one),
/// and each counts as `kind="reset"`. The defect: both framings, or
/// `gzip, chunked`, were decoded and passed on (the gzip bytes with nothing to say
/// so, the connection pooled again); a malformed first chunk gave an HTTP/1 client
/// an empty reply without a status line.
#[tokio::test]
async fn answers_framed_so_they_cannot_be_passed_on_are_502() {
    let answers = Arc::new(refused_answers());
    let n = answers.len();
    let served = answers.clone();
    let (up, accepted) = raw_upstream(move |mut s| {
        let answers = served.clone();
        async move {
            while let Some(head) = read_head(&mut s).await {
                if head.contains("\r\ncontent-length: 5\r\n") {
                    let mut body = [0u8; 5];
                    if s.read_exact(&mut body).await.is_err() {
                        return;
                    }
                }
                let path = head.split(' ').nth(1).unwrap_or("");
                let answer: &[u8] = path
                    .strip_prefix("/case/")
                    .and_then(|i| answers.get(i.parse::<usize>().ok()?))
                    .map_or(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", |a| a);
                if s.write_all(answer).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    for i in 0..n {
        let path = format!("/case/{i}");
        let r = step(
            &path,
            http1().try_send(Method::GET, &url(gw.addr, &path), &[], Bytes::new()),
        )
        .await;
        assert_eq!(
            r.map(|r| r.status),
            Ok(502),
            "GET {path} ({:?})",
            String::from_utf8_lossy(&answers[i])
        );
        let r = step(
            &path,
            http1().try_send(
                Method::POST,
                &url(gw.addr, &path),
                &[],
                Bytes::from_static(b"hello"),
            ),
        )
        .await;
        assert_eq!(r.map(|r| r.status), Ok(502), "POST {path}");
        let r = step(
            &path,
            h2c().try_send(Method::GET, &url(gw.addr, &path), &[], Bytes::new()),
        )
        .await;
        assert_eq!(r.map(|r| r.status), Ok(502), "h2c GET {path}");
    }
    for _ in 0..3 {
        let r = step("ok", http1().get(&url(gw.addr, "/ok"), &[])).await;
        assert_eq!((r.status, r.text()), (200, "ok"));
    }
    // One connection for each refused answer, then one for the three `ok`s.
    assert_eq!(accepted.load(Ordering::SeqCst), 3 * n + 1);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(resets(&m), Some((3 * n) as f64));
}

/// A chunked body that goes wrong after the head has gone to the client (a
/// malformed size line that comes after the head, data not followed by CRLF, a
/// trailer block without end) is cut for the client (or answered 502 when it broke
/// before anything was written to the client), its connection is never used again,
/// and each counts as `kind="reset"`.
#[tokio::test]
async fn a_malformed_chunked_body_is_cut_and_its_connection_closed() {
    let (up, accepted) = raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let path = head.split(' ').nth(1).unwrap_or("").to_string();
            let mut answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_vec();
            match path.as_str() {
                "/late-size" => {
                    // The head goes first; the bad size line once it is surely out.
                    if s.write_all(&answer).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    answer = b"zz\r\nabc\r\n0\r\n\r\n".to_vec();
                }
                "/no-crlf" => {
                    // A good first chunk with the head, the bad one once it is out.
                    answer.extend_from_slice(b"3\r\nabc\r\n");
                    if s.write_all(&answer).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    answer = b"3\r\nabcX\r\n0\r\n\r\n".to_vec();
                }
                "/trailers" => {
                    answer.extend_from_slice(b"0\r\n");
                    for _ in 0..10_000 {
                        answer.extend_from_slice(b"x-a: b\r\n");
                    }
                }
                _ => answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok".to_vec(),
            }
            if s.write_all(&answer).await.is_err() {
                return;
            }
        }
    })
    .await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for path in ["/late-size", "/no-crlf", "/trailers"] {
        let r = step(
            path,
            client.try_send(Method::GET, &url(gw.addr, path), &[], Bytes::new()),
        )
        .await;
        if path == "/trailers" {
            // Broken with its head, before anything went to the client: a 502.
            let r = r.expect("an answer");
            assert_eq!((r.status, r.text()), (502, "upstream unavailable\n"));
        } else {
            assert!(r.is_err(), "{path}: {r:?}");
        }
        let r = step("ok", client.get(&url(gw.addr, "/ok"), &[])).await;
        assert_eq!((r.status, r.text()), (200, "ok"), "after {path}");
    }
    // The head of the late one reached the client before the cut.
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /late-size HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let all = step("late-size", read_to_close(&mut c)).await;
    assert!(all.starts_with("HTTP/1.1 200 OK\r\n"), "{all:?}");
    assert!(all.ends_with("\r\n\r\n"), "nothing after the head: {all:?}");
    // Each bad body after the first closed the connection the `ok` before it had
    // used: none was ever used again.
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(resets(&m), Some(4.0));
}

/// A TLS upstream that closes its kept connections while they are idle (with a
/// close_notify, or just the TCP connection): the next request notices before it
/// writes a byte and goes on a new connection (a request written on a closed one
/// would be a 502, since it is never sent twice).
#[tokio::test]
async fn idle_tls_connections_the_upstream_closed_are_not_used_again() {
    let certs = self_signed();
    let acceptor = certs.acceptor();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let closed = Arc::new(AtomicUsize::new(0));
    let closes = closed.clone();
    tokio::spawn(async move {
        let mut n = 0;
        while let Ok((s, _)) = listener.accept().await {
            n += 1;
            let (acceptor, closes) = (acceptor.clone(), closes.clone());
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(s).await else {
                    return;
                };
                if read_head_from(&mut s).await.is_none() {
                    return;
                }
                let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                if s.write_all(answer).await.is_err() || s.flush().await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
                // Every other connection says close_notify first.
                if n % 2 == 0 {
                    let _ = s.shutdown().await;
                }
                drop(s);
                closes.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1}}\nupstreams:\n  app: {{targets: [\"https://{up}\"], probe: false, timeout: 1s, tls_ca: \"{}\"}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n",
        certs.cert_pem.path().display()
    ))
    .await;
    let client = http1();
    for n in 1..=4 {
        let r = step("GET", client.get(&url(gw.addr, "/"), &[])).await;
        assert_eq!((r.status, r.text()), (200, "ok"), "request {n}");
        let gone = eventually(Duration::from_secs(2), || async {
            closed.load(Ordering::SeqCst) == n
        })
        .await;
        assert!(gone.is_some(), "the upstream closed connection {n}");
    }
}

/// Reads a head (up to its empty line) from any stream.
async fn read_head_from<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Option<Vec<u8>> {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match step("read head", s.read(&mut byte)).await {
            Ok(1) => head.push(byte[0]),
            _ => return None,
        }
    }
    Some(head)
}
