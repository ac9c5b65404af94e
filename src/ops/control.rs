//! The one place that changes a running gateway. The file watcher, SIGHUP, the admin
//! API and automatic bans only translate what they see into a `Command`;
//! `Control::apply` carries it out, one at a time (`Control::run`). Reloads are
//! serialized here, and `/admin/config` shows the file with its secrets redacted.
//! The dynamic deny entries and their policy are `deny::list::DenyList`'s: changes
//! to the deny list are handed to it, and the Redis follower applies the shared
//! list's changes to it directly, in version order under the same lock as this
//! instance's own.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use crate::config::compile::compile;
use crate::config::schema;
use crate::config::value::redact_url;
use crate::deny::list::{ChangeError, DenyList, Host, TICK};
use crate::deny::{now_ms, BanRequest, Cursor, DenyView, Entry, Full, Target};
use crate::pipeline::Shared;
use crate::telemetry::metrics::Metrics;

/// Everything that can change a running gateway.
#[derive(Debug)]
pub enum Command {
    /// Read, validate and swap in the configuration file.
    Reload(Trigger),
    /// Add (or replace) a dynamic entry.
    DenyAdd(Entry),
    /// Remove a dynamic entry.
    DenyRemove(Target),
    /// Deny a key that kept hitting a route's limit.
    Ban(BanRequest),
    /// Drop expired entries and write the state file if anything changed.
    Tick,
    /// Write out the access log file's buffer and open its path again (SIGUSR1).
    ReopenLogs,
}

/// What asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// The file watcher: a reload that finds the file as it was last read does nothing.
    File,
    Signal,
    Api,
}

impl Trigger {
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::File => "file",
            Trigger::Signal => "signal",
            Trigger::Api => "api",
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum Reply {
    /// The new configuration's hash.
    Reloaded(String),
    /// The watched file has not changed since it was last read.
    Unchanged,
    Added(Entry),
    Removed(Entry),
    Done,
}

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The file does not load; the running configuration stays.
    #[error("{0}")]
    Config(String),
    #[error("no such entry")]
    NotFound,
    #[error("{0} is in deny: of the configuration file; remove it there")]
    Static(Target),
    #[error("shared deny list unavailable: {0}")]
    Store(String),
    #[error(transparent)]
    Full(#[from] Full),
}

/// What `/admin/config` shows.
#[derive(Debug, Clone)]
pub struct Status {
    pub path: PathBuf,
    pub hash: String,
    /// The effective configuration (defaults filled in), secrets redacted.
    pub config: serde_json::Value,
    pub loaded_at_ms: u64,
    pub last_reload: Option<ReloadRecord>,
}

#[derive(Debug, Clone)]
pub struct ReloadRecord {
    pub at_ms: u64,
    pub trigger: Trigger,
    /// The new hash, or the error with file, line and column.
    pub result: Result<String, String>,
}

pub struct Control {
    shared: Arc<Shared>,
    path: PathBuf,
    /// The file as started: settings only a restart changes are compared with it.
    started_with: schema::File,
    /// Held for a whole reload, so two never interleave.
    reloading: tokio::sync::Mutex<()>,
    /// SHA-1 of the file as last read (good or bad): the watcher's reloads skip a
    /// file they have already seen.
    last_read: Mutex<String>,
    status: Mutex<Status>,
    /// The dynamic deny entries, authoritative for this instance; `Shared::deny`
    /// holds a view.
    deny: Arc<DenyList>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// === impl Control ===

impl Control {
    /// `loaded` is the configuration `shared` was started with; `deny` the dynamic
    /// deny entries (see `DenyList::new`).
    pub fn new(
        shared: Arc<Shared>,
        loaded: &crate::config::Loaded,
        deny: Arc<DenyList>,
    ) -> Control {
        let f = &loaded.file;
        Control {
            shared,
            path: loaded.path.clone(),
            started_with: f.clone(),
            reloading: tokio::sync::Mutex::new(()),
            last_read: Mutex::new(loaded.hash.clone()),
            status: Mutex::new(Status {
                path: loaded.path.clone(),
                hash: loaded.hash.clone(),
                config: effective(f),
                loaded_at_ms: now_ms(),
                last_reload: None,
            }),
            deny,
        }
    }

    /// The dynamic deny entries, which the Redis follower changes directly (in
    /// version order, under the list's own lock).
    pub fn deny(&self) -> &Arc<DenyList> {
        &self.deny
    }

