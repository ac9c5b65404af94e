//! HTTP/2 upstreams (`upstreams.*.protocol`: h2c, h2, auto): any client protocol to
//! any upstream protocol, trailers both ways, streams multiplexed on few
//! connections within the server's limit, GOAWAY survived, ALPN, and a reload that
//! changes the protocol. The upstream is hyper's HTTP/2 server, started here.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

use crate::common::*;

/// How the HTTP/2 upstream behaves.
#[derive(Clone, Default)]
struct H2Opts {
    /// `SETTINGS_MAX_CONCURRENT_STREAMS` (hyper's default when `None`: 200).
    max_streams: Option<u32>,
    /// GOAWAY (graceful) on a connection once it has served this many requests.
    goaway_after: Option<usize>,
    /// Requests wait until this many are in flight at once (then all answer).
    gather: Option<usize>,
    /// TLS with ALPN offering these protocols.
    tls: Option<(Arc<SelfSigned>, Vec<Vec<u8>>)>,
}

/// What the HTTP/2 upstream saw of each request.
#[derive(Debug, Clone)]
struct Seen {
    version: http::Version,
    method: Method,
    uri: String,
    headers: HeaderMap,
    body: Bytes,
    trailers: Option<HeaderMap>,
}

struct H2Upstream {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl H2Upstream {
    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// An HTTP/2 server (hyper's; over TLS with ALPN when `opts.tls`). It answers 200
/// with the request body echoed, the header `x-version` (the request's version),
/// and, when the request has `x-reply-trailer: name=value`, that trailer after the
/// body. An HTTP/1.1 connection (ALPN picked it) gets the same from hyper's HTTP/1.
async fn h2_upstream(opts: H2Opts) -> H2Upstream {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let in_flight = Arc::new((AtomicUsize::new(0), tokio::sync::Notify::new()));
    let (conns, log) = (connections.clone(), seen.clone());
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            conns.fetch_add(1, Ordering::SeqCst);
            let (opts, log, in_flight) = (opts.clone(), log.clone(), in_flight.clone());
            tokio::spawn(async move {
                let served = Arc::new(AtomicUsize::new(0));
                let enough = Arc::new(tokio::sync::Notify::new());
                let (served2, enough2) = (served.clone(), enough.clone());
                let (tls, max_streams) = (opts.tls.clone(), opts.max_streams);
                let service = service_fn(move |req: Request<Incoming>| {
                    let (log, in_flight, opts) = (log.clone(), in_flight.clone(), opts.clone());
                    let (served, enough) = (served2.clone(), enough2.clone());
                    async move {
                        let (parts, body) = req.into_parts();
                        let collected = body.collect().await.unwrap();
                        let trailers = collected.trailers().cloned();
                        let body = collected.to_bytes();
                        log.lock().unwrap().push(Seen {
                            version: parts.version,
                            method: parts.method.clone(),
                            uri: parts.uri.to_string(),
                            headers: parts.headers.clone(),
                            body: body.clone(),
                            trailers,
                        });
                        if let Some(n) = opts
                            .gather
                            .filter(|_| !parts.uri.path().starts_with("/warm"))
                        {
                            let (count, all_in) = &*in_flight;
                            let arrived = count.fetch_add(1, Ordering::SeqCst) + 1;
                            if arrived >= n {
                                all_in.notify_waiters();
                            } else {
                                let wait = all_in.notified();
                                if count.load(Ordering::SeqCst) < n {
                                    let _ =
                                        tokio::time::timeout(Duration::from_secs(5), wait).await;
                                }
                            }
                        }
                        if opts
                            .goaway_after
                            .is_some_and(|n| served.fetch_add(1, Ordering::SeqCst) + 1 == n)
                        {
                            enough.notify_one();
                        }
                        let trailer = parts
                            .headers
                            .get("x-reply-trailer")
                            .and_then(|v| v.to_str().ok())
                            .and_then(|v| v.split_once('='))
                            .map(|(k, v)| (k.to_owned(), v.to_owned()));
                        let mut frames = vec![Ok::<_, Infallible>(Frame::data(body))];
                        if let Some((k, v)) = trailer {
                            let mut t = HeaderMap::new();
                            t.insert(
                                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                                HeaderValue::from_str(&v).unwrap(),
                            );
                            frames.push(Ok(Frame::trailers(t)));
                        }
                        let mut resp =
                            Response::new(StreamBody::new(futures_util::stream::iter(frames)));
                        resp.headers_mut().insert(
                            "x-version",
                            HeaderValue::from_str(&format!("{:?}", parts.version)).unwrap(),
                        );
                        Ok::<_, Infallible>(resp)
                    }
                });
                match tls {
                    Some((certs, alpn)) => {
                        let mut config = certs.server_config();
                        config.alpn_protocols = alpn;
                        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
                        let Ok(tls) = acceptor.accept(tcp).await else {
                            return;
                        };
                        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                        let io = TokioIo::new(tls);
                        if h2 {
                            let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                                .serve_connection(io, service)
                                .await;
                        } else {
                            let _ = hyper::server::conn::http1::Builder::new()
                                .serve_connection(io, service)
                                .await;
                        }
                    }
                    None => {
                        let mut b = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
                        b.max_concurrent_streams(max_streams);
                        let conn = b.serve_connection(TokioIo::new(tcp), service);
                        tokio::pin!(conn);
                        tokio::select! {
                            _ = conn.as_mut() => return,
                            () = enough.notified() => {}
                        }
                        // GOAWAY: the streams it has go on, no new one is taken.
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.await;
                    }
                }
            });
        }
    });
    H2Upstream {
        addr,
        connections,
        seen,
    }
}

