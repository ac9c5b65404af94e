//! HTTP/1.1 to upstreams, spoken in the request's own task: the request head is
//! written from the request's `HeaderMap`, the body streamed after it, the response
//! head read with the head scanner (`head`) and its body decoded as the client reads it. No
//! connection task, no channel between the request and its connection, and one
//! buffer per connection (pingora's route, instead of hyper's client).
//!
//! Framing follows hyper's client, which this replaces: the same rules for when a
//! request gets `Content-Length`, `Transfer-Encoding: chunked` or no body, and for
//! how a response's body is delimited (RFC 9112 §6.3).

use std::fmt::Write as _;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};
use http_body::{Body as _, Frame};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::OwnedSemaphorePermit;

use super::decode::DecodeError;
pub(crate) use super::decode::Source;
pub use super::decode::{Chunk, Decoder};
use super::framing::{
    check_buffered_chunks, content_length, items, may_trail, Connection, FramingError, Length,
    MAX_HEAD,
};
use super::head::{self, HeadError, ResponseHead};
use super::pooled::Reading;
use crate::http::body::{Body, BoxError};
use crate::http::transport::{Connector, Link, Stream};

/// Bytes asked of the socket per read (at least).
const READ_SIZE: usize = 16 * 1024;

/// A malformed or unexpected message from the upstream.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("the upstream closed the connection before answering")]
    ClosedBeforeAnswer,
    #[error("the upstream closed the connection before the end of the body")]
    IncompleteBody,
    #[error("malformed response from the upstream: {0}")]
    Malformed(&'static str),
    #[error("response head or trailer block larger than {MAX_HEAD} bytes")]
    HeadTooLarge,
    #[error("the request body did not match its Content-Length")]
    BodyLength,
}

impl From<FramingError> for WireError {
    fn from(e: FramingError) -> WireError {
        match e {
            FramingError::Malformed(what) => WireError::Malformed(what),
            FramingError::TooLarge => WireError::HeadTooLarge,
        }
    }
}

// === connections ===

/// An open upstream connection: its stream, what has been read from it and not yet
/// used, and its slot under the target's `max_connections`, held until it closes.
pub struct Conn {
    io: Stream,
    buf: BytesMut,
    _slot: OwnedSemaphorePermit,
    /// Kept from one response head to the next (boxed: a connection moves in and
    /// out of the pool on every request).
    kept: Box<Kept>,
    /// The pool's mark: the worker thread that opened it (`home`).
    home: usize,
    /// The answer whose body it carries, while that is read (`pooled`).
    pub(crate) reading: Reading,
}

/// A field value as the head scanner (`head`) found it, not checked byte by byte
/// again where that cannot find anything.
pub(crate) fn parsed_value(value: Bytes) -> Result<HeaderValue, header::InvalidHeaderValue> {
    if value.is_ascii() {
        // SAFETY: the head scanner (`head::field_lines`, as httparse) takes into a
        // value only `\t`, ` `..=`~` and 0x80..=0xFF, exactly the bytes a
        // `HeaderValue` may hold; this one is ASCII, so valid UTF-8 too (what the
        // function asks for).
        Ok(unsafe { HeaderValue::from_maybe_shared_unchecked(value) })
    } else {
        HeaderValue::from_maybe_shared(value)
    }
}

/// What a connection keeps from one response head to the next: the field names of
/// the last (`Names`), room for where the fields are, and an emptied header map
/// (the request's, `Conn::keep_map`) to fill with the next.
#[derive(Default)]
pub(crate) struct Kept {
    names: Names,
    spans: Vec<[usize; 4]>,
    /// The names of the head being read, in order.
    fields: Vec<HeaderName>,
    map: Option<HeaderMap>,
    /// The chunk extension bytes of the body being read (`decode::EXTENSIONS_LIMIT`).
    pub(crate) extensions: u64,
    /// Room for the request heads written on the connection
    /// (`Conn::request_head`): a head is done with before the next is written, so
    /// one allocation most often serves them all.
    head: BytesMut,
}

/// At most this many fields go to the client as they came (`RawFields`); a head
/// with more is put in a map.
const RAW_MAX_FIELDS: usize = 16;
// (`parse_one_head` marks them in a `u32`.)
const _: () = assert!(RAW_MAX_FIELDS <= 32);

/// An upstream answer's fields as they came, for the plain-request server
/// (`h1::server`) to write without a header map in between: each on a line of its own
/// as `name: value`, no name twice, none hop-by-hop, none the server writes in its
/// own way (`Connection`, `Transfer-Encoding`, `Trailer`, the rate-limit fields), one
/// `Content-Length` over 0; names lowercased. Written so, they are what the server
/// writes from a map holding them (the map's order is theirs: no name repeats).
#[derive(Debug)]
pub(crate) struct RawFields {
    /// The field lines, `\r\n` after each.
    pub(crate) lines: Bytes,
    /// Its `Content-Length`.
    pub(crate) length: u64,
    /// It has a `Date`.
    pub(crate) date: bool,
}

impl RawFields {
    /// The fields into `map`, after those it has, as a map from the head holds them.
    pub(crate) fn put_in(&self, map: &mut HeaderMap) {
        for line in self.lines.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|&b| b == b':') else {
                continue;
            };
            let value = &line[colon + 2..];
            let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&line[..colon]),
                parsed_value(self.lines.slice_ref(value)),
            ) else {
                continue;
            };
            map.append(name, value);
        }
    }
}

/// The field names of the last head read on a connection, as sent and parsed: a
/// peer sends the same ones, in the same order, head after head, and a name sent
/// as before is not parsed (nor sorted, `Traits`) again. (The first `NAMES_KEPT`
/// of them, up to `NAMES_BYTES` in all.)
#[derive(Default)]
pub(crate) struct Names {
    raw: Vec<u8>,
    at: Vec<(usize, usize)>,
    /// Each name, and what the upstream codec does with a field of that name.
    parsed: Vec<(HeaderName, Traits)>,
}

const NAMES_KEPT: usize = 32;
const NAMES_BYTES: usize = 1024;

/// Which of the fields framing and the answer's head depend on a name is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Connection,
    ContentLength,
    TransferEncoding,
    Date,
    Other,
}

/// What the upstream codec does with a field, known from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Traits {
    role: Role,
    /// Hop-by-hop (`fields::HOP_BY_HOP`).
    hop: bool,
    /// May go to the client as it came (`RawFields`): not hop-by-hop, not
    /// `Trailer`, not a rate-limit field (the server writes those its own way).
    as_is: bool,
    /// Sent in lower case already (as `RawFields` writes it).
    lower: bool,
    /// The same name as one before it in the head, when known (kept names: the
    /// names before a kept one are the ones kept before it).
    repeats: Option<bool>,
}

impl Traits {
    fn of(name: &HeaderName, raw: &[u8]) -> Traits {
        let role = match *name {
            header::CONNECTION => Role::Connection,
            header::CONTENT_LENGTH => Role::ContentLength,
            header::TRANSFER_ENCODING => Role::TransferEncoding,
            header::DATE => Role::Date,
            _ => Role::Other,
        };
        let hop = crate::http::fields::HOP_BY_HOP.contains(name);
        Traits {
            role,
            hop,
            as_is: !hop && *name != header::TRAILER && !crate::http::fields::is_rate_field(name),
            lower: !raw.iter().any(u8::is_ascii_uppercase),
            repeats: None,
        }
    }
}

impl Names {
    /// The `i`th field name of a head, sent as `raw` (the names before it were
    /// asked for first).
    pub(crate) fn name(
        &mut self,
        i: usize,
        raw: &[u8],
    ) -> Result<HeaderName, header::InvalidHeaderName> {
        self.name_traits(i, raw).map(|(name, _)| name)
    }

