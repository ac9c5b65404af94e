//! Forwarding: one connection pool per upstream target (`pool`, its connections
//! capped), round robin over the targets, bodies streamed both ways, hop-by-hop
//! headers dropped, `X-Forwarded-*` set, the client's `Host` kept, listed `Upgrade`
//! protocols (WebSocket) spliced, and failures sorted into connect / timeout /
//! reset / busy for a 502, 504 or 503.

pub mod fetch;
pub mod h2;
pub mod health;
pub mod pool;

use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::http::h1::server::OnUpgrade;
use crate::http::request::{ClientBody, Held, ReadBody};
use crate::http::site::Relay;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Response, StatusCode, Uri, Version};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::CertificateDer;

use crate::http::body::{Body, BoxError};
use crate::http::conn::coarse_ms;
use crate::http::conn::{ConnectionHeld, LastActive};
use crate::http::fields::HOP_BY_HOP;
use crate::http::h1::framing::{connection, lists, te_lists_trailers, Connection};
use crate::http::h1::upstream::{Conn, Forwarded, RawFields, XFF, XFH, XFP};
use crate::http::transport::{Connector, NoFreeConnection};
use crate::http::wake::Deadline;
use crate::limit::per_ip::{IpSlot, PerIp};
use crate::telemetry::metrics::ReadAheadBytes;
use crate::telemetry::refusal_log::Budget;
use crate::upstream::h2::{H2Error, H2Pool};
use crate::upstream::health::{Check, Health, Passive, State};
use crate::upstream::pool::{Exchanged, Pool, ReadTimeout, SendError};

/// A kept upstream connection idle longer than this is closed.
const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(90);

#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error("upstream {upstream}: target {target:?} is not an http:// or https:// address")]
    Target { upstream: String, target: String },
    #[error("upstream {upstream}: cannot read tls_ca {path}: {reason}")]
    Ca {
        upstream: String,
        path: String,
        reason: String,
    },
    #[error("TLS setup: {0}")]
    Tls(#[from] rustls::Error),
}

/// Why forwarding failed; `status` is what the client gets.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("upstream refused the connection: {0}")]
    Connect(BoxError),
    #[error("upstream did not answer in time")]
    Timeout,
    #[error("upstream connection failed: {0}")]
    Reset(BoxError),
    #[error("request body larger than the limit")]
    TooLarge,
    #[error("no free connection to the upstream in time")]
    Busy,
    /// Reading the body ahead would have held more than `server.max_buffered_bytes`
    /// in the whole process.
    #[error("request buffers full (server.max_buffered_bytes)")]
    BuffersFull,
    /// The client's own request body failed: not the upstream's fault.
    #[error("client request body: {0}")]
    Client(ClientFault),
}

/// How a client broke its request body (`sluice_client_errors_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientFault {
    /// Not valid HTTP framing (a bad chunk size, say).
    Malformed,
    /// The connection ended before the body did.
    Aborted,
    /// The body made no progress for `server.request_body_timeout`.
    Timeout,
}

impl std::fmt::Display for ClientFault {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            ClientFault::Malformed => "malformed",
            ClientFault::Aborted => "aborted",
            ClientFault::Timeout => "timeout",
        })
    }
}

/// An error reading the client's request body, marked as the client's so `classify`
/// can tell it from the upstream's failures wherever it sits in the error chain.
#[derive(Debug, thiserror::Error)]
#[error("client request body ({fault}): {source}")]
pub struct ClientBodyError {
    pub fault: ClientFault,
    source: BoxError,
}

/// Why a stalled request body failed.
#[derive(Debug, thiserror::Error)]
#[error("no progress within {0:?}")]
struct BodyStalled(Duration);

impl ClientFault {
    /// How a client's request body (`ClientBody`) failed, from its error.
    pub fn of(e: &BoxError) -> ClientFault {
        // A bad chunk or length comes as InvalidData/InvalidInput (or a hyper parse
        // error), a body cut short as UnexpectedEof or an incomplete message;
        // anything else (a reset, an h2 stream the client cancelled) is a client
        // that went away.
        let mut fault = ClientFault::Aborted;
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&**e);
        while let Some(s) = src {
            if let Some(io) = s.downcast_ref::<std::io::Error>() {
                if matches!(
                    io.kind(),
                    std::io::ErrorKind::InvalidData | std::io::ErrorKind::InvalidInput
                ) {
                    fault = ClientFault::Malformed;
                }
            }
            if s.downcast_ref::<hyper::Error>()
                .is_some_and(|h| h.is_parse())
            {
                fault = ClientFault::Malformed;
            }
            src = s.source();
        }
        fault
    }
}

impl ClientBodyError {
    fn new(source: BoxError) -> ClientBodyError {
        ClientBodyError {
            fault: ClientFault::of(&source),
            source,
        }
    }

    fn stalled(after: Duration) -> ClientBodyError {
        ClientBodyError {
            fault: ClientFault::Timeout,
            source: BodyStalled(after).into(),
        }
    }
}

/// The client's request body, failed with `ClientFault::Timeout` when the client
/// sends nothing of it for `timeout` (as nginx's `client_body_timeout`: the time
/// between two reads, not for the whole body). The timer runs only while the body
/// is asked for and has nothing to give: an upstream that stops reading does not
/// make it the client's fault.
struct Watched {
    inner: ClientBody,
    timeout: Duration,
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Told of every frame handed on (`true` once the body is over), so the upstream's
    /// `timeout` runs from the body's last progress, not from the request head.
    progress: Option<tokio::sync::watch::Sender<bool>>,
}

