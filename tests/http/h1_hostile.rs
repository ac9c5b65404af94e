//! Hostile bytes against the gateway's own HTTP/1.1 server: the same bytes on a
//! fresh connection and on one that has already served a request with a body get
//! the same answers, byte for byte but for `date`, and (for the first probes) the
//! answers hyper's server gave, recorded before sluice's server took every request.

use crate::common::*;
use tokio::io::AsyncWriteExt;

/// The last request of each probe: closes the connection once answered.
const CLOSE: &str = "GET /text HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n";

/// Everything read until the close, without `date` lines.
fn without_date(text: &str) -> String {
    text.split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("date:"))
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// Send `bytes` on a fresh connection and on a hyper one; both read to the close.
async fn both(addr: std::net::SocketAddr, bytes: &[u8]) -> (String, String) {
    let mut fast = connect(addr).await;
    let mut slow = hyper_connection(addr).await;
    let _ = fast.write_all(bytes).await;
    let _ = slow.write_all(bytes).await;
    (
        without_date(&read_to_close(&mut fast).await),
        without_date(&read_to_close(&mut slow).await),
    )
}

/// The status lines in `text` (a body need not end in a line break).
fn statuses(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("HTTP/1.") {
        let line = rest[at..].split("\r\n").next().unwrap_or_default();
        if line.len() > 12
            && line.as_bytes()[8] == b' '
            && line[9..12].bytes().all(|b| b.is_ascii_digit())
        {
            out.push(line);
        }
        rest = &rest[at + 7..];
    }
    out
}