    /// `name`, and what a field of that name is to the upstream codec.
    fn name_traits(
        &mut self,
        i: usize,
        raw: &[u8],
    ) -> Result<(HeaderName, Traits), header::InvalidHeaderName> {
        if let Some(&(a, b)) = self.at.get(i) {
            if self.raw[a..b] == *raw {
                return Ok(self.parsed[i].clone());
            }
            // Another name here: the ones from here on are this head's.
            self.raw.truncate(a);
            self.at.truncate(i);
            self.parsed.truncate(i);
        }
        let name = HeaderName::from_bytes(raw)?;
        let mut traits = Traits::of(&name, raw);
        if i == self.at.len() && i < NAMES_KEPT && self.raw.len() + raw.len() <= NAMES_BYTES {
            // The names before it are this head's: those kept are all there is.
            traits.repeats = Some(self.parsed.iter().any(|(n, _)| *n == name));
            let a = self.raw.len();
            self.raw.extend_from_slice(raw);
            self.at.push((a, self.raw.len()));
            self.parsed.push((name.clone(), traits));
        }
        Ok((name, traits))
    }
}

impl Conn {
    /// A new connection to `connector`'s target, to speak HTTP/1.1 on.
    pub async fn open(connector: &Connector) -> Result<Conn, BoxError> {
        Ok(Conn::new(connector.connect().await?))
    }

    /// An HTTP/1.1 connection on `link`, holding its slot until it closes.
    pub fn new(Link { io, slot }: Link) -> Conn {
        Conn {
            io,
            buf: BytesMut::with_capacity(READ_SIZE / 2),
            _slot: slot,
            kept: Box::default(),
            home: 0,
            reading: Reading::default(),
        }
    }

    /// The worker thread the pool marked it with: the one that opened it, whose
    /// reactor its socket is registered with (it wakes a task on another thread
    /// only through that one).
    pub fn home(&self) -> usize {
        self.home
    }

    pub fn set_home(&mut self, worker: usize) {
        self.home = worker;
    }

    /// Whether a kept connection can take a request: nothing arrived on it while it
    /// sat idle. An end of stream is the upstream closing it; bytes are something no
    /// request asked for. Costs no syscall unless the socket was reported readable.
    /// Outside the task's tokio budget: with the budget spent, every readiness poll
    /// is `Pending`, and a closed connection, or one with bytes waiting, looked fine.
    pub fn is_usable(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let check = std::future::poll_fn(|cx| {
            if self.io.tcp().poll_read_ready(cx).is_pending() {
                return Poll::Ready(true);
            }
            // Readable, or was: a read tells which (`WouldBlock` clears the mark).
            Poll::Ready(self.poll_fill(cx).is_pending())
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        // (Always ready; were it not, the connection is not trusted.)
        matches!(
            std::pin::pin!(tokio::task::unconstrained(check)).poll(&mut cx),
            Poll::Ready(true)
        )
    }

    /// The head of a request to send on this connection (`write_request_head`),
    /// written into the connection's own room for heads.
    pub fn request_head(
        &mut self,
        method: &Method,
        uri: &http::Uri,
        headers: &HeaderMap,
        fwd: &Forwarded<'_>,
    ) -> Bytes {
        write_request_head(method, uri, headers, fwd, &mut self.kept.head)
    }

    /// The map of a request sent on this connection, emptied: its answer's fields
    /// go in it.
    pub fn keep_map(&mut self, mut map: HeaderMap) {
        map.clear();
        self.kept.map = Some(map);
    }

    /// Whether bytes the upstream sent are waiting unread.
    pub fn has_unread(&self) -> bool {
        !self.buf.is_empty()
    }

    /// Reads what the socket has into the buffer: `Ok(0)` is its end.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < READ_SIZE / 8 {
            self.buf.reserve(READ_SIZE);
        }
        let read = tokio::io::AsyncReadExt::read_buf(&mut self.io, &mut self.buf);
        std::pin::pin!(read).poll(cx)
    }
}

impl Source for Conn {
    fn unread(&mut self) -> (&mut BytesMut, &mut u64) {
        (&mut self.buf, &mut self.kept.extensions)
    }

    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        Conn::poll_fill(self, cx)
    }
}

/// An upgraded (101) connection reads what came after the response head first.
impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.buf.is_empty() {
            let n = this.buf.len().min(buf.remaining());
            buf.put_slice(&this.buf.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

// === the request ===

/// How a request body goes up to the upstream on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UploadFraming {
    /// No body is sent.
    Empty,
    Length(u64),
    Chunked,
}

/// `X-Forwarded-*` fields a request gets that its map does not have: written after
/// the map's fields, as if appended to it in this order, with no map insert (see
/// `upstream::set_forwarded`).
#[derive(Default, Clone, Copy)]
pub struct Forwarded<'a> {
    pub for_: Option<&'a HeaderValue>,
    pub proto: Option<&'static str>,
    pub host: Option<&'a HeaderValue>,
}

impl Forwarded<'_> {
    fn is_empty(&self) -> bool {
        self.for_.is_none() && self.proto.is_none() && self.host.is_none()
    }

    /// Into the map after all: something is appended after them.
    pub fn put_in_map(&mut self, h: &mut HeaderMap) {
        if let Some(v) = self.for_.take() {
            h.insert(XFF.clone(), v.clone());
        }
        if let Some(p) = self.proto.take() {
            h.insert(XFP.clone(), HeaderValue::from_static(p));
        }
        if let Some(v) = self.host.take() {
            h.insert(XFH.clone(), v.clone());
        }
    }

    fn len(&self) -> usize {
        let line = |name: &HeaderName, v: Option<&[u8]>| {
            v.map_or(0, |v| name.as_str().len() + v.len() + 4)
        };
        line(&XFF, self.for_.map(HeaderValue::as_bytes))
            + line(&XFP, self.proto.map(str::as_bytes))
            + line(&XFH, self.host.map(HeaderValue::as_bytes))
    }

    fn write(&self, out: &mut BytesMut) {
        let mut line = |name: &HeaderName, v: Option<&[u8]>| {
            if let Some(v) = v {
                out.extend_from_slice(name.as_str().as_bytes());
                out.extend_from_slice(b": ");
                out.extend_from_slice(v);
                out.extend_from_slice(b"\r\n");
            }
        };
        line(&XFF, self.for_.map(HeaderValue::as_bytes));
        line(&XFP, self.proto.map(str::as_bytes));
        line(&XFH, self.host.map(HeaderValue::as_bytes));
    }
}

pub(crate) static XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
pub(crate) static XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
pub(crate) static XFH: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The request head on the wire (origin-form target, fields as they are), and how
/// its body follows (`upload_framing`, then `write_request_head`, into a buffer
/// of its own).
pub fn request_head(
    parts: &mut http::request::Parts,
    body: &Body,
    mut fwd: Forwarded<'_>,
) -> (Bytes, UploadFraming) {
    let framing = upload_framing(parts, body, &mut fwd);
    let head = write_request_head(
        &parts.method,
        &parts.uri,
        &parts.headers,
        &fwd,
        &mut BytesMut::new(),
    );
    (head, framing)
}

/// How a request's body follows its head, the fields it needs for that put in
/// the map (with `fwd`'s before them, to keep the order). As hyper's client: a
/// body that is already over is not sent (any `Content-Length` the request has
/// stays as it is); a `Content-Length` the request has, or a length the body
/// knows, delimits it; an unknown length is chunked, except on GET, HEAD and
/// CONNECT, which then send none.
pub fn upload_framing(
    parts: &mut http::request::Parts,
    body: &Body,
    fwd: &mut Forwarded<'_>,
) -> UploadFraming {
    if body.is_end_stream() {
        UploadFraming::Empty
    } else if let Some(n) = content_length(&parts.headers) {
        UploadFraming::Length(n)
    } else if let Some(n) = body.size_hint().exact() {
        fwd.put_in_map(&mut parts.headers);
        parts
            .headers
            .insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        UploadFraming::Length(n)
    } else if matches!(parts.method, Method::GET | Method::HEAD | Method::CONNECT) {
        UploadFraming::Empty
    } else {
        fwd.put_in_map(&mut parts.headers);
        parts.headers.remove(header::CONTENT_LENGTH);
        parts.headers.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        UploadFraming::Chunked
    }
}

