//! This instance's dynamic deny entries and their policy: the table (published to
//! the request path as one swapped view), eviction at `deny.max_entries`, bans, the
//! shared list's changes applied in version order with this instance's own, the
//! write-back of what Redis lost, expiry, and (through `state_file`) the memory
//! store's state file.
//! The control loop and the admin API call in; the entries survive reloads.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::deny::state_file;
use crate::deny::sync::{DenySync, Position, Remote, Written};
use crate::deny::{
    now_ms, BanRequest, Cursor, DenyTable, DenyView, DynamicTable, Entry, EntryJson, Full, Meta,
    Source, Target,
};
use crate::telemetry::fmt_dur;
use crate::telemetry::metrics::Metrics;

/// What the deny list needs of the gateway it runs in.
pub trait Host: Send + Sync {
    /// Hands the request path a new view; the one it replaces.
    fn publish(&self, view: Arc<DenyView>) -> Arc<DenyView>;
    /// `deny.max_entries` of the running configuration.
    fn max_entries(&self) -> usize;
    fn metrics(&self) -> &Metrics;
}

/// Why a change to the list was not made.
#[derive(Debug, thiserror::Error)]
pub enum ChangeError {
    #[error("no such entry")]
    NotFound,
    #[error("shared deny list unavailable: {0}")]
    Store(String),
    #[error(transparent)]
    Full(#[from] Full),
}

pub struct DenyList {
    host: Arc<dyn Host>,
    /// Dynamic entries, authoritative for this instance; the host holds a view.
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

// === impl DenyList ===

impl DenyList {
    /// Without `sync` (the memory store) and with a `state_file`, the entries saved
    /// there are loaded (expired ones dropped); with `sync`, the shared list is read
    /// at startup and kept by the follower, both through `remote`.
    pub fn new(
        host: Arc<dyn Host>,
        sync: Option<Arc<DenySync>>,
        state_file: Option<PathBuf>,
    ) -> DenyList {
        let state_file = match &sync {
            None => state_file,
            Some(_) => None,
        };
        let table = match &state_file {
            Some(p) => state_file::load(p),
            None => DenyTable::new(),
        };
        let list = DenyList {
            host,
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
        list.publish(&mut lock(&list.dynamic));
        list
    }

    /// False with the Redis store until the shared deny list has been read once.
    pub fn ready(&self) -> bool {
        self.sync.as_ref().is_none_or(|s| s.ready())
    }

    /// A page of the entries the request path enforces, static ones (`configured`,
    /// `deny:` of the configuration) first: at most `limit` entries after `after`,
    /// the cursor of the next page if there is one, and how many entries there are.
    pub fn page(
        &self,
        configured: &DenyTable,
        after: Option<&Cursor>,
        limit: usize,
    ) -> (Vec<Entry>, Option<Cursor>, usize) {
        // The table, not the request path's view (it has no reasons), with pending
        // changes published first (cheap): what is listed is enforced. A page is one
        // pass over the table under the lock; bans and admin changes wait for it.
        let mut d = lock(&self.dynamic);
        if self.publish_pending.swap(false, Ordering::AcqRel) {
            self.publish(&mut d);
        }
        let dynamic = &d.table;
        let total = configured.len() + dynamic.len();
        // One more than asked for says whether there is a next page.
        let want = limit.saturating_add(1);
        let mut page: Vec<(bool, Entry)> = Vec::new();
        if after.is_none_or(|c| !c.dynamic) {
            let from = after.map(|c| &c.target);
            page.extend(configured.page(from, want).into_iter().map(|e| (false, e)));
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

    /// Adds (or replaces) an entry, within `deny.max_entries`; with Redis, in the
    /// shared list first.
    pub async fn add(&self, e: Entry) -> Result<Entry, ChangeError> {
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
        Ok(e)
    }

    /// `deny.max_entries` of the running configuration.
    fn max_entries(&self) -> usize {
        self.host.max_entries()
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
            self.host
                .metrics()
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

    /// Removes a dynamic entry; with Redis, from the shared list first. `NotFound`
    /// when there is no such dynamic entry (it may be a static one).
    pub async fn remove(&self, target: Target) -> Result<Entry, ChangeError> {
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
                Ok(e)
            }
            // Removed from Redis, and already from here by the follower.
            None if shared.is_some() => Ok(Entry {
                target,
                meta: Meta {
                    expires_at_ms: None,
                    reason: None,
                    source: Source::Api,
                    route: None,
                },
            }),
            None => Err(ChangeError::NotFound),
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

    /// Denies a key that kept hitting a route's limit.
    pub async fn ban(&self, b: BanRequest) {
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
        self.host
            .metrics()
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

    /// Drops expired entries and writes the state file if anything changed.
    pub async fn tick(&self) {
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
                move || state_file::write(&p, &list)
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
        let g = &self.host.metrics().deny_entries;
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
        let old = self.host.publish(view);
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

fn store_error(e: crate::redis::Error) -> ChangeError {
    ChangeError::Store(e.to_string())
}

/// How often expired entries are dropped and the state file written.
pub const TICK: Duration = Duration::from_secs(1);
