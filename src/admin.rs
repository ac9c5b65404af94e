//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and the token-guarded
//! `/admin/*` API. It is a separate listener so that it can stay on loopback while
//! the gateway faces the world.

use std::sync::Arc;

use http::header::{HeaderValue, AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use hyper::body::Incoming;

use crate::answer::{self, Body};
use crate::gateway::Shared;

pub struct Admin {
    pub shared: Arc<Shared>,
}

impl Admin {
    pub async fn handle(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path();
        match (req.method(), path) {
            (&Method::GET, "/metrics") => {
                let mut r = Response::new(answer::full(self.shared.metrics.render()));
                r.headers_mut().insert(
                    CONTENT_TYPE,
                    HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
                );
                r
            }
            (&Method::GET, "/healthz") => answer::text(StatusCode::OK, "ok\n"),
            (&Method::GET, "/readyz") => {
                if self.shared.store.ready() {
                    answer::text(StatusCode::OK, "ready\n")
                } else {
                    answer::text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                }
            }
            (_, p) if p.starts_with("/admin/") => {
                if !self.authorized(&req) {
                    let mut r =
                        answer::text(StatusCode::UNAUTHORIZED, "missing or wrong bearer token\n");
                    r.headers_mut()
                        .insert("www-authenticate", HeaderValue::from_static("Bearer"));
                    return r;
                }
                answer::text(StatusCode::NOT_FOUND, "no such admin endpoint\n")
            }
            _ => answer::text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    fn authorized<B>(&self, req: &Request<B>) -> bool {
        // From the running configuration, so a rotated token takes effect on reload.
        let rt = self.shared.runtime.load();
        let Some(token) = &rt.admin_token else {
            return true;
        };
        let Some(given) = req
            .headers()
            .get(AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            // The scheme is case-insensitive (RFC 9110 §11.1): `bearer x` is fine.
            .and_then(|v| v.split_once(' '))
            .and_then(|(scheme, rest)| scheme.eq_ignore_ascii_case("bearer").then_some(rest))
        else {
            return false;
        };
        constant_time_eq(given.trim().as_bytes(), token.as_bytes())
    }
}

/// Compare without stopping at the first difference, so timing tells nothing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