/// The most room for request heads a connection keeps between requests.
const KEPT_HEAD_ROOM: usize = 16 * 1024;

/// The request head on the wire: origin-form target, the map's fields as they
/// are, then `fwd`'s. Written into `buf`, which keeps its room for the next head
/// once this one is dropped (a connection's own: `Conn::request_head`).
pub fn write_request_head(
    method: &Method,
    uri: &http::Uri,
    headers: &HeaderMap,
    fwd: &Forwarded<'_>,
    buf: &mut BytesMut,
) -> Bytes {
    let target = uri.path_and_query().map_or("/", |p| p.as_str());
    let fields: usize = headers
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len() + 4)
        .sum();
    let fields = fields + if fwd.is_empty() { 0 } else { fwd.len() };
    buf.clear();
    buf.reserve(method.as_str().len() + target.len() + fields + 14);
    buf.extend_from_slice(method.as_str().as_bytes());
    buf.extend_from_slice(b" ");
    buf.extend_from_slice(target.as_bytes());
    buf.extend_from_slice(b" HTTP/1.1\r\n");
    write_fields(buf, headers);
    if !fwd.is_empty() {
        fwd.write(buf);
    }
    buf.extend_from_slice(b"\r\n");
    let head = buf.split().freeze();
    // The room a rare large head needed goes with it, not kept for the
    // connection's life.
    if head.len() > KEPT_HEAD_ROOM {
        *buf = BytesMut::new();
    }
    head
}

fn write_fields(out: &mut BytesMut, h: &HeaderMap) {
    for (k, v) in h {
        out.extend_from_slice(k.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(v.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
}

/// Writes the head, then the body in its framing; ends flushed.
pub struct Upload {
    /// What to write before the next frame: `pending[at..]` (the head stays whole
    /// as it is written, for `Failed::head`).
    pending: Bytes,
    at: usize,
    body: Option<Body>,
    framing: UploadFraming,
    sent: u64,
    /// Bytes written so far (head and framing too): whether the upload moved.
    written: u64,
    /// The trailer fields the request announced (`announced_trailers`).
    trailers: Vec<HeaderName>,
}

/// How an upload failed: the client's body (its error, to classify), or the
/// upstream connection (perhaps it answered and closed: its answer is still read).
pub enum UploadError {
    Body(BoxError),
    Write(io::Error),
}

impl Upload {
    /// Bytes written so far: the upload moved if this grew.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Writes what is pending, then the body frame by frame; ready once all of it
    /// (its last chunk too) has gone out. Also polled while the response is read (a
    /// full-duplex exchange: the upstream answered before the body was all sent).
    pub fn poll_send(
        &mut self,
        conn: &mut Conn,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), UploadError>> {
        let io = &mut conn.io;
        loop {
            while self.at < self.pending.len() {
                let n = ready!(Pin::new(&mut *io).poll_write(cx, &self.pending[self.at..]))
                    .map_err(UploadError::Write)?;
                if n == 0 {
                    return Poll::Ready(Err(UploadError::Write(io::ErrorKind::WriteZero.into())));
                }
                self.at += n;
                self.written += n as u64;
            }
            // What is written goes out before the next frame is waited for (as
            // hyper's client): TLS keeps what the socket did not take, and a client
            // that waits for the answer before sending more would wait for ever.
            // (A no-op on plain TCP.)
            ready!(Pin::new(&mut *io).poll_flush(cx)).map_err(UploadError::Write)?;
            // No body left: everything, its last chunk too, has been written.
            let Some(body) = self.body.as_mut() else {
                return Poll::Ready(Ok(()));
            };
            match ready!(Pin::new(body).poll_frame(cx)) {
                None => {
                    self.body = None;
                    match self.framing {
                        UploadFraming::Chunked => {
                            self.pending = Bytes::from_static(b"0\r\n\r\n");
                            self.at = 0;
                        }
                        UploadFraming::Length(n) if n != self.sent => {
                            return Poll::Ready(Err(UploadError::Body(
                                WireError::BodyLength.into(),
                            )))
                        }
                        _ => {}
                    }
                }
                Some(Err(e)) => return Poll::Ready(Err(UploadError::Body(e))),
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) if data.is_empty() => {}
                    Ok(data) => {
                        self.sent += data.len() as u64;
                        self.at = 0;
                        self.pending = match self.framing {
                            UploadFraming::Chunked => {
                                let mut c = BytesMut::with_capacity(data.len() + 20);
                                let _ = write!(c, "{:x}\r\n", data.len());
                                c.extend_from_slice(&data);
                                c.extend_from_slice(b"\r\n");
                                c.freeze()
                            }
                            UploadFraming::Length(n) if self.sent > n => {
                                return Poll::Ready(Err(UploadError::Body(
                                    WireError::BodyLength.into(),
                                )))
                            }
                            _ => data,
                        };
                    }
                    Err(frame) => {
                        // Trailers: after the last chunk; a length-delimited body
                        // cannot carry them (hyper drops them too). As hyper's
                        // client: only those `Trailer` announced (none with `_`),
                        // and none that must not be a trailer.
                        if let (Ok(mut trailers), UploadFraming::Chunked) =
                            (frame.into_trailers(), self.framing)
                        {
                            let names: Vec<HeaderName> = trailers.keys().cloned().collect();
                            for name in names {
                                if !self.trailers.contains(&name) || !may_trail(&name) {
                                    trailers.remove(&name);
                                }
                            }
                            let mut c = BytesMut::from(&b"0\r\n"[..]);
                            write_fields(&mut c, &trailers);
                            c.extend_from_slice(b"\r\n");
                            self.pending = c.freeze();
                            self.at = 0;
                            self.body = None;
                        }
                    }
                },
            }
        }
    }
}

// === the response ===

/// A response head, and how its body is to be read.
pub struct Head {
    pub parts: http::response::Parts,
    pub body: Decoder,
    /// The connection may carry another request once this body has been read (and
    /// `upload` has ended): HTTP/1.1 without `Connection: close` (HTTP/1.0 with
    /// `keep-alive`), a body with a delimited end, no failed write.
    pub reusable: bool,
    /// The rest of the request body, when the answer came before it was all sent:
    /// it goes on while the response body is read, as hyper's client does.
    /// (Boxed: rare, and it would make every head larger, copied as it goes up.)
    pub upload: Option<Box<Upload>>,
    /// The fields have a hop-by-hop one (`upstream::strip_hop_by_hop` has work).
    pub hop_by_hop: bool,
    /// The fields as they came, instead of in `parts` (asked for with `raw_ok`).
    pub(crate) raw: Option<RawFields>,
}

/// Why an exchange failed, and whether the upstream sent anything back.
pub struct Failed {
    pub error: BoxError,
    /// No byte of an answer arrived: on a kept connection, a request that is safe
    /// to repeat may go on another.
    pub nothing_back: bool,
    /// Then the head of a request without a body, whole, to send again.
    pub head: Option<Bytes>,
}

/// Sends a request (its head as `request_head` made it) and reads the response
/// head, skipping informational (1xx) answers other than 101. An answer that comes
/// before the request body is all sent takes the rest of the upload with it.
pub async fn exchange(
    conn: &mut Conn,
    head: Bytes,
    body: Body,
    framing: UploadFraming,
    trailers: Vec<HeaderName>,
    method: &Method,
    raw_ok: bool,
) -> Result<Head, Failed> {
    let mut upload = Some(Upload {
        pending: head,
        at: 0,
        body: (framing != UploadFraming::Empty).then_some(body),
        framing,
        sent: 0,
        written: 0,
        trailers,
    });
    // The upload is kept once over (its head may be sent again): whether it goes on.
    let mut sending = true;
    let mut write_failed = None;
    let mut received = false;
    // Nothing came back: the head of a request without a body, to send again.
    let again = |upload: &mut Option<Upload>, received: bool| {
        let up = upload
            .take()
            .filter(|_| !received && framing == UploadFraming::Empty);
        up.map(|up| up.pending)
    };
    std::future::poll_fn(|cx| {
        if let (true, Some(up)) = (sending, upload.as_mut()) {
            match up.poll_send(conn, cx) {
                Poll::Pending => {}
                Poll::Ready(Ok(())) => sending = false,
                Poll::Ready(Err(UploadError::Body(e))) => {
                    return Poll::Ready(Err(Failed {
                        error: e,
                        nothing_back: false,
                        head: None,
                    }))
                }
                // The upstream may have answered before it closed: read on.
                Poll::Ready(Err(UploadError::Write(e))) => {
                    sending = false;
                    write_failed = Some(e);
                }
            }
        }
        loop {
            if !conn.buf.is_empty() {
                received = true;
                match parse_head_for(&mut conn.buf, method, &mut conn.kept, raw_ok) {
                    Err(e) => {
                        return Poll::Ready(Err(Failed {
                            error: e.into(),
                            nothing_back: false,
                            head: None,
                        }))
                    }
                    Ok(Some(mut head)) => {
                        if write_failed.is_some() {
                            head.reusable = false;
                        }
                        if sending && head.parts.status != StatusCode::SWITCHING_PROTOCOLS {
                            head.upload = upload.take().map(Box::new);
                        }
                        return Poll::Ready(Ok(head));
                    }
                    // More bytes are needed.
                    Ok(None) => {}
                }
            }
            match conn.poll_fill(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(0)) => {
                    let error: BoxError = match write_failed.take() {
                        Some(e) => e.into(),
                        None if conn.buf.is_empty() => WireError::ClosedBeforeAnswer.into(),
                        None => WireError::Malformed("incomplete response head").into(),
                    };
                    return Poll::Ready(Err(Failed {
                        error,
                        nothing_back: !received,
                        head: again(&mut upload, received),
                    }));
                }
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => {
                    return Poll::Ready(Err(Failed {
                        error: e.into(),
                        nothing_back: !received,
                        head: again(&mut upload, received),
                    }))
                }
            }
        }
    })
    .await
}

