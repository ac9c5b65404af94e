//! The deny list shared through Redis: one hash of entries, changes published in
//! version order, each instance's copy read again on a gap, and the list written
//! back when Redis lost it; bounded by an expiry index and a TTL on every key. The
//! protocol in full: ARCHITECTURE.md, "The shared deny list".

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};

use crate::deny::{Entry, EntryJson, Target};
use crate::redis::{Error as StoreError, Script, Shared};
use crate::telemetry::metrics::CallKind;

/// A change to the local copy, from the shared list.
#[derive(Debug)]
pub enum Remote {
    /// An entry added or replaced, and the entries the shared list evicted for it.
    Put(Entry, Vec<Target>),
    Delete(Target),
    /// The whole list, replacing the local copy; `lost` when Redis lost its data
    /// since the last read (its epoch changed).
    All {
        entries: Vec<Entry>,
        lost: bool,
    },
}

/// Where a copy of the shared list stands: the version it reflects, and the epoch of
/// the list that version belongs to (None while the list has none: nothing was ever
/// written to this Redis).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Position {
    pub version: u64,
    pub epoch: Option<String>,
    /// The id of the last change applied.
    pub last: Option<String>,
}

/// Applies one change to the local copy and records the position it reaches (with
/// `set_position`, in the same critical section).
type Apply = dyn Fn(Remote, Position) + Send + Sync;

/// How soon a follower that lost Redis tries again.
const RETRY: Duration = Duration::from_millis(250);

/// Entries asked for per HSCAN page (small pages: a reply is decoded on the
/// connection the limiter shares), and how long one page may take.
const PAGE: usize = 250;
const PAGE_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the subscription may take to open.
const POLL: Duration = Duration::from_secs(1);

/// How often the version is compared, to heal missed messages: half a second, so a
/// copy that missed one still learns of the change within the second the deny
/// list promises, its read of the list included (at one second, a change
/// caught by the comparison took 997 ms in a test on a cluster).
const VERSION_CHECK: Duration = Duration::from_millis(500);

/// The TTL of every key of the shared list: how long it outlives the last instance
/// that follows it. Each write sets it again, and so does every instance every
/// `KEEP_EVERY` version checks (a minute); a list whose keys expired (or were
/// evicted) meanwhile is "lost", and the instances write their copies back as
/// after a Redis restart.
pub const KEY_TTL: Duration = Duration::from_secs(7 * 24 * 3600);
const KEEP_EVERY: u32 = 120;

/// What a write did to the shared list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Written {
    /// Changed; where the list stands after it, and the entries it evicted.
    Changed(Position, Vec<Target>),
    /// Nothing changed: a ban met an entry that lasts longer.
    Kept,
    /// A new entry found `max_entries` entries, none of which expires.
    Full,
}

/// Helpers of every script. `expiry`: the expiry of a stored entry, a number,
/// nil/null for none, false if it does not decode (such an entry is replaced, or
/// removed, rather than failing the script). `size`: the entries of the hash, whose
/// `epoch` field is not one. `score`: an entry's place in the eviction index (bans
/// by expiry, then API entries by expiry: `API_AFTER` is past any expiry in
/// milliseconds and, added to one, still an exact double); none for an entry that
/// never expires. `indexed`: the index evicted alone while the hash has entries is
/// rebuilt from the hash; its member `''` (score +inf) marks an index that exists
/// when no entry expires, and is never evicted.
const EXPIRY: &str = r#"
local API_AFTER = 1125899906842624
local function expiry(j)
  local ok, e = pcall(cjson.decode, j)
  if not ok or type(e) ~= 'table' then return false end
  return e.expires_at_ms
end
local function keep(ttl, ...)
  for _, k in ipairs({...}) do redis.call('PEXPIRE', k, ttl) end
end
local function size(h)
  return redis.call('HLEN', h) - redis.call('HEXISTS', h, 'epoch')
