//! The client connection's I/O wrappers: a write that makes no progress for
//! `send_timeout` fails (`WriteStall`), and a close after an early answer lingers
//! (`Linger`).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::http::conn::Activity;

/// A client connection whose writes fail with `TimedOut` once one has waited
/// `timeout` without the socket taking a byte (nginx's `send_timeout`: the time
/// between two successive writes, not for the whole response). hyper does not poll
/// a response body while the socket is not writable, so no timer in the body would
/// fire: the clock has to be here, under TLS and HTTP. The failed write ends the
/// connection, and with it every request on it (the upstream connection and the
/// slots they hold). Reading is left alone: `request_header_timeout`,
/// `request_body_timeout` and `idle_timeout` cover a client that sends nothing.
pub(super) struct WriteStall<T> {
    io: T,
    timeout: Duration,
    /// Armed when a write first waits, cleared when one goes through.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> WriteStall<T> {
    pub(super) fn new(io: T, timeout: Duration) -> WriteStall<T> {
        WriteStall {
            io,
            timeout,
            stall: None,
        }
    }

    fn watch<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<R>>,
    ) -> std::task::Poll<std::io::Result<R>> {
        use std::task::Poll;
        if r.is_ready() {
            self.stall = None;
            return r;
        }
        let timeout = self.timeout;
        let stall = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took nothing for {timeout:?} (server.send_timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteStall<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteStall<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

/// How long a lingering close reads at most in all (nginx's `lingering_time`).
pub(super) const LINGER_TIME: Duration = Duration::from_secs(30);
/// A lingering close ends after this long with nothing read (nginx's
/// `lingering_timeout`).
const LINGER_SILENCE: Duration = Duration::from_secs(5);
/// A lingering close throws away at most this much.
const LINGER_BYTES: usize = 64 * 1024 * 1024;

/// A client connection that, when it closes after an answer written before its
/// request body was read (`Activity::linger`), lingers as nginx and Apache do:
/// its write side is shut (the client reads the answer to its end), then what the
/// client still sends is read and thrown away until it closes its end, or for at
/// most `LINGER_TIME`, `LINGER_SILENCE` without a byte, or `LINGER_BYTES`; then it
/// closes. A close with unread bytes would send a reset, and a client still
/// writing its body would see that instead of the answer. The drain runs in
/// `poll_shutdown`, where `http::h1::server` (HTTP/1.1, plain or under TLS) ends a connection,
/// so the connection holds its slots, and counts for shutdown, until it is over.
pub(super) struct Linger<T> {
    io: T,
    activity: Arc<Activity>,
    /// `LINGER_TIME` on the gateway's port, shorter on the admin port.
    most: Duration,
    drain: Drain,
}

enum Drain {
    NotYet,
    /// The write side is shut; reading until `at`, moved on by every read.
    Reading {
        until: tokio::time::Instant,
        at: Pin<Box<tokio::time::Sleep>>,
        left: usize,
    },
    Over,
}

impl<T> Linger<T> {
    pub(super) fn new(io: T, activity: Arc<Activity>, most: Duration) -> Linger<T> {
        Linger {
            io,
            activity,
            most,
            drain: Drain::NotYet,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Linger<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Linger<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            match &mut this.drain {
                Drain::NotYet => {
                    std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
                    if !this.activity.linger.load(Ordering::Relaxed) {
                        this.drain = Drain::Over;
                        return Poll::Ready(Ok(()));
                    }
                    this.activity.draining.store(true, Ordering::Release);
                    let now = tokio::time::Instant::now();
                    let until = now + this.most;
                    this.drain = Drain::Reading {
                        until,
                        at: Box::pin(tokio::time::sleep_until((now + LINGER_SILENCE).min(until))),
                        left: LINGER_BYTES,
                    };
                }
                Drain::Reading { until, at, left } => {
                    let mut room = [0u8; 8192];
                    let mut buf = tokio::io::ReadBuf::new(&mut room);
                    match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                        Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                            *left = left.saturating_sub(buf.filled().len());
                            if *left == 0 {
                                this.drain = Drain::Over;
                            } else {
                                let next =
                                    (tokio::time::Instant::now() + LINGER_SILENCE).min(*until);
                                at.as_mut().reset(next);
                            }
                        }
                        // The client closed its end (or the connection failed).
                        Poll::Ready(_) => this.drain = Drain::Over,
                        Poll::Pending => {
                            std::task::ready!(at.as_mut().poll(cx));
                            this.drain = Drain::Over;
                        }
                    }
                }
                Drain::Over => {
                    this.activity.draining.store(false, Ordering::Release);
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
}
