//! The route table: compiled matchers, tried in file order; the first route whose
//! every given condition holds takes the request.

use http::header::{HeaderName, HeaderValue, HOST};
use http::request::Parts;
use http::Method;
use regex::Regex;

use crate::pipeline::path::RoutePath;

#[derive(Debug, Clone)]
pub enum HostMatch {
    /// Lower-case host name.
    Exact(String),
    /// `*.example.com` stored as `.example.com`: any name ending so, at any depth,
    /// but not `example.com` itself (like nginx).
    Suffix(String),
}

#[derive(Debug, Clone)]
pub enum HeaderMatch {
    Present,
    Exact(HeaderValue),
}

#[derive(Debug, Clone, Default)]
pub struct Matcher {
    pub host: Option<HostMatch>,
    pub path: Option<String>,
    pub path_prefix: Option<String>,
    pub path_regex: Option<Regex>,
    pub methods: Option<Vec<Method>>,
    pub headers: Vec<(HeaderName, HeaderMatch)>,
    /// `path` and `path_prefix` compared ignoring ASCII case (`path_regex` is
    /// compiled case-insensitive for it).
    pub case_insensitive: bool,
}

/// The host a request is for: the URI authority (HTTP/2, absolute-form) or `Host`,
/// without port, lower-cased only when needed.
pub fn request_host(req: &Parts) -> Option<&str> {
    let raw = match req.uri.authority() {
        Some(a) => a.host(),
        None => req.headers.get(HOST)?.to_str().ok()?,
    };
    Some(strip_port(raw))
}

pub(crate) fn strip_port(h: &str) -> &str {
    if h.starts_with('[') {
        return h.split_inclusive(']').next().unwrap_or(h);
    }
    match h.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => h,
    }
}

impl Matcher {
    pub fn matches(&self, req: &Parts) -> bool {
        if let Some(m) = &self.methods {
            if !m.contains(&req.method) {
                return false;
            }
        }
        // The normalised path (see `admit::admit`), without `;parameters`.
        let path = req
            .extensions
            .get::<RoutePath>()
            .map_or(req.uri.path(), |p| p.0.as_str());
        if let Some(p) = &self.path {
            let same = if self.case_insensitive {
                path.eq_ignore_ascii_case(p)
            } else {
                path == p
            };
            if !same {
                return false;
            }
        }
        if let Some(p) = &self.path_prefix {
            let head = path.as_bytes().get(..p.len());
            let starts = if self.case_insensitive {
                head.is_some_and(|h| h.eq_ignore_ascii_case(p.as_bytes()))
            } else {
                head == Some(p.as_bytes())
            };
            if !starts {
                return false;
            }
        }
        if let Some(re) = &self.path_regex {
            if !re.is_match(path) {
                return false;
            }
        }
        if let Some(h) = &self.host {
            let Some(host) = request_host(req) else {
                return false;
            };
            let ok = match h {
                HostMatch::Exact(want) => host.eq_ignore_ascii_case(want),
                HostMatch::Suffix(sfx) => {
                    host.len() > sfx.len()
                        && host.is_char_boundary(host.len() - sfx.len())
                        && host[host.len() - sfx.len()..].eq_ignore_ascii_case(sfx)
                }
            };
            if !ok {
                return false;
            }
        }
        self.headers.iter().all(|(name, m)| match m {
            HeaderMatch::Present => req.headers.contains_key(name),
            HeaderMatch::Exact(v) => req.headers.get_all(name).iter().any(|have| have == v),
        })
    }
}

impl HostMatch {
    pub fn parse(s: &str) -> HostMatch {
        match s.strip_prefix('*') {
            Some(sfx) => HostMatch::Suffix(sfx.to_ascii_lowercase()),
            None => HostMatch::Exact(s.to_ascii_lowercase()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    fn req(method: &str, uri: &str, headers: &[(&str, &str)]) -> Parts {
        let mut b = Request::builder().method(method).uri(uri);
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn host_matching() {
        let m = Matcher {
            host: Some(HostMatch::parse("*.example.com")),
            ..Default::default()
        };
        assert!(m.matches(&req("GET", "/", &[("host", "api.example.com")])));
        assert!(m.matches(&req("GET", "/", &[("host", "a.b.EXAMPLE.com:8080")])));
        assert!(!m.matches(&req("GET", "/", &[("host", "example.com")])));
        assert!(!m.matches(&req("GET", "/", &[("host", "badexample.com")])));
        assert!(!m.matches(&req("GET", "/", &[])));
        let m = Matcher {
            host: Some(HostMatch::parse("api.example.com")),
            ..Default::default()
        };
        assert!(m.matches(&req("GET", "http://API.example.com/x", &[])));
        assert!(!m.matches(&req("GET", "/", &[("host", "api.example.com.evil")])));
    }

    #[test]
    fn all_conditions_must_hold() {
        let m = Matcher {
            path_prefix: Some("/v1/".into()),
            methods: Some(vec![Method::POST]),
            headers: vec![
                (
                    HeaderName::from_static("x-tenant"),
                    HeaderMatch::Exact(HeaderValue::from_static("acme")),
                ),
                (HeaderName::from_static("x-any"), HeaderMatch::Present),
            ],
            ..Default::default()
        };
        let h = [("x-tenant", "acme"), ("x-any", "")];
        assert!(m.matches(&req("POST", "/v1/items", &h)));
        assert!(!m.matches(&req("GET", "/v1/items", &h)));
        assert!(!m.matches(&req("POST", "/v2/items", &h)));
        assert!(!m.matches(&req(
            "POST",
            "/v1/items",
            &[("x-tenant", "other"), ("x-any", "1")]
        )));
        assert!(!m.matches(&req("POST", "/v1/items", &[("x-tenant", "acme")])));
        let exact = Matcher {
            path: Some("/login".into()),
            ..Default::default()
        };
        assert!(exact.matches(&req("GET", "/login?next=/", &[])));
        assert!(!exact.matches(&req("GET", "/login/", &[])));
        let re = Matcher {
            path_regex: Some(Regex::new("^/users/[0-9]+$").unwrap()),
            ..Default::default()
        };
        assert!(re.matches(&req("GET", "/users/42", &[])));
        assert!(!re.matches(&req("GET", "/users/x", &[])));
    }
}