impl http_body::Body for Watched {
    type Data = bytes::Bytes;
    type Error = ClientBodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, ClientBodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => {
                this.stall = None;
                let over = !matches!(frame, Some(Ok(_))) || this.inner.is_end_stream();
                if let Some(p) = &this.progress {
                    p.send_replace(over);
                }
                if over {
                    this.progress = None;
                }
                Poll::Ready(frame.map(|f| f.map_err(ClientBodyError::new)))
            }
            Poll::Pending => {
                let timeout = this.timeout;
                let stall = this
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                match stall.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Some(Err(ClientBodyError::stalled(timeout)))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl ProxyError {
    pub fn status(&self) -> StatusCode {
        match self {
            ProxyError::Connect(_) | ProxyError::Reset(_) => StatusCode::BAD_GATEWAY,
            ProxyError::Timeout => StatusCode::GATEWAY_TIMEOUT,
            ProxyError::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ProxyError::Client(ClientFault::Timeout) => StatusCode::REQUEST_TIMEOUT,
            ProxyError::Client(_) => StatusCode::BAD_REQUEST,
            ProxyError::Busy | ProxyError::BuffersFull => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// What an upstream is spoken to in (`upstreams.*.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Protocol {
    #[default]
    Http1,
    /// HTTP/2 with prior knowledge, cleartext.
    H2c,
    /// HTTP/2 over TLS.
    H2,
    /// Over TLS, what ALPN picks; HTTP/1.1 in cleartext.
    Auto,
}

/// How a target is spoken to: its pool of connections.
enum Via {
    H1(Arc<Pool>),
    H2(Arc<H2Pool>),
    /// `auto` over TLS: HTTP/2 until a connection's ALPN picks HTTP/1.1, then that.
    Auto(Arc<Pool>, Arc<H2Pool>),
}

/// One target of an upstream, with its own pool and its share of the upstream's
/// connections.
struct Target {
    scheme: Scheme,
    authority: Authority,
    via: Via,
    /// Failure lines written about this target, at most `FAILURE_LINES` a second.
    failures: Budget,
    /// In use or left out (`max_fails`, `health_check`).
    health: Health,
}

/// Lines a second, at most, about one target's failures (the rest are counted in
/// the next line's `dropped`, and all of them in `sluice_upstream_errors_total`).
pub const FAILURE_LINES: u64 = 3;

impl Target {
    /// `scheme://host:port`: its `target` label.
    fn label(&self) -> String {
        format!("{}://{}", self.scheme, self.authority)
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{}://{}", self.scheme, self.authority)
    }
}

pub struct Upstream {
    pub name: String,
    /// Everything it was built from (`UpstreamOpts::spec`): a reload keeps an
    /// upstream whose spec is unchanged.
    pub spec: String,
    targets: Vec<Target>,
    next: AtomicUsize,
    timeout: Duration,
    /// `Upgrade` protocols passed through, lower-case.
    upgrades: Vec<String>,
    /// `server.request_body_timeout`.
    body_timeout: Duration,
    /// `server.request_buffer`.
    request_buffer: usize,
    /// `server.max_buffered_bytes`, and the bytes read ahead in the whole process.
    max_buffered: usize,
    buffered: Arc<ReadAheadBytes>,
    /// `server.tunnel_idle_timeout`.
    tunnel_idle: Duration,
    /// Connections held at the client's pace (uploads still streaming, upgraded
    /// tunnels), per client address, and how many one address may hold
    /// (`client_share`).
    held: Arc<PerIp>,
    share: usize,
    /// `upstreams.*.probe`: whether `warn_absent` connects to its targets.
    probe: bool,
    /// `max_fails` and `fail_timeout`.
    passive: Passive,
    /// `health_check`, when the targets are checked actively.
    check: Option<Check>,
}

/// How an upstream is reached, beyond its targets.
pub struct UpstreamOpts<'a> {
    pub connect_timeout: Duration,
    pub timeout: Duration,
    /// The longest silence between two reads of a response body.
    pub read_timeout: Duration,
    pub tls_ca: Option<&'a Path>,
    /// At most this many connections, split evenly across the targets; a request
    /// that finds none free waits up to `connect_timeout`, then fails `Busy`.
    pub max_connections: usize,
    /// `server.upgrades`: the `Upgrade` protocols passed through.
    pub upgrades: &'a [String],
    /// `server.request_body_timeout`: the longest a request body may stall.
    pub body_timeout: Duration,
    /// `server.request_buffer`: how much of a request body is read before an
    /// upstream connection is taken for it.
    pub request_buffer: usize,
    /// `server.max_buffered_bytes`: the most request body bytes read ahead in the
    /// whole process, counted in `buffered` (one for the process, kept across
    /// reloads).
    pub max_buffered: usize,
    pub buffered: Arc<ReadAheadBytes>,
    /// `server.tunnel_idle_timeout`: a tunnel with no bytes either way this long
    /// is closed.
    pub tunnel_idle: Duration,
    /// Whether `warn_absent` probes its targets (`upstreams.*.probe`).
    pub probe: bool,
    /// `upstreams.*.protocol`.
    pub protocol: Protocol,
    /// `max_fails`, `fail_timeout`.
    pub passive: Passive,
    /// `health_check`.
    pub check: Option<Check>,
}

impl UpstreamOpts<'_> {
    /// What an upstream built from these options and `targets` is: equal specs build
    /// equal upstreams. The CA file's content is part of it (hashed), so a reload
    /// after replacing the file takes the new one.
    pub fn spec(&self, name: &str, targets: &[String]) -> String {
        let ca = self.tls_ca.map(|p| {
            let content = std::fs::read(p).unwrap_or_default();
            (
                p.display().to_string(),
                sha1_smol::Sha1::from(content).digest().to_string(),
            )
        });
        format!(
            "{name}|{targets:?}|{:?}|{:?}|{:?}|{:?}|{ca:?}|{}|{:?}|{:?}|{}|{}|{:?}|{:?}|{:?}",
            self.protocol,
            self.connect_timeout,
            self.timeout,
            self.read_timeout,
            self.max_connections,
            self.upgrades,
            self.body_timeout,
            self.request_buffer,
            self.max_buffered,
            self.tunnel_idle,
            self.passive,
            self.check
        )
    }
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("name", &self.name)
            .field("targets", &self.targets)
            .finish()
    }
}

/// What the proxy needs to know about the client connection.
pub struct Origin<'a> {
    /// The client's address (`client_ip`): what its streaming uploads are counted by.
    pub client: std::net::IpAddr,
    /// The TCP peer as an `X-Forwarded-For` entry (canonical form).
    pub peer_forwarded_for: &'a HeaderValue,
    /// Whether the peer is a trusted proxy (its `X-Forwarded-Proto/-Host` are kept).
    pub trusted: bool,
    /// `http` or `https`: how the client reached us.
    pub proto: &'static str,
}

impl Upstream {
    pub fn new(name: &str, targets: &[String], o: UpstreamOpts) -> Result<Upstream, BuildError> {
        let spec = o.spec(name, targets);
        let addrs = targets
            .iter()
            .map(|t| {
                let uri: Uri = t.parse().map_err(|_| BuildError::Target {
                    upstream: name.into(),
                    target: t.clone(),
                })?;
                match (uri.scheme(), uri.authority()) {
                    (Some(s), Some(a)) if *s == Scheme::HTTP || *s == Scheme::HTTPS => {
                        Ok((s.clone(), a.clone()))
                    }
                    _ => Err(BuildError::Target {
                        upstream: name.into(),
                        target: t.clone(),
                    }),
                }
            })
            .collect::<Result<Vec<_>, BuildError>>()?;
        let (connect_timeout, tls_ca) = (o.connect_timeout, o.tls_ca);

        let mut roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        if let Some(path) = tls_ca {
            let ca_err = |reason: String| BuildError::Ca {
                upstream: name.into(),
                path: path.display().to_string(),
                reason,
            };
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| ca_err(e.to_string()))? {
                let cert = cert.map_err(|e| ca_err(e.to_string()))?;
                roots.add(cert).map_err(|e| ca_err(e.to_string()))?;
            }
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let base = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots)
            .with_no_client_auth();
        // What ALPN offers: HTTP/1.1 for `http1` (and `auto`'s HTTP/1.1 pool),
        // `h2` for `h2`, both (h2 first) for `auto`.
        let alpn = |protocols: &[&[u8]]| {
            let mut c = base.clone();
            c.alpn_protocols = protocols.iter().map(|p| p.to_vec()).collect();
            Arc::new(c)
        };
        let tls = alpn(&[b"http/1.1"]);
        let tls_h2 = alpn(&[b"h2"]);
        let tls_auto = alpn(&[b"h2", b"http/1.1"]);

