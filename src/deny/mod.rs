//! The deny list: addresses, CIDR blocks and client keys that are refused before any
//! limit is charged. The static part comes from `deny:` in the configuration and is
//! rebuilt on every reload; dynamic entries (admin API, bans, other instances) live
//! beside it in the same kind of table and survive reloads. Addresses are looked up
//! in a prefix trie, so a check costs O(prefix length) however many entries there are.
//! The request path reads the dynamic part through a `DenyView` (a base rebuilt now
//! and then, and the changes since), so that publishing a change does not copy it.
//! Client keys are kept as the limiter stores them (long ones, and any that could
//! spell a hash, as their hash), and the dynamic part holds at most
//! `deny.max_entries`. `list` holds the dynamic entries' policy (eviction, bans,
//! publishing), `state_file` their file with the memory store, `sync` their sharing
//! through Redis.

pub mod list;
#[cfg(test)]
mod proptests;
pub mod state_file;
pub mod sync;

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use prefix_trie::joint::JointPrefixMap;
use serde::{Deserialize, Serialize};

use crate::identity::{
    canonical, canonical_net, kept_hashed, nfc, normalize_joined, KeyDigest, Normalize,
};
use crate::telemetry::metrics::DENY_SOURCES;

// === entries ===

/// `Target::logged`: `ip 10.1.0.0/16`, `key #a9993e364706816a`.
pub struct Logged<'a>(&'a Target);

impl std::fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Target::Ip(_) => write!(f, "ip {}", self.0.value()),
            Target::Key(k) => write!(f, "key #{}", crate::identity::KeyHash(k)),
        }
    }
}

/// What an entry refuses: an address or block, or a client key.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Always truncated to its network (`10.1.2.3/16` is `10.1.0.0/16`).
    Ip(IpNet),
    Key(String),
}

impl Target {
    /// An address (`203.0.113.7`, a /32 or /128) or a CIDR block, in canonical form:
    /// host bits cleared, IPv4-mapped IPv6 addresses as IPv4.
    pub fn ip(s: &str) -> Option<Target> {
        let s = s.trim();
        let net = match s.parse::<IpNet>() {
            Ok(n) => canonical_net(n),
            Err(_) => IpNet::from(canonical(s.parse::<IpAddr>().ok()?)),
        };
        Some(Target::Ip(net))
    }

    /// A key as the admin API or the configuration names it: a key in the hashed form
    /// (`#` and 40 lower-case hex digits) is taken as it is, since that is how a
    /// listed entry of a long key is named; any other key is kept as a client's key
    /// is (see `Target::client_key`).
    pub fn key(k: &str) -> Target {
        if crate::identity::is_digest(k) {
            Target::Key(k.to_string())
        } else {
            // In NFC, as the request path reads a body key (`José` typed with a
            // combining accent is the key the form sends composed).
            Target::client_key(&nfc(Cow::Borrowed(k)))
        }
    }

    /// A key as the client sent it, kept as the limiter stores it: itself, or `#` and
    /// its SHA-1 when it is longer than 256 bytes (so a client cannot make the table
    /// hold its 30 KB keys), starts with `#` (so a client sending `#<sha1 of K>` is
    /// never taken for K) or holds `{`/`}`.
    pub fn client_key(k: &str) -> Target {
        Target::Key(stored_key(k, &mut None).to_string())
    }

    /// Whether this is an address block wider than /8 (IPv4) or /32 (IPv6): such an
    /// entry denies a large part of the internet, and the admin API wants `force`.
    /// IPv4-mapped blocks are already IPv4 here, so they count by their IPv4 width.
    pub fn is_wide(&self) -> bool {
        match self {
            Target::Ip(IpNet::V4(n)) => n.prefix_len() < 8,
            Target::Ip(IpNet::V6(n)) => n.prefix_len() < 32,
            Target::Key(_) => false,
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Target::Ip(_) => "ip",
            Target::Key(_) => "key",
        }
    }

    /// As written to the log: an address or block as it is, a key only as its hash
    /// (as the refusal log's `key_hash`), so no client key reaches log storage.
    pub fn logged(&self) -> Logged<'_> {
        Logged(self)
    }

    /// As shown and stored: a single address without its prefix length.
    pub fn value(&self) -> String {
        match self {
            Target::Ip(n) if n.prefix_len() == n.max_prefix_len() => n.addr().to_string(),
            Target::Ip(n) => n.to_string(),
            Target::Key(k) => k.clone(),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "{} {}", self.kind(), self.value())
    }
}

/// Where an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    /// `deny:` in the configuration file.
    Static,
    /// The admin API (or `sluice deny`).
    Api,
    /// An automatic ban (`ban:` on a route).
    Ban,
}

impl Source {
    pub const ALL: [Source; 3] = [Source::Static, Source::Api, Source::Ban];

