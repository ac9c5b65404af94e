//! The HTTP/1 head scanner both codecs read with: a request head (`request`, for
//! `h1::server`) or a response head (`response`, for `h1::upstream`) where it lies
//! in the buffer, its parts given back as offsets into it. It takes and refuses
//! exactly what httparse 1.10 does with its default configuration (the tests below
//! hold it to that, byte for byte), in fewer instructions: one pass, the bytes of
//! values and targets looked at eight at a time.

use std::ops::Range;

use super::framing::MAX_FIELDS;

/// Why a head was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadError {
    /// More than `MAX_FIELDS` fields (the one past it read whole first, as
    /// httparse does).
    TooManyFields,
    /// Anything else: a byte where the grammar has no place for it.
    Malformed,
}

/// What a step found: `Ok(None)` when the buffer ends before it could tell.
type Step<T> = Result<Option<T>, HeadError>;

/// A request head: its length and its request line's parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RequestHead {
    /// The head's bytes, the empty line ending it included.
    pub len: usize,
    pub method: Range<usize>,
    /// The request target: valid UTF-8.
    pub target: Range<usize>,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor: u8,
}

/// A response head: its length and its status line's parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ResponseHead {
    pub len: usize,
    pub minor: u8,
    /// Three digits, any of them (100 to 999 is the caller's business).
    pub code: u16,
    /// The reason phrase, ASCII only: empty when there is none or it has bytes
    /// past ASCII (httparse's `""`).
    pub reason: Range<usize>,
}

/// The request head at the start of `buf`, its fields' `[name_start, name_end,
/// value_start, value_end]` in `fields` (emptied first); `Ok(None)` while it may
/// still come whole. (Not inlined: the codec's functions around it stay as small
/// as they were around httparse's call, and are inlined as they were.)
#[inline(never)]
pub(crate) fn request(buf: &[u8], fields: &mut Vec<[usize; 4]>) -> Step<RequestHead> {
    fields.clear();
    let Some(at) = skip_empty_lines(buf)? else {
        return Ok(None);
    };
    let Some(method) = method(buf, at)? else {
        return Ok(None);
    };
    let Some(target) = target(buf, method.end + 1)? else {
        return Ok(None);
    };
    let Some(minor) = version(buf, target.end + 1)? else {
        return Ok(None);
    };
    let Some(at) = line_end(buf, target.end + 9)? else {
        return Ok(None);
    };
    let Some(len) = field_lines(buf, at, fields)? else {
        return Ok(None);
    };
    Ok(Some(RequestHead {
        len,
        method,
        target,
        minor,
    }))
}

/// The response head at the start of `buf`, as `request` reads a request's.
#[inline(never)]
pub(crate) fn response(buf: &[u8], fields: &mut Vec<[usize; 4]>) -> Step<ResponseHead> {
    fields.clear();
    let Some(at) = skip_empty_lines(buf)? else {
        return Ok(None);
    };
    let Some(minor) = version(buf, at)? else {
        return Ok(None);
    };
    let mut code = 0u16;
    // ` ` after the version, then three digits.
    let Some(&sp) = buf.get(at + 8) else {
        return Ok(None);
    };
    if sp != b' ' {
        return Err(HeadError::Malformed);
    }
    for at in at + 9..at + 12 {
        match buf.get(at) {
            None => return Ok(None),
            Some(&d @ b'0'..=b'9') => code = code * 10 + u16::from(d - b'0'),
            Some(_) => return Err(HeadError::Malformed),
        }
    }
    // Then ` ` and a reason, or the line's end.
    let at = at + 12;
    let (reason, at) = match buf.get(at) {
        None => return Ok(None),
        Some(b' ') => {
            let start = at + 1;
            let end = value_run(buf, start);
            let Some(next) = line_end(buf, end)? else {
                return Ok(None);
            };
            // (Most often two or three bytes: no call to `is_ascii`.)
            if buf[start..end].iter().all(|&b| b < 0x80) {
                (start..end, next)
            } else {
                (start..start, next)
            }
        }
        Some(b'\r' | b'\n') => {
            let Some(next) = line_end(buf, at)? else {
                return Ok(None);
            };
            (at..at, next)
        }
        Some(_) => return Err(HeadError::Malformed),
    };
    let Some(len) = field_lines(buf, at, fields)? else {
        return Ok(None);
    };
    Ok(Some(ResponseHead {
        len,
        minor,
        code,
        reason,
    }))
}

