//! The oracle of the `request` target, for the server's HTTP/1 codec: a client's
//! bytes read as RFC 9112 says a server reads a request (§3 request line, §5 fields,
//! §6 body length), with sluice's limits as parameters; and `check_request`, which
//! holds a codec's reading (`CodecRequest`) to it; `request`, the target, reads the
//! same bytes with the server's codec (`h1::server::read_requests`). Where the codec
//! deliberately reads as hyper's server rather than as the RFC, the rules say so at
//! one place each, marked `EXCEPTION`, with why.

use super::rfc9112::{self, items, ChunkRules, ChunkedEnd, Fields};

/// A server's limits on a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    /// The largest head (request line, fields and the empty line after them); a
    /// larger one is refused with 431. Also the largest trailer section.
    pub max_head: usize,
    /// The most fields a head (or a trailer section) may have; more is 431.
    pub max_fields: usize,
    /// Chunk extensions read as RFC 9112 §7.1.1 writes them; else anything up to
    /// the CRLF but a CR or LF (as hyper and nginx read them).
    pub strict_extensions: bool,
}

impl Default for RequestLimits {
    /// sluice's defaults: `server.max_header_bytes` (32 KiB) and `h1::MAX_FIELDS`.
    fn default() -> Self {
        RequestLimits {
            max_head: 32 * 1024,
            max_fields: crate::http::h1::framing::MAX_FIELDS,
            strict_extensions: false,
        }
    }
}

/// How a request's body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// No body: neither `Content-Length` nor `Transfer-Encoding` (rule 7).
    None,
    Length(u64),
    Chunked,
}

/// A request head the oracle accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
    /// As they came: names lowercased, values as bytes (without the white space
    /// around them).
    pub fields: Fields,
    pub framing: Framing,
    /// The head's length in the input (leading empty lines included).
    pub head_len: usize,
    /// The connection may carry another request after this one (RFC 9112 §9.3).
    pub persistent: bool,
    /// After this request the connection may stop being HTTP: a CONNECT, or an
    /// `Upgrade` the `Connection` field names (what follows is the server's choice).
    pub may_switch: bool,
}

/// A request's body, as far as the input goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestBody {
    /// Whole: its data, its trailer fields (chunked only), and where the next
    /// request starts in the input.
    Complete {
        data: Vec<u8>,
        trailers: Fields,
        end: usize,
    },
    /// The input ends within it: the data so far.
    Incomplete { data: Vec<u8> },
    /// Its chunked framing is malformed (a 400 if nothing was answered yet): the
    /// data before, and the index in the input of the byte that shows it (`None`: in
    /// the trailer section).
    Malformed { data: Vec<u8>, at: Option<usize> },
}

/// What a server makes of a client's bytes, as far as the first request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RfcRequest {
    /// The head is not whole yet (nor over the limit): wait for more.
    Incomplete,
    /// Refused with this status, before any of it is passed on.
    Refused { status: u16, why: &'static str },
    Accepted {
        head: RequestHead,
        body: RequestBody,
    },
}

