//! An HTTP/2 upstream whose response body fails right after its head, before
//! any of the head went to an HTTP/1.1 client: the client gets a 502 (not an
//! empty reply), and the access log says 502 (the upstream's 200 beside it).

use std::time::Duration;

use bytes::Bytes;
use serde_json::Value;

use crate::common::*;
use crate::refusal_logs::Sluice;

/// An h2c upstream (the `h2` crate's server, frame by frame) that answers 200 with
/// `content-length: 100` and then ends the stream after 5 bytes: the head and the
/// broken body come together, and the body fails at its first frame.
async fn failing_after_head() -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    let resp = http::Response::builder()
                        .status(200)
                        .header("content-length", "100")
                        .body(())
                        .unwrap();
                    if let Ok(mut send) = respond.send_response(resp, false) {
                        let _ = send.send_data(Bytes::from_static(b"short"), true);
                    }
                }
            });
        }
    });
    addr
}

#[tokio::test]
async fn a_body_failing_before_the_head_went_is_a_502_logged_as_one() {
    let up = failing_after_head().await;
    let s = Sluice::start_yaml(false, |port, admin| {
        format!(
            "server: {{listen: \"127.0.0.1:{port}\"}}\nadmin: {{listen: \"127.0.0.1:{admin}\"}}\n\
             access_log: {{format: json}}\n\
             upstreams:\n  app: {{targets: [\"http://{up}\"], protocol: h2c}}\n\
             routes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
        )
    })
    .await;
    let addr = format!("127.0.0.1:{}", s.port).parse().unwrap();
    let answer = exchange(addr, b"GET /x HTTP/1.1\r\nhost: h\r\n\r\n").await;
    assert!(
        answer.starts_with("HTTP/1.1 502 Bad Gateway\r\n"),
        "{answer:?}"
    );
    // The access line, once it came through the pipe.
    let mut line = None;
    for _ in 0..(BOUND.as_millis() / 20) {
        line = s
            .lines
            .lock()
            .unwrap()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|v| v["path"] == "/x");
        if line.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let line = line.expect("an access line");
    assert_eq!(line["status"], 502, "{line}");
    assert_eq!(line["upstream_status"], 200, "{line}");
    let m = s.metrics().await;
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"reset\",route=\"all\"}"
        ),
        Some(1.0),
        "{m}"
    );
}
