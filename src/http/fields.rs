//! Field names whose meaning every layer shares: the hop-by-hop fields, and the
//! rate-limit fields sluice writes on responses (an upstream's own are replaced),
//! which the request path builds once as `AddedFields` and a codec writes.

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::HeaderMap;

/// The hop-by-hop headers of RFC 9110 §7.6.1, and every header `Connection` names.
/// (`Trailer` is not one: it announces the trailers, which HTTP/1.1 needs to
/// send them on.)
pub(crate) const HOP_BY_HOP: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
];
pub(crate) static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
pub(crate) static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
pub(crate) static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
pub(crate) static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
pub(crate) static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// Which rate-limit field a name is: `RateLimit`, `RateLimit-Policy`, or one of the
/// `X-RateLimit-*` family.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum RateField {
    RateLimit,
    Policy,
    X,
}

pub(crate) fn rate_field(name: &HeaderName) -> Option<RateField> {
    // Most names have none of their lengths: one look at it first.
    let s = name.as_str();
    match s.len() {
        9 if s == RATELIMIT.as_str() => Some(RateField::RateLimit),
        16 if s == RATELIMIT_POLICY.as_str() => Some(RateField::Policy),
        17 if s == X_LIMIT.as_str() || s == X_RESET.as_str() => Some(RateField::X),
        21 if s == X_REMAINING.as_str() => Some(RateField::X),
        _ => None,
    }
}

/// Whether `name` is one of the rate-limit fields (of either family).
pub(crate) fn is_rate_field(name: &HeaderName) -> bool {
    rate_field(name).is_some()
}

/// A field sluice adds to responses of its own (`AddedFields`): the rate-limit
/// ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Added {
    RateLimit,
    Policy,
    XLimit,
    XRemaining,
    XReset,
}

impl Added {
    pub fn name(self) -> &'static HeaderName {
        match self {
            Added::RateLimit => &RATELIMIT,
            Added::Policy => &RATELIMIT_POLICY,
            Added::XLimit => &X_LIMIT,
            Added::XRemaining => &X_REMAINING,
            Added::XReset => &X_RESET,
        }
    }

    /// The start of its line as HTTP/1 writes it: its name, then `: `. (Literals
    /// of known length: copied without a call, which a name read from its
    /// `HeaderName` is not.)
    fn line_start(self) -> &'static [u8] {
        match self {
            Added::RateLimit => b"ratelimit: ",
            Added::Policy => b"ratelimit-policy: ",
            Added::XLimit => b"x-ratelimit-limit: ",
            Added::XRemaining => b"x-ratelimit-remaining: ",
            Added::XReset => b"x-ratelimit-reset: ",
        }
    }
}

/// The most fields `AddedFields` holds: the rate-limit ones, both families.
const MAX_ADDED: usize = 5;

/// The fields sluice adds to a response of its own (the rate-limit ones), built
/// once by the request path: names and values in order. They are kept as HTTP/1
/// writes them (`name: value\r\n` each, back to back), so that HTTP/1's server
/// writes them after the response's own fields in one copy (`lines`), and a map
/// takes each value as a slice of that one buffer (`insert_into`).
pub struct AddedFields {
    lines: Vec<u8>,
    /// Each field and where its value stands in `lines`.
    fields: [(Added, usize, usize); MAX_ADDED],
    len: usize,
}

impl Default for AddedFields {
    fn default() -> AddedFields {
        AddedFields {
            lines: Vec::new(),
            fields: [(Added::RateLimit, 0, 0); MAX_ADDED],
            len: 0,
        }
    }
}

impl AddedFields {
    /// Room for `bytes` of fields, kept across `clear`s.
    pub fn with_capacity(bytes: usize) -> AddedFields {
        AddedFields {
            lines: Vec::with_capacity(bytes),
            ..AddedFields::default()
        }
    }

    /// Adds `field`, its value what `value` appends to the buffer it is given (a
    /// valid field value: the map leaves out any other). Past `MAX_ADDED` fields,
    /// nothing.
    #[inline]
    pub fn push(&mut self, field: Added, value: impl FnOnce(&mut Vec<u8>)) {
        if self.len == MAX_ADDED {
            return;
        }
        self.lines.extend_from_slice(field.line_start());
        let start = self.lines.len();
        value(&mut self.lines);
        self.fields[self.len] = (field, start, self.lines.len());
        self.lines.extend_from_slice(b"\r\n");
        self.len += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn clear(&mut self) {
        self.lines.clear();
        self.len = 0;
    }

    /// The fields as HTTP/1 header lines, in the order they were added.
    pub fn lines(&self) -> &[u8] {
        &self.lines
    }

    /// The fields' names and values, in the order they were added.
    pub fn iter(&self) -> impl Iterator<Item = (&'static HeaderName, &[u8])> + '_ {
        self.fields[..self.len]
            .iter()
            .map(|&(field, start, end)| (field.name(), &self.lines[start..end]))
    }

    /// Puts the fields in `map`, each replacing any of its name there: the values
    /// slices of one buffer. (A value that is not a valid field value is left out.)
    pub fn insert_into(self, map: &mut HeaderMap) {
        // Room for all of them at once, rather than a resize (and rehash) midway.
        map.reserve(self.len);
        let lines = Bytes::from(self.lines);
        for &(field, start, end) in &self.fields[..self.len] {
            if let Ok(v) = HeaderValue::from_maybe_shared(lines.slice(start..end)) {
                map.insert(field.name().clone(), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_added_line_starts_with_its_name() {
        use Added::*;
        for field in [RateLimit, Policy, XLimit, XRemaining, XReset] {
            let start = format!("{}: ", field.name().as_str());
            assert_eq!(field.line_start(), start.as_bytes(), "{field:?}");
        }
    }
}
