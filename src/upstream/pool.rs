//! Upstream connections of one target: HTTP/1.1 connections kept alive between
//! requests, in one idle list per worker so that a request and its upstream
//! connection stay on one worker thread. A connection's socket is registered with
//! the reactor of the worker that opened it, which is the only one told when it is
//! readable: used from another worker, every response wakes two threads. So a
//! connection always goes back to the list of the worker that opened it, and a
//! worker takes another's only when it may open no more (at the target's
//! `max_connections`): like nginx's and Envoy's, each worker's connections are its
//! own.
//!
//! A request speaks to its connection itself (`http::h1::upstream`): there is no connection
//! task. The connection goes back to its worker's list when the response body has
//! been read to its end; a body dropped before its end closes its connection. A
//! request safe to repeat (idempotent, no body) that finds a kept connection
//! closed before any answer came is sent again on another, as browsers and Go's
//! client do. A response body the upstream stops sending for `read_timeout` fails
//! (`ReadTimeout`), and its connection is closed.

use std::cell::Cell;
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Response;
use tokio::sync::oneshot;

use crate::http::body::{Body, BoxError};
use crate::http::conn::coarse_ms;
pub use crate::http::h1::pooled::ReadTimeout;
use crate::http::h1::pooled::{Keeper, Pooled};
use crate::http::h1::upstream::{self as h1, Conn, UploadFraming};
use crate::http::transport::Connector;

/// Idle lists per target; a worker takes from its own first (`worker % LISTS`).
const LISTS: usize = 8;

thread_local! {
    static WORKER: Cell<usize> = const { Cell::new(0) };
}

/// Marks this thread as worker `i` (the main thread is worker 0).
pub fn set_worker(i: usize) {
    WORKER.with(|w| w.set(i));
}

fn worker() -> usize {
    WORKER.with(|w| w.get())
}

/// Why a request got no answer from the pool.
#[derive(Debug)]
pub enum SendError {
    /// No connection could be opened (the connector's error).
    Connect(BoxError),
    /// The connection failed while the request was sent or its answer awaited, or
    /// the request body failed.
    Send(BoxError),
    /// No connection could be opened, and nothing of the request was written: its
    /// body is given back (its fields are back in the request's map), for another
    /// target.
    Unsent(BoxError, Body),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            SendError::Connect(e) | SendError::Unsent(e, _) => write!(f, "connecting: {e}"),
            SendError::Send(e) => e.fmt(f),
        }
    }
}

/// The upstream's answer.
pub enum Exchanged {
    /// With a body that gives the connection back at its end (`Body::Upstream`,
    /// holding the boxed connection), and whether its head has a hop-by-hop
    /// field.
    Response(Response<Body>, bool),
    /// 101: the connection now speaks the protocol switched to (boxed: rare, and
    /// it would make every answer as large as itself).
    Switched(http::response::Parts, Box<Conn>),
}

struct Idle {
    conn: Box<Conn>,
    /// When it was given back (`coarse_ms`).
    since_ms: u64,
}

pub struct Pool {
    connector: Connector,
    idle: [Mutex<Vec<Idle>>; LISTS],
    /// Requests that found no kept connection and wait for one to be given back
    /// while they try to open one (which waits for a free slot under the cap).
    waiting: Mutex<VecDeque<oneshot::Sender<Box<Conn>>>>,
    /// A connection idle longer than this (milliseconds, `coarse_ms`) is closed
    /// rather than reused.
    idle_ms: u64,
    /// The longest silence between two reads of a response body
    /// (`upstreams.*.read_timeout`).
    read_timeout: Duration,
}

impl Pool {
    pub fn new(connector: Connector, idle_timeout: Duration, read_timeout: Duration) -> Pool {
        Pool {
            connector,
            idle: std::array::from_fn(|_| Mutex::new(Vec::new())),
            waiting: Mutex::new(VecDeque::new()),
            idle_ms: u64::try_from(idle_timeout.as_millis()).unwrap_or(u64::MAX),
            read_timeout,
        }
    }

