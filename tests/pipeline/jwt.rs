//! Keys from verified JWT claims, end to end: real tokens (RS256, ES256, HS256,
//! signed with jsonwebtoken over ring), a JWKS served over HTTP on loopback and
//! rotated while the gateway runs, every kind of bad token refused 401 and charged
//! nothing, budgets per verified subject, tiers by claim and deny by claim key, on
//! the memory store and on a real redis-server.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use http::Method;
use serde_json::json;
use sluice::jwt::testing::{hs256, jwks, unsigned, TestKey};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

const ISS: &str = "https://idp.test/";
const SECRET: &str = "an-hs256-secret-of-32-bytes-long";

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("after 1970")
        .as_secs()
}

/// Claims of a good token for `sub`, with `extra` claims.
fn claims(sub: &str, extra: serde_json::Value) -> serde_json::Value {
    let mut c = json!({"sub": sub, "iss": ISS, "aud": "api", "iat": now(), "exp": now() + 600});
    if let (Some(c), Some(extra)) = (c.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            c.insert(k.clone(), v.clone());
        }
    }
    c
}

fn bearer(token: &str) -> String {
    format!("Bearer {token}")
}

/// A JWKS document served over plain HTTP on 127.0.0.1: swap it with `set`,
/// count the GETs with `fetches`.
struct JwksServer {
    addr: std::net::SocketAddr,
    doc: Arc<Mutex<String>>,
    fetches: Arc<AtomicUsize>,
}

impl JwksServer {
    async fn start(doc: String) -> JwksServer {
        let doc = Arc::new(Mutex::new(doc));
        let fetches = Arc::new(AtomicUsize::new(0));
        let (d, f) = (doc.clone(), fetches.clone());
        let (addr, _) = raw_upstream(move |mut s| {
            let (d, f) = (d.clone(), f.clone());
            async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 1024];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                f.fetch_add(1, Ordering::SeqCst);
                let body = d.lock().expect("the document").clone();
                let resp = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            }
        })
        .await;
        JwksServer { addr, doc, fetches }
    }

    fn url(&self) -> String {
        format!("http://{}/.well-known/jwks.json", self.addr)
    }

    fn set(&self, doc: String) {
        *self.doc.lock().expect("the document") = doc;
    }

    fn fetches(&self) -> usize {
        self.fetches.load(Ordering::SeqCst)
    }
}

fn hs_secret_env() -> &'static str {
    static SET: OnceLock<()> = OnceLock::new();
    SET.get_or_init(|| std::env::set_var("SLUICE_TEST_JWT_SECRET", SECRET));
    "SLUICE_TEST_JWT_SECRET"
}

/// The gateway of these tests: `/rs` and `/es` verified by the JWKS at `jwks`
/// (issuer and audience checked), `/hs` by an HS secret from the environment;
/// each keyed by `sub`, 3 a minute, gold plans 5, and `mallory` denied.
fn gateway_yaml(up: &str, jwks: &str, store: &str) -> String {
    let env = hs_secret_env();
    format!(
        r#"{store}upstreams:
  app: {{targets: ["{up}"], probe: false}}
deny: {{keys: [mallory]}}
jwt:
  providers:
    idp: {{jwks_url: "{jwks}", issuer: "{ISS}", audiences: [api]}}
    shared: {{secret: "${{{env}}}", issuer: "{ISS}"}}
routes:
  - name: rs
    match: {{path_prefix: /rs}}
    upstream: app
    jwt: {{provider: idp}}
    key: jwt:sub
    limits: [{{algorithm: fixed_window, limit: 3, window: 1m}}]
    overrides:
      - claims: {{plan: gold}}
        limits: [{{algorithm: fixed_window, limit: 5, window: 1m}}]
  - name: org
    match: {{path_prefix: /org}}
    upstream: app
    jwt: {{provider: idp}}
    key: "jwt:/org/id"
    limits: [{{algorithm: fixed_window, limit: 2, window: 1m}}]
  - name: hs
    match: {{path_prefix: /hs}}
    upstream: app
    jwt: {{provider: shared, cookie: session}}
    key: jwt:sub
    limits: [{{algorithm: fixed_window, limit: 3, window: 1m}}]
  - name: open
    match: {{path_prefix: /open}}
    upstream: app
    jwt: {{provider: idp, required: false}}
    key: jwt:sub
    missing_key: ip
    limits: [{{algorithm: fixed_window, limit: 2, window: 1m}}]
"#
    )
}

