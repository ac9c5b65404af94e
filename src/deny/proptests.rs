//! The deny table against a naive model (proptest): random adds, adds within
//! `max_entries` (evictions), removals, purges, time passing, rebuilds and whole
//! replacements, after each of which every lookup of the table, of the view just
//! published and of a view published earlier answers what a linear scan of a list
//! of entries answers. A failure prints the shrunk sequence; proptest saves its
//! seed under `proptest-regressions/deny/` (committed), which replays it first.

use std::borrow::Cow;
use std::net::IpAddr;

use proptest::prelude::*;

use super::*;

/// Nested blocks (v4, v6, IPv4-mapped), addresses, keys (one long, so kept
/// hashed), and keys a normalising route folds (case, email tags, a composite key).
fn targets() -> &'static [String] {
    static TARGETS: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    TARGETS.get_or_init(|| {
        [
            "10.0.0.0/8",
            "10.1.0.0/16",
            "10.1.2.0/24",
            "10.1.2.3",
            "10.1.3.0/24",
            "192.0.2.0/24",
            "192.0.2.9",
            "::ffff:10.2.0.0/112",
            "2001:db8::/32",
            "2001:db8:1::/48",
            "2001:db8:1::7",
            "2001:db8:2::/48",
            "a",
            "b",
            "Carl",
            "CARL",
            "carl",
            "Dora+spam@Example.com",
            "A+B|Eve+x@Example.com",
            "Jose\u{301}",
        ]
        .iter()
        .map(|t| t.to_string())
        .chain(["k".repeat(300)])
        .collect()
    })
}

const PROBES: [&str; 14] = [
    "10.1.2.3",
    "10.1.2.4",
    "10.1.3.1",
    "10.2.9.9",
    "10.9.9.9",
    "192.0.2.9",
    "192.0.2.10",
    "11.0.0.1",
    "::ffff:10.1.2.3",
    "2001:db8:1::7",
    "2001:db8:1::8",
    "2001:db8:2::1",
    "2001:db8:3::1",
    "2001:db9::1",
];

/// Keys as clients send them, with the form the table keeps them in (hashed when
/// long): looked up as they are, and in each folded form.
fn keys() -> &'static [(String, String)] {
    static KEYS: std::sync::OnceLock<Vec<(String, String)>> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| {
        [
            "a",
            "c",
            "carl",
            "Carl",
            "karl",
            "dora+spam@example.com",
            "dora@example.com",
            "a+b|eve@example.com",
            "a+b|eve+x@example.com",
            "José",
        ]
        .iter()
        .map(|k| k.to_string())
        .chain(["k".repeat(300), "k".repeat(299), "K".repeat(300)])
        .map(|k| {
            let stored = stored_key(&k, &mut None).to_string();
            (k, stored)
        })
        .collect()
    })
}

/// One entry the model keeps: what it denies, until when, from where, the order it
/// came in (ties in eviction), and for a key the forms a normalising route finds
/// it by.
#[derive(Debug, Clone)]
struct Kept {
    target: Target,
    source: Source,
    expires_at_ms: Option<u64>,
    seq: u64,
    forms: Vec<(Normalize, String)>,
}

/// The forms of key `k` a route that normalises keys compares it in, of the whole
/// key and of each part of a composite one; not `k` itself (the exact lookup finds
/// that), and none of a hashed key.
fn forms(k: &str) -> Vec<(Normalize, String)> {
    if k.starts_with('#') {
        return Vec::new();
    }
    Normalize::FOLDED
        .into_iter()
        .flat_map(|form| {
            [
                (form, form.apply(Cow::Borrowed(k)).into_owned()),
                (form, normalize_joined(form, k).into_owned()),
            ]
        })
        .filter(|(_, f)| f != k)
        .collect()
}

/// The deny list as a list of entries, every question answered by scanning it.
#[derive(Debug, Clone, Default)]
struct Model {
    entries: Vec<Kept>,
    seq: u64,
}

impl Model {
    fn live(e: &Kept, now: u64) -> bool {
        e.expires_at_ms.is_none_or(|at| at > now)
    }

    fn ip(&self, ip: IpAddr, now: u64) -> bool {
        let ip = canonical(ip);
        self.entries
            .iter()
            .any(|e| matches!(&e.target, Target::Ip(n) if n.contains(&ip)) && Model::live(e, now))
    }

    fn stored_key(&self, stored: &str, now: u64) -> bool {
        self.entries
            .iter()
            .any(|e| matches!(&e.target, Target::Key(k) if k == stored) && Model::live(e, now))
    }

    /// A live key entry one of whose forms is `folded` in `form`.
    fn folded_key(&self, form: Normalize, folded: &str, now: u64) -> bool {
        self.entries
            .iter()
            .any(|e| e.forms.iter().any(|(f, s)| *f == form && s == folded) && Model::live(e, now))
    }