end
local function score(j)
  local ok, e = pcall(cjson.decode, j)
  if not ok or type(e) ~= 'table' or type(e.expires_at_ms) ~= 'number' then return nil end
  if e.source == 'ban' then return string.format('%.0f', e.expires_at_ms) end
  return string.format('%.0f', e.expires_at_ms + API_AFTER)
end
local function index(z, field, j)
  local s = score(j)
  if s then redis.call('ZADD', z, s, field) else redis.call('ZREM', z, field) end
end
local function indexed(h, z)
  if redis.call('ZCARD', z) > 0 then return end
  local cursor = '0'
  repeat
    local page = redis.call('HSCAN', h, cursor, 'COUNT', 1000)
    cursor = page[1]
    for i = 1, #page[2], 2 do
      if page[2][i] ~= 'epoch' then index(z, page[2][i], page[2][i + 1]) end
    end
  until cursor == '0'
  redis.call('ZADD', z, 'inf', '')
end
"#;

/// One change. KEYS: entries, version, last, deleted, expiring. ARGV: op (`put`,
/// `ban`, `del`), field, entry JSON, channel, an epoch to set if there is none,
/// this change's id, how long a tombstone lasts (ms), max entries, the keys' TTL
/// (ms). A `ban` never replaces an entry that lasts longer (or for ever). A new
/// field beyond max entries evicts the bans closest to expiry, then the API entries
/// closest to expiry (`expiring` is their index); if none expires, the put fails. A
/// `del` leaves a tombstone, also when there was nothing to delete (the list may
/// have been lost), so that no write-back brings the entry back. The epoch is a
/// field of the hash: a hash evicted alone takes it along, and the next change sets
/// a new one, which tells every copy the list was lost. Reply: {1, version, epoch,
/// evicted fields...} if the list changed, {2} if it is full, else {0}.
const WRITE: &str = r#"
local op, field = ARGV[1], ARGV[2]
if op == 'ban' then
  local j = redis.call('HGET', KEYS[1], field)
  if j then
    local at = expiry(j)
    if at ~= false and (type(at) ~= 'number' or at >= cjson.decode(ARGV[3]).expires_at_ms) then
      return {0}
    end
  end
  op = 'put'
end
local evicted = {}
if op == 'put' then
  indexed(KEYS[1], KEYS[5])
  if redis.call('HEXISTS', KEYS[1], field) == 0 then
    local max = tonumber(ARGV[8])
    while size(KEYS[1]) >= max do
      local first = redis.call('ZRANGE', KEYS[5], 0, 0)
      if #first == 0 or first[1] == '' then return {2} end
      redis.call('ZREM', KEYS[5], first[1])
      if redis.call('HDEL', KEYS[1], first[1]) == 1 then
        evicted[#evicted + 1] = first[1]
      end
    end
  end
  redis.call('HSET', KEYS[1], field, ARGV[3])
  index(KEYS[5], field, ARGV[3])
  redis.call('HDEL', KEYS[4], field)
else
  local removed = redis.call('HDEL', KEYS[1], field)
  redis.call('ZREM', KEYS[5], field)
  redis.call('HSET', KEYS[4], field, '1')
  redis.call('PEXPIRE', KEYS[4], ARGV[7])
  if removed == 0 then return {0} end
end
local v = redis.call('INCR', KEYS[2])
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[5])
local e = redis.call('HGET', KEYS[1], 'epoch')
redis.call('SET', KEYS[3], ARGV[6])
keep(ARGV[9], KEYS[1], KEYS[2], KEYS[3], KEYS[5])
local msg = {v = v, e = e, id = ARGV[6], op = op, field = field, entry = ARGV[3]}
if #evicted > 0 then msg.evicted = evicted end
redis.call('PUBLISH', ARGV[4], cjson.encode(msg))
return {1, v, e, unpack(evicted)}
"#;

/// Renews the TTL of every key of the list that exists. KEYS: all of them. ARGV:
/// the TTL (ms).
const KEEP: &str = r#"
keep(ARGV[1], unpack(KEYS))
return 0
"#;