fn config(upstream: &str, protocol: &str, extra: &str) -> String {
    format!(
        "upstreams:\n  app: {{targets: [\"{upstream}\"], protocol: {protocol}, probe: false{extra}}}\n\
         routes:\n  - name: all\n    match: {{path_prefix: /}}\n    upstream: app\n"
    )
}

/// An HTTP/1.1 client through to an h2c upstream: the upstream gets HTTP/2 with
/// the client's host as `:authority`, the hop-by-hop fields gone (`TE: trailers`
/// kept) and `X-Forwarded-For`; the upstream's trailer reaches the client in a
/// chunked answer.
#[tokio::test]
async fn an_http1_client_reaches_an_h2c_upstream_with_its_trailers() {
    let up = h2_upstream(H2Opts::default()).await;
    let gw = start_gateway(&config(&format!("http://{}", up.addr), "h2c", "")).await;
    let mut s = connect(gw.addr).await;
    s.write_all(
        b"POST /v1/things?x=1 HTTP/1.1\r\nhost: api.example.com\r\nte: trailers\r\n\
          connection: keep-alive, x-private\r\nx-private: secret\r\nkeep-alive: 5\r\n\
          x-reply-trailer: x-checksum=abc123\r\ncontent-length: 5\r\n\r\nhello",
    )
    .await
    .unwrap();
    let text = bounded("answer", read_to_close_or_chunked_end(&mut s)).await;
    assert!(text.starts_with("HTTP/1.1 200 OK\r\n"), "{text}");
    assert!(text.contains("\r\nx-version: HTTP/2.0\r\n"), "{text}");
    assert!(
        text.contains("\r\ntransfer-encoding: chunked\r\n"),
        "{text}"
    );
    assert!(
        text.ends_with("\r\n\r\n5\r\nhello\r\n0\r\nx-checksum: abc123\r\n\r\n"),
        "{text:?}"
    );
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    let r = &seen[0];
    assert_eq!(r.version, http::Version::HTTP_2);
    assert_eq!(r.method, Method::POST);
    assert_eq!(r.uri, "http://api.example.com/v1/things?x=1");
    assert_eq!(r.body, "hello");
    let h = &r.headers;
    assert_eq!(h.get("te").unwrap(), "trailers");
    assert_eq!(h.get("x-forwarded-for").unwrap(), "127.0.0.1");
    assert_eq!(h.get("x-forwarded-host").unwrap(), "api.example.com");
    for gone in ["connection", "keep-alive", "x-private", "host"] {
        assert!(h.get(gone).is_none(), "{gone} reached the upstream: {h:?}");
    }
}

