//! A client's request as the layers above the codecs see it, whichever HTTP version
//! brought it: its body (`ClientBody`, and `ReadBody` for one whose start was read
//! already), and what its head says of that body.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::Frame;
use hyper::body::Incoming;

use crate::http::body::BoxError;
use crate::http::h1::framing;
use crate::http::h1::request_body::RequestBody;

/// The length the request's head declares for its body (`Content-Length`): none
/// when it declares none, or none that is one valid number.
pub fn declared_length(h: &HeaderMap) -> Option<u64> {
    framing::content_length(h)
}

/// Whether an answer sent before the request's body is read leaves that body on
/// the client's connection, in the way of its next request (so that answer must
/// close the connection): an HTTP/1 request that announces a body. An HTTP/2
/// stream's body is its own.
pub fn body_in_the_way(parts: &http::request::Parts) -> bool {
    parts.version < http::Version::HTTP_2 && framing::announces_body(&parts.headers)
}

/// A client's request body: none, read by sluice's HTTP/1 server, hyper's
/// (HTTP/2), or one of these whose start the request path has read already.
pub enum ClientBody {
    Empty,
    Own(RequestBody),
    Hyper(Incoming),
    Read(Box<ReadBody>),
}

impl http_body::Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            ClientBody::Empty => Poll::Ready(None),
            ClientBody::Own(b) => Pin::new(b).poll_frame(cx),
            ClientBody::Hyper(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            ClientBody::Read(b) => Pin::new(&mut **b).poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            ClientBody::Empty => true,
            ClientBody::Own(b) => b.is_end_stream(),
            ClientBody::Hyper(b) => b.is_end_stream(),
            ClientBody::Read(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self {
            ClientBody::Empty => http_body::SizeHint::with_exact(0),
            ClientBody::Own(b) => b.size_hint(),
            ClientBody::Hyper(b) => b.size_hint(),
            ClientBody::Read(b) => b.size_hint(),
        }
    }
}

/// A request body whose start was read before it is forwarded: the frames read,
/// then the rest as it comes. Until it is first asked for a frame it tells what the
/// body told before any of it was read (not over, its size hint), so the upload
/// keeps the client's framing: a `Content-Length` stays, a chunked body stays
/// chunked. Two readers make one: `pipeline::body_key` (a key in the body, `new`)
/// and the upstream's read-ahead (`server.request_buffer`, whose `H` gives the
/// bytes of each frame handed on back to the process's count).
pub struct ReadBody<B = ClientBody, H = ()> {
    frames: VecDeque<Frame<Bytes>>,
    /// Told of each frame's bytes as it is handed on.
    held: H,
    /// None: the body had ended.
    rest: Option<B>,
    hint: http_body::SizeHint,
    /// A frame has been asked for.
    started: bool,
}

/// What a `ReadBody` tells of each frame it hands on from those it read.
pub trait Held: Unpin {
    fn handed(&mut self, bytes: usize);
}

impl Held for () {
    fn handed(&mut self, _bytes: usize) {}
}

impl ReadBody {
    /// `data`, then `trailers`, then `rest` (None when the body has ended); `hint`
    /// is the body's size hint before any of it was read.
    pub fn new(
        data: Bytes,
        trailers: Option<HeaderMap>,
        rest: Option<ClientBody>,
        hint: http_body::SizeHint,
    ) -> ReadBody {
        let mut frames = VecDeque::with_capacity(2);
        if !data.is_empty() {
            frames.push_back(Frame::data(data));
        }
        if let Some(t) = trailers {
            frames.push_back(Frame::trailers(t));
        }
        ReadBody::of_frames(frames, (), rest, hint)
    }
}

impl<B, H> ReadBody<B, H> {
    /// `frames`, then `rest` (None when the body has ended), each frame handed on
    /// told to `held`; `hint` is the body's size hint before any of it was read.
    pub fn of_frames(
        frames: VecDeque<Frame<Bytes>>,
        held: H,
        rest: Option<B>,
        hint: http_body::SizeHint,
    ) -> ReadBody<B, H> {
        ReadBody {
            frames,
            held,
            rest,
            hint,
            started: false,
        }
    }
}

impl<B, H> http_body::Body for ReadBody<B, H>
where
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
    H: Held,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        this.started = true;
        if let Some(frame) = this.frames.pop_front() {
            this.held.handed(frame.data_ref().map_or(0, |d| d.len()));
            return Poll::Ready(Some(Ok(frame)));
        }
        match &mut this.rest {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.started
            && self.frames.is_empty()
            && self.rest.as_ref().is_none_or(|r| r.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        if !self.started {
            return self.hint;
        }
        let read: u64 = self
            .frames
            .iter()
            .map(|f| f.data_ref().map_or(0, |d| d.len() as u64))
            .sum();
        hint_after_read(read, self.rest.as_ref().map(|r| r.size_hint()))
    }
}

/// The size hint of a body that gives `read` bytes it holds already, then `rest`
/// (None: the body had ended).
fn hint_after_read(read: u64, rest: Option<http_body::SizeHint>) -> http_body::SizeHint {
    let rest = rest.unwrap_or_else(|| http_body::SizeHint::with_exact(0));
    let mut hint = http_body::SizeHint::new();
    hint.set_lower(rest.lower().saturating_add(read));
    if let Some(upper) = rest.upper() {
        hint.set_upper(upper.saturating_add(read));
    }
    hint
}

/// A body as sluice's HTTP/1 server reads it, and the client's end of its
/// connection: a task feeds the body from the connection, as the server does.
/// `length`: the body's `Content-Length`, or chunked when None.
#[cfg(test)]
pub(crate) fn http1_body_for_tests(
    length: Option<u64>,
    expect_continue: bool,
) -> (ClientBody, tokio::io::DuplexStream) {
    use crate::http::h1::decode::Decoder;
    use crate::http::h1::request_body::Inflow;
    let decode = length.map_or_else(Decoder::chunked, Decoder::Length);
    let (client, mut conn) = tokio::io::duplex(256 * 1024);
    let (inflow, body) = Inflow::new(decode, expect_continue);
    tokio::spawn(async move {
        let mut buf = bytes::BytesMut::new();
        let _ = std::future::poll_fn(|cx| inflow.poll_feed(cx, &mut conn, &mut buf)).await;
    });
    (ClientBody::Own(body), client)
}
