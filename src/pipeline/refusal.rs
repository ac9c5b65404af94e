//! The one place where sluice writes its own answers: every `Refusal` of the request
//! path (404, 400, 403, 413, 429, 502, 503, 504) maps to its status, decision, short
//! text body and whether the connection closes; plus the rate-limit headers that go
//! on every answer of a limited route, and the body wrapper that keeps a request's
//! end-of-request work (tally, concurrency permit) alive until its body ends.

use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};

use crate::http::body::{close, connect_refused, text, Body};
use crate::http::fields::{rate_field, Added, AddedFields, RateField};
use crate::limit::{Plan, Verdict};
use crate::pipeline::admit::BadRequest;
use crate::telemetry::metrics::Decision;
use crate::upstream::{ClientFault, ProxyError};

/// Whole seconds, rounded up.
pub fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// The `Retry-After` of a 429: whole seconds, rounded up, at least 1.
pub fn retry_after_secs(retry_after_us: u64) -> u64 {
    ceil_secs(retry_after_us).max(1)
}

/// What a refusal by a limit says.
fn limited_message(route: &str, limit: &str, secs: u64) -> String {
    format!("rate limit \"{limit}\" of route \"{route}\" exceeded; retry in {secs}s")
}

/// The 429 answer.
pub fn limited(route: &str, limit: &str, retry_after_us: u64) -> Response<Body> {
    let secs = retry_after_secs(retry_after_us);
    let mut r = text(
        StatusCode::TOO_MANY_REQUESTS,
        limited_message(route, limit, secs) + "\n",
    );
    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    r
}

// === refusals ===

/// Why a request is answered by sluice instead of its route's action, whichever phase
/// decided it. Each knows its status, its decision and whether the connection closes.
#[derive(Debug)]
pub enum Refusal<'a> {
    /// A malformed or ambiguous request head (method, Host, path).
    BadHead(BadRequest),
    /// `CONNECT`: sluice is no forward proxy (405).
    Connect,
    /// On the deny list: the configured status (403).
    Denied(StatusCode),
    Unmatched,
    /// The key the route needs is absent, empty or repeated; says which part.
    MissingKey(String),
    /// A key value with a character its kind of key may not hold; says which part,
    /// and whether it is read from the body (text of any script) or not
    /// (printable ASCII).
    UnprintableKey(String, bool),
    /// `Content-Length` over `max_request_body`.
    TooLarge(u64),
    Limited(Box<Limited<'a>>),
    /// The store is unreachable and `on_error: deny`.
    StoreDown,
    /// Forwarding failed (the decision made for the request stands).
    Upstream(ProxyError),
    /// The client broke its own request body.
    Client(ClientFault),
    /// No JWT (`Missing`) or one that failed a check, on a route that verifies one
    /// (401).
    Unauthorized(crate::jwt::Failure),
}

/// A request refused by a limit: what the 429 says.
#[derive(Debug)]
pub struct Limited<'a> {
    pub route: &'a str,
    pub plan: &'a Plan,
    pub policy: Option<&'a HeaderValue>,
    pub headers: &'a RateHeaders,
    pub verdict: Verdict,
}

impl From<ProxyError> for Refusal<'_> {
    fn from(e: ProxyError) -> Self {
        match e {
            ProxyError::Client(fault) => Refusal::Client(fault),
            e => Refusal::Upstream(e),
        }
    }
}

