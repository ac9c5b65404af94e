use serde_json::json;

use super::testing::{hs256, jwks, unsigned, TestKey};
use super::*;

const NOW: u64 = 1_800_000_000;

fn spec(source: Source) -> ProviderSpec {
    super::testing::spec(source, 4)
}

fn jwks_provider(keys: &[&TestKey]) -> Provider {
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, jwks(keys)).expect("write the JWKS");
    let p = Provider::new(spec(Source::File(path))).expect("a provider");
    drop(dir);
    p
}

fn claims() -> serde_json::Value {
    json!({"sub": "alice", "iss": "https://idp.test/", "aud": "api", "exp": NOW + 300, "nbf": NOW - 10, "org": {"id": 7}})
}

fn with(k: &str, v: serde_json::Value) -> serde_json::Value {
    let mut c = claims();
    c[k] = v;
    c
}

#[test]
fn rs256_es256_and_hs256_tokens_verify() {
    let (r, e) = (TestKey::rsa("r1"), TestKey::ec("e1"));
    let p = jwks_provider(&[&r, &e]);
    for t in [r.token(&claims()), e.token(&claims())] {
        let c = p.check(&t, NOW).expect("a good token");
        assert_eq!(c.0["sub"], "alice");
        assert_eq!(c.0["org"]["id"], 7);
    }
    let hs = Provider::new(spec(Source::Secret(b"s3cret-s3cret".to_vec()))).expect("HS provider");
    let c = hs
        .check(&hs256(b"s3cret-s3cret", &claims()), NOW)
        .expect("HS256");
    assert_eq!(c.0["sub"], "alice");
}

#[test]
fn every_reason_a_token_is_refused() {
    let r = TestKey::rsa("r1");
    let p = jwks_provider(&[&r]);
    let other = TestKey::ec("r1"); // same kid, another key: a forgery
    let cases: Vec<(&str, String, Failure)> = vec![
        ("not a JWT", "abc".into(), Failure::Malformed),
        ("bad base64", "!!!.e30.sig".into(), Failure::Malformed),
        (
            "header not JSON",
            "bm90anNvbg.e30.c2ln".into(),
            Failure::Malformed,
        ),
        ("alg none", unsigned(&claims()), Failure::Algorithm),
        (
            "forged signature",
            other.token(&claims()),
            Failure::Algorithm,
        ),
        (
            "expired",
            r.token(&with("exp", json!(NOW - 61))),
            Failure::Expired,
        ),
        (
            "not yet valid",
            r.token(&with("nbf", json!(NOW + 61))),
            Failure::NotYetValid,
        ),
        (
            "wrong issuer",
            r.token(&with("iss", json!("https://evil.test/"))),
            Failure::Issuer,
        ),
        (
            "wrong audience",
            r.token(&with("aud", json!("other"))),
            Failure::Audience,
        ),
        (
            "exp not a number",
            r.token(&with("exp", json!("soon"))),
            Failure::Malformed,
        ),
        (
            "unknown kid",
            TestKey::rsa("r9").token(&claims()),
            Failure::UnknownKid,
        ),
        (
            "HS256 with the RSA public key",
            hs256(&r.public_der(), &claims()),
            Failure::Algorithm,
        ),
    ];
    for (what, token, want) in cases {
        assert_eq!(p.check(&token, NOW).err(), Some(want), "{what}");
    }
    // A signature of the right algorithm by another RSA key: the signature fails.
    let mut t = r.token(&claims());
    let sig_at = t.rfind('.').expect("three parts") + 1;
    let flipped = if t.as_bytes()[sig_at] == b'A' {
        "B"
    } else {
        "A"
    };
    t.replace_range(sig_at..sig_at + 1, flipped);
    assert_eq!(p.check(&t, NOW).err(), Some(Failure::Signature));
    // A changed claim breaks the signature.
    let good = r.token(&claims());
    let parts: Vec<&str> = good.split('.').collect();
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    use base64::Engine;
    let evil = b64.encode(with("sub", json!("victim")).to_string());
    let tampered = format!("{}.{evil}.{}", parts[0], parts[2]);
    assert_eq!(p.check(&tampered, NOW).err(), Some(Failure::Signature));
}

#[test]
fn leeway_holds_on_both_sides() {
    let r = TestKey::rsa("r1");
    let p = jwks_provider(&[&r]);
    assert!(p
        .check(&r.token(&with("exp", json!(NOW - 60))), NOW)
        .is_ok());
    assert!(p
        .check(&r.token(&with("nbf", json!(NOW + 60))), NOW)
        .is_ok());
}

