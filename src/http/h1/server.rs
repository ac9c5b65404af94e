//! sluice's own HTTP/1.1 server, on the gateway's port and the admin port: every
//! HTTP/1 request, plain or under TLS, is read, answered and written here (hyper
//! serves only HTTP/2). A request body is read for the request path as it
//! asks for it (`request_body`); an upgrade hands the socket to its tunnel after the
//! `101`. Bodiless requests, most of them, take the shortest way: one parse, the
//! head worked on in place, the answer's head written behind the fields as they
//! came.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, StatusCode, Uri, Version};
use http_body::{Body as _, Frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::sync::{oneshot, watch};

use crate::http::body::{BoxError, Guarded, OnFail};
use crate::http::conn::Activity;
use crate::http::conn::ConnectionHeld;
use crate::http::fields::AddedFields;
use crate::http::h1::decode::Decoder;
use crate::http::h1::framing::{
    connection, decimal, has_token, last_is_chunked, may_trail, value_length, Connection,
};
use crate::http::h1::head::{self, HeadError, RequestHead};
use crate::http::h1::request_body::{poll_read_buf, Inflow, Settled};
use crate::http::h1::upstream::{parsed_value, Names, RawFields};
use crate::http::request::ClientBody;
use crate::http::site::{Lent, Relay, Site};
use crate::http::wake::{Deadline, OnWake};

/// A client connection as a tunnel takes it.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// An upgraded client connection: the bytes read past the upgrade request, then
/// the socket.
pub type Upgraded = Replay<Box<dyn Io>>;

/// In an upgrade request's extensions (as hyper's `OnUpgrade`): the client's
/// connection, once the `101` has been written to it.
#[derive(Clone)]
pub struct OnUpgrade(Arc<Mutex<Option<oneshot::Receiver<Upgraded>>>>);

impl OnUpgrade {
    /// The connection; `None` if the answer was no `101` or the connection ended.
    pub async fn upgraded(self) -> Option<Upgraded> {
        let rx = self.0.lock().unwrap_or_else(|e| e.into_inner()).take()?;
        rx.await.ok()
    }
}

/// hyper answers a longer request target 414.
const MAX_URI_LEN: usize = (u16::MAX - 1) as usize;
/// A body frame up to this size is copied behind its head (one write); larger ones
/// are written on their own.
const COPY_LIMIT: usize = 16 * 1024;

/// What a connection's server needs.
pub(crate) struct Fast<S: Site> {
    pub site: Arc<S>,
    pub peer: Arc<S::Peer>,
    pub header_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_head: usize,
    /// The connection's slots, lent to an upgrade's tunnel (`ConnectionHeld`).
    pub held: Arc<dyn std::any::Any + Send + Sync>,
}

/// How a request's body is framed (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RequestFraming {
    None,
    Length(u64),
    Chunked,
}

/// A parsed request and what its answer's framing depends on.
struct Plain {
    /// The request allows the connection to stay open (HTTP/1.1 without `close`,
    /// HTTP/1.0 with `keep-alive`).
    keep_alive: bool,
    version: Version,
    head: bool,
    /// `TE: trailers`.
    trailers: bool,
    body: RequestFraming,
    /// `Expect: 100-continue` (HTTP/1.1).
    expect: bool,
    /// `Upgrade` (HTTP/1.1) or `CONNECT`.
    upgrade: bool,
}

// Matched at once where it is made: not worth a box.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    Plain(Plain),
    Partial,
    /// Answered with this status, and the connection closed (hyper's
    /// `Server::on_error`). The head is still at the start of the buffer.
    Bad(StatusCode),
    /// Answered 400 as `Bad`; the head was split off the buffer: here it is.
    BadHead(Bytes),
}