/// Removes the given fields whose entries have expired by Redis' clock (not the
/// caller's: an instance whose clock runs fast must not expire entries early for
/// everyone), and any that does not decode. Every copy drops an expired entry by
/// itself, so nothing is published. KEYS: entries, expiring. ARGV: fields. Reply:
/// how many were removed.
const EXPIRE: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local removed = 0
for i = 1, #ARGV do
  local j = redis.call('HGET', KEYS[1], ARGV[i])
  if j then
    local at = expiry(j)
    if at == false or (type(at) == 'number' and at <= now) then
      removed = removed + redis.call('HDEL', KEYS[1], ARGV[i])
      redis.call('ZREM', KEYS[2], ARGV[i])
    end
  end
end
return removed
"#;

/// Writes back (field, entry) pairs the hash does not have (HSETNX), that were not
/// deleted since (no tombstone) and that fit within max entries, publishing
/// nothing: `ANNOUNCE` follows. KEYS: entries, deleted, expiring. ARGV: max
/// entries, the keys' TTL (ms), then the pairs. Reply: how many were added, how
/// many were deleted since.
const RESTORE: &str = r#"
local added, deleted = 0, 0
local max = tonumber(ARGV[1])
indexed(KEYS[1], KEYS[3])
for i = 3, #ARGV - 1, 2 do
  if redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
    if size(KEYS[1]) < max and redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then
      added = added + 1
      index(KEYS[3], ARGV[i], ARGV[i + 1])
    end
  else
    deleted = deleted + 1
  end
end
keep(ARGV[2], KEYS[1], KEYS[3])
return {added, deleted}
"#;

/// After a write-back: bumps the version and publishes a `restore`, which makes every
/// follower read the list again. KEYS: version, entries, last. ARGV: channel, an
/// epoch to set if there is none, this change's id, the keys' TTL (ms).
const ANNOUNCE: &str = r#"
local v = redis.call('INCR', KEYS[1])
redis.call('HSETNX', KEYS[2], 'epoch', ARGV[2])
local e = redis.call('HGET', KEYS[2], 'epoch')
redis.call('SET', KEYS[3], ARGV[3])
keep(ARGV[4], KEYS[1], KEYS[2], KEYS[3])
redis.call('PUBLISH', ARGV[1], cjson.encode({v = v, e = e, id = ARGV[3], op = 'restore', field = ''}))
return v
"#;

/// A script with the helpers it uses.
fn script(body: &str) -> Script {
    Script::new(&format!("{EXPIRY}{body}"))
}

/// The list's scripts, each sent by its hash (`crate::redis::scripts`).
struct Scripts {
    write: Script,
    keep: Script,
    expire: Script,
    restore: Script,
    announce: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    write: script(WRITE),
    keep: script(KEEP),
    expire: script(EXPIRE),
    restore: script(RESTORE),
    announce: script(ANNOUNCE),
});

/// How long a deletion's tombstone keeps write-backs from bringing an entry back.
const TOMBSTONE_MS: u64 = 10 * 60 * 1000;

/// A random id: an epoch candidate, a change's id.
fn new_id() -> String {
    use std::hash::{BuildHasher, RandomState};
    format!(
        "{:016x}",
        RandomState::new().hash_one(std::time::SystemTime::now())
    )
}

/// Entries written back, or expired, per script call.
const BATCH: usize = 500;

/// A published change.
#[derive(Debug, Serialize, Deserialize)]
struct Message {
    v: u64,
    /// The list's epoch.
    #[serde(default)]
    e: Option<String>,
    /// This change's id.
    #[serde(default)]
    id: Option<String>,
    op: String,
    field: String,
    /// The entry's JSON for `put`.
    #[serde(default)]
    entry: String,
    /// The fields a `put` evicted (absent when none: Lua's cjson writes an empty
    /// table as `{}`).
    #[serde(default)]
    evicted: Vec<String>,
}