/// The final (not informational) head at the front of `buf`, taken out of it with
/// the informational (1xx) heads before it: `Ok(None)` when more bytes are needed
/// (a partial head is left where it is).
#[cfg(test)]
fn parse_head(
    buf: &mut BytesMut,
    method: &Method,
    kept: &mut Kept,
) -> Result<Option<Head>, WireError> {
    parse_head_for(buf, method, kept, false)
}

/// The answer's head, its fields `RawFields` when `raw_ok` and they can be.
pub(crate) fn parse_head_for(
    buf: &mut BytesMut,
    method: &Method,
    kept: &mut Kept,
    raw_ok: bool,
) -> Result<Option<Head>, WireError> {
    loop {
        if buf.is_empty() {
            return Ok(None);
        }
        let before = buf.len();
        if let Some(head) = parse_one_head(buf, method, kept, raw_ok)? {
            return Ok(Some(head));
        }
        // Partial: nothing was taken. Otherwise an informational head was.
        if buf.len() == before {
            return Ok(None);
        }
    }
}

/// One head at the front of `buf`, taken out of it unless partial: `Ok(None)` for
/// an informational answer, or a partial head (left where it is).
fn parse_one_head(
    buf: &mut BytesMut,
    method: &Method,
    kept: &mut Kept,
    raw_ok: bool,
) -> Result<Option<Head>, WireError> {
    // Where each name and value is in the head, to share its bytes.
    let spans = &mut kept.spans;
    let ResponseHead {
        len,
        minor,
        code,
        reason,
    } = match head::response(buf, spans) {
        Ok(Some(head)) => head,
        Ok(None) if buf.len() > MAX_HEAD => return Err(WireError::HeadTooLarge),
        Ok(None) => return Ok(None),
        Err(HeadError::TooManyFields) => return Err(WireError::Malformed("too many fields")),
        Err(HeadError::Malformed) => return Err(WireError::Malformed("invalid response head")),
    };
    if len > MAX_HEAD {
        return Err(WireError::HeadTooLarge);
    }
    let status = StatusCode::from_u16(code).map_err(|_| WireError::Malformed("status"))?;
    let version = if minor == 1 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let reason = &buf[reason];
    let reason = (Some(reason) != status.canonical_reason().map(str::as_bytes))
        .then(|| Bytes::copy_from_slice(reason));
    let mut head = buf.split_to(len);
    if (100..200).contains(&code) && code != 101 {
        return Ok(None);
    }

    let mut connection = Connection::default();
    let mut hop_by_hop = false;
    // What framing needs, gathered on the way (no lookups in the map after).
    let mut seen = FramingFields::default();
    let last = spans.len().wrapping_sub(1);
    // The last field, when it is a `Connection` naming no field: all the forwarding
    // does with it is take it out again (the last: nothing moves into its place), so
    // it is not kept.
    let mut dropped = None;
    // Whether the fields can go to the client as they came (`RawFields`).
    let mut raw = raw_ok
        && code != 101
        && version == Version::HTTP_11
        && *method != Method::HEAD
        && (1..=RAW_MAX_FIELDS).contains(&spans.len());
    let mut date = false;
    // The names (by their place) not sent in lower case.
    let mut upper = 0u32;
    let names = &mut kept.fields;
    names.clear();
    for (i, &[n0, n1, v0, v1]) in spans.iter().enumerate() {
        let (name, traits) = kept
            .names
            .name_traits(i, &head[n0..n1])
            .map_err(|_| WireError::Malformed("field name"))?;
        let value = &head[v0..v1];
        match traits.role {
            Role::Connection => {
                let others = connection.add_items(value);
                if i == last && !others && code != 101 && !seen.connection {
                    dropped = Some(i);
                    names.push(name);
                    continue;
                }
                seen.connection = true;
                raw = false;
            }
            Role::ContentLength => seen.length.add(value),
            Role::TransferEncoding => {
                seen.transfer_encoding = true;
                seen.codings.add(value);
            }
            Role::Date => date = true,
            Role::Other => {}
        }
        hop_by_hop |= traits.hop;
        if raw {
            // Written as one line each, as a map would give them: no name twice, none
            // the server writes its own way; and sent as `name: value` lines already.
            let next = spans.get(i + 1).map_or(v1 + 2, |n| n[0]);
            if !traits.lower {
                upper |= 1 << i;
            }
            raw = traits.as_is
                && !traits.repeats.unwrap_or_else(|| names.contains(&name))
                && v0 == n1 + 2
                && head[n1..v0] == *b": "
                && v1 > v0
                && next == v1 + 2
                && head.get(v1..next) == Some(b"\r\n");
        }
        names.push(name);
    }
    let raw = match seen.length {
        Length::One(length) if raw && length > 0 && !seen.transfer_encoding => {
            let end = dropped.map_or(last, |d| d - 1);
            for (i, &[n0, n1, _, _]) in spans[..=end].iter().enumerate() {
                if upper & (1 << i) != 0 {
                    head[n0..n1].make_ascii_lowercase();
                }
            }
            Some((length, spans[0][0]..spans[end][3] + 2))
        }
        _ => None,
    };
    let head = head.freeze();
    let raw = raw.map(|(length, lines)| RawFields {
        lines: head.slice(lines),
        length,
        date,
    });
    let headers = match raw {
        // (The kept map, empty, goes on with the answer to be used again.)
        Some(_) => kept.map.take().unwrap_or_default(),
        None => {
            let mut headers = kept.map.take().unwrap_or_default();
            headers.reserve(spans.len());
            for (i, (name, &[_, _, v0, v1])) in names.drain(..).zip(spans.iter()).enumerate() {
                if Some(i) == dropped {
                    continue;
                }
                let value = parsed_value(head.slice(v0..v1))
                    .map_err(|_| WireError::Malformed("field value"))?;
                headers.append(name, value);
            }
            headers
        }
    };
    let mut resp = http::Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    if let Some(reason) = reason {
        if let Ok(r) = hyper::ext::ReasonPhrase::try_from(reason) {
            resp.extensions_mut().insert(r);
        }
    }
    let (mut parts, ()) = resp.into_parts();
    refuse_framing(&seen)?;
    let body = match decoder(&seen, status, version, method)? {
        // The first chunks mostly come with the head: malformed framing in them
        // makes the answer a 502 now, while nothing has gone to the client. (What
        // comes later cuts the body: the head has gone by then.)
        Decoder::Chunked(Chunk::Size) => {
            check_buffered_chunks(buf)?;
            kept.extensions = 0;
            let first = super::decode::chunk_size(buf, &mut kept.extensions)?;
            Decoder::Chunked(first.unwrap_or(Chunk::Size))
        }
        body => body,
    };
    parts.headers = headers;
    let reusable = connection.persists(version == Version::HTTP_11)
        && !matches!(body, Decoder::Eof)
        && code != 101;
    Ok(Some(Head {
        parts,
        body,
        reusable,
        upload: None,
        hop_by_hop,
        raw,
    }))
}