/// Serve HTTP/1 requests on `io` until it closes; `buf` holds what was read of it
/// already.
pub(crate) async fn serve<IO, S: Site>(
    mut io: IO,
    mut buf: BytesMut,
    fast: &Fast<S>,
    activity: &Arc<Activity>,
    stop: watch::Receiver<bool>,
) -> Result<(), BoxError>
where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let mut out: Vec<u8> = Vec::with_capacity(1024);
    let mut spans = Vec::with_capacity(32);
    // The field names of the last request.
    let mut names = Names::default();
    // The rate-limit fields of the answer, as header lines (`Lent`).
    let mut rate_fields = AddedFields::with_capacity(256);
    // A response's header map, emptied, holds the next request's fields (as in
    // hyper): no allocation, and room for the forwarding headers.
    let mut fields = HeaderMap::new();
    // Each request's head, in turn (`parse`).
    let (mut parts, ()) = Request::new(()).into_parts();
    // The waits beside the socket's are polled again only when woken (`OnWake`),
    // not every time the connection's task runs.
    let idle = OnWake::new(activity.idle(fast.idle_timeout));
    tokio::pin!(idle);
    let stopped = {
        let mut stop = stop.clone();
        OnWake::new(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
    };
    tokio::pin!(stopped);
    // One timer for the connection's deadlines: each head's, and each upstream
    // answer's (`Lent`).
    let timer = Deadline::new(tokio::time::Instant::now() + fast.header_timeout);
    tokio::pin!(timer);
    // How much of `buf` is known to hold no end of a head: a head sent in many
    // small pieces is parsed again only once its end may have come (as hyper does),
    // not on every read, which would cost the square of its length.
    let mut scan = Scan::default();
    loop {
        let plain = loop {
            if scan.worth_parsing(&buf) {
                match parse(
                    &mut buf,
                    &mut spans,
                    &mut names,
                    &mut fields,
                    &mut parts,
                    fast.max_head,
                ) {
                    Parsed::Plain(p) => {
                        scan = Scan::default();
                        break p;
                    }
                    Parsed::Partial => scan.partial(&buf),
                    // Answered by the server itself, and logged as the site logs
                    // its answers (an access line).
                    Parsed::Bad(status) => {
                        fast.site.refused_head(status, &fast.peer, &buf);
                        return refuse(&mut io, status).await;
                    }
                    Parsed::BadHead(head) => {
                        let status = StatusCode::BAD_REQUEST;
                        fast.site.refused_head(status, &fast.peer, &head);
                        return refuse(&mut io, status).await;
                    }
                }
            } else if buf.len() >= fast.max_head {
                // No end in sight within the limit.
                let status = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
                fast.site.refused_head(status, &fast.peer, &buf);
                return refuse(&mut io, status).await;
            }
            buf.reserve(2048);
            tokio::select! {
                biased;
                r = io.read_buf(&mut buf) => match r {
                    // With part of a head: hyper too ends without an answer.
                    Ok(0) => return Ok(()),
                    Ok(_) => {}
                    Err(e) => return Err(e.into()),
                },
                // hyper too closes without an answer.
                () = timer.as_mut().passed() => {
                    return Err("no request head within request_header_timeout".into());
                }
                _ = &mut idle => return Ok(()),
                _ = &mut stopped => return Ok(()),
            }
        };
        let Plain {
            keep_alive,
            version,
            head,
            trailers,
            body,
            expect,
            upgrade,
        } = plain;

        // In flight from its head until its response body has been sent.
        let in_flight = activity.start();
        rate_fields.clear();
        let (inflow, body) = match body {
            RequestFraming::None => (None, ClientBody::Empty),
            RequestFraming::Length(n) => {
                let (i, b) = Inflow::new(Decoder::Length(n), expect);
                (Some(i), ClientBody::Own(b))
            }
            RequestFraming::Chunked => {
                let (i, b) = Inflow::new(Decoder::chunked(), expect);
                (Some(i), ClientBody::Own(b))
            }
        };
        // The connection for the request's tunnel, and its slots (kept by the tunnel).
        let switch = upgrade.then(|| {
            let (tx, rx) = oneshot::channel();
            parts
                .extensions
                .insert(OnUpgrade(Arc::new(Mutex::new(Some(rx)))));
            parts.extensions.insert(ConnectionHeld(fast.held.clone()));
            tx
        });
        // The upstream answer's fields as they came, when they can be written so
        // (`encode_head`): to an HTTP/1.1 request other than HEAD.
        let mut raw: Option<RawFields> = None;
        let raw_ok = version == Version::HTTP_11 && !head;
        // The request's end (the site's `Guard`), held with the body as it is sent.
        let mut guard = None;
        let resp = {
            let answer = fast.site.serve(
                &mut parts,
                body,
                &fast.peer,
                Lent {
                    fields: &mut rate_fields,
                    relay: Relay {
                        timer: timer.as_mut(),
                        raw: raw_ok.then_some(&mut raw),
                    },
                },
                &mut guard,
            );
            tokio::pin!(answer);
            // As hyper: while the request is worked on, a client that closes its end
            // (with nothing more sent) cancels it.
            match &inflow {
                None if buf.is_empty() => {
                    // Room to read into: a read into none would look like the end.
                    buf.reserve(2048);
                    tokio::select! {
                        biased;
                        r = &mut answer => r,
                        r = io.read_buf(&mut buf) => match r {
                            Ok(0) => return Err("the client closed its connection mid-request".into()),
                            Err(e) => return Err(e.into()),
                            Ok(_) => answer.await,
                        },
                    }
                }
                None => answer.await,
                Some(inflow) => {
                    let mut watching = true;
                    std::future::poll_fn(|cx| {
                        if let Poll::Ready(r) = answer.as_mut().poll(cx) {
                            return Poll::Ready(Ok(r));
                        }
                        feed_or_watch(cx, inflow, &mut io, &mut buf, &mut watching).map(Err)
                    })
                    .await?
                }
            }
        };

        let (mut parts, body) = resp.into_parts();
        // (Sent from here, by reference: it holds the request's tally, large
        // enough that each move of it is a copy.)
        let mut body = Guarded::new(body, guard);
        if parts
            .extensions
            .get::<crate::http::body::Linger>()
            .is_some()
        {
            activity.linger();
        }
        if let Some(inflow) = &inflow {
            inflow.answering();
        }
        let switch = switch.filter(|_| parts.status == StatusCode::SWITCHING_PROTOCOLS);
        let kind = if body.is_end_stream() {
            None
        } else {
            Some(body.size_hint().exact())
        };
        let meta = Meta {
            version,
            keep_alive: keep_alive && !*stop.borrow(),
            head,
            switching: switch.is_some(),
        };
        out.clear();
        let enc = encode_head(&mut out, &mut parts, &meta, kind, &rate_fields, raw)?;
        let last = enc.last;
        fields = std::mem::take(&mut parts.headers);
        fields.clear();
        drop(parts);
        if let Some(tx) = switch {
            // The tunnel takes the connection from here, with what came after the
            // request (the client may speak the new protocol at once).
            drop(body);
            io.write_all(&out).await?;
            io.flush().await?;
            drop(in_flight);
            let io: Box<dyn Io> = Box::new(io);
            let _ = tx.send(Replay { head: buf, io });
            return Ok(());
        }
        let sent = send_body(
            &mut io,
            &mut buf,
            &mut out,
            &mut body,
            enc.framing,
            trailers,
            inflow.as_ref(),
        )
        .await;
        // A body not read to its end leaves the connection's framing unknown: it
        // closes, lingering, so the client reads this answer rather than a reset.
        let unread = inflow
            .as_ref()
            .is_some_and(|i| i.finish(&mut buf) != Settled::Done);
        if unread {
            activity.linger();
        }
        drop(in_flight);
        if let Err(e) = sent {
            if e.is::<NothingSent>() {
                tracing::debug!(error = %e, "answered 502");
                let _ =
                    refuse_with(&mut io, StatusCode::BAD_GATEWAY, b"upstream unavailable\n").await;
                return Ok(());
            }
            return Err(e);
        }
        if last || unread || *stop.borrow() {
            let _ = io.shutdown().await;
            return Ok(());
        }
        // The next head: `request_header_timeout` from the end of this response.
        timer
            .as_mut()
            .set(tokio::time::Instant::now() + fast.header_timeout);
    }
}

/// Feed a request body while it is read; once it needs nothing more, watch for
/// the client closing its end (with nothing more sent), which cancels the
/// request, as with hyper. Ready with the error that ends the connection.
fn feed_or_watch<IO>(
    cx: &mut Context<'_>,
    inflow: &Inflow,
    io: &mut IO,
    buf: &mut BytesMut,
    watching: &mut bool,
) -> Poll<BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    match inflow.poll_feed(cx, io, buf) {
        Poll::Ready(Err(e)) => Poll::Ready(e.into()),
        // A broken body ends its request by itself, with an answer.
        Poll::Ready(Ok(Settled::Failed)) | Poll::Pending => Poll::Pending,
        Poll::Ready(Ok(_)) if *watching && buf.is_empty() => match poll_read_buf(io, cx, buf) {
            Poll::Ready(Ok(0)) => {
                Poll::Ready("the client closed its connection mid-request".into())
            }
            Poll::Ready(Err(e)) => Poll::Ready(e.into()),
            Poll::Ready(Ok(_)) => {
                *watching = false;
                Poll::Pending
            }
            Poll::Pending => Poll::Pending,
        },
        Poll::Ready(Ok(_)) => Poll::Pending,
    }
}