        // Validation keeps max_connections at least the number of targets.
        let n = addrs.len().max(1);
        let targets = addrs
            .into_iter()
            .enumerate()
            .map(|(i, (scheme, authority))| {
                let share = (o.max_connections / n + usize::from(i < o.max_connections % n)).max(1);
                let https = scheme == Scheme::HTTPS;
                let port = authority.port_u16().unwrap_or(if https { 443 } else { 80 });
                let connector = |tls: &Arc<rustls::ClientConfig>| {
                    Connector::new(
                        authority.host(),
                        port,
                        https.then(|| tls.clone()),
                        connect_timeout,
                        share,
                    )
                    .map_err(|_| BuildError::Target {
                        upstream: name.into(),
                        target: format!("{scheme}://{authority}"),
                    })
                };
                let h1 = |c| Arc::new(Pool::new(c, POOL_IDLE_TIMEOUT, o.read_timeout));
                let h2 =
                    |c, auto| Arc::new(H2Pool::new(c, auto, POOL_IDLE_TIMEOUT, o.read_timeout));
                // (Validation keeps h2 to https:// and h2c to http://.)
                let via = match o.protocol {
                    Protocol::Http1 => Via::H1(h1(connector(&tls)?)),
                    Protocol::Auto if !https => Via::H1(h1(connector(&tls)?)),
                    Protocol::H2c => Via::H2(h2(connector(&tls)?, false)),
                    Protocol::H2 => Via::H2(h2(connector(&tls_h2)?, false)),
                    // One cap for both pools: a connection the HTTP/2 pool opens
                    // and hands over keeps its slot.
                    Protocol::Auto => {
                        let h1_connector = connector(&tls)?;
                        let h2_connector = connector(&tls_auto)?.sharing_slots(&h1_connector);
                        Via::Auto(h1(h1_connector), h2(h2_connector, true))
                    }
                };
                Ok(Target {
                    scheme,
                    authority,
                    via,
                    failures: Budget::new(FAILURE_LINES),
                    health: Health::default(),
                })
            })
            .collect::<Result<Vec<_>, BuildError>>()?;
        Ok(Upstream {
            name: name.into(),
            spec,
            targets,
            next: AtomicUsize::new(0),
            timeout: o.timeout,
            upgrades: o.upgrades.iter().map(|u| u.to_ascii_lowercase()).collect(),
            body_timeout: o.body_timeout,
            request_buffer: o.request_buffer,
            max_buffered: o.max_buffered,
            buffered: o.buffered,
            tunnel_idle: o.tunnel_idle,
            held: Arc::default(),
            share: client_share(o.max_connections),
            probe: o.probe,
            passive: o.passive,
            check: o.check,
        })
    }

    /// The `Upgrade` value to pass on: the offered protocols that are listed in
    /// `server.upgrades` (by name, any case), or `None`.
    fn allowed_upgrade(&self, h: &HeaderMap) -> Option<HeaderValue> {
        let offered: Vec<&str> = h
            .get_all(header::UPGRADE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| {
                let name = t.split('/').next().unwrap_or("").trim();
                self.upgrades.iter().any(|u| u.eq_ignore_ascii_case(name))
            })
            .collect();
        if offered.is_empty() {
            return None;
        }
        HeaderValue::from_str(&offered.join(", ")).ok()
    }

    /// The next target in turn (round robin) that is in use: its number, for
    /// `forward`. A target left out is passed over, unless its time out is over and
    /// no other request is trying it; when every target is out, the next in turn.
    #[inline]
    pub fn pick(&self) -> usize {
        let n = self.targets.len();
        let t = self.next.fetch_add(1, Ordering::Relaxed) % n;
        if n == 1 || self.targets[t].health.in_use() {
            return t;
        }
        self.pick_past(t)
    }

    #[cold]
    fn pick_past(&self, first: usize) -> usize {
        let n = self.targets.len();
        let now = coarse_ms();
        (0..n)
            .map(|k| (first + k) % n)
            .find(|&t| self.targets[t].health.claim(now, &self.passive))
            .unwrap_or(first)
    }

    /// The targets a request tries after target `from` could not be reached, each
    /// once, in turn: those in use (or due a try) first, then those left out.
    #[cold]
    fn failover_order(&self, from: usize) -> std::vec::IntoIter<usize> {
        let n = self.targets.len();
        let now = coarse_ms();
        let (mut usable, out): (Vec<usize>, Vec<usize>) = (1..n)
            .map(|k| (from + k) % n)
            .partition(|&t| self.targets[t].health.usable(now));
        usable.extend(out);
        usable.into_iter()
    }

    /// Each target as `scheme://host:port` (its `target` label) and its state now.
    pub fn target_states(&self) -> Vec<(String, State)> {
        let now = coarse_ms();
        self.targets
            .iter()
            .map(|t| (t.label(), t.health.state(now)))
            .collect()
    }

    /// Each target's `target` label.
    pub fn target_labels(&self) -> impl Iterator<Item = String> + '_ {
        self.targets.iter().map(Target::label)
    }

    /// The HTTP/2 pool of target `t`, when it speaks HTTP/2 (`auto`: until it
    /// picked HTTP/1.1).
    fn h2_of(t: &Target) -> Option<&Arc<H2Pool>> {
        match &t.via {
            Via::H1(_) => None,
            Via::H2(h2) => Some(h2),
            Via::Auto(_, h2) => (!h2.picked_http1()).then_some(h2),
        }
    }

    /// Target number `t`'s address as written (`host:port`), as logs name it.
    pub fn target_addr(&self, t: usize) -> &str {
        self.targets[t % self.targets.len()].authority.as_str()
    }

    /// Whether a line about a failure of target `t` may be written now (a few a
    /// second per target): `Some(lines dropped since the last one written)`.
    pub fn failure_line(&self, t: usize) -> Option<u64> {
        let second = crate::deny::now_ms() / 1000;
        self.targets[t % self.targets.len()].failures.admit(second)
    }

    /// One connection attempt to every target (no retries, within the connect
    /// timeout, the TLS handshake included): the targets that failed, with why.
    /// At startup and after a reload, so an upstream nothing listens on is logged at
    /// once rather than found by the first request.
    pub async fn probe(&self) -> Vec<(String, BoxError)> {
        let mut failed = Vec::new();
        for t in &self.targets {
            let probed = match &t.via {
                Via::H1(pool) => pool.probe().await,
                Via::H2(pool) | Via::Auto(_, pool) => pool.probe().await,
            };
            if let Err(e) = probed {
                failed.push((format!("{}://{}", t.scheme, t.authority), e));
            }
        }
        failed
    }

    /// The upstream's response head to `sent`, within `timeout`: counted from the end of the
    /// request body (`sending` reports its progress), and while the body is being sent,
    /// from its last progress. A slow but steady upload is no upstream timeout; an
    /// upstream that stops taking the body is; a client that stops sending it is the
    /// client's (`request_body_timeout`).
    ///
    /// (`sent` is pinned by the caller: a future taken by value and pinned here
    /// would be kept twice in this one's state, and copied on every call.)
    ///
    /// `timer`, when given, is the client connection's, set to the deadline instead
    /// of a timer of the request's own.
    async fn response_head<F: std::future::Future>(
        &self,
        mut sent: Pin<&mut F>,
        sending: Option<tokio::sync::watch::Receiver<bool>>,
        timer: Option<Pin<&mut Deadline>>,
        timeout: Duration,
    ) -> Result<F::Output, TimedOut> {
        if let Some(mut sending) = sending {
            loop {
                tokio::select! {
                    r = &mut sent => return Ok(r),
                    changed = tokio::time::timeout(timeout, sending.changed()) => match changed {
                        Err(_) => return Err(TimedOut),
                        // A frame went on: the clock starts again.
                        Ok(Ok(())) if !*sending.borrow_and_update() => {}
                        // The body is over (or was dropped with an error).
                        Ok(_) => break,
                    },
                }
            }
        }
        match timer {
            Some(mut timer) => {
                timer.as_mut().set(tokio::time::Instant::now() + timeout);
                tokio::select! {
                    biased;
                    r = sent => Ok(r),
                    () = timer.passed() => Err(TimedOut),
                }
            }
            None => tokio::time::timeout(timeout, sent)
                .await
                .map_err(|_| TimedOut),
        }
    }

    /// Forward `req` to target number `*at` (`pick`), or, when no connection to it
    /// can be made, to the next (`failover_order`), each target once: `*at` is the
    /// target that answered or failed last, and `passed_over` is told of each
    /// target left behind and why. A request is sent to another target only when
    /// nothing of it was written. The answer comes with a streaming body.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn forward(
        &self,
        at: &mut usize,
        parts: &mut http::request::Parts,
        body: ClientBody,
        origin: &Origin<'_>,
        max_body: u64,
        relay: Option<Relay<'_>>,
        mut passed_over: impl FnMut(usize, &ProxyError),
    ) -> Result<Response<Body>, ProxyError> {
        let (timer, raw) = match relay {
            Some(Relay { timer, raw }) => (Some(timer), raw),
            None => (None, None),
        };
        *at %= self.targets.len();
        let mut target = &self.targets[*at];
        // The HTTP/2 pool, when the target speaks HTTP/2 (`auto`: until it picked
        // HTTP/1.1).
        let mut h2 = Self::h2_of(target);
        let speaks_h2 = h2.is_some();
        // Only listed protocols are spliced: any other `Upgrade` (h2c above all,
        // whose tunnel would carry requests past every route and limit) is dropped
        // with the hop-by-hop headers and the request forwarded as a plain one. An
        // HTTP/2 upstream has no upgrades (RFC 9113 §8.6): the same.
        let upgrade_proto = if h2.is_none() && wants_upgrade(&parts.headers) {
            self.allowed_upgrade(&parts.headers)
        } else {
            None
        };
        // The client's connection, once the 101 is written, and its slots: put on
        // the request by sluice's HTTP/1.1 server (the request itself is never
        // rebuilt: it is worked on in place, not moved).
        let upgrading = upgrade_proto.is_some();
        let client_upgrade = upgrading.then(|| parts.extensions.remove::<OnUpgrade>());
        let held = upgrading
            .then(|| parts.extensions.remove::<ConnectionHeld>())
            .flatten();

        // The target's authority (HTTP/2 `:authority`, HTTP/1.1 absolute-form) wins
        // over `Host`, as in routing (RFC 9112 §3.2.2, RFC 9113 §8.3.1): otherwise a
        // client could be routed by one host and served by another.
        // (Without an authority, the `Host` sent is the client's, where it stands.)
        let host_is_the_field = parts.uri.authority().is_none();
        let host = parts
            .uri
            .authority()
            .and_then(|a| {
                let hostport = a.as_str().rsplit_once('@').map_or(a.as_str(), |(_, h)| h);
                HeaderValue::from_str(hostport).ok()
            })
            .or_else(|| parts.headers.get(header::HOST).cloned());
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        // Origin-form on the wire; the target is the connection's.
        parts.uri = Uri::from(path);
        // gRPC is HTTP/2 only: an `application/grpc` body over HTTP/1.1 is read
        // ahead like any other.
        let grpc = parts.version == Version::HTTP_2 && is_grpc(&parts.headers);
        // A gRPC call's own deadline, when sooner, is the upstream's timeout.
        let timeout = match grpc.then(|| grpc_timeout(&parts.headers)).flatten() {
            Some(t) => t.min(self.timeout),
            None => self.timeout,
        };
        parts.version = Version::HTTP_11;
        // Settings for an h2c upgrade, never passed on (RFC 9113 §3.2.1 drops the upgrade).
        if any_of(&parts.headers, std::slice::from_ref(&HTTP2_SETTINGS)) {
            parts.headers.remove(&HTTP2_SETTINGS);
        }
        let accepts_trailers = te_has_trailers(&parts.headers);
        let named_gone = strip_hop_by_hop(&mut parts.headers);
        if accepts_trailers {
            // TE is hop-by-hop, but without it the upstream drops its trailers:
            // say for ourselves that we pass them on (RFC 9110 §10.1.4).
            parts
                .headers
                .insert(header::TE, HeaderValue::from_static("trailers"));
        }
        if let Some(proto) = upgrade_proto {
            parts
                .headers
                .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
            parts.headers.insert(header::UPGRADE, proto);
        }
        let mut fwd = forwarded(&mut parts.headers, origin, host.as_ref());
        // The client's `Host` is in the map already, where it came (`admit` lets one
        // through at most): inserted again, it would cost a hashed lookup to change
        // nothing. Unless its `Connection` named it, and it went with the hop-by-hop
        // fields.
        let host_stays = host_is_the_field && host.is_some() && !named_gone;
        if !host_stays {
            if let Some(h) = back_host(&host, target) {
                parts.headers.insert(header::HOST, h);
            }
        }

        // A failure of the client's body (a stall too) carries its mark through the
        // pool to `classify` (`UploadError::Body`, then `SendError::Send`).
        let (progress, sending) = if http_body::Body::is_end_stream(&body) {
            (None, None)
        } else {
            let (tx, rx) = tokio::sync::watch::channel(false);
            (Some(tx), Some(rx))
        };
        // A request with no body (most) is sent with an empty one: nothing to watch,
        // limit or allocate.
        let mut body: Body = if sending.is_none() {
            crate::http::body::empty()
        } else {
            let body = Watched {
                inner: body,
                timeout: self.body_timeout,
                stall: None,
                progress,
            };
            Body::new(
                Limited::new(body, usize::try_from(max_body).unwrap_or(usize::MAX))
                    .map_err(BoxError::from),
            )
        };
        // A slow upload costs the upstream nothing until its body (or the first
        // `request_buffer` bytes of it) has come: only then is a connection taken.
        // (A body's failure here is the client's, sorted as it would be mid-send.)
        // (An upgrade's handshake has no body; one that has is read like any other.)
        let mut streaming = !http_body::Body::is_end_stream(&body);
        if streaming && self.request_buffer > 0 && !grpc {
            // Boxed: its state would otherwise grow every request's future, bodiless
            // ones too.
            let budget = (&self.buffered, self.max_buffered);
            let ahead = Box::pin(read_ahead(body, self.request_buffer, budget)).await?;
            (body, streaming) = (ahead.body, ahead.streaming);
        }
        // An upload that still streams (past `request_buffer`, a gRPC call, or with
        // no read-ahead) and an upgraded tunnel hold their upstream connection at the
        // client's pace: one address may hold at most `share` of them, so it cannot
        // take every connection (503 beyond it, as when the upstream is busy).
        let share = if upgrading || streaming {
            let Some(slot) = PerIp::take(&self.held, origin.client, self.share) else {
                tracing::debug!(upstream = %self.name, client = %origin.client, share = self.share, "refused: the address holds its share of the upstream's connections");
                return Err(ProxyError::Busy);
            };
            Some(slot)
        } else {
            None
        };
        // A tunnel keeps its share until it closes; an upload, until its body ends.
        let (tunnel_share, upload_share) = if upgrading {
            (share, None)
        } else {
            (None, share)
        };
        if let Some(slot) = upload_share {
            body = Body::new(Uploading {
                inner: body,
                slot: Some(slot),
            });
        }
        let mut timer = timer;
        // (An upgrade's answer is spliced, never written from its fields.)
        let mut raw = raw.filter(|_| !upgrading);
        // The targets still to try, made at the first that cannot be reached.
        let mut rest: Option<std::vec::IntoIter<usize>> = None;
        let resp = loop {
            // The HTTP/1.1 pool to send on, or why the request went nowhere.
            let pool = match (&target.via, h2) {
                (_, Some(h2)) => {
                    fwd.put_in_map(&mut parts.headers);
                    let req = h2_request(parts, target, body);
                    // Boxed: its state would otherwise grow every request's future,
                    // HTTP/1.1 ones too.
                    let head = Box::pin(async {
                        let sent = std::pin::pin!(h2.send(req));
                        let timer = timer.as_mut().map(|t| t.as_mut());
                        self.response_head(sent, sending.clone(), timer, timeout)
                            .await
                    });
                    match head.await {
                        Err(_) => return Err(ProxyError::Timeout),
                        Ok(Ok(resp)) => {
                            target.health.connected(&self.name, target);
                            return Ok(resp);
                        }
                        Ok(Err(H2Error::Unsent(req, e))) => {
                            let (back, b) = req.into_parts();
                            parts.headers = back.headers;
                            body = b;
                            Err(e)
                        }
                        Ok(Err(H2Error::Send(SendError::Connect(e) | SendError::Unsent(e, _)))) => {
                            return Err(classify(e, true))
                        }
                        Ok(Err(H2Error::Send(SendError::Send(e)))) => {
                            target.health.connected(&self.name, target);
                            return Err(classify(e, false));
                        }
                        // `auto`, and the target picked HTTP/1.1: the request goes on
                        // the connection it picked it on, in the HTTP/1.1 pool.
                        Ok(Err(H2Error::Http1(req, link))) => {
                            let Via::Auto(pool, _) = &target.via else {
                                return Err(ProxyError::Reset(
                                    "the upstream refused HTTP/2 by ALPN".into(),
                                ));
                            };
                            let (back, b) = req.into_parts();
                            parts.headers = back.headers;
                            // (`h2_request` took it for `:authority`.)
                            if let Some(h) = back_host(&host, target) {
                                parts.headers.insert(header::HOST, h);
                            }
                            body = b;
                            pool.adopt(Conn::new(link));
                            Ok(pool)
                        }
                    }
                }
                (Via::H1(pool) | Via::Auto(pool, _), None) => Ok(pool),
                (Via::H2(_), None) => unreachable!("an HTTP/2 target always has its pool"),
            };
            let unsent = match pool {
                Err(e) => e,
                Ok(pool) => {
                    let sent = self.send_h1(
                        pool, parts, body, fwd, &mut raw, &sending, &mut timer, timeout,
                    );
                    match sent.await {
                        Ok(sent) => break sent,
                        Err(Unsent(e, b)) => {
                            body = b;
                            e
                        }
                    }
                }
            };
            // No connection could be made: the request, not written, may go to the
            // next target (in the same protocol: its fields were made for it).
            let error = classify(unsent, true);
            if !matches!(error, ProxyError::Connect(_) | ProxyError::Timeout) {
                return Err(error);
            }
            target.health.failed(&self.name, target, &self.passive);
            let next = rest
                .get_or_insert_with(|| self.failover_order(*at))
                .find(|&t| Self::h2_of(&self.targets[t]).is_some() == speaks_h2);
            let Some(next) = next else {
                return Err(error);
            };
            passed_over(*at, &error);
            *at = next;
            target = &self.targets[next];
            h2 = Self::h2_of(target);
            if let Some(h) = back_host(&host, target) {
                parts.headers.insert(header::HOST, h);
            }
        };
        // A connection was made (what failed on it is no reason to leave it out).
        if matches!(resp, Ok(_) | Err(ProxyError::Reset(_))) {
            target.health.connected(&self.name, target);
        }
        let (mut resp, hop_by_hop) = match resp {
            Err(e) => return Err(e),
            Ok(Exchanged::Response(r, hop_by_hop)) => (r, hop_by_hop),
            Ok(Exchanged::Switched(parts, conn)) => {
                return match client_upgrade {
                    Some(client_upgrade) => Ok(splice(
                        parts,
                        *conn,
                        client_upgrade,
                        (held, tunnel_share),
                        self.tunnel_idle,
                    )),
                    // A switch nobody asked for: its connection speaks something
                    // else now.
                    None => Err(ProxyError::Reset(
                        "the upstream switched protocols without an upgrade request".into(),
                    )),
                };
            }
        };
        // (Known from reading the head: most answers have none.)
        if hop_by_hop {
            strip_hop_by_hop(resp.headers_mut());
        }
        Ok(resp)
    }
}