pub struct DenySync {
    redis: Shared,
    entries: String,
    version: String,
    /// The id of the last change: with the version, names where the list stands, so
    /// a Redis that went back in time (a failover to a replica that missed writes)
    /// and then moved on to the same version is noticed.
    last: String,
    /// Tombstones of deleted entries, which write-backs respect.
    deleted: String,
    /// The fields of entries that expire, by expiry: what a full list evicts first.
    expiring: String,
    channel: String,
    /// Where the local copy stands.
    position: std::sync::Mutex<Position>,
    /// The whole list has been read at least once.
    read: AtomicBool,
    /// Subscribed and in step (for logging an outage once).
    following: AtomicBool,
    /// A writer saw Redis keep something other than what it wrote: read the list at
    /// the next poll.
    recheck: AtomicBool,
}

impl DenySync {
    pub fn new(redis: Shared) -> DenySync {
        let p = redis.prefix().to_string();
        DenySync {
            entries: format!("{p}{{deny}}:entries"),
            version: format!("{p}{{deny}}:version"),
            last: format!("{p}{{deny}}:last"),
            deleted: format!("{p}{{deny}}:deleted"),
            expiring: format!("{p}{{deny}}:expiring"),
            channel: format!("{p}deny"),
            redis,
            position: std::sync::Mutex::new(Position::default()),
            read: AtomicBool::new(false),
            following: AtomicBool::new(false),
            recheck: AtomicBool::new(false),
        }
    }

    /// Whether the shared list has been read once: until then this instance does not
    /// enforce it, and says so on `/readyz`.
    pub fn ready(&self) -> bool {
        self.read.load(Ordering::Relaxed)
    }