fn redis_store(test: &str) -> String {
    static SERVER: OnceLock<crate::common::redis::RedisServer> = OnceLock::new();
    let server = SERVER.get_or_init(crate::common::redis::RedisServer::start);
    format!(
        "store:\n  backend: redis\n  redis: {{url: \"{}\", timeout: 2s, key_prefix: \"jwt-{test}:\"}}\n  on_error: deny\n",
        server.url()
    )
}

async fn statuses_with(c: &HttpClient, n: usize, url: &str, auth: &str) -> Vec<u16> {
    statuses(c, n, url, &[("authorization", auth)]).await
}

/// Every token that is not good is 401 with the right challenge, counted by
/// reason, and charged nothing: the good tokens of the same subject still get
/// their whole budget after them. RS256 and ES256 from the JWKS, HS256 from the
/// secret.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_are_401_by_reason_and_charged_nothing() {
    let (rsa, ec) = (TestKey::rsa("r1"), TestKey::ec("e1"));
    let idp = JwksServer::start(jwks(&[&rsa, &ec])).await;
    let up = upstream().await;
    let gw = start_gateway(&gateway_yaml(&up.url(), &idp.url(), "")).await;
    let c = http1();
    let rs = url(gw.addr, "/rs");

    let alice = claims("alice", json!({}));
    let with = |k: &str, v: serde_json::Value| {
        let mut c = alice.clone();
        c[k] = v;
        c
    };
    let forger = TestKey::ec("e1"); // the kid of a real key, another key
    let bad: Vec<(&str, String, &str)> = vec![
        ("forged", forger.token(&alice), "signature"),
        (
            "expired",
            rsa.token(&with("exp", json!(now() - 120))),
            "expired",
        ),
        (
            "not yet valid",
            rsa.token(&with("nbf", json!(now() + 120))),
            "not_yet_valid",
        ),
        (
            "wrong issuer",
            rsa.token(&with("iss", json!("https://evil.test/"))),
            "issuer",
        ),
        (
            "wrong audience",
            rsa.token(&with("aud", json!("billing"))),
            "audience",
        ),
        ("alg none", unsigned(&alice), "algorithm"),
        (
            "HS256 keyed with the RSA public key",
            hs256(&rsa.public_der(), &alice),
            "algorithm",
        ),
        (
            "unknown kid",
            TestKey::ec("e7").token(&alice),
            "unknown_kid",
        ),
        ("garbage", "not.a.jwt".into(), "malformed"),
    ];
    for (what, token, _) in &bad {
        let r = c.get(&rs, &[("authorization", &bearer(token))]).await;
        assert_eq!(r.status, 401, "{what}: {}", r.text());
        assert_eq!(
            r.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\""),
            "{what}"
        );
    }
    let none = c.get(&rs, &[]).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.header("www-authenticate"), Some("Bearer"));
    assert_eq!(
        none.text(),
        "this route needs a bearer token (Authorization: Bearer ...)\n"
    );
    let not_bearer = c.get(&rs, &[("authorization", "Basic YWxpY2U6cHc=")]).await;
    assert_eq!(not_bearer.status, 401);
    assert_eq!(up.hits(), 0, "no refused request reached the upstream");

    // alice's whole budget is still there, with an RS256 and an ES256 token.
    let (t1, t2) = (rsa.token(&alice), ec.token(&alice));
    assert_eq!(statuses_with(&c, 2, &rs, &bearer(&t1)).await, [200, 200]);
    assert_eq!(statuses_with(&c, 2, &rs, &bearer(&t2)).await, [200, 429]);
    // HS256 from the secret, in a cookie.
    let hs = url(gw.addr, "/hs");
    let cookie = format!("session={}", hs256(SECRET.as_bytes(), &alice));
    assert_eq!(
        statuses(&c, 4, &hs, &[("cookie", &cookie)]).await,
        [200, 200, 200, 429]
    );
    let forged_cookie = format!("session={}", hs256(b"another-secret", &alice));
    assert_eq!(c.get(&hs, &[("cookie", &forged_cookie)]).await.status, 401);

    let m = metrics(gw.admin_addr).await;
    for reason in [
        "signature",
        "expired",
        "not_yet_valid",
        "issuer",
        "audience",
        "unknown_kid",
    ] {
        let series = format!("sluice_jwt_failures_total{{reason=\"{reason}\",route=\"rs\"}}");
        assert_eq!(metric(&m, &series), Some(1.0), "{series}");
    }
    let count = |reason: &str, route: &str| {
        metric(
            &m,
            &format!("sluice_jwt_failures_total{{reason=\"{reason}\",route=\"{route}\"}}"),
        )
    };
    assert_eq!(count("algorithm", "rs"), Some(2.0));
    assert_eq!(count("malformed", "rs"), Some(2.0));
    assert_eq!(count("missing", "rs"), Some(1.0));
    assert_eq!(count("no_keys", "rs"), Some(0.0));
    assert_eq!(count("signature", "hs"), Some(1.0));
    assert_eq!(
        decisions(&m, "rs"),
        [("allowed", 3.0), ("limited", 1.0), ("unauthorized", 11.0)]
    );
    assert_eq!(requests(&m, "org", "unauthorized"), 0.0);
    assert!(m.contains("sluice_requests_total{decision=\"unauthorized\",route=\"org\"} 0"));
    assert_eq!(up.hits(), 6);
}

