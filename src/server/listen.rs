//! A listener at work: connection caps, the first bytes that choose HTTP/1.1 or
//! HTTP/2, TLS handshakes, each connection served until idle or stopped, and the
//! drain at shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use super::h2::{Http, Tracked};
use super::io::{Linger, WriteStall};
use crate::http::body::Body;
use crate::http::conn::Activity;
use crate::http::h1::server::Fast;
use crate::http::site::Site;
use crate::limit::per_ip::PerIp;
use crate::pipeline;

/// Whether a peer is exempt from the per-IP connection cap.
pub(super) type Exempt = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// How a listener treats its connections.
#[derive(Clone)]
pub(super) struct Limits {
    /// The longest request head (`server.max_header_bytes`).
    pub(super) max_head: usize,
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
    /// Bounds the TLS handshake and the wait for a request's first bytes.
    pub(super) header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    pub(super) idle_timeout: Duration,
    /// A connection whose writes make no progress for this long is closed.
    pub(super) send_timeout: Duration,
    pub(super) max_connections: usize,
    /// Connections one peer address may hold; more are closed at once.
    pub(super) per_ip: usize,
    /// IPv6 peers are counted per /64, not per address (`counted_as`).
    pub(super) per_v6_64: bool,
    pub(super) exempt: Exempt,
    /// Counts connections closed for `per_ip`.
    pub(super) refused: Option<prometheus::IntCounter>,
    /// How long shutdown waits for requests in flight.
    pub(super) grace: Duration,
    /// The longest lingering close (`Linger`).
    pub(super) linger: Duration,
    /// Shared by every worker accepting on the listener.
    pub(super) caps: Caps,
}

/// The listener's connection caps, in total and per peer address.
#[derive(Clone)]
pub(super) struct Caps {
    pub(super) slots: Arc<Semaphore>,
    pub(super) peers: Arc<PerIp>,
}

impl Caps {
    pub(super) fn new(max_connections: usize) -> Caps {
        Caps {
            slots: Arc::new(Semaphore::new(max_connections)),
            peers: Arc::new(PerIp::default()),
        }
    }
}

/// The HTTP/2 connection preface: a plain connection that starts with it speaks
/// h2c (`first_bytes`), any other HTTP/1.1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Wait until the client has sent enough to start a request: any bytes that are not
/// the start of the h2c preface, or the whole preface. The header timeout of the
/// server that then reads the connection starts only after that, so without this a
/// silent socket (or half a preface) would hold a connection slot for ever.
async fn first_bytes(stream: &tokio::net::TcpStream, limit: Duration) -> Option<Sniffed> {
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 24];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            _ => return None,
        };
        if n == 0 {
            return None;
        }
        if !H2_PREFACE.starts_with(&buf[..n]) {
            return Some(Sniffed::Http1);
        }
        if n == H2_PREFACE.len() {
            return Some(Sniffed::Http2);
        }
        // Part of a preface: peek answers at once while bytes wait, so pause briefly.
        if tokio::time::timeout_at(deadline, tokio::time::sleep(Duration::from_millis(5)))
            .await
            .is_err()
        {
            return None;
        }
    }
}

/// Read until `head` holds the HTTP/2 preface, or bytes that cannot begin it: what
/// a TLS connection whose client chose no protocol by ALPN speaks (None: it closed
/// first).
async fn read_preface<T>(io: &mut T, head: &mut BytesMut) -> Option<Sniffed>
where
    T: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    loop {
        let n = head.len().min(H2_PREFACE.len());
        if !H2_PREFACE.starts_with(&head[..n]) {
            return Some(Sniffed::Http1);
        }
        if n == H2_PREFACE.len() {
            return Some(Sniffed::Http2);
        }
        match io.read_buf(head).await {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
    }
}

/// What a plain connection's first bytes say it speaks.
enum Sniffed {
    Http1,
    /// The h2c preface (HTTP/2 with prior knowledge).
    Http2,
}