    pub fn as_str(self) -> &'static str {
        match self {
            Source::Static => DENY_SOURCES[0],
            Source::Api => DENY_SOURCES[1],
            Source::Ban => DENY_SOURCES[2],
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// One entry with everything the admin API shows about it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Entry {
    pub target: Target,
    pub meta: Meta,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Meta {
    /// Milliseconds since the UNIX epoch; None for an entry that stays until removed.
    pub expires_at_ms: Option<u64>,
    /// Shared, not copied, when an entry is (listings, write-backs).
    pub reason: Option<Arc<str>>,
    pub source: Source,
    /// The route whose `ban` made the entry.
    pub route: Option<Arc<str>>,
}

impl Entry {
    /// The JSON form of the admin API, the state file and the Redis store.
    pub fn to_json(&self) -> EntryJson {
        let m = &self.meta;
        EntryJson {
            kind: self.target.kind().to_string(),
            value: self.target.value(),
            expires_at: m.expires_at_ms.map(rfc3339),
            expires_at_ms: m.expires_at_ms,
            reason: m.reason.as_deref().map(str::to_string),
            source: m.source,
            route: m.route.as_deref().map(str::to_string),
        }
    }

    pub fn from_json(j: EntryJson) -> Option<Entry> {
        let target = match j.kind.as_str() {
            "ip" => Target::ip(&j.value)?,
            "key" if !j.value.is_empty() => Target::key(&j.value),
            _ => return None,
        };
        Some(Entry {
            target,
            meta: Meta {
                expires_at_ms: j.expires_at_ms,
                reason: j.reason.map(Arc::from),
                source: j.source,
                route: j.route.map(Arc::from),
            },
        })
    }
}

/// An entry as JSON: `{"kind":"ip","value":"10.1.0.0/16","expires_at":"2026-…Z",
/// "expires_at_ms":…,"reason":…,"source":"api"}` (`route` only on bans).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EntryJson {
    pub kind: String,
    pub value: String,
    #[serde(default)]
    pub expires_at: Option<String>,
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
    #[serde(default)]
    pub reason: Option<String>,
    pub source: Source,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<String>,
}

/// A key (or, for `key: ip`, the address) refused `after` times within `within` on
/// a route with `ban`: the gateway asks for it to be denied for `duration`.
#[derive(Debug, Clone)]
pub struct BanRequest {
    pub route: String,
    pub target: Target,
    pub duration: Duration,
}

// === the table ===

/// A key the client sent as the table keeps it (see `Target::client_key`); `digest`
/// holds the hash when there is one, so that the lookup of a long key allocates
/// nothing.
pub fn stored_key<'a>(k: &'a str, digest: &'a mut Option<KeyDigest>) -> &'a str {
    if kept_hashed(k) {
        digest.insert(KeyDigest::of(k)).as_str()
    } else {
        k
    }
}

/// Key entries by the forms a normalising route compares keys in (`normalize_key`):
/// under `casefold`, `carl` lists `Carl` and `CARL`. Only entries whose form is not
/// themselves are listed (one in its form is found by the exact lookup), and no
/// hashed one. A lookup checks that each entry it finds is still live, so a list
/// may keep an entry a little longer than the table does.
#[derive(Debug, Clone, Default)]
struct Folds([HashMap<Box<str>, Vec<Arc<str>>>; 2]);

impl Folds {
    /// Each form of `k` that is not `k` itself, with its index: of the whole text,
    /// and of each part when it is a composite key's joined form (`a|b`), since
    /// the table does not know which it is.
    fn forms(k: &str) -> impl Iterator<Item = (usize, Cow<'_, str>)> + '_ {
        Normalize::FOLDED
            .into_iter()
            .enumerate()
            .filter(move |_| !k.starts_with('#'))
            .flat_map(move |(i, form)| {
                let whole = form.apply(Cow::Borrowed(k));
                let parts = normalize_joined(form, k);
                let parts = (parts != whole).then_some((i, parts));
                std::iter::once((i, whole)).chain(parts)
            })
            .filter(move |(_, f)| *f != k)
    }

    fn add(&mut self, k: &Arc<str>) {
        for (i, f) in Folds::forms(k) {
            let list = self.0[i].entry(f.into()).or_default();
            if !list.contains(k) {
                list.push(k.clone());
            }
        }
    }

    fn remove(&mut self, k: &str) {
        for (i, f) in Folds::forms(k) {
            if let Some(list) = self.0[i].get_mut(&*f) {
                list.retain(|x| **x != *k);
                if list.is_empty() {
                    self.0[i].remove(&*f);
                }
            }
        }
    }

    /// The entries whose `form` is `folded`.
    fn get(&self, form: Normalize, folded: &str) -> &[Arc<str>] {
        let i = match form {
            Normalize::None => return &[],
            Normalize::Casefold => 0,
            Normalize::Email => 1,
        };
        self.0[i].get(folded).map_or(&[], Vec::as_slice)
    }
}

/// An entry in the table, with the order it came in (which breaks ties between
/// entries that expire in the same millisecond: the older one is evicted first).
#[derive(Debug, Clone)]
struct Slot {
    meta: Meta,
    seq: u64,
}

/// Entries by target: addresses and blocks in a prefix trie, keys in a hash map, with
/// indexes of expiry times and counts by source kept up to date, so purging,
/// counting and evicting cost nothing for entries that are not expiring.
#[derive(Debug, Clone, Default)]
pub struct DenyTable {
    ips: JointPrefixMap<IpNet, Slot>,
    /// Shared with the request path's `Base`, not copied.
    keys: HashMap<Arc<str>, Slot>,
    folds: Folds,
    /// The entries that expire, by (expiry, seq), one index per `eviction_rank`:
    /// bans are evicted before any admin entry.
    expiries: [BTreeSet<(u64, u64, Target)>; 2],
    counts: [usize; 3],
    seq: u64,
}

/// The table holds `max_entries` entries that never expire: a new one has no room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the deny list holds deny.max_entries ({0}) entries and none of them expires")]
pub struct Full(pub usize);

impl DenyTable {
    pub fn new() -> DenyTable {
        DenyTable::default()
    }

    /// Whether a live entry covers `ip`. Expired entries no longer count, even before
    /// they are purged.
    pub fn ip(&self, ip: IpAddr) -> bool {
        self.ip_at(ip, now_ms)
    }

    /// `ip` with the clock read only if an entry covers `ip`.
    fn ip_at(&self, ip: IpAddr, now: impl Fn() -> u64) -> bool {
        if self.ips.is_empty() {
            return false;
        }
        let mut clock = Clock::new(now);
        self.ips
            .cover_values(&IpNet::from(canonical(ip)))
            .any(|s| clock.live(s.meta.expires_at_ms))
    }

    /// Whether `key` (as the client sent it) has a live entry.
    pub fn key(&self, key: &str) -> bool {
        if self.keys.is_empty() {
            return false;
        }
        self.stored_key(stored_key(key, &mut None))
    }

    /// Whether `stored` (a key as `stored_key` gives it) has a live entry.
    pub fn stored_key(&self, stored: &str) -> bool {
        self.stored_key_at(stored, now_ms)
    }

