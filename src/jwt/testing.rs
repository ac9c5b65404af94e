//! Keys and tokens for tests and benches (with `test-support`): an RSA key (fixed:
//! ring makes no RSA keys), EC P-256 keys made fresh, their JWKS, and tokens
//! signed with jsonwebtoken over ring.

use base64::Engine;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use ring::signature::KeyPair;

const B64: base64::engine::GeneralPurpose = base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// A 2048-bit RSA test key (PKCS#8), made with `openssl genpkey` for these tests only.
const RSA_PEM: &str = "
MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQCz2g6uRRsTPLIY
aT5sO15zQarFYrdhmcdNozZmFd5/SJ8O0fXJypxTKPsl9Q2ebb4bbikZHDYvl4Sh
Uz7KeQfnzMT6Ub33mki2bTFMxcGdFMhuZPiUKEgjuXAgkoPKTD4Fdd5pK3r70XAM
jSYXsBah2hGYuWJxzYJ7lqHwjSS9htD/WUTvjTTZWkIlSiA2p5h/s35YgCoJTjuT
cuvnAL2vJmwiY1T5VqbXpJOwStMazaAf0ctVMPyVWzNtx1ugIQxCpOVLl/UhvsC6
H9rVXcKiNjSS+Q/pnW3K0bfRIfokC7wo5v/pggU2pKIfbU6k5WB2PLOTTkaJvk5D
nyMVNlaDAgMBAAECggEAHxz+hCxlUi8iWjG+wEeG/+ZgzhPVSJerUGWHUCLBYoCk
L5Kn9BhOcd55kCf0Cq/Ofv1QM81bHGGYarY1ex5z/ShB/VHtzKtOn+yE5lShuXRy
dhKWpD7RuAho+uGN1g3ZfuVUrBn/BRhGy40RhXCLgcVxXNvZSXm1dH7rFeu86uJh
AMLSD44XnN0F3Y6CTfiVg8On2GR4IltJ2GJTAE8WlkVVWciOfYg1IRnjxSSZPMEd
GsCiRWiuFpwJwBQodCT+aAwmI0kOX7hlkwGlowdBtNzIAI9miW/Xxfa3+vn0pjwb
zDjZm1SIJ3bNsHlnIwe4rZvff0NAEWWJSor5i0MiMQKBgQDW3SiWWM8V4d2UTQuk
h6tagiRLC1WAifcw8rqA4CJcCm9mYOtUUlyjpd6qjV9TRck0vGOZ3/8nXiVuieFm
dk8d5Kw1UfNekf9yvgHn6xFv1Ot4FP/QcFnu8dxwQ5EAsY65WhBJ3UHhiUTdg50c
BJpGqmDaUzYw8VnQdIvMBakwkQKBgQDWSOVqcgY0IAmbSD5OPes3mpCqZfDm6zTC
t9ah8xNJ3rO2NxzAN+mpNNfxlJ/HvcCDdi19Z4jvXjPl7ApYMS6qbzXAKp1KjRxQ
5lsxl9mUBXiZZSkU0uihDJZazyx6xP1U/dAcQHmMmFG7Kfl1x8cPVZhgnS+A6hWa
rPCh/KXf0wKBgQDByiSCPcVBIj78M+UtVuP4tOpQ+P77+POHJVWLSRwUUaEaAI4f
tk0xmDfVMb7pV0bbFpLqxPnXovU11owCIvDGsGmVib1r7VgtQCxt5TkL2UkrPB1h
/QNQHLpKUtZkfsCQcifAxxtVdL404DEChTA0ThUetPBqgjQUbBluQSjQ0QKBgBn1
PK1XYL8BvogsCTgrMgpLVAkATl160qpf4MU/j++b5cNGC9qRK2IO/7XJHk3xA5gp
Qbt2RlVQ4RKSNHKYiqGk1SsRPnqge3SlYxiv33CZ9REH+yEFp56Sysf3XtkEcffQ
w1wYx2CrtwLoQ8rrx4ZpBQt3HyELulBBcOj+lQ13AoGAa1egyRxa5gthLDcQUE78
+cqHIFVo+rJa7EYAypoHlXXep2dNgw1Uc5g+9CsnammvFDNksNlr3lKbEQyz1v48
c3OyOL9wQfJsMTap2vTtloN5JlLou6EgVQwZMwalHMsLE4DRAV+NQdAUBel9AWWM
Ica6qJzDGEQFzGyrgOF3H+E=
";

