//! The first phase of the request path: a head that is malformed or ambiguous (an
//! unknown method, a missing, repeated or invalid Host, a path that cannot be
//! normalised) is refused with 400 before anything routes it; the rest is put into
//! the one form that routing, key extraction and the upstream all see.

use std::borrow::Cow;
use std::net::Ipv6Addr;

use http::header::{HeaderMap, HeaderName, HeaderValue, COOKIE, HOST};
use http::request::Parts;
use http::uri::{Authority, PathAndQuery, Uri};
use http::{Method, Response, StatusCode, Version};

use crate::http::body;
use crate::http::body::Body;
use crate::pipeline::path::{self, PathError, RoutePath};

/// Why a request head is refused; always 400, and the connection is closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    #[error("unknown method (methods are upper-case, such as GET or POST)")]
    Method,
    #[error("no Host header")]
    NoHost,
    #[error("more than one Host header")]
    TwoHosts,
    #[error("invalid Host: {0}")]
    Host(&'static str),
    #[error("the Host header names another host than :authority")]
    HostMismatch,
    #[error("the asterisk-form request target (OPTIONS *) is not served")]
    Asterisk,
    #[error("{0}")]
    Path(#[from] PathError),
    #[error("the request target cannot be rebuilt")]
    Target,
}

impl BadRequest {
    /// The one-line 400 answer.
    pub fn answer(&self) -> Response<Body> {
        body::text(StatusCode::BAD_REQUEST, format!("bad request: {self}\n"))
    }
}

/// Check the head and normalise it in place: header names with `_` dropped, the path (`path::normalize`, the
/// route view in the extensions when it differs), a Host or `:authority` without
/// its trailing dot, and on HTTP/2 the `cookie` fields joined into one header (RFC
/// 9113 §8.2.3) as the HTTP/1.1 upstream will get them. `CONNECT` is left as it is.
pub fn admit(req: &mut Parts) -> Result<(), BadRequest> {
    drop_underscored(&mut req.headers);
    if req.method == Method::CONNECT {
        return Ok(());
    }
    let common = req.method == Method::GET || req.method == Method::POST;
    if !common && !METHODS.contains(&req.method.as_str()) {
        return Err(BadRequest::Method);
    }
    host(req)?;
    normalise_path(req)?;
    if req.version == Version::HTTP_2 {
        join_cookies(&mut req.headers);
    }
    Ok(())
}

/// The IANA HTTP Method Registry, less `CONNECT` (decided elsewhere) and `PRI`
/// (the HTTP/2 preface); `QUERY` too. Method names are case-sensitive (RFC 9110
/// §9.1): `post` is not `POST`, and a route limited to POST must not let it past.
pub(crate) const METHODS: [&str; 38] = [
    "GET",
    "POST",
    "HEAD",
    "PUT",
    "DELETE",
    "OPTIONS",
    "PATCH",
    "TRACE",
    "QUERY",
    "ACL",
    "BASELINE-CONTROL",
    "BIND",
    "CHECKIN",
    "CHECKOUT",
    "COPY",
    "LABEL",
    "LINK",
    "LOCK",
    "MERGE",
    "MKACTIVITY",
    "MKCALENDAR",
    "MKCOL",
    "MKREDIRECTREF",
    "MKWORKSPACE",
    "MOVE",
    "ORDERPATCH",
    "PROPFIND",
    "PROPPATCH",
    "REBIND",
    "REPORT",
    "SEARCH",
    "UNBIND",
    "UNCHECKOUT",
    "UNLINK",
    "UNLOCK",
    "UPDATE",
    "UPDATEREDIRECTREF",
    "VERSION-CONTROL",
];

// === Host ===

/// RFC 9112 §3.2: an HTTP/1.1 request has exactly one valid Host (HTTP/1.0 may
/// have none, as nginx accepts); an HTTP/2 request has `:authority` or Host, and a
/// Host beside `:authority` must name the same (RFC 9113 §8.3.1). The target's
/// authority (absolute-form, `:authority`) is checked like a Host.
fn host(req: &mut Parts) -> Result<(), BadRequest> {
    let mut hosts = req.headers.get_all(HOST).iter();
    let header = hosts.next();
    if hosts.next().is_some() {
        return Err(BadRequest::TwoHosts);
    }
    // The common case: a Host in normal form and no authority in the target, so
    // nothing to compare or rewrite.
    if req.uri.authority().is_none() && header.is_some_and(|v| plain_host(v.as_bytes())) {
        return Ok(());
    }
    let header = header
        .map(|v| {
            let s = v.to_str().map_err(|_| BadRequest::Host("not ASCII"))?;
            normalize_host(s).map_err(BadRequest::Host)
        })
        .transpose()?;
    let authority = req
        .uri
        .authority()
        .map(|a| normalize_host(a.as_str()).map_err(BadRequest::Host))
        .transpose()?;
    let missing = match req.version {
        Version::HTTP_09 | Version::HTTP_10 => false,
        Version::HTTP_11 => header.is_none(),
        _ => header.is_none() && authority.is_none(),
    };
    if missing {
        return Err(BadRequest::NoHost);
    }
    if let (Some(h), Some(a)) = (&header, &authority) {
        // The host names must agree (routing reads the name); a port that one of
        // them leaves out (`a` beside `a:443`) is no conflict.
        let name = crate::pipeline::route::strip_port;
        if req.version >= Version::HTTP_2 && !name(h).eq_ignore_ascii_case(name(a)) {
            return Err(BadRequest::HostMismatch);
        }
    }
    // Only a trailing dot makes a normal form differ.
    let header = header.and_then(owned);
    let authority = authority.and_then(owned);
    if let Some(h) = header {
        let v = HeaderValue::from_str(&h).map_err(|_| BadRequest::Target)?;
        req.headers.insert(HOST, v);
    }
    if let Some(a) = authority {
        let a: Authority = a.parse().map_err(|_| BadRequest::Target)?;
        let mut parts = std::mem::take(&mut req.uri).into_parts();
        parts.authority = Some(a);
        req.uri = Uri::from_parts(parts).map_err(|_| BadRequest::Target)?;
    }
    Ok(())
}

fn owned(c: Cow<'_, str>) -> Option<String> {
    match c {
        Cow::Owned(s) => Some(s),
        Cow::Borrowed(_) => None,
    }
}

/// A Host value (`name[:port]`, `[v6]:port`) as routing compares it: its trailing
/// dot removed. Refused (with the reason): user information (`a@b`), a list
/// (`a, b`), spaces and other characters that no host name has, empty labels
/// (`a..b`), a port that is empty, not a number or above 65535.
pub fn normalize_host(s: &str) -> Result<Cow<'_, str>, &'static str> {
    if plain_host(s.as_bytes()) {
        return Ok(Cow::Borrowed(s));
    }
    checked_host(s)
}

/// `normalize_host` for every Host, checks in the order that picks the reason
/// given: user information, brackets, the port, the name.
fn checked_host(s: &str) -> Result<Cow<'_, str>, &'static str> {
    if s.as_bytes().contains(&b'@') {
        return Err("user information (\"@\") in the host");
    }
    if let Some(rest) = s.strip_prefix('[') {
        let (literal, after) = rest.split_once(']').ok_or("an unclosed \"[\"")?;
        literal
            .parse::<Ipv6Addr>()
            .map_err(|_| "not an IPv6 address inside \"[ ]\"")?;
        if !after.is_empty() {
            port(after.strip_prefix(':').ok_or("text after \"]\"")?)?;
        }
        return Ok(Cow::Borrowed(s));
    }
    let (name, p) = match s.bytes().position(|b| b == b':') {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    if let Some(p) = p {
        port(p)?;
    }
    let bare = name.strip_suffix('.').unwrap_or(name);
    if bare.is_empty() {
        return Err("an empty host name");
    }
    // One pass (this runs on every request): the characters, and whether a label
    // is empty (a leading dot, two dots, a dot left at the end).
    let mut after_dot = true;
    let mut empty_label = false;
    for b in bare.bytes() {
        if !(b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_') {
            return Err("a character that no host name has");
        }
        let dot = b == b'.';
        empty_label |= dot && after_dot;
        after_dot = dot;
    }
    if empty_label || after_dot {
        return Err("an empty label");
    }
    Ok(match (bare.len() == name.len(), p) {
        (true, _) => Cow::Borrowed(s),
        (false, None) => Cow::Owned(bare.to_owned()),
        (false, Some(p)) => Cow::Owned(format!("{bare}:{p}")),
    })
}

/// Byte classes for `plain_host`.
const NAME: u8 = 1;
const DOT: u8 = 2;
const COLON: u8 = 3;
const HOST_CLASS: [u8; 256] = {
    let mut t = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        if c.is_ascii_alphanumeric() || c == b'-' || c == b'_' {
            t[b] = NAME;
        }
        b += 1;
    }
    t[b'.' as usize] = DOT;
    t[b':' as usize] = COLON;
    t
};

/// The common Host in one pass: `name[:port]` that `normalize_host` accepts as it
/// is (no trailing dot, no brackets). False means "not sure": `normalize_host`
/// decides, and says why it refuses.
fn plain_host(s: &[u8]) -> bool {
    // After a dot (or at the start): a label must follow.
    let mut after_dot = true;
    let mut i = 0;
    while i < s.len() {
        match HOST_CLASS[s[i] as usize] {
            NAME => after_dot = false,
            DOT if !after_dot => after_dot = true,
            COLON if !after_dot => break,
            _ => return false,
        }
        i += 1;
    }
    if after_dot {
        // Empty, or a trailing dot (normalised elsewhere).
        return false;
    }
    if i == s.len() {
        return true;
    }
    let p = &s[i + 1..];
    if p.is_empty() || p.len() > 5 {
        return false;
    }
    let mut v: u32 = 0;
    for &d in p {
        if !d.is_ascii_digit() {
            return false;
        }
        v = v * 10 + u32::from(d - b'0');
    }
    v <= 65535
}

fn port(p: &str) -> Result<(), &'static str> {
    let digits = !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit());
    if digits && p.parse::<u16>().is_ok() {
        Ok(())
    } else {
        Err("the port is not a number from 0 to 65535")
    }
}