    fn stored_key_at(&self, stored: &str, now: impl Fn() -> u64) -> bool {
        self.keys
            .get(stored)
            .is_some_and(|s| Clock::new(now).live(s.meta.expires_at_ms))
    }

    /// Whether a live key entry's `form` is `folded` (a request's key on a route
    /// that normalises it, in that form), the entry itself not in it: `Carl` for
    /// `carl` under `casefold`.
    pub fn folded_key(&self, form: Normalize, folded: &str) -> bool {
        self.folded_key_at(form, folded, now_ms)
    }

    fn folded_key_at(&self, form: Normalize, folded: &str, now: impl Fn() -> u64) -> bool {
        self.folds
            .get(form, folded)
            .iter()
            .any(|k| self.stored_key_at(k, &now))
    }

    pub fn has_keys(&self) -> bool {
        !self.keys.is_empty()
    }

    pub fn is_empty(&self) -> bool {
        self.ips.is_empty() && self.keys.is_empty()
    }

    /// Adds or replaces the entry for its target; returns the one it replaced.
    pub fn insert(&mut self, e: Entry) -> Option<Entry> {
        let (source, expires) = (e.meta.source, e.meta.expires_at_ms);
        self.seq += 1;
        let slot = Slot {
            meta: e.meta,
            seq: self.seq,
        };
        let old = match &e.target {
            Target::Ip(n) => self.ips.insert(*n, slot),
            Target::Key(k) => {
                let k: Arc<str> = Arc::from(k.as_str());
                self.folds.add(&k);
                self.keys.insert(k, slot)
            }
        };
        // The old entry leaves the index first: it may expire at the same time.
        if let Some(old) = &old {
            self.forget(&e.target, old);
        }
        self.counts[source.index()] += 1;
        if let Some(at) = expires {
            self.expiries[eviction_rank(source)].insert((at, self.seq, e.target.clone()));
        }
        old.map(|s| Entry {
            target: e.target,
            meta: s.meta,
        })
    }

    /// Adds or replaces the entry for its target, keeping at most `max` entries: a
    /// new target beyond it evicts the ban closest to expiry, or when no ban
    /// expires, the admin entry closest to expiry (so a flood of bans never pushes
    /// out an operator's entry; an entry that stays until removed is never
    /// evicted). Returns the evicted entries; `Full` if every entry stays until
    /// removed.
    pub fn insert_within(&mut self, e: Entry, max: usize) -> Result<Vec<Entry>, Full> {
        let mut evicted = Vec::new();
        if self.get(&e.target).is_none() {
            // Checked first: evicting some entries and then finding no room (`max`
            // lowered by a reload) would lose them for nothing.
            let expiring: usize = self.expiries.iter().map(BTreeSet::len).sum();
            if self.len() - expiring >= max {
                return Err(Full(max));
            }
            while self.len() >= max {
                let Some((_, _, first)) = self.expiries.iter().find_map(|x| x.first()).cloned()
                else {
                    return Err(Full(max));
                };
                evicted.extend(self.remove(&first));
            }
        }
        self.insert(e);
        Ok(evicted)
    }

    pub fn remove(&mut self, t: &Target) -> Option<Entry> {
        let slot = match t {
            Target::Ip(n) => self.ips.remove(n),
            Target::Key(k) => {
                let slot = self.keys.remove(k.as_str());
                if slot.is_some() {
                    self.folds.remove(k);
                }
                slot
            }
        }?;
        self.forget(t, &slot);
        Some(Entry {
            target: t.clone(),
            meta: slot.meta,
        })
    }

    /// Drops a removed entry from the expiry index and the counts.
    fn forget(&mut self, t: &Target, slot: &Slot) {
        self.counts[slot.meta.source.index()] -= 1;
        if let Some(at) = slot.meta.expires_at_ms {
            self.expiries[eviction_rank(slot.meta.source)].remove(&(at, slot.seq, t.clone()));
        }
    }

    pub fn get(&self, t: &Target) -> Option<Entry> {
        let slot = match t {
            Target::Ip(n) => self.ips.get(n),
            Target::Key(k) => self.keys.get(k.as_str()),
        }?;
        Some(Entry {
            target: t.clone(),
            meta: slot.meta.clone(),
        })
    }

    /// Every entry: addresses first (in address order), then keys (sorted).
    pub fn entries(&self) -> Vec<Entry> {
        self.page(None, usize::MAX)
    }

    /// At most `limit` entries whose targets come after `after`, in target order:
    /// addresses (in address order), then keys (sorted). One pass over the table and
    /// a sort of the page, not of the whole table.
    pub fn page(&self, after: Option<&Target>, limit: usize) -> Vec<Entry> {
        let mut page = Vec::new();
        if !matches!(after, Some(Target::Key(_))) {
            let after_ip = match after {
                Some(Target::Ip(n)) => Some(*n),
                _ => None,
            };
            let mut ips: Vec<(IpNet, &Meta)> = self
                .ips
                .iter()
                .filter(|(n, _)| after_ip.is_none_or(|a| *n > a))
                .map(|(n, s)| (n, &s.meta))
                .collect();
            smallest(&mut ips, limit, |a, b| a.0.cmp(&b.0));
            page.extend(ips.into_iter().map(|(n, m)| Entry {
                target: Target::Ip(n),
                meta: m.clone(),
            }));
        }
        let left = limit - page.len();
        if left > 0 {
            let after_key = match after {
                Some(Target::Key(k)) => Some(k.as_str()),
                _ => None,
            };
            let mut keys: Vec<(&Arc<str>, &Meta)> = self
                .keys
                .iter()
                .filter(|(k, _)| after_key.is_none_or(|a| *a < ***k))
                .map(|(k, s)| (k, &s.meta))
                .collect();
            smallest(&mut keys, left, |a, b| a.0.cmp(b.0));
            page.extend(keys.into_iter().map(|(k, m)| Entry {
                target: Target::Key(k.to_string()),
                meta: m.clone(),
            }));
        }
        page
    }