    pub async fn apply(&self, cmd: Command) -> Result<Reply, ControlError> {
        match cmd {
            Command::Reload(trigger) => self.reload(trigger).await,
            Command::DenyAdd(e) => Ok(Reply::Added(self.deny.add(e).await?)),
            Command::DenyRemove(t) => self.deny_remove(t).await,
            Command::Ban(b) => {
                self.deny.ban(b).await;
                Ok(Reply::Done)
            }
            Command::Tick => {
                self.deny.tick().await;
                Ok(Reply::Done)
            }
            Command::ReopenLogs => {
                let rt = self.shared.runtime.load_full();
                if let Some(file) = rt.access.as_ref().and_then(|a| a.file()) {
                    let file = file.clone();
                    // A write and an open: off the runtime's threads.
                    let _ = tokio::task::spawn_blocking(move || file.reopen()).await;
                }
                Ok(Reply::Done)
            }
        }
    }

    /// The control loop: commands, the request path's bans and a `TICK`, applied one
    /// at a time until `stop`; then one last tick (the state file written).
    pub async fn run(
        self: Arc<Self>,
        mut commands: tokio::sync::mpsc::UnboundedReceiver<Command>,
        mut bans: tokio::sync::mpsc::Receiver<BanRequest>,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let cmd = tokio::select! {
                Some(c) = commands.recv() => c,
                Some(b) = bans.recv() => Command::Ban(b),
                _ = tick.tick() => Command::Tick,
                _ = stop.changed() => break,
            };
            // Errors are logged and counted where they happen.
            let _ = self.apply(cmd).await;
        }
        let _ = self.apply(Command::Tick).await;
    }

    /// False with the Redis store until the shared deny list has been read once.
    pub fn ready(&self) -> bool {
        self.deny.ready()
    }

    pub fn status(&self) -> Status {
        lock(&self.status).clone()
    }

    /// The hash of the configuration in force (as `/admin/config` shows it).
    pub fn hash(&self) -> String {
        lock(&self.status).hash.clone()
    }

    /// Why `/readyz` answers 503, in the order it checks: empty when ready.
    pub fn not_ready(&self) -> Vec<&'static str> {
        let mut why = Vec::new();
        if !self.shared.store.ready() {
            why.push("store unavailable");
        }
        if !self.ready() {
            why.push("shared deny list not read yet");
        }
        why
    }

    /// A page of the entries the request path enforces, static ones first: at most
    /// `limit` entries after `after`, the cursor of the next page if there is one,
    /// and how many entries there are.
    pub fn page(
        &self,
        after: Option<&Cursor>,
        limit: usize,
    ) -> (Vec<Entry>, Option<Cursor>, usize) {
        let rt = self.shared.runtime.load();
        self.deny.page(&rt.deny.table, after, limit)
    }

    async fn deny_remove(&self, target: Target) -> Result<Reply, ControlError> {
        match self.deny.remove(target.clone()).await {
            Ok(e) => Ok(Reply::Removed(e)),
            Err(ChangeError::NotFound)
                if self.shared.runtime.load().deny.table.get(&target).is_some() =>
            {
                Err(ControlError::Static(target))
            }
            Err(e) => Err(e.into()),
        }
    }

    // === reload ===

