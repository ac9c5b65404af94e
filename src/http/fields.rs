//! Field names whose meaning every layer shares: the hop-by-hop fields, and the
//! rate-limit fields sluice writes on answers (an upstream's own are replaced).

use http::header::{self, HeaderName};

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
