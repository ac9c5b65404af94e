//! HTTP/2 upstreams that misbehave, and the corners of `protocol: auto` and of
//! gRPC answers: raw h2 servers (the `h2` crate's, driven by hand) and TLS
//! HTTP/1.1 servers picked by ALPN, started here.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::common::*;

fn config(upstream: &str, protocol: &str, extra: &str) -> String {
    format!(
        "upstreams:\n  app: {{targets: [\"{upstream}\"], protocol: {protocol}, probe: false{extra}}}\n\
         routes:\n  - name: all\n    match: {{path_prefix: /}}\n    upstream: app\n"
    )
}

/// A TLS server whose ALPN offers only `http/1.1` (hyper's HTTP/1.1 behind it):
/// each request waits `delay`, then gets 200. It records every request's `Host`
/// (`None` when it had none) and the most connections it had open at once.
struct Http1Tls {
    addr: SocketAddr,
    hosts: Arc<Mutex<Vec<Option<String>>>>,
    most_open: Arc<AtomicUsize>,
}

async fn http1_tls(certs: Arc<SelfSigned>, delay: Duration) -> Http1Tls {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let hosts = Arc::new(Mutex::new(Vec::new()));
    let most_open = Arc::new(AtomicUsize::new(0));
    let open = Arc::new(AtomicUsize::new(0));
    let (log, most) = (hosts.clone(), most_open.clone());
    tokio::spawn(async move {
        let mut config = certs.server_config();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        while let Ok((tcp, _)) = listener.accept().await {
            let (acceptor, log, most, open) =
                (acceptor.clone(), log.clone(), most.clone(), open.clone());
            tokio::spawn(async move {
                let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                if let Ok(tls) = acceptor.accept(tcp).await {
                    let service = service_fn(move |req: Request<Incoming>| {
                        let log = log.clone();
                        async move {
                            let host = req
                                .headers()
                                .get("host")
                                .map(|h| h.to_str().unwrap().to_owned());
                            log.lock().unwrap().push(host);
                            tokio::time::sleep(delay).await;
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                        }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tls), service)
                        .await;
                }
                open.fetch_sub(1, Ordering::SeqCst);
            });
        }
    });
    Http1Tls {
        addr,
        hosts,
        most_open,
    }
}

