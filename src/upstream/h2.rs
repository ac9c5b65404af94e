//! HTTP/2 to upstreams (`protocol: h2c`, `h2`, and `auto` when ALPN picks h2):
//! hyper's client (`hyper::client::conn::http2`), its framing and flow control, on
//! a few connections per target.
//!
//! A request takes a stream on the first open connection with one free: a
//! connection carries at most the server's `SETTINGS_MAX_CONCURRENT_STREAMS`
//! (and at most `MAX_STREAMS`) requests at once, and a new one is opened only when
//! every open one is full, one at a time, within the target's share of
//! `max_connections`. At that cap a request waits for a stream on the least busy
//! connection (hyper holds it until the server has room), within the upstream's
//! `timeout`.
//!
//! A connection the server sends GOAWAY on takes no new request; the requests it
//! did not process (above the GOAWAY's last stream, or refused with
//! `REFUSED_STREAM`) are sent again on another connection when they have no body
//! (RFC 9113 §8.7: not processed, so safe to repeat whatever the method), and a
//! request hyper had not yet handed to the connection is always sent again.
//! Keep-alive PINGs find a connection that died without a word.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, Uri, Version};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};

use crate::http::body::{Body, BoxError};
use crate::http::conn::coarse_ms;
use crate::http::h1::server::UnannouncedTrailers;
use crate::http::transport::{Connector, Link, NoFreeConnection, Stream};
use crate::http::wake::Deadline;
use crate::upstream::pool::{ReadTimeout, SendError};

/// Streams one connection carries at once, at most, whatever the server allows:
/// more connections share the load across the server's threads (nginx allows 128
/// by default, grpc-go any number).
pub const MAX_STREAMS: usize = 100;

/// Sent on a connection that has read nothing for this long, and on an idle one.
const PING_EVERY: Duration = Duration::from_secs(40);
/// A PING unanswered this long closes its connection, failing its requests.
const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts at one request, at most: sent again only when a connection closed
/// without processing it.
const ATTEMPTS: usize = 4;

/// The HTTP/2 connections of one target.
pub struct H2Pool {
    connector: Connector,
    conns: Mutex<Vec<Arc<H2Conn>>>,
    /// Held while a connection is opened: requests that find every connection full
    /// wait for that one rather than each opening its own.
    opening: tokio::sync::Mutex<()>,
    /// The last failure to open a connection, and when: requests that waited for
    /// that attempt fail with it rather than try again one after another.
    failed: Mutex<Option<(Instant, String)>>,
    /// An open connection with no stream for this long is closed.
    idle_ms: u64,
    read_timeout: Duration,
    /// `auto`: ALPN offered HTTP/1.1 too, and the target picked it.
    offers_http1: bool,
    picked_http1: AtomicBool,
    /// The streams the server allowed on the connection last told (until one
    /// has: `MAX_STREAMS`): a new connection starts at it, as its own SETTINGS
    /// come only after requests may already be on it.
    known_max: Arc<AtomicUsize>,
}

struct H2Conn {
    send: http2::SendRequest<Body>,
    /// Requests in flight on it.
    streams: AtomicUsize,
    /// How many it may carry, and hyper's half of the connection.
    driver: Arc<Driver>,
    /// When its last stream ended (`coarse_ms`).
    idle_since: AtomicU64,
    /// Its driver has ended: the connection is gone.
    closed: Arc<AtomicBool>,
}

impl H2Conn {
    fn usable(&self) -> bool {
        !self.closed.load(Ordering::Relaxed) && !self.send.is_closed()
    }
}

/// What the pool gives back instead of an answer.
pub enum H2Error {
    Send(SendError),
    /// `auto`: the target picked HTTP/1.1 on this connection; the request was not
    /// sent and goes back with it.
    Http1(Box<Request<Body>>, Link),
    /// No connection could be opened and the request was not sent: it goes back
    /// whole, for another target.
    Unsent(Box<Request<Body>>, BoxError),
}

impl From<SendError> for H2Error {
    fn from(e: SendError) -> H2Error {
        H2Error::Send(e)
    }
}