    /// Send the request `parts` with `body` (origin-form URI, `Host` set; `fwd` after
    /// its fields) on a kept connection, or a new one. The request is worked on
    /// where it is (its fields are taken to hold the answer's), not moved. With
    /// `raw`, the answer's fields go there instead of into its map when they can
    /// (`h1::RawFields`).
    pub(crate) async fn send(
        self: &Arc<Self>,
        parts: &mut http::request::Parts,
        body: Body,
        mut fwd: h1::Forwarded<'_>,
        mut raw: Option<&mut Option<h1::RawFields>>,
    ) -> Result<Exchanged, SendError> {
        let framing = h1::upload_framing(parts, &body, &mut fwd);
        // Written on the first connection, in its room; given back by an attempt
        // that may be repeated.
        let mut head = None;
        let repeatable = framing == UploadFraming::Empty && parts.method.is_idempotent();
        let trailers = match framing {
            UploadFraming::Chunked => crate::http::h1::framing::announced_trailers(&parts.headers),
            _ => Vec::new(),
        };
        let mut body = Some(body);
        // Its fields are on the wire: the map takes the answer's.
        let mut map = Some(std::mem::take(&mut parts.headers));
        loop {
            let (mut conn, kept) = match self.checkout() {
                Some(conn) => (conn, true),
                None => match self.connect_or_wait().await {
                    Ok(opened) => opened,
                    // Nothing written yet: the request goes back whole.
                    Err(SendError::Connect(e)) => match (map.take(), body.take()) {
                        (Some(headers), Some(body)) => {
                            parts.headers = headers;
                            return Err(SendError::Unsent(e, body));
                        }
                        _ => return Err(SendError::Connect(e)),
                    },
                    Err(e) => return Err(e),
                },
            };
            let written = match head.take() {
                Some(head) => head,
                // (The first attempt: the fields are still in `map`.)
                None => {
                    let fields = map.as_ref().unwrap_or(&parts.headers);
                    conn.request_head(&parts.method, &parts.uri, fields, &fwd)
                }
            };
            if let Some(map) = map.take() {
                conn.keep_map(map);
            }
            let sent = body.take().unwrap_or_else(crate::http::body::empty);
            let exchange = h1::exchange(
                &mut conn,
                written,
                sent,
                framing,
                trailers.clone(),
                &parts.method,
                raw.is_some(),
            );
            match exchange.await {
                Ok(head) if head.parts.status == http::StatusCode::SWITCHING_PROTOCOLS => {
                    return Ok(Exchanged::Switched(head.parts, conn));
                }
                Ok(mut head) => {
                    if let Some(slot) = raw.as_deref_mut() {
                        *slot = head.raw.take();
                    }
                    let keeper: Arc<dyn Keeper> = self.clone();
                    let body = Pooled::new(conn, head.body, head.reusable, head.upload, keeper);
                    let body = Response::from_parts(head.parts, Body::Upstream(body));
                    return Ok(Exchanged::Response(body, head.hop_by_hop));
                }
                // Closed before anything came back (the upstream's keep-alive ran
                // out as the request went): another connection may take it.
                Err(h1::Failed {
                    error,
                    nothing_back: true,
                    head: Some(again),
                }) if kept && repeatable => {
                    tracing::debug!(error = %error, "kept upstream connection closed; sending again");
                    head = Some(again);
                }
                Err(f) => return Err(SendError::Send(f.error)),
            }
        }
    }

