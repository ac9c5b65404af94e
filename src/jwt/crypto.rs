//! jsonwebtoken's signatures checked (and, for tests and benches, made) with ring,
//! the crypto rustls already brings: no second crypto library in the binary. HMAC,
//! RSA (PKCS#1 v1.5 and PSS, 2048 to 8192 bits) and ECDSA (P-256, P-384); EdDSA is
//! not offered.

use std::sync::Once;

use jsonwebtoken::crypto::{CryptoProvider, JwtSigner, JwtVerifier, KeyUtils};
use jsonwebtoken::errors::{Error, ErrorKind};
use jsonwebtoken::signature::{self, Signer, Verifier};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, DecodingKeyKind, EncodingKey};
use ring::signature as sig;

/// Makes ring jsonwebtoken's crypto for this process; idempotent.
pub fn install() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Another provider installed first (only a test could): it is used instead.
        let _ = PROVIDER.install_default();
    });
}

static PROVIDER: CryptoProvider = CryptoProvider {
    signer_factory: new_signer,
    verifier_factory: new_verifier,
    key_utils: KeyUtils::new_unimplemented(),
};

/// ring's verification algorithm for a public-key `alg`, with the key family it needs.
fn public_algorithm(
    alg: Algorithm,
) -> Option<(AlgorithmFamily, &'static dyn sig::VerificationAlgorithm)> {
    use AlgorithmFamily::{Ec, Rsa};
    Some(match alg {
        Algorithm::RS256 => (Rsa, &sig::RSA_PKCS1_2048_8192_SHA256),
        Algorithm::RS384 => (Rsa, &sig::RSA_PKCS1_2048_8192_SHA384),
        Algorithm::RS512 => (Rsa, &sig::RSA_PKCS1_2048_8192_SHA512),
        Algorithm::PS256 => (Rsa, &sig::RSA_PSS_2048_8192_SHA256),
        Algorithm::PS384 => (Rsa, &sig::RSA_PSS_2048_8192_SHA384),
        Algorithm::PS512 => (Rsa, &sig::RSA_PSS_2048_8192_SHA512),
        Algorithm::ES256 => (Ec, &sig::ECDSA_P256_SHA256_FIXED),
        Algorithm::ES384 => (Ec, &sig::ECDSA_P384_SHA384_FIXED),
        _ => return None,
    })
}

fn hmac_algorithm(alg: Algorithm) -> Option<ring::hmac::Algorithm> {
    match alg {
        Algorithm::HS256 => Some(ring::hmac::HMAC_SHA256),
        Algorithm::HS384 => Some(ring::hmac::HMAC_SHA384),
        Algorithm::HS512 => Some(ring::hmac::HMAC_SHA512),
        _ => None,
    }
}

// === verifying ===

enum Check {
    Hmac(ring::hmac::Key),
    Public(&'static dyn sig::VerificationAlgorithm, DecodingKey),
}

struct RingVerifier {
    alg: Algorithm,
    check: Check,
}

impl Verifier<Vec<u8>> for RingVerifier {
    fn verify(&self, msg: &[u8], signature: &Vec<u8>) -> Result<(), signature::Error> {
        let bad = |_| signature::Error::new();
        match &self.check {
            Check::Hmac(key) => ring::hmac::verify(key, msg, signature).map_err(bad),
            Check::Public(alg, key) => match key.kind() {
                DecodingKeyKind::RsaModulusExponent { n, e } => {
                    let params = rsa_params(self.alg).ok_or_else(signature::Error::new)?;
                    sig::RsaPublicKeyComponents { n, e }
                        .verify(params, msg, signature)
                        .map_err(bad)
                }
                DecodingKeyKind::SecretOrDer(der) => sig::UnparsedPublicKey::new(*alg, der)
                    .verify(msg, signature)
                    .map_err(bad),
            },
        }
    }
}

fn rsa_params(alg: Algorithm) -> Option<&'static sig::RsaParameters> {
    Some(match alg {
        Algorithm::RS256 => &sig::RSA_PKCS1_2048_8192_SHA256,
        Algorithm::RS384 => &sig::RSA_PKCS1_2048_8192_SHA384,
        Algorithm::RS512 => &sig::RSA_PKCS1_2048_8192_SHA512,
        Algorithm::PS256 => &sig::RSA_PSS_2048_8192_SHA256,
        Algorithm::PS384 => &sig::RSA_PSS_2048_8192_SHA384,
        Algorithm::PS512 => &sig::RSA_PSS_2048_8192_SHA512,
        _ => return None,
    })
}

