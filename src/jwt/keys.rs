//! A provider's keys: a JWKS's signing keys, or one HS secret; and the token header
//! read just far enough to pick the key (`alg`, `kid`).

use std::str::FromStr;

use base64::Engine;
use jsonwebtoken::jwk::{JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey};

use super::Failure;

#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    #[error("cannot fetch the JWKS: {0}")]
    Fetch(String),
    #[error("cannot read the JWKS: {0}")]
    Read(String),
    #[error("not a JWKS: {0}")]
    Parse(String),
    #[error("the JWKS has no signing key sluice can use (RSA, EC P-256/P-384 or oct)")]
    NoUsableKey,
    #[error("the HS secret is empty")]
    EmptySecret,
}

/// One key: its `kid`, the algorithm its JWK names (if any), and the key.
pub struct Key {
    pub kid: Option<String>,
    pub alg: Option<Algorithm>,
    pub key: DecodingKey,
}

/// The keys a provider checks signatures with.
#[derive(Default)]
pub struct KeySet {
    keys: Vec<Key>,
    /// Counts the sets a provider took: a token remembered under an older set is
    /// verified again (a key removed from the JWKS stops its tokens).
    pub generation: u64,
    /// An HS secret has no `kid`: a token's is not looked at.
    any_kid: bool,
}

impl KeySet {
    pub fn empty() -> KeySet {
        KeySet::default()
    }

    pub fn secret(secret: &[u8]) -> Result<KeySet, KeysError> {
        let key = DecodingKey::from_secret(secret).map_err(|_| KeysError::EmptySecret)?;
        Ok(KeySet {
            keys: vec![Key {
                kid: None,
                alg: None,
                key,
            }],
            generation: 1,
            any_kid: true,
        })
    }

    /// A JWKS document (RFC 7517): its signing keys. Keys for encryption
    /// (`use: enc`) and of types sluice cannot check are left out; none left is an
    /// error.
    pub fn parse_jwks(bytes: &[u8]) -> Result<KeySet, KeysError> {
        let set: JwkSet =
            serde_json::from_slice(bytes).map_err(|e| KeysError::Parse(e.to_string()))?;
        let keys: Vec<Key> = set
            .keys
            .iter()
            .filter(|jwk| !matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)))
            .filter_map(|jwk| {
                let key = DecodingKey::from_jwk(jwk).ok()?;
                if super::family_algorithms(key.family()).is_empty() {
                    return None;
                }
                Some(Key {
                    kid: jwk.common.key_id.clone(),
                    alg: jwk
                        .common
                        .key_algorithm
                        .and_then(|a| Algorithm::try_from(a).ok()),
                    key,
                })
            })
            .collect();
        if keys.is_empty() {
            return Err(KeysError::NoUsableKey);
        }
        Ok(KeySet {
            keys,
            generation: 1,
            any_kid: false,
        })
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Whether any key is a public key: then no HS token is ever accepted, since
    /// an HS "signature" made with a public key as the secret proves nothing.
    pub fn has_public(&self) -> bool {
        self.keys
            .iter()
            .any(|k| k.key.family() != AlgorithmFamily::Hmac)
    }

    /// The keys that may check a token of `alg` with `kid`: those with that `kid`
    /// (none: `UnknownKid`), or every key when the token names none; of them, those
    /// of `alg`'s family whose JWK names `alg` or no algorithm (none:
    /// `Algorithm`).
    pub fn candidates(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<Vec<&DecodingKey>, Failure> {
        let named: Vec<&Key> = match kid {
            Some(kid) if !self.any_kid => self
                .keys
                .iter()
                .filter(|k| k.kid.as_deref() == Some(kid))
                .collect(),
            _ => self.keys.iter().collect(),
        };
        if named.is_empty() {
            return Err(Failure::UnknownKid);
        }
        let fit: Vec<&DecodingKey> = named
            .into_iter()
            .filter(|k| k.key.family() == alg.family() && k.alg.is_none_or(|a| a == alg))
            .map(|k| &k.key)
            .collect();
        if fit.is_empty() {
            return Err(Failure::Algorithm);
        }
        Ok(fit)
    }
}

/// What the token's header says about its key.
#[derive(Debug, PartialEq, Eq)]
pub struct TokenHeader {
    pub alg: Algorithm,
    pub kid: Option<String>,
}

/// The header of a compact JWS: three base64url parts, the first a JSON object
/// with a known `alg` (`none`, in any case, and unknown algorithms: `Algorithm`)
/// and at most a string `kid`.
pub fn header(token: &str) -> Result<TokenHeader, Failure> {
    let mut parts = token.split('.');
    let (Some(h), Some(_), Some(_), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(Failure::Malformed);
    };
    let bytes = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(h)
        .map_err(|_| Failure::Malformed)?;
    let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|_| Failure::Malformed)?;
    let obj = v.as_object().ok_or(Failure::Malformed)?;
    let alg = obj
        .get("alg")
        .and_then(|a| a.as_str())
        .ok_or(Failure::Malformed)?;
    let alg = Algorithm::from_str(alg).map_err(|_| Failure::Algorithm)?;
    let kid = match obj.get("kid") {
        None => None,
        Some(serde_json::Value::String(k)) => Some(k.clone()),
        Some(_) => return Err(Failure::Malformed),
    };
    Ok(TokenHeader { alg, kid })
}
