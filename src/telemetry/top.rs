//! The heaviest refused clients of a route, for `GET /admin/top` and `sluice top`:
//! a space-saving sketch (Metwally, Agrawal and El Abbadi, "Efficient computation of
//! frequent and top-k elements in data streams", 2005) per route, in fixed memory
//! however many clients are refused, over two rotating epochs of wall-clock time.
//!
//! A sketch keeps `CAPACITY` counters. A refused key already counted adds one to its
//! counter; a new one takes a free counter, or else the smallest, whose count it
//! inherits plus one, with that inherited count as its `error` (how much its count
//! may be above the truth). So a key's count is never below its true count, at most
//! `error` above it, and `error` is at most N / `CAPACITY` for N refusals counted:
//! a key refused more than N / `CAPACITY` times is always kept.

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};

use crate::identity::{KeyDigest, MAX_STORED_KEY};

/// Counters per epoch of a route's sketch.
pub const CAPACITY: usize = 64;
// An allowed request marks the counters it counted in one word per epoch.
const _: () = assert!(CAPACITY <= 64);
/// The longest key kept: a key as the limiter stores it is at most this long (a
/// longer one is stored as `#` and its SHA-1, `identity::kept_hashed`).
pub const MAX_KEY: usize = MAX_STORED_KEY;
/// How long an epoch lasts: the counts cover the current epoch and the one before,
/// the last 60 to 120 seconds. Epochs start at whole minutes of the UNIX epoch.
pub const EPOCH_MS: u64 = 60_000;
/// The most memory one route's sketch holds, its counters for both epochs
/// (allocated at its first refusal).
pub const MAX_BYTES: usize = 2 * CAPACITY * std::mem::size_of::<Counter>();

/// The heaviest refused clients of one route. Kept across reloads by the route's
/// name; the request path asks it nothing but one relaxed load until the route
/// refuses a request.
#[derive(Default)]
pub struct Top {
    /// Whether either epoch holds a counter: when not, an allowed request has
    /// nothing to count and takes no lock.
    held: AtomicBool,
    window: Mutex<Window>,
}

/// A key's counts over the window, as `Top::list` reports them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Offender {
    /// The key as the limiter stores it.
    pub key: String,
    /// The client address of the key's last refusal.
    pub ip: IpAddr,
    /// Refusals counted: at least the true number, at most `error` above it.
    pub refused: u64,
    /// How far `refused` may be above the true number.
    pub error: u64,
    /// Requests of the key allowed while it was kept (none before its first
    /// refusal counted, none after its counter went to another key).
    pub allowed: u64,
    /// Wall-clock milliseconds since the UNIX epoch of its last request counted,
    /// refused or allowed.
    pub last_seen_ms: u64,
}

impl Top {
    /// A refusal of `key` (as the limiter stores it; a longer one is kept as its
    /// hash) from `ip`, at wall-clock time `now_ms`.
    pub fn refused(&self, key: &str, ip: IpAddr, now_ms: u64) {
        let digest;
        let key = if key.len() > MAX_KEY {
            digest = KeyDigest::of(key);
            digest.as_str()
        } else {
            key
        };
        let mut w = self.lock();
        w.rotate(now_ms);
        w.current.refuse(key, ip, now_ms);
        self.held.store(true, Relaxed);
    }

    /// Whether any key is kept: an allowed request need ask nothing more when not.
    pub fn holds_any(&self) -> bool {
        self.held.load(Relaxed)
    }