    /// Removes the entries expired at `now_ms`, soonest first; returns them.
    pub fn purge(&mut self, now_ms: u64) -> Vec<Entry> {
        let mut due = Vec::new();
        for index in &mut self.expiries {
            while index.first().is_some_and(|(at, _, _)| *at <= now_ms) {
                due.extend(index.pop_first());
            }
        }
        due.sort_unstable();
        due.into_iter()
            .filter_map(|(_, _, target)| self.remove(&target))
            .collect()
    }

    /// How many entries came from `source`.
    pub fn count(&self, source: Source) -> usize {
        self.counts[source.index()]
    }

    pub fn len(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// Which expiry index an entry of `source` is in: bans (0) are evicted first.
fn eviction_rank(source: Source) -> usize {
    match source {
        Source::Ban => 0,
        Source::Api | Source::Static => 1,
    }
}

/// Leaves the `n` smallest items of `v` in `v`, sorted.
fn smallest<T>(v: &mut Vec<T>, n: usize, cmp: impl Fn(&T, &T) -> std::cmp::Ordering) {
    if v.len() > n {
        if n == 0 {
            v.clear();
            return;
        }
        v.select_nth_unstable_by(n - 1, &cmp);
        v.truncate(n);
    }
    v.sort_unstable_by(cmp);
}

/// The static deny list of a configuration, with the status it answers.
#[derive(Debug, Clone)]
pub struct StaticDeny {
    pub table: DenyTable,
    pub status: http::StatusCode,
    /// `deny.max_entries`: the most dynamic entries kept (read on each change, so a
    /// reload applies it to the next one).
    pub max_entries: usize,
}

impl StaticDeny {
    pub fn new(
        ips: impl IntoIterator<Item = IpNet>,
        keys: impl IntoIterator<Item = String>,
        status: http::StatusCode,
        max_entries: usize,
    ) -> StaticDeny {
        let meta = Meta {
            expires_at_ms: None,
            reason: None,
            source: Source::Static,
            route: None,
        };
        let mut table = DenyTable::new();
        for n in ips {
            table.insert(Entry {
                target: Target::Ip(canonical_net(n)),
                meta: meta.clone(),
            });
        }
        for k in keys {
            table.insert(Entry {
                target: Target::key(&k),
                meta: meta.clone(),
            });
        }
        StaticDeny {
            table,
            status,
            max_entries,
        }
    }
}

// === the request path's view ===

/// The dynamic table as the request path sees it: a base built from the whole
/// table now and then, shared by every view until the next rebuild, and an overlay
/// of the changes made since. Publishing a change copies the overlay, not the base.
#[derive(Debug, Clone, Default)]
pub struct DenyView {
    base: Arc<Base>,
    overlay: Overlay,
    /// Of the table when the view was taken.
    len: usize,
    has_keys: bool,
}

/// What a lookup needs of every entry, and nothing else (no reasons, no expiry
/// index): expiry times in ms, None for an entry that stays until removed. Keys are
/// shared with the table.
#[derive(Debug, Clone, Default)]
struct Base {
    ips: JointPrefixMap<IpNet, Option<u64>>,
    keys: HashMap<Arc<str>, Option<u64>>,
    folds: Folds,
}

/// Targets changed since the base was built, with what they are now.
#[derive(Debug, Clone, Default)]
struct Overlay {
    ips: JointPrefixMap<IpNet, Change>,
    keys: HashMap<Arc<str>, Change>,
    /// Of the keys put since the base was built.
    folds: Folds,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Added or replaced: denied until this expiry.
    Put(Option<u64>),
    /// Removed (by hand, expiry or eviction): whatever the base says no longer counts.
    Gone,
}

/// Reads the clock at most once, and only when an entry that expires is found.
struct Clock<F> {
    read: F,
    now: Option<u64>,
}

impl<F: Fn() -> u64> Clock<F> {
    fn new(read: F) -> Self {
        Clock { read, now: None }
    }

    fn live(&mut self, expires_at_ms: Option<u64>) -> bool {
        match expires_at_ms {
            None => true,
            Some(t) => t > *self.now.get_or_insert_with(&self.read),
        }
    }
}

impl DenyView {
    /// As `DenyTable::ip`: whether a live entry covers `ip`.
    pub fn ip(&self, ip: IpAddr) -> bool {
        self.ip_at(ip, now_ms)
    }

    fn ip_at(&self, ip: IpAddr, now: impl Fn() -> u64) -> bool {
        let (base, overlay) = (&self.base.ips, &self.overlay.ips);
        if base.is_empty() && overlay.is_empty() {
            return false;
        }
        let net = IpNet::from(canonical(ip));
        let mut clock = Clock::new(now);
        overlay.cover_values(&net).any(|c| match c {
            Change::Put(at) => clock.live(*at),
            Change::Gone => false,
        }) || base
            .cover(&net)
            // A block changed since the base was built is the overlay's to answer.
            .any(|(n, at)| !overlay.contains_key(&n) && clock.live(*at))
    }

    /// As `DenyTable::key`.
    pub fn key(&self, key: &str) -> bool {
        self.has_keys && self.stored_key(stored_key(key, &mut None))
    }

    /// As `DenyTable::stored_key`.
    pub fn stored_key(&self, stored: &str) -> bool {
        self.stored_key_at(stored, now_ms)
    }

    fn stored_key_at(&self, stored: &str, now: impl Fn() -> u64) -> bool {
        let at = match self.overlay.keys.get(stored) {
            Some(Change::Put(at)) => at,
            Some(Change::Gone) => return false,
            None => match self.base.keys.get(stored) {
                Some(at) => at,
                None => return false,
            },
        };
        Clock::new(now).live(*at)
    }

    /// As `DenyTable::folded_key`.
    pub fn folded_key(&self, form: Normalize, folded: &str) -> bool {
        self.folded_key_at(form, folded, now_ms)
    }

    fn folded_key_at(&self, form: Normalize, folded: &str, now: impl Fn() -> u64) -> bool {
        self.has_keys
            && self
                .base
                .folds
                .get(form, folded)
                .iter()
                .chain(self.overlay.folds.get(form, folded))
                .any(|k| self.stored_key_at(k, &now))
    }

    pub fn has_keys(&self) -> bool {
        self.has_keys
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn len(&self) -> usize {
        self.len
    }
}

/// The dynamic part of the deny list: the table, authoritative, and what the
/// request path has of it (a base and the changes since). Every change goes through
/// here, so that none is missing from the next view.
#[derive(Debug, Default)]
pub struct DynamicTable {
    table: DenyTable,
    base: Arc<Base>,
    overlay: Overlay,
}

impl std::ops::Deref for DynamicTable {
    type Target = DenyTable;

    fn deref(&self) -> &DenyTable {
        &self.table
    }
}

impl DynamicTable {
    pub fn new(table: DenyTable) -> DynamicTable {
        let mut d = DynamicTable {
            table,
            ..DynamicTable::default()
        };
        d.build();
        d
    }

    /// The view to publish: the base shared, the overlay copied, so O(changes since
    /// the last `rebuild`), not O(entries).
    pub fn view(&self) -> DenyView {
        DenyView {
            base: self.base.clone(),
            overlay: self.overlay.clone(),
            len: self.table.len(),
            has_keys: self.table.has_keys(),
        }
    }

    /// How many targets changed since the base was built.
    pub fn changes(&self) -> usize {
        self.overlay.ips.len() + self.overlay.keys.len()
    }

    /// Folds the overlay into a new base, O(entries): a copy of the old base (a
    /// few times faster than building one from the table) with the changes applied.
    /// Views already taken keep the old base.
    pub fn rebuild(&mut self) {
        let mut base = Base::clone(&self.base);
        for (n, change) in self.overlay.ips.iter() {
            match change {
                Change::Put(at) => base.ips.insert(n, *at),
                Change::Gone => base.ips.remove(&n),
            };
        }
        for (k, change) in &self.overlay.keys {
            match change {
                Change::Put(at) => {
                    base.folds.add(k);
                    base.keys.insert(k.clone(), *at)
                }
                Change::Gone => {
                    base.folds.remove(k);
                    base.keys.remove(k)
                }
            };
        }
        self.base = Arc::new(base);
        self.overlay = Overlay::default();
    }

    /// A base of the whole table, and no overlay.
    fn build(&mut self) {
        let t = &self.table;
        self.base = Arc::new(Base {
            ips: t
                .ips
                .iter()
                .map(|(n, s)| (n, s.meta.expires_at_ms))
                .collect(),
            keys: t
                .keys
                .iter()
                .map(|(k, s)| (k.clone(), s.meta.expires_at_ms))
                .collect(),
            folds: t.folds.clone(),
        });
        self.overlay = Overlay::default();
    }

    /// Replaces the whole table (and builds the base anew).
    pub fn replace(&mut self, table: DenyTable) {
        self.table = table;
        self.build();
    }

    /// As `DenyTable::insert`.
    pub fn insert(&mut self, e: Entry) -> Option<Entry> {
        let target = e.target.clone();
        let old = self.table.insert(e);
        self.note(&target);
        old
    }

    /// As `DenyTable::insert_within`.
    pub fn insert_within(&mut self, e: Entry, max: usize) -> Result<Vec<Entry>, Full> {
        let target = e.target.clone();
        let evicted = self.table.insert_within(e, max)?;
        for old in &evicted {
            self.note(&old.target);
        }
        self.note(&target);
        Ok(evicted)
    }

    /// As `DenyTable::remove`.
    pub fn remove(&mut self, t: &Target) -> Option<Entry> {
        let old = self.table.remove(t);
        if old.is_some() {
            self.note(t);
        }
        old
    }

    /// As `DenyTable::purge`.
    pub fn purge(&mut self, now_ms: u64) -> Vec<Entry> {
        let expired = self.table.purge(now_ms);
        for e in &expired {
            self.note(&e.target);
        }
        expired
    }

    /// Records in the overlay what `t` is now in the table: its entry, a tombstone
    /// over the base's, or (neither in the table nor the base) nothing.
    fn note(&mut self, t: &Target) {
        match t {
            Target::Ip(n) => match self.table.ips.get(n) {
                Some(s) => {
                    self.overlay
                        .ips
                        .insert(*n, Change::Put(s.meta.expires_at_ms));
                }
                None if self.base.ips.contains_key(n) => {
                    self.overlay.ips.insert(*n, Change::Gone);
                }
                None => {
                    self.overlay.ips.remove(n);
                }
            },
            Target::Key(k) => match self.table.keys.get_key_value(k.as_str()) {
                Some((k, s)) => {
                    self.overlay.folds.add(k);
                    self.overlay
                        .keys
                        .insert(k.clone(), Change::Put(s.meta.expires_at_ms));
                }
                None => match self.base.keys.get_key_value(k.as_str()) {
                    Some((k, _)) => {
                        self.overlay.keys.insert(k.clone(), Change::Gone);
                    }
                    None => {
                        self.overlay.keys.remove(k.as_str());
                    }
                },
            },
        }
    }
}

// === paging ===

/// Where a page of the listed deny list starts: after this entry of the static
/// part (listed first) or of the dynamic part. Sent to clients as hex, so that any
/// key fits in a URL as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cursor {
    pub dynamic: bool,
    pub target: Target,
}

impl Cursor {
    /// `s` or `d`, then `ip:10.1.0.0/16` or `key:K`, in hex.
    pub fn encode(&self) -> String {
        use std::fmt::Write;
        let text = format!(
            "{}{}:{}",
            if self.dynamic { 'd' } else { 's' },
            self.target.kind(),
            self.target.value()
        );
        let mut hex = String::with_capacity(text.len() * 2);
        for b in text.bytes() {
            let _ = write!(hex, "{b:02x}");
        }
        hex
    }

    pub fn decode(hex: &str) -> Option<Cursor> {
        if !hex.len().is_multiple_of(2) || !hex.is_ascii() {
            return None;
        }
        let bytes = (0..hex.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).ok())
            .collect::<Option<Vec<u8>>>()?;
        let text = String::from_utf8(bytes).ok()?;
        let dynamic = match text.get(..1)? {
            "s" => false,
            "d" => true,
            _ => return None,
        };
        let target = match text.get(1..)?.split_once(':')? {
            ("ip", v) => Target::ip(v)?,
            ("key", v) if !v.is_empty() => Target::key(v),
            _ => return None,
        };
        Some(Cursor { dynamic, target })
    }
}

// === time ===

/// Wall-clock milliseconds since the UNIX epoch: entry expiry is absolute, so that
/// every instance (and a restarted one) agrees on it.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

pub use crate::telemetry::rfc3339;

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(target: &str, source: Source, expires_at_ms: Option<u64>) -> Entry {
        let target = Target::ip(target).unwrap_or_else(|| Target::Key(target.to_string()));
        Entry {
            target,
            meta: Meta {
                expires_at_ms,
                reason: None,
                source,
                route: None,
            },
        }
    }