impl Refusal<'_> {
    pub fn status(&self) -> StatusCode {
        match self {
            Refusal::Denied(status) => *status,
            Refusal::Connect => StatusCode::METHOD_NOT_ALLOWED,
            Refusal::Unmatched => StatusCode::NOT_FOUND,
            Refusal::Client(ClientFault::Timeout) => StatusCode::REQUEST_TIMEOUT,
            Refusal::BadHead(_)
            | Refusal::MissingKey(_)
            | Refusal::UnprintableKey(..)
            | Refusal::Client(_) => StatusCode::BAD_REQUEST,
            Refusal::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Refusal::Limited(_) => StatusCode::TOO_MANY_REQUESTS,
            Refusal::StoreDown => StatusCode::SERVICE_UNAVAILABLE,
            Refusal::Upstream(e) => e.status(),
            Refusal::Unauthorized(_) => StatusCode::UNAUTHORIZED,
        }
    }

    /// The decision counted for it; `None` keeps the one the limits made (forwarding
    /// failed after the request was admitted).
    pub fn decision(&self) -> Option<Decision> {
        Some(match self {
            Refusal::Denied(_) => Decision::Denied,
            Refusal::Unmatched => Decision::Unmatched,
            Refusal::BadHead(_)
            | Refusal::Connect
            | Refusal::MissingKey(_)
            | Refusal::UnprintableKey(..)
            | Refusal::TooLarge(_)
            | Refusal::Client(_) => Decision::BadRequest,
            Refusal::Limited(_) => Decision::Limited,
            Refusal::StoreDown => Decision::StoreErrorDenied,
            Refusal::Unauthorized(_) => Decision::Unauthorized,
            // A chunked body that grew over the limit: the client's request, refused.
            Refusal::Upstream(ProxyError::TooLarge) => Decision::BadRequest,
            Refusal::Upstream(_) => return None,
        })
    }

    /// Whether the connection must close after the answer: always when the client's
    /// body broke (the connection's framing is lost); when the answer comes before a
    /// request body was read (`unread_body`), so unread bytes are never taken for the
    /// next request.
    pub fn closes(&self, unread_body: bool) -> bool {
        match self {
            // The head itself is not to be trusted, nor where its body ends.
            Refusal::BadHead(_) | Refusal::Client(_) => true,
            // The rest of the body was not read.
            Refusal::Upstream(ProxyError::TooLarge | ProxyError::BuffersFull) => true,
            // The body may be partly read, or partly sent and dropped (busy after
            // the read-ahead, an upstream that failed mid-upload): the connection
            // closes, with a lingering close, so the client reads this answer.
            _ => unread_body,
        }
    }

    /// The gRPC status code a gRPC call gets instead of `status` (`grpc_answer`).
    pub fn grpc_code(&self) -> u8 {
        match self {
            // What gRPC makes of an HTTP 400 and 405 (its HTTP-to-gRPC mapping).
            Refusal::BadHead(_) | Refusal::Client(ClientFault::Malformed) => grpc::INTERNAL,
            Refusal::Connect | Refusal::Unmatched => grpc::UNIMPLEMENTED,
            Refusal::Denied(_) => grpc::PERMISSION_DENIED,
            // The client is not identified.
            Refusal::MissingKey(_) | Refusal::Unauthorized(_) => grpc::UNAUTHENTICATED,
            Refusal::UnprintableKey(..) => grpc::INVALID_ARGUMENT,
            // As gRPC answers a message over its size limit.
            Refusal::TooLarge(_) | Refusal::Upstream(ProxyError::TooLarge) => {
                grpc::RESOURCE_EXHAUSTED
            }
            Refusal::Limited(_) => grpc::RESOURCE_EXHAUSTED,
            Refusal::StoreDown => grpc::UNAVAILABLE,
            Refusal::Upstream(ProxyError::Timeout) | Refusal::Client(ClientFault::Timeout) => {
                grpc::DEADLINE_EXCEEDED
            }
            Refusal::Upstream(_) => grpc::UNAVAILABLE,
            Refusal::Client(ClientFault::Aborted) => grpc::CANCELLED,
        }
    }

    /// The answer: in gRPC for a gRPC call (`grpc`: its `content-type` is
    /// `application/grpc…`), else in HTTP.
    pub fn respond(self, unread_body: bool, grpc: bool) -> Response<Body> {
        let closes = self.closes(unread_body);
        let mut r = if grpc {
            self.grpc_answer()
        } else {
            self.http_answer()
        };
        if closes {
            r = close(r);
        }
        r
    }

    /// What the answer says, in one line (an HTTP answer's body, a gRPC answer's
    /// `grpc-message`).
    fn message(&self) -> String {
        match self {
            Refusal::BadHead(bad) => format!("bad request: {bad}"),
            Refusal::Connect => "CONNECT is not supported: sluice is no forward proxy".into(),
            Refusal::Denied(_) => "access denied".into(),
            Refusal::Unmatched => "no route matches this request".into(),
            Refusal::MissingKey(part) => format!(
                "missing {part} (absent, empty or sent more than once): this route needs it to identify the client"
            ),
            Refusal::UnprintableKey(part, false) => format!(
                "{part} holds a byte outside printable ASCII (0x20-0x7E), which an upstream may read as another key"
            ),
            Refusal::UnprintableKey(part, true) => format!(
                "{part} holds a control, format, private-use or unassigned character, which an upstream may drop and read as another key"
            ),
            Refusal::TooLarge(max) => format!("request body larger than {max} bytes"),
            Refusal::Limited(l) => {
                let (name, retry) = l.headline();
                limited_message(l.route, name, retry_after_secs(retry))
            }
            Refusal::StoreDown => "rate limiter unavailable; try again later".into(),
            Refusal::Upstream(e) => match e {
                ProxyError::Timeout => "upstream did not answer in time",
                ProxyError::TooLarge => "request body too large",
                ProxyError::Busy => "upstream busy",
                ProxyError::BuffersFull => "server busy: request buffers full",
                _ => "upstream unavailable",
            }
            .into(),
            Refusal::Client(ClientFault::Malformed) => "malformed request body".into(),
            Refusal::Client(ClientFault::Timeout) => "request body stalled".into(),
            Refusal::Client(ClientFault::Aborted) => "request body ended before its end".into(),
            Refusal::Unauthorized(crate::jwt::Failure::Missing) => {
                "this route needs a bearer token (Authorization: Bearer ...)".into()
            }
            Refusal::Unauthorized(f) => format!("invalid token ({})", f.as_str().replace('_', " ")),
        }
    }

    /// A gRPC answer (gRPC over HTTP/2, "Trailers-Only"): HTTP 200 with
    /// `grpc-status` and `grpc-message` in the head and no body; a limit's also has
    /// the rate-limit fields, `retry-after` and `grpc-retry-pushback-ms` (the delay
    /// gRPC's retry policy honours) as metadata.
    fn grpc_answer(self) -> Response<Body> {
        let mut r = Response::new(crate::http::body::empty());
        let h = r.headers_mut();
        h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        h.insert(
            grpc::STATUS.clone(),
            HeaderValue::from(u16::from(self.grpc_code())),
        );
        if let Ok(v) = HeaderValue::from_str(&grpc::percent_encode(&self.message())) {
            h.insert(grpc::MESSAGE.clone(), v);
        }
        if let Refusal::Limited(l) = &self {
            let secs = retry_after_secs(l.headline().1);
            h.insert(RETRY_AFTER, HeaderValue::from(secs));
            h.insert(
                grpc::RETRY_PUSHBACK_MS.clone(),
                HeaderValue::from(secs * 1000),
            );
            l.headers.apply(h, l.plan, l.policy, &l.verdict);
        }
        r
    }

    fn http_answer(self) -> Response<Body> {
        let status = self.status();
        match self {
            Refusal::BadHead(bad) => bad.answer(),
            Refusal::Connect => connect_refused(),
            Refusal::Limited(l) => {
                let (name, retry) = l.headline();
                let mut r = limited(l.route, name, retry);
                l.headers
                    .apply(r.headers_mut(), l.plan, l.policy, &l.verdict);
                r
            }
            Refusal::Unauthorized(f) => {
                let mut r = text(status, Refusal::Unauthorized(f).message() + "\n");
                // RFC 6750 §3: a plain challenge when no token came, `invalid_token`
                // when one did and failed.
                let challenge = if f == crate::jwt::Failure::Missing {
                    HeaderValue::from_static("Bearer")
                } else {
                    HeaderValue::from_static("Bearer error=\"invalid_token\"")
                };
                r.headers_mut()
                    .insert(http::header::WWW_AUTHENTICATE, challenge);
                r
            }
            other => text(status, other.message() + "\n"),
        }
    }
}