/// The first request in `input`, read as RFC 9112 says a server reads it, within
/// `limits`.
pub fn rfc_request(input: &[u8], limits: &RequestLimits) -> RfcRequest {
    let refused = |status, why| RfcRequest::Refused { status, why };
    // As many slots as fields are allowed: one more is 431 as soon as it comes,
    // whether or not the head is whole yet.
    let mut slots = vec![httparse::EMPTY_HEADER; limits.max_fields];
    let mut req = httparse::Request::new(&mut slots);
    // httparse: §2.2's leniencies (empty lines before the request line are skipped,
    // a bare LF ends a line), nothing more (no obs-fold, no white space before a
    // field's colon, no bare CR: each is a 400, as §5.1, §5.2 and §2.2 allow).
    let head_len = match req.parse(input) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if input.len() >= limits.max_head => {
            return refused(431, "no end of the head within the limit")
        }
        Ok(httparse::Status::Partial) => return RfcRequest::Incomplete,
        Err(httparse::Error::TooManyHeaders) => return refused(431, "too many fields"),
        Err(_) => return refused(400, "malformed head"),
    };
    if head_len > limits.max_head {
        return refused(431, "head over the limit");
    }
    if req.headers.len() > limits.max_fields {
        return refused(431, "too many fields");
    }
    let method = req.method.unwrap_or_default().to_owned();
    let target = req.path.unwrap_or_default().to_owned();
    let minor = req.version.unwrap_or(1);
    let mut fields: Fields = req
        .headers
        .iter()
        .map(|h| (h.name.to_ascii_lowercase(), h.value.to_vec()))
        .collect();

    // EXCEPTION: the target's form and Host are the request path's to check
    // (`pipeline::admit`), as hyper leaves them to its service; the codec checks only
    // that the target is a URI (as `http::Uri` reads it, and writes it: a fragment
    // dropped, an absolute-form path of `/` made explicit).
    // EXCEPTION: bytes nginx forwards but `http::Uri` refuses (`<`, `>` and a
    // backtick in the path; `"`, `<` and `>` in the query) are percent-encoded, as
    // browsers send them.
    let target = target.parse::<http::Uri>().or_else(|e| {
        let (path, query) = match target.split_once('?') {
            Some((p, q)) => (p, Some(q)),
            None => (target.as_str(), None),
        };
        let encode = |part: &str, refused: &str| -> String {
            part.chars()
                .map(|c| match refused.contains(c) {
                    true => format!("%{:02X}", c as u32),
                    false => c.to_string(),
                })
                .collect()
        };
        let mut encoded = encode(path, "<>`");
        if let Some(q) = query {
            encoded.push('?');
            encoded.push_str(&encode(q, "\"<>"));
        }
        if encoded == target {
            return Err(e);
        }
        encoded.parse::<http::Uri>()
    });
    let Ok(target) = target.map(|u| u.to_string()) else {
        return refused(400, "request target not a URI");
    };
    // EXCEPTION: framing as hyper's server reads it. A `Content-Length` is one number
    // a line (no lists), its lines equal, checked until a `Transfer-Encoding` comes;
    // `Transfer-Encoding` wins over it (§6.1's MAY refuse not taken: the length is
    // dropped and the connection closes after the answer); chunked is the last
    // item of the last `Transfer-Encoding` line (empty items count, `chunked` twice
    // is not refused, a line that is not UTF-8 names no coding).
    let mut length: Option<u64> = None;
    let mut transfer_encoding = false;
    let mut chunked = false;
    // Items of every `Transfer-Encoding` line.
    let mut codings = 0;
    let mut saw_length = false;
    for (name, value) in &fields {
        if name == "content-length" {
            saw_length = true;
            if transfer_encoding {
                continue;
            }
            let n = (!value.is_empty() && value.iter().all(u8::is_ascii_digit))
                .then(|| std::str::from_utf8(value).ok()?.parse::<u64>().ok())
                .flatten()
                // (A limit: hyper's largest length.)
                .filter(|n| *n <= u64::MAX - 2);
            match n {
                Some(n) if length.is_none_or(|l| l == n) => length = Some(n),
                _ => return refused(400, "invalid Content-Length"),
            }
        } else if name == "transfer-encoding" {
            // §6.1: Transfer-Encoding in HTTP/1.0 is faulty framing.
            if minor == 0 {
                return refused(400, "Transfer-Encoding in HTTP/1.0");
            }
            transfer_encoding = true;
            codings += value.split(|&b| b == b',').count();
            let last = value.rsplit(|&b| b == b',').next().unwrap_or_default();
            chunked = std::str::from_utf8(value).is_ok()
                && last.trim_ascii().eq_ignore_ascii_case(b"chunked");
        }
    }
    let framing = if transfer_encoding {
        // §6.3 rule 4: unless chunked is the last coding, the length cannot be known.
        if !chunked {
            return refused(400, "chunked is not the last transfer coding");
        }
        // §6.1: a coding the server does not understand (anything but the one
        // final `chunked`) is answered 501, as nginx does.
        if codings > 1 {
            return refused(501, "a transfer coding other than chunked");
        }
        fields.retain(|(n, _)| n != "content-length");
        Framing::Chunked
    } else {
        match length {
            // EXCEPTION: a length of 0 is no body, as the codec frames it.
            Some(0) | None => Framing::None,
            Some(n) => Framing::Length(n),
        }
    };

    // §9.3: HTTP/1.1 persists unless `close`; HTTP/1.0 with `keep-alive` only.
    // EXCEPTION: a `Connection` line with a byte other than visible ASCII or a tab
    // names no option (hyper reads the value as a string, or not at all).
    let visible: Fields = fields
        .iter()
        .filter(|(_, v)| v.iter().all(|&b| b == b'\t' || (32..127).contains(&b)))
        .cloned()
        .collect();
    let options = items(&visible, "connection");
    let persistent = !options.iter().any(|o| o == b"close")
        && (minor == 1 || options.iter().any(|o| o == b"keep-alive"))
        && !(transfer_encoding && saw_length);
    // EXCEPTION: any `Upgrade` field in HTTP/1.1 may switch, named by `Connection`
    // or not (hyper's server; the upgrade's answer decides).
    let upgrade = minor == 1 && fields.iter().any(|(n, _)| n == "upgrade");
    let head = RequestHead {
        may_switch: method == "CONNECT" || upgrade,
        method,
        target,
        minor,
        fields,
        framing,
        head_len,
        persistent,
    };

    let rest = &input[head_len..];
    let body = match framing {
        Framing::None => RequestBody::Complete {
            data: Vec::new(),
            trailers: Vec::new(),
            end: head_len,
        },
        Framing::Length(n) => match usize::try_from(n) {
            Ok(n) if n <= rest.len() => RequestBody::Complete {
                data: rest[..n].to_vec(),
                trailers: Vec::new(),
                end: head_len + n,
            },
            _ => RequestBody::Incomplete {
                data: rest.to_vec(),
            },
        },
        Framing::Chunked => {
            let rules = ChunkRules {
                strict_extensions: limits.strict_extensions,
                max_trailers: limits.max_head,
                max_trailer_fields: limits.max_fields,
            };
            match rfc9112::chunked(input, head_len, &rules) {
                (data, ChunkedEnd::Complete { trailers, end }) => RequestBody::Complete {
                    data,
                    trailers,
                    end,
                },
                (data, ChunkedEnd::Unfinished) => RequestBody::Incomplete { data },
                (data, ChunkedEnd::Malformed(at)) => RequestBody::Malformed { data, at },
            }
        }
    };
    RfcRequest::Accepted { head, body }
}

