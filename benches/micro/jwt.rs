//! JWT verification, as a route with `jwt` pays it per request:
//!
//! - `jwt/first_sight/{rs256,es256,hs256}`: a token never seen before (a fresh
//!   claim each iteration, so the cache never answers): parsing, the key lookup,
//!   the signature check, the claim checks, the cache insert;
//! - `jwt/cached/rs256`: the same token again (a SHA-256 of the token and a lookup).

use std::hint::black_box;

use criterion::Criterion;
use serde_json::json;
use sluice::jwt::testing::{hs256, jwks, spec, TestKey};
use sluice::jwt::{unix_now, Provider, Source};

fn provider(source: Source) -> Provider {
    Provider::new(spec(source, 10_000)).expect("a provider")
}

fn claims(i: u64) -> serde_json::Value {
    json!({"sub": format!("user-{i}"), "iss": "https://idp.test/", "aud": "api", "exp": unix_now() + 3600})
}

pub fn bench(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("jwks.json");
    let (rsa, ec) = (TestKey::rsa("r1"), TestKey::ec("e1"));
    std::fs::write(&file, jwks(&[&rsa, &ec])).expect("write the JWKS");
    let keys = provider(Source::File(file));
    let secret = b"an-hs256-secret-of-32-bytes-long".to_vec();
    let hs = provider(Source::Secret(secret.clone()));
    let now = unix_now();

    // Tokens signed ahead, so signing is not measured; more than the cache holds,
    // so none is ever a hit.
    let n = 20_000u64;
    let mut g = c.benchmark_group("jwt/first_sight");
    for (name, p, sign) in [
        (
            "rs256",
            &keys,
            &(|i| rsa.token(&claims(i))) as &dyn Fn(u64) -> String,
        ),
        ("es256", &keys, &|i| ec.token(&claims(i))),
        ("hs256", &hs, &|i| hs256(&secret, &claims(i))),
    ] {
        let tokens: Vec<String> = (0..n).map(sign).collect();
        let mut i = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % tokens.len();
                black_box(p.check(&tokens[i], now).is_ok())
            })
        });
    }
    g.finish();

    let token = rsa.token(&claims(0));
    assert!(keys.check(&token, now).is_ok());
    c.bench_function("jwt/cached/rs256", |b| {
        b.iter(|| black_box(keys.check(black_box(&token), now).is_ok()))
    });
}
