//! The admin listener: `/metrics`, `/healthz`, `/readyz`, and the token-guarded
//! `/admin/*` API. It is a separate listener so that it can stay on loopback while
//! the gateway faces the world. The API only translates requests into control
//! commands and their results into answers.

use std::sync::Arc;

use bytes::Bytes;
use http::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use serde::Deserialize;

use crate::answer::{self, Body};
use crate::config::value::parse_duration;
use crate::control::{Command, Control, ControlError, Reply, Status, Trigger};
use crate::deny::{now_ms, rfc3339, Entry, EntryJson, Meta, Source, Target};
use crate::gateway::Shared;

/// Largest request body the admin API reads.
pub const MAX_BODY: usize = 64 * 1024;
/// Longest `reason` kept with an entry.
const MAX_REASON: usize = 1024;

pub struct Admin {
    pub shared: Arc<Shared>,
    pub control: Arc<Control>,
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
                if !self.shared.store.ready() {
                    answer::text(StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n")
                } else if !self.control.ready() {
                    answer::text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "shared deny list not read yet\n",
                    )
                } else {
                    answer::text(StatusCode::OK, "ready\n")
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
                self.api(req).await
            }
            _ => answer::text(StatusCode::NOT_FOUND, "not found\n"),
        }
    }

    /// `/admin/*`, once authorized.
    async fn api(&self, req: Request<Incoming>) -> Response<Body> {
        let (method, path) = (req.method().clone(), req.uri().path().to_string());
        match (path.as_str(), method) {
            ("/admin/deny", Method::GET) => json(StatusCode::OK, &self.deny_list()),
            ("/admin/deny", Method::POST) => match read::<DenyRequest>(req).await {
                Ok(r) => self.deny_add(r).await,
                Err(r) => r,
            },
            ("/admin/deny", Method::DELETE) => match read::<DenyRequest>(req).await {
                Ok(r) => self.deny_remove(r).await,
                Err(r) => r,
            },
            ("/admin/deny", _) => not_allowed("GET, POST, DELETE"),
            ("/admin/config", Method::GET) => {
                json(StatusCode::OK, &config_view(&self.control.status()))
            }
            ("/admin/config", _) => not_allowed("GET"),
            ("/admin/reload", Method::POST) => {
                match self.control.apply(Command::Reload(Trigger::Api)).await {
                    Ok(Reply::Reloaded(hash)) => json(
                        StatusCode::OK,
                        &serde_json::json!({"result": "success", "hash": hash}),
                    ),
                    Ok(other) => internal(other),
                    Err(e) => json(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        &serde_json::json!({"result": "failure", "error": e.to_string()}),
                    ),
                }
            }
            ("/admin/reload", _) => not_allowed("POST"),
            _ => answer::text(StatusCode::NOT_FOUND, "no such admin endpoint\n"),
        }
    }

    fn deny_list(&self) -> Vec<EntryJson> {
        self.control.entries().iter().map(Entry::to_json).collect()
    }

    async fn deny_add(&self, r: DenyRequest) -> Response<Body> {
        let target = match r.target() {
            Ok(t) => t,
            Err(msg) => return bad_request(&msg),
        };
        let ttl = match r.ttl.as_deref().map(|t| (t, parse_duration(t.trim()))) {
            None => None,
            Some((_, Some(d))) if d.as_millis() > 0 => Some(d),
            Some((t, _)) => {
                return bad_request(&format!(
                    "ttl {t:?} is not a duration of at least 1ms like 30s, 10m, 1h or 1d"
                ))
            }
        };
        if r.reason.as_ref().is_some_and(|s| s.len() > MAX_REASON) {
            return bad_request(&format!("reason longer than {MAX_REASON} bytes"));
        }
        let entry = Entry {
            target,
            meta: Meta {
                expires_at_ms: ttl.map(|d| now_ms().saturating_add(d.as_millis() as u64)),
                reason: r.reason.filter(|s| !s.is_empty()).map(Into::into),
                source: Source::Api,
                route: None,
            },
        };
        match self.control.apply(Command::DenyAdd(entry)).await {
            Ok(Reply::Added(e)) => json(StatusCode::CREATED, &e.to_json()),
            Ok(other) => internal(other),
            Err(e) => refused(e),
        }
    }

    async fn deny_remove(&self, r: DenyRequest) -> Response<Body> {
        if r.ttl.is_some() || r.reason.is_some() {
            return bad_request("DELETE takes only \"ip\" or \"key\"");
        }
        let target = match r.target() {
            Ok(t) => t,
            Err(msg) => return bad_request(&msg),
        };
        match self.control.apply(Command::DenyRemove(target)).await {
            Ok(Reply::Removed(_)) => {
                let mut r = Response::new(answer::full(Bytes::new()));
                *r.status_mut() = StatusCode::NO_CONTENT;
                r
            }
            Ok(other) => internal(other),
            Err(e) => refused(e),
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

/// The body of `POST` and `DELETE /admin/deny`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DenyRequest {
    #[serde(default)]
    ip: Option<String>,
    #[serde(default)]
    key: Option<String>,
    #[serde(default)]
    ttl: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

impl DenyRequest {
    fn target(&self) -> Result<Target, String> {
        match (&self.ip, &self.key) {
            (Some(ip), None) => Target::ip(ip).ok_or_else(|| {
                format!("ip {ip:?} is not an address or CIDR block like 203.0.113.7 or 10.1.0.0/16")
            }),
            (None, Some(k)) if k.is_empty() => Err("key is empty".into()),
            (None, Some(k)) => Ok(Target::Key(k.clone())),
            _ => Err("give exactly one of \"ip\" and \"key\"".into()),
        }
    }
}

/// `/admin/config`: the effective configuration and what became of the last reload.
fn config_view(s: &Status) -> serde_json::Value {
    let last = s.last_reload.as_ref().map(|r| {
        let (result, hash, error) = match &r.result {
            Ok(h) => ("success", Some(h.as_str()), None),
            Err(e) => ("failure", None, Some(e.as_str())),
        };
        serde_json::json!({
            "at": rfc3339(r.at_ms),
            "trigger": r.trigger.as_str(),
            "result": result,
            "hash": hash,
            "error": error,
        })
    });
    serde_json::json!({
        "path": s.path.display().to_string(),
        "hash": s.hash,
        "loaded_at": rfc3339(s.loaded_at_ms),
        "last_reload": last,
        "config": s.config,
    })
}

/// Reads a JSON body of at most `MAX_BODY` bytes, or the 400 to answer.
async fn read<T: serde::de::DeserializeOwned>(req: Request<Incoming>) -> Result<T, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(bad_request(&format!("body larger than {MAX_BODY} bytes")))
        }
        Err(e) => return Err(bad_request(&format!("cannot read the body: {e}"))),
    };
    // serde reads a struct from a JSON array too (`["10.0.0.1"]` as `{"ip": …}`);
    // every body of this API is an object.
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(bad_request("malformed JSON body: expected a JSON object"));
    }
    serde_json::from_slice(&body).map_err(|e| bad_request(&format!("malformed JSON body: {e}")))
}

