//! Clients that stall mid-request: one that stops reading its response
//! (`server.send_timeout`), one that stops sending its request body
//! (`server.request_body_timeout`), and an idle WebSocket tunnel
//! (`server.tunnel_idle_timeout`); and an upstream that stalls mid-body
//! (`upstreams.*.read_timeout`). Each is cut after its timeout and gives back
//! the upstream connection it held; peers that are slow but progressing are not.

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
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::*;

/// Bytes of the large response body.
const BIG: usize = 32 << 20;

/// An upstream answering `/big` with `BIG` bytes and anything else with `ok`;
/// counts the request bodies that arrived complete.
async fn big_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let big = Bytes::from(vec![b'x'; BIG]);
    let complete = Arc::new(AtomicUsize::new(0));
    let done = complete.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            let (big, done) = (big.clone(), done.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let (big, done) = (big.clone(), done.clone());
                    async move {
                        let big_one = req.uri().path() == "/big";
                        if req.into_body().collect().await.is_ok() {
                            done.fetch_add(1, Ordering::SeqCst);
                        }
                        let body = if big_one {
                            big
                        } else {
                            Bytes::from_static(b"ok")
                        };
                        Ok::<_, Infallible>(Response::new(Full::new(body)))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(s), service)
                    .await;
            });
        }
    });
    (addr, complete)
}

fn config(up: SocketAddr, server: &str) -> String {
    format!(
        "server: {{listen: \"127.0.0.1:0\", {server}}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, max_connections: 1, connect_timeout: 200ms, timeout: 10s}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    )
}

/// Read from `s` until it ends (EOF or reset), at most `within`; the bytes read,
/// or `None` if it was still open.
async fn drain(s: &mut tokio::net::TcpStream, within: Duration) -> Option<usize> {
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0;
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return n,
                Ok(k) => n += k,
            }
        }
    })
    .await
    .ok()
}

/// While the stalled request holds the upstream's only connection, `/small` gets 503;
/// then, once the stalled client is cut, 200 again.
async fn assert_upstream_held_then_freed(gw: SocketAddr) {
    let client = http1();
    let busy = eventually(Duration::from_secs(5), || async {
        client.get(&url(gw, "/small"), &[]).await.status == 503
    })
    .await;
    assert!(busy.is_some(), "the large response never held the upstream");
    let freed = eventually(Duration::from_secs(5), || async {
        client.get(&url(gw, "/small"), &[]).await.status == 200
    })
    .await;
    assert!(
        freed.is_some(),
        "the upstream connection was never given back"
    );
}

/// The stalled connection `slow` is closed (within 5 s) before the whole `BIG` body
/// reached it.
async fn assert_closed_before_the_whole_body(slow: &mut tokio::net::TcpStream) {
    let got = drain(slow, Duration::from_secs(5))
        .await
        .expect("the stalled connection is closed");
    assert!(got < BIG, "the whole body arrived ({got} bytes)");
}

/// One HTTP/2 frame: the 9-byte header, then `payload`.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend_from_slice(&[kind, flags]);
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HEADERS on stream 1, END_STREAM | END_HEADERS: GET http://a/big.
fn get_big_frame() -> Vec<u8> {
    let mut block = vec![0x82, 0x86, 0x04, 4];
    block.extend_from_slice(b"/big");
    block.extend_from_slice(&[0x01, 1, b'a']);
    h2_frame(0x1, 0x5, 1, &block)
}

/// `sluice_upstream_errors_total` for timeouts on the route `rest`.
fn upstream_timeouts(m: &str) -> Option<f64> {
    metric(
        m,
        "sluice_upstream_errors_total{kind=\"timeout\",route=\"rest\"}",
    )
}