    #[test]
    fn addresses_blocks_and_keys() {
        let d = StaticDeny::new(
            [
                "203.0.113.0/24".parse().unwrap(),
                "198.51.100.7/32".parse().unwrap(),
                "2001:db8::/32".parse().unwrap(),
            ],
            ["leaked".to_string()],
            http::StatusCode::FORBIDDEN,
            10,
        )
        .table;
        for (ip, denied) in [
            ("203.0.113.200", true),
            ("203.0.114.1", false),
            ("198.51.100.7", true),
            ("198.51.100.8", false),
            ("::ffff:198.51.100.7", true),
            ("2001:db8:1::5", true),
            ("2001:db9::1", false),
        ] {
            assert_eq!(d.ip(ip.parse().unwrap()), denied, "{ip}");
        }
        assert!(d.key("leaked"));
        assert!(!d.key("leaked2"));
        assert_eq!((d.count(Source::Static), d.len()), (4, 4));
    }

    /// On a route that normalises its key, an entry matches when its own form is
    /// the request's key in that form, in the table and in every view of it, until
    /// it is removed.
    #[test]
    fn key_entries_match_in_the_routes_form() {
        use Normalize::{Casefold, Email};
        let mut d = DynamicTable::new(DenyTable::new());
        d.insert(entry("Carl", Source::Api, None));
        d.insert(entry("Dora+spam@Example.com", Source::Api, None));
        let long = "K".repeat(300);
        d.insert(entry(&Target::client_key(&long).value(), Source::Api, None));
        let view = d.view();
        for (form, key, denied) in [
            (Casefold, "carl", true),
            (Casefold, "karl", false),
            (Email, "carl", true),
            (Email, "dora@example.com", true),
            (Casefold, "dora+spam@example.com", true),
            (Casefold, "dora@example.com", false),
            (Normalize::None, "carl", false),
        ] {
            assert_eq!(view.folded_key(form, key), denied, "{form} {key}");
            assert_eq!(d.folded_key(form, key), denied, "{form} {key} (table)");
        }
        // A hashed entry is only ever matched exactly.
        assert!(!view.folded_key(Casefold, &"k".repeat(300)));
        // Removed: gone from the overlay, then from a rebuilt base.
        d.remove(&Target::Key("Carl".into()));
        assert!(!d.view().folded_key(Casefold, "carl"));
        assert!(!d.folded_key(Casefold, "carl"));
        d.rebuild();
        assert!(!d.view().folded_key(Casefold, "carl"));
        assert!(d.view().folded_key(Email, "dora@example.com"));
        d.insert(entry("CARL", Source::Api, None));
        d.rebuild();
        assert!(d.view().folded_key(Casefold, "carl"));
        assert!(d.view().folded_key(Email, "carl"));
        // A composite key's entry: each part in its form (`email` leaves `a+b`
        // alone, the tenant has no `@`).
        d.insert(entry("A+B|Eve+x@Example.com", Source::Api, None));
        let view = d.view();
        assert!(view.folded_key(Email, "a+b|eve@example.com"));
        assert!(view.folded_key(Casefold, "a+b|eve+x@example.com"));
        assert!(!view.folded_key(Email, "a+b|eve+x@example.com"));
        // Admin keys are kept in NFC, as body keys are read.
        assert_eq!(Target::key("Jose\u{301}"), Target::Key("José".into()));
    }

