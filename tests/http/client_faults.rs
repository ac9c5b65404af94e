//! A client that breaks its own request body (a malformed chunk, or closing
//! mid-body) is the client's fault: 400 (or just a close when it is gone), decision
//! `bad_request`, `sluice_client_errors_total{kind}`, and never an upstream error.
//! The upstream must never see the request complete.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::common;
use crate::common::*;

/// An upstream that reads every request body to its end before answering 200, and
/// counts the heads it received and the requests whose body arrived complete.
struct Counting {
    addr: SocketAddr,
    heads: Arc<AtomicUsize>,
    complete: Arc<AtomicUsize>,
}

async fn counting_upstream() -> Counting {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let heads = Arc::new(AtomicUsize::new(0));
    let complete = Arc::new(AtomicUsize::new(0));
    let (h, c) = (heads.clone(), complete.clone());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (h, c) = (h.clone(), c.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (h, c) = (h.clone(), c.clone());
                    async move {
                        h.fetch_add(1, Ordering::SeqCst);
                        if req.into_body().collect().await.is_ok() {
                            c.fetch_add(1, Ordering::SeqCst);
                        }
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from("ok\n"))))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Counting {
        addr,
        heads,
        complete,
    }
}

fn config(up: &Counting) -> String {
    format!(
        "upstreams:\n  api: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: up\n    match: {{path_prefix: /}}\n    upstream: api\n",
        up.addr
    )
}

/// The metric lines a client fault moves, in one string.
fn fault_lines(text: &str) -> Vec<String> {
    [
        "sluice_client_errors_total{kind=\"aborted\"}",
        "sluice_client_errors_total{kind=\"body\"}",
        "sluice_requests_total{decision=\"allowed\",route=\"up\"}",
        "sluice_requests_total{decision=\"bad_request\",route=\"up\"}",
        "sluice_upstream_errors_total{kind=\"connect\",route=\"up\"}",
        "sluice_upstream_errors_total{kind=\"reset\",route=\"up\"}",
        "sluice_upstream_errors_total{kind=\"timeout\",route=\"up\"}",
    ]
    .iter()
    .map(|s| format!("{s} {}", metric(text, s).unwrap_or(-1.0)))
    .collect()
}

fn expected(aborted: u32, body: u32, bad_request: u32) -> Vec<String> {
    vec![
        format!("sluice_client_errors_total{{kind=\"aborted\"}} {aborted}"),
        format!("sluice_client_errors_total{{kind=\"body\"}} {body}"),
        "sluice_requests_total{decision=\"allowed\",route=\"up\"} 0".into(),
        format!("sluice_requests_total{{decision=\"bad_request\",route=\"up\"}} {bad_request}"),
        "sluice_upstream_errors_total{kind=\"connect\",route=\"up\"} 0".into(),
        "sluice_upstream_errors_total{kind=\"reset\",route=\"up\"} 0".into(),
        "sluice_upstream_errors_total{kind=\"timeout\",route=\"up\"} 0".into(),
    ]
}