    /// An allowed request with `keys` (as the limiter stores them): each kept key
    /// counts it once; the others are not counted.
    pub fn allowed<'k>(&self, keys: impl IntoIterator<Item = &'k str>, now_ms: u64) {
        if !self.holds_any() {
            return;
        }
        let mut w = self.lock();
        if !w.rotate(now_ms) {
            self.held.store(false, Relaxed);
            return;
        }
        // A request counts once per counter, whichever of its keys found it.
        let (mut current, mut previous) = (0u64, 0u64);
        for key in keys {
            let hash = hash(key.as_bytes());
            if let Some(i) = w.current.find(hash, key) {
                if current & (1 << i) == 0 {
                    current |= 1 << i;
                    w.current.counters[i].saw_allowed(now_ms);
                }
            } else if let Some(i) = w.previous.find(hash, key) {
                if previous & (1 << i) == 0 {
                    previous |= 1 << i;
                    w.previous.counters[i].saw_allowed(now_ms);
                }
            }
        }
    }

    /// Every key kept, with its counts over both epochs, the most refused first
    /// (then by key).
    pub fn list(&self, now_ms: u64) -> Vec<Offender> {
        let mut w = self.lock();
        if !w.rotate(now_ms) {
            self.held.store(false, Relaxed);
            return Vec::new();
        }
        let (cur, prev) = (&w.current, &w.previous);
        // A key missing from a full epoch's sketch may have been refused there as
        // often as its smallest counter: counted so, and added to its error.
        let (cur_floor, prev_floor) = (cur.floor(), prev.floor());
        let mut out: Vec<Offender> = cur
            .counters
            .iter()
            .map(|c| match prev.find(c.hash, c.key()) {
                Some(j) => c.offender().merged(&prev.counters[j]),
                None => c.offender().plus(prev_floor),
            })
            .collect();
        out.extend(
            prev.counters
                .iter()
                .filter(|p| cur.find(p.hash, p.key()).is_none())
                .map(|p| p.offender().plus(cur_floor)),
        );
        out.sort_by(|a, b| b.refused.cmp(&a.refused).then_with(|| a.key.cmp(&b.key)));
        out
    }

    fn lock(&self) -> MutexGuard<'_, Window> {
        self.window.lock().unwrap_or_else(|e| e.into_inner())
    }
}

// === the two epochs ===

#[derive(Default)]
struct Window {
    /// The number of the current epoch (`now_ms / EPOCH_MS`).
    epoch: u64,
    current: Sketch,
    previous: Sketch,
}

impl Window {
    /// Moves to the epoch of `now_ms` (never back: a wall clock set back counts into
    /// the current one); whether either epoch still holds a counter.
    fn rotate(&mut self, now_ms: u64) -> bool {
        let epoch = now_ms / EPOCH_MS;
        if epoch > self.epoch {
            if epoch == self.epoch + 1 {
                std::mem::swap(&mut self.current, &mut self.previous);
            } else {
                self.previous.clear();
            }
            // The buffer is kept: a route refused once is likely refused again.
            self.current.clear();
            self.epoch = epoch;
        }
        !self.current.counters.is_empty() || !self.previous.counters.is_empty()
    }
}

/// One epoch's space-saving sketch.
#[derive(Default)]
struct Sketch {
    /// At most `CAPACITY`, allocated whole at the first refusal.
    counters: Vec<Counter>,
}

impl Sketch {
    fn find(&self, hash: u64, key: &str) -> Option<usize> {
        self.counters
            .iter()
            .position(|c| c.hash == hash && c.key() == key)
    }

    fn refuse(&mut self, key: &str, ip: IpAddr, now_ms: u64) {
        let hash = hash(key.as_bytes());
        if let Some(i) = self.find(hash, key) {
            let c = &mut self.counters[i];
            c.refused += 1;
            c.ip = ip;
            c.last_seen_ms = now_ms;
            return;
        }
        if self.counters.len() < CAPACITY {
            if self.counters.capacity() == 0 {
                self.counters.reserve_exact(CAPACITY);
            }
            self.counters
                .push(Counter::new(hash, key, ip, 1, 0, now_ms));
            return;
        }
        // Full: the smallest counter goes to the new key, which inherits its count
        // as its error (the oldest such counter on a tie).
        let Some(min) = self
            .counters
            .iter_mut()
            .min_by_key(|c| (c.refused, c.last_seen_ms))
        else {
            return;
        };
        *min = Counter::new(hash, key, ip, min.refused + 1, min.refused, now_ms);
    }

    /// The most a key not kept may have been refused in this epoch: the smallest
    /// count when every counter is taken, else 0 (every key refused is kept).
    fn floor(&self) -> u64 {
        if self.counters.len() < CAPACITY {
            return 0;
        }
        self.counters.iter().map(|c| c.refused).min().unwrap_or(0)
    }

    fn clear(&mut self) {
        self.counters.clear();
    }
}

/// A counter: flat, its key inline, so that taking one over allocates nothing.
struct Counter {
    hash: u64,
    refused: u64,
    error: u64,
    allowed: u64,
    last_seen_ms: u64,
    ip: IpAddr,
    len: u16,
    key: [u8; MAX_KEY],
}