/// Answer `status` with a short text `body` and close.
async fn refuse_with<IO>(io: &mut IO, status: StatusCode, body: &[u8]) -> Result<(), BoxError>
where
    IO: AsyncWrite + Unpin,
{
    let mut out = Vec::with_capacity(160 + body.len());
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(
        b"\r\nconnection: close\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: ",
    );
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\ndate: ");
    date::extend(&mut out);
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body);
    io.write_all(&out).await?;
    let _ = io.shutdown().await;
    Ok(())
}

/// Answer a head that cannot be served (as hyper's `Server::on_error`) and close.
async fn refuse<IO>(io: &mut IO, status: StatusCode) -> Result<(), BoxError>
where
    IO: AsyncWrite + Unpin,
{
    let mut out = Vec::with_capacity(128);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    out.extend_from_slice(b"\r\nconnection: close\r\ncontent-length: 0\r\ndate: ");
    date::extend(&mut out);
    out.extend_from_slice(b"\r\n\r\n");
    io.write_all(&out).await?;
    let _ = io.shutdown().await;
    Ok(())
}

/// What is known of a partial head in the buffer, so that a head sent in many
/// small pieces is parsed again only once its end may have come.
#[derive(Default)]
struct Scan {
    /// How much of the buffer is known to hold no end of a head (0: parse at once).
    scanned: usize,
    /// Where the first byte other than CR or LF is, once seen: the parser skips
    /// empty lines before a request line, so none of those can end a head (a
    /// flood of them, sent byte by byte, would otherwise be parsed again on every
    /// byte, the square of its length).
    first: Option<usize>,
    /// How much of the buffer was looked at for `first`.
    looked: usize,
    /// Bytes looked at for an empty line, in all.
    #[cfg(test)]
    examined: usize,
}

impl Scan {
    /// Whether `buf` may now hold a whole head: something new since the last
    /// parse, with an empty line in it after the request line's start (or with
    /// three bytes before, where an end may straddle reads).
    fn worth_parsing(&mut self, buf: &[u8]) -> bool {
        if buf.is_empty() {
            return false;
        }
        if self.scanned == 0 {
            return true;
        }
        let first = match self.first {
            Some(at) => at,
            None => {
                let found = buf[self.looked..]
                    .iter()
                    .position(|&b| b != b'\r' && b != b'\n');
                let Some(i) = found else {
                    self.looked = buf.len();
                    return false;
                };
                let at = self.looked + i;
                self.first = Some(at);
                at
            }
        };
        let from = self.scanned.saturating_sub(3).max(first);
        #[cfg(test)]
        {
            self.examined += buf.len() - from;
        }
        let may_end = buf[from..].windows(2).any(|w| w == b"\n\n" || w == b"\n\r");
        if !may_end {
            // Looked at once: the next read's bytes are looked at from here.
            self.scanned = buf.len();
        }
        may_end
    }

    /// The last parse found `buf` to be part of a head.
    fn partial(&mut self, buf: &[u8]) {
        self.scanned = buf.len();
    }
}