// === the pieces ===

/// Where the first line starts: empty lines (`\r\n` or `\n`) before it are
/// skipped.
fn skip_empty_lines(buf: &[u8]) -> Step<usize> {
    let mut at = 0;
    loop {
        match buf.get(at) {
            Some(b'\r' | b'\n') => match line_end(buf, at)? {
                Some(next) => at = next,
                None => return Ok(None),
            },
            Some(_) => return Ok(Some(at)),
            None => return Ok(None),
        }
    }
}

/// Past the line end at `at`: `\r\n` or a bare `\n`.
fn line_end(buf: &[u8], at: usize) -> Step<usize> {
    match buf.get(at) {
        Some(b'\n') => Ok(Some(at + 1)),
        Some(b'\r') => match buf.get(at + 1) {
            Some(b'\n') => Ok(Some(at + 2)),
            Some(_) => Err(HeadError::Malformed),
            None => Ok(None),
        },
        Some(_) => Err(HeadError::Malformed),
        None => Ok(None),
    }
}

/// The method at `at`: one or more token bytes, then ` ` (not in the range).
fn method(buf: &[u8], at: usize) -> Step<Range<usize>> {
    if buf.get(at..at + 4) == Some(b"GET ") {
        return Ok(Some(at..at + 3));
    }
    let end = token_run(buf, at);
    match buf.get(end) {
        None => Ok(None),
        Some(b' ') if end > at => Ok(Some(at..end)),
        Some(_) => Err(HeadError::Malformed),
    }
}

/// The request target at `at`: one or more of `!`..=`~` and 0x80..=0xFF, valid
/// UTF-8, then ` ` (not in the range).
fn target(buf: &[u8], at: usize) -> Step<Range<usize>> {
    let end = target_run(buf, at);
    match buf.get(end) {
        None => Ok(None),
        Some(b' ') if end > at && utf8(&buf[at..end]) => Ok(Some(at..end)),
        Some(_) => Err(HeadError::Malformed),
    }
}

/// Whether `bytes` are UTF-8, ASCII the most often.
fn utf8(bytes: &[u8]) -> bool {
    bytes.is_ascii() || std::str::from_utf8(bytes).is_ok()
}

/// The minor version of the `HTTP/1.0` or `HTTP/1.1` at `at` (eight bytes). With
/// fewer in the buffer, those there must begin `HTTP/1.`.
fn version(buf: &[u8], at: usize) -> Step<u8> {
    const HTTP_11: u64 = u64::from_le_bytes(*b"HTTP/1.1");
    const HTTP_10: u64 = u64::from_le_bytes(*b"HTTP/1.0");
    match buf.get(at..).and_then(<[u8]>::first_chunk::<8>) {
        Some(&word) => match u64::from_le_bytes(word) {
            HTTP_11 => Ok(Some(1)),
            HTTP_10 => Ok(Some(0)),
            _ => Err(HeadError::Malformed),
        },
        None => {
            let some = &buf[at.min(buf.len())..];
            if b"HTTP/1.".starts_with(some) {
                Ok(None)
            } else {
                Err(HeadError::Malformed)
            }
        }
    }
}