    #[test]
    fn targets_are_canonical() {
        assert_eq!(Target::ip("10.1.2.3/16").unwrap().value(), "10.1.0.0/16");
        assert_eq!(Target::ip("10.1.2.3").unwrap().value(), "10.1.2.3");
        assert_eq!(Target::ip("10.1.2.3/32").unwrap().value(), "10.1.2.3");
        assert_eq!(Target::ip("::ffff:10.1.2.3").unwrap().value(), "10.1.2.3");
        assert_eq!(
            Target::ip("::ffff:10.9.0.0/112").unwrap().value(),
            "10.9.0.0/16"
        );
        assert_eq!(
            Target::ip("2001:db8::1/48").unwrap().value(),
            "2001:db8::/48"
        );
        assert!(Target::ip("10.1.2.300").is_none());
        assert!(Target::ip("10.0.0.0/33").is_none());
    }

    #[test]
    fn expired_entries_stop_counting_before_the_purge() {
        let now = now_ms();
        let mut t = DenyTable::new();
        // An expired /24 inside a live /16, and the other way round.
        t.insert(entry("10.1.2.0/24", Source::Api, Some(now - 1)));
        t.insert(entry("10.1.0.0/16", Source::Ban, Some(now + 60_000)));
        t.insert(entry("10.9.0.0/16", Source::Api, Some(now - 1)));
        t.insert(entry("10.9.9.0/24", Source::Api, None));
        t.insert(entry("gone", Source::Api, Some(now - 1)));
        assert!(t.ip("10.1.2.3".parse().unwrap()));
        assert!(t.ip("10.9.9.9".parse().unwrap()));
        assert!(!t.ip("10.9.8.1".parse().unwrap()));
        assert!(!t.key("gone"));
        let purged: Vec<String> = t.purge(now).iter().map(|e| e.target.to_string()).collect();
        assert_eq!(purged, ["ip 10.1.2.0/24", "ip 10.9.0.0/16", "key gone"]);
        assert_eq!((t.count(Source::Api), t.count(Source::Ban)), (1, 1));

        // The same entry again (as the follower applies this instance's own change),
        // and an entry replaced by one of another source and expiry.
        let again = entry("twice", Source::Api, Some(now + 5));
        t.insert(again.clone());
        t.insert(again);
        t.insert(entry("10.1.0.0/16", Source::Api, Some(now + 6)));
        assert_eq!(
            (t.count(Source::Api), t.count(Source::Ban), t.len()),
            (3, 0, 3)
        );
        let purged: Vec<String> = t
            .purge(now + 6)
            .iter()
            .map(|e| e.target.to_string())
            .collect();
        assert_eq!(purged, ["key twice", "ip 10.1.0.0/16"]);
        assert_eq!((t.count(Source::Api), t.len()), (1, 1));
    }

