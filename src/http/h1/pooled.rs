//! The body of an upstream's HTTP/1 response, read from its connection as the
//! client takes it: the connection goes back to whoever keeps it (the target's
//! pool, `Keeper`) at the body's end if it may carry another request, and is
//! closed if the body is dropped before.
//!
//! It is a variant of the one response body type (`body::Body::Upstream`), so
//! the answer of every proxied request is sent without a heap allocation of its
//! own. It is one pointer, the boxed connection (boxed once, when it is opened):
//! what the body's reading needs (`Reading`) is kept in the connection, so the
//! answer stays as small as a boxed body while it is handed up through the
//! request path's futures (an answer 64 bytes larger was copied by `memcpy` at
//! each of about 20 moves).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::Frame;

use crate::http::body::BoxError;
use crate::http::h1::upstream::{Conn, Decoder, Upload, UploadError};
use crate::http::wake::Deadline;

/// Where a connection goes when the answer it carried has been read to its end.
pub trait Keeper: Send + Sync {
    /// Takes the connection back, for another request.
    fn give_back(&self, conn: Box<Conn>);
    /// The longest silence between two reads of a response body
    /// (`upstreams.*.read_timeout`).
    fn read_timeout(&self) -> Duration;
}

/// The upstream sent nothing more of a response body for `upstreams.*.read_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent nothing of the response body for {0:?}")]
pub struct ReadTimeout(pub Duration);

/// What a connection holds of the answer whose body it carries.
pub(crate) struct Reading {
    decoder: Decoder,
    /// The exchange left the connection fit for another request once the body
    /// has ended.
    reusable: bool,
    /// A frame came, or the upload moved, since the deadline was last set (true
    /// when an answer starts: a deadline kept from the last one is moved on).
    progressed: bool,
    /// The request body still going up (the upstream answered before its end).
    upload: Option<Box<Upload>>,
    /// Where the connection goes back; held only while the body is read, so an
    /// idle connection holds no reference to its pool.
    keeper: Option<Arc<dyn Keeper>>,
    /// When the upstream's silence runs out: made at the first wait for a body
    /// (most bodies come with their head and never wait), then moved on after each
    /// frame or upload progress (a store: the timer itself moves only when it
    /// fires early), and kept for the connection's next answers.
    silence: Option<Pin<Box<Deadline>>>,
}

impl Default for Reading {
    fn default() -> Reading {
        Reading {
            decoder: Decoder::Done,
            reusable: false,
            progressed: true,
            upload: None,
            keeper: None,
            silence: None,
        }
    }
}

/// A poll of a body.
type Polled = Poll<Option<Result<Frame<Bytes>, BoxError>>>;

/// What a poll leaves the connection fit for.
enum After {
    /// More of the body to read.
    More,
    /// The body ended: the connection goes back if it may.
    Ended,
    /// The connection failed, or carries nothing of use: it closes.
    Close,
}

impl Reading {
    fn poll_frame(&mut self, conn: &mut Conn, cx: &mut Context<'_>) -> (Polled, After) {
        if let Some(up) = self.upload.as_mut() {
            let written = up.written();
            let sent = up.poll_send(conn, cx);
            // The upstream may be waiting for the rest of the body: while it moves,
            // the silence is the client's (`request_body_timeout` bounds that).
            self.progressed |= up.written() != written;
            match sent {
                Poll::Pending => {}
                Poll::Ready(Ok(())) => self.upload = None,
                // The client's body failed: so does the exchange (hyper's client
                // closed the connection, failing the response body too).
                Poll::Ready(Err(UploadError::Body(e))) => {
                    self.upload = None;
                    return (Poll::Ready(Some(Err(e))), After::Close);
                }
                // The upstream stopped taking it: its answer is still read, and the
                // connection closes after it.
                Poll::Ready(Err(UploadError::Write(_))) => {
                    self.upload = None;
                    self.reusable = false;
                }
            }
        }
        let frame = match self.decoder.poll_frame(conn, cx) {
            Poll::Ready(frame) => frame,
            Poll::Pending => return self.poll_silence(cx),
        };
        self.progressed = true;
        let after = match &frame {
            Some(Ok(_)) if !self.decoder.is_end() => After::More,
            // The end: the last data, trailers or nothing more.
            None | Some(Ok(_)) => After::Ended,
            // The connection failed with the body: it is closed.
            Some(Err(_)) => After::Close,
        };
        (Poll::Ready(frame), after)
    }