/// A request that no connection could be made for, given back: why, and its body.
struct Unsent(BoxError, Body);

impl Upstream {
    /// `forward` on an HTTP/1.1 pool: the answer, or an error sorted as the
    /// client gets it, or the request given back when no connection could be made.
    #[allow(clippy::too_many_arguments)]
    async fn send_h1(
        &self,
        pool: &Arc<Pool>,
        parts: &mut http::request::Parts,
        body: Body,
        fwd: Forwarded<'_>,
        raw: &mut Option<&mut Option<RawFields>>,
        sending: &Option<tokio::sync::watch::Receiver<bool>>,
        timer: &mut Option<Pin<&mut Deadline>>,
        timeout: Duration,
    ) -> Result<Result<Exchanged, ProxyError>, Unsent> {
        let sent = std::pin::pin!(pool.send(parts, body, fwd, raw.as_deref_mut()));
        let timer = timer.as_mut().map(|t| t.as_mut());
        Ok(
            match self
                .response_head(sent, sending.clone(), timer, timeout)
                .await
            {
                Err(_) => Err(ProxyError::Timeout),
                Ok(Err(SendError::Unsent(e, body))) => return Err(Unsent(e, body)),
                Ok(Err(SendError::Connect(e))) => Err(classify(e, true)),
                Ok(Err(SendError::Send(e))) => Err(classify(e, false)),
                Ok(Ok(exchanged)) => Ok(exchanged),
            },
        )
    }
}