    #[test]
    fn a_hundred_thousand_entries() {
        let mut t = DenyTable::new();
        for i in 0..100_000u32 {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i * 2);
            t.insert(entry(&ip.to_string(), Source::Ban, None));
        }
        assert_eq!(t.len(), 100_000);
        assert!(t.ip("10.0.0.2".parse().unwrap()));
        assert!(!t.ip("10.0.0.3".parse().unwrap()));
        assert!(t.ip("10.3.13.62".parse().unwrap()));
    }

    #[test]
    fn a_publish_after_one_change_shares_the_base() {
        let mut d = DynamicTable::new(DenyTable::new());
        for i in 0..1000u32 {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i);
            d.insert(entry(&ip.to_string(), Source::Ban, None));
        }
        d.rebuild();
        let before = d.view();
        d.insert(entry("203.0.113.7", Source::Ban, None));
        d.remove(&Target::ip("10.0.0.0").unwrap());
        let after = d.view();
        assert!(Arc::ptr_eq(&before.base, &after.base));
        assert_eq!(d.changes(), 2);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        assert!(after.ip(ip("203.0.113.7")) && !after.ip(ip("10.0.0.0")));
        assert!(after.ip(ip("10.0.3.231")) && !after.ip(ip("10.0.3.232")));
        // A view taken earlier keeps what it had.
        assert!(!before.ip(ip("203.0.113.7")) && before.ip(ip("10.0.0.0")));
        d.rebuild();
        let rebuilt = d.view();
        assert!(!Arc::ptr_eq(&after.base, &rebuilt.base));
        assert_eq!((d.changes(), rebuilt.len()), (0, 1000));
        assert!(rebuilt.ip(ip("203.0.113.7")) && !rebuilt.ip(ip("10.0.0.0")));
    }

    #[test]
    fn beyond_max_entries_the_entry_closest_to_expiry_goes() {
        let mut t = DenyTable::new();
        t.insert_within(entry("perm", Source::Api, None), 3)
            .unwrap();
        t.insert_within(entry("late", Source::Ban, Some(500)), 3)
            .unwrap();
        t.insert_within(entry("first", Source::Ban, Some(100)), 3)
            .unwrap();
        // Same expiry as `first`, added later: `first` goes first.
        let gone = t
            .insert_within(entry("second", Source::Ban, Some(100)), 3)
            .unwrap();
        assert_eq!(
            gone.iter()
                .map(|e| e.target.to_string())
                .collect::<Vec<_>>(),
            ["key first"]
        );
        let gone = t
            .insert_within(entry("third", Source::Ban, Some(900)), 3)
            .unwrap();
        assert_eq!(
            gone.iter()
                .map(|e| e.target.to_string())
                .collect::<Vec<_>>(),
            ["key second"]
        );
        // Replacing an entry evicts nothing.
        assert_eq!(
            t.insert_within(entry("late", Source::Ban, Some(50)), 3),
            Ok(vec![])
        );
        assert_eq!(
            (t.len(), t.count(Source::Api), t.count(Source::Ban)),
            (3, 1, 2)
        );
        // Nothing that expires left: full.
        let mut p = DenyTable::new();
        p.insert_within(entry("a", Source::Api, None), 1).unwrap();
        assert_eq!(
            p.insert_within(entry("b", Source::Ban, Some(1)), 1),
            Err(Full(1))
        );
        assert!(p.get(&Target::key("b")).is_none());
        // With `max` lowered below the entries that stay, an entry that expires is
        // not evicted for nothing.
        p.insert(entry("c", Source::Ban, Some(1)));
        assert_eq!(
            p.insert_within(entry("d", Source::Ban, Some(1)), 1),
            Err(Full(1))
        );
        assert_eq!(p.len(), 2);
    }

    #[test]
    fn a_flood_of_bans_evicts_bans_before_an_admins_entry() {
        let hour = 3_600_000;
        let mut t = DenyTable::new();
        t.insert_within(entry("admin", Source::Api, Some(hour)), 5)
            .unwrap();
        // Bans that outlast the admin's entry: still evicted before it.
        for i in 0..20u64 {
            t.insert_within(
                entry(&format!("ban{i:02}"), Source::Ban, Some(2 * hour + i)),
                5,
            )
            .unwrap();
        }
        let kept: Vec<String> = t.entries().iter().map(|e| e.target.value()).collect();
        assert_eq!(kept, ["admin", "ban16", "ban17", "ban18", "ban19"]);
        assert_eq!((t.count(Source::Api), t.count(Source::Ban)), (1, 4));
        // With no ban left to evict, api entries go, soonest first.
        let mut t = DenyTable::new();
        t.insert_within(entry("late", Source::Api, Some(2 * hour)), 2)
            .unwrap();
        t.insert_within(entry("soon", Source::Api, Some(hour)), 2)
            .unwrap();
        let gone = t
            .insert_within(entry("ban", Source::Ban, Some(3 * hour)), 2)
            .unwrap();
        assert_eq!(
            gone.iter().map(|e| e.target.value()).collect::<Vec<_>>(),
            ["soon"]
        );
        // Purged soonest first, whatever the source.
        let purged: Vec<String> = t.purge(u64::MAX).iter().map(|e| e.target.value()).collect();
        assert_eq!(purged, ["late", "ban"]);
    }

