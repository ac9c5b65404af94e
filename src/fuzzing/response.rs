//! The `response` target: an upstream's bytes, as its answer to a GET or a HEAD, read
//! by sluice's HTTP/1 codec to upstreams (`http::h1::upstream`) and by `rfc_response`, an oracle written
//! from RFC 9112 (httparse splits the heads; every framing rule is the RFC's, written
//! out below). Both must make the same of them.
//!
//! Where sluice refuses more than the RFC asks, or takes a little more, the oracle
//! says so at one place each, marked `EXCEPTION`, with why.

use std::io;
use std::task::{Context, Poll, Waker};

use bytes::BytesMut;
use http::{HeaderMap, Method};

use super::rfc9112::{self, content_length, items, ChunkRules, ChunkedEnd, Fields, Length};
use crate::http::h1::framing::{MAX_FIELDS, MAX_HEAD};
use crate::http::h1::upstream::{parse_head_for, Decoder, Kept, Source};

/// How a response body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLength {
    /// No body (HEAD, 1xx, 204, 304, or `Content-Length: 0`).
    None,
    Length(u64),
    Chunked,
    /// Until the connection closes.
    Close,
}

/// The final head of an answer, as the oracle reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RfcHead {
    pub status: u16,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    pub fields: Fields,
    pub length: BodyLength,
    /// The connection may carry another request after this answer (RFC 9112 §9.3).
    pub persistent: bool,
    /// Where the body starts in the input.
    pub body_at: usize,
}

/// How the body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BodyEnd {
    /// As framed; with the trailer fields of a chunked body.
    Complete(Fields),
    /// Early: the stream closed first, or the chunked framing is malformed; then
    /// `malformed_at` is the index in the input of the byte that shows it, unless it
    /// is in the trailer section.
    Cut { malformed_at: Option<usize> },
}

/// What an HTTP/1.1 client makes of an upstream's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RfcResponse {
    /// No answer to pass on (sluice answers 502).
    Refused(&'static str),
    Answered {
        head: RfcHead,
        body: Vec<u8>,
        end: BodyEnd,
    },
}

// === the target ===

/// An upstream's answer, as bytes: read by sluice's client codec and by the oracle,
/// which must agree on whether there is an answer, its status, version, fields,
/// body length and whether the connection persists, its body and its trailers.
///
/// The first byte chooses: bit 0 a HEAD (else a GET); bit 1 fields as they came
/// (`RawFields`, where the server can take them); bits 2 to 6 the size of the pieces
/// the bytes arrive in, after a first read of them all at once (0: only that). The
/// rest is what the upstream sends before it closes the connection. The second read
/// goes on the same connection state (`Kept`), as a connection's next answer would.
pub fn response(data: &[u8]) {
    let Some((&mode, stream)) = data.split_first() else {
        return;
    };
    let method = if mode & 1 == 1 {
        Method::HEAD
    } else {
        Method::GET
    };
    let raw_ok = mode & 2 == 2;
    let piece = usize::from((mode >> 2) & 0x1f);
    let expected = rfc_response(stream, method == Method::HEAD);
    let mut kept = Kept::default();
    let mut pieces = vec![usize::MAX];
    if piece > 0 {
        pieces.push(piece);
    }
    for piece in pieces {
        let got = sluice_response(stream, &method, raw_ok, piece, &mut kept);
        check(&expected, &got, stream, piece);
    }
}

/// What sluice's codec made of the bytes.
#[derive(Debug)]
pub struct CodecResponse {
    /// The head, or why there is none.
    pub head: Result<RfcHead, String>,
    /// How many bytes had arrived when the head was read.
    pub seen: usize,
    pub body: Vec<u8>,
    /// The body ended as framed (with these trailers), or with this error.
    pub end: Result<Fields, String>,
}