/// A key rotated into the JWKS while the gateway runs is fetched on its first
/// token (and that token admitted); another unknown kid right after is refused
/// without a fetch (at most one refetch per 30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_rotated_in_is_fetched_on_its_first_token() {
    let (old, new) = (TestKey::rsa("2026-01"), TestKey::ec("2026-02"));
    let idp = JwksServer::start(jwks(&[&old])).await;
    let up = upstream().await;
    let gw = start_gateway(&gateway_yaml(&up.url(), &idp.url(), "")).await;
    let c = http1();
    let rs = url(gw.addr, "/rs");
    let r = c
        .get(
            &rs,
            &[(
                "authorization",
                &bearer(&old.token(&claims("a", json!({})))),
            )],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(idp.fetches(), 1, "fetched once at start");

    idp.set(jwks(&[&old, &new]));
    let r = c
        .get(
            &rs,
            &[(
                "authorization",
                &bearer(&new.token(&claims("b", json!({})))),
            )],
        )
        .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(idp.fetches(), 2, "the unknown kid fetched the JWKS again");

    let stranger = TestKey::ec("2026-03").token(&claims("c", json!({})));
    let r = c.get(&rs, &[("authorization", &bearer(&stranger))]).await;
    assert_eq!(r.status, 401);
    assert_eq!(idp.fetches(), 2, "no second refetch within 30 s");
    // The JWKS server gone: the keys fetched last still verify.
    idp.set("{not json".into());
    let r = c
        .get(
            &rs,
            &[(
                "authorization",
                &bearer(&old.token(&claims("d", json!({})))),
            )],
        )
        .await;
    assert_eq!(r.status, 200);
}