/// Framing that cannot be passed on faithfully is refused, whatever the status
/// (as nginx refuses it, with a 502): `Transfer-Encoding` beside `Content-Length`
/// (RFC 9112 §6.3 calls it a likely attempt at smuggling, and the connection
/// cannot be trusted after it), and any transfer coding but one `chunked` (a
/// `gzip` under it would reach the client decoded of its chunks only, with
/// nothing saying it is gzip; a last coding other than `chunked` would make the
/// body run to the close, RFC 9112 §6.3, which no upstream means).
fn refuse_framing(seen: &FramingFields) -> Result<(), WireError> {
    if !seen.transfer_encoding {
        return Ok(());
    }
    if seen.length != Length::None {
        return Err(WireError::Malformed(
            "both Content-Length and Transfer-Encoding",
        ));
    }
    if seen.codings != Codings::Chunked {
        return Err(WireError::Malformed(
            "a transfer coding other than one chunked",
        ));
    }
    Ok(())
}

/// How the body of a response is delimited (RFC 9112 §6.3, as hyper's client;
/// `refuse_framing` has let only a lone `chunked` coding through).
fn decoder(
    seen: &FramingFields,
    status: StatusCode,
    version: Version,
    method: &Method,
) -> Result<Decoder, WireError> {
    // RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing,
    // whether or not it has a body (what the upstream meant to follow it is unknown).
    if seen.transfer_encoding && version == Version::HTTP_10 {
        return Err(WireError::Malformed("Transfer-Encoding in HTTP/1.0"));
    }
    if matches!(status.as_u16(), 101 | 204 | 304) || method == Method::HEAD {
        return Ok(Decoder::Done);
    }
    if seen.transfer_encoding {
        return Ok(Decoder::Chunked(Chunk::Size));
    }
    match seen.length {
        Length::One(0) => Ok(Decoder::Done),
        Length::One(n) => Ok(Decoder::Length(n)),
        Length::Invalid => Err(WireError::Malformed("invalid Content-Length")),
        Length::None => Ok(Decoder::Eof),
    }
}

/// The fields of a response head that its framing depends on, as they were put in
/// its map.
#[derive(Default)]
struct FramingFields {
    connection: bool,
    transfer_encoding: bool,
    codings: Codings,
    length: Length,
}

/// The transfer codings of a head so far, over all its `Transfer-Encoding` lines.
#[derive(Default, Debug, PartialEq)]
enum Codings {
    #[default]
    None,
    /// One coding, `chunked`.
    Chunked,
    /// Another coding, or more than one.
    Other,
}

impl Codings {
    fn add(&mut self, value: &[u8]) {
        // Empty list items are nothing (RFC 9110 §5.6.1).
        for coding in items(value) {
            if coding.is_empty() {
                continue;
            }
            *self = match self {
                Codings::None if coding.eq_ignore_ascii_case(b"chunked") => Codings::Chunked,
                _ => Codings::Other,
            };
        }
    }
}

/// The next frame of a response body, read from its connection.
impl Decoder {
    pub fn poll_frame(
        &mut self,
        conn: &mut Conn,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.poll_frame_from(conn, cx)
    }

    /// The next frame of the body from `src`, whatever it reads from.
    pub(crate) fn poll_frame_from<S: Source>(
        &mut self,
        src: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.poll_from(src, cx).map(|frame| {
            frame.map(|f| {
                f.map_err(|e| match e {
                    DecodeError::Framing(e) => WireError::from(e).into(),
                    DecodeError::Incomplete => WireError::IncompleteBody.into(),
                    DecodeError::Io(e) => e.into(),
                })
            })
        })
    }
}