/// Every request in `input`, one after the other, as a server reads a connection:
/// up to the first that is not accepted whole, that ends the connection (not
/// persistent), or after which it may stop being HTTP.
pub fn rfc_requests(input: &[u8], limits: &RequestLimits) -> Vec<RfcRequest> {
    let mut out = Vec::new();
    let mut at = 0;
    loop {
        let request = rfc_request(&input[at..], limits);
        let next = match &request {
            RfcRequest::Accepted {
                head,
                body: RequestBody::Complete { end, .. },
            } if head.persistent && !head.may_switch && at + end < input.len() => Some(at + end),
            _ => None,
        };
        out.push(request);
        match next {
            Some(n) => at = n,
            None => return out,
        }
    }
}

/// The `request` target: a client's bytes read by the server's codec
/// (`h1::server::read_requests`, with the gateway's default limits) and held, request
/// by request, to `rfc_requests`.
pub fn request(data: &[u8]) {
    use crate::http::h1::server::{read_requests, BodyEnd, Read, RequestFraming};
    let limits = RequestLimits::default();
    let fields = |map: &http::HeaderMap| -> Fields {
        map.iter()
            .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
            .collect()
    };
    let got: Vec<CodecRequest> = read_requests(data, limits.max_head)
        .into_iter()
        .map(|read| match read {
            Read::Incomplete => CodecRequest::Incomplete,
            Read::Refused(status) => CodecRequest::Refused(status.as_u16()),
            Read::Request {
                parts,
                framed,
                data,
                trailers,
                end,
            } => CodecRequest::Accepted {
                method: parts.method.as_str().to_owned(),
                target: parts.uri.to_string(),
                minor: u8::from(parts.version == http::Version::HTTP_11),
                fields: fields(&parts.headers),
                framing: match framed {
                    RequestFraming::None => Framing::None,
                    RequestFraming::Length(n) => Framing::Length(n),
                    RequestFraming::Chunked => Framing::Chunked,
                },
                body: match end {
                    BodyEnd::Whole => CodecBody::Complete {
                        data,
                        trailers: trailers.as_ref().map(fields).unwrap_or_default(),
                    },
                    BodyEnd::Cut => CodecBody::Incomplete { data },
                    BodyEnd::Malformed => CodecBody::Malformed { data },
                },
            },
        })
        .collect();
    check_requests(data, &limits, &got);
}