impl H2Pool {
    /// `offers_http1`: the connector's TLS offers `http/1.1` beside `h2` (`auto`).
    pub fn new(
        connector: Connector,
        offers_http1: bool,
        idle_timeout: Duration,
        read_timeout: Duration,
    ) -> H2Pool {
        H2Pool {
            connector,
            conns: Mutex::new(Vec::new()),
            opening: tokio::sync::Mutex::new(()),
            failed: Mutex::new(None),
            idle_ms: u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX),
            read_timeout,
            offers_http1,
            picked_http1: AtomicBool::new(false),
            known_max: Arc::new(AtomicUsize::new(MAX_STREAMS)),
        }
    }

    /// `auto`: whether the target picked HTTP/1.1 (then its requests go to the
    /// HTTP/1.1 pool).
    pub fn picked_http1(&self) -> bool {
        self.picked_http1.load(Ordering::Relaxed)
    }

    /// One connection opened and dropped: whether the target takes connections.
    pub async fn probe(&self) -> Result<(), BoxError> {
        self.connector.probe().await
    }

    /// Send `req` (absolute URI: its scheme and authority become `:scheme` and
    /// `:authority`) on a free stream, and return the answer with a body that frees
    /// the stream at its end.
    pub async fn send(self: &Arc<Self>, mut req: Request<Body>) -> Result<Response<Body>, H2Error> {
        // What sending it again needs, for a request with no body (the only kind
        // that can be: a body is read once).
        let again = http_body::Body::is_end_stream(req.body()).then(|| Again::of(&req));
        // The client's request body fails in hyper's task, which only resets the
        // stream: its error is kept here, so the failure is the client's.
        // (Wrapped once a connection is found: a request handed to the HTTP/1.1
        // pool instead keeps its body's own errors.)
        let body_failed = Arc::new(Mutex::new(None));
        let mut wrapped = again.is_some();
        for attempt in 1..=ATTEMPTS {
            let slot = match self.take() {
                Some(slot) => slot,
                None => match self.open().await {
                    Ok(Opened::Slot(slot)) => slot,
                    Ok(Opened::Http1(conn)) => return Err(H2Error::Http1(Box::new(req), conn)),
                    // (A body wrapped for a connection that then closed stays here:
                    // its failures are told to this call.)
                    Err(SendError::Connect(e)) if !wrapped || again.is_some() => {
                        return Err(H2Error::Unsent(Box::new(req), e));
                    }
                    Err(e) => return Err(e.into()),
                },
            };
            if !wrapped {
                wrapped = true;
                let failed = body_failed.clone();
                req = req.map(|inner| Body::new(Recorded { inner, failed }));
            }
            let mut sender = slot.conn.send.clone();
            match sender.try_send_request(req).await {
                Ok(resp) => {
                    if !slot.conn.driver.told.load(Ordering::Relaxed) {
                        // The server's SETTINGS came before this answer, and hyper
                        // applied them before reading it.
                        slot.conn.driver.learn(&self.known_max, true);
                    }
                    let (mut parts, inner) = resp.into_parts();
                    // The answer as any other: the client's server writes it in its
                    // own version.
                    parts.version = Version::HTTP_11;
                    parts.extensions.insert(UnannouncedTrailers);
                    let body = H2Body {
                        inner,
                        _slot: slot,
                        read_timeout: self.read_timeout,
                        silence: None,
                    };
                    return Ok(Response::from_parts(parts, Body::new(body)));
                }
                Err(mut e) => {
                    if let Some(back) = e.take_message() {
                        // Never handed to the connection (it was closing): another
                        // takes it, body and all.
                        slot.conn.closed.store(true, Ordering::Relaxed);
                        tracing::debug!(error = %e.error(), "upstream HTTP/2 connection closing; request sent on another");
                        req = back;
                        continue;
                    }
                    let error = e.into_error();
                    if let Some(fault) = body_failed.lock().ok().and_then(|mut f| f.take()) {
                        return Err(SendError::Send(fault).into());
                    }
                    match &again {
                        Some(a) if attempt < ATTEMPTS && not_processed(&error) => {
                            tracing::debug!(%error, "upstream did not process the request; sending it again");
                            req = a.request();
                        }
                        _ => return Err(SendError::Send(error.into()).into()),
                    }
                }
            }
        }
        Err(
            SendError::Send("the upstream's HTTP/2 connections closed under the request".into())
                .into(),
        )
    }

    /// A stream on the first usable connection with one free. Connections that
    /// closed, and those idle too long, are dropped on the way (the last handle
    /// dropped closes one with GOAWAY).
    fn take(&self) -> Option<Slot> {
        let now = coarse_ms();
        let mut conns = lock(&self.conns);
        conns.retain(|c| {
            c.usable()
                && !(c.streams.load(Ordering::Relaxed) == 0
                    && now.saturating_sub(c.idle_since.load(Ordering::Relaxed)) > self.idle_ms)
        });
        let free = conns.iter().find(|c| {
            c.streams.load(Ordering::Relaxed) < c.driver.max.load(Ordering::Relaxed)
                && c.send.is_ready()
        })?;
        Some(Slot::on(free))
    }

    /// The least busy usable connection, past its streams: at the connection cap a
    /// request waits on it for a stream.
    fn least_busy(&self) -> Option<Slot> {
        let conns = lock(&self.conns);
        let c = conns
            .iter()
            .filter(|c| c.usable())
            .min_by_key(|c| c.streams.load(Ordering::Relaxed))?;
        Some(Slot::on(c))
    }

    async fn open(self: &Arc<Self>) -> Result<Opened, SendError> {
        let started = Instant::now();
        let wait = self.connector.connect_timeout();
        let Ok(_turn) = tokio::time::timeout(wait, self.opening.lock()).await else {
            return Err(SendError::Connect(NoFreeConnection(wait).into()));
        };
        // Opened by the request before this one in line.
        if let Some(slot) = self.take() {
            return Ok(Opened::Slot(slot));
        }
        if let Some((at, why)) = lock(&self.failed).as_ref() {
            if *at >= started {
                return Err(SendError::Connect(why.clone().into()));
            }
        }
        if !self.connector.has_free_slot() {
            if let Some(slot) = self.least_busy() {
                return Ok(Opened::Slot(slot));
            }
        }
        let Link { io, slot } = match self.connector.connect().await {
            Ok(opened) => opened,
            Err(e) => {
                *lock(&self.failed) = Some((Instant::now(), e.to_string()));
                return Err(SendError::Connect(e));
            }
        };
        if self.offers_http1 && !io.speaks_h2() {
            self.picked_http1.store(true, Ordering::Relaxed);
            tracing::debug!("upstream target picked HTTP/1.1 by ALPN");
            return Ok(Opened::Http1(Link { io, slot }));
        }
        let conn = self.handshake(io, slot).await.map_err(|e| {
            *lock(&self.failed) = Some((Instant::now(), e.to_string()));
            SendError::Connect(e)
        })?;
        let slot = Slot::on(&conn);
        lock(&self.conns).push(conn);
        Ok(Opened::Slot(slot))
    }

    async fn handshake(
        &self,
        io: Stream,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Result<Arc<H2Conn>, BoxError> {
        let (send, conn) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(PING_EVERY)
            .keep_alive_timeout(PING_TIMEOUT)
            .keep_alive_while_idle(true)
            .handshake::<_, Body>(TokioIo::new(io))
            .await?;
        let driver = Arc::new(Driver {
            conn: Mutex::new(Some(conn)),
            max: AtomicUsize::new(self.known_max.load(Ordering::Relaxed)),
            told: AtomicBool::new(false),
        });
        let closed = Arc::new(AtomicBool::new(false));
        let driven = Driven {
            driver: driver.clone(),
            known: self.known_max.clone(),
        };
        let conn = Arc::new(H2Conn {
            send,
            streams: AtomicUsize::new(0),
            driver,
            idle_since: AtomicU64::new(coarse_ms()),
            closed,
        });
        let (watched, idle_ms) = (Arc::downgrade(&conn), self.idle_ms);
        // (Looked at four times per idle timeout: closed within 1.25 of it.)
        let every = Duration::from_millis((idle_ms / 4).max(1));
        tokio::spawn(async move {
            // The connection's slot under the cap is held until it closes.
            let _permit = permit;
            let mut driven = std::pin::pin!(driven);
            loop {
                tokio::select! {
                    r = &mut driven => {
                        if let Err(error) = r {
                            tracing::debug!(%error, "upstream HTTP/2 connection failed");
                        }
                        break;
                    }
                    // An idle connection is closed even if no request comes to
                    // find it so (its PINGs would otherwise go on for ever).
                    () = tokio::time::sleep(every) => {
                        let Some(c) = watched.upgrade() else { continue };
                        let idle = coarse_ms().saturating_sub(c.idle_since.load(Ordering::Relaxed));
                        if c.streams.load(Ordering::Relaxed) == 0 && idle > idle_ms {
                            c.closed.store(true, Ordering::Relaxed);
                            tracing::debug!(idle_ms = idle, "idle upstream HTTP/2 connection closed");
                            break;
                        }
                    }
                }
            }
            if let Some(c) = watched.upgrade() {
                c.closed.store(true, Ordering::Relaxed);
            }
            lock(&driven.driver.conn).take();
        });
        Ok(conn)
    }
}

