//! The end-to-end harness: a gateway started from YAML text, real upstreams (echo,
//! slow, closing, upgrading, TLS), real HTTP/1.1 and h2c clients, raw sockets for
//! the cases where the bytes matter, the metrics endpoint, free ports, and child
//! processes that never outlive the test. Gateways and upstreams listen on
//! 127.0.0.1:0, so tests run in parallel without sharing a port. `redis` adds real
//! `redis-server`s and the `sluice` binary as a process, `webdriver` a headless
//! Chromium. Every test crate (`tests/*/main.rs`) includes it once, as
//! `#[path = "../common/mod.rs"] mod common;`.
#![allow(dead_code)]

pub mod llm;
pub mod redis;
pub mod webdriver;

pub use redis::base::*;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A `.yaml` temp file holding `text` (removed when dropped).
pub fn config_file(text: &str) -> tempfile::NamedTempFile {
    let f = tempfile::Builder::new()
        .suffix(".yaml")
        .tempfile()
        .expect("temp file");
    std::fs::write(f.path(), text).expect("write config");
    f
}

/// The name libtest gives the test `name` of the module whose `module_path!()` is
/// `module`: its path without the crate's name. For running one test of this
/// binary again in a child process (`--exact`).
pub fn test_name(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{name}"),
        None => name.to_string(),
    }
}

/// `http://ADDR` + `path`.
pub fn url(addr: SocketAddr, path: &str) -> String {
    format!("http://{addr}{path}")
}

/// Sleep until just after the next multiple of `window` since the UNIX epoch, so a
/// short burst of requests falls into one aligned window of a `fixed_window` limit.
pub async fn at_window_start(window: Duration) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    let w = window.as_micros();
    let left = w - now.as_micros() % w;
    tokio::time::sleep(Duration::from_micros(left as u64) + Duration::from_millis(20)).await;
}

// === upstreams ===

/// A real upstream: counts its requests and answers as its kind says.
pub struct Upstream {
    pub addr: SocketAddr,
    hits: Arc<AtomicUsize>,
}

impl Upstream {
    /// Requests that reached it (counted when their head arrives).
    pub fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// How an echo upstream answers every request. Per request, the headers
/// `x-reply-status: N`, `x-reply-bytes: N` (a body of N bytes instead of the echo),
/// `x-reply-header: name=value` and `x-reply-trailer: name=value` (a chunked body
/// ending in that trailer) override it.
#[derive(Clone, Debug, Default)]
pub struct UpstreamOpts {
    pub status: Option<u16>,
    /// Wait this long before answering.
    pub delay: Duration,
}

/// What the echo upstream saw, sent back as its JSON body.
#[derive(Debug, Serialize, Deserialize)]
pub struct Echo {
    pub method: String,
    pub uri: String,
    pub version: String,
    /// In the order received, repeated names kept.
    pub headers: Vec<(String, String)>,
    pub body_len: usize,
    pub body: String,
}

impl Echo {
    /// The one value of header `name`; panics when it was sent more than once.
    pub fn header(&self, name: &str) -> Option<&str> {
        let all = self.all(name);
        assert!(
            all.len() <= 1,
            "header {name} arrived {} times: {all:?}",
            all.len()
        );
        all.first().copied()
    }

    pub fn all(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
            .collect()
    }
}

/// An echo upstream answering 200 at once.
pub async fn upstream() -> Upstream {
    upstream_with(UpstreamOpts::default()).await
}

pub async fn upstream_with(opts: UpstreamOpts) -> Upstream {
    let listener = bind().await;
    let addr = listener.local_addr().expect("local addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_echo(stream, opts.clone(), counter.clone()));
        }
    });
    Upstream { addr, hits }
}

/// An echo upstream answering 200 at once on 127.0.0.1:`port` (a target that
/// comes back where it was).
pub async fn upstream_at(port: u16) -> Upstream {
    let listener = TcpListener::bind(("127.0.0.1", port))
        .await
        .expect("bind the port again");
    let addr = listener.local_addr().expect("local addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_echo(stream, UpstreamOpts::default(), counter.clone()));
        }
    });
    Upstream { addr, hits }
}