/// The field lines from `at` and the empty line after them: where the head ends.
/// No line may start with white space (no obsolete line folding), none may have
/// white space before its colon.
fn field_lines(buf: &[u8], mut at: usize, fields: &mut Vec<[usize; 4]>) -> Step<usize> {
    loop {
        let name_end = token_run(buf, at);
        let Some(&colon) = buf.get(name_end) else {
            return Ok(None);
        };
        if colon != b':' || name_end == at {
            // The empty line that ends the head, or a line no field starts.
            return match colon {
                b'\r' | b'\n' if name_end == at => line_end(buf, at),
                _ => Err(HeadError::Malformed),
            };
        }
        // The value with the white space around it (SP and HTAB are value bytes
        // too), then without.
        let after = name_end + 1;
        let end = value_run(buf, after);
        let next = match (buf.get(end), buf.get(end + 1)) {
            (Some(b'\r'), Some(b'\n')) => end + 2,
            (Some(b'\n'), _) => end + 1,
            (None, _) | (Some(b'\r'), None) => return Ok(None),
            _ => return Err(HeadError::Malformed),
        };
        // White space before the value (up to the line's end at the latest).
        let mut value = after;
        while buf.get(value).is_some_and(|&b| b == b' ' || b == b'\t') {
            value += 1;
        }
        // (None but white space: empty, where the line ends, as httparse has it.)
        let mut value_end = end;
        while value_end > value
            && buf
                .get(value_end - 1)
                .is_some_and(|&b| b == b' ' || b == b'\t')
        {
            value_end -= 1;
        }
        if fields.len() == MAX_FIELDS {
            return Err(HeadError::TooManyFields);
        }
        fields.push([at, name_end, value, value_end]);
        at = next;
    }
}

// === byte classes ===

/// A table of the bytes for which `$is` holds (of `$b`), built at compile time.
macro_rules! byte_class {
    ($b:ident => $is:expr) => {{
        let mut class = [false; 256];
        let mut i = 0;
        while i < 256 {
            let $b = i as u8;
            class[i] = $is;
            i += 1;
        }
        class
    }};
}

/// `tchar` (RFC 9110 §5.6.2): what a method and a field name are made of.
static TOKEN: [bool; 256] = byte_class!(b => b.is_ascii_alphanumeric()
|| matches!(
    b,
    b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*' | b'+' | b'-' | b'.' | b'^' | b'_'
        | b'`' | b'|' | b'~'
));

/// What a field value (and a reason phrase) may hold: HTAB, SP, VCHAR, obs-text.
static VALUE: [bool; 256] = byte_class!(b => b == b'\t' || (b >= b' ' && b != 0x7F));

/// What a request target may hold: VCHAR and obs-text.
static TARGET: [bool; 256] = byte_class!(b => b > b' ' && b != 0x7F);

/// Where the token bytes from `at` end.
fn token_run(buf: &[u8], at: usize) -> usize {
    match buf.get(at..) {
        Some(rest) => at + token_len(rest),
        None => at,
    }
}

/// How many token bytes `bytes` starts with, looked at eight to a step.
fn token_len(bytes: &[u8]) -> usize {
    let mut rest = bytes;
    while let Some((word, more)) = rest.split_first_chunk::<8>() {
        if let Some(i) = word.iter().position(|&b| !TOKEN[usize::from(b)]) {
            return bytes.len() - rest.len() + i;
        }
        rest = more;
    }
    bytes.len() - rest.len() + run(rest, &TOKEN)
}

/// How many bytes `rest` starts with that are in `class`.
fn run(rest: &[u8], class: &[bool; 256]) -> usize {
    rest.iter()
        .position(|&b| !class[usize::from(b)])
        .unwrap_or(rest.len())
}

/// Each byte of a word holding 1.
const ONES: u64 = u64::from_le_bytes([1; 8]);
/// Each byte's low seven bits.
const LOWS: u64 = ONES * 0x7F;
/// Each byte's high bit.
const HIGHS: u64 = ONES << 7;

/// The high bit set in each byte of `word` (in memory order, from the low end)
/// below `n` (at most 0x7F) or equal to DEL, and only there: bytes of 0x80 and
/// above are neither.
fn below_or_del(word: u64, n: u8) -> u64 {
    // Each byte's low seven bits plus one, DEL's coming to 0 (no carry leaves a
    // byte); past `n` once more and the high bit says "at least `n`", again
    // without a carry.
    let up = ((word & LOWS) + ONES) & LOWS;
    let at_least = up + ONES * u64::from(0x7F - n);
    !(at_least | word) & HIGHS
}

/// Where the value bytes from `at` end.
fn value_run(buf: &[u8], at: usize) -> usize {
    match buf.get(at..) {
        Some(rest) => at + value_len(rest),
        None => at,
    }
}