    pub fn position(&self) -> Position {
        self.position
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Called by whoever applies a change to the local copy, in the same critical
    /// section, so that a writer can tell whether its own change is already there.
    pub fn set_position(&self, p: Position) {
        *self.position.lock().unwrap_or_else(|p| p.into_inner()) = p;
    }

    /// Reads the whole list at the next poll (within a second): for a write that
    /// changed nothing in Redis, where the local copy may now differ from it.
    pub fn recheck(&self) {
        self.recheck.store(true, Ordering::Relaxed);
    }

    /// Whether the local copy already reflects the change that produced `written`
    /// (same list, same or later version).
    pub fn followed(&self, written: &Position) -> bool {
        let at = self.position();
        at.epoch.is_some() && at.epoch == written.epoch && at.version >= written.version
    }

    /// Adds or replaces `e` in the shared list (a ban never replaces an entry that
    /// lasts longer), with no bound on the entries; where the list stands after it,
    /// None if nothing changed.
    pub async fn put(&self, e: &Entry) -> Result<Option<Position>, StoreError> {
        Ok(match self.put_within(e, usize::MAX).await? {
            Written::Changed(at, _) => Some(at),
            Written::Kept | Written::Full => None,
        })
    }

    /// `put`, keeping at most `max` entries: a new one beyond it evicts the entries
    /// closest to expiry (never one that stays until removed).
    pub async fn put_within(&self, e: &Entry, max: usize) -> Result<Written, StoreError> {
        let json = serde_json::to_string(&e.to_json())
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        let op = if e.meta.source == crate::deny::Source::Ban {
            "ban"
        } else {
            "put"
        };
        self.write(op, &e.target, &json, max).await
    }

    /// Removes `t` from the shared list; None if it was not there.
    pub async fn delete(&self, t: &Target) -> Result<Option<Position>, StoreError> {
        Ok(match self.write("del", t, "", usize::MAX).await? {
            Written::Changed(at, _) => Some(at),
            Written::Kept | Written::Full => None,
        })
    }

    /// Renews the TTL of every key of the list but the tombstones (see `KEY_TTL`).
    pub async fn keep(&self) -> Result<(), StoreError> {
        // Not the tombstones: they last `TOMBSTONE_MS` from the deletion.
        let mut call = SCRIPTS.keep.call(4);
        call.arg(&self.entries)
            .arg(&self.version)
            .arg(&self.last)
            .arg(&self.expiring)
            .arg(KEY_TTL.as_millis() as u64);
        let within = self.redis.timeout();
        self.redis
            .call::<i64, _>(CallKind::Other, &call, within)
            .await
            .map(drop)
    }

    async fn write(
        &self,
        op: &str,
        t: &Target,
        arg: &str,
        max: usize,
    ) -> Result<Written, StoreError> {
        let id = new_id();
        let mut call = SCRIPTS.write.call(5);
        call.arg(&self.entries)
            .arg(&self.version)
            .arg(&self.last)
            .arg(&self.deleted)
            .arg(&self.expiring)
            .arg(op)
            .arg(field(t))
            .arg(arg)
            .arg(&self.channel)
            .arg(new_id())
            .arg(&id)
            .arg(TOMBSTONE_MS)
            .arg(max)
            .arg(KEY_TTL.as_millis() as u64);
        let within = self.redis.timeout();
        let reply: Vec<String> = self.redis.call(CallKind::Other, &call, within).await?;
        Ok(match reply.as_slice() {
            [changed, v, e, evicted @ ..] if changed == "1" => Written::Changed(
                Position {
                    version: v.parse().unwrap_or(0),
                    epoch: Some(e.clone()),
                    last: Some(id),
                },
                evicted.iter().filter_map(|f| parse_field(f)).collect(),
            ),
            [full] if full == "2" => Written::Full,
            _ => Written::Kept,
        })
    }

    /// Removes those of `targets` whose entries have expired in Redis.
    pub async fn expire(&self, targets: &[Target]) -> Result<(), StoreError> {
        for batch in targets.chunks(BATCH) {
            let mut call = SCRIPTS.expire.call(2);
            call.arg(&self.entries).arg(&self.expiring);
            for t in batch {
                call.arg(field(t));
            }
            let _: u64 = self
                .redis
                .call(CallKind::Other, &call, PAGE_TIMEOUT)
                .await?;
        }
        Ok(())
    }

    /// Writes back entries the shared list does not have and did not delete, keeping
    /// those it has. Whether every follower must read the list again (`announce`):
    /// something was added, or found deleted since (copies still hold it). On an
    /// error, what was written before it still counts.
    pub async fn restore(&self, entries: &[Entry], max: usize) -> (bool, Result<(), StoreError>) {
        let mut changed = false;
        for batch in entries.chunks(BATCH) {
            let mut call = SCRIPTS.restore.call(3);
            call.arg(&self.entries)
                .arg(&self.deleted)
                .arg(&self.expiring)
                .arg(max)
                .arg(KEY_TTL.as_millis() as u64);
            for e in batch {
                match serde_json::to_string(&e.to_json()) {
                    Ok(json) => call.arg(field(&e.target)).arg(json),
                    Err(err) => return (changed, Err(StoreError::Unavailable(err.to_string()))),
                };
            }
            match self
                .redis
                .call::<(u64, u64), _>(CallKind::Other, &call, PAGE_TIMEOUT)
                .await
            {
                Ok((added, deleted)) => changed |= added + deleted > 0,
                Err(e) => return (changed, Err(e)),
            }
        }
        (changed, Ok(()))
    }

    /// Makes every follower read the list again (after a write-back).
    pub async fn announce(&self) -> Result<(), StoreError> {
        let mut call = SCRIPTS.announce.call(3);
        call.arg(&self.version)
            .arg(&self.entries)
            .arg(&self.last)
            .arg(&self.channel)
            .arg(new_id())
            .arg(new_id())
            .arg(KEY_TTL.as_millis() as u64);
        let within = self.redis.timeout();
        self.redis
            .call::<u64, _>(CallKind::Other, &call, within)
            .await
            .map(drop)
    }

    /// The whole list, and the version read before it. Read page by page (HSCAN), so
    /// a large list never blocks Redis for long; a change made while the pages are
    /// read is published with a later version and applied after.
    async fn read_all(&self) -> Result<(Position, Vec<Entry>), StoreError> {
        let at = self.remote_position().await?;
        let mut entries = Vec::new();
        let mut cursor = 0u64;
        loop {
            let mut cmd = redis::cmd("HSCAN");
            cmd.arg(&self.entries).arg(cursor).arg("COUNT").arg(PAGE);
            let (next, page): (u64, Vec<String>) =
                self.redis.call(CallKind::Other, &cmd, PAGE_TIMEOUT).await?;
            entries.extend(
                page.chunks_exact(2)
                    .filter(|kv| kv[0] != "epoch")
                    .filter_map(|kv| parse_entry(&kv[1])),
            );
            if next == 0 {
                return Ok((at, entries));
            }
            cursor = next;
        }
    }

    /// Where the shared list stands now. The epoch is read after the version: a list
    /// lost and written to in between then shows a new epoch (and is written back),
    /// never an old epoch beside the new list's version.
    async fn remote_position(&self) -> Result<Position, StoreError> {
        let mut cmd = redis::cmd("MGET");
        cmd.arg(&self.version).arg(&self.last);
        let within = self.redis.timeout();
        let (version, last): (Option<u64>, Option<String>) =
            self.redis.call(CallKind::Other, &cmd, within).await?;
        let mut cmd = redis::cmd("HGET");
        cmd.arg(&self.entries).arg("epoch");
        let epoch: Option<String> = self.redis.call(CallKind::Other, &cmd, within).await?;
        Ok(Position {
            version: version.unwrap_or(0),
            epoch,
            last,
        })
    }

    /// Reads the whole list into the local copy. The list was lost (Redis lost its
    /// data) if it has another epoch than the one this copy followed, or went back
    /// to an earlier version, or stands at this copy's version through other changes.
    async fn resync(&self, apply: &Apply) -> Result<(), StoreError> {
        let (at, entries) = self.read_all().await?;
        tracing::debug!(
            version = at.version,
            entries = entries.len(),
            "shared deny list read"
        );
        let before = self.position();
        let lost = before.epoch.is_some()
            && (before.epoch != at.epoch
                || at.version < before.version
                || (at.version == before.version && at.last != before.last));
        apply(Remote::All { entries, lost }, at);
        self.read.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Reads the whole list once, within `within`: at startup, so that an instance
    /// whose Redis answers enforces the shared list (and is ready) from its first
    /// request. A failure is left to the follower.
    pub async fn read_once(
        &self,
        apply: impl Fn(Remote, Position) + Send + Sync + 'static,
        within: Duration,
    ) {
        match tokio::time::timeout(within, self.resync(&apply)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "shared deny list not read at startup"),
            Err(_) => tracing::warn!("shared deny list not read at startup: Redis too slow"),
        }
    }

    /// Keeps the local copy in step with the shared list until the process ends:
    /// subscribes, reads everything, then applies each published change in order.
    /// `apply` gets each change with its position and must call `set_position`.
    pub fn follow(self: Arc<Self>, apply: impl Fn(Remote, Position) + Send + Sync + 'static) {
        tokio::spawn(async move {
            let mut first = true;
            loop {
                let Err(e) = self.follow_once(&apply).await;
                // Said once per outage; the retries every RETRY are at debug level.
                if std::mem::take(&mut first) || self.following.swap(false, Ordering::Relaxed) {
                    tracing::warn!(error = %e, "shared deny list: following interrupted; retrying");
                } else {
                    tracing::debug!(error = %e, "shared deny list: still not following");
                }
                tokio::time::sleep(RETRY).await;
            }
        });
    }

    /// Follows until something fails; returns why.
    async fn follow_once(&self, apply: &Apply) -> Result<std::convert::Infallible, StoreError> {
        let (mut pubsub, subscribed) = self.redis.pubsub(POLL).await?;
        tokio::time::timeout(POLL, pubsub.subscribe(&self.channel))
            .await
            .map_err(|_| StoreError::Timeout)?
            .map_err(StoreError::of)?;
        // Subscribed first, then read: no change can fall between the two.
        self.resync(apply).await?;
        self.following.store(true, Ordering::Relaxed);
        let mut messages = pubsub.into_on_message();
        let mut poll = tokio::time::interval(VERSION_CHECK);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut polls = 0u32;
        loop {
            tokio::select! {
                msg = messages.next() => {
                    let Some(msg) = msg else {
                        return Err(StoreError::Unavailable("subscription closed".into()));
                    };
                    let Ok(m) = serde_json::from_slice::<Message>(msg.get_payload_bytes()) else {
                        continue;
                    };
                    let at = self.position();
                    // A message of another list: Redis lost its data (a flush, an
                    // empty replica) while this subscription stayed up.
                    if m.e.is_some() && at.epoch.is_some() && m.e != at.epoch {
                        self.resync(apply).await?;
                        continue;
                    }
                    if m.v <= at.version {
                        continue;
                    }
                    if m.v != at.version + 1 {
                        // A gap: some change was missed.
                        self.resync(apply).await?;
                        continue;
                    }
                    let next = Position {
                        version: m.v,
                        epoch: m.e.clone().or(at.epoch),
                        last: m.id.clone(),
                    };
                    match (m.op.as_str(), parse_field(&m.field)) {
                        ("put", _) => match parse_entry(&m.entry) {
                            Some(e) => {
                                let evicted = m.evicted.iter().filter_map(|f| parse_field(f)).collect();
                                apply(Remote::Put(e, evicted), next)
                            }
                            None => { self.resync(apply).await?; continue; }
                        },
                        ("del", Some(t)) => apply(Remote::Delete(t), next),
                        _ => { self.resync(apply).await?; continue; }
                    }
                }
                _ = poll.tick() => {
                    // Redis Sentinel moved the store to another server: subscribe there.
                    // (A primary that died closed this subscription already; one that was
                    // demoted would go on relaying what its new primary publishes, but
                    // only while it replicates from it.)
                    if self.redis.moved_from(&subscribed) {
                        return Err(StoreError::Unavailable("the Redis Sentinel primary moved".into()));
                    }
                    polls = polls.wrapping_add(1);
                    if polls.is_multiple_of(KEEP_EVERY) {
                        self.keep().await?;
                    }
                    let (remote, local) = (self.remote_position().await?, self.position());
                    let asked = self.recheck.swap(false, Ordering::Relaxed);
                    // The epoch too: the hash evicted alone takes it along.
                    if asked || (remote.version, &remote.last, &remote.epoch) != (local.version, &local.last, &local.epoch) {
                        self.resync(apply).await?;
                    }
                }
            }
        }
    }
}

/// The hash field of a target: `ip:10.1.0.0/16`, `key:K`.
fn field(t: &Target) -> String {
    format!("{}:{}", t.kind(), t.value())
}

fn parse_field(f: &str) -> Option<Target> {
    match f.split_once(':')? {
        ("ip", v) => Target::ip(v),
        ("key", v) => Some(Target::key(v)),
        _ => None,
    }
}

fn parse_entry(json: &str) -> Option<Entry> {
    serde_json::from_str::<EntryJson>(json)
        .ok()
        .and_then(Entry::from_json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        for t in [
            Target::ip("10.1.0.0/16").unwrap(),
            Target::ip("2001:db8::1").unwrap(),
            Target::Key("a:b".into()),
        ] {
            assert_eq!(parse_field(&field(&t)), Some(t));
        }
        assert_eq!(field(&Target::ip("10.1.2.3").unwrap()), "ip:10.1.2.3");
        assert_eq!(parse_field("nope"), None);
    }
}