/// The reviewer's case: with `max_connections: 1`, a client that asks for a large
/// body and never reads it held the only upstream connection for ever (every other
/// request got 503). Its writes now stall out after `send_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_and_frees_the_upstream() {
    let (up, _) = big_upstream().await;
    let gw = start_gateway(&config(up, "send_timeout: 500ms")).await;
    let mut slow = connect(gw.addr).await;
    slow.write_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    // Wait until the stalled request holds the upstream's only connection.
    assert_upstream_held_then_freed(gw.addr).await;
    // The stalled client's connection was closed before its body was sent.
    assert_closed_before_the_whole_body(&mut slow).await;
}

/// A download read slowly, but steadily, for longer than `send_timeout` is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_reader_gets_the_whole_body() {
    let (up, _) = big_upstream().await;
    let gw = start_gateway(&config(up, "send_timeout: 500ms")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await.expect("a head");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
    assert!(
        head.to_ascii_lowercase()
            .contains(&format!("\r\ncontent-length: {BIG}\r\n")),
        "{head:?}"
    );
    // 1 MiB every 200 ms for 2 s: four times the timeout.
    let mut got = 0;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let n = bounded("slow read", s.read_exact(&mut buf)).await.unwrap();
        got += n;
    }
    // Keep-alive: the connection stays open, so read exactly what is left.
    assert_eq!(got, 10 << 20);
    let mut rest = vec![0u8; BIG - got];
    bounded("the rest", s.read_exact(&mut rest)).await.unwrap();
    assert!(rest.iter().all(|b| *b == b'x'));
}

/// A request body that stops arriving: 408 once `request_body_timeout` passes,
/// counted as a client fault, and the upstream never gets the whole request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_upload_gets_408() {
    let (up, complete) = big_upstream().await;
    let gw = start_gateway(&config(up, "request_body_timeout: 500ms")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 10\r\n\r\nabc")
        .await
        .unwrap();
    // Trickle a byte every 200 ms for a second: progress, not a stall.
    for b in [b"d", b"e", b"f", b"g", b"h"] {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(b).await.unwrap();
    }
    let (head, body) = tokio::time::timeout(Duration::from_secs(5), read_response(&mut s))
        .await
        .expect("an answer within 5s")
        .expect("an answer");
    assert!(head.starts_with("HTTP/1.1 408 "), "{head:?}");
    assert!(
        head.to_ascii_lowercase()
            .contains("\r\nconnection: close\r\n"),
        "{head:?}"
    );
    assert_eq!(body, "request body stalled\n");
    assert_eq!(drain(&mut s, Duration::from_secs(5)).await, Some(0));
    assert_eq!(complete.load(Ordering::SeqCst), 0);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(&m, "sluice_client_errors_total{kind=\"timeout\"}"),
        Some(1.0)
    );
    assert_eq!(upstream_timeouts(&m), Some(0.0));
    assert_eq!(requests(&m, "rest", "bad_request"), 1.0);
    // The upstream connection is free again.
    assert_eq!(http1().get(&url(gw.addr, "/small"), &[]).await.status, 200);
}

/// The `timeout` child exists from the start.
#[tokio::test]
async fn the_client_timeout_counter_starts_at_zero() {
    let gw = start_gateway("routes: []\n").await;
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(&m, "sluice_client_errors_total{kind=\"timeout\"}"),
        Some(0.0)
    );
}

/// A WebSocket tunnel is closed once no byte has crossed it either way for
/// `tunnel_idle_timeout`; traffic keeps it open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_tunnel_is_closed() {
    let up = upstream().await;
    let yaml = format!(
        "server: {{listen: \"127.0.0.1:0\", tunnel_idle_timeout: 500ms}}\nupstreams:\n  app: {{targets: [\"{}\"], probe: false}}\nroutes:\n  - {{name: ws, match: {{path_prefix: /}}, upstream: app}}\n",
        up.url()
    );
    let gw = start_gateway(&yaml).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"GET /ws HTTP/1.1\r\nhost: a\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 101 "), "{head:?}");
    // A message every 200 ms for 2 s: never idle for the timeout.
    for i in 0..10u8 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let msg = [b'm', i];
        s.write_all(&msg).await.unwrap();
        let mut back = [0u8; 2];
        bounded("echo", s.read_exact(&mut back)).await.unwrap();
        assert_eq!(back, msg);
    }
    // Then silence: closed, with nothing more sent.
    assert_eq!(drain(&mut s, Duration::from_secs(5)).await, Some(0));
}