/// An upstream that processes a bodiless `POST` (counted) and then fails its
/// connection: GOAWAY with `INTERNAL_ERROR` whose last stream is that request's,
/// i.e. "this one may have been processed" (RFC 9113 §6.8). Such a request is not
/// one sluice may send again: the client gets 502 and the upstream saw it once.
#[tokio::test]
async fn a_request_under_an_error_goaways_last_stream_is_not_sent_again() {
    let processed = Arc::new(AtomicUsize::new(0));
    let counter = processed.clone();
    let (addr, _) = raw_upstream(move |tcp| {
        let counter = counter.clone();
        async move {
            let Ok(mut conn) = h2::server::handshake(tcp).await else {
                return;
            };
            if let Some(Ok((_req, respond))) = conn.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                conn.abrupt_shutdown(h2::Reason::INTERNAL_ERROR);
                let _ = std::future::poll_fn(|cx| conn.poll_closed(cx)).await;
                drop(respond);
            }
        }
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", "")).await;
    let r = http1()
        .send(Method::POST, &url(gw.addr, "/charge"), &[], Bytes::new())
        .await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(processed.load(Ordering::SeqCst), 1);
}

/// `auto` over TLS, the target picking HTTP/1.1, `max_connections: 2`: five
/// requests at once (after one that found the pick) hold at most two connections
/// to the target.
#[tokio::test]
async fn auto_keeps_to_max_connections_when_the_target_picks_http1() {
    let certs = Arc::new(self_signed());
    let ca = certs.cert_pem.path().display().to_string();
    let up = http1_tls(certs, Duration::from_millis(300)).await;
    let target = format!("https://localhost:{}", up.addr.port());
    let extra = format!(", tls_ca: \"{ca}\", max_connections: 2");
    let gw = start_gateway(&config(&target, "auto", &extra)).await;
    assert_eq!(http1().get(&url(gw.addr, "/pick"), &[]).await.status, 200);
    let mut calls = Vec::new();
    for i in 0..5 {
        let u = url(gw.addr, &format!("/{i}"));
        calls.push(tokio::spawn(
            async move { http1().get(&u, &[]).await.status },
        ));
    }
    let mut statuses = Vec::new();
    for c in calls {
        statuses.push(c.await.unwrap());
    }
    assert_eq!(statuses, vec![200; 5]);
    assert_eq!(up.most_open.load(Ordering::SeqCst), 2);
}

/// An HTTP/1.0 request without `Host` reaches an `http1` upstream with the
/// target's authority as `Host`; under `auto`, the request that finds the target
/// picks HTTP/1.1 must too (HTTP/1.1 requires it, RFC 9112 §3.2).
#[tokio::test]
async fn auto_gives_host_to_the_request_that_finds_the_http1_pick() {
    let certs = Arc::new(self_signed());
    let ca = certs.cert_pem.path().display().to_string();
    let up = http1_tls(certs, Duration::ZERO).await;
    let target = format!("https://localhost:{}", up.addr.port());
    let gw = start_gateway(&config(&target, "auto", &format!(", tls_ca: \"{ca}\""))).await;
    for path in ["/first", "/second"] {
        let mut s = connect(gw.addr).await;
        s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes())
            .await
            .unwrap();
        let answer = read_to_close(&mut s).await;
        // (An HTTP/1.0 client is answered in HTTP/1.0.)
        assert!(answer.starts_with("HTTP/1.0 200 OK\r\n"), "{answer}");
    }
    let authority = format!("localhost:{}", up.addr.port());
    assert_eq!(
        *up.hosts.lock().unwrap(),
        vec![Some(authority.clone()), Some(authority)]
    );
}

/// gRPC is HTTP/2 only: an `application/grpc` request over HTTP/1.1 is answered
/// in HTTP by sluice, whatever refuses it (here an upstream that takes no
/// connection, to an `http1` and an `h2c` upstream), and the same request over
/// h2c in gRPC (200, `grpc-status: 14`). (The review found the HTTP/1.1 request
/// answered in gRPC when a limit refused it and in HTTP when the upstream failed.)
#[tokio::test]
async fn a_grpc_content_type_is_answered_in_grpc_over_http2_only() {
    let dead = format!("http://127.0.0.1:{}", free_port());
    let mut answers = Vec::new();
    for protocol in ["http1", "h2c"] {
        let gw = start_gateway(&config(&dead, protocol, "")).await;
        for (client, name) in [(http1(), "HTTP/1.1"), (h2c(), "h2c")] {
            let r = client
                .send(
                    Method::POST,
                    &url(gw.addr, "/orders.v1.Orders/Get"),
                    &[("content-type", "application/grpc")],
                    Bytes::from_static(b"\0\0\0\0\0"),
                )
                .await;
            answers.push((
                protocol,
                name,
                r.status,
                r.header("grpc-status").map(str::to_owned),
            ));
        }
    }
    let grpc = Some("14".to_owned());
    assert_eq!(
        answers,
        vec![
            ("http1", "HTTP/1.1", 502, None),
            ("http1", "h2c", 200, grpc.clone()),
            ("h2c", "HTTP/1.1", 502, None),
            ("h2c", "h2c", 200, grpc),
        ]
    );
}

