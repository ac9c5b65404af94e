//! The fields of an upstream's answer as the client gets them, in order and
//! exactly: hop-by-hop ones (`Connection`, what it names, `Keep-Alive`) gone
//! wherever they stood, the rest kept in the order the answer's map gives them.

use crate::common::*;
use tokio::io::AsyncWriteExt;

/// The answers the upstream gives, by request path (`/0`, `/1`, ...).
const ANSWERS: &[&str] = &[
    // As nginx answers: `Connection` last.
    "HTTP/1.1 200 OK\r\nServer: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    // `Connection` in the middle.
    "HTTP/1.1 200 OK\r\nServer: x\r\nConnection: keep-alive\r\nContent-Type: text/plain\r\nX-A: 1\r\nContent-Length: 2\r\n\r\nok",
    // Naming a field.
    "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nContent-Length: 2\r\nConnection: keep-alive, X-A\r\n\r\nok",
    // Twice, and `Keep-Alive`.
    "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nX-A: 1\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    // Upper case, and a field of the same name as a later one.
    "HTTP/1.1 200 OK\r\nX-A: 1\r\nX-B: 2\r\nx-a: 3\r\nContent-Length: 2\r\nCONNECTION: Keep-Alive\r\n\r\nok",
    // `close` (the connection closes after it), naming a field `close`.
    "HTTP/1.1 200 OK\r\nClose: x\r\nX-A: 1\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
];

/// The client's view: the head's lines without `date`.
const EXPECTED: &[&[&str]] = &[
    &[
        "HTTP/1.1 200 OK",
        "server: x",
        "content-type: text/plain",
        "content-length: 2",
    ],
    &[
        "HTTP/1.1 200 OK",
        "server: x",
        "content-length: 2",
        "content-type: text/plain",
        "x-a: 1",
    ],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-b: 2"],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-a: 1"],
    &[
        "HTTP/1.1 200 OK",
        "x-a: 1",
        "x-a: 3",
        "x-b: 2",
        "content-length: 2",
    ],
    &["HTTP/1.1 200 OK", "content-length: 2", "x-a: 1"],
];

#[tokio::test]
async fn hop_by_hop_fields_go_wherever_they_stand() {
    let (up, _) = raw_upstream(|mut s| async move {
        while let Some(head) = read_head(&mut s).await {
            let path = head.split(' ').nth(1).unwrap_or("/0");
            let i: usize = path.trim_start_matches('/').parse().unwrap_or(0);
            if s.write_all(ANSWERS[i].as_bytes()).await.is_err() || ANSWERS[i].contains("close") {
                return;
            }
        }
    })
    .await;
    let gw = start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"http://{up}\"]}}\nroutes:\n  - {{name: all, match: {{path_prefix: /}}, upstream: app}}\n"
    ))
    .await;
    // Twice each: on a new upstream connection, then on a kept one.
    for round in 0..2 {
        let mut c = connect(gw.addr).await;
        for (i, expected) in EXPECTED.iter().enumerate() {
            let req = format!("GET /{i} HTTP/1.1\r\nhost: h\r\n\r\n");
            c.write_all(req.as_bytes()).await.expect("write");
            let (head, body) = read_response(&mut c).await.expect("an answer");
            let lines: Vec<&str> = head
                .split("\r\n")
                .filter(|l| !l.is_empty() && !l.starts_with("date:"))
                .collect();
            assert_eq!(lines, *expected, "round {round}, answer {i}");
            assert_eq!(body, "ok");
        }
    }
    gw.shutdown().await;
}