/// An upstream that accepts, reads the request head and closes without answering.
pub async fn closing_upstream() -> Upstream {
    let listener = bind().await;
    let addr = listener.local_addr().expect("local addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let counter = counter.clone();
            tokio::spawn(async move {
                if read_head(&mut stream).await.is_some() {
                    counter.fetch_add(1, Ordering::SeqCst);
                }
            });
        }
    });
    Upstream { addr, hits }
}

/// A fresh self-signed certificate for `localhost` and 127.0.0.1, as PEM files
/// (for sluice's `tls_ca` and `server.tls`) and ready for rustls.
pub struct SelfSigned {
    pub cert_pem: tempfile::NamedTempFile,
    pub key_pem: tempfile::NamedTempFile,
    pub cert: rustls_pki_types::CertificateDer<'static>,
    key_der: Vec<u8>,
}

pub fn self_signed() -> SelfSigned {
    let ck =
        rcgen::generate_simple_self_signed(vec!["localhost".to_string(), "127.0.0.1".to_string()])
            .expect("self-signed certificate");
    let pem = |text: String| {
        let f = tempfile::Builder::new()
            .suffix(".pem")
            .tempfile()
            .expect("temp file");
        std::fs::write(f.path(), text).expect("write PEM");
        f
    };
    SelfSigned {
        cert_pem: pem(ck.cert.pem()),
        key_pem: pem(ck.signing_key.serialize_pem()),
        cert: ck.cert.der().clone(),
        key_der: ck.signing_key.serialize_der(),
    }
}

impl SelfSigned {
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::new(self.server_config()))
    }

    /// A server's TLS configuration with this certificate (no ALPN).
    pub fn server_config(&self) -> rustls::ServerConfig {
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(self.key_der.clone().into());
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("TLS versions")
            .with_no_client_auth()
            .with_single_cert(vec![self.cert.clone()], key)
            .expect("server certificate")
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An echo upstream behind TLS with a fresh self-signed certificate; the returned
/// file holds that certificate (PEM), for `tls_ca`. Reach it as
/// `https://127.0.0.1:PORT`.
pub async fn tls_upstream() -> (Upstream, tempfile::NamedTempFile) {
    let certs = self_signed();
    let acceptor = certs.acceptor();
    let ca = certs.cert_pem;

    let listener = bind().await;
    let addr = listener.local_addr().expect("local addr");
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (acceptor, counter) = (acceptor.clone(), counter.clone());
            tokio::spawn(async move {
                // A client that rejects our certificate ends the handshake: fine.
                if let Ok(tls) = acceptor.accept(stream).await {
                    serve_echo(tls, UpstreamOpts::default(), counter).await;
                }
            });
        }
    });
    (Upstream { addr, hits }, ca)
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0")
}

async fn serve_echo<I>(io: I, opts: UpstreamOpts, hits: Arc<AtomicUsize>)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = service_fn(move |req| echo(req, opts.clone(), hits.clone()));
    let _ = hyper::server::conn::http1::Builder::new()
        .serve_connection(TokioIo::new(io), service)
        .with_upgrades()
        .await;
}