/// An HTTP/1.1 upstream whose `Trailer` field names nothing valid (empty): its
/// unannounced trailer `x-secret` is not passed to the client, as before HTTP/2
/// upstreams came (an empty list meant "none"; it now means "all").
#[tokio::test]
async fn an_empty_trailer_field_from_an_http1_upstream_passes_no_trailer() {
    let (addr, _) = raw_upstream(|mut s| async move {
        let _ = read_head(&mut s).await;
        let _ = s
            .write_all(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: \r\n\r\n\
                  5\r\nhello\r\n0\r\nx-secret: 1\r\n\r\n",
            )
            .await;
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest).await;
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "http1", "")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: h\r\nte: trailers\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = read_to_close(&mut s).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"), "{answer}");
    assert!(answer.ends_with("\r\n0\r\n\r\n"), "{answer:?}");
}

/// A raw h2c upstream (the `h2` crate's server, `max_streams` its
/// `SETTINGS_MAX_CONCURRENT_STREAMS` when given): every stream goes to `handle`
/// in a task of its own while the connection is driven.
async fn raw_h2<F, Fut>(max_streams: Option<u32>, handle: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(Request<h2::RecvStream>, h2::server::SendResponse<Bytes>) -> Fut
        + Clone
        + Send
        + Sync
        + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    raw_upstream(move |tcp| {
        let handle = handle.clone();
        async move {
            let mut b = h2::server::Builder::new();
            if let Some(n) = max_streams {
                b.max_concurrent_streams(n);
            }
            let Ok(mut conn) = b.handshake::<_, Bytes>(tcp).await else {
                return;
            };
            while let Some(Ok((req, respond))) = conn.accept().await {
                tokio::spawn(handle.clone()(req, respond));
            }
        }
    })
    .await
}