impl Limited<'_> {
    /// The limit the answer names, and its retry delay (microseconds).
    fn headline(&self) -> (&str, u64) {
        match self.verdict.headline() {
            Some((i, o)) => (self.plan.limits[i].name.as_str(), o.retry_after_us),
            None => ("", self.verdict.retry_after_us()),
        }
    }
}

/// gRPC's status codes and fields, as sluice answers gRPC calls itself.
pub mod grpc {
    use http::HeaderName;

    pub const CANCELLED: u8 = 1;
    pub const INVALID_ARGUMENT: u8 = 3;
    pub const DEADLINE_EXCEEDED: u8 = 4;
    pub const PERMISSION_DENIED: u8 = 7;
    pub const RESOURCE_EXHAUSTED: u8 = 8;
    pub const UNIMPLEMENTED: u8 = 12;
    pub const INTERNAL: u8 = 13;
    pub const UNAVAILABLE: u8 = 14;
    pub const UNAUTHENTICATED: u8 = 16;

    pub static STATUS: HeaderName = HeaderName::from_static("grpc-status");
    pub static MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
    pub static RETRY_PUSHBACK_MS: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");

    /// `grpc-message`'s encoding: UTF-8, with bytes outside printable ASCII and
    /// `%` percent-encoded.
    pub fn percent_encode(message: &str) -> String {
        let mut out = String::with_capacity(message.len());
        for b in message.bytes() {
            if (0x20..=0x7e).contains(&b) && b != b'%' {
                out.push(char::from(b));
            } else {
                out.push_str(&format!("%{b:02X}"));
            }
        }
        out
    }
}