/// Probes `upstreams` in a task of their own (`Upstream::probe`) and logs one WARN
/// per target that takes no connection: at startup, and for the upstreams a reload
/// built anew (an unchanged upstream is not probed again).
pub fn warn_absent(upstreams: Vec<Arc<Upstream>>) {
    if upstreams.is_empty() {
        return;
    }
    let upstreams: Vec<_> = upstreams.into_iter().filter(|up| up.probe).collect();
    if upstreams.is_empty() {
        return;
    }
    tokio::spawn(async move {
        for up in upstreams {
            for (target, error) in up.probe().await {
                tracing::warn!(
                    upstream = %up.name,
                    target,
                    %error,
                    "upstream target takes no connection: requests routed to it will get 502 until it does"
                );
            }
        }
    });
}

/// The `Host` a request goes upstream with: the client's, else the target's.
fn back_host(client: &Option<HeaderValue>, target: &Target) -> Option<HeaderValue> {
    match client {
        Some(h) => Some(h.clone()),
        None => HeaderValue::from_str(target.authority.as_str()).ok(),
    }
}

/// The request to send to an HTTP/2 target: the client's `Host` (or else the
/// target's authority) as `:authority`, the target's scheme as `:scheme`, the
/// fields (hop-by-hop ones already gone) taken from `parts`, which keeps its method
/// and path for the request's log lines.
fn h2_request(
    parts: &mut http::request::Parts,
    target: &Target,
    body: Body,
) -> http::Request<Body> {
    let authority = parts
        .headers
        .remove(header::HOST)
        .and_then(|h| Authority::try_from(h.as_bytes()).ok())
        .unwrap_or_else(|| target.authority.clone());
    let mut uri = http::uri::Parts::default();
    uri.scheme = Some(target.scheme.clone());
    uri.authority = Some(authority);
    uri.path_and_query = Some(
        parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/")),
    );
    let mut req = http::Request::new(body);
    *req.method_mut() = parts.method.clone();
    if let Ok(uri) = Uri::from_parts(uri) {
        *req.uri_mut() = uri;
    }
    *req.version_mut() = Version::HTTP_2;
    *req.headers_mut() = std::mem::take(&mut parts.headers);
    req
}

