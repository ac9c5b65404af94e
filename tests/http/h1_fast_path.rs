//! The gateway's own HTTP/1.1 server: pipelining, plain requests and ones with
//! bodies on one connection, and answers framed byte for byte as hyper frames
//! them (the same request, sent on a fresh connection and on one that served a
//! body first, gets the same head; the encoder was checked against hyper's on such
//! connections while hyper served them).

use crate::common::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// The status line of a head.
fn status_line(head: &str) -> &str {
    head.split("\r\n").next().unwrap_or_default()
}

/// A head's lines without `date` (it changes by the second), lower-cased.
fn without_date(head: &str) -> Vec<String> {
    head.to_ascii_lowercase()
        .split("\r\n")
        .filter(|l| !l.starts_with("date:"))
        .map(str::to_owned)
        .collect()
}

/// Read the answer to `req`: its head and, unless `head_only`, its body.
async fn answer(s: &mut TcpStream, req: &str, head_only: bool) -> (String, String) {
    s.write_all(req.as_bytes()).await.expect("write");
    if head_only {
        (read_head(s).await.expect("a head"), String::new())
    } else {
        read_response(s).await.expect("an answer")
    }
}

#[tokio::test]
async fn pipelined_plain_requests_are_answered_in_order() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"GET /one HTTP/1.1\r\nhost: h\r\n\r\n\
          GET /text HTTP/1.1\r\nhost: h\r\n\r\n\
          GET /three?x=1 HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    let (head, body) = read_response(&mut s).await.expect("first");
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    let echo: Echo = serde_json::from_str(&body).expect("echo");
    assert_eq!(echo.uri, "/one");
    let (head, body) = read_response(&mut s).await.expect("second");
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert_eq!(body, "ok\n");
    let (head, body) = read_response(&mut s).await.expect("third");
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    let echo: Echo = serde_json::from_str(&body).expect("echo");
    assert_eq!(echo.uri, "/three?x=1");
    assert_eq!(read_to_close(&mut s).await, "");
    assert_eq!(up.hits(), 2);
    gw.shutdown().await;
}