enum Opened {
    Slot(Slot),
    Http1(Link),
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether the upstream says it never processed the stream: it sent a graceful
/// GOAWAY (`NO_ERROR`) with a last stream below it, or refused it (RFC 9113 §8.7).
fn not_processed(e: &hyper::Error) -> bool {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = src {
        if let Some(h2) = s.downcast_ref::<h2::Error>() {
            // A GOAWAY with an error code says something went wrong, maybe with
            // this very request (fields over the server's limit): sent again, it
            // would end another connection and the streams on it.
            return (h2.is_go_away()
                && h2.is_remote()
                && h2.reason() == Some(h2::Reason::NO_ERROR))
                || h2.reason() == Some(h2::Reason::REFUSED_STREAM);
        }
        src = s.source();
    }
    false
}

/// A request with no body, to send again.
struct Again {
    method: Method,
    uri: Uri,
    headers: HeaderMap,
}

impl Again {
    fn of(req: &Request<Body>) -> Again {
        Again {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers: req.headers().clone(),
        }
    }

    fn request(&self) -> Request<Body> {
        let mut req = Request::new(crate::http::body::empty());
        *req.method_mut() = self.method.clone();
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        req
    }
}

/// One stream of a connection, freed when dropped.
struct Slot {
    conn: Arc<H2Conn>,
}

impl Slot {
    fn on(conn: &Arc<H2Conn>) -> Slot {
        conn.streams.fetch_add(1, Ordering::Relaxed);
        Slot { conn: conn.clone() }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.conn.idle_since.store(coarse_ms(), Ordering::Relaxed);
        self.conn.streams.fetch_sub(1, Ordering::Relaxed);
    }
}

/// hyper's half of a connection (what reads and writes its frames), shared by the
/// task that drives it and the pool, which reads the streams the server allows.
struct Driver {
    /// Taken by its task when it stops driving it: dropped, the connection closes.
    conn: Mutex<Option<http2::Connection<TokioIo<Stream>, Body, TokioExecutor>>>,
    /// How many streams the connection may carry (the server's setting, at most
    /// `MAX_STREAMS`; until it is known, the pool's `known_max`).
    max: AtomicUsize,
    /// The server's first SETTINGS have been applied.
    told: AtomicBool,
}

impl Driver {
    /// Take the server's figure into `max` and the pool's `known` once it is the
    /// server's: hyper's has changed from its own assumption, or `answered` (an
    /// answer has come, so the SETTINGS before it are applied).
    fn learn(&self, known: &AtomicUsize, answered: bool) {
        if let Some(conn) = &*lock(&self.conn) {
            self.take(conn.current_max_send_streams(), known, answered);
        }
    }

