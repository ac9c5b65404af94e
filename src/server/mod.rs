//! Listeners and lifecycle: the gateway port (HTTP/1.1 by sluice's own server, and
//! HTTP/2 by hyper's: h2c by its preface, h2 by ALPN under TLS; with
//! a header-read timeout, a head size limit, an idle timeout, and connection caps
//! in total and per peer address), the admin port, the control loop
//! (file watcher, bans, the shared deny list, expiry), the memory store's sweeper,
//! and graceful shutdown.
//!
//! Here: startup, the workers and shutdown. `listen`: a listener at work (caps,
//! sniffing, TLS, each connection until idle or stopped). `h2`: hyper's HTTP/2
//! server and its request tracking. `io`: the connection's send timeout and
//! lingering close.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::config::compile::{compile, CompileError};
use crate::config::schema::BackendSpec;
use crate::config::{ConfigErrors, Loaded};
use crate::deny::list::DenyList;
use crate::deny::sync::DenySync;
use crate::deny::{BanRequest, DenyView};
use crate::http::body::Body;
use crate::http::request::ClientBody;
use crate::http::site::Site;
use crate::limit::{Clock, MemoryStore, StoreError, SystemClock};
use crate::ops::admin::Admin;
use crate::ops::control::{Command, Control, Reply, Trigger};
use crate::pipeline::{self, Shared};
use crate::telemetry::metrics::Metrics;
use crate::telemetry::refusal_log::RefusalLog;

mod h2;
mod io;
mod listen;

use h2::{http_builder, H2Future, Http};
use io::LINGER_TIME;
use listen::{serve, Caps, Exempt, Limits};

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

/// Envoy's rate limit service at work: the service, its listener's task and the
/// watch on `rls.config_dir`.
struct Rls {
    service: Arc<crate::rls::Service>,
    addr: SocketAddr,
    task: JoinHandle<()>,
    watch: Option<crate::config::watch::Watch>,
}