// === rate-limit headers ===

/// Which header families a route sends, and its precomputed `RateLimit-Policy`.
#[derive(Debug, Clone, Default)]
pub struct RateHeaders {
    pub ietf: bool,
    pub x_ratelimit: bool,
}

/// `"burst";q=20;w=2, "daily";q=10000;w=86400` (draft-ietf-httpapi-ratelimit-headers).
pub fn policy_header(plan: &Plan) -> Option<HeaderValue> {
    let mut s = String::new();
    // Limits on trial are not announced: clients see the policy that holds.
    for l in plan.limits.iter().filter(|l| !l.shadow) {
        if !s.is_empty() {
            s.push_str(", ");
        }
        s.push_str(&format!("{};q={}", sf_string(&l.name), l.algorithm.quota()));
        // No window for concurrency: in flight is not per time.
        let w = l.algorithm.policy_window_us();
        if w > 0 {
            s.push_str(&format!(";w={}", ceil_secs(w)));
        }
    }
    if s.is_empty() {
        return None;
    }
    HeaderValue::from_str(&s).ok()
}

/// A structured-field string: quoted, with `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = Vec::with_capacity(s.len() + 2);
    push_sf_string(&mut out, s);
    // Only ASCII was added to valid UTF-8.
    String::from_utf8(out).expect("UTF-8")
}

/// Appends the `RateLimit` value `"name";r=7;t=1`.
fn push_ratelimit(out: &mut Vec<u8>, name: &str, remaining: u64, reset: u64) {
    let mut n = itoa::Buffer::new();
    push_sf_string(out, name);
    out.extend_from_slice(b";r=");
    out.extend_from_slice(n.format(remaining).as_bytes());
    out.extend_from_slice(b";t=");
    out.extend_from_slice(n.format(reset).as_bytes());
}

/// Appends `s` as a Structured Field string: quoted, `"` and `\\` escaped.
fn push_sf_string(out: &mut Vec<u8>, s: &str) {
    out.push(b'"');
    let escaped = |b: &u8| *b == b'"' || *b == b'\\';
    if s.as_bytes().iter().any(escaped) {
        for b in s.as_bytes() {
            if escaped(b) {
                out.push(b'\\');
            }
            out.push(*b);
        }
    } else {
        // Limit names (validated): as they are.
        out.extend_from_slice(s.as_bytes());
    }
    out.push(b'"');
}

impl RateHeaders {
    /// The chosen families' fields for `verdict`, appended to `out` in the order
    /// they are written: the one builder of the rate-limit fields, whichever way
    /// they go to the client.
    pub fn fields(
        &self,
        out: &mut AddedFields,
        plan: &Plan,
        policy: Option<&HeaderValue>,
        verdict: &Verdict,
    ) {
        let Some((i, o)) = verdict.headline() else {
            return;
        };
        let reset = ceil_secs(o.reset_us);
        if self.ietf {
            if let Some(p) = policy {
                out.push(Added::Policy, |v| v.extend_from_slice(p.as_bytes()));
            }
            // Limit names are letters, digits, `_`, `-` and `.` (validated): the
            // value is always a valid one.
            let name = &plan.limits[i].name;
            out.push(Added::RateLimit, |v| {
                push_ratelimit(v, name, o.remaining, reset)
            });
        }
        if self.x_ratelimit {
            // Written out, not a loop: each field's line start is then a literal.
            let mut n = itoa::Buffer::new();
            let mut number = |v: &mut Vec<u8>, x: u64| v.extend_from_slice(n.format(x).as_bytes());
            out.push(Added::XLimit, |v| number(v, o.quota));
            out.push(Added::XRemaining, |v| number(v, o.remaining));
            out.push(Added::XReset, |v| number(v, reset));
        }
    }