/// How many value bytes (HTAB, SP, VCHAR, obs-text) `bytes` starts with: eight at
/// a time while none is a tab, another control byte or DEL (a tab is stepped
/// over).
fn value_len(bytes: &[u8]) -> usize {
    let mut rest = bytes;
    while let Some((word, more)) = rest.split_first_chunk::<8>() {
        let stops = below_or_del(u64::from_le_bytes(*word), b' ');
        if stops == 0 {
            rest = more;
            continue;
        }
        let i = (stops.trailing_zeros() / 8) as usize;
        if word.get(i) != Some(&b'\t') {
            return bytes.len() - rest.len() + i;
        }
        rest = rest.get(i + 1..).unwrap_or_default();
    }
    bytes.len() - rest.len() + run(rest, &VALUE)
}

/// Where the target bytes from `at` end (VCHAR, obs-text), eight at a time.
fn target_run(buf: &[u8], at: usize) -> usize {
    let mut rest = buf.get(at..).unwrap_or_default();
    while let Some((word, more)) = rest.split_first_chunk::<8>() {
        let stops = below_or_del(u64::from_le_bytes(*word), b'!');
        if stops != 0 {
            return buf.len() - rest.len() + (stops.trailing_zeros() / 8) as usize;
        }
        rest = more;
    }
    buf.len() - rest.len() + run(rest, &TARGET)
}

#[cfg(test)]
mod tests {
    //! The scanner against httparse, called as the codecs called it before: the
    //! same outcome and the same parts (as offsets into the buffer) for realistic
    //! heads, each of their prefixes, each with any one byte replaced by a byte
    //! the grammar cares about, and heads generated from pieces of the grammar
    //! mixed with hostile bytes. Every input is read as a request and as a response.

    use std::mem::MaybeUninit;

    use proptest::collection::vec;
    use proptest::prelude::*;
    use proptest::sample::select;

    use super::*;

    /// What a parser made of a buffer.
    #[derive(Debug, PartialEq, Eq)]
    enum Outcome {
        Complete {
            len: usize,
            line: Line,
            fields: Vec<[usize; 4]>,
        },
        Partial,
        TooManyFields,
        Malformed,
    }

    #[derive(Debug, PartialEq, Eq)]
    enum Line {
        Request {
            method: Range<usize>,
            target: Range<usize>,
            minor: u8,
        },
        /// The reason where there is one (httparse's `""` for one with
        /// obs-text lies in no buffer).
        Response {
            minor: u8,
            code: u16,
            reason: Option<Range<usize>>,
        },
    }

    fn ours_request(buf: &[u8]) -> Outcome {
        let mut fields = vec![[7; 4]];
        match request(buf, &mut fields) {
            Ok(Some(head)) => Outcome::Complete {
                len: head.len,
                line: Line::Request {
                    method: head.method,
                    target: head.target,
                    minor: head.minor,
                },
                fields,
            },
            other => failed(other),
        }
    }

    fn ours_response(buf: &[u8]) -> Outcome {
        let mut fields = vec![[7; 4]];
        match response(buf, &mut fields) {
            Ok(Some(head)) => Outcome::Complete {
                len: head.len,
                line: Line::Response {
                    minor: head.minor,
                    code: head.code,
                    reason: (!head.reason.is_empty()).then_some(head.reason),
                },
                fields,
            },
            other => failed(other),
        }
    }

    fn failed<T>(got: Step<T>) -> Outcome {
        match got {
            Ok(Some(_)) => unreachable!("a complete head is matched before"),
            Ok(None) => Outcome::Partial,
            Err(HeadError::TooManyFields) => Outcome::TooManyFields,
            Err(HeadError::Malformed) => Outcome::Malformed,
        }
    }

    fn theirs_request(buf: &[u8]) -> Outcome {
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
        let mut req = httparse::Request::new(&mut []);
        let got = httparse::ParserConfig::default().parse_request_with_uninit_headers(
            &mut req,
            buf,
            &mut headers,
        );
        let len = match their_status(got) {
            Ok(len) => len,
            Err(outcome) => return outcome,
        };
        let (Some(method), Some(target), Some(minor)) = (req.method, req.path, req.version) else {
            panic!("httparse left a complete request line unset");
        };
        Outcome::Complete {
            len,
            line: Line::Request {
                method: span(buf, method.as_bytes()),
                target: span(buf, target.as_bytes()),
                minor,
            },
            fields: their_fields(buf, req.headers),
        }
    }

