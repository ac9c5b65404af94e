//! The body of every response sluice sends, and the helpers that keep an answer's
//! framing honest whichever codec writes it.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderValue, CONNECTION, CONTENT_LENGTH, CONTENT_TYPE};
use http::{Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;

use crate::http::h1::pooled::Pooled;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The body of every response sluice sends (and of every request it sends
/// upstream): its own or a streamed upstream one. The usual ones are held inline,
/// so sending them allocates nothing: sluice's own answers (`Full`, `Empty`) and an
/// upstream's HTTP/1 answer (`Upstream`); anything else is boxed (`Body::new`).
#[derive(Default)]
pub enum Body {
    #[default]
    Empty,
    /// Bytes known whole; `None` once sent.
    Full(Option<Bytes>),
    /// An upstream's HTTP/1 response, read from its connection as the client takes it.
    Upstream(Pooled),
    Boxed(BoxBody<Bytes, BoxError>),
}

impl Body {
    /// Any other body, boxed.
    pub fn new<B>(body: B) -> Body
    where
        B: http_body::Body<Data = Bytes, Error = BoxError> + Send + Sync + 'static,
    {
        Body::Boxed(BoxBody::new(body))
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Body::Empty => "Body::Empty",
            Body::Full(_) => "Body::Full",
            Body::Upstream(_) => "Body::Upstream",
            Body::Boxed(_) => "Body::Boxed",
        })
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // Every variant is Unpin.
        match self.get_mut() {
            Body::Empty => Poll::Ready(None),
            Body::Full(b) => Poll::Ready(b.take().map(|b| Ok(Frame::data(b)))),
            Body::Upstream(b) => Pin::new(b).poll_frame(cx),
            Body::Boxed(b) => Pin::new(b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Empty => true,
            Body::Full(b) => b.is_none(),
            Body::Upstream(b) => b.is_end_stream(),
            Body::Boxed(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            Body::Empty => http_body::SizeHint::with_exact(0),
            Body::Full(b) => {
                http_body::SizeHint::with_exact(b.as_ref().map_or(0, |b| b.len() as u64))
            }
            Body::Upstream(b) => b.size_hint(),
            Body::Boxed(b) => b.size_hint(),
        }
    }
}

/// `b`, whole.
pub fn full(b: impl Into<Bytes>) -> Body {
    let b = b.into();
    if b.is_empty() {
        Body::Empty
    } else {
        Body::Full(Some(b))
    }
}

/// A body with nothing in it.
pub fn empty() -> Body {
    Body::Empty
}

/// A short text answer from sluice itself.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// A body that knows its length is sent with that length in `content-length`,
/// whatever the map states: hyper writes the map's value as it is (a debug build
/// asserts they agree), and a stated length other than the body's would desync the
/// client (its next answer taken for body, or the rest of this body for its next
/// answer). A HEAD answer, a 204 and a 304 state a length they do not send.
pub fn own_length(r: &mut Response<Body>, head: bool) {
    use http_body::Body as _;
    let status = r.status();
    if head
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return;
    }
    let Some(n) = r.body().size_hint().exact() else {
        return;
    };
    let mut stated = r.headers().get_all(CONTENT_LENGTH).iter().peekable();
    if stated.peek().is_none() {
        return;
    }
    let same = |v: &HeaderValue| crate::http::h1::framing::decimal(v.as_bytes()) == Some(n);
    if !stated.all(same) {
        r.headers_mut().insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
}

/// The answer to a HEAD: sluice's own answers (429, 404, `respond`) carry a body,
/// which HTTP/1 servers leave unsent but hyper's h2 server sends, breaking the
/// stream; so the body goes, and its length stays stated, as a GET would get it.
/// (An upstream's answer to a HEAD has no body: it is left as it is.) A 1xx, 204
/// or 304 has no body to a GET either, so it states no length (RFC 9110 §8.6).
pub fn headless(r: Response<Body>) -> Response<Body> {
    use http_body::Body as _;
    let Some(n) = r.body().size_hint().exact().filter(|n| *n > 0) else {
        return r;
    };
    let status = r.status();
    let bodiless = status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let (mut parts, _) = r.into_parts();
    if !bodiless {
        parts.headers.insert(CONTENT_LENGTH, HeaderValue::from(n));
    }
    Response::from_parts(parts, empty())
}

/// Ask the client to close the connection: used when we answer before reading a
/// request body, so unread bytes can never be taken for the next request. The
/// answer is marked `Linger`: the listener then drains what the client still sends
/// before it closes (a close with unread bytes would reset the connection, and
/// the client, still writing its body, would see the reset instead of the answer).
pub fn close(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r.extensions_mut().insert(Linger);
    r
}

/// In the extensions of an answer written before the request body was read: the
/// connection closes after it with a lingering close (`server::Linger`).
#[derive(Debug, Clone, Copy)]
pub struct Linger;

/// The answer to `CONNECT`: sluice is no forward proxy, and a tunnel would carry
/// requests past every route and limit.
pub fn connect_refused() -> Response<Body> {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "CONNECT is not supported\n");
    r.headers_mut().insert(
        http::header::ALLOW,
        HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS"),
    );
    r
}

// === the end of a response ===

/// What the end of a request does when its response body fails, before the guard
/// is dropped.
pub trait OnFail {
    /// `at_first`: the body failed when first asked for a frame. Then sluice's
    /// HTTP/1 server has written nothing of the answer, and answers 502 instead
    /// (`h1::server::NothingSent`); on HTTP/2 the head has gone.
    fn failed(&mut self, e: &BoxError, at_first: bool);

    /// `bytes` of the body went out (told only while `counts_bytes`).
    fn sent(&mut self, _bytes: usize) {}

    /// Whether the guard wants `sent` (the access log's byte count).
    fn counts_bytes(&self) -> bool {
        false
    }
}

/// A response body that holds `guard` until the body has ended (its last frame was
/// taken, or it failed: the guard is told why first) or is dropped unfinished (the
/// client went away): work that belongs to the end of a request runs in the
/// guard's `Drop`.
pub fn guarded<G: OnFail + Send + Sync + Unpin + 'static>(body: Body, guard: G) -> Body {
    Body::new(Guarded::new(body, Some(guard)))
}