/// The address a peer's connections are counted under: its own, or with
/// `per_v6_64` an IPv6 peer's /64 (its first address).
fn counted_as(ip: IpAddr, per_v6_64: bool) -> IpAddr {
    match ip {
        IpAddr::V6(v6) if per_v6_64 => IpAddr::V6(std::net::Ipv6Addr::from(
            u128::from(v6) & !u128::from(u64::MAX),
        )),
        ip => ip,
    }
}

/// Serve one connection until it ends: closed gracefully once idle for
/// `idle_timeout` or when the listener stops. A connection closed for idleness
/// that has not ended after `linger` more (a peer that does not answer the h2
/// GOAWAY's PING) and still has nothing in flight, nor a lingering close under
/// way, is dropped.
async fn drive<C, E>(
    conn: C,
    close: impl Fn(Pin<&mut C>),
    activity: Arc<Activity>,
    idle_timeout: Duration,
    linger: Duration,
    mut stop: watch::Receiver<bool>,
) -> Result<(), crate::http::body::BoxError>
where
    C: Future<Output = Result<(), E>>,
    E: Into<crate::http::body::BoxError>,
{
    tokio::pin!(conn);
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => return r.map_err(Into::into),
            _ = activity.idle(idle_timeout), if !closing => {
                closing = true;
                close(conn.as_mut());
            }
            _ = stop.wait_for(|s| *s), if !closing => {
                closing = true;
                close(conn.as_mut());
            }
            _ = tokio::time::sleep(linger), if closing => {
                if !activity.busy() {
                    return Ok(());
                }
            }
        }
    }
}