// === path ===

/// The path in normal form (the query as sent), the route view beside it when the
/// path has `;parameters`. The asterisk-form target is refused, as nginx does.
fn normalise_path(req: &mut Parts) -> Result<(), BadRequest> {
    let raw = req.uri.path();
    if raw == "*" {
        return Err(BadRequest::Asterisk);
    }
    if let Some(p) = owned(path::normalize(raw)?) {
        let pq = match req.uri.query() {
            Some(q) => format!("{p}?{q}"),
            None => p,
        };
        let mut parts = std::mem::take(&mut req.uri).into_parts();
        parts.path_and_query = Some(PathAndQuery::try_from(pq).map_err(|_| BadRequest::Target)?);
        req.uri = Uri::from_parts(parts).map_err(|_| BadRequest::Target)?;
    }
    if let Some(view) = owned(path::route_view(req.uri.path())) {
        req.extensions.insert(RoutePath(view));
    }
    Ok(())
}

// === header names ===

/// Header names with `_` dropped, as nginx does (`underscores_in_headers off`):
/// CGI, WSGI and Rack servers fold `_` into `-`, so `X_Api_Key` would be the key
/// `X-Api-Key` to the upstream, but not to the key, the deny list or the matcher.
/// (One look at each name; a map is changed only when one has a `_`.)
fn drop_underscored(h: &mut HeaderMap) {
    let underscored = |n: &HeaderName| n.as_str().as_bytes().contains(&b'_');
    if !h.keys().any(underscored) {
        return;
    }
    let names: Vec<HeaderName> = h.keys().filter(|n| underscored(n)).cloned().collect();
    for n in names {
        h.remove(&n);
    }
}