    /// A kept connection ready for a request: this worker's most recently used;
    /// another worker's only when no connection may be opened (it goes back to
    /// that worker's list after). Connections the upstream closed (or sent
    /// something unasked on) while idle, or idle too long, are closed on the way.
    fn checkout(&self) -> Option<Box<Conn>> {
        let own = worker() % LISTS;
        let now = coarse_ms();
        let lists = if self.connector.has_free_slot() {
            1
        } else {
            LISTS
        };
        for i in (0..lists).map(|k| (own + k) % LISTS) {
            let mut idle = lock(&self.idle[i]);
            while let Some(mut e) = idle.pop() {
                if now.saturating_sub(e.since_ms) <= self.idle_ms && e.conn.is_usable() {
                    return Some(e.conn);
                }
            }
        }
        None
    }

    /// A new connection, or one another request gives back first (`true`: kept).
    /// A connection being opened for a request that then took a given-back one is
    /// not thrown away: it goes to the pool once open. (Dropping it made the pool
    /// stay smaller than the requests in flight, so a steady load kept opening and
    /// closing connections.)
    /// One connection opened and dropped (within the connect timeout, outside the
    /// cap): whether the target takes connections at all.
    pub async fn probe(&self) -> Result<(), BoxError> {
        self.connector.probe().await
    }

    async fn connect_or_wait(self: &Arc<Self>) -> Result<(Box<Conn>, bool), SendError> {
        let mut given = self.wait_for_one();
        let pool = self.clone();
        let mut connecting = Box::pin(async move {
            let mut conn = Conn::open(&pool.connector).await?;
            conn.set_home(worker());
            // Boxed once: it moves as a pointer from then on.
            Ok(Box::new(conn))
        });
        loop {
            tokio::select! {
                biased;
                Ok(mut conn) = &mut given => {
                    if conn.is_usable() {
                        let pool = self.clone();
                        tokio::spawn(async move {
                            if let Ok(opened) = connecting.await {
                                pool.give_back(opened);
                            }
                        });
                        return Ok((conn, true));
                    }
                    given = self.wait_for_one();
                }
                opened = &mut connecting => {
                    return opened.map(|c| (c, false)).map_err(SendError::Connect);
                }
            }
        }
    }

    /// Registers a request waiting for a given-back connection; the waits of
    /// requests that went on without one are dropped here, so they never pile up.
    fn wait_for_one(&self) -> oneshot::Receiver<Box<Conn>> {
        let (give, given) = oneshot::channel();
        let mut waiting = lock(&self.waiting);
        waiting.retain(|w| !w.is_closed());
        waiting.push_back(give);
        given
    }

    /// Takes `conn`, opened elsewhere (`auto`'s HTTP/2 pool, on a target that
    /// picked HTTP/1.1), for the next request.
    pub fn adopt(&self, mut conn: Conn) {
        conn.set_home(worker());
        self.give_back(Box::new(conn));
    }

    fn give_back(&self, mut conn: Box<Conn>) {
        // A request waiting for a connection takes it at once.
        loop {
            let Some(waiter) = lock(&self.waiting).pop_front() else {
                break;
            };
            match waiter.send(conn) {
                Ok(()) => return,
                // That request went on without it.
                Err(back) => conn = back,
            }
        }
        let now = coarse_ms();
        let mut idle = lock(&self.idle[conn.home() % LISTS]);
        // The oldest kept connection is closed once idle too long, so that a list
        // used last-in first-out does not keep its bottom open for ever.
        if idle
            .first()
            .is_some_and(|e| now.saturating_sub(e.since_ms) > self.idle_ms)
        {
            idle.remove(0);
        }
        idle.push(Idle {
            conn,
            since_ms: now,
        });
    }
}

impl Keeper for Pool {
    fn give_back(&self, conn: Box<Conn>) {
        Pool::give_back(self, conn);
    }