// === the comparison ===

/// What a server codec made of a request: filled in by whatever drives the codec
/// over the same bytes (the one missing piece of the `request` target).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodecRequest {
    /// It waited for more bytes: no whole head when the input ended.
    Incomplete,
    /// It answered this status without passing the request on.
    Refused(u16),
    Accepted {
        method: String,
        target: String,
        /// 0 for HTTP/1.0, 1 for HTTP/1.1.
        minor: u8,
        /// Names lowercased, values as bytes, each name's values in the order they
        /// came (the order of different names is not compared).
        fields: Fields,
        framing: Framing,
        body: CodecBody,
    },
}

/// How a codec's reading of a request body ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CodecBody {
    /// The whole body, and its trailers.
    Complete { data: Vec<u8>, trailers: Fields },
    /// The input ended within it; the data read so far.
    Incomplete { data: Vec<u8> },
    /// It refused the framing part way (a 400, or a cut body); the data read so far.
    Malformed { data: Vec<u8> },
}

/// Holds a codec's reading of `input` (`got`) to the oracle's; panics, showing both,
/// where they differ. A codec may answer 400 to a request whose chunked framing is
/// malformed, rather than pass on the head and cut the body (it had not passed the
/// request on yet).
pub fn check_request(input: &[u8], limits: &RequestLimits, got: &CodecRequest) {
    let expected = rfc_request(input, limits);
    let show = || {
        format!(
            "\ninput ({} bytes): {:?}\noracle: {expected:?}\ncodec: {got:?}",
            input.len(),
            String::from_utf8_lossy(input)
        )
    };
    match (&expected, got) {
        (RfcRequest::Incomplete, CodecRequest::Incomplete) => {}
        (RfcRequest::Refused { status, .. }, CodecRequest::Refused(ours)) => {
            assert_eq!(status, ours, "refused with another status{}", show())
        }
        (
            RfcRequest::Accepted {
                body: RequestBody::Malformed { .. },
                ..
            },
            CodecRequest::Refused(400),
        ) => {}
        // RFC 9112 §6.1: a server should answer 501 to a transfer coding it does not
        // know (any but chunked, here), rather than pass it on.
        (RfcRequest::Accepted { head, .. }, CodecRequest::Refused(501))
            if items(&head.fields, "transfer-encoding")
                .iter()
                .any(|c| c.as_slice() != b"chunked") => {}
        (
            RfcRequest::Accepted { head, body },
            CodecRequest::Accepted {
                method,
                target,
                minor,
                fields,
                framing,
                body: ours,
            },
        ) => {
            assert_eq!(
                (&head.method, &head.target, head.minor),
                (method, target, *minor),
                "request lines differ{}",
                show()
            );
            assert_eq!(
                in_map_order(&head.fields),
                in_map_order(fields),
                "fields differ{}",
                show()
            );
            assert_eq!(head.framing, *framing, "framing differs{}", show());
            match (body, ours) {
                (
                    RequestBody::Complete { data, trailers, .. },
                    CodecBody::Complete {
                        data: d,
                        trailers: t,
                    },
                ) => {
                    assert!(data == d, "bodies differ{}", show());
                    assert_eq!(
                        in_map_order(trailers),
                        in_map_order(t),
                        "trailers{}",
                        show()
                    );
                }
                (RequestBody::Incomplete { data }, CodecBody::Incomplete { data: d })
                | (RequestBody::Malformed { data, .. }, CodecBody::Malformed { data: d }) => {
                    assert!(data == d, "bodies so far differ{}", show());
                }
                _ => panic!("the bodies end differently{}", show()),
            }
        }
        _ => panic!("the codec and the oracle disagree{}", show()),
    }
}

/// `check_request` over a connection: the codec's readings of the requests in
/// `input`, one after the other (as `rfc_requests` splits them: each starts where
/// the one before ended), held to the oracle's, and as many of them.
pub fn check_requests(input: &[u8], limits: &RequestLimits, got: &[CodecRequest]) {
    let expected = rfc_requests(input, limits);
    assert_eq!(
        expected.len(),
        got.len(),
        "the codec read {} requests, the oracle {}\ninput: {:?}\noracle: {expected:?}\ncodec: {got:?}",
        got.len(),
        expected.len(),
        String::from_utf8_lossy(input)
    );
    let mut at = 0;
    for (request, ours) in expected.iter().zip(got) {
        check_request(&input[at..], limits, ours);
        if let RfcRequest::Accepted {
            body: RequestBody::Complete { end, .. },
            ..
        } = request
        {
            at += end;
        }
    }
}

