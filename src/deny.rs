//! The deny list: addresses, CIDR blocks and client keys that are refused before any
//! limit is charged. The static part comes from `deny:` in the configuration and is
//! rebuilt on every reload; dynamic entries (admin API, bans, other instances) live
//! beside it in the same kind of table and survive reloads. Addresses are looked up
//! in a prefix trie, so a check costs O(prefix length) however many entries there are.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ipnet::IpNet;
use prefix_trie::joint::JointPrefixMap;
use serde::{Deserialize, Serialize};

use crate::client::{canonical, canonical_net};

// === entries ===

/// `Target::logged`: `ip 10.1.0.0/16`, `key #a9993e364706816a`.
pub struct Logged<'a>(&'a Target);

impl std::fmt::Display for Logged<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Target::Ip(_) => write!(f, "ip {}", self.0.value()),
            Target::Key(k) => write!(f, "key #{}", crate::refusal_log::KeyHash(k)),
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
            Source::Static => "static",
            Source::Api => "api",
            Source::Ban => "ban",
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
    /// Shared, not copied, when the table is cloned for the request path.
    pub reason: Option<Arc<str>>,
    pub source: Source,
    /// The route whose `ban` made the entry.
    pub route: Option<Arc<str>>,
}

impl Meta {
    fn live(&self, now_ms: u64) -> bool {
        self.expires_at_ms.is_none_or(|t| t > now_ms)
    }
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
            "key" if !j.value.is_empty() => Target::Key(j.value),
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

/// Entries by target: addresses and blocks in a prefix trie, keys in a hash map, with
/// an index of expiry times and counts by source kept up to date, so purging and
/// counting cost nothing for entries that are not expiring.
#[derive(Debug, Clone, Default)]
pub struct DenyTable {
    ips: JointPrefixMap<IpNet, Meta>,
    keys: HashMap<String, Meta>,
    expiries: BTreeSet<(u64, Target)>,
    counts: [usize; 3],
}

impl DenyTable {
    pub fn new() -> DenyTable {
        DenyTable::default()
    }

    /// Whether a live entry covers `ip`. Expired entries no longer count, even before
    /// they are purged.
    pub fn ip(&self, ip: IpAddr) -> bool {
        if self.ips.is_empty() {
            return false;
        }
        let mut covering = self
            .ips
            .cover_values(&IpNet::from(canonical(ip)))
            .peekable();
        if covering.peek().is_none() {
            return false;
        }
        let now = now_ms();
        covering.any(|m| m.live(now))
    }

    /// Whether `key` has a live entry.
    pub fn key(&self, key: &str) -> bool {
        if self.keys.is_empty() {
            return false;
        }
        self.keys.get(key).is_some_and(|m| m.live(now_ms()))
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
        let old = match &e.target {
            Target::Ip(n) => self.ips.insert(*n, e.meta),
            Target::Key(k) => self.keys.insert(k.clone(), e.meta),
        };
        // The old entry leaves the index first: it may expire at the same time.
        if let Some(meta) = &old {
            self.forget(&e.target, meta);
        }
        self.counts[source.index()] += 1;
        if let Some(at) = expires {
            self.expiries.insert((at, e.target.clone()));
        }
        old.map(|meta| Entry {
            target: e.target,
            meta,
        })
    }

    pub fn remove(&mut self, t: &Target) -> Option<Entry> {
        let meta = match t {
            Target::Ip(n) => self.ips.remove(n),
            Target::Key(k) => self.keys.remove(k),
        }?;
        self.forget(t, &meta);
        Some(Entry {
            target: t.clone(),
            meta,
        })
    }

    /// Drops a removed entry from the expiry index and the counts.
    fn forget(&mut self, t: &Target, meta: &Meta) {
        self.counts[meta.source.index()] -= 1;
        if let Some(at) = meta.expires_at_ms {
            self.expiries.remove(&(at, t.clone()));
        }
    }

    pub fn get(&self, t: &Target) -> Option<Entry> {
        let meta = match t {
            Target::Ip(n) => self.ips.get(n),
            Target::Key(k) => self.keys.get(k),
        }?;
        Some(Entry {
            target: t.clone(),
            meta: meta.clone(),
        })
    }

    /// Every entry: addresses first (in address order), then keys (sorted).
    pub fn entries(&self) -> Vec<Entry> {
        let mut keys: Vec<_> = self.keys.iter().collect();
        keys.sort_by(|a, b| a.0.cmp(b.0));
        self.ips
            .iter()
            .map(|(n, m)| Entry {
                target: Target::Ip(n),
                meta: m.clone(),
            })
            .chain(keys.into_iter().map(|(k, m)| Entry {
                target: Target::Key(k.clone()),
                meta: m.clone(),
            }))
            .collect()
    }

    /// Removes the entries expired at `now_ms`, soonest first; returns them.
    pub fn purge(&mut self, now_ms: u64) -> Vec<Entry> {
        let mut expired = Vec::new();
        while let Some((at, _)) = self.expiries.first() {
            if *at > now_ms {
                break;
            }
            let Some((_, target)) = self.expiries.pop_first() else {
                break;
            };
            if let Some(e) = self.remove(&target) {
                expired.push(e);
            }
        }
        expired
    }

    /// How many entries came from `source`.
    pub fn count(&self, source: Source) -> usize {
        self.counts[source.index()]
    }

    pub fn len(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// The static deny list of a configuration, with the status it answers.
#[derive(Debug, Clone)]
pub struct StaticDeny {
    pub table: DenyTable,
    pub status: http::StatusCode,
}

impl StaticDeny {
    pub fn new(
        ips: impl IntoIterator<Item = IpNet>,
        keys: impl IntoIterator<Item = String>,
        status: http::StatusCode,
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
                target: Target::Key(k),
                meta: meta.clone(),
            });
        }
        StaticDeny { table, status }
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

/// `2026-11-21T22:10:00Z` (`.123` added when the milliseconds are not zero).
pub fn rfc3339(ms: u64) -> String {
    let secs = ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (H. Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let frac = match ms % 1000 {
        0 => String::new(),
        f => format!(".{f:03}"),
    };
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}{frac}Z")
}

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
    }
}