    fn position(&self, t: &Target) -> Option<usize> {
        self.entries.iter().position(|e| e.target == *t)
    }

    fn insert(&mut self, e: &Entry) {
        self.seq += 1;
        let kept = Kept {
            target: e.target.clone(),
            source: e.meta.source,
            expires_at_ms: e.meta.expires_at_ms,
            seq: self.seq,
            forms: match &e.target {
                Target::Key(k) => forms(k),
                Target::Ip(_) => Vec::new(),
            },
        };
        match self.position(&e.target) {
            Some(i) => self.entries[i] = kept,
            None => self.entries.push(kept),
        }
    }

    /// As `DenyTable::insert_within`: the targets evicted, or None when every entry
    /// stays until removed and there is no room.
    fn insert_within(&mut self, e: &Entry, max: usize) -> Option<Vec<Target>> {
        let mut evicted = Vec::new();
        if self.position(&e.target).is_none() {
            let staying = self
                .entries
                .iter()
                .filter(|e| e.expires_at_ms.is_none())
                .count();
            if staying >= max {
                return None;
            }
            while self.entries.len() >= max {
                // Bans first, then the one closest to expiry, then the oldest.
                let (i, _) = self
                    .entries
                    .iter()
                    .enumerate()
                    .filter_map(|(i, e)| {
                        let at = e.expires_at_ms?;
                        Some((i, (e.source != Source::Ban, at, e.seq)))
                    })
                    .min_by_key(|(_, rank)| *rank)?;
                evicted.push(self.entries.remove(i).target);
            }
        }
        self.insert(e);
        Some(evicted)
    }

    fn remove(&mut self, t: &Target) -> bool {
        self.position(t).map(|i| self.entries.remove(i)).is_some()
    }

    /// The targets expired at `now`, soonest first (ties: the oldest first).
    fn purge(&mut self, now: u64) -> Vec<Target> {
        let mut due: Vec<Kept> = self
            .entries
            .iter()
            .filter(|e| !Model::live(e, now))
            .cloned()
            .collect();
        due.sort_by_key(|e| (e.expires_at_ms, e.seq));
        self.entries.retain(|e| Model::live(e, now));
        due.into_iter().map(|e| e.target).collect()
    }

    fn count(&self, source: Source) -> usize {
        self.entries.iter().filter(|e| e.source == source).count()
    }

    fn has_keys(&self) -> bool {
        self.entries
            .iter()
            .any(|e| matches!(e.target, Target::Key(_)))
    }
}

/// An entry as random steps make it.
#[derive(Debug, Clone)]
struct NewEntry {
    target: usize,
    ban: bool,
    /// None: stays until removed; else its expiry from now (some already past).
    expires_in: Option<u64>,
}

fn new_entry() -> impl Strategy<Value = NewEntry> {
    (
        0..targets().len(),
        any::<bool>(),
        prop_oneof![1 => Just(None), 2 => (0u64..40).prop_map(Some)],
    )
        .prop_map(|(target, ban, expires_in)| NewEntry {
            target,
            ban,
            expires_in,
        })
}

impl NewEntry {
    fn entry(&self, now: u64) -> Entry {
        let target = &targets()[self.target];
        Entry {
            target: Target::ip(target).unwrap_or_else(|| Target::key(target)),
            meta: Meta {
                expires_at_ms: self.expires_in.map(|d| now + d - 5),
                reason: None,
                source: if self.ban { Source::Ban } else { Source::Api },
                route: None,
            },
        }
    }
}

#[derive(Debug, Clone)]
enum Step {
    InsertWithin(NewEntry),
    Insert(NewEntry),
    Remove(NewEntry),
    Purge,
    Wait(u64),
    Rebuild,
    /// As a read of the whole shared list: the table replaced by these, each added
    /// within `max`.
    Replace(Vec<NewEntry>),
    /// Keep the view published now, to check later that it still answers as the
    /// table did then.
    KeepView,
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let step = prop_oneof![
        5 => new_entry().prop_map(Step::InsertWithin),
        1 => new_entry().prop_map(Step::Insert),
        2 => new_entry().prop_map(Step::Remove),
        1 => Just(Step::Purge),
        1 => (0u64..20).prop_map(Step::Wait),
        1 => Just(Step::Rebuild),
        1 => proptest::collection::vec(new_entry(), 0..12).prop_map(Step::Replace),
        1 => Just(Step::KeepView),
    ];
    proptest::collection::vec(step, 1..250)
}

/// The lookups the table and the views it publishes share, at a time given.
trait Lookups {
    fn denies_ip(&self, ip: IpAddr, now: u64) -> bool;
    fn denies_stored(&self, stored: &str, now: u64) -> bool;
    fn denies_folded(&self, form: Normalize, folded: &str, now: u64) -> bool;
    /// has_keys, is_empty, len.
    fn sizes(&self) -> (bool, bool, usize);
}