/// Budgets per verified subject (two tokens of one `sub` share one), per nested
/// claim (`jwt:/org/id`), tiers by claim, a denied subject, an absent claim, and
/// a route where the token is optional.
async fn budgets_follow_verified_claims(store: String) {
    let rsa = TestKey::rsa("r1");
    let idp = JwksServer::start(jwks(&[&rsa])).await;
    let up = upstream().await;
    let gw = start_gateway(&gateway_yaml(&up.url(), &idp.url(), &store)).await;
    let c = http1();
    let (rs, org, open) = (
        url(gw.addr, "/rs"),
        url(gw.addr, "/org"),
        url(gw.addr, "/open"),
    );
    let token = |sub: &str, extra: serde_json::Value| bearer(&rsa.token(&claims(sub, extra)));

    // Two tokens of one subject: one budget of 3.
    let (a1, a2) = (
        token("alice", json!({"n": 1})),
        token("alice", json!({"n": 2})),
    );
    assert_ne!(a1, a2);
    assert_eq!(statuses_with(&c, 2, &rs, &a1).await, [200, 200]);
    assert_eq!(statuses_with(&c, 2, &rs, &a2).await, [200, 429]);
    // Another subject has its own.
    assert_eq!(
        statuses_with(&c, 4, &rs, &token("bob", json!({}))).await,
        ok_then_limited(3, 1)
    );
    // A gold plan: 5.
    let gold = token("carol", json!({"plan": "gold"}));
    assert_eq!(
        statuses_with(&c, 6, &rs, &gold).await,
        ok_then_limited(5, 1)
    );
    // A subject that is a number is a key too.
    assert_eq!(
        statuses_with(&c, 4, &rs, &token("x", json!({"sub": 42}))).await,
        ok_then_limited(3, 1)
    );
    // No sub: a missing key (400). (A `sub` that is not a string is a malformed
    // token to jsonwebtoken: 401.)
    let mut no_sub = claims("x", json!({}));
    no_sub.as_object_mut().map(|c| c.remove("sub"));
    let r = c
        .get(&rs, &[("authorization", &bearer(&rsa.token(&no_sub)))])
        .await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.text(),
        "missing JWT claim sub (absent, empty or sent more than once): this route needs it to identify the client\n"
    );
    // A denied subject: 403, however valid its token.
    assert_eq!(
        c.get(&rs, &[("authorization", &token("mallory", json!({})))])
            .await
            .status,
        403
    );
    // A nested claim: two users of one organisation share its budget of 2.
    let (u1, u2) = (
        token("u1", json!({"org": {"id": "acme"}})),
        token("u2", json!({"org": {"id": "acme"}})),
    );
    assert_eq!(statuses_with(&c, 1, &org, &u1).await, [200]);
    assert_eq!(statuses_with(&c, 2, &org, &u2).await, [200, 429]);
    // A claim that is neither a string nor a number is no key.
    let odd = token("u3", json!({"org": {"id": {"name": "acme"}}}));
    let r = c.get(&org, &[("authorization", &odd)]).await;
    assert_eq!(r.status, 400);
    assert_eq!(
        r.text(),
        "missing JWT claim /org/id (absent, empty or sent more than once): this route needs it to identify the client\n"
    );
    // An optional token: without one, counted by address (missing_key: ip); a bad
    // one is still 401.
    assert_eq!(statuses(&c, 3, &open, &[]).await, [200, 200, 429]);
    assert_eq!(
        statuses_with(&c, 1, &open, &token("dave", json!({}))).await,
        [200]
    );
    let expired = bearer(&rsa.token(&claims("dave", json!({"exp": now() - 600}))));
    assert_eq!(statuses_with(&c, 1, &open, &expired).await, [401]);

    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        decisions(&m, "rs"),
        [
            ("allowed", 14.0),
            ("bad_request", 1.0),
            ("denied", 1.0),
            ("limited", 4.0)
        ]
    );
    // The refused subjects are what /admin/top shows, as keys the deny list takes.
    let top = c.get(&url(gw.admin_addr, "/admin/top?route=rs"), &[]).await;
    assert!(top.text().contains("\"alice\""), "{}", top.text());
    let added = c
        .send(
            Method::POST,
            &url(gw.admin_addr, "/admin/deny"),
            &[("content-type", "application/json")],
            r#"{"key": "bob"}"#,
        )
        .await;
    assert_eq!(added.status, 201, "{}", added.text());
    let denied = eventually(std::time::Duration::from_secs(2), || async {
        c.get(&rs, &[("authorization", &token("bob", json!({})))])
            .await
            .status
            == 403
    })
    .await;
    assert!(denied.is_some(), "a claim key from /admin/top is denied");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_follow_verified_claims_on_memory() {
    budgets_follow_verified_claims(String::new()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn budgets_follow_verified_claims_on_redis() {
    budgets_follow_verified_claims(redis_store("budgets")).await
}

/// A gRPC call without a token gets gRPC's UNAUTHENTICATED (16), not an HTTP 401.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_without_a_token_are_unauthenticated() {
    let idp = JwksServer::start(jwks(&[&TestKey::rsa("r1")])).await;
    let up = upstream().await;
    let gw = start_gateway(&gateway_yaml(&up.url(), &idp.url(), "")).await;
    let r = h2c()
        .send(
            Method::POST,
            &url(gw.addr, "/rs.v1.Svc/Call"),
            &[("content-type", "application/grpc")],
            bytes::Bytes::new(),
        )
        .await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("grpc-status"), Some("16"));
    assert_eq!(up.hits(), 0);
}

/// Made by PyJWT with `cryptography` (keys generated there): a JWKS of an RSA and
/// an EC key, and tokens for `sub` in RS256, ES256 and HS256, plus `alg: none`
/// and HS256 keyed with the RSA public key. Printed as one JSON object.
const PYJWT: &str = r#"
import hashlib, hmac, json, sys, time
import jwt
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

iss, secret = sys.argv[1], sys.argv[2].encode()
now = int(time.time())
claims = {"sub": "py-user", "iss": iss, "aud": "api", "iat": now, "exp": now + 600, "plan": "gold"}
rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
ec_key = ec.generate_private_key(ec.SECP256R1())
rsa_jwk = json.loads(RSAAlgorithm.to_jwk(rsa_key.public_key()))
rsa_jwk.update(kid="py-rsa", alg="RS256", use="sig")
ec_jwk = json.loads(ECAlgorithm.to_jwk(ec_key.public_key()))
ec_jwk.update(kid="py-ec", alg="ES256")
b64 = lambda b: jwt.utils.base64url_encode(b).decode()
signing_input = b64(json.dumps({"alg": "HS256", "typ": "JWT", "kid": "py-rsa"}).encode()) + "." + b64(json.dumps(claims).encode())
public_der = rsa_key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.PKCS1)
confused = signing_input + "." + b64(hmac.new(public_der, signing_input.encode(), hashlib.sha256).digest())
print(json.dumps({
    "jwks": {"keys": [rsa_jwk, ec_jwk]},
    "rs256": jwt.encode(claims, rsa_key, algorithm="RS256", headers={"kid": "py-rsa"}),
    "es256": jwt.encode(claims, ec_key, algorithm="ES256", headers={"kid": "py-ec"}),
    "hs256": jwt.encode(claims, secret, algorithm="HS256"),
    "none": jwt.encode(claims, None, algorithm="none"),
    "confused": confused,
}))
"#;

