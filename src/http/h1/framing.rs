//! HTTP/1.1 framing rules both codecs share (RFC 9112): `Content-Length` values,
//! `Transfer-Encoding`, `Connection` tokens, chunk-size lines, trailer blocks and
//! which fields may trail, with the limits on each. The server codec applies them to
//! requests, the client codec to upstream answers; neither parses these itself.

use bytes::{Buf, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Framing that breaks these rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FramingError {
    #[error("malformed framing: {0}")]
    Malformed(&'static str),
    #[error("trailer block larger than {MAX_HEAD} bytes")]
    TooLarge,
}

/// The largest response head (status line and fields) or trailer block taken from
/// an upstream; a larger one is a 502 (nginx's `proxy_buffer_size` is 4–8 KiB,
/// Envoy's limit 60 KiB).
pub const MAX_HEAD: usize = 64 * 1024;

/// The most fields a message head or trailer block may have, both ways (hyper's
/// default; a request head with more gets 431).
pub(crate) const MAX_FIELDS: usize = 100;

/// The longest chunk-size line (with its extensions).
pub(crate) const MAX_CHUNK_LINE: usize = 4096;

/// Whether the last coding a `Transfer-Encoding` value lists is `chunked` (a value
/// that is not UTF-8 lists none).
pub(crate) fn last_is_chunked(value: &[u8]) -> bool {
    std::str::from_utf8(value).is_ok_and(|v| {
        v.rsplit(',')
            .next()
            .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"))
    })
}

/// The one `Content-Length` of a message: several values (or a list) are one only
/// if all equal; anything but digits is none.
pub fn content_length(h: &HeaderMap) -> Option<u64> {
    let mut length = Length::None;
    for v in h.get_all(header::CONTENT_LENGTH) {
        length.add(v.as_bytes());
    }
    match length {
        Length::One(n) => Some(n),
        Length::None | Length::Invalid => None,
    }
}

/// The most digits a `Content-Length` item may have in a list (`Length`): a `u64`
/// holds any 19.
pub(crate) const MAX_LENGTH_DIGITS: usize = 19;

/// The one grammar of a `Content-Length` number (RFC 9110 §8.6, `1*DIGIT`): digits
/// only (no sign, no space, no list), `None` when it does not fit a `u64` (as
/// hyper's `from_digits`). Lists are `Length`'s.
pub(crate) fn decimal(b: &[u8]) -> Option<u64> {
    if b.is_empty() {
        return None;
    }
    b.iter().try_fold(0u64, |n, &d| {
        if d.is_ascii_digit() {
            n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        } else {
            None
        }
    })
}

/// The number one `Content-Length` value states: a number, or a list of one number
/// repeated (RFC 9112 §6.3), as `Length` reads it.
pub(crate) fn value_length(value: &[u8]) -> Option<u64> {
    let mut length = Length::None;
    length.add(value);
    match length {
        Length::One(n) => Some(n),
        Length::None | Length::Invalid => None,
    }
}

/// The trailer fields a request's `Trailer` header announces: on a chunked body,
/// only those are sent (as hyper's client). None with `_` in its name: such request
/// headers are dropped (`admit::drop_underscored`), and a trailer is no way round.
pub fn announced_trailers(h: &HeaderMap) -> Vec<HeaderName> {
    h.get_all(header::TRAILER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|n| HeaderName::from_bytes(n.trim().as_bytes()).ok())
        .filter(|n| !n.as_str().contains('_'))
        .collect()
}

/// Whether a field may be sent as a trailer: not one that frames, routes or
/// authorizes the message (RFC 9110 §6.5.1; hyper's list), which a recipient that
/// merges trailers into the head would otherwise take as the request's own.
pub fn may_trail(name: &HeaderName) -> bool {
    !matches!(
        *name,
        header::AUTHORIZATION
            | header::CACHE_CONTROL
            | header::CONTENT_ENCODING
            | header::CONTENT_LENGTH
            | header::CONTENT_RANGE
            | header::CONTENT_TYPE
            | header::HOST
            | header::MAX_FORWARDS
            | header::SET_COOKIE
            | header::TRAILER
            | header::TRANSFER_ENCODING
            | header::TE
    )
}

/// The `Content-Length` values of a head so far (`content_length` of a whole map):
/// each item of each value `decimal`, at most `MAX_LENGTH_DIGITS` digits, white
/// space around it; all the same number.
#[derive(Default, Debug, PartialEq)]
pub(crate) enum Length {
    #[default]
    None,
    /// Every value, and every item of a list, is this one.
    One(u64),
    /// Something other than digits, or two lengths.
    Invalid,
}

impl Length {
    pub(crate) fn add(&mut self, value: &[u8]) {
        for part in value.split(|&b| b == b',') {
            let part = part.trim_ascii();
            let n = Some(part)
                .filter(|p| p.len() <= MAX_LENGTH_DIGITS)
                .and_then(decimal);
            *self = match (n, &*self) {
                (Some(n), Length::None) => Length::One(n),
                (Some(n), Length::One(f)) if *f == n => Length::One(n),
                _ => Length::Invalid,
            };
        }
    }
}

/// The chunk-size line at the front of `b`: its length with the CRLF, and the
/// size; `None` until the whole line is there.
pub(crate) fn size_line(b: &[u8]) -> Result<Option<(usize, u64)>, FramingError> {
    let Some(end) = b.iter().position(|&c| c == b'\n') else {
        return if b.len() > MAX_CHUNK_LINE {
            Err(FramingError::Malformed("chunk-size line too long"))
        } else if !may_become_size_line(b) {
            Err(FramingError::Malformed("chunk size"))
        } else {
            Ok(None)
        };
    };
    if end == 0 || b[end - 1] != b'\r' || end > MAX_CHUNK_LINE {
        return Err(FramingError::Malformed("chunk-size line"));
    }
    let line = &b[..end - 1];
    // A CR before the line's own is a bare CR (RFC 9112 §2.2), in the extensions too.
    if line.contains(&b'\r') {
        return Err(FramingError::Malformed("bare CR in a chunk-size line"));
    }
    let digits = line.iter().take_while(|c| c.is_ascii_hexdigit()).count();
    let rest = trim_blanks(&line[digits..]);
    if digits == 0 || digits > 16 || !(rest.is_empty() || rest[0] == b';') {
        return Err(FramingError::Malformed("chunk size"));
    }
    let size = line[..digits].iter().fold(0u64, |n, &c| {
        (n << 4) | u64::from((c as char).to_digit(16).unwrap_or(0))
    });
    Ok(Some((end + 1, size)))
}

/// Checks the chunked framing of what came with the head, taking nothing out: a
/// malformed size line, or a chunk not followed by CRLF, in bytes already at hand
/// makes the answer a 502 while nothing has gone to the client (otherwise the
/// client would get the head, then a cut). What has not come yet is checked as it
/// comes; the trailers are left to the decoder.
pub(crate) fn check_buffered_chunks(mut b: &[u8]) -> Result<(), FramingError> {
    while let Some((taken, size)) = size_line(b)? {
        b = &b[taken..];
        let Some(size) = usize::try_from(size).ok().filter(|n| *n > 0) else {
            return Ok(());
        };
        // What came of the CRLF after the data (none, `\r`, or both) must be it.
        let after = b.get(size..).unwrap_or_default();
        let end = &after[..after.len().min(2)];
        if !b"\r\n".starts_with(end) {
            return Err(FramingError::Malformed("chunk not followed by CRLF"));
        }
        if end.len() < 2 {
            return Ok(());
        }
        b = &after[2..];
    }
    Ok(())
}

/// Whether `part`, a chunk-size line whose end has not come yet, can still become
/// one `chunk_size` takes: so a size line that is wrong from its first bytes is
/// refused with the head it came with, not once its end comes.
fn may_become_size_line(part: &[u8]) -> bool {
    let digits = part.iter().take_while(|b| b.is_ascii_hexdigit()).count();
    if digits > 16 {
        return false;
    }
    if digits == part.len() {
        return true;
    }
    // A CR only as the last byte, the line's own (its LF to come).
    if part
        .iter()
        .position(|&b| b == b'\r')
        .is_some_and(|cr| cr + 1 != part.len())
    {
        return false;
    }
    let rest = trim_blanks(&part[digits..]);
    digits > 0 && (rest.is_empty() || rest[0] == b';' || rest == b"\r")
}

/// Without the spaces and tabs it starts with: white space after a chunk size, as
/// hyper and nginx take it (the grammar has it only before `;`).
fn trim_blanks(b: &[u8]) -> &[u8] {
    let blanks = b.iter().take_while(|&&c| c == b' ' || c == b'\t').count();
    &b[blanks..]
}

/// The trailer block after the last chunk, taken out of `buf`: `Some(None)` when
/// there are no fields, `None` until the block is complete.
pub(crate) fn trailers(buf: &mut BytesMut) -> Result<Option<Option<HeaderMap>>, FramingError> {
    let mut fields = [httparse::EMPTY_HEADER; MAX_FIELDS];
    match httparse::parse_headers(buf, &mut fields) {
        // As large a block as a head may be, however it arrived.
        Ok(httparse::Status::Complete((len, _))) if len > MAX_HEAD => Err(FramingError::TooLarge),
        Ok(httparse::Status::Complete((len, fields))) => {
            let mut map = HeaderMap::with_capacity(fields.len());
            for f in fields.iter() {
                let name = HeaderName::from_bytes(f.name.as_bytes())
                    .map_err(|_| FramingError::Malformed("trailer name"))?;
                let value = HeaderValue::from_bytes(f.value)
                    .map_err(|_| FramingError::Malformed("trailer value"))?;
                map.append(name, value);
            }
            buf.advance(len);
            Ok(Some((!map.is_empty()).then_some(map)))
        }
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => Err(FramingError::TooLarge),
        Ok(httparse::Status::Partial) => Ok(None),
        Err(_) => Err(FramingError::Malformed("trailers")),
    }
}

/// The items of a comma-separated field value (RFC 9110 §5.6.1), each without the
/// white space around it.
pub fn items(value: &[u8]) -> impl Iterator<Item = &[u8]> {
    value.split(|&b| b == b',').map(<[u8]>::trim_ascii)
}

/// Whether a comma-separated list has `token` (any case); as hyper, only in a
/// value of visible ASCII (what `HeaderValue::to_str` takes).
pub fn has_token(value: &[u8], token: &[u8]) -> bool {
    visible(value) && items(value).any(|t| t.eq_ignore_ascii_case(token))
}

/// Whether any of a field's values lists `token` (`Connection: upgrade`, a field
/// `Connection` names).
pub fn lists<'a>(values: impl IntoIterator<Item = &'a HeaderValue>, token: &[u8]) -> bool {
    values.into_iter().any(|v| has_token(v.as_bytes(), token))
}

/// What a message's `Connection` options say (RFC 9112 §9.3, RFC 9110 §7.6.1): the
/// one reading of its tokens, for both codecs and for the forwarding.
#[derive(Default, Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connection {
    /// `close`: the connection ends after this message.
    pub close: bool,
    /// `keep-alive`: an HTTP/1.0 connection persists.
    pub keep_alive: bool,
    /// `upgrade`: the `Upgrade` field is meant for this hop.
    pub upgrade: bool,
}