/// The same over h2c: a client that opens every flow-control window but stops
/// reading its socket stalls the whole connection, which is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_client_that_stops_reading_is_cut_and_frees_the_upstream() {
    let (up, _) = big_upstream().await;
    let gw = start_gateway(&config(up, "send_timeout: 500ms")).await;
    let mut slow = connect(gw.addr).await;
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // SETTINGS_INITIAL_WINDOW_SIZE = 2^31-1, and the connection window opened to it.
    bytes.extend(h2_frame(0x4, 0, 0, &[0, 4, 0x7f, 0xff, 0xff, 0xff]));
    bytes.extend(h2_frame(0x8, 0, 0, &0x7fff_0000u32.to_be_bytes()));
    bytes.extend(get_big_frame());
    slow.write_all(&bytes).await.unwrap();
    assert_upstream_held_then_freed(gw.addr).await;
    assert_closed_before_the_whole_body(&mut slow).await;
}

/// An h2c client that reads its socket but never opens one stream's flow-control
/// window: that stream's response is dropped after `send_timeout`, and with it the
/// upstream connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_h2_stream_whose_window_stays_closed_frees_the_upstream() {
    let (up, _) = big_upstream().await;
    let gw = start_gateway(&config(up, "send_timeout: 500ms")).await;
    let mut slow = connect(gw.addr).await;
    let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    // Default windows (64 KiB), never opened.
    bytes.extend(h2_frame(0x4, 0, 0, &[]));
    bytes.extend(get_big_frame());
    slow.write_all(&bytes).await.unwrap();
    // Keep reading the socket: the connection itself never stalls.
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 16];
        let mut n = 0;
        while let Ok(k) = slow.read(&mut buf).await {
            if k == 0 {
                break;
            }
            n += k;
        }
        n
    });
    assert_upstream_held_then_freed(gw.addr).await;
    reader.abort();
}

/// The upstream's `timeout` runs from the end of the request body (and, while it is
/// sent, from its last progress): a slow but steady upload is no upstream timeout.
/// Before, a client trickling its body past `timeout` got 504 counted against the
/// upstream.
#[tokio::test]
async fn a_slow_steady_upload_is_not_an_upstream_timeout() {
    let (up, complete) = big_upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\"}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 600ms}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 8\r\n\r\n")
        .await
        .unwrap();
    // A byte every 200 ms: 1.6 s in all, well past the upstream's 600 ms.
    for b in b"abcdefgh" {
        tokio::time::sleep(Duration::from_millis(200)).await;
        s.write_all(&[*b]).await.unwrap();
    }
    let (head, body) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 "), "{head:?}");
    assert_eq!(body, "ok");
    assert_eq!(complete.load(Ordering::SeqCst), 1);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(upstream_timeouts(&m), Some(0.0));
}

/// An upstream that stops taking the request body is still bounded by its `timeout`
/// (counted from the body's last progress): 504, the upstream's fault.
#[tokio::test]
async fn an_upstream_that_stops_reading_the_body_times_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let up = listener.local_addr().unwrap();
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = held.clone();
    tokio::spawn(async move {
        // Accepts, never reads.
        while let Ok((s, _)) = listener.accept().await {
            h.lock().unwrap().push(s);
        }
    });
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", max_request_body: 256MiB}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 500ms}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    const LEN: usize = 128 << 20;
    let s = connect(gw.addr).await;
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let head = format!("POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: {LEN}\r\n\r\n");
        wr.write_all(head.as_bytes()).await?;
        let chunk = vec![b'x'; 1 << 20];
        for _ in 0..(LEN >> 20) {
            wr.write_all(&chunk).await?;
        }
        Ok::<_, std::io::Error>(wr)
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let head = bounded("a 504", async {
        loop {
            let n = rd.read(&mut buf).await.unwrap_or(0);
            assert!(n > 0, "closed without an answer: {got:?}");
            got.extend_from_slice(&buf[..n]);
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                return String::from_utf8_lossy(&got[..end]).into_owned();
            }
        }
    })
    .await;
    assert!(head.starts_with("HTTP/1.1 504 "), "{head:?}");
    writer.abort();
    let m = metrics(gw.admin_addr).await;
    assert_eq!(upstream_timeouts(&m), Some(1.0));
}