/// A chunk-size line alone, its extensions counted from none.
#[cfg(test)]
fn chunk_size(buf: &mut BytesMut) -> Result<Option<Chunk>, FramingError> {
    super::decode::chunk_size(buf, &mut 0)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::net::TcpStream;
    use tokio::sync::Semaphore;

    use super::super::framing::{trailers, MAX_CHUNK_LINE};
    use super::*;

    /// Which answers keep their fields as they came (`RawFields`), and what those
    /// are; the rest go into the map. (Written to the client, both are the same:
    /// tests/http/transparency.rs.)
    #[test]
    fn fields_as_they_came_where_a_map_would_give_them_so() {
        let raw = |head: &str, method: Method| {
            let head = parse_head_for(
                &mut BytesMut::from(head.as_bytes()),
                &method,
                &mut Kept::default(),
                true,
            )
            .expect("a head")
            .expect("whole");
            head.raw.map(|r| {
                assert!(head.parts.headers.is_empty());
                (
                    String::from_utf8(r.lines.to_vec()).unwrap(),
                    r.length,
                    r.date,
                )
            })
        };
        assert_eq!(
            raw(
                "HTTP/1.1 200 OK\r\nServer: nginx\r\nDate: Sun, 22 Nov 2026 10:00:00 GMT\r\nContent-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n",
                Method::GET
            ),
            Some((
                "server: nginx\r\ndate: Sun, 22 Nov 2026 10:00:00 GMT\r\ncontent-length: 3\r\n".to_owned(),
                3,
                true
            ))
        );
        assert_eq!(
            raw(
                "HTTP/1.1 404 Not Found\r\nContent-Length: 12\r\nX-A: b\r\n\r\n",
                Method::POST
            ),
            Some(("content-length: 12\r\nx-a: b\r\n".to_owned(), 12, false))
        );
        for head in [
            // A map's order or way of writing differs, or the server writes them itself.
            "HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\nA: 3\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA:1\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA:  1\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA: 1 \r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nA:\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n",
            "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nKeep-Alive: timeout=5\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTrailer: x\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nX-RateLimit-Remaining: 1\r\nContent-Length: 3\r\n\r\n",
            "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n",
            "HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
            "HTTP/1.1 200 OK\r\nServer: s\r\n\r\n",
            "HTTP/1.1 204 No Content\r\nServer: s\r\n\r\n",
            "HTTP/1.0 200 OK\r\nContent-Length: 3\r\n\r\n",
        ] {
            assert_eq!(raw(head, Method::GET), None, "{head}");
        }
        let head = "HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n";
        assert_eq!(raw(head, Method::HEAD), None);
        let many: String = (0..RAW_MAX_FIELDS)
            .map(|i| format!("X-{i}: v\r\n"))
            .collect();
        assert_eq!(
            raw(
                &format!("HTTP/1.1 200 OK\r\n{many}Content-Length: 3\r\n\r\n"),
                Method::GET
            ),
            None
        );
    }

    /// The fields as they came, put into a map after what it holds, are what the map
    /// would have held from the head (names lowercased, values as they were).
    #[test]
    fn fields_as_they_came_go_into_a_map_as_from_the_head() {
        let head =
            b"HTTP/1.1 200 OK\r\nServer: nginx\r\nX-Odd: a:b \x80\r\nContent-Length: 3\r\n\r\n";
        let parse = |raw_ok| {
            parse_head_for(
                &mut BytesMut::from(&head[..]),
                &Method::GET,
                &mut Kept::default(),
                raw_ok,
            )
            .unwrap()
            .unwrap()
        };
        let from_map = parse(false).parts.headers;
        let raw = parse(true).raw.expect("as they came");
        let mut map = HeaderMap::new();
        map.insert("x-first", HeaderValue::from_static("1"));
        raw.put_in(&mut map);
        let got: Vec<_> = map.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut expected = vec![(
            HeaderName::from_static("x-first"),
            HeaderValue::from_static("1"),
        )];
        expected.extend(from_map.iter().map(|(k, v)| (k.clone(), v.clone())));
        assert_eq!(got, expected);
        assert_eq!(expected.len(), 4);
    }

    /// `Length`, fed the values as they come, and `content_length` over the map
    /// holding them, read them as the rule says (every item of every value is
    /// digits, at most 19, and all are the same number): for every sequence of up
    /// to three values from a set of edge cases.
    #[test]
    fn lengths_are_read_as_the_rule_says() {
        let values = [
            "0",
            "5",
            "05",
            " 5 ",
            "5,5",
            "5, 5",
            "5,6",
            "5,",
            ",",
            "",
            "a",
            "-1",
            "+5",
            "18446744073709551615",
            "1844674407370955161",
            "1234567890123456789",
        ];
        let mut seqs: Vec<Vec<&str>> = vec![vec![]];
        for _ in 0..3 {
            let longer: Vec<Vec<&str>> = seqs
                .iter()
                .filter(|s| s.len() == seqs.last().unwrap().len())
                .flat_map(|s| {
                    values.iter().map(move |v| {
                        let mut t = s.clone();
                        t.push(*v);
                        t
                    })
                })
                .collect();
            seqs.extend(longer);
        }
        for seq in &seqs {
            let mut map = HeaderMap::new();
            let mut length = Length::default();
            for v in seq {
                map.append(header::CONTENT_LENGTH, HeaderValue::from_str(v).unwrap());
                length.add(v.as_bytes());
            }
            let numbers: Option<Vec<u64>> = seq
                .iter()
                .flat_map(|v| v.split(','))
                .map(|item| item.trim_matches(|c: char| c.is_ascii_whitespace()))
                .map(|item| {
                    let digits = !item.is_empty()
                        && item.len() <= 19
                        && item.bytes().all(|b| b.is_ascii_digit());
                    digits.then(|| item.parse().unwrap())
                })
                .collect();
            let expected = match numbers {
                _ if seq.is_empty() => Length::None,
                Some(ns) if ns.windows(2).all(|w| w[0] == w[1]) => Length::One(ns[0]),
                _ => Length::Invalid,
            };
            let in_map = match expected {
                Length::One(n) => Some(n),
                _ => None,
            };
            assert_eq!(content_length(&map), in_map, "{seq:?}");
            assert_eq!(length, expected, "{seq:?}");
        }
    }

    #[test]
    fn every_value_httparse_takes_is_a_valid_header_value() {
        for b in 0..=255u8 {
            let mut head = b"HTTP/1.1 200 OK\r\nx-v: a".to_vec();
            head.push(b);
            head.extend_from_slice(b"b\r\ncontent-length: 0\r\n\r\n");
            let got = parse_head(
                &mut BytesMut::from(&head[..]),
                &Method::GET,
                &mut Kept::default(),
            );
            let valid = HeaderValue::from_bytes(&[b'a', b, b'b']).is_ok();
            match got {
                Ok(Some(h)) => {
                    assert!(valid, "{b:#x}");
                    assert_eq!(h.parts.headers["x-v"].as_bytes(), [b'a', b, b'b']);
                }
                _ => assert!(!valid || b == b'\r' || b == b'\n', "{b:#x}"),
            }
        }
    }

    #[test]
    fn a_names_traits_are_what_the_codec_asked_of_it_each_time() {
        let traits = |raw: &str| {
            let name = HeaderName::from_bytes(raw.as_bytes()).unwrap();
            Traits::of(&name, raw.as_bytes())
        };
        let t = traits("Connection");
        assert_eq!(
            (t.role, t.hop, t.as_is, t.lower),
            (Role::Connection, true, false, false)
        );
        let t = traits("content-length");
        assert_eq!(
            (t.role, t.hop, t.as_is, t.lower),
            (Role::ContentLength, false, true, true)
        );
        let t = traits("Transfer-Encoding");
        assert_eq!(
            (t.role, t.hop, t.as_is),
            (Role::TransferEncoding, true, false)
        );
        assert_eq!(traits("DATE").role, Role::Date);
        for raw in [
            "Trailer",
            "RateLimit",
            "ratelimit-policy",
            "X-RateLimit-Reset",
            "Keep-Alive",
            "TE",
        ] {
            assert!(!traits(raw).as_is, "{raw}");
        }
        let t = traits("X-Custom");
        assert_eq!(
            (t.role, t.hop, t.as_is, t.lower),
            (Role::Other, false, true, false)
        );
        // Kept with the name: the same answer from the cache, and a name sent
        // otherwise in the same place is sorted again.
        let mut names = Names::default();
        let first = names.name_traits(0, b"Server").unwrap();
        assert_eq!(names.name_traits(0, b"Server").unwrap(), first);
        let other = names.name_traits(0, b"connection").unwrap();
        assert_eq!(other.1.role, Role::Connection);
        assert!(other.1.lower);
        // Whether a name repeats one before it, in a head read first and again.
        let heads: [&[&[u8]]; 3] = [
            &[b"Vary", b"X-A", b"vary"],
            &[b"Vary", b"X-A", b"vary"],
            &[b"Vary", b"X-B", b"vary"],
        ];
        for head in heads {
            let repeats: Vec<_> = (0..3)
                .map(|i| names.name_traits(i, head[i]).unwrap().1.repeats)
                .collect();
            assert_eq!(repeats, [Some(false), Some(false), Some(true)], "{head:?}");
        }
    }

    #[test]
    fn kept_names_are_what_parsing_gives() {
        let mut names = Names::default();
        let long = "x".repeat(600);
        let heads: [&[&str]; 6] = [
            &["Server", "Content-Type", "X-Custom", "content-length"],
            &["Server", "Content-Type", "X-Custom", "content-length"],
            &["server", "CONTENT-TYPE", "X-Other"],
            &[
                "server",
                "Content-Type",
                "x-other",
                "Date",
                "Bad Name",
                "date",
            ],
            &[&long, &long, "Set-Cookie", &long],
            &[&long, &long, "Set-Cookie", &long, "Server"],
        ];
        for head in heads {
            for (i, raw) in head.iter().enumerate() {
                let got = names.name(i, raw.as_bytes());
                let parsed = HeaderName::from_bytes(raw.as_bytes());
                assert_eq!(got.is_ok(), parsed.is_ok(), "{raw}");
                if let (Ok(got), Ok(parsed)) = (got, parsed) {
                    assert_eq!(got, parsed);
                }
            }
            assert!(names.raw.len() <= NAMES_BYTES && names.at.len() <= NAMES_KEPT);
        }
    }

    fn parse(bytes: &str, method: Method) -> Result<Option<Head>, WireError> {
        parse_head(&mut BytesMut::from(bytes), &method, &mut Kept::default())
    }

    #[test]
    fn response_bodies_are_delimited_as_rfc_9112_says() {
        let len = |s: &str, m: Method| format!("{:?}", parse(s, m).unwrap().unwrap().body);
        assert_eq!(
            len("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", Method::GET),
            "Length(5)"
        );
        assert_eq!(
            len("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", Method::HEAD),
            "Done"
        );
        assert_eq!(len("HTTP/1.1 204 No Content\r\n\r\n", Method::GET), "Done");
        assert_eq!(
            len(
                "HTTP/1.1 304 Not Modified\r\ncontent-length: 9\r\n\r\n",
                Method::GET
            ),
            "Done"
        );
        assert_eq!(
            len(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n",
                Method::GET
            ),
            "Chunked(Size)"
        );
        assert_eq!(len("HTTP/1.1 200 OK\r\n\r\n", Method::GET), "Eof");
        assert_eq!(
            len(
                "HTTP/1.1 200 OK\r\ncontent-length: 4, 4\r\n\r\n",
                Method::GET
            ),
            "Length(4)"
        );
        assert!(parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 4, 5\r\n\r\n",
            Method::GET
        )
        .is_err());
        assert!(parse("HTTP/1.1 200 OK\r\ncontent-length: +4\r\n\r\n", Method::GET).is_err());
        assert!(parse(
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            Method::GET
        )
        .is_err());
        // RFC 9112 §6.1: faulty framing, body or none.
        for (head, method) in [
            (
                "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
                Method::HEAD,
            ),
            (
                "HTTP/1.0 204 No Content\r\ntransfer-encoding: chunked\r\n\r\n",
                Method::GET,
            ),
            (
                "HTTP/1.0 304 Not Modified\r\ntransfer-encoding: chunked\r\n\r\n",
                Method::GET,
            ),
        ] {
            assert!(parse(head, method).is_err(), "{head:?}");
        }
    }

    /// Only one `chunked` coding, and never beside `Content-Length`, whatever the
    /// status or method (as nginx): anything else would be passed on as something
    /// it is not.
    #[test]
    fn framing_other_than_one_chunked_or_one_length_is_refused() {
        for te in ["chunked", " chunked ", "CHUNKED", "chunked,", ", chunked"] {
            let head = format!("HTTP/1.1 200 OK\r\ntransfer-encoding: {te}\r\n\r\n");
            assert!(parse(&head, Method::GET).is_ok(), "{te:?}");
        }
        let refused = |head: &str| {
            for method in [Method::GET, Method::HEAD] {
                assert!(
                    matches!(parse(head, method.clone()), Err(WireError::Malformed(_))),
                    "{head:?} {method}"
                );
            }
        };
        for te in [
            "gzip, chunked",
            "chunked, chunked",
            "chunked, gzip",
            "gzip",
            "identity",
            "",
            ",",
        ] {
            refused(&format!(
                "HTTP/1.1 200 OK\r\ntransfer-encoding: {te}\r\n\r\n"
            ));
        }
        refused(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntransfer-encoding: chunked\r\n\r\n",
        );
        refused("HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n");
        refused("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n");
        refused(
            "HTTP/1.1 304 Not Modified\r\ntransfer-encoding: chunked\r\ncontent-length: 3\r\n\r\n",
        );
    }

    /// The first chunk-size line, when it came with the head, is read with it: a
    /// malformed one fails the head (a 502, nothing sent yet); a whole one is
    /// taken; a partial one that can still become valid waits.
    #[test]
    fn a_first_chunk_size_line_that_came_with_the_head_is_checked_with_it() {
        let head = |first: &str| {
            let mut buf = BytesMut::from(
                format!("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n{first}").as_str(),
            );
            parse_head(&mut buf, &Method::GET, &mut Kept::default())
                .map(|h| (format!("{:?}", h.expect("whole").body), buf.len()))
        };
        assert_eq!(head("").unwrap(), ("Chunked(Size)".to_owned(), 0));
        assert_eq!(head("1").unwrap(), ("Chunked(Size)".to_owned(), 1));
        assert_eq!(head("1a;x=y").unwrap(), ("Chunked(Size)".to_owned(), 6));
        assert_eq!(head("3\r").unwrap(), ("Chunked(Size)".to_owned(), 2));
        assert_eq!(head("3\r\nab").unwrap(), ("Chunked(Data(3))".to_owned(), 2));
        assert_eq!(head("0\r\n").unwrap(), ("Chunked(Trailers)".to_owned(), 0));
        for bad in [
            "zz",
            "zz\r\n",
            "-3\r\n",
            "3 x",
            "3\nabc",
            "1ffffffffffffffff",
            "3\rx",
            // Later chunks that came with the head are checked too.
            "5\r\nhelloXXX\r\n0\r\n\r\n",
            "5\r\nhello\r\nzz\r\n",
            "2\r\nok\r\n3\r\nabcd",
        ] {
            assert!(matches!(head(bad), Err(WireError::Malformed(_))), "{bad:?}");
        }
        assert!(head(&format!("1;{}", "e".repeat(MAX_CHUNK_LINE))).is_err());
        // Whole and partial chunks that are well framed wait for the decoder.
        for good in [
            "5\r\nhello\r\n0\r\n\r\n",
            "5\r\nhel",
            "5\r\nhello\r",
            "2\r\nok\r\n3",
        ] {
            assert!(head(good).is_ok(), "{good:?}");
        }
    }

    #[test]
    fn keep_alive_follows_version_and_connection() {
        let reusable = |s: &str| parse(s, Method::GET).unwrap().unwrap().reusable;
        assert!(reusable("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(!reusable(
            "HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!reusable("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"));
        assert!(reusable(
            "HTTP/1.0 200 OK\r\nconnection: Keep-Alive\r\ncontent-length: 0\r\n\r\n"
        ));
        assert!(!reusable("HTTP/1.1 200 OK\r\n\r\n"), "close-delimited");
    }

    #[test]
    fn informational_answers_are_skipped_and_partial_heads_wait() {
        let mut buf = BytesMut::from(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n",
        );
        let head = parse_head(&mut buf, &Method::POST, &mut Kept::default())
            .unwrap()
            .unwrap();
        assert_eq!(head.parts.status, 200);
        assert!(buf.is_empty());
        let mut buf = BytesMut::from("HTTP/1.1 200 OK\r\ncontent-le");
        assert!(parse_head(&mut buf, &Method::GET, &mut Kept::default())
            .unwrap()
            .is_none());
        assert_eq!(buf.len(), 27, "a partial head is left where it is");
        let mut buf = BytesMut::from("HTTP/1.1 103 Early Hints\r\n\r\nHTTP/1.1 200 OK\r\n");
        assert!(parse_head(&mut buf, &Method::GET, &mut Kept::default())
            .unwrap()
            .is_none());
        assert_eq!(
            &buf[..],
            b"HTTP/1.1 200 OK\r\n",
            "the 103 is gone, the partial head left"
        );
        let mut big = String::from("HTTP/1.1 200 OK\r\nx: ");
        big.push_str(&"a".repeat(MAX_HEAD));
        assert!(matches!(
            parse(&big, Method::GET),
            Err(WireError::HeadTooLarge)
        ));
    }

    #[test]
    fn a_non_canonical_reason_is_kept() {
        let head = parse(
            "HTTP/1.1 200 Fine\r\ncontent-length: 0\r\n\r\n",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        let r = head
            .parts
            .extensions
            .get::<hyper::ext::ReasonPhrase>()
            .unwrap();
        assert_eq!(r.as_bytes(), b"Fine");
    }

    #[test]
    fn chunk_size_lines() {
        let mut b = BytesMut::from("1a;name=value\r\nrest");
        assert!(matches!(chunk_size(&mut b), Ok(Some(Chunk::Data(26)))));
        assert_eq!(&b[..], b"rest");
        assert!(matches!(
            chunk_size(&mut BytesMut::from("0\r\n")),
            Ok(Some(Chunk::Trailers))
        ));
        assert!(matches!(chunk_size(&mut BytesMut::from("1a")), Ok(None)));
        assert!(matches!(chunk_size(&mut BytesMut::from("1a ;e")), Ok(None)));
        assert!(chunk_size(&mut BytesMut::from("1a x")).is_err());
        assert!(chunk_size(&mut BytesMut::from("x")).is_err());
        assert!(chunk_size(&mut BytesMut::from("x\r\n")).is_err());
        assert!(chunk_size(&mut BytesMut::from("1\n")).is_err());
        assert!(chunk_size(&mut BytesMut::from("11111111111111111\r\n")).is_err());
        assert!(matches!(
            chunk_size(&mut BytesMut::from("1a \t\r\n")),
            Ok(Some(Chunk::Data(26)))
        ));
        // A bare CR, or white space other than spaces and tabs, is not taken; a CR
        // that may be the line's own waits for its LF.
        for bad in [
            "5\r\r\n",
            "5;a\rb\r\n",
            "5\x0c\r\n",
            "5\r;a\r\n",
            "5\rx",
            "5;a\rb",
        ] {
            assert!(chunk_size(&mut BytesMut::from(bad)).is_err(), "{bad:?}");
        }
        for partial in ["5\r", "5 \r", "5;a=b\r"] {
            assert!(
                matches!(chunk_size(&mut BytesMut::from(partial)), Ok(None)),
                "{partial:?}"
            );
        }
    }

    /// A trailer block is held to a head's size however it arrives: whole in one
    /// read, it was taken at any size.
    #[test]
    fn a_trailer_block_larger_than_a_head_is_refused_even_whole() {
        let big = format!("x: {}\r\n\r\n", "a".repeat(MAX_HEAD));
        assert!(matches!(
            trailers(&mut BytesMut::from(big.as_str())),
            Err(FramingError::TooLarge)
        ));
        let fits = format!("x: {}\r\n\r\n", "a".repeat(MAX_HEAD - 10));
        assert!(matches!(
            trailers(&mut BytesMut::from(fits.as_str())),
            Ok(Some(Some(_)))
        ));
    }

    /// Over TLS, what an upload wrote goes out before the next frame of the body is
    /// waited for, as hyper's client flushed: rustls keeps what a full socket did
    /// not take, and a client that waits for the answer before it sends more (or an
    /// upstream that answers only once it has the whole part) waited for ever.
    #[tokio::test]
    async fn over_tls_each_part_of_an_upload_goes_out_before_the_next_is_waited_for() {
        use tokio::io::AsyncReadExt;
        const PART: usize = 256 << 10;
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let key = rustls_pki_types::PrivateKeyDer::Pkcs8(ck.signing_key.serialize_der().into());
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![ck.cert.der().clone()], key)
            .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ck.cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        // The upstream takes the head and the part slowly, so that the socket to it
        // stays full; it reports how much of the part it got.
        let upstream = tokio::spawn(async move {
            let (s, _) = listener.accept().await.unwrap();
            let mut s = acceptor.accept(s).await.unwrap();
            let mut got = Vec::new();
            let mut b = [0u8; 2048];
            let head_end = loop {
                if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                    break i + 4;
                }
                let n = s.read(&mut b).await.unwrap();
                assert_ne!(n, 0);
                got.extend_from_slice(&b[..n]);
            };
            let mut body = got.len() - head_end;
            let read_part = async {
                while body < PART {
                    match s.read(&mut b).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => body += n,
                    }
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            };
            let _ = tokio::time::timeout(Duration::from_secs(3), read_part).await;
            body
        });

        // A small send buffer: the socket fills at once.
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.set_send_buffer_size(4096).unwrap();
        let tcp = socket.connect(addr).await.unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
            .connect(name, tcp)
            .await
            .unwrap();
        let slot = Arc::new(Semaphore::new(1)).acquire_owned().await.unwrap();
        let mut conn = Conn {
            io: Stream::Tls(Box::new(tls)),
            buf: BytesMut::new(),
            _slot: slot,
            kept: Box::default(),
            home: 0,
            reading: Reading::default(),
        };
        // One part of the body, then the client waits (for the answer, say).
        let body = {
            use futures_util::StreamExt;
            let part = Frame::data(Bytes::from(vec![b'x'; PART]));
            let frames = futures_util::stream::iter([Ok::<_, BoxError>(part)])
                .chain(futures_util::stream::pending());
            Body::new(http_body_util::StreamBody::new(frames))
        };
        let head = Bytes::from_static(b"POST / HTTP/1.1\r\nhost: a\r\n\r\n");
        let framing = UploadFraming::Length(PART as u64 + 5);
        let sending = exchange(
            &mut conn,
            head,
            body,
            framing,
            Vec::new(),
            &Method::POST,
            false,
        );
        let got = tokio::select! {
            biased;
            got = upstream => got.unwrap(),
            _ = sending => panic!("no answer can come"),
        };
        assert_eq!(got, PART);
    }

    /// The check of a kept connection does not depend on the task's tokio budget:
    /// with it spent, tokio answers every readiness poll `Pending`, and a connection
    /// with bytes nobody asked for (or the upstream's close) looked usable, so the
    /// next request would have read those bytes as its answer.
    #[tokio::test]
    async fn a_kept_connection_is_checked_even_when_the_tasks_budget_is_spent() {
        use tokio::io::AsyncWriteExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let tcp = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (mut upstream, _) = listener.accept().await.unwrap();
        upstream
            .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nforged")
            .await
            .unwrap();
        tcp.readable().await.unwrap();
        let slot = Arc::new(Semaphore::new(1)).acquire_owned().await.unwrap();
        let mut conn = Conn {
            io: Stream::Plain(tcp),
            buf: BytesMut::new(),
            _slot: slot,
            kept: Box::default(),
            home: 0,
            reading: Reading::default(),
        };
        let usable = std::future::poll_fn(|cx| {
            // Spend the budget, as a task that did much I/O in one poll has.
            for _ in 0..200 {
                let _ = std::pin::pin!(tokio::task::consume_budget()).poll(cx);
            }
            Poll::Ready(conn.is_usable())
        })
        .await;
        assert!(!usable);
    }

    /// A connection's room for heads serves the next head once the last is
    /// dropped, and is not kept past `KEPT_HEAD_ROOM` after a large one.
    #[test]
    fn a_connections_room_for_heads_is_reused_and_kept_small() {
        let head = |buf: &mut BytesMut, value: &str| {
            let mut h = HeaderMap::new();
            h.insert("x-v", HeaderValue::from_str(value).unwrap());
            let uri = http::Uri::from_static("/p");
            write_request_head(&Method::GET, &uri, &h, &Forwarded::default(), buf)
        };
        let mut buf = BytesMut::new();
        let first = head(&mut buf, "a");
        assert_eq!(&first[..], b"GET /p HTTP/1.1\r\nx-v: a\r\n\r\n");
        let at = first.as_ptr();
        drop(first);
        let second = head(&mut buf, "b");
        assert_eq!(second.as_ptr(), at, "the same room, written again");
        drop(second);
        let big = head(&mut buf, &"x".repeat(3 * KEPT_HEAD_ROOM));
        assert_eq!(big.len(), 3 * KEPT_HEAD_ROOM + 26);
        drop(big);
        let small = head(&mut buf, "c");
        assert_eq!(&small[..], b"GET /p HTTP/1.1\r\nx-v: c\r\n\r\n");
        assert!(buf.capacity() <= KEPT_HEAD_ROOM, "{}", buf.capacity());
    }

    #[test]
    fn request_framing_follows_hypers_client() {
        let framing = |method: Method, headers: &[(&str, &str)], body: Body| {
            let mut req = http::Request::builder().method(method).uri("/p?q");
            for (k, v) in headers {
                req = req.header(*k, *v);
            }
            let (mut parts, ()) = req.body(()).unwrap().into_parts();
            let (head, f) = request_head(&mut parts, &body, Forwarded::default());
            (String::from_utf8(head.to_vec()).unwrap(), f)
        };
        let empty = || crate::http::body::full(Bytes::new());
        assert_eq!(
            framing(Method::GET, &[("host", "a")], empty()),
            (
                "GET /p?q HTTP/1.1\r\nhost: a\r\n\r\n".into(),
                UploadFraming::Empty
            )
        );
        assert_eq!(
            framing(
                Method::POST,
                &[],
                crate::http::body::full(Bytes::from("abc"))
            ),
            (
                "POST /p?q HTTP/1.1\r\ncontent-length: 3\r\n\r\n".into(),
                UploadFraming::Length(3)
            )
        );
        let unknown = || {
            let frames = futures_util::stream::pending::<Result<Frame<Bytes>, BoxError>>();
            Body::new(http_body_util::StreamBody::new(frames))
        };
        assert_eq!(
            framing(Method::PUT, &[], unknown()).1,
            UploadFraming::Chunked
        );
        assert_eq!(framing(Method::GET, &[], unknown()).1, UploadFraming::Empty);
        assert_eq!(
            framing(Method::PUT, &[("content-length", "7")], unknown()).1,
            UploadFraming::Length(7)
        );
    }
}
