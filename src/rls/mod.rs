//! Envoy's rate limit service: `ShouldRateLimit` over h2c (`service`), answered
//! from envoyproxy/ratelimit's configuration files (`files`) with the gateway's
//! store and deny list (`decide`). Beside the request path, never on it.

pub mod decide;
pub mod files;
pub mod service;

pub use files::{load_dir, Domains};
pub use service::Service;

use crate::limit::{Algorithm, LimitDef};

/// A limit that refuses every request: joined to a call with a denied descriptor
/// so the store decides the others without charging any.
fn refuse_all() -> LimitDef {
    let algorithm = Algorithm::FixedWindow {
        limit: 0,
        window_us: 1_000_000,
    };
    LimitDef::new("denied".into(), algorithm, 1)
}

/// `sluice check`'s lines about `rls:`: where it listens and each domain with its
/// file and number of limits.
pub fn summary(spec: &crate::config::schema::RlsSpec, domains: &Domains) -> String {
    let n = domains.by_name.len();
    let mut out = format!(
        "rls     {} (gRPC, h2c), {} domain{} in {}\n",
        spec.listen.0,
        n,
        if n == 1 { "" } else { "s" },
        spec.config_dir.as_str()
    );
    for name in domains.names() {
        if let Some(d) = domains.by_name.get(name) {
            let n = d.rules.len();
            out.push_str(&format!(
                "  {name} ({}): {n} limit{}\n",
                d.file.display(),
                if n == 1 { "" } else { "s" }
            ));
        }
    }
    out
}
