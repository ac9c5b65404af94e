//! Keys from verified JWT claims: each provider's keys (a JWKS by URL or file, or an
//! HS secret), the checks a token must pass before any of its claims becomes a key
//! (signature, `exp`/`nbf`, `iss`, `aud`), and a bounded cache of the tokens already
//! verified, so that a client's repeated token costs a lookup, not a signature check.

pub mod crypto;
mod keys;
#[cfg(any(test, feature = "test-support"))]
pub mod testing;

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwap;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, AlgorithmFamily, Validation};
use lru::LruCache;

pub use keys::{header, KeySet, KeysError, TokenHeader};

use crate::identity::VerifiedClaims;

/// A JWKS fetched by URL is fetched again this often...
pub const REFRESH: Duration = Duration::from_secs(600);
/// ...and on a token whose `kid` it lacks, at most this often.
pub const REFETCH_UNKNOWN_KID: Duration = Duration::from_secs(30);
/// A JWKS file is looked at this often (a change is taken at once).
pub const FILE_POLL: Duration = Duration::from_secs(1);
/// Verified tokens remembered per provider.
pub const CACHE_SIZE: usize = 10_000;
/// A token without `exp` is remembered at most this long.
const NO_EXP_CACHE_SECS: u64 = 60;
/// The most of a JWKS document read.
pub const MAX_JWKS_BYTES: usize = 1 << 20;

/// Why a token was refused, as `sluice_jwt_failures_total` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No token on a route that requires one.
    Missing,
    /// Not three base64url parts of JSON, or a claim of the wrong type.
    Malformed,
    /// `alg: none`, an algorithm the key does not name, HS where the provider has
    /// public keys.
    Algorithm,
    /// A `kid` the provider's keys do not have (after a refetch, for a URL).
    UnknownKid,
    Signature,
    Expired,
    NotYetValid,
    Issuer,
    Audience,
    /// The provider has no keys yet (its JWKS could never be fetched).
    NoKeys,
}

impl Failure {
    pub const ALL: [Failure; 10] = [
        Failure::Missing,
        Failure::Malformed,
        Failure::Algorithm,
        Failure::UnknownKid,
        Failure::Signature,
        Failure::Expired,
        Failure::NotYetValid,
        Failure::Issuer,
        Failure::Audience,
        Failure::NoKeys,
    ];

    /// The `reason` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Missing => "missing",
            Failure::Malformed => "malformed",
            Failure::Algorithm => "algorithm",
            Failure::UnknownKid => "unknown_kid",
            Failure::Signature => "signature",
            Failure::Expired => "expired",
            Failure::NotYetValid => "not_yet_valid",
            Failure::Issuer => "issuer",
            Failure::Audience => "audience",
            Failure::NoKeys => "no_keys",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Where a provider's keys come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A JWKS fetched over HTTP(S).
    Url(String),
    /// A JWKS file, read again when it changes.
    File(PathBuf),
    /// An HMAC secret (HS256, HS384, HS512).
    Secret(Vec<u8>),
}

/// A provider as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderSpec {
    pub name: String,
    pub source: Source,
    pub issuer: Option<String>,
    pub audiences: Vec<String>,
    pub leeway: Duration,
    pub cache_size: usize,
}

/// A verified token remembered: its claims, until when, under which key set.
struct Remembered {
    claims: VerifiedClaims,
    until: u64,
    generation: u64,
}

/// A provider at work: its keys, swapped whole when they are fetched again, and
/// the tokens it verified.
pub struct Provider {
    pub spec: ProviderSpec,
    keys: ArcSwap<KeySet>,
    cache: Mutex<LruCache<[u8; 32], Remembered>>,
    /// When an unknown `kid` last made the keys be fetched (Unix seconds; 0:
    /// never). The fetches at start and every `REFRESH` do not count: a key rotated
    /// in just after one is fetched on its first token.
    last_refetch: AtomicU64,
    /// When a token found no keys at all and fetched them (Unix seconds; 0: never).
    last_empty_fetch: AtomicU64,
    /// One fetch at a time; requests that need keys wait for it.
    fetching: tokio::sync::Mutex<()>,
    /// The JWKS file as last read: modified time and length.
    file_seen: Mutex<Option<(SystemTime, u64)>>,
}