#[tokio::test]
async fn requests_with_and_without_bodies_share_a_connection() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    // Sent in one write: each is answered in turn, the body read between the
    // plain requests.
    let mut s = connect(gw.addr).await;
    let mut bytes = b"GET /first HTTP/1.1\r\nhost: h\r\n\r\n".to_vec();
    bytes.extend_from_slice(WITH_BODY);
    bytes.extend_from_slice(b"GET /third HTTP/1.1\r\nhost: h\r\n\r\n");
    s.write_all(&bytes).await.expect("write");
    for (uri, method, body) in [
        ("/first", "GET", ""),
        ("/upload", "POST", "hello"),
        ("/third", "GET", ""),
    ] {
        let (head, text) = read_response(&mut s).await.expect("an answer");
        assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
        let echo: Echo = serde_json::from_str(&text).expect("echo");
        assert_eq!(
            (echo.uri.as_str(), echo.method.as_str(), echo.body.as_str()),
            (uri, method, body)
        );
    }
    // One by one on another connection.
    let mut s = connect(gw.addr).await;
    let (_, text) = answer(&mut s, "GET /a HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(serde_json::from_str::<Echo>(&text).expect("echo").uri, "/a");
    s.write_all(WITH_BODY).await.expect("write");
    let (_, text) = read_response(&mut s).await.expect("an answer");
    assert_eq!(
        serde_json::from_str::<Echo>(&text).expect("echo").body,
        "hello"
    );
    let (_, text) = answer(&mut s, "GET /text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(text, "ok\n");
    assert_eq!(up.hits(), 5);
    gw.shutdown().await;
}

#[tokio::test]
async fn head_and_204_have_no_body() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let mut s = connect(gw.addr).await;
    // The length of the body a GET would get, and no body; then a 204 with neither
    // length nor body: the next answer on the connection starts right after each.
    let (get, body) = answer(&mut s, "GET /x HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    let get_len = format!("\r\ncontent-length: {}\r\n", body.len());
    assert!(get.to_ascii_lowercase().contains(&get_len), "{get}");
    let (head, _) = answer(&mut s, "HEAD /x HTTP/1.1\r\nhost: h\r\n\r\n", true).await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    // The echo's body names the method: `HEAD` is one byte longer than `GET`.
    let head_len = format!("\r\ncontent-length: {}\r\n", body.len() + 1);
    assert!(head.to_ascii_lowercase().contains(&head_len), "{head}");
    let (head, _) = answer(&mut s, "HEAD /text HTTP/1.1\r\nhost: h\r\n\r\n", true).await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert!(head.contains("\r\ncontent-length: 3\r\n"), "{head}");
    let (head, _) = answer(&mut s, "GET /empty HTTP/1.1\r\nhost: h\r\n\r\n", true).await;
    assert_eq!(status_line(&head), "HTTP/1.1 204 No Content");
    let lower = head.to_ascii_lowercase();
    assert!(!lower.contains("content-length"), "{head}");
    assert!(!lower.contains("transfer-encoding"), "{head}");
    let (head, _) = answer(
        &mut s,
        "GET /x HTTP/1.1\r\nhost: h\r\nx-reply-status: 204\r\n\r\n",
        true,
    )
    .await;
    assert_eq!(status_line(&head), "HTTP/1.1 204 No Content");
    assert!(
        !head.to_ascii_lowercase().contains("transfer-encoding"),
        "{head}"
    );
    let (head, body) = answer(&mut s, "GET /text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert_eq!(body, "ok\n");
    gw.shutdown().await;
}

#[tokio::test]
async fn keep_alive_close_and_http_1_0() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    // HTTP/1.1: open unless asked to close.
    let mut s = connect(gw.addr).await;
    let (head, _) = answer(&mut s, "GET /text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert!(!head.to_ascii_lowercase().contains("connection:"), "{head}");
    let (head, _) = answer(
        &mut s,
        "GET /text HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
        false,
    )
    .await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert!(head.contains("\r\nconnection: close\r\n"), "{head}");
    assert_eq!(read_to_close(&mut s).await, "");

    // HTTP/1.0: closed unless asked to keep it.
    let mut s = connect(gw.addr).await;
    let (head, body) = answer(&mut s, "GET /text HTTP/1.0\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(status_line(&head), "HTTP/1.0 200 OK");
    assert!(!head.to_ascii_lowercase().contains("connection:"), "{head}");
    assert_eq!(body, "ok\n");
    assert_eq!(read_to_close(&mut s).await, "");

    let mut s = connect(gw.addr).await;
    let ka = "GET /y HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n";
    let (head, body) = answer(&mut s, ka, false).await;
    assert_eq!(status_line(&head), "HTTP/1.0 200 OK");
    assert!(head.contains("\r\nconnection: keep-alive\r\n"), "{head}");
    assert_eq!(serde_json::from_str::<Echo>(&body).expect("echo").uri, "/y");
    let (head, body) = answer(&mut s, "GET /text HTTP/1.0\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(status_line(&head), "HTTP/1.0 200 OK");
    assert_eq!(body, "ok\n");
    assert_eq!(read_to_close(&mut s).await, "");
    gw.shutdown().await;
}

#[tokio::test]
async fn answers_are_framed_as_hyper_frames_them() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    // (request, read only the head); a request that closes is read to the end,
    // trailers included.
    let requests = [
        ("GET /text HTTP/1.1\r\nhost: h\r\n\r\n", true),
        ("GET /text HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n", false),
        ("HEAD /text HTTP/1.1\r\nhost: h\r\n\r\n", true),
        ("HEAD /x HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n", false),
        ("GET /empty HTTP/1.1\r\nhost: h\r\n\r\n", true),
        ("GET /nowhere HTTP/1.1\r\nconnection: close\r\n\r\n", false),
        ("GET /text HTTP/1.0\r\nhost: h\r\n\r\n", false),
        ("GET /text HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n", true),
        ("GET /big HTTP/1.1\r\nhost: h\r\nx-reply-bytes: 100000\r\nconnection: close\r\n\r\n", false),
        (
            "GET /t HTTP/1.1\r\nhost: h\r\nte: trailers\r\nx-reply-trailer: x-sum=7\r\nconnection: close\r\n\r\n",
            false,
        ),
        (
            "GET /t HTTP/1.1\r\nhost: h\r\nx-reply-trailer: x-sum=7\r\nx-reply-status: 404\r\nconnection: close\r\n\r\n",
            false,
        ),
        (
            "GET /t HTTP/1.0\r\nhost: h\r\nte: trailers\r\nx-reply-trailer: x-sum=7\r\n\r\n",
            false,
        ),
    ];
    for (req, head_only) in requests {
        let mut fast = connect(gw.addr).await;
        let mut slow = hyper_connection(gw.addr).await;
        let (fast_text, hyper_text) = if head_only {
            (
                answer(&mut fast, req, true).await.0,
                answer(&mut slow, req, true).await.0,
            )
        } else {
            fast.write_all(req.as_bytes()).await.expect("write");
            slow.write_all(req.as_bytes()).await.expect("write");
            (
                read_to_close(&mut fast).await,
                read_to_close(&mut slow).await,
            )
        };
        assert_eq!(without_date(&fast_text), without_date(&hyper_text), "{req}");
        assert!(fast_text.contains("\r\ndate: "), "{fast_text}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_bad_head_after_a_plain_request_is_answered_as_hyper_did() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    // A field without a colon: 400 and the end of the connection, as before.
    let mut s = connect(gw.addr).await;
    let (head, body) = answer(&mut s, "GET /text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(
        (status_line(&head), body.as_str()),
        ("HTTP/1.1 200 OK", "ok\n")
    );
    s.write_all(b"GET /text HTTP/1.1\r\nhost h\r\n\r\n")
        .await
        .expect("write");
    let rest = read_to_close(&mut s).await;
    assert!(rest.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{rest}");
    // A head over max_header_bytes (32KiB): 431.
    let mut s = connect(gw.addr).await;
    let (head, _) = answer(&mut s, "GET /text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    let big = format!(
        "GET /text HTTP/1.1\r\nhost: h\r\nx-big: {}\r\n\r\n",
        "a".repeat(40 * 1024)
    );
    s.write_all(big.as_bytes()).await.expect("write");
    let rest = read_to_close(&mut s).await;
    assert!(
        rest.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
        "{rest}"
    );
    gw.shutdown().await;
}

/// A head sent in small pieces gets `request_header_timeout` once, however long it
/// grows: it is not handed to hyper part-way, whose timer would start again (an
/// 18 KiB head finished after 1.3 s was answered with a 1 s timeout).
#[tokio::test]
async fn a_head_sent_in_pieces_gets_the_header_timeout_once() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        "server: {{listen: \"127.0.0.1:0\", request_header_timeout: 1s}}\nupstreams:\n  app: {{targets: [\"{}\"]}}\nroutes:\n  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}\n",
        url(up.addr, "").trim_end_matches('/')
    ))
    .await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: h\r\nx-pad: ")
        .await
        .unwrap();
    // 15 KiB over 0.9 s, 3 KiB more at once, and the end at 1.3 s: past the
    // timeout, with more than 16 KiB buffered before it.
    let mut cut = false;
    for _ in 0..15 {
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
        cut |= s.write_all(&[b'p'; 1024]).await.is_err();
    }
    cut |= s.write_all(&[b'p'; 3072]).await.is_err();
    tokio::time::sleep(std::time::Duration::from_millis(400)).await;
    cut |= s.write_all(b"\r\n\r\n").await.is_err();
    let rest = read_to_close(&mut s).await;
    assert_eq!(
        rest.lines().next(),
        None,
        "answered after the header timeout (cut while sending: {cut})"
    );
    assert_eq!(up.hits(), 0);
}

/// A connection's head deadline and its requests' upstream deadlines share one
/// timer: each deadline holds whatever the one before it was. Here the header
/// timeout (400 ms) passes while the first upstream answer is awaited (600 ms, within
/// its 3 s), the next head's deadline then comes before the upstream's, and each
/// request on a connection gets its own upstream deadline.
#[tokio::test]
async fn each_deadline_of_a_connection_holds_on_its_one_timer() {
    let up = upstream_with(UpstreamOpts {
        delay: std::time::Duration::from_millis(600),
        ..Default::default()
    })
    .await;
    let gw = start_gateway(
        &r#"
server: {listen: "127.0.0.1:0", request_header_timeout: 400ms}
upstreams:
  patient: {targets: ["UP"], timeout: 3s}
  hasty: {targets: ["UP"], timeout: 300ms}
routes:
  - {name: slow, match: {path_prefix: /slow}, upstream: patient}
  - {name: short, match: {path_prefix: /short}, upstream: hasty}
"#
        .replace("UP", &up.url()),
    )
    .await;

    let mut s = connect(gw.addr).await;
    let started = std::time::Instant::now();
    let (head, body) = answer(&mut s, "GET /slow/text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
    assert_eq!(status_line(&head), "HTTP/1.1 200 OK");
    assert_eq!(
        serde_json::from_str::<Echo>(&body).expect("echo").uri,
        "/slow/text"
    );
    assert!(started.elapsed() >= std::time::Duration::from_millis(600));
    // No next head: closed at the header timeout, not at the upstream's deadline.
    let answered = std::time::Instant::now();
    assert_eq!(read_to_close(&mut s).await, "");
    let idle = answered.elapsed();
    assert!(
        idle >= std::time::Duration::from_millis(300)
            && idle < std::time::Duration::from_millis(1500),
        "closed {idle:?} after the answer"
    );

    let mut s = connect(gw.addr).await;
    for _ in 0..2 {
        let started = std::time::Instant::now();
        let (head, body) =
            answer(&mut s, "GET /short/text HTTP/1.1\r\nhost: h\r\n\r\n", false).await;
        assert_eq!(status_line(&head), "HTTP/1.1 504 Gateway Timeout");
        assert_eq!(body, "upstream did not answer in time\n");
        let took = started.elapsed();
        assert!(
            took >= std::time::Duration::from_millis(300)
                && took < std::time::Duration::from_millis(600),
            "504 after {took:?}"
        );
    }
    gw.shutdown().await;
}