    fn theirs_response(buf: &[u8]) -> Outcome {
        let mut headers = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
        let mut res = httparse::Response::new(&mut []);
        let got = httparse::ParserConfig::default().parse_response_with_uninit_headers(
            &mut res,
            buf,
            &mut headers,
        );
        let len = match their_status(got) {
            Ok(len) => len,
            Err(outcome) => return outcome,
        };
        let (Some(minor), Some(code), Some(reason)) = (res.version, res.code, res.reason) else {
            panic!("httparse left a complete status line unset");
        };
        Outcome::Complete {
            len,
            line: Line::Response {
                minor,
                code,
                reason: (!reason.is_empty()).then(|| span(buf, reason.as_bytes())),
            },
            fields: their_fields(buf, res.headers),
        }
    }

    fn their_status(got: httparse::Result<usize>) -> Result<usize, Outcome> {
        match got {
            Ok(httparse::Status::Complete(len)) => Ok(len),
            Ok(httparse::Status::Partial) => Err(Outcome::Partial),
            Err(httparse::Error::TooManyHeaders) => Err(Outcome::TooManyFields),
            Err(_) => Err(Outcome::Malformed),
        }
    }

    /// Where `part` lies in `buf`.
    fn span(buf: &[u8], part: &[u8]) -> Range<usize> {
        let at = part.as_ptr() as usize - buf.as_ptr() as usize;
        at..at + part.len()
    }