fn json(status: StatusCode, v: &impl serde::Serialize) -> Response<Body> {
    let mut body = serde_json::to_vec(v).unwrap_or_default();
    body.push(b'\n');
    let mut r = Response::new(answer::full(body));
    *r.status_mut() = status;
    r.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

fn bad_request(msg: &str) -> Response<Body> {
    answer::text(StatusCode::BAD_REQUEST, format!("{}\n", one_line(msg)))
}

fn not_allowed(allow: &'static str) -> Response<Body> {
    let mut r = answer::text(StatusCode::METHOD_NOT_ALLOWED, "method not allowed\n");
    r.headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    r
}

fn refused(e: ControlError) -> Response<Body> {
    let status = match &e {
        ControlError::Config(_) => StatusCode::UNPROCESSABLE_ENTITY,
        ControlError::NotFound => StatusCode::NOT_FOUND,
        ControlError::Static(_) => StatusCode::CONFLICT,
        ControlError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    answer::text(status, format!("{}\n", one_line(&e.to_string())))
}

fn internal(reply: Reply) -> Response<Body> {
    tracing::error!(?reply, "admin API: unexpected reply");
    answer::text(StatusCode::INTERNAL_SERVER_ERROR, "unexpected reply\n")
}

fn one_line(s: &str) -> String {
    s.replace(['\n', '\r'], " ")
}

/// Compare without stopping at the first difference, so timing tells nothing about
/// the token (its length included: both sides are hashed first).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    let (a, b) = (
        sha1_smol::Sha1::from(a).digest().bytes(),
        sha1_smol::Sha1::from(b).digest().bytes(),
    );
    a.iter().zip(&b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
