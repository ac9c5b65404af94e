//! Listeners and lifecycle: the gateway port (HTTP/1.1 and h2c on one socket, with
//! a header-read timeout and a connection cap), the admin port, the memory store's
//! sweeper, reload, and graceful shutdown.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinHandle;

use crate::admin::Admin;
use crate::config::compile::{compile, CompileError};
use crate::config::schema::Backend;
use crate::config::{self, ConfigErrors, Loaded};
use crate::gateway::{self, Shared};
use crate::limit::{MemoryStore, RedisOptions, RedisStore, Store, StoreError, SystemClock};
use crate::metrics::Metrics;

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
    config_path: std::path::PathBuf,
    /// The file as started: settings that only a restart changes are compared with it.
    started_with: crate::config::schema::File,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

pub async fn start(loaded: Loaded) -> Result<Running, StartError> {
    let metrics = Arc::new(Metrics::new());
    let runtime = compile(&loaded, &metrics)?;
    let f = &loaded.file;
    let tls = f.server.tls.as_ref().map(tls_acceptor).transpose()?;
    let max_keys = f.store.memory.max_keys.get();
    let store = match (f.store.backend, &f.store.redis) {
        (Backend::Memory, _) => {
            Store::memory(MemoryStore::new(max_keys, SystemClock::new()), &metrics)
        }
        (Backend::Redis, Some(redis)) => {
            let redis = RedisStore::connect(RedisOptions::from_config(redis)?).await?;
            Store::redis(redis, max_keys, &metrics)
        }
        (Backend::Redis, None) => {
            return Err(StoreError::Config(
                "store.backend: redis needs a store.redis section".into(),
            )
            .into())
        }
    };
    let shared = Arc::new(Shared {
        runtime: ArcSwap::from_pointee(runtime),
        store,
        metrics,
        proto: if tls.is_some() { "https" } else { "http" },
    });

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
    let builder = http_builder(header_timeout);
    let (stop, stop_rx) = watch::channel(false);
    let grace = f.server.shutdown_grace.get();

    let gw = {
        let shared = shared.clone();
        let service = move |peer: SocketAddr| {
            let shared = shared.clone();
            service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(gateway::handle(shared, req, peer).await) }
            })
        };
        let limits = Limits {
            tls,
            header_timeout,
            max_connections: f.server.max_connections.get(),
            grace,
        };
        tokio::spawn(serve(
            listener,
            limits,
            Arc::new(builder),
            service,
            stop_rx.clone(),
        ))
    };
    let admin = {
        let admin = Arc::new(Admin {
            shared: shared.clone(),
        });
        let service = move |_peer: SocketAddr| {
            let admin = admin.clone();
            service_fn(move |req| {
                let admin = admin.clone();
                async move { Ok::<_, Infallible>(admin.handle(req).await) }
            })
        };
        let limits = Limits {
            tls: None,
            header_timeout,
            max_connections: 256,
            grace: Duration::from_secs(1),
        };
        let builder = Arc::new(http_builder(header_timeout));
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
            }
        })
    };
    warn_unbuilt(f);
    tracing::info!(%addr, %admin_addr, config = %loaded.path.display(), hash = %loaded.hash, "sluice started");
    Ok(Running {
        addr,
        admin_addr,
        shared,
        config_path: loaded.path.clone(),
        started_with: loaded.file.clone(),
        stop,
        tasks: vec![gw, admin, sweeper],
    })
}

/// The settings that differ between `old` and `new` and that a reload cannot apply:
/// listeners, TLS, connection limits, timeouts of the listener, and the store.
fn needs_restart(
    old: &crate::config::schema::File,
    new: &crate::config::schema::File,
) -> Vec<&'static str> {
    let (o, n) = (&old.server, &new.server);
    let mut changed = Vec::new();
    let mut check = |name: &'static str, differs: bool| {
        if differs {
            changed.push(name);
        }
    };
    check("server.listen", o.listen != n.listen);
    check(
        "server.tls",
        format!("{:?}", o.tls) != format!("{:?}", n.tls),
    );
    check(
        "server.max_connections",
        o.max_connections != n.max_connections,
    );
    check(
        "server.request_header_timeout",
        o.request_header_timeout != n.request_header_timeout,
    );
    check(
        "server.shutdown_grace",
        o.shutdown_grace != n.shutdown_grace,
    );
    check("admin.listen", old.admin.listen != new.admin.listen);
    check(
        "store",
        format!("{:?}", old.store) != format!("{:?}", new.store),
    );
    changed
}

/// Settings the schema already knows but this version does not act on yet: say so
/// loudly rather than let an operator believe they protect anything.
fn warn_unbuilt(f: &crate::config::schema::File) {
    for r in f.routes.iter().filter(|r| r.ban.is_some()) {
        tracing::warn!(route = %r.name, "ban is not enforced in this version: keys are not banned automatically");
    }
    if f.store.backend == crate::config::schema::Backend::Memory && f.store.redis.is_some() {
        tracing::warn!(
            "store.redis is ignored with store.backend: memory: every instance limits on its own"
        );
    }
    if f.deny.state_file.is_some() {
        tracing::warn!(
            "deny.state_file is not used in this version: there are no dynamic deny entries yet"
        );
    }
}