/// A message's `Connection` options, over all its lines (`Connection::add`).
pub fn connection(h: &HeaderMap) -> Connection {
    let mut c = Connection::default();
    for v in h.get_all(header::CONNECTION) {
        c.add(v.as_bytes());
    }
    c
}

impl Connection {
    /// The options one line lists; as hyper, only in a value of visible ASCII
    /// (what `HeaderValue::to_str` takes: `has_token`).
    pub fn add(&mut self, value: &[u8]) {
        if visible(value) {
            self.add_items(value);
        }
    }

    /// The options one line lists, whatever other bytes it has (an upstream's answer,
    /// read as RFC 9110 §5.6.1 lists are); whether it lists any token but
    /// `keep-alive` (`close`, `upgrade`, or a field's name).
    pub(crate) fn add_items(&mut self, value: &[u8]) -> bool {
        let mut others = false;
        for t in items(value) {
            if t.eq_ignore_ascii_case(b"keep-alive") {
                self.keep_alive = true;
                continue;
            }
            if t.eq_ignore_ascii_case(b"close") {
                self.close = true;
            } else if t.eq_ignore_ascii_case(b"upgrade") {
                self.upgrade = true;
            }
            others |= !t.is_empty();
        }
        others
    }

    /// Whether a message's `Connection` lines name a field of the message (a
    /// hop-by-hop field to drop when forwarding): any token but `keep-alive` and
    /// `upgrade`, and `close` only when the message has a field of that name.
    pub fn names_fields(h: &HeaderMap) -> bool {
        h.get_all(header::CONNECTION).iter().any(|v| {
            items(v.as_bytes()).any(|t| {
                if t.eq_ignore_ascii_case(b"close") {
                    return h.contains_key("close");
                }
                !(t.is_empty()
                    || t.eq_ignore_ascii_case(b"keep-alive")
                    || t.eq_ignore_ascii_case(b"upgrade"))
            })
        })
    }