    fn read_timeout(&self) -> Duration {
        self.read_timeout
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A target that takes connections, holds them open and says nothing.
    async fn silent() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let mut open = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                open.push(s);
            }
        });
        addr
    }

    /// A pool of at most `max` connections to `addr`, closing those idle `idle`.
    fn pool_to(addr: std::net::SocketAddr, max: usize, idle: Duration) -> Arc<Pool> {
        let connector =
            Connector::new("127.0.0.1", addr.port(), None, Duration::from_secs(2), max).unwrap();
        Arc::new(Pool::new(connector, idle, Duration::from_secs(60)))
    }

    /// A kept connection is taken again within the pool's idle timeout, and closed
    /// rather than taken after it (idle stamps on the coarse clock).
    #[tokio::test]
    async fn a_connection_idle_past_the_timeout_is_not_taken_again() {
        let pool = pool_to(silent().await, 4, Duration::from_millis(300));
        pool.give_back(Box::new(Conn::open(&pool.connector).await.unwrap()));
        let conn = pool.checkout().expect("kept within the timeout");
        pool.give_back(conn);
        tokio::time::sleep(Duration::from_millis(100)).await;
        let conn = pool.checkout().expect("kept 100 ms into a 300 ms timeout");
        pool.give_back(conn);
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            pool.checkout().is_none(),
            "taken 400 ms into a 300 ms timeout"
        );
    }

    /// A connection goes back to the list of the worker that opened it, whichever
    /// worker used it last; another worker takes it only when it may open no more
    /// connections itself.
    #[tokio::test]
    async fn a_connection_goes_back_to_the_worker_that_opened_it() {
        let pool = pool_to(silent().await, 2, Duration::from_secs(60));
        // Worker 1 opens one; worker 0 uses it and gives it back.
        set_worker(1);
        let (one, kept) = pool.connect_or_wait().await.unwrap();
        assert!(!kept);
        assert_eq!(one.home(), 1);
        set_worker(0);
        pool.give_back(one);
        assert!(pool.checkout().is_none(), "worker 0 may open its own");
        set_worker(1);
        let one = pool.checkout().expect("back on worker 1's list");
        // With the other slot taken, worker 0 takes worker 1's.
        set_worker(0);
        let (zero, _) = pool.connect_or_wait().await.unwrap();
        assert_eq!(zero.home(), 0);
        assert!(!pool.connector.has_free_slot());
        pool.give_back(one);
        let taken = pool.checkout().expect("another worker's, at the cap");
        assert_eq!(taken.home(), 1);
        // And it goes back to worker 1's list.
        pool.give_back(taken);
        set_worker(1);
        assert_eq!(pool.checkout().map(|c| c.home()), Some(1));
    }

    /// An upstream that closes every connection after its answer (`Connection:
    /// close`): no connection ever comes back to the pool.
    async fn closing_each_time() -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 4096];
                    let mut got = Vec::new();
                    while !got.ends_with(b"\r\n\r\n") {
                        match s.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => got.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = s
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok",
                        )
                        .await;
                });
            }
        });
        addr
    }

    /// Every request that found no kept connection registered a wait; those that
    /// opened their own connection instead left it behind, for ever, when nothing
    /// was ever given back.
    #[tokio::test]
    async fn the_waits_of_requests_that_opened_their_own_connection_do_not_pile_up() {
        let addr = closing_each_time().await;
        let connector =
            Connector::new("127.0.0.1", addr.port(), None, Duration::from_secs(2), 4).unwrap();
        let pool = Arc::new(Pool::new(
            connector,
            Duration::from_secs(90),
            Duration::from_secs(60),
        ));
        for _ in 0..20 {
            let req = Request::builder()
                .uri("/")
                .header("host", addr.to_string())
                .body(crate::http::body::empty())
                .unwrap();
            let (mut parts, body) = req.into_parts();
            let Ok(Exchanged::Response(resp, _)) = pool
                .send(&mut parts, body, h1::Forwarded::default(), None)
                .await
            else {
                panic!("no answer");
            };
            let body = resp.into_body().collect().await.unwrap();
            assert_eq!(body.to_bytes(), "ok");
        }
        assert!(
            lock(&pool.waiting).len() <= 1,
            "{}",
            lock(&pool.waiting).len()
        );
    }
}