/// An upstream that resets its stream (`INTERNAL_ERROR`) after a first part of the
/// body: the HTTP/1.1 client's chunked answer must not end as if complete (no last
/// chunk) and its connection closes.
#[tokio::test]
async fn an_upstream_reset_mid_body_cuts_the_http1_answer() {
    let (addr, _) = raw_h2(None, |_req, mut respond| async move {
        let mut send = respond.send_response(Response::new(()), false).unwrap();
        send.send_data(Bytes::from_static(b"partial"), false)
            .unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        send.send_reset(h2::Reason::INTERNAL_ERROR);
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", "")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET / HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(2), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    assert!(closed.is_ok(), "connection still open: {text:?}");
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.ends_with("\r\n7\r\npartial\r\n"), "{text:?}");
}

/// A client that goes away mid-body: the upstream's stream is cancelled at once
/// and its stream is free again: with one connection allowed and one stream on it,
/// the next request is answered.
#[tokio::test]
async fn a_client_gone_mid_body_frees_the_upstream_stream() {
    let resets = Arc::new(Mutex::new(Vec::new()));
    let log = resets.clone();
    let (addr, accepted) = raw_h2(Some(1), move |req, mut respond| {
        let log = log.clone();
        async move {
            let mut send = respond.send_response(Response::new(()), false).unwrap();
            if req.uri().path() == "/stream" {
                send.send_data(Bytes::from_static(b"first"), false).unwrap();
                let reason = std::future::poll_fn(|cx| send.poll_reset(cx)).await;
                log.lock().unwrap().push(reason.ok());
            } else {
                send.send_data(Bytes::from_static(b"ok"), true).unwrap();
            }
        }
    })
    .await;
    let extra = ", max_connections: 1, timeout: 2s";
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", extra)).await;
    let mut s = connect(gw.addr).await;
    s.write_all(b"GET /stream HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    let head = read_head(&mut s).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    drop(s);
    let cancelled = eventually(Duration::from_secs(2), || async {
        *resets.lock().unwrap() == vec![Some(h2::Reason::CANCEL)]
    })
    .await;
    assert!(cancelled.is_some(), "{:?}", resets.lock().unwrap());
    let r = http1().get(&url(gw.addr, "/next"), &[]).await;
    assert_eq!((r.status, r.text()), (200, "ok"));
    assert_eq!(accepted.load(Ordering::SeqCst), 1);
}

/// An HTTP/2 client that cancels its call (`RST_STREAM`) before the answer's head:
/// the upstream's stream is cancelled at once, as docs/grpc-and-http2.md says.
#[tokio::test]
async fn a_client_cancel_before_the_head_cancels_the_upstream_stream() {
    let resets = Arc::new(Mutex::new(Vec::new()));
    let started = Arc::new(AtomicUsize::new(0));
    let (log, starts) = (resets.clone(), started.clone());
    let (addr, _) = raw_h2(None, move |_req, mut respond| {
        let (log, starts) = (log.clone(), starts.clone());
        async move {
            starts.fetch_add(1, Ordering::SeqCst);
            let reason = std::future::poll_fn(|cx| respond.poll_reset(cx)).await;
            log.lock().unwrap().push(reason.ok());
        }
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", "")).await;
    let tcp = connect(gw.addr).await;
    let (mut client, conn) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let req = Request::post(format!("http://{}/orders.v1.Orders/Get", gw.addr))
        .header("content-type", "application/grpc")
        .body(())
        .unwrap();
    let (answer, mut body) = client.send_request(req, false).unwrap();
    body.send_data(Bytes::from_static(b"\0\0\0\0\0"), true)
        .unwrap();
    let arrived = eventually(Duration::from_secs(2), || async {
        started.load(Ordering::SeqCst) == 1
    })
    .await;
    assert!(arrived.is_some());
    body.send_reset(h2::Reason::CANCEL);
    drop(answer);
    let cancelled = eventually(Duration::from_secs(2), || async {
        *resets.lock().unwrap() == vec![Some(h2::Reason::CANCEL)]
    })
    .await;
    assert!(cancelled.is_some(), "{:?}", resets.lock().unwrap());
}

/// An upstream whose `SETTINGS_MAX_HEADER_LIST_SIZE` (1 KiB) a request's fields
/// exceed: it ends the connection with GOAWAY (an error code, the request "not
/// processed"). Sent again, the same fields end the next connection the same way:
/// one request must cost one connection (and the streams other clients have on
/// it), not `ATTEMPTS` of them.
#[tokio::test]
async fn fields_over_the_upstreams_header_list_size_are_refused_once() {
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = handled.clone();
    let (addr, accepted) = raw_upstream(move |tcp| {
        let counter = counter.clone();
        async move {
            let Ok(mut conn) = h2::server::Builder::new()
                .max_header_list_size(1024)
                .handshake::<_, Bytes>(tcp)
                .await
            else {
                return;
            };
            while let Some(Ok((_req, mut respond))) = conn.accept().await {
                counter.fetch_add(1, Ordering::SeqCst);
                let _ = respond.send_response(Response::new(()), true);
            }
        }
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", "")).await;
    // A first request makes the server's SETTINGS known.
    assert_eq!(http1().get(&url(gw.addr, "/small"), &[]).await.status, 200);
    let big = "x".repeat(4000);
    let r = http1().get(&url(gw.addr, "/big"), &[("x-big", &big)]).await;
    assert_eq!(
        (
            r.status,
            handled.load(Ordering::SeqCst),
            accepted.load(Ordering::SeqCst)
        ),
        (502, 1, 1),
        "{}",
        r.text()
    );
}

/// An `h2c` target that speaks only HTTP/1.1: the request fails at once (502), not
/// after the upstream's `timeout`.
#[tokio::test]
async fn an_http1_only_server_on_an_h2c_target_fails_at_once() {
    let (addr, _) = raw_upstream(|tcp| async move {
        let service = service_fn(|_req: Request<Incoming>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(tcp), service)
            .await;
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{addr}"), "h2c", ", timeout: 5s")).await;
    for i in 0..2 {
        let t0 = std::time::Instant::now();
        let r = http1().get(&url(gw.addr, &format!("/{i}")), &[]).await;
        assert_eq!(r.status, 502, "{}", r.text());
        assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    }
}