impl Counter {
    fn new(hash: u64, key: &str, ip: IpAddr, refused: u64, error: u64, now_ms: u64) -> Counter {
        let len = key.len().min(MAX_KEY);
        let mut bytes = [0u8; MAX_KEY];
        bytes[..len].copy_from_slice(&key.as_bytes()[..len]);
        Counter {
            hash,
            refused,
            error,
            allowed: 0,
            last_seen_ms: now_ms,
            ip,
            len: len as u16,
            key: bytes,
        }
    }

    fn key(&self) -> &str {
        // Copied whole from a `str` (callers keep keys within `MAX_KEY`).
        std::str::from_utf8(&self.key[..usize::from(self.len)]).unwrap_or("")
    }

    fn saw_allowed(&mut self, now_ms: u64) {
        self.allowed += 1;
        self.last_seen_ms = self.last_seen_ms.max(now_ms);
    }

    fn offender(&self) -> Offender {
        Offender {
            key: self.key().to_string(),
            ip: self.ip,
            refused: self.refused,
            error: self.error,
            allowed: self.allowed,
            last_seen_ms: self.last_seen_ms,
        }
    }
}

impl Offender {
    /// This epoch's counts (the current one's) with the previous epoch's of the same
    /// key; the address is the later one's.
    fn merged(mut self, earlier: &Counter) -> Offender {
        self.refused += earlier.refused;
        self.error += earlier.error;
        self.allowed += earlier.allowed;
        if earlier.last_seen_ms > self.last_seen_ms {
            self.last_seen_ms = earlier.last_seen_ms;
            self.ip = earlier.ip;
        }
        self
    }

    /// With `floor` refusals the other epoch may have had uncounted.
    fn plus(mut self, floor: u64) -> Offender {
        self.refused += floor;
        self.error += floor;
        self
    }
}