/// Reads an HTTP/1.1 answer up to the end of its chunked body (the connection stays
/// open).
async fn read_to_close_or_chunked_end(s: &mut tokio::net::TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if got.windows(5).any(|w| w == b"\r\n0\r\n") && got.ends_with(b"\r\n\r\n") {
            break;
        }
    }
    String::from_utf8(got).unwrap()
}

/// An h2c client's streamed body and trailers reach an h2c upstream, and the
/// upstream's trailers come back.
#[tokio::test]
async fn trailers_pass_both_ways_between_http2_client_and_upstream() {
    let up = h2_upstream(H2Opts::default()).await;
    let gw = start_gateway(&config(&format!("http://{}", up.addr), "h2c", "")).await;
    let client = hyper_util::client::legacy::Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let mut trailers = HeaderMap::new();
    trailers.insert("x-sent-after", HeaderValue::from_static("yes"));
    let frames = vec![
        Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"part one, "))),
        Ok(Frame::data(Bytes::from_static(b"part two"))),
        Ok(Frame::trailers(trailers)),
    ];
    let req = Request::post(format!("http://{}/stream", gw.addr))
        .header("te", "trailers")
        .header("x-reply-trailer", "grpc-status=0")
        .body(StreamBody::new(futures_util::stream::iter(frames)))
        .unwrap();
    let resp = bounded("answer", client.request(req)).await.unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap();
    assert_eq!(body.trailers().unwrap().get("grpc-status").unwrap(), "0");
    assert_eq!(body.to_bytes(), "part one, part two");
    let seen = up.seen();
    assert_eq!(seen[0].body, "part one, part two");
    assert_eq!(
        seen[0]
            .trailers
            .as_ref()
            .unwrap()
            .get("x-sent-after")
            .unwrap(),
        "yes"
    );
}

/// 40 requests at once share one connection (the server allows 200 streams);
/// with a server that allows 10, they take exactly 4.
#[tokio::test]
async fn requests_share_connections_up_to_the_servers_stream_limit() {
    for (max_streams, expected) in [(None, 1), (Some(10), 4)] {
        let up = h2_upstream(H2Opts {
            max_streams,
            gather: Some(40),
            ..H2Opts::default()
        })
        .await;
        let gw = start_gateway(&config(&format!("http://{}", up.addr), "h2c", "")).await;
        // One connection first, so the server's SETTINGS are known before the rush.
        let client = http1();
        assert_eq!(client.get(&url(gw.addr, "/warm"), &[]).await.status, 200);
        let url = url(gw.addr, "/call");
        let up_hits = up.seen().len();
        assert_eq!(up_hits, 1);
        let mut calls = Vec::new();
        for i in 0..40 {
            let (c, u) = (http1(), url.clone());
            calls.push(tokio::spawn(async move {
                c.get(&format!("{u}/{i}"), &[]).await.status
            }));
        }
        let mut statuses = Vec::new();
        for c in calls {
            statuses.push(c.await.unwrap());
        }
        assert_eq!(statuses, vec![200; 40], "max_streams {max_streams:?}");
        assert_eq!(up.connections(), expected, "max_streams {max_streams:?}");
    }
}

/// An upstream that sends GOAWAY after every 7 requests on a connection: 150
/// requests, 10 at a time, all answered 200; the upstream saw more than one
/// connection.
#[tokio::test]
async fn every_request_is_answered_through_goaways() {
    let up = h2_upstream(H2Opts {
        goaway_after: Some(7),
        ..H2Opts::default()
    })
    .await;
    let gw = start_gateway(&config(&format!("http://{}", up.addr), "h2c", "")).await;
    let mut statuses = Vec::new();
    for round in 0..15 {
        let mut calls = Vec::new();
        for i in 0..10 {
            let u = url(gw.addr, &format!("/r{round}/{i}"));
            calls.push(tokio::spawn(
                async move { http1().get(&u, &[]).await.status },
            ));
        }
        for c in calls {
            statuses.push(c.await.unwrap());
        }
    }
    assert_eq!(statuses, vec![200; 150]);
    // (Each connection serves the streams it took before its GOAWAY: 7 or more.)
    assert!(up.connections() >= 2, "{} connections", up.connections());
}