/// Parse the head at the start of `buf`; a whole one is split off it. `spans` is
/// room for where its fields are (kept by the connection, so that no request
/// allocates or zeroes it), `names` the last request's field names
/// (`h1::Names`). The request's head goes into `parts` (the connection's,
/// worked on in place by the request path, never moved). What is refused, and
/// how, is hyper's (`Server::parse`, `Server::on_error`).
fn parse(
    buf: &mut BytesMut,
    spans: &mut Vec<[usize; 4]>,
    names: &mut Names,
    fields: &mut HeaderMap,
    parts: &mut http::request::Parts,
    max_head: usize,
) -> Parsed {
    const BAD: Parsed = Parsed::Bad(StatusCode::BAD_REQUEST);
    let bytes: &[u8] = buf.as_ref();
    let RequestHead {
        len,
        method,
        target,
        minor,
    } = match head::request(bytes, spans) {
        Ok(Some(head)) => head,
        Ok(None) if bytes.len() < max_head => return Parsed::Partial,
        // Over the limit: 431 at once from what is buffered.
        Ok(None) | Err(HeadError::TooManyFields) => {
            return Parsed::Bad(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
        }
        Err(HeadError::Malformed) => return BAD,
    };
    if len > max_head {
        return Parsed::Bad(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    }
    if target.len() > MAX_URI_LEN {
        return Parsed::Bad(StatusCode::URI_TOO_LONG);
    }
    let version = if minor == 1 {
        Version::HTTP_11
    } else {
        Version::HTTP_10
    };
    let http11 = version == Version::HTTP_11;
    let Ok(method) = Method::from_bytes(&bytes[method]) else {
        return BAD;
    };
    let mut connection = Connection::default();
    let mut trailers = false;
    // Framing as RFC 9112 §6.3 and hyper have it: chunked if the last
    // `Transfer-Encoding` ends so (anything else is refused), else the length,
    // which every `Content-Length` line must state alike.
    let mut length: Option<u64> = None;
    let mut saw_length = false;
    let mut te = false;
    let mut chunked = false;
    // Transfer codings named, over every line: more than a lone `chunked` is a
    // coding sluice does not implement (501, as nginx answers).
    let mut codings = 0usize;
    let mut expect = false;
    let mut upgrade = method == Method::CONNECT;
    let n = spans.len();
    for &[name_start, name_end, value_start, value_end] in spans.iter() {
        let name = &bytes[name_start..name_end];
        let value = &bytes[value_start..value_end];
        if name.eq_ignore_ascii_case(b"content-length") {
            saw_length = true;
            if !te {
                // One number a line, as hyper's server reads it (no list).
                let Some(len) = decimal(value) else {
                    return BAD;
                };
                if length.is_some_and(|l| l != len) || len > u64::MAX - 2 {
                    return BAD;
                }
                length = Some(len);
            }
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            if !http11 {
                return BAD;
            }
            te = true;
            length = None;
            codings += value.iter().filter(|&&b| b == b',').count() + 1;
            chunked = last_is_chunked(value);
        } else if name.eq_ignore_ascii_case(b"connection") {
            connection.add(value);
        } else if name.eq_ignore_ascii_case(b"te") && has_token(value, b"trailers") {
            trailers = true;
        } else if name.eq_ignore_ascii_case(b"expect") {
            expect = value.eq_ignore_ascii_case(b"100-continue");
        } else if name.eq_ignore_ascii_case(b"upgrade") {
            upgrade = http11;
        }
    }
    // As hyper: once any line asks to close, a later keep-alive does not undo it.
    let mut keep_alive = connection.persists(http11);
    if te && !chunked {
        return BAD;
    }
    // Framed by its final `chunked`, but coded by something else too (`gzip,
    // chunked`): forwarded as plain `chunked`, the coding would be lost.
    if te && codings > 1 {
        return Parsed::Bad(StatusCode::NOT_IMPLEMENTED);
    }
    // Both: the length is dropped, and the connection closes after the answer.
    if te && saw_length {
        keep_alive = false;
    }
    let body = match (te, length) {
        (true, _) => RequestFraming::Chunked,
        (false, Some(n)) if n > 0 => RequestFraming::Length(n),
        _ => RequestFraming::None,
    };
    let head = buf.split_to(len).freeze();
    let uri = match Uri::from_maybe_shared(head.slice(target.clone())) {
        Ok(uri) => uri,
        Err(_) => match encoded_target(&head[target]) {
            Some(uri) => uri,
            None => return Parsed::BadHead(head),
        },
    };
    let mut headers = std::mem::take(fields);
    if headers.capacity() == 0 {
        headers = HeaderMap::with_capacity(n + 8);
    } else {
        headers.reserve(n);
    }
    for (i, &[a, b, c, d]) in spans.iter().enumerate() {
        let (Ok(name), Ok(value)) = (names.name(i, &head[a..b]), parsed_value(head.slice(c..d)))
        else {
            return Parsed::BadHead(head);
        };
        headers.append(name, value);
    }
    if te && saw_length {
        headers.remove(header::CONTENT_LENGTH);
    }
    let is_head = method == Method::HEAD;
    parts.method = method;
    parts.uri = uri;
    parts.version = version;
    parts.headers = headers;
    parts.extensions.clear();
    Parsed::Plain(Plain {
        keep_alive,
        version,
        head: is_head,
        trailers,
        body,
        expect: expect && http11 && body != RequestFraming::None,
        upgrade,
    })
}

/// A request target the URI type refuses only for bytes that nginx forwards and
/// browsers percent-encode (`"`, `<`, `>` in a query; `<`, `>`, `` ` `` in a
/// path), with those bytes percent-encoded: the same value to an application that
/// decodes them, and a target every upstream parser takes. Off the hot path: only
/// a target that failed to parse comes here.
fn encoded_target(target: &[u8]) -> Option<Uri> {
    // What the URI type refuses in each part (it takes `"` in a path, `` ` `` in a
    // query).
    const IN_PATH: &[u8] = b"<>`";
    const IN_QUERY: &[u8] = b"\"<>";
    let mut out = Vec::with_capacity(target.len() + 16);
    let mut refused = IN_PATH;
    let mut changed = false;
    for &b in target {
        if refused.contains(&b) {
            out.extend_from_slice(format!("%{b:02X}").as_bytes());
            changed = true;
        } else {
            out.push(b);
        }
        if b == b'?' {
            refused = IN_QUERY;
        }
    }
    if !changed {
        return None;
    }
    Uri::from_maybe_shared(Bytes::from(out)).ok()
}

/// One request as `read_requests` read it.
#[cfg(feature = "fuzzing")]
pub(crate) enum Read {
    /// No whole head when the bytes ended.
    Incomplete,
    /// Answered with this status, and the connection closed.
    Refused(StatusCode),
    Request {
        /// As the request path gets it.
        parts: Box<http::request::Parts>,
        framed: RequestFraming,
        data: Vec<u8>,
        trailers: Option<HeaderMap>,
        end: BodyEnd,
    },
}

/// How a body `read_requests` read ended.
#[cfg(feature = "fuzzing")]
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum BodyEnd {
    Whole,
    /// The bytes ended within it.
    Cut,
    Malformed,
}

/// The `request` fuzz target's view of the codec: `input` read as a connection that
/// gets it whole reads it (`parse` as `serve` calls it, then each body through its
/// `Inflow`, as the request path asks for it, then `finish`), request after request
/// until the bytes end, the connection would close or may be handed to a tunnel, or
/// something is refused.
#[cfg(feature = "fuzzing")]
pub(crate) fn read_requests(input: &[u8], max_head: usize) -> Vec<Read> {
    let mut buf = BytesMut::from(input);
    let (mut spans, mut names, mut fields) = (Vec::new(), Names::default(), HeaderMap::new());
    let mut out = Vec::new();
    loop {
        let (mut parts, ()) = Request::new(()).into_parts();
        let plain = match parse(
            &mut buf,
            &mut spans,
            &mut names,
            &mut fields,
            &mut parts,
            max_head,
        ) {
            Parsed::Plain(p) => p,
            Parsed::Partial => {
                out.push(Read::Incomplete);
                return out;
            }
            Parsed::Bad(status) => {
                out.push(Read::Refused(status));
                return out;
            }
            Parsed::BadHead(_) => {
                out.push(Read::Refused(StatusCode::BAD_REQUEST));
                return out;
            }
        };
        let decode = match plain.body {
            RequestFraming::None => None,
            RequestFraming::Length(n) => Some(Decoder::Length(n)),
            RequestFraming::Chunked => Some(Decoder::chunked()),
        };
        let (mut data, mut trailers, mut end) = (Vec::new(), None, BodyEnd::Whole);
        if let Some(decode) = decode {
            // The client has sent all it will: a read for more finds the end.
            let (mut io, _) = tokio::io::duplex(1);
            let (inflow, mut body) = Inflow::new(decode, false);
            let mut cx = Context::from_waker(std::task::Waker::noop());
            loop {
                match Pin::new(&mut body).poll_frame(&mut cx) {
                    Poll::Ready(None) => break,
                    Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                        Ok(d) => data.extend_from_slice(&d),
                        Err(f) => trailers = f.into_trailers().ok(),
                    },
                    Poll::Ready(Some(Err(e))) => {
                        let cut = e
                            .downcast_ref::<std::io::Error>()
                            .is_some_and(|e| e.kind() == std::io::ErrorKind::UnexpectedEof);
                        end = if cut {
                            BodyEnd::Cut
                        } else {
                            BodyEnd::Malformed
                        };
                        break;
                    }
                    Poll::Pending => {
                        if let Poll::Ready(Err(e)) = inflow.poll_feed(&mut cx, &mut io, &mut buf) {
                            panic!("no write was asked for: {e}");
                        }
                    }
                }
            }
            drop(body);
            let settled = inflow.finish(&mut buf);
            assert_eq!(
                settled == Settled::Done,
                end == BodyEnd::Whole,
                "{settled:?}"
            );
        }
        // A body ended short or broken closes the connection.
        let last = end != BodyEnd::Whole || !plain.keep_alive || plain.upgrade || buf.is_empty();
        out.push(Read::Request {
            parts: Box::new(parts),
            framed: plain.body,
            data,
            trailers,
            end,
        });
        if last {
            return out;
        }
    }
}

/// What the answer's framing depends on besides the response.
struct Meta {
    /// The request's.
    version: Version,
    /// The connection may stay open after this answer (the request allows it and
    /// no graceful close has started).
    keep_alive: bool,
    head: bool,
    /// A `101` to an upgrade request: the connection is its tunnel's after it.
    switching: bool,
}

/// How the response body goes on the wire.
enum ResponseFraming {
    Length(u64),
    Chunked(Trailers),
    /// Until the connection closes (HTTP/1.0 without a length).
    Close,
}

/// Which trailers a chunked answer passes on (to a client that accepts them).
enum Trailers {
    None,
    /// Those its `Trailer` field names.
    Named(Vec<HeaderName>),
    /// Every one that may trail: an answer from an HTTP/2 upstream, which cannot
    /// announce them (`UnannouncedTrailers`).
    Any,
}

struct Encoding {
    framing: ResponseFraming,
    /// Close the connection after this response.
    last: bool,
}

/// Write the response head as hyper's server does (`Server::encode`): the same
/// status line, fields in the map's order, framing, `connection` and `date`.
/// `extra` holds fields that stand after the map's fields, as if they had been
/// appended to it (the rate-limit fields): only a `connection` this adds comes
/// after them.
fn encode_head(
    out: &mut Vec<u8>,
    parts: &mut http::response::Parts,
    meta: &Meta,
    body: Option<Option<u64>>,
    extra: &AddedFields,
    raw: Option<RawFields>,
) -> Result<Encoding, BoxError> {
    // The answer's fields as they came, written as they are where that is what the
    // map holding them would give: else they go into the map first.
    let raw = raw.and_then(|raw| {
        let as_they_are = meta.version == Version::HTTP_11
            && !meta.head
            && parts.version == Version::HTTP_11
            && body == Some(Some(raw.length))
            && parts.headers.is_empty();
        if as_they_are {
            return Some(raw);
        }
        let after = std::mem::take(&mut parts.headers);
        raw.put_in(&mut parts.headers);
        let mut name = None;
        for (next, value) in after {
            // (None: the name of the value before.)
            name = next.or(name);
            if let Some(name) = &name {
                parts.headers.append(name.clone(), value);
            }
        }
        None
    });
    let status = parts.status;
    if meta.switching {
        // As hyper writes a `101`: its fields, no framing, and the end of HTTP/1.1
        // on the connection.
        out.extend_from_slice(b"HTTP/1.1 101 Switching Protocols\r\n");
        let mut wrote_date = false;
        for (name, value) in parts.headers.iter() {
            wrote_date |= *name == header::DATE;
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(extra.lines());
        if !wrote_date {
            out.extend_from_slice(b"date: ");
            date::extend(out);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        return Ok(Encoding {
            framing: ResponseFraming::Length(0),
            last: true,
        });
    }
    let mut keep_alive = meta.keep_alive;
    // A `connection` value added to a map without one: its line would follow
    // `extra`, so it is written there rather than appended to the map.
    let mut added_connection: Option<&'static str> = None;
    let mut add_connection = |headers: &mut HeaderMap, value: &'static str| {
        if !extra.is_empty() && !headers.contains_key(header::CONNECTION) {
            added_connection = Some(value);
        } else {
            headers.append(header::CONNECTION, HeaderValue::from_static(value));
        }
    };
    // hyper's `enforce_version`.
    if meta.version == Version::HTTP_10 {
        if !connection(&parts.headers).keep_alive {
            match parts.version {
                Version::HTTP_10 => keep_alive = false,
                Version::HTTP_11 if keep_alive => add_connection(&mut parts.headers, "keep-alive"),
                _ => {}
            }
        }
        parts.version = Version::HTTP_10;
    } else if !keep_alive && !connection(&parts.headers).close {
        add_connection(&mut parts.headers, "close");
    }
    if status.is_informational() {
        // hyper refuses to send one as a response: a bare 500, and the end.
        out.extend_from_slice(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\ndate: ");
        date::extend(out);
        out.extend_from_slice(b"\r\n\r\n");
        return Ok(Encoding {
            framing: ResponseFraming::Length(0),
            last: true,
        });
    }
    let mut last = !keep_alive;
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
    if parts.version != Version::HTTP_10 && status == StatusCode::OK && reason.is_none() {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(if parts.version == Version::HTTP_10 {
            b"HTTP/1.0 "
        } else {
            b"HTTP/1.1 "
        });
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        match reason {
            Some(r) => out.extend_from_slice(r.as_bytes()),
            None => out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes()),
        }
        out.extend_from_slice(b"\r\n");
    }
    let http10 = parts.version == Version::HTTP_10;
    let can_chunk =
        !meta.head && !matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
    let can_length = !matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
    let mut framing = ResponseFraming::Length(0);
    let mut wrote_len = false;
    let mut wrote_date = false;
    let mut allowed_trailers: Option<Vec<HeaderName>> = None;
    let mut prev_len: Option<u64> = None;
    // A `content-length`, `transfer-encoding`, `connection` or `trailer` line is
    // open: its values are joined on one line.
    let mut open: Option<HeaderName> = None;
    let mut chunked_missing = false;
    let close_line = |out: &mut Vec<u8>, open: &mut Option<HeaderName>, chunked_missing: bool| {
        if open.take().is_some() {
            out.extend_from_slice(if chunked_missing {
                b", chunked\r\n"
            } else {
                b"\r\n"
            });
        }
    };
    if let Some(raw) = raw {
        // Each line as the loop below writes it: `content-length` as it came, the
        // body's length its framing.
        out.extend_from_slice(&raw.lines);
        framing = ResponseFraming::Length(raw.length);
        wrote_len = true;
        wrote_date = raw.date;
    }
    for (name, value) in parts.headers.iter() {
        if open.as_ref().is_some_and(|o| o != name) {
            close_line(out, &mut open, chunked_missing);
        }
        let continuing = open.is_some();
        match *name {
            header::CONTENT_LENGTH => {
                if wrote_len && !continuing {
                    return Err("a response with both a length and another framing".into());
                }
                match body {
                    Some(Some(known)) => {
                        if !continuing {
                            framing = ResponseFraming::Length(known);
                            // The body's own length, never the map's (hyper writes
                            // the map's): a length other than the one the body is
                            // framed by would desync the client.
                            out.extend_from_slice(b"content-length: ");
                            out.extend_from_slice(itoa::Buffer::new().format(known).as_bytes());
                            wrote_len = true;
                            open = Some(header::CONTENT_LENGTH);
                        }
                        continue;
                    }
                    Some(None) => {
                        let Some(len) = value_length(value.as_bytes()) else {
                            return Err("a response with an invalid content-length".into());
                        };
                        if let Some(prev) = prev_len {
                            if prev != len {
                                return Err("a response with differing content-lengths".into());
                            }
                            continue;
                        }
                        framing = ResponseFraming::Length(len);
                        out.extend_from_slice(b"content-length: ");
                        out.extend_from_slice(value.as_bytes());
                        wrote_len = true;
                        open = Some(header::CONTENT_LENGTH);
                        prev_len = Some(len);
                        continue;
                    }
                    None => {
                        if !meta.head {
                            continue;
                        }
                    }
                }
                wrote_len = true;
            }
            header::TRANSFER_ENCODING => {
                if wrote_len && !continuing {
                    return Err("a response with both a length and another framing".into());
                }
                if http10 || !can_chunk {
                    continue;
                }
                wrote_len = true;
                chunked_missing = !last_is_chunked(value.as_bytes());
                if !continuing {
                    framing = ResponseFraming::Chunked(Trailers::None);
                    out.extend_from_slice(b"transfer-encoding: ");
                    open = Some(header::TRANSFER_ENCODING);
                } else {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(value.as_bytes());
                continue;
            }
            header::CONNECTION => {
                if !last {
                    let mut line = Connection::default();
                    line.add(value.as_bytes());
                    last = line.close;
                }
                if !continuing {
                    out.extend_from_slice(b"connection: ");
                    open = Some(header::CONNECTION);
                } else {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(value.as_bytes());
                continue;
            }
            header::DATE => wrote_date = true,
            header::TRAILER => {
                if http10 || !can_chunk {
                    continue;
                }
                if !continuing {
                    out.extend_from_slice(b"trailer: ");
                    open = Some(header::TRAILER);
                } else {
                    out.extend_from_slice(b", ");
                }
                out.extend_from_slice(value.as_bytes());
                if let Ok(s) = value.to_str() {
                    allowed_trailers.get_or_insert_with(Vec::new).extend(
                        s.split(',')
                            .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok()),
                    );
                }
                continue;
            }
            _ => {}
        }
        close_line(out, &mut open, chunked_missing);
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    close_line(out, &mut open, chunked_missing);
    out.extend_from_slice(extra.lines());
    if let Some(value) = added_connection {
        // As the loop writes it, last in the map.
        out.extend_from_slice(b"connection: ");
        out.extend_from_slice(value.as_bytes());
        open = Some(header::CONNECTION);
        close_line(out, &mut open, chunked_missing);
        if value == "close" {
            last = true;
        }
    }
    if !wrote_len {
        framing = match body {
            Some(None) => {
                if http10 || !can_chunk {
                    ResponseFraming::Close
                } else {
                    out.extend_from_slice(b"transfer-encoding: chunked\r\n");
                    ResponseFraming::Chunked(Trailers::None)
                }
            }
            None | Some(Some(0)) => {
                if can_length && !meta.head {
                    out.extend_from_slice(b"content-length: 0\r\n");
                }
                ResponseFraming::Length(0)
            }
            Some(Some(len)) => {
                if can_length {
                    out.extend_from_slice(b"content-length: ");
                    out.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
                    out.extend_from_slice(b"\r\n");
                    ResponseFraming::Length(len)
                } else {
                    ResponseFraming::Length(0)
                }
            }
        };
    }
    if !can_chunk {
        framing = ResponseFraming::Length(0);
    }
    if wrote_date {
        out.extend_from_slice(b"\r\n");
    } else {
        out.extend_from_slice(b"date: ");
        date::extend(out);
        out.extend_from_slice(b"\r\n\r\n");
    }
    if let ResponseFraming::Chunked(t) = &mut framing {
        *t = match allowed_trailers {
            Some(named) => Trailers::Named(named),
            None if parts.extensions.get::<UnannouncedTrailers>().is_some() => Trailers::Any,
            None => Trailers::None,
        };
    }
    if matches!(framing, ResponseFraming::Close) {
        last = true;
    }
    Ok(Encoding { framing, last })
}

/// In a response's extensions: its trailers may come unannounced by a `Trailer`
/// field (it comes from an HTTP/2 upstream), and are passed to a client that
/// accepts trailers all the same, those that may trail.
#[derive(Clone, Copy, Debug)]
pub struct UnannouncedTrailers;

/// A response body that failed when first asked for a frame: nothing of the
/// answer was written (its head was still in the buffer), so the client gets a 502
/// instead of a connection closed on nothing.
#[derive(Debug, thiserror::Error)]
#[error("the response body failed before its head was sent: {0}")]
struct NothingSent(BoxError);

/// Send the head in `out` and the body in its framing. A body frame that is ready
/// at once goes in the same write as what precedes it; the first is always asked
/// for before anything is written (`NothingSent`). A request body still being
/// read (`inflow`) is fed meanwhile: the upstream may answer while it reads.
async fn send_body<IO, G>(
    io: &mut IO,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    body: &mut Guarded<G>,
    framing: ResponseFraming,
    trailers_allowed: bool,
    inflow: Option<&Inflow>,
) -> Result<(), BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    G: OnFail + Send + Sync + Unpin + 'static,
{
    // `remaining`: what a length still needs (`None`: chunked or until close).
    let (mut remaining, allowed, mut chunked) = match framing {
        // Nothing to send: the body is dropped unread, as hyper does.
        ResponseFraming::Length(0) => {
            body.end();
            write_out(io, buf, out, inflow).await?;
            return Ok(());
        }
        ResponseFraming::Length(n) => (Some(n), Trailers::None, false),
        ResponseFraming::Chunked(t) => (None, t, true),
        ResponseFraming::Close => (None, Trailers::None, false),
    };
    let mut ended = body.is_end_stream();
    // The first frame, if it is ready at once: asked for before the head is written.
    let mut first = None;
    if !ended {
        let now = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx)));
        match now.await {
            Poll::Ready(Some(Err(e))) => return Err(NothingSent(e).into()),
            Poll::Ready(f) => first = Some(f.transpose()?),
            Poll::Pending => {}
        }
    }
    while !ended {
        let next = match first.take() {
            Some(f) => f,
            None => next_frame(io, buf, out, body, inflow).await?,
        };
        let Some(frame) = next else {
            break;
        };
        let frame = match frame.into_data() {
            Ok(mut data) => {
                ended = body.is_end_stream();
                if let Some(r) = &mut remaining {
                    data.truncate(usize::try_from(*r).unwrap_or(usize::MAX));
                    *r -= data.len() as u64;
                    // hyper takes nothing more once the length is sent.
                    ended |= *r == 0;
                }
                if !data.is_empty() {
                    put_data(io, buf, out, data, chunked, inflow).await?;
                }
                continue;
            }
            Err(frame) => frame,
        };
        if let Ok(fields) = frame.into_trailers() {
            let passes = |n: &HeaderName| match &allowed {
                Trailers::None => false,
                Trailers::Named(named) => named.contains(n),
                Trailers::Any => true,
            };
            if chunked && trailers_allowed && !matches!(allowed, Trailers::None) {
                let mut lines = Vec::new();
                for (n, v) in fields.iter() {
                    if passes(n) && may_trail(n) {
                        lines.extend_from_slice(n.as_str().as_bytes());
                        lines.extend_from_slice(b": ");
                        lines.extend_from_slice(v.as_bytes());
                        lines.extend_from_slice(b"\r\n");
                    }
                }
                if !lines.is_empty() {
                    out.extend_from_slice(b"0\r\n");
                    out.extend_from_slice(&lines);
                    out.extend_from_slice(b"\r\n");
                    chunked = false;
                }
            }
            break;
        }
    }
    body.end();
    if chunked {
        out.extend_from_slice(b"0\r\n\r\n");
    }
    if !out.is_empty() {
        write_out(io, buf, out, inflow).await?;
    }
    if remaining.is_some_and(|r| r > 0) {
        return Err("the response body ended before its content-length".into());
    }
    Ok(())
}

/// Write `out` whole and empty it, feeding a request body still being read while
/// the client takes its time (it may read only once it has sent its body).
async fn write_out<IO>(
    io: &mut IO,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    inflow: Option<&Inflow>,
) -> Result<(), BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    write_all(io, buf, out, inflow).await?;
    out.clear();
    Ok(())
}

