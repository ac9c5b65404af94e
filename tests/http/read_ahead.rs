//! The process-wide bound on request bodies read ahead (`server.max_buffered_bytes`),
//! against the real binary: h2c clients whose streams each send most of the
//! `request_buffer` of a declared large body and then stall. The bytes held stay
//! within the bound, the streams past it are answered 503 and counted, and every
//! byte counted is given back when the clients go.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use tokio::io::AsyncWriteExt;

use crate::common::redis::SluiceProcess;
use crate::common::*;

const CONNECTIONS: usize = 2;
const STREAMS: usize = 128;
/// What each stream sends of its declared 1 MB body before it stalls: just under
/// `request_buffer` (64KiB), so the read-ahead keeps waiting for more.
const SENT: usize = 65_000;
const MAX: usize = 2 * 1024 * 1024;

fn held_and_refused(m: &str) -> (usize, usize) {
    let held = metric(m, "sluice_read_ahead_bytes").expect("sluice_read_ahead_bytes");
    let refused =
        metric(m, "sluice_read_ahead_refused_total").expect("sluice_read_ahead_refused_total");
    (held as usize, refused as usize)
}

#[tokio::test]
async fn stalled_h2c_uploads_hold_at_most_max_buffered_bytes() {
    let up = upstream().await;
    let yaml = format!(
        r#"server: {{listen: "${{SLUICE_LISTEN}}", max_buffered_bytes: {MAX}}}
admin: {{listen: "${{SLUICE_ADMIN_LISTEN}}"}}
upstreams:
  app: {{targets: ["{}"], probe: false}}
routes:
  - {{name: up, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    );
    let gw = SluiceProcess::start_env(&yaml, &[]).await;
    // Both series exist from the start, at 0.
    assert_eq!(held_and_refused(&metrics(gw.admin).await), (0, 0));

    let answered_503 = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    let mut bodies = Vec::new();
    for _ in 0..CONNECTIONS {
        let tcp = connect(gw.addr).await;
        let (client, conn) = h2::client::handshake(tcp).await.expect("h2c handshake");
        let conn = tokio::spawn(conn);
        let mut client = client.ready().await.expect("ready");
        for _ in 0..STREAMS {
            let req = Request::post(format!("http://{}/upload", gw.addr))
                .header("content-length", "1000000")
                .body(())
                .unwrap();
            let (answer, mut body) = client.send_request(req, false).expect("a stream");
            body.send_data(Bytes::from(vec![b'x'; SENT]), false)
                .expect("data");
            bodies.push(body);
            let count = answered_503.clone();
            clients.push(tokio::spawn(async move {
                if let Ok(r) = answer.await {
                    if r.status() == 503 {
                        count.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }));
            client = client.ready().await.expect("ready");
        }
        clients.push(conn_task(conn));
    }

    // Settled: every stream either holds all it sent or was refused.
    let total = CONNECTIONS * STREAMS;
    let last = until(gw.admin, BOUND, |(held, refused)| {
        held % SENT == 0 && held / SENT + refused == total
    })
    .await;
    let (held, refused) = last;
    assert!(held <= MAX, "{held} bytes held, over {MAX}");
    assert!(held > 0 && refused > 0, "{last:?}");
    // Each refusal is a 503 the client read.
    let answered = eventually(Duration::from_secs(2), || async {
        answered_503.load(Ordering::SeqCst) == refused
    })
    .await;
    assert!(
        answered.is_some(),
        "{} answered 503, {refused} refused",
        answered_503.load(Ordering::SeqCst)
    );
    assert_eq!(up.hits(), 0, "no stalled upload reached the upstream");

    // The clients go: every byte counted is given back.
    drop(bodies);
    for c in clients {
        c.abort();
    }
    let now = until(gw.admin, Duration::from_secs(2), |(held, _)| held == 0).await;
    assert_eq!(now.1, refused);
}

/// The bytes held and the read-aheads refused, once `done` holds of them (polled
/// every 20 ms, for at most `within`).
async fn until(
    admin: std::net::SocketAddr,
    within: Duration,
    done: impl Fn((usize, usize)) -> bool,
) -> (usize, usize) {
    let step = Duration::from_millis(20);
    let mut last = (0, 0);
    for _ in 0..=within.as_millis() / step.as_millis() {
        last = held_and_refused(&metrics(admin).await);
        if done(last) {
            return last;
        }
        tokio::time::sleep(step).await;
    }
    panic!("never settled: held and refused {last:?}");
}

/// The connection's task, as a handle to abort with the streams' tasks.
fn conn_task(conn: tokio::task::JoinHandle<Result<(), h2::Error>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let _ = conn.await;
    })
}

/// Over HTTP/1.1: with the bound at one `request_buffer`, a stalled upload holds
/// it, and the next upload's read-ahead is answered 503 with the connection
/// closed (its body was not read); once the first goes, an upload is read ahead
/// and forwarded again.
#[tokio::test]
async fn an_http1_upload_past_the_bound_gets_503_and_a_close() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"server: {{listen: "127.0.0.1:0", request_buffer: 64KiB, max_buffered_bytes: 64KiB}}
upstreams:
  app: {{targets: ["{}"], probe: false}}
routes:
  - {{name: up, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    ))
    .await;
    let head = "POST /upload HTTP/1.1\r\nhost: h\r\ncontent-length: 1000000\r\n\r\n";
    let mut stalled = connect(gw.addr).await;
    stalled.write_all(head.as_bytes()).await.unwrap();
    stalled.write_all(&[b'x'; SENT]).await.unwrap();
    until(gw.admin_addr, Duration::from_secs(2), |(held, _)| {
        held == SENT
    })
    .await;

    let mut next = connect(gw.addr).await;
    next.write_all(head.as_bytes()).await.unwrap();
    next.write_all(&[b'y'; 1000]).await.unwrap();
    // The answer is read whole once the server closes; the lingering close that
    // waits for the rest of the body ends at the client's end of it.
    let (head, body) = read_response(&mut next).await.expect("an answer");
    next.shutdown().await.unwrap();
    let rest = read_to_close(&mut next).await;
    assert_eq!(rest, "");
    let answer = format!("{head}{body}");
    assert!(
        answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"),
        "{answer}"
    );
    assert!(answer.contains("\r\nconnection: close\r\n"), "{answer}");
    assert!(
        answer.ends_with("\r\n\r\nserver busy: request buffers full\n"),
        "{answer}"
    );
    assert_eq!(
        until(
            gw.admin_addr,
            Duration::from_secs(2),
            |(_, refused)| refused == 1
        )
        .await,
        (SENT, 1)
    );

    // The stalled upload goes: its bytes are given back, and a body is read
    // ahead and forwarded again.
    drop(stalled);
    until(gw.admin_addr, Duration::from_secs(2), |(held, _)| held == 0).await;
    let small =
        "POST /upload HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello";
    let answer = exchange(gw.addr, small.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.contains("\"body\":\"hello\""), "{answer}");
    assert_eq!(up.hits(), 1);
    gw.shutdown().await;
}