async fn echo(
    mut req: Request<Incoming>,
    opts: UpstreamOpts,
    hits: Arc<AtomicUsize>,
) -> Result<Response<ReplyBody>, Infallible> {
    hits.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(opts.delay).await;
    if let Some(proto) = req.headers().get(http::header::UPGRADE).cloned() {
        return Ok(upgrade_echo(&mut req, proto));
    }
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let wanted = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
    let status = wanted("x-reply-status")
        .and_then(|s| s.parse().ok())
        .or(opts.status)
        .unwrap_or(200);
    let reply = match wanted("x-reply-bytes").and_then(|n| n.parse::<usize>().ok()) {
        Some(n) => Bytes::from(pattern(n)),
        None => {
            let echo = Echo {
                method: parts.method.to_string(),
                uri: parts.uri.to_string(),
                version: format!("{:?}", parts.version),
                headers: parts
                    .headers
                    .iter()
                    .map(|(k, v)| {
                        (
                            k.to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect(),
                body_len: body.len(),
                body: String::from_utf8_lossy(&body).into_owned(),
            };
            Bytes::from(serde_json::to_vec(&echo).expect("echo serializes"))
        }
    };
    // With a trailer wanted, the body streams (chunked) in three pieces.
    let body = match wanted("x-reply-trailer").and_then(|h| h.split_once('=')) {
        None => Full::new(reply).boxed(),
        Some((k, v)) => {
            let mut trailers = HeaderMap::new();
            trailers.insert(
                http::HeaderName::from_bytes(k.as_bytes()).expect("trailer name"),
                HeaderValue::from_str(v).expect("trailer value"),
            );
            let third = reply.len().div_ceil(3).max(1);
            let mut frames: VecDeque<_> = reply
                .chunks(third)
                .map(|c| Frame::data(Bytes::copy_from_slice(c)))
                .collect();
            frames.push_back(Frame::trailers(trailers));
            Frames(frames).boxed()
        }
    };
    let trailer_name = wanted("x-reply-trailer")
        .and_then(|h| h.split_once('='))
        .map(|(k, _)| k);
    let mut resp = Response::new(body);
    if let Some(name) = trailer_name {
        // HTTP/1.1 sends only the trailers that `Trailer` announces.
        resp.headers_mut().insert(
            http::header::TRAILER,
            HeaderValue::from_str(name).expect("trailer name"),
        );
    }
    *resp.status_mut() = StatusCode::from_u16(status).expect("valid status");
    if let Some((k, v)) = wanted("x-reply-header").and_then(|h| h.split_once('=')) {
        resp.headers_mut().insert(
            http::HeaderName::from_bytes(k.as_bytes()).expect("header name"),
            HeaderValue::from_str(v).expect("header value"),
        );
    }
    Ok(resp)
}

/// Answer 101 and echo every byte on the upgraded connection.
type ReplyBody = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// A body of fixed frames, sent without a length: chunked on HTTP/1.1.
struct Frames(VecDeque<Frame<Bytes>>);

impl http_body::Body for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.0.pop_front().map(Ok))
    }
}

fn upgrade_echo(req: &mut Request<Incoming>, proto: HeaderValue) -> Response<ReplyBody> {
    let on = hyper::upgrade::on(req);
    tokio::spawn(async move {
        if let Ok(up) = on.await {
            let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
            let _ = tokio::io::copy(&mut r, &mut w).await;
        }
    });
    let mut resp = Response::new(Full::new(Bytes::new()).boxed());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    resp.headers_mut().insert(
        http::header::CONNECTION,
        HeaderValue::from_static("upgrade"),
    );
    resp.headers_mut().insert(http::header::UPGRADE, proto);
    resp
}

/// `n` bytes of a recognisable ASCII pattern (so a shifted or truncated copy shows).
pub fn pattern(n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| b"abcdefghijklmnopqrstuvwxyz0123456789"[i % 36])
        .collect()
}

// === clients ===

/// Request headers as tests write them.
pub type Headers<'a> = &'a [(&'a str, &'a str)];

/// A response, read whole.
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: HeaderMap,
    pub body: Bytes,
    pub trailers: Option<HeaderMap>,
}

impl Resp {
    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).expect("UTF-8 body")
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(name)
            .map(|v| v.to_str().expect("ASCII header"))
    }

    /// A header that must be there, as a number.
    pub fn num(&self, name: &str) -> u64 {
        let v = self
            .header(name)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers));
        v.parse()
            .unwrap_or_else(|_| panic!("{name}: {v:?} is not a number"))
    }

    /// What the echo upstream saw.
    pub fn echo(&self) -> Echo {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not an echo ({e}): {} {:?}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The names of the rate-limit headers present.
    pub fn rate_headers(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self
            .headers
            .keys()
            .map(|k| k.as_str())
            .filter(|k| k.starts_with("ratelimit") || k.starts_with("x-ratelimit"))
            .collect();
        names.sort_unstable();
        names
    }
}

/// A real HTTP client: hyper-util's pooled client, HTTP/1.1 or h2c (prior knowledge).
#[derive(Clone)]
pub struct HttpClient {
    inner: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
}