/// Reads the bytes as `client::exchange` reads an answer (parse what has come, else
/// read more), then its body as `h1::pooled::Pooled` does, frame by frame.
fn sluice_response(
    stream: &[u8],
    method: &Method,
    raw_ok: bool,
    piece: usize,
    kept: &mut Kept,
) -> CodecResponse {
    let mut mem = Memory {
        buf: BytesMut::new(),
        rest: stream,
        piece,
        seen: 0,
        extensions: 0,
    };
    let mut cx = Context::from_waker(Waker::noop());
    let refused = |why: String, seen| CodecResponse {
        head: Err(why),
        seen,
        body: Vec::new(),
        end: Ok(Vec::new()),
    };
    let head = loop {
        if !mem.buf.is_empty() {
            match parse_head_for(&mut mem.buf, method, kept, raw_ok) {
                Err(e) => return refused(e.to_string(), mem.seen),
                Ok(Some(head)) => break head,
                Ok(None) => {}
            }
        }
        if let Poll::Ready(Ok(0)) = mem.poll_fill(&mut cx) {
            return refused("closed before a whole head".into(), mem.seen);
        }
    };
    let seen = mem.seen;
    mem.extensions = kept.extensions;

    let mut fields = head.parts.headers.clone();
    if let Some(raw) = &head.raw {
        assert!(fields.is_empty(), "fields both as they came and in the map");
        raw.put_in(&mut fields);
        assert_eq!(
            raw.date,
            fields.contains_key(http::header::DATE),
            "RawFields::date"
        );
        // (On a 204 or 304 the server does not take them as they came.)
        if let Decoder::Length(n) = head.body {
            assert_eq!(n, raw.length, "RawFields::length");
        }
    }
    let length = match head.body {
        Decoder::Done | Decoder::Length(0) => BodyLength::None,
        Decoder::Length(n) => BodyLength::Length(n),
        Decoder::Chunked(_) => BodyLength::Chunked,
        Decoder::Eof => BodyLength::Close,
    };
    let ours = RfcHead {
        status: head.parts.status.as_u16(),
        minor: u8::from(head.parts.version == http::Version::HTTP_11),
        fields: map_fields(&fields),
        length,
        persistent: head.reusable,
        body_at: 0,
    };

    let mut decoder = head.body;
    let mut body = Vec::new();
    let end = loop {
        match decoder.poll_frame_from(&mut mem, &mut cx) {
            Poll::Pending => panic!("bytes in memory are never waited for"),
            Poll::Ready(None) => break Ok(Vec::new()),
            Poll::Ready(Some(Err(e))) => break Err(e.to_string()),
            Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                Ok(data) => body.extend_from_slice(&data),
                Err(frame) => {
                    let trailers = frame.into_trailers().unwrap_or_default();
                    assert!(
                        matches!(
                            decoder.poll_frame_from(&mut mem, &mut cx),
                            Poll::Ready(None)
                        ),
                        "a frame after the trailers"
                    );
                    break Ok(map_fields(&trailers));
                }
            },
        }
    };
    CodecResponse {
        head: Ok(ours),
        seen,
        body,
        end,
    }
}

/// The bytes of an answer, in memory, arriving `piece` at a time.
struct Memory<'a> {
    buf: BytesMut,
    rest: &'a [u8],
    piece: usize,
    /// How many have arrived.
    seen: usize,
    /// The body's chunk extension bytes (as `Kept` counts them on a connection).
    extensions: u64,
}

impl Source for Memory<'_> {
    fn unread(&mut self) -> (&mut BytesMut, &mut u64) {
        (&mut self.buf, &mut self.extensions)
    }

    fn poll_fill(&mut self, _: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let n = self.piece.min(self.rest.len());
        self.buf.extend_from_slice(&self.rest[..n]);
        self.rest = &self.rest[n..];
        self.seen += n;
        Poll::Ready(Ok(n))
    }
}