/// Tokens and a JWKS made by another library (PyJWT, `cryptography`'s keys) verify
/// as sluice's own do; its `alg: none` and algorithm-confusion tokens are refused.
/// (tests/run.sh installs PyJWT and cryptography when they are missing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_made_by_pyjwt_verify() {
    let out = crate::common::run_grouped(
        std::process::Command::new("python3").args(["-c", PYJWT, ISS, SECRET]),
    )
    .expect("python3 runs");
    assert!(
        out.status.success(),
        "PyJWT and cryptography are needed (tests/run.sh installs them): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let made: serde_json::Value = serde_json::from_slice(&out.stdout).expect("PyJWT's JSON");
    let idp = JwksServer::start(made["jwks"].to_string()).await;
    let up = upstream().await;
    let gw = start_gateway(&gateway_yaml(&up.url(), &idp.url(), "")).await;
    let c = http1();
    let token = |name: &str| bearer(made[name].as_str().expect("a token"));
    let rs = url(gw.addr, "/rs");
    // One subject, a gold plan (5 a minute), whichever key signed.
    assert_eq!(
        statuses_with(&c, 3, &rs, &token("rs256")).await,
        [200, 200, 200]
    );
    assert_eq!(
        statuses_with(&c, 3, &rs, &token("es256")).await,
        [200, 200, 429]
    );
    let hs = url(gw.addr, "/hs");
    let cookie = format!("session={}", made["hs256"].as_str().expect("a token"));
    assert_eq!(statuses(&c, 1, &hs, &[("cookie", &cookie)]).await, [200]);
    for bad in ["none", "confused"] {
        let r = c.get(&rs, &[("authorization", &token(bad))]).await;
        assert_eq!(r.status, 401, "{bad}");
        assert_eq!(
            r.header("www-authenticate"),
            Some("Bearer error=\"invalid_token\"")
        );
    }
    let m = metrics(gw.admin_addr).await;
    assert_eq!(
        metric(
            &m,
            "sluice_jwt_failures_total{reason=\"algorithm\",route=\"rs\"}"
        ),
        Some(2.0)
    );
    assert_eq!(up.hits(), 6);
}

/// A JWKS file is read again when it changes: a key added to it verifies within
/// the bound, one removed stops verifying.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_file_is_read_again_when_it_changes() {
    let (old, new) = (TestKey::rsa("f1"), TestKey::ec("f2"));
    let dir = tempfile::tempdir().expect("a temp dir");
    let file = dir.path().join("jwks.json");
    std::fs::write(&file, jwks(&[&old])).expect("write the JWKS");
    let up = upstream().await;
    let gw = start_gateway(&format!(
        r#"upstreams:
  app: {{targets: ["{}"], probe: false}}
jwt:
  providers:
    files: {{jwks_file: "{}"}}
routes:
  - name: f
    match: {{path_prefix: /}}
    upstream: app
    jwt: {{provider: files}}
    key: jwt:sub
    limits: [{{algorithm: fixed_window, limit: 100, window: 1m}}]
"#,
        up.url(),
        file.display()
    ))
    .await;
    let c = http1();
    let f = url(gw.addr, "/f");
    let (t_old, t_new) = (
        bearer(&old.token(&claims("a", json!({})))),
        bearer(&new.token(&claims("b", json!({})))),
    );
    assert_eq!(statuses_with(&c, 1, &f, &t_old).await, [200]);
    assert_eq!(statuses_with(&c, 1, &f, &t_new).await, [401]);
    std::fs::write(&file, jwks(&[&new])).expect("rotate the JWKS");
    let within = std::time::Duration::from_secs(3);
    let taken = eventually(within, || async {
        c.get(&f, &[("authorization", &t_new)]).await.status == 200
    })
    .await;
    assert!(
        taken.is_some(),
        "the new key verifies once the file changed"
    );
    assert_eq!(statuses_with(&c, 1, &f, &t_old).await, [401]);
    // (A broken file keeping the last good keys: `jwt::tests`, on a driven read.)
}