#[tokio::test]
async fn hostile_heads_are_answered_as_hyper_answers_them() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let long_target = format!("/{}", "a".repeat(70_000));
    let fields_100: String = (0..99).map(|i| format!("x-f{i}: v\r\n")).collect();
    let fields_101: String = (0..100).map(|i| format!("x-f{i}: v\r\n")).collect();
    let probes: Vec<String> = vec![
        // Plain, then a body: the body is never read as a request.
        format!("GET /a HTTP/1.1\r\nhost: h\r\n\r\nPOST /b HTTP/1.1\r\nhost: h\r\ncontent-length: 26\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\n\r\nPOST /b HTTP/1.1\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n{CLOSE}"),
        // Content-Length variants.
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\ncontent-length: 0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 00\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0, 0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: +0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\ncontent-length: 5\r\n\r\nhello{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ncontent-length: 0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{CLOSE}"),
        // Transfer-Encoding tricks.
        format!("GET /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding: gzip\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding : chunked\r\n\r\n0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: b\r\n transfer-encoding: chunked\r\n\r\n0\r\n\r\n{CLOSE}"),
        // Bare LF, NUL and control bytes.
        format!("GET /a HTTP/1.1\nhost: h\n\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\nx-a: b\r\n\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: b\0c\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: b\x01c\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: b\x7fc\r\n\r\n{CLOSE}"),
        format!("GET /a\0 HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\rx-a: b\r\n\r\n{CLOSE}"),
        format!("\r\n\r\nGET /a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        // obs-text in a value and in the target.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: caf\u{e9}\r\n\r\n{CLOSE}"),
        format!("GET /caf\u{e9} HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\u{e9}\r\n\r\n{CLOSE}"),
        format!("get /a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        // Hosts and targets.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nhost: other\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\n\r\n{CLOSE}"),
        format!("GET http://other/a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET http://h/a HTTP/1.1\r\n\r\n{CLOSE}"),
        format!("OPTIONS * HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET * HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET //a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a#frag HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\n\r\nGET {long_target} HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("CONNECT h:443 HTTP/1.1\r\nhost: h:443\r\n\r\n{CLOSE}"),
        format!("G\u{e9}T /a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.2\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/2.0\r\nhost: h\r\n\r\n{CLOSE}"),
        format!("GET /a  HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        // Field counts.
        format!("GET /a HTTP/1.1\r\nhost: h\r\n{fields_100}\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\n{fields_101}\r\n{CLOSE}"),
        // Connection.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nconnection: close\r\nconnection: keep-alive\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nconnection: keep-alive, close\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nconnection: CLOSE\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\nconnection: close\r\n\r\n{CLOSE}"),
        format!("HEAD /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n{CLOSE}"),
        // Expect, Upgrade.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nexpect: 100-continue\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\nexpect: 100-continue\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nupgrade: foo\r\nconnection: upgrade\r\n\r\n{CLOSE}"),
        // Answers without a body, or with odd framing, from the upstream.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-status: 304\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-status: 204\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-status: 205\r\n\r\n{CLOSE}"),
        format!("HEAD /a HTTP/1.1\r\nhost: h\r\nx-reply-status: 304\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\nx-reply-status: 204\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\nx-reply-trailer: x-s=1\r\n\r\n{CLOSE}"),
        format!("HEAD /a HTTP/1.1\r\nhost: h\r\nte: trailers\r\nx-reply-trailer: x-s=1\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nte: trailers\r\nx-reply-trailer: x-s=1\r\nx-reply-status: 304\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-header: date=Tue, 01 Jan 2030 00:00:00 GMT\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-header: x-b=c\r\nx-reply-status: 599\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-status: 101\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-reply-bytes: 0\r\n\r\n{CLOSE}"),
        format!("HEAD /a HTTP/1.1\r\nhost: h\r\nx-reply-bytes: 70000\r\n\r\n{CLOSE}"),
        // Hop-by-hop and TE.
        format!("GET /a HTTP/1.1\r\nhost: h\r\nte: trailers, deflate\r\nconnection: te\r\n\r\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nconnection: x-a\r\nx-a: b\r\n\r\n{CLOSE}"),
    ];
    // What hyper's HTTP/1.1 server answered to each probe, recorded (without
    // `date`) before sluice's own server took every request.
    let recorded: Vec<serde_json::Value> =
        serde_json::from_str(include_str!("../fixtures/h1_hostile_hyper.json")).expect("JSON");
    assert_eq!(recorded.len(), probes.len());
    for (probe, hyper) in probes.iter().zip(&recorded) {
        let (fast, slow) = both(gw.addr, probe.as_bytes()).await;
        let shown = &probe[..probe.len().min(200)];
        assert!(probe.starts_with(hyper["probe"].as_str().expect("a probe")));
        assert_eq!(
            fast,
            hyper["answer"].as_str().expect("an answer"),
            "{shown:?}"
        );
        assert_eq!(fast, slow, "{shown:?}");
        assert!(!fast.contains("\"uri\":\"/smuggled"), "{shown:?}: {fast}");
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn split_hostile_heads_are_answered_as_hyper_answers_them() {
    // The same probes, each byte written on its own (a head in pieces).
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let probes = [
        format!("GET /a HTTP/1.1\nhost: h\n\n{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\n\r\nPOST /b HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\n\r\nabc{CLOSE}"),
        format!("GET /a HTTP/1.1\r\nhost: h\r\nx-a: b\r\n\n{CLOSE}"),
        format!("\r\n\r\nGET /a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}"),
        // Empty lines before a request line are skipped, however many.
        format!("{}GET /a HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}", "\r\n".repeat(2000)),
        format!("{}GET /a HTTP/1.1\nhost: h\n\n{CLOSE}", "\n".repeat(2000)),
        format!("\n\r\n\nGET /a HTTP/1.1\r\nhost: h\r\n\n{CLOSE}"),
    ];
    for probe in &probes {
        let mut fast = connect(gw.addr).await;
        let mut slow = hyper_connection(gw.addr).await;
        for b in probe.as_bytes() {
            fast.write_all(&[*b]).await.expect("write");
            slow.write_all(&[*b]).await.expect("write");
        }
        let fast = without_date(&read_to_close(&mut fast).await);
        let slow = without_date(&read_to_close(&mut slow).await);
        assert_eq!(fast, slow, "{probe:?}");
        assert_eq!(
            statuses(&fast).last(),
            Some(&"HTTP/1.1 200 OK"),
            "{probe:?}"
        );
    }
    gw.shutdown().await;
}

#[tokio::test]
async fn a_client_that_half_closes_gets_no_answer_it_waits_for() {
    // An upstream slower than the client's end arriving.
    let up = upstream_with(UpstreamOpts {
        delay: std::time::Duration::from_millis(200),
        ..Default::default()
    })
    .await;
    let gw = plain_gateway(&up.url()).await;
    // (request, the fast path's answers): one that is ready at once is still
    // sent (hyper, which looks for the end first, sends none); one that waits for
    // the upstream is cancelled, as with hyper.
    let ok: &[&str] = &["HTTP/1.1 200 OK"];
    for (req, answered) in [
        ("GET /text HTTP/1.1\r\nhost: h\r\n\r\n", ok),
        ("GET /a HTTP/1.1\r\nhost: h\r\n\r\n", &[]),
        (
            "GET /text HTTP/1.1\r\nhost: h\r\n\r\nGET /text HTTP/1.1\r\nhost: h\r\n\r\n",
            &["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        ),
        (
            "GET /a HTTP/1.1\r\nhost: h\r\n\r\nGET /a HTTP/1.1\r\nhost: h\r\n\r\n",
            ok,
        ),
    ] {
        let mut fast = connect(gw.addr).await;
        let mut slow = hyper_connection(gw.addr).await;
        for s in [&mut fast, &mut slow] {
            s.write_all(req.as_bytes()).await.expect("write");
            s.shutdown().await.expect("shutdown");
        }
        let fast = without_date(&read_to_close(&mut fast).await);
        let slow = without_date(&read_to_close(&mut slow).await);
        assert_eq!(statuses(&fast), answered, "{req:?}\n{fast}");
        if req.contains("/a ") {
            assert_eq!(fast, slow, "{req:?}");
        }
    }
    gw.shutdown().await;
}

/// Every request the fast path answers is counted once in `sluice_requests_total`,
/// pipelined or not, whatever its framing.
#[tokio::test]
async fn requests_the_fast_path_serves_are_counted_exactly() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"GET /text HTTP/1.1\r\nhost: h\r\n\r\n\
          HEAD /text HTTP/1.1\r\nhost: h\r\n\r\n\
          GET /a HTTP/1.1\r\nhost: h\r\n\r\n\
          GET /a HTTP/1.0\r\nhost: h\r\nconnection: keep-alive\r\n\r\n\
          HEAD /a HTTP/1.1\r\nhost: h\r\n\r\n\
          GET /big HTTP/1.1\r\nhost: h\r\nx-reply-bytes: 100000\r\n\r\n\
          GET /t HTTP/1.1\r\nhost: h\r\nte: trailers\r\nx-reply-trailer: x-sum=7\r\n\r\n\
          GET /text HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
    )
    .await
    .expect("write");
    let all = read_to_close(&mut s).await;
    assert_eq!(statuses(&all).len(), 8, "{all}");
    // An HTTP/1.0 request without keep-alive: answered until the close.
    let all = exchange(gw.addr, b"GET /a HTTP/1.0\r\nhost: h\r\n\r\n").await;
    assert_eq!(statuses(&all), ["HTTP/1.0 200 OK"]);
    let m = eventually_metrics(gw.admin_addr, |m| {
        requests(m, "text", "allowed") == 3.0 && requests(m, "rest", "allowed") == 6.0
    })
    .await;
    assert_eq!(decisions(&m, "text"), [("allowed", 3.0)]);
    assert_eq!(decisions(&m, "rest"), [("allowed", 6.0)]);
    assert_eq!(up.hits(), 6);
    gw.shutdown().await;
}

/// The metrics once `done` holds (a request is counted when its body ends).
async fn eventually_metrics(admin: std::net::SocketAddr, done: impl Fn(&str) -> bool) -> String {
    for _ in 0..100 {
        let m = metrics(admin).await;
        if done(&m) {
            return m;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    metrics(admin).await
}

/// A graceful shutdown while a plain request is in flight: its answer is sent
/// whole, with `connection: close`, as hyper sends it, and the connection ends.
#[tokio::test]
async fn a_shutdown_lets_a_plain_request_in_flight_finish() {
    let up = upstream_with(UpstreamOpts {
        delay: std::time::Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let gw = plain_gateway(&up.url()).await;
    let mut fast = connect(gw.addr).await;
    // hyper's connection: its first request waits too.
    let mut slow = connect(gw.addr).await;
    slow.write_all(WITH_BODY).await.expect("write");
    fast.write_all(b"GET /a HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .expect("write");
    let mut n = 0;
    while up.hits() < 2 && n < 100 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        n += 1;
    }
    assert_eq!(up.hits(), 2);
    slow.write_all(b"GET /a HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .expect("write");
    let stopping = tokio::spawn(gw.shutdown());
    let fast = without_date(&read_to_close(&mut fast).await);
    let slow = without_date(&read_to_close(&mut slow).await);
    assert_eq!(statuses(&fast), ["HTTP/1.1 200 OK"], "{fast}");
    assert!(fast.contains("\r\nconnection: close\r\n"), "{fast}");
    assert!(fast.ends_with("\"body\":\"\"}"), "{fast}");
    assert_eq!(statuses(&slow), ["HTTP/1.1 200 OK"], "{slow}");
    assert!(slow.contains("\r\nconnection: close\r\n"), "{slow}");
    stopping.await.expect("shutdown");
}

/// A head of exactly `max_header_bytes` is served; one byte more, or that many
/// bytes with no end, is 431 at once; the fast path and hyper agree.
#[tokio::test]
async fn heads_at_max_header_bytes_are_answered_as_hyper_answers_them() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let max = 32 * 1024;
    let head = |len: usize, end: &str| {
        let start = "GET /a HTTP/1.1\r\nhost: h\r\nx-pad: ";
        let pad = len - start.len() - end.len();
        format!("{start}{}{end}", "p".repeat(pad))
    };
    for (bytes, want) in [
        (
            head(max, "\r\n\r\n"),
            vec!["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        ),
        (
            head(max - 1, "\r\n\r\n"),
            vec!["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        ),
        (
            head(max, "\n\n"),
            vec!["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        ),
        (
            head(max + 1, "\r\n\r\n"),
            vec!["HTTP/1.1 431 Request Header Fields Too Large"],
        ),
        (
            head(max, "\r\n"),
            vec!["HTTP/1.1 431 Request Header Fields Too Large"],
        ),
        (
            format!("{}{}", "\r\n".repeat(max / 2), head(100, "\r\n\r\n")),
            vec!["HTTP/1.1 431 Request Header Fields Too Large"],
        ),
        (
            format!("{}{}", "\r\n".repeat(100), head(100, "\r\n\r\n")),
            vec!["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        ),
    ] {
        // A head with no end is left open: the 431 must come without it.
        let bytes = if bytes.ends_with("\r\n\r\n") || bytes.ends_with("\n\n") {
            format!("{bytes}{CLOSE}")
        } else {
            bytes
        };
        let (fast, slow) = both(gw.addr, bytes.as_bytes()).await;
        assert_eq!(statuses(&fast), want, "{}", &fast[..fast.len().min(300)]);
        assert_eq!(fast, slow);
    }
    gw.shutdown().await;
}

/// An answer that refuses a plain request (429) keeps the connection, as with
/// hyper: the next request on it is served.
#[tokio::test]
async fn a_refused_plain_request_keeps_the_connection() {
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["{}"]}}
routes:
  - {{name: text, match: {{path: /text}}, respond: {{status: 200, body: "ok\n"}}}}
  - name: one
    match: {{path: /one}}
    upstream: app
    limits: [{{algorithm: fixed_window, limit: 1, window: 1m}}]
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#,
        up.url()
    ))
    .await;
    let one = "GET /one HTTP/1.1\r\nhost: h\r\n\r\n";
    let all = exchange(gw.addr, format!("{one}{one}{one}{CLOSE}").as_bytes()).await;
    assert_eq!(
        statuses(&all),
        [
            "HTTP/1.1 200 OK",
            "HTTP/1.1 429 Too Many Requests",
            "HTTP/1.1 429 Too Many Requests",
            "HTTP/1.1 200 OK"
        ],
        "{all}"
    );
    let (fast, slow) = both(gw.addr, format!("{one}{CLOSE}").as_bytes()).await;
    assert_eq!(
        statuses(&fast),
        ["HTTP/1.1 429 Too Many Requests", "HTTP/1.1 200 OK"]
    );
    assert_eq!(fast, slow);
    assert_eq!(up.hits(), 2);
    let m = eventually_metrics(gw.admin_addr, |m| requests(m, "one", "limited") == 4.0).await;
    assert_eq!(decisions(&m, "one"), [("allowed", 1.0), ("limited", 4.0)]);
    gw.shutdown().await;
}

/// A transfer coding other than a final `chunked` (`gzip, chunked`, in one line or
/// two, or `chunked` twice) is one sluice does not implement: 501 and a close, as
/// nginx answers, and the upstream sees nothing. Forwarding the body as plain
/// `chunked` would lose the coding.
#[tokio::test]
async fn transfer_codings_other_than_chunked_get_501() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    let body = "5\r\nhello\r\n0\r\n\r\n";
    let not_implemented = "HTTP/1.1 501 Not Implemented\r\nconnection: close\r\ncontent-length: 0";
    for te in [
        "transfer-encoding: gzip, chunked\r\n",
        "transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
        "transfer-encoding: chunked, chunked\r\n",
        "transfer-encoding: identity, chunked\r\n",
    ] {
        let probe = format!("POST /a HTTP/1.1\r\nhost: h\r\n{te}\r\n{body}{CLOSE}");
        let (fast, slow) = both(gw.addr, probe.as_bytes()).await;
        assert_eq!(fast, format!("{not_implemented}\r\n\r\n"), "{te:?}");
        assert_eq!(fast, slow, "{te:?}");
    }
    // Only the request each `hyper_connection` makes first.
    assert_eq!(up.hits(), 4);
    // `chunked` alone, in any case, still goes through.
    let probe =
        format!("POST /a HTTP/1.1\r\nhost: h\r\ntransfer-encoding: Chunked\r\n\r\n{body}{CLOSE}");
    let all = exchange(gw.addr, probe.as_bytes()).await;
    assert_eq!(
        statuses(&all),
        ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
        "{all}"
    );
    assert!(all.contains("\"body\":\"hello\""), "{all}");
    gw.shutdown().await;
}

/// Request-target bytes nginx forwards but the URI type refuses (`"`, `<`, `>` in
/// a query; `<`, `>` and `` ` `` in a path) are forwarded percent-encoded, as a
/// browser sends them: the same value to any application that decodes them.
#[tokio::test]
async fn targets_with_quotes_and_angle_brackets_are_forwarded_encoded() {
    let up = upstream().await;
    let gw = plain_gateway(&up.url()).await;
    for (target, forwarded) in [
        ("/q?a=\"b\"", "/q?a=%22b%22"),
        ("/q?a=<b>&c=`d`{e}|\\^", "/q?a=%3Cb%3E&c=`d`{e}|\\\\^"),
        ("/p<a>/`b`/\"c\"", "/p%3Ca%3E/%60b%60/\\\"c\\\""),
    ] {
        let probe = format!("GET {target} HTTP/1.1\r\nhost: h\r\n\r\n{CLOSE}");
        let all = exchange(gw.addr, probe.as_bytes()).await;
        assert_eq!(
            statuses(&all),
            ["HTTP/1.1 200 OK", "HTTP/1.1 200 OK"],
            "{target}: {all}"
        );
        assert!(
            all.contains(&format!("\"uri\":\"{forwarded}\"")),
            "{target}: {all}"
        );
    }
    gw.shutdown().await;
}