    /// The upstream has sent nothing new: the body fails once that has lasted
    /// `read_timeout`, counted from the first wait after the last frame or upload
    /// progress (an upstream may wait for the whole upload before it goes on). As
    /// nginx's `proxy_read_timeout`: the time between two reads, not the whole body.
    /// The connection is closed: what it still carries is no answer to anything.
    fn poll_silence(&mut self, cx: &mut Context<'_>) -> (Polled, After) {
        let timeout = self
            .keeper
            .as_ref()
            .map_or(Duration::MAX, |k| k.read_timeout());
        let at = tokio::time::Instant::now().checked_add(timeout);
        // (A timeout too far to count: the silence never runs out.)
        let Some(at) = at else {
            return (Poll::Pending, After::More);
        };
        let silence = match &mut self.silence {
            Some(d) => {
                if self.progressed {
                    d.as_mut().set(at);
                }
                d
            }
            None => self.silence.insert(Box::pin(Deadline::new(at))),
        };
        self.progressed = false;
        if silence.as_mut().poll_passed(cx).is_pending() {
            return (Poll::Pending, After::More);
        }
        self.upload = None;
        (
            Poll::Ready(Some(Err(ReadTimeout(timeout).into()))),
            After::Close,
        )
    }
}

/// A response body read from its connection as the client takes it; the
/// connection goes back to its keeper at its end (if it may carry another
/// request), and is closed if the body is dropped before.
pub struct Pooled(Option<Box<Conn>>);

impl Pooled {
    /// The body `decoder` reads from `conn`; `reusable`: the exchange left the
    /// connection fit for another request once the body has ended; `upload`: the
    /// request body still to send; `keeper`: where the connection goes after.
    pub fn new(
        mut conn: Box<Conn>,
        decoder: Decoder,
        reusable: bool,
        upload: Option<Box<Upload>>,
        keeper: Arc<dyn Keeper>,
    ) -> Pooled {
        let r = &mut conn.reading;
        r.decoder = decoder;
        r.reusable = reusable;
        r.progressed = true;
        r.upload = upload;
        r.keeper = Some(keeper);
        Pooled(Some(conn))
    }

    fn release(&mut self) {
        if let Some(mut conn) = self.0.take() {
            let r = &mut conn.reading;
            let keeper = r.keeper.take();
            // Bytes after the end of the answer: nothing asked for them. An upload
            // still going: the connection is busy with it, and closes.
            let reusable = r.reusable && r.upload.take().is_none();
            if reusable && !conn.has_unread() {
                if let Some(keeper) = keeper {
                    keeper.give_back(conn);
                }
            }
        }
    }
}

impl http_body::Body for Pooled {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let Some(conn) = self.0.as_deref_mut() else {
            return Poll::Ready(None);
        };
        // Out of the connection while it reads from it.
        let mut reading = std::mem::take(&mut conn.reading);
        let (polled, after) = reading.poll_frame(conn, cx);
        conn.reading = reading;
        match after {
            After::More => {}
            After::Ended => self.release(),
            After::Close => self.0 = None,
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.0.as_ref().is_none_or(|c| c.reading.decoder.is_end())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.0 {
            Some(c) => c.reading.decoder.size_hint(),
            None => http_body::SizeHint::with_exact(0),
        }
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        // A body with nothing in it (HEAD, 204, 304) may never be polled.
        if self.0.as_ref().is_some_and(|c| c.reading.decoder.is_end()) {
            self.release();
        }
    }
}