/// A signing key with its `kid`, and its public half as a JWK.
pub struct TestKey {
    pub kid: String,
    pub alg: Algorithm,
    der: Vec<u8>,
    pub jwk: serde_json::Value,
}

impl TestKey {
    /// The fixed RSA key, for RS256.
    pub fn rsa(kid: &str) -> TestKey {
        let pem: String = RSA_PEM.split_whitespace().collect();
        let der = base64::engine::general_purpose::STANDARD
            .decode(pem)
            .expect("the test key's base64");
        let pair = ring::signature::RsaKeyPair::from_pkcs8(&der).expect("the test RSA key");
        let c = ring::signature::RsaPublicKeyComponents::<Vec<u8>>::from(pair.public());
        let (n, e) = (B64.encode(&c.n), B64.encode(&c.e));
        TestKey {
            kid: kid.into(),
            alg: Algorithm::RS256,
            der,
            jwk: serde_json::json!({"kty": "RSA", "kid": kid, "alg": "RS256", "use": "sig", "n": n, "e": e}),
        }
    }

    /// A fresh EC P-256 key, for ES256.
    pub fn ec(kid: &str) -> TestKey {
        let rng = ring::rand::SystemRandom::new();
        let alg = &ring::signature::ECDSA_P256_SHA256_FIXED_SIGNING;
        let der = ring::signature::EcdsaKeyPair::generate_pkcs8(alg, &rng)
            .expect("an EC key")
            .as_ref()
            .to_vec();
        let pair = ring::signature::EcdsaKeyPair::from_pkcs8(alg, &der, &rng).expect("the EC key");
        let point = pair.public_key().as_ref();
        let (x, y) = (B64.encode(&point[1..33]), B64.encode(&point[33..65]));
        TestKey {
            kid: kid.into(),
            alg: Algorithm::ES256,
            der,
            jwk: serde_json::json!({"kty": "EC", "kid": kid, "crv": "P-256", "alg": "ES256", "x": x, "y": y}),
        }
    }

    /// A token of these claims signed with this key, its `kid` in the header.
    pub fn token(&self, claims: &serde_json::Value) -> String {
        super::crypto::install();
        let mut header = Header::new(self.alg);
        header.kid = Some(self.kid.clone());
        let key = match self.alg {
            Algorithm::ES256 => EncodingKey::from_ec_der(&self.der),
            _ => EncodingKey::from_rsa_der(&self.der),
        };
        jsonwebtoken::encode(&header, claims, &key).expect("a signed token")
    }

    /// The RSA key's public key as RFC 8017 DER (`RSAPublicKey`): what an attacker
    /// would use as an HS256 secret.
    pub fn public_der(&self) -> Vec<u8> {
        let pair = ring::signature::RsaKeyPair::from_pkcs8(&self.der).expect("an RSA key");
        pair.public().as_ref().to_vec()
    }
}

/// A provider's settings for tests and benches: issuer `https://idp.test/`,
/// audience `api`, a 60 s leeway.
pub fn spec(source: super::Source, cache_size: usize) -> super::ProviderSpec {
    super::ProviderSpec {
        name: "idp".into(),
        source,
        issuer: Some("https://idp.test/".into()),
        audiences: vec!["api".into()],
        leeway: std::time::Duration::from_secs(60),
        cache_size,
    }
}

/// A JWKS document of these keys.
pub fn jwks(keys: &[&TestKey]) -> String {
    let keys: Vec<&serde_json::Value> = keys.iter().map(|k| &k.jwk).collect();
    serde_json::json!({ "keys": keys }).to_string()
}

/// An HS256 token of these claims with `secret`.
pub fn hs256(secret: &[u8], claims: &serde_json::Value) -> String {
    super::crypto::install();
    let key = EncodingKey::from_secret(secret).expect("a secret");
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), claims, &key).expect("a signed token")
}

/// A token with `alg: none` and no signature.
pub fn unsigned(claims: &serde_json::Value) -> String {
    let h = B64.encode(br#"{"alg":"none","typ":"JWT"}"#);
    let c = B64.encode(claims.to_string());
    format!("{h}.{c}.")
}
