//! The one place that changes a running gateway. The file watcher, SIGHUP, the admin
//! API and automatic bans only translate what they see into a `Command`;
//! `Control::apply` carries it out. The Redis follower calls `Control::remote`, which
//! applies the shared list's changes in version order under the same lock as this
//! instance's own. Reloads are serialized; dynamic deny entries live here (published
//! to the request path as one swapped snapshot) and so survive reloads.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::config::compile::compile;
use crate::config::schema;
use crate::config::value::{fmt_dur, redact_url};
use crate::deny::sync::{DenySync, Position, Remote, Written};
use crate::deny::{
    now_ms, BanRequest, Cursor, DenyTable, DenyView, DynamicTable, Entry, EntryJson, Full, Meta,
    Source, Target,
};
use crate::pipeline::Shared;
use tokio::sync::Notify;

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
    /// Dynamic entries, authoritative for this instance; `Shared::deny` holds a view.
    dynamic: Mutex<Dynamic>,
    sync: Option<Arc<DenySync>>,
    /// Entries the shared list should have but may not: bans made while Redis was
    /// unreachable, and everything this copy held when Redis lost its data. Kept in
    /// the local copy whenever the shared list is read, until written back.
    pending: Arc<Mutex<Vec<Entry>>>,
    /// A change not yet published to the request path (see `publish_soon`).
    publish_pending: AtomicBool,
    publish_wake: Notify,
    /// The view published before the current one.
    retired: Mutex<Option<Arc<DenyView>>>,
    /// A write-back is under way.
    writing_back: Arc<AtomicBool>,
    /// This instance's bans on their way to Redis, which the copy holds beyond
    /// `deny.max_entries` until Redis says what each evicted (see `insert_ban`).
    bans_in_flight: Arc<AtomicUsize>,
}

