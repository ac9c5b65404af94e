//! The one place where sluice writes its own answers: 404, 400, 403, 413, 429, 502,
//! 503, 504 and `respond` routes, each with a short text body, plus the rate-limit
//! headers that go on every answer of a limited route.

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue, CONNECTION, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::limit::{Plan, Verdict};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body of every response sluice sends: its own or a streamed upstream one.
pub type Body = http_body_util::combinators::BoxBody<Bytes, BoxError>;

pub fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into()).map_err(|never| match never {}).boxed()
}

/// A short text answer from sluice itself.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = status;
    r.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}

/// Ask the client to close the connection: used when we answer before reading a
/// request body, so unread bytes can never be taken for the next request.
pub fn close(mut r: Response<Body>) -> Response<Body> {
    r.headers_mut()
        .insert(CONNECTION, HeaderValue::from_static("close"));
    r
}

/// The answer to `CONNECT`: sluice is no forward proxy, and a tunnel would carry
/// requests past every route and limit.
pub fn connect_refused() -> Response<Body> {
    let mut r = text(StatusCode::METHOD_NOT_ALLOWED, "CONNECT is not supported\n");
    r.headers_mut().insert(
        http::header::ALLOW,
        HeaderValue::from_static("GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS"),
    );
    r
}

/// Whole seconds, rounded up.
pub fn ceil_secs(us: u64) -> u64 {
    us.div_ceil(1_000_000)
}

/// The 429 answer.
pub fn limited(route: &str, limit: &str, retry_after_us: u64) -> Response<Body> {
    let secs = ceil_secs(retry_after_us).max(1);
    let mut r = text(
        StatusCode::TOO_MANY_REQUESTS,
        format!("rate limit \"{limit}\" of route \"{route}\" exceeded; retry in {secs}s\n"),
    );
    r.headers_mut().insert(RETRY_AFTER, HeaderValue::from(secs));
    r
}

// === rate-limit headers ===

/// Which header families a route sends, and its precomputed `RateLimit-Policy`.
#[derive(Debug, Clone, Default)]
pub struct RateHeaders {
    pub ietf: bool,
    pub x_ratelimit: bool,
}

static RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");
static RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
static X_LIMIT: HeaderName = HeaderName::from_static("x-ratelimit-limit");
static X_REMAINING: HeaderName = HeaderName::from_static("x-ratelimit-remaining");
static X_RESET: HeaderName = HeaderName::from_static("x-ratelimit-reset");

/// `"burst";q=20;w=2, "daily";q=10000;w=86400` (draft-ietf-httpapi-ratelimit-headers).
pub fn policy_header(plan: &Plan) -> Option<HeaderValue> {
    let mut s = String::new();
    for (i, l) in plan.limits.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&format!(
            "{};q={};w={}",
            sf_string(&l.name),
            l.algorithm.quota(),
            ceil_secs(l.algorithm.policy_window_us())
        ));
    }
    HeaderValue::from_str(&s).ok()
}

/// A structured-field string: quoted, with `"` and `\` escaped.
fn sf_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

impl RateHeaders {
    /// Add the chosen families for `verdict` to `headers`.
    pub fn apply(
        &self,
        headers: &mut HeaderMap,
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
                headers.insert(RATELIMIT_POLICY.clone(), p.clone());
            }
            let v = format!(
                "{};r={};t={}",
                sf_string(&plan.limits[i].name),
                o.remaining,
                reset
            );
            if let Ok(v) = HeaderValue::from_str(&v) {
                headers.insert(RATELIMIT.clone(), v);
            }
        }
        if self.x_ratelimit {
            headers.insert(X_LIMIT.clone(), HeaderValue::from(o.quota));
            headers.insert(X_REMAINING.clone(), HeaderValue::from(o.remaining));
            headers.insert(X_RESET.clone(), HeaderValue::from(reset));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