    async fn reload(&self, trigger: Trigger) -> Result<Reply, ControlError> {
        let _one_at_a_time = self.reloading.lock().await;
        let (text, hash) = match std::fs::read_to_string(&self.path) {
            Ok(t) => {
                let hash = crate::config::hash(&t);
                (Ok(t), hash)
            }
            // Seen once per kind of failure, like a file's content.
            Err(e) => (Err(e.to_string()), format!("unreadable: {:?}", e.kind())),
        };
        {
            let mut last = lock(&self.last_read);
            if trigger == Trigger::File && *last == hash {
                return Ok(Reply::Unchanged);
            }
            *last = hash;
        }
        let text = match text {
            Ok(t) => t,
            Err(e) => {
                let msg = format!("{}: cannot read: {e}", self.path.display());
                return self.reload_failed(trigger, msg);
            }
        };
        let m = &self.shared.metrics;
        let loaded = match crate::config::parse(&text, &self.path) {
            Ok(l) => l,
            Err(e) => return self.reload_failed(trigger, e.to_string()),
        };
        // The admin listener stays where it was bound until a restart: a file that
        // moves it to loopback must not drop the token it needs where it still is.
        let bound = self.started_with.admin.listen.0;
        let token = loaded.file.admin.token.as_ref().filter(|t| !t.is_empty());
        if !bound.ip().is_loopback() && token.is_none() {
            let msg = format!(
                "{}: admin.token: the admin listener stays on {bound}, off loopback, until a restart, so it needs a token",
                self.path.display()
            );
            return self.reload_failed(trigger, msg);
        }
        let rt = match compile(&loaded, m, Some(&self.shared.runtime.load())) {
            Ok(rt) => rt,
            Err(e) => return self.reload_failed(trigger, e.to_string()),
        };
        for w in &loaded.warnings {
            tracing::warn!("{w}");
        }
        for setting in needs_restart(&self.started_with, &loaded.file) {
            tracing::warn!(
                setting,
                "changed in the file, but takes effect only after a restart"
            );
        }
        let hash = rt.hash.clone();
        let old = self.shared.runtime.load();
        let built: Vec<_> = rt
            .upstreams
            .values()
            .filter(|up| !old.upstreams.values().any(|o| Arc::ptr_eq(o, up)))
            .cloned()
            .collect();
        // The health gauges of targets no upstream has any more go.
        for up in old.upstreams.values() {
            for target in up.target_labels() {
                let kept = rt
                    .upstreams
                    .get(&up.name)
                    .is_some_and(|new| new.target_labels().any(|t| t == target));
                if !kept {
                    let _ = m
                        .upstream_target_healthy
                        .remove_label_values(&[up.name.as_str(), target.as_str()]);
                }
            }
        }
        drop(old);
        self.shared.runtime.store(Arc::new(rt));
        crate::upstream::health::start(&built, &m.upstream_target_healthy);
        crate::upstream::warn_absent(built);
        m.config_reloads.with_label_values(&["success"]).inc();
        m.config_last_reload_success.set(1);
        let now = now_ms();
        {
            let mut status = lock(&self.status);
            status.hash = hash.clone();
            status.config = effective(&loaded.file);
            status.loaded_at_ms = now;
            status.last_reload = Some(ReloadRecord {
                at_ms: now,
                trigger,
                result: Ok(hash.clone()),
            });
        }
        tracing::info!(%hash, trigger = trigger.as_str(), "configuration reloaded");
        Ok(Reply::Reloaded(hash))
    }

    fn reload_failed(&self, trigger: Trigger, error: String) -> Result<Reply, ControlError> {
        let m = &self.shared.metrics;
        m.config_reloads.with_label_values(&["failure"]).inc();
        m.config_last_reload_success.set(0);
        lock(&self.status).last_reload = Some(ReloadRecord {
            at_ms: now_ms(),
            trigger,
            result: Err(error.clone()),
        });
        tracing::error!(%error, trigger = trigger.as_str(), "reload failed; the previous configuration stays");
        Err(ControlError::Config(error))
    }
}

// === the gateway, as the deny list's host ===

impl Host for Shared {
    fn publish(&self, view: Arc<DenyView>) -> Arc<DenyView> {
        self.deny.swap(view)
    }

    fn max_entries(&self) -> usize {
        self.runtime.load().deny.max_entries
    }

    fn metrics(&self) -> &Metrics {
        &self.metrics
    }
}

impl From<ChangeError> for ControlError {
    fn from(e: ChangeError) -> ControlError {
        match e {
            ChangeError::NotFound => ControlError::NotFound,
            ChangeError::Store(e) => ControlError::Store(e),
            ChangeError::Full(full) => ControlError::Full(full),
        }
    }
}

// === helpers ===

/// The configuration as JSON with defaults filled in, secrets replaced by `***`
/// (the admin token, Redis passwords, JWT providers' HS secrets, and credentials in
/// URLs).
fn effective(f: &schema::File) -> serde_json::Value {
    let mut v = serde_json::to_value(f).unwrap_or(serde_json::Value::Null);
    if let Some(token) = v.pointer_mut("/admin/token") {
        if !token.is_null() {
            *token = "***".into();
        }
    }
    let redact = |u: &mut serde_json::Value| {
        if let Some(s) = u.as_str() {
            *u = redact_url(s).into();
        }
    };
    if let Some(url) = v.pointer_mut("/store/redis/url") {
        redact(url);
    }
    for list in ["/store/redis/cluster", "/store/redis/sentinel/nodes"] {
        if let Some(nodes) = v.pointer_mut(list).and_then(|c| c.as_array_mut()) {
            nodes.iter_mut().for_each(redact);
        }
    }
    if let Some(password) = v.pointer_mut("/store/redis/sentinel/password") {
        if !password.is_null() {
            *password = "***".into();
        }
    }
    if let Some(providers) = v
        .pointer_mut("/jwt/providers")
        .and_then(|p| p.as_object_mut())
    {
        for p in providers.values_mut() {
            if let Some(secret) = p.get_mut("secret").filter(|s| !s.is_null()) {
                *secret = "***".into();
            }
            if let Some(url) = p.get_mut("jwks_url") {
                redact(url);
            }
        }
    }
    if let Some(ups) = v.pointer_mut("/upstreams").and_then(|u| u.as_object_mut()) {
        for up in ups.values_mut() {
            if let Some(ts) = up.get_mut("targets").and_then(|t| t.as_array_mut()) {
                ts.iter_mut().for_each(redact);
            }
        }
    }
    v
}