struct Dynamic {
    table: DynamicTable,
    /// Not before then is the request path's base rebuilt again (see `publish`).
    rebuild_after: Instant,
    /// Changed since the state file was last written.
    dirty: bool,
    state_file: Option<PathBuf>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// === impl Control ===

impl Control {
    /// `loaded` is the configuration `shared` was started with. With the memory store
    /// and `deny.state_file`, the entries saved there are loaded (expired ones dropped);
    /// with `sync`, the shared list is read at startup and kept by the follower, both
    /// through `remote`.
    pub fn new(
        shared: Arc<Shared>,
        loaded: &crate::config::Loaded,
        sync: Option<Arc<DenySync>>,
    ) -> Control {
        let f = &loaded.file;
        let state_file = match (&sync, &f.deny.state_file) {
            (None, Some(p)) => Some(PathBuf::from(p.as_str())),
            _ => None,
        };
        let mut table = DenyTable::new();
        if let Some(p) = &state_file {
            match read_state(p) {
                Ok(entries) => {
                    let now = now_ms();
                    let live: Vec<Entry> = entries
                        .into_iter()
                        .filter(|e| e.meta.expires_at_ms.is_none_or(|t| t > now))
                        .collect();
                    tracing::info!(file = %p.display(), entries = live.len(), "dynamic deny entries loaded");
                    for e in live {
                        table.insert(e);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                    // Kept for a person to look at: the next change overwrites the file.
                    let mut aside = p.as_os_str().to_owned();
                    aside.push(".corrupt");
                    let moved = std::fs::rename(p, &aside).is_ok();
                    tracing::error!(file = %p.display(), error = %e, moved_to = ?moved.then_some(&aside), "deny.state_file not loaded; starting with no dynamic entries")
                }
                Err(e) => {
                    tracing::error!(file = %p.display(), error = %e, "deny.state_file cannot be read; starting with no dynamic entries")
                }
            }
        }
        let control = Control {
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
            pending: Arc::new(Mutex::new(Vec::new())),
            publish_pending: AtomicBool::new(false),
            publish_wake: Notify::new(),
            retired: Mutex::new(None),
            writing_back: Arc::new(AtomicBool::new(false)),
            bans_in_flight: Arc::new(AtomicUsize::new(0)),
            dynamic: Mutex::new(Dynamic {
                table: DynamicTable::new(table),
                rebuild_after: Instant::now(),
                dirty: false,
                state_file,
            }),
            sync,
        };
        control.publish(&mut lock(&control.dynamic));
        control
    }

    pub async fn apply(&self, cmd: Command) -> Result<Reply, ControlError> {
        match cmd {
            Command::Reload(trigger) => self.reload(trigger).await,
            Command::DenyAdd(e) => self.deny_add(e).await,
            Command::DenyRemove(t) => self.deny_remove(t).await,
            Command::Ban(b) => {
                self.ban(b).await;
                Ok(Reply::Done)
            }
            Command::Tick => {
                self.tick().await;
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

    /// False with the Redis store until the shared deny list has been read once.
    pub fn ready(&self) -> bool {
        self.sync.as_ref().is_none_or(|s| s.ready())
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
        // The table, not the request path's view (it has no reasons), with pending
        // changes published first (cheap): what is listed is enforced. A page is one
        // pass over the table under the lock; bans and admin changes wait for it.
        let mut d = lock(&self.dynamic);
        if self.publish_pending.swap(false, Ordering::AcqRel) {
            self.publish(&mut d);
        }
        let dynamic = &d.table;
        let total = rt.deny.table.len() + dynamic.len();
        // One more than asked for says whether there is a next page.
        let want = limit.saturating_add(1);
        let mut page: Vec<(bool, Entry)> = Vec::new();
        if after.is_none_or(|c| !c.dynamic) {
            let from = after.map(|c| &c.target);
            page.extend(
                rt.deny
                    .table
                    .page(from, want)
                    .into_iter()
                    .map(|e| (false, e)),
            );
        }
        if page.len() < want {
            let from = after.filter(|c| c.dynamic).map(|c| &c.target);
            let left = want - page.len();
            page.extend(dynamic.page(from, left).into_iter().map(|e| (true, e)));
        }
        let next = if page.len() > limit {
            page.truncate(limit);
            page.last().map(|(dynamic, e)| Cursor {
                dynamic: *dynamic,
                target: e.target.clone(),
            })
        } else {
            None
        };
        (page.into_iter().map(|(_, e)| e).collect(), next, total)
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

    // === the deny list ===

    async fn deny_add(&self, e: Entry) -> Result<Reply, ControlError> {
        let max = self.max_entries();
        let written = match &self.sync {
            Some(sync) => match sync.put_within(&e, max).await.map_err(store_error)? {
                Written::Changed(at, evicted) => Some((at, evicted)),
                Written::Kept => None,
                Written::Full => return Err(Full(max).into()),
            },
            None => None,
        };
        let mut added = Ok(());
        self.change_unless_followed(written.as_ref().map(|(at, _)| at), |t| match &written {
            // What Redis evicted for it, not what this copy would choose.
            Some((_, evicted)) => self.put_shared(t, e.clone(), evicted, max),
            None => added = self.insert_within(t, e.clone(), max).map(drop),
        });
        // With Redis the shared list took it: the follower keeps this copy in step.
        if written.is_none() {
            added?;
        }
        tracing::info!(entry = %e.target.logged(), expires_at_ms = ?e.meta.expires_at_ms, reason = ?e.meta.reason, "deny entry added");
        Ok(Reply::Added(e))
    }

    /// `deny.max_entries` of the running configuration.
    fn max_entries(&self) -> usize {
        self.shared.runtime.load().deny.max_entries
    }

    /// Inserts `e` into the dynamic table within `max` entries, counting and logging
    /// what it evicts; returns the evicted targets.
    fn insert_within(
        &self,
        t: &mut DynamicTable,
        e: Entry,
        max: usize,
    ) -> Result<Vec<Target>, Full> {
        self.evicting(t.insert_within(e, max))
    }

    /// Counts and logs what an `insert_within` evicted; the evicted targets.
    fn evicting(&self, inserted: Result<Vec<Entry>, Full>) -> Result<Vec<Target>, Full> {
        let evicted = inserted?;
        if !evicted.is_empty() {
            self.shared
                .metrics
                .deny_evictions
                .inc_by(evicted.len() as u64);
            for old in &evicted {
                tracing::debug!(entry = %old.target.logged(), "deny entry evicted at deny.max_entries");
            }
        }
        Ok(evicted.into_iter().map(|e| e.target).collect())
    }

    /// Applies an entry the shared list took: exactly the entries Redis evicted for
    /// it leave this copy, so copies and Redis evict alike. Only a copy still at the
    /// cap (beyond this instance's own bans in flight) differs from Redis: it
    /// evicts by itself and reads the list again at the next poll.
    fn put_shared(&self, t: &mut DynamicTable, e: Entry, evicted: &[Target], max: usize) {
        for x in evicted {
            t.remove(x);
        }
        let room = max.saturating_add(self.bans_in_flight.load(Ordering::Acquire));
        if t.get(&e.target).is_some() || t.len() < room {
            t.insert(e);
            return;
        }
        let _ = self.insert_within(t, e, max);
        if let Some(sync) = &self.sync {
            sync.recheck();
        }
    }

    /// Inserts this instance's own ban. With Redis, the shared list decides what a
    /// ban at the cap evicts and the follower applies that (`put_shared`), so the
    /// copy holds one entry beyond `max` per ban on its way to Redis; past that
    /// (Redis slow or away), and without Redis, the copy evicts by itself. Returns
    /// what it evicted.
    fn insert_ban(&self, t: &mut DynamicTable, e: Entry, max: usize) -> Result<Vec<Target>, Full> {
        let in_flight = match &self.sync {
            Some(_) => self.bans_in_flight.load(Ordering::Acquire),
            None => 0,
        };
        if t.get(&e.target).is_none() && t.len() < max.saturating_add(in_flight) {
            t.insert(e);
            return Ok(Vec::new());
        }
        self.insert_within(t, e, max)
    }

    async fn deny_remove(&self, target: Target) -> Result<Reply, ControlError> {
        let shared = match &self.sync {
            Some(sync) => {
                let written = sync.delete(&target).await.map_err(store_error)?;
                // Nothing to delete in Redis: if another instance adds it meanwhile,
                // this copy must not be the one that forgets it.
                if written.is_none() {
                    sync.recheck();
                }
                written
            }
            None => None,
        };
        lock(&self.pending).retain(|e| e.target != target);
        let mut removed = None;
        self.change_unless_followed(shared.as_ref(), |t| removed = t.remove(&target));
        match removed {
            Some(e) => {
                tracing::info!(entry = %e.target.logged(), "deny entry removed");
                Ok(Reply::Removed(e))
            }
            // Removed from Redis, and already from here by the follower.
            None if shared.is_some() => Ok(Reply::Removed(Entry {
                target,
                meta: Meta {
                    expires_at_ms: None,
                    reason: None,
                    source: Source::Api,
                    route: None,
                },
            })),
            None if self.shared.runtime.load().deny.table.get(&target).is_some() => {
                Err(ControlError::Static(target))
            }
            None => Err(ControlError::NotFound),
        }
    }

    /// Applies this instance's own change to the local copy, unless the follower has
    /// already applied the shared list's change (or a later one) that `written` names:
    /// applying it again could undo a later change from another instance. Without
    /// Redis (`written` None) the change is always applied.
    fn change_unless_followed(
        &self,
        written: Option<&Position>,
        f: impl FnOnce(&mut DynamicTable),
    ) {
        let mut d = lock(&self.dynamic);
        let followed = match (&self.sync, written) {
            (Some(sync), Some(w)) => sync.followed(w),
            _ => false,
        };
        if !followed {
            f(&mut d.table);
            d.dirty = true;
        }
        // Published before the caller answers, also when the follower applied the
        // change (it publishes a little later): an admin call takes effect at once.
        self.publish_pending.store(false, Ordering::Release);
        self.publish(&mut d);
    }

    async fn ban(&self, b: BanRequest) {
        let now = now_ms();
        let until = now.saturating_add(b.duration.as_millis() as u64);
        // Refusals that raced the first request for this ban ask again: one is enough.
        let already = lock(&self.dynamic)
            .table
            .get(&b.target)
            .is_some_and(|e| e.meta.expires_at_ms.is_none_or(|t| t > now));
        if already {
            return;
        }
        let e = Entry {
            target: b.target,
            meta: Meta {
                expires_at_ms: Some(until),
                reason: Some(
                    format!(
                        "kept hitting the limits of route {} (banned for {})",
                        b.route,
                        fmt_dur(b.duration)
                    )
                    .into(),
                ),
                source: Source::Ban,
                route: Some(b.route.as_str().into()),
            },
        };
        let max = self.max_entries();
        let mut added = Ok(Vec::new());
        self.change_soon(|t| {
            // Counted before the insert, so that it makes room for itself.
            if self.sync.is_some() {
                self.bans_in_flight.fetch_add(1, Ordering::AcqRel);
            }
            added = self.insert_ban(t, e.clone(), max);
        });
        let evicted_here = match added {
            Ok(mut evicted) => {
                evicted.sort();
                evicted
            }
            Err(full) => {
                if self.sync.is_some() {
                    self.bans_in_flight.fetch_sub(1, Ordering::AcqRel);
                }
                // Once per refusal that asks: debug, so a flood cannot flood the log.
                tracing::debug!(entry = %e.target.logged(), "ban not made: {full}");
                return;
            }
        };
        tracing::warn!(route = %b.route, entry = %e.target.logged(), duration = %fmt_dur(b.duration), "banned");
        self.shared
            .metrics
            .bans
            .with_label_values(&[b.route.as_str()])
            .inc();
        // Enforced here already; shared off the control loop, so a burst of bans
        // never waits for Redis one round trip at a time. Pending until shared, so a
        // read of the shared list meanwhile keeps it.
        if let Some(sync) = self.sync.clone() {
            lock(&self.pending).push(e.clone());
            let (pending, in_flight) = (self.pending.clone(), self.bans_in_flight.clone());
            tokio::spawn(async move {
                let written = sync.put_within(&e, max).await;
                in_flight.fetch_sub(1, Ordering::AcqRel);
                match written {
                    Ok(written) => {
                        lock(&pending).retain(|p| *p != e);
                        let agrees = match written {
                            // The follower applies what Redis evicted, unless this
                            // copy evicted for itself (too many bans in flight) and
                            // chose other entries.
                            Written::Changed(_, mut evicted) => {
                                evicted.sort();
                                evicted_here.is_empty() || evicted == evicted_here
                            }
                            // Redis kept a longer entry (or had no room): this copy
                            // holds the ban instead.
                            Written::Kept | Written::Full => false,
                        };
                        if !agrees {
                            sync.recheck();
                        }
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, entry = %e.target.logged(), "ban not shared yet: Redis unavailable")
                    }
                }
            });
        }
    }

    /// A change from the shared list, or the whole of it, with the position it
    /// reaches: applied by the follower in version order, under the same lock as this
    /// instance's own changes (see `change_unless_followed`), so it bypasses the
    /// command queue.
    pub fn remote(&self, r: Remote, at: Position) {
        let mut d = lock(&self.dynamic);
        let sync = self.sync.as_ref();
        let max = self.max_entries();
        match r {
            Remote::Put(e, evicted) => self.put_shared(&mut d.table, e, &evicted, max),
            Remote::Delete(target) => {
                lock(&self.pending).retain(|e| e.target != target);
                d.table.remove(&target);
            }
            Remote::All { entries, lost } => {
                let mut all = DenyTable::new();
                for e in entries {
                    let _ = self.evicting(all.insert_within(e, max));
                }
                let now = now_ms();
                let mut pending = lock(&self.pending);
                if lost {
                    // Redis lost its data (restarted without persistence, a flush, an
                    // empty replica, a failover that went back in time): everything
                    // this copy holds is written back, so that a Redis restart lifts
                    // no entry. Entries deleted since are not (tombstones).
                    tracing::warn!(
                        entries = d.table.len(),
                        "the shared deny list was lost in Redis; writing this instance's copy back"
                    );
                    pending.extend(d.table.entries());
                }
                tidy(&mut pending, now);
                // Until written back, pending entries stay enforced here, whatever a
                // half-restored list says; bans in flight beyond the cap, since Redis
                // says what each evicts (`insert_ban`).
                let room = max.saturating_add(self.bans_in_flight.load(Ordering::Acquire));
                for e in pending.iter() {
                    if all.get(&e.target).is_some() {
                        continue;
                    }
                    if all.len() < room {
                        all.insert(e.clone());
                    } else {
                        let _ = self.evicting(all.insert_within(e.clone(), max));
                    }
                }
                d.table.replace(all);
                let restore = pending.clone();
                drop(pending);
                if let Some(sync) = sync {
                    sync.set_position(at);
                }
                d.dirty = true;
                self.publish_pending.store(false, Ordering::Release);
                self.publish(&mut d);
                return self.write_back(restore);
            }
        }
        if let Some(sync) = sync {
            sync.set_position(at);
        }
        d.dirty = true;
        self.publish_soon();
    }

    /// Writes `entries` back to the shared list (keeping any entry it has), off the
    /// caller; once written they are no longer pending. One write-back at a time.
    fn write_back(&self, entries: Vec<Entry>) {
        let (Some(sync), false) = (self.sync.clone(), entries.is_empty()) else {
            return;
        };
        if self.writing_back.swap(true, Ordering::AcqRel) {
            return;
        }
        let (pending, writing) = (self.pending.clone(), self.writing_back.clone());
        let max = self.max_entries();
        tokio::spawn(async move {
            let (changed, result) = sync.restore(&entries, max).await;
            if result.is_ok() {
                // No longer pending before the followers read the list again: entries
                // deleted since must then leave every copy.
                let written: std::collections::HashSet<&Entry> = entries.iter().collect();
                lock(&pending).retain(|p| !written.contains(p));
            }
            let announced = if changed {
                sync.announce().await
            } else {
                Ok(())
            };
            if let Err(err) = result.and(announced) {
                tracing::debug!(error = %err, entries = entries.len(), "entries not written back yet");
            }
            writing.store(false, Ordering::Release);
        });
    }

    async fn tick(&self) {
        // Entries not written back yet (Redis away, a failed write) are tried again.
        let retry = {
            let mut pending = lock(&self.pending);
            tidy(&mut pending, now_ms());
            pending.clone()
        };
        self.write_back(retry);
        let (expired, save) = {
            let mut d = lock(&self.dynamic);
            let expired = d.table.purge(now_ms());
            if !expired.is_empty() {
                d.dirty = true;
                self.publish_soon();
            }
            // The file is written from a snapshot, off the lock and the runtime.
            let save = match (d.state_file.clone(), d.dirty) {
                (Some(p), true) => {
                    d.dirty = false;
                    let list: Vec<EntryJson> =
                        d.table.entries().iter().map(Entry::to_json).collect();
                    Some((p, list))
                }
                _ => None,
            };
            (expired, save)
        };
        if let Some((p, list)) = save {
            let written = tokio::task::spawn_blocking({
                let p = p.clone();
                move || write_state(&p, &list)
            })
            .await;
            if let Err(e) = written.map_err(std::io::Error::other).and_then(|r| r) {
                tracing::error!(file = %p.display(), error = %e, "cannot write deny.state_file");
                lock(&self.dynamic).dirty = true;
            }
        }
        match expired.as_slice() {
            [] => {}
            [e] => tracing::info!(entry = %e.target.logged(), "deny entry expired"),
            many => tracing::info!(entries = many.len(), "deny entries expired"),
        }
        if let (Some(sync), false) = (self.sync.clone(), expired.is_empty()) {
            // Every instance tries, in batches, off the control loop; Redis' clock
            // decides, so an entry renewed meanwhile stays.
            let targets: Vec<Target> = expired.into_iter().map(|e| e.target).collect();
            tokio::spawn(async move {
                if let Err(err) = sync.expire(&targets).await {
                    tracing::debug!(error = %err, "expired entries not removed from Redis");
                }
            });
        }
    }

    /// Changes the dynamic table; the request path sees it within `PUBLISH_EVERY`.
    fn change_soon(&self, f: impl FnOnce(&mut DynamicTable)) {
        let mut d = lock(&self.dynamic);
        f(&mut d.table);
        d.dirty = true;
        self.publish_soon();
    }

    /// Changes that come in bursts (bans, other instances' changes, expiries) are
    /// applied to the table one by one and published together by `run_publisher`,
    /// at most once per `PUBLISH_EVERY` (or per ten times as long as the last copy
    /// took, should the overlay have grown large): a publish copies every change
    /// since the base was last rebuilt, so one per ban would make a flood quadratic.
    fn publish_soon(&self) {
        self.publish_pending.store(true, Ordering::Release);
        self.publish_wake.notify_one();
    }

    /// Publishes pending changes until the process ends.
    pub async fn run_publisher(self: Arc<Self>) {
        loop {
            self.publish_wake.notified().await;
            let mut took = Duration::ZERO;
            if self.publish_pending.swap(false, Ordering::AcqRel) {
                took = self.publish(&mut lock(&self.dynamic));
            }
            tokio::time::sleep(PUBLISH_EVERY.max(took * 10)).await;
        }
    }

    /// Gives the request path a view of the table: the base it has (shared) and the
    /// changes since (copied), O(changes), not O(entries). Past `rebuild_at` changes
    /// they are first folded into a new base, O(entries), so that a change costs
    /// O(√entries) amortized; at most once per ten times as long as the last rebuild
    /// took, so that a flood costs a bounded share of a core (the changes pile up
    /// meanwhile). Returns how long the copy took, not counting a rebuild.
    fn publish(&self, d: &mut Dynamic) -> Duration {
        // Counted before it is enforced, so the gauge is never behind the table.
        let g = &self.shared.metrics.deny_entries;
        for source in [Source::Api, Source::Ban] {
            let n = i64::try_from(d.table.count(source)).unwrap_or(i64::MAX);
            g.with_label_values(&[source.as_str()]).set(n);
        }
        let started = Instant::now();
        if d.table.changes() > rebuild_at(d.table.len()) && started >= d.rebuild_after {
            d.table.rebuild();
            d.rebuild_after = Instant::now() + started.elapsed() * 10;
        }
        let copying = Instant::now();
        let view = Arc::new(d.table.view());
        let took = copying.elapsed();
        let old = self.shared.deny.swap(view);
        // Freed at the next publish, here, not by whichever request happens to drop
        // the last reference (a base of 100,000 entries takes milliseconds to free).
        *lock(&self.retired) = Some(old);
        took
    }
}

/// How many changes the request path's overlay holds before its base is rebuilt:
/// √entries balances the copy of the overlay at each publish against the rebuild.
fn rebuild_at(entries: usize) -> usize {
    1024.max(2 * entries.isqrt())
}

/// How often, at most, bursts of changes are published to the request path.
const PUBLISH_EVERY: Duration = Duration::from_millis(20);

// === helpers ===

/// Pending entries: expired ones dropped, one per target (the latest).
fn tidy(pending: &mut Vec<Entry>, now: u64) {
    pending.retain(|e| e.meta.expires_at_ms.is_none_or(|at| at > now));
    let mut seen = std::collections::HashSet::new();
    for i in (0..pending.len()).rev() {
        if !seen.insert(pending[i].target.clone()) {
            pending.remove(i);
        }
    }
}

fn store_error(e: crate::limit::StoreError) -> ControlError {
    ControlError::Store(e.to_string())
}

/// The configuration as JSON with defaults filled in, secrets replaced by `***`.
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
    check("server.listen", o.listen != n.listen);
    check("server.tls", json(&o.tls) != json(&n.tls));
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
    check(
        "server.max_connections_per_ip",
        o.max_connections_per_ip != n.max_connections_per_ip,
    );
    check("server.idle_timeout", o.idle_timeout != n.idle_timeout);
    check("server.workers", o.workers != n.workers);
    // Held by each connection's socket; request_body_timeout and
    // tunnel_idle_timeout go with the upstreams and apply to the next request.
    check("server.send_timeout", o.send_timeout != n.send_timeout);
    check(
        "server.max_header_bytes",
        o.max_header_bytes != n.max_header_bytes,
    );
    check("admin.listen", old.admin.listen != new.admin.listen);
    let (oa, na) = (&old.admin, &new.admin);
    check(
        "admin.max_connections_per_ip",
        oa.max_connections_per_ip != na.max_connections_per_ip,
    );
    check(
        "admin.request_header_timeout",
        oa.request_header_timeout != na.request_header_timeout,
    );
    check("admin.idle_timeout", oa.idle_timeout != na.idle_timeout);
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
    changed
}

/// A configuration section as JSON, to compare sections that have no `PartialEq`.
fn json<T: serde::Serialize>(v: &T) -> serde_json::Value {
    serde_json::to_value(v).unwrap_or(serde_json::Value::Null)
}

fn read_state(p: &std::path::Path) -> std::io::Result<Vec<Entry>> {
    let bytes = match std::fs::read(p) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let text = String::from_utf8(bytes)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let list: Vec<EntryJson> = serde_json::from_str(&text)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    Ok(list.into_iter().filter_map(Entry::from_json).collect())
}

/// Temp file in the same directory, fsync, rename: a crash leaves the old file or the
/// new one, never half of one.
fn write_state(p: &std::path::Path, list: &[EntryJson]) -> std::io::Result<()> {
    use std::io::Write;
    let body = serde_json::to_vec_pretty(list).map_err(std::io::Error::other)?;
    let mut tmp = p.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(&body)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, p)
}

/// How often expired entries are dropped and the state file written.
pub const TICK: Duration = Duration::from_secs(1);

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