/// No end of a request to tell (the admin API's requests).
impl OnFail for std::convert::Infallible {
    fn failed(&mut self, _e: &BoxError, _at_first: bool) {
        match *self {}
    }
}

/// `body` with `guard` (see `guarded`), unboxed: for a server that holds the
/// body it sends where it is (sluice's HTTP/1 server, `Site::Guard`).
pub struct Guarded<G> {
    body: Body,
    guard: Option<G>,
    /// A frame has been asked for.
    polled: bool,
}

impl<G> Guarded<G> {
    pub fn new(body: Body, guard: Option<G>) -> Guarded<G> {
        Guarded {
            body,
            guard,
            polled: false,
        }
    }

    /// Drops the body, then the guard, where they are (as dropping the whole
    /// would, without moving it): the body is over, or will not be sent.
    pub fn end(&mut self) {
        self.body = empty();
        self.guard = None;
    }
}

impl<G: OnFail + Send + Sync + Unpin + 'static> http_body::Body for Guarded<G> {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        // Both fields are Unpin (a boxed body and an Option).
        let this = &mut *self;
        let at_first = !std::mem::replace(&mut this.polled, true);
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Err(e))) => {
                if let Some(mut guard) = this.guard.take() {
                    guard.failed(e, at_first);
                }
            }
            Poll::Ready(None) => this.guard = None,
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(guard), Some(data)) = (this.guard.as_mut(), frame.data_ref()) {
                    if guard.counts_bytes() {
                        guard.sent(data.len());
                    }
                }
                if this.body.is_end_stream() {
                    this.guard = None;
                }
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
