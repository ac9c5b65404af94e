//! Upstream connections of one target: HTTP/1.1 connections kept alive between
//! requests, in one idle list per worker so that a request, its upstream
//! connection's task and its timers stay on the worker thread that took it.
//!
//! Instead of hyper-util's pooled client (a shared pool behind a mutex, boxed
//! futures, and a task spawned per request to wait for the connection to be
//! ready again), a connection goes back to its worker's list when the response
//! body has been read to its end; a body dropped before its end takes its
//! connection with it (hyper closes it). A request sent on a kept connection that
//! turns out to be closed before the request was written is sent again on
//! another, as hyper-util's client does.

use std::cell::Cell;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, Uri};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::answer::{Body, BoxError};

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
    /// The connection failed while the request was sent or its answer awaited.
    Send(hyper::Error),
}

struct Idle {
    tx: SendRequest<Body>,
    since: Instant,
}

pub struct Pool<C> {
    connector: C,
    /// `scheme://authority/` of the target, what the connector dials.
    dst: Uri,
    idle: [Mutex<Vec<Idle>>; LISTS],
    /// Requests that found no kept connection and wait for one to be given back
    /// while they try to open one (which waits for a free slot under the cap).
    waiting: Mutex<VecDeque<oneshot::Sender<SendRequest<Body>>>>,
    /// A connection idle longer than this is closed rather than reused.
    idle_timeout: Duration,
}

impl<C> Pool<C>
where
    C: tower_service::Service<Uri> + Clone + Send + 'static,
    C::Future: Send + 'static,
    C::Error: Into<BoxError>,
    C::Response: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    pub fn new(connector: C, dst: Uri, idle_timeout: Duration) -> Pool<C> {
        Pool {
            connector,
            dst,
            idle: std::array::from_fn(|_| Mutex::new(Vec::new())),
            waiting: Mutex::new(VecDeque::new()),
            idle_timeout,
        }
    }

    /// Send `req` (origin-form URI, `Host` set) on a kept connection, or a new one.
    /// The answer comes with the connection's `Lease`, to give back once its body
    /// has been read (`Pooled`).
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<Body>,
    ) -> Result<(Response<Incoming>, Lease<C>), SendError> {
        loop {
            let (mut tx, kept) = match self.checkout() {
                Some(tx) => (tx, true),
                None => self.connect_or_wait().await?,
            };
            match tx.try_send_request(req).await {
                Ok(resp) => {
                    let lease = Lease {
                        pool: self.clone(),
                        tx,
                    };
                    return Ok((resp, lease));
                }
                Err(mut e) => match e.take_message() {
                    // Closed before the request was written: nothing reached the
                    // upstream, so another connection may take it.
                    Some(r) if kept => req = r,
                    _ => return Err(SendError::Send(e.into_error())),
                },
            }
        }
    }

    /// A kept connection ready for a request: this worker's most recently used
    /// first, then another worker's. A connection still finishing its last exchange
    /// (the upstream answered before the request body was all sent, and the upload
    /// goes on) is left where it is, never waited for.
    fn checkout(&self) -> Option<SendRequest<Body>> {
        let own = worker() % LISTS;
        for i in (0..LISTS).map(|k| (own + k) % LISTS) {
            let mut idle = lock(&self.idle[i]);
            let mut busy = Vec::new();
            let mut found = None;
            while let Some(e) = idle.pop() {
                if e.tx.is_closed() || e.since.elapsed() > self.idle_timeout {
                    continue;
                }
                if e.tx.is_ready() {
                    found = Some(e.tx);
                    break;
                }
                busy.push(e);
            }
            // Back under the others, in their order.
            busy.reverse();
            idle.splice(0..0, busy);
            if found.is_some() {
                return found;
            }
        }
        None
    }

    /// A new connection, or one another request gives back first (`true`: kept).
    async fn connect_or_wait(&self) -> Result<(SendRequest<Body>, bool), SendError> {
        let mut given = self.wait_for_one();
        let connecting = self.connect();
        tokio::pin!(connecting);
        loop {
            tokio::select! {
                biased;
                Ok(tx) = &mut given => {
                    if tx.is_ready() {
                        return Ok((tx, true));
                    }
                    // Closed or busy meanwhile: kept (if open) for later, and this
                    // request waits on.
                    self.keep(tx);
                    given = self.wait_for_one();
                }
                opened = &mut connecting => {
                    return opened.map(|tx| (tx, false)).map_err(SendError::Connect);
                }
            }
        }
    }

    /// Registers a request waiting for a given-back connection; the waits of
    /// requests that went on without one are dropped here, so they never pile up.
    fn wait_for_one(&self) -> oneshot::Receiver<SendRequest<Body>> {
        let (give, given) = oneshot::channel();
        let mut waiting = lock(&self.waiting);
        waiting.retain(|w| !w.is_closed());
        waiting.push_back(give);
        given
    }

    async fn connect(&self) -> Result<SendRequest<Body>, BoxError> {
        let mut connector = self.connector.clone();
        std::future::poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(Into::into)?;
        let io = connector.call(self.dst.clone()).await.map_err(Into::into)?;
        let (tx, conn) = http1::Builder::new().handshake(io).await?;
        tokio::spawn(async move {
            if let Err(e) = conn.with_upgrades().await {
                tracing::debug!(error = %e, "upstream connection ended with an error");
            }
        });
        Ok(tx)
    }
}

