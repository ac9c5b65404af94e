//! The transport under both HTTP versions to upstreams: TCP or TLS streams
//! (`Stream`), opened by a target's `Connector` within its connect timeout, each
//! holding one slot of the target's `max_connections` until it closes.

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::http::body::BoxError;

#[derive(Debug, thiserror::Error)]
#[error("no free connection to the upstream within {0:?}")]
pub struct NoFreeConnection(pub Duration);

/// A connection to an upstream target, plain or TLS.
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

impl Stream {
    /// Whether TLS's ALPN picked HTTP/2 (`h2`).
    pub fn speaks_h2(&self) -> bool {
        match self {
            Stream::Plain(_) => false,
            Stream::Tls(s) => s.get_ref().1.alpn_protocol() == Some(b"h2"),
        }
    }

    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Plain(s) => s,
            Stream::Tls(s) => s.get_ref().0,
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// A connection just opened: its stream and its slot under the target's cap, held
/// until the connection is dropped.
pub struct Link {
    pub io: Stream,
    pub slot: OwnedSemaphorePermit,
}

/// Opens connections to one target, each with a slot of the target's cap: a
/// request that gets no slot within `connect_timeout` fails (`NoFreeConnection`).
/// Resolving, connecting and the TLS handshake together get `connect_timeout`
/// (nginx's `proxy_connect_timeout` also covers its handshake).
pub struct Connector {
    /// The host as written in the target, without brackets (DNS name or IP).
    host: String,
    port: u16,
    tls: Option<(
        tokio_rustls::TlsConnector,
        rustls_pki_types::ServerName<'static>,
    )>,
    connect_timeout: Duration,
    slots: Arc<Semaphore>,
}

impl Connector {
    pub fn new(
        host: &str,
        port: u16,
        tls: Option<Arc<rustls::ClientConfig>>,
        connect_timeout: Duration,
        slots: usize,
    ) -> Result<Connector, rustls_pki_types::InvalidDnsNameError> {
        let host = host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned();
        let tls = match tls {
            None => None,
            Some(config) => {
                let name = match host.parse::<IpAddr>() {
                    Ok(ip) => rustls_pki_types::ServerName::IpAddress(ip.into()),
                    Err(_) => rustls_pki_types::ServerName::try_from(host.clone())?,
                };
                Some((tokio_rustls::TlsConnector::from(config), name))
            }
        };
        Ok(Connector {
            host,
            port,
            tls,
            connect_timeout,
            slots: Arc::new(Semaphore::new(slots)),
        })
    }

    /// A new connection's stream (TLS handshake done) and its slot under the cap,
    /// for either HTTP version to speak on it.
    pub async fn connect(&self) -> Result<Link, BoxError> {
        let wait = self.connect_timeout;
        let slot = match tokio::time::timeout(wait, self.slots.clone().acquire_owned()).await {
            Ok(Ok(slot)) => slot,
            _ => return Err(NoFreeConnection(wait).into()),
        };
        match tokio::time::timeout(wait, self.open()).await {
            Ok(io) => Ok(Link { io: io?, slot }),
            Err(_) => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "upstream connect timeout").into())
            }
        }
    }

    /// This connector, its connections counted under `other`'s cap instead of its
    /// own (two ways of speaking to one target, one `max_connections` share).
    pub fn sharing_slots(mut self, other: &Connector) -> Connector {
        self.slots = other.slots.clone();
        self
    }

    /// Whether a connection may be opened now without waiting for one to close.
    pub fn has_free_slot(&self) -> bool {
        self.slots.available_permits() > 0
    }

    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// One connection opened (TLS handshake included) and dropped, within the
    /// connect timeout and outside the slots: whether the target is there.
    pub async fn probe(&self) -> Result<(), BoxError> {
        match tokio::time::timeout(self.connect_timeout, self.open()).await {
            Ok(io) => io.map(drop),
            Err(_) => {
                Err(io::Error::new(io::ErrorKind::TimedOut, "upstream connect timeout").into())
            }
        }
    }

    async fn open(&self) -> Result<Stream, BoxError> {
        let tcp = match self.host.parse::<IpAddr>() {
            Ok(ip) => TcpStream::connect((ip, self.port)).await?,
            Err(_) => {
                let mut last = None;
                let mut open = None;
                let addrs: Vec<_> = tokio::net::lookup_host((self.host.as_str(), self.port))
                    .await?
                    .collect();
                // Each address gets its share of `connect_timeout` (as hyper's
                // connector gives it), so one that drops packets (a broken IPv6
                // route) leaves time for the next.
                let share = self.connect_timeout / u32::try_from(addrs.len().max(1)).unwrap_or(1);
                for addr in addrs {
                    match tokio::time::timeout(share, TcpStream::connect(addr)).await {
                        Ok(Ok(s)) => {
                            open = Some(s);
                            break;
                        }
                        Ok(Err(e)) => last = Some(e),
                        Err(_) => {
                            last = Some(io::Error::new(
                                io::ErrorKind::TimedOut,
                                format!("connecting to {addr} timed out"),
                            ))
                        }
                    }
                }
                match (open, last) {
                    (Some(s), _) => s,
                    (None, Some(e)) => return Err(e.into()),
                    (None, None) => {
                        return Err(io::Error::new(
                            io::ErrorKind::NotFound,
                            format!("{} resolves to no address", self.host),
                        )
                        .into())
                    }
                }
            }
        };
        tcp.set_nodelay(true)?;
        Ok(match &self.tls {
            None => Stream::Plain(tcp),
            Some((tls, name)) => Stream::Tls(Box::new(tls.connect(name.clone(), tcp).await?)),
        })
    }
}