    fn take(&self, allowed: usize, known: &AtomicUsize, answered: bool) {
        // Until the server's SETTINGS, hyper's figure is its own assumption (100).
        if allowed != HYPER_INITIAL_STREAMS || answered || self.told.load(Ordering::Relaxed) {
            self.told.store(true, Ordering::Relaxed);
            let allowed = allowed.clamp(1, MAX_STREAMS);
            self.max.store(allowed, Ordering::Relaxed);
            known.store(allowed, Ordering::Relaxed);
        }
    }
}

/// A connection driven to its end, telling its `Driver` the streams the server
/// allows whenever it is polled (hyper polls it when a request is handed to it,
/// not when the server's SETTINGS come: `H2Pool::send` asks once an answer has).
struct Driven {
    driver: Arc<Driver>,
    /// The pool's `known_max`.
    known: Arc<AtomicUsize>,
}

impl Future for Driven {
    type Output = hyper::Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let (r, allowed) = {
            let mut conn = lock(&self.driver.conn);
            let Some(conn) = conn.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            (
                Pin::new(&mut *conn).poll(cx),
                conn.current_max_send_streams(),
            )
        };
        self.driver.take(allowed, &self.known, false);
        r
    }
}

/// What hyper assumes the server allows until its SETTINGS say.
const HYPER_INITIAL_STREAMS: usize = 100;

/// The client's request body, its failure kept for the caller (hyper's task that
/// sends it only resets the stream).
struct Recorded {
    inner: Body,
    failed: Arc<Mutex<Option<BoxError>>>,
}

/// What hyper's task gets instead of the client body's own error (kept in
/// `Recorded::failed`).
#[derive(Debug, thiserror::Error)]
#[error("the client's request body failed")]
struct BodyFailed;