pub fn http1() -> HttpClient {
    client(&[], false)
}

pub fn h2c() -> HttpClient {
    client(&[], true)
}

/// An HTTP/1.1 client that also speaks `https://` to servers with one of `roots`.
pub fn https(roots: &[rustls_pki_types::CertificateDer<'static>]) -> HttpClient {
    client(roots, false)
}

fn client(roots: &[rustls_pki_types::CertificateDer<'static>], http2_only: bool) -> HttpClient {
    let mut store = rustls::RootCertStore::empty();
    for cert in roots {
        store.add(cert.clone()).expect("root certificate");
    }
    let tls = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(store)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .build();
    HttpClient {
        inner: Client::builder(TokioExecutor::new())
            .http2_only(http2_only)
            .build(connector),
    }
}

impl HttpClient {
    pub async fn get(&self, url: &str, headers: &[(&str, &str)]) -> Resp {
        self.send(Method::GET, url, headers, Bytes::new()).await
    }

    pub async fn send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Resp {
        let sent = self.try_send(method, url, headers, body.into());
        bounded(url, sent)
            .await
            .unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    /// The response, or why there is none (e.g. nothing listens yet).
    pub async fn try_send(
        &self,
        method: Method,
        url: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Resp, String> {
        let mut req = Request::builder().method(method).uri(url);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
        let resp = self
            .inner
            .request(req)
            .await
            .map_err(|e| format!("{e:?}"))?;
        let (parts, body) = resp.into_parts();
        let collected = body.collect().await.map_err(|e| format!("body: {e}"))?;
        let trailers = collected.trailers().cloned();
        Ok(Resp {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body: collected.to_bytes(),
            trailers,
        })
    }
}

/// Whether a GET of `url` answers 200 within `BOUND` (polled): a child process
/// ready at last, its `/readyz` or Envoy's `/ready`.
pub async fn answers_200(url: &str) -> bool {
    let c = http1();
    let ok = eventually(BOUND, || async {
        c.try_send(Method::GET, url, &[], Bytes::new())
            .await
            .is_ok_and(|r| r.status == 200)
    });
    ok.await.is_some()
}

/// GET with a fresh HTTP/1.1 client.
pub async fn get(url: &str, headers: &[(&str, &str)]) -> Resp {
    http1().get(url, headers).await
}

/// The statuses of `n` sequential GETs.
pub async fn statuses(
    client: &HttpClient,
    n: usize,
    url: &str,
    headers: &[(&str, &str)],
) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(client.get(url, headers).await.status);
    }
    out
}

/// `n` times 200 followed by `m` times 429.
pub fn ok_then_limited(n: usize, m: usize) -> Vec<u16> {
    let mut v = vec![200; n];
    v.extend(std::iter::repeat_n(429, m));
    v
}

// === metrics ===

pub async fn metrics(admin: SocketAddr) -> String {
    let r = get(&url(admin, "/metrics"), &[]).await;
    assert_eq!(r.status, 200, "GET /metrics");
    r.text().to_string()
}

/// The value of one series, written exactly as the exposition writes it, e.g.
/// `sluice_requests_total{decision="allowed",route="hello"}`.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// `sluice_requests_total{decision=D,route=R}`, 0 when absent.
pub fn requests(text: &str, route: &str, decision: &str) -> f64 {
    let series = format!("sluice_requests_total{{decision=\"{decision}\",route=\"{route}\"}}");
    metric(text, &series).unwrap_or(0.0)
}

/// Every non-zero `sluice_requests_total` series of `route`, as (decision, count),
/// in the exposition's (alphabetical) order.
pub fn decisions<'a>(text: &'a str, route: &str) -> Vec<(&'a str, f64)> {
    let needle = format!(",route=\"{route}\"}}");
    text.lines()
        .filter_map(|l| l.strip_prefix("sluice_requests_total{decision=\""))
        .filter_map(|l| {
            let (decision, rest) = l.split_once('"')?;
            let value: f64 = rest.strip_prefix(&needle)?.trim().parse().ok()?;
            (value != 0.0).then_some((decision, value))
        })
        .collect()
}

// === raw sockets ===

/// A raw upstream on 127.0.0.1 that counts the connections it accepts and serves
/// each with `serve`.
pub async fn raw_upstream<F, Fut>(serve: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
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

// === the plain-request server (tests/http/h1_*.rs) ===

/// A gateway whose `/text` and `/empty` sluice answers itself (200 `ok\n`, 204)
/// and whose other paths go to the upstream at `up`.
pub async fn plain_gateway(up: &str) -> Running {
    start_gateway(&format!(
        r#"
upstreams:
  app: {{targets: ["{up}"], probe: false}}
routes:
  - {{name: text, match: {{path: /text}}, respond: {{status: 200, body: "ok\n"}}}}
  - {{name: empty, match: {{path: /empty}}, respond: {{status: 204, body: ""}}}}
  - {{name: rest, match: {{path_prefix: /}}, upstream: app}}
"#
    ))
    .await
}

/// A request with a body: after it, a connection is hyper's.
pub const WITH_BODY: &[u8] = b"POST /upload HTTP/1.1\r\nhost: h\r\ncontent-length: 5\r\n\r\nhello";

/// A connection that has served a request with a body (`WITH_BODY`). Until
/// sluice's own server read bodies, hyper's served the rest of such a connection:
/// tests compare its answers with a fresh connection's.
pub async fn hyper_connection(addr: SocketAddr) -> TcpStream {
    let mut s = connect(addr).await;
    s.write_all(WITH_BODY).await.expect("write");
    let (head, _) = read_response(&mut s).await.expect("an answer");
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    s
}

pub async fn connect(addr: SocketAddr) -> TcpStream {
    bounded("connect", TcpStream::connect(addr))
        .await
        .expect("connect")
}

/// A connection to `addr` from 127.0.0.2 ("another client").
pub async fn connect_from_other(addr: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind("127.0.0.2:0".parse().expect("address"))
        .expect("bind 127.0.0.2");
    bounded("connect", socket.connect(addr))
        .await
        .expect("connect")
}

/// Read up to the end of a response (or request) head; `None` on EOF before it.
pub async fn read_head(stream: &mut (impl AsyncRead + Unpin)) -> Option<String> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        match bounded("read head", stream.read(&mut byte)).await {
            Ok(1) => buf.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&buf).into_owned())
}

