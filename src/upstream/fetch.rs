//! sluice's own GET of a document over HTTP/1.1 (a JWT provider's JWKS), on the
//! upstream connector: the same TLS (webpki roots) and connection rules as any
//! upstream, no pool kept between fetches.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Uri};
use http_body_util::BodyExt;

use super::health::Passive;
use super::pool::Exchanged;
use super::{Protocol, Upstream, UpstreamOpts, Via};
use crate::telemetry::metrics::ReadAheadBytes;

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{0} is not an http:// or https:// URL")]
    Url(String),
    #[error("{0}")]
    Build(#[from] super::BuildError),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Failed(String),
    #[error("answered {0}")]
    Status(StatusCode),
    #[error("the document is larger than {0} bytes")]
    TooLarge(usize),
}

/// The body of a GET of `url` answered 200, at most `max` bytes, all within
/// `timeout`.
pub async fn get(url: &str, timeout: Duration, max: usize) -> Result<Bytes, FetchError> {
    tokio::time::timeout(timeout, get_unbounded(url, max))
        .await
        .map_err(|_| FetchError::Timeout(timeout))?
}

async fn get_unbounded(url: &str, max: usize) -> Result<Bytes, FetchError> {
    let uri: Uri = url.parse().map_err(|_| FetchError::Url(url.to_string()))?;
    let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
        return Err(FetchError::Url(url.to_string()));
    };
    let origin = format!("{scheme}://{authority}");
    let opts = UpstreamOpts {
        connect_timeout: Duration::from_secs(5),
        timeout: Duration::from_secs(10),
        read_timeout: Duration::from_secs(10),
        tls_ca: None,
        max_connections: 1,
        upgrades: &[],
        body_timeout: Duration::from_secs(10),
        request_buffer: 0,
        max_buffered: 0,
        buffered: Arc::new(ReadAheadBytes::detached()),
        tunnel_idle: Duration::from_secs(10),
        probe: false,
        protocol: Protocol::Http1,
        passive: Passive {
            max_fails: 0,
            fail_timeout: Duration::from_secs(10),
        },
        check: None,
    };
    let up = Upstream::new("jwks", &[origin], opts)?;
    let target = up.targets.first().ok_or(FetchError::Url(url.to_string()))?;
    let Via::H1(pool) = &target.via else {
        return Err(FetchError::Failed("no HTTP/1.1 pool".into()));
    };
    let mut req = Request::new(crate::http::body::empty());
    *req.uri_mut() = uri
        .path_and_query()
        .map_or_else(|| Uri::from_static("/"), |p| Uri::from(p.clone()));
    let host = http::HeaderValue::from_str(authority.as_str())
        .map_err(|e| FetchError::Failed(e.to_string()))?;
    let h = req.headers_mut();
    h.insert(http::header::HOST, host);
    h.insert(
        http::header::USER_AGENT,
        http::HeaderValue::from_static("sluice-jwks"),
    );
    h.insert(
        http::header::ACCEPT,
        http::HeaderValue::from_static("application/json"),
    );
    let (mut parts, body) = req.into_parts();
    let resp = match pool
        .send(&mut parts, body, Default::default(), None)
        .await
        .map_err(|e| FetchError::Failed(e.to_string()))?
    {
        Exchanged::Response(resp, _) => resp,
        Exchanged::Switched(..) => {
            return Err(FetchError::Failed("the server switched protocols".into()))
        }
    };
    if resp.status() != StatusCode::OK {
        return Err(FetchError::Status(resp.status()));
    }
    let mut body = resp.into_body();
    let mut out = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| FetchError::Failed(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            if out.len() + data.len() > max {
                return Err(FetchError::TooLarge(max));
            }
            out.extend_from_slice(&data);
        }
    }
    Ok(Bytes::from(out))
}