impl JwtVerifier for RingVerifier {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

/// A verifier only for a key of the algorithm's own family: an RSA key never checks
/// an HMAC signature (the algorithm-confusion attack), nor the other way round.
fn new_verifier(alg: &Algorithm, key: &DecodingKey) -> Result<Box<dyn JwtVerifier>, Error> {
    let alg = *alg;
    let check = if let Some(h) = hmac_algorithm(alg) {
        if key.family() != AlgorithmFamily::Hmac {
            return Err(ErrorKind::InvalidKeyFormat.into());
        }
        Check::Hmac(ring::hmac::Key::new(h, key.try_get_as_bytes()?))
    } else {
        let (family, ring_alg) = public_algorithm(alg).ok_or(ErrorKind::InvalidAlgorithm)?;
        if key.family() != family {
            return Err(ErrorKind::InvalidKeyFormat.into());
        }
        Check::Public(ring_alg, key.clone())
    };
    Ok(Box::new(RingVerifier { alg, check }))
}

// === signing (tests and benches make their tokens with it) ===

enum Sign {
    Hmac(ring::hmac::Key),
    Rsa(sig::RsaKeyPair, &'static dyn sig::RsaEncoding),
    Ec(sig::EcdsaKeyPair),
}

struct RingSigner {
    alg: Algorithm,
    sign: Sign,
}

impl Signer<Vec<u8>> for RingSigner {
    fn try_sign(&self, msg: &[u8]) -> Result<Vec<u8>, signature::Error> {
        let rng = ring::rand::SystemRandom::new();
        match &self.sign {
            Sign::Hmac(key) => Ok(ring::hmac::sign(key, msg).as_ref().to_vec()),
            Sign::Rsa(pair, encoding) => {
                let mut out = vec![0; pair.public().modulus_len()];
                pair.sign(*encoding, &rng, msg, &mut out)
                    .map_err(|_| signature::Error::new())?;
                Ok(out)
            }
            Sign::Ec(pair) => pair
                .sign(&rng, msg)
                .map(|s| s.as_ref().to_vec())
                .map_err(|_| signature::Error::new()),
        }
    }
}

impl JwtSigner for RingSigner {
    fn algorithm(&self) -> Algorithm {
        self.alg
    }
}

/// HMAC from a secret; RSA from a PKCS#1 or PKCS#8 DER private key; ECDSA from a
/// PKCS#8 DER private key.
fn new_signer(alg: &Algorithm, key: &EncodingKey) -> Result<Box<dyn JwtSigner>, Error> {
    let alg = *alg;
    let bad = |_| Error::from(ErrorKind::InvalidKeyFormat);
    let sign = match alg {
        Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512 => {
            let h = hmac_algorithm(alg).ok_or(ErrorKind::InvalidAlgorithm)?;
            if key.family() != AlgorithmFamily::Hmac {
                return Err(ErrorKind::InvalidKeyFormat.into());
            }
            Sign::Hmac(ring::hmac::Key::new(h, key.as_bytes()))
        }
        Algorithm::ES256 | Algorithm::ES384 => {
            let a = if alg == Algorithm::ES256 {
                &sig::ECDSA_P256_SHA256_FIXED_SIGNING
            } else {
                &sig::ECDSA_P384_SHA384_FIXED_SIGNING
            };
            let rng = ring::rand::SystemRandom::new();
            Sign::Ec(sig::EcdsaKeyPair::from_pkcs8(a, key.as_bytes(), &rng).map_err(bad)?)
        }
        _ => {
            let encoding: &'static dyn sig::RsaEncoding = match alg {
                Algorithm::RS256 => &sig::RSA_PKCS1_SHA256,
                Algorithm::RS384 => &sig::RSA_PKCS1_SHA384,
                Algorithm::RS512 => &sig::RSA_PKCS1_SHA512,
                Algorithm::PS256 => &sig::RSA_PSS_SHA256,
                Algorithm::PS384 => &sig::RSA_PSS_SHA384,
                Algorithm::PS512 => &sig::RSA_PSS_SHA512,
                _ => return Err(ErrorKind::InvalidAlgorithm.into()),
            };
            let der = key.as_bytes();
            let pair = sig::RsaKeyPair::from_der(der)
                .or_else(|_| sig::RsaKeyPair::from_pkcs8(der))
                .map_err(bad)?;
            Sign::Rsa(pair, encoding)
        }
    };
    Ok(Box::new(RingSigner { alg, sign }))
}