/// Starts `rls:`, if configured: its domains read (an error stops startup, as one
/// of `rules.yaml` does), its listener bound and served until `stop_rx` changes.
async fn serve_rls(
    shared: &Arc<Shared>,
    f: &crate::config::schema::File,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Option<Rls>, StartError> {
    let Some(spec) = &f.rls else { return Ok(None) };
    let service = Arc::new(crate::rls::Service::new(shared.clone(), spec)?);
    let (listener, addr) =
        crate::rls::service::bind(spec)
            .await
            .map_err(|source| StartError::Listen {
                addr: spec.listen.0,
                source,
            })?;
    let task = tokio::spawn(crate::rls::service::serve(
        service.clone(),
        listener,
        stop_rx.clone(),
    ));
    let watch = crate::rls::service::watch(service.clone());
    tracing::info!(%addr, dir = %service.dir().display(), domains = %service.domains().join(","), "rls: serving Envoy's rate limit service");
    Ok(Some(Rls {
        service,
        addr,
        task,
        watch,
    }))
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
    /// Envoy's rate limit service's address, with `rls:`.
    pub rls_addr: Option<SocketAddr>,
    rls: Option<Arc<crate::rls::Service>>,
    pub shared: Arc<Shared>,
    pub control: Arc<Control>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    /// Runs until the process ends; stopped with the rest.
    publisher: JoinHandle<()>,
    _watch: Option<crate::config::watch::Watch>,
    _rls_watch: Option<crate::config::watch::Watch>,
}

/// Connections the admin listener holds at once, from all addresses.
const ADMIN_CONNECTIONS: usize = 256;

/// How long startup waits to read the shared deny list before serving without it.
const STARTUP_READ: Duration = Duration::from_secs(1);

/// Bans the request path can ask for before the control loop has caught up; more
/// are dropped (the next refusal of the key asks again).
const BAN_QUEUE: usize = 1024;

pub async fn start(loaded: Loaded) -> Result<Running, StartError> {
    start_with(loaded, None).await
}

/// `start`, with the limiter's time `clock`'s: the memory store's clock, or on Redis
/// the time sent with every limiter call instead of Redis' own. For tests that drive
/// time across a window's end.
#[cfg(any(test, feature = "test-support"))]
pub async fn start_at(loaded: Loaded, clock: Arc<dyn Clock>) -> Result<Running, StartError> {
    start_with(loaded, Some(clock)).await
}

/// Startup, step by step: the state connections share, the deny list and the control
/// object, the listeners, then everything that runs until shutdown.
async fn start_with(loaded: Loaded, clock: Option<Arc<dyn Clock>>) -> Result<Running, StartError> {
    let f = &loaded.file;
    let (shared, tls, ban_rx) = share(&loaded, clock).await?;
    let (deny, sync) = deny_list(&shared, f)?;
    let control = Arc::new(Control::new(shared.clone(), &loaded, deny.clone()));
    let bound = bind(f).await?;
    let (addr, admin_addr) = (bound.addr, bound.admin_addr);
    // Validation keeps it between 8KiB and 1MiB.
    let max_head = usize::try_from(f.server.max_header_bytes.0).unwrap_or(usize::MAX);
    let (stop, stop_rx) = watch::channel(false);
    let gw = serve_gateway(&shared, bound.listener, addr, tls, f, max_head, &stop_rx)?;
    let rls = serve_rls(&shared, f, &stop_rx).await?;
    // The dashboard's history: the counters of every route, sampled.
    let history = Arc::new(crate::ops::stats::History::standard());
    crate::ops::stats::sample(&shared, &history);
    let sampler = tokio::spawn(crate::ops::stats::run(
        shared.clone(),
        history.clone(),
        stop_rx.clone(),
    ));
    // The fleet view; its heartbeat starts once the shared deny list was read.
    let fleet = Arc::new(crate::ops::fleet::Fleet::new(
        shared.clone(),
        control.clone(),
        addr,
    ));
    let admin = Arc::new(Admin {
        shared: shared.clone(),
        control: control.clone(),
        history,
        fleet: fleet.clone(),
        body_timeout: f.admin.request_header_timeout.get(),
        rls: rls.as_ref().map(|r| r.service.clone()),
    });
    let admin = serve_admin(admin, bound.admin_listener, f, max_head, &stop_rx);
    let sweeper = sweep(shared.clone(), stop_rx.clone());
    // The control loop: everything that changes the running gateway from inside
    // (bans, the shared deny list, expiry, the file watcher) goes through it.
    let (commands, command_rx) = tokio::sync::mpsc::unbounded_channel::<Command>();
    if let Some(sync) = sync {
        follow(&sync, &deny).await;
    }
    let watch = watch_file(&loaded, commands);
    let publisher = tokio::spawn(deny.clone().run_publisher());
    let heartbeat = tokio::spawn(fleet.run(stop_rx.clone()));
    let control_loop = tokio::spawn(control.clone().run(command_rx, ban_rx, stop_rx.clone()));
    warn_unused(f);
    for w in &loaded.warnings {
        tracing::warn!("{w}");
    }
    tracing::info!(%addr, %admin_addr, config = %loaded.path.display(), hash = %loaded.hash, "sluice started");
    let (rls_addr, rls_service, rls_task, rls_watch) = match rls {
        Some(r) => (Some(r.addr), Some(r.service), Some(r.task), r.watch),
        None => (None, None, None, None),
    };
    Ok(Running {
        addr,
        admin_addr,
        rls_addr,
        rls: rls_service,
        shared,
        control,
        stop,
        tasks: gw
            .into_iter()
            .chain([admin, sampler, sweeper, control_loop, heartbeat])
            .chain(rls_task)
            .collect(),
        publisher,
        _watch: watch,
        _rls_watch: rls_watch,
    })
}

/// What every connection shares: the compiled configuration (its upstreams' health
/// checks started), the store, the metrics; with the TLS acceptor of `server.tls`,
/// and where the request path's bans arrive.
async fn share(
    loaded: &Loaded,
    clock: Option<Arc<dyn Clock>>,
) -> Result<
    (
        Arc<Shared>,
        Option<tokio_rustls::TlsAcceptor>,
        tokio::sync::mpsc::Receiver<BanRequest>,
    ),
    StartError,
> {
    let metrics = Arc::new(Metrics::new());
    let runtime = compile(loaded, &metrics, None)?;
    let upstreams: Vec<_> = runtime.upstreams.values().cloned().collect();
    crate::upstream::health::start(&upstreams, &metrics.upstream_target_healthy);
    crate::upstream::warn_absent(upstreams);
    let f = &loaded.file;
    let tls = f.server.tls.as_ref().map(tls_acceptor).transpose()?;
    let store = crate::config::compile::store(f, &metrics, clock).await?;
    let (bans, ban_rx) = tokio::sync::mpsc::channel(BAN_QUEUE);
    let shared = Arc::new_cyclic(|me| Shared {
        me: me.clone(),
        runtime: ArcSwap::from_pointee(runtime),
        deny: ArcSwap::from_pointee(DenyView::default()),
        strikes: MemoryStore::new(f.store.memory.max_keys.get(), SystemClock::new()),
        bans,
        store,
        refusals: RefusalLog::new(metrics.refusal_logs_dropped.clone()),
        metrics,
        proto: if tls.is_some() { "https" } else { "http" },
    });
    Ok((shared, tls, ban_rx))
}

/// The dynamic deny entries: shared through Redis with the Redis store (the
/// follower not started yet), else kept in `deny.state_file`, if any.
fn deny_list(
    shared: &Arc<Shared>,
    f: &crate::config::schema::File,
) -> Result<(Arc<DenyList>, Option<Arc<DenySync>>), StartError> {
    let sync = match (shared.store.redis_connection(), &f.store.redis) {
        (Some(r), Some(_)) => Some(Arc::new(DenySync::new(r.clone()))),
        _ => None,
    };
    let state_file = f
        .deny
        .state_file
        .as_ref()
        .map(|p| PathBuf::from(p.as_str()));
    let deny = Arc::new(DenyList::new(shared.clone(), sync.clone(), state_file));
    Ok((deny, sync))
}

/// The gateway's and the admin API's listeners, bound.
struct Bound {
    listener: TcpListener,
    admin_listener: TcpListener,
    addr: SocketAddr,
    admin_addr: SocketAddr,
}

async fn bind(f: &crate::config::schema::File) -> Result<Bound, StartError> {
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
    Ok(Bound {
        listener,
        admin_listener,
        addr,
        admin_addr,
    })
}

/// The gateway port at work: one task per worker, each ending when it has drained.
fn serve_gateway(
    shared: &Arc<Shared>,
    listener: TcpListener,
    addr: SocketAddr,
    tls: Option<tokio_rustls::TlsAcceptor>,
    f: &crate::config::schema::File,
    max_head: usize,
    stop_rx: &watch::Receiver<bool>,
) -> Result<Vec<JoinHandle<()>>, StartError> {
    let header_timeout = f.server.request_header_timeout.get();
    let grace = f.server.shutdown_grace.get();
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
                let mut resp = pipeline::handle(&shared, &mut parts, body, &peer).await;
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
    Ok(handles)
}

/// The admin port at work.
fn serve_admin(
    admin: Arc<Admin>,
    admin_listener: TcpListener,
    f: &crate::config::schema::File,
    max_head: usize,
    stop_rx: &watch::Receiver<bool>,
) -> JoinHandle<()> {
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
}

/// Every 5 s, until `stop_rx` changes: the memory store's and the ban strikes' stale
/// entries go.
fn sweep(shared: Arc<Shared>, mut stop_rx: watch::Receiver<bool>) -> JoinHandle<()> {
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
}

/// Reads the shared deny list (waiting at most `STARTUP_READ`), then follows it:
/// its changes go straight to the deny list.
async fn follow(sync: &Arc<DenySync>, deny: &Arc<DenyList>) {
    let d = deny.clone();
    sync.read_once(move |r, at| d.remote(r, at), STARTUP_READ)
        .await;
    let d = deny.clone();
    sync.clone().follow(move |r, at| d.remote(r, at));
}

/// The configuration file's watcher, which asks the control loop for reloads. A
/// configuration that was not read from a file (tests) has nothing to watch.
fn watch_file(
    loaded: &Loaded,
    commands: tokio::sync::mpsc::UnboundedSender<Command>,
) -> Option<crate::config::watch::Watch> {
    if !loaded.path.is_file() {
        return None;
    }
    match crate::config::watch::watch(&loaded.path, move || {
        let _ = commands.send(Command::Reload(Trigger::File));
    }) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, config = %loaded.path.display(), "cannot watch the configuration file; reload with SIGHUP or POST /admin/reload");
            None
        }
    }
}