/// `protocol: h2` over TLS with a private CA: ALPN picks h2. `auto` speaks
/// HTTP/2 to a server that offers it and HTTP/1.1 to one that offers only that.
#[tokio::test]
async fn h2_and_auto_pick_the_protocol_by_alpn() {
    let certs = Arc::new(self_signed());
    let ca = certs.cert_pem.path().display().to_string();
    let cases: [(&str, Vec<Vec<u8>>, &str); 3] = [
        ("h2", vec![b"h2".to_vec()], "HTTP/2.0"),
        (
            "auto",
            vec![b"h2".to_vec(), b"http/1.1".to_vec()],
            "HTTP/2.0",
        ),
        ("auto", vec![b"http/1.1".to_vec()], "HTTP/1.1"),
    ];
    for (protocol, alpn, version) in cases {
        let up = h2_upstream(H2Opts {
            tls: Some((certs.clone(), alpn)),
            ..H2Opts::default()
        })
        .await;
        let target = format!("https://localhost:{}", up.addr.port());
        // One worker: each worker opens connections of its own.
        let gw = start_gateway(&format!(
            "server: {{listen: 127.0.0.1:0, workers: 1}}\n{}",
            config(&target, protocol, &format!(", tls_ca: \"{ca}\""))
        ))
        .await;
        for i in 0..3 {
            let r = http1().get(&url(gw.addr, &format!("/{i}")), &[]).await;
            assert_eq!(r.status, 200, "{protocol} {version}: {}", r.text());
            assert_eq!(r.header("x-version"), Some(version), "{protocol}");
        }
        assert_eq!(up.connections(), 1, "{protocol} {version}");
    }
}

/// A reload that changes an upstream's protocol applies it (a new pool); the
/// answers say which version the upstream got.
#[tokio::test]
async fn a_reload_changes_the_protocol() {
    let certs = Arc::new(self_signed());
    let ca = certs.cert_pem.path().display().to_string();
    // A TLS server that speaks either, as ALPN picks.
    let up = h2_upstream(H2Opts {
        tls: Some((certs, vec![b"h2".to_vec(), b"http/1.1".to_vec()])),
        ..H2Opts::default()
    })
    .await;
    let target = format!("https://localhost:{}", up.addr.port());
    let tls = format!(", tls_ca: \"{ca}\"");
    let (gw, file) = start_gateway_file(&config(&target, "http1", &tls)).await;
    let r = http1().get(&url(gw.addr, "/a"), &[]).await;
    assert_eq!(r.header("x-version"), Some("HTTP/1.1"));
    std::fs::write(file.path(), with_listeners(&config(&target, "h2", &tls))).unwrap();
    gw.reload().await.expect("reload");
    let r = http1().get(&url(gw.addr, "/b"), &[]).await;
    assert_eq!(r.header("x-version"), Some("HTTP/2.0"));
}

/// An h2c upstream with a target that refuses connections: each request it would
/// have had goes to the live one; the dead one is left out after its first failure.
#[tokio::test]
async fn an_h2c_target_refusing_connections_costs_no_request_its_answer() {
    let live = h2_upstream(H2Opts::default()).await;
    let dead = format!("http://127.0.0.1:{}", free_port());
    let gw = start_gateway(&format!(
        "upstreams:\n  app: {{targets: [\"http://{}\", \"{dead}\"], protocol: h2c, probe: false}}\n\
         routes:\n  - name: all\n    match: {{path_prefix: /}}\n    upstream: app\n",
        live.addr
    ))
    .await;
    for client in [http1(), h2c()] {
        let got = statuses(&client, 20, &url(gw.addr, "/x"), &[]).await;
        assert_eq!(got, vec![200; 20]);
    }
    assert_eq!(live.seen().len(), 40);
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &m,
            "sluice_upstream_errors_total{kind=\"connect\",route=\"all\"}"
        ),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            &format!("sluice_upstream_target_healthy{{target=\"{dead}\",upstream=\"app\"}}")
        ),
        Some(0.0),
        "{m}"
    );
    gw.shutdown().await;
}