/// Waits (bounded) until the metric lines are `want`; returns the last seen.
async fn settle(admin: SocketAddr, want: &[String]) -> Vec<String> {
    let mut last = Vec::new();
    for _ in 0..100 {
        last = fault_lines(&metrics(admin).await);
        if last == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    last
}

/// The metric lines become `want` (within `settle`'s bound).
async fn assert_settles(admin: SocketAddr, want: Vec<String>) {
    assert_eq!(settle(admin, &want).await, want);
}

/// Waits (bounded, without failing) until the upstream has seen one request head.
async fn wait_for_one_head(up: &Counting) {
    for _ in 0..100 {
        if up.heads.load(Ordering::SeqCst) == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn the_client_errors_start_at_zero() {
    let up = counting_upstream().await;
    let gw = start_gateway(&config(&up)).await;
    assert_eq!(
        fault_lines(&metrics(gw.admin_addr).await),
        expected(0, 0, 0)
    );
}

#[tokio::test]
async fn a_malformed_chunked_body_is_a_bad_request_not_an_upstream_failure() {
    let up = counting_upstream().await;
    let gw = start_gateway(&config(&up)).await;
    let got = exchange(
        gw.addr,
        b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\nZZ-not-a-size\r\n\r\n",
    )
    .await;
    let status = got.lines().next().unwrap_or_default();
    assert_eq!(status, "HTTP/1.1 400 Bad Request", "{got}");
    assert!(got.contains("\r\nconnection: close\r\n"), "{got}");
    assert_settles(gw.admin_addr, expected(0, 1, 1)).await;
    assert_eq!(up.complete.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_client_that_closes_mid_body_is_counted_as_aborted_and_never_completes_upstream() {
    let up = counting_upstream().await;
    // Nothing read ahead: the body streams as it comes.
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", request_buffer: 0}}\n{}",
        config(&up)
    ))
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .expect("write");
    // The head reaches the upstream (the body streams), then the client goes away.
    wait_for_one_head(&up).await;
    assert_eq!(up.heads.load(Ordering::SeqCst), 1);
    drop(s);
    assert_settles(gw.admin_addr, expected(1, 0, 1)).await;
    assert_eq!(up.complete.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_client_that_closes_within_the_request_buffer_never_reaches_the_upstream() {
    let up = counting_upstream().await;
    let gw = start_gateway(&config(&up)).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n0123456789")
        .await
        .expect("write");
    drop(s);
    assert_settles(gw.admin_addr, expected(1, 0, 1)).await;
    assert_eq!(up.heads.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_chunked_body_cut_short_is_aborted_too() {
    let up = counting_upstream().await;
    let gw = start_gateway(&config(&up)).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .expect("write");
    wait_for_one_head(&up).await;
    drop(s);
    assert_settles(gw.admin_addr, expected(1, 0, 1)).await;
    assert_eq!(up.complete.load(Ordering::SeqCst), 0);
    // A complete request still goes through, on the same gateway.
    let ok = exchange(
        gw.addr,
        b"POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi",
    )
    .await;
    assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
    assert_eq!(up.complete.load(Ordering::SeqCst), 1);
}

// === early answers to uploading clients (lingering close) ===

/// Python's `http.client`: `n` POSTs of `size` bytes to `path`, each on a new
/// connection from `source`, over TLS when `tls`; prints what each got, its status
/// or the name of the exception it raised.
const PYTHON_POSTS: &str = r#"
import http.client, ssl, sys
host, port, source, path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
size, n, tls = int(sys.argv[5]), int(sys.argv[6]), sys.argv[7] == "tls"
body = b"x" * size
out = []
for _ in range(n):
    if tls:
        ctx = ssl._create_unverified_context()
        c = http.client.HTTPSConnection(host, port, timeout=20, source_address=(source, 0), context=ctx)
    else:
        c = http.client.HTTPConnection(host, port, timeout=20, source_address=(source, 0))
    try:
        c.request("POST", path, body=body, headers={"content-type": "application/octet-stream"})
        r = c.getresponse()
        r.read()
        out.append(str(r.status))
    except Exception as e:
        out.append(type(e).__name__)
    finally:
        c.close()
print(" ".join(out))
"#;

/// What Python got for each of `n` uploads of `size` bytes (see `PYTHON_POSTS`).
async fn python_posts(
    gw: SocketAddr,
    source: &str,
    path: &str,
    size: usize,
    n: usize,
    tls: bool,
) -> Vec<String> {
    let args = [
        gw.ip().to_string(),
        gw.port().to_string(),
        source.to_string(),
        path.to_string(),
        size.to_string(),
        n.to_string(),
        if tls { "tls" } else { "plain" }.to_string(),
    ];
    let out = tokio::task::spawn_blocking(move || {
        run_grouped(
            std::process::Command::new("python3")
                .arg("-c")
                .arg(PYTHON_POSTS)
                .args(&args),
        )
    })
    .await
    .expect("python3 runs")
    .expect("python3 starts");
    assert!(
        out.status.success(),
        "python3: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

fn times(status: &str, n: usize) -> Vec<String> {
    vec![status.to_string(); n]
}

const MIB: usize = 1024 * 1024;

#[tokio::test]
async fn python_uploading_over_max_request_body_reads_413_not_a_reset() {
    let up = counting_upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_request_body: 1MiB}}\n{}",
        config(&up)
    ))
    .await;
    let got = python_posts(gw.addr, "127.0.0.1", "/upload", 2 * MIB, 10, false).await;
    assert_eq!(got, times("413", 10));
    assert_eq!(up.heads.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn python_uploading_over_max_request_body_over_tls_reads_413() {
    let up = counting_upstream().await;
    let certs = self_signed();
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_request_body: 1MiB, tls: {{cert: \"{}\", key: \"{}\"}}}}\n{}",
        certs.cert_pem.path().display(),
        certs.key_pem.path().display(),
        config(&up)
    ))
    .await;
    let got = python_posts(gw.addr, "127.0.0.1", "/upload", 2 * MIB, 10, true).await;
    assert_eq!(got, times("413", 10));
}

#[tokio::test]
async fn python_uploading_to_a_limited_route_reads_its_429s() {
    let up = counting_upstream().await;
    let gw = start_gateway(&format!(
        "upstreams:\n  api: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: up\n    match: {{path_prefix: /}}\n    upstream: api\n    key: ip\n    limits: [{{algorithm: fixed_window, limit: 1, window: 1h}}]\n",
        up.addr
    ))
    .await;
    let got = python_posts(gw.addr, "127.0.0.1", "/upload", MIB, 10, false).await;
    let mut want = times("429", 10);
    want[0] = "200".into();
    assert_eq!(got, want);
    assert_eq!(up.complete.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn python_uploading_from_a_denied_address_reads_403_and_a_respond_route_its_answer() {
    let up = counting_upstream().await;
    let gw = start_gateway(&format!(
        "deny: {{ips: [127.0.0.2]}}\nupstreams:\n  api: {{targets: [\"http://{}\"]}}\nroutes:\n  - {{name: canned, match: {{path: /canned}}, respond: {{status: 202, body: \"taken\\n\"}}}}\n  - {{name: up, match: {{path_prefix: /}}, upstream: api}}\n",
        up.addr
    ))
    .await;
    let got = python_posts(gw.addr, "127.0.0.2", "/upload", 2 * MIB, 10, false).await;
    assert_eq!(got, times("403", 10));
    let got = python_posts(gw.addr, "127.0.0.1", "/canned", 2 * MIB, 10, false).await;
    assert_eq!(got, times("202", 10));
    assert_eq!(up.heads.load(Ordering::SeqCst), 0);
}

/// Whether a new connection from 127.0.0.1 is served (a GET answered) or closed at
/// once (the address holds its one connection).
async fn served(gw: SocketAddr) -> bool {
    let mut s = connect(gw).await;
    if s.write_all(b"GET /canned HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .is_err()
    {
        return false;
    }
    read_head(&mut s).await.is_some()
}

#[tokio::test]
async fn a_lingering_close_holds_its_connection_slot_until_the_client_is_silent() {
    let gw = start_gateway(
        "server: {listen: \"127.0.0.1:0\", max_request_body: 1KiB, max_connections_per_ip: 1}\nroutes:\n  - {name: canned, match: {path_prefix: /}, respond: {status: 200, body: \"ok\\n\"}}\n",
    )
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 2097152\r\n\r\n")
        .await
        .expect("write head");
    s.write_all(&[b'x'; 64 * 1024]).await.expect("write body");
    let (head, _) = read_response(&mut s).await.expect("the 413");
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");
    // The write side is shut after the answer: the client reads its end at once.
    assert_eq!(read_to_close(&mut s).await, "");
    // What the client goes on sending is read and thrown away (no reset), and the
    // connection holds the address's one slot meanwhile.
    s.write_all(&[b'x'; 64 * 1024])
        .await
        .expect("write more body");
    assert!(!served(gw.addr).await);
    // Silent for LINGER_SILENCE (5s): closed, the slot given back.
    let freed = eventually(Duration::from_secs(10), || served(gw.addr)).await;
    assert!(freed.is_some(), "the lingering close never ended");
}

#[tokio::test]
async fn python_uploading_while_the_store_is_down_under_on_error_deny_reads_503() {
    let mut redis = common::redis::RedisServer::start();
    let up = counting_upstream().await;
    let gw = start_gateway(&format!(
        "store:\n  backend: redis\n  redis: {{url: \"{}\", timeout: 200ms}}\n  on_error: deny\nupstreams:\n  api: {{targets: [\"http://{}\"]}}\nroutes:\n  - name: up\n    match: {{path_prefix: /}}\n    upstream: api\n    key: ip\n    limits: [{{algorithm: fixed_window, limit: 100, window: 1h}}]\n",
        redis.url(),
        up.addr
    ))
    .await;
    redis.kill();
    let got = python_posts(gw.addr, "127.0.0.1", "/upload", 8 * MIB, 10, false).await;
    assert_eq!(got, times("503", 10));
    assert_eq!(up.heads.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_lingering_close_throws_away_at_most_64_mib() {
    let gw = start_gateway(
        "server: {listen: \"127.0.0.1:0\", max_request_body: 1KiB}\nroutes:\n  - {name: canned, match: {path_prefix: /}, respond: {status: 200, body: \"ok\\n\"}}\n",
    )
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 1073741824\r\n\r\n")
        .await
        .expect("write head");
    let (head, _) = read_response(&mut s).await.expect("the 413");
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");
    // Sent as fast as it goes: taken until 64MiB have been thrown away, then the
    // connection is closed (the next writes fail). Never more than 256MiB here.
    let piece = vec![b'x'; 1 << 20];
    let mut sent = 0usize;
    while sent < 256 << 20 {
        match bounded("write", s.write_all(&piece)).await {
            Ok(()) => sent += piece.len(),
            Err(_) => break,
        }
    }
    assert!(
        (64 << 20..128 << 20).contains(&sent),
        "{} MiB taken before the close",
        sent >> 20
    );
}

/// The defect: after stop, a connection that was closing was dropped once
/// `request_header_timeout` passed with nothing in flight, and a lingering close
/// has nothing in flight: the drain was cut mid-read and the client got a reset.
/// Here the header timeout is 200 ms and the client goes on sending for 1.5 s (each
/// write given time to meet a reset): every write is taken, and shutdown waits
/// until the client ends its body.
#[tokio::test]
async fn a_lingering_close_counts_as_open_during_the_shutdown_grace() {
    let gw = start_gateway(
        "server: {listen: \"127.0.0.1:0\", max_request_body: 1KiB, request_header_timeout: 200ms}\nroutes:\n  - {name: canned, match: {path_prefix: /}, respond: {status: 200, body: \"ok\\n\"}}\n",
    )
    .await;
    let addr = gw.addr;
    let mut s = connect(addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 67108864\r\n\r\n")
        .await
        .expect("write head");
    s.write_all(&[b'x'; 64 * 1024]).await.expect("write body");
    let (head, _) = read_response(&mut s).await.expect("the 413");
    assert!(head.starts_with("HTTP/1.1 413 "), "{head}");
    let stopping = tokio::spawn(gw.shutdown());
    let refused = eventually(Duration::from_secs(5), || async {
        tokio::net::TcpStream::connect(addr).await.is_err()
    })
    .await;
    assert!(refused.is_some(), "the listener never closed");
    // Still draining, past the header timeout: the body goes on being taken (a
    // dropped drain would answer the next write with a reset).
    let t0 = std::time::Instant::now();
    let piece = vec![b'x'; 256 * 1024];
    let mut sent = 0usize;
    while t0.elapsed() < Duration::from_millis(1500) {
        bounded("write", s.write_all(&piece))
            .await
            .unwrap_or_else(|e| panic!("after {} KiB of the drain: {e}", sent >> 10));
        sent += piece.len();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(sent >= 3 << 20, "{sent}");
    assert!(!stopping.is_finished(), "shutdown ended during the drain");
    // The client ends its body: the lingering close ends, and so does shutdown.
    s.shutdown().await.expect("shut the write side");
    bounded("shutdown", stopping).await.expect("shutdown task");
}