#[test]
fn hs_tokens_are_refused_by_a_secret_of_another_value() {
    let hs = Provider::new(spec(Source::Secret(b"right".to_vec()))).expect("HS provider");
    assert_eq!(
        hs.check(&hs256(b"wrong", &claims()), NOW).err(),
        Some(Failure::Signature)
    );
    // An RS256 token to an HS provider: no key of its family.
    let r = TestKey::rsa("r1");
    assert_eq!(
        hs.check(&r.token(&claims()), NOW).err(),
        Some(Failure::Algorithm)
    );
}

#[test]
fn a_verified_token_is_remembered_until_it_expires() {
    let r = TestKey::rsa("r1");
    let p = jwks_provider(&[&r]);
    let t = r.token(&claims());
    assert!(p.check(&t, NOW).is_ok());
    assert_eq!(p.cached(), 1);
    assert!(p.check(&t, NOW + 1).is_ok());
    assert_eq!(p.cached(), 1);
    // Past exp + leeway the cache does not answer: the token is expired.
    assert_eq!(p.check(&t, NOW + 300 + 61).err(), Some(Failure::Expired));
    assert_eq!(p.cached(), 0);
}

#[test]
fn the_cache_is_bounded() {
    let r = TestKey::rsa("r1");
    let p = jwks_provider(&[&r]);
    for i in 0..10 {
        assert!(p
            .check(&r.token(&with("sub", json!(format!("u{i}")))), NOW)
            .is_ok());
    }
    assert_eq!(p.cached(), 4);
}

#[test]
fn a_refused_token_is_never_remembered() {
    let r = TestKey::rsa("r1");
    let p = jwks_provider(&[&r]);
    let _ = p.check(&r.token(&with("aud", json!("other"))), NOW);
    assert_eq!(p.cached(), 0);
}

#[test]
fn a_key_removed_from_the_file_stops_its_cached_tokens() {
    let (r, e) = (TestKey::rsa("r1"), TestKey::ec("e1"));
    let dir = tempfile::tempdir().expect("a temp dir");
    let path = dir.path().join("jwks.json");
    std::fs::write(&path, jwks(&[&r, &e])).expect("write");
    let p = Provider::new(spec(Source::File(path.clone()))).expect("a provider");
    let t = r.token(&claims());
    assert!(p.check(&t, NOW).is_ok());
    std::fs::write(&path, jwks(&[&e])).expect("rewrite");
    // A length change is a change, whatever the clock's resolution.
    p.reread_file_if_changed();
    assert_eq!(p.check(&t, NOW).err(), Some(Failure::UnknownKid));
    // A broken file keeps the last good set.
    std::fs::write(&path, "{not json").expect("break");
    p.reread_file_if_changed();
    assert!(p.check(&e.token(&claims()), NOW).is_ok());
}

#[test]
fn unknown_kids_refetch_at_most_every_30_seconds() {
    let p = Provider::new(spec(Source::Url("http://127.0.0.1:9/jwks".into()))).expect("a provider");
    assert!(p.refetch_due(NOW));
    p.last_refetch.store(NOW, Ordering::Relaxed);
    assert!(!p.refetch_due(NOW + 29));
    assert!(p.refetch_due(NOW + 30));
}

#[test]
fn a_jwks_needs_a_usable_key() {
    assert!(matches!(
        KeySet::parse_jwks(br#"{"keys": []}"#),
        Err(KeysError::NoUsableKey)
    ));
    assert!(matches!(
        KeySet::parse_jwks(b"[]"),
        Err(KeysError::Parse(_))
    ));
    // Encryption keys are left out.
    let mut k = TestKey::rsa("r1").jwk;
    k["use"] = json!("enc");
    let doc = json!({"keys": [k]}).to_string();
    assert!(matches!(
        KeySet::parse_jwks(doc.as_bytes()),
        Err(KeysError::NoUsableKey)
    ));
}

#[test]
fn an_algorithm_the_jwk_does_not_name_is_refused() {
    let r = TestKey::rsa("r1");
    // The JWK says RS256; a PS256 token under its kid is refused before any check.
    let p = jwks_provider(&[&r]);
    let mut header = jsonwebtoken::Header::new(Algorithm::PS256);
    header.kid = Some("r1".into());
    let h = base64::Engine::encode(
        &base64::engine::general_purpose::URL_SAFE_NO_PAD,
        serde_json::to_vec(&header).expect("header"),
    );
    let t = format!("{h}.e30.c2ln");
    assert_eq!(p.check(&t, NOW).err(), Some(Failure::Algorithm));
}