async fn write_all<IO>(
    io: &mut IO,
    buf: &mut BytesMut,
    bytes: &[u8],
    inflow: Option<&Inflow>,
) -> Result<(), BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let Some(inflow) = inflow else {
        io.write_all(bytes).await?;
        return Ok(());
    };
    let mut at = 0;
    std::future::poll_fn(|cx| {
        while at < bytes.len() {
            match Pin::new(&mut *io).poll_write(cx, &bytes[at..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(std::io::Error::from(std::io::ErrorKind::WriteZero)))
                }
                Poll::Ready(Ok(n)) => at += n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => {
                    if let Poll::Ready(Err(e)) = inflow.poll_feed(cx, io, buf) {
                        return Poll::Ready(Err(e));
                    }
                    return Poll::Pending;
                }
            }
        }
        Poll::Ready(Ok(()))
    })
    .await?;
    Ok(())
}

/// Append a data frame to `out` in its framing; a large one is written with what is
/// pending rather than copied.
async fn put_data<IO>(
    io: &mut IO,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    data: Bytes,
    chunked: bool,
    inflow: Option<&Inflow>,
) -> Result<(), BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    if chunked {
        push_hex(out, data.len());
        out.extend_from_slice(b"\r\n");
    }
    if data.len() <= COPY_LIMIT {
        out.extend_from_slice(&data);
    } else {
        write_out(io, buf, out, inflow).await?;
        write_all(io, buf, &data, inflow).await?;
    }
    if chunked {
        out.extend_from_slice(b"\r\n");
    }
    Ok(())
}