/// Unix time in seconds.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Provider {
    /// A provider; an HS secret's key and a JWKS file's keys are there at once, a
    /// URL's come with the first fetch (`start`, or the first token).
    pub fn new(spec: ProviderSpec) -> Result<Provider, KeysError> {
        let keys = match &spec.source {
            Source::Secret(s) => KeySet::secret(s)?,
            Source::File(p) => KeySet::parse_jwks(
                &std::fs::read(p).map_err(|e| KeysError::Read(format!("{}: {e}", p.display())))?,
            )?,
            Source::Url(_) => KeySet::empty(),
        };
        Ok(Provider::with_keys(spec, keys))
    }

    /// A provider with these keys to begin with (a URL's are fetched again by
    /// `start` and on an unknown `kid`).
    pub fn with_keys(spec: ProviderSpec, keys: KeySet) -> Provider {
        crypto::install();
        let size = NonZeroUsize::new(spec.cache_size).unwrap_or(NonZeroUsize::MIN);
        let p = Provider {
            keys: ArcSwap::from_pointee(keys),
            cache: Mutex::new(LruCache::new(size)),
            last_refetch: AtomicU64::new(0),
            last_empty_fetch: AtomicU64::new(0),
            fetching: tokio::sync::Mutex::new(()),
            file_seen: Mutex::new(None),
            spec,
        };
        if let Source::File(path) = &p.spec.source {
            *p.file_seen.lock().unwrap_or_else(PoisonError::into_inner) = file_stamp(path);
        }
        p
    }

    /// Keeps the keys fresh while the provider lives: a URL's fetched now and every
    /// `REFRESH`, a file's read again when it changes. Needs a Tokio runtime; does
    /// nothing without one (`sluice check`).
    pub fn start(self: &Arc<Self>) {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if matches!(self.spec.source, Source::Secret(_)) {
            return;
        }
        let weak: Weak<Provider> = Arc::downgrade(self);
        rt.spawn(async move {
            let mut first = true;
            loop {
                let Some(p) = weak.upgrade() else { return };
                let wait = match &p.spec.source {
                    Source::Url(_) => {
                        // At start, unless a first token fetched them already.
                        if first {
                            p.refresh_unless_changed(0).await;
                        } else {
                            p.refresh().await;
                        }
                        first = false;
                        REFRESH
                    }
                    _ => {
                        p.reread_file_if_changed();
                        FILE_POLL
                    }
                };
                drop(p);
                tokio::time::sleep(wait).await;
            }
        });
    }

    /// The keys in use now.
    pub fn keys(&self) -> Arc<KeySet> {
        self.keys.load_full()
    }

    /// Fetches (a URL) or reads (a file) the keys again; on failure the last good set
    /// stays, and the failure is logged. Concurrent callers share one fetch.
    pub async fn refresh(&self) {
        let _one = self.fetching.lock().await;
        let result = match &self.spec.source {
            Source::Url(url) => {
                crate::upstream::fetch::get(url, Duration::from_secs(5), MAX_JWKS_BYTES)
                    .await
                    .map_err(|e| KeysError::Fetch(e.to_string()))
                    .and_then(|body| KeySet::parse_jwks(&body))
            }
            Source::File(p) => std::fs::read(p)
                .map_err(|e| KeysError::Read(format!("{}: {e}", p.display())))
                .and_then(|b| KeySet::parse_jwks(&b)),
            Source::Secret(_) => return,
        };
        self.take(result);
    }

    /// `refresh`, unless the keys are no longer those of `generation` (another
    /// fetch brought new ones while this one waited its turn).
    async fn refresh_unless_changed(&self, generation: u64) -> bool {
        let one = self.fetching.lock().await;
        if self.keys.load().generation != generation {
            return false;
        }
        drop(one);
        self.refresh().await;
        true
    }

    fn take(&self, result: Result<KeySet, KeysError>) {
        match result {
            Ok(mut set) => {
                let old = self.keys.load();
                set.generation = old.generation + 1;
                tracing::info!(provider = %self.spec.name, keys = set.len(), "jwt keys loaded");
                self.keys.store(Arc::new(set));
            }
            Err(e) => {
                tracing::warn!(provider = %self.spec.name, error = %e, "jwt keys not loaded; the last good set stays")
            }
        }
    }

    /// A JWKS file read again if its modified time or length changed.
    pub fn reread_file_if_changed(&self) {
        let Source::File(path) = &self.spec.source else {
            return;
        };
        let stamp = file_stamp(path);
        {
            let mut seen = self
                .file_seen
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if *seen == stamp || stamp.is_none() {
                return;
            }
            *seen = stamp;
        }
        self.take(
            std::fs::read(path)
                .map_err(|e| KeysError::Read(format!("{}: {e}", path.display())))
                .and_then(|b| KeySet::parse_jwks(&b)),
        );
    }

    /// `check`, and for a URL provider whose keys lack the token's `kid` (a key
    /// rotated in) or that has none yet: one refetch, at most every
    /// `REFETCH_UNKNOWN_KID`, then `check` again.
    pub async fn verify(&self, token: &str, now: u64) -> Result<VerifiedClaims, Failure> {
        match self.check(token, now) {
            Err(f @ (Failure::UnknownKid | Failure::NoKeys)) => {
                if !matches!(self.spec.source, Source::Url(_)) {
                    return Err(f);
                }
                let generation = self.keys.load().generation;
                // No keys yet (the JWKS could not be fetched at start): fetched
                // again at most as often as for an unknown kid, on a clock of its
                // own, so that a token at start does not delay a rotated key's.
                let last = match f {
                    Failure::NoKeys => &self.last_empty_fetch,
                    _ => &self.last_refetch,
                };
                if due(last, now) {
                    if self.refresh_unless_changed(generation).await {
                        last.store(now.max(1), Ordering::Relaxed);
                    }
                } else if f == Failure::NoKeys {
                    // A fetch under way (the one at start): its keys.
                    drop(self.fetching.lock().await);
                } else {
                    return Err(f);
                }
                self.check(token, now)
            }
            other => other,
        }
    }

    /// Whether an unknown `kid` may fetch the keys again at `now`.
    pub fn refetch_due(&self, now: u64) -> bool {
        due(&self.last_refetch, now)
    }

    /// The token's claims if it passes every check at `now` (Unix seconds): its
    /// signature by one of the provider's keys in an algorithm that key allows,
    /// `exp` and `nbf` within the leeway, `iss` and `aud`. A token verified before
    /// under the same keys is taken from the cache until it expires.
    pub fn check(&self, token: &str, now: u64) -> Result<VerifiedClaims, Failure> {
        let keys = self.keys.load();
        let id = token_id(token);
        {
            let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(r) = cache.get(&id) {
                if r.generation == keys.generation && now <= r.until {
                    return Ok(r.claims.clone());
                }
                cache.pop(&id);
            }
        }
        let (claims, until) = self.verify_uncached(&keys, token, now)?;
        let claims = VerifiedClaims(Arc::new(claims));
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .put(
                id,
                Remembered {
                    claims: claims.clone(),
                    until,
                    generation: keys.generation,
                },
            );
        Ok(claims)
    }

    /// The checks, without the cache: the claims and until when they hold.
    fn verify_uncached(
        &self,
        keys: &KeySet,
        token: &str,
        now: u64,
    ) -> Result<(serde_json::Value, u64), Failure> {
        let header = keys::header(token)?;
        let alg = header.alg;
        if alg.family() == AlgorithmFamily::Hmac && keys.has_public() {
            return Err(Failure::Algorithm);
        }
        if keys.is_empty() {
            return Err(Failure::NoKeys);
        }
        let candidates = keys.candidates(header.kid.as_deref(), alg)?;
        let mut validation = Validation::new(alg);
        validation.validate_exp = false;
        validation.validate_nbf = false;
        validation.required_spec_claims.clear();
        validation.leeway = 0;
        if let Some(iss) = &self.spec.issuer {
            validation.set_issuer(&[iss]);
        }
        if self.spec.audiences.is_empty() {
            validation.validate_aud = false;
        } else {
            validation.set_audience(&self.spec.audiences);
        }
        let mut last = Failure::Signature;
        for key in candidates {
            match jsonwebtoken::decode::<serde_json::Value>(token, key, &validation) {
                Ok(data) => return self.times(data.claims, now),
                Err(e) => {
                    last = match e.kind() {
                        ErrorKind::InvalidSignature => Failure::Signature,
                        ErrorKind::InvalidIssuer => return Err(Failure::Issuer),
                        ErrorKind::InvalidAudience => return Err(Failure::Audience),
                        ErrorKind::InvalidAlgorithm
                        | ErrorKind::InvalidAlgorithmName
                        | ErrorKind::InvalidKeyFormat => Failure::Algorithm,
                        _ => return Err(Failure::Malformed),
                    }
                }
            }
        }
        Err(last)
    }

    /// `exp` and `nbf` (numbers, when present) against `now` with the leeway; until
    /// when the token may be remembered.
    fn times(
        &self,
        claims: serde_json::Value,
        now: u64,
    ) -> Result<(serde_json::Value, u64), Failure> {
        let leeway = self.spec.leeway.as_secs();
        let time = |name: &str| match claims.get(name) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|t| Some(t.max(0.0) as u64))
                .ok_or(Failure::Malformed),
        };
        let (exp, nbf) = (time("exp")?, time("nbf")?);
        if let Some(exp) = exp {
            if now > exp.saturating_add(leeway) {
                return Err(Failure::Expired);
            }
        }
        if let Some(nbf) = nbf {
            if now.saturating_add(leeway) < nbf {
                return Err(Failure::NotYetValid);
            }
        }
        let until = match exp {
            Some(exp) => exp.saturating_add(leeway),
            None => now + NO_EXP_CACHE_SECS,
        };
        Ok((claims, until))
    }

    /// How many verified tokens are remembered.
    pub fn cached(&self) -> usize {
        self.cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// Whether `REFETCH_UNKNOWN_KID` has passed since `last` (0: never).
fn due(last: &AtomicU64, now: u64) -> bool {
    let last = last.load(Ordering::Relaxed);
    last == 0 || now >= last + REFETCH_UNKNOWN_KID.as_secs()
}

fn file_stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// The cache's key for a token: its SHA-256 (the token itself is never kept).
fn token_id(token: &str) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    let mut id = [0u8; 32];
    id.copy_from_slice(d.as_ref());
    id
}

/// The algorithms a key of `family` may check.
pub fn family_algorithms(family: AlgorithmFamily) -> &'static [Algorithm] {
    match family {
        AlgorithmFamily::Hmac => &[Algorithm::HS256, Algorithm::HS384, Algorithm::HS512],
        AlgorithmFamily::Rsa => &[
            Algorithm::RS256,
            Algorithm::RS384,
            Algorithm::RS512,
            Algorithm::PS256,
            Algorithm::PS384,
            Algorithm::PS512,
        ],
        AlgorithmFamily::Ec => &[Algorithm::ES256, Algorithm::ES384],
        _ => &[],
    }
}

#[cfg(test)]
mod tests;
