//! HTTP/2 on the listeners: hyper's server, its requests counted in the
//! connection's `Activity`, and a watchdog for streams whose window stays shut.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::http::body::Body;
use crate::http::conn::{Activity, InFlight};

/// hyper's HTTP/2 server (h2c, and h2 under TLS); HTTP/1.1 is sluice's own
/// (`http::h1::server`). HTTP/2 connections are pinged so that dead peers are noticed. A
/// decoded header list larger than `max_head` resets its stream with 431.
pub(super) fn http_builder<Z>(site: Arc<Z>, max_head: usize) -> Http<Z> {
    let mut h2 = http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(H2_STREAMS)
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_header_list_size(u32::try_from(max_head).unwrap_or(u32::MAX));
    Http { site, h2 }
}

/// Concurrent streams one HTTP/2 connection may open (nginx's
/// `http2_max_concurrent_streams`; hyper's default is 200). Each may hold up to
/// `server.request_buffer` of its body read ahead.
const H2_STREAMS: u32 = 128;

/// The HTTP servers of a listener: where its HTTP/1.1 requests go (`http::h1::server`),
/// and hyper's HTTP/2. A plain connection's protocol is known from its first bytes
/// (`first_bytes`), so it goes straight to HTTP/1.1 or HTTP/2 without hyper-util's
/// detection layer, which re-reads every request through a rewind buffer.
pub struct Http<Z> {
    pub(super) site: Arc<Z>,
    pub(super) h2: http2::Builder<TokioExecutor>,
}

/// An HTTP/2 response body that keeps its request counted as in flight until it
/// ends, shared with a watchdog (`Taken`).
pub(super) struct TrackedBody {
    inner: Arc<Mutex<Taken>>,
    send_timeout: Duration,
    _in_flight: InFlight,
}

/// An HTTP/2 response body and when it last handed out a frame that has not been
/// followed by a request for the next one. The HTTP/2 layer asks for the next
/// frame only once the stream has flow-control window for the last one: a client
/// that keeps its connection flowing but never opens one stream's window stalls
/// that stream without stalling the socket, out of `WriteStall`'s sight. When
/// that lasts `send_timeout`, the watchdog drops the body (releasing its upstream
/// connection, concurrency lease and tally); the stream is reset with an error
/// when (if ever) the client opens the window.
struct Taken {
    body: Option<Body>,
    handed: Option<tokio::time::Instant>,
    watched: bool,
}

fn lock(t: &Mutex<Taken>) -> std::sync::MutexGuard<'_, Taken> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

async fn watch_stream(taken: std::sync::Weak<Mutex<Taken>>, timeout: Duration) {
    loop {
        let due = {
            let Some(t) = taken.upgrade() else { return };
            let g = lock(&t);
            g.handed.unwrap_or_else(tokio::time::Instant::now) + timeout
        };
        tokio::time::sleep_until(due).await;
        let Some(t) = taken.upgrade() else { return };
        let stalled = {
            let mut g = lock(&t);
            match g.handed {
                Some(at) if at.elapsed() >= timeout => g.body.take(),
                _ => None,
            }
        };
        if let Some(body) = stalled {
            drop(body);
            tracing::debug!(
                ?timeout,
                "an HTTP/2 stream's window stayed closed for send_timeout: response dropped"
            );
            return;
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = crate::http::body::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let shared = self.inner.clone();
        let mut g = lock(&shared);
        g.handed = None;
        let Some(body) = g.body.as_mut() else {
            return Poll::Ready(Some(Err(
                "the client opened no window for the stream within send_timeout".into(),
            )));
        };
        let r = Pin::new(&mut *body).poll_frame(cx);
        if matches!(r, Poll::Ready(Some(Ok(_)))) && !body.is_end_stream() {
            g.handed = Some(tokio::time::Instant::now());
            if !g.watched {
                g.watched = true;
                tokio::spawn(watch_stream(Arc::downgrade(&shared), self.send_timeout));
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.inner)
            .body
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        lock(&self.inner)
            .body
            .as_ref()
            .map(|b| b.size_hint())
            .unwrap_or_default()
    }
}

/// The listener's HTTP/2 service with each request counted in the connection's
/// `Activity` (`http::h1::server` counts HTTP/1.1 requests itself).
pub(super) struct Tracked<S> {
    pub(super) inner: S,
    pub(super) activity: Arc<Activity>,
    /// `server.send_timeout`, for HTTP/2 streams (see `Taken`).
    pub(super) send_timeout: Duration,
}

/// What the gateway's and the admin port's services return: boxed once, where the
/// request's future is made, so that it is never copied again on its way to hyper.
pub(super) type H2Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + Unpin + 'static,
{
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = TrackedFuture<S::Future>;

    fn call(&self, req: Request<Incoming>) -> TrackedFuture<S::Future> {
        let in_flight = self.activity.start();
        TrackedFuture {
            response: self.inner.call(req),
            send_timeout: self.send_timeout,
            in_flight: Some(in_flight),
        }
    }
}

/// The response of `Tracked`'s service, its body tracked.
pub(super) struct TrackedFuture<F> {
    response: F,
    send_timeout: Duration,
    in_flight: Option<InFlight>,
}

impl<F> Future for TrackedFuture<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>> + Unpin,
{
    type Output = Result<Response<TrackedBody>, Infallible>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        let Ok(resp) = std::task::ready!(Pin::new(&mut this.response).poll(cx));
        let in_flight = this
            .in_flight
            .take()
            .expect("TrackedFuture polled after it was ready");
        std::task::Poll::Ready(Ok(resp.map(|body| TrackedBody {
            inner: Arc::new(Mutex::new(Taken {
                body: Some(body),
                handed: None,
                watched: false,
            })),
            send_timeout: this.send_timeout,
            _in_flight: in_flight,
        })))
    }
}