// The table and its views answer under the same names.
macro_rules! lookups {
    ($($t:ty),*) => {$(
        impl Lookups for $t {
            fn denies_ip(&self, ip: IpAddr, now: u64) -> bool {
                self.ip_at(ip, || now)
            }

            fn denies_stored(&self, stored: &str, now: u64) -> bool {
                self.stored_key_at(stored, || now)
            }

            fn denies_folded(&self, form: Normalize, folded: &str, now: u64) -> bool {
                self.folded_key_at(form, folded, || now)
            }

            fn sizes(&self) -> (bool, bool, usize) {
                (self.has_keys(), self.is_empty(), self.len())
            }
        }
    )*};
}

lookups!(DenyTable, DenyView);

/// Every lookup of `of` (the table or a view, named `what`) against the model at
/// `now`.
fn agrees(model: &Model, what: &str, of: &dyn Lookups, now: u64) -> Result<(), TestCaseError> {
    for ip in PROBES.map(|p| p.parse::<IpAddr>().unwrap()) {
        prop_assert_eq!(of.denies_ip(ip, now), model.ip(ip, now), "{}, {}", what, ip);
    }
    for (k, stored) in keys() {
        let want = model.stored_key(stored, now);
        prop_assert_eq!(of.denies_stored(stored, now), want, "{}, key {}", what, k);
        for form in [Normalize::None, Normalize::Casefold, Normalize::Email] {
            let want = model.folded_key(form, k, now);
            let got = of.denies_folded(form, k, now);
            prop_assert_eq!(got, want, "{}, {} {}", what, form, k);
        }
    }
    let len = model.entries.len();
    prop_assert_eq!(of.sizes(), (model.has_keys(), len == 0, len), "{}", what);
    Ok(())
}

proptest! {
    // Fewer cases than the limits' properties, each longer (up to 250 steps, as
    // the random walk this replaces took 300): rebuilds, tombstones over the base
    // and evictions need a few hundred steps to pile up.
    #![proptest_config(ProptestConfig {
        cases: 128,
        // Cheaper to draw from than the default ChaCha: a sixth of the time here.
        rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
        ..ProptestConfig::default()
    })]

    /// The table, the view it publishes and every view published before answer
    /// every lookup (addresses under nested blocks, keys as sent, keys in a
    /// route's folded form) as a scan of the entries does, live ones only; adds
    /// within `max_entries` evict what the model evicts, purges remove what it
    /// removes, in the same order.
    #[test]
    fn lookups_agree_with_a_list_of_entries(
        max in 1usize..12,
        threshold in 0usize..6,
        steps in steps(),
    ) {
        let mut now = 1_000_000u64;
        let mut d = DynamicTable::new(DenyTable::new());
        let mut model = Model::default();
        let mut kept: Vec<(DenyView, Model, u64)> = Vec::new();
        for (i, step) in steps.iter().enumerate() {
            match step {
                Step::InsertWithin(e) => {
                    let e = e.entry(now);
                    let got = d.insert_within(e.clone(), max).ok();
                    let got = got.map(|v| v.into_iter().map(|e| e.target).collect::<Vec<_>>());
                    prop_assert_eq!(got, model.insert_within(&e, max), "step {}", i);
                }
                Step::Insert(e) => {
                    let e = e.entry(now);
                    d.insert(e.clone());
                    model.insert(&e);
                }
                Step::Remove(e) => {
                    let t = e.entry(now).target;
                    prop_assert_eq!(d.remove(&t).is_some(), model.remove(&t), "step {}", i);
                }
                Step::Purge => {
                    let got: Vec<Target> = d.purge(now).into_iter().map(|e| e.target).collect();
                    prop_assert_eq!(got, model.purge(now), "step {}", i);
                }
                Step::Wait(ms) => now += ms,
                Step::Rebuild => d.rebuild(),
                Step::Replace(all) => {
                    let (mut table, mut fresh) = (DenyTable::new(), Model::default());
                    for e in all {
                        let e = e.entry(now);
                        let _ = table.insert_within(e.clone(), max);
                        fresh.insert_within(&e, max);
                    }
                    d.replace(table);
                    model = fresh;
                }
                Step::KeepView => kept.push((d.view(), model.clone(), now)),
            }
            if d.changes() > threshold {
                d.rebuild();
            }
            agrees(&model, "table", &*d, now)?;
            agrees(&model, "view", &d.view(), now)?;
            for source in Source::ALL {
                prop_assert_eq!(d.count(source), model.count(source), "{:?}", source);
            }
        }
        // A view is never changed: what the table did since does not reach it.
        for (view, then, at) in &kept {
            agrees(then, "a view kept", view, *at)?;
        }
    }
}