    /// Whether the connection persists after the message (RFC 9112 §9.3): HTTP/1.1
    /// unless `close`; HTTP/1.0 with `keep-alive` and no `close`.
    pub fn persists(&self, http11: bool) -> bool {
        !self.close && (http11 || self.keep_alive)
    }
}

/// Visible ASCII and tabs only (`HeaderValue::to_str`'s bytes, spaces included).
fn visible(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (32..127).contains(&b))
}

/// Whether `TE` values accept trailers (`trailers`, parameters aside).
pub fn te_lists_trailers<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> bool {
    values
        .into_iter()
        .filter(|v| v.to_str().is_ok())
        .flat_map(|v| items(v.as_bytes()))
        .any(|t| {
            t.split(|&b| b == b';')
                .next()
                .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"trailers"))
        })
}

/// Whether an HTTP/1 request head announces a body: `Transfer-Encoding`, or a
/// first `Content-Length` that is not the number 0. (One pass over the few fields of most
/// requests, cheaper than two hashed lookups.)
pub fn announces_body(h: &HeaderMap) -> bool {
    let mut length_seen = false;
    for (k, v) in h {
        if *k == header::TRANSFER_ENCODING {
            return true;
        }
        if *k == header::CONTENT_LENGTH && !length_seen {
            if decimal(v.as_bytes()) != Some(0) {
                return true;
            }
            length_seen = true;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One grammar for a `Content-Length` number wherever it is read: digits only,
    /// no sign, no space inside; a list only of one number repeated, and only where
    /// a value may be a list (`value_length`, `Length`).
    #[test]
    fn a_content_length_is_digits_and_a_list_only_of_one_number() {
        for (v, n) in [("0", Some(0)), ("5", Some(5)), ("05", Some(5))] {
            assert_eq!(decimal(v.as_bytes()), n, "{v:?}");
            assert_eq!(value_length(v.as_bytes()), n, "{v:?}");
        }
        for v in ["", "+5", "-5", " 5", "5 ", "5 5", "5,5", "0x5", "5.0", "５"] {
            assert_eq!(decimal(v.as_bytes()), None, "{v:?}");
        }
        assert_eq!(decimal(b"18446744073709551615"), Some(u64::MAX));
        assert_eq!(decimal(b"18446744073709551616"), None);
        for (v, n) in [("5, 5", Some(5)), (" 5 ,5", Some(5)), ("5,6", None)] {
            assert_eq!(value_length(v.as_bytes()), n, "{v:?}");
        }
        for v in ["+5", "5,+5", "5 5", "5,", ",", "", "18446744073709551615"] {
            assert_eq!(value_length(v.as_bytes()), None, "{v:?}");
        }
    }
}
