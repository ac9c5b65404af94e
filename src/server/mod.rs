//! Listeners and lifecycle: the gateway port (HTTP/1.1 by sluice's own server, and
//! HTTP/2 by hyper's: h2c by its preface, h2 by ALPN under TLS; with
//! a header-read timeout, a head size limit, an idle timeout, and connection caps
//! in total and per peer address), the admin port, the control loop
//! (file watcher, bans, the shared deny list, expiry), the memory store's sweeper,
//! and graceful shutdown.

use std::convert::Infallible;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use bytes::BytesMut;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::config::compile::{compile, redis_options, CompileError};
use crate::config::schema::Backend;
use crate::config::{ConfigErrors, Loaded};
use crate::deny::sync::DenySync;
use crate::deny::DenyView;
use crate::http::body::Body;
use crate::http::conn::{Activity, InFlight};
use crate::http::h1::server::{ClientBody, Fast, Site};
use crate::limit::per_ip::PerIp;
use crate::limit::{MemoryStore, RedisStore, Store, StoreError, SystemClock};
use crate::ops::admin::Admin;
use crate::ops::control::{Command, Control, Reply, Trigger, TICK};
use crate::pipeline::{self, Shared};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::refusal_log::RefusalLog;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Config(#[from] ConfigErrors),
    #[error(transparent)]
    Compile(#[from] CompileError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("server.tls: {0}")]
    Tls(String),
}

/// The TLS acceptor for `server.tls`: certificate chain and key from PEM files,
/// offering h2 and http/1.1 by ALPN.
fn tls_acceptor(tls: &crate::config::schema::Tls) -> Result<tokio_rustls::TlsAcceptor, StartError> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let err = |what: &str, e: &dyn std::fmt::Display| StartError::Tls(format!("{what}: {e}"));
    let certs = CertificateDer::pem_file_iter(tls.cert.as_str())
        .map_err(|e| err(&tls.cert, &e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(&tls.cert, &e))?;
    let key = PrivateKeyDer::from_pem_file(tls.key.as_str()).map_err(|e| err(&tls.key, &e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| err("protocol versions", &e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| err("certificate", &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// A started gateway. Dropping it does not stop it; call `shutdown`.
pub struct Running {
    /// The gateway's bound address (useful with port 0).
    pub addr: SocketAddr,
    pub admin_addr: SocketAddr,
    pub shared: Arc<Shared>,
    pub control: Arc<Control>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Runs until the process ends; stopped with the rest.
    publisher: JoinHandle<()>,
    _watch: Option<crate::config::watch::Watch>,
}

/// Connections the admin listener holds at once, from all addresses.
const ADMIN_CONNECTIONS: usize = 256;

/// How long startup waits to read the shared deny list before serving without it.
const STARTUP_READ: Duration = Duration::from_secs(1);

/// Bans the request path can ask for before the control loop has caught up; more
/// are dropped (the next refusal of the key asks again).
const BAN_QUEUE: usize = 1024;

pub async fn start(loaded: Loaded) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let runtime = compile(&loaded, &metrics, None)?;
    let f = &loaded.file;
    let tls = f.server.tls.as_ref().map(tls_acceptor).transpose()?;
    let max_keys = f.store.memory.max_keys.get();
    let store = match (f.store.backend, &f.store.redis) {
        (Backend::Memory, _) => {
            let m = MemoryStore::new(max_keys, SystemClock::new())
                .with_evictions(metrics.eviction_counters.clone());
            Store::memory(m, &metrics)
        }
        (Backend::Redis, Some(redis)) => {
            let redis = RedisStore::connect(crate::config::compile::redis_options(redis)?).await?;
            Store::redis(redis, max_keys, &metrics)
        }
        (Backend::Redis, None) => {
            return Err(StoreError::Config(
                "store.backend: redis needs a store.redis section".into(),
            )
            .into())
        }
    };
    let (bans, mut ban_rx) = tokio::sync::mpsc::channel(BAN_QUEUE);
    let shared = Arc::new(Shared {
        runtime: ArcSwap::from_pointee(runtime),
        deny: ArcSwap::from_pointee(DenyView::default()),
        strikes: MemoryStore::new(max_keys, SystemClock::new()),
        bans,
        store,
        refusals: RefusalLog::new(metrics.refusal_logs_dropped.clone()),
        metrics,
        proto: if tls.is_some() { "https" } else { "http" },
    });
    let sync = match (shared.store.redis_store(), &f.store.redis) {
        (Some(r), Some(c)) => Some(Arc::new(DenySync::new(r.clone(), redis_options(c)?.target))),
        _ => None,
    };
    let control = Arc::new(Control::new(shared.clone(), &loaded, sync.clone()));

    let listen = |addr: SocketAddr| async move {
        TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Listen { addr, source })
    };
    let listener = listen(f.server.listen.0).await?;
    let admin_listener = listen(f.admin.listen.0).await?;
    let addr = listener.local_addr().map_err(|source| StartError::Listen {
        addr: f.server.listen.0,
        source,
    })?;
    let admin_addr = admin_listener
        .local_addr()
        .map_err(|source| StartError::Listen {
            addr: f.admin.listen.0,
            source,
        })?;

    let header_timeout = f.server.request_header_timeout.get();
    // Validation keeps it between 8KiB and 1MiB.
    let max_head = usize::try_from(f.server.max_header_bytes.0).unwrap_or(usize::MAX);
    let (stop, stop_rx) = watch::channel(false);
    let grace = f.server.shutdown_grace.get();

    let gw = {
        let refused = shared
            .metrics
            .connections_refused
            .with_label_values(&["per_ip"]);
        let shared_for_exempt = shared.clone();
        let builder = http_builder(shared.clone(), max_head);
        let shared = shared.clone();
        let service = move |peer: Arc<pipeline::Peer>| {
            let shared = shared.clone();
            // HTTP/2 only: sluice's own server takes every HTTP/1 request.
            service_fn(move |req: Request<Incoming>| -> H2Future {
                let (shared, peer) = (shared.clone(), peer.clone());
                let (mut parts, body) = req.into_parts();
                Box::pin(async move {
                    let body = ClientBody::Hyper(body);
                    let mut resp = pipeline::handle(&shared, &mut parts, body, &peer, None).await;
                    crate::http::body::own_length(&mut resp, parts.method == http::Method::HEAD);
                    Ok(resp)
                })
            })
        };
        // A load balancer in front carries many clients' connections.
        let exempt: Exempt = {
            let shared = shared_for_exempt;
            Arc::new(move |ip| shared.runtime.load().trusted.contains(ip))
        };
        let limits = Limits {
            max_head,
            tls,
            header_timeout,
            idle_timeout: f.server.idle_timeout.get(),
            send_timeout: f.server.send_timeout.get(),
            max_connections: f.server.max_connections.get(),
            per_ip: f.server.max_connections_per_ip.get(),
            per_v6_64: false,
            exempt,
            linger: LINGER_TIME,
            refused: Some(refused),
            grace,
            caps: Caps::new(f.server.max_connections.get()),
        };
        let builder = Arc::new(builder);
        // Worker 0 is this runtime; each other worker is a thread with a runtime of
        // its own, accepting on its own handle of the same socket.
        let mut handles = Vec::new();
        for i in 1..workers(f) {
            let dup = std::os::fd::AsFd::as_fd(&listener)
                .try_clone_to_owned()
                .map(std::net::TcpListener::from)
                .map_err(|source| StartError::Listen { addr, source })?;
            handles.push(spawn_worker(
                i,
                addr,
                dup,
                limits.clone(),
                builder.clone(),
                service.clone(),
                stop_rx.clone(),
            )?);
        }
        handles.push(tokio::spawn(serve(
            listener,
            limits,
            builder,
            service,
            stop_rx.clone(),
        )));
        handles
    };
    // The dashboard's history: the counters of every route, sampled.
    let history = Arc::new(crate::ops::stats::History::standard());
    crate::ops::stats::sample(&shared, &history);
    let sampler = tokio::spawn(crate::ops::stats::run(
        shared.clone(),
        history.clone(),
        stop_rx.clone(),
    ));
    let admin = {
        let admin = Arc::new(Admin {
            shared: shared.clone(),
            control: control.clone(),
            history,
            body_timeout: f.admin.request_header_timeout.get(),
        });
        let builder = Arc::new(http_builder(admin.clone(), max_head));
        // HTTP/2 only (h2c): sluice's own server takes every HTTP/1 request.
        let service = move |_peer: Arc<pipeline::Peer>| {
            let admin = admin.clone();
            service_fn(move |req: Request<Incoming>| -> H2Future {
                let admin = admin.clone();
                let req = req.map(ClientBody::Hyper);
                Box::pin(async move { Ok(admin.handle(req).await) })
            })
        };
        // Small caps and short timeouts: one client holding idle or half-sent
        // connections must not keep /healthz and /metrics from answering (a health
        // check gives up after a few seconds). No address is exempt: a proxy in
        // front of the admin port is not expected.
        let header_timeout = f.admin.request_header_timeout.get();
        let limits = Limits {
            max_head,
            tls: None,
            header_timeout,
            idle_timeout: f.admin.idle_timeout.get(),
            send_timeout: f.server.send_timeout.get(),
            max_connections: ADMIN_CONNECTIONS,
            per_ip: f.admin.max_connections_per_ip.get(),
            // One host usually holds a whole /64: per address, it could open as
            // many admin connections as it likes.
            per_v6_64: true,
            exempt: Arc::new(|_| false),
            // An admin request has seconds to come whole: its lingering close, too
            // (held 30 s, it would let a few addresses fill the listener's total).
            linger: header_timeout,
            refused: None,
            grace: Duration::from_secs(1),
            caps: Caps::new(ADMIN_CONNECTIONS),
        };
        tokio::spawn(serve(
            admin_listener,
            limits,
            builder,
            service,
            stop_rx.clone(),
        ))
    };
    let sweeper = {
        let shared = shared.clone();
        let mut stop_rx = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(5));
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    _ = stop_rx.changed() => return,
                }
                if let Some(m) = shared.store.memory_store() {
                    m.sweep();
                }
                shared.strikes.sweep();
            }
        })
    };
    // The control loop: everything that changes the running gateway from inside
    // (bans, the shared deny list, expiry, the file watcher) goes through it.
    let (commands, mut command_rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
    if let Some(sync) = sync {
        let c = control.clone();
        sync.read_once(move |r, at| c.remote(r, at), STARTUP_READ)
            .await;
        let c = control.clone();
        sync.follow(move |r, at| c.remote(r, at));
    }
    // A configuration that was not read from a file (tests) has nothing to watch.
    let watch = if !loaded.path.is_file() {
        None
    } else {
        let commands = commands.clone();
        match crate::config::watch::watch(&loaded.path, move || {
            let _ = commands.send(Command::Reload(Trigger::File));
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, config = %loaded.path.display(), "cannot watch the configuration file; reload with SIGHUP or POST /admin/reload");
                None
            }
        }
    };
    let publisher = tokio::spawn(control.clone().run_publisher());
    let control_loop = {
        let control = control.clone();
        let mut stop_rx = stop_rx.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let cmd = tokio::select! {
                    Some(c) = command_rx.recv() => c,
                    Some(b) = ban_rx.recv() => Command::Ban(b),
                    _ = tick.tick() => Command::Tick,
                    _ = stop_rx.changed() => break,
                };
                // Errors are logged and counted where they happen.
                let _ = control.apply(cmd).await;
            }
            let _ = control.apply(Command::Tick).await;
        })
    };
    warn_unused(f);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(%addr, %admin_addr, config = %loaded.path.display(), hash = %loaded.hash, "sluice started");
    Ok(Running {
        addr,
        admin_addr,
        shared,
        control,
        stop,
        tasks: gw
            .into_iter()
            .chain([admin, sampler, sweeper, control_loop])
            .collect(),
        publisher,
        _watch: watch,
    })
}