fn log_end(peer: SocketAddr, result: Result<(), crate::http::body::BoxError>) {
    if let Err(e) = result {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// Accept connections until told to stop, then drain them for at most `grace`.
/// With `tls`, each connection is first handshaken (bounded by the header timeout).
pub(super) async fn serve<S, F, Z: Site<Peer = pipeline::Peer>>(
    listener: TcpListener,
    limits: Limits,
    builder: Arc<Http<Z>>,
    service: F,
    mut stop: watch::Receiver<bool>,
) where
    F: Fn(Arc<pipeline::Peer>) -> S,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + Unpin + 'static,
{
    let Limits {
        max_head,
        tls,
        header_timeout,
        idle_timeout,
        send_timeout,
        max_connections,
        per_ip,
        per_v6_64,
        exempt,
        refused,
        grace,
        linger,
        caps: Caps { slots, peers },
    } = limits;
    loop {
        let permit = tokio::select! {
            p = slots.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            _ = stop.changed() => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.changed() => break,
        };
        let ip = crate::identity::canonical(peer.ip());
        let ip_slot = if exempt(ip) {
            None
        } else {
            match PerIp::take(&peers, counted_as(ip, per_v6_64), per_ip) {
                Some(slot) => Some(slot),
                None => {
                    if let Some(c) = &refused {
                        c.inc();
                    }
                    tracing::debug!(%peer, per_ip, "connection closed: the address holds max_connections_per_ip");
                    continue;
                }
            }
        };
        let _ = stream.set_nodelay(true);
        // Held by the connection, and by a tunnel it upgrades to.
        let held = Arc::new((permit, ip_slot));
        // The peer, and its `X-Forwarded-For` entry, once per connection for both
        // HTTP servers.
        let client = Arc::new(pipeline::Peer::new(peer));
        let activity = Activity::new();
        let service = Tracked {
            inner: service(client.clone()),
            activity: activity.clone(),
            send_timeout,
        };
        let (builder, tls, mut stop) = (builder.clone(), tls.clone(), stop.clone());
        let fast = Fast {
            site: builder.site.clone(),
            peer: client,
            header_timeout,
            idle_timeout,
            max_head,
            held: held.clone(),
        };
        tokio::spawn(async move {
            let _held = held;
            // Until its first request, a connection has nothing to finish at shutdown.
            let result = match tls {
                None => {
                    let started = tokio::select! {
                        ok = first_bytes(&stream, header_timeout) => ok,
                        _ = stop.wait_for(|s| *s) => None,
                    };
                    let io = Linger::new(
                        WriteStall::new(stream, send_timeout),
                        activity.clone(),
                        linger,
                    );
                    match started {
                        Some(Sniffed::Http1) => {
                            let buf = BytesMut::with_capacity(4096);
                            crate::http::h1::server::serve(io, buf, &fast, &activity, stop).await
                        }
                        Some(Sniffed::Http2) => {
                            let conn = builder.h2.serve_connection(TokioIo::new(io), service);
                            let close = |c: Pin<&mut _>| http2::Connection::graceful_shutdown(c);
                            drive(conn, close, activity, idle_timeout, header_timeout, stop).await
                        }
                        None => Err("no request before the header timeout".into()),
                    }
                }
                Some(acceptor) => {
                    let shaken = tokio::select! {
                        r = tokio::time::timeout(header_timeout, acceptor.accept(Linger::new(WriteStall::new(stream, send_timeout), activity.clone(), linger))) => r,
                        _ = stop.wait_for(|s| *s) => Ok(Err(std::io::ErrorKind::Interrupted.into())),
                    };
                    let stream = match shaken {
                        Ok(Ok(stream)) => stream,
                        Ok(Err(e)) => return log_end(peer, Err(e.into())),
                        Err(_) => return log_end(peer, Err("TLS handshake timed out".into())),
                    };
                    // HTTP/2 when the client chose it by ALPN, HTTP/1.1 when it chose
                    // that; with no choice, by the first bytes, as on a plain connection.
                    let alpn = stream.get_ref().1.alpn_protocol().map(|p| p == b"h2");
                    let (mut stream, mut head) = (stream, BytesMut::with_capacity(4096));
                    let sniffed = match alpn {
                        Some(true) => Some(Sniffed::Http2),
                        Some(false) => Some(Sniffed::Http1),
                        None => tokio::select! {
                            s = tokio::time::timeout(header_timeout, read_preface(&mut stream, &mut head)) => s.ok().flatten(),
                            _ = stop.wait_for(|s| *s) => None,
                        },
                    };
                    match sniffed {
                        Some(Sniffed::Http2) => {
                            // (With the preface, when it was read to tell.)
                            let io =
                                TokioIo::new(crate::http::h1::server::Replay { head, io: stream });
                            let conn = builder.h2.serve_connection(io, service);
                            let close = |c: Pin<&mut _>| http2::Connection::graceful_shutdown(c);
                            drive(conn, close, activity, idle_timeout, header_timeout, stop).await
                        }
                        Some(Sniffed::Http1) => {
                            crate::http::h1::server::serve(stream, head, &fast, &activity, stop)
                                .await
                        }
                        None => Err("no request before the header timeout".into()),
                    }
                }
            };
            log_end(peer, result);
        });
    }
    drop(listener);
    // Every connection holds a slot until it ends (an upgraded one: until its
    // tunnel closes).
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    if tokio::time::timeout(grace, slots.acquire_many(all))
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "shutdown grace elapsed with requests still in flight"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The admin listener counts an IPv6 peer per /64; IPv4 peers, and every peer
    /// of the gateway's listener, per address.
    #[test]
    fn ipv6_peers_are_counted_per_64_when_asked() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let block = ip("2001:db8:1:2::");
        assert_eq!(counted_as(ip("2001:db8:1:2::1"), true), block);
        assert_eq!(
            counted_as(ip("2001:db8:1:2:ffff:ffff:ffff:ffff"), true),
            block
        );
        assert_eq!(
            counted_as(ip("2001:db8:1:3::1"), true),
            ip("2001:db8:1:3::")
        );
        assert_eq!(
            counted_as(ip("2001:db8:1:2::1"), false),
            ip("2001:db8:1:2::1")
        );
        assert_eq!(counted_as(ip("192.0.2.7"), true), ip("192.0.2.7"));
        let table = Arc::new(PerIp::default());
        let one = PerIp::take(&table, counted_as(ip("2001:db8::1"), true), 1);
        assert!(one.is_some());
        assert!(PerIp::take(&table, counted_as(ip("2001:db8::2"), true), 1).is_none());
        assert!(PerIp::take(&table, counted_as(ip("2001:db8:0:1::2"), true), 1).is_some());
    }
}