/// Fields as RFC 9110 §5.3 compares them: each name's values in their order; the
/// order of different names is not significant (a map's removal reorders them).
fn in_map_order(fields: &Fields) -> Fields {
    let mut out = fields.clone();
    // Stable: each name's values stay in their order.
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What the oracle says of one input: refused (its status), incomplete, or the
    /// framing and the body when whole.
    fn read(input: &str) -> String {
        match rfc_request(input.as_bytes(), &RequestLimits::default()) {
            RfcRequest::Incomplete => "incomplete".into(),
            RfcRequest::Refused { status, .. } => status.to_string(),
            RfcRequest::Accepted { head, body } => {
                let body = match body {
                    RequestBody::Complete { data, trailers, .. } => format!(
                        "{:?}{}",
                        String::from_utf8_lossy(&data),
                        trailers
                            .iter()
                            .map(|(n, v)| format!(" {n}={}", String::from_utf8_lossy(v)))
                            .collect::<String>()
                    ),
                    RequestBody::Incomplete { data } => {
                        format!("incomplete {:?}", String::from_utf8_lossy(&data))
                    }
                    RequestBody::Malformed { data, at } => {
                        format!("malformed at {at:?} {:?}", String::from_utf8_lossy(&data))
                    }
                };
                format!("{:?} {body}", head.framing)
            }
        }
    }

    #[test]
    fn tricky_requests() {
        let cases: &[(&str, &str)] = &[
            ("GET / HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            // §2.2: a server may take a bare LF as a line's end, and skip empty lines
            // before the request line.
            ("GET / HTTP/1.1\nHost: a\n\n", "None \"\""),
            ("\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            // §5.2: obs-fold in a request is refused (or replaced, which sluice does not).
            ("GET / HTTP/1.1\r\nHost: a\r\nX: a\r\n b\r\n\r\n", "400"),
            // §5.1: white space between a field name and its colon is a 400.
            ("GET / HTTP/1.1\r\nHost : a\r\n\r\n", "400"),
            // §2.2: a bare CR is invalid.
            ("GET / HTTP/1.1\r\nHost: a\rb\r\n\r\n", "400"),
            ("GET / HTTP/1.1\r\nHost: a\r\n", "incomplete"),
            // Host and the target's form are `admit`'s (EXCEPTION).
            ("GET / HTTP/1.1\r\n\r\n", "None \"\""),
            ("GET / HTTP/1.0\r\n\r\n", "None \"\""),
            ("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", "None \"\""),
            ("GET * HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            ("OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            ("CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n", "None \"\""),
            ("CONNECT /a HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            ("GET a|b HTTP/1.1\r\nHost: a\r\n\r\n", "400"),
            ("GET http://a/b HTTP/1.1\r\nHost: a\r\n\r\n", "None \"\""),
            ("GET / HTTP/2.0\r\nHost: a\r\n\r\n", "400"),
            // §6.3 rule 5: a list of one length repeated may be taken as it: not by
            // hyper's server (EXCEPTION), lines repeated only.
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello", "400"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello", "Length(5) \"hello\""),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 6\r\n\r\nhello", "400"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello", "400"),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhel", "Length(5) incomplete \"hel\""),
            // §6.3 rule 4: chunked must be the last coding; §6.1: any other coding
            // is one sluice does not implement (501, as nginx).
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n", "400"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n", "501"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n", "501"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "501"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \r\n\r\n", "400"),
            // §6.1: Transfer-Encoding in HTTP/1.0 is refused; beside Content-Length it
            // wins (EXCEPTION), unless a length before it is invalid.
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n", "Chunked incomplete \"\""),
            ("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: x\r\nTransfer-Encoding: chunked\r\n\r\n", "400"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: x\r\n\r\n", "Chunked incomplete \"\""),
            ("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "400"),
            // §7.1: extensions (a quoted string with an escaped quote and a `;`),
            // trailers.
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5;a=\"x\\\";y\"\r\nhello\r\n0\r\nX-T: 1\r\n\r\n", "Chunked \"hello\" x-t=1"),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello", "Chunked incomplete \"hello\""),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloX", "Chunked malformed at Some(64) \"hello\""),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\nhello\r\n0\r\n\r\n", "Chunked malformed at Some(57) \"\""),
            ("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-T: a\r\n b\r\n\r\n", "Chunked malformed at None \"\""),
        ];
        let mut wrong = Vec::new();
        for (input, want) in cases {
            let got = read(input);
            if got != *want {
                wrong.push(format!("{input:?}: {got}, not {want}"));
            }
        }
        assert!(wrong.is_empty(), "\n{}", wrong.join("\n"));
    }

    #[test]
    fn limits_and_strict_extensions() {
        let tight = RequestLimits {
            max_head: 40,
            max_fields: 2,
            strict_extensions: true,
        };
        let read = |input: &str| rfc_request(input.as_bytes(), &tight);
        assert!(matches!(
            read("GET / HTTP/1.1\r\nHost: a\r\nX: b\r\nY: c\r\n\r\n"),
            RfcRequest::Refused { status: 431, .. }
        ));
        assert!(matches!(
            read("GET / HTTP/1.1\r\nHost: aaaaaaaaaaaaaaaaaaaaaaaaa"),
            RfcRequest::Refused { status: 431, .. }
        ));
        // A field past the limit is 431 before the head is whole.
        assert!(matches!(
            read("GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\nC: 3\r\n"),
            RfcRequest::Refused { status: 431, .. }
        ));
        assert_eq!(
            read("GET / HTTP/1.1\r\nA: 1\r\nB: 2\r\n"),
            RfcRequest::Incomplete
        );
        let ext = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0;a b\r\n\r\n";
        let limits = RequestLimits {
            strict_extensions: true,
            ..RequestLimits::default()
        };
        assert!(matches!(
            rfc_request(ext.as_bytes(), &limits),
            RfcRequest::Accepted {
                body: RequestBody::Malformed { .. },
                ..
            }
        ));
        assert!(matches!(
            rfc_request(ext.as_bytes(), &RequestLimits::default()),
            RfcRequest::Accepted {
                body: RequestBody::Complete { .. },
                ..
            }
        ));
    }

    #[test]
    fn pipelined_requests_stop_where_the_connection_does() {
        let two = "GET /a HTTP/1.1\r\nHost: a\r\n\r\nPOST /b HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\nokGET /c HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGET /d HTTP/1.1\r\n";
        let got = rfc_requests(two.as_bytes(), &RequestLimits::default());
        let targets: Vec<_> = got
            .iter()
            .map(|r| match r {
                RfcRequest::Accepted { head, .. } => head.target.as_str(),
                _ => "-",
            })
            .collect();
        assert_eq!(targets, ["/a", "/b", "/c"]);
    }

    #[test]
    fn a_codec_that_reads_as_the_oracle_passes() {
        let input =
            b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n";
        let limits = RequestLimits::default();
        check_request(
            input,
            &limits,
            &CodecRequest::Accepted {
                method: "POST".into(),
                target: "/".into(),
                minor: 1,
                fields: vec![
                    ("host".into(), b"a".to_vec()),
                    ("transfer-encoding".into(), b"chunked".to_vec()),
                ],
                framing: Framing::Chunked,
                body: CodecBody::Complete {
                    data: b"ok".to_vec(),
                    trailers: Vec::new(),
                },
            },
        );
        let differs = std::panic::catch_unwind(|| {
            check_request(input, &limits, &CodecRequest::Refused(400));
        });
        assert!(differs.is_err());
        let two = b"GET /a HTTP/1.1\r\nHost: a\r\n\r\nGET /b HTTP/1.1\r\nHost";
        let first = CodecRequest::Accepted {
            method: "GET".into(),
            target: "/a".into(),
            minor: 1,
            fields: vec![("host".into(), b"a".to_vec())],
            framing: Framing::None,
            body: CodecBody::Complete {
                data: Vec::new(),
                trailers: Vec::new(),
            },
        };
        check_requests(two, &limits, &[first.clone(), CodecRequest::Incomplete]);
        let short =
            std::panic::catch_unwind(|| check_requests(two, &limits, std::slice::from_ref(&first)));
        assert!(short.is_err());
    }
}