/// A gRPC call's `grpc-timeout` (gRPC over HTTP/2: at most 8 digits and a unit,
/// `H`, `M`, `S`, `m`, `u` or `n`), or `None` when it has none or it is malformed.
pub fn grpc_timeout(h: &HeaderMap) -> Option<Duration> {
    let v = h.get("grpc-timeout")?.as_bytes();
    let (&unit, digits) = v.split_last()?;
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// No answer from the upstream within its `timeout`.
struct TimedOut;

/// A gRPC request (`application/grpc`, `application/grpc+proto`, ...): its
/// messages go both ways at once (a bidirectional call waits for answers before it
/// sends more), so its body is never read ahead (it is capped per client instead).
pub fn is_grpc(h: &HeaderMap) -> bool {
    const GRPC: &[u8] = b"application/grpc";
    h.get(header::CONTENT_TYPE).is_some_and(|v| {
        let v = v.as_bytes();
        v.len() >= GRPC.len()
            && v[..GRPC.len()].eq_ignore_ascii_case(GRPC)
            && matches!(v.get(GRPC.len()), None | Some(b'+' | b';'))
    })
}

/// The share of an upstream's `max_connections` that one client address may hold
/// with uploads still streaming and tunnels: a quarter, at least one.
fn client_share(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}

/// A request body read ahead, and whether more of it is still to come.
struct Ahead {
    body: Body,
    streaming: bool,
}

/// Read `body` until it ends or `limit` bytes of it have come; the body to send,
/// which gives those frames, then the rest as it comes.
async fn read_ahead(
    mut body: Body,
    limit: usize,
    (buffered, max): (&Arc<ReadAheadBytes>, usize),
) -> Result<Ahead, ProxyError> {
    let hint = http_body::Body::size_hint(&body);
    let mut frames = std::collections::VecDeque::new();
    let mut read = 0;
    // What this request holds of the process's budget, given back as its frames go
    // on (or when it is dropped).
    let mut held = HeldBytes {
        buffered: buffered.clone(),
        bytes: 0,
    };
    let rest = loop {
        let Some(frame) = body
            .frame()
            .await
            .transpose()
            .map_err(|e| classify(e, false))?
        else {
            break None;
        };
        let len = frame.data_ref().map_or(0, |d| d.len());
        // Past the bound, the request is answered 503 and its bytes are let go at
        // once (an HTTP/2 stream's buffered data with it), rather than waiting:
        // a wait would keep them, and the client's unread bytes, in memory.
        if !buffered.take(len, max) {
            buffered.refused.inc();
            tracing::debug!(
                held = buffered.held(),
                max,
                "refused: read-ahead over server.max_buffered_bytes"
            );
            return Err(ProxyError::BuffersFull);
        }
        held.bytes += len;
        read += len;
        frames.push_back(frame);
        if http_body::Body::is_end_stream(&body) {
            break None;
        }
        if read >= limit {
            break Some(body);
        }
    };
    let streaming = rest.is_some();
    let body = Body::new(ReadAhead::of_frames(frames, held, rest, hint));
    Ok(Ahead { body, streaming })
}

/// An upload that streams at the client's pace, holding its address's share
/// (`Upstream::held`) until it ends, fails or is dropped.
struct Uploading {
    inner: Body,
    slot: Option<IpSlot>,
}

impl http_body::Body for Uploading {
    type Data = bytes::Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, BoxError>>> {
        let frame = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(frame, Poll::Ready(None | Some(Err(_)))) || self.inner.is_end_stream() {
            self.slot = None;
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A request body read ahead (`read_ahead`): the frames read, then the rest; its
/// trailers are among the frames.
type ReadAhead = ReadBody<Body, HeldBytes>;

/// Bytes a read-ahead holds of the process's count (`ReadAheadBytes`), given back
/// when it is dropped.
struct HeldBytes {
    buffered: Arc<ReadAheadBytes>,
    bytes: usize,
}

impl Held for HeldBytes {
    fn handed(&mut self, bytes: usize) {
        self.bytes -= bytes;
        self.buffered.give(bytes);
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        self.buffered.give(self.bytes);
    }
}

/// In the extensions of a 101 answer: closed when the spliced tunnel ends, so the
/// end of the request (its tally, its concurrency slots) can wait for it.
#[derive(Clone)]
pub struct TunnelEnd(pub tokio::sync::watch::Receiver<()>);

/// Pass a 101 answer on and join the two upgraded connections once both sides
/// have switched. The tunnel is closed (both connections) once no byte has
/// crossed it, either way, for `idle` (nginx's `proxy_read_timeout`).
fn splice(
    mut parts: http::response::Parts,
    upstream: Conn,
    // (None: the client's server cannot hand its connection over.)
    client: Option<OnUpgrade>,
    // The client connection's slots, and the client's share of the upstream: both
    // held until the tunnel closes.
    held: (Option<ConnectionHeld>, Option<IpSlot>),
    idle: Duration,
) -> Response<Body> {
    let (open, end) = tokio::sync::watch::channel(());
    tokio::spawn(async move {
        let _open = open;
        let _held = held;
        let Some(c) = client.map(OnUpgrade::upgraded) else {
            tracing::debug!("upgrade failed on the client's side");
            return;
        };
        let Some(c) = c.await else {
            tracing::debug!("upgrade failed on the client's side");
            return;
        };
        let last = Arc::new(LastActive::new());
        let mut c = Active {
            io: c,
            last: last.clone(),
        };
        let mut u = Active {
            io: upstream,
            last: last.clone(),
        };
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut c, &mut u) => {}
            _ = last.idle(idle) => tracing::debug!(?idle, "tunnel idle: closed"),
        }
    });
    parts.extensions.insert(TunnelEnd(end));
    Response::from_parts(parts, crate::http::body::empty())
}

/// One side of a tunnel, noting each byte read or written in `last`.
struct Active<T> {
    io: T,
    last: Arc<LastActive>,
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Active<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.last.touch();
        }
        r
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Active<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.last.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

fn wants_upgrade(h: &HeaderMap) -> bool {
    any_of(h, std::slice::from_ref(&header::UPGRADE)) && connection(h).upgrade
}

/// What the chain of an error says it was, beyond a failed connection.
enum Cause {
    Busy,
    TooLarge,
    Client(ClientFault),
    Timeout,
}

fn cause(e: &(dyn std::error::Error + 'static)) -> Option<Cause> {
    let mut src = Some(e);
    while let Some(s) = src {
        if s.is::<NoFreeConnection>() {
            return Some(Cause::Busy);
        }
        if s.is::<ReadTimeout>() {
            return Some(Cause::Timeout);
        }
        if s.is::<LengthLimitError>() {
            return Some(Cause::TooLarge);
        }
        if let Some(c) = s.downcast_ref::<ClientBodyError>() {
            return Some(Cause::Client(c.fault));
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return Some(Cause::Timeout);
            }
        }
        src = s.source();
    }
    None
}

/// A failed exchange with the upstream, sorted by its causes: opening a connection
/// (`connecting`) or on one.
fn classify(e: BoxError, connecting: bool) -> ProxyError {
    match cause(&*e) {
        Some(Cause::Busy) => ProxyError::Busy,
        Some(Cause::TooLarge) => ProxyError::TooLarge,
        Some(Cause::Client(fault)) => ProxyError::Client(fault),
        Some(Cause::Timeout) => ProxyError::Timeout,
        None if connecting => ProxyError::Connect(e),
        None => ProxyError::Reset(e),
    }
}

/// How an upstream failed a response body after its head had gone to the client
/// (`sluice_upstream_errors_total{kind}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFailure {
    /// Silent for `read_timeout`.
    Timeout,
    /// The connection failed, or the body was malformed.
    Reset,
}

/// Whose fault a response body's failure is: the upstream's, or (`None`) the
/// client's, whose request body was still going up while the answer came back.
pub fn body_failure(e: &BoxError) -> Option<BodyFailure> {
    match cause(&**e) {
        Some(Cause::Timeout) => Some(BodyFailure::Timeout),
        Some(Cause::Client(_) | Cause::TooLarge) => None,
        Some(Cause::Busy) | None => Some(BodyFailure::Reset),
    }
}

static HTTP2_SETTINGS: HeaderName = HeaderName::from_static("http2-settings");

/// Where `Connection` and `Transfer-Encoding` are in `HOP_BY_HOP`.
const CONNECTION_AT: usize = 0;
const TRANSFER_ENCODING_AT: usize = 4;

/// Whether `TE` accepts trailers.
fn te_has_trailers(h: &HeaderMap) -> bool {
    if !any_of(h, std::slice::from_ref(&header::TE)) {
        return false;
    }
    te_lists_trailers(h.get_all(header::TE))
}

/// Whether `h` has any of `names`: one pass over its names, which costs less than a
/// hashed lookup per name when (as on most requests) none is there.
fn any_of(h: &HeaderMap, names: &[HeaderName]) -> bool {
    h.keys().any(|k| names.contains(k))
}

/// Takes the hop-by-hop fields out of `h`, and those its `Connection` names: whether
/// any of the latter was there.
pub fn strip_hop_by_hop(h: &mut HeaderMap) -> bool {
    // One pass over the names: which of the list are there (most messages have
    // none, or only `Connection`), and nothing is removed that is not.
    let mut present = 0u8;
    for k in h.keys() {
        if let Some(i) = HOP_BY_HOP.iter().position(|n| n == k) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return false;
    }
    // RFC 9112 §6.3: Transfer-Encoding overrides Content-Length, and a request with
    // both must lose its Content-Length before it is passed on (hyper's server has
    // decoded the chunks; left alone, the length would cut the body short). A
    // response with both never gets here: `h1::upstream` refuses it.
    if present & (1 << TRANSFER_ENCODING_AT) != 0 {
        h.remove(header::CONTENT_LENGTH);
    }
    // The fields `Connection` names, those of them the message has (usually none:
    // its tokens are `keep-alive` or `close`).
    let mut named_gone = false;
    if present & (1 << CONNECTION_AT) != 0 && Connection::names_fields(h) {
        let connection = h.get_all(header::CONNECTION);
        let named = |k: &HeaderName| lists(&connection, k.as_str().as_bytes());
        let gone: Vec<HeaderName> = h
            .keys()
            .filter(|k| !HOP_BY_HOP.contains(k) && named(k))
            .cloned()
            .collect();
        for n in &gone {
            h.remove(n);
        }
        named_gone = !gone.is_empty();
    }
    for (i, n) in HOP_BY_HOP.iter().enumerate() {
        if present & (1 << i) != 0 {
            h.remove(n);
        }
    }
    named_gone
}

static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
const UNTRUSTED_CLAIMS: [HeaderName; 2] = [header::FORWARDED, HeaderName::from_static("x-real-ip")];

/// Append the peer to `X-Forwarded-For`; set `X-Forwarded-Proto`/`-Host` unless a
/// trusted proxy already did. `Forwarded` and `X-Real-IP` pass only from a trusted
/// proxy: from anyone else they are claims the upstream must not believe.
fn set_forwarded(h: &mut HeaderMap, origin: &Origin, host: Option<&HeaderValue>) {
    if !origin.trusted && any_of(h, &UNTRUSTED_CLAIMS) {
        h.remove(header::FORWARDED);
        h.remove(&X_REAL_IP);
    }
    let peer = origin.peer_forwarded_for;
    if !any_of(h, std::slice::from_ref(&XFF)) {
        h.insert(XFF.clone(), peer.clone());
    } else {
        append_peer(h, peer);
    }
    if !(origin.trusted && h.contains_key(&XFP)) {
        h.insert(XFP.clone(), HeaderValue::from_static(origin.proto));
    }
    if !(origin.trusted && h.contains_key(&XFH)) {
        if let Some(host) = host {
            h.insert(XFH.clone(), host.clone());
        }
    }
}

/// The `X-Forwarded-For` the request has, with the peer appended (one field).
fn append_peer(h: &mut HeaderMap, peer: &HeaderValue) {
    let prior: Vec<&str> = h
        .get_all(&XFF)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .collect();
    let peer = peer.to_str().unwrap_or_default();
    let xff = if prior.is_empty() {
        peer.to_string()
    } else {
        format!("{}, {peer}", prior.join(", "))
    };
    if let Ok(v) = HeaderValue::from_str(&xff) {
        h.insert(XFF.clone(), v);
    }
}

/// `set_forwarded`, with the fields the map does not have left out of it and
/// returned, to follow its fields on the wire (`h1::Forwarded`) as if appended
/// to it: one pass over its names, no insert (and no hashing) for them. Only when
/// that is where they would stand: the map has `Host` (replaced where it stands
/// after this) and no claim to remove (removing reorders the map); else all go in
/// the map, as `set_forwarded` puts them.
fn forwarded<'a>(
    h: &mut HeaderMap,
    origin: &Origin<'a>,
    host: Option<&'a HeaderValue>,
) -> Forwarded<'a> {
    let (mut has_host, mut claims, mut xff, mut xfp, mut xfh) = (false, false, false, false, false);
    for k in h.keys() {
        match *k {
            header::HOST => has_host = true,
            header::FORWARDED => claims = true,
            _ if *k == XFF => xff = true,
            _ if *k == XFP => xfp = true,
            _ if *k == XFH => xfh = true,
            _ if *k == X_REAL_IP => claims = true,
            _ => {}
        }
    }
    if !has_host || (claims && !origin.trusted) {
        set_forwarded(h, origin, host);
        return Forwarded::default();
    }
    let mut fwd = Forwarded::default();
    if xff {
        append_peer(h, origin.peer_forwarded_for);
    } else {
        fwd.for_ = Some(origin.peer_forwarded_for);
    }
    if !(origin.trusted && xfp) {
        if xfp {
            h.insert(XFP.clone(), HeaderValue::from_static(origin.proto));
        } else {
            fwd.proto = Some(origin.proto);
        }
    }
    if let (false, Some(host)) = (origin.trusted && xfh, host) {
        if xfh {
            h.insert(XFH.clone(), host.clone());
        } else {
            fwd.host = Some(host);
        }
    }
    fwd
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gRPC's `grpc-timeout`: at most 8 digits and one of its six units; anything
    /// else is no deadline.
    #[test]
    fn grpc_timeouts_are_read_as_grpc_writes_them() {
        let t = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).unwrap());
            grpc_timeout(&h)
        };
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("2M"), Some(Duration::from_secs(120)));
        assert_eq!(t("3S"), Some(Duration::from_secs(3)));
        assert_eq!(t("250m"), Some(Duration::from_millis(250)));
        assert_eq!(t("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(t("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "m", "123456789m", "1.5S", "10s", "-1S", "10"] {
            assert_eq!(t(bad), None, "{bad:?}");
        }
        assert_eq!(grpc_timeout(&HeaderMap::new()), None);
    }
    use http_body::Body as _;

    /// A body of `frames`, its size hint `hint`, as a client's would come.
    fn frames(frames: Vec<http_body::Frame<bytes::Bytes>>, hint: Option<u64>) -> Body {
        let stream = futures_util::stream::iter(frames.into_iter().map(Ok::<_, BoxError>));
        let body = http_body_util::StreamBody::new(stream);
        struct Hinted<B>(B, Option<u64>);
        impl<B: http_body::Body + Unpin> http_body::Body for Hinted<B> {
            type Data = B::Data;
            type Error = B::Error;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<http_body::Frame<B::Data>, B::Error>>> {
                Pin::new(&mut self.0).poll_frame(cx)
            }
            fn size_hint(&self) -> http_body::SizeHint {
                self.1
                    .map(http_body::SizeHint::with_exact)
                    .unwrap_or_default()
            }
        }
        Body::new(Hinted(body, hint))
    }

    fn data(s: &'static str) -> http_body::Frame<bytes::Bytes> {
        http_body::Frame::data(bytes::Bytes::from_static(s.as_bytes()))
    }

    /// Read ahead, a body tells the upload what it told before (not over, its
    /// length or none: the framing is the client's), and gives the same frames,
    /// trailers included, whether it was read whole or in part.
    #[tokio::test]
    async fn a_body_read_ahead_is_the_same_body() {
        let bytes = crate::telemetry::metrics::Metrics::new().read_ahead.clone();
        let unbounded = (&bytes, usize::MAX);
        let mut trailers = HeaderMap::new();
        trailers.insert("x-sum", HeaderValue::from_static("7"));
        for limit in [1, 4, 1024] {
            let chunked = vec![
                data("ab"),
                data("cde"),
                http_body::Frame::trailers(trailers.clone()),
            ];
            let Ahead { body, streaming } = read_ahead(frames(chunked, None), limit, unbounded)
                .await
                .expect("read");
            // Read whole (trailers too) only when the limit is above its 5 bytes.
            assert_eq!(streaming, limit < 1024, "limit {limit}");
            assert!(!body.is_end_stream());
            assert_eq!(body.size_hint().exact(), None);
            let got = body.collect().await.expect("collected");
            assert_eq!(got.trailers(), Some(&trailers));
            assert_eq!(&got.to_bytes()[..], b"abcde");

            let sized = read_ahead(
                frames(vec![data("ab"), data("cde")], Some(5)),
                limit,
                unbounded,
            )
            .await
            .expect("read")
            .body;
            assert!(!sized.is_end_stream());
            assert_eq!(sized.size_hint().exact(), Some(5));
            assert_eq!(
                &sized.collect().await.expect("collected").to_bytes()[..],
                b"abcde"
            );
        }
        // An empty chunked body stays one (not over until asked).
        let empty = read_ahead(frames(Vec::new(), None), 1024, unbounded)
            .await
            .expect("read")
            .body;
        assert!(!empty.is_end_stream());
        drop(empty);
        assert_eq!(bytes.held(), 0);
    }

    /// The bytes read ahead count in the process's total until they are sent on
    /// (or dropped); one that would take the total past the bound is refused and
    /// holds nothing.
    #[tokio::test]
    async fn bytes_read_ahead_are_counted_until_sent_on_and_bounded() {
        let bytes = crate::telemetry::metrics::Metrics::new().read_ahead.clone();
        let ahead = read_ahead(
            frames(vec![data("ab"), data("cde")], None),
            1024,
            (&bytes, 5),
        )
        .await
        .expect("read");
        assert_eq!(bytes.held(), 5);
        let over = read_ahead(frames(vec![data("x")], None), 1024, (&bytes, 5)).await;
        assert!(matches!(over, Err(ProxyError::BuffersFull)));
        assert_eq!((bytes.held(), bytes.refused.get()), (5, 1));
        let got = ahead.body.collect().await.expect("collected");
        assert_eq!(&got.to_bytes()[..], b"abcde");
        assert_eq!(bytes.held(), 0);
        let ahead = read_ahead(frames(vec![data("ab")], None), 1024, (&bytes, 5))
            .await
            .expect("read");
        assert_eq!(bytes.held(), 2);
        drop(ahead);
        assert_eq!(bytes.held(), 0);
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        assert_eq!(HOP_BY_HOP[CONNECTION_AT], header::CONNECTION);
        assert_eq!(HOP_BY_HOP[TRANSFER_ENCODING_AT], header::TRANSFER_ENCODING);
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "keep-alive, X-Secret".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert("proxy-connection", "keep-alive".parse().unwrap());
        h.insert("x-kept", "yes".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert_eq!(h["x-kept"], "yes");

        // `close` names a field too, if there is one.
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close".parse().unwrap());
        h.insert("close", "x".parse().unwrap());
        h.insert("x-kept", "yes".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);

        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert!(h.is_empty(), "{h:?}");
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_LENGTH, "5".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h[header::CONTENT_LENGTH], "5");
    }

    #[test]
    fn forwarded_headers() {
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", "1.1.1.1".parse().unwrap());
        h.append("x-forwarded-for", "2.2.2.2".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        let peer = HeaderValue::from_static("10.0.0.1");
        let o = Origin {
            client: std::net::Ipv4Addr::LOCALHOST.into(),
            peer_forwarded_for: &peer,
            trusted: false,
            proto: "http",
        };
        set_forwarded(
            &mut h,
            &o,
            Some(&HeaderValue::from_static("api.example.com")),
        );
        assert_eq!(h["x-forwarded-for"], "1.1.1.1, 2.2.2.2, 10.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example.com");
        let mut h2 = HeaderMap::new();
        h2.insert("x-forwarded-proto", "https".parse().unwrap());
        h2.insert("forwarded", "for=1.2.3.4".parse().unwrap());
        h2.insert("x-real-ip", "1.2.3.4".parse().unwrap());
        let mut h3 = h2.clone();
        set_forwarded(&mut h3, &o, None);
        assert_eq!(h3.get("forwarded"), None);
        assert_eq!(h3.get("x-real-ip"), None);
        set_forwarded(&mut h2, &Origin { trusted: true, ..o }, None);
        assert_eq!(h2["x-forwarded-proto"], "https");
        assert_eq!(h2["forwarded"], "for=1.2.3.4");
        assert_eq!(h2["x-real-ip"], "1.2.3.4");
    }
}