/// FNV-1a: a quick first comparison; keys that share a hash are told apart by
/// their bytes, so a client that finds collisions gains nothing but a slower scan.
fn hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    const T0: u64 = 1_800_000_000_000; // a whole minute
    const A: IpAddr = IpAddr::V4(Ipv4Addr::new(198, 51, 100, 7));
    const B: IpAddr = IpAddr::V4(Ipv4Addr::new(203, 0, 113, 9));

    fn row(key: &str, ip: IpAddr, refused: u64, error: u64, allowed: u64, at: u64) -> Offender {
        Offender {
            key: key.into(),
            ip,
            refused,
            error,
            allowed,
            last_seen_ms: at,
        }
    }

    #[test]
    fn fewer_keys_than_counters_are_counted_exactly() {
        let top = Top::default();
        assert!(!top.holds_any());
        top.allowed(["k1"], T0);
        assert_eq!(top.list(T0), vec![]);
        for i in 0..10 {
            top.refused("k1", A, T0 + i);
        }
        for i in 0..3 {
            top.refused("k2", B, T0 + 20 + i);
        }
        assert!(top.holds_any());
        // Counted once per request, whichever of its keys is kept; unkept keys not.
        top.allowed(["k1", "k1", "nobody"], T0 + 30);
        top.allowed(["k2"], T0 + 31);
        top.refused("k1", B, T0 + 40);
        assert_eq!(
            top.list(T0 + 50),
            vec![
                row("k1", B, 11, 0, 1, T0 + 40),
                row("k2", B, 3, 0, 1, T0 + 31)
            ]
        );
    }

    /// Refused 1000 times among 10,000 keys refused once or twice each: always
    /// kept, the first listed, its count within `error` above the truth, and `error`
    /// at most N / CAPACITY.
    #[test]
    fn a_heavy_key_in_a_flood_of_distinct_keys_stays_on_top_within_its_bound() {
        let top = Top::default();
        let (mut n, mut heavy) = (0u64, 0u64);
        for i in 0..10_000u64 {
            let key = format!("flood-{i}");
            top.refused(&key, B, T0 + i);
            n += 1;
            if i % 3 == 0 {
                top.refused(&key, B, T0 + i);
                n += 1;
            }
            if i % 10 == 0 {
                top.refused("heavy", A, T0 + i);
                n += 1;
                heavy += 1;
            }
        }
        let list = top.list(T0 + 10_000);
        assert_eq!(list.len(), CAPACITY);
        let first = &list[0];
        assert_eq!((first.key.as_str(), first.ip), ("heavy", A));
        assert!(first.refused >= heavy, "{first:?}");
        assert!(first.refused <= heavy + first.error, "{first:?}");
        for o in &list {
            assert!(o.error <= n / CAPACITY as u64, "{o:?} with n = {n}");
            assert!(o.refused >= o.error, "{o:?}");
        }
    }

    /// The same over two epochs: the heavy key refused in both is summed, within the
    /// bound over the refusals of both.
    #[test]
    fn the_bound_holds_over_both_epochs() {
        let top = Top::default();
        let (mut n, mut heavy) = (0u64, 0u64);
        for epoch in 0..2 {
            let at = T0 + epoch * EPOCH_MS;
            for i in 0..5_000u64 {
                top.refused(&format!("e{epoch}-{i}"), B, at + i);
                n += 1;
                if i % 4 == 0 {
                    top.refused("heavy", A, at + i);
                    n += 1;
                    heavy += 1;
                }
            }
        }
        let list = top.list(T0 + EPOCH_MS + 5_000);
        assert_eq!(list[0].key, "heavy");
        assert!(list[0].refused >= heavy && list[0].refused <= heavy + list[0].error);
        for o in &list {
            assert!(o.error <= n / CAPACITY as u64, "{o:?} with n = {n}");
        }
    }

    #[test]
    fn epochs_rotate_and_old_counts_go() {
        let top = Top::default();
        top.refused("old", A, T0);
        top.refused("old", A, T0 + 1);
        // The next epoch: the previous one still counts.
        top.refused("new", B, T0 + EPOCH_MS);
        top.refused("old", A, T0 + EPOCH_MS + 5);
        assert_eq!(
            top.list(T0 + EPOCH_MS + 10),
            vec![
                row("old", A, 3, 0, 0, T0 + EPOCH_MS + 5),
                row("new", B, 1, 0, 0, T0 + EPOCH_MS)
            ]
        );
        // One epoch on, the first is gone.
        assert_eq!(
            top.list(T0 + 2 * EPOCH_MS),
            vec![
                row("new", B, 1, 0, 0, T0 + EPOCH_MS),
                row("old", A, 1, 0, 0, T0 + EPOCH_MS + 5)
            ]
        );
        // Two more, all of it; an allowed request then takes no lock.
        assert!(top.holds_any());
        top.allowed(["old"], T0 + 4 * EPOCH_MS);
        assert!(!top.holds_any());
        assert_eq!(top.list(T0 + 4 * EPOCH_MS), vec![]);
        // A clock set back counts into the current epoch.
        top.refused("back", A, T0);
        assert_eq!(
            top.list(T0 + 4 * EPOCH_MS),
            vec![row("back", A, 1, 0, 0, T0)]
        );
    }

    /// A key missing from a full epoch may have been refused there as often as its
    /// smallest counter: counted so, with that much more error.
    #[test]
    fn a_key_missing_from_a_full_epoch_is_counted_at_its_floor() {
        let top = Top::default();
        for i in 0..CAPACITY as u64 {
            top.refused(&format!("k{i}"), B, T0);
            top.refused(&format!("k{i}"), B, T0);
        }
        top.refused("late", A, T0 + EPOCH_MS);
        let list = top.list(T0 + EPOCH_MS);
        let late = list.iter().find(|o| o.key == "late").unwrap();
        assert_eq!((late.refused, late.error), (3, 2));
    }

    #[test]
    fn memory_is_bounded() {
        let top = Top::default();
        for at in [T0, T0 + EPOCH_MS] {
            for i in 0..1_000u64 {
                top.refused(&format!("{at}-{i}"), B, at + i);
                let w = top.lock();
                assert!(w.current.counters.len() <= CAPACITY);
                assert!(w.current.counters.capacity() <= CAPACITY);
                assert!(w.previous.counters.capacity() <= CAPACITY);
            }
        }
        assert_eq!(top.list(T0 + EPOCH_MS + 1_000).len(), 2 * CAPACITY);
        // As docs/admin-api-and-cli.md says.
        assert_eq!(std::mem::size_of::<Counter>(), 320);
        assert_eq!(MAX_BYTES, 40_960);
    }

    #[test]
    fn a_long_key_is_kept_as_its_hash() {
        let top = Top::default();
        let long = "x".repeat(MAX_KEY + 1);
        top.refused(&long, A, T0);
        top.refused(&"y".repeat(MAX_KEY), A, T0);
        let list = top.list(T0);
        assert_eq!(list[0].key, KeyDigest::of(&long).as_str());
        assert_eq!(list[1].key, "y".repeat(MAX_KEY));
    }
}