impl http_body::Body for Recorded {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Ready(Some(Err(e))) => {
                *lock(&self.failed) = Some(e);
                Poll::Ready(Some(Err(BodyFailed.into())))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A response body from an HTTP/2 upstream: fails after `read_timeout` of silence
/// (as the HTTP/1.1 one does), and frees its stream when it ends or is dropped
/// (dropped early, hyper resets the stream: the upstream sees the cancel).
struct H2Body {
    inner: hyper::body::Incoming,
    _slot: Slot,
    read_timeout: Duration,
    /// Made at the first wait, moved on after every frame.
    silence: Option<Pin<Box<Deadline>>>,
}

impl http_body::Body for H2Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                if let Some(s) = &mut this.silence {
                    s.as_mut()
                        .set(tokio::time::Instant::now() + this.read_timeout);
                }
                Poll::Ready(frame.map(|f| f.map_err(BoxError::from)))
            }
            Poll::Pending => {
                let timeout = this.read_timeout;
                let silence = this.silence.get_or_insert_with(|| {
                    Box::pin(Deadline::new(tokio::time::Instant::now() + timeout))
                });
                std::task::ready!(silence.as_mut().poll_passed(cx));
                Poll::Ready(Some(Err(ReadTimeout(timeout).into())))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An h2c server answering 200 to everything; counts the connections open.
    async fn server() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        limited_server(None).await
    }

    /// The same, allowing `max_streams` streams at once on a connection.
    async fn limited_server(max_streams: Option<u32>) -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let open = Arc::new(AtomicUsize::new(0));
        let counter = open.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let counter = counter.clone();
                tokio::spawn(async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    let service = hyper::service::service_fn(|_req| async {
                        Ok::<_, std::convert::Infallible>(Response::new(crate::http::body::empty()))
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .max_concurrent_streams(max_streams)
                        .serve_connection(TokioIo::new(tcp), service)
                        .await;
                    counter.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (addr, open)
    }

    fn get(addr: std::net::SocketAddr) -> Request<Body> {
        let mut req = Request::new(crate::http::body::empty());
        *req.uri_mut() = format!("http://{addr}/").parse().unwrap();
        req
    }

    /// Once an answer has come on a connection, the pool knows the streams its
    /// server allows (its SETTINGS come before any answer), though nothing wakes
    /// the connection's driver in between: the next requests are not piled on it.
    #[tokio::test]
    async fn the_servers_stream_limit_is_known_once_an_answer_has_come() {
        let (addr, _) = limited_server(Some(10)).await;
        let connector =
            Connector::new("127.0.0.1", addr.port(), None, Duration::from_secs(2), 4).unwrap();
        let pool = Arc::new(H2Pool::new(
            connector,
            false,
            Duration::from_secs(60),
            Duration::from_secs(60),
        ));
        let Ok(resp) = pool.send(get(addr)).await else {
            panic!("no answer");
        };
        assert_eq!(resp.status(), 200);
        let conns = lock(&pool.conns);
        assert_eq!(conns.len(), 1);
        assert_eq!(conns[0].driver.max.load(Ordering::Relaxed), 10);
        assert_eq!(pool.known_max.load(Ordering::Relaxed), 10);
    }

    /// A connection with no stream for the idle timeout is closed though no request
    /// comes to find it so; the next request opens another.
    #[tokio::test]
    async fn an_idle_connection_is_closed_without_a_request() {
        let (addr, open) = server().await;
        let connector =
            Connector::new("127.0.0.1", addr.port(), None, Duration::from_secs(2), 4).unwrap();
        let pool = Arc::new(H2Pool::new(
            connector,
            false,
            Duration::from_millis(200),
            Duration::from_secs(60),
        ));
        let get = || {
            let mut req = Request::new(crate::http::body::empty());
            *req.uri_mut() = format!("http://{addr}/").parse().unwrap();
            req
        };
        for round in 0..2 {
            let Ok(resp) = pool.send(get()).await else {
                panic!("no answer in round {round}");
            };
            assert_eq!(resp.status(), 200);
            drop(resp);
            assert_eq!(open.load(Ordering::SeqCst), 1, "round {round}");
            let mut waited = Duration::ZERO;
            while open.load(Ordering::SeqCst) != 0 {
                assert!(
                    waited < Duration::from_secs(3),
                    "still open after {waited:?}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
                waited += Duration::from_millis(20);
            }
        }
    }
}
