//! The upstream connection pool: a kept-alive connection is used again for the next
//! request, one the upstream closed while it sat idle is not (the request goes on a
//! new one and succeeds), and one whose response body was not read to its end is
//! never given back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use tokio::io::AsyncWriteExt;

/// A raw HTTP/1.1 upstream that counts the connections it accepts. Each answer is
/// `200` with a body of `body_len` bytes, keep-alive; with `close_after`, it closes
/// the connection that long after each answer (an upstream's keep-alive timeout),
/// without saying so in the answer, and counts it closed.
async fn counting_upstream(
    body_len: usize,
    close_after: Option<Duration>,
) -> (SocketAddr, Arc<AtomicUsize>, Arc<AtomicUsize>) {
    let closed = Arc::new(AtomicUsize::new(0));
    let closes = closed.clone();
    let (addr, accepted) = raw_upstream(move |mut s| {
        let closes = closes.clone();
        async move {
            while read_head(&mut s).await.is_some() {
                let mut answer =
                    format!("HTTP/1.1 200 OK\r\ncontent-length: {body_len}\r\n\r\n").into_bytes();
                answer.extend(std::iter::repeat_n(b'x', body_len));
                if s.write_all(&answer).await.is_err() {
                    return;
                }
                if let Some(after) = close_after {
                    tokio::time::sleep(after).await;
                    drop(s);
                    closes.fetch_add(1, Ordering::SeqCst);
                    return;
                }
            }
        }
    })
    .await;
    (addr, accepted, closed)
}

fn config(up: SocketAddr) -> String {
    format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    )
}

#[tokio::test]
async fn sequential_requests_share_one_kept_connection() {
    let (up, accepted, _) = counting_upstream(5, None).await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for _ in 0..5 {
        let r = client.get(&url(gw.addr, "/"), &[]).await;
        assert_eq!((r.status, r.text()), (200, "xxxxx"));
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_connection_the_upstream_closed_while_idle_is_not_used_again() {
    let (up, accepted, closed) = counting_upstream(2, Some(Duration::from_millis(20))).await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for n in 1..=4 {
        // A POST is never sent again on another connection: only noticing the
        // close before using the connection gets it a 200.
        let r = client
            .send(http::Method::POST, &url(gw.addr, "/"), &[], "")
            .await;
        assert_eq!((r.status, r.text()), (200, "xx"));
        // The upstream closes the connection while it is idle in the pool.
        let gone = eventually(Duration::from_secs(2), || async {
            closed.load(Ordering::SeqCst) == n
        })
        .await;
        assert!(gone.is_some(), "the upstream closed connection {n}");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 4);
}

#[tokio::test]
async fn a_response_the_client_left_half_read_does_not_give_its_connection_back() {
    // Large enough not to fit in the socket buffers at once.
    let (up, accepted, _) = counting_upstream(8 << 20, None).await;
    let gw = start_gateway(&config(up)).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /big HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await.expect("a response head");
    assert!(head.starts_with("HTTP/1.1 200"), "{head:?}");
    drop(s);
    // The next request gets a whole answer on a connection of its own.
    let client = http1();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _ = tx.send(client.get(&url(gw.addr, "/"), &[]).await);
        drop(gw);
    });
    let r = bounded("the second request", rx).await.expect("an answer");
    assert_eq!((r.status, r.text().len()), (200, 8 << 20));
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
}

/// A raw upstream that answers a POST with `401` at once, without reading its body,
/// and anything else with `200 ok`; it counts the connections it accepts.
async fn early_answer_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let answer: &[u8] = if head.starts_with("POST") {
                b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n"
            } else {
                b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
            };
            if s.write_all(answer).await.is_err() {
                return;
            }
            if head.starts_with("POST") {
                // The body is never read: the connection stays busy with it.
                std::future::pending::<()>().await;
            }
        }
    })
    .await
}