/// Settings in the file that this configuration does not use: say so rather than
/// let an operator believe they do something.
fn warn_unused(f: &crate::config::schema::File) {
    if f.store.backend == Backend::Memory && f.store.redis.is_some() {
        tracing::warn!(
            "store.redis is ignored with store.backend: memory: every instance limits on its own"
        );
    }
    if f.store.backend == Backend::Redis && f.deny.state_file.is_some() {
        tracing::warn!(
            "deny.state_file is ignored with store.backend: redis: dynamic entries live in Redis"
        );
    }
}

impl Running {
    /// Reload the configuration file now (as SIGHUP does): the new hash, or the error.
    pub async fn reload(&self) -> Result<String, String> {
        match self.control.apply(Command::Reload(Trigger::Signal)).await {
            Ok(Reply::Reloaded(hash)) => Ok(hash),
            Ok(other) => Err(format!("unexpected reply {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Stop accepting, let requests in flight finish (bounded by
    /// `server.shutdown_grace`), then return.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.publisher.abort();
    }
}

/// hyper's HTTP/2 server (h2c, and h2 under TLS); HTTP/1.1 is sluice's own
/// (`h1server`). HTTP/2 connections are pinged so that dead peers are noticed. A
/// decoded header list larger than `max_head` resets its stream with 431.
fn http_builder<Z>(site: Arc<Z>, max_head: usize) -> Http<Z> {
    let mut h2 = http2::Builder::new(TokioExecutor::new());
    h2.timer(TokioTimer::new())
        .max_concurrent_streams(H2_STREAMS)
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_header_list_size(u32::try_from(max_head).unwrap_or(u32::MAX));
    Http { site, h2 }
}

/// Concurrent streams one HTTP/2 connection may open (nginx's
/// `http2_max_concurrent_streams`; hyper's default is 200). Each may hold up to
/// `server.request_buffer` of its body read ahead.
const H2_STREAMS: u32 = 128;

/// The HTTP servers of a listener: where its HTTP/1.1 requests go (`h1server`),
/// and hyper's HTTP/2. A plain connection's protocol is known from its first bytes
/// (`first_bytes`), so it goes straight to HTTP/1.1 or HTTP/2 without hyper-util's
/// detection layer, which re-reads every request through a rewind buffer.
pub struct Http<Z> {
    site: Arc<Z>,
    h2: http2::Builder<TokioExecutor>,
}

/// Whether a peer is exempt from the per-IP connection cap.
type Exempt = Arc<dyn Fn(IpAddr) -> bool + Send + Sync>;

/// How a listener treats its connections.
#[derive(Clone)]
struct Limits {
    /// The longest request head (`server.max_header_bytes`).
    max_head: usize,
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// Bounds the TLS handshake and the wait for a request's first bytes.
    header_timeout: Duration,
    /// A connection with no request in flight for this long is closed.
    idle_timeout: Duration,
    /// A connection whose writes make no progress for this long is closed.
    send_timeout: Duration,
    max_connections: usize,
    /// Connections one peer address may hold; more are closed at once.
    per_ip: usize,
    /// IPv6 peers are counted per /64, not per address (`counted_as`).
    per_v6_64: bool,
    exempt: Exempt,
    /// Counts connections closed for `per_ip`.
    refused: Option<prometheus::IntCounter>,
    /// How long shutdown waits for requests in flight.
    grace: Duration,
    /// The longest lingering close (`Linger`).
    linger: Duration,
    /// Shared by every worker accepting on the listener.
    caps: Caps,
}

/// The listener's connection caps, in total and per peer address.
#[derive(Clone)]
struct Caps {
    slots: Arc<Semaphore>,
    peers: Arc<PerIp>,
}

impl Caps {
    fn new(max_connections: usize) -> Caps {
        Caps {
            slots: Arc::new(Semaphore::new(max_connections)),
            peers: Arc::new(PerIp::default()),
        }
    }
}

/// `server.workers`, or one per core this process may run on.
fn workers(f: &crate::config::schema::File) -> usize {
    f.server
        .workers
        .map(|n| n.get())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A worker thread: a single-threaded runtime serving connections it accepts on
/// `listener` (a handle of the gateway socket, which the kernel hands each
/// connection to one worker). Its requests, their upstream connections and timers
/// stay on the thread. The returned task ends when the worker has drained.
fn spawn_worker<S, F, Z: Site<Peer = pipeline::Peer>>(
    i: usize,
    addr: SocketAddr,
    listener: std::net::TcpListener,
    limits: Limits,
    builder: Arc<Http<Z>>,
    service: F,
    stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, StartError>
where
    F: Fn(Arc<pipeline::Peer>) -> S + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>
        + Send
        + 'static,
    S::Future: Send + Unpin + 'static,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|source| StartError::Listen { addr, source })?;
    let (done, drained) = tokio::sync::oneshot::channel::<()>();
    std::thread::Builder::new()
        .name(format!("sluice-worker-{i}"))
        .spawn(move || {
            crate::upstream::pool::set_worker(i);
            runtime.block_on(async move {
                match TcpListener::from_std(listener) {
                    Ok(l) => serve(l, limits, builder, service, stop).await,
                    Err(e) => tracing::error!(error = %e, "worker {i} cannot accept"),
                }
            });
            let _ = done.send(());
        })
        .map_err(|source| StartError::Listen { addr, source })?;
    Ok(tokio::spawn(async move {
        let _ = drained.await;
    }))
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

/// A client connection whose writes fail with `TimedOut` once one has waited
/// `timeout` without the socket taking a byte (nginx's `send_timeout`: the time
/// between two successive writes, not for the whole response). hyper does not poll
/// a response body while the socket is not writable, so no timer in the body would
/// fire: the clock has to be here, under TLS and HTTP. The failed write ends the
/// connection, and with it every request on it (the upstream connection and the
/// slots they hold). Reading is left alone: `request_header_timeout`,
/// `request_body_timeout` and `idle_timeout` cover a client that sends nothing.
struct WriteStall<T> {
    io: T,
    timeout: Duration,
    /// Armed when a write first waits, cleared when one goes through.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<T> WriteStall<T> {
    fn new(io: T, timeout: Duration) -> WriteStall<T> {
        WriteStall {
            io,
            timeout,
            stall: None,
        }
    }

    fn watch<R>(
        &mut self,
        cx: &mut std::task::Context<'_>,
        r: std::task::Poll<std::io::Result<R>>,
    ) -> std::task::Poll<std::io::Result<R>> {
        use std::task::Poll;
        if r.is_ready() {
            self.stall = None;
            return r;
        }
        let timeout = self.timeout;
        let stall = self
            .stall
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stall.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("the client took nothing for {timeout:?} (server.send_timeout)"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for WriteStall<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for WriteStall<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, r)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, r)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let r = Pin::new(&mut self.io).poll_shutdown(cx);
        self.watch(cx, r)
    }
}

/// How long a lingering close reads at most in all (nginx's `lingering_time`).
const LINGER_TIME: Duration = Duration::from_secs(30);
/// A lingering close ends after this long with nothing read (nginx's
/// `lingering_timeout`).
const LINGER_SILENCE: Duration = Duration::from_secs(5);
/// A lingering close throws away at most this much.
const LINGER_BYTES: usize = 64 * 1024 * 1024;

/// A client connection that, when it closes after an answer written before its
/// request body was read (`Activity::linger`), lingers as nginx and Apache do:
/// its write side is shut (the client reads the answer to its end), then what the
/// client still sends is read and thrown away until it closes its end, or for at
/// most `LINGER_TIME`, `LINGER_SILENCE` without a byte, or `LINGER_BYTES`; then it
/// closes. A close with unread bytes would send a reset, and a client still
/// writing its body would see that instead of the answer. The drain runs in
/// `poll_shutdown`, where `h1server` (HTTP/1.1, plain or under TLS) ends a connection,
/// so the connection holds its slots, and counts for shutdown, until it is over.
struct Linger<T> {
    io: T,
    activity: Arc<Activity>,
    /// `LINGER_TIME` on the gateway's port, shorter on the admin port.
    most: Duration,
    drain: Drain,
}

enum Drain {
    NotYet,
    /// The write side is shut; reading until `at`, moved on by every read.
    Reading {
        until: tokio::time::Instant,
        at: Pin<Box<tokio::time::Sleep>>,
        left: usize,
    },
    Over,
}

impl<T> Linger<T> {
    fn new(io: T, activity: Arc<Activity>, most: Duration) -> Linger<T> {
        Linger {
            io,
            activity,
            most,
            drain: Drain::NotYet,
        }
    }
}

impl<T: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Linger<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Linger<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::task::Poll;
        let this = &mut *self;
        loop {
            match &mut this.drain {
                Drain::NotYet => {
                    std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
                    if !this.activity.linger.load(Ordering::Relaxed) {
                        this.drain = Drain::Over;
                        return Poll::Ready(Ok(()));
                    }
                    this.activity.draining.store(true, Ordering::Release);
                    let now = tokio::time::Instant::now();
                    let until = now + this.most;
                    this.drain = Drain::Reading {
                        until,
                        at: Box::pin(tokio::time::sleep_until((now + LINGER_SILENCE).min(until))),
                        left: LINGER_BYTES,
                    };
                }
                Drain::Reading { until, at, left } => {
                    let mut room = [0u8; 8192];
                    let mut buf = tokio::io::ReadBuf::new(&mut room);
                    match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                        Poll::Ready(Ok(())) if !buf.filled().is_empty() => {
                            *left = left.saturating_sub(buf.filled().len());
                            if *left == 0 {
                                this.drain = Drain::Over;
                            } else {
                                let next =
                                    (tokio::time::Instant::now() + LINGER_SILENCE).min(*until);
                                at.as_mut().reset(next);
                            }
                        }
                        // The client closed its end (or the connection failed).
                        Poll::Ready(_) => this.drain = Drain::Over,
                        Poll::Pending => {
                            std::task::ready!(at.as_mut().poll(cx));
                            this.drain = Drain::Over;
                        }
                    }
                }
                Drain::Over => {
                    this.activity.draining.store(false, Ordering::Release);
                    return Poll::Ready(Ok(()));
                }
            }
        }
    }
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

/// An HTTP/2 response body that keeps its request counted as in flight until it
/// ends, shared with a watchdog (`Taken`).
struct TrackedBody {
    inner: Arc<Mutex<Taken>>,
    send_timeout: Duration,
    _in_flight: InFlight,
}

/// An HTTP/2 response body and when it last handed out a frame that has not been
/// followed by a request for the next one. The HTTP/2 layer asks for the next
/// frame only once the stream has flow-control window for the last one: a client
/// that keeps its connection flowing but never opens one stream's window stalls
/// that stream without stalling the socket, out of `WriteStall`'s sight. When
/// that lasts `send_timeout`, the watchdog drops the body (releasing its upstream
/// connection, concurrency lease and tally); the stream is reset with an error
/// when (if ever) the client opens the window.
struct Taken {
    body: Option<Body>,
    handed: Option<tokio::time::Instant>,
    watched: bool,
}

fn lock(t: &Mutex<Taken>) -> std::sync::MutexGuard<'_, Taken> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

async fn watch_stream(taken: std::sync::Weak<Mutex<Taken>>, timeout: Duration) {
    loop {
        let due = {
            let Some(t) = taken.upgrade() else { return };
            let g = lock(&t);
            g.handed.unwrap_or_else(tokio::time::Instant::now) + timeout
        };
        tokio::time::sleep_until(due).await;
        let Some(t) = taken.upgrade() else { return };
        let stalled = {
            let mut g = lock(&t);
            match g.handed {
                Some(at) if at.elapsed() >= timeout => g.body.take(),
                _ => None,
            }
        };
        if let Some(body) = stalled {
            drop(body);
            tracing::debug!(
                ?timeout,
                "an HTTP/2 stream's window stayed closed for send_timeout: response dropped"
            );
            return;
        }
    }
}

impl http_body::Body for TrackedBody {
    type Data = bytes::Bytes;
    type Error = crate::http::body::BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        use std::task::Poll;
        let shared = self.inner.clone();
        let mut g = lock(&shared);
        g.handed = None;
        let Some(body) = g.body.as_mut() else {
            return Poll::Ready(Some(Err(
                "the client opened no window for the stream within send_timeout".into(),
            )));
        };
        let r = Pin::new(&mut *body).poll_frame(cx);
        if matches!(r, Poll::Ready(Some(Ok(_)))) && !body.is_end_stream() {
            g.handed = Some(tokio::time::Instant::now());
            if !g.watched {
                g.watched = true;
                tokio::spawn(watch_stream(Arc::downgrade(&shared), self.send_timeout));
            }
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        lock(&self.inner)
            .body
            .as_ref()
            .is_some_and(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        lock(&self.inner)
            .body
            .as_ref()
            .map(|b| b.size_hint())
            .unwrap_or_default()
    }
}

/// The listener's HTTP/2 service with each request counted in the connection's
/// `Activity` (`h1server` counts HTTP/1.1 requests itself).
struct Tracked<S> {
    inner: S,
    activity: Arc<Activity>,
    /// `server.send_timeout`, for HTTP/2 streams (see `Taken`).
    send_timeout: Duration,
}

/// What the gateway's and the admin port's services return: boxed once, where the
/// request's future is made, so that it is never copied again on its way to hyper.
type H2Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

impl<S> hyper::service::Service<Request<Incoming>> for Tracked<S>
where
    S: hyper::service::Service<Request<Incoming>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + Unpin + 'static,
{
    type Response = Response<TrackedBody>;
    type Error = Infallible;
    type Future = TrackedFuture<S::Future>;

    fn call(&self, req: Request<Incoming>) -> TrackedFuture<S::Future> {
        let in_flight = self.activity.start();
        TrackedFuture {
            answer: self.inner.call(req),
            send_timeout: self.send_timeout,
            in_flight: Some(in_flight),
        }
    }
}

/// The answer of `Tracked`'s service, its body tracked.
struct TrackedFuture<F> {
    answer: F,
    send_timeout: Duration,
    in_flight: Option<InFlight>,
}

impl<F> Future for TrackedFuture<F>
where
    F: Future<Output = Result<Response<Body>, Infallible>> + Unpin,
{
    type Output = Result<Response<TrackedBody>, Infallible>;

    fn poll(
        mut self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        let Ok(resp) = std::task::ready!(Pin::new(&mut this.answer).poll(cx));
        let in_flight = this
            .in_flight
            .take()
            .expect("TrackedFuture polled after it was ready");
        std::task::Poll::Ready(Ok(resp.map(|body| TrackedBody {
            inner: Arc::new(Mutex::new(Taken {
                body: Some(body),
                handed: None,
                watched: false,
            })),
            send_timeout: this.send_timeout,
            _in_flight: in_flight,
        })))
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
async fn serve<S, F, Z: Site<Peer = pipeline::Peer>>(
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