/// A chunk size, in upper-case hex as hyper writes it.
fn push_hex(out: &mut Vec<u8>, mut n: usize) {
    let mut digits = [0u8; 16];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b"0123456789ABCDEF"[n & 15];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    out.extend_from_slice(&digits[at..]);
}

/// The body's next frame. What is pending in `out` is written first unless the
/// frame is ready at once (or `out` is large). While waiting, a request body still
/// being read is fed, and a client that closes its end (with nothing more sent)
/// ends the request, as with hyper.
async fn next_frame<IO, B>(
    io: &mut IO,
    buf: &mut BytesMut,
    out: &mut Vec<u8>,
    body: &mut B,
    inflow: Option<&Inflow>,
) -> Result<Option<Frame<Bytes>>, BoxError>
where
    IO: AsyncRead + AsyncWrite + Unpin,
    B: http_body::Body<Data = Bytes, Error = BoxError> + Unpin,
{
    if out.len() < COPY_LIMIT {
        let now = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *body).poll_frame(cx)));
        if let Poll::Ready(f) = now.await {
            return f.transpose();
        }
    }
    if !out.is_empty() {
        write_out(io, buf, out, inflow).await?;
    }
    if let Some(inflow) = inflow {
        let mut watching = true;
        return std::future::poll_fn(|cx| {
            if let Poll::Ready(f) = Pin::new(&mut *body).poll_frame(cx) {
                return Poll::Ready(f.transpose());
            }
            feed_or_watch(cx, inflow, io, buf, &mut watching).map(Err)
        })
        .await;
    }
    let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx));
    if !buf.is_empty() {
        return frame.await.transpose();
    }
    buf.reserve(2048);
    tokio::select! {
        biased;
        f = frame => f.transpose(),
        r = io.read_buf(buf) => match r {
            Ok(0) => Err("the client closed its connection mid-response".into()),
            Err(e) => Err(e.into()),
            Ok(_) => std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx))
                .await
                .transpose(),
        },
    }
}