    fn their_fields(buf: &[u8], fields: &[httparse::Header<'_>]) -> Vec<[usize; 4]> {
        fields
            .iter()
            .map(|f| {
                let name = span(buf, f.name.as_bytes());
                let value = span(buf, f.value);
                [name.start, name.end, value.start, value.end]
            })
            .collect()
    }

    /// Both parsers read `buf` alike, as a request and as a response.
    fn same(buf: &[u8]) {
        let shown = || buf.escape_ascii().to_string();
        assert_eq!(
            ours_request(buf),
            theirs_request(buf),
            "request {}",
            shown()
        );
        assert_eq!(
            ours_response(buf),
            theirs_response(buf),
            "response {}",
            shown()
        );
    }

    /// A head of the given start line and `n` fields of varied shapes.
    fn with_fields(start: &str, n: usize) -> Vec<u8> {
        let mut head = start.as_bytes().to_vec();
        for i in 0..n {
            // Short lines (a head of MAX_FIELDS has each byte replaced in turn).
            let line = match i % 4 {
                0 => format!("x-{i}: v {i}\r\n"),
                1 => format!("X{i}:{i}\n"),
                2 => format!("a: \t{i} \t\r\n"),
                _ => "e:\r\n".to_string(),
            };
            head.extend_from_slice(line.as_bytes());
        }
        head.extend_from_slice(b"\r\n");
        head
    }

    /// Heads as clients and upstreams send them, and a few odd but valid ones.
    fn realistic() -> Vec<Vec<u8>> {
        let mut heads: Vec<Vec<u8>> = [
            // wrk, plain and as bench/callgrind's script sends it
            &b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n\r\n"[..],
            b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nX-Key: key-1\r\n\r\n",
            // curl
            b"GET /api/v1/items?id=42&sort=desc HTTP/1.1\r\nHost: api.example.com\r\n\
              User-Agent: curl/8.5.0\r\nAccept: */*\r\n\r\n",
            b"POST /upload HTTP/1.1\r\nHost: localhost:8080\r\nUser-Agent: curl/8.5.0\r\n\
              Accept: */*\r\nContent-Length: 5\r\n\
              Content-Type: application/x-www-form-urlencoded\r\n\r\nhello",
            // a browser
            b"GET /search?q=caf%C3%A9&lang=fr HTTP/1.1\r\nHost: www.example.org\r\n\
              Connection: keep-alive\r\n\
              sec-ch-ua: \"Chromium\";v=\"131\", \"Not_A Brand\";v=\"24\"\r\n\
              sec-ch-ua-mobile: ?0\r\nsec-ch-ua-platform: \"Linux\"\r\n\
              Upgrade-Insecure-Requests: 1\r\n\
              User-Agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 \
              (KHTML, like Gecko) Chrome/131.0.0.0 Safari/537.36\r\n\
              Accept: text/html,application/xhtml+xml,application/xml;q=0.9,\
              image/avif,image/webp,*/*;q=0.8\r\n\
              Sec-Fetch-Site: none\r\nSec-Fetch-Mode: navigate\r\nSec-Fetch-User: ?1\r\n\
              Sec-Fetch-Dest: document\r\nAccept-Encoding: gzip, deflate, br, zstd\r\n\
              Accept-Language: fr-FR,fr;q=0.9,en-US;q=0.8\r\n\
              Cookie: session=abc123; theme=dark\r\n\r\n",
            // odd but valid: empty lines first, bare line ends, empty and blank
            // values, trailing white space, obs-text, a UTF-8 target
            b"\r\n\nOPTIONS * HTTP/1.0\nX-Empty:\nX-Blank: \t \nX-Trail: a\tb \t\n\
              X-Obs: caf\xc3\xa9 \x80\xff\n\n",
            b"PUT /caf\xc3\xa9/%20?a=\"b\" HTTP/1.1\r\nHost:x\r\n\r\n",
            // nginx's answer, as bench/callgrind's upstream sends it
            b"HTTP/1.1 200 OK\r\nServer: nginx/1.26.3\r\n\
              Date: Sat, 28 Nov 2026 15:50:13 GMT\r\nContent-Type: text/plain\r\n\
              Content-Length: 3\r\nConnection: keep-alive\r\n\r\nok\n",
            b"HTTP/1.1 204 No Content\r\n\r\n",
            b"HTTP/1.0 404 \r\nX: y\r\n\r\n",
            b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
            b"\nHTTP/1.1 200\nContent-Length:0\n\n",
            b"HTTP/1.1 599 Caf\xc3\xa9 \tfine\r\nSet-Cookie: a=b; Path=/\r\n\
              Set-Cookie: c=d\r\nVary:\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\
              Cache-Control: no-cache, no-store\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        ]
        .iter()
        .map(|h| h.to_vec())
        .collect();
        for n in [0, 1, MAX_FIELDS, MAX_FIELDS + 1] {
            heads.push(with_fields("GET /fields HTTP/1.1\r\n", n));
            heads.push(with_fields("HTTP/1.1 200 OK\r\n", n));
        }
        heads
    }

    /// Every byte, next to every byte, in each place of a word: marked exactly when
    /// it is below the bound or DEL, whatever its neighbours are.
    #[test]
    fn below_or_del_marks_exactly_the_bytes_below_the_bound_and_del() {
        for n in [b' ', b'!'] {
            for a in 0..=255u8 {
                for b in 0..=255u8 {
                    for at in 0..7 {
                        let mut word = [b'x'; 8];
                        word[at] = a;
                        word[at + 1] = b;
                        let got = below_or_del(u64::from_le_bytes(word), n);
                        let want = word.iter().enumerate().fold(0u64, |marks, (i, &c)| {
                            marks | (u64::from(c < n || c == 0x7F) << (8 * i + 7))
                        });
                        assert_eq!(got, want, "{n:#x} {word:x?}");
                    }
                }
            }
        }
    }

    /// Bytes the grammar treats apart, and a letter.
    const INTERESTING: &[u8] = b"\0\t\n\r \"(),/:;<=>?@[\\]{}\x7f\x80\xffa";

    #[test]
    fn realistic_heads_and_each_of_their_prefixes_read_as_httparse_reads_them() {
        for head in realistic() {
            for end in 0..=head.len() {
                same(&head[..end]);
            }
        }
    }

    /// A bad byte is found as soon as it is in the buffer: the head cut right after
    /// it is refused as the whole one is, not taken as partial.
    #[test]
    fn realistic_heads_with_any_one_byte_replaced_read_as_httparse_reads_them() {
        for head in realistic() {
            for at in 0..head.len() {
                for &b in INTERESTING {
                    let mut changed = head.clone();
                    changed[at] = b;
                    same(&changed);
                    same(&changed[..at + 1]);
                }
            }
        }
    }

    /// One of `valid`, mostly; else up to three bytes of any kind.
    fn piece(valid: &'static [&'static [u8]]) -> impl Strategy<Value = Vec<u8>> {
        let hostile = prop_oneof![select(INTERESTING), any::<u8>()];
        prop_oneof![
            6 => select(valid).prop_map(<[u8]>::to_vec),
            1 => vec(hostile, 0..4),
        ]
    }

    fn field() -> impl Strategy<Value = Vec<u8>> {
        (
            piece(&[
                b"Host",
                b"content-length",
                b"X-Key",
                b"a",
                b"Sec-Fetch-Mode",
            ]),
            piece(&[b":", b": ", b":\t", b":  \t", b" :", b"\t: "]),
            piece(&[
                b"",
                b"v",
                b"1",
                b"a b",
                b"caf\xc3\xa9",
                b"\"q\", (c)",
                b"\xff",
            ]),
            piece(&[b"", b" ", b"\t ", b" x "]),
            piece(&[b"\r\n", b"\n"]),
        )
            .prop_map(|(name, colon, value, trailing, end)| {
                [name, colon, value, trailing, end].concat()
            })
    }

    fn fields() -> impl Strategy<Value = Vec<u8>> {
        prop_oneof![
            6 => vec(field(), 0..6),
            1 => vec(field(), MAX_FIELDS - 2..MAX_FIELDS + 3),
        ]
        .prop_map(|lines| lines.concat())
    }

    fn request_line() -> impl Strategy<Value = Vec<u8>> {
        (
            piece(&[b"GET", b"POST", b"OPTIONS", b"M-SEARCH", b"get"]),
            piece(&[b" "]),
            piece(&[
                b"/",
                b"/a/b?c=d",
                b"*",
                b"http://x.test/p",
                b"/caf\xc3\xa9",
                b"/\xc3",
            ]),
            piece(&[b" "]),
            piece(&[
                b"HTTP/1.1",
                b"HTTP/1.0",
                b"HTTP/2.0",
                b"HTTP/1.",
                b"http/1.1",
            ]),
        )
            .prop_map(|(m, s1, t, s2, v)| [m, s1, t, s2, v].concat())
    }

    fn status_line() -> impl Strategy<Value = Vec<u8>> {
        (
            piece(&[b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2"]),
            piece(&[b" "]),
            piece(&[b"200", b"404", b"100", b"999", b"20", b"2000"]),
            piece(&[b" OK", b" ", b"", b" Caf\xc3\xa9", b" Not Found", b" a\tb "]),
        )
            .prop_map(|(v, s, c, r)| [v, s, c, r].concat())
    }

    /// A head from pieces: empty lines, a start line, fields, an empty line and
    /// what follows, then cut short at times and a byte or two replaced.
    fn head() -> impl Strategy<Value = Vec<u8>> {
        (
            piece(&[b"", b"", b"\r\n", b"\n", b"\r\n\n"]),
            prop_oneof![request_line(), status_line()],
            piece(&[b"\r\n", b"\n"]),
            fields(),
            piece(&[b"\r\n", b"\n", b""]),
            piece(&[b"", b"body"]),
            any::<prop::sample::Index>(),
            any::<bool>(),
            vec((any::<prop::sample::Index>(), any::<u8>()), 0..2),
        )
            .prop_map(
                |(empty, line, end, fields, blank, body, cut, whole, changes)| {
                    let mut head = [empty, line, end, fields, blank, body].concat();
                    if head.is_empty() {
                        return head;
                    }
                    for (at, b) in changes {
                        let at = at.index(head.len());
                        head[at] = b;
                    }
                    if !whole {
                        head.truncate(cut.index(head.len() + 1));
                    }
                    head
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1024))]

        #[test]
        fn generated_heads_read_as_httparse_reads_them(head in head()) {
            same(&head);
        }
    }
}
