//! HTTP/1.1 to upstreams as sluice speaks it (src/wire.rs), against hostile and
//! unusual upstreams written byte by byte: heads that arrive in pieces, answers that
//! come while the upload goes on, bodies cut short, malformed framing, bytes nobody
//! asked for, request trailers, and what may be sent twice.

mod common;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
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

/// A raw upstream on 127.0.0.1 that counts the connections it accepts and serves
/// each with `serve`.
async fn raw_upstream<F, Fut>(serve: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        while let Ok((s, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(s));
        }
    });
    (addr, accepted)
}

fn config(up: SocketAddr) -> String {
    format!(
        "server: {{listen: \"127.0.0.1:0\", workers: 1}}\nupstreams:\n  app: {{targets: [\"http://{up}\"], timeout: 1s}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n"
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