// === an upstream that stalls mid-body (`upstreams.*.read_timeout`) ===

/// A gateway in front of `up` whose response bodies may be silent 300 ms at most.
fn read_timeout_config(up: SocketAddr) -> String {
    format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 2s, read_timeout: 300ms}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    )
}

/// Reads one request head and, when it announces one, its 5-byte body.
async fn read_request(s: &mut tokio::net::TcpStream) -> Option<String> {
    let head = read_head(s).await?;
    if head
        .to_ascii_lowercase()
        .contains("\r\ncontent-length: 5\r\n")
    {
        let mut body = [0u8; 5];
        s.read_exact(&mut body).await.ok()?;
    }
    Some(head)
}

/// The upstream's 7 bytes of a 100-byte body, as the client gets them after the
/// head: as they came (`/length`) or as one chunk (`/chunked`).
fn seven_bytes_as_sent(path: &str) -> &'static str {
    if path == "/chunked" {
        "7\r\n1234567\r\n"
    } else {
        "1234567"
    }
}

/// The defect: an upstream that sent its head and 7 bytes of a 100-byte body, then
/// nothing, held the client and the upstream connection for ever (`timeout` covers
/// only the head). After `read_timeout` of silence the response is cut: an HTTP/1
/// client gets the head and the 7 bytes, then the connection closes (a truncated
/// message, never a well-framed short one); an h2c client's stream fails. The
/// upstream connection is closed, not pooled, and each cut counts as a timeout.
/// On the plain-request server (GET), on hyper's (a request with a body), and h2c.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_that_stalls_mid_body_is_cut_after_read_timeout() {
    let closed = Arc::new(AtomicUsize::new(0));
    let counted = closed.clone();
    let (up, accepted) = raw_upstream(move |mut s| {
        let closed = counted.clone();
        async move {
            let Some(head) = read_request(&mut s).await else {
                return;
            };
            let answer: &[u8] = if head.split(' ').nth(1) == Some("/chunked") {
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n7\r\n1234567\r\n"
            } else {
                b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n1234567"
            };
            if s.write_all(answer).await.is_err() {
                return;
            }
            // Silent from here on: only sluice can end the connection.
            let mut b = [0u8; 64];
            while let Ok(n) = s.read(&mut b).await {
                if n == 0 {
                    break;
                }
            }
            closed.fetch_add(1, Ordering::SeqCst);
        }
    })
    .await;
    let gw = start_gateway(&read_timeout_config(up)).await;
    let mut cuts = 0;
    for path in ["/length", "/chunked"] {
        for request in [
            format!("GET {path} HTTP/1.1\r\nhost: a\r\n\r\n"),
            format!("POST {path} HTTP/1.1\r\nhost: a\r\ncontent-length: 5\r\n\r\nhello"),
        ] {
            let mut c = connect(gw.addr).await;
            c.write_all(request.as_bytes()).await.unwrap();
            let all = tokio::time::timeout(Duration::from_secs(5), read_to_close(&mut c))
                .await
                .unwrap_or_else(|_| panic!("{request:?}: not cut within 5 s"));
            let (head, body) = all.split_once("\r\n\r\n").expect("a head");
            assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head:?}");
            let framing = if path == "/chunked" {
                "\r\ntransfer-encoding: chunked"
            } else {
                "\r\ncontent-length: 100"
            };
            assert!(head.to_ascii_lowercase().contains(framing), "{head:?}");
            assert_eq!(body, seven_bytes_as_sent(path), "{request:?}");
            cuts += 1;
        }
    }
    let h2 = tokio::time::timeout(
        Duration::from_secs(5),
        h2c().try_send(
            http::Method::GET,
            &url(gw.addr, "/length"),
            &[],
            Bytes::new(),
        ),
    )
    .await
    .expect("h2c: not cut within 5 s");
    assert!(h2.is_err(), "{h2:?}");
    cuts += 1;
    let m = metrics(gw.admin_addr).await;
    assert_eq!(upstream_timeouts(&m), Some(f64::from(cuts)));
    let all_closed = eventually(Duration::from_secs(5), || async {
        closed.load(Ordering::SeqCst) == 5
    })
    .await;
    assert!(
        all_closed.is_some(),
        "sluice closed {} of 5 upstream connections",
        closed.load(Ordering::SeqCst)
    );
    assert_eq!(accepted.load(Ordering::SeqCst), 5);
}

