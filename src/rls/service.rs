//! The gRPC face: `envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit`
//! over h2c on `rls.listen` (tonic's server, envoy-types' protos), and the domains
//! it answers from, reloaded when `rls.config_dir` changes.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::decide::{decide, Compiled};
use super::files::load_dir;
use crate::config::schema::RlsSpec;
use crate::config::ConfigErrors;
use crate::pipeline::Shared;
use crate::telemetry::top::Top;

/// Envoy's rate limit service of one gateway.
pub struct Service {
    shared: Arc<Shared>,
    compiled: ArcSwap<Compiled>,
    dir: PathBuf,
    response_headers: bool,
}

impl Service {
    /// The service over the domains of `spec.config_dir`, or their errors.
    pub fn new(shared: Arc<Shared>, spec: &RlsSpec) -> Result<Service, ConfigErrors> {
        let dir = PathBuf::from(spec.config_dir.as_str());
        let domains = load_dir(&dir)?;
        let compiled = Compiled::new(domains, &shared.metrics, None);
        Ok(Service {
            shared,
            compiled: ArcSwap::from_pointee(compiled),
            dir,
            response_headers: spec.response_headers,
        })
    }

    pub fn dir(&self) -> &std::path::Path {
        &self.dir
    }

    /// The domains' names, sorted.
    pub fn domains(&self) -> Vec<String> {
        let c = self.compiled.load();
        c.domains.names().into_iter().map(str::to_string).collect()
    }

    /// Reads `rls.config_dir` again: its domains replace the old ones in one swap
    /// (counts stay with every limit whose place in its file, algorithm and unit
    /// are unchanged), or nothing changes and the errors are logged and returned.
    pub fn reload(&self) -> Result<String, ConfigErrors> {
        let reloads = &self.shared.metrics.config_reloads;
        match load_dir(&self.dir) {
            Ok(domains) => {
                let hash = domains.hash.clone();
                let before = self.compiled.load_full();
                if before.domains.hash == hash {
                    return Ok(hash);
                }
                let names = domains.names().join(",");
                self.compiled.store(Arc::new(Compiled::new(
                    domains,
                    &self.shared.metrics,
                    Some(&before),
                )));
                reloads.with_label_values(&["success"]).inc();
                tracing::info!(dir = %self.dir.display(), %hash, domains = %names, "rls: configuration reloaded");
                Ok(hash)
            }
            Err(e) => {
                reloads.with_label_values(&["failure"]).inc();
                for err in &e.0 {
                    tracing::error!("rls: {err}; the domains loaded before still serve");
                }
                Err(e)
            }
        }
    }

    /// Each domain's sketch of its most refused callers, for `/admin/top`.
    pub fn tops(&self) -> Vec<(String, Arc<Top>)> {
        let c = self.compiled.load();
        let mut tops: Vec<(String, Arc<Top>)> =
            c.tops.iter().map(|(d, t)| (d.clone(), t.clone())).collect();
        tops.sort_by(|a, b| a.0.cmp(&b.0));
        tops
    }

    /// Decides one call (what the gRPC method answers).
    pub async fn should_rate_limit(
        &self,
        req: &RateLimitRequest,
    ) -> Result<RateLimitResponse, super::decide::Malformed> {
        let compiled = self.compiled.load_full();
        decide(&self.shared, &compiled, req, self.response_headers).await
    }
}

/// The gRPC method on the service.
struct Grpc(Arc<Service>);

#[tonic::async_trait]
impl RateLimitService for Grpc {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        match self.0.should_rate_limit(request.get_ref()).await {
            Ok(r) => Ok(tonic::Response::new(r)),
            Err(e) => Err(tonic::Status::invalid_argument(e.to_string())),
        }
    }
}

/// Binds `rls.listen`.
pub async fn bind(spec: &RlsSpec) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(spec.listen.0).await?;
    let addr = listener.local_addr()?;
    Ok((listener, addr))
}

/// Serves `ShouldRateLimit` on `listener` until `stop` changes; calls in flight
/// finish first.
pub async fn serve(service: Arc<Service>, listener: TcpListener, mut stop: watch::Receiver<bool>) {
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let svc = RateLimitServiceServer::new(Grpc(service));
    let signal = async move {
        let _ = stop.changed().await;
    };
    if let Err(e) = tonic::transport::Server::builder()
        .serve_with_incoming_shutdown(svc, incoming, signal)
        .await
    {
        tracing::error!(error = %e, "rls: the gRPC listener stopped");
    }
}

/// Watches `rls.config_dir`: each change reloads the domains.
pub fn watch(service: Arc<Service>) -> Option<crate::config::watch::Watch> {
    let dir = service.dir.clone();
    match crate::config::watch::watch_dir(&dir, move || {
        let _ = service.reload();
    }) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, dir = %dir.display(), "rls: cannot watch rls.config_dir; its changes need a restart");
            None
        }
    }
}