impl Running {
    /// Reload the configuration file: parse, validate and compile it completely, then
    /// swap it in whole; on any error the running configuration stays.
    pub fn reload(&self) -> Result<String, String> {
        let m = &self.shared.metrics;
        let result = config::load(&self.config_path)
            .map_err(|e| e.to_string())
            .and_then(|l| compile(&l, m).map(|rt| (l, rt)).map_err(|e| e.to_string()));
        match result {
            Ok((loaded, rt)) => {
                for setting in needs_restart(&self.started_with, &loaded.file) {
                    tracing::warn!(
                        setting,
                        "changed in the file, but takes effect only after a restart"
                    );
                }
                warn_unbuilt(&loaded.file);
                let hash = rt.hash.clone();
                self.shared.runtime.store(Arc::new(rt));
                m.config_reloads.with_label_values(&["success"]).inc();
                m.config_last_reload_success.set(1);
                tracing::info!(%hash, "configuration reloaded");
                Ok(hash)
            }
            Err(e) => {
                m.config_reloads.with_label_values(&["failure"]).inc();
                m.config_last_reload_success.set(0);
                tracing::error!(error = %e, "reload failed; the previous configuration stays");
                Err(e)
            }
        }
    }

    /// Stop accepting, let requests in flight finish (bounded by
    /// `server.shutdown_grace`), then return.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// HTTP/1.1 and h2c on one socket. The header-read timeout needs the timer to do
/// anything; HTTP/2 connections are pinged so that dead peers are noticed.
fn http_builder(header_timeout: Duration) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20));
    builder
}

/// How a listener treats its connections.
struct Limits {
    tls: Option<tokio_rustls::TlsAcceptor>,
    /// Bounds the TLS handshake and the wait for a request's first bytes.
    header_timeout: Duration,
    max_connections: usize,
    /// How long shutdown waits for requests in flight.
    grace: Duration,
}

/// The HTTP/2 connection preface, which hyper waits for in full to tell h2c from
/// HTTP/1.1.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Wait until the client has sent enough to start a request: any bytes that are not
/// the start of the h2c preface, or the whole preface. hyper's own header timeout
/// starts only after that, so without this a silent socket (or half a preface)
/// would hold a connection slot for ever.
async fn first_bytes(stream: &tokio::net::TcpStream, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    let mut buf = [0u8; 24];
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Ok(Ok(n)) => n,
            _ => return false,
        };
        if n == 0 {
            return false;
        }
        if n >= H2_PREFACE.len() || !H2_PREFACE.starts_with(&buf[..n]) {
            return true;
        }
        // Part of a preface: peek answers at once while bytes wait, so pause briefly.
        if tokio::time::timeout_at(deadline, tokio::time::sleep(Duration::from_millis(5)))
            .await
            .is_err()
        {
            return false;
        }
    }
}

/// Accept connections until told to stop, then drain them for at most `grace`.
/// With `tls`, each connection is first handshaken (bounded by the header timeout).
async fn serve<S, F>(
    listener: TcpListener,
    limits: Limits,
    builder: Arc<auto::Builder<TokioExecutor>>,
    service: F,
    mut stop: watch::Receiver<bool>,
) where
    F: Fn(SocketAddr) -> S,
    S: hyper::service::Service<
            http::Request<hyper::body::Incoming>,
            Response = http::Response<crate::answer::Body>,
            Error = Infallible,
        > + Send
        + 'static,
    S::Future: Send + 'static,
{
    let Limits {
        tls,
        header_timeout,
        max_connections,
        grace,
    } = limits;
    let slots = Arc::new(Semaphore::new(max_connections));
    let graceful = GracefulShutdown::new();
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
        let _ = stream.set_nodelay(true);
        let (builder, service, watcher, tls) = (
            builder.clone(),
            service(peer),
            graceful.watcher(),
            tls.clone(),
        );
        tokio::spawn(async move {
            let _permit = permit;
            let result = match tls {
                None if !first_bytes(&stream, header_timeout).await => {
                    Err("no request before the header timeout".into())
                }
                None => {
                    let conn =
                        builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
                    watcher.watch(conn.into_owned()).await
                }
                Some(acceptor) => {
                    match tokio::time::timeout(header_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            let conn = builder
                                .serve_connection_with_upgrades(TokioIo::new(stream), service);
                            watcher.watch(conn.into_owned()).await
                        }
                        Ok(Err(e)) => Err(e.into()),
                        Err(_) => Err("TLS handshake timed out".into()),
                    }
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?grace,
            "shutdown grace elapsed with requests still in flight"
        );
    }
}