/// The settings that differ between `old` and `new` and that a reload cannot apply:
/// listeners, TLS, connection limits, timeouts of the listener, and the store.
fn needs_restart(old: &schema::File, new: &schema::File) -> Vec<&'static str> {
    let (o, n) = (&old.server, &new.server);
    let mut changed = Vec::new();
    let mut check = |name: &'static str, differs: bool| {
        if differs {
            changed.push(name);
        }
    };
    // `section.field` for each field named, compared as values.
    macro_rules! fields {
        ($section:literal, $o:ident, $n:ident: $($field:ident),+) => {
            $(check(concat!($section, ".", stringify!($field)), $o.$field != $n.$field);)+
        };
    }
    fields!("server", o, n: listen);
    check("server.tls", json(&o.tls) != json(&n.tls));
    fields!("server", o, n: max_connections, request_header_timeout, shutdown_grace,
        max_connections_per_ip, idle_timeout, workers);
    // Held by each connection's socket; request_body_timeout and
    // tunnel_idle_timeout go with the upstreams and apply to the next request.
    fields!("server", o, n: send_timeout, max_header_bytes);
    let (oa, na) = (&old.admin, &new.admin);
    fields!("admin", oa, na: listen, max_connections_per_ip, request_header_timeout,
        idle_timeout);
    // on_error is read per request from the swapped configuration.
    let store = |f: &schema::File| {
        let mut v = json(&f.store);
        if let Some(m) = v.as_object_mut() {
            m.remove("on_error");
        }
        v
    };
    check("store", store(old) != store(new));
    check(
        "deny.state_file",
        old.deny.state_file != new.deny.state_file,
    );
    // Envoy's rate limit service is started with the gateway; its folder's files
    // are reloaded on their own.
    check("rls", json(&old.rls) != json(&new.rls));
    changed
}

/// A configuration section as JSON, to compare sections that have no `PartialEq`.
fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(yaml: &str) -> schema::File {
        serde_yaml::from_str(yaml).expect("valid schema")
    }

    #[test]
    fn listener_settings_need_a_restart_upstream_and_upgrade_ones_do_not() {
        let old = file("routes: []\n");
        let new = file(
            "server: {idle_timeout: 5s, send_timeout: 5s, request_body_timeout: 5s, tunnel_idle_timeout: 5s, max_connections_per_ip: 3, max_header_bytes: 16KiB, upgrades: []}\nupstreams: {a: {targets: [http://127.0.0.1:1], max_connections: 5}}\nroutes: []\n",
        );
        assert_eq!(
            needs_restart(&old, &new),
            [
                "server.max_connections_per_ip",
                "server.idle_timeout",
                "server.send_timeout",
                "server.max_header_bytes"
            ]
        );
    }

    #[test]
    fn jwt_secrets_are_redacted() {
        let f = file(
            "jwt:\n  providers:\n    hs: {secret: s3cret-of-the-issuer}\n    idp: {jwks_url: \"https://user:pw@idp.example.com/jwks.json\", issuer: idp}\nroutes: []\n",
        );
        let p = &effective(&f)["jwt"]["providers"];
        assert_eq!(p["hs"]["secret"], "***");
        assert_eq!(
            p["idp"]["jwks_url"],
            "https://user:***@idp.example.com/jwks.json"
        );
        assert_eq!(p["idp"]["issuer"], "idp");
        assert_eq!(p["idp"]["secret"], serde_json::Value::Null);
    }

    #[test]
    fn sentinel_secrets_are_redacted() {
        let f = file(
            "store: {backend: redis, redis: {sentinel: {master: m, nodes: [\"redis://:spw@10.0.0.1:26379\", redis://10.0.0.2:26379], password: pw}}}\nroutes: []\n",
        );
        let s = &effective(&f)["store"]["redis"]["sentinel"];
        assert_eq!(
            s["nodes"],
            serde_json::json!(["redis://***@10.0.0.1:26379", "redis://10.0.0.2:26379"])
        );
        assert_eq!(s["password"], "***");
        assert_eq!(s["master"], "m");
        let none = file(
            "store: {backend: redis, redis: {sentinel: {master: m, nodes: []}}}\nroutes: []\n",
        );
        assert_eq!(
            effective(&none)["store"]["redis"]["sentinel"]["password"],
            serde_json::Value::Null
        );
    }
}