/// A map's fields in its order (names in the order they first came, each with its
/// values in theirs).
fn map_fields(map: &HeaderMap) -> Fields {
    map.iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// Fields in a map's order: grouped by name, in the order names first came.
fn grouped(fields: &[(String, Vec<u8>)]) -> Fields {
    let mut out: Fields = Vec::with_capacity(fields.len());
    let mut names: Vec<&str> = Vec::new();
    for (name, _) in fields {
        if !names.contains(&name.as_str()) {
            names.push(name);
            out.extend(fields.iter().filter(|(n, _)| n == name).cloned());
        }
    }
    out
}

/// Sluice's reading (`got`, of the bytes arriving `piece` at a time) against the
/// oracle's (`expected`).
pub fn check(expected: &RfcResponse, got: &CodecResponse, stream: &[u8], piece: usize) {
    let show = || {
        format!(
            "\ninput ({} bytes, pieces of {piece}): {:?}\noracle: {expected:?}\nsluice: {got:?}",
            stream.len(),
            String::from_utf8_lossy(stream)
        )
    };
    let (head, body, end) = match expected {
        RfcResponse::Refused(_) => {
            assert!(
                got.head.is_err(),
                "sluice answered, the oracle refused{}",
                show()
            );
            return;
        }
        RfcResponse::Answered { head, body, end } => (head, body, end),
    };
    let ours = match &got.head {
        Ok(ours) => ours,
        // EXCEPTION: malformed chunked framing that came with the head fails the
        // answer (502) rather than cutting its body: nothing has gone to the client
        // yet (`client::check_buffered_chunks`; the trailers are not looked at).
        Err(_) if matches!(end, BodyEnd::Cut { malformed_at: Some(at) } if *at < got.seen) => {
            return
        }
        Err(why) => panic!("sluice refused ({why}), the oracle answered{}", show()),
    };
    let mut fields = grouped(&head.fields);
    // EXCEPTION: a last `Connection` field naming only `keep-alive` is not kept (it
    // says what the connection does, and forwarding takes it out: `client` saves the
    // map insert and removal); what it says still counts.
    let keep_alive_only = |v: &[u8]| {
        v.split(|&b| b == b',').all(|t| {
            let t = t.trim_ascii();
            t.is_empty() || t.eq_ignore_ascii_case(b"keep-alive")
        })
    };
    if let Some((name, value)) = head.fields.last() {
        let connections = head.fields.iter().filter(|(n, _)| n == "connection");
        if name == "connection"
            && keep_alive_only(value)
            && head.status != 101
            && connections.count() == 1
        {
            let at = fields
                .iter()
                .position(|(n, _)| n == "connection")
                .expect("there");
            fields.remove(at);
        }
    }
    let want = RfcHead {
        fields,
        body_at: 0,
        ..head.clone()
    };
    assert_eq!(ours, &want, "heads differ{}", show());
    assert!(
        *body == got.body,
        "bodies differ: {:?} vs {:?}{}",
        String::from_utf8_lossy(body),
        String::from_utf8_lossy(&got.body),
        show()
    );
    match (end, &got.end) {
        (BodyEnd::Complete(trailers), Ok(ours)) => {
            assert_eq!(ours, &grouped(trailers), "trailers differ{}", show())
        }
        (BodyEnd::Cut { malformed_at }, Err(_)) => {
            if let Some(at) = malformed_at {
                assert!(
                    *at >= got.seen,
                    "malformed chunked framing at {at}, in the {} bytes that came with the head, cut the body instead of failing the answer{}",
                    got.seen,
                    show()
                );
            }
        }
        _ => panic!("the bodies end differently{}", show()),
    }
}

// === the oracle ===

/// An upstream's bytes, read as RFC 9112 says a client reads the answer to a GET
/// (or a HEAD, `head_request`) on a connection that closes after them.
pub fn rfc_response(input: &[u8], head_request: bool) -> RfcResponse {
    use RfcResponse::Refused;
    let mut at = 0;
    // Informational (1xx) heads come first, as many as the upstream sends (§4 of RFC
    // 9110 §15.2: a client must be able to parse one or more before the final one).
    let (status, minor, fields) = loop {
        let mut slots = vec![httparse::EMPTY_HEADER; 4 * MAX_FIELDS];
        let mut res = httparse::Response::new(&mut slots);
        let len = match res.parse(&input[at..]) {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) => return Refused("closed within a head"),
            Err(_) => return Refused("malformed head"),
        };
        // EXCEPTION (a limit): a head of more than 64 KiB, or of more than 100
        // fields, is refused (hyper's client and nginx have such limits too).
        if len > MAX_HEAD {
            return Refused("head over 64 KiB");
        }
        if res.headers.len() > MAX_FIELDS {
            return Refused("more than 100 fields");
        }
        let status = res.code.unwrap_or(0);
        // RFC 9110 §15: a status outside 100..=599 is invalid; a client treats
        // 600..=999 as a 5xx (and passes them on as they are), but has nothing to do
        // with one under 100.
        if status < 100 {
            return Refused("status under 100");
        }
        at += len;
        // RFC 9110 §15.2: a 1xx answer is followed by the final one. 101 ends the
        // HTTP exchange on this connection.
        // EXCEPTION: 101 is always final, with no body (`client` has no way to know
        // whether the request asked to upgrade: the gateway checks that).
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        let fields: Fields = res
            .headers
            .iter()
            .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
            .collect();
        break (status, res.version.unwrap_or(0), fields);
    };

    let values = |name: &'static str| {
        fields
            .iter()
            .filter(move |(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    };
    let transfer_encoding = values("transfer-encoding").next().is_some();
    let codings = items(&fields, "transfer-encoding");
    let content_length = content_length(values("content-length"));

    // EXCEPTION: `Transfer-Encoding` and `Content-Length` together are refused,
    // whatever the status (RFC 9112 §6.3 lets Transfer-Encoding win, and calls it a
    // likely smuggling attempt; nginx refuses it too).
    if transfer_encoding && content_length != Length::Absent {
        return Refused("Transfer-Encoding beside Content-Length");
    }
    // EXCEPTION: any transfer coding but one `chunked` is refused, whatever the
    // status (§6.3 would read a body whose last coding is not chunked to the close,
    // and a `gzip` under the chunks would reach the client as if not encoded).
    if transfer_encoding && codings != [b"chunked".to_vec()] {
        return Refused("a transfer coding other than one chunked");
    }
    // RFC 9112 §6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing
    // (and the connection must close after it).
    if transfer_encoding && minor == 0 {
        return Refused("Transfer-Encoding in HTTP/1.0");
    }
    // RFC 9112 §6.3, in its order.
    let length = if head_request || matches!(status, 101 | 204 | 304) {
        BodyLength::None
    } else if transfer_encoding {
        BodyLength::Chunked
    } else {
        match content_length {
            Length::Invalid => return Refused("invalid Content-Length"),
            Length::Valid(0) => BodyLength::None,
            Length::Valid(n) => BodyLength::Length(n),
            Length::Absent => BodyLength::Close,
        }
    };
    // RFC 9112 §9.3: HTTP/1.1 persists unless `close`; HTTP/1.0 only with
    // `keep-alive`; a body that ends with the connection ends it; after 101 the
    // connection is no longer HTTP's.
    let options = items(&fields, "connection");
    let persistent = !options.iter().any(|o| o == b"close")
        && (minor == 1 || options.iter().any(|o| o == b"keep-alive"))
        && length != BodyLength::Close
        && status != 101;
    let head = RfcHead {
        status,
        minor,
        fields,
        length,
        persistent,
        body_at: at,
    };

    let rest = &input[at..];
    let (body, end) = match length {
        BodyLength::None => (Vec::new(), BodyEnd::Complete(Vec::new())),
        BodyLength::Close => (rest.to_vec(), BodyEnd::Complete(Vec::new())),
        BodyLength::Length(n) => {
            let have = usize::try_from(n).map_or(rest.len(), |n| n.min(rest.len()));
            let end = if (have as u64) < n {
                BodyEnd::Cut { malformed_at: None }
            } else {
                BodyEnd::Complete(Vec::new())
            };
            (rest[..have].to_vec(), end)
        }
        BodyLength::Chunked => {
            let rules = ChunkRules {
                strict_extensions: false,
                max_trailers: MAX_HEAD,
                max_trailer_fields: MAX_FIELDS,
            };
            let (body, end) = rfc9112::chunked(input, at, &rules);
            let end = match end {
                ChunkedEnd::Complete { trailers, .. } => BodyEnd::Complete(trailers),
                ChunkedEnd::Unfinished => BodyEnd::Cut { malformed_at: None },
                ChunkedEnd::Malformed(at) => BodyEnd::Cut { malformed_at: at },
            };
            (body, end)
        }
    };
    RfcResponse::Answered { head, body, end }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(input: &str, head: bool) -> (RfcHead, String, BodyEnd) {
        match rfc_response(input.as_bytes(), head) {
            RfcResponse::Answered { head, body, end } => {
                (head, String::from_utf8(body).unwrap(), end)
            }
            r => panic!("{input:?}: {r:?}"),
        }
    }

    #[test]
    fn the_oracle_reads_as_rfc_9112_says() {
        let (h, body, end) = answered(
            "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: b\r\n\r\n5;a=\"q\"\r\nhello\r\n0\r\nT: v\r\n\r\n",
            false,
        );
        assert_eq!(h.status, 200);
        assert_eq!(h.length, BodyLength::Chunked);
        assert_eq!(body, "hello");
        assert_eq!(end, BodyEnd::Complete(vec![("t".into(), b"v".to_vec())]));
        let (h, body, _) = answered("HTTP/1.0 200 OK\r\n\r\nto the end", false);
        assert_eq!(
            (h.length, h.persistent, body.as_str()),
            (BodyLength::Close, false, "to the end")
        );
        let (h, body, _) = answered(
            "HTTP/1.1 200 OK\r\ncontent-length: 3, 3\r\n\r\nabcdef",
            false,
        );
        assert_eq!(
            (h.length, h.persistent, body.as_str()),
            (BodyLength::Length(3), true, "abc")
        );
        let (h, body, _) = answered("HTTP/1.1 200 OK\r\ncontent-length: x\r\n\r\nabc", true);
        assert_eq!((h.length, body.as_str()), (BodyLength::None, ""));
        let input = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhelloX";
        let (_, body, end) = answered(input, false);
        let x = input.find('X');
        assert_eq!(
            (body.as_str(), end),
            ("hello", BodyEnd::Cut { malformed_at: x })
        );
        for refused in [
            "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: +3\r\n\r\n",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            "HTTP/1.1 204 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 0\r\n\r\n",
            "HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
            "HTTP/1.1 099 Odd\r\n\r\n",
            "HTTP/1.1 100 Continue\r\n\r\n",
        ] {
            assert!(
                matches!(
                    rfc_response(refused.as_bytes(), false),
                    RfcResponse::Refused(_)
                ),
                "{refused:?}"
            );
        }
    }

    #[test]
    fn readable_inputs() {
        response(b"@HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n");
        response(b"AHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n");
        response(b"BHTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: keep-alive\r\n\r\nhello");
    }
}