/// A connection handed on (to a tunnel): the bytes the server had read and not
/// used, then the socket.
pub struct Replay<T> {
    pub head: BytesMut,
    pub io: T,
}

impl<T: AsyncRead + Unpin> AsyncRead for Replay<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.head.is_empty() {
            let n = self.head.len().min(out.remaining());
            out.put_slice(&self.head[..n]);
            self.head.advance(n);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, out)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Replay<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        b: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, b)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The `date` value, formatted once a second per thread (as hyper caches it).
mod date {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};

    struct Cached {
        secs: u64,
        value: [u8; 29],
    }

    thread_local! {
        static CACHED: RefCell<Cached> = const { RefCell::new(Cached { secs: 0, value: [0; 29] }) };
    }

    pub(super) fn extend(out: &mut Vec<u8>) {
        let now = SystemTime::now();
        let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        CACHED.with(|c| {
            let mut c = c.borrow_mut();
            if c.secs != secs || c.value[0] == 0 {
                let s = httpdate::fmt_http_date(now);
                if s.len() == 29 {
                    c.value.copy_from_slice(s.as_bytes());
                    c.secs = secs;
                } else {
                    out.extend_from_slice(s.as_bytes());
                    return;
                }
            }
            out.extend_from_slice(&c.value);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer whose fields came as a map would give them is written with those
    /// lines as they are, the rate-limit lines after them, and no map built (the
    /// map stays empty: the fallback would have put the fields in it).
    #[test]
    fn fields_as_they_came_are_written_as_they_are() {
        let lines = "server: up\r\ndate: Sun, 22 Nov 2026 10:00:00 GMT\r\ncontent-length: 3\r\n";
        let raw = RawFields {
            lines: Bytes::from_static(lines.as_bytes()),
            length: 3,
            date: true,
        };
        let (mut parts, ()) = http::Response::new(()).into_parts();
        let meta = Meta {
            version: Version::HTTP_11,
            keep_alive: true,
            head: false,
            switching: false,
        };
        let mut out = Vec::new();
        let mut extra = AddedFields::default();
        extra.push(crate::http::fields::Added::Policy, |v| {
            v.extend_from_slice(b"5;w=10")
        });
        let enc = encode_head(
            &mut out,
            &mut parts,
            &meta,
            Some(Some(3)),
            &extra,
            Some(raw),
        )
        .expect("encoded");
        assert_eq!(
            String::from_utf8(out).unwrap(),
            format!("HTTP/1.1 200 OK\r\n{lines}ratelimit-policy: 5;w=10\r\n\r\n")
        );
        assert!(matches!(enc.framing, ResponseFraming::Length(3)));
        assert!(!enc.last);
        assert!(parts.headers.is_empty());
    }

    /// A body sluice frames itself is sent with its own length, whatever length
    /// the map states: a stated length shorter than the body would end the answer
    /// early and make its rest the answer to the next pipelined request; a longer
    /// one would take the next answer for body.
    #[test]
    fn a_stated_length_never_differs_from_the_body_framed() {
        for stated in [&["100"][..], &["1"], &["3", "100"], &["x"]] {
            let (mut parts, ()) = http::Response::new(()).into_parts();
            for v in stated {
                parts
                    .headers
                    .append(header::CONTENT_LENGTH, HeaderValue::from_static(v));
            }
            let meta = Meta {
                version: Version::HTTP_11,
                keep_alive: true,
                head: false,
                switching: false,
            };
            let mut out = Vec::new();
            let enc = encode_head(
                &mut out,
                &mut parts,
                &meta,
                Some(Some(3)),
                &AddedFields::default(),
                None,
            )
            .expect("encoded");
            let text = String::from_utf8(out).unwrap();
            let lengths: Vec<&str> = text
                .split("\r\n")
                .filter(|l| l.starts_with("content-length"))
                .collect();
            assert_eq!(lengths, ["content-length: 3"], "{stated:?}");
            assert!(
                matches!(enc.framing, ResponseFraming::Length(3)),
                "{stated:?}"
            );
        }
    }

    /// How often a head arriving one byte at a time is parsed (the parser's
    /// answer, partial until its end, applied), and how many bytes were looked
    /// at for its end in all.
    fn parses_byte_by_byte(head: &[u8]) -> (usize, usize) {
        let mut scan = Scan::default();
        let mut buf = Vec::new();
        let mut parses = 0;
        for &b in head {
            buf.push(b);
            if scan.worth_parsing(&buf) {
                parses += 1;
                scan.partial(&buf);
            }
        }
        (parses, scan.examined)
    }

    #[test]
    fn a_head_sent_byte_by_byte_costs_its_length() {
        // Each byte is looked at a bounded number of times (with the three before
        // it), not once per read after it.
        let mut head = b"GET / HTTP/1.1\r\nhost: h\r\n".to_vec();
        for _ in 0..1000 {
            head.extend_from_slice(b"x-a: b\r\n");
        }
        let (parses, examined) = parses_byte_by_byte(&head);
        assert_eq!(parses, 1);
        assert!(examined <= 4 * head.len(), "{examined} for {}", head.len());
        // Empty lines before a request line are skipped by the parser: none of
        // them can end a head, and a flood of them costs no parse each.
        for flood in [b"\r\n".repeat(16 * 1024), b"\n".repeat(16 * 1024)] {
            assert_eq!(parses_byte_by_byte(&flood), (1, 0));
        }
        let mut head = b"\r\n".repeat(1000);
        head.extend_from_slice(b"GET / HTTP/1.1\r\nhost: h\r\n");
        let (parses, examined) = parses_byte_by_byte(&head);
        assert_eq!(parses, 1);
        assert!(examined <= 4 * head.len(), "{examined} for {}", head.len());
        // The end of the head is found: parsed at its `\r\n\r` and at its last
        // byte (an end may be either), as hyper does.
        head.extend_from_slice(b"\r\n");
        assert_eq!(parses_byte_by_byte(&head).0, 3);
        let mut head = b"GET / HTTP/1.1\nhost: h\n".to_vec();
        head.push(b'\n');
        assert_eq!(parses_byte_by_byte(&head).0, 2);
    }
}