// === cookies ===

/// Several `cookie` fields joined with `; ` into one header: HTTP/2 clients split
/// them (RFC 9113 §8.2.3), and HTTP/1.1 servers read one Cookie header.
fn join_cookies(h: &mut HeaderMap) {
    if h.get_all(COOKIE).iter().nth(1).is_none() {
        return;
    }
    let mut joined = Vec::new();
    for (i, v) in h.get_all(COOKIE).iter().enumerate() {
        if i > 0 {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(v.as_bytes());
    }
    if let Ok(v) = HeaderValue::from_bytes(&joined) {
        h.insert(COOKIE, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn parts(method: &str, uri: &str, version: Version, headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().method(method).uri(uri).version(version);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn hosts() {
        for (host, want) in [
            ("api.example.com", Ok("api.example.com")),
            ("API.example.com:8080", Ok("API.example.com:8080")),
            ("api.example.com.", Ok("api.example.com")),
            ("api.example.com.:80", Ok("api.example.com:80")),
            ("127.0.0.1:0", Ok("127.0.0.1:0")),
            ("[::1]", Ok("[::1]")),
            ("[::1]:443", Ok("[::1]:443")),
            ("my_host", Ok("my_host")),
            ("", Err("an empty host name")),
            (".", Err("an empty host name")),
            ("a..b", Err("an empty label")),
            (".a", Err("an empty label")),
            ("a..", Err("an empty label")),
            ("a, b", Err("a character that no host name has")),
            ("a,b", Err("a character that no host name has")),
            ("a b", Err("a character that no host name has")),
            ("a/b", Err("a character that no host name has")),
            ("a@evil", Err("user information (\"@\") in the host")),
            ("a:abc", Err("the port is not a number from 0 to 65535")),
            ("a:", Err("the port is not a number from 0 to 65535")),
            ("a:+80", Err("the port is not a number from 0 to 65535")),
            ("a:65536", Err("the port is not a number from 0 to 65535")),
            ("a:1:2", Err("the port is not a number from 0 to 65535")),
            ("[::1", Err("an unclosed \"[\"")),
            ("[x]", Err("not an IPv6 address inside \"[ ]\"")),
            ("[::1]x", Err("text after \"]\"")),
        ] {
            assert_eq!(
                normalize_host(host).as_deref().map_err(|e| *e),
                want,
                "{host:?}"
            );
        }
    }

    /// The one-pass check agrees with the full one on every short Host spelled
    /// from the characters that matter (several problems at once included: the
    /// reason given stays the full check's).
    #[test]
    fn plain_host_agrees_with_the_full_check() {
        let alphabet = [
            "a", "Z", "0", "6", "5", "-", "_", ".", ":", "@", "[", "]", " ", ",", "é",
        ];
        let mut hosts = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..4 {
            let next: Vec<String> = last
                .iter()
                .flat_map(|h| alphabet.iter().map(move |c| format!("{h}{c}")))
                .collect();
            hosts.extend(next.iter().cloned());
            last = next;
        }
        for p in [
            "0", "65535", "65536", "99999", "00080", "000080", "1a", "", "+1", "8080",
        ] {
            for name in [
                "a",
                "a.b",
                "a.",
                "a..b",
                "127.0.0.1",
                "[::1]",
                "a@b",
                "a b",
                "",
            ] {
                hosts.push(format!("{name}:{p}"));
            }
        }
        for h in &hosts {
            let fast = normalize_host(h);
            assert_eq!(fast, checked_host(h), "{h:?}");
            if plain_host(h.as_bytes()) {
                assert!(matches!(fast, Ok(Cow::Borrowed(_))), "{h:?}");
            }
        }
    }

    #[test]
    fn host_rules_by_version() {
        let (v10, v11, h2) = (Version::HTTP_10, Version::HTTP_11, Version::HTTP_2);
        let host = |h| [("host", h)];
        for (uri, version, headers, want) in [
            ("/", v11, &[][..], Err(BadRequest::NoHost)),
            (
                "/",
                v11,
                &[("host", "a"), ("host", "a")],
                Err(BadRequest::TwoHosts),
            ),
            ("http://a/", v11, &[], Err(BadRequest::NoHost)),
            ("/", v10, &[], Ok(())),
            ("/", h2, &[], Err(BadRequest::NoHost)),
            ("http://a/", h2, &[], Ok(())),
            ("http://a/", h2, &host("A"), Ok(())),
            ("http://a/", h2, &host("b"), Err(BadRequest::HostMismatch)),
            // A port only one of them names is no conflict; a different port
            // neither (routing reads the name).
            ("http://a/", h2, &host("a:443"), Ok(())),
            ("http://a/", h2, &host("A:8443"), Ok(())),
            ("http://a:443/", h2, &host("a"), Ok(())),
            (
                "http://a:443/",
                h2,
                &host("b:443"),
                Err(BadRequest::HostMismatch),
            ),
        ] {
            let got = admit(&mut parts("GET", uri, version, headers));
            assert_eq!(got, want, "{uri} {version:?} {headers:?}");
        }
        let mut p = parts("GET", "http://a.b./x", v11, &[("host", "c.d.:81")]);
        admit(&mut p).unwrap();
        assert_eq!(p.uri, "http://a.b/x");
        assert_eq!(p.headers[HOST], "c.d:81");
    }

    /// nginx's `underscores_in_headers off`: every field whose name has a `_` is
    /// gone before routing, keys and forwarding read the head; the rest stay.
    #[test]
    fn header_names_with_an_underscore_are_dropped() {
        let mut p = parts(
            "GET",
            "/",
            Version::HTTP_11,
            &[
                ("host", "h"),
                ("x_api_key", "a"),
                ("x-api-key", "b"),
                ("X_Api_Key", "c"),
                ("_", "d"),
            ],
        );
        admit(&mut p).unwrap();
        let names: Vec<&str> = p.headers.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["host", "x-api-key"]);
    }

    #[test]
    fn methods_are_case_sensitive_registry_tokens() {
        for m in ["GET", "PROPFIND", "VERSION-CONTROL", "QUERY", "CONNECT"] {
            assert_eq!(
                admit(&mut parts(m, "/", Version::HTTP_11, &[("host", "a")])),
                Ok(()),
                "{m}"
            );
        }
        for m in ["get", "Post", "PRI", "FOO"] {
            assert_eq!(
                admit(&mut parts(m, "/", Version::HTTP_11, &[("host", "a")])),
                Err(BadRequest::Method),
                "{m}"
            );
        }
    }

    #[test]
    fn paths_and_cookies() {
        let mut p = parts(
            "GET",
            "/a/../x;p=1?q=/../%2e",
            Version::HTTP_2,
            &[("host", "h"), ("cookie", "a=1"), ("cookie", "b=2")],
        );
        admit(&mut p).unwrap();
        assert_eq!(p.uri, "/x;p=1?q=/../%2e");
        assert_eq!(p.extensions.get::<RoutePath>().unwrap().0, "/x");
        assert_eq!(p.headers.get_all(COOKIE).iter().count(), 1);
        assert_eq!(p.headers[COOKIE], "a=1; b=2");
        let mut p = parts("GET", "/x%2fy", Version::HTTP_11, &[("host", "h")]);
        assert_eq!(
            admit(&mut p),
            Err(BadRequest::Path(PathError::EncodedSlash))
        );
        let mut p = parts("OPTIONS", "*", Version::HTTP_11, &[("host", "h")]);
        assert_eq!(admit(&mut p), Err(BadRequest::Asterisk));
    }
}