    #[test]
    fn long_keys_are_kept_hashed_and_found_by_the_key_as_sent() {
        let long = "k".repeat(30_000);
        let hashed = format!("#{}", sha1_smol::Sha1::from(long.as_bytes()).digest());
        assert_eq!(Target::key(&long), Target::Key(hashed.clone()));
        assert_eq!(Target::key(&"k".repeat(256)), Target::Key("k".repeat(256)));
        assert_eq!(Target::key(&hashed), Target::Key(hashed.clone()));
        let mut t = DenyTable::new();
        let mut e = entry("placeholder", Source::Ban, None);
        e.target = Target::key(&long);
        t.insert(e);
        assert_eq!(t.entries()[0].target.value(), hashed);
        assert!(t.key(&long));
        assert!(!t.key(&hashed));
        assert!(!t.key(&"k".repeat(29_999)));
    }

    #[test]
    fn a_client_key_never_spells_a_hashed_one() {
        let long = "L".repeat(300);
        let hashed = KeyDigest::of(&long).as_str().to_string();
        let banned = |t: Target| {
            let mut e = entry("placeholder", Source::Ban, None);
            e.target = t;
            let mut table = DenyTable::new();
            table.insert(e);
            table
        };
        // The long key banned: a client sending `#<sha1 of it>` is not denied.
        let t = banned(Target::client_key(&long));
        assert_eq!((t.key(&long), t.key(&hashed)), (true, false));
        // The literal `#<sha1>` banned: the long key is not denied.
        let t = banned(Target::client_key(&hashed));
        assert_eq!((t.key(&hashed), t.key(&long)), (true, false));
        // The admin API and the configuration name the long key's entry by its hash;
        // any other key starting with `#` is hashed like a client's.
        assert_eq!(Target::key(&hashed), Target::client_key(&long));
        assert_eq!(Target::key("#x"), Target::client_key("#x"));
        assert_ne!(Target::key("#x"), Target::Key("#x".into()));
        assert_eq!(
            Target::key(&hashed.to_uppercase()),
            Target::client_key(&hashed.to_uppercase())
        );
    }

    #[test]
    fn pages_and_cursors() {
        let mut t = DenyTable::new();
        for e in ["b", "a", "10.0.0.2", "2001:db8::/32", "10.0.0.1", "c"] {
            t.insert(entry(e, Source::Api, None));
        }
        let values = |p: Vec<Entry>| p.iter().map(|e| e.target.value()).collect::<Vec<_>>();
        assert_eq!(values(t.page(None, 2)), ["10.0.0.1", "10.0.0.2"]);
        let after = Target::ip("10.0.0.2").unwrap();
        assert_eq!(values(t.page(Some(&after), 2)), ["2001:db8::/32", "a"]);
        assert_eq!(values(t.page(Some(&Target::key("a")), 5)), ["b", "c"]);
        assert_eq!(t.page(Some(&Target::key("c")), 5), vec![]);
        for c in [
            Cursor {
                dynamic: true,
                target: Target::key("a b&c=d\u{202e}"),
            },
            Cursor {
                dynamic: false,
                target: Target::ip("10.1.0.0/16").unwrap(),
            },
        ] {
            assert_eq!(Cursor::decode(&c.encode()), Some(c));
        }
        for bad in ["", "7", "zz", "78", "733a6b"] {
            assert_eq!(Cursor::decode(bad), None, "{bad}");
        }
    }

    #[test]
    fn wide_blocks() {
        for (ip, wide) in [
            ("0.0.0.0/0", true),
            ("10.0.0.0/7", true),
            ("10.0.0.0/8", false),
            ("::/0", true),
            ("2001:db8::/31", true),
            ("2001:db8::/32", false),
            ("::ffff:0.0.0.0/96", true),
            ("::ffff:10.0.0.0/104", false),
            ("::ffff:8.0.0.0/103", true),
        ] {
            assert_eq!(Target::ip(ip).unwrap().is_wide(), wide, "{ip}");
        }
        assert!(!Target::key("k").is_wide());
    }

    #[test]
    fn json_round_trip() {
        let mut e = entry("2001:db8::/32", Source::Ban, Some(1_800_057_600_123));
        e.meta.route = Some(Arc::from("login"));
        e.meta.reason = Some(Arc::from("too many refusals"));
        let j = serde_json::to_string(&e.to_json()).unwrap();
        assert_eq!(
            j,
            r#"{"kind":"ip","value":"2001:db8::/32","expires_at":"2027-01-16T00:00:00.123Z","expires_at_ms":1800057600123,"reason":"too many refusals","source":"ban","route":"login"}"#
        );
        let back = Entry::from_json(serde_json::from_str(&j).unwrap()).unwrap();
        assert_eq!(back, e);
    }

    #[test]
    fn dates() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_800_057_600_000 - 1), "2027-01-15T23:59:59.999Z");
        // The second kept per thread is not mistaken for the next one, nor a year
        // too long for it.
        assert_eq!(rfc3339(1_800_057_600_000), "2027-01-16T00:00:00Z");
        assert_eq!(rfc3339(253_402_300_800_000), "10000-01-01T00:00:00Z");
        assert_eq!(rfc3339(253_402_300_800_001), "10000-01-01T00:00:00.001Z");
    }
}