    /// Add the chosen families for `verdict` to `headers` (`fields`, put in the map).
    pub fn apply(
        &self,
        headers: &mut HeaderMap,
        plan: &Plan,
        policy: Option<&HeaderValue>,
        verdict: &Verdict,
    ) {
        let mut fields = AddedFields::with_capacity(128);
        self.fields(&mut fields, plan, policy, verdict);
        fields.insert_into(headers);
    }
}

impl RateHeaders {
    /// Whether `headers` has a field `apply` would set (it replaces it where it
    /// stands): `policy` says whether a `RateLimit-Policy` would be.
    pub fn any_in(&self, headers: &HeaderMap, policy: bool) -> bool {
        if headers.is_empty() || !(self.ietf || self.x_ratelimit) {
            return false;
        }
        headers.keys().any(|k| match rate_field(k) {
            Some(RateField::RateLimit) => self.ietf,
            Some(RateField::Policy) => self.ietf && policy,
            Some(RateField::X) => self.x_ratelimit,
            None => false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fields_are_what_apply_adds_and_any_in_sees_them() {
        use crate::limit::{Algorithm, LimitDef, Mode, Outcome};
        let window = |limit, window_us| Algorithm::FixedWindow { limit, window_us };
        let plan = Plan {
            limits: vec![
                LimitDef::new("a.b-c_d".into(), window(10, 2_000_000), 1),
                LimitDef::new("second".into(), window(3, 60_000_000), 1),
            ],
            mode: Mode::Reject,
        };
        let policy = policy_header(&plan);
        let outcome = |remaining, reset_us, allowed| Outcome {
            allowed,
            quota: 10,
            remaining,
            reset_us,
            retry_after_us: if allowed { 0 } else { 1_500_000 },
            delay_us: 0,
        };
        let verdicts = [
            Verdict {
                allowed: true,
                delay_us: 0,
                outcomes: vec![outcome(7, 1_000_001, true), outcome(2, 59_000_000, true)].into(),
                trial: 0,
            },
            Verdict {
                allowed: false,
                delay_us: 0,
                outcomes: vec![outcome(0, 0, false), outcome(12_345_678_901, 1, true)].into(),
                trial: 0,
            },
            Verdict {
                allowed: true,
                delay_us: 0,
                outcomes: vec![].into(),
                trial: 0,
            },
        ];
        for (ietf, x_ratelimit) in [(true, true), (true, false), (false, true), (false, false)] {
            let h = RateHeaders { ietf, x_ratelimit };
            for v in &verdicts {
                for policy in [policy.as_ref(), None] {
                    let mut map = HeaderMap::new();
                    h.apply(&mut map, &plan, policy, v);
                    let mut expected = Vec::new();
                    for (k, v) in &map {
                        expected.extend_from_slice(k.as_str().as_bytes());
                        expected.extend_from_slice(b": ");
                        expected.extend_from_slice(v.as_bytes());
                        expected.extend_from_slice(b"\r\n");
                    }
                    let mut fields = AddedFields::default();
                    h.fields(&mut fields, &plan, policy, v);
                    // What HTTP/1's server writes is what the map holds.
                    assert_eq!(
                        String::from_utf8_lossy(fields.lines()),
                        String::from_utf8_lossy(&expected)
                    );
                    let named: Vec<_> = fields.iter().map(|(k, _)| k.clone()).collect();
                    let in_map: Vec<_> = map.keys().cloned().collect();
                    assert_eq!(named, in_map);
                    assert!(!h.any_in(&HeaderMap::new(), policy.is_some()));
                    for (k, _) in &map {
                        let mut other = HeaderMap::new();
                        other.insert(http::header::SERVER, HeaderValue::from_static("x"));
                        other.insert(k.clone(), HeaderValue::from_static("1"));
                        assert!(h.any_in(&other, policy.is_some()), "{k}");
                    }
                    let mut other = HeaderMap::new();
                    other.insert(http::header::SERVER, HeaderValue::from_static("x"));
                    other.insert("x-ratelimit", HeaderValue::from_static("1"));
                    assert!(!h.any_in(&other, policy.is_some()));
                }
            }
        }
    }

    #[test]
    fn escapes_and_rounding() {
        assert_eq!(sf_string(r#"a"b\c"#), r#""a\"b\\c""#);
        assert_eq!(ceil_secs(0), 0);
        assert_eq!(ceil_secs(1), 1);
        assert_eq!(ceil_secs(1_000_000), 1);
        assert_eq!(ceil_secs(1_000_001), 2);
        let r = limited("api", "burst", 300_000);
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()[RETRY_AFTER], "1");
    }
}