/// Read one response: its head and its body (by `content-length` or chunked),
/// from a plain or a TLS stream; `None` when the connection ends before a head.
pub async fn read_response(stream: &mut (impl AsyncRead + Unpin)) -> Option<(String, String)> {
    let head = read_head(stream).await?;
    let lower = head.to_ascii_lowercase();
    let mut body = Vec::new();
    if let Some(n) = lower
        .split("\r\n")
        .find_map(|l| l.strip_prefix("content-length:"))
    {
        body.resize(n.trim().parse().expect("content-length"), 0);
        bounded("read body", stream.read_exact(&mut body))
            .await
            .ok()?;
    } else if lower.contains("transfer-encoding: chunked") {
        loop {
            let size = read_line(stream).await?;
            let size = usize::from_str_radix(size.trim(), 16).expect("chunk size");
            let mut chunk = vec![0; size + 2];
            bounded("read chunk", stream.read_exact(&mut chunk))
                .await
                .ok()?;
            if size == 0 {
                break;
            }
            body.extend_from_slice(&chunk[..size]);
        }
    }
    Some((head, String::from_utf8_lossy(&body).into_owned()))
}

async fn read_line(stream: &mut (impl AsyncRead + Unpin)) -> Option<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        match bounded("read line", stream.read(&mut byte)).await {
            Ok(1) => line.push(byte[0]),
            _ => return None,
        }
    }
    Some(String::from_utf8_lossy(&line).into_owned())
}

/// Write `bytes`, then read until the peer closes (or resets); what was read.
pub async fn exchange(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = connect(addr).await;
    s.write_all(bytes).await.expect("write");
    read_to_close(&mut s).await
}

pub async fn read_to_close(s: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match bounded("read to close", s.read(&mut buf)).await {
            Ok(0) | Err(_) => break,
            Ok(n) => out.extend_from_slice(&buf[..n]),
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