/// Settings in the file that this configuration does not use: say so rather than
/// let an operator believe they do something.
fn warn_unused(f: &crate::config::schema::File) {
    if f.store.backend == BackendSpec::Memory && f.store.redis.is_some() {
        tracing::warn!(
            "store.redis is ignored with store.backend: memory: every instance limits on its own"
        );
    }
    if f.store.backend == BackendSpec::Redis && f.deny.state_file.is_some() {
        tracing::warn!(
            "deny.state_file is ignored with store.backend: redis: dynamic entries live in Redis"
        );
    }
}

impl Running {
    /// Reload the configuration file now (as SIGHUP does): the new hash, or the error.
    /// Envoy's rate limit service's folder is read again too.
    pub async fn reload(&self) -> Result<String, String> {
        let reloaded = match self.control.apply(Command::Reload(Trigger::Signal)).await {
            Ok(Reply::Reloaded(hash)) => Ok(hash),
            Ok(other) => Err(format!("unexpected reply {other:?}")),
            Err(e) => Err(e.to_string()),
        };
        if let Some(Err(e)) = self.rls.as_ref().map(|s| s.reload()) {
            return Err(e.to_string());
        }
        reloaded
    }

    /// Write out the access log file's buffer and open the file again (SIGUSR1).
    pub async fn reopen_logs(&self) {
        let _ = self.control.apply(Command::ReopenLogs).await;
    }

    /// Stop accepting, let requests in flight finish (bounded by
    /// `server.shutdown_grace`), then return, the access log file written out.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
        self.publisher.abort();
        if let Some(file) = self
            .shared
            .runtime
            .load()
            .access
            .as_ref()
            .and_then(|a| a.file())
        {
            file.flush();
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