/// An upstream that answered before the request body was all sent has its connection
/// back in the pool while the upload goes on: the next request must not wait for
/// that upload (it waited until the upstream timeout and got 504).
#[tokio::test]
async fn a_connection_still_taking_an_upload_is_not_lent_to_the_next_request() {
    let (up, accepted) = early_answer_upstream().await;
    // Streamed as it comes (no read-ahead), so the upload is still going on when
    // the answer arrives.
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1, request_buffer: 0}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], probe: false, timeout: 1s}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let mut upload = connect(gw.addr).await;
    upload
        .write_all(b"POST /upload HTTP/1.1\r\nhost: a\r\ncontent-length: 1000000\r\n\r\nsome")
        .await
        .unwrap();
    let head = read_head(&mut upload).await.expect("the early answer");
    assert!(head.starts_with("HTTP/1.1 401"), "{head:?}");
    // The upload is still open (1,000,000 bytes announced, 4 sent).
    let r = http1().get(&url(gw.addr, "/"), &[]).await;
    assert_eq!((r.status, r.text()), (200, "ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    drop(upload);
}

/// A raw upstream answering every request with a chunked body and a trailer.
async fn trailer_upstream() -> (SocketAddr, Arc<AtomicUsize>) {
    raw_upstream(|mut s| async move {
        while read_head(&mut s).await.is_some() {
            let answer = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\n\r\n2\r\nok\r\n0\r\nx-sum: 42\r\n\r\n";
            if s.write_all(answer).await.is_err() {
                return;
            }
        }
    })
    .await
}

#[tokio::test]
async fn a_response_ending_with_trailers_gives_its_connection_back() {
    let (up, accepted) = trailer_upstream().await;
    let gw = start_gateway(&config(up)).await;
    let client = http1();
    for _ in 0..3 {
        let r = client.get(&url(gw.addr, "/"), &[("te", "trailers")]).await;
        assert_eq!((r.status, r.text()), (200, "ok"));
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// A raw upstream that answers a request's head at once with a chunked `200` and
/// then echoes each chunk of the request body as it arrives (a full-duplex
/// exchange, as streaming services do).
async fn echo_upstream() -> SocketAddr {
    let (addr, _) = raw_upstream(|mut s| async move {
        use tokio::io::AsyncReadExt;
        if read_head(&mut s).await.is_none() {
            return;
        }
        let head = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n";
        if s.write_all(head).await.is_err() {
            return;
        }
        // The request body comes chunked; pass each chunk's bytes back as a chunk.
        let mut buf = [0u8; 4096];
        loop {
            let n = match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            for part in text.split("\r\n").collect::<Vec<_>>().chunks(2) {
                let (Some(size), Some(data)) = (part.first(), part.get(1)) else {
                    continue;
                };
                if size.trim() == "0" {
                    let _ = s.write_all(b"0\r\n\r\n").await;
                    return;
                }
                let chunk = format!("{:x}\r\n{data}\r\n", data.len());
                if s.write_all(chunk.as_bytes()).await.is_err() {
                    return;
                }
            }
        }
    })
    .await;
    addr
}

/// Reads one chunk of a chunked body from a raw client socket.
async fn read_chunk(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut byte = [0u8; 1];
    // `size\r\n`, then `data\r\n`.
    let mut lines = 0;
    while lines < 2 {
        bounded("a chunk", s.read_exact(&mut byte)).await.unwrap();
        got.push(byte[0]);
        if got.ends_with(b"\r\n") {
            lines += 1;
            if got == b"0\r\n" {
                break;
            }
        }
    }
    String::from_utf8(got).unwrap()
}

/// The upstream answers before the request body has been sent and keeps reading
/// it: the rest of the upload goes on while the answer streams back (it was cut
/// at the answer's head, and the echo never came).
#[tokio::test]
async fn an_upload_goes_on_while_an_early_answer_streams_back() {
    let up = echo_upstream().await;
    // Full duplex needs the body streamed as it comes (no read-ahead).
    let gw =
        start_gateway(&config(up).replace("workers: 1", "workers: 1, request_buffer: 0")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /echo HTTP/1.1\r\nhost: a\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
    )
    .await
    .unwrap();
    let head = read_head(&mut s).await.expect("the answer's head");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head:?}");
    assert_eq!(read_chunk(&mut s).await, "5\r\nhello\r\n");
    s.write_all(b"5\r\nworld\r\n").await.unwrap();
    assert_eq!(read_chunk(&mut s).await, "5\r\nworld\r\n");
    s.write_all(b"0\r\n\r\n").await.unwrap();
    assert_eq!(read_chunk(&mut s).await, "0\r\n");
}
