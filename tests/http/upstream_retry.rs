//! A request without a body that finds its kept upstream connection closed before
//! any answer is sent again, whole, on another; one with a body is not.

use std::sync::atomic::Ordering;

use crate::common::*;
use tokio::io::AsyncWriteExt;

/// An upstream that answers the first request of each connection and closes the
/// connection, unanswered, on the second; each request's head is recorded.
async fn closing_on_the_second() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::Mutex<Vec<String>>>,
) {
    let heads = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = heads.clone();
    let (addr, accepted) = raw_upstream(move |mut s| {
        let seen = seen.clone();
        async move {
            let Some(head) = read_head(&mut s).await else {
                return;
            };
            seen.lock().unwrap().push(head);
            let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
            if s.write_all(answer).await.is_err() {
                return;
            }
            if let Some(head) = read_head(&mut s).await {
                seen.lock().unwrap().push(head);
            }
        }
    })
    .await;
    (addr, accepted, heads)
}

#[tokio::test]
async fn a_plain_request_is_sent_again_on_another_connection() {
    let (up, accepted, heads) = closing_on_the_second().await;
    let gw = start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"http://{up}\"], probe: false}}\nroutes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let mut c = connect(gw.addr).await;
    for path in ["/one", "/two"] {
        let req = format!("GET {path} HTTP/1.1\r\nhost: h\r\nx-a: 1\r\n\r\n");
        c.write_all(req.as_bytes()).await.expect("write");
        let (head, body) = read_response(&mut c).await.expect("an answer");
        assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
        assert_eq!(body, "ok");
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 2);
    let heads = heads.lock().unwrap().clone();
    assert_eq!(heads.len(), 3, "{heads:?}");
    // The same head both times, whole.
    assert!(heads[1].starts_with("GET /two HTTP/1.1\r\n"), "{heads:?}");
    assert_eq!(heads[1], heads[2]);
    gw.shutdown().await;
}

#[tokio::test]
async fn a_request_with_a_body_is_not_sent_again() {
    let (up, accepted, _) = closing_on_the_second().await;
    let gw = start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"http://{up}\"], probe: false}}\nroutes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    let mut c = connect(gw.addr).await;
    c.write_all(b"GET /one HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .expect("write");
    let (head, _) = read_response(&mut c).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    c.write_all(b"POST /two HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\nhi")
        .await
        .expect("write");
    let (head, _) = read_response(&mut c).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 502 Bad Gateway\r\n"), "{head}");
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
    gw.shutdown().await;
}