impl<C> Pool<C> {
    fn give_back(&self, mut tx: SendRequest<Body>) {
        if tx.is_closed() {
            return;
        }
        // A request waiting for a connection takes a ready one at once.
        while tx.is_ready() {
            let Some(waiter) = lock(&self.waiting).pop_front() else {
                break;
            };
            match waiter.send(tx) {
                Ok(()) => return,
                // That request went on without it.
                Err(back) => tx = back,
            }
        }
        self.keep(tx);
    }

    /// Into this worker's idle list.
    fn keep(&self, tx: SendRequest<Body>) {
        if tx.is_closed() {
            return;
        }
        let now = Instant::now();
        let mut idle = lock(&self.idle[worker() % LISTS]);
        // The oldest kept connection is closed once idle too long, so that a list
        // used last-in first-out does not keep its bottom open for ever.
        if idle
            .first()
            .is_some_and(|e| now.duration_since(e.since) > self.idle_timeout)
        {
            idle.remove(0);
        }
        idle.push(Idle { tx, since: now });
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A connection lent to one request: given back by `Pooled` at the end of the
/// response body, closed if dropped before (or on an upgrade).
pub struct Lease<C> {
    pool: Arc<Pool<C>>,
    tx: SendRequest<Body>,
}

/// A response body that gives its connection back to the pool when it has been
/// read to its end.
pub struct Pooled<C> {
    body: Incoming,
    lease: Option<Lease<C>>,
}

impl<C> Pooled<C> {
    pub fn new(body: Incoming, lease: Lease<C>) -> Pooled<C> {
        Pooled {
            body,
            lease: Some(lease),
        }
    }

    fn release(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.pool.give_back(lease.tx);
        }
    }
}

impl<C> http_body::Body for Pooled<C> {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        let frame = std::task::ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.release(),
            // Trailers end a body (hyper asks no further after them).
            Some(Ok(f)) if f.is_trailers() || this.body.is_end_stream() => this.release(),
            Some(Ok(_)) => {}
            // The connection failed with the body: it is not given back.
            Some(Err(_)) => this.lease = None,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}

impl<C> Drop for Pooled<C> {
    fn drop(&mut self) {
        // A body with nothing in it (HEAD, 204, 304) may never be polled.
        if self.body.is_end_stream() {
            self.release();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::connect::HttpConnector;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
        let dst: Uri = format!("http://{addr}/").parse().unwrap();
        let pool = Arc::new(Pool::new(
            HttpConnector::new(),
            dst,
            Duration::from_secs(90),
        ));
        for _ in 0..20 {
            let req = Request::builder()
                .uri("/")
                .header("host", addr.to_string())
                .body(crate::answer::full(Bytes::new()))
                .unwrap();
            let (resp, lease) = pool.send(req).await.expect("an answer");
            let body = Pooled::new(resp.into_body(), lease)
                .collect()
                .await
                .unwrap();
            assert_eq!(body.to_bytes(), "ok");
        }
        assert!(
            lock(&pool.waiting).len() <= 1,
            "{}",
            lock(&pool.waiting).len()
        );
    }
}