/// A body that comes slowly but steadily (a byte every 100 ms, a second in all,
/// past the 300 ms `read_timeout`) is never silent for the timeout: it arrives
/// whole, and nothing is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_but_steady_upstream_body_is_not_cut() {
    let (up, _) = raw_upstream(|mut s| async move {
        while read_request(&mut s).await.is_some() {
            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n")
                .await
                .is_err()
            {
                return;
            }
            for b in b"0123456789" {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if s.write_all(&[*b]).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    let gw = start_gateway(&read_timeout_config(up)).await;
    let r = http1().get(&url(gw.addr, "/slow"), &[]).await;
    assert_eq!((r.status, r.text()), (200, "0123456789"));
    let r = http1()
        .send(http::Method::POST, &url(gw.addr, "/slow"), &[], "hello")
        .await;
    assert_eq!((r.status, r.text()), (200, "0123456789"));
    let r = h2c().get(&url(gw.addr, "/slow"), &[]).await;
    assert_eq!((r.status, r.text()), (200, "0123456789"));
    let m = metrics(gw.admin_addr).await;
    assert_eq!(upstream_timeouts(&m), Some(0.0));
}

/// The defect: an upstream that answered early (its head and part of its body) and
/// then waited for the rest of a slow but live upload was cut after `read_timeout`
/// and counted as an upstream timeout, though the wait was the client's (which
/// `request_body_timeout` bounds). The upload moving is progress: a byte every
/// 100 ms for 1.2 s, past the 300 ms `read_timeout`, with no read-ahead, and the
/// answer comes whole; nothing is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_waiting_on_a_slow_upload_is_not_cut() {
    const UPLOAD: &[u8] = b"abcdefghijkl";
    let received = Arc::new(std::sync::Mutex::new(Vec::new()));
    let got = received.clone();
    let (up, _) = raw_upstream(move |mut s| {
        let got = got.clone();
        async move {
            if read_head(&mut s).await.is_none() {
                return;
            }
            if s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nearly")
                .await
                .is_err()
            {
                return;
            }
            let mut body = [0u8; UPLOAD.len()];
            if s.read_exact(&mut body).await.is_err() {
                return;
            }
            got.lock().unwrap().extend_from_slice(&body);
            let _ = s.write_all(b"-late").await;
        }
    })
    .await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", request_buffer: 0}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 2s, read_timeout: 300ms}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let mut c = connect(gw.addr).await;
    let head = format!(
        "POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: {}\r\n\r\n",
        UPLOAD.len()
    );
    c.write_all(head.as_bytes()).await.unwrap();
    for b in UPLOAD {
        tokio::time::sleep(Duration::from_millis(100)).await;
        c.write_all(&[*b]).await.expect("the upload is not cut off");
    }
    let (head, body) = read_response(&mut c).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head:?}");
    assert_eq!(body, "early-late");
    assert_eq!(received.lock().unwrap().as_slice(), UPLOAD);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(upstream_timeouts(&m), Some(0.0));
}
